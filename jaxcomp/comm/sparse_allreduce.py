"""Sparse all-reduces whose traffic does not grow like the all-gather's.

:func:`jaxcomp.comm.sparse_mean` all-gathers every device's fixed-capacity
(index, value) message: each device sends its message to the ``N - 1`` others,
``(N - 1) m`` bytes for a message of ``m`` bytes, which passes a dense ring
all-reduce's ``2 (N - 1) / N`` gradients at a few hundred devices. The
exchanges here keep the traffic near a constant number of messages:

==================  ====================================  ==========================
exchange            per-device bytes (``m`` = message)      result
==================  ====================================  ==========================
:func:`gtopk_mean`  ``log2(N) m`` (N a power of two)       global top-``cap`` of the sum
:func:`oktopk_mean` ``~(s + 1) (N-1)/N m`` + histogram      per-region top of the sum
:func:`cyclic_mean`  2 all-reduces of ``cap`` entries       exact sum on one device's support
:func:`sparcml_mean` ``sum_i min(2^i cap, U)`` pairs, or     exact sum (union)
                    a dense all-reduce past the threshold
:func:`scatter_mean` ``~s (N-1)/N m``                       this device's region of
                                                         the sum (FSDP)
==================  ====================================  ==========================

The first two *select* from the merged messages: what they leave out of the
result is returned as ``(indices, values)`` pairs to add back into exactly one
device's residual (the one that dropped it, or a group's leader for pairs
dropped by several devices at once), so nothing is lost globally:
``sum_d new_residual_d + N * update == sum_d (old_residual_d + g_d)``. The
sparsifiers do this with ``exchange="gtopk"`` / ``"oktopk"``.

:func:`exchange` also runs ``"gossip"``, which is no all-reduce: each device
gets the ring mix of its own and its two neighbours' messages
(:func:`jaxcomp.comm.collectives.gossip_sparse_mean`), for decentralized
training (:func:`jaxcomp.aggregation.make_gossip_train_step`).

Every function runs inside ``jax.shard_map`` over ``axis_name``, takes this
device's message (``indices`` int32 ``[cap]``, ``size`` marking padding,
``values`` ``[cap]``) and returns an :class:`Exchanged`. Bytes are counted
from the shapes the collectives move.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp import _vma
from jaxcomp.comm.collectives import (
    INDEX_ITEMSIZE,
    all_gather_invariant,
    allgather_bytes,
    allreduce_bytes,
    array_nbytes,
    axis_size,
    dense_mean,
    mean_first,
)

__all__ = [
    "EXACT_EXCHANGES",
    "EXCHANGES",
    "INCLUDE_EXCHANGES",
    "OKTOPK_SLACK",
    "POWER_OF_TWO_EXCHANGES",
    "Exchanged",
    "check_device_count",
    "check_include",
    "choose_exchange",
    "cyclic_mean",
    "exchange",
    "gossip_sends_pairs",
    "gtopk_mean",
    "gtopk_mean_segments",
    "gtopk_rounds",
    "is_power_of_two",
    "oktopk_capacities",
    "oktopk_mean",
    "oktopk_mean_segments",
    "oktopk_wire_bytes",
    "scatter_capacity",
    "scatter_mean",
    "scatter_mean_segments",
    "sparcml_mean",
    "sparcml_union_capacity",
]

# Ok-Topk: each device sends up to ``slack * cap / N`` pairs to each region
# owner (padded all_to_all); overflow stays in the sender's residual.
OKTOPK_SLACK = 1.5
# Histogram bins per device for balancing the regions.
_BINS_PER_DEVICE = 16


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
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: exchange("sparse", i, v, 4, "data"),
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


def _check_power_of_two(name: str, n_dev: int) -> None:
    if not is_power_of_two(n_dev):
        raise ValueError(
            f"exchange={name!r} pairs devices by recursive doubling and needs a power-of-two "
            f"number of devices along the axis, got {n_dev}; use exchange='oktopk' (any N) "
            "or 'sparse'"
        )


def check_device_count(exchange: str, n_dev: int) -> None:
    """Refuses a device count ``exchange`` cannot run on, before anything is traced.

    The check the exchange itself makes when it is traced inside ``shard_map``
    (:data:`POWER_OF_TWO_EXCHANGES` pair devices by recursive doubling), for
    a run that knows its device count up front: its message, earlier.

    Raises:
      ValueError: ``n_dev`` is not a device count ``exchange`` runs on.

    Example:
      >>> check_device_count("gtopk", 8)  # fine
      >>> check_device_count("sparse", 3)  # any count
      >>> try:
      ...     check_device_count("gtopk", 3)
      ... except ValueError as e:
      ...     print(str(e)[:60])
      exchange='gtopk' pairs devices by recursive doubling and nee
    """
    if exchange in POWER_OF_TWO_EXCHANGES:
        _check_power_of_two(exchange, n_dev)


def gtopk_rounds(n_dev: int) -> int:
    """Rounds of recursive doubling: ``log2 N``.

    Example:
      >>> gtopk_rounds(8)
      3
    """
    return int(math.log2(n_dev)) if n_dev > 1 else 0


def _scatter_mean(indices, values, size: int, n_dev: int):
    scaled = values / jnp.asarray(n_dev, values.dtype) if n_dev > 1 else values
    return jnp.zeros((size,), values.dtype).at[indices].add(scaled, mode="drop")


def _returned(values, n_dev: int, divisor: int):
    """Values an exchange gives back to a residual, in the message's units (float32 if rescaled)."""
    if divisor == n_dev:
        return values
    return values.astype(jnp.float32) * n_dev


def _merge_pairs(idx_a, val_a, idx_b, val_b, size: int):
    """Union of two messages with unique indices, equal indices summed.

    Canonical: the same pairs in the same order whichever message is ``a``
    (sorted by index; of two equal indices the first slot holds the sum, the
    second becomes padding), so both partners of a round compute the same.
    """
    idx = jnp.concatenate([idx_a, idx_b])
    val = jnp.concatenate([val_a, val_b])
    return _sum_adjacent_duplicates(*lax.sort((idx, val), num_keys=1), size)


def _sum_adjacent_duplicates(idx, val, size: int):
    """Sorted pairs with each index at most twice: the first of two equal
    indices holds their sum, the second becomes padding (``size``, 0)."""
    same = (idx[1:] == idx[:-1]) & (idx[:-1] < size)
    dup_next = jnp.concatenate([same, jnp.zeros((1,), bool)])
    dup_prev = jnp.concatenate([jnp.zeros((1,), bool), dup_next[:-1]])
    nxt = jnp.concatenate([val[1:], jnp.zeros((1,), val.dtype)])
    val = jnp.where(dup_next, val + nxt, jnp.where(dup_prev, 0, val))
    idx = jnp.where(dup_prev, size, idx)
    return idx, val


def _top_and_rest(idx, val, keep: int, size: int):
    """The ``keep`` largest ``|val|`` pairs and the rest (padding ranked last)."""
    score = jnp.where(idx < size, jnp.abs(val).astype(jnp.float32), -1.0)
    _, order = lax.top_k(score, idx.shape[0])  # full ranking; ties: lower position first
    idx, val = idx[order], val[order]
    return idx[:keep], val[:keep], idx[keep:], val[keep:]


def gtopk_mean(indices, values, size: int, axis_name) -> Exchanged:
    """gTop-k (Shi et al. 2019): recursive doubling that keeps the top ``cap`` per round.

    At round ``i`` device ``d`` swaps its message with ``d XOR 2^i``
    (``ppermute``), merges the two (equal indices summed) and keeps the
    ``cap`` largest ``|value|`` pairs. After ``log2 N`` rounds every device
    holds the same ``cap`` pairs: the top of the (partially merged) global
    sum; the update is their mean over ``N``. The pairs a round drops are
    identical for the ``2^(i+1)`` devices of a merging group; they are
    returned to exactly one of them (the group's lowest index) for its
    residual.

    Returns:
      :class:`Exchanged`: ``wire_bytes = log2(N) * cap * (4 + itemsize)``;
      ``returned_*`` hold ``log2(N) * cap`` pairs.

    Raises:
      ValueError: ``N`` not a power of two.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: gtopk_mean(i, v, 5, "data").update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, -4.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    _check_power_of_two("gtopk", n_dev)
    cap = indices.shape[0]
    me = lax.axis_index(axis_name)
    wire = gtopk_rounds(n_dev) * (array_nbytes(indices) + array_nbytes(values))
    values, divisor = mean_first(values, n_dev)
    idx, val = indices, jnp.where(indices < size, values, 0)
    back_idx, back_val = [], []
    for i in range(gtopk_rounds(n_dev)):
        perm = [(d, d ^ (1 << i)) for d in range(n_dev)]
        p_idx = lax.ppermute(idx, axis_name, perm)
        p_val = lax.ppermute(val, axis_name, perm)
        m_idx, m_val = _merge_pairs(idx, val, p_idx, p_val, size)
        idx, val, d_idx, d_val = _top_and_rest(m_idx, m_val, cap, size)
        leader = (me & ((2 << i) - 1)) == 0
        back_idx.append(jnp.where(leader, d_idx, size))
        back_val.append(jnp.where(leader, d_val, 0))
    update = _vma.device_identical(_scatter_mean(idx, val, size, divisor), axis_name)
    if not back_idx:
        return Exchanged(update, jnp.float32(wire))
    back = _returned(jnp.concatenate(back_val), n_dev, divisor)
    return Exchanged(update, jnp.float32(wire), jnp.concatenate(back_idx), back)


def oktopk_capacities(cap: int, n_dev: int, slack: float = OKTOPK_SLACK) -> tuple[int, int]:
    """``(per_peer, per_region)``: pairs sent to each region owner, pairs each owner keeps.

    Example:
      >>> oktopk_capacities(100, 4)  # ceil(1.5 * 100 / 4), ceil(100 / 4)
      (38, 25)
    """
    per_peer = max(1, math.ceil(slack * cap / n_dev))
    per_region = max(1, math.ceil(cap / n_dev))
    return per_peer, per_region


def oktopk_wire_bytes(cap: int, n_dev: int, itemsize: int, slack: float = OKTOPK_SLACK) -> float:
    """Bytes one device sends in :func:`oktopk_mean` of a ``cap``-pair message.

    ``(N - 1) (per_peer + per_region)`` pairs (:func:`oktopk_capacities`)
    and the all-reduce of the region histogram; 0 on one device.

    Example:
      >>> oktopk_wire_bytes(100, 4, 4)  # 3 * (38 + 25) * 8 + 1.5 * 64 * 4
      1896.0
    """
    if n_dev <= 1:
        return 0.0
    per_peer, per_region = oktopk_capacities(cap, n_dev, slack)
    hist = allreduce_bytes(4 * _BINS_PER_DEVICE * n_dev, n_dev)
    return (n_dev - 1) * (per_peer + per_region) * (INDEX_ITEMSIZE + itemsize) + hist


def gtopk_mean_segments(indices, values, size: int, axis_name, slots) -> Exchanged:
    """:func:`gtopk_mean` for many segments at once, each keeping its own top.

    Segment ``s`` of a packed buffer owns ``slots[s]`` consecutive message
    slots (static) and its own index range; each round swaps the whole
    message with the partner (one ``ppermute`` of indices and one of values
    for all segments), merges each segment's pairs with the partner's (equal
    indices summed) and keeps each segment's ``slots[s]`` largest ``|value|``
    pairs: what :func:`gtopk_mean` gives each segment alone, pair for pair
    (the same merge and ranking, by sorts keyed on the segment first).

    Returns:
      :class:`Exchanged` over the whole buffer (``size`` = padding index);
      ``wire_bytes`` is the total.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: gtopk_mean_segments(i, v, 6, "data", (1, 2)).update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3, 6], jnp.int32), jnp.array([2.0, -4.0, 0.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    _check_power_of_two("gtopk", n_dev)
    slots = np.asarray(slots, np.int64)
    total = int(slots.sum())
    me = lax.axis_index(axis_name)
    wire = gtopk_rounds(n_dev) * (array_nbytes(indices) + array_nbytes(values))
    values, divisor = mean_first(values, n_dev)
    idx, val = indices, jnp.where(indices < size, values, 0)
    # The merged message: each segment's own slots, then its partner's.
    spans = list(zip(np.cumsum(slots) - slots, slots, strict=True))  # (first slot, count)
    gather = np.concatenate(
        [np.r_[np.arange(o, o + c), total + np.arange(o, o + c)] for o, c in spans]
    ).astype(np.int32)
    segment = jnp.asarray(np.repeat(np.arange(len(slots)), 2 * slots).astype(np.int32))
    kept = np.concatenate([2 * o + np.arange(c) for o, c in spans]).astype(np.int32)
    dropped = np.concatenate([2 * o + c + np.arange(c) for o, c in spans]).astype(np.int32)
    position = jnp.arange(2 * total, dtype=jnp.int32)
    back_idx, back_val = [], []
    for i in range(gtopk_rounds(n_dev)):
        perm = [(d, d ^ (1 << i)) for d in range(n_dev)]
        p_idx = lax.ppermute(idx, axis_name, perm)
        p_val = lax.ppermute(val, axis_name, perm)
        m_idx = jnp.concatenate([idx, p_idx])[gather]
        m_val = jnp.concatenate([val, p_val])[gather]
        # _merge_pairs per segment: sorted by index within it, duplicates summed
        # (segments' index ranges are disjoint, so no pair spans two).
        _, m_idx, m_val = lax.sort((segment, m_idx, m_val), num_keys=2)
        m_idx, m_val = _sum_adjacent_duplicates(m_idx, m_val, size)
        # _top_and_rest per segment: by |value| down, ties to the lower position.
        score = jnp.where(m_idx < size, jnp.abs(m_val).astype(jnp.float32), -1.0)
        *_, r_idx, r_val = lax.sort((segment, -score, position, m_idx, m_val), num_keys=3)
        idx, val = r_idx[kept], r_val[kept]
        leader = (me & ((2 << i) - 1)) == 0
        back_idx.append(jnp.where(leader, r_idx[dropped], size))
        back_val.append(jnp.where(leader, r_val[dropped], 0))
    update = _vma.device_identical(_scatter_mean(idx, val, size, divisor), axis_name)
    if not back_idx:
        return Exchanged(update, jnp.float32(wire))
    back = _returned(jnp.concatenate(back_val), n_dev, divisor)
    return Exchanged(update, jnp.float32(wire), jnp.concatenate(back_idx), back)


def _to_owners(slot, indices, values, padding: int, per_peer: int, axis_name):
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


def _region_bounds(indices, size: int, n_dev: int, axis_name):
    """Region starts balancing the devices' selected indices (a psum-ed histogram)."""
    bins = _BINS_PER_DEVICE * n_dev
    width = -(-size // bins)
    which = jnp.where(indices < size, indices // width, bins)
    hist = jnp.zeros((bins,), jnp.int32).at[which].add(1, mode="drop")
    hist = lax.psum(hist, axis_name)
    cdf = jnp.cumsum(hist)
    total = jnp.maximum(cdf[-1], 1)
    # Region j starts at the first bin where the cumulative share passes j / N.
    targets = (jnp.arange(1, n_dev) * total + n_dev - 1) // n_dev
    first_bins = jnp.searchsorted(cdf, targets, side="left") + 1
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), (first_bins * width).astype(jnp.int32)])
    return jnp.minimum(starts, size)


def oktopk_mean(indices, values, size: int, axis_name, *, slack: float = OKTOPK_SLACK) -> Exchanged:
    """A balanced sparse reduce-scatter, then an all-gather of the selection (Ok-Topk).

    The index range is split into ``N`` regions balanced by a histogram of
    every device's selected indices (one small all-reduce per step: the
    regions follow the distribution each step, where Ok-Topk re-balances
    periodically from stored statistics). Each device sends its pairs in
    region ``j`` to device ``j`` over a padded ``all_to_all`` (at most
    ``ceil(slack * cap / N)`` per peer: ``ragged_all_to_all`` does not run on
    XLA:CPU; overflow is returned to the sender's residual); device ``j``
    sums the pairs it receives and keeps the ``ceil(cap / N)`` largest (the
    rest returned to its own residual); the selections are all-gathered and
    averaged.

    Returns:
      :class:`Exchanged`: ``wire_bytes`` = all_to_all ``(N - 1) * per_peer``
      pairs + all-gather ``(N - 1) * per_region`` pairs + the histogram's
      all-reduce; about ``(slack + 1) (N - 1) / N`` messages.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: oktopk_mean(i, v, 5, "data").update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, -4.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    slack = V.check_real("slack", slack, 0, low_open=True)
    cap = indices.shape[0]
    per_peer, per_region = oktopk_capacities(cap, n_dev, slack)
    wire = oktopk_wire_bytes(cap, n_dev, jnp.dtype(values.dtype).itemsize, slack)
    if n_dev == 1:
        return Exchanged(_scatter_mean(indices, values, size, 1), jnp.float32(0))
    starts = _region_bounds(indices, size, n_dev, axis_name)
    values, divisor = mean_first(values, n_dev)
    idx, val = lax.sort((indices, values), num_keys=1)  # padding (size) last
    region = jnp.searchsorted(starts, idx, side="right") - 1
    first = jnp.searchsorted(idx, starts, side="left")  # each region's first slot
    rank = jnp.arange(cap) - first[jnp.clip(region, 0, n_dev - 1)]
    valid = idx < size
    fits = valid & (rank < per_peer)
    slot = jnp.where(fits, region * per_peer + rank, n_dev * per_peer)
    recv_idx, recv_val = _to_owners(slot, idx, val, size, per_peer, axis_name)
    # Sum equal indices (up to N copies) in index order, then keep the largest.
    r_idx, r_val = lax.sort((recv_idx.reshape(-1), recv_val.reshape(-1)), num_keys=1)
    first_of = jnp.concatenate([jnp.ones((1,), bool), r_idx[1:] != r_idx[:-1]])
    seg = jnp.cumsum(first_of) - 1
    sums = jax.ops.segment_sum(r_val, seg, num_segments=r_idx.shape[0])
    u_idx = jnp.full(r_idx.shape, size, jnp.int32).at[seg].set(r_idx)
    u_idx = jnp.where(jnp.arange(r_idx.shape[0]) <= seg[-1], u_idx, size)
    keep_idx, keep_val, drop_idx, drop_val = _top_and_rest(u_idx, sums, per_region, size)
    all_idx = all_gather_invariant(keep_idx, axis_name).reshape(-1)
    all_val = all_gather_invariant(keep_val, axis_name).reshape(-1)
    update = _scatter_mean(all_idx, all_val, size, divisor)
    overflow_idx = jnp.where(valid & ~fits, idx, size)
    overflow_val = jnp.where(valid & ~fits, val, 0)
    return Exchanged(
        update,
        jnp.float32(wire),
        jnp.concatenate([overflow_idx, drop_idx]),
        _returned(jnp.concatenate([overflow_val, drop_val]), n_dev, divisor),
    )


def oktopk_mean_segments(
    indices, values, size: int, axis_name, slots, offsets, sizes, *, slack: float = OKTOPK_SLACK
) -> Exchanged:
    """:func:`oktopk_mean` for many segments at once, each with its own regions and top.

    Segment ``s`` owns ``slots[s]`` consecutive message slots (static; 0
    leaves it out) and the index range ``[offsets[s], offsets[s] + sizes[s])``
    of a packed buffer (``size`` = padding index). Each segment gets what
    :func:`oktopk_mean` gives it alone, pair for pair: its regions balanced by
    its own histogram, its own ``per_peer`` and ``per_region`` capacities
    (:func:`oktopk_capacities` of ``slots[s]``), the same sums and ranking
    (sorts keyed by the segment first), the same returned pairs. For all
    segments together: one all-reduce of the histograms, one ``all_to_all``
    of indices and one of values (each peer's row holds every segment's
    slots for it), one all-gather of each.

    Returns:
      :class:`Exchanged` over the whole buffer; ``wire_bytes`` is the total
      (each segment's :func:`oktopk_mean` formula, summed); the returned
      pairs are every segment's overflow, then every segment's dropped pairs
      (packed indices).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: oktopk_mean_segments(i, v, 6, "data", (1, 2), (0, 3), (3, 3)).update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3, 6], jnp.int32), jnp.array([2.0, -4.0, 0.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    slack = V.check_real("slack", slack, 0, low_open=True)
    if n_dev == 1:
        return Exchanged(_scatter_mean(indices, values, size, 1), jnp.float32(0))
    slots = np.asarray(slots, np.int64)
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    n_seg = len(slots)
    caps = [oktopk_capacities(int(c), n_dev, slack) if c else (0, 0) for c in slots]
    per_peer, per_region = (np.asarray(c, np.int64) for c in zip(*caps, strict=True))
    total, width_p = int(slots.sum()), int(per_peer.sum())
    item = jnp.dtype(values.dtype).itemsize
    bins = _BINS_PER_DEVICE * n_dev
    wire = sum(oktopk_wire_bytes(int(c), n_dev, item, slack) for c in slots if c)

    def static(a):  # a per-segment table read per slot
        return jnp.asarray(np.asarray(a)[np.repeat(np.arange(n_seg), slots)].astype(np.int32))

    seg = static(np.arange(n_seg))
    # Each segment's local indices (its own padding index: its size), as alone.
    valid = indices < size
    local = jnp.where(valid, indices - static(offsets), static(sizes))
    # _region_bounds per segment: one all-reduce of every segment's histogram.
    width = -(-sizes // bins)
    which = jnp.where(valid, local // static(width), bins)
    hist = jnp.zeros((n_seg, bins), jnp.int32).at[seg, which].add(1, mode="drop")
    cdf = jnp.cumsum(lax.psum(hist, axis_name), axis=1)
    count = jnp.maximum(cdf[:, -1], 1)
    targets = (jnp.arange(1, n_dev)[None, :] * count[:, None] + n_dev - 1) // n_dev
    first_bins = jnp.sum(cdf[:, None, :] < targets[:, :, None], axis=2, dtype=jnp.int32) + 1
    starts = jnp.concatenate(
        [jnp.zeros((n_seg, 1), jnp.int32), first_bins * jnp.asarray(width[:, None], jnp.int32)], 1
    )
    starts = jnp.minimum(starts, jnp.asarray(sizes[:, None], jnp.int32))
    # Each segment's pairs by index (its slots stay its own), split by region.
    values, divisor = mean_first(values, n_dev)
    _, local, idx, val = lax.sort((seg, local, indices, values), num_keys=2)
    valid = idx < size
    seg_starts = starts[seg]
    region = jnp.sum(seg_starts <= local[:, None], axis=1) - 1
    first = jax.ops.segment_sum(
        (local[:, None] < seg_starts).astype(jnp.int32), seg, n_seg, indices_are_sorted=True
    )
    position = jnp.arange(total) - static(np.cumsum(slots) - slots)
    rank = position - first[seg, jnp.clip(region, 0, n_dev - 1)]
    fits = valid & (rank < static(per_peer))
    # Peer row j: every segment's slots for device j, segment by segment.
    column = region * width_p + static(np.cumsum(per_peer) - per_peer) + rank
    slot = jnp.where(fits, column, n_dev * width_p)
    recv_idx, recv_val = _to_owners(slot, idx, val, size, width_p, axis_name)
    # Per segment: equal indices summed in index (then device) order, the largest kept.
    block = np.repeat(np.arange(n_seg), n_dev * per_peer).astype(np.int32)  # after the sort
    block_start = n_dev * (np.cumsum(per_peer) - per_peer)
    recv_seg = jnp.asarray(np.tile(np.repeat(np.arange(n_seg), per_peer), n_dev).astype(np.int32))
    _, r_idx, r_val = lax.sort((recv_seg, recv_idx.reshape(-1), recv_val.reshape(-1)), num_keys=2)
    starts_block = np.zeros(n_dev * width_p, bool)
    starts_block[block_start[per_peer > 0]] = True
    first_of = jnp.concatenate([jnp.ones((1,), bool), r_idx[1:] != r_idx[:-1]]) | starts_block
    run = jnp.cumsum(first_of) - 1
    run = run - run[jnp.asarray(block_start[block])]  # each block's runs from 0
    at = jnp.asarray(block_start[block].astype(np.int32)) + run
    sums = jax.ops.segment_sum(r_val, at, num_segments=n_dev * width_p)
    u_idx = jnp.full((n_dev * width_p,), size, jnp.int32).at[at].set(r_idx)
    last = jax.ops.segment_max(run, jnp.asarray(block), n_seg, indices_are_sorted=True)
    in_block = jnp.arange(n_dev * width_p) - jnp.asarray(block_start[block])
    u_idx = jnp.where(in_block <= last[jnp.asarray(block)], u_idx, size)
    # _top_and_rest per segment: by |value| down, ties to the lower position.
    score = jnp.where(u_idx < size, jnp.abs(sums).astype(jnp.float32), -1.0)
    order = jnp.arange(n_dev * width_p, dtype=jnp.int32)
    *_, t_idx, t_val = lax.sort((jnp.asarray(block), -score, order, u_idx, sums), num_keys=3)
    kept = np.concatenate([o + np.arange(r) for o, r in zip(block_start, per_region, strict=True)])
    spans = zip(block_start, per_region, n_dev * per_peer, strict=True)
    dropped = np.concatenate([o + np.arange(r, n) for o, r, n in spans])
    all_idx = all_gather_invariant(t_idx[kept.astype(np.int32)], axis_name).reshape(-1)
    all_val = all_gather_invariant(t_val[kept.astype(np.int32)], axis_name).reshape(-1)
    update = _scatter_mean(all_idx, all_val, size, divisor)
    overflow = valid & ~fits
    drop = dropped.astype(np.int32)
    return Exchanged(
        update,
        jnp.float32(wire),
        jnp.concatenate([jnp.where(overflow, idx, size), t_idx[drop]]),
        _returned(jnp.concatenate([jnp.where(overflow, val, 0), t_val[drop]]), n_dev, divisor),
    )


def scatter_capacity(cap: int, n_dev: int, slack: float = OKTOPK_SLACK) -> int:
    """Pairs each device sends to each region owner in :func:`scatter_mean`.

    Example:
      >>> scatter_capacity(100, 4)  # ceil(1.5 * 100 / 4)
      38
    """
    return max(1, math.ceil(slack * cap / n_dev))


def scatter_mean(
    indices, values, size: int, axis_name, *, slack: float = OKTOPK_SLACK
) -> Exchanged:
    """A sparse reduce-scatter: device ``j`` gets the mean of every message's region ``j``.

    For FSDP (:func:`jaxcomp.distributed.sharded_optimizer`): the index range
    is split into ``N`` equal contiguous regions (``size`` divisible by ``N``;
    a parameter split over the data axis along its first dimension owns
    exactly its region of the flat gradient). Each device sends its pairs in
    region ``j`` to device ``j`` over a padded ``all_to_all`` (at most
    ``ceil(slack * cap / N)`` per peer; overflow is returned to the sender's
    residual), and device ``j`` sums what it receives into its region.
    Nothing else travels: no device needs the other regions.

    Returns:
      :class:`Exchanged` whose ``update`` is this device's region only
      (``[size // N]``, different on every device), ``wire_bytes`` =
      ``(N - 1) * per_peer`` pairs (about ``slack`` messages, whatever ``N``),
      and the overflow as returned pairs.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm.sparse_allreduce import scatter_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda i, v: scatter_mean(i, v, 4, "data").update, mesh=mesh,
      ...     in_specs=(P(), P()), out_specs=P("data"))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, -1.0])).tolist()
      [0.0, 2.0, 0.0, -1.0]
    """
    n_dev = axis_size(axis_name)
    slack = V.check_real("slack", slack, 0, low_open=True)
    if size % n_dev:
        raise ValueError(
            f"exchange='scatter' splits a leaf's {size} elements into {n_dev} equal regions "
            "(one per device); the size must be divisible by the number of devices"
        )
    if n_dev == 1:
        return Exchanged(_scatter_mean(indices, values, size, 1), jnp.float32(0))
    cap = indices.shape[0]
    region = size // n_dev
    per_peer = scatter_capacity(cap, n_dev, slack)
    idx, val = lax.sort((indices, values), num_keys=1)  # padding (size) last
    valid = idx < size
    owner = jnp.where(valid, idx // region, n_dev)
    first = jnp.searchsorted(idx, jnp.arange(n_dev, dtype=idx.dtype) * region, side="left")
    rank = jnp.arange(cap) - first[jnp.clip(owner, 0, n_dev - 1)]
    fits = valid & (rank < per_peer)
    slot = jnp.where(fits, owner * per_peer + rank, n_dev * per_peer)
    # Offsets within the owner's region; `region` marks padding.
    offset = jnp.where(fits, idx - owner * region, region).astype(jnp.int32)
    recv_idx, recv_val = _to_owners(slot, offset, val, region, per_peer, axis_name)
    update = _scatter_mean(recv_idx.reshape(-1), recv_val.reshape(-1), region, n_dev)
    pair = INDEX_ITEMSIZE + jnp.dtype(values.dtype).itemsize
    return Exchanged(
        update,
        jnp.float32((n_dev - 1) * per_peer * pair),
        jnp.where(valid & ~fits, idx, size),
        jnp.where(valid & ~fits, val, 0),
    )


def scatter_mean_segments(
    indices, values, size: int, axis_name, slots, offsets, sizes, *, slack: float = OKTOPK_SLACK
) -> Exchanged:
    """:func:`scatter_mean` for many segments at once: this device's region of each.

    Segment ``s`` owns ``slots[s]`` consecutive message slots (static; 0
    leaves it out) and the index range ``[offsets[s], offsets[s] + sizes[s])``
    of a packed buffer (``size`` = padding index); its region ``j`` (of ``N``
    equal ones, ``sizes[s]`` divisible by ``N``) goes to device ``j``, with
    :func:`scatter_capacity` of ``slots[s]`` pairs per peer, as
    :func:`scatter_mean` sends it alone (overflow returned to the sender). One
    ``all_to_all`` of offsets and one of values for all segments.

    Returns:
      :class:`Exchanged` whose ``update`` holds this device's region of each
      segment with slots, segment by segment (``sum(sizes[s] // N)``
      elements), each what :func:`scatter_mean` gives it alone, bit for bit;
      ``wire_bytes`` the total; the overflow as returned pairs (packed indices).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda i, v: scatter_mean_segments(i, v, 8, "data", (1, 1), (0, 4), (3, 2)).update,
      ...     mesh=mesh, in_specs=P(), out_specs=P("data"))
      >>> f(jnp.array([1, 5], jnp.int32), jnp.array([2.0, -1.0])).tolist()
      [0.0, 2.0, 0.0, 0.0, -1.0]
    """
    n_dev = axis_size(axis_name)
    slack = V.check_real("slack", slack, 0, low_open=True)
    slots = np.asarray(slots, np.int64)
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    member = slots > 0
    if np.any(sizes[member] % n_dev):
        raise ValueError(
            f"exchange='scatter' splits a leaf's elements into {n_dev} equal regions (one per "
            f"device); the sizes must be divisible by the number of devices, got "
            f"{sizes[member].tolist()}"
        )
    n_seg = len(slots)
    region = np.where(member, sizes // n_dev, 0)
    out_size = int(region.sum())
    per_peer = np.asarray([scatter_capacity(int(c), n_dev, slack) if c else 0 for c in slots])
    width_p = int(per_peer.sum())

    def static(a):  # a per-segment table read per slot
        return jnp.asarray(np.asarray(a)[np.repeat(np.arange(n_seg), slots)].astype(np.int32))

    seg = static(np.arange(n_seg))
    valid = indices < size
    local = jnp.where(valid, indices - static(offsets), static(sizes))
    # Where a segment's region of this device's output starts.
    shard_start = static(np.cumsum(region) - region)
    if n_dev == 1:  # the region is the whole segment
        at = jnp.where(valid, local + shard_start, out_size)
        return Exchanged(_scatter_mean(at, values, out_size, 1), jnp.float32(0))
    _, local, idx, val = lax.sort((seg, local, indices, values), num_keys=2)
    valid = idx < size
    owner = jnp.where(valid, local // jnp.maximum(static(region), 1), n_dev)
    bounds = jnp.arange(n_dev, dtype=jnp.int32)[None, :] * static(region)[:, None]
    first = jax.ops.segment_sum(
        (local[:, None] < bounds).astype(jnp.int32), seg, n_seg, indices_are_sorted=True
    )
    position = jnp.arange(idx.shape[0]) - static(np.cumsum(slots) - slots)
    rank = position - first[seg, jnp.clip(owner, 0, n_dev - 1)]
    fits = valid & (rank < static(per_peer))
    # Peer row j: every segment's slots for device j, segment by segment.
    column = owner * width_p + static(np.cumsum(per_peer) - per_peer) + rank
    slot = jnp.where(fits, column, n_dev * width_p)
    # Offsets in the owner's output (its regions, segment by segment); out_size: padding.
    offset = jnp.where(fits, local - owner * static(region) + shard_start, out_size)
    recv_idx, recv_val = _to_owners(slot, offset, val, out_size, width_p, axis_name)
    update = _scatter_mean(recv_idx.reshape(-1), recv_val.reshape(-1), out_size, n_dev)
    pair = INDEX_ITEMSIZE + jnp.dtype(values.dtype).itemsize
    return Exchanged(
        update,
        jnp.float32((n_dev - 1) * width_p * pair),
        jnp.where(valid & ~fits, idx, size),
        jnp.where(valid & ~fits, val, 0),
    )


def cyclic_mean(indices, values_at, size: int, axis_name, step) -> tuple[Exchanged, jax.Array]:
    """ScaleCom's cyclic leader: one device's indices, then a plain all-reduce of their values.

    At step ``t`` device ``t mod N`` leads: its indices are broadcast (an
    all-reduce of the leader's indices, zeros elsewhere), every device
    gathers *its own* accumulated values there (``values_at(indices)``) and
    the ``cap`` values are all-reduced. Exact mean on the leader's support;
    each device's residual keeps everything else. Traffic independent of
    ``N``: two all-reduces of ``cap`` entries.

    Args:
      indices: this device's selected indices (only the leader's are used).
      values_at: ``values_at(leader_indices) -> values`` of this device at
        those indices (``size`` = padding gives 0).
      size: length of the dense result.
      axis_name: mesh axis.
      step: the step counter (traced int).

    Returns:
      ``(Exchanged, leader_indices)``: what every device sent is its values
      at ``leader_indices``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> acc = jnp.array([0.0, 2.0, 0.5, -4.0, 0.0, 0.0])  # last entry: index 5 = padding
      >>> def step(i):
      ...     out, leader = cyclic_mean(i, lambda j: acc[j], 5, "data", jnp.int32(0))
      ...     return out.update
      >>> f = jax.jit(jax.shard_map(
      ...     step, mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3], jnp.int32)).tolist()  # the leader's support only
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    me = lax.axis_index(axis_name)
    leader = jnp.asarray(step, jnp.int32) % n_dev
    # Broadcast as a sum: every other device contributes zeros (size is never 0 here).
    shared = lax.psum(jnp.where(me == leader, indices, 0), axis_name)
    shared = jnp.where(shared >= size, size, shared)
    vals = values_at(shared)
    added, divisor = mean_first(vals, n_dev)
    update = _scatter_mean(shared, lax.psum(added, axis_name), size, divisor)
    wire = allreduce_bytes(array_nbytes(indices), n_dev) + allreduce_bytes(
        array_nbytes(vals), n_dev
    )
    return Exchanged(update, jnp.float32(wire)), shared


def sparcml_union_capacity(cap: int, size: int, n_dev: int, itemsize: int) -> int:
    """``U``: the largest total count (sum over devices) kept sparse by :func:`sparcml_mean`.

    The break-even of the sparse path: the largest ``U`` whose recursive-doubling
    bytes ``sum_i min(2^i cap, U) (4 + itemsize)`` stay below a dense ring
    all-reduce's ``2 (N - 1) / N * size * itemsize``; at most ``N cap`` (every
    message full).

    Example:
      >>> # Largest U with 2 rounds of min(2^i 100, U) pairs of 8 bytes < 1.5 * 200 * 4 bytes.
      >>> sparcml_union_capacity(100, 200, 4, 4)
      74
    """
    dense = allreduce_bytes(size * itemsize, n_dev)

    def cost(u):
        return sum(min(cap << i, u) for i in range(gtopk_rounds(n_dev))) * (4 + itemsize)

    lo, hi = 0, n_dev * cap
    if cost(hi) < dense:
        return hi
    while lo < hi:  # the largest u with cost(u) < dense
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if cost(mid) < dense else (lo, mid - 1)
    return lo


def sparcml_mean(indices, values, size: int, axis_name, *, dense=None) -> Exchanged:
    """SparCML: sparse recursive doubling of the union, or dense past a density threshold.

    A tiny all-reduce of the message counts decides, identically on every
    device: if the total count is at most :func:`sparcml_union_capacity`
    ``U``, messages are merged by recursive doubling without dropping
    anything (the union, equal indices summed; round ``i`` carries
    ``min(2^i cap, U)`` pairs, enough since the union never exceeds the total
    count); otherwise the messages are scattered into dense tensors and
    all-reduced. Both branches have static shapes; the result is the exact
    mean either way.

    Returns:
      :class:`Exchanged`; ``wire_bytes`` of the branch taken, plus the count's
      4-byte all-reduce.

    Raises:
      ValueError: ``N`` not a power of two.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: sparcml_mean(i, v, 5, "data").update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, -4.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    _check_power_of_two("sparcml", n_dev)
    cap = indices.shape[0]
    item = jnp.dtype(values.dtype).itemsize
    union = sparcml_union_capacity(cap, size, n_dev, item)
    count = jnp.sum(indices < size, dtype=jnp.int32)
    total = lax.psum(count, axis_name)
    count_bytes = allreduce_bytes(4, n_dev)
    added, divisor = mean_first(values, n_dev)

    def sparse(_):
        idx, val = indices, added
        sent = 0
        for i in range(gtopk_rounds(n_dev)):
            perm = [(d, d ^ (1 << i)) for d in range(n_dev)]
            p_idx = lax.ppermute(idx, axis_name, perm)
            p_val = lax.ppermute(val, axis_name, perm)
            sent += idx.shape[0] * (4 + item)
            m_idx, m_val = _merge_pairs(idx, val, p_idx, p_val, size)
            # Canonical order puts padding last; the union fits in min(2 c, U).
            keep = min(m_idx.shape[0], union)
            order = jnp.argsort(m_idx, stable=True)[:keep]
            idx, val = m_idx[order], m_val[order]
        update = _vma.device_identical(_scatter_mean(idx, val, size, divisor), axis_name)
        return update, jnp.float32(sent)

    def dense_path(_):
        d = (
            dense
            if dense is not None
            else jnp.zeros((size,), values.dtype).at[indices].add(values, mode="drop")
        )
        return dense_mean(d, axis_name)

    if n_dev == 1:
        update, wire = sparse(None)
    else:
        # _vma.cond: the sparse branch's mean comes out of ppermutes (varying over
        # the axis), the dense one out of a pmean (invariant); under a shard_map
        # with check_vma=True lax.cond rejects the mismatch.
        update, wire = _vma.cond(total <= union, sparse, dense_path, None)
    return Exchanged(update, wire + jnp.float32(count_bytes))


# ---------------------------------------------------------------------------
# One entry point for the sparsifiers.
# ---------------------------------------------------------------------------

# Values of the sparsifiers' ``exchange`` argument.
EXCHANGES = (
    "auto",
    "auto_topk",
    "sparse",
    "dense",
    "server",
    "sparcml",
    "gtopk",
    "oktopk",
    "scalecom",
    "gossip",
    "scatter",
)
# Exchanges that pair devices by recursive doubling: a power-of-two device count.
POWER_OF_TWO_EXCHANGES = ("gtopk", "sparcml")
# Exchanges whose result is the exact mean of the messages.
EXACT_EXCHANGES = ("sparse", "dense", "server", "sparcml")
# Exchanges that take ``include=`` (backup workers): the mean over the included
# devices. The server and SparCML divide by N, so they reject it.
INCLUDE_EXCHANGES = ("sparse", "dense")


def check_include(name: str) -> None:
    """Raises ValueError unless exchange ``name`` takes ``include=`` (backup workers).

    Only :data:`INCLUDE_EXCHANGES` (and ``"auto"``, which picks one of them)
    average over the included devices; the others divide by every device or
    mix neighbours.

    Example:
      >>> check_include("sparse")  # takes it
      >>> check_include("gtopk")
      Traceback (most recent call last):
          ...
      ValueError: exchange='gtopk' does not take include= (backup workers): ...
    """
    if name not in (*INCLUDE_EXCHANGES, "auto"):
        raise ValueError(
            f"exchange={name!r} does not take include= (backup workers): only "
            f"{INCLUDE_EXCHANGES} (and 'auto') average over the included devices"
        )


def choose_exchange(name: str, capacity: int, size: int, itemsize: int, n_dev: int) -> str:
    """The exchange ``"auto"`` / ``"auto_topk"`` stand for (static, from sizes and ``N``).

    ``"auto"`` keeps the exact mean: the sparse all-gather when it moves
    fewer bytes than a dense all-reduce at full capacity
    (:func:`jaxcomp.comm.prefer_sparse`), else dense. (SparCML is exact too
    but is never cheaper at full capacity; it pays only when the devices
    send well below capacity, which is known per step, not statically: ask
    for it by name.) ``"auto_topk"`` also considers the exchanges that apply
    a global top of the sum instead of the union (``gtopk``, ``oktopk``) and
    takes the fewest bytes per device (ties: the exact one). Other names are
    returned unchanged.

    Example:
      >>> from jaxcomp.comm.sparse_allreduce import choose_exchange
      >>> [choose_exchange("auto", 4195, 2**22, 4, n) for n in (8, 2048)]
      ['sparse', 'dense']
      >>> [choose_exchange("auto_topk", 4195, 2**22, 4, n) for n in (2, 8, 32)]
      ['sparse', 'oktopk', 'oktopk']
    """
    from jaxcomp.comm.collectives import prefer_sparse  # noqa: PLC0415 (same package)

    if name not in ("auto", "auto_topk"):
        return name
    if n_dev <= 1:
        return "dense"
    pair = 4 + itemsize
    costs = {"dense": allreduce_bytes(size * itemsize, n_dev)}
    if prefer_sparse(capacity, size, itemsize, n_dev):
        costs["sparse"] = allgather_bytes(capacity * pair, n_dev)
    if name == "auto_topk":
        if is_power_of_two(n_dev):
            costs["gtopk"] = gtopk_rounds(n_dev) * capacity * pair
        costs["oktopk"] = oktopk_wire_bytes(capacity, n_dev, itemsize)
    order = ["sparse", "dense", "gtopk", "oktopk"]  # ties: the exact one first
    return min(costs, key=lambda e: (costs[e], order.index(e)))


def gossip_sends_pairs(capacity: int, size: int, itemsize: int) -> bool:
    """Whether ``"gossip"`` sends a message as (index, value) pairs: when they
    are fewer bytes than the dense message (static).

    Example:
      >>> gossip_sends_pairs(100, 10_000, 4), gossip_sends_pairs(600, 1000, 4)
      (True, False)
    """
    return capacity * (INDEX_ITEMSIZE + itemsize) < size * itemsize


def exchange(
    name: str,
    indices,
    values,
    size: int,
    axis_name,
    *,
    dense=None,
    include=None,
) -> Exchanged:
    """Runs the named exchange (not ``"scalecom"``, which needs the accumulator).

    ``"gossip"`` is not an average: this device's update is the ring mix
    ``(S_{i-1} + S_i + S_{i+1}) / 3`` of its own and its two ring neighbours'
    messages (:func:`jaxcomp.comm.collectives.gossip_sparse_mean`, or
    :func:`jaxcomp.comm.gossip_mean` of the dense message when that is
    smaller), different on every device: for decentralized training
    (:func:`jaxcomp.aggregation.make_gossip_train_step`); two messages on the
    wire.

    Args:
      name: one of :data:`EXCHANGES` except ``"scalecom"``.
      indices, values, size, axis_name: the message (see the module docstring).
      dense: optional, this device's message scattered into ``[size]``.
      include: backup-worker flag (only :data:`INCLUDE_EXCHANGES` take it).

    Returns:
      :class:`Exchanged`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: exchange("sparcml", i, v, 5, "data").update,
      ...     mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, -4.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    from jaxcomp.comm import collectives  # noqa: PLC0415

    n_dev = axis_size(axis_name)
    # Checked on the name asked for: "auto_topk" may resolve to an exact
    # exchange at some sizes and not at others.
    if include is not None:
        check_include(name)
    name = choose_exchange(name, indices.shape[0], size, jnp.dtype(values.dtype).itemsize, n_dev)
    if name in ("sparse", "dense"):
        return Exchanged(
            *collectives.exchange_mean(
                indices, values, size, axis_name, exchange=name, dense=dense, include=include
            )
        )
    if name == "server":
        return Exchanged(*collectives.server_sparse_mean(indices, values, size, axis_name))
    if name == "sparcml":
        return sparcml_mean(indices, values, size, axis_name, dense=dense)
    if name == "gtopk":
        return gtopk_mean(indices, values, size, axis_name)
    if name == "oktopk":
        return oktopk_mean(indices, values, size, axis_name)
    if name == "scatter":
        return scatter_mean(indices, values, size, axis_name)
    if name == "gossip":
        # Send whichever form of the message is smaller (static).
        itemsize = jnp.dtype(values.dtype).itemsize
        if gossip_sends_pairs(indices.shape[0], size, itemsize):
            return Exchanged(
                *collectives.gossip_sparse_mean(indices, values, size, axis_name, dense=dense)
            )
        if dense is None:
            dense = jnp.zeros((size,), values.dtype).at[indices].add(values, mode="drop")
        return Exchanged(*collectives.gossip_mean(dense, axis_name))
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {name!r}")
