"""The `full-rlhf` flow: validate the data, then SFT → reward model → RL → evaluation → promotion.

Each stage is a `run_stage` task (a Ray job) whose result is persisted. Retrying a failed flow run (the UI's
Retry, or `prefect flow-run retry <id>`) keeps the run id, so finished tasks come back Cached and are not run
again; the failed stage has the same stage key, hence the same workspace, and its job resumes from the last
checkpoint there. A new flow run with the same config re-runs no finished stage either: run_stage finds the
committed artifact by stage key.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.results import PipelineResult
from infra.ray_cluster import ray_address_in_env
from infra.settings import Settings, get_settings
from stages.config import PipelineConfig
from tasks.prepare import prepare_config
from tasks.promote import PromotionGate, promote
from tasks.run_stage import stage_task
from tasks.validate import validate_data


def artifact_root_for(config: PipelineConfig, settings: Settings) -> str:
    """RLHF_ARTIFACT_ROOT, when set, overrides the config's artifact_root (a worker pinned to a bucket)."""
    root = settings.artifact_root or config.artifact_root
    return root if "://" in root else str(Path(root).expanduser().resolve())


# The flow's own result (small) goes to Prefect's default result storage: PREFECT_LOCAL_STORAGE_PATH, or
# PREFECT_DEFAULT_RESULT_STORAGE_BLOCK in production; the stage results to the settings' result storage.
@flow(name="full-rlhf", persist_result=True)
def full_rlhf(config: PipelineConfig) -> PipelineResult:
    """SFT → reward model → RL → evaluation on `config`; promotes the policy if the evaluation passes."""
    settings = get_settings()
    logger = get_run_logger()
    root = artifact_root_for(config, settings)
    persisted = {"result_storage": settings.result_storage_block()}
    with ray_address_in_env(settings) as ray_address:
        logger.info(f"Ray Jobs API {ray_address}; artifacts {root}/{config.name}; workspaces {settings.workspace_root}")
        config = prepare_config.with_options(**persisted)(config)
        validate_data.with_options(**persisted)(config)

        run = stage_task(settings)
        common = {"pipeline": config.name, "artifact_root": root}
        sft = run("sft", config.sft, {}, **common)
        reward_model = run("reward_model", config.reward_model, {"base": sft}, **common)
        policy = run("rl", config.rl, {"actor": sft, "reward": reward_model}, **common)
        report = run("evaluate", config.evaluate, {"policy": policy, "reference": sft, "reward": reward_model},
                     **common)  # fmt: skip
        gate = PromotionGate(min_reward_gain=config.promotion_min_reward_gain)
        decision = promote.with_options(**persisted)(policy, report, gate, artifact_root=root)

    stages = {"sft": sft, "reward_model": reward_model, "rl": policy, "evaluate": report}
    return PipelineResult(artifact_root=root, stages=stages, promotion=decision)
