"""Crashes the way they happen, injected from the tests: a stage process killed with SIGKILL right after one of its
checkpoints is committed. Nothing in the product knows about them."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from stage_runs import ROOT, STAGE_TIMEOUT_S, stage_env


def kill_tree(pid: int, child: subprocess.Popen | None = None) -> None:
    """SIGKILL a process and everything below it (its ranks, its private Ray). When it is our `child`, the Popen
    reaps it, so that its return code says how it died."""
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
    if child is not None:
        child.wait()
        tree = tree[1:]
    psutil.wait_procs(tree, timeout=30)


def latest_checkpoint(ckpt_dir: Path) -> int:
    marker = Path(ckpt_dir) / "latest_step.json"
    return json.loads(marker.read_text())["step"] if marker.exists() else 0


def run_killed_at_checkpoint(command: list, ckpt_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a stage command (on the session's Ray head) and SIGKILL it, with every process it started, as soon as its
    first checkpoint under `ckpt_dir` is committed (`latest_step.json` appears). Its Ray actors die with their
    driver. Returns what it printed; fails if it ends first."""
    full_env = stage_env(env)
    logs = Path(tempfile.mkdtemp(prefix="killed-stage-"))
    out, err = logs / "stdout", logs / "stderr"
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(list(map(str, command)), cwd=ROOT, env=full_env, stdout=stdout, stderr=stderr,
                                start_new_session=True)
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    try:
        while not latest_checkpoint(ckpt_dir):
            if proc.poll() is not None:
                raise AssertionError(f"{command[:4]} exited {proc.returncode} before its first checkpoint\n"
                                     f"--- stdout\n{out.read_text()[-6000:]}\n--- stderr\n{err.read_text()[-6000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{command[:4]} wrote no checkpoint within {STAGE_TIMEOUT_S}s")
            time.sleep(0.01)
    finally:
        kill_tree(proc.pid, child=proc)
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(), err.read_text())
    shutil.rmtree(logs)
    return done


def stage_command(stage: str, *flags, config: str = "tiny") -> list:
    """`python -m stages.<stage> --config <config> <flags>`, as stage_runs.run_stage runs it."""
    return [sys.executable, "-m", f"stages.{stage}", "--config", config, *flags]


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
