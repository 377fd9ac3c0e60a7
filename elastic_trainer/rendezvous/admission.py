"""How the agents of a round get into it: torch's operation loop with one admitter and light waits.

torch's ``DistributedOpExecutor`` runs the rendezvous state machine against the backend: read
the state, ask the state handler (join, exit, ...) what to do, write the state back by
compare-and-swap, and again. Each of N agents arriving together writes itself into the state,
loses O(N) compare-and-swap races, and downloads the whole state (O(N)) each time it changes:
O(N^2) in all, which is what stopped 1,000 agents. ``EtcdOpExecutor`` is that loop with:

- **fresh reads and a short adaptive poll**: every turn reads etcd (no cache), and the pause
  between turns grows with the crowd (50 ms for a few nodes, up to 3 s for a thousand);
- **one admitter**: the smallest live name among the round's participants and the nodes waiting
  to join (their ``joining/`` keys) adds everyone waiting in one write and completes the round;
- **light waits**: the others poll the state's few-byte summary and read the whole state only
  when it changed in a way that concerns them (round complete, next round, closed), when a node
  died, or when they become the admitter; a node not admitted within ``_admission_patience``
  writes itself in as torch does, so a stuck admitter delays a round but never blocks it;
- **early completion**: a round completes as soon as every node with a live lease joined it,
  instead of always waiting ``last_call_timeout``;
- **rank keys**: the node that completes the round writes each participant's rank and the world
  size where that node reads only its own (``etcd_backend.publish_ranks``), and takes rank 0 itself
  (it publishes MASTER_ADDR at once); a waiting node polls its key with the summary, so no node but
  the one that completes the round reads or decodes the state of all N (at 1,000 agents those N
  decodes at the moment of completion took the CPU the lease renewals needed). A node that finds no
  key (a spare, a failed write) reads the state as before. Rank 0 deletes the older rounds' keys,
  and the last round's when the run closes (``handler.py``, ``shutdown``).

The handler (``handler.py``) runs it for ``next_rendezvous``.
"""

from __future__ import annotations

import logging
import inspect
import random
import time

from torch.distributed.elastic.events import NodeState, construct_and_record_rdzv_event
from torch.distributed.elastic.rendezvous.api import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousTimeoutError,
)
from elastic_trainer.torch_private import (
    Action,
    DistributedOpExecutor,
    JoinOp,
    NodeDesc,
    RendezvousContext,
)

from elastic_trainer.rendezvous.etcd_backend import EtcdRendezvousBackend
from elastic_trainer.rendezvous.state import (
    EtcdRendezvousStateHolder,
    decode_summary,
    encode_summary,
    node_name,
)

logger = logging.getLogger(__name__)


def parse_rank(value: bytes | None) -> tuple[int, int] | None:
    """A rank key's ``"<rank> <world size>"`` (``etcd_backend.publish_ranks``), or None when it is
    missing or not a rank below the world size."""
    try:
        rank, world = (int(x) for x in (value or b"").split())
    except ValueError:
        return None
    return (rank, world) if 0 <= rank < world else None


def record_event(obj, run_id: str, node: NodeDesc, message: str, node_state: NodeState,
                 rank: int | None = None) -> None:
    """torch's ``_record`` without ``inspect.stack()``, for ``obj`` (a handler or an operation loop)
    of rendezvous ``run_id``.

    torch names each rendezvous event after the calling method with two ``inspect.stack()``
    calls, which read the source file of every frame: with a thousand agents that was a
    tenth of all CPU time, even though the events go nowhere unless an events handler is set.
    The name here is that of the method that called ``obj``'s ``_record``, from its frame alone
    (``inspect.currentframe``: no source file is read).
    """
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    construct_and_record_rdzv_event(
        name=f"{type(obj).__name__}.{caller.f_code.co_name if caller is not None else '?'}", run_id=run_id,
        message=message, node_state=node_state, hostname=node.addr, pid=node.pid, local_id=node.local_id,
        rank=rank)


def crowd_of(state) -> int:
    """Nodes the state names: participants, waiting and redundant."""
    return len(state.participants) + len(state.wait_list) + len(state.redundancy_list)


def _light_poll(crowd: int) -> float:
    """Seconds between a waiting node's summary polls: 0.3 s at 256 nodes, 1 s from 1,000 to 2,000
    nodes (etcd then serves 1,000 to 2,000 polls a second), growing beyond, 5 s at 10,000. (It was
    2 s at 1,000 nodes: the last nodes learnt that their round was complete up to 2.6 s late.)"""
    return min(0.05 + 0.001 * crowd, max(1.0, crowd / 2000))


class EtcdOpExecutor(DistributedOpExecutor):
    """torch's operation loop with fresh reads, a short adaptive poll and early completion."""

    lost_races = 0
    finished: tuple[int, int, int] | None = None
    """After ``run(JoinOp())``: (round, rank, world size) when this node learnt its rank from its own
    rank key (``etcd_backend.publish_ranks``) instead of the state; the holder's state is then older."""
    _completing = False  # this node marked the round complete: it publishes the ranks once written
    rejoin = None
    """Called at each turn of a join (the handler's ``_rejoin``): a new lease if this one was lost."""

    def _record(self, message: str, node_state: NodeState = NodeState.RUNNING) -> None:
        record_event(self, self._settings.run_id, self._node, message, node_state)

    def run(self, state_handler, deadline: float, update_deadline=None) -> None:
        holder: EtcdRendezvousStateHolder = self._state_holder  # type: ignore[assignment]
        self.finished, self._completing = None, False
        try:
            self._run(holder, state_handler, deadline, update_deadline)
        finally:
            holder.exact_joining, holder.light, holder.tolerate_short = True, False, False

    def _run(self, holder: EtcdRendezvousStateHolder, state_handler, deadline: float, update_deadline) -> None:
        action = None
        self._state = holder.state
        joining = isinstance(state_handler, JoinOp)
        full_next = False  # the next sync reads the member lists (a write was due after a short light sync)
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
            holder.light = not holder.exact_joining and not full_next
            holder.tolerate_short = joining
            full_next = False
            written = holder.sync(use_cache=False)
            if written and self._completing and holder.state.complete:
                self._publish_ranks(holder)
            self._completing = False
            if written is False:
                # Lost a compare-and-swap race: back off in proportion to the crowd, then
                # read afresh, so that N racing agents do not retry in lockstep.
                self.lost_races += 1
                time.sleep(random.uniform(0, min(0.5, 0.0005 * crowd_of(holder.state))))
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
                    if self.finished is not None:
                        return  # complete, with this node's rank read from its own key
                    continue
            if holder.last_light and holder.light_short and action != Action.SYNC:
                full_next = True  # a write after a light sync that counted a dead node: read exactly first
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

    def _mark_rendezvous_complete(self) -> None:
        """torch's ranks (the participants in sorted order), except that the node that completes the
        round takes rank 0 (it swaps with the first): rank 0 publishes the round's MASTER_ADDR and
        MASTER_PORT, which every other node waits for, and the completing node is the one that knows
        first. With rank 0 one of the waiting nodes, the round waited for its next poll (up to 1.3 s
        at 1,000 nodes) before anyone could start."""
        super()._mark_rendezvous_complete()
        participants = self._state.participants
        mine = participants.get(self._node)
        if mine:  # not already 0 (None: a node that completes a round it is not in)
            first = next(n for n, r in participants.items() if r == 0)
            participants[first], participants[self._node] = mine, 0
        self._completing = True

    def _publish_ranks(self, holder: EtcdRendezvousStateHolder) -> None:
        """Write each participant's rank where it reads only its own (after the write that completed
        the round); a failure only sends the waiting nodes to the state, as before."""
        state = holder.state
        try:
            holder.backend.publish_ranks(
                state.round, {node_name(n): r for n, r in state.participants.items()})
        except RendezvousError as exc:
            logger.info("could not publish the ranks of round %d (%s); the nodes read the state", state.round, exc)

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
        backend: EtcdRendezvousBackend = holder.backend
        state = self._state
        expected = decode_summary(encode_summary(state))[:3]  # type: ignore[index]  # round, complete, closed
        waiting_to_join = self._node not in state.participants and not state.complete
        # The crowd is the live nodes, not only those in the state: a node that came early sees
        # an almost empty state, and polled 20 times a second while a thousand others arrived.
        crowd = max(crowd_of(state), holder.alive_count)
        started, alive, admitted = time.monotonic(), holder.alive_count, len(state.participants)
        me = node_name(self._node)
        # Waiting for an open round: poll this node's rank key too; once the round is complete, the
        # node that completed it writes every participant's (``_publish_ranks``), and a node that
        # finds its own is done without reading the state of all N nodes.
        rank_key = None if state.complete or state.closed else backend.rank_key(state.round, me)
        complete_since = None
        while True:
            time.sleep(0.1 if complete_since is not None else _light_poll(crowd) * random.uniform(0.7, 1.3))
            now = time.monotonic()
            summary, count, first, rank = backend.poll_round(rank_key)
            summary = decode_summary(summary)
            if now > deadline or summary is None:
                return
            if rank_key is not None and summary[:3] == (state.round, 1, 0):
                mine = parse_rank(rank)
                if mine is not None and mine[1] == summary[3]:
                    self.finished = (state.round, *mine)
                    return
                # Complete without our key: being written (the node that completed the round writes
                # the keys right after the state), or we are not a participant: read the state.
                complete_since = now if complete_since is None else complete_since
                if now - complete_since < 1.0:
                    continue
            if summary[:3] != expected:
                return
            if count < alive and state.complete:  # a participant died: look closer
                return
            # In an open round a death is the admitter's business (it syncs exactly and removes the
            # dead), and if the admitter died, the next smallest name finds itself first (below).
            # Every waiting node reading the state again at each lost lease was O(N^2).
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
        crowd = max(crowd_of(state), self._state_holder.alive_count)  # type: ignore[attr-defined]
        pause = (0.05 if fast else min(3.0, 0.05 + 0.003 * crowd)) * random.uniform(0.7, 1.3)
        if state.deadline is not None and self._node in state.participants:
            from datetime import datetime, timezone
            until_deadline = (state.deadline - datetime.now(timezone.utc)).total_seconds() + 0.01
            pause = max(0.01, min(pause, until_deadline))
        time.sleep(pause)
