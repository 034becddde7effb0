"""Prompt + response sequences as the RL and evaluation stages batch them, and how batches are split over ranks."""

from __future__ import annotations

import torch

from stages import data


def build_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded prompt+response sequences; action_mask[t] marks positions whose next token is a response
    token (aligned with next-token log-probs and values, which have length T-1)."""
    input_ids, attention_mask = data.pad_sequences([p + r for p, r in zip(prompt_ids, response_ids)], pad_id)
    action_mask = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        action_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask}


def split_rows(tensors: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous, equal-as-possible row slices, one per rank."""
    rows = next(iter(tensors.values())).shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i] : bounds[i + 1]] for k, v in tensors.items()} for i in range(parts)]


def micro_batches(tensors: dict[str, torch.Tensor], size: int, device) -> list[dict[str, torch.Tensor]]:
    """Row slices of `size` moved to `device`."""
    rows = next(iter(tensors.values())).shape[0]
    return [{k: v[start : start + size].to(device) for k, v in tensors.items()} for start in range(0, rows, size)]
