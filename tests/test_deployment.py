"""prefect.yaml as an operator uses it, with production's storage and real crashes: a Prefect server, `prefect
deploy`, process workers, the embedded Ray head a flow run starts itself, artifacts and Prefect's task results on
S3 (a moto server behind a proxy the test can cut).

One deployment run of the tiny pipeline (a few steps per stage) serves most tests here. In that run, in order:
- SFT: one of its rank actors is killed with SIGKILL after the first checkpoint. The job fails, the task retries,
  SFT resumes from the checkpoint and its losses continue; then the S3 endpoint goes away for 30 s while SFT's
  output is being committed, and the commit waits it out.
- Reward model: the Prefect worker and its flow process are killed with SIGKILL while the job runs (the Ray head,
  in its own session, lives on and finishes the job). A new worker starts; the heartbeat automation marks the
  run Crashed; the test opens the run in headless Chromium and clicks Retry, as an operator would; the retry
  adopts the recorded head and re-attaches to the job instead of submitting it again; its output is committed once.
- RL: the Ray head is killed with SIGKILL after RL's first checkpoint. The run fails with an error naming the
  cluster; `prefect flow-run retry` puts it back; a new head starts, RL resumes from its checkpoint, and the run
  completes (screenshot saved as a test output).
Meanwhile every listening socket of every process of the run (server, workers, flow, Ray, ranks, vLLM) is recorded:
none may listen beyond loopback; and the worker's environment holds secret canaries that must appear nowhere the
run wrote.
- The evaluation report shows held-out answers by model and its learning curve, which renders in
  the UI.
Then, with toy stages (tests/fake_stages) for speed, deployments whose gate asks for a person's
approval: one run is approved in the browser, another is rejected when its approval times out; and a
run that tries to change a field only its deployment sets is refused.
"""

from __future__ import annotations

import ipaddress
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psutil
import pytest
import s3fs
import yaml
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import StateType
from prefect.states import Cancelled, Paused, Pending, Running, Scheduled

from flows.server_setup import AUTO_RETRY_MESSAGE, RETRY_AUTOMATION_PREFIX, ZOMBIE_AUTOMATION
from infra.artifacts import open_store
from infra.ray_cluster import HEAD_RECORD, LocalRayHead, job_client, read_head_record
from infra.settings import PROJECT_ROOT, get_settings
from pipeline.identity import stage_code_version
from pipeline.config import load_pipeline_config
from stages.config import CONFIG_DIR
from tests.conftest import MOTO_BUCKET
from tests.prefect_stack import NIGHTLY, POOL, STAGES, PrefectStack, small_tiny_config, stop_process
from tests.presets_in_prefect_yaml import regenerated
from tests.tcp_proxy import TcpProxy

# Operates deployments on a Prefect server, a worker, Ray and a browser: the full suite's tier.
pytestmark = pytest.mark.slow

OUTAGE_S = 30
AUDIT_MARKER = "RLHF_TEST_RUN_MARKER"  # every process of the run inherits it; the socket audit looks for it
ZOMBIE_AFTER_S = 45  # heartbeats come every 30 s (prefect.yaml); the minimum Prefect allows
# --disable-dev-shm-usage: a container's /dev/shm is often 64 MiB, and Ray's object store shares it; a page that
# cannot map its memory there crashes and never draws.
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                  "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1100")  # fmt: skip


def prefect_yaml() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())


def test_deployment_parameters_are_the_presets():
    """Each deployment's config parameter is its preset verbatim, comments included; after editing a preset,
    `python tests/presets_in_prefect_yaml.py` regenerates prefect.yaml."""
    text = (PROJECT_ROOT / "prefect.yaml").read_text()
    assert text == regenerated(text), "prefect.yaml differs from the presets: run python tests/presets_in_prefect_yaml.py"
    deployments = {d["name"]: d for d in prefect_yaml()["deployments"]}
    assert set(deployments) == {"llama3-8b", "llama3-8b-grpo", "tiny", "tiny-agent"}
    for name, deployment in deployments.items():
        preset = yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())
        assert deployment["parameters"]["config"] == preset, f"prefect.yaml {name}: differs from configs/{name}.yaml"
        assert deployment["entrypoint"] == "flows/full_rlhf.py:full_rlhf"
        assert deployment["work_pool"]["name"] == POOL
        assert "job_variables" not in deployment["work_pool"]  # the pool's template fixes them (flows/server_setup.py)


class SocketAudit(threading.Thread):
    """Records, every second, the listening sockets of the processes whose environment carries the marker."""

    def __init__(self, marker: str):
        super().__init__(daemon=True)
        self.marker = marker
        self.seen: dict[tuple[str, str, int], str] = {}  # (kind, ip, port) -> process
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(1.0):
            self.sample()

    def sample(self) -> None:
        for conn in psutil.net_connections("inet"):
            listening = conn.status == psutil.CONN_LISTEN or (conn.type == 2 and not conn.raddr)  # TCP, or UDP bound
            if not listening or conn.pid is None or not conn.laddr:
                continue
            try:
                process = psutil.Process(conn.pid)
                if process.environ().get(AUDIT_MARKER) != self.marker:
                    continue
                name = " ".join(process.cmdline())[:120]
            except psutil.Error:
                continue
            kind = "tcp" if conn.status == psutil.CONN_LISTEN else "udp"
            self.seen[(kind, conn.laddr.ip, conn.laddr.port)] = name

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=10)


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def marked_processes(marker: str) -> list[psutil.Process]:
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(AUDIT_MARKER) == marker:
                found.append(process)
        except psutil.Error:
            continue
    return found


def command_of(process: psutil.Process) -> str:
    """The process's command line; "" once it has exited or is a zombie no one reaps."""
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def wait_for_no_ray_processes(marker: str, timeout_s: float = 30) -> list[str]:
    """Ray processes of the run still alive after `timeout_s` (a stopped head's workers exit within seconds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for process in marked_processes(marker):
            command = command_of(process)
            if "gcs_server" in command or "raylet" in command or command.startswith("ray::"):
                left.append(command[:100])
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def wait_until(condition, what: str, timeout_s: float, interval_s: float = 0.05):
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)
    return value


def checkpoint_step(workspace: Path, stage: str) -> int:
    steps = [json.loads(p.read_text())["step"] for p in workspace.glob(f"tiny/{stage}/*/ckpt/latest_step.json")]
    return max(steps, default=0)


def jobs_of(address: str) -> dict[str, list[str]]:
    jobs: dict[str, list] = {}
    for job in job_client(address).list_jobs():
        jobs.setdefault(job.metadata.get("stage", "?"), []).append(job)
    return {stage: [j.status.value for j in sorted(found, key=lambda j: int(j.metadata["attempt"]))]
            for stage, found in jobs.items()}  # fmt: skip


def process_tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def kill(victims: list[psutil.Process]) -> None:
    for process in victims:
        try:
            process.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(victims, timeout=10)


def kill_worker_and_flow(worker_pid: int, head_pid: int) -> list[int]:
    """SIGKILL the worker and its flow process, not the Ray head the flow started (with its jobs) below them.

    The head's tree is read after the worker's: a process the head starts in between (a rank actor of the job that
    has just begun) is then in both and spared, where the other order would have killed it with the worker."""
    tree = process_tree(worker_pid)
    ray = {p.pid for p in process_tree(head_pid)}
    victims = [p for p in tree if p.pid not in ray]
    kill(victims)
    return [p.pid for p in victims]


def kill_ray_head(head_pid: int) -> None:
    """The head node lost at once: the `ray start` process and every process under it (GCS, raylet, dashboard,
    workers, rank actors, job drivers), SIGKILL."""
    kill(process_tree(head_pid))


def chromium():
    """Selenium driving Debian's chromium + chromium-driver (`.ci/run` installs them)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={tempfile.mkdtemp(prefix='chromium-')}"):
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))


PAGE_WAIT_S = 120  # a run page takes 5-10 s here, 30 s with the cores busy; more on a slower, loaded machine
PAGE_LOADS = 3


def open_page(browser, url: str, condition, what: str):
    """Open `url` and wait for `condition` (what a person waits to see), loading the page again when it does not
    show within PAGE_WAIT_S (a request the UI lost on a loaded machine); returns what the condition returns. Gives
    up naming what it waited for and what the page showed instead."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    for load in range(PAGE_LOADS):
        try:
            browser.get(url) if load == 0 else browser.refresh()
            return WebDriverWait(browser, PAGE_WAIT_S).until(condition)
        except TimeoutException:
            pass
    shown = " ".join(browser.find_element(By.TAG_NAME, "body").text.split())
    raise AssertionError(f"{what} not shown at {url} in {PAGE_LOADS} loads of {PAGE_WAIT_S} s; the page shows: "
                         f"{shown[:400]!r}")


def click_retry(browser, run_url: str) -> None:
    """What a person does: open the run, click Retry, confirm in the dialog."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, run_url, ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Retry']")),
              "the Retry button").click()
    wait = WebDriverWait(browser, PAGE_WAIT_S)
    dialog = wait.until(ec.visibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    assert "Retry" in dialog.text
    dialog.find_element(By.XPATH, ".//button[normalize-space()='Retry']").click()
    wait.until(ec.invisibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    leave_page(browser)


def leave_page(browser) -> None:
    """A blank page until the next look: an open Prefect UI polls and redraws, a core's fifth for as long as it is
    shown, which the training runs of the suite need."""
    browser.get("about:blank")


def rendered_images(browser, url: str, path: Path) -> list[tuple[str, int]]:
    """(start of src, natural width) of every image the page at `url` shows once rendered; a screenshot to `path`."""
    from selenium.webdriver.common.by import By

    open_page(browser, url, lambda b: b.find_elements(By.CSS_SELECTOR, "img[src^='data:image/png']"),
              "an image of the report")
    time.sleep(2)  # let it decode and draw
    browser.save_screenshot(str(path))
    return browser.execute_script("return Array.from(document.images).map(i => [i.src.slice(0, 22), i.naturalWidth])")


def screenshot_completed(browser, run_url: str, path: Path) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec

    open_page(browser, run_url, ec.text_to_be_present_in_element((By.TAG_NAME, "body"), "Completed"),
              "the Completed state")
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
    """The server as an operator sets it up: the work pool made by hand, `prefect deploy` (whose build step creates
    the crash automation), then README's setup command with the nightly's automatic retry."""
    tmp = tmp_path_factory.mktemp("deployment")
    marker = uuid.uuid4().hex
    stack = PrefectStack(tmp, env={AUDIT_MARKER: marker, "RLHF_ZOMBIE_AFTER_S": str(ZOMBIE_AFTER_S)})
    try:
        stack.up(setup_command=False)
        with stack.client() as client:
            stack.automations_after_deploy = {automation.name: automation for automation in client.read_automations()}
        done = subprocess.run([sys.executable, "-m", "flows.server_setup", "--retry-crashed", NIGHTLY],
                              cwd=PROJECT_ROOT, env=stack.env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0 and "automation" in done.stdout, done.stdout + done.stderr
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def operated_run(stack, moto_s3, tmp_path_factory, test_output_dir):
    tmp = tmp_path_factory.mktemp("operated-run")
    marker = stack.env[AUDIT_MARKER]
    workspace = tmp / "workspace"
    proxy = TcpProxy(("127.0.0.1", int(moto_s3.rsplit(":", 1)[1]))).start()
    prefix = f"s3://{MOTO_BUCKET}/{uuid.uuid4().hex}"
    canaries = {name: f"canary-{name.lower()}-{uuid.uuid4().hex}" for name in
                ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "WANDB_API_KEY", "RAY_AUTH_TOKEN")}
    worker_env = {
        "AWS_ENDPOINT_URL": proxy.url, "AWS_ENDPOINT_URL_S3": proxy.url, **canaries,
        "RLHF_ARTIFACT_ROOT": f"{prefix}/artifacts",
        "RLHF_RESULT_STORAGE": f"{prefix}/prefect-results",
        "RLHF_WORKSPACE_ROOT": str(workspace),
        "RLHF_RAY_NUM_CPUS": "2",
        "RLHF_MAX_RETRIES": "1",
        "RLHF_RETRY_DELAY_S": "0",
        "RLHF_POLL_INTERVAL_S": "1",
        "RLHF_STAGE_DEADLINE_S": "1200",
        # Pinned: an edit of stages/ during the test must not change the stage keys between run and retries.
        "RLHF_CODE_VERSION": stage_code_version(get_settings(), "rl"),
        "RLHF_CACHE_DIR": str(tmp / "model-cache"),  # the stages read their input models from the store
    }
    audit = SocketAudit(marker)
    audit.start()
    record: dict = {"tmp": tmp, "prefix": prefix, "canaries": canaries, "workspace": workspace, "outage": {}}
    browser = chromium() if shutil.which("chromium") and shutil.which("chromedriver") else None
    record["retried_in_browser"] = browser is not None
    workers = []
    try:
        worker, worker_log = stack.start_worker("worker-1", worker_env)
        workers.append(worker)
        cutter = threading.Thread(target=cut_s3_during_commit, args=(proxy, workspace, record["outage"]), daemon=True)
        cutter.start()
        config = small_tiny_config(
            sft={"max_samples": 1280, "save_steps": 5, "logging_steps": 5},  # 40 steps: time to kill a rank
            reward_model={"max_samples": 256, "save_steps": 2},
            rl={"rollout_backend": "vllm"},  # the audit covers vLLM's sockets too
        )
        run = stack.run_deployment("full-rlhf/tiny", {"config": config})
        record["run"] = run

        # SFT: kill a rank actor after the first checkpoint.
        wait_until(lambda: checkpoint_step(workspace, "sft") >= 5, "SFT's first checkpoint", 900)
        ranks = [p for p in marked_processes(marker) if command_of(p).startswith("ray::SFTWorker")]
        assert ranks, "no SFT rank actor found"
        ranks[-1].send_signal(signal.SIGKILL)
        record["rank_killed_after_step"] = checkpoint_step(workspace, "sft")

        # Reward model: kill the worker and its flow process while the job runs; start another worker.
        head = wait_until(lambda: read_head_record(workspace), "the embedded head's record", 60)
        record["first_head"] = head
        wait_until(lambda: jobs_of(head.address).get("reward_model") == ["RUNNING"], "the reward model job", 900, 0.5)
        cutter.join(timeout=OUTAGE_S + 5)
        record["killed"] = kill_worker_and_flow(worker.pid, head.pid)
        record["killed_at"] = time.monotonic()
        worker, worker_log = stack.start_worker("worker-2", worker_env)
        workers.append(worker)
        crashed = stack.wait_for(run.id, {StateType.CRASHED}, timeout_s=ZOMBIE_AFTER_S + 120, logs=worker_log)
        record["crash_detected_after_s"] = time.monotonic() - record["killed_at"]
        record["crashed"] = crashed.state
        record["jobs_when_crashed"] = jobs_of(head.address)
        record["sft_failure"] = next(job for job in job_client(head.address).list_jobs()
                                     if job.metadata.get("stage") == "sft" and job.status.value == "FAILED")
        run_url = f"{stack.url}/runs/flow-run/{run.id}"
        if browser is not None:  # the operator's Retry
            click_retry(browser, run_url)
        else:  # the request the UI's Retry sends; test_retry_from_the_ui_in_a_browser skips
            with stack.client() as client:
                client.set_flow_run_state(run.id, Scheduled(name="AwaitingRetry", message="Retry from the UI"))

        # RL: kill the Ray head after RL's first checkpoint.
        wait_until(lambda: checkpoint_step(workspace, "rl") >= 1, "RL's first checkpoint", 900, 0.2)
        adopted = read_head_record(workspace)
        record["adopted_head"] = adopted
        record["jobs_before_head_kill"] = jobs_of(adopted.address)
        client = job_client(adopted.address)
        record["job_infos"] = [client.get_job_info(job.submission_id) for job in client.list_jobs()]
        kill_ray_head(adopted.pid)
        failed = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=600, logs=worker_log)
        record["failed"] = failed.state
        record["record_after_failure"] = (workspace / HEAD_RECORD).exists()
        stack.wait_for_process_exits(run.id, 1)  # the first process was killed: the worker saw only this one
        stack.cli("flow-run", "retry", str(run.id))  # README's retry from the command line

        completed = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=1200, logs=worker_log)
        record["completed"] = completed
        record["result"] = stack.result(completed)
        record["screenshot"] = test_output_dir / "ui-retry-completed-run.png"
        if browser is not None:
            screenshot_completed(browser, run_url, record["screenshot"])
        with stack.client() as client:
            record["states"] = client.read_flow_run_states(run.id)
            record["automations"] = {automation.name for automation in client.read_automations()}
            record["task_runs"] = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(
                any_=[run.id])))  # fmt: skip
            record["artifacts"] = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
                like_="tiny-")))  # fmt: skip
        record["report_images"] = None
        if browser is not None:
            report = next(a for a in record["artifacts"] if a.key == "tiny-evaluation-report")
            record["report_images"] = rendered_images(browser, f"{stack.url}/artifacts/artifact/{report.id}",
                                                      test_output_dir / "ui-evaluation-report.png")
        record["logs"] = stack.logs(run.id)
        record["worker_log"] = worker_log
        record["leftover_ray"] = wait_for_no_ray_processes(marker)
        record["record_at_end"] = (workspace / HEAD_RECORD).exists()
    finally:
        if browser is not None:
            browser.quit()
        audit.stop()
        for worker in workers:
            stop_process(worker)
        proxy.stop()
        # Whatever a failure left behind: the heads of the run and their processes.
        # command_of: a process listed may have exited since, or be a zombie nobody reaps (killed with its parent);
        # the clean-up must never hide the failure that brought the test here.
        for process in marked_processes(marker):
            if "prefect server" in command_of(process):
                continue
            try:
                process.send_signal(signal.SIGKILL)
            except psutil.Error:
                pass
    record["sockets"] = audit.seen
    yield record


@pytest.fixture
def s3_env(moto_s3, monkeypatch):
    """The test process reads the run's bucket straight from moto."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_s3)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_s3)


def store_of(run: dict):
    return open_store(f"{run['prefix']}/artifacts", "tiny")


@pytest.mark.pipeline
def test_rank_killed_mid_stage_the_task_retries_and_training_continues(operated_run, s3_env):
    assert operated_run["jobs_when_crashed"]["sft"] == ["FAILED", "SUCCEEDED"]
    sft = operated_run["result"].stages["sft"]
    assert sft.metrics["resumed_from_step"] >= 5 and sft.metrics["steps"] == 40
    store = store_of(operated_run)
    history = json.loads(store.read_file(store.get("sft", sft.version), "history.json"))
    assert [record["step"] for record in history] == list(range(1, 41))  # no step lost or repeated
    losses = [record["loss"] for record in history]
    assert all(math.isfinite(loss) for loss in losses)
    # The first step after the resume continues from where the checkpoint left off (a restart from the base
    # model would be back near the first loss), and training goes on improving.
    resumed = sft.metrics["resumed_from_step"]
    assert losses[resumed] < 1.25 * losses[resumed - 1] and losses[resumed] < 0.8 * losses[0], losses
    assert sum(losses[-10:]) < sum(losses[:10])
    failure = operated_run["sft_failure"]
    assert failure.driver_exit_code == 1, failure.message  # a crash of the stage, reported as one


@pytest.mark.pipeline
def test_s3_outage_during_a_commit_is_waited_out(operated_run, s3_env):
    outage = operated_run["outage"]
    assert outage.get("up_at", 0) - outage.get("down_at", 0) >= OUTAGE_S, outage
    retries = [line for line in operated_run["logs"].splitlines() if line.startswith("artifact store:")]
    assert any("retrying in" in line for line in retries), operated_run["logs"][-3000:]
    store = store_of(operated_run)
    assert store.versions("sft") == [1] and store.garbage("sft", grace_s=0) == []
    store.verify(store.get("sft", 1))


@pytest.mark.pipeline
def test_lost_worker_the_run_is_marked_crashed_and_its_job_reattached_once(operated_run, s3_env):
    crashed = operated_run["crashed"]
    assert crashed.type == StateType.CRASHED and "No heartbeat" in crashed.message
    assert operated_run["crash_detected_after_s"] < ZOMBIE_AFTER_S + 60
    # The setup's automatic retry is for the nightly deployment only: this tiny run was retried by hand alone.
    assert operated_run["automations"] == {ZOMBIE_AUTOMATION, RETRY_AUTOMATION_PREFIX + "llama3-8b"}
    assert not [s for s in operated_run["states"] if s.message == AUTO_RETRY_MESSAGE]
    # The orphaned job went on running on the head the killed flow had started, and only that one job exists.
    assert operated_run["jobs_when_crashed"]["reward_model"] in (["RUNNING"], ["SUCCEEDED"])
    assert operated_run["jobs_before_head_kill"]["reward_model"] == ["SUCCEEDED"]
    first, adopted = operated_run["first_head"], operated_run["adopted_head"]
    assert (adopted.address, adopted.pid) == (first.address, first.pid)  # adopted, not a second head
    assert f"adopting the local Ray head at {first.address}" in operated_run["logs"]
    assert store_of(operated_run).versions("reward_model") == [1]  # committed once


@pytest.mark.pipeline
def test_retry_from_the_ui_in_a_browser_resumes_the_crashed_run(operated_run):
    if not operated_run["retried_in_browser"]:
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them): retried through the API")
    retries = [s for s in operated_run["states"] if s.name == "AwaitingRetry"]
    assert [s.message for s in retries] == ["Retry from the UI"]  # the browser's click, nothing else
    states: dict[str, list[str]] = {}
    for task_run in operated_run["task_runs"]:
        states.setdefault(task_run.name, []).append(task_run.state.name)
    # The retries skipped what had finished: SFT after the crash, SFT and the reward model after the failure.
    assert "Cached" in states["sft"] and "Cached" in states["reward_model"], states
    assert operated_run["screenshot"].stat().st_size > 10_000


@pytest.mark.pipeline
def test_ray_head_killed_a_clear_failure_then_the_cli_retry_resumes(operated_run, s3_env):
    failed = operated_run["failed"]
    address = operated_run["adopted_head"].address
    assert failed.type == StateType.FAILED and f"Ray cluster at {address}" in failed.message, failed.message
    assert not operated_run["record_after_failure"]  # the failed flow cleared the dead head's record
    assert [s.message for s in operated_run["states"] if s.message == "Retried via CLI"] == ["Retried via CLI"]
    rl = operated_run["result"].stages["rl"]
    assert rl.metrics["resumed_from_step"] == 1 and rl.metrics["steps"] == 2
    store = store_of(operated_run)
    assert {stage: store.versions(stage) for stage in (*STAGES, "report")} == {
        stage: [1] for stage in (*STAGES, "report")}  # fmt: skip
    # The last flow stopped its head: no Ray process of the run is left, and no record of one.
    assert operated_run["leftover_ray"] == [] and not operated_run["record_at_end"]


@pytest.mark.pipeline
def test_every_socket_of_the_run_listens_on_loopback_only(operated_run):
    sockets = operated_run["sockets"]
    programs = " ".join(sockets.values())
    for part in ("prefect", "gcs_server", "raylet", "ray::SFTWorker", "ray::RankHost", "ray::VLLMEngine"):
        assert part in programs, f"the audit saw nothing of {part}: {sorted(set(sockets.values()))}"
    exposed = {key: program for key, program in sockets.items() if not is_loopback(key[1])}
    assert exposed == {}


@pytest.mark.pipeline
def test_artifacts_and_task_results_live_on_s3_and_verify(operated_run, s3_env, moto_s3):
    root = f"{operated_run['prefix']}/artifacts"
    store = store_of(operated_run)
    assert {m.stage for m in store.lineage("evaluate")} == set(STAGES)
    # gc with no grace at all, which an operator must ask for (the run is over: no upload is live).
    no_grace = {**os.environ, "RLHF_MIN_STAGING_GRACE_S": "0"}
    for command in (["verify", root, "tiny"], ["list", root, "tiny"], ["gc", root, "--grace-s", "0"]):
        done = subprocess.run([sys.executable, "-m", "infra.artifacts", *command], cwd=PROJECT_ROOT,
                              capture_output=True, text=True, timeout=120, env=no_grace)  # fmt: skip
        assert done.returncode == 0, done.stderr
        if command[0] == "verify":
            assert done.stdout.count("ok ") == len(STAGES) + 1 and "FAILED" not in done.stdout
        if command[0] == "list":
            assert all(f"{stage} " in done.stdout for stage in STAGES)
        if command[0] == "gc":
            assert done.stdout == ""  # nothing half-written was left behind
    s3 = s3fs.S3FileSystem(endpoint_url=moto_s3, key="any", secret="any", skip_instance_cache=True)
    results = s3.find(f"{operated_run['prefix']}/prefect-results")
    assert len(results) >= len(STAGES)  # the persisted task results the retries came back Cached from


@pytest.mark.pipeline
def test_progress_and_the_evaluation_report_are_shown_in_the_ui(operated_run, s3_env):
    by_key = {a.key: a for a in sorted(operated_run["artifacts"], key=lambda a: a.created)}  # the newest of each key
    result = operated_run["result"]
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
    if operated_run["report_images"] is not None:
        assert ["data:image/png;base64,", 700] in operated_run["report_images"], operated_run["report_images"]
    curve = result.report.curve_uri
    assert curve and curve.endswith("/learning_curve.png")
    store = store_of(operated_run)
    report_version = store.get("report", result.report.version)
    assert store.read_file(report_version, "learning_curve.png").startswith(b"\x89PNG")
    assert report_version.inputs["policy"].digest == result.stages["rl"].digest


@pytest.mark.pipeline
def test_secrets_of_the_worker_appear_nowhere_the_run_wrote(operated_run, stack, moto_s3):
    s3 = s3fs.S3FileSystem(endpoint_url=moto_s3, key="any", secret="any", skip_instance_cache=True)
    written = {path: s3.cat_file(path) for path in s3.find(operated_run["prefix"])}
    for path in [*stack.database.parent.glob("prefect.db*"), *operated_run["tmp"].rglob("*"),
                 operated_run["worker_log"]]:  # fmt: skip
        if path.is_file():
            written[str(path)] = path.read_bytes()
    written.update({f"ray job {job.submission_id}": repr((job.entrypoint, job.metadata, job.runtime_env)).encode()
                    for job in operated_run["job_infos"]})  # fmt: skip
    assert any(path.endswith("MANIFEST.json") for path in written) and str(stack.database) in written
    leaks = [(where, name) for where, data in written.items() for name, value in operated_run["canaries"].items()
             if value.encode() in data]  # fmt: skip
    assert leaks == []


def test_deploy_created_the_crash_automation(stack):
    zombie = stack.automations_after_deploy[ZOMBIE_AUTOMATION]
    trigger = zombie.trigger
    assert zombie.enabled and trigger.posture == "Proactive"
    assert trigger.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.Completed" in trigger.expect
    assert trigger.within.total_seconds() == ZOMBIE_AFTER_S
    assert zombie.actions[0].type == "change-flow-run-state" and zombie.actions[0].state == StateType.CRASHED


def test_nightly_runs_at_0100_utc_and_a_second_concurrent_run_is_cancelled(stack):
    with stack.client() as client:
        deployment = client.read_deployment_by_name("full-rlhf/llama3-8b")
        (schedule,) = deployment.schedules
        assert (schedule.schedule.cron, schedule.schedule.timezone) == ("0 1 * * *", "UTC")
        assert deployment.global_concurrency_limit.limit == 1
        assert deployment.concurrency_options.collision_strategy == "CANCEL_NEW"

        # The first run is moved to Running as a worker would (no worker runs in this module outside the
        # operated_run fixture, so nothing else picks these up); the second then tries to start.
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
    deployments.append(tiny)  # its worker runs tiny too (RLHF_DEPLOYMENTS_FILE names this file)
    path = tmp / "prefect.yaml"
    path.write_text(yaml.safe_dump({"name": "rlhf-flow-approvals", "prefect-version": prefect_yaml()["prefect-version"],
                                    "deployments": deployments}))
    return path


def approve_in_browser(browser, run_url: str, comment: str) -> str:
    """What a person does: open the paused run, click Resume, switch Approve on, write why, submit; returns the
    form's text (what they read before approving)."""
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    open_page(browser, run_url, ec.element_to_be_clickable((By.XPATH, "//button[normalize-space()='Resume']")),
              "the Resume button").click()
    # The dialog shows before its form is drawn, and the form is drawn again as the run's input schema arrives: every
    # step finds its element afresh and checks what it did, as a person looks at the form before going on.
    redrawn = (NoSuchElementException, StaleElementReferenceException)
    wait = WebDriverWait(browser, PAGE_WAIT_S, ignored_exceptions=redrawn)

    def in_form(css: str):
        return browser.find_element(By.CSS_SELECTOR, f".p-modal {css}")

    def switched_on(_browser) -> bool:
        switch = in_form("[role='switch']")
        if switch.get_attribute("aria-checked") != "true":
            switch.click()
        return in_form("[role='switch']").get_attribute("aria-checked") == "true"

    def comment_written(_browser) -> bool:
        box = in_form("textarea")
        if box.get_attribute("value") != comment:
            box.clear()
            box.send_keys(comment)
        return in_form("textarea").get_attribute("value") == comment

    wait.until(lambda b: in_form("[role='switch']").is_enabled() and in_form("textarea").is_displayed())
    text = browser.find_element(By.CSS_SELECTOR, ".p-modal").text
    wait.until(switched_on)
    wait.until(comment_written)
    submit = (By.XPATH, "//*[contains(@class, 'p-modal')]//button[normalize-space()='Submit']")
    wait.until(ec.element_to_be_clickable(submit)).click()
    try:
        wait.until(ec.invisibility_of_element_located((By.CSS_SELECTOR, ".p-modal")))
    except TimeoutException:
        shown = " ".join(browser.find_element(By.CSS_SELECTOR, ".p-modal").text.split())
        raise AssertionError(f"the resume dialog stayed open {PAGE_WAIT_S} s after Submit; it shows: {shown[:400]!r}") \
            from None
    return text


@pytest.fixture(scope="module")
def approval_runs(stack, tmp_path_factory, test_output_dir):
    """With toy stages: a run approved in the browser, a run whose approval times out, a run that changes fields
    only its deployment sets."""
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        pytest.skip("chromium and chromium-driver are not installed (.ci/run installs them)")
    tmp = tmp_path_factory.mktemp("approvals")
    deployments_file = approval_deployments(tmp)
    stack.cli("--no-prompt", "deploy", "--all", "--prefect-file", str(deployments_file))
    record: dict = {"root": tmp / "artifacts"}
    with LocalRayHead(num_cpus=2, auth_mode="disabled") as head:
        worker, worker_log = stack.start_worker("toy-worker", {
            "RLHF_STAGE_MODULE_PREFIX": "tests.fake_stages", "RLHF_RAY_ADDRESS": head.address,
            "RLHF_RAY_AUTH_MODE": "disabled", "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
            "RLHF_ARTIFACT_ROOT": str(record["root"]), "RLHF_RESULT_STORAGE": str(tmp / "results"),
            "RLHF_POLL_INTERVAL_S": "0.5", "RLHF_MAX_RETRIES": "0", "RLHF_DEPLOYMENTS_FILE": str(deployments_file)})  # fmt: skip
        browser = chromium()
        try:
            run = stack.run_deployment("full-rlhf/tiny-approval", {})
            stack.wait_for(run.id, {StateType.PAUSED}, timeout_s=600, logs=worker_log)
            run_url = f"{stack.url}/runs/flow-run/{run.id}"
            record["form"] = approve_in_browser(browser, run_url, "held-out answers look right")
            record["approved"] = stack.wait_for(run.id, {StateType.COMPLETED}, timeout_s=300, logs=worker_log)
            screenshot_completed(browser, run_url, test_output_dir / "ui-approved-run.png")
            leave_page(browser)

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
            record["decisions"] = {name: stack.result(record[name]).promotion for name in ("approved", "timed_out")}
        finally:
            browser.quit()
            stop_process(worker)
    yield record


def test_a_paused_night_is_approved_in_the_browser_and_promoted(approval_runs):
    decision = approval_runs["decisions"]["approved"]
    assert "Paused" in approval_runs["states"]["approved"]
    assert "Approve rl v1 for production?" in approval_runs["form"] and "evaluation report" in approval_runs["form"]
    assert decision.promoted and decision.approval == "approved: held-out answers look right"
    assert open_store(str(approval_runs["root"]), "tiny").get("rl", "production").version == decision.version == 1


def test_a_night_nobody_approves_is_rejected_when_its_approval_times_out(approval_runs):
    decision = approval_runs["decisions"]["timed_out"]
    # Rejected by the run's own deadline before the server's pause timeout: never a Failed state on the way, which
    # would alert whoever watches the deployment's failures.
    assert "Paused" in approval_runs["states"]["timed_out"] and "Failed" not in approval_runs["states"]["timed_out"]
    assert not decision.promoted and decision.version == 2 and decision.production_version == 1
    assert decision.approval == f"no approval within {APPROVAL_TIMEOUT_S} s: rejected"
    assert decision.reasons[0] == f"FAIL {decision.approval}"
    assert open_store(str(approval_runs["root"]), "tiny").get("rl", "production").version == 1


def test_a_deployment_run_may_not_change_what_only_its_deployment_sets(approval_runs):
    message = approval_runs["refused"].state.message
    assert "changes gate.min_accuracy_gain, evaluate.remote_rm_url: only the deployment sets them" in message, message
    assert "a run may set " in message and "max_samples" in message


# ---------------------------------------------------------------------------------------------- what a run may change

@pytest.fixture(scope="module")
def refused_runs(stack, tmp_path_factory):
    """Runs of full-rlhf/tiny as an API user could create them: with job variables, after a PATCH of the
    deployment's parameters, with file paths where the config takes values; each refused before anything runs."""
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.exceptions import PrefectHTTPStatusError

    tmp = tmp_path_factory.mktemp("refused")
    canary, fifo = tmp / "CANARY", tmp / "fifo"
    os.mkfifo(fifo)
    record: dict = {"canary": canary, "created": {}, "refused_at_creation": {}}
    worker, worker_log = stack.start_worker("refusing-worker", {
        "RLHF_STAGE_MODULE_PREFIX": "tests.fake_stages", "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
        "RLHF_ARTIFACT_ROOT": str(tmp / "artifacts"), "RLHF_RESULT_STORAGE": str(tmp / "results"),
        "RLHF_MAX_RETRIES": "0"})  # fmt: skip
    tiny_config = yaml.safe_load((CONFIG_DIR / "tiny.yaml").read_text())
    try:
        with stack.client() as client:
            deployment = client.read_deployment_by_name("full-rlhf/tiny")
            record["pool"] = client.read_work_pool(POOL).base_job_template
            for name, job_variables in (("command", {"command": f"touch {canary}"}),
                                        ("env", {"env": {"RLHF_REWARD_DIRS": "/", "PYTHONPATH": str(tmp)}})):
                try:
                    run = client.create_flow_run_from_deployment(deployment.id, job_variables=job_variables)
                    record["created"][name] = run.id
                except PrefectHTTPStatusError as error:
                    record["refused_at_creation"][name] = error.response.text
            record["created"]["stream_output"] = client.create_flow_run_from_deployment(
                deployment.id, job_variables={"stream_output": False}).id
            for name, value in (("fifo", str(fifo)), ("dev_zero", "/dev/zero")):
                # The server's check of the parameters' schema would refuse a string here; any API user may ask
                # it not to check.
                config = {**tiny_config, "evaluate": {**tiny_config["evaluate"], "eval_suite": value}}
                response = client.request("POST", "/deployments/{id}/create_flow_run", path_params={"id": deployment.id},
                                          json={"parameters": {"config": config}, "enforce_parameter_schema": False})
                record["created"][name] = response.json()["id"]
            for name in list(record["created"]):
                record[name] = stack.wait_for(record["created"][name], {StateType.FAILED}, timeout_s=300,
                                              logs=worker_log)
            # A run beside one paused for approval (Prefect gives the deployment's slot back during the pause).
            # Scheduled a day ahead: a worker that picked it up before the pause would crash proposing Pending.
            waiting = client.create_flow_run_from_deployment(
                deployment.id, state=Scheduled(scheduled_time=datetime.now(timezone.utc) + timedelta(days=1)))
            client.set_flow_run_state(waiting.id, Paused(pause_key="approval"), force=True)
            try:
                run = client.create_flow_run_from_deployment(deployment.id)
                record["beside_paused"] = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=300, logs=worker_log)
                record["paused_name"] = waiting.name
            finally:
                client.set_flow_run_state(waiting.id, Cancelled(), force=True)
            # A PATCH of the deployment's parameters: a looser gate.
            patched = {**tiny_config, "gate": {**tiny_config["gate"], "min_prompts": 1}}
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={"config": patched}))
            try:
                run = client.create_flow_run_from_deployment(deployment.id)
                record["patched"] = stack.wait_for(run.id, {StateType.FAILED}, timeout_s=300, logs=worker_log)
            finally:
                client.update_deployment(deployment.id, DeploymentUpdate(parameters=deployment.parameters))
    finally:
        stop_process(worker)
    yield record


def test_the_work_pool_fixes_what_a_run_executes(refused_runs):
    """The pool was made by hand with Prefect's default template (the stack fixture); deploy's build step set the
    command, the environment and the working directory, and the server refuses job variables that would set them."""
    configuration = refused_runs["pool"]["job_configuration"]
    assert configuration["command"] is None and configuration["working_dir"] is None
    assert configuration["env"] == {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30"}
    assert refused_runs["pool"]["variables"]["additionalProperties"] is False
    assert set(refused_runs["refused_at_creation"]) >= {"command", "env"}
    assert "command" in refused_runs["refused_at_creation"]["command"]
    assert not refused_runs["canary"].exists()
    message = refused_runs["stream_output"].state.message
    assert "sets job variables stream_output: what a run executes and its environment are fixed" in message, message


def test_a_run_beside_one_paused_for_approval_is_refused(refused_runs):
    message = refused_runs["beside_paused"].state.message
    assert f"run {refused_runs['paused_name']} of deployment tiny is paused, waiting for approval" in message, message


def test_a_deployment_patched_on_the_server_is_refused(refused_runs):
    message = refused_runs["patched"].state.message
    assert "deployment tiny on the server differs from" in message and "prefect.yaml at " in message, message
    assert "parameters.config.gate.min_prompts: not running it" in message


@pytest.mark.parametrize("case", ["fifo", "dev_zero"])
def test_a_suite_path_in_a_runs_config_is_refused_without_reading_it(refused_runs, case):
    """Prefect validates the parameters in the flow run's process before the flow starts: the FIFO would hold it
    there forever, /dev/zero would fill its memory."""
    run = refused_runs[case]
    assert "config.evaluate: Value error, eval_suite is a string, which would name a file to read" in run.state.message
    assert (run.end_time - run.start_time).total_seconds() < 60
