"""The rollout chunk: how many rows the native engine samples at once.

``rollout.chunk_rows: auto`` picks the largest number of rows that is a multiple of
``rollout.group_size`` (a group's rows stay in one chunk: they share their prompt's prefill), at
most the rows one rank samples per step, and whose rollout phase — everything resident plus the
chunk's KV, state and workspace — fits the device. Every rollout term grows with the rows, so
the fitting row counts are a prefix and a bisection finds the largest. ``chunk_rows: N`` uses N
(at most the step's rows) and the plan says whether it fits.
"""

from __future__ import annotations

from collections.abc import Callable


def largest_fitting_rows(fits: Callable[[int], bool], group_size: int, max_rows: int) -> int:
    """The largest multiple of ``group_size`` ≤ ``max_rows`` with ``fits(rows)`` (``fits`` true on a
    prefix of the multiples); 0 when not even one group fits."""
    lo, hi = 0, max_rows // group_size
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid * group_size):
            lo = mid
        else:
            hi = mid - 1
    return lo * group_size


def chunks_per_step(rows_per_rank: int, chunk_rows: int) -> int:
    return -(-rows_per_rank // chunk_rows) if chunk_rows > 0 else 0
