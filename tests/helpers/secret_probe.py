"""A worker script that reports what a secret could leak through, for the security tests.

    elastic-train ... tests/helpers/secret_probe.py       # with PROBE_OUT=<folder> in the environment

Each worker writes ``<PROBE_OUT>/rank<RANK>.json``: its own environment, the command line of every
process of the job (the launcher and agent, the workers, an embedded etcd: the descendants of
the test's child, whose pid is ``PROBE_TEST_PID``), and
whether its round fence could reach etcd with the credentials it was handed; rank 0 saves a tiny
checkpoint into the run's checkpoint dir, committed through the fence (the commit record in etcd),
and with ``PROBE_WANDB=1`` starts a W&B run (offline, with the key file the launcher handed over,
the checkpoint URL in its config) that stays open while it waits; then each waits until
``<PROBE_OUT>/stop`` exists (at most 120 s), so that a test can look at the running job.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def _parents() -> dict[int, int]:
    parents = {}
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                parents[int(proc.name)] = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError, IndexError):
                continue  # ended meanwhile
    return parents


def job_cmdlines(test_pid: int) -> list[str]:
    """The command lines of every process of the job: the descendants of the test's child (the
    launcher, and so the agent, the workers, an embedded etcd)."""
    parents = _parents()
    top = os.getpid()
    while parents.get(top, 0) not in (test_pid, 0, 1):
        top = parents[top]
    job, changed = {top}, True
    while changed:
        grown = job | {pid for pid, parent in parents.items() if parent in job}
        changed, job = grown != job, grown
    lines = []
    for pid in sorted(job):
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return lines


def main() -> int:
    from elastic_trainer.fence import FencedError
    from elastic_trainer.rendezvous.round_fence import RoundFence

    out = Path(os.environ["PROBE_OUT"])
    fence, fence_error = RoundFence.from_env(), None
    try:
        if fence is None:
            fence_error = "no fence in the environment"
        else:
            fence.check()
    except FencedError as exc:
        fence_error = str(exc)
    report = {"environ": dict(os.environ), "proc_environ": Path("/proc/self/environ").read_bytes().decode(errors="replace"),
              "cmdlines": job_cmdlines(int(os.environ["PROBE_TEST_PID"])), "fence_error": fence_error}
    url = os.environ.get("ELASTIC_TRAINER_CHECKPOINT_DIR")
    if os.environ["RANK"] == "0" and url:
        import torch

        from elastic_trainer.checkpoint import CheckpointManager
        CheckpointManager(url, async_checkpoint=False, fence=fence).save(1, {"w": torch.zeros(2)}, blocking=True)
    wandb_run = None
    if os.environ["RANK"] == "0" and os.environ.get("PROBE_WANDB"):
        from elastic_trainer.training import metrics
        wandb_run = metrics.init_wandb(enabled=True, run_id=f"probe{os.getpid()}", project="probe",
                                       log_dir=os.environ["ELASTIC_TRAINER_LOG_DIR"], config={"checkpoint_dir": url})
        wandb_run.log({"global_step": 1, "loss": 1.0})
    tmp = out / f".rank{os.environ['RANK']}.json"
    tmp.write_text(json.dumps(report))
    tmp.rename(out / f"rank{os.environ['RANK']}.json")
    deadline = time.monotonic() + 120
    while not (out / "stop").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    if wandb_run is not None:
        wandb_run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
