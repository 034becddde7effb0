"""An evaluation report as data and markdown: the evaluation's metrics by model (policy, reference, production) and
the policy's learning curve as a PNG.

The evaluation stage writes `<name>` metrics for the policy, `reference_<name>` for its reference and, when the
production model is scored too, `production_<name>`: one table row per name, one column per model.
"""

from __future__ import annotations

import io
import math

from pydantic import BaseModel

from pipeline.identity import StageResult

MODELS = ("policy", "reference", "production")
CURVE_FILE = "learning_curve.png"
# Panels of the learning curve: (title, history keys drawn in it); a panel without data is left out.
CURVE_PANELS = (("reward", ("reward", "eval_reward")), ("KL to reference", ("kl",)), ("loss", ("loss",)))


class ReportResult(BaseModel):
    uri: str
    version: int
    curve_uri: str | None
    markdown: str


def metrics_by_model(metrics: dict) -> dict[str, dict[str, float | int | str]]:
    """{metric name: {model: value}}: `reference_x` and `production_x` are x of those models, the rest the policy's."""
    table: dict[str, dict[str, float | int | str]] = {}
    for key, value in metrics.items():
        model, name = "policy", key
        for prefix in MODELS[1:]:
            if key.startswith(prefix + "_"):
                model, name = prefix, key.removeprefix(prefix + "_")
        table.setdefault(name, {})[model] = value
    return dict(sorted(table.items()))


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def metrics_table(metrics: dict) -> str:
    """Markdown table: a row per metric, columns policy and reference, and production when it was scored."""
    rows = metrics_by_model(metrics)
    scored = {model for by_model in rows.values() for model in by_model}
    columns = [model for model in MODELS if model != "production" or model in scored]
    lines = ["| metric | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, by_model in rows.items():
        lines.append(f"| {name} | " + " | ".join(_cell(by_model.get(model)) for model in columns) + " |")
    return "\n".join(lines)


def learning_curve_png(history: list[dict], title: str) -> bytes | None:
    """A PNG of the history's reward, KL and loss by step; None when it has none of them."""
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    panels = []
    for panel_title, keys in CURVE_PANELS:
        series = {}
        for key in keys:
            points = [(r["step"], r[key]) for r in history if isinstance(r.get(key), (int, float)) and "step" in r]
            if points:
                series[key] = points
        if series:
            panels.append((panel_title, series))
    if not panels:
        return None
    figure, axes = plt.subplots(len(panels), 1, figsize=(7, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (panel_title, series) in zip(axes[:, 0], panels):
        for key, points in series.items():
            ax.plot(*zip(*points), marker="o", markersize=3, label=key)
        ax.set_ylabel(panel_title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    figure.suptitle(title)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100)
    plt.close(figure)
    return buffer.getvalue()


def report_markdown(report: StageResult, policy: StageResult, curve_link: str | None) -> str:
    curve = (f"Learning curve of {policy.stage} v{policy.version} (PNG in the artifact store): [{CURVE_FILE}]({curve_link})"
             if curve_link else f"{policy.stage} v{policy.version} has no history.json: no learning curve.")
    return (f"### Evaluation of {policy.stage} v{policy.version}\n\n"
            f"{metrics_table(report.metrics)}\n\n{curve}\n\n"
            f"evaluation: {report.uri}  \npolicy: {policy.uri}\n")
