"""docs/architecture.md stays true: what it says about threads and the environment holds in the code.

- Every thread our code starts goes through the process's runtime (``runtime().start_thread`` /
  ``start_timer``): no ``threading.Thread``, ``Timer``, thread pool or ``Thread`` subclass anywhere
  in elastic_trainer/ but ``runtime.py``.
- Every thread name the code gives is in the architecture's thread tables (and every name a live
  worker runs, read from ``elastic-train status``: ``tests/test_status.py``'s live run).
- Every environment variable name the code reads or writes is defined in ``env.py``: anywhere else
  it is ``env.ENV_...``, never a string (``os.environ["X"]``, ``.get/.pop/.setdefault("X")``,
  ``"X" in os.environ``, ``os.getenv("X")``, the keys of an environment given to a process), nor a
  constant of another module; and an ``ELASTIC_TRAINER_*`` string appears nowhere else at all.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.architecture import thread_table, unnamed
from tests.helpers.common import REPO

PACKAGE = REPO / "elastic_trainer"
RUNTIME = PACKAGE / "runtime.py"
ENV = PACKAGE / "env.py"


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


# ------------------------------------------------------------------------------- thread starts

THREAD_MAKERS = {"Thread", "Timer", "start_new_thread", "ThreadPoolExecutor", "ThreadPool"}
"""Calls that make a thread (``threading.Thread(...)``, ``Timer``, ``_thread.start_new_thread``, thread pools)."""

THREAD_EXCEPTIONS: dict[str, str] = {
    # Known thread starts outside the runtime, in files other work is rewriting now (issue 42); the
    # lead empties this list at merge. An entry that no longer matches fails too.
}


def thread_starts(path: Path) -> list[str]:
    """Every place in one file that makes a thread (or a Thread subclass), as ``file:line: what``."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Call):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in THREAD_MAKERS:
                found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {ast.unparse(node.func)}"))
        elif isinstance(node, ast.ClassDef):
            for base in node.bases:
                if (base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", None)) in ("Thread", "Timer"):
                    found.append((node.lineno, f"{_rel(path)}:{node.lineno}: class {node.name}({ast.unparse(base)})"))
    return [text for _, text in sorted(found)]


def test_every_thread_starts_through_the_runtime():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != RUNTIME for line in thread_starts(path)]
    new = [p for p in found if p not in THREAD_EXCEPTIONS]
    gone = [p for p in THREAD_EXCEPTIONS if p not in found]
    assert new == [] and gone == [], (
        "threads started around the runtime (use runtime().start_thread / start_timer, elastic_trainer/runtime.py):\n"
        + "\n".join(new) + ("\nno longer found, remove from THREAD_EXCEPTIONS:\n" + "\n".join(gone) if gone else ""))


# ------------------------------------------------------------------------------- thread names

STARTERS = {"start_thread", "_start_thread", "start_timer"}
NAMES_GIVEN_ELSEWHERE: dict[str, tuple[str, ...]] = {
    # a start whose name is a variable: where the name comes from
    "elastic_trainer/checkpoint/save_thread.py: self.name": ("checkpoint-save",),  # SaveThread("checkpoint-save")
    # the live group's default StartThread passes on its callers' names, each a literal checked where it is called
    "elastic_trainer/live/threads.py: name": (),
}


def thread_names(path: Path) -> list[str]:
    """The names of the threads one file starts through a runtime's ``start_thread``/``start_timer``
    (or a ``start_thread`` handed in): a literal as it is, an f-string up to its first field and ``*``."""
    names = []
    for node in ast.walk(_tree(path)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
        if func not in STARTERS:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            names.append(first.value)
        elif isinstance(first, ast.JoinedStr):
            names.append("".join(v.value if isinstance(v, ast.Constant) else "*" for v in first.values))
        else:
            key = f"{_rel(path)}: {ast.unparse(first)}"
            assert key in NAMES_GIVEN_ELSEWHERE, f"{key}: a thread named by a variable; say its names in NAMES_GIVEN_ELSEWHERE"
            names += NAMES_GIVEN_ELSEWHERE[key]
    return names


def test_every_thread_the_code_starts_is_in_the_architecture_thread_table():
    names = [n for path in sorted(PACKAGE.rglob("*.py")) if path != RUNTIME for n in thread_names(path)]
    assert len(names) > 15 and "checkpoint-save" in names and "etcd-watchdog *" in names
    assert unnamed(names) == [], "threads the code starts that docs/architecture.md's thread tables do not name"


def test_the_thread_checks_catch_a_bypass_and_an_unnamed_thread():
    probe = REPO / "tests" / "_architecture_probe_tmp.py"
    try:
        probe.write_text("import threading\nfrom threading import Timer\n"
                         "threading.Thread(target=print).start()\nTimer(1, print)\n"
                         "class T(threading.Thread):\n    pass\n"
                         "runtime().start_thread('no-such-thread', print)\nrt.start_timer(f'etcd-watchdog {k}', 1, f)\n")
        assert [line.split(":", 1)[1] for line in thread_starts(probe)] == [
            "3: threading.Thread", "4: Timer", "5: class T(threading.Thread)"]
        assert thread_names(probe) == ["no-such-thread", "etcd-watchdog *"]
        assert unnamed(thread_names(probe)) == ["no-such-thread"]
        assert unnamed(["Thread-12 (_run)", "etcd-watchdog /run/alive/n1", "Thread-3 (other)"]) == ["Thread-3 (other)"]
    finally:
        probe.unlink()


def test_the_thread_table_is_read_from_every_thread_table_of_the_doc():
    table = thread_table()
    assert {"MainThread", "live-watch", "etcd-lease-renewals", "etcd-watchdog <key>", "Thread-<n> (_run)"} <= set(table)


# ------------------------------------------------------------------------------- environment variables

ENVIRON_LIKE = re.compile(r"(^|\.)(environ|env)$")
"""What an environment is called where one is read or built: ``os.environ``, ``environ``, ``env``."""
OURS = re.compile(r"ELASTIC_TRAINER_[A-Z0-9_]+")


def _docstrings(tree: ast.Module) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    for node in ast.walk(tree):  # an attribute docstring: a string statement after an assignment
        body = getattr(node, "body", None)
        if isinstance(body, list):
            ids.update(id(s.value) for s in body if isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))
    return ids


def env_names_outside_env_py(path: Path) -> list[str]:
    """Every environment variable name one file spells itself (see the module docstring), ``file:line: what``."""
    tree = _tree(path)
    constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                 and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                 for t in node.targets if isinstance(t, ast.Name)}
    found: list[tuple[int, str]] = []

    def key(node: ast.expr | None, why: str) -> None:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {node.value!r} ({why})"))
        elif isinstance(node, ast.Name) and node.id in constants:
            found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {node.id} = {constants[node.id]!r} ({why}, "
                                       "a constant of this module)"))

    def environ_like(node: ast.expr) -> bool:
        return isinstance(node, (ast.Name, ast.Attribute)) and bool(ENVIRON_LIKE.search(ast.unparse(node)))

    def environment(node: ast.expr, why: str) -> None:  # a mapping that is, or becomes, an environment
        if isinstance(node, ast.Dict):
            for k in node.keys:
                key(k, why)
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "dict":
            for kw in node.keywords:
                if kw.arg is not None:
                    found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {kw.arg!r} ({why})"))
            for arg in node.args:
                environment(arg, why)

    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and environ_like(node.value):
            key(node.slice, "an environment's key")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and environ_like(func.value) and node.args:
                if func.attr in ("get", "pop", "setdefault", "__getitem__", "__contains__"):
                    key(node.args[0], f"{ast.unparse(func)}")
                elif func.attr == "update":
                    environment(node.args[0], f"{ast.unparse(func)}")
            if isinstance(func, ast.Attribute) and func.attr in ("getenv", "putenv", "unsetenv") and node.args:
                key(node.args[0], f"os.{func.attr}")
            if isinstance(func, ast.Attribute) and environ_like(func.value) and func.attr == "update":
                for kw in node.keywords:
                    found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {kw.arg!r} ({ast.unparse(func)})"))
            for kw in node.keywords:
                if kw.arg == "env":
                    environment(kw.value, "a process's environment")
            if getattr(func, "id", None) == "dict" and node.args and environ_like(node.args[0]):
                environment(node, "a copy of an environment")
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops) \
                and any(environ_like(c) for c in node.comparators):
            key(node.left, "in an environment")
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and ENVIRON_LIKE.search(t.id)
                                                  for t in node.targets):
            environment(node.value, "an environment")
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and OURS.fullmatch(node.value)
                and id(node) not in docstrings):
            found.append((node.lineno, f"{_rel(path)}:{node.lineno}: {node.value!r} (our variable's name)"))
    once: dict[str, str] = {}  # one line per name and line, whatever way it was seen first
    for _, text in sorted(found):
        once.setdefault(text.split(" (")[0], text)
    return list(once.values())


def test_every_environment_variable_name_is_defined_in_env_py():
    found = [line for path in sorted(PACKAGE.rglob("*.py")) if path != ENV for line in env_names_outside_env_py(path)]
    assert found == [], ("environment variable names spelled outside elastic_trainer/env.py (define them there, "
                         "as ENV_..., and use the constant):\n" + "\n".join(found))


def test_the_environment_check_catches_every_spelling():
    probe = REPO / "tests" / "_architecture_probe_tmp.py"
    try:
        probe.write_text(
            "import os, subprocess\nfrom elastic_trainer.env import ENV_LOG_DIR\nMINE = 'MY_VAR'\n"
            "os.environ['A_VAR']\nos.environ.get('B_VAR')\nos.environ.pop(MINE, None)\n"      # 4, 5, 6
            "os.getenv('C_VAR')\n'D_VAR' in os.environ\nenv = dict(os.environ, E_VAR='1')\n"  # 7, 8, 9
            "subprocess.run(['x'], env={'F_VAR': '1', ENV_LOG_DIR: 'ok'})\n"                   # 10
            "os.environ.update({'G_VAR': '1'})\nx = 'ELASTIC_TRAINER_H'\n"                     # 11, 12
            "os.environ[ENV_LOG_DIR]\nenviron.get(ENV_LOG_DIR)\n")                             # fine
        found = [line.split(":", 1)[1].split(" (")[0] for line in env_names_outside_env_py(probe)]
        assert found == ["4: 'A_VAR'", "5: 'B_VAR'", "6: MINE = 'MY_VAR'", "7: 'C_VAR'", "8: 'D_VAR'", "9: 'E_VAR'",
                         "10: 'F_VAR'", "11: 'G_VAR'", "12: 'ELASTIC_TRAINER_H'"], found
    finally:
        probe.unlink()
