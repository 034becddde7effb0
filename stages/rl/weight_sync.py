"""Actor → rollout engine weight sync: parameters broadcast in buckets over a torch.distributed group.

The group joins actor rank 0 (rank 0 of the group) and every engine worker (ranks 1..). It is a standalone
process group (TCPStore + ProcessGroupGloo/NCCL objects), so it never touches the default group the actor ranks
train with, nor the engines' own. The transfer plan is fixed at start-up: a list of buckets, each a list of
(name, shape, dtype) of at most `bucket_bytes`. Each sync walks the buckets in order: the actor ranks gather one
bucket (ZeRO-3) and rank 0 broadcasts it as one flat tensor; each engine worker receives it and hands its tensors
to the model's weight loader as they arrive, so neither side ever holds a second copy of the whole model.

`--vllm_sync_backend` picks the group's backend: nccl between GPUs, gloo on CPU.

Engines colocated with the actor (--colocate_all_models) need no transfer: each actor rank lays a bucket out on
its own device and hands the engines a handle to it, which an engine worker on the same device opens
(`share_bucket` / `open_shared`): a CUDA IPC handle on GPUs (as OpenRLHF), read in place; a shared-memory segment
on CPU, copied out once. The handles travel through Ray; the weights do not.

However the buckets arrive, a vLLM engine loads one sync as one session (stages/rl/vllm_worker.py), so a layer whose
parameters straddle two buckets is rebuilt once all of them are in; and the driver then checks that every engine
computes with what the actor sent (stages/rl/weight_check.py).
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

BucketEntry = tuple[str, tuple[int, ...], str]  # (parameter name, full shape, dtype name)
SYNC_TIMEOUT = datetime.timedelta(minutes=30)
_DTYPES = {str(dtype).removeprefix("torch."): dtype for dtype in (torch.float32, torch.bfloat16, torch.float16)}


def plan_buckets(params: Iterable[tuple[str, tuple[int, ...], torch.dtype]], bucket_bytes: int) -> list[list[BucketEntry]]:
    """Consecutive parameters grouped into buckets of one dtype and at most `bucket_bytes` (a larger parameter
    travels alone). Keeping the model's order lets the engine finish loading one layer before the next arrives."""
    buckets: list[list[BucketEntry]] = []
    size = 0
    for name, shape, dtype in params:
        dtype_name = str(dtype).removeprefix("torch.")
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        current = buckets[-1] if buckets else None
        if current is None or current[-1][2] != dtype_name or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append((name, tuple(shape), dtype_name))
        size += nbytes
    return buckets


def bucket_bytes_total(buckets: list[list[BucketEntry]]) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=_DTYPES[dtype]).element_size()
               for bucket in buckets for _, shape, dtype in bucket)


@dataclass
class SyncGroup:
    """The weight-sync process group and the device its transfers are staged on (CPU for gloo)."""

    process_group: Any
    device: torch.device


def open_group(master_addr: str, master_port: int, rank: int, world_size: int, backend: str, *,
               local_addr: str, device=None, store=None) -> SyncGroup:
    """A standalone process group of `world_size` ranks; rank 0 hosts its store at master_addr:master_port and
    passes it in `store` (stages.distributed.host_store), the others connect to it.

    `local_addr` is this process's node address: gloo binds its sockets there (loopback on a local cluster), not
    on whatever the host name resolves to. `device` is this rank's GPU with nccl.
    """
    from torch.distributed import PrefixStore, TCPStore

    if store is None:
        store = TCPStore(master_addr, master_port, world_size, is_master=False, timeout=SYNC_TIMEOUT)
    prefixed = PrefixStore("weight-sync", store)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        options = ProcessGroupGloo._Options()
        options._timeout = SYNC_TIMEOUT
        options._devices = [ProcessGroupGloo.create_device(hostname=local_addr)]
        return SyncGroup(ProcessGroupGloo(prefixed, rank, world_size, options), torch.device("cpu"))
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL

        torch.cuda.set_device(device)
        return SyncGroup(ProcessGroupNCCL(prefixed, rank, world_size), torch.device(device))
    raise ValueError(f"weight sync backend must be 'nccl' or 'gloo', got {backend!r}")


def _broadcast(group: SyncGroup, tensor: torch.Tensor) -> None:
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    group.process_group.broadcast([tensor], options).wait()


def send_bucket(group: SyncGroup, tensors: list[torch.Tensor]) -> None:
    """Rank 0: broadcast one bucket's tensors as a single flat tensor (through host memory with gloo)."""
    _broadcast(group, torch.cat([t.detach().reshape(-1) for t in tensors]).to(group.device))


def receive_buckets(group: SyncGroup, buckets: list[list[BucketEntry]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: (name, tensor) of every parameter, bucket by bucket as each broadcast arrives."""
    for bucket in buckets:
        dtype = _DTYPES[bucket[0][2]]
        flat = torch.empty(sum(torch.Size(shape).numel() for _, shape, _ in bucket), dtype=dtype,
                           device=group.device)
        _broadcast(group, flat)
        yield from _unflatten(flat, bucket)


def _unflatten(flat: torch.Tensor, bucket: list[BucketEntry]) -> Iterator[tuple[str, torch.Tensor]]:
    offset = 0
    for name, shape, _ in bucket:
        count = torch.Size(shape).numel()
        yield name, flat[offset : offset + count].view(shape)
        offset += count


@dataclass(frozen=True)
class SharedBucket:
    """A bucket laid out on an actor rank's device, as a handle another process there opens."""

    location: str  # the GPU's UUID, or the machine's host name for host memory
    handle: Any  # CUDA: torch's (rebuild function, arguments) of an IPC handle; CPU: (segment name, dtype, numel)


class HeldBucket:
    """What the actor rank keeps while engines open a bucket: the tensor, and on CPU its shared-memory segment,
    which the rank alone creates and removes (`release`), whoever opened it."""

    def __init__(self, tensor: torch.Tensor, segment=None):
        self.tensor, self.segment = tensor, segment

    def release(self) -> None:
        self.tensor = None  # the segment's buffer cannot close while a tensor views it
        if self.segment is not None:
            self.segment.close()
            self.segment.unlink()
            self.segment = None


def location(device: torch.device) -> str:
    if device.type == "cuda":
        return f"gpu {torch.cuda.get_device_properties(device).uuid}"
    return f"host {socket.gethostname()}"


def share_bucket(tensors: list[torch.Tensor], device: torch.device) -> tuple[HeldBucket, SharedBucket]:
    """Actor side: the tensors laid end to end on `device` and the handle to them. Hold the bucket until every
    engine has loaded it, then release it."""
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        flat = torch.cat([t.detach().reshape(-1) for t in tensors]).to(device)
        return HeldBucket(flat), SharedBucket(location(device), reduce_tensor(flat))
    from multiprocessing import shared_memory

    dtype, count = tensors[0].dtype, sum(t.numel() for t in tensors)
    segment = shared_memory.SharedMemory(create=True, size=count * tensors[0].element_size())
    flat = torch.frombuffer(segment.buf, dtype=dtype, count=count)
    torch.cat([t.detach().reshape(-1).cpu() for t in tensors], out=flat)
    return HeldBucket(flat, segment), SharedBucket(location(device), (segment.name, str(dtype).removeprefix("torch."),
                                                                      count))


def open_shared(shared: list[SharedBucket], bucket: list[BucketEntry],
                device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Engine side: (name, tensor) of every parameter of `bucket`, from what an actor rank on this process's
    device shares: views of its GPU memory (CUDA IPC), or on CPU one copy out of its shared-memory segment."""
    here = location(device)
    match = next((item for item in shared if item.location == here), None)
    if match is None:
        raise RuntimeError(f"weight sync: no actor rank shares weights on {here} (shared on "
                           f"{sorted({item.location for item in shared})}): the engines must be colocated with it")
    if device.type == "cuda":
        rebuild, args = match.handle
        args = list(args)
        args[6] = device.index if device.index is not None else torch.cuda.current_device()  # this process's number
        flat = rebuild(*args)
    else:
        from multiprocessing import resource_tracker, shared_memory

        name, dtype, count = match.handle
        segment = shared_memory.SharedMemory(name=name)
        # The actor rank removes the segment; this process's tracker would remove it again when it exits.
        resource_tracker.unregister(segment._name, "shared_memory")
        try:
            flat = torch.frombuffer(segment.buf, dtype=_DTYPES[dtype], count=count).clone()
        finally:
            segment.close()
    yield from _unflatten(flat, bucket)


def with_tied(weights: Iterable[tuple[str, torch.Tensor]], tied: dict[str, str]) -> Iterator[tuple[str, Any]]:
    """Also yield each tied parameter (e.g. lm_head.weight) under its own name right after its source."""
    by_source: dict[str, list[str]] = {}
    for name, source in tied.items():
        by_source.setdefault(source, []).append(name)
    for name, tensor in weights:
        yield name, tensor
        for alias in by_source.get(name, []):
            yield alias, tensor
