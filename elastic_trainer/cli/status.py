"""``elastic-train status``: a running job's nodes, round and training, read from its etcd.

Run it from any terminal or machine that reaches the job's etcd::

    elastic-train status                                   # the embedded etcd of the run under ./runs/
    elastic-train status --run-id quickstart               # ... of runs/quickstart (--log-dir DIR: elsewhere)
    elastic-train status --rdzv-endpoint etcd:2379 --run-id job7 --rdzv-conf key_prefix=/jobs  # the job's options
    elastic-train status --json                            # one JSON document, for scripts
    elastic-train status --watch                           # refresh every 2 s (--watch 5: every 5 s)

It shows the nodes (name, address, since when, lease time left; from the rendezvous's
``alive/<node>`` keys and the state), the nodes refused for now (a failed check before a join, or
held out after an eviction as a straggler: ``observability/check_board.py``, with their one line
and when they check again), the current round, its nodes' ranks, and what global rank 0
publishes: world size, step, epoch, samples/s and loss of the last steps, the newest committed
checkpoint (step, age, URL with credentials redacted), the last events (world size changes and
why, resumes, restarts, stops) and the names of rank 0's threads.

What rank 0 publishes is ``training/status.py``'s ``StatusPublisher``; this module only reads.
The embedded etcd's endpoint is in ``<log dir>/etcd-endpoint`` (``etcd_server.ENDPOINT_FILE``) while
it runs.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from elastic_trainer.cli.usage import Parser
from elastic_trainer.etcd.server import ENDPOINT_FILE
from elastic_trainer.training.status import STATUS_KEY


# ------------------------------------------------------------------------------- reading

def read_status(conn, prefix: str) -> dict[str, Any]:
    """Everything ``elastic-train status`` shows, as a JSON-ready dict."""
    from elastic_trainer.observability.check_board import read_refused
    from elastic_trainer.rendezvous.state import decode_state, node_name

    now = time.time()

    def read(client):
        state_value, _ = client.get(prefix + "state")
        alive = [(meta.key.decode()[len(prefix + "alive/"):], value, meta.lease_id)
                 for value, meta in client.get_prefix(prefix + "alive/")]
        joining = [meta.key.decode()[len(prefix + "joining/"):]
                   for _, meta in client.get_prefix(prefix + "joining/", keys_only=True)]
        status_value, _ = client.get(prefix + STATUS_KEY)
        quorum_value, _ = client.get(prefix + "live/quorum")
        refused = read_refused(client, prefix)
        leases = {}
        for _, _, lease_id in alive:
            if lease_id:
                info = client.get_lease_info(lease_id)
                leases[lease_id] = (int(info.TTL), int(info.grantedTTL))
        return state_value, alive, joining, status_value, leases, quorum_value, refused

    state_value, alive, joining, status_value, leases, quorum_value, refused = conn.call(read, "status read")
    out: dict[str, Any] = {"round": None, "complete": None, "closed": None, "live": None, "nodes": [],
                           "waiting": joining, "refused": [dataclasses.asdict(r) for r in refused], "training": None}
    node_rank: dict[str, int] = {}
    if state_value:  # --recovery restart: torch's rendezvous state, a round per restart
        body = state_value.split(b"\n", 1)[1] if b"\n" in state_value else state_value
        state = decode_state(body)
        out.update(round=state.round, complete=state.complete, closed=state.closed)
        node_rank = {node_name(n): r for n, r in state.participants.items()}
    workers: dict[str, list[int]] = {}
    if quorum_value:  # --recovery live: the live group's quorum (live/group.py), rank i = members[i]
        from elastic_trainer.live.quorum import MEMBERS, decode

        quorum = decode(quorum_value, lambda q: None,  # a change record: its whole record is beside it
                        lambda q: conn.call(lambda c: c.get(f"{prefix}live/{MEMBERS}{q}")[0], "status read"))
        for rank, member in enumerate(quorum.members):
            workers.setdefault(member.node, []).append(rank)
        out["live"] = {"quorum": quorum.q, "world_size": len(quorum.members), "cause": quorum.cause,
                       "finished": quorum.finished}
    for name, value, lease_id in sorted(alive):
        try:
            since = float(json.loads(value or b"{}").get("since")) if value else None
        except (ValueError, TypeError, AttributeError):
            since = None
        ttl, granted = leases.get(lease_id, (None, None))
        out["nodes"].append({"name": name, "address": name.rsplit("_", 2)[0], "node_rank": node_rank.get(name),
                             "ranks": workers.get(name), "since": since, "lease_left_s": ttl,
                             "lease_ttl_s": granted})
    if status_value:
        training = json.loads(status_value)
        training["age_s"] = max(0.0, now - float(training.get("time", now)))
        out["training"] = training
    return out


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


def format_status(run_id: str, endpoint: str, status: dict[str, Any], now: float | None = None) -> str:
    """The status as lines for people."""
    now = time.time() if now is None else now
    lines = [f"run {run_id} on etcd {endpoint}"]
    waiting = f", {len(status['waiting'])} waiting to join" if status["waiting"] else ""
    live = status["live"]
    if live is not None:
        lines.append(f"live group: quorum {live['quorum']} ({live['cause']}), world size {live['world_size']}; "
                     f"{len(status['nodes'])} node(s) alive{waiting}" + ("; finished" if live["finished"] else ""))
    elif status["round"] is not None:
        what = "closed (the run is over)" if status["closed"] else "complete" if status["complete"] else "forming"
        lines.append(f"rendezvous: round {status['round']}, {what}; {len(status['nodes'])} node(s) alive{waiting}")
    else:
        lines.append(f"rendezvous: no round yet; {len(status['nodes'])} node(s) alive (is the run id right?)")
    if status["nodes"]:
        lines.append(f"  {'node':<32} {'address':<16} {'ranks':>8} {'since':>8} {'lease left':>10}")
        for n in status["nodes"]:
            lease = f"{n['lease_left_s']}/{n['lease_ttl_s']}s" if n["lease_left_s"] is not None else "?"
            ranks = (",".join(map(str, n["ranks"])) if n["ranks"] else
                     f"node {n['node_rank']}" if n["node_rank"] is not None else "-")
            since = _ago(now - n["since"]) if n["since"] else "?"
            lines.append(f"  {n['name']:<32} {n['address']:<16} {ranks:>8} {since:>8} {lease:>10}")
    for r in status.get("refused", []):
        lines.append(f"  refused: {r['node']} since {_ago(now - r['time'])} ago, next check in "
                     f"{_ago(r['retry_at'] - now)}: {r['line']}")
    t = status["training"]
    if not t:
        lines.append("training: nothing published yet (rank 0 publishes once it trains)")
        return "\n".join(lines)
    loss = t.get("loss")
    lines.append(f"training: {t.get('state', '?')}, step {t.get('step', '?')}, epoch {t.get('epoch', '?')}, "
                 f"world size {t.get('world_size', '?')}, loss {loss:.4f}" if isinstance(loss, (int, float)) else
                 f"training: {t.get('state', '?')}, step {t.get('step', '?')}, world size {t.get('world_size', '?')}")
    if t.get("samples_per_s") is not None:
        lines[-1] += f", {t['samples_per_s']:.1f} samples/s"
    lines[-1] += f" (rank 0 on {t.get('node', '?')}, {_ago(t['age_s'])} ago)"
    ck = t.get("checkpoint")
    lines.append(f"checkpoint: step-{ck['step']}, {_ago(now - ck['time'])} ago, {ck['url']}" if ck else
                 "checkpoint: none committed yet")
    if t.get("threads"):
        counts = collections.Counter(t["threads"])
        lines.append("threads (rank 0): " + ", ".join(n if c == 1 else f"{n} x{c}" for n, c in counts.items()))
    if t.get("events"):
        lines.append("events:")
        for e in t["events"][-8:]:
            rest = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                             for k, v in e.items() if k not in ("time", "event") and v is not None)
            stamp = time.strftime("%H:%M:%S", time.localtime(e.get("time", 0)))
            lines.append(f"  {stamp} {e.get('event')}" + (f" ({rest})" if rest else ""))
    return "\n".join(lines)


def find_embedded_endpoint(log_dir: str | None, run_id: str | None) -> tuple[str, str]:
    """``(endpoint, run id)`` of a launcher's embedded etcd from ``<log dir>/etcd-endpoint``.

    With neither, looks under ``runs/`` (the default log dirs ``runs/<run id>``) and takes the
    only run that has one. Raises ``ValueError`` with the fix when there is none or several.
    """
    if log_dir or run_id:
        path = Path(log_dir or Path("runs") / run_id) / ENDPOINT_FILE
        if not path.is_file():
            raise ValueError(f"no embedded etcd is running for {path.parent} (no {path}); start the run there, or "
                             "give --rdzv-endpoint HOST:PORT and --run-id")
        return path.read_text().strip(), run_id or path.parent.name
    found = sorted(Path("runs").glob(f"*/{ENDPOINT_FILE}"))
    if len(found) != 1:
        names = ", ".join(p.parent.name for p in found)
        raise ValueError("no run with an embedded etcd under ./runs; give --rdzv-endpoint HOST:PORT and --run-id"
                         if not found else f"several runs under ./runs ({names}); pick one with --run-id")
    return found[0].read_text().strip(), found[0].parent.name


# ------------------------------------------------------------------------------- the command

def build_parser() -> argparse.ArgumentParser:
    """The command's parser; its errors are ``UsageError`` (one line, status 2)."""
    p = Parser(prog="elastic-train status", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Show a running job: nodes, round, world size, step, loss, checkpoint, events.",
                     epilog="\n\n".join(__doc__.split("\n\n")[1:3]))  # the sentence and its examples
    p.add_argument("--rdzv-endpoint", default=None, metavar="H:P[,H:P]",
                   help="the job's etcd (default: the embedded etcd of a run under --log-dir or ./runs/)")
    p.add_argument("--run-id", default=None, help="the job's run id (default: the one run found under ./runs/)")
    p.add_argument("--rdzv-conf", default="", metavar="K=V,...",
                   help="the job's rendezvous options that reach etcd: key_prefix, protocol, ca_cert, cert, key, "
                        "user, password_file (the same as the job's; found by itself for an embedded etcd)")
    p.add_argument("--log-dir", default=None, help="the run's log dir, where its embedded etcd's endpoint is")
    p.add_argument("--json", action="store_true", help="print one JSON document (for scripts)")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                   help="refresh every SECONDS (default 2) until Ctrl-C")
    return p


def main(argv: list[str]) -> int:
    """``elastic-train status``: print the status (once, or every ``--watch`` seconds). Exit 0."""
    from torch.distributed.elastic.rendezvous.api import RendezvousParameters

    from elastic_trainer.rendezvous.etcd_backend import run_prefix
    from elastic_trainer.etcd.client import EtcdConnection
    from elastic_trainer.etcd.server import PASSWORD_FILE, ROOT_USER
    from elastic_trainer.rendezvous.options import RendezvousOptions

    p = build_parser()
    args = p.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        p.error(f"--watch {args.watch:g} must be a positive number of seconds")
    endpoint, run_id = args.rdzv_endpoint, args.run_id
    embedded_password = None
    if endpoint is None:
        try:
            endpoint, run_id = find_embedded_endpoint(args.log_dir, run_id)
        except ValueError as exc:
            p.error(str(exc))
        embedded_password = Path(args.log_dir or Path("runs") / run_id) / PASSWORD_FILE
    elif run_id is None:
        p.error("--rdzv-endpoint needs --run-id (the job's; `elastic-train` uses elastic-run by default)")
    items = [item.strip() for item in args.rdzv_conf.split(",") if item.strip()]
    bad = [item for item in items if "=" not in item]
    if bad:
        p.error(f"--rdzv-conf {bad[0]!r} must look like key=value (for example key_prefix=/jobs)")
    conf = dict(item.split("=", 1) for item in items)
    if embedded_password is not None and embedded_password.is_file() and not {"user", "password_file"} & set(conf):
        conf.update(user=ROOT_USER, password_file=str(embedded_password))  # the embedded etcd's auth, as its join line
    try:
        options = RendezvousOptions(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, **conf))
    except ValueError as exc:
        p.error(f"--rdzv-conf: {exc}")
    prefix = run_prefix(options.key_prefix, run_id)
    conn = None
    try:
        while True:
            try:
                if conn is None:
                    conn = EtcdConnection(dataclasses.replace(options.etcd, retry_timeout=5.0))
                status = read_status(conn, prefix)
            except Exception as exc:  # noqa: BLE001 - one line, whatever the reason (no traceback)
                text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(f"elastic-train status: error: cannot read run {run_id} from etcd {endpoint}: {text}",
                      file=sys.stderr)
                if args.watch is None:
                    return 1
            else:
                if args.json:
                    print(json.dumps({"run_id": run_id, "endpoint": endpoint, **status}, default=str), flush=True)
                else:
                    if args.watch is not None and sys.stdout.isatty():
                        print("\033[H\033[2J", end="")
                    print(format_status(run_id, endpoint, status), flush=True)
            if args.watch is None:
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0
    finally:
        if conn is not None:
            conn.close()
