"""The steady-state cost of peer copies (issue 31 point 5): step time with and without
``--fsdp-peer-copy-every``, and what one copy costs the training thread and the sender thread.

Run (from the repository root; about 1 min per run):

    .venv/bin/python benchmarks/peer_copy_cost.py --repeats 2 --every 5 \\
        --txt benchmarks/results/live_recovery_fsdp_copy_cost.txt --json benchmarks/results/live_recovery_fsdp_copy_cost.json

Each run is one job of ``--nodes`` ``elastic-train --recovery live`` nodes of 2 workers on one etcd, the
trainer with ``--fsdp --fsdp-shard-all`` on a model of about ``--d-model``/``--layers`` (the same
``seeds`` example the other benchmarks use, larger), ``--steps`` steps with no sleep, no checkpoints;
runs with copies off and every ``--every`` steps alternate, ``--repeats`` times each. Per run: the
median step interval at full world size (each rank's step ends, after ``--skip`` warm-up steps),
and from the workers' last log line (``peer copies: ...``) the bytes of one rank's copy, the
training thread's time per copy (the host copy of its shards; all it waits for) and the sender
thread's (serialize, send over loopback to the peer, kept there). On 2 shared cores the sender
competes with training for CPU; on a GPU host it competes for a host core and PCIe.

Every process it starts is an agent in its own session, killed through its recorded PID; etcd is stopped.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import live_recovery  # noqa: E402  (benchmarks/live_recovery.py: our trainer's job)
from overhead import summary  # noqa: E402  (benchmarks/overhead.py: median, min, max, IQR of alternated repeats)

from benchmarks import provenance  # noqa: E402

SUMMARY = re.compile(r"peer copies: (\d+) sent of (\d+) taken, (\d+) bytes each, training thread ([0-9.]+)s per "
                     r"copy, sender ([0-9.]+)s per copy")


class CopyJob(live_recovery.TrainerJob):
    """Our trainer, sharded over all ranks, a larger model, ``steps`` steps, copies every ``every`` (0: none)."""

    def __init__(self, every: int, workdir: Path, args: argparse.Namespace) -> None:
        settings = argparse.Namespace(min_nodes=args.nodes, nproc=2, fsdp=True, fsdp_shard_all=True,
                                      fsdp_peer_copy_every=every, sleep_per_step=0.0, checkpoint_every=10**9,
                                      baseline_collective_timeout=30.0)
        super().__init__("live", args.nodes, workdir, settings)
        self.args, self.every = args, every

    def node_cmd(self) -> list[str]:
        a = self.args
        cmd = super().node_cmd()
        values = {"--d-model": a.d_model, "--nhead": 4, "--layers": a.layers, "--dim-feedforward": 4 * a.d_model,
                  "--max-steps": a.steps}
        for i, flag in enumerate(cmd[:-1]):  # the larger model and the step count replace the tiny one's
            if flag in values:
                cmd[i + 1] = str(values[flag])
        return cmd


def one_run(every: int, workdir: Path, args: argparse.Namespace) -> dict:
    job = CopyJob(every, workdir, args)
    try:
        for _ in range(args.nodes):
            job.start_node()
        for agent in job.agents:
            agent.wait(timeout=args.timeout)
        world = 2 * args.nodes
        ends: dict[int, list[float]] = {}
        for s in job.steps():
            if s["world_size"] == world and s["step"] > args.skip and "loss_scope" not in s:
                ends.setdefault(s["rank"], []).append(s["time"])
        gaps = [b - a for times in ends.values() for a, b in zip(sorted(times), sorted(times)[1:])]
        out: dict = {"every": every, "step_s": statistics.median(gaps) if gaps else None, "steps": args.steps}
        found = [m.groups() for log in workdir.glob("agent-*.log") for m in SUMMARY.finditer(log.read_text())]
        if found:
            out.update(sent=sum(int(f[0]) for f in found), taken=sum(int(f[1]) for f in found),
                       bytes=statistics.median(int(f[2]) for f in found),
                       copy_s=statistics.median(float(f[3]) for f in found),
                       send_s=statistics.median(float(f[4]) for f in found))
        return out
    finally:
        job.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Peer copies' steady-state cost (see the module docstring).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="nodes of 2 workers each")
    p.add_argument("--every", type=int, default=5, help="--fsdp-peer-copy-every of the runs with copies")
    p.add_argument("--repeats", type=int, default=2, help="runs of each kind, alternated")
    p.add_argument("--steps", type=int, default=80, help="steps per run")
    p.add_argument("--skip", type=int, default=10, help="warm-up steps left out of the step interval")
    p.add_argument("--d-model", type=int, default=256, help="the model's width")
    p.add_argument("--layers", type=int, default=2, help="the model's encoder and decoder layers")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds a run may take")
    p.add_argument("--json", default=None, help="also write every measurement to this JSON file")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    started = time.time()
    with provenance.record(args.txt) as run:
        runs: list[dict] = []
        with tempfile.TemporaryDirectory(prefix="peer-copy-cost-") as tmp:
            for r in range(args.repeats):
                for every in (0, args.every):
                    got = one_run(every, Path(tmp) / f"run-{r}-{every}", args)
                    runs.append(got)
                    print(f"repeat {r + 1}, copies {'every ' + str(every) if every else 'off'}: step "
                          f"{got['step_s'] if got['step_s'] is None else round(got['step_s'], 4)} s"
                          + (f", one rank's copy {got['bytes']:.0f} bytes, training thread {got['copy_s']:.4f} s, "
                             f"sender {got['send_s']:.4f} s per copy ({got['sent']}/{got['taken']} sent)"
                             if "bytes" in got else ""), flush=True)
        off = [g["step_s"] for g in runs if not g["every"] and g["step_s"]]
        on = [g["step_s"] for g in runs if g["every"] and g["step_s"]]
        sides = {}
        if off and on:  # the alternated repeats' summary, as overhead.py gives it
            sides = {"off": summary(off), "on": summary(on),
                     "paired_ratio": summary([b["step_s"] / a["step_s"] for a, b in zip(runs[::2], runs[1::2])
                                              if a["step_s"] and b["step_s"]])}
            ratio = sides["on"]["median"] / sides["off"]["median"]
            print(f"\nmedian step: {sides['off']['median']:.4f} s without copies, {sides['on']['median']:.4f} s with "
                  f"a copy every {args.every} steps: {ratio:.3f}x")
            for name in ("off", "on"):
                st = sides[name]
                print(f"  copies {name:3s}: min {st['min']:.4f} s, max {st['max']:.4f} s, IQR {st['q1']:.4f}.."
                      f"{st['q3']:.4f} s over {st['n']} runs")
            paired = sides["paired_ratio"]
            print(f"  paired ratios (each repeat's run with copies / without): median {paired['median']:.3f}, "
                  f"min {paired['min']:.3f}, max {paired['max']:.3f}")
        print(f"{args.nodes} nodes x 2 workers, --fsdp --fsdp-shard-all, d-model {args.d_model}, {args.layers} layers, "
              f"{args.steps} steps per run (first {args.skip} left out), load average {run.load_start[0]:.1f} at "
              f"the start, {os.getloadavg()[0]:.1f} at the end, {time.time() - started:.0f} s in all")
        print("command: " + run.command)
        provenance.write_json(args.json, {"args": vars(args), "runs": runs, "summary": sides}, run, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
