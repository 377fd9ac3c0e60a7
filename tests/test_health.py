"""The checks before a node joins (``observability/health.py``) and the back-off between them, against
real things: file, memory and S3 storage (moto's server), a read-only mount, an S3 endpoint that
stops answering, a real etcd, a slow one and a loopback port where nothing listens, the CPU's matmul.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_health.py -q
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from elastic_trainer.etcd.server import free_port
from elastic_trainer.observability import health
from elastic_trainer.observability.backoff import BackOff
from elastic_trainer.observability.health import HealthConfig
from tests.helpers.common import mounted_tmpfs
from tests.helpers.slow_proxy import SlowProxy

pytestmark = pytest.mark.timeout(120)


def one_line(result: health.CheckResult) -> str:
    assert "\n" not in result.line
    return result.line


# ------------------------------------------------------------------------------------------- storage

def test_storage_that_takes_a_write_read_and_delete_passes_on_every_store(any_url):
    from elastic_trainer import storage

    result = health.check_storage(any_url)
    assert result.ok and one_line(result).startswith("storage: ") and "written, read and deleted" in result.line
    fs, root = storage.get_fs(any_url)
    assert [n for n in storage.list_dir(fs, root) if n.startswith(".write-probe")] == []  # nothing left behind


def test_a_read_only_mount_fails_with_one_line_naming_it_and_the_fix(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", read_only=True) as mount:
        result = health.check_storage(str(mount / "ckpt"))
    assert not result.ok
    line = one_line(result)
    assert line.startswith("storage: ") and str(mount / "ckpt") in line
    assert "Read-only file system" in line and "check that" in line and "writable by this user" in line


def test_storage_that_stops_answering_fails_within_the_bound_and_the_next_check_does_not_pile_up(
        s3_url, s3_endpoint, monkeypatch):
    host, port = s3_endpoint.removeprefix("http://").split(":")
    with SlowProxy(host, int(port), delay=8.0) as proxy:  # every request reaches S3 8 s late
        monkeypatch.setenv("ELASTIC_TRAINER_S3_ENDPOINT_URL", f"http://{proxy.endpoint}")
        first = health.check_storage(s3_url, timeout=1.0)
        assert not first.ok and "did not answer within 1 s" in one_line(first) and first.seconds < 3.0
        second = health.check_storage(s3_url, timeout=1.0)
        assert not second.ok and "the previous probe is still blocked" in second.line and second.seconds < 0.5


def test_a_url_with_keys_is_never_shown(s3_url):
    bucket_path = s3_url.removeprefix("s3://")
    result = health.check_storage(f"s3://AKIAEXAMPLE:very-secret@{bucket_path}-missing-bucket-zz")
    assert "very-secret" not in result.line and "AKIAEXAMPLE" not in result.line


# ---------------------------------------------------------------------------------------------- etcd

def test_a_running_etcd_answers_within_the_bound(etcd):
    result = health.check_etcd(etcd.endpoint)
    assert result.ok and one_line(result).startswith(f"etcd: {etcd.endpoint} (etcd 3.") and result.seconds < 3.0


def test_nothing_listening_fails_at_once_with_the_endpoint_and_the_fix():
    endpoint = f"127.0.0.1:{free_port()}"
    result = health.check_etcd(endpoint, timeout=2.0)
    assert not result.ok and result.seconds < 2.5
    line = one_line(result)
    assert line.startswith("etcd: no etcd answered at " + endpoint) and "check that etcd runs there" in line


def test_an_etcd_slower_than_the_bound_fails(etcd):
    with SlowProxy("127.0.0.1", etcd.port, delay=1.5) as proxy:  # each request 1.5 s late: over a 1 s bound
        result = health.check_etcd(proxy.endpoint, timeout=1.0)
    assert not result.ok and one_line(result).startswith("etcd: ")


# -------------------------------------------------------------------------------------------- device

def test_the_cpu_matmul_is_right_and_reports_its_speed():
    result = health.check_device(torch.device("cpu"), config=HealthConfig(matmul_size=256))
    assert result.ok and result.value > 0 and one_line(result).startswith("device: cpu ")


def test_a_device_far_slower_than_its_peers_fails_naming_both_speeds():
    # References far from any CPU's speed (a shared machine's varies several-fold between runs)
    config = HealthConfig(matmul_size=256)
    result = health.check_device(torch.device("cpu"), reference=1e6, config=config)  # peers at a PFLOP/s
    assert not result.ok and result.value > 0
    line = one_line(result)
    assert "below 0.5 of its peers' median 1000000.0" in line and "nvidia-smi" in line
    assert health.check_device(torch.device("cpu"), reference=1e-3, config=config).ok


def test_nvml_is_skipped_with_the_reason_where_it_cannot_apply():
    result = health.check_nvml()
    if result.skipped:
        assert result.ok and one_line(result).startswith("nvml: skipped: ")
    else:  # a machine with an NVIDIA driver and pynvml: healthy GPUs need no action
        assert result.ok, result.line


# ------------------------------------------------------------------------------------- the whole node

def test_a_healthy_node_passes_every_check(tmp_path, etcd):
    report = health.check_node(HealthConfig(matmul_size=128), checkpoint_url=str(tmp_path / "ckpt"),
                               etcd_endpoints=etcd.endpoint, device=torch.device("cpu"))
    assert report.ok and [r.check for r in report.results] == ["storage", "etcd", "device"]
    assert report.summary().startswith("node check passed: storage: ")


def test_a_failing_node_says_every_failure_in_one_line_and_counts_them(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    with mounted_tmpfs(tmp_path / "ro", read_only=True) as mount:
        report = health.check_node(HealthConfig(matmul_size=128, etcd_timeout_s=1.0),
                                   checkpoint_url=str(mount), etcd_endpoints=endpoint, device=torch.device("cpu"))
    assert not report.ok and [r.check for r in report.failures()] == ["storage", "etcd"]
    line = report.summary()
    assert "\n" not in line and line.startswith("node check failed: storage: ") and "; etcd: no etcd answered" in line


# ------------------------------------------------------------------------------------------- bounded

def test_a_probe_past_its_bound_is_reported_once_and_not_started_again_while_it_is_stuck():
    release = threading.Event()
    assert health.bounded("t-probe", release.wait, 0.1) == ("timeout", None)
    assert health.bounded("t-probe", lambda: 1, 0.1) == ("stuck", None)
    release.set()
    assert health.bounded("t-probe", lambda: 2, 5.0) == ("done", 2) or release.is_set()
    kind, exc = health.bounded("t-raises", lambda: 1 / 0, 5.0)
    assert kind == "raised" and isinstance(exc, ZeroDivisionError)


# ------------------------------------------------------------------------------------------- back-off

def test_back_off_doubles_up_to_its_maximum_with_bounded_jitter_and_starts_over_after_reset():
    backoff = BackOff(initial=1.0, factor=2.0, maximum=10.0, jitter=0.1, rng=random.Random(7))
    delays = [backoff.next_delay() for _ in range(6)]
    for delay, nominal in zip(delays, [1, 2, 4, 8, 10, 10]):
        assert 0.9 * nominal <= delay <= 1.1 * nominal
    backoff.reset()
    assert 0.9 <= backoff.next_delay() <= 1.1


def test_back_off_gives_up_after_max_attempts():
    backoff = BackOff(initial=1.0, jitter=0.0, max_attempts=2)
    assert [backoff.next_delay(), backoff.next_delay(), backoff.next_delay()] == [1.0, 2.0, None]


@pytest.mark.parametrize("kwargs, message", [
    ({"initial": 0}, "must be above 0"), ({"initial": 10, "maximum": 5}, "at most the longest"),
    ({"factor": 0.5}, "factor must be at least 1"), ({"jitter": 1.0}, "jitter from 0 to below 1"),
])
def test_bad_back_off_settings_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        BackOff(**kwargs)


@pytest.mark.parametrize("kwargs, message", [
    ({"storage_timeout_s": 0}, "storage_timeout_s must be above 0"), ({"matmul_size": 4}, "at least 16"),
    ({"min_speed_ratio": 1.5}, "min_speed_ratio must be in"),
])
def test_bad_health_settings_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HealthConfig(**kwargs)
