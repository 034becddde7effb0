"""The promotion gate as Prefect tasks (pipeline/gate.py decides): which production policy the evaluation compares
with, the gate's decision, and moving the policy stage's `production` alias, by compare-and-swap against the
production policy the decision was taken on."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from infra.artifacts import AliasMoved, open_store
from pipeline.config import PromotionGate
from pipeline.gate import (
    PRODUCTION_ALIAS, PromotionDecision, decide, decision_markdown, production_baseline, tries_against,
)  # fmt: skip
from pipeline.identity import StageResult
from tasks.run_stage import artifact_key


@task(name="production-policy", persist_result=True)
def production_policy(policy: StageResult, *, artifact_root: str, moved_to: int | None = None) -> StageResult | None:
    """`production_baseline` of the candidate; a task, so that a retried run compares with the same policy.
    `moved_to`: where production moved under a concurrent promotion, read again (a new input, not this run's cache)."""
    return production_baseline(open_store(artifact_root, policy.pipeline, log=get_run_logger().warning), policy)


@task(name="judge", persist_result=True)
def judge(policy: StageResult, report: StageResult, gate: PromotionGate, *, artifact_root: str,
          production: StageResult | None = None) -> PromotionDecision:  # fmt: skip
    """The gate's decision on the candidate from its evaluation `report`; `production` is the policy it was compared
    with (production_policy's answer)."""
    store = open_store(artifact_root, policy.pipeline)
    current = store.alias_record(policy.stage, PRODUCTION_ALIAS)
    return decide(policy, report, gate, production, current["version"] if current else None,
                  tries_against(store, production, report.stage))


@task(name="promote", persist_result=True)
def promote(decision: PromotionDecision, report: StageResult, *, pipeline: str, artifact_root: str,
            ) -> PromotionDecision:  # fmt: skip
    """Carry the decision out: point `production` at the candidate if it still points at the policy the decision
    compared with; when it moved meanwhile, the decision comes back unpromoted with `production_moved_to` set."""
    logger = get_run_logger()
    if decision.moves_production:
        store = open_store(artifact_root, pipeline)
        try:
            store.set_alias(decision.stage, PRODUCTION_ALIAS, decision.version, expected=decision.production_version)
            logger.info(f"promoted {decision.stage} v{decision.version} to {PRODUCTION_ALIAS}")
        except AliasMoved as moved:
            logger.warning(f"{decision.stage} v{decision.version} not promoted yet: {moved}; evaluating again")
            decision = decision.rejected(f"production moved to v{moved.current} meanwhile: {moved}")
            return decision.model_copy(update={"production_moved_to": moved.current})
    elif decision.already_production:
        logger.info(f"{decision.stage} v{decision.version} is production already")
    else:
        logger.warning(f"{decision.stage} v{decision.version} not promoted: "
                       + "; ".join(r for r in decision.reasons if r.startswith("FAIL")))
    create_markdown_artifact(key=artifact_key(pipeline, "promotion"), markdown=decision_markdown(decision, report.uri),
                             description=f"promotion gate of {decision.stage} v{decision.version}")
    return decision
