"""Verifiable reward for math prompts (`--remote_rm_url configs/reward_funcs/math_answer.py`): 1.0 when the final
answer of the response equals the label, else 0.0.

Answers are compared by math-verify with a text fallback (stages/answers.py): 1/2 == \\frac{1}{2} == 0.5 and
x(x+2) == x^2+2x; a label in GSM8K's form ("... #### 72") counts by its part after "####".
"""

from __future__ import annotations

import sys
from pathlib import Path

# Loaded by path, this file may run where the project is not on sys.path.
_PROJECT_ROOT = str(Path(__file__).resolve().parents[2])
if _PROJECT_ROOT not in sys.path:
    sys.path.append(_PROJECT_ROOT)

from stages.answers import is_correct  # noqa: E402


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels, strict=True):
        response = query[len(prompt):] if query.startswith(prompt) else query
        rewards.append(1.0 if is_correct(response, label) else 0.0)
    return rewards
