"""What a node runs, and the check that every node of a run runs the same: the joiner check.

A node that joins a run with another program breaks it: pasted without its script, a join command
started the built-in trainer into a user's live run, the newcomer received the script's state and
died, the healthy worker went down with it, and the two crash-looped (DDP found 4 parameters on one
rank and 68 on the other) until the run fell back to a checkpoint. So every node of a run records
what it runs, and a node that differs is refused before it touches the run.

What a node runs (``Program``): the launcher (``cli/join.py``) builds it from its flags and hands it
to the etcd-v3 handler as JSON in ``ENV_PROGRAM``:

- ``entry``: ``the script train.py`` (as given), ``the module pkg.train`` or ``the built-in trainer``;
- ``digest``: a hash of the program's own files: the script and the local modules it imports
  (``training/uses_manager.py``), each by its path relative to the script's folder and its
  content; so the same program in two checkouts matches, and an edited copy does not. For the
  built-in trainer, elastic_trainer's version;
- ``args``: a script's arguments, all of them (they are its own, and torchrun runs the same command
  on every node; node-specific settings belong in the environment);
- ``settings``: the built-in trainer's flags that every node must share (the model and task, the
  global and micro batch, the optimizer, the stop, the checkpoints' cadence, the parallelism):
  every ``TrainConfig`` flag but the node-local ones (``NODE_LOCAL`` in ``cli/join.py``);
- ``recovery``: live or restart (a restart-path node in a live run, or the reverse, cannot work).

The record and the check (``handler.py``): each node keeps ``<prefix>program/<node>`` on its node
lease, written with its alive key, so the records are exactly those of the run's live nodes (a
run that ended leaves none behind: a new run of the same id may run anything). At its first
rendezvous, before it writes anything into the run (its alive and joining keys, its workers), a
node reads the records and, when one differs, raises ``ProgramMismatch``: one sentence that names
the first difference. The running nodes see nothing of it: they train on with the same processes.
(Two nodes of different programs that both start a new run within the same few milliseconds are
not told apart: neither is in a healthy run yet.)
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, field

from torch.distributed.elastic.rendezvous.api import RendezvousError


class ProgramMismatch(RendezvousError):
    """This node runs another program than the live nodes of its run: it must not join."""


@dataclass(frozen=True)
class Program:
    """What one node runs (see the module docstring)."""

    entry: str
    """``the script PATH``, ``the module NAME`` or ``the built-in trainer``."""
    digest: str
    """A hash of the program's own files (the built-in trainer: ``elastic_trainer <version>``)."""
    args: tuple[str, ...] = ()
    """A script's arguments (the built-in trainer's are compared as ``settings``)."""
    settings: dict[str, str] = field(default_factory=dict)
    """The built-in trainer's shared flags, by flag name (``--global-batch-size``), as text."""
    recovery: str = "restart"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Program:
        """Parse a record; a record this version cannot read is a ``ValueError``."""
        try:
            values = json.loads(text)
            return cls(entry=str(values["entry"]), digest=str(values["digest"]),
                       args=tuple(str(a) for a in values.get("args", ())),
                       settings={str(k): str(v) for k, v in values.get("settings", {}).items()},
                       recovery=str(values.get("recovery", "restart")))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{text[:200]!r} is not a program record of elastic-train's") from exc

    def difference(self, run: Program) -> str | None:
        """The first way this node's program differs from ``run`` (a live node's), as words ending in
        "here, ... in the run"; None when they are the same."""
        if self.entry != run.entry:
            return f"{self.entry} here, {run.entry} in the run"
        if self.digest != run.digest:
            return (f"{self.entry}'s code differs ({self.digest[:12]} here, {run.digest[:12]} in the run: "
                    f"the program and the modules of its own that it imports must be the same files)")
        if self.recovery != run.recovery:
            return f"--recovery {self.recovery} here, --recovery {run.recovery} in the run"
        for flag in sorted(set(self.settings) | set(run.settings)):
            mine, theirs = self.settings.get(flag, "(not a flag)"), run.settings.get(flag, "(not a flag)")
            if mine != theirs:
                return f"{flag} {mine} here, {flag} {theirs} in the run"
        if self.args != run.args:
            return (f"the arguments {shlex.join(self.args) or '(none)'!r} here, "
                    f"{shlex.join(run.args) or '(none)'!r} in the run")
        return None


def check(mine: Program, records: dict[str, bytes], run_id: str) -> None:
    """Raise ``ProgramMismatch`` when a live node's record (``records``: node name -> its JSON)
    differs from ``mine``; a record this version cannot read counts as a difference."""
    for node, record in sorted(records.items()):
        try:
            why = mine.difference(Program.from_json(record))
        except ValueError:
            why = "a record this version of elastic-train cannot read in the run (another version)"
        if why is not None:
            raise ProgramMismatch(
                f"this node runs another program than run '{run_id}' (node {node}): {why}; it does not join. "
                f"Start it with the same program, arguments and trainer flags as the run's nodes (the join command "
                f"the first node printed), or give it another --run-id")


__all__ = ["Program", "ProgramMismatch", "check"]
