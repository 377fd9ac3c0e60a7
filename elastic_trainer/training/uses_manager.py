"""Whether a training script uses the Manager: what decides the recovery mode it runs under.

``elastic-train`` runs a script that uses ``elastic_trainer.Manager`` under live recovery by
default (the survivors keep their processes), and any other script under torchrun's restarts. The
question is answered from the script's text, before any worker starts: an import of the Manager
(from ``elastic_trainer``, ``elastic_trainer.training`` or ``elastic_trainer.training.manager``) or
the name ``elastic_trainer.Manager``; a mere mention in a comment does not count. Called by the
launcher (``cli/launch.py``).
"""

from __future__ import annotations

import re

_USES_MANAGER = re.compile(
    r"^\s*from\s+elastic_trainer(?:\.training(?:\.manager)?)?\s+import\s+(?:\([^)]*|[^\n]*)\bManager\b"
    r"|\belastic_trainer\.(?:training\.(?:manager\.)?)?Manager\b", re.MULTILINE)


def script_uses_manager(script: str, module: bool = False) -> bool:
    """Whether the training script (a path, or a module name with ``module``) uses this Manager:
    its text imports it (``from elastic_trainer import Manager``, or from ``elastic_trainer.training``
    or ``.training.manager``) or names ``elastic_trainer.Manager``. ``elastic-train`` runs such a script under
    live recovery by default and any other under restart: a script that ignores the Manager would,
    under live recovery, get from torchrun a process group of its own node only (each node
    training alone), so it must not run there."""
    import importlib.util

    path: str | None = script
    if module:
        try:
            spec = importlib.util.find_spec(script)
        except (ImportError, ValueError):
            spec = None
        path = spec.origin if spec is not None else None
    if not path:
        return False
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    return _USES_MANAGER.search(text) is not None


__all__ = ["script_uses_manager"]
