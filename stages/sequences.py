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


def first_fit_count(lengths: list[int], budget: int) -> int:
    """How many micro-batches of at most `budget` tokens first fit packs sequences of `lengths` into, a longer
    sequence taking one of its own (OpenRLHF's count for --use_dynamic_batch)."""
    loads: list[int] = []
    for length in lengths:
        for slot, load in enumerate(loads):
            if load + length <= budget:
                loads[slot] += length
                break
        else:
            loads.append(length)
    return len(loads)


def balanced_partitions(lengths: list[int], parts: int) -> list[list[int]]:
    """The indices of `lengths` in `parts` groups of near-equal token sums (the longest sequence first, each into
    the lightest group), ascending within a group; a group is empty only with fewer sequences than groups."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        lightest = min(range(parts), key=lambda g: (loads[g], len(groups[g]), g))
        groups[lightest].append(index)
        loads[lightest] += lengths[index]
    return [sorted(group) for group in groups]


def select_rows(tensors: dict[str, torch.Tensor], rows: list[int], device) -> dict[str, torch.Tensor]:
    """`rows` of a right-padded batch moved to `device`, cut to the longest of them: columns of the sequences
    (width T) to its length, next-token columns (width T-1: masks, log-probs, values) to one less."""
    index = torch.tensor(rows, dtype=torch.long)
    width = tensors["input_ids"].shape[1]
    longest = int(tensors["attention_mask"][index].sum(dim=1).max())
    selected = {}
    for key, value in tensors.items():
        value = value[index]
        if value.dim() > 1 and value.shape[1] in (width, width - 1):
            value = value[:, : longest - (width - value.shape[1])]
        selected[key] = value.to(device)
    return selected


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


def pair_sequences(examples: list[dict]) -> list[list[int]]:
    """Chosen sequences, then rejected ones: one forward scores both sides of every pair."""
    return [e["chosen_ids"] for e in examples] + [e["rejected_ids"] for e in examples]
