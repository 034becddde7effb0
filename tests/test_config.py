"""Stage configs and their command line: the seed's commands, presets, impossible combinations, help, hashing."""

from __future__ import annotations

import importlib.util
import os
import shlex
import threading

import pytest
import yaml

from pipeline.config import PipelineConfig, load_pipeline_config, load_preset, validate_pipeline
from pipeline.identity import stage_identity
from stages.cli import build_parser, parse_stage_args
from stages.config import CONFIG_DIR, ConfigError
from stages.registry import STAGES
from stages.rl.config import RLConfig

# ---------------------------------------------------------------- the seed's commands, module paths swapped

SEED_PPO_HYBRID = """
ray job submit --address="http://127.0.0.1:8265" \\
  --runtime-env-json='{"working_dir": "/openrlhf"}' \\
  -- python3 -m stages.rl \\
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 \\
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 \\
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 \\
  --actor_num_nodes 1 --actor_num_gpus_per_node 8 \\
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 \\
  --colocate_all_models \\
  --vllm_gpu_memory_utilization 0.5 \\
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture \\
  --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \\
  --save_path ./output/llama3-8b-rlhf \\
  --micro_train_batch_size 8 --train_batch_size 128 \\
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 \\
  --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024 \\
  --zero_stage 3 --bf16 \\
  --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \\
  --init_kl_coef 0.01 --normalize_reward \\
  --gradient_checkpointing --packing_samples \\
  --vllm_enable_sleep --deepspeed_enable_sleep
"""

SEED_GRPO_ADDITION = "--advantage_estimator group_norm"

SEED_RM = """
deepspeed --module stages.reward_model \\
  --save_path ./output/llama3-8b-rm \\
  --save_steps -1 --logging_steps 1 \\
  --eval_steps -1 --train_batch_size 256 \\
  --micro_train_batch_size 1 --pretrain meta-llama/Meta-Llama-3-8B \\
  --bf16 --max_epochs 1 --max_len 8192 \\
  --zero_stage 3 --learning_rate 9e-6 \\
  --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \\
  --apply_chat_template --chosen_key chosen \\
  --rejected_key rejected --flash_attn --gradient_checkpointing
"""

SEED_PPO = """
ray job submit --address="http://127.0.0.1:8265" \\
  -- python3 -m stages.rl \\
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 \\
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 \\
  --critic_num_nodes 1 --critic_num_gpus_per_node 8 \\
  --actor_num_nodes 1 --actor_num_gpus_per_node 8 \\
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 \\
  --colocate_all_models \\
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture \\
  --reward_pretrain ./output/llama3-8b-rm \\
  --save_path ./output/llama3-8b-ppo \\
  --micro_train_batch_size 8 --train_batch_size 128 \\
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 \\
  --max_epochs 1 --prompt_max_len 1024 --generate_max_len 1024 \\
  --zero_stage 3 --bf16 \\
  --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 \\
  --init_kl_coef 0.01 --normalize_reward \\
  --vllm_enable_sleep --deepspeed_enable_sleep
"""

SEED_GRPO = """
ray job submit --address="http://127.0.0.1:8265" \\
  -- python3 -m stages.rl \\
  --advantage_estimator group_norm \\
  --ref_num_nodes 1 --ref_num_gpus_per_node 8 \\
  --reward_num_nodes 1 --reward_num_gpus_per_node 8 \\
  --actor_num_nodes 1 --actor_num_gpus_per_node 8 \\
  --vllm_num_engines 4 --vllm_tensor_parallel_size 2 \\
  --colocate_all_models \\
  --pretrain OpenRLHF/Llama-3-8b-sft-mixture \\
  --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \\
  --save_path ./output/llama3-8b-grpo \\
  --micro_train_batch_size 8 --train_batch_size 128 \\
  --micro_rollout_batch_size 16 --rollout_batch_size 1024 \\
  --max_epochs 1 --bf16 \\
  --actor_learning_rate 5e-7 \\
  --init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 \\
  --normalize_reward --no_advantage_std_norm
"""

SEED_DPO = """
deepspeed --module stages.dpo \\
  --save_path ./output/llama3-8b-dpo \\
  --save_steps -1 --logging_steps 1 \\
  --eval_steps -1 --train_batch_size 256 \\
  --micro_train_batch_size 2 --pretrain meta-llama/Meta-Llama-3-8B \\
  --bf16 --max_epochs 1 --max_len 8192 \\
  --zero_stage 3 --learning_rate 5e-7 --beta 0.1 \\
  --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku \\
  --apply_chat_template --chosen_key chosen \\
  --rejected_key rejected --flash_attn --gradient_checkpointing
"""

SEED_SEPARATE_GPUS = """
--actor_num_gpus_per_node 8 \\
--critic_num_gpus_per_node 8 \\
--reward_num_gpus_per_node 8 \\
--ref_num_gpus_per_node 8
"""
SEED_HYBRID_ENGINE = "--colocate_all_models --vllm_enable_sleep --deepspeed_enable_sleep"
SEED_KL_INCREASE = "--init_kl_coef 0.05"
SEED_VLLM = "--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.5"


def stage_argv(command: str) -> tuple[str, list[str]]:
    """(stage, flags) of `deepspeed --module stages.X ...` or `ray job submit ... -- python3 -m stages.X ...`."""
    words = shlex.split(command.replace("\\\n", " "))
    module_at = next(i for i, word in enumerate(words) if word.startswith("stages."))
    return words[module_at].removeprefix("stages."), words[module_at + 1 :]


def flags(snippet: str) -> list[str]:
    return shlex.split(snippet.replace("\\\n", " "))


def without(argv: list[str], *dropped: str) -> list[str]:
    return [word for word in argv if word not in dropped]


def parse_error(capsys, stage: str, argv: list[str], **kwargs) -> str:
    with pytest.raises(SystemExit) as exit_info:
        parse_stage_args(STAGES[stage], argv, **kwargs)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_seed_ppo_hybrid_engine_lands_with_its_meaning():
    stage, argv = stage_argv(SEED_PPO_HYBRID)
    assert stage == "rl"
    cfg = parse_stage_args(STAGES[stage], argv, require_inputs=False)
    assert isinstance(cfg, RLConfig)
    assert cfg.pretrain == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert cfg.reward_pretrain == "OpenRLHF/Llama-3-8b-rm-700k"
    assert (cfg.vllm_num_engines, cfg.vllm_tensor_parallel_size, cfg.vllm_gpu_memory_utilization) == (4, 2, 0.5)
    assert cfg.colocate_all_models and cfg.vllm_enable_sleep and cfg.deepspeed_enable_sleep
    assert (cfg.micro_train_batch_size, cfg.train_batch_size) == (8, 128)
    assert (cfg.micro_rollout_batch_size, cfg.rollout_batch_size) == (16, 1024)
    assert (cfg.actor_learning_rate, cfg.critic_learning_rate, cfg.init_kl_coef) == (5e-7, 9e-6, 0.01)
    assert cfg.zero_stage == 3 and cfg.bf16 and cfg.normalize_reward
    assert cfg.gradient_checkpointing and cfg.packing_samples
    assert cfg.advantage_estimator == "gae" and cfg.uses_critic and cfg.n_samples_per_prompt == 1
    assert cfg.critic_init == "OpenRLHF/Llama-3-8b-rm-700k"
    assert cfg.role_ranks() == {"actor": 8, "critic": 8, "ref": 8, "reward": 8}


def test_seed_grpo_is_the_ppo_command_plus_group_norm():
    stage, argv = stage_argv(SEED_PPO_HYBRID)
    cfg = parse_stage_args(STAGES[stage], argv + flags(SEED_GRPO_ADDITION), require_inputs=False)
    assert cfg.advantage_estimator == "group_norm"
    assert not cfg.uses_critic and "critic" not in cfg.role_ranks()
    assert cfg.n_samples_per_prompt == 8  # unset: a group estimator needs a group
    packing = "--packing_samples turns --flash_attn on, as in OpenRLHF"  # the hybrid command packs
    assert cfg.flash_attn and cfg.notes() == [
        packing, "--n_samples_per_prompt unset: 8 samples per prompt for --advantage_estimator group_norm "
        "(OpenRLHF's default of 1 leaves no group to compare with, and OpenRLHF refuses it)"]
    explicit = parse_stage_args(STAGES[stage], argv + flags(SEED_GRPO_ADDITION) + ["--n_samples_per_prompt", "4"],
                                require_inputs=False)
    assert explicit.n_samples_per_prompt == 4 and explicit.notes() == [packing]


def test_seed_workflow_ppo_with_own_reward_model():
    stage, argv = stage_argv(SEED_PPO)
    cfg = parse_stage_args(STAGES[stage], argv, require_inputs=False)
    assert cfg.reward_pretrain == "./output/llama3-8b-rm" and cfg.save_path == "./output/llama3-8b-ppo"
    assert not cfg.packing_samples and cfg.vllm_gpu_memory_utilization == 0.95


def test_seed_workflow_grpo():
    stage, argv = stage_argv(SEED_GRPO)
    cfg = parse_stage_args(STAGES[stage], argv, require_inputs=False)
    assert cfg.advantage_estimator == "group_norm" and cfg.use_kl_loss and cfg.kl_estimator == "k3"
    assert cfg.no_advantage_std_norm and cfg.normalize_reward and not cfg.uses_critic
    # Accepted as OpenRLHF accepts it, and said to do nothing there.
    assert any(note.startswith("--no_advantage_std_norm has no effect with --advantage_estimator group_norm")
               for note in cfg.notes())
    assert cfg.save_path == "./output/llama3-8b-grpo" and cfg.prompt_max_len == 1024


def test_seed_rl_commands_name_no_prompt_data(capsys):
    """The seed's RL commands give no --prompt_data: a run says so; the llama3-8b preset supplies it."""
    for command in (SEED_PPO_HYBRID, SEED_PPO, SEED_GRPO):
        stage, argv = stage_argv(command)
        assert "missing required --prompt_data" in parse_error(capsys, stage, argv)
        cfg = parse_stage_args(STAGES[stage], ["--config", "llama3-8b", *argv])
        assert cfg.prompt_data == "OpenRLHF/prompt-collection-v0.1"


def test_seed_reward_model_under_the_deepspeed_launcher():
    stage, argv = stage_argv(SEED_RM)
    assert stage == "reward_model"
    cfg = parse_stage_args(STAGES[stage], [*argv, "--local_rank=0"])
    assert cfg.local_rank == 0
    assert (cfg.save_steps, cfg.logging_steps, cfg.eval_steps) == (-1, 1, -1)
    assert (cfg.train_batch_size, cfg.micro_train_batch_size, cfg.max_len) == (256, 1, 8192)
    assert cfg.pretrain == "meta-llama/Meta-Llama-3-8B" and cfg.learning_rate == 9e-6
    assert cfg.dataset == "OpenRLHF/preference_dataset_mixture2_and_safe_pku"
    assert cfg.apply_chat_template and cfg.flash_attn and cfg.gradient_checkpointing and cfg.bf16
    assert (cfg.chosen_key, cfg.rejected_key, cfg.prompt_key, cfg.loss) == ("chosen", "rejected", None, "sigmoid")


def test_seed_dpo():
    stage, argv = stage_argv(SEED_DPO)
    cfg = parse_stage_args(STAGES[stage], [*argv, "--local_rank=3"])
    assert (cfg.beta, cfg.learning_rate, cfg.micro_train_batch_size, cfg.zero_stage) == (0.1, 5e-7, 2, 3)
    assert cfg.local_rank == 3 and cfg.ref_pretrain is None and not cfg.ipo


def test_seed_troubleshooting_snippets():
    _, ppo = stage_argv(SEED_PPO_HYBRID)
    separate = without(ppo, "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep")
    cfg = parse_stage_args(STAGES["rl"], separate + flags(SEED_SEPARATE_GPUS), require_inputs=False)
    assert not cfg.colocate_all_models and cfg.critic_num_gpus_per_node == 8
    cfg = parse_stage_args(STAGES["rl"], separate + flags(SEED_HYBRID_ENGINE) + flags(SEED_KL_INCREASE) + flags(SEED_VLLM),
                           require_inputs=False)
    assert cfg.colocate_all_models and cfg.vllm_enable_sleep and cfg.init_kl_coef == 0.05


# ---------------------------------------------------------------- rejected input

def test_unknown_flag_is_rejected_by_name(capsys):
    _, argv = stage_argv(SEED_RM)
    err = parse_error(capsys, "reward_model", [*argv, "--bogus_flag", "1"])
    assert "unrecognized arguments: --bogus_flag" in err


def test_abbreviated_flag_is_not_accepted(capsys):
    err = parse_error(capsys, "sft", ["--pretr", "model", "--dataset", "d"])
    assert "--pretr" in err


def test_invalid_values_name_the_flag(capsys):
    _, argv = stage_argv(SEED_RM)
    assert "invalid value for --zero_stage" in parse_error(capsys, "reward_model", [*argv, "--zero_stage", "4"])
    assert "invalid value for --learning_rate" in parse_error(capsys, "reward_model", [*argv, "--learning_rate", "-1"])
    assert "--kl_estimator: invalid choice" in parse_error(capsys, "rl", ["--kl_estimator", "k4"])


_, PPO = stage_argv(SEED_PPO_HYBRID)
_, RM = stage_argv(SEED_RM)
TINY = ["--config", "tiny"]
GROUP_ESTIMATORS = ["group_norm", "rloo", "dr_grpo", "reinforce_baseline"]


@pytest.mark.parametrize(
    ("stage", "argv", "named"),
    [
        ("rl", without(PPO, "--colocate_all_models", "--deepspeed_enable_sleep"),
         ["--vllm_enable_sleep requires --colocate_all_models"]),
        ("rl", without(PPO, "--colocate_all_models", "--vllm_enable_sleep"),
         ["--deepspeed_enable_sleep requires --colocate_all_models"]),
        *[("rl", [*PPO, "--advantage_estimator", name, "--n_samples_per_prompt", "1"],
           [f"--advantage_estimator {name} needs --n_samples_per_prompt >= 2"]) for name in GROUP_ESTIMATORS],
        ("rl", [*PPO, "--critic_num_gpus_per_node", "4"],
         ["--colocate_all_models", "critic", "--critic_num_gpus_per_node"]),
        ("rl", [*PPO, "--train_batch_size", "100", "--rollout_batch_size", "1000"],
         ["--train_batch_size 100", "--micro_train_batch_size 8", "--actor_num_nodes × --actor_num_gpus_per_node"]),
        ("reward_model", [*RM, "--train_batch_size", "100"],
         ["--train_batch_size 100", "--micro_train_batch_size 1", "--num_nodes 1 × --num_gpus_per_node 8"]),
        ("rl", [*PPO, "--rollout_batch_size", "1000"],
         ["--rollout_batch_size 1000 × --n_samples_per_prompt 1", "--train_batch_size 128"]),
        ("rl", [*PPO, "--micro_rollout_batch_size", "256"], ["--micro_rollout_batch_size 256", "8 data-parallel actor ranks"]),
        ("rl", [*PPO, "--init_kl_coef", "0", "--use_kl_loss"], ["--use_kl_loss with --init_kl_coef 0"]),
        ("rl", [*PPO, "--init_kl_coef", "0", "--kl_estimator", "k3"], ["--kl_estimator k3", "--init_kl_coef 0"]),
        ("rl", [*PPO, "--init_kl_coef", "0", "--kl_target", "6"], ["--kl_target", "--init_kl_coef"]),
        ("rl", [*PPO, "--vllm_num_engines", "8"],
         ["--colocate_all_models needs --vllm_num_engines × --vllm_tensor_parallel_size (16) at most"]),
        ("rl", [*PPO, "--remote_rm_url", "reward.py"], ["--remote_rm_url and --reward_pretrain", "--normalize_reward"]),
        ("rl", [*PPO, "--rollout_backend", "hf"], ["--vllm_tensor_parallel_size 2 needs --rollout_backend vllm"]),
        ("rl", [*TINY, "--rollout_backend", "hf", "--vllm_tensor_parallel_size", "2"],
         ["needs --rollout_backend vllm"]),
        ("rl", [*TINY, "--vllm_num_engines", "0"], ["invalid value for --vllm_num_engines"]),
        ("rl", [*TINY, "--temperature", "0"], ["--temperature 0"]),
        ("rl", [*TINY, "--reward_clip_range", "5", "-5"], ["--reward_clip_range 5.0 -5.0"]),
        ("rl", [*TINY, "--dual_clip", "0.5"], ["invalid value for --dual_clip"]),
        ("rl", [*PPO, "--zero_stage", "0"], ["--deepspeed_enable_sleep", "needs --zero_stage 1, 2 or 3, got "
                                            "--zero_stage 0"]),
        ("rl", [*PPO, "--adam_offload"], ["--deepspeed_enable_sleep with --adam_offload under --zero_stage 3",
                                          "drop one of the two flags"]),
        ("rl", [*TINY, "--policy_loss_type", "cispo", "--dual_clip", "3"],
         ["--dual_clip 3.0 bounds PPO's clipped objective: --policy_loss_type cispo has none"]),
        ("sft", [*TINY, "--no_apply_chat_template", "--input_template", "Q: "], ["--input_template 'Q: ' has no {}"]),
        ("sft", [*TINY, "--input_template", "Q: {}"], ["--input_template and --apply_chat_template"]),
        ("sft", [*TINY, "--save_steps", "0"], ["--save_steps 0"]),
        ("reward_model", [*RM, "--zero_stage", "0", "--adam_offload"], ["--adam_offload needs --zero_stage"]),
        ("dpo", [*TINY, "--ipo", "--label_smoothing", "0.1"], ["--label_smoothing", "--ipo"]),
        ("evaluate", [*TINY, "--eval_temperature", "0"], ["invalid value for --eval_temperature"]),
        ("rl", [*TINY, "--freezing_actor_steps", "3"], ["--freezing_actor_steps 3", "gae"]),
        ("rl", [*TINY, "--dynamic_filtering"], ["--dynamic_filtering", "--remote_rm_url"]),
        ("rl", [*TINY, "--remote_rm_url", "r.py", "--dynamic_filtering", "--dynamic_filtering_reward_range", "1", "0"],
         ["--dynamic_filtering_reward_range 1.0 0.0"]),
        ("rl", [*TINY, "--save_best"], ["--save_best", "--eval_dataset"]),
        ("dpo", [*TINY, "--lora_alpha", "32", "--lora_dropout", "0.1"],
         ["--lora_alpha, --lora_dropout: configures LoRA adapters, which are off; set --lora_rank > 0"]),
        ("rl", [*TINY, "--target_modules", "q_proj"], ["--target_modules: configures LoRA adapters, which are off"]),
        ("sft", [*TINY, "--load_in_4bit", "--bf16"], ["--load_in_4bit: 4-bit weights cannot be trained", "--lora_rank"]),
        ("dpo", [*TINY, "--load_in_4bit", "--lora_rank", "8"], ["--load_in_4bit computes in bfloat16", "add --bf16"]),
        ("rl", [*TINY, "--load_in_4bit", "--lora_rank", "8", "--bf16", "--zero_stage", "3"],
         ["--load_in_4bit with --zero_stage 3", "use --zero_stage 2"]),
        ("sft", [*TINY, "--multiturn", "--pretrain_mode"], ["--multiturn and --pretrain_mode exclude each other"]),
        ("sft", [*TINY, "--no_apply_chat_template", "--multiturn"], ["--multiturn needs --apply_chat_template"]),
        ("sft", [*TINY, "--no_apply_chat_template", "--system_key", "system_prompt"],
         ["--system_key needs --apply_chat_template"]),
        ("sft", [*TINY, "--pretrain_mode", "--system_key", "system_prompt"],
         ["--system_key applies to prompt/response"]),
        ("reward_model", [*TINY, "--margin_loss", "--loss", "logexp"], ["--margin_loss needs --loss sigmoid"]),
        ("kto", [*TINY, "--micro_train_batch_size", "1", "--train_batch_size", "16"],
         ["--micro_train_batch_size 1: KTO's KL reference point"]),
        ("sft", [*TINY, "--dataset", "a.jsonl,b.jsonl", "--dataset_probs", "0.5"],
         ["--dataset_probs has 1 probabilities for the 2 datasets of --dataset"]),
        ("dpo", [*TINY, "--dataset", "a.jsonl,b.jsonl", "--dataset_probs", "0.6,0.6"],
         ["--dataset_probs 0.6,0.6: each probability must be > 0 and together they must sum to 1"]),
        ("kto", [*TINY, "--dataset", "a.jsonl", "--dataset_probs", "1.0"],
         ["--dataset_probs mixes datasets: give --dataset as a comma-separated list"]),
        ("rl", [*TINY, "--prompt_data", "a.jsonl,b.jsonl", "--prompt_data_probs", "0.7;0.3"],
         ["--prompt_data_probs '0.7;0.3': expected comma-separated numbers"]),
        ("rl", [*TINY, "--ema_beta", "0.9"], ["--ema_beta 0.9 configures --enable_ema, which is off"]),
        ("rl", [*TINY, "--enable_ema", "--lora_rank", "8"], ["--enable_ema averages the actor's full weights"]),
        ("rl", [*TINY, "--enable_ema", "--save_best", "--eval_dataset", "e.jsonl", "--eval_steps", "2"],
         ["--enable_ema and --save_best exclude each other"]),
        ("rl", [*TINY, "--advantage_estimator", "rloo", "--save_value_network"],
         ["--save_value_network exports the critic, which --advantage_estimator rloo does not train"]),
        ("rl", [*TINY, "--async_train"], ["--async_train generates while the actor trains, and "
                                          "--colocate_all_models puts the engines on the actor's GPUs"]),
        ("rl", [*TINY, "--agent_func_path", "agent.py", "--remote_rm_url", "reward.py"],
         ["--agent_func_path rewards the episodes itself: not with --remote_rm_url (choose one reward source)"]),
        ("evaluate", [*TINY, "--agent_timeout", "5"], ["--agent_timeout 5 configures --agent_func_path, which is unset"]),
        ("rl", [*TINY, "--no_colocate_all_models", "--async_train", "--partial_rollout", "--agent_func_path", "a.py"],
         ["--partial_rollout generates responses in segments, an agent's episodes in turns"]),
        ("rl", [*TINY, "--partial_rollout"], ["--partial_rollout lets a weight update land during generation ahead "
                                              "of training: it needs --async_train"]),
        ("rl", [*TINY, "--partial_rollout_segment_len", "8"],
         ["--partial_rollout_segment_len 8 configures --partial_rollout, which is off"]),
        ("rl", [*TINY, "--async_queue_size", "2"], ["--async_queue_size 2 configures --async_train, which is off"]),
        ("rl", [*TINY, "--train_max_tokens_per_gpu", "512", "--rollout_max_tokens_per_gpu", "1024"],
         ["--train_max_tokens_per_gpu 512 configures --use_dynamic_batch, which is off",
          "--rollout_max_tokens_per_gpu 1024 configures --use_dynamic_batch, which is off"]),
        ("rl", [*TINY, "--ref_reward_offload"], ["--ref_reward_offload offloads ZeRO-3 partitions: it needs "
                                                 "--zero_stage 3, got 2"]),
        ("dpo", [*TINY, "--ref_offload"], ["--ref_offload offloads ZeRO-3 partitions: it needs --zero_stage 3, got 2"]),
        ("rl", [*TINY, "--use_dynamic_batch", "--actor_num_gpus_per_node", "3", "--ref_num_gpus_per_node", "3"],
         ["--train_batch_size 128 is not a multiple of the 3 data-parallel ranks"]),
        ("rl", [*TINY, "--vllm_generate_batch_size", "64"],
         ["--vllm_generate_batch_size 64 > --rollout_batch_size 32 keeps groups for later steps: it needs "
          "--async_train"]),
        ("rl", [*TINY, "--vllm_generate_batch_size", "16"], ["--vllm_generate_batch_size 16 is below "
                                                              "--rollout_batch_size 32"]),
        ("rl", [*TINY, "--logprob_gap_warn", "0.5", "--logprob_gap_stop", "0.2"],
         ["--logprob_gap_stop 0.2 must be above --logprob_gap_warn 0.5"]),
        ("rl", [*TINY, "--vllm_is_correction_type", "icepop"],
         ["--vllm_is_correction_type configures --enable_vllm_is_correction, which is off"]),
        ("rl", [*TINY, "--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "1.5", "5"],
         ["--vllm_is_truncated_threshold 1.5 5.0: needs 0 <= low < 1 < high"]),
        ("sft", [*TINY, "--no_apply_chat_template", "--tokenizer_chat_template", "{{ messages }}"],
         ["--tokenizer_chat_template is used by --apply_chat_template, which is off"]),
        ("dpo", [*TINY, "--tokenizer_chat_template", "{% for m in messages %}{{ m.content }}"],
         ["--tokenizer_chat_template is not a Jinja template: Unexpected end of template", "(line 1)"]),
    ],
)
def test_impossible_combinations_are_rejected_naming_the_flags(capsys, stage, argv, named):
    err = parse_error(capsys, stage, argv, require_inputs=False)
    for text in named:
        assert text in err


def test_group_estimators_need_no_critic_settings():
    # Without --colocate_all_models the critic's size only matters for gae.
    separate = without(PPO, "--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep")
    odd_critic = [*separate, "--critic_num_gpus_per_node", "3"]
    for name in GROUP_ESTIMATORS:
        cfg = parse_stage_args(STAGES["rl"], [*odd_critic, "--advantage_estimator", name], require_inputs=False)
        assert not cfg.uses_critic
    with pytest.raises(SystemExit):
        parse_stage_args(STAGES["rl"], odd_critic, require_inputs=False)  # gae trains the 3-rank critic: 128 % (8 × 3)


def test_missing_inputs_are_named(capsys):
    assert "missing required --pretrain, --dataset" in parse_error(capsys, "sft", TINY)
    err = parse_error(capsys, "evaluate", [*TINY, "--pretrain", "p", "--prompt_data", "d"])
    assert "missing required --reward_pretrain or --remote_rm_url or --agent_func_path, the dataset of eval_suite " \
           "benchmark(s) gsm8k, math (a tiny pipeline fills it in" in err
    both = ["--pretrain", "p", "--prompt_data", "d", "--reward_pretrain", "rm", "--remote_rm_url", "reward.py",
            "--eval_suite", "none"]
    assert parse_stage_args(STAGES["evaluate"], [*TINY, *both]).remote_rm_url == "reward.py"  # evaluation may use both


# ---------------------------------------------------------------- presets

def test_presets_load_and_validate():
    tiny = load_pipeline_config("tiny")
    assert tiny.name == "tiny" and tiny.tiny_assets_dir
    assert tiny.sft.device == "cpu" and tiny.sft.world_size == 1 and tiny.sft.zero_stage == 2 and not tiny.sft.bf16
    assert tiny.sft.pretrain is None and tiny.rl.pretrain is None and tiny.rl.reward_pretrain is None
    assert tiny.rl.advantage_estimator == "group_norm" and tiny.rl.use_kl_loss and tiny.rl.kl_estimator == "k3"
    assert tiny.rl.rollout_backend == "hf" and tiny.rl.vllm_num_engines == 1 and tiny.rl.actor_ranks == 1

    llama = load_pipeline_config("llama3-8b")
    rl = llama.rl
    assert rl.pretrain == "OpenRLHF/Llama-3-8b-sft-mixture" and rl.reward_pretrain == "OpenRLHF/Llama-3-8b-rm-700k"
    assert rl.role_ranks() == {"actor": 8, "critic": 8, "ref": 8, "reward": 8}
    assert (rl.vllm_num_engines, rl.vllm_tensor_parallel_size, rl.zero_stage, rl.bf16) == (4, 2, 3, True)
    assert rl.colocate_all_models and rl.vllm_enable_sleep and rl.deepspeed_enable_sleep
    assert (rl.train_batch_size, rl.rollout_batch_size, rl.actor_learning_rate) == (128, 1024, 5e-7)
    assert llama.reward_model.max_len == 8192 and llama.dpo.beta == 0.1


@pytest.mark.parametrize("preset", ["tiny", "llama3-8b", "tiny-agent"])
def test_every_stage_parses_from_each_preset(preset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # presets are found next to the package, not in the working directory
    for stage in STAGES:
        cfg = parse_stage_args(STAGES[stage], ["--config", preset], require_inputs=False)
        assert cfg == getattr(load_pipeline_config(preset), stage)


def test_a_preset_extends_another_section_by_section(tmp_path):
    """tiny-agent extends tiny: its keys over tiny's, a stage section key by key, for the pipeline, a stage's --config
    and a deployment's `config` parameter (the preset verbatim, `extends:` included) alike."""
    agent, tiny = load_pipeline_config("tiny-agent"), load_pipeline_config("tiny")
    assert (agent.name, agent.shape, agent.rl.agent_func_path) == ("tiny-agent", "sft-rl", "stages/tiny_agent.py")
    assert agent.rl.model_copy(update={"agent_func_path": None}) == tiny.rl and agent.sft == tiny.sft
    assert parse_stage_args(STAGES["rl"], ["--config", "tiny-agent"], require_inputs=False) == agent.rl
    parameter = yaml.safe_load((CONFIG_DIR / "tiny-agent.yaml").read_text())
    assert parameter["extends"] == "tiny" and PipelineConfig.model_validate(parameter) == agent
    assert PipelineConfig.model_validate(agent.model_dump(mode="json")) == agent  # a flow run's stored parameter

    child = tmp_path / "child.yaml"
    child.write_text(f"extends: {tmp_path / 'middle.yaml'}\nname: child\nrl:\n  seed: 5\n")
    (tmp_path / "middle.yaml").write_text("extends: tiny\nname: middle\nrl:\n  seed: 4\n  temperature: 0.5\n")
    chained = load_pipeline_config(str(child))
    assert (chained.name, chained.rl.seed, chained.rl.temperature, chained.shape) == ("child", 5, 0.5, tiny.shape)

    (tmp_path / "nameless.yaml").write_text("extends: tiny\nrl:\n  seed: 4\n")
    with pytest.raises(ConfigError, match="extends tiny but sets no name of its own: its runs would share tiny's"):
        load_pipeline_config(str(tmp_path / "nameless.yaml"))
    (tmp_path / "a.yaml").write_text(f"extends: {tmp_path / 'b.yaml'}\nname: a\n")
    (tmp_path / "b.yaml").write_text(f"extends: {tmp_path / 'a.yaml'}\nname: b\n")
    with pytest.raises(ConfigError, match="which extends it back"):
        load_pipeline_config(str(tmp_path / "a.yaml"))
    (tmp_path / "typo.yaml").write_text("extends: tiny\nname: typo\nrl:\n  actor_lr: 1.0\n")
    with pytest.raises(ConfigError, match="unknown field rl.actor_lr"):
        load_pipeline_config(str(tmp_path / "typo.yaml"))



def test_no_field_of_a_run_config_has_a_file_read(tmp_path):
    """Every field of every section set to a FIFO's path, in a run's parameters: validation ends at once (opening a
    FIFO to read it waits for a writer forever), and the fields whose string names a file to read (eval_suite,
    extends) are refused, naming the field, with nothing of the file in the message; from a --config file or a
    preset, the same suite file is read."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    base = load_preset("tiny")
    cases = [({**base, key: str(fifo)}, key) for key in PipelineConfig.model_fields if key not in STAGES]
    cases += [({**base, stage: {**base[stage], field: str(fifo)}}, f"{stage}.{field}")
              for stage in STAGES for field in STAGES[stage].model_fields]
    refused = []

    def validate_all():
        for data, where in cases:
            try:
                PipelineConfig.model_validate(data)
            except ValueError as error:
                if "which would name a file to read" in str(error) or "not a file" in str(error):
                    refused.append(where)

    worker = threading.Thread(target=validate_all, daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive(), f"validation opened a file: stuck after {len(refused)} refusals"
    assert sorted(refused) == ["evaluate.eval_suite", "extends"]
    with pytest.raises(ValueError, match=r"evaluate: eval_suite is a string, which would name a file to read: the "
                                         r"config of a run holds values only; files are read only from a preset"):
        validate_pipeline({**base, "evaluate": {**base["evaluate"], "eval_suite": "/dev/zero"}}, "run")

    suite = tmp_path / "suite.yaml"
    suite.write_text("- {name: gsm8k, format: gsm8k, n_samples: 0}\n")
    cfg = parse_stage_args(STAGES["evaluate"], ["--eval_suite", str(suite)], require_inputs=False)
    assert [b.name for b in cfg.eval_suite] == ["gsm8k"]
    preset = tmp_path / "mine.yaml"
    preset.write_text(f"extends: tiny\nname: mine\nevaluate:\n  eval_suite: {suite}\n")
    assert [b.name for b in load_pipeline_config(str(preset)).evaluate.eval_suite] == ["gsm8k"]


def test_a_config_parameter_extends_presets_by_name_and_never_has_a_file_read(tmp_path):
    secret = tmp_path / "secret.yaml"
    secret.write_text("name: CANARY-in-a-file\n")
    for base in (str(secret), "/etc/passwd", "../configs/tiny.yaml"):
        with pytest.raises(ValueError, match=r"config: extends may name only a preset \(llama3-8b, .*\) here, not a "
                                             r"file: a run's parameters never have files read") as refused:
            PipelineConfig.model_validate({"extends": base, "name": "mine"})
        assert "CANARY" not in str(refused.value) and "root:" not in str(refused.value)
    assert PipelineConfig.model_validate({"extends": "tiny", "name": "mine"}).shape == load_pipeline_config("tiny").shape

def test_flags_override_the_preset_section(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump({"rl": load_preset("tiny")["rl"] | {"seed": 3}}))
    cfg = parse_stage_args(STAGES["rl"], ["--config", str(path)], require_inputs=False)
    assert cfg.seed == 3 and cfg.use_kl_loss
    cfg = parse_stage_args(STAGES["rl"], ["--config", str(path), "--seed", "7", "--no_use_kl_loss", "--kl_estimator", "k1",
                                  "--reward_clip_range", "-5", "5"], require_inputs=False)
    assert cfg.seed == 7 and not cfg.use_kl_loss and cfg.reward_clip_range == (-5.0, 5.0)


def test_none_unsets_a_preset_value(capsys):
    cfg = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b", "--reward_pretrain", "none", "--remote_rm_url", "reward.py",
                                  "--no_normalize_reward"])
    assert cfg.reward_pretrain is None and cfg.remote_rm_url == "reward.py" and "reward" not in cfg.role_ranks()
    assert "invalid int value: 'x'" in parse_error(capsys, "rl", ["--vllm_num_engines", "x"])


def test_bad_presets_are_named(capsys, tmp_path):
    assert "unknown preset 'nope'" in parse_error(capsys, "sft", ["--config", "nope"])
    path = tmp_path / "typo.yaml"
    path.write_text("rl:\n  actor_lr: 1.0\n")
    assert f"unknown field rl.actor_lr in {path}" in parse_error(capsys, "rl", ["--config", str(path)])
    path.write_text("rl:\n  zero_stage: 9\n")
    assert f"invalid value for rl.zero_stage in {path}" in parse_error(capsys, "rl", ["--config", str(path)])
    path.write_text("stagez: {}\n")
    with pytest.raises(ConfigError, match="unknown keys stagez"):
        load_preset(str(path))


def test_pipeline_overrides_merge_and_errors_name_the_field():
    cfg = load_pipeline_config("tiny", {"rl": {"seed": 7}, "artifact_root": "s3://bucket/rlhf"})
    assert cfg.rl.seed == 7 and cfg.rl.advantage_estimator == "group_norm" and cfg.artifact_root == "s3://bucket/rlhf"
    with pytest.raises(ConfigError, match=r"invalid value for rl\.zero_stage"):
        load_pipeline_config("tiny", {"rl": {"zero_stage": 7}})
    with pytest.raises(ConfigError, match=r"rl: --vllm_enable_sleep requires --colocate_all_models"):
        load_pipeline_config("tiny", {"rl": {"colocate_all_models": False, "vllm_enable_sleep": True}})
    with pytest.raises(ConfigError, match=r"sft\.pretrain, sft\.dataset.* no tiny_assets_dir"):
        load_pipeline_config("tiny", {"tiny_assets_dir": None})


# ---------------------------------------------------------------- help, descriptions, hashing

def test_every_field_has_a_one_line_description():
    for model_cls in [*STAGES.values(), PipelineConfig]:
        for name, field in model_cls.model_fields.items():
            assert field.description and "\n" not in field.description, f"{model_cls.__name__}.{name}"


@pytest.mark.parametrize("stage", list(STAGES))
def test_help_lists_every_field_with_its_description(stage, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_stage_args(STAGES[stage], ["--help"])
    assert exit_info.value.code == 0
    shown = "".join(capsys.readouterr().out.split())
    for name, field in STAGES[stage].model_fields.items():
        assert f"--{name}" in shown
        assert "".join(field.description.split()) in shown, name


def test_build_parser_flag_shapes():
    parser = build_parser(RLConfig)
    assert not parser.allow_abbrev
    args = vars(parser.parse_args(["--adam_betas", "0.9", "0.99", "--eps_clip_low_high", "0.2", "0.28", "--bf16"]))
    assert args == {"config": None, "adam_betas": [0.9, 0.99], "eps_clip_low_high": [0.2, 0.28], "bf16": True}


def test_lora_flags_take_openrlhf_values():
    cfg = parse_stage_args(STAGES["sft"], [*TINY, "--lora_rank", "8", "--lora_alpha", "32", "--target_modules", "q_proj",
                                   "v_proj", "--lora_dropout", "0.05"], require_inputs=False)
    assert (cfg.lora_rank, cfg.lora_alpha, cfg.target_modules, cfg.lora_dropout) == (8, 32, ["q_proj", "v_proj"], 0.05)
    assert parse_stage_args(STAGES["rl"], TINY, require_inputs=False).target_modules == ["all-linear"]


def test_the_stage_key_is_stable_and_ignores_where_outputs_go():
    cfg = load_pipeline_config("tiny").rl

    def key(config) -> str:
        return stage_identity("tiny", "rl", config, {}, code="c").key

    digest = key(cfg)
    assert len(digest) == 64 and digest == key(load_pipeline_config("tiny").rl)
    assert key(RLConfig.model_validate(cfg.model_dump())) == digest  # a dumped config re-validates unchanged
    assert key(cfg.model_copy(update={"save_path": "/x", "ckpt_path": "/y"})) == digest
    assert key(cfg.model_copy(update={"seed": 43})) != digest
    llama = load_pipeline_config("llama3-8b").rl
    assert key(llama.model_copy(update={"prompt_data": f"{llama.prompt_data}#{'0' * 40}"})) != digest  # pinned


def test_a_hub_dataset_whose_revision_cannot_be_told_gives_no_stage_key(monkeypatch):
    """Offline (or with the hub down past the retries) there is no key to compute: never one that stands in for
    the revision, which would change when the hub comes back and retrain everything."""
    from stages.fingerprint import HubUnavailable

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubUnavailable, match="OpenRLHF/prompt-collection-v0.1"):
        stage_identity("llama3-8b", "rl", load_pipeline_config("llama3-8b").rl, {}, code="c")


def test_a_resolved_stage_config_round_trips_through_yaml(tmp_path, capsys):
    _, argv = stage_argv(SEED_GRPO)
    cfg = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b", *argv])
    section, flat = tmp_path / "section.yaml", tmp_path / "flat.yaml"
    section.write_text(yaml.safe_dump({"rl": cfg.model_dump(mode="json")}))
    flat.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))  # one stage's flags, as a job's workspace holds
    assert parse_stage_args(STAGES["rl"], ["--config", str(section)]) == cfg
    assert parse_stage_args(STAGES["rl"], ["--config", str(flat)]) == cfg
    flat.write_text(yaml.safe_dump({"seed": 1, "actor_lr": 1.0}))
    assert f"unknown field actor_lr in {flat}" in parse_error(capsys, "rl", ["--config", str(flat)])


def test_a_wandb_key_given_as_openrlhf_takes_it_is_refused_without_being_echoed(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_stage_args(STAGES["rl"], ["--use_wandb", "canary-wandb-key-123"], require_inputs=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--use_wandb takes no value here: put the W&B key in WANDB_API_KEY" in err and "canary" not in err
    with pytest.raises(SystemExit):
        parse_stage_args(STAGES["rl"], ["--use_wandb=canary-wandb-key-123"], require_inputs=False)
    assert "canary" not in capsys.readouterr().err


def test_a_mixture_is_fingerprinted_and_pinned_part_by_part(tmp_path):
    """The stage key changes when any dataset of a mixture changes, and with its probabilities; a hub part is
    pinned on its own, the files beside it unchanged."""
    from stages.fingerprint import dataset_fingerprint, pin_hub_revision

    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text('{"prompt": "a", "response": "x"}\n')
    second.write_text('{"prompt": "b", "response": "y"}\n')
    mixture = f"{first},{second}"
    cfg = parse_stage_args(STAGES["sft"], [*TINY, "--pretrain", "p", "--dataset", mixture, "--dataset_probs", "0.5,0.5"])
    assert cfg.dataset_probabilities == [0.5, 0.5]

    def key(config) -> str:
        return stage_identity("tiny", "sft", config, {}, code="c").key

    before, fingerprint = key(cfg), dataset_fingerprint(mixture)
    assert fingerprint == f"{dataset_fingerprint(str(first))} + {dataset_fingerprint(str(second))}"
    assert key(cfg.model_copy(update={"dataset_probs": "0.6,0.4"})) != before
    second.write_text('{"prompt": "b", "response": "z"}\n')
    assert dataset_fingerprint(mixture) != fingerprint and key(cfg) != before
    pinned = "org/data#" + "0" * 40 + "@test"
    assert pin_hub_revision(f"{first}, {pinned}") == f"{first},{pinned}"


def test_offloaded_frozen_models_keep_their_zero3_partitions_in_host_memory():
    """--ref_reward_offload (RL) and --ref_offload (DPO), as OpenRLHF's: the frozen models' DeepSpeed config offloads
    their ZeRO-3 parameters to host memory on GPUs; on CPU they already are there, and the stage says so once."""
    from stages.engine import deepspeed_config
    from stages.fields import cpu_notes

    cfg = parse_stage_args(STAGES["rl"], [*TINY, "--zero_stage", "3", "--ref_reward_offload"], require_inputs=False)
    offloaded = deepspeed_config(cfg, world_size=1, train_batch_size=128, micro_batch_size=16, train=False,
                                 offload_params=True)
    assert offloaded["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_param" not in deepspeed_config(cfg, world_size=1, train_batch_size=128, micro_batch_size=16,
                                                   train=False)["zero_optimization"]
    assert any(note.startswith("--ref_reward_offload has no effect on CPU") for note in cpu_notes(cfg))
    dpo = parse_stage_args(STAGES["dpo"], [*TINY, "--zero_stage", "3", "--ref_offload"], require_inputs=False)
    assert any(note.startswith("--ref_offload has no effect on CPU") for note in cpu_notes(dpo))


def test_packing_turns_flash_attention_on_as_in_openrlhf():
    """--packing_samples without --flash_attn turns it on (OpenRLHF's rule, said once); an explicit --no_flash_attn
    keeps the block mask and says what it costs. On a GPU without the flash-attn package the stage stops naming it."""
    from stages.errors import StageInputError
    from stages.model_io import attn_implementation

    packed = parse_stage_args(STAGES["sft"], [*TINY, "--packing_samples"], require_inputs=False)
    assert packed.flash_attn and packed.notes() == ["--packing_samples turns --flash_attn on, as in OpenRLHF"]
    explicit = parse_stage_args(STAGES["sft"], [*TINY, "--packing_samples", "--no_flash_attn"], require_inputs=False)
    assert not explicit.flash_attn and "block mask" in explicit.notes()[0]
    assert attn_implementation(packed, "cpu") is None
    if importlib.util.find_spec("flash_attn") is None:  # this machine: no GPU build of flash-attn
        with pytest.raises(StageInputError, match="needs the flash-attn package on GPU machines"):
            attn_implementation(packed, "cuda")
