"""Does a rollout engine hold the actor's weights? The actor digests what it sends, every engine worker reads back
what it computes with, and the two are compared after a sync (`mismatches`). Pure torch: no vLLM, no Ray.

The digests survive what an engine does to the weights it loads: vLLM fuses q/k/v and gate/up into one matrix,
shards matrices over tensor-parallel workers, and on CPU packs linear weights into oneDNN's layout and keeps no
readable copy at all. So the engine is asked what its layers compute rather than what its tensors hold:
  - a matrix W: ||W x||², x a fixed N(0, 1) vector of W's input width (`probe_vector`). The engine runs its own
    linear layer on x (an embedding, which it holds as it is, is multiplied). A fused layer's output is its parts'
    outputs laid end to end and a column-parallel (or vocabulary-parallel) shard's output a slice of it, so squared
    norms add up over parts and shards; a row-parallel shard's output is a partial sum, which adds up as a vector
    first (`combine="vector"`). Scaled, zeroed, stale or half-loaded weights change it.
  - any other tensor (norms, biases): Σ|w| and Σw², which add up over shards and ignore layout.
Both are computed from the weights in the engine's dtype. The engine's numbers differ from the actor's only by its
kernels' rounding (`RTOL`). A permutation of rows within one weight is not seen; the probe batch's
log-probs, compared after the same sync (stages/rl/driver.py), are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

# Relative difference allowed between the engine's read-back and the actor's digest, by the engine's dtype: its
# matrix products round their outputs to it (measured on SmolLM2-135M: 2e-7 in float32, 5e-4 in bfloat16).
RTOL = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 1e-2}
# Mean absolute difference of the probe batch's token log-probs (temperature 1) between an engine and the actor
# that still counts as the same weights, by dtype: different kernels, same model. Measured on SmolLM2-135M (vLLM on
# CPU against transformers): float32 1e-5, bfloat16 0.05 (0.12 on the tiny model's QLoRA actor, whose 4-bit weights
# reach the engine merged); an engine whose fused layers were half loaded: 8 to 12 nats.
PROBE_TOLERANCE = {"float32": 0.05, "bfloat16": 0.5, "float16": 0.5}
_CHUNK_ELEMENTS = 1 << 24  # working copies stay under 128 MiB however large the tensor


def probe_vector(width: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """The fixed N(0, 1) input of every linear layer `width` wide, rounded to `dtype` (the engine computes in it)."""
    vector = torch.randn(width, generator=torch.Generator().manual_seed(width)).to(dtype)
    return vector if device is None else vector.to(device)


@dataclass(frozen=True)
class TensorDigest:
    """What the actor sent for one tensor, in the engine's dtype: ||W x||² of a matrix, (Σ|w|, Σw²) of the rest."""

    wx_sq: float | None = None
    abs_sum: float | None = None
    sq_sum: float | None = None


def digest(tensor: torch.Tensor, dtype: torch.dtype) -> TensorDigest:
    """The digest of `tensor` as the engine holds it (cast to `dtype`). A matrix is multiplied in float32 (exact
    products of bfloat16 values, sums good to 1e-6), a chunk of rows at a time to bound the float32 copy."""
    weight = tensor.detach().to(dtype)
    if weight.dim() == 2:
        x = probe_vector(weight.shape[1], dtype, weight.device).float()
        rows = max(1, _CHUNK_ELEMENTS // max(1, weight.shape[1]))
        return TensorDigest(wx_sq=sum(float((weight[start : start + rows].float() @ x).double().square().sum())
                                      for start in range(0, weight.shape[0], rows)))
    flat = weight.reshape(-1)
    abs_sum = sq_sum = 0.0
    for start in range(0, flat.numel(), _CHUNK_ELEMENTS):
        chunk = flat[start : start + _CHUNK_ELEMENTS].double()
        abs_sum += float(chunk.abs().sum())
        sq_sum += float(chunk.square().sum())
    return TensorDigest(abs_sum=abs_sum, sq_sum=sq_sum)


def with_tied_digests(sent: dict[str, TensorDigest], tied: dict[str, str]) -> dict[str, TensorDigest]:
    """`sent` and each tied tensor (an engine loads lm_head.weight from embed_tokens.weight) under its own name."""
    return {**sent, **{name: sent[source] for name, source in tied.items() if source in sent}}


Kind = Literal["wx", "moments"]
Combine = Literal["each", "sum", "vector"]


@dataclass(frozen=True)
class ReadBack:
    """One engine worker's reading of one of its tensors (or part of one).

    `covers` names the actor's tensors it holds, each with the number of times it is counted over the engine's
    workers (a key/value head replicated on several tensor-parallel workers). `combine` says how the readings of an
    engine's workers add up: "each" (replicated: every worker must match alone), "sum" (shards: values add),
    "vector" (a row-parallel layer's partial outputs: the vectors add, then the square norm is taken).
    """

    name: str
    covers: tuple[tuple[str, int], ...]
    kind: Kind
    value: tuple[float, ...] | torch.Tensor  # wx: (||y||²,) or, combined as "vector", y; moments: (Σ|w|, Σw²)
    combine: Combine = "each"


def reading_of(name: str, covers: tuple[tuple[str, int], ...], tensor: torch.Tensor,
               combine: Combine = "each") -> ReadBack:
    """A reading of a tensor an engine holds as it is (an embedding, a norm, a bias; every tensor of an HF
    engine): its digest, computed as the actor computes it."""
    held = digest(tensor, tensor.dtype)
    if held.wx_sq is not None:
        return ReadBack(name, covers, "wx", (held.wx_sq,), combine)
    return ReadBack(name, covers, "moments", (held.abs_sum, held.sq_sum), combine)


def _expected(kind: Kind, covers, sent: dict[str, TensorDigest]) -> tuple[float, ...] | None:
    """The sum of the covered tensors' digests of `kind`; None when one of them has no such digest (a matrix the
    engine holds as a vector: not comparable)."""
    digests = [(sent[name], times) for name, times in covers]
    if kind == "wx":
        if any(d.wx_sq is None for d, _ in digests):
            return None
        return (sum(times * d.wx_sq for d, times in digests),)
    if any(d.abs_sum is None for d, _ in digests):
        return None
    return (sum(times * d.abs_sum for d, times in digests), sum(times * d.sq_sum for d, times in digests))


def _measured(readings: list[ReadBack]) -> list[tuple[float, ...]]:
    first = readings[0]
    if first.combine == "each":
        return [tuple(float(v) for v in reading.value) for reading in readings]
    if first.combine == "sum":
        return [tuple(float(sum(values)) for values in zip(*(reading.value for reading in readings)))]
    vector = sum(reading.value.double() for reading in readings)
    return [(float(vector.square().sum()),)]


def mismatches(sent: dict[str, TensorDigest], workers: list[list[ReadBack]], rtol: float,
               tied: dict[str, str] | None = None) -> list[str]:
    """What one engine's workers read back that the actor did not send, one line per tensor, in the engine's order
    (empty when every reading matches). A tensor the actor never sent is a mismatch too. `tied`: {tied tensor: its
    source}, named beside it (the actor sends the source only; `sent` holds it under both names)."""
    tied = tied or {}
    readings: dict[tuple[str, str], list[ReadBack]] = {}
    for worker in workers:
        for reading in worker:
            readings.setdefault((reading.name, reading.kind), []).append(reading)
    problems = []
    for (name, kind), group in readings.items():
        covers = group[0].covers
        unsent = [cover for cover, _ in covers if cover not in sent]
        if unsent:
            problems.append(f"{name} holds {', '.join(unsent)}, which the actor did not send")
            continue
        expected = _expected(kind, covers, sent)
        if expected is None:
            problems.append(f"{name} holds {', '.join(c for c, _ in covers)} in another shape than the actor sent")
            continue
        for worker, measured in enumerate(_measured(group)):
            if all(abs(m - e) <= rtol * abs(e) + 1e-12 for m, e in zip(measured, expected)):
                continue
            what = "||W x||²" if kind == "wx" else "(Σ|w|, Σw²)"
            where = f" on worker {worker}" if len(group) > 1 and group[0].combine == "each" else ""
            shown = [f"{cover}, tied to {tied[cover]}" if cover in tied else cover for cover, _ in covers]
            parts = f" ({', '.join(shown)})" if shown != [name] else ""
            problems.append(f"{name}{parts}{where}: {what} {_fmt(measured)}, the actor sent {_fmt(expected)}")
    return problems


def _fmt(values: tuple[float, ...]) -> str:
    return ", ".join(f"{value:.6g}" for value in values)
