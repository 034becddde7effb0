"""The RL stage for real (`python -m stages.rl`) on the tiny task, one CPU rank per model as the tiny preset runs it.

PPO with a critic and the reward model, every other advantage estimator, every placement, exact resume, reward
functions that break and endpoints that are down, and the seed's GRPO command rehearsed on CPU (two ranks per model).
The tiny preset generates with HF; the runs that stream weights into vLLM engines say so. The session's SFT model
and reward model (conftest.py) feed every run.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from conftest import free_port
from faults import rewound_checkpoints
from stage_runs import ROOT, history_of, max_weight_change, metrics_of, run_stage, tiny_suite, weights
from test_config import SEED_GRPO, SEED_PPO, SEED_PPO_HYBRID, stage_argv
from test_rewards import RewardServer

from pipeline.config import load_pipeline_config
from pipeline.rehearsal import StandIns, rehearse_stage
from stages.cli import parse_stage_args
from stages.model_io import load_value_model
from stages.registry import STAGES

pytestmark = pytest.mark.slow

RULE_REWARD = "stages/tiny_reward.py"
# PPO on the tiny task: 4 samples per prompt (one optimizer step of 128 per rollout), the KL in the reward (k1),
# rewards standardised with the reward model's statistics, a critic learning as fast as the actor.
PPO = ("--advantage_estimator", "gae", "--n_samples_per_prompt", 4, "--no_use_kl_loss", "--kl_estimator", "k1",
       "--critic_learning_rate", "3e-4", "--normalize_reward")


ASYNC = ("--no_colocate_all_models", "--async_train")


def rl(tmp: Path, sft_model: Path, assets, *flags, env: dict | None = None, expect_rc: int = 0, name: str = "run",
       private_ray: bool = False):
    out = tmp / name
    proc = run_stage("rl", "--pretrain", sft_model, "--prompt_data", assets["prompts_train"],
                     "--save_path", out / "model", "--ckpt_path", out / "ckpt", *flags, env=env, expect_rc=expect_rc,
                     private_ray=private_ray)
    return out / "model", proc


def test_ppo_with_critic_and_reward_model_learns(tmp_path, assets, sft_model, reward_model):
    """PPO (gae) with the critic started from the reward model, actor+ref and critic+reward colocated."""
    policy, proc = rl(tmp_path, sft_model, assets, *PPO, "--reward_pretrain", reward_model, "--max_samples", 800,
                      "--no_colocate_all_models", "--colocate_actor_ref", "--colocate_critic_reward",
                      "--save_steps", 5, "--save_value_network")
    assert "roles {'actor': 1, 'critic': 1, 'ref': 1, 'reward': 1} + 1 engine(s)" in proc.stdout
    history = history_of(policy)
    assert len(history) == 25
    first, last = history[:5], history[-5:]
    assert sum(r["critic_loss"] for r in last) < sum(r["critic_loss"] for r in first), "the critic does not fit"
    # --save_value_network: the trained critic beside the actor, a value model with its own (moved) head.
    critic = load_value_model(f"{policy}_critic", trained_head=True)
    start = load_value_model(reward_model, trained_head=True)
    assert float((critic.score.weight - start.score.weight).detach().abs().max()) > 1e-4
    checkpoint = tmp_path / "run" / "ckpt" / "step00000025"
    assert (checkpoint / "actor").is_dir() and (checkpoint / "critic").is_dir()

    report = tmp_path / "report"
    run_stage("evaluate", "--pretrain", policy, "--ref_pretrain", sft_model, "--reward_pretrain", reward_model,
              "--remote_rm_url", RULE_REWARD, "--prompt_data", assets["prompts_eval"], "--save_path", report,
              "--num_gpus_per_node", 2, "--eval_suite", tiny_suite(assets, tmp_path / "suite.yaml", 200))
    metrics = metrics_of(report)
    # Held-out greedy accuracy (rule reward) and the reward model's score of the same answers both rise.
    assert metrics["accuracy"] - metrics["reference_accuracy"] >= 0.2, metrics
    assert metrics["reward_mean"] > metrics["reference_reward_mean"], metrics
    assert 0 < metrics["kl_mean"] < 10, metrics
    assert metrics["pass4"] >= metrics["accuracy"] - 0.05, metrics
    # The held-out prompts in GSM8K's format score as the prompt set does (within one prompt of 200), the gain
    # beyond noise; the reward model prefers the policy's answers to held-out preference prompts.
    assert metrics["gsm8k/prompts"] == metrics["prompts"] == 200
    assert abs(metrics["gsm8k/accuracy"] - metrics["accuracy"]) <= 1 / 200, metrics
    assert metrics["gsm8k/accuracy_gain_vs_reference_low"] > 0, metrics
    assert metrics["preferences/win_rate_vs_reference_low"] > 0.5, metrics


def test_qlora_ppo_trains_adapters_on_4bit_models_sharing_one_process(tmp_path, assets, sft_model, reward_model):
    """--load_in_4bit (QLoRA, as OpenRLHF applies it): the actor, reference, reward model and critic load with 4-bit
    NF4 weights, all four in one process per rank (--colocate_all_models); the actor and the critic train LoRA
    adapters; the engine gets the merged, dequantized bf16 weights; the outputs are full bf16 models."""
    from transformers import AutoConfig

    policy, proc = rl(tmp_path, sft_model, assets, *PPO, "--reward_pretrain", reward_model, "--max_samples", 96,
                      "--load_in_4bit", "--bf16", "--lora_rank", 8, "--lora_alpha", 16, "--actor_learning_rate",
                      "2e-3", "--critic_learning_rate", "2e-3", "--save_value_network")
    assert "roles {'actor': 1, 'critic': 1, 'ref': 1, 'reward': 1} + 1 engine(s)" in proc.stdout
    assert "kernels-community" not in proc.stdout + proc.stderr  # bitsandbytes' optional-kernel notice dropped
    history = history_of(policy)
    assert len(history) == 3 and all(math.isfinite(r["critic_loss"]) for r in history)
    # The actor and the reference start from the same 4-bit weights; the adapters then move the actor away.
    assert history[0]["kl"] == 0 and all(abs(r["kl"]) > 1e-4 for r in history[1:]), history
    for output in (policy, Path(f"{policy}_critic")):
        config = AutoConfig.from_pretrained(output)
        assert getattr(config, "quantization_config", None) is None and config.dtype == torch.bfloat16
        assert (output / "lora_adapter" / "adapter_config.json").is_file()
    assert max_weight_change(sft_model, policy) > 1e-3


def test_async_ppo_resumed_after_a_crash_repeats_the_uninterrupted_steps(tmp_path, assets, sft_model):
    """Async PPO (its critic from the SFT model, the rule reward), rollouts two policy versions ahead, 48 prompts per
    generate call for rollouts of 32 (the rest kept for the next steps), the engines' log-probs corrected for
    (seq-mask-tis), an adaptive KL controller: restarted from its checkpoints as a kill after step 3 leaves them, the
    six steps equal the uninterrupted run's (actor, critic, KL controller, the two rollouts produced ahead and the
    groups kept, prompt position, RNG), and so does the output, the actor's moving average (--enable_ema), which the
    restart reads back from the checkpoint."""
    ppo_with_rule_reward = tuple(flag for flag in PPO if flag != "--normalize_reward")
    flags = (*ppo_with_rule_reward, "--remote_rm_url", RULE_REWARD, "--max_samples", 192, "--save_steps", 3,
             "--kl_target", "1.0",
             "--no_colocate_all_models", "--colocate_actor_ref", "--colocate_critic_reward", "--async_train",
             "--async_queue_size", 2, "--vllm_generate_batch_size", 48, "--enable_vllm_is_correction",
             "--vllm_is_correction_type", "seq-mask-tis", "--enable_ema", "--ema_beta", "0.5")
    full, _ = rl(tmp_path, sft_model, assets, *flags, name="full")
    rewound_checkpoints(tmp_path / "full" / "ckpt", tmp_path / "resumed" / "ckpt", 3)
    resumed, proc = rl(tmp_path, sft_model, assets, *flags, name="resumed")
    assert "resumed from the checkpoint of step 3" in proc.stdout
    assert metrics_of(resumed)["resumed_from_step"] == 3

    expected, got = history_of(full), history_of(resumed)
    assert [r["step"] for r in got] == list(range(1, 7))
    assert len({r["kl_coef"] for r in expected}) > 1, "the adaptive KL controller never moved"
    # Step k trains on the rollout of policy k - 2 (generated two steps ahead), older for groups kept from an
    # earlier generate call; 48 prompts per call, none when the kept groups fill the rollout.
    assert [r["prompts_sampled"] for r in got] == [48, 48, 0, 48, 48, 0]
    assert [r["policy_lag"] for r in got] == [0, 1, 2, 2, 2.5, 3]
    assert [r["policy_lag_max"] for r in got] == [0, 1, 2, 2, 3, 3]
    assert expected[0]["vllm_kl"] == pytest.approx(0, abs=1e-5) and expected[-1]["vllm_kl"] > 1e-3
    assert any(r["is_affected_fraction"] > 0 for r in expected) and all(r["time/rollout_wait"] >= 0 for r in expected)
    for a, b in zip(expected, got):
        for key, value in a.items():
            if isinstance(value, float) and not key.startswith("time/") and not key.endswith("_per_s"):
                assert b[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (a["step"], key)
    assert max_weight_change(full, resumed) < 1e-6


def test_grpo_on_separate_placements_with_dynamic_filtering_and_best_checkpoint(tmp_path, assets, sft_model):
    """Actor, reference and engine each on bundles of their own; groups whose samples all score alike are replaced
    by further prompts; the output is the best evaluated actor."""
    policy, proc = rl(tmp_path, sft_model, assets, "--advantage_estimator", "group_norm", "--remote_rm_url",
                      RULE_REWARD, "--no_colocate_all_models", "--dynamic_filtering",
                      "--max_samples", 384,
                      "--eval_dataset", assets["prompts_eval"], "--eval_steps", 4,
                      "--save_best", "--entropy_loss_coef", "0", "--eval_n_samples_per_prompt", 0)
    history, metrics = history_of(policy), metrics_of(policy)
    assert "roles {'actor': 1, 'ref': 1} + 1 engine(s)" in proc.stdout
    assert metrics["groups_filtered"] > 0 and any(r["prompts_sampled"] > 32 for r in history)
    assert all(r["entropy"] > 0 for r in history)
    evaluated = {r["step"]: r["eval_reward"] for r in history if "eval_reward" in r}
    best_step = max(evaluated, key=evaluated.get)
    assert metrics["best_step"] == best_step and metrics["eval_reward"] == evaluated[best_step]
    assert metrics["eval_reward"] >= metrics["eval_reward_initial"] + 0.4, metrics
    best = tmp_path / "run" / "ckpt" / "best"
    assert max_weight_change(best, policy) == 0.0


def test_the_ema_output_averages_the_initial_and_the_trained_weights(tmp_path, assets, sft_model):
    """--enable_ema --ema_beta 0.75 over one optimizer step (ZeRO-3: the averaged weights are gathered): the output
    is 0.75 × the SFT weights + 0.25 × the trained actor, which the step's checkpoint holds (ZeRO-3 partitions,
    merged with DeepSpeed's own zero_to_fp32)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    averaged, _ = rl(tmp_path, sft_model, assets, "--remote_rm_url", RULE_REWARD, "--max_samples", 32,
                     "--zero_stage", 3, "--save_steps", 1, "--enable_ema", "--ema_beta", "0.75")
    assert len(history_of(averaged)) == 1
    trained = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "run" / "ckpt" / "step00000001"), tag="actor")
    start, ema = weights(sft_model), weights(averaged)
    assert set(trained) == set(ema) and max(float((trained[n] - start[n]).abs().max()) for n in trained) > 1e-4
    for name, value in ema.items():
        assert float((value - (0.75 * start[name] + 0.25 * trained[name])).abs().max()) < 1e-6, name


@pytest.mark.parametrize(
    "estimator, flags, margin",
    [
        ("rloo", ("--colocate_all_models",), 0.4),
        ("reinforce", ("--no_use_kl_loss", "--kl_estimator", "k1"), 0.4),
        # Async: each rollout sampled by the policy up to two versions back, the engines' log-probs corrected for,
        # partial rollouts generated two tokens at a time with a weight update free to land in between.
        ("reinforce_baseline", ("--kl_estimator", "k2", *ASYNC, "--async_queue_size", 2, "--partial_rollout",
                                "--partial_rollout_segment_len", 2, "--enable_vllm_is_correction",
                                "--vllm_is_correction_type", "icepop"), 0.4),
        # The actor as LoRA adapters (merged weights go to a vLLM engine on the actor's cores, which opens them in
        # shared memory), packed forwards, ZeRO-3, micro-batches by token budget (about 8 and 16 sequences); the
        # engine's log-probs against the actor's tell whether it holds the actor's weights at every step.
        ("dr_grpo", ("--lora_rank", 8, "--lora_alpha", 16, "--actor_learning_rate", "2e-3", "--packing_samples",
                     "--zero_stage", 3, "--rollout_backend", "vllm", "--use_dynamic_batch",
                     "--train_max_tokens_per_gpu", 256, "--rollout_max_tokens_per_gpu", 512,
                     "--enable_vllm_is_correction"), 0.4),
    ],
)
def test_each_estimator_raises_held_out_accuracy(tmp_path, assets, sft_model, estimator, flags, margin):
    """Ten rollouts of 32 prompts x 4 samples against the rule reward, served over HTTP by two endpoints of which
    the first is down: every request fails over, no sample is lost."""
    server = RewardServer()
    try:
        dead = f"http://127.0.0.1:{free_port()}/get_reward"  # nothing listens there
        policy, _ = rl(tmp_path, sft_model, assets, "--advantage_estimator", estimator, *flags,
                       "--remote_rm_url", f"{dead},{server.url}", "--max_samples", 320,
                       "--eval_dataset", assets["prompts_eval"], "--eval_steps", 10, "--eval_n_samples_per_prompt", 0)
    finally:
        server.close()
    metrics = metrics_of(policy)
    assert (policy / "lora_adapter").is_dir() == ("--lora_rank" in flags)
    assert metrics["reward_failed_samples"] == 0 and sum(server.requests) > 0
    assert metrics["eval_reward"] >= metrics["eval_reward_initial"] + margin, metrics
    assert math.isfinite(metrics["kl_last"])
    history = history_of(policy)
    if "--async_train" in flags:
        # Partial: a rollout may start after the update its step would have waited for (lag 0).
        lowest = 0 if "--partial_rollout" in flags else 1
        assert history[0]["policy_lag"] == 0 and all(r["policy_lag"] >= lowest for r in history[1:])
        assert all(0 < r["is_weight"] < 5 for r in history)
    elif "--enable_vllm_is_correction" in flags:  # synchronous: the engine samples with the weights just synced
        assert all(abs(r["vllm_kl"]) < 1e-4 for r in history), [r["vllm_kl"] for r in history]
    assert all(("mixed_version_samples" in r) == ("--partial_rollout" in flags) for r in history)


def test_an_agent_task_with_a_second_try_learns_and_is_evaluated_on_the_same_episodes(tmp_path, assets, sft_model):
    """The tiny task as an agent's episodes (stages/tiny_agent.py): a wrong first answer hears "more" or "less" and
    answers again. GRPO on the episodes raises held-out episode success by 20 points or more, in RL's own
    evaluation and in the evaluation stage's, which plays the same episodes with the policy and its reference."""
    agent = "stages/tiny_agent.py"
    policy, _ = rl(tmp_path, sft_model, assets, "--advantage_estimator", "group_norm", "--agent_func_path", agent,
                   "--max_samples", 192, "--eval_dataset", assets["prompts_eval"], "--eval_steps", 6,
                   "--eval_n_samples_per_prompt", 0)
    metrics, history = metrics_of(policy), history_of(policy)
    assert metrics["eval_reward"] >= metrics["eval_reward_initial"] + 0.2, metrics
    # Second tries count: some episodes failed the first answer and succeeded with the feedback.
    assert any(r["reward"] > r["reward_first_try"] for r in history)
    assert all(r["response_length"] > 5 for r in history)

    report = tmp_path / "report"
    run_stage("evaluate", "--pretrain", policy, "--ref_pretrain", sft_model, "--agent_func_path", agent,
              "--prompt_data", assets["prompts_eval"], "--save_path", report, "--eval_n_samples_per_prompt", 1,
              "--eval_suite", "none")
    evaluated = metrics_of(report)
    assert evaluated["accuracy"] - evaluated["reference_accuracy"] >= 0.2, evaluated
    assert evaluated["accuracy"] == pytest.approx(metrics["eval_reward"], abs=0.05), (evaluated, metrics)
    assert 0 <= evaluated["pass1"] <= 1 and math.isfinite(evaluated["kl_mean"])


def test_a_broken_reward_function_stops_the_stage_naming_it(tmp_path, assets, sft_model):
    reward = tmp_path / "nan_reward.py"
    reward.write_text("import math\n\ndef reward_func(queries, prompts, labels):\n"
                      "    return [math.nan if i == 3 else 1.0 for i in range(len(queries))]\n")
    _, proc = rl(tmp_path, sft_model, assets, "--advantage_estimator", "group_norm", "--remote_rm_url", reward,
                 "--max_samples", 64, expect_rc=2)
    assert "reward_func in" in proc.stderr and "nan_reward.py returned non-finite rewards (nan) at index 3" in proc.stderr


@pytest.mark.parametrize("fault, said", [
    ("scale:model.layers.1.mlp.up_proj.weight", "engine 0 does not compute with the weights the actor sent: "
     "model.layers.1.mlp.gate_up_proj.weight (model.layers.1.mlp.gate_proj.weight, model.layers.1.mlp.up_proj.weight)"),
    ("drop:model.layers.0.self_attn.k_proj.weight", "engine 0 never loaded model.layers.0.self_attn.k_proj.weight"),
])
def test_a_weight_sync_altered_on_its_way_stops_the_stage_naming_the_tensor(tmp_path, assets, sft_model, fault, said):
    """A tensor doubled or lost between the actor and the vLLM engine (tests/sync_faults: where the engine opens the
    shared buckets) stops the stage at the first sync, before the engine samples with it, naming the tensor."""
    hook = Path(__file__).resolve().parent / "sync_faults"
    model, proc = rl(tmp_path, sft_model, assets, "--remote_rm_url", RULE_REWARD, "--rollout_backend", "vllm",
                     "--vllm_sync_bucket_mb", 1, "--max_samples", 96,
                     env={"RLHF_TEST_SYNC_FAULT": fault, "PYTHONPATH": f"{hook}:{ROOT}"}, expect_rc=2, private_ray=True)
    assert f"weight sync 1: {said}" in proc.stderr, proc.stderr[-3000:]
    assert "[rl] step" not in proc.stdout  # step 1's line follows its sync: the stage stopped in between
    assert not model.exists()


def test_the_seed_grpo_command_rehearsed_on_cpu(tmp_path, assets, sft_model, reward_model):
    """The seed's Workflow 2 GRPO command (our module path) runs two rollouts with only the stated swaps, every flag
    meaning what it means in OpenRLHF."""
    argv = stage_argv(SEED_GRPO)[1]
    preset = parse_stage_args(STAGES["rl"], argv, require_inputs=False).model_dump(mode="json")
    stand_ins = StandIns(base_model=str(assets["model"]), policy_model=str(sft_model), reward_model=str(reward_model),
                         data_dir=assets["prompts_train"].parent, fixtures_dir=tmp_path / "fixtures")
    values, swaps = rehearse_stage("rl", preset, stand_ins)
    swapped = {swap.field for swap in swaps}
    assert {"advantage_estimator", "colocate_all_models", "zero_stage", "bf16", "normalize_reward", "init_kl_coef",
            "use_kl_loss", "kl_estimator", "no_advantage_std_norm"}.isdisjoint(swapped)
    config = tmp_path / "rl.yaml"
    config.write_text(yaml.safe_dump({k: v for k, v in values.items() if k not in ("save_path", "ckpt_path")}))
    out = tmp_path / "run"
    proc = run_stage("rl", "--save_path", out / "model", "--ckpt_path", out / "ckpt", config=str(config))
    history = history_of(out / "model")
    assert len(history) == 2 and max_weight_change(sft_model, out / "model") > 0
    assert "roles {'actor': 2, 'ref': 2, 'reward': 2} + 1 engine(s)" in proc.stdout
    assert values["n_samples_per_prompt"] == 8  # unset in the command (the note is said where it is parsed)
    assert "--no_advantage_std_norm has no effect with --advantage_estimator group_norm" in proc.stdout
    assert all(math.isfinite(r["kl_loss"]) for r in history)


def test_the_seed_ppo_commands_are_the_llama3_8b_presets_rl_section():
    """The quick start's hybrid-engine PPO line (packing, gradient checkpointing, sleep, colocated) sets every
    training setting the llama3-8b preset's RL section sets, so the preset's rehearsal (tests/test_rehearsals.py: two
    rollouts on 2 CPU ranks per model, critic and reward model included) is that command's rehearsal. They differ only
    where the command leaves a setting to its defaults: the device (auto: the cluster's GPUs), the prompts it is
    given, and how much and how often to save (its packing turns FlashAttention on, as the preset's). Workflow 1's
    PPO line is the same command without packing (so without FlashAttention), gradient checkpointing and the engines'
    memory share, on the reward model it trained: padded PPO with a critic is test_ppo_with_critic_and_reward_model_
    learns's, on two ranks per model the GRPO command's above."""
    hybrid = parse_stage_args(STAGES["rl"], stage_argv(SEED_PPO_HYBRID)[1], require_inputs=False).model_dump(mode="json")
    preset = load_pipeline_config("llama3-8b").rl.model_dump(mode="json")
    differing = {field for field in hybrid if hybrid[field] != preset[field]}
    assert differing == {"device", "prompt_data", "input_key", "apply_chat_template", "max_samples", "save_path",
                         "save_steps", "max_ckpt_num"}, differing
    assert (hybrid["device"], preset["device"]) == ("auto", "cuda")
    workflow_1 = parse_stage_args(STAGES["rl"], stage_argv(SEED_PPO)[1], require_inputs=False).model_dump(mode="json")
    differing = {field: workflow_1[field] for field in hybrid if hybrid[field] != workflow_1[field]}
    assert differing == {"packing_samples": False, "flash_attn": False, "gradient_checkpointing": False,
                         "vllm_gpu_memory_utilization": 0.95, "reward_pretrain": "./output/llama3-8b-rm",
                         "save_path": "./output/llama3-8b-ppo"}, differing


def ragged_prompts(path: Path, out: Path, seed: int) -> Path:
    """The tiny task's prompts behind instructions of 0 to 5 sentences: chat-templated, 10 to about 55 tokens."""
    import json
    import random

    rng = random.Random(seed)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out.write_text("".join(json.dumps({**row, "prompt": "Please answer. " * rng.randint(0, 5) + row["prompt"]}) + "\n"
                           for row in rows))
    return out


def test_rollouts_at_production_shapes_learn(tmp_path, assets, sft_model):
    """128 prompts × 8 samples a rollout (1024 samples, one optimizer step in micro-batches of 64), prompts of
    ragged lengths up to ~55 tokens, 16-token answers, vLLM engines (every call over the scheduler's token budget),
    held-out evaluation with pass@4 along the way: held-out accuracy rises."""
    train = ragged_prompts(assets["prompts_train"], tmp_path / "train.jsonl", seed=1)
    held_out = ragged_prompts(assets["prompts_eval"], tmp_path / "eval.jsonl", seed=2)
    out = tmp_path / "run"
    run_stage("rl", "--pretrain", sft_model, "--prompt_data", train, "--eval_dataset", held_out,
              "--save_path", out / "model", "--ckpt_path", out / "ckpt", "--remote_rm_url", RULE_REWARD,
              "--rollout_backend", "vllm", "--rollout_batch_size", 128, "--n_samples_per_prompt", 8,
              "--train_batch_size", 1024, "--micro_train_batch_size", 64, "--micro_rollout_batch_size", 64,
              "--prompt_max_len", 64, "--generate_max_len", 16, "--max_samples", 512, "--eval_steps", 2,
              "--eval_n_samples_per_prompt", 4, "--save_steps", -1)
    history, metrics = history_of(out / "model"), metrics_of(out / "model")
    assert len(history) == 4 and all(r["response_length"] > 0 for r in history)
    assert metrics["eval_reward"] >= metrics["eval_reward_initial"] + 0.2, metrics
    evaluated = [r for r in history if "eval_pass4" in r]
    assert len(evaluated) == 2 and all(r["eval_pass4"] >= r["eval_pass1"] for r in evaluated), evaluated

