"""What every selector builds on: :class:`Selection`, counting, exact order statistics, the cut.

A selector is a pure, jit-able function ``selector(x, k, **options)`` on a
1-D array ``x`` and a static target count ``k``; it returns a
:class:`Selection` whose threshold ``t`` defines the communication set
``{i : |x_i| > t}`` (strictly greater, for every selector), with that set's
exact size. The pieces here are shared by the selectors of
:mod:`jaxcomp.selection.ldte` and :mod:`jaxcomp.selection.selectors`:

- counting: :func:`count_above` (``#{|x| > t}`` in one barriered pass) and
  :func:`count_above_many` (several candidates in the same pass);
- float32 thresholds by their bits: :func:`just_below` (the largest float32
  below ``v``, so that ``|x| > just_below(v)`` is ``|x| >= v``) and
  :func:`float32_above`;
- exact order statistics without a sort of ``x``: :func:`exact_top_k`
  (``lax.top_k``), :func:`kth_largest_above` (a search on float32 bit
  patterns, eight probes counted per pass, nothing n-sized allocated) and
  :func:`top_k_above` (the exact top-``k`` among the survivors of a
  threshold, compacted first when they fit a buffer);
- the capacity cut: a selection may pass more than the message's capacity
  (ties, or a threshold set on the low side); :func:`capacity_cut` describes
  the ``capacity`` largest, ties to the lower index as ``lax.top_k``, and
  :func:`cut_message` extracts them;
- :func:`strided_sample`, the fixed odd-stride sample estimates are read from.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._vma import varying_like
from jaxcomp.selection import _kernels as kernels

__all__ = [
    "Selection",
    "capacity_cut",
    "cut_message",
    "exact_top_k",
    "target_count",
]


class Selection(NamedTuple):
    """What a selector decided for one 1-D tensor.

    Attributes:
      threshold: float32 scalar; the communication set is ``{i: |x_i| > t}``.
      count: int32 scalar, the size of that set (may exceed any capacity: the
        caller sends at most its capacity and keeps the rest in the residual).
      iterations: int32 scalar, counting passes after the first estimate
        (search iterations for LDTE-BS and binary search, adaptation rounds
        for DGC, trimmed top-k and Gaussian-k; 0 for exact top-k).
      indices: for index-based selectors (``random_k``) the chosen indices,
        else ``None``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = exact_top_k(x, 3)
      >>> int(sel.count), int(sel.iterations), sel.indices is None
      (3, 0, True)
      >>> x[jnp.abs(x) > sel.threshold].tolist()  # the communication set
      [-4.0, 3.0, 6.0]
    """

    threshold: jax.Array
    count: jax.Array
    iterations: jax.Array
    indices: jax.Array | None = None


def target_count(ratio: float, n: int) -> int:
    """``k = max(1, ceil(ratio * n))`` clipped to ``n`` (0 for an empty tensor).

    Example:
      >>> target_count(0.001, 10_000), target_count(0.001, 10), target_count(0.5, 0)
      (10, 1, 0)
    """
    if n == 0:
        return 0
    # ratio * n carries a rounding of a few ulps (0.07 * 100 = 7.000000000000001):
    # a relative epsilon keeps that from counting as one element more, and an
    # epsilon relative to n would swallow a real fraction (1e-3 * 10_000_001).
    x = ratio * n
    return min(n, max(1, math.ceil(x - 1e-12 * x)))


def abs32(x: jax.Array) -> jax.Array:
    return jnp.abs(x.astype(jnp.float32))


def count_above(x: jax.Array, t: jax.Array) -> jax.Array:
    """``#{|x| > t}`` in one pass over ``x``.

    The barrier keeps XLA from (a) merging this ``abs(x)`` with another one
    (say, ``max|x|`` in the moments pass) into an n-sized temporary, and (b)
    fusing the scalar computation of ``t`` into the per-element loop; either
    doubled the cost of the count on XLA:CPU (measured 6.5 vs 3.5 floors for
    estimate + count at 2^22).
    """
    x, t = lax.optimization_barrier((x, jnp.asarray(t, jnp.float32)))
    return kernels.count_above(jnp.abs(x), t)


def count_above_many(x: jax.Array, ts: jax.Array) -> jax.Array:
    """``#{|x| > ts[j]}`` for every candidate in one pass (barriered as :func:`count_above`).

    Two candidates cost what one does: ``count_above`` reduces two outputs
    per element on XLA:CPU anyway (the second a barrier copy of t, kept only
    for vectorisation).
    """
    x, ts = lax.optimization_barrier((x, ts.astype(jnp.float32)))
    return kernels.count_above_many(jnp.abs(x), ts)


def just_below(v: jax.Array) -> jax.Array:
    """Largest float32 below ``v`` (so that ``a > result`` iff ``a >= v``), never < 0.

    Selecting zeros sends nothing, so a k-th value of 0 (or NaN) gives
    threshold 0. By the bit pattern, as :func:`float32_above`: below the
    smallest normal it gives the largest subnormal.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.int32)
    below = lax.bitcast_convert_type(bits - 1, jnp.float32)
    return jnp.where(v > 0, below, jnp.float32(0))


def make_selection(t, count, iterations=0) -> Selection:
    return Selection(
        threshold=jnp.asarray(t, jnp.float32),
        count=jnp.asarray(count, jnp.int32),
        iterations=jnp.asarray(iterations, jnp.int32),
    )


# ---------------------------------------------------------------------------
# Exact top-k.
# ---------------------------------------------------------------------------


def flat_input(select: Callable[..., Selection]) -> Callable[..., Selection]:
    """Rejects a selector's ``x`` that is not 1-D (counts and indices are of a flat tensor)."""

    @functools.wraps(select)
    def checked(x, *args, **kwargs):
        if jnp.ndim(x) != 1:
            raise ValueError(
                f"{select.__name__}: x must be 1-D (flatten the tensor first), got shape "
                f"{jnp.shape(x)}"
            )
        return select(x, *args, **kwargs)

    return checked


def kth_largest(a: jax.Array, k: int) -> jax.Array:
    # jnp.min of the top-k values, not values[k - 1]: indexing the output of
    # lax.top_k makes XLA:CPU compile a full sort (35x slower at 2^24).
    return jnp.min(lax.top_k(a, k)[0])


@flat_input
def exact_top_k(x: jax.Array, k: int) -> Selection:
    """Exact top-k by magnitude with ``lax.top_k`` ("radixSelect" on GPU).

    Ties at the k-th value are all selected (the set is ``{|x| >= kth}``), so
    ``count`` may exceed ``k`` when values repeat; zeros are never selected.

    Args:
      x: 1-D array.
      k: static number of elements to keep, ``1 <= k <= x.size``.

    Returns:
      A :class:`Selection` with ``iterations == 0``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = exact_top_k(x, 3)
      >>> int(sel.count), x[jnp.abs(x) > sel.threshold].tolist()
      (3, [-4.0, 3.0, 6.0])
      >>> int(exact_top_k(jnp.array([2.0, 1.0, 1.0, 1.0]), 2).count)  # ties at the k-th all pass
      4
    """
    a = abs32(x)
    t = just_below(kth_largest(a, k))
    return make_selection(t, kernels.count_above(a, t))


def strided_sample(x: jax.Array, size: int) -> jax.Array:
    """``size`` elements of ``x`` at a fixed odd stride (all of ``x`` if smaller).

    The stride is odd so that it never aligns with a power-of-two dimension of
    the flattened tensor (a stride of 64 on a (..., 64) kernel would sample a
    single output channel).
    """
    n = x.shape[0]
    if n <= size:
        return x
    stride = n // size
    if stride % 2 == 0:
        stride -= 1
    return x[: stride * size : stride]


_SEARCH_PROBES = 8


def kth_largest_above(
    x: jax.Array, t: jax.Array, count: jax.Array, k: int, *, top: jax.Array | None = None
) -> jax.Array:
    """The k-th largest of ``where(|x| > t, |x|, 0)`` in float32, ``count = #{|x| > t}``.

    That is the k-th largest ``|x|`` when ``count >= k``, else 0.

    A search on float32 bit patterns (non-negative floats order as their
    int32 bits) with ``_SEARCH_PROBES`` evenly spaced probes counted in one
    pass (``kernels.count_above_many``: 8 cost about 1.7 single counts), so
    each pass cuts the bracket 9-fold: at most 10 passes where a bisection
    made 31. It allocates nothing n-sized: ``lax.top_k`` on the masked array
    needed an n-sized temporary, and XLA:CPU allocates the temporaries of
    every branch on every call, taken or not: in a training step that
    temporary pushed the step's temporaries past glibc's mmap threshold, so
    the gradient was page-faulted in anew on every call (ldte_bs step at
    2^22: 19-21 vs 12 ms without it, experiments/bench_update.py).
    Invariant (when ``count >= k``): ``count(lo) >= k > count(hi)``; the
    k-th largest value is the smallest ``v`` with ``count(v) < k``.
    ``top``: an upper bound on ``|x|`` (float32) instead of ``max|x|``, which
    costs a pass and, inside a conditional, an n-sized ``|x|`` temporary on
    XLA:CPU (its reduce kernel does not fuse the ``abs``).
    """
    # (t = -0.0 has negative bits: counted as +0.0, which counts the same.)
    lo = jnp.maximum(lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.int32), 0)
    hi = jnp.max(abs32(x)) if top is None else jnp.asarray(top, jnp.float32)
    hi = lax.bitcast_convert_type(hi, jnp.int32)

    j = jnp.arange(1, _SEARCH_PROBES + 1, dtype=jnp.int32)

    def body(s):
        lo, hi = s
        # Probes spread over (lo, hi], the first strictly inside (hi - lo >= 2),
        # without int32 overflow; counts fall as the probe rises.
        q, r = jnp.divmod(hi - lo, _SEARCH_PROBES + 1)
        probes = lo + q * j + jnp.minimum(j, r)
        many = count_above_many(x, lax.bitcast_convert_type(probes, jnp.float32)) >= k
        return jnp.max(jnp.where(many, probes, lo)), jnp.min(jnp.where(many, hi, probes))

    _, hi = lax.while_loop(lambda s: s[1] - s[0] > 1, body, varying_like((lo, hi), x))
    return jnp.where(count >= k, lax.bitcast_convert_type(hi, jnp.float32), jnp.float32(0))


def top_k_above(x: jax.Array, t: jax.Array, count: jax.Array, k: int, buffer: int):
    """Exact k-th largest ``|x|`` among ``{|x| > t}``, which holds ``count >= k`` elements.

    When the survivors fit ``buffer`` they are compacted first, so ``lax.top_k``
    runs on ``buffer`` elements instead of ``n`` (the point of DGC's and
    RedSync's two-stage selection); otherwise it runs on the masked array.
    """
    n = x.shape[0]
    buffer = min(buffer, n)

    def small(_):
        _, vals, _ = kernels.extract(x, t, buffer)  # padding values are 0
        return kth_largest(abs32(vals), k)

    def large(_):
        return kth_largest_above(x, t, count, k)

    if buffer >= n:
        kth = large(None)
    else:
        kth = lax.cond(count <= buffer, small, large, None)
    t2 = just_below(kth)
    return t2, count_above(x, t2)


def float32_above(t: jax.Array) -> jax.Array:
    """The next float32 above a non-negative float32 ``t``, by its bits.

    Integer arithmetic on the bit pattern, not ``nextafter``: XLA:CPU treats
    a subnormal operand of float arithmetic as 0, so ``nextafter`` of the
    largest subnormal would not give the smallest normal.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.int32)
    return lax.bitcast_convert_type(bits + 1, jnp.float32)


def capacity_cut(
    x: jax.Array, t: jax.Array, count: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """The ``capacity`` largest of the ``count > capacity`` elements with ``|x| > t``.

    Ties at the ``capacity``-th magnitude ``v`` go to the lower index, as in
    ``lax.top_k``. Returned as ``(cut, limit)``: the message is
    ``{i: |x_i| > cut and (|x_i| > float32_above(cut) or i <= limit)}``, where
    ``cut`` is the float32 just below ``v`` (so the first term is
    ``|x_i| >= v`` and ``|x_i| > float32_above(cut)`` is ``|x_i| > v``) and
    ``limit`` the index of the last tie sent. Without a cut, ``(t, n)``
    describes ``{|x| > t}`` in the same form.

    When the survivors fit ``4 * capacity`` slots they are compacted (one
    counting pass) and searched there; otherwise the search on float32 bit
    patterns runs on ``x`` (:func:`kth_largest_above`, up to 10 counting
    passes, nothing n-sized allocated) and a second compaction finds the
    ties. Magnitudes compare in float32. ``count`` must be exact
    (:class:`Selection`'s contract): it picks the path, and the compacting
    one sees only the first ``4 * capacity`` survivors.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.zeros(64).at[:10].set(1.0).at[63].set(5.0)  # ten ties, one larger
      >>> cut, limit = capacity_cut(x, jnp.float32(0.5), jnp.int32(11), 6)
      >>> int(limit)  # the last tie sent: ties 0-4 and the 5.0
      4
      >>> idx, vals = cut_message(x, cut, limit, 6)
      >>> idx.tolist(), vals.tolist()
      ([0, 1, 2, 3, 4, 63], [1.0, 1.0, 1.0, 1.0, 1.0, 5.0])
    """
    n = x.shape[0]
    buffer = min(n, 4 * capacity)

    def small(_):
        idx, vals, _ = kernels.extract(x, t, buffer)
        mags = abs32(vals)  # padding: 0, at index n
        # The same search on the buffer (lax.top_k there took 1.4 ms at 2^22).
        v = kth_largest_above(mags, t, count, capacity)
        ties_so_far = jnp.cumsum((mags == v) & (idx < n), dtype=jnp.int32)
        wanted = capacity - jnp.sum(mags > v, dtype=jnp.int32)  # >= 1
        # The wanted-th tie's slot: the count of slots before it (no argmax,
        # whose variadic reduce GPU lowerings would not share with the CPU's).
        last = jnp.sum(ties_so_far < wanted, dtype=jnp.int32)
        return v, idx[last]

    def large(_):
        v = kth_largest_above(x, t, count, capacity, top=jnp.float32(jnp.inf))
        below = just_below(v)
        ties, _, _ = kernels.extract(x, below, capacity, upper=v)
        wanted = capacity - count_above(x, v)
        return v, ties[wanted - 1]

    if buffer == n:
        v, limit = small(None)
    else:
        v, limit = lax.cond(count <= buffer, small, large, None)
    return just_below(v), limit


def cut_message(
    x: jax.Array, cut: jax.Array, limit: jax.Array, capacity: int
) -> tuple[jax.Array, jax.Array]:
    """Ascending indices and values of the message :func:`capacity_cut` described.

    Two compactions, the elements above ``v = float32_above(cut)`` and the
    ties at ``v`` up to ``limit``, merged by index; ``capacity`` slots, the
    unused ones padding (index ``n``, value 0) as in ``kernels.extract``.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([2.0, -3.0, 2.0, 2.0, 0.0])
      >>> cut = jnp.nextafter(jnp.float32(2.0), jnp.float32(0))  # just below the tie value 2
      >>> idx, vals = cut_message(x, cut, jnp.int32(2), 3)  # ties up to index 2
      >>> idx.tolist(), vals.tolist()
      ([0, 1, 2], [2.0, -3.0, 2.0])
    """
    n = x.shape[0]
    v = float32_above(cut)
    above, above_vals, _ = kernels.extract(x, v, capacity)
    ties, tie_vals, _ = kernels.extract(x, cut, capacity, upper=v)
    kept = ties <= limit
    idx = jnp.concatenate([above, jnp.where(kept, ties, n)])
    vals = jnp.concatenate([above_vals, jnp.where(kept, tie_vals, jnp.zeros((), x.dtype))])
    idx, vals = lax.sort((idx, vals), num_keys=1)
    return idx[:capacity], vals[:capacity]
