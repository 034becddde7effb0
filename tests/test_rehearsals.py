"""`python -m flows.run --preset <preset> --rehearse`, as a user runs it, for each GPU preset: the preset's stages on
CPU with only the stated swaps (tiny models and data in the presets' formats, GPU counts scaled to 2 CPU ranks per
model), through Prefect and Ray. The RL job of the llama3-8b rehearsal is the seed's hybrid-engine PPO command (see
tests/test_rl.py). An RL job killed after its checkpoint and resumed through the task's retry is tests/test_pipeline.py's
(its driver killed) and tests/test_deployment.py's (the Ray head killed).
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
from fsspec.core import url_to_fs
from local_pipeline import local_pipeline_environment
from prefect.settings import PREFECT_API_URL
from stage_runs import max_weight_change

from infra.artifacts import open_store
from infra.ray_cluster import job_client
from infra.settings import PROJECT_ROOT
from pipeline.config import load_pipeline_config, policy_stage
from stages.fields import Output, names_with
from stages.registry import STAGES

pytestmark = pytest.mark.pipeline

GPU_PRESETS = ("llama3-8b", "llama3-8b-grpo")


@pytest.fixture(scope="module")
def rehearsals(tmp_path_factory):
    """Each preset's rehearsal on this module's Prefect server and Ray head."""
    tmp = tmp_path_factory.mktemp("rehearsals")
    with local_pipeline_environment(tmp) as head:
        yield rehearse_each(tmp, job_client(head.address))


def local_dir(uri: str) -> Path:
    """A version in the local store, as a directory (its URI is file:...)."""
    return Path(url_to_fs(uri)[1])


def rehearse_each(tmp, client) -> dict:
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    runs = {}
    for preset in GPU_PRESETS:
        root = tmp / preset
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "flows.run", "--preset", preset, "--rehearse", "--artifact_root",
                               str(root)], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=1800,
                              env={**env, "RLHF_MAX_RETRIES": "0"})  # fmt: skip
        rl_jobs = sorted((job for job in client.list_jobs() if job.metadata.get("pipeline") == preset
                          and job.metadata.get("stage") == "rl"), key=lambda job: int(job.metadata["attempt"]))
        runs[preset] = {"done": done, "seconds": time.monotonic() - started, "root": root,
                        "rl_jobs": [job.status.value for job in rl_jobs]}
    return runs


@pytest.mark.parametrize("preset", GPU_PRESETS)
def test_gpu_preset_rehearsed_on_cpu_end_to_end(rehearsals, preset):
    run = rehearsals[preset]
    out = run["done"].stdout
    assert run["done"].returncode == 0, out[-6000:] + run["done"].stderr[-6000:]
    print(f"{preset} rehearsed in {run['seconds']:.0f} s\n{out}")
    assert f"rehearsal of {preset} completed in" in out
    table = out.split("but for these swaps\n\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split() == ["stage", "field", "preset", "rehearsal", "why"]
    config = load_pipeline_config(preset)
    swapped = {tuple(line.split()[:2]) for line in table[1:]}
    store = open_store(str(run["root"] / "artifacts"), preset)
    for stage in config.stages:
        manifest = store.get(stage, 1)
        preset_values = config.section(stage).model_dump(mode="json")
        for field, value in manifest.config.items():  # what the job ran with: the preset's, but for the swaps
            if field in manifest.inputs or field in names_with(STAGES[stage], Output) or (stage, field) in swapped:
                continue
            preset_value = preset_values[field]  # a relative path is made absolute for the jobs
            assert value == preset_value or value == str((PROJECT_ROOT / str(preset_value)).resolve()), (stage, field)
    assert store.get(policy_stage(config.shape), 1).metrics["steps"] >= 2
    logged = out + run["done"].stderr  # the stages' job logs come through the flow's log
    if preset == "llama3-8b":  # PPO on the hybrid engine: every model on 2 CPU ranks, the GPU-only flags said once
        assert "roles {'actor': 2, 'critic': 2, 'ref': 2, 'reward': 2} + 1 engine(s)" in logged
        rl, sft = (local_dir(store.get(stage, 1).uri) for stage in ("rl", "sft"))
        history = json.loads((rl / "history.json").read_text())
        assert len(history) == 2 and all(math.isfinite(r["critic_loss"]) for r in history)
        assert max_weight_change(sft, rl) > 0
        assert run["rl_jobs"] == ["SUCCEEDED"] and store.get("rl", 1).config["save_steps"] == 1  # the preset's rate
        for flag in ("vllm_enable_sleep", "deepspeed_enable_sleep"):  # said once
            assert logged.count(f"[rl] --{flag} has no effect on CPU") == 1

