"""Trainer runs as the tests start and compare them: the tiny model's flags, the end-to-end
workloads, an uninterrupted baseline, an ``elastic-train`` node, and the checks that a run that
lost and gained nodes ends where the baseline ends.

    from tests.helpers.runs import TINY, latest

    Trainer(parse_config([*TINY, "--global-batch-size", "8", "--checkpoint-dir", ck])).train()
    step, state = latest(ck)

``TINY`` is the model and data every trainer test starts from (a step takes milliseconds: these
tests are about processes and state, not speed); each test adds its own batch and run flags.

The end-to-end tests (``test_train_e2e``, ``test_live_recovery``, ``test_preemption_e2e``) train
``SEEDS_MSE`` when the world size at each step depends on timing (a kill lands between steps
somewhere): the seeds' workload with ``--loss mse``, whose runs stay far within the tolerances
below under any reduction order (``test_train_e2e``'s docstring says why a task that learns does
not). Tolerance: every parameter with a gradient matches the uninterrupted run to within
``PARAM_ATOL``; the attention key biases, whose true gradient is zero, are held to ``LR * steps``
(``param_drift``).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import torch

from elastic_trainer import records
from elastic_trainer.checkpoint import CheckpointManager
from tests.helpers.common import REPO, cli_cmd, wait_until

TINY_MODEL = ["--d-model", "16", "--nhead", "2", "--layers", "1", "--dim-feedforward", "32"]
"""The example Transformer at its smallest: one encoder and one decoder layer, width 16."""
TINY = [*TINY_MODEL, "--src-len", "4", "--tgt-len", "4", "--dataset-size", "256"]
"""``TINY_MODEL`` on 256 sequences of 4 tokens (``--tgt-len`` counts for ``--example seeds`` only)."""

GBS = 12
LR = 1e-3
PARAM_ATOL = 1e-5
SIZES = [*TINY_MODEL, "--dataset-size", "240", "--global-batch-size", str(GBS), "--micro-batch-size", "3",
         "--no-wandb", "--no-progress", "--sample-ledger"]
"""The end-to-end runs' model, data size and batches, with the sample ledger on."""
SEEDS_MSE = [*SIZES, "--example", "seeds", "--src-len", "2", "--tgt-len", "4", "--loss", "mse"]
"""The end-to-end workload whose runs match the baseline whatever the reduction order."""
CONF = "lease_ttl=3,keep_alive_interval=1,last_call_timeout=1"
"""The rendezvous settings (``--rdzv-conf``) of the end-to-end nodes: a lost node is known in seconds."""
FIXTURE = "tests.helpers.task_fixture:build"
"""The user task in ``tests/helpers/task_fixture.py``, as ``--task`` takes it."""


def latest(ckpt_dir: Path) -> tuple[int, dict]:
    """The newest checkpoint in ``ckpt_dir``: ``(step, state)``; fails the test when there is none."""
    found = CheckpointManager(str(ckpt_dir)).load()
    assert found is not None, f"no checkpoint in {ckpt_dir}"
    return found


def param_drift(a: dict, b: dict) -> tuple[float, float]:
    """``(worst, worst_gauge)``: largest |a - b| over parameters, and over the attention key biases.

    The key bias of every attention has zero gradient in exact arithmetic (softmax does not change
    when the same number is added to every score), so its computed gradient is rounding noise that
    Adam normalises to steps of about ``lr``: it differs between reduction orders by up to
    ``lr * steps`` and never changes the model's output. It is reported apart (``worst_gauge``).
    """
    worst = gauge = 0.0
    for name, x in a.items():
        diff = (x.double() - b[name].double()).abs()
        if name.endswith("in_proj_bias"):
            d = diff.numel() // 3
            gauge = max(gauge, diff[d:2 * d].max().item())
            diff = torch.cat([diff[:d], diff[2 * d:]])
        worst = max(worst, diff.max().item())
    return worst, gauge


_BASELINES: dict[tuple, tuple[dict, dict[int, float], dict[int, list[int]]]] = {}


def baseline(tmp_path: Path, steps: int, workload: list[str] = SEEDS_MSE) -> tuple[dict, dict[int, float], dict[int, list[int]]]:
    """An uninterrupted single-process run: (final model, loss per step, indices per step).

    The run is deterministic (one process, fixed seeds, on the CPU), so each ``(steps, workload)``
    runs once per test session and later calls get a copy of its results (``test_live_hsdp``'s two
    shard-all runs compare against the same 50 steps: a start-up of the trainer saved)."""
    key = (steps, tuple(workload))
    if key not in _BASELINES:
        _BASELINES[key] = _uninterrupted(tmp_path, steps, workload)
    return copy.deepcopy(_BASELINES[key])


def _uninterrupted(tmp_path: Path, steps: int, workload: list[str]) -> tuple[dict, dict[int, float], dict[int, list[int]]]:
    ck, logs = tmp_path / "base-ck", tmp_path / "base-logs"
    proc = subprocess.run([sys.executable, "-m", "elastic_trainer.train", *workload, "--max-steps", str(steps),
                           "--checkpoint-dir", str(ck), "--log-dir", str(logs)],
                          cwd=REPO, capture_output=True, text=True, timeout=180,
                          env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {s.step: s.loss for s in records.read_steps(logs)}
    ledger = {r.step: r.indices for r in records.read_ledger(logs)}
    return latest(ck)[1]["model"], losses, ledger


def agent(procs, etcd, run_id: str, nproc: int, ck: Path, logs: Path, *trainer_args: str,
          nnodes: str = "1", out: Path | None = None, recovery: str | None = None,
          workload: list[str] = SEEDS_MSE, conf: str = CONF) -> subprocess.Popen:
    """An ``elastic-train`` node; ``recovery`` is its --recovery (None: the launcher's default)."""
    log = open(out, "a") if out else subprocess.DEVNULL
    extra = ("--recovery", recovery) if recovery else ()
    proc = procs.start(cli_cmd("--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-endpoint", etcd.endpoint,
                               "--run-id", run_id, "--rdzv-conf", conf, *extra, "--checkpoint-dir", str(ck),
                               "--log-dir", str(logs), "--", *workload, *trainer_args),
                       cwd=REPO, stdout=log, stderr=subprocess.STDOUT if out else subprocess.PIPE, text=True)
    if out:
        log.close()
    return proc


def wait_for_steps(what: str, pred, logs: Path, timeout: float, agents: list[subprocess.Popen], outs: list[Path]):
    """The step records under ``logs`` once ``pred`` holds for them; on a timeout the failure shows
    the tails of the agents' logs ``outs``."""
    def agent_logs() -> str:
        tails = {p.name: p.read_text()[-1500:] for p in outs if p.exists()}
        return f"agent logs: {tails}"

    return wait_until(lambda: records.read_steps(logs), timeout, what, until=pred, details=agent_logs)


def final_batches(logs: Path) -> dict[int, list[int]]:
    """Indices of each step over all ranks, from the last rendezvous round that ran the step.

    A step can run more than once (a round ends before its checkpoint, the next round redoes it
    from the last checkpoint); the final lineage is the last round's run of it.
    """
    by_round_step: dict[tuple[int, int], list[int]] = defaultdict(list)
    for rec in records.read_ledger(logs):
        by_round_step[(rec.round, rec.step)] += rec.indices
    last = {}
    for rnd, step in by_round_step:
        last[step] = max(last.get(step, rnd), rnd)
    return {step: sorted(by_round_step[(rnd, step)]) for step, rnd in last.items()}


def check_equivalence(model: dict, base_model: dict, steps: int) -> float:
    """Assert that ``model`` is the uninterrupted run's ``base_model`` after ``steps`` (within
    ``PARAM_ATOL``; key biases within ``LR * steps``); return the worst parameter drift."""
    worst, gauge = param_drift(model, base_model)
    print(f"parameter drift vs uninterrupted run after {steps} steps: {worst:.3g} "
          f"(attention key biases, zero true gradient: {gauge:.3g})")
    assert worst <= PARAM_ATOL, f"parameters drift by {worst} from the uninterrupted run"
    assert gauge <= LR * steps * 1.01
    return worst
