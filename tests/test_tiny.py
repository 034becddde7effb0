"""The tiny toolkit: deterministic assets, loadable with the Auto classes, well-formed task data, rule reward."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from stages import tiny

REPO_ROOT = Path(__file__).resolve().parents[1]


def file_digests(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> dict[str, Path]:
    return tiny.build_tiny_assets(tmp_path_factory.mktemp("tiny") / "assets", seed=0)


@pytest.fixture(scope="module")
def tokenizer(assets):
    return AutoTokenizer.from_pretrained(assets["model"])


def test_same_seed_gives_identical_bytes_across_processes(assets, tmp_path):
    # A separate process through the CLI: the tokenizer trainer's and the weight init's determinism must not
    # depend on per-process state such as hash seeds.
    out = subprocess.run(
        [sys.executable, "-m", "stages.tiny", "--out", str(tmp_path / "cli"), "--seed", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, check=True,
    ).stdout
    keys = {"model", *tiny.DATASET_FILES}
    # Libraries may log to stdout too (DeepSpeed's accelerator notice): keep the asset lines.
    printed = dict(line.split(": ", 1) for line in out.splitlines() if line.split(": ", 1)[0] in keys)
    assert set(printed) == keys
    assert all(Path(path).exists() for path in printed.values())
    root = assets["model"].parent
    assert file_digests(tmp_path / "cli") == file_digests(root)
    assert any(name.endswith("model.safetensors") for name in file_digests(root))


def test_other_seed_changes_weights_and_split(assets, tmp_path):
    other = tiny.build_tiny_assets(tmp_path / "seed1", seed=1)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert digest(other["model"] / "model.safetensors") != digest(assets["model"] / "model.safetensors")
    assert digest(other["model"] / "tokenizer.json") == digest(assets["model"] / "tokenizer.json")
    assert read_jsonl(other["prompts_eval"]) != read_jsonl(assets["prompts_eval"])


def test_build_is_idempotent_and_rebuilds_when_seed_or_files_change(tmp_path):
    paths = tiny.build_tiny_assets(tmp_path, seed=0)
    weights = paths["model"] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert tiny.build_tiny_assets(tmp_path, seed=0) == paths
    assert weights.stat().st_mtime_ns == mtime

    before = file_digests(tmp_path)
    paths["sft_train"].unlink()
    tiny.build_tiny_assets(tmp_path, seed=0)
    assert file_digests(tmp_path) == before

    tiny.build_tiny_assets(tmp_path, seed=3)
    assert json.loads((tmp_path / tiny.ASSETS_MARKER).read_text())["seed"] == 3
    assert file_digests(tmp_path)["model/model.safetensors"] != before["model/model.safetensors"]


def test_model_shape_fits_vllm_cpu_and_special_ids_are_in_config(assets, tokenizer):
    config = json.loads((assets["model"] / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["hidden_size"] // config["num_attention_heads"] >= 32
    assert config["vocab_size"] == len(tokenizer) <= 512
    assert config["pad_token_id"] == tokenizer.pad_token_id != tokenizer.eos_token_id == config["eos_token_id"]


def test_causal_lm_loads_and_generates_until_eos_or_limit(assets, tokenizer):
    model = AutoModelForCausalLM.from_pretrained(assets["model"])
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 3?"}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert 1 <= out.shape[1] - inputs["input_ids"].shape[1] <= 4


def test_value_head_pools_at_last_non_pad_token(assets, tokenizer):
    torch.manual_seed(0)
    value_model = AutoModelForSequenceClassification.from_pretrained(assets["model"], num_labels=1).eval()
    assert value_model.config.pad_token_id == tokenizer.pad_token_id
    short = tokenizer("Answer: 5", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    long = tokenizer("Answer: 12", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    padded = torch.tensor([short + [tokenizer.pad_token_id] * (len(long) - len(short)), long])
    with torch.no_grad():
        batch_scores = value_model(input_ids=padded, attention_mask=(padded != tokenizer.pad_token_id).long()).logits
        alone = value_model(input_ids=torch.tensor([short])).logits
    assert batch_scores.shape == (2, 1)
    torch.testing.assert_close(batch_scores[0], alone[0])


def test_chat_template_renders_turns_with_special_tokens(tokenizer):
    messages = [{"role": "user", "content": "Add 4 and 7."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|user|>Add 4 and 7.<|assistant|>"
    full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": "Answer: 11"}], tokenize=False)
    assert full == "<|user|>Add 4 and 7.<|assistant|>Answer: 11<|eos|>"
    ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens[0] == "<|user|>" and tokens[-1] == "<|eos|>" and "<|assistant|>" in tokens
    assert "1" in tokens and "11" not in tokens  # digits are single tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Add 4 and 7.Answer: 11"
    system = tokenizer.apply_chat_template([{"role": "system", "content": "Be exact."}, *messages], tokenize=False)
    assert system == "Be exact.\n<|user|>Add 4 and 7."
    # The response tokenises the same alone as after the prompt, so prompt/response masks line up.
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer("Answer: 11<|eos|>", add_special_tokens=False)["input_ids"]
    assert ids == prompt_ids + response_ids


def test_datasets_are_well_formed_with_disjoint_held_out_prompts(assets):
    fields = {"sft": {"prompt", "response"}, "pref": {"prompt", "chosen", "rejected"}, "prompts": {"prompt", "label"}}
    rows = {f"{family}_{split}": read_jsonl(assets[f"{family}_{split}"])
            for family in fields for split in ("train", "eval")}
    for key, data in rows.items():
        assert data, key
        assert all(set(row) == fields[key.rsplit("_", 1)[0]] for row in data), key
        assert all(isinstance(v, str) and v for row in data for v in row.values()), key
    for family in fields:
        train = {row["prompt"] for row in rows[f"{family}_train"]}
        held_out = {row["prompt"] for row in rows[f"{family}_eval"]}
        assert not train & held_out, family
    # All families share one split.
    assert {r["prompt"] for r in rows["sft_eval"]} == {r["prompt"] for r in rows["prompts_eval"]}
    assert {r["prompt"] for r in rows["pref_train"]} == {r["prompt"] for r in rows["prompts_train"]}
    assert len(rows["prompts_eval"]) == len({r["prompt"] for r in rows["prompts_eval"]})


def test_real_format_files_hold_the_same_task(assets):
    sft = read_jsonl(assets["sft_train"])
    orca = read_jsonl(assets["orca_train"])
    assert [(r["question"], r["response"]) for r in orca] == [(r["prompt"], r["response"]) for r in sft]
    assert {r["system_prompt"] for r in orca} == set(tiny.SYSTEM_PROMPTS)
    chat = read_jsonl(assets["chat_train"])
    chat_turns = [m["content"] for r in chat for m in r["messages"] if m["role"] != "system"]
    assert chat_turns == [text for r in sft[: len(chat_turns) // 2] for text in (r["prompt"], r["response"])]
    assert [r["text"] for r in read_jsonl(assets["pretrain_train"])] == [f"{r['prompt']} {r['response']}" for r in sft]
    pairs = read_jsonl(assets["pref_train"])
    chat_pairs = read_jsonl(assets["pref_chat_train"])
    assert [(r["chosen"][0]["content"], r["chosen"][1]["content"], r["rejected"][1]["content"]) for r in chat_pairs] \
        == [(r["prompt"], r["chosen"], r["rejected"]) for r in pairs]
    for split in ("train", "eval"):
        collection = read_jsonl(assets[f"prompts_chat_{split}"])
        assert [(r["context_messages"], r["label"]) for r in collection] == [
            ([{"role": "user", "content": r["prompt"]}], r["label"]) for r in read_jsonl(assets[f"prompts_{split}"])]
    kto = read_jsonl(assets["kto_train"])
    assert sum(r["label"] for r in kto) == len(kto) // 2 == len(read_jsonl(assets["prompts_train"]))
    for row in kto:
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert (tiny.extract_answer(row["completion"]) == str(a + b)) is row["label"]


def test_rl_labels_are_the_sums_and_preferences_prefer_them(assets):
    for row in read_jsonl(assets["prompts_train"]) + read_jsonl(assets["prompts_eval"]):
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert row["label"] == str(a + b), row
    rejected = {}
    for row in read_jsonl(assets["pref_train"]):
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        assert tiny.extract_answer(row["chosen"]) == str(a + b)
        rejected.setdefault(row["prompt"], set()).add(int(tiny.extract_answer(row["rejected"])))
    for prompt, answers in rejected.items():
        a, b = map(int, re.findall(r"\d+", prompt))
        assert len(answers) == tiny.PREF_PAIRS_PER_PROMPT and a + b + 1 in answers and a + b not in answers


def test_sft_demonstrations_are_mostly_off_by_one_in_the_same_mix_for_every_prompt(assets):
    per_prompt = Counter()
    for row in read_jsonl(assets["sft_train"]):
        a, b = map(int, re.findall(r"\d+", row["prompt"]))
        answer = int(tiny.extract_answer(row["response"]))
        assert answer in (a + b, a + b + 1), row
        per_prompt[row["prompt"]] += answer == a + b
    assert set(per_prompt.values()) == {tiny.SFT_CORRECT_PER_PROMPT}


@pytest.mark.parametrize(
    ("response", "expected"),
    [("Answer: 12", "12"), ("Answer:7<|eos|>", "7"), ("Answer: 3 Answer: 4", "3"), ("12", None), ("", None)],
)
def test_extract_answer(response, expected):
    assert tiny.extract_answer(response) == expected


def test_reward_func_scores_correct_and_incorrect_answers():
    prompt = "<|user|>What is 2 plus 3?<|assistant|>"
    queries = [prompt + "Answer: 5<|eos|>", prompt + "Answer: 6", prompt + "5", "What is 2 plus 3?Answer: 5"]
    prompts = [prompt, prompt, prompt, prompt]  # the last query lost its special tokens in decoding
    rewards = tiny.reward_func(queries, prompts, ["5", "5", "5", "5"])
    assert rewards.dtype == torch.float32
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 queries, 1 prompts"):
        tiny.reward_func(queries[:2], prompts[:1], ["5", "5"])


def test_reward_file_usable_by_path():
    spec = importlib.util.spec_from_file_location("user_reward", REPO_ROOT / "stages" / "tiny_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.reward_func(["Answer: 9"], [""], ["9"]).tolist() == [1.0]
