"""The node's /metrics: figures recorded by separate worker processes reach a real HTTP scrape of the
launcher's server, a dead worker's live gauges are forgotten while its counts stay, recording is a
no-op when metrics are off, and the endpoint serves TLS with client certificates.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_metrics_endpoint.py -q
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from elastic_trainer.env import ENV_METRICS_DIR
from elastic_trainer.etcd.server import free_port
from elastic_trainer.observability import metrics
from elastic_trainer.observability.metrics_server import MetricsConfig, MetricsError, serve
from tests.helpers.common import REPO
from tests.helpers.scrape import figure, live_node, node_metrics, scrape
from tests.helpers.tls_certs import make_certs

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    """This node's endpoint on a free loopback port (the launcher's part); closed after the test."""
    srv = serve(MetricsConfig(port=free_port(), addr="127.0.0.1", port_given=True))
    try:
        yield srv
    finally:
        srv.close()


def value(samples: dict[str, list], name: str, **labels: str) -> float:
    [found] = [s.value for s in samples[name] if all(s.labels.get(k) == v for k, v in labels.items())]
    return found


def worker(procs, calls: list, then: str) -> subprocess.Popen:
    """A separate process that records ``calls`` (it inherits ENV_METRICS_DIR, as torchrun's workers do)."""
    proc = procs.start([sys.executable, "-m", "tests.helpers.metrics_worker", json.dumps(calls), then], cwd=REPO,
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.startswith("recorded"), f"the worker recorded nothing: {line!r}"
    return proc


def test_a_scrape_shows_what_separate_workers_recorded_and_forgets_a_dead_workers_live_gauges(server, procs):
    stays = worker(procs, [["world", 4, 2], ["step_done", 0.12, 32], ["step_done", 0.3, 32],
                           ["checkpoint_committed", 0.004, 1_700_000_000.0], ["straggler_score", 1.0]], "stay")
    dies = worker(procs, [["world", 3, 1], ["step_done", 0.2, 32], ["checkpoint_loaded", 1_600_000_000.0],
                          ["recovered", "kill", 0.4],
                          ["recovered", "straggler", 1.5], ["straggler_score", 5.0]], "exit")
    dies.wait(timeout=30)

    s = scrape(server.port)
    assert value(s, "elastic_trainer_steps_total") == 3  # counts of the dead worker stay
    assert value(s, "elastic_trainer_samples_total") == 96
    assert value(s, "elastic_trainer_step_seconds_count") == 3
    assert value(s, "elastic_trainer_step_seconds_bucket", le="0.25") == 2
    assert value(s, "elastic_trainer_recoveries_total", kind="kill") == 1
    assert value(s, "elastic_trainer_recovery_seconds_sum", kind="straggler") == pytest.approx(1.5)
    # the newest commit, whoever recorded it (a resumed worker the commit time it loaded), dead or alive
    assert value(s, "elastic_trainer_checkpoint_last_commit_timestamp_seconds") == 1_700_000_000.0
    # the dead worker recorded its world last, but a live gauge shows live processes only
    assert value(s, "elastic_trainer_world_size") == 4 and value(s, "elastic_trainer_world_nodes") == 2
    assert [(x.labels["pid"], x.value) for x in s["elastic_trainer_straggler_score"]] == [(str(stays.pid), 1.0)]

    stays.stdin.close()  # the last worker ends: its live gauges go too, its counts stay
    stays.wait(timeout=30)
    s = scrape(server.port)
    assert "elastic_trainer_world_size" not in s and "elastic_trainer_straggler_score" not in s
    assert value(s, "elastic_trainer_steps_total") == 3


def test_every_metric_is_served_under_its_specs_name(server, procs):
    worker(procs, [["world", 2, 2], ["step_done", 0.1, 8], ["recovered", "join", 0.2],
                   ["checkpoint_committed", 0.01], ["etcd_request", "txn", 0.002], ["etcd_request", "compact", 0.1],
                   ["lease_renewed", 0.05], ["straggler_score", 1.1], ["node_started", 2],
                   ["health_check_failed", "storage"]], "exit").wait(timeout=30)
    s = scrape(server.port)
    served = {name for name in s if name.startswith(metrics.PREFIX)}
    assert served - {n for n in served if n.endswith("_created")} <= metrics.series_names()
    for spec in metrics.SPECS:
        if spec.mode.startswith("live"):
            continue  # the worker is gone: its live gauges with it
        assert spec.series() & served, f"{spec.full_name} was recorded but not served"
    assert value(s, "elastic_trainer_etcd_request_seconds_count", op="other") == 1  # an unknown op is bounded
    assert value(s, "elastic_trainer_health_check_failures_total", check="storage") == 1


def test_recording_is_a_no_op_where_metrics_are_off(procs, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != ENV_METRICS_DIR}
    calls = [["world", 2, 1], ["step_done", 0.1, 8], ["recovered", "kill", 0.1], ["straggler_score", 2.0]]
    out = subprocess.run([sys.executable, "-m", "tests.helpers.metrics_worker", json.dumps(calls), "exit"], cwd=REPO,
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("recorded"), out.stderr
    assert "prometheus_client" not in out.stderr


def test_a_process_that_imported_prometheus_client_before_the_folder_was_named_says_so_and_records_nothing(
        tmp_path):
    folder = tmp_path / "metrics"
    folder.mkdir()
    code = ("import os, prometheus_client\n"
            f"os.environ[{ENV_METRICS_DIR!r}] = {str(folder)!r}\n"
            "from elastic_trainer.observability import metrics\n"
            "metrics.step_done(0.1, 8); metrics.step_done(0.1, 8)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "imported in this process before" in out.stderr and out.stderr.count("records nothing") == 1
    assert list(folder.iterdir()) == []


def test_an_unknown_recovery_kind_is_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="'oops' is not a recovery kind.*kill, freeze, hang"):
        metrics.recovered("oops", 1.0)


def test_port_zero_turns_metrics_off():
    assert serve(MetricsConfig(port=0)) is None
    assert ENV_METRICS_DIR not in os.environ


def test_a_port_in_use_is_an_error_when_asked_for_and_a_warning_for_the_default(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(MetricsError, match=f"--metrics-port {port}: the port is in use"):
            serve(MetricsConfig(port=port, addr="127.0.0.1", port_given=True))
        assert serve(MetricsConfig(port=port, addr="127.0.0.1")) is None
    assert "is in use (another elastic-train on this machine?)" in caplog.text
    assert ENV_METRICS_DIR not in os.environ


@pytest.mark.parametrize("kwargs, message", [
    ({"port": 70000}, "--metrics-port must be 0"),
    ({"certfile": "c.pem"}, "go together"),
    ({"client_cafile": "ca.pem"}, "needs HTTPS"),
])
def test_bad_settings_are_one_sentence_naming_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MetricsConfig(**kwargs)


def test_https_with_client_certificates_admits_only_a_scraper_the_ca_signed(tmp_path, procs):
    certs = make_certs(tmp_path / "pki")
    srv = serve(MetricsConfig(port=free_port(), addr="127.0.0.1", port_given=True, certfile=str(certs / "server.pem"),
                              keyfile=str(certs / "server-key.pem"), client_cafile=str(certs / "ca.pem")))
    try:
        worker(procs, [["step_done", 0.1, 8]], "exit").wait(timeout=30)
        scraper = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        scraper.load_cert_chain(str(certs / "client.pem"), str(certs / "client-key.pem"))
        assert value(scrape(srv.port, "https", scraper), "elastic_trainer_steps_total") == 1
        stranger = ssl.create_default_context(cafile=str(certs / "ca.pem"))  # no client certificate
        with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
            scrape(srv.port, "https", stranger)
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            scrape(srv.port, "http")
    finally:
        srv.close()


def test_close_removes_the_folder_and_the_variable(server):
    folder = server.folder
    assert os.environ[ENV_METRICS_DIR] == folder and os.path.isdir(folder)
    server.close()
    assert ENV_METRICS_DIR not in os.environ and not os.path.exists(folder)


def test_the_folder_of_a_killed_launcher_is_removed_by_the_next_one_and_a_running_ones_kept(procs, tmp_path):
    """A launcher killed with SIGKILL cannot remove its folder; the next ``serve`` of the same user
    does (its pid no longer runs), and leaves the folder of one that still runs."""
    code = ("import os, sys, tempfile; tempfile.tempdir = sys.argv[1]\n"
            "from elastic_trainer.observability.metrics_server import MetricsConfig, serve\n"
            "s = serve(MetricsConfig(port=int(sys.argv[2]), port_given=True))\n"
            "print(s.folder, flush=True); sys.stdin.read()")
    launchers = [procs.start([sys.executable, "-c", code, str(tmp_path), str(free_port())], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    killed, running = (p.stdout.readline().strip() for p in launchers)
    assert os.path.isdir(killed) and os.path.isdir(running)
    launchers[0].kill()
    launchers[0].wait(timeout=30)
    env_before = os.environ.get(ENV_METRICS_DIR)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tempfile.tempdir", str(tmp_path))
        with serve(MetricsConfig(port=free_port(), port_given=True)) as mine:
            assert not os.path.exists(killed) and os.path.isdir(running) and os.path.isdir(mine.folder)
    assert os.environ.get(ENV_METRICS_DIR) == env_before
    launchers[1].stdin.close()
    launchers[1].wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_live_two_node_run_shows_its_world_and_steps_and_a_killed_node_in_the_world_and_recoveries(
        etcd, run_id, procs, tmp_path):
    """Point 1 of the operations issue, end to end: two ``elastic-train`` nodes, each serving its own
    /metrics; both show a world of 2 ranks on 2 nodes and rank 0's node counts steps and samples;
    one node is SIGKILLed: the survivor's endpoint shows a world of 1 on 1 node, a recovery of kind
    ``kill`` with its duration, and steps counting on."""
    import signal

    from tests.helpers.common import wait_until
    from tests.helpers.runs import GBS

    ports = [free_port(), free_port()]
    outs = [tmp_path / f"node{i}.log" for i in range(2)]

    def node(i: int) -> subprocess.Popen:
        return live_node(procs, outs[i], endpoint=etcd.endpoint, run_id=run_id, nnodes="1:2", port=ports[i],
                         run_dir=tmp_path, trainer=("--sleep-per-step", "0.05"))

    def tails() -> str:
        return "\n".join(f"--- {o.name}\n{o.read_text()[-2500:]}" for o in outs if o.exists())

    nodes = [node(0), node(1)]
    both = wait_until(lambda: [node_metrics(p) for p in ports], 120, "both endpoints at a world of 2, steps counted",
                      until=lambda ms: all(figure(m, "elastic_trainer_world_size") == 2
                                           and figure(m, "elastic_trainer_world_nodes") == 2 for m in ms)
                      and max(figure(m, "elastic_trainer_steps_total") for m in ms) >= 5, details=tails)
    counting = [i for i, m in enumerate(both) if figure(m, "elastic_trainer_steps_total") > 0]
    assert len(counting) == 1, "rank 0's node alone counts the steps"
    m = both[counting[0]]
    steps, samples = figure(m, "elastic_trainer_steps_total"), figure(m, "elastic_trainer_samples_total")
    assert samples in (steps * GBS, (steps - 1) * GBS), ("samples: the global batch of each step", steps, samples)
    assert figure(m, "elastic_trainer_step_seconds_count") >= 4 and figure(m, "elastic_trainer_min_nodes") == 1
    assert figure(m, "elastic_trainer_recoveries_total", kind="kill") == 0
    for node in both:  # each node's agent and workers talk to etcd and renew leases: timed
        requests = {s.labels["op"]: s.value for s in node["elastic_trainer_etcd_request_seconds_count"]}
        assert requests.get("get", 0) >= 1 and requests.get("put", 0) >= 1 and set(requests) <= set(metrics.ETCD_OPS)
        assert figure(node, "elastic_trainer_lease_renewal_lag_seconds_count") >= 1
        assert 0 < figure(node, "elastic_trainer_etcd_request_seconds_sum", op="get") < 60

    survivor, victim = 0, 1  # rank 0's node or the other: the survivor is rank 0 after the re-form either way
    os.killpg(nodes[victim].pid, signal.SIGKILL)
    nodes[victim].wait(timeout=30)
    steps_then = figure(node_metrics(ports[survivor]), "elastic_trainer_steps_total")
    after = wait_until(lambda: node_metrics(ports[survivor]), 90, "the survivor's endpoint at a world of 1, a kill",
                       until=lambda m: figure(m, "elastic_trainer_world_size") == 1
                       and figure(m, "elastic_trainer_recoveries_total", kind="kill") >= 1
                       and figure(m, "elastic_trainer_steps_total") >= steps_then + 5, details=tails)
    assert figure(after, "elastic_trainer_world_nodes") == 1
    assert figure(after, "elastic_trainer_recovery_seconds_count", kind="kill") >= 1
    assert 0 < figure(after, "elastic_trainer_recovery_seconds_sum", kind="kill") < 30
    nodes[survivor].send_signal(signal.SIGTERM)
    assert nodes[survivor].wait(timeout=120) == 128 + signal.SIGTERM, tails()  # stopped, its step saved
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        scrape(ports[survivor])  # the launcher closed its endpoint when it ended


def test_a_re_forms_kind_comes_from_its_cause_and_the_worlds_before_and_after():
    """The ``kind`` label of the recoveries, from the causes the live path gives (``live/watcher.py``'s
    reasons behind a failed collective, the trainer's planned re-forms)."""
    from elastic_trainer.training.manager import recovery_kind

    failed = "a collective failed (RuntimeError); "
    assert recovery_kind(failed + "the process of node1-0-42 refuses connections", 3, 2) == "kill"
    assert recovery_kind(failed + "the etcd lease of node1-0-42 expired (stopped or cut off)", 3, 2) == "freeze"
    assert recovery_kind(failed + "no progress for 6.1s (a rank is hung)", 3, 2) == "hang"
    assert recovery_kind(failed + "node0-0-7 saw no progress for 6.0s", 3, 2) == "hang"
    assert recovery_kind("planned: a peer was preempted; ", 3, 2) == "preemption"
    assert recovery_kind("planned: a member asked; a node asks to join", 2, 3) == "join"
    assert all(k in metrics.RECOVERY_KINDS for k in ("kill", "freeze", "hang", "preemption", "join"))
