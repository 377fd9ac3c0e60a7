"""The training state on the wire: what a live peer sends a newcomer, encoded so that decoding is cheap and safe.

A live re-form sends a newcomer (and a rank behind) the state of a rank that completed the
quorum's step (``state_transfer.py``), and the members wait while it decodes it. ``torch.load``
with ``weights_only=True`` decodes in a pure-Python unpickler: 13-35 ms for the states of the
benchmarks here (a 122 KB MLP state of 138 tensors; a 1.8 MB one of 350), on the join's critical
path; without ``weights_only`` it would run whatever code a peer's bytes name. So the state goes as

    b"ETSTATE2" | skeleton length (8 bytes, little endian) | skeleton (JSON, padded to 8 bytes) | tensors (safetensors)

- the **tensors** in safetensors' format (``safetensors.torch.save``), packed: the tensors of each
  dtype joined end to end into one (safetensors spends ~30 us of Python on each tensor it saves:
  7.5 ms for a 185-tensor state, where the packing takes 0.3 ms), the skeleton's ``"$l"`` naming
  each tensor's pack, offset and shape; each decoded by one copy out of the received buffer (a
  tensor of its own, as ``torch.load`` makes it: an optimizer keeps what it loads, and a view would
  keep, and a later save would write, the whole buffer);
- the **skeleton**, everything else, in JSON: dicts, lists, strings, numbers (floats exactly, NaN
  and infinities too), booleans and None as themselves; a tensor as ``{"$t": i}``; a tuple as
  ``{"$u": [...]}``; a dict with keys that are not strings (an optimizer's ``state`` by parameter
  index) as ``{"$d": [[key, value], ...]}``, and an ``OrderedDict`` with its ``_metadata`` (a
  module's ``state_dict`` keeps its version there) as ``{"$o": [...], "$m": ...}``.

A state with anything else (a NumPy array, an object, two views of one storage) is sent as
``torch.save`` wrote it and decoded by ``torch.load(weights_only=True)``, as before: ``decode``
tells the two apart by the magic. Decoding reads only JSON and tensor bytes: no code runs.
"""

from __future__ import annotations

import io
import json
import struct
from collections import OrderedDict
from typing import Any

import torch

from elastic_trainer.torch_private import set_state_dict_metadata, state_dict_metadata

MAGIC = b"ETSTATE2"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
"""safetensors' dtype names, as its header writes them, and torch's dtypes."""


class _Unsupported(Exception):
    """A value the skeleton cannot hold: the state goes as ``torch.save`` writes it."""


_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def _skeleton(x: Any, tensors: list[torch.Tensor], seen: dict[int, int]) -> Any:
    if isinstance(x, torch.Tensor):
        if x.dtype not in _NAMES:
            raise _Unsupported(f"dtype {x.dtype}")
        if id(x) not in seen:  # the same tensor twice (tied weights): sent once
            seen[id(x)] = len(tensors)
            tensors.append(x.detach().cpu())
        return {"$t": seen[id(x)]}
    if isinstance(x, dict):
        items = [[k, _skeleton(v, tensors, seen)] for k, v in x.items()]
        if any(type(k) not in (str, int) for k in x):
            raise _Unsupported("a dict key that is neither str nor int")
        meta = state_dict_metadata(x)
        if isinstance(x, OrderedDict) and meta is not None:
            return {"$o": items, "$m": _skeleton(meta, tensors, seen)}
        if all(type(k) is str and not k.startswith("$") for k in x):
            return dict(items)
        return {"$d": items}
    if isinstance(x, tuple):
        return {"$u": [_skeleton(v, tensors, seen) for v in x]}
    if isinstance(x, list):
        return [_skeleton(v, tensors, seen) for v in x]
    if x is None or type(x) in (bool, int, float, str):
        return x
    raise _Unsupported(type(x).__name__)


def _restore(x: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(x, list):
        return [_restore(v, tensors) for v in x]
    if not isinstance(x, dict):
        return x
    if "$t" in x:
        return tensors[x["$t"]]
    if "$u" in x:
        return tuple(_restore(v, tensors) for v in x["$u"])
    if "$d" in x:
        return {k: _restore(v, tensors) for k, v in x["$d"]}
    if "$o" in x:
        out = OrderedDict((k, _restore(v, tensors)) for k, v in x["$o"])
        set_state_dict_metadata(out, _restore(x["$m"], tensors))
        return out
    return {k: _restore(v, tensors) for k, v in x.items()}


def encode(state: Any) -> torch.Tensor:
    """``state`` as one byte tensor (see the module docstring), for ``decode`` on the receiver."""
    from safetensors.torch import save

    tensors: list[torch.Tensor] = []
    try:
        tree = _skeleton(state, tensors, {})
        by_dtype: dict[str, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(_NAMES[t.dtype], []).append(i)
        layout: list[list] = [[]] * len(tensors)  # tensor i: [its pack, offset in elements, shape]
        packs: dict[str, torch.Tensor] = {}
        for name, members in by_dtype.items():
            offset = 0
            for i in members:
                layout[i] = [name, offset, list(tensors[i].shape)]
                offset += tensors[i].numel()
            packs[name] = torch.cat([tensors[i].reshape(-1) for i in members])
        skeleton = json.dumps({"$l": layout, "$s": tree}).encode()
        data = save(packs)
    except Exception:  # noqa: BLE001 - _Unsupported, or safetensors refused a tensor (shared storage): as before
        buf = io.BytesIO()
        torch.save(state, buf)
        return torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
    skeleton += b" " * (-len(skeleton) % 8)  # the tensors' bytes stay 8-byte aligned in the buffer
    out = bytearray(16 + len(skeleton) + len(data))
    out[:16] = MAGIC + struct.pack("<Q", len(skeleton))
    out[16:16 + len(skeleton)] = skeleton
    out[16 + len(skeleton):] = data
    return torch.frombuffer(out, dtype=torch.uint8)


def decode(payload: torch.Tensor) -> Any:
    """The state ``encode`` made, from its bytes (a CPU uint8 tensor)."""
    from elastic_trainer.storage import PartsReader

    raw = payload.numpy()
    if raw[:8].tobytes() != MAGIC:
        return torch.load(PartsReader([memoryview(raw)]), weights_only=True, map_location="cpu")
    (n,) = struct.unpack("<Q", raw[8:16].tobytes())
    skeleton = json.loads(raw[16:16 + n].tobytes())
    base = 16 + n
    (header_len,) = struct.unpack("<Q", raw[base:base + 8].tobytes())
    header = json.loads(raw[base + 8:base + 8 + header_len].tobytes())
    start = base + 8 + header_len
    packs: dict[str, torch.Tensor] = {}
    for name, info in header.items():
        if name != "__metadata__":
            begin, end = info["data_offsets"]
            packs[name] = payload[start + begin:start + end].view(_DTYPES[info["dtype"]])
    tensors = [packs[name][offset:offset + _numel(shape)].reshape(shape).clone()
               for name, offset, shape in skeleton["$l"]]
    return _restore(skeleton["$s"], tensors)


def split(state: Any) -> tuple[Any, list[list], list[torch.Tensor]]:
    """``state`` cut for sending its tensors apart, as they are (``state_transfer``'s late keys):
    its skeleton (as ``encode`` writes it, JSON-able: a tensor as ``{"$t": i}``), each tensor's
    dtype and shape (``buffers`` makes their like), and the tensors themselves, contiguous
    (not copied when they are; a tensor in it twice, once). ValueError for what the skeleton cannot
    hold (the module docstring)."""
    tensors: list[torch.Tensor] = []
    try:
        skeleton = _skeleton(state, tensors, {})
    except _Unsupported as exc:
        raise ValueError(f"a state with {exc} cannot be sent in parts") from None
    tensors = [t.contiguous() for t in tensors]
    return skeleton, [[_NAMES[t.dtype], list(t.shape)] for t in tensors], tensors


def buffers(layout: list[list]) -> list[torch.Tensor]:
    """Empty CPU tensors of ``split``'s dtypes and shapes, to receive its tensors into."""
    return [torch.empty(shape, dtype=_DTYPES[name]) for name, shape in layout]


def join(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """The state ``split`` cut, from its skeleton and (received) tensors."""
    return _restore(skeleton, tensors)


def warm_up() -> None:
    """Encode and decode a small state once: the first call in a process takes ~20 ms more (lazy
    imports and first dispatches), which a live worker spends at its start, not in a join's pause."""
    small = OrderedDict(w=torch.zeros(2), n=torch.zeros((), dtype=torch.int64), b=torch.zeros(1, dtype=torch.bool))
    decode(encode({"model": small, "state": {0: {"step": torch.tensor(1.0)}}, "t": (1, "x")}))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


__all__ = ["MAGIC", "buffers", "decode", "encode", "join", "split", "warm_up"]
