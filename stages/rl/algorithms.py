"""RL's math as pure torch functions: KL estimators and controllers, returns and advantages, the actor's and
critic's losses, rollout corrections and length penalties. The reductions and log-probs it shares with the other
stages are stages/algorithms.py.

Everything here is computed in float32 whatever the input dtype, and takes an explicit action ``mask``
([B, T], 1 on response tokens) wherever padding exists: masked positions never change a result.
Formulas and worked numbers: docs/algorithms.md.
"""

from __future__ import annotations

import torch
from torch import Tensor

from stages.algorithms import masked_mean, masked_sum
from stages.rl.estimators import ADVANTAGE_ESTIMATORS, GLOBALLY_NORMALIZED_ESTIMATORS, GROUP_ESTIMATORS, KL_ESTIMATORS

KL_CLAMP = 10.0
LOG_RATIO_CLAMP = 20.0
GROUP_STD_EPS = 1e-9
BATCH_VAR_FLOOR = 1e-8


# ---------------------------------------------------------------------------------------------------------------
# KL: estimators, reward shaping, coefficient controllers
# ---------------------------------------------------------------------------------------------------------------


def compute_kl(logp: Tensor, ref_logp: Tensor, estimator: str = "k3") -> Tensor:
    """Per-token KL estimate of the policy from the reference, clamped to [-10, 10].

    With d = logp - ref_logp: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    # Every estimator already exceeds the final clamp at |d| = 20, so clamping d first changes no value but keeps
    # exp(-d) finite, which keeps the gradient of the clamped result free of inf * 0 = nan.
    log_ratio = (logp.float() - ref_logp.float()).clamp(-2 * KL_CLAMP, 2 * KL_CLAMP)
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = log_ratio.square() / 2
    else:
        kl = torch.exp(-log_ratio) - 1 + log_ratio
    return kl.clamp(-KL_CLAMP, KL_CLAMP)


def sequence_kl(kl: Tensor, mask: Tensor) -> Tensor:
    """Each sequence's KL as OpenRLHF logs it and feeds its KL controller: the mean over its action tokens, [B]."""
    return masked_mean(kl, mask, dim=-1)


def last_action_index(mask: Tensor) -> Tensor:
    """Index of the last set position of each row of ``mask`` ([B, T] -> [B]); 0 for an empty row."""
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return torch.where(mask.bool(), positions, -1).max(dim=-1).values.clamp(min=0)


def kl_penalized_rewards(scalar_reward: Tensor, kl: Tensor, mask: Tensor, beta: float) -> Tensor:
    """Token rewards r_t = -beta * kl_t on action tokens, plus the scalar reward on the last action token.

    [B], [B, T], [B, T] -> [B, T]; zero at masked positions.
    """
    action = mask.bool()
    rewards = torch.where(action, -beta * kl.float(), 0.0)
    # A row without action tokens has nowhere to put its reward: drop it rather than write into padding.
    final_reward = torch.where(action.any(dim=-1), scalar_reward.float(), 0.0)
    return rewards.scatter_add(1, last_action_index(action).unsqueeze(-1), final_reward.unsqueeze(-1))


class FixedKLController:
    """Constant KL coefficient (``--init_kl_coef``)."""

    def __init__(self, value: float):
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Keep the coefficient; same interface as AdaptiveKLController."""


class AdaptiveKLController:
    """Ziegler et al. (2019) proportional controller that steers the observed KL towards ``target``.

    e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon).
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float):
        if target <= 0 or horizon <= 0:
            raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got target={target}, horizon={horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Adjust the coefficient after a step that used ``n_steps`` samples and measured ``current_kl``."""
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


# ---------------------------------------------------------------------------------------------------------------
# Returns and advantages
# ---------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def gae_advantages_and_returns(
    rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lambd: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over action tokens, [B, T] each -> (advantages, returns), [B, T].

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last action token is 0), A_t = delta_t + gamma*lambd*A_{t+1},
    returns G_t = A_t + V_t. Masked positions are not steps: the recursion passes over them (so padding on either
    side, or masked tokens in between, change nothing) and they come out as 0.
    """
    rewards, values, action = rewards.float(), values.float(), mask.bool()
    next_value = rewards.new_zeros(rewards.shape[0])
    next_advantage = rewards.new_zeros(rewards.shape[0])
    advantages = []
    for t in reversed(range(rewards.shape[1])):
        is_action = action[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage_t = torch.where(is_action, delta + gamma * lambd * next_advantage, 0.0)
        advantages.append(advantage_t)
        next_value = torch.where(is_action, values[:, t], next_value)
        next_advantage = torch.where(is_action, advantage_t, next_advantage)
    advantages = torch.stack(advantages[::-1], dim=1)
    returns = torch.where(action, advantages + values, 0.0)
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t+1} over action tokens, [B, T] -> [B, T]; masked positions are skipped and give 0."""
    rewards, action = rewards.float(), mask.bool()
    next_return = rewards.new_zeros(rewards.shape[0])
    returns = []
    for t in reversed(range(rewards.shape[1])):
        is_action = action[:, t]
        return_t = torch.where(is_action, rewards[:, t] + gamma * next_return, 0.0)
        returns.append(return_t)
        next_return = torch.where(is_action, return_t, next_return)
    return torch.stack(returns[::-1], dim=1)


@torch.no_grad()
def group_advantages(rewards: Tensor, n_samples_per_prompt: int, estimator: str) -> Tensor:
    """Per-sample advantage from the other samples of the same prompt, [B] -> [B].

    The n samples of one prompt are contiguous. group_norm (GRPO): (R - mean) / (unbiased std + 1e-9), always (as
    in OpenRLHF, ``--no_advantage_std_norm`` does not reach the group); rloo: R_i - mean of the other n - 1;
    dr_grpo and reinforce_baseline: R - mean.
    """
    if estimator not in GROUP_ESTIMATORS:
        raise ValueError(f"advantage_estimator must be one of {GROUP_ESTIMATORS} here, got {estimator!r}")
    n = n_samples_per_prompt
    if n < 1 or rewards.numel() % n != 0:
        raise ValueError(f"n_samples_per_prompt={n} does not divide the {rewards.numel()} rewards into groups")
    if estimator in ("rloo", "group_norm") and n < 2:
        raise ValueError(f"advantage_estimator {estimator!r} needs n_samples_per_prompt >= 2, got {n}")
    groups = rewards.float().reshape(-1, n)
    group_mean = groups.mean(dim=-1, keepdim=True)
    if estimator == "rloo":
        leave_one_out_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (n - 1)
        advantages = groups - leave_one_out_mean
    elif estimator == "group_norm":
        advantages = (groups - group_mean) / (groups.std(dim=-1, keepdim=True, unbiased=True) + GROUP_STD_EPS)
    else:
        advantages = groups - group_mean
    return advantages.reshape(rewards.shape)


@torch.no_grad()
def normalize_advantages(advantages: Tensor, mask: Tensor, std_norm: bool = True) -> Tensor:
    """Whiten token advantages over every action token of the batch: (A - mean) / sqrt(max(var, 1e-8)).

    Population variance; only the mean is removed with ``std_norm=False``. Masked positions come out as 0.
    """
    action = mask.bool()
    mean = masked_mean(advantages, action)
    centered = torch.where(action, advantages.float() - mean, 0.0)
    if not std_norm:
        return centered
    variance = masked_mean(centered.square(), action)
    return centered * torch.rsqrt(variance.clamp(min=BATCH_VAR_FLOOR))


@torch.no_grad()
def compute_advantages(
    estimator: str,
    scalar_rewards: Tensor,
    mask: Tensor,
    *,
    n_samples_per_prompt: int,
    kl: Tensor | None = None,
    beta: float = 0.0,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 0.95,
    std_norm: bool = True,
    reward_clip_range: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """Token advantages and returns for one rollout batch, ([B, T], [B, T]); 0 at masked positions.

    ``scalar_rewards`` [B] are the (length-penalised) sequence rewards, ``kl`` [B, T] the per-token KL to the
    reference, used as reward shaping with coefficient ``beta`` (leave it None when the KL is in the loss).
    ``reward_clip_range`` clips the scalar reward after the group baseline and before the KL is added (OpenRLHF's
    compute_reward order).

    - gae: GAE over the shaped rewards with the critic's ``values``; returns = A + V.
    - reinforce: returns G = discounted sum of the shaped rewards; A = G.
    - group estimators (group_norm, rloo, dr_grpo, reinforce_baseline): the group advantage of each sample
      replaces its scalar reward, then A = G with gamma = 1 (gamma is ignored). Without KL shaping the advantage is
      the sample's group advantage at every action token.
    - gae, reinforce and reinforce_baseline advantages are then whitened over the whole batch
      (``std_norm=False``: mean only). Returns are never normalised.
    """
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage_estimator must be one of {ADVANTAGE_ESTIMATORS}, got {estimator!r}")
    if kl is None:
        if beta != 0.0:
            raise ValueError(f"a KL coefficient beta={beta} in the reward needs the per-token kl")
        kl = torch.zeros(mask.shape, device=mask.device)

    if estimator in GROUP_ESTIMATORS:
        scalar_rewards = group_advantages(scalar_rewards, n_samples_per_prompt, estimator)
        gamma = 1.0
    if reward_clip_range is not None:
        scalar_rewards = scalar_rewards.clamp(*reward_clip_range)
    token_rewards = kl_penalized_rewards(scalar_rewards, kl, mask, beta)

    if estimator == "gae":
        if values is None:
            raise ValueError("advantage_estimator 'gae' needs values from a critic")
        advantages, returns = gae_advantages_and_returns(token_rewards, values, mask, gamma, lambd)
    else:
        returns = discounted_returns(token_rewards, mask, gamma)
        advantages = returns

    if estimator in GLOBALLY_NORMALIZED_ESTIMATORS:
        advantages = normalize_advantages(advantages, mask, std_norm)
    return advantages, returns


# ---------------------------------------------------------------------------------------------------------------
# Actor and critic losses
# ---------------------------------------------------------------------------------------------------------------


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate per token -> (loss_t, clip_mask), both [B, T] float32; aggregate with the mask.

    ratio = exp(clamp(logp - old_logp, -20, 20)); s1 = ratio*A; s2 = clamp(ratio, 1 - eps_low, 1 + eps_high)*A;
    loss_t = -min(s1, s2), and with dual clip c > 1, for A < 0: -max(min(s1, s2), c*A).
    clip_mask is 1 where the clipped term was the smaller (s2 < s1); its masked mean is the clip fraction.
    """
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    advantages = advantages.float()
    ratio = torch.exp((logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    surrogate = ratio * advantages
    clipped_surrogate = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high) * advantages
    objective = torch.min(surrogate, clipped_surrogate)
    if dual_clip is not None:
        # Bounds the loss of a negative-advantage token whose ratio has grown far above 1.
        objective = torch.where(advantages < 0, torch.max(objective, dual_clip * advantages), objective)
    clip_mask = (clipped_surrogate < surrogate).float()
    return -objective, clip_mask


def gspo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, Tensor]:
    """GSPO's clipped surrogate: one importance ratio per sequence, s_i = exp(mean over its action tokens of
    logp - old_logp), on every action token; then the PPO clip as in policy_loss. -> (loss_t, clip_mask), [B, T].
    Aggregate with aggregate_sequence_loss."""
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    sequence_log_ratio = masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)
    return policy_loss(sequence_log_ratio.expand_as(log_ratio), torch.zeros_like(log_ratio), advantages,
                       eps_clip_low, eps_clip_high, dual_clip)


def cispo_policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1): the importance weight, clipped and detached, times the token's log-prob times its
    advantage -> (loss_t, clip_mask), [B, T] float32; aggregate with the mask (a token mean, as ppo).

    w = sg(clamp(exp(clamp(logp - old_logp, -20, 20)), 1 - eps_low, 1 + eps_high)); loss_t = -w * A * logp.
    Unlike PPO's clip no token loses its gradient: a clipped weight only scales it, d loss_t / d logp = -w * A.
    clip_mask is 1 where the weight was clamped. The paper bounds the weight from above only: give eps_low >= 1.
    """
    log_ratio = (logp.float() - old_logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio).detach()
    weight = ratio.clamp(1.0 - eps_clip_low, 1.0 + eps_clip_high)
    clip_mask = (weight != ratio).float()
    return -weight * advantages.float() * logp.float(), clip_mask


IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis")


def rollout_correction(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, kind: str, low: float,
                       high: float) -> tuple[Tensor, Tensor]:
    """Importance weights of the trainer's policy over the engines' (the policy that sampled) -> (weights,
    affected), both [B, T]: multiply the token losses by the weights (no gradient flows through them).

    r = exp(old_logp - rollout_logp) per token;
      tis:          w = clamp(r, low, high), affected where r was clamped;
      icepop:       w = r where low <= r <= high, else 0 (the token is dropped), affected where dropped;
      seq-mask-tis: a sequence whose geometric-mean ratio exp(mean of its log r) lies outside [low, high] is
                    dropped whole (as OpenRLHF); the others keep w = r, unclamped but for a cap at e^20 (OpenRLHF
                    has none), affected on dropped ones.
    """
    if kind not in IS_CORRECTION_TYPES:
        raise ValueError(f"unknown IS correction {kind!r}: one of {IS_CORRECTION_TYPES}")
    raw_log_ratio = (old_logp.float() - rollout_logp.float()).detach()
    # Capped at e^20 whatever the kind: tis and icepop thresholds lie far inside, and a seq-mask-tis weight of a
    # kept sequence stays finite (OpenRLHF's is inf from a log-ratio of 88.7 on).
    ratio = raw_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()
    if kind == "tis":
        return ratio.clamp(low, high), ((ratio < low) | (ratio > high)).float() * mask
    if kind == "icepop":
        kept = (ratio >= low) & (ratio <= high)
        return ratio * kept, (~kept).float() * mask
    sequence_ratio = masked_mean(raw_log_ratio, mask, dim=-1).exp()
    kept = ((sequence_ratio >= low) & (sequence_ratio <= high)).float().unsqueeze(-1)
    return ratio * kept, (1.0 - kept).expand_as(ratio) * mask


def logprob_gap(logp: Tensor, rollout_logp: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """How far the rollout engine's log-probs of the tokens it sampled are from the trainer's (same weights, other
    kernels): over the action tokens, the sum of |logp - rollout_logp|, the sum of the k3 estimate of
    KL(π_engine ‖ π_trainer) (the tokens were sampled by the engine: k3 = r - 1 - log r, r = π_trainer / π_engine),
    and the largest |logp - rollout_logp|. Sums, so that shares of one step add up over micro-batches and ranks."""
    diff = (logp.float() - rollout_logp.float()).detach().abs()
    k3 = compute_kl(rollout_logp.detach(), logp.detach(), "k3")
    return {"abs_sum": masked_sum(diff, mask), "k3_sum": masked_sum(k3, mask),
            "max": torch.where(mask.bool(), diff, 0.0).max() if mask.numel() else diff.new_zeros(())}


def step_sequence_count(mask: Tensor) -> int:
    """The sequences of a step that have action tokens, [B, T] -> int: what a sequence mean divides by.

    A sequence without one (an agent episode whose every step is masked) has no loss to average; counting it
    would shrink the others' weight. OpenRLHF v0.11 counts the same (v0.10.1's gspo loss is nan there)."""
    return int(mask.bool().any(dim=-1).sum())


def aggregate_sequence_loss(loss_t: Tensor, mask: Tensor, num_sequences: float) -> Tensor:
    """Sequence mean: each sequence's token-mean loss, summed, over the ``num_sequences`` of the whole optimizer
    step (every micro-batch on every rank; step_sequence_count: those with action tokens), so accumulation gives
    the same gradient however the step is split. A sequence without action tokens adds 0."""
    return masked_mean(loss_t, mask, dim=-1).sum() / max(float(num_sequences), 1.0)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float | None = 0.5) -> Tensor:
    """Critic loss per token, 0.5 * max((V_clipped - G)^2, (V - G)^2); plain 0.5 * (V - G)^2 without clip."""
    values, returns = values.float(), returns.float()
    unclipped = (values - returns).square()
    if value_clip is None:
        return 0.5 * unclipped
    old_values = old_values.float()
    values_clipped = old_values + (values - old_values).clamp(-value_clip, value_clip)
    return 0.5 * torch.max((values_clipped - returns).square(), unclipped)


def ema_update(average: Tensor, value: Tensor, beta: float) -> Tensor:
    """Exponential moving average of weights, in place: average <- beta * average + (1 - beta) * value
    (OpenRLHF's --enable_ema after each optimizer step, starting from the initial weights)."""
    return average.mul_(beta).add_(value.to(average.dtype), alpha=1.0 - beta)


# ---------------------------------------------------------------------------------------------------------------
# Length penalties on the scalar reward
# ---------------------------------------------------------------------------------------------------------------


def overlong_penalty(
    rewards: Tensor, response_lengths: Tensor, max_new_tokens: int, buffer_len: int, factor: float
) -> Tensor:
    """DAPO soft overlong penalty, [B] -> [B]: with e = min(len - (max_new_tokens - buffer), buffer),
    R - e / buffer * factor where e > 0, R otherwise."""
    if not 0 < buffer_len <= max_new_tokens:
        raise ValueError(f"overlong buffer length must be in (0, max_new_tokens={max_new_tokens}], got {buffer_len}")
    expected_len = max_new_tokens - buffer_len
    excess = (response_lengths.float() - expected_len).clamp(max=buffer_len)
    return rewards.float() - excess.clamp(min=0.0) / buffer_len * factor


def truncation_penalty(rewards: Tensor, truncated_mask: Tensor, coef: float) -> Tensor:
    """Reward for responses that did not stop properly, [B] -> [B]: coef * R for coef in [0, 1], coef itself for
    coef < 0; untruncated samples keep R."""
    if coef > 1.0:
        raise ValueError(f"truncation penalty coefficient must be <= 1, got {coef}")
    rewards = rewards.float()
    penalised = coef * rewards if coef >= 0 else torch.full_like(rewards, coef)
    return torch.where(truncated_mask.bool(), penalised, rewards)
