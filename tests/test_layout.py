"""The package's layout rules hold: layers that point one way, no import cycle, no reach-in to
another object's private members, and tests and benchmarks that depend on each other one way only.

In elastic_trainer/ (every import counts: module level, in a function, under TYPE_CHECKING):

- **Layers** (``LAYERS``, and docs/architecture.md's "Layers"): base services (env, config, the
  runtime, the fence protocol, torch's private names, etcd, ...) below the parts (rendezvous/,
  checkpoint/, the data), the live quorum, training, the parsers and the public names, the commands
  (train.py, drill/, cli/) and the tools that read the commands (the docs' flag tables). An import
  goes down, or sideways within its own part.
- **No import cycle**, anywhere in the package.
- **No reach-in**: ``x._name`` (or ``getattr(x, "_name")``) only for x = self, cls or super();
  the policy for other libraries' underscore names is at ``REACH_IN_FILES`` below.

Known exceptions, in files other work of issue 42 is rewriting now, are listed with file:line in
``LAYER_EXCEPTIONS``, ``CYCLE_EXCEPTIONS`` and ``REACH_IN_EXCEPTIONS``, for the lead to empty at
merge; an entry that no longer matches fails, so the lists only shrink.

Everywhere (the package, tests and benchmarks): ``torch_private.py`` is the one module allowed to
import torch's underscore names (it checks them, see ``test_torch_private.py``); elsewhere an import
of ``_name`` from another module, or ``module._name`` on an imported project module, fails.

No test module imports another test module (what two share lives in ``tests/helpers/`` or
``tests/conftest.py``), and nothing in ``benchmarks/`` or ``elastic_trainer/`` imports ``tests``
(tests may import a benchmark's module, such as ``benchmarks/rdzv_worker.py``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers.common import REPO

ALLOWED = {REPO / "elastic_trainer" / "torch_private.py"}
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


# ============================================================ the package's layers, cycles and reach-ins
#
# Every import inside elastic_trainer/ counts: at module level, inside a function, and under
# ``if TYPE_CHECKING:`` (a cycle hidden in one is still two modules that cannot be read apart).
# A module's layer is the most specific entry below that names it ("checkpoint" names the package
# and its modules; "training.data" one module); "" is the package's own __init__.py.

PACKAGE = REPO / "elastic_trainer"

LAYERS: list[dict[str, tuple[str, ...]]] = [
    # 0. base: services every layer uses, none of which knows the rendezvous, training or a command:
    #    the environment's names and exit codes, the configs, the thread owner and the one exit,
    #    the fence protocol, torch's private names, devices and CPUs, the records' contract, etcd.
    #    observability/'s metrics (every process records into them, the etcd client and the lease too),
    #    the straggler arithmetic, the step clock, the crash-loop policy and the back-off.
    {"base": ("env", "config", "runtime", "fence", "torch_private", "cpus", "devices", "records", "etcd", "storage",
              "observability", "observability.metrics", "observability.metrics_server", "observability.backoff",
              "observability.stragglers", "observability.step_clock", "observability.crash_loop")},
    # 1. the parts, each its own group: one may not import another of the same layer.
    {"rendezvous": ("rendezvous",),  # torchrun's side: the etcd-v3 handler, its backend, leases
     "checkpoint": ("checkpoint",),
     "data": ("sampler", "tasks", "training.data", "stream")},  # what the trainer reads; training/data.py
    #                                                             is the example tasks' datasets
    # 2. the live quorum, built on the agents' rendezvous (their node lease and what they record on it)
    # with the node's checks before it joins (they write to the checkpoint storage)
    {"live": ("live",), "health": ("observability.health",)},
    # 3. training: the Manager, the Trainer and their parts
    {"training": ("training",)},
    # 4. the public names (elastic_trainer/__init__.py) and the parsers generated from the configs
    {"public": ("",), "flags": ("flags",)},
    # 5. the commands: the worker's entry and the drill; then `elastic-train`, which dispatches to the drill
    #    (the worker's entry with the fork server its workers are forked from: preload.py)
    {"train": ("train", "preload"), "script": ("script",), "drill": ("drill",)},
    {"cli": ("cli",)},
    # 6. what reads the commands: the docs' flag tables (from their parsers)
    {"tools": ("flag_tables",)},
]
# A new package is in no layer until it is placed here (the test says which).

LAYER_EXCEPTIONS: dict[str, str] = {
    # Known imports against the layers, each "file:line: importer -> imported", in files other work
    # is rewriting now (issue 42). The lead empties this list at merge; an entry that no longer
    # matches fails too, so the list only ever shrinks.
}

CYCLE_EXCEPTIONS: dict[tuple[str, ...], str] = {
    # Known import cycles (their modules, sorted), for the lead to empty at merge; none left.
}


def _modules() -> dict[str, Path]:
    """Every module of the package by its name without ``elastic_trainer.`` ("" for the package)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _ours(name: str, modules: dict[str, Path]) -> str | None:
    """The module of ours that ``name`` (an absolute dotted name) is or is in; None if not ours."""
    if name != "elastic_trainer" and not name.startswith("elastic_trainer."):
        return None
    rel = name[len("elastic_trainer."):] if name != "elastic_trainer" else ""
    while rel not in modules:
        rel = rel.rpartition(".")[0]
    return rel


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def package_imports(modules: dict[str, Path] | None = None) -> list[tuple[str, str, int, str]]:
    """Every import between modules of the package: (importer, imported, line, where), ``where``
    being "module", "function" or "TYPE_CHECKING". ``from a import b`` imports ``a.b`` when that is
    a module, else ``a``; a subpackage's parents are not counted (importing ``a.b`` runs
    ``a/__init__.py``, which imports nothing heavy: the package's __init__ files import lazily)."""
    modules = _modules() if modules is None else modules
    edges = []
    for name, path in modules.items():
        is_package = path.name == "__init__.py"

        def visit(node: ast.AST, where: str) -> None:
            for child in ast.iter_child_nodes(node):
                inner = where
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) and where == "module":
                    inner = "function"
                if isinstance(child, ast.If) and _type_checking(child.test):
                    inner = "TYPE_CHECKING"
                if isinstance(child, ast.Import):
                    for alias in child.names:
                        target = _ours(alias.name, modules)
                        if target is not None and target != name:
                            edges.append((name, target, child.lineno, where))
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        base = ["elastic_trainer", *name.split(".")] if name else ["elastic_trainer"]
                        base = base if is_package else base[:-1]
                        base = base[:len(base) - child.level + 1]
                        source = ".".join(base + ([child.module] if child.module else []))
                    else:
                        source = child.module or ""
                    for alias in child.names:
                        target = _ours(f"{source}.{alias.name}", modules)
                        if target is not None and target != name:
                            edges.append((name, target, child.lineno, where))
                visit(child, inner)

        visit(ast.parse(path.read_text(), str(path)), "module")
    return sorted(set(edges))


def layer_of(module: str) -> tuple[int, str] | None:
    """(layer index, group) of a module (the most specific entry that names it), None if none does."""
    best: tuple[int, int, str] | None = None
    for index, groups in enumerate(LAYERS):
        for group, prefixes in groups.items():
            for prefix in prefixes:
                if module == prefix or (prefix and module.startswith(prefix + ".")) or (not prefix and not module):
                    if best is None or len(prefix) > best[0]:
                        best = (len(prefix), index, group)
    return None if best is None else (best[1], best[2])


def _where(module: str, line: int, modules: dict[str, Path]) -> str:
    return f"{modules[module].relative_to(REPO)}:{line}"


def layer_violations(modules: dict[str, Path] | None = None) -> list[str]:
    """Every import that goes up a layer, or across to another group of its layer, as
    ``file:line: importer -> imported``; and every module no layer names."""
    modules = _modules() if modules is None else modules
    problems = [f"{modules[m].relative_to(REPO)}: {m or 'elastic_trainer'} is in no layer (add it to LAYERS)"
                for m in modules if layer_of(m) is None]
    for src, dst, line, _ in package_imports(modules):
        a, b = layer_of(src), layer_of(dst)
        if a is None or b is None or a[1] == b[1] or b[0] < a[0]:
            continue
        problems.append(f"{_where(src, line, modules)}: {src or 'elastic_trainer'} -> {dst or 'elastic_trainer'}")
    return sorted(set(problems))


def test_imports_point_down_the_layers():
    """What the layers say: configs, flags and the base services below the commands; the runtime, the
    fence protocol and torch's private names below checkpoint/, rendezvous/, live/ and training/."""
    found = layer_violations()
    new = [p for p in found if p not in LAYER_EXCEPTIONS]
    gone = [p for p in LAYER_EXCEPTIONS if p not in found]
    assert new == [] and gone == [], (
        "imports against the layers (tests/test_layout.py's LAYERS):\n" + "\n".join(new)
        + ("\nno longer found, remove from LAYER_EXCEPTIONS:\n" + "\n".join(gone) if gone else ""))


def test_the_layers_name_what_they_must():
    # the rules, spelled out: whoever edits LAYERS keeps them
    def below(a: str, b: str) -> bool:
        return layer_of(a)[0] < layer_of(b)[0]

    for service in ("runtime", "fence", "torch_private", "config", "env", "flags"):
        for user in ("cli.launch", "drill.scenario", "train"):
            assert below(service, user), (service, user)
    for service in ("runtime", "fence", "torch_private"):
        for user in ("checkpoint.writer", "rendezvous.handler", "live.quorum", "training.manager"):
            assert below(service, user), (service, user)
    assert below("train", "flag_tables") and below("cli.launch", "flag_tables") and below("drill.scenario", "flag_tables")


def test_the_layer_checks_catch_an_import_up_across_in_a_function_and_under_type_checking():
    probes = {"env": "def f():\n    from elastic_trainer import train\n",  # up, in a function
              "train": "",
              "checkpoint.writer": "from elastic_trainer.rendezvous import x\nfrom elastic_trainer import env\n",
              "rendezvous.x": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from elastic_trainer.checkpoint.writer import Writer\n",  # across, TYPE_CHECKING
              "cli.launch": "import elastic_trainer.env\nfrom elastic_trainer.checkpoint import writer\n"}  # down: fine
    modules = {m: REPO / "tests" / f"_layout_probe_{i}.py" for i, m in enumerate(probes)}
    try:
        for m, text in probes.items():
            modules[m].write_text(text)
        found = sorted(line.split(": ", 1)[1] for line in layer_violations(modules))
        assert found == ["checkpoint.writer -> rendezvous.x", "env -> train", "rendezvous.x -> checkpoint.writer"]
        assert find_cycles(modules) == {("checkpoint.writer", "rendezvous.x")}
    finally:
        for path in modules.values():
            path.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------ cycles

def find_cycles(modules: dict[str, Path] | None = None) -> set[tuple[str, ...]]:
    """The import cycles of the package: each strongly connected set of two or more modules, sorted."""
    modules = _modules() if modules is None else modules
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for src, dst, _, _ in package_imports(modules):
        graph[src].add(dst)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = set()

    def connect(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                cycles.add(tuple(sorted(members)))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return cycles


def test_no_import_cycle():
    modules = _modules()
    found = find_cycles(modules)
    new = found - set(CYCLE_EXCEPTIONS)
    gone = set(CYCLE_EXCEPTIONS) - found
    edges = package_imports(modules)
    lines = []
    for cycle in sorted(new):
        lines.append(" <-> ".join(cycle) + ":")
        lines += [f"  {_where(a, line, modules)}: {a} -> {b} ({where})" for a, b, line, where in edges
                  if a in cycle and b in cycle]
    assert not new and not gone, ("import cycles (TYPE_CHECKING and function-level imports count):\n" + "\n".join(lines)
                                  + ("\nno longer found, remove from CYCLE_EXCEPTIONS: " + str(sorted(gone)) if gone else ""))


# ------------------------------------------------------------------------------------ reach-ins
#
# An object uses another's public interface: ``x._name`` is only for x = self or cls (or super()).
# ``self.other._x``, ``obj.attr._x``, ``Class._x`` outside ``cls``, ``getattr(x, "_x")``: reach-ins.
# A module's own private functions and globals are plain names there, never ``x._name``.
# The policy for the underscore names of other libraries:
# - torch's: only in torch_private.py, which checks every one of them against the running torch;
# - the namedtuple API (``_replace``, ``_asdict``, ``_fields``, ``_make``, ``_field_defaults``): public,
#   underscored only so as not to clash with field names (the Python docs say so);
# - ``os._exit``: public (the documented exit without clean-up), and only the runtime ends a process;
# - everything else (``sys._getframe``, argparse's ``_actions``, a library's private method): a reach-in.

REACH_IN_FILES = {"elastic_trainer/torch_private.py"}
NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
PUBLIC_UNDERSCORED = {"os._exit": {"elastic_trainer/runtime.py"}}

REACH_IN_EXCEPTIONS: dict[str, str] = {
    # Known reach-ins, "file:line: expression", in files other work is rewriting now (issue 42); the
    # lead empties this list at merge. An entry that no longer matches fails too.
}


def _own(node: ast.expr) -> bool:
    """``self``, ``cls`` or ``super()``: the object's own members."""
    return (isinstance(node, ast.Name) and node.id in ("self", "cls")) or (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super")


def reach_ins(path: Path) -> list[str]:
    """Every ``x._name`` (and ``getattr(x, "_name")``) in one file where x is not self, cls or super()."""
    rel = str(path.relative_to(REPO))
    if rel in REACH_IN_FILES:
        return []
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr) and not _own(node.value):
            text = ast.unparse(node)
            if node.attr in NAMEDTUPLE_API or rel in PUBLIC_UNDERSCORED.get(text, ()):
                continue
            found.append((node.lineno, node.col_offset, f"{rel}:{node.lineno}: {text}"))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and _private(node.args[1].value) and node.args[1].value not in NAMEDTUPLE_API
              and not _own(node.args[0])):
            found.append((node.lineno, node.col_offset, f"{rel}:{node.lineno}: {ast.unparse(node)}"))
    return [text for _, _, text in sorted(found)]


def test_no_object_reaches_into_anothers_private_members():
    files = sorted(PACKAGE.rglob("*.py"))
    found = [line for path in files for line in reach_ins(path)]
    new = [p for p in found if p not in REACH_IN_EXCEPTIONS]
    gone = [p for p in REACH_IN_EXCEPTIONS if p not in found]
    assert new == [] and gone == [], ("reach-ins into another object's private members:\n" + "\n".join(new)
                                      + ("\nno longer found, remove from REACH_IN_EXCEPTIONS:\n" + "\n".join(gone)
                                         if gone else ""))


def test_the_reach_in_check_catches_what_it_should_and_only_that():
    probe = REPO / "tests" / "_layout_probe_tmp.py"
    try:
        probe.write_text(
            "import os, sys\n"
            "class A:\n"
            "    def f(self, other):\n"
            "        self._a, cls_ok = 1, super()._b\n"             # own: fine
            "        other._c\n"                                    # 5: another object's
            "        self.other._d\n"                               # 6: a member's member
            "        A._e\n"                                        # 7: a class's, not through cls
            "        getattr(other, '_f', None)\n"                  # 8: the same by name
            "        getattr(self, '_g', None)\n"                   # own: fine
            "        return point._replace(x=1), sys._getframe(1), os._exit\n")  # 10: the last two
        found = [line.split(":", 1)[1] for line in reach_ins(probe)]
        assert found == ["5: other._c", "6: self.other._d", "7: A._e", "8: getattr(other, '_f', None)",
                         "10: sys._getframe", "10: os._exit"], found
    finally:
        probe.unlink()
