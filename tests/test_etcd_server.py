"""The embedded etcd's process: started beside gRPC threads without aborting, gone with its parent.

A ``preexec_fn`` makes Python fork() and run code in the child before exec; a process with gRPC
threads (an etcd client, a watch) sometimes aborted there in gRPC's fork handlers (SIGABRT, "epoll_wait
error: Bad file descriptor"), so an etcd restarted under a live watch "exited at start"
(tests/test_live_watch.py's restart test, about 1 run in 10). ``dying_with_parent`` wraps the command in
``setpriv --pdeathsig KILL`` instead, and the parent-death signal still holds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading

import pytest

from elastic_trainer.etcd.server import EtcdServer, dying_with_parent
from tests.helpers.common import etcd_conn, holds_within

pytestmark = pytest.mark.timeout(120)


def test_children_start_cleanly_while_grpc_threads_are_busy(tmp_path):
    cmd, preexec = dying_with_parent(["/bin/echo", "ok"])
    if preexec is not None:
        pytest.skip("no setpriv with --pdeathsig on PATH: the preexec_fn fallback is in use")
    with EtcdServer(data_dir=tmp_path / "data") as server:
        conn = etcd_conn(server)
        stop = threading.Event()

        def busy() -> None:  # requests in flight on gRPC's threads, as a watcher's are
            while not stop.is_set():
                conn.call(lambda c: c.put("/busy", b"1"))

        thread = threading.Thread(target=busy, daemon=True)
        thread.start()
        try:
            bad = []
            for _ in range(150):  # the preexec_fn way failed 3 in 300 here
                done = subprocess.run(cmd, capture_output=True, timeout=10, check=False)
                if done.returncode != 0 or done.stdout != b"ok\n":
                    bad.append((done.returncode, done.stderr[-200:]))
            assert not bad, bad
        finally:
            stop.set()
            thread.join(10)
            conn.close()


def test_the_embedded_etcd_dies_with_the_process_that_started_it(tmp_path):
    """SIGKILL the process that started etcd: etcd follows (nothing is left behind)."""
    script = textwrap.dedent(f"""
        import sys, time
        from elastic_trainer.etcd.server import EtcdServer
        server = EtcdServer(data_dir={str(tmp_path / 'data')!r}).start()
        print(server.proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    etcd_pid = None
    try:
        etcd_pid = int(parent.stdout.readline())
        os.kill(etcd_pid, 0)  # running
        parent.kill()
        parent.wait(10)

        def gone() -> bool:
            try:
                os.kill(etcd_pid, 0)
            except ProcessLookupError:
                return True
            # a zombie of init's is gone too
            try:
                with open(f"/proc/{etcd_pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True

        assert holds_within(gone, 10), f"etcd {etcd_pid} outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if etcd_pid is not None:
            try:
                os.kill(etcd_pid, signal.SIGKILL)  # only left when the test failed: it is ours
            except ProcessLookupError:
                pass
