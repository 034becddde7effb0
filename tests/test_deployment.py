"""prefect.yaml as an operator uses it, with production's storage: a real Prefect server, `prefect deploy`, a process
worker and a Ray head; artifacts and Prefect's task results on S3 (a moto server behind a proxy the test can cut).

One deployment run of the tiny pipeline (a few steps per stage) serves most tests here:
- the S3 endpoint goes away for 30 s while SFT's output is being committed;
- the RL job's driver is killed after its first checkpoint, so the run fails; then, as an operator would,
  the test opens the run in headless Chromium and clicks Retry; the worker picks it up, SFT and the reward model
  come back Cached, RL resumes from its checkpoint and the run completes (screenshot saved as a test output);
- the worker's environment holds secret canaries that must appear nowhere the run wrote;
- the evaluation report shows held-out answers by model and its learning curve, which renders in the UI.
Then, with toy stages (tests/fake_stages) for speed, deployments whose gate asks for a person's approval: one run
is approved in the browser, another is rejected when its approval times out; and a run that tries to change a
field only its deployment sets is refused.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import s3fs
import yaml
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Pending, Running, Scheduled

from flows.server_setup import ZOMBIE_AUTOMATION
from infra.artifacts import open_store
from infra.ray_cluster import LocalRayHead, job_client
from infra.settings import PROJECT_ROOT, get_settings
from stages.config import CONFIG_DIR
from pipeline.identity import stage_code_version
from tests.conftest import MOTO_BUCKET
from tests.presets_in_prefect_yaml import regenerated
from tests.faults import KillJobAfterCheckpoint
from pipeline.config import load_pipeline_config
from tests.prefect_stack import POOL, STAGES, PrefectStack, small_tiny_config, stop_process
from tests.tcp_proxy import TcpProxy

OUTAGE_S = 30
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1100")  # fmt: skip


def prefect_yaml() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())


def test_deployment_parameters_are_the_presets():
    """Each deployment's config parameter is its preset verbatim, comments included; after editing a preset,
    `python tests/presets_in_prefect_yaml.py` regenerates prefect.yaml."""
    text = (PROJECT_ROOT / "prefect.yaml").read_text()
    assert text == regenerated(text), "prefect.yaml differs from the presets: run python tests/presets_in_prefect_yaml.py"
    deployments = {d["name"]: d for d in prefect_yaml()["deployments"]}
    assert set(deployments) == {"llama3-8b", "llama3-8b-grpo", "tiny"}
    for name, deployment in deployments.items():
        preset = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        assert deployment["parameters"]["config"] == preset, f"prefect.yaml {name}: differs from configs/{name}.yaml"
        assert deployment["entrypoint"] == "flows/full_rlhf.py:full_rlhf"
        assert deployment["work_pool"]["name"] == POOL
        assert deployment["work_pool"]["job_variables"]["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"


def jobs_by_stage(client) -> dict[str, list[str]]:
    """Statuses of the cluster's stage jobs, oldest attempt first, keyed by stage."""
    jobs: dict[str, list] = {}
    for job in client.list_jobs():
        if job.metadata.get("stage"):
            jobs.setdefault(job.metadata["stage"], []).append(job)
    return {stage: [j.status.value for j in sorted(found, key=lambda j: int(j.metadata["attempt"]))]
            for stage, found in jobs.items()}  # fmt: skip


def chromium():
    """Selenium driving Debian's chromium + chromium-driver (`.ci/run` installs them)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


def click_retry(browser, run_url: str) -> None:
    """What a person does: open the run, click Retry, confirm in the dialog."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(run_url)
    wait = WebDriverWait(browser, 60)
    wait.until(ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Retry']"))).click()
    dialog = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    assert "Retry" in dialog.text
    dialog.find_element(By.XPATH, ".//button[normalize-space()='Retry']").click()
    wait.until(ec.invisibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))


def rendered_images(browser, url: str, path: Path) -> list[tuple[str, int]]:
    """(start of src, natural width) of every image the page at `url` shows once rendered; a screenshot to `path`."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(url)
    WebDriverWait(browser, 60).until(lambda b: b.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']"))
    time.sleep(2)  # let it decode and draw
    browser.save_screenshot(str(path))
    return browser.execute_script("return Array.from(document.images).map(i => [i.src.slice(0, 22), i.naturalWidth])")


def screenshot_completed(browser, run_url: str, path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(run_url)
    WebDriverWait(browser, 60).until(ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "Completed"))
    time.sleep(2)  # let the timeline draw
    browser.save_screenshot(str(path))


def cut_s3_during_commit(proxy: TcpProxy, workspace: Path, record: dict) -> None:
    """Take the S3 endpoint down when SFT's job has written its metrics (its commit follows) for OUTAGE_S."""
    deadline = time.monotonic() + 1200
    while not list(workspace.glob("tiny/sft/*/output/metrics.json")):
        if time.monotonic() > deadline:
            return
        time.sleep(0.2)
    proxy.stop()
    record["down_at"] = time.time()
    time.sleep(OUTAGE_S)
    proxy.start()
    record["up_at"] = time.time()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deployment")
    stack = PrefectStack(tmp)
    try:
        yield stack.up(setup_command=False)  # the automations then come from `prefect deploy`
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def retried_run(stack, moto_s3, tmp_path_factory, test_output_dir):
    tmp = tmp_path_factory.mktemp("retried-run")
    proxy = TcpProxy(("127.0.0.1", int(moto_s3.rsplit(":", 1)[1]))).start()
    prefix = f"s3://{MOTO_BUCKET}/{uuid.uuid4().hex}"
    canaries = {name: f"canary-{name.lower()}-{uuid.uuid4().hex}" for name in
                ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN")}
    s3_env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ENDPOINT_URL_S3": proxy.url, **canaries}
    worker_env = {
        **s3_env,
        "RLHF_ARTIFACT_ROOT": f"{prefix}/artifacts",
        "RLHF_RESULT_STORAGE": f"{prefix}/prefect-results",
        "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
        "RLHF_RAY_AUTH_MODE": "disabled",
        "RLHF_POLL_INTERVAL_S": "1",
        "RLHF_STAGE_DEADLINE_S": "1200",
        "RLHF_MAX_RETRIES": "0",
        # Pinned: an edit of stages/ during the test must not change the stage keys between run and retry.
        "RLHF_CODE_VERSION": stage_code_version(get_settings(), "rl"),
    }
    outage: dict = {}
    head = LocalRayHead(num_cpus=2, auth_mode="disabled")
    with pytest.MonkeyPatch.context() as head_env:
        # The cluster has its own S3 access (the stages read their input models from the store).
        for name, value in {**s3_env, "RLHF_CACHE_DIR": str(tmp / "model-cache")}.items():
            head_env.setenv(name, value)
        head.start()
    try:
        worker, worker_log = stack.start_worker("worker", {**worker_env, "RLHF_RAY_ADDRESS": head.address})
        cutter = threading.Thread(target=cut_s3_during_commit, args=(proxy, tmp / "workspace", outage), daemon=True)
        cutter.start()
        killer = KillJobAfterCheckpoint(tmp / "workspace", "tiny", "rl")
        killer.start()
        run = stack.run_deployment("full-rlhf/tiny", {"config": small_tiny_config()})
        failed = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=1500, logs=worker_log)
        killer.stop()
        stack.wait_for_process_exits(run.id, 1)
        cutter.join(timeout=OUTAGE_S + 5)
        ray = job_client(head.address)
        s3 = s3fs.S3FileSystem(endpoint_url=moto_s3, key="any", secret="any", skip_instance_cache=True)
        after_failure = {
            "state": failed.state,
            "jobs": jobs_by_stage(ray),
            "versions": {stage: len(s3.glob(f"{prefix}/artifacts/tiny/{stage}/v*/MANIFEST.json")) for stage in STAGES},
        }

        run_url = f"{stack.url}/runs/flow-run/{run.id}"
        browser = chromium() if shutil.which("chromium") and shutil.which("chromedriver") else None
        try:
            if browser is not None:
                click_retry(browser, run_url)
            else:  # the request the UI's Retry sends; test_retry_from_the_ui_in_a_browser skips
                with stack.client() as client:
                    client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry", message="Retry from the UI"))
            completed = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=1500, logs=worker_log)
            screenshot = test_output_dir / "ui-retry-completed-run.png"
            with stack.client() as client:
                artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                    like_="tiny-")))  # fmt: skip
            report_images = None
            if browser is not None:
                screenshot_completed(browser, run_url, screenshot)
                report = next(a for a in artifacts if a.key == "tiny-evaluation-report")
                report_images = rendered_images(browser, f"{stack.url}/artifacts/artifact/{report.id}",
                                                test_output_dir / "ui-evaluation-report.png")
        finally:
            if browser is not None:
                browser.quit()
        with stack.client() as client:
            state_history = client.read_flow_run_states(run.id)
            task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run.id])))
        logs = stack.logs(run.id)
        jobs = jobs_by_stage(ray)
        job_infos = [ray.get_job_info(job.submission_id) for job in ray.list_jobs()]
        stop_process(worker)
    finally:
        head.stop()
        proxy.stop()
    yield {
        "tmp": tmp, "prefix": prefix, "canaries": canaries, "run": run, "after_failure": after_failure,
        "retried_in_browser": browser is not None, "completed": completed, "screenshot": screenshot,
        "state_history": state_history, "task_runs": task_runs, "logs": logs, "artifacts": artifacts,
        "jobs": jobs, "job_infos": job_infos, "outage": outage, "worker_log": worker_log,
        "report_images": report_images,
    }  # fmt: skip


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    """The test process reads the run's bucket straight from moto."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)


@pytest.mark.pipeline
def test_retry_from_the_ui_in_a_browser_resumes_the_failed_stage(retried_run):
    if not retried_run["retried_in_browser"]:
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them): retried through the API")
    failure = retried_run["after_failure"]
    assert failure["jobs"] == {"sft": ["SUCCEEDED"], "reward_model": ["SUCCEEDED"], "rl": ["FAILED"]}
    assert failure["versions"] == {"sft": 1, "reward_model": 1, "rl": 0, "evaluate": 0}
    assert "stage rl: job" in failure["state"].message and "failed, exit code" in failure["state"].message

    retry = [s for s in retried_run["state_history"] if s.name == "AwaitingRetry"]
    assert [s.message for s in retry] == ["Retry from the UI"]  # the browser's click, nothing else
    # Finished stages were not run again; RL continued from its checkpoint; the run went on to the end.
    assert retried_run["jobs"] == {"sft": ["SUCCEEDED"], "reward_model": ["SUCCEEDED"], "rl": ["FAILED", "SUCCEEDED"],
                                   "evaluate": ["SUCCEEDED"]}  # fmt: skip
    states = {}
    for task_run in retried_run["task_runs"]:
        states.setdefault(task_run.name, []).append(task_run.state.name)
    assert "Cached" in states["sft"] and "Cached" in states["reward_model"], states
    result = retried_run["completed"].state.result()
    assert result.stages["rl"].metrics["resumed_from_step"] == 1
    assert result.stages["rl"].metrics["steps"] == 2
    assert retried_run["screenshot"].stat().st_size > 10_000


@pytest.mark.pipeline
def test_artifacts_and_task_results_live_on_s3_and_verify(retried_run, s3_env, moto_s3):
    root = f"{retried_run['prefix']}/artifacts"
    store = open_store(root, "tiny")
    assert {stage: store.versions(stage) for stage in (*STAGES, "report")} == {
        stage: [1] for stage in (*STAGES, "report")}  # fmt: skip
    assert {m.stage for m in store.lineage("evaluate")} == set(STAGES)
    for command in (["verify", root, "tiny"], ["list", root, "tiny"], ["gc", root, "--grace-s", "0"]):
        done = subprocess.run([sys.executable, "-m", "infra.artifacts", *command], cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        if command[0] == "verify":
            assert done.stdout.count("ok ") == len(STAGES) + 1 and "FAILED" not in done.stdout
        if command[0] == "list":
            assert all(f"{stage} " in done.stdout for stage in STAGES)
        if command[0] == "gc":
            assert done.stdout == ""  # nothing half-written was left behind
    s3 = s3fs.S3FileSystem(endpoint_url=moto_s3, key="any", secret="any", skip_instance_cache=True)
    results = s3.find(f"{retried_run['prefix']}/prefect-results")
    assert len(results) >= len(STAGES)  # the persisted task results the retry came back Cached from


@pytest.mark.pipeline
def test_s3_outage_during_a_commit_is_waited_out(retried_run, s3_env):
    outage = retried_run["outage"]
    assert outage.get("up_at", 0) - outage.get("down_at", 0) >= OUTAGE_S, outage
    retries = [line for line in retried_run["logs"].splitlines() if line.startswith("artifact store:")]
    assert any("retrying in" in line for line in retries), retried_run["logs"][-3000:]
    store = open_store(f"{retried_run['prefix']}/artifacts", "tiny")
    assert store.versions("sft") == [1] and store.garbage("sft", grace_s=0) == []
    store.verify(store.get("sft", 1))


@pytest.mark.pipeline
def test_progress_and_the_evaluation_report_are_shown_in_the_ui(retried_run, s3_env):
    by_key = {a.key: a for a in retried_run["artifacts"]}
    result = retried_run["completed"].state.result()
    for stage in ("sft", "reward_model", "rl"):
        progress = by_key[f"tiny-{stage.replace('_', '-')}-progress"]
        steps = result.stages[stage].metrics["steps"]
        assert progress.type == "progress" and progress.data == 100.0
        assert progress.description == f"{stage}: {steps}/{steps} steps, finished"

    report = by_key["tiny-evaluation-report"]
    assert report.type == "markdown"
    assert "| metric | policy | reference |" in report.data and "| accuracy |" in report.data
    # What would be promoted beside what it replaces: held-out prompts, each model's answer and reward.
    assert "| prompt | label | candidate | reference |" in report.data and "**(reward " in report.data
    # The curve is in the markdown itself (a link into the store would be dead in the UI), and it renders.
    assert "![learning curve of rl v1](data:image/png;base64," in report.data
    if retried_run["report_images"] is not None:
        assert ["data:image/png;base64,", 700] in retried_run["report_images"], retried_run["report_images"]
    curve = result.report.curve_uri
    assert curve and curve.endswith("/learning_curve.png")
    store = open_store(f"{retried_run['prefix']}/artifacts", "tiny")
    report_version = store.get("report", result.report.version)
    assert store.read_file(report_version, "learning_curve.png").startswith(b"\x89PNG")
    assert report_version.inputs["policy"].digest == result.stages["rl"].digest


@pytest.mark.pipeline
def test_secrets_of_the_worker_appear_nowhere_the_run_wrote(retried_run, stack, moto_s3):
    s3 = s3fs.S3FileSystem(endpoint_url=moto_s3, key="any", secret="any", skip_instance_cache=True)
    written = {path: s3.cat_file(path) for path in s3.find(retried_run["prefix"])}
    for path in [*stack.database.parent.glob("prefect.db*"), *retried_run["tmp"].rglob("*"), retried_run["worker_log"]]:
        if path.is_file():
            written[str(path)] = path.read_bytes()
    written.update({f"ray job {job.submission_id}": repr((job.entrypoint, job.metadata, job.runtime_env)).encode()
                    for job in retried_run["job_infos"]})  # fmt: skip
    assert any(path.endswith("MANIFEST.json") for path in written) and str(stack.database) in written
    leaks = [(where, name) for where, data in written.items() for name, value in retried_run["canaries"].items()
             if value.encode() in data]  # fmt: skip
    assert leaks == []


def test_deploy_created_the_crash_automation(stack):
    with stack.client() as client:
        (zombie,) = client.read_automations_by_name(ZOMBIE_AUTOMATION)
    trigger = zombie.trigger
    assert zombie.enabled and trigger.posture == "Proactive"
    assert trigger.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.Completed" in trigger.expect
    assert trigger.within.total_seconds() == get_settings().zombie_after_s
    assert zombie.actions[0].type == "change-flow-run-state" and zombie.actions[0].state == StateType.CRASHED


def test_nightly_runs_at_0100_utc_and_a_second_concurrent_run_is_cancelled(stack):
    with stack.client() as client:
        deployment = client.read_deployment_by_name("full-rlhf/llama3-8b")
        (schedule,) = deployment.schedules
        assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 1 * * *", "UTC")
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "CANCEL_NEW"

        # The first run is moved to Running as a worker would (no worker runs in this module outside the
        # retried_run fixture, so nothing else picks these up); the second then tries to start.
        first = client.create_flow_run_from_deployment(deployment.id, state=Scheduled())
        second = client.create_flow_run_from_deployment(deployment.id, state=Scheduled())
        try:
            assert client.set_flow_run_state(first.id, Pending()).state.type == StateType.PENDING
            assert client.set_flow_run_state(first.id, Running()).state.type == StateType.RUNNING
            client.set_flow_run_state(second.id, Pending())
            assert client.read_flow_run(second.id).state_type == StateType.CANCELLED
        finally:
            for run in (first, second):
                client.set_flow_run_state(run.id, Cancelled(), force=True)


# ---------------------------------------------------------------------------------------------- a person's approval

APPROVAL_TIMEOUT_S = 20


def approval_deployments(tmp: Path) -> Path:
    """A prefect.yaml of two deployments of the tiny preset whose gate asks for approval: one that waits long, one
    that rejects after APPROVAL_TIMEOUT_S (its RL learning rate differs, so that it has a candidate of its own)."""
    (tiny,) = [d for d in prefect_yaml()["deployments"] if d["name"] == "tiny"]
    deployments = []
    for name, timeout_s, learning_rate in (("tiny-approval", 900, 3e-4), ("tiny-approval-timeout", APPROVAL_TIMEOUT_S,
                                                                           4e-4)):  # fmt: skip
        config = yaml.safe_load((CONFIG_DIR / "tiny.yaml").read_text())
        config["gate"].update(require_approval=True, approval_timeout_s=timeout_s)
        config["rl"]["actor_learning_rate"] = learning_rate
        config["tiny_assets_dir"] = str(tmp / "tiny-assets")
        deployments.append({**tiny, "name": name, "parameters": {"config": config}})
    path = tmp / "prefect.yaml"
    path.write_text(yaml.safe_dump({"name": "rlhf-flow-approvals", "prefect-version": prefect_yaml()["prefect-version"],
                                    "deployments": deployments}))
    return path


def approve_in_browser(browser, run_url: str, comment: str) -> str:
    """What a person does: open the paused run, click Resume, switch Approve on, write why, submit; returns the
    form's text (what they read before approving)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(run_url)
    wait = WebDriverWait(browser, 60)
    wait.until(ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Resume']"))).click()
    form = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    text = form.text
    form.find_element(By.CSS_SELECTOR, "[role='switch']").click()
    form.find_element(By.CSS_SELECTOR, "textarea").send_keys(comment)
    form.find_element(By.XPATH, ".//button[normalize-space()='Submit']").click()
    wait.until(ec.invisibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    return text


@pytest.fixture(scope="module")
def approval_runs(stack, tmp_path_factory, test_output_dir):
    """With toy stages: a run approved in the browser, a run whose approval times out, a run that changes fields
    only its deployment sets."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    tmp = tmp_path_factory.mktemp("approvals")
    stack.cli("--no-prompt", "deploy", "--all", "--prefect-file", str(approval_deployments(tmp)))
    record: dict = {"root": tmp / "artifacts"}
    with LocalRayHead(num_cpus=2, auth_mode="disabled") as head:
        worker, worker_log = stack.start_worker("toy-worker", {
            "RLHF_STAGE_MODULE_PREFIX": "tests.fake_stages", "RLHF_RAY_ADDRESS": head.address,
            "RLHF_RAY_AUTH_MODE": "disabled", "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
            "RLHF_ARTIFACT_ROOT": str(record["root"]), "RLHF_RESULT_STORAGE": str(tmp / "results"),
            "RLHF_POLL_INTERVAL_S": "0.5", "RLHF_MAX_RETRIES": "0"})  # fmt: skip
        browser = chromium()
        try:
            run = stack.run_deployment("full-rlhf/tiny-approval", {})
            stack.wait_for(run.id, {StateType.PAUSED}, timeout_s=600, logs=worker_log)
            run_url = f"{stack.url}/runs/flow-run/{run.id}"
            record["form"] = approve_in_browser(browser, run_url, "held-out answers look right")
            record["approved"] = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=300, logs=worker_log)
            screenshot_completed(browser, run_url, test_output_dir / "ui-approved-run.png")

            run = stack.run_deployment("full-rlhf/tiny-approval-timeout", {})
            record["timed_out"] = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=600, logs=worker_log)

            forbidden = load_pipeline_config("tiny", {"gate": {"min_accuracy_gain": -1.0},
                                                      "evaluate": {"remote_rm_url": "http://203.0.113.9/collect"}})
            run = stack.run_deployment("full-rlhf/tiny", {"config": forbidden.model_dump(mode="json",
                                                                                           exclude_unset=True)})
            record["refused"] = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=300, logs=worker_log)
            with stack.client() as client:
                record["states"] = {name: [s.name for s in client.read_flow_run_states(record[name].id)]
                                    for name in ("approved", "timed_out")}  # fmt: skip
        finally:
            browser.quit()
            stop_process(worker)
    yield record


def test_a_paused_night_is_approved_in_the_browser_and_promoted(approval_runs):
    decision = approval_runs["approved"].state.result().promotion
    assert "Paused" in approval_runs["states"]["approved"]
    assert "Approve rl v1 for production?" in approval_runs["form"] and "evaluation report" in approval_runs["form"]
    assert decision.promoted and decision.approval == "approved: held-out answers look right"
    assert open_store(str(approval_runs["root"]), "tiny").get("rl", "production").version == decision.version == 1


def test_a_night_nobody_approves_is_rejected_when_its_approval_times_out(approval_runs):
    decision = approval_runs["timed_out"].state.result().promotion
    assert "Paused" in approval_runs["states"]["timed_out"]
    assert not decision.promoted and decision.version == 2 and decision.production_version == 1
    assert decision.approval == f"no approval within {APPROVAL_TIMEOUT_S} s: rejected"
    assert decision.reasons[0] == f"FAIL {decision.approval}"
    assert open_store(str(approval_runs["root"]), "tiny").get("rl", "production").version == 1


def test_a_deployment_run_may_not_change_what_only_its_deployment_sets(approval_runs):
    message = approval_runs["refused"].state.message
    assert "changes gate.min_accuracy_gain, evaluate.remote_rm_url: only the deployment sets them" in message, message
    assert "a run may set " in message and "max_samples" in message
