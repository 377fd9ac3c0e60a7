"""FSDP checkpoints, full state gathered on rank 0 against sharded per rank: memory and time.

    .venv/bin/python benchmarks/sharded_bench.py                  # 4 ranks, widths 1024 and 2048
    .venv/bin/python benchmarks/sharded_bench.py --ranks 2 --widths 256 --json out.json   # quick

For each width ``d`` a model of four ``Linear(d, d)`` layers (each its own ``fully_shard`` unit,
Adam) is trained one step on ``--ranks`` gloo ranks (torchrun, CPU), then saved once to a local
directory, both ways:

- full: ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=True`` (the
  gather onto rank 0), then ``CheckpointManager.save(blocking=True)`` on rank 0 (format 3);
- sharded: ``checkpoint.sharded.save_sharded`` (each rank its DCP shards, rank 0 the manifest).

Per rank it reports the resident memory before the save and the peak during it (``VmHWM`` of
``/proc/self/status``, reset with ``/proc/self/clear_refs`` just before the save), and the time
the save blocked. Then the sharded checkpoint is loaded at the same and at half the world size
(``load_sharded``, resharding), timed. State bytes = parameters + Adam's two moments.
Prints a table and the command that produced it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from elastic_trainer.checkpoint import CheckpointManager
    from elastic_trainer.checkpoint.sharded import load_sharded, save_sharded

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    if args.mode != "load":
        model(torch.randn(8, args.width)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    ckpt = CheckpointManager(args.url, async_checkpoint=False, writer_id=f"bench-{rank}-{os.getpid()}")
    dist.barrier()
    row = {"mode": args.mode, "rank": rank, "world": world, "width": args.width, "rss_before": _status("VmRSS")}
    _reset_peak()
    t0 = time.perf_counter()
    if args.mode == "full":
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = {"model": get_model_state_dict(model, options=options),
                 "optimizer": get_optimizer_state_dict(model, optimizer, options=options)}
        if rank == 0:
            ckpt.save(1, state, blocking=True)
        del state
        dist.barrier()
    elif args.mode == "sharded":
        save_sharded(ckpt, 1, model, optimizer, {"meta": {"world_size": world}} if rank == 0 else None)
    else:
        step, state = ckpt.load()
        load_sharded(ckpt, step, state, model, optimizer)
        dist.barrier()
    row["seconds"] = time.perf_counter() - t0
    row["peak"] = _status("VmHWM")
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo may abort in interpreter teardown after a clean run (see elastic_trainer/train.py)


def _run(ranks: int, mode: str, width: int, url: str, out: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "--worker", mode, "--width", str(width), "--url", url, "--out", out]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} at {ranks} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--widths", default="1024,2048")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, choices=["full", "sharded", "load"], help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        return worker(args)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/rows.jsonl"
        for width in (int(w) for w in args.widths.split(",")):
            for mode in ("full", "sharded"):
                _run(args.ranks, mode, width, f"{tmp}/{mode}-{width}", out)
            for ranks in sorted({args.ranks, max(1, args.ranks // 2)}, reverse=True):
                _run(ranks, "load", width, f"{tmp}/sharded-{width}", out)
        rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    mib = 1 << 20
    print(f"\n{'width':>5} | {'state MiB':>9} | {'mode':>7} | {'ranks':>5} | {'seconds':>7} | "
          f"rank 0 RSS before / peak MiB (growth) | other ranks' peak growth MiB (max)")
    for width in sorted({r["width"] for r in rows}):
        state_mib = 3 * 4 * (width * width + width) * 4 / mib
        for mode in ("full", "sharded", "load"):
            for world in sorted({r["world"] for r in rows if r["width"] == width and r["mode"] == mode}, reverse=True):
                group = sorted((r for r in rows if (r["width"], r["mode"], r["world"]) == (width, mode, world)),
                               key=lambda r: r["rank"])
                r0, others = group[0], group[1:]
                grow = max(((r["peak"] - r["rss_before"]) / mib for r in others), default=0.0)
                print(f"{width:>5} | {state_mib:>9.1f} | {mode:>7} | {world:>5} | {max(r['seconds'] for r in group):>7.2f} | "
                      f"{r0['rss_before'] / mib:8.0f} / {r0['peak'] / mib:6.0f} ({(r0['peak'] - r0['rss_before']) / mib:+.0f}) "
                      f"| {grow:+.0f}")
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    if args.json:
        Path(args.json).write_text(json.dumps({"command": sys.argv, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
