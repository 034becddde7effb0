"""TRL's GRPOTrainer on the same model, prompts, reward and budget as the RL stage, for side-by-side numbers.

Run by the benchmark harness in its own process (`python -m bench.trl_grpo ARGS_JSON OUT_JSON`); needs `trl`
(the `bench` extra). Writes loop time, samples/s, each step's mean reward and the held-out greedy accuracy of the
trained policy.
"""

from __future__ import annotations

import json
import sys
import time


def main(args_path: str, out_path: str) -> None:
    started = time.perf_counter()
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stages.tiny import reward_func

    args = json.loads(open(args_path).read())
    tokenizer = AutoTokenizer.from_pretrained(args["model"])
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)

    def rows(path: str) -> list[dict]:
        return [json.loads(line) for line in open(path)]

    def as_chat(row: dict) -> dict:
        return {"prompt": [{"role": "user", "content": row["prompt"]}], "label": row["label"]}

    train = Dataset.from_list([as_chat(r) for r in rows(args["prompts"])][: args["prompts_per_step"] * args["steps"]])

    def task_reward(prompts, completions, label, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return reward_func(texts, [""] * len(texts), label).tolist()

    samples_per_step = args["prompts_per_step"] * args["samples_per_prompt"]
    config = GRPOConfig(
        output_dir=args["output_dir"], report_to=[], use_cpu=True, bf16=False, seed=args["seed"],
        per_device_train_batch_size=samples_per_step, gradient_accumulation_steps=1,
        num_generations=args["samples_per_prompt"], num_iterations=1, max_completion_length=args["new_tokens"],
        temperature=1.0, beta=args["kl_coef"], learning_rate=args["learning_rate"], lr_scheduler_type="constant",
        adam_beta1=0.9, adam_beta2=0.95, max_grad_norm=1.0, max_steps=args["steps"], logging_steps=1,
        save_strategy="no", dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=config, train_dataset=train,
                          processing_class=tokenizer)
    loop_started = time.perf_counter()
    trainer.train()
    loop_seconds = time.perf_counter() - loop_started

    # Held-out greedy accuracy with the same chat template and stop token as the RL stage.
    held_out = rows(args["eval_prompts"])
    tokenizer.padding_side = "left"
    correct = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(held_out), 64):
            chunk = held_out[start : start + 64]
            texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}], tokenize=False,
                                                   add_generation_prompt=True) for r in chunk]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            out = model.generate(**batch, max_new_tokens=args["new_tokens"], do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += int(reward_func(answers, [""] * len(answers), [r["label"] for r in chunk]).sum())
    result = {"loop_seconds": loop_seconds, "samples_per_s": samples_per_step * args["steps"] / loop_seconds,
              "eval_accuracy": correct / len(held_out), "process_seconds": time.perf_counter() - started,
              "train_rewards": [row["reward"] for row in trainer.state.log_history if "reward" in row]}
    open(out_path, "w").write(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
