"""Supervised fine-tuning: causal-LM loss on the trained tokens, one global token mean per optimizer step.

What is trained (OpenRLHF's SFT modes): the response of prompt/response rows (--input_key/--output_key, through
--input_template or --apply_chat_template, with an optional --system_key), every assistant turn of whole
conversations (--multiturn), or every token of raw text (--pretrain_mode).

    python -m stages.sft --config tiny --pretrain ./model --dataset sft.jsonl --save_path ./out
    deepspeed --module stages.sft --pretrain meta-llama/Meta-Llama-3-8B --dataset Open-Orca/OpenOrca \\
        --input_key question --output_key response --input_template $'User: {}\\nAssistant: ' --zero_stage 2 --bf16
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data
from stages.engine import load_for_zero
from stages.launch import run_rank_group
from stages.trainer import StepTrainer


# The config fields encode_rows reads: with the rows and the tokenizer, they key the prepared examples' cache.
EXAMPLE_FIELDS = ("input_key", "output_key", "apply_chat_template", "input_template", "max_len", "system_key",
                  "multiturn", "pretrain_mode")


def encode_rows(cfg, tokenizer, rows) -> data.Encoded:
    return data.encode_sft(
        rows, tokenizer, input_key=cfg.input_key, output_key=cfg.output_key,
        apply_chat_template=cfg.apply_chat_template, input_template=cfg.input_template, max_len=cfg.max_len,
        system_key=cfg.system_key, multiturn=cfg.multiturn, pretrain_mode=cfg.pretrain_mode,
    )


def token_count(examples: list[dict]) -> float:
    """Trained tokens of the examples; the mask is shifted by one against the log-probs (token 0 has none)."""
    return float(sum(sum(e["loss_mask"][1:]) for e in examples))


def sft_loss(token_log_probs: list[torch.Tensor], examples: list[dict], normalizer: float) -> torch.Tensor:
    """Summed NLL of the trained tokens / normalizer (the step's trained tokens: a global token mean)."""
    masks = torch.cat([torch.tensor(e["loss_mask"][1:], device=token_log_probs[0].device) for e in examples])
    return algo.aggregate_token_loss(-torch.cat(token_log_probs), masks, normalizer)


class SFTWorker(StepTrainer):
    stage = "sft"

    def load_train_model(self, ds_config):
        from stages.model_io import load_causal_lm, loading_options

        options = loading_options(self.cfg, self.device)
        return load_for_zero(lambda: load_causal_lm(self.model_path, **options), ds_config)

    encode_rows = staticmethod(encode_rows)
    example_fields = EXAMPLE_FIELDS

    def step_normalizer(self, examples: list[dict]) -> float:
        return token_count(examples)

    def micro_batch_loss(self, examples, normalizer):
        sequences = [e["input_ids"] for e in examples]
        with self.router_losses() as aux_losses:
            loss = sft_loss(self.log_probs(self.engine, sequences), examples, normalizer)
        return self.with_aux_loss(loss, {"loss": loss.item(), "tokens": float(sum(map(len, sequences)))}, aux_losses)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        nll, tokens = 0.0, 0.0
        for micro, real in self.eval_micro_batches():
            micro_nll = float(sft_loss(self.log_probs(self.engine, [e["input_ids"] for e in micro]), micro, 1.0))
            if real:
                nll, tokens = nll + micro_nll, tokens + token_count(micro)
        totals = self.all_reduce_sum({"nll": nll, "tokens": tokens})
        return {"loss": totals["nll"] / max(totals["tokens"], 1.0)}


def run(cfg) -> dict:
    return run_rank_group("sft", SFTWorker, cfg, cfg.validate_rows)
