"""The first save's blocked time on a GPU: host memory made inside the save, or prepared before it.

    python benchmarks/gpu_first_save.py --out first_save.json        # ~1 min on an H100 (2 GB state)
    python benchmarks/gpu_first_save.py --quick                      # smoke test (CPU too)

One process, one GPU, the 166M-parameter GPT of ``benchmarks/gpt_task.py`` (AdamW, bf16 autocast:
a 2.0 GB state). Three parts:

1. **Host memory** for a state of that size: page-locking a fresh buffer (``cudaHostRegister``,
   ``checkpoint/host_memory.py``) against torch's caching pinned allocator (``pin_memory=True``)
   and a pageable buffer: seconds to make, GB/s of a device-to-host copy into each, and how much
   slower the training steps run while the buffer is made on a background thread.
2. **Full-state saves** (``CheckpointManager``, what DDP's rank 0 saves) at steps 20 and 50,
   the second after the first finished writing, without and with ``prepare`` after the first
   step (``checkpoint.sharded.prepare_saves``, as the trainer calls it): blocked ms per save.
3. **Sharded saves** (FSDP2 over NCCL, a world of one; ``ShardedSaver``): the same, and the bytes
   the committed line reports.

Prints a table; ``--out`` writes JSON that starts with "commit", "date", "machine" and "command". Target (issue 28):
every save, the first included, blocks < 50 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

import gpt_task  # noqa: E402
import provenance  # noqa: E402  (benchmarks/provenance.py: the results' header: date, commit, machine, command)
from gpu_overhead import QUICK_GPT, builds, write_json  # noqa: E402

from elastic_trainer.checkpoint import CheckpointManager, host_memory  # noqa: E402
from elastic_trainer.checkpoint.sharded import ShardedSaver, prepare_saves  # noqa: E402

SAVE_AT = (20, 50)  # the first save and a steady one


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Job:
    """The GPT, its optimizer and data on ``device``; ``step()`` trains one batch."""

    def __init__(self, opts, device: torch.device, batch: int, fsdp: bool = False) -> None:
        torch.manual_seed(0)
        self.device = device
        self.model = gpt_task.make_model(opts)
        if fsdp:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in self.model.blocks:
                fully_shard(block, mp_policy=policy)
            fully_shard(self.model, mp_policy=policy)
        else:
            self.model.to(device)
        self.optimizer = gpt_task.make_optimizer(self.model.parameters(), opts)
        data = gpt_task.make_dataset(opts)
        self.x, self.y = data.tensors[0][:batch].to(device), data.tensors[1][:batch].to(device)
        self.amp = device.type == "cuda"

    def step(self) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.amp):
            loss = gpt_task.loss(self.model, (self.x, self.y))
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def state_bytes(self) -> int:
        tensors = [*self.model.state_dict().values()]
        tensors += [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
        local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
        return sum(t.numel() * t.element_size() for t in local)


def timed_steps(job: Job, n: int) -> list[float]:
    """Milliseconds of each of ``n`` steps, the GPU's time included (a synchronize after each)."""
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        job.step()
        _sync(job.device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def host_memory_part(job: Job, nbytes: int) -> dict:
    """Making a buffer of ``nbytes`` three ways, copying into each, and the steps while one is made."""
    cuda = job.device.type == "cuda"
    out: dict = {"bytes": nbytes}
    src = torch.empty(nbytes, dtype=torch.uint8, device=job.device)

    def copy_gbps(dst: torch.Tensor, src: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(3):
            _sync(job.device)
            t0 = time.perf_counter()
            dst[:nbytes].copy_(src, non_blocking=True)  # a page-locked buffer is whole pages
            _sync(job.device)
            best = min(best, time.perf_counter() - t0)
        return nbytes / best / 1e9

    ways = {"registered": lambda: host_memory.allocate(nbytes, cuda)[0],
            "pageable": lambda: host_memory.allocate(nbytes, False, touch=True)[0]}
    if cuda:
        ways["torch_pinned"] = lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    for name, make in ways.items():
        t0 = time.perf_counter()
        buf = make()
        out[f"{name}_make_s"] = time.perf_counter() - t0
        out[f"{name}_copy_gbps"] = copy_gbps(buf, src)
        del buf
    del src
    steady = timed_steps(job, 20)
    done = threading.Event()
    made: list = []
    thread = threading.Thread(target=lambda: (made.append(host_memory.allocate(nbytes, cuda, touch=True)), done.set()))
    t0 = time.perf_counter()
    thread.start()
    during: list[float] = []
    while not done.is_set() and len(during) < 500:
        during += timed_steps(job, 1)
    thread.join()
    out.update(background_make_s=time.perf_counter() - t0, steady_step_ms=statistics.median(steady),
               steps_during_make=len(during), during_median_step_ms=statistics.median(during) if during else None,
               during_max_step_ms=max(during) if during else None,
               during_extra_ms=sum(during) - len(during) * statistics.median(steady) if during else None)
    made.clear()
    return out


def saves_part(job: Job, make_saver, prepare, steps: int) -> dict:
    """Train ``steps`` steps; save at ``SAVE_AT`` (each after the previous one is written); ``prepare``
    after the first step when given. Returns blocked ms per save and the last commit's stats."""
    blocked, waits = [], []
    saver = make_saver()
    for step in range(1, steps + 1):
        job.step()
        if step == 1 and prepare is not None:
            prepare(saver)
        if step in SAVE_AT:
            saver.wait()
            _sync(job.device)
            t0 = time.perf_counter()
            stats = saver.save(step)
            blocked.append(round((time.perf_counter() - t0) * 1e3, 1))
            waits.append(round(stats.get("host_buffer_wait_s", 0.0) * 1e3, 1))
    saver.wait()
    last = saver.stats()
    saver.close()
    return {"blocked_ms": blocked, "host_buffer_wait_ms": waits, "committed": last.get("committed"),
            "bytes": last.get("bytes"), "host_buffer_bytes": last.get("host_buffer_bytes")}


class FullSaver:
    def __init__(self, job: Job, root: str) -> None:
        self.job, self.ckpt = job, CheckpointManager(root, keep_checkpoints=1)

    def save(self, step: int) -> dict:
        state = {"model": self.job.model.state_dict(), "optimizer": self.job.optimizer.state_dict(),
                 "meta": {"step": step}}
        self.ckpt.save(step, state)
        return self.ckpt.last_save_stats

    def wait(self) -> None:
        self.ckpt.wait()

    def stats(self) -> dict:
        return self.ckpt.last_save_stats

    def close(self) -> None:
        self.ckpt.close()


class Sharded(FullSaver):
    def __init__(self, job: Job, root: str) -> None:
        super().__init__(job, root)
        self.saver = ShardedSaver(self.ckpt)

    def save(self, step: int) -> dict:
        self.saver.save(step, self.job.model, self.job.optimizer, {"meta": {"step": step}})
        return self.saver.last_stats

    def stats(self) -> dict:
        return {**self.ckpt.last_save_stats, "host_buffer_bytes": self.saver.last_stats.get("host_buffer_bytes")}

    def close(self) -> None:
        self.saver.close()
        self.ckpt.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--out", default=None, help="write the results as JSON to this file")
    p.add_argument("--quick", action="store_true", help="a tiny GPT (CPU too)")
    p.add_argument("--parts", default="memory,full,sharded", help="comma list (default memory,full,sharded)")
    provenance.add_arguments(p)
    args = p.parse_args(argv)
    with provenance.record(args.txt) as run:
        return _main(args, run)


def _main(args: argparse.Namespace, run: provenance.Run) -> int:
    parts = set(args.parts.split(","))
    opts = gpt_task.add_arguments(argparse.ArgumentParser()).parse_args(QUICK_GPT if args.quick else [])
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    steps = max(SAVE_AT) + 1
    result: dict = {**builds(), "benchmark": "gpu_first_save", "device": str(device)}
    with tempfile.TemporaryDirectory(prefix="first-save-") as tmp:
        job = Job(opts, device, args.batch)
        timed_steps(job, 3)
        result["state_bytes"] = job.state_bytes()
        print(f"{device} ({result.get('gpu', 'cpu')}), state {result['state_bytes'] / 1e9:.2f} GB", flush=True)
        if "memory" in parts:
            result["host_memory"] = host_memory_part(job, result["state_bytes"])
            print(json.dumps(result["host_memory"], indent=1), flush=True)
        if "full" in parts:
            for name, prep in (("full_no_prepare", None),
                               ("full_prepared", lambda s: prepare_saves(s.ckpt, s.job.model, s.job.optimizer,
                                                                         sharded=False, main=True))):
                result[name] = saves_part(job, lambda: FullSaver(job, f"{tmp}/{name}"), prep, steps)
                print(name, result[name], flush=True)
        del job
        if "sharded" in parts:
            import torch.distributed as dist

            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("FIRST_SAVE_PORT", "29533"))
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1,
                                    device_id=device if device.type == "cuda" else None)
            try:
                job = Job(opts, device, args.batch, fsdp=True)
                timed_steps(job, 3)
                for name, prep in (("sharded_no_prepare", None),
                                   ("sharded_prepared", lambda s: s.saver.prepare(s.job.model, s.job.optimizer))):
                    result[name] = saves_part(job, lambda: Sharded(job, f"{tmp}/{name}"), prep, steps)
                    print(name, result[name], flush=True)
            finally:
                dist.destroy_process_group()
    prepared = [ms for k in ("full_prepared", "sharded_prepared") if k in result for ms in result[k]["blocked_ms"]]
    result["max_prepared_blocked_ms"] = max(prepared) if prepared else None
    result["every_prepared_save_under_50_ms"] = bool(prepared) and max(prepared) < 50
    print(f"every save after prepare (the first included) < 50 ms: "
          f"{'met' if result['every_prepared_save_under_50_ms'] else 'MISSED'} (max {result['max_prepared_blocked_ms']} ms)")
    if args.out:
        write_json(args.out, result, run, say=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
