"""Direct preference optimisation (DPO, conservative DPO with --label_smoothing, IPO with --ipo).

The policy and a frozen reference (--ref_pretrain, default: the starting model) score the response tokens of each
chosen and rejected answer; the loss pushes the policy's log-ratio margin up. An optional NLL term on the chosen
response (--nll_loss_coef) keeps the policy close to the chosen answers. Data as for the reward model: prompt/
chosen/rejected columns, or whole conversations without --prompt_key (prompt = their shared prefix).

    deepspeed --module stages.dpo --pretrain ./sft --dataset pref.jsonl --beta 0.1 --zero_stage 3 --bf16
    python -m stages.dpo --config tiny --pretrain ./sft --dataset pref.jsonl --save_path ./dpo
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data
from stages.launch import run_rank_group
from stages.sequences import pair_sequences
from stages.trainer import ReferenceStepTrainer


# The config fields encode_rows reads: with the rows and the tokenizer, they key the prepared examples' cache.
EXAMPLE_FIELDS = ("prompt_key", "chosen_key", "rejected_key", "apply_chat_template", "input_template", "max_len")


def encode_rows(cfg, tokenizer, rows) -> data.Encoded:
    return data.encode_preferences(
        rows, tokenizer, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key, rejected_key=cfg.rejected_key,
        apply_chat_template=cfg.apply_chat_template, input_template=cfg.input_template, max_len=cfg.max_len,
    )


def pair_masks(examples: list[dict]) -> list[list[int]]:
    return [e["chosen_loss_mask"] for e in examples] + [e["rejected_loss_mask"] for e in examples]


def dpo_terms(policy_log_probs: list[torch.Tensor], ref_log_probs: list[torch.Tensor], examples: list[dict], cfg
              ) -> dict[str, torch.Tensor]:
    """Mean DPO/IPO loss of the pairs, the mean chosen NLL (per sequence token mean, as OpenRLHF) and the implicit
    rewards, from the token log-probs of the chosen then rejected sequences (pair_sequences order)."""
    masks, n = pair_masks(examples), len(examples)
    policy, reference = algo.response_sums(policy_log_probs, masks), algo.response_sums(ref_log_probs, masks)
    loss, chosen_reward, rejected_reward = algo.preference_loss(
        policy[:n], policy[n:], reference[:n], reference[n:], cfg.beta, label_smoothing=cfg.label_smoothing,
        ipo=cfg.ipo,
    )
    chosen_nll = -algo.response_means(policy_log_probs[:n], masks[:n]).mean()
    return {"loss": loss, "nll": chosen_nll, "chosen_reward": chosen_reward, "rejected_reward": rejected_reward}


class DPOWorker(ReferenceStepTrainer):
    stage = "dpo"

    encode_rows = staticmethod(encode_rows)
    example_fields = EXAMPLE_FIELDS

    def pair_terms(self, examples) -> dict[str, torch.Tensor]:
        sequences = pair_sequences(examples)
        policy = self.log_probs(self.engine, sequences)
        with torch.no_grad():
            reference = self.log_probs(self.reference, sequences)
        return dpo_terms(policy, reference, examples, self.cfg)

    def micro_batch_loss(self, examples, normalizer):
        with self.router_losses() as aux_losses:  # the policy's one forward of both sides (not the reference's)
            terms = self.pair_terms(examples)
        share = len(examples) / normalizer
        loss = (terms["loss"] + self.cfg.nll_loss_coef * terms["nll"]) * share
        correct = float((terms["chosen_reward"] > terms["rejected_reward"]).sum())
        return self.with_aux_loss(loss, {
            "loss": loss.item(), "accuracy": correct / normalizer,
            "reward_margin": float((terms["chosen_reward"] - terms["rejected_reward"]).sum()) / normalizer,
            "tokens": float(sum(map(len, pair_sequences(examples))))}, aux_losses)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        sums = {"loss": 0.0, "correct": 0.0, "pairs": 0.0}
        for micro, real in self.eval_micro_batches():
            terms = self.pair_terms(micro)
            if not real:
                continue
            sums["loss"] += float(terms["loss"]) * len(micro)
            sums["correct"] += float((terms["chosen_reward"] > terms["rejected_reward"]).sum())
            sums["pairs"] += len(micro)
        sums = self.all_reduce_sum(sums)
        return {"loss": sums["loss"] / sums["pairs"], "accuracy": sums["correct"] / sums["pairs"]}


def run(cfg) -> dict:
    return run_rank_group("dpo", DPOWorker, cfg, cfg.validate_rows)
