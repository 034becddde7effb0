"""The `full-rlhf` flow: preflight, the stages of the config's shape, evaluation against the reference and the
production policy, the promotion gate.

Shapes (pipeline.config.PIPELINE_SHAPES) are data: the flow runs the shape's stages in order and feeds each
stage's output into the fields STAGE_INPUTS names, e.g. SFT -> reward model -> RL -> evaluation, or SFT -> DPO ->
evaluation. Each stage is a `run_stage` task (a Ray job) whose result is persisted. Retrying a failed flow run
(the UI's Retry, or `prefect flow-run retry <id>`) keeps the run id, so finished tasks come back Cached and are not
run again; the failed stage has the same stage key, hence the same workspace, and its job resumes from the last
checkpoint there. A new flow run (the nightly schedule) re-runs only what changed: a stage whose config, inputs,
data content and code are unchanged is found committed by its stage key; a night without changes submits no job,
does not even start the embedded Ray head, and says so.

Without RLHF_RAY_ADDRESS the flow runs its stages on the workspace's embedded Ray head (infra/ray_cluster.py):
a retry after the flow's process was killed adopts the head the killed process left running and re-attaches to
its job. A run put back by the `--retry-crashed` automation (flows/server_setup.py) more than
RLHF_MAX_CRASH_RETRIES times in a row fails at once instead.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import get_run_context

from flows.results import PipelineResult
from flows.server_setup import AUTO_RETRY_MESSAGE
from infra.ray_cluster import ray_address_in_env
from infra.settings import Settings, get_settings
from pipeline.config import PipelineConfig, policy_stage
from pipeline.identity import StageResult, stage_inputs
from tasks.preflight import preflight
from tasks.promote import production_policy, promote
from tasks.report import publish_report
from tasks.run_stage import result_storage, stage_task


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
    """The stages of `config.shape` in order, then evaluation and the promotion gate: the candidate policy becomes
    `production` only if it beats its reference and does not fall behind the current production policy."""
    settings = get_settings()
    logger = get_run_logger()
    with get_client(sync_client=True) as client:
        retries = automatic_retries_in_a_row(client.read_flow_run_states(get_run_context().flow_run.id))
    if retries > settings.max_crash_retries:
        raise CrashLoop(f"crashed and was retried automatically {retries} times in a row (RLHF_MAX_CRASH_RETRIES="
                        f"{settings.max_crash_retries}); not running again: find the cause, then retry by hand")
    root = artifact_root_for(config, settings)
    persisted = {"result_storage": result_storage(settings)}
    plan = preflight.with_options(**persisted)(config, artifact_root=root, ray_address=settings.ray_address)
    config = plan.config
    # A night without changes needs no cluster: every stage is found committed.
    cluster = nullcontext() if plan.reused_everything else ray_address_in_env(settings, log=logger.info)
    with cluster as ray_address:
        logger.info(f"{config.shape}: {' -> '.join(config.stages)}; Ray Jobs API {ray_address or 'not needed'}; "
                    f"artifacts {root}/{config.name}; workspaces {settings.workspace_root}")
        run = stage_task(settings)
        results: dict[str, StageResult] = {}
        production = None
        for stage in config.stages:
            if stage == "evaluate":
                candidate = results[policy_stage(config.shape)]
                production = production_policy.with_options(**persisted)(candidate, artifact_root=root)
            inputs = stage_inputs(config, stage, results, production)
            results[stage] = run(stage, config.section(stage), inputs, pipeline=config.name, artifact_root=root)
        policy = results[policy_stage(config.shape)]
        decision = promote.with_options(**persisted)(policy, results["evaluate"], config.gate, artifact_root=root,
                                                      production=production)
        evaluation_report = publish_report.with_options(**persisted)(results["evaluate"], policy, artifact_root=root)

    unchanged = all(result.reused for result in results.values())
    if unchanged:
        logger.info("nothing changed (config, data, code): every stage reused its committed artifact, "
                    "no Ray job was submitted")
    return PipelineResult(artifact_root=root, shape=config.shape, stages=results, promotion=decision,
                          report=evaluation_report, unchanged=unchanged)
