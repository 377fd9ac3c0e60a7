"""The ``--rdzv-conf`` options of the etcd-v3 rendezvous, parsed and checked.

Each option is documented in one table in docs/rendezvous.md; a bad or unknown one raises
``ValueError`` with a sentence that names it.
"""

from __future__ import annotations

import os

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_trainer.etcd.access import is_loopback, read_password_file
from elastic_trainer.etcd.client import EtcdOptions, parse_endpoints

# The etcd password as an environment variable of the launcher (never of the workers: it is
# removed from the environment when first read, before any worker starts; see launcher_password).
from elastic_trainer.env import ENV_RDZV_PASSWORD, LiveSettings  # noqa: E402
_launcher_password: str | None = None


def launcher_password() -> str | None:
    """The etcd password from the launcher's ``ELASTIC_TRAINER_RDZV_PASSWORD``.

    The variable is removed from the environment at the first read: torch's agent copies its
    environment into every worker, and from there it would reach every DataLoader worker and
    subprocess. The value is kept for later reads in this process (a second handler)."""
    global _launcher_password
    value = os.environ.pop(ENV_RDZV_PASSWORD, None)
    if value:
        _launcher_password = value
    return _launcher_password


_LIVE = LiveSettings()

# Options torch's launcher adds by itself; accepted and ignored.
_TORCH_ADDED = {"timeout", "is_host", "rank", "store_type"}


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    value = params.get(key, default)
    try:
        seconds = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"the rendezvous option {key}={value!r} must be a number of seconds") from exc
    if not seconds > 0:
        raise ValueError(f"the rendezvous option {key}={value!r} must be positive")
    return seconds


class RendezvousOptions:
    """Every ``--rdzv-conf`` option of the etcd-v3 backend, parsed and checked.

    The table in docs/rendezvous.md documents each one; defaults are in ``DEFAULTS``.
    """

    DEFAULTS = {
        "key_prefix": "/elastic-trainer", "protocol": "http", "user": None, "password": None,
        "password_file": None,
        "ca_cert": None, "cert": None, "key": None, "read_timeout": 10.0, "connect_timeout": 4.0,
        "retry_timeout": 60.0, "join_timeout": _LIVE.join_timeout, "last_call_timeout": _LIVE.last_call,
        "close_timeout": 30.0, "heartbeat_timeout": 5.0, "lease_ttl": _LIVE.lease_ttl,
        "keep_alive_interval": _LIVE.keep_alive_interval, "recovery": "restart",
        "report_timeout": _LIVE.report_timeout, "hang_min": _LIVE.hang_min, "hang_factor": _LIVE.hang_factor,
    }
    """The options the live quorum shares take their defaults from ``env.LiveSettings`` (one place)."""

    def __init__(self, params: RendezvousParameters) -> None:
        unknown = set(params.config) - set(self.DEFAULTS) - _TORCH_ADDED
        if unknown:
            raise ValueError(f"unknown etcd-v3 rendezvous option(s) {sorted(unknown)}; "
                             f"known: {sorted(self.DEFAULTS)} (see docs/rendezvous.md)")
        self.run_id = params.run_id
        self.key_prefix = str(params.get("key_prefix") or self.DEFAULTS["key_prefix"])
        if not self.key_prefix.startswith("/"):
            raise ValueError(f"the rendezvous option key_prefix={self.key_prefix!r} must start with '/'")
        protocol = str(params.get("protocol", "http")).lower()
        if protocol not in ("http", "https"):
            raise ValueError(f"the rendezvous option protocol={protocol!r} must be http or https")
        timeouts = {k: _seconds(params, k, self.DEFAULTS[k]) for k in (
            "read_timeout", "connect_timeout", "retry_timeout", "join_timeout", "last_call_timeout",
            "close_timeout", "heartbeat_timeout", "keep_alive_interval", "report_timeout", "hang_min")}
        self.join_timeout = timeouts["join_timeout"]
        self.last_call_timeout = timeouts["last_call_timeout"]
        self.close_timeout = timeouts["close_timeout"]
        self.heartbeat_timeout = timeouts["heartbeat_timeout"]
        self.keep_alive_interval = timeouts["keep_alive_interval"]
        self.report_timeout = timeouts["report_timeout"]
        self.hang_min = timeouts["hang_min"]
        try:
            self.hang_factor = float(params.get("hang_factor", self.DEFAULTS["hang_factor"]))
        except (TypeError, ValueError):
            self.hang_factor = -1.0
        if not self.hang_factor >= 0:
            raise ValueError(f"the rendezvous option hang_factor={params.get('hang_factor')!r} must be a number "
                             f">= 0 (0 turns hang detection off)")
        self.recovery = str(params.get("recovery", "restart")).lower()
        if self.recovery not in ("live", "restart"):
            raise ValueError(f"the rendezvous option recovery={self.recovery!r} must be live or restart")
        try:
            self.lease_ttl = int(params.get("lease_ttl", self.DEFAULTS["lease_ttl"]))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the rendezvous option lease_ttl={params.get('lease_ttl')!r} must be "
                             f"a whole number of seconds") from exc
        if self.lease_ttl < 2:
            raise ValueError(f"the rendezvous option lease_ttl={self.lease_ttl} must be at least 2 s "
                             f"(etcd rounds shorter leases up)")
        if self.keep_alive_interval * 2 > self.lease_ttl:
            raise ValueError(f"keep_alive_interval={self.keep_alive_interval:g} must be at most half of "
                             f"lease_ttl={self.lease_ttl} so that one lost renewal does not expire the lease")
        cert, key = params.get("cert"), params.get("key")
        if bool(cert) != bool(key):
            raise ValueError("the rendezvous options cert and key (TLS client certificate) go together")
        user, password, password_file = params.get("user"), params.get("password"), params.get("password_file")
        if password and password_file:
            raise ValueError("give the etcd password once: password_file or password, not both")
        if password_file:
            password = read_password_file(str(password_file))
        elif not password and user:
            password = launcher_password()
        if bool(user) != bool(password):
            raise ValueError(f"the rendezvous options user and password go together (the password from "
                             f"password_file=PATH or the env var {ENV_RDZV_PASSWORD})")
        ca_cert = params.get("ca_cert")
        if protocol == "https" and not ca_cert:
            raise ValueError("protocol=https needs ca_cert (the CA that signed etcd's certificate)")
        endpoints = parse_endpoints(params.endpoint)
        remote = [h for h, _ in endpoints if not is_loopback(h)]
        if password and protocol == "http" and not ca_cert and remote:
            raise ValueError(f"user/password over plain http to {remote[0]} would send the etcd password in "
                             f"clear; use protocol=https with ca_cert (see docs/security.md)")
        self.password_file = str(password_file) if password_file else None
        self.etcd = EtcdOptions(
            endpoints=endpoints, protocol=protocol, user=user or None,
            password=password or None, ca_cert=ca_cert or None, cert=cert or None, key=key or None,
            read_timeout=timeouts["read_timeout"], connect_timeout=timeouts["connect_timeout"],
            retry_timeout=timeouts["retry_timeout"])
