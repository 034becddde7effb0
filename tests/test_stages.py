"""Each stage entrypoint run for real (`python -m stages.<name>`) with 2 CPU ranks on the tiny model.

These runs share one SFT result (module fixture) so the whole file stays a few minutes long.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from stages.tiny import build_tiny_assets

ROOT = Path(__file__).resolve().parent.parent
STAGE_TIMEOUT_S = 900


def run_stage(stage: str, *flags: str, env: dict | None = None, expect_rc: int = 0) -> subprocess.CompletedProcess:
    """Run a stage entrypoint as a user would, in its own process with a private local Ray."""
    full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--config", "tiny", *map(str, flags)],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    if proc.returncode != expect_rc:
        raise AssertionError(f"stages.{stage} exited {proc.returncode} (expected {expect_rc})\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics_of(path: Path) -> dict:
    return json.loads((path / "metrics.json").read_text())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def max_weight_change(before: Path, after: Path) -> float:
    a, b = weights(before), weights(after)
    return max(float((a[k] - b[k]).abs().max()) for k in a if k in b)


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return build_tiny_assets(tmp_path_factory.mktemp("tiny"), seed=0)


# Two epochs over the tiny SFT set: 150 steps of 32 examples, a checkpoint every 50.
SFT_FLAGS = ("--max_epochs", 2, "--train_batch_size", 32, "--micro_train_batch_size", 8, "--num_gpus_per_node", 2,
             "--zero_stage", 2, "--save_steps", 50, "--logging_steps", 50)


@pytest.fixture(scope="module")
def sft_model(assets, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sft")
    run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"],
              "--eval_dataset", assets["sft_eval"], "--save_path", out / "model", "--ckpt_path", out / "ckpt",
              *SFT_FLAGS)
    return out / "model"


def test_sft_learns_and_exports_a_loadable_model(sft_model, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = metrics_of(sft_model)
    assert metrics["steps"] == 150 and metrics["resumed_from_step"] == 0
    assert metrics["train_loss_last"] < 0.1 * metrics["train_loss_first"], metrics
    assert metrics["eval_loss"] < metrics["train_loss_first"], metrics
    assert max_weight_change(assets["model"], sft_model) > 1e-3
    model = AutoModelForCausalLM.from_pretrained(sft_model)
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    assert model.config.vocab_size == len(tokenizer)


def test_sft_resume_after_crash_repeats_the_uninterrupted_losses(sft_model, assets, tmp_path):
    """A run killed right after its first checkpoint, then restarted, logs the very losses of the full run."""
    flags = ("--pretrain", assets["model"], "--dataset", assets["sft_train"], "--save_path", tmp_path / "model",
             "--ckpt_path", tmp_path / "ckpt", *SFT_FLAGS)
    crashed = run_stage("sft", *flags, env={"RLHF_FAULT_INJECT": "sft:after_checkpoint"}, expect_rc=3)
    assert "fault injected after the checkpoint of step 50" in crashed.stderr
    assert not (tmp_path / "model" / "metrics.json").exists()
    run_stage("sft", *flags)
    assert metrics_of(tmp_path / "model")["resumed_from_step"] == 50

    full = json.loads((sft_model / "history.json").read_text())
    resumed = json.loads((tmp_path / "model" / "history.json").read_text())
    assert [r["step"] for r in resumed] == list(range(1, 151))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full], rel=1e-5)
    assert "[sft] step 50/150 (33%" in crashed.stdout and f"loss={full[49]['loss']:.4f}" in crashed.stdout
    assert max_weight_change(sft_model, tmp_path / "model") < 1e-5


def test_reward_model_separates_chosen_from_rejected(sft_model, assets, tmp_path):
    from transformers import AutoModelForSequenceClassification

    out = tmp_path / "rm"
    run_stage("reward_model", "--pretrain", sft_model, "--dataset", assets["pref_train"],
              "--eval_dataset", assets["pref_eval"], "--save_path", out, "--ckpt_path", tmp_path / "ckpt",
              "--max_epochs", 3, "--learning_rate", "1e-3", "--train_batch_size", 32, "--micro_train_batch_size", 8,
              "--num_gpus_per_node", 2, "--zero_stage", 3)  # ZeRO-3: sharded load, gathered export
    metrics = metrics_of(out)
    losses = [r["loss"] for r in json.loads((out / "history.json").read_text())]
    # Pairwise loss starts at log 2; the tiny reward model needs ~100 steps before it drops (the pipeline's
    # 600-step preset reaches >= 0.9 held-out accuracy, checked by tests/test_pipeline.py).
    assert sum(losses[-25:]) / 25 < sum(losses[:25]) / 25 - 0.05, metrics
    assert metrics["eval_accuracy"] >= 0.58, metrics
    config = json.loads((out / "config.json").read_text())
    assert config["reward_std"] > 0 and "reward_mean" in config
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1


def test_dpo_prefers_chosen_answers(sft_model, assets, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    run_stage("dpo", "--pretrain", sft_model, "--dataset", assets["pref_train"], "--eval_dataset", assets["pref_eval"],
              "--save_path", out, "--ckpt_path", tmp_path / "ckpt", "--num_gpus_per_node", 2)
    metrics = metrics_of(out)
    # Policy equals reference at the start: the loss is exactly log 2.
    assert metrics["train_loss_first"] == pytest.approx(0.693147, abs=1e-5)
    assert metrics["train_loss_last"] < 0.66 and metrics["eval_loss"] < 0.66, metrics
    assert metrics["eval_accuracy"] >= 0.6, metrics
    assert max_weight_change(sft_model, out) > 1e-4
    AutoModelForCausalLM.from_pretrained(out)


def test_evaluate_compares_policy_with_reference(sft_model, assets, tmp_path):
    out = tmp_path / "report"
    run_stage("evaluate", "--pretrain", sft_model, "--ref_pretrain", sft_model, "--remote_rm_url",
              "stages/tiny_reward.py", "--prompt_data", assets["prompts_eval"], "--save_path", out,
              "--num_gpus_per_node", 2, "--max_samples", 64)
    metrics = metrics_of(out)
    assert metrics["prompts"] == 64
    # Same weights on both sides: equal greedy accuracy and an (estimated) KL of zero.
    assert metrics["accuracy"] == metrics["reference_accuracy"]
    assert abs(metrics["kl_mean"]) < 1e-4
    assert 0 < metrics["response_length"] <= 32


def test_bad_data_fails_before_training_with_exit_code_2(assets, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "1 + 1 = ?", "response": "Answer: 2"}\n{"prompt": "  ", "response": "Answer: 3"}\n')
    proc = run_stage("sft", "--pretrain", assets["model"], "--dataset", bad, "--save_path", tmp_path / "out",
                     expect_rc=2)
    assert "bad.jsonl" in proc.stderr and "1" in proc.stderr
