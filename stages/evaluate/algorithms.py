"""The evaluation's statistics, as pure functions of per-prompt scores: the mean with its confidence interval, the
paired difference of two models answering the same prompts, the win rate of one model's answers over another's, and
the majority vote over sampled answers.

Every model answers the same held-out prompts, so differences are paired: the interval is that of the mean of the
per-prompt differences, much narrower than two independent intervals would be when the models agree on most prompts.
Intervals use the normal approximation, mean ± z·s/√n with s the sample standard deviation (n − 1): sound for the
hundreds of prompts a gate should ask for (`gate.min_prompts`), optimistic on a handful. Formulas and worked
numbers: docs/algorithms.md ("Evaluation: intervals and win rates").
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import Tensor

Z_95 = 1.959963984540054  # the standard normal's 97.5% quantile: a two-sided 95% interval


def mean_interval(values: Tensor, z: float = Z_95) -> tuple[float, float, float]:
    """(mean, low, high) of per-prompt `values`: mean ± z·s/√n. Needs two values at least (s is undefined below)."""
    values = values.double().flatten()
    n = values.numel()
    if n < 2:
        raise ValueError(f"an interval needs at least 2 prompts, got {n}")
    mean = float(values.mean())
    half = z * float(values.std(unbiased=True)) / math.sqrt(n)
    return mean, mean - half, mean + half


def paired_gain(candidate: Tensor, baseline: Tensor, z: float = Z_95) -> tuple[float, float, float]:
    """(mean, low, high) of candidate − baseline over the same prompts (scores in the same order)."""
    if candidate.shape != baseline.shape:
        raise ValueError(f"paired scores differ in shape: {tuple(candidate.shape)} vs {tuple(baseline.shape)}")
    return mean_interval(candidate.double() - baseline.double(), z)


def win_outcomes(candidate: Tensor, baseline: Tensor) -> Tensor:
    """Per prompt: 1 where the candidate's answer scores higher, 0.5 on a tie, 0 where it scores lower."""
    if candidate.shape != baseline.shape:
        raise ValueError(f"paired scores differ in shape: {tuple(candidate.shape)} vs {tuple(baseline.shape)}")
    return 0.5 + 0.5 * torch.sign(candidate.double() - baseline.double())


def win_rate(candidate: Tensor, baseline: Tensor, z: float = Z_95) -> tuple[float, float, float]:
    """(rate, low, high): how often the candidate's answer beats the baseline's on the same prompt, ties half; the
    interval clipped to [0, 1], where the normal approximation overshoots on few prompts."""
    rate, low, high = mean_interval(win_outcomes(candidate, baseline), z)
    return rate, max(0.0, low), min(1.0, high)


def majority_vote(votes: list[list[str | None]], scores: Tensor) -> Tensor:
    """Per prompt, the score of the answer most of its samples agree on (maj@k): `votes[i][j]` is the final answer of
    prompt i's sample j (None: it gave none and does not vote), `scores[i, j]` that sample's score. A tie goes to the
    answer given first; a prompt whose samples give no answer scores 0."""
    result = torch.zeros(len(votes), dtype=torch.float64)
    for i, answers in enumerate(votes):
        counts = Counter(answer for answer in answers if answer is not None)
        if counts:
            top = max(counts.values())
            first = next(j for j, answer in enumerate(answers) if answer is not None and counts[answer] == top)
            result[i] = float(scores[i, first])
    return result
