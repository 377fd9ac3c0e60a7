"""``elastic-train drill``: break a training run on purpose and prove that it recovers.

A drill starts its own etcd and K simulated nodes on this machine (each one an
``elastic-train`` process: a torchrun agent and its workers, in their own sessions), runs the
built-in trainer with a tiny model and the sample ledger on, applies faults one at a time,
and measures each recovery. It ends with ``<out>/report.json``, ``<out>/timeline.png`` and a
summary table, and exits non-zero when a fault was not recovered, a sample was repeated or
skipped, or committed work was lost.

    elastic-train drill --nodes 3 --kill node:1@step:20 --add-node @after:5
    elastic-train drill --scenario drills/default.toml --out runs/drill-default

Fault grammar: ``--FAULT [TARGET]@WHEN[,for:SECONDS]``.
  TARGET  node:N (node N; nodes are numbered 0.. in start order, added ones after),
          rank0 (the node hosting global rank 0 now), random (a random live node).
  WHEN    step:S (the run reached global step S), time:T (T seconds after the first step),
          after:K (K steps after the previous fault recovered).
Faults fire in the order given; one fires only once the previous one has recovered.

Everything the drill starts (processes, etcd, namespaces, veth pairs, the tmpfs) is removed
when it ends, also on Ctrl-C, SIGTERM or an error.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import random
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from elastic_trainer import drill_report
from elastic_trainer.etcd_server import EtcdServer

logger = logging.getLogger(__name__)

# A model small enough that a step is dominated by --sleep-per-step on a 2-core machine.
DEFAULT_TRAINER_ARGS = [
    "--d-model", "16", "--nhead", "2", "--layers", "1", "--dim-feedforward", "32", "--src-len", "4",
    "--tgt-len", "4", "--dataset-size", "100000", "--global-batch-size", "12",
    "--sleep-per-step", "0.25", "--checkpoint-every", "5", "--sample-ledger", "--no-wandb",
]
FAULT_HELP = {
    "kill": "SIGKILL a node: its agent's and every worker's process group",
    "kill-rank0": "SIGKILL the node that hosts global rank 0 (no TARGET)",
    "kill-during-checkpoint": "SIGKILL rank 0's node as soon as a checkpoint save starts at or after WHEN",
    "stop": "SIGSTOP a node for:SECONDS (past the lease TTL), then SIGCONT it: a zombie",
    "term": "SIGTERM a node (preemption); SIGKILL what is left after --term-grace",
    "add-node": "start one more node (no TARGET)",
    "restart-etcd": "SIGKILL the drill's etcd, start it again for:SECONDS later (default 1) on the same port and data",
    "cut": "cut a node off the network for:SECONDS (needs --netns)",
    "corrupt-checkpoint": "flip bytes in the newest checkpoint, then SIGKILL TARGET (default random) so the run must resume past it",
    "fill-disk": "fill the checkpoint tmpfs for:SECONDS, then free it",
}
NEEDS_TARGET = {"kill", "stop", "term", "cut"}
NO_TARGET = {"kill-rank0", "kill-during-checkpoint", "add-node", "restart-etcd", "fill-disk"}
DEFAULT_FOR = {"stop": 8.0, "cut": 6.0, "fill-disk": 8.0, "restart-etcd": 1.0}


class ScenarioError(ValueError):
    """A fault spec or scenario file that cannot be understood; the message says how to fix it."""


@dataclass(frozen=True)
class Trigger:
    """When a fault fires: ``step:S``, ``time:T`` (s after the first step) or ``after:K`` steps."""

    kind: str
    value: float

    def __str__(self) -> str:
        return f"{self.kind}:{self.value:g}"


@dataclass
class Fault:
    """One fault of a scenario: its kind (a key of FAULT_HELP), target, trigger and duration."""

    kind: str
    target: str | None
    trigger: Trigger
    duration: float | None = None

    @property
    def label(self) -> str:
        extra = f",for:{self.duration:g}" if self.duration is not None else ""
        return f"{self.kind} {self.target or ''}@{self.trigger}{extra}"


def _parse_target(kind: str, text: str) -> str | None:
    text = text.strip()
    if not text:
        if kind in NEEDS_TARGET:
            raise ScenarioError(f"--{kind} needs a target before '@': node:N, rank0 or random "
                                f"(for example --{kind} node:1@step:20)")
        return "random" if kind == "corrupt-checkpoint" else None
    if kind in NO_TARGET:
        raise ScenarioError(f"--{kind} takes no target, got {text!r} (write --{kind} @step:20)")
    if text in ("rank0", "random"):
        return text
    if text.startswith("node:") and text[5:].isdigit():
        return text
    raise ScenarioError(f"--{kind}: target {text!r} is not node:N, rank0 or random")


def parse_fault(kind: str, spec: str) -> list[Fault]:
    """Parse one ``--KIND SPEC`` (see the module docstring) into faults."""
    if kind == "random-kills":
        count, _, rest = spec.partition(",")
        every = 5.0
        if rest:
            key, _, val = rest.partition(":")
            if key.strip() != "every" or not val.strip().isdigit():
                raise ScenarioError(f"--random-kills takes N[,every:STEPS], got {spec!r}")
            every = float(val)
        if not count.strip().isdigit() or int(count) < 1:
            raise ScenarioError(f"--random-kills takes a count of at least 1, got {spec!r}")
        out = []
        for _ in range(int(count)):
            out.append(Fault("kill", "random", Trigger("after", every)))
            out.append(Fault("add-node", None, Trigger("after", 1)))
        return out
    if kind not in FAULT_HELP:
        raise ScenarioError(f"unknown fault {kind!r}; known: {', '.join(sorted(FAULT_HELP))}, random-kills")
    target_text, at, rest = spec.partition("@")
    if not at:
        raise ScenarioError(f"--{kind} {spec!r}: say when with '@', e.g. @step:20, @time:30 or @after:5")
    when, *options = [p.strip() for p in rest.split(",")]
    wkind, _, wval = when.partition(":")
    try:
        trigger = Trigger(wkind, float(wval))
    except ValueError:
        raise ScenarioError(f"--{kind} {spec!r}: WHEN must be step:S, time:T or after:K") from None
    if wkind not in ("step", "time", "after") or trigger.value < 0:
        raise ScenarioError(f"--{kind} {spec!r}: WHEN must be step:S, time:T or after:K with a number >= 0")
    duration = DEFAULT_FOR.get(kind)
    for opt in options:
        key, _, val = opt.partition(":")
        if key != "for":
            raise ScenarioError(f"--{kind} {spec!r}: unknown option {opt!r} (only for:SECONDS)")
        if kind not in DEFAULT_FOR:
            raise ScenarioError(f"--{kind} takes no for:SECONDS")
        try:
            duration = float(val)
        except ValueError:
            raise ScenarioError(f"--{kind} {spec!r}: for: takes seconds, got {val!r}") from None
    return [Fault(kind, _parse_target(kind, target_text), trigger, duration)]


def parse_fault_line(line: str) -> list[Fault]:
    """``"kill node:1@step:20"`` (a scenario file's entry) into faults."""
    kind, _, spec = line.strip().lstrip("-").partition(" ")
    return parse_fault(kind, spec.strip())


class _FaultAction(argparse.Action):
    """Appends parsed faults to ``namespace.faults`` in command-line order."""

    def __call__(self, parser, namespace, values, option_string=None):
        kind = self.dest.replace("_", "-")
        try:
            faults = parse_fault(kind, values)
        except ScenarioError as exc:
            parser.error(str(exc))
        namespace.faults = list(getattr(namespace, "faults", None) or []) + faults


def build_parser() -> argparse.ArgumentParser:
    examples = """examples:
  elastic-train drill --nodes 3 --kill node:1@step:20 --add-node @after:5
  elastic-train drill --nodes 3 --kill-rank0 @step:30 --stop node:2@after:5,for:8 --term random@time:60
  elastic-train drill --nodes 2 --restart-etcd @step:15,for:2 --corrupt-checkpoint @after:5 --fill-disk @after:5,for:6
  elastic-train drill --netns --nodes 3 --cut node:1@step:20,for:6
  elastic-train drill --nodes 3 --random-kills 5,every:4
  elastic-train drill --scenario drills/default.toml --out runs/drill-default
  elastic-train drill --nodes 2 --kill node:1@step:12 --trainer-args=--no-resume   # must FAIL
"""
    p = argparse.ArgumentParser(prog="elastic-train drill", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 3)[3].split("\n\nEverything")[0] + "\n\n" + examples,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", help="TOML file: a [drill] table of these flags and a faults = [...] list")
    p.add_argument("--nodes", type=int, default=None, help="nodes started at the beginning (default 3)")
    p.add_argument("--nproc-per-node", type=int, default=None, help="workers per node (default 1)")
    p.add_argument("--min-nodes", type=int, default=None, help="the run's --min-nodes (default 1)")
    p.add_argument("--out", default=None, help="folder for logs, checkpoints and the report (default runs/drill-<time>)")
    p.add_argument("--rdzv-endpoint", default=None, help="use this etcd instead of starting one (restart-etcd is then refused)")
    p.add_argument("--rdzv-backend", default=None, help="rendezvous backend (default etcd-v3)")
    p.add_argument("--rdzv-conf", default=None, help="passed to every node's --rdzv-conf")
    p.add_argument("--checkpoint-dir", default=None, help="checkpoint URL (default <out>/checkpoints, a tmpfs with fill-disk)")
    p.add_argument("--disk-size", default=None, help="size of the checkpoint tmpfs for fill-disk (default 48m)")
    p.add_argument("--netns", action="store_true", default=None, help="each node in its own network namespace (root)")
    p.add_argument("--trainer-args", default=None,
                   help="extra trainer flags, one string, appended after the drill's (e.g. --trainer-args=--no-resume)")
    p.add_argument("--script", default=None, help="run this training script instead of the built-in trainer "
                   "(it must write the same step log, ledger and events)")
    p.add_argument("--recovery-timeout", type=float, default=None,
                   help="seconds a fault may take to a step at the expected world size (default 120)")
    p.add_argument("--tail-steps", type=int, default=None, help="steps to train after the last fault (default 5)")
    p.add_argument("--timeout", type=float, default=None, help="whole drill limit in seconds (default 1200)")
    p.add_argument("--term-grace", type=float, default=None, help="seconds after SIGTERM before SIGKILL (default 30)")
    p.add_argument("--seed", type=int, default=None, help="seed of random targets (default 0)")
    faults = p.add_argument_group("faults ([TARGET]@WHEN[,for:SECONDS]; fire in the order given)")
    for kind, text in FAULT_HELP.items():
        faults.add_argument(f"--{kind}", dest=kind.replace("-", "_"), action=_FaultAction, metavar="SPEC", help=text)
    faults.add_argument("--random-kills", dest="random_kills", action=_FaultAction, metavar="N[,every:K]",
                        help="N times: SIGKILL a random node K steps (default 5) after the last recovery, then add a node")
    return p


DEFAULTS = {"nodes": 3, "nproc_per_node": 1, "min_nodes": 1, "rdzv_backend": "etcd-v3", "disk_size": "48m",
            "netns": False, "recovery_timeout": 120.0, "tail_steps": 5, "timeout": 1200.0, "term_grace": 30.0,
            "seed": 0, "trainer_args": ""}


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Flags, then the scenario file's values for flags not given, then the defaults."""
    args = build_parser().parse_args(argv)
    flag_faults = list(getattr(args, "faults", None) or [])
    file_faults: list[Fault] = []
    if args.scenario:
        try:
            data = tomllib.loads(Path(args.scenario).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ScenarioError(f"cannot read scenario {args.scenario}: {exc}") from exc
        table = dict(data.get("drill", {}))
        for line in table.pop("faults", data.get("faults", [])):
            file_faults.extend(parse_fault_line(line))
        for key, value in table.items():
            key = key.replace("-", "_")
            if key not in DEFAULTS and key not in ("out", "rdzv_endpoint", "rdzv_conf", "checkpoint_dir", "script"):
                raise ScenarioError(f"{args.scenario}: unknown setting {key!r} in [drill]")
            if key == "trainer_args" and isinstance(value, list):
                value = shlex.join(str(v) for v in value)
            if getattr(args, key, None) is None:
                setattr(args, key, value)
    for key, value in DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.faults = file_faults + flag_faults
    if args.nodes < 1 or args.nproc_per_node < 1:
        raise ScenarioError("--nodes and --nproc-per-node must be at least 1")
    kinds = {f.kind for f in args.faults}
    if "cut" in kinds and not args.netns:
        raise ScenarioError("the cut fault needs --netns (each node in its own network namespace)")
    if "restart-etcd" in kinds and args.rdzv_endpoint:
        raise ScenarioError("restart-etcd needs the drill's own etcd: leave out --rdzv-endpoint")
    if "fill-disk" in kinds and args.checkpoint_dir:
        raise ScenarioError("fill-disk needs the drill's own tmpfs checkpoint dir: leave out --checkpoint-dir")
    if args.netns and args.rdzv_endpoint:
        raise ScenarioError("--netns starts its own etcd on the drill bridge: leave out --rdzv-endpoint")
    return args


# --------------------------------------------------------------------------- processes


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (all its threads'), from /proc."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except OSError:
            continue
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children of children too."""
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children(todo.pop()):
            if child not in found:
                found.append(child)
                todo.append(child)
    return found


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks (tells a live pid from a recycled one)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _die_with_drill() -> None:  # runs in the child between fork and exec
    """PR_SET_PDEATHSIG(SIGKILL): a node dies even when the drill itself is SIGKILLed (its
    workers follow: the trainer sets the same on them). Nodes start from the main thread."""
    import ctypes
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


@dataclass
class Node:
    """One simulated node: an ``elastic-train`` process (agent) and the workers it started."""

    index: int
    log_dir: Path
    proc: subprocess.Popen
    net: object | None = None
    state: str = "running"  # running | stopped | cut | killed | terminated | exited
    workers: set[int] = field(default_factory=set)
    seen: dict[int, tuple[int | None, int]] = field(default_factory=dict)  # pid -> (start ticks, pgid)
    term_deadline: float | None = None
    paused_pgids: set[int] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"node-{self.index}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def pgids(self) -> set[int]:
        """The agent's process group and every descendant's, looked up now."""
        groups = {self.proc.pid}
        for pid in descendants(self.proc.pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        return groups

    def signal(self, sig: int) -> set[int]:
        groups = self.pgids() if self.alive else set()
        for pgid in groups:
            _killpg(pgid, sig)
        return groups

    def kill_leftovers(self) -> None:
        """SIGKILL every worker ever seen that still runs (same pid and start time)."""
        for pid, (ticks, pgid) in self.seen.items():
            if ticks is not None and _start_ticks(pid) == ticks:
                _killpg(pgid, signal.SIGKILL)


class DirWatch:
    """inotify on one folder: the names created in it, the moment they are created."""

    _IN_CREATE, _IN_MOVED_TO = 0x100, 0x80

    def __init__(self, path: Path) -> None:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), self._IN_CREATE | self._IN_MOVED_TO) < 0:
            err = ctypes.get_errno()
            if self.fd >= 0:
                os.close(self.fd)
            raise OSError(err, f"inotify on {path} failed: {os.strerror(err)}")

    def read(self, timeout: float = 0.0) -> list[str]:
        """Names created since the last call, waiting up to ``timeout`` seconds for one."""
        import select
        import struct
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:
            return []
        names, pos = [], 0
        while pos + 16 <= len(data):
            _wd, _mask, _cookie, size = struct.unpack_from("iIII", data, pos)
            names.append(data[pos + 16:pos + 16 + size].rstrip(b"\0").decode(errors="replace"))
            pos += 16 + size
        return names

    def close(self) -> None:
        os.close(self.fd)


class DrillInterrupted(BaseException):
    """SIGTERM/SIGHUP reached the drill: unwind through the clean-up."""


class _Tail:
    """Reads the new complete lines of growing .jsonl files."""

    def __init__(self) -> None:
        self.offsets: dict[Path, int] = {}

    def read(self, paths) -> list[dict]:
        out = []
        for path in paths:
            start = self.offsets.get(path, 0)
            try:
                with open(path, "rb") as fh:
                    fh.seek(start)
                    data = fh.read()
            except OSError:
                continue
            end = data.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[path] = start + end + 1
            for line in data[:end].splitlines():
                try:
                    obj = json.loads(line)
                except ValueError:
                    continue
                if isinstance(obj, dict):
                    obj["_path"] = path
                    out.append(obj)
        return out


# --------------------------------------------------------------------------- the drill


class Drill:
    """Runs one drill: etcd, nodes, the faults in order, the measurements, the clean-up."""

    POLL = 0.1
    SETTLE_STEPS = 3

    def __init__(self, args: argparse.Namespace, argv: list[str]) -> None:
        self.args = args
        self.argv = argv
        stamp = time.strftime("%Y%m%d-%H%M%S")
        self.out = Path(args.out or f"runs/drill-{stamp}").resolve()
        self.run_id = f"drill-{stamp}-{os.getpid()}"
        self.rng = random.Random(args.seed)
        self.nodes: list[Node] = []
        self.timeline: list[dict] = []
        self.records: list[dict] = []
        self.problems: list[str] = []
        self.r0: list[dict] = []  # rank-0 step lines as they appear
        self.events: list[dict] = []
        self.commits: dict[int, float] = {}  # checkpoint step -> commit time (manifest mtime)
        self._tail = _Tail()
        self.etcd: EtcdServer | None = None
        self.network = None
        self.tmpfs: Path | None = None
        self._watch: DirWatch | None = None
        self._cleaned = False
        adds = sum(f.kind == "add-node" for f in args.faults)
        self.max_nodes = args.nodes + adds
        self.trainer_args = DEFAULT_TRAINER_ARGS + shlex.split(args.trainer_args or "")
        self.global_batch = _last_int(self.trainer_args, "--global-batch-size")
        self.checkpoint_every = _last_int(self.trainer_args, "--checkpoint-every")

    # ---- set-up and clean-up

    def setup(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "nodes").mkdir(exist_ok=True)
        host = "127.0.0.1"
        if self.args.netns:
            from elastic_trainer import netns
            netns.sweep_stale()
            self.network = netns.Network()
            self.network.up()
            host = self.network.host_address
        if any(f.kind == "fill-disk" for f in self.args.faults):
            self.tmpfs = self.out / "ckpt-tmpfs"
            self.tmpfs.mkdir(exist_ok=True)
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.args.disk_size}", "tmpfs",
                                   str(self.tmpfs)], capture_output=True, text=True)
            if done.returncode != 0:
                self.tmpfs.rmdir()
                self.tmpfs = None
                raise ScenarioError(f"fill-disk needs a tmpfs (root): mount failed: {done.stderr.strip()}")
            self.checkpoint_dir = str(self.tmpfs / "checkpoints")
        else:
            self.checkpoint_dir = self.args.checkpoint_dir or str(self.out / "checkpoints")
        if self.args.rdzv_endpoint:
            self.endpoint = self.args.rdzv_endpoint
        elif self.args.rdzv_backend == "c10d":
            from elastic_trainer.etcd_server import free_port
            self.endpoint = f"{host}:{free_port(host)}"
        else:
            self.etcd = EtcdServer(data_dir=self.out / "etcd", host=host, log_path=self.out / "etcd.log")
            self.etcd.start()
            self.endpoint = self.etcd.endpoint
        logger.info("drill %s: out %s, endpoint %s, checkpoints %s", self.run_id, self.out, self.endpoint,
                    self.checkpoint_dir)

    def cleanup(self) -> None:
        """Stop everything this drill started; every step runs even when another fails."""
        if self._cleaned:
            return
        self._cleaned = True
        steps = [("watch", self._close_watch), ("nodes", self._stop_all_nodes), ("etcd", self._stop_etcd), ("netns", self._teardown_net),
                 ("tmpfs", self._unmount)]
        for name, step in steps:
            try:
                step()
            except Exception:  # noqa: BLE001 - clean-up goes on; the error is logged with its trace
                logger.exception("drill clean-up of %s failed", name)

    def _stop_all_nodes(self) -> None:
        for node in self.nodes:
            if node.alive:
                node.signal(signal.SIGKILL)
                if node.state in ("running", "stopped", "cut"):
                    node.state = "killed"
        for node in self.nodes:
            node.kill_leftovers()
            try:
                node.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("node %s (pid %s) did not exit after SIGKILL", node.name, node.proc.pid)

    def _stop_etcd(self) -> None:
        if self.etcd is not None:
            self.etcd.stop()
            self.etcd = None

    def _teardown_net(self) -> None:
        if self.network is not None:
            self.network.teardown()
            self.network = None

    def _unmount(self) -> None:
        if self.tmpfs is not None:
            done = subprocess.run(["umount", str(self.tmpfs)], capture_output=True, text=True)
            if done.returncode != 0:
                subprocess.run(["umount", "-l", str(self.tmpfs)], capture_output=True)
            self.tmpfs.rmdir()
            self.tmpfs = None

    # ---- nodes

    def start_node(self) -> Node:
        index = len(self.nodes)
        log_dir = self.out / "nodes" / f"node-{index}"
        log_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"{self.args.min_nodes}:{self.max_nodes}",
               "--nproc-per-node", str(self.args.nproc_per_node), "--rdzv-backend", self.args.rdzv_backend,
               "--rdzv-endpoint", self.endpoint, "--run-id", self.run_id, "--log-dir", str(log_dir),
               "--checkpoint-dir", self.checkpoint_dir, "--max-restarts", "1000"]
        if self.args.rdzv_conf:
            cmd += ["--rdzv-conf", self.args.rdzv_conf]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        net = None
        if self.network is not None:
            from elastic_trainer import netns
            net = self.network.add_node(index)
            cmd += ["--local-addr", net.address]
            env.update(GLOO_SOCKET_IFNAME=netns.INSIDE_IFNAME, TP_SOCKET_IFNAME=netns.INSIDE_IFNAME)
        if self.args.script:
            cmd.append(str(Path(self.args.script).resolve()))
        cmd += ["--", *self.trainer_args]
        if net is not None:
            cmd = self.network.wrap(net, cmd)
        with open(log_dir / "agent.log", "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True, env=env, preexec_fn=_die_with_drill)
        node = Node(index, log_dir, proc, net)
        self.nodes.append(node)
        self._note(node.name, "node_started", pid=proc.pid, cmd=shlex.join(cmd))
        return node

    def _note(self, node: str | None, what: str, **extra) -> None:
        self.timeline.append({"time": time.time(), "node": node, "what": what, **extra})

    def members(self) -> list[Node]:
        return [n for n in self.nodes if n.alive and n.state in ("running", "stopped", "cut")]

    def poll(self) -> None:
        """Observe: node exits, worker processes started and gone, new log lines."""
        for node in self.nodes:
            if not node.alive:
                if node.state in ("running", "stopped", "cut"):
                    node.state = "exited"
                    self._note(node.name, "node_exited", code=node.proc.returncode)
                if node.workers:
                    self._note(node.name, "workers_gone", pids=sorted(node.workers))
                    node.workers = set()
                continue
            if node.term_deadline and time.time() > node.term_deadline:
                node.signal(signal.SIGKILL)
                self._note(node.name, "term_grace_over_killed")
                node.term_deadline = None
            kids = set(children(node.proc.pid))
            gone, new = node.workers - kids, kids - node.workers
            if gone:
                self._note(node.name, "workers_gone", pids=sorted(gone))
            if new:
                self._note(node.name, "workers_started", pids=sorted(new))
                for pid in new:
                    try:
                        node.seen[pid] = (_start_ticks(pid), os.getpgid(pid))
                    except ProcessLookupError:
                        continue
            node.workers = kids
        dirs = list((self.out / "nodes").glob("node-*"))
        for line in self._tail.read([p for d in dirs for p in (d / "steps").glob("rank-0-*.jsonl")]):
            if isinstance(line.get("time"), (int, float)) and "step" in line:
                line["_node"] = line["_path"].parent.parent.name
                self.r0.append(line)
        self.r0.sort(key=lambda s: s["time"])
        for line in self._tail.read([d / "events.jsonl" for d in dirs]):
            if isinstance(line.get("time"), (int, float)):
                self.events.append(line)
        self._scan_commits()

    def _scan_commits(self) -> None:
        """Record each checkpoint's commit (its manifest's mtime) before retention prunes it."""
        root = Path(self.checkpoint_dir)
        if "://" in self.checkpoint_dir or not root.is_dir():
            return
        for manifest in root.glob("step-*/manifest.json"):
            step = manifest.parent.name[5:]
            if step.isdigit() and int(step) not in self.commits:
                try:
                    self.commits[int(step)] = manifest.stat().st_mtime
                except FileNotFoundError:
                    continue

    @property
    def latest(self) -> dict | None:
        return self.r0[-1] if self.r0 else None

    def pick(self, target: str) -> Node | None:
        live = [n for n in self.nodes if n.alive and n.state == "running"]
        if target == "random":
            return self.rng.choice(live) if live else None
        if target == "rank0":
            name = self.latest["_node"] if self.latest else None
            return next((n for n in live if n.name == name), None)
        index = int(target.split(":")[1])
        return next((n for n in live if n.index == index), None)

    # ---- faults

    def triggered(self, fault: Fault, settle_step: int) -> bool:
        step = self.latest["step"] if self.latest else 0
        if fault.trigger.kind == "step":
            return step >= fault.trigger.value
        if fault.trigger.kind == "after":
            return step >= settle_step + fault.trigger.value
        return time.time() - self.first_step_time >= fault.trigger.value

    def fire(self, fault: Fault, index: int) -> dict:
        """Apply one fault now; return its record (measured later by drill_report)."""
        latest = self.latest or {}
        members = self.members()
        rec = {"index": index, "label": fault.label, "kind": fault.kind, "target": fault.target,
               "trigger": str(fault.trigger), "duration": fault.duration, "fired_at": None, "end_at": None,
               "fired_step": latest.get("step"), "world_before": latest.get("world_size"),
               "round_before": latest.get("round"), "node": None, "status": "fired", "notes": [],
               "corrupted_steps": []}
        kind = fault.kind
        if kind == "kill-during-checkpoint":
            rec["armed_at"] = time.time()
            rec["status"] = "armed"
            root = Path(self.checkpoint_dir)
            if "://" not in self.checkpoint_dir and root.is_dir():
                self._watch = DirWatch(root)  # the step-N folder appears when the upload starts
            return rec
        node = None
        if kind in ("kill", "kill-rank0", "stop", "term", "cut", "corrupt-checkpoint"):
            node = self.pick("rank0" if kind == "kill-rank0" else fault.target)
            if node is None:
                rec["status"] = f"skipped: no live node matches {fault.target or 'rank0'}"
                return rec
            rec["node"] = node.name
            rec["was_rank0"] = bool(self.latest and self.latest["_node"] == node.name)
        rec["survivors"] = [n.name for n in members if n is not node]
        size = len(members)
        rec["expected_world"] = rec["final_world"] = min(size, self.max_nodes)
        if kind == "corrupt-checkpoint":
            corrupted = self.corrupt_newest_checkpoint()
            if corrupted is None:
                rec["status"] = "skipped: no checkpoint to corrupt (local checkpoint dir only)"
                return rec
            rec["corrupted_steps"] = [corrupted[0]]
            rec["corrupted_file"] = corrupted[1]
            self._note(None, "checkpoint_corrupted", step=corrupted[0], file=corrupted[1])
        now = time.time()
        rec["fired_at"] = now
        if kind in ("kill", "kill-rank0", "corrupt-checkpoint"):
            self.kill(node)
            rec["expected_world"] = rec["final_world"] = min(size - 1, self.max_nodes)
        elif kind == "term":
            node.signal(signal.SIGTERM)
            node.state = "terminated"
            node.term_deadline = now + self.args.term_grace
            self._note(node.name, "node_terminated")
            rec["expected_world"] = rec["final_world"] = min(size - 1, self.max_nodes)
        elif kind == "stop":
            node.paused_pgids = node.signal(signal.SIGSTOP)
            node.state = "stopped"
            self._note(node.name, "node_stopped", pgids=sorted(node.paused_pgids))
            rec["expected_world"] = size - 1
        elif kind == "cut":
            self.network.cut(node.net)
            node.state = "cut"
            self._note(node.name, "node_cut")
            rec["expected_world"] = size - 1
        elif kind == "add-node":
            new = self.start_node()
            rec["node"] = new.name
            rec["expected_world"] = rec["final_world"] = min(size + 1, self.max_nodes)
        elif kind == "restart-etcd":
            self.etcd.kill()
            self._note(None, "etcd_killed")
        elif kind == "fill-disk":
            rec["filled_bytes"] = self.fill_disk()
            self._note(None, "disk_filled", bytes=rec["filled_bytes"])
        if fault.duration is not None and kind in ("stop", "cut", "restart-etcd", "fill-disk"):
            rec["end_due"] = now + fault.duration
        return rec

    def end_fault(self, rec: dict) -> None:
        """The second half of a fault with a duration: SIGCONT, link up, etcd back, disk freed."""
        node = next((n for n in self.nodes if n.name == rec.get("node")), None)
        kind = rec["kind"]
        if kind == "stop" and node is not None:
            for pgid in node.paused_pgids:
                _killpg(pgid, signal.SIGCONT)
            if node.state == "stopped":
                node.state = "running"
            self._note(node.name, "node_continued")
        elif kind == "cut" and node is not None:
            self.network.restore(node.net)
            if node.state == "cut":
                node.state = "running"
            self._note(node.name, "node_restored")
        elif kind == "restart-etcd":
            self.etcd.start()
            self._note(None, "etcd_started")
        elif kind == "fill-disk":
            (self.tmpfs / ".drill-fill").unlink(missing_ok=True)
            self._note(None, "disk_freed")
        rec["end_at"] = time.time()
        rec.pop("end_due", None)

    def kill(self, node: Node) -> None:
        groups = node.signal(signal.SIGKILL)
        node.state = "killed"
        self._note(node.name, "node_killed", pgids=sorted(groups))
        try:
            node.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logger.warning("node %s still there 5 s after SIGKILL", node.name)

    def progress(self, rec: dict) -> bool:
        """Advance a fired fault; True once it recovered, timed out or was skipped."""
        now = time.time()
        if rec["status"].startswith("skipped"):
            return True
        if rec["status"] == "armed":
            return self._kill_when_saving(rec, now)
        if "end_due" in rec:
            if now >= rec["end_due"]:
                self.end_fault(rec)
            return False
        since = rec["end_at"] or rec["fired_at"]
        must_restart = rec["kind"] in drill_report.WORLD_CHANGING and rec["round_before"] is not None
        # Settled: SETTLE_STEPS steps of one world at the expected size since the fault (one
        # stray step of the old world finishing after a stall does not count).
        fresh = [s for s in self.r0[-self.SETTLE_STEPS:] if s["time"] > since
                 and s.get("world_size") == rec["final_world"]
                 and not (must_restart and s.get("round") == rec["round_before"])]
        if len(fresh) == self.SETTLE_STEPS and len({s.get("round") for s in fresh}) == 1:
            rec["status"] = "recovered"
            return True
        if now - since > self.args.recovery_timeout:
            rec["status"] = "timeout"
            return True
        return False

    def _kill_when_saving(self, rec: dict, now: float) -> bool:
        """SIGKILL rank 0's node the moment a checkpoint upload starts (kill-during-checkpoint)."""
        if self._watch is not None:
            started = [n for n in self._watch.read(self.POLL) if n.startswith("step-") and n[5:].isdigit()]
            step = int(started[-1][5:]) if started else None
        else:  # remote storage: the trainer's save event (written when the async save starts)
            start = next((e for e in self.events if e.get("event") in drill_report.CKPT_START_EVENTS
                          and e["time"] >= rec["armed_at"]), None)
            step = start.get("step") if start else None
        node = self.pick("rank0")
        if step is not None and node is not None:
            members = self.members()
            created = time.time()
            self.kill(node)
            manifest = Path(self.checkpoint_dir) / f"step-{step}" / "manifest.json"
            during = "://" not in self.checkpoint_dir and not manifest.exists()
            rec.update(status="fired", fired_at=created, node=node.name, was_rank0=True,
                       fired_step=self.latest["step"], world_before=self.latest.get("world_size"),
                       round_before=self.latest.get("round"), checkpoint_step=step, during_upload=during,
                       survivors=[n.name for n in members if n is not node],
                       expected_world=min(len(members) - 1, self.max_nodes))
            rec["final_world"] = rec["expected_world"]
            rec["notes"].append(f"killed while step-{step} was being uploaded (not committed)" if during else
                                f"step-{step} was already committed when the kill landed")
            self._close_watch()
        elif now - rec["armed_at"] > self.args.recovery_timeout:
            rec["status"] = "skipped: no checkpoint save started"
            self._close_watch()
            return True
        return False

    def _close_watch(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    def corrupt_newest_checkpoint(self) -> tuple[int, str] | None:
        """Flip 64 bytes in the biggest file of the newest committed ``step-N`` folder."""
        root = Path(self.checkpoint_dir)
        if "://" in self.checkpoint_dir or not root.is_dir():
            return None
        folders = sorted((d for d in root.glob("step-*") if d.is_dir() and d.name[5:].isdigit()),
                         key=lambda d: int(d.name[5:]), reverse=True)
        for folder in folders:
            files = [f for f in folder.rglob("*") if f.is_file()]
            if not any("manifest" in f.name.lower() for f in files):
                continue  # not committed: readers ignore it anyway
            data = [f for f in files if "manifest" not in f.name.lower()] or files
            victim = max(data, key=lambda f: f.stat().st_size)
            size = victim.stat().st_size
            with open(victim, "r+b") as fh:
                fh.seek(max(0, size // 2 - 32))
                chunk = fh.read(64)
                fh.seek(max(0, size // 2 - 32))
                fh.write(bytes(b ^ 0xFF for b in chunk))
            return int(folder.name[5:]), str(victim)
        return None

    def fill_disk(self) -> int:
        """Write zeros into the checkpoint tmpfs until it is full; return the bytes written."""
        written = 0
        fd = os.open(self.tmpfs / ".drill-fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            for size in (1 << 20, 4096, 1):
                block = b"\0" * size
                while True:
                    try:
                        written += os.write(fd, block)
                    except OSError:
                        break
        finally:
            os.close(fd)
        return written

    # ---- the whole run

    def run(self) -> dict:
        self.setup()
        self.started_at = time.time()
        self.deadline = self.started_at + self.args.timeout
        for _ in range(self.args.nodes):
            self.start_node()
        self.first_step_time = None
        startup_limit = time.time() + max(self.args.recovery_timeout, 180)
        while self.first_step_time is None:
            self.poll()
            if self.latest:
                self.first_step_time = self.latest["time"]
            elif time.time() > startup_limit or not any(n.alive for n in self.nodes):
                self.problems.append("the run made no optimizer step at start (see nodes/*/agent.log)")
                break
            time.sleep(self.POLL)
        queue = list(self.args.faults) if self.first_step_time else []
        current = None
        settle_step = self.latest["step"] if self.latest else 0
        while self.first_step_time is not None:
            self.poll()
            if time.time() > self.deadline:
                self.problems.append(f"the drill hit its --timeout of {self.args.timeout:g}s")
                break
            if not any(n.alive for n in self.nodes):
                if current is not None or queue:
                    self.problems.append("every node exited before the scenario was done")
                break
            if current is not None:
                if self.progress(current):
                    self._note(current.get("node"), "fault_done", index=current["index"], status=current["status"])
                    logger.info("fault %d (%s): %s at step %s", current["index"], current["label"],
                                current["status"], self.latest["step"] if self.latest else None)
                    if current["status"] == "timeout":
                        if not self.restart_job(current):
                            break
                    settle_step = self.latest["step"] if self.latest else settle_step
                    current = None
            elif queue:
                if self.triggered(queue[0], settle_step):
                    fault = queue.pop(0)
                    current = self.fire(fault, len(self.records) + 1)
                    self.records.append(current)
                    self._note(current.get("node"), "fault_fired", index=current["index"], label=fault.label)
                    logger.info("fault %d %s fired at step %s", current["index"], fault.label, current["fired_step"])
            elif self.latest and self.latest["step"] >= settle_step + self.args.tail_steps:
                break
            time.sleep(self.POLL)
        for fault in queue:
            self.records.append({"index": len(self.records) + 1, "label": fault.label, "kind": fault.kind,
                                 "fired_at": None, "status": "not fired", "notes": []})
        if current is not None and current["status"] not in ("recovered", "timeout") \
                and not current["status"].startswith("skipped"):
            current["status"] = "unfinished"
        self._stop_all_nodes()
        self._scan_commits()
        self.ended_at = time.time()
        return self.report()

    def restart_job(self, rec: dict) -> bool:
        """What an operator does after a failed recovery: kill every node, start fresh ones.

        They resume from the newest checkpoint, so the rest of the scenario still runs (and the
        ledger still judges the whole lineage). Returns False when the job does not come back.
        """
        logger.warning("fault %d (%s) did not recover: restarting the job with %d fresh nodes",
                       rec["index"], rec["label"], self.args.nodes)
        self.problems.append(f"fault {rec['index']} ({rec['label']}) did not recover within "
                             f"{self.args.recovery_timeout:g}s; the drill restarted the job to go on")
        for node in self.nodes:
            if node.alive:
                self.kill(node)
        self.poll()
        self._note(None, "job_restarted", after_fault=rec["index"])
        marker = time.time()
        for _ in range(self.args.nodes):
            self.start_node()
        want = min(self.args.nodes, self.max_nodes)
        while time.time() < min(self.deadline, marker + max(self.args.recovery_timeout, 180)):
            self.poll()
            fresh = [s for s in self.r0[-self.SETTLE_STEPS:] if s["time"] > marker and s.get("world_size") == want]
            if len(fresh) == self.SETTLE_STEPS:
                return True
            time.sleep(self.POLL)
        self.problems.append("the job did not come back after the drill restarted it; the rest was not run")
        return False

    def report(self) -> dict:
        for rec in self.records:
            if rec["status"].startswith("skipped"):
                rec["notes"].append(rec["status"])
        meta = {"command": shlex.join(["elastic-train", "drill", *self.argv]), "run_id": self.run_id,
                "out": str(self.out), "started_at": self.started_at, "ended_at": self.ended_at,
                "config": {"nodes": self.args.nodes, "nproc_per_node": self.args.nproc_per_node,
                           "min_nodes": self.args.min_nodes, "max_nodes": self.max_nodes,
                           "rdzv_backend": self.args.rdzv_backend, "netns": self.args.netns,
                           "checkpoint_dir": self.checkpoint_dir, "trainer_args": self.trainer_args,
                           "recovery_timeout": self.args.recovery_timeout},
                "problems": self.problems}
        node_dirs = {n.name: n.log_dir for n in self.nodes}
        expected = None
        size, seed = _last_int(self.trainer_args, "--dataset-size"), _last_int(self.trainer_args, "--seed") or 0
        if not self.args.script and "--task" not in self.trainer_args and size and self.global_batch:
            expected = drill_report.sampler_order(size, self.global_batch, seed)  # the built-in task's order
        report = drill_report.build_report(meta, self.records, self.timeline, node_dirs, self.global_batch,
                                           self.args.recovery_timeout, self.commits, expected)
        drill_report.write_report(report, self.out)
        return report


def _last_int(args: list[str], flag: str) -> int | None:
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return int(value) if value is not None and value.lstrip("-").isdigit() else None


def main(argv: list[str] | None = None) -> int:
    """Run a drill from command-line flags; 0 when everything recovered and nothing was lost."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not logging.getLogger().handlers:  # `python -m elastic_trainer.drill`; the CLI sets this up itself
        logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    try:
        args = parse_args(argv)
    except ScenarioError as exc:
        print(f"elastic-train drill: error: {exc}", file=sys.stderr)
        return 2
    drill = Drill(args, argv)

    def interrupted(signum, frame):
        raise DrillInterrupted(signum)

    previous = {}
    for sig in (signal.SIGTERM, signal.SIGHUP):
        try:
            previous[sig] = signal.signal(sig, interrupted)
        except ValueError:  # not the main thread: the caller handles signals
            break
    atexit.register(drill.cleanup)
    try:
        report = drill.run()
    except ScenarioError as exc:
        print(f"elastic-train drill: error: {exc}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, DrillInterrupted):
        print("elastic-train drill: interrupted; everything it started was stopped", file=sys.stderr)
        return 130
    finally:
        drill.cleanup()
        atexit.unregister(drill.cleanup)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(drill_report.summary_table(report))
    print(f"report: {drill.out / 'report.json'}  timeline: {drill.out / 'timeline.png'}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":  # python -m elastic_trainer.drill
    sys.exit(main())
