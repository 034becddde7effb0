"""The RL stage's proof that the rollout engines run the actor's weights, before any rollout uses them.

After every weight sync each engine says which of the announced tensors it loaded (all, once each). After the start-up
and the first sync, then every --weight_sync_check_interval syncs, it is also checked:
  - read-back: what each engine worker computes with against the actor's digests of what it sent
    (stages/rl/weight_check.py), naming the tensor and the engine that differ;
  - a probe batch: a few prompts with an engine's greedy answers at start-up, fixed for the run; the log-probs of
    their tokens at temperature 1 from every engine and from the actor agree within a tolerance set by the dtype.
A failure stops the stage (WeightSyncError) before the engines sample again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from stages.errors import StageInputError
from stages.rl.weight_check import PROBE_TOLERANCE
from stages.sequences import build_sequences

# Every token of the probe rows after the first is compared, the prompts' included. A forward of the 135M model over
# two rows of ~60 tokens takes about 0.3 s on 2 cores, in the actor and in each engine.
PROBE_PROMPTS = 2
PROBE_RESPONSE_TOKENS = 16


class WeightSyncError(StageInputError):
    """A rollout engine does not compute with the actor's weights. A retry would load them the same way."""


@dataclass
class Probe:
    """The fixed probe batch: token ids of each row, scored from its second token on (each row as a (first token,
    the rest) pair, as the engines' `score_tokens` takes it)."""

    pairs: list[tuple[list[int], list[int]]]

    @classmethod
    def sample(cls, engine, prompts: list[str], max_new_tokens: int, max_total_len: int | None) -> Probe:
        """`prompts` and one engine's greedy answers to them as it starts (the actor's initial weights)."""
        answered = ray.get(engine.generate.remote(prompts, n=1, max_new_tokens=max_new_tokens, temperature=0.0,
                                                  top_p=1.0, seed=None, max_total_len=max_total_len))
        rows = [rollout.prompt_ids + rollout.response_ids for rollout in answered]
        return cls([(row[:1], row[1:]) for row in rows])


def probe_prompts(prompts, count: int) -> list[str]:
    """The first `count` prompts of the prompt data (repeated when it holds fewer)."""
    rows = prompts.take(list(range(min(count, len(prompts)))))
    return [rows[k % len(rows)]["prompt"] for k in range(count)]


class SyncCheck:
    """Checks after each sync; keeps what the run's metrics report of them."""

    def __init__(self, cfg, roles, probe: Probe, pad_token_id: int):
        self.cfg, self.roles, self.probe, self.pad_token_id = cfg, roles, probe, pad_token_id
        self.tolerance = PROBE_TOLERANCE[cfg.rollout_dtype]
        self.checks = 0
        self.seconds = 0.0
        self.probe_gap: dict[str, float] = {}  # of the last check: mean and max over engines
        self.unreadable_noted = False

    def due(self, sync: int) -> bool:
        """Whether sync number `sync` (1 = the first after start-up) is read back and probed, beyond its receipt."""
        return sync == 1 or sync % self.cfg.weight_sync_check_interval == 0

    def after_start(self) -> dict[str, float]:
        """The engines loaded the actor's model: the probe only (nothing was sent to read back against)."""
        return self._timed(lambda: self._check_probe("start-up"))

    def after_sync(self, sync: int, receipts: list[dict[str, list[str]]]) -> dict[str, float]:
        """Every tensor arrived; when due, the read-back and the probe. Returns the record's sync_check/* values."""
        for engine, receipt in enumerate(receipts):
            if receipt["missing"] or receipt["unexpected"]:
                raise WeightSyncError(
                    f"weight sync {sync}: engine {engine} "
                    + "; ".join(part for part in (
                        _listed("never loaded", receipt["missing"]), _listed("loaded unannounced",
                                                                             receipt["unexpected"])) if part)
                    + ": the engine holds a mix of old and new weights")
        if not self.due(sync):
            return {}
        return self._timed(lambda: (self._check_read_back(sync), self._check_probe(f"weight sync {sync}")))

    def _timed(self, check) -> dict[str, float]:
        started = time.perf_counter()
        check()
        seconds = time.perf_counter() - started
        self.checks += 1
        self.seconds += seconds
        return {"sync_probe_gap_mean": self.probe_gap["mean"], "sync_probe_gap_max": self.probe_gap["max"]}

    def _check_read_back(self, sync: int) -> None:
        sent = self.roles.actor.on_rank(0, "sent_digests")
        results = ray.get([engine.check_weights.remote(sent) for engine in self.roles.engines])
        for engine, result in enumerate(results):
            if result["mismatches"]:
                raise WeightSyncError(
                    f"weight sync {sync}: engine {engine} does not compute with the weights the actor sent: "
                    + "; ".join(result["mismatches"][:5])
                    + (f" (and {len(result['mismatches']) - 5} more)" if len(result["mismatches"]) > 5 else ""))
        unreadable = results[0]["unreadable"]
        if unreadable and not self.unreadable_noted:
            self.unreadable_noted = True
            print(f"[rl] weight check: {len(unreadable)} tensors cannot be read back from the engines (e.g. "
                  f"{', '.join(unreadable[:3])}): the probe batch checks them", flush=True)

    def _check_probe(self, when: str) -> None:
        prompt_ids = [prompt for prompt, _ in self.probe.pairs]
        response_ids = [response for _, response in self.probe.pairs]
        batch = build_sequences(prompt_ids, response_ids, self.pad_token_id)
        actor = self.roles.actor
        # One after the other: colocated on CPU cores, the engines' threads spinning beside the actor's slow both.
        logp = torch.cat(actor.leaders(actor.run_sharded("log_probs", actor.split(batch), temperature=1.0)))
        expected = [logp[row, len(prompt) - 1 : len(prompt) - 1 + len(response)]
                    for row, (prompt, response) in enumerate(self.probe.pairs)]
        scored = ray.get([engine.score_tokens.remote(self.probe.pairs) for engine in self.roles.engines])
        gaps = []
        for engine, rows in enumerate(scored):
            diff = torch.cat([(torch.tensor(row) - want).abs() for row, want in zip(rows, expected)])
            gap = {"mean": float(diff.mean()), "max": float(diff.max())}
            if gap["mean"] > self.tolerance:
                raise WeightSyncError(
                    f"{when}: engine {engine}'s log-probs of the probe batch differ from the actor's by "
                    f"{gap['mean']:.4f} nats per token on average (max {gap['max']:.4f}; the {self.cfg.rollout_dtype} "
                    f"tolerance is {self.tolerance}): it does not run the actor's weights")
            gaps.append(gap)
        self.probe_gap = {"mean": max(g["mean"] for g in gaps), "max": max(g["max"] for g in gaps)}

    def metrics(self) -> dict[str, Any]:
        """What the run's manifest records: checks made, their time, the probe's gap at the last one."""
        return {"weight_sync_checks": self.checks, "weight_sync_check_seconds": round(self.seconds, 2),
                "weight_sync_probe_gap_mean": self.probe_gap.get("mean"),
                "weight_sync_probe_gap_max": self.probe_gap.get("max")}


def _listed(what: str, names: list[str]) -> str:
    if not names:
        return ""
    return f"{what} {', '.join(names[:5])}" + (f" (and {len(names) - 5} more)" if len(names) > 5 else "")
