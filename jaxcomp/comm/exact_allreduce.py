"""SparCML, ScaleCom's cyclic leader and the sparse reduce-scatter: sums that select nothing.

Unlike gTop-k and Ok-Topk (:mod:`jaxcomp.comm.topk_allreduce`), these do not
choose a top of the merged messages; each sums exactly what it carries:

- :func:`sparcml_mean` (SparCML): the union of the messages by recursive
  doubling (equal indices summed, round ``i`` carrying ``min(2^i cap, U)``
  pairs), or a dense all-reduce when the total count passes the break-even
  ``U`` (:func:`sparcml_union_capacity`); the exact mean either way, decided
  identically on every device by a tiny all-reduce of the counts.
- :func:`cyclic_mean` (ScaleCom): at step ``t`` device ``t mod N`` leads; its
  indices are broadcast and every device's own values there are all-reduced.
  The exact mean on the leader's support; each residual keeps the rest.
  Two all-reduces of ``cap`` entries, whatever ``N``.
- :func:`scatter_mean` (for FSDP): device ``j`` gets the mean of every
  message's region ``j`` of ``N`` equal regions, over a padded
  ``all_to_all`` of at most ``ceil(slack * cap / N)`` pairs per peer; the
  overflow is returned to the sender's residual. About ``slack`` messages
  per device. :func:`scatter_mean_segments` does it for many segments of a
  packed buffer at once.
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
    allreduce_bytes,
    array_nbytes,
    axis_size,
    dense_mean,
    mean_first,
)
from jaxcomp.comm.sparse_pairs import (
    Exchanged,
    check_power_of_two,
    merge_pairs,
    scatter_add_mean,
    to_owners,
)
from jaxcomp.comm.topk_allreduce import OKTOPK_SLACK, gtopk_rounds

__all__ = [
    "cyclic_mean",
    "scatter_capacity",
    "scatter_mean",
    "scatter_mean_segments",
    "sparcml_mean",
    "sparcml_union_capacity",
]


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
        return Exchanged(scatter_add_mean(indices, values, size, 1), jnp.float32(0))
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
    recv_idx, recv_val = to_owners(slot, offset, val, region, per_peer, axis_name)
    update = scatter_add_mean(recv_idx.reshape(-1), recv_val.reshape(-1), region, n_dev)
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
        return Exchanged(scatter_add_mean(at, values, out_size, 1), jnp.float32(0))
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
    recv_idx, recv_val = to_owners(slot, offset, val, out_size, width_p, axis_name)
    update = scatter_add_mean(recv_idx.reshape(-1), recv_val.reshape(-1), out_size, n_dev)
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
    update = scatter_add_mean(shared, lax.psum(added, axis_name), size, divisor)
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
    check_power_of_two("sparcml", n_dev)
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
            m_idx, m_val = merge_pairs(idx, val, p_idx, p_val, size)
            # Canonical order puts padding last; the union fits in min(2 c, U).
            keep = min(m_idx.shape[0], union)
            order = jnp.argsort(m_idx, stable=True)[:keep]
            idx, val = m_idx[order], m_val[order]
        update = _vma.device_identical(scatter_add_mean(idx, val, size, divisor), axis_name)
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
