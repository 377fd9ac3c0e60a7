"""A running job's status in etcd, as global rank 0 publishes it for ``elastic-train status``.

What rank 0 publishes, ``<key_prefix>/<run_id>/status`` (one JSON document)::

    {"time": ..., "node": ..., "step": ..., "epoch": ..., "world_size": ..., "round": ...,
     "loss": ..., "samples_per_s": ..., "checkpoint": {"step": ..., "time": ..., "url": ...} | null,
     "state": "training" | "finished" | "stopped", "events": [{"time": ..., "event": ..., ...}, ...],
     "threads": ["MainThread", "checkpoint-save", "live-watch", ...]}

``threads`` names every thread of rank 0's process (``threading.enumerate()``) as of the write:
what it is running now, for a person asking why a run stalls (docs/architecture.md's thread table
says who owns each; tests/test_status.py checks that the table names every one a live worker runs).

``StatusPublisher`` writes it from a background thread at most once a second (``INTERVAL_S``),
only when something changed, so the training loop never waits for etcd: a step only updates a dict.
Every URL in it is written ``storage.redact``-ed (``s3://***@bucket``): no credentials in etcd.
A new rank 0 (a restart, a re-formed group) keeps the events and the checkpoint of the previous
one. A worker not started by the etcd-v3 rendezvous (plain ``python -m elastic_trainer.train``)
publishes nothing (``from_env`` returns None). The command that reads it is ``cli/status.py``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from elastic_trainer import storage
from elastic_trainer.env import WorkerEnv
from elastic_trainer.runtime import runtime

logger = logging.getLogger(__name__)

INTERVAL_S = 1.0
"""Rank 0 writes its status at most this often."""
MAX_EVENTS = 12
"""The status keeps this many of the newest events."""
STATUS_KEY = "status"
"""The status document's key under the run's prefix."""


class StatusPublisher:
    """Rank 0's status in ``<prefix>status``: ``update()`` and ``event()`` change a dict, a thread writes it."""

    def __init__(self, conn, prefix: str, interval: float = INTERVAL_S) -> None:
        self._conn = conn
        self._key = prefix + STATUS_KEY
        self._interval = interval
        self._lock = threading.Lock()
        self._doc: dict[str, Any] = {"state": "training", "checkpoint": None, "events": []}
        self._dirty = False
        self._stop = threading.Event()
        self._warned = False
        try:  # keep the events of earlier processes (a restart, a new rank 0)
            value, _ = conn.call(lambda c: c.get(self._key), "status read", retry_timeout=2)
            if value:
                old = json.loads(value)
                self._doc["events"] = list(old.get("events", []))[-MAX_EVENTS:]
                self._doc["checkpoint"] = old.get("checkpoint")
        except Exception as exc:  # noqa: BLE001 - a status is a convenience: never stop training for it
            logger.info("status: could not read the previous status: %s", exc)
        self._thread = runtime().start_thread("status-publisher", self._run, stop=self._stop.set)

    @classmethod
    def from_env(cls) -> StatusPublisher | None:
        """The publisher of a worker started by ``elastic-train`` on the etcd-v3 rendezvous, else None."""
        env = WorkerEnv.from_environ()
        text, prefix = env.rdzv_conn, env.rdzv_prefix
        if not text or not prefix:
            return None
        from elastic_trainer.etcd.client import EtcdConnection, options_from_export

        return cls(EtcdConnection(options_from_export(text, retry_timeout=5.0)), prefix)

    @classmethod
    def from_env_or_none(cls) -> StatusPublisher | None:
        """``from_env()``, or None (and one warning) when it cannot start: the status is for
        people, and training goes on without it."""
        try:
            return cls.from_env()
        except Exception as exc:  # noqa: BLE001 - never stop training for the status
            logger.warning("status: not publishing to etcd (%s)", exc)
            return None

    def update(self, **fields: Any) -> None:
        """Set fields of the status (``step=``, ``loss=``, ``checkpoint=``...); written within a second."""
        with self._lock:
            self._doc.update(fields)
            self._dirty = True

    def event(self, record: dict) -> None:
        """Add an event (an ``EventRecord``'s JSON); the status keeps the newest ``MAX_EVENTS``."""
        with self._lock:
            self._doc["events"] = (self._doc["events"] + [record])[-MAX_EVENTS:]
            self._dirty = True

    def _write(self) -> None:
        with self._lock:
            if not self._dirty:
                return
            self._doc["time"] = time.time()
            self._doc["threads"] = sorted(t.name for t in threading.enumerate())
            # Whatever a field or an event holds, no URL's credentials reach etcd or `status`.
            data = storage.redact(json.dumps(self._doc, separators=(",", ":"), default=str))
            self._dirty = False
        try:
            self._conn.call(lambda c: c.put(self._key, data), "status write", retry_timeout=2)
        except Exception as exc:  # noqa: BLE001 - training goes on; say so once
            if not self._warned:
                logger.warning("status: could not write %s to etcd (%s); `elastic-train status` shows older "
                               "numbers until it works again", self._key, exc)
                self._warned = True

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self._write()

    def close(self) -> None:
        """Write what is pending now, stop the thread and close the connection."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._write()
        self._conn.close()
