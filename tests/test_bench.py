"""The benchmark harness in its quick form: the RL stage and SFT measured, a table and JSON written.

TRL's side runs only where the `bench` extra is installed; without it the table says so and the rest still runs.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PHASES = {"generation", "reward", "experience_ref_logprobs", "training", "weight_sync", "idle"}


@pytest.mark.slow
def test_quick_bench_writes_the_table_and_json(tmp_path):
    out = tmp_path / "results.json"
    proc = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out), "--work_dir", str(tmp_path / "w")],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())

    ours = results["rl"]["tiny"]["ours"]
    assert ours["samples_per_s"] > 0 and 0 < ours["startup_seconds"] < ours["command_seconds"]
    assert PHASES <= set(ours["phases"]), ours["phases"]
    assert all(ours["phases"][name] >= 0 for name in PHASES)
    assert list(results["supervised"]) == ["sft"] and results["supervised"]["sft"]["tokens_per_s"] > 0
    trl = results["rl"]["tiny"]["trl"]
    if importlib.util.find_spec("trl") is None:
        assert trl is None and "not installed" in results["table"]
    else:
        assert trl["samples_per_s"] > 0 and "x |" in results["table"]
    assert "training loop samples/s" in proc.stdout and "tokens/s" in proc.stdout
    later = results["rl"]["tiny"]["async"]
    assert later["samples_per_s"] > 0 and later["phases"]["rollout_wait"] >= 0 and 0 < later["generation_share"]
    assert "async (queue 1)" in results["table"] and "seconds the trainer waited for rollouts" in results["table"]
