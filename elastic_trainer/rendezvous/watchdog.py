"""The membership watchdog: one world at a time while a round trains.

While training, the handler's lease keeper calls ``_watch`` at each lease renewal interval: it
checks that this node's lease lives, that the round it joined is still the current one with this
node in it, and that every participant of that round still holds its lease. If not,
``num_nodes_waiting()`` answers >0 and torch's agent stops its workers and re-rendezvouses; a
node learns of a lost lease (after a pause, say) before it may rejoin, and gets a new lease only
from ``next_rendezvous`` (after the agent stopped its workers). A node cut off from etcd for
longer than its lease can be trusted stops its workers before the others may form a round
without it. Most checks cost a few bytes: the state's summary and the count of live nodes; the
whole state and the live names are read only when the round changed or fewer nodes live.

``MembershipWatchdog`` is torch's handler with these checks; ``EtcdRendezvousHandler``
(``handler.py``) derives from it and sets the attributes they read (``_joined``, ``_revoked``,
``_waiting``, ``_alive_count``, ``_lease``, ``_options``, ``_etcd_backend``, ``node_name``).
"""

from __future__ import annotations

import logging

from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

from elastic_trainer.torch_private import DynamicRendezvousHandler

from elastic_trainer.rendezvous.state import decode_state, decode_summary, node_name

logger = logging.getLogger(__name__)


class MembershipWatchdog(DynamicRendezvousHandler):
    """torch's handler whose ``num_nodes_waiting`` answers >0 when this node's round no longer stands."""

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
            return  # membership is the live quorum's business (live/group.py)
        round_, world, members = joined
        try:
            # The summary and the count of live nodes, a few bytes: the whole state and the
            # live names only when the round changed or fewer nodes are alive than last time.
            summary, count = self._etcd_backend.poll_summary(retry_timeout=self._options.keep_alive_interval)
            summary = decode_summary(summary)
            if summary is not None and summary[:4] == (round_, 1, 0, world) and \
                    count >= max(self._alive_count, world):
                self._waiting, self._alive_count = summary[4], count
                return
            if summary is not None and summary[:4] == (round_, 1, 0, world) and count < world:
                # Fewer nodes alive than the round has participants: one of them is dead, and the
                # names would not change what this node does. (Every node reading the state and
                # every live name here, at each lost lease, was O(N^2): at 1,000 simulated agents
                # those reads took the CPU that the renewals needed, and more leases ran out.)
                self._revoke(f"{world - count} participant(s) of round {round_} lost their etcd lease "
                             f"({count} of {world} nodes alive)")
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
        if len(state.participants) < world:  # a participant was removed: it lost its lease
            self._revoke(f"{world - len(state.participants)} participant(s) of round {round_} left it "
                         f"(their etcd lease ended)")
            return
        if members is None:  # the rank came from its rank key: the names are the state's
            members = frozenset(node_name(n) for n in state.participants)
        dead = sorted(members - alive)
        if dead:
            self._revoke(f"participant(s) {', '.join(dead)} of round {round_} lost their etcd lease")
