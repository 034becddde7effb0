"""The promotion gate as Prefect tasks (pipeline/gate.py decides): which production policy the evaluation compares
with, and moving the policy stage's `production` alias when the gate passes."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.artifacts import open_store
from pipeline.config import PromotionGate
from pipeline.gate import PRODUCTION_ALIAS, PromotionDecision, decide, decision_markdown, production_baseline
from pipeline.identity import StageResult
from tasks.run_stage import artifact_key


@task(name="production-policy", persist_result=True)
def production_policy(policy: StageResult, *, artifact_root: str) -> StageResult | None:
    """`production_baseline` of the candidate; a task, so that a retried run compares with the same policy."""
    return production_baseline(open_store(artifact_root, policy.pipeline, log=get_run_logger().warning), policy)


@task(name="promote", persist_result=True)
def promote(
    policy: StageResult, report: StageResult, gate: PromotionGate, *, artifact_root: str,
    production: StageResult | None = None,
) -> PromotionDecision:  # fmt: skip
    """Point `production` of the policy's stage at the candidate if the report passes `gate`; `production` is the
    policy it was compared with (production_policy's answer)."""
    logger = get_run_logger()
    store = open_store(artifact_root, policy.pipeline)
    current = store.alias_record(policy.stage, PRODUCTION_ALIAS)
    decision = decide(policy, report, gate, production, current["version"] if current else None)
    if decision.promoted and not decision.already_production:
        store.set_alias(policy.stage, PRODUCTION_ALIAS, policy.version)
        logger.info(f"promoted {policy.stage} v{policy.version} to {PRODUCTION_ALIAS}")
    elif decision.already_production:
        logger.info(f"{policy.stage} v{policy.version} is production already")
    else:
        logger.warning(f"{policy.stage} v{policy.version} not promoted: "
                       + "; ".join(r for r in decision.reasons if r.startswith("FAIL")))
    create_markdown_artifact(key=artifact_key(policy.pipeline, "promotion"), markdown=decision_markdown(decision,
                             report.uri), description=f"promotion gate of {policy.stage} v{policy.version}")
    return decision
