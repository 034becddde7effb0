"""Turn a PipelineConfig into the one the stages run with: tiny assets built and filled in, local paths absolute."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task

from stages.config import PipelineConfig

# (stage, field) <- tiny asset, for fields the config leaves unset. Later stages' models come from artifacts.
TINY_ASSET_FIELDS = {
    ("sft", "pretrain"): "model",
    ("sft", "dataset"): "sft_train",
    ("sft", "eval_dataset"): "sft_eval",
    ("reward_model", "dataset"): "pref_train",
    ("reward_model", "eval_dataset"): "pref_eval",
    ("rl", "prompt_data"): "prompts_train",
    ("evaluate", "prompt_data"): "prompts_eval",
}
# Fields that may name a local path; Ray jobs run elsewhere, so relative paths are made absolute here.
PATH_FIELDS = ("pretrain", "ref_pretrain", "reward_pretrain", "dataset", "eval_dataset", "prompt_data", "remote_rm_url")
STAGES = ("sft", "reward_model", "rl", "evaluate")


def _absolute_if_local(value: str | None) -> str | None:
    if value is None or "://" in value or not Path(value).expanduser().exists():
        return value
    return str(Path(value).expanduser().resolve())


@task(name="prepare-config", persist_result=True)
def prepare_config(config: PipelineConfig) -> PipelineConfig:
    """Build the tiny assets when `tiny_assets_dir` is set and use them for unset model/data fields (and the
    tiny task's rule reward for evaluation accuracy); make local paths absolute."""
    logger = get_run_logger()
    sections = {stage: getattr(config, stage).model_dump() for stage in STAGES}
    if config.tiny_assets_dir is not None:
        from stages import tiny

        assets_dir = Path(config.tiny_assets_dir).expanduser().resolve()
        assets = tiny.build_tiny_assets(assets_dir)
        logger.info(f"tiny assets in {assets_dir}")
        for (stage, field), asset in TINY_ASSET_FIELDS.items():
            if sections[stage][field] is None:
                sections[stage][field] = str(assets[asset])
        if sections["evaluate"]["remote_rm_url"] is None:  # the rule reward gives evaluation its accuracy
            sections["evaluate"]["remote_rm_url"] = str(Path(tiny.__file__).with_name("tiny_reward.py"))
    for section in sections.values():
        for field in PATH_FIELDS:
            if field in section:
                section[field] = _absolute_if_local(section[field])
    return config.model_copy(update={stage: type(getattr(config, stage)).model_validate(s)
                                     for stage, s in sections.items()})
