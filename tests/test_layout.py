"""The package's layout rules hold: no module reaches into another module's private names, and
the tests and benchmarks depend on each other one way only.

``torch_private.py`` is the one module allowed to import torch's underscore names (it checks
them, see ``test_torch_private.py``); everywhere else, in the package, tests and benchmarks, an
import of ``_name`` from another module, or ``module._name`` on an imported project module, fails.

No test module imports another test module (what two share lives in ``tests/helpers/`` or
``tests/conftest.py``), and nothing in ``benchmarks/`` or ``elastic_trainer/`` imports ``tests``
(tests may import a benchmark's module, such as ``benchmarks/rdzv_worker.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.common import REPO

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


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """Every module ``path`` imports, absolute names as written, with their lines (``from a import b``
    counts as ``a`` and ``a.b``: ``b`` may be a module)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def wrong_way_imports(path: Path) -> list[str]:
    """A test module's import of another test module, or an import of ``tests`` outside tests/."""
    in_tests = path.is_relative_to(REPO / "tests")
    problems: dict[int, str] = {}  # one per import statement
    for line, module in imported_modules(path):
        parts = module.split(".")
        if parts[0] != "tests" or line in problems:
            continue
        if not in_tests:
            problems[line] = f"{path.relative_to(REPO)}:{line}: imports {module} (nothing outside tests/ may)"
        elif len(parts) > 1 and parts[1].startswith("test_"):
            problems[line] = (f"{path.relative_to(REPO)}:{line}: imports the test module {'.'.join(parts[:2])} "
                              "(move what both need to tests/helpers/ or tests/conftest.py)")
    return list(problems.values())


def test_no_test_module_imports_another_and_nothing_outside_tests_imports_them():
    files = [p for top in OURS for p in sorted((REPO / top).rglob("*.py"))]
    problems = [line for p in files for line in wrong_way_imports(p)]
    assert problems == [], "\n".join(problems)


def test_the_check_catches_a_test_importing_a_test_and_a_benchmark_importing_tests():
    probes = [REPO / "tests" / "_layout_probe_tmp.py", REPO / "benchmarks" / "_layout_probe_tmp.py"]
    try:
        for probe in probes:
            probe.write_text("from tests.test_trainer import latest\nimport tests.test_train_e2e\n"
                             "from tests import test_cli\nfrom tests.helpers.runs import TINY\n")
        assert len(wrong_way_imports(probes[0])) == 3
        assert len(wrong_way_imports(probes[1])) == 4
    finally:
        for probe in probes:
            probe.unlink(missing_ok=True)


# ---- objects and modules of elastic_trainer/live/ (the lead widens these to the whole package) ----------
LIVE = REPO / "elastic_trainer" / "live"


def attribute_reach_ins(path: Path) -> list[str]:
    """Every ``x._name`` in one file where ``x`` is not ``self`` or ``cls``: an object that reaches
    into another's private members (``module._name`` on a module is ``private_reach_ins``'s)."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}")
    return found


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(paths: list[Path]) -> dict[str, set[str]]:
    """module -> the modules among ``paths`` it imports anywhere in its text (at the top, in a
    function, under ``TYPE_CHECKING``; ``from a import b`` counts as ``a.b`` when that is one of
    them, else as ``a``; relative imports resolved)."""
    names = {module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in names and t != name}
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``: each strongly connected set of more than one module (Tarjan's), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_no_object_in_live_reaches_into_another_objects_private_members():
    files = sorted(LIVE.rglob("*.py"))
    assert len(files) > 10
    problems = [line for p in files for line in attribute_reach_ins(p)]
    assert problems == [], "\n".join(problems)


def test_the_modules_of_live_import_each_other_without_a_cycle():
    graph = import_graph(sorted(LIVE.rglob("*.py")))
    assert len(graph) > 10 and any(graph.values())
    assert import_cycles(graph) == []


def test_the_live_checks_catch_a_reach_in_and_a_cycle_hidden_in_a_function(tmp_path, monkeypatch):
    probe = tmp_path / "probe.py"
    probe.write_text("class A:\n    def f(self, other):\n        return self._a, other._b, self._c._d, super()._e\n")
    monkeypatch.setattr("tests.test_layout.REPO", tmp_path)
    assert [line.split(": ", 1)[1] for line in attribute_reach_ins(probe)] == ["other._b", "self._c._d", "super()._e"]
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")
    graph = import_graph(sorted(pkg.glob("*.py")))
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
