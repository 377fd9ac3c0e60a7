"""Properties of the elastic sampler: exactly-once per epoch across restarts at any world size.

Run:  .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_sampler.py
(add ``-s -k distributed_sampler`` to print the DistributedSampler comparison table of docs/sampler.md)
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from elastic_trainer.sampler import (
    ElasticSampler,
    epoch_permutation,
    loss_weight,
    micro_batch_count,
    share_of_batch,
)
from tests.helpers.world_changes import world_segments

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class IndexDataset(Dataset):
    """Sample ``i`` is ``i`` itself, so a batch shows which indices a loader delivered."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


# ---- the split of one global batch --------------------------------------------------------------
@settings(max_examples=200, **SETTINGS)
@given(b=st.integers(1, 300), w=st.integers(1, 40))
def test_share_of_batch_covers_the_global_batch_once_in_rank_order(b, w):
    shares = [share_of_batch(b, w, r) for r in range(w)]
    pos = 0
    for r, (start, length) in enumerate(shares):
        assert start == pos
        assert length == b // w + (1 if r < b % w else 0)
        pos += length
    assert pos == b


@settings(max_examples=200, **SETTINGS)
@given(b=st.integers(1, 200), w=st.integers(1, 16), m=st.none() | st.integers(1, 40), data=st.data())
def test_micro_batches_split_the_share_within_size_and_equal_count_on_ranks(b, w, m, data):
    if b < w:
        return
    n = data.draw(st.integers(b, 3 * b))
    counts = []
    for r in range(w):
        s = ElasticSampler(n, b, r, w, micro_batch_size=m, shuffle=False)
        micro = s.batches_for_step(0)
        start, length = share_of_batch(b, w, r)
        assert [i for mb in micro for i in mb] == list(range(start, start + length))
        assert all(len(mb) >= 1 for mb in micro)
        assert m is None or all(len(mb) <= m for mb in micro)
        assert len(micro) == s.micro_batches_per_step == micro_batch_count(b, w, r, m)
        counts.append(len(micro))
    if not (m == 1 and b % w):
        assert len(set(counts)) == 1, "every rank must run the same number of micro-batches (FSDP)"
    assert ElasticSampler(n, b, w - 1, w, micro_batch_size=m).lockstep_micro_batches == max(counts)


def test_global_batch_smaller_than_world_size_is_refused_with_a_sentence():
    assert share_of_batch(3, 5, 4) == (3, 0)
    with pytest.raises(ValueError, match="global_batch_size=3 is smaller than world_size=5"):
        ElasticSampler(100, 3, 0, 5)
    with pytest.raises(ValueError, match="dataset_len=10 is smaller than global_batch_size=16"):
        ElasticSampler(10, 16, 0, 1)
    with pytest.raises(ValueError, match="rank must be in"):
        ElasticSampler(100, 8, 2, 2)
    with pytest.raises(ValueError, match="micro_batch_size"):
        ElasticSampler(100, 8, 0, 2, micro_batch_size=0)


# ---- the permutation ----------------------------------------------------------------------------
@settings(max_examples=40, **SETTINGS)
@given(n=st.integers(1, 500), seed=st.integers(0, 2**40), epoch=st.integers(0, 50), w=st.integers(1, 8))
def test_every_rank_sees_the_same_permutation(n, seed, epoch, w):
    w = min(w, n)
    perms = []
    for r in range(w):
        s = ElasticSampler(n, w, r, w, seed=seed)
        s.set_epoch(epoch)
        perms.append(s.permutation())
    assert all(torch.equal(p, perms[0]) for p in perms)
    assert sorted(perms[0].tolist()) == list(range(n))


def test_permutation_is_the_same_in_another_process_and_differs_per_epoch():
    code = "from elastic_trainer.sampler import epoch_permutation as p; print(p(1000, 7, 3).tolist())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(out.stdout) == epoch_permutation(1000, 7, 3).tolist()
    assert not torch.equal(epoch_permutation(1000, 7, 3), epoch_permutation(1000, 7, 4))
    # (seed, epoch) is hashed: seed+1/epoch-1 is not the same stream (DistributedSampler's seed+epoch is).
    assert not torch.equal(epoch_permutation(1000, 8, 2), epoch_permutation(1000, 7, 3))
    assert epoch_permutation(10, 7, 3, shuffle=False).tolist() == list(range(10))


# ---- exactly once over restarts at changing world sizes -----------------------------------------
def simulate(n, seed, micro, segments, epochs=2, shuffle=True):
    """Run ``segments`` of (world_size, global_batch, steps, lost) over ``epochs`` epochs.

    Each segment builds the samplers of all ranks from the last saved state, runs ``steps``
    optimizer steps (each rank iterates its micro-batches, then every rank commits), saves the
    state after each of the first ``steps - lost`` of them, and "crashes": the last ``lost`` steps and whatever the
    loaders prefetched are not in the saved model, so they do not count (the ledger's lineage
    rule). Returns {epoch: [indices in the order the counted steps consumed them]}.
    """
    state = None
    counted = defaultdict(list)
    for w, b, steps, lost in segments:
        samplers = [ElasticSampler(n, b, r, w, seed=seed, micro_batch_size=micro, shuffle=shuffle) for r in range(w)]
        if state is not None:
            for s in samplers:
                s.load_state_dict(json.loads(json.dumps(state)))  # through a checkpoint's plain values
        assert len({(s.epoch, s.offset) for s in samplers}) == 1
        iters = [iter(s) for s in samplers]
        done = []
        for _ in range(steps):
            if samplers[0].epoch >= epochs:
                break
            epoch, batch = samplers[0].epoch, []
            for s, it in zip(samplers, iters):
                for _ in range(s.micro_batches_per_step):
                    mb = next(it)
                    assert 1 <= len(mb) <= (micro or b)
                    batch += mb
            assert len(batch) == b
            for s in samplers:
                s.commit_step()
            if samplers[0].offset == 0:  # the epoch rolled over: its iterators are exhausted
                for it in iters:
                    assert next(it, None) is None
                iters = [iter(s) for s in samplers]
            done.append((epoch, batch))
            if len(done) <= steps - lost:  # a checkpoint after this step
                counted[epoch] += batch
                state = samplers[0].state_dict()
        for it in iters:  # prefetched but never trained on: must not matter
            next(it, None)
    return counted


def check_exactly_once(n, seed, counted, epochs, max_batch, drop, shuffle=True):
    for e in range(epochs):
        perm = epoch_permutation(n, seed, e, shuffle).tolist()
        got = counted[e]
        assert len(got) == len(set(got)), f"epoch {e}: a sample was consumed twice"
        assert sorted(got) == sorted(perm[: len(got)]), f"epoch {e}: consumed a multiset other than a prefix"
        assert got == perm[: len(got)], f"epoch {e}: consumed out of permutation order"
        if drop is not None:
            assert len(got) == n - drop, f"epoch {e}: skipped samples beyond the dropped tail"
        else:
            assert 0 <= n - len(got) < max_batch


@st.composite
def elastic_runs(draw, vary_batch=False):
    n = draw(st.integers(1, 160))
    b0 = draw(st.integers(1, min(n, 24)))
    seed = draw(st.integers(0, 2**31))
    micro = draw(st.none() | st.integers(1, 8))
    segments = draw(world_segments(n, b0, vary_batch))
    return n, b0, seed, micro, segments


@settings(max_examples=120, **SETTINGS)
@given(run=elastic_runs(), shuffle=st.booleans())
def test_resume_at_any_world_size_consumes_every_sample_once_per_epoch(run, shuffle):
    n, b, seed, micro, segments = run
    counted = simulate(n, seed, micro, segments, epochs=2, shuffle=shuffle)
    # The dropped tail is the documented remainder: n % b samples, the last of each epoch's permutation.
    check_exactly_once(n, seed, counted, 2, b, drop=n % b, shuffle=shuffle)
    assert len(counted[0]) == (n // b) * b


@settings(max_examples=50, **SETTINGS)
@given(run=elastic_runs(vary_batch=True))
def test_resume_with_a_changed_global_batch_continues_at_the_sample_offset(run):
    n, b, seed, micro, segments = run
    counted = simulate(n, seed, micro, segments, epochs=2)
    check_exactly_once(n, seed, counted, 2, max(s[1] for s in segments), drop=None)


def test_shrink_and_grow_by_hand_gives_exactly_the_first_steps_of_the_permutation():
    n, b = 2048, 64
    counted = simulate(n, 0, 32, [(2, b, 20, 0), (1, b, 6, 0), (2, b, 10**6, 0)], epochs=1)
    assert counted[0] == epoch_permutation(n, 0, 0).tolist()


# ---- iteration, epochs, state -------------------------------------------------------------------
def test_a_new_iterator_starts_at_the_committed_offset_not_where_the_old_one_was():
    s = ElasticSampler(40, 8, 1, 2, seed=3, micro_batch_size=2)
    it = iter(s)
    seen = [next(it) for _ in range(5)]  # 2.5 steps prefetched, only 2 committed
    assert seen[:4] == s.batches_for_step(0) + s.batches_for_step(1)
    s.commit_step()
    s.commit_step()
    assert (s.epoch, s.offset, s.step_in_epoch, s.remaining_steps, len(s)) == (0, 16, 2, 3, 6)
    assert list(iter(s)) == [mb for k in (2, 3, 4) for mb in s.batches_for_step(k)]
    it = iter(s)  # the position is taken when iter() is called, not at the first next()
    s.commit_step()
    assert next(it) == s.batches_for_step(2)[0]


def test_commit_rolls_to_the_next_epoch_and_set_epoch_keeps_a_resumed_offset():
    s = ElasticSampler(10, 3, 0, 1, seed=1)
    assert s.steps_per_epoch == 3
    for _ in range(3):
        s.commit_step()
    assert (s.epoch, s.offset) == (1, 0)
    s.commit_step()
    s.set_epoch(1)  # the trainer's epoch loop after a resume: a no-op
    assert (s.epoch, s.offset) == (1, 3)
    s.set_epoch(2)
    assert (s.epoch, s.offset) == (2, 0)
    assert list(s)[0] == epoch_permutation(10, 1, 2)[:3].tolist()
    with pytest.raises(ValueError):
        s.set_epoch(-1)


def test_state_dict_is_plain_json_and_restores_at_another_world_size():
    a = ElasticSampler(100, 12, 0, 3, seed=5, micro_batch_size=4)
    a.set_epoch(2)
    for _ in range(4):
        a.commit_step()
    state = json.loads(json.dumps(a.state_dict()))
    assert {k: state[k] for k in ("epoch", "offset", "seed", "dataset_len", "global_batch_size")} == {
        "epoch": 2, "offset": 48, "seed": 5, "dataset_len": 100, "global_batch_size": 12}
    b = ElasticSampler(100, 12, 3, 4, seed=5)
    b.load_state_dict(state)
    assert (b.epoch, b.offset) == (2, 48)
    assert list(b)[0] == epoch_permutation(100, 5, 2)[48 + 9 : 48 + 12].tolist()


def test_loading_a_state_for_another_dataset_is_refused_and_the_saved_seed_wins():
    s = ElasticSampler(100, 10, 0, 1, seed=1)
    with pytest.raises(ValueError, match="dataset of 100 samples but this dataset has 90"):
        ElasticSampler(90, 10, 0, 1).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="lacks"):
        s.load_state_dict({"epoch": 1})
    t = ElasticSampler(100, 10, 0, 1, seed=2)
    t.load_state_dict(s.state_dict())
    assert t.seed == 1 and torch.equal(t.permutation(), s.permutation())


def test_loading_with_a_larger_batch_than_is_left_moves_to_the_next_epoch():
    s = ElasticSampler(100, 10, 0, 1)
    for _ in range(8):
        s.commit_step()
    t = ElasticSampler(100, 30, 0, 1)
    t.load_state_dict(s.state_dict())
    assert (t.epoch, t.offset) == (1, 0)


# ---- DataLoader ---------------------------------------------------------------------------------
def _loader_batches(num_workers: int) -> list[list[int]]:
    sampler = ElasticSampler(50, 7, 1, 3, seed=11, micro_batch_size=2)
    loader = DataLoader(IndexDataset(50), batch_sampler=sampler, num_workers=num_workers)
    out = []
    it = iter(loader)
    for _ in range(2):  # two steps, then the "trainer" drops the iterator (prefetched batches are lost)
        for _ in range(sampler.micro_batches_per_step):
            out.append(next(it).tolist())
        sampler.commit_step()
    del it
    while sampler.epoch < 2:  # a fresh iterator per epoch, from the committed offset
        it = iter(loader)
        assert len(loader) == sampler.remaining_steps * sampler.micro_batches_per_step
        for _ in range(sampler.remaining_steps):
            for _ in range(sampler.micro_batches_per_step):
                out.append(next(it).tolist())
            sampler.commit_step()
    return out


@pytest.mark.timeout(180)
def test_dataloader_with_0_and_2_workers_yields_the_same_batches_as_the_sampler():
    expected_sampler = ElasticSampler(50, 7, 1, 3, seed=11, micro_batch_size=2)
    expected = [mb for e in (0, 1) for k in range(7) for mb in expected_sampler.batches_for_step(k, epoch=e)]
    assert _loader_batches(0) == expected
    assert _loader_batches(2) == expected


# ---- the loss weight ----------------------------------------------------------------------------
@settings(max_examples=25, **SETTINGS)
@given(b=st.integers(1, 40), w=st.integers(1, 9), micro=st.none() | st.integers(1, 6), seed=st.integers(0, 1000))
def test_weighted_micro_batch_losses_averaged_over_ranks_give_the_full_batch_gradient(b, w, micro, seed):
    if b < w:
        return
    gen = torch.Generator().manual_seed(seed)
    n, d = b + 5, 3
    x, y = torch.randn(n, d, generator=gen, dtype=torch.float64), torch.randn(n, generator=gen, dtype=torch.float64)
    w0 = torch.randn(d, generator=gen, dtype=torch.float64)

    def grad(indices, weight):
        p = w0.clone().requires_grad_(True)
        (((x[indices] @ p - y[indices]) ** 2).mean() * weight).backward()
        return p.grad

    batch = ElasticSampler(n, b, 0, w, seed=seed).global_batch_at(0)
    full = grad(batch, 1.0)
    ranks = []
    for r in range(w):
        s = ElasticSampler(n, b, r, w, seed=seed, micro_batch_size=micro)
        ranks.append(sum(grad(mb, loss_weight(len(mb), b, w)) for mb in s.micro_batches_at(0)))
    ddp = sum(ranks) / w  # what DDP's all-reduce average hands every rank
    torch.testing.assert_close(ddp, full, rtol=1e-10, atol=1e-12)


def test_without_the_weight_an_uneven_split_biases_the_gradient():
    b, w = 7, 3
    x, y = torch.arange(8.0, dtype=torch.float64).unsqueeze(1), torch.zeros(8, dtype=torch.float64)
    p0 = torch.ones(1, dtype=torch.float64)

    def grad(idx, weight):
        p = p0.clone().requires_grad_(True)
        (((x[idx] @ p - y[idx]) ** 2).mean() * weight).backward()
        return p.grad

    batch = ElasticSampler(8, b, 0, w, shuffle=False).global_batch_at(0)
    full = grad(batch, 1.0)
    parts = [ElasticSampler(8, b, r, w, shuffle=False, micro_batch_size=2).micro_batches_at(0) for r in range(w)]
    weighted = sum(grad(mb, loss_weight(len(mb), b, w)) for mbs in parts for mb in mbs) / w
    naive = sum(grad(mb, 1.0 / len(mbs)) for mbs in parts for mb in mbs) / w
    torch.testing.assert_close(weighted, full)
    assert not torch.allclose(naive, full)


# ---- why: DistributedSampler's numbers ----------------------------------------------------------
def distributed_sampler_resume(n, per_rank_batch, w_before, w_after, steps, mode):
    """Stop an epoch of ``DistributedSampler`` after ``steps`` steps at ``w_before`` ranks and resume at
    ``w_after``, either skipping ``steps`` steps (``mode="skip"``) or restarting the epoch. Returns
    (repeated, skipped) sample counts over the epoch."""
    def shard(w, r):
        return list(DistributedSampler(IndexDataset(n), num_replicas=w, rank=r, shuffle=True, seed=0))

    seen = [i for r in range(w_before) for i in shard(w_before, r)[: steps * per_rank_batch]]
    start = steps * per_rank_batch if mode == "skip" else 0
    seen += [i for r in range(w_after) for i in shard(w_after, r)[start:]]
    return len(seen) - len(set(seen)), n - len(set(seen))


def elastic_resume(n, global_batch, w_before, w_after, steps, micro):
    counted = simulate(n, 0, micro, [(w_before, global_batch, steps, 0), (w_after, global_batch, 10**6, 0)], epochs=1)
    seen = counted[0]
    return len(seen) - len(set(seen)), n - len(set(seen))


def test_distributed_sampler_resume_repeats_or_skips_and_the_elastic_sampler_does_not():
    n, per_rank = 2048, 32  # the seed scripts' dataset and per-rank batch
    rows = [
        ("2 -> 1 after 20 steps", 2, 1, 20, (640, 0), (1280, 0)),
        ("1 -> 2 after 6 steps", 1, 2, 6, (0, 192), (192, 0)),
    ]
    print("\n| change | DistributedSampler, skip steps | DistributedSampler, restart epoch | ElasticSampler |")
    for name, wb, wa, steps, skip_expected, restart_expected in rows:
        skip = distributed_sampler_resume(n, per_rank, wb, wa, steps, "skip")
        restart = distributed_sampler_resume(n, per_rank, wb, wa, steps, "restart")
        ours = elastic_resume(n, per_rank * wb, wb, wa, steps, micro=per_rank)
        print(f"| {name} | {skip[0]} repeated, {skip[1]} skipped | {restart[0]} repeated, {restart[1]} skipped "
              f"| {ours[0]} repeated, {ours[1]} skipped |")
        assert skip == skip_expected
        assert restart == restart_expected
        assert ours == (0, 0)


# ---- a step that some ranks sit out (a live join's newcomers, at weight zero) --------------------
@settings(max_examples=150, **SETTINGS)
@given(b=st.integers(2, 60), w=st.integers(2, 9), m=st.none() | st.integers(1, 8), data=st.data())
def test_a_step_sat_out_by_some_ranks_is_shared_by_the_others_and_the_next_by_all(b, w, m, data):
    """``sit_out(ranks)``: the next step's global batch goes whole to the other ranks, once each
    sample, in rank order; the ranks that sit out get none (0 micro-batches); every rank agrees on
    the step's lockstep count (the most any rank runs); the step after is every rank's as usual,
    and so is a new iterator's stream after it. The loss weights still give the global batch's mean."""
    if b < w:
        return
    n = data.draw(st.integers(2 * b, 4 * b))
    out = data.draw(st.lists(st.integers(0, w - 1), min_size=1, max_size=w - 1, unique=True))
    if w - len(out) > b:
        return
    samplers = [ElasticSampler(n, b, r, w, micro_batch_size=m, seed=3) for r in range(w)]
    for s in samplers:
        s.sit_out(out)
    batch = samplers[0].global_batch_at(0)
    steps = [s.micro_batches_at(0) for s in samplers]
    assert [i for mbs in steps for mb in mbs for i in mb] == batch, "the sat-out step's batch, once, in rank order"
    for r, s in enumerate(samplers):
        assert s.micro_batches_per_step == len(steps[r]) and (r not in out or not steps[r])
        assert m is None or all(1 <= len(mb) <= m for mb in steps[r])
    assert {s.lockstep_micro_batches for s in samplers} == {max(len(x) for x in steps)}
    # each micro-batch's mean loss times its weight, averaged over all w ranks (DDP's and FSDP's
    # reduction; a rank that sits out adds 0): the global batch's mean, for any per-sample loss
    mean = sum(loss_weight(len(mb), b, w) * sum(i + 1.0 for i in mb) / len(mb) for mbs in steps for mb in mbs) / w
    assert abs(mean - sum(i + 1.0 for i in batch) / b) < 1e-9 * n
    iterated = [list(iter(s)) for s in samplers]  # the iterators read the sat-out step, then the usual split
    for r, s in enumerate(samplers):
        assert iterated[r][:len(steps[r])] == steps[r]
        plain = ElasticSampler(n, b, r, w, micro_batch_size=m, seed=3)
        assert iterated[r][len(steps[r]):] == list(plain._iter_from(0, b))
        s.commit_step()
        assert s.micro_batches_per_step == plain.micro_batches_per_step
        assert s.lockstep_micro_batches == plain.lockstep_micro_batches
        assert s.micro_batches_at(b) == plain.micro_batches_at(b)
        assert s.state_dict() == {**plain.state_dict(), "offset": b}


def test_sitting_out_needs_a_rank_with_samples_and_a_reshard_forgets_it():
    s = ElasticSampler(40, 8, 0, 3)
    with pytest.raises(ValueError, match="between 1 and 8 ranks"):
        s.sit_out([0, 1, 2])
    s.sit_out([0])
    assert s.micro_batches_per_step == 0 and len(s) == (40 // 8 - 1) * 1
    s.reshard(0, 3)
    assert s.micro_batches_per_step == 1
    s.sit_out([])
    assert s.micro_batches_per_step == 1
