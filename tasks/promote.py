"""Move the policy's `production` alias, but only when its evaluation report passes the gate."""

from __future__ import annotations

import math

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel, Field

from infra.artifacts import open_store
from tasks.run_stage import StageResult, artifact_key

PRODUCTION_ALIAS = "production"


class PromotionGate(BaseModel):
    """What the evaluation report must show. A comparison applies when the report has both of its metrics
    (accuracy needs a rule reward, reward_mean a reward model); at least one must apply."""

    min_reward_gain: float = Field(
        0.0, description="reward_mean - reference_reward_mean must be greater than this"
    )
    min_accuracy_gain: float = Field(
        0.0, description="accuracy - reference_accuracy must be at least this"
    )
    max_kl_mean: float | None = Field(
        None, description="upper bound on kl_mean (policy vs reference); it must be finite in any case"
    )


class PromotionDecision(BaseModel):
    promoted: bool
    stage: str
    version: int
    reasons: list[str]


def check_gate(metrics: dict, gate: PromotionGate) -> tuple[bool, list[str]]:
    """(passed, one line per criterion)."""
    failures, passes = [], []

    def record(ok: bool, line: str) -> None:
        (passes if ok else failures).append(line)

    comparisons = 0
    if "accuracy" in metrics and "reference_accuracy" in metrics:
        comparisons += 1
        gain = metrics["accuracy"] - metrics["reference_accuracy"]
        record(gain >= gate.min_accuracy_gain,
               f"accuracy gain {gain:+.4f} (needs >= {gate.min_accuracy_gain:+.4f})")
    if "reward_mean" in metrics and "reference_reward_mean" in metrics:
        comparisons += 1
        gain = metrics["reward_mean"] - metrics["reference_reward_mean"]
        record(gain > gate.min_reward_gain, f"reward gain {gain:+.4f} (needs > {gate.min_reward_gain:+.4f})")
    if comparisons == 0:
        record(False, "report has neither accuracy nor reward_mean with their reference_ values")
    kl = metrics.get("kl_mean")
    if kl is None:
        record(False, "report has no kl_mean")
    else:
        bound_ok = gate.max_kl_mean is None or kl <= gate.max_kl_mean
        record(math.isfinite(kl) and bound_ok,
               f"kl_mean {kl:.4f} (needs finite{'' if gate.max_kl_mean is None else f', <= {gate.max_kl_mean}'})")
    return not failures, [f"FAIL {line}" for line in failures] + [f"ok   {line}" for line in passes]


@task(name="promote", persist_result=True)
def promote(
    policy_manifest: StageResult, report_manifest: StageResult, gate: PromotionGate, *, artifact_root: str
) -> PromotionDecision:
    """Point `production` of the policy's stage at its version if the report passes `gate`."""
    logger = get_run_logger()
    passed, reasons = check_gate(report_manifest.metrics, gate)
    decision = PromotionDecision(
        promoted=passed, stage=policy_manifest.stage, version=policy_manifest.version, reasons=reasons
    )
    if passed:
        store = open_store(artifact_root, policy_manifest.pipeline)
        store.set_alias(policy_manifest.stage, PRODUCTION_ALIAS, policy_manifest.version)
        logger.info(f"promoted {policy_manifest.stage} v{policy_manifest.version} to {PRODUCTION_ALIAS}")
    else:
        logger.warning(f"{policy_manifest.stage} v{policy_manifest.version} not promoted: " + "; ".join(reasons))
    verdict = "promoted to `production`" if passed else "**not promoted**"
    create_markdown_artifact(
        key=artifact_key(policy_manifest.pipeline, "promotion"),
        markdown=f"### {policy_manifest.stage} v{policy_manifest.version}: {verdict}\n\n"
        + "\n".join(f"- `{line}`" for line in reasons)
        + f"\n\nreport: {report_manifest.uri}",
    )
    return decision
