"""The ``etcd-v3`` rendezvous backend for torchrun.

Registered under the entry-point group ``torchrun.handlers`` as ``etcd-v3``, so that
``elastic-train`` (by default) and plain torchrun use it once the package is installed:

    torchrun --rdzv-backend etcd-v3 --rdzv-endpoint 127.0.0.1:2379 --nnodes 1:4 train.py

Modules: ``handler`` (torch's dynamic rendezvous with leases and a membership
watchdog), ``options`` (``--rdzv-conf``), ``lease`` (a node's etcd lease), ``node_lease`` (that
lease shared with the node's workers under live recovery), ``etcd_backend`` (state key,
compare-and-swap), ``state`` (JSON state, lease-based liveness), ``etcd_store`` (torch Store on
etcd), ``fence`` (round fence for workers). The handler's live mode starts workers that join the
live quorum (``elastic_trainer/live/``). Options and measured numbers: docs/rendezvous.md.

Exports ``handler_creator`` (torchrun's entry point; this package is imported by torch's own
rendezvous registry, so it stays light).
"""

from __future__ import annotations

from collections.abc import Callable


def handler_creator() -> Callable:
    """Entry point of the ``torchrun.handlers`` group: returns ``create(params) -> handler``.

    torch calls this while it imports its own rendezvous package, so the handler module
    (which imports that package) is imported only when a handler is created.
    """
    def create(params):
        from elastic_trainer.rendezvous.handler import create_handler

        return create_handler(params)

    return create


__all__ = ["handler_creator"]
