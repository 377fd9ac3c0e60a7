"""One member of a live group forming its process group, as a process of its own (``tests/test_live_formation.py``).

    python -m tests.helpers.forming_member ENDPOINT RUN_ID NODE ROLE [--lease-ttl 2]

The process is a whole node: its agent's lease (a ``LeaseKeeper`` with its renewal record) and one
worker's ``LiveGroup`` on it, made as ``elastic-train`` makes them, with the Manager's wiring of a
silent loss (``on_member_lost`` abandons the group: ``training/abandon.py``). It joins a quorum of
two nodes, then by ``ROLE``:

- ``wait``: prints ``joined`` and waits (the test kills or stops it: a member lost right after the
  quorum formed, before its process group);
- ``init``: prints ``joined``, then makes the process group on the group's store
  (``init_process_group``, a 300 s timeout) and prints ``grouped``;
- ``receive``: as ``init``, then waits for the other rank's state (a broadcast from it), as a
  newcomer waits in the state transfer;
- ``grouped``: as ``init``, then waits (the test stops it during the others' state transfer).

Every line is ``<what> <time.monotonic()> [details]``; a wait that fails prints ``failed <t>
<type>: <message>`` and exits 3.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import sys
import time

import torch
import torch.distributed as dist

from elastic_trainer.live.group import LiveGroup
from elastic_trainer.rendezvous.lease import LeaseKeeper
from elastic_trainer.rendezvous.node_lease import AgentRecord
from elastic_trainer.training.abandon import GroupAbandon
from tests.helpers.common import etcd_conn
from tests.helpers.live_nodes import settings


def say(what: str, details: str = "") -> None:
    print(f"{what} {time.monotonic():.6f} {details}".rstrip(), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("run_id")
    p.add_argument("node")
    p.add_argument("role", choices=["wait", "init", "receive", "grouped"])
    p.add_argument("--lease-ttl", type=int, default=2)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    live = settings(min_nodes=2, max_nodes=2, last_call=30.0, lease_ttl=args.lease_ttl, keep_alive_interval=0.5)
    agent_conn = etcd_conn(args.endpoint)
    record = AgentRecord()
    agent = LeaseKeeper(agent_conn, f"/{args.run_id}/alive/{args.node}", ttl=args.lease_ttl, interval=0.5,
                        on_renewed=record)
    agent.ensure()
    host, port = args.endpoint.rsplit(":", 1)
    abandon = GroupAbandon("gloo", [(host, int(port))])  # etcd's connections are not the group's
    group = LiveGroup.make(etcd_conn(args.endpoint), f"/{args.run_id}/", args.node, 0, 1, "127.0.0.1", live,
                           agent.lease_id, on_member_lost=abandon.abandon)
    q = group.join()
    say("joined", str(q.rank_of(group.id)))
    if args.role == "wait":
        time.sleep(600)
        return 0
    try:
        with abandon.recording():
            dist.init_process_group("gloo", store=group.store(), rank=q.rank_of(group.id), world_size=q.world_size,
                                    timeout=datetime.timedelta(seconds=300))
        say("grouped")
        if args.role == "grouped":
            time.sleep(600)
        elif args.role == "receive":
            state = torch.zeros(4)
            dist.broadcast(state, src=1 - q.rank_of(group.id))
            say("received")
    except Exception as exc:  # noqa: BLE001 - what the test asserts on
        say("failed", f"{type(exc).__name__}: {exc}".replace("\n", " "))
        return 3
    return 0


if __name__ == "__main__":
    from elastic_trainer.runtime import exit_without_teardown

    exit_without_teardown(main())  # gloo may abort in the interpreter's teardown after a clean run (runtime.py says how)
