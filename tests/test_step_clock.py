"""A slow rank is named by the scores of its real own times on gloo, and a fast one never is, while
the wall time per step (the same on every rank: the all-reduce waits for the slowest) names nobody.

Four processes train a tiny DDP model on gloo for 12 steps, their steps timed by ``StepClock``
(its DDP communication hook): ranks 1 and 2 are fast, rank 0 sleeps 50 ms a step in its own
forward, rank 3 as long in fetching its batch. The model has a BatchNorm, so DDP's forward
broadcasts rank 0's buffers: the fast ranks wait there for the slow rank 0, and that wait must not
count as their own time. One job (starting the processes is most of its
seconds).

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_step_clock.py -q
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_trainer.observability.stragglers import StragglerConfig, scores
from tests.helpers.common import REPO

pytestmark = pytest.mark.timeout(120)

WORLD, SLOW_COMPUTE, SLOW_DATA, SLEEP = 4, 0, 3, 0.05


def test_slow_ranks_are_named_by_their_own_time_and_the_fast_ones_never(tmp_path, procs):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = [procs.start([sys.executable, "-m", "tests.helpers.straggler_step", str(rank), str(WORLD),
                            str(tmp_path / "init"), "12", str(SLOW_COMPUTE), str(SLOW_DATA), str(SLEEP)],
                           cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for rank in range(WORLD)]
    ranks = []
    for proc in started:
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err[-2000:]
        ranks.append(json.loads(out.strip().splitlines()[-1]))
    ranks.sort(key=lambda r: r["rank"])
    nodes = [f"node{r['rank']}" for r in ranks]
    threshold = StragglerConfig().min_slowdown

    own = scores([r["own"] for r in ranks], nodes)
    assert [i for i, s in enumerate(own) if s >= threshold] == [SLOW_COMPUTE, SLOW_DATA], ranks
    # a fast rank's own time leaves out its waits for the slow ones (the all-reduce, rank 0's buffer
    # broadcast): far below their 50 ms sleep
    assert all(r["own"] < SLEEP / 2 for r in ranks[1:3]), ranks
    # the wall time per step cannot tell: every rank waits for the slowest in the all-reduce
    wall = scores([r["period"] for r in ranks], nodes)
    assert all(s < threshold for s in wall), ranks
    # and the slow loader shows as such
    assert ranks[SLOW_DATA]["data"] >= SLEEP and all(r["data"] < SLEEP / 2 for r in ranks[:3]), ranks
