"""A checkpoint writer in its own process, for the kill-during-save and concurrent-writer tests.

    python tests/helpers/ckpt_writer.py --url /tmp/ck --steps 1,2,3 --writer-id a [--size-kb 64]
        [--slow-from-step 2 --slow-bytes-per-s 1000000] [--keep 3] [--go-file PATH]
        [--etcd HOST:PORT --prefix /elastic-trainer/RUN/ --round 4 [--stop-after-fence-at 5]]

Saves each step (blocking) with a state whose tensors are filled with a per-writer value and
prints ``committed <step>`` or ``not-committed <step>`` (with ``--go-file``, first ``ready``, then it
waits for that file); with ``--slow-from-step`` the writes of
that step and later go through a throttled local filesystem that prints ``uploading <step>``
when the first byte of that step is written, so a test can SIGKILL the process mid-upload.
With ``--etcd`` the commits are fenced by a ``RoundFence`` of ``--round`` (the etcd commit record);
``--stop-after-fence-at N`` makes the process print ``fence-passed N`` and SIGSTOP itself right
after its fence check for step N passed, before its commit, so a test can let a new round go on
and then SIGCONT it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import torch
from fsspec.implementations.local import LocalFileSystem

from elastic_trainer.checkpoint import CheckpointManager
from elastic_trainer.rendezvous.round_fence import RoundFence


class StallingFence(RoundFence):
    """A round fence that stops its own process right after the check of a chosen step passed."""

    stop_at_step: int | None = None
    step: int | None = None

    def guard(self):
        guard = super().guard()
        if self.step is not None and self.step == self.stop_at_step:
            self.stop_at_step = None
            print(f"fence-passed {self.step}", flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        return guard


class _ThrottledFile:
    """A local file opened for writing that writes at most ``bytes_per_s`` in 64 KiB chunks."""

    def __init__(self, path: str, mode: str, bytes_per_s: float) -> None:
        self.f = open(path, mode)
        self.bytes_per_s = bytes_per_s

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        chunk = 64 * 1024
        for i in range(0, len(view), chunk):
            self.f.write(view[i:i + chunk])
            self.f.flush()
            time.sleep(len(view[i:i + chunk]) / self.bytes_per_s)
        return len(view)

    def flush(self) -> None:
        self.f.flush()

    def close(self) -> None:
        self.f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ThrottledLocalFileSystem(LocalFileSystem):
    """The local filesystem with slow writes (a slow NFS or S3); announces the first write."""

    cachable = False

    def __init__(self, bytes_per_s: float, announce: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.bytes_per_s = bytes_per_s
        self.announce = announce
        self.announced = False

    def open(self, path, mode="rb", **kwargs):
        if "w" not in mode:
            return super().open(path, mode, **kwargs)
        if not self.announced:
            print(self.announce, flush=True)
            self.announced = True
        return _ThrottledFile(self._strip_protocol(path), mode, self.bytes_per_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--url", required=True)
    p.add_argument("--steps", required=True, help="comma-separated steps to save, in order")
    p.add_argument("--writer-id", required=True)
    p.add_argument("--size-kb", type=int, default=64)
    p.add_argument("--keep", type=int, default=3)
    p.add_argument("--slow-from-step", type=int, default=None)
    p.add_argument("--slow-bytes-per-s", type=float, default=1e6)
    p.add_argument("--go-file", default=None, help="wait until this file exists before the first save")
    p.add_argument("--etcd", default=None, help="fence the commits with a RoundFence on this etcd")
    p.add_argument("--prefix", default=None)
    p.add_argument("--round", type=int, default=None)
    p.add_argument("--stop-after-fence-at", type=int, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    fence = None
    if args.etcd:
        fence = StallingFence(args.round, args.prefix, args.etcd, retry_timeout=5)
        fence.stop_at_step = args.stop_after_fence_at
    mgr = CheckpointManager(args.url, keep_checkpoints=args.keep, async_checkpoint=False, writer_id=args.writer_id,
                            retry_backoff_s=0.05, fence=fence)
    if args.go_file:
        print("ready", flush=True)  # imported and connected: the test makes the go file once all are
    while args.go_file and not os.path.exists(args.go_file):
        time.sleep(0.01)
    fill = float(sum(map(ord, args.writer_id)))
    numel = args.size_kb * 1024 // 4
    for step in (int(s) for s in args.steps.split(",")):
        if args.slow_from_step is not None and step >= args.slow_from_step:
            mgr.fs = ThrottledLocalFileSystem(args.slow_bytes_per_s, f"uploading {step}")
        state = {"model": {"w": torch.full((numel,), fill), "b": torch.arange(step, dtype=torch.float32)},
                 "optimizer": {"state": {0: {"step": torch.tensor(float(step))}}, "param_groups": [{"lr": 0.1}]},
                 "step": step, "writer": args.writer_id}
        if fence is not None:
            fence.step = step
        mgr.save(step, state, blocking=True)
        print(f"{'committed' if mgr.last_save_stats.get('committed') else 'not-committed'} {step}", flush=True)
    mgr.close()
    if fence is not None:
        fence.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
