"""Fencing: how a writer proves that the world it belongs to is still the current one.

A worker that writes something only the current world may write (a checkpoint commit) must not
succeed once its world is over: its rendezvous round was replaced (the restart path), or its live
quorum re-formed without it or its lease expired (live recovery). A check alone is check-then-act:
a writer paused right after it can act when its world is long over. So a fence gives a ``Guard``,
the *fencing token*: etcd comparisons that hold exactly as long as what was checked still holds,
and a write put in one transaction with them (the checkpoint commit record,
``checkpoint/record.py``) fails once the world changes, however long the writer was paused.

This module is the protocol only, below every layer that fences or is fenced: ``FencedError``,
``Guard``, the ``Fence`` protocol and ``round_token()``. Its providers are
``rendezvous/round_fence.RoundFence`` (the restart path's rendezvous round) and the live group
(``--recovery live``: its quorum key and the worker's lease); its users are ``checkpoint/``
(``CommitRecord``, ``CheckpointManager``) and whoever commits a write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from elastic_trainer.env import WorkerEnv

if TYPE_CHECKING:
    from elastic_trainer.etcd.client import EtcdConnection


class FencedError(RuntimeError):
    """This worker's rendezvous round is over (or cannot be proven current)."""


@dataclass(frozen=True)
class Guard:
    """A fencing token: what a write must compare in its etcd transaction to be fenced.

    ``compares`` are ``(key, target, value)`` with target ``"mod"`` (the key's mod revision) or
    ``"create"`` (its create revision; 0 means absent): all of them hold while the round (or the
    live quorum) that was checked is current and the writer's lease lives.
    """

    token: str
    compares: tuple[tuple[str, str, int], ...]


class Fence(Protocol):
    """What a fenced writer needs of a fence: ``RoundFence``, or the live group of ``--recovery live``.

    Members:
        prefix: the etcd key prefix of the run (``RoundFence``: ``/elastic-trainer/<run_id>/``;
            the live group: ``<run prefix>live/``); the commit record's key is made from it.
        token: a short name of what is fenced (``"round-7"``, ``"quorum-3"``), recorded beside
            what was written.
        etcd: the ``EtcdConnection`` (``etcd/client.py``) that a write fenced by
            ``guard()`` goes through (its ``call(fn, what)``).
        guard(): check that the round (or quorum) is current, raising ``FencedError`` if not, and
            return the ``Guard`` whose comparisons keep holding exactly while it stays current.

    A fence is an object, not a function: ``CheckpointManager`` takes either a ``Fence`` (the
    commit is then the etcd record) or a plain callable (check-then-act before the manifest).
    Structural: a class provides it by having these members; it need not inherit from it.
    """

    prefix: str

    @property
    def token(self) -> str: ...

    @property
    def etcd(self) -> EtcdConnection: ...

    def guard(self) -> Guard: ...


def round_token() -> str | None:
    """The token of this worker's rendezvous round from its environment (``"round-7"``, as
    ``RoundFence.token``), None when it was not started by the etcd-v3 rendezvous."""
    rnd = WorkerEnv.from_environ().rdzv_round
    return f"round-{rnd}" if rnd is not None else None


__all__ = ["Fence", "FencedError", "Guard", "round_token"]
