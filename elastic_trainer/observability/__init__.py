"""Running a long job as a service: what it tells a monitoring system, and what it does about slow,
broken or crash-looping nodes.

Modules (one idea each; only ``step_clock`` imports torch when imported; none talks to etcd per step):

- ``metrics``: the run's Prometheus metrics (``SPECS``) and the small API that records them
  (``world``, ``step_done``, ``recovered``, ``checkpoint_committed``, ...): a no-op unless the launcher
  serves; each process writes its own files (prometheus_client's multiprocess mode);
- ``metrics_server``: the node's ``/metrics``, served by ``elastic-train`` from those files
  (``serve(MetricsConfig)``), a dead worker's live gauges forgotten at each scrape;
- ``step_clock``: how long a rank's own part of a step takes (data, host work, device compute: the
  step less its wait in the gradient all-reduce), timed by a DDP communication hook, with CUDA events
  on a GPU;
- ``stragglers``: the math: a window of a rank's own times, scores against its peers, and the
  eviction decision (would the job step faster at N-1 nodes than at N with this one?);
- ``health``: the checks before a node joins (storage, etcd, device, NVML), each failure one line;
- ``backoff``: when to try again (health checks, a straggler's hold-out);
- ``crash_loop``: when restarting a node's workers again would not help (``EXIT_CRASH_LOOP``).

Exports nothing at the package level: import the module you use
(``from elastic_trainer.observability import metrics``).
"""

from __future__ import annotations
