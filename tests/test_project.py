"""The project's promises to a newcomer: README's two commands, CI running the same, every stage's --help."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from stages.registry import STAGES

ROOT = Path(__file__).resolve().parent.parent
ENTRYPOINTS = ("sft", "reward_model", "dpo", "kto", "rl", "evaluate")


def quick_start_commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    quick_start = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", quick_start, flags=re.S)]


def test_readme_has_the_run_command_then_the_test_command():
    run, test = quick_start_commands()
    assert run.endswith("-m flows.run --preset tiny") and "\n" not in run
    assert test.endswith("-m pytest") and "\n" not in test


def test_ci_runs_exactly_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.startswith(("#", "set ", "cd "))]
    *before, test = ci_lines
    assert test == quick_start_commands()[1]
    # Before it only what CI needs on top: the browser of the UI test, installed when missing.
    assert len(before) <= 1 and all("apt-get install" in line and "chromium chromium-driver" in line
                                    for line in before), before  # fmt: skip


@pytest.mark.parametrize("stage", ENTRYPOINTS)
def test_stage_help_lists_every_config_field(stage):
    proc = subprocess.run([sys.executable, "-m", f"stages.{stage}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in STAGES[stage].model_fields:
        assert f"--{name}" in proc.stdout, f"stages.{stage} --help does not list --{name}"
