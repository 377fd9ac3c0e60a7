"""The re-form's state transfer: who serializes the state before the group forms (``early_state``).

The source of a quorum with receivers (a newcomer, a rank behind) serializes its state as soon as
the quorum is known, while it waits for the others to reach the new group; the bytes it then sends
decode to the state it had. The transfer itself runs in every live re-form of the end-to-end tests
(test_live_recovery.py, test_train_e2e.py)."""

from __future__ import annotations

import torch

from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.storage import PartsReader
from elastic_trainer.training.state_transfer import early_state, encode_state

MEMBERS = tuple(Member(f"n{i}-0-1", f"n{i}", 0, f"127.0.0.1:{4000 + i}") for i in range(3))


def quorum(receivers: tuple[int, ...], source: int = 0) -> Quorum:
    return Quorum(q=7, members=MEMBERS, step=41, source=source, receivers=receivers, cause="test")


def state() -> dict:
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "meta": {"step": 41, "epoch": 2}, "rng": (1, 2, 3)}


def test_the_source_of_a_quorum_with_receivers_serializes_its_state_before_the_group_forms():
    calls = []

    def state_dict() -> dict:
        calls.append(1)
        return state()

    q, data = early_state(quorum(receivers=(2,), source=1), MEMBERS[1].id, state_dict, None)
    assert q == 7 and calls == [1]
    got = torch.load(PartsReader([memoryview(data.numpy())]), weights_only=True)
    assert torch.equal(got["model"]["w"], state()["model"]["w"]) and got["meta"] == {"step": 41, "epoch": 2}
    assert torch.equal(data, encode_state(state()))  # the bytes send_state would have made after forming


def test_no_early_state_on_other_ranks_without_receivers_or_for_sharded_states():
    never = lambda: (_ for _ in ()).throw(AssertionError("state_dict called"))  # noqa: E731
    assert early_state(quorum(receivers=(2,)), MEMBERS[1].id, never, None) is None  # not the source
    assert early_state(quorum(receivers=()), MEMBERS[0].id, never, None) is None  # nobody receives
    assert early_state(quorum(receivers=(2,)), MEMBERS[0].id, never, lambda q: {2: 0}) is None  # donors send later
    assert early_state(quorum(receivers=(2,)), MEMBERS[0].id, None, None) is None  # no state to send
