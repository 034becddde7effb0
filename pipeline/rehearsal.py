"""A preset rehearsed on a CPU machine: every setting kept except a list of swaps derived from it.

`rehearse_pipeline` applies the same rules to every stage of the preset's shape (`rehearse_stage` to one stage's
values). The swaps, each with its reason (what a GPU cluster has and this machine has not):
- models the config names (hub ids, paths) -> the tiny toolkit's model of the kind the field declares
  (stages/fields.py ModelPath): a model to fine-tune, a fine-tuned policy (actor, reference, production), or a
  scorer (reward model, critic, with the normalisation statistics a trained reward model carries); a model an
  earlier stage of the pipeline feeds is not swapped;
- datasets (the fields declared Dataset) -> tiny fixtures in the config's own format (its column names; chat
  messages where it applies a chat template; whole conversations where preference data has no prompt column;
  KTO's label column), held-out rows where the field is held out; each benchmark of the evaluation's suite -> the
  tiny task's held-out prompts in the benchmark's format;
- `device` -> cpu, one rollout engine without tensor parallelism (GPU-only flags such as `flash_attn` or the sleep
  modes are kept: the stage says once that they cannot act on CPU);
- ranks: every `*num_gpus_per_node` down to at most 2 CPU ranks, `*num_nodes` to 1, `ring_attn_size` to at most 2;
- lengths down to what the tiny model holds (128 positions);
- batch sizes down with their ratios kept: gradient accumulation steps (train / (micro x data-parallel ranks)) and
  optimizer steps per rollout (rollout samples / train batch);
- steps capped: one epoch and data for REHEARSAL_STEPS optimizer steps per training stage (RL: rollouts), the
  evaluation on EVAL_PROMPTS prompts; `save_steps` scaled with them (the preset's interval as the same fraction of
  its steps, at least one step, before the last), so that a rehearsal checkpoints and can resume as the preset does;
- the gate's min_prompts down to EVAL_PROMPTS, the prompts the rehearsal's evaluation judges;
- the pipeline's artifact root -> a rehearsal folder, so that a rehearsal never writes into the preset's store.
Everything else (shape, the gate's rules, ZeRO stage, bf16, gradient checkpointing, colocation, sleep flags,
estimator, KL, packing, learning rates, reward functions, the weight-sync backend ...) is kept, so a preset that cannot
run fails here, on CPU, in minutes.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig, shape_inputs, validate_pipeline
from stages.evaluate.suite import FORMAT_COLUMNS, TINY_BENCHMARK_ASSETS
from stages.fields import Dataset, ModelPath, fields_with
from stages.fingerprint import mixture_parts
from stages.registry import OFFLINE_STAGES, STAGES

MAX_RANKS = 2
PROMPT_MAX_LEN = 48  # the tiny model has 128 positions; the task's prompts are under 40 tokens
GENERATE_MAX_LEN = 8
REHEARSAL_STEPS = 2
EVAL_PROMPTS = 16


@dataclass(frozen=True)
class Swap:
    stage: str
    field: str
    before: Any
    after: Any
    why: str


@dataclass(frozen=True)
class StandIns:
    """Tiny models and the tiny task's datasets that take the place of the real ones."""

    base_model: str  # for a model to fine-tune (SFT's start, a reward model's start)
    policy_model: str  # for a fine-tuned policy (RL's actor, references, the production policy)
    reward_model: str  # for a reward model or a critic
    data_dir: Path  # the tiny task's jsonl files (stages.tiny.DATASET_FILES)
    fixtures_dir: Path  # where fixtures in the preset's formats are written

    def model(self, role: str) -> str:
        return {"base": self.base_model, "policy": self.policy_model, "scorer": self.reward_model}[role]


def build_stand_ins(directory: Path) -> StandIns:
    """The tiny model and datasets under `directory`, and a scorer stand-in: the tiny model with the reward
    normalisation statistics (mean 0, std 1) that a reward model of stages.reward_model carries."""
    from stages import tiny

    assets = tiny.build_tiny_assets(directory / "tiny-assets")
    scorer = directory / "scorer"
    if not (scorer / "config.json").exists():
        shutil.copytree(assets["model"], scorer, dirs_exist_ok=True)
        config = json.loads((scorer / "config.json").read_text())
        (scorer / "config.json").write_text(json.dumps({**config, "reward_mean": 0.0, "reward_std": 1.0}, indent=2))
    return StandIns(base_model=str(assets["model"]), policy_model=str(assets["model"]), reward_model=str(scorer),
                    data_dir=assets["sft_train"].parent, fixtures_dir=directory / "fixtures")


# ---------------------------------------------------------------------------------------------- rules

def _device_swaps(values: dict) -> list[tuple[str, Any, str]]:
    swaps = []
    if values.get("device") != "cpu":
        swaps.append(("device", "cpu", "no GPU: ranks run on CPU cores"))
    if values.get("vllm_tensor_parallel_size", 1) > 1:
        swaps.append(("vllm_tensor_parallel_size", 1, "tensor parallelism needs GPUs"))
    if values.get("vllm_num_engines", 1) > 1:
        swaps.append(("vllm_num_engines", 1, "one engine on two cores"))
    return swaps


def _rank_swaps(values: dict) -> list[tuple[str, Any, str]]:
    swaps = []
    for name, value in values.items():
        if name.endswith("num_gpus_per_node") and value > MAX_RANKS:
            swaps.append((name, MAX_RANKS, f"{MAX_RANKS} CPU ranks stand in for the GPUs of a node"))
        elif name.endswith("num_nodes") and value > 1:
            swaps.append((name, 1, "one machine"))
        elif name == "ring_attn_size" and value > MAX_RANKS:
            swaps.append((name, MAX_RANKS, f"a ring of {MAX_RANKS} CPU ranks stands in"))
    return swaps


def _length_swaps(values: dict) -> list[tuple[str, Any, str]]:
    limits = {"prompt_max_len": PROMPT_MAX_LEN, "generate_max_len": GENERATE_MAX_LEN,
              "max_len": PROMPT_MAX_LEN + GENERATE_MAX_LEN}
    return [(k, limit, "the tiny model holds 128 positions") for k, limit in limits.items()
            if values.get(k) is not None and values[k] > limit]


def ranks_of(values: dict, role: str) -> int:
    return values[f"{role}_num_nodes"] * values[f"{role}_num_gpus_per_node"]


def data_parallel(ranks: int, values: dict, rehearsed: bool = False) -> int:
    """Data-parallel ranks of `ranks` (--ring_attn_size consecutive ranks share their data); `rehearsed`: of the
    rehearsal's ranks and ring."""
    ring = values.get("ring_attn_size", 1)
    return min(ranks, MAX_RANKS) // min(ring, MAX_RANKS) if rehearsed else ranks // ring


def _offline_batch_swaps(values: dict) -> list[tuple[str, Any, str]]:
    """Smaller batches with the same gradient accumulation; data for REHEARSAL_STEPS steps of one epoch."""
    ranks = values["num_nodes"] * values["num_gpus_per_node"]
    micro_batches = values["micro_train_batch_size"] * data_parallel(ranks, values)
    accumulation = max(1, values["train_batch_size"] // micro_batches)
    train = data_parallel(ranks, values, rehearsed=True) * accumulation
    new = {"micro_train_batch_size": (1, "memory of a CPU rank"),
           "train_batch_size": (train, f"same gradient accumulation ({accumulation} micro-batches per rank and step)"),
           "max_epochs": (1, f"{REHEARSAL_STEPS} steps"),
           "max_samples": (train * REHEARSAL_STEPS, f"{REHEARSAL_STEPS} steps")}
    return [(k, v, why) for k, (v, why) in new.items() if values[k] != v]


def _rl_batch_swaps(values: dict) -> list[tuple[str, Any, str]]:
    """Smaller RL batches with the same gradient accumulation and optimizer steps per rollout."""
    n = values["n_samples_per_prompt"]
    ranks = data_parallel(ranks_of(values, "actor"), values, rehearsed=True)
    accumulation = values["train_batch_size"] // (values["micro_train_batch_size"]
                                                   * data_parallel(ranks_of(values, "actor"), values))
    steps_per_rollout = values["rollout_batch_size"] * n // values["train_batch_size"]
    micro = 1
    train = micro * ranks * accumulation
    rollout = max(1, -(-train * steps_per_rollout // n))
    while rollout * n % train:  # whole optimizer steps per rollout
        rollout += 1
    new = {"micro_train_batch_size": (micro, "memory of a CPU rank"),
           "train_batch_size": (train, f"same gradient accumulation ({accumulation} micro-batches per rank and step)"),
           "rollout_batch_size": (rollout, f"same optimizer steps per rollout ({steps_per_rollout})"),
           "micro_rollout_batch_size": (min(values["micro_rollout_batch_size"], 4), "memory of a CPU rank"),
           "max_samples": (rollout * REHEARSAL_STEPS, f"{REHEARSAL_STEPS} rollouts"),
           "num_episodes": (1, f"{REHEARSAL_STEPS} rollouts")}
    return [(k, v, why) for k, (v, why) in new.items() if values[k] != v]


def preset_steps(stage: str, values: dict) -> int:
    """The optimizer steps (RL: rollouts) a stage of the preset runs, from its max_samples and batch sizes."""
    if stage == "rl":
        return max(1, values["max_samples"] // values["rollout_batch_size"] * values["num_episodes"])
    return max(1, -(-values["max_samples"] // values["train_batch_size"]) * values["max_epochs"])


def _checkpoint_swaps(stage: str, values: dict) -> list[tuple[str, Any, str]]:
    """save_steps at the same fraction of the rehearsal's REHEARSAL_STEPS as of the preset's steps, at least 1
    and before the last step (a preset that only saves at the end, -1, keeps that)."""
    every = values.get("save_steps", -1)
    if every <= 0:
        return []
    steps = preset_steps(stage, values)
    scaled = max(1, min(REHEARSAL_STEPS - 1, round(every * REHEARSAL_STEPS / steps)))
    why = f"a checkpoint every {every} of the preset's ~{steps} steps, at that rate of {REHEARSAL_STEPS}"
    return [] if scaled == every else [("save_steps", scaled, why)]


def _evaluate_batch_swaps(values: dict) -> list[tuple[str, Any, str]]:
    new = {"max_samples": (EVAL_PROMPTS, f"{EVAL_PROMPTS} held-out prompts"),
           "micro_rollout_batch_size": (min(values["micro_rollout_batch_size"], 4), "memory of a CPU rank")}
    return [(k, v, why) for k, (v, why) in new.items() if values[k] != v]


BATCH_RULES = {**{stage: _offline_batch_swaps for stage in OFFLINE_STAGES}, "rl": _rl_batch_swaps,
               "evaluate": _evaluate_batch_swaps}


def _model_swaps(stage: str, values: dict, stand_ins: StandIns, wired: set[str]) -> list[tuple[str, Any, str]]:
    return [(field, stand_ins.model(role.kind), f"the tiny model as the {role.kind} model")
            for field, role in fields_with(STAGES[stage], ModelPath).items()
            if values.get(field) and field not in wired]


# ---------------------------------------------------------------------------------------------- fixtures

def _rows(stand_ins: StandIns, kind: str, split: str) -> list[dict]:
    return [json.loads(line) for line in (stand_ins.data_dir / f"{kind}_{split}.jsonl").read_text().splitlines()]


def _chat(text: str, as_messages: bool) -> str | list[dict]:
    return [{"role": "user", "content": text}] if as_messages else text


def fixture_rows(stage: str, values: dict, rows: list[dict]) -> list[dict]:
    """Tiny rows under the stage config's column names and in its format."""
    chat = bool(values.get("apply_chat_template"))
    kind = STAGES[stage].tiny_rows
    if kind == "prompts":
        return [{values["input_key"]: _chat(r["prompt"], chat),
                 **({values["label_key"]: r["label"]} if values.get("label_key") else {})} for r in rows]
    if kind == "sft":
        return [{values["input_key"]: _chat(r["prompt"], chat), values["output_key"]: r["response"]} for r in rows]
    if kind == "kto":
        return [{values["input_key"]: _chat(r["prompt"], chat), values["output_key"]: r["response"],
                 values["label_key"]: r["label"]} for r in rows]
    if values.get("prompt_key") is None:  # whole conversations in chosen and rejected
        def conversation(prompt, answer):
            return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]

        return [{values["chosen_key"]: conversation(r["prompt"], r["chosen"]),
                 values["rejected_key"]: conversation(r["prompt"], r["rejected"])} for r in rows]
    return [{values["prompt_key"]: _chat(r["prompt"], chat), values["chosen_key"]: r["chosen"],
             values["rejected_key"]: r["rejected"]} for r in rows]


def _data_swaps(stage: str, values: dict, stand_ins: StandIns) -> list[tuple[str, Any, str]]:
    swaps = []
    for field, role in fields_with(STAGES[stage], Dataset).items():
        # A command without prompts (the seed's RL commands) gets them too.
        if not (values.get(field) or (stage, field) == ("rl", "prompt_data")):
            continue
        split = "eval" if role.held_out else "train"
        path = stand_ins.fixtures_dir / f"{stage}_{field}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = fixture_rows(stage, values, _rows(stand_ins, STAGES[stage].tiny_rows, split))
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        columns = ", ".join(repr(column) for column in rows[0])
        # One stand-in per dataset of a mixture: its sampling probabilities still apply.
        stand_in = ",".join([str(path)] * len(mixture_parts(values.get(field) or str(path))))
        swaps.append((field, stand_in, f"tiny {STAGES[stage].tiny_rows} rows in the same format (columns {columns})"))
    return swaps


def _suite_swaps(values: dict, stand_ins: StandIns) -> list[tuple[str, Any, str]]:
    """Each benchmark of an evaluation suite -> the tiny task's held-out prompts in its format, under its columns,
    EVAL_PROMPTS of them."""
    from stages import tiny

    if not values.get("eval_suite"):
        return []
    rehearsed = []
    for benchmark in values["eval_suite"]:
        asset = TINY_BENCHMARK_ASSETS[benchmark["format"]]
        rows = [json.loads(line) for line in (stand_ins.data_dir / tiny.DATASET_FILES[asset]).read_text().splitlines()]
        if benchmark["format"] == "prompts":
            rows = fixture_rows("evaluate", values, rows)
        default_input, default_label = FORMAT_COLUMNS[benchmark["format"]]
        renames = {default_input: benchmark.get("input_key"), default_label or "solution": benchmark.get("label_key")}
        rows = [{renames.get(column) or column: value for column, value in row.items()} for row in rows]
        path = stand_ins.fixtures_dir / f"evaluate_eval_suite_{benchmark['name']}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        rehearsed.append({**benchmark, "dataset": str(path), "max_samples": min(benchmark["max_samples"],
                                                                                EVAL_PROMPTS)})
    return [("eval_suite", rehearsed, f"each benchmark: {EVAL_PROMPTS} of the tiny task's held-out prompts in its "
             "format and columns")]


# ---------------------------------------------------------------------------------------------- rehearsals

def rehearse_stage(stage: str, values: dict, stand_ins: StandIns, wired: set[str] = frozenset()
                   ) -> tuple[dict, list[Swap]]:  # fmt: skip
    """A stage's config values for a CPU rehearsal, and the swaps made. `wired`: fields an earlier stage of the
    pipeline feeds (not swapped)."""
    changes = (_device_swaps(values) + _rank_swaps(values) + _length_swaps(values) + _checkpoint_swaps(stage, values)
               + BATCH_RULES[stage](values) + _model_swaps(stage, values, stand_ins, wired)
               + _data_swaps(stage, values, stand_ins) + _suite_swaps(values, stand_ins))
    swaps = [Swap(stage, field, values.get(field), after, why) for field, after, why in changes]
    return {**values, **{swap.field: swap.after for swap in swaps}}, swaps


def rehearse_pipeline(config: PipelineConfig, stand_ins: StandIns, artifact_root: str):
    """(the rehearsal's PipelineConfig, the swaps) of a PipelineConfig: every stage of its shape rehearsed."""
    wiring = shape_inputs(config.shape)
    data = config.model_dump(mode="json")
    swaps = [Swap("pipeline", "artifact_root", config.artifact_root, artifact_root,
                  "a rehearsal never writes into the preset's store")]
    data["artifact_root"] = artifact_root
    if "evaluate" in config.stages and config.gate.min_prompts > EVAL_PROMPTS:
        swaps.append(Swap("gate", "min_prompts", config.gate.min_prompts, EVAL_PROMPTS,
                          f"the rehearsal's evaluation judges {EVAL_PROMPTS} prompts"))
        data["gate"]["min_prompts"] = EVAL_PROMPTS
    for stage in config.stages:
        data[stage], stage_swaps = rehearse_stage(stage, data[stage], stand_ins, set(wiring[stage]))
        swaps += stage_swaps
    return validate_pipeline(data, f"rehearsal of {config.name}"), swaps


def swap_table(swaps: list[Swap]) -> str:
    lines = [f"{'stage':<13} {'field':<26} {'preset':<42} {'rehearsal':<36} why"]
    for swap in swaps:
        lines.append(f"{swap.stage:<13} {swap.field:<26} {_short(swap.before):<42} {_short(swap.after, 36):<36} "
                     f"{swap.why}")
    return "\n".join(lines)


def _short(value: Any, width: int = 42) -> str:
    text = str(value)
    return text if len(text) <= width else "..." + text[-(width - 3):]
