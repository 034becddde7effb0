"""RL fine-tuning from rollouts: PPO with a critic, GRPO, RLOO, REINFORCE++ and friends (`--advantage_estimator`).

One step, as the driver runs it:
  1. take prompts from the prompt stream and sample `n_samples_per_prompt` responses each with the rollout
     engines (vLLM, or HF generate where vLLM is not installed);
  2. score them: a rule function or HTTP endpoints (`--remote_rm_url`), or the reward model. Prompt groups whose
     remote reward failed, and with `--dynamic_filtering` groups without learning signal, are dropped and
     replaced by further prompts until the rollout holds `rollout_batch_size` groups;
  3. log-probs of the responses under the actor and the reference, values under the critic (gae);
  4. advantages and returns (stages/algorithms.py), then `max_epochs` passes of PPO updates of the critic and
     the actor in optimizer steps of `train_batch_size` samples, the KL either in the reward or in the loss;
  5. send the actor's new weights to the engines; evaluate, warn on drift, checkpoint every `save_steps`.
With --async_train steps 1-2 run on a thread of their own, --async_queue_size steps ahead (stages/rl/rollout_queue.py);
without it each step collects its own rollout first (RolloutsOnDemand).

    python -m stages.rl --config tiny --pretrain ./sft --remote_rm_url reward.py --prompt_data prompts.jsonl \
        --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --save_path ./policy
    python -m stages.rl --config llama3-8b --pretrain ./sft --reward_pretrain ./rm --save_path ./ppo   # PPO
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from stages import algorithms as algo
from stages import engine as ds
from stages.distributed import ActorGroup, Placement, cluster_device, cpu_threads, init_ray
from stages.errors import StageInputError
from stages.launch import note_limits
from stages.placement import (
    ENGINES, bundle_resources, describe, engine_bundles, group_bundles, models_take_turns, placement_plan,
    rank_processes, startup_order,
)
from stages.rewards import RewardBatch, reward_source_of
from stages.rl import algorithms as rl_algo
from stages.rl.agents import agent_rollouts, load_agent_executor
from stages.rl.actor import PolicyWorker, ReferenceWorker
from stages.rl.config import RLConfig
from stages.rl.critic import CriticWorker, RewardModelWorker
from stages.rl.rollout import (
    Extension,
    Rollout,
    encode_prompt,
    extend_across,
    generate_across,
    resolve_backend,
    response_budgets,
    rollouts_of,
)
from stages.rl.rollout_queue import RolloutQueue
from stages.rl.sync_check import (
    PROBE_PROMPTS, PROBE_RESPONSE_TOKENS, Probe, SyncCheck, WeightSyncError, probe_prompts,
)
from stages.sequences import build_sequences, chunks
from stages.tracking import PhaseTimer, StepLog, phase_seconds

if TYPE_CHECKING:  # the data libraries load once the role processes are starting (load_prompts)
    from stages.prepared import ExampleRows

# Phases that follow one another within a step; whatever else the step took is reported as idle.
SEQUENTIAL_PHASES = ("generation", "reward", "experience", "advantages", "training", "weight_sync", "sync_check",
                     "evaluation", "checkpoint")
# With --async_train generation and reward overlap training: a step is made of these and its wait for rollouts.
ASYNC_TRAINER_PHASES = ("rollout_wait", "experience", "advantages", "training", "weight_sync", "sync_check",
                        "evaluation", "checkpoint")
# What stops a run when not finite (stages/engine.py stop_if_diverged), as the supervised stages' loss and gradient.
DIVERGENCE_KEYS = ("policy_loss", "critic_loss", "kl_loss", "kl", "entropy", "aux_loss", "critic_aux_loss", "grad_norm",
                   "critic_grad_norm")
ACTOR_KEYS = ("input_ids", "attention_mask", "action_mask", "old_logp", "ref_logp", "rollout_logp", "advantages")
CRITIC_KEYS = ("input_ids", "attention_mask", "action_mask", "old_values", "returns")


# ----------------------------------------------------------------------------- the roles of one run

# The rank workers of each role (stages/rl/actor.py, stages/rl/critic.py).
ROLE_WORKERS = {"actor": PolicyWorker, "critic": CriticWorker, "ref": ReferenceWorker, "reward": RewardModelWorker}


class Roles:
    """The Ray actor groups and rollout engines of one RL run, placed as the colocation flags say."""

    def __init__(self, cfg: RLConfig, device: str, config_cls: type):
        from stages.rl.rollout import create_rollout_engines

        self.cfg = cfg
        ranks = cfg.role_ranks()
        plan = placement_plan(cfg)
        bundles = group_bundles(cfg)
        total = sum(bundles.values())
        if device == "cuda" and total > ray.cluster_resources().get("GPU", 0):
            raise StageInputError(f"this placement needs {total} GPUs ({describe(plan, bundles)}) but the Ray "
                                  f"cluster has {ray.cluster_resources().get('GPU', 0):g}: lower the "
                                  "*_num_gpus_per_node flags or colocate")
        bundle = bundle_resources(cfg, device, total, ray.cluster_resources().get("CPU", 1))
        # With --async_train the engines generate while a model computes: on CPU the two sides share the cores
        # (with threads for all of them each, they spin against each other and both slow down).
        actor_per_node = -(-ranks["actor"] // cfg.actor_num_nodes)
        beside_models, beside_engines = ((cfg.vllm_num_engines, actor_per_node) if cfg.async_train else (0, 0))
        self.placement_groups = []
        fractions: dict[str, dict[str, float]] = {}
        engine_options: dict[str, Any] = {}
        for name, members in plan.items():
            group = placement_group([dict(bundle) for _ in range(bundles[name])], strategy="PACK")
            ray.get(group.ready())
            self.placement_groups.append(group)
            share = 1.0 / len(members)
            fractions[name] = dict(num_cpus=bundle["CPU"] * share, num_gpus=share if device == "cuda" else 0.0)
            if ENGINES in members:
                engine_options = dict(placement_group=group, bundle_indices=list(range(engine_bundles(cfg))),
                                      **fractions[name])
        self.engines = create_rollout_engines(
            cfg.pretrain, backend=cfg.rollout_backend, num_engines=cfg.vllm_num_engines,
            tensor_parallel_size=cfg.vllm_tensor_parallel_size,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep=cfg.vllm_enable_sleep,
            seed=cfg.seed, dtype="bfloat16" if cfg.bf16 else "float32", max_model_len=cfg.total_len,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            cpu_threads=cpu_threads(cfg.vllm_num_engines + beside_engines), wait=False, **engine_options,
        )
        order = startup_order(cfg, device)
        print(f"[rl] start-up: {' -> '.join(order)}", flush=True)
        if order[0] == "engines":  # up and asleep before any model process exists on their GPUs
            ray.get([engine.__ray_ready__.remote() for engine in self.engines])
            self.engines_call("sleep")
        self.groups: dict[str, ActorGroup] = {}
        for (name, members), group in zip(plan.items(), self.placement_groups):
            for hosted in rank_processes(cfg, [role for role in members if role != ENGINES]):
                role = hosted[0]
                per_node = -(-ranks[role] // getattr(cfg, f"{role}_num_nodes"))
                options = dict(placement=Placement(group, **fractions[name]),
                               threads=cpu_threads(per_node + beside_models))
                if len(hosted) == 1:
                    self.groups[role] = ActorGroup(ROLE_WORKERS[role], ranks[role], device, name=role, **options)
                else:
                    self.groups.update(ActorGroup.hosted({r: ROLE_WORKERS[r] for r in hosted}, ranks[role], device,
                                                         **options))
        for group in self.groups.values():
            group.ring_size = cfg.ring_attn_size
        self.sequential = models_take_turns(cfg, device)
        self.buckets: list = []
        self.shared_sync = False  # set by open_weight_sync
        # Every rank joins its group and loads its model right away; start() waits for them.
        self._joined = [ref for group in self.groups.values() for ref in group.rendezvous()]
        cfg_dict = cfg.model_dump()
        self._loaded = [ref for group in self.groups.values() for ref in group.run_async("setup", cfg_dict, config_cls)]

    def start(self, optimizer_steps: int) -> dict[str, float]:
        """Wait for every rank to join and load its model (begun in __init__), build the trained models' engines
        for `optimizer_steps`, wait for the rollout engines; seconds of the waits."""
        seconds = {}
        started = time.perf_counter()
        # Each rank builds its engine as soon as its model is loaded (its calls run in the order they are made).
        built = [ref for role in ("actor", "critic") if role in self.groups
                 for ref in self.groups[role].run_async("build", optimizer_steps)]
        ray.get(self._joined)
        seconds["processes"] = time.perf_counter() - started
        ray.get(self._loaded + built + [engine.__ray_ready__.remote() for engine in self.engines])
        seconds["models_and_engines"] = time.perf_counter() - started - seconds["processes"]
        return seconds

    @property
    def actor(self) -> ActorGroup:
        return self.groups["actor"]

    def get(self, role: str) -> ActorGroup | None:
        return self.groups.get(role)

    def open_weight_sync(self, backend: str) -> int:
        """Plan the buckets and, for engines on GPUs (CPU cores) of their own, join actor rank 0 and every engine
        worker in the weight-sync group over `backend`; returns the bytes of one sync.

        Engines on the actor's GPUs (--colocate_all_models) open the actor ranks' own copies instead: CUDA IPC
        handles on GPUs, shared memory on CPU (stages/rl/weight_sync.py), whatever --vllm_sync_backend says (NCCL cannot
        join two ranks on one GPU anyway).
        """
        from stages.rl.weight_sync import bucket_bytes_total

        self.buckets = self.actor.run("sync_plan", self.cfg.vllm_sync_bucket_mb * 2**20)[0]
        self.shared_sync = self.cfg.colocate_all_models
        if self.shared_sync:
            print("[rl] weight sync: the engines share the actor's devices (--colocate_all_models) and open its "
                  "ranks' weights in place (CUDA IPC on GPUs, shared memory on CPU), no transfer", flush=True)
            return bucket_bytes_total(self.buckets)
        tp = self.cfg.vllm_tensor_parallel_size
        world = 1 + len(self.engines) * tp
        addr, port = ray.get(self.actor.on_rank(0, "weight_sync_endpoint", world))
        ray.get([self.actor.on_rank(0, "open_weight_sync", addr, port, world, backend)]
                + [engine.init_weight_sync.remote(addr, port, 1 + i * tp, world, backend)
                   for i, engine in enumerate(self.engines)])
        return bucket_bytes_total(self.buckets)

    def sync_weights(self, version: int, digests: bool = False) -> list[dict[str, list[str]]]:
        """The actor's current weights into every engine, bucket by bucket, one session per engine that ends with
        the engine at policy `version`; each engine's receipt (stages/rl/sync_check.py). With `digests` actor rank 0
        digests what it sends, for the read-back."""
        if not self.shared_sync:
            done = ray.get(self.actor.run_async("broadcast_weights", self.buckets, digests)
                           + [engine.receive_weights.remote(self.buckets, version) for engine in self.engines])
            return done[self.actor.world_size :]
        self.engines_call("begin_weight_sync")
        for index, bucket in enumerate(self.buckets):  # each rank keeps one bucket shared until the engines took it
            shared = ray.get(self.actor.run_async("share_bucket", index, bucket, digests))
            ray.get([engine.receive_shared.remote(bucket, shared) for engine in self.engines])
        # A layer that straddles buckets may still view the last one (CUDA IPC) until the session ends.
        receipts = ray.get([engine.end_weight_sync.remote(version) for engine in self.engines])
        ray.get(self.actor.run_async("release_shared"))
        return receipts

    def engines_call(self, method: str, *args: Any) -> None:
        ray.get([getattr(engine, method).remote(*args) for engine in self.engines])

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)
        for group in self.groups.values():
            group.shutdown()
        for group in self.placement_groups:
            remove_placement_group(group)


# ----------------------------------------------------------------------------- the step loop

class RewardUnavailableError(RuntimeError):
    """No sample of a rollout got a reward: the endpoints are down. Retryable (the stage resumes later)."""


# ----------------------------------------------------------------------------- prompts and rewards

class PromptStream:
    """The prompts in a seeded order, one episode after the other; `position` counts the prompts taken. Only the
    prompts taken are read from the prepared files."""

    def __init__(self, prompts: ExampleRows, seed: int, num_episodes: int, position: int = 0):
        self.prompts, self.seed, self.num_episodes, self.position = prompts, seed, num_episodes, position
        self._orders: dict[int, list[int]] = {}

    @property
    def size(self) -> int:
        return len(self.prompts) * self.num_episodes

    def take(self, count: int) -> list[dict]:
        taken: list[dict] = []
        while len(taken) < count and self.position < self.size:
            episode, index = divmod(self.position, len(self.prompts))
            if episode not in self._orders:
                generator = torch.Generator().manual_seed(self.seed * 7919 + episode)
                self._orders[episode] = torch.randperm(len(self.prompts), generator=generator).tolist()
            part = self._orders[episode][index : index + count - len(taken)]
            taken += self.prompts.take(part)
            self.position += len(part)
        return taken


@dataclass
class Scorer:
    """Scalar rewards of rollouts: a rule function / HTTP endpoints, or the reward model group; with an agent
    (--agent_func_path) its episodes, rewarded by the agent (`sample`)."""

    source: Any  # RewardFunction | RemoteReward | None
    reward_group: Any  # ActorGroup of RewardModelWorker | None
    pad_token_id: int
    agent: Any = None  # AgentExecutorBase | None
    tokenizer: Any = None

    def sample(self, cfg: RLConfig, engines: list, prompts: list[dict], *, n: int, temperature: float, top_p: float,
               seed: int, logprobs: bool = False) -> tuple[list[Rollout], RewardBatch | None]:
        """`n` responses per prompt from the engines, and with an agent their rewards (else None: score them)."""
        if self.agent is not None:
            return agent_rollouts(self.agent, engines, self.tokenizer, prompts, n=n, temperature=temperature,
                                  top_p=top_p, max_new_tokens=cfg.generate_max_len, max_length=cfg.total_len,
                                  seed=seed, logprobs=logprobs, timeout_s=cfg.agent_timeout)
        return generate_across(engines, [p["prompt"] for p in prompts], seed=seed, n=n,
                               max_new_tokens=cfg.generate_max_len, temperature=temperature, top_p=top_p,
                               max_total_len=cfg.max_len, logprobs=logprobs), None

    def __call__(self, rollouts: list[Rollout], labels: list[str]) -> RewardBatch:
        if self.source is not None:
            return self.source([r.prompt + r.response_text for r in rollouts], [r.prompt for r in rollouts], labels)
        batch = build_sequences([r.prompt_ids for r in rollouts], [list(r.response_ids) for r in rollouts],
                                self.pad_token_id)
        group = self.reward_group
        rewards = torch.cat(group.leaders(group.run_sharded("score", group.split(batch))))
        return RewardBatch(rewards, rewards.clone(), torch.zeros(len(rollouts), dtype=torch.bool))


@dataclass
class PromptGroup:
    """The `n` scored samples of one prompt and the policy version that sampled them."""

    rollouts: list[Rollout]
    labels: list[str]
    rewards: RewardBatch
    policy_version: int  # with --partial_rollout: the oldest version that sampled a token of the group
    mixed_version_samples: int = 0  # --partial_rollout: samples whose tokens come from two or more versions


@dataclass
class RolloutBatch:
    """`rollout_batch_size` groups of `n` samples each, what it took to fill them, and where the prompt stream and
    the groups kept for later steps stood once it was full (what a checkpoint after it resumes from)."""

    groups: list[PromptGroup] = field(default_factory=list)
    prompts_sampled: int = 0
    groups_filtered: int = 0
    reward_failed_samples: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    prompt_position: int = 0
    carried: list[PromptGroup] = field(default_factory=list)

    @property
    def rollouts(self) -> list[Rollout]:
        return [r for g in self.groups for r in g.rollouts]

    @property
    def labels(self) -> list[str]:
        return [label for g in self.groups for label in g.labels]

    @property
    def rewards(self) -> list[RewardBatch]:
        return [g.rewards for g in self.groups]


class RolloutCollector:
    """Samples and scores prompt groups until a rollout is full. With --vllm_generate_batch_size above
    --rollout_batch_size a generate call samples more prompts than one rollout needs; the extra groups are kept
    (`carried`) and fill the next rollouts first. With --partial_rollout responses are generated in segments
    between which a weight update may land (`queue.segment`)."""

    def __init__(self, cfg: RLConfig, roles: Roles, stream: PromptStream, scorer: Scorer, carried: list[PromptGroup],
                 tokenizer):
        self.cfg, self.roles, self.stream, self.scorer, self.carried = cfg, roles, stream, scorer, list(carried)
        self.tokenizer = tokenizer
        self.queue: RolloutQueue | None = None  # set once the queue exists
        # The engines' log-probs of what they sample: for the log-prob gap every step, and the IS correction. vLLM
        # returns them nearly free; HF generate keeps every step's logits for them, so only when the correction
        # needs them.
        self.logprobs = cfg.enable_vllm_is_correction or resolve_backend(cfg.rollout_backend) == "vllm"

    def generate(self, prompts: list[dict], seed: int, policy_version: int,
                 ) -> tuple[list[Rollout], list[set[int]], RewardBatch | None]:  # fmt: skip
        """n samples per prompt, for each the policy versions that sampled its tokens, and an agent's rewards."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        sampling = dict(temperature=cfg.temperature, top_p=cfg.top_p, logprobs=self.logprobs)
        texts = [p["prompt"] for p in prompts]
        if not cfg.partial_rollout:
            rollouts, rewards = self.scorer.sample(cfg, self.roles.engines, prompts, n=n, seed=seed, **sampling)
            return rollouts, [{policy_version} for _ in rollouts], rewards
        prompt_ids = [encode_prompt(self.tokenizer, text) for text in texts]
        budgets = [budget for budget in response_budgets(prompt_ids, cfg.generate_max_len, cfg.max_len)
                   for _ in range(n)]
        samples = [Extension([], [] if self.logprobs else None, "length") for _ in budgets]
        versions: list[set[int]] = [set() for _ in samples]
        active, segment = list(range(len(samples))), 0
        while active:
            sequences = [prompt_ids[k // n] + samples[k].token_ids for k in active]
            lengths = [min(cfg.partial_rollout_segment_len, budgets[k] - len(samples[k].token_ids)) for k in active]
            extensions, version = self.queue.segment(lambda: extend_across(
                self.roles.engines, sequences, lengths, seed=seed + 1000 * segment, **sampling))
            still = []
            for k, extension in zip(active, extensions):
                samples[k].token_ids += extension.token_ids
                if extension.logprobs is not None:
                    samples[k].logprobs += extension.logprobs
                versions[k].add(version)
                if extension.finish_reason == "stop":
                    samples[k].finish_reason = "stop"
                elif len(samples[k].token_ids) < budgets[k]:
                    still.append(k)
            active, segment = still, segment + 1
        return rollouts_of(self.tokenizer, texts, prompt_ids, n, samples), versions, None

    def collect(self, step: int, policy_version: int) -> RolloutBatch | None:
        """The rollout of `step`; None when the prompt stream runs out first."""
        cfg, n = self.cfg, self.cfg.n_samples_per_prompt
        low, high = cfg.dynamic_filtering_reward_range
        timer = PhaseTimer()
        batch = RolloutBatch(groups=self.carried[: cfg.rollout_batch_size])
        self.carried = self.carried[cfg.rollout_batch_size :]
        attempt = 0
        while len(batch.groups) < cfg.rollout_batch_size:
            missing = cfg.rollout_batch_size - len(batch.groups)
            prompts = self.stream.take(max(missing, cfg.generate_batch_size) if attempt == 0 else missing)
            if not prompts:
                return None
            batch.prompts_sampled += len(prompts)
            with timer.phase("generation"):
                rollouts, versions, rewards = self.generate(prompts, cfg.seed * 100_003 + step * 101 + attempt * 7,
                                                            policy_version)
            labels = [prompts[i // n]["label"] for i in range(len(rollouts))]
            if cfg.vllm_enable_sleep and self.scorer.reward_group is not None:
                self.roles.engines_call("sleep")  # the reward model scores on the GPUs the engines free
            if rewards is None:  # an agent's episodes come rewarded
                with timer.phase("reward"):
                    rewards = self.scorer(rollouts, labels)
            if bool(rewards.failed.all()):
                raise RewardUnavailableError(f"no sample of step {step + 1} got a reward: "
                                             + "; ".join(rewards.errors[-3:]))
            for g in range(len(prompts)):
                group = slice(g * n, (g + 1) * n)
                if bool(rewards.failed[group].any()):
                    batch.reward_failed_samples += n
                    continue
                if cfg.dynamic_filtering and not low < float(rewards.scores[group].mean()) < high:
                    batch.groups_filtered += 1
                    continue
                kept = PromptGroup(rollouts[group], labels[group], RewardBatch(
                    rewards.rewards[group], rewards.scores[group], rewards.failed[group], rewards.extra_logs),
                    min(min(v) for v in versions[group]), sum(len(v) > 1 for v in versions[group]))
                (batch.groups if len(batch.groups) < cfg.rollout_batch_size else self.carried).append(kept)
            attempt += 1
        batch.timings = timer.take()
        batch.prompt_position, batch.carried = self.stream.position, list(self.carried)
        return batch


class RolloutsOnDemand:
    """Synchronous training: each step's rollout is collected when the step asks for it, by the policy that step
    trains, and the new weights go to the engines after the step. (With --async_train, RolloutQueue produces them
    ahead on a thread; this has its interface.)"""

    def __init__(self, produce, first: int):
        self.produce, self.version = produce, first

    def take(self, step: int) -> RolloutBatch | None:
        return self.produce(step, self.version)

    def update_weights(self, sync) -> None:
        if sync is not None:
            sync()
        self.version += 1

    def pending(self, after: int) -> list:
        return []  # nothing is produced ahead

    def close(self) -> None:
        pass


def rollout_state(pending: list[RolloutBatch], newest: RolloutBatch) -> dict[str, Any]:
    """Plain data (tensors, lists, numbers) for a checkpoint: the rollouts produced ahead of training and the
    groups kept for later steps once the `newest` rollout was produced."""
    return {"pending": [{**dataclasses.asdict(batch), "carried": []} for batch in pending],
            "carried": [dataclasses.asdict(group) for group in newest.carried]}


def restored_batch(state: dict[str, Any]) -> RolloutBatch:
    fields = {**state, "groups": [restored_group(g) for g in state["groups"]],
              "carried": [restored_group(g) for g in state["carried"]]}
    return RolloutBatch(**fields)


def restored_group(state: dict[str, Any]) -> PromptGroup:
    return PromptGroup([Rollout(**r) for r in state["rollouts"]], state["labels"], RewardBatch(**state["rewards"]),
                       state["policy_version"], state["mixed_version_samples"])


def shape_rewards(cfg: RLConfig, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    if cfg.overlong_buffer_len:
        rewards = rl_algo.overlong_penalty(rewards, lengths, cfg.generate_max_len, cfg.overlong_buffer_len,
                                        cfg.overlong_penalty_factor)
    if cfg.stop_properly_penalty_coef is not None:
        rewards = rl_algo.truncation_penalty(rewards, truncated, cfg.stop_properly_penalty_coef)
    return rewards  # clipped after the group baseline, in compute_advantages


# ----------------------------------------------------------------------------- one step

def rollout_is_one_update(cfg: RLConfig) -> bool:
    """True when each rollout makes exactly one optimizer step and no KL goes into the reward: the policy that
    sampled is the one being updated, so its log-probs come from the training forward itself (no extra pass)."""
    one_step = cfg.max_epochs == 1 and cfg.rollout_batch_size * cfg.n_samples_per_prompt == cfg.train_batch_size
    return one_step and not (cfg.uses_reference and not cfg.use_kl_loss)


def make_experience(cfg: RLConfig, roles: Roles, batch: RolloutBatch, pad_token_id: int, kl_ctl,
                    timer: PhaseTimer) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Sequences, log-probs, values, KL, advantages and returns of one rollout batch."""
    rollouts = batch.rollouts
    experience = build_sequences([r.prompt_ids for r in rollouts], [list(r.response_ids) for r in rollouts],
                                 pad_token_id, [r.response_mask for r in rollouts])
    mask = experience["action_mask"]
    if all(r.logprobs is not None for r in rollouts):  # the engines' own: the gap, and the IS correction's base
        experience["rollout_logp"] = torch.zeros_like(mask)
        for row, r in enumerate(rollouts):
            start = len(r.prompt_ids) - 1
            experience["rollout_logp"][row, start : start + len(r.response_ids)] = torch.tensor(r.logprobs)
    reward_batch = RewardBatch.concat(batch.rewards)
    lengths = torch.tensor([len(r.response_ids) for r in rollouts], dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
    reward = shape_rewards(cfg, reward_batch.rewards, lengths, truncated)

    forwards = [(role, method, phase) for role, method, phase in (
        ("actor", "log_probs", "actor_logprobs"), ("ref", "log_probs", "ref_logprobs"),
        ("critic", "values", "critic_values"),
    ) if roles.get(role) is not None and not (role == "actor" and rollout_is_one_update(cfg))]
    results = {}
    with timer.phase("experience"):
        if roles.sequential:
            for role, method, phase in forwards:
                with timer.phase(f"experience_{phase}"):
                    group = roles.get(role)
                    results[phase] = torch.cat(group.leaders(group.run_sharded(method, group.split(experience))))
        else:  # every model reads the same sequences on GPUs of its own: all at once
            started = time.perf_counter()
            pending = {phase: (roles.get(role), roles.get(role).run_sharded_async(method,
                                                                                  roles.get(role).split(experience)))
                       for role, method, phase in forwards}
            for phase, (group, refs) in pending.items():  # each phase: time until that model's answers were all in
                results[phase] = torch.cat(group.leaders(ray.get(refs)))
                timer.add(f"experience_{phase}", time.perf_counter() - started)
    with timer.phase("advantages"):
        if "actor_logprobs" in results:
            experience["old_logp"] = results["actor_logprobs"]
        experience["ref_logp"] = results.get("ref_logprobs", torch.zeros_like(mask))
        in_reward = cfg.uses_reference and not cfg.use_kl_loss
        kl = (rl_algo.compute_kl(experience["old_logp"], experience["ref_logp"], cfg.kl_estimator) * mask
              if in_reward or (cfg.uses_reference and "old_logp" in experience) else torch.zeros_like(mask))
        values = results.get("critic_values")
        experience["advantages"], experience["returns"] = rl_algo.compute_advantages(
            cfg.advantage_estimator, reward, mask, n_samples_per_prompt=cfg.n_samples_per_prompt,
            kl=kl if in_reward else None, beta=kl_ctl.value if in_reward else 0.0, values=values, gamma=cfg.gamma,
            lambd=cfg.lambd, std_norm=not cfg.no_advantage_std_norm, reward_clip_range=cfg.reward_clip_range,
        )
        if values is not None:
            experience["old_values"] = values
    stats = {
        "reward": float(reward_batch.rewards.mean()),
        "shaped_reward": float(reward.mean()),
        "kl_coef": kl_ctl.value,
        "response_length": float(lengths.mean()),
        "truncated_fraction": float(truncated.float().mean()),
        "advantage_std": float(algo.masked_mean((experience["advantages"] - algo.masked_mean(
            experience["advantages"], mask)).square(), mask).sqrt()),
        **{f"reward_{key}": value for key, value in reward_batch.extra_logs.items()},
    }
    if "old_logp" in experience:  # else the training forward measures these
        stats["kl"] = float(rl_algo.sequence_kl(kl, mask).mean())
        if "rollout_logp" in experience:
            gap = rl_algo.logprob_gap(experience["old_logp"], experience["rollout_logp"], mask)
            tokens = max(float(mask.sum()), 1.0)
            stats.update(logprob_gap_mean=float(gap["abs_sum"]) / tokens, logprob_gap_k3=float(gap["k3_sum"]) / tokens,
                         logprob_gap_max=float(gap["max"]))
    return experience, stats


def train_on_experience(cfg: RLConfig, roles: Roles, experience: dict[str, torch.Tensor], step: int, kl_coef: float,
                        gpu: bool, timer: PhaseTimer) -> tuple[dict[str, float], bool]:
    """`max_epochs` passes of optimizer steps over the experience; returns (mean stats, whether the actor moved).

    The actor's `kl_sum` (KL measured in its training forward when no separate log-prob pass ran) comes back as
    `kl`, the mean over sequences of each one's token-mean KL, like make_experience's.
    """
    critic = roles.get("critic")
    train_actor = not (cfg.freezing_actor_steps > 0 and step < cfg.freezing_actor_steps)
    trained = ([critic] if critic is not None else []) + ([roles.actor] if train_actor else [])
    actor_keys = tuple(key for key in ACTOR_KEYS if key in experience)
    jobs = {id(group): (CRITIC_KEYS, {}) for group in trained if group is critic}
    jobs[id(roles.actor)] = (actor_keys, {"kl_coef": kl_coef, "step_sequences": None})  # None: the step's count
    totals: dict[str, float] = {}
    with timer.phase("training"):
        if roles.sequential or (cfg.deepspeed_enable_sleep and gpu):
            # One model at a time: all CPU cores for it, or (GPU sleep) only its training states on the GPUs.
            for group in trained:
                sleeping = cfg.deepspeed_enable_sleep and gpu
                if sleeping:
                    group.run("reload_states")
                _run_updates(cfg, [group], jobs, experience, step, totals)
                if sleeping:
                    group.run("offload_states")
        else:
            _run_updates(cfg, trained, jobs, experience, step, totals)
    updates = cfg.max_epochs * -(-len(experience["input_ids"]) // cfg.train_batch_size)
    stats = {key: value if key.endswith("_max") else value / updates for key, value in totals.items()
             if key != "kl_sum"}
    if "kl_sum" in totals:
        stats["kl"] = totals["kl_sum"] / len(experience["input_ids"])
    return stats, train_actor


def offload_trained_states(cfg: RLConfig, roles: Roles, gpu: bool) -> list[str]:
    """--deepspeed_enable_sleep on GPUs: the trained models' optimizer states, master weights and gradient buffers go
    to host memory once their engines are built (and their checkpoint is loaded), as OpenRLHF does after init; each
    comes back only for its own training turn (train_on_experience). Returns the roles offloaded."""
    if not (cfg.deepspeed_enable_sleep and gpu):
        return []
    offloaded = [role for role in ("critic", "actor") if roles.get(role) is not None]
    for role in offloaded:
        roles.get(role).run("offload_states")
    return offloaded


def _run_updates(cfg: RLConfig, groups: list, jobs: dict, experience: dict[str, torch.Tensor], step: int,
                 totals: dict[str, float]) -> None:
    generator = torch.Generator().manual_seed(cfg.seed * 31 + step)
    for _ in range(cfg.max_epochs):
        order = torch.randperm(len(experience["input_ids"]), generator=generator)
        for chunk in chunks(order.tolist(), cfg.train_batch_size):
            step_tokens = float(experience["action_mask"][chunk].sum())
            pending = []
            for group in groups:
                keys, kwargs = jobs[id(group)]
                if "step_sequences" in kwargs:
                    step_sequences = rl_algo.step_sequence_count(experience["action_mask"][chunk])
                    kwargs = {**kwargs, "step_sequences": step_sequences}
                step_batch = {key: experience[key][chunk] for key in keys}
                pending.append((group, group.run_sharded_async("train_step", group.split(step_batch),
                                                               step_tokens=step_tokens, **kwargs)))
            for group, refs in pending:
                for stats in group.leaders(ray.get(refs)):
                    for key, value in stats.items():  # ranks' shares add up; a maximum is the largest
                        totals[key] = max(totals.get(key, value), value) if key.endswith("_max") else (
                            totals.get(key, 0.0) + value)


def drift_warnings(cfg: RLConfig, first: dict[str, Any], record: dict[str, Any]) -> dict[str, str]:
    """What the training guards see in this step's record, compared with the first step's: {guard: message}."""
    warnings = {}
    if record["kl"] > cfg.drift_max_kl:
        warnings["kl"] = f"KL to the reference {record['kl']:.2f} > {cfg.drift_max_kl:g}"
    if record["truncated_fraction"] > cfg.drift_max_truncated_fraction:
        warnings["truncation"] = f"{record['truncated_fraction']:.0%} of responses hit the length cap"
    ratio = record["response_length"] / max(first["response_length"], 1e-9)
    if not 1 / cfg.drift_length_ratio <= ratio <= cfg.drift_length_ratio:
        warnings["length"] = (f"mean response length {first['response_length']:.1f} -> "
                              f"{record['response_length']:.1f}")
    return warnings


def logprob_gap_warning(cfg: RLConfig, record: dict[str, Any], step: int, lag: int) -> str | None:
    """What the step's log-prob gap between the engines and the actor says: a warning above --logprob_gap_warn, a
    stop (WeightSyncError, before this step's weights are synced or saved) above --logprob_gap_stop. Samples of an
    older policy (--async_train) differ from the actor by the policy's own change too: they are not stopped on."""
    gap = record.get("logprob_gap_mean")
    if gap is None or gap <= cfg.logprob_gap_warn:
        return None
    what = (f"the rollout engines' log-probs of their samples differ from the actor's by {gap:.4f} nats per token "
            f"on average (max {record['logprob_gap_max']:.3f}, k3 KL {record['logprob_gap_k3']:.4f})")
    if cfg.logprob_gap_stop is not None and gap > cfg.logprob_gap_stop and lag == 0:
        raise WeightSyncError(f"step {step}: {what}, above --logprob_gap_stop {cfg.logprob_gap_stop:g}: the engines "
                              "do not sample from the policy being trained")
    return f"{what}, above --logprob_gap_warn {cfg.logprob_gap_warn:g}" + (
        f" (samples {lag} policy version(s) old)" if lag else "")


def evaluate_held_out(cfg: RLConfig, roles: Roles, prompts: list[dict], scorer: Scorer) -> dict[str, float]:
    """Greedy reward (task accuracy with a 0/1 rule reward) and pass@n of the held-out prompts."""
    labels = [p["label"] for p in prompts]
    greedy, rewards = scorer.sample(cfg, roles.engines, prompts, n=1, temperature=0.0, top_p=1.0, seed=cfg.seed)
    rewards = rewards if rewards is not None else scorer(greedy, labels)
    if bool(rewards.failed.all()):  # a mean over nothing would be NaN, refused at commit on every retry
        raise RewardUnavailableError("no held-out prompt got a reward: " + "; ".join(rewards.errors[-3:]))
    metrics = {
        "eval_reward": float(rewards.rewards[~rewards.failed].mean()),
        "eval_response_length": sum(len(r.response_ids) for r in greedy) / len(greedy),
        "eval_truncated_fraction": sum(r.finish_reason == "length" for r in greedy) / len(greedy),
    }
    k = cfg.eval_n_samples_per_prompt
    if k:
        sampled, scores = scorer.sample(cfg, roles.engines, prompts, n=k, temperature=cfg.eval_temperature,
                                        top_p=1.0, seed=cfg.seed + 1)
        scores = scores if scores is not None else scorer(sampled, [label for label in labels for _ in range(k)])
        per_prompt = scores.rewards.view(-1, k)
        answered = ~scores.failed.view(-1, k).any(dim=1)
        if not bool(answered.any()):
            raise RewardUnavailableError("no held-out prompt got rewards for all its samples: "
                                         + "; ".join(scores.errors[-3:]))
        metrics["eval_pass1"] = float(per_prompt[answered].mean())
        metrics[f"eval_pass{k}"] = float(per_prompt[answered].max(dim=1).values.mean())
    if cfg.vllm_enable_sleep:
        roles.engines_call("sleep")
    return metrics


# ----------------------------------------------------------------------------- the stage

def run(cfg: RLConfig) -> dict[str, Any]:
    import psutil

    from stages.model_io import resolve_model_path

    # From the start of this process to here: interpreter, imports, flag parsing.
    parts = {"imports": time.time() - psutil.Process().create_time()}
    started = time.perf_counter()
    start_step = ds.claim_checkpoints("rl", cfg) if cfg.ckpt_path else 0
    init_ray()
    device = cluster_device(cfg.device)
    note_limits("rl", cfg, device)
    parts["ray"] = time.perf_counter() - started
    placed = time.perf_counter()
    cfg.pretrain = resolve_model_path(cfg.pretrain)  # rank actors and engines then share one local copy
    # The role processes and the engines start (and import what they need) while this process reads the data.
    roles = Roles(cfg, device, RLConfig)
    parts["placement"] = time.perf_counter() - placed
    try:
        loading = time.perf_counter()
        prompts, eval_prompts, reward_source, tokenizer = load_prompts(cfg)
        total_steps = len(prompts) * cfg.num_episodes // cfg.rollout_batch_size
        if total_steps == 0:
            raise StageInputError(f"--prompt_data {cfg.prompt_data} has {len(prompts)} prompts, fewer than "
                                  f"--rollout_batch_size {cfg.rollout_batch_size} × --num_episodes "
                                  f"{cfg.num_episodes}")
        samples_per_step = cfg.rollout_batch_size * cfg.n_samples_per_prompt
        optimizer_steps = total_steps * cfg.max_epochs * samples_per_step // cfg.train_batch_size
        parts["data"] = time.perf_counter() - loading
        parts.update(roles.start(optimizer_steps))
        synced = time.perf_counter()
        sync_bytes = roles.open_weight_sync("nccl" if device == "cuda" and cfg.vllm_sync_backend == "nccl"
                                            else "gloo")
        parts["weight_sync"] = time.perf_counter() - synced
        if cfg.vllm_enable_sleep:
            roles.engines_call("sleep")
        agent = load_agent_executor(cfg.agent_func_path) if cfg.agent_func_path else None
        scorer = Scorer(reward_source, roles.get("reward"), tokenizer.pad_token_id, agent, tokenizer)
        print(f"[rl] {device}: roles {cfg.role_ranks()} + {len(roles.engines)} engine(s); weight sync "
              f"{sync_bytes / 2**20:.1f} MiB in {len(roles.buckets)} bucket(s); start-up "
              + ", ".join(f"{k} {v:.1f}s" for k, v in parts.items()), flush=True)
        parts["total"] = time.perf_counter() - started + parts["imports"]
        return train(cfg, roles, prompts, eval_prompts, scorer, tokenizer, start_step, total_steps,
                     device == "cuda", startup=parts)
    finally:
        roles.shutdown()


def load_prompts(cfg: RLConfig) -> tuple[ExampleRows, list[dict], Any, Any]:
    """(training prompts, held-out prompts, the reward function or endpoints, the tokenizer), data validated.

    The prompts are rendered and tokenized once into the cache of prepared examples (stages/prepared.py): the
    rollout loop reads each step's prompts from its files, and a retried, resumed or unchanged night renders none
    again. The held-out prompts are answered whole at every evaluation, so they are read whole. The data libraries
    are imported here, once the role processes are starting, not before."""
    from stages import data, prepared
    from stages.model_io import load_tokenizer

    reward_source = reward_source_of(cfg)
    def validate(rows, source: str) -> None:
        cfg.validate_rows(rows, source)

    tokenizer = load_tokenizer(cfg.pretrain)

    def prepare(rows, what: str) -> ExampleRows:
        return prepared.prepare_prompts(cfg, tokenizer, rows, stage="rl", what=what)

    rows = data.load_mixture(cfg.prompt_data, split=cfg.prompt_split, max_samples=cfg.max_samples,
                             probabilities=cfg.prompt_data_probabilities, seed=cfg.seed, validate=validate)
    prompts = prepare(rows, "prompts")
    eval_prompts = []
    if cfg.eval_dataset:
        eval_prompts = list(prepare(data.load_mixture(cfg.eval_dataset, split=cfg.eval_split,
                                                      max_samples=cfg.max_samples, validate=validate),
                                    "held-out prompts"))
    return prompts, eval_prompts, reward_source, tokenizer


def start_check(cfg: RLConfig, roles: Roles, prompts: ExampleRows, tokenizer, resumed: bool) -> SyncCheck:
    """The weight check of the run (stages/rl/sync_check.py), its probe batch answered by an engine as it started.
    A fresh run's engines hold the actor's weights from the start: checked now. A resumed actor holds its
    checkpoint's, which the first sync brings the engines."""
    started = time.perf_counter()
    ranks = roles.actor.world_size // roles.actor.ring_size  # one probe row at least per data-parallel rank
    probe = Probe.sample(roles.engines[0], probe_prompts(prompts, max(PROBE_PROMPTS, ranks)),
                         min(cfg.generate_max_len, PROBE_RESPONSE_TOKENS), cfg.max_len)
    check = SyncCheck(cfg, roles, probe, tokenizer.pad_token_id)
    if not resumed:
        check.after_start()
        print(f"[rl] the engines' log-probs of the probe batch are within {check.probe_gap['mean']:.2g} nats of the "
              f"actor's (checked in {time.perf_counter() - started:.1f}s)", flush=True)
    return check


def train(cfg: RLConfig, roles: Roles, prompts: ExampleRows, eval_prompts: list[dict], scorer: Scorer, tokenizer,
          start_step: int, total_steps: int, gpu: bool, startup: dict[str, float]) -> dict[str, Any]:
    client_state = roles.actor.run("load_checkpoint", start_step)[0] if start_step else {}
    if start_step and roles.get("critic") is not None:
        roles.get("critic").run("load_checkpoint", start_step)
    offload_trained_states(cfg, roles, gpu)
    check = start_check(cfg, roles, prompts, tokenizer, resumed=bool(start_step))
    history: list[dict] = client_state.get("history", [])
    kl_ctl = (rl_algo.AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target
              else rl_algo.FixedKLController(cfg.init_kl_coef))
    kl_ctl.value = client_state.get("kl_coef", kl_ctl.value)
    stream = PromptStream(prompts, cfg.seed, cfg.num_episodes, client_state.get("prompt_position", 0))
    queued = client_state.get("rollout_queue", {})
    collector = RolloutCollector(cfg, roles, stream, scorer, [restored_group(g) for g in queued.get("carried", [])],
                                 tokenizer)
    best = client_state.get("best")  # {"step", "eval_reward"} of the actor kept in <ckpt_path>/best
    best_dir = Path(cfg.ckpt_path) / "best"
    timer = PhaseTimer()
    log = StepLog("rl", cfg, total_steps, start_step)
    syncs = 0
    checked: dict[str, float] = {}  # the last sync's check, for the step record

    def sync_weights(version: int) -> None:
        nonlocal syncs
        syncs += 1
        with timer.phase("weight_sync"):
            receipts = roles.sync_weights(version, digests=check.due(syncs))
        with timer.phase("sync_check"):
            checked.update(check.after_sync(syncs, receipts))

    if start_step:
        print(f"[rl] resumed from the checkpoint of step {start_step}", flush=True)
        sync_weights(start_step)
    eval_initial = client_state.get("eval_reward_initial")
    if eval_prompts and eval_initial is None:
        eval_initial = evaluate_held_out(cfg, roles, eval_prompts, scorer)["eval_reward"]
        print(f"[rl] eval_reward={eval_initial:.4f} before training", flush=True)
    started = time.time()
    drifting: set[str] = set()
    gap_warned = False
    stopped_early = None
    if cfg.async_train:  # a thread of its own produces the rollouts --async_queue_size steps ahead
        rollouts = RolloutQueue(collector.collect, start_step, total_steps, cfg.async_queue_size,
                                [restored_batch(b) for b in queued.get("pending", [])], partial=cfg.partial_rollout)
        collector.queue = rollouts
        rollouts.start()
    else:
        rollouts = RolloutsOnDemand(collector.collect, start_step)
    for step in range(start_step, total_steps):
        step_started = time.perf_counter()
        batch = rollouts.take(step)
        if batch is None:
            stopped_early = (f"the prompt stream ran out at step {step + 1} of {total_steps} (dynamic filtering "
                             "dropped too many groups)")
            print(f"[rl] {stopped_early}", flush=True)
            break
        if cfg.vllm_enable_sleep:
            roles.engines_call("sleep")
        experience, record = make_experience(cfg, roles, batch, scorer.pad_token_id, kl_ctl, timer)
        stats, actor_moved = train_on_experience(cfg, roles, experience, step, kl_ctl.value, gpu, timer)
        record.update(stats)
        record.setdefault("kl", 0.0)  # no reference model: no KL
        ds.stop_if_diverged(record, step + 1, DIVERGENCE_KEYS, cfg.ckpt_path)
        gap_warning = logprob_gap_warning(cfg, record, step + 1, max(step - g.policy_version for g in batch.groups))
        if gap_warning and not gap_warned:
            print(f"[rl] WARNING step {step + 1}: {gap_warning}", flush=True)
        gap_warned = gap_warning is not None
        kl_ctl.update(record["kl"], len(batch.rollouts))

        rollouts.update_weights((lambda: sync_weights(step + 1)) if actor_moved else None)
        lags = [step - group.policy_version for group in batch.groups]
        record = {"step": step + 1, **record, "prompts_sampled": batch.prompts_sampled,
                  "groups_filtered": batch.groups_filtered, "reward_failed_samples": batch.reward_failed_samples,
                  "policy_lag": sum(lags) / len(lags), "policy_lag_max": max(lags),
                  "sampled_by_policy": min(group.policy_version for group in batch.groups), **checked}
        checked.clear()
        if cfg.partial_rollout:
            record["mixed_version_samples"] = sum(group.mixed_version_samples for group in batch.groups)
        if eval_prompts and cfg.eval_steps > 0 and (step + 1) % cfg.eval_steps == 0:
            with timer.phase("evaluation"):
                record.update(evaluate_held_out(cfg, roles, eval_prompts, scorer))
                if cfg.save_best and (best is None or record["eval_reward"] > best["eval_reward"]):
                    export_atomically(roles, best_dir)
                    best = {"step": step + 1, "eval_reward": record["eval_reward"]}
        warnings = drift_warnings(cfg, history[0] if history else record, record)
        if warnings:
            record["drift"] = "; ".join(warnings.values())
            new = [message for guard, message in warnings.items() if guard not in drifting]
            if new:
                first_reward = (history[0] if history else record)["reward"]
                print(f"[rl] WARNING step {step + 1}: the policy drifts ({'; '.join(new)}) while the reward went "
                      f"{first_reward:.3f} -> {record['reward']:.3f}: check held-out quality before trusting it",
                      flush=True)
        drifting = set(warnings)
        history.append(record)
        saved = cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0
        if saved:
            with timer.phase("checkpoint"):
                pending = rollouts.pending(step + 1)  # produced ahead: a resumed run trains on these first
                newest = pending[-1] if pending else batch
                state = {"history": history, "kl_coef": kl_ctl.value, "eval_reward_initial": eval_initial,
                         "prompt_position": newest.prompt_position, "best": best,
                         "rollout_queue": rollout_state(pending, newest)}
                refs = roles.actor.run_async("save_checkpoint", step + 1, state)
                if roles.get("critic") is not None:
                    refs += roles.get("critic").run_async("save_checkpoint", step + 1, {})
                ray.get(refs)
                ds.commit_checkpoint(cfg.ckpt_path, step + 1, cfg.max_ckpt_num)
        step_seconds = time.perf_counter() - step_started
        record.update(throughput(experience, step_seconds))
        # Generation and reward of this rollout; with --async_train they overlapped earlier steps' training,
        # and the time this step waited for them is its rollout_wait.
        record.update(batch.timings)
        record.update(timer.take())
        phases = SEQUENTIAL_PHASES
        if cfg.async_train:
            record["time/rollout_wait"] = round(rollouts.take_waited(), 4)
            phases = ASYNC_TRAINER_PHASES
        record["time/idle"] = round(step_seconds - sum(record.get(f"time/{p}", 0.0) for p in phases), 4)
        record["time/step"] = round(step_seconds, 4)
        log.log(step + 1, record)
    rollouts.close()

    metrics = final_metrics(cfg, history, start_step, total_steps, started, startup, eval_initial, best)
    metrics.update({key: value for key, value in check.metrics().items() if value is not None})
    if stopped_early:
        metrics["stopped_early"] = stopped_early
    if eval_prompts:
        last = evaluate_held_out(cfg, roles, eval_prompts, scorer)
        metrics.update(last)
        metrics["eval_reward_last"] = last["eval_reward"]
    if cfg.save_best and best is not None:
        shutil.copytree(best_dir, cfg.save_path, dirs_exist_ok=True)
        metrics.update({"best_step": best["step"], "eval_reward": best["eval_reward"]})
    else:
        roles.actor.run("export", cfg.save_path)
    if cfg.save_value_network:
        roles.get("critic").run("export", critic_path(cfg.save_path))
    ds.write_metrics(cfg.save_path, metrics)
    (Path(cfg.save_path) / "history.json").write_text(json.dumps(history, indent=1))
    log.summary(metrics)
    log.close()
    return {"metrics": metrics, "history": history}


def critic_path(save_path: str) -> str:
    """Where --save_value_network writes the critic: beside the actor, as OpenRLHF does."""
    return str(save_path).rstrip("/") + "_critic"


def export_atomically(roles: Roles, directory: Path) -> None:
    """The actor as an HF model in `directory`, replacing what was there only once the export is complete."""
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    roles.actor.run("export", str(staging))
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)


def throughput(experience: dict[str, torch.Tensor], step_seconds: float) -> dict[str, float]:
    samples = experience["input_ids"].shape[0]
    tokens = float(experience["attention_mask"].sum())
    return {"samples_per_s": samples / step_seconds, "tokens_per_s": tokens / step_seconds}


def final_metrics(cfg: RLConfig, history: list[dict], start_step: int, total_steps: int, started: float,
                  startup: dict[str, float], eval_initial: float | None, best: dict | None) -> dict[str, Any]:
    metrics: dict[str, Any] = {"steps": total_steps, "resumed_from_step": start_step,
                               "train_seconds": round(time.time() - started, 2),
                               "startup_seconds": round(startup["total"], 2),
                               **{f"startup/{part}": round(seconds, 2) for part, seconds in startup.items()
                                  if part != "total"}}
    if history:
        window = history[-max(1, min(5, len(history))):]
        this_run = history[start_step:]
        metrics.update({
            "reward_first": history[0]["reward"],
            "reward_last": sum(r["reward"] for r in window) / len(window),
            "kl_last": history[-1]["kl"],
            "response_length_last": history[-1]["response_length"],
            "drift_warning_steps": sum(1 for r in history if "drift" in r),
            "reward_failed_samples": sum(r["reward_failed_samples"] for r in history),
            "groups_filtered": sum(r["groups_filtered"] for r in history),
            **phase_seconds(this_run),
        })
        if this_run:
            metrics["samples_per_s"] = sum(r["samples_per_s"] for r in this_run) / len(this_run)
            metrics["tokens_per_s"] = sum(r["tokens_per_s"] for r in this_run) / len(this_run)
        gaps = [r["logprob_gap_mean"] for r in history if "logprob_gap_mean" in r]
        if gaps:
            metrics.update(logprob_gap_mean_last=gaps[-1], logprob_gap_mean_highest=max(gaps))
    if eval_initial is not None:
        metrics["eval_reward_initial"] = eval_initial
    if best is not None:
        metrics["best_step"] = best["step"]
    return metrics
