"""The ``--rdzv-conf`` options of the etcd-v3 rendezvous, parsed and checked.

Each option is documented in one table in docs/rendezvous.md; a bad or unknown one raises
``ValueError`` with a sentence that names it.
"""

from __future__ import annotations

from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic_trainer.rendezvous.etcd_client import EtcdOptions, parse_endpoints

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
        "ca_cert": None, "cert": None, "key": None, "read_timeout": 10.0, "connect_timeout": 4.0,
        "retry_timeout": 60.0, "join_timeout": 600.0, "last_call_timeout": 1.0, "close_timeout": 30.0,
        "heartbeat_timeout": 5.0, "lease_ttl": 3, "keep_alive_interval": 1.0,
        "recovery": "restart", "report_timeout": 5.0,
    }

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
            "close_timeout", "heartbeat_timeout", "keep_alive_interval", "report_timeout")}
        self.join_timeout = timeouts["join_timeout"]
        self.last_call_timeout = timeouts["last_call_timeout"]
        self.close_timeout = timeouts["close_timeout"]
        self.heartbeat_timeout = timeouts["heartbeat_timeout"]
        self.keep_alive_interval = timeouts["keep_alive_interval"]
        self.report_timeout = timeouts["report_timeout"]
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
        user, password = params.get("user"), params.get("password")
        if bool(user) != bool(password):
            raise ValueError("the rendezvous options user and password go together")
        ca_cert = params.get("ca_cert")
        if protocol == "https" and not ca_cert:
            raise ValueError("protocol=https needs ca_cert (the CA that signed etcd's certificate)")
        self.etcd = EtcdOptions(
            endpoints=parse_endpoints(params.endpoint), protocol=protocol, user=user or None,
            password=password or None, ca_cert=ca_cert or None, cert=cert or None, key=key or None,
            read_timeout=timeouts["read_timeout"], connect_timeout=timeouts["connect_timeout"],
            retry_timeout=timeouts["retry_timeout"])
