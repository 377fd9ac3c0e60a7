"""A torch ``Store`` on etcd v3, for what the agents share during a rendezvous round.

torchrun's agents use the store returned with each round (wrapped by the handler in a
``PrefixStore`` named after the round) to publish MASTER_ADDR/MASTER_PORT, assign
worker ranks and meet at the exit barrier. torch's ``EtcdStore`` speaks etcd v2; this
one speaks v3:

* ``set`` is a put; ``get`` and ``wait`` block until the keys exist or the store timeout
  passes (polling with exponential backoff from 10 ms to 250 ms; ``LookupError`` on timeout,
  like torch's); with ``woken`` (an event that a watch on the store's keys sets) a wait looks
  again as soon as a key changes, and with ``seen`` (the values that watch delivered) it answers
  from them without a request;
* ``add`` and ``compare_set`` are etcd transactions on the key's mod revision, so they are
  atomic among any number of agents;
* ``check``, ``delete_key`` and ``num_keys`` do what c10d's stores do.

Keys are stored as ``<prefix><key>`` with the value as given (bytes). Note that torch's
``PrefixStore`` does not forward ``delete_key``/``num_keys`` to a store written in Python
(a torch limitation); call them on the ``EtcdStore`` itself.

    from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions
    store = EtcdStore(EtcdConnection(EtcdOptions(endpoints=(("127.0.0.1", 2379),))), "/demo/store/")
    store.set("a", b"1"); store.get("a")  # b"1"
"""

from __future__ import annotations

import random
import threading
import time
from datetime import timedelta

import etcd3.utils
from torch.distributed import Store

from elastic_trainer.etcd.client import EtcdConnection

_POLL_MIN = 0.01
_POLL_MAX = 0.25


def _bytes(value) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, list):  # pybind hands std::vector<uint8_t> over as a list of ints
        return bytes(value)
    raise ValueError(f"a store key or value must be str or bytes, got {type(value).__name__}")


class EtcdStore(Store):
    """A c10d ``Store`` whose keys live in etcd under ``prefix``.

    Args:
        conn: the etcd connection.
        prefix: the etcd key prefix of this store (ends with '/').
        timeout: how long ``get``/``wait`` block; c10d's default (5 min) when None.
    """

    def __init__(self, conn: EtcdConnection, prefix: str, timeout: timedelta | None = None) -> None:
        super().__init__()  # required by the pybind trampoline
        self._conn = conn
        self.prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.requests = 0
        self.poll_min, self.poll_max = _POLL_MIN, _POLL_MAX
        """Seconds between two reads of a wait: the first, and the most it doubles to."""
        self.woken: threading.Event | None = None
        """Set by whoever watches the store's keys in etcd (``live/group_store.py``): a wait then
        looks again at once instead of at its next poll."""
        self.seen: dict[bytes, bytes] | None = None
        """The values that watch delivered (full key -> value; a deletion removes it): a ``get`` or
        ``wait`` whose keys are all in it answers from it, without a request. For stores whose
        keys are written once (a process group's: each rank's address, NCCL's id): a key set again
        may be answered with the value before, until its event comes."""
        if timeout is not None:
            self.set_timeout(timeout)

    def _key(self, key) -> bytes:
        return self.prefix.encode() + _bytes(key)

    def _call(self, fn, what):
        self.requests += 1
        return self._conn.call(fn, f"store {what}")

    # -- c10d API -----------------------------------------------------------------------
    def set(self, key, value) -> None:
        k, v = self._key(key), _bytes(value)
        self._call(lambda c: c.put(k, v), "set")

    def get(self, key) -> bytes:
        values = self._wait_get([self._key(key)], self.timeout)
        if values is None:
            raise LookupError(f"key {_bytes(key).decode(errors='replace')!r} was not set in the etcd store "
                              f"{self.prefix} within {self.timeout.total_seconds():g}s")
        return values[0]

    def multi_set(self, keys, values) -> None:
        """Set several keys in one request (one etcd transaction)."""
        pairs = [(self._key(k), _bytes(v)) for k, v in zip(keys, values)]
        self._call(lambda c: c.transaction(compare=[], success=[c.transactions.put(k, v) for k, v in pairs],
                                           failure=[]), "set")

    def multi_get(self, keys) -> list[bytes]:
        """The values of several keys, read together in one request, waiting (up to the store's
        timeout) until every one is set."""
        values = self._wait_get([self._key(k) for k in keys], self.timeout)
        if values is None:
            raise LookupError(f"keys {[_bytes(k).decode(errors='replace') for k in keys]} were not all set "
                              f"in the etcd store {self.prefix} within {self.timeout.total_seconds():g}s")
        return values

    def wait(self, keys, timeout: timedelta | None = None) -> None:
        wait_for = self.timeout if timeout is None else timeout
        if self._wait_get([self._key(k) for k in keys], wait_for) is None:
            raise LookupError(f"keys {[_bytes(k).decode(errors='replace') for k in keys]} were not all set "
                              f"in the etcd store {self.prefix} within {wait_for.total_seconds():g}s")

    def check(self, keys) -> bool:
        return self._try_get([self._key(k) for k in keys]) is not None

    def delivered(self, keys) -> bool:
        """Whether the watch delivered every key of ``keys`` (``seen``; no request: False without a watch)."""
        seen = self.seen
        return seen is not None and all(self._key(k) in seen for k in keys)

    def add(self, key, amount: int) -> int:
        k = self._key(key)
        while True:
            value, meta = self._call(lambda c: c.get(k), "add")
            if value is None:
                new = int(amount)
                compare = lambda c: c.transactions.create(k) == 0  # noqa: E731
            else:
                new = int(value) + int(amount)
                rev = meta.mod_revision
                compare = lambda c, rev=rev: c.transactions.mod(k) == rev  # noqa: E731
            ok, _ = self._call(lambda c: c.transaction(compare=[compare(c)],
                                                       success=[c.transactions.put(k, str(new))], failure=[]),
                               "add")
            if ok:
                return new
            time.sleep(random.uniform(0, 0.01))

    def compare_set(self, key, expected, desired) -> bytes:
        k, exp, des = self._key(key), _bytes(expected), _bytes(desired)

        def txn(c):
            t = c.transactions
            compare = [t.create(k) == 0] if exp == b"" else [t.value(k) == exp]
            return c.transaction(compare=compare, success=[t.put(k, des)], failure=[t.get(k)])

        ok, responses = self._call(txn, "compare_set")
        if ok:
            return des
        kvs = responses[0]
        # c10d: a missing key with a non-empty expected value answers the expected value.
        return kvs[0][0] if kvs else exp

    def delete_key(self, key) -> bool:
        k = self._key(key)
        return bool(self._call(lambda c: c.delete(k), "delete_key"))

    def num_keys(self) -> int:
        prefix = self.prefix.encode()
        end = etcd3.utils.prefix_range_end(prefix)
        response = self._call(lambda c: c.get_range_response(prefix, end, count_only=True), "num_keys")
        return int(response.count)

    def delete_prefix(self, sub_prefix: str) -> None:
        """Delete every key under ``<prefix><sub_prefix>`` (old rounds' keys)."""
        p = self._key(sub_prefix)
        self._call(lambda c: c.delete_prefix(p), "cleanup")

    # -- helpers ------------------------------------------------------------------------
    def _try_get(self, keys: list[bytes]) -> list[bytes] | None:
        def txn(c):
            return c.transaction(compare=[], success=[c.transactions.get(k) for k in keys], failure=[])
        _, responses = self._call(txn, "get")
        if not all(responses):
            return None
        return [kvs[0][0] for kvs in responses]

    def _wait_get(self, keys: list[bytes], timeout: timedelta) -> list[bytes] | None:
        deadline = time.monotonic() + timeout.total_seconds()
        delay = self.poll_min
        woken, seen = self.woken, self.seen
        while True:
            if woken is not None:
                woken.clear()  # before the read: a key set after it wakes the wait below
            if seen is not None and all(k in seen for k in keys):
                try:
                    return [seen[k] for k in keys]
                except KeyError:  # deleted meanwhile: ask etcd
                    pass
            values = self._try_get(keys)
            if values is not None:
                return values
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if woken is None:
                time.sleep(min(delay, left))
            else:
                woken.wait(min(delay, left))
            delay = min(delay * 2, self.poll_max)
