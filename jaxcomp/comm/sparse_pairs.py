"""What the sparse all-reduces share: the message, the result, and the arithmetic on pairs.

A message is this device's fixed-capacity list of (index, value) pairs:
``indices`` int32 ``[cap]`` into a dense vector of ``size`` elements (the
index ``size`` marks padding, with value 0) and ``values`` ``[cap]``. Every
exchange of :mod:`jaxcomp.comm.sparse_allreduce` runs inside
``jax.shard_map`` over ``axis_name`` and returns an :class:`Exchanged`: the
dense ``update`` (the mean, or this device's region of it), the bytes this
device sent, and the pairs it must add back into its residual (those a
selecting exchange dropped), so that nothing is lost globally.

The pair arithmetic here is written so that every device computes the same
thing from the same pairs: :func:`merge_pairs` is the canonical union of two
messages with unique indices (sorted by index; of two equal indices the first
slot holds the sum, the second becomes padding), whichever message comes
first, so the two partners of a recursive-doubling round agree;
:func:`top_and_rest` ranks by ``|value|`` with padding last and ties by
position; :func:`scatter_add_mean` scatters pairs into the dense mean
(dividing by ``N`` first unless :func:`jaxcomp.comm.collectives.mean_first`
already did); :func:`to_owners` routes pairs to their region's owner over a
padded ``all_to_all`` (``ragged_all_to_all`` does not run on XLA:CPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.comm.collectives import axis_size

__all__ = [
    "Exchanged",
    "is_power_of_two",
]


class Exchanged(NamedTuple):
    """What a sparse all-reduce gives this device.

    Attributes:
      update: the dense mean ``[size]`` (identical on every device).
      wire_bytes: float32 bytes this device sent.
      returned_indices: int32 pairs to add back into this device's residual
        (``size`` = padding), or None when nothing is dropped.
      returned_values: their values (the message dtype), or None.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm.sparse_allreduce import exchange
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: exchange("allgather", i, v, 4, "data"),
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> out = f(jnp.array([0, 2], jnp.int32), jnp.array([1.0, 3.0]))
      >>> out.update.tolist(), out.returned_indices is None
      ([1.0, 0.0, 3.0, 0.0], True)
    """

    update: jax.Array
    wire_bytes: jax.Array
    returned_indices: jax.Array | None = None
    returned_values: jax.Array | None = None


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` is a positive power of two (the recursive-doubling exchanges need it).

    Example:
      >>> is_power_of_two(8), is_power_of_two(6)
      (True, False)
    """
    return n >= 1 and n & (n - 1) == 0


def check_power_of_two(name: str, n_dev: int) -> None:
    if not is_power_of_two(n_dev):
        raise ValueError(
            f"exchange={name!r} pairs devices by recursive doubling and needs a power-of-two "
            f"number of devices along the axis, got {n_dev}; use exchange='oktopk' (any N) "
            "or 'sparse'"
        )


def scatter_add_mean(indices, values, size: int, n_dev: int):
    scaled = values / jnp.asarray(n_dev, values.dtype) if n_dev > 1 else values
    return jnp.zeros((size,), values.dtype).at[indices].add(scaled, mode="drop")


def returned_units(values, n_dev: int, divisor: int):
    """Values an exchange gives back to a residual, in the message's units (float32 if rescaled)."""
    if divisor == n_dev:
        return values
    return values.astype(jnp.float32) * n_dev


def merge_pairs(idx_a, val_a, idx_b, val_b, size: int):
    """Union of two messages with unique indices, equal indices summed.

    Canonical: the same pairs in the same order whichever message is ``a``
    (sorted by index; of two equal indices the first slot holds the sum, the
    second becomes padding), so both partners of a round compute the same.
    """
    idx = jnp.concatenate([idx_a, idx_b])
    val = jnp.concatenate([val_a, val_b])
    return sum_adjacent_duplicates(*lax.sort((idx, val), num_keys=1), size)


def sum_adjacent_duplicates(idx, val, size: int):
    """Sorted pairs with each index at most twice: the first of two equal
    indices holds their sum, the second becomes padding (``size``, 0)."""
    same = (idx[1:] == idx[:-1]) & (idx[:-1] < size)
    dup_next = jnp.concatenate([same, jnp.zeros((1,), bool)])
    dup_prev = jnp.concatenate([jnp.zeros((1,), bool), dup_next[:-1]])
    nxt = jnp.concatenate([val[1:], jnp.zeros((1,), val.dtype)])
    val = jnp.where(dup_next, val + nxt, jnp.where(dup_prev, 0, val))
    idx = jnp.where(dup_prev, size, idx)
    return idx, val


def top_and_rest(idx, val, keep: int, size: int):
    """The ``keep`` largest ``|val|`` pairs and the rest (padding ranked last)."""
    score = jnp.where(idx < size, jnp.abs(val).astype(jnp.float32), -1.0)
    _, order = lax.top_k(score, idx.shape[0])  # full ranking; ties: lower position first
    idx, val = idx[order], val[order]
    return idx[:keep], val[:keep], idx[keep:], val[keep:]


def to_owners(slot, indices, values, padding: int, per_peer: int, axis_name):
    """A padded ``all_to_all`` of (index, value) pairs: pair ``i`` goes to slot
    ``slot[i]`` of the ``(N, per_peer)`` send buffer (row ``j`` to device ``j``;
    out-of-range slots are dropped, empty ones hold ``padding`` and 0).
    Returns the ``(N, per_peer)`` indices and values received (row ``s`` from device ``s``)."""
    n_dev = axis_size(axis_name)
    send_idx = jnp.full((n_dev * per_peer,), padding, jnp.int32).at[slot].set(indices, mode="drop")
    send_val = jnp.zeros((n_dev * per_peer,), values.dtype).at[slot].set(values, mode="drop")
    return (
        lax.all_to_all(send_idx.reshape(n_dev, per_peer), axis_name, 0, 0, tiled=True),
        lax.all_to_all(send_val.reshape(n_dev, per_peer), axis_name, 0, 0, tiled=True),
    )
