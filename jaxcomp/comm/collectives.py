"""Collectives for compressed gradients, run inside ``jax.shard_map`` (or ``pmap``).

Every function takes the mesh axis name and returns the averaged (or mixed)
dense result together with the bytes this device put on the wire for it, a
float32 scalar counted from the shapes and dtypes of what the collective
actually moves (not estimated from a ratio). Byte counts follow the usual cost
model of each collective, with ``B`` the bytes of one device's message and
``N`` the number of devices along the axis:

==========================  =================================  =================================
collective                  per-device bytes reported          what it models
==========================  =================================  =================================
:func:`dense_mean`          ``2 (N - 1) / N * B``              ring all-reduce
:func:`sparse_mean`         ``(N - 1) * B``                    all-gather of (index, value)
:func:`server_mean`         ``B_push + B_pull``                parameter server, a worker's link
:func:`gossip_mean`         ``2 * B``                          two ring neighbours (ppermute)
:func:`gossip_sparse_mean`  ``2 * B`` (B: the sparse message)  the same, (index, value) pairs
:func:`weighted_mean`       ``2 (N - 1) / N * (B + 4)``        all-reduce of ``w x`` and ``w``
==========================  =================================  =================================

Backup workers (partial aggregation): :func:`dense_mean`, :func:`sparse_mean`
and :func:`exchange_mean` take ``include``, this device's boolean flag; the
result is the mean over the included devices only. Fixed shapes mean the
excluded devices' buffers still travel (zeroed), so the bytes are unchanged,
plus one scalar all-reduce for the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp import _vma

__all__ = [
    "EXCHANGES",
    "EXCHANGE_ALIASES",
    "GOSSIP_WEIGHTS",
    "DecentralizedExchangeError",
    "all_gather_invariant",
    "allgather_bytes",
    "allreduce_bytes",
    "assign_to_servers",
    "axis_size",
    "canonical_exchange",
    "check_servers",
    "dense_mean",
    "exchange_mean",
    "fastest_mask",
    "check_gossip_weights",
    "gossip_mean",
    "gossip_sparse_mean",
    "include_fastest",
    "prefer_sparse",
    "pull_from_root",
    "pull_from_servers",
    "push_to_root",
    "push_to_servers",
    "server_devices",
    "server_link_bytes",
    "server_mean",
    "server_message_counts",
    "server_ranges",
    "server_sparse_mean",
    "sparse_mean",
    "weighted_mean",
]

# Values of the ``exchange`` argument of :func:`exchange_mean`, canonical names
# (docs/vocabulary.md): "allgather" is the all-gather of the compressed messages
# in every family (the quantizers' too), "dense" the all-reduce of decoded values.
EXCHANGES = ("auto", "allgather", "dense")
# Older spellings still accepted wherever an exchange name is, meaning exactly
# the canonical name (no warning: "sparse" is in configs and scripts, and the
# same collective runs either way, bit for bit).
EXCHANGE_ALIASES = {"sparse": "allgather"}


def canonical_exchange(name):
    """``name`` with an alias of :data:`EXCHANGE_ALIASES` replaced by its canonical name.

    Anything else (canonical names, invalid values) is returned unchanged, for
    the caller's own check to name.

    Example:
      >>> from jaxcomp.comm import canonical_exchange
      >>> canonical_exchange("sparse"), canonical_exchange("dense")
      ('allgather', 'dense')
    """
    return EXCHANGE_ALIASES.get(name, name) if isinstance(name, str) else name


INDEX_ITEMSIZE = 4  # messages carry int32 indices


def axis_size(axis_name) -> int:
    """Number of devices along ``axis_name`` (a static int inside shard_map).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: x * axis_size("data"), mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    return lax.axis_size(axis_name)


def all_gather_invariant(x: jax.Array, axis_name) -> jax.Array:
    """``lax.all_gather`` whose result is typed device-invariant.

    Every device receives the same gathered array, but plain ``all_gather``
    types it device-varying, so everything computed from it (the averaged
    update) would look un-exchanged to ``shard_map``'s ``check_vma`` typing.
    Typed invariant, an exchanged update can be told apart from a local one
    at trace time (``jaxcomp.distributed.make_train_step`` relies on it) and
    returned as replicated under ``check_vma=True``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: all_gather_invariant(x, "data"),
      ...     mesh=mesh, in_specs=P(), out_specs=P()))  # replicated: no check_vma error
      >>> f(jnp.arange(3.0)).tolist()
      [[0.0, 1.0, 2.0]]
    """
    return lax.all_gather(x, axis_name, to="invarying")


def array_nbytes(x: jax.Array) -> int:
    return x.size * jnp.dtype(x.dtype).itemsize


def allreduce_bytes(nbytes: float, n_devices: int) -> float:
    """Bytes one device sends in a ring all-reduce of an ``nbytes`` buffer.

    Example:
      >>> allreduce_bytes(1000, n_devices=4)  # 2 (N - 1) / N * nbytes
      1500.0
      >>> allreduce_bytes(1000, n_devices=1)
      0.0
    """
    return 2.0 * (n_devices - 1) / n_devices * nbytes if n_devices > 1 else 0.0


def allgather_bytes(nbytes: float, n_devices: int) -> float:
    """Bytes one device sends in an all-gather of its ``nbytes`` message.

    Example:
      >>> allgather_bytes(100, n_devices=8)  # (N - 1) * nbytes
      700.0
    """
    return float((n_devices - 1) * nbytes)


def prefer_sparse(
    capacity: int,
    size: int,
    itemsize: int,
    n_devices: int,
    *,
    index_itemsize: int = INDEX_ITEMSIZE,
) -> bool:
    """Whether the sparse all-gather moves fewer bytes than a dense all-reduce.

    A static (Python) decision from message sizes, so it can pick the code path
    at trace time: the all-gather sends ``capacity * (index_itemsize +
    itemsize) * (N - 1)`` bytes per device, the ring all-reduce
    ``2 (N - 1) / N * size * itemsize``. Sparse wins below a density of about
    ``2 / (N (1 + index_itemsize / itemsize))``: 1/8 for float32 on 8 devices,
    so DGC's 25% warm-up phase goes dense.

    Args:
      capacity: (index, value) pairs in one device's message.
      size: elements of the dense tensor.
      itemsize: bytes per value (``jnp.dtype(dtype).itemsize``).
      n_devices: devices along the axis (``lax.axis_size(axis_name)``).
      index_itemsize: bytes per index (int32: 4).

    Returns:
      ``True`` when the sparse message is strictly cheaper; ``False`` on one
      device (nothing moves either way, and the dense path skips the scatter).

    Example:
      >>> from jaxcomp.comm import prefer_sparse
      >>> prefer_sparse(capacity=6292, size=2**22, itemsize=4, n_devices=8)
      True
      >>> prefer_sparse(capacity=2**20, size=2**22, itemsize=4, n_devices=8)
      False
    """
    if n_devices <= 1:
        return False
    sparse = allgather_bytes(capacity * (index_itemsize + itemsize), n_devices)
    dense = allreduce_bytes(size * itemsize, n_devices)
    return sparse < dense


def _include_count(include, axis_name):
    """(this device's flag as bool, number of included devices as float32)."""
    include = jnp.asarray(include, jnp.bool_)
    count = lax.psum(include.astype(jnp.float32), axis_name)
    return include, count


def _over_count(x, count):
    """``x / max(count, 1)`` in ``x``'s dtype, computed in at least float32.

    As a multiplication by the reciprocal: XLA rewrites a division by a
    broadcast scalar into one in some programs and not in others (a rounding
    apart), so a leaf's mean would depend on what else the program holds (a
    leaf alone against the same leaf in a packed buffer).
    """
    dt = jnp.promote_types(x.dtype, jnp.float32)
    inv = 1 / jnp.maximum(count, 1).astype(dt)
    return (x.astype(dt) * inv).astype(x.dtype)


def divides_first(dtype, n_dev: int) -> bool:
    """Whether a mean over ``n_dev`` messages of ``dtype`` divides each before adding.

    Adding before dividing by ``N`` (a dense all-reduce; gTop-k, Ok-Topk,
    SparCML, ScaleCom) overflows float16 (65504) where the mean fits; divided
    first, the sum is the mean (each division exact for ``N`` a power of two,
    short of underflow; the sum of the ``N`` float16 terms is still rounded
    to float16, and no residual keeps that rounding). Other dtypes keep the
    one rounding of the sum's division.
    """
    return n_dev > 1 and jnp.dtype(dtype) == jnp.float16


def mean_first(values, n_dev: int):
    """``(values, divisor)``: what the exchange adds, and what it divides the sum by after."""
    if divides_first(values.dtype, n_dev):
        return values / jnp.asarray(n_dev, values.dtype), 1
    return values, n_dev


def dense_mean(
    x: jax.Array, axis_name, *, include: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """All-reduce mean of a dense tensor (the uncompressed baseline).

    Args:
      x: this device's tensor.
      axis_name: mesh axis to average over.
      include: optional boolean scalar, this device's backup-worker flag. When
        given, the result is the mean over the devices whose flag is ``True``
        (zeros if none is).

    Returns:
      ``(mean, bytes_sent)`` with ``bytes_sent`` a float32 scalar: a ring
      all-reduce's ``2 (N - 1) / N`` times the tensor's size (plus one float32
      for the included count when ``include`` is given).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import dense_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda x: dense_mean(x, "data")[0], mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> f(jnp.arange(3.0)).tolist()
      [0.0, 1.0, 2.0]
    """
    n_dev = axis_size(axis_name)
    if include is None:
        added, divisor = mean_first(x, n_dev)
        mean = lax.pmean(added, axis_name) if divisor > 1 else lax.psum(added, axis_name)
        return mean, jnp.float32(allreduce_bytes(array_nbytes(x), n_dev))
    include, count = _include_count(include, axis_name)
    if divides_first(x.dtype, n_dev):
        share = _over_count(x, count)
        mean = lax.psum(jnp.where(include, share, jnp.zeros_like(x)), axis_name)
    else:
        total = lax.psum(jnp.where(include, x, jnp.zeros_like(x)), axis_name)
        mean = _over_count(total, count)
    return mean, jnp.float32(allreduce_bytes(array_nbytes(x) + 4, n_dev))


def dense_scatter_mean(x: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """Reduce-scatter mean of a 1-D tensor: this device's ``1/N`` region of the mean.

    Region ``j`` (of ``N`` equal contiguous ones; ``x.size`` divisible by
    ``N``) goes to device ``j``: FSDP's gradient exchange, half a ring
    all-reduce.

    Returns:
      ``(region_mean, bytes_sent)``: ``(N - 1) / N`` times the tensor's size.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import dense_scatter_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda x: dense_scatter_mean(x, "data")[0], mesh=mesh,
      ...                   in_specs=P(), out_specs=P("data"))
      >>> f(jnp.arange(3.0)).tolist()
      [0.0, 1.0, 2.0]
    """
    n_dev = axis_size(axis_name)
    if x.ndim != 1 or x.shape[0] % n_dev:
        raise ValueError(
            f"dense_scatter_mean: a 1-D tensor whose size divides by {n_dev} devices, got "
            f"shape {x.shape}"
        )
    if n_dev == 1:
        return x, jnp.float32(0)
    total = lax.psum_scatter(x, axis_name, scatter_dimension=0, tiled=True)
    wire = array_nbytes(x) * (n_dev - 1) / n_dev
    return (total / jnp.asarray(n_dev, x.dtype)).astype(x.dtype), jnp.float32(wire)


def sparse_mean(
    indices: jax.Array,
    values: jax.Array,
    size: int,
    axis_name,
    *,
    include: jax.Array | None = None,
    sum_dtype: Any = None,
    regions: tuple[np.ndarray, np.ndarray] | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mean over devices of sparse messages, as a dense 1-D array of ``size``.

    Each device holds a fixed-capacity message: ``indices`` (int32, padding
    entries equal to ``size``, an out-of-range sentinel) and ``values``
    (padding 0). The messages are all-gathered and all ``N * capacity`` pairs
    scatter-added into one dense buffer in a single scatter (``mode="drop"``
    discards the padding).

    Speed (8 simulated devices, 2^22 float32, capacity 6292, this CPU): the
    all-gather takes ~1 ms and writing the dense output ~19 ms (the floor: a
    zero-fill alone), so the values are divided by ``N`` before the scatter
    rather than dividing the dense result (an extra pass: 52 ms -> 22 ms).
    Sorting the pairs to pass ``indices_are_sorted`` (56 ms), one scatter per
    device with ``unique_indices`` (25 ms) and ``segment_sum`` (20 ms) were no
    faster.

    Summation order: contributions to one coordinate are added device by
    device in axis order, the same on every device, so every device gets a
    bit-identical result. It equals ``sum_d dense_d / N`` up to float rounding
    of that order; each value is divided by ``N`` before summing, which is
    exact when ``N`` is a power of two (barring underflow) and otherwise adds
    at most one rounding per term.

    Args:
      indices: int32 ``[capacity]``, this device's indices (``size`` = padding).
      values: ``[capacity]``, the matching values (any float dtype).
      size: length of the dense result.
      axis_name: mesh axis to average over.
      include: optional boolean scalar, this device's backup-worker flag; the
        result is then the mean over the included devices' messages only.
      sum_dtype: optional float dtype wider than ``values``' (float16 or
        bfloat16 values): the values travel in their own dtype and are cast
        to ``sum_dtype`` after the all-gather, then divided and added there
        (DGC's ``fp16_values``: decompressed to float32 before the sum). The
        mean is then in ``sum_dtype``. None: in ``values.dtype``.
      regions: optional static ``(offsets, spans)``, int arrays
        ``[capacity]``: slot ``j``'s index is relative to the region
        ``[offsets[j], offsets[j] + spans[j])`` of the result (an index
        ``>= spans[j]`` is padding), so that ``indices`` fit in a 16-bit
        dtype when every region is smaller than ``2^16``. None: indices
        address the result itself.

    ``indices`` may be any integer dtype holding ``size`` (``uint16`` for a
    result, or regions, of fewer than ``2^16`` elements): they travel in it
    and the bytes count its itemsize.

    Returns:
      ``(mean, bytes_sent)``: the dense mean (``values.dtype``, or
      ``sum_dtype``) and the bytes this device sends, ``(N - 1) * (capacity *
      (index_itemsize + itemsize))``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import sparse_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda i, v: sparse_mean(i, v, 4, "data")[0], mesh=mesh,
      ...     in_specs=(P(), P()), out_specs=P("data"))
      >>> f(jnp.array([2, 4], jnp.int32), jnp.array([5.0, 0.0])).tolist()
      [0.0, 0.0, 5.0, 0.0]
    """
    n_dev = axis_size(axis_name)
    extra = 0
    wide = None if sum_dtype is None or jnp.dtype(sum_dtype) == values.dtype else sum_dtype
    sent = allgather_bytes(array_nbytes(indices) + array_nbytes(values), n_dev)
    scale = None
    if include is None:
        if wide is not None:
            scale = 1 / jnp.asarray(n_dev, wide)
        elif n_dev > 1:
            values = values / jnp.asarray(n_dev, values.dtype)
    else:
        include, count = _include_count(include, axis_name)
        # Excluded messages travel (static shapes) but carry nothing.
        indices = jnp.where(include, indices, jnp.asarray(size if regions is None else
                                                          np.iinfo(indices.dtype).max,
                                                          indices.dtype))  # fmt: skip
        if wide is not None:
            values = jnp.where(include, values, 0)
            scale = 1 / jnp.maximum(count, 1).astype(wide)
        else:
            values = jnp.where(include, _over_count(values, count), 0)
        extra = allreduce_bytes(4, n_dev)
    all_idx = all_gather_invariant(indices, axis_name)  # [N, capacity]
    all_val = all_gather_invariant(values, axis_name).reshape(-1)
    if regions is None:
        all_idx = all_idx.reshape(-1).astype(jnp.int32)
    else:
        # Region-relative (16-bit) indices back to positions in the result.
        offsets, spans = (np.asarray(a, np.int32) for a in regions)
        local = all_idx.astype(jnp.int32)
        all_idx = jnp.where(local < spans, local + offsets, size).reshape(-1)
    if wide is not None:
        # Divided in the wide dtype, as the narrow values / N would round.
        all_val = all_val.astype(wide) / jnp.asarray(n_dev, wide) if include is None else (
            all_val.astype(wide) * scale
        )  # fmt: skip
    out = jnp.zeros((size,), all_val.dtype).at[all_idx].add(all_val, mode="drop")
    return out, jnp.float32(sent + extra)


def exchange_mean(
    indices: jax.Array,
    values: jax.Array,
    size: int,
    axis_name,
    *,
    exchange: str = "auto",
    dense: jax.Array | None = None,
    include: jax.Array | None = None,
    sum_dtype: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Mean of sparse messages, sent sparse or dense (chosen statically).

    The same result as :func:`sparse_mean` (up to summation order): with
    ``exchange="auto"`` the sparse all-gather is used when
    :func:`prefer_sparse` says it moves fewer bytes, otherwise the message is
    scattered into a local dense tensor and all-reduced.

    Args:
      indices: int32 ``[capacity]`` (``size`` = padding).
      values: ``[capacity]`` message values.
      size: length of the dense result.
      axis_name: mesh axis.
      exchange: ``"auto"``, ``"allgather"`` (alias ``"sparse"``) or ``"dense"``.
      dense: optional, the message already scattered into a dense ``[size]``
        tensor of ``values.dtype`` (saves the local scatter on the dense path).
      include: optional backup-worker flag, see :func:`sparse_mean`.
      sum_dtype: see :func:`sparse_mean` (the all-gather's sum; a dense
        all-reduce adds in ``values.dtype``, what it moves). The mean is
        returned in ``sum_dtype`` either way.

    Returns:
      ``(mean, bytes_sent)`` of the chosen collective.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import exchange_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda i, v: exchange_mean(i, v, 3, "data")[0], mesh=mesh,
      ...     in_specs=(P(), P()), out_specs=P("data"))
      >>> f(jnp.array([1], jnp.int32), jnp.array([2.0])).tolist()
      [0.0, 2.0, 0.0]
    """
    exchange = canonical_exchange(
        V.check_choice("exchange", exchange, EXCHANGES + tuple(EXCHANGE_ALIASES))
    )
    if exchange == "auto":
        itemsize = jnp.dtype(values.dtype).itemsize
        use_sparse = prefer_sparse(
            indices.shape[0], size, itemsize, axis_size(axis_name),
            index_itemsize=jnp.dtype(indices.dtype).itemsize,
        )  # fmt: skip
    else:
        use_sparse = exchange == "allgather"
    if use_sparse:
        return sparse_mean(indices, values, size, axis_name, include=include, sum_dtype=sum_dtype)
    if dense is None:
        dense = jnp.zeros((size,), values.dtype).at[indices].add(values, mode="drop")
    mean, sent = dense_mean(dense, axis_name, include=include)
    return (mean if sum_dtype is None else mean.astype(sum_dtype)), sent


def weighted_mean(x: jax.Array, weight: jax.Array, axis_name) -> tuple[jax.Array, jax.Array]:
    """Weighted average ``sum_d w_d x_d / sum_d w_d`` over devices.

    Args:
      x: this device's tensor.
      weight: this device's non-negative scalar weight (e.g. its batch size).
      axis_name: mesh axis.

    Returns:
      ``(weighted mean in x.dtype, bytes_sent)``: an all-reduce of ``w x``
      and of ``w`` (float32).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import weighted_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda x: weighted_mean(x, 2.0, "data")[0], mesh=mesh,
      ...                   in_specs=P(), out_specs=P())
      >>> f(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    n_dev = axis_size(axis_name)
    w = jnp.asarray(weight, jnp.float32)
    total, wsum = lax.psum((w.astype(x.dtype) * x, w), axis_name)
    mean = (total / wsum.astype(x.dtype)).astype(x.dtype)
    return mean, jnp.float32(allreduce_bytes(array_nbytes(x) + 4, n_dev))


# --- backup workers --------------------------------------------------------


def fastest_mask(delays, num_backup: int):
    """Include mask of the ``N - num_backup`` fastest devices.

    Args:
      delays: ``[N]`` simulated per-device step times (numpy or jax), the same
        on every device.
      num_backup: ``b``, how many of the slowest devices to leave out,
        ``0 <= b < N``. Ties go to the lower device index.

    Returns:
      bool ``[N]``, ``True`` for the devices whose messages are aggregated.

    Example:
      >>> import numpy as np
      >>> from jaxcomp.comm import fastest_mask
      >>> fastest_mask(np.array([3.0, 1.0, 9.0, 2.0]), 1).tolist()
      [True, True, False, True]
    """
    delays = jnp.asarray(delays)
    n = delays.shape[0]
    num_backup = V.check_int("num_backup", num_backup, 0, n - 1)
    order = jnp.argsort(delays, stable=True)
    rank = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return rank < n - num_backup


def include_fastest(delays, num_backup: int, axis_name) -> jax.Array:
    """This device's backup-worker flag from replicated per-device delays.

    Inside shard_map: ``fastest_mask(delays, num_backup)[axis_index]``, the
    ``include`` argument of :func:`dense_mean`, :func:`sparse_mean` and
    :func:`exchange_mean`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda d: include_fastest(d, 0, "data")[None],
      ...     mesh=mesh, in_specs=P(), out_specs=P("data")))
      >>> f(jnp.array([2.5])).tolist()  # no backup workers: every device is included
      [True]
    """
    return fastest_mask(delays, num_backup)[lax.axis_index(axis_name)]


# --- parameter server --------------------------------------------------------


def check_servers(
    servers: Any,
    n_devices: int | None = None,
    *,
    exchange: str = "server",
    axis_name: Any = "",
) -> int:
    """Validates ``servers``, the size of a parameter-server group (the one check of it).

    An int in ``[1, N]`` (``None``: 1), ``N`` the devices of the axis
    (``n_devices``; ``None`` where they are not known yet, as at a
    compressor's construction: bounded by ``2**31 - 1`` there, by ``N`` when
    the update is traced). A compressor passes its ``exchange`` and
    ``axis_name``: more than one server needs ``exchange="server"`` and an
    axis to spread them over (``axis_name=None``: one device, no servers).

    Raises:
      ValueError: naming ``servers`` and its range, or the ``exchange`` /
        ``axis_name`` it needs.

    Example:
      >>> check_servers(2, n_devices=8), check_servers(None)
      (2, 1)
      >>> check_servers(2, exchange="allgather")
      Traceback (most recent call last):
        ...
      ValueError: servers must be 1 unless exchange='server', got 2 with exchange='allgather'
    """
    bound = 2**31 - 1 if n_devices is None else max(int(n_devices), 1)
    servers = V.check_int("servers", 1 if servers is None else servers, 1, bound)
    if servers > 1 and exchange != "server":
        raise ValueError(
            f"servers must be 1 unless exchange='server', got {servers} with exchange={exchange!r}"
        )
    if servers > 1 and axis_name is None:
        raise ValueError(
            f"servers must be 1 with axis_name=None (one device: nothing to serve), got {servers}"
        )
    return servers


def server_devices(n_devices: int, servers: int = 1, *, root: int = 0) -> tuple[int, ...]:
    """The devices of a group of ``M`` parameter servers: spread evenly over the axis.

    Server ``j`` is device ``(root + j * N // M) % N`` (with ``N = 8``:
    ``M = 2`` gives devices 0 and 4, ``M = 4`` devices 0, 2, 4, 6), so the
    servers sit in different parts of the axis (on a multi-host mesh,
    different hosts where ``M`` divides the host count) rather than crowding
    its first hosts. ``M = 1`` is ``root`` alone, the single server.

    Example:
      >>> server_devices(8, 4), server_devices(8, 1)
      ((0, 2, 4, 6), (0,))
    """
    n_devices = V.check_int("n_devices", n_devices, 1)
    servers = check_servers(servers, n_devices)
    V.check_int("root", root, 0, max(n_devices - 1, 0))
    return tuple((root + j * n_devices // servers) % n_devices for j in range(servers))


def server_ranges(size: int, servers: int = 1) -> tuple[tuple[int, int], ...]:
    """The key ranges of ``M`` servers over a flat buffer of ``size`` elements.

    Server ``j`` owns the flat positions ``[lo_j, hi_j)``: equal contiguous
    slices of ``ceil(size / M)`` elements (the last shorter, empty ones past
    the end when ``size < M``). Static: they depend on shapes only.

    Example:
      >>> server_ranges(10, 4)
      ((0, 3), (3, 6), (6, 9), (9, 10))
    """
    size, servers = V.check_int("size", size, 0), check_servers(servers)
    chunk = -(-size // servers)
    return tuple((min(j * chunk, size), min((j + 1) * chunk, size)) for j in range(servers))


def assign_to_servers(nbytes: Sequence[float], servers: int = 1) -> tuple[tuple[int, ...], ...]:
    """Which messages each of ``M`` servers takes, when they are sharded whole (by leaf).

    Greedy balancing of the bytes: the largest message first (ties: the
    lower index) to the server with the fewest bytes so far (ties: the
    lower server); each server's share listed in message order. Static (it
    depends on message sizes only); servers beyond the number of messages
    get none. With ``M = 1`` the one server takes every message.

    Example:
      >>> assign_to_servers([100, 10, 60, 50], servers=2)
      ((0, 1), (2, 3))
    """
    servers = check_servers(servers)
    # A byte count may be a formula's float (a benchmark's): any finite number >= 0.
    sizes = [V.check_real(f"nbytes[{i}]", b, 0.0) for i, b in enumerate(nbytes)]
    loads, shares = [0.0] * servers, [[] for _ in range(servers)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        j = min(range(servers), key=lambda j: (loads[j], j))
        loads[j] += sizes[i]
        shares[j].append(i)
    return tuple(tuple(sorted(share)) for share in shares)


def server_link_bytes(push_nbytes, pull_nbytes, n_devices: int) -> dict:
    """Per-step bytes of the parameter-server pattern, by link.

    Args:
      push_nbytes: bytes of one worker's push (its gradient message); for a
        group of ``M`` servers, a sequence: what one worker pushes to each.
      pull_nbytes: bytes of the averaged result each worker pulls (a
        sequence for a group: what it pulls from each server).
      n_devices: ``N``, the workers (each server is co-located with one of
        them, whose own push and pull stay local).

    Returns:
      dict with ``worker`` (push + pull on the link of a worker that serves
      nothing: the sums over the servers) and ``server_in`` /
      ``server_out`` (what a server's link carries in its server role: the
      ``N - 1`` remote pushes in, ``N - 1`` pulls out), floats for scalar
      arguments, tuples of one float per server for sequences.

    Example:
      >>> server_link_bytes(push_nbytes=10, pull_nbytes=40, n_devices=4)
      {'worker': 50.0, 'server_in': 30.0, 'server_out': 120.0}
      >>> server_link_bytes([10, 10], [20, 20], n_devices=4)
      {'worker': 60.0, 'server_in': (30.0, 30.0), 'server_out': (60.0, 60.0)}
    """
    group = isinstance(push_nbytes, Sequence) or isinstance(pull_nbytes, Sequence)
    pushes = [float(b) for b in (push_nbytes if group else [push_nbytes])]
    pulls = [float(b) for b in (pull_nbytes if group else [pull_nbytes])]
    if len(pushes) != len(pulls):
        raise ValueError(
            f"push_nbytes and pull_nbytes must have one entry per server, got {len(pushes)} "
            f"and {len(pulls)}"
        )
    remote = max(n_devices - 1, 0)
    server_in = tuple(float(remote * b) for b in pushes)
    server_out = tuple(float(remote * b) for b in pulls)
    return {
        "worker": float(sum(pushes) + sum(pulls)) if n_devices > 1 else 0.0,
        "server_in": server_in if group else server_in[0],
        "server_out": server_out if group else server_out[0],
    }


def server_message_counts(indices: jax.Array, size: int, servers: int = 1) -> jax.Array:
    """Per server, how many of a sparse message's entries fall in its key range.

    With ``M > 1`` servers a worker pushes its whole fixed-capacity message
    to every server (static shapes: how many entries fall in a range is
    data-dependent), and each server keeps the entries of its range
    (:func:`server_sparse_mean`). These counts are the meaningful part of
    those pushes: ``counts[j] * (index + value bytes)`` of the
    ``capacity * (index + value bytes)`` moved to server ``j``. Padding
    entries (index ``>= size``) count nowhere.

    Returns:
      int32 ``[M]``.

    Example:
      >>> import jax.numpy as jnp
      >>> server_message_counts(jnp.array([0, 1, 7, 10]), 10, servers=2).tolist()
      [2, 1]
    """
    bounds = jnp.asarray([lo for lo, _ in server_ranges(size, servers)] + [size], jnp.int32)
    idx = indices.astype(jnp.int32)[:, None]
    inside = (idx >= bounds[None, :-1]) & (idx < bounds[None, 1:])
    return jnp.sum(inside, axis=0, dtype=jnp.int32)


def _server_of(devices, n_dev: int) -> np.ndarray:
    """Each device's server index in ``devices`` (0 for a device that serves nothing)."""
    table = np.zeros(n_dev, np.int32)
    table[list(devices)] = np.arange(len(devices), dtype=np.int32)
    return table


def push_to_servers(send, axis_name, servers: Sequence[int], *, per_server: bool = False):
    """Every worker's message to each server of the group, one ppermute per round.

    ``send``: what this device sends; with ``per_server`` a ``(M, ...)``
    array whose row ``j`` goes to server ``j``, else the same message to all.
    Round ``r`` (``1 <= r < N``) is ONE ppermute: server ``s_j`` receives
    from device ``(s_j + r) mod N`` (distinct sources, as the servers are
    distinct), so the count is ``N - 1`` whatever ``M``. Returns ``(N, ...)``:
    on server ``j``'s device, row ``d`` is what device ``d`` sent it (device
    order); rows are meaningless on other devices.

    Args:
      send: this device's message (``per_server``: one row per server).
      axis_name: mesh axis.
      servers: the servers' devices along the axis, distinct
        (:func:`server_devices`).
      per_server: whether ``send`` holds one row per server.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: push_to_servers(x, "data", (0,)), mesh=mesh, in_specs=P(),
      ...     out_specs=P("data")))
      >>> f(jnp.arange(3.0)).tolist()  # row d: device d's x, as received on the server
      [[0.0, 1.0, 2.0]]
    """
    n_dev, devices = axis_size(axis_name), tuple(servers)
    me = lax.axis_index(axis_name)
    if per_server and len(devices) == 1:
        send, per_server = send[0], False
    if per_server:
        owner = jnp.asarray(_server_of(devices, n_dev))
        # The sender of round r to server s_j is the device s_j + r: it sends row j.
        row = lambda r: send[owner[(me - r) % n_dev]]  # noqa: E731
    else:
        row = lambda r: send  # noqa: E731
    rounds = [row(0)] + [
        lax.ppermute(row(r), axis_name, perm=[((s + r) % n_dev, s) for s in devices])
        for r in range(1, n_dev)
    ]
    # On server s, round r came from device s + r: device d's message is round d - s.
    return jnp.take(jnp.stack(rounds), (jnp.arange(n_dev) - me) % n_dev, axis=0)


def pull_from_servers(shards, axis_name, servers: Sequence[int]):
    """Every device gets each server's shard, one ppermute per round.

    ``shards``: ``(M, ...)``, row ``j`` meaningful on server ``j``'s device.
    Round ``r`` is ONE ppermute: server ``s_j`` sends to device ``(s_j + r)
    mod N`` (distinct destinations). Returns ``(M, ...)``, the same on every
    device.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: pull_from_servers(x[None], "data", (0,))[0], mesh=mesh,
      ...     in_specs=P(), out_specs=P("data")))
      >>> f(jnp.arange(3.0)).tolist()
      [0.0, 1.0, 2.0]
    """
    n_dev, devices = axis_size(axis_name), tuple(servers)
    me = lax.axis_index(axis_name)
    mine = shards[0] if len(devices) == 1 else shards[jnp.asarray(_server_of(devices, n_dev))[me]]
    rounds = [mine] + [
        lax.ppermute(mine, axis_name, perm=[(s, (s + r) % n_dev) for s in devices])
        for r in range(1, n_dev)
    ]
    # On device d, server s_j's shard arrived in round d - s_j.
    got = jnp.take(jnp.stack(rounds), (me - jnp.asarray(devices)) % n_dev, axis=0)
    return _vma.device_identical(got, axis_name)


def push_to_root(x: jax.Array, axis_name, *, root: int = 0) -> list:
    """Every device's ``x`` sent to ``root`` (single-pair ``ppermute`` calls), in device order.

    The list's entries are meaningful on ``root`` only; the parameter
    server's push (:func:`push_to_servers` with one server).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: push_to_root(x, "data")[0], mesh=mesh, in_specs=P(), out_specs=P("data")))
      >>> f(jnp.arange(3.0)).tolist()  # entry 0: device 0's x, as received on the root
      [0.0, 1.0, 2.0]
    """
    _check_root(root, axis_size(axis_name))
    return list(push_to_servers(x, axis_name, (root,)))


def pull_from_root(x: jax.Array, axis_name, *, root: int = 0) -> jax.Array:
    """``root``'s ``x`` on every device (the parameter server's pull).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: pull_from_root(x, "data"), mesh=mesh, in_specs=P(), out_specs=P("data")))
      >>> f(jnp.arange(3.0)).tolist()
      [0.0, 1.0, 2.0]
    """
    _check_root(root, axis_size(axis_name))
    return pull_from_servers(x[None], axis_name, (root,))[0]


def _check_root(root, n_dev):
    V.check_int("root", root, 0, n_dev - 1)


def _server_key_ranges(size: int, axis_name, root: int, servers: int):
    """``(N, devices, chunk)``: the servers that own a key range of ``[0, size)``
    (empty ranges left out; an empty buffer keeps the first server) and the
    range length ``ceil(size / M)`` (the last range is shorter; its shard padded)."""
    n_dev = axis_size(axis_name)
    _check_root(root, n_dev)
    devices = server_devices(n_dev, servers, root=root)
    ranges = server_ranges(size, servers)
    used = sum(hi > lo for lo, hi in ranges) or 1
    return n_dev, devices[:used], ranges[0][1] - ranges[0][0]


def _pad_to(flat, length):
    return flat if flat.size == length else jnp.pad(flat, (0, length - flat.size))


def server_mean(
    x: jax.Array, axis_name, *, root: int = 0, servers: int = 1
) -> tuple[jax.Array, jax.Array]:
    """Parameter-server averaging (DLGS): workers push, the server averages, workers pull.

    Device ``root`` plays the server: every other device pushes its ``x`` to it
    (``ppermute`` calls, so nothing moves between workers), the server
    sums the pushes in device order and divides by ``N``, and sends the mean
    back to every worker. All devices end with the root's bit-identical mean.

    A group of ``servers = M`` servers (devices :func:`server_devices`) shards
    the flattened ``x`` by key range (:func:`server_ranges`): server ``j``
    receives only its slice of every worker's ``x``, averages it and sends
    that slice of the mean back. Each element is averaged exactly as by one
    server (the same additions in the same order); a worker's link carries
    the same bytes, and each server's link ``1 / M`` of the single server's.
    The group's traffic moves in ``N - 1`` push and ``N - 1`` pull rounds,
    one ``ppermute`` each (server ``s_j`` paired with device ``s_j + r``):
    the compiled program does not grow with ``M``.

    Args:
      x: this worker's tensor.
      axis_name: mesh axis.
      root: index of the (first) server device along the axis.
      servers: ``M`` in ``[1, N]``, the servers of the group (1: ``root`` alone).

    Returns:
      ``(mean, bytes)``: ``bytes`` is one worker's link per step, push + pull
      ``= 2 B``; the server's link carries ``(N - 1) B`` in and ``(N - 1) B``
      out (:func:`server_link_bytes`), the bottleneck that all-reduce avoids.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import server_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda x: server_mean(x, "data")[0], mesh=mesh,
      ...                   in_specs=P(), out_specs=P("data"))
      >>> f(jnp.arange(2.0)).tolist()
      [0.0, 1.0]
    """
    flat = x.reshape(-1)
    n_dev, devices, chunk = _server_key_ranges(flat.size, axis_name, root, servers)
    m = len(devices)
    send = _pad_to(flat, m * chunk).reshape(m, chunk)
    pushed = push_to_servers(send, axis_name, devices, per_server=True)
    total = pushed[0]
    for d in range(1, n_dev):
        total = total + pushed[d]
    shards = pull_from_servers((total / n_dev)[None], axis_name, devices)
    mean = shards.reshape(-1)[: flat.size].reshape(x.shape)
    item = jnp.dtype(x.dtype).itemsize
    nbytes = [(hi - lo) * item for lo, hi in server_ranges(flat.size, servers)[:m]]
    return mean, jnp.float32(server_link_bytes(nbytes, nbytes, n_dev)["worker"])


def server_sparse_mean(
    indices: jax.Array,
    values: jax.Array,
    size: int,
    axis_name,
    *,
    root: int = 0,
    servers: int = 1,
) -> tuple[jax.Array, jax.Array]:
    """Parameter server with sparse pushes (DLGS): push (index, value), pull dense.

    Workers push their fixed-capacity messages (see :func:`sparse_mean`) to
    the server ``root``, which scatter-adds them in device order, divides by
    ``N`` and sends the dense mean back.

    A group of ``servers = M`` servers (devices :func:`server_devices`) owns
    the key ranges :func:`server_ranges` of ``[0, size)``: server ``j``
    scatter-adds the entries of every message that fall in its range (in
    device order, as one server does) and sends that slice of the dense mean
    back. How many of a message's entries fall in a range is data-dependent,
    so with static shapes each worker pushes its whole message to every
    server (``M`` times the message on the wire; the meaningful part is
    :func:`server_message_counts`); the dense pull is split, ``1 / M`` per
    server. Push and pull move in ``N - 1`` rounds each, one ``ppermute``
    per round and buffer whatever ``M`` (see :func:`server_mean`).

    Returns:
      ``(mean, bytes)``: a worker's push ``M * capacity * (4 + itemsize)``
      plus its pull ``size * itemsize``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda i, v: server_sparse_mean(i, v, 5, "data")[0],
      ...     mesh=mesh, in_specs=P(), out_specs=P("data")))
      >>> f(jnp.array([1, 3]), jnp.array([2.0, -4.0])).tolist()
      [0.0, 2.0, 0.0, -4.0, 0.0]
    """
    n_dev, devices, chunk = _server_key_ranges(size, axis_name, root, servers)
    m = len(devices)
    all_idx = push_to_servers(indices, axis_name, devices).reshape(-1)
    all_val = push_to_servers(values, axis_name, devices).reshape(-1)
    all_val = all_val / jnp.asarray(n_dev, values.dtype)
    if m > 1:  # this server's range; the rest (and padding) dropped
        lo = jnp.asarray(_server_of(devices, n_dev) * chunk)[lax.axis_index(axis_name)]
        inside = (all_idx >= lo) & (all_idx < jnp.minimum(lo + chunk, size))
        all_idx = jnp.where(inside, all_idx - lo.astype(all_idx.dtype), chunk)
    total = jnp.zeros((chunk,), values.dtype).at[all_idx].add(all_val, mode="drop")
    mean = pull_from_servers(total[None], axis_name, devices).reshape(-1)[:size]
    push = array_nbytes(indices) + array_nbytes(values)
    item = jnp.dtype(values.dtype).itemsize
    link = server_link_bytes(
        [push] * m, [(hi - lo) * item for lo, hi in server_ranges(size, servers)[:m]], n_dev
    )
    return mean, jnp.float32(link["worker"])


# --- gossip ------------------------------------------------------------------

# Default ring mixing weights ``(w_self, w_left, w_right)``: a symmetric,
# doubly stochastic mixing matrix, so repeated mixing keeps the replicas' mean.
GOSSIP_WEIGHTS = (1 / 3, 1 / 3, 1 / 3)


class DecentralizedExchangeError(_vma.ProbeError):
    """A gossip (decentralized) exchange traced where updates must be averaged.

    A gossip exchange gives every device a different update (its ring mix), so
    it cannot drive replicated parameters: ``jaxcomp.distributed.make_train_step``
    would otherwise keep device 0's parameters and silently drop the others'.
    Raised while ``make_train_step`` probes ``tx``; use
    :func:`jaxcomp.aggregation.make_gossip_train_step` (per-device parameters).
    """


def check_gossip_weights(weights: Sequence[float]) -> tuple[float, float, float]:
    """Validates ring mixing weights: 3 non-negative numbers summing to 1.

    A sum within ``np.isclose`` of 1 is accepted and renormalised (in float64).

    Returns:
      ``(w_self, w_left, w_right)`` as Python floats, summing to 1.

    Raises:
      ValueError: anything else, naming ``weights``.

    Example:
      >>> check_gossip_weights([0.5, 0.25, 0.25])
      (0.5, 0.25, 0.25)
      >>> check_gossip_weights([0.5, 0.5, 0.5])
      Traceback (most recent call last):
          ...
      ValueError: weights must be 3 non-negative numbers summing to 1, got [0.5, 0.5, 0.5]
    """
    bad = ValueError(f"weights must be 3 non-negative numbers summing to 1, got {weights!r}")
    try:
        w = np.asarray([V.check_real("weights", v, 0.0, 1.0) for v in weights], np.float64)
    except (TypeError, ValueError):
        raise bad from None
    if w.shape != (3,) or not np.isclose(w.sum(), 1.0):
        raise bad
    # Renormalised: weights kept as given (sum 1 + 1e-5, accepted by isclose)
    # made replicas that agree drift by that factor every step.
    return tuple(float(v) for v in w / w.sum())


def ring_neighbours(x, axis_name):
    """``(from_left, from_right)``: the ring neighbours' ``x`` (two ``ppermute`` calls).

    ``from_left`` on device ``i`` is device ``i - 1``'s ``x``, ``from_right``
    device ``i + 1``'s (indices mod ``N``); ``x`` may be a pytree (one
    ``ppermute`` per leaf and direction). On one device both are ``x``.

    Raises:
      DecentralizedExchangeError: when traced by ``make_train_step``'s probe
        (replicated parameters): every gossip exchange goes through here.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: ring_neighbours(x, "data"), mesh=mesh, in_specs=P(), out_specs=P("data")))
      >>> [v.tolist() for v in f(jnp.arange(3.0))]  # one device: both neighbours are itself
      [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    """
    if _vma.probing_now():  # make_train_step's probe (replicated parameters)
        raise DecentralizedExchangeError(
            "a gossip exchange (exchange='gossip', jaxcomp.aggregation.gossip_exchange or "
            "jaxcomp.comm.gossip_mean) gives each device a different update, so it cannot "
            "train the replicated parameters of make_train_step (they would silently become "
            "device 0's). Use jaxcomp.aggregation.make_gossip_train_step, which keeps one "
            "parameter replica per device, or an averaging exchange."
        )
    n_dev = axis_size(axis_name)
    if n_dev == 1:
        return x, x
    from_left = lax.ppermute(x, axis_name, perm=[(i, (i + 1) % n_dev) for i in range(n_dev)])
    from_right = lax.ppermute(x, axis_name, perm=[(i, (i - 1) % n_dev) for i in range(n_dev)])
    return from_left, from_right


def gossip_mean(
    x: jax.Array, axis_name, *, weights: Sequence[float] = GOSSIP_WEIGHTS
) -> tuple[jax.Array, jax.Array]:
    """One gossip step on a ring (D-PSGD): mix with the two ring neighbours.

    ``x_i <- w_self x_i + w_left x_{i-1} + w_right x_{i+1}`` (indices mod
    ``N``), with two ``ppermute`` calls. Replicas may differ (``x`` is per device);
    with a doubly stochastic mixing matrix (these symmetric weights, summing
    to 1) repeated steps converge to the average of the initial replicas.
    With ``N = 2`` both neighbours are the other device.

    Args:
      x: this device's replica (floating point; mixed in float32 or wider).
      axis_name: mesh axis (the ring follows the axis order).
      weights: ``(w_self, w_left, w_right)``, non-negative, summing to 1.

    Returns:
      ``(mixed, bytes_sent)``: each device sends ``x`` to both neighbours,
      ``2 B`` (0 on one device).

    Raises:
      DecentralizedExchangeError: inside ``make_train_step`` (see
        :func:`ring_neighbours`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import gossip_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda x: gossip_mean(x, "data")[0], mesh=mesh,
      ...                   in_specs=P(), out_specs=P("data"))
      >>> f(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """
    w = check_gossip_weights(weights)
    from_left, from_right = ring_neighbours(x, axis_name)
    if axis_size(axis_name) == 1:
        return x, jnp.float32(0)
    return ring_mix(x, from_left, from_right, w), jnp.float32(2 * array_nbytes(x))


def ring_mix(x, from_left, from_right, weights):
    """``w_self x + w_left from_left + w_right from_right``, cast back to ``x``'s dtype.

    :func:`gossip_mean`'s mix of what :func:`ring_neighbours` received, apart
    so that an exchange that moves many tensors in one buffer can mix each
    tensor on its own (the same kernels, so the same bits, as its own
    ``gossip_mean``). ``weights``: as returned by :func:`check_gossip_weights`.
    """
    # Mixed in float32 at least: bf16 weights of 1/3 would not sum to 1.
    wide = jnp.promote_types(x.dtype, jnp.float32)
    w_self, w_left, w_right = (jnp.asarray(v, wide) for v in weights)
    mixed = w_self * x.astype(wide) + w_left * from_left.astype(wide)
    mixed = mixed + w_right * from_right.astype(wide)
    return mixed.astype(x.dtype)


def gossip_sparse_mean(
    indices: jax.Array,
    values: jax.Array,
    size: int,
    axis_name,
    *,
    dense: jax.Array | None = None,
    weights: Sequence[float] = GOSSIP_WEIGHTS,
) -> tuple[jax.Array, jax.Array]:
    """Gossip of sparse messages: this device's ring mix of its own and its neighbours'.

    Each device sends its fixed-capacity (index, value) message (see
    :func:`sparse_mean`) to its two ring neighbours and returns ``w_self S_i +
    w_left S_{i-1} + w_right S_{i+1}`` as a dense ``[size]`` array, ``S_j``
    device ``j``'s message scattered. The result differs per device
    (decentralized training, :func:`jaxcomp.aggregation.make_gossip_train_step`).

    Args:
      indices: int32 ``[capacity]`` (``size`` = padding).
      values: ``[capacity]`` message values.
      size: length of the dense result.
      axis_name: mesh axis (the ring follows the axis order).
      dense: optional, this device's message already scattered into ``[size]``.
      weights: ``(w_self, w_left, w_right)``, non-negative, summing to 1.

    Returns:
      ``(mixed, bytes_sent)``: two messages, ``2 * capacity * (4 + itemsize)``
      (0 on one device).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm.collectives import gossip_sparse_mean
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(
      ...     lambda i, v: gossip_sparse_mean(i, v, 3, "data")[0], mesh=mesh,
      ...     in_specs=(P(), P()), out_specs=P("data"))
      >>> f(jnp.array([1, 3], jnp.int32), jnp.array([2.0, 0.0])).tolist()
      [0.0, 2.0, 0.0]
    """
    w = check_gossip_weights(weights)
    if dense is None:
        dense = jnp.zeros((size,), values.dtype).at[indices].add(values, mode="drop")
    (l_idx, l_val), (r_idx, r_val) = ring_neighbours((indices, values), axis_name)
    if axis_size(axis_name) == 1:
        return dense, jnp.float32(0)
    wide = jnp.promote_types(values.dtype, jnp.float32)
    w_self, w_left, w_right = (jnp.asarray(v, wide) for v in w)
    # One scatter of both neighbours' pairs onto the weighted own message.
    pairs = jnp.concatenate([w_left * l_val.astype(wide), w_right * r_val.astype(wide)])
    own = w_self * dense.astype(wide)
    mixed = own.at[jnp.concatenate([l_idx, r_idx])].add(pairs, mode="drop")
    return mixed.astype(values.dtype), jnp.float32(
        2 * (array_nbytes(indices) + array_nbytes(values))
    )
