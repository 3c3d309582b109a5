"""Timing helpers shared by the benchmark programs (medians after warm-up)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

__all__ = ["median_ms"]


def median_ms(fn: Callable, *args, warmup: int = 2, repeats: int = 7) -> float:
    """Median wall time of ``fn(*args)`` in milliseconds, results blocked on."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)
