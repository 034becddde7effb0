"""Every field of every stage config acts: some code the stage runs reads it.

A field that no code reads is a flag users believe is on. The check is static: from a stage's entrypoint module,
it follows references by name (functions, classes, methods) through the project modules the entrypoint imports,
and collects the attributes the reached code loads (`cfg.packing_samples`) or names in getattr/hasattr. A field
counts as read when one of them is its name. Reached classes count whole (their methods are hooks that base
classes call), except the config classes: of those only the properties and methods the stage uses count
(`cfg.world_size` reads num_nodes and num_gpus_per_node), never a validator.

Name matching is lenient (two functions of the same name both count as reached), so a pass is a floor; a failure
names fields that no reached code can read.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pipeline.code import entry_module, module_closure
from stages.registry import STAGES

ROOT = Path(__file__).resolve().parent.parent
# Config methods that only check or describe a config: reading a field there does not make it act.
VALIDATORS = frozenset({"_reject_impossible", "_problems", "_placement_problems", "_algorithm_problems",
                        "missing_inputs", "train_world_sizes"})


def loaded_names(node: ast.AST) -> tuple[set[str], set[str]]:
    """(names a piece of code refers to: variables and attributes, attributes it reads: loaded attributes and
    strings given to getattr/hasattr). A local variable named like a field is not a read of the field."""
    referred, read = set(), set()
    for child in ast.walk(node):
        if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Load):
            referred.add(child.id)
        elif isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load):
            referred.add(child.attr)
            read.add(child.attr)
        elif (isinstance(child, ast.Call) and isinstance(child.func, ast.Name)
              and child.func.id in ("getattr", "hasattr") and len(child.args) >= 2
              and isinstance(child.args[1], ast.Constant)):
            read.add(child.args[1].value)
    return referred | read, read


def is_config_module(module: str) -> bool:
    """stages/config.py (the shared config classes) or a stage's config.py (its own)."""
    return module == "stages.config" or (module.startswith("stages.") and module.endswith(".config"))


def definitions(trees: dict[str, ast.Module]) -> dict[str, list[ast.AST]]:
    """Functions, classes, methods and module-level names (e.g. a table of worker classes) of the modules by name
    (config classes by their members only)."""
    found: dict[str, list[ast.AST]] = {}
    for module, tree in trees.items():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not (
                    is_config_module(module) and isinstance(node, ast.ClassDef)):
                found.setdefault(node.name, []).append(node)
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and not is_config_module(module):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for target in targets:
                    if isinstance(target, ast.Name) and node.value is not None:
                        found.setdefault(target.id, []).append(node.value)
            if isinstance(node, ast.ClassDef):
                for member in node.body:
                    if isinstance(member, ast.FunctionDef) and member.name not in VALIDATORS:
                        found.setdefault(member.name, []).append(member)
    return found


def unread_fields(root: Path, entry: str, fields: set[str]) -> set[str]:
    """Fields of a stage config that no code reachable from the stage's entrypoint module reads."""
    trees = module_closure(entry, root)
    entry = entry_module(entry, root)
    defined = definitions(trees)
    read: set[str] = set()
    visited: set[int] = set()
    pending: list[ast.AST] = [trees[entry]]
    while pending:
        node = pending.pop()
        if id(node) in visited:
            continue
        visited.add(id(node))
        referred, attributes = loaded_names(node)
        read |= attributes
        pending += [definition for name in referred for definition in defined.get(name, ())]
    return fields - read


@pytest.mark.parametrize("stage", list(STAGES))
def test_every_config_field_is_read_by_its_stage(stage):
    fields = set(STAGES[stage].model_fields)
    unread = unread_fields(ROOT, f"stages.{stage}", fields)
    assert not unread, f"stages.{stage}: no code reads --{', --'.join(sorted(unread))}"


def test_the_check_finds_unread_fields(tmp_path):
    package = tmp_path / "stages"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "config.py").write_text(
        "class Cfg:\n"
        "    @property\n    def world(self):\n        return self.nodes * self.per_node\n"
        "    @property\n    def unused(self):\n        return self.only_in_unused_property\n"
        "    def _problems(self):\n        return [self.only_validated]\n"
    )
    (package / "helper.py").write_text(
        "def lr(cfg, only_a_variable=None):\n    return getattr(cfg, 'learning_rate'), only_a_variable\n"
        "def never_called(cfg):\n    return cfg.only_in_uncalled_function\n"
        "class Worker:\n    def hook(self):\n        return self.cfg.read_by_a_hook\n"
    )
    (package / "toy.py").write_text(
        "from stages import helper\nfrom stages.config import Cfg\n"
        "class ToyWorker(helper.Worker):\n    pass\n"
        "def run(cfg: Cfg):\n    cfg.written = 1\n    return cfg.world, helper.lr(cfg)\n"
    )
    fields = {"nodes", "per_node", "learning_rate", "read_by_a_hook", "only_in_unused_property", "only_validated",
              "only_in_uncalled_function", "written", "only_a_variable"}
    assert unread_fields(tmp_path, "stages.toy", fields) == {
        "only_in_unused_property", "only_validated", "only_in_uncalled_function", "written", "only_a_variable"}
