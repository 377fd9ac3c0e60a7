"""The launcher's configuration: what ``elastic-train`` was asked to run, validated.

Every field is checked in ``__post_init__``; a bad value raises ``ValueError`` with one
sentence that names the value and says what to change, which the CLI prints as one line.
The trainer's, checkpoint's and sampler's settings live beside their code
(``trainer.TrainConfig``, ``checkpoint.CheckpointConfig``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

# Environment variables through which the launcher tells the workers where things are.
# They are named here, once; the trainer reads them as the defaults of its own flags.
ENV_RDZV_ENDPOINT = "ELASTIC_TRAINER_RDZV_ENDPOINT"
ENV_RUN_ID = "ELASTIC_TRAINER_RUN_ID"
ENV_CHECKPOINT_DIR = "ELASTIC_TRAINER_CHECKPOINT_DIR"
ENV_LOG_DIR = "ELASTIC_TRAINER_LOG_DIR"
ENV_RDZV_PREFIX = "ELASTIC_TRAINER_RDZV_PREFIX"
# Set by the etcd-v3 rendezvous handler in the agent after each round, inherited by workers.
ENV_RDZV_ROUND = "ELASTIC_TRAINER_RDZV_ROUND"

DEFAULT_RUN_ID = "elastic-run"
_RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


@dataclass
class RunConfig:
    """One node's share of an elastic run, as the launcher builds it from flags."""

    min_nodes: int = 1
    """Fewest nodes the job trains on; below it, the survivors wait for nodes to join."""
    max_nodes: int = 1
    """Most nodes admitted to a round; more wait as spares."""
    nproc_per_node: int = 1
    """Worker processes per node (one per GPU on GPU nodes)."""
    rdzv_endpoint: str | None = None
    """etcd ``host:port[,host:port...]``; None starts the embedded etcd for this run."""
    rdzv_backend: str = "etcd-v3"
    """torchrun rendezvous backend; ``etcd-v3`` is ours, ``c10d`` is torch's (for comparisons)."""
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    """Backend options (``--rdzv-conf k=v,k=v``), see the rendezvous docs."""
    run_id: str = DEFAULT_RUN_ID
    """Names the run: nodes with the same run id and endpoint train together."""
    max_restarts: int = 100
    """Worker-group restarts an agent allows after failures (a lost peer counts as one)."""
    monitor_interval: float = 0.1
    """Seconds between the agent's checks of its workers."""
    checkpoint_dir: str | None = None
    """fsspec URL of the checkpoint root; ``checkpoints/<run id>`` when None."""
    log_dir: str | None = None
    """Local folder for the embedded etcd's data and the agents' logs; ``runs/<run id>`` when None."""
    local_addr: str | None = None
    """The address other nodes reach this one at; looked up from the host name when None."""
    program: list[str] = field(default_factory=list)
    """The worker command after the interpreter: ``[script, args...]`` or ``["-m", module, args...]``."""

    def __post_init__(self) -> None:
        for name in ("min_nodes", "max_nodes", "nproc_per_node"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} must be a whole number of at least 1, got {value!r}")
        if self.max_nodes < self.min_nodes:
            raise ValueError(f"--max-nodes ({self.max_nodes}) must be at least --min-nodes "
                             f"({self.min_nodes}); raise --max-nodes or lower --min-nodes")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be 0 or more, got {self.max_restarts}")
        if not self.monitor_interval > 0:
            raise ValueError(f"--monitor-interval must be a positive number of seconds, got {self.monitor_interval}")
        if not _RUN_ID_RE.match(self.run_id):
            raise ValueError(f"--run-id {self.run_id!r} must be 1-128 letters, digits, '.', '_' or '-'")
        if self.checkpoint_dir is None:
            self.checkpoint_dir = os.path.join("checkpoints", self.run_id)
        if self.log_dir is None:
            self.log_dir = os.path.join("runs", self.run_id)

    @property
    def embedded_etcd(self) -> bool:
        """True when this node starts its own etcd (no ``--rdzv-endpoint`` given)."""
        return self.rdzv_endpoint is None and self.rdzv_backend == "etcd-v3"
