"""The models of the RL stage as Ray actor groups (actor, critic, reference, reward model) placed as
stages/placement.py plans, beside the rollout engines."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import ray
import torch
import torch.nn.functional as F
from ray.util.placement_group import placement_group, remove_placement_group

from stages import algorithms as algo
from stages import engine as ds
from stages import lora, moe, ring_attention
from stages import packing as packing_lib
from stages.distributed import ActorGroup, Placement, RankWorker, cpu_threads, host_store, node_address
from stages.errors import StageInputError
from stages.placement import (
    ENGINES,
    bundle_resources,
    describe,
    engine_bundles,
    group_bundles,
    models_take_turns,
    placement_plan,
    rank_processes,
)
from stages.rl import algorithms as rl_algo
from stages.sequences import balanced_partitions, first_fit_count, select_rows


def _dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


def reward_normalization(config) -> tuple[float, float] | None:
    """(mean, std) stored with a reward model: ours (reward_mean/reward_std) or OpenRLHF's (mean/std)."""
    for mean_key, std_key in (("reward_mean", "reward_std"), ("mean", "std")):
        mean, std = getattr(config, mean_key, None), getattr(config, std_key, None)
        if isinstance(mean, (int, float)) and isinstance(std, (int, float)):
            return float(mean), max(float(std), 1e-8)
    return None


class TokenValueModel(torch.nn.Module):
    """A scalar-head (sequence classification) model read at every position: values [B, T].

    The critic of PPO. Its head is the reward model's (`score`), so a critic started from the reward model
    begins with the reward model's estimates; with `normalization` the values are standardised like the rewards.
    """

    def __init__(self, model: torch.nn.Module, normalization: tuple[float, float] | None = None):
        super().__init__()
        if not isinstance(getattr(model, "score", None), torch.nn.Module):
            raise StageInputError(f"critic model {type(model).__name__} has no `score` value head")
        self.model = model
        self.normalization = normalization

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **forward_kwargs) -> torch.Tensor:
        model = lora.hf_model(self.model)  # with --lora_rank its layers hold the adapters, its head the trained copy
        base = getattr(model, model.base_model_prefix)
        hidden = base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                      use_cache=False, **forward_kwargs).last_hidden_state
        values = model.score(hidden).squeeze(-1).float()
        if self.normalization is not None:
            mean, std = self.normalization
            values = (values - mean) / std
        return values

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.model.gradient_checkpointing_enable(**kwargs)


class TrainedRole(RankWorker):
    """A model trained with DeepSpeed inside the RL loop (actor or critic): checkpoints and GPU sleep.

    `setup` loads the model while the driver still reads the data; `build` wraps it in its DeepSpeed engine once
    the number of optimizer steps (the learning-rate schedule's length) is known.
    """

    tag = ""
    aux_key = ""  # the logged name of its --aux_loss_coef term

    def learning_rate(self) -> float: ...

    def router_losses(self):
        """Collects the load-balancing losses of the model's forwards in the block (--aux_loss_coef > 0)."""
        return moe.router_aux_losses(self.engine, enabled=self.cfg.aux_loss_coef > 0)

    def with_aux_loss(self, loss: torch.Tensor, aux_losses: list[torch.Tensor], rows: list[int], micro_batches: int,
                      totals: dict[str, float]) -> torch.Tensor:
        """`loss` + --aux_loss_coef × this micro-batch's share of the step's mean load-balancing loss, added to
        totals[aux_key]. The step's micro-batches are `micro_batches` on every rank (rank_micro_batches) × ranks
        (stages/moe.py); an idle micro-batch (rows []) adds nothing, like the rest of its loss."""
        if not aux_losses or not rows:
            return loss
        share = moe.step_share(aux_losses, micro_batches * self.dp_size)
        totals[self.aux_key] = totals.get(self.aux_key, 0.0) + share.item()
        return loss + self.cfg.aux_loss_coef * share

    def build(self, total_optimizer_steps: int) -> None:
        self.engine = ds.build_train_engine(self.model, self.cfg, self.ds_config, learning_rate=self.learning_rate(),
                                            total_steps=total_optimizer_steps)
        del self.model

    def save_checkpoint(self, step: int, client_state: dict) -> None:
        ds.save_checkpoint(self.engine, self.cfg.ckpt_path, step, client_state, tag=self.tag)

    def load_checkpoint(self, step: int) -> dict:
        return ds.load_checkpoint(self.engine, self.cfg.ckpt_path, step, tag=self.tag)

    def offload_states(self) -> None:
        """--deepspeed_enable_sleep: optimizer states, gradients and master weights to host memory (GPU only)."""
        from deepspeed.runtime.zero.offload_config import OffloadStateTypeEnum

        # The bf16/fp32 working weights stay: log-probs and values are still computed between training phases.
        self.engine.offload_states(include=[OffloadStateTypeEnum.optim_states, OffloadStateTypeEnum.hp_params,
                                            OffloadStateTypeEnum.lp_grads,
                                            OffloadStateTypeEnum.contiguous_grad_buffer])
        torch.cuda.empty_cache()

    def reload_states(self) -> None:
        self.engine.reload_states()


class PolicyWorker(TrainedRole):
    """One rank of the actor (the policy being trained)."""

    tag = "actor"
    aux_key = "aux_loss"
    _sharing: Iterator | None = None  # the walk of the weights a shared sync is in (share_bucket)
    _held = None  # the bucket the engines are opening (stages.rl.weight_sync.HeldBucket)

    def learning_rate(self) -> float:
        return self.cfg.actor_learning_rate

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_causal_lm, loading_options, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        self.join_ring(cfg)
        ds.seed_everything(cfg.seed)
        self.ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                             micro_batch_size=cfg.micro_train_batch_size)
        path = resolve_model_path(cfg.pretrain)
        model = ds.load_for_zero(lambda: load_causal_lm(path, **loading_options(cfg, self.device)), self.ds_config)
        moe.check_router(model, cfg.aux_loss_coef, cfg.pretrain)
        self.model = lora.wrap(model, cfg, value_model=False)
        # Tied parameters travel once; the engines copy them to their other names.
        self._tied = set(getattr(lora.hf_model(self.model), "all_tied_weights_keys", {}) or {})

    def build(self, total_optimizer_steps: int) -> None:
        super().build(total_optimizer_steps)
        self.ema = None  # --enable_ema: {HF name: fp32 weight} in rank 0's host memory, from the initial weights
        if self.cfg.enable_ema:
            self._update_ema(beta=0.0)

    def _update_ema(self, beta: float) -> None:
        """Every rank walks the full weights (joining the ZeRO-3 gathers, one module at a time); rank 0 averages."""
        if self.rank == 0 and self.ema is None:
            self.ema = {}
        for name, weight in lora.merged_named_weights(self.engine, device="cpu" if self.rank == 0 else "meta"):
            if self.rank == 0:
                if name in self.ema:
                    rl_algo.ema_update(self.ema[name], weight, beta)
                else:
                    self.ema[name] = weight.detach().float().clone()  # never the live weight itself

    def _ema_path(self, step: int):
        return ds.step_dir(self.cfg.ckpt_path, step) / self.tag / "ema.pt"

    def save_checkpoint(self, step: int, client_state: dict) -> None:
        super().save_checkpoint(step, client_state)
        if self.ema is not None:
            torch.save(self.ema, self._ema_path(step))

    def load_checkpoint(self, step: int) -> dict:
        client_state = super().load_checkpoint(step)
        if self.ema is not None:
            if not self._ema_path(step).is_file():
                raise StageInputError(f"--enable_ema: the checkpoint of step {step} holds no averaged weights "
                                      f"({self._ema_path(step)}): it was written without --enable_ema")
            self.ema = torch.load(self._ema_path(step), weights_only=True)
        return client_state

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        self.engine.eval()
        return sequence_log_probs(self.engine, batch, self.cfg, self.ring)

    def train_step(self, shard: dict[str, torch.Tensor], step_tokens: float, step_sequences: int,
                   kl_coef: float) -> dict[str, float]:
        """One optimizer step over this rank's share of the step's samples (micro-batches accumulate).

        Losses are token sums divided by `step_tokens`, the action tokens of the whole optimizer step over all
        ranks: a global token mean however the step is split (GSPO's policy loss: per-sequence means over the
        step's `step_sequences`). Without `old_logp` in the shard (one optimizer step
        per rollout) the rollout policy is the current one: its log-probs are this forward's, detached, and the
        KL to the reference is measured here (`kl_sum`: the sum over sequences of each one's token-mean KL).
        """
        cfg = self.cfg
        self.engine.train()
        eps_low, eps_high = cfg.eps_clip_bounds
        scale = ds.global_loss_scale(self.engine, self.ring_size)
        device = next(self.engine.module.parameters()).device
        totals = {"policy_loss": 0.0, "clip_fraction": 0.0, "approx_kl": 0.0}
        micro_batches = rank_micro_batches(shard, cfg.micro_train_batch_size, cfg.train_token_budget, device)
        for index, (micro, rows) in enumerate(micro_batches):
            mask = micro["action_mask"]
            with self.router_losses() as aux_losses:
                logp, entropy_t = policy_forward(self.engine, micro, cfg.temperature, cfg.packing_samples,
                                                 with_entropy=cfg.entropy_loss_coef is not None, ring=self.ring)
            old_logp = micro["old_logp"] if "old_logp" in micro else logp.detach()
            rollout_logp = micro.get("rollout_logp")
            if cfg.policy_loss_type == "gspo":
                # GSPO's sequence ratio is taken to the policy that sampled when the correction is on (OpenRLHF).
                base = old_logp if rollout_logp is None else rollout_logp
                loss_t, clipped = rl_algo.gspo_policy_loss(logp, base, micro["advantages"], mask, eps_low, eps_high,
                                                        cfg.dual_clip)
                policy_loss = rl_algo.aggregate_sequence_loss(loss_t, mask, step_sequences)
            else:
                loss_t, clipped = rl_algo.policy_loss(logp, old_logp, micro["advantages"], eps_low, eps_high,
                                                   cfg.dual_clip)
                if rollout_logp is not None:
                    low, high = cfg.vllm_is_truncated_threshold
                    weights, affected = rl_algo.rollout_correction(old_logp, rollout_logp, mask,
                                                                cfg.vllm_is_correction_type, low, high)
                    loss_t = loss_t * weights
                    with torch.no_grad():
                        for key, value in (("is_weight", weights), ("is_affected_fraction", affected),
                                           ("vllm_kl", rollout_logp - old_logp)):
                            totals[key] = totals.get(key, 0.0) + float(algo.masked_sum(value, mask)) / step_tokens
                policy_loss = algo.aggregate_token_loss(loss_t, mask, step_tokens)
            loss = policy_loss
            if cfg.use_kl_loss:
                kl_loss = algo.aggregate_token_loss(rl_algo.compute_kl(logp, micro["ref_logp"], cfg.kl_estimator),
                                                    mask, step_tokens)
                loss = loss + kl_coef * kl_loss
                totals["kl_loss"] = totals.get("kl_loss", 0.0) + kl_loss.item()
            if "old_logp" not in micro and cfg.uses_reference:
                kl = rl_algo.compute_kl(logp.detach(), micro["ref_logp"], cfg.kl_estimator)
                totals["kl_sum"] = totals.get("kl_sum", 0.0) + float(rl_algo.sequence_kl(kl, mask).sum())
            if cfg.entropy_loss_coef is not None:
                entropy = algo.aggregate_token_loss(entropy_t, mask, step_tokens)
                loss = loss - cfg.entropy_loss_coef * entropy
                totals["entropy"] = totals.get("entropy", 0.0) + entropy.item()
            loss = self.with_aux_loss(loss, aux_losses, rows, len(micro_batches), totals)
            accumulate(self.engine, cfg, last=index == len(micro_batches) - 1)
            self.engine.backward(loss * scale)
            self.engine.step()
            with torch.no_grad():
                totals["policy_loss"] += policy_loss.item()
                totals["clip_fraction"] += float(algo.masked_sum(clipped, mask)) / step_tokens
                totals["approx_kl"] += float(algo.masked_sum(old_logp - logp, mask)) / step_tokens
        if cfg.enable_ema:  # the optimizer stepped at the last micro-batch
            with torch.no_grad():
                self._update_ema(cfg.ema_beta)
        return totals

    # ---- weight sync to the rollout engines (stages/rl/weight_sync.py)
    def _sync_weights(self, device) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full weight) as the engines load them: LoRA merged, ZeRO-3 gathered one module at a time
        (every rank iterates), tied copies left out."""
        for name, weight in lora.merged_named_weights(self.engine, device=device):
            if name not in self._tied:
                yield name, weight

    def sync_plan(self, bucket_bytes: int) -> list:
        from stages.rl.weight_sync import plan_buckets

        return plan_buckets(((name, tuple(w.shape), w.dtype) for name, w in self._sync_weights("meta")),
                            bucket_bytes)

    def weight_sync_endpoint(self, world_size: int) -> tuple[str, int]:
        """Rank 0 only: host the weight-sync group's store on this node's address; where to reach it."""
        self._sync_listener, self._sync_store = host_store(node_address(), world_size)
        return node_address(), self._sync_listener.getsockname()[1]

    def open_weight_sync(self, master_addr: str, master_port: int, world_size: int, backend: str) -> None:
        """Rank 0 only: become rank 0 of the weight-sync group."""
        from stages.rl.weight_sync import open_group

        self._sync_group = open_group(master_addr, master_port, 0, world_size, backend, local_addr=node_address(),
                                      store=self._sync_store,
                                      device=torch.device("cuda", torch.cuda.current_device())
                                      if backend == "nccl" else None)

    @torch.no_grad()
    def share_bucket(self, index: int, bucket: list):
        """Shared sync (engines on this rank's device): bucket `index` of the walk of the weights (the first
        starts a walk; every rank walks, for ZeRO-3's gathers) laid out on this rank's device, as a handle the
        engines there open. The previous bucket is released."""
        from stages.rl.weight_sync import share_bucket

        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        if index == 0:
            self.release_shared()  # a walk an error left open
            self._sharing = self._sync_weights(device)
        elif self._held is not None:
            self._held.release()
        tensors = []
        for expected, _, _ in bucket:
            name, weight = next(self._sharing)
            assert name == expected, f"weight sync out of step: {name} where the plan has {expected}"
            tensors.append(weight)
        self._held, shared = share_bucket(tensors, device)
        return shared

    @torch.no_grad()  # the walk's contexts restore the grad mode they found, no_grad: close it inside one
    def release_shared(self) -> None:
        if self._sharing is not None:
            self._sharing.close()
        if self._held is not None:
            self._held.release()
        self._held = self._sharing = None

    @torch.no_grad()
    def broadcast_weights(self, buckets: list) -> None:
        """Every rank walks the weights (joining the ZeRO-3 gathers); rank 0 broadcasts them bucket by bucket."""
        from stages.rl.weight_sync import send_bucket

        device = self._sync_group.device if self.rank == 0 else "meta"
        weights = self._sync_weights(device)
        for bucket in buckets:
            tensors = []
            for expected, _, _ in bucket:
                name, weight = next(weights)
                assert name == expected, f"weight sync out of step: {name} where the plan has {expected}"
                tensors.append(weight)
            if self.rank == 0:
                send_bucket(self._sync_group, tensors)

    def export(self, save_path: str) -> None:
        """The actor as an HF model; with --enable_ema its moving average instead."""
        from stages.model_io import load_tokenizer

        tokenizer = load_tokenizer(self.cfg.pretrain)
        if not self.cfg.enable_ema:
            ds.export_hf(self.engine, tokenizer, save_path)
            return
        if self.rank == 0:
            from stages.model_io import save_hf

            dtype = _dtype(self.cfg)
            save_hf(lora.hf_model(self.engine), tokenizer, save_path, None,
                    {name: average.to(dtype) for name, average in self.ema.items()})
        torch.distributed.barrier()


class CriticWorker(TrainedRole):
    """One rank of the critic (PPO's value model), trained on the returns with the clipped value loss."""

    tag = "critic"
    aux_key = "critic_aux_loss"

    def learning_rate(self) -> float:
        return self.cfg.critic_learning_rate

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_value_model, loading_options, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        self.join_ring(cfg)
        ds.seed_everything(cfg.seed)
        self.ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                             micro_batch_size=cfg.micro_train_batch_size)
        path = resolve_model_path(cfg.critic_init)
        model = ds.load_for_zero(
            lambda: load_value_model(path, value_head_prefix=cfg.value_head_prefix,
                                     **loading_options(cfg, self.device)), self.ds_config)
        moe.check_router(model, cfg.aux_loss_coef, cfg.critic_init)
        normalization = reward_normalization(model.config) if cfg.normalize_reward else None
        # --lora_rank adapts the critic too (as in OpenRLHF), its value head trained whole.
        self.model = TokenValueModel(lora.wrap(model, cfg, value_model=True), normalization)

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Value of the state before each action token, [B, T-1] (aligned with the action mask)."""
        self.engine.eval()
        cfg = self.cfg
        micro = rank_micro_batches(batch, cfg.micro_rollout_batch_size, cfg.rollout_token_budget,
                                   next(self.engine.module.parameters()).device)
        return forward_rows(batch, micro, lambda part: value_forward(self.engine, part, cfg.packing_samples, self.ring))

    def export(self, save_path: str) -> None:
        """--save_value_network: the critic as an HF value model (its `score` head), loadable as a reward model."""
        from stages.model_io import load_tokenizer

        ds.export_hf(self.engine.module.model, load_tokenizer(self.cfg.critic_init), save_path)

    def train_step(self, shard: dict[str, torch.Tensor], step_tokens: float) -> dict[str, float]:
        cfg = self.cfg
        self.engine.train()
        scale = ds.global_loss_scale(self.engine, self.ring_size)
        device = next(self.engine.module.parameters()).device
        totals = {"critic_loss": 0.0, "values": 0.0}
        micro_batches = rank_micro_batches(shard, cfg.micro_train_batch_size, cfg.train_token_budget, device)
        for index, (micro, rows) in enumerate(micro_batches):
            mask = micro["action_mask"]
            with self.router_losses() as aux_losses:
                values = value_forward(self.engine, micro, cfg.packing_samples, self.ring)
            critic_loss = algo.aggregate_token_loss(
                rl_algo.value_loss(values, micro["old_values"], micro["returns"], cfg.value_clip), mask, step_tokens)
            loss = self.with_aux_loss(critic_loss, aux_losses, rows, len(micro_batches), totals)
            accumulate(self.engine, cfg, last=index == len(micro_batches) - 1)
            self.engine.backward(loss * scale)
            self.engine.step()
            totals["critic_loss"] += critic_loss.item()
            totals["values"] += float(algo.masked_sum(values.detach(), mask)) / step_tokens
        return totals


class ReferenceWorker(RankWorker):
    """One rank of the frozen reference model."""

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_causal_lm, loading_options, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group(deepspeed=cfg.zero_stage == 3)  # DeepSpeed only to shard it
        self.join_ring(cfg)
        ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                        micro_batch_size=cfg.micro_train_batch_size, train=False,
                                        offload_params=cfg.ref_reward_offload and self.device == "cuda")
        path = resolve_model_path(cfg.ref_pretrain or cfg.pretrain)
        model = ds.load_for_zero(lambda: load_causal_lm(path, **loading_options(cfg, self.device)), ds_config)
        self.model = ds.build_inference_engine(model, ds_config, self.device)

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sequence_log_probs(self.model, batch, self.cfg, self.ring)


class RewardModelWorker(RankWorker):
    """One rank of the reward model. It scores the token ids of prompt + response + eos, so it must share the
    policy's tokenizer, as a reward model trained from the SFT checkpoint does."""

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_tokenizer, load_value_model, loading_options, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        # Sharded with ZeRO-3 as the reference is (the RL stage's --zero_stage), a whole copy on every rank else.
        sharded = getattr(cfg, "zero_stage", 0) == 3
        self.init_process_group(deepspeed=sharded)
        self.join_ring(cfg)
        local = resolve_model_path(cfg.reward_pretrain)
        ds_config = ds.deepspeed_config(
            cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
            micro_batch_size=cfg.micro_train_batch_size, train=False,
            offload_params=cfg.ref_reward_offload and self.device == "cuda") if sharded else None
        load = lambda: load_value_model(local, value_head_prefix=cfg.value_head_prefix, trained_head=True,  # noqa: E731
                                        **loading_options(cfg, self.device))
        model = ds.load_for_zero(load, ds_config) if sharded else load()
        self.config = model.config
        self.model = ds.build_inference_engine(model, ds_config, self.device) if sharded else model.eval().to(self.device)
        self.eos_token_id = load_tokenizer(local).eos_token_id
        self.max_positions = getattr(self.config, "max_position_embeddings", None)
        self.normalization = reward_normalization(self.config)
        if cfg.normalize_reward and self.normalization is None:
            raise StageInputError(f"--normalize_reward: reward model {cfg.reward_pretrain} has no reward_mean/"
                                  "reward_std (or mean/std) in its config.json; train it with stages.reward_model "
                                  "and an --eval_dataset")

    @torch.no_grad()
    def score(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The reward of each sequence: the value head at its eos, which a truncated response gets appended."""
        cfg = self.cfg
        rewards = torch.zeros(batch["input_ids"].shape[0])
        for micro, rows in rank_micro_batches(batch, cfg.micro_rollout_batch_size, cfg.rollout_token_budget,
                                              self.device):
            scores = packing_lib.last_token_values(
                self.model, [ending_with_eos(seq, self.eos_token_id, self.max_positions) for seq in _unpadded(micro)[0]],
                pad_token_id=self.config.pad_token_id, packing=getattr(cfg, "packing_samples", False),
                ring=self.ring).cpu()
            if rows:
                rewards[rows] = scores.float()
        if self.cfg.normalize_reward:
            mean, std = self.normalization
            rewards = (rewards - mean) / std
        return rewards


def ending_with_eos(sequence: list[int], eos_token_id: int, max_positions: int | None = None) -> list[int]:
    """`sequence` as a reward model was trained to score it: ending with eos. A response cut at the length limit
    gets eos appended (as OpenRLHF does), or its last token replaced where the model has no position left;
    scored mid-text instead, a reward model is read where it never learned, and a policy can drift into
    truncated answers that it happens to score well."""
    if sequence and sequence[-1] == eos_token_id:
        return sequence
    if max_positions is not None and len(sequence) >= max_positions:
        return sequence[: max_positions - 1] + [eos_token_id]
    return sequence + [eos_token_id]


def rank_micro_batches(batch: dict[str, torch.Tensor], size: int, token_budget: int | None,
                       device) -> list[tuple[dict[str, torch.Tensor], list[int]]]:
    """(micro-batch, its rows of `batch`) in the order they run: `size` rows at a time, or with --use_dynamic_batch
    (`token_budget`) as many micro-batches as the rank of this model's group that needs the most for micro-batches
    of at most `token_budget` tokens, its sequences balanced over them and each cut to its longest sequence. Every
    rank then runs the same number of forwards, which ZeRO-3's parameter gathers need; a rank with fewer sequences
    than micro-batches runs its first one again with no action token (rows []), adding nothing."""
    rows = batch["input_ids"].shape[0]
    lengths = batch["attention_mask"].sum(dim=1).tolist()
    needed = -(-rows // size) if token_budget is None else first_fit_count(lengths, token_budget)
    count = torch.tensor([needed], device=device)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
    if token_budget is None:
        parts = [list(range(start, min(start + size, rows))) for start in range(0, size * int(count.item()), size)]
        return [({k: v[part[0] : part[-1] + 1].to(device) for k, v in batch.items()}, part) if part
                else (idle_micro_batch(batch, device), []) for part in parts]
    return [(select_rows(batch, part, device), part) if part else (idle_micro_batch(batch, device), [])
            for part in balanced_partitions(lengths, int(count.item()))]


def idle_micro_batch(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """The first sequence of `batch` without action tokens: a forward (and backward) that adds nothing."""
    idle = select_rows(batch, [0], device)
    idle["action_mask"] = torch.zeros_like(idle["action_mask"])
    return idle


def accumulate(engine, cfg, last: bool) -> None:
    """With --use_dynamic_batch the number of micro-batches varies from step to step: the engine runs without a
    fixed accumulation count (stages/engine.py) and is told which micro-batch ends the optimizer step."""
    if cfg.use_dynamic_batch:
        engine.set_gradient_accumulation_boundary(last)


def forward_rows(batch: dict[str, torch.Tensor], micro: list[tuple[dict[str, torch.Tensor], list[int]]],
                 forward) -> torch.Tensor:
    """`forward(micro_batch)` ([b, t-1] per token) of every micro-batch, back in `batch`'s rows and width."""
    out = torch.zeros(batch["input_ids"].shape[0], batch["input_ids"].shape[1] - 1)
    for part, rows in micro:
        result = forward(part).float().cpu()
        if rows:
            out[rows, : result.shape[1]] = result
    return out


def _unpadded(micro: dict[str, torch.Tensor]) -> tuple[list[list[int]], list[int]]:
    lengths = micro["attention_mask"].sum(dim=1).tolist()
    return [row[:n].tolist() for row, n in zip(micro["input_ids"], lengths)], lengths


def policy_forward(model, micro: dict[str, torch.Tensor], temperature: float, packing: bool,
                   with_entropy: bool = False, ring=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Next-token log-probs [B, T-1] of the sampling distribution (logits / temperature, as the engines sampled)
    of a right-padded micro-batch, and the entropies when asked: from one padded forward, or with
    --packing_samples from one padding-free forward of the sequences laid end to end (stages/packing.py), split
    over the ranks of a `ring` with --ring_attn_size (stages/ring_attention.py)."""
    ids = micro["input_ids"]
    if not packing:
        logits = model(input_ids=ids, attention_mask=micro["attention_mask"]).logits[:, :-1] / temperature
        return algo.token_log_probs(logits, ids[:, 1:]), algo.entropy_from_logits(logits) if with_entropy else None
    sequences, lengths = _unpadded(micro)
    packed_ids, position_ids, starts = packing_lib.pack(sequences, ids.device)

    def run(part_ids, positions, next_ids, forward_kwargs) -> torch.Tensor:
        logits = model(input_ids=part_ids, position_ids=positions, use_cache=False, **forward_kwargs).logits
        logits = logits / temperature
        logp = algo.token_log_probs(logits, next_ids)[0]
        return torch.stack([logp, algo.entropy_from_logits(logits)[0]], dim=-1) if with_entropy else logp[:, None]

    per_token = ring_attention.per_token(run, packed_ids, position_ids, ring)
    width = ids.shape[1] - 1
    rows = [F.pad(per_token[start : start + n - 1], (0, 0, 0, width - n + 1)) for start, n in zip(starts, lengths)]
    stacked = torch.stack(rows)  # [B, T-1, 1 or 2]
    return stacked[..., 0], stacked[..., 1] if with_entropy else None


def value_forward(model, micro: dict[str, torch.Tensor], packing: bool, ring=None) -> torch.Tensor:
    """Values [B, T-1] of the state before each next token (aligned with the action mask), padded or packed
    (over the ranks of a `ring`, if any)."""
    if not packing:
        return model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"])[:, :-1]
    sequences, lengths = _unpadded(micro)
    packed_ids, position_ids, starts = packing_lib.pack(sequences, micro["input_ids"].device)
    values = ring_attention.per_token(
        lambda part_ids, positions, _next, forward_kwargs: model(input_ids=part_ids, position_ids=positions,
                                                                 **forward_kwargs)[0],
        packed_ids, position_ids, ring)
    width = micro["input_ids"].shape[1] - 1
    return torch.stack([F.pad(values[start : start + n - 1], (0, width - n + 1)) for start, n in zip(starts, lengths)])


@torch.no_grad()
def sequence_log_probs(model, batch: dict[str, torch.Tensor], cfg, ring=None) -> torch.Tensor:
    """Log-probs [B, T-1] of a batch, micro-batch by micro-batch, on CPU."""
    micro = rank_micro_batches(batch, cfg.micro_rollout_batch_size, cfg.rollout_token_budget,
                               next(model.parameters()).device)
    return forward_rows(batch, micro, lambda part: policy_forward(model, part, cfg.temperature,
                                                                   cfg.packing_samples, ring=ring)[0])


# ----------------------------------------------------------------------------- the roles of one run

ROLE_WORKERS = {"actor": PolicyWorker, "critic": CriticWorker, "ref": ReferenceWorker, "reward": RewardModelWorker}


class Roles:
    """The Ray actor groups and rollout engines of one RL run, placed as the colocation flags say."""

    def __init__(self, cfg, device: str, config_cls: type):
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
        self.groups: dict[str, ActorGroup] = {}
        engine_options: dict[str, Any] = {}
        for name, members in plan.items():
            group = placement_group([dict(bundle) for _ in range(bundles[name])], strategy="PACK")
            ray.get(group.ready())
            self.placement_groups.append(group)
            share = 1.0 / len(members)
            fraction = dict(num_cpus=bundle["CPU"] * share, num_gpus=share if device == "cuda" else 0.0)
            if ENGINES in members:
                engine_options = dict(placement_group=group, bundle_indices=list(range(engine_bundles(cfg))),
                                      **fraction)
            for hosted in rank_processes(cfg, [role for role in members if role != ENGINES]):
                role = hosted[0]
                per_node = -(-ranks[role] // getattr(cfg, f"{role}_num_nodes"))
                options = dict(placement=Placement(group, **fraction), threads=cpu_threads(per_node + beside_models))
                if len(hosted) == 1:
                    self.groups[role] = ActorGroup(ROLE_WORKERS[role], ranks[role], device, name=role, **options)
                else:
                    self.groups.update(ActorGroup.hosted({r: ROLE_WORKERS[r] for r in hosted}, ranks[role], device,
                                                         **options))
        for group in self.groups.values():
            group.ring_size = cfg.ring_attn_size
        self.engines = create_rollout_engines(
            cfg.pretrain, backend=cfg.rollout_backend, num_engines=cfg.vllm_num_engines,
            tensor_parallel_size=cfg.vllm_tensor_parallel_size,
            gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep=cfg.vllm_enable_sleep,
            seed=cfg.seed, dtype="bfloat16" if cfg.bf16 else "float32", max_model_len=cfg.total_len,
            enforce_eager=cfg.enforce_eager, enable_prefix_caching=cfg.enable_prefix_caching,
            cpu_threads=cpu_threads(cfg.vllm_num_engines + beside_engines), wait=False, **engine_options,
        )
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

    def sync_weights(self) -> None:
        """The actor's current weights into every engine, bucket by bucket."""
        if not self.shared_sync:
            ray.get(self.actor.run_async("broadcast_weights", self.buckets)
                    + [engine.receive_weights.remote(self.buckets) for engine in self.engines])
            return
        for index, bucket in enumerate(self.buckets):  # each rank keeps one bucket shared until the engines took it
            shared = ray.get(self.actor.run_async("share_bucket", index, bucket))
            ray.get([engine.receive_shared.remote(bucket, shared) for engine in self.engines])
        ray.get(self.actor.run_async("release_shared"))

    def engines_call(self, method: str, *args: Any) -> None:
        ray.get([getattr(engine, method).remote(*args) for engine in self.engines])

    def shutdown(self) -> None:
        for engine in self.engines:
            ray.kill(engine)
        for group in self.groups.values():
            group.shutdown()
        for group in self.placement_groups:
            remove_placement_group(group)

