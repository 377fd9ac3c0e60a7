"""The worker entry that torchrun runs: flags -> ``TrainConfig`` -> ``Trainer(...).train()``.

Run it::

    # one process, the built-in Transformer example, 50 steps, checkpoints in ./ckpt:
    python -m elastic_trainer.train --max-steps 50 --checkpoint-dir ckpt --checkpoint-every 10 --no-wandb

    # two workers with torchrun (or `elastic-train --nproc-per-node 2 -- <these flags>`):
    torchrun --standalone --nproc-per-node 2 -m elastic_trainer.train --max-steps 50 --checkpoint-dir ckpt

    # your own task (see elastic_trainer/tasks.py); unknown flags are passed to it as args.task_argv:
    python -m elastic_trainer.train --task my_pkg.my_task:build --epochs 3 --my-flag 7

The process sets PR_SET_PDEATHSIG(SIGKILL) first thing, so it dies with the agent that started it.
After a clean finish it leaves through the worker runtime's exit (``runtime.exit_without_teardown``): gloo's
teardown at interpreter exit could abort a worker whose run succeeded (``runtime.py`` says how).
"""

from __future__ import annotations

import logging
import os
import sys

from elastic_trainer.config import TrainConfig
from elastic_trainer.env import ENV_LOG_LEVEL, WorkerEnv
from elastic_trainer.flags import build_train_parser, parse_train_config  # generated from TrainConfig
from elastic_trainer.runtime import die_with_parent, exit_without_teardown


def main(argv: list[str] | None = None) -> int:
    """Parse flags, train, return the exit status (0 also after a SIGTERM that was handled).

    The worker runtime's threads are stopped and joined before it returns (``runtime().close()``)."""
    die_with_parent()
    rank = WorkerEnv.from_environ().rank or 0
    logging.basicConfig(level=os.environ.get(ENV_LOG_LEVEL, "INFO"),
                        format=f"[%(asctime)s] rank{rank} %(levelname)s %(name)s: %(message)s")
    config = parse_train_config(argv, build_train_parser(doc=__doc__))  # this docstring is --help's text
    from elastic_trainer.runtime import runtime
    from elastic_trainer.observability.crash_loop import stop_a_crash_loop

    stop_a_crash_loop()  # this node's workers failed again and again without a step: stop it instead

    code = _train(config)
    runtime().close()
    return code


def _train(config: TrainConfig) -> int:
    """``Trainer(config).train()``, and the exit status that says how it ended."""
    from elastic_trainer.devices import DeviceError
    from elastic_trainer.env import EXIT_EVICTED, EXIT_EXCLUDED, EXIT_PEER_STOPPED, EXIT_USAGE
    from elastic_trainer.live.quorum import LiveExcluded, RunFinished
    from elastic_trainer.runtime import stop_node
    from elastic_trainer.training.straggler_watch import Evicted
    from elastic_trainer.training.preemption import PEER_STOPPED
    from elastic_trainer.training.trainer import Trainer

    from elastic_trainer.observability.crash_loop import failures_marked, mark_failure

    trainer: Trainer | None = None

    def newest() -> int | None:  # the newest committed (or resumed) checkpoint this worker knew of
        return trainer.checkpoints.last_save_step if trainer is not None else None

    try:
        with failures_marked(newest, expected=(DeviceError, RunFinished, LiveExcluded)):
            trainer = Trainer(config)
            summary = trainer.train()
    except DeviceError as exc:  # the node cannot run the --device/--amp asked for: one line, no traceback
        print(f"elastic_trainer.train: error: {exc}", file=sys.stderr, flush=True)
        mark_failure(EXIT_USAGE, str(exc))
        return EXIT_USAGE
    except RunFinished:  # a spare that was never needed: the run is done
        return 0
    except Evicted as exc:  # a straggler's node: its launcher holds it out, checks it, lets it rejoin
        stop_node(str(exc), EXIT_EVICTED)
    except LiveExcluded:  # left out of the live group: the agent starts this worker again as a newcomer
        return EXIT_EXCLUDED
    if summary["stopped_by"] == PEER_STOPPED:
        # Only the preempted node's workers end for good; ours go on at the next round.
        logging.getLogger("elastic_trainer.train").warning(
            "another node was preempted; step %d is saved; exiting %d so that torchrun restarts this worker "
            "into a round without it", summary["step"], EXIT_PEER_STOPPED)
        return EXIT_PEER_STOPPED
    return 0


if __name__ == "__main__":  # python -m elastic_trainer.train
    exit_without_teardown(main())
