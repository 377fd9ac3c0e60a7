"""A node's etcd lease: the key that says the node is alive, renewed in the background.

Every lease kept on one etcd connection is renewed by one thread, the connection's
``RenewalLoop``, as etcd's Go client renews all the leases of a client from one loop: each
renewal is still one message per lease per interval on the connection's keep-alive stream,
and etcd's answer is applied the moment it arrives, by the stream's reader thread. A thread
per lease that sent its renewal and slept waiting for the answer cost 0.8 ms of Python per
renewal (three thread wake-ups each) and etcd 0.5 ms; one loop per connection cost 0.23 ms and
0.19 ms (63 leases on one process, 2 CPUs: etcd takes a burst of renewals at once). An agent
keeps one lease, so it runs one loop as it ran one thread; a process that keeps many leases
on one connection (the scale benchmark's simulated agents, ``benchmarks/live_sim.py``'s nodes)
no longer runs a thread per lease.
"""

from __future__ import annotations

import heapq
import itertools
import json
import logging
import threading
import time
import weakref

import grpc

from elastic_trainer.etcd.client import EtcdConnection
from elastic_trainer.observability import metrics
from elastic_trainer.runtime import runtime

logger = logging.getLogger(__name__)


class RenewalLoop:
    """The one thread that renews every lease kept on one etcd connection (see the module docstring).

    Each keeper is due every ``interval`` seconds from its first renewal (a fixed pace: a late
    loop renews at once and keeps the pace from then on). Between renewals the loop also looks at
    a keeper when a renewal of it has waited too long for an answer (so that a hung member is given
    up on time and the next renewal goes to another one) and when etcd answered that the lease is
    gone (so that ``on_lost`` is called at once, from this thread, not from the stream's reader).
    The thread ends when no keeper is left and starts again with the next one.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, LeaseKeeper, bool]] = []  # (when, seq, keeper, renew or only look)
        self._seq = itertools.count()
        self._keepers: set[LeaseKeeper] = set()
        self._thread: threading.Thread | None = None

    @staticmethod
    def of(conn: EtcdConnection) -> RenewalLoop:
        """The loop of ``conn`` (made on first use)."""
        with _LOOPS_LOCK:
            loop = _LOOPS.get(conn)
            if loop is None:
                loop = _LOOPS[conn] = RenewalLoop()
            return loop

    def add(self, keeper: LeaseKeeper, first: float) -> None:
        with self._cond:
            self._keepers.add(keeper)
            self._push(first, keeper, True)
            if self._thread is None:  # this process's runtime owns it (the agent's, or a worker's)
                self._thread = runtime().start_thread("etcd-lease-renewals", self._run, stop=self.stop)

    def remove(self, keeper: LeaseKeeper) -> None:
        with self._cond:
            self._keepers.discard(keeper)
            self._cond.notify()

    def stop(self) -> None:
        """Renew nothing more: the thread ends (the runtime's ``close()``, when the process ends);
        a keeper added later starts it again."""
        with self._cond:
            self._keepers.clear()
            self._cond.notify()

    def look_at(self, keeper: LeaseKeeper, when: float | None = None) -> None:
        """Have the loop apply ``keeper``'s answers at ``when`` (now when None)."""
        with self._cond:
            if keeper in self._keepers:
                self._push(time.monotonic() if when is None else when, keeper, False)

    def _push(self, when: float, keeper: LeaseKeeper, renew: bool) -> None:
        heapq.heappush(self._heap, (when, next(self._seq), keeper, renew))
        self._cond.notify()

    def _next(self) -> list[tuple[float, LeaseKeeper, bool]] | None:
        """Wait for what is due; None when no keeper is left (the thread then ends)."""
        with self._cond:
            while True:
                if not self._keepers:
                    self._thread = None
                    return None
                while self._heap and self._heap[0][2] not in self._keepers:
                    heapq.heappop(self._heap)  # a closed keeper's
                now = time.monotonic()
                if self._heap and self._heap[0][0] <= now:
                    # Renewals due within a fifth of an interval go out with this one: a burst of
                    # renewals costs the loop one wake-up and etcd one read of the stream, and the
                    # leases renewed together stay together (the next is due an interval from now).
                    early = now + 0.2 * self._heap[0][2].interval
                    due = []
                    while self._heap and (self._heap[0][0] <= now or (self._heap[0][3] and self._heap[0][0] <= early)):
                        when, _, keeper, renew = heapq.heappop(self._heap)
                        if keeper in self._keepers:
                            due.append((when, keeper, renew))
                    return due
                self._cond.wait(self._heap[0][0] - now if self._heap else None)

    def _run(self) -> None:
        while (due := self._next()) is not None:
            started = time.monotonic()
            for _, keeper, renew in due:
                if keeper.stopped:
                    self.remove(keeper)
                    continue
                try:
                    if renew:
                        keeper.refresh(wait=0)
                        with self._cond:
                            if keeper in self._keepers:  # an interval from the start of this burst
                                keeper.due = started + keeper.interval
                                self._push(keeper.due, keeper, True)
                    elif keeper.apply_answers():
                        keeper.refresh(wait=0)  # the stream failed: the next renewal goes out now, on a new one
                    # A renewal to give up before the next one is due (a hung member): look at it then.
                    check = keeper.give_up_at()
                    if check is not None and check < keeper.due:
                        self.look_at(keeper, check)
                except Exception:  # noqa: BLE001 - one keeper's failure must not stop the others' renewals
                    logger.exception("renewing the etcd lease of %s failed", keeper.key)


_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LOOPS_LOCK = threading.Lock()


class LeaseKeeper:
    """Keeps this node's ``alive/<node>`` key on an etcd lease and renews the lease.

    ``ensure()`` grants a lease (a new one if the last was lost) and writes the key; the
    connection's ``RenewalLoop`` renews it every ``interval`` seconds (from the start of one
    renewal to the next, so that a slow etcd does not stretch the period by its latency) and a
    thread of the keeper's own calls ``on_tick`` (the handler's watchdog) every ``interval``
    seconds. They used to share one thread: with every etcd request 0.5 s late, a renewal plus
    the watchdog's reads plus the interval made 2 s between renewals, and the node fenced itself
    although etcd was healthy. A lease etcd no longer knows is *lost*: the keeper does not grant a
    new one by itself (the handler does, in ``next_rendezvous``, after the workers stopped), and
    calls ``on_lost`` from the renewal loop as soon as etcd said so (a live worker exits before its
    next step, not at the next tick). ``on_renewed(lease_id, sent)`` is called after every grant
    or renewal etcd accepted (under live recovery the handler records it for the node's workers:
    ``rendezvous/node_lease.py``), from the keep-alive stream's reader thread: it must be quick.
    """

    def __init__(self, conn: EtcdConnection, key: str, ttl: int, interval: float, on_tick=None,
                 on_lost=None, on_renewed=None, tick_later: bool = False) -> None:
        self._conn = conn
        self._key = key
        self._ttl = ttl
        self._interval = interval
        self._on_tick = on_tick
        self._tick_later = tick_later  # ``on_tick`` starts with ``start_ticking()``, not ``ensure()``
        self._on_lost = on_lost
        self._on_renewed = on_renewed
        self._lease_id: int | None = None
        self._lost = False
        self._last_attempt = time.monotonic()
        self._last_renewed = time.monotonic()  # when the last renewal that etcd accepted was SENT
        self._stop = threading.Event()
        self._started = False
        self._thread: threading.Thread | None = None  # the watchdog's (``on_tick``)
        self._loop = RenewalLoop.of(conn)
        self.due = 0.0
        """When the renewal loop sends this lease's next renewal."""
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
    def stopped(self) -> bool:
        """True once ``close()`` began: nothing renews the lease any more."""
        return self._stop.is_set()

    @property
    def key(self) -> str:
        return self._key

    @property
    def interval(self) -> float:
        return self._interval

    @property
    def lease_id(self) -> int | None:
        """The lease etcd knows now (None before ``ensure()`` and after ``close()``)."""
        return self._lease_id

    def _grant(self) -> None:
        lease = self._conn.call(lambda c: c.lease(self._ttl), "lease grant")
        self.requests += 1
        self._lease_id, self._lost = lease.id, False

    def _put_alive(self, also: dict[str, bytes] | None = None) -> None:
        # The value is for people (`elastic-train status`: since when); readers use the key's name only.
        if not also:
            self._conn.call(lambda c: c.put(self._key, self._since, lease=self._lease_id), "alive key")
        else:
            def put_all(c):
                puts = [c.transactions.put(key, value, lease=self._lease_id)
                        for key, value in ((self._key, self._since), *also.items())]
                return c.transaction(compare=[], success=puts, failure=[])
            self._conn.call(put_all, "alive key")
        self.requests += 1

    def ensure(self, also: dict[str, bytes] | None = None) -> None:
        """Hold a live lease (granted now if there is none, or it was lost) and the alive key on it;
        ``also``: more keys to write on the lease in the same request (a node's ``joining/`` key)."""
        with self._lock:
            sent = time.monotonic()
            granted = None
            if self._lease_id is None or self._lost:
                self._grant()
                granted = sent
            try:
                self._put_alive(also)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:
                    raise
                # The lease ran out while etcd was out of reach (a network cut), before a
                # renewal could tell us: this is the one place that may take a new lease.
                logger.warning("the etcd lease of %s ended while etcd was out of reach; taking a new one",
                               self._key)
                granted = time.monotonic()
                self._grant()
                self._put_alive(also)
            self._last_attempt = time.monotonic()
            self._last_renewed = sent
            lease_id = self._lease_id
        if self._on_renewed is not None:
            self._on_renewed(lease_id, sent)
        if not self._started and not self._stop.is_set():
            self._started = True
            # An interval from the grant, not from now: etcd counts the lease's time from the grant,
            # and under load the alive key's write took a second or more after it. A first renewal
            # an interval after that write came after the 3 s lease had run out (at 1,000 simulated
            # agents the first leases were lost this way, 2.5 s in, and each loss cost every waiting
            # agent a full read).
            self.due = (granted if granted is not None else sent) + self._interval
            self._loop.add(self, self.due)
            if not self._tick_later:
                self.start_ticking()

    def start_ticking(self) -> None:
        """Start calling ``on_tick`` every interval (once; ``ensure()`` does it unless ``tick_later``:
        the handler's watchdog has nothing to check before its node joined a round, and a thousand
        agents waiting to join woke a thousand idle threads a second)."""
        with self._lock:
            if self._on_tick is None or self._thread is not None or self._stop.is_set():
                return
            self._thread = runtime().start_thread(f"etcd-watchdog {self._key}", self._tick, stop=self._stop.set)

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
        # Earlier answers first (a renewal unanswered too long fails its stream here, so that this
        # one goes out on a new stream), then this renewal's, waited for up to ``wait`` seconds.
        self.apply_answers()
        still = []
        try:
            pending = self._conn.call(lambda c: self._conn.send_renewal(lease_id), "lease keep-alive",
                                      retry_timeout=0)
            self.requests += 1
            pending.on_answer(lambda p: self._answered(lease_id, p))
            still = self._collect([(lease_id, pending)], float("inf") if wait is None else wait)
        except Exception as exc:  # noqa: BLE001 - a failed renewal is retried at the next tick
            logger.warning("could not renew the etcd lease of %s: %s", self._key, exc)
        if still:
            with self._inflight_lock:
                self._inflight[:0] = still

    @property
    def _failover_after(self) -> float:
        # Several endpoints: a member that does not answer within ttl - 2 intervals (1 s at
        # the defaults) is given up, and the next renewal, sent at once to the next member,
        # still lands before the lease (renewed an interval before this one) runs out.
        return max(0.5, self._ttl - 2 * self._interval)

    def apply_answers(self) -> bool:
        """Apply the answers that came to renewals in flight, without waiting; True when their
        stream failed (a renewal unanswered too long, or the stream broke)."""
        with self._inflight_lock:
            inflight, self._inflight = self._inflight, []
        try:
            still = self._collect(inflight, 0.0)
        except Exception as exc:  # noqa: BLE001 - their stream failed; the next renewal opens a new one
            logger.info("earlier renewals of the etcd lease of %s failed: %s", self._key, exc)
            return True
        if still:
            with self._inflight_lock:
                self._inflight[:0] = still
        return False

    def give_up_at(self) -> float | None:
        """When the oldest unanswered renewal is to be given up (None when none is in flight)."""
        with self._inflight_lock:
            if not self._inflight:
                return None
            sent = min(p.sent for _, p in self._inflight)
        return sent + self._conn.renewal_give_up_after(self._failover_after) + 0.001

    def _answered(self, lease_id: int, p) -> bool:
        """etcd's answer to a renewal, in the keep-alive stream's reader thread: applied there when
        the lease lives; a lost lease is left to the renewal loop (``on_lost`` may take time)."""
        if p.ttl > 0:
            self._renewed(lease_id, p.sent, p.ttl, p.answered - p.sent)
            return True
        self._loop.look_at(self)
        return False

    def _collect(self, inflight: list, wait: float) -> list:
        """Apply the answers that came to renewals in flight and that the reader thread did not
        apply (waiting up to ``wait`` seconds for the last); the ones still unanswered. A failed
        stream raises."""
        still = []
        for i, (lease_id, p) in enumerate(inflight):
            # Not through ``call``: nothing here is retried, and a renewal's Python is what a
            # thousand simulated agents on two CPUs run short of.
            ttl = self._conn.renewal_result(p, wait if i == len(inflight) - 1 else 0.0, self._failover_after)
            if ttl is None:
                still.append((lease_id, p))
            elif not p.applied:
                self._renewed(lease_id, p.sent, ttl, p.answered - p.sent)
        return still

    on_answer = None
    """Tracing (``benchmarks/rdzv_scale.py --trace``): when set, called as ``on_answer(sent, took, lost)``
    with every renewal answer, from the thread that applies it; it must be quick."""

    def _renewed(self, lease_id: int, sent: float, ttl: int, took: float) -> None:
        """Apply etcd's answer ``ttl`` to a renewal of ``lease_id`` sent at ``sent``."""
        if self.on_answer is not None:
            self.on_answer(sent, took, ttl <= 0)
        metrics.lease_renewed(took)  # /metrics: the renewal's round trip, sent when due
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

    def _tick(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._on_tick()
            except Exception:  # noqa: BLE001 - the watchdog must survive etcd hiccups; logged
                if not self._stop.is_set():  # else the connection was closed under a last check
                    logger.exception("rendezvous watchdog check failed")

    def close(self, revoke: bool = True) -> None:
        self._stop.set()
        self._loop.remove(self)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)  # let a watchdog check in flight end first
        with self._lock:
            lease_id, self._lease_id = self._lease_id, None
        if revoke and lease_id is not None and not self._lost:
            try:
                self._conn.call(lambda c: c.revoke_lease(lease_id), "lease revoke", retry_timeout=2)
            except Exception as exc:  # noqa: BLE001 - best effort; the lease expires by itself
                logger.info("could not revoke the etcd lease of %s (%s); it expires by itself", self._key, exc)
