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

Layout of the code: this module is the sparsifiers' one entry point
(:func:`exchange`, :func:`choose_exchange` for ``"auto"``, the tables of
exchange names and their checks) and re-exports the exchanges, which live by
job: :mod:`jaxcomp.comm.sparse_pairs` (the message, :class:`Exchanged` and
the arithmetic on pairs), :mod:`jaxcomp.comm.topk_allreduce` (gTop-k and
Ok-Topk, which select) and :mod:`jaxcomp.comm.exact_allreduce` (SparCML,
ScaleCom's cyclic leader and the sparse reduce-scatter, which do not).
"""

from __future__ import annotations

import jax.numpy as jnp

from jaxcomp.comm.collectives import (
    EXCHANGE_ALIASES,
    INDEX_ITEMSIZE,
    allgather_bytes,
    allreduce_bytes,
    axis_size,
    canonical_exchange,
)
from jaxcomp.comm.exact_allreduce import (
    cyclic_mean,
    scatter_capacity,
    scatter_mean,
    scatter_mean_segments,
    sparcml_mean,
    sparcml_union_capacity,
)
from jaxcomp.comm.sparse_pairs import Exchanged, check_power_of_two, is_power_of_two
from jaxcomp.comm.topk_allreduce import (
    BINS_PER_DEVICE,
    OKTOPK_SLACK,
    gtopk_mean,
    gtopk_mean_segments,
    gtopk_rounds,
    oktopk_capacities,
    oktopk_mean,
    oktopk_mean_segments,
    oktopk_wire_bytes,
)

__all__ = [
    "EXACT_EXCHANGES",
    "EXCHANGES",
    "EXCHANGE_ALIASES",
    "INCLUDE_EXCHANGES",
    "OKTOPK_SLACK",
    "POWER_OF_TWO_EXCHANGES",
    "Exchanged",
    "canonical_exchange",
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

# Histogram bins per device of Ok-Topk's region balancing (read by tests and benchmarks).
_BINS_PER_DEVICE = BINS_PER_DEVICE


def check_device_count(exchange: str, n_dev: int) -> None:
    """Refuses a device count ``exchange`` cannot run on, before anything is traced.

    The check the exchange itself makes when it is traced inside ``shard_map``
    (:data:`POWER_OF_TWO_EXCHANGES` pair devices by recursive doubling), for
    a run that knows its device count up front: its message, earlier.

    Raises:
      ValueError: ``n_dev`` is not a device count ``exchange`` runs on.

    Example:
      >>> check_device_count("gtopk", 8)  # fine
      >>> check_device_count("allgather", 3)  # any count
      >>> try:
      ...     check_device_count("gtopk", 3)
      ... except ValueError as e:
      ...     print(str(e)[:60])
      exchange='gtopk' pairs devices by recursive doubling and nee
    """
    if canonical_exchange(exchange) in POWER_OF_TWO_EXCHANGES:
        check_power_of_two(exchange, n_dev)


# ---------------------------------------------------------------------------
# One entry point for the sparsifiers.
# ---------------------------------------------------------------------------

# Values of the sparsifiers' ``exchange`` argument, canonical names
# (docs/vocabulary.md); :data:`EXCHANGE_ALIASES` holds the older spellings
# still accepted ("sparse" for "allgather").
EXCHANGES = (
    "auto",
    "auto_topk",
    "allgather",
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
EXACT_EXCHANGES = ("allgather", "dense", "server", "sparcml")
# Exchanges that take ``include=`` (backup workers): the mean over the included
# devices. The server and SparCML divide by N, so they reject it.
INCLUDE_EXCHANGES = ("allgather", "dense")


def check_include(name: str) -> None:
    """Raises ValueError unless exchange ``name`` takes ``include=`` (backup workers).

    Only :data:`INCLUDE_EXCHANGES` (and ``"auto"``, which picks one of them)
    average over the included devices; the others divide by every device or
    mix neighbours.

    Example:
      >>> check_include("allgather")  # takes it (so does its alias "sparse")
      >>> check_include("gtopk")
      Traceback (most recent call last):
          ...
      ValueError: exchange='gtopk' does not take include= (backup workers): ...
    """
    if canonical_exchange(name) not in (*INCLUDE_EXCHANGES, "auto"):
        raise ValueError(
            f"exchange={name!r} does not take include= (backup workers): only "
            f"{INCLUDE_EXCHANGES} (and 'auto') average over the included devices"
        )


def choose_exchange(
    name: str, capacity: int, size: int, itemsize: int, n_dev: int, *, index_itemsize: int = 4
) -> str:
    """The exchange ``"auto"`` / ``"auto_topk"`` stand for (static, from sizes and ``N``).

    ``"auto"`` keeps the exact mean: the all-gather of the pairs
    (``"allgather"``) when it moves
    fewer bytes than a dense all-reduce at full capacity
    (:func:`jaxcomp.comm.prefer_sparse`), else dense. (SparCML is exact too
    but is never cheaper at full capacity; it pays only when the devices
    send well below capacity, which is known per step, not statically: ask
    for it by name.) ``"auto_topk"`` also considers the exchanges that apply
    a global top of the sum instead of the union (``gtopk``, ``oktopk``) and
    takes the fewest bytes per device (ties: the exact one). Other names are
    returned as their canonical name (``"sparse"`` as ``"allgather"``).

    Example:
      >>> from jaxcomp.comm.sparse_allreduce import choose_exchange
      >>> [choose_exchange("auto", 4195, 2**22, 4, n) for n in (8, 2048)]
      ['allgather', 'dense']
      >>> [choose_exchange("auto_topk", 4195, 2**22, 4, n) for n in (2, 8, 32)]
      ['allgather', 'oktopk', 'oktopk']
    """
    from jaxcomp.comm.collectives import prefer_sparse  # noqa: PLC0415 (same package)

    name = canonical_exchange(name)
    if name not in ("auto", "auto_topk"):
        return name
    if n_dev <= 1:
        return "dense"
    pair = index_itemsize + itemsize
    costs = {"dense": allreduce_bytes(size * itemsize, n_dev)}
    if prefer_sparse(capacity, size, itemsize, n_dev, index_itemsize=index_itemsize):
        costs["allgather"] = allgather_bytes(capacity * pair, n_dev)
    if name == "auto_topk":
        if is_power_of_two(n_dev):
            costs["gtopk"] = gtopk_rounds(n_dev) * capacity * pair
        costs["oktopk"] = oktopk_wire_bytes(capacity, n_dev, itemsize)
    order = ["allgather", "dense", "gtopk", "oktopk"]  # ties: the exact one first
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
    sum_dtype=None,
    servers: int = 1,
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
      name: one of :data:`EXCHANGES` except ``"scalecom"`` (or an alias of
        :data:`EXCHANGE_ALIASES`).
      indices, values, size, axis_name: the message (see the module docstring).
      dense: optional, this device's message scattered into ``[size]``.
      include: backup-worker flag (only :data:`INCLUDE_EXCHANGES` take it).
      sum_dtype: ``"allgather"``, ``"dense"`` and ``"auto"`` only: the dtype
        the mean is returned in, the all-gather's sum computed in it (see
        :func:`jaxcomp.comm.sparse_mean`). ``indices`` may be 16-bit
        (``uint16``) for those three when ``size < 2^16``.
      servers: ``"server"`` only: the size of the group of parameter
        servers, by key range (:func:`jaxcomp.comm.server_sparse_mean`).

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
    name = choose_exchange(
        name, indices.shape[0], size, jnp.dtype(values.dtype).itemsize, n_dev,
        index_itemsize=jnp.dtype(indices.dtype).itemsize,
    )  # fmt: skip
    if name in ("allgather", "dense"):
        return Exchanged(
            *collectives.exchange_mean(
                indices, values, size, axis_name, exchange=name, dense=dense, include=include,
                sum_dtype=sum_dtype,
            )
        )  # fmt: skip
    if sum_dtype is not None or jnp.dtype(indices.dtype) != jnp.int32:
        raise ValueError(
            f"exchange {name!r} sends int32 indices and adds in the values' dtype: "
            "sum_dtype and 16-bit indices need 'allgather', 'dense' or 'auto'"
        )
    if name == "server":
        return Exchanged(
            *collectives.server_sparse_mean(indices, values, size, axis_name, servers=servers)
        )
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
