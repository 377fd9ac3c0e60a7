"""The re-form's state transfer: who serializes the state before the group forms (``early_state``),
and the format it travels in (``state_codec``: safetensors and JSON, decoded without running code).

The source of a quorum with receivers (a newcomer, a rank behind) serializes its state as soon as
the quorum is known, while it waits for the others to reach the new group; the bytes it then sends
decode to the state it had. The transfer itself runs in every live re-form of the end-to-end tests
(test_live_recovery.py, test_train_e2e.py)."""

from __future__ import annotations

import torch

from elastic_trainer.live.quorum import Member, Quorum
from elastic_trainer.training.state_codec import MAGIC, decode, encode
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

    threads = []

    def start_thread(name, target, *args):
        threads.append(name)
        target(*args)

    early = early_state(quorum(receivers=(2,), source=1), MEMBERS[1].id, state_dict, None, start_thread)
    assert early.q == 7 and calls == [1] and threads == ["live-encode-state"]
    data = early.result()
    got = decode(data.clone())
    assert torch.equal(got["model"]["w"], state()["model"]["w"]) and got["meta"] == {"step": 41, "epoch": 2}
    assert torch.equal(data, encode_state(state()))  # the bytes send_state would have made after forming


def _no_thread(name, target, *args):
    raise AssertionError(f"{name} started")


def test_an_encoding_that_failed_raises_on_the_training_thread():
    state = {"w": torch.ones(2)}
    early = early_state(quorum(receivers=(2,)), MEMBERS[0].id, lambda: state, None,
                        lambda name, target, *args: target({"bad": lambda: 0}))  # neither format holds it
    try:
        early.result()
    except Exception as exc:  # noqa: BLE001 - torch.save's pickling error, whatever its type
        assert "lambda" in str(exc) or "pickle" in str(exc).lower(), exc
    else:
        raise AssertionError("the encoding's error did not reach result()")


def test_no_early_state_on_other_ranks_without_receivers_or_for_sharded_states():
    never = lambda: (_ for _ in ()).throw(AssertionError("state_dict called"))  # noqa: E731
    assert early_state(quorum(receivers=(2,)), MEMBERS[1].id, never, None, _no_thread) is None  # not the source
    assert early_state(quorum(receivers=()), MEMBERS[0].id, never, None, _no_thread) is None  # nobody receives
    assert early_state(quorum(receivers=(2,)), MEMBERS[0].id, never, lambda q: {2: 0}, _no_thread) is None  # donors send later
    assert early_state(quorum(receivers=(2,)), MEMBERS[0].id, None, None, _no_thread) is None  # no state to send


def _roundtrip(state):
    return decode(encode(state).clone())  # as a receiver holds it: bytes of its own


def test_the_wire_format_round_trips_a_trainers_state_exactly():
    import random
    from collections import OrderedDict

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
             "rng": {"python": random.getstate(), "torch": torch.get_rng_state()},
             "odd": {"$key": 1, 3: (1, 2.5, None, True, "x"), "nan": float("nan"), "inf": float("-inf")},
             "dtypes": [torch.arange(3, dtype=d) for d in (torch.float16, torch.bfloat16, torch.int8, torch.float64)]
             + [torch.tensor([True, False]), torch.tensor(7), torch.zeros(0, 3)],
             "meta": {"step": 41, "epoch": 2}}
    data = encode(state)
    assert bytes(data[:8].numpy()) == MAGIC
    got = _roundtrip(state)
    assert got["rng"]["python"] == state["rng"]["python"] and torch.equal(got["rng"]["torch"], state["rng"]["torch"])
    assert isinstance(got["model"], OrderedDict) and got["model"]._metadata == state["model"]._metadata
    for k, v in state["model"].items():
        assert torch.equal(got["model"][k], v) and got["model"][k].dtype == v.dtype
    assert list(got["optimizer"]["state"]) == list(state["optimizer"]["state"])  # int keys stay ints
    assert got["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    for i, s in state["optimizer"]["state"].items():
        assert all(torch.equal(got["optimizer"]["state"][i][k], v) for k, v in s.items())
    odd = got["odd"]
    assert odd["$key"] == 1 and odd[3] == (1, 2.5, None, True, "x") and odd["inf"] == float("-inf")
    assert odd["nan"] != odd["nan"]
    for a, b in zip(got["dtypes"], state["dtypes"]):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    assert got["meta"] == {"step": 41, "epoch": 2}
    # a model loads what came, and the optimizer steps on from the same state
    twin = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 2))
    twin.load_state_dict(got["model"])
    twin_opt = torch.optim.AdamW(twin.parameters(), lr=0.1)
    twin_opt.load_state_dict(got["optimizer"])
    for m, o in ((model, opt), (twin, twin_opt)):
        o.zero_grad()
        torch.manual_seed(0)
        m(torch.randn(5, 4)).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))


def test_decoded_tensors_are_their_own_and_tied_weights_travel_once():
    w = torch.randn(4, 4)
    state = {"a": w, "b": w, "c": torch.ones(3)}
    payload = encode(state).clone()
    got = decode(payload)
    assert torch.equal(got["a"], w) and got["a"] is got["b"]
    payload.zero_()  # the received buffer goes; what was decoded stays
    assert torch.equal(got["a"], w) and torch.equal(got["c"], torch.ones(3))
    assert payload.numel() < 4 * 16 + 4 * 3 + 1024  # w once, not twice


def test_a_state_the_format_cannot_hold_goes_as_torch_save_wrote_it():
    view = torch.arange(10.0)
    state = {"complex": torch.ones(2, dtype=torch.complex64), "w": torch.ones(2)}
    data = encode(state)
    assert bytes(data[:8].numpy()) != MAGIC  # torch.save's bytes
    got = _roundtrip(state)
    assert torch.equal(got["complex"], state["complex"]) and torch.equal(got["w"], state["w"])
    shared = {"x": view[:5], "y": view[5:]}  # two views of one storage: safetensors refuses them
    got = _roundtrip(shared)
    assert torch.equal(got["x"], view[:5]) and torch.equal(got["y"], view[5:])


def test_late_keys_follow_the_rest_while_both_sides_run_collectives(tmp_path):
    """``send_states(late=...)`` in 3 real gloo ranks (donor 0 sends to 1 and 2): the receivers get
    the rest at once and a ``LateState`` for the late keys; all three run collectives on the same
    group while those bytes move; then the receivers' ``result()`` is the donor's tensors exactly
    and the donor's ``LateSend.wait()`` returns. A state without the late keys sends them none."""
    import subprocess
    import sys

    from tests.helpers.common import REPO

    script = tmp_path / "late.py"
    script.write_text('''
import torch, torch.distributed as dist
from elastic_trainer.training.state_transfer import LATE, LateSend, LateState, send_states
dist.init_process_group("gloo")
rank = dist.get_rank()
big = torch.arange(2_000_000, dtype=torch.float32)
state = {"meta": {"step": 9}, "shards": {"w": big}} if rank == 0 else None
got = send_states(state, {1: 0, 2: 0}, torch.device("cpu"), late=("shards",))
if rank == 0:
    assert isinstance(got, LateSend), got
else:
    assert got["meta"] == {"step": 9} and "shards" not in got and isinstance(got[LATE], LateState), got
for _ in range(3):
    t = torch.ones(1); dist.all_reduce(t); assert t.item() == 3
if rank == 0:
    got.wait()
else:
    assert torch.equal(got[LATE].result()["shards"]["w"], big)
plain = send_states({"meta": {"step": 9}} if rank == 0 else None, {1: 0, 2: 0}, torch.device("cpu"), late=("shards",))
assert plain is None if rank == 0 else LATE not in plain, plain
dist.barrier()
print("LATE OK")
''')
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                           str(script)], cwd=REPO, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0 and proc.stdout.count("LATE OK") == 3, proc.stderr[-3000:]
