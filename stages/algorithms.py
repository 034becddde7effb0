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


# Positions per chunk: as many as keep one chunk's float32 copy of the logits at LOGITS_CHUNK_BYTES (256 MiB:
# 523 positions of Llama-3's 128256-entry vocabulary).
LOGITS_CHUNK_BYTES = 256 * 2**20


def logits_chunk_positions(vocab_size: int, chunk_bytes: int = LOGITS_CHUNK_BYTES) -> int:
    """Positions per chunk of the log-prob and entropy passes: one chunk's float32 logits fit in `chunk_bytes`."""
    return max(1, chunk_bytes // (4 * max(vocab_size, 1)))


def _label_log_probs(logits: Tensor, labels: Tensor | None) -> Tensor:
    """log p(label) of each row of a [n, V] chunk (already scaled and in float32)."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def _entropy(logits: Tensor, _labels: Tensor | None) -> Tensor:
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (probs * logits).sum(-1)


class _ChunkedRows(torch.autograd.Function):
    """`per_row(logits / temperature in float32, labels)` ([n, V] -> [n]) over [B, T, V] logits, a chunk of at most
    `chunk` positions of one sequence at a time, so that no float32 copy of the whole [B, T, V] (nor of one sequence's
    [T, V]) exists: forward and backward each hold one chunk's float32 copy and temporaries. Only the logits (in
    their own dtype) are kept for the backward, which recomputes each chunk's graph: the gradient is the one the
    unchunked autograd graph gives, chunk by chunk, written into one tensor of the logits' dtype."""

    @staticmethod
    def forward(ctx, per_row, logits: Tensor, labels: Tensor | None, temperature: float, chunk: int) -> Tensor:
        out = torch.empty(logits.shape[:-1], dtype=torch.float32, device=logits.device)
        for row in range(logits.shape[0]):
            for start in range(0, logits.shape[1], chunk):
                part = slice(start, start + chunk)
                out[row, part] = per_row(_scaled_float32(logits[row, part], temperature),
                                         None if labels is None else labels[row, part])
        ctx.per_row, ctx.temperature, ctx.chunk = per_row, temperature, chunk
        ctx.save_for_backward(logits, labels)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for row in range(logits.shape[0]):
            for start in range(0, logits.shape[1], ctx.chunk):
                part = slice(start, start + ctx.chunk)
                with torch.enable_grad():
                    piece = logits[row, part].detach().requires_grad_()
                    value = ctx.per_row(_scaled_float32(piece, ctx.temperature),
                                        None if labels is None else labels[row, part])
                    grad[row, part], = torch.autograd.grad(value, piece, grad_out[row, part])
        return None, grad, None, None, None


def _scaled_float32(logits: Tensor, temperature: float) -> Tensor:
    """`logits / temperature` in float32, divided after the cast: bf16 logits divided in bf16 lose up to 0.07 of a
    log-prob at temperature 0.7 (measured on a GPU: tests/test_gpu.py), and vLLM samples from float32 logits divided
    by the temperature. In place on the chunk's fresh float32 copy, never on float32 logits themselves."""
    scaled = logits.float()
    if temperature == 1.0:
        return scaled
    return scaled / temperature if scaled is logits else scaled.div_(temperature)


def token_log_probs(logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk: int | None = None) -> Tensor:
    """log p(label) per position of the distribution ``logits / temperature``, [B, T, V] x [B, T] -> [B, T], in
    float32.

    Chunked over positions (``chunk``, default logits_chunk_positions): only one chunk's float32 copy of the logits
    exists at a time, in the forward and in the backward (bf16 logits of a large vocabulary would otherwise double,
    with logsumexp's temporary triple, in size). Negative labels (ignore index -100) are read at id 0: mask them.
    """
    chunk = chunk or logits_chunk_positions(logits.shape[-1])
    return _ChunkedRows.apply(_label_log_probs, logits, labels.clamp(min=0), float(temperature), chunk)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk: int | None = None) -> Tensor:
    """Entropy of the softmax of ``logits / temperature`` per position, [B, T, V] -> [B, T], in float32, chunked
    over positions as token_log_probs."""
    chunk = chunk or logits_chunk_positions(logits.shape[-1])
    return _ChunkedRows.apply(_entropy, logits, None, float(temperature), chunk)


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
