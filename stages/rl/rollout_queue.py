"""Rollouts produced ahead of training (`--async_train`), each by a known policy version.

A thread of the driver produces the rollouts of steps in order while the main thread trains: the rollout engines
and the trained models are Ray actors of their own, so generation and training run at once. The policy version
is the number of optimizer-updated steps whose weights the engines hold. With a queue of q the rollout of step k
is sampled by version max(k - q, first) exactly:
  - producing step k waits until the engines hold that version;
  - a weight update to version v + 1 waits until step v + q, the last one due from version v, is produced.
So generation and a weight update never overlap on the engines, no sample mixes two versions, and an async run
repeats and resumes like a synchronous one (stages/rl/driver.py RolloutsOnDemand, where each rollout is produced
when its step asks for it: q = 0).

With `partial` (--partial_rollout) a weight update does not wait for production: the producer generates in
segments (`segment`), and an update lands between two of them; the rest of each response comes from the new
version, and every segment reports the version it was sampled by.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


# How long the trainer waits for the producer's next rollout before it calls the producer stuck: far beyond one
# rollout of a large model, so that a hung engine fails the stage (retried) instead of holding its GPUs until the
# stage deadline.
STALL_TIMEOUT_S = 3600.0


class RolloutStalled(RuntimeError):
    """The producer made no rollout for longer than the queue's stall timeout."""


class RolloutQueue:
    """The rollouts of steps first..last-1, `queue_size` (at least 1) steps ahead of training.

    `produce(step, version)` returns the rollout of `step` sampled by policy `version`, or None when the prompts
    ran out (nothing is produced after it). `ready` holds rollouts already produced, from a checkpoint.
    """

    def __init__(self, produce: Callable[[int, int], Any], first: int, last: int, queue_size: int,
                 ready: list | None = None, partial: bool = False, stall_timeout_s: float = STALL_TIMEOUT_S):
        assert queue_size >= 1, "synchronous training takes its rollouts on demand (RolloutsOnDemand)"
        self.produce, self.first, self.last, self.queue_size = produce, first, last, queue_size
        self.stall_timeout_s = stall_timeout_s
        self.partial = partial
        self._engines = threading.Lock()  # held by one generation segment or one weight update
        self._update_waiting = False  # a weight update goes before the next segment (a lock alone is not fair)
        self.version = first  # held by the engines
        self.ready: dict[int, Any] = {first + i: batch for i, batch in enumerate(ready or [])}
        self.next_step = first + len(self.ready)
        self.finished = False  # the prompts ran out
        self.error: BaseException | None = None
        self.waited = 0.0  # seconds the trainer waited for rollouts since the last take_waited()
        self._changed = threading.Condition()
        self._closed = False

    def start(self) -> RolloutQueue:
        """Begin producing ahead."""
        threading.Thread(target=self._run, name="rollouts", daemon=True).start()
        return self

    def version_for(self, step: int) -> int:
        return max(step - self.queue_size, self.first)

    def _run(self) -> None:
        try:
            while self.next_step < self.last and not self.finished:
                step = self.next_step
                with self._changed:
                    self._changed.wait_for(lambda: self._closed or self.version >= self.version_for(step))
                    if self._closed:
                        return
                    assert self.partial or self.version == self.version_for(step), (step, self.version)
                batch = self.produce(step, self.version)
                with self._changed:
                    self.ready[step] = batch
                    self.finished = batch is None
                    self.next_step += 1
                    self._changed.notify_all()
        except BaseException as error:  # handed to the trainer, which raises it
            with self._changed:
                self.error = error
                self._changed.notify_all()

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding the condition) until `ready()`; RolloutStalled when the producer made nothing meanwhile
        for `stall_timeout_s`."""
        if not self._changed.wait_for(ready, timeout=self.stall_timeout_s):
            raise RolloutStalled(f"--async_train: no rollout produced for {self.stall_timeout_s:g} s while waiting "
                                 f"for {what} (the producer is at step {self.next_step}): a rollout engine or the "
                                 "reward source is stuck")

    def take(self, step: int) -> Any:
        """The rollout of `step` (None: the prompts ran out), waiting for the producer if needed."""
        started = time.perf_counter()
        with self._changed:
            self._wait_for(lambda: step in self.ready or self.error is not None, f"the rollout of step {step}")
            self.waited += time.perf_counter() - started
            if step not in self.ready:
                raise self.error
            batch = self.ready.pop(step)
            self._changed.notify_all()
            return batch

    def segment(self, generate: Callable[[], Any]) -> tuple[Any, int]:
        """(generate(), the policy version it sampled with): no weight update runs meanwhile."""
        with self._changed:
            self._changed.wait_for(lambda: not self._update_waiting)
        with self._engines:
            return generate(), self.version

    def update_weights(self, sync: Callable[[], None] | None) -> None:
        """The next policy version: run `sync` (the actor's weights into the engines; None when the actor did not
        move) once every rollout still due from the current version is produced (partial: between two segments)."""
        if self.partial:
            with self._changed:
                self._update_waiting = True
            with self._engines:
                if sync is not None:
                    sync()
                with self._changed:
                    self.version += 1
                    self._update_waiting = False
                    self._changed.notify_all()
            if self.error is not None:
                raise self.error
            return
        with self._changed:
            last_due = min(self.version + self.queue_size, self.last - 1)
            self._wait_for(lambda: self.next_step > last_due or self.finished or self.error is not None,
                           f"step {last_due}, the last rollout due from policy version {self.version}")
            if self.error is not None:
                raise self.error
            if sync is not None:
                sync()
            self.version += 1
            self._changed.notify_all()

    def pending(self, after: int) -> list:
        """The produced rollouts of steps after..after+queue_size-1 (what a checkpoint taken now must keep)."""
        with self._changed:
            return [self.ready[step] for step in range(after, after + self.queue_size) if step in self.ready]

    def take_waited(self) -> float:
        waited, self.waited = self.waited, 0.0
        return waited

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()
