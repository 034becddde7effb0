"""Running stage entrypoints as a user does, and reading what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from infra.ray_cluster import HeadPorts, LocalRayHead

ROOT = Path(__file__).resolve().parent.parent
STAGE_TIMEOUT_S = 900


_SHARED_HEAD: list = []


def shared_ray_address() -> str:
    """A Ray head for this test session's stage runs, started at first use: a stage joins it as the driver of a
    pipeline's Ray job joins its cluster, instead of starting a private one (about 4 s a run)."""
    if not _SHARED_HEAD:
        head = DriversOnlyRayHead(num_cpus=os.cpu_count(), auth_mode="disabled")
        head.start()
        _SHARED_HEAD.append(head)
    return _SHARED_HEAD[0].gcs_address


def stop_shared_ray_head() -> None:
    """At the end of the session (conftest.pytest_sessionfinish: an xdist worker may end without running atexit)."""
    while _SHARED_HEAD:
        _SHARED_HEAD.pop().stop()


class DriversOnlyRayHead(LocalRayHead):
    """A local head that drivers join by its GCS address: no dashboard, so no Jobs API, and about half the idle CPU
    of a full head over the session it lives."""

    def command(self, ports: HeadPorts) -> list[str]:
        dashboard_flags = ("--dashboard-host", "--dashboard-port", "--ray-client-server-port")
        return [part for part in super().command(ports)
                if not part.startswith(dashboard_flags)] + ["--include-dashboard=false"]

    def ready(self, address: str) -> bool:
        return "will now block forever" in self._log_path.read_text(errors="replace")  # every process is up

    def start(self) -> str:
        super().start()
        self.address = None  # no Jobs API: drivers join by `gcs_address`
        return self.gcs_address


def stage_env(env: dict | None = None, private_ray: bool = False, ray_address: str | None = None) -> dict:
    """The environment of a stage process: the session's Ray head (`private_ray`: none, the stage starts its own;
    `ray_address`: the cluster at that GCS address)."""
    full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("RAY_ADDRESS", None)
    if ray_address:
        full_env.update(RAY_ADDRESS=ray_address)
    elif not private_ray:
        # A driver joins a loopback-only head with the same switch the head runs with (infra/ray_cluster.py).
        full_env.update(RAY_ADDRESS=shared_ray_address(), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    return full_env


def run_stage(stage: str, *flags, config: str = "tiny", env: dict | None = None, expect_rc: int = 0,
              private_ray: bool = False, ray_address: str | None = None) -> subprocess.CompletedProcess:
    """`python -m stages.<stage> --config <config> <flags>` in its own process, on the session's Ray head."""
    full_env = stage_env(env, private_ray, ray_address)
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--config", config, *map(str, flags)],
                          cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=STAGE_TIMEOUT_S)
    if proc.returncode != expect_rc:
        raise AssertionError(f"stages.{stage} exited {proc.returncode} (expected {expect_rc})\n"
                             f"--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def metrics_of(path: Path) -> dict:
    return json.loads((Path(path) / "metrics.json").read_text())


def history_of(path: Path) -> list[dict]:
    return json.loads((Path(path) / "history.json").read_text())


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def max_weight_change(before: Path, after: Path) -> float:
    a, b = weights(before), weights(after)
    return max(float((a[k] - b[k]).abs().max()) for k in a if k in b)


def tiny_suite(assets: dict, path: Path, max_samples: int, preferences: bool = True) -> Path:
    """An eval suite YAML at `path`: the tiny task's held-out prompts as gsm8k and math benchmarks, and as
    preference prompts (for an evaluation with a reward model) (stages/evaluate/suite.py)."""
    benchmarks = [{"name": "gsm8k", "dataset": str(assets["prompts_eval_gsm8k"]), "format": "gsm8k",
                   "max_samples": max_samples},
                  {"name": "math", "dataset": str(assets["prompts_eval_math"]), "format": "math", "n_samples": 0,
                   "max_samples": max_samples},
                  {"name": "preferences", "dataset": str(assets["pref_eval"]), "format": "preference_prompts",
                   "n_samples": 0, "max_samples": 3 * max_samples}][: 3 if preferences else 2]
    path.write_text(json.dumps({"benchmarks": benchmarks}))  # JSON is YAML
    return path
