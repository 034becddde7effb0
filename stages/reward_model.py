"""Reward model: a value head on the SFT model, trained on preference pairs with the pairwise loss.

The reward of a sequence is the head's output at its last non-padding token. At evaluation time the mean and
std of the rewards of all held-out chosen and rejected responses are stored in the checkpoint's config.json
(`reward_mean`, `reward_std`) so that `--normalize_reward` in later stages can use them.

    python -m stages.reward_model --config tiny --pretrain ./sft --dataset pref.jsonl --save_path ./rm
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data
from stages.engine import load_for_zero
from stages.launch import run_rank_group, stage_main
from stages.trainer import StepTrainer, chunks, validate_sources


def sequence_rewards(model, input_ids, attention_mask) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()


class RewardModelWorker(StepTrainer):
    stage = "reward_model"

    def load_train_model(self, ds_config):
        from stages.model_io import load_value_model

        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float32
        model = load_for_zero(lambda: load_value_model(self.model_path, dtype=dtype), ds_config)
        model.config.pad_token_id = self.tokenizer.pad_token_id
        return model

    def build_examples(self, source: str, split: str) -> list[dict]:
        cfg = self.cfg
        rows = data.load_rows(source, split=split, max_samples=cfg.max_samples)
        examples = data.build_preference_examples(
            rows, self.tokenizer, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key,
            rejected_key=cfg.rejected_key, apply_chat_template=cfg.apply_chat_template, max_len=cfg.max_len,
        )
        if cfg.margin_loss:
            for example, row in zip(examples, rows):
                example["margin"] = float(row["margin"])
        return examples

    def step_normalizer(self, examples: list[dict]) -> float:
        return float(len(examples))

    def pair_rewards(self, examples) -> tuple[torch.Tensor, torch.Tensor]:
        input_ids, attention_mask, _ = (t.to(self.model_device) for t in
                                        data.preference_batch(examples, self.tokenizer.pad_token_id))
        rewards = sequence_rewards(self.engine, input_ids, attention_mask)
        return rewards[: len(examples)], rewards[len(examples) :]

    def micro_batch_loss(self, examples, normalizer):
        chosen, rejected = self.pair_rewards(examples)
        margin = torch.tensor([e["margin"] for e in examples]) if self.cfg.margin_loss else None
        loss = algo.pairwise_rm_loss(chosen, rejected, margin=margin, kind=self.cfg.loss) * len(examples) / normalizer
        correct = float((chosen > rejected).sum())
        return loss, {"loss": loss.item(), "accuracy": correct / normalizer}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        correct, pairs, total, total_sq, count = 0.0, 0.0, 0.0, 0.0, 0.0
        for micro in chunks(self.eval_shard(), self.cfg.micro_train_batch_size):
            chosen, rejected = self.pair_rewards(micro)
            both = torch.cat([chosen, rejected]).double()
            correct += float((chosen > rejected).sum())
            pairs += len(micro)
            total, total_sq, count = total + float(both.sum()), total_sq + float((both**2).sum()), count + len(both)
        sums = self.all_reduce_sum({"correct": correct, "pairs": pairs, "sum": total, "sum_sq": total_sq,
                                    "count": count})
        mean = sums["sum"] / sums["count"]
        std = max(sums["sum_sq"] / sums["count"] - mean**2, 0.0) ** 0.5
        self.reward_stats = {"reward_mean": mean, "reward_std": std}
        return {"accuracy": sums["correct"] / sums["pairs"], **self.reward_stats}

    def export_extra_config(self) -> dict | None:
        # Normalisation statistics travel with the checkpoint (read by --normalize_reward downstream).
        return getattr(self, "reward_stats", None)


def run(cfg) -> dict:
    validate_sources(cfg, lambda rows, source: data.validate_preference(rows, source, cfg.prompt_key, cfg.chosen_key,
                                                                        cfg.rejected_key))
    return run_rank_group("reward_model", RewardModelWorker, cfg)


if __name__ == "__main__":
    from stages import reward_model

    stage_main("reward_model", reward_model.run)
