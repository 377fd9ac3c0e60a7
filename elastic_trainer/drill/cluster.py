"""The drill's cluster on this machine: its etcd, network, checkpoint folder and nodes.

:class:`Cluster` sets up what a drill runs on (its own etcd unless ``--rdzv-endpoint``, one network
namespace per node with ``--netns``, a tmpfs for the checkpoints when a fill-disk fault is planned),
starts and kills nodes, and observes them: :meth:`Cluster.poll` notes node exits and workers
started and gone on the timeline, and reads rank 0's step lines, the trainers' events and each
checkpoint's commit as they appear. :meth:`Cluster.cleanup` removes all of it.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TypeVar

from elastic_trainer import records
from elastic_trainer.records import EventRecord, StepRecord
from elastic_trainer.drill.kinds import FAULTS
from elastic_trainer.drill.nodes import Node, start_ticks, workers
from elastic_trainer.drill.scenario import DEFAULT_TRAINER_ARGS, ScenarioError
from elastic_trainer.etcd.server import EtcdServer, dying_with_parent, start_with_auth
from elastic_trainer.etcd.tls import make_certs
from elastic_trainer.env import ENV_GLOO_SOCKET_IFNAME, ENV_PYTHONUNBUFFERED, ENV_TP_SOCKET_IFNAME

logger = logging.getLogger(__name__)
R = TypeVar("R", bound=records.Record)

POLL = 0.1  # seconds between two looks at the nodes and their logs


class _Tail:
    """Reads the new complete lines of growing .jsonl files as records."""

    def __init__(self) -> None:
        self.offsets: dict[Path, tuple[int, int]] = {}  # path -> (bytes read, lines read)

    def read(self, paths, cls: type[R], origin_of) -> list[R]:
        """New records of ``cls`` in ``paths``; ``origin_of(path)`` names their origin."""
        out = []
        for path in paths:
            start, lines = self.offsets.get(path, (0, 0))
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            chunk = data[:end].split(b"\n")
            self.offsets[path] = (start + end + 1, lines + len(chunk))
            for number, line in enumerate(chunk, start=lines + 1):
                record = records.parse_line(line, cls, f"{path}:{number}", origin=origin_of(path))
                if record is not None:
                    out.append(record)
        return out


class Cluster:
    """The etcd, network, checkpoint folder and nodes of one drill, and what they log."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out or f"runs/drill-{stamp}").resolve()
        self.run_id = f"drill-{stamp}-{os.getpid()}"
        self.rng = random.Random(args.seed)
        self.nodes: list[Node] = []
        self.timeline: list[dict] = []
        self.r0: list[StepRecord] = []  # rank-0 step lines as they appear (origin: the node)
        self.events: list[EventRecord] = []
        self.commits: dict[int, float] = {}  # checkpoint step -> commit time (manifest mtime)
        self._tail = _Tail()
        self.etcd: EtcdServer | None = None
        self.etcd_conf = ""  # the --rdzv-conf options (TLS files, user, password file) of the drill's etcd
        self.network = None
        self.tmpfs: Path | None = None
        adds = sum(f.kind == "add-node" for f in args.faults)
        self.max_nodes = args.nodes + adds
        self.trainer_args = DEFAULT_TRAINER_ARGS + shlex.split(args.trainer_args or "")

    # ---- set-up and clean-up

    def setup(self) -> None:
        """Make the output folders; start the network, the tmpfs and etcd this drill needs."""
        earlier = [name for name in ("nodes", "report.json", "etcd") if (self.out / name).exists()]
        if earlier:  # the report reads every step line under nodes/: an earlier drill's would count
            raise ScenarioError(f"--out {self.out} holds an earlier drill's results ({', '.join(earlier)}); "
                                f"give a new folder or remove it")
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "nodes").mkdir(exist_ok=True)
        host = "127.0.0.1"
        if self.args.netns:
            from elastic_trainer.drill import netns
            netns.sweep_stale()
            self.network = netns.Network()
            self.network.up()
            host = self.network.host_address
        if any(f.kind == "fill-disk" for f in self.args.faults):
            self.tmpfs = self.out / "ckpt-tmpfs"
            self.tmpfs.mkdir(exist_ok=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_size}", "tmpfs",
                                   str(self.tmpfs)], capture_output=True, text=True)
            if done.returncode != 0:
                self.tmpfs.rmdir()
                self.tmpfs = None
                raise ScenarioError(f"fill-disk needs a tmpfs (root): mount failed: {done.stderr.strip()}")
            self.checkpoint_dir = str(self.tmpfs / "checkpoints")
        else:
            self.checkpoint_dir = self.args.checkpoint_dir or str(self.out / "checkpoints")
        if self.args.rdzv_endpoint:
            self.endpoint = self.args.rdzv_endpoint
        elif self.args.rdzv_backend == "c10d":
            from elastic_trainer.etcd.server import free_port
            self.endpoint = f"{host}:{free_port(host)}"
        else:
            # As the embedded etcd: authentication on (any user of this machine reaches the port),
            # the password in a 0600 file; on the bridge also TLS with client certificates (the
            # rendezvous sends a password to an address other than loopback only over TLS).
            tls = make_certs(self.out / "etcd-tls", [host]) if self.network is not None else None
            self.etcd = EtcdServer(data_dir=self.out / "etcd", host=host, log_path=self.out / "etcd.log",
                                   extra_args=tls.server_flags() if tls is not None else None)
            conf = start_with_auth(self.etcd, self.out / "etcd-password", tls)
            self.etcd_conf = ",".join(f"{k}={v}" for k, v in conf.items())
            self.endpoint = self.etcd.endpoint
        logger.info("drill %s: out %s, endpoint %s, checkpoints %s", self.run_id, self.out, self.endpoint,
                    self.checkpoint_dir)

    def cleanup(self) -> None:
        """Stop everything the cluster started; every step runs even when another fails."""
        steps = [("nodes", self.stop_all_nodes), ("etcd", self._stop_etcd), ("netns", self._teardown_net),
                 ("tmpfs", self._unmount)]
        for name, step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - clean-up goes on; the error is logged with its trace
                logger.exception("drill clean-up of %s failed", name)

    def stop_all_nodes(self) -> None:
        """SIGKILL every node and every worker ever seen that still runs; wait for the agents."""
        for node in self.nodes:
            if node.alive:
                node.signal(signal.SIGKILL)
                if node.state in ("running", "stopped", "cut"):
                    node.state = "killed"
        for node in self.nodes:
            node.kill_leftovers()
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("node %s (pid %s) did not exit after SIGKILL", node.name, node.proc.pid)

    def _stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def _teardown_net(self) -> None:
        if self.network is not None:
            self.network.teardown()
            self.network = None

    def _unmount(self) -> None:
        if self.tmpfs is not None:
            done = subprocess.run(["umount", str(self.tmpfs)], capture_output=True, text=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(self.tmpfs)], capture_output=True)
            self.tmpfs.rmdir()
            self.tmpfs = None

    # ---- nodes

    def start_node(self) -> Node:
        """Start one more node (``node-<i>``, logs in ``<out>/nodes/node-<i>/``) and return it."""
        index = len(self.nodes)
        log_dir = self.out / "nodes" / f"node-{index}"
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"{self.args.min_nodes}:{self.max_nodes}",
               "--nproc-per-node", str(self.args.nproc_per_node), "--rdzv-backend", self.args.rdzv_backend,
               "--rdzv-endpoint", self.endpoint, "--run-id", self.run_id, "--log-dir", str(log_dir),
               "--checkpoint-dir", self.checkpoint_dir, "--max-restarts", "1000"]
        if getattr(self.args, "recovery", None):
            cmd += ["--recovery", self.args.recovery]
        rdzv_conf = ",".join(c for c in (self.etcd_conf, self.args.rdzv_conf) if c)
        if rdzv_conf:
            cmd += ["--rdzv-conf", rdzv_conf]
        env = {**os.environ, ENV_PYTHONUNBUFFERED: "1"}
        for kind in sorted({f.kind for f in self.args.faults}):  # e.g. hang's debug hook, on every node
            env.update(FAULTS[kind].node_env)
            cmd += list(FAULTS[kind].node_args)
        net = None
        if self.network is not None:
            from elastic_trainer.drill import netns
            net = self.network.add_node(index)
            cmd += ["--local-addr", net.address]
            env.update({ENV_GLOO_SOCKET_IFNAME: netns.INSIDE_IFNAME, ENV_TP_SOCKET_IFNAME: netns.INSIDE_IFNAME})
        if self.args.script:
            cmd.append(str(Path(self.args.script).resolve()))
        cmd += ["--", *self.trainer_args]
        if net is not None:
            cmd = self.network.wrap(net, cmd)
        with open(log_dir / "agent.log", "ab") as log:
            cmd, preexec = dying_with_parent(cmd)  # setpriv: no fork-time code beside the drill's gRPC threads
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env, preexec_fn=preexec)
        node = Node(index, log_dir, proc, net)
        self.nodes.append(node)
        self.note(node.name, "node_started", pid=proc.pid, cmd=shlex.join(cmd))
        return node

    def note(self, node: str | None, what: str, **extra) -> None:
        """Add what happened (to ``node``, or to the drill) now to the timeline."""
        self.timeline.append({"time": time.time(), "node": node, "what": what, **extra})

    def members(self) -> list[Node]:
        """The nodes the job counts now: alive and running, stopped or cut off."""
        return [n for n in self.nodes if n.alive and n.state in ("running", "stopped", "cut")]

    def poll(self) -> None:
        """Observe: node exits, worker processes started and gone, new log lines."""
        for node in self.nodes:
            if not node.alive:
                if node.state in ("running", "stopped", "cut"):
                    node.state = "exited"
                    self.note(node.name, "node_exited", code=node.proc.returncode)
                if node.workers:
                    self.note(node.name, "workers_gone", pids=sorted(node.workers))
                    node.workers = set()
                continue
            if node.term_deadline and time.time() > node.term_deadline:
                node.signal(signal.SIGKILL)
                self.note(node.name, "term_grace_over_killed")
                node.term_deadline = None
            kids = set(workers(node.proc.pid))
            gone, new = node.workers - kids, kids - node.workers
            if gone:
                self.note(node.name, "workers_gone", pids=sorted(gone))
            if new:
                self.note(node.name, "workers_started", pids=sorted(new))
                for pid in new:
                    node.seen[pid] = start_ticks(pid)
            node.workers = kids
        dirs = list((self.out / "nodes").glob("node-*"))
        # Every worker's file: under live recovery a process changes rank when its world re-forms,
        # so rank 0's lines are the lines that say rank 0, not those of the file named rank-0.
        lines = self._tail.read([f.path for d in dirs for f in records.step_files(d)], StepRecord,
                                lambda path: path.parent.parent.name)  # <node dir>/steps/<file>
        self.r0.extend(s for s in lines if s.rank == 0)
        self.r0.sort(key=lambda s: s.time)
        self.events.extend(self._tail.read([records.events_path(d) for d in dirs], EventRecord,
                                           lambda path: path.parent.name))
        self.scan_commits()

    def scan_commits(self) -> None:
        """Record each checkpoint's commit (its manifest's mtime) before retention prunes it."""
        root = Path(self.checkpoint_dir)
        if "://" in self.checkpoint_dir or not root.is_dir():
            return
        for manifest in root.glob("step-*/manifest.json"):
            step = manifest.parent.name[5:]
            if step.isdigit() and int(step) not in self.commits:
                try:
                    self.commits[int(step)] = manifest.stat().st_mtime
                except FileNotFoundError:
                    continue

    @property
    def latest(self) -> StepRecord | None:
        """Rank 0's newest step line, or None before the first step."""
        return self.r0[-1] if self.r0 else None

    def node(self, name: str | None) -> Node | None:
        """The node called ``name`` (``node-<i>``), or None."""
        return next((n for n in self.nodes if n.name == name), None)

    def pick(self, target: str) -> Node | None:
        """The running node that ``target`` (node:N, rank0, random) names now, or None."""
        live = [n for n in self.nodes if n.alive and n.state == "running"]
        if target == "random":
            return self.rng.choice(live) if live else None
        if target == "rank0":
            name = self.latest.origin if self.latest else None
            return next((n for n in live if n.name == name), None)
        index = int(target.split(":")[1])
        return next((n for n in live if n.index == index), None)

    def kill(self, node: Node) -> None:
        """SIGKILL a node's process groups; wait up to 5 s for its agent to exit."""
        groups = node.signal(signal.SIGKILL)
        node.state = "killed"
        self.note(node.name, "node_killed", pgids=sorted(groups))
        try:
            node.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("node %s still there 5 s after SIGKILL", node.name)
