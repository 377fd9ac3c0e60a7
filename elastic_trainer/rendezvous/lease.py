"""A node's etcd lease: the key that says the node is alive, renewed in the background."""

from __future__ import annotations

import json
import logging
import threading
import time

import grpc

from elastic_trainer.rendezvous.etcd_client import EtcdConnection

logger = logging.getLogger(__name__)


class LeaseKeeper:
    """Keeps this node's ``alive/<node>`` key on an etcd lease and renews the lease.

    ``ensure()`` grants a lease (a new one if the last was lost) and writes the key;
    a daemon thread renews it every ``interval`` seconds (from the start of one renewal to the
    next, so that a slow etcd does not stretch the period by its latency) and another calls
    ``on_tick`` (the handler's watchdog) every ``interval`` seconds. They used to share one
    thread: with every etcd request 0.5 s late, a renewal plus the watchdog's reads plus the
    interval made 2 s between renewals, and the node fenced itself although etcd was healthy.
    A lease etcd no longer knows is *lost*: the keeper does not grant a new one by itself (the
    handler does, in ``next_rendezvous``, after the workers stopped), and calls ``on_lost`` from
    the renewal thread at once (a live worker exits before its next step, not at the next tick).
    ``on_renewed(lease_id, sent)`` is called after every grant or renewal etcd accepted (under
    live recovery the handler records it for the node's workers: ``rendezvous/node_lease.py``).
    """

    def __init__(self, conn: EtcdConnection, key: str, ttl: int, interval: float, on_tick=None,
                 on_lost=None, on_renewed=None) -> None:
        self._conn = conn
        self._key = key
        self._ttl = ttl
        self._interval = interval
        self._on_tick = on_tick
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._lease_id: int | None = None
        self._lost = False
        self._last_attempt = time.monotonic()
        self._last_renewed = time.monotonic()  # when the last renewal that etcd accepted was SENT
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticker: threading.Thread | None = None
        self._slow_warned = False
        self._lock = threading.Lock()
        self._since = json.dumps({"since": time.time()}).encode()
        self._inflight: list[tuple[int, object]] = []  # (lease id, renewal sent and not answered yet)
        self._inflight_lock = threading.Lock()
        self.requests = 0

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def lease_id(self) -> int | None:
        """The lease etcd knows now (None before ``ensure()`` and after ``close()``)."""
        return self._lease_id

    def _grant(self) -> None:
        lease = self._conn.call(lambda c: c.lease(self._ttl), "lease grant")
        self.requests += 1
        self._lease_id, self._lost = lease.id, False

    def _put_alive(self) -> None:
        # The value is for people (`elastic-train status`: since when); readers use the key's name only.
        self._conn.call(lambda c: c.put(self._key, self._since, lease=self._lease_id), "alive key")
        self.requests += 1

    def ensure(self) -> None:
        with self._lock:
            sent = time.monotonic()
            if self._lease_id is None or self._lost:
                self._grant()
            try:
                self._put_alive()
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                # The lease ran out while etcd was out of reach (a network cut), before a
                # renewal could tell us: this is the one place that may take a new lease.
                logger.warning("the etcd lease of %s ended while etcd was out of reach; taking a new one",
                               self._key)
                self._grant()
                self._put_alive()
            self._last_attempt = time.monotonic()
            self._last_renewed = sent
            lease_id = self._lease_id
        if self._on_renewed is not None:
            self._on_renewed(lease_id, sent)
        if self._thread is None:
            self._thread = threading.Thread(target=self._renew, name=f"etcd-lease {self._key}", daemon=True)
            self._thread.start()
            if self._on_tick is not None:
                self._ticker = threading.Thread(target=self._tick, name=f"etcd-watchdog {self._key}", daemon=True)
                self._ticker.start()

    def put(self, key: str, value: bytes) -> None:
        """Write ``key`` attached to the lease (it vanishes with the lease)."""
        with self._lock:
            lease_id = self._lease_id
        self._conn.call(lambda c: c.put(key, value, lease=lease_id), "put")
        self.requests += 1

    def delete(self, key: str) -> None:
        self._conn.call(lambda c: c.delete(key), "delete")
        self.requests += 1

    def refresh(self, wait: float | None = None) -> None:
        """Renew the lease once; mark it lost when etcd no longer knows it.

        The renewal is sent, then its answer awaited for at most ``wait`` seconds (None: until
        etcd answers or the renewal is given up); an answer that comes later is applied by the
        next call. The renewal thread waits one interval, so a late answer never delays the next
        renewal: at 1,000 simulated agents answers took seconds to reach their threads, and a
        keeper that waited for each sent the next one after its 3 s lease had run out.

        Nothing here holds the keeper's lock while etcd answers: a renewal that etcd answers late
        (a loaded etcd, a failover) must not hold up ``put`` (the handler's ``joining/`` key) or
        ``expired_at_etcd``. At 1,000 agents a join waited up to 17.5 s behind slow renewals."""
        with self._lock:
            lease_id = self._lease_id
            if lease_id is None or self._lost:
                return
            self._last_attempt = time.monotonic()
        # Several endpoints: a member that does not answer within ttl - 2 intervals (1 s at
        # the defaults) is given up, and the next renewal, sent at once to the next member,
        # still lands before the lease (renewed an interval before this one) runs out.
        failover_after = max(0.5, self._ttl - 2 * self._interval)
        with self._inflight_lock:
            inflight, self._inflight = self._inflight, []
        # Earlier answers first (a renewal unanswered too long fails its stream here, so that this
        # one goes out on a new stream), then this renewal's, waited for up to ``wait`` seconds.
        try:
            still = self._collect(inflight, 0.0, failover_after)
        except Exception as exc:  # noqa: BLE001 - their stream failed; this renewal opens a new one
            logger.info("earlier renewals of the etcd lease of %s failed: %s", self._key, exc)
            still = []
        try:
            pending = self._conn.call(lambda c: self._conn.send_renewal(lease_id), "lease keep-alive",
                                      retry_timeout=0)
            self.requests += 1
            still += self._collect([(lease_id, pending)], float("inf") if wait is None else wait, failover_after)
        except Exception as exc:  # noqa: BLE001 - a failed renewal is retried at the next tick
            logger.warning("could not renew the etcd lease of %s: %s", self._key, exc)
        if still:
            with self._inflight_lock:
                self._inflight[:0] = still

    def _collect(self, inflight: list, wait: float, failover_after: float) -> list:
        """Apply the answers that came to renewals in flight (waiting up to ``wait`` seconds for
        the last); the ones still unanswered. A failed stream raises."""
        still = []
        for i, (lease_id, p) in enumerate(inflight):
            # Not through ``call``: nothing here is retried, and a renewal's Python is what a
            # thousand simulated agents on two CPUs run short of.
            ttl = self._conn.renewal_result(p, wait if i == len(inflight) - 1 else 0.0, failover_after)
            if ttl is None:
                still.append((lease_id, p))
            else:
                self._renewed(lease_id, p.sent, ttl, p.answered - p.sent)
        return still

    def _renewed(self, lease_id: int, sent: float, ttl: int, took: float) -> None:
        """Apply etcd's answer ``ttl`` to a renewal of ``lease_id`` sent at ``sent``."""
        lost = False
        with self._lock:
            if self._lease_id != lease_id:  # closed, or a new lease granted meanwhile: not ours to judge
                return
            if ttl <= 0:
                self._lost = lost = True
            else:
                self._last_renewed = max(self._last_renewed, sent)
        if not lost and self._on_renewed is not None:
            self._on_renewed(lease_id, sent)
        if lost:
            logger.warning("the etcd lease of %s expired; this node left its round", self._key)
            if self._on_lost is not None:
                self._on_lost()
        if took + self._interval > self._ttl - self._interval and not self._slow_warned:
            self._slow_warned = True  # once: the node fences itself next if it stays this slow
            logger.warning("etcd took %.1fs to answer a lease renewal; at this latency lease_ttl=%d "
                           "cannot be kept alive with certainty; raise lease_ttl in --rdzv-conf",
                           took, self._ttl)

    def expired_at_etcd(self, timeout: float) -> bool | None:
        """Ask etcd now (one request, at most ``timeout`` seconds) whether the lease is gone:
        True when etcd no longer knows it (it is then marked lost), False when it lives, None when
        etcd did not answer in time (not proof of anything: etcd may be restarting)."""
        with self._lock:
            lease_id = self._lease_id
        if lease_id is None or self._lost:
            return self._lost
        from etcd3.etcdrpc import LeaseTimeToLiveRequest

        def ask(c):
            return c.leasestub.LeaseTimeToLive(LeaseTimeToLiveRequest(ID=lease_id), timeout,
                                               credentials=c.call_credentials, metadata=c.metadata)

        try:
            answer = self._conn.call(ask, "lease time-to-live", retry_timeout=0)
            self.requests += 1
        except Exception as exc:  # noqa: BLE001 - no answer: the renewal thread keeps trying
            logger.info("could not ask etcd for the lease of %s: %s", self._key, exc)
            return None
        if answer.TTL > 0:
            return False
        logger.warning("the etcd lease of %s expired; this node left its round", self._key)
        self._lost = True
        return True

    def seconds_since_renewal(self) -> float:
        """Seconds since the last renewal etcd accepted was sent: etcd may expire the lease
        ``ttl`` seconds after it processed that renewal, and never sooner than this says."""
        return time.monotonic() - self._last_renewed

    def seconds_since_renewal_attempt(self) -> float:
        return time.monotonic() - self._last_attempt

    def _renew(self) -> None:
        delay = self._interval
        while not self._stop.wait(delay):
            started = time.monotonic()
            self.refresh(wait=self._interval)
            delay = max(0.0, self._interval - (time.monotonic() - started))

    def _tick(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._on_tick()
            except Exception:  # noqa: BLE001 - the watchdog must survive etcd hiccups; logged
                if not self._stop.is_set():  # else the connection was closed under a last check
                    logger.exception("rendezvous watchdog check failed")

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        for thread in (self._thread, self._ticker):
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=1.0)  # let a renewal or watchdog check in flight end first
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None and not self._lost:
            try:
                self._conn.call(lambda c: c.revoke_lease(lease_id), "lease revoke", retry_timeout=2)
            except Exception as exc:  # noqa: BLE001 - best effort; the lease expires by itself
                logger.info("could not revoke the etcd lease of %s (%s); it expires by itself", self._key, exc)
