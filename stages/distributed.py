"""Ray actor groups: N rank processes placed with a placement group, each a torch.distributed rank.

A stage's driver (`python -m stages.<name>`, itself a Ray job) builds one `ActorGroup` per model role
(actor, reference, reward, critic). Every rank actor sets the usual torch.distributed environment
(RANK, WORLD_SIZE, MASTER_ADDR/PORT, LOCAL_RANK) before DeepSpeed initialises, so the same worker code also
runs under `deepspeed --module stages.<name>` or torchrun without Ray.
"""

from __future__ import annotations

import copy
import ipaddress
import os
import socket
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from infra.secrets import REDACTING_SETUP_HOOK
from stages.environment import stage_environment


def cluster_device(device: str) -> str:
    """The device of a stage's Ray ranks: 'auto' means CUDA when the Ray cluster has GPUs."""
    if device != "auto":
        return device
    return "cuda" if cluster_has_gpus() else "cpu"


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0


def cpu_rank_env(threads: int = 1) -> dict[str, str]:
    """Environment of a CPU rank: its share of the node's cores as compute threads (more threads than cores, e.g.
    two ranks of two threads on two cores, run about 2x slower)."""
    return {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def cpu_threads(processes_per_node: int) -> int:
    """Compute threads of each of `processes_per_node` CPU processes that work at the same time on a node.

    The RL stage's models take turns on CPU (generation, then each model's forward, then training), so each
    model's ranks get all the cores between them rather than a fixed share of one. $RLHF_CPU_CORES caps the cores
    counted, for a machine that also runs other work: threads beyond the free cores spin in OpenMP's barriers and
    slow every process down (two tiny RL stages side by side on 2 cores take twice as long with 2 threads per
    process as with 1).
    """
    cores = min((node["Resources"].get("CPU", 1) for node in ray.nodes() if node["Alive"]), default=1)
    cores = min(cores, stage_environment().cpu_cores or cores)
    return max(1, int(cores) // max(processes_per_node, 1))


class RankWorker:
    """Base class of every rank actor: sets up the process as one torch.distributed rank."""

    def __init__(self, rank: int, world_size: int, device: str, threads: int = 1):
        from infra.secrets import redact_streams
        from stages.tracking import silence_known_noise

        redact_streams()  # the actor's own log files on its node, not only what reaches the driver
        silence_known_noise()
        self.rank = rank
        self.world_size = world_size
        self.device = device
        if device == "cpu":
            os.environ.update(cpu_rank_env(threads))
            import torch

            torch.set_num_threads(threads)

    ring = None  # this rank's ring with --ring_attn_size > 1 (stages/ring_attention.py), set by join_ring

    def join_ring(self, cfg) -> None:
        """--ring_attn_size: join the ring of consecutive ranks this rank splits its sequences' tokens with (after
        init_process_group). The ranks of a ring read the same data: data-parallel rank and size count rings."""
        from stages.ring_attention import ring_of

        # A stage without the flags (the evaluation's reward model) has no ring.
        self.ring = ring_of(self.rank, self.world_size, getattr(cfg, "ring_attn_size", 1),
                            getattr(cfg, "ring_head_stride", 1))

    @property
    def ring_size(self) -> int:
        return self.ring.size if self.ring is not None else 1

    @property
    def dp_rank(self) -> int:
        return self.rank // self.ring_size

    @property
    def dp_size(self) -> int:
        return self.world_size // self.ring_size

    def master_endpoint(self) -> tuple[str, int]:
        """Host the rendezvous store on rank 0 (this rank), listening on the node's address only.

        torch's env:// rendezvous would bind its store on every interface; a store bound here (loopback on a
        local cluster) is what every rank, this one included, joins as a client (see `join`).
        """
        self._rendezvous_socket, self._rendezvous_store = host_store(node_address())
        return node_address(), self._rendezvous_socket.getsockname()[1]

    def join(self, endpoint: tuple[str, int]) -> None:
        """Set the torch.distributed environment a launcher would (the Ray path has no launcher)."""
        master_addr, master_port = endpoint
        os.environ.update(
            RANK=str(self.rank),
            WORLD_SIZE=str(self.world_size),
            MASTER_ADDR=master_addr,
            MASTER_PORT=str(master_port),
            # Ray gives each GPU rank its own CUDA_VISIBLE_DEVICES, so the local device is always 0.
            LOCAL_RANK="0",
            LOCAL_SIZE="1",
            # Connect to rank 0's store (master_endpoint) instead of starting one on every interface.
            TORCHELASTIC_USE_AGENT_STORE="True",
        )
        if ipaddress.ip_address(master_addr).is_loopback:
            # gloo's own listeners follow the hostname's address unless told the interface.
            os.environ["GLOO_SOCKET_IFNAME"] = loopback_interface()

    def init_process_group(self, deepspeed: bool = True) -> None:
        """Join the ranks' process group: through DeepSpeed for a rank that trains or shards with it, plain
        torch.distributed otherwise (a frozen model need not pay DeepSpeed's import)."""
        import torch.distributed as dist

        backend = "nccl" if self.device == "cuda" else "gloo"
        if not deepspeed:
            if not dist.is_initialized():
                dist.init_process_group(backend)
            return
        import deepspeed as ds

        if self.device == "cpu":
            skip_deepspeed_shm_comm()
        # Joins the group another role of this process (RankHost) already made, if one did.
        ds.init_distributed(dist_backend=backend)


class RankHost(RankWorker):
    """One rank process that hosts several roles of equal ranks sharing a placement (e.g. the actor and its
    reference under --colocate_actor_ref): one interpreter, one set of imports, one torch.distributed group and one
    CUDA context instead of one of each per role, and the roles' calls run one at a time, as colocated models
    take turns. `call(role, method, ...)` runs a method of one of them."""

    def __init__(self, rank: int, world_size: int, device: str, threads: int, role_classes: dict[str, type]):
        super().__init__(rank, world_size, device, threads)
        self.roles = {role: cls(rank, world_size, device, threads) for role, cls in role_classes.items()}

    def call(self, role: str, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.roles[role], method)(*args, **kwargs)


def skip_deepspeed_shm_comm() -> None:
    """Keep DeepSpeed's CPU backend from building its shared-memory all-reduce op at init.

    Building it means probing a compiler for every DeepSpeed op on each start (tens of seconds per rank, more on a
    busy machine) and a ~35 s JIT compile on a fresh machine; only DeepSpeed's inference kernels use the op, never
    ZeRO training, which all-reduces through gloo. An empty compatibility table answers the probe before it runs.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__ = {}

def node_address() -> str:
    return ray.util.get_node_ip_address()


def host_store(address: str, world_size: int | None = None):
    """(listening socket, TCPStore) of a store server bound to `address` only, on a free port.

    torch's TCPStore server listens on every interface; handed a socket bound here it listens on this one. Keep
    the socket alive as long as the store.
    """
    import datetime

    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    listener = socket.create_server((address, 0), family=family)
    store = dist.TCPStore(address, listener.getsockname()[1], world_size, is_master=True,
                          wait_for_workers=False, master_listen_fd=listener.fileno(),
                          timeout=datetime.timedelta(minutes=30))
    return listener, store


def loopback_interface() -> str:
    """Name of the network interface that carries 127.0.0.1 ("lo" on Linux)."""
    import psutil

    for name, addresses in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses):
            return name
    return "lo"


@dataclass
class Placement:
    """Where a group's ranks go: a placement group and the fraction of a bundle each rank takes."""

    group: PlacementGroup
    num_cpus: float
    num_gpus: float
    owned: bool = False


def make_placement(num_ranks: int, device: str, *, num_cpus: float = 1.0, num_gpus: float = 1.0) -> Placement:
    """A placement group with one bundle per rank (CPU: one core; GPU: one GPU plus a core), packed on few nodes."""
    bundle = {"GPU": 1, "CPU": 1} if device == "cuda" else {"CPU": 1}
    group = placement_group([dict(bundle) for _ in range(num_ranks)], strategy="PACK")
    ray.get(group.ready())
    return Placement(group, num_cpus=num_cpus, num_gpus=num_gpus if device == "cuda" else 0.0, owned=True)


class ActorGroup:
    """`num_ranks` instances of a RankWorker subclass, rank i on bundle i; calls are dispatched to all ranks.

    A group of a role hosted with others (`hosted`) dispatches to that role inside each rank's RankHost."""

    def __init__(self, worker_cls: type, num_ranks: int, device: str, *, placement: Placement | None = None,
                 name: str = "group", threads: int = 1, host_args: tuple = ()):
        self.name = name
        self.role: str | None = None  # set on the groups `hosted` returns
        self.ring_size = 1  # consecutive ranks that split each sequence's tokens (--ring_attn_size), set by the stage
        self.placement = placement or make_placement(num_ranks, device)
        env_vars = cpu_rank_env(threads) if device == "cpu" else {}
        remote_cls = ray.remote(worker_cls)
        self.actors = []
        for rank in range(num_ranks):
            options = dict(
                num_cpus=self.placement.num_cpus,
                num_gpus=self.placement.num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.placement.group, placement_group_bundle_index=rank
                ),
                runtime_env={"env_vars": env_vars},
            )
            self.actors.append(remote_cls.options(**options).remote(rank, num_ranks, device, threads, *host_args))
        self._joined = self.actors[0].master_endpoint.remote()

    @classmethod
    def hosted(cls, role_classes: dict[str, type], num_ranks: int, device: str, *, placement: Placement,
               threads: int = 1) -> dict[str, ActorGroup]:
        """One RankHost per rank holding every role of `role_classes` (taking the placement's share of each);
        role -> a group of that role, all of them on the same rank processes."""
        shared = Placement(placement.group, num_cpus=placement.num_cpus * len(role_classes),
                           num_gpus=placement.num_gpus * len(role_classes), owned=placement.owned)
        hosts = cls(RankHost, num_ranks, device, placement=shared, name="+".join(role_classes), threads=threads,
                    host_args=(role_classes,))
        groups = {}
        for role in role_classes:
            group = copy.copy(hosts)
            group.name, group.role = role, role
            groups[role] = group
        return groups

    def rendezvous(self) -> list[ray.ObjectRef]:
        """Give every rank the address rank 0 hosts the rendezvous at (on its own node, which need not be the
        driver's). Returns the calls to wait for, so that several groups can start side by side."""
        return [actor.join.remote(self._joined) for actor in self.actors]

    @property
    def world_size(self) -> int:
        return len(self.actors)

    def split(self, tensors: dict) -> list[dict]:
        """Row slices of `tensors` ({name: [rows, ...]}), one per rank: contiguous, equal-as-possible slices per
        data-parallel group, the same slice for every rank of a ring (`ring_size`, --ring_attn_size)."""
        from stages.sequences import split_rows

        return [part for part in split_rows(tensors, self.world_size // self.ring_size) for _ in range(self.ring_size)]

    def leaders(self, results: list) -> list:
        """Of one result per rank, those of each ring's first rank (the others computed the same)."""
        return results[:: self.ring_size]

    def on_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Call `method` on one rank."""
        actor = self.actors[rank]
        if self.role is None:
            return getattr(actor, method).remote(*args, **kwargs)
        return actor.call.remote(self.role, method, *args, **kwargs)

    def run(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call `method` on every rank with the same arguments and wait for all results (rank order)."""
        return ray.get(self.run_async(method, *args, **kwargs))

    def run_async(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        return [self.on_rank(rank, method, *args, **kwargs) for rank in range(self.world_size)]

    def run_sharded(self, method: str, shards: list[Any], **kwargs: Any) -> list[Any]:
        """Call `method` on rank i with shards[i]."""
        return ray.get(self.run_sharded_async(method, shards, **kwargs))

    def run_sharded_async(self, method: str, shards: list[Any], **kwargs: Any) -> list[ray.ObjectRef]:
        assert len(shards) == self.world_size, f"{self.name}: {len(shards)} shards for {self.world_size} ranks"
        return [self.on_rank(rank, method, shard, **kwargs) for rank, shard in enumerate(shards)]

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self.placement.owned:
            remove_placement_group(self.placement.group)


def init_ray() -> None:
    """Join the cluster this job runs in (RAY_ADDRESS is set by the Jobs API), or start a private local one."""
    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Without RAY_ADDRESS the private cluster listens on loopback only (see stages/__init__.py), and every worker
    # process redacts its own output (a job gets the same hook from the orchestration's runtime_env): processes
    # started for the stage by others too, such as vLLM's tensor-parallel workers, whose log files stay on the node.
    address = os.environ.get("RAY_ADDRESS") or None
    if not address:
        from infra.ray_env import QUIET_HEAD_ENV

        os.environ.update(QUIET_HEAD_ENV)
    ray.init(address=address, include_dashboard=False, log_to_driver=True,
             runtime_env=None if address else {"worker_process_setup_hook": REDACTING_SETUP_HOOK})


def launched_by_torch_launcher() -> bool:
    """True under `deepspeed --module` / torchrun: the launcher already made this process a rank."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ and "RAY_JOB_ID" not in os.environ
