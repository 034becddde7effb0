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

A run of a deployment may set otherwise than the deployment's own `config` parameter only the fields declared
RunOverride (stages/fields.py): how much to train, how often to checkpoint (never off) and log, the training
seeds, the rollout engine. Everything else (models, data, reward sources, the gate and the evaluation it judges,
where artifacts go) is the deployment's; a run that changes it fails before it starts anything.

The end of a run: the evaluation of the candidate beside its reference and the production policy, the report, the
gate's decision, with `gate.require_approval` a pause for a person's approval (a form in the Prefect UI, or
`python -m flows.approve`; no answer within `gate.approval_timeout_s` rejects), and the promotion, a
compare-and-swap against the production policy the gate compared with. When another run moved production
meanwhile, the evaluation runs again against the new production before the gate decides again.
"""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

import yaml
from prefect import flow, get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import StateType
from prefect.context import get_run_context

from flows.approval import await_approval
from flows.results import PipelineResult
from flows.server_setup import AUTO_RETRY_MESSAGE
from infra.ray_cluster import ray_address_in_env
from infra.settings import Settings, get_settings
from pipeline.config import (
    PipelineConfig, overrides_out_of_bounds, policy_stage, refused_overrides, run_overrides, validate_pipeline,
)  # fmt: skip
from pipeline.gate import PromotionDecision
from pipeline.identity import StageResult, stage_inputs
from pipeline.report import ReportResult
from tasks.preflight import preflight
from tasks.promote import judge, production_policy, promote
from tasks.report import publish_report
from tasks.results import RESULT_SERIALIZER, persisted
from tasks.run_stage import stage_task

# Evaluations against a production policy that other runs keep moving, before this run gives up promoting.
MAX_PROMOTION_ROUNDS = 3


class CrashLoop(RuntimeError):
    """The run was retried automatically after crashes too many times in a row."""


class OverrideRefused(ValueError):
    """A deployment run's config changes fields that only the deployment sets."""


class DeploymentChanged(ValueError):
    """The server's copy of a deployment differs from the deployments installed on the worker."""


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


def installed_deployment(path: Path, name: str) -> dict:
    """Deployment `name` as the deployments file installed on this worker defines it."""
    try:
        deployments = (yaml.safe_load(path.read_text()) or {}).get("deployments") or []
    except (OSError, yaml.YAMLError, AttributeError) as error:
        raise DeploymentChanged(f"cannot read the installed deployments {path} (RLHF_DEPLOYMENTS_FILE): "
                                f"{getattr(error, 'strerror', None) or error}") from error
    for deployment in deployments:
        if isinstance(deployment, dict) and deployment.get("name") == name:
            return deployment
    raise DeploymentChanged(f"deployment {name} is not one of {path} (the deployments installed on this worker, "
                            "RLHF_DEPLOYMENTS_FILE): not running a deployment the installed project does not define")


def differing_keys(ours, theirs, where: str) -> list[str]:
    """Dotted paths at which two JSON-like values differ (values never shown: they may hold credentials)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        return [found for key in sorted(set(ours) | set(theirs), key=str)
                for found in differing_keys(ours.get(key), theirs.get(key), f"{where}.{key}")]
    return [] if ours == theirs else [where]


def check_deployment(deployment, run_job_variables: dict, settings: Settings) -> None:
    """The server's copy of the run's deployment (parameters, job variables) is the installed one, and the run sets
    no job variable of its own: any API user may change the server's copy, and the worker takes from it what runs."""
    installed = installed_deployment(settings.deployments_file, deployment.name)
    job_variables = (installed.get("work_pool") or {}).get("job_variables") or {}
    changed = (differing_keys(installed.get("parameters") or {}, deployment.parameters or {}, "parameters")
               + differing_keys(job_variables, deployment.job_variables or {}, "job_variables"))
    if changed:
        raise DeploymentChanged(
            f"deployment {deployment.name} on the server differs from {settings.deployments_file} at "
            f"{', '.join(changed)}: not running it. Only `prefect deploy` from the installed project sets a "
            "deployment; deploy again to undo the change (and find who made it)")
    own = sorted(key for key, value in (run_job_variables or {}).items() if job_variables.get(key) != value)
    if own:
        raise OverrideRefused(f"this run of deployment {deployment.name} sets job variables {', '.join(own)}: what "
                              "a run executes and its environment are fixed by the work pool and the deployment")


def paused_runs_beside(client, flow_run) -> list:
    """The other runs of `flow_run`'s deployment that are paused (waiting for a person's approval)."""
    from prefect.client.schemas.filters import (
        FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterId, FlowRunFilterState, FlowRunFilterStateType,
    )  # fmt: skip

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        deployment_id=FlowRunFilterDeploymentId(any_=[flow_run.deployment_id]),
        id=FlowRunFilterId(not_any_=[flow_run.id]),
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED]))))  # fmt: skip


def check_run(config: PipelineConfig, settings: Settings) -> None:
    """Refuse a crash loop, a run beside a paused run of its deployment, a deployment changed on the server, and a
    deployment run that sets job variables or changes more config fields than the RunOverride ones."""
    flow_run = get_run_context().flow_run
    with get_client(sync_client=True) as client:
        retries = automatic_retries_in_a_row(client.read_flow_run_states(flow_run.id))
        deployment = client.read_deployment(flow_run.deployment_id) if flow_run.deployment_id else None
        paused = paused_runs_beside(client, flow_run) if deployment is not None else []
    if paused:
        # Prefect gives the deployment's slot back while a run waits for approval: two nights would then train
        # side by side and race to promote.
        raise OverrideRefused(f"run {paused[0].name} of deployment {deployment.name} is paused, waiting for "
                              "approval: approve or reject it (python -m flows.approval), then run again")
    if retries > settings.max_crash_retries:
        raise CrashLoop(f"crashed and was retried automatically {retries} times in a row (RLHF_MAX_CRASH_RETRIES="
                        f"{settings.max_crash_retries}); not running again: find the cause, then retry by hand")
    if deployment is not None:
        check_deployment(deployment, flow_run.job_variables, settings)
        deployed = validate_pipeline(deployment.parameters["config"], f"deployment {deployment.name}'s config")
        refused = refused_overrides(deployed, config)
        if refused:
            raise OverrideRefused(f"this run of deployment {deployment.name} changes {', '.join(refused)}: only the "
                                  f"deployment sets them; a run may set {', '.join(run_overrides())}")
        out_of_bounds = overrides_out_of_bounds(deployed, config)
        if out_of_bounds:
            raise OverrideRefused(f"this run of deployment {deployment.name} sets {', '.join(out_of_bounds)}: a run "
                                  "may not turn checkpoints off or make them rarer; the deployment's own parameters "
                                  "may")


# The flow's own result (small) goes to Prefect's default result storage: PREFECT_LOCAL_STORAGE_PATH, or
# PREFECT_DEFAULT_RESULT_STORAGE_BLOCK in production, as JSON; the tasks' to the checked result storage
# (tasks/results.py), which a retried run loads them from.
@flow(name="full-rlhf", persist_result=True, result_serializer=RESULT_SERIALIZER)
def full_rlhf(config: PipelineConfig) -> PipelineResult:
    """The stages of `config.shape` in order, then evaluation and the promotion gate: the candidate policy becomes
    `production` only if it beats its reference and does not fall behind the current production policy."""
    settings = get_settings()
    logger = get_run_logger()
    check_run(config, settings)
    root = artifact_root_for(config, settings)
    options = persisted(settings)
    plan = preflight.with_options(**options)(config, artifact_root=root, ray_address=settings.ray_address)
    config = plan.config
    # A night without changes needs no cluster: every stage is found committed.
    cluster = nullcontext() if plan.reused_everything else ray_address_in_env(settings, log=logger.info)
    with cluster as ray_address:
        logger.info(f"{config.shape}: {' -> '.join(config.stages)}; Ray Jobs API {ray_address or 'not needed'}; "
                    f"artifacts {root}/{config.name}; workspaces {settings.workspace_root}")
        run = stage_task(settings)
        results: dict[str, StageResult] = {}
        for stage in config.stages[:-1]:  # every shape ends with the evaluation
            results[stage] = run(stage, config.section(stage), stage_inputs(config, stage, results),
                                 pipeline=config.name, artifact_root=root)
        decision, report = evaluate_and_promote(config, results, run, options, root)

    unchanged = all(result.reused for result in results.values())
    if unchanged:
        logger.info("nothing changed (config, data, code): every stage reused its committed artifact, "
                    "no Ray job was submitted")
    return PipelineResult(artifact_root=root, shape=config.shape, stages=results, promotion=decision,
                          report=report, unchanged=unchanged)


def evaluate_and_promote(config: PipelineConfig, results: dict[str, StageResult], run, options: dict, root: str,
                         ) -> tuple[PromotionDecision, ReportResult]:  # fmt: skip
    """Evaluate the candidate against the production policy, report, decide, ask for approval when the gate says
    so, and promote; again against the new production while other runs move it (at most MAX_PROMOTION_ROUNDS).
    Adds the evaluation to `results`."""
    logger = get_run_logger()
    policy = results[policy_stage(config.shape)]
    moved_to = None
    for _ in range(MAX_PROMOTION_ROUNDS):
        production = production_policy.with_options(**options)(policy, artifact_root=root, moved_to=moved_to)
        results["evaluate"] = run("evaluate", config.section("evaluate"),
                                  stage_inputs(config, "evaluate", results, production), pipeline=config.name,
                                  artifact_root=root)  # fmt: skip
        report = publish_report.with_options(**options)(results["evaluate"], policy, artifact_root=root)
        decision = judge.with_options(**options)(policy, results["evaluate"], config.gate, artifact_root=root,
                                                 production=production)
        if decision.moves_production and config.gate.require_approval:
            decision = await_approval(decision, report, config.gate)
        decision = promote.with_options(**options)(decision, results["evaluate"], pipeline=config.name,
                                                   artifact_root=root)
        if decision.production_moved_to is None:
            return decision, report
        moved_to = decision.production_moved_to
        logger.warning(f"production moved to {policy.stage} v{moved_to} during this run: evaluating "
                       f"{policy.stage} v{policy.version} against it")
    return decision.rejected(f"production moved {MAX_PROMOTION_ROUNDS} times during this run"), report
