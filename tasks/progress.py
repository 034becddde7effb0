"""A stage's progress in the Prefect UI, read from the step lines its job prints.

Stages print one line per logged step:

    [rl] step 5/25 (20%, elapsed 0:00:12, ETA 0:00:48) reward=0.4100 kl=0.0123

(inside a Ray actor the line arrives prefixed with "(PolicyWorker pid=123) "). `parse_step_line` reads such a
line; `StageProgress` keeps one Prefect progress artifact per running stage and moves it as lines arrive.
Lines of any other shape are ignored.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from prefect.artifacts import create_progress_artifact, update_progress_artifact

STEP_LINE = re.compile(
    r"\[(?P<stage>[A-Za-z0-9_.-]+)\] step (?P<step>\d+)/(?P<total>\d+) "
    r"\((?P<percent>\d+(?:\.\d+)?)%, elapsed (?P<elapsed>\d+:\d\d:\d\d), ETA (?P<eta>[^)\s]+)\)"
    r"(?P<values>(?: [A-Za-z0-9_./-]+=\S+)*)\s*$"
)


@dataclass(frozen=True)
class StepProgress:
    stage: str
    step: int
    total: int
    percent: float
    elapsed: str
    eta: str
    values: dict[str, str]

    def describe(self) -> str:
        shown = " ".join(f"{k}={v}" for k, v in self.values.items())
        return (f"{self.stage}: step {self.step}/{self.total}, elapsed {self.elapsed}, ETA {self.eta}"
                + (f" ({shown})" if shown else ""))


def parse_step_line(line: str) -> StepProgress | None:
    """The progress a step line reports, or None for any other line."""
    match = STEP_LINE.search(line)
    if match is None:
        return None
    values = dict(pair.split("=", 1) for pair in match["values"].split())
    return StepProgress(
        stage=match["stage"], step=int(match["step"]), total=int(match["total"]), percent=float(match["percent"]),
        elapsed=match["elapsed"], eta=match["eta"], values=values,
    )  # fmt: skip


class StageProgress:
    """One Prefect progress artifact (`<key>`, 0-100) for one stage attempt, created at its first step line."""

    def __init__(self, key: str, stage: str):
        self.key, self.stage = key, stage
        self.artifact_id = None
        self.last: StepProgress | None = None

    def update(self, lines: list[str]) -> None:
        """Move the artifact to the newest step line among `lines` (one API call per batch, not per line)."""
        newest = None
        for line in lines:
            if (progress := parse_step_line(line)) is not None and progress.stage == self.stage:
                newest = progress
        if newest is None or newest == self.last:
            return
        self.last = newest
        self._set(min(100.0, 100.0 * newest.step / max(newest.total, 1)), newest.describe())

    def finish(self, total_steps: int | None) -> None:
        """The job succeeded: 100%, with the step count from its metrics.json when it has one."""
        if self.artifact_id is None and total_steps is None:
            return
        steps = f"{total_steps}/{total_steps} steps" if total_steps is not None else "done"
        self._set(100.0, f"{self.stage}: {steps}, finished")

    def _set(self, percent: float, description: str) -> None:
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(progress=percent, key=self.key, description=description)
        else:
            update_progress_artifact(artifact_id=self.artifact_id, progress=percent, description=description)
