"""``elastic-train etcd certs`` and ``elastic-train etcd --tls-dir``: a shared etcd that only nodes
holding a certificate from the run's CA can reach, against a real etcd 3.4 serving TLS."""

from __future__ import annotations

import re
import stat
import subprocess

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousParameters

from elastic_trainer import cli
from elastic_trainer.etcd.server import EtcdServer, free_port
from elastic_trainer.rendezvous import handler_creator
from tests.helpers.common import cli_cmd, wait_until


def _conf(text: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in text.split(","))


def test_etcd_on_another_address_without_tls_is_refused_before_it_starts(monkeypatch, capsys):
    def started(self, *args, **kwargs):
        raise AssertionError("etcd was started")
    monkeypatch.setattr(EtcdServer, "start", started)
    assert cli.main(["etcd", "--host", "0.0.0.0", "--port", "2379"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--tls-dir" in err and "elastic-train etcd certs" in err


def test_etcd_with_a_tls_dir_missing_its_server_key_names_the_file(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(EtcdServer, "start", lambda self, *a, **k: pytest.fail("etcd was started"))
    assert cli.main(["etcd", "certs", "--out", str(tmp_path / "tls"), "--host", "127.0.0.1"]) == 0
    (tmp_path / "tls" / "server-key.pem").unlink()
    assert cli.main(["etcd", "--tls-dir", str(tmp_path / "tls")]) == 2
    assert "server-key.pem is missing" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_certs_command_prints_flags_that_let_only_certified_nodes_in(tmp_path, procs, run_id, capsys):
    tls = tmp_path / "tls"
    assert cli.main(["etcd", "certs", "--out", str(tls), "--host", "127.0.0.1", "--client", "node-a"]) == 0
    printed = capsys.readouterr().out
    assert stat.S_IMODE(tls.stat().st_mode) == 0o700
    assert {p.name for p in tls.iterdir()} == {"ca.pem", "ca-key.pem", "server.pem", "server-key.pem",
                                               "node-a.pem", "node-a-key.pem"}
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in tls.glob("*-key.pem"))
    server_flags = re.search(r"^etcd server: elastic-train etcd (.*)$", printed, re.M).group(1).split()
    node_conf = _conf(re.search(r"^node \(node-a\): .*--rdzv-conf (\S+)$", printed, re.M).group(1))
    assert server_flags[server_flags.index("--tls-dir") + 1] == str(tls)

    password = tmp_path / "pw"
    password.write_text("etcd-root-password\n")
    password.chmod(0o600)
    port = free_port()
    server = procs.start(cli_cmd("etcd", "--host", "127.0.0.1", "--port", str(port), "--data-dir",
                                 str(tmp_path / "data"), "--tls-dir", str(tls), "--password-file", str(password)),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    line = wait_until(lambda: server.stdout.readline(), 60, "etcd serving",
                      until=lambda text: "etcd serving at" in text or server.poll() is not None)
    assert f"etcd serving at https://127.0.0.1:{port}" in line, line
    endpoint = f"127.0.0.1:{port}"

    def handler(conf: dict, **extra):
        return handler_creator()(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, local_addr="127.0.0.1",
                                                      connect_timeout="2", **conf, **extra))
    # The node with the printed flags joins (its certificate acts as etcd user root: auth is on).
    node = handler(node_conf)
    try:
        assert node.next_rendezvous().world_size == 1
    finally:
        node.shutdown()
    # Without a client certificate (or without TLS) nobody gets in, with or without the password.
    no_cert = {"protocol": "https", "ca_cert": node_conf["ca_cert"]}
    for conf in (no_cert, {**no_cert, "user": "root", "password_file": str(password)}, {}):
        with pytest.raises(RendezvousConnectionError):
            handler(conf)
