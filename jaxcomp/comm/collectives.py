"""Collectives for compressed gradients, run inside ``jax.shard_map`` (or ``pmap``).

Every function takes the mesh axis name and returns the averaged dense update
together with the bytes this device put on the wire for it, counted from the
shapes and dtypes of what the collective actually moves (not estimated from a
ratio). Byte counts follow the usual cost model of each collective: a ring
all-reduce of ``B`` bytes over ``N`` devices sends ``2 (N - 1) / N * B`` bytes
per device; an all-gather of a ``B``-byte message sends ``(N - 1) * B`` bytes
per device (each device's message travels to the ``N - 1`` others).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "axis_size",
    "dense_mean",
    "sparse_mean",
]


def axis_size(axis_name) -> int:
    """Number of devices along ``axis_name`` (a static int inside shard_map)."""
    return lax.axis_size(axis_name)


def _nbytes(x: jax.Array) -> int:
    return x.size * jnp.dtype(x.dtype).itemsize


def dense_mean(x: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """All-reduce mean of a dense tensor (the uncompressed baseline).

    Returns:
      ``(mean, bytes_sent)`` with ``bytes_sent`` a float32 scalar: a ring
      all-reduce's ``2 (N - 1) / N`` times the tensor's size.
    """
    n_dev = axis_size(axis_name)
    mean = lax.pmean(x, axis_name)
    sent = 2.0 * (n_dev - 1) / n_dev * _nbytes(x)
    return mean, jnp.float32(sent)


def sparse_mean(
    indices: jax.Array, values: jax.Array, size: int, axis_name
) -> tuple[jax.Array, jax.Array]:
    """Mean over devices of sparse messages, as a dense 1-D array of ``size``.

    Each device holds a fixed-capacity message: ``indices`` (int32, padding
    entries equal to ``size``, an out-of-range sentinel) and ``values``
    (padding 0). The messages are all-gathered and scatter-added into one
    dense buffer, then divided by the number of devices.

    Summation order: contributions to one coordinate are added device by
    device in axis order, the same on every device, so every device gets a
    bit-identical result; it equals ``sum_d dense_d / N`` up to float
    rounding of that order.

    Returns:
      ``(mean, bytes_sent)``: the dense mean (``values.dtype``) and the bytes
      this device sends, ``(N - 1) * (capacity * (4 + itemsize))``.
    """
    n_dev = axis_size(axis_name)
    all_idx = lax.all_gather(indices, axis_name)  # [N, capacity]
    all_val = lax.all_gather(values, axis_name)
    out = jnp.zeros((size,), values.dtype)
    out = out.at[all_idx.reshape(-1)].add(all_val.reshape(-1), mode="drop")
    sent = (n_dev - 1) * (_nbytes(indices) + _nbytes(values))
    return out / n_dev, jnp.float32(sent)
