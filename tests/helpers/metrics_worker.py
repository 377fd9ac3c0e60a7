"""A separate process that records metrics through ``elastic_trainer.observability.metrics``, as a
worker does (the folder comes from the environment its parent gives it)::

    python -m tests.helpers.metrics_worker '[["world", 4, 2], ["step_done", 0.1, 32]]' stay

Each entry is a function of the metrics module and its arguments, called in order. Then it prints
``recorded <pid>`` and either exits (``exit``) or stays until its standard input is closed (``stay``).
"""

from __future__ import annotations

import json
import os
import sys

from elastic_trainer.observability import metrics


def main() -> None:
    calls, then = json.loads(sys.argv[1]), sys.argv[2]
    for name, *args in calls:
        getattr(metrics, name)(*args)
    print(f"recorded {os.getpid()}", flush=True)
    if then == "stay":
        sys.stdin.read()


if __name__ == "__main__":
    main()
