"""The supervised step loop's pure parts: when a run counts as diverged, throughput."""

from __future__ import annotations

import math

import pytest

from stages.errors import StageInputError
from stages.trainer import NonFiniteLossError, stop_if_diverged, tokens_per_second


def test_a_non_finite_loss_or_gradient_norm_stops_naming_step_and_value():
    stop_if_diverged({"step": 3, "loss": 0.5, "grad_norm": 2.0})
    stop_if_diverged({"step": 3, "loss": 0.5})  # ZeRO-0 reports no gradient norm
    with pytest.raises(NonFiniteLossError, match=r"^loss is nan at step 3: training diverged"):
        stop_if_diverged({"step": 3, "loss": math.nan, "grad_norm": 1.0})
    with pytest.raises(NonFiniteLossError, match=r"^gradient norm is inf at step 7 \(loss 0\.6931\)"):
        stop_if_diverged({"step": 7, "loss": 0.693147, "grad_norm": math.inf})
    assert issubclass(NonFiniteLossError, StageInputError)  # exit code 2: a retry diverges again


def test_tokens_per_second_counts_forward_backward_and_optimizer_time():
    records = [{"tokens": 300.0, "time/forward_backward": 0.2, "time/optimizer": 0.1, "time/checkpoint": 5.0},
               {"tokens": 100.0, "time/forward_backward": 0.05, "time/optimizer": 0.05}]
    assert tokens_per_second(records) == 1000.0
    assert tokens_per_second([]) == 0.0
