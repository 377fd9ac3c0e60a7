"""The ``etcd-v3`` rendezvous handler: torch's dynamic rendezvous on etcd v3, with leases.

A *rendezvous* is the barrier at which torchrun's agents agree who trains: each
*round* admits between min and max nodes and gives each a rank. When a node dies or
a node asks to join, the agents stop their workers and meet in the next round.

This is torch's ``DynamicRendezvousHandler`` (the state machine of the c10d backend)
with four changes:

1. **State as JSON** (``state.py``) in one etcd key written by compare-and-swap
   (``etcd_backend.py``); nothing read from etcd is unpickled.
2. **Liveness by etcd leases.** Each node keeps ``<prefix>alive/<node>`` alive on a
   lease (``lease_ttl``, renewed every ``keep_alive_interval``). A node is dead when etcd
   expired its lease, never because a peer's clock says its heartbeat is old; the state
   carries no periodic heartbeat writes.
3. **One world at a time.** While training, a watchdog checks at each lease renewal
   that this node's lease lives, that the round it joined is still the current one
   with this node in it, and that every participant of that round still holds its
   lease. If not, ``num_nodes_waiting()`` answers >0 and torch's agent stops its
   workers and re-rendezvouses; a node learns of a lost lease (after a pause, say)
   before it may rejoin, and gets a new lease only from ``next_rendezvous`` (after the
   agent stopped its workers). A new round cannot start while a participant of the
   last one still holds its lease without having left: torch's state machine moves to
   the next round only once every participant exited (after stopping its workers) or
   was removed, and we remove only lease-expired nodes.
4. **Fresh bootstrap store every round.** torch's handler shares the agent's TCP store
   with workers by default and caches its address from the first round on every
   non-rank-0 node; after rank 0 changes (the old rank 0 died) workers dial a store
   that no longer exists and time out waiting for MASTER_ADDR. Here
   ``use_agent_store`` is False and every round publishes a new MASTER_ADDR/PORT
   (a free port on the new rank 0), where the rank-0 worker hosts the TCPStore.

It also completes a round as soon as every node with a live lease has joined it
(instead of always waiting ``last_call_timeout``), which is what makes recovery fast.

5. **Live recovery** (``recovery=live``, what ``elastic-train`` sets for its DDP trainer): each
   agent's rendezvous is a world of its own node (``_live_rendezvous``), so torch's agent never
   stops healthy workers for a lost or added node; the workers agree on who trains together in
   the live quorum (``rendezvous/quorum.py``). torch's agent still starts, supervises and restarts
   them. The workers attach their live keys to this agent's lease (its id exported as
   ``ELASTIC_TRAINER_RDZV_LEASE``), so a node costs etcd one lease renewal per interval however
   many workers it runs; when that lease is lost, the workers see their keys gone and exit, and
   come back as newcomers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import sys
import tempfile
import time
from datetime import timedelta

from torch.distributed import PrefixStore
from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
)
from elastic_trainer.rendezvous.torch_private import (
    Action,
    DistributedOpExecutor,
    DynamicRendezvousHandler,
    ExitOp,
    JoinOp,
    NodeDesc,
    RendezvousContext,
    RendezvousSettings,
    RendezvousState,
    RendezvousTimeout,
    generate_node_desc,
)

from elastic_trainer.rendezvous.etcd_client import EtcdConnection, export_options
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.rendezvous.etcd_store import EtcdStore
from elastic_trainer.rendezvous.lease import LeaseKeeper
from elastic_trainer.rendezvous.node_lease import AgentRecord
from elastic_trainer.rendezvous.options import RendezvousOptions, launcher_password
from elastic_trainer.rendezvous.state import (
    EtcdRendezvousStateHolder,
    decode_state,
    decode_summary,
    encode_state,
    encode_summary,
    node_json,
    node_name,
)

logger = logging.getLogger(__name__)

from elastic_trainer.env import LiveSettings, WorkerEnv  # noqa: E402 - what workers read, defined in env.py

# torch writes heartbeat timestamps into the state whenever the last one is older than
# the settings' keep-alive interval; with leases those writes are pure load, so the
# interval the state machine sees is a year.
NO_STATE_HEARTBEATS = timedelta(days=365)

def _record(obj, node: NodeDesc, message: str, node_state: NodeState, rank: int | None = None) -> None:
    """torch's ``_record`` without ``inspect.stack()``.

    torch names each rendezvous event after the calling method with two ``inspect.stack()``
    calls, which read the source file of every frame: with a thousand agents that was a
    tenth of all CPU time, even though the events go nowhere unless an events handler is set.
    The caller's name comes from its frame here.
    """
    construct_and_record_rdzv_event(
        name=f"{type(obj).__name__}.{sys._getframe(2).f_code.co_name}", run_id=obj._settings.run_id,
        message=message, node_state=node_state, hostname=node.addr, pid=node.pid, local_id=node.local_id,
        rank=rank)


def _crowd(state) -> int:
    return len(state.participants) + len(state.wait_list) + len(state.redundancy_list)


class _EtcdOpExecutor(DistributedOpExecutor):
    """torch's operation loop with fresh reads, a short adaptive poll and early completion."""

    lost_races = 0
    rejoin = None
    """Called at each turn of a join (the handler's ``_rejoin``): a new lease if this one was lost."""

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        _record(self, self._node, message, node_state)

    def run(self, state_handler, deadline: float, update_deadline=None) -> None:
        holder: EtcdRendezvousStateHolder = self._state_holder  # type: ignore[assignment]
        try:
            self._run(holder, state_handler, deadline, update_deadline)
        finally:
            holder.exact_joining, holder.light = True, False

    def _run(self, holder: EtcdRendezvousStateHolder, state_handler, deadline: float, update_deadline) -> None:
        action = None
        self._state = holder.state
        joining = isinstance(state_handler, JoinOp)
        while action != Action.FINISH:
            if joining and self.rejoin is not None:
                self.rejoin()
            # Only a node that admits needs the exact joining list: the admitter, or a node the
            # admitter kept waiting too long (it writes itself in with everyone waiting). The
            # others keep a lazy one (see etcd_backend._Members), which names the admitter as
            # well: a name in it whose key is gone belongs to a node already admitted, or a dead one.
            holder.exact_joining = self._is_admitter(holder) or time.monotonic() < self._bypass_gate_until
            # The others read light (no member lists; state.py): they only need the state, how
            # many nodes live and who admits. A node that finds itself the admitter reads exactly next.
            holder.light = not holder.exact_joining
            if holder.sync(use_cache=False) is False:
                # Lost a compare-and-swap race: back off in proportion to the crowd, then
                # read afresh, so that N racing agents do not retry in lockstep.
                self.lost_races += 1
                time.sleep(random.uniform(0, min(0.5, 0.0005 * _crowd(holder.state))))
                holder.sync(use_cache=False)
            self._state = holder.state
            ctx = RendezvousContext(self._node, self._state, self._settings)
            try:
                action = state_handler(ctx, deadline)
            except RendezvousGracefulExitError as exc:
                # A spare (beyond max nodes) when the run finished. torch's agent turns this error
                # into a run() that returns None, which its launcher then fails on (AttributeError,
                # status 1: a Job would recreate the pod); a closed rendezvous is what happened.
                raise RendezvousClosedError(f"the rendezvous of run '{self._settings.run_id}' is closed "
                                            f"(the job finished) while this node waited as a spare") from exc
            if action == Action.FINISH:
                continue
            if action == Action.ERROR_CLOSED:
                raise RendezvousClosedError(f"the rendezvous of run '{self._settings.run_id}' is closed "
                                            f"(the job finished or was shut down)")
            if action == Action.ERROR_TIMEOUT:
                raise RendezvousTimeoutError(
                    f"the rendezvous of run '{self._settings.run_id}' did not complete in time "
                    f"(join_timeout {self._settings.timeout.join.total_seconds():g}s); fewer than "
                    f"min nodes ({self._settings.min_nodes}) joined")
            joining_op = isinstance(state_handler, JoinOp)
            if action == Action.SYNC and joining_op and self._everyone_alive_has_joined(holder):
                action = Action.MARK_RENDEZVOUS_COMPLETE
            if joining_op and action in (Action.SYNC, Action.ADD_TO_PARTICIPANTS):
                if self._is_admitter(holder):
                    if not holder.joining_exact or holder.last_light:
                        continue  # the admitter acts on the list: the next sync reads it exactly
                    if self._admit_joining():
                        holder.mark_dirty()  # admit everyone waiting in one write
                        continue
                if self._may_wait_lightly(holder, action):
                    self._wait_lightly(holder, deadline)
                    continue
            if action == Action.SYNC:
                self._pause(fast=joining_op and self._is_admitter(holder))
                continue
            if action == Action.KEEP_ALIVE:
                self._keep_alive()
            elif action == Action.ADD_TO_PARTICIPANTS:
                self._add_to_participants()
            elif action == Action.ADD_TO_WAIT_LIST:
                self._add_to_wait_list()
            elif action == Action.ADD_TO_REDUNDANCY_LIST:
                self._add_to_redundancy_list()
            elif action == Action.REMOVE_FROM_PARTICIPANTS:
                self._remove_from_participants()
            elif action == Action.REMOVE_FROM_WAIT_LIST:
                self._remove_from_wait_list()
            elif action == Action.REMOVE_FROM_REDUNDANCY_LIST:
                self._remove_from_redundancy_list()
                if update_deadline:
                    deadline = update_deadline(self._settings.timeout.join)
            elif action == Action.MARK_RENDEZVOUS_COMPLETE:
                self._mark_rendezvous_complete()
            elif action == Action.MARK_RENDEZVOUS_CLOSED:
                self._mark_rendezvous_closed()
            holder.mark_dirty()

    def _add_to_participants(self) -> None:
        """Add this node, and with it every live node waiting to join (up to max nodes).

        torch adds one node per compare-and-swap write, so N nodes arriving together
        need N writes and lose O(N^2) races; the ``joining/`` keys let one writer admit
        everyone already waiting in one write.
        """
        super()._add_to_participants()
        self._admit_joining()

    def _admit_joining(self) -> bool:
        """Add the live nodes waiting to join (``joining/`` keys) to this round; True if any was added."""
        state, holder = self._state, self._state_holder
        if state.complete or state.closed or not holder.joining_exact or holder.last_light:  # type: ignore[attr-defined]
            return False
        from datetime import datetime, timezone
        now = datetime.now(timezone.utc)
        added = 0
        for node in self._state_holder.joining:  # type: ignore[attr-defined]
            if len(state.participants) >= self._settings.max_nodes:
                break
            if node in state.participants or node in state.redundancy_list:
                continue
            state.participants[node] = 0
            state.wait_list.discard(node)
            state.last_heartbeats[node] = now
            added += 1
        if added:
            if len(state.participants) >= self._settings.min_nodes and state.deadline is None:
                state.deadline = now + self._settings.timeout.last_call
            if len(state.participants) == self._settings.max_nodes:
                self._mark_rendezvous_complete()
        return added > 0

    # -- one admitter, light waits ------------------------------------------------------
    # With every node writing itself into the state, N nodes arriving together lose O(N)
    # compare-and-swap races each, and every waiting node downloads the whole state (O(N))
    # each time it changes: O(N^2) in all, which is what stopped 1,000 agents. So one node,
    # the *admitter* (the smallest live name among the round's participants and the nodes
    # waiting to join), admits everyone and completes the round; the others poll only the
    # state's few-byte summary and what is new under alive/ and joining/, and read the whole
    # state when the summary changes (round complete, next round, closed), when a participant
    # lost its lease, or when they become the admitter. A node that is not admitted within
    # ``_admission_patience`` writes itself in, as torch does, so a stuck admitter delays but
    # never blocks a round.

    _bypass_gate_until = 0.0

    _admitter_memo: tuple = (None, None, None, None)

    def _admitter(self, holder: EtcdRendezvousStateHolder) -> str | None:
        if holder.last_light:  # every node of the round holds its joining key until the round completes
            return holder.first_joining
        state, alive, joining, name = self._admitter_memo
        if state is self._state and alive is holder.alive and joining is holder.joining:
            return name  # asked up to three times per loop; the inputs are new objects when they change
        names = {node_name(n) for n in self._state.participants}
        names.update(node_name(n) for n in holder.joining)
        names &= holder.alive
        name = min(names) if names else None
        self._admitter_memo = (self._state, holder.alive, holder.joining, name)
        return name

    def _is_admitter(self, holder: EtcdRendezvousStateHolder) -> bool:
        state = self._state
        return not state.complete and not state.closed and self._admitter(holder) == node_name(self._node)

    def _admission_patience(self, crowd: int) -> float:
        """Seconds a node waits to be admitted while the admitter admits nobody."""
        return 2.0 + 0.005 * crowd

    def _may_wait_lightly(self, holder: EtcdRendezvousStateHolder, action: Action) -> bool:
        state = self._state
        if state.closed:
            return False
        if state.complete:  # waiting in the wait list for the next round
            return action == Action.SYNC
        if action == Action.ADD_TO_PARTICIPANTS and (
                time.monotonic() < self._bypass_gate_until or
                (not holder.last_light and self._node not in holder.joining)):
            return False  # the admitter cannot see us (yet), or it kept us waiting too long
        admitter = self._admitter(holder)
        return admitter is not None and admitter != node_name(self._node)

    def _wait_lightly(self, holder: EtcdRendezvousStateHolder, deadline: float) -> None:
        """Poll the summary until the state changed in a way that may concern this node.

        (An etcd watch on the summary instead of polls was tried: at 1,000 agents it woke every
        waiter at each admission write and took longer, 37.6 s against 25.3 s.)
        """
        backend: EtcdRendezvousBackend = holder._backend  # type: ignore[attr-defined]
        state = self._state
        expected = decode_summary(encode_summary(state))[:3]  # type: ignore[index]  # round, complete, closed
        waiting_to_join = self._node not in state.participants and not state.complete
        # The crowd is the live nodes, not only those in the state: a node that came early sees
        # an almost empty state, and polled 20 times a second while a thousand others arrived.
        crowd = max(_crowd(state), holder.alive_count)
        started, alive, admitted = time.monotonic(), holder.alive_count, len(state.participants)
        me = node_name(self._node)
        while True:
            time.sleep(min(2.0, 0.05 + 0.002 * crowd) * random.uniform(0.7, 1.3))
            now = time.monotonic()
            summary, count, first = backend.poll_round()
            summary = decode_summary(summary)
            if now > deadline or summary is None or summary[:3] != expected:
                return
            if count < alive:  # a node died (perhaps the admitter, or a participant): look closer
                return
            if first == me and holder.last_light and not state.complete:  # we admit now (those before us left)
                return
            alive, crowd = count, max(crowd, count, summary[3] + summary[4])
            if summary[3] != admitted:  # the admitter is at work: patience starts over
                started, admitted = now, summary[3]
            if waiting_to_join and now - started > self._admission_patience(crowd):
                self._bypass_gate_until = now + 1.0
                return
            if now - started > max(5.0, 0.01 * crowd):  # a full read now and then regardless
                return

    def _everyone_alive_has_joined(self, holder: EtcdRendezvousStateHolder) -> bool:
        """True when this round has min..max participants, us among them, and no other live node
        (never after a light sync: it does not know which nodes live)."""
        state, alive = self._state, holder.alive
        n = len(state.participants)
        if holder.last_light or state.complete or state.closed or self._node not in state.participants or state.deadline is None:
            return False
        if not self._settings.min_nodes <= n <= self._settings.max_nodes:
            return False
        return alive <= {node_name(p) for p in state.participants}

    def _pause(self, fast: bool = False) -> None:
        state = self._state
        # 50 ms for a few nodes, up to 3 s for a thousand: every waiting node reads the state
        # (the admitter, alone in reading it often, waits 50 ms).
        crowd = max(_crowd(state), self._state_holder.alive_count)  # type: ignore[attr-defined]
        pause = (0.05 if fast else min(3.0, 0.05 + 0.003 * crowd)) * random.uniform(0.7, 1.3)
        if state.deadline is not None and self._node in state.participants:
            from datetime import datetime, timezone
            until_deadline = (state.deadline - datetime.now(timezone.utc)).total_seconds() + 0.01
            pause = max(0.01, min(pause, until_deadline))
        time.sleep(pause)


class EtcdRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler on etcd v3 with leases and a membership watchdog."""

    def __init__(self, node: NodeDesc, settings: RendezvousSettings, store: EtcdStore,
                 backend: EtcdRendezvousBackend, conn: EtcdConnection, options: RendezvousOptions) -> None:
        holder = EtcdRendezvousStateHolder(backend, settings)
        super().__init__(node, settings, backend.name, store, holder)
        self._op_executor = _EtcdOpExecutor(node, holder, settings)
        self._etcd_backend = backend
        self._conn = conn
        self._options = options
        self.node_name = node_name(node)
        # Live mode: the workers' keys are on this lease too; each renewal is recorded for them
        # (they renew it themselves only when this agent's renewal is late: rendezvous/node_lease.py).
        self._renewals = AgentRecord() if options.recovery == "live" else None
        self._lease = LeaseKeeper(conn, backend.alive_key(self.node_name), options.lease_ttl,
                                  options.keep_alive_interval, self._watch, on_renewed=self._renewals)
        self._joined: tuple[int, frozenset[str]] | None = None
        self._first_round = True
        self._revoked: str | None = None
        self._waiting = 0
        self._alive_count = 0  # live nodes at the watchdog's last look
        self._live_rounds = 0  # worker groups started in live mode
        # The path of the 0600 file that hands the etcd password to workers (never their environment).
        self._password_file: str | None = options.password_file
        self._own_password_file = False

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        _record(self, self._this_node, message, node_state, rank)

    # -- torch's API --------------------------------------------------------------------
    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        self._joined, self._revoked, self._waiting, self._alive_count = None, None, 0, 0
        if self._options.recovery == "live":
            return self._live_rendezvous()
        logger.info("node %s joins the next round of rendezvous '%s'", self.node_name, self._settings.run_id)
        self._lease.ensure()
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        if self._first_round:
            # This node's descriptor (address, pid, local id) is new: it cannot be in a round
            # yet, so there is nothing to leave (torch reads the whole state to find out).
            self._first_round = False
            self._reopen_finished_run()
            time.sleep(random.uniform(0, 0.1))
        else:
            self._op_executor.run(ExitOp(), deadline)
        # Only after leaving the last round may others admit this node to the next one.
        joining_key = self._etcd_backend.joining_key(self.node_name)
        joining_value = json.dumps(node_json(self._this_node)).encode()
        self._lease.put(joining_key, joining_value)
        self._op_executor.rejoin = lambda: self._rejoin(joining_key, joining_value)
        try:
            self._op_executor.run(JoinOp(), deadline, self._get_deadline)
        finally:
            self._op_executor.rejoin = None
            try:
                self._lease.delete(joining_key)
            except RendezvousError as exc:
                logger.info("could not delete %s (%s); it goes with the lease", joining_key, exc)
        state = self._state_holder.state
        rank, world_size = self._get_world()
        store = self._get_store()
        # Fresh every round: rank 0 publishes its address and a free port; its rank-0 worker
        # hosts the TCPStore there (use_agent_store is False).
        bootstrap = RendezvousStoreInfo.build(rank, store, local_addr=self._this_node.addr)
        self._joined = (state.round, frozenset(node_name(n) for n in state.participants))
        self._export_env(state.round)
        if rank == 0 and state.round >= 2:
            try:
                self._store.delete_prefix(f"torch.rendezvous.{self._settings.run_id}.{state.round - 2}/")
            except RendezvousError as exc:
                logger.info("could not delete the store keys of round %d: %s", state.round - 2, exc)
        logger.info("node %s joined round %d of rendezvous '%s' as rank %d of %d", self.node_name,
                    state.round, self._settings.run_id, rank, world_size)
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def _rejoin(self, joining_key: str, joining_value: bytes) -> None:
        """While this node waits to join: when etcd expired its lease (etcd or this node too slow
        to renew in time), take a new one and write the alive and joining keys again. The node has
        no workers now, so it may; without this it stayed invisible to the admitter, wrote itself
        into the state after its patience, and every node that saw its key gone wrote it out again:
        at 1,000 simulated agents under load, 60,000 state writes in two minutes and no round."""
        if not self._lease.lost:
            return
        logger.warning("node %s: its etcd lease expired while it waited to join; taking a new one",
                       self.node_name)
        try:
            self._lease.ensure()
            self._lease.put(joining_key, joining_value)
        except RendezvousError as exc:
            logger.warning("node %s: could not take a new etcd lease yet: %s", self.node_name, exc)

    def _live_rendezvous(self) -> RendezvousInfo:
        """Live recovery (``recovery=live``): a world of this node alone, for torch's agent.

        torch's agent starts, watches and restarts this node's workers as usual, but which workers
        train together is agreed by the workers themselves, in the live quorum in etcd
        (``rendezvous/quorum.py``), so a node lost or added never stops the others' workers. The
        node's lease still tells whether this node may run workers at all: if it is lost (a pause,
        a cut from etcd) ``num_nodes_waiting`` makes the agent stop them, and they come back as
        newcomers.
        """
        self._lease.ensure()
        self._live_rounds += 1
        store = PrefixStore(f"live-agent/{self.node_name}/{self._live_rounds}/", self._store)
        bootstrap = RendezvousStoreInfo.build(0, store, local_addr=self._this_node.addr)
        self._joined = (0, frozenset())  # the lease watchdog runs; the round checks do not
        o, s = self._options, self._settings
        self._export_env(0, LiveSettings(
            min_nodes=s.min_nodes, max_nodes=s.max_nodes, last_call=o.last_call_timeout,
            join_timeout=o.join_timeout, report_timeout=o.report_timeout, lease_ttl=o.lease_ttl,
            keep_alive_interval=o.keep_alive_interval, hang_min=o.hang_min, hang_factor=o.hang_factor))
        logger.info("node %s starts its workers in the live group of run '%s'", self.node_name, s.run_id)
        return RendezvousInfo(store, 0, 1, bootstrap)

    def _reopen_finished_run(self) -> None:
        """Start over when the run's state says a finished job closed it and nobody is left.

        torch closes the rendezvous when a job ends; its c10d store vanishes with the job,
        but etcd keeps the closed state, so running the same run id again (the embedded etcd
        keeps its data in the log dir) would fail at once. A closed state none of whose nodes
        is alive belongs to a finished job: replace it (compare-and-swap) by a fresh one whose
        round numbers continue, so that round fences stay unique. Other live nodes that are not
        in it are newcomers like this one (a re-created Kubernetes Job starts every pod at once;
        each used to see the others alive and leave the state closed, and every node failed);
        one of them wins the swap. A live node of the closed state (the job is ending, or a
        late joiner while it still runs) keeps it closed.
        """
        backend = self._etcd_backend
        summary = decode_summary(backend.poll_summary()[0])
        if summary is not None and not summary[2]:
            return  # not closed (the common case), known from a few bytes
        # The state alone first: in a new run there is none (and no summary), and the list of
        # live nodes, read whole, cost every one of 1,000 agents arriving together O(N).
        found = backend.read_state()
        if found is None:
            return
        data, token = found
        old = decode_state(data)
        if not old.closed:
            return
        members = {node_name(n) for n in (*old.participants, *old.wait_list, *old.redundancy_list)}
        if members & backend.read()[2]:
            return
        fresh = RendezvousState()
        fresh.round = old.round + 1
        if backend.set_state(encode_state(fresh), token, summary=encode_summary(fresh)) is not None:
            logger.info("rendezvous '%s' was closed by a finished job; starting it over at round %d",
                        self._settings.run_id, fresh.round)
            self._store.delete_prefix("")

    def num_nodes_waiting(self) -> int:
        if self._joined is not None and self._revoked is None and \
                self._lease.seconds_since_renewal_attempt() > self._options.lease_ttl:
            # This process was paused (or starved) for longer than a lease: find out now.
            self._lease.refresh()
            self._watch()
        if self._joined is not None and self._revoked is None and self._options.recovery != "live":
            # (Live mode: this agent's round is a world of its own node, and which workers train
            # together is the live quorum's business: each worker's key is on this node's lease
            # and the worker exits when etcd expired it, quorum changes are compare-and-swaps,
            # commits are fenced.
            # Stopping healthy workers here would turn a short etcd outage into a restart.)
            unrenewed = self._lease.seconds_since_renewal()
            if unrenewed > self._options.lease_ttl - self._options.keep_alive_interval:
                # Cut off from etcd (or etcd is down): the lease may run out any moment and the
                # others may form a round without us. Stop our workers before that can happen,
                # so that two worlds never train at once; we rejoin when etcd answers again.
                self._revoke(f"its etcd lease has not been renewed for {unrenewed:.1f}s "
                             f"(lease_ttl {self._options.lease_ttl:g}s)")
        if self._revoked is not None:
            return max(1, self._waiting)
        return self._waiting

    def shutdown(self) -> bool:
        self._joined = None
        try:
            return super().shutdown()
        finally:
            self._lease.close(revoke=True)
            if self._renewals is not None:
                self._renewals.close()
            if self._own_password_file and self._password_file:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._password_file)

    # torch's heartbeat timer, switched off: liveness is the lease (LeaseKeeper). Both names are in
    # torch_private.METHODS: a torch that renamed them fails its check instead of writing heartbeats.
    def _start_heartbeats(self) -> None:
        pass

    def _stop_heartbeats(self) -> None:
        pass

    # -- membership watchdog ------------------------------------------------------------
    def _revoke(self, reason: str) -> None:
        if self._revoked is None:
            logger.warning("node %s: %s; stopping its workers to rejoin", self.node_name, reason)
            self._revoked = reason

    def _watch(self) -> None:
        joined = self._joined
        if joined is None or self._revoked is not None:
            return
        if self._lease.lost and self._options.recovery == "live":
            # This node was paused or cut off past its lease (the agent alone being paused costs
            # nothing: its workers renew the node's lease meanwhile, rendezvous/node_lease.py).
            # Its workers' live keys were on that lease and went with it: each worker's watch
            # sees its own key gone and the worker exits by itself; the agent restarts them
            # (``_live_rendezvous`` exports the new lease) and they join as newcomers. The agent
            # just takes a new lease.
            try:
                self._lease.ensure()
            except Exception as exc:  # noqa: BLE001 - etcd out of reach: tried again at the next tick
                logger.warning("node %s: its etcd lease expired and a new one cannot be taken yet: %s",
                               self.node_name, exc)
                return
            logger.warning("node %s: its etcd lease expired (paused or cut off); took a new one; its workers "
                           "found their keys gone with it and rejoin as newcomers", self.node_name)
            return
        if self._lease.lost:
            self._revoke("its etcd lease expired")
            return
        if self._options.recovery == "live":
            return  # membership is the live quorum's business (rendezvous/quorum.py)
        round_, members = joined
        try:
            # The summary and the count of live nodes, a few bytes: the whole state and the
            # live names only when the round changed or fewer nodes are alive than last time.
            summary, count = self._etcd_backend.poll_summary(retry_timeout=self._options.keep_alive_interval)
            summary = decode_summary(summary)
            if summary is not None and summary[:4] == (round_, 1, 0, len(members)) and \
                    count >= max(self._alive_count, len(members)):
                self._waiting, self._alive_count = summary[4], count
                return
            if summary is not None and summary[:4] == (round_, 1, 0, len(members)) and count < len(members):
                # Fewer nodes alive than the round has participants: one of them is dead, and the
                # names would not change what this node does. (Every node reading the state and
                # every live name here, at each lost lease, was O(N^2): at 1,000 simulated agents
                # those reads took the CPU that the renewals needed, and more leases ran out.)
                self._revoke(f"{len(members) - count} participant(s) of round {round_} lost their etcd lease "
                             f"({count} of {len(members)} nodes alive)")
                return
            data, _, alive = self._etcd_backend.read(retry_timeout=self._options.keep_alive_interval)
            self._alive_count = len(alive)
        except RendezvousConnectionError as exc:
            logger.warning("watchdog could not read the rendezvous state: %s", exc)
            return
        if data is None:
            self._revoke("the rendezvous state vanished from etcd")
            return
        state = decode_state(data)
        self._waiting = len(state.wait_list)
        if state.closed:
            return
        if state.round != round_ or not state.complete or self._this_node not in state.participants:
            self._revoke(f"round {round_} is over (etcd is at round {state.round}, "
                         f"complete={state.complete})")
            return
        dead = sorted(members - alive)
        if dead:
            self._revoke(f"participant(s) {', '.join(dead)} of round {round_} lost their etcd lease")

    def _export_env(self, round_: int, live: LiveSettings | None = None) -> None:
        """What the workers read (``WorkerEnv``), set in this agent's environment, which torch's
        agent copies into each worker's: the round, where the run's keys are, this node, how to
        reach etcd, and in live mode the live quorum's settings."""
        o = self._options.etcd
        os.environ.update(WorkerEnv(
            rdzv_round=round_, rdzv_prefix=self._etcd_backend.prefix, rdzv_node=self.node_name,
            rdzv_endpoint=WorkerEnv.from_environ().rdzv_endpoint or o.endpoint_text,
            rdzv_conn=export_options(o, self._worker_password_file()), live=live,
            rdzv_lease=self._lease.lease_id if live is not None else None).to_environ())

    def _worker_password_file(self) -> str | None:
        """The 0600 file through which workers get the etcd password: the ``password_file`` the
        node was given, or (a password from the launcher's environment or from ``password=``) a
        private temporary file, removed at shutdown."""
        if self._password_file is None and self._options.etcd.password:
            fd, path = tempfile.mkstemp(prefix="elastic-trainer-rdzv-")  # mode 0600
            with os.fdopen(fd, "w") as f:
                f.write(self._options.etcd.password)
            self._password_file, self._own_password_file = path, True
        return self._password_file


def create_handler(params: RendezvousParameters) -> EtcdRendezvousHandler:
    """Build the etcd-v3 handler from torchrun's ``RendezvousParameters``."""
    if os.environ.get("ELASTIC_TRAINER_RDZV_LOG"):  # e.g. INFO: show what the rendezvous does
        log = logging.getLogger("elastic_trainer.rendezvous")
        if not log.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(h)
        log.setLevel(os.environ["ELASTIC_TRAINER_RDZV_LOG"].upper())
    options = RendezvousOptions(params)
    # Also without a user: the launcher's password env var must not reach the workers.
    launcher_password()
    conn = EtcdConnection(options.etcd)
    backend = EtcdRendezvousBackend(conn, params.run_id, options.key_prefix)
    store = EtcdStore(conn, backend.prefix + "store/")
    settings = RendezvousSettings(
        params.run_id, params.min_nodes, params.max_nodes,
        RendezvousTimeout(join=timedelta(seconds=options.join_timeout),
                          last_call=timedelta(seconds=options.last_call_timeout),
                          close=timedelta(seconds=options.close_timeout),
                          heartbeat=timedelta(seconds=options.heartbeat_timeout)),
        keep_alive_interval=NO_STATE_HEARTBEATS, keep_alive_max_attempt=3)
    node = generate_node_desc(params.local_addr)
    return EtcdRendezvousHandler(node, settings, store, backend, conn, options)
