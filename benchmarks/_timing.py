"""What the CPU benchmarks share: the median time of a step, after one warm-up call."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def median_ms(step: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` timed calls of ``step``, in milliseconds, after one untimed call (allocations, the
    first call's dispatch, a compilation)."""
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)
