"""A torch ``RendezvousBackend`` on etcd v3: one state key, compare-and-swap, leases.

The rendezvous state of a run lives in one etcd key, ``<prefix>state``. Every writer
sends a transaction that puts the new state only if the key's *mod revision* still
equals the fencing token the writer last saw (or, with no token, only if the key does
not exist yet). The token is that mod revision. This is exactly the ``get_state`` /
``set_state`` contract of torch's own backends (see ``RendezvousBackend``).

Keys of one run (prefix ``/elastic-trainer/<run_id>/`` by default):

    <prefix>state          the rendezvous state: an envelope line, then the JSON state
    <prefix>alive/<node>   one empty key per live node, attached to that node's lease
    <prefix>joining/<node> the node's descriptor (JSON) while it waits to join a round, on its lease
    <prefix>store/<key>    the etcd-backed torch Store (``etcd_store.EtcdStore``)

Every read of the state also reads the ``alive/`` keys in the same transaction (so at
the same revision): the state holder treats a node as dead only when its lease key is
gone, which etcd decides by its own clock, never a peer's.

The stored value starts with ``elastic-trainer-rdzv/1 <run_id>\\n``; a value without it
(written by another program, another run or another version) is refused with a
``RendezvousStateError`` instead of being decoded.
"""

from __future__ import annotations

import logging

import etcd3.utils
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_trainer.rendezvous._etcd import EtcdConnection

logger = logging.getLogger(__name__)

MAGIC = b"elastic-trainer-rdzv/1"
DEFAULT_KEY_PREFIX = "/elastic-trainer"


def run_prefix(key_prefix: str | None, run_id: str) -> str:
    """The key prefix of one run: ``<key_prefix>/<run_id>/``."""
    root = (key_prefix or DEFAULT_KEY_PREFIX).rstrip("/")
    return f"{root}/{run_id}/"


class EtcdRendezvousBackend(RendezvousBackend):
    """Holds the rendezvous state of ``run_id`` in etcd v3.

    Args:
        conn: the etcd connection (shared with the store and the lease keeper).
        run_id: the run; its state is refused by other run ids.
        key_prefix: the root of all keys; the run's keys live under ``<key_prefix>/<run_id>/``.
    """

    def __init__(self, conn: EtcdConnection, run_id: str, key_prefix: str | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._conn = conn
        self.run_id = run_id
        self.prefix = run_prefix(key_prefix, run_id)
        self.state_key = self.prefix + "state"
        self.alive_prefix = self.prefix + "alive/"
        self.joining_prefix = self.prefix + "joining/"
        self._header = MAGIC + b" " + run_id.encode() + b"\n"
        self.requests = 0
        """etcd requests this backend sent (for the scale benchmark)."""
        self.last_alive: frozenset[str] | None = None
        """Node names with a live lease key, read in the same transaction as the last state."""
        self._cache: tuple[int, bytes] | None = None  # (mod revision, state) last seen
        self.last_joining: dict[str, bytes] = {}
        """Node name -> descriptor of the nodes waiting to join, read with the last state."""

    @property
    def name(self) -> str:
        return "etcd-v3"

    # -- encoding -----------------------------------------------------------------------
    def _wrap(self, state: bytes) -> bytes:
        return self._header + state

    def _unwrap(self, value: bytes) -> bytes:
        if not value.startswith(self._header):
            first = value.split(b"\n", 1)[0][:60]
            if first.startswith(MAGIC + b" "):
                why = f"it belongs to run {first[len(MAGIC) + 1:].decode(errors='replace')!r}"
            else:
                why = f"it does not start with {MAGIC.decode()!r} (it starts with {first!r})"
            raise RendezvousStateError(
                f"The value of etcd key '{self.state_key}' was not written by the etcd-v3 rendezvous "
                f"of run '{self.run_id}': {why}. Refusing to use it; another program wrote under this "
                f"prefix. Use another key_prefix or run id, or delete the key.")
        return value[len(self._header):]

    def alive_key(self, node_name: str) -> str:
        return self.alive_prefix + node_name

    def joining_key(self, node_name: str) -> str:
        return self.joining_prefix + node_name

    def _range(self, prefix: str):
        return self._conn.client.transactions.get(prefix, etcd3.utils.prefix_range_end(prefix.encode()))

    def _alive_range(self):
        return self._range(self.alive_prefix)

    def _names(self, kvs) -> frozenset[str]:
        n = len(self.alive_prefix)
        return frozenset(meta.key.decode()[n:] for _, meta in kvs)

    def _joining(self, kvs) -> dict[str, bytes]:
        n = len(self.joining_prefix)
        return {meta.key.decode()[n:]: value for value, meta in kvs}

    # -- the contract -------------------------------------------------------------------
    def read(self, retry_timeout: float | None = None) -> tuple[bytes | None, int | None, frozenset[str]]:
        """State, token and live node names, read atomically; state and token are None when unset."""
        def txn(client):
            return client.transaction(compare=[], success=[client.transactions.get(self.state_key),
                                                           self._alive_range()], failure=[])
        self.requests += 1
        _, (state_kvs, alive_kvs) = self._conn.call(txn, "state read", retry_timeout)
        alive = self._names(alive_kvs)
        if not state_kvs:
            return None, None, alive
        value, meta = state_kvs[0]
        return self._unwrap(value), meta.mod_revision, alive

    def get_state(self) -> tuple[bytes, Token] | None:
        # A conditional read: when the state is still at the revision we last saw, etcd sends
        # only the alive/joining keys, not the state (waiting nodes poll it).
        cached = self._cache

        def txn(client):
            t = client.transactions
            ranges = [self._alive_range(), self._range(self.joining_prefix)]
            if cached is None:
                return client.transaction(compare=[], success=[t.get(self.state_key), *ranges], failure=[])
            return client.transaction(compare=[t.mod(self.state_key) == cached[0]], success=ranges,
                                      failure=[t.get(self.state_key), *ranges])
        self.requests += 1
        unchanged, responses = self._conn.call(txn, "state read")
        if cached is not None and unchanged:
            alive_kvs, joining_kvs = responses
            self.last_alive, self.last_joining = self._names(alive_kvs), self._joining(joining_kvs)
            return cached[1], cached[0]
        state_kvs, alive_kvs, joining_kvs = responses
        self.last_alive, self.last_joining = self._names(alive_kvs), self._joining(joining_kvs)
        if not state_kvs:
            self._cache = None
            return None
        value, meta = state_kvs[0]
        state = self._unwrap(value)
        self._cache = (meta.mod_revision, state)
        return state, meta.mod_revision

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None:
            try:
                token = int(token)
            except (TypeError, ValueError):
                result = self.get_state()
                return None if result is None else (*result, False)
            if token <= 0:
                result = self.get_state()
                return None if result is None else (*result, False)

        def txn(client):
            t = client.transactions
            compare = [t.mod(self.state_key) == token] if token is not None else [t.create(self.state_key) == 0]
            return client.transaction(
                compare=compare,
                success=[t.put(self.state_key, self._wrap(state)), self._alive_range(),
                         self._range(self.joining_prefix)],
                failure=[t.get(self.state_key), self._alive_range(), self._range(self.joining_prefix)])

        self.requests += 1
        succeeded, responses = self._conn.call(txn, "state write")
        self.last_alive, self.last_joining = self._names(responses[1]), self._joining(responses[2])
        if succeeded:
            revision = responses[0].response_put.header.revision
            self._cache = (revision, state)
            return state, revision, True
        if not responses[0]:  # deleted between our read and write
            self._cache = None
            return None
        value, meta = responses[0][0]
        current = self._unwrap(value)
        self._cache = (meta.mod_revision, current)
        return current, meta.mod_revision, False
