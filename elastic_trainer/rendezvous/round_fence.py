"""The round fence: lets a worker prove that its rendezvous round is still the current one.

Each completed rendezvous round has a number; the etcd-v3 handler exports it to the
workers it starts (``ELASTIC_TRAINER_RDZV_ROUND``), with the run's key prefix and the
node's name. Before a worker does something that only the current world may do
(committing a checkpoint, say), it calls ``check()``: one etcd transaction reads the
rendezvous state and this node's lease key, and ``FencedError`` is raised unless

* the state's round is still this worker's round and that round is complete,
* this worker's node is still a participant of it, and
* this node's lease key still exists (etcd has not declared the node dead).

This covers what the agent's watchdog cannot: an agent frozen (SIGSTOP, swap storm)
while its workers go on. When etcd cannot be reached within ``retry_timeout``
seconds the round cannot be proven current, so ``check()`` raises ``FencedError`` too
(fail safe: the caller skips its commit).

A check alone is check-then-act: a worker paused right after it can act when its round is
long over. ``guard()`` makes the act conditional instead: it checks as ``check()`` does and
returns a ``Guard``, the *fencing token*: etcd comparisons (the state key's mod revision, the
node's lease key's create revision) that hold exactly as long as what was checked still holds.
A write put in one transaction with them (the checkpoint commit record,
``checkpoint/record.py``) fails once the round changes or the lease ends, however long the
writer was paused in between. The live quorum (``live/group.py``) gives the same kind of
``Guard`` for its quorum key and member lease.

What a writer needs of either is the ``Fence`` protocol (``elastic_trainer/fence.py``): ``prefix`` (the etcd key prefix its
keys live under), ``token`` (its round's or quorum's short name), ``etcd`` (the connection a
fenced write goes through) and ``guard()``. ``RoundFence`` and the live group both provide it;
the checkpoint commit record (``checkpoint/record.py``) and ``CheckpointManager`` take any
``Fence``. A plain ``check`` function can fence a commit too (check-then-act, no record):
``round_token()`` is then the token recorded beside it.

    from elastic_trainer.fence import FencedError
    from elastic_trainer.rendezvous.round_fence import RoundFence
    fence = RoundFence.from_env()          # None when not started by the etcd-v3 rendezvous
    if fence is not None:
        fence.check()                      # raises FencedError when this round is over
        token = fence.token                # "round-7", to record beside what was written
        guard = fence.guard()              # the same check, plus comparisons for a fenced write
"""

from __future__ import annotations

import json

from torch.distributed.elastic.rendezvous.api import RendezvousError

from elastic_trainer.env import WorkerEnv
from elastic_trainer.fence import FencedError, Guard


class RoundFence:
    """Checks that rendezvous round ``round`` of the run under ``prefix`` is still current.

    Args:
        round: the round the worker was started in.
        prefix: the run's key prefix (``/elastic-trainer/<run_id>/``).
        endpoints: etcd ``host:port[,host:port]``.
        node: the node's name in the rendezvous (``<addr>_<pid>_<local_id>``); when given,
            the node must still be a participant with a live lease.
        conn_export: how to reach etcd, as the handler exported it (``etcd_client.export_options``:
            TLS files, user, and the path of the 0600 file that holds the password).
        retry_timeout: seconds to keep trying an unreachable etcd before fencing.
    """

    def __init__(self, round: int, prefix: str, endpoints: str, node: str | None = None,
                 conn_export: str | None = None, retry_timeout: float = 15.0) -> None:
        self.round = round
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.endpoints = endpoints
        self.node = node
        self._conn_export = conn_export or "{}"
        self._retry_timeout = retry_timeout
        self._conn = None
        self._backend = None

    @classmethod
    def from_env(cls) -> RoundFence | None:
        """The fence of this worker, or None when not started under the etcd-v3 rendezvous."""
        env = WorkerEnv.from_environ()
        conn = env.rdzv_conn or "{}"
        endpoints = env.rdzv_endpoint or json.loads(conn).get("endpoints")
        if env.rdzv_round is None or not env.rdzv_prefix or not endpoints:
            return None
        return cls(env.rdzv_round, env.rdzv_prefix, endpoints, env.rdzv_node, conn_export=conn)

    @property
    def token(self) -> str:
        """A short name of this worker's round, e.g. ``"round-7"``."""
        return f"round-{self.round}"

    def _connect(self):
        if self._backend is None:
            from elastic_trainer.etcd.client import EtcdConnection, options_from_export
            from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend

            options = options_from_export(self._conn_export, self._retry_timeout, endpoints=self.endpoints)
            self._conn = EtcdConnection(options)
            run_id = self.prefix.rstrip("/").rsplit("/", 1)[-1]
            root = self.prefix.rstrip("/")[: -len(run_id)].rstrip("/") or "/"
            self._backend = EtcdRendezvousBackend(self._conn, run_id, root)
        return self._backend

    @property
    def etcd(self):
        """The ``EtcdConnection`` this fence reads through (for writes guarded by ``guard()``)."""
        self._connect()
        return self._conn

    def check(self) -> None:
        """Raise ``FencedError`` unless this worker's round is still the run's current round."""
        self.guard()

    def guard(self) -> Guard:
        """``check()``, and the comparisons that keep holding while what it checked holds: the
        state key is unchanged since this read and the node's lease key is the same key (a lease
        that ended deletes it; a new lease makes a new one)."""
        from elastic_trainer.rendezvous.state import decode_state, node_name

        try:
            backend = self._connect()
            keys = [backend.state_key] + ([backend.alive_key(self.node)] if self.node else [])

            def txn(c):
                return c.transaction(compare=[], success=[c.transactions.get(k) for k in keys], failure=[])
            _, responses = self._conn.call(txn, "fence check")
            state = decode_state(backend.unwrap(responses[0][0][0])) if responses[0] else None
            lease_alive = bool(responses[1]) if self.node else True
            compares = [(backend.state_key, "mod", responses[0][0][1].mod_revision if responses[0] else 0)]
            if self.node and responses[1]:
                compares.append((backend.alive_key(self.node), "create", responses[1][0][1].create_revision))
        except RendezvousError as exc:
            raise FencedError(f"cannot prove that rendezvous {self.token} of {self.prefix} is current: {exc}") from exc
        if state is None:
            raise FencedError(f"the rendezvous state of {self.prefix} is gone; {self.token} is over")
        if state.round != self.round or not state.complete:
            raise FencedError(f"{self.token} of {self.prefix} is over: etcd is at round {state.round} "
                              f"({'complete' if state.complete else 'forming'})")
        if self.node is not None:
            if self.node not in {node_name(n) for n in state.participants}:
                raise FencedError(f"node {self.node} is no longer a participant of {self.token} of {self.prefix}")
            if not lease_alive:
                raise FencedError(f"the etcd lease of node {self.node} expired; {self.token} is over for it")
        return Guard(self.token, tuple(compares))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = self._backend = None


__all__ = ["RoundFence"]
