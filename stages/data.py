"""Datasets for every stage: loading, pandera validation, prompt formatting and tokenised examples.

Loading goes through `datasets` (hub names, local .json/.jsonl/.parquet files or directories, file://, s3://).
Validation runs before any training and reports every bad row at once. Example builders turn rows into token ids
with a loss mask that covers only the response tokens and the final eos.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import datasets
import numpy as np
import pandas as pd
import pandera.pandas as pa
import torch
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.download import DownloadConfig
from pandera.errors import SchemaErrors

from infra.artifacts import storage_options_from_env

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
# "data/train.jsonl@test" or "org/name@validation[:100]": a split name, optionally sliced, after the last "@".
_SPLIT_SUFFIX = re.compile(r"^(?P<path>.+)@(?P<split>\w[\w.-]*(\[[^\]]*\])?)$")
_MAX_LISTED_ROWS = 50


class DataValidationError(ValueError):
    """Bad or unreadable data; the message names the file, every failed check and the row numbers."""


# ---------------------------------------------------------------------------------------------------- loading


def split_source(source: str, split: str = "train") -> tuple[str, str]:
    """`"path@split"` -> ("path", "split"); a source without a suffix keeps `split`."""
    match = _SPLIT_SUFFIX.match(source)
    return (match["path"], match["split"]) if match else (source, split)


def load_rows(
    source: str | os.PathLike, *, split: str = "train", max_samples: int | None = None
) -> datasets.Dataset:
    """Rows of one split of `source`: a hub name, a local .json/.jsonl/.parquet file or directory, a file:// or
    s3:// URI (credentials and endpoint from the AWS_* environment). `source@split` overrides `split`.

    A single file is the requested split; a directory maps files to splits by name (train.jsonl, test.jsonl, ...)
    like the hub does. Keeps the first `max_samples` rows. Unreadable or missing data raises DataValidationError.
    """
    source = os.fspath(source)
    path, split = split_source(source, split)
    path = path.removeprefix("file://")
    try:
        if path.startswith("s3://"):
            rows = _load_files(path, split)
        elif _is_local_path(path):
            path = str(Path(path).expanduser())
            if not Path(path).exists():
                raise DataValidationError(f"{source}: no such file or directory")
            rows = _load_files(path, split)
        else:
            rows = datasets.load_dataset(path, split=split)
    except DataValidationError:
        raise
    except Exception as exc:  # datasets, fsspec and arrow raise many types; all mean "cannot read this"
        raise DataValidationError(f"{source}: cannot read split {split!r}: {type(exc).__name__}: {exc}") from exc
    if max_samples is not None:
        rows = rows.select(range(min(max_samples, len(rows))))
    return rows


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


def _as_messages(value: Any) -> list[dict] | None:
    """A chat-format value ([{"role", "content"}, ...], as a list or an arrow-decoded array) or None."""
    if not isinstance(value, (list, tuple, np.ndarray)) or len(value) == 0:
        return None
    if not all(isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
               for m in value):
        return None
    return [{"role": m["role"], "content": m["content"]} for m in value]


def _is_text(value: Any) -> bool:
    return isinstance(value, str) or _as_messages(value) is not None


def _is_not_blank(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    messages = _as_messages(value)
    # Other types pass here: the type check reports them once.
    return messages is None or all(m["content"].strip() for m in messages)


def _is_label(value: Any) -> bool:
    return isinstance(value, (str, int, float)) and not isinstance(value, bool)


def _comparable(value: Any) -> str:
    messages = _as_messages(value)
    return json.dumps(messages) if messages is not None else str(value).strip()


_CHECK_MEANINGS = {
    "column_in_dataframe": "column is missing",
    "not_nullable": "null value",
    "text_or_messages": "not text: expected a string or a list of {role, content} messages",
    "not_blank": "empty or whitespace-only text",
    "label_is_scalar": "label must be a string or a number",
    "chosen_differs_from_rejected": "chosen response equals rejected response",
}
_ROW_CHECKS = {"chosen_differs_from_rejected"}  # dataframe-wide checks: reported once, not per column


def _text_column() -> pa.Column:
    return pa.Column(
        nullable=False,
        checks=[
            pa.Check(_is_text, element_wise=True, name="text_or_messages"),
            pa.Check(_is_not_blank, element_wise=True, name="not_blank"),
        ],
    )


def sft_schema(input_key: str, output_key: str) -> pa.DataFrameSchema:
    return pa.DataFrameSchema({input_key: _text_column(), output_key: _text_column()}, name="sft")


def preference_schema(prompt_key: str, chosen_key: str, rejected_key: str) -> pa.DataFrameSchema:
    def chosen_differs(df: pd.DataFrame) -> pd.Series:
        if chosen_key not in df or rejected_key not in df:  # reported as missing columns instead
            return pd.Series(True, index=df.index)
        return df[chosen_key].map(_comparable) != df[rejected_key].map(_comparable)

    return pa.DataFrameSchema(
        {prompt_key: _text_column(), chosen_key: _text_column(), rejected_key: _text_column()},
        checks=[pa.Check(chosen_differs, name="chosen_differs_from_rejected")],
        name="preference",
    )


def prompt_schema(input_key: str, label_key: str | None = None) -> pa.DataFrameSchema:
    columns = {input_key: _text_column()}
    if label_key is not None:
        columns[label_key] = pa.Column(
            nullable=False,
            checks=[
                pa.Check(_is_label, element_wise=True, name="label_is_scalar"),
                pa.Check(_is_not_blank, element_wise=True, name="not_blank"),
            ],
        )
    return pa.DataFrameSchema(columns, name="prompts")


def validate_sft(ds: datasets.Dataset, source: str, input_key: str, output_key: str) -> None:
    """Raise one DataValidationError listing every failed check and row of SFT data."""
    _validate("SFT", sft_schema(input_key, output_key), ds, source,
              {input_key: "--input_key", output_key: "--output_key"})


def validate_preference(
    ds: datasets.Dataset, source: str, prompt_key: str, chosen_key: str, rejected_key: str
) -> None:
    """Raise one DataValidationError listing every failed check and row of preference data."""
    _validate("preference", preference_schema(prompt_key, chosen_key, rejected_key), ds, source,
              {prompt_key: "--prompt_key", chosen_key: "--chosen_key", rejected_key: "--rejected_key"})


def validate_prompts(ds: datasets.Dataset, source: str, input_key: str, label_key: str | None = None) -> None:
    """Raise one DataValidationError listing every failed check and row of RL prompt data."""
    flags = {input_key: "--input_key"}
    if label_key is not None:
        flags[label_key] = "--label_key"
    _validate("prompt", prompt_schema(input_key, label_key), ds, source, flags)


def _validate(
    kind: str, schema: pa.DataFrameSchema, ds: datasets.Dataset, source: str, flags: dict[str, str]
) -> None:
    if len(ds) == 0:
        raise DataValidationError(f"{kind} data in {source} has no rows")
    present = [column for column in schema.columns if column in ds.column_names]
    frame = ds.select_columns(present).to_pandas() if present else pd.DataFrame(index=range(len(ds)))
    try:
        schema.validate(frame, lazy=True)
    except SchemaErrors as errors:
        raise DataValidationError(
            _failure_report(kind, source, len(ds), errors.failure_cases, flags, ds.column_names)
        ) from None


def _failure_report(
    kind: str, source: str, num_rows: int, cases: pd.DataFrame, flags: dict[str, str], columns: Sequence[str]
) -> str:
    # Group pandera's one-row-per-failure table into one line per (column, check).
    grouped: dict[tuple[str | None, str], list[tuple[Any, Any]]] = {}
    for case in cases.to_dict("records"):
        check = str(case["check"])
        if check == "column_in_dataframe":
            key = (str(case["failure_case"]), check)
        elif check in _ROW_CHECKS:
            key = (None, check)
        else:
            key = (case["column"], check)
        grouped.setdefault(key, []).append((case["index"], case["failure_case"]))

    def order(key: tuple[str | None, str]) -> tuple[int, int, str]:
        column, check = key
        position = list(flags).index(column) if column in flags else len(flags)
        return (check != "column_in_dataframe", position, check)

    lines = []
    for column, check in sorted(grouped, key=order):
        where = f"column {column!r} ({flags[column]}): " if column in flags else ""
        meaning = _CHECK_MEANINGS.get(check, check)
        if check == "column_in_dataframe":
            lines.append(f"  - {where}{meaning}; columns present: {', '.join(columns) or 'none'}")
            continue
        failures = grouped[(column, check)]
        rows = sorted({int(index) for index, _ in failures})
        listed = ", ".join(map(str, rows[:_MAX_LISTED_ROWS]))
        more = f" and {len(rows) - _MAX_LISTED_ROWS} more" if len(rows) > _MAX_LISTED_ROWS else ""
        line = f"  - {where}check {check} failed ({meaning}) at rows [{listed}]{more}"
        if check == "text_or_messages":
            examples = ", ".join(_short_repr(value) for _, value in failures[:3])
            line += f"; values: {examples}"
        lines.append(line)
    header = (
        f"{kind} data in {source} ({num_rows} rows) failed {len(lines)} validation check(s); "
        "row numbers are 0-based row indices in the file:"
    )
    return "\n".join([header, *lines])


def _short_repr(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# -------------------------------------------------------------------------------------------------- examples


def format_prompt(
    tokenizer: PreTrainedTokenizerBase,
    prompt: str | list[dict],
    apply_chat_template: bool,
    input_template: str | None = None,
) -> str:
    """Prompt text the model sees.

    With `apply_chat_template`, a string becomes one user message and chat lists are used as given, rendered
    with the tokenizer's template and the generation prompt. Otherwise a string is used as is, or through
    `input_template` (e.g. "User: {}\\nAssistant: ").
    """
    if apply_chat_template:
        if not tokenizer.chat_template:
            raise ValueError(
                f"--apply_chat_template is set but tokenizer {tokenizer.name_or_path!r} has no chat template"
            )
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else _as_messages(prompt)
        if messages is None:
            raise ValueError(f"prompt is neither text nor a list of {{role, content}} messages: {_short_repr(prompt)}")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise ValueError("a chat-format prompt (list of messages) needs --apply_chat_template")
    return input_template.format(prompt) if input_template else prompt


def _response_text(value: str | list[dict]) -> str:
    """A response is text, or chat messages whose last one is the response."""
    if isinstance(value, str):
        return value
    messages = _as_messages(value)
    if messages is None:
        raise ValueError(f"response is neither text nor a list of {{role, content}} messages: {_short_repr(value)}")
    return messages[-1]["content"]


def _encode_prompts(
    tokenizer: PreTrainedTokenizerBase,
    prompts: list,
    apply_chat_template: bool,
    input_template: str | None,
) -> tuple[list[str], list[list[int]]]:
    texts = [format_prompt(tokenizer, p, apply_chat_template, input_template) for p in prompts]
    # A rendered chat template already holds its special tokens (bos); plain text gets the tokenizer's own.
    ids = tokenizer(texts, add_special_tokens=not apply_chat_template)["input_ids"] if texts else []
    return texts, ids


def _encode_responses(tokenizer: PreTrainedTokenizerBase, responses: list) -> list[list[int]]:
    if tokenizer.eos_token_id is None:
        raise ValueError(f"tokenizer {tokenizer.name_or_path!r} has no eos token to end responses with")
    texts = [_response_text(r) for r in responses]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    return [response + [tokenizer.eos_token_id] for response in ids]


def _prompt_and_response(prompt_ids: list[int], response_ids: list[int], max_len: int) -> tuple[list[int], list[int]]:
    """Sequence cut to max_len (the prompt is kept whole) and its loss mask: 1 on response tokens and eos.

    loss_mask[i] == 1 means input_ids[i] is a target the model should predict from the tokens before it.
    """
    response_ids = response_ids[: max_len - len(prompt_ids)]
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def _check_dropped(kind: str, dropped_rows: list[int], total: int, reason: str) -> None:
    if not dropped_rows:
        return
    if len(dropped_rows) == total:
        raise DataValidationError(f"all {total} {kind} examples were dropped: {reason}")
    shown = ", ".join(map(str, dropped_rows[:20])) + (" ..." if len(dropped_rows) > 20 else "")
    logger.warning("dropped %d of %d %s examples (%s): rows [%s]", len(dropped_rows), total, kind, reason, shown)


def build_sft_examples(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    output_key: str,
    apply_chat_template: bool,
    max_len: int,
    input_template: str | None = None,
) -> list[dict]:
    """[{"input_ids", "loss_mask"}]: prompt + response + eos, loss on response and eos only.

    Sequences are cut to max_len keeping the whole prompt; rows whose prompt leaves no room for any response
    token are dropped (counted and logged).
    """
    _, prompt_ids = _encode_prompts(tokenizer, list(ds[input_key]), apply_chat_template, input_template)
    response_ids = _encode_responses(tokenizer, list(ds[output_key]))
    examples, dropped = [], []
    for row, (prompt, response) in enumerate(zip(prompt_ids, response_ids)):
        if len(prompt) >= max_len:
            dropped.append(row)
            continue
        input_ids, loss_mask = _prompt_and_response(prompt, response, max_len)
        examples.append({"input_ids": input_ids, "loss_mask": loss_mask})
    _check_dropped("SFT", dropped, len(prompt_ids), f"the prompt fills max_len={max_len}; raise --max_len")
    return examples


def build_preference_examples(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str,
    chosen_key: str,
    rejected_key: str,
    apply_chat_template: bool,
    max_len: int,
    input_template: str | None = None,
) -> list[dict]:
    """[{"chosen_ids", "chosen_loss_mask", "rejected_ids", "rejected_loss_mask"}], built like SFT examples."""
    _, prompt_ids = _encode_prompts(tokenizer, list(ds[prompt_key]), apply_chat_template, input_template)
    chosen_ids = _encode_responses(tokenizer, list(ds[chosen_key]))
    rejected_ids = _encode_responses(tokenizer, list(ds[rejected_key]))
    examples, dropped = [], []
    for row, (prompt, chosen, rejected) in enumerate(zip(prompt_ids, chosen_ids, rejected_ids)):
        if len(prompt) >= max_len:
            dropped.append(row)
            continue
        chosen_seq, chosen_mask = _prompt_and_response(prompt, chosen, max_len)
        rejected_seq, rejected_mask = _prompt_and_response(prompt, rejected, max_len)
        examples.append({
            "chosen_ids": chosen_seq,
            "chosen_loss_mask": chosen_mask,
            "rejected_ids": rejected_seq,
            "rejected_loss_mask": rejected_mask,
        })
    _check_dropped("preference", dropped, len(prompt_ids), f"the prompt fills max_len={max_len}; raise --max_len")
    return examples


def build_prompt_examples(
    ds: datasets.Dataset,
    tokenizer: PreTrainedTokenizerBase,
    *,
    input_key: str,
    label_key: str | None,
    apply_chat_template: bool,
    prompt_max_len: int,
    input_template: str | None = None,
) -> list[dict]:
    """[{"prompt", "prompt_ids", "label"}] for rollouts; label is "" without a label_key.

    Prompts longer than prompt_max_len are dropped (counted and logged), not cut: a cut prompt is a different task.
    """
    texts, prompt_ids = _encode_prompts(tokenizer, list(ds[input_key]), apply_chat_template, input_template)
    labels = [str(label) for label in ds[label_key]] if label_key is not None else [""] * len(texts)
    examples, dropped = [], []
    for row, (text, ids, label) in enumerate(zip(texts, prompt_ids, labels)):
        if len(ids) > prompt_max_len:
            dropped.append(row)
            continue
        examples.append({"prompt": text, "prompt_ids": ids, "label": label})
    _check_dropped("prompt", dropped, len(texts), f"longer than prompt_max_len={prompt_max_len} tokens")
    return examples


def pad_sequences(seqs: list[list[int]], pad_token_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token sequences padded to the longest one."""
    return pad_batch(seqs, pad_token_id, side), pad_batch([[1] * len(seq) for seq in seqs], 0, side)


def preference_batch(examples: list[dict], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Chosen sequences first, then rejected ones, right-padded: (input_ids, attention_mask, loss_mask)."""
    sequences = [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
    loss_masks = [e["chosen_loss_mask"] for e in examples] + [e["rejected_loss_mask"] for e in examples]
    return (*pad_sequences(sequences, pad_token_id), pad_batch(loss_masks, 0))


def pad_batch(seqs: list[list[int]], pad_value: int, side: str = "right") -> torch.Tensor:
    """[B, longest] long tensor of `seqs` padded with `pad_value` on the right or left."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max((len(seq) for seq in seqs), default=0)
    batch = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if not seq:
            continue
        if side == "right":
            batch[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        else:
            batch[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
    return batch
