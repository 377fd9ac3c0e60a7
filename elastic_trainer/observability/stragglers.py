"""Stragglers: which rank is slow, and whether the job would be faster without its node.

A synchronous data-parallel job steps at the pace of its slowest rank: every step ends in the
gradient all-reduce, which no rank leaves before the last one arrives. So a rank's wall time per
step cannot name the slow rank (all are equal: the fast ones wait longer in the collective). What
names it is each rank's **own time** per step: data loading, host work and device compute, the
step less its wait inside the collectives (``step_clock.py`` measures it). This module is the
arithmetic on those times, pure (no torch, no clock of its own: the caller passes ``now``):

1. ``OwnTimes``: a rank's last ``window`` own times, summarised by their median (robust: a GC pause
   or one slow batch moves it little), cleared when the world changes (the work per rank changes).
2. ``scores(own, nodes)``: each rank's median over the median of its **peers'** (the ranks of the
   other nodes): 1.0 is as fast as they are, 5.0 five times slower. A rank at least as fast as every
   other has a score of at most 1: the fastest rank is never named.
3. ``EvictionPolicy.decide(summary, now)``: evict when the job would step faster without a node.
   The global batch is constant, so at N-1 nodes each rank does N/(N-1) of the work; the step at N is
   the measured period, at N-1 without node k it is about::

       T(N-1) = N/(N-1) x max(own time of the ranks outside k) + c,    c = period - max(own time)

   (c: what the step spends beyond the slowest rank's own part: the all-reduce's tail, unoverlapped
   communication; kept as it is, and all own time taken to scale with the batch, which makes the
   estimate of N-1 pessimistic, so the policy errs towards keeping a node). Samples per second go
   as 1/T, so the gain of evicting k is ``period / T(N-1)``. Several equally slow nodes are
   considered together (the k slowest for each k), since evicting one of two leaves the other.

   A node is evicted only when all of these hold: its ranks' worst score is at least
   ``min_slowdown`` (a node 10% slower is kept, whatever N); the gain is at least ``1 + min_gain``;
   it stayed a candidate for ``sustain_s`` (a burst is not a straggler); at least
   ``cooldown_s`` passed since the world last changed (the windows refill at the new size); and the
   nodes left are at least ``min_nodes``. Uniform noise cannot pass the first test: ranks whose own
   times lie within a band of +-10% around one value have scores of at most 1.1/0.9 = 1.22.

Numbers: 3 nodes, one at 5x (0.25 s against 0.05 s a step): T(3) = 0.25 s, T(2) = 1.5 x 0.05 =
0.075 s, a gain of 3.3: evicted. One node 10% slower: T(2) = 1.5 x 1.0 > T(3) = 1.1 (and its score
1.1 < 1.25): kept. Evicting pays at N nodes once the slow node is more than N/(N-1) times slower
than the rest (2x at N=2, 1.5x at N=3, 1.14x at N=8), and never below ``min_slowdown``.

Usage (rank 0, every ``summary_every_s``, with the medians all ranks gathered)::

    policy = EvictionPolicy(StragglerConfig(), min_nodes=1)
    d = policy.decide(Summary(own=(0.05, 0.05, 0.25), nodes=("a", "b", "c"), period=0.25), now)
    d.named      # (2,): ranks at least min_slowdown slower than their peers (reported)
    d.evict      # ("c",) once sustained, under the "evict" policy; () otherwise
    policy.world_changed(now)    # after any re-form: windows refill, the cool-down starts
"""

from __future__ import annotations

import json
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from elastic_trainer.env import settings_from_json

POLICIES = ("evict", "report", "off")


@dataclass
class StragglerConfig:
    """How stragglers are found and what is done about them (``--straggler-*`` flags)."""

    policy: str = "evict"
    """``evict``: a node that slows the job is left out live and held out (``hold_out_s``);
    ``report``: only named (status, metrics, W&B, events); ``off``: not measured."""
    window: int = 20
    """Own times per rank that its median is taken over (the last this many steps)."""
    min_samples: int = 10
    """Steps a rank must have timed since the world last changed before it is scored."""
    summary_every_s: float = 2.0
    """Seconds between two exchanges of the ranks' medians (one all-gather of one number per rank)."""
    min_slowdown: float = 1.25
    """A rank is named when its own time is at least this many times its peers' median."""
    min_gain: float = 0.1
    """Evict only when the job would step at least this much faster without the node (0.1: 10%)."""
    sustain_s: float = 10.0
    """Seconds a node must stay a candidate before it is evicted."""
    cooldown_s: float = 15.0
    """Seconds after a change of the world (any re-form) during which nothing is evicted."""
    hold_out_s: float = 300.0
    """Seconds an evicted node's agent keeps it out before it checks it again and lets it rejoin;
    doubled each time the same node is evicted again (``backoff.BackOff``)."""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"--straggler-policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.window < 1 or not 1 <= self.min_samples <= self.window:
            raise ValueError(f"--straggler-window ({self.window}) must be at least 1 and at least "
                             f"--straggler-min-samples ({self.min_samples}), which must be at least 1")
        if self.min_slowdown <= 1.0:
            raise ValueError(f"--straggler-min-slowdown must be above 1 (1.25: 25% slower than its peers), "
                             f"got {self.min_slowdown}")
        for name in ("summary_every_s", "min_gain", "sustain_s", "cooldown_s", "hold_out_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"straggler {name} must be 0 or more, got {getattr(self, name)}")

    def to_json(self) -> str:
        """What the launcher hands its workers (``ENV_STRAGGLERS``)."""
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> StragglerConfig:
        """Parse ``to_json``'s text; keys this version does not know are ignored."""
        return settings_from_json(cls, text, f"straggler settings {text!r} are not the JSON the launcher writes")


class OwnTimes:
    """One rank's own times per step: the last ``window`` of them and their median."""

    def __init__(self, window: int = StragglerConfig.window) -> None:
        self.times: deque[float] = deque(maxlen=window)

    def add(self, seconds: float) -> None:
        if seconds >= 0:
            self.times.append(seconds)

    def clear(self) -> None:
        """Forget them all: the world changed, so did the work per rank."""
        self.times.clear()

    def __len__(self) -> int:
        return len(self.times)

    def median(self) -> float | None:
        return statistics.median(self.times) if self.times else None

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100, linear interpolation); None before the first time."""
        if not self.times:
            return None
        ordered = sorted(self.times)
        pos = (len(ordered) - 1) * q / 100.0
        low = int(pos)
        high = min(low + 1, len(ordered) - 1)
        return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def scores(own: Sequence[float], nodes: Sequence[str]) -> list[float]:
    """Each rank's own time over the median own time of the ranks on other nodes (its peers); 1.0
    for every rank of a one-node world. ``own[i]`` and ``nodes[i]`` are rank i's.

    One sort of all the times, then per node the median of the times without that node's: its k
    ranks are k holes in the sorted list, so the median of the rest lies within k places of the
    whole list's middle (O(n log n + n k), not O(n^2): 8,000 ranks at 1,000 nodes in milliseconds)."""
    if len(own) != len(nodes):
        raise ValueError(f"{len(own)} own times for {len(nodes)} ranks' nodes; give one of each per rank")
    order = sorted(range(len(own)), key=lambda i: own[i])
    position = {i: p for p, i in enumerate(order)}
    ranks_of: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        ranks_of.setdefault(node, []).append(i)
    reference: dict[str, float | None] = {}
    for node, mine in ranks_of.items():
        holes = sorted(position[i] for i in mine)
        rest = len(own) - len(holes)
        if rest == 0:
            reference[node] = None
            continue
        wanted = sorted({(rest - 1) // 2, rest // 2})  # the middle one or two of the rest, by index
        found: list[float] = []
        p, h = wanted[0], 0  # no place before the middle of the rest can be it: holes only move it right
        while len(found) < len(wanted):
            while h < len(holes) and holes[h] < p:
                h += 1  # h: the holes before place p
            if not (h < len(holes) and holes[h] == p) and p - h == wanted[len(found)]:
                found.append(own[order[p]])
            p += 1
        reference[node] = sum(found) / len(found)
    out = []
    for mine, node in zip(own, nodes):
        ref = reference[node]
        ref = mine if ref is None else ref
        out.append(mine / ref if ref > 0 else (1.0 if mine <= 0 else float("inf")))
    return out


@dataclass(frozen=True)
class Summary:
    """What the ranks exchanged: each rank's median own time and node, and the step period."""

    own: tuple[float, ...]
    """Rank i's median own time (``OwnTimes.median``); NaN for a rank with fewer than
    ``min_samples`` times since the world changed (then nothing is decided yet)."""
    nodes: tuple[str, ...]
    period: float
    """The median step period (the same on every rank: the all-reduce makes it so)."""


def step_time_without(summary: Summary, left_out: set[str]) -> float:
    """The step period expected with the nodes ``left_out`` gone (see the module docstring)."""
    n = len(set(summary.nodes))
    kept = [t for t, node in zip(summary.own, summary.nodes) if node not in left_out]
    if not kept or n - len(left_out) < 1:
        return float("inf")
    slowest = max(summary.own)
    overhead = max(0.0, summary.period - slowest)
    return n / (n - len(left_out)) * max(kept) + overhead


@dataclass(frozen=True)
class Decision:
    """``named``: ranks at least ``min_slowdown`` slower than their peers; ``evict``: nodes to leave
    out now (empty unless the policy is ``evict`` and every condition held); ``gain``: the expected
    speed-up of leaving them out (period / expected period); ``reason``: one line saying why."""

    named: tuple[int, ...] = ()
    scores: tuple[float, ...] = ()
    evict: tuple[str, ...] = ()
    gain: float = 1.0
    reason: str = ""


@dataclass
class EvictionPolicy:
    """Rank 0's straggler decisions over time (see the module docstring); state: how long each node
    has been a candidate, and when the world last changed."""

    config: StragglerConfig = field(default_factory=StragglerConfig)
    min_nodes: int = 1
    changed_at: float | None = None
    """When the world last changed (None: not since the start; the first world has no cool-down)."""
    candidate_since: dict[str, float] = field(default_factory=dict)

    def world_changed(self, now: float) -> None:
        """Any re-form (an eviction included): the cool-down starts, candidates start over."""
        self.changed_at = now
        self.candidate_since.clear()

    def candidates(self, summary: Summary, node_scores: dict[str, float]) -> tuple[tuple[str, ...], float]:
        """The set of slowest nodes whose eviction gains most (each named), and that gain."""
        n = len(node_scores)
        slow_first = sorted((node for node, s in node_scores.items() if s >= self.config.min_slowdown),
                            key=lambda node: -node_scores[node])
        best: tuple[tuple[str, ...], float] = ((), 1.0)
        for k in range(1, min(len(slow_first), n - self.min_nodes) + 1):
            left_out = tuple(slow_first[:k])
            gain = summary.period / step_time_without(summary, set(left_out))
            if gain > best[1]:
                best = (left_out, gain)
        return best

    def decide(self, summary: Summary, now: float) -> Decision:
        """Score the ranks; name the slow ones; say which nodes to evict now, if any."""
        if any(math.isnan(t) for t in summary.own):
            return Decision(reason="waiting for every rank's first window of own times")
        rank_scores = scores(summary.own, summary.nodes)
        named = tuple(i for i, s in enumerate(rank_scores) if s >= self.config.min_slowdown)
        node_scores: dict[str, float] = {}
        for node, s in zip(summary.nodes, rank_scores):
            node_scores[node] = max(s, node_scores.get(node, 0.0))
        nodes, gain = self.candidates(summary, node_scores)
        if gain < 1.0 + self.config.min_gain:
            nodes = ()
        for node in list(self.candidate_since):
            if node not in nodes:
                del self.candidate_since[node]
        for node in nodes:
            self.candidate_since.setdefault(node, now)
        base = Decision(named, tuple(rank_scores), (), gain, "")
        if not nodes:
            return replace(base, reason="no node slows the job enough to leave it out" if named else "")
        what = ", ".join(f"{node} ({node_scores[node]:.2f}x its peers)" for node in nodes)
        it = "it" if len(nodes) == 1 else "them"
        if self.config.policy != "evict":
            return replace(base, reason=f"{what}: the job would step {gain:.2f}x faster without {it} (policy "
                                      f"{self.config.policy}: reported only)")
        waited = min(now - self.candidate_since[node] for node in nodes)
        if waited < self.config.sustain_s:
            return replace(base, reason=f"{what}: slow for {waited:.1f} s of the {self.config.sustain_s:g} s it must last")
        if self.changed_at is not None and now - self.changed_at < self.config.cooldown_s:
            return replace(base, reason=f"{what}: the world changed {now - self.changed_at:.1f} s ago, within the "
                                      f"{self.config.cooldown_s:g} s cool-down")
        return replace(base, evict=nodes, reason=f"evict {what}: the job would step {gain:.2f}x faster without {it}, "
                                               f"at {len(node_scores) - len(nodes)} nodes")


__all__ = ["Decision", "EvictionPolicy", "OwnTimes", "POLICIES", "StragglerConfig", "Summary", "scores",
           "step_time_without"]
