"""The step loop shared by the supervised stages (SFT, reward model, DPO, KTO).

Each rank runs the same loop over a deterministic global schedule: step s of epoch e takes a fixed slice of a
seeded permutation, rank r takes every world_size-th example of it. Because the schedule is a pure function of
(seed, step), a job restarted from a checkpoint continues with exactly the batches it would have seen.
Losses are normalised by a per-step global count (tokens or pairs) so gradient accumulation and the number of
ranks do not change the gradient.

A non-finite loss or gradient norm stops the stage (exit 2, naming the step and the value) before anything of that
step is written (stages/engine.py stop_if_diverged, as in RL): the last checkpoint stays the newest, and no output
appears.
"""

from __future__ import annotations

import json
import math
import socket
import time
from datetime import timedelta
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from stages import engine as ds
from stages import moe, packing, prepared
from stages.distributed import RankWorker
from stages.errors import StageInputError
from stages.sequences import chunks
from stages.tracking import PhaseTimer, StepLog, phase_seconds


# How long the ranks of a node wait for its first rank to prepare the examples (700k pairs take about 13 minutes
# on 2 cores).
PREPARATION_TIMEOUT = timedelta(hours=12)


class StepTrainer(RankWorker):
    """Subclasses set `stage` (and `value_model` for a scalar-head model) and implement the hooks below."""

    stage: str = ""
    value_model: bool = False  # LoRA then also trains the value head

    # ---- hooks
    # encode_rows(cfg, tokenizer, rows) -> data.Encoded: the stage module's encoder (a staticmethod), and
    # example_fields: the config fields it reads (they key the cache of prepared examples, stages/prepared.py)
    encode_rows: Any
    example_fields: tuple[str, ...] = ()

    def load_train_model(self, ds_config: dict) -> torch.nn.Module: ...
    def step_normalizer(self, examples: list[dict]) -> float:
        """The step's global count its loss is divided by: its examples (pairs, samples) unless overridden."""
        return float(len(examples))
    def micro_batch_loss(self, examples: list[dict], normalizer: float) -> tuple[torch.Tensor, dict[str, float]]:
        """Loss of one micro-batch as `sum / normalizer` (un-scaled) and summed statistics for logging; the
        statistic "tokens" counts the tokens the trained model read."""
    def evaluate(self) -> dict[str, float]: ...
    def step_record(self, sums: dict[str, float]) -> dict[str, float]:
        """The logged values of a step from its statistics summed over micro-batches and ranks."""
        return sums
    def export_extra_config(self) -> dict | None:
        return None

    # ---- the loop
    def setup(self, cfg_dict: dict, config_cls: type) -> dict[str, int]:
        self.cfg = config_cls.model_validate(cfg_dict)
        self.init_process_group()
        self.join_ring(self.cfg)
        ds.seed_everything(self.cfg.seed)
        from stages import data
        from stages.model_io import load_tokenizer, resolve_model_path

        self.model_path = resolve_model_path(self.cfg.pretrain)
        self.tokenizer = load_tokenizer(self.model_path)
        if self.cfg.tokenizer_chat_template is not None:
            self.tokenizer.chat_template = self.cfg.tokenizer_chat_template
        cfg = self.cfg
        self.train_examples = self.prepare_examples(data.load_mixture(
            cfg.dataset, split=cfg.dataset_split, max_samples=cfg.max_samples,
            probabilities=cfg.dataset_probabilities, seed=cfg.seed), "training rows")
        self.eval_examples = (self.prepare_examples(data.load_mixture(cfg.eval_dataset, split=cfg.eval_split,
                                                                      max_samples=cfg.max_samples), "held-out rows")
                              if cfg.eval_dataset else [])
        self.steps_per_epoch = len(self.train_examples) // self.cfg.train_batch_size
        if self.steps_per_epoch == 0:
            raise StageInputError(
                f"dataset {self.cfg.dataset} has {len(self.train_examples)} usable examples, fewer than"
                f" --train_batch_size {self.cfg.train_batch_size}"
            )
        self.total_steps = self.steps_per_epoch * self.cfg.max_epochs
        ds_config = ds.deepspeed_config(
            self.cfg, world_size=self.world_size, train_batch_size=self.cfg.train_batch_size,
            micro_batch_size=self.cfg.micro_train_batch_size,
        )
        model = ds.trained_model(self.load_train_model(ds_config), self.cfg, init=self.cfg.pretrain,
                                 value_model=self.value_model, aux_loss_coef=self.aux_loss_coef)
        self.engine = ds.build_train_engine(
            model, self.cfg, ds_config, learning_rate=self.cfg.learning_rate, total_steps=self.total_steps
        )
        return {"train_examples": len(self.train_examples), "eval_examples": len(self.eval_examples),
                "total_steps": self.total_steps}

    def prepare_examples(self, rows, what: str) -> prepared.ExampleRows:
        """The examples of `rows`: the first rank of each node prepares them (or finds them cached), then the
        node's other ranks open the same files. They wait in a gloo group of its own, whose timeout
        (PREPARATION_TIMEOUT) outlasts tokenizing a large dataset; the ranks' own group gives up after 10 minutes."""
        hosts: list[str] = [""] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname())
        leads = hosts.index(hosts[self.rank]) == self.rank
        waiting = dist.new_group(backend="gloo", timeout=PREPARATION_TIMEOUT)

        def prepare() -> prepared.Preparation:
            return prepared.prepare(self.encode_rows, self.cfg, self.example_fields, self.tokenizer, rows, what=what,
                                    report=leads)

        preparation, failure = None, None
        if leads:
            try:
                preparation = prepare()
            except Exception as error:  # the node's other ranks must hear of it rather than wait on
                failure = error
        failures: list[str | None] = [None] * self.world_size
        dist.all_gather_object(failures, failure and f"{type(failure).__name__}: {failure}", group=waiting)
        if failure is not None:
            raise failure
        if any(failures):
            leader = next(rank for rank, message in enumerate(failures) if message)
            raise RuntimeError(f"rank {leader} could not prepare the {what}: {failures[leader]}")
        if not leads:
            preparation = prepare()  # the files the node's first rank wrote
        if self.rank == 0:
            print(f"[{self.stage}] {preparation.summary(what)}", flush=True)
        return preparation.examples

    def step_examples(self, step: int) -> list[dict]:
        epoch, index = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.cfg.seed * 100_003 + epoch)
        order = torch.randperm(len(self.train_examples), generator=generator).tolist()
        size = self.cfg.train_batch_size
        return self.train_examples.take(order[index * size : (index + 1) * size])

    def fit(self, start_step: int = 0) -> dict[str, Any]:
        """Train from `start_step` (resuming from its checkpoint when > 0) to the end; rank 0 writes the outputs."""
        cfg = self.cfg
        client_state = ds.load_checkpoint(self.engine, cfg.ckpt_path, start_step) if start_step else {}
        history: list[dict] = client_state.get("history", [])
        log = StepLog(self.stage, cfg, self.total_steps, start_step) if self.rank == 0 else None
        timer = PhaseTimer()
        self.engine.train()
        started = time.time()
        for step in range(start_step, self.total_steps):
            step_started = time.perf_counter()
            with timer.phase("data"):
                batch = self.step_examples(step)
                normalizer = self.step_normalizer(batch)
                mine = batch[self.dp_rank :: self.dp_size]  # the ranks of a ring read the same examples
            totals: dict[str, float] = {}
            for micro in chunks(mine, cfg.micro_train_batch_size):
                with timer.phase("forward_backward"):
                    loss, stats = self.micro_batch_loss(micro, normalizer)
                    self.engine.backward(loss * ds.global_loss_scale(self.engine, self.ring_size))
                with timer.phase("optimizer"):  # the optimizer runs at the last micro-batch of the step
                    self.engine.step()
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value
            record = {"step": step + 1, **self.step_record(self.all_reduce_sum(totals)),
                      "lr": self.engine.get_lr()[0]}
            grad_norm = self.engine.get_global_grad_norm()  # global: the same on every rank (None with ZeRO-0)
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            ds.stop_if_diverged(record, step + 1, ("loss", "grad_norm"), cfg.ckpt_path)
            if cfg.eval_steps > 0 and (step + 1) % cfg.eval_steps == 0 and self.eval_examples:
                with timer.phase("evaluation"):
                    record.update({f"eval_{k}": v for k, v in self.evaluate().items()})
                self.engine.train()
            history.append(record)
            saved = bool(cfg.ckpt_path) and cfg.save_steps > 0 and (step + 1) % cfg.save_steps == 0
            if saved:
                with timer.phase("checkpoint"):
                    ds.save_checkpoint(self.engine, cfg.ckpt_path, step + 1, {"history": history})
                    if self.rank == 0:
                        ds.commit_checkpoint(cfg.ckpt_path, step + 1, cfg.max_ckpt_num)
                    dist.barrier()
            record.update(timer.take())
            record["time/step"] = round(time.perf_counter() - step_started, 4)
            if log is not None:
                log.log(step + 1, record)
        metrics: dict[str, Any] = {
            "steps": self.total_steps,
            "resumed_from_step": start_step,
            "train_seconds": round(time.time() - started, 2),
        }
        if history:
            metrics["train_loss_first"] = history[0]["loss"]
            metrics["train_loss_last"] = history[-1]["loss"]
            metrics.update(phase_seconds(history[start_step:]))
            metrics["tokens_per_second"] = tokens_per_second(history[start_step:])
        if self.eval_examples:
            metrics.update({f"eval_{k}": v for k, v in self.evaluate().items()})
        ds.export_hf(self.engine, self.tokenizer, cfg.save_path, self.export_extra_config())
        if self.rank == 0:
            ds.write_metrics(cfg.save_path, metrics)
            (Path(cfg.save_path) / "history.json").write_text(json.dumps(history, indent=1))
            log.summary(metrics)
            log.close()
        return {"metrics": metrics, "history": history}

    # ---- helpers
    @property
    def aux_loss_coef(self) -> float:
        """--aux_loss_coef; KTO has none (as in OpenRLHF)."""
        return getattr(self.cfg, "aux_loss_coef", 0.0)

    def router_losses(self):
        """Collects the load-balancing losses of the trained model's forwards in the block (--aux_loss_coef > 0)."""
        return moe.router_aux_losses(self.engine, enabled=self.aux_loss_coef > 0)

    def with_aux_loss(self, loss: torch.Tensor, stats: dict[str, float], aux_losses: list[torch.Tensor]
                      ) -> tuple[torch.Tensor, dict[str, float]]:
        """(`loss` + --aux_loss_coef × this micro-batch's share of the step's mean load-balancing loss, `stats` with
        the share as `aux_loss`). The step's micro-batches over all ranks are train_batch_size /
        micro_train_batch_size (each rank's share of the step, in micro-batches, times the ranks): stages/moe.py."""
        if not aux_losses:
            return loss, stats
        share = moe.step_share(aux_losses, self.cfg.train_batch_size // self.cfg.micro_train_batch_size)
        return loss + self.aux_loss_coef * share, {**stats, "aux_loss": share.item()}

    def log_probs(self, model, sequences: list[list[int]]) -> list[torch.Tensor]:
        """Next-token log-probs of each sequence (packed with --packing_samples, over the ring's ranks with
        --ring_attn_size)."""
        return packing.sequence_log_probs(model, sequences, pad_token_id=self.tokenizer.pad_token_id,
                                          packing=self.cfg.packing_samples, ring=self.ring)

    def all_reduce_sum(self, values: dict[str, float]) -> dict[str, float]:
        """Sums over the data-parallel groups (the ranks of a ring hold the same values: counted once)."""
        keys = sorted(values)
        tensor = torch.tensor([values[k] for k in keys], dtype=torch.float64)
        dist.all_reduce(tensor)
        return {k: float(v) / self.ring_size for k, v in zip(keys, tensor.tolist())}

    def eval_micro_batches(self, examples: list[dict] | None = None) -> Iterator[tuple[list[dict], bool]]:
        """This rank's share of `examples` (default: the held-out ones) in micro-batches, as (examples, real).
        Every rank gets the same number (forwards are collectives under ZeRO-3): a rank with fewer examples fills
        up with a repeated example marked real=False, whose results it must not count."""
        examples = self.eval_examples if examples is None else examples
        shard = examples[self.dp_rank :: self.dp_size]
        size = self.cfg.micro_train_batch_size
        longest = math.ceil(len(examples) / self.dp_size)
        for index in range(math.ceil(longest / size)):
            micro = shard[index * size : (index + 1) * size]
            yield (micro, True) if micro else (examples[:1], False)



class ReferenceStepTrainer(StepTrainer):
    """A policy trained against a frozen reference model (DPO, KTO): `self.reference` is the reference's
    inference engine, `--ref_pretrain` or else the starting model."""

    def load_train_model(self, ds_config):
        from stages.model_io import load_causal_lm, loading_options, resolve_model_path

        options = loading_options(self.cfg, self.device)
        policy = ds.load_for_zero(lambda: load_causal_lm(self.model_path, **options), ds_config)
        ref_path = resolve_model_path(self.cfg.ref_pretrain or self.cfg.pretrain)
        ref_config = ds.deepspeed_config(self.cfg, world_size=self.world_size,
                                         train_batch_size=self.cfg.train_batch_size,
                                         micro_batch_size=self.cfg.micro_train_batch_size, train=False,
                                         offload_params=getattr(self.cfg, "ref_offload", False) and self.device == "cuda")
        reference = ds.load_for_zero(lambda: load_causal_lm(ref_path, **options), ref_config)
        self.reference = ds.build_inference_engine(reference, ref_config, self.device)
        return policy

def tokens_per_second(records: list[dict]) -> float:
    """Tokens read by the trained model (all ranks) per second of forward, backward and optimizer time."""
    seconds = sum(r.get("time/forward_backward", 0.0) + r.get("time/optimizer", 0.0) for r in records)
    return round(sum(r.get("tokens", 0.0) for r in records) / seconds, 1) if seconds > 0 else 0.0

