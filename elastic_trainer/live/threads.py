"""The threads of a live worker's membership, and how they are started.

Every thread of the live group is started through one ``StartThread`` that its owner passes in:
by default the process's runtime (``runtime().start_thread``, ``runtime.py``), which owns, stops
and joins them; a simulation may pass its own. The threads, who starts each, and what
ends it:

| thread | started by | runs while | ended by |
| --- | --- | --- | --- |
| ``live-probe`` | ``ProbeListener`` (``live/probe.py``) | the worker is a member | ``LiveGroup.close`` |
| ``node-lease`` | ``WorkerLease.start`` (``live/worker_lease.py``) | the worker holds its node's lease | ``WorkerLease.close`` |
| ``live-watch`` | ``Watcher.start`` (``live/watcher.py``), at ``LiveGroup.join`` | the worker is a member | ``Watcher.close`` |
| ``live-watch-stream`` | the watcher, on the node's watching worker (``live/view_keeper.py``) | the same | ``Watcher.close`` |
| ``live-node-watch`` | the watcher, on its node's other workers (``live/node_share.py``) | until promoted | ``Watcher.close`` |
| ``live-report-watch`` | ``ReportFeed`` (``live/report_feed.py``), on the re-form's first candidates | the worker is one | ``Reform`` |
| ``live-key-watch`` | ``LiveGroup.watch``: the quorum key while it joins; every quorum's store (``StoreWatch``) | it joins; it is a member | ``LiveGroup.join``; ``LiveGroup.close`` |

No thread here ends the process: a lost lease or a hung training thread is handed to the callbacks
the group was made with (``on_lease_lost``, ``on_hung``; the Manager exits through its runtime).
"""

from __future__ import annotations

import threading
from typing import Callable

from elastic_trainer.runtime import runtime

StartThread = Callable[..., threading.Thread]
"""``start_thread(name, target, *args, stop=callable) -> Thread``, as ``WorkerRuntime.start_thread``:
``stop`` is what makes ``target`` return (called by the runtime at its close)."""


def start_in_runtime(name: str, target: Callable[..., object], *args: object,
                     stop: Callable[[], None] | None = None) -> threading.Thread:
    """The default ``StartThread``: a daemon thread the process's runtime owns (stopped and joined at
    its ``close()``)."""
    return runtime().start_thread(name, target, *args, stop=stop)


__all__ = ["StartThread", "start_in_runtime"]
