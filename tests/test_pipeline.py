"""The tiny pipeline through Prefect and Ray, nothing mocked.

One run serves both tests, to keep the suite to a single pipeline's worth of training: the RL stage is made
to crash right after its first checkpoint (RLHF_FAULT_INJECT, no task retries), so the flow run fails; the
same flow run is then retried with `prefect flow-run retry` and completes. test_pipeline_learns checks what
the completed run learned; test_retry_resumes_the_failed_stage checks how it got there.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_API_URL, PREFECT_LOCAL_STORAGE_PATH, temporary_settings
from prefect.testing.utilities import prefect_test_harness

from flows.full_rlhf import full_rlhf
from flows.results import PipelineResult
from infra.artifacts import open_store
from infra.ray_cluster import LocalRayHead, job_client
from infra.settings import PROJECT_ROOT, get_settings
from stages.config import load_pipeline_config
from tasks.run_stage import stage_code_version

pytestmark = pytest.mark.pipeline

STAGES = ("sft", "reward_model", "rl", "evaluate")


def jobs_by_stage(client) -> dict[str, list[str]]:
    """Statuses of the cluster's stage jobs, oldest attempt first, keyed by stage."""
    jobs: dict[str, list] = {}
    for job in client.list_jobs():
        if job.metadata.get("stage"):
            jobs.setdefault(job.metadata["stage"], []).append(job)
    return {
        stage: [job.status.value for job in sorted(found, key=lambda j: int(j.metadata["attempt"]))]
        for stage, found in jobs.items()
    }


def retry_output(run: dict) -> str:
    return run["retry"].stdout[-4000:] + run["retry"].stderr[-4000:]


def task_runs_of(flow_run_id) -> dict[str, list]:
    """Task runs of a flow run by task run name (run_stage runs are named after their stage)."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    by_name: dict[str, list] = {}
    for run in runs:
        by_name.setdefault(run.name, []).append(run)
    return by_name


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """Run the tiny pipeline with a crash after RL's first checkpoint, then retry the same flow run."""
    tmp = tmp_path_factory.mktemp("pipeline")
    config = load_pipeline_config(
        "tiny", {"artifact_root": str(tmp / "artifacts"), "tiny_assets_dir": str(tmp / "tiny-assets")}
    )
    head = LocalRayHead(num_cpus=2, auth_mode="disabled")
    with pytest.MonkeyPatch.context() as env, head:
        for name, value in {
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RLHF_RAY_ADDRESS": head.address,
            "RLHF_RAY_AUTH_MODE": "disabled",
            "RLHF_WORKSPACE_ROOT": str(tmp / "workspace"),
            "RLHF_MAX_RETRIES": "0",
            "RLHF_POLL_INTERVAL_S": "1",
            "RLHF_STAGE_DEADLINE_S": "1200",  # a stage that hangs fails the test instead of blocking it
            "RLHF_FAULT_INJECT": "rl:after_checkpoint",
        }.items():
            env.setenv(name, value)
        env.delenv("RLHF_ARTIFACT_ROOT", raising=False)
        # Pinned, so that an edit of stages/ while this test runs cannot change the stage keys between the run
        # and its retry (a new key means a new workspace, without the checkpoint to resume from).
        env.setenv("RLHF_CODE_VERSION", stage_code_version(get_settings()))
        env.setenv("PREFECT_LOCAL_STORAGE_PATH", str(tmp / "prefect-results"))  # the flow's result, for the CLI
        client = job_client(head.address)
        flow_results = temporary_settings(updates={PREFECT_LOCAL_STORAGE_PATH: tmp / "prefect-results"})
        with prefect_test_harness(server_startup_timeout=180), flow_results:
            failed = full_rlhf(config, return_state=True)
            flow_run_id = failed.state_details.flow_run_id
            after_failure = {
                "state": failed,
                "jobs": jobs_by_stage(client),
                "task_runs": task_runs_of(flow_run_id),
                "versions": {stage: open_store(config.artifact_root, "tiny").versions(stage) for stage in STAGES},
            }
            # The CLI path a user takes: same flow run id, executed again (here: locally, from the entrypoint).
            retry = subprocess.run(
                [str(Path(sys.executable).parent / "prefect"), "flow-run", "retry", str(flow_run_id),
                 "--entrypoint", "flows/full_rlhf.py:full_rlhf"],
                cwd=PROJECT_ROOT, env={**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()},
                capture_output=True, text=True, timeout=1800,
            )  # fmt: skip
            with get_client(sync_client=True) as prefect:
                final_state = prefect.read_flow_run(flow_run_id).state
            yield {
                "config": config,
                "tmp": tmp,
                "after_failure": after_failure,
                "retry": retry,
                "final_state": final_state,
                "final_result": final_state.result() if final_state.is_completed() else None,
                "jobs": jobs_by_stage(client),
                "task_runs": task_runs_of(flow_run_id),
            }


def test_pipeline_learns(resumed_run):
    assert resumed_run["final_state"].is_completed(), retry_output(resumed_run)
    result: PipelineResult = resumed_run["final_result"]
    assert set(result.stages) == set(STAGES)
    reward_model = result.stages["reward_model"].metrics
    report = result.stages["evaluate"].metrics
    assert reward_model["eval_accuracy"] >= 0.9, reward_model
    assert report["accuracy"] - report["reference_accuracy"] >= 0.2, report
    assert math.isfinite(report["kl_mean"]), report

    store = open_store(result.artifact_root, "tiny")
    for stage, artifact in result.stages.items():
        manifest = store.get(stage, artifact.version)
        store.verify(manifest)  # every file's sha256
        assert manifest.digest == artifact.digest and manifest.stage_key == artifact.stage_key
    lineage = {m.stage for m in store.lineage("evaluate", result.stages["evaluate"].version)}
    assert lineage == set(STAGES)
    evaluate_inputs = store.get("evaluate", result.stages["evaluate"].version).inputs
    assert evaluate_inputs["pretrain"].digest == result.stages["rl"].digest
    assert evaluate_inputs["ref_pretrain"].digest == result.stages["sft"].digest
    if result.promotion.promoted:
        assert store.get("rl", "production").version == result.stages["rl"].version


def test_retry_resumes_the_failed_stage(resumed_run):
    failure = resumed_run["after_failure"]
    assert failure["state"].is_failed()
    assert failure["jobs"] == {"sft": ["SUCCEEDED"], "reward_model": ["SUCCEEDED"], "rl": ["FAILED"]}
    assert failure["versions"] == {"sft": [1], "reward_model": [1], "rl": [], "evaluate": []}
    assert resumed_run["final_state"].is_completed(), retry_output(resumed_run)

    # Finished stages were not run again: no new Ray jobs, no new versions, their tasks came back Cached.
    assert resumed_run["jobs"] == {
        "sft": ["SUCCEEDED"], "reward_model": ["SUCCEEDED"], "rl": ["FAILED", "SUCCEEDED"], "evaluate": ["SUCCEEDED"]
    }  # fmt: skip
    store = open_store(resumed_run["config"].artifact_root, "tiny")
    assert {stage: store.versions(stage) for stage in STAGES} == {stage: [1] for stage in STAGES}
    states = {name: [run.state.name for run in runs] for name, runs in resumed_run["task_runs"].items()}
    for name in ("sft", "reward_model"):
        assert "Cached" in states[name], states

    # The failed stage continued from its checkpoint in the same workspace.
    rl = resumed_run["final_result"].stages["rl"]
    assert rl.metrics["resumed_from_step"] > 0, rl.metrics
    workspace = resumed_run["tmp"] / "workspace" / "tiny" / "rl" / rl.stage_key[:16]
    assert any((workspace / "ckpt").iterdir())
