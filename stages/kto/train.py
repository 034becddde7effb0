"""Kahneman-Tversky optimisation (KTO, Ethayarajh et al. 2024) on unpaired desirable/undesirable responses.

The policy and a frozen reference (--ref_pretrain, default: the starting model) score each response; with
r = log pi(y|x) - log ref(y|x) (summed over response tokens), a desirable sample loses
w_D (1 - sigmoid(beta (r - z0))) and an undesirable one w_U (1 - sigmoid(beta (z0 - r))). The reference point z0
is the batch KL estimate: the mean of log pi - log ref over mismatched pairs (each prompt with the next sample's
response in the micro-batch), averaged over data-parallel ranks, clamped at 0 and not differentiated (TRL's KTO).

Data: unpaired rows (--input_key, --output_key, --label_key: a bool, true = desirable; TRL's prompt/completion/
label), or preference pairs (--prompt_key, --chosen_key, --rejected_key, detected by their columns), each split
into a desirable and an undesirable row.

    python -m stages.kto --config tiny --pretrain ./sft --dataset kto.jsonl --save_path ./kto
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from stages import algorithms as algo
from stages import data
from stages.launch import run_rank_group
from stages.trainer import ReferenceStepTrainer


# The config fields encode_rows reads: with the rows and the tokenizer, they key the prepared examples' cache.
EXAMPLE_FIELDS = ("input_key", "output_key", "label_key", "prompt_key", "chosen_key", "rejected_key",
                  "apply_chat_template", "input_template", "max_len")


def encode_rows(cfg, tokenizer, rows) -> data.Encoded:
    keys = {"input_key": cfg.input_key, "output_key": cfg.output_key, "label_key": cfg.label_key}
    if cfg.is_paired(rows):
        rows = data.unpair_preferences(rows, prompt_key=cfg.prompt_key, chosen_key=cfg.chosen_key,
                                       rejected_key=cfg.rejected_key)
        keys = {"input_key": "prompt", "output_key": "completion", "label_key": "label"}
    return data.encode_kto(rows, tokenizer, apply_chat_template=cfg.apply_chat_template,
                                   input_template=cfg.input_template, max_len=cfg.max_len, **keys)


def kto_sequences(examples: list[dict], max_len: int) -> tuple[list[list[int]], list[list[int]], list[list[int]],
                                                               list[list[int]]]:
    """(sequences, their loss masks, KL sequences, their loss masks). KL sequence i is prompt i with the response
    of sample i + 1 (cyclically), cut to max_len: a response the prompt did not ask for."""
    def joined(prompt: list[int], response: list[int]) -> tuple[list[int], list[int]]:
        ids, mask = data.prompt_and_response(prompt, response)
        return ids[:max_len], mask[:max_len]

    matched = [joined(e["prompt_ids"], e["response_ids"]) for e in examples]
    shifted = examples[1:] + examples[:1]
    mismatched = [joined(e["prompt_ids"], other["response_ids"]) for e, other in zip(examples, shifted)]
    return ([ids for ids, _ in matched], [mask for _, mask in matched],
            [ids for ids, _ in mismatched], [mask for _, mask in mismatched])


def kto_terms(policy_sums: torch.Tensor, ref_sums: torch.Tensor, kl_estimate: torch.Tensor, examples: list[dict],
              cfg) -> dict[str, torch.Tensor]:
    """Mean KTO loss of the micro-batch, implicit rewards beta * r of its desirable and undesirable samples and the
    reference point z0, from summed response log-probs [B]."""
    desirable = torch.tensor([e["desirable"] for e in examples], device=policy_sums.device)
    loss, desirable_rewards, undesirable_rewards, z0 = algo.kto_loss(
        policy_sums, ref_sums, desirable, kl_estimate, cfg.beta,
        desirable_weight=cfg.desirable_loss_weight, undesirable_weight=cfg.undesirable_loss_weight,
    )
    return {"loss": loss, "desirable_rewards": desirable_rewards, "undesirable_rewards": undesirable_rewards,
            "z0": z0}


class KTOWorker(ReferenceStepTrainer):
    stage = "kto"

    encode_rows = staticmethod(encode_rows)
    example_fields = EXAMPLE_FIELDS

    def micro_terms(self, examples: list[dict], average_kl_over_ranks: bool) -> dict[str, torch.Tensor]:
        sequences, masks, kl_sequences, kl_masks = kto_sequences(examples, self.cfg.max_len)
        n = len(examples)
        policy = algo.response_sums(self.log_probs(self.engine, sequences), masks)
        with torch.no_grad():
            policy_kl = algo.response_sums(self.log_probs(self.engine, kl_sequences), kl_masks)
            reference = algo.response_sums(self.log_probs(self.reference, sequences + kl_sequences), masks + kl_masks)
        kl_estimate = algo.kto_kl_estimate(policy_kl, reference[n:])
        if average_kl_over_ranks:
            dist.all_reduce(kl_estimate)
            kl_estimate = kl_estimate / self.world_size
        return kto_terms(policy, reference[:n], kl_estimate, examples, self.cfg)

    def micro_batch_loss(self, examples, normalizer):
        terms = self.micro_terms(examples, average_kl_over_ranks=True)
        loss = terms["loss"] * len(examples) / normalizer
        sequences = sum(len(e["prompt_ids"]) + len(e["response_ids"]) for e in examples)
        return loss, {"loss": loss.item(), "kl": float(terms["z0"]) * len(examples) / normalizer,
                      **self.reward_sums(terms), "tokens": float(sequences)}

    @staticmethod
    def reward_sums(terms: dict[str, torch.Tensor]) -> dict[str, float]:
        return {"desirable_reward_sum": float(terms["desirable_rewards"].sum()),
                "desirable_count": float(terms["desirable_rewards"].numel()),
                "undesirable_reward_sum": float(terms["undesirable_rewards"].sum()),
                "undesirable_count": float(terms["undesirable_rewards"].numel())}

    def step_record(self, sums: dict[str, float]) -> dict[str, float]:
        record = {key: value for key, value in sums.items() if not key.endswith(("_sum", "_count"))}
        for side in ("desirable", "undesirable"):
            record[f"{side}_reward"] = sums[f"{side}_reward_sum"] / max(sums[f"{side}_count"], 1.0)
        return record

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        sums = {"loss": 0.0, "samples": 0.0, "desirable_reward_sum": 0.0, "desirable_count": 0.0,
                "undesirable_reward_sum": 0.0, "undesirable_count": 0.0}
        for micro, real in self.eval_micro_batches():
            # Held-out micro-batches take their KL reference point from themselves (no collective per batch).
            terms = self.micro_terms(micro, average_kl_over_ranks=False)
            if not real:
                continue
            sums["loss"] += float(terms["loss"]) * len(micro)
            sums["samples"] += len(micro)
            for key, value in self.reward_sums(terms).items():
                sums[key] += value
        sums = self.all_reduce_sum(sums)
        return {"loss": sums["loss"] / sums["samples"], **{
            key: value for key, value in self.step_record(sums).items() if key.endswith("_reward")}}


def run(cfg) -> dict:
    def validate(rows, source: str) -> None:
        cfg.validate_rows(rows, source)
        layout = ("preference pairs (--prompt_key, --chosen_key, --rejected_key), each split into a desirable and "
                  "an undesirable sample" if cfg.is_paired(rows) else
                  "unpaired samples (--input_key, --output_key, --label_key)")
        print(f"[kto] {source}: {layout}", flush=True)

    return run_rank_group("kto", KTOWorker, cfg, validate)
