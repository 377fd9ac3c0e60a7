"""The straggler arithmetic (``observability/stragglers.py``): the fastest rank is never named,
uniform noise never evicts, a node 5x slower is evicted within 20 s, a node 10% slower is kept,
never below ``min_nodes``, not within the cool-down, not under ``report``.

The simulations step a job of N nodes in simulated time (each step: every rank's own time = its
node's factor x a base time x per-step noise; the period = the slowest own time + a fixed
communication tail), feed each rank's ``OwnTimes`` and ask the policy every ``summary_every_s``,
as rank 0 will: no sleeping, no wall clock.

    .venv/bin/python -m pytest -p no:cacheprovider tests/test_stragglers.py -q
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_trainer.observability.stragglers import (
    EvictionPolicy,
    OwnTimes,
    StragglerConfig,
    Summary,
    scores,
    step_time_without,
)

times = st.floats(min_value=1e-4, max_value=100.0, allow_nan=False)


def simulate(factors: list[float], *, ranks_per_node: int = 1, noise: float = 0.1, seconds: float = 60.0,
             seed: int = 0, base: float = 0.05, comm: float = 0.005, config: StragglerConfig | None = None,
             min_nodes: int = 1):
    """Run the job in simulated time until the policy evicts: (seconds, decision), or (None, last decision)."""
    rng = random.Random(seed)
    config = config or StragglerConfig()
    nodes = [f"node{i}" for i in range(len(factors)) for _ in range(ranks_per_node)]
    factor = [f for f in factors for _ in range(ranks_per_node)]
    own = [OwnTimes(config.window) for _ in nodes]
    periods = OwnTimes(config.window)
    policy = EvictionPolicy(config, min_nodes=min_nodes)
    now, due, decision = 0.0, config.summary_every_s, None
    while now < seconds:
        step = [base * f * rng.uniform(1 - noise, 1 + noise) for f in factor]
        for mine, t in zip(own, step):
            mine.add(t)
        periods.add(max(step) + comm)
        now += max(step) + comm
        if now >= due:
            due = now + config.summary_every_s
            medians = tuple(o.median() if len(o) >= config.min_samples else math.nan for o in own)
            decision = policy.decide(Summary(medians, tuple(nodes), periods.median()), now)
            if decision.evict:
                return now, decision
    return None, decision


# ------------------------------------------------------------------------------------------- scores

@given(st.lists(times, min_size=2, max_size=64), st.data())
def test_the_fastest_rank_is_never_named(own, data):
    nodes = [data.draw(st.sampled_from("abcdefgh")) for _ in own]
    s = scores(own, nodes)
    fastest = min(range(len(own)), key=own.__getitem__)
    assert s[fastest] <= 1.0
    decision = EvictionPolicy(StragglerConfig(sustain_s=0, cooldown_s=0)).decide(
        Summary(tuple(own), tuple(nodes), max(own)), 0.0)
    assert fastest not in decision.named


@given(st.lists(times, min_size=2, max_size=64), st.data(), st.integers(1, 4))
def test_a_node_whose_ranks_are_all_within_min_slowdown_of_their_peers_is_never_evicted(own, data, min_nodes):
    nodes = [data.draw(st.sampled_from("abcdef")) for _ in own]
    config = StragglerConfig(sustain_s=0, cooldown_s=0)
    summary = Summary(tuple(own), tuple(nodes), max(own) * data.draw(st.floats(1.0, 2.0)))
    decision = EvictionPolicy(config, min_nodes=min_nodes).decide(summary, 0.0)
    s = scores(own, nodes)
    for node in decision.evict:
        assert max(x for x, n in zip(s, nodes) if n == node) >= config.min_slowdown
    assert len(set(nodes)) - len(decision.evict) >= min(min_nodes, len(set(nodes)))
    if decision.evict:  # and only when the job gains
        assert summary.period / step_time_without(summary, set(decision.evict)) >= 1 + config.min_gain


@given(st.integers(2, 64), st.integers(1, 8), times, st.data())
def test_own_times_within_ten_percent_of_each_other_are_never_named_nor_evicted(n_nodes, per_node, base, data):
    """Whatever values the band holds (chosen adversarially), scores stay under 1.1/0.9 = 1.22 < 1.25."""
    nodes = tuple(f"n{i}" for i in range(n_nodes) for _ in range(per_node))
    band = st.floats(0.9 * base, 1.1 * base)
    policy = EvictionPolicy(StragglerConfig(sustain_s=0, cooldown_s=0))
    for t in range(3):
        own = tuple(data.draw(band) for _ in nodes)
        decision = policy.decide(Summary(own, nodes, max(own) * 1.05), float(t))
        assert decision.named == () and decision.evict == ()


def test_scores_compare_a_rank_with_the_other_nodes_ranks_only():
    # a node of 4 slow ranks among 4 fast ones: its ranks' peers are the fast node's, so they are named
    s = scores([1, 1, 1, 1, 5, 5, 5, 5], ["a"] * 4 + ["b"] * 4)
    assert s == [0.2] * 4 + [5.0] * 4
    assert scores([3.0], ["a"]) == [1.0]
    with pytest.raises(ValueError, match="3 own times for 2 ranks' nodes"):
        scores([1, 2, 3], ["a", "b"])


def test_own_times_keep_the_last_window_and_give_its_median_and_percentiles():
    own = OwnTimes(window=5)
    assert own.median() is None and own.percentile(90) is None
    for t in [9.0, 1.0, 2.0, 3.0, 4.0, 100.0]:
        own.add(t)
    assert len(own) == 5 and own.median() == 3.0  # 9.0 fell out of the window; 100 moves the median little
    assert own.percentile(0) == 1.0 and own.percentile(100) == 100.0 and own.percentile(50) == 3.0
    own.clear()
    assert len(own) == 0


# ------------------------------------------------------------------------------------ the decision

def test_the_issues_three_node_example_gains_3_3x_without_the_slow_node():
    summary = Summary(own=(0.05, 0.05, 0.25), nodes=("a", "b", "c"), period=0.25)
    assert step_time_without(summary, {"c"}) == pytest.approx(0.075)
    decision = EvictionPolicy(StragglerConfig(sustain_s=0)).decide(summary, 0.0)
    assert decision.evict == ("c",) and decision.named == (2,) and decision.gain == pytest.approx(10 / 3)
    assert "evict c (5.00x its peers): the job would step 3.33x faster without it, at 2 nodes" == decision.reason


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 16), st.integers(1, 4), st.floats(0.0, 0.3), st.integers(0, 2**32 - 1), st.data())
def test_a_node_five_times_slower_is_evicted_within_20_seconds(n_nodes, per_node, noise, seed, data):
    slow = data.draw(st.integers(0, n_nodes - 1))
    factors = [5.0 if i == slow else 1.0 for i in range(n_nodes)]
    took, decision = simulate(factors, ranks_per_node=per_node, noise=noise, seed=seed, seconds=60)
    assert took is not None and took <= 20.0, decision
    assert decision.evict == (f"node{slow}",)


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 64), st.integers(1, 4), st.floats(0.0, 0.5), st.integers(0, 2**32 - 1))
def test_uniform_noise_never_evicts(n_nodes, per_node, noise, seed):
    """Every rank drawn from the same distribution, up to +-50% per step, over 2 minutes."""
    took, decision = simulate([1.0] * n_nodes, ranks_per_node=per_node, noise=noise, seed=seed, seconds=120)
    assert took is None, decision


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 64), st.floats(0.0, 0.3), st.integers(0, 2**32 - 1), st.data())
def test_a_node_ten_percent_slower_is_kept(n_nodes, noise, seed, data):
    slow = data.draw(st.integers(0, n_nodes - 1))
    factors = [1.1 if i == slow else 1.0 for i in range(n_nodes)]
    took, decision = simulate(factors, noise=noise, seed=seed, seconds=120)
    assert took is None, decision


def test_a_node_slower_than_the_rest_but_not_enough_to_pay_for_its_share_is_kept():
    # at 3 nodes, leaving one out pays once it is more than 1.5x slower: 1.4x is kept, 2x is evicted
    assert simulate([1.0, 1.0, 1.4], noise=0.02)[0] is None
    assert simulate([1.0, 1.0, 2.0], noise=0.02)[0] is not None


def test_two_equally_slow_nodes_are_evicted_together_when_one_alone_would_not_help():
    took, decision = simulate([1.0, 1.0, 1.0, 1.0, 5.0, 5.0], noise=0.05)
    assert took is not None and set(decision.evict) == {"node4", "node5"}


def test_never_below_min_nodes():
    assert simulate([1.0, 5.0], min_nodes=2)[0] is None
    took, decision = simulate([1.0, 5.0, 5.0], min_nodes=2, noise=0.05)
    assert len(decision.evict) <= 1  # one of the two may go, never both


def test_nothing_is_evicted_within_the_cool_down_after_the_world_changed():
    policy = EvictionPolicy(StragglerConfig(sustain_s=0, cooldown_s=60))
    summary = Summary((0.05, 0.05, 0.25), ("a", "b", "c"), 0.25)
    policy.world_changed(100.0)
    decision = policy.decide(summary, 159.0)
    assert decision.evict == () and "within the 60 s cool-down" in decision.reason
    assert policy.decide(summary, 160.0).evict == ("c",)


def test_a_burst_shorter_than_sustain_is_not_evicted():
    policy = EvictionPolicy(StragglerConfig(sustain_s=10))
    slow, fine = Summary((1, 1, 5), ("a", "b", "c"), 5), Summary((1, 1, 1), ("a", "b", "c"), 1)
    assert policy.decide(slow, 0.0).evict == () and policy.decide(slow, 9.0).evict == ()
    assert policy.decide(fine, 9.5).evict == ()  # the burst ended: it starts over
    assert policy.decide(slow, 10.0).evict == () and policy.decide(slow, 20.0).evict == ("c",)


def test_report_names_the_slow_rank_and_never_evicts():
    took, decision = simulate([1.0, 1.0, 5.0], config=StragglerConfig(policy="report"))
    assert took is None and decision.named == (2,) and "policy report: reported only" in decision.reason


def test_nothing_is_decided_before_every_rank_has_a_window():
    decision = EvictionPolicy().decide(Summary((0.05, math.nan, 0.25), ("a", "b", "c"), 0.25), 0.0)
    assert decision.named == () and decision.evict == () and "waiting" in decision.reason


@pytest.mark.parametrize("kwargs, message", [
    ({"policy": "kill"}, "--straggler-policy must be one of evict, report, off"),
    ({"window": 5, "min_samples": 10}, "--straggler-window"),
    ({"min_slowdown": 1.0}, "must be above 1"),
    ({"cooldown_s": -1}, "cooldown_s must be 0 or more"),
])
def test_bad_settings_are_one_sentence(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StragglerConfig(**kwargs)
