"""Every rank's own RNG state (elastic_trainer/training/rng.py, checkpoint.capture_rng_state):
which saved state each rank restores, at the same and at another world size, and the CUDA
generator of the process's own device (``gpu`` tests, skipped without CUDA)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from elastic_trainer.checkpoint import capture_rng_state, restore_rng_state
from elastic_trainer.training.rng import gather_rng_states, rng_state_for_rank

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _state_after(seed: int) -> dict:
    random.seed(seed), np.random.seed(seed), torch.manual_seed(seed)
    return capture_rng_state(torch.device("cpu"))


def _draws() -> tuple:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_each_rank_takes_its_own_saved_state_and_new_ranks_take_rank_0s():
    states = [_state_after(s) for s in (10, 11, 12)]
    saved = {"ranks": states}
    for rank in range(3):
        assert rng_state_for_rank(saved, rank) is states[rank]
    assert rng_state_for_rank(saved, 5) is states[0]  # the world grew: as every rank at a fresh start
    assert rng_state_for_rank({"ranks": [states[1]]}, 1) is states[1]  # a one-state save (live peer, lost peer)
    assert rng_state_for_rank({"ranks": [states[1]]}, 0) is states[1]
    assert rng_state_for_rank(states[2], 1) is states[2]  # an older checkpoint: one state for every rank
    with pytest.raises(ValueError, match="no entry for rank 0"):
        rng_state_for_rank({"ranks": []}, 0)


def test_restoring_a_ranks_state_replays_its_draws_and_not_another_ranks():
    own, other = _state_after(1), _state_after(2)
    restore_rng_state(own, torch.device("cpu"))
    want = _draws()
    restore_rng_state(rng_state_for_rank({"ranks": [other, own]}, 1), torch.device("cpu"))
    got = _draws()
    assert got[0] == want[0] and got[1] == want[1] and torch.equal(got[2], want[2])
    restore_rng_state(rng_state_for_rank({"ranks": [other, own]}, 0), torch.device("cpu"))
    assert not torch.equal(_draws()[2], want[2])


def test_a_cpu_process_captures_no_cuda_state_and_ignores_a_saved_one():
    state = capture_rng_state(torch.device("cpu"))
    assert "cuda" not in state
    restore_rng_state({**state, "cuda": torch.zeros(16, dtype=torch.uint8)}, torch.device("cpu"))


def test_without_a_process_group_the_gather_is_this_process_alone():
    got = gather_rng_states(torch.device("cpu"), gather=True)
    assert list(got) == ["ranks"] and len(got["ranks"]) == 1
    assert torch.equal(got["ranks"][0]["torch"], torch.get_rng_state())


@pytest.mark.gpu
@needs_cuda
def test_cuda_state_is_the_own_devices_generator_and_goes_back_to_it():
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    torch.cuda.manual_seed_all(3)
    torch.rand(1000, device=device)  # this device's generator moves; the others stay at the seed
    state = capture_rng_state(device)
    assert isinstance(state["cuda"], torch.Tensor) and torch.equal(state["cuda"], torch.cuda.get_rng_state(device))
    want = torch.rand(5, device=device)
    torch.cuda.manual_seed_all(9)
    restore_rng_state(state, device)
    assert torch.equal(torch.rand(5, device=device), want)
