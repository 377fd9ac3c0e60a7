"""A user's own loop as the Manager recovers it: its model, its data and its state, handed over once.

``Manager.start(model, DDP, optimizer=opt)`` and ``Manager.loader(DataLoader(...))`` build the
three pieces here, and ``Manager.step`` drives them; the loop itself stays plain
(``examples/own_loop.py``)::

    ddp = manager.start(model, DDP, optimizer=opt)      # a Rewrapped: DDP now, DDP again after a re-form
    loader = manager.loader(DataLoader(data, batch_sampler=sampler))   # an ElasticLoader
    for x, y in loader:
        loss = manager.step(train_step, x, y)

- ``Rewrapped``: the model as the loop holds it, one object for the whole run. It calls the
  current wrapper (``wrap(module)``, e.g. DDP) of the bare module; a re-form drops the wrapper
  before the old process group goes and makes a new one on the new group.
- ``ElasticLoader``: a ``DataLoader`` over an ``ElasticSampler`` (``batch_sampler=``), one batch per
  step. A re-form reshards the sampler for the new world (``ElasticSampler.reshard``); the
  iteration then goes on with a fresh iterator from the sampler's committed position, so the
  samples of a step that did not complete come again, cut for the new world: none is repeated or
  skipped. An iteration ends with the sampler's epoch, also when a received position is already in
  the next one (a rank that was behind).
- ``LoopRecovery``: the ``Recovery`` (``training/recovery.py``) of such a loop. What it sends a
  rank that needs the state (a newcomer, a rank behind): ``{"model", "optimizer", "loop"
  (``state()``, the loop's own extras), "samplers" (each loader's position), "step"}``; what it does
  at a re-form: release and re-wrap the model, load a received state, reshard the samplers. It
  counts the steps, commits the samplers' steps and writes the records (``loop_records.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from elastic_trainer.records import Event
from elastic_trainer.sampler import ElasticSampler
from elastic_trainer.training.loop_records import LoopRecords, Seat
from elastic_trainer.training.recovery import Reform

logger = logging.getLogger(__name__)


class Rewrapped(torch.nn.Module):
    """The bare ``module`` and its current wrapper for the process group, ``wrap(module)``.

    Calling it calls the wrapper; ``module``, ``parameters()`` and ``state_dict()`` are the bare
    module's (its keys prefixed ``module.``, as DDP's are); any other attribute (``no_sync``) is
    the wrapper's. Not distributed (a single process), the wrapper is the module itself."""

    def __init__(self, module: torch.nn.Module, wrap: Callable[[torch.nn.Module], torch.nn.Module] | None) -> None:
        super().__init__()
        self.module = module
        object.__setattr__(self, "wrap_fn", wrap)  # not a submodule: plain attributes
        object.__setattr__(self, "wrapped", None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.wrapped is None:
            raise RuntimeError("the model has no wrapper for the current process group: it was released for a "
                               "re-form (call it only inside Manager.step, after Manager.start)")
        return self.wrapped(*args, **kwargs)

    def rewrap(self, distributed: bool) -> None:
        """Wrap the bare module for the current process group (itself when not ``distributed``)."""
        wrapped = self.wrap_fn(self.module) if distributed and self.wrap_fn is not None else self.module
        wrapped.train(self.training)
        object.__setattr__(self, "wrapped", wrapped)

    def release(self) -> None:
        """Drop the wrapper: it refers to the process group about to go."""
        object.__setattr__(self, "wrapped", None)

    def train(self, mode: bool = True) -> Rewrapped:
        super().train(mode)
        if self.wrapped is not None and self.wrapped is not self.module:
            self.wrapped.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("wrapped")
            if wrapped is None or name.startswith("__"):
                raise
            return getattr(wrapped, name)


class ElasticLoader:
    """A ``DataLoader`` whose ``batch_sampler`` is an ``ElasticSampler``, iterated across re-forms
    (see the module docstring). ``stopped()``: the ranks agreed to stop (an iteration ends)."""

    def __init__(self, loader: torch.utils.data.DataLoader, stopped: Callable[[], bool]) -> None:
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(sampler, ElasticSampler):
            raise ValueError(f"Manager.loader needs a DataLoader whose batch_sampler is an ElasticSampler (got "
                             f"{type(sampler).__name__}); make it DataLoader(dataset, batch_sampler=sampler)")
        if sampler.micro_batches_per_step != 1:
            raise ValueError(f"Manager.loader yields one batch per step; the sampler splits a step into "
                             f"{sampler.micro_batches_per_step} micro-batches: make it with micro_batch_size=None")
        self.loader, self.sampler, self.stopped = loader, sampler, stopped
        self.generation = 0
        """Counts the process groups the sampler was split for (``regrouped``)."""
        self._current: EpochIteration | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> EpochIteration:
        self._current = EpochIteration(self)
        return self._current

    def regrouped(self) -> None:
        """A re-form resharded the sampler: the next batch comes from a fresh iterator."""
        self.generation += 1

    def redo(self) -> Any | None:
        """The batch that replaces a step lost to a re-form, from the committed position and cut for
        the new world; None when there is none (no iteration, or the epoch is over)."""
        return self._current.redo() if self._current is not None else None


class EpochIteration:
    """One ``for batch in loader``: this rank's batches of the sampler's epoch from its committed
    position; after a re-form (``loader.generation`` moved on) from a fresh ``DataLoader`` iterator."""

    def __init__(self, owner: ElasticLoader) -> None:
        self.owner, self.epoch, self.seen = owner, owner.sampler.epoch, owner.generation
        self.inner: Iterator | None = iter(owner.loader)

    def __iter__(self) -> EpochIteration:
        return self

    def __next__(self) -> Any:
        if self.inner is None or self.owner.stopped():
            self.inner = None  # a DataLoader iterator's workers go with it
            raise StopIteration
        if self.seen != self.owner.generation:
            self._fresh()
        return next(self.inner)

    def redo(self) -> Any | None:
        if self.inner is None:
            return None
        self._fresh()
        return next(self.inner, None)

    def _fresh(self) -> None:
        self.seen = self.owner.generation
        self.inner = None
        same_epoch = self.owner.sampler.epoch == self.epoch
        self.inner = iter(self.owner.loader) if same_epoch else iter(())


class LoopRecovery:
    """The ``Recovery`` of a user's loop (see the module docstring). ``seat``: the Manager (rank,
    world size, round, whether distributed), read at each use."""

    donors = None  # one source sends every receiver the whole state

    def __init__(self, seat: Seat, records: LoopRecords) -> None:
        self.seat, self.records = seat, records
        self.model: Rewrapped | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.extra: tuple[Callable[[], dict], Callable[[dict], None]] | None = None
        """The loop's own ``(state, load_state)``: an LR scheduler, a counter..."""
        self.loaders: list[ElasticLoader] = []
        self.steps = 0
        """Steps completed (sent to newcomers with the state, so the count goes on)."""
        self._positions: list[dict] | None = None  # a received state's sampler positions, for loaders to come

    @property
    def step(self) -> int:
        return self.steps

    def add_loader(self, loader: ElasticLoader) -> None:
        if self._positions is not None and len(self.loaders) < len(self._positions):
            loader.sampler.load_state_dict(self._positions[len(self.loaders)])
        self.loaders.append(loader)
        loader.sampler.reshard(self.seat.rank, self.seat.world_size)

    def joined(self, receive: Callable[[], dict | None] | None, source: int | None) -> None:
        """The first group is up (``Manager.start``): a newcomer (``receive``: what gives it a live
        peer's state, from ``source``) loads it when it has something to load it into; then the
        model is wrapped and the data split for the group."""
        self.records.open()
        seat = self.seat
        if receive is not None and (self.model is not None or self.optimizer is not None or self.extra is not None):
            t0 = time.perf_counter()
            got = receive()
            if got is not None:
                self.load_state_dict(got)
                self.records.event(Event.PEER_STATE_LOADED, step=self.steps, world_size=seat.world_size,
                                   source=source, seconds=time.perf_counter() - t0, round=seat.round)
        else:
            self.records.event(Event.START, world_size=seat.world_size, restart=self.records.restart,
                               round=seat.round)
        self.regrouped()

    # ---- the Recovery --------------------------------------------------------------------------
    def step_done(self, result: Any) -> None:
        self.steps += 1
        for loader in self.loaders:
            loader.sampler.commit_step()
        sampler = self.loaders[0].sampler if self.loaders else None
        self.records.step(self.steps, result, sampler.epoch if sampler else None, sampler.offset if sampler else None)

    def release(self, cause: str, planned: bool) -> None:
        if self.model is not None:
            self.model.release()

    def state_dict(self) -> dict:
        return {"model": self.model.module.state_dict() if self.model is not None else None,
                "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
                "loop": self.extra[0]() if self.extra is not None else None,
                "samplers": [loader.sampler.state_dict() for loader in self.loaders], "step": self.steps}

    def load_state_dict(self, state: dict) -> None:
        """A peer's state (a newcomer's at start, a rank behind's after a re-form), into this loop."""
        if self.model is not None and state.get("model") is not None:
            self.model.module.load_state_dict(state["model"])
        if self.optimizer is not None and state.get("optimizer") is not None:
            self.optimizer.load_state_dict(state["optimizer"])
        if self.extra is not None and state.get("loop") is not None:
            self.extra[1](state["loop"])
        self._positions = list(state.get("samplers") or [])
        for loader, position in zip(self.loaders, self._positions):
            loader.sampler.load_state_dict(position)
        self.steps = int(state.get("step", self.steps))

    def reformed(self, reform: Reform) -> None:
        if reform.state is not None:
            self.load_state_dict(reform.state)
        self.regrouped()
        q = reform.quorum
        self.records.event(Event.LIVE_REFORM, step=self.steps, old=reform.old_world_size, new=q.world_size,
                           round=q.q, old_round=reform.old_round, cause=q.cause, failed_at=reform.failed_at,
                           receivers=list(q.receivers), ahead=reform.ahead, **reform.timings())
        if reform.old_world_size != q.world_size:
            self.records.event(Event.WORLD_SIZE_CHANGED, old=reform.old_world_size, new=q.world_size, step=self.steps)

    def ahead(self, quorum, group) -> None:
        """Nothing to make ahead: the loop's ``wrap`` (DDP) runs at the switch, where it broadcasts."""

    def regrouped(self) -> None:
        """A new process group (the first, or a re-form's): the model wrapped for it, the data split over it."""
        for loader in self.loaders:
            loader.sampler.reshard(self.seat.rank, self.seat.world_size)
            loader.regrouped()
        if self.model is not None:
            self.model.rewrap(self.seat.distributed)
            self.seat.time_steps(self.model.wrapped)  # DDP: this rank's own step, which names a straggler

    def redo(self) -> Any | None:
        """The batch of the step that replaces a lost one (the first loader's), or None."""
        return self.loaders[0].redo() if self.loaders else None


__all__ = ["ElasticLoader", "EpochIteration", "LoopRecovery", "Rewrapped"]
