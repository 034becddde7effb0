"""Forward passes over lists of token sequences, padded or packed, for every stage that scores sequences.

Packing (`--packing_samples`) puts all sequences of a micro-batch into one row without padding. The position ids
restart at 0 for each sequence; with no attention mask, transformers reads those restarts as sequence boundaries
and keeps attention inside each sequence (a block-diagonal causal mask with sdpa/eager, the variable-length kernel
with FlashAttention-2). The results equal the padded forward's up to float rounding (tests/test_packing.py: 1e-5).

Every function takes a model (an HF model, a PEFT model or a DeepSpeed engine around either) and a list of token
id lists, and returns one tensor per sequence, in order:

    sequence_log_probs(model, seqs, pad_token_id=pad, packing=True)  # [len(seq) - 1] next-token log-probs each
    sequence_values(value_model, seqs, pad_token_id=pad, packing=True)  # [len(seq)] value-head outputs each
    last_token_values(value_model, seqs, pad_token_id=pad, packing=True)  # [B] reward at each last token

`packed_log_probs` / `packed_values` are the single padding-free forwards behind `packing=True`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from stages import algorithms as algo
from stages import ring_attention
from stages.sequences import pad_sequences


def model_device(model) -> torch.device:
    return next(getattr(model, "module", model).parameters()).device


def pack(sequences: list[list[int]], device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, list[int]]:
    """(input_ids [1, N], position_ids [1, N], start offset of each sequence) of the sequences laid end to end."""
    if not sequences or any(len(seq) == 0 for seq in sequences):
        raise ValueError("packing needs at least one sequence and no empty ones")
    input_ids = torch.tensor([token for seq in sequences for token in seq], dtype=torch.long, device=device)
    position_ids = torch.cat([torch.arange(len(seq), device=device) for seq in sequences])
    starts = [0]
    for seq in sequences[:-1]:
        starts.append(starts[-1] + len(seq))
    return input_ids.unsqueeze(0), position_ids.unsqueeze(0), starts


def _padded(sequences: list[list[int]], pad_token_id: int, device) -> tuple[Tensor, Tensor]:
    input_ids, attention_mask = pad_sequences(sequences, pad_token_id)
    return input_ids.to(device), attention_mask.to(device)


def packed_log_probs(model, sequences: list[list[int]], temperature: float = 1.0, ring=None) -> list[Tensor]:
    """One padding-free forward; log p(token t+1 | tokens <= t) of each sequence, [len(seq) - 1] each, fp32.

    Keeps the autograd graph (use it for training as well as under torch.no_grad()). With a `ring`
    (--ring_attn_size) the ranks of the ring each run a slice of the row (stages/ring_attention.py).
    """
    input_ids, position_ids, starts = pack(sequences, model_device(model))

    def run(ids: Tensor, positions: Tensor, next_ids: Tensor, forward_kwargs: dict) -> Tensor:
        logits = model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs).logits
        return algo.token_log_probs(logits, next_ids, temperature)[0]

    token_logp = ring_attention.per_token(run, input_ids, position_ids, ring)
    return [token_logp[start : start + len(seq) - 1] for start, seq in zip(starts, sequences)]


def padded_log_probs(model, sequences: list[list[int]], pad_token_id: int, temperature: float = 1.0) -> list[Tensor]:
    """The same log-probs from one right-padded batch."""
    input_ids, attention_mask = _padded(sequences, pad_token_id, model_device(model))
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1]
    token_logp = algo.token_log_probs(logits, input_ids[:, 1:], temperature)
    return [token_logp[row, : len(seq) - 1] for row, seq in enumerate(sequences)]


def sequence_log_probs(model, sequences: list[list[int]], *, pad_token_id: int, packing: bool,
                       temperature: float = 1.0, ring=None) -> list[Tensor]:
    """Next-token log-probs of each sequence, packed (over the `ring`'s ranks, if any) or padded."""
    if packing:
        return packed_log_probs(model, sequences, temperature, ring)
    return padded_log_probs(model, sequences, pad_token_id, temperature)


def value_head(model) -> torch.nn.Module:
    """The scalar head of a value model (reward model, critic): `score` of an AutoModelForSequenceClassification,
    inside a DeepSpeed engine and/or PEFT wrapper (PEFT's trainable copy of it, with LoRA)."""
    module = getattr(model, "module", model)
    hf_model = module.get_base_model() if hasattr(module, "get_base_model") else module
    head = getattr(hf_model, "score", None)
    if head is None:
        raise ValueError(f"{type(hf_model).__name__} has no `score` head: not a value model")
    return head


@contextmanager
def _captured_output(module: torch.nn.Module) -> Iterator[list[Tensor]]:
    captured: list[Tensor] = []
    handle = module.register_forward_hook(lambda _module, _inputs, output: captured.append(output))
    try:
        yield captured
    finally:
        handle.remove()


def packed_values(model, sequences: list[list[int]], ring=None) -> list[Tensor]:
    """One padding-free forward of a value model; its head's output at every token, [len(seq)] each, fp32.

    The whole model runs (so DeepSpeed's ZeRO-3 hooks fetch every weight); the head's per-token output is read
    with a forward hook, before the model pools it. With a `ring`, over the ring's ranks as packed_log_probs.
    """
    input_ids, position_ids, starts = pack(sequences, model_device(model))

    def run(ids: Tensor, positions: Tensor, _next_ids: Tensor, forward_kwargs: dict) -> Tensor:
        with _captured_output(value_head(model)) as captured:
            model(input_ids=ids, position_ids=positions, use_cache=False, **forward_kwargs)
        return captured[-1][0, :, 0].float()

    values = ring_attention.per_token(run, input_ids, position_ids, ring)
    return [values[start : start + len(seq)] for start, seq in zip(starts, sequences)]


def padded_values(model, sequences: list[list[int]], pad_token_id: int) -> list[Tensor]:
    input_ids, attention_mask = _padded(sequences, pad_token_id, model_device(model))
    with _captured_output(value_head(model)) as captured:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    values = captured[-1][..., 0].float()
    return [values[row, : len(seq)] for row, seq in enumerate(sequences)]


def sequence_values(model, sequences: list[list[int]], *, pad_token_id: int, packing: bool,
                    ring=None) -> list[Tensor]:
    """Value-head output at every token of each sequence, packed (over the `ring`'s ranks, if any) or padded."""
    if packing:
        return packed_values(model, sequences, ring)
    return padded_values(model, sequences, pad_token_id)


def last_token_values(model, sequences: list[list[int]], *, pad_token_id: int, packing: bool,
                      ring=None) -> Tensor:
    """[B] value-head output at the last token of each sequence: the reward of a reward model.

    The last token is found from each sequence's length, not from pad ids, so a pad token equal to eos (a common
    fallback) does not move it.
    """
    values = sequence_values(model, sequences, pad_token_id=pad_token_id, packing=packing, ring=ring)
    return torch.stack([value[-1] for value in values])
