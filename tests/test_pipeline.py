"""The tiny pipeline through Prefect and Ray, nothing mocked.

One run serves both first tests, to keep the suite to a single pipeline's worth of training: the RL job's driver
is killed (SIGKILL) right after its first checkpoint (no task retries), so the flow run fails; the
same flow run is then retried with `prefect flow-run retry` and completes. test_pipeline_learns checks what
the completed run learned; test_retry_resumes_the_failed_stage checks how it got there.

The nights after it, on the same store (its policy is production now):
- one preference row changed, and RL at a learning rate of about 0 (a policy no better than its SFT start): SFT is
  reused, the reward model, RL and the evaluation run again; the new policy is not promoted;
- nothing changed: every stage is reused, no Ray job is submitted;
- the evaluation's HTTP reward endpoint is down: the evaluation fails retryably and commits nothing; the next
  night, the endpoint back, completes, and the whole store verifies;
- the other shapes that start from SFT (RL on an agent's episodes, DPO, KTO), a few steps each, on the same SFT
  (RL with a reward function is the llama3-8b-grpo rehearsal's, tests/test_rehearsals.py).
The GPU presets' rehearsals run in tests/test_rehearsals.py, beside this module.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults import KillJobAfterCheckpoint
from local_pipeline import local_pipeline_environment
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey, FlowRunFilter, FlowRunFilterId
from prefect.settings import PREFECT_API_URL
from reward_server import RewardServer

from flows.full_rlhf import full_rlhf
from flows.results import PipelineResult
from infra.artifacts import open_store
from infra.ray_cluster import free_port, job_client
from infra.settings import PROJECT_ROOT
from pipeline.config import load_pipeline_config
from stages.fields import Output, names_with
from stages.reward_model.config import RewardModelConfig

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
    with local_pipeline_environment(tmp) as head:
        client = job_client(head.address)
        killer = KillJobAfterCheckpoint(tmp / "workspace", "tiny", "rl")
        killer.start()
        failed = full_rlhf(config, return_state=True)
        killer.stop()
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
    assert reward_model["eval_accuracy"] >= 0.95, reward_model
    assert report["accuracy"] - report["reference_accuracy"] >= 0.2, report
    assert math.isfinite(report["kl_mean"]), report
    # Paired on the same prompts: the gain is the difference of the accuracies, beyond noise; the reward model's
    # win rate of the policy's answers over its SFT start comes with its interval.
    assert report["accuracy_gain_vs_reference"] == pytest.approx(report["accuracy"] - report["reference_accuracy"])
    assert 0 < report["accuracy_gain_vs_reference_low"] < report["accuracy_gain_vs_reference_high"], report
    win_rate = [report[f"win_rate_vs_reference{end}"] for end in ("_low", "", "_high")]
    assert 0 <= win_rate[0] <= win_rate[1] <= win_rate[2] <= 1, report
    # The preset's eval suite: the held-out prompts in GSM8K's format score as the prompt set does (within one prompt),
    # answers compared by math-verify, the gain beyond noise; MATH's format with sampled answers and their majority.
    assert report["gsm8k/prompts"] == report["prompts"] == 200, report
    assert abs(report["gsm8k/accuracy"] - report["accuracy"]) <= 1 / 200, report
    assert report["gsm8k/accuracy_gain_vs_reference_low"] > 0 and report["gsm8k/win_rate_vs_reference"] > 0.5, report
    assert report["math/prompts"] == 32 and 0 < report["math/maj4"] <= report["math/pass4"], report

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
    assert result.promotion.promoted and store.get("rl", "production").version == result.stages["rl"].version


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


# ---------------------------------------------------------------------------------------------- the nights after

def jobs_submitted(client) -> int:
    return sum(len(statuses) for statuses in jobs_by_stage(client).values())


def run_night(config) -> dict:
    client = job_client(os.environ["RLHF_RAY_ADDRESS"])
    jobs_before, started = jobs_submitted(client), time.monotonic()
    state = full_rlhf(config, return_state=True)
    return {"state": state, "seconds": time.monotonic() - started, "jobs": jobs_submitted(client) - jobs_before,
            "result": state.result() if state.is_completed() else None}


def change_one_preference_row(path: Path) -> None:
    """Another wrong answer in the first pair's rejected response."""
    rows = path.read_text().splitlines()
    first = json.loads(rows[0])
    wrong = next(f"Answer: {n}" for n in range(30, 40) if f"Answer: {n}" not in (first["chosen"], first["rejected"]))
    rows[0] = json.dumps({**first, "rejected": wrong})
    path.write_text("\n".join(rows) + "\n")


@pytest.fixture(scope="module")
def nights(resumed_run):
    """After resumed_run (production: its policy): a night with one preference row changed and RL at a learning rate
    of about 0, then a night with nothing changed."""
    assert resumed_run["final_state"].is_completed(), retry_output(resumed_run)
    tmp = resumed_run["tmp"]
    change_one_preference_row(tmp / "tiny-assets" / "data" / "pref_train.jsonl")
    config = load_pipeline_config("tiny", {
        "artifact_root": str(tmp / "artifacts"), "tiny_assets_dir": str(tmp / "tiny-assets"),
        "rl": {"actor_learning_rate": 1e-12, "max_samples": 32},  # one step that changes nothing
        "evaluate": {"max_samples": 64, "eval_n_samples_per_prompt": 0},
    })  # fmt: skip
    nights = {"changed": run_night(config), "unchanged": run_night(config)}
    dead = f"http://127.0.0.1:{free_port()}/get_reward"
    nights["endpoint down"] = run_night(config.model_copy(update={"evaluate": config.evaluate.model_copy(
        update={"remote_rm_url": dead})}))  # fmt: skip
    endpoint = RewardServer()
    try:
        nights["endpoint back"] = run_night(config.model_copy(update={"evaluate": config.evaluate.model_copy(
            update={"remote_rm_url": endpoint.url})}))  # fmt: skip
    finally:
        endpoint.close()
    return nights


def test_changed_preference_data_retrains_the_reward_model_and_what_follows(resumed_run, nights):
    night = nights["changed"]
    assert night["state"].is_completed(), night["state"].message
    first, result = resumed_run["final_result"], night["result"]
    assert {stage: r.reused for stage, r in result.stages.items()} == {
        "sft": True, "reward_model": False, "rl": False, "evaluate": False}
    assert {stage: r.version for stage, r in result.stages.items()} == {
        "sft": 1, "reward_model": 2, "rl": 2, "evaluate": 2}
    assert night["jobs"] == 3  # reward model, RL, evaluation: no SFT job

    store = open_store(result.artifact_root, "tiny")
    before, after = store.get("reward_model", 1), store.get("reward_model", 2)
    # Same path, same config, same input: only the content of the preference data differs, and the manifests say so.
    assert before.datasets["dataset"].source == after.datasets["dataset"].source
    assert before.datasets["dataset"].fingerprint != after.datasets["dataset"].fingerprint
    assert before.datasets["eval_dataset"] == after.datasets["eval_dataset"]
    assert {k: v for k, v in before.config.items() if k not in names_with(RewardModelConfig, Output)} == {
        k: v for k, v in after.config.items() if k not in names_with(RewardModelConfig, Output)}
    assert before.inputs == after.inputs and first.stages["sft"].digest == before.inputs["pretrain"].digest


def test_a_policy_worse_than_production_is_not_promoted(resumed_run, nights):
    decision = nights["changed"]["result"].promotion
    production = resumed_run["final_result"].stages["rl"]
    assert not decision.promoted and decision.version == 2 and decision.production_version == production.version
    assert open_store(nights["changed"]["result"].artifact_root, "tiny").get("rl", "production").version == 1
    failures = [line for line in decision.reasons if line.startswith("FAIL")]
    assert any(line.startswith("FAIL accuracy") and "vs production v1" in line for line in failures), failures
    scores = decision.scores
    assert scores["production"]["accuracy"] - scores["policy"]["accuracy"] >= 0.2, scores
    store = open_store(nights["changed"]["result"].artifact_root, "tiny")
    assert store.get("rl", "production").version == 1
    assert store.get("evaluate", 2).inputs["production_pretrain"].digest == production.digest
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["tiny-promotion"])))
    shown = [a.data for a in artifacts if "rl v2: **not promoted**" in a.data]
    assert shown and all("production is rl v1" in text and "| accuracy |" in text for text in shown)


def test_an_unchanged_night_reuses_every_stage_and_submits_no_job(nights):
    night, changed = nights["unchanged"], nights["changed"]
    assert night["state"].is_completed(), night["state"].message
    result = night["result"]
    assert night["jobs"] == 0 and result.unchanged
    assert {stage: (r.version, r.reused) for stage, r in result.stages.items()} == {
        stage: (r.version, True) for stage, r in changed["result"].stages.items()}
    assert result.promotion.reasons == changed["result"].promotion.reasons  # judged as the night before
    assert night["seconds"] < changed["seconds"] / 3, (night["seconds"], changed["seconds"])


def test_a_night_whose_reward_endpoint_is_down_fails_retryably_and_the_next_night_completes(nights):
    down, back = nights["endpoint down"], nights["endpoint back"]
    assert down["state"].is_failed() and down["jobs"] == 1  # the evaluation alone: everything else reused
    message = down["state"].message
    assert "stage evaluate: job" in message and "exit code 1" in message and "reward requests" in message, message
    assert back["state"].is_completed(), back["state"].message
    result = back["result"]
    assert back["jobs"] == 1 and math.isfinite(result.stages["evaluate"].metrics["accuracy"])
    store = open_store(result.artifact_root, "tiny")
    # The failed evaluation committed nothing: the night after found every earlier version readable.
    assert store.versions("evaluate") == [1, 2, 3] and result.stages["evaluate"].version == 3
    done = subprocess.run([sys.executable, "-m", "infra.artifacts", "verify", result.artifact_root, "tiny"],
                          cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0 and "FAILED" not in done.stdout and "UNREADABLE" not in done.stdout, done.stdout


# A few steps each: these runs check that the shapes run end to end, not what they learn. "sft-rl-agent" is the
# tiny-agent preset (it extends tiny): RL on the tiny agent's episodes, the evaluation playing them too; on tiny's
# store (its name), so that it starts from the committed SFT like the others.
SHAPES_FROM_SFT = {"sft-dpo": ("tiny", "sft-dpo", {"dpo": {"max_samples": 64}}),
                   "sft-kto": ("tiny", "sft-kto", {"kto": {"max_samples": 32}}),
                   "sft-rl-agent": ("tiny-agent", "sft-rl", {"name": "tiny", "rl": {"max_samples": 32}})}


@pytest.fixture(scope="module")
def shapes_from_sft(resumed_run):
    tmp = resumed_run["tmp"]
    runs = {}
    for name, (preset, shape, sections) in SHAPES_FROM_SFT.items():
        runs[name] = run_night(load_pipeline_config(preset, {
            "artifact_root": str(tmp / "artifacts"), "tiny_assets_dir": str(tmp / "tiny-assets"), "shape": shape,
            "evaluate": {"max_samples": 16, "eval_n_samples_per_prompt": 0}, **sections}))  # fmt: skip
    return runs


@pytest.mark.parametrize("name", SHAPES_FROM_SFT)
def test_each_shape_from_sft_runs_end_to_end_on_the_committed_sft(resumed_run, shapes_from_sft, name):
    preset, shape, sections = SHAPES_FROM_SFT[name]
    night = shapes_from_sft[name]
    assert night["state"].is_completed(), night["state"].message
    result, sft = night["result"], resumed_run["final_result"].stages["sft"]
    policy = result.stages[result.promotion.stage]
    assert tuple(result.stages) == ("sft", result.promotion.stage, "evaluate") and result.shape == shape
    assert result.stages["sft"] == sft.model_copy(update={"reused": True}) and night["jobs"] == 2
    store = open_store(result.artifact_root, "tiny")
    assert store.get(policy.stage, policy.version).inputs["pretrain"].digest == sft.digest
    evaluation = store.get("evaluate", result.stages["evaluate"].version)
    assert evaluation.inputs["pretrain"].digest == policy.digest
    assert evaluation.inputs["ref_pretrain"].digest == sft.digest
    assert policy.metrics["steps"] >= 1
    report = result.stages["evaluate"].metrics
    assert {"accuracy", "reference_accuracy", "kl_mean"} <= set(report) and math.isfinite(report["kl_mean"])
    # With an agent, RL and the evaluation play its episodes, and no reward function is filled in for either.
    agent = load_pipeline_config(preset).rl.agent_func_path
    expected = str(PROJECT_ROOT / agent) if agent else None
    for record in [evaluation] + ([store.get("rl", policy.version)] if policy.stage == "rl" else []):
        assert record.config.get("agent_func_path") == expected
        assert (record.config.get("remote_rm_url") is None) == bool(agent)
