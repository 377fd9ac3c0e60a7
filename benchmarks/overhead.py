"""Steady-state overhead: samples/s of ``elastic-train`` against plain ``torchrun`` + DDP.

    .venv/bin/python benchmarks/overhead.py                 # 5 repeats each, 110 steps, ckpt every 50
    .venv/bin/python benchmarks/overhead.py --quick         # smoke test: 1 repeat each, 12 steps

Both sides train the built-in example task (``elastic_trainer.tasks.build_example``, same flags,
same global batch, 2 workers on this machine):

- A, elastic: ``elastic-train --nproc-per-node 2 -- --max-steps N --checkpoint-every 50``: embedded
  etcd, the etcd-v3 rendezvous, our trainer with its per-step JSON log, and an asynchronous
  checkpoint of model + optimizer + RNG + sampler every 50 steps (rank 0, local directory).
- B, plain: ``python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/plain_ddp.py``:
  DistributedSampler, DDP, Adam, no checkpoints, no logging in the loop.

The runs alternate, A B A B ..., so that the load other processes put on the machine falls on
both sides alike. Samples/s of a run is read from rank 0's per-step timestamps (the trainer's step
log; plain_ddp.py writes the same format at exit): ``global batch * steps / seconds`` over the
steps after ``--warmup-steps``, up to the last one. The window holds whole checkpoint periods
(warm-up 10, 110 steps: 100 measured steps, saves at 50 and 100), so the cost of each save (the blocked CPU copy and
the background serialization sharing the two cores) is inside it. Start-up (etcd, rendezvous,
imports) and the final blocking save are outside it and reported apart, as wall seconds.

Because this machine is shared, samples/s moves with other people's load. Two more numbers per
run help to read it: the median step time (leaves out save steps and bursts of load) and the CPU
seconds the whole job used per sample inside the window (launcher, etcd and workers, sampled from
/proc every 0.25 s), which counts the extra work of fault tolerance whatever else the cores do.

``OMP_NUM_THREADS`` is set to 1 for both sides (``--omp-threads``), the value torchrun's own CLI
sets when it starts more than one worker per node; see docs/benchmarks.md for why.

Prints one line per run, a summary table (median, min/max, IQR, the ratio of medians and the
median of the paired A/B ratios) and the commands; writes everything as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import provenance  # benchmarks/provenance.py: the results' header (date, commit, machine, command)
from elastic_trainer import records

REPO = Path(__file__).resolve().parent.parent
PLAIN_SCRIPT = REPO / "benchmarks" / "plain_ddp.py"


# ------------------------------------------------------------------------------- processes

def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (torchrun workers run in sessions of their own)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for path in glob.glob(f"/proc/{parent}/task/*/children"):
            try:
                with open(path) as f:
                    kids = [int(x) for x in f.read().split()]
            except OSError:
                continue
            found.extend(kids)
            todo.extend(kids)
    return found


def _kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the process, its process group, and the groups of all its descendants."""
    if proc.poll() is not None:
        return
    own = os.getpgid(0)
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            pgid = os.getpgid(pid)
            if pgid != own:
                os.killpg(pgid, signal.SIGKILL)
            else:
                os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a process (all its threads), from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime (fields 14 and 15 of stat)


def _role(pid: int) -> str:
    """What a process of the job is: etcd, worker rank N, or launcher (the torchrun agent and helpers)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return "launcher"
    if argv and os.path.basename(argv[0]) == b"etcd":
        return "etcd"
    if b"RANK" in env and (b"elastic_trainer.train" in argv or any(a.endswith(b"plain_ddp.py") for a in argv)):
        return f"rank {env[b'RANK'].decode()}"
    return "launcher"


class CpuMeter:
    """Samples the CPU seconds used so far by each process of a tree (agent, etcd, workers) every ``interval``."""

    def __init__(self, root: int, interval: float = 0.25) -> None:
        self.root, self.interval = root, interval
        self.seen: dict[int, float] = {}  # pid -> last CPU seconds read (kept after the process exits)
        self.roles: dict[int, str] = {}
        self.samples: list[tuple[float, dict[int, float]]] = []  # (unix time, {pid: CPU seconds so far})

    def sample(self) -> None:
        for pid in [self.root, *_descendants(self.root)]:
            cpu = _cpu_seconds(pid)
            if cpu is not None:
                self.seen[pid] = max(cpu, self.seen.get(pid, 0.0))
                if pid not in self.roles or self.roles[pid] == "launcher":  # a fresh child may not have exec'd yet
                    self.roles[pid] = _role(pid)
        self.samples.append((time.time(), dict(self.seen)))

    def between(self, t0: float, t1: float) -> dict[str, float] | None:
        """CPU seconds used from ``t0`` to ``t1`` per role, and ``total`` (linear between samples)."""
        def at(t: float) -> dict[int, float] | None:
            for (ta, ca), (tb, cb) in zip(self.samples, self.samples[1:]):
                if ta <= t <= tb:
                    f = (t - ta) / (tb - ta) if tb > ta else 0.0
                    return {pid: ca.get(pid, 0.0) + (cb[pid] - ca.get(pid, 0.0)) * f for pid in cb}
            return None
        a, b = at(t0), at(t1)
        if a is None or b is None:
            return None
        parts: dict[str, float] = {}
        for pid, cpu in b.items():
            role = self.roles.get(pid, "launcher")
            parts[role] = parts.get(role, 0.0) + cpu - a.get(pid, 0.0)
        parts["total"] = sum(parts.values())
        return parts


def run_command(cmd: list[str], *, env: dict, cwd: Path, log: Path, timeout: float) -> tuple[float, CpuMeter]:
    """Run ``cmd`` in its own session, output to ``log``, sampling its tree's CPU time.

    Returns (wall seconds, the CpuMeter); raises on a non-zero exit or after ``timeout`` (killing the tree).
    """
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        meter = CpuMeter(proc.pid)
        try:
            while True:
                meter.sample()
                try:
                    rc = proc.wait(timeout=meter.interval)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() - t0 > timeout:
                        raise
        except BaseException:
            _kill_tree(proc)
            raise
    if rc != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"exit status {rc} from {shlex.join(cmd)}; last output:\n{tail}")
    return time.monotonic() - t0, meter


# ------------------------------------------------------------------------------- measures

def read_step_times(log_dir: Path, rank: int = 0) -> dict[int, float]:
    """``{step: unix time}`` from the step log of ``rank`` under ``log_dir`` (one process expected)."""
    files = records.step_files(log_dir, rank)
    if len(files) != 1:
        raise RuntimeError(f"expected one step log of rank {rank} in {log_dir / records.STEPS_DIR}, found "
                           f"{len(files)} (a worker restarted? the run is not a steady state)")
    return {int(s.step): float(s.time) for s in records.read_file(files[0].path, records.StepRecord)}


def throughput(times: dict[int, float], warmup: int, global_batch: int) -> dict:
    """Samples/s over the steps after ``warmup``: from the end of step ``warmup`` to the last step."""
    last = max(times)
    if warmup not in times or last <= warmup:
        raise RuntimeError(f"step log has steps {min(times)}..{last}; need step {warmup} and later ones")
    seconds = times[last] - times[warmup]
    steps = last - warmup
    intervals = [times[s] - times[s - 1] for s in range(warmup + 1, last + 1) if s - 1 in times and s in times]
    typical = statistics.median(intervals)
    return {"samples_per_s": steps * global_batch / seconds, "steps": steps, "seconds": seconds,
            "median_step_s": typical, "median_step_samples_per_s": global_batch / typical,
            "first_step": warmup + 1, "last_step": last, "window": (times[warmup], times[last])}


def checkpoint_events(log_dir: Path, window: tuple[float, float]) -> list[records.EventRecord]:
    """The trainer's ``checkpoint_saved`` events (rank 0) inside the measured window."""
    return [e for e in records.read_events(log_dir)
            if e.event == records.Event.CHECKPOINT_SAVED and window[0] <= e.time <= window[1]]


def summary(values: list[float]) -> dict:
    """Median, min, max and the interquartile range of a list of numbers."""
    values = sorted(values)
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "min": values[0], "max": values[-1],
            "q1": q[0], "q3": q[2], "n": len(values), "values": values}


# ------------------------------------------------------------------------------- the benchmark

def _trainer_flags(args, checkpoints: bool) -> list[str]:
    ckpt = ["--checkpoint-every", str(args.checkpoint_every)] if checkpoints else []
    return ["--max-steps", str(args.max_steps), "--global-batch-size", str(args.global_batch_size), *ckpt,
            "--no-wandb", "--no-progress", *args.task_args]


def side_command(kind: str, args, run_dir: Path) -> list[str]:
    """The command of one side; ``trainer``/``trainer-nockpt`` split the overhead into its causes."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                str(args.nproc_per_node)]
    if kind == "elastic":  # A: what a user runs
        return [sys.executable, "-m", "elastic_trainer.cli", "--nproc-per-node", str(args.nproc_per_node),
                "--recovery", args.recovery, "--run-id", f"ovh-{uuid.uuid4().hex[:8]}", "--log-dir", str(run_dir),
                "--checkpoint-dir", str(run_dir / "ckpt"), "--", *_trainer_flags(args, True)]
    if kind == "plain":  # B: the baseline
        return [*torchrun, str(PLAIN_SCRIPT), "--max-steps", str(args.max_steps), "--global-batch-size",
                str(args.global_batch_size), "--warmup-steps", str(args.warmup_steps), "--log-dir", str(run_dir),
                *args.task_args]
    if kind in ("trainer", "trainer-nockpt"):  # our trainer under plain torchrun: no etcd, no etcd-v3 rendezvous
        ckpt = kind == "trainer"
        return [*torchrun, "-m", "elastic_trainer.train", "--log-dir", str(run_dir),
                *(["--checkpoint-dir", str(run_dir / "ckpt")] if ckpt else []), *_trainer_flags(args, ckpt)]
    raise ValueError(f"unknown side {kind!r}; choose from {', '.join(SIDES)}")


SIDES = ("elastic", "plain", "trainer", "trainer-nockpt")


def measure(kind: str, args, run_dir: Path, env: dict) -> dict:
    run_dir.mkdir(parents=True)
    cmd = side_command(kind, args, run_dir)
    load = os.getloadavg()[0]
    wall, meter = run_command(cmd, env=env, cwd=run_dir, log=run_dir / "output.log", timeout=args.timeout)
    try:
        times = read_step_times(run_dir)
    except RuntimeError as exc:
        tail = (run_dir / "output.log").read_text(errors="replace")[-4000:]
        raise RuntimeError(f"{exc}; command: {shlex.join(cmd)}; its output ends with:\n{tail}") from exc
    result = throughput(times, args.warmup_steps, args.global_batch_size)
    window = result.pop("window")
    cpu = meter.between(*window)  # CPU seconds of the whole tree (launcher, etcd, workers) inside the window
    samples = result["steps"] * args.global_batch_size
    result["cpu_s"] = cpu["total"] if cpu else None
    result["cpu_ms_per_sample"] = cpu["total"] * 1e3 / samples if cpu else None
    result["cpu_ms_per_sample_by_role"] = {k: v * 1e3 / samples for k, v in sorted(cpu.items())} if cpu else {}
    saves = checkpoint_events(run_dir, window)
    result.update(kind=kind, wall_s=wall, load_before=load, command=shlex.join(cmd),
                  checkpoints=len(saves), blocked_s=sum(e.blocked_s or 0.0 for e in saves))
    return result


def verdict(ratio: float) -> str:
    """The 2% target read from the ratio of medians elastic/plain: met within 0.98..1.02; above 1.02 the
    elastic side cannot really be faster (it does more), so the run's noise hides the answer."""
    if ratio > 1.02:
        return (f"not resolved (elastic/plain {ratio:.3f}: faster than the baseline it adds work to, so this run's "
                "noise is larger than the target; see the CPU per sample and rerun with more repeats)")
    return "met" if ratio >= 0.98 else "MISSED"


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5, help="runs of each side, alternated (default 5)")
    p.add_argument("--max-steps", type=int, default=110, help="optimizer steps per run (default 110)")
    p.add_argument("--warmup-steps", type=int, default=10, help="steps left out of samples/s (default 10)")
    p.add_argument("--checkpoint-every", type=int, default=50, help="elastic side: save every N steps (default 50)")
    p.add_argument("--global-batch-size", type=int, default=32, help="both sides (default 32, the trainer's)")
    p.add_argument("--nproc-per-node", type=int, default=2, help="workers (default 2)")
    p.add_argument("--omp-threads", default="1",
                   help="OMP_NUM_THREADS for both sides (default 1, torchrun's; 'inherit' leaves the environment's)")
    p.add_argument("--task-args", default="", metavar="'FLAGS'",
                   help="example-task flags for both sides, e.g. '--d-model 64' (default: the example's defaults "
                        "with --example seeds, the workload the recorded results were measured on)")
    p.add_argument("--sides", default="elastic,plain",
                   help="comma list, run in this order each repeat (default elastic,plain); also: trainer "
                        "(our trainer + checkpoints under plain torchrun) and trainer-nockpt, to split the overhead")
    p.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    p.add_argument("--recovery", choices=("live", "restart"), default="live",
                   help="the elastic side's --recovery (default live, elastic-train's for this trainer)")
    p.add_argument("--workdir", default=None, help="keep run logs here (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    provenance.add_arguments(p)
    p.add_argument("--quick", action="store_true", help="smoke test: 1 repeat, 12 steps, save every 5, tiny model")
    args = p.parse_args(argv)
    if args.quick:
        args.repeats, args.max_steps, args.warmup_steps, args.checkpoint_every = 1, 12, 2, 5
        args.task_args = args.task_args or "--d-model 32 --dim-feedforward 64 --dataset-size 256"
    args.task_args = ["--example", "seeds", *shlex.split(args.task_args)]  # a later --example wins
    args.sides = [x.strip() for x in args.sides.split(",") if x.strip()]
    if not {"elastic", "plain"} <= set(args.sides) or not set(args.sides) <= set(SIDES):
        p.error(f"--sides must include elastic and plain, and only these: {', '.join(SIDES)}")
    if args.repeats < 1 or args.max_steps <= args.warmup_steps + 1:
        p.error("need --repeats >= 1 and --max-steps > --warmup-steps + 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(args, run)


def _main(args, run: provenance.Run) -> int:
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    for name in [k for k in env if k.startswith("ELASTIC_TRAINER_") and k != "ELASTIC_TRAINER_S3_ENDPOINT_URL"]:
        del env[name]
    if args.omp_threads != "inherit":
        env["OMP_NUM_THREADS"] = args.omp_threads
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    workdir = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    try:
        for i in range(args.repeats):
            for kind in args.sides:
                r = measure(kind, args, workdir / f"{i:02d}-{kind}", env)
                r["repeat"] = i
                runs.append(r)
                cpu = f"{r['cpu_ms_per_sample']:.2f}" if r["cpu_ms_per_sample"] else "?"
                print(f"repeat {i} {kind:14s} {r['samples_per_s']:7.1f} samples/s over steps {r['first_step']}.."
                      f"{r['last_step']} ({r['seconds']:.1f} s; median step {r['median_step_s'] * 1e3:.0f} ms; "
                      f"{cpu} CPU ms/sample), "
                      f"wall {r['wall_s']:.1f} s, load {r['load_before']:.1f}"
                      + (f", {r['checkpoints']} checkpoints blocked {r['blocked_s'] * 1e3:.0f} ms in all"
                         if r["checkpoints"] else ""), flush=True)
    except BaseException:
        print(f"overhead: a run failed; its logs are kept in {workdir}", file=sys.stderr)
        raise
    else:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)

    by = {k: [r for r in runs if r["kind"] == k] for k in args.sides}
    sides = {}
    for k, rs in by.items():
        sides[k] = {"samples_per_s": summary([r["samples_per_s"] for r in rs]),
                    "median_step_samples_per_s": summary([r["median_step_samples_per_s"] for r in rs]),
                    "cpu_ms_per_sample": summary([r["cpu_ms_per_sample"] for r in rs if r["cpu_ms_per_sample"]]
                                                 or [float("nan")]),
                    "wall_s": summary([r["wall_s"] for r in rs]), "command": rs[0]["command"]}
        roles = sorted({role for r in rs for role in r["cpu_ms_per_sample_by_role"]})
        sides[k]["cpu_ms_per_sample_by_role"] = {
            role: statistics.median([r["cpu_ms_per_sample_by_role"].get(role, 0.0) for r in rs]) for role in roles}
        if k != "plain":
            sides[k]["paired_ratio"] = summary([x["samples_per_s"] / y["samples_per_s"]
                                                for x, y in zip(rs, by["plain"])])
    for k in args.sides:  # after the loop: plain may come after the others in --sides
        if k != "plain":
            sides[k]["ratio_of_medians"] = sides[k]["samples_per_s"]["median"] / sides["plain"]["samples_per_s"]["median"]
            sides[k]["median_step_ratio"] = (sides[k]["median_step_samples_per_s"]["median"]
                                             / sides["plain"]["median_step_samples_per_s"]["median"])
            sides[k]["cpu_ratio"] = (sides[k]["cpu_ms_per_sample"]["median"]
                                     / sides["plain"]["cpu_ms_per_sample"]["median"])
    ratio = sides["elastic"]["ratio_of_medians"]
    overhead = 1 - ratio  # negative: the elastic side was faster, which only this run's noise can do
    result = {
        "benchmark": "overhead", "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "elastic_command": sides["elastic"]["command"], "plain_command": sides["plain"]["command"],
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "txt")},
        "omp_num_threads": env.get("OMP_NUM_THREADS"), "cpus": os.cpu_count(),
        "elastic": sides["elastic"]["samples_per_s"], "plain": sides["plain"]["samples_per_s"],
        "paired_ratio": sides["elastic"]["paired_ratio"], "ratio_of_medians": ratio,
        "median_step_ratio": sides["elastic"]["median_step_ratio"], "cpu_ratio": sides["elastic"]["cpu_ratio"],
        "overhead": overhead, "within_2_percent": abs(overhead) <= 0.02, "sides": sides, "runs": runs,
    }
    import torch  # only for the version line

    print(f"\ncommand: {result['command']}")
    for k in args.sides:
        print(f"{k}: {sides[k]['command']}")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={env.get('OMP_NUM_THREADS')}, "
          f"{args.repeats} alternated repeats, samples/s over steps {args.warmup_steps + 1}..{args.max_steps}")
    print("side           | median samples/s | min    | max    | IQR            | /plain (paired min..max) "
          "| median-step samples/s | CPU ms/sample | wall s")
    for k in args.sides:
        st, ms = sides[k]["samples_per_s"], sides[k]["median_step_samples_per_s"]
        rel = ("" if k == "plain" else f"{sides[k]['ratio_of_medians']:.3f} ({sides[k]['paired_ratio']['min']:.2f}.."
               f"{sides[k]['paired_ratio']['max']:.2f})")
        print(f"{k:14s} | {st['median']:16.1f} | {st['min']:6.1f} | {st['max']:6.1f} | {st['q1']:6.1f}..{st['q3']:<6.1f} "
              f"| {rel:24s} | {ms['median']:21.1f} | {sides[k]['cpu_ms_per_sample']['median']:13.2f} "
              f"| {sides[k]['wall_s']['median']:.1f}")
    paired = result["paired_ratio"]
    print(f"ratio of medians elastic/plain: {ratio:.3f} (overhead {overhead:+.1%}); paired ratios: median "
          f"{paired['median']:.3f}, min {paired['min']:.3f}, max {paired['max']:.3f}")
    print(f"typical step (median step time, leaves out save steps and load spikes) elastic/plain: "
          f"{result['median_step_ratio']:.3f}")
    print(f"CPU time of the whole job (launcher, etcd, workers) per sample, elastic/plain: {result['cpu_ratio']:.3f} "
          "(less sensitive to other load than samples/s)")
    roles = sorted({role for k in args.sides for role in sides[k]["cpu_ms_per_sample_by_role"]},
                   key=lambda r: (r == "total", r))
    print("CPU ms per sample by process (median over repeats): side | " + " | ".join(roles))
    for k in args.sides:
        by_role = sides[k]["cpu_ms_per_sample_by_role"]
        print(f"  {k:14s} | " + " | ".join(f"{by_role.get(role, 0.0):.3f}" for role in roles))
    print(f"target (overhead <= 2%): {verdict(ratio)}")
    if args.out:
        provenance.write_json(args.out, {**result, "verdict": verdict(ratio)}, run)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
