"""Dataset loading, pandera validation messages, prompt formatting and example builders."""

from __future__ import annotations

import copy
import json
import logging
import time
from pathlib import Path

import datasets
import pandas as pd
import pytest
import fsspec

from infra.artifacts import storage_options_from_env
from stages import data, sequences
from stages.data import DataValidationError
from stages.model_io import load_tokenizer
from stages.tiny import build_tiny_model

SFT_ROWS = [
    {"prompt": "What is 1 plus 2?", "response": "Answer: 3"},
    {"prompt": "Add 4 and 5.", "response": "Answer: 9"},
    {"prompt": "Sum 2 with 2.", "response": "Answer: 4"},
]


def dataset(rows: list[dict]) -> datasets.Dataset:
    return datasets.Dataset.from_list(rows)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(build_tiny_model(tmp_path_factory.mktemp("tiny_model"))))


# ---------------------------------------------------------------------------------------------------- loading


@pytest.mark.parametrize("suffix", [".jsonl", ".json", ".parquet"])
def test_load_rows_reads_each_file_format(tmp_path, suffix):
    path = tmp_path / f"sft{suffix}"
    if suffix == ".jsonl":
        write_jsonl(path, SFT_ROWS)
    elif suffix == ".json":
        path.write_text(json.dumps(SFT_ROWS))
    else:
        pd.DataFrame(SFT_ROWS).to_parquet(path)
    assert data.load_rows(str(path)).to_list() == SFT_ROWS
    assert data.load_rows(f"file://{path}", max_samples=2).to_list() == SFT_ROWS[:2]


def test_load_rows_selects_split_of_a_directory(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", SFT_ROWS[:2])
    write_jsonl(tmp_path / "test.jsonl", SFT_ROWS[2:])
    assert data.load_rows(str(tmp_path)).to_list() == SFT_ROWS[:2]
    assert data.load_rows(f"{tmp_path}@test").to_list() == SFT_ROWS[2:]
    assert data.load_rows(str(tmp_path), split="test").to_list() == SFT_ROWS[2:]
    with pytest.raises(DataValidationError, match="validation"):
        data.load_rows(f"{tmp_path}@validation")


def test_a_mixture_is_read_in_order_or_interleaved_by_its_probabilities(tmp_path):
    """OpenRLHF's --dataset a,b: concatenated; with --dataset_probs interleaved (seeded) until each part is used up;
    max_samples caps each part and the mixture."""
    first = write_jsonl(tmp_path / "a.jsonl", [{"prompt": f"a{i}", "response": "x"} for i in range(6)])
    second = write_jsonl(tmp_path / "b.jsonl", [{"prompt": f"b{i}", "response": "y"} for i in range(3)])
    source = f"{first}, {second}"
    assert [r["prompt"] for r in data.load_mixture(source)] == [*(f"a{i}" for i in range(6)), "b0", "b1", "b2"]
    assert [r["prompt"] for r in data.load_mixture(source, max_samples=4)] == ["a0", "a1", "a2", "a3"]
    mixed = [r["prompt"] for r in data.load_mixture(source, probabilities=[0.5, 0.5], seed=1)]
    assert set(mixed) == {*(f"a{i}" for i in range(6)), "b0", "b1", "b2"}  # every row, the shorter part repeated
    assert mixed[:4] != ["a0", "a1", "a2", "a3"] and mixed == [
        r["prompt"] for r in data.load_mixture(source, probabilities=[0.5, 0.5], seed=1)]
    assert [r for r in mixed if r.startswith("a")][:6] == [f"a{i}" for i in range(6)]  # each part keeps its order
    seen: list[str] = []
    data.load_mixture(source, validate=lambda rows, part: seen.append(part))
    assert seen == [str(first), str(second)]  # each part is checked on its own (its row numbers are its own)


def test_a_mixture_of_datasets_with_other_columns_is_refused_naming_them(tmp_path):
    first = write_jsonl(tmp_path / "a.jsonl", SFT_ROWS)
    other = write_jsonl(tmp_path / "b.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataValidationError, match=r"do not share their columns.*a.jsonl: prompt, response.*"
                                                   r"b.jsonl: question, answer"):
        data.load_mixture(f"{first},{other}")


def test_split_source_parses_suffix():
    assert data.split_source("org/name@validation[:100]") == ("org/name", "validation[:100]")
    assert data.split_source("s3://bucket/sft.jsonl") == ("s3://bucket/sft.jsonl", "train")


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("missing.jsonl", None, "no such file"),
        ("broken.jsonl", '{"prompt": "a", "response": \n', "cannot read"),
        ("broken.parquet", "not parquet at all", "cannot read"),
        ("notes.txt", "hello", "unsupported file type"),
    ],
)
def test_unreadable_file_names_it(tmp_path, name, content, expected):
    path = tmp_path / name
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataValidationError, match=expected) as err:
        data.load_rows(str(path))
    assert str(path) in str(err.value)


def test_load_rows_from_s3(tmp_path, s3_root):
    fs = fsspec.filesystem("s3", **storage_options_from_env(s3_root))
    pd.DataFrame(SFT_ROWS).to_parquet(tmp_path / "sft.parquet")
    fs.put(str(tmp_path / "sft.parquet"), f"{s3_root}/flat/sft.parquet")
    fs.put(str(write_jsonl(tmp_path / "train.jsonl", SFT_ROWS[:1])), f"{s3_root}/splits/train.jsonl")
    fs.put(str(write_jsonl(tmp_path / "test.jsonl", SFT_ROWS[1:])), f"{s3_root}/splits/test.jsonl")

    assert data.load_rows(f"{s3_root}/flat/sft.parquet").to_list() == SFT_ROWS
    # Two reads in a row: datasets mutates storage options, so each read needs its own.
    assert data.load_rows(f"{s3_root}/splits@test").to_list() == SFT_ROWS[1:]
    assert data.load_rows(f"{s3_root}/splits").to_list() == SFT_ROWS[:1]
    with pytest.raises(DataValidationError, match=f"{s3_root}/flat/missing.jsonl"):
        data.load_rows(f"{s3_root}/flat/missing.jsonl")


# ------------------------------------------------------------------------------------------------- validation


def validation_error(path: Path, rows: list[dict], kind: str, **keys) -> str:
    write_jsonl(path, rows)
    validate = {"sft": data.validate_sft, "preference": data.validate_preference, "prompt": data.validate_prompts}
    with pytest.raises(DataValidationError) as err:
        validate[kind](data.load_rows(str(path)), str(path), **keys)
    message = str(err.value)
    assert str(path) in message and "0-based row indices in the file" in message
    return message


SFT_KEYS = {"input_key": "prompt", "output_key": "response"}
PREF_KEYS = {"prompt_key": "prompt", "chosen_key": "chosen", "rejected_key": "rejected"}


def test_missing_column_names_column_and_flag(tmp_path):
    message = validation_error(tmp_path / "sft.jsonl", SFT_ROWS, "sft", input_key="prompt", output_key="answer")
    assert "column 'answer' (--output_key): column is missing; columns present: prompt, response" in message


@pytest.mark.parametrize(
    ("bad_rows", "check", "rows"),
    [
        ({1: {"response": ""}, 2: {"response": "  \n"}}, "column 'response' (--output_key): check not_blank", "[1, 2]"),
        ({0: {"prompt": 7}}, "column 'prompt' (--input_key): check text_or_messages", "[0]"),
        ({2: {"prompt": [{"role": "user"}]}}, "column 'prompt' (--input_key): check text_or_messages", "[2]"),
        ({1: {"response": None}}, "column 'response' (--output_key): check not_nullable", "[1]"),
    ],
)
def test_bad_sft_rows_are_listed(tmp_path, bad_rows, check, rows):
    bad = [{**row, **bad_rows.get(i, {})} for i, row in enumerate(SFT_ROWS)]
    message = validation_error(tmp_path / "sft.jsonl", bad, "sft", **SFT_KEYS)
    assert f"{check} failed" in message and f"at rows {rows}" in message


def test_every_failure_is_reported_in_one_error(tmp_path):
    rows = [
        {"prompt": "Add 1 and 1.", "chosen": "Answer: 2", "rejected": "Answer: 3"},
        {"prompt": " ", "chosen": "Answer: 2", "rejected": "Answer: 3"},
        {"prompt": "Add 1 and 2.", "chosen": "Answer: 3", "rejected": "Answer: 3"},
        {"prompt": 12, "chosen": "", "rejected": "Answer: 3"},
    ]
    message = validation_error(tmp_path / "pref.jsonl", rows, "preference", **PREF_KEYS)
    assert "failed 4 validation check(s)" in message
    assert "column 'prompt' (--prompt_key): check not_blank failed (empty or whitespace-only text) at rows [1]" \
        in message
    assert "column 'prompt' (--prompt_key): check text_or_messages failed" in message and "values: 12" in message
    assert "column 'chosen' (--chosen_key): check not_blank failed" in message
    assert "check chosen_differs_from_rejected failed (chosen response equals rejected response) at rows [2]" in message


def test_rows_are_validated_in_chunks_and_reported_by_row_of_the_whole_file(tmp_path, monkeypatch):
    """A chunk of rows at a time (bounded memory on 700k rows); failures of every chunk in one report, numbered as
    rows of the file; a missing column is reported once, after the first chunk."""
    monkeypatch.setattr(data, "VALIDATION_CHUNK_ROWS", 4)
    rows = [{"prompt": f"Add {i} and 1.", "chosen": f"Answer: {i + 1}", "rejected": "Answer: 0"} for i in range(11)]
    rows[2]["chosen"], rows[9]["chosen"] = "", " "
    rows[7]["rejected"] = rows[7]["chosen"]
    message = validation_error(tmp_path / "pref.jsonl", rows, "preference", **PREF_KEYS)
    assert "(11 rows) failed 2 validation check(s)" in message
    assert "column 'chosen' (--chosen_key): check not_blank failed (empty or whitespace-only text) at rows [2, 9]" \
        in message
    assert "check chosen_differs_from_rejected failed (chosen response equals rejected response) at rows [7]" in message
    message = validation_error(tmp_path / "pref.jsonl", rows, "preference", **{**PREF_KEYS, "chosen_key": "best"})
    assert message.count("column 'best' (--chosen_key): column is missing") == 1


def test_prompt_labels_are_checked(tmp_path):
    rows = [{"prompt": "Add 1 and 1.", "label": "2"}, {"prompt": "Add 1 and 2.", "label": " "}]
    message = validation_error(tmp_path / "prompts.jsonl", rows, "prompt", input_key="prompt", label_key="label")
    assert "column 'label' (--label_key): check not_blank failed" in message and "at rows [1]" in message
    message = validation_error(tmp_path / "prompts.jsonl", rows, "prompt", input_key="prompt", label_key="answer")
    assert "column 'answer' (--label_key): column is missing" in message


def test_valid_data_with_custom_keys_and_chat_messages_passes(tmp_path):
    rows = [
        {"question": [{"role": "user", "content": "Add 1 and 1."}], "answer": "Answer: 2", "gold": 2},
        {"question": "Add 2 and 2.", "answer": [{"role": "assistant", "content": "Answer: 4"}], "gold": 4},
    ]
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    ds = data.load_rows(str(path))
    data.validate_sft(ds, str(path), input_key="question", output_key="answer")
    data.validate_prompts(ds, str(path), input_key="question", label_key="gold")


# -------------------------------------------------------------------------------------------------- examples


@pytest.mark.parametrize("special_tokens", [False, True])
def test_token_ids_are_the_tokenizers_own(tokenizer, special_tokens):
    """The Rust batch encoder called directly gives the wrapper's ids, special tokens in the text included; a backend
    left truncating (by an earlier call with truncation) goes through the wrapper, which resets it."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(tokenizer)  # which starts each text with <|pad|> when special tokens are added
    pad = tokenizer.pad_token_id
    tokenizer.backend_tokenizer.post_processor = TemplateProcessing(single="<|pad|> $A",
                                                                    special_tokens=[("<|pad|>", pad)])
    texts = ["Add 1 and 1.", "<|user|>Hi<|assistant|>Yo<|eos|>", "", "x" * 300]
    expected = tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
    assert all((ids[:1] == [pad]) == special_tokens for ids in expected)
    assert data.token_ids(tokenizer, texts, special_tokens=special_tokens) == expected
    tokenizer(texts, truncation=True, max_length=4)
    assert tokenizer.backend_tokenizer.truncation is not None
    assert data.token_ids(tokenizer, texts, special_tokens=special_tokens) == expected
    assert tokenizer.backend_tokenizer.truncation is None
    assert data.token_ids(tokenizer, [], special_tokens=special_tokens) == []


def test_format_prompt(tokenizer):
    assert data.format_prompt(tokenizer, "Add 1 and 1.", apply_chat_template=False) == "Add 1 and 1."
    templated = data.format_prompt(tokenizer, "Add 1 and 1.", False, input_template="User: {}\nAssistant: ")
    assert templated == "User: Add 1 and 1.\nAssistant: "
    assert data.format_prompt(tokenizer, "Add 1 and 1.", True) == "<|user|>Add 1 and 1.<|assistant|>"
    messages = [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}, {"role": "user", "content": "Add"}
    ]
    assert data.format_prompt(tokenizer, messages, True) == "<|user|>Hi<|assistant|>Yo<|eos|><|user|>Add<|assistant|>"
    with pytest.raises(ValueError, match="--apply_chat_template"):
        data.format_prompt(tokenizer, messages, False)


@pytest.mark.parametrize("apply_chat_template", [False, True])
def test_sft_loss_mask_covers_response_and_eos_only(tokenizer, apply_chat_template):
    examples = data.encode_sft(
        dataset(SFT_ROWS), tokenizer, input_key="prompt", output_key="response",
        apply_chat_template=apply_chat_template, max_len=64,
    ).kept()
    assert len(examples) == len(SFT_ROWS)
    for row, example in zip(SFT_ROWS, examples):
        ids, mask = example["input_ids"], example["loss_mask"]
        prompt = data.format_prompt(tokenizer, row["prompt"], apply_chat_template)
        n_prompt = len(tokenizer(prompt, add_special_tokens=not apply_chat_template)["input_ids"])
        assert mask == [0] * n_prompt + [1] * (len(ids) - n_prompt)
        assert ids[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(ids[:n_prompt]) == prompt
        assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == row["response"] + tokenizer.eos_token


def test_truncation_keeps_prompt_and_drops_rows_without_room(tokenizer, caplog):
    rows = [{"prompt": "Hi", "response": "Answer: 123456789"}, {"prompt": "Add 4 and 5 " * 8, "response": "Answer: 9"}]
    prompt_len = len(tokenizer("Hi")["input_ids"])
    long_prompt_len = len(tokenizer(rows[1]["prompt"])["input_ids"])
    max_len = prompt_len + 4
    assert long_prompt_len >= max_len
    with caplog.at_level(logging.WARNING, logger="stages.data"):
        examples = data.encode_sft(
            dataset(rows), tokenizer, input_key="prompt", output_key="response", apply_chat_template=False,
            max_len=max_len,
        ).kept()
    assert len(examples) == 1
    assert examples[0]["input_ids"][:prompt_len] == tokenizer("Hi")["input_ids"]
    assert examples[0]["loss_mask"] == [0] * prompt_len + [1] * 4
    assert "dropped 1 of 2 SFT examples" in caplog.text and "rows [1]" in caplog.text
    with pytest.raises(DataValidationError, match="all 1 SFT examples were dropped"):
        data.encode_sft(dataset(rows[1:]), tokenizer, input_key="prompt", output_key="response",
                        apply_chat_template=False, max_len=max_len).kept()


def test_preference_examples_share_the_prompt(tokenizer):
    rows = [{"q": "Add 1 and 1.", "good": "Answer: 2", "bad": "Answer: 31"}]
    (example,) = data.encode_preferences(
        dataset(rows), tokenizer, prompt_key="q", chosen_key="good", rejected_key="bad",
        apply_chat_template=True, max_len=64,
    ).kept()
    n_prompt = len(tokenizer("<|user|>Add 1 and 1.<|assistant|>", add_special_tokens=False)["input_ids"])
    for side, text in (("chosen", "Answer: 2"), ("rejected", "Answer: 31")):
        ids, mask = example[f"{side}_ids"], example[f"{side}_loss_mask"]
        assert mask[:n_prompt] == [0] * n_prompt and all(mask[n_prompt:])
        assert tokenizer.decode(ids[n_prompt:]) == text + "<|eos|>"
    assert example["chosen_ids"][:n_prompt] == example["rejected_ids"][:n_prompt]


def test_prompt_examples_carry_text_ids_and_label(tokenizer, caplog):
    rows = [{"prompt": "Add 1 and 1.", "label": "2"}, {"prompt": "Add 4 and 5. " * 10, "label": "9"}]
    with caplog.at_level(logging.WARNING, logger="stages.data"):
        examples = data.encode_prompts(
            dataset(rows), tokenizer, input_key="prompt", label_key="label", apply_chat_template=True,
            prompt_max_len=16,
        ).kept()
    assert examples == [{
        "prompt": "<|user|>Add 1 and 1.<|assistant|>",
        "prompt_ids": tokenizer("<|user|>Add 1 and 1.<|assistant|>", add_special_tokens=False)["input_ids"],
        "label": "2",
    }]
    assert "dropped 1 of 2 prompt examples" in caplog.text
    unlabeled = data.encode_prompts(dataset(rows[:1]), tokenizer, input_key="prompt", label_key=None,
                                    apply_chat_template=False, prompt_max_len=16).kept()
    assert unlabeled[0]["label"] == "" and unlabeled[0]["prompt"] == "Add 1 and 1."


def test_pad_batch_pads_either_side():
    assert sequences.pad_batch([[1, 2, 3], [4]], 0).tolist() == [[1, 2, 3], [4, 0, 0]]
    assert sequences.pad_batch([[1, 2, 3], [4]], 9, side="left").tolist() == [[1, 2, 3], [9, 9, 4]]
    with pytest.raises(ValueError, match="padding side"):
        sequences.pad_batch([[1]], 0, side="middle")


# ------------------------------------------------------------------------------- validation never crashes


def bad_utf8_file(path: Path) -> Path:
    rows = [json.dumps(row).encode() for row in SFT_ROWS]
    rows[1] = rows[1].replace(b"Add", b"A\xffdd")  # one byte that is not UTF-8, in row 1's prompt
    path.write_bytes(b"\n".join(rows) + b"\n")
    return path


@pytest.mark.parametrize(
    ("kind", "keys"),
    [("sft", SFT_KEYS), ("preference", {"prompt_key": "prompt", "chosen_key": "response", "rejected_key": "other"}),
     ("prompt", {"input_key": "prompt"})],
)
def test_undecodable_bytes_are_reported_by_row(tmp_path, kind, keys):
    path = bad_utf8_file(tmp_path / "bad.jsonl")
    if kind == "preference":  # a preference file: a rejected column next to the bad prompt
        rows = path.read_bytes().splitlines()
        path.write_bytes(b"\n".join(row[:-1] + b', "other": "Answer: 0"}' for row in rows) + b"\n")
    validate = {"sft": data.validate_sft, "preference": data.validate_preference, "prompt": data.validate_prompts}
    with pytest.raises(DataValidationError) as err:
        validate[kind](data.load_rows(str(path)), str(path), **keys)
    message = str(err.value)
    assert str(path) in message and "failed 1 validation check(s)" in message
    assert "column 'prompt' (--input_key" in message or "column 'prompt' (--prompt_key)" in message
    assert "check valid_utf8 failed (text is not valid UTF-8) at rows [1]" in message


def test_column_and_table_level_failures_name_the_whole_column(tmp_path):
    """Failures pandera reports without a row (a check over a whole column, a check that raised) still end in
    the one report, never in a traceback."""
    import pandera.pandas as pa

    def breaks(value):
        raise RuntimeError("cannot check this")

    schema = pa.DataFrameSchema(
        {"prompt": pa.Column(checks=[pa.Check(lambda column: False, name="column_wide"),
                                     pa.Check(breaks, element_wise=True, name="raises")]),
         "response": pa.Column(checks=[pa.Check(lambda value: value != "Answer: 9", element_wise=True,
                                                name="row_check")])},
        checks=[pa.Check(lambda frame: False, name="table_wide")],
    )
    with pytest.raises(DataValidationError) as err:
        data._validate("SFT", schema, dataset(SFT_ROWS), "rows.jsonl", {"prompt": "--input_key"})
    message = str(err.value)
    assert "failed 4 validation check(s)" in message
    assert "column 'prompt' (--input_key): check column_wide failed (column_wide) on the whole column: False" in message
    assert "column 'prompt' (--input_key): check raises failed (raises) on the whole column: " \
           'RuntimeError("cannot check this")' in message
    assert "column 'response': check row_check failed (row_check) at rows [1]" in message
    assert "check table_wide failed (table_wide) on the whole table: False" in message


def test_a_failing_validation_machinery_is_still_a_data_error(monkeypatch):
    monkeypatch.setattr(data, "_python_frame", lambda ds, columns, index: (_ for _ in ()).throw(MemoryError("too big")))
    with pytest.raises(DataValidationError, match=r"SFT data in rows.jsonl could not be validated: MemoryError"):
        data.validate_sft(dataset(SFT_ROWS), "rows.jsonl", **SFT_KEYS)


def test_rows_that_passed_are_not_checked_again_until_their_file_changes(tmp_path, monkeypatch):
    """A pass is recorded by the rows' fingerprint and the schema's settings: the same file read again is not
    checked (a warm start), other settings are, and so is the file once it changes, bad rows reported by row."""
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in SFT_ROWS))
    data.validate_sft(data.load_rows(str(path)), str(path), **SFT_KEYS)
    rows = data.load_rows(str(path))
    record = data.validation_record("SFT", dict(SFT_KEYS, multiturn=False, pretrain_mode=False, system_key=None,
                                                apply_chat_template=None), rows)
    assert json.loads(record.read_text()) == {"kind": "SFT", "source": str(path), "rows": len(SFT_ROWS)}

    checked = []
    frame = data._python_frame
    monkeypatch.setattr(data, "_python_frame", lambda *args: checked.append(args) or frame(*args))
    data.validate_sft(rows, str(path), **SFT_KEYS)
    assert checked == []  # the record answered
    data.validate_sft(rows, str(path), input_key="prompt", output_key="response", apply_chat_template=False)
    assert len(checked) == 1  # other settings: another schema, checked

    time.sleep(0.01)  # a later modification time, as any rewrite of a file has
    path.write_text(path.read_text().replace('"Answer: 9"', '""'))
    with pytest.raises(DataValidationError, match=r"at rows \[1\]"):
        data.validate_sft(data.load_rows(str(path)), str(path), **SFT_KEYS)
    assert len(checked) == 2


def test_wrong_types_from_parquet_are_row_failures(tmp_path):
    path = tmp_path / "prompts.parquet"
    pd.DataFrame({"prompt": ["Add 1 and 1.", "Add 2 and 2."], "label": [True, False]}).to_parquet(path)
    message = validation_error_of(path, data.validate_prompts, input_key="prompt", label_key="label")
    assert "column 'label' (--label_key): check label_is_scalar failed" in message and "at rows [0, 1]" in message


def validation_error_of(path: Path, validate, **keys) -> str:
    with pytest.raises(DataValidationError) as err:
        validate(data.load_rows(str(path)), str(path), **keys)
    return str(err.value)


# ------------------------------------------------------------------------ encoding only the tokens max_len keeps

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")


def trained_tokenizer(kind: str):
    """A small tokenizer of a real family, trained here: GPT-2's byte-level BPE, Llama 3's regex split, one whose
    words keep the space after them (a cut word differs from the whole text's), a sentencepiece-like Metaspace BPE
    (splitting words, or Llama 2's way: the whole text one word), BERT's WordPiece."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from bench.data_scale import TextSource

    special = ["<|eos|>", "<|user|>"]
    if kind == "wordpiece":
        backend = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        backend.normalizer = normalizers.BertNormalizer(lowercase=True)
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        trainer = trainers.WordPieceTrainer(vocab_size=2000, special_tokens=["[UNK]", *special], show_progress=False)
    elif kind.startswith("metaspace"):
        backend = Tokenizer(models.BPE(byte_fallback=True))
        backend.normalizer = normalizers.NFKC()
        backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first", split=kind == "metaspace-words")
        trainer = trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                      special_tokens=[*special] + [f"<0x{byte:02X}>" for byte in range(256)])
    else:
        backend = Tokenizer(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind == "gpt2")
        split = (pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated") if kind == "llama3" else
                 pre_tokenizers.Split(" ", "merged_with_previous"))  # a word ends with the space after it
        backend.pre_tokenizer = byte_level if kind == "gpt2" else pre_tokenizers.Sequence([split, byte_level])
        trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=special, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    source = TextSource(seed=1)
    backend.train_from_iterator([source.text(5, 40) for _ in range(2000)] + [MIXED_SCRIPTS] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|eos|>", additional_special_tokens=special[1:])


MIXED_SCRIPTS = "数据 测试 这是一个例子 🙂🙂 ünïcödé naïve 12345 3.14159 x_y-z don't I'll\ttab\n\nnew line"


def texts_that_cut_anywhere() -> list[str]:
    """Long texts whose cuts fall in every kind of place: words, digits, other scripts, runs of spaces, newlines,
    special tokens, one word of thousands of characters; and short ones encoded whole."""
    from bench.data_scale import TextSource

    source = TextSource(seed=2)
    texts = [source.text(60, 400) for _ in range(40)]
    texts += [" ".join([MIXED_SCRIPTS] * 30), ("word  " * 3 + "   \n") * 200, "<|user|>" + "Hi <|eos|>there " * 300,
              "9" * 5000, "a" * 3000 + " end", ("x" * 300 + " ") * 20, "tail " * 400 + "<|eos|>", "", "short"]
    return texts


@pytest.mark.parametrize("kind", ["tiny", "gpt2", "llama3", "trailing-space", "metaspace-words", "metaspace-one",
                                  "wordpiece"])
def test_the_first_tokens_of_a_text_cut_short_are_those_of_the_whole_text(tokenizer, kind):
    """token_ids with limits: each text's first `limit` ids equal the whole encoding's, whatever the tokenizer and
    wherever the cut falls; long texts are cut (fewer characters encoded) where the tokenizer splits words, and
    encoded whole where it does not (Llama 2's Metaspace without split)."""
    tokenizer = tokenizer if kind == "tiny" else trained_tokenizer(kind)
    texts = texts_that_cut_anywhere()
    for special_tokens in (False, True):
        whole = tokenizer(texts, add_special_tokens=special_tokens)["input_ids"]
        # without special tokens, every third limit up to 400: the last wanted token at each place of a word
        for limit in [*range(1, 400, 3)] * (not special_tokens) + [1, 60, 512, 2000, data.WHOLE]:
            limits = [limit] * len(texts)
            assert data.token_ids(tokenizer, texts, special_tokens=special_tokens, limits=limits) == [
                ids[:limit] for ids in whole], (kind, special_tokens, limit)

    class CountingBackend:  # the characters the batch encoder reads
        def __init__(self, backend):
            self.backend, self.chars = backend, 0

        def encode_batch(self, batch, add_special_tokens):
            self.chars += sum(map(len, batch))
            return self.backend.encode_batch(batch, add_special_tokens=add_special_tokens)

    counting = CountingBackend(tokenizer.backend_tokenizer)
    cut_ids = data._leading_ids(counting, texts, [60] * len(texts), special_tokens=False)
    assert cut_ids == [ids[:60] for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    total = sum(map(len, texts))
    if kind == "metaspace-one":
        assert not data._splits_words(tokenizer.backend_tokenizer)
    else:
        assert counting.chars < total / 2, (kind, counting.chars, total)  # 8 of them encoded whole to calibrate


def test_the_same_text_is_encoded_once(tokenizer):
    texts = ["Add 1 and 1.", "Add 2 and 2.", "Add 1 and 1."]
    ids = data.token_ids(tokenizer, texts, special_tokens=False, limits=[2, 100, 100])
    assert ids == [tokenizer(text, add_special_tokens=False)["input_ids"][:limit] for text, limit in
                   zip(texts, [2, 100, 100])]
    ids[0].append(-1)  # the lists are the caller's own
    assert ids[2] == tokenizer(texts[2], add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("max_len", [16, 200, 512, 1500])
def test_examples_built_to_max_len_equal_those_cut_from_whole_encodings(tokenizer, monkeypatch, tmp_path, max_len):
    """Every encoder that cuts at max_len (SFT's three modes, preferences, KTO) gives the examples, fits and eos of
    encoding every piece whole and cutting after, on real-format rows long enough to be cut (and, at 16, rows whose
    prompt fills max_len)."""
    from bench.data_scale import write_pairs  # OpenRLHF/preference_dataset_mixture2_and_safe_pku's layout

    pairs = data.load_rows(str(write_pairs(tmp_path / "pairs.jsonl", 60, seed=3)))
    sft = dataset([{"q": pair["chosen"][0]["content"], "a": pair["chosen"][1]["content"],
                    "conversation": pair["chosen"] + [pair["chosen"][0], pair["rejected"][1]]} for pair in pairs])
    builds = {
        "sft": lambda: data.encode_sft(sft, tokenizer, input_key="q", output_key="a", apply_chat_template=True,
                                       max_len=max_len),
        "sft plain": lambda: data.encode_sft(sft, tokenizer, input_key="q", output_key="a", max_len=max_len,
                                             apply_chat_template=False, input_template="Q: {}\nA: "),
        "multiturn": lambda: data.encode_sft(sft, tokenizer, input_key="conversation", output_key="a",
                                             apply_chat_template=True, multiturn=True, max_len=max_len),
        "pretrain": lambda: data.encode_sft(sft, tokenizer, input_key="a", output_key="a", apply_chat_template=False,
                                            pretrain_mode=True, max_len=max_len),
        "preference": lambda: data.encode_preferences(pairs, tokenizer, prompt_key=None, chosen_key="chosen",
                                                      rejected_key="rejected", apply_chat_template=True,
                                                      max_len=max_len),
        "kto": lambda: data.encode_kto(sft.add_column("label", [True, False] * 30), tokenizer, input_key="q",
                                       output_key="a", label_key="label", apply_chat_template=True, max_len=max_len),
    }
    built = {name: build() for name, build in builds.items()}
    encode_whole = data._encode_pieces
    monkeypatch.setattr(data, "_encode_pieces", lambda *args, max_len=None, **kwargs: encode_whole(*args, **kwargs))
    for name, build in builds.items():
        expected = build()
        assert (built[name].examples, built[name].fits) == (expected.examples, expected.fits), name
    # No prompt is as short as 16 tokens: at 16 every row is dropped (a KTO prompt is never cut)
    assert any(built["preference"].fits) == any(built["kto"].fits) == (max_len > 16)
