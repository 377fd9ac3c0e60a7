"""FSDP checkpoints, full state gathered on rank 0 against sharded per rank: blocking, throughput, memory, load.

    .venv/bin/python benchmarks/sharded_bench.py                      # 4 ranks, widths 1024, 2048 and 4096
    .venv/bin/python benchmarks/sharded_bench.py --ranks 2 --load-ranks 1 --widths 128 --steps 2 --repeats 1  # smoke
    .venv/bin/python benchmarks/sharded_bench.py --json benchmarks/results/sharded_bench.json

For each width ``d`` a model of four ``Linear(d, d)`` layers (each its own ``fully_shard`` unit,
Adam) trains on ``--ranks`` gloo ranks (torchrun, CPU), ``--batch`` rows of ``d`` per rank and
step, and is checkpointed to a local directory both ways:

- full: ``get_model_state_dict``/``get_optimizer_state_dict`` with ``full_state_dict=True`` (the
  gather onto rank 0), then ``CheckpointManager.save`` on rank 0 (format 3; asynchronous: the
  snapshot copy, then a background thread);
- sharded: ``checkpoint.sharded.ShardedSaver.save`` (every rank copies its shards to CPU memory,
  then DCP writes them in the background; every rank hashes a share; rank 0 commits).

Measured, per width and way:

- step: the median training step with no save under way;
- blocked: the time a save held the training thread (the gather and the snapshot copy; sharded:
  the staging copy), median over ``--repeats`` saves, and as a share of the step; ``step during``
  is the median step while the save runs beside it (it shares the CPU);
- throughput: a blocking save (start to commit, every rank done) against a plain copy of the same
  bytes (each rank writes, through fsspec and fsynced, the bytes its files of the save hold into a
  new file, as a save does; full: rank 0 all of them), alternating; the ratio is the median of
  pairwise copy/save time ratios;
- peak RSS per rank during a blocking save (``VmHWM`` of ``/proc/self/status``, reset with
  ``/proc/self/clear_refs`` just before), as growth over the RSS before it;
- load: the last checkpoint loaded at ``--ranks`` and at half as many (``--load-ranks``; full: rank 0 reads the file
  and ``set_*_state_dict(broadcast_from_rank0=True)`` scatters it; sharded: ``load_sharded``
  reshards), timed, with the same RSS growth.

State bytes = parameters + Adam's two moments. Prints tables, the load average and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import provenance  # benchmarks/provenance.py: the results' header (date, commit, machine, command)

REPO = Path(__file__).resolve().parent.parent


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes (``VmRSS``, ``VmHWM``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)


def _build(width: int, world: int, seed: int = 0):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(4)])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def _full_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def bench(args: argparse.Namespace) -> dict:
    """One way (``args.mode``: full or sharded) at one width, on this rank; returns its row."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from elastic_trainer.checkpoint import CheckpointManager
    from elastic_trainer import storage
    from elastic_trainer.checkpoint.sharded import ShardedSaver

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _build(args.width, world)
    g = torch.Generator().manual_seed(rank)
    batch = torch.randn(args.batch, args.width, generator=g)

    def step() -> float:
        t0 = time.perf_counter()
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    steps = [step() for _ in range(args.steps)]
    ckpt = CheckpointManager(args.url, keep_checkpoints=2, writer_id=f"bench-{rank}-{os.getpid()}")
    saver = ShardedSaver(ckpt) if args.mode == "sharded" else None
    number = iter(range(1, 10_000))

    def save(blocking: bool) -> float:
        """One save of the next step number; returns the seconds this rank was held."""
        n = next(number)
        rest = {"meta": {"world_size": world}} if rank == 0 else None
        if saver is not None:
            return saver.save(n, model, optimizer, rest, blocking=blocking)
        t0 = time.perf_counter()
        state = {"model": get_model_state_dict(model, options=_full_options()),
                 "optimizer": get_optimizer_state_dict(model, optimizer, options=_full_options())}
        if rank == 0:
            ckpt.save(n, {**state, **rest}, blocking=blocking)
        del state
        return time.perf_counter() - t0

    # throughput and memory: blocking saves against plain copies of the same bytes, alternating
    row = {"mode": args.mode, "rank": rank, "world": world, "width": args.width, "batch": args.batch,
           "step_s": statistics.median(steps), "save_s": [], "copy_s": [], "blocked_s": [], "during_s": []}
    shares = None
    for i in range(args.repeats):
        dist.barrier()
        if i == 0:
            row["rss_before"] = _status("VmRSS")
            _reset_peak()
        t0 = time.perf_counter()
        save(blocking=True)
        if rank == 0:
            ckpt.wait()
        dist.barrier()
        row["save_s"].append(time.perf_counter() - t0)
        if rank == 0:  # where a save's time went (CheckpointManager / ShardedSaver stats)
            row.setdefault("parts", []).append({k: v for k, v in ckpt.last_save_stats.items()
                                                if k.endswith("_s") and k != "blocked_s"})
        if i == 0:
            row["peak"] = _status("VmHWM")
            shares = [_share_bytes(ckpt, rank, world, saver is not None) if rank == 0 else None]
            dist.broadcast_object_list(shares, src=0)
            shares = shares[0]
            blob = torch.randint(0, 255, (max(1, shares[rank]),), dtype=torch.uint8).numpy()
        # a plain copy into a new file, as a save writes new files (earlier versions rewrote one
        # file in place each time), removed after
        plain = storage.join(ckpt.root, f"plain-{rank}-{i}")
        dist.barrier()
        t0 = time.perf_counter()
        if shares[rank]:
            storage.write_bytes(ckpt.fs, plain, memoryview(blob)[: shares[rank]])
        dist.barrier()
        row["copy_s"].append(time.perf_counter() - t0)
        if shares[rank]:
            ckpt.fs.rm(plain)
    row["bytes"] = sum(shares)
    # blocking: asynchronous saves with training going on beside them
    for _ in range(args.repeats):
        dist.barrier()
        row["blocked_s"].append(save(blocking=False))
        row["during_s"] += [step() for _ in range(args.steps)]
        ckpt.wait()
        if rank == 0 and not ckpt.last_save_stats.get("committed"):
            raise SystemExit(f"a {args.mode} save did not commit: {ckpt.last_error}")
    ckpt.close()
    return row


def _share_bytes(ckpt, rank: int, world: int, sharded: bool) -> list[int]:
    """Bytes of the newest checkpoint's files that each rank wrote (full: rank 0 all of them)."""
    import json as _json

    from elastic_trainer import storage

    step = max(int(n.split("-")[1]) for n in storage.list_dir(ckpt.fs, ckpt.root) if n.startswith("step-"))
    files = _json.loads(storage.read_bytes(ckpt.fs, storage.join(ckpt.root, f"step-{step}", "manifest.json")))["files"]
    out = [0] * world
    for rel, info in files.items():
        name = rel.rsplit("/", 1)[-1]
        writer = int(name[2:].split("_")[0]) if sharded and name.startswith("__") else 0
        out[writer] += info["size"]
    return out


def load(args: argparse.Namespace) -> dict:
    """Load the newest checkpoint (``args.mode``: load-full or load-sharded) at this world size."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    from elastic_trainer.checkpoint import CheckpointManager
    from elastic_trainer.checkpoint.sharded import load_sharded

    rank, world = dist.get_rank(), dist.get_world_size()
    model, optimizer = _build(args.width, world, seed=1)
    ckpt = CheckpointManager(args.url, writer_id=f"load-{rank}-{os.getpid()}")
    dist.barrier()
    row = {"mode": args.mode, "rank": rank, "world": world, "width": args.width, "rss_before": _status("VmRSS")}
    _reset_peak()
    t0 = time.perf_counter()
    if args.mode == "load-sharded":
        step, state = ckpt.load()
        load_sharded(ckpt, step, state, model, optimizer)
    else:
        options = _full_options()
        options.broadcast_from_rank0 = True
        state = ckpt.load()[1] if rank == 0 else {"model": {}, "optimizer": {}}
        set_model_state_dict(model, state["model"], options=options)
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        del state
    dist.barrier()
    row["seconds"] = time.perf_counter() - t0
    row["peak"] = _status("VmHWM")
    return row


def worker(args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    row = load(args) if args.mode.startswith("load") else bench(args)
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # gloo may abort in interpreter teardown after a clean run (see elastic_trainer/train.py)


def _run(ranks: int, args: argparse.Namespace, mode: str, width: int, url: str, out: str) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "--worker", mode, "--width", str(width), "--url", url, "--out", out, "--batch", str(args.batch),
           "--steps", str(args.steps), "--repeats", str(args.repeats)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} at {ranks} ranks failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")


def _ratio(row: dict) -> float:
    return statistics.median(c / s for c, s in zip(row["copy_s"], row["save_s"]))


def report(rows: list[dict]) -> None:
    mib = 1 << 20
    print(f"\n{'width':>5} | {'state MiB':>9} | {'mode':>7} | {'ranks':>5} | {'step s':>6} | {'blocked ms':>10} | "
          f"{'of step':>7} | {'step during':>11} | {'save s':>6} | {'copy s':>6} | {'copy/save':>9} | "
          f"rank 0 RSS growth MiB | others' max")
    for width in sorted({r["width"] for r in rows}):
        for mode in ("full", "sharded"):
            group = sorted((r for r in rows if (r["width"], r["mode"]) == (width, mode)), key=lambda r: r["rank"])
            if not group:
                continue
            r0, others = group[0], group[1:]
            step = statistics.median(r["step_s"] for r in group)
            blocked = statistics.median(max(r["blocked_s"][i] for r in group) for i in range(len(r0["blocked_s"])))
            during = statistics.median(x for r in group for x in r["during_s"])
            grow = max(((r["peak"] - r["rss_before"]) / mib for r in others), default=0.0)
            print(f"{width:>5} | {r0['bytes'] / mib:>9.1f} | {mode:>7} | {r0['world']:>5} | {step:>6.3f} | "
                  f"{blocked * 1000:>10.1f} | {blocked / step:>6.1%} | {during:>11.3f} | "
                  f"{statistics.median(r0['save_s']):>6.3f} | {statistics.median(r0['copy_s']):>6.3f} | "
                  f"{_ratio(r0):>9.2f} | {(r0['peak'] - r0['rss_before']) / mib:>+21.0f} | {grow:+.0f}")
    print("\nwhere a blocking save's time went on rank 0 (medians, ms): full: copy = snapshot, serialize + upload = "
          "write and commit (the gather is the rest of 'save s'); sharded: stage = copy to CPU, write = DCP's "
          "writing (every rank done; the files hashed as they are written), hash = files read back to hash "
          "them (0 unless one was written with a seek), upload = the rest and the manifest "
          "(commit), total = from the end of staging to the commit")
    shown = {"full": ("copy_s", "serialize_s", "upload_s"),
             "sharded": ("stage_s", "write_s", "hash_s", "upload_s", "total_s")}
    for r0 in sorted((r for r in rows if r["rank"] == 0 and "parts" in r), key=lambda r: (r["width"], r["mode"])):
        keys = shown[r0["mode"]]
        print(f"{r0['width']:>5} {r0['mode']:>7}: " + ", ".join(
            f"{k[:-2]} {statistics.median(p.get(k, 0.0) for p in r0['parts']) * 1000:.0f}" for k in keys))
    print(f"\n{'width':>5} | {'load':>7} | {'ranks':>5} | {'seconds':>7} | rank 0 RSS growth MiB | others' max")
    for width in sorted({r["width"] for r in rows}):
        for mode in ("load-full", "load-sharded"):
            for world in sorted({r["world"] for r in rows if (r["width"], r["mode"]) == (width, mode)}, reverse=True):
                group = sorted((r for r in rows if (r["width"], r["mode"], r["world"]) == (width, mode, world)),
                               key=lambda r: r["rank"])
                r0, others = group[0], group[1:]
                grow = max(((r["peak"] - r["rss_before"]) / mib for r in others), default=0.0)
                print(f"{width:>5} | {mode[5:]:>7} | {world:>5} | {max(r['seconds'] for r in group):>7.3f} | "
                      f"{(r0['peak'] - r0['rss_before']) / mib:>+21.0f} | {grow:+.0f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--widths", default="1024,2048,4096")
    p.add_argument("--batch", type=int, default=64, help="rows per rank and step")
    p.add_argument("--steps", type=int, default=5, help="steps timed without a save, and beside each save")
    p.add_argument("--repeats", type=int, default=3, help="saves of each kind (and plain copies)")
    p.add_argument("--load-ranks", default=None, metavar="N,...",
                   help="world sizes the checkpoints are loaded at (default: --ranks and half of it; the smoke "
                        "test loads at 1 alone: each size is a torchrun launch of its own)")
    p.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write the rows and the header (date, commit, machine) here")
    provenance.add_arguments(p)
    p.add_argument("--worker", default=None, choices=["full", "sharded", "load-full", "load-sharded"],
                   help=argparse.SUPPRESS)
    p.add_argument("--width", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--url", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.mode = args.worker
        return worker(args)
    with provenance.record(args.txt) as run:
        _main(args, run)


def _main(args: argparse.Namespace, run: provenance.Run) -> None:
    load_ranks = sorted({int(n) for n in args.load_ranks.split(",")} if args.load_ranks
                        else {args.ranks, max(1, args.ranks // 2)}, reverse=True)
    print("command:", run.command)
    print("load average at start:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = f"{tmp}/rows.jsonl"
        for width in (int(w) for w in args.widths.split(",")):
            for mode in ("full", "sharded"):
                _run(args.ranks, args, mode, width, f"{tmp}/{mode}-{width}", out)
                for ranks in load_ranks:
                    _run(ranks, args, f"load-{mode}", width, f"{tmp}/{mode}-{width}", out)
        rows = [json.loads(line) for line in Path(out).read_text().splitlines()]
    report(rows)
    print("load average at end:", " ".join(f"{x:.2f}" for x in os.getloadavg()))
    provenance.write_json(args.json, {"rows": rows}, run, indent=1)


if __name__ == "__main__":
    main()
