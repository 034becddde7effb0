"""run_stage mechanics against a real Prefect server and a real local Ray head, with a stage that does no ML
(tests/fake_stages/toy.py): idempotence, retry classification, resume, log streaming, deadline, re-attach,
Prefect artifacts, progress, the workspace's single writer, secrets kept out of what the run writes. Then the
full-rlhf flow in every pipeline shape with toy stages (tests/fake_stages/pipeline_toy.py): which stage feeds which
field, reuse across shapes and runs, and the gate against the production policy."""

from __future__ import annotations

import contextvars
import json
import os
import re
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import yaml
from conftest import replace_stored
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterKey,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.client.schemas.objects import StateType
from prefect.settings import PREFECT_API_DATABASE_CONNECTION_URL
from prefect.testing.utilities import prefect_test_harness
from pydantic import BaseModel
from secret_patterns import ALL_TEXTS, CANARY, SECRETS, URL_TEXTS

from flows.full_rlhf import full_rlhf
from infra.artifacts import open_store
from infra.ray_cluster import LocalRayHead, job_client
from infra.settings import PROJECT_ROOT, get_settings
from pipeline.config import PIPELINE_SHAPES, PromotionGate, load_pipeline_config, shape_inputs
from stages.launch import writer_lock, writer_lock_path
from tasks.promote import judge, promote
from tasks.results import RESULT_SERIALIZER, persisted
from pipeline.identity import StageResult, resolve_config, stage_code_version, stage_key
from tasks.run_stage import StageConfigError, StageError, StageTimeout, stage_task, submission_id
from tcp_proxy import TcpProxy

LOCAL = fsspec.filesystem("file")  # the local artifact root and workspace of these tests

# Runs flows on a Prefect server and stage jobs on Ray: the full suite's tier.
pytestmark = pytest.mark.slow

PIPELINE = "toy-pipe"


class ToyConfig(BaseModel):
    """Config of tests/fake_stages/toy.py; save_path and ckpt_path are filled by run_stage."""

    value: int
    pretrain: str | None = None
    sleep_s: float = 0.0
    config_error: bool = False
    steps: int = 0
    leak_env: list[str] = []
    nan_until_resumed: bool = False
    save_path: str = ""
    ckpt_path: str = ""


@pytest.fixture(scope="module")
def prefect_server():
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
        # A loaded machine (other suites share its 2 cores) can take a while to start the server.
        with prefect_test_harness(server_startup_timeout=180):
            yield


@pytest.fixture(scope="module")
def ray_address():
    with LocalRayHead(num_cpus=2, auth_mode="disabled") as head:
        yield head.address


@pytest.fixture
def env(tmp_path, monkeypatch, prefect_server, ray_address):
    """Settings for one test: fresh workspace and store, the toy stage package, fast polling."""
    monkeypatch.setenv("RLHF_RAY_ADDRESS", ray_address)
    monkeypatch.setenv("RLHF_RAY_AUTH_MODE", "disabled")
    monkeypatch.setenv("RLHF_WORKSPACE_ROOT", str(tmp_path / "workspace"))
    monkeypatch.setenv("RLHF_RESULT_STORAGE", str(tmp_path / "results"))
    monkeypatch.setenv("RLHF_STAGE_MODULE_PREFIX", "tests.fake_stages")
    monkeypatch.setenv("RLHF_POLL_INTERVAL_S", "0.3")
    monkeypatch.setenv("RLHF_MAX_RETRIES", "1")
    monkeypatch.setenv("RLHF_RETRY_DELAY_S", "0")
    monkeypatch.delenv("TOY_CRASH_AFTER_CHECKPOINT", raising=False)
    return {"root": str(tmp_path / "artifacts"), "client": job_client(ray_address)}


@flow(name="toy-stage")
def toy_flow(config: ToyConfig, inputs: dict | None = None, artifact_root: str = "", deadline_s: float | None = None):
    return stage_task()(
        "toy", config, inputs, pipeline=PIPELINE, artifact_root=artifact_root, deadline_s=deadline_s
    )


def run_toy(env, config: ToyConfig, inputs=None, deadline_s=None):
    return toy_flow(config, inputs, env["root"], deadline_s, return_state=True)


def attempts_of(env, config: ToyConfig, inputs=None) -> list[str]:
    """Statuses of the Ray jobs submitted for this toy config, oldest first."""
    settings = get_settings()
    resolved = resolve_config("toy", config, inputs or {})
    digests = {role: r.digest for role, r in (inputs or {}).items()}
    key = stage_key(PIPELINE, "toy", resolved, digests, stage_code_version(settings, "toy"))
    statuses, attempt = [], 1
    while True:
        try:
            statuses.append(env["client"].get_job_info(submission_id(key, attempt)).status.value)
        except RuntimeError:
            return statuses
        attempt += 1


def flow_run_logs(flow_run_id, must_contain: str, timeout_s: float = 15.0) -> str:
    """All log messages of a flow run; waits until `must_contain` arrives (logs are shipped in batches)."""
    deadline = time.monotonic() + timeout_s
    with get_client(sync_client=True) as client:
        while True:
            logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
            text = "\n".join(log.message for log in logs)
            if must_contain in text or time.monotonic() > deadline:
                return text
            time.sleep(0.5)


def test_stage_commits_artifact_streams_logs_and_publishes(env):
    state = run_toy(env, ToyConfig(value=7))
    result = state.result()
    assert result.version == 1 and result.metrics == {"value": 7, "resumed_from_step": 0}
    manifest = open_store(env["root"], PIPELINE).get("toy", result.version)
    assert manifest.digest == result.digest and manifest.stage_key == result.stage_key
    assert manifest.metrics["value"] == 7 and "result.json" in manifest.files
    assert attempts_of(env, ToyConfig(value=7)) == ["SUCCEEDED"]

    logs = flow_run_logs(state.state_details.flow_run_id, "toy: done")
    assert "toy: starting with value=7" in logs and "toy: done" in logs

    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["toy-pipe-toy", "toy-pipe-toy-metrics"]))
        )
    by_type = {a.type: a for a in artifacts}
    assert result.uri in by_type["markdown"].data  # a link artifact is stored as markdown
    assert "resumed_from_step" in str(by_type["table"].data)


def test_rerun_is_idempotent_and_inputs_reach_config_fields(env):
    first = run_toy(env, ToyConfig(value=1)).result()
    again = run_toy(env, ToyConfig(value=1)).result()
    assert again.reused and not first.reused
    assert again.model_copy(update={"reused": False}) == first
    assert attempts_of(env, ToyConfig(value=1)) == ["SUCCEEDED"]  # no second job

    downstream = run_toy(env, ToyConfig(value=2), inputs={"pretrain": first}).result()
    manifest = open_store(env["root"], PIPELINE).get("toy", downstream.version)
    assert manifest.config["pretrain"] == first.uri
    assert manifest.inputs["pretrain"].digest == first.digest



def test_a_damaged_committed_version_is_quarantined_and_built_again_not_reused(env):
    config = ToyConfig(value=8)
    first = run_toy(env, config).result()
    replace_stored(LOCAL, f"{first.uri.removeprefix('file:')}/result.json", b'{"value": 9}')  # a bad disk
    # The job's output in the workspace is what v1 held when committed: committed again, no job runs.
    second = run_toy(env, config).result()
    assert not second.reused and second.version == first.version + 1 and attempts_of(env, config) == ["SUCCEEDED"]
    store = open_store(env["root"], PIPELINE)
    assert list(store.quarantined("toy")) == [first.version] and "result.json" in store.quarantined("toy")[1]
    assert json.loads(store.read_file(store.get("toy", second.version), "result.json"))["value"] == 8
    # Damaged in the store and in the workspace: the stage runs again.
    for folder in (Path(second.uri.removeprefix("file:")), toy_workspace(config) / "output"):
        replace_stored(LOCAL, str(folder / "result.json"), b'{"value": 7}')
    third = run_toy(env, config).result()
    assert third.version == second.version + 1 and attempts_of(env, config) == ["SUCCEEDED", "SUCCEEDED"]
    assert json.loads(store.read_file(store.get("toy", third.version), "result.json"))["value"] == 8
    assert run_toy(env, config).result().reused


def test_config_error_is_not_retried_and_names_the_field(env):
    state = run_toy(env, ToyConfig(value=3, config_error=True))
    assert state.is_failed()
    with pytest.raises(StageConfigError, match="field 'value' = 3 is not allowed"):
        state.result()
    assert attempts_of(env, ToyConfig(value=3, config_error=True)) == ["FAILED"]


def test_crash_is_retried_and_resumes_from_checkpoint(env, monkeypatch):
    monkeypatch.setenv("TOY_CRASH_AFTER_CHECKPOINT", "1")
    monkeypatch.setenv("RLHF_JOB_ENV_PASSTHROUGH", "TOY_CRASH_AFTER_CHECKPOINT")
    result = run_toy(env, ToyConfig(value=4)).result()
    assert result.metrics["resumed_from_step"] == 1
    assert attempts_of(env, ToyConfig(value=4)) == ["FAILED", "SUCCEEDED"]


def test_a_succeeded_job_whose_output_cannot_be_committed_runs_again_as_a_new_job(env):
    config = ToyConfig(value=6, nan_until_resumed=True)
    result = run_toy(env, config).result()  # the first job's NaN metric refused, the retry's job committed
    assert result.metrics["resumed_from_step"] == 1 and "loss" not in result.metrics
    assert attempts_of(env, config) == ["SUCCEEDED", "SUCCEEDED"]
    refused = list(toy_workspace(config).glob("refused-*"))
    assert len(refused) == 1 and "NaN" in (refused[0] / "metrics.json").read_text()


def test_only_the_newest_set_aside_outputs_are_kept(tmp_path):
    """A refusal that repeats on every attempt sets aside an output each time: the newest two stay for a look."""
    from tasks.run_stage import KEEP_REFUSED, _drop_older_refused

    for age, job in enumerate(["d", "c", "b", "a"]):
        (tmp_path / f"refused-{job}").mkdir()
        os.utime(tmp_path / f"refused-{job}", (time.time() - 100 * age, time.time() - 100 * age))
    (tmp_path / "output").mkdir()
    _drop_older_refused(tmp_path)
    assert KEEP_REFUSED == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["output", "refused-c", "refused-d"]


def test_deadline_stops_the_job(env, monkeypatch):
    monkeypatch.setenv("RLHF_MAX_RETRIES", "0")
    config = ToyConfig(value=5, sleep_s=120)
    started = time.monotonic()
    state = run_toy(env, config, deadline_s=4)
    assert state.is_failed() and time.monotonic() - started < 60
    with pytest.raises(StageTimeout):
        state.result()
    deadline = time.monotonic() + 15
    while attempts_of(env, config) != ["STOPPED"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert attempts_of(env, config) == ["STOPPED"]


def toy_workspace(config: ToyConfig) -> Path:
    settings = get_settings()
    key = stage_key(PIPELINE, "toy", resolve_config("toy", config, {}), {}, stage_code_version(settings, "toy"))
    return Path(settings.workspace_root) / PIPELINE / "toy" / key[:16]


def test_progress_artifact_follows_the_step_lines(env):
    state = run_toy(env, ToyConfig(value=11, steps=4))
    assert state.result().metrics["steps"] == 4
    with get_client(sync_client=True) as client:
        (progress,) = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(
            any_=["toy-pipe-toy-progress"])), flow_run_filter=None)  # fmt: skip
    assert progress.type == "progress" and progress.data == 100.0
    assert progress.description == "toy: 4/4 steps, finished"
    logs = flow_run_logs(state.state_details.flow_run_id, "[toy] step 4/4")
    assert "[toy] step 2/4 (50%, elapsed 0:00:02, ETA 0:00:02) value=11" in logs


def test_a_second_writer_is_refused_before_touching_the_workspace(env):
    config = ToyConfig(value=12)
    workspace = toy_workspace(config)
    (workspace / "output").mkdir(parents=True)
    (workspace / "output" / "partial.bin").write_bytes(b"written by the holder")
    with writer_lock(writer_lock_path(str(workspace / "output"), str(workspace / "ckpt"))):
        state = run_toy(env, config)
    with pytest.raises(StageError, match=r"still being written by pid \d+"):
        state.result()
    assert attempts_of(env, config) == []  # no job submitted
    assert (workspace / "output" / "partial.bin").exists()  # nor the holder's output wiped


def test_secret_values_are_redacted_from_everything_the_run_writes(env, monkeypatch):
    """The job prints secrets of its environment (inherited from the head, as in production) and every text that
    holds one by its form alone (tests/secret_patterns.py: URLs, headers, credential fields, tokens), and fails once
    with them in its error; neither Prefect (logs, states, artifacts: its database file) nor the workspace, the store
    or the Ray job's metadata may hold them."""
    canaries = {name: f"canary-{name.lower()}-{uuid.uuid4().hex}" for name in
                ("HF_TOKEN", "WEBHOOK_SECRET_URL", "WANDB_API_KEY", "AWS_SECRET_ACCESS_KEY", "RAY_AUTH_TOKEN")}
    for name, value in canaries.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TOY_LIBRARY_OUTPUT", ALL_TEXTS)  # a name that says nothing: only the forms find them
    with pytest.raises(ValueError, match="secret variables"):
        get_settings(job_env_passthrough=["HF_HOME", "HF_TOKEN"])
    config = ToyConfig(value=13, leak_env=[*canaries, "TOY_LIBRARY_OUTPUT"])
    with LocalRayHead(num_cpus=1, auth_mode="disabled") as head:  # started with the secrets in its env
        monkeypatch.setenv("RLHF_RAY_ADDRESS", head.address)
        state = run_toy(env, config)
        client = job_client(head.address)
        jobs = [client.get_job_info(job.submission_id) for job in client.list_jobs()]
    assert state.result().metrics["resumed_from_step"] == 1  # failed once (secrets in its error), then passed
    assert len(jobs) == 2

    logs = flow_run_logs(state.state_details.flow_run_id, "toy: done")
    assert "could not authenticate with HF_TOKEN=[redacted HF_TOKEN]" in logs  # redacted, not dropped
    assert "http://rm.internal/score?jwt=[redacted]" in logs and "Authorization: Bearer [redacted]" in logs
    (failure,) = [line for line in logs.splitlines() if line.startswith("Task run failed with exception")]
    assert "StageError" in failure and "[redacted WANDB_API_KEY]" in failure  # the error that carried them

    written = {}
    database = Path(PREFECT_API_DATABASE_CONNECTION_URL.value().split("///", 1)[1])
    for path in [*database.parent.glob(database.name + "*"), *Path(env["root"]).rglob("*"),
                 *get_settings().workspace_root.rglob("*")]:  # fmt: skip
        if path.is_file():
            written[str(path)] = path.read_bytes()
    # What we hand Ray; Ray's own copy of the job's output (its logs, a failed job's message) is the cluster's.
    written.update({f"ray job {job.submission_id}": repr((job.entrypoint, job.metadata, job.runtime_env)).encode()
                    for job in jobs})
    assert any("prefect" in name for name in written) and any("MANIFEST.json" in name for name in written)
    leaks = [(where, secret) for where, data in written.items() for secret in [*canaries.values(), *SECRETS]
             if secret.encode() in data]  # fmt: skip
    assert leaks == []


def test_running_attempt_is_reattached_not_duplicated(env):
    """A job left running by a worker that went away is watched again, not submitted twice."""
    config = ToyConfig(value=6, sleep_s=3)
    settings = get_settings()
    resolved = resolve_config("toy", config, {})
    key = stage_key(PIPELINE, "toy", resolved, {}, stage_code_version(settings, "toy"))
    workspace = Path(settings.workspace_root) / PIPELINE / "toy" / key[:16]
    (workspace / "output").mkdir(parents=True)
    (workspace / "ckpt").mkdir()
    config_path = workspace / "config.yaml"
    config_path.write_text(yaml.safe_dump({**resolved, "save_path": str(workspace / "output")}))
    env["client"].submit_job(
        entrypoint=f"{settings.job_python} -m tests.fake_stages.toy --config {config_path} "
        f"--save_path {workspace / 'output'} --ckpt_path {workspace / 'ckpt'}",
        submission_id=submission_id(key, 1),
        runtime_env=settings.job_runtime_env(),
    )
    result = run_toy(env, config).result()
    assert result.metrics["value"] == 6
    assert attempts_of(env, config) == ["SUCCEEDED"]



@flow(name="toy-promote")
def promote_flow(policy: StageResult, report: StageResult, gate: PromotionGate, artifact_root: str):
    options = persisted(get_settings())
    decision = judge.with_options(**options)(policy, report, gate, artifact_root=artifact_root)
    return promote.with_options(**options)(decision, report, pipeline=PIPELINE, artifact_root=artifact_root)


def test_promote_moves_production_only_when_the_gate_passes(env):
    policy = run_toy(env, ToyConfig(value=9)).result()
    good = {"accuracy": 0.6, "reference_accuracy": 0.3, "reward_mean": 1.0, "reference_reward_mean": 0.2,
            "kl_mean": 0.5, "prompts": 200}  # fmt: skip
    store = open_store(env["root"], PIPELINE)

    for metrics in ({**good, "accuracy": 0.2}, {**good, "kl_mean": float("nan")}, {"kl_mean": 0.1}):
        report = policy.model_copy(update={"stage": "evaluate", "metrics": metrics})
        decision = promote_flow(policy, report, PromotionGate(), env["root"])
        assert not decision.promoted, metrics
        assert "production" not in store.aliases("toy")

    report = policy.model_copy(update={"stage": "evaluate", "metrics": good})
    decision = promote_flow(policy, report, PromotionGate(min_reward_gain=0.5), env["root"])
    assert decision.promoted and store.get("toy", "production").version == policy.version
    # Production stays where it is when its own policy no longer passes a stricter gate; the decision says so.
    again = promote_flow(policy, report, PromotionGate(min_reward_gain=1.0), env["root"])
    assert again.promoted and again.reasons[0].startswith("already production")
    assert any(line.startswith("FAIL reward gain") for line in again.reasons)


# ---------------------------------------------------------------------------------------------- pipeline shapes

# One artifact root for all: the with-SFT shapes share one SFT; "dpo" after "sft-dpo" meets a production policy.
SHAPE_RUNS = ("sft-dpo", "dpo", "sft-kto", "kto", "sft-rl", "rl", "rm-rl", "sft-rm-rl")


@pytest.fixture(scope="module")
def shape_runs(prefect_server, ray_address, tmp_path_factory):
    """The flow on the tiny preset in every shape, toy stages doing the work; then "dpo" once more, unchanged, and
    once more after its DPO version was damaged."""
    tmp = tmp_path_factory.mktemp("shapes")
    client = job_client(ray_address)
    runs = {}
    with pytest.MonkeyPatch.context() as env:
        for name, value in {"RLHF_RAY_ADDRESS": ray_address, "RLHF_RAY_AUTH_MODE": "disabled",
                            "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"), "RLHF_RESULT_STORAGE": str(tmp / "results"),
                            "RLHF_STAGE_MODULE_PREFIX": "tests.fake_stages",
                            "RLHF_POLL_INTERVAL_S": "0.3", "RLHF_MAX_RETRIES": "0"}.items():  # fmt: skip
            env.setenv(name, value)
        env.delenv("RLHF_ARTIFACT_ROOT", raising=False)
        for run, shape in [*((shape, shape) for shape in SHAPE_RUNS), ("dpo again", "dpo"), ("dpo damaged", "dpo")]:
            if run == "dpo damaged":  # a disk gone bad under the version the unchanged night reused
                damaged = Path(runs["dpo again"]["state"].result().stages["dpo"].uri.removeprefix("file:"))
                replace_stored(LOCAL, str(damaged / "result.json"), b'{"value": -1}')  # a file it does not list
            config = load_pipeline_config("tiny", {"artifact_root": str(tmp / "artifacts"),
                                                   "tiny_assets_dir": str(tmp / "tiny-assets"), "shape": shape})
            jobs_before = len(client.list_jobs())
            state = full_rlhf(config, return_state=True)
            runs[run] = {"state": state, "jobs": len(client.list_jobs()) - jobs_before,
                         "production": open_store(str(tmp / "artifacts"), "tiny").aliases("dpo").get("production")}
    return {"runs": runs, "root": str(tmp / "artifacts"), "model": str(tmp / "tiny-assets" / "model")}


@pytest.mark.parametrize("shape", SHAPE_RUNS)
def test_each_shape_runs_its_stages_fed_as_the_table_says(shape_runs, shape):
    state = shape_runs["runs"][shape]["state"]
    assert state.is_completed(), state.message
    result = state.result()
    assert tuple(result.stages) == PIPELINE_SHAPES[shape] and result.shape == shape
    store = open_store(shape_runs["root"], "tiny")
    for stage, fed in shape_inputs(shape).items():
        manifest = store.get(stage, result.stages[stage].version)
        inputs = {field: ref.digest for field, ref in manifest.inputs.items() if field != "production_pretrain"}
        assert inputs == {field: result.stages[producer].digest for field, producer in fed.items()}, stage
        # A model no stage feeds comes from the config: here the tiny assets' model (an "instruct model").
        if "pretrain" not in fed:
            assert manifest.config["pretrain"] == shape_runs["model"], stage
        assert manifest.datasets and all(ref.fingerprint.startswith("sha256:") for ref in manifest.datasets.values())
    policy = result.stages[result.promotion.stage]
    assert result.stages["evaluate"].metrics["accuracy"] == pytest.approx(policy.metrics["quality"] / 10)


def test_shapes_share_committed_stages(shape_runs):
    runs = shape_runs["runs"]
    sft = {shape: runs[shape]["state"].result().stages["sft"] for shape in SHAPE_RUNS if shape.startswith("sft-")}
    assert {result.version for result in sft.values()} == {1}  # one SFT, trained by the first, reused by the others
    assert [shape for shape, result in sft.items() if not result.reused] == ["sft-dpo"]
    assert runs["sft-dpo"]["jobs"] == 3 and runs["sft-kto"]["jobs"] == 2  # sft, dpo, evaluate; then kto, evaluate


def test_a_worse_policy_is_not_promoted_over_production(shape_runs):
    """DPO from the instruct model ("dpo") after DPO from the SFT model ("sft-dpo", promoted): it beats its own
    reference but falls behind production, so production stays where it was."""
    first, second = (shape_runs["runs"][run] for run in ("sft-dpo", "dpo"))
    promoted = first["state"].result().promotion
    assert promoted.promoted and first["production"] == promoted.version == 1
    decision = second["state"].result().promotion
    assert not decision.promoted and decision.production_version == 1 and second["production"] == 1
    failures = [line for line in decision.reasons if line.startswith("FAIL")]
    assert len(failures) == 1 and failures[0].startswith("FAIL accuracy") and "vs production v1" in failures[0]
    assert set(decision.scores) == {"policy", "reference", "production"}
    assert decision.scores["production"]["accuracy"] > decision.scores["policy"]["accuracy"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-promotion"])))
    (shown,) = {a.data for a in artifacts if "dpo v2: **not promoted**" in a.data}  # the run and its unchanged rerun
    assert "| accuracy | 0.0500 | 0.0000 | 0.2500 |" in shown and "production is dpo v1" in shown
    # The first candidate had no production to be judged against; this is the first judged against dpo v1.
    assert promoted.tries_against_production is None and decision.tries_against_production == 1
    assert "production is dpo v1; candidate 1 judged against it" in shown


def test_an_unchanged_run_reuses_every_stage_without_a_job(shape_runs):
    again = shape_runs["runs"]["dpo again"]
    result = again["state"].result()
    assert again["jobs"] == 0 and result.unchanged and all(stage.reused for stage in result.stages.values())
    # Judged as the first time, against the same production policy: the same evaluation is reused.
    first = shape_runs["runs"]["dpo"]["state"].result()
    assert result.stages == {name: stage.model_copy(update={"reused": True}) for name, stage in first.stages.items()}
    assert not result.promotion.promoted and result.promotion.production_version == 1


def test_a_night_after_a_reused_version_was_damaged_quarantines_it_and_completes(shape_runs):
    """The plan finds the damage before it decides that nothing runs (so the night has its Ray cluster), the task
    quarantines the version and commits the job's output again: the night completes on an intact DPO version."""
    damaged = shape_runs["runs"]["dpo again"]["state"].result().stages["dpo"]
    state = shape_runs["runs"]["dpo damaged"]["state"]
    assert state.is_completed(), state.message
    rebuilt = state.result().stages["dpo"]
    assert not rebuilt.reused and rebuilt.version > damaged.version and rebuilt.digest == damaged.digest
    store = open_store(shape_runs["root"], "tiny")
    assert list(store.quarantined("dpo")) == [damaged.version]
    store.verify(store.get("dpo", rebuilt.version))


# ---------------------------------------------------------------------------------------------- what a run trusts

def test_the_job_log_is_followed_not_fetched_whole_at_every_poll(env, monkeypatch):
    """Every poll used to download the whole job log; now it arrives through Ray's log tail, and the whole log is
    fetched once, at the end, to be sure nothing is missing."""
    proxy = TcpProxy(("127.0.0.1", int(get_settings().ray_address.rsplit(":", 1)[1]))).start()
    monkeypatch.setenv("RLHF_RAY_ADDRESS", proxy.url)
    try:
        state = run_toy(env, ToyConfig(value=14, steps=12))  # 12 step lines over 2.4 s, polled every 0.3 s
    finally:
        proxy.stop()
    assert state.result().metrics["steps"] == 12
    requests = b"".join(proxy.sent)
    assert len(re.findall(rb"GET /api/jobs/[^ ]+/logs HTTP", requests)) == 1, "the whole log fetched more than once"
    assert re.findall(rb"GET /api/jobs/[^ ]+/logs/tail HTTP", requests)
    logs = flow_run_logs(state.state_details.flow_run_id, "toy: done")
    steps = [line for line in logs.splitlines() if line.startswith("[toy] step ")]
    assert [line.split()[2] for line in steps] == [f"{step}/12" for step in range(1, 13)]  # each once, in order


def test_a_planted_pickle_result_is_never_loaded(env, tmp_path):
    """A result file replaced by one that names pickle (what a job could plant where results live, for the next
    retry to load) is refused by the storage every task reads its results through; the files are nowhere a job
    writes."""
    from prefect.results import ResultRecord, ResultRecordMetadata, ResultStore, resolve_result_storage
    from prefect.serializers import PickleSerializer

    from tasks.results import RefusedResult

    result = run_toy(env, ToyConfig(value=15)).result()
    results = Path(get_settings().result_storage)
    files = [path for path in results.rglob("*") if path.is_file()]
    assert files and not results.is_relative_to(get_settings().workspace_root)
    storage = resolve_result_storage(persisted(get_settings())["result_storage"])
    # Read the way Prefect reads results when a retry looks for them: what the run wrote passes.
    store = ResultStore(result_storage=storage, serializer=RESULT_SERIALIZER, cache_result_in_memory=False)
    assert store.exists(files[0].name) and store.read(files[0].name).result == result

    marker = tmp_path / "planted-code-ran"
    planted = ResultRecord(result=Planted(marker), metadata=ResultRecordMetadata(
        serializer=PickleSerializer(), storage_key=str(files[0])))  # fmt: skip
    for path in files:
        path.write_bytes(planted.serialize())
        with pytest.raises(RefusedResult, match="serializer 'pickle'"):
            store.read(path.name)
        assert not store.exists(path.name)  # a retry takes it for missing and runs the task again
    assert not marker.exists()


@flow(name="result-of-a-flow", persist_result=True, result_serializer=RESULT_SERIALIZER)
def flow_returning_a_model() -> StageResult:
    return StageResult(pipeline=PIPELINE, stage="toy", version=3, uri="file:///x", digest="d", stage_key="k",
                       metrics={"steps": 3})


def test_a_flow_result_reads_back_as_its_model_in_another_process(prefect_server):
    """A flow's result is stored bare (its serializer lives in the run's state): read back elsewhere, as a test,
    the UI's user or a later night does, it is the model the flow returned, not a dict (Prefect's own JSON form
    of a model reads back as an old-format record)."""
    from prefect.settings import PREFECT_API_URL

    state = flow_returning_a_model(return_state=True)
    code = ("from prefect import get_client\n"
            "with get_client(sync_client=True) as client:\n"
            f"    result = client.read_flow_run('{state.state_details.flow_run_id}').state.result()\n"
            "print(type(result).__name__, result.version, result.metrics)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PYTHONPATH": str(PROJECT_ROOT)})
    assert done.stdout.strip() == "StageResult 3 {'steps': 3}", done.stdout + done.stderr[-2000:]


class Planted:
    """Unpickling it creates a file: it could run anything."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def flow_run_texts(flow_run_id) -> list[str]:
    """What Prefect holds of a flow run that the run wrote: logs, artifacts, states of the run and its tasks."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        task_runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
        states = client.read_flow_run_states(flow_run_id)
    return ([log.message for log in logs] + [str(a.data) + str(a.description) for a in artifacts]
            + [str(s.message) for s in states] + [str(t.state.message) for t in task_runs if t.state])


def test_a_canary_inside_a_reward_url_is_absent_from_everything_the_run_writes(env, tmp_path_factory):
    """Credentials in a reward endpoint's URL, in every form tests/secret_patterns.py lists, are refused when the
    config is validated, naming the field, before anything is written: neither the error, nor the plan, nor the run's
    logs, artifacts and states, nor any file under the run's folders holds them."""
    canary = f"canary-{uuid.uuid4().hex}"
    forms = [text.replace(CANARY, canary) for text in URL_TEXTS if text.startswith("http")]
    url = ",".join([f"http://alice:{canary}@127.0.0.1:9/score?token={canary}2", *forms])
    overrides = {"artifact_root": env["root"], "shape": "sft-rl",
                 "tiny_assets_dir": str(Path(env["root"]).parent / "tiny-assets")}
    with pytest.raises(ValueError, match="rl: --remote_rm_url http://.redacted.@.*credentials in the URL are refused"
                       ) as refused:  # fmt: skip
        load_pipeline_config("tiny", {**overrides, "rl": {"remote_rm_url": url}})
    assert canary not in str(refused.value)
    # The plan of a preset file that sets it (kept outside the run's folders, which must hold no canary).
    preset = tmp_path_factory.mktemp("preset") / "leaky.yaml"
    preset.write_text(yaml.safe_dump({"extends": "tiny", "name": "leaky", **overrides, "rl": {"remote_rm_url": url}}))
    planned = subprocess.run([sys.executable, "-m", "flows.run", "--preset", str(preset), "--plan"], cwd=PROJECT_ROOT,
                             capture_output=True, text=True, timeout=120)  # fmt: skip
    assert planned.returncode != 0 and "credentials in the URL are refused" in planned.stderr, planned.stderr
    assert canary not in planned.stdout + planned.stderr
    # A run's parameters as a deployment passes them (JSON): refused before the flow starts, the URL not repeated.
    config = load_pipeline_config("tiny", overrides).model_dump(mode="json")
    config["rl"]["remote_rm_url"] = config["evaluate"]["remote_rm_url"] = url
    state = full_rlhf(config, return_state=True)
    assert state.is_failed() and "credentials in the URL are refused" in state.message, state.message
    texts = flow_run_texts(state.state_details.flow_run_id)
    assert [text[:200] for text in texts if canary in text] == []
    written = [path for path in Path(env["root"]).parent.rglob("*") if path.is_file() and canary.encode() in
               path.read_bytes()]  # fmt: skip
    assert written == []


def test_of_two_concurrent_promotions_the_better_policy_stays_production(env):
    """A weaker candidate, compared with an old production, finds production moved to a stronger policy by another
    run before it could promote: it is evaluated again against that one, and loses."""
    store = open_store(env["root"], "tiny")

    def night(learning_rate: float, **gate):
        config = load_pipeline_config("tiny", {
            "artifact_root": env["root"], "tiny_assets_dir": str(Path(env["root"]).parent / "tiny-assets"),
            "shape": "dpo", "dpo": {"learning_rate": learning_rate}, "gate": gate})  # fmt: skip
        return full_rlhf(config, return_state=True).result()

    old = night(1e-4)  # quality 0.1: production
    strong = night(1e-3, min_accuracy_gain=100)  # quality 1.0, committed, held back by its own run's gate
    assert store.get("dpo", "production").version == old.promotion.version == 1 and strong.promotion.version == 2

    evaluations = Path(get_settings().workspace_root) / "tiny" / "evaluate"
    before = set(evaluations.iterdir())

    def the_other_run_promotes():  # while the weak night's first evaluation runs
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if [path for path in evaluations.iterdir() if path not in before and (path / "config.yaml").exists()]:
                store.set_alias("dpo", "production", 2, expected=1)
                return
            time.sleep(0.01)

    promoter = threading.Thread(target=the_other_run_promotes, daemon=True)
    promoter.start()
    weak = night(5e-4)  # quality 0.5: better than the old production, worse than the strong policy
    promoter.join(timeout=10)
    decision = weak.promotion
    assert store.get("dpo", "production").version == 2
    assert not decision.promoted and decision.version == 3 and decision.production_version == 2
    assert any(line.startswith("FAIL accuracy") and "vs production v2" in line for line in decision.reasons)
    compared = [store.get("evaluate", v).inputs["production_pretrain"].digest for v in store.versions("evaluate")[-2:]]
    assert compared == [old.stages["dpo"].digest, strong.stages["dpo"].digest]  # evaluated again, against the new one


def test_a_run_waiting_for_approval_is_rejected_from_the_command_line(env):
    from prefect.settings import PREFECT_API_URL

    config = load_pipeline_config("tiny", {
        "artifact_root": env["root"], "tiny_assets_dir": str(Path(env["root"]).parent / "tiny-assets"),
        "shape": "dpo", "gate": {"require_approval": True, "approval_timeout_s": 300}})  # fmt: skip
    answered = {}

    def answer_when_paused():  # as an operator does, from another shell
        deadline = time.monotonic() + 300
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                paused = [run for run in client.read_flow_runs() if run.state_type == StateType.PAUSED]
                if paused:
                    answered["cli"] = subprocess.run(
                        [sys.executable, "-m", "flows.approval", str(paused[0].id), "--reject", "--comment",
                         "the reference answers better"], cwd=PROJECT_ROOT, capture_output=True, text=True,
                        env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}, timeout=120)  # fmt: skip
                    return
                time.sleep(0.5)

    # The thread sees this test's Prefect server (Prefect's settings live in a context variable).
    answering = threading.Thread(target=contextvars.copy_context().run, args=(answer_when_paused,), daemon=True)
    answering.start()
    decision = full_rlhf(config, return_state=True).result().promotion
    answering.join(timeout=30)
    assert answered["cli"].returncode == 0 and "rejected" in answered["cli"].stdout, answered["cli"].stderr
    assert not decision.promoted and decision.approval == "rejected: the reference answers better"
    assert "production" not in open_store(env["root"], "tiny").aliases("dpo")
