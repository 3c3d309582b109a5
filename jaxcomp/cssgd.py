"""CSSGD: coded synchronous SGD (redundant data assignment, coded multicast exchange).

The CSSGD paper (Li et al., Computer Engineering 2021) applies coded
distributed computing to data-parallel SGD. With ``n`` workers and
redundancy ``r``:

* **Assignment** (Algorithm 2, :func:`assign_blocks`): each mini-batch is
  split into ``Q = C(n, r)`` blocks; block ``q`` goes to the ``q``-th
  ``r``-subset of workers (``itertools.combinations`` order). Every block
  lives on exactly ``r`` workers and each worker holds ``C(n-1, r-1)``
  blocks (``r / n`` of the batch: ``r`` times the compute of plain data
  parallelism).
* **Encoding** (Algorithm 3): every worker computes one gradient per block it
  holds. For each ``(r+1)``-subset ``S`` of workers and each ``j`` in ``S``,
  the block of ``S \\ {j}`` is missing at ``j`` and held by the ``r`` others.
  Its gradient is split into ``r`` segments; member ``k`` of ``S`` owns
  segment ``pos(k)``, its position in the sorted block subset, and sends *one*
  multicast packet to ``S \\ {k}``: the sum of its segments of the ``r``
  blocks ``S \\ {j}``, ``j != k``.
* **Decoding** (Algorithm 4): receiver ``j`` subtracts from each packet the
  ``r - 1`` segments it knows (blocks containing ``j``); what remains is one
  segment of its missing block, and the ``r`` senders of ``S`` deliver all
  ``r`` segments. Over all ``S`` containing ``j`` it recovers every missing
  block and sums all ``Q`` block gradients: the same global gradient as
  plain synchronous SGD.
* **Integers** so that coded sums invert exactly: values are quantized to
  ``bits``-bit integers over ``[-value_range, value_range]`` (paper: int32
  over ``[-10, 10]``, end points ``0x80000001`` / ``0x7FFFFFFF``; here
  ``0x80000080`` / ``0x7FFFFF80 = 2^31 - 128``: quantization rounds and clips
  in float32, which holds neither of the paper's end points (they round to
  ``-2^31`` and to ``2^31``, outside int32), and ``2^31 - 128`` is the largest
  float32 below ``2^31``), packets are summed and decoded with wrap-around
  (modular) integer arithmetic, which inverts exactly whatever the sums.
  Values outside the range are clipped and counted (never wrapped);
  non-finite values make the whole step's gradient NaN (counted too), as
  they would in plain SGD.

Communication, in units of ``n C(n, r)`` block gradients (every worker's
share of every block), summed over workers (:func:`coded_load`,
:func:`uncoded_load`): coded ``(1/r)(1 - r/n)`` against ``1 - r/n`` for the
uncoded exchange of the same assignment (each missing block sent whole,
unicast, by one holder). A *block* gradient is a full model gradient, and
there are ``C(n, r)`` of them, so in bytes per worker the coded exchange
sends ``C(n-1, r) / r`` gradients: 7 on 8 workers at ``r = 1`` (an
all-to-all of whole gradients), 10.5 at ``r = 2``, 11.7 at ``r = 3``, 8.75 at
``r = 4``, 0.14 at ``r = 7``, where a ring all-reduce of plain data-parallel
gradients sends ``2 (n-1)/n < 2``. :func:`bytes_per_worker` gives the
numbers; docs/cssgd.md says where CSSGD wins.

On a device mesh (inside ``shard_map``) the multicast is emulated by an
``all_gather`` of every worker's packets (a broadcast medium); the byte
counts charge what a real multicast sends: each packet once by its sender
(``sent_bytes``), and once per receiver (``received_bytes``).

Example:
  >>> from jaxcomp import cssgd
  >>> a = cssgd.assign_blocks(4, 2)
  >>> a.subsets[:3], a.worker_blocks[0]
  (((0, 1), (0, 2), (0, 3)), (0, 1, 2))
  >>> float(cssgd.coded_load(4, 2)), float(cssgd.uncoded_load(4, 2))
  (0.25, 0.5)
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import weakref
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp.comm import collectives
from jaxcomp.comm import local as local_lib
from jaxcomp.distributed.grads import per_device_value_and_grad
from jaxcomp.distributed.skeleton import device_slice, device_stack, jit_step, shard_step

__all__ = [
    "BITS",
    "EXCHANGES",
    "ROUNDINGS",
    "Assignment",
    "CodedConfig",
    "CodedState",
    "CodedStats",
    "assign_blocks",
    "best_redundancy",
    "block_batch",
    "bytes_per_worker",
    "coded_load",
    "coded_mean",
    "dequantize",
    "init_opt_state",
    "make_train_step",
    "quantize",
    "shard_block_batch",
    "step_time",
    "uncoded_load",
]

# CodedConfig.bits: integer widths on the wire.
BITS = (8, 16, 32)
# CodedConfig.exchange: coded multicast packets, or whole missing blocks.
EXCHANGES = ("coded", "uncoded")
# CodedConfig.rounding: to nearest (the paper) or stochastic (unbiased).
ROUNDINGS = ("nearest", "stochastic")
_INT = {8: jnp.int8, 16: jnp.int16, 32: jnp.int32}


# ---------------------------------------------------------------------------
# Assignment (Algorithm 2).
# ---------------------------------------------------------------------------


def _check_nr(n, r) -> tuple[int, int]:
    n = V.check_int("n", n, 1)
    r = V.check_int("redundancy", r, 1, n)
    return n, r


class Assignment(NamedTuple):
    """Which worker holds which block (the paper's Algorithm 2).

    Attributes:
      n: workers.
      r: redundancy (workers per block).
      subsets: ``subsets[q]``, the sorted workers holding block ``q``
        (``itertools.combinations(range(n), r)`` order); ``C(n, r)`` blocks.
      worker_blocks: ``worker_blocks[k]``, the blocks worker ``k`` holds, in
        increasing order (``C(n-1, r-1)`` each).

    Example:
      >>> a = assign_blocks(3, 2)
      >>> a.subsets, a.worker_blocks  # C(3, 2) = 3 blocks, each held by 2 workers
      (((0, 1), (0, 2), (1, 2)), ((0, 1), (0, 2), (1, 2)))
    """

    n: int
    r: int
    subsets: tuple[tuple[int, ...], ...]
    worker_blocks: tuple[tuple[int, ...], ...]


@functools.lru_cache(maxsize=64)
def assign_blocks(n: int, r: int) -> Assignment:
    """Block ``q`` of every mini-batch to the ``q``-th ``r``-subset of the ``n`` workers.

    Args:
      n: workers (>= 1).
      r: redundancy, in ``[1, n]``.

    Returns:
      The :class:`Assignment`.

    Raises:
      ValueError: ``n < 1`` or ``r`` outside ``[1, n]``.

    Example:
      >>> from jaxcomp.cssgd import assign_blocks
      >>> assign_blocks(3, 2).worker_blocks
      ((0, 1), (0, 2), (1, 2))
    """
    n, r = _check_nr(n, r)
    subsets = tuple(itertools.combinations(range(n), r))
    worker_blocks = tuple(tuple(q for q, s in enumerate(subsets) if k in s) for k in range(n))
    return Assignment(n, r, subsets, worker_blocks)


# Leaves made by block_batch / shard_block_batch: id -> (weak reference, n, r).
# A layout for r and one for n - r + 1 have the same shapes (C(n-1, r-1) =
# C(n-1, n-r) blocks per worker), so make_train_step looks its blocks up here
# to reject a layout made for another redundancy; the coded sums would not
# cancel and the "mean gradient" would be silently wrong.
_LAYOUTS: dict[int, tuple[weakref.ref, int, int]] = {}


def _remember_layout(tree, n: int, r: int):
    for leaf in jax.tree.leaves(tree):
        key = id(leaf)

        def forget(ref, key=key):
            entry = _LAYOUTS.get(key)
            if entry is not None and entry[0] is ref:
                del _LAYOUTS[key]

        try:
            _LAYOUTS[key] = (weakref.ref(leaf, forget), n, r)
        except TypeError:  # not weak-referenceable: not checked
            pass
    return tree


def _check_layout(blocks, n: int, r: int) -> None:
    for leaf in jax.tree.leaves(blocks):
        entry = _LAYOUTS.get(id(leaf))
        if entry is not None and entry[0]() is leaf and (entry[1], entry[2]) != (n, r):
            raise ValueError(
                f"cssgd.make_train_step: the blocks were laid out for n={entry[1]} workers "
                f"and redundancy r={entry[2]} (shard_block_batch(..., r={entry[2]})), but the "
                f"step was built for n={n}, redundancy={r}: lay the batch out with "
                f"shard_block_batch(batch, mesh, {r}) (the block counts C(n-1, r-1) agree, "
                "the holders of each block do not)"
            )


def block_batch(batch, n: int, r: int):
    """A global mini-batch in CSSGD's layout: leaves ``(n, C(n-1, r-1), b, ...)``.

    The batch's leading axis (size ``B``) is split into ``C(n, r)``
    consecutive blocks of ``b = B / C(n, r)`` examples; worker ``k``'s row
    stacks the blocks it holds (:func:`assign_blocks`), so every example
    appears in ``r`` rows. Host-side (numpy).

    Args:
      batch: a pytree of arrays with a common leading batch axis.
      n: workers.
      r: redundancy.

    Returns:
      The pytree in the per-worker layout.

    Raises:
      ValueError: when ``B`` is not a positive multiple of ``C(n, r)`` (no
        padding: a padded example would be trained on; pick the batch size
        with ``math.comb(n, r)`` in mind, e.g. 280 serves ``n = 8``,
        ``r = 1..4``).

    Example:
      >>> import numpy as np
      >>> from jaxcomp.cssgd import block_batch
      >>> block_batch(np.arange(6), 3, 2)[:, :, 0].tolist()  # blocks of 2 examples
      [[0, 2], [0, 4], [2, 4]]
    """
    a = assign_blocks(n, r)
    q = len(a.subsets)
    leaves = jax.tree.leaves(batch)
    sizes = {np.shape(x)[0] if np.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes:
        raise ValueError(f"batch leaves must share a leading batch axis, got sizes {sizes}")
    (size,) = sizes
    if size < q or size % q:
        raise ValueError(
            f"batch size {size} must be a positive multiple of C(n, r) = C({n}, {r}) = {q} "
            "(CSSGD splits each mini-batch into one block per r-subset of workers)"
        )
    index = np.asarray(a.worker_blocks)  # (n, m)

    def layout(x):
        x = np.asarray(x)
        blocks = x.reshape(q, size // q, *x.shape[1:])
        return blocks[index]

    return _remember_layout(jax.tree.map(layout, batch), n, r)


def shard_block_batch(batch, mesh: Mesh, r: int, axis_name="data"):
    """:func:`block_batch` placed on ``mesh``, worker ``k``'s blocks on device ``k``.

    One process only (every process would need the whole global batch).

    Example:
      >>> import jax, numpy as np
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> blocks = shard_block_batch({"x": np.eye(2, dtype=np.float32)}, mesh, 1)
      >>> blocks["x"].shape  # (devices, blocks per worker, examples per block, features)
      (1, 1, 2, 2)
    """
    n = mesh.shape[axis_name]
    sharding = NamedSharding(mesh, P(axis_name))
    placed = jax.tree.map(lambda x: jax.device_put(x, sharding), block_batch(batch, n, r))
    return _remember_layout(placed, n, r)


# ---------------------------------------------------------------------------
# Quantization (the paper's int32 over [-10, 10]).
# ---------------------------------------------------------------------------


def _scale(value_range: float, bits: int) -> float:
    # The largest integer level: 0x7FFFFFFF for 32 bits, as in the paper, but
    # float32 cannot hold 2^31 - 1, so the float product is clipped to the
    # largest float32 below 2^31 (2^31 - 128) before the cast.
    return (2 ** (bits - 1) - 1) / value_range


def _min_value_range(bits: int) -> float:
    """The smallest ``value_range`` whose float32 step ``value_range / (2^(bits-1) - 1)``
    is a normal float32 (a subnormal one flushes to 0 on XLA:CPU and the scale is inf)."""
    return float((2 ** (bits - 1) - 1) * np.finfo(np.float32).tiny)


def _check_value_range(value_range, bits: int) -> float:
    value_range = V.check_real("value_range", value_range, 0, low_open=True)
    low, high = _min_value_range(bits), float(np.finfo(np.float32).max)
    if not low <= value_range <= high:
        raise ValueError(
            f"value_range must be in [{low:.4g}, {high:.4g}] for bits={bits} (its float32 "
            f"quantization step and scale must be normal, finite float32), got {value_range!r}"
        )
    return value_range


def _max_level(bits: int) -> float:
    top = 2 ** (bits - 1) - 1
    return float(np.nextafter(np.float32(top + 1), np.float32(0))) if bits == 32 else float(top)


def quantize(x, value_range: float = 10.0, bits: int = 32, key=None):
    """``x`` as ``bits``-bit integers over ``[-value_range, value_range]``.

    ``round(clip(x) * (2^(bits-1) - 1) / value_range)``, nearest, or
    stochastic (unbiased inside the range) with ``key``. Non-finite values
    map to 0 (the caller counts them).

    Returns:
      ``(q, clipped, nonfinite)``: the integers (int8/16/32), and int32
      counts of finite values outside the range and of non-finite values.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.cssgd import quantize
      >>> q, clipped, _ = quantize(jnp.array([0.5, -20.0]), value_range=1.0, bits=8)
      >>> q.tolist(), int(clipped)
      ([64, -127], 1)
    """
    if not V.is_dynamic(value_range):  # a traced range is the caller's to keep in bounds
        _check_value_range(value_range, bits)
    x = jnp.asarray(x, jnp.float32)
    finite = jnp.isfinite(x)
    outside = finite & (jnp.abs(x) > value_range)
    y = jnp.clip(jnp.where(finite, x, 0.0), -value_range, value_range) * _scale(value_range, bits)
    if key is None:
        y = jnp.round(y)
    else:
        y = jnp.floor(y + jax.random.uniform(key, y.shape, jnp.float32))
    top = _max_level(bits)
    q = jnp.clip(y, -top, top).astype(_INT[bits])
    count = lambda m: jnp.sum(m, dtype=jnp.int32)  # noqa: E731
    return q, count(outside), count(~finite)


def dequantize(q, value_range: float = 10.0, bits: int = 32):
    """The float32 values of :func:`quantize`'s integers.

    Example:
      >>> import jax.numpy as jnp
      >>> dequantize(jnp.array([127, -127, 0]), value_range=2.0, bits=8).tolist()
      [2.0, -2.0, 0.0]
    """
    if not V.is_dynamic(value_range):
        _check_value_range(value_range, bits)
    return q.astype(jnp.float32) / jnp.float32(_scale(value_range, bits))


# ---------------------------------------------------------------------------
# The coding plan: static index tables per worker.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Index tables of the coded and uncoded exchanges (numpy, per worker)."""

    n: int
    r: int
    blocks: int  # Q = C(n, r)
    own: np.ndarray  # (n, m) global ids of each worker's blocks
    missing: np.ndarray  # (n, M) global ids of its missing blocks, M = C(n-1, r)
    send: np.ndarray  # (n, M, r, 2): per packet, (own-local block, segment) summed
    recv_src: np.ndarray  # (n, M, r, 2): per missing block and segment, (sender, packet)
    recv_known: np.ndarray  # (n, M, r, r-1, 2): (own-local block, segment) to subtract
    uncoded_src: np.ndarray  # (n, M, 2): per missing block, (sender, sender-local block)
    uncoded_sends: np.ndarray  # (n,) whole blocks each worker sends uncoded


@functools.lru_cache(maxsize=64)
def _plan(n: int, r: int) -> _Plan:
    a = assign_blocks(n, r)
    block_of = {s: q for q, s in enumerate(a.subsets)}
    local = [{q: i for i, q in enumerate(a.worker_blocks[k])} for k in range(n)]
    m_missing = math.comb(n - 1, r)
    groups = list(itertools.combinations(range(n), r + 1))
    # Packets of worker k: one per (r+1)-subset containing k, in order.
    packet_of = [{} for _ in range(n)]
    send = np.zeros((n, m_missing, r, 2), np.int32)
    for k in range(n):
        for p, s in enumerate(g for g in groups if k in g):
            packet_of[k][s] = p
            others = [j for j in s if j != k]
            for t, j in enumerate(others):
                block = tuple(w for w in s if w != j)  # missing at j, held by k
                send[k, p, t] = (local[k][block_of[block]], block.index(k))
    missing = np.zeros((n, m_missing), np.int32)
    recv_src = np.zeros((n, m_missing, r, 2), np.int32)
    recv_known = np.zeros((n, m_missing, r, max(r - 1, 0), 2), np.int32)
    uncoded_src = np.zeros((n, m_missing, 2), np.int32)
    uncoded_sends = np.zeros((n,), np.int64)
    for j in range(n):
        outside = [s for s in a.subsets if j not in s]
        for i, block in enumerate(outside):  # block = S \ {j}
            s = tuple(sorted((*block, j)))
            missing[j, i] = block_of[block]
            for seg, k in enumerate(block):  # sender k owns segment pos(k) = seg
                recv_src[j, i, seg] = (k, packet_of[k][s])
                known = [tuple(w for w in s if w != jj) for jj in s if jj not in (k, j)]
                for t, kb in enumerate(known):  # blocks holding j: j knows them
                    recv_known[j, i, seg, t] = (local[j][block_of[kb]], kb.index(k))
            # Uncoded: the missing block sent whole by one holder, spread evenly.
            non_holders = [w for w in range(n) if w not in block]
            sender = block[non_holders.index(j) % r]
            uncoded_src[j, i] = (sender, local[sender][block_of[block]])
            uncoded_sends[sender] += 1
    own = np.asarray(a.worker_blocks, np.int32).reshape(n, -1)
    return _Plan(
        n, r, len(a.subsets), own, missing, send, recv_src, recv_known, uncoded_src, uncoded_sends
    )


# ---------------------------------------------------------------------------
# Loads, bytes and the time model.
# ---------------------------------------------------------------------------


def coded_load(n: int, r: int) -> Fraction:
    """The paper's coded load ``(1/r)(1 - r/n)``: bytes sent by all workers over ``n C(n,r) G``.

    Example:
      >>> coded_load(4, 2)  # (1/2)(1 - 2/4)
      Fraction(1, 4)
    """
    n, r = _check_nr(n, r)
    return Fraction(1, r) * (1 - Fraction(r, n))


def uncoded_load(n: int, r: int) -> Fraction:
    """The uncoded load ``1 - r/n`` of the same assignment (whole blocks, unicast).

    Example:
      >>> uncoded_load(4, 2)  # 1 - 2/4
      Fraction(1, 2)
    """
    n, r = _check_nr(n, r)
    return 1 - Fraction(r, n)


def _segment(size: int, r: int) -> int:
    return -(-size // r)


def bytes_per_worker(n: int, r: int, size: int, bits: int = 32) -> dict:
    """Bytes one worker sends and receives per step, and the baselines'.

    Args:
      n: workers.
      r: redundancy.
      size: elements of one gradient.
      bits: integer width on the wire.

    Returns:
      ``{"coded_sent", "coded_received", "uncoded_sent" (mean over workers),
      "uncoded_received", "allreduce_sent"}``: bytes; the last is a ring
      all-reduce of the float32 gradient without redundancy (``r = 1``
      compute), the practical baseline. Coded segments are ``ceil(size / r)``
      elements (the last padded).

    Example:
      >>> from jaxcomp.cssgd import bytes_per_worker
      >>> b = bytes_per_worker(8, 2, 1000)
      >>> b["coded_sent"] / 4000, b["uncoded_sent"] / 4000, b["allreduce_sent"] / 4000
      (10.5, 21.0, 1.75)
    """
    n, r = _check_nr(n, r)
    size = V.check_int("size", size, 1)
    item = V.check_choice("bits", bits, BITS) // 8
    m_missing = math.comb(n - 1, r)
    return {
        "coded_sent": m_missing * _segment(size, r) * item,
        "coded_received": m_missing * r * _segment(size, r) * item,
        "uncoded_sent": m_missing * size * item,
        "uncoded_received": m_missing * size * item,
        "allreduce_sent": collectives.allreduce_bytes(4 * size, n),
    }


def step_time(t_calc: float, t_comm: float, r: int) -> float:
    """The paper's per-batch time model ``T = r * T_calc + T_comm / r``.

    ``T_calc``: one worker's compute on its ``1/n`` share (``r = 1``);
    ``T_comm``: the exchange time at ``r = 1``.

    Example:
      >>> step_time(t_calc=1.0, t_comm=8.0, r=2)  # 2 * 1 + 8 / 2
      6.0
    """
    t_calc = V.check_real("t_calc", t_calc, 0)
    t_comm = V.check_real("t_comm", t_comm, 0)
    r = V.check_int("redundancy", r, 1)
    return r * t_calc + t_comm / r


def best_redundancy(t_calc: float, t_comm: float, n: int) -> int:
    """The ``r`` in ``[1, n - 1]`` minimising :func:`step_time` (ties: the smallest).

    Example:
      >>> from jaxcomp.cssgd import best_redundancy
      >>> best_redundancy(1.0, 9.0, 8), best_redundancy(1.0, 0.5, 8)
      (3, 1)
    """
    n = V.check_int("n", n, 2)
    return min(range(1, n), key=lambda r: (step_time(t_calc, t_comm, r), r))


# ---------------------------------------------------------------------------
# The exchange, inside shard_map.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CodedConfig:
    """Static settings of the coded exchange.

    Attributes:
      redundancy: ``r``, workers per block, in ``[1, n]``.
      value_range: quantization range ``[-value_range, value_range]``, at
        least ``(2^(bits-1) - 1) * 2^-126`` (about 2.5e-29 for 32 bits: the
        float32 step must be a normal number) and at most float32's max.
      bits: integer width on the wire, 8, 16 or 32 (the paper: 32).
      rounding: ``"nearest"`` (the paper) or ``"stochastic"`` (unbiased).
      exchange: ``"coded"`` (multicast packets) or ``"uncoded"`` (whole
        missing blocks, the paper's comparison).

    Example:
      >>> cfg = CodedConfig(redundancy=2, bits=16)
      >>> cfg.redundancy, cfg.value_range, cfg.rounding, cfg.exchange
      (2, 10.0, 'nearest', 'coded')
    """

    redundancy: int
    value_range: float = 10.0
    bits: int = 32
    rounding: str = "nearest"
    exchange: str = "coded"

    def __post_init__(self):
        V.check_int("redundancy", self.redundancy, 1)
        V.check_choice("bits", self.bits, BITS)
        _check_value_range(self.value_range, self.bits)
        V.check_choice("rounding", self.rounding, ROUNDINGS)
        V.check_choice("exchange", self.exchange, EXCHANGES)


class CodedStats(NamedTuple):
    """What one coded exchange did on this device (int32 counts, float32 bytes).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> cfg = CodedConfig(redundancy=1, value_range=1.0)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda g: coded_mean(g, cfg, "data")[1], mesh=mesh, in_specs=P(), out_specs=P()))
      >>> stats = f(jnp.array([[0.5, -3.0]]))  # -3 is outside [-1, 1]
      >>> int(stats.clipped), int(stats.nonfinite)
      (1, 0)
    """

    clipped: jax.Array
    nonfinite: jax.Array
    sent_bytes: jax.Array
    received_bytes: jax.Array


def _exchange_blocks(q_own, plan: _Plan, exchange: str, axis_name):
    """This device's decoded missing blocks' integers, ``(C(n-1, r), G)``."""
    k = lax.axis_index(axis_name)
    m, size = q_own.shape
    r = plan.r
    if exchange == "uncoded" or plan.missing.shape[1] == 0:
        if plan.missing.shape[1] == 0:
            received = q_own[:0]
        else:
            everyone = lax.all_gather(q_own, axis_name)  # (n, m, G)
            src = jnp.asarray(plan.uncoded_src)[k]
            received = everyone[src[:, 0], src[:, 1]]
    else:
        seg = _segment(size, r)
        padded = jnp.pad(q_own, ((0, 0), (0, seg * r - size))).reshape(m, r, seg)
        send = jnp.asarray(plan.send)[k]  # (M, r, 2)
        # One packet per (r+1)-subset: the wrap-around sum of r segments.
        packets = jnp.sum(padded[send[..., 0], send[..., 1]], axis=1, dtype=q_own.dtype)
        everyone = lax.all_gather(packets, axis_name)  # (n, M, seg): the broadcast medium
        src = jnp.asarray(plan.recv_src)[k]  # (M, r, 2)
        got = everyone[src[..., 0], src[..., 1]]  # (M, r, seg)
        if r > 1:
            known = jnp.asarray(plan.recv_known)[k]  # (M, r, r-1, 2)
            got = got - jnp.sum(padded[known[..., 0], known[..., 1]], axis=2, dtype=q_own.dtype)
        received = got.reshape(-1, r * seg)[:, :size]
    return received


def _all_blocks(q_own, received, plan: _Plan, axis_name):
    """Every block's integers in block order, ``(Q, G)`` (tests: ``return_blocks``)."""
    k = lax.axis_index(axis_name)
    ids = jnp.concatenate([jnp.asarray(plan.own)[k], jnp.asarray(plan.missing)[k]])
    blocks = jnp.concatenate([q_own, received])
    return jnp.zeros_like(blocks).at[ids].set(blocks, unique_indices=True)


def _exact_sum(q_own, received):
    """The sum of all blocks' integers as float32, the same on every device.

    Integer sums do not depend on the order of the terms, so each device adds
    its own and its decoded blocks in whatever order it holds them. An int32
    sum of ``Q`` values could overflow, so 32-bit values are split into a
    signed high and an unsigned low 16-bit half, each summed exactly in
    int32, and joined once in float32 (one rounding).
    """
    q = jnp.concatenate([q_own, received]).astype(jnp.int32)
    if q_own.dtype != jnp.int32:  # 8 or 16 bits: Q * 2^15 fits in int32
        return jnp.sum(q, axis=0).astype(jnp.float32)
    hi = jnp.sum(q >> 16, axis=0)
    lo = jnp.sum(q & 0xFFFF, axis=0)
    return hi.astype(jnp.float32) * 65536.0 + lo.astype(jnp.float32)


def _byte_counts(plan: _Plan, size: int, cfg: CodedConfig, axis_name):
    item = cfg.bits // 8
    m_missing = plan.missing.shape[1]
    if cfg.exchange == "coded":
        seg = _segment(size, plan.r)
        sent = jnp.float32(m_missing * seg * item)
        received = jnp.float32(m_missing * plan.r * seg * item)
    else:
        per_worker = jnp.asarray(plan.uncoded_sends * size * item, jnp.float32)
        sent = per_worker[lax.axis_index(axis_name)]
        received = jnp.float32(m_missing * size * item)
    return sent, received


def _check_config(cfg) -> None:
    if not isinstance(cfg, CodedConfig):
        raise ValueError(
            f"cfg must be a jaxcomp.cssgd.CodedConfig (e.g. CodedConfig(redundancy=2)), got {cfg!r}"
        )


def coded_mean(block_grads, cfg: CodedConfig, axis_name, key=None, *, return_blocks=False):
    """The mean of all blocks' gradients, exchanged by coded multicast (inside ``shard_map``).

    Args:
      block_grads: this device's gradients of the blocks it holds, a pytree
        whose leaves have a leading axis of ``C(n-1, r-1)`` blocks (in
        :func:`assign_blocks` order; :func:`block_batch` lays data out so).
      cfg: the :class:`CodedConfig`.
      axis_name: the mesh axis of the ``n`` workers.
      key: PRNG key for ``rounding="stochastic"`` (ignored otherwise); the
        same on every device (each block's noise is drawn from
        ``fold_in(key, block id)``, so its ``r`` holders round it alike).
      return_blocks: also return the ``(C(n, r), G)`` integers of every block
        as this device decoded them (tests).

    Returns:
      ``(mean, stats)``: the mean over the ``C(n, r)`` blocks, a pytree like
      one block's gradient (float leaves in their dtype; identical on every
      device), and :class:`CodedStats`; with ``return_blocks`` a third item.

    Raises:
      ValueError: redundancy above the axis size, or leaves whose leading
        axis is not ``C(n-1, r-1)``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> cfg = CodedConfig(redundancy=1)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda g: coded_mean(g, cfg, "data")[0], mesh=mesh, in_specs=P(), out_specs=P()))
      >>> f(jnp.array([[0.5, -1.0]])).tolist()  # one worker, one block: its gradient
      [0.5, -1.0]
    """
    _check_config(cfg)
    n = collectives.axis_size(axis_name)
    if cfg.redundancy > n:
        raise ValueError(
            f"redundancy must be an integer in [1, {n}] (the {n} devices of {axis_name!r}), "
            f"got {cfg.redundancy}"
        )
    plan = _plan(n, cfg.redundancy)
    m = plan.own.shape[1]
    leaves, treedef = jax.tree.flatten(block_grads)
    for x in leaves:
        if jnp.ndim(x) < 1 or jnp.shape(x)[0] != m:
            raise ValueError(
                f"coded_mean: every leaf needs a leading axis of C(n-1, r-1) = {m} blocks "
                f"(n={n}, r={cfg.redundancy}), got shape {jnp.shape(x)}"
            )
    flat = jnp.concatenate([jnp.reshape(x, (m, -1)).astype(jnp.float32) for x in leaves], axis=1)
    size = flat.shape[1]
    if cfg.rounding == "stochastic":
        if key is None:
            raise ValueError("coded_mean: rounding='stochastic' needs key=")
        # The r holders of a block must round it identically, or the coded
        # sums would not cancel: the noise depends on the block, not the device.
        ids = jnp.asarray(plan.own)[lax.axis_index(axis_name)]
        keys = jax.vmap(lambda q: jax.random.fold_in(key, q))(ids)
        q, clipped, nonfinite = jax.vmap(lambda x, k: quantize(x, cfg.value_range, cfg.bits, k))(
            flat, keys
        )
        clipped, nonfinite = jnp.sum(clipped), jnp.sum(nonfinite)
    else:
        q, clipped, nonfinite = quantize(flat, cfg.value_range, cfg.bits)
    received = _exchange_blocks(q, plan, cfg.exchange, axis_name)
    total = _exact_sum(q, received)
    denom = _scale(cfg.value_range, cfg.bits) * plan.blocks
    if denom <= float(np.finfo(np.float32).max):
        total = total / jnp.float32(denom)
    else:  # a small value_range times many blocks: inf in float32, so in two steps
        # (the barrier keeps XLA from folding (a / b) / c back into a / (b * c)).
        total = lax.optimization_barrier(total / jnp.float32(_scale(cfg.value_range, cfg.bits)))
        total = total / jnp.float32(plan.blocks)
    # A NaN or Inf anywhere makes the step's gradient NaN, as plain SGD's would be.
    any_nonfinite = lax.psum(nonfinite, axis_name) > 0
    total = jnp.where(any_nonfinite, jnp.nan, total)
    out, start = [], 0
    for x in leaves:
        shape = jnp.shape(x)[1:]
        count = math.prod(shape)
        out.append(total[start : start + count].reshape(shape).astype(x.dtype))
        start += count
    sent_bytes, received_bytes = _byte_counts(plan, size, cfg, axis_name)
    stats = CodedStats(clipped, nonfinite, sent_bytes, received_bytes)
    mean = jax.tree.unflatten(treedef, out)
    if return_blocks:
        return mean, stats, _all_blocks(q, received, plan, axis_name)
    return mean, stats


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------


class CodedState(NamedTuple):
    """The coded exchange's per-device state (the first part of the optimizer state).

    Attributes:
      clipped: finite gradient values clipped to the range so far (int32).
      nonfinite: non-finite gradient values seen so far (int32).
      key: PRNG key data of stochastic rounding, the same on every device.
      wire_bytes: bytes this device sent in the last step (multicast
        accounting; counted into ``metrics["wire_bytes"]``).
      received_bytes: bytes it received in the last step.
    """

    clipped: jax.Array
    nonfinite: jax.Array
    key: jax.Array
    wire_bytes: jax.Array
    received_bytes: jax.Array


def init_opt_state(tx: optax.GradientTransformation, params, mesh: Mesh, axis_name="data", seed=0):
    """``(CodedState, tx state)`` per device, stacked along ``axis_name``.

    ``tx`` is the optimizer applied to the exchanged mean gradient (e.g.
    ``optax.sgd(0.1, momentum=0.9)``); it must not communicate (see
    :func:`make_train_step`).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> params = dist.replicate(jnp.zeros(2), mesh)
      >>> coded, tx_state = init_opt_state(optax.sgd(0.1), params, mesh)
      >>> coded.clipped.shape, coded.key.shape  # a leading axis of one entry per device
      ((1,), (1, 2))
    """
    from jaxcomp import distributed  # noqa: PLC0415 (distributed imports comm)

    tx_state = distributed.init_opt_state(tx, params, mesh, axis_name)
    n = mesh.shape[axis_name]
    zeros = np.zeros((n,), np.int32)
    # One key on every device: a block's holders must round it alike.
    key = np.asarray(jax.random.key_data(jax.random.key(seed)))
    coded = CodedState(
        zeros,
        zeros,
        np.repeat(key[None], n, axis=0),
        np.zeros((n,), np.float32),
        np.zeros((n,), np.float32),
    )
    coded = distributed.shard_batch(coded, mesh, axis_name)
    return coded, tx_state


def _check_local(tx, params, axis_name, state) -> None:
    """Rejects a ``tx`` that communicates: the mean gradient is already exchanged."""

    def probe(p, s):
        return tx.update(p, s, p)

    jaxpr = jax.make_jaxpr(probe)(params, state)
    if local_lib.communicates(jaxpr.jaxpr):
        raise ValueError(
            "cssgd.make_train_step: tx communicates over the mesh (a compressor with "
            f"axis_name={axis_name!r}?). The coded exchange already gives every device the "
            "exact mean gradient; a sparsifier's per-block supports or a quantizer's "
            "per-block scales cannot be summed inside coded packets, so compressing before "
            "the coded exchange is not supported, and exchanging again after it is waste. "
            "Use a local optimizer (optax.sgd, ...), or bits=8/16 to quantize the coded "
            "exchange itself."
        )


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    cfg: CodedConfig,
    axis_name="data",
    *,
    donate: bool = True,
    communicate: bool = True,
) -> Callable:
    """A jitted CSSGD train step: per-block gradients, coded exchange, ``tx``.

    Each device computes the gradient of ``loss_fn`` (the mean loss of a
    batch) on each of its ``C(n-1, r-1)`` blocks, the coded exchange gives
    every device the mean over all ``C(n, r)`` blocks (the gradient of the
    whole mini-batch, quantized), and ``tx`` turns it into the update of the
    replicated parameters.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``.
      tx: a local optax optimizer (no collectives: checked when the step is
        first traced, ``ValueError`` otherwise).
      mesh: the device mesh; its ``axis_name`` size is ``n``.
      cfg: :class:`CodedConfig` (redundancy, range, bits, rounding, exchange).
      axis_name: the workers' mesh axis.
      donate: donate parameters and state.
      communicate: ``False`` replaces every collective of the step by a local
        stand-in of the same shapes (:func:`jaxcomp.comm.without_communication`),
        to time the step without its communication (not a training step).

    Returns:
      ``step(params, opt_state, blocks) -> (params, opt_state, metrics)``
      with ``opt_state`` from :func:`init_opt_state`, ``blocks`` from
      :func:`shard_block_batch` with this ``cfg.redundancy`` (blocks it or
      :func:`block_batch` made for another ``n`` or ``r`` raise a
      ``ValueError``; the shapes cannot tell ``r`` from ``n - r + 1``, and
      blocks made otherwise are not checked), and ``metrics``: ``loss`` (mean over all
      blocks), ``wire_bytes`` and ``received_bytes`` (per device, mean over
      devices), ``clipped`` and ``nonfinite`` (this step, summed over devices).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from jaxcomp import cssgd, distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> cfg = cssgd.CodedConfig(redundancy=1)
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> params = dist.replicate(jnp.zeros(2), mesh)
      >>> state = cssgd.init_opt_state(optax.sgd(0.1), params, mesh)
      >>> step = cssgd.make_train_step(loss, optax.sgd(0.1), mesh, cfg)
      >>> blocks = cssgd.shard_block_batch({"x": np.eye(2, dtype=np.float32),
      ...                                   "y": np.ones(2, np.float32)}, mesh, 1)
      >>> params, state, metrics = step(params, state, blocks)
      >>> float(metrics["loss"])
      1.0
    """
    _check_config(cfg)
    n = mesh.shape[axis_name]
    if cfg.redundancy > n:
        raise ValueError(
            f"redundancy must be an integer in [1, {n}] (the mesh's {axis_name!r} axis), "
            f"got {cfg.redundancy}"
        )
    step = _CodedStepConfig(
        tx=tx,
        code=cfg,
        axis_name=axis_name,
        n=n,
        value_and_grad=per_device_value_and_grad(loss_fn, axis_name),
    )
    # The decoded mean is identical on every device (integer decoding, same
    # program) but typed varying after the all-gather (shard_step's check_vma=False).
    sharded = shard_step(
        functools.partial(_coded_per_device, step),
        mesh,
        in_specs=(P(), P(axis_name), P(axis_name)),
        out_specs=(P(), P(axis_name), P()),
        communicate=communicate,
    )
    return jit_step(
        sharded,
        donate_argnums=(0, 1) if donate else (),
        arguments=functools.partial(_coded_arguments, step),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _CodedStepConfig:
    """The validated static options of one :func:`make_train_step` step."""

    tx: optax.GradientTransformation
    code: CodedConfig
    axis_name: object
    n: int  # devices along axis_name
    value_and_grad: Callable  # per-device (loss, grads) of loss_fn


def _coded_arguments(step: _CodedStepConfig, params, opt_state, blocks):
    """The step's arguments, the blocks' layout checked against ``n`` and the redundancy."""
    _check_layout(blocks, step.n, step.code.redundancy)
    return params, opt_state, blocks


def _coded_per_device(step: _CodedStepConfig, params, opt_state, blocks):
    """One device's step inside ``shard_map``: block gradients, coded mean, ``tx``."""
    tx, axis_name = step.tx, step.axis_name
    coded, state = device_slice(opt_state)
    local_blocks = device_slice(blocks)
    _check_local(tx, params, axis_name, state)
    losses, block_grads = jax.vmap(step.value_and_grad, in_axes=(None, 0))(params, local_blocks)
    key = jax.random.wrap_key_data(coded.key)
    key, use = jax.random.split(key)
    mean, stats = coded_mean(block_grads, step.code, axis_name, use)
    updates, state = tx.update(mean, state, params)
    params = optax.apply_updates(params, updates)
    coded = CodedState(
        coded.clipped + stats.clipped,
        coded.nonfinite + stats.nonfinite,
        jax.random.key_data(key),
        stats.sent_bytes,
        stats.received_bytes,
    )
    # Each device's blocks are C(n-1, r-1) of the C(n, r); every block on r devices.
    metrics = {
        "loss": lax.pmean(jnp.mean(losses), axis_name),
        "wire_bytes": lax.pmean(stats.sent_bytes, axis_name),
        "received_bytes": lax.pmean(stats.received_bytes, axis_name),
        "clipped": lax.psum(stats.clipped, axis_name),
        "nonfinite": lax.psum(stats.nonfinite, axis_name),
    }
    return params, device_stack((coded, state)), metrics
