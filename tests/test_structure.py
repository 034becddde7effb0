"""The code's own structure: field roles declared once and used everywhere, a stage's code version as what its job
imports, layers that only import downward, no test hooks in product code."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path
from typing import Annotated

import pytest
from pydantic import Field

from infra.settings import get_settings
from pipeline.code import PROJECT_ROOT, code_version, imported_modules, module_closure
from pipeline.identity import stage_identity
from stages.cli import parse_stage_args
from stages.engine import training_fingerprint
from stages.fields import NOT_TRAINING, Dataset, GpuOnly, ModelPath, Output, cpu_notes, fields_with, names_with
from stages.registry import STAGES
from stages.sft.config import SFTConfig

LAYERS = ("infra", "stages", "pipeline", "tasks", "flows")  # each may import only itself and those before it
STAGE_NAMES = tuple(STAGES)


# ---------------------------------------------------------------------------------------------- field roles

class SFTWithSideData(SFTConfig):
    """An SFT config that someone extends with a second dataset, declaring nothing but its role."""

    side_data: Annotated[str | None, Dataset(split="dataset_split")] = Field(None, description="more rows")
    side_eval: Annotated[str | None, Dataset(split="eval_split", held_out=True), NOT_TRAINING] = Field(
        None, description="more held-out rows")


def test_a_new_dataset_field_enters_the_stage_key_and_checkpoint_ownership(tmp_path):
    side, side_eval = tmp_path / "side.jsonl", tmp_path / "side_eval.jsonl"
    side.write_text('{"input": "1+1", "output": "2"}\n')
    side_eval.write_text('{"input": "2+2", "output": "4"}\n')
    cfg = SFTWithSideData(side_data=str(side), side_eval=str(side_eval))

    first = stage_identity("p", "sft", cfg, {}, code="c")
    assert set(first.datasets) == {"side_data", "side_eval"}
    owned = training_fingerprint("sft", cfg)
    assert set(owned["data"]) == {"side_data"}  # held-out rows never make checkpoints another run's

    side.write_text('{"input": "1+1", "output": "3"}\n')  # new content at the same path
    assert stage_identity("p", "sft", cfg, {}, code="c").key != first.key
    changed = training_fingerprint("sft", cfg)
    assert changed["data"] != owned["data"]
    side_eval.write_text('{"input": "2+2", "output": "5"}\n')
    assert training_fingerprint("sft", cfg) == changed


def test_every_stage_declares_its_data_models_and_outputs():
    for stage, cls in STAGES.items():
        datasets = fields_with(cls, Dataset)
        assert datasets and all(role.split in cls.model_fields for role in datasets.values()), stage
        assert "pretrain" in fields_with(cls, ModelPath), stage
        assert {"save_path"} <= names_with(cls, Output), stage
    assert set(fields_with(STAGES["evaluate"], Dataset)) == {"prompt_data"}
    assert fields_with(STAGES["evaluate"], Dataset)["prompt_data"].held_out


def test_gpu_only_flags_say_once_that_they_cannot_act_on_cpu():
    cfg = parse_stage_args(STAGES["rl"], ["--config", "llama3-8b"], require_inputs=False)
    notes = cpu_notes(cfg)
    assert [note.split()[0] for note in notes] == ["--flash_attn", "--no_enforce_eager", "--vllm_enable_sleep",
                                                   "--deepspeed_enable_sleep", "--vllm_sync_backend"]
    assert all("has no effect on CPU: " in note for note in notes)
    quiet = cfg.model_copy(update={name: role.cpu_value for name, role in fields_with(type(cfg), GpuOnly).items()})
    assert cpu_notes(quiet) == []
    for stage, cls in STAGES.items():  # the CPU preset sets no flag that a CPU run would have to explain
        assert cpu_notes(parse_stage_args(cls, ["--config", "tiny"], require_inputs=False)) == [], stage


# ---------------------------------------------------------------------------------------------- code versions

@pytest.fixture(scope="module")
def project_copy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    for package in LAYERS:
        shutil.copytree(PROJECT_ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


def versions(root: Path) -> dict[str, str]:
    return {stage: code_version(f"stages.{stage}", root) for stage in STAGE_NAMES}


def edited(root: Path, relative: str, old: str, new: str) -> None:
    path = root / relative
    text = path.read_text()
    assert text.count(old) == 1, (relative, old)
    path.write_text(text.replace(old, new))


def appended(root: Path, relative: str) -> None:
    path = root / relative
    path.write_text(path.read_text() + "# edited\n")


def changed_by(root: Path, *relatives: str) -> set[str]:
    """The stages whose code version changes when a comment is appended to each of `relatives`."""
    before = versions(root)
    for relative in relatives:
        appended(root, relative)
    return {stage for stage, version in versions(root).items() if version != before[stage]}


def test_a_stage_code_version_is_the_code_its_job_runs(project_copy):
    assert versions(project_copy) == versions(PROJECT_ROOT)
    # Code no stage job runs: the rehearsal, a help string of the orchestration's settings, the plan, the registry.
    assert changed_by(project_copy, "pipeline/rehearsal.py", "infra/settings.py", "pipeline/plan.py",
                      "stages/registry.py") == set()
    # RL's own code: its config, the vLLM rollout engines, the rollout queue, its math, its driver: RL alone, and
    # the evaluation where it runs the same engines.
    assert changed_by(project_copy, "stages/rl/config.py") == {"rl"}
    assert changed_by(project_copy, "stages/rl/rollout_queue.py") == {"rl"}
    assert changed_by(project_copy, "stages/rl/driver.py") == {"rl"}
    assert changed_by(project_copy, "stages/rl/rollout.py") == {"rl", "evaluate"}
    assert changed_by(project_copy, "stages/rl/algorithms.py") == {"rl", "evaluate"}
    # One stage's entry or config: that stage alone (DPO and KTO no longer run the reward model's entry).
    for stage in ("sft", "reward_model", "dpo", "kto", "evaluate"):
        for module in ("__main__.py", "config.py"):
            assert changed_by(project_copy, f"stages/{stage}/{module}") == {stage}, (stage, module)
    assert changed_by(project_copy, "stages/reward_model/train.py") == {"reward_model"}
    assert changed_by(project_copy, "stages/dpo/train.py") == {"dpo"}
    # Shared code: every stage that runs it.
    assert changed_by(project_copy, "stages/algorithms.py") == set(STAGES)
    assert changed_by(project_copy, "stages/config.py") == set(STAGES)
    assert changed_by(project_copy, "stages/trainer.py") == {"sft", "reward_model", "dpo", "kto"}


def test_the_code_version_setting_overrides_the_closure(monkeypatch):
    from pipeline.identity import stage_code_version

    assert stage_code_version(get_settings(), "rl") == code_version("stages.rl") == code_version("stages.rl.__main__")
    monkeypatch.setenv("RLHF_CODE_VERSION", "release-1.2")
    assert stage_code_version(get_settings(), "rl") == "release-1.2"


def test_the_closure_follows_imports_in_functions_and_skips_other_modules_main_blocks(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "entry.py").write_text("def run():\n    from pkg import lazy\n\nif __name__ == '__main__':\n"
                                      "    from pkg import script_only\n")
    (package / "lazy.py").write_text("from . import helper\n\nif __name__ == '__main__':\n    import pkg.cli\n")
    for name in ("helper", "script_only", "cli"):
        (package / f"{name}.py").write_text("")
    assert sorted(module_closure("pkg.entry", tmp_path)) == ["pkg", "pkg.entry", "pkg.helper", "pkg.lazy",
                                                            "pkg.script_only"]


def test_installed_beside_other_packages_the_closure_stays_in_the_project(tmp_path):
    """From a wheel the project's packages sit in site-packages beside their dependencies: an import of a
    dependency is not project code (it would hash all of torch)."""
    for package in ("stages", "stages/toy", "torch"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "stages" / "toy" / "__main__.py").write_text("import torch\nfrom stages import helper\n")
    (tmp_path / "stages" / "helper.py").write_text("from torch import nn\n")
    assert sorted(module_closure("stages.toy", tmp_path)) == ["stages", "stages.helper", "stages.toy",
                                                              "stages.toy.__main__"]


# ---------------------------------------------------------------------------------------------- layers

def project_imports() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (anywhere but in its `__main__` block)."""
    graph = {}
    for layer in LAYERS:
        for path in sorted((PROJECT_ROOT / layer).rglob("*.py")):
            parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            graph[name] = imported_modules(PROJECT_ROOT, name, ast.parse(path.read_text()), entry=False)
    return graph


def test_no_import_cycle():
    graph = project_imports()

    def reaches(start: str, target: str) -> bool:
        seen, pending = set(), list(graph[start])
        while pending:
            name = pending.pop()
            if name == target:
                return True
            if name not in seen and name in graph:
                seen.add(name)
                pending += graph[name]
        return False

    cycles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a] if b in graph and b != a and reaches(b, a)})
    assert not cycles, f"import cycles through: {cycles}"


def test_every_layer_imports_only_downward_and_only_the_orchestration_imports_prefect():
    upward = []
    for module, imports in project_imports().items():
        layer = LAYERS.index(module.split(".")[0])
        upward += [f"{module} -> {name}" for name in imports if LAYERS.index(name.split(".")[0]) > layer]
    assert not upward, upward
    for layer in ("infra", "stages", "pipeline"):
        for path in (PROJECT_ROOT / layer).rglob("*.py"):
            tree = ast.parse(path.read_text())
            names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
            names |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
            assert not any(name.split(".")[0] == "prefect" for name in names), path


def test_no_product_module_reads_a_test_hook():
    for layer in LAYERS:
        for path in (PROJECT_ROOT / layer).rglob("*.py"):
            text = path.read_text()
            assert "FAULT_INJECT" not in text and "_PAUSE" not in text, path
    assert get_settings().job_env_passthrough == []
