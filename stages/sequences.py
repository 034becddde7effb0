"""Token sequences as batches: padding, prompt + response sequences of RL and evaluation, splits over ranks.

Light on purpose (torch only): rank and engine processes import it without the dataset libraries.
"""

from __future__ import annotations

import torch


def build_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int,
                    response_masks: list[list[int] | None] | None = None) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response sequences; action_mask[t] marks positions whose next token is a response
    token (aligned with next-token log-probs and values, which have length T-1), or with `response_masks` (an
    agent's episodes) a response token of the model's own, not the environment's."""
    input_ids, attention_mask = pad_sequences([p + r for p, r in zip(prompt_ids, response_ids)], pad_id)
    action_mask = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        own = response_masks[i] if response_masks is not None and response_masks[i] is not None else [1.0] * len(r)
        action_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = torch.tensor(own, dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask}


def chunks(items: list, size: int) -> list[list]:
    """Consecutive slices of `items` of `size` (the last one shorter)."""
    return [items[i : i + size] for i in range(0, len(items), size)]


def split_rows(tensors: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous, equal-as-possible row slices, one per rank."""
    rows = next(iter(tensors.values())).shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i] : bounds[i + 1]] for k, v in tensors.items()} for i in range(parts)]


def micro_batches(tensors: dict[str, torch.Tensor], size: int, device) -> list[dict[str, torch.Tensor]]:
    """Row slices of `size` moved to `device`."""
    rows = next(iter(tensors.values())).shape[0]
    return [{k: v[start : start + size].to(device) for k, v in tensors.items()} for start in range(0, rows, size)]


def pad_sequences(seqs: list[list[int]], pad_token_id: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of token sequences padded to the longest one."""
    return pad_batch(seqs, pad_token_id, side), pad_batch([[1] * len(seq) for seq in seqs], 0, side)


def pad_batch(seqs: list[list[int]], pad_value: int, side: str = "right") -> torch.Tensor:
    """[B, longest] long tensor of `seqs` padded with `pad_value` on the right or left."""
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    width = max((len(seq) for seq in seqs), default=0)
    batch = torch.full((len(seqs), width), pad_value, dtype=torch.long)
    for row, seq in enumerate(seqs):
        if not seq:
            continue
        if side == "right":
            batch[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        else:
            batch[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
    return batch
