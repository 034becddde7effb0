"""The benchmark harness in its quick form: the RL stage and SFT measured, a table and JSON written.

TRL's side runs only where the `bench` extra is installed; without it the table says so and the rest still runs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHASES = {"generation", "reward", "experience_ref_logprobs", "training", "weight_sync", "idle"}


@pytest.mark.slow
def test_quick_bench_writes_the_table_and_json(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out), "--work_dir", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    ours = results["rl"]["tiny"]["ours"]
    assert ours["samples_per_s"] > 0 and 0 < ours["startup_seconds"] < ours["command_seconds"]
    assert PHASES <= set(ours["phases"]), ours["phases"]
    assert all(ours["phases"][name] >= 0 for name in PHASES)
    assert len(ours["train_rewards"]) == 2 and all(0 <= reward <= 1 for reward in ours["train_rewards"])
    accuracy = results["rl"]["tiny"]["accuracy"]
    assert accuracy["seeds"] == [42] and accuracy["ours"] == [ours["eval_accuracy"]]
    assert "held-out greedy accuracy (mean of 1 seed: " in results["table"]
    assert list(results["supervised"]) == ["sft"] and results["supervised"]["sft"]["tokens_per_s"] > 0
    trl = results["rl"]["tiny"]["trl"]
    if importlib.util.find_spec("trl") is None:
        assert trl is None and "not installed" in results["table"]
    else:
        assert trl["samples_per_s"] > 0 and "x |" in results["table"] and len(trl["train_rewards"]) == 2
    assert "training loop samples/s" in proc.stdout and "tokens/s" in proc.stdout
    later = results["rl"]["tiny"]["async"]
    assert later["samples_per_s"] > 0 and later["phases"]["rollout_wait"] >= 0 and 0 < later["generation_share"]
    assert "async (queue 1)" in results["table"] and "seconds the trainer waited for rollouts" in results["table"]


@pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="compares with TRL: needs the bench extra")
def test_one_update_on_the_same_batch_matches_trls(sft_model, assets, tmp_path):
    """Sampling noise taken out: advantages, loss and gradient of one GRPO update on one sampled batch equal TRL's
    own `_compute_loss`, and our DeepSpeed engine's optimizer step equals torch AdamW with clipping."""
    out = tmp_path / "same-batch.json"
    proc = subprocess.run([sys.executable, "-m", "bench.same_batch", "--model", str(sft_model), "--prompts",
                           str(assets["prompts_train"]), "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    same = json.loads(out.read_text())
    assert 0 < same["reward_mean"] < 1  # some groups have advantages: the policy term is not zero
    assert same["advantage_max_difference"] < 1e-3  # TRL's std + 1e-4 against OpenRLHF's std + 1e-9
    assert same["loss"]["ours"] == pytest.approx(same["loss"]["trl"], rel=1e-3)
    assert same["gradient_norm"]["ours"] == pytest.approx(same["gradient_norm"]["trl"], rel=1e-3)
    assert same["gradient_cosine"] > 0.9999
    assert same["optimizer_step_max_parameter_difference"] < 1e-6


def test_the_data_bench_writes_real_format_rows_and_reads_what_the_stage_prints(tmp_path):
    """`python -m bench --data`'s synthetic pairs pass the reward model's schema in the seed's conversation layout,
    with the stated lengths; its parser reads both lines a stage prints about its examples."""
    from bench import data_scale
    from stages import data
    from stages.cli import parse_stage_args
    from stages.prepared import Preparation
    from stages.registry import STAGES

    path = data_scale.write_pairs(tmp_path / "pairs.jsonl", 50)
    cfg = parse_stage_args(STAGES["reward_model"], ["--config", "tiny", "--pretrain", "unused", "--dataset", str(path),
                                                    "--prompt_key", "none"])
    cfg.validate_rows(data.load_rows(str(path)), str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert all(row["chosen"][0] == row["rejected"][0] and 20 <= len(row["chosen"][0]["content"].split()) <= 90
               and 60 <= len(row["rejected"][1]["content"].split()) <= 200 for row in rows)
    first = Preparation([1] * 98, 100, 12.5, False, 2, 1.5).summary("training rows")
    again = Preparation([1] * 98, 100, 0.4, True, 1, 0.5).summary("training rows")
    assert data_scale.PREPARED.search(first)["rate"] == "8" and data_scale.PREPARED.search(first)["seconds"] == "12.5"
    assert data_scale.PREPARED.search(again)["how"].startswith("from the cache")
