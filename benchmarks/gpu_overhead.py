"""GPU overhead: samples/s of ``elastic-train`` against plain ``torchrun`` + DDP, one GPU, a GPT-class model.

    python benchmarks/gpu_overhead.py --out benchmarks/results/gpu_overhead.json          # 2 pairs, ~2.5 min on an H100
    python benchmarks/gpu_overhead.py --quick                                            # smoke test (CPU too)

Both sides train ``benchmarks/gpt_task.py`` (166M parameters: d 1024, 8 blocks, sequence 512;
batch 16, bf16 autocast, AdamW; about 30 ms a step on an H100) on one GPU, one worker:

- A, elastic: ``elastic-train --nproc-per-node 1 -- --task benchmarks/gpt_task.py:build --device cuda
  --amp bf16 --checkpoint-every 100``: embedded etcd, the etcd-v3 rendezvous, live recovery (the
  default), our trainer with its step log, and an asynchronous checkpoint of the 2.0 GB state
  every 100 steps (its host memory made after the first step, ``checkpoint/host_memory.py``).
- B, plain: ``torchrun --standalone --nproc-per-node 1 benchmarks/gpu_overhead.py plain-worker``:
  DistributedSampler, DDP over NCCL, the same model, data, AdamW and autocast, TF32 on as the
  trainer sets it, no checkpoints, no logging in the loop.
- ``--fsdp`` adds C, ``elastic-train --recovery restart -- --fsdp`` (sharded saves), once, after
  the pairs, for its blocked milliseconds per save.

The sides alternate, A B A B, so that whatever else the machine does falls on both alike.
Samples/s of a run: global batch x steps / seconds over the steps after ``--warmup-steps`` (50)
up to the last (300), read from rank 0's per-step timestamps (the trainer's step log; the plain
worker writes the same format at exit, synchronizing the GPU at the window's two ends). The
window holds the saves at steps 100 and 200; the final blocking save is outside it. Each save's
blocked milliseconds come from the trainer's ``checkpoint_saved`` events (the first one included).

Writes JSON (``--out``) that starts with "commit", "date", "machine" and "command" (``provenance.py``), then the GPU, torch, CUDA and NCCL
builds, every run, the paired ratios and the blocked milliseconds of each save; prints a table
and the commands. Target (issue 28): elastic/plain >= 0.99 including saves; every save < 50 ms.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import gpt_task  # noqa: E402  (benchmarks/gpt_task.py: the model, data and optimizer of both sides)
import overhead  # noqa: E402  (benchmarks/overhead.py: running a side, step logs, samples/s, events)
import provenance  # noqa: E402  (benchmarks/provenance.py: the results' header: date, commit, machine, command)

from elastic_trainer import records  # noqa: E402

GPT_TASK = f"{REPO / 'benchmarks' / 'gpt_task.py'}:build"
QUICK_GPT = ["--gpt-width", "64", "--gpt-blocks", "2", "--gpt-heads", "4", "--gpt-seq", "32", "--gpt-vocab", "256",
             "--gpt-samples", "512"]


# ------------------------------------------------------------------------------- the plain side

def plain_worker(argv: list[str]) -> int:
    """The baseline's worker (under torchrun): what a user writes without elastic-trainer."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    p = gpt_task.add_arguments(argparse.ArgumentParser(prog="gpu_overhead.py plain-worker"))
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=300)
    p.add_argument("--warmup-steps", type=int, default=50)
    p.add_argument("--device", default="cuda")
    p.add_argument("--amp", default="bf16", choices=("bf16", "off"))
    p.add_argument("--log-dir", required=True)
    args = p.parse_args(argv)
    rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    cuda = args.device == "cuda"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")  # TF32, as the trainer's default on CUDA
        torch.backends.cudnn.allow_tf32 = True
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    torch.manual_seed(0)
    model = gpt_task.make_model(args).to(device)
    ddp = DDP(model, device_ids=[local] if cuda else None)
    data = gpt_task.make_dataset(args)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.global_batch_size // world, sampler=sampler, drop_last=True,
                        pin_memory=cuda)
    optimizer = gpt_task.make_optimizer(ddp.parameters(), args)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.amp == "bf16")
    times: list[float] = []
    step, epoch = 0, 0
    while step < args.max_steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            with autocast:
                loss = gpt_task.loss(ddp, (x.to(device, non_blocking=True), y.to(device, non_blocking=True)))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if cuda and step in (args.warmup_steps, args.max_steps):  # the window's ends: the GPU's time
                torch.cuda.synchronize(device)
            times.append(time.time())
            if step >= args.max_steps:
                break
        epoch += 1
    log = records.JsonLines(records.steps_path(args.log_dir, rank, os.getpid()))
    for i, t in enumerate(times, start=1):
        log.write(records.StepRecord(time=t, step=i, world_size=world, rank=rank, loss=float(loss) if i == step else None))
    log.close()
    dist.destroy_process_group()
    return 0


# ------------------------------------------------------------------------------- the benchmark

def _gpt_flags(args) -> list[str]:
    return QUICK_GPT if args.quick else []


def side_command(kind: str, args, run_dir: Path) -> list[str]:
    steps = ["--max-steps", str(args.max_steps), "--global-batch-size", str(args.global_batch_size)]
    amp = ["--amp", "bf16"] if args.device == "cuda" else []
    if kind == "plain":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                str(Path(__file__).resolve()), "plain-worker", *steps, "--warmup-steps", str(args.warmup_steps),
                "--device", args.device, "--amp", "bf16" if amp else "off", "--log-dir", str(run_dir), *_gpt_flags(args)]
    trainer = ["--task", GPT_TASK, "--device", args.device, *amp, *steps, "--checkpoint-every",
               str(args.checkpoint_every), "--no-wandb", "--no-progress", *_gpt_flags(args)]
    launcher = [sys.executable, "-m", "elastic_trainer.cli", "--nproc-per-node", "1",
                "--run-id", f"gpuovh-{uuid.uuid4().hex[:8]}", "--log-dir", str(run_dir),
                "--checkpoint-dir", str(run_dir / "ckpt")]
    if kind == "elastic":
        return [*launcher, "--", *trainer]
    if kind == "elastic-fsdp":
        return [*launcher, "--recovery", "restart", "--", *trainer, "--fsdp"]
    raise ValueError(f"unknown side {kind!r}")


def committed_lines(log: Path) -> list[str]:
    return [ln.split("] ", 1)[-1] for ln in log.read_text(errors="replace").splitlines() if " committed (" in ln]


def measure(kind: str, args, run_dir: Path, env: dict) -> dict:
    run_dir.mkdir(parents=True)
    cmd = side_command(kind, args, run_dir)
    log = run_dir / "output.log"
    wall, _ = overhead.run_command(cmd, env=env, cwd=run_dir, log=log, timeout=args.timeout)
    try:
        times = overhead.read_step_times(run_dir)
        result = overhead.throughput(times, args.warmup_steps, args.global_batch_size)
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}; command: {shlex.join(cmd)}; its output ends with:\n"
                           f"{log.read_text(errors='replace')[-4000:]}") from exc
    window = result.pop("window")
    steps = sorted(times)
    intervals = [times[s] - times[s - 1] for s in steps[1:] if s - 1 in times and s > args.warmup_steps]
    result.update(kind=kind, wall_s=wall, command=shlex.join(cmd), max_step_ms=max(intervals) * 1e3)
    if kind != "plain":
        saves = [e for e in records.read_events(run_dir) if e.event == records.Event.CHECKPOINT_SAVED]
        result["saves"] = [{"step": e.step, "blocked_ms": round((e.blocked_s or 0.0) * 1e3, 1), "blocking": e.blocking,
                            "in_window": window[0] <= e.time <= window[1]} for e in saves]
        result["periodic_blocked_ms"] = [s["blocked_ms"] for s in result["saves"] if not s["blocking"]]
        result["committed_lines"] = committed_lines(log)
    shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # 2 GB a save: keep the disk free
    return result


def builds() -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(0)
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    return out


def write_json(path: str, result: dict, run: provenance.Run, say: bool = False) -> None:
    """``result`` as JSON, after the header keys (``provenance``: commit, date, machine, command)."""
    provenance.write_json(path, result, run)
    if say:
        print(f"wrote {path}")


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=2, help="alternated pairs (default 2)")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps per run (default 300)")
    p.add_argument("--warmup-steps", type=int, default=50, help="steps left out of samples/s (default 50)")
    p.add_argument("--checkpoint-every", type=int, default=100, help="elastic side: save every N steps (default 100)")
    p.add_argument("--global-batch-size", type=int, default=16, help="both sides (default 16)")
    p.add_argument("--fsdp", action="store_true", help="also run elastic-train --fsdp once, after the pairs (sharded saves)")
    p.add_argument("--device", default=None, help="cuda (default where torch sees a GPU) or cpu (smoke tests)")
    p.add_argument("--timeout", type=float, default=240, help="seconds one run may take (default 240)")
    p.add_argument("--workdir", default=None, help="keep run logs here (default: a temp dir, removed)")
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 pair, 12 steps, save every 5, a tiny GPT")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.quick:
        args.repeats, args.max_steps, args.warmup_steps, args.checkpoint_every = 1, 12, 2, 5
    if args.repeats < 1 or args.max_steps <= args.warmup_steps + 1:
        p.error("need --repeats >= 1 and --max-steps > --warmup-steps + 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["plain-worker"]:
        return plain_worker(argv[1:])
    args = parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(args, run)


def _main(args, run: provenance.Run) -> int:
    started = time.monotonic()
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="disabled")
    for name in [k for k in env if k.startswith("ELASTIC_TRAINER_")]:
        del env[name]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    workdir = Path(args.workdir).resolve() if args.workdir else Path(tempfile.mkdtemp(prefix="gpu-overhead-"))
    workdir.mkdir(parents=True, exist_ok=True)
    sides = ["elastic", "plain", *(["elastic-fsdp"] if args.fsdp else [])]
    plan = [(i, kind) for i in range(args.repeats) for kind in ("elastic", "plain")]
    plan += [(args.repeats - 1, "elastic-fsdp")] if args.fsdp else []  # once: its blocked ms per save
    head = {**builds(), "benchmark": "gpu_overhead"}
    runs: list[dict] = []
    try:
        for i, kind in plan:
            r = measure(kind, args, workdir / f"{i:02d}-{kind}", env)
            r["repeat"] = i
            runs.append(r)
            if args.out:  # after every run: a run cut short still leaves what it measured
                write_json(args.out, {**head, "partial": True, "runs": runs}, run)
            saves = (f", saves blocked {r['periodic_blocked_ms']} ms (periodic), "
                     f"{[s['blocked_ms'] for s in r['saves'] if s['blocking']]} ms (final)" if "saves" in r else "")
            print(f"repeat {i} {kind:12s} {r['samples_per_s']:8.1f} samples/s over steps {r['first_step']}.."
                  f"{r['last_step']} (median step {r['median_step_s'] * 1e3:.1f} ms, max {r['max_step_ms']:.0f} ms), "
                  f"wall {r['wall_s']:.1f} s{saves}", flush=True)
    except BaseException:
        print(f"gpu_overhead: a run failed; its logs are kept in {workdir}", file=sys.stderr)
        raise
    if not args.workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    by = {k: [r for r in runs if r["kind"] == k] for k in sides}
    paired = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(by["elastic"], by["plain"])]
    periodic = [ms for r in by["elastic"] + by.get("elastic-fsdp", []) for ms in r["periodic_blocked_ms"]]
    first = [r["periodic_blocked_ms"][0] for r in by["elastic"] + by.get("elastic-fsdp", []) if r["periodic_blocked_ms"]]
    result = {
        **head, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir", "txt")},
        "samples_per_s": {k: overhead.summary([r["samples_per_s"] for r in rs]) for k, rs in by.items()},
        "median_step_ms": {k: statistics.median(r["median_step_s"] * 1e3 for r in rs) for k, rs in by.items()},
        "paired_ratio": paired, "ratio_min": min(paired),
        "blocked_ms_per_save": {k: [r["periodic_blocked_ms"] for r in rs] for k, rs in by.items() if k != "plain"},
        "first_save_blocked_ms": first, "max_periodic_blocked_ms": max(periodic) if periodic else None,
        "targets": {"ratio_at_least_0.99": min(paired) >= 0.99,
                    "every_save_under_50_ms": bool(periodic) and max(periodic) < 50},
        "total_s": time.monotonic() - started, "runs": runs,
        "commands": {k: rs[0]["command"] for k, rs in by.items()},
    }
    print(f"\n{result['gpu'] if 'gpu' in result else args.device}, torch {result['torch']} (CUDA {result['cuda_build']}"
          f"{', NCCL ' + result['nccl'] if 'nccl' in result else ''}), commit {run.commit[:12]}")
    for k in sides:
        print(f"{k}: {result['commands'][k]}")
    print("side         | samples/s median (min..max) | median step ms | blocked ms per periodic save")
    for k, rs in by.items():
        st = result["samples_per_s"][k]
        print(f"{k:12s} | {st['median']:8.1f} ({st['min']:.1f}..{st['max']:.1f})      | {result['median_step_ms'][k]:14.1f} | "
              f"{result['blocked_ms_per_save'].get(k, '-')}")
    print(f"elastic/plain paired ratios: {', '.join(f'{x:.3f}' for x in paired)} (target >= 0.99: "
          f"{'met' if result['targets']['ratio_at_least_0.99'] else 'MISSED'}); every periodic save < 50 ms, the first "
          f"included: {'met' if result['targets']['every_save_under_50_ms'] else 'MISSED'} "
          f"(max {result['max_periodic_blocked_ms']} ms); {result['total_s']:.0f} s in all")
    if args.out:
        write_json(args.out, result, run, say=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
