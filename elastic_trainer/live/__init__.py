"""The live quorum: which workers train together under ``--recovery live``, agreed through etcd.

``LiveGroup`` (``group.py``) is a worker's membership, the one object the training side uses; it is
composed of parts that each do one thing: the live keys and the transactions on them
(``keys.py``), what a quorum is and its record (``quorum.py``), this worker's keys on its node's
lease (``worker_lease.py``), joining and the quorum held (``membership.py``), the re-form round
(``reform.py``, with ``report_feed.py`` and ``node_report.py``), the watcher (``watcher.py``; its
view: ``view_keeper.py``, ``mirror.py``, ``stream.py``, ``node_share.py``), the process group's
store (``group_store.py``), the probe port (``probe.py``), the step clock (``progress.py``) and the
threads (``threads.py``). torchrun's side (the agents' rendezvous, the node's lease) is
``rendezvous/``. Design and numbers: docs/trainer.md, "Live recovery"; docs/rendezvous.md.

Exports, imported on first use (a submodule such as ``quorum`` needs neither torch nor etcd's
client): ``LiveGroup``, ``Quorum``, ``Member``, ``LiveExcluded``, ``RunFinished``, ``LiveTimeout``,
``MemberGone``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"LiveGroup": "group", "Quorum": "quorum", "Member": "quorum", "LiveExcluded": "quorum",
            "RunFinished": "quorum", "LiveTimeout": "quorum", "MemberGone": "group_store"}


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
