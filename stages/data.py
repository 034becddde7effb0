"""Datasets for every stage: loading, pandera validation, prompt formatting and tokenised examples.

Loading goes through `datasets` (hub names, local .json/.jsonl/.parquet files or directories, file://, s3://); a
hub name pinned to a revision (`org/name#<sha>`, as the plan pins them) reads that revision. An outage (hub 5xx,
S3 timeouts or 503s, a cut connection) is retried for RLHF_ARTIFACT_RETRY_S and then fails the stage with exit 1,
which the orchestration retries; data that cannot be read for any other reason is a data error (exit 2).
Validation runs before any training and reports every failure at once, naming file, flag, check and rows (or the
whole column); it never ends in a traceback, whatever the data (bytes that are not UTF-8 included). A pass is
recorded under the datasets cache (`$HF_DATASETS_CACHE/rlhf-validated`), named by the rows' fingerprint, the
schema's settings and this module's source, so that a retried stage or a night whose data did not change does not
check the same rows again (README: Data at scale); a failure is never recorded.

Formats (column names come from the stages' --*_key flags), as OpenRLHF reads them:
- SFT: prompt + response (text, or chat messages with --apply_chat_template), optionally a system prompt column
  (OpenOrca's system_prompt); whole conversations with --multiturn; raw text with --pretrain_mode;
- preferences (reward model, DPO, KTO): prompt + chosen + rejected, or no prompt column and chosen/rejected as
  whole conversations (the prompt is their shared prefix, the response the final assistant turn);
- prompts (RL, evaluation): text or chat messages (prompt-collection's context_messages), optional labels;
- KTO: unpaired prompt + completion + bool label (TRL's layout).

Example builders turn rows into token ids with a loss mask over the trained tokens: responses and their eos,
every assistant turn of a conversation, or everything in pretrain mode. Chat-templated text is split at turn
boundaries of the rendered conversation, so the template's own end-of-turn tokens are trained with each reply.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pandas as pd
import pandera
import pandera.pandas as pa
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.download import DownloadConfig
from datasets.fingerprint import Hasher
from pandera.errors import SchemaErrors

from infra.artifacts import StoreSettings, StoreUnreachable, retrying, storage_options_from_env
from stages.environment import stage_environment
from stages.errors import DataValidationError, SourceUnavailable
from stages.fingerprint import mixture_parts, split_revision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# "data/train.jsonl@test" or "org/name@validation[:100]": a split name, optionally sliced, after the last "@".
_SPLIT_SUFFIX = re.compile(r"^(?P<path>.+)@(?P<split>\w[\w.-]*(\[[^\]]*\])?)$")
_MAX_LISTED_ROWS = 50
VALIDATION_CHUNK_ROWS = 20_000
VALIDATED_FORMAT = 1  # of the records of passed validations: another value never reads an older record


# ---------------------------------------------------------------------------------------------------- loading


def split_source(source: str, split: str = "train") -> tuple[str, str]:
    """`"path@split"` -> ("path", "split"); a source without a suffix keeps `split`."""
    match = _SPLIT_SUFFIX.match(source)
    return (match["path"], match["split"]) if match else (source, split)


def load_rows(
    source: str | os.PathLike, *, split: str = "train", max_samples: int | None = None, subset: str | None = None
) -> datasets.Dataset:
    """Rows of one split of `source`: a hub name, a local .json/.jsonl/.parquet file or directory, a file:// or
    s3:// URI (credentials and endpoint from the AWS_* environment). `source@split` overrides `split`; `subset`
    names a hub dataset's configuration (openai/gsm8k's `main`).

    A single file is the requested split; a directory maps files to splits by name (train.jsonl, test.jsonl, ...)
    like the hub does. Keeps the first `max_samples` rows. Unreadable or missing data raises DataValidationError.
    """
    source = os.fspath(source)
    path, split = split_source(source, split)
    path = path.removeprefix("file://")

    def read() -> datasets.Dataset:
        if path.startswith("s3://"):
            return _load_files(path, split)
        if _is_local_path(path):
            local = str(Path(path).expanduser())
            if not Path(local).exists():
                raise DataValidationError(f"{source}: no such file or directory")
            return _load_files(local, split)
        name, revision = split_revision(path)
        return datasets.load_dataset(name, subset, split=split, revision=revision)

    try:
        rows = retrying(f"reading {source}", read, StoreSettings().artifact_retry_s, logger.warning)
    except DataValidationError:
        raise
    except StoreUnreachable as exc:
        raise SourceUnavailable(f"{source}: cannot read split {split!r}: {exc}") from exc
    except Exception as exc:  # datasets, fsspec and arrow raise many types; all mean "cannot read this"
        raise DataValidationError(f"{source}: cannot read split {split!r}: {type(exc).__name__}: {exc}") from exc
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows))))
    return rows


def load_mixture(
    source: str, *, split: str = "train", max_samples: int | None = None, probabilities: list[float] | None = None,
    seed: int = 42, validate: Callable[[datasets.Dataset, str], None] | None = None,
) -> datasets.Dataset:
    """OpenRLHF's dataset mixtures: `source` is one dataset or a comma-separated list, each part read as load_rows
    reads one (its first `max_samples` rows) and checked by `validate(rows, part)`. Parts are concatenated in order,
    or with `probabilities` (--dataset_probs) interleaved, seeded, until every part is exhausted; the mixture keeps
    its first `max_samples` rows."""
    parts = mixture_parts(source)
    tables = []
    for part in parts:
        rows = load_rows(part, split=split, max_samples=max_samples)
        if validate is not None:
            validate(rows, part)
        tables.append(rows)
    if len(tables) == 1:
        return tables[0]
    columns = "; ".join(f"{part}: {', '.join(rows.column_names)}" for part, rows in zip(parts, tables))
    if len({tuple(sorted(rows.column_names)) for rows in tables}) > 1:  # datasets would fill the gaps with None
        raise DataValidationError(f"{source}: the datasets of this mixture do not share their columns ({columns})")
    try:
        mixed = (datasets.interleave_datasets(tables, probabilities=probabilities, seed=seed,
                                              stopping_strategy="all_exhausted")
                 if probabilities else datasets.concatenate_datasets(tables))
    except ValueError as error:
        raise DataValidationError(f"{source}: the datasets of this mixture do not share their column types "
                                  f"({columns}): {error}") from error
    return mixed.select(range(min(max_samples, len(mixed)))) if max_samples is not None else mixed


def _is_local_path(path: str) -> bool:
    return (
        Path(path).expanduser().exists()
        or path.startswith(("/", "./", "../", "~"))
        or Path(path).suffix in FILE_BUILDERS
    )


def _load_files(path: str, split: str) -> datasets.Dataset:
    suffix = Path(path).suffix
    if not path.startswith("s3://") and Path(path).is_file() and suffix not in FILE_BUILDERS:
        expected = ", ".join(FILE_BUILDERS)
        raise DataValidationError(f"{path}: unsupported file type {suffix!r}; expected one of {expected}")
    if suffix in FILE_BUILDERS:
        split_name = re.sub(r"\[.*$", "", split)
        builder, data_files = FILE_BUILDERS[suffix], {split_name: path}
    else:
        builder, data_files = _directory_files(path, DownloadConfig(storage_options=storage_options_from_env(path)))
    # A fresh options dict: datasets mutates the one it is given.
    return datasets.load_dataset(
        builder, data_files=data_files, split=split, storage_options=storage_options_from_env(path)
    )


def _directory_files(path: str, download_config: DownloadConfig) -> tuple[str, dict[str, list[str]]]:
    patterns = get_data_patterns(path, download_config)
    files = DataFilesDict.from_patterns(
        patterns, base_path=path, allowed_extensions=list(FILE_BUILDERS), download_config=download_config
    )
    builders = {FILE_BUILDERS[Path(f).suffix] for split_files in files.values() for f in split_files}
    if len(builders) != 1:
        raise DataValidationError(
            f"{path}: a data directory needs files of one format (.json/.jsonl or .parquet); found {sorted(builders)}"
        )
    return builders.pop(), {str(split): list(split_files) for split, split_files in files.items()}


# ------------------------------------------------------------------------------------------------- validation


class _Undecodable:
    """Stand-in for a value whose bytes are not valid UTF-8, so that validation can name its row."""

    def __repr__(self) -> str:
        return "<not UTF-8>"


UNDECODABLE = _Undecodable()


def _as_messages(value: Any) -> list[dict] | None:
    """A chat-format value ([{"role", "content"}, ...], as a list or an arrow-decoded array) or None."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _decodable(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    # An undecodable value is reported once, by the valid_utf8 check, not again by every other check.
    return lambda value: value is UNDECODABLE or check(value)


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or _as_messages(value) is not None


def _is_not_blank(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    messages = _as_messages(value)
    # Other types pass here: the type check reports them once.
    return messages is None or all(m["content"].strip() for m in messages)


def _is_conversation(value: Any) -> bool:
    return _as_messages(value) is not None


def _has_assistant_turn(value: Any) -> bool:
    messages = _as_messages(value)
    return messages is None or any(m["role"] == "assistant" for m in messages)


def _ends_with_assistant_turn(value: Any) -> bool:
    messages = _as_messages(value)
    return messages is None or messages[-1]["role"] == "assistant"


def _is_plain_text(value: Any) -> bool:
    return _as_messages(value) is None


def _is_label(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _is_bool_label(value: Any) -> bool:
    return isinstance(value, bool) or (isinstance(value, int) and value in (0, 1))


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and np.isfinite(value)


def _is_optional_text(value: Any) -> bool:
    return value is None or isinstance(value, str)


def _comparable(value: Any) -> str:
    messages = _as_messages(value)
    return json.dumps(messages) if messages is not None else str(value).strip()


def _conversation_prompt(value: Any) -> str:
    """The messages before the final turn of a conversation, as comparable text ("" for plain text)."""
    messages = _as_messages(value)
    return json.dumps(messages[:-1]) if messages is not None else ""


_CHECK_MEANINGS = {
    "column_in_dataframe": "column is missing",
    "not_nullable": "null value",
    "valid_utf8": "text is not valid UTF-8",
    "text_or_messages": "not text: expected a string or a list of {role, content} messages",
    "not_blank": "empty or whitespace-only text",
    "conversation": "not a conversation: expected a list of {role, content} messages",
    "has_assistant_turn": "no assistant message to train on",
    "ends_with_assistant_turn": "the conversation does not end with the assistant's response",
    "plain_text": "chat messages need --apply_chat_template",
    "label_is_scalar": "label must be a string or a number",
    "label_is_bool": "label must be true/false (or 1/0): is the response desirable",
    "margin_is_number": "margin must be a finite number",
    "text_or_null": "system prompt must be text or null",
    "chosen_differs_from_rejected": "chosen response equals rejected response",
    "same_prompt_in_chosen_and_rejected": "chosen and rejected conversations differ before their final turn",
}
# Checks over whole rows (several columns): reported once under their own name, not per column.
_TABLE_CHECKS = {"chosen_differs_from_rejected", "same_prompt_in_chosen_and_rejected"}


def _column(*checks: tuple[Callable[[Any], bool], str], nullable: bool = False) -> pa.Column:
    """A column whose values must be valid UTF-8 and pass each element-wise (check, name)."""
    return pa.Column(
        nullable=nullable,
        checks=[pa.Check(lambda value: value is not UNDECODABLE, element_wise=True, name="valid_utf8")]
        + [pa.Check(_decodable(check), element_wise=True, name=name) for check, name in checks],
    )


def _text_column(apply_chat_template: bool | None = None) -> pa.Column:
    """Text or chat messages; with apply_chat_template=False chat messages are refused (None: not checked)."""
    checks = [(_is_text, "text_or_messages"), (_is_not_blank, "not_blank")]
    if apply_chat_template is False:
        checks.append((_is_plain_text, "plain_text"))
    return _column(*checks)


def _conversation_column(*extra: tuple[Callable[[Any], bool], str]) -> pa.Column:
    return _column((_is_conversation, "conversation"), (_is_not_blank, "not_blank"), *extra)


def sft_schema(input_key: str, output_key: str, *, multiturn: bool = False, pretrain_mode: bool = False,
               system_key: str | None = None, apply_chat_template: bool | None = None) -> pa.DataFrameSchema:
    """Prompt + response columns; one conversation column with multiturn; one text column in pretrain mode."""
    if multiturn:
        columns = {input_key: _conversation_column((_has_assistant_turn, "has_assistant_turn"))}
    elif pretrain_mode:
        columns = {input_key: _text_column(apply_chat_template)}
    else:
        columns = {input_key: _text_column(apply_chat_template), output_key: _text_column(apply_chat_template)}
    if system_key is not None:
        columns[system_key] = _column((_is_optional_text, "text_or_null"), nullable=True)
    return pa.DataFrameSchema(columns, name="sft")


def preference_schema(prompt_key: str | None, chosen_key: str, rejected_key: str, *,
                      margin_key: str | None = None, apply_chat_template: bool | None = None) -> pa.DataFrameSchema:
    """Prompt + chosen + rejected; without a prompt column chosen and rejected are whole texts or conversations
    that share every message but the final assistant turn."""

    def present(df: pd.DataFrame) -> bool:
        return chosen_key in df and rejected_key in df  # missing columns are reported as such instead

    def chosen_differs(df: pd.DataFrame) -> pd.Series:
        if not present(df):
            return pd.Series(True, index=df.index)
        return df[chosen_key].map(_comparable) != df[rejected_key].map(_comparable)

    def same_prompt(df: pd.DataFrame) -> pd.Series:
        if not present(df):
            return pd.Series(True, index=df.index)
        return df[chosen_key].map(_conversation_prompt) == df[rejected_key].map(_conversation_prompt)

    response = _text_column(apply_chat_template)
    checks = [pa.Check(chosen_differs, name="chosen_differs_from_rejected")]
    columns = {}
    if prompt_key is None:
        extra = [(_ends_with_assistant_turn, "ends_with_assistant_turn")]
        if apply_chat_template is False:
            extra.append((_is_plain_text, "plain_text"))
        response = _column((_is_text, "text_or_messages"), (_is_not_blank, "not_blank"), *extra)
        checks.append(pa.Check(same_prompt, name="same_prompt_in_chosen_and_rejected"))
    else:
        columns[prompt_key] = _text_column(apply_chat_template)
    columns |= {chosen_key: response, rejected_key: response}
    if margin_key is not None:
        columns[margin_key] = _column((_is_finite_number, "margin_is_number"))
    return pa.DataFrameSchema(columns, checks=checks, name="preference")


def prompt_schema(input_key: str, label_key: str | None = None, *,
                  apply_chat_template: bool | None = None) -> pa.DataFrameSchema:
    columns = {input_key: _text_column(apply_chat_template)}
    if label_key is not None:
        columns[label_key] = _column((_is_label, "label_is_scalar"), (_is_not_blank, "not_blank"))
    return pa.DataFrameSchema(columns, name="prompts")


def kto_schema(input_key: str, output_key: str, label_key: str, *,
               apply_chat_template: bool | None = None) -> pa.DataFrameSchema:
    return pa.DataFrameSchema(
        {input_key: _text_column(apply_chat_template), output_key: _text_column(apply_chat_template),
         label_key: _column((_is_bool_label, "label_is_bool"))},
        name="kto",
    )


def validate_sft(ds: datasets.Dataset, source: str, input_key: str, output_key: str, *, multiturn: bool = False,
                 pretrain_mode: bool = False, system_key: str | None = None,
                 apply_chat_template: bool | None = None) -> None:
    """Raise one DataValidationError listing every failed check and row of SFT data."""
    flags = {input_key: "--input_key"}
    if not (multiturn or pretrain_mode):
        flags[output_key] = "--output_key"
    if system_key is not None:
        flags[system_key] = "--system_key"
    settings = dict(input_key=input_key, output_key=output_key, multiturn=multiturn, pretrain_mode=pretrain_mode,
                    system_key=system_key, apply_chat_template=apply_chat_template)
    _validate("SFT", sft_schema(**settings), ds, source, flags, settings)


def validate_preference(ds: datasets.Dataset, source: str, prompt_key: str | None, chosen_key: str,
                        rejected_key: str, *, margin_key: str | None = None,
                        apply_chat_template: bool | None = None) -> None:
    """Raise one DataValidationError listing every failed check and row of preference data."""
    flags = {chosen_key: "--chosen_key", rejected_key: "--rejected_key"}
    if prompt_key is not None:
        flags = {prompt_key: "--prompt_key", **flags}
    if margin_key is not None:
        flags[margin_key] = "--margin_loss"
    settings = dict(prompt_key=prompt_key, chosen_key=chosen_key, rejected_key=rejected_key, margin_key=margin_key,
                    apply_chat_template=apply_chat_template)
    _validate("preference", preference_schema(**settings), ds, source, flags, settings)


def validate_prompts(ds: datasets.Dataset, source: str, input_key: str, label_key: str | None = None, *,
                     apply_chat_template: bool | None = None) -> None:
    """Raise one DataValidationError listing every failed check and row of RL prompt data.

    Prompts are text or chat messages (e.g. OpenRLHF/prompt-collection-v0.1's context_messages); with
    apply_chat_template=False chat messages are refused, since only a chat template can render them.
    """
    flags = {input_key: "--input_key"}
    if label_key is not None:
        flags[label_key] = "--label_key"
    settings = dict(input_key=input_key, label_key=label_key, apply_chat_template=apply_chat_template)
    _validate("prompt", prompt_schema(**settings), ds, source, flags, settings)


def validate_sources(cfg, validate: Callable[[datasets.Dataset, str], None]) -> None:
    """Load and validate --dataset and --eval_dataset in a stage's driver, so bad data fails before any rank trains."""
    for source, split in ((cfg.dataset, cfg.dataset_split), (cfg.eval_dataset, cfg.eval_split)):
        if source is not None:
            for part in mixture_parts(source):
                validate(load_rows(part, split=split, max_samples=cfg.max_samples), part)


def validate_prompt_rows(cfg, rows: datasets.Dataset, source: str) -> None:
    """`validate_prompts` with the columns and template of an RL or evaluation config."""
    validate_prompts(rows, source, cfg.input_key, cfg.label_key, apply_chat_template=cfg.apply_chat_template)


def validate_kto(ds: datasets.Dataset, source: str, input_key: str, output_key: str, label_key: str, *,
                 apply_chat_template: bool | None = None) -> None:
    """Raise one DataValidationError listing every failed check and row of unpaired KTO data."""
    flags = {input_key: "--input_key", output_key: "--output_key", label_key: "--label_key"}
    settings = dict(input_key=input_key, output_key=output_key, label_key=label_key,
                    apply_chat_template=apply_chat_template)
    _validate("KTO", kto_schema(**settings), ds, source, flags, settings)


def _validate(kind: str, schema: pa.DataFrameSchema, ds: datasets.Dataset, source: str, flags: dict[str, str],
              settings: dict[str, Any] | None = None) -> None:
    """Validates `ds` in chunks of VALIDATION_CHUNK_ROWS rows (as Python objects, a chunk costs several times its
    bytes) and reports the failures of all chunks at once, by row of the whole dataset; rows that passed against the
    same `settings` (the schema's arguments) before are not checked again (`validation_record`; without `settings`,
    always checked)."""
    if len(ds) == 0:
        raise DataValidationError(f"{kind} data in {source} has no rows")
    # Rows read from files (every stage's: datasets keeps them in Arrow files); rows built in memory are checked
    # each time.
    record = validation_record(kind, settings, ds) if ds.cache_files and settings is not None else None
    if record is not None and record.exists():
        os.utime(record)  # used now: kept for another RLHF_EXAMPLE_CACHE_DAYS
        return
    columns = [column for column in schema.columns if column in ds.column_names]
    failures = []
    try:
        for start in range(0, len(ds), VALIDATION_CHUNK_ROWS):
            rows = range(start, min(start + VALIDATION_CHUNK_ROWS, len(ds)))
            try:
                schema.validate(_python_frame(ds.select(rows), columns, rows), lazy=True)
            except SchemaErrors as errors:
                failures.append(errors.failure_cases)
                if errors.failure_cases["index"].isna().any():
                    break  # a missing column or a table-wide failure: every chunk would repeat it
    except Exception as error:  # validation must end in a report, never in a traceback that looks retryable
        raise DataValidationError(
            f"{kind} data in {source} could not be validated: {type(error).__name__}: {error}"
        ) from error
    if failures:
        raise DataValidationError(
            _failure_report(kind, source, len(ds), pd.concat(failures, ignore_index=True), flags, ds.column_names))
    if record is not None:
        _record_pass(record, {"kind": kind, "source": source, "rows": len(ds)})


def validation_record(kind: str, settings: dict[str, Any], ds: datasets.Dataset) -> Path:
    """Where a pass of `ds` against the schema `kind` built with `settings` is recorded. datasets' fingerprint of
    the rows stands for their content: the files' paths and modification times (S3: ETags), or a hub revision, and
    every selection, mixture and cut made since; this module's source and pandera's version stand for the checks'
    code."""
    code = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()
    key = Hasher.hash([VALIDATED_FORMAT, kind, settings, ds._fingerprint, code, pandera.__version__])
    return Path(datasets.config.HF_DATASETS_CACHE) / "rlhf-validated" / f"{key}.json"


def _record_pass(record: Path, what: dict[str, Any]) -> None:
    """Written whole or not at all (a temporary file renamed), so that a killed stage leaves no half record."""
    record.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=record.parent, suffix=".tmp", delete=False) as out:
        json.dump(what, out)
    os.replace(out.name, record)
    remove_unused(record.parent, "*.json", stage_environment().example_cache_days * 86_400)


def remove_unused(directory: Path, pattern: str, older_than_s: float) -> None:
    """Remove the files of `directory` matching `pattern` not used for `older_than_s` seconds (a reader that has one
    open keeps its data)."""
    cutoff = time.time() - older_than_s
    for path in directory.glob(pattern):
        try:
            if path.stat().st_mtime < cutoff:
                path.unlink()
        except FileNotFoundError:  # removed by another stage meanwhile
            pass


def _python_frame(ds: datasets.Dataset, columns: list[str], index: range) -> pd.DataFrame:
    """The columns as Python objects (str, list of dicts, bool, ...), indexed by row of the whole dataset;
    undecodable values become UNDECODABLE."""
    if not columns:
        return pd.DataFrame(index=index)
    return pd.DataFrame({name: pd.Series(_column_values(ds.select_columns([name]), name), dtype=object, index=index)
                         for name in columns})


def _column_values(column: datasets.Dataset, name: str) -> list[Any]:
    try:
        return column[:][name]
    except UnicodeDecodeError:
        # The JSON reader keeps invalid UTF-8 bytes in string columns; only decoding a value fails.
        values = []
        for index in range(len(column)):
            try:
                values.append(column[index][name])
            except UnicodeDecodeError:
                values.append(UNDECODABLE)
        return values


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and np.isnan(value))


def _failure_report(
    kind: str, source: str, num_rows: int, cases: pd.DataFrame, flags: dict[str, str], columns: Sequence[str]
) -> str:
    # Group pandera's one-row-per-failure table into one line per (column, check). Failures without a row index
    # are about a whole column (a column-level check, or a check that could not run).
    grouped: dict[tuple[str | None, str], list[tuple[Any, Any]]] = {}
    for case in cases.to_dict("records"):
        check = str(case["check"])
        column = None if _is_missing(case["column"]) else str(case["column"])
        if check == "column_in_dataframe":
            column = str(case["failure_case"])
        elif check in _TABLE_CHECKS:
            column = None
        grouped.setdefault((column, check), []).append((case["index"], case["failure_case"]))

    def order(key: tuple[str | None, str]) -> tuple[int, int, str]:
        column, check = key
        position = list(flags).index(column) if column in flags else len(flags)
        return (check != "column_in_dataframe", position, check)

    lines = []
    for column, check in sorted(grouped, key=order):
        where = f"column {column!r} ({flags[column]}): " if column in flags else (
            f"column {column!r}: " if column is not None else "")
        meaning = _CHECK_MEANINGS.get(check, check)
        if check == "column_in_dataframe":
            lines.append(f"  - {where}{meaning}; columns present: {', '.join(columns) or 'none'}")
            continue
        failures = grouped[(column, check)]
        rows = sorted({int(index) for index, _ in failures if not _is_missing(index)})
        if rows:
            listed = ", ".join(map(str, rows[:_MAX_LISTED_ROWS]))
            more = f" and {len(rows) - _MAX_LISTED_ROWS} more" if len(rows) > _MAX_LISTED_ROWS else ""
            line = f"  - {where}check {check} failed ({meaning}) at rows [{listed}]{more}"
            if check == "text_or_messages":
                examples = ", ".join(_short_repr(value) for index, value in failures[:3] if not _is_missing(index))
                line += f"; values: {examples}"
        else:
            # pandera gives the reason (or the error of a check that could not run) as the failure case.
            reason = _shorten(str(failures[0][1]), 200)
            whole = "the whole column" if column is not None else "the whole table"
            line = f"  - {where}check {check} failed ({meaning}) on {whole}: {reason}"
        lines.append(line)
    header = (
        f"{kind} data in {source} ({num_rows} rows) failed {len(lines)} validation check(s); "
        "row numbers are 0-based row indices in the file:"
    )
    return "\n".join([header, *lines])


def _short_repr(value: Any, limit: int = 40) -> str:
    return _shorten(repr(value), limit)


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -------------------------------------------------------------------------------------------------- rendering


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool = False) -> str:
    if not tokenizer.chat_template:
        raise DataValidationError(
            f"--apply_chat_template is set but tokenizer {tokenizer.name_or_path!r} has no chat template"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _messages(value: Any, role: str, what: str) -> list[dict]:
    """A chat value as messages: text becomes one message of `role`."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    messages = _as_messages(value)
    if messages is None:
        raise DataValidationError(f"{what} is neither text nor a list of {{role, content}} messages: "
                                  f"{_short_repr(value)}")
    return messages


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict],
    apply_chat_template: bool,
    input_template: str | None = None,
) -> str:
    """Prompt text the model sees.

    With `apply_chat_template`, a string becomes one user message and chat lists (system turns included) are used
    as given, rendered with the tokenizer's template and the generation prompt. Otherwise a string is used as is,
    or through `input_template` (e.g. "User: {}\\nAssistant: ").
    """
    if apply_chat_template:
        return _render(tokenizer, _messages(prompt, "user", "prompt"), add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise DataValidationError("a chat-format prompt (list of messages) needs --apply_chat_template")
    return input_template.format(prompt) if input_template else prompt


def _prompt_messages(prompt: Any, system: str | None) -> list[dict]:
    messages = _messages(prompt, "user", "prompt")
    return ([{"role": "system", "content": system}] if system else []) + messages


def _conversation_segments(tokenizer: PreTrainedTokenizerBase, messages: list[dict],
                           train_from: int = 0) -> list[tuple[str, bool]]:
    """The rendered conversation as consecutive (text, trained) pieces: every assistant message at index >=
    `train_from` (its content and end-of-turn markup) is trained, everything else (other turns, the template's
    headers and generation prompts) is context. Needs a template that renders a conversation's prefix as a
    prefix of the whole, as chat templates do.
    """
    full = _render(tokenizer, messages)
    pieces, cursor = [], 0
    for index in range(train_from, len(messages)):
        if messages[index]["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:index], add_generation_prompt=True) if index else ""
        through = full if index == len(messages) - 1 else _render(tokenizer, messages[: index + 1])
        if not (through.startswith(before) and full.startswith(through) and len(before) >= cursor):
            raise DataValidationError(
                f"the chat template of {tokenizer.name_or_path!r} renders turn {index} of a conversation "
                "differently depending on the turns after it, so the assistant tokens cannot be located; "
                "use a template that renders conversations incrementally"
            )
        pieces += [(full[cursor : len(before)], False), (full[len(before) : len(through)], True)]
        cursor = len(through)
    pieces.append((full[cursor:], False))
    return [(text, trained) for text, trained in pieces if text]


# -------------------------------------------------------------------------------------------------- examples


def token_ids(tokenizer: PreTrainedTokenizerBase, texts: list[str], *, special_tokens: bool,
              limits: list[int] | None = None) -> list[list[int]]:
    """Token ids of each text, as `tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]`; with `limits`,
    the first limits[i] of them (the whole encoding when it is shorter). A text that occurs several times is encoded
    once (a preference pair's prompt, for its chosen and its rejected side).

    A fast tokenizer's Rust batch encoder is called directly: the same ids without the per-text dicts (attention
    masks, ...) the wrapper builds, about a quarter of the encoding time. The wrapper runs when the backend is set
    to truncate, pad or split special tokens otherwise than the wrapper would (it resets that first)."""
    if not texts:
        return []
    limits = limits or [WHOLE] * len(texts)
    most: dict[str, int] = {}
    for text, limit in zip(texts, limits):
        most[text] = max(most.get(text, 0), limit)
    unique = list(most)
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens", False))):
        encoded = tokenizer(unique, add_special_tokens=special_tokens)["input_ids"]
    elif all(limit == WHOLE for limit in most.values()) or not _splits_words(backend):
        encoded = [encoding.ids for encoding in backend.encode_batch(unique, add_special_tokens=special_tokens)]
    else:
        encoded = _leading_ids(backend, unique, [most[text] for text in unique], special_tokens)
    by_text = dict(zip(unique, encoded))
    return [by_text[text][:limit] for text, limit in zip(texts, limits)]


WHOLE = 2**62  # a limit that keeps every token
CUT_FROM_SHARE = 0.75  # a text is cut only where that leaves out a quarter of it or more: else encoded whole
CUT_MARGIN = 1.25  # characters cut beyond the estimate of those the wanted tokens cover, as a share of it ...
CUT_SLACK_CHARS = 64  # ... plus these: the two words that do not count, and texts denser than the estimate
CALIBRATION_TEXTS = 8  # long texts encoded whole to measure the characters per token when no short one tells


def _leading_ids(backend, texts: list[str], limits: list[int], special_tokens: bool) -> list[list[int]]:
    """The first limits[i] token ids of each text (all when fewer), encoding a long text only as far as they need.

    A pre-tokenizer splits a text into words that the model encodes one at a time, and the words of a text cut at a
    word boundary are the whole text's words but for the last ones (cut or followed by other characters). So a cut
    text's tokens up to the one before its last two words are the whole text's, and the cut is kept where its wanted
    tokens all lie there; otherwise (too few characters, or a text that is one long word) the whole text is encoded.
    The cut is placed from the characters per token of the texts encoded whole (short ones, or a few long ones)."""
    encoded: list[list[int] | None] = [None] * len(texts)
    chars = tokens = 0

    def encode_whole(indices: list[int]) -> None:
        nonlocal chars, tokens
        for index, encoding in zip(indices, backend.encode_batch([texts[i] for i in indices],
                                                                 add_special_tokens=special_tokens)):
            ids = encoding.ids
            encoded[index] = ids[: limits[index]]
            chars, tokens = chars + len(texts[index]), tokens + len(ids)

    long = [i for i, (text, limit) in enumerate(zip(texts, limits)) if len(text) * CUT_FROM_SHARE > limit]
    short = sorted(set(range(len(texts))) - set(long))
    encode_whole(short)
    if tokens < 64 * CALIBRATION_TEXTS:
        encode_whole(long[:CALIBRATION_TEXTS])
        long = long[CALIBRATION_TEXTS:]
    chars_per_token = chars / max(tokens, 1)
    cuts = {i: _word_boundary(texts[i], int(limits[i] * chars_per_token * CUT_MARGIN) + CUT_SLACK_CHARS)
            for i in long}
    cut = [i for i in long if cuts[i] is not None and cuts[i] < len(texts[i]) * CUT_FROM_SHARE]
    whole = sorted(set(long) - set(cut))
    for index, encoding in zip(cut, backend.encode_batch([texts[i][: cuts[i]] for i in cut],
                                                         add_special_tokens=special_tokens)):
        limit, words = limits[index], encoding.word_ids
        last_word = next((word for word in reversed(words) if word is not None), None)  # words only grow
        if len(words) >= limit and words[limit - 1] is not None and words[limit - 1] <= last_word - 2:
            encoded[index] = encoding.ids[:limit]
        else:
            whole.append(index)
    encode_whole(whole)
    return encoded


_WORD_END = re.compile(r"(?<=\S)\s")


def _word_boundary(text: str, at: int) -> int | None:
    """The first position from `at` where whitespace follows a word (None within 256 characters: the text is not cut
    inside a long word, a run of spaces or a special token)."""
    found = _WORD_END.search(text, at, at + 256)
    return found.start() if found else None


def _splits_words(backend) -> bool:
    """Whether the tokenizer's pre-tokenizer splits text into words (Llama 3's, Qwen's, GPT-2's do; a tokenizer that
    encodes the whole text as one word cannot be cut, see `_leading_ids`)."""
    words = backend.encode("one two three four", add_special_tokens=False).word_ids
    return len({word for word in words if word is not None}) >= 4


def _encode_pieces(tokenizer: PreTrainedTokenizerBase, rows: list[list[tuple[str, bool]]], *,
                   special_tokens: bool, add_eos: bool = True,
                   max_len: int | None = None) -> list[tuple[list[int], list[int]]]:
    """Token ids and loss mask (1 = a target to predict) of each row's (text, trained) pieces.

    The first piece gets the tokenizer's special tokens (bos) when `special_tokens` (plain text; a rendered
    chat template already holds them). With `add_eos`, a row not ending in eos gets one, trained like the
    piece before it: the model learns to stop. With `max_len`, a row's first max_len tokens, all a caller that cuts
    there reads: the pieces past them are not encoded, and a long piece only as far as they need.
    """
    eos = tokenizer.eos_token_id  # read once: each read looks the token up in the vocabulary again
    if add_eos and eos is None:
        raise DataValidationError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end responses with")
    room = WHOLE if max_len is None else max_len
    encoded: list[tuple[list[int], list[int]]] = [([], []) for _ in rows]
    for position in range(max(map(len, rows), default=0)):
        todo = [row for row, pieces in enumerate(rows) if position < len(pieces) and len(encoded[row][0]) < room]
        texts = [rows[row][position][0] for row in todo]
        limits = None if max_len is None else [room - len(encoded[row][0]) for row in todo]
        pieces_ids = token_ids(tokenizer, texts, special_tokens=special_tokens and position == 0, limits=limits)
        for row, piece_ids in zip(todo, pieces_ids):
            ids, mask = encoded[row]
            ids += piece_ids
            mask += [int(rows[row][position][1])] * len(piece_ids)
    for ids, mask in encoded:
        if add_eos and len(ids) < room and (not ids or ids[-1] != eos):
            mask.append(mask[-1] if mask else 1)
            ids.append(eos)
    return encoded


def _prompt_response_pieces(
    tokenizer: PreTrainedTokenizerBase, prompt: Any, response: Any, *, apply_chat_template: bool,
    input_template: str | None, system: str | None = None,
) -> list[tuple[str, bool]]:
    """(prompt text, context) then the response: the chat template renders prompt + response messages and the
    assistant turns after the prompt are trained; plain text is the (templated) prompt then the response."""
    if apply_chat_template:
        prompt_messages = _prompt_messages(prompt, system)
        return _conversation_segments(tokenizer, prompt_messages + _messages(response, "assistant", "response"),
                                      train_from=len(prompt_messages))
    if not isinstance(response, str):
        raise DataValidationError("a chat-format response (list of messages) needs --apply_chat_template")
    return [(format_prompt(tokenizer, prompt, False, input_template), False), (response, True)]


def _split_prompt(ids: list[int], mask: list[int]) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) of an encoded prompt + response: the prompt ends where training starts."""
    start = mask.index(1) if 1 in mask else len(ids)
    return ids[:start], ids[start:]


def _fit(ids: list[int], mask: list[int], max_len: int) -> tuple[list[int], list[int]] | None:
    """The example cut to max_len, or None when no target is left (the first token is never one: nothing
    precedes it)."""
    ids, mask = ids[:max_len], mask[:max_len]
    return (ids, mask) if any(mask[1:]) else None


@dataclass
class Encoded:
    """Examples aligned with the rows they were built from: where row i leaves nothing to train on (its prompt fills
    max_len), `fits[i]` is False and `examples[i]` holds empty sequences. `kept()` drops those rows (logged, and
    an error when none is left), so that rows encoded in chunks are counted over the whole dataset."""

    examples: list[dict]
    fits: list[bool]
    kind: str  # "SFT", "preference", "KTO", "prompt": what the log calls the examples
    reason: str  # why a row does not fit, and what to change

    def kept(self) -> list[dict]:
        check_dropped(self.kind, [row for row, fits in enumerate(self.fits) if not fits], len(self.fits), self.reason)
        return [example for example, fits in zip(self.examples, self.fits) if fits]


def check_dropped(kind: str, dropped_rows: list[int], total: int, reason: str) -> None:
    if not dropped_rows:
        return
    if len(dropped_rows) == total:
        raise DataValidationError(f"all {total} {kind} examples were dropped: {reason}")
    shown = ", ".join(map(str, dropped_rows[:20])) + (" ..." if len(dropped_rows) > 20 else "")
    logger.warning("dropped %d of %d %s examples (%s): rows [%s]", len(dropped_rows), total, kind, reason, shown)


def encode_sft(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    output_key: str,
    apply_chat_template: bool,
    max_len: int,
    input_template: str | None = None,
    system_key: str | None = None,
    multiturn: bool = False,
    pretrain_mode: bool = False,
) -> Encoded:
    """[{"input_ids", "loss_mask"}], loss_mask[i] == 1 where input_ids[i] is a target (OpenRLHF's SFT modes):

    - prompt + response (+ eos): loss on the response, e.g. OpenOrca's question/response with its system prompt
      (`system_key`, rendered as a system message by the chat template);
    - `multiturn`: the conversation in `input_key` rendered with the chat template, loss on every assistant turn;
    - `pretrain_mode`: the text in `input_key` (+ eos), loss on every token.

    Sequences are cut to max_len; rows left without any trained token (the prompt fills max_len) do not fit.
    """
    if multiturn:
        pieces = [_conversation_segments(tokenizer, _messages(c, "user", "conversation")) for c in ds[input_key]]
    elif pretrain_mode:
        texts = [format_prompt(tokenizer, t, False, input_template) if isinstance(t, str) else
                 _render(tokenizer, _messages(t, "user", "text")) for t in ds[input_key]]
        pieces = [[(text, True)] for text in texts]
    else:
        systems = ds[system_key] if system_key is not None else [None] * len(ds)
        pieces = [
            _prompt_response_pieces(tokenizer, prompt, response, apply_chat_template=apply_chat_template,
                                    input_template=input_template, system=system)
            for prompt, response, system in zip(ds[input_key], ds[output_key], systems)
        ]
    fitted = [_fit(ids, mask, max_len) for ids, mask in _encode_pieces(
        tokenizer, pieces, special_tokens=not apply_chat_template, max_len=max_len)]
    return Encoded([{"input_ids": ids, "loss_mask": mask} for ids, mask in (f or ([], []) for f in fitted)],
                   [f is not None for f in fitted], "SFT", f"no response token fits in max_len={max_len}; raise --max_len")


def _split_conversations(prompt: Any, chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """(prompt, chosen response, rejected response) of a preference row. Without a prompt column (prompt None),
    conversations split into their shared prefix and final turn, and plain texts have an empty prompt."""
    if prompt is not None:
        return prompt, chosen, rejected
    if isinstance(chosen, str) and isinstance(rejected, str):
        return "", chosen, rejected
    chosen, rejected = _messages(chosen, "assistant", "chosen"), _messages(rejected, "assistant", "rejected")
    return chosen[:-1], chosen[-1:], rejected[-1:]


def encode_preferences(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str | None,
    chosen_key: str,
    rejected_key: str,
    apply_chat_template: bool,
    max_len: int,
    input_template: str | None = None,
    margin_key: str | None = None,
) -> Encoded:
    """[{"chosen_ids", "chosen_loss_mask", "rejected_ids", "rejected_loss_mask"(, "margin")}], each side built
    like an SFT example (loss mask on the response and eos)."""
    prompts = ds[prompt_key] if prompt_key is not None else [None] * len(ds)
    chosen_pieces, rejected_pieces = [], []
    for split in map(_split_conversations, prompts, ds[chosen_key], ds[rejected_key]):
        prompt, chosen, rejected = split
        for response, pieces in ((chosen, chosen_pieces), (rejected, rejected_pieces)):
            pieces.append(_prompt_response_pieces(tokenizer, prompt, response, apply_chat_template=apply_chat_template,
                                                  input_template=input_template))
    special = not apply_chat_template
    both = _encode_pieces(tokenizer, chosen_pieces + rejected_pieces, special_tokens=special, max_len=max_len)
    chosen, rejected = both[: len(chosen_pieces)], both[len(chosen_pieces) :]
    margins = ds[margin_key] if margin_key is not None else None
    examples, fits = [], []
    for row, (chosen_encoded, rejected_encoded) in enumerate(zip(chosen, rejected)):
        chosen_fit, rejected_fit = _fit(*chosen_encoded, max_len), _fit(*rejected_encoded, max_len)
        fits.append(chosen_fit is not None and rejected_fit is not None)
        (chosen_ids, chosen_mask), (rejected_ids, rejected_mask) = (chosen_fit, rejected_fit) if fits[-1] else (
            ([], []), ([], []))
        example = {"chosen_ids": chosen_ids, "chosen_loss_mask": chosen_mask,
                   "rejected_ids": rejected_ids, "rejected_loss_mask": rejected_mask}
        if margins is not None:
            example["margin"] = float(margins[row])
        examples.append(example)
    return Encoded(examples, fits, "preference", f"no response token fits in max_len={max_len}; raise --max_len")


def unpair_preferences(ds: datasets.Dataset, *, prompt_key: str | None, chosen_key: str,
                       rejected_key: str) -> datasets.Dataset:
    """Preference pairs as unpaired KTO rows (TRL's unpair_preference_dataset): each pair gives
    {"prompt", "completion": chosen, "label": True} and {"prompt", "completion": rejected, "label": False}.

    Without a prompt column, conversations are split into their shared prefix and final turn.
    """
    prompts = ds[prompt_key] if prompt_key is not None else [None] * len(ds)
    rows = []
    for prompt, chosen, rejected in map(_split_conversations, prompts, ds[chosen_key], ds[rejected_key]):
        rows += [{"prompt": prompt, "completion": chosen, "label": True},
                 {"prompt": prompt, "completion": rejected, "label": False}]
    return datasets.Dataset.from_list(rows)


def encode_kto(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    output_key: str,
    label_key: str,
    apply_chat_template: bool,
    max_len: int,
    input_template: str | None = None,
) -> Encoded:
    """[{"prompt_ids", "response_ids", "desirable"}]: unpaired prompt + completion (+ eos) with its bool label.

    Prompt and response stay apart because KTO's KL reference point scores each prompt with another sample's
    response. Responses are cut so that prompt + response fits max_len; rows without room do not fit.
    """
    pieces = [
        _prompt_response_pieces(tokenizer, prompt, response, apply_chat_template=apply_chat_template,
                                input_template=input_template)
        for prompt, response in zip(ds[input_key], ds[output_key])
    ]
    examples, fits = [], []
    encoded = _encode_pieces(tokenizer, pieces, special_tokens=not apply_chat_template, max_len=max_len)
    for (ids, mask), label in zip(encoded, ds[label_key]):
        prompt_ids, response_ids = _split_prompt(ids, mask)
        response_ids = response_ids[: max(max_len - len(prompt_ids), 0)]  # none when the prompt fills it
        fits.append(bool(response_ids))
        examples.append({"prompt_ids": prompt_ids if response_ids else [], "response_ids": response_ids,
                         "desirable": bool(label)})
    return Encoded(examples, fits, "KTO", f"the prompt fills max_len={max_len}; raise --max_len")


def encode_prompts(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    label_key: str | None,
    apply_chat_template: bool,
    prompt_max_len: int,
    input_template: str | None = None,
) -> Encoded:
    """[{"prompt", "prompt_ids", "label"}] for rollouts; label is "" without a label_key.

    Prompts are text or chat messages (OpenRLHF/prompt-collection-v0.1's context_messages, system turns
    included); messages need `apply_chat_template`, which renders them with the generation prompt. Prompts longer
    than prompt_max_len do not fit (dropped, counted and logged), and are not cut: a cut prompt is a different task.
    """
    texts = [format_prompt(tokenizer, p, apply_chat_template, input_template) for p in ds[input_key]]
    # A rendered chat template already holds its special tokens (bos); plain text gets the tokenizer's own.
    prompt_ids = token_ids(tokenizer, texts, special_tokens=not apply_chat_template)
    labels = [str(label) for label in ds[label_key]] if label_key is not None else [""] * len(texts)
    examples, fits = [], []
    for text, ids, label in zip(texts, prompt_ids, labels):
        fits.append(len(ids) <= prompt_max_len)
        examples.append({"prompt": text, "prompt_ids": ids if fits[-1] else [], "label": label})
    return Encoded(examples, fits, "prompt", f"longer than prompt_max_len={prompt_max_len} tokens")


# The config fields encode_prompt_rows reads (the RL and evaluation stages' prompt flags): with the rows and the
# tokenizer, they key the prepared prompts.
PROMPT_FIELDS = ("input_key", "label_key", "apply_chat_template", "prompt_max_len", "input_template")


def encode_prompt_rows(cfg, tokenizer, rows: datasets.Dataset) -> Encoded:
    return encode_prompts(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                          apply_chat_template=cfg.apply_chat_template, prompt_max_len=cfg.prompt_max_len,
                          input_template=cfg.input_template)


def prompt_and_response(prompt_ids: list[int], response_ids: list[int]) -> tuple[list[int], list[int]]:
    """Sequence and loss mask of a prompt followed by a response: 1 on the response tokens."""
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)
