"""The promotion gate: the candidate policy becomes `production` only when the evaluation shows it is better than its
reference and no worse than the policy in production (within the gate's tolerances).

The evaluation scores the candidate, its reference and the production policy on the same held-out prompts
(`production_pretrain`). An unchanged night finds its candidate already in production: it is judged, as on the
night it was promoted, against the policy it replaced, so the evaluation of that night is reused instead of run
again.

Promotion is a compare-and-swap against the production policy the gate compared with: when another run moved
production meanwhile, the decision says where to (`production_moved_to`) and the flow evaluates again, against the
new production, before it decides; of two concurrent promotions the better policy stays in production. With
`require_approval` a person approves or rejects a candidate that passed before it moves (`approval`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import BaseModel

from infra.artifacts import ArtifactStore, ChecksumError
from pipeline.config import GateRule, PromotionGate
from pipeline.identity import StageResult
from pipeline.report import MODELS, metrics_by_model, metrics_table, model_metric

PRODUCTION_ALIAS = "production"
# The evaluation's paired comparison of each metric the gate compares (stages/evaluate/run.py)
GAIN_METRICS = {"accuracy": "accuracy_gain", "reward_mean": "reward_gain"}
# Metrics are fractions and means in floating point: 0.51 - 0.50 must not exceed a tolerance of 0.01.
ROUNDING = 1e-9


class PromotionDecision(BaseModel):
    """Whether the candidate is `production` after this run, why, and the numbers it was judged on."""

    promoted: bool
    already_production: bool = False  # promoted by an earlier run (an unchanged night)
    stage: str
    version: int
    production_version: int | None  # the production policy compared with; None when there was none
    reasons: list[str]
    scores: dict[str, dict[str, float | int | str]]  # model (policy, reference, production) -> metric -> value
    approval: str | None = None  # what the person asked said, or why nobody approved
    production_moved_to: int | None = None  # set when production moved before the promotion could
    # How many evaluated candidates (this one included) were judged against the same production policy: each is
    # another draw, and a gate on 95% intervals passes a policy no better than production about one draw in 40.
    tries_against_production: int | None = None

    def rejected(self, why: str) -> PromotionDecision:
        """The same decision, not promoted, for `why` (first among the reasons)."""
        return self.model_copy(update={"promoted": False, "reasons": [f"FAIL {why}", *self.reasons]})

    @property
    def moves_production(self) -> bool:
        """Whether carrying the decision out moves the `production` alias."""
        return self.promoted and not self.already_production


def tries_against(store: ArtifactStore, production: StageResult | None, evaluation_stage: str) -> int | None:
    """How many committed evaluations scored `production` as the production policy (None without one)."""
    if production is None:
        return None
    tries = 0
    for version in store.versions(evaluation_stage):
        ref = store.get(evaluation_stage, version).inputs.get("production_pretrain")
        tries += ref is not None and ref.digest == production.digest
    return tries


def production_baseline(store: ArtifactStore, policy: StageResult) -> StageResult | None:
    """The policy the candidate must not fall behind: the one `production` points at, or, when that is the
    candidate itself (nothing changed since it was promoted), the one it replaced. None when there is none, or when
    it is damaged (`intact_version`)."""
    record = store.alias_record(policy.stage, PRODUCTION_ALIAS)
    if record is None:
        return None
    version = record["version"] if record["version"] != policy.version else record.get("previous")
    return None if version is None else intact_version(store, policy.stage, version)


def intact_version(store: ArtifactStore, stage: str, version: int) -> StageResult | None:
    """The production policy `version` if it is as committed (store.verify_for_reuse); else None, the version
    quarantined and the store's log told why: an evaluation would refuse it every night, and the candidate is
    judged on its reference alone, its promotion replacing the damaged policy."""
    why = store.quarantined(stage).get(version)
    if why is None:
        manifest = store.get(stage, version)
        try:
            store.verify_for_reuse(manifest)
            return StageResult.from_manifest(manifest, reused=True)
        except ChecksumError as error:
            why = f"production policy found damaged: {error}"
            store.quarantine(stage, version, why)
    store.log(f"{stage} v{version}, the production policy, is quarantined ({why}): the candidate is judged on its "
              "reference alone and, if it passes, replaces it")
    return None


def judged_on(gain: float, bounds: list[float | None], gate: PromotionGate) -> tuple[float, str]:
    """(what the gate judges of a gain: the gain itself, or with decide_on_intervals its interval's low end `bounds[0]`
    (-inf without an interval), and how a reason line shows it)."""
    if not gate.decide_on_intervals:
        return gain, f"{gain:+.4f}"
    if None in bounds:
        return -math.inf, f"{gain:+.4f} without the interval decide_on_intervals needs"
    return bounds[0], f"{gain:+.4f}, 95% interval [{bounds[0]:+.4f}, {bounds[1]:+.4f}]"


def check_gate(metrics: dict, gate: PromotionGate, production_version: int | None = None,
               candidate: dict | None = None, tries_against_production: int | None = None) -> tuple[bool, list[str]]:
    """(passed, one line per criterion, failures first). `production_version`: the production policy the report
    must have scored (its `production_` metrics), or None. `candidate`: the candidate's own metrics (its manifest).
    `tries_against_production`: the evaluations that scored that production policy, this one included."""
    failures, passes = [], []

    def record(ok: bool, line: str) -> None:
        (passes if ok else failures).append(line)

    judged = metrics.get("prompts", 0)
    record(judged >= gate.min_prompts, f"judged on {judged} held-out prompts (needs >= {gate.min_prompts})")

    def gain_over(name: str, other: str) -> tuple[float, float, str]:
        """(the gain, what the gate judges: the gain or its interval's low end, how the line shows it)."""
        gain = metrics[name] - metrics[f"{other}_{name}"]
        bounds = [metrics.get(f"{GAIN_METRICS[name]}_vs_{other}{end}") for end in ("_low", "_high")]
        return gain, *judged_on(gain, bounds, gate)

    comparisons = 0
    if "accuracy" in metrics and "reference_accuracy" in metrics:
        comparisons += 1
        _, judged_gain, shown = gain_over("accuracy", "reference")
        record(judged_gain >= gate.min_accuracy_gain - ROUNDING,
               f"accuracy gain over the reference {shown} (needs >= {gate.min_accuracy_gain:+.4f})")
    if "reward_mean" in metrics and "reference_reward_mean" in metrics:
        comparisons += 1
        _, judged_gain, shown = gain_over("reward_mean", "reference")
        record(judged_gain > gate.min_reward_gain,
               f"reward gain over the reference {shown} (needs > {gate.min_reward_gain:+.4f})")
    if comparisons == 0:
        record(False, "report has neither accuracy nor reward_mean with their reference_ values")

    if production_version is not None:
        against_production = 0
        for name, tolerance in (("accuracy", gate.max_accuracy_regression),
                                ("reward_mean", gate.max_reward_regression)):  # fmt: skip
            if name in metrics and f"production_{name}" in metrics:
                against_production += 1
                gain, judged_gain, shown = gain_over(name, "production")
                record(-judged_gain <= tolerance + ROUNDING,
                       f"{name} {metrics[name]:.4f} vs production v{production_version} "
                       f"{metrics[f'production_{name}']:.4f}: regression {-gain:+.4f} (gain {shown}; tolerance "
                       f"{tolerance})")
        if against_production == 0:
            record(False, f"report has no production_ metrics although production v{production_version} exists")

        bound = gate.max_tries_against_production
        if bound is not None and tries_against_production is not None:
            record(tries_against_production <= bound,
                   f"candidate {tries_against_production} judged against production v{production_version} (allows "
                   f"at most {bound}: each try is another draw of the same held-out metrics; a candidate past them "
                   "needs a fresh held-out set, or a person raising gate.max_tries_against_production)")

    for rule in gate.rules:
        check_rule(rule, metrics, gate, production_version, record)

    if gate.max_logprob_gap is not None:
        check_logprob_gap(gate.max_logprob_gap, metrics, candidate or {}, record)

    kl = metrics.get("kl_mean")
    if kl is None:
        record(False, "report has no kl_mean")
    else:
        bound_ok = gate.max_kl_mean is None or kl <= gate.max_kl_mean
        record(math.isfinite(kl) and bound_ok,
               f"kl_mean {kl:.4f} (needs finite{'' if gate.max_kl_mean is None else f', <= {gate.max_kl_mean}'})")
    return not failures, [f"FAIL {line}" for line in failures] + [f"ok   {line}" for line in passes]


def check_logprob_gap(bound: float, metrics: dict, candidate: dict, record: Callable[[bool, str], None]) -> None:
    """The engines must run the candidate as the trainer does: the evaluation's gap (required), and the RL stage's
    gap at its last weight sync where the candidate has one."""
    gap = metrics.get("logprob_gap_mean")
    record(gap is not None and gap <= bound,
           f"log-prob gap of the evaluation's engines {gap:.4f} (needs <= {bound})" if gap is not None
           else "report has no logprob_gap_mean (evaluate.logprob_gap_samples 0, or engines other than vLLM)")
    synced = candidate.get("weight_sync_probe_gap_mean")
    if synced is not None:
        record(synced <= bound, f"log-prob gap at the candidate's last weight sync {synced:.4f} (needs <= {bound})")


def check_rule(rule: GateRule, metrics: dict, gate: PromotionGate, production_version: int | None,
               record: Callable[[bool, str], None]) -> None:
    """Record whether the report passes `rule`: enough prompts of its benchmark, the gain over the reference, and
    against production (when one exists) no regression beyond the rule's tolerance."""
    name = rule.benchmark
    judged = metrics.get(f"{name}/prompts", 0)
    if judged < gate.min_prompts:
        record(False, f"{name}: not deciding on {judged} prompts (needs >= {gate.min_prompts})")
        return
    comparison = "win_rate" if rule.metric == "win_rate" else f"{rule.metric}_gain"
    offset = 0.5 if rule.metric == "win_rate" else 0.0  # a win rate's gain is its distance above a tie
    others = ("reference", "production") if production_version is not None else ("reference",)
    for other in others:
        key = f"{name}/{comparison}_vs_{other}"
        if key not in metrics:
            record(False, f"{name}: report has no {key} (the benchmark's format or the stage's models do not give it)")
            continue
        gain = metrics[key] - offset
        bounds = [None if metrics.get(f"{key}{end}") is None else metrics[f"{key}{end}"] - offset
                  for end in ("_low", "_high")]
        decided_on, shown = judged_on(gain, bounds, gate)
        if other == "reference":
            record(decided_on >= rule.min_gain - ROUNDING,
                   f"{name}: {rule.metric} gain over the reference {shown} on {judged} prompts (needs >= "
                   f"{rule.min_gain:+.4f})")
        else:
            record(-decided_on <= rule.max_regression + ROUNDING,
                   f"{name}: {rule.metric} vs production v{production_version}: gain {shown} on {judged} prompts "
                   f"(regression tolerance {rule.max_regression})")


def scores_by_model(metrics: dict) -> dict[str, dict[str, float | int | str]]:
    """{model: {metric: value}} of an evaluation report's metrics."""
    scores: dict[str, dict[str, float | int | str]] = {}
    for name, by_model in metrics_by_model(metrics).items():
        for model, value in by_model.items():
            scores.setdefault(model, {})[name] = value
    return {model: scores[model] for model in MODELS if model in scores}


def decide(policy: StageResult, report: StageResult, gate: PromotionGate, production: StageResult | None,
           current_production: int | None, tries_against_production: int | None = None) -> PromotionDecision:
    """The gate's decision on `policy` from its evaluation `report`; `production` is the policy the report compared
    it with, `current_production` the version the alias points at now, `tries_against_production` how many
    evaluations scored that production policy (`tries_against`)."""
    production_version = production.version if production is not None else None
    passed, reasons = check_gate(report.metrics, gate, production_version, policy.metrics, tries_against_production)
    already = current_production == policy.version
    if already:
        reasons.insert(0, f"already production: promoted by an earlier run (this evaluation "
                          f"{'passes' if passed else 'fails'} the gate)")
    return PromotionDecision(promoted=already or passed, already_production=already, stage=policy.stage,
                             version=policy.version, production_version=production_version, reasons=reasons,
                             scores=scores_by_model(report.metrics), tries_against_production=tries_against_production)


def decision_markdown(decision: PromotionDecision, report_uri: str) -> str:
    if decision.already_production:
        verdict = "already `production`"
    else:
        verdict = "promoted to `production`" if decision.promoted else "**not promoted**"
    against = ("no production policy yet" if decision.production_version is None
               else f"production is {decision.stage} v{decision.production_version}")
    metrics = {model_metric(model, name): value
               for model, values in decision.scores.items() for name, value in values.items()}
    approval = f"\n\napproval: {decision.approval}" if decision.approval else ""
    if decision.tries_against_production and decision.production_version is not None:
        against += (f"; candidate {decision.tries_against_production} judged against it (each try is another draw "
                    "of the held-out metrics)")
    return (f"### {decision.stage} v{decision.version}: {verdict}\n\n"
            f"Candidate {decision.stage} v{decision.version}, its reference, and {against}, on the same held-out "
            f"prompts:\n\n{metrics_table(metrics)}\n\n"
            + "\n".join(f"- `{line}`" for line in decision.reasons)
            + f"{approval}\n\nreport: {report_uri}\n")
