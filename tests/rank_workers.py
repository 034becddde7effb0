"""Rank workers of the RL stage built in the test process, on the one gloo rank of conftest's `one_deepspeed_rank`
(a real DeepSpeed engine, no Ray), and a rank's share of an optimizer step to feed them."""

from __future__ import annotations

import torch

from stages.rl.config import RLConfig
from stages.sequences import build_sequences


def ragged_shard(seed: int = 0) -> dict[str, torch.Tensor]:
    """Eight sequences of 3 to 24 tokens, as a rank's share of an optimizer step, with advantages and reference
    log-probs."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in (2, 9, 4, 14, 3, 6, 11, 1)]
    responses = [torch.randint(3, 300, (int(n),), generator=generator).tolist() for n in (1, 10, 3, 8, 2, 5, 7, 2)]
    shard = build_sequences(prompts, responses, pad_id=0)
    mask = shard["action_mask"]
    shard["advantages"] = torch.randn(mask.shape, generator=generator) * mask
    shard["ref_logp"] = -torch.rand(mask.shape, generator=generator) * 3 * mask
    shard["old_values"] = torch.randn(mask.shape, generator=generator) * mask
    shard["returns"] = torch.randn(mask.shape, generator=generator) * mask
    return shard


def built(worker_cls, cfg) -> object:
    """A rank of `worker_cls` in this process: its model and DeepSpeed engine on the one gloo rank."""
    worker = worker_cls.__new__(worker_cls)
    worker.rank, worker.world_size, worker.device = 0, 1, "cpu"
    worker.setup(cfg.model_dump(), RLConfig)
    worker.build(4)
    return worker
