"""A join side by side (issue 46, point 4): TorchFT 0.2.0's survivors against ours on the live path.

Run (from the repository root; about 40 s per trial; the first run installs torchft, see below):

    .venv/bin/python benchmarks/torchft_join.py --trials 3 --txt benchmarks/results/torchft_join.txt

Per trial, each system in a job of its own on loopback, steps padded to 0.05 s, gloo:

  torchft  three replica groups of one process each (``benchmarks/torchft_worker.py``: TorchFT's own
           DDP example, ``Manager`` + its ``DistributedDataParallel`` and ``Optimizer`` wrappers, on a
           small MLP), one ``torchft_lighthouse`` run as TorchFT's slurm example runs it
           (``--min_replicas 1 --quorum_tick_ms 100 --join_timeout_ms 10000``); two groups step, then
           the third starts as a bare process;
  live     ours: ``elastic-train --recovery live``, the built-in trainer (``live_recovery.py``'s
           ``TrainerJob`` and its ``join`` scenario): two nodes step, then a third node starts.

Measured, from the step logs: the survivors' pause (their last step at 2 to the first at 3, as
``live_recovery.py`` counts it), a survivor's step interval at 2 before the join (a pause of one
step's length is no pause) and the newcomer's start to the first step at 3. TorchFT's newcomer
is a bare Python process, ours a whole node (launcher, torchrun's agent, worker): that column is
not like for like, and says so.

TorchFT is not a dependency of this project: the first run installs the registry's ``torchft==0.2.0``
wheel with ``--no-deps`` into ``~/.cache/elastic-trainer/torchft-0.2.0/`` (``$XDG_CACHE_HOME`` if
set; outside the repository; torch is this venv's; its OpenTelemetry extras are not needed for this) and puts it on the workers' ``PYTHONPATH`` only.
Every process it starts runs in a session of its own and is killed with its children, also on error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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

import recovery  # noqa: E402  (benchmarks/recovery.py: the job and its waits)
from live_recovery import TrainerJob, longest_gap, measure_join, pause_around  # noqa: E402

from benchmarks import provenance  # noqa: E402
from benchmarks.rdzv_worker import signal_tree  # noqa: E402
from elastic_trainer.etcd.server import free_port  # noqa: E402

SITE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "elastic-trainer" / "torchft-0.2.0"
"""Where torchft is installed for this benchmark: outside the repository (its files are not ours)."""
TORCHFT = "torchft==0.2.0"
SLEEP = 0.05
LIGHTHOUSE_ARGS = ["--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000"]


def ensure_torchft() -> Path:
    """``SITE`` with torchft in it (installed once, by pip as this machine configures it)."""
    if not (SITE / "torchft" / "__init__.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(SITE), TORCHFT],
                       check=True)
    return SITE


class TorchftJob(recovery.Job):
    """A lighthouse and replica groups of one process (the job's "nodes"), each in its own session."""

    def __init__(self, workdir: Path) -> None:
        super().__init__("c10d", 3, workdir)  # no etcd: the lighthouse is TorchFT's only coordinator
        port = free_port()
        self.env = {"PYTHONPATH": f"{SITE}{os.pathsep}{REPO}", "OMP_NUM_THREADS": "1",
                    "TORCHFT_LIGHTHOUSE": f"http://127.0.0.1:{port}"}
        with open(workdir / "lighthouse.log", "w") as log:
            self.lighthouse = subprocess.Popen(
                [sys.executable, str(SITE / "bin" / "torchft_lighthouse"), *LIGHTHOUSE_ARGS, "--bind",
                 f"127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env})

    def node_cmd(self) -> list[str]:
        return [sys.executable, str(REPO / "benchmarks" / "torchft_worker.py"), "--replica", str(len(self.agents)),
                "--out", str(self.dir), "--sleep-per-step", str(SLEEP)]

    def steps(self) -> list[dict]:
        out = []
        for f in (self.dir / "steps").glob("torchft-*.jsonl"):
            for line in f.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass  # a line being written
        return sorted(out, key=lambda s: s["time"])

    def close(self) -> None:
        try:
            super().close()
        finally:
            signal_tree(self.lighthouse.pid, signal.SIGKILL)
            self.lighthouse.wait()


def step_interval(steps: list[dict], rank) -> float | None:
    """The median seconds between two of ``rank``'s steps at a world of 2 (the join's pause ends at a
    step at 3, so it is not among them): a pause of that much is no pause at all."""
    times = [s["time"] for s in steps if s["rank"] == rank and s["world_size"] == 2]
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else None


def torchft_join(root: Path, timeout: float) -> dict:
    job = TorchftJob(root)
    try:
        job.start_node()
        job.start_node()
        since = time.time()
        job.wait("two groups stepping together", lambda st: len({s["rank"] for s in st if s["time"] > since
                                                                  and s["world_size"] == 2}) == 2, timeout)
        time.sleep(1.0)
        t0 = time.time()
        job.start_node()
        first = job.wait("a step at 3", lambda st: [s for s in st if s["time"] > t0 and s["world_size"] == 3],
                         timeout)[0]
        time.sleep(1.0)
        steps = [s for s in job.steps() if s["rank"] in ("0", "1")]  # the survivors'
        return {"pause": pause_around(steps, t0, 2, 3), "s": first["time"] - t0,
                "interval": step_interval(steps, "0"), "longest": longest_gap(steps, t0, first["time"] + 1.0, ("0", "1"))}
    finally:
        job.close()


def live_join(root: Path, timeout: float) -> dict:
    settings = argparse.Namespace(min_nodes=1, nproc=1, fsdp=False, fsdp_shard_all=False, fsdp_peer_copy_every=0,
                                  sleep_per_step=SLEEP, checkpoint_every=1000, baseline_collective_timeout=30,
                                  model_args="")
    job = TrainerJob("live", 3, root, settings)
    try:
        job.start_node()
        job.start_node()
        out = measure_join(job, 3, timeout, live=True)
        return {"pause": out["pause"], "s": out["s"], "interval": step_interval(job.steps(), 0),
                "longest": out["longest"]}
    finally:
        job.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--timeout", type=float, default=120.0)
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    ensure_torchft()

    def on_sigterm(signum, frame):  # unwind through every `finally` that closes a job
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    with provenance.record(args.txt):
        print(provenance.byte_compile(), flush=True)  # ours as an install leaves them (pip compiled torchft)
        root = Path(tempfile.mkdtemp(prefix="torchft-join-"))
        rows: dict[str, list[dict]] = {"torchft": [], "live": []}
        try:
            for trial in range(args.trials):
                for system, measure in (("torchft", torchft_join), ("live", live_join)):
                    row = measure(root / f"{system}-{trial}", args.timeout)
                    rows[system].append(row)
                    print(f"trial {trial} {system:8s} survivors' pause {row['pause']:.3f} s (a step: "
                          f"{row['interval']:.3f} s; their longest step interval around the join "
                          f"{row['longest']:.3f} s), newcomer's start -> first step at 3 {row['s']:.3f} s", flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print()
        for system, mine in rows.items():
            pauses = [r["pause"] for r in mine if r["pause"] is not None]
            starts = [r["s"] for r in mine]
            extra = [r["pause"] - r["interval"] for r in mine if r["pause"] is not None and r["interval"]]
            longest = [r["longest"] - r["interval"] for r in mine if r["longest"] is not None and r["interval"]]
            print(f"{system:8s} join: survivors' pause median {statistics.median(pauses):.3f} s, worst "
                  f"{max(pauses):.3f} s (beyond a step's length: median {statistics.median(extra):.3f} s; their longest "
                  f"step interval from the newcomer's start to a second after its first step, beyond a step: median "
                  f"{statistics.median(longest):.3f} s, worst {max(longest):.3f} s); newcomer's start -> first step median {statistics.median(starts):.3f} s "
                  f"({len(mine)} trial(s); torchft's newcomer is a bare process, ours a whole node)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
