"""The trainer's logs, defined once: the step log, the events and the sample ledger.

The trainer (``training/trainer.py``) writes three kinds of JSON lines under its ``--log-dir``;
the drills, the benchmarks and the tests read them back. This module is the only place that
knows their keys and file names:

=====================================  ================  ====================================
file                                   record            written by
=====================================  ================  ====================================
``steps/rank-<r>-<pid>.jsonl``         :class:`StepRecord`    every rank, one line per step
``events.jsonl``                       :class:`EventRecord`   rank 0: start, resume, saves, stop
``ledger/rank-<r>-<pid>.jsonl``        :class:`LedgerRecord`  every rank, ``--sample-ledger``
=====================================  ================  ====================================

Each record is a dataclass with ``to_json()`` (the JSON object, keys in the order the trainer
has always written them, so old and new logs are the same) and ``from_json(obj)``, which is
strict about the keys a record cannot do without (:class:`RecordError`) and keeps unknown keys
in ``extra`` (a newer writer's additions survive a read and a write). Reading a log::

    from elastic_trainer import records

    for step in records.read_steps(log_dir, rank=0):
        print(step.step, step.loss, step.world_size)
    saves = [e for e in records.read_events(log_dir) if e.event == records.Event.CHECKPOINT_SAVED]

A line that is not JSON is skipped (a writer killed in the middle of its last line); a JSON
line without a required key is an error that names the file and the line.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterable, NamedTuple, TypeVar

STEPS_DIR = "steps"
LEDGER_DIR = "ledger"
EVENTS_FILE = "events.jsonl"
_WORKER_FILE = re.compile(r"^rank-(\d+)-(\d+)\.jsonl$")

R = TypeVar("R", bound="Record")


class RecordError(ValueError):
    """A log line that is JSON but not a valid record (a required key missing or of the wrong type)."""


# ------------------------------------------------------------------------------ records

def _always(default: Any = None) -> Any:
    """An optional key the trainer always writes (``null`` when it has no value)."""
    return field(default=default, metadata={"write": "always"})


def _if_set(default: Any = None) -> Any:
    """An optional key written only when it has a value."""
    return field(default=default, metadata={"write": "if_set"})


@dataclass(kw_only=True)
class Record:
    """Shared ``to_json``/``from_json``: a field without a default is a required key.

    Fields are the JSON keys, in the order they are written; ``extra`` holds the keys this
    version does not know; ``origin`` is not part of the JSON: a reader that knows where a
    record came from (the drill: its node's name) puts it there.
    """

    KIND: ClassVar[str] = "record"
    NUMBERS: ClassVar[tuple[str, ...]] = ()  # required keys that must hold a number

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    origin: str | None = field(default=None, compare=False, repr=False)

    @classmethod
    def _keys(cls) -> list[dataclasses.Field]:
        return [f for f in dataclasses.fields(cls) if f.name not in ("extra", "origin")]

    @classmethod
    def required(cls) -> list[str]:
        """The keys a line must have to be this record."""
        return [f.name for f in cls._keys()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    def _written(self, f: dataclasses.Field) -> bool:
        return f.metadata.get("write") != "if_set" or getattr(self, f.name) is not None

    def to_json(self) -> dict[str, Any]:
        """The JSON object of this record (what ``JsonLines`` writes as one line)."""
        out = {f.name: getattr(self, f.name) for f in self._keys() if self._written(f)}
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out

    @classmethod
    def from_json(cls: type[R], obj: dict[str, Any], *, origin: str | None = None) -> R:
        """The record of one JSON object; unknown keys go to ``extra``; a missing required key raises."""
        if not isinstance(obj, dict):
            raise RecordError(f"a {cls.KIND} record is a JSON object, got {type(obj).__name__}")
        missing = [k for k in cls.required() if k not in obj]
        if missing:
            raise RecordError(f"a {cls.KIND} record needs the key(s) {', '.join(missing)}; "
                              f"this one has only {', '.join(obj) or 'none'}")
        for key in cls.NUMBERS:
            if isinstance(obj[key], bool) or not isinstance(obj[key], (int, float)):
                raise RecordError(f"a {cls.KIND} record's {key!r} must be a number, got {obj[key]!r}")
        known = {f.name for f in cls._keys()}
        return cls(**{k: v for k, v in obj.items() if k in known},
                   extra={k: v for k, v in obj.items() if k not in known}, origin=origin)


@dataclass(kw_only=True)
class StepRecord(Record):
    """One optimizer step as one rank saw it (``steps/rank-<r>-<pid>.jsonl``, every rank).

    ``loss`` is the global batch's mean loss; after a failed collective the steps whose loss
    was never agreed are logged with this rank's own loss and ``loss_scope="rank"``.
    """

    KIND: ClassVar[str] = "step"
    NUMBERS: ClassVar[tuple[str, ...]] = ("time", "step")

    time: float  # unix time at the end of the step
    step: int  # the global step just completed (1 is the first)
    epoch: int | None = _always()
    offset: int | None = _always()  # samples of the epoch committed after this step
    world_size: int | None = _always()
    rank: int | None = _always()
    round: int | None = _always()  # the rendezvous round (None without the etcd-v3 rendezvous)
    restart: int | None = _always()  # torchrun's restart count
    loss: float | None = _always()
    loss_scope: str | None = _if_set()  # "rank" when ``loss`` is this rank's only
    node: str | None = _always()  # the host name


class Event(enum.StrEnum):
    """The names of the trainer's events (``events.jsonl``, rank 0)."""

    START = "start"  # a run starts without a checkpoint
    CHECKPOINT_LOADED = "checkpoint_loaded"  # a checkpoint was loaded
    RESUME = "resume"  # training goes on from it
    PEER_STATE_LOADED = "peer_state_loaded"  # live recovery: a newcomer got the state from a live rank
    WORLD_SIZE_CHANGED = "world_size_changed"  # ... at another world size than it was saved at
    CHECKPOINT_SAVED = "checkpoint_saved"  # a save finished (blocking) or started (async)
    CHECKPOINT_SAVE_START = "checkpoint_save_start"  # not written by our trainer; a --script may
    LIVE_REFORM = "live_reform"  # live recovery: the group was re-formed in place
    LIVE_EXCLUDED = "live_excluded"  # live recovery: this rank was left out of the new quorum
    STRAGGLERS = "stragglers"  # the ranks named slow changed, or a node is evicted (training/straggler_watch.py)
    STOP = "stop"  # the ranks agreed to stop (signal, a peer stopped, --max-seconds)
    FINISHED = "finished"  # the last step is done and saved
    STOPPED = "stopped"  # stopped before the last step, after its final save


# Each event's keys after "time" and "event", in the order the trainer writes them.
EVENT_KEYS: dict[Event, tuple[str, ...]] = {
    Event.START: ("world_size", "restart", "round"),
    Event.CHECKPOINT_LOADED: ("step", "epoch", "offset", "world_size", "saved_world_size"),
    Event.RESUME: ("step", "world_size", "restart", "round"),
    Event.PEER_STATE_LOADED: ("step", "epoch", "offset", "world_size", "source", "seconds", "round"),
    Event.WORLD_SIZE_CHANGED: ("old", "new", "step"),
    Event.CHECKPOINT_SAVED: ("step", "blocked_s", "blocking", "committed", "epoch", "offset", "world_size"),
    Event.CHECKPOINT_SAVE_START: ("step",),
    Event.LIVE_REFORM: ("step", "old", "new", "round", "old_round", "cause", "failed_at", "receivers",
                        "teardown_s", "agree_s", "group_s", "state_s", "total_s"),
    Event.LIVE_EXCLUDED: ("step", "reason"),
    Event.STRAGGLERS: ("step", "named", "scores", "evict", "reason"),
    Event.STOP: ("step", "reason"),
    Event.FINISHED: ("step", "reason"),
    Event.STOPPED: ("step", "reason"),
}
# A checkpoint save has started (the drill's kill-during-checkpoint waits for one).
CHECKPOINT_START_EVENTS = (Event.CHECKPOINT_SAVED, Event.CHECKPOINT_SAVE_START)


@dataclass(kw_only=True)
class EventRecord(Record):
    """Something that happened to the run (``events.jsonl``, rank 0); ``event`` says what.

    Every field but ``time`` and ``event`` is optional: each event writes the keys that
    :data:`EVENT_KEYS` lists for it (``null`` when unset); an event name this version does not
    know (a newer trainer's) is kept as a plain string and writes the keys that are set.
    """

    KIND: ClassVar[str] = "event"
    NUMBERS: ClassVar[tuple[str, ...]] = ("time",)

    time: float
    event: str  # an ``Event`` when known
    step: int | None = None
    epoch: int | None = None
    offset: int | None = None
    world_size: int | None = None
    saved_world_size: int | None = None  # checkpoint_loaded: the world size it was saved at
    restart: int | None = None
    round: int | None = None
    old: int | None = None  # world_size_changed
    new: int | None = None
    reason: str | None = None  # stop, finished, stopped: "done", "signal SIGTERM", ...
    blocked_s: float | None = None  # checkpoint_saved: seconds the training loop waited
    blocking: bool | None = None
    committed: bool | None = None
    source: int | None = None  # peer_state_loaded: the live rank that sent the state
    seconds: float | None = None  # peer_state_loaded: how long it took
    old_round: int | None = None  # live_reform: the quorum before, and why it changed
    cause: str | None = None
    failed_at: float | None = None
    receivers: list[int] | None = None  # live_reform: the ranks that got the state
    teardown_s: float | None = None  # live_reform: the phases' seconds
    agree_s: float | None = None
    group_s: float | None = None
    state_s: float | None = None
    total_s: float | None = None
    ahead: bool | None = None  # live_reform: a join whose group formed beside the old one (group_ahead.py; newer lines)
    late: bool | None = None  # live_reform: a join whose bulk came while its first step ran (Reform.late; newer lines)
    named: list[int] | None = None  # stragglers: the ranks named slow, each rank's score, the nodes evicted
    scores: list[float] | None = None
    evict: list[str] | None = None

    def __post_init__(self) -> None:
        try:
            self.event = Event(self.event)
        except ValueError:
            pass  # a newer writer's event: kept as it is

    def to_json(self) -> dict[str, Any]:
        """``time``, ``event``, the event's :data:`EVENT_KEYS`, then any other key that is set."""
        keys = EVENT_KEYS.get(self.event, ())  # type: ignore[call-overload]
        out: dict[str, Any] = {"time": self.time, "event": str(self.event)}
        out.update((k, getattr(self, k)) for k in keys)
        out.update((f.name, getattr(self, f.name)) for f in self._keys()
                   if f.name not in out and getattr(self, f.name) is not None)
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        return out


@dataclass(kw_only=True)
class LedgerRecord(Record):
    """The dataset indices one rank consumed at one step (``ledger/rank-<r>-<pid>.jsonl``); for a streamed
    source, the stable sample ids of ``stream.order``."""

    KIND: ClassVar[str] = "ledger"
    NUMBERS: ClassVar[tuple[str, ...]] = ("step",)

    step: int
    epoch: int
    round: int | None = _always()
    indices: list[int]


# ------------------------------------------------------------------------------ files

class WorkerFile(NamedTuple):
    """A per-process log file: ``rank-<rank>-<pid>.jsonl``."""

    rank: int
    pid: int
    path: Path


def worker_file_name(rank: int, pid: int) -> str:
    return f"rank-{rank}-{pid}.jsonl"


def steps_path(log_dir: str | Path, rank: int, pid: int) -> Path:
    """Where the worker ``pid`` of ``rank`` writes its step log."""
    return Path(log_dir) / STEPS_DIR / worker_file_name(rank, pid)


def ledger_path(log_dir: str | Path, rank: int, pid: int) -> Path:
    """Where the worker ``pid`` of ``rank`` writes its sample ledger."""
    return Path(log_dir) / LEDGER_DIR / worker_file_name(rank, pid)


def events_path(log_dir: str | Path) -> Path:
    """Where rank 0 writes the events."""
    return Path(log_dir) / EVENTS_FILE


def _worker_files(folder: Path, rank: int | None) -> list[WorkerFile]:
    found = []
    for path in sorted(folder.glob(f"rank-{'*' if rank is None else rank}-*.jsonl")):
        match = _WORKER_FILE.match(path.name)
        if match and (rank is None or int(match.group(1)) == rank):
            found.append(WorkerFile(int(match.group(1)), int(match.group(2)), path))
    return found


def step_files(log_dir: str | Path, rank: int | None = None) -> list[WorkerFile]:
    """The step logs under ``log_dir`` (of one rank, if given), sorted by file name."""
    return _worker_files(Path(log_dir) / STEPS_DIR, rank)


def ledger_files(log_dir: str | Path, rank: int | None = None) -> list[WorkerFile]:
    """The sample ledgers under ``log_dir`` (of one rank, if given), sorted by file name."""
    return _worker_files(Path(log_dir) / LEDGER_DIR, rank)


# ------------------------------------------------------------------------------ reading

def parse_line(line: str | bytes, cls: type[R], where: str, *, origin: str | None = None) -> R | None:
    """One log line as a ``cls`` record; None for a blank or torn (not JSON) line.

    ``where`` (``file:line``) goes into the error of a line that is JSON but not a record.
    """
    text = line.decode(errors="replace") if isinstance(line, bytes) else line
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None  # a writer killed in the middle of its line
    try:
        return cls.from_json(obj, origin=origin)
    except RecordError as exc:
        raise RecordError(f"{where}: {exc}") from None


def read_file(path: str | Path, cls: type[R], *, origin: str | None = None) -> list[R]:
    """The records of one .jsonl file (none if it does not exist); see :func:`parse_line`."""
    path = Path(path)
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return []
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        record = parse_line(line, cls, f"{path}:{number}", origin=origin)
        if record is not None:
            out.append(record)
    return out


def _read_all(files: Iterable[WorkerFile], cls: type[R], origin: str | None) -> list[R]:
    return [r for f in files for r in read_file(f.path, cls, origin=origin)]


def read_steps(log_dir: str | Path, rank: int | None = None, *, origin: str | None = None) -> list[StepRecord]:
    """Every step line under ``log_dir`` (of one rank, if given), file by file in name order."""
    return _read_all(step_files(log_dir, rank), StepRecord, origin)


def read_ledger(log_dir: str | Path, rank: int | None = None, *, origin: str | None = None) -> list[LedgerRecord]:
    """Every ledger line under ``log_dir`` (of one rank, if given), file by file in name order."""
    return _read_all(ledger_files(log_dir, rank), LedgerRecord, origin)


def read_events(log_dir: str | Path, *, origin: str | None = None) -> list[EventRecord]:
    """Rank 0's events under ``log_dir``, in the order written."""
    return read_file(events_path(log_dir), EventRecord, origin=origin)


# ------------------------------------------------------------------------------ writing

def _dumps(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


class JsonLines:
    """Append-only JSON lines, flushed per line (the drills read them while training runs).

    ``JsonLines(None)`` writes nothing (a log that is off, or events on ranks other than 0).
    """

    def __init__(self, path: Path | None) -> None:
        self.file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, record: Record) -> None:
        if self.file is not None:
            self.file.write(_dumps(record.to_json()) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
