"""A torch ``RendezvousBackend`` on etcd v3: one state key, compare-and-swap, leases.

The rendezvous state of a run lives in one etcd key, ``<prefix>state``. Every writer
sends a transaction that puts the new state only if the key's *mod revision* still
equals the fencing token the writer last saw (or, with no token, only if the key does
not exist yet). The token is that mod revision. This is exactly the ``get_state`` /
``set_state`` contract of torch's own backends (see ``RendezvousBackend``).

Keys of one run (prefix ``/elastic-trainer/<run_id>/`` by default):

    <prefix>state          the rendezvous state: an envelope line, then the JSON state
    <prefix>summary        "<round> <complete> <closed>", written with every state write
    <prefix>alive/<node>   one key per live node, attached to that node's lease (readers use the name; the
                           value, {"since": unix time}, is for `elastic-train status`)
    <prefix>joining/<node> present while the node waits to join a round, on its lease (readers take
                           the node from the key's name; the value, its descriptor, is for people)
    <prefix>ranks/<round>/<node>  "<rank> <world size>", written by the node that completed the round:
                           a waiting node reads its own, not the state (round zero-padded: in order)
    <prefix>store/<key>    the etcd-backed torch Store (``etcd_store.EtcdStore``)
    <prefix>program/<node> what the node runs, on its lease (``program.py``: the joiner check)

Every read of the state also reads the ``alive/`` and ``joining/`` keys in the same
transaction (so at the same revision): the state holder treats a node as dead only when
its lease key is gone, which etcd decides by its own clock, never a peer's. Those reads
fetch only the keys created since the last one (``_Members``), so a poll costs what
changed, not the number of nodes; nodes that only wait poll the ``summary`` instead of
the state (``admission.EtcdOpExecutor``).

The stored value starts with ``elastic-trainer-rdzv/1 <run_id>\\n``; a value without it
(written by another program, another run or another version) is refused with a
``RendezvousStateError`` instead of being decoded.
"""

from __future__ import annotations

import logging
import threading

import etcd3.utils
from etcd3 import etcdrpc
from torch.distributed.elastic.rendezvous.api import RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_trainer.etcd.client import EtcdConnection

logger = logging.getLogger(__name__)

MAGIC = b"elastic-trainer-rdzv/1"
DEFAULT_KEY_PREFIX = "/elastic-trainer"


def run_prefix(key_prefix: str | None, run_id: str) -> str:
    """The key prefix of one run: ``<key_prefix>/<run_id>/``."""
    root = (key_prefix or DEFAULT_KEY_PREFIX).rstrip("/")
    return f"{root}/{run_id}/"


class _Members:
    """The keys under one prefix (``alive/`` or ``joining/``), kept current by reading only new keys.

    Every read of the state also reads these prefixes. Reading them whole costs O(nodes) per
    read, and with N agents polling that is O(N^2): at 1,000 agents etcd took seconds per
    read and the agents' leases ran out. Instead each read asks only for the keys *created*
    after the last complete view (``min_create_revision``) together with the prefix's key
    count, which etcd reports before that filter. If the count equals the known keys plus the
    new ones, no key was deleted and the view is complete again; otherwise (a node died or
    left) the caller reads the prefix whole. So a poll costs O(new keys), and a full read
    happens only after a deletion.

    A *lazy* view skips that full read: after a deletion it adds the new keys and keeps the
    old ones, some of which may be gone (``exact`` is then False until a full read). The
    ``joining/`` view of a node that is not the admitter is lazy: every node deletes its
    joining key once it has its rank, so at the end of a round of N nodes every other
    waiting node saw a deletion and read the whole list (at 1,000 agents, 3,000 reads and
    190 MB), although only the admitter acts on that list.
    """

    def __init__(self, prefix: str, keys_only: bool) -> None:
        self.prefix = prefix.encode()
        self._end = etcd3.utils.prefix_range_end(self.prefix)
        self._keys_only = keys_only
        self.revision = 0
        """The etcd revision at which ``items`` was complete (0: never read)."""
        self.items: dict[str, bytes] = {}
        self.exact = True
        """False when ``items`` may hold keys deleted from etcd (a lazy view after a deletion)."""
        self._full = True  # the last request asked for the whole prefix

    def request(self, full: bool = False) -> etcdrpc.RequestOp:
        r = etcdrpc.RangeRequest(key=self.prefix, range_end=self._end, keys_only=self._keys_only)
        self._full = full or not self.revision
        if not self._full:
            r.min_create_revision = self.revision + 1
        return etcdrpc.RequestOp(request_range=r)

    def update(self, response: etcdrpc.RangeResponse, revision: int, lazy: bool = False) -> bool:
        """Apply a range answer read at ``revision`` for the last ``request``; False when a key
        was deleted and the view is not lazy (read it whole)."""
        n = len(self.prefix)
        new = {kv.key[n:].decode(): kv.value for kv in response.kvs}
        if self._full:
            self.items, self.exact = new, True
        elif self.exact and response.count == len(self.items) + len(new):
            if new:  # else keep the same dict: readers skip work when it is the same object
                self.items = {**self.items, **new}
        elif lazy:
            if new:
                self.items = {**self.items, **new}
            self.exact = False
        else:
            return False
        self.revision = revision
        return True


def _count(prefix: bytes) -> etcdrpc.RequestOp:
    """How many keys are under ``prefix`` (etcd walks its in-memory index; no values, no keys sent)."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=prefix, range_end=etcd3.utils.prefix_range_end(prefix), count_only=True))


def _first(prefix: bytes) -> etcdrpc.RequestOp:
    """The smallest key under ``prefix`` (keys only, one key)."""
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
        key=prefix, range_end=etcd3.utils.prefix_range_end(prefix), keys_only=True, limit=1))


def _get(key: bytes) -> etcdrpc.RequestOp:
    return etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(key=key))


def _mod_equals(key: bytes, revision: int) -> etcdrpc.Compare:
    return etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.MOD, key=key,
                           mod_revision=revision)


def _absent(key: bytes) -> etcdrpc.Compare:
    return etcdrpc.Compare(result=etcdrpc.Compare.EQUAL, target=etcdrpc.Compare.CREATE, key=key,
                           create_revision=0)


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
        self._state_key = self.state_key.encode()
        self._summary_key = (self.prefix + "summary").encode()
        self.ranks_prefix = self.prefix + "ranks/"
        self.alive_prefix = self.prefix + "alive/"
        self.joining_prefix = self.prefix + "joining/"
        self.program_prefix = self.prefix + "program/"
        self._header = MAGIC + b" " + run_id.encode() + b"\n"
        self.requests = 0
        """etcd requests this backend sent (for the scale benchmark)."""
        self.last_alive: frozenset[str] | None = None
        """Node names with a live lease key, read in the same transaction as the last state."""
        self._cache: tuple[int, bytes] | None = None  # (mod revision, state) last seen
        self.last_joining: dict[str, bytes] = {}
        """Names of the nodes waiting to join (values not read), read with the last state."""
        # get_state/set_state run in the agent's thread, read() in the watchdog's: each keeps its view
        self._alive, self._joining = _Members(self.alive_prefix, True), _Members(self.joining_prefix, True)
        self._watch_alive = _Members(self.alive_prefix, True)
        self._published_alive: dict | None = None
        self._read_lock = threading.Lock()
        self.light_alive_count = 0
        """With the last *light* read (``get_state(light=True)``): how many alive/ keys etcd held."""
        self.light_first_joining: str | None = None
        """With the last light read: the smallest name under joining/ (None when there is none)."""

    @property
    def name(self) -> str:
        return "etcd-v3"

    # -- encoding -----------------------------------------------------------------------
    def _wrap(self, state: bytes) -> bytes:
        return self._header + state

    def unwrap(self, value: bytes) -> bytes:
        """The rendezvous state in a value of the state key (its header checked: this run's, this format)."""
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

    def program_key(self, node_name: str) -> str:
        return self.program_prefix + node_name

    def programs(self) -> dict[str, bytes]:
        """What each live node of the run runs: its ``program/`` record, by node name."""
        prefix = self.program_prefix.encode()
        resp = self._txn("program read", [], [etcdrpc.RequestOp(request_range=etcdrpc.RangeRequest(
            key=prefix, range_end=etcd3.utils.prefix_range_end(prefix)))])
        return {kv.key[len(prefix):].decode(): kv.value for kv in resp.responses[0].response_range.kvs}

    def rank_key(self, round_: int, node_name: str) -> str:
        return f"{self.ranks_prefix}{round_:020d}/{node_name}"

    # -- etcd ---------------------------------------------------------------------------
    def _txn(self, what: str, compare: list, success: list, failure: list | None = None,
             retry_timeout: float | None = None) -> etcdrpc.TxnResponse:
        """One etcd transaction of raw protobuf operations (python3-etcd3's ``transaction`` has no
        range options and wraps every key in Python objects); errors as python3-etcd3 raises them."""
        request = etcdrpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        self.requests += 1
        return self._conn.call(lambda client: client.txns([request])[0], what, retry_timeout)

    def _members(self, ranges: list, revision: int, what: str, views: tuple[_Members, ...],
                 retry_timeout: float | None = None, lazy: tuple[_Members, ...] = ()) -> None:
        """Update ``views`` from their range answers; read whole the ones where a key was deleted
        (unless they are in ``lazy``)."""
        stale = [v for v, r in zip(views, ranges) if not v.update(r.response_range, revision, v in lazy)]
        if stale:
            resp = self._txn(what, [], [v.request(full=True) for v in stale], retry_timeout=retry_timeout)
            for v, r in zip(stale, resp.responses):
                v.update(r.response_range, resp.header.revision)

    def _member_ranges(self, exact_joining: bool) -> tuple[list, tuple[_Members, ...]]:
        """The range requests of alive/ and joining/ for a state read or write, and the lazy views."""
        ranges = [self._alive.request(), self._joining.request(full=exact_joining and not self._joining.exact)]
        return ranges, (() if exact_joining else (self._joining,))

    def _publish(self) -> None:
        if self._alive.items is not self._published_alive:  # a poll that found nothing new builds nothing
            self._published_alive = self._alive.items
            self.last_alive = frozenset(self._alive.items)
        self.last_joining = self._joining.items

    def _state_value(self, kvs) -> tuple[bytes, int] | None:
        if not kvs:
            return None
        return self.unwrap(kvs[0].value), kvs[0].mod_revision

    # -- the contract -------------------------------------------------------------------
    def read(self, retry_timeout: float | None = None) -> tuple[bytes | None, int | None, frozenset[str]]:
        """State, token and live node names, read together; state and token are None when unset."""
        with self._read_lock:
            alive = self._watch_alive
            resp = self._txn("state read", [], [_get(self._state_key), alive.request()],
                             retry_timeout=retry_timeout)
            self._members(resp.responses[1:], resp.header.revision, "state read", (alive,), retry_timeout)
            names = frozenset(alive.items)
        found = self._state_value(resp.responses[0].response_range.kvs)
        if found is None:
            return None, None, names
        return found[0], found[1], names

    @property
    def joining_exact(self) -> bool:
        """Whether ``last_joining`` is exactly etcd's joining/ keys (see ``get_state``)."""
        return self._joining.exact

    def read_state(self) -> tuple[bytes, int] | None:
        """The state and its token, without the member lists; None when there is no state."""
        resp = self._txn("state read", [], [_get(self._state_key)])
        return self._state_value(resp.responses[0].response_range.kvs)

    def get_state(self, exact_joining: bool = True, light: bool = False) -> tuple[bytes, Token] | None:
        """torch's contract. With ``exact_joining`` False the ``joining/`` view is lazy
        (``_Members``): it may keep names whose keys were deleted; True reads it whole if so.

        ``light``: read neither member list, only how many nodes are alive
        (``light_alive_count``) and the smallest name waiting to join (``light_first_joining``):
        a few bytes instead of O(nodes), for the nodes that do not admit (see ``state.py``);
        ``last_alive`` and ``last_joining`` are left as they were."""
        # A conditional read: when the state is still at the revision we last saw, etcd sends
        # only what is new under alive/ and joining/, not the state (waiting nodes poll it).
        cached = self._cache
        if light:
            ranges = [_count(self._alive.prefix), _first(self._joining.prefix)]
        else:
            ranges, lazy = self._member_ranges(exact_joining)
        if cached is None:
            resp = self._txn("state read", [], [_get(self._state_key), *ranges])
        else:
            resp = self._txn("state read", [_mod_equals(self._state_key, cached[0])], ranges,
                             [_get(self._state_key), *ranges])
        unchanged = cached is not None and resp.succeeded
        answers = list(resp.responses)
        state_kvs = None if unchanged else answers.pop(0).response_range.kvs
        if light:
            self.light_alive_count = int(answers[0].response_range.count)
            first = answers[1].response_range.kvs
            n = len(self._joining.prefix)
            self.light_first_joining = first[0].key[n:].decode() if first else None
        else:
            self._members(answers, resp.header.revision, "state read", (self._alive, self._joining), lazy=lazy)
            self._publish()
        if unchanged:
            return cached[1], cached[0]  # type: ignore[index]
        found = self._state_value(state_kvs)
        self._cache = found[::-1] if found is not None else None  # type: ignore[assignment]
        return found

    def poll_summary(self, retry_timeout: float | None = None) -> tuple[bytes | None, int]:
        """The state's summary (``state.encode_summary``; None when unknown) and the number of
        live nodes: a few bytes, and no per-key work in etcd (a key count walks etcd's
        in-memory index only). Waiting and training nodes poll this, not the state."""
        alive_count = etcdrpc.RangeRequest(key=self._alive.prefix, range_end=etcd3.utils.prefix_range_end(
            self._alive.prefix), count_only=True)
        resp = self._txn("state poll", [], [_get(self._summary_key), etcdrpc.RequestOp(request_range=alive_count)],
                         retry_timeout=retry_timeout)
        kvs = resp.responses[0].response_range.kvs
        return (kvs[0].value if kvs else None), int(resp.responses[1].response_range.count)

    def poll_round(self, rank_key: str | None = None) -> tuple[bytes | None, int, str | None, bytes | None]:
        """``poll_summary``, the smallest name under joining/ and ``rank_key``'s value (each None when
        absent), in one request: a waiting node learns that it admits now, or its rank."""
        ops = [_get(self._summary_key), _count(self._alive.prefix), _first(self._joining.prefix)]
        if rank_key is not None:
            ops.append(_get(rank_key.encode()))
        resp = self._txn("state poll", [], ops)
        kvs, first = resp.responses[0].response_range.kvs, resp.responses[2].response_range.kvs
        rank = resp.responses[3].response_range.kvs if rank_key is not None else None
        n = len(self._joining.prefix)
        return ((kvs[0].value if kvs else None), int(resp.responses[1].response_range.count),
                first[0].key[n:].decode() if first else None, rank[0].value if rank else None)

    def publish_ranks(self, round_: int, ranks: dict[str, int]) -> None:
        """Write every participant's ``rank_key`` of a round just completed (``"<rank> <world size>"``;
        see ``admission.py``): 100 keys a transaction (etcd's default limit is 128 operations), all the
        transactions sent at once (one round trip; one after the other they took 3 s under load)."""
        world = len(ranks)
        items = sorted(ranks.items())
        requests = [etcdrpc.TxnRequest(success=[etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(
            key=self.rank_key(round_, name).encode(), value=f"{rank} {world}".encode()))
            for name, rank in items[i:i + 100]]) for i in range(0, len(items), 100)]
        self.requests += len(requests)
        self._conn.call(lambda client: client.txns(requests), "ranks write")  # a failure sends them all again

    def delete_ranks_before(self, round_: int | None = None) -> None:
        """Delete the ``rank_key`` of every round before ``round_`` (None: of every round)."""
        end = f"{self.ranks_prefix}{round_:020d}/".encode() if round_ is not None else \
            etcd3.utils.prefix_range_end(self.ranks_prefix.encode())
        self._txn("ranks delete", [], [etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(
            key=self.ranks_prefix.encode(), range_end=end))])

    def set_state(self, state: bytes, token: Token | None = None, *,
                  summary: bytes | None = None, exact_joining: bool = True) -> tuple[bytes, Token, bool] | None:
        """torch's contract; ``summary`` is stored with the state (or removed when None);
        ``exact_joining`` as in ``get_state``."""
        if token is not None:
            try:
                token = int(token)
            except (TypeError, ValueError):
                result = self.get_state(exact_joining)
                return None if result is None else (*result, False)
            if token <= 0:
                result = self.get_state(exact_joining)
                return None if result is None else (*result, False)

        views = (self._alive, self._joining)
        ranges, lazy = self._member_ranges(exact_joining)
        compare = [_mod_equals(self._state_key, token)] if token is not None else [_absent(self._state_key)]
        put = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=self._state_key, value=self._wrap(state)))
        if summary is None:
            mark = etcdrpc.RequestOp(request_delete_range=etcdrpc.DeleteRangeRequest(key=self._summary_key))
        else:
            mark = etcdrpc.RequestOp(request_put=etcdrpc.PutRequest(key=self._summary_key, value=summary))
        resp = self._txn("state write", compare, [put, *ranges, mark], [_get(self._state_key), *ranges])
        answers = list(resp.responses)[:3]
        first = answers.pop(0)
        self._members(answers, resp.header.revision, "state write", views, lazy=lazy)
        self._publish()
        if resp.succeeded:
            revision = first.response_put.header.revision
            self._cache = (revision, state)
            return state, revision, True
        found = self._state_value(first.response_range.kvs)
        if found is None:  # deleted between our read and write
            self._cache = None
            return None
        self._cache = found[::-1]  # type: ignore[assignment]
        return found[0], found[1], False
