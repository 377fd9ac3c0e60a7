"""The node's ``/metrics`` endpoint: served by ``elastic-train`` (the launcher), read from the files its
processes write (``metrics.py``).

``serve(MetricsConfig)`` is called once by the launcher, before torchrun's agent starts any worker:

1. it makes a fresh folder (``tempfile.mkdtemp``: node-local, never a shared volume, whose mmap
   semantics prometheus_client's files do not survive; fresh, because files left by an earlier
   launcher would add their counts to this one's) and names it in ``ENV_METRICS_DIR`` in the
   launcher's own environment, which the agent hands to every worker it starts. The folder's name
   holds the launcher's pid, and the folders of this user's launchers that no longer run (killed
   with SIGKILL, which leaves no chance to remove them) are removed first;
2. it starts prometheus_client's HTTP server (a daemon thread of prometheus_client's, in the
   launcher: no worker serves) on ``port`` at ``addr``, with TLS and client certificates when given
   (``certfile``/``keyfile``/``client_cafile``: docs/security.md, "Metrics");
3. each scrape first forgets the processes that are gone (``mark_process_dead`` for every pid
   with a file in the folder that no longer runs: a worker restarted by the agent, killed, or
   excluded), then merges the folder (``MultiProcessCollector``). No hook in the agent is needed
   to learn of a worker's death, and a scrape never shows a dead worker's live gauges.

``MetricsServer.close()`` stops the server, removes the folder and unsets the variable (the
launcher calls it when it ends). With ``port`` 0 nothing is served, no folder is made and
recording stays a no-op everywhere.

A port already in use: an error (``MetricsError``, one line naming the port and the fix) when the
port was asked for, and a warning and no metrics when it is the default (another
``elastic-train`` of the same machine has it: a local multi-node run), so that a second node on one
machine still trains.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from elastic_trainer.env import ENV_METRICS_DIR

logger = logging.getLogger(__name__)

DEFAULT_PORT = 29600
"""Beside torch's store (29500) and the embedded etcd (29400), outside the exporters' range
9100-9999 (fully allocated by Prometheus' port list), so that it meets no exporter a node runs."""

_PID_FILE = re.compile(r"_(\d+)\.db$")
FOLDER_PREFIX = "elastic-train-metrics-"
_FOLDER = re.compile(re.escape(FOLDER_PREFIX) + r"(\d+)-[^/]+$")


class MetricsError(RuntimeError):
    """The metrics endpoint cannot be served as asked (one sentence that names the fix)."""


@dataclass
class MetricsConfig:
    """How the launcher serves ``/metrics`` (the ``--metrics-*`` flags)."""

    port: int = DEFAULT_PORT
    """TCP port of this node's ``/metrics``; 0 turns metrics off (nothing served, nothing recorded)."""
    addr: str = ""
    """Address to listen on; empty: every address (``::`` where the kernel has IPv6, which also takes
    IPv4 clients; else ``0.0.0.0``). ``127.0.0.1`` keeps it to this machine."""
    certfile: str | None = None
    """PEM certificate to serve HTTPS with (with ``keyfile``); None: plain HTTP."""
    keyfile: str | None = None
    """PEM private key of ``certfile``."""
    client_cafile: str | None = None
    """PEM CA bundle: with it a scraper must present a certificate it signed (mutual TLS)."""
    port_given: bool = False
    """Whether the port was asked for: then a port in use is an error, else a warning."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--metrics-port must be 0 (off) or a TCP port up to 65535, got {self.port}")
        if bool(self.certfile) != bool(self.keyfile):
            raise ValueError("--metrics-certfile and --metrics-keyfile go together: give both for HTTPS, or neither")
        if self.client_cafile and not self.certfile:
            raise ValueError("--metrics-client-cafile needs HTTPS: give --metrics-certfile and --metrics-keyfile too")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process holds that pid now: alive, not ours to judge
        return True
    return True


def forget_dead(folder: str) -> list[int]:
    """``mark_process_dead`` for every process with a file in ``folder`` that no longer runs; the pids."""
    from prometheus_client import multiprocess

    pids = {int(m.group(1)) for path in glob.glob(os.path.join(folder, "*.db"))
            if (m := _PID_FILE.search(os.path.basename(path)))}
    dead = sorted(pid for pid in pids if pid != os.getpid() and not _alive(pid))
    for pid in dead:
        multiprocess.mark_process_dead(pid, folder)
    return dead


class _NodeCollector:
    """What a scrape reads: the folder merged, after forgetting the processes that are gone."""

    def __init__(self, folder: str) -> None:
        from prometheus_client import multiprocess

        self.folder = folder
        self.merged = multiprocess.MultiProcessCollector(None, path=folder)

    def collect(self) -> Any:
        forget_dead(self.folder)
        return self.merged.collect()


def _listen(config: MetricsConfig, registry: Any) -> tuple[Any, Any]:
    from prometheus_client import start_http_server

    tls = {"certfile": config.certfile, "keyfile": config.keyfile, "client_cafile": config.client_cafile,
           "client_auth_required": bool(config.client_cafile)}
    if config.addr:
        return start_http_server(config.port, config.addr, registry, **tls)
    try:
        return start_http_server(config.port, "::", registry, **tls)
    except OSError as exc:
        if exc.errno not in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
            raise
        return start_http_server(config.port, "0.0.0.0", registry, **tls)


class MetricsServer:
    """The running endpoint (``serve``'s result): its ``folder``, ``port``; ``close()`` ends it."""

    def __init__(self, folder: str, server: Any, thread: Any) -> None:
        self.folder = folder
        self._server, self._thread = server, thread
        self.port: int = server.server_address[1]
        self._closed = False

    def close(self) -> None:
        """Stop serving, remove the folder, unset ``ENV_METRICS_DIR`` (it named this folder); once."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5.0)
        if os.environ.get(ENV_METRICS_DIR) == self.folder:
            del os.environ[ENV_METRICS_DIR]
        shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_orphans(tmp: str) -> list[str]:
    """Remove the metrics folders under ``tmp`` that a launcher of this user left when it was killed
    (its pid, in the folder's name, no longer runs); the removed paths."""
    removed = []
    for path in glob.glob(os.path.join(tmp, f"{FOLDER_PREFIX}*")):
        m = _FOLDER.search(path)
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:
            continue
        if m and mine and not _alive(int(m[1])):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def serve(config: MetricsConfig) -> MetricsServer | None:
    """Serve this node's ``/metrics`` as ``config`` says; None when it is off (port 0) or, for the
    default port, taken. Call it in the launcher before any worker starts and before anything in
    the launcher records (``metrics.node_started``), so both write into the new folder."""
    if config.port == 0:
        return None
    if ENV_METRICS_DIR in os.environ:
        logger.warning("%s=%s was set; elastic-train replaces it with a folder of its own for this node",
                       ENV_METRICS_DIR, os.environ[ENV_METRICS_DIR])
    remove_orphans(tempfile.gettempdir())
    folder = tempfile.mkdtemp(prefix=f"{FOLDER_PREFIX}{os.getpid()}-")
    # Named before prometheus_client is first imported here, so that the launcher's own figures
    # (metrics.node_started) go to the folder too (its value class is chosen at that import).
    os.environ[ENV_METRICS_DIR] = folder
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NodeCollector(folder))
    try:
        server, thread = _listen(config, registry)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        del os.environ[ENV_METRICS_DIR]
        where = f"{config.addr or 'every address'}:{config.port}"
        if exc.errno == errno.EADDRINUSE and not config.port_given:
            logger.warning("metrics: port %d is in use (another elastic-train on this machine?): this node serves "
                           "no /metrics; give each node its own --metrics-port", config.port)
            return None
        if exc.errno == errno.EADDRINUSE:
            raise MetricsError(f"--metrics-port {config.port}: the port is in use on {where}; choose another port, "
                               "or 0 to turn metrics off") from exc
        raise MetricsError(f"cannot serve /metrics on {where}: {exc.strerror or exc}; check --metrics-addr and "
                           "the TLS files") from exc
    scheme = "https" if config.certfile else "http"
    logger.info("metrics: serving %s://%s:%d/metrics (files in %s)", scheme, config.addr or "*", config.port, folder)
    return MetricsServer(folder, server, thread)


__all__ = ["DEFAULT_PORT", "FOLDER_PREFIX", "MetricsConfig", "MetricsError", "MetricsServer", "forget_dead",
           "remove_orphans", "serve"]
