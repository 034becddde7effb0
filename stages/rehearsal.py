"""A preset's stage config rehearsed on a CPU machine: every setting kept except a list of swaps derived from it.

The swaps, each with its reason (they are what a GPU cluster has and this machine has not):
- models (hub ids, paths) -> the tiny toolkit's model at the same position in the pipeline (base, SFT, reward);
- datasets -> tiny fixtures with the config's own column names and shapes (chat messages where the config
  applies a chat template);
- `device` cuda -> cpu, `flash_attn` off (no CPU kernels), `vllm_sync_backend` nccl -> gloo;
- ranks: every `*num_gpus_per_node` down to at most 2 CPU ranks, `*num_nodes` to 1, one rollout engine without
  tensor parallelism;
- lengths down to what the tiny model holds (128 positions);
- batch sizes down with their ratios kept: gradient accumulation steps (train / (micro x ranks)) and optimizer
  steps per rollout (rollout samples / train batch);
- data capped so that each stage runs two optimizer steps (RL: two rollouts).
Everything else (ZeRO stage, bf16, colocation, sleep flags, estimator, KL, packing, learning rates ...) is kept,
so a preset that cannot run fails here, on CPU, in minutes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_RANKS = 2
PROMPT_MAX_LEN = 48  # the tiny model has 128 positions; the task's prompts are under 40 tokens
GENERATE_MAX_LEN = 8
REHEARSAL_STEPS = 2


@dataclass(frozen=True)
class Swap:
    field: str
    before: Any
    after: Any
    why: str


@dataclass(frozen=True)
class StandIns:
    """Tiny models and task rows that take the place of the real ones."""

    base_model: str
    sft_model: str
    reward_model: str
    prompts: list[dict]  # {"prompt": str, "label": str}
    fixtures_dir: Path


def _ranks_swaps(values: dict) -> list[Swap]:
    swaps = []
    for name, value in values.items():
        if name.endswith("num_gpus_per_node") and value > MAX_RANKS:
            swaps.append(Swap(name, value, MAX_RANKS, f"{MAX_RANKS} CPU ranks stand in for the GPUs of a node"))
        elif name.endswith("num_nodes") and value > 1:
            swaps.append(Swap(name, value, 1, "one machine"))
    return swaps


def _device_swaps(values: dict) -> list[Swap]:
    swaps = []
    if values.get("device") != "cpu":
        swaps.append(Swap("device", values.get("device"), "cpu", "no GPU: ranks run on CPU cores"))
    if values.get("flash_attn"):
        swaps.append(Swap("flash_attn", True, False, "FlashAttention-2 has no CPU kernels"))
    if values.get("vllm_sync_backend") == "nccl":
        swaps.append(Swap("vllm_sync_backend", "nccl", "gloo", "NCCL needs GPUs"))
    if values.get("vllm_tensor_parallel_size", 1) > 1:
        swaps.append(Swap("vllm_tensor_parallel_size", values["vllm_tensor_parallel_size"], 1,
                          "tensor parallelism needs GPUs"))
    if values.get("vllm_num_engines", 1) > 1:
        swaps.append(Swap("vllm_num_engines", values["vllm_num_engines"], 1, "one engine on two cores"))
    return swaps


def _rl_batch_swaps(values: dict, ranks: int) -> list[Swap]:
    """Smaller RL batches with the same gradient accumulation and optimizer steps per rollout."""
    n = values["n_samples_per_prompt"]
    accumulation = values["train_batch_size"] // (values["micro_train_batch_size"] * ranks_of(values, "actor"))
    steps_per_rollout = values["rollout_batch_size"] * n // values["train_batch_size"]
    micro = 1
    train = micro * ranks * accumulation
    rollout = max(1, -(-train * steps_per_rollout // n))
    while rollout * n % train:  # whole optimizer steps per rollout
        rollout += 1
    new = {"micro_train_batch_size": micro, "train_batch_size": train, "rollout_batch_size": rollout,
           "micro_rollout_batch_size": min(values["micro_rollout_batch_size"], 4),
           "max_samples": rollout * REHEARSAL_STEPS, "num_episodes": 1}
    why = {"micro_train_batch_size": "memory of a CPU rank",
           "train_batch_size": f"same gradient accumulation ({accumulation} micro-batches per rank and step)",
           "rollout_batch_size": f"same optimizer steps per rollout ({steps_per_rollout})",
           "micro_rollout_batch_size": "memory of a CPU rank",
           "max_samples": f"{REHEARSAL_STEPS} rollouts", "num_episodes": f"{REHEARSAL_STEPS} rollouts"}
    return [Swap(k, values[k], v, why[k]) for k, v in new.items() if values[k] != v]


def ranks_of(values: dict, role: str) -> int:
    return values[f"{role}_num_nodes"] * values[f"{role}_num_gpus_per_node"]


def _length_swaps(values: dict) -> list[Swap]:
    limits = {"prompt_max_len": PROMPT_MAX_LEN, "generate_max_len": GENERATE_MAX_LEN,
              "max_len": PROMPT_MAX_LEN + GENERATE_MAX_LEN}
    return [Swap(k, values[k], limit, "the tiny model holds 128 positions") for k, limit in limits.items()
            if values.get(k) is not None and values[k] > limit]


def write_prompt_fixture(path: Path, rows: list[dict], input_key: str, label_key: str | None,
                         as_messages: bool) -> str:
    """Prompt rows under the config's column names: chat messages when the config applies a chat template."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            record = {input_key: [{"role": "user", "content": row["prompt"]}] if as_messages else row["prompt"]}
            if label_key:
                record[label_key] = row["label"]
            out.write(json.dumps(record) + "\n")
    return str(path)


def rehearse_rl(values: dict, stand_ins: StandIns) -> tuple[dict, list[Swap]]:
    """The RL stage's config values for a CPU rehearsal, and the swaps made."""
    ranks = min(ranks_of(values, "actor"), MAX_RANKS)
    swaps = _device_swaps(values) + _ranks_swaps(values) + _length_swaps(values) + _rl_batch_swaps(values, ranks)
    models = {"pretrain": stand_ins.sft_model, "ref_pretrain": stand_ins.sft_model,
              "reward_pretrain": stand_ins.reward_model, "critic_pretrain": stand_ins.reward_model}
    for name, stand_in in models.items():
        if values.get(name):
            swaps.append(Swap(name, values[name], stand_in, "the tiny model in the same role"))
    fixtures = {"prompt_data": "prompts", "eval_dataset": "eval_prompts"}
    for name, fixture in fixtures.items():
        if values.get(name) or name == "prompt_data":  # a command without prompts (the seed's) gets them here
            path = write_prompt_fixture(stand_ins.fixtures_dir / f"{fixture}.jsonl", stand_ins.prompts,
                                        values["input_key"], values.get("label_key"), values["apply_chat_template"])
            swaps.append(Swap(name, values[name], path, f"tiny prompts in the same format (column "
                                                         f"{values['input_key']!r})"))
    rehearsed = dict(values)
    rehearsed.update({swap.field: swap.after for swap in swaps})
    return rehearsed, swaps


def swap_table(stage: str, swaps: list[Swap]) -> str:
    lines = [f"{'stage':<13} {'field':<28} {'preset':<42} {'rehearsal':<34} why"]
    for swap in swaps:
        lines.append(f"{stage:<13} {swap.field:<28} {_short(swap.before):<42} {_short(swap.after):<34} {swap.why}")
    return "\n".join(lines)


def _short(value: Any, width: int = 40) -> str:
    text = str(value)
    return text if len(text) <= width else "..." + text[-(width - 3):]
