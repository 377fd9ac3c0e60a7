"""Format 3 (elastic_trainer.checkpoint.format): exact round trips, corruption, old formats, S3.

Files are written by ``CheckpointManager`` on real stores (local files, memory://, s3:// on
moto's HTTP server) or by the format's own ``write``; damaged and hostile files are made by hand.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import struct
import sys
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from elastic_trainer.checkpoint import format as checkpoint_format
from elastic_trainer import storage
from elastic_trainer.checkpoint import CheckpointManager, capture_rng_state
from elastic_trainer.checkpoint.format import Arena
from elastic_trainer.checkpoint.host_memory import whole_pages
from elastic_trainer.checkpoint.snapshot import Snapshotter

pytestmark = pytest.mark.timeout(180)


def _bits(t: torch.Tensor) -> bytes:
    """The exact bytes of a tensor's values (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_identical(a, b, where="state") -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and type(b) is dict), f"{where}: {type(a)} vs {type(b)}"
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape), where
        assert _bits(a) == _bits(b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            _assert_identical(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_identical(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), where
    else:
        assert a == b and repr(a) == repr(b), where


def _odd_state() -> dict:
    """Every kind of value a state may hold, with the awkward cases of each."""
    g = torch.Generator().manual_seed(0)
    tensors = {name: torch.randn(3, 5, generator=g).to(dtype) for name, dtype in checkpoint_format.RAW_DTYPES.items()
               if name not in ("bool", "complex32") and not name.startswith(("uint", "int", "float8"))}
    tensors.update({
        "bool": torch.rand(7, generator=g) > 0.5,
        "int64": torch.randint(-2**62, 2**62, (4,), generator=g),
        "uint8": torch.randint(0, 255, (9,), dtype=torch.uint8, generator=g),
        "int8": torch.randint(-128, 127, (2, 2), dtype=torch.int8, generator=g),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "special": torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0]),
    })
    for name in ("float8_e4m3fn", "float8_e5m2", "uint16", "uint32", "uint64"):
        if name in checkpoint_format.RAW_DTYPES:
            tensors[name] = torch.arange(6).to(checkpoint_format.RAW_DTYPES[name])
    return {
        "model": tensors,
        "optimizer": {"state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(2)}, 1: {}},
                      "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0, 1], "foreach": None,
                                        "amsgrad": False}]},
        "rng": capture_rng_state(),
        "scalars": {"nan": float("nan"), "inf": float("inf"), "neg_zero": -0.0, "big": 2**70, "neg": -(2**63),
                    "text": "naïve ✓ \"quoted\" \n", "none": None, "t": True, "f": False},
        "keys": {(1, "a"): "tuple key", 2.5: "float key", None: "none key", True: "bool key", 7: "int key"},
        "tag_lookalikes": {"tensor": 3, "dict": [1, 2], "one": {"tuple": "x"}},
        "nested": [(1, [2, (3,)]), [], (), {}, [torch.zeros(2), {"deep": (torch.ones(1), "x")}]],
        "dtypes": [torch.float32, torch.bfloat16, torch.int64],
    }


def _through_format3(state: dict) -> tuple[dict, bytes]:
    snap, _ = Snapshotter().take(state)
    out = io.BytesIO()
    assert checkpoint_format.write(snap.state, snap.arena, out)
    data = out.getvalue()
    return checkpoint_format.read(data), data


def test_every_kind_of_value_round_trips_bit_exactly():
    state = _odd_state()
    loaded, data = _through_format3(state)
    _assert_identical(state, loaded)
    assert data[:8] == b"ETSTATE3"
    (header_len,) = struct.unpack_from("<Q", data, 8)
    assert (16 + header_len) % 64 == 0  # the data starts aligned
    # tuple keys, int keys and the one-key dicts that look like tags came back as they were
    assert loaded["keys"][(1, "a")] == "tuple key" and loaded["optimizer"]["state"][0]["step"].item() == 4.0
    assert loaded["tag_lookalikes"] == {"tensor": 3, "dict": [1, 2], "one": {"tuple": "x"}}


def test_loaded_tensors_are_writable_and_share_no_memory():
    state = {"a": torch.ones(3), "b": torch.zeros(2)}
    loaded, _ = _through_format3(state)
    loaded["a"] += 1  # no warning about read-only memory, no effect on the other tensor
    assert torch.equal(loaded["a"], torch.full((3,), 2.0)) and torch.equal(loaded["b"], torch.zeros(2))
    assert loaded["a"].untyped_storage().data_ptr() != loaded["b"].untyped_storage().data_ptr()


_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**80, max_value=2**80)
            | st.floats(allow_nan=False) | st.text(max_size=8))
_keys = st.one_of(st.text(max_size=8), st.integers(-5, 5), st.tuples(st.integers(0, 3), st.text(max_size=3)))
_values = st.recursive(
    _scalars | st.builds(lambda n: torch.arange(n, dtype=torch.float64) / 7, st.integers(0, 5)),
    lambda children: (st.lists(children, max_size=4) | st.lists(children, max_size=3).map(tuple)
                      | st.dictionaries(_keys, children, max_size=4)),
    max_leaves=20)


@settings(max_examples=150, deadline=None)
@given(st.dictionaries(st.text(max_size=6), _values, max_size=4))
def test_any_nesting_of_plain_values_and_tensors_round_trips(state):
    loaded, _ = _through_format3(state)
    _assert_identical(state, loaded)


# --------------------------------------------------------------------------- the manager writes it


def _manifest(url: str, step: int) -> tuple:
    fs, root = storage.get_fs(url)
    step_dir = storage.join(root, f"step-{step}")
    return fs, step_dir, json.loads(fs.cat_file(storage.join(step_dir, "manifest.json")))


def test_manager_writes_format3_on_every_store_and_loads_it_exactly(any_url):
    state = _odd_state()
    mgr = CheckpointManager(any_url, async_checkpoint=False)
    mgr.save(3, state)
    fs, step_dir, manifest = _manifest(any_url, 3)
    assert manifest["format"] == 3 and list(manifest["files"]) == [f"{mgr.writer_id}/state.bin"]
    data = fs.cat_file(storage.join(step_dir, mgr.writer_id, "state.bin"))
    assert data[:8] == b"ETSTATE3" and manifest["files"][f"{mgr.writer_id}/state.bin"]["size"] == len(data)
    step, loaded = mgr.load()
    assert step == 3
    _assert_identical(state, loaded)


def test_corrupt_byte_anywhere_in_a_format3_file_is_caught_by_its_checksum(any_url, caplog):
    mgr = CheckpointManager(any_url, keep_checkpoints=5, async_checkpoint=False)
    mgr.save(1, {"model": {"w": torch.ones(1000)}})
    fs, step_dir, manifest = _manifest(any_url, 1)
    path = storage.join(step_dir, next(iter(manifest["files"])))
    good = fs.cat_file(path)
    for where in (3, 20, len(good) - 1):  # magic, header, tensor data
        bad = bytearray(good)
        bad[where] ^= 0x04
        fs.pipe_file(path, bytes(bad))
        fs.invalidate_cache()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint"):
            assert mgr.load() is None
        assert "step-1: " in caplog.text and "state.bin fails its xxh3_128 check (corrupted)" in caplog.text
    fs.pipe_file(path, good)
    fs.invalidate_cache()
    assert torch.equal(mgr.load()[1]["model"]["w"], torch.ones(1000))


def _rewrite_with_valid_manifest(url: str, step: int, data: bytes) -> None:
    """Replace the data file of ``step`` and make its manifest vouch for it (a hostile or buggy writer)."""
    fs, step_dir, manifest = _manifest(url, step)
    rel = next(iter(manifest["files"]))
    fs.pipe_file(storage.join(step_dir, rel), data)
    manifest["files"][rel] = {"size": len(data), "hash": "xxh3_128", "digest": xxhash.xxh3_128(data).hexdigest()}
    fs.pipe_file(storage.join(step_dir, "manifest.json"), json.dumps(manifest).encode())
    fs.invalidate_cache()


def _file_with_header(head: dict, data: bytes = b"") -> bytes:
    text = json.dumps(head).encode()
    return struct.pack("<8sQ", b"ETSTATE3", len(text)) + text + data


_GOOD = {"format": 3, "byteorder": sys.byteorder, "data_size": 8, "tensors": [["float32", [2], 0, 8]],
         "state": {"w": {"tensor": 0}}}


@pytest.mark.parametrize("bad, message", [
    (b"PK\x03\x04 a zip, say torch.save's", "not a format-3 state file"),
    (struct.pack("<8sQ", b"ETSTATE3", 10**9) + b"{}", "runs past the end of the file"),
    (struct.pack("<8sQ", b"ETSTATE3", 5) + b"{nope", "header is not valid JSON"),
    (_file_with_header({**_GOOD, "tensors": [["float32", [4], 0, 16]]}, bytes(8)), "does not fit the data"),
    (_file_with_header({**_GOOD, "tensors": [["float32", [2], -8, 8]]}, bytes(8)), "does not fit the data"),
    (_file_with_header({**_GOOD, "tensors": [["object", [2], 0, 8]]}, bytes(8)), "is malformed"),
    (_file_with_header({**_GOOD, "state": {"w": {"tensor": 5}}}, bytes(8)), "bad 'tensor' value 5"),
    (_file_with_header({**_GOOD, "state": {"w": {"dtype": "os.system"}}}, bytes(8)), "bad 'dtype' value"),
    (_file_with_header({**_GOOD, "state": {"d": {"dict": [[[1, 2], "list key"]]}}}, bytes(8)), "cannot be a key"),
    (_file_with_header({**_GOOD, "byteorder": "middle"}, bytes(8)), "'middle'-endian"),
    (_file_with_header(_GOOD, bytes(9)), "data is 9 bytes, header says 8"),
], ids=["not-format3", "header-too-long", "bad-json", "tensor-past-end", "negative-offset", "unknown-dtype",
        "no-such-tensor", "dtype-not-a-dtype", "unhashable-key", "byte-order", "data-size"])
def test_malformed_format3_file_with_a_valid_checksum_is_skipped_saying_why(tmp_path, bad, message, caplog):
    url = str(tmp_path / "c")
    mgr = CheckpointManager(url, keep_checkpoints=5, async_checkpoint=False)
    mgr.save(1, {"w": torch.zeros(2)})
    mgr.save(2, {"w": torch.ones(2)})
    assert checkpoint_format.read(_file_with_header(_GOOD, bytes(8)))["w"].shape == (2,)  # the good one reads
    _rewrite_with_valid_manifest(url, 2, bad)
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint"):
        step, state = mgr.load()
    assert step == 1 and torch.equal(state["w"], torch.zeros(2))
    assert "skipping checkpoint" in caplog.text and "step-2" in caplog.text and message in caplog.text
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        checkpoint_format.read(bad)


def _decoded_bytes(value) -> int:
    """Bytes of the distinct tensor storages in a decoded state."""
    seen: dict[int, int] = {}

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    walk(value)
    return sum(seen.values())


def test_many_references_to_one_tensor_row_decode_it_once(tmp_path, caplog):
    mib = 1 << 20
    head = {"format": 3, "byteorder": sys.byteorder, "data_size": mib, "tensors": [["uint8", [mib], 0, mib]],
            "state": {"refs": [{"tensor": 0}] * 300}}
    hostile = _file_with_header(head, bytes(mib))
    state = checkpoint_format.read(hostile)
    assert len(state["refs"]) == 300 and all(t is state["refs"][0] for t in state["refs"])
    assert _decoded_bytes(state) <= len(hostile)  # was 300 MiB of tensors from a 1 MiB file


def test_tensor_rows_that_overlap_past_the_data_size_are_refused_and_skipped(tmp_path, caplog):
    mib = 1 << 20
    head = {"format": 3, "byteorder": sys.byteorder, "data_size": mib,
            "tensors": [["uint8", [mib], 0, mib]] * 300, "state": {"refs": [{"tensor": i} for i in range(300)]}}
    hostile = _file_with_header(head, bytes(mib))
    with pytest.raises(ValueError, match=r"rows add up to more bytes than the data holds \(1048576\)"):
        checkpoint_format.read(hostile)
    url = str(tmp_path / "c")
    mgr = CheckpointManager(url, keep_checkpoints=5, async_checkpoint=False)
    mgr.save(1, {"w": torch.zeros(2)})
    mgr.save(2, {"w": torch.ones(2)})
    _rewrite_with_valid_manifest(url, 2, hostile)
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint"):
        assert mgr.load()[0] == 1
    assert "step-2" in caplog.text and "add up to more bytes than the data holds" in caplog.text


def test_a_tensor_shared_in_the_saved_state_stays_one_tensor(tmp_path):
    w = torch.arange(6.0)
    mgr = CheckpointManager(str(tmp_path / "c"), async_checkpoint=False)
    mgr.save(1, {"model": {"embed": w, "head": w}})
    state = mgr.load()[1]
    assert torch.equal(state["model"]["embed"], w) and torch.equal(state["model"]["head"], w)


def test_a_pickle_under_a_format3_manifest_is_never_unpickled(tmp_path, caplog):
    url = str(tmp_path / "c")
    mgr = CheckpointManager(url, keep_checkpoints=5, async_checkpoint=False)
    mgr.save(1, {"w": torch.zeros(2)})
    mgr.save(2, {"w": torch.ones(2)})
    buf = io.BytesIO()
    torch.save({"evil": print}, buf)
    _rewrite_with_valid_manifest(url, 2, buf.getvalue())
    with caplog.at_level(logging.WARNING, logger="elastic_trainer.checkpoint"):
        assert mgr.load()[0] == 1
    assert "not a format-3 state file" in caplog.text


# --------------------------------------------------------------------------- older formats still load


def _write_by_hand(url: str, step: int, files: dict[str, bytes], fmt: int, checksum: str) -> None:
    step_dir = Path(url) / f"step-{step}"
    listed = {}
    for rel, data in files.items():
        (step_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (step_dir / rel).write_bytes(data)
        listed[rel] = ({"size": len(data), "sha256": hashlib.sha256(data).hexdigest()} if checksum == "sha256" else
                       {"size": len(data), "hash": "xxh3_128", "digest": xxhash.xxh3_128(data).hexdigest()})
    manifest = {"format": fmt, "step": step, "files": listed, "writer": "old", "fence_token": None,
                "created": time.time(), "meta": None, "host": "h"}
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


def _torch_saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def test_formats_1_2_and_3_side_by_side_all_load_and_count_for_retention(tmp_path):
    url = str(tmp_path / "c")
    states = {s: {"model": {"w": torch.full((4,), float(s))}, "optimizer": {"state": {0: {"step": torch.tensor(s)}}},
                  "sampler": {"offset": 32 * s}} for s in (1, 2, 3, 4)}
    _write_by_hand(url, 1, {f"old/{k}.pt": _torch_saved({k: v}) for k, v in states[1].items()}, 1, "sha256")
    _write_by_hand(url, 2, {"old/state.pt": _torch_saved(states[2])}, 2, "xxh3_128")
    mgr = CheckpointManager(url, keep_checkpoints=4, async_checkpoint=False)
    mgr.save(3, states[3])
    assert _manifest(url, 3)[2]["format"] == 3
    for step in (1, 2, 3):
        got_step, got = mgr.load(step)
        assert got_step == step
        _assert_identical(states[step], got)
    mgr.keep_checkpoints = 2
    mgr.save(4, states[4])  # retention counts the old formats like any other
    assert sorted(p.name for p in Path(url).iterdir()) == ["step-3", "step-4"]


@pytest.mark.filterwarnings("ignore:Sparse invariant checks:UserWarning")  # torch.load of a sparse tensor
def test_a_sparse_tensor_falls_back_to_a_format2_file_that_round_trips(any_url):
    sparse = torch.sparse_coo_tensor([[0, 2]], [1.5, -2.0], (4,))
    state = {"model": {"dense": torch.arange(3.0), "sparse": sparse}, "step": 3}
    mgr = CheckpointManager(any_url, async_checkpoint=False)
    mgr.save(1, state)
    _, _, manifest = _manifest(any_url, 1)
    assert manifest["format"] == 2 and list(manifest["files"]) == [f"{mgr.writer_id}/state.pt"]
    got = mgr.load()[1]
    assert torch.equal(got["model"]["dense"], torch.arange(3.0)) and got["step"] == 3
    assert torch.equal(got["model"]["sparse"].to_dense(), sparse.to_dense())
    mgr.save(2, {"model": {"dense": torch.arange(3.0)}, "step": 4})  # and back to format 3
    assert _manifest(any_url, 2)[2]["format"] == 3


# --------------------------------------------------------------------------- the arena


def test_arena_is_reused_while_the_tensors_keep_their_shapes_and_relaid_when_they_change():
    snapper = Snapshotter()
    state = {"a": torch.ones(3), "b": {"c": torch.zeros(2, 2, dtype=torch.float64)}}
    first, _ = snapper.take(state)
    arena = first.arena
    assert first.state["a"].untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    state["a"] += 1
    second, _ = snapper.take(state)
    assert second.arena is arena and torch.equal(second.state["a"], torch.full((3,), 2.0))
    third, _ = snapper.take({**state, "new": torch.ones(5, dtype=torch.int32)})
    assert third.arena is not arena and torch.equal(third.state["new"], torch.ones(5, dtype=torch.int32))
    fourth, _ = snapper.take(state)  # one tensor fewer: no stale bytes are left to write
    assert fourth.arena is not third.arena and fourth.arena.size == Arena([((3,), torch.float32),
                                                                           ((2, 2), torch.float64)]).size
    loaded = checkpoint_format.read(_write(fourth))
    assert set(loaded) == {"a", "b"} and torch.equal(loaded["b"]["c"], torch.zeros(2, 2, dtype=torch.float64))


def _relayouts(device: str) -> list[dict]:
    """States of a model that grows twice, loses a layer, then most of itself (re-layouts each)."""
    layer = lambda n: torch.ones(n, 1024, device=device)  # noqa: E731 - n rows of 4 KiB
    return [{"a": layer(256)}, {"a": layer(256), "b": layer(16)}, {"a": layer(256), "b": layer(16), "c": layer(32)},
            {"a": layer(256), "c": layer(32)}, {"c": layer(32)}]


def test_one_host_buffer_about_the_size_of_the_state_serves_every_relayout():
    """The snapshot's memory is one buffer, regrown (exactly) only when the state outgrows it and
    made smaller when the state falls below half of it: never twice the state, never a heap of
    old buffers (issue 22: the caching host allocator kept every pinned block of every layout)."""
    snapper, seen = Snapshotter(), []
    for state in _relayouts("cpu"):
        snap, _ = snapper.take(state)
        assert snap.arena.buffer.untyped_storage().data_ptr() == snapper.host.tensor.data_ptr()
        seen.append((snap.arena.size, snapper.host.capacity, snapper.host.allocations))
        assert all(torch.equal(snap.state[k], v) for k, v in state.items())
    row = 4096
    assert seen == [(256 * row, 256 * row, 1),  # the first layout: exactly the state
                    (272 * row, 272 * row, 2), (304 * row, 304 * row, 3),  # grown, exactly, the old one freed
                    (288 * row, 304 * row, 3),  # a layer fewer: the same buffer
                    (32 * row, 32 * row, 4)]  # below half of it: made smaller
    snapper.clear()
    assert snapper.host.capacity == 0


@pytest.mark.parametrize("nbytes", [1, 4095, 4096, 4097, 3 * 4096 + 5])
def test_a_buffer_to_page_lock_has_whole_pages_of_its_own(nbytes):
    buf = whole_pages(nbytes)
    assert buf.data_ptr() % 4096 == 0 and buf.numel() % 4096 == 0 and nbytes <= buf.numel() < nbytes + 4096


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_snapshot_memory_stays_the_size_of_the_state_across_relayouts():
    """CUDA sources: the buffer is page-locked (cudaHostRegister), exactly the state's size, and
    nothing is taken from torch's caching host allocator (which rounds up to powers of two).
    Page-locked is what the copy's speed shows: ``is_pinned()`` is False on some torch builds for
    memory registered with cudaHostRegister."""
    torch.cuda.synchronize()
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    snapper = Snapshotter()
    for state in _relayouts("cuda"):
        snap, _ = snapper.take(state)
        assert snap.arena.pinned and snapper.host.pinned  # registered: page_lock raises on a CUDA error
        assert snap.arena.size <= snapper.host.capacity <= 2 * snap.arena.size + 4096
        assert all(torch.equal(snap.state[k], v.cpu()) for k, v in state.items())
        assert torch.cuda.host_memory_stats().get("allocated_bytes.current", 0) == before
    assert snapper.host.allocations == 4
    big = {"w": torch.ones(64 << 20, device="cuda")}  # 256 MiB
    snapper.take(big)
    pageable = torch.empty(big["w"].numel() * 4, dtype=torch.uint8)

    def copy_s(into: torch.Tensor) -> float:
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            into.view(torch.float32).copy_(big["w"], non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return min(times)
    pinned_s, pageable_s = copy_s(snapper.host.tensor[:pageable.numel()]), copy_s(pageable)
    assert pinned_s * 1.5 < pageable_s, (pinned_s, pageable_s)  # H100: 54.9 GB/s against 13.6 GB/s
    snapper.clear()


def _write(snap) -> bytes:
    out = io.BytesIO()
    assert checkpoint_format.write(snap.state, snap.arena, out)
    return out.getvalue()


def test_tensors_are_laid_out_aligned_in_one_buffer():
    arena = Arena([((3,), torch.float32), ((), torch.int64), ((0, 5), torch.float16), ((2,), torch.bool)])
    offsets = [v.data_ptr() - arena.buffer.data_ptr() for v in arena.views if v.numel()]  # empty: no pointer
    assert all(o % 64 == 0 for o in offsets) and offsets == sorted(offsets) == [0, 64, 128]
    assert [tuple(v.shape) for v in arena.views] == [(3,), (), (0, 5), (2,)]
    assert json.loads(arena.table)[0] == ["float32", [3], 0, 12]
