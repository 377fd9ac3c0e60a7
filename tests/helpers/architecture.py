"""docs/architecture.md's thread tables, read as the tests compare them with the code and with a
running worker.

    table = thread_table()                  # ["MainThread", "live-watch", "etcd-watchdog <key>", ...]
    assert unnamed(["live-watch", "etcd-watchdog /r/alive/n"], table) == []

A table is one whose header's first cell is ``thread``; its first column lists names in backticks,
several to a row. A ``<placeholder>`` in a name (``etcd-watchdog <key>``, ``Thread-<n> (_run)``)
stands for any text; so does ``*`` in a name given to :func:`unnamed` (a name the code makes with
an f-string, ``f"etcd-watchdog {key}"``, is ``etcd-watchdog *``).
"""

from __future__ import annotations

import re

from tests.helpers.common import REPO

ARCHITECTURE = REPO / "docs" / "architecture.md"


def thread_table(text: str | None = None) -> list[str]:
    """Every thread name the thread tables of ``text`` (default: docs/architecture.md) give, as written."""
    text = ARCHITECTURE.read_text() if text is None else text
    names: list[str] = []
    in_table = False
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else None
        if cells is None:
            in_table = False
        elif cells[0] == "thread":
            in_table = True
        elif in_table and not set(cells[0]) <= set("-: "):
            names += re.findall(r"`([^`]+)`", cells[0])
    return names


def _pattern(entry: str) -> re.Pattern:
    return re.compile("".join(".+" if re.fullmatch(r"<[^>]*>", part) else re.escape(part)
                              for part in re.split(r"(<[^>]*>)", entry)))


def unnamed(names, table: list[str] | None = None) -> list[str]:
    """The names (sorted, once each) that no entry of the table matches."""
    patterns = [_pattern(entry) for entry in (thread_table() if table is None else table)]
    return sorted({n for n in names if not any(p.fullmatch(n.replace("*", "x")) for p in patterns)})
