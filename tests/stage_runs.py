"""Running stage entrypoints as a user does, and reading what they wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
STAGE_TIMEOUT_S = 900


def run_stage(stage: str, *flags, config: str = "tiny", env: dict | None = None,
              expect_rc: int = 0) -> subprocess.CompletedProcess:
    """`python -m stages.<stage> --config <config> <flags>` in its own process, with a private local Ray."""
    full_env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "PYTHONPATH": str(ROOT), **(env or {})}
    full_env.pop("RAY_ADDRESS", None)
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
