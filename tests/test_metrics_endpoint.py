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
from prometheus_client.parser import text_string_to_metric_families

from elastic_trainer.env import ENV_METRICS_DIR
from elastic_trainer.etcd.server import free_port
from elastic_trainer.observability import metrics
from elastic_trainer.observability.metrics_server import MetricsConfig, MetricsError, serve
from tests.helpers.common import REPO
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


def scrape(port: int, scheme: str = "http", context: ssl.SSLContext | None = None) -> dict[str, list]:
    """Sample name -> its samples, from one real HTTP scrape."""
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=10, context=context) as answer:
        text = answer.read().decode()
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


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
