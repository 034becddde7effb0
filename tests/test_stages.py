"""Each stage entrypoint run for real (`python -m stages.<name>`, or under `deepspeed --module`) on the tiny model,
with the preset's one CPU rank or with two where data parallelism is what a run checks.

These runs share one SFT result (module fixture) so the whole file stays a few minutes long; ZeRO stages 0-3 are
spread over them.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stages import data, packing, sequences, tiny
from stages.model_io import load_tokenizer

from conftest import SFT_FLAGS, SFT_STEPS
from infra.ray_cluster import free_port
from faults import rewound_checkpoints
from stage_runs import ROOT, STAGE_TIMEOUT_S, history_of, max_weight_change, metrics_of, run_stage, tiny_suite

# Runs the stage entrypoints (Ray, DeepSpeed, a model trained per test): the full suite's tier.
pytestmark = pytest.mark.slow

LAUNCHER_ENV = {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}


def launcher_command(stage: str, *flags) -> list:
    """A stage under the DeepSpeed launcher with 2 CPU ranks, as the seed's commands run (no Ray)."""
    launcher = Path(sys.executable).parent / "deepspeed"
    return [str(launcher), "--num_gpus", "2", "--master_port", str(free_port()), "--module", f"stages.{stage}",
            *map(str, flags)]


def run_launcher(stage: str, *flags, expect_rc: int = 0) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **LAUNCHER_ENV}
    full_env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(launcher_command(stage, *flags), cwd=ROOT, env=full_env, capture_output=True, text=True,
                          timeout=STAGE_TIMEOUT_S)
    if proc.returncode != expect_rc:
        raise AssertionError(f"deepspeed --module stages.{stage} exited {proc.returncode} (expected {expect_rc})\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def greedy_accuracy(model_dir: Path, prompts_file: Path) -> float:
    """Share of held-out prompts whose greedy answer (HF generate, 8 new tokens) is the sum."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    rows = [json.loads(line) for line in prompts_file.read_text().splitlines()]
    prompts = [data.format_prompt(tokenizer, row["prompt"], apply_chat_template=True) for row in rows]
    input_ids, attention_mask = sequences.pad_sequences(tokenizer(prompts, add_special_tokens=False)["input_ids"],
                                                   tokenizer.pad_token_id, side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=8, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    responses = tokenizer.batch_decode(out[:, input_ids.shape[1] :], skip_special_tokens=True)
    return float(tiny.reward_func(responses, [""] * len(rows), [row["label"] for row in rows]).mean())


@pytest.fixture(scope="module")
def sft_accuracy(sft_model, assets) -> float:
    return greedy_accuracy(sft_model, assets["prompts_eval"])


def test_sft_learns_and_exports_a_loadable_model(sft_model, assets):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    metrics = metrics_of(sft_model)
    assert metrics["steps"] == SFT_STEPS and metrics["resumed_from_step"] == 0
    assert all(metrics[f"seconds/{phase}"] > 0 for phase in ("forward_backward", "optimizer", "checkpoint"))
    assert metrics["tokens_per_second"] > 0 and all(r["tokens"] > 0 for r in history_of(sft_model))
    assert metrics["train_loss_last"] < 0.1 * metrics["train_loss_first"], metrics
    assert metrics["eval_loss"] < metrics["train_loss_first"], metrics
    assert max_weight_change(assets["model"], sft_model) > 1e-3
    model = AutoModelForCausalLM.from_pretrained(sft_model)
    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    assert model.config.vocab_size == len(tokenizer)


def test_sft_resumed_from_its_last_checkpoint_repeats_the_uninterrupted_losses(sft_model, assets, tmp_path):
    """The session SFT's checkpoints as a run killed right after its newest one (step 200) leaves them, restarted:
    the very losses and weights of the uninterrupted run."""
    flags = ("--pretrain", assets["model"], "--dataset", assets["sft_train"], "--eval_dataset", assets["sft_eval"],
             "--save_path", tmp_path / "model", "--ckpt_path", tmp_path / "ckpt", *SFT_FLAGS)
    rewound_checkpoints(sft_model.parent / "ckpt", tmp_path / "ckpt", 200)
    proc = run_stage("sft", *flags)
    assert metrics_of(tmp_path / "model")["resumed_from_step"] == 200
    output = proc.stdout + proc.stderr
    assert "Warning" not in output  # third-party deprecations (stages.tracking) dropped
    assert "Loading weights" not in output and "Writing model shards" not in output  # nor transformers' bars

    full = json.loads((sft_model / "history.json").read_text())
    resumed = json.loads((tmp_path / "model" / "history.json").read_text())
    assert [r["step"] for r in resumed] == list(range(1, SFT_STEPS + 1))
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in full], rel=1e-5)
    assert metrics_of(tmp_path / "model")["eval_loss"] == pytest.approx(metrics_of(sft_model)["eval_loss"], rel=1e-5)
    assert max_weight_change(sft_model, tmp_path / "model") < 1e-5


def test_sft_trains_on_a_mixture_interleaved_by_its_probabilities(assets, tmp_path):
    """OpenRLHF's --dataset a,b --dataset_probs: the ranks read the seeded interleaving of both datasets."""
    mixture, probs = f"{assets['sft_train']},{assets['sft_eval']}", "0.75,0.25"
    proc = run_stage("sft", "--pretrain", assets["model"], "--dataset", mixture, "--dataset_probs", probs,
                     "--max_samples", 96, "--max_epochs", 1, "--save_path", tmp_path / "model",
                     "--ckpt_path", tmp_path / "ckpt", "--num_gpus_per_node", 2)
    expected = data.load_mixture(mixture, max_samples=96, probabilities=[0.75, 0.25], seed=42)
    assert {row["prompt"] for row in data.load_rows(assets["sft_eval"])} & {row["prompt"] for row in expected}
    assert f'"train_examples": {len(expected)}' in proc.stdout
    assert len(history_of(tmp_path / "model")) == len(expected) // 32


def test_checkpoints_of_another_run_are_refused(sft_model, assets, tmp_path):
    """A stage pointed at checkpoints it did not write stops before training, naming what differs."""
    proc = run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"],
                     "--save_path", tmp_path / "model", "--ckpt_path", sft_model.parent / "ckpt", *SFT_FLAGS,
                     "--learning_rate", "1e-3", expect_rc=2)
    assert "holds checkpoints (step 200) of another run: --learning_rate 0.002 -> 0.001" in proc.stderr
    assert "--load_checkpoint" in proc.stderr and not (tmp_path / "model").exists()


def test_reward_model_separates_chosen_from_rejected(reward_model):
    from transformers import AutoModelForSequenceClassification

    out = reward_model  # the tiny preset's reward model, ZeRO-3 (conftest.py)
    assert metrics_of(out)["eval_accuracy"] >= 0.95
    losses = [r["loss"] for r in history_of(out)]
    assert losses[0] == pytest.approx(0.693, abs=0.05) and sum(losses[-25:]) / 25 < sum(losses[:25]) / 25 - 0.2
    config = json.loads((out / "config.json").read_text())
    assert config["reward_std"] > 0 and "reward_mean" in config
    model = AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == 1


def test_dpo_prefers_chosen_answers_and_answers_better(sft_model, sft_accuracy, assets, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "dpo"
    run_stage("dpo", "--pretrain", sft_model, "--dataset", assets["pref_train"], "--eval_dataset", assets["pref_eval"],
              "--save_path", out, "--ckpt_path", tmp_path / "ckpt", "--num_gpus_per_node", 2)
    metrics = metrics_of(out)
    # Policy equals reference at the start: the loss is exactly log 2.
    assert metrics["train_loss_first"] == pytest.approx(0.693147, abs=1e-5)
    assert metrics["train_loss_last"] < 0.5 and metrics["eval_loss"] < 0.5, metrics
    # Implicit-reward accuracy on held-out pairs, and greedy answers to held-out prompts.
    assert metrics["eval_accuracy"] >= 0.9, metrics
    assert greedy_accuracy(out, assets["prompts_eval"]) > sft_accuracy + 0.1, (metrics, sft_accuracy)
    assert max_weight_change(sft_model, out) > 1e-4
    AutoModelForCausalLM.from_pretrained(out)


def test_qlora_dpo_on_4bit_policy_and_reference_answers_better(sft_model, sft_accuracy, assets, tmp_path):
    """--load_in_4bit (QLoRA): the policy and the reference load with 4-bit NF4 weights (bitsandbytes), LoRA adapters
    train on the policy in bfloat16, and the output is the full bfloat16 model (dequantized, merged)."""
    out = tmp_path / "dpo"
    run_stage("dpo", "--pretrain", sft_model, "--dataset", assets["pref_train"], "--eval_dataset", assets["pref_eval"],
              "--load_in_4bit", "--bf16", "--lora_rank", 8, "--lora_alpha", 16, "--learning_rate", "4e-3",
              "--num_gpus_per_node", 1, "--max_samples", 960, "--save_path", out, "--ckpt_path", tmp_path / "ckpt")
    metrics = metrics_of(out)
    # Policy and reference start from the same 4-bit weights: log 2, up to bfloat16 rounding.
    assert metrics["train_loss_first"] == pytest.approx(0.693, abs=0.01)
    # 960 pairs × 2 epochs (60 steps): last loss 0.34, held-out accuracy 0.84, greedy accuracy 0.02 → 0.56.
    assert metrics["train_loss_last"] < 0.45 and metrics["eval_accuracy"] >= 0.8, metrics
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    assert (out / "lora_adapter" / "adapter_config.json").is_file()
    assert greedy_accuracy(out, assets["prompts_eval"]) > sft_accuracy + 0.3


def lm_eval_tasks(assets, folder: Path) -> Path:
    """Local lm-evaluation-harness tasks on the tiny task's held-out data, one per kind of request: the prompts in
    GSM8K's layout answered by generation (an answer filter, exact match), the right answer against the wrong one
    of each held-out pair by log-likelihood (multiple choice), and the right answer as a greedy continuation
    (log-likelihood: acc is "greedy decoding says it"), and the SFT texts' perplexity (rolling log-likelihood)."""
    folder.mkdir()
    tasks = {
        "tiny_gsm8k": {"dataset_kwargs": {"data_files": {"test": str(assets["prompts_eval_gsm8k"])}},
                       "output_type": "generate_until", "doc_to_text": "{{question}}",
                       "doc_to_target": "{{answer.split('#### ')[-1]}}",
                       "generation_kwargs": {"until": ["<|eos|>"], "do_sample": False},
                       "filter_list": [{"name": "answer", "filter": [
                           {"function": "regex", "regex_pattern": "Answer: (-?[0-9]+)"}, {"function": "take_first"}]}],
                       "metric_list": [{"metric": "exact_match"}]},
        "tiny_choice": {"dataset_kwargs": {"data_files": {"test": str(assets["pref_eval"])}},
                        "output_type": "multiple_choice", "doc_to_text": "{{prompt}}", "target_delimiter": "",
                        "doc_to_choice": "{{[chosen, rejected]}}", "doc_to_target": 0,
                        "metric_list": [{"metric": "acc"}]},
        "tiny_greedy": {"dataset_kwargs": {"data_files": {"test": str(assets["prompts_eval"])}},
                        "output_type": "loglikelihood", "doc_to_text": "{{prompt}}", "target_delimiter": "",
                        "doc_to_target": "Answer: {{label}}<|eos|>", "metric_list": [{"metric": "acc"}]},
        "tiny_perplexity": {"dataset_kwargs": {"data_files": {"test": str(assets["pretrain_train"])}},
                            "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
                            "metric_list": [{"metric": "word_perplexity"}]},
    }
    for name, task in tasks.items():
        (folder / f"{name}.yaml").write_text(json.dumps({"task": name, "dataset_path": "json", "test_split": "test",
                                                        **task}))  # JSON is YAML
    return folder


def choice_accuracy(model_dir: Path, pairs_file: Path, rows: int) -> float:
    """Share of held-out pairs whose right answer the model finds likelier than the wrong one after the prompt
    (summed log-probs, HF forward): what the tiny_choice task's acc measures."""
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()

    def logprob(context: str, answer: str) -> float:
        context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
        ids = tokenizer(context + answer, add_special_tokens=False)["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1)
        return sum(float(logits[i - 1, ids[i]]) for i in range(len(context_ids), len(ids)))

    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines()[:rows]]
    wins = [logprob(context, p["chosen"]) > logprob(context, p["rejected"]) for p in pairs
            for context in [data.format_prompt(tokenizer, p["prompt"], apply_chat_template=True)]]
    return sum(wins) / len(wins)


def test_evaluate_compares_policy_with_reference(sft_model, assets, tmp_path):
    """The held-out prompts, and the same prompts as gsm8k and math benchmarks of an eval suite: answers compared
    with math-verify score as the tiny task's own reward does; lm-evaluation-harness tasks on the same data, through
    the same engines (vLLM), score as the stage's own metrics and an HF forward do; the policy's samples scored by
    transformers as by the engines (the log-prob gap the gate may bound)."""
    out = tmp_path / "report"
    run_stage("evaluate", "--pretrain", sft_model, "--ref_pretrain", sft_model, "--remote_rm_url",
              "stages/tiny_reward.py", "--prompt_data", assets["prompts_eval"], "--save_path", out,
              "--num_gpus_per_node", 2, "--max_samples", 64, "--rollout_backend", "vllm",
              "--eval_suite", tiny_suite(assets, tmp_path / "suite.yaml", 64, preferences=False),
              "--lm_eval", "tiny_gsm8k,tiny_choice", "tiny_greedy", "tiny_perplexity",
              "--lm_eval_include_path", lm_eval_tasks(assets, tmp_path / "lm-eval-tasks"))
    metrics = metrics_of(out)
    assert metrics["prompts"] == metrics["gsm8k/prompts"] == metrics["math/prompts"] == 64
    # Same weights on both sides: equal greedy accuracy, no paired difference on any prompt, a KL of zero.
    assert metrics["accuracy"] == metrics["reference_accuracy"]
    assert [metrics[f"accuracy_gain_vs_reference{end}"] for end in ("", "_low", "_high")] == [0.0, 0.0, 0.0]
    assert abs(metrics["kl_mean"]) < 1e-4
    assert metrics["logprob_gap_samples"] == 32 and 0 < metrics["logprob_gap_mean"] < 1e-3, metrics
    assert 0 < metrics["response_length"] <= 32
    # The same greedy answers, judged by math-verify against the labels in GSM8K's and MATH's forms.
    assert metrics["gsm8k/accuracy"] == metrics["math/accuracy"] == metrics["accuracy"] > 0, metrics
    assert metrics["gsm8k/extraction_failures"] < 0.1 and metrics["gsm8k/maj4"] >= 0
    assert metrics["gsm8k/accuracy_gain_vs_reference_low"] == metrics["gsm8k/accuracy_gain_vs_reference_high"] == 0
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert {s["benchmark"] for s in samples} == {"", "gsm8k", "math"}
    # lm-eval: the same greedy answers, filtered by its regex; the right answer as greedy decoding's continuation;
    # the multiple choice as an HF forward scores it; each for both models (same weights: same numbers).
    harness = {key: value for key, value in metrics.items() if key.startswith("lm_eval/")}
    assert harness["lm_eval/tiny_gsm8k/exact_match_answer"] == metrics["gsm8k/accuracy"], harness
    assert abs(harness["lm_eval/tiny_greedy/acc"] - metrics["accuracy"]) <= 1 / 64, harness  # within one prompt
    assert harness["lm_eval/tiny_choice/acc"] == pytest.approx(choice_accuracy(sft_model, assets["pref_eval"], 64))
    assert 1 < harness["lm_eval/tiny_perplexity/word_perplexity"] < math.inf
    for key, value in harness.items():
        task, metric = key.split("/")[1:]
        if not metric.startswith("reference_"):
            assert harness[f"lm_eval/{task}/reference_{metric}"] == pytest.approx(value), key


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
def test_bad_data_fails_before_training_with_exit_code_2(stage, assets, tmp_path):
    """A blank SFT prompt, a preference file with a byte that is not UTF-8: one report naming file, check and row."""
    bad = tmp_path / "bad.jsonl"
    if stage == "sft":
        bad.write_text('{"prompt": "1 + 1 = ?", "response": "Answer: 2"}\n{"prompt": "  ", "response": "Answer: 3"}\n')
        expected = "column 'prompt' (--input_key): check not_blank failed (empty or whitespace-only text) at rows [1]"
    else:
        rows = assets["pref_train"].read_bytes().splitlines()[:4]
        rows[2] = rows[2].replace(b"Answer", b"Ans\xffwer", 1)
        bad.write_bytes(b"\n".join(rows) + b"\n")
        expected = "check valid_utf8 failed (text is not valid UTF-8) at rows [2]"
    proc = run_stage(stage, "--pretrain", assets["model"], "--dataset", bad, "--save_path", tmp_path / "out",
                     expect_rc=2)
    assert f"data in {bad} " in proc.stderr and expected in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_flipped_byte_in_a_committed_model_stops_the_stage_before_any_rank_starts(assets, tmp_path):
    """A model committed to a store as SFT's output, one byte of its weights flipped: the reward model that would
    train from it exits 2 naming the file, before a rank starts or a checkpoint is written."""
    from infra.artifacts import open_store

    store = open_store(str(tmp_path / "artifacts"), "tiny")
    sft = store.commit("sft", assets["model"], config={})
    weights = Path(sft.uri.removeprefix("file://")) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    proc = run_stage("reward_model", "--pretrain", sft.uri.removeprefix("file://"), "--dataset", assets["pref_train"],
                     "--save_path", tmp_path / "out", "--ckpt_path", tmp_path / "ckpt", expect_rc=2)  # fmt: skip
    assert "--pretrain" in proc.stderr and "v0001/model.safetensors: sha256" in proc.stderr, proc.stderr
    assert "ranks on" not in proc.stdout and not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------ supervised stages: KTO, seeds, LoRA, failures

KTO_FLAGS = ("--zero_stage", 1, "--save_steps", 50, "--logging_steps", 25)  # 100 steps of 16 samples


def test_kto_answers_better_than_its_sft_start(sft_model, sft_accuracy, assets, tmp_path):
    """KTO (ZeRO-1) on TRL-style unpaired rows, from the SFT model."""
    out = tmp_path / "kto"
    run_stage("kto", "--pretrain", sft_model, "--dataset", assets["kto_train"], "--save_path", out,
              "--ckpt_path", tmp_path / "ckpt", *KTO_FLAGS)
    metrics, history = metrics_of(out), history_of(out)
    # Policy equals reference at the start: every sample loses exactly 1 - sigmoid(0).
    assert history[0]["loss"] == pytest.approx(0.5, abs=1e-6) and history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    assert history[-1]["desirable_reward"] > 0 > history[-1]["undesirable_reward"], history[-1]
    assert all(metrics[f"seconds/{phase}"] > 0 for phase in ("forward_backward", "optimizer", "checkpoint"))
    assert greedy_accuracy(out, assets["prompts_eval"]) > sft_accuracy + 0.1, metrics
    assert max_weight_change(sft_model, out) > 1e-4


def test_kto_resumed_after_a_crash_repeats_the_uninterrupted_losses(sft_model, assets, tmp_path):
    """Four steps uninterrupted on 2 ranks (ZeRO-1: each rank checkpoints its part of the optimizer), then restarted
    from its checkpoints as a kill after step 2 leaves them: the same four steps."""
    def flags(out: Path) -> tuple:
        return ("--pretrain", sft_model, "--dataset", assets["kto_train"], "--max_samples", 64, "--save_path",
                out / "model", "--ckpt_path", out / "ckpt", *KTO_FLAGS, "--save_steps", 2, "--num_gpus_per_node", 2)

    run_stage("kto", *flags(tmp_path / "full"))
    rewound_checkpoints(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt", 2)
    run_stage("kto", *flags(tmp_path / "resumed"))
    assert metrics_of(tmp_path / "resumed" / "model")["resumed_from_step"] == 2
    full, resumed = history_of(tmp_path / "full" / "model"), history_of(tmp_path / "resumed" / "model")
    assert [r["step"] for r in resumed] == [r["step"] for r in full] == [1, 2, 3, 4]
    for key in ("loss", "kl", "desirable_reward", "undesirable_reward"):
        assert [r[key] for r in resumed] == pytest.approx([r[key] for r in full], rel=1e-5, abs=1e-7), key
    assert max_weight_change(tmp_path / "full" / "model", tmp_path / "resumed" / "model") < 1e-6


def seed_command(command: str, assets, out: Path, *extra) -> tuple[str, list]:
    """A seed command with our module path, the tiny model and the preference fixture in the seed dataset's
    layout, scaled from 8 GPUs to 2 CPU ranks (global batch / 16, the seed's micro-batch: several accumulated per
    step) and to 64 rows: four steps."""
    from tests.test_config import stage_argv

    stage, argv = stage_argv(command)
    values = {"--pretrain": assets["model"], "--dataset": assets["pref_chat_train"], "--save_path": out / "model",
              "--train_batch_size": int(argv[argv.index("--train_batch_size") + 1]) // 16}
    argv = [values.get(argv[i - 1], word) if i else word for i, word in enumerate(argv)]
    return stage, [*argv, "--num_gpus_per_node", 2, "--max_samples", 64, "--ckpt_path", out / "ckpt", *extra]


@pytest.mark.parametrize("seed, resumed", [("SEED_RM", True), ("SEED_DPO", False)])
def test_seed_command_trains_under_the_deepspeed_launcher(seed, resumed, assets, tmp_path):
    """The seed's train_rm / train_dpo lines (ZeRO-3, bf16, gradient checkpointing, --flash_attn, chat-format pairs
    without --prompt_key) under `deepspeed --module`. The reward model's is also restarted from its checkpoints as a
    kill after step 2 leaves them: the same losses (DPO's resume is the same loop as KTO's, resumed exactly on Ray
    above)."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from tests import test_config

    checkpoints = ("--save_steps", 2) if resumed else ()  # the seed's -1 saves none
    stage, argv = seed_command(getattr(test_config, seed), assets, tmp_path / "full", *checkpoints)
    full = run_launcher(stage, *argv)
    assert full.stdout.count(f"[{stage}] --flash_attn has no effect on CPU") == 1
    history = history_of(tmp_path / "full" / "model")
    assert [r["step"] for r in history] == [1, 2, 3, 4]
    assert all(math.isfinite(r["loss"]) and 0 < r["grad_norm"] < math.inf for r in history)  # steps were taken
    output = tmp_path / "full" / "model"

    if resumed:
        _, argv = seed_command(getattr(test_config, seed), assets, tmp_path / "resumed", *checkpoints)
        rewound_checkpoints(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt", 2)
        run_launcher(stage, *argv)
        output = tmp_path / "resumed" / "model"
        assert metrics_of(output)["resumed_from_step"] == 2
        assert [r["loss"] for r in history_of(output)] == pytest.approx([r["loss"] for r in history], rel=1e-5)
        assert max_weight_change(tmp_path / "full" / "model", output) == 0.0

    model_cls = AutoModelForSequenceClassification if stage == "reward_model" else AutoModelForCausalLM
    model = model_cls.from_pretrained(output)
    assert model.dtype == torch.bfloat16
    if stage == "reward_model":  # no --eval_dataset in the seed: --normalize_reward's statistics from training pairs
        assert model.config.reward_stats_source.startswith("first ") and model.config.reward_std > 0


VLLM_GREEDY = """
import json, os, sys
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_HOST_IP="127.0.0.1", VLLM_CPU_KVCACHE_SPACE="1")
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="float32", enforce_eager=True, max_model_len=128, seed=0)
    prompts = [{"prompt_token_ids": ids} for ids in json.loads(sys.argv[2])]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
    print("TOKENS " + json.dumps([list(output.outputs[0].token_ids) for output in outputs]))
"""


def test_lora_sft_on_conversations_exports_an_adapter_and_a_merged_model(assets, tmp_path):
    """LoRA (ZeRO-3, packed micro-batches) on multi-turn conversations: the merged output loads in transformers and
    vLLM, the adapter on the base model gives the same log-probs."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "lora"
    # The tokenizer's own template, system prompts dropped: the exported tokenizer carries the one trained with.
    template = tiny.CHAT_TEMPLATE.replace("{{ message['content'] + '\\n' }}", "")
    assert template != tiny.CHAT_TEMPLATE
    run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["chat_train"], "--input_key", "messages",
              "--tokenizer_chat_template", template, "--multiturn", "--max_len", 96, "--max_samples", 512, "--max_epochs", 1, "--learning_rate", "3e-3",
              "--lora_rank", 8, "--lora_alpha", 16, "--zero_stage", 3, "--num_gpus_per_node", 2, "--packing_samples",
              "--save_path", out, "--ckpt_path", tmp_path / "ckpt", "--logging_steps", 4)
    metrics = metrics_of(out)
    assert metrics["train_loss_last"] < 0.8 * metrics["train_loss_first"], metrics  # 16 LoRA steps: ~0.7
    assert metrics["seconds/forward_backward"] > 0 and metrics["tokens_per_second"] > 0
    assert (out / "lora_adapter" / "adapter_config.json").is_file()
    assert max_weight_change(assets["model"], out) > 1e-3

    tokenizer = load_tokenizer(out)
    assert tokenizer.chat_template == template
    prompts = [data.format_prompt(tokenizer, q, True) for q in ("What is 2 plus 3?", "Add 7 and 1.", "Sum 4 with 4.")]
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(assets["model"]),
                                             out / "lora_adapter").eval()
    with torch.no_grad():
        sequences = [ids + [tokenizer.eos_token_id] for ids in prompt_ids]
        expected = torch.cat(packing.padded_log_probs(merged, sequences, tokenizer.pad_token_id))
        adapted = torch.cat(packing.padded_log_probs(with_adapter, sequences, tokenizer.pad_token_id))
        assert float((adapted - expected).abs().max()) < 1e-4
        hf_greedy = [merged.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id)[0, len(ids) :].tolist() for ids in prompt_ids]
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed: the merged model was checked in transformers only")
    script = tmp_path / "vllm_greedy.py"
    script.write_text(VLLM_GREEDY)
    proc = subprocess.run([sys.executable, str(script), str(out), json.dumps(prompt_ids)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    vllm_greedy = json.loads(proc.stdout.split("TOKENS ", 1)[1])
    assert vllm_greedy == hf_greedy


def test_diverging_run_stops_with_exit_2_and_keeps_the_last_good_checkpoint(assets, tmp_path):
    """An absurd learning rate: step 2's update is not finite (ZeRO-0 applies it), so step 3's loss is nan."""
    out, ckpt = tmp_path / "model", tmp_path / "ckpt"
    proc = run_stage("sft", "--pretrain", assets["model"], "--dataset", assets["sft_train"], "--max_samples", 128,
                     "--max_epochs", 1, "--zero_stage", 0, "--learning_rate", "1e30", "--lr_warmup_ratio", 0,
                     "--save_steps", 1, "--save_path", out, "--ckpt_path", ckpt, expect_rc=2)
    assert "[sft] error: step 3: loss=nan is not finite: training diverged" in proc.stderr
    assert f"the newest checkpoint, step 2, is kept in {ckpt}" in proc.stderr
    assert "Traceback" not in proc.stderr.split("[sft] error:", 1)[1].split("\n", 1)[0]
    assert json.loads((ckpt / "latest_step.json").read_text()) == {"step": 2}
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000001", "step00000002"]
    assert not out.exists()
