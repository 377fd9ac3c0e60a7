"""The worker entry that torchrun runs: flags -> ``TrainConfig`` -> ``Trainer(...).train()``.

Run it::

    # one process, the built-in Transformer example, 50 steps, checkpoints in ./ckpt:
    python -m elastic_trainer.train --max-steps 50 --checkpoint-dir ckpt --checkpoint-every 10 --no-wandb

    # two workers with torchrun (or `elastic-train --nproc-per-node 2 -- <these flags>`):
    torchrun --standalone --nproc-per-node 2 -m elastic_trainer.train --max-steps 50 --checkpoint-dir ckpt

    # your own task (see elastic_trainer/tasks.py); unknown flags are passed to it as args.task_argv:
    python -m elastic_trainer.train --task my_pkg.my_task:build --epochs 3 --my-flag 7

The process sets PR_SET_PDEATHSIG(SIGKILL) first thing, so it dies with the agent that started it.
After a clean finish it leaves with ``os._exit`` (``exit_without_teardown``): gloo's teardown at
interpreter exit could abort a worker whose run succeeded.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import os
import signal
import sys
from typing import NoReturn

from elastic_trainer import config as cfgmod

PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (the torchrun agent) dies."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _optional_int(text: str) -> int | None:
    return None if text.lower() in ("none", "") else int(text)


def build_parser():
    """The trainer's flags (the example task's flags are added by ``elastic_trainer.tasks``)."""
    from elastic_trainer.tasks import add_example_arguments

    p = argparse.ArgumentParser(prog="python -m elastic_trainer.train", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    g.add_argument("--task", default=None, metavar="MODULE:FN",
                   help="task builder, package.module:build or file.py:build (default: the built-in Transformer example)")
    g.add_argument("--global-batch-size", type=int, default=32, help="samples per optimizer step over all ranks (default 32)")
    g.add_argument("--micro-batch-size", type=_optional_int, default=None,
                   help="most samples per forward/backward on a rank; more means gradient accumulation (default: whole share)")
    g.add_argument("--max-steps", type=int, default=None, help="total optimizer steps across restarts")
    g.add_argument("--epochs", type=int, default=None, help="epochs to train (default 1 when --max-steps is not given)")
    g.add_argument("--max-seconds", type=float, default=None, help="stop with a checkpoint after this many seconds")
    g.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default 1e-3)")
    g.add_argument("--scale-lr", action="store_true",
                   help="linear rule: --global-batch-size is per rank and the LR is multiplied by the world size")
    g.add_argument("--clip-grad-norm", type=float, default=None, help="clip the gradient norm to this value")
    g.add_argument("--seed", type=int, default=0, help="seed of the model init, the RNGs and the data order (default 0)")
    c = p.add_argument_group("checkpoints and resume")
    c.add_argument("--checkpoint-dir", default=os.environ.get(cfgmod.ENV_CHECKPOINT_DIR) or None, metavar="URL",
                   help=f"fsspec URL (path, memory://, s3://...) (default env {cfgmod.ENV_CHECKPOINT_DIR}; none = no checkpoints)")
    c.add_argument("--checkpoint-every", type=int, default=None, metavar="N", help="save every N steps")
    c.add_argument("--checkpoint-every-seconds", type=float, default=None, metavar="T", help="save every T seconds")
    c.add_argument("--keep-checkpoints", type=int, default=3, metavar="K", help="committed checkpoints kept (default 3)")
    c.add_argument("--sync-checkpoint", dest="async_checkpoint", action="store_false",
                   help="serialize and upload inside the step instead of in the background")
    c.add_argument("--no-resume", dest="resume", action="store_false", help="start from scratch even if checkpoints exist")
    c.add_argument("--grace-seconds", type=float, default=20.0,
                   help="after SIGTERM, save at the next step and exit within this many seconds (default 20)")
    o = p.add_argument_group("logs")
    o.add_argument("--log-dir", default=os.environ.get(cfgmod.ENV_LOG_DIR) or "runs/local",
                   help=f"step log, events, ledger, traces, offline W&B (default env {cfgmod.ENV_LOG_DIR} or runs/local)")
    o.add_argument("--step-log", dest="step_log", action="store_true", default=True,
                   help="one JSON line per step per rank in <log-dir>/steps (on by default)")
    o.add_argument("--no-step-log", dest="step_log", action="store_false", help="do not write the step log")
    o.add_argument("--sample-ledger", action="store_true", help="record the dataset indices of every step in <log-dir>/ledger")
    o.add_argument("--no-wandb", dest="wandb", action="store_false", help="do not log to W&B")
    o.add_argument("--wandb-project", default="elastic-trainer", help="W&B project (default elastic-trainer)")
    o.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    e = p.add_argument_group("execution")
    e.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    e.add_argument("--fsdp", action="store_true", help="FSDP (fully_shard) instead of DDP")
    e.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP gradient bucket size in MiB (default 25)")
    e.add_argument("--amp", action="store_true", help="bf16 autocast on CPU, fp16 autocast + GradScaler on CUDA")
    e.add_argument("--compile", action="store_true", help="torch.compile the model")
    e.add_argument("--profile", action="store_true", help="torch.profiler trace per rank into <log-dir>/profile")
    e.add_argument("--profile-wait", type=int, default=1, help="profiler schedule: steps skipped (default 1)")
    e.add_argument("--profile-warmup", type=int, default=1, help="profiler schedule: warm-up steps (default 1)")
    e.add_argument("--profile-active", type=int, default=3, help="profiler schedule: steps recorded (default 3)")
    e.add_argument("--num-workers", type=int, default=0, help="DataLoader workers per rank (default 0)")
    e.add_argument("--sleep-per-step", type=float, default=0.0, help="testing/drills: sleep this long in every step")
    e.add_argument("--collective-timeout", type=float, default=300.0, help="process group timeout in seconds (default 300)")
    add_example_arguments(p)
    return p


def parse_config(argv: list[str] | None = None):
    """Parse flags into a ``TrainConfig`` (unknown flags go to the task as ``args.task_argv``)."""
    from elastic_trainer.config import TrainConfig

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.task is None and unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    args.task_argv = unknown
    fields = {name for name in TrainConfig.__dataclass_fields__ if name != "task_args"}
    try:
        return TrainConfig(**{k: v for k, v in vars(args).items() if k in fields}, task_args=args)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train, return the exit status (0 also after a SIGTERM that was handled)."""
    die_with_parent()
    rank = os.environ.get("RANK", "0")
    logging.basicConfig(level=os.environ.get("ELASTIC_TRAINER_LOG_LEVEL", "INFO"),
                        format=f"[%(asctime)s] rank{rank} %(levelname)s %(name)s: %(message)s")
    config = parse_config(argv)
    from elastic_trainer.training.trainer import EXIT_PEER_STOPPED, PEER_STOPPED, Trainer

    from elastic_trainer.training.live import EXIT_EXCLUDED, LiveExcluded, RunFinished

    try:
        summary = Trainer(config).train()
    except RunFinished:  # a spare that was never needed: the run is done
        return 0
    except LiveExcluded:  # left out of the live group: the agent starts this worker again as a newcomer
        return EXIT_EXCLUDED
    if summary["stopped_by"] == PEER_STOPPED:
        # Only the preempted node's workers end for good; ours go on at the next round.
        logging.getLogger("elastic_trainer.train").warning(
            "another node was preempted; step %d is saved; exiting %d so that torchrun restarts this worker "
            "into a round without it", summary["step"], EXIT_PEER_STOPPED)
        return EXIT_PEER_STOPPED
    return 0


def exit_without_teardown(code: int) -> NoReturn:
    """End this worker now with ``code``, after flushing its output, skipping the exit-time
    teardown of the interpreter and of C++ statics.

    Call it when everything is closed: the trainer has saved, closed its logs and the checkpoint
    manager, and left the process group. What is left to tear down at exit is torch's: the
    process group's C++ objects, still referenced by the model (DDP, FSDP), die during
    interpreter finalization, and there gloo can abort a worker whose run succeeded
    ("terminate called without an active exception", SIGABRT; seen once in the CI of two
    sessions, on rank 1 right after a clean finish), which torchrun reports as a failed job.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":  # python -m elastic_trainer.train
    exit_without_teardown(main())
