"""Where a stage's ranks and rollout engines go: its placement groups, their bundles, and what one bundle holds.

Plain arithmetic on the config and the cluster's cores, shared by the RL roles, the evaluation and the plan, so
the plan asks the cluster for exactly what the stage will place.

RL placement (OpenRLHF's flags):
- separate (default): each model, and the rollout engines, on bundles of their own;
- `--colocate_actor_ref`: actor and reference share bundles; `--colocate_critic_reward`: critic and reward model;
- `--colocate_all_models` (hybrid engine): every model and the engines share the actor's bundles.
Models sharing a bundle each take an equal fraction of it. A bundle is one GPU (and a core) on GPUs; on CPU the
bundles of RL and evaluation are fractions of a core sized so that the whole placement fits the cluster's cores
(their models take turns there), while an offline stage's ranks each take a core.
"""

from __future__ import annotations

import math

from stages.config import OfflineTrainingConfig, StageConfig

ENGINES = "engines"  # the rollout engines' share of a placement


def placement_plan(cfg) -> dict[str, list[str]]:
    """RL: placement group name -> the roles sharing its bundles (the rollout engines as ENGINES)."""
    roles = list(cfg.role_ranks())
    if cfg.colocate_all_models:
        return {"shared": [*roles, ENGINES]}
    plan: dict[str, list[str]] = {"actor": ["actor"]}
    if "ref" in roles:
        plan.setdefault("actor" if cfg.colocate_actor_ref else "ref", []).append("ref")
    if "critic" in roles:
        plan["critic"] = ["critic"]
    if "reward" in roles:
        plan.setdefault("critic" if cfg.colocate_critic_reward and "critic" in roles else "reward", []).append("reward")
    plan[ENGINES] = [ENGINES]
    return plan


def rank_processes(cfg, roles: list[str]) -> list[list[str]]:
    """The models of one placement group by the rank processes that hold them. Colocated models (of equal ranks,
    which the colocation flags require) share one process per rank (a RankHost: one interpreter, one CUDA
    context, their calls one at a time, as colocated models take turns anyway). Not with --async_train: rollouts
    are scored on another thread while the models train, and calls from two threads could reach a shared
    process's ranks in different orders, each rank then waiting in another model's collective."""
    if cfg.async_train or not roles:
        return [[role] for role in roles]
    return [roles]


def models_take_turns(cfg, device: str) -> bool:
    """Whether the RL models run one after another rather than side by side: on CPU every model shares the same
    cores (each gets all of them in its turn); with --colocate_all_models every model shares the same GPUs, so
    the phases take turns as in OpenRLHF (generate, engines asleep, reward, reference, critic, actor) instead of
    holding every model's activations at once."""
    return device == "cpu" or cfg.colocate_all_models


def startup_order(cfg, device: str) -> tuple[str, ...]:
    """How the engines and the models start. With --vllm_enable_sleep and --colocate_all_models on GPUs the engines
    come first, and sleep before any model loads on their GPUs (as OpenRLHF): vLLM profiles the GPU's free memory
    at start-up, asserts that no co-tenant frees memory meanwhile and would count the models' growth as its own.
    Otherwise both start at once, which saves start-up time."""
    if cfg.vllm_enable_sleep and cfg.colocate_all_models and device == "cuda":
        return ("engines", "engines asleep", "models")
    return ("engines and models",)


def engine_bundles(cfg) -> int:
    return cfg.vllm_num_engines * cfg.vllm_tensor_parallel_size


def group_bundles(cfg: StageConfig) -> dict[str, int]:
    """Placement group name -> its bundles: one per rank or engine (tensor-parallel rank) it holds."""
    if isinstance(cfg, OfflineTrainingConfig):
        return {"ranks": cfg.world_size}
    if hasattr(cfg, "role_ranks"):  # RL: each role's ranks, or the engines, by the colocation flags
        ranks = cfg.role_ranks()
        return {name: engine_bundles(cfg) if members == [ENGINES] else ranks[members[0]]
                for name, members in placement_plan(cfg).items()}
    # the evaluation: the engines, and the reward model's ranks when one scores
    return {ENGINES: engine_bundles(cfg), **({"reward": cfg.world_size} if cfg.reward_pretrain else {})}


def bundle_resources(cfg: StageConfig, device: str, total_bundles: int, cores: float) -> dict[str, float]:
    """One bundle of the stage `cfg` configures: a GPU and a core on GPUs; on CPU a core per offline rank, else an
    equal share of the cluster's `cores` (at most one) so that `total_bundles` bundles fit."""
    if device == "cuda":
        return {"GPU": 1.0, "CPU": 1.0}
    if isinstance(cfg, OfflineTrainingConfig):
        return {"CPU": 1.0}
    return {"CPU": math.floor(min(1.0, cores / total_bundles) * 100) / 100}


def describe(plan: dict[str, list[str]], bundles: dict[str, int]) -> str:
    return ", ".join(f"{'+'.join(members)}: {bundles[name]}" for name, members in plan.items())
