"""The etcd StatefulSet's member start-up (elastic_trainer/etcd/member.py) and its probes, on real etcds.

The whole story (three members from the rendered manifests, one that loses its volume and rejoins)
is tests/test_k8s_run.py; here: the flags-to-config translation, the NOSPACE liveness rule against a
real etcd whose backend is full, and listening on an IPv6-only pod network.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import etcd3
import pytest
import yaml

from elastic_trainer.etcd import member as etcd_member
from elastic_trainer.etcd.server import free_port
from tests.helpers.common import REPO, wait_until

kubectl = shutil.which("kubectl")
etcd_binary = shutil.which("etcd")
needs_etcd = pytest.mark.skipif(etcd_binary is None, reason="etcd is not installed")


def _statefulset() -> dict:
    out = subprocess.run([kubectl, "kustomize", str(REPO / "k8s" / "base")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return next(d for d in yaml.safe_load_all(out.stdout) if d and d["kind"] == "StatefulSet")


def test_flags_become_etcds_config_file_with_tls_nested_and_types_kept():
    flags = etcd_member.parse_flags(["--name=etcd-0", "--data-dir=/d", "--initial-cluster=etcd-0=http://a:2380",
                                     "--initial-advertise-peer-urls=http://a:2380", "--quota-backend-bytes=1024",
                                     "--client-cert-auth=true", "--cert-file=/t/tls.crt", "--key-file", "/t/tls.key"])
    config = etcd_member.to_config(flags)
    assert config["quota-backend-bytes"] == 1024 and config["name"] == "etcd-0"
    assert config["client-transport-security"] == {"client-cert-auth": True, "cert-file": "/t/tls.crt",
                                                   "key-file": "/t/tls.key"}
    with pytest.raises(etcd_member.MemberError, match="--experimental-foo"):
        etcd_member.to_config({**flags, "experimental-foo": "1"})
    with pytest.raises(etcd_member.MemberError, match="--initial-cluster is missing"):
        etcd_member.parse_flags(["--name=x", "--data-dir=/d", "--initial-advertise-peer-urls=http://a:2380"])


def test_any_address_is_dual_stack_and_falls_back_to_ipv4_without_ipv6():
    urls = "https://[::]:2379"
    assert etcd_member.listen_any(urls, ipv6=True) == urls
    assert etcd_member.listen_any(urls, ipv6=False) == "https://0.0.0.0:2379"


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@needs_etcd
@pytest.mark.skipif(kubectl is None, reason="kubectl is not installed")
def test_liveness_probe_ignores_a_nospace_alarm_and_readiness_does_not(tmp_path, procs):
    """A full backend (NOSPACE) is fixed by compaction and `etcdctl alarm disarm`, not by restarting the
    member; a liveness probe that fails on it restarts every member in a loop."""
    etcd = _statefulset()["spec"]["template"]["spec"]["containers"][0]
    liveness, readiness = etcd["livenessProbe"]["httpGet"]["path"], etcd["readinessProbe"]["httpGet"]["path"]
    client, peer, metrics = free_port(), free_port(), free_port()
    procs.start([etcd_binary, f"--data-dir={tmp_path / 'data'}", f"--listen-client-urls=http://127.0.0.1:{client}",
                 f"--advertise-client-urls=http://127.0.0.1:{client}", f"--listen-peer-urls=http://127.0.0.1:{peer}",
                 f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
                 f"--initial-cluster=default=http://127.0.0.1:{peer}",
                 f"--listen-metrics-urls=http://127.0.0.1:{metrics}", f"--quota-backend-bytes={1 << 20}"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{metrics}"
    wait_until(lambda: _get(base + readiness)[0] == 200 if _port_open(metrics) else False, 20, "etcd ready")
    c = etcd3.client("127.0.0.1", client)
    # Fill past the 1 MiB quota. etcd checks the quota against its backend's size, which grows only
    # when a batch commits (every 100 ms): under load 100 quick puts all got in before it did (CI),
    # so keep writing, with pauses for the commits, until etcd refuses (60 s at most).
    refused, deadline, i = None, time.monotonic() + 60, 0
    while refused is None and time.monotonic() < deadline:
        try:
            c.put(f"/fill/{i}", "x" * 100_000)
        except Exception as exc:  # noqa: BLE001 - asserted below
            refused = exc
        i += 1
        if i % 10 == 0:
            time.sleep(0.15)
    assert refused is not None and "space" in str(refused).lower(), (i, refused)
    assert any(a.alarm_type == etcd3.etcdrpc.NOSPACE for a in c.list_alarms())
    assert _get(base + liveness) == (200, {"health": "true"})
    assert _get(base + readiness)[0] == 503


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@needs_etcd
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2")
@pytest.mark.skipif(kubectl is None, reason="kubectl is not installed")
def test_a_member_serves_on_an_ipv6_only_pod_network(tmp_path, procs):
    """The rendered flags on a pod with only an IPv6 address: the member listens on [::] and a client
    reaches it by its DNS name (no IPv4 literal anywhere)."""
    from tests.helpers.k8s_pod import expand, localize

    init = _statefulset()["spec"]["template"]["spec"]["initContainers"][0]
    ns = f"etm-{os.getpid()}"
    hosts = Path("/etc/netns") / ns
    address = "fd7a:1::10"
    name = "etcd-0.etcd-peer.elastic-trainer.svc"
    try:
        subprocess.run(["ip", "netns", "add", ns], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "lo", "up"], check=True)
        # The pod's interface (a veth whose other end stays in the namespace), IPv6 only.
        subprocess.run(["ip", "-n", ns, "link", "add", "v6", "type", "veth", "peer", "name", "v6peer"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "v6peer", "up"], check=True)
        subprocess.run(["ip", "-n", ns, "addr", "add", f"{address}/64", "dev", "v6", "nodad"], check=True)
        subprocess.run(["ip", "-n", ns, "link", "set", "v6", "up"], check=True)
        hosts.mkdir(parents=True, exist_ok=True)
        (hosts / "hosts").write_text(f"{address} {name}\n::1 localhost\n")
        env = {"POD_NAME": "etcd-0", "POD_NAMESPACE": "elastic-trainer"}
        # The Secret etcd-server-tls as mounted (the members serve client TLS).
        from elastic_trainer.etcd.tls import make_certs
        files = make_certs(tmp_path / "pki", [name])
        tls = tmp_path / "tls"
        tls.mkdir()
        for src, dst in ((files.cert("ca"), "ca.crt"), (files.cert("server"), "tls.crt"), (files.key("server"), "tls.key")):
            (tls / dst).write_bytes(src.read_bytes())
        mounts = {"/var/lib/etcd": tmp_path, "/etc/etcd/tls": tls}
        argv = [localize(expand(t, env), mounts) for t in [*init["command"], *init["args"]]]
        assert argv[:3] == ["python", "-m", "elastic_trainer.etcd.member"]
        inner = ["ip", "netns", "exec", ns]
        pyenv = {**os.environ, "PYTHONPATH": str(REPO)}
        # The image's python is this interpreter; no other member exists: do not wait 10 s for one.
        done = subprocess.run([*inner, sys.executable, *argv[1:3], "--discovery-timeout=1", *argv[3:]],
                              capture_output=True, text=True, timeout=120, env=pyenv)
        assert done.returncode == 0, done.stderr
        config = json.loads((tmp_path / "etcd.conf.json").read_text())
        assert config["listen-client-urls"] == "https://[::]:2379"
        assert config["advertise-client-urls"] == f"https://{name}:2379"
        procs.start([*inner, etcd_binary, f"--config-file={tmp_path / 'etcd.conf.json'}"],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        # No quorum alone (3 members configured), but it accepts connections, over IPv6, by name.
        probe = ("import socket,sys\n"
                 f"s=socket.create_connection(({name!r}, 2379), timeout=2)\n"
                 "print(s.getpeername()[0])")
        seen = wait_until(lambda: subprocess.run([*inner, sys.executable, "-c", probe],
                                                 capture_output=True, text=True, timeout=20).stdout.strip(),
                          30, "etcd accepting on IPv6")
        assert seen == address
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(hosts, ignore_errors=True)
