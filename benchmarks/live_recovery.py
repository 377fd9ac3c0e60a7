"""Live recovery (issue 17): seconds lost per fault and goodput, live vs restart vs torchrun's c10d.

Run (from the repository root; about 3 min per trial of all three systems, plus 2 x
``--goodput-seconds`` per goodput system and their start-ups):

    .venv/bin/python benchmarks/live_recovery.py --trials 20 --json out.json
    .venv/bin/python benchmarks/live_recovery.py --trials 3 --goodput-seconds 60     # a quick look
    .venv/bin/python benchmarks/live_recovery.py --systems live --trials 1 --goodput-seconds 20   # the smoke test

``--fsdp`` (issue 31): nodes of 2 workers each, the trainer with ``--fsdp`` (HSDP: sharded within a
node, replicated across nodes), live against restart, the loud scenarios; world sizes are in ranks:

    .venv/bin/python benchmarks/live_recovery.py --fsdp --systems live,restart --goodput-systems live,restart \
        --trials 3 --goodput-seconds 60 --txt benchmarks/results/live_recovery_fsdp.txt

``--fsdp-shard-all`` (no shard has a second copy: a lost node costs a checkpoint reload in place, a
join reshards every rank from the survivors' live shards) and ``--fsdp-peer-copy-every K`` (the
lost node's shards rebuilt from copies in a peer's host memory instead):

    .venv/bin/python benchmarks/live_recovery.py --fsdp --fsdp-shard-all --systems live,restart \
        --goodput-seconds 0 --trials 3 --txt benchmarks/results/live_recovery_fsdp_shard_all.txt
    .venv/bin/python benchmarks/live_recovery.py --fsdp --fsdp-shard-all --fsdp-peer-copy-every 5 --systems live \
        --goodput-seconds 0 --trials 3 --txt benchmarks/results/live_recovery_fsdp_peer_copy.txt

Four systems, ``--nodes`` nodes of one worker each on loopback, the same small model (``TINY``):

  live        ``elastic-train --recovery live``: survivors keep their processes and re-form the group;
  own-loop    ``elastic-train examples/own_loop.py``: a plain DDP script of its own (DataLoader,
              ElasticSampler, rank-0 checkpoints after each epoch) through ``elastic_trainer.Manager``,
              live by default (the same kills and join; its steps logged by the Manager);
  restart     ``elastic-train --recovery restart``: every change restarts the workers, which resume
              from the newest checkpoint (the same ``--checkpoint-every`` on both of ours);
  c10d-tuned  ``torchrun`` + ``benchmarks/plain_ddp.py`` (DDP, no checkpoints) on c10d as
              ``benchmarks/recovery.py`` tunes it (1 s heartbeats, last call 1 s, store not shared).

Each trial, per system, in one job while it survives (a fresh job for what follows a failure):

  kill-other  SIGKILL the node of the highest rank -> the first step at N-1;
  join        then start a node -> the survivors' pause (their last step at N-1 to the first step at N)
              and the newcomer's start -> its first step (live: where it went, from its log, and just
              before it, torch's part of it: a fresh interpreter's ``import torch, torch._dynamo`` timed
              beside the members, ``import_floor``);
  kill-rank0  SIGKILL the node of rank 0 -> the first step at N-1;
  stop-node, stop-rank0, cut-node, hang
              silent faults (issue 27, ``benchmarks/silent.py``): a node frozen or cut off, a worker
              hung -> the first step at N-1 (or "> cap" after ``--cap`` s) and back at N. cut-node runs in
              a job of its own whose nodes live in network namespaces (root). The restart path and
              c10d run with ``--baseline-collective-timeout`` (30 s; their defaults are 300 s and 30 min).

A slow node (a straggler, issue 44) is not a fault with a "first step after": its scenario is
``benchmarks/stragglers.py``, the same three nodes and model side by side on the live path (evicted),
the restart path and plain torchrun (both run at its pace), samples/s over 60 s.

``--scenarios`` picks some (all by default), e.g. ``--scenarios stop-node,stop-rank0,cut-node,hang
--goodput-seconds 0`` for the silent faults alone. ``--txt`` and ``--json`` write the results with
the commit and the date (``benchmarks/results/``).

For each fault it also counts the steps redone (the last step any rank completed before it, minus
the first step after it, plus one; 0 when nothing is lost; plain_ddp has no checkpoints and starts
over at step 1) and, on the live path, the survivors' extra peak memory: VmHWM from
/proc/<pid>/status before and after the re-form (a join broadcasts the whole training state).

Steps are padded with ``--sleep-per-step`` (0.05 s; printed with the measured step interval) so that
the step rate is set by the sleep, not by 2 shared cores. Goodput: per ``--goodput-systems``, a run
of ``--goodput-seconds`` with a fault every ``--fault-every`` seconds (alternately SIGKILL a random
node of the world and start a node) against the same run without faults; the window starts once
the world has N nodes, and its steps are the highest step reached minus the step at its start;
beside that ratio it prints the share of the faulted window not stalled (see ``stalled_seconds``),
which load on a shared machine does not move.

Every process it starts is an agent in its own session, killed with its workers through the
recorded agent PID (``signal_tree``), and every etcd is stopped, also on error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery  # noqa: E402  (benchmarks/recovery.py: the job, c10d's settings, the waits)
import silent  # noqa: E402  (benchmarks/silent.py: frozen, cut-off and hung nodes)
from recovery import Failed  # noqa: E402

from elastic_trainer import records  # noqa: E402
from benchmarks import provenance  # noqa: E402  (the results' header: date, commit, machine, command)
from benchmarks.rdzv_worker import agent_cmd, signal_tree  # noqa: E402
from elastic_trainer.drill.nodes import descendants  # noqa: E402

SYSTEMS = ("live", "own-loop", "restart", "c10d-tuned")
LIVE_SYSTEMS = ("live", "own-loop")
LOUD = ("kill-other", "join", "kill-rank0")
SCENARIOS = (*LOUD, *silent.SCENARIOS)
EXAMPLE = ["--example", "seeds", "--d-model", "16", "--nhead", "2", "--layers", "1", "--dim-feedforward", "32", "--src-len", "2",
           "--tgt-len", "4", "--dataset-size", "2400", "--loss", "mse", "--global-batch-size", "12"]
"""The model and data of /tmp/live/try.py's experiment, flags both the trainer and plain_ddp.py take."""
TRAINER = ["--micro-batch-size", "3", "--no-wandb", "--no-progress", "--max-steps", "1000000"]
RDZV_CONF = "lease_ttl=3,keep_alive_interval=1,last_call_timeout=1"
TARGETS = {"kill": "median < 0.5 s, worst < 1 s, all recovered", "join": "pause median < 0.5 s",
           "goodput": ">= 0.9 (restart path measured before: 0.53)"}


def read_steps(log_dir: Path) -> list[dict]:
    """Every step the workers under ``log_dir`` logged (``records``), as dicts with the worker's pid, by time."""
    steps = [{**r.to_json(), "pid": f.pid} for f in records.step_files(log_dir)
             for r in records.read_file(f.path, records.StepRecord)]
    return sorted(steps, key=lambda s: s["time"])


class TrainerJob(recovery.Job):
    """Our trainer (``elastic-train``) on one etcd, with ``--recovery live`` or ``restart``."""

    def __init__(self, recovery_mode: str, nodes: int, workdir: Path, settings: argparse.Namespace, net=None) -> None:
        super().__init__("etcd-v3", nodes, workdir, net=net)
        self.name, self.recovery, self.settings = recovery_mode, recovery_mode, settings
        self.env = {"OMP_NUM_THREADS": "1", **silent.DEBUG_ENV}

    def node_cmd(self) -> list[str]:
        s = self.settings
        return [sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"{s.min_nodes}:{self.max_nodes}",
                "--rdzv-endpoint", self.endpoint, "--run-id", "bench", "--rdzv-conf", RDZV_CONF,
                "--recovery", self.recovery, "--local-addr", "127.0.0.1", "--nproc-per-node", str(s.nproc),
                "--checkpoint-dir", str(self.dir / "ckpt"), "--log-dir", str(self.dir), "--",
                *EXAMPLE, *shlex.split(s.model_args), *TRAINER, *(["--fsdp"] if s.fsdp else []),
                *(["--fsdp-shard-all"] if s.fsdp_shard_all else []),
                *(["--fsdp-peer-copy-every", str(s.fsdp_peer_copy_every)] if s.fsdp_peer_copy_every else []),
                "--sleep-per-step", str(s.sleep_per_step),
                "--checkpoint-every", str(s.checkpoint_every),
                *(["--collective-timeout", str(s.baseline_collective_timeout)] if self.recovery == "restart" else [])]

    def steps(self) -> list[dict]:
        return read_steps(self.dir)

    def events(self) -> list[dict]:
        return [e.to_json() for e in records.read_events(self.dir)]


class OwnLoopJob(TrainerJob):
    """``examples/own_loop.py`` (a plain DDP loop through ``elastic_trainer.Manager``) under
    ``elastic-train``, live: the Manager's recovery without the built-in trainer."""

    def __init__(self, nodes: int, workdir: Path, settings: argparse.Namespace, net=None) -> None:
        super().__init__("live", nodes, workdir, settings, net)
        self.name = "own-loop"

    def node_cmd(self) -> list[str]:
        s = self.settings
        return [sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"{s.min_nodes}:{self.max_nodes}",
                "--rdzv-endpoint", self.endpoint, "--run-id", "bench", "--rdzv-conf", RDZV_CONF,
                "--local-addr", "127.0.0.1", "--log-dir", str(self.dir), str(REPO / "examples" / "own_loop.py"),
                "--epochs", "1000000", "--checkpoint", str(self.dir / "own_loop.pt"),
                "--sleep-per-step", str(s.sleep_per_step)]


class PlainJob(recovery.Job):
    """torchrun on c10d (as ``recovery.py`` tunes it) running ``benchmarks/plain_ddp.py``."""

    def __init__(self, nodes: int, workdir: Path, settings: argparse.Namespace, net=None) -> None:
        super().__init__("c10d-tuned", nodes, workdir, net=net)
        self.settings = settings
        self.env = {**self.env, "OMP_NUM_THREADS": "1"}

    def node_cmd(self) -> list[str]:
        s = self.settings
        cmd = agent_cmd(self.endpoint, "bench", self.out, nnodes=f"{s.min_nodes}:{self.max_nodes}",
                        backend=self.rdzv_backend, conf=self.conf)
        cmd = cmd[:cmd.index("--out") - 1]  # torchrun's flags, without benchmarks/rdzv_worker.py
        return [*cmd, str(REPO / "benchmarks" / "plain_ddp.py"), *EXAMPLE, "--max-steps", "1000000",
                "--log-dir", str(self.dir), "--live-step-log", "--sleep-per-step", str(s.sleep_per_step),
                "--collective-timeout", str(s.baseline_collective_timeout)]

    def steps(self) -> list[dict]:
        return read_steps(self.dir)

    def events(self) -> list[dict]:
        return []


def make_job(system: str, nodes: int, workdir: Path, settings: argparse.Namespace, netns: bool = False) -> recovery.Job:
    """A job of ``system``; with ``netns`` its nodes each in a network namespace (``silent.Netns``)."""
    net = silent.Netns() if netns else None
    try:
        if system == "c10d-tuned":
            return PlainJob(nodes, workdir, settings, net)
        if system == "own-loop":
            return OwnLoopJob(nodes, workdir, settings, net)
        return TrainerJob(system, nodes, workdir, settings, net)
    except BaseException:
        if net is not None:
            net.close()
        raise


# ---- what the step logs say --------------------------------------------------------------------
def vm_hwm_mib(pid: int) -> float | None:
    """The peak resident memory of ``pid`` so far (VmHWM), in MiB; None when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def world_pids(steps: list[dict], size: int) -> dict[int, int]:
    """{rank: pid} of the newest world of ``size`` in the logs."""
    last: dict[int, int] = {}
    for s in steps:
        if s["world_size"] == size:
            last[s["rank"]] = s["pid"]
    return last


def redone_steps(steps: list[dict], t0: float, size: int) -> int | None:
    """Steps done again after a change at ``t0``: the last step completed before the first step at
    world size ``size`` after ``t0``, minus that first step, plus one (0: training went on where it
    stopped; a step that ended just after a kill, its all-reduce done before it, counts as done)."""
    after = [s for s in steps if s["time"] > t0 and s["world_size"] == size]
    if not after:
        return None
    before = [s["step"] for s in steps if s["time"] < after[0]["time"] and not (
        s["time"] > t0 and s["world_size"] == size)]
    return max(before) - after[0]["step"] + 1 if before else None


def pause_around(steps: list[dict], t0: float, old: int, new: int) -> float | None:
    """Seconds between the last step at size ``old`` and the first step at size ``new`` after ``t0``."""
    firsts = [s["time"] for s in steps if s["time"] > t0 and s["world_size"] == new]
    if not firsts:
        return None
    lasts = [s["time"] for s in steps if s["world_size"] == old and s["time"] < firsts[0]]
    return firsts[0] - lasts[-1] if lasts else None


def longest_gap(steps: list[dict], t0: float, end: float, ranks) -> float | None:
    """The longest interval between two consecutive steps of any rank in ``ranks`` from its last
    step before ``t0`` to ``end``: a join's pause is one of them, and a step slowed while the
    newcomer's group formed beside the old one (``group_ahead.py``) would be another."""
    out = None
    for r in ranks:
        times = sorted(s["time"] for s in steps if s["rank"] == r and s["time"] <= end and "loss_scope" not in s)
        before = [t for t in times if t <= t0]
        times = before[-1:] + [t for t in times if t > t0]
        gaps = [b - a for a, b in zip(times, times[1:])]
        if gaps:
            out = max(gaps) if out is None else max(out, max(gaps))
    return out


def step_interval(steps: list[dict], size: int) -> float | None:
    """Median seconds between consecutive steps of one rank (rank 0) at world size ``size``."""
    times = [s["time"] for s in steps if s["world_size"] == size and s["rank"] == 0 and "loss_scope" not in s]
    gaps = [b - a for a, b in zip(times, times[1:]) if 0 < b - a < 1.0]
    return statistics.median(gaps) if gaps else None


def reform_event(job: recovery.Job, t0: float) -> dict | None:
    """The first ``live_reform`` event rank 0 logged after ``t0``: its phase timings and, under
    ``--fsdp``, the bytes of shards the re-form moved over all ranks (``moved_bytes``: a join's
    newcomers' shards from their donors, a reshard's rows)."""
    for e in job.events():
        if e.get("event") == "live_reform" and e.get("time", 0) > t0:
            return {k: e[k] for k in ("cause", "teardown_s", "agree_s", "group_s", "state_s", "total_s",
                                      "receivers", "moved_bytes", "sent_bytes", "state_from", "ahead") if k in e}
    return None


# ---- one trial ----------------------------------------------------------------------------------
def _steady(job: recovery.Job, size: int, timeout: float) -> dict[int, int]:
    """Wait for ``size`` ranks stepping at world size ``size`` now, then a second of steady steps.

    Only steps from now on count: a world that was ``size`` before a fault the job has not been
    healed of (a kill with no join after it) is not steady at ``size``."""
    job.world_formed(size, timeout, since=time.time())
    time.sleep(1.0)
    return job.world_formed(size, timeout, since=time.time())


def _kill(job: recovery.Job, rank: int, n: int, timeout: float, live: bool, w: int = 1) -> dict:
    """SIGKILL the node (``w`` workers) of ``rank`` in the world of ``n`` ranks; measure the way back to ``n - w``."""
    ranks = _steady(job, n, timeout)
    victim = job.agent_of(ranks[rank])
    survivors = [pid for pid in ranks.values() if pid not in descendants(victim.pid)]
    hwm_before = {pid: vm_hwm_mib(pid) for pid in survivors}
    t0 = time.time()
    signal_tree(victim.pid, signal.SIGKILL)
    victim.wait()
    out: dict = {"s": job.first_step_after(t0, n - w, timeout)}
    job.world_formed(n - w, timeout)
    time.sleep(0.5)  # a few steps at n - w: their lines are logged at the next step-end agreement
    steps = job.steps()
    out["redone"] = redone_steps(steps, t0, n - w)
    if live:
        out["hwm_extra_mib"] = _hwm_extra(hwm_before)
        out["reform"] = reform_event(job, t0)
    return out


def measure_join(job: recovery.Job, n: int, timeout: float, live: bool, w: int = 1) -> dict:
    """Start a node (``w`` workers) in the world of ``n - w`` ranks; measure the survivors' pause and the newcomer's start."""
    ranks = _steady(job, n - w, timeout)
    floor = import_floor(job) if live else None
    hwm_before = {pid: vm_hwm_mib(pid) for pid in ranks.values()}
    t0 = time.time()
    job.start_node()
    out: dict = {"s": job.first_step_after(t0, n, timeout), "import_floor": floor}
    job.world_formed(n, timeout)
    if live:
        out["phases"] = newcomer_phases(job.dir / f"agent-{len(job.agents) - 1}.log", t0, t0 + out["s"])
    time.sleep(0.5)
    steps = job.steps()
    out["pause"] = pause_around(steps, t0, n - w, n)
    out["longest"] = longest_gap(steps, t0, t0 + out["s"] + 1.0, range(n - w))
    out["redone"] = redone_steps(steps, t0, n)
    if live:
        out["hwm_extra_mib"] = _hwm_extra(hwm_before)
        out["reform"] = reform_event(job, t0)
    return out


IMPORT_FLOOR = "import torch, torch._dynamo"
"""What every newcomer's worker imports before its first step, whatever starts it: torch, and
``torch._dynamo``, which DDP's constructor and each torch optimizer's ``step`` import."""


def import_floor(job: recovery.Job) -> float:
    """Seconds a fresh interpreter takes to run :data:`IMPORT_FLOOR` beside the job's members (its
    threads as theirs): the part of a newcomer's start that is torch's, measured where it joins."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", IMPORT_FLOOR], check=True, env={**os.environ, **job.env}, timeout=120)
    return time.perf_counter() - started


_ASCTIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]")  # our loggers' lines
_GLOG = re.compile(r"^I(\d{4} \d\d:\d\d:\d\d\.\d{6}) ")  # torch's agent's lines: I1203 12:44:08.059000


def _line_time(line: str, year: int) -> float | None:
    """The wall-clock time a log line starts with (local time), or None."""
    if m := _ASCTIME.match(line):
        return time.mktime(time.strptime(m.group(1).split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(m.group(1)[-3:]) / 1e3
    if m := _GLOG.match(line):
        whole, frac = m.group(1).split(".")
        return time.mktime(time.strptime(f"{year}{whole}", "%Y%m%d %H:%M:%S")) + int(frac) / 1e6
    return None


NEWCOMER_PHASES = ("launcher", "worker", "fork", "build", "warm_up", "admission", "group", "state", "first_step")


def newcomer_phases(log: Path, t0: float, first_step: float) -> dict[str, float] | None:
    """Where a joining node's start went, from its log (a live worker's; None if a mark is missing):
    ``launcher`` its start -> torch's agent starting its worker (imports, node check, rendezvous);
    ``worker`` -> the worker asking to be admitted, in two: ``fork``, until its process exists (a
    forked worker: the fork server's imports of torch, ``torch._dynamo`` and ours that it waited for)
    and ``build``, its own start-up (the Manager, the task, its data, and ``warm_up``: DDP's first
    construction's imports, the state codec's first use); ``admission`` -> the quorum that admits it;
    ``group`` -> its group formed; ``state`` -> the state received from a peer (the members switch
    once it is ready); ``first_step`` -> its first step. ``fork`` and ``build`` are -1 when the
    worker's log does not say its process's age (before 2026-12-04)."""
    year = time.localtime(t0).tm_year
    marks: dict[str, float] = {}
    warm = admitted = age = None
    for line in log.read_text(errors="replace").splitlines():
        at = _line_time(line, year)
        if at is None or at < t0 - 1.0:
            continue
        if "Starting worker group" in line and "started" not in marks:
            marks["started"] = at
        elif "live: asking to be admitted" in line and "asking" not in marks:
            warm = re.search(r"warm-up of ([\d.]+)s", line)
            age = re.search(r"started ([\d.]+)s ago", line)
            marks["asking"] = at
        elif "live: admitted to quorum" in line and admitted is None:
            admitted = re.search(r"after ([\d.]+)s .*group in ([\d.]+)s", line)
            marks["admitted"] = at
        elif "live: received the training state" in line and "received" not in marks:
            marks["received"] = at
    if warm is None or admitted is None or not {"started", "asking", "received"} <= marks.keys():
        return None
    admission, group = (float(x) for x in admitted.groups())
    build = float(age.group(1)) if age is not None else None
    return {"launcher": marks["started"] - t0, "worker": marks["asking"] - marks["started"],
            "fork": marks["asking"] - marks["started"] - build if build is not None else -1.0,
            "build": build if build is not None else -1.0, "warm_up": float(warm.group(1)), "admission": admission,
            "group": group, "state": marks["received"] - marks["admitted"], "first_step": first_step - marks["received"]}


def _hwm_extra(before: dict[int, float | None]) -> dict[str, float] | None:
    """The survivors' VmHWM growth since ``before``, in MiB: the largest and the median."""
    grown = [after - b for pid, b in before.items()
             if b is not None and (after := vm_hwm_mib(pid)) is not None]
    if not grown:
        return None
    return {"max": max(grown), "median": statistics.median(grown), "survivors": len(grown)}


def trial(system: str, args: argparse.Namespace, root: Path) -> dict:
    """Every scenario once; a scenario that fails ends its job, and the next one starts a fresh job
    (as does one that needs network namespaces after one that does not)."""
    nodes, w, live, results = args.nodes, args.nproc, system in LIVE_SYSTEMS, {}
    n = nodes * w  # ranks
    job, jobs = None, 0
    missing = 0  # nodes the job lost to a kill and has not got back by a join
    try:
        for scenario in args.scenarios:
            if scenario == "join" and not isinstance(results.get("kill-other"), dict):
                results["join"] = "not run (kill-other failed)"
                continue
            netns = scenario in silent.NEEDS_NETNS
            if netns and silent.can_cut():
                results[scenario] = silent.can_cut()
                continue
            if job is not None and (job.net is not None) != netns:
                job.close()
                job = None
            try:
                if job is None:
                    jobs += 1
                    job = make_job(system, nodes, root / f"{system}-{jobs}", args, netns)
                    for _ in range(nodes):
                        job.start_node()
                    try:
                        _steady(job, n, args.timeout)
                    except Failed as exc:
                        raise Failed(f"setup {exc}") from exc
                    results.setdefault("step_interval", step_interval(job.steps(), n))
                    missing = 0
                if scenario != "join":  # every other scenario starts from a world of N: give back the killed node
                    for _ in range(missing):
                        job.start_node()
                    missing = 0
                if scenario == "join":
                    results[scenario] = measure_join(job, n, args.timeout, live, w)
                    missing = max(0, missing - 1)
                elif scenario in silent.SCENARIOS:
                    results[scenario] = silent.measure(job, scenario, n, args, live,
                                                       lambda j, size: _steady(j, size, args.timeout), redone_steps)
                else:
                    results[scenario] = _kill(job, 0 if scenario == "kill-rank0" else n - 1, n, args.timeout, live, w)
                    missing += 1
            except Failed as exc:
                results[scenario] = str(exc)
                if job is not None:
                    job.close()
                job = None
    finally:
        if job is not None:
            job.close()
    return results


# ---- goodput ------------------------------------------------------------------------------------
def goodput_run(system: str, args: argparse.Namespace, workdir: Path, faults: bool) -> dict:
    """Steps reached in ``--goodput-seconds`` after the world has N nodes, with or without faults."""
    n, rng = args.nodes, random.Random(args.seed)
    job = make_job(system, n, workdir, args)
    log: list[str] = []
    try:
        for _ in range(n):
            job.start_node()
        job.world_formed(n * args.nproc, args.timeout)
        t_start = time.time()
        end = t_start + args.goodput_seconds
        step_start = max(s["step"] for s in job.steps() if s["time"] <= t_start)
        kill_next, next_fault = True, t_start + args.fault_every
        while faults and next_fault < end:
            time.sleep(max(0.0, next_fault - time.time()))
            if kill_next:
                log.append(_kill_random_member(job, rng, t_start))
            else:
                job.start_node()
                log.append(f"{time.time() - t_start:.1f}s add a node")
            kill_next, next_fault = not kill_next, next_fault + args.fault_every
        time.sleep(max(0.0, end - time.time()) + 1.0)  # +1 s: steps before `end` are logged at an agreement
        steps = [s for s in job.steps() if s["time"] <= end]
        return {"steps": max(s["step"] for s in steps) - step_start, "seconds": args.goodput_seconds,
                "stalled_s": stalled_seconds(steps, step_start, t_start), "faults": log,
                "final_world": steps[-1]["world_size"]}
    except Failed as exc:
        return {"steps": None, "error": str(exc), "faults": log}
    finally:
        job.close()


def stalled_seconds(steps: list[dict], step_start: int, t_start: float) -> float:
    """Seconds of the window in which no new step was completed beyond the usual step interval.

    Each step counts at its first completion (a redone step adds nothing); a gap between two new
    steps longer than three median intervals is a stall, and what it lasts beyond one median
    interval is lost time. Unlike the ratio of steps, this does not move with the step rate."""
    first: dict[int, float] = {}
    for s in steps:
        if s["step"] > step_start:
            first.setdefault(s["step"], s["time"])
    times = [t_start, *sorted(first.values())]
    gaps = [b - a for a, b in zip(times, times[1:])]
    if not gaps:
        return 0.0
    usual = statistics.median(gaps)
    return sum(g - usual for g in gaps if g > 3 * usual)


def _kill_random_member(job: recovery.Job, rng: random.Random, t_start: float) -> str:
    """SIGKILL a random node of the newest world (not a newcomer still starting); not the last one."""
    steps = job.steps()
    newest = steps[-1]
    pids = {s["pid"] for s in steps if s["world_size"] == newest["world_size"] and s["time"] > newest["time"] - 2}
    members = [a for a in job.agents if a.poll() is None and pids & set(descendants(a.pid))]
    when = f"{time.time() - t_start:.1f}s"
    if len(members) < 2:
        return f"{when} kill skipped: {len(members)} node(s) in the world"
    victim = rng.choice(members)
    signal_tree(victim.pid, signal.SIGKILL)
    victim.wait()
    return f"{when} kill a node of {len(members)} (agent {victim.pid})"


# ---- report -------------------------------------------------------------------------------------
def _stats(values: list) -> tuple[str, str]:
    ok = [v for v in values if isinstance(v, (int, float))]
    med = f"{statistics.median(ok):.3f}" if ok else "-"
    worst = f"{max(ok):.3f}" if ok else "-"
    return med, worst


def moved_bytes(ok: list[dict]) -> int | None:
    """The median bytes of shards the re-forms of these trials moved (rank 0's ``live_reform`` event)."""
    moved = [v["reform"]["moved_bytes"] for v in ok if (v.get("reform") or {}).get("moved_bytes") is not None]
    return int(statistics.median(moved)) if moved else None


def summarize(results: dict[str, list[dict]], scenarios: list[str]) -> str:
    head = (f"{'system':<11} {'scenario':<11} {'ok':>5} {'median s':>9} {'worst s':>8} {'pause med':>9} "
            f"{'pause max':>9} {'redone':>7} {'+HWM MiB':>8} {'moved B':>9}  failures")
    lines = [head]
    for system, trials in results.items():
        for sc in scenarios:
            vals = [t.get(sc, "not run") for t in trials]
            ok = [v for v in vals if isinstance(v, dict)]
            med, worst = _stats([v["s"] for v in ok])
            pmed, pmax = _stats([v.get("pause") for v in ok]) if sc == "join" else ("", "")
            redone = [v["redone"] for v in ok if v.get("redone") is not None]
            red = f"{min(redone)}-{max(redone)}" if redone and min(redone) != max(redone) else (
                str(redone[0]) if redone else "-")
            hwm = [v["hwm_extra_mib"]["max"] for v in ok if v.get("hwm_extra_mib")]
            hw = f"{max(hwm):.1f}" if hwm else "-"
            moved = moved_bytes(ok)
            mv = "-" if moved is None else str(moved)
            bad = "; ".join(sorted({v for v in vals if isinstance(v, str)}))
            lines.append(f"{system:<11} {sc:<11} {len(ok):>2}/{len(vals):<2} {med:>9} {worst:>8} {pmed:>9} "
                         f"{pmax:>9} {red:>7} {hw:>8} {mv:>9}  {bad}")
    return "\n".join(lines)


def verdicts(results: dict[str, list[dict]], goodput: dict[str, dict]) -> list[str]:
    """The issue's targets for the live path, met or not."""
    out = []
    for system in LIVE_SYSTEMS:
        trials = results.get(system, [])
        for sc in ("kill-other", "kill-rank0"):
            vals = [t.get(sc) for t in trials if sc in t]
            ok = [v["s"] for v in vals if isinstance(v, dict)]
            if vals:
                met = len(ok) == len(vals) and statistics.median(ok) < 0.5 and max(ok) < 1.0
                med, worst = _stats(ok)
                out.append(f"{system} {sc}: median {med} s, worst {worst} s, {len(ok)}/{len(vals)} "
                           f"(target {TARGETS['kill']}): {'met' if met else 'NOT met'}")
        joins = [t["join"] for t in trials if isinstance(t.get("join"), dict)]
        pauses = [j["pause"] for j in joins if j.get("pause")]
        if any("join" in t for t in trials):
            med = statistics.median(pauses) if pauses else None
            moved = moved_bytes(joins)
            per_rank = [j["reform"]["moved_bytes"] // len(j["reform"]["receivers"]) for j in joins
                        if (j.get("reform") or {}).get("moved_bytes") and j["reform"].get("receivers")
                        and j["reform"].get("state_from") == "replica"]  # a reshard sends rows to every rank
            with_bytes = "" if moved is None else (
                f", {moved} bytes of shards moved per join (median" + (
                    f"; {statistics.median(per_rank):.0f} per newcomer rank), point to point from the donors"
                    if per_rank else "; a reshard: each rank sent its new rows), point to point"))
            out.append(f"{system} join: survivors' pause median {med if med is None else f'{med:.3f}'} s "
                       f"(target {TARGETS['join']}): {'met' if med is not None and med < 0.5 else 'NOT met'}"
                       + with_bytes)
    for system, g in goodput.items():
        ratio = g.get("ratio")
        out.append(f"{system} goodput: {ratio if ratio is None else f'{ratio:.3f}'} (target {TARGETS['goodput']}): "
                   f"{'met' if ratio is not None and ratio >= 0.9 else 'NOT met'}")
    return out


def _systems(text: str, p: argparse.ArgumentParser) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    for s in names:
        if s not in SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SYSTEMS)}")
    return names


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Live recovery vs restart vs c10d (see the module docstring).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="trials of the live path (the issue asks for 20)")
    p.add_argument("--baseline-trials", type=int, default=None,
                   help="trials of restart and c10d-tuned (default: --trials)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma list of {', '.join(SYSTEMS)}")
    p.add_argument("--nodes", type=int, default=3, help="nodes per job, one worker each")
    p.add_argument("--min-nodes", type=int, default=1, help="the jobs' minimum nodes (--nnodes MIN:nodes)")
    p.add_argument("--sleep-per-step", type=float, default=0.05,
                   help="seconds every step sleeps, so that the sleep, not 2 shared cores, sets the step rate")
    p.add_argument("--checkpoint-every", type=int, default=20, help="our trainer saves every N steps")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds before a measurement fails")
    p.add_argument("--goodput-seconds", type=float, default=300.0, help="length of each goodput run (0: none)")
    p.add_argument("--goodput-systems", default="live", help="systems whose goodput is measured (comma list)")
    p.add_argument("--fault-every", type=float, default=10.0,
                   help="seconds between faults in the goodput run (alternately kill a node, add one)")
    p.add_argument("--seed", type=int, default=0, help="seed of the goodput run's choice of nodes to kill")
    p.add_argument("--scenarios", default=None,
                   help=f"comma list of {', '.join(SCENARIOS)} (default: all; with --fsdp the loud ones)")
    p.add_argument("--cap", type=float, default=90.0,
                   help="silent faults: seconds to wait for a world without the node or worker; past it the "
                        "trial counts as '> cap'. Above what restart and c10d-tuned need with the collective "
                        "timeout below (a hung worker: that timeout, then torchrun's 30 s grace to stop it), "
                        "far below their defaults")
    p.add_argument("--away", type=float, default=float(silent.LEASE_TTL + 2),
                   help="silent faults: seconds a frozen or cut-off node stays away at least (past its lease)")
    p.add_argument("--baseline-collective-timeout", type=float, default=30.0,
                   help="restart and c10d-tuned: the collective timeout a user who knows about hangs sets "
                        "(--collective-timeout, init_process_group(timeout=)); the live path keeps its default")
    p.add_argument("--fsdp", action="store_true",
                   help="issue 31: nodes of 2 workers, the trainer with --fsdp (HSDP: sharded within a node, "
                        "replicated across nodes); systems live and restart, the loud scenarios")
    p.add_argument("--fsdp-shard-all", action="store_true",
                   help="with --fsdp: the trainer's --fsdp-shard-all (one shard per rank over all nodes: a lost node "
                        "is rebuilt from peer copies or a checkpoint, a join reshards every rank live)")
    p.add_argument("--fsdp-peer-copy-every", type=int, default=0, metavar="K",
                   help="with --fsdp: the trainer's --fsdp-peer-copy-every (each rank's shards in a peer node's "
                        "host memory every K steps; 0: none)")
    p.add_argument("--model-args", default="", metavar="FLAGS",
                   help="our trainer: flags after the example model's, which they override (the last wins), e.g. "
                        "'--d-model 256 --dim-feedforward 1024 --layers 4' for a state that takes a while to move")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file (with commit and date)")
    p.add_argument("--keep", action="store_true", help="keep every job's logs")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(p, args, run)


def _main(p: argparse.ArgumentParser, args: argparse.Namespace, run: provenance.Run) -> int:
    systems = _systems(args.systems, p)
    if args.scenarios is None:
        args.scenarios = ",".join(LOUD if args.fsdp else SCENARIOS)
    args.nproc = 2 if args.fsdp else 1
    if (args.fsdp_shard_all or args.fsdp_peer_copy_every) and not args.fsdp:
        p.error("--fsdp-shard-all and --fsdp-peer-copy-every need --fsdp")
    if args.fsdp and set(systems) - {"live", "restart"}:
        p.error("--fsdp measures our trainer alone: --systems live,restart")
    if args.fsdp and set(s.strip() for s in args.scenarios.split(",")) - set(LOUD):
        p.error(f"--fsdp: --scenarios of {', '.join(LOUD)} (the silent faults are measured without it)")
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    for sc in args.scenarios:
        if sc not in SCENARIOS:
            p.error(f"unknown scenario {sc!r}; choose from {', '.join(SCENARIOS)}")
    args.scenarios = [sc for sc in SCENARIOS if sc in args.scenarios]  # join follows kill-other
    goodput_systems = _systems(args.goodput_systems, p) if args.goodput_seconds > 0 else []
    if not 1 <= args.min_nodes < args.nodes:
        p.error(f"--min-nodes {args.min_nodes} must be at least 1 and below --nodes {args.nodes}")

    def on_sigterm(signum, frame):  # unwind through every `finally` that closes a job
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    print(provenance.byte_compile(), flush=True)
    root = Path(tempfile.mkdtemp(prefix="live-recovery-bench-"))
    def say(line: str = "") -> None:  # printed: provenance.record keeps it for --txt
        print(line, flush=True)

    counts = {s: args.trials if s in LIVE_SYSTEMS else (args.baseline_trials or args.trials) for s in systems}
    results: dict[str, list[dict]] = {s: [] for s in systems}
    goodput: dict[str, dict] = {}
    started = time.time()
    try:
        for i in range(max(counts.values(), default=0)):
            for s in systems:  # alternate the systems trial by trial, so load hits all alike
                if i < counts[s]:
                    r = trial(s, args, root / f"trial-{i}")
                    results[s].append(r)
                    say(f"trial {i + 1} {s}: " + ", ".join(
                        _trial_value(k, v) for k, v in r.items() if k in SCENARIOS))
        for s in goodput_systems:
            base = goodput_run(s, args, root / f"goodput-{s}-clean", faults=False)
            say(f"goodput {s} without faults: {base.get('steps')} steps in {args.goodput_seconds:.0f} s")
            hit = goodput_run(s, args, root / f"goodput-{s}-faults", faults=True)
            say(f"goodput {s} with a fault every {args.fault_every:.0f} s: {hit.get('steps')} steps "
                f"({len(hit['faults'])} faults)")
            ratio = hit["steps"] / base["steps"] if hit.get("steps") is not None and base.get("steps") else None
            busy = 1 - hit["stalled_s"] / args.goodput_seconds if hit.get("steps") is not None else None
            goodput[s] = {"clean": base, "faults": hit, "ratio": ratio, "time_ratio": busy}
    finally:
        if args.keep:
            print(f"logs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    loud = [sc for sc in args.scenarios if sc in LOUD]
    quiet = [sc for sc in args.scenarios if sc in silent.SCENARIOS]
    intervals = [t["step_interval"] for ts in results.values() for t in ts if t.get("step_interval")]
    step_s = statistics.median(intervals) if intervals else None
    say()
    if loud:
        say(summarize(results, loud))
        say("  ok: recovered/trials; median/worst s: kill -> first step at N-1, join: the newcomer's start -> its "
            "first step; pause: the survivors' last step at N-1 -> first at N; redone: steps done again (range); "
            "+HWM: the survivors' largest VmHWM growth over the re-form (live); moved B: --fsdp, bytes of shards "
            "the re-form sent over all ranks (median; rank 0's live_reform event)")
    if quiet:
        say(silent.summarize(results, quiet, args.cap))
        say(f"  silent faults: N-1 ok: trials with a world without the node or worker within --cap {args.cap:g} s; "
            f"to N-1: fault -> its first step ('> {args.cap:g}': none within the cap); to N: fault -> the first step "
            f"at N once the node is back (away >= {args.away:g} s) or the worker replaced; restart and c10d-tuned "
            f"with a collective timeout of {args.baseline_collective_timeout:g} s, live at its defaults (lease "
            f"{silent.LEASE_TTL} s, hang bound max({silent.HANG_MIN:g} s, {silent.HANG_FACTOR:g} x median step))")
    for s in systems:
        for sc in args.scenarios:
            phases = [t[sc]["reform"] for t in results[s] if isinstance(t.get(sc), dict) and t[sc].get("reform")]
            if phases:
                ahead = sum(bool(ph.get("ahead")) for ph in phases)
                say(f"  {s} {sc} re-form on rank 0, median s: " + ", ".join(
                    f"{k[:-2]} {statistics.median(ph[k] for ph in phases):.3f}"
                    for k in ("teardown_s", "agree_s", "group_s", "state_s", "total_s"))
                    + (f" (its group formed ahead, beside the old one, in {ahead} of {len(phases)})" if ahead else ""))
            starts = [t[sc]["phases"] for t in results[s] if isinstance(t.get(sc), dict) and t[sc].get("phases")]
            if starts:
                say(f"  {s} {sc}: the newcomer's start -> its first step, median s: " + ", ".join(
                    f"{k.replace('_', ' ')} {statistics.median(ph[k] for ph in starts):.3f}" for k in NEWCOMER_PHASES)
                    + " (launcher: to its worker's start; worker: to asking to be admitted, fork and build "
                    "its parts, its warm-up included; benchmarks/live_recovery.py newcomer_phases)")
            floors = [t[sc]["import_floor"] for t in results[s] if isinstance(t.get(sc), dict)
                      and t[sc].get("import_floor")]
            if floors:
                say(f"  {s} {sc}: a fresh interpreter's `{IMPORT_FLOOR}` beside the members just before the join "
                    f"(torch's part of any newcomer's start), median {statistics.median(floors):.3f} s, worst "
                    f"{max(floors):.3f} s")
            longest = [t[sc]["longest"] for t in results[s] if isinstance(t.get(sc), dict) and t[sc].get("longest")]
            if longest:
                say(f"  {s} {sc}: the survivors' longest step interval from the newcomer's start to a second after its "
                    f"first step, median {statistics.median(longest):.3f} s, worst {max(longest):.3f} s")
    if step_s is not None:
        say(f"  steps padded with --sleep-per-step {args.sleep_per_step}: median step interval "
            f"{step_s:.3f} s at {args.nodes} nodes, so about "
            f"{max(0.0, step_s - args.sleep_per_step):.3f} s of compute and waiting per step")
    for s, g in goodput.items():
        ratio = "-" if g["ratio"] is None else f"{g['ratio']:.3f}"
        busy = "-" if g["time_ratio"] is None else f"{g['time_ratio']:.3f}"
        say(f"goodput {s}: {g['faults'].get('steps')} / {g['clean'].get('steps')} steps = {ratio} "
            f"({args.goodput_seconds:.0f} s each, a fault every {args.fault_every:.0f} s); time not stalled "
            f"in the run with faults: {busy} ({g['faults'].get('stalled_s', float('nan')):.1f} s stalled, "
            f"{g['clean'].get('stalled_s', float('nan')):.1f} s without faults). On 2 shared cores the step "
            "ratio also moves with the load and with smaller worlds stepping faster")
    targets = verdicts(results, goodput)
    targets27 = silent.verdicts(results, LIVE_SYSTEMS, step_s, args.cap) if quiet else []
    if targets:
        say()
        say("targets (issue 17):")
        for line in targets:
            say("  " + line)
    if targets27:
        say()
        say("targets (issue 27):")
        for line in targets27:
            say("  " + line)
    say(f"\n{args.nodes} nodes x {args.nproc} worker(s){_layout(args)} on loopback (cut-node: in network namespaces), --nnodes "
        f"{args.min_nodes}:{args.nodes}, {os.cpu_count()} CPUs, load average {run.load_start[0]:.1f} at the start, "
        f"{os.getloadavg()[0]:.1f} at the end, {time.time() - started:.0f} s in all")
    say("command: " + run.command)
    provenance.write_json(args.json, {"args": vars(args), "targets": TARGETS, "results": results, "goodput": goodput,
                                      "verdicts": targets, "verdicts_issue_27": targets27}, run, indent=1)
    return 0


def _layout(args: argparse.Namespace) -> str:
    if not args.fsdp:
        return ""
    copies = f", peer copies every {args.fsdp_peer_copy_every} steps" if args.fsdp_peer_copy_every else ""
    return f" (--fsdp: {'sharded over all ranks' if args.fsdp_shard_all else 'HSDP'}{copies})"


def _trial_value(scenario: str, v) -> str:
    """One scenario of a trial, for its progress line."""
    if not isinstance(v, dict):
        return f"{scenario}={v}"
    if scenario in silent.SCENARIOS:
        to_away = f"> {v['cap']:g}s (cap)" if v.get("s") is None else f"{v['s']:.3f}s"
        back = "" if v.get("back") is None else f" (N again {v['back']:.3f}s)"
        return f"{scenario}={to_away}{back}" + (f" redone {v['redone']}" if v.get("redone") is not None else "")
    return (f"{scenario}={v['s']:.3f}s" + (f" (pause {v['pause']:.3f}s)" if v.get("pause") is not None else "")
            + (f" redone {v['redone']}" if v.get("redone") is not None else "")
            + (f" moved {v['reform']['moved_bytes']} B" if (v.get("reform") or {}).get("moved_bytes") else ""))


if __name__ == "__main__":
    sys.exit(main())
