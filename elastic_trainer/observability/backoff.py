"""When to try again: exponential back-off with jitter, as one small object.

Used where a node waits before it tries something again that failed for a reason outside it: a
health check before joining (``health.py``: storage away, etcd slow, a device that fails), and an
evicted straggler's hold-out (``stragglers.StragglerConfig.hold_out_s``, doubled each time the same
node is evicted again). The n-th delay is ``initial x factor**(n-1)``, at most ``maximum``, spread by
+-``jitter`` (a fraction) so that nodes that failed together do not all retry in the same second;
``max_attempts`` (None: no limit) ends the retries: ``next_delay()`` then returns None.

Usage::

    backoff = BackOff(initial=5.0, maximum=300.0)
    while not (report := health.check_node(...)).ok:
        delay = backoff.next_delay()
        if delay is None:
            raise SystemExit(report.summary())
        logger.warning("%s; next check in %.0f s", report.summary(), delay)
        time.sleep(delay)
    backoff.reset()
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class BackOff:
    """Delays before each retry (see the module docstring); ``attempts``: delays given so far."""

    initial: float = 5.0
    """Seconds before the first retry."""
    factor: float = 2.0
    """Each delay is this many times the one before, up to ``maximum``."""
    maximum: float = 300.0
    """The longest delay, in seconds."""
    jitter: float = 0.1
    """Each delay is moved by up to this fraction of itself, at random, either way."""
    max_attempts: int | None = None
    """Retries before ``next_delay`` gives up (None: never)."""
    rng: random.Random = field(default_factory=random.Random, repr=False)
    """The source of the jitter (pass a seeded one for a repeatable sequence)."""
    attempts: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.initial <= self.maximum:
            raise ValueError(f"back-off: the first delay ({self.initial:g} s) must be above 0 and at most the "
                             f"longest ({self.maximum:g} s)")
        if self.factor < 1 or not 0 <= self.jitter < 1:
            raise ValueError(f"back-off: factor must be at least 1 (got {self.factor:g}) and jitter from 0 to "
                             f"below 1 (got {self.jitter:g})")
        if self.max_attempts is not None and self.max_attempts < 0:
            raise ValueError(f"back-off: max_attempts must be 0 or more, or None, got {self.max_attempts}")

    def peek(self) -> float:
        """The next delay without jitter and without counting it."""
        return min(self.maximum, self.initial * self.factor ** self.attempts)

    def next_delay(self) -> float | None:
        """Seconds to wait before the next try, or None once ``max_attempts`` delays were given."""
        if self.max_attempts is not None and self.attempts >= self.max_attempts:
            return None
        delay = self.peek()
        self.attempts += 1
        return delay * (1.0 + self.jitter * self.rng.uniform(-1.0, 1.0))

    def reset(self) -> None:
        """It worked: the next failure starts from ``initial`` again."""
        self.attempts = 0


__all__ = ["BackOff"]
