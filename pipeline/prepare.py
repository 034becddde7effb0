"""Turn a PipelineConfig into the one the stages run with: tiny assets built and filled in, local paths absolute."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from pipeline.config import TINY_ASSET_FIELDS, PipelineConfig, shape_inputs
from stages.evaluate.suite import TINY_BENCHMARK_ASSETS
from stages.fields import path_fields


def _absolute_if_local(value: str | None) -> str | None:
    if value is None or "://" in value or not Path(value).expanduser().exists():
        return value
    return str(Path(value).expanduser().resolve())


def prepare(config: PipelineConfig, log: Callable[[str], None] = print) -> PipelineConfig:
    """With `tiny_assets_dir`, build the tiny assets and use them for the fields of the shape's stages that the
    config leaves unset and no stage feeds (TINY_ASSET_FIELDS); let the evaluation play the episodes of RL's agent
    when it names no reward source of its own; make local paths absolute (Ray jobs run in another working
    directory)."""
    wiring = shape_inputs(config.shape)
    sections = {stage: config.section(stage).model_dump() for stage in config.stages}
    trained_agent = sections.get("rl", {}).get("agent_func_path")
    evaluation = sections.get("evaluate", {})
    if trained_agent and not (evaluation.get("agent_func_path") or evaluation.get("remote_rm_url")):
        evaluation["agent_func_path"] = trained_agent  # the evaluation plays the episodes RL trained on
    if config.tiny_assets_dir is not None:
        from stages import tiny

        assets_dir = Path(config.tiny_assets_dir).expanduser().resolve()
        assets = {**tiny.build_tiny_assets(assets_dir), "rule_reward": Path(tiny.__file__).with_name("tiny_reward.py")}
        log(f"tiny assets in {assets_dir}")
        for benchmark in evaluation.get("eval_suite") or []:  # a benchmark without data: the tiny one in its format
            if benchmark["dataset"] is None:
                benchmark["dataset"] = str(assets[TINY_BENCHMARK_ASSETS[benchmark["format"]]])
        for (stage, field), asset in TINY_ASSET_FIELDS.items():
            if stage not in sections or field in wiring[stage] or sections[stage][field] is not None:
                continue
            rewarded_by_model = sections[stage].get("reward_pretrain") is not None or "reward_pretrain" in wiring[stage]
            if stage == "rl" and field == "remote_rm_url" and rewarded_by_model:
                continue  # RL takes one reward source; evaluation scores with both (accuracy and reward_mean)
            if field == "remote_rm_url" and sections[stage].get("agent_func_path"):
                continue  # the agent rewards its episodes
            if asset in assets:
                sections[stage][field] = str(assets[asset])
    for stage, section in sections.items():
        for field in path_fields(type(config.section(stage))):
            section[field] = _absolute_if_local(section[field])
    for benchmark in evaluation.get("eval_suite") or []:
        benchmark["dataset"] = _absolute_if_local(benchmark["dataset"])
    return config.model_copy(update={stage: type(config.section(stage)).model_validate(values)
                                     for stage, values in sections.items()})
