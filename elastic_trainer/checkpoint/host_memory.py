"""Host memory for checkpoints: one reused CPU buffer per saver, page-locked for GPU states, made ready before the first save.

A save blocks training while the state is copied from the GPU into CPU memory. That copy runs at
the bus's speed (about 55 GB/s on an H100) only into *page-locked* (pinned) memory; into ordinary
pageable memory it is about 4 times slower. Page-locking is itself slow: ``cudaHostRegister``
faults in and locks every page, about 0.37 s per GB on an H100, so a first save that made its
buffer then blocked 0.6-0.7 s for a 2 GB state where later saves blocked 40 ms. Two things here
keep every save as short as the steady ones:

1. **One buffer, reused.** A ``HostBuffer`` is allocated once at the size of the state (whole
   pages, page-locked for CUDA sources) and reused by every save and every re-layout that fits;
   it is made again, exactly the new size, only when the state outgrows it, shrinks below half
   of it, or needs pinning it lacks (or has pinning it does not need). So the memory stays about
   the size of the state, unlike torch's caching host allocator (``pin_memory=True``), which
   rounds every block up to a power of two and keeps freed blocks.
2. **Made ready early.** ``HostBuffer.prepare(nbytes, pinned)`` allocates and page-locks (on the
   CPU: touches every page) on a background thread owned by the worker runtime
   (``runtime.py``); a trainer calls it, through ``CheckpointManager.prepare`` or
   ``ShardedSaver.prepare``, once the state exists (after the first step, when the optimizer
   has made its state) and long before the first save. ``get`` adopts the prepared buffer,
   waiting for it only if it is not ready yet (``waited_s``).

    host = HostBuffer()
    host.prepare(2 << 30, pinned=True)   # returns at once
    ...                                  # training steps
    buf = host.get(nbytes, pinned=True)  # the prepared buffer: no allocation here
"""

from __future__ import annotations

import logging
import threading
import time
import weakref

import torch

log = logging.getLogger(__name__)

PAGE = 4096


def slack(nbytes: int) -> int:
    """The room a buffer prepared for ``nbytes`` leaves for what a save adds to the tensors it was
    sized from (RNG states, sampler, counters: small): 1/64 of the size, at least 64 KiB, at most
    the size itself (a buffer more than twice the state's size would not be reused)."""
    return min(max(nbytes // 64, 64 << 10), nbytes)


class HostBuffer:
    """The one CPU buffer a saver lays its snapshots out in, pinned for CUDA sources; see the module docstring.

    ``allocations`` counts the buffers made (a prepared one included), ``capacity`` is the
    current one's size in bytes, ``waited_s`` how long the last ``get`` waited for a preparation.
    """

    def __init__(self) -> None:
        self.tensor: torch.Tensor | None = None
        self.pinned = False
        self.allocations = 0
        self.waited_s = 0.0
        self._unpin: weakref.finalize | None = None
        self._lock = threading.Lock()
        self._preparing: threading.Thread | None = None
        self._prepared: tuple[torch.Tensor, weakref.finalize | None, bool] | None = None
        self._error: BaseException | None = None

    @property
    def capacity(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()

    def fits(self, nbytes: int, pinned: bool) -> bool:
        """Whether the current buffer serves ``nbytes`` with this pinning (see the class)."""
        return self.tensor is not None and pinned == self.pinned and nbytes <= self.capacity <= 2 * nbytes + PAGE

    def prepare(self, nbytes: int, pinned: bool) -> bool:
        """Start making a buffer of ``nbytes`` (plus ``slack``) on a background thread, unless the
        current one or one in preparation already serves it; returns whether one was started."""
        self.wait()
        if nbytes <= 0 or self.fits(nbytes, pinned):
            return False
        from elastic_trainer.runtime import runtime

        self._preparing = runtime().start_thread("checkpoint-host-buffer", self._make, nbytes + slack(nbytes), pinned)
        return True

    def _make(self, nbytes: int, pinned: bool) -> None:
        try:
            t0 = time.perf_counter()
            made = (*allocate(nbytes, pinned, touch=True), pinned)
            log.debug("checkpoint host buffer of %d bytes (%s) ready in %.3fs", nbytes,
                      "page-locked" if pinned else "pageable", time.perf_counter() - t0)
            with self._lock:
                self._prepared = made
        except Exception as exc:  # noqa: BLE001 - handed to the training thread by wait()
            with self._lock:
                self._error = exc

    def wait(self) -> float:
        """Wait for a preparation in progress and adopt its buffer (the current one freed first);
        returns the seconds waited. A preparation that failed is logged and changes nothing: ``get``
        then allocates as it would have (and raises what that raises)."""
        thread = self._preparing
        if thread is None:
            return 0.0
        t0 = time.perf_counter()
        thread.join()
        waited = time.perf_counter() - t0
        self._preparing = None
        with self._lock:
            made, error, self._prepared, self._error = self._prepared, self._error, None, None
        if error is not None:
            log.warning("preparing the checkpoint's host buffer failed (%s: %s); the next save allocates it",
                        type(error).__name__, error)
        if made is not None:
            self._drop()
            self.tensor, self._unpin, self.pinned = made
            self.allocations += 1
        return waited

    def get(self, nbytes: int, pinned: bool) -> torch.Tensor:
        """A uint8 buffer of at least ``nbytes`` bytes (the prepared or current one when it fits)."""
        self.waited_s = self.wait()
        if not self.fits(nbytes, pinned):
            self._drop()
            self.tensor, self._unpin = allocate(nbytes, pinned)
            self.pinned = pinned
            self.allocations += 1
        return self.tensor

    def free(self) -> None:
        """Unpin and drop the buffer, a prepared one too (views still held elsewhere stay valid, no
        longer pinned)."""
        self.wait()
        self._drop()

    def _drop(self) -> None:
        if self._unpin is not None:
            self._unpin()
            self._unpin = None
        self.tensor, self.pinned = None, False


def allocate(nbytes: int, pinned: bool, touch: bool = False) -> tuple[torch.Tensor, weakref.finalize | None]:
    """A new uint8 CPU buffer of ``nbytes`` and, when ``pinned``, the finalizer that unpins it.

    Pinned: whole pages (``whole_pages``) page-locked with ``cudaHostRegister`` (which faults
    every page in). Not pinned, with ``touch``: its pages written now (a preparation), so that
    the first copy into it does not fault them in."""
    if pinned and nbytes:
        tensor = whole_pages(nbytes)
        return tensor, page_lock(tensor)
    tensor = torch.empty(nbytes, dtype=torch.uint8)
    if touch and nbytes:
        pages = tensor.numpy()  # one byte a page, on this thread alone (zero_() would take the intra-op threads)
        pages[::PAGE] = 0
        pages[-1] = 0
    return tensor, None


def whole_pages(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer of at least ``nbytes`` bytes that starts and ends on page boundaries, so
    that page-locking it locks no page another allocation shares (``cudaHostRegister`` refuses a
    page already registered, as a neighbouring small buffer's would be)."""
    size = -(-nbytes // PAGE) * PAGE
    raw = torch.empty(size + PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start:start + size]


def page_lock(tensor: torch.Tensor) -> weakref.finalize:
    """Page-lock ``tensor``'s memory for the GPU; returns the finalizer that unlocks it (called by
    ``HostBuffer.free``, or when ``tensor`` is collected: before its memory can be freed, which
    views of it may delay; they stay valid, unpinned).

    The memory is not pinned in torch's sense (``tensor.is_pinned()`` is False on some builds for
    memory registered this way); what matters, a device-to-host copy at the bus's speed, is."""
    cudart = torch.cuda.cudart()
    ptr = tensor.data_ptr()
    err = int(cudart.cudaHostRegister(ptr, tensor.numel(), 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        raise RuntimeError(f"cudaHostRegister of the {tensor.numel()}-byte checkpoint buffer failed with CUDA error "
                           f"{err}; is the locked-memory limit (ulimit -l) of the container too low?")
    unpin = weakref.finalize(tensor, _page_unlock, ptr)
    unpin.atexit = False  # never after the CUDA context is gone
    return unpin


def _page_unlock(ptr: int) -> None:
    err = int(torch.cuda.cudart().cudaHostUnregister(ptr))
    if err != 0:
        raise RuntimeError(f"cudaHostUnregister of the checkpoint buffer failed with CUDA error {err}")


def cuda_devices(tensors: list[torch.Tensor]) -> list[torch.device]:
    """The CUDA devices ``tensors`` live on, in first-seen order: the ones whose queued copies a
    snapshot must wait for (``torch.cuda.synchronize()`` alone waits for the *current* device,
    which need not be the state's)."""
    seen: dict[torch.device, None] = {}
    for t in tensors:
        if t.is_cuda:
            seen.setdefault(t.device, None)
    return list(seen)


__all__ = ["HostBuffer", "PAGE", "allocate", "cuda_devices", "page_lock", "slack", "whole_pages"]
