"""Ring attention (--ring_attn_size): the tokens of one packed micro-batch split over a group of ranks.

With `--ring_attn_size N`, N consecutive ranks form a ring: they read the same micro-batches, laid end to end in
one packed row (--packing_samples), and each runs the model on 1/N of the row's tokens, so activations per rank
shrink N-fold and a sequence longer than one GPU holds still trains. In every attention layer the ring all-gathers
the keys and values (the all-gather form of ring attention Llama 3 was trained with, which ring-flash-attn calls
`llama3`): each rank's queries attend to the keys of their own sequence up to their own position, whichever rank
holds them. `--ring_head_stride` key/value heads are gathered at a time, bounding the gathered tensors' memory.
The per-token results (log-probs, entropies, values) are all-gathered at the end, so every rank of the ring holds
the whole micro-batch's and computes the same loss; gradients flow back through both gathers.

Gradient scale: each rank of a ring computes the same loss, so the gathers' backward sums N equal contributions
and every rank's gradient is N times its tokens' share. DeepSpeed averages over all ranks (data-parallel groups x
ring): the result is the mean over data-parallel groups of the whole loss's gradient, as without a ring. Losses
normalised per step count data-parallel groups, not ranks (`stages.engine.global_loss_scale`).

The attention itself is torch's scaled_dot_product_attention with a block-causal mask (the packed row's sequence
ids), registered with transformers as the attention implementation `ring_sdpa`; outside a ring forward (padded
batches, generation) the implementation is plain sdpa.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

RING_ATTENTION = "ring_sdpa"


@dataclass
class Ring:
    """This rank's ring: its process group, its place in it, and the key/value heads gathered at a time."""

    group: object
    rank: int
    size: int
    head_stride: int


@cache
def ring_of(rank: int, world_size: int, size: int, head_stride: int) -> Ring | None:
    """This rank's ring of `size` consecutive ranks (None for size 1). Every rank creates every ring's group
    (torch.distributed requires it), once per process: roles sharing a rank process share the rings."""
    if size == 1:
        return None
    if world_size % size:
        raise ValueError(f"--ring_attn_size {size} must divide the {world_size} ranks of the model")
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = Ring(group, rank - start, size, head_stride)
    return mine


class _GatherTokens(torch.autograd.Function):
    """All-gather along a dimension in ring order; the backward sums the gradients of every rank's copy and
    returns this rank's slice."""

    @staticmethod
    def forward(ctx, local: Tensor, dim: int, ring: Ring) -> Tensor:
        ctx.dim, ctx.ring = dim, ring
        parts = [torch.empty_like(local) for _ in range(ring.size)]
        dist.all_gather(parts, local.contiguous(), group=ring.group)
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.ring.group)
        return grad.chunk(ctx.ring.size, ctx.dim)[ctx.ring.rank], None, None


def gather_tokens(local: Tensor, ring: Ring, dim: int = 0) -> Tensor:
    return _GatherTokens.apply(local, dim, ring)


@dataclass
class RingLayout:
    """What every attention layer of one ring forward needs: the ring, the sequence id of every token of the
    (padded) packed row, and where this rank's slice starts."""

    ring: Ring
    sequence_ids: Tensor  # [ring.size * local_len]; -1 for the padding that evens the slices
    start: int
    local_len: int
    _mask: Tensor | None = field(default=None, repr=False)

    def mask(self) -> Tensor:
        """[local_len, total] True where a query of this slice may attend: same sequence, not a later token."""
        if self._mask is None:
            ids = self.sequence_ids
            rows = torch.arange(self.start, self.start + self.local_len, device=ids.device)
            columns = torch.arange(ids.numel(), device=ids.device)
            self._mask = (ids[rows, None] == ids[None, :]) & (columns[None, :] <= rows[:, None])
        return self._mask


# The layout of the ring forward in progress. Passed to the attention layers as a keyword of the model's forward,
# which transformers hands to every attention call (and gradient checkpointing keeps for the recomputation).
LAYOUT_KEY = "ring_layout"


def ring_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                           **kwargs) -> tuple[Tensor, None]:
    """transformers' attention interface: query [1, heads, L, d], key/value [1, kv_heads, L, d] of this rank's
    slice; returns [1, L, heads, d]. Without a ring layout: plain sdpa."""
    layout: RingLayout | None = kwargs.pop(LAYOUT_KEY, None)
    if layout is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kv_heads, stride = key.shape[1], layout.ring.head_stride
    if kv_heads % stride:
        from stages.errors import StageInputError

        raise StageInputError(f"--ring_head_stride {stride} must divide the model's {kv_heads} key/value heads")
    per_kv = query.shape[1] // kv_heads
    outputs = []
    for head in range(0, kv_heads, stride):
        keys = gather_tokens(key[:, head : head + stride], layout.ring, dim=2)
        values = gather_tokens(value[:, head : head + stride], layout.ring, dim=2)
        outputs.append(F.scaled_dot_product_attention(
            query[:, head * per_kv : (head + stride) * per_kv], keys, values, attn_mask=layout.mask(),
            dropout_p=dropout, scale=scaling, enable_gqa=per_kv > 1))
    return torch.cat(outputs, dim=1).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make `ring_sdpa` an attention implementation transformers can load models with (sdpa's masks outside a
    ring forward)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(RING_ATTENTION, ring_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(RING_ATTENTION, sdpa_mask)


def per_token(run: Callable[[Tensor, Tensor, Tensor, dict], Tensor], input_ids: Tensor, position_ids: Tensor,
              ring: Ring | None) -> Tensor:
    """Per-token results [N, ...] of one forward over a packed row (input_ids, position_ids [1, N]).

    `run(input_ids, position_ids, next_ids, forward_kwargs)` runs the model on a slice of the row (passing
    `forward_kwargs` to it) and returns one result per token of the slice; `next_ids` are the tokens that follow
    (the labels of next-token log-probs; the last token of each sequence gets its successor's first, unused).
    Without a ring the slice is the whole row; with one, each rank runs 1/ring.size of it and the results are
    gathered.
    """
    next_ids = torch.roll(input_ids, -1, dims=1)
    if ring is None:
        return run(input_ids, position_ids, next_ids, {})
    total = input_ids.shape[1]
    local_len = -(-total // ring.size)
    padding = local_len * ring.size - total
    sequence_ids = torch.cumsum(position_ids[0] == 0, 0) - 1
    layout = RingLayout(ring, F.pad(sequence_ids, (0, padding), value=-1), ring.rank * local_len, local_len)
    part = slice(layout.start, layout.start + local_len)
    local = run(F.pad(input_ids, (0, padding))[:, part], F.pad(position_ids, (0, padding))[:, part],
                F.pad(next_ids, (0, padding))[:, part], {LAYOUT_KEY: layout})
    return gather_tokens(local, ring)[:total]
