"""Final answers of math responses and their comparison with a label, shared by the math reward
(configs/reward_funcs/math_answer.py) and the evaluation's `gsm8k` and `math` benchmarks.

Answers are compared by math-verify (the checker TRL and open-r1 use): it extracts the final answer (the last
\\boxed{...}, else the last LaTeX or plain expression) and compares with sympy, so 1/2 == \\frac{1}{2} == 0.5 and
x(x+2) == x^2+2x. Only where math-verify parses nothing from the label or the response does the comparison fall back
to text: the last \\boxed{...}, else what follows the last "Answer:", else the last number, compared after dropping
spaces, `$`, `\\left`/`\\right` and a trailing period, or as numbers. Labels are strings or numbers; a label in
GSM8K's form ("... #### 72") counts by its part after "####".
"""

from __future__ import annotations

import re
import threading

from math_verify import parse, verify

ANSWER = re.compile(r"Answer:\s*(.+)", re.IGNORECASE)
NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")
TIMEOUT_S = 5  # per parse and per comparison: sympy can take very long on adversarial expressions


def _timeout() -> int | None:
    # math-verify times out with SIGALRM, which exists only in the main thread.
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


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
    for noise in ("\\left", "\\right", "$", " ", "\\!", "\\,"):
        text = text.replace(noise, "")
    return text.rstrip(".").strip()


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def same_text_answer(answer: str, label: str) -> bool:
    a, b = _normal(answer), _normal(label)
    if a == b:
        return True
    x, y = _number(a), _number(b)
    return x is not None and y is not None and abs(x - y) < 1e-6


def is_correct(response: str, label: str) -> bool:
    label = str(label).split("####")[-1].strip()
    timeout = _timeout()
    gold = parse(label if "$" in label or "\\(" in label else f"${label}$", parsing_timeout=timeout)
    predicted = parse(response, parsing_timeout=timeout)
    if gold and predicted:
        return bool(verify(gold, predicted, timeout_seconds=timeout))
    answer = final_answer(response)
    return answer is not None and same_text_answer(answer, label)


def vote_key(response: str) -> str | None:
    """The response's final answer as majority voting compares it (spaces, `$`, commas of thousands dropped); None
    when it has none: such a sample does not vote."""
    answer = final_answer(response)
    if answer is None:
        return None
    normal = _normal(answer)
    number = _number(normal)
    return f"{number:g}" if number is not None else normal


def gsm8k_label(solution: str) -> str | None:
    """GSM8K's final answer: what follows the last "####" of its solution, thousands' commas dropped; None without
    one."""
    if "####" not in solution:
        return None
    label = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return label or None


def last_boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} of `text` (MATH's final answer in its solution); None without one."""
    return _last_boxed(text)
