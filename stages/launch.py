"""How a stage entrypoint starts its ranks and reports: Ray actor group (default) or an external launcher, the
writer lock of its workspace, the check of its input models, its redacted output, and the exit codes of
stages/errors.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable

from infra.secrets import Redactor, redact_streams
from stages.errors import WorkspaceBusy, exit_code
from stages.fields import cpu_notes


def run_rank_group(stage: str, worker_cls: type, cfg, validate: Callable[[Any, str], None]) -> dict[str, Any]:
    """Check the data with `validate(rows, source)`, then run `setup` and `fit` on every rank; returns rank 0's
    result. On Ray the ranks start while this process reads the data."""
    import ray
    import torch

    from stages.data import validate_sources
    from stages.distributed import ActorGroup, cluster_device, cpu_threads, init_ray, launched_by_torch_launcher
    from stages.engine import claim_checkpoints
    from stages.moe import check_config_router

    config_cls = type(cfg)
    check_config_router(getattr(cfg, "aux_loss_coef", 0.0), cfg.pretrain)
    if launched_by_torch_launcher():
        validate_sources(cfg, validate)
        device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        # The launcher already set RANK, WORLD_SIZE, LOCAL_RANK and MASTER_ADDR/PORT for this process, and passes
        # --local_rank: the GPU of this rank.
        rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if device == "cuda":
            torch.cuda.set_device(cfg.local_rank if cfg.local_rank >= 0 else int(os.environ.get("LOCAL_RANK", 0)))
        if rank == 0 and world_size != cfg.world_size:
            print(f"[{stage}] --num_nodes {cfg.num_nodes} × --num_gpus_per_node {cfg.num_gpus_per_node} = "
                  f"{cfg.world_size} ranks ignored: the launcher started {world_size}", flush=True)
        if rank == 0:
            note_limits(stage, cfg, device)
        start_step = claim_checkpoints(stage, cfg, write=rank == 0) if cfg.ckpt_path else 0
        worker = worker_cls(rank, world_size, device)
        worker.setup(cfg.model_dump(), config_cls)
        return worker.fit(start_step)
    start_step = claim_checkpoints(stage, cfg) if cfg.ckpt_path else 0
    init_ray()
    device = cluster_device(cfg.device)
    note_limits(stage, cfg, device)
    group = ActorGroup(worker_cls, cfg.world_size, device, name=stage, threads=cpu_threads(cfg.num_gpus_per_node))
    try:
        validate_sources(cfg, validate)
        ray.get(group.rendezvous())
        info = group.run("setup", cfg.model_dump(), config_cls)[0]
        print(f"[{stage}] {group.world_size} ranks on {device}: {json.dumps(info)}", flush=True)
        return group.run("fit", start_step)[0]
    finally:
        group.shutdown()


def note_limits(stage: str, cfg, device: str) -> None:
    """Say once which flags of `cfg` cannot act on this device, and why (the fields' GpuOnly declarations), and
    where its settings act otherwise than the same flags in OpenRLHF (`cfg.notes()`)."""
    for note in (cpu_notes(cfg) if device == "cpu" else []) + cfg.notes():
        print(f"[{stage}] {note}", flush=True)


def writer_lock_path(save_path: str, ckpt_path: str | None) -> Path:
    """The lock file beside the directory a second writer would corrupt: the checkpoints, else the output."""
    target = Path(ckpt_path or save_path).expanduser().resolve()
    return target.with_name(target.name + ".lock")


def writer_lock_holder(lock_path: Path) -> str | None:
    """Who holds the writer lock at `lock_path` (as they wrote it), or None when nobody does."""
    try:
        fd = os.open(lock_path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return lock_path.read_text().strip() or "a process that has not written its name yet"
    finally:
        os.close(fd)
    return None


@contextmanager
def writer_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` for the duration; raises WorkspaceBusy naming the holder.

    The kernel drops the lock when the holder dies, even by SIGKILL, so a crashed job never blocks its retry.
    """
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_path.read_text().strip()
            raise WorkspaceBusy(f"{lock_path.parent} is being written by {holder or 'another process'}") from None
        holder = f"pid {os.getpid()} on {socket.gethostname()}, Ray job {os.environ.get('RAY_JOB_ID', '-')}"
        os.ftruncate(fd, 0)
        os.write(fd, holder.encode())
        yield
    finally:
        os.close(fd)  # releases the lock


def stage_main(config_cls: type, body: Callable[[Any], dict[str, Any]], argv: list[str] | None = None) -> None:
    """Parse the flags of the stage that `config_cls` configures, check its input models, run `body(cfg)` holding the writer lock (rank 0), map
    failures to exit codes. Everything the process prints is redacted with its own (the node's) environment."""
    from stages.cli import parse_stage_args
    from stages.model_io import check_model_inputs
    from stages.tracking import silence_known_noise

    redact_streams(Redactor())
    stage = config_cls.stage
    cfg = parse_stage_args(config_cls, argv)
    silence_known_noise()
    first_rank = os.environ.get("RANK", "0") == "0"  # under a launcher rank 0 checks and holds the lock
    target = writer_lock_path(cfg.save_path, getattr(cfg, "ckpt_path", None))
    lock = writer_lock(target) if first_rank else nullcontext()
    try:
        with lock:
            if first_rank:
                check_model_inputs(stage, cfg)
            result = body(cfg)
    except Exception as error:
        code = exit_code(error)
        if code == 1:
            traceback.print_exc()
        else:
            # Raised in a rank actor, it arrives wrapped in Ray's error (also an instance of its class): show its
            # own message, not the remote traceback.
            print(f"[{stage}] error: {getattr(error, 'cause', None) or error}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        sys.stderr.flush()
        sys.exit(code)
    sys.stdout.flush()
    if first_rank:  # under a launcher every rank gets here
        print(f"[{stage}] done: {json.dumps(result.get('metrics', {}), sort_keys=True)}", flush=True)
