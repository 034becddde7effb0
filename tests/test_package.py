"""The project as a real (not editable) install: the wheel holds every module of the product packages and every preset
and plugin under configs/, the presets' plugin paths resolve in the install, and `python -m flows.run --preset tiny
--plan` runs from a folder outside the checkout on the installed copy alone."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
# Top-level packages of the checkout that are not the product: pyproject.toml leaves them out of the wheel (bench/ is
# a harness run from a checkout). Every other folder with an __init__.py is a product package and must be shipped.
NOT_SHIPPED = {"tests", "bench"}
# What the build copy of the checkout leaves out: at the top, the venv, git and what builds and runs write there;
# everywhere, bytecode.
TOP_LEVEL_LEFT_OUT = {".git", ".venv", "build", "artifacts", "output", "ckpt", "test-output", ".cache", ".pytest_cache",
                      ".ruff_cache", ".notes"}
CONFIG_SUFFIXES = (".yaml", ".yml", ".py")
# Records, at exit, where every imported module came from; then runs flows.run as `python -m` does.
DRIVER = """
import atexit, importlib.util, json, runpy, sys
record = sys.argv.pop(1)
ran = importlib.util.find_spec("flows.run").origin  # what run_module runs, as __main__ (gone from sys.modules after)
def where(module):  # from the module's own namespace: a lazy module's __getattr__ would import more
    names = getattr(module, "__dict__", {})
    found = names.get("__file__") or next(iter(names.get("__path__") or []), None)
    return found if isinstance(found, str) else None
def save():
    modules = json.dumps({**{name: where(module) for name, module in list(sys.modules.items())}, "flows.run": ran})
    with open(record, "w") as file:
        file.write(modules)
atexit.register(save)
runpy.run_module("flows.run", run_name="__main__", alter_sys=True)
"""


def copy_ignored(folder: str, names: list[str]) -> set[str]:
    left_out = {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info"))}
    return left_out | (TOP_LEVEL_LEFT_OUT & set(names) if Path(folder) == ROOT else set())


def product_packages(source: Path) -> list[str]:
    return sorted(p.name for p in source.iterdir() if (p / "__init__.py").is_file() and p.name not in NOT_SHIPPED)


def shipped_files(source: Path) -> set[str]:
    """Paths (relative, as in the wheel) of every module of the product packages and every preset and plugin."""
    files = {path for package in product_packages(source) for path in (source / package).rglob("*.py")}
    files |= {path for path in (source / "configs").rglob("*") if path.suffix in CONFIG_SUFFIXES}
    return {path.relative_to(source).as_posix() for path in files if "__pycache__" not in path.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built from a copy of the checkout (no build/ or egg-info left in it), installed with pip into a folder
    of its own, and the files the copy says it must hold."""
    work = tmp_path_factory.mktemp("package")
    source, wheels, site = work / "source", work / "wheels", work / "site"
    shutil.copytree(ROOT, source, ignore=copy_ignored)

    def pip(*args) -> None:
        command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *map(str, args)]
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", wheels, source)
    [wheel] = wheels.glob("*.whl")
    pip("install", "--no-deps", "--no-index", "-q", "--target", site, wheel)
    return {"wheel": wheel, "site": site, "expected": shipped_files(source), "packages": product_packages(source)}


def test_wheel_holds_every_module_preset_and_plugin(installed):
    with zipfile.ZipFile(installed["wheel"]) as wheel:
        names = set(wheel.namelist())
    assert {"pipeline", "stages", "flows"} <= set(installed["packages"])
    assert {"configs/tiny.yaml", "configs/agents/calculator.py", "configs/reward_funcs/math_answer.py"} <= names
    assert not installed["expected"] - names, f"left out of the wheel: {sorted(installed['expected'] - names)}"
    assert not {name for name in names if name.startswith(tuple(f"{p}/" for p in NOT_SHIPPED))}


def test_presets_plugin_paths_resolve_in_the_install(installed):
    """A preset's relative plugin path (agent_func_path, remote_rm_url FILE.py) resolves against the folder holding
    the packages, as the stages resolve it: a file of the install, not of a checkout."""

    def plugin_paths(value) -> list[str]:
        if isinstance(value, dict):
            return [path for item in value.values() for path in plugin_paths(item)]
        if isinstance(value, list):
            return [path for item in value for path in plugin_paths(item)]
        if isinstance(value, str) and value.endswith(".py") and "://" not in value and not Path(value).is_absolute():
            return [value]
        return []

    site = installed["site"]
    assert (site / "configs").is_dir(), "configs/ is not in the install"
    presets = sorted((site / "configs").glob("*.yaml"))
    found = {preset.name: plugin_paths(yaml.safe_load(preset.read_text())) for preset in presets}
    assert any(found.values()), found  # the presets do name plugins: the check checks something
    missing = {name: [p for p in paths if not (site / p).is_file()] for name, paths in found.items()}
    assert not any(missing.values()), f"plugin files not in the install: {missing}"


@pytest.mark.slow
def test_plan_runs_outside_the_checkout_on_the_installed_copy(installed, tmp_path):
    """`-S`: no .pth file runs, so the venv's editable install of the checkout cannot answer an import; the venv's
    site-packages (the dependencies) come after the install on PYTHONPATH."""
    site, record = installed["site"].resolve(), tmp_path / "modules.json"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dependencies = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *dependencies])}
    done = subprocess.run([sys.executable, "-S", "-c", DRIVER, str(record), "--preset", "tiny", "--plan"],
                          cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "plan OK" in done.stdout, done.stdout[-4000:]

    modules = json.loads(record.read_text())
    ours = {name: where for name, where in modules.items()
            if name.split(".")[0] in {*installed["packages"], "configs"}}
    assert {"flows.run", "pipeline.plan", "stages.config"} <= set(ours), sorted(ours)
    not_installed = {name: where for name, where in ours.items()
                     if not (where and Path(where).resolve().is_relative_to(site))}
    assert not not_installed, f"product modules not from the install: {not_installed}"
    venv = Path(sys.prefix).resolve()  # the dependencies: in CI the venv lies in the checkout (.venv)
    resolved = {name: Path(where).resolve() for name, where in modules.items() if where}
    from_checkout = {name: str(path) for name, path in resolved.items()
                     if path.is_relative_to(ROOT) and not path.is_relative_to(venv)}
    assert not from_checkout, f"imported from the checkout: {from_checkout}"
