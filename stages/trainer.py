"""The step loop shared by the supervised stages (SFT, reward model, DPO, KTO).

Each rank runs the same loop over a deterministic global schedule: step s of epoch e takes a fixed slice of a
seeded permutation, rank r takes every world_size-th example of it. Because the schedule is a pure function of
(seed, step), a job restarted from a checkpoint continues with exactly the batches it would have seen.
Losses are normalised by a per-step global count (tokens or pairs) so gradient accumulation and the number of
ranks do not change the gradient.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from stages import engine as ds
from stages.distributed import RankWorker


def next_token_log_probs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float = 1.0) -> torch.Tensor:
    """log p(token t+1 | tokens <= t) for every position, [B, T-1], fp32; logits divided by `temperature`."""
    from stages import algorithms as algo

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    return algo.token_log_probs(logits / temperature, input_ids[:, 1:])


def chunks(items: list, size: int) -> list[list]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class StepTrainer(RankWorker):
    """Subclasses set `stage` and implement the model/data/loss hooks below."""

    stage: str = ""

    # ---- hooks
    def load_train_model(self, ds_config: dict) -> torch.nn.Module: ...
    def build_examples(self, source: str, split: str) -> list[dict]: ...
    def step_normalizer(self, examples: list[dict]) -> float: ...
    def micro_batch_loss(self, examples: list[dict], normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch as `sum / normalizer` (un-scaled) and summed statistics for logging."""
    def evaluate(self) -> dict[str, float]: ...
    def export_extra_config(self) -> dict | None:
        return None

    # ---- the loop
    def setup(self, cfg_dict: dict, config_cls: type) -> dict[str, int]:
        self.cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        ds.seed_everything(self.cfg.seed)
        from stages.model_io import load_tokenizer, resolve_model_path

        self.model_path = resolve_model_path(self.cfg.pretrain)
        self.tokenizer = load_tokenizer(self.model_path)
        self.train_examples = self.build_examples(self.cfg.dataset, self.cfg.dataset_split)
        self.eval_examples = (self.build_examples(self.cfg.eval_dataset, self.cfg.eval_split)
                              if self.cfg.eval_dataset else [])
        self.steps_per_epoch = len(self.train_examples) // self.cfg.train_batch_size
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"dataset {self.cfg.dataset} has {len(self.train_examples)} usable examples, fewer than"
                f" --train_batch_size {self.cfg.train_batch_size}"
            )
        self.total_steps = self.steps_per_epoch * self.cfg.max_epochs
        ds_config = ds.deepspeed_config(
            self.cfg, world_size=self.world_size, train_batch_size=self.cfg.train_batch_size,
            micro_batch_size=self.cfg.micro_train_batch_size,
        )
        model = self.load_train_model(ds_config)
        self.engine = ds.build_train_engine(
            model, self.cfg, ds_config, learning_rate=self.cfg.learning_rate, total_steps=self.total_steps
        )
        return {"train_examples": len(self.train_examples), "eval_examples": len(self.eval_examples),
                "total_steps": self.total_steps}

    def step_examples(self, step: int) -> list[dict]:
        epoch, index = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        order = torch.randperm(len(self.train_examples), generator=generator).tolist()
        size = self.cfg.train_batch_size
        return [self.train_examples[i] for i in order[index * size : (index + 1) * size]]

    def fit(self, stop_after_first_checkpoint: bool = False) -> dict[str, Any]:
        cfg = self.cfg
        start_step, client_state = ds.load_checkpoint(self.engine, cfg.ckpt_path) if cfg.ckpt_path else (0, {})
        history: list[dict] = client_state.get("history", [])
        self.engine.train()
        started = time.time()
        for step in range(start_step, self.total_steps):
            batch = self.step_examples(step)
            normalizer = self.step_normalizer(batch)
            mine = batch[self.rank :: self.world_size]
            totals: dict[str, float] = {}
            for micro in chunks(mine, cfg.micro_train_batch_size):
                loss, stats = self.micro_batch_loss(micro, normalizer)
                self.engine.backward(loss * ds.global_loss_scale(self.engine))
                self.engine.step()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            record = {"step": step + 1, **self.all_reduce_sum(totals),
                      "lr": self.engine.get_lr()[0]}
            history.append(record)
            if self.rank == 0 and (step + 1) % max(cfg.logging_steps, 1) == 0:
                shown = " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items())
                print(f"[{self.stage}] {shown}", flush=True)
            if cfg.eval_steps > 0 and (step + 1) % cfg.eval_steps == 0 and self.eval_examples:
                record.update({f"eval_{k}": v for k, v in self.evaluate().items()})
                self.engine.train()
            if cfg.ckpt_path and cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0:
                ds.save_checkpoint(self.engine, cfg.ckpt_path, step + 1, {"history": history}, cfg.max_ckpt_num)
                if stop_after_first_checkpoint and start_step == 0:
                    return {"fault_injected": True, "step": step + 1}
        metrics: dict[str, Any] = {
            "steps": self.total_steps,
            "resumed_from_step": start_step,
            "train_seconds": round(time.time() - started, 2),
        }
        if history:
            metrics["train_loss_first"] = history[0]["loss"]
            metrics["train_loss_last"] = history[-1]["loss"]
        if self.eval_examples:
            metrics.update({f"eval_{k}": v for k, v in self.evaluate().items()})
        ds.export_hf(self.engine, self.tokenizer, cfg.save_path, self.export_extra_config())
        if self.rank == 0:
            ds.write_metrics(cfg.save_path, metrics)
            (Path(cfg.save_path) / "history.json").write_text(json.dumps(history, indent=1))
        return {"metrics": metrics, "history": history}

    # ---- helpers
    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(tensor)
        return {k: float(v) for k, v in zip(keys, tensor.tolist())}

    def eval_shard(self) -> list[dict]:
        return self.eval_examples[self.rank :: self.world_size]

    @property
    def model_device(self) -> torch.device:
        return next(self.engine.module.parameters()).device


def validate_sources(cfg, validate: Callable[[Any, str], None]) -> None:
    """Load and validate --dataset and --eval_dataset in the driver, so bad data fails before any rank starts."""
    from stages import data

    for source, split in ((cfg.dataset, cfg.dataset_split), (cfg.eval_dataset, cfg.eval_split)):
        if source is not None:
            validate(data.load_rows(source, split=split, max_samples=cfg.max_samples), source)
