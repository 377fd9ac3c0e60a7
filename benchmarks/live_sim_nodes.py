"""The simulated nodes of ``benchmarks/live_sim.py``: workers that are the product's ``LiveGroup``
with torch left out, the nodes of one process (``Part``) and the processes (``Pool``). What is
simulated and what runs as in the product is in ``live_sim.py``'s docstring.

A ``SimWorker`` composes the product's parts as ``LiveGroup.make`` does (``live/group.py``), through
their public constructors, with three differences that are the simulation's: the process's one
probe listener for all its workers (a live process's port: the proposer's probes of the silent
members find it alive), its node's ``LeaseKeeper`` renewing the lease for it (no stand-in renewal
thread per worker: the keepers renew every node's lease of a process from one loop), and a
``stream_factory`` that times when the new quorum's event reached the worker's stream (the seam
the product's watcher and report feed make their streams through). It learns of a loss through
the ``on_member_lost`` the group is made with, and of the next quorum through the views its
watcher hands its subscribers (``Watcher.subscribe``), as the product's re-form does.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import json
import logging
import multiprocessing as mp
import os
import selectors
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from elastic_trainer.env import LiveSettings
from elastic_trainer.live.group import LiveGroup
from elastic_trainer.live.keys import WATCHED, LiveKeys, View
from elastic_trainer.live.membership import Membership
from elastic_trainer.live.node_share import NodeShare
from elastic_trainer.live.node_report import GRACE as NODE_REPORT_GRACE, NODE_MARK, NodeReport
from elastic_trainer.live.probe import ProbeListener
from elastic_trainer.live.progress import Progress
from elastic_trainer.live.quorum import Member, Quorum, decode, record_q
from elastic_trainer.live.reform import NODE_REPORT_EVERY
from elastic_trainer.live.stream import WatchStream, watch_request
from elastic_trainer.live.threads import start_in_runtime as daemon_thread
from elastic_trainer.live.view_keeper import ViewKeeper
from elastic_trainer.live.worker_lease import WorkerLease
from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints
from elastic_trainer.rendezvous.lease import LeaseKeeper

PREFIX = "/live-sim/"


def connection(endpoint: str) -> EtcdConnection:
    return EtcdConnection(EtcdOptions(endpoints=parse_endpoints(endpoint), retry_timeout=60, read_timeout=60))


class SharedDecoder:
    """One process's quorum decoding for all its workers (``Mirror.decode``): a record that arrives
    again, the same bytes, is the quorum decoded the first time (a quorum number names one member
    list). A real node decodes it once per worker on its own CPUs, in parallel; the simulation's
    siblings look one after the other on one thread, and each decode of 8,000 members (and its
    member index) would delay the next sibling's."""

    def __init__(self) -> None:
        self._last: tuple[bytes, Quorum] | None = None
        self._lock = threading.Lock()

    def __call__(self, value: bytes, known, fetch) -> Quorum:
        with self._lock:
            last = self._last
        if last is not None and last[0] == value:
            return last[1]
        quorum = decode(value, known, fetch)
        with self._lock:
            self._last = (value, quorum)
        return quorum


class SimWorker:
    """One simulated worker (see the module docstring): ``group`` is the product's ``LiveGroup``."""

    def __init__(self, conn, node: str, local_rank: int, nproc: int, settings: LiveSettings,
                 keeper: LeaseKeeper, probe: str, decoder: SharedDecoder, reread: bool = False) -> None:
        self.node, self.settings, self.reread = node, settings, reread
        keys = LiveKeys(conn, PREFIX)
        me = Member(f"{node}-{local_rank}-{os.getpid()}", node, local_rank, probe)
        lease = WorkerLease(keys, me.id, keeper.lease_id, settings.lease_ttl, settings.keep_alive_interval)
        self.group = LiveGroup(keys, Membership(keys, lease, me, nproc, settings),
                               Progress(settings.hang_min, settings.hang_factor), start_thread=daemon_thread,
                               on_member_lost=self._lost, stream_factory=self._stream)
        self.group.watcher.subscribe(self._seen)
        self.group.watcher.keeper.mirror.decode = decoder
        self.id = me.id
        self.reports = False  # report on a loss (the product's training thread does, in reform)
        self.lost_at: float | None = None  # when its watcher first saw the loss
        self.knew_at: float | None = None  # when its watcher first saw the target quorum
        self.event_at: float | None = None  # when its watch stream delivered the target quorum's change
        self.written_at: float | None = None  # the proposer: when its reform() wrote the target quorum
        self.proposer = False  # this worker re-forms with the product's LiveGroup.reform (the first in line)
        self.proposer_node = False  # a worker of the proposer's node
        self.target = 0
        self.reporter: ThreadPoolExecutor | None = None  # puts the reports, as the training threads would
        self.gatherer: Gatherer | None = None  # the node reporters' gathering
        self.node_ids: list[str] = []  # its node's workers, in the quorum's order (by local rank)

    @property
    def keys(self) -> LiveKeys:
        return self.group.keys

    @property
    def views(self) -> ViewKeeper:
        """Where its watcher's view comes from (its counters: ``reads``, ``applied``, ``loads``)."""
        return self.group.watcher.keeper

    def _stream(self, conn, keys, on_change, on_events=None) -> WatchStream:
        """The product's stream, timing the new quorum's event (``--reread``: every event makes the
        watcher read all the live keys again, as it did before it applied the events)."""
        quorum_key = self.keys.key("quorum")

        def events(changes) -> None:
            if self.event_at is None and self.target and any(c.key == quorum_key and c.value is not None
                                                             and record_q(c.value) >= self.target for c in changes):
                self.event_at = time.monotonic()
            if self.reread or on_events is None:
                on_change()
            else:
                on_events(changes)

        return WatchStream(conn, keys, on_change, on_events=events)

    def register(self) -> None:
        """``alive/<id>`` and ``join/<id>`` on the node's lease, as ``WorkerLease.ensure`` and ``join`` write them."""
        lease, me = self.group.lease, self.group.me
        lease.put(lease.key, b'{"since": 0}')
        lease.put(self.keys.key("join/" + self.id), json.dumps(
            {"node": me.node, "local_rank": me.local_rank, "nproc": self.group.membership.nproc,
             "probe": me.probe}).encode())

    def adopt(self, q: Quorum) -> None:
        """``q`` is the quorum it trains in now, as the end of ``join`` or ``reform`` makes it."""
        self.group.membership.adopt(q)
        self.group.reformer.prepare(q)

    def watch(self, thread: bool = True):
        """Start watching: the product's watcher thread, or (``thread`` False: a sibling that
        ``Part._serve_siblings`` serves) only its part in the node's watch, whose ``NodeShare`` is
        returned (its socket to serve)."""
        if thread:
            self.group.watcher.start()
            return None
        return self.group.watcher.keeper.open()

    def _lost(self, reason: str) -> None:
        if self.lost_at is not None:
            return
        self.lost_at = time.monotonic()
        q = self.group.quorum
        if self.reports and q is not None and self.target == q.q + 1:
            # the training thread reports (LiveGroup.reform), not the watcher: off its thread; the
            # first in line runs the product's reform (it reports, follows the reports, writes). A
            # report to the node's directory is a local file: written at once, as each worker of a
            # real node writes its own (queued behind 1,000 puts, the node's reporter would gather
            # before its siblings are in)
            if self.proposer:  # on a thread of its own, as a training thread: not queued behind the
                # 125 thin nodes' report puts of the process's pool
                threading.Thread(target=self._reform, args=(self.target,), name="sim-proposer", daemon=True).start()
            elif not self._report_to_node(self.target):
                self.reporter.submit(self.report, self.target)

    def _seen(self, view: View) -> None:
        """Each view its watcher looks at: a follower learns the next quorum (the product's follower
        returns from ``reform`` then)."""
        q, held = view.quorum, self.group.quorum
        if q is not None and held is not None and q.q > held.q and q.rank_of(self.id) is not None:
            if q.q >= self.target and self.knew_at is None:
                self.knew_at = time.monotonic()
            self.adopt(q)

    def _reform(self, target: int) -> None:
        """The proposer's round: ``LiveGroup.reform`` as a training thread calls it (its report, its
        look at the reports its feed follows, the compare-and-swap)."""
        try:
            q = self.group.reform(0, "sim: a node's lease lost")
        except Exception as exc:  # noqa: BLE001 - printed; the main process times out on it
            logging.getLogger("live_sim").error("the proposer's reform failed: %r", exc)
            return
        self.written_at = time.monotonic()
        if q.q >= target and self.knew_at is None:
            self.knew_at = self.written_at

    def report(self, target: int) -> None:
        """A follower's own report, as ``LiveGroup.reform`` puts it where it has no node report."""
        self.put(f"report/{target}/{self.id}", json.dumps({"step": 0, "cause": "sim"}).encode())

    def _report_to_node(self, target: int) -> bool:
        """This worker's report to its node's directory (its node's reporter hands the node to the
        ``Gatherer``, which puts the node's report and, as the product's members do past the grace,
        the reports of those it did not cover). False: none (it puts its own)."""
        share = self.group.watcher.keeper.share
        if share is None or self.group.quorum is None or self.gatherer is None:
            return False
        mine = self.node_ids  # the product takes them from the old quorum (Round.by_node), built once per
        if len(mine) < 2:     # re-form on each worker's own CPU: 8,000 members x 875 siblings here
            return False
        report = NodeReport(share.dir, target, self.node, mine, self.id)
        report.write({"step": 0, "cause": "sim"})
        self.gatherer.add(self, report)
        return True

    def put(self, sub: str, value: bytes) -> None:
        """``sub`` on the node's lease, tried five times (a failure is printed, not raised)."""
        for attempt in range(5):
            try:
                self.group.lease.put(self.keys.key(sub), value)
                return
            except Exception as exc:  # noqa: BLE001 - reported after the last try
                if attempt == 4:
                    logging.getLogger("live_sim").error("report of %s failed: %s", self.id, exc)
                time.sleep(0.1)

    def close(self) -> None:
        """Stop watching (its keys stay: a lost node's go with its lease, the others' at the end)."""
        self.group.watcher.close()
        self.group.reformer.close()


class ThinNode:
    """A node of ``--full-nodes``' load (every node not among the full ones): its etcd side as the
    product's, its in-node work left out. It keeps its lease (renewed every second), its workers'
    ``alive`` and ``join`` keys, and ONE etcd watch stream on the live keys, as a node's watching
    worker does; when its stream shows a loss it puts its node's one report (as the node's
    reporter would once its workers wrote theirs), and it times when the stream delivered the next
    quorum. What it does not do is what a real node does on its own CPUs: the watcher's looks, the
    publish to the node's directory, its siblings' loads and looks. The full nodes run all of that
    (the product's code), and their numbers say what it adds (from the watching worker's event to
    the last sibling's knowing)."""

    def __init__(self, conn, node: str, keeper: LeaseKeeper, workers: list[SimWorker], pool: ThreadPoolExecutor) -> None:
        self.conn, self.node, self.keeper, self.workers, self.pool = conn, node, keeper, workers, pool
        self.prefix = workers[0].keys.prefix
        self.target = 0
        self.lost_at: float | None = None
        self.event_at: float | None = None
        self.watch: WatchStream | _Established | None = None

    def start(self, aio: AioThin | None = None) -> None:
        if aio is not None:  # --thin-aio: a task on the process's one loop
            import asyncio

            self.aio = aio
            self.watch = _Established()
            self.aio_closed = asyncio.Event()
            aio.start(self)
            return
        self.watch = WatchStream(self.conn, [self.prefix + k for k in WATCHED], lambda: None, on_events=self._events)
        daemon_thread("thin-watch", self.watch.run)

    def _events(self, changes) -> None:
        now = time.monotonic()
        for c in changes:
            if c.key == self.prefix + "quorum":
                if c.value is not None and self.event_at is None and record_q(c.value) >= self.target > 0:
                    self.event_at = now
            elif c.value is None and self.lost_at is None and self.target > 0 and c.key.startswith(self.prefix + "alive/"):
                self.lost_at = now
                self.pool.submit(self.put_report, self.target)

    def report(self, target: int) -> tuple[str, bytes]:
        """Its node's report for quorum ``target``: the key under the live prefix, and the value."""
        record = {"step": 0, "cause": "sim"}
        return (f"report/{target}/{NODE_MARK}{self.node}",
                json.dumps({"members": {w.id: record for w in self.workers}}).encode())

    def put_report(self, target: int) -> None:
        self.workers[0].put(*self.report(target))

    def close(self) -> None:
        if getattr(self, "aio", None) is not None:
            self.aio.close(self)
        elif self.watch is not None:
            self.watch.close()


class _Established:
    """What ``Part`` asks of a thin node's watch: whether it is established."""

    def __init__(self) -> None:
        self.established = threading.Event()


class AioThin:
    """``--thin-aio``: the thin nodes of one process on ONE asyncio loop (grpc.aio), not a thread
    each: each node's watch stream is a task, its report put an awaited call on the same loop. The
    etcd side is the same requests and streams as ``ThinNode``'s threads; what it spares is the
    simulation's own CPU (125 stream threads and a 16-thread put pool a process, woken per event
    and fighting for the GIL on 2 cores), which is not a real node's: a real node has its own."""

    def __init__(self, endpoint: str) -> None:
        import asyncio

        self._asyncio = asyncio
        self.target = parse_endpoints(endpoint)[0]
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        daemon_thread("thin-aio", self._run)
        self._ready.wait(10)

    def _run(self) -> None:
        import grpc

        self._asyncio.set_event_loop(self.loop)
        host, port = self.target
        self.channel = grpc.aio.insecure_channel(f"{host}:{port}")
        self._ready.set()
        self.loop.run_forever()

    def start(self, thin: "ThinNode") -> None:
        self._asyncio.run_coroutine_threadsafe(self._watch(thin), self.loop)

    async def _watch(self, thin: "ThinNode") -> None:
        from etcd3 import etcdrpc

        stub = etcdrpc.WatchStub(self.channel)
        kv = etcdrpc.KVStub(self.channel)
        requests = [watch_request(thin.prefix + k) for k in WATCHED]  # the product's watch, as ThinNode's

        async def feed():
            for r in requests:
                yield r
            await thin.aio_closed.wait()

        call = stub.Watch(feed())
        thin.aio_call = call
        created = 0
        quorum_key, alive = (thin.prefix + "quorum").encode(), (thin.prefix + "alive/").encode()
        try:
            async for response in call:
                if response.created:
                    created += 1
                    if created == len(requests):
                        thin.watch.established.set()
                    continue
                now = time.monotonic()
                for e in response.events:
                    if e.kv.key == quorum_key:
                        if (e.type == e.PUT and thin.event_at is None
                                and record_q(e.kv.value) >= thin.target > 0):
                            thin.event_at = now
                    elif (e.type != e.PUT and thin.lost_at is None and thin.target > 0
                          and e.kv.key.startswith(alive)):
                        thin.lost_at = now
                        self.loop.create_task(self._report(kv, thin, thin.target))
        except Exception as exc:  # noqa: BLE001 - the stream ends at close; otherwise printed
            if not thin.aio_closed.is_set():
                logging.getLogger("live_sim").error("thin node %s's stream failed: %r", thin.node, exc)

    async def _report(self, kv, thin: "ThinNode", target: int) -> None:
        from etcd3 import etcdrpc

        sub, value = thin.report(target)
        key = thin.prefix + sub
        for attempt in range(5):
            try:
                await kv.Put(etcdrpc.PutRequest(key=key.encode(), value=value, lease=thin.keeper.lease_id))
                return
            except Exception as exc:  # noqa: BLE001 - reported after the last try
                if attempt == 4:
                    logging.getLogger("live_sim").error("report of %s failed: %s", thin.node, exc)
                await self._asyncio.sleep(0.1)

    def close(self, thin: "ThinNode") -> None:
        self.loop.call_soon_threadsafe(thin.aio_closed.set)
        call = getattr(thin, "aio_call", None)
        if call is not None:
            self.loop.call_soon_threadsafe(call.cancel)


SIM_GRACE = 10.0
"""The simulation's grace for a node's report, where the product's is ``node_report.GRACE`` (0.5 s).
A real node's workers come out of the failed collective together and write their reports within
milliseconds; the simulation's siblings are served one after the other by one thread per process
and write theirs seconds apart, so with the product's grace nearly every node's report was partial
and nearly every sibling put its own (7,652 puts in a loss at 1,000 x 8, 13.5 s to the last
survivor's knowing). The product's grace only matters when a node's reporter is gone or hung,
which the simulation does not do (``tests/test_node_report.py`` does)."""


class Gatherer:
    """The node reports of this process's nodes, as the product makes them in
    each worker's ``reform`` loop (``live/reform.py``), from one thread: a node's
    reporter puts the node's report once every member's file is in (looked at again whenever a
    member of its node wrote one, where the product's reporter looks every ``NODE_REPORT_EVERY``)
    or ``SIM_GRACE`` passed; a member that its node's report did not cover ``SIM_GRACE`` after it
    wrote its own puts its own (the product's member looks at each loop). The puts go to the report
    pool. One thread, not one per reporter: 125 reporters waiting in a pool of 16 threads would hold
    it while their siblings' reports queue behind them. The proposer's node is the product's
    ``reform``, with the product's grace."""

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._reporters: dict[str, tuple[SimWorker, NodeReport, float]] = {}  # node -> its pending reporter
        self._members: collections.deque[tuple[SimWorker, NodeReport, float]] = collections.deque()
        """The other members, in the order they wrote their files, until ``SIM_GRACE`` after it."""
        self._proposers: list[tuple[SimWorker, NodeReport, float]] = []  # the proposer's node's, until GRACE
        self._dirty: set[str] = set()  # nodes a member of which wrote its file since the last look
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        daemon_thread("gatherer", self._run)

    def add(self, worker: SimWorker, report: NodeReport) -> None:
        with self._lock:
            if report.reporter:
                self._reporters[worker.node] = (worker, report, time.monotonic())
            elif worker.proposer_node:  # its reporter is the product's reform, with the product's grace
                self._proposers.append((worker, report, time.monotonic()))
            else:
                self._members.append((worker, report, time.monotonic()))
            self._dirty.add(worker.node)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(NODE_REPORT_EVERY if self._reporters or self._members or self._proposers else 1.0)
            self._wake.clear()
            now = time.monotonic()
            with self._lock:
                dirty, self._dirty = self._dirty, set()
                due = [n for n, (_, _, since) in self._reporters.items() if n in dirty or now - since > SIM_GRACE]
                late = []
                while self._members and now - self._members[0][2] > SIM_GRACE:
                    late.append(self._members.popleft())
                late += [m for m in self._proposers if now - m[2] > NODE_REPORT_GRACE]
                self._proposers = [m for m in self._proposers if now - m[2] <= NODE_REPORT_GRACE]
            for node in due:
                worker, report, since = self._reporters[node]
                got = report.gathered()
                if len(got) == len(report.members) or now - since > SIM_GRACE:
                    with self._lock:
                        del self._reporters[node]
                    self._pool.submit(self._send, worker, report, got)
            for worker, report, _ in late:
                if not report.covered():  # None (no node report yet) or False (it went without this one)
                    self._pool.submit(worker.report, report.target)

    @staticmethod
    def _send(worker: SimWorker, report: NodeReport, got: dict) -> None:
        worker.put(report.key, report.value(got))
        report.mark(list(got))

    def close(self) -> None:
        self._stop.set()
        self._wake.set()


class Part:
    """One process's nodes: their lease keepers and workers."""

    def __init__(self, endpoint: str, nodes: list[str], workers: int, channels: int, settings: LiveSettings,
                 reread: bool = False, shared_siblings: bool = False, thin_aio: bool = False,
                 tmpdir: str | None = None) -> None:
        if len(nodes) == 1:  # the proposer's node apart (--proposer-apart): its round's lines, ~10 a loss
            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(threadName)s %(name)s: %(message)s")
        else:
            logging.getLogger("elastic_trainer").setLevel(logging.ERROR)  # a warning per worker and loss
        if tmpdir is not None:  # the nodes' lease records and shared directories (rendezvous/node_lease.py)
            tempfile.tempdir = tmpdir
        self.settings = settings
        self.conns = [connection(endpoint) for _ in range(max(1, min(channels, len(nodes))))]
        # the workers' probe port: one listener per process that accepts (a live process, for the
        # proposer's probes of the members that have not reported yet)
        self.probe = ProbeListener("127.0.0.1", daemon_thread)
        self.keepers: dict[str, LeaseKeeper] = {}
        self.workers: dict[str, list[SimWorker]] = {}
        decoder = SharedDecoder()
        for i, node in enumerate(nodes):
            conn = self.conns[i % len(self.conns)]
            keeper = LeaseKeeper(conn, f"{PREFIX}node/{node}", settings.lease_ttl, settings.keep_alive_interval)
            keeper.ensure()
            self.keepers[node] = keeper
            self.workers[node] = [SimWorker(conn, node, r, workers, settings, keeper, self.probe.address, decoder, reread)
                                  for r in range(workers)]
            for w in self.workers[node]:
                w.node_ids = [x.id for x in self.workers[node]]
        self.lost: set[str] = set()
        self.reporter = ThreadPoolExecutor(16)
        self.gatherer = Gatherer(self.reporter)
        for w in self.all():
            w.reporter, w.gatherer = self.reporter, self.gatherer
        self.thin: dict[str, ThinNode] = {}  # --full-nodes: the nodes that are not full (thin_out)
        self.aio = AioThin(endpoint) if thin_aio else None  # --thin-aio: the thin nodes' one loop
        self.shared_siblings = shared_siblings
        self.closing = threading.Event()
        self.look_errors = 0

    def all(self, live: bool = True) -> list[SimWorker]:
        return [w for n, ws in self.workers.items() if not (live and n in self.lost) for w in ws]

    def thin_out(self, full: list[str]) -> int:
        """``--full-nodes``: the nodes of this process not in ``full`` become ``ThinNode``s (before ``watch``)."""
        self.thin = {node: ThinNode(ws[0].keys.conn, node, self.keepers[node], ws, self.reporter)
                     for node, ws in self.workers.items() if node not in full}
        return len(self.workers) - len(self.thin)

    def full(self, live: bool = True) -> list[SimWorker]:
        """The workers of the nodes that run the product's code whole (all, without ``--full-nodes``)."""
        return [w for n, ws in self.workers.items() if not (live and n in self.lost) and n not in self.thin
                for w in ws]

    def register(self) -> int:
        workers = self.all()
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda w: w.register(), workers))
        return len(workers)

    def adopt(self, data: bytes) -> int:
        """Every worker adopts quorum 1 and deletes its join key, as ``LiveGroup.join`` ends."""
        q = Quorum.from_json(data)

        def adopt(w: SimWorker) -> None:
            w.adopt(q)
            w.target = q.q
            w.group.lease.delete(w.keys.key("join/" + w.id))

        with ThreadPoolExecutor(32) as pool:
            list(pool.map(adopt, self.all()))
        return len(self.all())

    def watch(self, reports: bool, timeout: float, wave: int = 0) -> dict:
        """Every worker starts its watcher (once every process's workers joined, as a trainer
        starts watching after its join); the answer once each has made its first read. With
        ``shared_siblings``, each node's first worker starts its watcher thread and takes the
        node's watch, and one thread of this process serves all the siblings (``_serve_siblings``).
        ``wave`` (> 0): the nodes of this process start ``wave`` at a time, each wave once the one
        before has read (nodes of a real job start over a minute, not in one instant)."""
        deadline = time.monotonic() + timeout
        for thin in self.thin.values():
            thin.start(self.aio)
        nodes = [ws for n, ws in self.workers.items() if n not in self.thin]
        step = wave if wave > 0 else max(1, len(nodes))  # a process may hold thin nodes only
        for w in self.all():
            w.reports = reports
        for i in range(0, len(nodes), step):
            batch = nodes[i:i + step]
            starting = [w for ws in batch for w in (ws if not self.shared_siblings else ws[:1])]
            for w in starting:
                w.watch()
            while wave > 0 and any(w.views.reads < 1 for w in starting) and time.monotonic() < deadline:
                time.sleep(0.02)
        if self.shared_siblings:
            while not all(ws[0].views.share is not None and ws[0].views.share.leader
                          for ws in nodes) and time.monotonic() < deadline:
                time.sleep(0.01)
            siblings = [(w, w.watch(thread=False)) for ws in nodes for w in ws[1:]]
            if any(share is None for _, share in siblings):
                raise RuntimeError("a sibling took its node's watch: the first worker did not")
            daemon_thread("siblings", self._serve_siblings, siblings)
        while (any(w.views.reads + w.views.loads < 1 for w in self.full())
               or any(not t.watch.established.is_set() for t in self.thin.values())) and time.monotonic() < deadline:
            time.sleep(0.05)
        # What the start made lives to the end (~1,000 nodes' views): out of the collector's sweeps,
        # which would otherwise walk it all while a loss is timed (each a product node's own heap).
        gc.collect()
        gc.freeze()
        return {"read": sum(w.views.reads + w.views.loads >= 1 for w in self.full())
                + sum(len(t.workers) for t in self.thin.values() if t.watch.established.is_set())}

    def expect(self, target: int, proposer: str | None) -> None:
        """The next loss re-forms into ``target``; worker ``proposer`` (if it is here) runs the product's reform."""
        for w in self.all():
            w.lost_at = w.knew_at = w.event_at = w.written_at = None
            w.target = target
            w.proposer = w.id == proposer
            w.proposer_node = proposer is not None and w.node == proposer.split("-", 1)[0]
        for thin in self.thin.values():
            if thin.node not in self.lost:
                thin.lost_at = thin.event_at = None
                thin.target = target

    def lose(self, node: str, expire: bool = False) -> float:
        """The node is lost: its lease revoked (t0: now), or with ``expire`` left to expire (its
        renewals stop; t0: when etcd expires it at the earliest, the last accepted renewal's
        sending plus the TTL: a renewal still in flight only makes t0 early, the times long)."""
        for w in self.workers[node]:
            w.close()
        if node in self.thin:
            self.thin[node].close()
        self.lost.add(node)
        keeper = self.keepers[node]
        if keeper.lost:  # expired already (renewed too late under load): the times would not be this loss's
            raise RuntimeError(f"the lease of {node} expired before it was to be lost (the machine is too loaded)")
        if expire:
            keeper.close(revoke=False)
            return time.monotonic() - keeper.seconds_since_renewal() + self.settings.lease_ttl
        t0 = time.monotonic()
        keeper.close(revoke=True)
        return t0

    def collect(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        thin = [t for n, t in self.thin.items() if n not in self.lost]
        # and the proposer's reform returned: its watcher may show it the quorum it wrote before that
        # (its own process apart, --proposer-apart, all its workers knew before the stamp was set)
        while (any(w.knew_at is None or (w.proposer and w.written_at is None) for w in self.full())
               or any(t.event_at is None for t in thin)) and time.monotonic() < deadline:
            time.sleep(0.02)
        ws = self.full()
        return {"lost_at": [w.lost_at for w in ws], "knew_at": [w.knew_at for w in ws],
                "keeps_watch": [w.views.stream is not None for w in ws],
                "event_at": [w.event_at for w in ws if w.event_at is not None],
                "written_at": [w.written_at for w in self.all() if w.written_at is not None],
                "thin_lost_at": [t.lost_at for t in thin], "thin_event_at": [t.event_at for t in thin],
                "thin_workers": sum(len(t.workers) for t in thin), "stats": self.stats()}

    def stats(self) -> dict:
        ws = self.all(live=False)
        return {"reads": sum(w.views.reads for w in ws), "applied": sum(w.views.applied for w in ws),
                "lost_leases": sum(k.lost for n, k in self.keepers.items() if n not in self.lost),
                "loads": sum(w.views.loads for w in ws), "look_errors": self.look_errors,
                "cpu_s": time.process_time()}

    def _serve_siblings(self, siblings: list[tuple[SimWorker, NodeShare]]) -> None:
        """One thread for every sibling of this process (``--shared-siblings``): what each
        sibling's two threads do in the product (``NodeShare.run`` waits on the sibling's socket;
        the watcher looks at each datagram and every poll), for all of them, one after the other.
        Each look is the product's ``Watcher.look``; what is not simulated is a sibling's
        promotion when its node's watching worker dies (no node dies here but a lost one)."""
        selector = selectors.DefaultSelector()
        for w, share in siblings:
            sock = share.bind()
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ, w)
        poll = siblings[0][0].settings.poll if siblings else 1.0
        next_poll = time.monotonic() + poll
        while not self.closing.is_set():
            for key, _ in selector.select(max(0.0, next_poll - time.monotonic())):
                with contextlib.suppress(OSError):
                    while key.fileobj.recv(16):
                        pass
                w = key.data
                w.views.stale()  # what the product's NodeShare.run calls on a datagram
                self._look(w)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + poll
                for w, _ in siblings:
                    self._look(w)
        selector.close()

    def _look(self, w: SimWorker) -> None:
        if w.group.watcher.stopped:
            return
        try:
            w.group.watcher.look()
        except Exception as exc:  # noqa: BLE001 - counted and printed: a product thread would have died
            self.look_errors += 1
            if self.look_errors <= 3:
                logging.getLogger("live_sim").error("a sibling's look failed: %r", exc)

    def close(self) -> None:
        self.closing.set()
        for thin in self.thin.values():
            thin.close()
        self.gatherer.close()
        self.reporter.shutdown(wait=False)
        for w in self.all(live=False):
            w.close()
        for node, keeper in self.keepers.items():
            if node not in self.lost:
                keeper.close(revoke=False)
        for conn in self.conns:
            conn.close()
        self.probe.close()


def serve(pipe) -> None:
    """A simulation process: builds its ``Part`` and answers the main process's commands."""
    threading.stack_size(512 * 1024)
    part = None
    while (job := pipe.recv()) is not None:
        what, kwargs = job
        try:
            if what == "setup":
                part = Part(**kwargs)
                pipe.send(part.register())
            else:
                pipe.send(getattr(part, what)(**kwargs))
        except Exception as exc:  # noqa: BLE001 - sent back to the main process, which reports it
            pipe.send({"error": f"{what}: {type(exc).__name__}: {exc}"})
    if part is not None:
        part.close()


class Pool:
    """``processes`` spawned simulation processes (gRPC does not survive fork)."""

    def __init__(self, processes: int) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(processes):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=serve, args=(child,), daemon=True)
            proc.start()
            self.pipes.append(parent)
            self.procs.append(proc)

    def ask(self, what: str, per_pipe: list[dict] | dict | None = None, only: int | None = None) -> list:
        pipes = list(enumerate(self.pipes)) if only is None else [(only, self.pipes[only])]
        for i, pipe in pipes:
            kwargs = per_pipe[i] if isinstance(per_pipe, list) else (per_pipe or {})
            pipe.send((what, kwargs))
        answers = [pipe.recv() for _, pipe in pipes]
        failed = [a["error"] for a in answers if isinstance(a, dict) and "error" in a]
        if failed:
            raise RuntimeError(f"a simulation process failed: {failed[0]}")
        return answers

    def close(self) -> None:
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:
                pass
        for proc in self.procs:
            proc.join(20)
            if proc.is_alive():
                proc.kill()
                proc.join()


__all__ = ["Gatherer", "PREFIX", "SIM_GRACE", "Part", "Pool", "SharedDecoder", "SimWorker", "ThinNode", "connection", "daemon_thread", "serve"]
