"""The policy's ranks in the RL stage: the actor (trained with the policy loss, its weights sent to the rollout
engines) and the frozen reference, both computing the policy's token log-probs; and what every trained RL role
shares (TrainedRole: setup, DeepSpeed engine, checkpoints, sleep; micro-batches of a rank's share)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from stages import algorithms as algo
from stages import engine as ds
from stages import lora, moe, ring_attention
from stages import packing as packing_lib
from stages.distributed import RankWorker, host_store, node_address
from stages.errors import StageInputError
from stages.rl import algorithms as rl_algo
from stages.sequences import balanced_partitions, first_fit_count, select_rows


def _dtype(cfg) -> torch.dtype:
    return torch.bfloat16 if cfg.bf16 else torch.float32


class TrainedRole(RankWorker):
    """A model trained with DeepSpeed inside the RL loop (actor or critic): checkpoints and GPU sleep.

    `setup` loads the model while the driver still reads the data; `build` wraps it in its DeepSpeed engine once
    the number of optimizer steps (the learning-rate schedule's length) is known.
    """

    tag = ""
    aux_key = ""  # the logged name of its --aux_loss_coef term
    value_model = False  # LoRA then also trains the value head

    # ---- hooks
    def learning_rate(self) -> float: ...
    def init_path(self) -> str:
        """The model it starts from (a flag's value)."""
    def load(self, path: str, options: dict) -> torch.nn.Module:
        """The HF model at `path`, loaded with `options` (model_io.loading_options)."""
    def ready(self, loaded: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
        """What trains: `model` (the `loaded` one made trainable); a role may wrap it."""
        return model

    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        """Join the rank group and load the model, made trainable as in every training stage (ds.trained_model)."""
        from stages.model_io import loading_options, resolve_model_path

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        self.join_ring(cfg)
        ds.seed_everything(cfg.seed)
        self.ds_config = ds.deepspeed_config(cfg, world_size=self.world_size, train_batch_size=cfg.train_batch_size,
                                             micro_batch_size=cfg.micro_train_batch_size)
        path = resolve_model_path(self.init_path())
        loaded = ds.load_for_zero(lambda: self.load(path, loading_options(cfg, self.device)), self.ds_config)
        self.model = self.ready(loaded, ds.trained_model(loaded, cfg, init=self.init_path(),
                                                         value_model=self.value_model, aux_loss_coef=cfg.aux_loss_coef))

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

    def add_grad_norm(self, totals: dict[str, float], key: str) -> None:
        """The optimizer step's global gradient norm (None under ZeRO-0) into `totals`, as this rank's share: the
        driver sums the data-parallel ranks' totals (stages/engine.py stop_if_diverged stops a non-finite one)."""
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is not None:
            totals[key] = float(grad_norm) / self.dp_size

    def build(self, total_optimizer_steps: int) -> None:
        self.engine = ds.build_train_engine(self.model, self.cfg, self.ds_config, learning_rate=self.learning_rate(),
                                            total_steps=total_optimizer_steps)
        del self.model

    def save_checkpoint(self, step: int, client_state: dict) -> None:
        ds.save_checkpoint(self.engine, self.cfg.ckpt_path, step, client_state, tag=self.tag)

    def load_checkpoint(self, step: int) -> dict:
        return ds.load_checkpoint(self.engine, self.cfg.ckpt_path, step, tag=self.tag)

    def offload_states(self) -> None:
        ds.offload_training_states(self.engine)

    def reload_states(self) -> None:
        self.engine.reload_states()


class PolicyWorker(TrainedRole):
    """One rank of the actor (the policy being trained)."""

    tag = "actor"
    aux_key = "aux_loss"
    _sharing: Iterator | None = None  # the walk of the weights a shared sync is in (share_bucket)
    _held = None  # the bucket the engines are opening (stages.rl.weight_sync.HeldBucket)
    _sent: dict = {}  # rank 0: {name: digest} of the last sync (stages.rl.weight_check.TensorDigest)

    def learning_rate(self) -> float:
        return self.cfg.actor_learning_rate

    def init_path(self) -> str:
        return self.cfg.pretrain

    def load(self, path: str, options: dict) -> torch.nn.Module:
        from stages.model_io import load_causal_lm

        return load_causal_lm(path, **options)

    def ready(self, loaded: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
        # Tied parameters travel once; the engines copy them to their other names.
        self._tied = set(getattr(lora.hf_model(model), "all_tied_weights_keys", {}) or {})
        return model

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
    def log_probs(self, batch: dict[str, torch.Tensor], temperature: float | None = None) -> torch.Tensor:
        """Token log-probs at the sampling temperature, or at `temperature` (the weight check's probe: 1)."""
        self.engine.eval()
        return sequence_log_probs(self.engine, batch, self.cfg, self.ring, temperature)

    def train_step(self, shard: dict[str, torch.Tensor], step_tokens: float, step_sequences: int,
                   kl_coef: float) -> dict[str, float]:
        """One optimizer step over this rank's share of the step's samples (micro-batches accumulate).

        Losses are token sums divided by `step_tokens`, the action tokens of the whole optimizer step over all
        ranks: a global token mean however the step is split (GSPO's policy loss: per-sequence means over the
        step's `step_sequences`; CISPO's is a token mean like PPO's). Without `old_logp` in the shard (one optimizer step
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
            if "rollout_logp" in micro and "old_logp" not in micro:  # this forward is the sampling policy's
                gap = rl_algo.logprob_gap(logp, micro["rollout_logp"], mask)
                for key, value in (("logprob_gap_mean", gap["abs_sum"]), ("logprob_gap_k3", gap["k3_sum"])):
                    totals[key] = totals.get(key, 0.0) + float(value) / step_tokens
                totals["logprob_gap_max"] = max(totals.get("logprob_gap_max", 0.0), float(gap["max"]))
            rollout_logp = micro.get("rollout_logp") if cfg.enable_vllm_is_correction else None
            if cfg.policy_loss_type == "gspo":
                # GSPO's sequence ratio is taken to the policy that sampled when the correction is on (OpenRLHF).
                base = old_logp if rollout_logp is None else rollout_logp
                loss_t, clipped = rl_algo.gspo_policy_loss(logp, base, micro["advantages"], mask, eps_low, eps_high,
                                                        cfg.dual_clip)
                policy_loss = rl_algo.aggregate_sequence_loss(loss_t, mask, step_sequences)
            else:
                if cfg.policy_loss_type == "cispo":
                    loss_t, clipped = rl_algo.cispo_policy_loss(logp, old_logp, micro["advantages"], eps_low,
                                                                eps_high)
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
        self.add_grad_norm(totals, "grad_norm")
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
    def share_bucket(self, index: int, bucket: list, digests: bool = False):
        """Shared sync (engines on this rank's device): bucket `index` of the walk of the weights (the first
        starts a walk; every rank walks, for ZeRO-3's gathers) laid out on this rank's device, as a handle the
        engines there open. The previous bucket is released. With `digests`, rank 0 digests what it shares."""
        from stages.rl.weight_sync import share_bucket

        device = torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")
        if index == 0:
            self.release_shared()  # a walk an error left open
            self._sharing = self._sync_weights(device)
            self._sent = {}
        elif self._held is not None:
            self._held.release()
        tensors = self._next_bucket(self._sharing, bucket, digests and self.rank == 0)
        self._held, shared = share_bucket(tensors, device)
        return shared

    def _next_bucket(self, weights: Iterator[tuple[str, torch.Tensor]], bucket: list,
                     digests: bool) -> list[torch.Tensor]:
        """The tensors of `bucket` from the walk of the weights, digested as the engines hold them if asked
        (stages/rl/weight_check.py)."""
        from stages.rl.weight_check import digest

        tensors = []
        for expected, _, _ in bucket:
            name, weight = next(weights)
            assert name == expected, f"weight sync out of step: {name} where the plan has {expected}"
            if digests:
                self._sent[name] = digest(weight, _dtype(self.cfg))
            tensors.append(weight)
        return tensors

    def sent_digests(self) -> dict:
        """Rank 0: the digests of the last sync's tensors ({} when it was not asked to digest them)."""
        return self._sent

    @torch.no_grad()  # the walk's contexts restore the grad mode they found, no_grad: close it inside one
    def release_shared(self) -> None:
        if self._sharing is not None:
            self._sharing.close()
        if self._held is not None:
            self._held.release()
        self._held = self._sharing = None

    @torch.no_grad()
    def broadcast_weights(self, buckets: list, digests: bool = False) -> None:
        """Every rank walks the weights (joining the ZeRO-3 gathers); rank 0 broadcasts them bucket by bucket, and
        with `digests` digests them."""
        from stages.rl.weight_sync import send_bucket

        device = self._sync_group.device if self.rank == 0 else "meta"
        weights = self._sync_weights(device)
        self._sent = {}
        for bucket in buckets:
            tensors = self._next_bucket(weights, bucket, digests and self.rank == 0)
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
        # The log-probs and entropies divide by the temperature chunk by chunk (stages/algorithms.py): no scaled
        # copy, and no float32 one, of the whole logits.
        logits = model(input_ids=ids, attention_mask=micro["attention_mask"]).logits[:, :-1]
        return (algo.token_log_probs(logits, ids[:, 1:], temperature),
                algo.entropy_from_logits(logits, temperature) if with_entropy else None)
    sequences, lengths = _unpadded(micro)
    packed_ids, position_ids, starts = packing_lib.pack(sequences, ids.device)

    def run(part_ids, positions, next_ids, forward_kwargs) -> torch.Tensor:
        logits = model(input_ids=part_ids, position_ids=positions, use_cache=False, **forward_kwargs).logits
        logp = algo.token_log_probs(logits, next_ids, temperature)[0]
        if not with_entropy:
            return logp[:, None]
        return torch.stack([logp, algo.entropy_from_logits(logits, temperature)[0]], dim=-1)

    per_token = ring_attention.per_token(run, packed_ids, position_ids, ring)
    width = ids.shape[1] - 1
    rows = [F.pad(per_token[start : start + n - 1], (0, 0, 0, width - n + 1)) for start, n in zip(starts, lengths)]
    stacked = torch.stack(rows)  # [B, T-1, 1 or 2]
    return stacked[..., 0], stacked[..., 1] if with_entropy else None


@torch.no_grad()
def sequence_log_probs(model, batch: dict[str, torch.Tensor], cfg, ring=None,
                       temperature: float | None = None) -> torch.Tensor:
    """Log-probs [B, T-1] of a batch at the sampling temperature (or `temperature`), micro-batch by micro-batch, on
    CPU."""
    temperature = cfg.temperature if temperature is None else temperature
    micro = rank_micro_batches(batch, cfg.micro_rollout_batch_size, cfg.rollout_token_budget,
                               next(model.parameters()).device)
    return forward_rows(batch, micro, lambda part: policy_forward(model, part, temperature,
                                                                   cfg.packing_samples, ring=ring)[0])
