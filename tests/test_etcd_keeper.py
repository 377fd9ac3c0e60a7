"""The embedded etcd's keeper (``etcd/keeper.py``): etcd lives while a node of its runs holds an
``alive/`` key (or a launcher's claim), and not longer; a keeper whose launcher ended before any
node registered leaves nothing behind. Real keeper processes, real etcd."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import etcd3
import pytest

from elastic_trainer.etcd.keeper import GRACE, POLL, release_keeper, running_etcd, start_keeper
from elastic_trainer.etcd.server import ENDPOINT_FILE, PASSWORD_FILE, ROOT_USER, read_password_file
from tests.helpers.common import wait_until

pytestmark = pytest.mark.timeout(120)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _etcd_of(keeper_pid: int) -> int:
    return int(Path(f"/proc/{keeper_pid}/task/{keeper_pid}/children").read_text().split()[0])


def _client(log_dir: Path) -> etcd3.Etcd3Client:
    host, port = (log_dir / ENDPOINT_FILE).read_text().strip().rsplit(":", 1)
    client = etcd3.client(host, int(port), timeout=5, user=ROOT_USER,
                          password=read_password_file(str(log_dir / PASSWORD_FILE)))
    client.call_credentials = None
    return client


def test_etcd_lives_while_a_node_holds_its_alive_key_and_stops_after(tmp_path):
    keeper, endpoint = start_keeper(tmp_path, "/elastic-trainer/")
    try:
        etcd = _etcd_of(keeper.pid)
        # a helper that counts keys: no torch (1.5 s of its start and ~200 MB for nothing)
        assert "libtorch" not in Path(f"/proc/{keeper.pid}/maps").read_text()
        client = _client(tmp_path)
        lease = client.lease(3)
        client.put("/elastic-trainer/run/alive/node-a", b"{}", lease=lease)
        release_keeper(keeper)  # the first node's launcher ended: node-a still trains
        assert keeper.poll() is None and _alive(etcd) and (tmp_path / ENDPOINT_FILE).exists()
        # a restarted first node in the same log dir claims the running etcd and joins it
        assert running_etcd(tmp_path, "/elastic-trainer/run/") == endpoint
        lease.revoke()  # node-a leaves; the claim (15 s) still holds etcd
        wait_until(lambda: client.get_range_response(b"/elastic-trainer/run/keep/", b"/elastic-trainer/run/keep0",
                                                     count_only=True).count, 5, "the claim")
        assert keeper.poll() is None
        for kv_lease in client.get_range_response(b"/elastic-trainer/run/keep/", b"/elastic-trainer/run/keep0").kvs:
            client.revoke_lease(kv_lease.lease)  # the claimant's node registered and left: nothing holds etcd
        client.close()
        keeper.wait(timeout=GRACE + 5 * POLL + 5)
        wait_until(lambda: not _alive(etcd), 10, "etcd to stop with its keeper")
        assert not (tmp_path / ENDPOINT_FILE).exists()
        assert running_etcd(tmp_path, "/elastic-trainer/run/") is None
    finally:
        keeper.kill()


def test_a_keeper_whose_launcher_ended_before_any_node_registered_stops_etcd(tmp_path):
    starter = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from elastic_trainer.etcd.keeper import start_keeper
        keeper, endpoint = start_keeper(Path({str(tmp_path)!r}), "/elastic-trainer/")
        print(keeper.pid, flush=True)
        """)], capture_output=True, text=True, timeout=60)
    assert starter.returncode == 0, starter.stderr
    keeper = int(starter.stdout.split()[0])
    wait_until(lambda: not _alive(keeper), 10, "the keeper to stop")
    assert not (tmp_path / ENDPOINT_FILE).exists()
    assert "ended before any node registered" in (tmp_path / "etcd-keeper.log").read_text()
