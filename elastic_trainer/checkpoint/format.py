"""Format 3 of a checkpoint's data file: the tensors' raw bytes behind a small JSON header.

``torch.save`` pickles: for the example model's 258 tensors that is ~5.4 ms of Python (about
22 pickler callbacks a tensor), more than writing its 11 MB. A snapshot's tensors already lie
in one buffer, the ``Arena`` (``checkpoint_snapshot.Snapshotter`` copies the state into it), so a save
here is a header of a few KB and then that buffer, written and hashed in large pieces as it is::

    offset 0       b"ETSTATE3"                      magic, 8 bytes
    offset 8       H: header length, uint64 little-endian
    offset 16      header: UTF-8 JSON, padded with spaces so that the data starts at a multiple of 64
    offset 16 + H  data: every tensor's bytes, C order, native byte order, each at a multiple of 64

The header is ``{"format": 3, "byteorder": "little", "data_size": N, "state": V}``. A value V
is JSON's own null, true/false, int, float (``NaN``/``Infinity`` as Python's json writes them),
string or list, and anything else is an object with exactly one key that says what it is:

- ``{"dict": [[K, V], ...]}``: a dict, keys of any type (ints in an optimizer's state), in order;
- ``{"tuple": [V, ...]}``;
- ``{"dtype": "float32"}``: a ``torch.dtype``;
- ``{"tensor": {"dtype": "float32", "shape": [4, 8], "offset": 0, "nbytes": 128}}``: a tensor
  whose bytes are at ``offset`` in the data.

Reading parses JSON and copies bytes into new tensors; nothing in the file can run code. Every
field is checked (tags, dtype names from a fixed list, shapes, offsets inside the data) and a
file that breaks a rule raises ``ValueError`` saying which. Memory is bounded by the file: each
row of the tensor table is decoded at most once (more references to it get the same tensor, as
``torch.save`` keeps shared tensors shared), and the rows decoded may not add up to more bytes
than the data section holds (a writer lays every row out in its own bytes), so a hostile header
cannot turn a 1 MiB file into hundreds of MiB of tensors. The manifest's checksum covers the
whole file, so this is the second line, not the first.

Tensors of other kinds (sparse, quantized, sub-byte dtypes) have no raw layout here; a state that
holds one is written as a format 2 ``torch.save`` file instead (see ``checkpoint``).
"""

from __future__ import annotations

import json
import math
import struct
import sys
from typing import Any, Callable, Iterable

import numpy as np
import torch

FORMAT = 3
MAGIC = b"ETSTATE3"
ALIGN = 64
_PREFIX = struct.Struct("<8sQ")  # magic, header length

RAW_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
                 "int64", "int32", "int16", "int8", "uint8", "uint16", "uint32", "uint64", "bool",
                 "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if isinstance(getattr(torch, name, None), torch.dtype)
}
"""dtypes whose tensors are stored as raw bytes, by the name the header uses."""
_DTYPE_NAMES = {dtype: name for name, dtype in RAW_DTYPES.items()}
_ALL_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_SCALARS = frozenset({str, bool, int, float, type(None)})
_TAGS = frozenset({"dict", "tuple", "dtype", "tensor"})


def is_raw(t: torch.Tensor) -> bool:
    """Whether ``t`` can be stored as raw bytes (a dense tensor of a dtype in ``RAW_DTYPES``)."""
    return t.layout == torch.strided and t.dtype in _DTYPE_NAMES and not t.is_quantized


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class Arena:
    """One contiguous CPU buffer holding every tensor of a snapshot, laid out as format 3's data.

    ``views[i]`` is the i-th tensor of ``specs`` (shape, dtype) inside the buffer; ``refs`` maps
    ``id(view)`` to its reference in a header (``{"tensor": i}``) and ``table`` is the header's
    tensor table as JSON text: both are built once and reused by every save of this layout.
    ``pinned`` buffers serve CUDA sources (faster device-to-host copies). ``allocate(size,
    pinned)``, when given, returns the uint8 buffer to lay the arena out in (at least ``size``
    bytes; the snapshot's ``HostBuffer`` reuses one from arena to arena); by default a new one.
    """

    def __init__(self, specs: Iterable[tuple[torch.Size, torch.dtype]], pinned: bool = False,
                 allocate: Callable[[int, bool], torch.Tensor] | None = None) -> None:
        specs = list(specs)
        offsets, size = [], 0
        for shape, dtype in specs:
            offsets.append(size)
            size = _aligned(size + math.prod(shape) * dtype.itemsize)
        self.size = size
        self.pinned = pinned
        if allocate is None:
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
        else:
            self.buffer = allocate(size, pinned)[:size]
        self.views: list[torch.Tensor] = []
        self.refs: dict[int, dict] = {}
        table = []
        for i, ((shape, dtype), offset) in enumerate(zip(specs, offsets)):
            nbytes = math.prod(shape) * dtype.itemsize
            view = self.buffer[offset:offset + nbytes].view(dtype).view(shape)
            self.views.append(view)
            self.refs[id(view)] = {"tensor": i}
            table.append([_DTYPE_NAMES[dtype], list(shape), offset, nbytes])
        self.table = json.dumps(table, separators=(",", ":"))
        self.data = memoryview(self.buffer.numpy()) if size else memoryview(b"")


def header(state: Any, arena: Arena) -> bytes | None:
    """Magic, length and JSON header for ``state`` (whose tensors are ``arena``'s views), padded
    so that the data starts aligned; None when ``state`` holds a tensor outside the arena."""
    try:
        encoded = _encode(state, arena.refs)
    except _NotInArena:
        return None
    text = (f'{{"format":{FORMAT},"byteorder":"{sys.byteorder}","data_size":{arena.size},'
            f'"tensors":{arena.table},"state":{json.dumps(encoded, separators=(",", ":"))}}}').encode()
    length = _aligned(_PREFIX.size + len(text)) - _PREFIX.size
    return _PREFIX.pack(MAGIC, length) + text + b" " * (length - len(text))


def write(state: Any, arena: Arena, out) -> bool:
    """Write ``state`` in format 3 into the stream ``out``; False (nothing written) when it has a
    tensor that is not one of ``arena``'s views (then the caller writes another format)."""
    head = header(state, arena)
    if head is None:
        return False
    out.write(head)
    if arena.size:
        out.write(arena.data)
    return True


class _NotInArena(Exception):
    pass


def _encode(value: Any, refs: dict[int, dict]) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        if all(type(v) in _SCALARS for v in value):  # e.g. python's RNG state: 625 ints
            return value
        return [_encode(v, refs) for v in value]
    if isinstance(value, torch.Tensor):
        ref = refs.get(id(value))
        if ref is None:
            raise _NotInArena
        return ref
    if isinstance(value, dict):
        if all(type(k) is str for k in value) and not (len(value) == 1 and next(iter(value)) in _TAGS):
            return {k: _encode(v, refs) for k, v in value.items()}
        return {"dict": [[_encode(k, refs), _encode(v, refs)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, refs) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, (str, int, float)):  # a subclass (an IntEnum, ...): stored as its plain value
        return value
    raise TypeError(f"format 3 cannot store a value of type {kind.__name__}")


# ----------------------------------------------------------------------------- reading


def is_format3(data: bytes | memoryview) -> bool:
    """Whether ``data`` starts like a format-3 file."""
    return bytes(data[:len(MAGIC)]) == MAGIC


def read(data: bytes | memoryview) -> dict:
    """The state stored in ``data`` (a whole format-3 file); ``ValueError`` naming what is wrong."""
    view = memoryview(data)
    if view.nbytes < _PREFIX.size or not is_format3(view):
        raise ValueError("not a format-3 state file (bad magic)")
    _, length = _PREFIX.unpack_from(view)
    start = _PREFIX.size + length
    if start > view.nbytes:
        raise ValueError(f"format-3 header length {length} runs past the end of the file ({view.nbytes} bytes)")
    try:
        head = json.loads(bytes(view[_PREFIX.size:start]))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"format-3 header is not valid JSON ({exc})") from exc
    if not isinstance(head, dict) or head.get("format") != FORMAT or "state" not in head \
            or type(head.get("tensors")) is not list:
        raise ValueError("format-3 header lacks the format, the tensor table or the state")
    if head.get("byteorder") != sys.byteorder:
        raise ValueError(f"checkpoint was written on a {head.get('byteorder')!r}-endian machine, "
                         f"this one is {sys.byteorder}-endian")
    size = head.get("data_size")
    if type(size) is not int or start + size != view.nbytes:
        raise ValueError(f"format-3 data is {view.nbytes - start} bytes, header says {size!r}")
    raw = np.frombuffer(view, dtype=np.uint8, count=size, offset=start) if size else np.empty(0, np.uint8)
    return _decode(head["state"], _Table(head["tensors"], raw), raw)


class _Table:
    """The tensor table while reading: every row decoded at most once, all rows decoded together
    no larger than the data section."""

    def __init__(self, rows: list, raw: np.ndarray) -> None:
        self.rows, self.raw = rows, raw
        self.decoded: dict[int, torch.Tensor] = {}
        self.budget = raw.size

    def __len__(self) -> int:
        return len(self.rows)

    def tensor(self, i: int) -> torch.Tensor:
        if i not in self.decoded:
            entry = self.rows[i]
            out = _tensor(entry, self.raw)  # checked first: a row alone fits the data
            if entry[3] > self.budget:
                raise ValueError(f"format-3 tensor rows add up to more bytes than the data holds ({self.raw.size}); "
                                 f"row {i} {_show(entry, 80)} overlaps others")
            self.decoded[i] = out
            self.budget -= entry[3]
        return self.decoded[i]


def _decode(value: Any, table: _Table, raw: np.ndarray) -> Any:
    kind = type(value)
    if kind in _SCALARS:
        return value
    if kind is list:
        if all(type(v) in _SCALARS for v in value):
            return value
        return [_decode(v, table, raw) for v in value]
    if kind is not dict:
        raise ValueError(f"format-3 header holds an unknown value {_show(value, 80)}")
    if len(value) != 1 or next(iter(value)) not in _TAGS:
        return {k: _decode(v, table, raw) for k, v in value.items()}
    (tag, body), = value.items()
    if tag == "tensor" and type(body) is int and 0 <= body < len(table):
        return table.tensor(body)
    if tag == "dict" and type(body) is list:
        out = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise ValueError(f"format-3 dict entry {_show(pair, 80)} is not a [key, value] pair")
            key = _decode(pair[0], table, raw)
            try:
                out[key] = _decode(pair[1], table, raw)
            except TypeError as exc:  # an unhashable key
                raise ValueError(f"format-3 dict key {_show(pair[0], 80)} cannot be a key") from exc
        return out
    if tag == "tuple" and type(body) is list:
        return tuple(_decode(v, table, raw) for v in body)
    if tag == "dtype" and body in _ALL_DTYPES:
        return _ALL_DTYPES[body]
    raise ValueError(f"format-3 header holds a bad {tag!r} value {_show(body, 80)}")


def _show(value: Any, limit: int) -> str:
    """``value`` as the header spells it, cut to ``limit`` characters (for error messages)."""
    text = json.dumps(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _tensor(entry: Any, raw: np.ndarray) -> torch.Tensor:
    """A new tensor from a tensor-table entry ``[dtype, shape, offset, nbytes]``."""
    if type(entry) is not list or len(entry) != 4:
        raise ValueError(f"format-3 tensor entry {_show(entry, 80)} is not [dtype, shape, offset, nbytes]")
    name, shape, offset, nbytes = entry
    dtype = RAW_DTYPES.get(name) if type(name) is str else None
    if (dtype is None or type(shape) is not list or not all(type(n) is int and n >= 0 for n in shape)
            or type(offset) is not int or type(nbytes) is not int):
        raise ValueError(f"format-3 tensor entry {_show(entry, 120)} is malformed")
    if math.prod(shape) * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > raw.size:
        raise ValueError(f"format-3 tensor entry {_show(entry, 120)} does not fit the data ({raw.size} bytes)")
    out = torch.empty(shape, dtype=dtype)
    if nbytes:
        out.reshape(-1).view(torch.uint8).numpy()[:] = raw[offset:offset + nbytes]
    return out
