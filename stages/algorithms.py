"""The math every training stage shares, as pure torch functions: masked reductions, token-loss aggregation,
log-probs and entropy, and the pairwise losses of the reward model, DPO and KTO. RL's own math (KL, advantages,
policy and value losses) is stages/rl/algorithms.py.

Everything here is computed in float32 whatever the input dtype, and takes an explicit ``mask`` ([B, T], 1 on
trained tokens) wherever padding exists: masked positions never change a result.
Formulas and worked numbers: docs/algorithms.md.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# ---------------------------------------------------------------------------------------------------------------
# Masked reductions and loss aggregation
# ---------------------------------------------------------------------------------------------------------------


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` over positions where ``mask`` is set (over ``dim``, or everything)."""
    # torch.where rather than x * mask: a nan/inf at a padded position must not leak into the sum.
    kept = torch.where(mask.bool(), x.float(), 0.0)
    return kept.sum() if dim is None else kept.sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over masked positions; an empty selection gives 0 instead of nan."""
    count = mask.bool().sum() if dim is None else mask.bool().sum(dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def aggregate_token_loss(loss_t: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Global token mean: ``sum(loss_t * mask) / num_tokens``.

    ``num_tokens`` is the number of action tokens in the whole optimizer step (every micro-batch on every
    data-parallel rank). Accumulating this over micro-batches gives the same gradient however the step is split;
    a per-micro-batch mean would not with ragged lengths. ``None`` means this batch is the whole step.
    """
    if num_tokens is None:
        num_tokens = mask.bool().sum()
    if isinstance(num_tokens, Tensor):
        num_tokens = num_tokens.float().clamp(min=1.0)
    else:
        num_tokens = max(float(num_tokens), 1.0)
    return masked_sum(loss_t, mask) / num_tokens


def response_sums(token_log_probs: list[torch.Tensor], masks: list[list[int]]) -> torch.Tensor:
    """[B] sum of each sequence's response-token log-probs; masks are aligned with the inputs (token 0 has no
    log-prob, so they are shifted by one)."""
    return torch.stack([masked_sum(logp, torch.tensor(mask[1:], device=logp.device))
                        for logp, mask in zip(token_log_probs, masks)])


def response_means(token_log_probs: list[torch.Tensor], masks: list[list[int]]) -> torch.Tensor:
    """[B] mean response-token log-prob of each sequence."""
    return torch.stack([masked_mean(logp, torch.tensor(mask[1:], device=logp.device))
                        for logp, mask in zip(token_log_probs, masks)])


# ---------------------------------------------------------------------------------------------------------------
# Log-probabilities and entropy
# ---------------------------------------------------------------------------------------------------------------


def token_log_probs(logits: Tensor, labels: Tensor) -> Tensor:
    """log p(label) per position, [B, T, V] x [B, T] -> [B, T], in float32.

    Works one sequence at a time so that only a [T, V] float32 copy exists at once (bf16 logits of a large
    vocabulary would otherwise double in size). Negative labels (ignore index -100) are read at id 0: mask them.
    """
    safe_labels = labels.clamp(min=0).unsqueeze(-1)
    rows = []
    for row_logits, row_labels in zip(logits, safe_labels):
        row_logits = row_logits.float()
        label_logits = row_logits.gather(-1, row_labels).squeeze(-1)
        rows.append(label_logits - torch.logsumexp(row_logits, dim=-1))
    return torch.stack(rows)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution per position, [B, T, V] -> [B, T], in float32, one sequence at a time."""
    rows = []
    for row_logits in logits:
        row_logits = row_logits.float()
        probs = torch.softmax(row_logits, dim=-1)
        rows.append(torch.logsumexp(row_logits, dim=-1) - (probs * row_logits).sum(-1))
    return torch.stack(rows)


# ---------------------------------------------------------------------------------------------------------------
# Reward model, DPO family, KTO
# ---------------------------------------------------------------------------------------------------------------


def pairwise_rm_loss(chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, kind: str = "sigmoid") -> Tensor:
    """Mean Bradley-Terry loss over pairs of rewards [B].

    sigmoid: -log sigmoid(r_c - r_r - margin); logexp: log(1 + exp(r_r - r_c)) (no margin).
    """
    diff = chosen.float() - rejected.float()
    if kind == "sigmoid":
        if margin is not None:
            diff = diff - margin.float()
        return -F.logsigmoid(diff).mean()
    if kind == "logexp":
        if margin is not None:
            raise ValueError("a reward margin is only supported by the 'sigmoid' reward model loss")
        return F.softplus(-diff).mean()
    raise ValueError(f"reward model loss must be 'sigmoid' or 'logexp', got {kind!r}")


def pairwise_accuracy(chosen: Tensor, rejected: Tensor) -> Tensor:
    """Fraction of pairs whose chosen reward is strictly above the rejected one (ties count as wrong)."""
    return (chosen.float() > rejected.float()).float().mean()


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """DPO, conservative DPO or IPO on sequence log-probs [B] -> (mean loss, chosen_reward [B], rejected_reward [B]).

    z = (pi_c - pi_r) - (ref_c - ref_r). DPO/cDPO: -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z) with
    eps = ``label_smoothing``; IPO: (z - 1/(2 beta))^2 (label smoothing unused). The implicit rewards
    beta * (pi - ref) are detached; ``pairwise_accuracy`` of them is the preference accuracy.
    """
    if not 0.0 <= label_smoothing <= 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5], got {label_smoothing}")
    chosen_log_ratio = policy_chosen.float() - ref_chosen.float()
    rejected_log_ratio = policy_rejected.float() - ref_rejected.float()
    z = chosen_log_ratio - rejected_log_ratio
    if ipo:
        losses = (z - 1.0 / (2.0 * beta)).square()
    else:
        losses = -(1.0 - label_smoothing) * F.logsigmoid(beta * z) - label_smoothing * F.logsigmoid(-beta * z)
    return losses.mean(), beta * chosen_log_ratio.detach(), beta * rejected_log_ratio.detach()


def kto_kl_estimate(policy_mismatched_logps: Tensor, ref_mismatched_logps: Tensor) -> Tensor:
    """Local estimate of KL(policy || ref) from mismatched (prompt, other sample's response) pairs, detached.

    Average it over data-parallel ranks before passing it to ``kto_loss``, which clamps it at 0.
    """
    return (policy_mismatched_logps.float() - ref_mismatched_logps.float()).mean().detach()


def kto_loss(
    policy_logps: Tensor,
    ref_logps: Tensor,
    desirable: Tensor,
    kl_estimate: Tensor | float,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """KTO (Ethayarajh et al., 2024) on sequence log-probs [B] -> (mean loss, chosen_rewards, rejected_rewards, z0).

    z0 = max(kl_estimate, 0) is the reference point. With r = log pi - log ref, a desirable sample loses
    w_D * (1 - sigmoid(beta (r - z0))), an undesirable one w_U * (1 - sigmoid(beta (z0 - r))); the loss is their
    mean over the batch. chosen_rewards / rejected_rewards are beta * r (detached) of the desirable / undesirable
    samples, in batch order.
    """
    desirable = desirable.bool()
    log_ratio = policy_logps.float() - ref_logps.float()
    z0 = torch.as_tensor(kl_estimate, dtype=torch.float32, device=log_ratio.device).detach().clamp(min=0.0)
    desirable_losses = desirable_weight * (1.0 - torch.sigmoid(beta * (log_ratio - z0)))
    undesirable_losses = undesirable_weight * (1.0 - torch.sigmoid(beta * (z0 - log_ratio)))
    losses = torch.where(desirable, desirable_losses, undesirable_losses)
    rewards = beta * log_ratio.detach()
    return losses.mean(), rewards[desirable], rewards[~desirable], z0
