"""The value-head models' ranks in the RL stage: the critic (PPO's value model, trained on the returns) and the
reward model that scores rollouts, both reading a scalar head."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from stages import algorithms as algo
from stages import engine as ds
from stages import lora, ring_attention
from stages import packing as packing_lib
from stages.distributed import RankWorker
from stages.errors import StageInputError
from stages.rl import algorithms as rl_algo
from stages.rl.actor import TrainedRole, _unpadded, accumulate, forward_rows, rank_micro_batches


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


class CriticWorker(TrainedRole):
    """One rank of the critic (PPO's value model), trained on the returns with the clipped value loss."""

    tag = "critic"
    aux_key = "critic_aux_loss"
    value_model = True

    def learning_rate(self) -> float:
        return self.cfg.critic_learning_rate

    def init_path(self) -> str:
        return self.cfg.critic_init

    def load(self, path: str, options: dict) -> torch.nn.Module:
        from stages.model_io import load_value_model

        return load_value_model(path, value_head_prefix=self.cfg.value_head_prefix, **options)

    def ready(self, loaded: torch.nn.Module, model: torch.nn.Module) -> torch.nn.Module:
        # --lora_rank adapts the critic too (as in OpenRLHF), its value head trained whole.
        normalization = reward_normalization(loaded.config) if self.cfg.normalize_reward else None
        return TokenValueModel(model, normalization)

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
        self.add_grad_norm(totals, "critic_grad_norm")
        return totals


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
