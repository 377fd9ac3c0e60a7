"""``elastic-train``: run one node of an elastic training job on torchrun's elastic agent, and the
commands around it.

Examples::

    # One machine, embedded etcd, the built-in example task, 1 to 4 nodes of 2 workers:
    elastic-train --min-nodes 1 --max-nodes 4 --nproc-per-node 2

    # Flags for the built-in trainer come after `--`:
    elastic-train --nnodes 1:2 --nproc-per-node 2 -- --max-steps 200 --checkpoint-every 20

    # A second node joins the same run (the first one prints its endpoint):
    elastic-train --nnodes 1:4 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:PORT

    # Your own script, torchrun style:
    elastic-train --nnodes 2:4 --rdzv-endpoint etcd:2379 my_train.py --lr 3e-4

    # A standalone etcd for several machines, TLS with client certificates (docs/security.md):
    elastic-train etcd certs --out etcd-tls --host 10.0.0.5      # prints the flags each side needs
    elastic-train etcd --host 0.0.0.0 --port 2379 --data-dir /var/lib/elastic-etcd --tls-dir etcd-tls

    # What a running job is doing (nodes, round, step, loss, checkpoint, events):
    elastic-train status --watch

    # Kill-node recovery drills (see docs/drills.md):
    elastic-train drill --help

    # A checkpoint's model weights as safetensors, and a new run from them:
    elastic-train export checkpoints/elastic-run --to model.safetensors
    elastic-train --nnodes 1:4 -- --init-from model.safetensors

One module per command, each with its own ``main(argv)``:

- ``launch``: a node of a job (flags -> ``RunConfig`` -> torch's ``elastic_launch``);
- ``secrets``: keeps credentials off command lines and out of the workers' environment;
- ``etcd``: ``elastic-train etcd`` and ``elastic-train etcd certs``;
- ``status``: ``elastic-train status``, which reads what rank 0 publishes (``training/status.py``);
- ``export``: ``elastic-train export``, over ``checkpoint/weights.py``;
- ``usage``: ``UsageError``, the one-line error every command reports bad input with.

:func:`main` parses ``argv`` and dispatches (tests call it with a list of strings, as torchx's do).
Workers never import this package: what they share with the commands (status publishing, weight
files) are libraries of their own.
"""

from __future__ import annotations

import logging
import os
import sys

from elastic_trainer.cli.usage import UsageError
from elastic_trainer.env import ENV_LOG_LEVEL, EXIT_USAGE

__all__ = ["UsageError", "main"]


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run: a node of a job, ``etcd``, ``status``, ``export`` or ``drill``. Return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=os.environ.get(ENV_LOG_LEVEL, "INFO"),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    command, rest = (argv[0], argv[1:]) if argv[:1] in (["etcd"], ["export"], ["status"], ["drill"]) else (None, argv)
    try:
        if command == "etcd":
            from elastic_trainer.cli import etcd
            return etcd.main(rest)
        if command == "export":
            from elastic_trainer.cli import export
            return export.main(rest)
        if command == "status":
            from elastic_trainer.cli import status
            return status.main(rest)
        if command == "drill":
            from elastic_trainer.drill import command as drill
            return drill.main(rest)
        from elastic_trainer.cli import launch
        return launch.main(rest)
    except UsageError as exc:
        print(f"elastic-train: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
