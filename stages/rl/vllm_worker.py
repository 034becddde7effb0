"""What runs inside vLLM's workers: the receiving side of the weight sync, and the read-back of the loaded weights.

vLLM runs a weight update as a session of each worker: `start_weight_update`, `update_weights` once per chunk,
`finish_weight_update`, driven by the worker's weight-transfer engine (vllm/distributed/weight_transfer). Its own
engines move CUDA tensors (NCCL, CUDA IPC); `BucketReceiver` is the one for our transports (stages/rl/weight_sync.py:
a broadcast over the sync group, gloo or NCCL; an actor rank's bucket opened in place, CUDA IPC or host shared
memory), registered under TRANSFER_BACKEND when this module is imported, which every worker does since
`WorkerWeights` is its extension class. As vLLM's IPC engine does, a session is one layerwise reload: vLLM keeps
each layer's loads until all of its parameters arrived, whichever bucket each came in, then rebuilds it in place.
(One reload per bucket, as `reload_weights` does, finishes a layer whose fused gate/up or q/k/v matrix arrived in
part from memory that was never loaded.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from stages.rl.weight_check import ReadBack, probe_vector, reading_of
from stages.rl.weight_sync import open_group, open_shared, receive_buckets, with_tied

TRANSFER_BACKEND = "rlhf-flow-buckets"


@dataclass
class BucketInitInfo(WeightTransferInitInfo):
    """The weight-sync group a broadcast arrives over; worker i of the engine takes rank rank_offset + i."""

    master_addr: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str


@dataclass
class BucketUpdateInfo(WeightTransferUpdateInfo):
    """One chunk of a sync: every bucket, broadcast over the group (`shared` None), or one bucket that an actor rank
    on this worker's device shares (`shared`: its handles). `tied`: {tied name: its source}."""

    buckets: list
    shared: list | None = None
    tied: dict[str, str] = field(default_factory=dict)


class BucketReceiver(WeightTransferEngine[BucketInitInfo, BucketUpdateInfo]):
    """One sync = one session = one layerwise reload. It also counts what it was sent against what it loaded."""

    init_info_cls = BucketInitInfo
    update_info_cls = BucketUpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group = None
        self.planned: list[str] = []  # names the session's buckets announce, tied copies included
        self.loaded: list[str] = []  # names handed to the model's loader, in order

    def init_transfer_engine(self, init_info: BucketInitInfo) -> None:
        import ray

        self.group = open_group(init_info.master_addr, init_info.master_port,
                                init_info.rank_offset + self.parallel_config.rank, init_info.world_size,
                                init_info.backend, local_addr=ray.util.get_node_ip_address(),
                                device=self.device if init_info.backend == "nccl" else None)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self.planned, self.loaded = [], []
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class synchronizes "the accelerator", which a CPU worker does not have.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # the copies out of the actor's memory are done before it frees the bucket

    def receive_weights(self, update_info: BucketUpdateInfo) -> None:
        entries = [name for bucket in update_info.buckets for name, _, _ in bucket]
        self.planned += [name for name, _ in with_tied(((name, None) for name in entries), update_info.tied)]
        if update_info.shared is None:
            if self.group is None:
                raise RuntimeError("weight sync: a broadcast arrived before the engine joined the sync group")
            weights = receive_buckets(self.group, update_info.buckets)
        else:
            weights = open_shared(update_info.shared, update_info.buckets[0], self.device)
        self.model.load_weights(self._counted(with_tied(weights, update_info.tied)))

    def _counted(self, weights):
        for name, tensor in weights:
            self.loaded.append(name)
            yield name, tensor

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def receipt(self) -> dict[str, list[str]]:
        """The last session's names that were announced but never loaded, and loaded but never announced."""
        loaded, planned = set(self.loaded), set(self.planned)
        return {"missing": [name for name in self.planned if name not in loaded],
                "unexpected": sorted(set(self.loaded) - planned),
                "loaded": list(self.loaded)}

    def shutdown(self) -> None:
        self.group = None


try:
    WeightTransferEngineFactory.register_engine(TRANSFER_BACKEND, BucketReceiver)
except ValueError:  # registered by an earlier import in this process
    pass


class WorkerWeights:
    """vLLM worker extension (`worker_extension_cls`): its methods run in every worker of an engine through
    `collective_rpc`."""

    def weight_sync_receipt(self) -> dict[str, list[str]]:
        return self.weight_transfer_engine.receipt()

    @torch.no_grad()
    def read_back_weights(self, names: list[str]) -> tuple[list[ReadBack], list[str]]:
        """What this worker computes with for the actor's tensors `names` (stages/rl/weight_check.py), and the names
        it cannot read back: tensors it does not hold under a name the model maps them to (MoE experts, which
        vLLM's loaders stack by hand), or whose layer it does not know how to run."""
        return read_back(self.model_runner.get_model(), names, self.device)


def read_back(model: torch.nn.Module, names: list[str], device: torch.device) -> tuple[list[ReadBack], list[str]]:
    from vllm.model_executor.layers.linear import LinearBase, QKVParallelLinear, ReplicatedLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    targets: dict[str, list[tuple[str, Any]]] = {}  # the model's tensor -> (actor's name, shard id) it holds
    unreadable = []
    for name in names:
        mapped = model_tensor_name(model, name)
        if mapped is None:
            unreadable.append(name)
            continue
        targets.setdefault(mapped[0], []).append((name, mapped[1]))
    readings: list[ReadBack] = []
    for target, held in targets.items():
        module_name, _, attribute = target.rpartition(".")
        try:
            module = model.get_submodule(module_name)
            tensor = getattr(module, attribute)
        except AttributeError:
            unreadable += [name for name, _ in held]
            continue
        tp_size = getattr(module, "tp_size", 1)
        covers = tuple((name, 1) for name, _ in held)
        if isinstance(module, LinearBase) and attribute == "weight":
            readings += _linear_readings(module, target, held, device, tp_size,
                                         QKVParallelLinear, ReplicatedLinear, RowParallelLinear)
        elif isinstance(tensor, torch.Tensor) and tensor.numel() > 0:
            sharded = tp_size > 1 and (isinstance(module, VocabParallelEmbedding)
                                       or (attribute == "bias" and isinstance(module, LinearBase)
                                           and not isinstance(module, (RowParallelLinear, ReplicatedLinear))))
            if sharded and getattr(module, "num_kv_head_replicas", 1) > 1:
                unreadable += [name for name, _ in held]  # a q/k/v bias with replicated key/value heads
                continue
            readings.append(reading_of(target, covers, tensor, "sum" if sharded else "each"))
        else:
            unreadable += [name for name, _ in held]
    return readings, unreadable


def model_tensor_name(model: torch.nn.Module, name: str) -> tuple[str, Any] | None:
    """(the model's tensor, shard id) that loads the actor's tensor `name`, or None when the model drops it: the
    model's own name mapper (vLLM's newer models stack q/k/v and gate/up there), else its packed modules (older
    ones stack them in their loaders)."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapped = mapper._map_name_with_shard(name)
        if mapped is None or mapped[0] != name:
            return mapped
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        for index, part in enumerate(parts):
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), "qkv"[index] if len(parts) == 3 else index
    return name, None


def _linear_readings(module, target: str, held, device, tp_size: int, qkv_cls, replicated_cls,
                     row_cls) -> list[ReadBack]:
    """The layer run on the probe vector: ||y||² of its output (a row-parallel shard's partial output whole)."""
    x = probe_vector(module.input_size, module.params_dtype, device)
    row_parallel = isinstance(module, row_cls) and tp_size > 1
    if row_parallel:
        width = module.input_size_per_partition
        x = x[module.tp_rank * width : (module.tp_rank + 1) * width]
    y = module.quant_method.apply(module, x[None], None)[0].double().cpu()
    covers = tuple((name, 1) for name, _ in held)
    if row_parallel:
        return [ReadBack(target, covers, "wx", y, "vector")]
    if tp_size == 1 or isinstance(module, replicated_cls):
        return [ReadBack(target, covers, "wx", (float(y.square().sum()),), "each")]
    replicas = getattr(module, "num_kv_head_replicas", 1)
    if isinstance(module, qkv_cls) and replicas > 1:  # every key/value head sits on `replicas` workers
        q_width = module.num_heads * module.head_size
        queries = tuple((name, 1) for name, shard in held if shard == "q")
        keys_values = tuple((name, replicas) for name, shard in held if shard != "q")
        return [ReadBack(target + "[q]", queries, "wx", (float(y[:q_width].square().sum()),), "sum"),
                ReadBack(target + "[kv]", keys_values, "wx", (float(y[q_width:].square().sum()),), "sum")]
    return [ReadBack(target, covers, "wx", (float(y.square().sum()),), "sum")]
