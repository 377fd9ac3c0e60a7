"""The run's Prometheus metrics: what each node's ``elastic-train`` serves at ``/metrics``, and the
small API through which the workers and the launcher record them.

Who records and who serves. A node is one launcher process (``elastic-train``: torchrun's agent)
and its workers, separate processes that the agent restarts. The launcher serves
(``metrics_server.serve``): it makes a fresh folder, names it in ``ENV_METRICS_DIR`` (prometheus_client's
``PROMETHEUS_MULTIPROC_DIR``), which the workers inherit, and answers each scrape by merging the
files in it. Every process that records (a worker, the launcher itself) writes its figures into
that folder through prometheus_client's multiprocess mode: one memory-mapped file per process and
metric type (``counter_<pid>.db``, ...), so recording a step is a few writes to memory (about
10 us), with no lock between processes, no socket and no etcd traffic. A worker never serves.

The functions below are the whole API; each is a no-op when ``ENV_METRICS_DIR`` is not set in the
process (metrics off: ``--metrics-port 0``, plain torchrun, a test), so the caller never asks::

    from elastic_trainer.observability import metrics

    metrics.world(ranks=8, nodes=2)                  # every worker: at start and after each re-form
    metrics.step_done(seconds=0.21, samples=256)     # global rank 0: each step
    metrics.recovered("kill", seconds=0.4)           # global rank 0: after a re-form or a resume
    metrics.checkpoint_committed(blocked_seconds=0.012)   # global rank 0: at each commit
    metrics.checkpoint_loaded(committed_at=1.7e9)    # global rank 0: after resuming from a checkpoint
    metrics.etcd_request("txn", seconds=0.003)       # whoever timed an etcd request
    metrics.lease_renewed(lag_seconds=0.02)          # whoever keeps the node's lease
    metrics.straggler_score(1.02)                    # each rank, its own (stragglers.py)

The metrics (names follow Prometheus' conventions: a ``elastic_trainer_`` prefix, base units in
the name, ``_total`` for counters, a timestamp rather than an age, which PromQL computes):

==================================================  =========  ===========================================
``elastic_trainer_world_size``                      gauge      ranks in the current group
``elastic_trainer_world_nodes``                     gauge      nodes in the current group
``elastic_trainer_min_nodes``                       gauge      ``--min-nodes`` (the launcher's)
``elastic_trainer_started_timestamp_seconds``       gauge      when this node's launcher started
``elastic_trainer_steps_total``                     counter    optimizer steps (rank 0's)
``elastic_trainer_samples_total``                   counter    samples trained on (the global batch per step)
``elastic_trainer_step_seconds``                    histogram  step period (rank 0's, all ranks wait alike)
``elastic_trainer_recoveries_total{kind}``          counter    recoveries by ``RECOVERY_KINDS``
``elastic_trainer_recovery_seconds{kind}``          histogram  how long each took
``elastic_trainer_checkpoint_last_commit_timestamp_seconds``  gauge  the newest committed checkpoint
``elastic_trainer_checkpoint_last_blocked_seconds``           gauge  the training time the last save took
``elastic_trainer_checkpoint_blocked_seconds``      histogram  the same, every save
``elastic_trainer_etcd_request_seconds{op}``        histogram  etcd requests' latency by ``ETCD_OPS``
``elastic_trainer_lease_renewal_lag_seconds``       histogram  how late a lease renewal was confirmed
``elastic_trainer_straggler_score``                 gauge      a rank's own step time / its peers' median
``elastic_trainer_health_check_failures_total{check}``  counter  failed checks before a join (health.py)
==================================================  =========  ===========================================

How a gauge merges over a node's processes is its prometheus_client "multiprocess mode": the world
gauges are ``livemostrecent`` (the newest value of a live process: every worker knows the world
after a re-form), the checkpoint's ``max``/``mostrecent`` (a commit stays committed after its
writer dies), the straggler score ``liveall`` (one series per live worker, labelled ``pid``). The
``live`` ones forget a worker once it is dead (``metrics_server`` calls ``mark_process_dead`` for it
at the next scrape); counters and histograms keep a dead worker's figures, so they never go back.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from elastic_trainer.env import ENV_METRICS_DIR

logger = logging.getLogger(__name__)

PREFIX = "elastic_trainer_"

RECOVERY_KINDS = ("kill", "freeze", "hang", "join", "preemption", "straggler", "restart")
"""The ``kind`` label of the recovery metrics:

- ``kill``: a member's processes died (its lease was revoked, or its collective failed at once);
- ``freeze``: a member stopped answering (a frozen process, a cut network): dropped when its lease expired;
- ``hang``: the ranks agreed that a member's step hung (the hang bound), and excluded it;
- ``join``: a node joined a training group (a planned re-form);
- ``preemption``: a member was stopped by SIGTERM, saved and left;
- ``straggler``: a slow member was evicted (``stragglers.py``);
- ``restart``: the restart path: every worker restarted from the newest checkpoint."""

ETCD_OPS = ("get", "put", "txn", "delete", "lease_grant", "lease_revoke", "watch", "other")
"""The ``op`` label of ``elastic_trainer_etcd_request_seconds``; anything else is recorded as ``other``."""

HEALTH_CHECKS = ("storage", "etcd", "device", "nvml")
"""The ``check`` label of ``elastic_trainer_health_check_failures_total`` (``health.py``'s checks)."""

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
"""Seconds: a small model's step on a CPU (10 ms) to a large one's on many GPUs (tens of s)."""
RECOVERY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds: a live re-form (0.1-1 s) to a restart from a checkpoint on GPUs (minutes)."""
BLOCKED_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
"""Seconds a save holds training: an async snapshot (ms) to a synchronous write (s)."""
ETCD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds: etcd on loopback answers in under a ms, a loaded cluster in tens of ms; 10 s is its read timeout."""
LAG_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0)
"""Seconds late: the node lease lives 3 s by default, renewed every 1 s; past 2 s it is at risk."""


@dataclass(frozen=True)
class Spec:
    """One metric: its name (without ``PREFIX``), Prometheus type, help, labels, and for a gauge how
    it merges over the node's processes (``mode``), for a histogram its buckets."""

    name: str
    type: str
    doc: str
    labels: tuple[str, ...] = ()
    mode: str = ""
    buckets: tuple[float, ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    def series(self) -> set[str]:
        """The names its samples carry in the exposition (what PromQL selects)."""
        suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}[self.type]
        return {self.full_name + suffix for suffix in suffixes}


SPECS = (
    Spec("world_size", "gauge", "Ranks in the current training group.", mode="livemostrecent"),
    Spec("world_nodes", "gauge", "Nodes in the current training group.", mode="livemostrecent"),
    Spec("min_nodes", "gauge", "The run's --min-nodes, as this node's launcher was given it.", mode="livemax"),
    Spec("started_timestamp_seconds", "gauge", "Unix time this node's launcher started.", mode="livemin"),
    Spec("steps", "counter", "Optimizer steps completed (recorded by global rank 0)."),
    Spec("samples", "counter", "Samples trained on: the global batch of each step (global rank 0)."),
    Spec("step_seconds", "histogram", "Period of a training step (global rank 0).", buckets=STEP_BUCKETS),
    Spec("recoveries", "counter", "Recoveries of the training group, by kind.", ("kind",)),
    Spec("recovery_seconds", "histogram", "Seconds from a fault to training again, by kind.", ("kind",),
         buckets=RECOVERY_BUCKETS),
    Spec("checkpoint_last_commit_timestamp_seconds", "gauge", "Unix time the newest checkpoint was committed.",
         mode="max"),
    Spec("checkpoint_last_blocked_seconds", "gauge", "Seconds the last checkpoint save held training.",
         mode="mostrecent"),
    Spec("checkpoint_blocked_seconds", "histogram", "Seconds each checkpoint save held training.",
         buckets=BLOCKED_BUCKETS),
    Spec("etcd_request_seconds", "histogram", "Latency of etcd requests, by operation.", ("op",),
         buckets=ETCD_BUCKETS),
    Spec("lease_renewal_lag_seconds", "histogram", "How late after its due time etcd confirmed a lease renewal.",
         buckets=LAG_BUCKETS),
    Spec("straggler_score", "gauge", "This rank's own step time over the median of its peers' (1: as fast as "
         "they are; 5: five times slower).", mode="liveall"),
    Spec("health_check_failures", "counter", "Failed checks before a node joins, by check.", ("check",)),
)
"""Every metric, once: the objects are made from these, and the dashboard's and alerts' queries are
checked against ``series_names()``."""


def series_names() -> set[str]:
    """Every series name the metrics show (a counter ``x`` as ``x_total``, a histogram as ``x_bucket``,
    ``x_sum`` and ``x_count``): what a dashboard or an alert may select."""
    return set().union(*(spec.series() for spec in SPECS))


def _make(spec: Spec) -> Any:
    """The prometheus_client object of ``spec``, registered nowhere: in multiprocess mode its values go
    to the files whatever the registry, and a user's metric of the same name cannot collide with it."""
    import prometheus_client

    if spec.type == "gauge":
        return prometheus_client.Gauge(spec.full_name, spec.doc, spec.labels, registry=None,
                                       multiprocess_mode=spec.mode)
    if spec.type == "histogram":
        return prometheus_client.Histogram(spec.full_name, spec.doc, spec.labels, registry=None, buckets=spec.buckets)
    return prometheus_client.Counter(spec.full_name, spec.doc, spec.labels, registry=None)


_lock = threading.Lock()
_made: dict[str, Any] | None = None
_refused = False  # prometheus_client was imported here before ENV_METRICS_DIR was set: say so once


def enabled() -> bool:
    """Whether this process records: ``ENV_METRICS_DIR`` names the node's folder."""
    return bool(os.environ.get(ENV_METRICS_DIR))


def _metrics() -> dict[str, Any] | None:
    """This process's metrics, made on first use; None when metrics are off here."""
    global _made, _refused
    if _made is not None:
        return _made
    if not enabled() or _refused:
        return None
    with _lock:
        if _made is None and not _refused:
            import prometheus_client.values as values

            if values.ValueClass is values.MutexValue:
                # Chosen when prometheus_client was first imported, before the variable was set:
                # figures would stay in this process's memory, which nobody scrapes.
                _refused = True
                logger.warning("prometheus_client was imported in this process before %s was set, so its figures "
                               "cannot reach the node's /metrics; set the variable before importing it (process %d "
                               "records nothing)", ENV_METRICS_DIR, os.getpid())
                return None
            _made = {spec.name: _make(spec) for spec in SPECS}
    return _made


def _check(value: str, allowed: tuple[str, ...], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{value!r} is not a {what} the metrics know; use one of {', '.join(allowed)}")
    return value


# ---- what a worker records ---------------------------------------------------------------------------
def world(ranks: int, nodes: int) -> None:
    """The current group: ``ranks`` and ``nodes`` (every worker, at start and after each re-form)."""
    if (m := _metrics()) is not None:
        m["world_size"].set(ranks)
        m["world_nodes"].set(nodes)


def step_done(seconds: float, samples: int) -> None:
    """One optimizer step of ``seconds`` (its period) over ``samples`` (the global batch); global rank 0."""
    if (m := _metrics()) is not None:
        m["steps"].inc()
        m["samples"].inc(samples)
        m["step_seconds"].observe(seconds)


def recovered(kind: str, seconds: float) -> None:
    """A recovery of ``kind`` (``RECOVERY_KINDS``) that took ``seconds`` from the fault (or from when it
    was noticed) to training again; recorded once per recovery, by global rank 0 after it."""
    _check(kind, RECOVERY_KINDS, "recovery kind")
    if (m := _metrics()) is not None:
        m["recoveries"].labels(kind).inc()
        m["recovery_seconds"].labels(kind).observe(seconds)


def checkpoint_committed(blocked_seconds: float, when: float | None = None) -> None:
    """A checkpoint was committed at Unix time ``when`` (default: now); its save held training for
    ``blocked_seconds``. Global rank 0, at each commit."""
    if (m := _metrics()) is not None:
        m["checkpoint_last_commit_timestamp_seconds"].set(time.time() if when is None else when)
        m["checkpoint_last_blocked_seconds"].set(blocked_seconds)
        m["checkpoint_blocked_seconds"].observe(blocked_seconds)


def checkpoint_loaded(committed_at: float) -> None:
    """Training resumed from a checkpoint committed at Unix time ``committed_at`` (global rank 0, after
    a resume): a restarted node's endpoint shows how old the newest commit is, not "never"."""
    if (m := _metrics()) is not None:
        m["checkpoint_last_commit_timestamp_seconds"].set(committed_at)


def etcd_request(op: str, seconds: float) -> None:
    """An etcd request (``ETCD_OPS``; another name counts as ``other``) answered in ``seconds``."""
    if (m := _metrics()) is not None:
        m["etcd_request_seconds"].labels(op if op in ETCD_OPS else "other").observe(seconds)


def lease_renewed(lag_seconds: float) -> None:
    """A lease renewal that etcd confirmed ``lag_seconds`` after it was due (0: on time)."""
    if (m := _metrics()) is not None:
        m["lease_renewal_lag_seconds"].observe(max(0.0, lag_seconds))


def straggler_score(score: float) -> None:
    """This rank's straggler score (``stragglers.scores``): its own step time over its peers' median."""
    if (m := _metrics()) is not None:
        m["straggler_score"].set(score)


# ---- what the launcher records ------------------------------------------------------------------------
def node_started(min_nodes: int, when: float | None = None) -> None:
    """This node's launcher started at ``when`` (default: now) for a run of at least ``min_nodes``."""
    if (m := _metrics()) is not None:
        m["min_nodes"].set(min_nodes)
        m["started_timestamp_seconds"].set(time.time() if when is None else when)


def health_check_failed(check: str) -> None:
    """A check before joining (``HEALTH_CHECKS``) failed on this node."""
    _check(check, HEALTH_CHECKS, "health check")
    if (m := _metrics()) is not None:
        m["health_check_failures"].labels(check).inc()


__all__ = ["ETCD_OPS", "HEALTH_CHECKS", "PREFIX", "RECOVERY_KINDS", "SPECS", "Spec", "checkpoint_committed",
           "checkpoint_loaded", "enabled", "etcd_request", "health_check_failed", "lease_renewed", "node_started",
           "recovered", "series_names", "step_done", "straggler_score", "world"]
