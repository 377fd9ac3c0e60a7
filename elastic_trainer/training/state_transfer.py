"""State transfer: a live rank's training state sent point to point to the ranks that need it.

After a re-form the quorum continues at the highest step any survivor reported; the ranks behind
it and the newcomers (``Quorum.receivers``) receive the state of one rank that completed it
(``Quorum.source``), over the new process group, never from storage (``send_state``). A sharded
state (HSDP, ``training/hsdp.py``) has no single source: each receiver gets its part from the rank
that holds the same part (``donors``: receiver rank -> donor rank), every donor sending side by side
(``send_states``). ``transfer`` is what a re-form runs: the plan, its checks, and the sends.

The state is whatever the loop's ``state_dict()`` returns (``torch.save``-able: tensors, numbers,
nested dicts); it is serialized once on the sender (``state_codec.py``: safetensors and JSON, so
that a receiver decodes it in a few milliseconds and runs no code from it) and decoded on each
receiver.

Some keys of it may come **late** (``late``: a join's bulk, HSDP's shards): the rest is sent as
above, with those keys' skeleton and their tensors' shapes (``state_codec.split``), and their
tensors follow in the background, as they are, without a copy or an encoding (``isend``/``irecv``
on the same group, posted at once; the receiver finds a ``LateState`` under ``LATE``, the sender
gets a ``LateSend``), so that both go on with their step while the bytes move, and each waits for
them only where it must (``Manager.commit_point``, before the optimizer step: the receiver needs
them, the sender's step would change them).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from elastic_trainer.live.quorum import Quorum
from elastic_trainer.training import state_codec


def encode_state(state: dict) -> torch.Tensor:
    """``state`` serialized into one byte tensor, as ``send_state`` sends it (``state_codec.py``)."""
    return state_codec.encode(state)


LATE = "__late__"
"""The key under which a receiver's state holds its ``LateState`` (``send_state(late=...)``)."""


class LateState:
    """The keys of a state that follow the rest (``send_state(late=...)``), being received in the
    background into tensors of their own: ``result()`` waits for them (a dict of those keys)."""

    def __init__(self, src: int, skeleton, layout: list[list]) -> None:
        self._skeleton, self._tensors = skeleton, state_codec.buffers(layout)
        self._works = [dist.irecv(t.reshape(-1), src=src) for t in self._tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in self._tensors)
        """The bytes that come."""

    def result(self) -> dict:
        """The late keys (waits until they arrived; raises if the transfer failed: a lost sender)."""
        for work in self._works:
            work.wait()
        return state_codec.join(self._skeleton, self._tensors)


class LateSend:
    """A sender's late keys in flight to its receivers (``send_state(late=...)``): its own tensors,
    uncopied, which must not change before ``wait()`` returns."""

    def __init__(self, tensors: list[torch.Tensor], receivers: Sequence[int]) -> None:
        self._tensors = tensors
        self._works = [dist.isend(t.reshape(-1), dst=dst) for dst in receivers for t in tensors]

    def wait(self) -> None:
        """Until every receiver has them (raises if a transfer failed: a lost receiver)."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self._tensors = []


def send_state(state: dict | None, src: int, receivers: Sequence[int], device: torch.device, *,
               encoded: torch.Tensor | None = None, late: Sequence[str] = ()) -> dict | LateSend | None:
    """Send ``state`` from rank ``src`` to each rank in ``receivers`` (point to point: other ranks
    neither receive nor decode it). Returns the state on the receivers, None elsewhere.
    ``encoded``: ``encode_state(state)``, made beforehand (the sender then passes no ``state``).
    ``late``: keys of ``state`` sent after the rest, in the background (the module docstring): the
    receivers' state holds a ``LateState`` under ``LATE`` instead of them, and the sender gets
    a ``LateSend`` (None when ``state`` has none of those keys). They must be what
    ``state_codec.split`` can cut, in CPU memory (gloo): else ValueError, before anything is sent.

    Peak extra memory: on the sender the serialized state (twice, for a moment, while
    ``state_codec.encode`` joins its parts); on a receiver the received bytes and the decoded state."""
    rank = dist.get_rank()
    if rank == src:
        later = None
        if state is not None and any(k in state for k in late):
            if device.type != "cpu":
                raise ValueError("send_state: late keys go over gloo, from CPU memory")
            skeleton, layout, later = state_codec.split({k: state[k] for k in late if k in state})
            state = {**{k: v for k, v in state.items() if k not in late}, LATE: {"s": skeleton, "l": layout}}
        data = encoded if encoded is not None else encode_state(state)
        payload = data.to(device) if device.type != "cpu" else data
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        works = []
        for dst in receivers:
            works += [dist.isend(size, dst=dst), dist.isend(payload, dst=dst)]
        for work in works:
            work.wait()
        del payload, data
        return LateSend(later, receivers) if later is not None else None
    if rank not in receivers:
        return None
    size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(size, src=src)
    payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.recv(payload, src=src)
    got = state_codec.decode(payload.cpu() if device.type != "cpu" else payload)
    if LATE in got:
        got[LATE] = LateState(src, got[LATE]["s"], got[LATE]["l"])
    return got


def send_states(state: dict | None, donors: dict[int, int | None], device: torch.device,
                late: Sequence[str] = ()) -> dict | LateSend | None:
    """Several ``send_state`` at once, for ``donors`` (receiver rank -> the rank that sends to it):
    every donor sends its own ``state`` to its receivers, point to point (``late``: as in
    ``send_state``). Each rank takes part in one transfer only (the others return at once), so the
    donors send side by side (HSDP: one donor per shard index, ``training/hsdp.py``). Returns what
    this rank received (a donor: its ``LateSend``, if any), else None."""
    rank = dist.get_rank()
    by_donor: dict[int, list[int]] = {}
    for receiver, donor in donors.items():
        if donor is None:
            raise ValueError(f"send_states: no rank holds the state of rank {receiver}")
        by_donor.setdefault(donor, []).append(receiver)
    got = None
    for donor, receivers in sorted(by_donor.items()):
        if rank == donor or rank in receivers:
            got = send_state(state if rank == donor else None, donor, receivers, device, late=late)
    return got


class EarlyState:
    """A re-form's state, serialized by its source as soon as the quorum is known, on a thread of
    its own while the group forms (``early_state``): the source reaches the group at once, and the
    receivers do not wait for its serialization after it. ``state_dict()`` is called on the caller's
    thread (the loop's code stays on the training thread); only ``encode_state`` runs on the other."""

    def __init__(self, q: int, state: dict, start_thread: Callable[..., object]) -> None:
        self.q = q
        self._done = threading.Event()
        self._data: torch.Tensor | None = None
        self._error: BaseException | None = None
        start_thread("live-encode-state", self._encode, state)

    def _encode(self, state: dict) -> None:
        try:
            self._data = encode_state(state)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread by result()
            self._error = exc
        finally:
            self._done.set()

    def result(self) -> torch.Tensor:
        """The serialized state (waits for the thread; its error, if it failed)."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._data


def early_state(quorum: Quorum, member_id: str, state_dict: Callable[[], dict] | None, donors: Callable | None,
                start_thread: Callable[..., object]) -> EarlyState | None:
    """``EarlyState`` on the source of a quorum with receivers (a newcomer, a rank behind), else
    None (sharded states: ``donors`` send after the group forms)."""
    if donors is not None or state_dict is None or not quorum.receivers:
        return None
    if quorum.rank_of(member_id) != quorum.source:
        return None
    return EarlyState(quorum.q, state_dict(), start_thread)


def transfer(quorum: Quorum, rank: int, state_dict: Callable[[], dict] | None, device: torch.device,
             donors: Callable[[Quorum], dict[int, int | None]] | None = None,
             early: EarlyState | None = None,
             late: Sequence[str] = ()) -> tuple[dict | LateSend | None, tuple[int, ...]]:
    """A re-form's state transfer on every rank of the new group: ``(received state, missing)``.
    ``early``: ``early_state()``, used when it is this quorum's (a member lost while the group
    formed made another).

    Without ``donors`` the quorum's source sends ``state_dict()`` to its receivers. With ``donors``
    (``Manager.reform``'s) each donor sends its own ``state_dict()`` to its receivers; when any
    receiver has no donor nothing is sent and ``missing`` names those ranks, alike on every rank
    (the caller loads a checkpoint). The state is None on the ranks that received nothing.
    ``late``: keys of the senders' states that follow in the background (``send_state``); a sender
    then gets its ``LateSend`` in place of a state."""
    plan = donors(quorum) if donors is not None else None
    if plan is not None:
        missing = tuple(r for r, d in sorted(plan.items()) if d is None)
        sender = rank in plan.values()
        if sender and state_dict is None:
            raise ValueError("Manager.reform needs state_dict on the ranks that send their state to others")
        if plan and not missing:
            sent = state_dict() if sender else None
            return send_states(sent, plan, device, late), ()
        return None, missing
    if quorum.receivers:
        source = rank == quorum.source
        if source and state_dict is None:
            raise ValueError("Manager.reform needs state_dict on the rank that sends the state to the others")
        if source and early is not None and early.q == quorum.q:
            return send_state(None, quorum.source, quorum.receivers, device, encoded=early.result()), ()
        return send_state(state_dict() if source else None, quorum.source, quorum.receivers, device, late=late), ()
    return None, ()


__all__ = ["LATE", "EarlyState", "LateSend", "LateState", "early_state", "encode_state", "send_state", "send_states",
           "transfer"]
