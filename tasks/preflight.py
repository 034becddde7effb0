"""The flow's first task: the plan (pipeline/plan.py) against the cluster the stages will run on, shown in the log
and as a markdown artifact, failing naming every problem before any job starts."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.settings import get_settings
from pipeline.config import PipelineConfig
from pipeline.plan import Plan, build_plan, raise_for_problems
from tasks.run_stage import artifact_key


@task(name="preflight", persist_result=True)
def preflight(config: PipelineConfig, *, artifact_root: str, ray_address: str | None) -> Plan:
    logger = get_run_logger()
    plan = build_plan(config, get_settings(), ray_address, artifact_root=artifact_root, local_binding=True,
                      log=logger.info)
    text = plan.render()
    logger.info("preflight plan:\n" + text)
    create_markdown_artifact(key=artifact_key(config.name, "plan"), markdown=f"```\n{text}\n```",
                             description=f"preflight of {config.name} ({config.shape})")
    raise_for_problems(plan)
    return plan
