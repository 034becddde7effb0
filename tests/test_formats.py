"""The dataset formats users train on, each in the exact column layout of the real dataset (tiny task content),
through the stages' own data path: the stage's flags parsed as on the command line, then its validate_rows and
encode_rows (what `python -m stages.<stage>` runs before and in its ranks).
"""

from __future__ import annotations

import json

import pytest

from stages import data
from stages.cli import parse_stage_args
from stages.data import DataValidationError
from stages.dpo import train as dpo
from stages.kto import train as kto
from stages.registry import STAGES
from stages.reward_model import train as reward_model
from stages.sft import train as sft


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def examples_of(stage_module, stage: str, tokenizer, source, *flags: str, rows: int = 8):
    """Validate and tokenise the first rows of `source` exactly as the stage does with these flags."""
    cfg = parse_stage_args(STAGES[stage], ["--config", "tiny", "--pretrain", "unused", "--dataset", str(source), *flags])
    loaded = data.load_rows(str(source), max_samples=rows)
    cfg.validate_rows(loaded, str(source))
    return stage_module.encode_rows(cfg, tokenizer, loaded).kept()


def trained_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([token for token, trained in zip(ids, mask) if trained])


def test_openorca_with_system_prompts_through_the_chat_template(assets, tokenizer):
    rows = read_jsonl(assets["orca_train"])[:8]
    assert set(rows[0]) == {"id", "system_prompt", "question", "response"}
    assert {row["system_prompt"] for row in rows} == {"", "You are a careful calculator."}
    examples = examples_of(sft, "sft", tokenizer, assets["orca_train"], "--input_key", "question",
                           "--output_key", "response", "--system_key", "system_prompt", "--max_len", "64")
    for row, example in zip(rows, examples):
        text = tokenizer.decode(example["input_ids"])
        system = row["system_prompt"] + "\n" if row["system_prompt"] else ""
        assert text == f"{system}<|user|>{row['question']}<|assistant|>{row['response']}<|eos|>"
        assert trained_text(tokenizer, example["input_ids"], example["loss_mask"]) == row["response"] + "<|eos|>"


def test_openorca_with_openrlhf_input_template(assets, tokenizer):
    """OpenRLHF's Llama SFT example: --input_key question --output_key response --input_template 'User: {}...'."""
    rows = read_jsonl(assets["orca_train"])[:8]
    examples = examples_of(sft, "sft", tokenizer, assets["orca_train"], "--no_apply_chat_template",
                           "--input_key", "question", "--output_key", "response",
                           "--input_template", "User: {}\nAssistant: ", "--max_len", "64")
    for row, example in zip(rows, examples):
        assert tokenizer.decode(example["input_ids"]) == (f"User: {row['question']}\nAssistant: {row['response']}"
                                                          "<|eos|>")
        assert trained_text(tokenizer, example["input_ids"], example["loss_mask"]) == row["response"] + "<|eos|>"


def test_multiturn_conversations_train_every_assistant_turn(assets, tokenizer):
    rows = read_jsonl(assets["chat_train"])
    assert any(row["messages"][0]["role"] == "system" for row in rows)
    with_system = next(i for i, row in enumerate(rows) if row["messages"][0]["role"] == "system")
    examples = examples_of(sft, "sft", tokenizer, assets["chat_train"], "--input_key", "messages", "--multiturn",
                           "--max_len", "128", rows=with_system + 1)
    for row, example in zip(rows, examples):
        replies = [m["content"] + "<|eos|>" for m in row["messages"] if m["role"] == "assistant"]
        assert len(replies) == 2
        assert trained_text(tokenizer, example["input_ids"], example["loss_mask"]) == "".join(replies)
        assert tokenizer.decode(example["input_ids"]) == tokenizer.apply_chat_template(row["messages"], tokenize=False)
    assert tokenizer.decode(examples[with_system]["input_ids"]).startswith("You are a careful calculator.\n<|user|>")


def test_pretrain_mode_trains_every_token(assets, tokenizer):
    rows = read_jsonl(assets["pretrain_train"])[:8]
    flags = ("--no_apply_chat_template", "--input_key", "text", "--pretrain_mode")
    examples = examples_of(sft, "sft", tokenizer, assets["pretrain_train"], *flags, "--max_len", "64")
    for row, example in zip(rows, examples):
        assert all(example["loss_mask"])
        assert tokenizer.decode(example["input_ids"]) == row["text"] + "<|eos|>"
    cut = examples_of(sft, "sft", tokenizer, assets["pretrain_train"], *flags, "--max_len", "5")
    assert all(len(example["input_ids"]) == 5 for example in cut)  # long texts are cut, not dropped


@pytest.mark.parametrize(("stage", "module"), [("reward_model", reward_model), ("dpo", dpo)])
def test_preference_conversations_without_prompt_key(stage, module, assets, tokenizer):
    """OpenRLHF/preference_dataset_mixture2_and_safe_pku: chosen/rejected are whole conversations (the seed gives
    no --prompt_key); the prompt is their shared prefix, the response their final assistant turn."""
    rows = read_jsonl(assets["pref_chat_train"])[:8]
    assert set(rows[0]) == {"chosen", "rejected", "chosen_score", "rejected_score"}
    examples = examples_of(module, stage, tokenizer, assets["pref_chat_train"], "--prompt_key", "none")
    for row, example in zip(rows, examples):
        prompt = tokenizer.apply_chat_template(row["chosen"][:-1], tokenize=False, add_generation_prompt=True)
        for side in ("chosen", "rejected"):
            ids, mask = example[f"{side}_ids"], example[f"{side}_loss_mask"]
            assert tokenizer.decode(ids) == tokenizer.apply_chat_template(row[side], tokenize=False)
            assert tokenizer.decode(ids).startswith(prompt)
            assert trained_text(tokenizer, ids, mask) == row[side][-1]["content"] + "<|eos|>"


def test_preference_conversations_must_share_their_prompt_and_end_with_the_response(assets, tokenizer, tmp_path):
    rows = read_jsonl(assets["pref_chat_train"])[:4]
    rows[1]["rejected"][0]["content"] = "Another question?"
    rows[2]["chosen"] = rows[2]["chosen"][:1]  # the user turn alone
    path = tmp_path / "pref.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataValidationError) as error:
        examples_of(reward_model, "reward_model", tokenizer, path, "--prompt_key", "none")
    message = str(error.value)
    assert "check same_prompt_in_chosen_and_rejected failed" in message and "at rows [1, 2]" in message
    assert "column 'chosen' (--chosen_key): check ends_with_assistant_turn failed" in message and "rows [2]" in message


def test_margin_column_for_margin_loss(assets, tokenizer, tmp_path):
    rows = [{**row, "margin": float(index % 3)} for index, row in enumerate(read_jsonl(assets["pref_train"])[:6])]
    path = tmp_path / "pref.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    examples = examples_of(reward_model, "reward_model", tokenizer, path, "--margin_loss")
    assert [example["margin"] for example in examples] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]
    with pytest.raises(DataValidationError, match=r"column 'margin' \(--margin_loss\): column is missing"):
        examples_of(reward_model, "reward_model", tokenizer, assets["pref_train"], "--margin_loss")


def test_prompt_collection_messages_with_labels(assets, tokenizer):
    """OpenRLHF/prompt-collection-v0.1's context_messages (plus a label column), as the RL stage loads prompts."""
    rows = data.load_rows(str(assets["prompts_chat_eval"]), max_samples=4)
    assert set(rows.column_names) == {"dataset", "context", "context_messages", "id", "label"}
    data.validate_prompts(rows, "prompts", "context_messages", "label", apply_chat_template=True)
    examples = data.encode_prompts(rows, tokenizer, input_key="context_messages", label_key="label",
                                   apply_chat_template=True, prompt_max_len=64).kept()
    for row, example in zip(rows, examples):
        assert example["prompt"] == f"<|user|>{row['context']}<|assistant|>"
        assert example["prompt_ids"] == tokenizer(example["prompt"], add_special_tokens=False)["input_ids"]
        assert example["label"] == row["label"]
    with pytest.raises(DataValidationError, match=r"plain_text failed \(chat messages need --apply_chat_template"):
        data.validate_prompts(rows, "prompts", "context_messages", "label", apply_chat_template=False)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 1 and 2."}]
    assert data.format_prompt(tokenizer, system, True) == "Be brief.\n<|user|>Add 1 and 2.<|assistant|>"


def test_kto_unpaired_rows(assets, tokenizer):
    """TRL's unpaired preference layout: prompt, completion, bool label."""
    rows = read_jsonl(assets["kto_train"])[:8]
    examples = examples_of(kto, "kto", tokenizer, assets["kto_train"])
    for row, example in zip(rows, examples):
        assert tokenizer.decode(example["prompt_ids"]) == f"<|user|>{row['prompt']}<|assistant|>"
        assert tokenizer.decode(example["response_ids"]) == row["completion"] + "<|eos|>"
        assert example["desirable"] is row["label"]


@pytest.mark.parametrize(("dataset", "flags"), [("pref_train", []), ("pref_chat_train", ["--prompt_key", "none"])])
def test_kto_from_preference_pairs(dataset, flags, assets, tokenizer):
    rows = read_jsonl(assets[dataset])[:4]
    examples = examples_of(kto, "kto", tokenizer, assets[dataset], *flags, rows=4)
    assert [example["desirable"] for example in examples] == [True, False] * 4
    for row, (chosen, rejected) in zip(rows, zip(examples[0::2], examples[1::2])):
        assert chosen["prompt_ids"] == rejected["prompt_ids"]
        for side, example in (("chosen", chosen), ("rejected", rejected)):
            response = row[side] if isinstance(row[side], str) else row[side][-1]["content"]
            assert tokenizer.decode(example["response_ids"]) == response + "<|eos|>"


def test_kto_labels_must_be_booleans(assets, tokenizer, tmp_path):
    rows = read_jsonl(assets["kto_train"])[:3]
    rows[1]["label"] = "yes"
    path = tmp_path / "kto.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(DataValidationError, match=r"column 'label' \(--label_key\): check label_is_bool failed .* "
                                                  r"at rows \[1\]"):
        examples_of(kto, "kto", tokenizer, path)
