"""Checks of stages.algorithms against the worked numbers of reference/algorithms.md and hand-computed values."""

import math

import pytest
import torch

from stages import algorithms as algo
from stages.rl import algorithms as rl_algo


def close(actual, expected, atol=1e-5):
    """Assert a tensor equals expected numbers (given as a list, float or tensor) to ``atol``."""
    expected = torch.as_tensor(expected, dtype=torch.float32)
    torch.testing.assert_close(actual.float(), expected, atol=atol, rtol=0)


def ragged_mask(lengths, total_len, left_pad=None):
    """[B, T] action mask with ``lengths`` ones per row, starting at ``left_pad`` (default 0)."""
    left_pad = left_pad or [0] * len(lengths)
    mask = torch.zeros(len(lengths), total_len, dtype=torch.bool)
    for row, (start, length) in enumerate(zip(left_pad, lengths)):
        mask[row, start : start + length] = True
    return mask


def perturb_masked(x, mask, scale=100.0, seed=1):
    """Copy of ``x`` with large random values written at positions where ``mask`` is not set."""
    noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)) * scale
    return torch.where(mask.bool(), x, noise)


# --------------------------------------------------------------------------------------------------------------
# KL
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, expected",
    [(0.1, {"k1": 0.1, "k2": 0.005, "k3": 0.0048374}), (-0.1, {"k1": -0.1, "k2": 0.005, "k3": 0.0051709})],
)
def test_kl_estimators_worked_numbers(d, expected):
    logp, ref_logp = torch.tensor([-1.0 + d]), torch.tensor([-1.0])
    for estimator, value in expected.items():
        close(rl_algo.compute_kl(logp, ref_logp, estimator), [value], atol=1e-6)


def test_kl_is_clamped_and_gradient_finite():
    logp = torch.tensor([50.0, -50.0, -200.0, 0.0], requires_grad=True)
    ref_logp = torch.zeros(4)
    close(rl_algo.compute_kl(logp, ref_logp, "k1"), [10.0, -10.0, -10.0, 0.0])
    close(rl_algo.compute_kl(logp, ref_logp, "k2"), [10.0, 10.0, 10.0, 0.0])
    k3 = rl_algo.compute_kl(logp, ref_logp, "k3")
    close(k3, [10.0, 10.0, 10.0, 0.0])
    k3.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_kl_computed_in_fp32_and_rejects_unknown_estimator():
    logp = torch.tensor([-1.0], dtype=torch.bfloat16)
    assert rl_algo.compute_kl(logp, logp, "k3").dtype == torch.float32
    with pytest.raises(ValueError, match="kl_estimator"):
        rl_algo.compute_kl(logp, logp, "k4")


def test_kl_penalized_rewards_puts_scalar_on_last_action_token():
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.4, 0.4, 0.4, 0.4], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 0, 0]])
    rewards = rl_algo.kl_penalized_rewards(torch.tensor([2.0, -1.0, 5.0]), kl, mask, beta=0.5)
    # A row without action tokens has nowhere to put its reward and stays all zero.
    close(rewards, [[-0.05, -0.1, 1.85, 0.0], [0.0, -0.2, -0.2, -1.2], [0.0, 0.0, 0.0, 0.0]])


def test_kl_penalized_rewards_ignores_masked_positions():
    torch.manual_seed(0)
    mask = ragged_mask([3, 6, 1], 6, left_pad=[2, 0, 4])
    kl, scalar = torch.randn(3, 6), torch.randn(3)
    expected = rl_algo.kl_penalized_rewards(scalar, kl, mask, beta=0.1)
    torch.testing.assert_close(rl_algo.kl_penalized_rewards(scalar, perturb_masked(kl, mask), mask, 0.1), expected)
    assert (expected[~mask] == 0).all()


def test_fixed_kl_controller_never_changes():
    controller = rl_algo.FixedKLController(0.05)
    controller.update(current_kl=100.0, n_steps=1000)
    assert controller.value == 0.05


def test_adaptive_kl_controller_update_numbers():
    controller = rl_algo.AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    # KL 9 over target 6: error 0.5 clipped to 0.2; beta *= 1 + 0.2 * 256 / 10000 = 1.00512.
    controller.update(current_kl=9.0, n_steps=256)
    assert controller.value == pytest.approx(0.100512, abs=1e-12)
    # KL 5.7: error -0.05 (inside the clip); beta *= 1 - 0.05 * 100 / 10000 = 0.9995.
    controller.update(current_kl=5.7, n_steps=100)
    assert controller.value == pytest.approx(0.100512 * 0.9995, abs=1e-12)
    # Far below target: error clipped at -0.2.
    controller.update(current_kl=0.0, n_steps=500)
    assert controller.value == pytest.approx(0.100512 * 0.9995 * 0.99, abs=1e-12)


# --------------------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------------------


def test_group_estimators_worked_numbers():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    close(rl_algo.group_advantages(rewards, 4, "group_norm"), [0.8660, -0.8660, -0.8660, 0.8660], atol=1e-4)
    close(rl_algo.group_advantages(rewards, 4, "rloo"), [0.6667, -0.6667, -0.6667, 0.6667], atol=1e-4)
    close(rl_algo.group_advantages(rewards, 4, "dr_grpo"), [0.5, -0.5, -0.5, 0.5])
    close(rl_algo.group_advantages(rewards, 4, "reinforce_baseline"), [0.5, -0.5, -0.5, 0.5])


def test_group_estimators_use_contiguous_groups_and_survive_equal_rewards():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 6.0, 3.0, 3.0, 3.0, 3.0])
    # Second group: mean 5.25, unbiased std 0.5; third group: all equal, so 0 rather than nan.
    close(
        rl_algo.group_advantages(rewards, 4, "group_norm"),
        [0.8660, -0.8660, -0.8660, 0.8660, -0.5, -0.5, -0.5, 1.5, 0, 0, 0, 0],
        atol=1e-4,
    )
    # Pairs (1, 0), (0, 1), (5, 5), (5, 6): n = 2 makes rloo R_i - R_other.
    close(rl_algo.group_advantages(rewards[:8], 2, "rloo"), [1, -1, -1, 1, 0, 0, -1, 1])


def test_group_estimators_reject_bad_group_sizes():
    with pytest.raises(ValueError, match="n_samples_per_prompt"):
        rl_algo.group_advantages(torch.zeros(6), 4, "group_norm")
    with pytest.raises(ValueError, match="n_samples_per_prompt >= 2"):
        rl_algo.group_advantages(torch.zeros(4), 1, "rloo")


@pytest.mark.parametrize("lambd, advantages, returns", [(0.95, [0.46575, 0.385, 0.3], [0.96575, 0.985, 1.0]),
                                                         (1.0, [0.5, 0.4, 0.3], [1.0, 1.0, 1.0])])
def test_gae_worked_numbers(lambd, advantages, returns):
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = rl_algo.gae_advantages_and_returns(rewards, values, torch.ones(1, 3), gamma=1.0, lambd=lambd)
    close(adv, [advantages])
    close(ret, [returns])


def test_gae_passes_over_padding_on_either_side_and_in_between():
    # The worked example embedded with padding left, right and inside; action positions must match it exactly.
    rewards = torch.tensor([[7.0, 0.0, 7.0, 0.0, 7.0, 1.0, 7.0]])
    values = torch.tensor([[9.0, 0.5, 9.0, 0.6, 9.0, 0.7, 9.0]])
    mask = torch.tensor([[0, 1, 0, 1, 0, 1, 0]])
    adv, ret = rl_algo.gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lambd=0.95)
    close(adv, [[0, 0.46575, 0, 0.385, 0, 0.3, 0]])
    close(ret, [[0, 0.96575, 0, 0.985, 0, 1.0, 0]])


def test_discounted_returns_with_gamma():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    close(rl_algo.discounted_returns(rewards, torch.tensor([[1, 1, 1, 0]]), gamma=0.5), [[1.5, 1.0, 2.0, 0.0]])


def test_normalize_advantages_population_variance_and_mean_only():
    advantages = torch.tensor([[1.0, 1.0, 50.0], [0.0, 0.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    # Mean 0.5, population variance 0.25 (the unbiased one, 1/3, would give +-0.866).
    close(rl_algo.normalize_advantages(advantages, mask), [[1, 1, 0], [-1, -1, 0]])
    close(rl_algo.normalize_advantages(advantages, mask, std_norm=False), [[0.5, 0.5, 0], [-0.5, -0.5, 0]])


def test_normalize_advantages_floors_variance():
    # All equal: variance 0 is floored at 1e-8, so the centred zeros stay zeros instead of nan.
    close(rl_algo.normalize_advantages(torch.full((2, 3), 4.0), torch.ones(2, 3)), torch.zeros(2, 3))


def test_compute_advantages_reinforce_normalises_over_batch_and_keeps_raw_returns():
    mask = torch.ones(2, 2)
    adv, ret = rl_algo.compute_advantages("reinforce", torch.tensor([1.0, 0.0]), mask, n_samples_per_prompt=1)
    close(ret, [[1, 1], [0, 0]])
    close(adv, [[1, 1], [-1, -1]])


def test_compute_advantages_reinforce_with_kl_in_reward():
    mask = torch.tensor([[1, 1, 1]])
    kl = torch.tensor([[0.2, 0.4, 0.6]])
    _, ret = rl_algo.compute_advantages("reinforce", torch.tensor([1.0]), mask, n_samples_per_prompt=1, kl=kl,
                                     beta=0.5, gamma=1.0)
    # Token rewards [-0.1, -0.2, -0.3 + 1]; returns are their suffix sums.
    close(ret, [[0.4, 0.5, 0.7]])


def test_compute_advantages_group_norm_broadcasts_to_action_tokens():
    mask = ragged_mask([3, 1, 4, 2], 4)
    adv, ret = rl_algo.compute_advantages("group_norm", torch.tensor([1.0, 0.0, 0.0, 1.0]), mask,
                                       n_samples_per_prompt=4, gamma=0.5)
    a = 0.8660254
    expected = [[a, a, a, 0], [-a, 0, 0, 0], [-a, -a, -a, -a], [a, a, 0, 0]]
    close(adv, expected)  # gamma is 1 for group estimators, and no batch normalisation
    close(ret, expected)


def test_group_norm_divides_by_the_group_std_even_with_no_advantage_std_norm():
    """OpenRLHF: group_norm is (R - mean) / (std + 1e-9) always; no_advantage_std_norm only reaches the batch
    whitening of gae, reinforce and reinforce_baseline."""
    mask = ragged_mask([1, 1, 1, 1], 1)
    adv, _ = rl_algo.compute_advantages("group_norm", torch.tensor([1.0, 0.0, 0.0, 1.0]), mask, n_samples_per_prompt=4,
                                     std_norm=False)
    close(adv[:, 0], [0.8660254, -0.8660254, -0.8660254, 0.8660254])
    # reinforce_baseline: group mean off, then the batch mean only: [3, 1 | 10, 12] -> [1, -1 | -1, 1].
    adv, _ = rl_algo.compute_advantages("reinforce_baseline", torch.tensor([3.0, 1.0, 10.0, 12.0]), mask,
                                     n_samples_per_prompt=2, std_norm=False)
    close(adv[:, 0], [1.0, -1.0, -1.0, 1.0])


def test_reward_clip_acts_after_the_group_baseline():
    """rloo over [30, 0, 0, 0], clip ±10: baselines 0, 10, 10, 10 -> [30, -10, -10, -10] -> [10, -10, -10, -10].
    Clipping first would give [10, 0, 0, 0] -> [10, -3.33, -3.33, -3.33]."""
    mask = ragged_mask([1, 1, 1, 1], 1)
    adv, _ = rl_algo.compute_advantages("rloo", torch.tensor([30.0, 0.0, 0.0, 0.0]), mask, n_samples_per_prompt=4,
                                     reward_clip_range=(-10.0, 10.0))
    close(adv[:, 0], [10.0, -10.0, -10.0, -10.0])


def test_sequence_kl_is_the_token_mean_of_each_sequence():
    """As OpenRLHF logs it and feeds --kl_target: [1, 2, 3] -> 2 and [4] -> 4, batch 3 (sums would give 5)."""
    kl = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    per_sequence = rl_algo.sequence_kl(kl, ragged_mask([3, 1], 4))
    close(per_sequence, [2.0, 4.0])
    assert float(per_sequence.mean()) == 3.0


def test_compute_advantages_rloo_and_dr_grpo_not_batch_normalised():
    mask = ragged_mask([2, 2, 2, 2], 2)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv, _ = rl_algo.compute_advantages("rloo", rewards, mask, n_samples_per_prompt=4)
    close(adv[:, 0], [2 / 3, -2 / 3, -2 / 3, 2 / 3])
    adv, _ = rl_algo.compute_advantages("dr_grpo", rewards, mask, n_samples_per_prompt=4)
    close(adv[:, 0], [0.5, -0.5, -0.5, 0.5])


def test_compute_advantages_reinforce_baseline_subtracts_group_mean_then_normalises():
    mask = ragged_mask([1, 1, 1, 1], 1)
    rewards = torch.tensor([3.0, 1.0, 10.0, 10.0])
    adv, ret = rl_algo.compute_advantages("reinforce_baseline", rewards, mask, n_samples_per_prompt=2)
    close(ret[:, 0], [1.0, -1.0, 0.0, 0.0])
    # Batch mean 0, population std sqrt(0.5).
    close(adv[:, 0], [math.sqrt(2), -math.sqrt(2), 0.0, 0.0])


def test_compute_advantages_gae_matches_worked_example_before_normalisation():
    mask = torch.ones(1, 3)
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = rl_algo.compute_advantages("gae", torch.tensor([1.0]), mask, n_samples_per_prompt=1, values=values,
                                       lambd=0.95, std_norm=False)
    close(ret, [[0.96575, 0.985, 1.0]])
    mean = (0.46575 + 0.385 + 0.3) / 3
    close(adv, [[0.46575 - mean, 0.385 - mean, 0.3 - mean]])


def test_compute_advantages_rejects_missing_inputs():
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="critic"):
        rl_algo.compute_advantages("gae", torch.ones(2), mask, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="advantage_estimator"):
        rl_algo.compute_advantages("ppo", torch.ones(2), mask, n_samples_per_prompt=1)
    with pytest.raises(ValueError, match="kl"):
        rl_algo.compute_advantages("reinforce", torch.ones(2), mask, n_samples_per_prompt=1, beta=0.1)


@pytest.mark.parametrize("estimator", rl_algo.ADVANTAGE_ESTIMATORS)
def test_compute_advantages_masked_positions_never_matter(estimator):
    torch.manual_seed(0)
    mask = ragged_mask([5, 2, 7, 1, 3, 6, 4, 7], 7, left_pad=[0, 3, 0, 6, 2, 1, 0, 0])
    scalar, kl, values = torch.randn(8), torch.randn(8, 7) * 0.1, torch.randn(8, 7)
    kwargs = dict(n_samples_per_prompt=4, beta=0.05, gamma=1.0, lambd=0.9)
    adv, ret = rl_algo.compute_advantages(estimator, scalar, mask, kl=kl, values=values, **kwargs)
    adv2, ret2 = rl_algo.compute_advantages(estimator, scalar, mask, kl=perturb_masked(kl, mask),
                                         values=perturb_masked(values, mask, seed=2), **kwargs)
    torch.testing.assert_close(adv2, adv)
    torch.testing.assert_close(ret2, ret)
    assert (adv[~mask] == 0).all() and (ret[~mask] == 0).all()
    assert adv[mask].abs().sum() > 0


# --------------------------------------------------------------------------------------------------------------
# Policy and value losses, aggregation
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "old_logp, logp, advantage, dual_clip, expected_loss, expected_clipped",
    [
        (-0.5, 0.0, 1.0, None, -1.2, 1.0),
        (-0.5, 0.0, -1.0, None, 1.6487, 0.0),
        (-0.5, 0.0, -1.0, 3.0, 1.6487, 0.0),
        (-2.0, 0.0, -1.0, 3.0, 3.0, 0.0),
        (0.0, -0.5, 1.0, None, -0.6065, 0.0),
        (0.0, -0.5, -1.0, None, 0.8, 1.0),
        # Dual clip leaves positive advantages alone; a ratio inside the clip range is not "clipped".
        (-0.5, 0.0, 1.0, 3.0, -1.2, 1.0),
        (-0.1, 0.0, 1.0, None, -1.10517, 0.0),
    ],
)
def test_policy_loss_worked_rows(old_logp, logp, advantage, dual_clip, expected_loss, expected_clipped):
    loss_t, clip_mask = rl_algo.policy_loss(torch.tensor([logp]), torch.tensor([old_logp]), torch.tensor([advantage]),
                                         eps_clip_low=0.2, eps_clip_high=0.2, dual_clip=dual_clip)
    close(loss_t, [expected_loss], atol=1e-4)
    close(clip_mask, [expected_clipped])


def test_policy_loss_without_dual_clip_is_unbounded_for_negative_advantage():
    loss_t, _ = rl_algo.policy_loss(torch.tensor([0.0]), torch.tensor([-2.0]), torch.tensor([-1.0]))
    close(loss_t, [math.exp(2.0)], atol=1e-4)


def test_policy_loss_asymmetric_clip():
    logp, old_logp = torch.tensor([0.0, 0.0, -0.5]), torch.tensor([-0.5, -0.5, 0.0])
    advantages = torch.tensor([1.0, -1.0, -1.0])
    loss_t, _ = rl_algo.policy_loss(logp, old_logp, advantages, eps_clip_low=0.2, eps_clip_high=0.28)
    close(loss_t, [-1.28, 1.6487, 0.8], atol=1e-4)
    loss_t, _ = rl_algo.policy_loss(logp, old_logp, advantages, eps_clip_low=0.5, eps_clip_high=0.28)
    close(loss_t[2:], [math.exp(-0.5)], atol=1e-4)


def test_policy_loss_clamps_log_ratio():
    loss_t, _ = rl_algo.policy_loss(torch.tensor([0.0, 0.0]), torch.tensor([-100.0, -100.0]), torch.tensor([1.0, -1.0]))
    assert torch.isfinite(loss_t).all()
    close(loss_t, [-1.2, math.exp(20.0)], atol=1.0)


def test_policy_loss_rejects_dual_clip_not_above_one():
    with pytest.raises(ValueError, match="dual_clip"):
        rl_algo.policy_loss(torch.zeros(1), torch.zeros(1), torch.ones(1), dual_clip=1.0)


def test_policy_and_value_loss_aggregates_ignore_masked_positions():
    torch.manual_seed(0)
    mask = ragged_mask([4, 1, 6, 3], 6, left_pad=[2, 0, 0, 1])
    logp, old_logp, adv = torch.randn(4, 6) * 0.3, torch.randn(4, 6) * 0.3, torch.randn(4, 6)
    values, old_values, returns = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6)

    def aggregates(logp, old_logp, adv, values, old_values, returns):
        loss_t, clip_mask = rl_algo.policy_loss(logp, old_logp, adv, dual_clip=3.0)
        return (algo.aggregate_token_loss(loss_t, mask), algo.masked_mean(clip_mask, mask),
                algo.aggregate_token_loss(rl_algo.value_loss(values, old_values, returns), mask))

    expected = aggregates(logp, old_logp, adv, values, old_values, returns)
    perturbed = aggregates(*(perturb_masked(x, mask, seed=i) for i, x in
                             enumerate([logp, old_logp, adv, values, old_values, returns])))
    for got, want in zip(perturbed, expected):
        torch.testing.assert_close(got, want)
    # Even inf/nan in padding must not leak into the aggregate.
    poisoned = torch.where(mask, torch.ones(4, 6), torch.tensor(float("nan")))
    close(algo.aggregate_token_loss(poisoned, mask), 1.0)


def test_value_loss_clip_numbers():
    values, old_values = torch.tensor([1.0, 1.0]), torch.tensor([0.0, 0.0])
    returns = torch.tensor([0.0, 2.0])
    # Clipped V = 0.5: row 1 max(0.25, 1) / 2; row 2 max(2.25, 1) / 2.
    close(rl_algo.value_loss(values, old_values, returns, value_clip=0.5), [0.5, 1.125])
    close(rl_algo.value_loss(values, old_values, returns, value_clip=None), [0.5, 0.5])


def test_masked_mean_per_row_and_empty_row():
    x = torch.tensor([[1.0, 3.0, 100.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]])
    close(algo.masked_mean(x, mask, dim=-1), [2.0, 0.0])
    close(algo.masked_sum(x, mask, dim=-1), [4.0, 0.0])
    close(algo.masked_mean(x, mask), 2.0)


def _micro_batch_setup():
    """A tiny 'policy' whose per-token log-probs depend on weights, plus ragged PPO inputs for 8 samples."""
    generator = torch.Generator().manual_seed(0)
    lengths = [1, 2, 3, 5, 8, 13, 2, 7]
    mask = ragged_mask(lengths, 13)
    features = torch.randn(8, 13, 4, generator=generator)
    old_logp = -torch.rand(8, 13, generator=generator)
    advantages = torch.randn(8, 13, generator=generator)
    weights = torch.randn(4, generator=generator) * 0.1
    return mask, features, old_logp, advantages, weights


def _accumulated_gradient(split_size, per_micro_batch_mean):
    mask, features, old_logp, advantages, initial_weights = _micro_batch_setup()
    weights = initial_weights.clone().requires_grad_(True)
    total_tokens = mask.sum()
    num_micro_batches = 8 // split_size
    for start in range(0, 8, split_size):
        rows = slice(start, start + split_size)
        logp = -torch.nn.functional.softplus(features[rows] @ weights)
        loss_t, _ = rl_algo.policy_loss(logp, old_logp[rows], advantages[rows])
        if per_micro_batch_mean:
            loss = algo.aggregate_token_loss(loss_t, mask[rows]) / num_micro_batches
        else:
            loss = algo.aggregate_token_loss(loss_t, mask[rows], num_tokens=total_tokens)
        loss.backward()
    return weights.grad


def test_global_token_mean_gradient_independent_of_micro_batch_split():
    one_by_eight = _accumulated_gradient(split_size=8, per_micro_batch_mean=False)
    eight_by_one = _accumulated_gradient(split_size=1, per_micro_batch_mean=False)
    torch.testing.assert_close(eight_by_one, one_by_eight, rtol=1e-5, atol=1e-7)
    # A mean per micro-batch weighs short sequences' tokens more once the step is split: the gradients differ.
    naive_eight_by_one = _accumulated_gradient(split_size=1, per_micro_batch_mean=True)
    assert not torch.allclose(naive_eight_by_one, one_by_eight, rtol=1e-3, atol=1e-5)


def test_aggregate_token_loss_divides_by_step_token_count():
    loss_t = torch.tensor([[1.0, 2.0, 3.0]])
    mask = torch.tensor([[1, 1, 0]])
    close(algo.aggregate_token_loss(loss_t, mask), 1.5)
    close(algo.aggregate_token_loss(loss_t, mask, num_tokens=6), 0.5)
    close(algo.aggregate_token_loss(loss_t, mask, num_tokens=torch.tensor(10)), 0.3)


# --------------------------------------------------------------------------------------------------------------
# Log-probs and entropy
# --------------------------------------------------------------------------------------------------------------


def test_token_log_probs_matches_log_softmax_and_is_fp32():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    got = algo.token_log_probs(logits, labels)
    assert got.dtype == torch.float32 and got.shape == (3, 5)
    close(got, expected.float())
    bf16 = algo.token_log_probs(logits.to(torch.bfloat16), labels)
    assert bf16.dtype == torch.float32
    close(bf16, expected.float(), atol=0.1)


def test_token_log_probs_gradient_flows():
    logits = torch.zeros(1, 1, 4, requires_grad=True)
    algo.token_log_probs(logits, torch.tensor([[2]])).sum().backward()
    # d log softmax_2 / d logits = onehot(2) - softmax = [-0.25, -0.25, 0.75, -0.25].
    close(logits.grad, [[[-0.25, -0.25, 0.75, -0.25]]])


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, -1e9, -1e9]]])
    # Uniform over 4: log 4; near one-hot: ~0; (0.75, 0.25): -(0.75 ln 0.75 + 0.25 ln 0.25).
    expected = [[math.log(4.0), 0.0, -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))]]
    entropy = algo.entropy_from_logits(logits)
    assert entropy.dtype == torch.float32
    close(entropy, expected)


def _unchunked_log_probs(logits, labels, temperature):
    """The unchunked computation (one float32 copy of each whole sequence's logits, divided by the temperature in
    float32)."""
    rows = []
    for row_logits, row_labels in zip(logits, labels.clamp(min=0).unsqueeze(-1)):
        row_logits = row_logits.float() / temperature
        rows.append(row_logits.gather(-1, row_labels).squeeze(-1) - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def _unchunked_entropy(logits, temperature):
    rows = []
    for row_logits in logits:
        row_logits = row_logits.float() / temperature
        probs = torch.softmax(row_logits, dim=-1)
        rows.append(torch.logsumexp(row_logits, dim=-1) - (probs * row_logits).sum(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 3, 64])
def test_chunked_log_probs_and_entropy_equal_the_unchunked_values_and_gradients(dtype, temperature, chunk):
    """Chunks of 1, 3 (not dividing the 7 positions) and more than the sequence; a padded batch's [:, :-1] view;
    an ignore-index label. Values within 1e-6, gradients (in the logits' dtype) within 1e-6 or one bf16 rounding."""
    generator = torch.Generator().manual_seed(3)
    full = (torch.randn(2, 8, 50, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, 50, (2, 7), generator=generator)
    labels[1, 6] = -100
    weights = torch.randn(2, 7, generator=generator)

    def run(log_probs, entropy):
        logits = full.clone().requires_grad_()
        view = logits[:, :-1]
        logp, ent = log_probs(view, labels), entropy(view)
        ((logp * weights).sum() + (ent * weights.flip(0)).sum()).backward()
        return logp, ent, logits.grad

    got = run(lambda x, y: algo.token_log_probs(x, y, temperature, chunk=chunk),
              lambda x: algo.entropy_from_logits(x, temperature, chunk=chunk))
    expected = run(lambda x, y: _unchunked_log_probs(x, y, temperature), lambda x: _unchunked_entropy(x, temperature))
    for name, a, b in zip(("log-probs", "entropy"), got[:2], expected[:2]):
        assert a.dtype == torch.float32, name
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0, msg=name)
    assert got[2].dtype == dtype
    torch.testing.assert_close(got[2].float(), expected[2].float(), atol=1e-6,
                               rtol=0 if dtype == torch.float32 else 2**-8)


def _peak_cpu_bytes(fn) -> int:
    """Peak bytes allocated through torch's CPU allocator while `fn` runs, above what was allocated before: every
    allocation and free the profiler records (profile_memory), kernels' internal temporaries included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak


def test_chunked_log_probs_and_entropy_peak_memory_stays_below_a_fraction_of_one_float32_copy_of_the_logits():
    """bf16 logits of one packed row, 4096 positions × 2048 vocabulary entries: one float32 copy is 32 MiB.
    Measured here (MiB above the inputs, no gradients / forward + backward beyond the leaf's clone and its bf16
    gradient, 16 MiB each): unchunked log-probs 80 / 112, entropy 112 / 208; in chunks of 128 positions (1 MiB of
    float32 each) log-probs 2.0 / 4.0, entropy 3.0 / 7.0. Bounds: an eighth of one copy without gradients, a third
    with them; the unchunked form must show at least two copies (so the measurement sees them)."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4096, 2048, generator=generator).to(torch.bfloat16)
    labels = torch.randint(0, 2048, (1, 4096), generator=generator)
    fp32_copy = logits.numel() * 4
    with torch.no_grad():
        assert _peak_cpu_bytes(lambda: _unchunked_log_probs(logits, labels, 1.0)) >= 2 * fp32_copy
        assert _peak_cpu_bytes(lambda: _unchunked_entropy(logits, 0.7)) >= 2 * fp32_copy
        for name, fn in (("log-probs", lambda: algo.token_log_probs(logits, labels, 0.7, chunk=128)),
                         ("entropy", lambda: algo.entropy_from_logits(logits, 0.7, chunk=128))):
            peak = _peak_cpu_bytes(fn)
            assert peak < fp32_copy / 8, (name, peak)

    def forward_backward(fn):
        leaf = logits.clone().requires_grad_()
        fn(leaf).sum().backward()

    leaf_and_grad = 2 * logits.numel() * 2
    unchunked = _peak_cpu_bytes(lambda: forward_backward(lambda x: _unchunked_log_probs(x, labels, 1.0)))
    assert unchunked >= leaf_and_grad + 2 * fp32_copy
    for name, fn in (("log-probs", lambda x: algo.token_log_probs(x, labels, 0.7, chunk=128)),
                     ("entropy", lambda x: algo.entropy_from_logits(x, 0.7, chunk=128))):
        peak = _peak_cpu_bytes(lambda: forward_backward(fn))
        assert peak < leaf_and_grad + fp32_copy / 3, (name, peak)


# --------------------------------------------------------------------------------------------------------------
# Reward model, DPO family, KTO
# --------------------------------------------------------------------------------------------------------------


def test_pairwise_rm_loss_values():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0])
    # (ln(1 + e^-1) + ln(1 + e^1)) / 2
    close(algo.pairwise_rm_loss(chosen, rejected), 0.81326169)
    # margin 0.5: (ln(1 + e^-0.5) + ln(1 + e^1.5)) / 2
    close(algo.pairwise_rm_loss(chosen, rejected, margin=torch.tensor([0.5, 0.5])), 1.08774513)
    close(algo.pairwise_rm_loss(chosen, rejected, kind="logexp"), 0.81326169)
    with pytest.raises(ValueError, match="margin"):
        algo.pairwise_rm_loss(chosen, rejected, margin=torch.zeros(2), kind="logexp")
    with pytest.raises(ValueError, match="sigmoid"):
        algo.pairwise_rm_loss(chosen, rejected, kind="hinge")


def test_pairwise_accuracy_counts_ties_as_wrong():
    close(algo.pairwise_accuracy(torch.tensor([2.0, 0.0, 1.0, 3.0]), torch.tensor([1.0, 1.0, 1.0, -3.0])), 0.5)


PREFERENCE_LOGPS = dict(policy_chosen=torch.tensor([-1.0]), policy_rejected=torch.tensor([-2.0]),
                        ref_chosen=torch.tensor([-1.5]), ref_rejected=torch.tensor([-1.5]))  # z = 1


def test_dpo_loss_and_implicit_rewards():
    loss, chosen_reward, rejected_reward = algo.preference_loss(**PREFERENCE_LOGPS, beta=0.1)
    close(loss, 0.64439666)  # ln(1 + e^-0.1)
    close(chosen_reward, [0.05])
    close(rejected_reward, [-0.05])


def test_conservative_dpo_loss():
    loss, _, _ = algo.preference_loss(**PREFERENCE_LOGPS, beta=0.1, label_smoothing=0.1)
    close(loss, 0.9 * 0.64439666 + 0.1 * 0.74439666)  # 0.1 * ln(1 + e^0.1) for the flipped label
    with pytest.raises(ValueError, match="label_smoothing"):
        algo.preference_loss(**PREFERENCE_LOGPS, beta=0.1, label_smoothing=0.7)


def test_ipo_loss():
    loss, _, _ = algo.preference_loss(**PREFERENCE_LOGPS, beta=0.1, ipo=True)
    close(loss, 16.0)  # (1 - 1 / 0.2)^2


def test_preference_loss_is_mean_over_batch_and_rewards_detached():
    policy_chosen = torch.tensor([-1.0, -3.0], requires_grad=True)
    loss, chosen_reward, _ = algo.preference_loss(policy_chosen, torch.tensor([-2.0, -3.0]),
                                                  torch.tensor([-1.5, -3.0]), torch.tensor([-1.5, -3.0]), beta=0.1)
    close(loss, (0.64439666 + math.log(2.0)) / 2)  # second pair: z = 0
    assert not chosen_reward.requires_grad
    loss.backward()
    assert policy_chosen.grad[0] < 0  # raising the chosen log-prob lowers the loss


def test_kto_loss_values():
    policy, ref = torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -1.5])
    desirable = torch.tensor([True, False])
    kl_estimate = algo.kto_kl_estimate(torch.tensor([-3.0, -3.0]), torch.tensor([-3.4, -3.2]))
    close(kl_estimate, 0.3)
    loss, chosen_rewards, rejected_rewards, z0 = algo.kto_loss(policy, ref, desirable, kl_estimate, beta=0.1,
                                                               desirable_weight=1.0, undesirable_weight=1.33)
    # desirable: 1 - sigmoid(0.1 * (0.5 - 0.3)); undesirable: 1.33 * (1 - sigmoid(0.1 * (0.3 + 0.5)))
    desirable_loss = 1 - 1 / (1 + math.exp(-0.02))
    undesirable_loss = 1.33 * (1 - 1 / (1 + math.exp(-0.08)))
    close(loss, (desirable_loss + undesirable_loss) / 2)
    close(z0, 0.3)
    close(chosen_rewards, [0.05])
    close(rejected_rewards, [-0.05])


def test_kto_reference_point_clamped_at_zero():
    policy, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    loss, _, _, z0 = algo.kto_loss(policy, ref, torch.tensor([True]), kl_estimate=-2.0, beta=0.1)
    close(z0, 0.0)
    close(loss, 1 - 1 / (1 + math.exp(-0.05)))


# --------------------------------------------------------------------------------------------------------------
# Length penalties
# --------------------------------------------------------------------------------------------------------------


def test_overlong_penalty():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    lengths = torch.tensor([70, 90, 100, 85])
    # expected length 80, buffer 20: excess -10 (none), 10, 20, 5
    close(rl_algo.overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_len=20, factor=1.0),
          [1.0, 0.5, 0.0, -0.25])
    close(rl_algo.overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_len=20, factor=2.0),
          [1.0, 0.0, -1.0, -0.5])
    with pytest.raises(ValueError, match="buffer"):
        rl_algo.overlong_penalty(rewards, lengths, max_new_tokens=100, buffer_len=0, factor=1.0)


def test_truncation_penalty():
    rewards = torch.tensor([1.0, 0.8, -0.4])
    truncated = torch.tensor([True, False, True])
    close(rl_algo.truncation_penalty(rewards, truncated, 0.5), [0.5, 0.8, -0.2])
    close(rl_algo.truncation_penalty(rewards, truncated, 0.0), [0.0, 0.8, 0.0])
    close(rl_algo.truncation_penalty(rewards, truncated, -1.0), [-1.0, 0.8, -1.0])
    with pytest.raises(ValueError, match="truncation"):
        rl_algo.truncation_penalty(rewards, truncated, 1.5)


def test_gspo_clips_one_ratio_per_sequence_and_averages_per_sequence():
    """Sequence 1: token log-ratios 0.1, 0.3 -> s = exp(0.2) = 1.2214, A = +1: clipped at 1.2 on both tokens.
    Sequence 2: one token, log-ratio -0.1 -> s = 0.9048, A = -1: unclipped, loss +0.9048.
    Step of 2 sequences: (-1.2 + 0.9048) / 2 = -0.1476; only sequence 2 has a gradient: s / 2 = 0.4524."""
    old = torch.zeros(2, 2)
    logp = torch.tensor([[0.1, 0.3], [-0.1, 5.0]], requires_grad=True)  # 5.0 is padding
    mask = ragged_mask([2, 1], 2)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    loss_t, clipped = rl_algo.gspo_policy_loss(logp, old, advantages, mask)
    close(loss_t * mask, [[-1.2, -1.2], [0.904837, 0.0]])
    close(clipped * mask, [[1.0, 1.0], [0.0, 0.0]])
    loss = rl_algo.aggregate_sequence_loss(loss_t, mask, num_sequences=2)
    close(loss, -0.147582)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [0.452419, 0.0]])


@pytest.mark.parametrize(
    "old_logp, logp, advantage, expected_loss, expected_grad, expected_clipped",
    [
        # ratio e^0.5 = 1.6487 -> w = 1.2; loss -1.2 * 1 * (-0.5) = 0.6; gradient -w * A = -1.2 (PPO's: 0, clipped).
        (-1.0, -0.5, 1.0, 0.6, -1.2, 1.0),
        # ratio e^-0.5 = 0.6065 -> w = 0.8; A = +1: loss 0.8, gradient -0.8.
        (-0.5, -1.0, 1.0, 0.8, -0.8, 1.0),
        # Same with A = -1: loss -0.8, gradient +0.8 (PPO's: 0, clipped at 0.8).
        (-0.5, -1.0, -1.0, -0.8, 0.8, 1.0),
        # ratio e^-0.1 = 0.904837 inside [0.8, 1.2]: w = ratio; loss 0.904837 * 1.1 = 0.995321, gradient -0.904837.
        (-1.0, -1.1, 1.0, 0.995321, -0.904837, 0.0),
    ],
)
def test_cispo_worked_rows(old_logp, logp, advantage, expected_loss, expected_grad, expected_clipped):
    logp_t = torch.tensor([logp], requires_grad=True)
    loss_t, clipped = rl_algo.cispo_policy_loss(logp_t, torch.tensor([old_logp]), torch.tensor([advantage]),
                                                eps_clip_low=0.2, eps_clip_high=0.2)
    close(loss_t, [expected_loss])
    close(clipped, [expected_clipped])
    loss_t.sum().backward()
    close(logp_t.grad, [expected_grad])


def test_cispo_keeps_the_gradient_ppo_clips_away_and_agrees_with_ppo_on_policy():
    """Where PPO's clip zeroes a token's gradient, CISPO keeps it scaled by the clipped weight; on-policy
    (logp == old_logp, w = 1) both give the policy gradient -A per token."""
    logp = torch.tensor([-0.5, -1.0], requires_grad=True)
    old, advantages = torch.tensor([-1.0, -1.0]), torch.tensor([1.0, 1.0])
    ppo_t, _ = rl_algo.policy_loss(logp, old, advantages)
    ppo_grad, = torch.autograd.grad(ppo_t.sum(), logp)
    cispo_t, _ = rl_algo.cispo_policy_loss(logp, old, advantages)
    cispo_grad, = torch.autograd.grad(cispo_t.sum(), logp)
    close(ppo_grad, [0.0, -1.0])
    close(cispo_grad, [-1.2, -1.0])
    # The weight carries no gradient: only the log-prob factor does. One-sided, as the paper: eps_low = 1.
    far = torch.tensor([-5.0], requires_grad=True)
    loss_t, clipped = rl_algo.cispo_policy_loss(far, torch.tensor([0.0]), torch.tensor([1.0]), 1.0, 4.0)
    loss_t.backward()
    close(far.grad, [-math.exp(-5.0)])
    close(clipped, [0.0])
    # Aggregated as PPO's loss: a global token mean, masked positions (even nan) change nothing.
    mask = torch.tensor([[1, 1, 0]])
    loss_t, _ = rl_algo.cispo_policy_loss(torch.tensor([[-0.5, -1.1, float("nan")]]), torch.tensor([[-1.0, -1.0, 0.0]]),
                                          torch.ones(1, 3))
    close(algo.aggregate_token_loss(loss_t, mask), (0.6 + 0.995321) / 2)


def test_ema_update_averages_in_place_from_the_initial_weights():
    """β = 0.9 from w0 = 1.0: after weights 2.0 then 4.0 the average is 0.9·1.1 + 0.1·4 = 1.39."""
    average = torch.tensor([1.0, -1.0])
    same = rl_algo.ema_update(average, torch.tensor([2.0, 0.0]), 0.9)
    assert same is average
    close(average, [1.1, -0.9])
    rl_algo.ema_update(average, torch.tensor([4.0, 1.0], dtype=torch.bfloat16), 0.9)
    close(average, [1.39, -0.71])
    assert average.dtype == torch.float32


@pytest.mark.parametrize("kind, weights, affected", [
    # Token ratios exp(old - rollout): [0.25, 1, 2, 8] and [8, 8, pad], thresholds [0.5, 5].
    ("tis", [[0.5, 1.0, 2.0, 5.0], [5.0, 5.0, 0.5, 0.5]], [[1, 0, 0, 1], [1, 1, 0, 0]]),
    ("icepop", [[0.0, 1.0, 2.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [[1, 0, 0, 1], [1, 1, 0, 0]]),
    # Geometric means: (0.25 * 1 * 2 * 8) ** (1/4) = 1.41 kept unclamped; 8 dropped whole.
    ("seq-mask-tis", [[0.25, 1.0, 2.0, 8.0], [0.0, 0.0, 0.0, 0.0]], [[0, 0, 0, 0], [1, 1, 0, 0]]),
])
def test_rollout_correction_worked_rows(kind, weights, affected):
    ratios = torch.tensor([[0.25, 1.0, 2.0, 8.0], [8.0, 8.0, 0.01, 0.01]])
    mask = torch.tensor([[1.0, 1, 1, 1], [1, 1, 0, 0]])
    rollout_logp = torch.full((2, 4), -1.5)
    got_weights, got_affected = rl_algo.rollout_correction(rollout_logp + ratios.log(), rollout_logp, mask, kind,
                                                        0.5, 5.0)
    torch.testing.assert_close(got_weights * mask, torch.tensor(weights) * mask)
    torch.testing.assert_close(got_affected, torch.tensor(affected, dtype=torch.float32))
    assert not got_weights.requires_grad


def test_logprob_gap_worked_numbers():
    """docs/algorithms.md: the engine's log-probs of its samples against the actor's, over the action tokens."""
    logp = torch.tensor([[-1.0, -2.0, -0.5]])
    rollout_logp = torch.tensor([[-1.1, -1.7, -0.5]])
    gap = rl_algo.logprob_gap(logp, rollout_logp, torch.tensor([[1.0, 1.0, 0.0]]))
    close(gap["abs_sum"] / 2, 0.2)
    close(gap["max"], 0.3)
    close(gap["k3_sum"] / 2, (0.0051709 + 0.0408182) / 2)
    same = rl_algo.logprob_gap(logp, logp, torch.ones(1, 3))
    assert float(same["abs_sum"]) == float(same["k3_sum"]) == float(same["max"]) == 0.0


def test_rollout_correction_is_one_where_the_trainer_agrees_with_the_engines():
    logp = torch.randn(3, 5, requires_grad=True)
    for kind in rl_algo.IS_CORRECTION_TYPES:
        weights, affected = rl_algo.rollout_correction(logp, logp.detach(), torch.ones(3, 5), kind, 0.5, 5.0)
        torch.testing.assert_close(weights, torch.ones(3, 5))
        assert float(affected.sum()) == 0


# --------------------------------------------------------------------------------------------------------------
# Where this project and OpenRLHF (v0.10.1, v0.11.0) differ on purpose: README's table, rows (a)-(f)
# --------------------------------------------------------------------------------------------------------------


def test_a_step_loss_is_one_token_mean_over_ragged_micro_batches_as_openrlhf_v0_11():
    """Four micro-batches of one sequence each, 1, 2, 3 and 4 tokens of losses 4, 3, 2, 1. Here (and OpenRLHF
    v0.11.0): (4 + 6 + 6 + 4) / 10 = 2.0, every token's gradient 1/10. v0.10.1 averages the micro-batches' own
    means: (4 + 3 + 2 + 1) / 4 = 2.5, a token's gradient 1/(4 n): 0.25, 0.125, 0.0833, 0.0625."""
    lengths, values = [1, 2, 3, 4], [4.0, 3.0, 2.0, 1.0]
    micro = [torch.full((1, n), v, requires_grad=True) for n, v in zip(lengths, values)]
    step_tokens = float(sum(lengths))
    loss = sum(algo.aggregate_token_loss(loss_t, torch.ones_like(loss_t), step_tokens) for loss_t in micro)
    close(loss, 2.0)
    loss.backward()
    for loss_t in micro:
        close(loss_t.grad, torch.full_like(loss_t, 0.1))
    per_micro_batch_means = sum(algo.masked_mean(t.detach(), torch.ones_like(t)) for t in micro) / len(micro)
    close(per_micro_batch_means, 2.5)


def test_b_masked_tokens_inside_a_response_are_not_steps_of_gae_or_returns():
    """r = [0, 0, 1], V = [0.5, 0.6, 0.7], mask [1, 0, 1] (an observation between two actions), gamma 1, lambda 0.95.
    Here the masked token is passed over: A_0 = (0.7 - 0.5) + 0.95 * 0.3 = 0.485. OpenRLHF (v0.10.1 and v0.11.0)
    zeroes its reward and value and keeps it as a step: A_1 = 0.7 + 0.95 * 0.3 = 0.985, A_0 = (0 - 0.5) + 0.95 *
    0.985 = 0.43575. Discounted returns (reinforce), gamma 0.5: here [0.5, 0, 1]; OpenRLHF [0.25, 0.5, 1]."""
    rewards, values = torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]])
    mask = torch.tensor([[1, 0, 1]])
    adv, ret = rl_algo.gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lambd=0.95)
    close(adv, [[0.485, 0.0, 0.3]])
    close(ret, [[0.985, 0.0, 1.0]])
    openrlhf_a0 = (0.0 - 0.5) + 0.95 * ((0.0 + 0.7 - 0.0) + 0.95 * 0.3)
    assert abs(openrlhf_a0 - 0.43575) < 1e-9
    close(rl_algo.discounted_returns(rewards, mask, gamma=0.5), [[0.5, 0.0, 1.0]])
    # With lambda = gamma = 1 the two agree: A_0 = 1 - 0.5 either way.
    adv, _ = rl_algo.gae_advantages_and_returns(rewards, values, mask, gamma=1.0, lambd=1.0)
    close(adv[:, 0], [0.5])


def test_c_ppo_log_ratio_is_clamped_at_20_as_openrlhf_v0_11():
    """log-ratio 25 with A = -1: ratio e^20 = 4.85165e8 (v0.10.1: e^25 = 7.2e10, gradient 7.2e10), and no
    gradient past the clamp; log-ratio 100: finite here and in v0.11.0, inf in v0.10.1."""
    logp = torch.tensor([0.0, 0.0], requires_grad=True)
    loss_t, _ = rl_algo.policy_loss(logp, torch.tensor([-25.0, -100.0]), torch.tensor([-1.0, -1.0]))
    close(loss_t, [math.exp(20.0), math.exp(20.0)], atol=1e3)
    loss_t.sum().backward()
    close(logp.grad, [0.0, 0.0])
    assert torch.isinf(torch.tensor(100.0).exp())  # v0.10.1: exp(100) in float32, the loss inf


def test_d_k3_gradient_is_zero_not_nan_far_below_the_clamp():
    """k3 = exp(-d) - 1 + d reaches the clamp of 10 at d = -2.61: below it the clamped value has no gradient.
    OpenRLHF (v0.10.1, v0.11.0) computes exp(-d) in float32, inf below d = -88.7, and its gradient there is
    0 * inf = nan. Here d is clamped to [-20, 20] first: d = -100 gives 10 with gradient 0; d = -3 gives 10 with
    gradient 0 in both; d = -2 gives e^2 - 3 = 4.389056 with gradient 1 - e^2 = -6.389056 in both."""
    logp = torch.tensor([-100.0, -3.0, -2.0], requires_grad=True)
    k3 = rl_algo.compute_kl(logp, torch.zeros(3), "k3")
    close(k3, [10.0, 10.0, math.exp(2.0) - 3.0])
    k3.sum().backward()
    close(logp.grad, [0.0, 0.0, 1.0 - math.exp(2.0)])
    unclamped = torch.tensor([-100.0], requires_grad=True)
    ((-unclamped).exp() - 1 + unclamped).clamp(-10, 10).sum().backward()  # OpenRLHF's computation
    assert torch.isnan(unclamped.grad).all()


def test_e_seq_mask_tis_weights_are_capped_at_e20():
    """Token log-ratios [30, -30] and [100, -100]: geometric mean 1, inside [0.5, 5], both sequences kept (the
    filter reads the uncapped log-ratios, as OpenRLHF). Weights here e^20 = 4.85165e8 and e^-20; OpenRLHF's
    (v0.10.1, v0.11.0) e^30 and e^-30, and inf and 0 for the second, whose loss is then inf or nan."""
    log_ratio = torch.tensor([[30.0, -30.0], [100.0, -100.0]])
    rollout_logp = torch.full((2, 2), -150.0)
    weights, affected = rl_algo.rollout_correction(rollout_logp + log_ratio, rollout_logp, torch.ones(2, 2),
                                                   "seq-mask-tis", 0.5, 5.0)
    torch.testing.assert_close(weights, torch.tensor([[math.exp(20.0), math.exp(-20.0)]] * 2), rtol=1e-5, atol=0)
    close(affected, [[0.0, 0.0], [0.0, 0.0]])
    # The filter on the uncapped log-ratios: [30, -10] has mean 10 (dropped); capped it would be 5, dropped too,
    # and [30, -18] mean 6 (dropped) where capping would give mean 1, e^1 = 2.7, kept.
    log_ratio = torch.tensor([[30.0, -18.0]])
    weights, affected = rl_algo.rollout_correction(-150.0 + log_ratio, torch.full((1, 2), -150.0),
                                                   torch.ones(1, 2), "seq-mask-tis", 0.5, 5.0)
    close(weights, [[0.0, 0.0]])
    close(affected, [[1.0, 1.0]])


def test_f_gspo_sequence_mean_skips_sequences_without_action_tokens_as_openrlhf_v0_11():
    """The gspo worked example with a third sequence that has no action token (an agent episode masked whole):
    its ratio is exp(0) on no token, it adds 0 and is not counted, so the step loss stays (-1.2 + 0.9048) / 2 =
    -0.147582 and the gradient 0.452419, as OpenRLHF v0.11.0 (v0.10.1: 0/0, the step's loss is nan)."""
    old = torch.zeros(3, 2)
    logp = torch.tensor([[0.1, 0.3], [-0.1, 5.0], [7.0, 7.0]], requires_grad=True)
    mask = ragged_mask([2, 1, 0], 2)
    advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [3.0, 3.0]])
    loss_t, _ = rl_algo.gspo_policy_loss(logp, old, advantages, mask)
    assert rl_algo.step_sequence_count(mask) == 2
    loss = rl_algo.aggregate_sequence_loss(loss_t, mask, rl_algo.step_sequence_count(mask))
    close(loss, -0.147582)
    loss.backward()
    close(logp.grad, [[0.0, 0.0], [0.452419, 0.0], [0.0, 0.0]])
    assert rl_algo.step_sequence_count(torch.zeros(2, 3)) == 0


# ---------------------------------------------------------------------------------------------------------------
# Evaluation: intervals and win rates (docs/algorithms.md)
# ---------------------------------------------------------------------------------------------------------------


def test_paired_gain_interval_worked_numbers():
    from stages.evaluate.algorithms import paired_gain

    # Differences 1,0,0,1,0: mean 0.4, s = sqrt(1.2 / 4) = 0.5477, half-width 1.96 · 0.5477 / sqrt(5) = 0.4801.
    mean, low, high = paired_gain(torch.tensor([1.0, 1, 0, 1, 0]), torch.tensor([0.0, 1, 0, 0, 0]))
    assert (mean, low, high) == pytest.approx((0.4, -0.0801, 0.8801), abs=1e-4)
    # Pairing: one model a constant 0.1 above the other on varied scores is a gain of exactly 0.1, no noise.
    scores = torch.tensor([0.3, -2.0, 1.5, 0.0])
    assert paired_gain(scores + 0.1, scores) == pytest.approx((0.1, 0.1, 0.1))


def test_win_rate_counts_ties_half_and_clips_its_interval():
    from stages.evaluate.algorithms import win_outcomes, win_rate

    candidate, baseline = torch.tensor([2.0, 0.5, 1.0, -1.0]), torch.tensor([1.0, 0.5, 2.0, -3.0])
    assert win_outcomes(candidate, baseline).tolist() == [1.0, 0.5, 0.0, 1.0]
    # Mean 0.625, s = sqrt(0.6875 / 3) = 0.4787, half-width 0.4691: [0.1559, 1.0941] clipped to [0.1559, 1].
    assert win_rate(candidate, baseline) == pytest.approx((0.625, 0.1559, 1.0), abs=1e-4)
    assert win_rate(baseline, baseline)[:1] == (0.5,)


def test_majority_vote_worked_numbers():
    """maj@k: the answer most samples give decides; samples without an answer abstain; a tie goes to the answer
    given first (docs/algorithms.md)."""
    from stages.evaluate.algorithms import majority_vote

    votes = [["7", "7", "8", None],  # 7 wins 2 to 1: the score of a 7
             ["8", "7", "7", "8"],  # 2 to 2: 8 came first
             [None, None, None, None],  # nobody answered
             ["5", None, None, None]]  # one vote is a majority
    scores = torch.tensor([[1.0, 1, 0, 0], [0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    assert majority_vote(votes, scores).tolist() == [1.0, 0.0, 0.0, 1.0]
    # maj@4 = 0.5 here where pass@4 (any sample right) is 0.75 and pass@1 (the mean) is 0.3125.
    assert float(majority_vote(votes, scores).mean()) == 0.5 and float(scores.max(dim=1).values.mean()) == 0.75


def test_final_answers_of_benchmark_solutions_and_of_responses():
    from stages.answers import gsm8k_label, is_correct, last_boxed, vote_key

    assert gsm8k_label("Natalia sold 48/2 = 24 clips.\n#### 1,072") == "1072"
    assert gsm8k_label("no marker here") is None and gsm8k_label("#### ") is None
    assert last_boxed("so $x = \\boxed{\\frac{1}{2}}$ and \\boxed{3}.") == "3"
    assert last_boxed("\\boxed{\\frac{a}{b}}") == "\\frac{a}{b}" and last_boxed("\\boxed{open") is None
    # Votes compare final answers as numbers where they are numbers: 1,234 and 1234.0 are one answer.
    assert vote_key("so the total is 1,234.") == vote_key("Answer: 1234.0") == "1234"
    assert vote_key("\\boxed{x^2 + 1}") == "x^2+1" and vote_key("I do not know") is None
    assert is_correct("The answer is \\boxed{\\dfrac{1}{2}}", "0.5") and not is_correct("Answer: 7", "8")


def test_intervals_refuse_what_they_cannot_tell():
    from stages.evaluate.algorithms import mean_interval, paired_gain

    with pytest.raises(ValueError, match="at least 2 prompts, got 1"):
        mean_interval(torch.tensor([1.0]))
    with pytest.raises(ValueError, match="differ in shape"):
        paired_gain(torch.ones(3), torch.ones(4))
