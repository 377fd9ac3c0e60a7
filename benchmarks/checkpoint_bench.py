"""Checkpoint cost: how long a training step is blocked by a save, and save throughput.

    .venv/bin/python benchmarks/checkpoint_bench.py            # d_model 128 and 512, file and s3
    .venv/bin/python benchmarks/checkpoint_bench.py --quick    # smoke test (seconds)
    .venv/bin/python benchmarks/checkpoint_bench.py --json benchmarks/results/checkpoint_bench.json   # rows as JSON too

For the example model (``torch.nn.Transformer``, 2 encoder + 2 decoder layers, feed-forward 4*d,
Adam, batch 32 of src 4 / tgt 20 tokens) this runs a real forward/backward/step loop and measures:

- step: the median time of a training step with no checkpoint running;
- async blocked: the time the training thread waited for a save: ``CheckpointManager.save``
  itself plus any wait for the snapshot copy at the next optimizer step (``blocked_s`` of
  ``last_save_stats``), median over the saves after the first (the first allocates the snapshot
  buffers and, made before the manager saw the optimizer step, copies everything inside
  ``save()``; shown apart);
- step during async: the median step time while the background save runs (it shares the CPU);
- sync save: a ``blocking=True`` save of the same state (serialize + hash + upload + commit);
- throughput: checkpoint bytes / (serialize + upload) of a synchronous save, against ``fs.pipe``
  of one blob of the same number of bytes to the same storage (the plain copy), and on local
  disks also against that copy plus fsync (a checkpoint is fsynced before its commit: the
  durable plain copy). Saves and copies alternate; the ratios are medians of pairwise ratios
  (robust to a busy machine). On local disks a third copy, printed below the table and kept in
  the JSON, writes the blob through the save's own write path (``storage.write_streamed``: early
  writeback, fsync; 4 MiB writes) with nothing to serialize or hash: what is left between it and
  the save is the cost of serializing, hashing and committing. Also printed below the table: the
  ratio with the snapshot copy inside ``save()`` counted as part of the save (``copy_s``; the
  throughput above starts where the copy ends, as the plain copy starts from bytes in memory).

Storage: a local directory and ``s3://`` on moto's S3 server (loopback) in its own process, so that
the server does not share this process's GIL (it stands for a separate S3 machine).
Prints a table and the command that produced it.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid

import torch

import provenance  # benchmarks/provenance.py: the results' header (date, commit, machine, command)
from elastic_trainer import storage
from elastic_trainer.checkpoint import CheckpointManager, capture_rng_state


def build(d_model: int, layers: int):
    torch.manual_seed(0)
    model = torch.nn.Transformer(d_model=d_model, nhead=8, num_encoder_layers=layers, num_decoder_layers=layers,
                                 dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    src, tgt = torch.rand(32, 4, d_model), torch.rand(32, 20, d_model)

    def step() -> float:
        t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(src, tgt), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return time.perf_counter() - t0

    def state() -> dict:
        return {"model": model.state_dict(), "optimizer": opt.state_dict(), "rng": capture_rng_state(),
                "meta": {"world_size": 1}}

    return model, step, state


def bench(url: str, d_model: int, layers: int, steps: int, saves: int) -> dict:
    model, step, state = build(d_model, layers)
    for _ in range(3):
        step()  # warm up; Adam state now exists
    plain_steps = [step() for _ in range(steps)]

    mgr = CheckpointManager(url, keep_checkpoints=1, async_checkpoint=True)
    blocked, copy_wait, during = [], [], []
    for i in range(saves + 1):  # the first save allocates the snapshot buffers: reported apart
        mgr.save(i + 1, state())
        while mgr.busy():
            during.append(step())  # the first of these may wait for the snapshot copy
        mgr.wait()
        assert mgr.last_error is None, mgr.last_error
        blocked.append(mgr.last_save_stats["blocked_s"])  # save() + the wait at the next optimizer step
        copy_wait.append(mgr.last_save_stats["copy_wait_s"])
    async_stats = dict(mgr.last_save_stats)
    mgr.close()

    # synchronous saves alternated with plain copies of the same number of bytes, so that both
    # see the same machine load; ratios are taken pair by pair
    sync = CheckpointManager(url, keep_checkpoints=1, async_checkpoint=False)
    fs, root = storage.get_fs(url)
    blob = None
    sync_s, e2e_bps, plain_bps, durable_bps, ratios, durable_ratios, ser, upl = ([] for _ in range(8))
    streamed_bps, streamed_ratios, copy_s, copy_ratios = [], [], [], []
    for i in range(saves):
        sync_s.append(sync.save(100 + i, state(), blocking=True))
        st = sync.last_save_stats
        assert st["committed"], st
        nbytes = st["bytes"]
        e2e_bps.append(nbytes / (st["serialize_s"] + st["upload_s"]))
        ser.append(st["serialize_s"])
        upl.append(st["upload_s"])
        copy_s.append(st["copy_s"])
        with_copy_bps = nbytes / (st["serialize_s"] + st["upload_s"] + st["copy_s"])
        blob = blob if blob is not None and len(blob) == nbytes else os.urandom(nbytes)
        view = memoryview(blob)
        path = storage.join(root, f"plain-{i}.bin")
        t0 = time.perf_counter()
        fs.pipe_file(path, blob)
        plain_bps.append(nbytes / (time.perf_counter() - t0))
        ratios.append(e2e_bps[-1] / plain_bps[-1])
        fs.rm(path)
        if not storage.is_local(fs):
            copy_ratios.append(with_copy_bps / plain_bps[-1])
        if storage.is_local(fs):  # the same copy made durable, as a checkpoint is (fsync)
            t0 = time.perf_counter()
            storage.write_bytes(fs, path, blob)
            durable_bps.append(nbytes / (time.perf_counter() - t0))
            durable_ratios.append(e2e_bps[-1] / durable_bps[-1])
            copy_ratios.append(with_copy_bps / durable_bps[-1])
            fs.rm(path)
            # ... and through the save's own write path (early writeback + fsync), nothing to serialize:
            # in 4 MiB writes, the size of this model's largest tensors
            t0 = time.perf_counter()
            storage.write_streamed(fs, path, lambda out: [out.write(view[o:o + (4 << 20)])
                                                          for o in range(0, nbytes, 4 << 20)])
            streamed_bps.append(nbytes / (time.perf_counter() - t0))
            streamed_ratios.append(e2e_bps[-1] / streamed_bps[-1])
            fs.rm(path)
    sync.close()
    storage.remove(fs, root)
    return {
        "d_model": d_model, "params_m": sum(p.numel() for p in model.parameters()) / 1e6, "mb": nbytes / 1e6,
        "step_s": statistics.median(plain_steps),
        "first_blocked_s": blocked[0], "blocked_s": statistics.median(blocked[1:]),
        "copy_wait_s": statistics.median(copy_wait[1:]),
        "step_during_s": statistics.median(during) if during else float("nan"),
        "bg_s": async_stats["serialize_s"] + async_stats["upload_s"],
        "sync_s": statistics.median(sync_s),
        "save_mbps": statistics.median(e2e_bps) / 1e6,
        "plain_mbps": statistics.median(plain_bps) / 1e6,
        "ratio": statistics.median(ratios),
        "durable_mbps": statistics.median(durable_bps) / 1e6 if durable_bps else None,
        "durable_ratio": statistics.median(durable_ratios) if durable_ratios else None,
        "streamed_mbps": statistics.median(streamed_bps) / 1e6 if streamed_bps else None,
        "streamed_ratio": statistics.median(streamed_ratios) if streamed_ratios else None,
        "serialize_s": statistics.median(ser), "upload_s": statistics.median(upl),
        "copy_s": statistics.median(copy_s), "with_copy_ratio": statistics.median(copy_ratios),
    }


def start_moto_server() -> tuple[subprocess.Popen, int]:
    """moto's S3 server in its own process on a free loopback port (a separate S3 machine, in small)."""
    from elastic_trainer.etcd.server import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", "import sys; from moto.server import main; main(sys.argv[1:])",
                             "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start within 60 s")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smallest sizes, file and s3, one save each")
    p.add_argument("--sizes", default="128,512", help="d_model values (default 128,512)")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers each (default 2)")
    p.add_argument("--steps", type=int, default=20, help="timed plain steps (default 20)")
    p.add_argument("--saves", type=int, default=5, help="saves per mode, median reported (default 5)")
    p.add_argument("--stores", default="file,s3", help="file and/or s3 (default both)")
    p.add_argument("--json", metavar="PATH", help="also write the rows (seconds, MB/s, ratios) and the settings here")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(args, run)


def _main(args, run: provenance.Run) -> int:
    if args.quick:
        args.sizes, args.layers, args.steps, args.saves = "128", 1, 3, 1
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))

    load_start = os.getloadavg()
    server = None
    tmp = tempfile.mkdtemp(prefix="ckpt-bench-")
    rows = []
    try:
        for store in args.stores.split(","):
            if store == "s3":
                server, port = start_moto_server()
                os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                                  AWS_DEFAULT_REGION="us-east-1",
                                  ELASTIC_TRAINER_S3_ENDPOINT_URL=f"http://127.0.0.1:{port}")
                bucket = f"bench-{uuid.uuid4().hex[:8]}"
                storage.get_fs(f"s3://{bucket}")[0].mkdir(bucket)
            for d in (int(x) for x in args.sizes.split(",")):
                url = os.path.join(tmp, f"d{d}") if store == "file" else f"s3://{bucket}/d{d}"
                r = bench(url, d, args.layers, args.steps, args.saves)
                r["store"] = store
                rows.append(r)
                print(f"  done {store} d_model={d}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"command: {run.command}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{args.layers}+{args.layers} layers, median of {args.saves} saves")
    head = ("store", "d_model", "params M", "ckpt MB", "step ms", "1st async blocked ms", "async blocked ms",
            "blocked/step", "step during upload ms", "bg save s", "sync save s", "sync/step", "serialize s", "upload s",
            "save MB/s", "plain copy MB/s", "save/plain", "plain+fsync MB/s", "save/(plain+fsync)")
    print(" | ".join(head))
    print(" | ".join("---" for _ in head))
    for r in rows:
        durable = r["durable_mbps"]
        print(" | ".join([
            r["store"], str(r["d_model"]), f"{r['params_m']:.1f}", f"{r['mb']:.1f}", f"{r['step_s'] * 1e3:.0f}",
            f"{r['first_blocked_s'] * 1e3:.1f}", f"{r['blocked_s'] * 1e3:.1f}", f"{r['blocked_s'] / r['step_s']:.1%}",
            f"{r['step_during_s'] * 1e3:.0f}",
            f"{r['bg_s']:.2f}", f"{r['sync_s']:.2f}", f"{r['sync_s'] / r['step_s']:.1f}x",
            f"{r['serialize_s']:.2f}", f"{r['upload_s']:.2f}",
            f"{r['save_mbps']:.0f}", f"{r['plain_mbps']:.0f}", f"{r['ratio']:.0%}",
            f"{durable:.0f}" if durable else "n/a", f"{r['durable_ratio']:.0%}" if durable else "n/a"]))
    for r in rows:
        base = "plain+fsync" if r["durable_mbps"] else "plain"
        print(f"{r['store']} d_model={r['d_model']}: counting the snapshot copy inside save() too "
              f"({r['copy_s'] * 1e3:.1f} ms), save/{base} {r['with_copy_ratio']:.0%}")
    for r in rows:
        if r["streamed_mbps"]:
            print(f"{r['store']} d_model={r['d_model']}: plain copy through the save's write path (early writeback + "
                  f"fsync) {r['streamed_mbps']:.0f} MB/s, save/that {r['streamed_ratio']:.0%}")
    load_end = os.getloadavg()
    print(f"load average (1/5/15 min) at the start: {load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f}, "
          f"at the end: {load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f}")
    if args.json:
        result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
                  "cpus": os.cpu_count(), "layers": args.layers, "saves": args.saves, "steps": args.steps,
                  "time": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_start": list(load_start),
                  "load_end": list(load_end),
                  "rows": [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()}
                           for r in rows]}
        provenance.write_json(args.json, result, run, indent=1)
        print(f"rows written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
