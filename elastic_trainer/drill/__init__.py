"""Kill-node drills: ``elastic-train drill`` (or ``python -m elastic_trainer.drill``).

Modules, in the order a drill uses them:

- ``command``: the command (``main``) and ``Drill``, which runs the parts below;
- ``scenario``: the fault grammar (``--FAULT [TARGET]@WHEN[,for:SECONDS]``), flags, scenario files;
- ``kinds``: the fault kinds, one registry entry each (help, target rule, duration, fire, heal);
- ``cluster``: the drill's etcd, network, checkpoint folder and simulated nodes;
- ``nodes``: one simulated node (an ``elastic-train`` process group) and its processes;
- ``netns``: network namespaces and veth pairs, for faults that cut a node off (root only);
- ``faults``: firing a fault, healing it, and when the run counts as recovered;
- ``logs``: reading what the nodes logged (agent logs; step logs and events as ``elastic_trainer.records``);
- ``ledger``: the exactly-once check of every sample, and one world at a time;
- ``report``: the measurements, ``report.json``, the summary table and the timeline picture.

Exports ``main``. Catalogue and numbers: docs/drills.md.
"""

from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Run a drill from command-line flags (see ``command.main``)."""
    from elastic_trainer.drill.command import main as run

    return run(argv)
