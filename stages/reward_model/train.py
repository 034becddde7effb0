"""Reward model: a value head on the SFT model, trained on preference pairs with the pairwise loss.

The reward of a sequence is the head's output at its last token. At evaluation time the mean and std of the
rewards of all held-out chosen and rejected responses are stored in the checkpoint's config.json (`reward_mean`,
`reward_std`) so that `--normalize_reward` in later stages can use them; without --eval_dataset they come from the
first training pairs (`reward_stats_source` says which).

Pairs are prompt/chosen/rejected columns, or (no --prompt_key) chosen and rejected whole conversations, as in
OpenRLHF/preference_dataset_mixture2_and_safe_pku; --margin_loss reads a `margin` column.

    python -m stages.reward_model --config tiny --pretrain ./sft --dataset pref.jsonl --save_path ./rm
    deepspeed --module stages.reward_model --pretrain meta-llama/Meta-Llama-3-8B --apply_chat_template \\
        --dataset OpenRLHF/preference_dataset_mixture2_and_safe_pku --chosen_key chosen --rejected_key rejected
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data, packing
from stages.engine import load_for_zero
from stages.launch import run_rank_group
from stages.reward_model.config import MARGIN_COLUMN
from stages.sequences import pair_sequences
from stages.trainer import StepTrainer


# The config fields encode_rows reads: with the rows and the tokenizer, they key the prepared examples' cache.
EXAMPLE_FIELDS = ("prompt_key", "chosen_key", "rejected_key", "apply_chat_template", "input_template", "max_len",
                  "margin_loss")


def encode_rows(cfg, tokenizer, rows) -> data.Encoded:
    return data.encode_preferences(
        rows, tokenizer, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key,
        apply_chat_template=cfg.apply_chat_template, input_template=cfg.input_template, max_len=cfg.max_len,
        margin_key=MARGIN_COLUMN if cfg.margin_loss else None,
    )


def pair_rewards(model, examples: list[dict], *, pad_token_id: int, packing_samples: bool, ring=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen rewards [B], rejected rewards [B]): the value head at the last token of each response."""
    rewards = packing.last_token_values(model, pair_sequences(examples), pad_token_id=pad_token_id,
                                        packing=packing_samples, ring=ring)
    return rewards[: len(examples)], rewards[len(examples) :]


# Training pairs scored for the normalisation statistics when there is no held-out set.
STATS_TRAIN_PAIRS = 1024


class RewardModelWorker(StepTrainer):
    stage = "reward_model"
    value_model = True

    def load_train_model(self, ds_config):
        from stages.model_io import load_value_model, loading_options

        options = loading_options(self.cfg, self.device)
        model = load_for_zero(lambda: load_value_model(self.model_path, **options), ds_config)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    encode_rows = staticmethod(encode_rows)
    example_fields = EXAMPLE_FIELDS

    def pair_rewards(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        return pair_rewards(self.engine, examples, pad_token_id=self.tokenizer.pad_token_id,
                            packing_samples=self.cfg.packing_samples, ring=self.ring)

    def micro_batch_loss(self, examples, normalizer):
        with self.router_losses() as aux_losses:  # one forward scores both sides of the pairs
            chosen, rejected = self.pair_rewards(examples)
        margin = torch.tensor([e["margin"] for e in examples], device=chosen.device) if self.cfg.margin_loss else None
        loss = algo.pairwise_rm_loss(chosen, rejected, margin=margin, kind=self.cfg.loss) * len(examples) / normalizer
        correct = float((chosen > rejected).sum())
        return self.with_aux_loss(loss, {"loss": loss.item(), "accuracy": correct / normalizer,
                                         "tokens": float(sum(map(len, pair_sequences(examples))))}, aux_losses)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        accuracy, stats = self.score_pairs(self.eval_examples)
        self.reward_stats = {**stats, "reward_stats_source": "eval_dataset"}
        return {"accuracy": accuracy, **stats}

    @torch.no_grad()
    def score_pairs(self, examples: list[dict]) -> tuple[float, dict[str, float]]:
        """Pairwise accuracy over `examples`, and the mean and std of all their chosen and rejected rewards."""
        self.engine.eval()
        correct, pairs, total, total_sq, count = 0.0, 0.0, 0.0, 0.0, 0.0
        for micro, real in self.eval_micro_batches(examples):
            chosen, rejected = self.pair_rewards(micro)
            if not real:
                continue
            both = torch.cat([chosen, rejected]).double()
            correct += float((chosen > rejected).sum())
            pairs += len(micro)
            total, total_sq, count = total + float(both.sum()), total_sq + float((both**2).sum()), count + len(both)
        sums = self.all_reduce_sum({"correct": correct, "pairs": pairs, "sum": total, "sum_sq": total_sq,
                                    "count": count})
        mean = sums["sum"] / sums["count"]
        std = max(sums["sum_sq"] / sums["count"] - mean**2, 0.0) ** 0.5
        return sums["correct"] / sums["pairs"], {"reward_mean": mean, "reward_std": std}

    def export_extra_config(self) -> dict | None:
        # Normalisation statistics travel with the checkpoint (read by --normalize_reward downstream). Without a
        # held-out set they come from the first training pairs, so that --normalize_reward works after any run.
        if getattr(self, "reward_stats", None) is None:
            pairs = self.train_examples[:STATS_TRAIN_PAIRS]
            _, stats = self.score_pairs(pairs)
            self.reward_stats = {**stats, "reward_stats_source": f"first {len(pairs)} training pairs"}
            if self.rank == 0:
                print(f"[reward_model] no --eval_dataset: reward_mean/reward_std for --normalize_reward come from "
                      f"the first {len(pairs)} training pairs", flush=True)
        return self.reward_stats


def run(cfg) -> dict:
    return run_rank_group("reward_model", RewardModelWorker, cfg, cfg.validate_rows)
