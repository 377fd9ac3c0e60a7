"""Start one member of the Kubernetes etcd StatefulSet: first bootstrap, restart, or a lost volume.

etcd's ``--initial-cluster-state`` must be ``new`` when the cluster is formed and ``existing``
when a member joins a cluster that runs; a member whose volume was lost (a new PVC, a wiped
disk) and that starts again with ``new`` has the identity the cluster remembers but an empty
log, and crash-loops (``tocommit(N) is out of range [lastIndex(0)]``). The etcd image has no
shell to decide this at start, so an init container runs this module with etcd's own flags:

    python -m elastic_trainer.etcd.member --config-out /var/lib/etcd/etcd.conf.yml -- \\
        --name=etcd-1 --data-dir=/var/lib/etcd/data --initial-cluster=etcd-0=http://...,... ...

and writes them as etcd's configuration file (``etcd --config-file``; JSON, which is YAML), deciding three things:

1. **Data in the volume** (``<data-dir>/member`` exists): the flags as given; etcd ignores the
   ``--initial-*`` flags and restarts with its old identity.
2. **Empty volume, and another member answers**: the cluster exists. A member of ours that has
   run before (it has a name) lost its data: it is removed and this pod is added as a new
   member (``member remove`` / ``member add``; one that was added but never started is kept).
   The config then says ``initial-cluster-state: existing`` and lists the members as the
   cluster has them, so etcd takes the identity the cluster gave it.
3. **Empty volume, no other member answers** within ``--discovery-timeout``: the first
   bootstrap (all members start together): the flags as given (``new``).

Listening on ``[::]`` (dual stack: IPv4 and IPv6 clients alike) is written as ``0.0.0.0`` on a
pod whose kernel has no IPv6, so the same flags work on IPv4-only, IPv6-only and dual-stack
clusters. The members' client URLs for the check come from ``--initial-cluster`` (the peer
URLs with the client port); with ``--client-cert-auth`` the member's own certificate (it
carries clientAuth) authenticates the check, over https.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import urlsplit

logger = logging.getLogger("elastic_trainer.etcd.member")

# etcd's flags that this module writes to the config file, by YAML type; a flag not listed is
# refused (a silently dropped flag would change etcd's behaviour without a word).
_STRINGS = {"name", "data-dir", "wal-dir", "listen-peer-urls", "listen-client-urls", "listen-metrics-urls",
            "initial-advertise-peer-urls", "advertise-client-urls", "initial-cluster", "initial-cluster-state",
            "initial-cluster-token", "auto-compaction-mode", "auto-compaction-retention", "logger", "log-level"}
_INTS = {"quota-backend-bytes", "snapshot-count", "heartbeat-interval", "election-timeout", "max-request-bytes",
         "max-snapshots", "max-wals"}
_BOOLS = {"strict-reconfig-check", "enable-pprof"}
# --cert-file etc. go under client-transport-security, --peer-cert-file etc. under peer-transport-security.
_TLS = {"cert-file": "cert-file", "key-file": "key-file", "trusted-ca-file": "trusted-ca-file",
        "client-cert-auth": "client-cert-auth"}


class MemberError(RuntimeError):
    """The flags cannot be turned into a config, or the cluster refused a membership change."""


def parse_flags(flags: list[str]) -> dict[str, str]:
    """``--key=value`` (or ``--key value``; a bare ``--flag`` is ``true``) into ``{key: value}``."""
    out: dict[str, str] = {}
    i = 0
    while i < len(flags):
        token = flags[i]
        if not token.startswith("--"):
            raise MemberError(f"etcd flag {token!r} does not start with --")
        key, eq, value = token[2:].partition("=")
        if not eq:
            if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
                value, i = flags[i + 1], i + 1
            else:
                value = "true"
        out[key] = value
        i += 1
    for need in ("name", "data-dir", "initial-cluster", "initial-advertise-peer-urls"):
        if need not in out:
            raise MemberError(f"etcd flag --{need} is missing")
    return out


def _bool(key: str, value: str) -> bool:
    if value.lower() not in ("true", "false"):
        raise MemberError(f"etcd flag --{key}={value}: expected true or false")
    return value.lower() == "true"


def to_config(flags: dict[str, str]) -> dict:
    """etcd's YAML configuration (the ``--config-file`` format) for ``flags``."""
    config: dict = {}
    for key, value in flags.items():
        if key in _STRINGS:
            config[key] = value
        elif key in _INTS:
            config[key] = int(value)
        elif key in _BOOLS:
            config[key] = _bool(key, value)
        elif key in _TLS:
            config.setdefault("client-transport-security", {})[_TLS[key]] = (
                _bool(key, value) if key == "client-cert-auth" else value)
        elif key.startswith("peer-") and key[5:] in _TLS:
            config.setdefault("peer-transport-security", {})[_TLS[key[5:]]] = (
                _bool(key, value) if key == "peer-client-cert-auth" else value)
        else:
            raise MemberError(f"etcd flag --{key} is not one etcd_member knows how to write to etcd's config "
                              "file; add it to the tables in elastic_trainer/etcd/member.py")
    return config


def has_ipv6() -> bool:
    """Whether this network namespace can listen on IPv6 (a kernel with ipv6.disable=1 cannot)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::", 0))
        return True
    except OSError:
        return False


def listen_any(urls: str, ipv6: bool) -> str:
    """``urls`` with the ``[::]`` hosts written as ``0.0.0.0`` when there is no IPv6."""
    return urls if ipv6 else urls.replace("[::]", "0.0.0.0")


def initial_cluster(text: str) -> dict[str, str]:
    """``name=peerURL,...`` as ``{peerURL: name}``."""
    out = {}
    for item in text.split(","):
        name, eq, url = item.strip().partition("=")
        if not eq or not name or not url:
            raise MemberError(f"--initial-cluster entry {item!r} is not name=peerURL")
        out[url] = name
    return out


def _client_endpoints(flags: dict[str, str], port: int) -> list[tuple[str, int]]:
    mine = flags["initial-advertise-peer-urls"].split(",")
    return [(urlsplit(url).hostname, port) for url in initial_cluster(flags["initial-cluster"]) if url not in mine]


def _connect(flags: dict[str, str], port: int, timeout: float):
    """A client of the other members, or None when none of them answers within ``timeout``."""
    from elastic_trainer.etcd.client import EtcdConnection, EtcdOptions
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    secure = flags.get("client-cert-auth", "false").lower() == "true" or "cert-file" in flags
    options = EtcdOptions(endpoints=tuple(_client_endpoints(flags, port)),
                          protocol="https" if secure else "http",
                          ca_cert=flags.get("trusted-ca-file") if secure else None,
                          cert=flags.get("cert-file") if secure else None,
                          key=flags.get("key-file") if secure else None,
                          connect_timeout=timeout, read_timeout=10.0, retry_timeout=30.0)
    try:
        return EtcdConnection(options)
    except RendezvousConnectionError as exc:
        logger.info("etcd_member: no other member answers (%s)", exc)
        return None


def decide(flags: dict[str, str], client_port: int = 2379, timeout: float = 10.0) -> dict[str, str]:
    """The flags this member must start with (see the module docstring); may change membership."""
    if (Path(flags["data-dir"]) / "member").is_dir():
        logger.info("etcd_member: %s has data in %s: restarting with it", flags["name"], flags["data-dir"])
        return flags
    conn = _connect(flags, client_port, timeout)
    if conn is None:
        logger.info("etcd_member: %s starts a new cluster (--initial-cluster-state=%s as given)",
                    flags["name"], flags.get("initial-cluster-state", "new"))
        return flags
    try:
        my_urls = flags["initial-advertise-peer-urls"].split(",")
        members = conn.call(lambda c: list(c.members), "member list")
        mine = [m for m in members if set(m.peer_urls) & set(my_urls)]
        for m in mine:
            if m.name:  # it has run: its data is gone with the volume
                logger.warning("etcd_member: %s (member %x) lost its data: removing it and joining as a new member",
                               flags["name"], m.id)
                conn.call(lambda c, mid=m.id: c.remove_member(mid), "member remove", retry_timeout=30.0)
        if not mine or all(m.name for m in mine):
            conn.call(lambda c: c.add_member(my_urls), "member add", retry_timeout=30.0)
        members = conn.call(lambda c: list(c.members), "member list")
    except Exception as exc:  # noqa: BLE001 - one sentence for the init container's log
        raise MemberError(f"the etcd cluster answered but refused the membership change: {exc}") from exc
    finally:
        conn.close()
    names = initial_cluster(flags["initial-cluster"])
    entries = []
    for m in members:
        for url in m.peer_urls:
            name = flags["name"] if url in my_urls else (m.name or names.get(url))
            if name:
                entries.append(f"{name}={url}")
    logger.info("etcd_member: %s joins the existing cluster %s", flags["name"], ",".join(entries))
    return {**flags, "initial-cluster-state": "existing", "initial-cluster": ",".join(entries)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("etcd_member: usage: python -m elastic_trainer.etcd.member --config-out FILE -- ETCD_FLAGS...",
              file=sys.stderr)
        return 2
    split = argv.index("--")
    p = argparse.ArgumentParser(prog="python -m elastic_trainer.etcd.member")
    p.add_argument("--config-out", required=True, help="where to write etcd's configuration file")
    p.add_argument("--client-port", type=int, default=2379, help="the other members' client port (default 2379)")
    p.add_argument("--discovery-timeout", type=float, default=10.0,
                   help="seconds to wait for another member before starting a new cluster (default 10)")
    args = p.parse_args(argv[:split])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        flags = parse_flags(argv[split + 1:])
        ipv6 = has_ipv6()
        for key in ("listen-client-urls", "listen-peer-urls", "listen-metrics-urls"):
            if key in flags:
                flags[key] = listen_any(flags[key], ipv6)
        config = to_config(decide(flags, args.client_port, args.discovery_timeout))
    except (MemberError, ValueError) as exc:
        print(f"etcd_member: {exc}", file=sys.stderr)
        return 1
    out = Path(args.config_out)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML: etcd reads it
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
