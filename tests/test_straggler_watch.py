"""The Manager's straggler bookkeeping (``training/straggler_watch.py``): what each rank adds to the
step agreement, and that every rank reaches the same decision from the summed slots, survivors and
newcomers alike, so that the evicted node's ranks leave and the others re-form at the same step.
The live end to end (three ``elastic-train`` nodes, one 5x slower) is tests/test_stragglers_live.py.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_straggler_watch.py -q
"""

from __future__ import annotations

import math

import torch

from elastic_trainer.live.quorum import LiveExcluded, Member, Quorum
from elastic_trainer.observability.stragglers import StragglerConfig
from elastic_trainer.training.straggler_watch import Evicted, StragglerWatch

CPU = torch.device("cpu")
CONFIG = StragglerConfig(sustain_s=4.0, cooldown_s=10.0)


def quorum(nodes: list[str]) -> Quorum:
    return Quorum(q=1, members=tuple(Member(f"{n}-0-{i}", n, 0, f"127.0.0.1:{i}") for i, n in enumerate(nodes)))


class Clock:
    """Rank 0's clock, set by the test."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def watches_of(n: int, clock: Clock, **kwargs) -> list[StragglerWatch]:
    return [StragglerWatch(CONFIG, CPU, clock=clock, **kwargs) for _ in range(n)]


def agree(watches: list[StragglerWatch], q: Quorum, clock: Clock, now: float):
    """One agreement at ``now`` on rank 0's clock: each rank's payload, summed as the all-reduce sums
    it, then each rank's decision (None on an agreement without a summary)."""
    clock.now = now
    payloads = [w.payload(rank, len(watches)) for rank, w in enumerate(watches)]
    assert len({len(p) for p in payloads}) == 1, "every rank adds as many floats"
    summed = [sum(col) for col in zip(*payloads)]
    return [w.read(summed, q, rank) for rank, w in enumerate(watches)]


def feed(watches: list[StragglerWatch], own: list[float], steps: int) -> None:
    for w, t in zip(watches, own):
        for _ in range(steps):
            w.own.add(t)
            w.periods.add(max(own))


def test_rank_0s_flag_announces_the_summary_which_rides_on_the_next_agreement_every_2_s():
    q, clock = quorum(["a", "b", "c"]), Clock()
    watches = watches_of(3, clock)
    sizes = []
    for i in range(12):  # agreements 0.5 s apart on rank 0's clock
        clock.now = 0.5 * i
        payloads = [w.payload(r, 3) for r, w in enumerate(watches)]
        assert len({len(p) for p in payloads}) == 1
        assert all(p[0] == 0 for p in payloads[1:]), "only rank 0 raises the flag"
        sizes.append((payloads[0][0], len(payloads[0])))
        summed = [sum(col) for col in zip(*payloads)]
        for r, w in enumerate(watches):
            w.read(summed, q, r)
    # raised at 0 s, 2 s, 4 s; the summary (1 + 3 slots + clock + period) rides on the agreement after each
    assert sizes == [(1, 1), (0, 6), (0, 1), (0, 1), (1, 1), (0, 6), (0, 1), (0, 1), (1, 1), (0, 6), (0, 1), (0, 1)]
    fresh = StragglerWatch(CONFIG, CPU, clock=clock)
    fresh.read([1.0], q, 1)  # the flag came: the next payload carries the slots
    slots = fresh.payload(1, 3)
    assert slots[1] == 0 and math.isnan(slots[2]) and slots[4:] == [0.0, 0.0], "NaN before min_samples own times"
    assert StragglerWatch(CONFIG, CPU).payload(0, 1) == [], "one rank: nothing to compare"
    assert StragglerWatch(StragglerConfig(policy="off"), CPU).payload(0, 3) == []


def test_every_rank_decides_the_same_eviction_at_the_same_agreement():
    q, clock = quorum(["a", "b", "c"]), Clock()
    watches = watches_of(3, clock)
    feed(watches, [0.05, 0.05, 0.25], 20)
    decided = []
    for i in range(60):
        out = agree(watches, q, clock, now=100.0 + 0.2 * i)
        assert all(d == out[0] for d in out), out
        if out[0] is not None and out[0].evict:
            decided.append((i, out[0].evict))
    first, evict = decided[0]
    assert evict == ("c",)
    assert 0.2 * first >= CONFIG.sustain_s, "not before it stayed slow for sustain_s"
    assert watches[2].last.named == (2,) and watches[0].last.scores[2] > 4


def test_a_newcomer_and_the_survivors_keep_the_same_cool_down_after_a_re_form():
    q, clock = quorum(["a", "b", "c"]), Clock()
    survivors = watches_of(2, clock)
    for w in survivors:
        w.world_changed()  # the re-form that let the newcomer in
    newcomer = StragglerWatch(CONFIG, CPU, rejoined=True, clock=clock)
    watches = [*survivors, newcomer]
    feed(watches, [0.05, 0.05, 0.25], 20)
    times = [50.0 + 0.2 * i for i in range(120)]
    outs = [agree(watches, q, clock, now) for now in times]
    evicted_at = [now for now, out in zip(times, outs) if out[0] is not None and out[0].evict]
    for out in outs:
        assert all(d == out[0] for d in out)
    assert evicted_at and evicted_at[0] - times[0] >= CONFIG.cooldown_s, "the cool-down counts for everyone"
    within = [out[0] for now, out in zip(times, outs) if out[0] is not None and now - times[0] < CONFIG.cooldown_s]
    assert within and all(not d.evict for d in within) and any("cool-down" in d.reason for d in within)


def test_a_node_within_the_noise_is_never_evicted():
    q, clock = quorum(["a", "b", "c"]), Clock()
    watches = watches_of(3, clock)
    feed(watches, [0.050, 0.055, 0.060], 20)  # 20% apart at most: under min_slowdown
    for i in range(100):
        assert all(d is None or (not d.evict and not d.named) for d in agree(watches, q, clock, now=0.2 * i))


def test_time_steps_needs_ddp_and_evicted_is_an_exclusion():
    assert StragglerWatch(CONFIG, CPU).time_steps(torch.nn.Linear(2, 2)) is False
    assert StragglerWatch(CONFIG, CPU).time_steps(None) is False
    assert issubclass(Evicted, LiveExcluded)  # the crash-loop policy never counts it as a failure
