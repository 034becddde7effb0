"""Supervised fine-tuning: causal-LM loss on response tokens, one global token mean per optimizer step.

    python -m stages.sft --config tiny --pretrain ./model --dataset sft.jsonl --save_path ./out
    deepspeed --module stages.sft --pretrain meta-llama/Meta-Llama-3-8B --dataset ... --zero_stage 3 --bf16
"""

from __future__ import annotations

import torch

from stages import algorithms as algo
from stages import data
from stages.engine import load_for_zero
from stages.launch import run_rank_group, stage_main
from stages.trainer import StepTrainer, chunks, next_token_log_probs, validate_sources


def causal_lm_batch(examples: list[dict], pad_token_id: int, device) -> tuple[torch.Tensor, ...]:
    input_ids, attention_mask = data.pad_sequences([e["input_ids"] for e in examples], pad_token_id)
    loss_mask = data.pad_batch([e["loss_mask"] for e in examples], 0)
    return input_ids.to(device), attention_mask.to(device), loss_mask.to(device)


class SFTWorker(StepTrainer):
    stage = "sft"

    def load_train_model(self, ds_config):
        from stages.model_io import load_causal_lm

        dtype = torch.bfloat16 if self.cfg.bf16 else torch.float32
        attn = "flash_attention_2" if self.cfg.flash_attn and self.device == "cuda" else None
        return load_for_zero(lambda: load_causal_lm(self.model_path, dtype=dtype, attn_implementation=attn), ds_config)

    def build_examples(self, source: str, split: str) -> list[dict]:
        cfg = self.cfg
        rows = data.load_rows(source, split=split, max_samples=cfg.max_samples)
        return data.build_sft_examples(
            rows, self.tokenizer, input_key=cfg.input_key, output_key=cfg.output_key,
            apply_chat_template=cfg.apply_chat_template, max_len=cfg.max_len,
        )

    def step_normalizer(self, examples: list[dict]) -> float:
        # Response tokens that are predicted: the mask is shifted by one against the inputs.
        return float(sum(sum(e["loss_mask"][1:]) for e in examples))

    def micro_batch_loss(self, examples, normalizer):
        input_ids, attention_mask, loss_mask = causal_lm_batch(examples, self.tokenizer.pad_token_id,
                                                               self.model_device)
        logp = next_token_log_probs(self.engine, input_ids, attention_mask)
        loss = algo.aggregate_token_loss(-logp, loss_mask[:, 1:], normalizer)
        return loss, {"loss": loss.item()}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        self.engine.eval()
        nll, tokens = 0.0, 0.0
        for micro in chunks(self.eval_shard(), self.cfg.micro_train_batch_size):
            input_ids, attention_mask, loss_mask = causal_lm_batch(micro, self.tokenizer.pad_token_id,
                                                                   self.model_device)
            logp = next_token_log_probs(self.engine, input_ids, attention_mask)
            nll += float(-(logp * loss_mask[:, 1:]).sum())
            tokens += float(loss_mask[:, 1:].sum())
        totals = self.all_reduce_sum({"nll": nll, "tokens": tokens})
        return {"loss": totals["nll"] / max(totals["tokens"], 1.0)}


def run(cfg) -> dict:
    validate_sources(cfg, lambda rows, source: data.validate_sft(rows, source, cfg.input_key, cfg.output_key))
    return run_rank_group("sft", SFTWorker, cfg)


if __name__ == "__main__":
    # Ray pickles classes of __main__ by value; importing the module by name lets rank actors import it instead.
    from stages import sft

    stage_main("sft", sft.run)
