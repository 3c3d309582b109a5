"""gTop-k and Ok-Topk: sparse all-reduces that keep a top of the summed messages.

Both *select* from the merged messages, so that the result has a bounded
number of nonzeros and the traffic stays near a constant number of messages
(``m`` bytes each):

- :func:`gtopk_mean` (Shi et al. 2019): recursive doubling. At round ``i``
  device ``d`` swaps its message with ``d XOR 2^i``, merges the two (equal
  indices summed) and keeps the ``cap`` largest ``|value|`` pairs; after
  ``log2 N`` rounds every device holds the same ``cap`` pairs. ``log2(N) m``
  bytes per device; ``N`` must be a power of two.
- :func:`oktopk_mean` (Ok-Topk): a balanced sparse reduce-scatter (regions
  balanced by an all-reduced histogram of the selected indices; at most
  ``ceil(slack * cap / N)`` pairs to each owner), each owner keeps the
  ``ceil(cap / N)`` largest of its summed region, and the selections are
  all-gathered: about ``(slack + 1) (N - 1) / N`` messages plus the
  histogram.

What they leave out of the result is returned as ``(indices, values)`` pairs
to add back into exactly one device's residual (the one that dropped it, or a
group's leader for pairs dropped by several devices at once), so nothing is
lost globally: ``sum_d new_residual_d + N * update == sum_d (old_residual_d +
g_d)``. The ``*_segments`` forms run many segments of a packed buffer at once
(one collective for all), each segment getting what the one-segment form
gives it alone, pair for pair.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp import _vma
from jaxcomp.comm.collectives import (
    INDEX_ITEMSIZE,
    all_gather_invariant,
    allreduce_bytes,
    array_nbytes,
    axis_size,
    mean_first,
)
from jaxcomp.comm.sparse_pairs import (
    Exchanged,
    check_power_of_two,
    merge_pairs,
    returned_units,
    scatter_add_mean,
    sum_adjacent_duplicates,
    to_owners,
    top_and_rest,
)

__all__ = [
    "OKTOPK_SLACK",
    "gtopk_mean",
    "gtopk_mean_segments",
    "gtopk_rounds",
    "oktopk_capacities",
    "oktopk_mean",
    "oktopk_mean_segments",
    "oktopk_wire_bytes",
]

# Ok-Topk: each device sends up to ``slack * cap / N`` pairs to each region
# owner (padded all_to_all); overflow stays in the sender's residual.
OKTOPK_SLACK = 1.5
# Histogram bins per device for balancing the regions.
BINS_PER_DEVICE = 16


def gtopk_rounds(n_dev: int) -> int:
    """Rounds of recursive doubling: ``log2 N``.

    Example:
      >>> gtopk_rounds(8)
      3
    """
    return int(math.log2(n_dev)) if n_dev > 1 else 0


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
    check_power_of_two("gtopk", n_dev)
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
        m_idx, m_val = merge_pairs(idx, val, p_idx, p_val, size)
        idx, val, d_idx, d_val = top_and_rest(m_idx, m_val, cap, size)
        leader = (me & ((2 << i) - 1)) == 0
        back_idx.append(jnp.where(leader, d_idx, size))
        back_val.append(jnp.where(leader, d_val, 0))
    update = _vma.device_identical(scatter_add_mean(idx, val, size, divisor), axis_name)
    if not back_idx:
        return Exchanged(update, jnp.float32(wire))
    back = returned_units(jnp.concatenate(back_val), n_dev, divisor)
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
    hist = allreduce_bytes(4 * BINS_PER_DEVICE * n_dev, n_dev)
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
    check_power_of_two("gtopk", n_dev)
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
        # merge_pairs per segment: sorted by index within it, duplicates summed
        # (segments' index ranges are disjoint, so no pair spans two).
        _, m_idx, m_val = lax.sort((segment, m_idx, m_val), num_keys=2)
        m_idx, m_val = sum_adjacent_duplicates(m_idx, m_val, size)
        # top_and_rest per segment: by |value| down, ties to the lower position.
        score = jnp.where(m_idx < size, jnp.abs(m_val).astype(jnp.float32), -1.0)
        *_, r_idx, r_val = lax.sort((segment, -score, position, m_idx, m_val), num_keys=3)
        idx, val = r_idx[kept], r_val[kept]
        leader = (me & ((2 << i) - 1)) == 0
        back_idx.append(jnp.where(leader, r_idx[dropped], size))
        back_val.append(jnp.where(leader, r_val[dropped], 0))
    update = _vma.device_identical(scatter_add_mean(idx, val, size, divisor), axis_name)
    if not back_idx:
        return Exchanged(update, jnp.float32(wire))
    back = returned_units(jnp.concatenate(back_val), n_dev, divisor)
    return Exchanged(update, jnp.float32(wire), jnp.concatenate(back_idx), back)


def _region_bounds(indices, size: int, n_dev: int, axis_name):
    """Region starts balancing the devices' selected indices (a psum-ed histogram)."""
    bins = BINS_PER_DEVICE * n_dev
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
        return Exchanged(scatter_add_mean(indices, values, size, 1), jnp.float32(0))
    starts = _region_bounds(indices, size, n_dev, axis_name)
    values, divisor = mean_first(values, n_dev)
    idx, val = lax.sort((indices, values), num_keys=1)  # padding (size) last
    region = jnp.searchsorted(starts, idx, side="right") - 1
    first = jnp.searchsorted(idx, starts, side="left")  # each region's first slot
    rank = jnp.arange(cap) - first[jnp.clip(region, 0, n_dev - 1)]
    valid = idx < size
    fits = valid & (rank < per_peer)
    slot = jnp.where(fits, region * per_peer + rank, n_dev * per_peer)
    recv_idx, recv_val = to_owners(slot, idx, val, size, per_peer, axis_name)
    # Sum equal indices (up to N copies) in index order, then keep the largest.
    r_idx, r_val = lax.sort((recv_idx.reshape(-1), recv_val.reshape(-1)), num_keys=1)
    first_of = jnp.concatenate([jnp.ones((1,), bool), r_idx[1:] != r_idx[:-1]])
    seg = jnp.cumsum(first_of) - 1
    sums = jax.ops.segment_sum(r_val, seg, num_segments=r_idx.shape[0])
    u_idx = jnp.full(r_idx.shape, size, jnp.int32).at[seg].set(r_idx)
    u_idx = jnp.where(jnp.arange(r_idx.shape[0]) <= seg[-1], u_idx, size)
    keep_idx, keep_val, drop_idx, drop_val = top_and_rest(u_idx, sums, per_region, size)
    all_idx = all_gather_invariant(keep_idx, axis_name).reshape(-1)
    all_val = all_gather_invariant(keep_val, axis_name).reshape(-1)
    update = scatter_add_mean(all_idx, all_val, size, divisor)
    overflow_idx = jnp.where(valid & ~fits, idx, size)
    overflow_val = jnp.where(valid & ~fits, val, 0)
    return Exchanged(
        update,
        jnp.float32(wire),
        jnp.concatenate([overflow_idx, drop_idx]),
        returned_units(jnp.concatenate([overflow_val, drop_val]), n_dev, divisor),
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
        return Exchanged(scatter_add_mean(indices, values, size, 1), jnp.float32(0))
    slots = np.asarray(slots, np.int64)
    offsets, sizes = np.asarray(offsets, np.int64), np.asarray(sizes, np.int64)
    n_seg = len(slots)
    caps = [oktopk_capacities(int(c), n_dev, slack) if c else (0, 0) for c in slots]
    per_peer, per_region = (np.asarray(c, np.int64) for c in zip(*caps, strict=True))
    total, width_p = int(slots.sum()), int(per_peer.sum())
    item = jnp.dtype(values.dtype).itemsize
    bins = BINS_PER_DEVICE * n_dev
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
    recv_idx, recv_val = to_owners(slot, idx, val, size, width_p, axis_name)
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
    # top_and_rest per segment: by |value| down, ties to the lower position.
    score = jnp.where(u_idx < size, jnp.abs(sums).astype(jnp.float32), -1.0)
    order = jnp.arange(n_dev * width_p, dtype=jnp.int32)
    *_, t_idx, t_val = lax.sort((jnp.asarray(block), -score, order, u_idx, sums), num_keys=3)
    kept = np.concatenate([o + np.arange(r) for o, r in zip(block_start, per_region, strict=True)])
    spans = zip(block_start, per_region, n_dev * per_peer, strict=True)
    dropped = np.concatenate([o + np.arange(r, n) for o, r, n in spans])
    all_idx = all_gather_invariant(t_idx[kept.astype(np.int32)], axis_name).reshape(-1)
    all_val = all_gather_invariant(t_val[kept.astype(np.int32)], axis_name).reshape(-1)
    update = scatter_add_mean(all_idx, all_val, size, divisor)
    overflow = valid & ~fits
    drop = dropped.astype(np.int32)
    return Exchanged(
        update,
        jnp.float32(wire),
        jnp.concatenate([jnp.where(overflow, idx, size), t_idx[drop]]),
        returned_units(jnp.concatenate([jnp.where(overflow, val, 0), t_val[drop]]), n_dev, divisor),
    )
