"""Properties of the streaming position (``stream.order``, ``stream.position``): every sample exactly once
per epoch across world-size changes, restarts and lost steps, with pure functions only (no files).

The multi-process proofs (a live run 3 -> 2 -> 3, the restart path) are in ``test_stream_train.py``;
the readers and the DataLoader workers in ``test_stream_readers.py`` and ``test_stream_loader.py``.

Run:  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_stream_position.py
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elastic_trainer.drill.ledger import stream_order
from elastic_trainer.sampler import ElasticSampler, share_of_batch
from elastic_trainer.stream.order import EpochOrder, seeded_permutation
from elastic_trainer.stream.position import Segment, StreamSampler, merge, span
from tests.helpers.world_changes import world_segments

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# ---- the epoch's order ----------------------------------------------------------------------------
@settings(max_examples=100, **SETTINGS)
@given(sizes=st.lists(st.integers(0, 60), min_size=1, max_size=8), seed=st.integers(0, 2**40),
       epoch=st.integers(0, 5), buffer=st.integers(1, 50), shuffle=st.booleans())
def test_the_epoch_order_is_a_permutation_of_the_ids_that_stays_inside_each_block(sizes, seed, epoch, buffer, shuffle):
    order = EpochOrder(sizes, seed, epoch, buffer, shuffle)
    n = sum(sizes)
    q = order.stream_positions(0, n)
    assert sorted(q.tolist()) == list(range(n))
    assert (q // buffer == np.arange(n) // buffer).all(), "a position left its shuffle block"
    assert sorted(order.epoch_ids().tolist()) == list(range(n))
    if not shuffle:
        assert order.epoch_ids().tolist() == list(range(n))
    # a shard is read front to back: its rows appear in the stream in row order, contiguously
    shard, row = order.locate(np.arange(n))
    for s in set(shard.tolist()):
        assert row[shard == s].tolist() == list(range(sizes[s]))
    # any sub-range gives the same positions as the whole
    lo, hi = n // 3, n - n // 4
    assert order.stream_positions(lo, hi).tolist() == q[lo:hi].tolist()


def test_pieces_name_the_rows_behind_stream_positions_across_shard_edges():
    order = EpochOrder([5, 0, 7, 3], seed=1, epoch=0, buffer=4, shuffle=False)
    assert order.pieces(3, 13) == [(0, 3, 5), (2, 0, 7), (3, 0, 1)]
    shuffled = EpochOrder([5, 0, 7, 3], seed=1, epoch=2, buffer=4)
    for a, b in [(0, 15), (4, 9), (14, 15)]:
        rows = [(s, r) for s, lo, hi in shuffled.pieces(a, b) for r in range(lo, hi)]
        shard, row = shuffled.locate(np.arange(a, b))
        assert rows == list(zip(shard.tolist(), row.tolist()))


def test_the_order_is_pinned_on_every_machine_and_version():
    """The order is defined by our own mixer, not a library RNG: these ids (computed once, in another
    process) must never change, or every saved stream position would point at other samples."""
    assert EpochOrder([10, 7, 12], seed=5, epoch=1, buffer=8).epoch_ids().tolist() == PINNED


PINNED = [20, 18, 17, 24, 22, 19, 23, 21, 26, 12, 10, 13, 28, 27, 25, 11, 15, 2, 3, 14, 4, 16, 1, 0, 8, 9, 7, 6, 5]


def test_seeded_permutations_differ_by_key_and_shuffle_blocks_by_epoch():
    assert seeded_permutation(50, 1).tolist() != seeded_permutation(50, 2).tolist()
    a, b = EpochOrder([100], 0, 0, 100), EpochOrder([100], 0, 1, 100)
    assert a.epoch_ids().tolist() != b.epoch_ids().tolist()


# ---- one segment ----------------------------------------------------------------------------------
@settings(max_examples=150, **SETTINGS)
@given(n=st.integers(1, 300), b=st.integers(1, 40), w=st.integers(1, 12), data=st.data())
def test_ranks_take_contiguous_ranges_that_tile_the_segment_and_each_step_is_one_global_batch(n, b, w, data):
    if b < w or n < b:
        return
    edges = sorted(data.draw(st.sets(st.integers(0, n * 3), max_size=8)))
    remaining = merge(list(zip(edges[0::2], edges[1::2]))) or [(0, n)]  # sorted, disjoint, some adjacent
    seg = Segment(tuple(remaining), w, b)
    ranges = [seg.rank_range(r) for r in range(w)]
    laid = [p for rng in ranges for a, z in rng for p in range(a, z)]
    every = [p for a, z in remaining for p in range(a, z)]
    assert laid == every[: seg.steps * b], "the ranks' ranges tile V[:S*B] in rank order"
    for k in range(seg.steps):
        step = [p for r in range(w) for a, z in seg.rank_part(r, k) for p in range(a, z)]
        assert len(step) == len(set(step)) == b


@settings(max_examples=150, **SETTINGS)
@given(b=st.integers(1, 30), w=st.integers(1, 8), w2=st.integers(1, 8), k=st.integers(0, 10), n=st.integers(30, 200))
def test_resegmenting_at_the_same_world_or_after_no_step_deals_the_same_samples(b, w, w2, k, n):
    if b < max(w, w2) or n < b:
        return
    seg = Segment(((0, n),), w, b)
    k = min(k, seg.steps)
    done = Segment(seg.remaining, w, b, k)
    again = Segment(tuple(done.unread()), w, b)
    for r in range(w):
        assert merge(again.rank_range(r)) == merge(done.rank_range(r, k))
    detour = Segment(tuple(Segment(tuple(done.unread()), w2, b).unread()), w, b)  # a world that ran no step
    assert detour.remaining == again.remaining


# ---- exactly once across worlds, restarts and lost steps -----------------------------------------
def simulate(sizes, seed, buffer, micro, segments, epochs, shuffle=True, out=None):
    """Run ``segments`` of ``(world size, global batch, steps, lost)`` like the ledger's lineage rule:
    the state is saved (through JSON) after each of the first ``steps - lost`` steps; the last
    ``lost`` steps and what the loaders read ahead are lost. ``out[i]``: the ranks that sit out the
    first step of segment ``i`` (``sit_out``: a live join's newcomers). Returns ({epoch: ids in
    order}, [(ranks that trained the step, ids)] of the counted steps)."""
    state, counted, lineage = None, defaultdict(list), []
    for k, (w, b, steps, lost) in enumerate(segments):
        samplers = [StreamSampler(sizes, b, r, w, seed=seed, buffer=buffer, micro_batch_size=micro, shuffle=shuffle)
                    for r in range(w)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(json.loads(json.dumps(state)))
        assert len({json.dumps(s.state_dict(), sort_keys=True) for s in samplers}) == 1, "ranks disagree"
        sitting = sorted((out or {}).get(k, ()))
        for s in samplers:
            s.sit_out(sitting)
        for i in range(steps):
            if samplers[0].epoch >= epochs:
                break
            epoch, batch, counts = samplers[0].epoch, [], []
            for s in samplers:
                mbs = s.batch_ids()
                assert [len(mb) for mb in mbs] == s.micro_sizes and len(mbs) == s.micro_batches_per_step
                share = share_of_batch(b, w, s.rank)[1]  # the rest: this step's part, then a share of each step after
                assert span(s.rest()) == sum(len(mb) for mb in mbs) + share * (s.remaining_steps - 1)
                assert not (i == 0 and s.rank in sitting) or mbs == []
                batch += [x for mb in mbs for x in mb]
                counts.append(len(mbs))
            assert batch == samplers[0].global_batch()
            assert len(batch) == b
            assert {s.lockstep_micro_batches for s in samplers} == {max(counts)}
            for s in samplers:
                s.commit_step()
            if i < steps - lost:
                counted[epoch] += batch
                lineage.append((w - (len(sitting) if i == 0 else 0), batch))
                state = samplers[0].state_dict()
    return counted, lineage


@st.composite
def stream_runs(draw, vary_batch=False):
    sizes = draw(st.lists(st.integers(0, 50), min_size=1, max_size=6).filter(lambda s: sum(s) >= 1))
    n = sum(sizes)
    b0 = draw(st.integers(1, min(n, 24)))
    seed, buffer = draw(st.integers(0, 2**31)), draw(st.integers(1, 40))
    micro = draw(st.none() | st.integers(1, 8))
    segments = draw(world_segments(n, b0, vary_batch))
    # some segments' first step sat out by some of their ranks (a live join's newcomers: sit_out)
    out = {k: draw(st.sets(st.integers(0, w - 1), max_size=w - 1)) for k, (w, *_) in enumerate(segments)
           if w > 1 and draw(st.booleans())}
    return sizes, b0, seed, buffer, micro, segments, out


@settings(max_examples=150, **SETTINGS)
@given(run=stream_runs(), shuffle=st.booleans())
def test_resume_at_any_world_size_streams_every_sample_once_per_epoch(run, shuffle):
    sizes, b, seed, buffer, micro, segments, out = run
    counted, _ = simulate(sizes, seed, buffer, micro, segments, epochs=2, shuffle=shuffle, out=out)
    n = sum(sizes)
    for e in range(2):
        got = counted[e]
        assert len(got) == len(set(got)), f"epoch {e}: a sample was trained twice"
        # exactly the first (n // b) * b order positions: the same set, and the same dropped tail, as one rank
        assert sorted(got) == sorted(EpochOrder(sizes, seed, e, buffer, shuffle).epoch_ids(0, (n // b) * b).tolist())


@settings(max_examples=60, **SETTINGS)
@given(run=stream_runs(vary_batch=True))
def test_resume_with_a_changed_global_batch_drops_only_a_tail_shorter_than_a_batch(run):
    sizes, b, seed, buffer, micro, segments, out = run
    counted, _ = simulate(sizes, seed, buffer, micro, segments, epochs=2, out=out)
    n, biggest = sum(sizes), max(s[1] for s in segments)
    for e in range(2):
        assert len(counted[e]) == len(set(counted[e]))
        assert 0 <= n - len(counted[e]) < biggest


@settings(max_examples=80, **SETTINGS)
@given(run=stream_runs())
def test_the_drills_replay_names_the_samples_of_every_step_from_the_world_sizes_alone(run):
    """What a step trains depends only on the world sizes of the counted steps before it (a step some
    ranks sat out counting at the number that trained it): lost steps and restarts change nothing
    (invariant 3), so the drill can replay a run's lineage."""
    sizes, b, seed, buffer, micro, segments, out = run
    _, lineage = simulate(sizes, seed, buffer, micro, segments, epochs=2, out=out)
    expected = stream_order(sizes, b, seed, buffer)
    for step, (world, batch) in enumerate(lineage, start=1):
        assert sorted(expected(step, world)) == sorted(batch)


def test_shrink_and_grow_by_hand_3_2_3_splits_shards_into_ranges_and_trains_the_whole_epoch():
    sizes, b = [40, 40, 40, 40], 12
    counted, lineage = simulate(sizes, 7, 16, 2, [(3, b, 4, 0), (2, b, 3, 1), (3, b, 10**6, 0)], epochs=1)
    assert len(counted[0]) == 156 and len(set(counted[0])) == 156
    s = StreamSampler(sizes, b, 2, 3, seed=7, buffer=16)
    assert len(s.rest()) == 1 and span(s.rest()) == 13 * 4  # one contiguous range of 13 steps x 4 samples
    assert s.rest()[0][0] == 13 * 8 and s.rest()[0][1] == 13 * 12  # rank 2's range starts inside shard 2


# ---- what the trainer reads from a sampler -------------------------------------------------------
@settings(max_examples=100, **SETTINGS)
@given(n=st.integers(1, 200), b=st.integers(1, 40), w=st.integers(1, 8), m=st.none() | st.integers(1, 9))
def test_micro_batches_and_steps_match_the_map_style_sampler(n, b, w, m):
    if b < w or n < b:
        return
    for r in range(w):
        s, e = StreamSampler([n], b, r, w, micro_batch_size=m), ElasticSampler(n, b, r, w, micro_batch_size=m)
        assert (s.micro_batches_per_step, s.lockstep_micro_batches, s.steps_per_epoch, s.remaining_steps) == \
               (e.micro_batches_per_step, e.lockstep_micro_batches, e.steps_per_epoch, e.remaining_steps)
        assert [len(mb) for mb in s.batch_ids()] == [len(mb) for mb in e.batches_for_step(0)]


def test_an_epoch_rolls_after_its_last_step_and_set_epoch_keeps_a_resumed_position():
    s = StreamSampler([25], 6, 0, 2, buffer=5)
    for _ in range(4):
        s.commit_step()
    assert (s.epoch, s.offset, s.remaining_steps) == (1, 0, 4)
    s.commit_step()
    s.set_epoch(1)
    assert (s.epoch, s.offset) == (1, 6)
    s.set_epoch(3)
    assert (s.epoch, s.offset, s.remaining_steps) == (3, 0, 4)
    with pytest.raises(ValueError, match="outside the 4 steps left"):
        s.batch_ids(ahead=4)


# ---- load rules ----------------------------------------------------------------------------------
def test_a_map_style_position_other_shards_or_a_broken_state_are_refused_in_one_sentence():
    s = StreamSampler([30, 30], 6, 0, 2, data_digest="abc")
    with pytest.raises(ValueError, match="map-style"):
        s.load_state_dict(ElasticSampler(60, 6, 0, 2).state_dict())
    with pytest.raises(ValueError, match="stream"):
        ElasticSampler(60, 6, 0, 2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="shards hold 61"):
        StreamSampler([30, 31], 6, 0, 2).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="another shard list"):
        StreamSampler([31, 29], 6, 0, 2, data_digest="xyz").load_state_dict(s.state_dict())
    broken = {**s.state_dict(), "offset": 12}
    with pytest.raises(ValueError, match="inconsistent"):
        StreamSampler([30, 30], 6, 0, 2).load_state_dict(broken)
    with pytest.raises(ValueError, match="not a position"):
        StreamSampler([30, 30], 6, 0, 2).load_state_dict({**s.state_dict(), "remaining": [[10, 5]]})
    with pytest.raises(ValueError, match="smaller than world_size"):
        StreamSampler([30, 30], 2, 0, 3)


def test_the_saved_seed_shuffle_and_buffer_win_with_a_warning(caplog):
    a = StreamSampler([50], 5, 0, 1, seed=1, buffer=10)
    a.commit_step()
    b = StreamSampler([50], 5, 0, 1, seed=2, buffer=20)
    with caplog.at_level(logging.WARNING):
        b.load_state_dict(a.state_dict())
    assert "keeps its order" in caplog.text
    assert (b.seed, b.buffer, b.offset) == (1, 10, 5) and b.batch_ids() == a.batch_ids()
