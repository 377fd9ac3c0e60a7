"""Who may speak to an etcd: the password file's rules, and whether a host is this machine's loopback
(the only place a password may travel without TLS).

Without torch or gRPC, so that the helpers that need no client (the embedded etcd's keeper, the
``elastic-train etcd`` commands) start in a tenth of a second and not in two.
"""

from __future__ import annotations

import ipaddress
import os


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, never resolved) is this machine's loopback."""
    if host.lower() in ("localhost", "localhost.localdomain") or host.lower().endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name other than localhost: another machine, as far as we know


def read_password_file(path: str) -> str:
    """The etcd password in ``path`` (one line; a trailing newline is dropped).

    Raises ``ValueError`` naming the option when the file cannot be read, is empty, or can be read
    by other users (a password that others can read protects nothing)."""
    try:
        mode = os.stat(path).st_mode
        with open(path) as f:
            password = f.read().rstrip("\r\n")
    except OSError as exc:
        raise ValueError(f"the rendezvous option password_file={path!r} cannot be read "
                         f"({exc.strerror}); give a file that holds the etcd password") from exc
    if mode & 0o077:
        raise ValueError(f"the rendezvous option password_file={path!r} can be read by other users "
                         f"(mode {mode & 0o777:o}); run `chmod 600 {path}`")
    if not password:
        raise ValueError(f"the rendezvous option password_file={path!r} is empty; put the etcd password in it")
    return password
