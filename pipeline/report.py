"""An evaluation report as data and markdown: the evaluation's metrics by model (policy, reference, production), a
sample of held-out prompts with each model's answer and reward, and the policy's learning curve as a PNG.

The evaluation stage writes `<name>` metrics for the policy, `reference_<name>` for its reference and, when the
production model is scored too, `production_<name>`: one table row per name, one column per model; its paired
comparisons of the policy with the others (gains and win rates with their 95% intervals) get a table of their own. Its
samples.jsonl holds the first prompts with every model's greedy answer: one table row per prompt, so that a person
sees what would be promoted beside what it replaces. The curve is an image in the markdown: a link relative to
report.md in the stored copy, the PNG itself (a data URI) in the Prefect UI, where no link into the store opens.
"""

from __future__ import annotations

import base64
import io
import math
import re

from pydantic import BaseModel

from pipeline.identity import StageResult

MODELS = ("policy", "reference", "production")
# The evaluation's paired comparisons of the policy with another model, and their interval bounds
COMPARISON = re.compile(r"(?:[\w.-]+/)?(accuracy_gain|reward_gain|win_rate)_vs_(reference|production)")
COMPARISON_OR_BOUND = re.compile(COMPARISON.pattern + r"(_low|_high)?")
CURVE_FILE = "learning_curve.png"
# Panels of the learning curve: (title, history keys drawn in it); a panel without data is left out.
CURVE_PANELS = (("reward", ("reward", "eval_reward")), ("KL to reference", ("kl",)), ("loss", ("loss",)),
                ("log-prob gap, engines vs actor", ("logprob_gap_mean", "sync_probe_gap_mean")))


class ReportResult(BaseModel):
    uri: str
    version: int
    curve_uri: str | None
    markdown: str
    artifact_id: str | None = None  # the Prefect markdown artifact showing it


def comparisons(metrics: dict) -> dict[str, tuple[float, float | None, float | None]]:
    """{comparison: (value, low, high)} of the report's paired comparisons (`accuracy_gain_vs_reference`,
    `win_rate_vs_production`, ...: stages/evaluate/algorithms.py) with their 95% intervals."""
    return {key: (value, metrics.get(f"{key}_low"), metrics.get(f"{key}_high"))
            for key, value in sorted(metrics.items()) if COMPARISON.fullmatch(key)}  # fmt: skip


def metrics_by_model(metrics: dict) -> dict[str, dict[str, float | int | str]]:
    """{metric name: {model: value}}: `reference_x` and `production_x` are x of those models, the rest the policy's,
    and likewise after a benchmark's `<name>/` (`gsm8k/reference_accuracy` is the reference's `gsm8k/accuracy`);
    paired comparisons left out (`comparisons`)."""
    table: dict[str, dict[str, float | int | str]] = {}
    for key, value in metrics.items():
        if COMPARISON_OR_BOUND.fullmatch(key):
            continue
        benchmark, slash, rest = key.rpartition("/")
        model, name = "policy", rest
        for prefix in MODELS[1:]:
            if rest.startswith(prefix + "_"):
                model, name = prefix, rest.removeprefix(prefix + "_")
        table.setdefault(benchmark + slash + name, {})[model] = value
    return dict(sorted(table.items()))


def model_metric(model: str, name: str) -> str:
    """The report's key of `model`'s metric `name` (the inverse of metrics_by_model)."""
    benchmark, slash, rest = name.rpartition("/")
    return benchmark + slash + (rest if model == "policy" else f"{model}_{rest}")


def by_benchmark(metrics: dict) -> dict[str, dict]:
    """{benchmark: its metrics without the `<name>/` prefix}; "" holds the metrics of --prompt_data and the KL."""
    groups: dict[str, dict] = {}
    for key, value in metrics.items():
        benchmark, _, rest = key.rpartition("/")
        groups.setdefault(benchmark, {})[rest] = value
    return dict(sorted(groups.items()))


def _cell(value) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value)


def metrics_table(metrics: dict) -> str:
    """Markdown tables, one per benchmark (the held-out prompts' first, untitled): a row per metric, columns policy
    and reference, and production when it was scored; then the paired comparisons with their intervals."""
    parts = []
    for benchmark, values in by_benchmark(metrics).items():
        table = _benchmark_table(values)
        parts.append(f"**{benchmark}** ({values.get('prompts', '?')} prompts)\n\n{table}" if benchmark else table)
    return "\n\n".join(parts)


def _benchmark_table(metrics: dict) -> str:
    rows = metrics_by_model(metrics)
    scored = {model for by_model in rows.values() for model in by_model}
    columns = [model for model in MODELS if model != "production" or model in scored]
    lines = ["| metric | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, by_model in rows.items():
        lines.append(f"| {name} | " + " | ".join(_cell(by_model.get(model)) for model in columns) + " |")
    paired = comparisons(metrics)
    if paired:
        lines += ["", "| paired comparison | value | 95% interval |", "|---|---:|---:|"]
        lines += [f"| {name} | {_cell(value)} | [{_cell(low)}, {_cell(high)}] |"
                  for name, (value, low, high) in paired.items()]  # fmt: skip
    return "\n".join(lines)


def learning_curve_png(history: list[dict], title: str) -> bytes | None:
    """A PNG of the history's reward, KL, loss and engine-vs-actor log-prob gap by step; None when it has none."""
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


def png_data_uri(png: bytes) -> str:
    """The PNG as a `data:` URI, for an image that shows wherever the markdown is rendered."""
    return "data:image/png;base64," + base64.b64encode(png).decode()


# Markdown punctuation that makes links, images, emphasis and code out of model-written text, escaped with a backslash.
_MARKUP = re.compile(r"([\\|\[\]()!*_`#~])")


def _escaped(text: object, limit: int = 200) -> str:
    """A table cell: markup escaped (answers are model output: an image written as markdown would be fetched from
    anywhere by whoever opens the report, a link would be clickable), HTML's `<` as text, URLs broken for
    autolinking by a zero-width space after the scheme, line breaks shown as ⏎, long texts cut."""
    flat = _MARKUP.sub(r"\\\1", str(text)).replace("<", "&lt;").replace("\r", "").replace("\n", " ⏎ ")
    flat = re.sub(r"(?i)(://|www\.)", lambda m: m.group(1)[0] + "\u200b" + m.group(1)[1:], flat)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _answer(sample: dict | None) -> str:
    if sample is None:
        return "–"
    scores = [f"reward {_cell(sample['reward'])}" if "reward" in sample else "",
              f"RM {_cell(sample['reward_model_score'])}" if "reward_model_score" in sample else ""]
    scored = ", ".join(score for score in scores if score)
    return f"{_escaped(sample['response'])}" + (f" **({scored})**" if scored else "")


def samples_table(samples: list[dict]) -> str:
    """Markdown tables, one per benchmark: a row per held-out prompt, its label, and each model's answer with its
    reward."""
    benchmarks: dict[str, list[dict]] = {}
    for sample in samples:
        benchmarks.setdefault(sample.get("benchmark") or "", []).append(sample)
    return "\n\n".join(f"**{name}**\n\n{_samples_table(rows)}" if name else _samples_table(rows)
                        for name, rows in benchmarks.items())


def _samples_table(samples: list[dict]) -> str:
    by_prompt: dict[str, dict] = {}
    for sample in samples:
        row = by_prompt.setdefault(sample["prompt"], {"label": sample.get("label")})
        row[sample["model"]] = sample
    models = [model for model in MODELS if any(model in row for row in by_prompt.values())]
    names = {"policy": "candidate"}
    lines = ["| prompt | label | " + " | ".join(names.get(m, m) for m in models) + " |",
             "|---|---|" + "---|" * len(models)]
    for prompt, row in by_prompt.items():
        lines.append(f"| {_escaped(prompt)} | {_escaped(row['label'] or '–')} | "
                     + " | ".join(_answer(row.get(model)) for model in models) + " |")
    return "\n".join(lines)


def report_markdown(report: StageResult, policy: StageResult, curve_src: str | None, samples: list[dict]) -> str:
    """The report: metrics by model, held-out answers by model, the learning curve (an image at `curve_src`)."""
    curve = (f"Learning curve of {policy.stage} v{policy.version}:\n\n![learning curve of {policy.stage} "
             f"v{policy.version}]({curve_src})" if curve_src
             else f"{policy.stage} v{policy.version} has no history.json: no learning curve.")
    answers = (f"Held-out prompts, answered greedily by each model:\n\n{samples_table(samples)}" if samples
               else "The evaluation kept no sample answers.")
    return (f"### Evaluation of {policy.stage} v{policy.version}\n\n"
            f"{metrics_table(report.metrics)}\n\n{answers}\n\n{curve}\n\n"
            f"evaluation: {report.uri}  \npolicy: {policy.uri}\n")
