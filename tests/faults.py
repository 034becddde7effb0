"""Crashes the way they happen, injected from the tests: a stage's Ray job killed with SIGKILL right after one of its
checkpoints is committed, or the checkpoints such a kill leaves. Nothing in the product knows about them."""

from __future__ import annotations

import json
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil

from stages.engine import LATEST_MARKER, step_dir


def kill_tree(pid: int) -> None:
    """SIGKILL a process and everything below it (a job driver: its ranks and engines)."""
    try:
        process = psutil.Process(pid)
        tree = [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in tree:
        try:
            member.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(tree, timeout=30)


def rewound_checkpoints(ckpt_dir: Path, to: Path, step: int) -> Path:
    """A copy of a run's checkpoints as the run leaves them when it is killed right after committing `step`: the newer
    checkpoints absent, `latest_step.json` at `step` (the marker is written last, engine.commit_checkpoint). A run
    pointed at the copy resumes from `step`: an exact-resume test needs the uninterrupted run and this restart, not a
    third run to kill. Killing the process itself is the pipelines' (KillJobAfterCheckpoint, and the deployment test's
    rank, worker and Ray head kills)."""
    shutil.copytree(ckpt_dir, to)
    for path in to.glob("step*"):
        if path.name > step_dir(to, step).name:  # zero-padded: names sort as steps
            shutil.rmtree(path)
    assert step_dir(to, step).is_dir(), f"{ckpt_dir} holds no checkpoint of step {step}"
    (to / LATEST_MARKER).write_text(json.dumps({"step": step}))
    return to


class KillJobAfterCheckpoint(threading.Thread):
    """Watches a flow's workspace for the first checkpoint of `stage` (any stage key) and then SIGKILLs that stage's
    Ray job driver, with everything it started: the job fails as when its node dies."""

    def __init__(self, workspace: Path, pipeline: str, stage: str, timeout_s: float = 1800):
        super().__init__(daemon=True)
        self.pattern = f"{pipeline}/{stage}/*/ckpt/latest_step.json"
        self.workspace, self.stage, self.timeout_s = workspace, stage, timeout_s
        self.killed_pid: int | None = None
        self._done = threading.Event()

    def driver(self) -> psutil.Process | None:
        for process in psutil.process_iter(["cmdline"]):
            cmdline = process.info["cmdline"] or []
            if f"stages.{self.stage}" in cmdline and any(str(self.workspace) in part for part in cmdline):
                return process
        return None

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._done.is_set() and time.monotonic() < deadline:
            if any(self.workspace.glob(self.pattern)) and (driver := self.driver()) is not None:
                self.killed_pid = driver.pid
                kill_tree(driver.pid)
                return
            time.sleep(0.05)

    def stop(self) -> None:
        self._done.set()
        self.join(timeout=10)
