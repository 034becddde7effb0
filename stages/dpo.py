"""Direct preference optimisation (DPO, conservative DPO with --label_smoothing, IPO with --ipo).

The policy and a frozen reference (--ref_pretrain, default: the starting model) score the response tokens of each
chosen and rejected answer; the loss pushes the policy's log-ratio margin up. An optional NLL term on the chosen
response (--nll_loss_coef) keeps the policy close to the chosen answers.

    deepspeed --module stages.dpo --pretrain ./sft --dataset pref.jsonl --beta 0.1 --zero_stage 3 --bf16
    python -m stages.dpo --config tiny --pretrain ./sft --dataset pref.jsonl --save_path ./dpo
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data
from stages.engine import build_inference_engine, deepspeed_config, load_for_zero
from stages.launch import run_rank_group, stage_main
from stages.trainer import StepTrainer, chunks, next_token_log_probs, validate_sources


def response_log_prob_sums(model, input_ids, attention_mask, loss_mask) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of response-token log-probs per sequence [2B], per-token log-probs [2B, T-1]); loss_mask is aligned
    with the log-probs (shifted by one against the inputs)."""
    token_logp = next_token_log_probs(model, input_ids, attention_mask)
    return algo.masked_sum(token_logp, loss_mask, dim=-1), token_logp


class DPOWorker(StepTrainer):
    stage = "dpo"

    def load_train_model(self, ds_config):
        from stages.model_io import load_causal_lm, resolve_model_path

        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float32
        policy = load_for_zero(lambda: load_causal_lm(self.model_path, dtype=dtype), ds_config)
        ref_path = resolve_model_path(self.cfg.ref_pretrain or self.cfg.pretrain)
        ref_config = deepspeed_config(self.cfg, world_size=self.world_size, train_batch_size=self.cfg.train_batch_size,
                                      micro_batch_size=self.cfg.micro_train_batch_size, train=False)
        reference = load_for_zero(lambda: load_causal_lm(ref_path, dtype=dtype), ref_config)
        self.reference = build_inference_engine(reference, ref_config, self.device)
        return policy

    def build_examples(self, source: str, split: str) -> list[dict]:
        cfg = self.cfg
        rows = data.load_rows(source, split=split, max_samples=cfg.max_samples)
        return data.build_preference_examples(
            rows, self.tokenizer, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key,
            rejected_key=cfg.rejected_key, apply_chat_template=cfg.apply_chat_template, max_len=cfg.max_len,
        )

    def step_normalizer(self, examples: list[dict]) -> float:
        return float(len(examples))

    def pair_terms(self, examples) -> dict[str, torch.Tensor]:
        input_ids, attention_mask, loss_mask = (t.to(self.model_device) for t in
                                                data.preference_batch(examples, self.tokenizer.pad_token_id))
        loss_mask = loss_mask[:, 1:]
        policy_sums, policy_tokens = response_log_prob_sums(self.engine, input_ids, attention_mask, loss_mask)
        with torch.no_grad():
            ref_sums, _ = response_log_prob_sums(self.reference, input_ids, attention_mask, loss_mask)
        n = len(examples)
        loss, chosen_reward, rejected_reward = algo.preference_loss(
            policy_sums[:n], policy_sums[n:], ref_sums[:n], ref_sums[n:], self.cfg.beta,
            label_smoothing=self.cfg.label_smoothing, ipo=self.cfg.ipo,
        )
        chosen_nll = algo.masked_mean(-policy_tokens[:n], loss_mask[:n])
        return {"loss": loss, "nll": chosen_nll, "chosen_reward": chosen_reward, "rejected_reward": rejected_reward}

    def micro_batch_loss(self, examples, normalizer):
        terms = self.pair_terms(examples)
        share = len(examples) / normalizer
        loss = (terms["loss"] + self.cfg.nll_loss_coef * terms["nll"]) * share
        correct = float((terms["chosen_reward"] > terms["rejected_reward"]).sum())
        return loss, {"loss": loss.item(), "accuracy": correct / normalizer,
                      "reward_margin": float((terms["chosen_reward"] - terms["rejected_reward"]).sum()) / normalizer}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        sums = {"loss": 0.0, "correct": 0.0, "pairs": 0.0}
        for micro in chunks(self.eval_shard(), self.cfg.micro_train_batch_size):
            terms = self.pair_terms(micro)
            sums["loss"] += float(terms["loss"]) * len(micro)
            sums["correct"] += float((terms["chosen_reward"] > terms["rejected_reward"]).sum())
            sums["pairs"] += len(micro)
        sums = self.all_reduce_sum(sums)
        return {"loss": sums["loss"] / sums["pairs"], "accuracy": sums["correct"] / sums["pairs"]}


def run(cfg) -> dict:
    validate_sources(cfg, lambda rows, source: data.validate_preference(rows, source, cfg.prompt_key, cfg.chosen_key,
                                                                        cfg.rejected_key))
    return run_rank_group("dpo", DPOWorker, cfg)


if __name__ == "__main__":
    from stages import dpo

    stage_main("dpo", dpo.run)
