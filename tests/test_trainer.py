"""The step loop's pure parts: when a run counts as diverged (every training stage and RL), throughput."""

from __future__ import annotations

import math

import pytest

from stages.errors import StageInputError
from stages.engine import NonFiniteLossError, commit_checkpoint, stop_if_diverged
from stages.trainer import tokens_per_second


def test_a_non_finite_loss_or_gradient_norm_stops_naming_step_value_and_the_last_checkpoint(tmp_path):
    keys = ("loss", "grad_norm")
    stop_if_diverged({"loss": 0.5, "grad_norm": 2.0}, 3, keys, None)
    stop_if_diverged({"loss": 0.5}, 3, keys, None)  # ZeRO-0 reports no gradient norm
    stop_if_diverged({"loss": 0.5, "grad_norm": None, "eval_loss": math.nan}, 3, keys, None)  # only the step's keys
    with pytest.raises(NonFiniteLossError, match=r"^step 3: loss=nan is not finite: training diverged.*no checkpoint"):
        stop_if_diverged({"loss": math.nan, "grad_norm": 1.0}, 3, keys, str(tmp_path))
    with pytest.raises(NonFiniteLossError, match=r"^step 7: grad_norm=inf is not finite"):
        stop_if_diverged({"loss": 0.693147, "grad_norm": math.inf}, 7, keys, None)
    commit_checkpoint(tmp_path, 5, max_keep=2)
    with pytest.raises(NonFiniteLossError, match=r"^step 7: policy_loss=nan is not finite.*step 5, is kept"):
        stop_if_diverged({"policy_loss": math.nan, "critic_loss": 0.2}, 7, ("policy_loss", "critic_loss"),
                         str(tmp_path))
    assert issubclass(NonFiniteLossError, StageInputError)  # exit code 2: a retry diverges again


def test_tokens_per_second_counts_forward_backward_and_optimizer_time():
    records = [{"tokens": 300.0, "time/forward_backward": 0.2, "time/optimizer": 0.1, "time/checkpoint": 5.0},
               {"tokens": 100.0, "time/forward_backward": 0.05, "time/optimizer": 0.05}]
    assert tokens_per_second(records) == 1000.0
    assert tokens_per_second([]) == 0.0
