"""How a stage entrypoint starts its ranks and reports: Ray actor group (default) or an external launcher.

Exit codes are part of the stage contract: 0 success, 2 config or data error (a retry cannot fix it),
3 test-only fault injection, anything else a failure that a retry may fix.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any, Callable

EXIT_CONFIG_ERROR = 2
EXIT_FAULT_INJECTED = 3


class StageInputError(ValueError):
    """A problem with the stage's configuration or data, reported before any rank starts."""


def world_size_of(cfg) -> int:
    return cfg.num_nodes * cfg.num_gpus_per_node


def run_rank_group(stage: str, worker_cls: type, cfg, *, num_ranks: int | None = None) -> dict[str, Any]:
    """Run `setup` then `fit` on every rank; returns rank 0's result."""
    from stages.distributed import ActorGroup, RankWorker, cluster_has_gpus, init_ray, launched_by_torch_launcher
    from stages.engine import fault_injection_requested

    fault = fault_injection_requested(stage)
    config_cls = type(cfg)
    if launched_by_torch_launcher():
        device = cfg.device if cfg.device != "auto" else ("cuda" if _cuda() else "cpu")
        worker = worker_cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                            os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", 29500)),
                            device)
        assert isinstance(worker, RankWorker)
        worker.setup(cfg.model_dump(), config_cls)
        return worker.fit(fault)
    init_ray()
    device = cfg.device if cfg.device != "auto" else ("cuda" if cluster_has_gpus() else "cpu")
    group = ActorGroup(worker_cls, num_ranks or world_size_of(cfg), device, name=stage)
    try:
        info = group.run("setup", cfg.model_dump(), config_cls)[0]
        print(f"[{stage}] {group.world_size} ranks on {device}: {json.dumps(info)}", flush=True)
        return group.run("fit", fault)[0]
    finally:
        group.shutdown()


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def stage_main(stage: str, body: Callable[[Any], dict[str, Any]], argv: list[str] | None = None) -> None:
    """Parse the stage's flags, run `body(cfg)`, map failures to the stage exit codes."""
    from stages.config import parse_stage_args
    from stages.data import DataValidationError

    cfg = parse_stage_args(stage, argv)
    try:
        result = body(cfg)
    except (DataValidationError, StageInputError) as error:
        print(f"[{stage}] error: {error}", file=sys.stderr, flush=True)
        sys.exit(EXIT_CONFIG_ERROR)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    if result.get("fault_injected"):
        print(f"[{stage}] fault injected after the checkpoint of step {result['step']} (RLHF_FAULT_INJECT)",
              file=sys.stderr, flush=True)
        sys.exit(EXIT_FAULT_INJECTED)
    print(f"[{stage}] done: {json.dumps(result.get('metrics', {}), sort_keys=True)}", flush=True)
