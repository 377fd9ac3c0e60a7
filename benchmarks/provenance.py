"""Where a result came from: the date, the commit, the machine and the command, at the top of every results file.

Every benchmark that writes results (``benchmarks/results/<name>.txt`` and ``<name>.json``) goes through
this module, so that each number the docs quote can be traced to the run behind it::

    p = argparse.ArgumentParser(...)
    provenance.add_arguments(p)                      # --txt PATH
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:         # date, commit, CPUs, load now; keeps what is printed
        ...                                          # the benchmark, printing as before
        provenance.write_json(args.json, result, run)   # {"commit", "date", "machine", "command", ...result}
    # on leaving the block: --txt holds the header line, then everything the script printed

The text file's first line (``load``: the 1-minute load average at the start and when the file was written)::

    # commit 3e2d128 date 2026-11-25T14:19Z cores 2 load 0.41/0.62 command: python benchmarks/overhead.py --repeats 15

The JSON file starts with the same facts as keys: ``"commit"``, ``"date"``, ``"machine"`` (``cores``,
``load_start``, ``load_end``: the 1/5/15-minute load averages) and ``"command"``.

The commit is ``$GIT_COMMIT`` when it is set (a copy of the tree without ``.git``, as ``launch/gpu-check``
runs one), else ``git rev-parse --short HEAD`` of this tree, with ``+dirty`` when the code (``elastic_trainer/``,
``benchmarks/*.py``) differs from it, else ``unknown``. ``cores`` is what this process may use (its CPU
affinity capped by the cgroup's quota, ``elastic_trainer.cpus``).

Results written before this module existed got their header afterwards, from git history
(``header_added_afterwards`` says so, and from where); ``tests/test_docs.py`` checks that every file in
``benchmarks/results/`` has a header.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

HEADER_RE = re.compile(r"^# commit (?P<commit>\S+) date (?P<date>\S+) cores (?P<cores>\S+) "
                       r"load (?P<load>\S+) (?:(?P<afterwards>header added afterwards: .*?) )?command: (?P<command>.+)$")
"""The first line of a results text file; ``afterwards`` only in a header added from git history."""

JSON_KEYS = ("commit", "date", "machine", "command")
"""The first keys of a results JSON file."""


def commit() -> str:
    """The code's commit: ``$GIT_COMMIT``, else git's short hash (``+dirty`` with uncommitted code), else unknown."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", "elastic_trainer", "benchmarks/*.py"],
                               cwd=REPO, capture_output=True, timeout=10).returncode != 0
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def cores() -> int:
    """CPUs this process may keep busy (affinity, capped by the cgroup's quota)."""
    from elastic_trainer.cpus import available_cpus

    return available_cpus()


def _load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class _Tee(io.TextIOBase):
    """stdout that also keeps what is written to it."""

    def __init__(self, out) -> None:
        self.out, self.kept = out, io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()


@dataclass
class Run:
    """One benchmark run's facts, taken when it starts (the load at the end: when a file is written)."""

    commit: str
    date: str  # UTC, ISO 8601 to the second
    cores: int
    load_start: list[float]
    command: str
    printed: _Tee | None = field(default=None, repr=False)

    @classmethod
    def now(cls, argv: list[str] | None = None) -> "Run":
        argv = sys.argv if argv is None else argv
        return cls(commit=commit(), date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                   cores=cores(), load_start=_load(), command=shlex.join([Path(sys.executable).name, *argv]))

    def header(self) -> dict[str, Any]:
        """The keys a results JSON starts with."""
        return {"commit": self.commit, "date": self.date,
                "machine": {"cores": self.cores, "load_start": self.load_start, "load_end": _load()},
                "command": self.command}

    def header_line(self) -> str:
        """The first line of a results text file."""
        return (f"# commit {self.commit} date {self.date[:16]}Z cores {self.cores} "
                f"load {self.load_start[0]:.2f}/{_load()[0]:.2f} command: {self.command}")


def stamp(result: dict[str, Any], run: Run) -> dict[str, Any]:
    """``result`` with the run's header keys first (they replace keys of the same name)."""
    header = run.header()
    return {**header, **{k: v for k, v in result.items() if k not in header}}


def write_json(path: str | os.PathLike | None, result: dict[str, Any], run: Run, *, indent: int = 2) -> None:
    """Write ``result`` as JSON to ``path`` (nothing when None), the run's header keys first."""
    if path is None:
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(stamp(result, run), indent=indent) + "\n")


def byte_compile() -> str:
    """Compile our package to bytecode (its ``__pycache__`` folders, which git ignores) before a
    benchmark times processes that start: ``pip install`` leaves an installed package so, but this
    tree is installed editable, and where ``PYTHONDONTWRITEBYTECODE`` is set (our development
    machines) every process would compile each of our modules it imports, every time: 0.16 s instead
    of 0.08 s for the modules a worker's fork server imports (2026-12-04), on a newcomer's way to its
    first step. Returns the line a benchmark prints about it."""
    import compileall

    ok = compileall.compile_dir(str(REPO / "elastic_trainer"), quiet=1)
    return ("our modules byte-compiled first, as an install leaves them (benchmarks/provenance.py byte_compile)"
            if ok else "our modules could not all be byte-compiled: those start from source (slower)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--txt PATH``: the printed results, after the header line (what ``benchmarks/run_all`` keeps)."""
    parser.add_argument("--txt", metavar="PATH", default=None,
                        help="also write what this prints to PATH, after a first line with the commit, date, cores, "
                             "load and command")


@contextlib.contextmanager
def record(txt: str | os.PathLike | None, argv: list[str] | None = None) -> Iterator[Run]:
    """Take the run's facts; keep what is printed inside the block and write it to ``txt`` (if given)
    after the header line when the block ends, also when it fails (then with a last ``# failed`` line)."""
    run = Run.now(argv)
    if txt is None:
        yield run
        return
    saved = sys.stdout
    run.printed = sys.stdout = _Tee(saved)
    failed = None
    try:
        yield run
    except BaseException as exc:
        failed = exc
        raise
    finally:
        sys.stdout = saved
        body = run.printed.kept.getvalue()
        tail = f"# failed: {type(failed).__name__}: {failed}\n" if failed is not None else ""
        Path(txt).parent.mkdir(parents=True, exist_ok=True)
        Path(txt).write_text(run.header_line() + "\n" + body + ("" if body.endswith("\n") or not body else "\n") + tail)
