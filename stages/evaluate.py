"""Evaluation of a policy against its reference on held-out prompts.

For the policy and the reference: task accuracy of greedy answers (rule reward), mean reward-model score of those
answers, mean response length. For the policy: KL(policy || reference), estimated per prompt as the sum over
response tokens of log π − log π_ref on responses sampled from the policy at temperature 1, averaged over prompts.
Prompts are sharded over the ranks of an actor group.

    python -m stages.evaluate --config tiny --pretrain ./policy --ref_pretrain ./sft --reward_pretrain ./rm \
        --remote_rm_url reward.py --prompt_data prompts_eval.jsonl --save_path ./report
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import ray
import torch

from stages import algorithms as algo
from stages import data
from stages import engine as ds
from stages.distributed import ActorGroup, RankWorker, cluster_device, init_ray
from stages.launch import stage_main
from stages.rewards import load_reward_function
from stages.rl import build_sequences
from stages.trainer import chunks, next_token_log_probs


class EvalWorker(RankWorker):
    def setup(self, cfg_dict: dict, config_cls: type) -> None:
        from stages.model_io import load_causal_lm, load_tokenizer, load_value_model

        self.cfg = cfg = config_cls.model_validate(cfg_dict)
        torch.manual_seed(cfg.seed + self.rank)
        self.tokenizer = load_tokenizer(cfg.pretrain, padding_side="left")
        self.policy = load_causal_lm(cfg.pretrain).eval().to(self.device)
        self.reference = load_causal_lm(cfg.ref_pretrain).eval().to(self.device) if cfg.ref_pretrain else None
        self.reward_model = (load_value_model(cfg.reward_pretrain).eval().to(self.device) if cfg.reward_pretrain
                             else None)
        self.reward_fn = load_reward_function(cfg.remote_rm_url) if cfg.remote_rm_url else None

    @torch.no_grad()
    def generate(self, model, prompt_ids: list[list[int]], temperature: float) -> list[list[int]]:
        """Response ids (up to and including eos) per prompt; temperature 0 is greedy decoding."""
        greedy = temperature == 0
        pad, eos = self.tokenizer.pad_token_id, self.tokenizer.eos_token_id
        input_ids, attention_mask = (t.to(self.device) for t in data.pad_sequences(prompt_ids, pad, side="left"))
        output = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=self.cfg.generate_max_len,
            do_sample=not greedy, temperature=None if greedy else temperature, top_p=None, top_k=None,
            pad_token_id=pad, eos_token_id=eos,
        )
        responses = []
        for row in output[:, input_ids.shape[1] :].tolist():
            responses.append(row[: row.index(eos) + 1] if eos in row else row)
        return responses

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def sequences(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> dict[str, torch.Tensor]:
        batch = build_sequences(prompt_ids, response_ids, self.tokenizer.pad_token_id)
        return {key: value.to(self.device) for key, value in batch.items()}

    @torch.no_grad()
    def rm_scores(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> torch.Tensor:
        # The reward model was trained on prompt + response + eos token ids of the same tokenizer.
        batch = self.sequences(prompt_ids, response_ids)
        scores = self.reward_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        return scores[:, 0].float().cpu()

    @torch.no_grad()
    def sequence_kl(self, prompt_ids: list[list[int]], response_ids: list[list[int]]) -> torch.Tensor:
        batch = self.sequences(prompt_ids, response_ids)
        logp, ref_logp = (next_token_log_probs(model, batch["input_ids"], batch["attention_mask"])
                          for model in (self.policy, self.reference))
        kl = algo.compute_kl(logp, ref_logp, "k1")
        return (kl * batch["action_mask"]).sum(-1).cpu()

    def evaluate(self, shard: list[dict]) -> dict[str, Any]:
        sums: dict[str, float] = {"prompts": float(len(shard))}
        samples: list[dict] = []
        models = {"": self.policy, "reference_": self.reference} if self.reference else {"": self.policy}
        for batch in chunks(shard, self.cfg.micro_rollout_batch_size):
            prompts = [p["prompt"] for p in batch]
            prompt_ids = [p["prompt_ids"] for p in batch]
            labels = [p["label"] for p in batch]
            for prefix, model in models.items():
                responses = self.generate(model, prompt_ids, self.cfg.temperature)
                texts = [self.decode(r) for r in responses]
                queries = [p + t for p, t in zip(prompts, texts)]
                add(sums, f"{prefix}response_length", sum(len(r) for r in responses))
                if self.reward_fn:
                    correct = torch.as_tensor(self.reward_fn(queries, prompts, labels), dtype=torch.float32)
                    add(sums, f"{prefix}accuracy", float(correct.sum()))
                if self.reward_model is not None:
                    add(sums, f"{prefix}reward_mean", float(self.rm_scores(prompt_ids, responses).sum()))
                samples += [{"model": prefix.rstrip("_") or "policy", "prompt": p, "label": l, "response": t}
                            for p, l, t in list(zip(prompts, labels, texts))[:4]]
            if self.reference is not None:
                sampled = self.generate(self.policy, prompt_ids, temperature=1.0)  # KL is an expectation under π
                add(sums, "kl_mean", float(self.sequence_kl(prompt_ids, sampled).sum()))
        return {"sums": sums, "samples": samples}


def add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + value


def run(cfg) -> dict[str, Any]:
    from stages.config import EvaluateConfig
    from stages.model_io import load_tokenizer

    rows = data.load_rows(cfg.prompt_data, split=cfg.prompt_split, max_samples=cfg.max_samples)
    data.validate_prompts(rows, cfg.prompt_data, cfg.input_key, cfg.label_key)
    if cfg.remote_rm_url:
        load_reward_function(cfg.remote_rm_url)  # fail before any rank starts
    prompts = data.build_prompt_examples(rows, load_tokenizer(cfg.pretrain), input_key=cfg.input_key,
                                         label_key=cfg.label_key, apply_chat_template=cfg.apply_chat_template,
                                         prompt_max_len=cfg.prompt_max_len)
    init_ray()
    group = ActorGroup(EvalWorker, cfg.world_size, cluster_device(cfg.device), name="evaluate")
    try:
        group.run("setup", cfg.model_dump(), EvaluateConfig)
        results = group.run_sharded("evaluate", [prompts[r :: group.world_size] for r in range(group.world_size)])
    finally:
        group.shutdown()
    totals: dict[str, float] = {}
    for result in results:
        for key, value in result["sums"].items():
            add(totals, key, value)
    count = totals.pop("prompts")
    metrics = {key: value / count for key, value in totals.items()}
    metrics["prompts"] = int(count)
    ds.write_metrics(cfg.save_path, metrics)
    with open(Path(cfg.save_path) / "samples.jsonl", "w") as out:
        for result in results:
            for sample in result["samples"]:
                out.write(json.dumps(sample) + "\n")
    ray.shutdown()
    return {"metrics": metrics}


if __name__ == "__main__":
    from stages import evaluate

    stage_main("evaluate", evaluate.run)
