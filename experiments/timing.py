"""Timing helpers shared by the benchmark programs (medians after warm-up)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax

__all__ = ["median_ms", "median_ms_threaded"]


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


def median_ms_threaded(
    fn: Callable,
    state,
    *args,
    next_state: Callable = lambda out: out,
    warmup: int = 2,
    repeats: int = 7,
) -> float:
    """Median time of ``state = next_state(fn(state, *args))``, as a training loop runs.

    For functions that donate ``state`` (``jax.jit(..., donate_argnums=0)``),
    so that the new residual or optimizer state is written in place of the old
    one, as in a real training step; donated inputs cannot be reused.
    """
    times = []
    for i in range(warmup + repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(state, *args))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        state = next_state(out)
    return 1e3 * statistics.median(times)
