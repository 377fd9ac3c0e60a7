"""What the launcher, the agents and the workers tell each other through the environment, and
how a worker's process ends: every variable name and every exit code is defined here, once.

Names: the launcher (``elastic-train``) sets ``ENV_RDZV_ENDPOINT``, ``ENV_RUN_ID``,
``ENV_CHECKPOINT_DIR``, ``ENV_LOG_DIR`` for the trainer's flag defaults; the etcd-v3 handler
(``rendezvous/handler.py``) sets the ``ENV_RDZV_*`` of its round and, in live mode, ``ENV_LIVE``
(the live quorum's settings) in the agent's environment, which torchrun passes to the workers.

Exit codes of a worker (what its agent, torchrun, and the drills read):

======================  =====  ==========================================================
``EXIT_OK``             0      finished, stopped at ``--max-seconds``, or a spare not needed
``EXIT_ERROR``          1      an error (a traceback says which); torchrun restarts the worker
``EXIT_USAGE``          2      bad flags or a device the node cannot run: one line, no restart helps
``EXIT_PEER_STOPPED``   75     another node was preempted; step saved; restart into a new round
``EXIT_EXCLUDED``       76     left out of the live quorum; the agent restarts it as a newcomer
``EXIT_PREEMPTED``      143    128 + SIGTERM: this worker was stopped by a signal
======================  =====  ==========================================================
"""

from __future__ import annotations

import signal

# ---- environment variables ------------------------------------------------------------------
ENV_RDZV_ENDPOINT = "ELASTIC_TRAINER_RDZV_ENDPOINT"
ENV_RUN_ID = "ELASTIC_TRAINER_RUN_ID"
ENV_CHECKPOINT_DIR = "ELASTIC_TRAINER_CHECKPOINT_DIR"
ENV_LOG_DIR = "ELASTIC_TRAINER_LOG_DIR"
ENV_RDZV_PREFIX = "ELASTIC_TRAINER_RDZV_PREFIX"
ENV_RDZV_ROUND = "ELASTIC_TRAINER_RDZV_ROUND"
"""Set by the etcd-v3 rendezvous handler in the agent after each round, inherited by workers."""
ENV_RDZV_NODE = "ELASTIC_TRAINER_RDZV_NODE"
ENV_RDZV_CONN = "ELASTIC_TRAINER_RDZV_CONN"
ENV_RDZV_PASSWORD = "ELASTIC_TRAINER_RDZV_PASSWORD"
ENV_LIVE = "ELASTIC_TRAINER_LIVE"
"""Set by the etcd-v3 handler in live mode: JSON of the live quorum's settings."""
ENV_WANDB_KEY_FILE = "ELASTIC_TRAINER_WANDB_KEY_FILE"

# ---- exit codes -------------------------------------------------------------------------------
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_PEER_STOPPED = 75
"""EX_TEMPFAIL: not an error of this worker; torchrun restarts it into a round without the
preempted node."""
EXIT_EXCLUDED = 76
"""A worker left out of the quorum exits with this; its agent restarts it as a newcomer."""
EXIT_PREEMPTED = 128 + int(signal.SIGTERM)
"""The usual exit code after a SIGTERM: W&B's "not a success"."""

# ---- torch's variables that we set --------------------------------------------------------------
ENV_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""How an NCCL process group handles an error or a timeout; torchrun's agent sets ``1`` (end the
process) for its workers when its own environment lacks it."""
NCCL_CLEAN_UP_ONLY = "2"
"""``ENV_NCCL_ERROR_HANDLING``'s value for the live path: abort the communicators and raise the
error on the training thread, keeping the process. ``elastic-train`` sets it in live mode."""
