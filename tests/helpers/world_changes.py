"""A hypothesis strategy for runs whose world size changes: the segments the sampler tests simulate.

    segments = draw(world_segments(n=160, b0=12))   # [(world size, global batch, steps, steps lost), ...]

Each segment trains ``steps`` steps at one world size and global batch, and loses its last ``lost``
(the work after the last checkpoint); the last segment (the survivors) runs to the end. Used by
``test_sampler.py`` (map-style) and ``test_stream_position.py`` (streaming).
"""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def world_segments(draw, n: int, b0: int, vary_batch: bool = False) -> list[tuple[int, int, int, int]]:
    """Up to 5 segments over ``n`` samples at global batch ``b0`` (any batch up to 24 with ``vary_batch``),
    world sizes 1..6, then a last one at ``b0`` that finishes the run."""
    segments = []
    for _ in range(draw(st.integers(0, 5))):
        b = draw(st.integers(1, min(n, 24))) if vary_batch else b0
        w = draw(st.integers(1, min(b, 6)))
        steps = draw(st.integers(0, 2 * (n // b) + 1))
        segments.append((w, b, steps, draw(st.integers(0, steps))))
    segments.append((draw(st.integers(1, min(b0, 6))), b0, 10**6, 0))  # the survivors finish the run
    return segments
