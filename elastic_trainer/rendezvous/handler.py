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
3. **One world at a time** (``watchdog.py``). While training, a watchdog checks at each lease renewal
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
(instead of always waiting ``last_call_timeout``), which is what makes recovery fast, and one
node (the *admitter*) admits everyone waiting in one write while the others wait on a few bytes
(``admission.py``): torch's loop lets N arriving nodes race O(N^2) times.

5. **Live recovery** (``recovery=live``, what ``elastic-train`` sets for its DDP trainer): each
   agent's rendezvous is a world of its own node (``_live_rendezvous``), so torch's agent never
   stops healthy workers for a lost or added node; the workers agree on who trains together in
   the live quorum (``live/group.py``). torch's agent still starts, supervises and restarts
   them. The workers attach their live keys to this agent's lease (its id exported as
   ``ELASTIC_TRAINER_RDZV_LEASE``), so a node costs etcd one lease renewal per interval however
   many workers it runs; when that lease is lost, the workers see their keys gone and exit, and
   come back as newcomers.

6. **The joiner check** (``program.py``): at its first rendezvous a node compares what it runs
   (``ELASTIC_TRAINER_PROGRAM``, from ``elastic-train``) with the records of the run's live nodes,
   and one that differs is refused (``ProgramMismatch``) before it writes anything into the run.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import tempfile
import time
from datetime import timedelta

from torch.distributed import PrefixStore
from torch.distributed.elastic.utils.distributed import get_free_port
from torch.distributed.elastic.events import NodeState
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from elastic_trainer.torch_private import (
    DynamicRendezvousHandler,
    ExitOp,
    JoinOp,
    NodeDesc,
    RendezvousSettings,
    RendezvousState,
    RendezvousTimeout,
    generate_node_desc,
)

from elastic_trainer.rendezvous.admission import EtcdOpExecutor, record_event
from elastic_trainer.etcd.client import EtcdConnection, export_options
from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.etcd.store import EtcdStore
from elastic_trainer.rendezvous.lease import LeaseKeeper
from elastic_trainer.rendezvous.node_lease import AgentRecord
from elastic_trainer.rendezvous.options import RendezvousOptions, launcher_password
from elastic_trainer.rendezvous.program import Program, ProgramMismatch, check as check_program
from elastic_trainer.rendezvous.state import (
    EtcdRendezvousStateHolder,
    decode_state,
    decode_summary,
    encode_state,
    encode_summary,
    node_json,
    node_name,
)
from elastic_trainer.rendezvous.watchdog import MembershipWatchdog

logger = logging.getLogger(__name__)

from elastic_trainer.env import ENV_PROGRAM, ENV_RDZV_LOG, LiveSettings, WorkerEnv  # noqa: E402 - what workers read, defined in env.py

# torch writes heartbeat timestamps into the state whenever the last one is older than
# the settings' keep-alive interval; with leases those writes are pure load, so the
# interval the state machine sees is a year.
NO_STATE_HEARTBEATS = timedelta(days=365)

class EtcdRendezvousHandler(MembershipWatchdog, DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler on etcd v3 with leases and a membership watchdog.

    (``DynamicRendezvousHandler`` is named although ``MembershipWatchdog`` derives from it: the
    check of torch's private names, ``tests/test_torch_private.py``, reads each file's own bases.)"""

    def __init__(self, node: NodeDesc, settings: RendezvousSettings, store: EtcdStore,
                 backend: EtcdRendezvousBackend, conn: EtcdConnection, options: RendezvousOptions,
                 program: Program | None = None) -> None:
        holder = EtcdRendezvousStateHolder(backend, settings)
        super().__init__(node, settings, backend.name, store, holder)
        self._op_executor = EtcdOpExecutor(node, holder, settings)
        self._etcd_backend = backend
        self._conn = conn
        self._options = options
        self.node_name = node_name(node)
        # Live mode: the workers' keys are on this lease too; each renewal is recorded for them
        # (they renew it themselves only when this agent's renewal is late: rendezvous/node_lease.py).
        self._renewals = AgentRecord() if options.recovery == "live" else None
        self._lease = LeaseKeeper(conn, backend.alive_key(self.node_name), options.lease_ttl,
                                  options.keep_alive_interval, self._watch, on_renewed=self._renewals,
                                  tick_later=True)  # the watchdog starts when this node joined a round
        self._joined: tuple[int, int, frozenset[str] | None] | None = None
        """(round, world size, participants' names: None when the rank came from the rank key)."""
        self._rank0 = False  # rank 0 of the last round it joined: it deletes the rank keys at shutdown
        self._program = program  # what this node runs, checked against the run's (program.py); None: unchecked
        self._program_state = "unchecked"  # "checked", or "refused": then nothing of it is in the run
        self._first_round = True
        self._revoked: str | None = None
        self._waiting = 0
        self._alive_count = 0  # live nodes at the watchdog's last look
        self._live_rounds = 0  # worker groups started in live mode
        # The path of the 0600 file that hands the etcd password to workers (never their environment).
        self._password_file: str | None = options.password_file
        self._own_password_file = False

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING, rank: int | None = None) -> None:
        record_event(self, self._settings.run_id, self._this_node, message, node_state, rank)

    # -- torch's API --------------------------------------------------------------------
    @property
    def use_agent_store(self) -> bool:
        return False

    def next_rendezvous(self) -> RendezvousInfo:
        self._joined, self._revoked, self._waiting, self._alive_count = None, None, 0, 0
        mine = self._check_program()
        if self._options.recovery == "live":
            return self._live_rendezvous(mine)
        logger.info("node %s joins the next round of rendezvous '%s'", self.node_name, self._settings.run_id)
        joining_key = self._etcd_backend.joining_key(self.node_name)
        joining_value = json.dumps(node_json(self._this_node)).encode()
        first, self._first_round = self._first_round, False
        if first:
            # This node's descriptor (address, pid, local id) is new: it cannot be in a round
            # yet, so there is nothing to leave (torch reads the whole state to find out), and
            # its joining key goes out with its alive key, in one request.
            self._lease.ensure({joining_key: joining_value, **mine})
            deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
            time.sleep(random.uniform(0, 0.1))
        else:
            self._lease.ensure(mine)
            deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
            self._op_executor.run(ExitOp(), deadline)
            # Only after leaving the last round may others admit this node to the next one.
            self._lease.put(joining_key, joining_value)
        self._op_executor.rejoin = lambda: self._rejoin(joining_key, joining_value)
        try:
            try:
                self._op_executor.run(JoinOp(), deadline, self._get_deadline)
            except RendezvousClosedError:
                # A closed state met at the first join may be a finished job's: start it over and
                # join again (asked only then: at every first join it was a request per node).
                if not first or not self._reopen_finished_run():
                    raise
                self._op_executor.run(JoinOp(), deadline, self._get_deadline)
        finally:
            self._op_executor.rejoin = None
            try:
                self._lease.delete(joining_key)
            except RendezvousError as exc:
                logger.info("could not delete %s (%s); it goes with the lease", joining_key, exc)
        finished = self._op_executor.finished
        if finished is not None:
            # The rank came from this node's own rank key (admission.py): the holder's state is the
            # open round's, read before the round completed; the store prefix is torch's _wrap_store's.
            round_, rank, world_size = finished
            store = PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{round_}", self._store)
            self._joined = (round_, world_size, None)
        else:
            state = self._state_holder.state
            round_ = state.round
            rank, world_size = self._get_world()
            store = self._get_store()
            self._joined = (round_, world_size, frozenset(node_name(n) for n in state.participants))
        # Fresh every round: rank 0 publishes its address and a free port; its rank-0 worker
        # hosts the TCPStore there (use_agent_store is False).
        bootstrap = self._bootstrap(rank, round_)
        self._lease.start_ticking()
        self._export_env(round_)
        self._rank0 = rank == 0
        if rank == 0:
            try:
                if round_ >= 2:
                    self._store.delete_prefix(f"torch.rendezvous.{self._settings.run_id}.{round_ - 2}/")
                if round_ >= 1:
                    self._etcd_backend.delete_ranks_before(round_)
            except RendezvousError as exc:
                logger.info("could not delete the keys of rounds before %d: %s", round_, exc)
        logger.info("node %s joined round %d of rendezvous '%s' as rank %d of %d", self.node_name,
                    round_, self._settings.run_id, rank, world_size)
        return RendezvousInfo(store, rank, world_size, bootstrap)

    def _check_program(self) -> dict[str, bytes]:
        """The joiner check (``program.py``) at the first rendezvous, before this node writes anything
        into the run; returns this node's program record, written on its lease with its alive key."""
        if self._program is None:
            return {}
        if self._program_state == "unchecked":
            try:
                check_program(self._program, self._etcd_backend.programs(), self._settings.run_id)
            except ProgramMismatch:
                self._program_state = "refused"
                raise
            self._program_state = "checked"
        return {self._etcd_backend.program_key(self.node_name): self._program.to_json().encode()}

    def _bootstrap(self, rank: int, round_: int) -> RendezvousStoreInfo:
        """torch's ``RendezvousStoreInfo.build`` (the round's MASTER_ADDR and MASTER_PORT, the same keys
        under the round's store prefix) in one etcd request per node: rank 0 writes its address and a
        free port together, the others read both together. torch's writes and reads them one at a
        time: four requests on rank 0 and two on every other node."""
        prefix = f"torch.rendezvous.{self._settings.run_id}.{round_}/"  # the round's store (``_get_store``)
        keys = [prefix + RendezvousStoreInfo.MASTER_ADDR_KEY, prefix + RendezvousStoreInfo.MASTER_PORT_KEY]
        if rank == 0:
            addr, port = self._this_node.addr, get_free_port()
            self._store.multi_set(keys, [addr.encode(), str(port).encode()])
            return RendezvousStoreInfo(addr, port)
        addr_bytes, port_bytes = self._store.multi_get(keys)
        return RendezvousStoreInfo(addr_bytes.decode(), int(port_bytes.decode()))

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

    def _live_rendezvous(self, mine: dict[str, bytes]) -> RendezvousInfo:
        """Live recovery (``recovery=live``): a world of this node alone, for torch's agent.

        torch's agent starts, watches and restarts this node's workers as usual, but which workers
        train together is agreed by the workers themselves, in the live quorum in etcd
        (``live/group.py``), so a node lost or added never stops the others' workers. The
        node's lease still tells whether this node may run workers at all: if it is lost (a pause,
        a cut from etcd) ``num_nodes_waiting`` makes the agent stop them, and they come back as
        newcomers.
        """
        self._lease.ensure(mine)
        self._live_rounds += 1
        store = PrefixStore(f"live-agent/{self.node_name}/{self._live_rounds}/", self._store)
        bootstrap = RendezvousStoreInfo.build(0, store, local_addr=self._this_node.addr)
        self._joined = (0, 0, frozenset())  # the lease watchdog runs; the round checks do not
        self._lease.start_ticking()
        o, s = self._options, self._settings
        self._export_env(0, LiveSettings(
            min_nodes=s.min_nodes, max_nodes=s.max_nodes, last_call=o.last_call_timeout,
            join_timeout=o.join_timeout, report_timeout=o.report_timeout, lease_ttl=o.lease_ttl,
            keep_alive_interval=o.keep_alive_interval, hang_min=o.hang_min, hang_factor=o.hang_factor))
        logger.info("node %s starts its workers in the live group of run '%s'", self.node_name, s.run_id)
        return RendezvousInfo(store, 0, 1, bootstrap)

    def _reopen_finished_run(self) -> bool:
        """Start over when the run's state says a finished job closed it and nobody is left; True
        when the run is open now (started over here or by another node, or not closed after all).

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
            return True  # not closed (any more), known from a few bytes
        # The state alone first: in a new run there is none (and no summary), and the list of
        # live nodes, read whole, cost every one of 1,000 agents arriving together O(N).
        found = backend.read_state()
        if found is None:
            return True
        data, token = found
        old = decode_state(data)
        if not old.closed:
            return True
        members = {node_name(n) for n in (*old.participants, *old.wait_list, *old.redundancy_list)}
        if members & backend.read()[2]:
            return False
        fresh = RendezvousState()
        fresh.round = old.round + 1
        written = backend.set_state(encode_state(fresh), token, summary=encode_summary(fresh))
        if written is not None and written[2]:  # (a lost swap returns the winner's state, not None)
            logger.info("rendezvous '%s' was closed by a finished job; starting it over at round %d",
                        self._settings.run_id, fresh.round)
            self._store.delete_prefix("")
        return True  # started over here, or by the node that won the swap

    def shutdown(self) -> bool:
        self._joined = None
        if self._program_state == "refused":  # nothing of it is in the run: keep the run's rendezvous open
            self._lease.close(revoke=True)
            return False
        try:
            closed = super().shutdown()
            if closed and self._rank0:  # the last round's rank keys: nobody reads them any more
                try:
                    self._etcd_backend.delete_ranks_before(None)
                except RendezvousError as exc:
                    logger.info("could not delete the rank keys at shutdown: %s", exc)
            return closed
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
    if os.environ.get(ENV_RDZV_LOG):  # e.g. INFO: show what the rendezvous does
        log = logging.getLogger("elastic_trainer.rendezvous")
        if not log.handlers:
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            log.addHandler(h)
        log.setLevel(os.environ[ENV_RDZV_LOG].upper())
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
    program = os.environ.get(ENV_PROGRAM)  # set by elastic-train; plain torchrun runs unchecked
    return EtcdRendezvousHandler(node, settings, store, backend, conn, options,
                                 Program.from_json(program) if program else None)
