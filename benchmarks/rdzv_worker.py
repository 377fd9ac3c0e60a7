"""A tiny torchrun worker for rendezvous benchmarks and tests: gloo allreduce "steps".

Each step all-reduces one tensor over the world torchrun formed, sleeps, and appends
one JSON line to ``<out>/rank-<rank>-<pid>.jsonl``:

    {"start": unix time the allreduce was entered, "time": unix time it returned, "step": n,
     "round": ELASTIC_TRAINER_RDZV_ROUND,
     "world_size": W, "rank": R, "restart": TORCHELASTIC_RESTART_COUNT, "pid": pid, "sum": allreduce result}

It dies with its agent (PR_SET_PDEATHSIG), so killing an agent kills its node.

    torchrun --rdzv-backend etcd-v3 --rdzv-endpoint 127.0.0.1:2379 --nnodes 1:3 \\
        benchmarks/rdzv_worker.py --out /tmp/steps --sleep 0.1 --seconds 60

Below the worker, the harness that drives it: ``agent_cmd`` (one torchrun agent running it),
``signal_tree``, ``read_steps`` and the checks of its step logs. ``benchmarks/recovery.py`` and
``benchmarks/live_recovery.py`` measure with it, and ``tests/test_rendezvous_agents.py`` tests the
rendezvous with it (tests import it as ``benchmarks.rdzv_worker``; nothing in benchmarks/ imports
from tests/).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from datetime import timedelta

from elastic_trainer.drill.nodes import descendants
from elastic_trainer.env import ENV_RDZV_ROUND


def main(argv: list[str] | None = None) -> int:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the step logs")
    p.add_argument("--sleep", type=float, default=0.1, help="seconds to sleep per step")
    p.add_argument("--seconds", type=float, default=600, help="stop after this long")
    p.add_argument("--fence", action="store_true", help="check the round fence before logging each step")
    p.add_argument("--pg-timeout", type=float, default=30, help="gloo timeout in seconds")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    fence = None
    if args.fence:
        from elastic_trainer.rendezvous.round_fence import RoundFence
        fence = RoundFence.from_env()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank-{rank}-{os.getpid()}.jsonl")
    end = time.time() + args.seconds
    step = 0
    with open(path, "a", buffering=1) as log:
        while time.time() < end:
            t = torch.ones(1)
            start = time.time()
            dist.all_reduce(t)
            now = time.time()
            if fence is not None:
                fence.check()
            step += 1
            log.write(json.dumps({"start": start, "time": now, "step": step, "round": os.environ.get(ENV_RDZV_ROUND),
                                  "world_size": world, "rank": rank, "pid": os.getpid(), "sum": float(t.item()),
                                  "restart": os.environ.get("TORCHELASTIC_RESTART_COUNT")}) + "\n")
            time.sleep(args.sleep)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    from elastic_trainer.runtime import exit_without_teardown

    exit_without_teardown(main())


# -- harness for the tests and benchmarks that drive this worker ------------------------

WORKER = os.path.abspath(__file__)


def agent_cmd(endpoint: str, run_id: str, out: str, nnodes: str = "1:3", backend: str = "etcd-v3",
              conf: str = "", worker_args: tuple[str, ...] = ()) -> list[str]:
    """The command line of one torchrun agent (one node, one worker) running this worker."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
           "--rdzv-id", run_id, "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "100",
           "--monitor-interval", "0.1", "--local-addr", "127.0.0.1"]
    if conf:
        cmd += ["--rdzv-conf", conf]
    return cmd + [WORKER, "--out", out, *worker_args]


def signal_tree(pid: int, sig: int) -> None:
    """Send ``sig`` to ``pid``'s process group and to the group of every descendant."""
    groups = []
    for p in [pid, *descendants(pid)]:
        try:
            g = os.getpgid(p)
        except OSError:
            continue
        if g not in groups:
            groups.append(g)
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass


def read_steps(out: str) -> list[dict]:
    """Every complete step line under ``out``, sorted by time; a last line still being written (no
    newline yet) is left out, so the logs of running workers can be read at any time."""
    steps = []
    if os.path.isdir(out):
        for name in os.listdir(out):
            with open(os.path.join(out, name)) as f:
                steps += [json.loads(line) for line in f if line.endswith("\n")]
    return sorted(steps, key=lambda s: s["time"])


def world_problems(steps: list[dict]) -> list[str]:
    """What breaks "one world at a time" in the step logs (empty when nothing does).

    A world is a (round, world size) pair; within one, every step must report the same
    world size, and the spans of two worlds must not overlap. A world's span runs from the
    first to the last time one of its steps entered the allreduce: a worker paused inside an
    allreduce (SIGSTOP) may finish it after it resumes, which is the tail of a step its peers
    already took, not a step of a second world; a step it *starts* after another world began
    would be one.
    """
    spans: dict[tuple, list[float]] = {}
    for s in steps:
        key = (s["round"], s["world_size"])
        span = spans.setdefault(key, [s["start"], s["start"]])
        span[0], span[1] = min(span[0], s["start"]), max(span[1], s["start"])
    problems = []
    rounds: dict = {}
    for (round_, world) in spans:
        rounds.setdefault(round_, set()).add(world)
    problems += [f"round {r} reported world sizes {sorted(w)}" for r, w in rounds.items() if len(w) > 1]
    ordered = sorted(spans.items(), key=lambda kv: kv[1][0])
    for i, (k1, s1) in enumerate(ordered):
        for k2, s2 in ordered[i + 1:]:
            if s2[0] <= s1[1]:
                problems.append(f"world {k1} ({s1[0]:.3f}-{s1[1]:.3f}) overlaps world {k2} "
                                f"({s2[0]:.3f}-{s2[1]:.3f})")
    return problems


def world_summary(steps: list[dict]) -> list[str]:
    """One line per (round, world size, pid): how many steps, first start and last end (for failures)."""
    rows: dict[tuple, list] = {}
    for s in steps:
        row = rows.setdefault((s["round"], s["world_size"], s["pid"]), [0, s["start"], s["time"]])
        row[0], row[1], row[2] = row[0] + 1, min(row[1], s["start"]), max(row[2], s["time"])
    return [f"round {r} world {w} pid {p}: {n} steps, {a:.3f}-{b:.3f}"
            for (r, w, p), (n, a, b) in sorted(rows.items(), key=lambda kv: kv[1][1])]
