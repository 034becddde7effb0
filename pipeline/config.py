"""The pipeline's config: its shape (which stages run, which stage's output feeds which field of a later one), the
promotion gate, and one section per stage (stages/config.py); loaded from the presets in configs/.

    load_pipeline_config("llama3-8b", {"rl": {"seed": 1}})
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationError, ValidationInfo, model_validator

from stages.config import (
    ConfigError,
    StageConfig,
    StrictModel,
    deep_merge,
    preset_data,
    preset_names,
    preset_path,
    preset_sections,
    resolve_extends,
    validation_messages,
)
from stages.dpo.config import DPOConfig
from stages.evaluate.config import EvaluateConfig
from stages.fields import FILES_MAY_BE_READ, FileValued, RunOverride, fields_with, files_may_be_read, names_with
from stages.kto.config import KTOConfig
from stages.registry import STAGES
from stages.reward_model.config import RewardModelConfig
from stages.rl.config import RLConfig
from stages.sft.config import SFTConfig

# ---------------------------------------------------------------- pipeline shapes
#
# A pipeline runs the stages of its shape in order and always ends with the evaluation. Which stage's output fills
# which field of a later stage is one table: a field keeps the value its section gives (a model named in the preset)
# only when none of its producers is in the shape.

PIPELINE_SHAPES: dict[str, tuple[str, ...]] = {
    "sft-rm-rl": ("sft", "reward_model", "rl", "evaluate"),  # RL against a reward model trained on preferences
    "sft-rl": ("sft", "rl", "evaluate"),  # RL with a reward function (or a reward model named in rl:)
    "sft-dpo": ("sft", "dpo", "evaluate"),
    "sft-kto": ("sft", "kto", "evaluate"),
    "rm-rl": ("reward_model", "rl", "evaluate"),  # the same without SFT: start from an instruct model
    "rl": ("rl", "evaluate"),
    "dpo": ("dpo", "evaluate"),
    "kto": ("kto", "evaluate"),
}
PipelineShape = Literal[tuple(PIPELINE_SHAPES)]  # type: ignore[valid-type]
# The stages whose output is the candidate policy; a shape has exactly one.
POLICY_STAGES = tuple(stage for stage, cls in STAGES.items() if cls.trains_policy)
# (stage, field) <- the stages whose output fills it, the first one in the shape winning.
STAGE_INPUTS: dict[tuple[str, str], tuple[str, ...]] = {
    ("reward_model", "pretrain"): ("sft",),  # the reward model starts from the SFT model
    ("rl", "pretrain"): ("sft",),  # the policy starts from the SFT model
    ("rl", "reward_pretrain"): ("reward_model",),
    ("dpo", "pretrain"): ("sft",),
    ("kto", "pretrain"): ("sft",),
    ("evaluate", "pretrain"): POLICY_STAGES,  # the candidate
    ("evaluate", "ref_pretrain"): ("sft",),  # what the candidate started from
    ("evaluate", "reward_pretrain"): ("reward_model",),
}
# (stage, field) <- tiny asset that fills it when the config leaves it unset, no stage feeds it and tiny_assets_dir
# is set: what each stage declares (StageConfig.tiny_assets).
TINY_ASSET_FIELDS: dict[tuple[str, str], str] = {
    (stage, field): asset for stage, cls in STAGES.items() for field, asset in cls.tiny_assets.items()
}


def shape_inputs(shape: str) -> dict[str, dict[str, str]]:
    """{stage: {field: producing stage}} for every stage of `shape`, in run order."""
    stages = PIPELINE_SHAPES[shape]
    wiring: dict[str, dict[str, str]] = {stage: {} for stage in stages}
    for (stage, field), producers in STAGE_INPUTS.items():
        producer = next((p for p in producers if p in stages), None)
        if stage in stages and producer is not None:
            wiring[stage][field] = producer
    return wiring


def policy_stage(shape: str) -> str:
    """The stage of `shape` whose output is the candidate policy."""
    (stage,) = [s for s in PIPELINE_SHAPES[shape] if s in POLICY_STAGES]
    return stage


class GateRule(StrictModel):
    """One benchmark of the evaluation suite (evaluate.eval_suite) that the candidate must pass: a gain over its
    reference, and no regression against production beyond a tolerance, in one metric. With the gate's
    decide_on_intervals, judged on the bound of the 95% interval, like the gate's own comparisons."""

    benchmark: str = Field(description="name of a benchmark of evaluate.eval_suite")
    metric: Literal["accuracy", "reward", "win_rate"] = Field(
        description="accuracy (a gsm8k, math or prompts benchmark), reward (the reward model's mean score) or "
        "win_rate (the reward model's, ties half; its gain is the win rate above 0.5)",
    )
    min_gain: float = Field(0.0, description="gain over the reference the candidate must reach (at least)")
    max_regression: float = Field(
        0.01, ge=0, description="tolerance against production: how far below it the candidate may be",
    )


class PromotionGate(StrictModel):
    """What the evaluation must show for the candidate policy to become `production`.

    A comparison applies when the report has both of its metrics: accuracy needs a reward function
    (evaluate.remote_rm_url), reward_mean a reward model. At least one comparison with the reference must apply;
    the production comparisons apply when a production policy exists (it is scored on the same prompts).
    With `decide_on_intervals` each comparison is judged on the bound of its 95% interval (the evaluation's paired
    `<metric>_gain_vs_<model>_low` / `_high`) instead of the difference alone.
    """

    min_reward_gain: float = Field(
        0.0, description="reward_mean − reference_reward_mean must be greater than this (reward-model score)",
    )
    min_accuracy_gain: float = Field(0.0, description="accuracy − reference_accuracy must be at least this")
    min_prompts: int = Field(
        100, ge=1,
        description="the evaluation must have judged at least this many held-out prompts: on fewer, noise decides",
    )
    max_kl_mean: float | None = Field(
        None, gt=0, description="upper bound on kl_mean (candidate vs reference); unset: only finite is required",
    )
    max_logprob_gap: float | None = Field(
        None, gt=0,
        description="upper bound (nats per token) on how far the rollout engines' log-probs may be from the "
        "trainer's: the evaluation's logprob_gap_mean of the candidate and, for a candidate trained by RL, its "
        "last weight sync's probe gap (weight_sync_probe_gap_mean in its manifest); unset: not judged",
    )
    max_reward_regression: float = Field(
        0.05, ge=0,
        description="tolerance against production: production_reward_mean − reward_mean may be at most this",
    )
    max_accuracy_regression: float = Field(
        0.01, ge=0, description="tolerance against production: production_accuracy − accuracy may be at most this",
    )
    decide_on_intervals: bool = Field(
        False,
        description="judge each comparison on its 95% interval: a gain must pass with the interval's low end, a "
        "regression against production must stay within tolerance at its high end (a difference within noise then "
        "neither promotes a candidate nor replaces production); off: on the differences themselves",
    )
    max_tries_against_production: int | None = Field(
        None, ge=1,
        description="at most this many candidates judged against one production policy (the evaluations that scored "
        "it, this one included): each is another draw of the same held-out metrics, and a gate on 95% intervals "
        "passes a policy no better than production about one draw in 40; unset: not judged",
    )
    rules: list[GateRule] = Field(
        default_factory=list,
        description="benchmarks of evaluate.eval_suite the candidate must pass too, each on its own prompts (at least "
        "min_prompts of them)",
    )
    require_approval: bool = Field(
        False,
        description="a candidate that passes is promoted only when a person approves it: the flow run pauses with a "
        "form in the Prefect UI (the evaluation report linked), or `python -m flows.approval <flow-run-id>`",
    )
    approval_timeout_s: float = Field(
        24 * 3600.0, gt=0, description="seconds a paused run waits for the approval; then the candidate is rejected",
    )


class PipelineConfig(StrictModel):
    """One full-rlhf run (the stages of its shape, then evaluation and the gate) and where its artifacts go; a
    preset's schema."""

    extends: Annotated[str | None, FileValued(installed=preset_names)] = Field(
        None,
        description="preset (name or YAML path) this config starts from: its own keys are merged over the preset's, "
        "a stage section key by key; resolved as the config is read (a preset that extends another names its own "
        "pipeline)",
    )
    name: str = Field(
        "rlhf", pattern=r"^[a-z0-9][a-z0-9-]*$",
        description="pipeline name: artifact namespace (lowercase letters, digits, dashes)",
    )
    artifact_root: str = Field("./artifacts", description="artifact store root: a path, file:// or s3://bucket/prefix")
    tiny_assets_dir: str | None = Field(
        None, description="build the tiny model and datasets here and use them for every model/data path left unset",
    )
    shape: PipelineShape = Field(
        "sft-rm-rl",
        description="stages to run, in order, before the evaluation: sft-rm-rl, sft-rl (RL with a reward function), "
        "sft-dpo, sft-kto, or the same without sft- (start from the instruct model the section names)",
    )
    gate: PromotionGate = Field(
        default_factory=PromotionGate, description="what the evaluation must show for the policy to be promoted",
    )
    sft: SFTConfig = Field(default_factory=SFTConfig, description="SFT stage")
    reward_model: RewardModelConfig = Field(default_factory=RewardModelConfig, description="reward model stage")
    rl: RLConfig = Field(default_factory=RLConfig, description="RL stage")
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig, description="evaluation stage")
    dpo: DPOConfig = Field(default_factory=DPOConfig, description="DPO stage (shapes sft-dpo and dpo)")
    kto: KTOConfig = Field(default_factory=KTOConfig, description="KTO stage (shapes sft-kto and kto)")

    @model_validator(mode="before")
    @classmethod
    def _extends_a_preset(cls, data, info: ValidationInfo):
        # A deployment's `config` parameter is its preset verbatim, `extends:` included (a preset's name only).
        if not isinstance(data, dict):
            return data
        return resolve_extends(data, "config", presets_only=not files_may_be_read(info))

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages this pipeline runs, in order."""
        return PIPELINE_SHAPES[self.shape]

    def section(self, stage: str) -> StageConfig:
        return getattr(self, stage)

    @model_validator(mode="after")
    def _inputs_available(self) -> PipelineConfig:
        # A stage's required inputs come from an earlier stage of the shape, its section, or the tiny assets.
        wiring = shape_inputs(self.shape)
        missing = []
        for stage in self.stages:
            section = self.section(stage)
            groups = [*type(section).required_inputs, *((("ref_pretrain",),) if stage == "evaluate" else ())]
            for group in groups:
                if any(field in wiring[stage] or getattr(section, field) is not None for field in group):
                    continue
                if self.tiny_assets_dir is not None and any((stage, f) in TINY_ASSET_FIELDS for f in group):
                    continue
                missing.append(" or ".join(f"{stage}.{field}" for field in group))
        suite = {benchmark.name: benchmark for benchmark in self.evaluate.eval_suite or []}
        for rule in self.gate.rules:
            if rule.benchmark not in suite:
                raise ValueError(f"gate.rules: {rule.benchmark} is not a benchmark of evaluate.eval_suite "
                                 f"({', '.join(sorted(suite)) or 'none'})")
            if rule.metric == "accuracy" and suite[rule.benchmark].format == "preference_prompts":
                raise ValueError(f"gate.rules: {rule.benchmark} (preference_prompts) has no accuracy, only the reward "
                                 "model's reward and win_rate")
        if "evaluate" in self.stages and self.tiny_assets_dir is None:
            missing += [f"evaluate.eval_suite {b.name}.dataset" for b in suite.values() if b.dataset is None]
        judged_by_model = self.evaluate.reward_pretrain is not None or "reward_pretrain" in wiring.get("evaluate", {})
        needs_model = [f"benchmark {b.name} (preference_prompts)" for b in suite.values()
                       if b.format == "preference_prompts"]
        needs_model += [f"gate rule on {r.benchmark}'s {r.metric}" for r in self.gate.rules if r.metric != "accuracy"]
        if "evaluate" in self.stages and needs_model and not judged_by_model:
            raise ValueError(f"evaluate.eval_suite: {', '.join(needs_model)} needs a reward model, and shape "
                             f"{self.shape!r} has none to give the evaluation (set evaluate.reward_pretrain)")
        if missing:
            source = "no tiny_assets_dir" if self.tiny_assets_dir is None else "the tiny assets do not either"
            raise ValueError(f"{', '.join(missing)} unset: no stage of shape {self.shape!r} provides "
                             f"{'it' if len(missing) == 1 else 'them'}, and {source}")
        return self


# ---------------------------------------------------------------- presets

def load_preset(name_or_path: str) -> dict:
    """The preset as a dict, with what it extends: pipeline keys plus one section per stage (an empty section when
    absent or null)."""
    path = preset_path(name_or_path)
    data = preset_data(path)
    unknown = sorted(set(data) - set(PipelineConfig.model_fields))
    if unknown:
        raise ConfigError(
            f"{path}: unknown keys {', '.join(unknown)}; expected stage sections ({', '.join(STAGES)}) "
            f"or pipeline keys ({', '.join(k for k in PipelineConfig.model_fields if k not in STAGES)})"
        )
    return {**data, **preset_sections(path, data)}


def load_pipeline_config(name_or_path: str, overrides: dict | None = None) -> PipelineConfig:
    """A preset with `overrides` merged into it (nested dicts merge, e.g. {"rl": {"seed": 1}}), validated; the files
    its fields name (an eval suite) are read."""
    return validate_pipeline(deep_merge(load_preset(name_or_path), overrides or {}), str(preset_path(name_or_path)),
                             files_may_be_read=True)


def validate_pipeline(data: dict, where: str, files_may_be_read: bool = False) -> PipelineConfig:
    """`data` as a PipelineConfig; ConfigError naming `where` and each failing stage.field otherwise. Without
    `files_may_be_read` (a run's parameters), a string where a file could be named is refused unread."""
    try:
        return PipelineConfig.model_validate(data, context=FILES_MAY_BE_READ if files_may_be_read else None)
    except ValidationError as error:
        lines = validation_messages(error, lambda loc: ".".join(str(part) for part in loc))
        raise ConfigError(f"{where}: " + "; ".join(lines)) from error


def refused_overrides(deployed: PipelineConfig, requested: PipelineConfig) -> list[str]:
    """The fields where a deployment run's config differs from the deployment's own and that a run may not change
    (all but the stage fields declared RunOverride, stages/fields.py), as `stage.field` or `gate.field`."""
    ours, theirs = deployed.model_dump(mode="json"), requested.model_dump(mode="json")
    refused = []
    for key, value in ours.items():
        if key in STAGES:
            allowed = names_with(STAGES[key], RunOverride)
            refused += [f"{key}.{field}" for field, default in value.items()
                        if theirs[key][field] != default and field not in allowed]
        elif isinstance(value, dict):
            refused += [f"{key}.{field}" for field, default in value.items() if theirs[key][field] != default]
        elif theirs[key] != value:
            refused.append(key)
    return refused


def overrides_out_of_bounds(deployed: PipelineConfig, requested: PipelineConfig) -> list[str]:
    """Run overrides set outside what a run may set (RunOverride.at_least, .at_most_deployed), as
    `stage.field=value (at least N)` or `(at most N, the deployment's)`."""
    ours, theirs = deployed.model_dump(mode="json"), requested.model_dump(mode="json")
    found = []
    for key, config_cls in STAGES.items():
        for field, role in fields_with(config_cls, RunOverride).items():
            if key not in ours or role.at_least is None or theirs[key][field] == ours[key][field]:
                continue
            value, own = theirs[key][field], ours[key][field]
            if value < role.at_least:
                found.append(f"{key}.{field}={value} (at least {role.at_least})")
            elif role.at_most_deployed and own >= role.at_least and value > own:
                found.append(f"{key}.{field}={value} (at most {own}, the deployment's)")
    return found


def run_overrides() -> list[str]:
    """What a deployment run may set otherwise than its deployment: `field` (stages that have it)."""
    return sorted({field for cls in STAGES.values() for field in names_with(cls, RunOverride)})
