"""A drill's logs, read back: worker processes, worlds (attempts) and the final lineage.

A drill (``elastic_trainer.drill``) leaves one log folder per node (``<out>/nodes/node-<i>/``,
the node's ``--log-dir``) holding the trainer's step logs and sample ledger (one file per worker
process), rank 0's events (all three are ``elastic_trainer.records``) and the agent's
``agent.log``. :func:`load_logs` reads them into :class:`RunLogs`; each record's ``origin`` is
the name of the node whose folder held it:

* An **attempt** is one world: the workers of one rendezvous round (the step logs' ``round``;
  without rounds, the workers whose steps overlap a rank-0 worker's). Attempts are ordered by
  their first step.
* The **final lineage** (:func:`final_lineage`) says, for every optimizer step ``1..final``, which
  attempt's work the final model contains: the last attempt's steps, then the steps up to the one
  it resumed from taken from the latest earlier attempt that reached that step, and so on back to
  step 1. ``drill_ledger`` judges exactly-once over it.
"""

from __future__ import annotations

import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from elastic_trainer import records
from elastic_trainer.records import EventRecord, LedgerRecord, StepRecord

# Agent log lines: python logging "[2026-11-23 07:38:53,081] ..." and torch's "W1123 07:38:53.109000 pid file] ...".
_PY_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})\] (.*)$")
_TORCH_LINE = re.compile(r"^\[?[IWEF](\d\d)(\d\d) (\d\d:\d\d:\d\d\.\d+) +\d+ (.*)$")


@dataclass
class Worker:
    """One worker process: its step-log lines and its ledger lines."""

    node: str
    rank: int
    pid: int
    steps: list[StepRecord] = field(default_factory=list)
    ledger: list[LedgerRecord] = field(default_factory=list)


@dataclass
class Attempt:
    """One world: the workers of one rendezvous round."""

    key: str
    workers: list[Worker] = field(default_factory=list)

    @property
    def lines(self) -> list[StepRecord]:
        return sorted((s for w in self.workers for s in w.steps), key=lambda s: s.time)

    @property
    def rank0(self) -> list[StepRecord]:
        return [s for s in self.lines if s.rank == 0]

    @property
    def start(self) -> float:
        return min(s.time for w in self.workers for s in w.steps)

    @property
    def end(self) -> float:
        return max(s.time for w in self.workers for s in w.steps)

    @property
    def first_step(self) -> int:
        return min(s.step for w in self.workers for s in w.steps)

    @property
    def last_step(self) -> int:
        return max(s.step for w in self.workers for s in w.steps)

    @property
    def world_size(self) -> int:
        return Counter(s.world_size for w in self.workers for s in w.steps).most_common(1)[0][0]

    @property
    def nodes(self) -> list[str]:
        return sorted({w.node for w in self.workers})

    def complete_last_step(self) -> int:
        """The newest step every rank of this world logged (the killed end may be torn)."""
        ranks: dict[int, int] = {}
        for w in self.workers:
            if w.steps:
                ranks[w.rank] = max(ranks.get(w.rank, 0), max(s.step for s in w.steps))
        return min(ranks.values()) if ranks else 0


def read_agent_log(path: Path) -> list[dict]:
    """Timestamped lines of a node's agent log: ``{"time", "text"}`` (local-time stamps)."""
    out = []
    try:
        text = path.read_text(errors="replace")
        year = time.localtime(path.stat().st_mtime).tm_year
    except FileNotFoundError:
        return out
    for raw in text.replace("\r", "\n").splitlines():
        line = raw.strip()
        m = _PY_LINE.match(line)
        try:
            if m:
                stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1000
                out.append({"time": stamp, "text": m.group(3)})
                continue
            m = _TORCH_LINE.match(line)
            if m:
                hms, frac = m.group(3).split(".")
                stamp = datetime.strptime(f"{year}-{m.group(1)}-{m.group(2)} {hms}", "%Y-%m-%d %H:%M:%S").timestamp()
                out.append({"time": stamp + float("0." + frac), "text": m.group(4)})
        except ValueError:
            continue
    return out


@dataclass
class RunLogs:
    workers: list[Worker]
    events: list[EventRecord]
    attempts: list[Attempt]
    agent: dict[str, list[dict]] = field(default_factory=dict)

    @property
    def rank0_lines(self) -> list[StepRecord]:
        return sorted((s for w in self.workers if w.rank == 0 for s in w.steps), key=lambda s: s.time)

    def attempt_of(self, line: StepRecord) -> Attempt | None:
        if not hasattr(self, "_index"):
            self._index = {id(s): a for a in self.attempts for w in a.workers for s in w.steps}
        return self._index.get(id(line))


def load_logs(node_dirs: dict[str, Path]) -> RunLogs:
    """Read every node's step logs, ledger and events (``{node name: its log dir}``)."""
    workers: dict[tuple[str, int, int], Worker] = {}
    events: list[EventRecord] = []
    for node, root in sorted(node_dirs.items()):
        for attr, files, kind in (("steps", records.step_files(root), StepRecord),
                                  ("ledger", records.ledger_files(root), LedgerRecord)):
            for f in files:
                worker = workers.setdefault((node, f.rank, f.pid), Worker(node, f.rank, f.pid))
                getattr(worker, attr).extend(records.read_file(f.path, kind, origin=node))
        events.extend(records.read_events(root, origin=node))
    events.sort(key=lambda e: e.time)
    agent = {node: read_agent_log(Path(root) / "agent.log") for node, root in node_dirs.items()}
    split = [part for w in workers.values() for part in split_by_round(w)]
    return RunLogs(split, events, group_attempts(split), agent)


def split_by_round(worker: Worker) -> list[Worker]:
    """One ``Worker`` per round that this process trained in, with its rank in that round.

    Under live recovery a worker process outlives its world: it trains in one round, re-forms the
    group in place and goes on in the next one, maybe at another rank. Each (process, round) is
    one member of one world, exactly like a process of the restart path."""
    rounds = {s.round for s in worker.steps} | {l.round for l in worker.ledger}
    if len(rounds) <= 1:
        return [worker]
    parts = []
    for rnd in sorted(rounds, key=lambda r: (r is None, r)):
        steps = [s for s in worker.steps if s.round == rnd]
        ledger = [l for l in worker.ledger if l.round == rnd]
        rank = steps[0].rank if steps else worker.rank
        parts.append(Worker(worker.node, rank, worker.pid, steps, ledger))
    return parts


def group_attempts(workers: list[Worker]) -> list[Attempt]:
    """Group worker processes into worlds: by round when logged, else by overlap with rank 0."""
    attempts: dict[str, Attempt] = {}
    loose = []
    for w in workers:
        if not w.steps:
            continue
        rnd = w.steps[0].round
        if rnd not in (None, ""):
            attempts.setdefault(f"round-{rnd}", Attempt(f"round-{rnd}")).workers.append(w)
        elif w.rank == 0:
            attempts.setdefault(f"{w.node}:{w.pid}", Attempt(f"{w.node}:{w.pid}")).workers.append(w)
        else:
            loose.append(w)
    for w in loose:  # no round logged: join the rank-0 world that overlaps this worker most
        start, end = min(s.time for s in w.steps), max(s.time for s in w.steps)
        best, best_overlap = None, -1.0
        for a in attempts.values():
            overlap = min(end, a.end) - max(start, a.start)
            if a.world_size == w.steps[0].world_size and overlap > best_overlap:
                best, best_overlap = a, overlap
        if best is not None:
            best.workers.append(w)
    return sorted(attempts.values(), key=lambda a: a.start)


def final_lineage(attempts: list[Attempt]) -> tuple[dict[int, Attempt], list[int], int]:
    """Map each step of the final model's history to the attempt that did it.

    Returns ``(step -> attempt, steps no attempt covers, final step)``.
    """
    if not attempts:
        return {}, [], 0
    lineage: dict[int, Attempt] = {}
    missing: list[int] = []
    current = attempts[-1]
    final = current.complete_last_step()
    top = final
    while True:
        first = current.first_step
        for step in range(max(first, 1), top + 1):
            lineage[step] = current
        resumed = first - 1
        if resumed <= 0:
            break
        earlier = [a for a in attempts if a.start < current.start and a.first_step <= resumed <= a.last_step]
        if not earlier:
            missing.extend(range(1, resumed + 1))
            break
        current, top = earlier[-1], resumed
    return lineage, sorted(missing), final
