"""Peer copies: each rank's shard in the host memory of a rank on another node, every K steps
(``--fsdp-peer-copy-every``), so that a lost node's shards survive it without a checkpoint.

Under ``--fsdp-shard-all`` (or HSDP when every replica of a shard is lost at once) no live rank
holds a lost rank's shard, and without a copy the survivors reload the newest checkpoint from
storage and redo the steps since it. Gemini (SOSP '23) keeps checkpoints in peers' CPU memory
instead; this is that idea at its smallest:

- **Who holds whose.** A ring over nodes: rank ``r`` sends to rank ``(r + nproc) % world`` (the
  same local rank of the next node), and keeps its own snapshot too. A node's loss then leaves
  every shard of the layout with a holder unless the next node is lost as well.
- **What.** At every K-th step (and the first step in a new quorum), the training thread copies its shards (parameters and optimizer
  state, ``hsdp.Shards``) to host memory and captures its trainer state (sampler, step, RNG,
  scheduler: what the heal path sends a newcomer); that is all it waits for. A background thread
  (``runtime().start_thread``) serializes it and pushes it over a plain TCP connection to the
  holder, whose server thread keeps the bytes. Not a process group: a send is outside the
  collectives' failure and re-form logic, and a lost holder costs a failed send, nothing more.
- **How many.** Two generations per (quorum, rank), so a node lost in the middle of a refresh
  still leaves the previous step complete on every holder. Host memory per rank: 4 shards' worth
  (two of its own, two of its peer's), as serialized bytes.
- **Used** by ``reshard.gather`` at a re-form that no live replica can heal: the newest step that
  every shard index has a copy of among the survivors (``reshard.choose``), cut to the new world.

Both server and sender live for the process (a re-form only changes where the sender sends,
learned in one ``all_gather_object`` at the first copy after it).
"""

from __future__ import annotations

import io
import json
import logging
import socket
import threading
import time

import torch
import torch.distributed as dist

from elastic_trainer.training.hsdp import Shards
from elastic_trainer.training.reshard import Held
from elastic_trainer.runtime import runtime

logger = logging.getLogger(__name__)

GENERATIONS = 2
"""Copies kept per (quorum, rank): the newest and the one before it."""


def encode(shards: Shards, trainer: dict) -> bytes:
    """A snapshot's bytes (``torch.save``; what ``reshard.gather`` decodes with ``weights_only``)."""
    buf = io.BytesIO()
    torch.save({"shards": shards.to_state(), "trainer": trainer}, buf)
    return buf.getvalue()


def host_copy(shards: Shards) -> Shards:
    """``shards`` copied to host memory (on the CPU: cloned), so that training may change them."""
    def cp(t):
        return t.detach().to("cpu", copy=True) if isinstance(t, torch.Tensor) else t
    return Shards({n: cp(t) for n, t in shards.params.items()}, {n: cp(t) for n, t in shards.buffers.items()},
                  {n: {k: cp(v) for k, v in st.items()} for n, st in shards.optim.items()},
                  dict(shards.sharded_keys), [dict(g) for g in shards.groups])


class Store:
    """The copies this process holds, its own among them: ``Held`` -> bytes, ``GENERATIONS`` newest
    steps per (quorum, shard index); a newer quorum's copy drops the older quorums' (their layout
    is gone once the new one has a copy of its own)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[Held, bytes] = {}

    def put(self, held: Held, data: bytes) -> None:
        with self._lock:
            items = {h: d for h, d in self._items.items() if h.q >= held.q}
            same = sorted((h for h in items if (h.q, h.shards, h.index) == (held.q, held.shards, held.index)),
                          key=lambda h: h.step)
            for old in same[:max(0, len(same) - GENERATIONS + 1)]:
                del items[old]
            items[held] = data
            self._items = items

    def items(self) -> dict[Held, bytes]:
        with self._lock:
            return dict(self._items)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(len(d) for d in self._items.values())


class PeerCopies:
    """This worker's server (copies from a peer), its sender (its own to a peer) and its store.

    ``every`` steps; ``host``: the address peers reach this worker at (its probe listener's)."""

    def __init__(self, every: int, host: str, nproc: int) -> None:
        self.every, self.nproc = every, nproc
        self.store = Store()
        self._server = socket.create_server((host, 0))
        self._server.settimeout(0.5)  # accept() wakes to see close()
        self.address = (host, self._server.getsockname()[1])
        self._closed = False
        self._pending: tuple[Held, Shards, dict, tuple[str, int] | None] | None = None
        self._cond = threading.Condition()
        self._target: tuple[int, tuple[str, int] | None] | None = None  # (quorum, the holder's address)
        self.sent = 0
        self.copy_s: list[float] = []  # the training thread's time per snapshot
        self.send_s: list[float] = []  # the sender thread's time per copy (serialize, send, kept)
        self.sizes: list[int] = []
        rt = runtime()
        rt.start_thread("peer-copy-server", self._serve, stop=self.close)
        rt.start_thread("peer-copy-sender", self._send_loop, stop=self.close)

    # ---- the training thread -----------------------------------------------------------------------
    def due(self, step: int, world: int, q: int) -> bool:
        """Every ``every``-th step, and the first step in a new quorum (whose layout no copy holds yet:
        a join that resharded leaves no copy of the new shards), on every rank alike."""
        fresh = self._target is None or self._target[0] != q
        return self.every > 0 and world > self.nproc and (step % self.every == 0 or fresh)

    def snapshot(self, q: int, rank: int, world: int, shards_count: int, step: int, shards: Shards,
                 trainer: dict) -> float:
        """Copy this rank's shards to host memory and hand them to the sender (collective the first
        time in quorum ``q``: every rank learns its holder's address). Returns the seconds it took."""
        t0 = time.perf_counter()
        if self._target is None or self._target[0] != q:
            addresses: list = [None] * world
            dist.all_gather_object(addresses, self.address)
            self._target = (q, tuple(addresses[(rank + self.nproc) % world]))
        held = Held(q, shards_count, rank % shards_count, step, "copy")
        snap = host_copy(shards)
        with self._cond:
            self._pending = (held, snap, trainer, self._target[1])  # a newer one replaces one not yet sent
            self._cond.notify()
        took = time.perf_counter() - t0
        self.copy_s.append(took)
        return took

    # ---- the threads ---------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while True:
            with self._cond:
                while self._pending is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                held, snap, trainer, target = self._pending
                self._pending = None
            t0 = time.perf_counter()
            data = encode(snap, trainer)
            self.store.put(held, data)  # its own copy
            try:
                with socket.create_connection(target, timeout=30) as conn:
                    header = json.dumps({"q": held.q, "shards": held.shards, "index": held.index,
                                         "step": held.step, "bytes": len(data)}).encode() + b"\n"
                    conn.sendall(header)
                    conn.sendall(data)
                    if conn.recv(1) != b"k":
                        raise ConnectionError("the holder closed the connection before it kept the copy")
                self.sent += 1
                self.send_s.append(time.perf_counter() - t0)
                self.sizes.append(len(data))
            except OSError as exc:  # a lost holder: the re-form that follows names a new one
                logger.info("peer copy of step %d to %s:%d not sent: %s", held.step, *target, exc)

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                with conn:
                    conn.settimeout(60)
                    reader = conn.makefile("rb")
                    head = json.loads(reader.readline())
                    data = reader.read(head["bytes"])
                    if len(data) != head["bytes"]:
                        raise ConnectionError(f"a peer copy ended after {len(data)} of {head['bytes']} bytes")
                    self.store.put(Held(head["q"], head["shards"], head["index"], head["step"], "copy"), data)
                    conn.sendall(b"k")
            except (OSError, ValueError) as exc:  # a sender lost mid-copy: its older copy stands
                logger.info("a peer copy was not received: %s", exc)

    def summary(self) -> str:
        """One line: copies sent, their size, the training thread's and the sender's time per copy."""
        def med(xs: list) -> float:
            return sorted(xs)[len(xs) // 2] if xs else float("nan")
        return (f"peer copies: {self.sent} sent of {len(self.copy_s)} taken, {med(self.sizes)} bytes each, "
                f"training thread {med(self.copy_s):.4f}s per copy, sender {med(self.send_s):.4f}s per copy "
                f"(medians); holding {self.store.nbytes} bytes")

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        try:
            self._server.close()
        except OSError:
            pass


__all__ = ["GENERATIONS", "PeerCopies", "Store", "encode", "host_copy"]
