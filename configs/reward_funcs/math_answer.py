"""Verifiable reward for math prompts (`--remote_rm_url configs/reward_funcs/math_answer.py`): 1.0 when the final
answer of the response equals the label, else 0.0.

The final answer is the content of the last \\boxed{...}, else what follows the last "Answer:", else the last
number in the response. Answers compare equal after dropping spaces, `$`, `\\left`/`\\right` and a trailing period,
or as numbers (3 == 3.0 == 3.00). Labels are strings or numbers; a label in GSM8K's form ("... #### 72") counts by
its part after "####".
"""

from __future__ import annotations

import re

ANSWER = re.compile(r"Answer:\s*(.+)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(response: str) -> str | None:
    boxed = _last_boxed(response)
    if boxed is not None:
        return boxed
    answers = ANSWER.findall(response)
    if answers:
        return answers[-1].splitlines()[0]
    numbers = NUMBER.findall(response)
    return numbers[-1] if numbers else None


def _normal(text: str) -> str:
    text = str(text).split("####")[-1]
    for noise in ("\\left", "\\right", "$", " ", "\\!", "\\,"):
        text = text.replace(noise, "")
    return text.rstrip(".").strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def same_answer(answer: str, label: str) -> bool:
    a, b = _normal(answer), _normal(label)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    return x is not None and y is not None and abs(x - y) < 1e-6


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        response = query[len(prompt):] if query.startswith(prompt) else query
        answer = final_answer(response)
        rewards.append(1.0 if answer is not None and same_answer(answer, label) else 0.0)
    return rewards
