"""Benchmark suites of the evaluation (`--eval_suite FILE`, or an `eval_suite:` list in a preset's evaluate section):
which datasets every model answers, in which format, and how its answers are scored.

Formats, with the columns each reads (a benchmark's `input_key` / `label_key` override them):
- `gsm8k`: `question`, `answer` whose final answer follows `####` (openai/gsm8k);
- `math`: `problem`, and `answer` where the dataset has one (HuggingFaceH4/MATH-500), else the last `\\boxed{}` of
  `solution` (the MATH dataset);
- `prompts`: the stage's `input_key` / `label_key`, scored by the stage's reward function (--remote_rm_url);
- `preference_prompts`: `prompt` only (each distinct prompt once: preference data repeats a prompt per pair; a whole
  conversation, such as `chosen` where the data has no prompt column, up to its final answer), answers judged by the
  reward model (--reward_pretrain): its mean score and the win rates between the models.
`gsm8k` and `math` answers are compared with the label by math-verify (stages/answers.py); a greedy answer with no
final answer to extract is counted (`extraction_failures`) and scores 0.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import yaml
from pydantic import Field, ValidationError

from stages.config import StrictModel, validation_messages

BenchmarkFormat = Literal["gsm8k", "math", "prompts", "preference_prompts"]
# Columns each format reads unless the benchmark names others: (prompt column, label column or None).
FORMAT_COLUMNS: dict[str, tuple[str | None, str | None]] = {
    "gsm8k": ("question", "answer"),
    "math": ("problem", None),  # the label column is `answer` where present, else `solution`: see math_label_key
    "prompts": (None, None),  # the stage's input_key / label_key
    "preference_prompts": ("prompt", None),
}
# Formats whose answers are compared with a label by math-verify.
MATH_FORMATS = ("gsm8k", "math")
# The tiny task's held-out prompts in each format (stages/tiny.py): what a benchmark without a dataset reads in a
# pipeline with tiny_assets_dir, and what the rehearsal reads in place of every benchmark's dataset.
TINY_BENCHMARK_ASSETS = {"gsm8k": "prompts_eval_gsm8k", "math": "prompts_eval_math", "prompts": "prompts_eval",
                         "preference_prompts": "pref_eval"}


class Benchmark(StrictModel):
    """One benchmark of an evaluation suite: its prompts, how answers are scored, how many samples per prompt."""

    name: str = Field(
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$",
        description="prefix of its metrics (`<name>/accuracy`, ...): letters, digits, `_`, `.`, `-`",
    )
    dataset: str | None = Field(
        None, description="hub name (`org/name#revision` pins it), local json/jsonl/parquet or s3:// URI; "
        "`@split` after it picks the split; unset: the tiny task's held-out prompts in this format (tiny pipelines)",
    )
    split: str = Field("test", description="split read when `dataset` names none with `@split`")
    subset: str | None = Field(None, description="a hub dataset's configuration (openai/gsm8k: main)")
    format: BenchmarkFormat = Field(description="gsm8k, math, prompts or preference_prompts (module docstring)")
    n_samples: int = Field(
        4, ge=0, description="samples per prompt at the stage's --eval_temperature for pass<n> and maj<n> (0: greedy "
        "answers only)",
    )
    max_samples: int = Field(1_000_000, ge=1, description="the first this many prompts of the dataset")
    input_key: str | None = Field(None, description="prompt column; unset: the format's")
    label_key: str | None = Field(None, description="label column; unset: the format's")


def load_suite(value: str | list | None) -> list[dict] | None:
    """A suite given as a YAML file's path (its `benchmarks:` list, or a list at its top) as the list of its
    benchmarks; lists and None unchanged. Errors name the file and the benchmark."""
    if value is None or isinstance(value, list):
        return value
    path = Path(str(value)).expanduser()
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as error:
        raise ValueError(f"cannot read the eval suite {value}: {error.strerror or error}") from error
    except yaml.YAMLError as error:
        raise ValueError(f"{value} is not YAML: {error}") from error
    benchmarks = loaded.get("benchmarks") if isinstance(loaded, dict) else loaded
    if not isinstance(benchmarks, list) or not benchmarks:
        raise ValueError(f"{value}: an eval suite is a non-empty list of benchmarks (or a `benchmarks:` list)")
    for i, benchmark in enumerate(benchmarks):
        try:
            Benchmark.model_validate(benchmark)
        except ValidationError as error:
            where = f"benchmark {i + 1}" + (f" ({benchmark['name']})" if isinstance(benchmark, dict)
                                            and "name" in benchmark else "")
            raise ValueError(f"{value}, {where}: " + "; ".join(
                validation_messages(error, lambda loc: ".".join(map(str, loc))))) from error
    return benchmarks


def suite_problems(benchmarks: list[Benchmark]) -> list[str]:
    """What makes a suite unusable as a whole: names used twice."""
    seen: set[str] = set()
    twice = sorted({b.name for b in benchmarks if b.name in seen or seen.add(b.name)})
    return [f"benchmark name {name!r} is used more than once" for name in twice]


def benchmark_rows(benchmark: Benchmark, rows, cfg) -> tuple[list, list[str]]:
    """(prompts, labels) of a benchmark's rows (a datasets.Dataset) in its format, checked as the stage's prompts
    are; rows without a final answer to compare with (a gsm8k answer without `####`, a math solution without
    `\\boxed{}`) are refused by file and row. `cfg`: the stage's (its input_key, label_key and template)."""
    # Imported here: the stage's config imports this module, and the data layer (datasets, pandera) is heavy.
    from stages import data
    from stages.answers import gsm8k_label, last_boxed
    from stages.errors import DataValidationError

    default_input, default_label = FORMAT_COLUMNS[benchmark.format]
    input_key = benchmark.input_key or default_input or cfg.input_key
    if benchmark.format == "prompts":
        label_key = benchmark.label_key or cfg.label_key
    elif benchmark.format == "math":
        label_key = benchmark.label_key or ("answer" if "answer" in rows.column_names else "solution")
    else:
        label_key = benchmark.label_key or default_label
    source = f"{benchmark.dataset} (benchmark {benchmark.name}, format {benchmark.format})"
    data.validate_prompts(rows, source, input_key, label_key, apply_chat_template=cfg.apply_chat_template)
    labels = [str(label) for label in rows[label_key]] if label_key else [""] * len(rows)
    if benchmark.format == "gsm8k" or (benchmark.format == "math" and label_key == "solution"):
        extract, what = ((gsm8k_label, "a final answer after ####") if benchmark.format == "gsm8k"
                         else (last_boxed, "a \\boxed{} final answer"))
        labels = [extract(label) for label in labels]
        missing = [row for row, label in enumerate(labels) if label is None]
        if missing:
            raise DataValidationError(
                f"{source}: column {label_key!r} has no {what} at rows {missing[:20]}"
                f"{f' and {len(missing) - 20} more' if len(missing) > 20 else ''}")
    prompts = rows[input_key]
    if benchmark.format == "preference_prompts":
        # A whole conversation (chosen, where preference data has no prompt column) is prompted up to its answer.
        prompts = [p[:-1] if isinstance(p, list) and p and isinstance(p[-1], dict)
                   and p[-1].get("role") == "assistant" else p for p in prompts]
        # Each distinct prompt once: preference data repeats a prompt per pair.
        first: dict[str, int] = {}
        for row, prompt in enumerate(prompts):
            first.setdefault(json.dumps(prompt, sort_keys=True), row)
        prompts, labels = [prompts[row] for row in first.values()], [labels[row] for row in first.values()]
    return prompts, labels
