"""The package's layout rules hold: no module reaches into another module's private names.

``torch_private.py`` is the one module allowed to import torch's underscore names (it checks
them, see ``test_torch_private.py``); everywhere else, in the package, tests and benchmarks, an
import of ``_name`` from another module, or ``module._name`` on an imported project module, fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
ALLOWED = {REPO / "elastic_trainer" / "rendezvous" / "torch_private.py"}
OURS = ("elastic_trainer", "tests", "benchmarks")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reach_ins(path: Path) -> list[str]:
    """Every import of another module's private name in one file, as ``file:line: what``."""
    tree = ast.parse(path.read_text(), str(path))
    found, modules = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if _private(alias.name):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno}: from {node.module} import {alias.name}")
                if node.module.startswith(OURS):
                    modules.add(alias.asname or alias.name)
            if node.module.startswith(OURS) and any(_private(p) for p in node.module.split(".")):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: import from private module {node.module}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(OURS):
                    modules.add(alias.asname or alias.name.split(".")[0])
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                and _private(node.attr)):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    files = [p for top in OURS for p in sorted((REPO / top).rglob("*.py")) if p not in ALLOWED]
    assert len(files) > 50
    problems = [line for p in files for line in private_reach_ins(p)]
    assert problems == [], "\n".join(problems)


def test_the_check_catches_a_reach_in(tmp_path):
    bad = REPO / "tests" / "_layout_probe_tmp.py"
    try:
        bad.write_text("from elastic_trainer.checkpoint import storage\nfrom x import _y\nstorage._z\n")
        assert len(private_reach_ins(bad)) == 2
    finally:
        bad.unlink()
