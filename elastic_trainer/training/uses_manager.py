"""A training script's own sources, and whether they use the Manager: what decides the recovery
mode a script runs under by default, and what the joiner check fingerprints.

``elastic-train`` runs a script that uses ``elastic_trainer.Manager`` under live recovery by
default (the survivors keep their processes) and any other script under torchrun's restarts;
``--recovery live|restart`` always overrides that guess. A script under live recovery that forms
its process group without the Manager is stopped at its first ``init_process_group``
(``elastic_trainer/script.py``), so a wrong guess costs a clear error, never a silent run.

The guess reads the program's text, never runs it (the launcher has not even imported torch):
:func:`script_sources` parses the script with ``ast`` and follows its imports of its *own* modules,
the ones Python would find in the script's folder (``sys.path[0]``; for ``-m pkg.mod`` the current
folder, or the installed package ``pkg`` itself), through ``import helpers``, ``from helpers import x``,
``from pkg.sub import y`` and relative imports inside packages, up to ``MAX_FILES`` files;
installed packages and the standard library are not followed. A file uses the Manager when it
imports it from ``elastic_trainer`` (``from elastic_trainer import Manager``, also from
``elastic_trainer.training`` or ``elastic_trainer.training.manager``, or any other
``elastic_trainer`` module) or names it as an attribute of an imported ``elastic_trainer`` module
(``elastic_trainer.Manager``); a mention in a comment or a string does not count.

    sources = script_sources("examples/own_loop.py")
    sources.uses_manager            # True
    sources.files                   # (Path('.../examples/own_loop.py'),): the script, then its own modules

Called by the launcher (``cli/launch.py`` for the mode, ``cli/join.py`` for the fingerprint).
"""

from __future__ import annotations

import ast
import importlib.machinery
import logging
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

PACKAGE = "elastic_trainer"
MANAGER = "Manager"
MAX_FILES = 64
MAX_BYTES = 4 << 20
"""The most files, and bytes, of a program's own that are read: a script in a folder with a large
package of its own is still answered within a second or so."""


@dataclass(frozen=True)
class ScriptSources:
    """A program's own source files (the script or module first, then the local modules it
    imports, in the order found) and whether any of them uses the Manager."""

    root: Path | None
    """The folder the files are found under (None: the program was not found)."""
    files: tuple[Path, ...]
    uses_manager: bool


def _parse(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_bytes(), filename=str(path))
    except (OSError, SyntaxError, ValueError) as exc:
        logger.debug("could not parse %s: %s", path, exc)
        return None


def _is_ours(module: str | None) -> bool:
    return module is not None and (module == PACKAGE or module.startswith(PACKAGE + "."))


def _uses_manager(tree: ast.Module) -> bool:
    """An import of ``Manager`` from an ``elastic_trainer`` module, or ``<elastic_trainer module>.Manager``."""
    bound: set[str] = set()  # names an `import elastic_trainer[.x] [as y]` binds
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _is_ours(node.module):
            if any(alias.name in (MANAGER, "*") for alias in node.names):
                return True
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _is_ours(alias.name):
                    bound.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == MANAGER:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                return True
    return False


def _imported(tree: ast.Module, package: str) -> list[str]:
    """Every module name the file may import (absolute; ``package``: the file's own, for relative
    imports), with each ``from m import n`` also as ``m.n`` (``n`` may be a submodule)."""
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                if node.level - 1 > len(parts):
                    continue
                base = ".".join(parts[:len(parts) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            if base:
                names.append(base)
            names.extend(f"{base}.{alias.name}" if base else alias.name for alias in node.names if alias.name != "*")
    # `import a.b.c` runs a/__init__.py and a/b/__init__.py first
    return [".".join(parts[:i]) for name in names for parts in [name.split(".")] for i in range(1, len(parts) + 1)]


def _local_file(root: Path, module: str) -> Path | None:
    """The file of ``module`` under ``root`` (``a/b.py`` or ``a/b/__init__.py``), or None."""
    base = root.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _package_of(root: Path, path: Path) -> str:
    """The package a file under ``root`` belongs to (``a.b`` for ``root/a/b/c.py`` or ``root/a/b/__init__.py``)."""
    parts = list(path.relative_to(root).parts)
    return ".".join(parts[:-1])


def _find_module(name: str) -> tuple[Path, Path, Path] | None:
    """``-m name``: its file, the folder that holds its top-level package, and the folder whose files
    count as its own (that folder when it is the current one; else the top-level package's own, or
    none but the module's file), as ``python -m`` run from here would find them (the current folder
    first), without importing anything."""
    search = [str(Path.cwd()), *[p for p in sys.path if p]]
    parts = name.split(".")
    try:
        spec = importlib.machinery.PathFinder.find_spec(parts[0], search)
        for i in range(1, len(parts)):
            if spec is None or not spec.submodule_search_locations:
                return None
            spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:i + 1]),
                                                            list(spec.submodule_search_locations))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    path = Path(spec.origin).resolve()
    if path.name == "__init__.py" and spec.submodule_search_locations:
        main = path.parent / "__main__.py"  # `python -m pkg` runs pkg/__main__.py
        path = main if main.is_file() else path
    root = path.parents[len(parts) - (0 if path.name in ("__init__.py", "__main__.py") else 1)]
    if root == Path.cwd().resolve():
        return path, root, root
    return path, root, root / parts[0] if (root / parts[0]).is_dir() else path


def script_sources(script: str, module: bool = False) -> ScriptSources:
    """The program's own files and whether they use the Manager (see the module docstring):
    ``script`` is a path, or a module name with ``module`` (``elastic-train -m``)."""
    if module:
        found = _find_module(script)
        if found is None:
            return ScriptSources(None, (), False)
        first, root, scope = found
    else:
        first = Path(script).resolve()
        if not first.is_file():
            return ScriptSources(None, (), False)
        root = scope = first.parent
    files: list[Path] = []
    seen = {first}
    queue = deque([first])
    uses = False
    size = 0
    while queue and len(files) < MAX_FILES and size < MAX_BYTES:
        path = queue.popleft()
        files.append(path)
        size += path.stat().st_size
        tree = _parse(path)
        if tree is None:
            continue
        uses = uses or _uses_manager(tree)
        package = _package_of(root, path) if path.is_relative_to(root) else ""
        for name in _imported(tree, package):
            if _is_ours(name):
                continue
            local = _local_file(root, name)
            if local is not None and local.resolve().is_relative_to(scope) and local.resolve() not in seen:
                seen.add(local.resolve())
                queue.append(local.resolve())
    return ScriptSources(root, tuple(files), uses)


def script_uses_manager(script: str, module: bool = False) -> bool:
    """Whether the training script (a path, or a module name with ``module``) or one of its own
    modules uses ``elastic_trainer.Manager``: the launcher's default recovery mode (live if so)."""
    return script_sources(script, module).uses_manager


__all__ = ["MAX_BYTES", "MAX_FILES", "ScriptSources", "script_sources", "script_uses_manager"]
