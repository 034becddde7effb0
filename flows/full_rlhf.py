"""The `full-rlhf` flow: validate the data, then SFT → reward model → RL → evaluation → promotion.

Each stage is a `run_stage` task (a Ray job) whose result is persisted. Retrying a failed flow run (the UI's
Retry, or `prefect flow-run retry <id>`) keeps the run id, so finished tasks come back Cached and are not run
again; the failed stage has the same stage key, hence the same workspace, and its job resumes from the last
checkpoint there. A new flow run with the same config re-runs no finished stage either: run_stage finds the
committed artifact by stage key.

Without RLHF_RAY_ADDRESS the flow runs its stages on the workspace's embedded Ray head (infra/ray_cluster.py):
a retry after the flow's process was killed adopts the head the killed process left running and re-attaches to
its job. A run put back by the `--retry-crashed` automation (flows/server_setup.py) more than
RLHF_MAX_CRASH_RETRIES times in a row fails at once instead.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import get_run_context

from flows.results import PipelineResult
from flows.server_setup import AUTO_RETRY_MESSAGE
from infra.ray_cluster import ray_address_in_env
from infra.settings import Settings, get_settings
from stages.config import PipelineConfig
from tasks.prepare import prepare_config
from tasks.promote import PromotionGate, promote
from tasks.report import publish_report
from tasks.run_stage import stage_task
from tasks.validate import validate_data


class CrashLoop(RuntimeError):
    """The run was retried automatically after crashes too many times in a row."""


def automatic_retries_in_a_row(states) -> int:
    """Automatic crash retries since the run was last scheduled by anything else (created, or retried by hand)."""
    count = 0
    for state in sorted(states, key=lambda s: s.timestamp, reverse=True):
        if state.type == StateType.SCHEDULED:
            if state.message != AUTO_RETRY_MESSAGE:
                break
            count += 1
    return count


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
    with get_client(sync_client=True) as client:
        retries = automatic_retries_in_a_row(client.read_flow_run_states(get_run_context().flow_run.id))
    if retries > settings.max_crash_retries:
        raise CrashLoop(f"crashed and was retried automatically {retries} times in a row (RLHF_MAX_CRASH_RETRIES="
                        f"{settings.max_crash_retries}); not running again: find the cause, then retry by hand")
    root = artifact_root_for(config, settings)
    persisted = {"result_storage": settings.result_storage_block()}
    with ray_address_in_env(settings, log=logger.info) as ray_address:
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
        evaluation_report = publish_report.with_options(**persisted)(report, policy, artifact_root=root)

    stages = {"sft": sft, "reward_model": reward_model, "rl": policy, "evaluate": report}
    return PipelineResult(artifact_root=root, stages=stages, promotion=decision, report=evaluation_report)
