"""The promotion gate: move the policy stage's `production` alias only when the evaluation shows the candidate is
better than its reference and no worse than the policy in production (within the gate's tolerances).

The evaluation scores the candidate, its reference and the production policy on the same held-out prompts
(`production_pretrain`, fed by `production_policy`). An unchanged night finds its candidate already in
production: it is judged, as on the night it was promoted, against the policy it replaced, so the evaluation of
that night is reused instead of run again.
"""

from __future__ import annotations

import math

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from pydantic import BaseModel

from infra.artifacts import ArtifactStore, open_store
from stages.config import PromotionGate
from tasks.report import MODELS, metrics_by_model, metrics_table
from tasks.run_stage import StageResult, artifact_key

PRODUCTION_ALIAS = "production"
# Metrics are fractions and means in floating point: 0.51 - 0.50 must not exceed a tolerance of 0.01.
ROUNDING = 1e-9


class PromotionDecision(BaseModel):
    """Whether the candidate is `production` after this run, why, and the numbers it was judged on."""

    promoted: bool
    stage: str
    version: int
    production_version: int | None  # the production policy compared with; None when there was none
    reasons: list[str]
    scores: dict[str, dict[str, float | int | str]]  # model (policy, reference, production) -> metric -> value


def production_baseline(store: ArtifactStore, policy: StageResult) -> StageResult | None:
    """The policy the candidate must not fall behind: the one `production` points at, or, when that is the
    candidate itself (nothing changed since it was promoted), the one it replaced. None when there is none."""
    record = store.alias_record(policy.stage, PRODUCTION_ALIAS)
    if record is None:
        return None
    version = record["version"] if record["version"] != policy.version else record.get("previous")
    return None if version is None else StageResult.from_manifest(store.get(policy.stage, version), reused=True)


@task(name="production-policy", persist_result=True)
def production_policy(policy: StageResult, *, artifact_root: str) -> StageResult | None:
    """`production_baseline` of the candidate; a task, so that a retried run compares with the same policy."""
    return production_baseline(open_store(artifact_root, policy.pipeline, log=get_run_logger().warning), policy)


def check_gate(metrics: dict, gate: PromotionGate, production_version: int | None = None) -> tuple[bool, list[str]]:
    """(passed, one line per criterion, failures first). `production_version`: the production policy the report
    must have scored (its `production_` metrics), or None."""
    failures, passes = [], []

    def record(ok: bool, line: str) -> None:
        (passes if ok else failures).append(line)

    comparisons = 0
    if "accuracy" in metrics and "reference_accuracy" in metrics:
        comparisons += 1
        gain = metrics["accuracy"] - metrics["reference_accuracy"]
        record(gain >= gate.min_accuracy_gain - ROUNDING,
               f"accuracy gain over the reference {gain:+.4f} (needs >= {gate.min_accuracy_gain:+.4f})")
    if "reward_mean" in metrics and "reference_reward_mean" in metrics:
        comparisons += 1
        gain = metrics["reward_mean"] - metrics["reference_reward_mean"]
        record(gain > gate.min_reward_gain,
               f"reward gain over the reference {gain:+.4f} (needs > {gate.min_reward_gain:+.4f})")
    if comparisons == 0:
        record(False, "report has neither accuracy nor reward_mean with their reference_ values")

    if production_version is not None:
        against_production = 0
        for name, tolerance in (("accuracy", gate.max_accuracy_regression),
                                ("reward_mean", gate.max_reward_regression)):  # fmt: skip
            if name in metrics and f"production_{name}" in metrics:
                against_production += 1
                regression = metrics[f"production_{name}"] - metrics[name]
                record(regression <= tolerance + ROUNDING,
                       f"{name} {metrics[name]:.4f} vs production v{production_version} "
                       f"{metrics[f'production_{name}']:.4f}: regression {regression:+.4f} (tolerance {tolerance})")
        if against_production == 0:
            record(False, f"report has no production_ metrics although production v{production_version} exists")

    kl = metrics.get("kl_mean")
    if kl is None:
        record(False, "report has no kl_mean")
    else:
        bound_ok = gate.max_kl_mean is None or kl <= gate.max_kl_mean
        record(math.isfinite(kl) and bound_ok,
               f"kl_mean {kl:.4f} (needs finite{'' if gate.max_kl_mean is None else f', <= {gate.max_kl_mean}'})")
    return not failures, [f"FAIL {line}" for line in failures] + [f"ok   {line}" for line in passes]


def scores_by_model(metrics: dict) -> dict[str, dict[str, float | int | str]]:
    """{model: {metric: value}} of an evaluation report's metrics."""
    scores: dict[str, dict[str, float | int | str]] = {}
    for name, by_model in metrics_by_model(metrics).items():
        for model, value in by_model.items():
            scores.setdefault(model, {})[name] = value
    return {model: scores[model] for model in MODELS if model in scores}


@task(name="promote", persist_result=True)
def promote(
    policy: StageResult, report: StageResult, gate: PromotionGate, *, artifact_root: str,
    production: StageResult | None = None,
) -> PromotionDecision:  # fmt: skip
    """Point `production` of the policy's stage at the candidate if the report passes `gate`; `production` is the
    policy it was compared with (production_policy's answer)."""
    logger = get_run_logger()
    store = open_store(artifact_root, policy.pipeline)
    production_version = production.version if production is not None else None
    passed, reasons = check_gate(report.metrics, gate, production_version)
    current = store.alias_record(policy.stage, PRODUCTION_ALIAS)
    already = current is not None and current["version"] == policy.version
    if already:
        reasons.insert(0, f"already production: promoted by an earlier run (this evaluation "
                          f"{'passes' if passed else 'fails'} the gate)")
        logger.info(f"{policy.stage} v{policy.version} is production already")
    elif passed:
        store.set_alias(policy.stage, PRODUCTION_ALIAS, policy.version)
        logger.info(f"promoted {policy.stage} v{policy.version} to {PRODUCTION_ALIAS}")
    else:
        logger.warning(f"{policy.stage} v{policy.version} not promoted: " + "; ".join(r for r in reasons
                                                                                     if r.startswith("FAIL")))
    decision = PromotionDecision(promoted=already or passed, stage=policy.stage, version=policy.version,
                                 production_version=production_version, reasons=reasons,
                                 scores=scores_by_model(report.metrics))  # fmt: skip
    create_markdown_artifact(key=artifact_key(policy.pipeline, "promotion"), markdown=decision_markdown(decision,
                             report.uri), description=f"promotion gate of {policy.stage} v{policy.version}")
    return decision


def decision_markdown(decision: PromotionDecision, report_uri: str) -> str:
    if decision.reasons and decision.reasons[0].startswith("already production"):
        verdict = "already `production`"
    else:
        verdict = "promoted to `production`" if decision.promoted else "**not promoted**"
    against = ("no production policy yet" if decision.production_version is None
               else f"production is {decision.stage} v{decision.production_version}")
    metrics = {f"{model}_{name}" if model != "policy" else name: value
               for model, values in decision.scores.items() for name, value in values.items()}
    return (f"### {decision.stage} v{decision.version}: {verdict}\n\n"
            f"Candidate {decision.stage} v{decision.version}, its reference, and {against}, on the same held-out "
            f"prompts:\n\n{metrics_table(metrics)}\n\n"
            + "\n".join(f"- `{line}`" for line in decision.reasons)
            + f"\n\nreport: {report_uri}\n")
