"""What nodes say of their checks before a join (``observability/check_board.py``), in a real etcd:
the device speeds a node compares with (other hosts', the same device only), the refused nodes'
lines (on a lease, taken back when the node passes), and the device check run in a process of its
own (``health.check_devices_apart``, a GPU node's path, here on the CPU).

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_check_board.py -q
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest
import torch

from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions, parse_endpoints
from elastic_trainer.observability import health
from elastic_trainer.observability.check_board import REFUSED, SPEEDS, CheckBoard, device_label, read_refused
from elastic_trainer.observability.health import HealthConfig

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def board_of(etcd, run_id):
    options = EtcdOptions(endpoints=parse_endpoints(etcd.endpoint), retry_timeout=3.0)
    prefix = f"/elastic-trainer/{run_id}/"
    boards: list[CheckBoard] = []
    conn = EtcdConnection(options)

    def make(host: str, node: str | None = None) -> CheckBoard:
        boards.append(CheckBoard(options, prefix, host=host, node=node or f"{host}-1"))
        return boards[-1]

    make.conn, make.prefix = conn, prefix
    try:
        yield make
    finally:
        for b in boards:
            b.close()
        conn.close()


def test_a_node_compares_with_other_hosts_reports_of_the_same_device(board_of):
    cpu = device_label(torch.device("cpu"))
    assert cpu.startswith("cpu: ")
    a, b, c, gpu, me = (board_of(h) for h in ("a", "b", "c", "g", "me"))
    assert me.reference(cpu) is None  # nobody reported yet: any speed passes
    a.passed(10.0, cpu)
    b.passed(30.0, cpu)
    c.passed(20.0, cpu)
    gpu.passed(900.0, "NVIDIA H100 80GB HBM3")  # another device is no reference for a CPU
    me.passed(1000.0, cpu)  # nor is this host's own earlier report
    assert me.reference(cpu) == 20.0
    a.passed(40.0, cpu)  # a host's next report replaces its last
    assert me.reference(cpu) == 30.0
    assert board_of("x").reference("NVIDIA H100 80GB HBM3") == 900.0
    for stray in (b"not json", b"[1, 2]", json.dumps({"gflops": "fast", "device": cpu}).encode(),
                  b'{"gflops": NaN, "device": "%s"}' % cpu.encode(), json.dumps({"gflops": -5, "device": cpu}).encode()):
        board_of.conn.call(lambda cl: cl.put(board_of.prefix + SPEEDS + "stray", stray))
        assert me.reference(cpu) == 30.0  # a stray value is no report
    [(value, _)] = board_of.conn.call(lambda cl: list(cl.get_prefix(board_of.prefix + SPEEDS + "a")))
    assert json.loads(value)["gflops"] == 40.0


def test_a_refused_node_is_listed_with_its_line_until_it_passes(board_of):
    me, other = board_of("me", "me-7"), board_of("other", "other-9")
    me.refused("node check failed: device: slow; next check in 5 s", 5.0)
    other.refused("this node was left out (evicted as a straggler); it rejoins in 300 s", 300.0)
    [mine, theirs] = board_of.conn.call(lambda cl: read_refused(cl, board_of.prefix))
    assert (mine.node, theirs.node) == ("me-7", "other-9")
    assert mine.line.startswith("node check failed: device") and 4 <= mine.retry_at - mine.time <= 5.01
    me.refused("node check failed: device: slower; next check in 10 s", 10.0)  # the next failure replaces it
    assert [r.line for r in board_of.conn.call(lambda cl: read_refused(cl, board_of.prefix))][0].endswith("10 s")
    me.passed(12.0, "cpu: test")
    assert [r.node for r in board_of.conn.call(lambda cl: read_refused(cl, board_of.prefix))] == ["other-9"]
    board_of.conn.call(lambda cl: cl.put(board_of.prefix + REFUSED + "stray", b'{"line": 7, "time": "x", "retry_at": NaN}'))
    stray = [r for r in board_of.conn.call(lambda cl: read_refused(cl, board_of.prefix)) if r.node == "stray"]
    assert [(r.line, r.time, r.retry_at) for r in stray] == [("7", 0.0, 0.0)]
    board_of.conn.call(lambda cl: cl.delete(board_of.prefix + REFUSED + "stray"))
    other.close()  # a launcher that stops takes its line back
    assert board_of.conn.call(lambda cl: read_refused(cl, board_of.prefix)) == []


def test_a_refused_line_goes_with_its_lease_when_the_launcher_is_gone(board_of):
    me = board_of("me", "me-8")
    me.refused("node check failed: etcd: slow", 0.0)  # a lease of the retry (0 s) plus the margin
    key = board_of.prefix + REFUSED + "me-8"
    [(_, meta)] = board_of.conn.call(lambda cl: list(cl.get_prefix(key)))
    info = board_of.conn.call(lambda cl: cl.get_lease_info(meta.lease_id))
    assert 0 < info.TTL <= 30


def test_the_board_of_an_etcd_that_does_not_answer_never_fails_the_check(etcd):
    from elastic_trainer.etcd.server import free_port

    options = EtcdOptions(endpoints=parse_endpoints(f"127.0.0.1:{free_port()}"), connect_timeout=0.5,
                          retry_timeout=0.5)
    board = CheckBoard(options, "/elastic-trainer/none/", host="me")
    started = time.monotonic()
    assert board.reference("cpu: x") is None
    board.refused("node check failed: etcd: gone", 5.0)
    board.passed(1.0, "cpu: x")
    board.close()
    assert time.monotonic() - started < 30


def test_the_device_check_in_a_process_of_its_own_is_judged_by_its_peers_median():
    config = HealthConfig(matmul_size=256)
    seen = []

    def reference(label: str) -> float | None:
        seen.append(label)
        return None

    result = health.check_devices_apart(["cpu", "cpu"], reference, config=config)
    assert result.ok and result.value > 0 and result.label == device_label(torch.device("cpu")), result.line
    assert seen == [result.label] and result.line.startswith("device: cpu ")
    slow = health.check_devices_apart(["cpu"], lambda label: 1e6, config=config)  # peers at a PFLOP/s
    assert not slow.ok and "below 0.5 of its peers' median 1000000.0" in slow.line and "\n" not in slow.line
    broken = health.check_devices_apart(["nodevice:0"], config=config)
    assert not broken.ok and broken.line.startswith("device: ") and "\n" not in broken.line


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_node_far_slower_than_its_peers_is_refused_shown_in_status_and_admitted_once_it_passes(
        etcd, run_id, procs, tmp_path):
    """Under ``elastic-train``: another host reported a device like this one at a PFLOP/s, so this
    node's first check fails; it says so in one line, ``elastic-train status`` lists it with that
    line, and once the peers' figure is one it meets, its next check (after the 5 s back-off)
    passes, it reports its own speed, leaves the status's refused list and trains."""
    from elastic_trainer.etcd.server import free_port
    from tests.helpers.common import cli_cmd, wait_until
    from tests.helpers.runs import CONF
    from tests.helpers.scrape import figure, live_node, node_metrics

    conn = EtcdConnection(EtcdOptions(endpoints=parse_endpoints(etcd.endpoint)))
    prefix = f"/elastic-trainer/{run_id}/"
    label = device_label(torch.device("cpu"))
    peer = prefix + SPEEDS + "a-host-of-its-peers"
    conn.call(lambda c: c.put(peer, json.dumps({"gflops": 1e6, "device": label})))
    port, log = free_port(), tmp_path / "node.log"
    node = live_node(procs, log, endpoint=etcd.endpoint, run_id=run_id, nnodes="1", port=port, run_dir=tmp_path)

    def status() -> dict:
        done = subprocess.run(cli_cmd("status", "--rdzv-endpoint", etcd.endpoint, "--run-id", run_id, "--rdzv-conf",
                                      CONF, "--json"), capture_output=True, text=True, timeout=60, check=True)
        return json.loads(done.stdout)

    try:
        text = wait_until(log.read_text, 120, "the node refused", until=lambda t: "next check in 5 s" in t,
                          details=lambda: log.read_text()[-3000:])
        [line] = [t for t in text.splitlines() if "node check failed" in t]
        assert "device: cpu ran a" in line and "below 0.5 of its peers' median 1000000.0" in line, line
        [refused] = wait_until(status, 30, "the refusal in the status", until=lambda s: s["refused"])["refused"]
        assert refused["line"].startswith("node check failed: device: cpu ran a"), refused
        assert figure(node_metrics(port), "elastic_trainer_health_check_failures_total", check="device") >= 1
        assert "step" not in (status()["training"] or {}), "a refused node trained"
        conn.call(lambda c: c.put(peer, json.dumps({"gflops": 1e-3, "device": label})))
        wait_until(status, 120, "the node admitted and training",
                   until=lambda s: not s["refused"] and (s["training"] or {}).get("step", 0) > 0,
                   details=lambda: log.read_text()[-3000:])
        [(value, _)] = conn.call(lambda c: list(c.get_prefix(prefix + SPEEDS + socket.gethostname())))
        assert json.loads(value)["device"] == label and json.loads(value)["gflops"] > 1e-3
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(timeout=120)
        conn.close()


@pytest.mark.gpu
def test_on_a_gpu_the_device_check_runs_apart_and_leaves_this_process_without_a_cuda_context():
    """A GPU node's launcher checks its GPUs in a process of its own (a context here would stay on GPU 0
    for the whole run): every local GPU is judged, by the slowest, named as NVML would name it."""
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    result = health.check_devices_apart(devices, config=HealthConfig(matmul_size=1024))
    assert result.ok and result.value > 100 and "NVIDIA" in (result.label or ""), result.line  # GFLOP/s
    assert not torch.cuda.is_initialized()
