"""Streaming reads (issue 45, point 5): does reading keep up with the trainer, and how long does a rank
take to find its place again after a world-size change?

    .venv/bin/python benchmarks/stream_read.py --txt benchmarks/results/stream_read.txt \\
        --json benchmarks/results/stream_read.json          # 1 GB of Parquet + 1 GB of token files
    .venv/bin/python benchmarks/stream_read.py --gb 0.02 --paced-steps 10 --repositions 2   # the smoke test's size

The data are written first, under ``--dir`` (a new temporary folder by default, deleted at the end):
``--gb`` of Parquet shards (a ``tokens`` column of ``--seq-len`` int32 lists, random, row groups of
``--row-group`` rows, ``--shard-mb`` per file) and ``--gb`` of flat uint16 token files of the same
sequences. They were just written, so they are read from the page cache (a local disk's best case;
the machine is shared and dropping the cache would disturb the others). Each rank's step takes
``--rows-per-rank`` sequences in micro-batches of ``--micro`` (the sample: an int64 tensor of the
tokens), through the product's path (``feed.make_feed`` -> ``StreamSampler`` + ``StreamBatches``),
with ``--shuffle-buffer`` rows a block. For each format and each ``--workers`` count:

1. **Read rate**: one rank alone reads the whole epoch as fast as it can (nothing else in the step):
   MB/s and rows/s, and the rate one step of ``--step-seconds`` needs.
2. **At the trainer's rate**: rank 0 of ``--world`` ranks, whose step takes ``--step-seconds``
   (a sleep: the GPU's work) plus the wait for its micro-batches; ``--paced-steps`` steps: the wait
   per step (median, p99, max). Reading stalls the step when the wait is not ~0.
3. **Reposition**: a world of ``--world`` ranks after some steps changes to ``world - 1`` and back
   (a node lost, a node added): for the first and the last rank of the new world, the time from the
   saved position to its first step's micro-batches (``load_state_dict`` into a new sampler, a new
   feed, the first step's samples read, DataLoader workers started), median and worst over
   ``--repositions`` changes, against one step's time (the target: at most one step); and, after a
   step's compute, the wait for the second step's (what is left of the workers' start-up).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import provenance  # benchmarks/provenance.py: the results' header (date, commit, machine, command)

from elastic_trainer.stream import ParquetReader, ShardedSource, TokenFileReader
from elastic_trainer.tasks import Task
from elastic_trainer.training.feed import make_feed

CPU = torch.device("cpu")


def to_sample(row: dict) -> torch.Tensor:
    """A row's tokens as the int64 tensor a model embeds."""
    return torch.from_numpy(row["tokens"].astype(np.int64))


def write_data(root: Path, gb: float, seq_len: int, shard_mb: float, row_group: int) -> dict[str, list[str]]:
    """``gb`` of Parquet shards and ``gb`` of token files of random sequences; returns their paths by format."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    out: dict[str, list[str]] = {"parquet": [], "tokens": []}
    for fmt, itemsize in (("parquet", 4), ("tokens", 2)):
        rows_total = int(gb * 1e9) // (seq_len * itemsize)
        per_shard = max(1, int(shard_mb * 1e6) // (seq_len * itemsize))
        (root / fmt).mkdir(parents=True, exist_ok=True)
        for i, start in enumerate(range(0, rows_total, per_shard)):
            rows = min(per_shard, rows_total - start)
            if fmt == "parquet":
                values = pa.array(rng.integers(0, 50000, rows * seq_len, dtype=np.int32))
                offsets = pa.array(np.arange(0, rows * seq_len + 1, seq_len, dtype=np.int32))
                path = root / fmt / f"shard-{i:04d}.parquet"
                pq.write_table(pa.table({"tokens": pa.ListArray.from_arrays(offsets, values)}), path,
                               row_group_size=row_group)
            else:
                path = root / fmt / f"shard-{i:04d}.bin"
                rng.integers(0, 50000, rows * seq_len, dtype=np.uint16).tofile(path)
            out[fmt].append(str(path))
    return out


def source_of(fmt: str, shards: list[str], seq_len: int, buffer: int) -> ShardedSource:
    reader = ParquetReader(["tokens"]) if fmt == "parquet" else TokenFileReader(seq_len, "uint16")
    return ShardedSource(shards, reader, transform=to_sample, shuffle_buffer=buffer)


def feed(task: Task, rank: int, world: int, args, workers: int, state: dict | None = None):
    gbs = args.rows_per_rank * (args.world if world > 1 else 1)  # constant over world changes, as in the trainer
    sampler, batches = make_feed(task, global_batch_size=gbs, rank=rank, world_size=world,
                                 seed=0, micro_batch_size=args.micro, num_workers=workers, device=CPU)
    if state is not None:
        sampler.load_state_dict(state)
    return sampler, batches


def step(sampler, batches) -> int:
    """One step's micro-batches; returns the tokens delivered."""
    tokens = 0
    for i in range(sampler.micro_batches_per_step):
        _, _, batch = batches.next(first_of_step=i == 0)
        tokens += batch.numel()
    sampler.commit_step()
    return tokens


def read_rate(task: Task, args, workers: int, row_bytes: int) -> dict:
    sampler, batches = feed(task, 0, 1, args, workers)
    steps, t0 = sampler.remaining_steps, time.perf_counter()
    rows = 0
    for _ in range(steps):
        step(sampler, batches)
        rows += args.rows_per_rank
    took = time.perf_counter() - t0
    return {"rows": rows, "seconds": round(took, 3), "rows_per_s": round(rows / took, 1),
            "mb_per_s": round(rows * row_bytes / took / 1e6, 1)}


def paced(task: Task, args, workers: int) -> dict:
    sampler, batches = feed(task, 0, args.world, args, workers)
    waits = []
    for _ in range(min(args.paced_steps, sampler.remaining_steps)):
        t0 = time.perf_counter()
        step(sampler, batches)
        waits.append(time.perf_counter() - t0)
        time.sleep(args.step_seconds)  # the step's compute, while DataLoader workers read ahead
    first, rest = waits[0], sorted(waits[1:]) or [0.0]
    return {"steps": len(waits), "first_ms": round(first * 1e3, 1), "median_ms": round(statistics.median(rest) * 1e3, 2),
            "p99_ms": round(rest[min(len(rest) - 1, int(0.99 * len(rest)))] * 1e3, 2), "max_ms": round(rest[-1] * 1e3, 1)}


def reposition(task: Task, args, workers: int) -> dict:
    """For the first and the last rank of the new world: the wait for the first step's micro-batches (the
    reposition) and, after one step of compute, for the second step's (what the workers' start-up leaves)."""
    base, _ = feed(task, 0, args.world, args, workers)
    times: dict[str, list[float]] = {f"{who} {which}": [] for who in ("first rank", "last rank")
                                     for which in ("step 1", "step 2")}
    for trial in range(args.repositions):
        for _ in range(min(7, base.remaining_steps - 3)):
            base.commit_step()  # the old world's steps (their reading is not what is measured)
        state = base.state_dict()
        for world in (args.world - 1, args.world):
            for who, rank in (("first rank", 0), ("last rank", world - 1)):
                t0 = time.perf_counter()
                sampler, batches = feed(task, rank, world, args, workers, state)
                step(sampler, batches)
                times[f"{who} step 1"].append(time.perf_counter() - t0)
                time.sleep(args.step_seconds)
                t0 = time.perf_counter()
                step(sampler, batches)
                times[f"{who} step 2"].append(time.perf_counter() - t0)
                del sampler, batches  # its DataLoader workers end with it
            probe, _ = feed(task, 0, world, args, 0, state)
            state = probe.state_dict()
    return {name: {"median_ms": round(statistics.median(v) * 1e3, 1), "max_ms": round(max(v) * 1e3, 1), "n": len(v)}
            for name, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="GB of each format to write and read (default: 1)")
    p.add_argument("--dir", default=None, help="where to write the data (default: a new temporary folder, deleted)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens a row (default: 2048)")
    p.add_argument("--shard-mb", type=float, default=128, help="MB a shard (default: 128)")
    p.add_argument("--row-group", type=int, default=1024, help="Parquet rows a row group (default: 1024)")
    p.add_argument("--shuffle-buffer", type=int, default=1024, help="rows a shuffle block (default: 1024)")
    p.add_argument("--rows-per-rank", type=int, default=16, help="sequences a rank trains a step (default: 16)")
    p.add_argument("--micro", type=int, default=8, help="sequences a micro-batch (default: 8)")
    p.add_argument("--world", type=int, default=8, help="ranks of the paced and reposition runs (default: 8)")
    p.add_argument("--step-seconds", type=float, default=0.2, help="the step's compute time (default: 0.2)")
    p.add_argument("--paced-steps", type=int, default=100, help="steps at the trainer's rate (default: 100)")
    p.add_argument("--repositions", type=int, default=5, help="world changes measured, each two ways (default: 5)")
    p.add_argument("--workers", default="0,2", help="--num-workers counts, comma-separated (default: 0,2)")
    p.add_argument("--note", default="", help="what else ran on the machine meanwhile (printed and kept in the JSON)")
    p.add_argument("--json", default=None, metavar="PATH", help="write every number to PATH")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="stream-read-"))
    with provenance.record(args.txt) as run:
        print(f"command: {run.command}")
        print(f"machine: {run.cores} cores, load average at the start {' '.join(map(str, os.getloadavg()))}"
              + (f"; meanwhile: {args.note}" if args.note else ""))
        try:
            t0 = time.perf_counter()
            shards = write_data(root, args.gb, args.seq_len, args.shard_mb, args.row_group)
            print(f"wrote {args.gb:g} GB of Parquet ({len(shards['parquet'])} shards) and {args.gb:g} GB of token "
                  f"files ({len(shards['tokens'])}) under {root} in {time.perf_counter() - t0:.1f} s")
            need = args.rows_per_rank / args.step_seconds
            print(f"a rank trains {args.rows_per_rank} sequences of {args.seq_len} tokens a step of {args.step_seconds} s: "
                  f"it needs {need:.0f} rows/s\n")
            rows = []
            for fmt in ("parquet", "tokens"):
                source = source_of(fmt, shards[fmt], args.seq_len, args.shuffle_buffer)
                task = Task(model=torch.nn.Linear(1, 1), dataset=source, loss_fn=lambda out, batch: out.sum())
                row_bytes = args.seq_len * (4 if fmt == "parquet" else 2)
                for w in workers:
                    row = {"format": fmt, "workers": w, "rows_in_all": sum(source.row_counts()),
                           "read": read_rate(task, args, w, row_bytes), "paced": paced(task, args, w),
                           "reposition": reposition(task, args, w)}
                    rows.append(row)
                    r, pc, rp = row["read"], row["paced"], row["reposition"]
                    print(f"{fmt:8s} workers {w}: read {r['mb_per_s']:7.1f} MB/s {r['rows_per_s']:9.0f} rows/s "
                          f"({r['rows_per_s'] / need:5.1f}x the need) | wait a step: median {pc['median_ms']} ms, "
                          f"p99 {pc['p99_ms']} ms, max {pc['max_ms']} ms (first {pc['first_ms']} ms)")
                    print("         reposition, the first step's data (median / max ms): " + ", ".join(
                          f"{who} {rp[f'{who} step 1']['median_ms']} / {rp[f'{who} step 1']['max_ms']}"
                          for who in ("first rank", "last rank")) + "; the second step's: " + ", ".join(
                          f"{who} {rp[f'{who} step 2']['median_ms']} / {rp[f'{who} step 2']['max_ms']}"
                          for who in ("first rank", "last rank")) + f" (a step: {args.step_seconds * 1e3:.0f} ms)")
            worst = max(v["max_ms"] for row in rows for k, v in row["reposition"].items() if k.endswith("step 1"))
            print(f"\nworst reposition {worst} ms: {'within' if worst <= args.step_seconds * 1e3 else 'OVER'} one "
                  f"step ({args.step_seconds * 1e3:.0f} ms); load average at the end {' '.join(map(str, os.getloadavg()))}")
            settings = {k: v for k, v in vars(args).items() if k not in ("txt", "json", "dir", "note")}
            provenance.write_json(args.json, {"settings": settings, "meanwhile": args.note, "needed_rows_per_s": need,
                                              "rows": rows, "worst_reposition_ms": worst}, run)
        finally:
            if not args.dir:
                shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
