"""One report per node for a live re-form, gathered through the node's directory.

Every survivor of a live re-form reports the step it completed (``report/<q>/<id>``,
``live/reform.py``), and the re-form's proposer follows the reports until every member is in. At
1,000 nodes of 8 workers that was 8,000 puts to etcd per loss, all at once, and the proposer took
8,000 report keys back. Where the workers of a node share a directory (the node's lease's,
``rendezvous/node_lease.py``: its one etcd watch lives there too, ``live/node_share.py``), they
send one:

- each worker writes its report to the directory (``report-<q>-<id>.json``, written whole and
  renamed into place: a file of the user's own 0700 directory, no request);
- the node's **reporter**, its first member in the old quorum's order, gathers them, and once
  every member of the node is in (they come out of the failed collective together: a few
  milliseconds) or ``GRACE`` passed, puts ``report/<q>/@<node>`` = ``{"members": {id: report}}``
  (one put), then writes ``report-<q>.done`` with the ids that put covered;
- any other worker puts its own ``report/<q>/<id>`` as before when the done file does not hold its
  id (the reporter gathered before it was in: at once), or there is none ``GRACE`` after it
  reported (the reporter is hung or killed).

A reader of the reports (``LiveKeys.read``, ``live/report_feed.py``) expands a node's report into its members' (``expand``),
so the proposer sees what it saw before; a member in both counts once. Nodes are kept or dropped
whole anyway, so a node's report loses nothing the proposer used. A single-worker node, or a
worker without a node directory, reports as before.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

GRACE = 0.5
"""Seconds after a worker reported to its node's directory before it puts its own report when the
node's report did not cover it (its node's reporter is gone, hung, or gathered before it was in)."""

NODE_MARK = "@"
"""A report key ``report/<q>/@<node>`` is a node's report (a member id never starts with it)."""


class NodeReport:
    """This worker's part in its node's report for the re-form into quorum ``target``.

    ``members`` are the ids of this worker's node in the old quorum, in its order (the first is the
    node's reporter)."""

    def __init__(self, directory: str, target: int, node: str, members: Sequence[str], me: str) -> None:
        self.dir, self.target, self.node, self.me = directory, target, node, me
        self.members = list(members)
        self.reporter = bool(self.members) and self.members[0] == me
        self.done = False
        """This worker's report is in etcd (in its node's, or its own)."""

    @property
    def key(self) -> str:
        """The node's report key under the live prefix."""
        return f"report/{self.target}/{NODE_MARK}{self.node}"

    def write(self, record: dict) -> None:
        """This worker's report, as a file of the node's directory (whole: written aside, renamed)."""
        path = self._path(f"report-{self.target}-{self.me}.json")
        tmp = f"{path}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(record).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def gathered(self) -> dict[str, dict]:
        """The reports of this node's members written so far (a malformed one is left out: that
        member puts its own)."""
        out = {}
        for mid in self.members:
            try:
                with open(self._path(f"report-{self.target}-{mid}.json"), "rb") as f:
                    record = json.loads(f.read())
            except (OSError, ValueError):
                continue
            if isinstance(record, dict):
                out[mid] = record
        return out

    def value(self, reports: dict[str, dict]) -> bytes:
        """What the node's report key holds for ``reports``."""
        return json.dumps({"members": reports}).encode()

    def mark(self, ids: Sequence[str]) -> None:
        """The reporter, once its put succeeded: the ids it covered (for the others to see), and
        the files of older re-forms removed."""
        self.done = True
        path = self._path(f"report-{self.target}.done")
        try:
            with open(f"{path}.tmp", "w") as f:
                json.dump(sorted(ids), f)
            os.replace(f"{path}.tmp", path)
        except OSError:  # the others put their own after the grace
            return
        with contextlib.suppress(OSError):
            for name in os.listdir(self.dir):
                if name.startswith("report-") and _target_of(name) < self.target:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.dir, name))

    def covered(self) -> bool | None:
        """Whether the node's report (put by its reporter) holds this worker's: None while it is
        not in (no done file yet), False when it went without it."""
        try:
            with open(self._path(f"report-{self.target}.done")) as f:
                self.done = self.me in json.load(f)
        except (OSError, ValueError, TypeError):
            return None
        return self.done

    def _path(self, name: str) -> str:
        return os.path.join(self.dir, name)


def _target_of(name: str) -> int:
    """The re-form a report file is for (``report-<q>-...`` or ``report-<q>.done``); -1 if none."""
    head = name[len("report-"):].split("-", 1)[0].split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def expand(reports: dict[str, dict]) -> dict[str, dict]:
    """Reports by member id: a node's report (key ``@<node>``) stands for each of its members'."""
    out: dict[str, dict] = {}
    for key, value in reports.items():
        if not key.startswith(NODE_MARK):
            out[key] = value
            continue
        members = value.get("members")
        if isinstance(members, dict):
            for mid, record in members.items():
                if isinstance(record, dict):
                    out.setdefault(str(mid), record)
    return out


__all__ = ["GRACE", "NODE_MARK", "NodeReport", "expand"]
