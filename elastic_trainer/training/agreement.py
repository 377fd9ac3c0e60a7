"""The step agreement: what the ranks share at a step's end, and how often they do.

Under live recovery a rank learns of a re-form to come (a node waits to join, a member's lease
expired) from its own quorum, at its own moment; the ranks must still re-form at one and the same
step. So every few steps they run one small all-reduce (``Manager.agree``) of::

    [the loop's own values..., this rank's "re-form pending" flag, rank 0's next interval,
     this rank's "next group formed ahead" flag]

Summed over the ranks, the flag says whether any rank asks to re-form (``Agreement.reform``: all
re-form now) and the interval is rank 0's alone (the others send 0): every rank then counts down
the same number of steps to the next agreement (``Cadence``). While a join's group forms beside the
one in use (``group_ahead.py``) the ranks agree every step, and the last flag counts the ranks whose
part of it is up (``Agreement.ahead``): all of them, and they switch to it at that step. The loop's values ride along for
free (a loss to log, a "stop now" vote). The interval is about 0.2 s of steps
(``agree_interval``): often enough that a joiner waits little, seldom enough that the all-reduce
costs 1-2% of a small CPU step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """What the ranks agreed at a step's end."""

    values: list[float]
    """The loop's values, summed over the ranks."""
    reform: bool
    """Some rank's quorum asks to re-form (a node waits to join, a member's lease expired): every
    rank re-forms now, at this same step (``Manager.reform``)."""
    next_in: int
    """Steps until the next agreement (rank 0's choice)."""
    ahead: int = 0
    """How many ranks have the next group formed ahead (a join: all of them, and they switch now)."""

    @classmethod
    def read(cls, shared: torch.Tensor) -> Agreement:
        """The agreement in a reduced ``shared`` tensor (``shared_values``'s layout)."""
        out = shared.tolist()
        n = len(out) - 3
        return cls(out[:n], out[n] > 0, max(1, int(out[n + 1])), int(out[n + 2]))


def shared_values(values: Sequence[float] | torch.Tensor, reform_pending: bool, interval: int, rank: int,
                  device: torch.device, ahead: bool = False) -> torch.Tensor:
    """What one rank contributes to the agreement's all-reduce: ``values`` (float64), its re-form
    flag, on rank 0 ``interval`` (0 elsewhere), and whether its part of the next group is formed
    ahead, on the device of ``values`` when a tensor (the group's device: NCCL needs CUDA tensors),
    else on ``device``."""
    vals = values.to(torch.float64) if isinstance(values, torch.Tensor) else torch.tensor(
        [float(v) for v in values], dtype=torch.float64, device=device)
    flags = torch.tensor([float(reform_pending), float(interval) if rank == 0 else 0.0, float(ahead)],
                         dtype=torch.float64, device=vals.device)
    return torch.cat([vals.reshape(-1), flags])


def agree_interval(host_cycle_s: float, device_step_s: float | None = None) -> int:
    """Steps between two step-end agreements: about 0.2 s of steps, 1 to 32. A step takes the
    longer of the host's cycle (start to start) and the device's own time for it (CUDA), since the
    host only queues the GPU's work and runs ahead of it until a synchronisation point."""
    cycle = max(host_cycle_s, device_step_s or 0.0)
    return max(1, min(32, int(0.2 / cycle))) if cycle > 0 else 1


class Cadence:
    """When the next agreement is due: a countdown of steps (``next_in``, set from each
    ``Agreement``; the first step agrees), and the measured cycle from one step's start to the
    next (``cycle_s``, None until two steps started), which sets the default interval.

    ``count()`` is the command (a step starts: ``Manager.run`` calls it); ``due`` only asks."""

    def __init__(self) -> None:
        self.next_in = 1
        self.cycle_s: float | None = None
        self._last: float | None = None

    def count(self) -> None:
        """A step starts: one step fewer to the next agreement, and the cycle since the last start."""
        now = time.perf_counter()
        if self._last is not None:
            self.cycle_s = now - self._last
        self._last = now
        self.next_in -= 1

    @property
    def due(self) -> bool:
        """Whether the ranks agree at the end of the step counted last."""
        return self.next_in <= 0


__all__ = ["Agreement", "Cadence", "agree_interval", "shared_values"]
