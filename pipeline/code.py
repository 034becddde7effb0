"""What code a stage job runs: its entrypoint module and every project module it can import, found statically.

The closure follows `import` and `from ... import` statements at any depth (imports inside functions count: they
run when the function does), the packages above each module (their `__init__` runs on import), and skips the
`if __name__ == "__main__":` block of every module but the entrypoint (that code runs only when a module is run as
a script). A stage's code version is the sha256 of the files in its closure, so an edit to code the stage cannot
reach (the rehearsal, the orchestration's settings) leaves its stage key alone, and an edit to code it runs (the
algorithms for RL) changes it.
"""

from __future__ import annotations

import ast
import hashlib
from pathlib import Path

PROJECT_ROOT = Path(__file__).resolve().parent.parent
# The project's own top-level packages. Installed from a wheel they sit in site-packages beside every other
# distribution, so a module counts as the project's only under one of these (or the entry's own package).
PROJECT_PACKAGES = ("infra", "stages", "pipeline", "tasks", "flows")


def module_file(root: Path, name: str) -> Path | None:
    """The source file of module `name` under `root`, or None."""
    path = root / Path(*name.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _is_main_guard(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return (isinstance(node, ast.If) and isinstance(test, ast.Compare) and isinstance(test.left, ast.Name)
            and test.left.id == "__name__" and any(isinstance(c, ast.Constant) and c.value == "__main__"
                                                   for c in test.comparators))


def _imports(node: ast.AST, package: str, skip_main: bool) -> set[str]:
    names: set[str] = set()
    for child in ast.iter_child_nodes(node):
        if skip_main and _is_main_guard(child):
            continue
        if isinstance(child, ast.Import):
            names |= {alias.name for alias in child.names}
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: from the importing module's package
                parts = package.split(".")[: len(package.split(".")) - child.level + 1]
                base = ".".join([*parts, base] if base else parts)
            names.add(base)
            names |= {f"{base}.{alias.name}" for alias in child.names}  # `from stages import data`
        names |= _imports(child, package, skip_main=False)
    return names


def imported_modules(root: Path, name: str, tree: ast.Module, *, entry: bool) -> set[str]:
    """Project modules that module `name` imports (its main block only when it is the entrypoint), with the
    packages above each of them."""
    package = name if module_file(root, name).name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for imported in _imports(tree, package, skip_main=not entry):
        parts = imported.split(".")
        found |= {prefix for i in range(1, len(parts) + 1)
                  if module_file(root, prefix := ".".join(parts[:i])) is not None}
    return found


def entry_module(name: str, root: Path = PROJECT_ROOT) -> str:
    """What `python -m name` runs: module `name`, or the `__main__` module of package `name`."""
    path = module_file(root, name)
    if path is None:
        raise ValueError(f"no module {name} under {root}")
    return f"{name}.__main__" if path.name == "__init__.py" and (path.parent / "__main__.py").is_file() else name


# Per version of a file (path, modification time, size): the stages' closures share most of their modules.
_PARSED: dict[tuple, ast.Module] = {}
_IMPORTED: dict[tuple, set[str]] = {}


def _version(path: Path) -> tuple:
    stat = path.stat()
    return str(path), stat.st_mtime_ns, stat.st_size


def parsed(path: Path) -> ast.Module:
    """The syntax tree of `path`, parsed once per version of the file."""
    key = _version(path)
    if key not in _PARSED:
        _PARSED[key] = ast.parse(path.read_text(), filename=str(path))
    return _PARSED[key]


def module_closure(entry: str, root: Path = PROJECT_ROOT) -> dict[str, ast.Module]:
    """Parsed source of what `python -m entry` runs and of every project module it reaches through imports."""
    entry = entry_module(entry, root)
    packages = {entry.split(".")[0], *PROJECT_PACKAGES}
    parts = entry.split(".")
    pending = [".".join(parts[:i]) for i in range(1, len(parts))] + [entry]
    trees: dict[str, ast.Module] = {}
    while pending:
        name = pending.pop()
        if name in trees or name.split(".")[0] not in packages or module_file(root, name) is None:
            continue
        path = module_file(root, name)
        trees[name] = parsed(path)
        key = (*_version(path), name, name == entry, str(root))
        if key not in _IMPORTED:
            _IMPORTED[key] = imported_modules(root, name, trees[name], entry=name == entry)
        pending += _IMPORTED[key]
    return trees


def code_version(entry: str, root: Path = PROJECT_ROOT) -> str:
    """sha256 over the sources of `entry`'s closure (paths and contents); no git needed."""
    digest = hashlib.sha256()
    for name in sorted(module_closure(entry, root)):
        path = module_file(root, name)
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def imported_code_version(path: Path, root: Path = PROJECT_ROOT) -> str | None:
    """sha256 of the project modules a file outside the packages imports (a reward function that calls
    stages/answers.py), with their closures; None when it imports none. Its own content is fingerprinted as data."""
    names = {name for name in _imports(parsed(path), "", skip_main=False)
             if name.split(".")[0] in PROJECT_PACKAGES and module_file(root, name) is not None}
    if not names:
        return None
    closure: dict[str, ast.Module] = {}
    for name in sorted(names):
        closure |= module_closure(name, root)
    digest = hashlib.sha256()
    for name in sorted(closure):
        module = module_file(root, name)
        digest.update(str(module.relative_to(root)).encode() + b"\0" + module.read_bytes() + b"\0")
    return digest.hexdigest()
