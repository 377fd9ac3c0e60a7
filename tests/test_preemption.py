"""``training/preemption.py`` in one process: what a SIGTERM records and which threads it leaves.

The behaviour of whole workers (save at the boundary, exit codes, the grace period) is tested on
real processes in tests/test_trainer.py and tests/test_preemption_e2e.py.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from elastic_trainer.training.preemption import PEER_STOPPED, Preemption
from elastic_trainer.runtime import runtime
from elastic_trainer.training.worker import DistInfo

pytestmark = pytest.mark.timeout(60)


def _wait_for(condition, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_sigterm_is_recorded_once_and_closing_leaves_no_thread_and_the_old_handler():
    before = signal.getsignal(signal.SIGTERM)
    calls = []
    preemption = Preemption(grace_seconds=60.0)
    preemption.watch(DistInfo(rank=0, world_size=2), step_seconds=lambda: 10.0, on_signal=lambda: calls.append(1),
                     on_hung=lambda: None, saving=lambda: False)
    assert "sigterm-watcher" in runtime().threads() and not preemption.signalled
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)
    _wait_for(lambda: preemption.signalled)
    _wait_for(lambda: {"sigterm-grace", "sigterm-hung-step"} <= set(runtime().threads()))
    time.sleep(0.1)
    assert calls == [1], "the handler and the watcher both see the signal; it counts once"
    assert preemption.stop_reason(peer_signalled=True) == "signal SIGTERM"
    preemption.disarm()
    preemption.close()
    _wait_for(lambda: not {"sigterm-watcher", "sigterm-grace", "sigterm-hung-step"} & set(runtime().threads()))
    assert signal.getsignal(signal.SIGTERM) is before


def test_without_a_signal_of_its_own_a_rank_stops_for_its_peer_or_for_max_seconds():
    preemption = Preemption(grace_seconds=60.0)
    try:
        assert preemption.stop_reason(peer_signalled=True) == PEER_STOPPED
        assert preemption.stop_reason(peer_signalled=False) == "max-seconds"
    finally:
        preemption.close()
