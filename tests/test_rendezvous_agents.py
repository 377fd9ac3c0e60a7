"""Real torchrun agents on the etcd-v3 rendezvous: nodes die, pause and join; one world at a time.

Each node is ``python -m torch.distributed.run --rdzv-backend etcd-v3`` (found through the
``torchrun.handlers`` entry point) with one ``benchmarks/rdzv_worker.py`` worker that logs every
allreduce step with its round and world size. The step logs are the evidence.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from benchmarks.rdzv_worker import agent_cmd, read_steps, signal_tree, world_problems, world_summary
from tests.helpers.common import wait_until
from tests.helpers.runs import CONF

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


class Nodes:
    """Starts agents (one worker each) of one run and waits on their step logs."""

    def __init__(self, procs, etcd, run_id, tmp_path):
        self.procs, self.etcd, self.run_id, self.tmp = procs, etcd, run_id, tmp_path
        self.out = str(tmp_path / "steps")
        self.started = []

    def start(self, name: str, conf: str = CONF) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        env = dict(os.environ, ELASTIC_TRAINER_RDZV_LOG="INFO", LOGLEVEL="INFO")
        proc = self.procs.start(agent_cmd(self.etcd.endpoint, self.run_id, self.out, nnodes="1:3", conf=conf,
                                          worker_args=("--sleep", "0.05")),
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        self.started.append(proc)
        return proc

    def wait_for(self, what: str, pred, timeout: float = 90) -> list[dict]:
        def worlds_and_logs() -> str:
            logs = {p.name: p.read_text()[-1500:] for p in self.tmp.glob("*.log")}
            return f"worlds {world_summary(read_steps(self.out))}; agent logs: {logs}"

        return wait_until(lambda: read_steps(self.out), timeout, what, until=pred, details=worlds_and_logs)

    def kill_all(self) -> None:
        for proc in self.started:
            signal_tree(proc.pid, signal.SIGKILL)


@pytest.fixture
def nodes(procs, etcd, run_id, tmp_path):
    n = Nodes(procs, etcd, run_id, tmp_path)
    try:
        yield n
    finally:
        n.kill_all()


def _after(steps, t, world):
    """Steps at ``world`` that entered their allreduce after ``t`` (see ``world_problems``)."""
    return [s for s in steps if s["start"] > t and s["world_size"] == world]


def test_node_killed_survivor_continues_then_a_new_node_grows_the_world(nodes):
    a = nodes.start("a")
    b = nodes.start("b")
    nodes.wait_for("a world of 2", lambda st: len({s["pid"] for s in st if s["world_size"] == 2}) == 2)

    killed_at = time.time()
    signal_tree(b.pid, signal.SIGKILL)  # the agent and its worker
    steps = nodes.wait_for("the survivor at world size 1", lambda st: len(_after(st, killed_at, 1)) >= 3)
    assert {s["rank"] for s in _after(steps, killed_at, 1)} == {0}
    assert a.poll() is None

    joined_at = time.time()
    nodes.start("c")
    steps = nodes.wait_for("a world of 2 with the new node",
                           lambda st: len({s["pid"] for s in _after(st, joined_at, 2)}) == 2
                           and len(_after(st, joined_at, 2)) >= 6)
    assert {s["rank"] for s in _after(steps, joined_at, 2)} == {0, 1}
    assert all(s["sum"] == s["world_size"] for s in steps)
    assert world_problems(read_steps(nodes.out)) == []


def test_paused_node_past_its_lease_never_trains_in_a_second_world(nodes):
    a = nodes.start("a")
    nodes.start("b")
    nodes.wait_for("a world of 2", lambda st: len({s["pid"] for s in st if s["world_size"] == 2}) == 2)

    stopped_at = time.time()
    signal_tree(a.pid, signal.SIGSTOP)  # the whole node: agent and worker
    try:
        nodes.wait_for("b alone at world size 1", lambda st: len(_after(st, stopped_at, 1)) >= 3)
        time.sleep(1)
    finally:
        resumed_at = time.time()
        signal_tree(a.pid, signal.SIGCONT)
    # The paused node finds its lease gone, stops its stale worker and rejoins: world of 2 again.
    steps = nodes.wait_for("a world of 2 after the pause",
                           lambda st: len({s["pid"] for s in _after(st, resumed_at, 2)}) == 2
                           and len(_after(st, resumed_at, 2)) >= 6)
    rounds = sorted({int(s["round"]) for s in steps})
    assert len(rounds) >= 3, rounds
    assert world_problems(steps) == []


@pytest.mark.trial  # 20 s; the same etcd restart under live recovery (the default) is
# test_live_recovery's short etcd outage, and the client's retries are test_etcd_client's
def test_etcd_restart_during_training_does_not_stop_the_job(procs, run_id, tmp_path):
    from elastic_trainer.etcd.server import EtcdServer

    server = EtcdServer(data_dir=tmp_path / "etcd-data", log_path=tmp_path / "etcd-server.log")
    server.start()
    n = Nodes(procs, server, run_id, tmp_path)
    try:
        a = n.start("a")
        n.start("b")
        steps = n.wait_for("a world of 2", lambda st: len({s["pid"] for s in st if s["world_size"] == 2}) == 2)
        round_ = steps[-1]["round"]
        down_at = time.time()
        server.kill()  # SIGKILL, data kept
        time.sleep(4)
        server.start()  # same data dir and port
        up_at = time.time()
        # etcd was gone for longer than lease_ttl - keep_alive_interval (3 - 1 s): the nodes could
        # not prove their membership, so they stopped their workers (no second world could form
        # if this had been a partition) and rejoined when etcd answered. The job lives on.
        steps = n.wait_for("a world of 2 again after the etcd restart",
                           lambda st: len({s["pid"] for s in _after(st, up_at, 2)}) == 2
                           and len(_after(st, up_at, 2)) >= 6)
        assert all(s["world_size"] == 2 for s in steps if s["time"] > down_at)
        assert all(p.poll() is None for p in n.started), "no agent may die of an etcd restart"
        assert int(steps[-1]["round"]) >= int(round_)
        # And the rendezvous works again: a node dies, the survivor goes on alone.
        killed_at = time.time()
        signal_tree(n.started[1].pid, signal.SIGKILL)
        n.wait_for("the survivor at world size 1 after the etcd restart",
                   lambda st: len(_after(st, killed_at, 1)) >= 3)
        assert a.poll() is None
        assert world_problems(read_steps(n.out)) == []
    finally:
        n.kill_all()
        server.stop()


class _CuttableProxy:
    """A loopback TCP forwarder to etcd that a test can cut, like a network partition of one node."""

    def __init__(self, target: str) -> None:
        import socket
        import threading

        host, port = target.rsplit(":", 1)
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._conns: list = []
        self._lock = threading.Lock()
        self._cut = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    client.close()
                    continue
                upstream = socket.create_connection(self._target)
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def cut(self) -> None:
        import socket

        with self._lock:
            self._cut = True
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
        self._listener.close()


def test_nodes_cut_off_from_etcd_stop_training_before_a_newcomer_forms_a_new_world(procs, etcd, run_id, tmp_path):
    """Nodes a and b reach etcd through a proxy that is cut while their gloo links stay up (the
    drill found this when a bridge lost etcd for 40 s). Node c, which reaches etcd, sees their
    leases expire and forms a world alone: a and b must have stopped training before that."""
    proxy = _CuttableProxy(etcd.endpoint)
    n = Nodes(procs, etcd, run_id, tmp_path)
    try:
        n.etcd = type("ProxiedEtcd", (), {"endpoint": proxy.endpoint})()
        n.start("a")
        n.start("b")
        n.wait_for("a world of 2", lambda st: len({s["pid"] for s in st if s["world_size"] == 2}) == 2)
        cut_at = time.time()
        proxy.cut()
        n.etcd = etcd
        n.start("c")
        steps = n.wait_for("node c alone at world size 1", lambda st: len(_after(st, cut_at, 1)) >= 5)
        assert world_problems(steps) == [], world_problems(steps)
        alone_from = min(s["time"] for s in _after(steps, cut_at, 1))
        old_world_last = max(s["time"] for s in steps if s["world_size"] == 2)
        assert old_world_last < alone_from, "the cut-off nodes' world trained beside the new one"
        # The first of a and b to stop did so on its own lease check (their gloo links were up); the
        # other may do the same, or its worker fails first when the peer's worker is gone.
        logs = {name: (tmp_path / f"{name}.log").read_text() for name in ("a", "b")}
        assert any("has not been renewed" in log for log in logs.values()), logs["a"][-2000:]
        for log in logs.values():
            assert "has not been renewed" in log or "Worker group FAILED" in log, log[-2000:]
    finally:
        n.kill_all()
        proxy.cut()
