"""A drill's faults, applied one at a time, and when each counts as recovered.

:class:`FaultDriver` fires a :class:`~elastic_trainer.drill.scenario.Fault` on a
:class:`~elastic_trainer.drill.cluster.Cluster` through its kind's entry in
:data:`~elastic_trainer.drill.kinds.FAULTS` (SIGKILL, SIGSTOP, SIGTERM or cut a node, add a
node, hang a worker, restart etcd, corrupt the newest checkpoint, fill the checkpoint disk), ends the faults that
last ``for:SECONDS`` (the entry's ``heal``), and decides when the run has recovered: :data:`SETTLE_STEPS` steps of one
world at the expected size since the fault (or its end). Each fault leaves a record (a dict: what
fired, when, on which node, the world expected after it, the outcome) that ``drill_report``
measures afterwards.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from elastic_trainer.drill import report as drill_report
from elastic_trainer.drill.cluster import POLL, Cluster
from elastic_trainer.drill.kinds import FAULTS, ranks
from elastic_trainer.drill.scenario import Fault

SETTLE_STEPS = 3  # steps of one world at the expected size that make a fault recovered


class DirWatch:
    """inotify on one folder: the names created in it, the moment they are created."""

    _IN_CREATE, _IN_MOVED_TO = 0x100, 0x80

    def __init__(self, path: Path) -> None:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), self._IN_CREATE | self._IN_MOVED_TO) < 0:
            err = ctypes.get_errno()
            if self.fd >= 0:
                os.close(self.fd)
            raise OSError(err, f"inotify on {path} failed: {os.strerror(err)}")

    def read(self, timeout: float = 0.0) -> list[str]:
        """Names created since the last call, waiting up to ``timeout`` seconds for one."""
        import select
        import struct
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        names, pos = [], 0
        while pos + 16 <= len(data):
            _wd, _mask, _cookie, size = struct.unpack_from("iIII", data, pos)
            names.append(data[pos + 16:pos + 16 + size].rstrip(b"\0").decode(errors="replace"))
            pos += 16 + size
        return names

    def close(self) -> None:
        os.close(self.fd)


class FaultDriver:
    """Fires a drill's faults on its cluster, ends them, and tells when the run has recovered."""

    def __init__(self, cluster: Cluster, args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.args = args
        self._watch: DirWatch | None = None

    def fire(self, fault: Fault, index: int) -> dict:
        """Apply one fault now (its ``FAULTS`` entry's ``fire``); return its record (measured later by drill_report)."""
        latest = self.cluster.latest
        members = self.cluster.members()
        rec = {"index": index, "label": fault.label, "kind": fault.kind, "target": fault.target,
               "trigger": str(fault.trigger), "duration": fault.duration, "fired_at": None, "end_at": None,
               "fired_step": latest.step if latest else None, "world_before": latest.world_size if latest else None,
               "round_before": latest.round if latest else None, "node": None, "status": "fired", "notes": [],
               "corrupted_steps": []}
        kind = FAULTS[fault.kind]
        if kind.arms:
            kind.fire(self, rec, None, len(members), time.time())
            return rec
        node = None
        if kind.victim is not None:
            node = self.cluster.pick("rank0" if kind.victim == "rank0" else fault.target)
            if node is None:
                rec["status"] = f"skipped: no live node matches {fault.target or 'rank0'}"
                return rec
            rec["node"] = node.name
            rec["was_rank0"] = bool(self.cluster.latest and self.cluster.latest.origin == node.name)
        rec["survivors"] = [n.name for n in members if n is not node]
        size = len(members)
        rec["expected_world"] = rec["final_world"] = ranks(self.args, min(size, self.cluster.max_nodes))
        if kind.prepare is not None:
            skipped = kind.prepare(self, rec)
            if skipped:
                rec["status"] = skipped
                return rec
        now = time.time()
        rec["fired_at"] = now
        kind.fire(self, rec, node, size, now)
        if fault.duration is not None and kind.heal is not None:
            rec["end_due"] = now + fault.duration
        return rec

    def end_fault(self, rec: dict) -> None:
        """The second half of a fault with a duration (its ``heal``): SIGCONT, link up, etcd back, disk freed."""
        node = self.cluster.node(rec.get("node"))
        FAULTS[rec["kind"]].heal(self, rec, node)
        rec["end_at"] = time.time()
        rec.pop("end_due", None)

    def progress(self, rec: dict) -> bool:
        """Advance a fired fault; True once it recovered, timed out or was skipped."""
        now = time.time()
        if rec["status"].startswith("skipped"):
            return True
        if rec["status"] == "armed":
            return self._kill_when_saving(rec, now)
        if "end_due" in rec:
            if now >= rec["end_due"]:
                self.end_fault(rec)
            return False
        since = rec["end_at"] or rec["fired_at"]
        must_restart = (rec["kind"] in drill_report.WORLD_CHANGING or rec.get("expect_dip")) \
            and rec["round_before"] is not None
        # Settled: SETTLE_STEPS steps of one world at the expected size since the fault (one
        # stray step of the old world finishing after a stall does not count; after a dip to N-1
        # the world at N is a new one).
        fresh = [s for s in self.cluster.r0[-SETTLE_STEPS:] if s.time > since
                 and s.world_size == rec["final_world"]
                 and not (must_restart and s.round == rec["round_before"])]
        if len(fresh) == SETTLE_STEPS and len({s.round for s in fresh}) == 1:
            rec["status"] = "recovered"
            return True
        if now - since > self.args.recovery_timeout:
            rec["status"] = "timeout"
            return True
        return False

    def _kill_when_saving(self, rec: dict, now: float) -> bool:
        """SIGKILL rank 0's node the moment a checkpoint upload starts (kill-during-checkpoint)."""
        if self._watch is not None:
            started = [n for n in self._watch.read(POLL) if n.startswith("step-") and n[5:].isdigit()]
            step = int(started[-1][5:]) if started else None
        else:  # remote storage: the trainer's save event (written when the async save starts)
            start = next((e for e in self.cluster.events if e.event in drill_report.CKPT_START_EVENTS
                          and e.time >= rec["armed_at"]), None)
            step = start.step if start else None
        node = self.cluster.pick("rank0")
        if step is not None and node is not None:
            members = self.cluster.members()
            created = time.time()
            self.cluster.kill(node)
            manifest = Path(self.cluster.checkpoint_dir) / f"step-{step}" / "manifest.json"
            during = "://" not in self.cluster.checkpoint_dir and not manifest.exists()
            latest = self.cluster.latest
            rec.update(status="fired", fired_at=created, node=node.name, was_rank0=True,
                       fired_step=latest.step, world_before=latest.world_size,
                       round_before=latest.round, checkpoint_step=step, during_upload=during,
                       survivors=[n.name for n in members if n is not node],
                       expected_world=ranks(self.args, min(len(members) - 1, self.cluster.max_nodes)))
            rec["final_world"] = rec["expected_world"]
            rec["notes"].append(f"killed while step-{step} was being uploaded (not committed)" if during else
                                f"step-{step} was already committed when the kill landed")
            self.close_watch()
        elif now - rec["armed_at"] > self.args.recovery_timeout:
            rec["status"] = "skipped: no checkpoint save started"
            self.close_watch()
            return True
        return False

    def watch_checkpoints(self) -> None:
        """Watch the checkpoint folder for a ``step-N`` folder (kill-during-checkpoint), if it is local."""
        root = Path(self.cluster.checkpoint_dir)
        if "://" not in self.cluster.checkpoint_dir and root.is_dir():
            self._watch = DirWatch(root)  # the step-N folder appears when the upload starts

    def close_watch(self) -> None:
        """Stop watching the checkpoint folder (kill-during-checkpoint), if it is watched."""
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def corrupt_newest_checkpoint(self) -> tuple[int, str] | None:
        """Flip 64 bytes in the biggest file of the newest committed ``step-N`` folder."""
        root = Path(self.cluster.checkpoint_dir)
        if "://" in self.cluster.checkpoint_dir or not root.is_dir():
            return None
        folders = sorted((d for d in root.glob("step-*") if d.is_dir() and d.name[5:].isdigit()),
                         key=lambda d: int(d.name[5:]), reverse=True)
        for folder in folders:
            files = [f for f in folder.rglob("*") if f.is_file()]
            if not any("manifest" in f.name.lower() for f in files):
                continue  # not committed: readers ignore it anyway
            data = [f for f in files if "manifest" not in f.name.lower()] or files
            victim = max(data, key=lambda f: f.stat().st_size)
            size = victim.stat().st_size
            with open(victim, "r+b") as fh:
                fh.seek(max(0, size // 2 - 32))
                chunk = fh.read(64)
                fh.seek(max(0, size // 2 - 32))
                fh.write(bytes(b ^ 0xFF for b in chunk))
            return int(folder.name[5:]), str(victim)
        return None

    def fill_disk(self) -> int:
        """Write zeros into the checkpoint tmpfs until it is full; return the bytes written."""
        written = 0
        fd = os.open(self.cluster.tmpfs / ".drill-fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                block = b"\0" * size
                while True:
                    try:
                        written += os.write(fd, block)
                    except OSError:
                        break
        finally:
            os.close(fd)
        return written

    def free_disk(self) -> None:
        """Delete what ``fill_disk`` wrote."""
        (self.cluster.tmpfs / ".drill-fill").unlink(missing_ok=True)
