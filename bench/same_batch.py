"""One GRPO update on the same batch, ours beside TRL's GRPOTrainer: advantages, loss, gradient, optimizer step.

    python -m bench.same_batch --model DIR --prompts FILE --out JSON

The accuracy rows of `python -m bench` compare two trainers through their sampling noise; this compares their
updates with the noise taken out. One batch is sampled from DIR (32 prompts x 4 answers of at most 8 tokens, the
bench's shape) and scored with the tiny task's rule reward; then on that batch:
- advantages: ours (stages.algorithms, group_norm) against TRL's group formula, (r - mean) / (std + 1e-4);
- loss and gradient: ours (the actor's forward and token losses of stages.rl.actor) against TRL's own `_compute_loss`
  (loss_type dapo, KL 0.01 k3 to a reference moved off the policy so that the KL term counts);
- one optimizer step from the same loss: our DeepSpeed engine (ZeRO-2, AdamW, clipping 1.0) against torch AdamW
  with `clip_grad_norm_`, what the HF Trainer under TRL runs.
Needs `trl` (the `bench` extra). Prints the differences and writes them as JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
from types import SimpleNamespace

import torch

from infra.ray_cluster import free_port
from stages import algorithms as algo
from stages.rl import algorithms as rl_algo
from stages.rl.actor import policy_forward
from stages.sequences import build_sequences
from stages.tiny import reward_func

PROMPTS, SAMPLES, NEW_TOKENS, KL_COEF, LEARNING_RATE = 32, 4, 8, 0.01, 3e-4


def sample_batch(model, tokenizer, rows: list[dict],
                 seed: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """Prompt ids, sampled responses (ending at eos or the cap) and their rule rewards, SAMPLES per prompt."""
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                           add_generation_prompt=True) for r in rows]
    prompt_ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts for _ in range(SAMPLES)]
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(**batch, do_sample=True, top_k=0, max_new_tokens=NEW_TOKENS,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    responses = []
    for row in out[:, batch["input_ids"].shape[1] :].tolist():
        stop = next((t for t, token in enumerate(row) if token == tokenizer.eos_token_id), None)
        responses.append(row if stop is None else row[: stop + 1])
    answers = [tokenizer.decode(r, skip_special_tokens=True) for r in responses]
    rewards = reward_func(answers, [""] * len(answers), [r["label"] for r in rows for _ in range(SAMPLES)])
    return prompt_ids, responses, rewards


def flat_gradient(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()]).clone()


def our_loss(model, ref, prompt_ids, responses, rewards, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, per-sample advantage): the RL stage's actor loss on the batch as one optimizer step."""
    batch = build_sequences(prompt_ids, responses, pad_id)
    mask = batch["action_mask"]
    advantages, _ = rl_algo.compute_advantages("group_norm", rewards, mask, n_samples_per_prompt=SAMPLES)
    with torch.no_grad():
        ref_logp, _ = policy_forward(ref, batch, 1.0, False)
    logp, _ = policy_forward(model, batch, 1.0, False)
    loss_t, _ = rl_algo.policy_loss(logp, logp.detach(), advantages)
    tokens = mask.sum()
    loss = (algo.aggregate_token_loss(loss_t, mask, tokens)
            + KL_COEF * algo.aggregate_token_loss(rl_algo.compute_kl(logp, ref_logp, "k3"), mask, tokens))
    return loss, algo.masked_sum(advantages, mask, dim=1) / mask.sum(1).clamp(min=1)


def our_update(model, ref, prompt_ids, responses, rewards, pad_id: int) -> tuple[torch.Tensor, float, torch.Tensor]:
    """(per-sample advantage, loss, gradient) of our actor loss."""
    model.zero_grad()
    loss, advantages = our_loss(model, ref, prompt_ids, responses, rewards, pad_id)
    loss.backward()
    return advantages, loss.item(), flat_gradient(model)


def trl_update(model, ref, tokenizer, prompt_ids, responses, rewards, work_dir: str):
    """(per-sample advantage, loss, gradient) from TRL's GRPOTrainer._compute_loss on the same batch."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    config = GRPOConfig(output_dir=work_dir, report_to=[], use_cpu=True, bf16=False, max_steps=1, save_strategy="no",
                        per_device_train_batch_size=PROMPTS * SAMPLES, num_generations=SAMPLES,
                        max_completion_length=NEW_TOKENS, beta=KL_COEF, learning_rate=LEARNING_RATE)
    trainer = GRPOTrainer(model=model, reward_funcs=lambda completions, **_: [0.0] * len(completions), args=config,
                          train_dataset=Dataset.from_list([{"prompt": "unused"}] * SAMPLES), processing_class=tokenizer)
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, which this call skips
    trainer.ref_model.load_state_dict(ref.state_dict())
    prompts = tokenizer.pad({"input_ids": prompt_ids}, return_tensors="pt")  # left, as TRL pads prompts
    width = max(map(len, responses))
    completion_ids = torch.full((len(responses), width), tokenizer.pad_token_id)
    completion_mask = torch.zeros(len(responses), width, dtype=torch.long)
    for row, response in enumerate(responses):
        completion_ids[row, : len(response)] = torch.tensor(response)
        completion_mask[row, : len(response)] = 1
    groups = rewards.view(-1, SAMPLES)
    advantages = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).flatten()
    with torch.no_grad():
        ids = torch.cat([prompts["input_ids"], completion_ids], 1)
        attention = torch.cat([prompts["attention_mask"], completion_mask], 1)
        ref_logps = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, attention, width)[0]
    inputs = {"prompt_ids": prompts["input_ids"], "prompt_mask": prompts["attention_mask"],
              "completion_ids": completion_ids, "completion_mask": completion_mask, "advantages": advantages,
              "ref_per_token_logps": ref_logps, "num_items_in_batch": completion_mask.sum()}
    model.train()
    model.zero_grad()
    loss = trainer._compute_loss(model, inputs)
    loss.backward()
    return advantages, loss.item(), flat_gradient(model)


def optimizer_step_difference(model, ref, prompt_ids, responses, rewards, pad_id: int) -> float:
    """Largest parameter difference after one step from our loss: our DeepSpeed engine against torch AdamW."""
    import deepspeed

    from stages.engine import build_train_engine, deepspeed_config

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = SimpleNamespace(zero_stage=2, max_norm=1.0, bf16=False, gradient_checkpointing=False, adam_betas=(0.9, 0.95),
                          l2=0.0, lr_scheduler="constant", lr_warmup_ratio=0.0)
    ours, theirs = copy.deepcopy(model), copy.deepcopy(model)
    size = PROMPTS * SAMPLES
    engine = build_train_engine(ours, cfg, deepspeed_config(cfg, world_size=1, train_batch_size=size,
                                                             micro_batch_size=size),
                                learning_rate=LEARNING_RATE, total_steps=1)
    optimizer = torch.optim.AdamW(theirs.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0)
    engine.backward(our_loss(engine, ref, prompt_ids, responses, rewards, pad_id)[0])
    engine.step()
    our_update(theirs, ref, prompt_ids, responses, rewards, pad_id)
    torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    optimizer.step()
    return max((a - b).abs().max().item() for a, b in zip(engine.module.parameters(), theirs.parameters()))


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="HF model directory (the bench uses the tiny preset's SFT)")
    parser.add_argument("--prompts", required=True, help="JSONL of {prompt, label} rows; the first 32 are sampled")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    ref = copy.deepcopy(model)
    torch.manual_seed(args.seed)
    with torch.no_grad():  # a reference a little off the policy: the KL term and its gradient are not zero
        for param in ref.parameters():
            param.add_(torch.randn_like(param) * 0.005)
    rows = [json.loads(line) for line in open(args.prompts)][:PROMPTS]
    prompt_ids, responses, rewards = sample_batch(model, tokenizer, rows, args.seed)
    pad_id = tokenizer.pad_token_id
    # Before TRL's trainer is built: it patches the forward of the model it trains.
    step_difference = optimizer_step_difference(model, ref, prompt_ids, responses, rewards, pad_id)
    our_adv, our_loss_value, our_grad = our_update(model, ref, prompt_ids, responses, rewards, pad_id)
    trl_adv, trl_loss_value, trl_grad = trl_update(model, ref, tokenizer, prompt_ids, responses, rewards,
                                             os.path.join(os.path.dirname(os.path.abspath(args.out)), "trl-same-batch"))
    result = {
        "reward_mean": rewards.mean().item(), "response_length": sum(map(len, responses)) / len(responses),
        "advantage_max_difference": (our_adv - trl_adv).abs().max().item(),
        "loss": {"ours": our_loss_value, "trl": trl_loss_value},
        "gradient_norm": {"ours": our_grad.norm().item(), "trl": trl_grad.norm().item()},
        "gradient_cosine": torch.nn.functional.cosine_similarity(our_grad.double(), trl_grad.double(), 0).item(),
        "optimizer_step_max_parameter_difference": step_difference,
    }
    with open(args.out, "w") as out:
        json.dump(result, out, indent=1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
