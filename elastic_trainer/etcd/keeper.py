"""The embedded etcd's keeper: runs a run's embedded etcd for as long as any node of the run uses it.

``elastic-train`` without ``--rdzv-endpoint`` gives its run an etcd of its own (``etcd_server``),
and other nodes on the machine join through it (docs/usage.md, "Joining a second node"). When
that etcd lived in the first node's process group, killing the first node took the rendezvous
from every other node: the survivors' re-form failed and their agents tried to renew their leases
for two minutes. A node's loss is what the run is built to survive, the first node's included. So
the first node starts this keeper in a session of its own (a kill of the node's process group
does not reach it), and the keeper starts etcd (which dies with the keeper: ``PR_SET_PDEATHSIG``)
and stops it when nobody needs it any more:

- **before any node registered**: when the launcher that started it is gone (a launcher killed at
  start leaves nothing behind);
- **after**: once the ``alive/`` keys of every run under its key prefix (one per live node, on the
  node's lease, so gone ``lease_ttl`` seconds after a node is killed) and their ``keep/`` keys (a
  claim by a launcher that is about to join: :func:`claim`) have stayed empty for ``GRACE``
  seconds, or at once after the first node's launcher said it ended (``SIGUSR1``: a one-node run
  ends as before);
- **on SIGTERM or SIGINT**: at once.

It removes the endpoint file (``<log dir>/etcd-endpoint``, where ``elastic-train status`` and a
restarted first node find the running etcd) before it stops etcd. Its environment is
``env.helper_environ()`` (no secret of the launcher's); the etcd password reaches it as the path of
the 0600 password file only. Its log (and etcd's) are in the run's log dir.

    python -m elastic_trainer.etcd.keeper --log-dir runs/elastic-run --prefix /elastic-trainer/ --starter PID

It prints one line on stdout, ``ready HOST:PORT`` or ``error MESSAGE``, which the launcher waits for
(``start_keeper``).
"""

from __future__ import annotations

import argparse
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from elastic_trainer.env import ENV_ETCD_BINARY, helper_environ

logger = logging.getLogger(__name__)

GRACE = 2.0
"""Seconds the run's ``alive/`` keys must stay empty before the keeper stops etcd (a node between
two leases is not gone)."""
POLL = 0.5
"""Seconds between the keeper's looks at the run's ``alive/`` keys."""
FAILING = 30.0
"""Seconds of failed looks after which the keeper gives up (it cannot tell whether a node is left)."""
CLAIM_TTL = 15
"""Seconds a launcher's claim on a running embedded etcd lasts (:func:`claim`): the time from its look
to its node's first ``alive/`` key (the agent's start, a few seconds), with a margin."""
PASS_ON = ("PYTHONPATH", ENV_ETCD_BINARY)
"""What the keeper needs beyond ``env.helper_environ()``: where this package is, and which etcd to run."""


class KeeperError(RuntimeError):
    """The keeper could not start etcd (its message says why)."""


def start_keeper(log_dir: Path, prefix: str, timeout: float = 60.0) -> tuple[subprocess.Popen, str]:
    """Start the keeper for the runs whose keys are under ``prefix`` (``key_prefix``), with etcd's data, log and
    password under ``log_dir``; return it and etcd's endpoint once etcd serves with authentication
    on. Raises ``KeeperError`` (the keeper gone) when it does not."""
    env = helper_environ()
    env.update({k: os.environ[k] for k in PASS_ON if k in os.environ})
    cmd = [sys.executable, "-m", "elastic_trainer.etcd.keeper", "--log-dir", str(log_dir), "--prefix", prefix,
           "--starter", str(os.getpid())]
    with open(log_dir / "etcd-keeper.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)  # its one line, or its end (EOF)
    line = proc.stdout.readline().strip() if ready else ""
    proc.stdout.close()
    if line.startswith("ready "):
        return proc, line.split(" ", 1)[1]
    proc.kill()
    proc.wait()
    raise KeeperError(line.split(" ", 1)[1] if line.startswith("error ") else
                      f"the embedded etcd did not start within {timeout:g}s (see {log_dir / 'etcd-keeper.log'})")


def release_keeper(proc: subprocess.Popen) -> None:
    """The first node's launcher ends: the keeper stops etcd as soon as no node uses it (a node
    killed or stopped by a signal holds its ``alive/`` key until its lease runs out)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGUSR1)


def running_etcd(log_dir: Path, prefix: str) -> str | None:
    """The endpoint of the embedded etcd a keeper of ``log_dir`` runs now, claimed (:func:`claim`)
    for the node about to join through it; None when there is none (no endpoint file, or its etcd
    does not answer with the password of the log dir)."""
    import etcd3

    from elastic_trainer.etcd.server import ENDPOINT_FILE, PASSWORD_FILE, ROOT_USER, read_password_file

    endpoint_file, password_file = log_dir / ENDPOINT_FILE, log_dir / PASSWORD_FILE
    if not endpoint_file.exists() or not password_file.exists():
        return None
    endpoint = endpoint_file.read_text().strip()
    host, _, port = endpoint.rpartition(":")
    try:
        client = etcd3.client(host, int(port), timeout=3, user=ROOT_USER, password=read_password_file(str(password_file)))
    except Exception as exc:  # noqa: BLE001 - gone, or another etcd: the caller starts one
        logger.info("the embedded etcd named in %s does not answer (%s)", endpoint_file, exc)
        return None
    try:
        client.call_credentials = None  # plain http on loopback: the token goes as metadata
        claim(client, prefix)
    except Exception as exc:  # noqa: BLE001 - as above
        logger.info("the embedded etcd named in %s does not answer (%s)", endpoint_file, exc)
        return None
    finally:
        client.close()
    return endpoint


def claim(client, prefix: str, ttl: int = CLAIM_TTL) -> None:
    """Keep a running keeper from stopping its etcd for ``ttl`` seconds (``client``: an etcd3 client
    of it): a launcher that found the run's embedded etcd running and will join through it claims it
    first, or the keeper could stop it between the look and the node's first ``alive/`` key."""
    client.put(f"{prefix}keep/{socket.gethostname()}-{os.getpid()}", b"", lease=client.lease(ttl))


class Keeper:
    """The keeper's loop (see the module docstring)."""

    def __init__(self, log_dir: Path, prefix: str, starter: int) -> None:
        self.log_dir, self.prefix, self.starter = log_dir, prefix, starter
        self.released = threading.Event()  # SIGUSR1: the first node's launcher ended
        self.stopped = threading.Event()   # SIGTERM, SIGINT

    def run(self) -> int:
        import etcd3

        from elastic_trainer.etcd.server import (ENDPOINT_FILE, PASSWORD_FILE, EtcdError, EtcdServer,
                                                 read_password_file, start_with_auth)

        server = EtcdServer(data_dir=self.log_dir / "etcd", log_path=self.log_dir / "etcd.log")
        endpoint_file = self.log_dir / ENDPOINT_FILE
        try:
            conf = start_with_auth(server, self.log_dir / PASSWORD_FILE)
        except EtcdError as exc:
            print(f"error {exc}", flush=True)
            return 1
        endpoint_file.write_text(server.endpoint + "\n")
        # etcd3's own client (the rendezvous's pulls torch in, ~2 s and ~200 MB for a helper that counts keys)
        client = etcd3.client(server.host, server.port, timeout=5, user=conf["user"],
                              password=read_password_file(conf["password_file"]))
        client.call_credentials = None  # gRPC sends call credentials only over TLS; the token goes as metadata
        print(f"ready {server.endpoint}", flush=True)
        sys.stdout.close()
        try:
            why = self._watch(client, server)
        finally:
            client.close()
            if endpoint_file.exists() and endpoint_file.read_text().strip() == server.endpoint:
                endpoint_file.unlink(missing_ok=True)
            server.stop()
        logger.info("stopped the embedded etcd at %s: %s", server.endpoint, why)
        return 0

    def _watch(self, client, server) -> str:
        """Wait until etcd is not needed any more; return why."""
        import etcd3.utils

        root = self.prefix.encode()
        end = etcd3.utils.prefix_range_end(root)
        registered, empty_since, failing_since = False, None, None
        while not self.stopped.wait(POLL):
            now = time.monotonic()
            if server.proc is None or server.proc.poll() is not None:
                return "etcd exited by itself"
            try:
                keys = client.get_range_response(root, end, keys_only=True).kvs
                alive = sum(1 for kv in keys if b"/alive/" in kv.key or b"/keep/" in kv.key)
            except Exception as exc:  # noqa: BLE001 - etcd busy: look again at the next poll, for a while
                logger.warning("could not count the run's nodes: %s", exc)
                failing_since = failing_since or now
                if now - failing_since > FAILING:
                    return f"it could not read its own etcd for {FAILING:g}s"
                continue
            failing_since = None
            if alive:
                registered, empty_since = True, None
            elif self.released.is_set():
                return "the first node ended and no node is left"
            elif not registered:
                if os.getppid() != self.starter:
                    return "the launcher that started it ended before any node registered"
            else:
                empty_since = empty_since or now
                if now - empty_since >= GRACE:
                    return f"no node of the run has been alive for {GRACE:g}s"
        return "stopped by a signal"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic_trainer.etcd.keeper", description=__doc__.split("\n\n")[0])
    p.add_argument("--log-dir", required=True, help="the run's log dir: etcd's data, log and password file")
    p.add_argument("--prefix", required=True, help="the runs' key prefix (the rendezvous's key_prefix)")
    p.add_argument("--starter", type=int, required=True, help="the pid of the launcher that starts it")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    keeper = Keeper(Path(args.log_dir), args.prefix, args.starter)
    signal.signal(signal.SIGUSR1, lambda *_: keeper.released.set())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: keeper.stopped.set())
    return keeper.run()


if __name__ == "__main__":
    sys.exit(main())
