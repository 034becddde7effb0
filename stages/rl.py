"""RL fine-tuning from rollouts: GRPO, RLOO, REINFORCE++ and friends (`--advantage_estimator`).

One step, as the driver runs it:
  1. take `rollout_batch_size` prompts, generate `n_samples_per_prompt` responses each with the rollout engines
     (vLLM, or HF generate where vLLM is not installed);
  2. score them: a rule function (`--remote_rm_url file.py`), an HTTP endpoint, or the reward model;
  3. log-probs of the responses under the actor (at rollout time) and the reference model;
  4. advantages (stages/algorithms.py), then `max_epochs` passes of PPO-clip updates in optimizer steps of
     `train_batch_size` samples, with the KL either in the reward or in the loss (`--use_kl_loss`);
  5. push the new actor weights into the rollout engines; checkpoint every `save_steps`.

    python -m stages.rl --config tiny --pretrain ./sft --remote_rm_url reward.py --prompt_data prompts.jsonl \
        --advantage_estimator group_norm --use_kl_loss --kl_estimator k3 --save_path ./policy
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import ray
import torch

from stages import algorithms as algo
from stages import data
from stages import engine as ds
from stages.distributed import ActorGroup, Placement, RankWorker, cluster_device, init_ray, make_placement
from stages.launch import StageInputError, stage_main
from stages.rewards import load_reward_function
from stages.trainer import chunks, next_token_log_probs

EXPERIENCE_KEYS = ("input_ids", "attention_mask", "action_mask", "old_logp", "ref_logp", "advantages")


# ----------------------------------------------------------------------------- rank actors

class PolicyWorker(RankWorker):
    """One rank of the actor (the policy being trained)."""

    def setup(self, cfg_dict: dict, config_cls: type, total_optimizer_steps: int) -> None:
        from stages.model_io import load_causal_lm, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        ds.seed_everything(cfg.seed)
        ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                        micro_batch_size=cfg.micro_train_batch_size)
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        path = resolve_model_path(cfg.pretrain)
        model = ds.load_for_zero(lambda: load_causal_lm(path, dtype=dtype), ds_config)
        self.engine = ds.build_train_engine(model, cfg, ds_config, learning_rate=cfg.actor_learning_rate,
                                            total_steps=total_optimizer_steps)

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return sequence_log_probs(self.engine, batch, self.cfg.micro_train_batch_size, self.cfg.temperature)

    def train_step(self, shard: dict[str, torch.Tensor], step_tokens: float) -> dict[str, float]:
        """One optimizer step over this rank's share of the step's samples (micro-batches accumulate)."""
        cfg = self.cfg
        self.engine.train()
        eps_low, eps_high = cfg.eps_clip_low_high or (cfg.eps_clip, cfg.eps_clip)
        scale = ds.global_loss_scale(self.engine)
        device = next(self.engine.module.parameters()).device
        totals = {"policy_loss": 0.0, "kl_loss": 0.0, "clip_fraction": 0.0, "entropy": 0.0}
        num_samples = shard["input_ids"].shape[0]
        for start in range(0, num_samples, cfg.micro_train_batch_size):
            micro = {k: v[start : start + cfg.micro_train_batch_size].to(device) for k, v in shard.items()}
            mask = micro["action_mask"]
            logits = self.engine(input_ids=micro["input_ids"],
                                 attention_mask=micro["attention_mask"]).logits[:, :-1] / cfg.temperature
            logp = algo.token_log_probs(logits, micro["input_ids"][:, 1:])
            loss_t, clipped = algo.policy_loss(logp, micro["old_logp"], micro["advantages"], eps_low, eps_high,
                                               cfg.dual_clip)
            policy_loss = algo.aggregate_token_loss(loss_t, mask, step_tokens)
            loss = policy_loss
            if cfg.use_kl_loss and cfg.init_kl_coef > 0:
                kl_loss = algo.aggregate_token_loss(algo.compute_kl(logp, micro["ref_logp"], cfg.kl_estimator),
                                                    mask, step_tokens)
                loss = loss + cfg.init_kl_coef * kl_loss
                totals["kl_loss"] += kl_loss.item()
            self.engine.backward(loss * scale)
            self.engine.step()
            with torch.no_grad():
                totals["policy_loss"] += policy_loss.item()
                totals["clip_fraction"] += float(algo.masked_sum(clipped, mask)) / step_tokens
                totals["entropy"] += float(algo.masked_sum(algo.entropy_from_logits(logits), mask)) / step_tokens
        return totals

    def rollout_weights(self) -> dict[str, torch.Tensor] | None:
        """Full weights for the rollout engines (rank 0 only; every rank joins the ZeRO-3 gather)."""
        state = ds.gathered_state_dict(self.engine)
        return state if self.rank == 0 else None

    def save_checkpoint(self, step: int, client_state: dict) -> None:
        ds.save_checkpoint(self.engine, self.cfg.ckpt_path, step, client_state, tag="actor")

    def load_checkpoint(self, step: int) -> dict:
        return ds.load_checkpoint(self.engine, self.cfg.ckpt_path, step, tag="actor")

    def export(self, save_path: str) -> None:
        from stages.model_io import load_tokenizer

        ds.export_hf(self.engine, load_tokenizer(self.cfg.pretrain), save_path)


class ReferenceWorker(RankWorker):
    """One rank of the frozen reference model."""

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_causal_lm, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                        micro_batch_size=cfg.micro_train_batch_size, train=False)
        dtype = torch.bfloat16 if cfg.bf16 else torch.float32
        path = resolve_model_path(cfg.ref_pretrain or cfg.pretrain)
        self.model = ds.build_inference_engine(ds.load_for_zero(lambda: load_causal_lm(path, dtype=dtype),
                                                                ds_config), ds_config, self.device)

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_log_probs(self.model, batch, self.cfg.micro_train_batch_size, self.cfg.temperature)


class RewardModelWorker(RankWorker):
    """One rank of the reward model. It scores the token ids of prompt + response (+ eos), so it must share the
    actor's tokenizer, as a reward model trained from the SFT checkpoint does."""

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_value_model, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        self.model = load_value_model(resolve_model_path(cfg.reward_pretrain)).eval().to(self.device)
        stats = {k: getattr(self.model.config, k, None) for k in ("reward_mean", "reward_std")}
        if cfg.normalize_reward and None in stats.values():
            raise StageInputError(f"--normalize_reward: reward model {cfg.reward_pretrain} has no reward_mean/"
                                  "reward_std in its config.json (train it with stages.reward_model and an eval set)")
        self.stats = stats

    @torch.no_grad()
    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        rewards = []
        for start in range(0, batch["input_ids"].shape[0], self.cfg.micro_rollout_batch_size):
            ids = batch["input_ids"][start : start + self.cfg.micro_rollout_batch_size].to(self.device)
            mask = batch["attention_mask"][start : start + self.cfg.micro_rollout_batch_size].to(self.device)
            rewards.append(self.model(input_ids=ids, attention_mask=mask).logits[:, 0].float().cpu())
        reward = torch.cat(rewards)
        if self.cfg.normalize_reward:
            reward = (reward - self.stats["reward_mean"]) / max(self.stats["reward_std"], 1e-8)
        return reward


def sequence_log_probs(model, batch: dict[str, torch.Tensor], micro_batch_size: int,
                      temperature: float) -> torch.Tensor:
    """Log-probs of the sampling distribution (logits / temperature), as the rollout engines sampled from."""
    device = next(model.parameters()).device
    out = []
    for start in range(0, batch["input_ids"].shape[0], micro_batch_size):
        ids = batch["input_ids"][start : start + micro_batch_size].to(device)
        mask = batch["attention_mask"][start : start + micro_batch_size].to(device)
        out.append(next_token_log_probs(model, ids, mask, temperature).cpu())
    return torch.cat(out)


# ----------------------------------------------------------------------------- driver helpers

def split_rows(tensors: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Contiguous, equal-as-possible row slices, one per rank."""
    rows = next(iter(tensors.values())).shape[0]
    bounds = [rows * i // parts for i in range(parts + 1)]
    return [{k: v[bounds[i] : bounds[i + 1]] for k, v in tensors.items()} for i in range(parts)]


def gather_log_probs(group: ActorGroup, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat(group.run_sharded("log_probs", split_rows(batch, group.world_size)))


def build_sequences(prompt_ids: list[list[int]], response_ids: list[list[int]], pad_id: int) -> dict:
    """Right-padded prompt+response sequences; action_mask[t] marks positions whose next token is a response
    token (aligned with log-probs, which have length T-1)."""
    input_ids, attention_mask = data.pad_sequences([p + r for p, r in zip(prompt_ids, response_ids)], pad_id)
    action_mask = torch.zeros(input_ids.shape[0], input_ids.shape[1] - 1)
    for i, (p, r) in enumerate(zip(prompt_ids, response_ids)):
        action_mask[i, len(p) - 1 : len(p) - 1 + len(r)] = 1.0
    return {"input_ids": input_ids, "attention_mask": attention_mask, "action_mask": action_mask}


def shape_rewards(cfg, rewards: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> torch.Tensor:
    if cfg.overlong_buffer_len:
        rewards = algo.overlong_penalty(rewards, lengths, cfg.generate_max_len, cfg.overlong_buffer_len,
                                        cfg.overlong_penalty_factor)
    if cfg.stop_properly_penalty_coef is not None:
        rewards = algo.truncation_penalty(rewards, truncated, cfg.stop_properly_penalty_coef)
    low, high = cfg.reward_clip_range
    return rewards.clamp(low, high)


class Roles:
    """The Ray actor groups and rollout engines of one RL run, placed together or apart."""

    def __init__(self, cfg, device: str):
        from stages.rollout import create_rollout_engines

        ranks = cfg.role_ranks()  # actor, plus ref with a KL term and reward without --remote_rm_url
        actor_placement = ref_placement = reward_placement = None
        engine_resources: dict[str, Any] = {}
        if cfg.colocate_all_models:
            # One bundle per actor rank; every role (engines included) takes an equal fraction of each bundle.
            shared = make_placement(ranks["actor"], device)
            share = math.floor(100 / (len(ranks) + 1)) / 100
            gpu_share = share if device == "cuda" else 0.0
            actor_placement = Placement(shared.group, num_cpus=share, num_gpus=gpu_share, owned=True)
            ref_placement = reward_placement = Placement(shared.group, num_cpus=share, num_gpus=gpu_share)
            engine_resources = dict(placement_group=shared.group, num_cpus=share, num_gpus=gpu_share)
        self.actor = ActorGroup(PolicyWorker, ranks["actor"], device, placement=actor_placement, name="actor")
        self.ref = (ActorGroup(ReferenceWorker, ranks["ref"], device, placement=ref_placement, name="ref")
                    if "ref" in ranks else None)
        self.reward = (ActorGroup(RewardModelWorker, ranks["reward"], device, placement=reward_placement,
                                  name="reward") if "reward" in ranks else None)
        self.engines = create_rollout_engines(
            cfg.pretrain, backend=cfg.rollout_backend, num_engines=cfg.vllm_num_engines,
            tensor_parallel_size=cfg.vllm_tensor_parallel_size,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep=cfg.vllm_enable_sleep,
            seed=cfg.seed, dtype="bfloat16" if cfg.bf16 else "float32",
            max_model_len=cfg.prompt_max_len + cfg.generate_max_len, **engine_resources,
        )

    def shutdown(self) -> None:
        # The actor group owns the shared placement group: shut it down last.
        for engine in self.engines:
            ray.kill(engine)
        for group in (self.ref, self.reward, self.actor):
            if group is not None:
                group.shutdown()


def generate(engines, prompts: list[str], cfg, seed: int, *, n: int, temperature: float) -> list:
    per_engine = chunks(prompts, math.ceil(len(prompts) / len(engines)))
    refs = [engine.generate.remote(part, n=n, max_new_tokens=cfg.generate_max_len, temperature=temperature,
                                   top_p=cfg.top_p, seed=seed + i)
            for i, (engine, part) in enumerate(zip(engines, per_engine))]
    return [rollout for part in ray.get(refs) for rollout in part]


@dataclass
class Scorer:
    """Scalar rewards of rollouts: a rule/HTTP reward function, or the reward model group."""

    reward_fn: Callable | None
    reward_group: ActorGroup | None
    pad_token_id: int

    def __call__(self, rollouts: list, prompts: list[str], labels: list[str]) -> torch.Tensor:
        if self.reward_fn is not None:
            queries = [p + r.response_text for p, r in zip(prompts, rollouts)]
            return torch.as_tensor(self.reward_fn(queries, prompts, labels), dtype=torch.float32)
        batch = build_sequences([r.prompt_ids for r in rollouts], [list(r.response_ids) for r in rollouts],
                                self.pad_token_id)
        return torch.cat(self.reward_group.run_sharded("score", split_rows(batch, self.reward_group.world_size)))


def evaluate_greedy(cfg, roles: Roles, eval_prompts: list[dict], scorer: Scorer) -> float:
    """Mean reward of greedy answers to the held-out prompts (task accuracy with a 0/1 rule reward)."""
    rollouts = generate(roles.engines, [p["prompt"] for p in eval_prompts], cfg, seed=cfg.seed, n=1, temperature=0.0)
    return float(scorer(rollouts, [p["prompt"] for p in eval_prompts], [p["label"] for p in eval_prompts]).mean())


def push_weights(roles: Roles) -> None:
    """Every actor rank joins the gather; rank 0's weights go to the engines straight from the object store."""
    refs = roles.actor.run_async("rollout_weights")
    ray.get([engine.update_weights.remote(refs[0]) for engine in roles.engines] + refs[1:])


# ----------------------------------------------------------------------------- the loop

def run(cfg) -> dict[str, Any]:
    from stages.config import RLConfig
    from stages.model_io import load_tokenizer, resolve_model_path

    if cfg.advantage_estimator == "gae":
        raise StageInputError("--advantage_estimator gae needs the critic of PPO, which this stage does not run yet;"
                              " use group_norm, rloo, reinforce, reinforce_baseline or dr_grpo")
    reward_fn = load_reward_function(cfg.remote_rm_url) if cfg.remote_rm_url else None
    rows = data.load_rows(cfg.prompt_data, split=cfg.prompt_split, max_samples=cfg.max_samples)
    data.validate_prompts(rows, cfg.prompt_data, cfg.input_key, cfg.label_key)
    cfg.pretrain = resolve_model_path(cfg.pretrain)  # rank actors and engines then share one local copy
    tokenizer = load_tokenizer(cfg.pretrain)
    prompts = data.build_prompt_examples(rows, tokenizer, input_key=cfg.input_key, label_key=cfg.label_key,
                                         apply_chat_template=cfg.apply_chat_template,
                                         prompt_max_len=cfg.prompt_max_len)
    eval_prompts = []
    if cfg.eval_dataset:
        eval_rows = data.load_rows(cfg.eval_dataset, split=cfg.eval_split, max_samples=cfg.max_samples)
        data.validate_prompts(eval_rows, cfg.eval_dataset, cfg.input_key, cfg.label_key)
        eval_prompts = data.build_prompt_examples(eval_rows, tokenizer, input_key=cfg.input_key,
                                                  label_key=cfg.label_key, apply_chat_template=cfg.apply_chat_template,
                                                  prompt_max_len=cfg.prompt_max_len)
    steps_per_episode = len(prompts) // cfg.rollout_batch_size
    if steps_per_episode == 0:
        raise StageInputError(f"--prompt_data {cfg.prompt_data} has {len(prompts)} prompts, fewer than"
                              f" --rollout_batch_size {cfg.rollout_batch_size}")
    total_steps = steps_per_episode * cfg.num_episodes
    samples_per_step = cfg.rollout_batch_size * cfg.n_samples_per_prompt
    optimizer_steps = total_steps * cfg.max_epochs * samples_per_step // cfg.train_batch_size

    init_ray()
    roles = Roles(cfg, cluster_device(cfg.device))
    try:
        cfg_dict = cfg.model_dump()
        setups = roles.actor.run_async("setup", cfg_dict, RLConfig, optimizer_steps)
        if roles.ref:
            setups += roles.ref.run_async("setup", cfg_dict, RLConfig)
        if roles.reward:
            setups += roles.reward.run_async("setup", cfg_dict, RLConfig)
        ray.get(setups)
        scorer = Scorer(reward_fn, roles.reward, tokenizer.pad_token_id)
        return train(cfg, roles, prompts, eval_prompts, tokenizer, scorer, total_steps, steps_per_episode)
    finally:
        roles.shutdown()


def train(cfg, roles: Roles, prompts: list[dict], eval_prompts: list[dict], tokenizer, scorer: Scorer,
          total_steps: int, steps_per_episode: int) -> dict[str, Any]:
    from stages.engine import fault_injection_requested

    start_step = ds.claim_checkpoints("rl", cfg) if cfg.ckpt_path else 0
    client_state = roles.actor.run("load_checkpoint", start_step)[0] if start_step else {}
    history: list[dict] = client_state.get("history", [])
    kl_ctl = (algo.AdaptiveKLController(cfg.init_kl_coef, cfg.kl_target, cfg.kl_horizon) if cfg.kl_target
              else algo.FixedKLController(cfg.init_kl_coef))
    kl_ctl.value = client_state.get("kl_coef", kl_ctl.value)
    if start_step:
        print(f"[rl] resumed from the checkpoint of step {start_step}", flush=True)
        push_weights(roles)
    started = time.time()
    eval_initial = client_state.get("eval_reward_initial")
    if eval_prompts and eval_initial is None:
        eval_initial = evaluate_greedy(cfg, roles, eval_prompts, scorer)
        print(f"[rl] eval_reward={eval_initial:.4f} before training", flush=True)
    for step in range(start_step, total_steps):
        episode, index = divmod(step, steps_per_episode)
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(cfg.seed * 7919 + episode))
        batch = [prompts[i] for i in order[index * cfg.rollout_batch_size : (index + 1) * cfg.rollout_batch_size]]
        record = rl_step(cfg, roles, batch, tokenizer, scorer, kl_ctl, step)
        if eval_prompts and cfg.eval_steps > 0 and (step + 1) % cfg.eval_steps == 0:
            record["eval_reward"] = evaluate_greedy(cfg, roles, eval_prompts, scorer)
        history.append(record)
        if (step + 1) % max(cfg.logging_steps, 1) == 0:
            print("[rl] " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                     for k, v in record.items()), flush=True)
        if cfg.ckpt_path and cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0:
            state = {"history": history, "kl_coef": kl_ctl.value, "eval_reward_initial": eval_initial}
            roles.actor.run("save_checkpoint", step + 1, state)
            ds.commit_checkpoint(cfg.ckpt_path, step + 1, cfg.max_ckpt_num)
            if fault_injection_requested("rl") and start_step == 0:
                return {"fault_injected": True, "step": step + 1}
    roles.actor.run("export", cfg.save_path)
    metrics = {"steps": total_steps, "resumed_from_step": start_step, "train_seconds": round(time.time() - started, 2)}
    if history:
        window = history[-max(1, min(5, len(history))):]
        metrics.update({
            "reward_first": history[0]["reward"],
            "reward_last": sum(r["reward"] for r in window) / len(window),
            "kl_last": history[-1]["kl"],
            "response_length_last": history[-1]["response_length"],
        })
    if eval_prompts:
        metrics["eval_reward_initial"] = eval_initial
        metrics["eval_reward"] = evaluate_greedy(cfg, roles, eval_prompts, scorer)
    ds.write_metrics(cfg.save_path, metrics)
    (Path(cfg.save_path) / "history.json").write_text(json.dumps(history, indent=1))
    return {"metrics": metrics, "history": history}


def rl_step(cfg, roles: Roles, batch: list[dict], tokenizer, scorer: Scorer, kl_ctl, step: int) -> dict[str, Any]:
    n = cfg.n_samples_per_prompt
    rollouts = generate(roles.engines, [p["prompt"] for p in batch], cfg, seed=cfg.seed * 100_003 + step * 101,
                        n=n, temperature=cfg.temperature)
    prompt_ids = [r.prompt_ids for r in rollouts]
    response_ids = [list(r.response_ids) for r in rollouts]
    prompt_texts = [batch[i // n]["prompt"] for i in range(len(rollouts))]
    labels = [batch[i // n]["label"] for i in range(len(rollouts))]
    raw_reward = scorer(rollouts, prompt_texts, labels)
    experience = build_sequences(prompt_ids, response_ids, tokenizer.pad_token_id)
    lengths = torch.tensor([len(r) for r in response_ids], dtype=torch.float32)
    truncated = torch.tensor([r.finish_reason == "length" for r in rollouts])
    reward = shape_rewards(cfg, raw_reward, lengths, truncated)

    mask = experience["action_mask"]
    experience["old_logp"] = gather_log_probs(roles.actor, experience)
    experience["ref_logp"] = (gather_log_probs(roles.ref, experience) if roles.ref
                              else torch.zeros_like(experience["old_logp"]))
    kl = algo.compute_kl(experience["old_logp"], experience["ref_logp"], cfg.kl_estimator) * mask
    in_reward = roles.ref is not None and not cfg.use_kl_loss
    experience["advantages"], _ = algo.compute_advantages(
        cfg.advantage_estimator, reward, mask, n_samples_per_prompt=n, kl=kl if in_reward else None,
        beta=kl_ctl.value if in_reward else 0.0, gamma=cfg.gamma, lambd=cfg.lambd,
        std_norm=not cfg.no_advantage_std_norm,
    )
    sequence_kl = float(algo.masked_sum(kl, mask) / len(rollouts))
    kl_ctl.update(sequence_kl, len(rollouts))

    totals: dict[str, float] = {}
    updates = 0
    generator = torch.Generator().manual_seed(cfg.seed * 31 + step)
    for _ in range(cfg.max_epochs):
        order = torch.randperm(len(rollouts), generator=generator)
        for chunk in chunks(order.tolist(), cfg.train_batch_size):
            step_batch = {k: experience[k][chunk] for k in EXPERIENCE_KEYS}
            step_tokens = float(step_batch["action_mask"].sum())
            for stats in roles.actor.run_sharded("train_step", split_rows(step_batch, roles.actor.world_size),
                                                 step_tokens=step_tokens):
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            updates += 1
    push_weights(roles)
    return {
        "step": step + 1,
        "reward": float(raw_reward.mean()),
        "shaped_reward": float(reward.mean()),
        "kl": sequence_kl,
        "kl_coef": kl_ctl.value,
        "response_length": float(lengths.mean()),
        "truncated_fraction": float(truncated.float().mean()),
        **{k: v / updates for k, v in totals.items()},
    }


if __name__ == "__main__":
    from stages import rl

    stage_main("rl", rl.run)
