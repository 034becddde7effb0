"""Tiny toolkit: a small Llama and BPE tokenizer built locally, a verifiable arithmetic task, its datasets, its rule reward.

The task is adding two digits asked in one of several phrasings; the response is ``Answer: <sum>``. The SFT
demonstrations are noisy the way careless annotators are: each prompt has three, one gives the sum and two are off by
one in the same direction. SFT therefore learns a policy whose greedy answer is mostly wrong while sampling finds the
sum about a third of the time, which leaves clear room for RL with the rule reward; preference pairs (the sum vs a
wrong answer) train a reward model. Held-out prompts are (a, b, phrasing) combinations absent from train. Everything
is deterministic from a seed and needs no hub access.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from typing import TYPE_CHECKING

import torch

from stages.lean_imports import lean_transformers
from stages.tracking import quiet_model_files

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<|pad|>"
EOS_TOKEN = "<|eos|>"
USER_TOKEN = "<|user|>"
ASSISTANT_TOKEN = "<|assistant|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, USER_TOKEN, ASSISTANT_TOKEN]

# User and assistant turns, optionally after a system prompt (plain text on its own line); the generation prompt
# opens the assistant turn. No token is added for the system role: the vocabulary, and so the model, stay as they were.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER_TOKEN + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT_TOKEN + "' + message['content'] + '" + EOS_TOKEN + "' }}"
    "{% else %}{{ raise_exception('tiny chat template supports only system, user and assistant roles, got ' "
    "+ message['role']) }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT_TOKEN + "' }}{% endif %}"
)

# Phrasings of the same question; none contains "answer", so the answer pattern only ever matches the response.
TEMPLATES = (
    "What is {a} plus {b}?",
    "{a} + {b} = ?",
    "Add {a} and {b}.",
    "Compute {a}+{b}.",
    "What is the sum of {a} and {b}?",
    "Tom has {a} apples and gets {b} more. How many apples does he have?",
    "If x = {a} and y = {b}, what is x + y?",
    "Sum {a} with {b}.",
    "Please add {b} to {a}.",
    "A box holds {a} red and {b} blue balls. How many balls?",
)
MAX_OPERAND = 9
EVAL_FRACTION = 0.2
SFT_DEMOS_PER_PROMPT = 3  # annotators per prompt
SFT_CORRECT_PER_PROMPT = 1  # of them give the sum; the others give sum + 1
PREF_PAIRS_PER_PROMPT = 3  # rejected answers: sum + 1, sum - 1 (sum + 2 for 0), then random other wrong answers

ANSWER_PATTERN = re.compile(r"Answer:\s*(-?\d+)")
ASSETS_MARKER = "tiny_assets.json"
ASSETS_FORMAT = 4  # bump whenever the builders' output changes, so assets built by older code are rebuilt
DATASET_FILES = {
    "sft_train": "sft_train.jsonl",
    "sft_eval": "sft_eval.jsonl",
    "pref_train": "pref_train.jsonl",
    "pref_eval": "pref_eval.jsonl",
    "prompts_train": "prompts_train.jsonl",
    "prompts_eval": "prompts_eval.jsonl",
    # The train problems in the shapes of the datasets users train on (see _real_format_rows).
    "orca_train": "orca_train.jsonl",
    "chat_train": "chat_train.jsonl",
    "pretrain_train": "pretrain_train.jsonl",
    "pref_chat_train": "pref_chat_train.jsonl",
    "prompts_chat_train": "prompts_chat_train.jsonl",
    "prompts_chat_eval": "prompts_chat_eval.jsonl",
    "kto_train": "kto_train.jsonl",
    # The held-out prompts as evaluation benchmarks in GSM8K's and MATH's formats (stages/evaluate/suite.py).
    "prompts_eval_gsm8k": "prompts_eval_gsm8k.jsonl",
    "prompts_eval_math": "prompts_eval_math.jsonl",
}
SYSTEM_PROMPTS = ("", "You are a careful calculator.")  # OpenOrca rows have a system prompt or an empty one
TINY_EXPERTS, TINY_TOP_K = 4, 2  # the tiny mixture-of-experts model (build_tiny_model(moe=True))


@dataclass(frozen=True)
class TinyModelShape:
    """Llama shape of the tiny model; head_dim = hidden_size / num_attention_heads must be >= 32 for vLLM on CPU."""

    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 128
    vocab_size: int = 384  # upper bound for the BPE trainer, which stops earlier once the task text has no pairs left


@dataclass(frozen=True)
class Problem:
    a: int
    b: int
    template: int

    @property
    def prompt(self) -> str:
        return TEMPLATES[self.template].format(a=self.a, b=self.b)

    @property
    def answer(self) -> int:
        return self.a + self.b


def format_response(answer: int) -> str:
    return f"Answer: {answer}"


def extract_answer(response: str) -> str | None:
    """The integer after the first ``Answer:`` in the response, or None when there is none."""
    match = ANSWER_PATTERN.search(response)
    return match.group(1) if match else None


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> torch.Tensor:
    """1.0 where the answer in the response equals the label, else 0.0; queries are prompt + response texts."""
    if not len(queries) == len(prompts) == len(labels):
        raise ValueError(
            f"reward_func needs equal lengths, got {len(queries)} queries, {len(prompts)} prompts, {len(labels)} labels"
        )
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        # Prompts never contain the answer pattern, so when a decoded query does not start with its prompt
        # verbatim (special tokens dropped), searching the whole query is still correct.
        response = query[len(prompt) :] if query.startswith(prompt) else query
        rewards.append(1.0 if extract_answer(response) == str(label).strip() else 0.0)
    return torch.tensor(rewards, dtype=torch.float32)


def all_problems() -> list[Problem]:
    return [
        Problem(a, b, t)
        for t in range(len(TEMPLATES))
        for a in range(MAX_OPERAND + 1)
        for b in range(MAX_OPERAND + 1)
    ]


def split_problems(seed: int) -> tuple[list[Problem], list[Problem]]:
    """Random train / held-out split over (a, b, phrasing): held-out prompt strings never occur in train."""
    problems = all_problems()
    random.Random(seed).shuffle(problems)
    n_eval = round(len(problems) * EVAL_FRACTION)
    return problems[n_eval:], problems[:n_eval]


def _corpus() -> Iterable[str]:
    """All task text, for training the tokenizer; independent of the seed."""
    for problem in all_problems():
        yield problem.prompt
    for answer in range(2 * MAX_OPERAND + 2):
        yield format_response(answer)


def build_tokenizer(vocab_size: int = TinyModelShape.vocab_size) -> PreTrainedTokenizerFast:
    """Byte-level BPE trained on the task text; digits stay single tokens so numbers are spelled digit by digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[USER_TOKEN, ASSISTANT_TOKEN],
        clean_up_tokenization_spaces=False,
        model_max_length=TinyModelShape.max_position_embeddings,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def build_tiny_model(out_dir: str | Path, seed: int = 0, shape: TinyModelShape = TinyModelShape(),
                     moe: bool = False) -> Path:
    """Write a randomly initialised LlamaForCausalLM and its tokenizer (HF format, safetensors) into out_dir; with
    `moe` a MixtralForCausalLM of the same shape, each MLP a mixture of TINY_EXPERTS experts (TINY_TOP_K per token)."""
    with quiet_model_files():
        return _write_tiny_model(Path(out_dir), seed, shape, moe)


def _write_tiny_model(out: Path, seed: int, shape: TinyModelShape, moe: bool) -> Path:
    lean_transformers()
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(shape.vocab_size)
    config_cls, model_cls = (MixtralConfig, MixtralForCausalLM) if moe else (LlamaConfig, LlamaForCausalLM)
    experts = dict(num_local_experts=TINY_EXPERTS, num_experts_per_tok=TINY_TOP_K) if moe else {}
    config = config_cls(
        **experts,
        vocab_size=len(tokenizer),
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_hidden_layers,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,  # the value-head model pools at the last non-pad token
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        dtype="float32",
    )
    # Fork the RNG so building assets never disturbs the caller's random state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


def _sft_rows(problems: list[Problem], rng: random.Random) -> list[dict]:
    # Every prompt gets the same mix (exactly SFT_CORRECT_PER_PROMPT correct demonstrations), so the noise has no
    # per-prompt or per-operand-pair fluctuations that a model could memorise as signal.
    rows = [
        {"prompt": p.prompt, "response": format_response(p.answer if k < SFT_CORRECT_PER_PROMPT else p.answer + 1)}
        for p in problems
        for k in range(SFT_DEMOS_PER_PROMPT)
    ]
    rng.shuffle(rows)
    return rows


def _preference_rows(problems: list[Problem], rng: random.Random) -> list[dict]:
    # Per prompt, rejected answers are the annotators' systematic sum + 1, the near miss on the other side and random
    # others. A reward model that rarely sees near misses learns "not sum + 1" or "not above the sum" instead of
    # "equals the sum", and RL against it drifts to those wrong answers.
    rows = []
    for p in problems:
        near_miss = p.answer - 1 if p.answer > 0 else p.answer + 2
        others = [x for x in range(2 * MAX_OPERAND + 2) if x not in (p.answer, p.answer + 1, near_miss)]
        for wrong in [p.answer + 1, near_miss, *rng.sample(others, PREF_PAIRS_PER_PROMPT - 2)]:
            rows.append({"prompt": p.prompt, "chosen": format_response(p.answer), "rejected": format_response(wrong)})
    rng.shuffle(rows)
    return rows


def _real_format_rows(train: list[Problem], held_out: list[Problem], sft_rows: list[dict], pref_rows: list[dict],
                      rng: random.Random) -> dict[str, list[dict]]:
    """The task in the column layouts of real datasets, so that every supported format is trained on:

    - orca_train: Open-Orca/OpenOrca (id, system_prompt, question, response), the SFT demonstrations;
    - chat_train: multi-turn conversations (messages), two SFT demonstrations per conversation;
    - pretrain_train: raw text (text), prompt and response of each demonstration;
    - pref_chat_train: OpenRLHF/preference_dataset_mixture2_and_safe_pku (chosen and rejected as whole
      conversations, chosen_score, rejected_score), the preference pairs;
    - prompts_chat_{train,eval}: OpenRLHF/prompt-collection-v0.1 (dataset, context, context_messages, id) plus label;
    - kto_train: TRL's unpaired preferences (prompt, completion, bool label), per prompt the sum and a wrong answer.
    """
    def user(text: str) -> dict:
        return {"role": "user", "content": text}

    def assistant(text: str) -> dict:
        return {"role": "assistant", "content": text}

    def prompt_collection(problems: list[Problem], split: str) -> list[dict]:
        return [{"dataset": "tiny-arithmetic", "context": p.prompt, "context_messages": [user(p.prompt)],
                 "id": f"tiny-{split}-{i}", "label": str(p.answer)} for i, p in enumerate(problems)]

    chat = []
    for first, second in zip(sft_rows[0::2], sft_rows[1::2]):
        system = rng.choice(SYSTEM_PROMPTS)
        chat.append({"messages": ([{"role": "system", "content": system}] if system else [])
                     + [user(first["prompt"]), assistant(first["response"]),
                        user(second["prompt"]), assistant(second["response"])]})
    kto = []
    for p in train:
        wrong = rng.choice([p.answer + 1, p.answer - 1 if p.answer > 0 else p.answer + 2])
        kto += [{"prompt": p.prompt, "completion": format_response(p.answer), "label": True},
                {"prompt": p.prompt, "completion": format_response(wrong), "label": False}]
    rng.shuffle(kto)
    return {
        "orca_train": [{"id": f"tiny.{i}", "system_prompt": rng.choice(SYSTEM_PROMPTS), "question": row["prompt"],
                        "response": row["response"]} for i, row in enumerate(sft_rows)],
        "chat_train": chat,
        "pretrain_train": [{"text": f"{row['prompt']} {row['response']}"} for row in sft_rows],
        "pref_chat_train": [{"chosen": [user(row["prompt"]), assistant(row["chosen"])],
                             "rejected": [user(row["prompt"]), assistant(row["rejected"])],
                             "chosen_score": 1.0, "rejected_score": 0.0} for row in pref_rows],
        "prompts_chat_train": prompt_collection(train, "train"),
        "prompts_chat_eval": prompt_collection(held_out, "eval"),
        "kto_train": kto,
    }


def build_tiny_datasets(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write SFT, preference and RL-prompt jsonl files, each with a train and a held-out split, into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    train, held_out = split_problems(seed)
    rng = random.Random(seed + 1)
    rows = {
        "sft_train": _sft_rows(train, rng),
        "sft_eval": _sft_rows(held_out, rng),
        "pref_train": _preference_rows(train, rng),
        "pref_eval": _preference_rows(held_out, rng),
        "prompts_train": [{"prompt": p.prompt, "label": str(p.answer)} for p in train],
        "prompts_eval": [{"prompt": p.prompt, "label": str(p.answer)} for p in held_out],
    }
    # Own random stream: adding formats never changes the rows above.
    rows |= _real_format_rows(train, held_out, rows["sft_train"], rows["pref_train"], random.Random(seed + 2))
    rows["prompts_eval_gsm8k"] = [{"question": p.prompt, "answer": f"{p.a} + {p.b} = {p.answer}\n#### {p.answer}"}
                                  for p in held_out]
    rows["prompts_eval_math"] = [{"problem": p.prompt, "solution": f"${p.a} + {p.b} = \\boxed{{{p.answer}}}$"}
                                 for p in held_out]
    return {key: _write_jsonl(out / DATASET_FILES[key], rows[key]) for key in DATASET_FILES}


def _asset_paths(out: Path) -> dict[str, Path]:
    return {"model": out / "model", **{key: out / "data" / name for key, name in DATASET_FILES.items()}}


def build_tiny_assets(out_dir: str | Path, seed: int = 0) -> dict[str, Path]:
    """Model under out_dir/model and datasets under out_dir/data; a no-op when built before with the same seed."""
    out = Path(out_dir)
    paths = _asset_paths(out)
    marker = out / ASSETS_MARKER
    expected = {"format": ASSETS_FORMAT, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == expected and all(p.exists() for p in paths.values()):
        return paths
    marker.unlink(missing_ok=True)
    shutil.rmtree(paths["model"], ignore_errors=True)
    build_tiny_model(paths["model"], seed)
    build_tiny_datasets(out / "data", seed)
    # Written last: an interrupted build has no marker and is rebuilt next time.
    marker.write_text(json.dumps(expected))
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Build the tiny model, tokenizer and task datasets.")
    parser.add_argument("--out", required=True, help="directory to write the assets into")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights, data split and label noise")
    args = parser.parse_args(argv)
    for name, path in build_tiny_assets(args.out, args.seed).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
