"""The embedded etcd: a private etcd v3 server for one run on one machine.

With no ``--rdzv-endpoint``, ``elastic-train`` has one of these started on a free loopback
port with its data under the run's log dir, by a keeper in a session of its own that stops it
once no node of the run is left (``etcd/keeper.py``): the run's etcd outlives the node that
started it. ``elastic-train etcd`` runs one in the foreground for several machines to share.

The server is started with ``PR_SET_PDEATHSIG`` so that it dies with the process that
started it, even when that process is killed with SIGKILL: nothing is left behind; and with only
``env.helper_environ()`` in its environment, so that none of the launcher's secrets reach it.
:func:`start_with_auth` starts one with etcd's authentication on (the embedded etcd, the drill's).

    from elastic_trainer.etcd.server import EtcdServer
    with EtcdServer(data_dir="/tmp/etcd-data") as server:
        print(server.endpoint)          # "127.0.0.1:PORT"
"""

from __future__ import annotations

import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from elastic_trainer.env import ENV_ETCD_BINARY, helper_environ
from elastic_trainer.etcd.access import read_password_file

if TYPE_CHECKING:
    from elastic_trainer.etcd.tls import TlsFiles
    from elastic_trainer.etcd.client import EtcdOptions

logger = logging.getLogger(__name__)

INSTALL_HINT = "install it with `apt-get install -y etcd-server etcd-client` (Debian/Ubuntu) or put an etcd 3.4+ binary on PATH"
_PR_SET_PDEATHSIG = 1
ROOT_USER = "root"  # etcd's auth needs its root user; the embedded etcd's nodes use it
PASSWORD_FILE = "etcd-password"
"""The embedded etcd's root password, a 0600 file in the run's log dir (``elastic-train status`` reads it)."""
ENDPOINT_FILE = "etcd-endpoint"
"""The embedded etcd's ``host:port``, in the run's log dir while it runs (``etcd_keeper`` keeps it;
``elastic-train status`` and a restarted first node find the running etcd there)."""


class EtcdError(RuntimeError):
    """The etcd server could not be started, or an endpoint does not answer."""


def find_etcd_binary() -> str:
    """Return the path of the ``etcd`` binary or raise ``EtcdError`` saying how to install it."""
    path = os.environ.get(ENV_ETCD_BINARY) or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdError(f"the etcd binary was not found on PATH: {INSTALL_HINT}")
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port on ``host`` that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def parse_endpoints(value: str) -> list[tuple[str, int]]:
    """Parse ``host:port[,host:port...]`` (an ``http(s)://`` prefix is allowed) into pairs."""
    endpoints = []
    for item in value.split(","):
        item = item.strip()
        for scheme in ("http://", "https://"):
            if item.startswith(scheme):
                item = item[len(scheme):]
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"'{item}' is not a host:port endpoint (for example 127.0.0.1:2379)")
        endpoints.append((host.strip("[]"), int(port)))
    if not endpoints:
        raise ValueError("the endpoint list is empty")
    return endpoints


def probe_endpoint(endpoints: str, timeout: float = 3.0, options: EtcdOptions | None = None) -> str:
    """Check that one of ``endpoints`` answers an etcd v3 status request; return its version.

    ``options`` (the rendezvous's ``EtcdOptions``: TLS files, user and password) say how to speak
    to etcd, so the check connects exactly as the rendezvous will; without them, plain http.
    Raises ``EtcdError`` naming each endpoint and its failure when none answers within ``timeout``.
    """
    from dataclasses import replace

    # imported late: the CLI's parser must not pay for grpc and torch
    from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions

    base = options or EtcdOptions(endpoints=())
    errors = []
    deadline = time.monotonic() + timeout
    for host, port in parse_endpoints(endpoints):
        left = max(0.5, deadline - time.monotonic())
        try:
            # A closed port fails here at once, instead of being retried for the whole budget.
            with socket.create_connection((host, port), timeout=left):
                pass
            conn = EtcdConnection(replace(base, endpoints=((host, port),), connect_timeout=left,
                                          read_timeout=left))
            try:
                return conn.client.status().version
            finally:
                conn.close()
        except Exception as exc:  # noqa: BLE001 - every failure is reported below, by endpoint
            cause = exc.__cause__ if exc.__cause__ is not None else exc
            errors.append(f"{host}:{port} ({type(cause).__name__})")
    tls = "protocol=https, ca_cert, cert, key" if base.protocol == "https" else "none given"
    raise EtcdError(f"no etcd answered at {', '.join(errors)} within {timeout:g}s; check that etcd runs there "
                    f"(`elastic-train etcd` starts one; without --rdzv-endpoint the embedded one is used) and "
                    f"the TLS options ({tls}) and user/password in --rdzv-conf")


def run_password(path: str | Path) -> str:
    """The embedded etcd's root password in ``path``: read it, or generate one into a new 0600 file.

    The file outlives the run on purpose: the embedded etcd keeps its data (auth included) in the
    log dir, and a run started again in that log dir must reach it with the same password."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        try:
            return read_password_file(str(path))
        except ValueError as exc:
            raise EtcdError(f"{exc} (the embedded etcd's password)") from exc
    password = secrets.token_urlsafe(24)
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


def enable_auth(endpoint: str, password: str, timeout: float = 10.0, tls: TlsFiles | None = None) -> None:
    """Turn etcd's authentication on, with user ``root`` and ``password`` (etcd's ``user add root``,
    ``auth enable``). Nothing to do when it is on already and ``password`` works; ``EtcdError`` when
    it is on with another password. ``tls``: the server's TLS folder (its server certificate, which
    may act as a client too, reaches it on this machine)."""
    import etcd3
    import grpc
    from etcd3 import etcdrpc

    host, port = parse_endpoints(endpoint)[0]
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"  # listening everywhere: loopback among the rest
    if tls is None:
        client = etcd3.client(host, port, timeout=timeout)
    else:
        client = etcd3.client(host, port, timeout=timeout, ca_cert=str(tls.cert("ca")),
                              cert_key=str(tls.key("server")), cert_cert=str(tls.cert("server")))
    stub = client.authstub

    def ignore(fn, request, detail: str) -> None:
        try:
            fn(request, timeout)
        except grpc.RpcError as exc:
            if detail not in (exc.details() or ""):
                raise

    try:
        try:
            stub.Authenticate(etcdrpc.AuthenticateRequest(name=ROOT_USER, password=password), timeout)
            return  # on already, with this password
        except grpc.RpcError as exc:
            if "not enabled" not in (exc.details() or ""):
                raise EtcdError(f"the etcd at {endpoint} has authentication on and refuses the password in "
                                f"its password file ({exc.details()}); remove its data dir to start it over") from exc
        try:
            stub.UserAdd(etcdrpc.AuthUserAddRequest(name=ROOT_USER, password=password), timeout)
        except grpc.RpcError as exc:
            if "already exists" not in (exc.details() or ""):
                raise
            stub.UserChangePassword(etcdrpc.AuthUserChangePasswordRequest(name=ROOT_USER, password=password),
                                    timeout)
        ignore(stub.RoleAdd, etcdrpc.AuthRoleAddRequest(name=ROOT_USER), "already exists")
        stub.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=ROOT_USER, role=ROOT_USER), timeout)
        stub.AuthEnable(etcdrpc.AuthEnableRequest(), timeout)
    except grpc.RpcError as exc:
        raise EtcdError(f"could not turn on authentication in the etcd at {endpoint}: {exc.details()}") from exc
    finally:
        client.close()


def start_with_auth(server: EtcdServer, password_file: str | Path, tls: TlsFiles | None = None) -> dict[str, str]:
    """Start ``server`` with etcd's authentication on: user root, the password in ``password_file``
    (generated into a new 0600 file when there is none: :func:`run_password`). ``tls``: the folder
    whose ``server_flags()`` ``server`` serves TLS with (None: plain http, on loopback).

    Returns the ``--rdzv-conf`` options a node on this machine joins with: the TLS files of the
    folder's ``client`` certificate, user root and ``password_file``. Raises ``EtcdError``, with the
    server stopped, when etcd does not start or refuses to turn authentication on."""
    try:
        server.start()
        enable_auth(server.endpoint, run_password(password_file), tls=tls)
    except EtcdError:
        server.stop()
        raise
    conf = tls.rdzv_options("client") if tls is not None else {}
    return {**conf, "user": ROOT_USER, "password_file": str(password_file)}


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _setpriv_with_pdeathsig() -> str:
    """setpriv's path when it has ``--pdeathsig``, else ``""``."""
    binary = shutil.which("setpriv")
    if binary is None:
        return ""
    try:
        out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return binary if "--pdeathsig" in out.stdout else ""


_SETPRIV: str | None = None


def dying_with_parent(cmd: list[str]) -> tuple[list[str], "Callable[[], None] | None"]:
    """``cmd`` and the ``preexec_fn`` that make its process die with this thread (SIGKILL by
    ``PR_SET_PDEATHSIG``), for ``subprocess.Popen``.

    With util-linux's ``setpriv --pdeathsig`` on PATH (2.33+, in Debian's base image) the
    command is wrapped in it and no ``preexec_fn`` is needed: a ``preexec_fn`` makes Python
    fork() and run code in the child before exec, and a process with gRPC threads (an etcd
    client, a watch) sometimes aborts there in gRPC's fork handlers (SIGABRT, "epoll_wait error:
    Bad file descriptor": 3 of 300 starts in a stress test), so etcd "exits at start". Without
    setpriv, the ``preexec_fn`` is the fallback."""
    global _SETPRIV
    if _SETPRIV is None:
        _SETPRIV = _setpriv_with_pdeathsig()
    if _SETPRIV:
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *cmd], None
    return cmd, _die_with_parent


class EtcdServer:
    """One etcd process on loopback; a context manager that starts and stops it.

    Args:
        data_dir: where etcd keeps its data; a temporary directory (removed on stop) if None.
        host: the address to listen on; loopback unless several machines must reach it.
        port: the client port; a free one if None.
        extra_args: more etcd flags (TLS, auth, ...), passed as they are.
        log_path: where etcd's own log goes; ``<data_dir>.log`` if None.
    """

    def __init__(self, data_dir: str | Path | None = None, host: str = "127.0.0.1",
                 port: int | None = None, extra_args: list[str] | None = None,
                 log_path: str | Path | None = None) -> None:
        self._own_dir = data_dir is None
        self.data_dir = Path(data_dir or tempfile.mkdtemp(prefix="elastic-etcd-"))
        self.host = host
        self.port = port or free_port(host)
        self.peer_port = free_port("127.0.0.1")
        self.extra_args = list(extra_args or [])
        self.log_path = Path(log_path) if log_path else self.data_dir.with_name(self.data_dir.name + ".log")
        self.proc: subprocess.Popen | None = None
        self.scheme = "https" if any(a.startswith("--cert-file") for a in self.extra_args) else "http"

    @property
    def endpoint(self) -> str:
        """``host:port`` of the client URL, as ``--rdzv-endpoint`` takes it."""
        return f"{self.host}:{self.port}"

    def start(self, timeout: float = 20.0) -> "EtcdServer":
        """Start etcd and wait until it serves; raise ``EtcdError`` if it does not."""
        binary = find_etcd_binary()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.data_dir.chmod(0o700)  # etcd's own advice: its data (users, the run's state) is private
        client_url = f"{self.scheme}://{self.host}:{self.port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        cmd = [binary, "--name", "elastic-trainer", "--data-dir", str(self.data_dir),
               "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
               "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
               "--initial-cluster", f"elastic-trainer={peer_url}",
               # ~1 s heartbeat elections on a single member are pointless; keep the log quiet.
               "--log-level", "warn", *self.extra_args]
        log = open(self.log_path, "ab")
        try:
            # With only the basics in its environment: etcd needs none of the launcher's secrets.
            cmd, preexec = dying_with_parent(cmd)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=helper_environ(),
                                         stdin=subprocess.DEVNULL, preexec_fn=preexec)
        finally:
            log.close()
        self._wait_ready(timeout)
        logger.info("etcd %s started at %s (data dir %s)", self.proc.pid, self.endpoint, self.data_dir)
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-800:] if self.log_path.exists() else ""
                self.proc = None
                raise EtcdError(f"etcd exited at start (see {self.log_path}): {tail.strip().splitlines()[-1:]}")
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    # A listening socket is not yet a leader: ask for the status over HTTP.
                    if self.scheme == "http" and not self._healthy():
                        raise OSError("not healthy yet")
                    return
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise EtcdError(f"etcd did not become healthy within {timeout:g}s (see {self.log_path})")

    def _healthy(self) -> bool:
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.port}/health", timeout=1) as resp:
                return b'"true"' in resp.read()
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL) and remove a temporary data dir."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._own_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)
            self.log_path.unlink(missing_ok=True)

    def kill(self) -> None:
        """SIGKILL etcd without touching its data (for restart drills)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def __enter__(self) -> "EtcdServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
