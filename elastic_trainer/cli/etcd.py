"""``elastic-train etcd``: a standalone etcd that the nodes of several machines share, and
``elastic-train etcd certs``, which makes its TLS certificates.

    elastic-train etcd certs --out etcd-tls --host 10.0.0.5      # prints the flags each side needs
    elastic-train etcd --host 0.0.0.0 --port 2379 --data-dir /var/lib/elastic-etcd --tls-dir etcd-tls

``etcd`` refuses to listen beyond loopback without TLS (``--insecure`` overrides it on a network
you trust); with ``--password-file`` it also turns on etcd's user authentication (user root).
The server itself is ``etcd/server.EtcdServer``, the certificates ``etcd/tls``; see docs/security.md.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

from elastic_trainer.cli.usage import Parser, UsageError
from elastic_trainer.config import positive_int


def certs_main(argv: list[str]) -> int:
    """``elastic-train etcd certs``: write a CA and certificates, print the flags each side needs."""
    from elastic_trainer.etcd.tls import make_certs

    p = Parser(prog="elastic-train etcd certs",
                description="Create a CA, etcd's server certificate and the nodes' client certificates, and print "
                            "the flags the etcd server and each node then need.")
    p.add_argument("--out", required=True, help="folder to write the PEM files to (created 0700; keys 0600)")
    p.add_argument("--host", action="append", required=True,
                   help="an address or DNS name the nodes reach etcd at (repeat for several)")
    p.add_argument("--client", action="append", default=None,
                   help="a client certificate to make, by file name (repeat for several; default: client)")
    p.add_argument("--user", default="root", help="the etcd user the client certificates act as when etcd's "
                                                  "authentication is on (their common name; default root)")
    p.add_argument("--days", type=positive_int("--days"), default=365, help="validity (default 365)")
    args = p.parse_args(argv)
    try:
        files = make_certs(Path(args.out).resolve(), args.host, args.client or ["client"], args.user, args.days)
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from exc
    print(f"elastic-train: wrote a CA, a server certificate for {', '.join(args.host)} and client "
          f"certificate(s) {', '.join(args.client or ['client'])} to {files.folder}.\n"
          f"Keep ca-key.pem off the nodes; give each node ca.pem and its own certificate and key.\n"
          f"etcd server: elastic-train etcd --host 0.0.0.0 --tls-dir {files.folder}\n"
          + "".join(f"node ({c}): elastic-train --rdzv-endpoint {args.host[0]}:2379 --rdzv-conf {files.rdzv_conf(c)}\n"
                    for c in args.client or ["client"]), end="", flush=True)
    return 0


def main(argv: list[str]) -> int:
    """``elastic-train etcd``: serve a standalone etcd until Ctrl-C or SIGTERM."""
    from elastic_trainer.etcd.server import ROOT_USER, EtcdError, EtcdServer, enable_auth
    from elastic_trainer.etcd.tls import TlsFiles
    from elastic_trainer.etcd.access import is_loopback, read_password_file

    if argv[:1] == ["certs"]:
        return certs_main(argv[1:])
    p = Parser(prog="elastic-train etcd", description="Run a standalone etcd that several nodes share "
                "(`elastic-train etcd certs --help` makes its TLS certificates).")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=2379, help="client port (default 2379)")
    p.add_argument("--data-dir", default="etcd-data", help="where etcd keeps its data (default ./etcd-data)")
    p.add_argument("--tls-dir", default=None, help="serve TLS with the certificates in this folder (made by "
                   "`elastic-train etcd certs`) and accept only clients with a certificate from its CA")
    p.add_argument("--password-file", default=None, help="also turn on etcd's user authentication, with user "
                   "root and the password in this file (mode 0600)")
    p.add_argument("--insecure", action="store_true", help="allow plain http on an address other than loopback: "
                   "anyone who reaches the port could join or close a run")
    args = p.parse_args(argv)
    tls = TlsFiles(Path(args.tls_dir).resolve()) if args.tls_dir else None
    if tls is None and not is_loopback(args.host) and not args.insecure:
        raise UsageError(f"--host {args.host} without --tls-dir would let anyone who reaches port {args.port} join "
                         "or close a run; make certificates with `elastic-train etcd certs` and give --tls-dir, "
                         "or add --insecure on a network you trust")
    try:
        if tls is not None:
            tls.check()
        password = read_password_file(args.password_file) if args.password_file else None
    except ValueError as exc:
        raise UsageError(str(exc).replace("the rendezvous option password_file", "--password-file")) from exc
    server = EtcdServer(data_dir=Path(args.data_dir).resolve(), host=args.host, port=args.port,
                        log_path=Path(args.data_dir).resolve().with_suffix(".log"),
                        extra_args=tls.server_flags() if tls else None)
    try:
        server.start()
        if password is not None:
            enable_auth(server.endpoint, password, tls=tls)
    except EtcdError as exc:
        server.stop()
        raise UsageError(str(exc)) from exc
    conf = tls.rdzv_conf("client") if tls else ""
    if password is not None:
        conf += ("," if conf else "") + f"user={ROOT_USER},password_file=PATH"
    print(f"elastic-train: etcd serving at {server.scheme}://{server.endpoint}; use --rdzv-endpoint {server.endpoint}"
          + (f" --rdzv-conf {conf}" if conf else "") + ". Ctrl-C stops it.", flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    try:
        while not stop and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
