"""Stragglers (issue 44): a node 5x slower than the others, evicted live or just run slow.

Run (from the repository root; about 80 s per case and trial):

    .venv/bin/python benchmarks/stragglers.py --trials 1 --txt benchmarks/results/stragglers.txt

Three nodes of one worker each on loopback (the built-in trainer, ``live_recovery.py``'s small model,
global batch 12), one etcd per job. Each case is a fresh job; the window starts at the first step at
a world of 3 and lasts ``--seconds`` (60):

  clean         every node ``--sleep-per-step 0.05``, live (the reference);
  slow-evict    node 2 at 0.25 s a step (5x), live, the straggler defaults (``evict``, sustain 10 s);
  slow-report   the same node, ``--straggler-policy report``: named, never left out, as a job runs
                under torchrun or TorchFT, which do not evict (it just runs slow);
  slow-restart  the same node, ``--recovery restart`` (the restart path has no eviction either);
  slow-torchrun the same node under plain ``torchrun`` on c10d running ``benchmarks/plain_ddp.py``
                (the same model and global batch, as ``live_recovery.py``'s ``c10d-tuned``): no
                eviction, it just runs slow;
  ten-percent   node 2 at 0.055 s (10% slower), live, ``evict``: it must be kept.

Per case: samples per second over the window (steps reached x the global batch: the global batch is
constant, so at N-1 nodes each rank does N/(N-1) of the work; samples, not a rank's speed, count),
its ratio to ``clean`` of the same trial, the seconds from the window's start to the eviction (the
``live_reform`` event whose cause names a straggler), and the evictions seen. The issue's targets:
slow-evict >= 0.6 of clean, out within 20 s; ten-percent kept.

Every process it starts is an agent in its own session, killed with its workers; every etcd is
stopped, also on error or Ctrl-C.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import recovery  # noqa: E402  (benchmarks/recovery.py: the job and its waits)
from live_recovery import EXAMPLE, RDZV_CONF, TRAINER, read_steps  # noqa: E402
from rdzv_worker import agent_cmd  # noqa: E402

from benchmarks import provenance  # noqa: E402
from elastic_trainer import records  # noqa: E402

GBS = 12
CASES = {  # name: (recovery, straggler policy, slow node's sleep per step)
    "clean": ("live", "evict", 0.05),
    "slow-evict": ("live", "evict", 0.25),
    "slow-report": ("live", "report", 0.25),
    "slow-restart": ("restart", "evict", 0.25),
    "slow-torchrun": ("torchrun", None, 0.25),
    "ten-percent": ("live", "evict", 0.055),
}
NODES, SLOW_NODE, SLEEP = 3, 2, 0.05


class StragglerJob(recovery.Job):
    """Three ``elastic-train`` nodes; node ``SLOW_NODE`` sleeps ``slow_sleep`` a step, the others ``SLEEP``."""

    def __init__(self, case: str, workdir: Path) -> None:
        recovery_kind, self.policy, self.slow_sleep = CASES[case]
        super().__init__("c10d-tuned" if recovery_kind == "torchrun" else "etcd-v3", NODES, workdir)
        self.recovery = recovery_kind
        self.env = {**self.env, "OMP_NUM_THREADS": "1"}

    def node_cmd(self) -> list[str]:
        i = len(self.agents)  # the node being started
        sleep = str(self.slow_sleep if i == SLOW_NODE else SLEEP)
        if self.recovery == "torchrun":
            cmd = agent_cmd(self.endpoint, "bench", self.out, nnodes=f"2:{NODES}", backend=self.rdzv_backend,
                            conf=self.conf)
            cmd = cmd[:cmd.index("--out") - 1]  # torchrun's flags, without benchmarks/rdzv_worker.py
            return [*cmd, str(REPO / "benchmarks" / "plain_ddp.py"), *EXAMPLE, "--max-steps", "1000000",
                    "--log-dir", str(self.dir), "--live-step-log", "--sleep-per-step", sleep,
                    "--collective-timeout", "30"]
        return [sys.executable, "-m", "elastic_trainer.cli", "--nnodes", f"2:{NODES}", "--rdzv-endpoint",
                self.endpoint, "--run-id", "bench", "--rdzv-conf", RDZV_CONF, "--recovery", self.recovery,
                "--local-addr", "127.0.0.1", "--metrics-port", "0", "--straggler-policy", self.policy,
                "--checkpoint-dir", str(self.dir / "ckpt"), "--log-dir", str(self.dir), "--", *EXAMPLE, *TRAINER,
                "--sleep-per-step", sleep, "--checkpoint-every", "1000",
                "--collective-timeout", "30"]

    def steps(self) -> list[dict]:
        return read_steps(self.dir)


def measure(case: str, seconds: float, root: Path) -> dict:
    job = StragglerJob(case, root / case)
    try:
        for _ in range(NODES):
            job.start_node()
        first = job.wait("a step at a world of 3", lambda steps: [s for s in steps if s.get("world_size") == NODES],
                         timeout=180)[0]
        t0, step0 = first["time"], first["step"]
        time.sleep(max(0.0, t0 + seconds - time.time()))
        reached = max((s["step"] for s in job.steps() if s["time"] <= t0 + seconds), default=step0)
        events = records.read_events(job.dir) if job.recovery != "torchrun" else []
        evictions = [e for e in (ev.to_json() for ev in events)
                     if e.get("event") == "live_reform" and "straggler" in str(e.get("cause", ""))
                     and e["time"] >= t0]
        return {"case": case, "samples_per_s": (reached - step0) * GBS / seconds, "steps": reached - step0,
                "evicted_after_s": evictions[0]["time"] - t0 if evictions else None, "evictions": len(evictions)}
    finally:
        job.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=1)
    p.add_argument("--seconds", type=float, default=60.0, help="the window from the first step at a world of 3")
    p.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        p.error(f"unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")

    def on_sigterm(signum, frame):  # unwind through every `finally` that closes a job
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_sigterm)
    with provenance.record(args.txt):
        root = Path(tempfile.mkdtemp(prefix="stragglers-bench-"))
        rows: list[dict] = []
        try:
            for trial in range(args.trials):
                clean = None
                for case in cases:
                    row = {"trial": trial, **measure(case, args.seconds, root)}
                    clean = row["samples_per_s"] if case == "clean" else clean
                    row["vs_clean"] = row["samples_per_s"] / clean if clean else None
                    rows.append(row)
                    after = row["evicted_after_s"]
                    print(f"trial {trial} {case:13s} {row['samples_per_s']:6.1f} samples/s"
                          + (f"  {row['vs_clean']:.2f} of clean" if row["vs_clean"] is not None else "")
                          + f"  evictions {row['evictions']}" + (f", first after {after:.1f} s" if after is not None
                                                                  else ""), flush=True)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        print()
        for case in cases:
            mine = [r for r in rows if r["case"] == case]
            ratios = [r["vs_clean"] for r in mine if r["vs_clean"] is not None]
            outs = [r["evicted_after_s"] for r in mine if r["evicted_after_s"] is not None]
            print(f"{case:13s} samples/s median {statistics.median(r['samples_per_s'] for r in mine):6.1f}"
                  + (f", vs clean median {statistics.median(ratios):.2f} worst {min(ratios):.2f}" if ratios else "")
                  + (f", evicted after median {statistics.median(outs):.1f} s worst {max(outs):.1f} s" if outs else
                     ", never evicted")
                  + f" ({len(mine)} trial(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
