"""Timing helpers shared by the benchmark programs (medians after warm-up)."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

__all__ = ["environment", "median_ms", "median_ms_threaded", "median_seconds_fresh"]


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


def median_seconds_fresh(fn: Callable, args: tuple, repeats: int = 5) -> float:
    """Median seconds of ``fn(*args)`` called on a fresh device copy of ``args`` each time.

    For jitted functions that donate their inputs: the copies are made (and
    finished) before the clock starts, so every call sees the same inputs and
    pays what a training loop pays. The first call compiles and is not timed.
    """
    times = []
    for i in range(repeats + 1):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*fresh))
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def environment() -> dict:
    """Where a benchmark ran, for the ``meta`` of its JSON.

    JAX's version and backend, the first device, the machine, its CPU count,
    ``XLA_FLAGS`` (simulated devices, codegen options) and the local time.
    """
    return {
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "machine": platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
