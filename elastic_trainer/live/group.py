"""``LiveGroup``: one worker's membership of the live quorum, composed of the parts of ``live/``.

Under ``--recovery live`` (the default) every agent's rendezvous is a world of its own node
(``rendezvous/handler.py``, live mode): torchrun still starts, supervises and restarts the
workers, but *which workers train together* is decided by the workers through etcd. A worker's
``LiveGroup`` is the one object the training side (the ``Manager``, ``training/manager.py``) talks
to; it is made of parts that each do one thing and meet through their public methods:

| part | module | what it does |
| --- | --- | --- |
| ``keys`` | ``live/keys.py`` | the live keys in etcd, and every transaction on them |
| ``lease`` | ``live/worker_lease.py`` | this worker's keys on its node's lease; leaving when it is gone |
| ``membership`` | ``live/membership.py`` | joining, the quorum held, the change waited for |
| ``watcher`` | ``live/watcher.py`` | the thread that watches leases, stalls and joiners (its view: ``live/view_keeper.py``) |
| ``reformer`` | ``live/reform.py`` | the re-form round: reports, one proposer, the next quorum |
| ``progress`` | ``live/progress.py`` | the training thread's step clock, which the hang bound is judged by |

The life of a member: ``join()`` waits until a quorum includes it and starts the watcher (from then
on, also while a process group forms, a member's loss is seen); ``store()`` is the store its
process group is made on (``live/group_store.py``: its waits end once a member is gone);
while training, ``change_pending`` says the group must re-form (shared at the next step-end
agreement), ``on_member_lost`` is called when the collectives in flight must fail now, and
``check_lease()`` before each step ends a worker whose lease is gone; ``reform()`` after a failure
or at an agreed step gives the next quorum; ``finish()`` (rank 0) and ``close()`` end it. The group
is also the checkpoint commit's fence (``rendezvous/fence.Fence``: ``prefix``, ``token``, ``etcd``,
``guard()``): the quorum number and this worker's lease.

**Threads.** Every thread is started through the ``start_thread`` it is made with (by default the
process's runtime, ``runtime().start_thread``; ``live/threads.py`` lists them), and no part ends the process:
``on_lease_lost`` and ``on_hung`` do (the Manager exits through its runtime). Design and numbers:
docs/trainer.md, "Live recovery".
"""

from __future__ import annotations

import datetime
import os
import threading
from collections.abc import Callable

from elastic_trainer.env import LiveSettings, WorkerEnv
from elastic_trainer.live.group_store import GroupStore, StoreWatch
from elastic_trainer.live.keys import Change, LiveKeys
from elastic_trainer.live.membership import Membership
from elastic_trainer.live.probe import ProbeListener, resolvable
from elastic_trainer.live.progress import Progress
from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.live.reform import Reform
from elastic_trainer.live.stream import StreamFactory, WatchStream
from elastic_trainer.live.threads import StartThread, start_in_runtime
from elastic_trainer.live.watcher import Watcher
from elastic_trainer.live.worker_lease import WorkerLease
from elastic_trainer.etcd.client import EtcdConnection, options_from_export

Callback = Callable[[str], None]
Callback0 = Callable[[], None]


class LiveGroup:
    """This worker's membership of the live quorum of its run (see the module docstring), made of
    ``keys``, ``membership`` (with its ``lease``) and ``progress``; the watcher and the re-form are
    made here. ``probe``: this process's probe listener, closed with the group (None: the probe
    address in ``membership.me`` is someone else's to keep). ``make`` builds one from a connection,
    ``from_env`` from a worker's environment."""

    def __init__(self, keys: LiveKeys, membership: Membership, progress: Progress, *,
                 start_thread: StartThread = start_in_runtime, probe: ProbeListener | None = None,
                 on_member_lost: Callback | None = None, on_hung: Callback | None = None, probe_peers: bool = False,
                 stream_factory: StreamFactory = WatchStream) -> None:
        self.keys, self.membership, self.lease, self.progress = keys, membership, membership.lease, progress
        self.settings: LiveSettings = membership.settings
        self.probe = probe
        """This process's probe listener (closed with the group), or None where it is another's."""
        self.watcher = Watcher(keys, membership, self.lease, progress, self.settings, start_thread,
                               on_member_lost=self._member_lost, on_hung=self._hung, stream_factory=stream_factory)
        self.reformer = Reform(keys, membership, self.lease, self.watcher, self.settings, start_thread, stream_factory)
        self.on_member_lost = on_member_lost
        """Called from the watcher thread when the group's collectives in flight must fail now (a
        member's lease expired or it left, a stall was declared, a member's process is gone): the
        Manager abandons its process group (gloo: shuts its connections; NCCL: aborts it)."""
        self.on_hung = on_hung
        """Called from the watcher when this worker's training thread is stuck while its peers
        re-form without it (it must end the process: the Manager exits; its agent starts a newcomer)."""
        self.probe_peers = probe_peers
        self._start_thread, self._stream_factory = start_thread, stream_factory
        self.stores = StoreWatch()
        """What the standing watch on every quorum's store delivered (``store()``), from ``join`` on."""
        self._unwatch_stores: Callback0 | None = None
        self._closed = False

    @classmethod
    def make(cls, conn: EtcdConnection, run_prefix: str, node: str, local_rank: int, nproc: int, host: str,
             settings: LiveSettings, lease_id: int, *, start_thread: StartThread = start_in_runtime,
             on_lease_lost: Callback | None = None, on_member_lost: Callback | None = None,
             on_hung: Callback | None = None, probe_peers: bool = False,
             stream_factory: StreamFactory = WatchStream) -> LiveGroup:
        """The group of worker ``local_rank`` of ``nproc`` on ``node``, its keys on the node's lease
        ``lease_id`` (the agent's), its probe port on ``host``. ``on_lease_lost(reason)`` is called
        when etcd no longer knows the lease: the others may already train without this worker, so
        it must end it (default: ``check_lease`` raises ``LiveExcluded``). ``stream_factory``: how
        its etcd watch streams are made (``live/stream.py``)."""
        keys = LiveKeys(conn, run_prefix)
        probe = ProbeListener(host, start_thread)
        me = Member(f"{node}-{local_rank}-{os.getpid()}", node, local_rank, probe.address)
        lease = WorkerLease(keys, me.id, lease_id, settings.lease_ttl, settings.keep_alive_interval, on_lease_lost)
        try:
            lease.ensure()
        except BaseException:
            probe.close()
            raise
        lease.start(start_thread)
        membership = Membership(keys, lease, me, nproc, settings)
        return cls(keys, membership, Progress(settings.hang_min, settings.hang_factor), start_thread=start_thread,
                   probe=probe, on_member_lost=on_member_lost, on_hung=on_hung, probe_peers=probe_peers,
                   stream_factory=stream_factory)

    @classmethod
    def from_env(cls, env: WorkerEnv, *, start_thread: StartThread = start_in_runtime,
                 on_lease_lost: Callback | None = None, on_member_lost: Callback | None = None,
                 on_hung: Callback | None = None, probe_peers: bool = False) -> LiveGroup | None:
        """The live group of this worker when its agent runs the etcd-v3 rendezvous in live mode
        (``env.live`` set), else None."""
        if env.live is None:
            return None
        if not (env.rdzv_conn and env.rdzv_node and env.rdzv_prefix and env.rdzv_lease is not None):
            raise ValueError("the live settings are in the environment but not the rendezvous's etcd connection, "
                             "node, prefix and lease; start workers through `elastic-train` (the etcd-v3 handler "
                             "sets them)")
        # The password is not in the environment: the export names the 0600 file that holds it.
        options = options_from_export(env.rdzv_conn, retry_timeout=15.0)
        node = env.rdzv_node
        host = resolvable(node.rsplit("_", 2)[0] if node.count("_") >= 2 else "127.0.0.1")
        return cls.make(EtcdConnection(options), env.rdzv_prefix, node, env.local_rank or 0,
                        env.local_world_size or 1, host, env.live, env.rdzv_lease, start_thread=start_thread,
                        on_lease_lost=on_lease_lost, on_member_lost=on_member_lost, on_hung=on_hung,
                        probe_peers=probe_peers)

    # ---- who -----------------------------------------------------------------------------------
    @property
    def id(self) -> str:
        return self.membership.id

    @property
    def me(self) -> Member:
        return self.membership.me

    @property
    def quorum(self) -> Quorum | None:
        """The quorum this worker trains in (None before ``join``)."""
        return self.membership.quorum

    @property
    def conn(self) -> EtcdConnection:
        return self.keys.conn

    @property
    def probe_peers(self) -> bool:
        """Also probe one member of every other node each poll (NCCL: a collective may hang on a
        dead peer instead of failing; gloo's fail when the peer's sockets close)."""
        return self.watcher.probe_peers

    @probe_peers.setter
    def probe_peers(self, value: bool) -> None:
        self.watcher.probe_peers = value

    # ---- joining and re-forming ----------------------------------------------------------------
    def join(self) -> Quorum:
        """Wait until a quorum includes this worker (as a newcomer, or in a cold start), then watch.
        While it waits, a watch on the quorum key wakes it once the key changes: a newcomer learns
        the quorum that admits it within a watch event of its write, not at its next look (every
        20 ms), while the members wait for it to form the group. Its standing watch on every
        quorum's store starts first (``stores``, closed with the group), so that the members'
        addresses are there when its group forms."""
        if self._unwatch_stores is None:  # established while it waits: the group's addresses come as set
            self._unwatch_stores = self.watch(self.keys.key("store/"), self.stores.reset, self.stores.changed)
        woken = threading.Event()
        unwatch = self.watch(self.keys.key("quorum"), woken.set)
        try:
            q = self.membership.join(woken)
        finally:
            unwatch()
        self.reformer.prepare(q)
        self.watcher.start()
        return q

    def reform(self, step: int, cause: str, report_timeout: float | None = None) -> Quorum:
        """After a failure (or at an agreed step, for a join): the next quorum with this worker in it,
        after it completed ``step``. Raises ``LiveExcluded`` when it formed without this worker."""
        return self.reformer.reform(step, cause, report_timeout)

    def store(self) -> GroupStore:
        """A fresh torch ``Store`` in etcd for the current quorum's process group (no process hosts
        it); its waits end once a member of the quorum is gone."""
        q = self.quorum
        assert q is not None, "store() before join()"
        return GroupStore(self.keys, q, self.id, lambda: self.watcher.loss_of(q),
                          datetime.timedelta(seconds=max(5.0, self.settings.report_timeout * 3)), watched=self.stores)

    def watch(self, key: str, on_change: Callback0, on_events: Callable[[list[Change]], None] | None = None
              ) -> Callback0:
        """Call ``on_change()`` whenever ``key`` (every key under it, when it ends with ``/``) changes
        in etcd (with ``on_events``: ``on_events(changes)`` instead), on a watch stream of its own
        (``live/stream.py``), and ``on_change()`` when that stream is (re-)established; returns what
        stops it. It adds no read: a waiter looks again when told."""
        stream = self._stream_factory(self.keys.conn, [key], on_change, on_events=on_events)
        self._start_thread("live-key-watch", stream.run, stop=stream.close)
        return stream.close

    def forget_old(self) -> None:
        """Rank 0, once its group is up: delete what no one reads any more."""
        self.membership.forget_old()

    # ---- while training ------------------------------------------------------------------------
    @property
    def change_pending(self):
        """A ``threading.Event`` set while the group must re-form (a node asks to join, a member was lost)."""
        return self.membership.change_pending

    @property
    def change_reason(self) -> str:
        return self.membership.change_reason

    def start_watching(self) -> None:
        """Make sure the watcher runs (``join`` starts it)."""
        self.watcher.start()

    def check_lease(self) -> None:
        """Before a step: end this worker (``on_lease_lost``) when its lease is gone."""
        self.lease.check()

    def wake(self) -> None:
        """Make the watcher look now (a slow phase began)."""
        self.watcher.wake()

    def _member_lost(self, reason: str) -> None:
        if self.on_member_lost is not None:
            self.on_member_lost(reason)

    def _hung(self, reason: str) -> None:
        if self.on_hung is not None:
            self.on_hung(reason)

    # ---- the end -------------------------------------------------------------------------------
    def finish(self) -> None:
        """Rank 0 at the end of training: mark the run finished, so that waiting newcomers exit 0
        and the members' leaving is no loss."""
        self.membership.finish()

    def close(self) -> None:
        """Leave: the watcher stops, and this worker's ``alive`` key is marked as left and deleted,
        so that the others see at once that it is gone, and that it left."""
        if self._closed:
            return
        self._closed = True
        if self._unwatch_stores is not None:
            self._unwatch_stores()
        self.watcher.close()
        self.reformer.close()
        if self.probe is not None:
            self.probe.close()
        self.lease.close()

    # ---- the checkpoint commit's fence (rendezvous/fence.Fence) ---------------------------------
    @property
    def prefix(self) -> str:
        """``<run prefix>live/``: the commit record's key is made from it."""
        return self.keys.prefix

    @property
    def token(self) -> str:
        return f"quorum-{self.quorum.q if self.quorum else 0}"

    @property
    def etcd(self) -> EtcdConnection:
        """The ``EtcdConnection`` of the live group (for writes guarded by ``guard()``)."""
        return self.keys.conn

    def guard(self):
        """The fencing token (``rendezvous.fence.Guard``) of this worker's quorum and lease, or
        ``FencedError`` when either is over."""
        return self.keys.guard(self.quorum, self.id)

    def fence_check(self) -> None:
        """Raise ``FencedError`` unless this worker's quorum is current and its lease lives."""
        self.guard()


__all__ = ["LiveGroup"]
