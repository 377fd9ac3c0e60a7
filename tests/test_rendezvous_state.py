"""Hostile state: whatever bytes are in the run's state key, ``decode_state`` either returns a
state within bounds or refuses it with ``RendezvousStateError`` (the rendezvous's own error type),
never a stray ``ValueError``, ``RecursionError`` or ``MemoryError``. Property-tested with hypothesis;
no etcd needed (the bytes are what an attacker with write access to the key could put there)."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.elastic.rendezvous.api import RendezvousStateError

from elastic_trainer.rendezvous.state import (
    MAX_INT,
    MAX_STATE_BYTES,
    decode_state,
    encode_state,
    parse_node_name,
)
from elastic_trainer.torch_private import NodeDesc, RendezvousState

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

nodes = st.builds(NodeDesc, st.text(min_size=1, max_size=20), st.integers(0, MAX_INT), st.integers(0, 8))


@st.composite
def states(draw) -> RendezvousState:
    state = RendezvousState()
    state.round = draw(st.integers(0, MAX_INT))
    state.complete, state.closed = draw(st.booleans()), draw(st.booleans())
    state.deadline = draw(st.none() | st.datetimes(timezones=st.just(timezone.utc)))
    state.participants = draw(st.dictionaries(nodes, st.integers(0, MAX_INT), max_size=5))
    state.wait_list = draw(st.sets(nodes, max_size=3))
    state.redundancy_list = draw(st.sets(nodes, max_size=3))
    return state


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=30)


def _decodes_or_refuses(data: bytes) -> RendezvousState | None:
    try:
        state = decode_state(data)
    except RendezvousStateError:
        return None
    assert 0 <= state.round <= MAX_INT
    assert all(0 <= rank <= MAX_INT for rank in state.participants.values())
    assert all(0 <= n.pid <= MAX_INT and 0 <= n.local_id <= MAX_INT
               for n in (*state.participants, *state.wait_list, *state.redundancy_list))
    return state


@SETTINGS
@given(states())
def test_every_valid_state_round_trips(state):
    back = decode_state(encode_state(state))
    assert (back.round, back.complete, back.closed, back.deadline) == \
        (state.round, state.complete, state.closed, state.deadline)
    assert back.participants == state.participants
    assert back.wait_list == state.wait_list and back.redundancy_list == state.redundancy_list


@SETTINGS
@given(st.binary(max_size=200))
def test_arbitrary_bytes_are_decoded_or_refused(data):
    _decodes_or_refuses(data)


@SETTINGS
@given(json_values)
def test_arbitrary_json_is_decoded_or_refused(value):
    _decodes_or_refuses(json.dumps(value).encode())


FIELDS = ["round", "complete", "closed", "deadline", "participants", "wait_list", "redundancy_list"]


@SETTINGS
@given(states(), st.sampled_from(FIELDS), json_values)
def test_a_valid_state_with_one_field_replaced_is_decoded_within_bounds_or_refused(state, field, value):
    doc = json.loads(encode_state(state))
    doc[field] = value
    _decodes_or_refuses(json.dumps(doc).encode())


@SETTINGS
@given(states(), st.integers(0, 2), st.sampled_from(["addr", "pid", "local_id", "rank"]), json_values)
def test_a_node_or_rank_replaced_by_anything_is_decoded_within_bounds_or_refused(state, which, part, value):
    state.participants[NodeDesc("n", 1, 0)] = 0
    doc = json.loads(encode_state(state))
    entry = doc["participants"][min(which, len(doc["participants"]) - 1)]
    if part == "rank":
        entry[1] = value
    else:
        entry[0][part] = value
    _decodes_or_refuses(json.dumps(doc).encode())


def _valid_doc() -> dict:
    state = RendezvousState()
    state.participants = {NodeDesc("h", 10, 0): 0}
    state.deadline = datetime(2026, 1, 1, tzinfo=timezone.utc)
    return json.loads(encode_state(state))


def _with(**fields) -> bytes:
    data = json.dumps({**_valid_doc(), **fields}, separators=(",", ":")).encode()
    assert b'"round":' in data and b'"wait_list":' in data  # what the byte-level cases replace
    return data


HOSTILE = {
    "deep_nesting": b"[" * 100_000 + b"]" * 100_000,
    "deep_nesting_in_a_field": _with().replace(b'"wait_list":[]', b'"wait_list":' + b"[" * 50_000 + b"]" * 50_000),
    "huge_integer_text": _with().replace(b'"round":0', b'"round":' + b"9" * 5000),
    "huge_round": _with(round=2**70),
    "negative_round": _with(round=-1),
    "negative_rank": _with(participants=[[{"addr": "h", "pid": 10, "local_id": 0}, -3]]),
    "huge_rank": _with(participants=[[{"addr": "h", "pid": 10, "local_id": 0}, 2**80]]),
    "negative_pid": _with(participants=[[{"addr": "h", "pid": -10, "local_id": 0}, 0]]),
    "bool_as_rank": _with(participants=[[{"addr": "h", "pid": 10, "local_id": 0}, True]]),
    "string_round": _with(round="1"),
    "oversize": _with(wait_list=[{"addr": "x" * 1000, "pid": i, "local_id": 0} for i in range(5000)]),
    "oversize_addr": _with(wait_list=[{"addr": "x" * 100_000, "pid": 1, "local_id": 0}]),
    "deadline_out_of_range": _with(deadline="99999-01-01T00:00:00+00:00"),
    "deadline_not_a_time": _with(deadline=12),
    "version_true": _with(version=True),
    "nan": _with().replace(b'"round":0', b'"round":NaN'),
    "infinity_as_pid": _with().replace(b'"pid":10', b'"pid":Infinity'),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_state_is_refused_with_the_rendezvous_error(name):
    with pytest.raises(RendezvousStateError, match="not valid elastic-trainer JSON state"):
        decode_state(HOSTILE[name])


def test_the_size_limit_is_far_above_a_thousand_node_state():
    state = RendezvousState()
    state.participants = {NodeDesc(f"node-{i:04d}.cluster.local", 100_000 + i, 0): i for i in range(1000)}
    data = encode_state(state)
    assert len(data) * 10 < MAX_STATE_BYTES and len(decode_state(data).participants) == 1000


@SETTINGS
@given(st.text(max_size=40))
def test_any_joining_key_name_is_parsed_within_bounds_or_ignored(name):
    # Names of joining/<node> keys: whoever can write under the run's prefix chooses them.
    node = parse_node_name(name)
    assert node is None or (0 <= node.pid <= MAX_INT and 0 <= node.local_id <= MAX_INT and node.addr)


@pytest.mark.parametrize("name", ["h_\u00b2_0", "h_1_\u0663", "h_99999999999999999999_0", "_1_0", "h_-1_0"])
def test_hostile_joining_key_names_are_ignored(name):
    assert parse_node_name(name) is None
