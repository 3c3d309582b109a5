"""Top-k threshold selectors: LDTE-BS and the baselines it is measured against.

Every selector is a pure, jit-able function ``selector(x, k, **options)`` on a
1-D array ``x`` (a residual, already accumulated) and a static target count
``k``. It returns a :class:`Selection`: a threshold ``t`` such that the
communication set is ``{i : |x_i| > t}`` (strictly greater, for every
selector), the size of that set, and how many counting passes or search
iterations it took. Selectors never sort the whole array unless their name
says so (``sort_top_k``), never move data to the host, and have static output
shapes, so they compose with ``jit``, ``lax.switch`` and ``shard_map``.

``random_k`` is the one index-based selector: it returns the chosen indices in
``Selection.indices`` instead of a meaningful threshold.

The formulas follow ``docs/algorithms.md`` section 2 (reconstructed from the LDTE-BS
paper, RedSync, DGC and Gaussian-k).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection import _kernels as kernels

__all__ = [
    "MEDIAN_SAMPLE",
    "RANDOM_ROW",
    "Selection",
    "SELECTORS",
    "binary_search",
    "capacity_cut",
    "cut_message",
    "DGC_RULES",
    "dgc_sample",
    "dgc_sampling",
    "dgc_start",
    "exact_top_k",
    "fixed_threshold",
    "gaussian_k",
    "get_selector",
    "ldte_bs",
    "random_k",
    "random_scores",
    "sort_top_k",
    "target_count",
    "trimmed_top_k",
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


def _abs32(x: jax.Array) -> jax.Array:
    return jnp.abs(x.astype(jnp.float32))


def _count(x: jax.Array, t: jax.Array) -> jax.Array:
    """``#{|x| > t}`` in one pass over ``x``.

    The barrier keeps XLA from (a) merging this ``abs(x)`` with another one
    (say, ``max|x|`` in the moments pass) into an n-sized temporary, and (b)
    fusing the scalar computation of ``t`` into the per-element loop; either
    doubled the cost of the count on XLA:CPU (measured 6.5 vs 3.5 floors for
    estimate + count at 2^22).
    """
    x, t = lax.optimization_barrier((x, jnp.asarray(t, jnp.float32)))
    return kernels.count_above(jnp.abs(x), t)


def _count_many(x: jax.Array, ts: jax.Array) -> jax.Array:
    """``#{|x| > ts[j]}`` for every candidate in one pass (barriered as :func:`_count`).

    Two candidates cost what one does: ``count_above`` reduces two outputs
    per element on XLA:CPU anyway (the second a barrier copy of t, kept only
    for vectorisation).
    """
    x, ts = lax.optimization_barrier((x, ts.astype(jnp.float32)))
    return kernels.count_above_many(jnp.abs(x), ts)


def _just_below(v: jax.Array) -> jax.Array:
    """Largest float32 below ``v`` (so that ``a > result`` iff ``a >= v``), never < 0.

    Selecting zeros sends nothing, so a k-th value of 0 (or NaN) gives
    threshold 0. By the bit pattern, as :func:`float32_above`: below the
    smallest normal it gives the largest subnormal.
    """
    bits = lax.bitcast_convert_type(jnp.asarray(v, jnp.float32), jnp.int32)
    below = lax.bitcast_convert_type(bits - 1, jnp.float32)
    return jnp.where(v > 0, below, jnp.float32(0))


def _selection(t, count, iterations=0) -> Selection:
    return Selection(
        threshold=jnp.asarray(t, jnp.float32),
        count=jnp.asarray(count, jnp.int32),
        iterations=jnp.asarray(iterations, jnp.int32),
    )


# ---------------------------------------------------------------------------
# Exact top-k.
# ---------------------------------------------------------------------------


def _flat_input(select: Callable[..., Selection]) -> Callable[..., Selection]:
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


def _kth_largest(a: jax.Array, k: int) -> jax.Array:
    # jnp.min of the top-k values, not values[k - 1]: indexing the output of
    # lax.top_k makes XLA:CPU compile a full sort (35x slower at 2^24).
    return jnp.min(lax.top_k(a, k)[0])


@_flat_input
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
    a = _abs32(x)
    t = _just_below(_kth_largest(a, k))
    return _selection(t, kernels.count_above(a, t))


@_flat_input
def sort_top_k(x: jax.Array, k: int) -> Selection:
    """Exact top-k through a full sort: the O(n log n) reference.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = sort_top_k(x, 3)
      >>> int(sel.count), x[jnp.abs(x) > sel.threshold].tolist()
      (3, [-4.0, 3.0, 6.0])
    """
    a = _abs32(x)
    t = _just_below(jnp.sort(a)[a.shape[0] - k])
    return _selection(t, kernels.count_above(a, t))


@_flat_input
def fixed_threshold(x: jax.Array, k: int, *, threshold: float) -> Selection:
    """ "fixed-v": a user-given threshold; ``k`` only sizes the caller's capacity.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = fixed_threshold(x, 3, threshold=2.5)
      >>> float(sel.threshold), int(sel.count)  # |x| > 2.5: -4, 3 and 6
      (2.5, 3)
    """
    del k
    # May be an injected (traced) hyperparameter.
    t = jnp.float32(V.check_real("threshold", threshold, 0.0, allow_traced=True))
    return _selection(t, kernels.count_above(_abs32(x), t))


# ---------------------------------------------------------------------------
# Search-based selectors: LDTE-BS and RedSync's binary search.
# ---------------------------------------------------------------------------

_SEARCHES = ("bisect", "fibonacci", "interpolate")


def fibonacci_fractions(max_iters: int) -> jax.Array:
    """Probe positions F[j-1]/F[j] (-> 0.618...) for Fibonacci search."""
    fib = [1, 2]
    while len(fib) < max_iters + 2:
        fib.append(fib[-1] + fib[-2])
    # Early probes use the fractions of the largest Fibonacci numbers; the
    # last one is 1/2, so the final steps are plain bisection.
    fr = [fib[j - 1] / fib[j] for j in range(max_iters + 1, 0, -1)]
    return jnp.asarray(fr, jnp.float32)


def _search(
    x: jax.Array,
    k: int,
    lo: jax.Array,
    hi: jax.Array,
    c_lo: jax.Array,
    c_hi: jax.Array,
    *,
    upper: float,
    search: str,
    max_iters: int,
    delta: float,
    lo_is_zero: jax.Array,
    start: tuple[jax.Array, jax.Array] | None = None,
):
    """Shrinks ``[lo, hi]`` (counts ``c_lo > ub``, ``c_hi < k``) until ``k <= nnz <= ub``.

    ``c_lo`` may be an upper estimate (``n``) when ``lo`` is the initial 0 and
    was never counted (``lo_is_zero``). Returns ``(t, count, iterations)``.
    """
    ub = math.floor(upper * k)
    n = x.shape[0]
    target = math.log(math.sqrt(k * max(ub, k)) + 1.0)
    fib = fibonacci_fractions(max_iters)

    def cond(s):
        lo, hi, _, _, _, c, it, _, _, _ = s
        feasible = (c >= k) & (c <= ub)
        # Stop when the bracket no longer shrinks in float32 or is below delta.
        mid = lo + (hi - lo) * 0.5
        stuck = (mid <= lo) | (mid >= hi) | (hi - lo <= delta)
        return ~feasible & ~stuck & (it < max_iters)

    def body(s):
        lo, hi, c_lo, c_hi, _, _, it, last, repeat, lo_zero = s
        if search == "bisect":
            frac = jnp.float32(0.5)
        elif search == "fibonacci":
            frac = fib[it]
        else:
            # Regula falsi on log(count): Laplacian (exponential) tails make
            # log(count) nearly linear in t, so one or two probes usually land
            # in [k, ub]. Illinois-style safeguard: after the same end moved
            # twice in a row, bisect once, so it never stalls at one end.
            f_lo = jnp.log(c_lo.astype(jnp.float32) + 1.0) - target
            f_hi = jnp.log(c_hi.astype(jnp.float32) + 1.0) - target
            interp = f_lo / jnp.maximum(f_lo - f_hi, 1e-6)
            frac = jnp.where(repeat, 0.5, jnp.clip(interp, 0.02, 0.98))
        t = jnp.clip(lo + (hi - lo) * frac, lo, hi)
        c = _count(x, t)
        too_many = c > ub
        too_few = c < k
        moved = jnp.where(too_many, 1, jnp.where(too_few, -1, 0)).astype(jnp.int32)
        return (
            jnp.where(too_many, t, lo),
            jnp.where(too_few, t, hi),
            jnp.where(too_many, c, c_lo),
            jnp.where(too_few, c, c_hi),
            t,
            c,
            it + 1,
            moved,
            (moved != 0) & (moved == last),
            lo_zero & ~too_many,
        )

    # The current probe: the caller's estimate, else hi (count c_hi < k, so
    # the loop runs at least once).
    t0, c0 = start if start is not None else (hi, c_hi)
    init = (
        lo,
        hi,
        c_lo,
        c_hi,
        t0,
        c0,
        jnp.int32(0),
        jnp.int32(0),
        jnp.bool_(False),
        lo_is_zero,
    )
    init = varying_like(init, x)
    lo, hi, c_lo, c_hi, t, c, it, _, _, lo_zero = lax.while_loop(cond, body, init)
    feasible = (c >= k) & (c <= ub)

    def fallback(_):
        # No threshold gives k <= nnz <= ub: ties (more than ub values share
        # the top magnitudes: all ones, +-1 signs, small integers), fewer than
        # k nonzeros, or the probe cap / delta. Take the "too many" end lo:
        # its count is >= k whenever x holds k nonzeros (lo = 0 counts all of
        # them), and the caller sends the first `capacity` of its set in index
        # order, keeping the rest in the residual. The "too few" end hi would
        # send fewer than k: nothing at all on tied data, so the leaf would
        # never train and its residual would grow without bound.
        cap = min(n, math.ceil(upper * k))
        c_lo_true = jnp.where(lo_zero, _count(x, lo), c_lo)
        # When the bracket stopped before closing (probe cap, delta), lo may lie
        # well below the k-th value: refine to the exact top-k among lo's set.
        # After a closed bracket (adjacent floats: a tie) lo is that already.
        open_ = jnp.nextafter(lo, jnp.float32(jnp.inf)) < hi
        return lax.cond(
            (c_lo_true > cap) & open_,
            lambda: _top_k_above(x, lo, c_lo_true, k, buffer=4 * cap),
            lambda: (lo, c_lo_true),
        )

    t, c = lax.cond(feasible, lambda _: (t, c), fallback, None)
    return t, c, it


def check_search_options(search: str, upper: float, max_iters: int, delta=0.0):
    V.check_choice("search", search, _SEARCHES)
    V.check_real("upper", upper, 1.0)  # the count window is [k, upper * k]
    V.check_int("max_iters", max_iters, 0)
    V.check_real("delta", delta, 0.0, allow_traced=True)  # may be an injected hyperparameter


def _log_cosh(z: jax.Array) -> jax.Array:
    z = jnp.abs(z)
    return z + jnp.log1p(jnp.exp(-2.0 * z)) - math.log(2.0)


def _strided_sample(x: jax.Array, size: int) -> jax.Array:
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


# Moments from this many strided elements by default: an estimate of b within
# ~1% (Laplace kurtosis 6: rel. sd of the variance ~ sqrt(5 / m)), which moves
# the expected count by a few percent, well inside the [k, 1.5k] window that
# the count pass verifies anyway. Exact for tensors up to this size.
DEFAULT_MOMENT_SAMPLE = 65536

# The "mle" estimator's median comes from a strided sample of at most this
# many elements (exact for smaller tensors): O(n) without a sort of x.
MEDIAN_SAMPLE = 65536


def laplace_threshold(
    x: jax.Array,
    k: int,
    *,
    estimator: str = "moments",
    aim: float = 1.0,
    moment_sample: int | None = None,
) -> jax.Array:
    """The LDTE estimate ``t = b * ln(cosh(mu / b) / eta)`` with ``eta = aim * k / n``.

    Args:
      x: 1-D array.
      k: static target count.
      estimator: ``"moments"`` (the paper: ``mu = mean``,
        ``b = sqrt(var / 2)``) or ``"mle"`` (``mu = median``,
        ``b = mean|x - mu|``; the median always comes from a strided sample
        of at most 65536 elements, exact for smaller tensors, so the
        estimator stays O(n) without a sort).
      aim: multiplies ``eta``; 1 is the paper's formula (expected count
        ``k``, the lower edge of the window, so about half the time one
        search probe follows); 1.25 aims at the middle of ``[k, 1.5 k]``.
      moment_sample: estimate the moments from this many elements taken at a
        fixed odd stride; ``None`` uses every element (the paper).

    Returns:
      The float32 estimate, ``>= 0``.

    Example:
      >>> import jax, jax.numpy as jnp, math
      >>> x = jax.random.laplace(jax.random.key(0), (100_000,))  # Laplace(0, 1)
      >>> t = laplace_threshold(x, 100)  # P(|x| > t) = exp(-t) = 1e-3 at t = ln 1000
      >>> round(float(t), 1), round(math.log(1000), 1)
      (6.9, 6.9)
    """
    n = x.shape[0]
    xs = x if moment_sample is None else _strided_sample(x, moment_sample)
    if estimator == "moments":
        mean, var, _ = kernels.moments(xs)
        mu, b = mean, jnp.sqrt(var / 2.0)
    elif estimator == "mle":
        xs32 = xs.astype(jnp.float32)
        mu = jnp.median(_strided_sample(xs32, MEDIAN_SAMPLE))
        b = jnp.mean(jnp.abs(xs32 - mu))
    else:
        raise ValueError(f"estimator must be 'moments' or 'mle', got {estimator!r}")
    eta = min(1.0, aim * k / n)
    safe_b = jnp.where(b > 0, b, 1.0)
    # ln(cosh(z)) written stably: cosh overflows float32 for |mu/b| > 89.
    t = safe_b * (_log_cosh(mu / safe_b) - math.log(eta))
    return jnp.maximum(jnp.where(b > 0, t, 0.0), 0.0)


# Expected counts (in units of aim * k) of the sample-quantile probes: three
# across the window and one beyond each end, so the bracket closes.
_PROBE_FACTORS = (2.4, 1.16, 1.0, 0.84, 0.4)


def _sample_quantile_thresholds(x, k, sample_size, aim, upper, sample=None):
    """Thresholds whose sample counts predict ``f * aim * k`` for each probe factor.

    ``sample``: ``_strided_sample(x, sample_size)`` if the caller has it already.
    """
    n = x.shape[0]
    sample = _abs32(_strided_sample(x, sample_size) if sample is None else sample)
    m = sample.shape[0]
    ks = [max(1, min(m, math.ceil(f * aim * k / n * m))) for f in _PROBE_FACTORS]
    vals = lax.top_k(sample, max(ks))[0]
    # vals[j - 1] by a masked min: indexing lax.top_k's output makes XLA:CPU
    # rewrite it into a full sort (measured 12 vs 0.6 passes).
    iota = lax.iota(jnp.int32, vals.shape[0])
    return jnp.stack([_just_below(jnp.min(jnp.where(iota < j, vals, jnp.inf))) for j in ks])


def _choose(ts: jax.Array, cs: jax.Array, k: int, ub: int, aim: float, *, preferred: int):
    """The ``(t, count)`` to go on from: the first of the ``preferred`` leading
    candidates in ``[k, ub]``, else the one in it whose count is nearest
    ``aim * k``, else the first candidate."""
    in_window = (cs >= k) & (cs <= ub)
    miss = jnp.abs(jnp.log(cs.astype(jnp.float32) + 1.0) - math.log(aim * k))
    rank = jnp.where(lax.iota(jnp.int32, ts.shape[0]) < preferred, -1.0, miss)
    first = jnp.where(jnp.any(in_window), jnp.argmin(jnp.where(in_window, rank, jnp.inf)), 0)
    return ts[first], cs[first]


def _bracket(ts: jax.Array, cs: jax.Array, k: int, ub: int, n: int):
    """The search bracket from counted candidates ``cs[j] = #{|x| > ts[j]}``.

    Returns ``(lo, c_lo, hi, c_hi, hi_known)``: lo is the largest candidate
    with too many (count > ub), else 0 with the upper estimate ``n`` (0 is
    never counted); hi the smallest with too few (count < k), else the first
    candidate (and ``hi_known`` False: max|x| closes the bracket if needed).
    """
    many, few = cs > ub, cs < k
    any_many = jnp.any(many)
    lo = jnp.where(any_many, jnp.max(jnp.where(many, ts, -jnp.inf)), jnp.float32(0))
    # The largest t with too many has the smallest such count.
    c_lo = jnp.where(any_many, jnp.min(jnp.where(many, cs, n)), n).astype(jnp.int32)
    hi_known = jnp.any(few)
    hi = jnp.where(hi_known, jnp.min(jnp.where(few, ts, jnp.inf)), ts[0])
    c_hi = jnp.where(hi_known, jnp.max(jnp.where(few, cs, -1)), cs[0]).astype(jnp.int32)
    return lo, c_lo, hi, c_hi, hi_known


@_flat_input
def ldte_bs(
    x: jax.Array,
    k: int,
    *,
    estimator: str = "moments",
    search: str = "interpolate",
    aim: float = 1.25,
    moment_sample: int | None = DEFAULT_MOMENT_SAMPLE,
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
    exact_below: int = 0,
    hint: jax.Array | float | None = None,
) -> Selection:
    """LDTE-BS: Laplacian threshold estimate, corrected by a search on counts.

    The mean and variance (of a strided sample by default) give the Laplacian
    fit and ``t = b * ln(cosh(mu/b) / eta)``; one pass counts
    ``nnz = #{|x| > t}``.
    If ``nnz`` is outside ``[k, upper*k]`` a ``lax.while_loop`` searches
    ``[t, max|x|]`` (too many) or ``[0, t]`` (too few), recounting each probe,
    until ``k <= nnz <= upper*k``, the bracket is narrower than ``delta`` (or
    stops shrinking in float32), or ``max_iters`` probes were made.

    If no threshold can satisfy the window (ties: more than ``upper * k``
    values share the top magnitudes, as with all-ones, +-1 or small-integer
    data; fewer than ``k`` nonzeros; the probe cap), the result is on the
    "too many" side: the largest probed threshold that passes at least ``k``
    (refined to the exact top-k among its survivors if the bracket did not
    close), or 0 (all nonzeros) when fewer than ``k`` are nonzero. ``count``
    may then exceed the capacity ``ceil(upper * k)``: the sparsifier sends the
    ``capacity`` largest selected elements, ties to the lower index
    (:func:`capacity_cut`), and keeps the rest in the residual, so every step
    sends at least ``min(k, nnz)`` elements.

    Args:
      x: 1-D array (the residual).
      k: static target count, ``1 <= k <= x.size``.
      estimator: ``"moments"`` (paper default) or ``"mle"``, see
        :func:`laplace_threshold`.
      search: ``"bisect"`` (the paper's binary search: midpoint probes),
        ``"fibonacci"`` (probes at ratios of consecutive Fibonacci numbers, as
        the paper suggests), or ``"interpolate"`` (default: regula falsi on
        log counts inside the same bracket, so an estimate that is close is
        refined from where it is, not from the middle of the whole interval;
        falls back to bisection steps when it stalls).
      aim: the estimate targets ``aim * k`` elements (default 1.25, the
        middle of the window; ``aim=1, search="bisect", moment_sample=None``
        is the paper's algorithm exactly).
      moment_sample: the moments come from this many elements at a fixed
        odd stride (default 65536; exact below that size), which makes the
        estimate ~4x cheaper than a full pass; ``None`` uses all elements.
      upper: the window's upper factor (paper: 1.5).
      max_iters: cap on search probes.
      delta: stop when ``hi - lo < delta`` (the paper's termination parameter).
      exact_below: tensors with fewer elements use exact top-k instead (the
        paper's crossover: LDTE-BS only pays off above some size; measured
        here between 2^16 and 2^18 elements, see ``bench_selection``).
        Default 0: always LDTE-BS.
      hint: a second candidate threshold (a scalar, may be traced), counted
        in the same pass as the estimate; the sparsifiers pass the previous
        step's threshold. With a hint, the sample-quantile probes
        (``search="interpolate"`` on a sampled tensor) join that pass too,
        computed every call instead of only when the estimate misses: under
        error feedback the residual is far from Laplacian and the estimate
        misses on most steps, so this saves the second pass those steps took.
        The estimate is kept whenever it is in the window, then the hint,
        then the probe nearest the aim. A hint that is not finite or is
        negative is ignored. ``None`` (default): the estimate alone, probes
        in a second pass when it misses.

    Returns:
      A :class:`Selection`; ``iterations`` counts the count passes after
      the first (0 when a candidate of the first pass was in the window).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp.selection import ldte_bs
      >>> x = jax.random.laplace(jax.random.key(0), (100_000,))
      >>> sel = jax.jit(ldte_bs, static_argnums=1)(x, 100)
      >>> bool(100 <= sel.count <= 150)
      True
    """
    check_search_options(search, upper, max_iters, delta)
    exact_below = V.check_int("exact_below", exact_below, 0)
    if x.shape[0] < exact_below:
        return exact_top_k(x, k)
    aim = V.check_real("aim", aim, 0.0, float(upper), low_open=True)
    moment_sample = V.check_int("moment_sample", moment_sample, 2, allow_none=True)
    n = x.shape[0]
    ub = math.floor(upper * k)
    sampled = search == "interpolate" and moment_sample is not None and n > moment_sample
    t0 = laplace_threshold(x, k, estimator=estimator, aim=aim, moment_sample=moment_sample)
    it = jnp.int32(0)
    if hint is None:
        ts0, cs0 = t0[None], _count(x, t0)[None]
    else:
        # The candidates in one pass: the estimate, the hint and (sampled
        # interpolation) the sample-quantile probes, which would otherwise
        # take a second pass whenever the estimate misses, as it does on
        # most error-feedback steps.
        h = jnp.asarray(hint, jnp.float32)
        # inf (the state after a skipped step), NaN or < 0: count t0 twice.
        h = jnp.where(jnp.isfinite(h) & (h >= 0), h, t0)
        ts0 = jnp.stack([t0, h])
        if sampled:
            qs = _sample_quantile_thresholds(x, k, moment_sample, aim, upper)
            ts0 = jnp.concatenate([ts0, qs])
        cs0 = _count_many(x, ts0)
        # A hint with nothing above it brackets no better than max|x| (and a
        # huge one far worse): drop it, as if the estimate had been counted twice.
        drop = (lax.iota(jnp.int32, ts0.shape[0]) == 1) & (cs0 == 0)
        ts0, cs0 = jnp.where(drop, t0, ts0), jnp.where(drop, cs0[0], cs0)
    # The current probe: the estimate if in the window, else the hint, else
    # the probe whose count is nearest the aim; if none is, the estimate.
    t, c = _choose(ts0, cs0, k, ub, aim, preferred=2)
    lo, c_lo, hi, c_hi, hi_known = _bracket(ts0, cs0, k, ub, n)
    if sampled and hint is None:
        # The estimate missed (a non-Laplacian residual, e.g. a mixture):
        # before bisecting, probe thresholds read off the strided sample's
        # own quantiles for counts around the window (and one on each side
        # for a bracket), all counted in one pass. ~1.3 passes in all; the
        # window is usually hit, else the bracket is tight.
        # The moments' strided sample (the same elements, shared with
        # laplace_threshold's by CSE), taken outside the cond: inside it
        # would be a second strided gather of x (~0.2-0.3 ms at any size).
        sample = _strided_sample(x, moment_sample)

        def probe():
            ts = _sample_quantile_thresholds(x, k, moment_sample, aim, upper, sample)
            cs = kernels.count_above_many(jnp.abs(lax.optimization_barrier(x)), ts)
            return ts, cs

        missed = (c < k) | (c > ub)
        m = len(_PROBE_FACTORS)
        ts, cs = lax.cond(missed, probe, lambda: (jnp.full((m,), t), jnp.full((m,), c, jnp.int32)))
        it = missed.astype(jnp.int32)
        # The estimate if it was in the window, else the probe nearest the aim;
        # the bracket from all of them (unchanged when the probes did not run).
        ts, cs = jnp.concatenate([ts0, ts]), jnp.concatenate([cs0, cs])
        t, c = _choose(ts, cs, k, ub, aim, preferred=1)
        lo, c_lo, hi, c_hi, hi_known = _bracket(ts, cs, k, ub, n)
    # max|x| (nothing lies above it) closes the bracket only when a search
    # follows and no probe had too few: a pass the common case skips.
    need_max = ~hi_known & ((c < k) | (c > ub))
    hi = lax.cond(need_max, lambda: jnp.max(_abs32(x)), lambda: hi)
    c_hi = jnp.where(need_max, 0, c_hi)
    # The while loop starts at the current probe and runs zero times when it
    # is already in the window (no lax.cond around it: XLA:CPU runs
    # conditional branches as separate, slower computations).
    t, c, it2 = _search(
        x,
        k,
        lo,
        hi,
        c_lo,
        c_hi,
        upper=upper,
        search=search,
        max_iters=max_iters,
        delta=delta,
        lo_is_zero=lo == 0,
        start=(t, c),
    )
    return _selection(t, c, it + it2)


@_flat_input
def binary_search(
    x: jax.Array,
    k: int,
    *,
    start: str = "zero",
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
) -> Selection:
    """RedSync's threshold binary search, with no distribution estimate.

    Args:
      x: 1-D array.
      k: static target count.
      start: ``"zero"`` bisects ``[0, max|x|]`` (docs/algorithms.md); ``"mean"``
        bisects ``[mean|x|, max|x|]`` as RedSync's code does (falls back to
        ``[0, mean|x|]`` if fewer than ``k`` exceed the mean).
      upper: accept ``k <= nnz <= upper*k`` (RedSync's code uses 2).
      max_iters: cap on probes.
      delta: stop when the bracket is narrower than this.

    Returns:
      A :class:`Selection`; ``iterations`` counts probes. When no threshold
      lands in ``[k, upper * k]`` (ties) the result passes at least
      ``min(k, nnz)`` elements, as for :func:`ldte_bs`.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = binary_search(x, 3)  # accepts 3 <= count <= 4.5
      >>> # Bisects [0, 6]: t = 3 passes 2 (too few), t = 1.5 passes 4.
      >>> float(sel.threshold), int(sel.count), int(sel.iterations)
      (1.5, 4, 2)
    """
    check_search_options("bisect", upper, max_iters, delta)
    V.check_choice("start", start, ("zero", "mean"))
    n = x.shape[0]
    amax = jnp.max(_abs32(x))
    if start == "zero":
        t, c, it = _search(
            x,
            k,
            jnp.float32(0),
            amax,
            jnp.int32(n),
            jnp.int32(0),
            upper=upper,
            search="bisect",
            max_iters=max_iters,
            delta=delta,
            lo_is_zero=jnp.bool_(True),
        )
        return _selection(t, c, it)
    m = jnp.mean(_abs32(x))
    cm = _count(x, m)
    ub = math.floor(upper * k)
    many = cm > ub
    t, c, it = _search(
        x,
        k,
        jnp.where(many, m, 0.0),
        jnp.where(many, amax, m),
        jnp.where(many, cm, n),
        jnp.where(many, 0, cm),
        upper=upper,
        search="bisect",
        max_iters=max_iters,
        delta=delta,
        lo_is_zero=~many,
    )
    ok = (cm >= k) & (cm <= ub)
    return _selection(jnp.where(ok, m, t), jnp.where(ok, cm, c), jnp.where(ok, 0, it + 1))


# ---------------------------------------------------------------------------
# Hierarchical and fitted baselines.
# ---------------------------------------------------------------------------


_SEARCH_PROBES = 8


def _kth_largest_above(
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
    hi = jnp.max(_abs32(x)) if top is None else jnp.asarray(top, jnp.float32)
    hi = lax.bitcast_convert_type(hi, jnp.int32)

    j = jnp.arange(1, _SEARCH_PROBES + 1, dtype=jnp.int32)

    def body(s):
        lo, hi = s
        # Probes spread over (lo, hi], the first strictly inside (hi - lo >= 2),
        # without int32 overflow; counts fall as the probe rises.
        q, r = jnp.divmod(hi - lo, _SEARCH_PROBES + 1)
        probes = lo + q * j + jnp.minimum(j, r)
        many = _count_many(x, lax.bitcast_convert_type(probes, jnp.float32)) >= k
        return jnp.max(jnp.where(many, probes, lo)), jnp.min(jnp.where(many, hi, probes))

    _, hi = lax.while_loop(lambda s: s[1] - s[0] > 1, body, varying_like((lo, hi), x))
    return jnp.where(count >= k, lax.bitcast_convert_type(hi, jnp.float32), jnp.float32(0))


def _top_k_above(x: jax.Array, t: jax.Array, count: jax.Array, k: int, buffer: int):
    """Exact k-th largest ``|x|`` among ``{|x| > t}``, which holds ``count >= k`` elements.

    When the survivors fit ``buffer`` they are compacted first, so ``lax.top_k``
    runs on ``buffer`` elements instead of ``n`` (the point of DGC's and
    RedSync's two-stage selection); otherwise it runs on the masked array.
    """
    n = x.shape[0]
    buffer = min(buffer, n)

    def small(_):
        _, vals, _ = kernels.extract(x, t, buffer)  # padding values are 0
        return _kth_largest(_abs32(vals), k)

    def large(_):
        return _kth_largest_above(x, t, count, k)

    if buffer >= n:
        kth = large(None)
    else:
        kth = lax.cond(count <= buffer, small, large, None)
    t2 = _just_below(kth)
    return t2, _count(x, t2)


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
    patterns runs on ``x`` (:func:`_kth_largest_above`, up to 10 counting
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
        mags = _abs32(vals)  # padding: 0, at index n
        # The same search on the buffer (lax.top_k there took 1.4 ms at 2^22).
        v = _kth_largest_above(mags, t, count, capacity)
        ties_so_far = jnp.cumsum((mags == v) & (idx < n), dtype=jnp.int32)
        wanted = capacity - jnp.sum(mags > v, dtype=jnp.int32)  # >= 1
        # The wanted-th tie's slot: the count of slots before it (no argmax,
        # whose variadic reduce GPU lowerings would not share with the CPU's).
        last = jnp.sum(ties_so_far < wanted, dtype=jnp.int32)
        return v, idx[last]

    def large(_):
        v = _kth_largest_above(x, t, count, capacity, top=jnp.float32(jnp.inf))
        below = _just_below(v)
        ties, _, _ = kernels.extract(x, below, capacity, upper=v)
        wanted = capacity - _count(x, v)
        return v, ties[wanted - 1]

    if buffer == n:
        v, limit = small(None)
    else:
        v, limit = lax.cond(count <= buffer, small, large, None)
    return _just_below(v), limit


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


# dgc_sample's rules: DGC's reference code (default), jaxcomp's earlier at-least-k rule.
DGC_RULES = ("reference", "at_least_k")


def dgc_sampling(n: int, k: int, sample_ratio: float = 0.01) -> tuple[int, int, int]:
    """DGC's sample set-up for ``n`` elements and target ``k``, as its reference code.

    ``(stride, num_samples, top_k_samples)`` with the compression ratio
    ``r = k / n``: with ``pct = ceil(n sample_ratio)`` and
    ``cpr = ceil(2 / r)``, the whole tensor (``stride`` 1) when
    ``n <= cpr`` or ``sample_ratio >= 1``; else the stride
    ``ceil(n / max(pct, cpr) / 32) * 32 + 1``, lowered by 8 until
    ``n // stride >= max(pct, cpr)``. ``top_k_samples = ceil(num_samples r)``.

    Example:
      >>> dgc_sampling(100_000, 100)  # cpr = 2000 > pct = 1000: stride 65, 57, 49
      (49, 2040, 3)
      >>> dgc_sampling(1000, 10)  # cpr = 200: the stride falls from 33 to 1
      (1, 1000, 10)
      >>> dgc_sampling(150, 1)  # n <= cpr = 300: the whole tensor
      (1, 150, 1)
    """
    if n == 0:
        return 1, 0, 0
    r = k / n
    stride, m = 1, n
    if sample_ratio < 1.0:
        pct = math.ceil(n * sample_ratio)
        cpr = math.ceil(2 / r)
        if n > cpr:
            want = max(pct, cpr)
            stride = math.ceil(n / want / 32) * 32 + 1
            m = n // stride
            while m < want:
                stride -= 8
                m = n // stride
    return stride, m, math.ceil(m * r)


def dgc_start(key: jax.Array, stride) -> jax.Array:
    """DGC's sample start for one step: uniform in ``[0, stride)`` from ``key`` (int32).

    The remainder of 32 random bits (bias below ``stride / 2**32``): integer
    arithmetic, so a batch of keys (the segmented form) gives each key's start.

    Example:
      >>> import jax
      >>> stride = dgc_sampling(100_000, 100)[0]
      >>> 0 <= int(dgc_start(jax.random.key(0), stride)) < stride
      True
    """
    bits = jax.random.bits(key, dtype=jnp.uint32)
    return lax.rem(bits, jnp.asarray(stride).astype(jnp.uint32)).astype(jnp.int32)


def check_dgc_options(rule, sample_ratio, upper, decay, max_adaptations):
    """:func:`dgc_sample`'s options, checked: ``(rule, sample_ratio, upper, max_adaptations)``."""
    rule = V.check_choice("rule", rule, DGC_RULES)
    if rule == "reference":
        # The reference code clamps it to [0.01, 1]: a smaller value is refused, not changed.
        sample_ratio = V.check_real("sample_ratio", sample_ratio, 0.01, 1.0)
    else:
        sample_ratio = V.check_ratio("sample_ratio", sample_ratio)
    upper = V.check_real("upper", upper, 1.0)
    V.check_real("decay", decay, 0.0, 1.0, low_open=True, high_open=True, allow_traced=True)
    max_adaptations = V.check_int("max_adaptations", max_adaptations, 0)
    return rule, sample_ratio, upper, max_adaptations


def dgc_bounds(k, upper: float, decay) -> tuple[Any, Any]:
    """The reference's count bounds as integers: ``(lo, hi)`` with ``count < decay k``
    iff ``count < lo`` and ``count > upper k`` iff ``count > hi``.

    ``k`` an int or an integer numpy array; a traced ``decay`` gives ``lo=None``
    (compared in float32 in the program).
    """
    k = np.asarray(k, np.float64)
    hi = np.floor(k * upper).astype(np.int64)
    lo = None if V.is_dynamic(decay) else np.ceil(decay * k).astype(np.int64)
    return lo, hi


def below_decay(c, k, lo, decay):
    """``c < decay * k``: by the static integer ``lo``, else in float32."""
    if lo is not None:
        return c < lo
    return c.astype(jnp.float32) < jnp.asarray(decay, jnp.float32) * jnp.asarray(k, jnp.float32)


@_flat_input
def dgc_sample(
    x: jax.Array,
    k: int,
    *,
    sample_ratio: float = 0.01,
    upper: float = 1.3,
    decay: float = 0.8,
    max_adaptations: int = 10,
    rule: str = "reference",
    key: jax.Array | None = None,
    start: jax.Array | int | None = None,
) -> Selection:
    """DGC's hierarchical selection (Lin et al., ICLR 2018), by its reference code.

    ``rule="reference"`` (default) follows ``DGCCompressor._sparsify`` of
    synxlin/deep-gradient-compression: a strided sample (set up by
    :func:`dgc_sampling`: at least ``sample_ratio`` of ``x`` and at least
    ``2 / r`` elements; the whole tensor when ``n <= 2 / r``), the elements
    ``start, start + stride, ...`` (the reference draws the start every
    step: give ``key``, see :func:`dgc_start`; neither: 0); the threshold
    ``t`` is the smallest of the sample's ``ceil(num_samples r)`` largest
    magnitudes and the survivors are ``{|x| >= t}``. Unless the whole tensor
    was sampled, up to ``max_adaptations`` rounds: more than ``upper * k``
    survivors: exact top-k among them (``resample``), stop; more than ``k``:
    stop; fewer than ``decay * k`` (the reference's ``compress_lower_bound``,
    which is also its decay factor): ``t *= decay`` (float32) and count
    again; else stop (so no resample after the last round's decay). The
    selector sees ``k``, not the ratio: ``r = k / n``, the reference's
    ``compress_ratio`` when ``ratio * n`` is an integer (else ``k / n`` is
    larger, ``ceil(ratio n) / n``, and so the sample size and its top may
    differ from the reference's).

    The reference then sends the first ``k`` survivors in index order; this
    selector reports the survivors (``count`` may exceed ``k``) and the
    sparsifier cuts the message to the ``k`` largest of them (ties to the
    lower index, :func:`capacity_cut`: ``jaxcomp.dgc`` and
    ``sparsify("dgc")`` default to ``capacity_factor=1``). So both send at
    most ``k``, the same set whenever at most ``k`` survive or the reference
    resamples (up to which of equal magnitudes ``torch.topk`` keeps), and
    over ``k`` survivors without a resample (between ``k`` and
    ``upper * k``, or ties at a whole tensor's ``k``-th value) this sends
    the ``k`` largest where the reference sends the ``k`` first: a
    first-``k``-by-index message ``{|x| >= t, i <= limit}`` drops larger
    elements past ``limit``, which the ``(cut, limit)`` message form (and
    the deferred residual's state) cannot express. Zeros: with ``t = 0``
    the reference's survivors include zeros (sent as zero values); here
    they count as survivors for the rounds' decisions but the threshold
    set, as every selector's, is ``{|x| > threshold}``, nonzeros only.

    ``rule="at_least_k"`` is jaxcomp's earlier rule: a sample of
    ``max(sample_ratio * n, 1)`` elements at a fixed odd stride from index 0,
    ``t`` its top ``k / n`` fraction's smallest, ``t *= decay`` while fewer
    than ``k`` pass (at most ``max_adaptations`` times), then exact top-k
    among the survivors if more than ``ceil(upper * k)`` pass; no cut (the
    message is ``{|x| > t}`` up to the usual capacity ``1.5 k``).

    Guarantees (the liveness exemption, precisely), with the defaults: the
    count is at least 1 whenever ``x`` has a nonzero (the threshold lies at
    or below a nonzero of ``x``, or is 0). With ``rule="reference"`` at
    least ``m = ceil(decay * k)`` (and the message at most ``k``) whenever
    ``m`` elements have ``|x_i| >= max|x| / 9``; with ``"at_least_k"`` at
    least ``k`` whenever ``k`` elements do (in general: above
    ``decay**max_adaptations * max|x|``, 0.107 max|x| here, up to float32
    rounding), which tie-heavy data (all ones, +-1, small integers)
    satisfies. It ends lower when the sample's threshold overestimates the
    wanted magnitude by more than ``decay**-max_adaptations``, e.g. when
    sampled outliers (as many as the sample's top: at least 2 with
    ``"reference"``, whose sample has at least ``2 / r`` elements) are far
    larger than the rest.

    Args:
      x: 1-D array.
      k: static target count (``num_selects``).
      sample_ratio: fraction sampled, in ``[0.01, 1]`` for ``"reference"``
        (the reference clamps to it), in ``(0, 1]`` for ``"at_least_k"``.
      upper: the resample bound, ``>= 1``.
      decay: threshold factor in ``(0, 1)`` (traceable); with
        ``"reference"`` also the lower bound ``decay * k``.
      max_adaptations: cap on adaptation rounds, ``>= 0``.
      rule: ``"reference"`` or ``"at_least_k"``.
      key: PRNG key for the sample start (``"reference"``).
      start: the sample start itself, in ``[0, stride)`` (overrides ``key``).

    Returns:
      A :class:`Selection`; ``iterations`` counts the decay rounds plus one if
      the survivors' top-k ran.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = dgc_sample(x, 3)
      >>> int(sel.count), x[jnp.abs(x) > sel.threshold].tolist()
      (3, [-4.0, 3.0, 6.0])
    """
    rule, sample_ratio, upper, max_adaptations = check_dgc_options(
        rule, sample_ratio, upper, decay, max_adaptations
    )
    if rule == "at_least_k":
        return _dgc_at_least_k(x, k, sample_ratio, upper, decay, max_adaptations)
    n = x.shape[0]
    stride, m, ks = dgc_sampling(n, k, sample_ratio)
    whole = m == n
    if whole:
        sample = _abs32(x)
    else:
        if start is not None:
            first = jnp.asarray(start, jnp.int32)
        elif key is not None:
            first = dgc_start(key, stride)
        else:
            first = jnp.int32(0)
        # importance[start::stride]: num_samples or num_samples + 1 elements.
        pos = first + lax.iota(jnp.int32, m + 1) * stride
        inside = pos < n
        sample = jnp.where(inside, _abs32(x[jnp.where(inside, pos, 0)]), jnp.float32(0))
    t = _kth_largest(sample, ks)  # the reference's threshold: survivors are |x| >= t
    c = _count(x, _just_below(t))  # #{|x| >= t}, nonzeros (t = 0: all nonzeros)
    it = jnp.int32(0)
    if whole:
        return _selection(_just_below(t), c, it)
    lo, hi = dgc_bounds(k, upper, decay)
    lo, hi = (None if lo is None else int(lo)), int(hi)

    def survivors(t, c):  # the reference's count: with t = 0 every element survives
        return jnp.where(t > 0, c, n)

    def cond(s):
        t, c, it = s
        return below_decay(survivors(t, c), k, lo, decay) & (it < max_adaptations)

    def body(s):
        t, _, it = s
        # An injected decay is float64 under x64 (optax.inject_hyperparams
        # stores hyperparameters in the parameters' dtype): the carry stays float32.
        t = (t * decay).astype(t.dtype)
        return t, _count(x, _just_below(t)), it + 1

    t, c, it = lax.while_loop(cond, body, varying_like((t, c, it), x))
    # The reference checks for a resample in a round: none left after the last decay.
    resample = (survivors(t, c) > hi) & (it < max_adaptations)
    t = _just_below(t)

    def refine(_):
        t2, c2 = _top_k_above(x, t, c, k, buffer=4 * max(hi, k))
        return t2, c2, it + 1

    t, c, it = lax.cond(resample, refine, lambda _: (t, c, it), None)
    return _selection(t, c, it)


def _dgc_at_least_k(x, k, sample_ratio, upper, decay, max_adaptations) -> Selection:
    n = x.shape[0]
    m = max(1, min(n, math.ceil(sample_ratio * n)))
    sample = _abs32(_strided_sample(x, m))
    ks = target_count(k / n, sample.shape[0])
    t = _kth_largest(sample, ks)
    t = _just_below(t)
    c = _count(x, t)

    def cond(s):
        t, c, it = s
        return (c < k) & (it < max_adaptations) & (t > 0)

    def body(s):
        t, _, it = s
        # An injected decay is float64 under x64 (optax.inject_hyperparams
        # stores hyperparameters in the parameters' dtype): the carry stays float32.
        t = (t * decay).astype(t.dtype)
        return t, _count(x, t), it + 1

    t, c, it = lax.while_loop(cond, body, varying_like((t, c, jnp.int32(0)), x))
    hi = math.ceil(upper * k)

    def refine(_):
        t2, c2 = _top_k_above(x, t, c, k, buffer=4 * hi)
        return t2, c2, it + 1

    t, c, it = lax.cond(c > hi, refine, lambda _: (t, c, it), None)
    return _selection(t, c, it)


# trimmed_top_k's most counting passes (each reads the whole tensor).
MAX_TRIM_ROUNDS = 1024


def trim_rounds(start: float, step: float) -> int:
    """The thresholds ``r = start, start - step, ..., >= 0`` of :func:`trimmed_top_k`, checked."""
    start = V.check_real("start", start, 0.0, 1.0)
    step = V.check_real("step", step, 0.0, low_open=True)
    if start / step >= MAX_TRIM_ROUNDS:
        raise ValueError(
            f"step must be > start / {MAX_TRIM_ROUNDS} = {start / MAX_TRIM_ROUNDS:.3g} (each "
            f"value of r is a counting pass over the tensor), got step={step!r} with "
            f"start={start!r}"
        )
    return math.floor(start / step + 1e-9) + 1


@_flat_input
def trimmed_top_k(x: jax.Array, k: int, *, start: float = 0.8, step: float = 0.2) -> Selection:
    """RedSync's trimmed top-k.

    Threshold ``mean + r * (max - mean)`` of ``|x|``, starting at ``r = start``
    and lowering ``r`` by ``step`` until at least ``k`` elements survive (down
    to ``r = 0``, then all nonzeros), then exact top-k among the survivors.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> # mean |x| = 2.25, max 6: r = 0.8, ..., 0.2 pass at most 2; r = 0 passes 3.
      >>> sel = trimmed_top_k(x, 3)
      >>> int(sel.count), int(sel.iterations), x[jnp.abs(x) > sel.threshold].tolist()
      (3, 4, [-4.0, 3.0, 6.0])
    """
    rounds = trim_rounds(start, step)
    mean = jnp.mean(_abs32(x))
    amax = jnp.max(_abs32(x))

    def cond(s):
        _, c, it = s
        return (c < k) & (it < rounds + 1)

    def body(s):
        _, _, it = s
        r = start - step * it.astype(jnp.float32)
        t = jnp.where(it < rounds, mean + r * (amax - mean), 0.0)
        return t, _count(x, t), it + 1

    init = varying_like((jnp.float32(0), jnp.int32(-1), jnp.int32(0)), x)
    t, c, it = lax.while_loop(cond, body, init)
    # it >= 1 here; report adaptation rounds after the first.
    t, c = lax.cond(
        c > k,
        lambda _: _top_k_above(x, t, c, k, buffer=4 * k),
        lambda _: (t, c),
        None,
    )
    return _selection(t, c, it - 1)


def gaussian_bracket(k, ub, t, c, t_lo, c_lo, t_hi, c_hi):
    """Gaussian-k's search bracket after probe ``t`` (count ``c``): the largest
    probe with too many (``> ub``) and the smallest with too few (``< k``).

    Elementwise: scalars for one tensor, per-segment arrays for many.
    """
    many = (c > ub) & (t > t_lo)
    few = (c < k) & (t < t_hi)
    return (
        jnp.where(many, t, t_lo),
        jnp.where(many, c, c_lo),
        jnp.where(few, t, t_hi),
        jnp.where(few, c, c_hi),
    )


@_flat_input
def gaussian_k(
    x: jax.Array,
    k: int,
    *,
    corrections: int = 3,
    lower: float = 2 / 3,
    upper: float = 4 / 3,
    refine: bool = True,
) -> Selection:
    """Gaussian-k (Shi et al.): threshold from a Gaussian fit, then corrections.

    ``t = mu + sigma * Phi^-1(1 - eta / 2)``; then up to ``corrections`` times,
    ``t *= 0.5`` if fewer than ``lower * k`` pass or ``t *= 1.5`` if more than
    ``upper * k`` pass.

    Deviation from the reference code, which sends whatever the corrections
    end with: down to ``lower * k``, nothing at all on constant data (the
    fit's ``t`` then equals every ``|x|``), and on data with a negative mean
    ``t = 0``, i.e. everything, of which a fixed-capacity message always holds
    the same first elements (the others would never be sent). With
    ``refine=True`` (default), if the count ends outside ``[k, upper * k]``,
    LDTE-BS's interpolation search on counts (:func:`ldte_bs`) continues from
    the bracket the probes left (else ``[0, max|x|]``) into that window;
    where ties make it impossible it ends on the "too many" side with the
    whole top-k tie group. So at least ``min(k, nnz)`` pass. On Laplacian
    data at ratio 1e-3 the Gaussian fit usually ends in ``[2k/3, k)``, so the
    search runs on most steps (measured +0.9 passes over the data at 2^22);
    ``refine=False`` is the reference algorithm exactly.

    Returns:
      A :class:`Selection`; ``iterations`` counts corrections plus search
      probes.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = gaussian_k(x, 3)
      >>> int(sel.count), x[jnp.abs(x) > sel.threshold].tolist()
      (3, [-4.0, 3.0, 6.0])
    """
    corrections = V.check_int("corrections", corrections, 0)
    n = x.shape[0]
    mean, var, _ = kernels.moments(x)
    eta = k / n
    t = mean + jnp.sqrt(var) * jax.scipy.special.ndtri(jnp.float32(1.0 - eta / 2.0))
    t = jnp.maximum(t, 0.0)
    c = _count(x, t)
    ub = math.floor(max(1.0, upper) * k)

    bracket = functools.partial(gaussian_bracket, k, ub)

    def cond(s):
        _, c, it, *_ = s
        return ((c < lower * k) | (c > upper * k)) & (it < corrections)

    def body(s):
        t, c, it, *br = s
        t = jnp.where(c < lower * k, t * 0.5, t * 1.5)
        c = _count(x, t)
        return (t, c, it + 1, *bracket(t, c, *br))

    none = (jnp.float32(-1), jnp.int32(n), jnp.float32(jnp.inf), jnp.int32(0))
    init = (t, c, jnp.int32(0), *bracket(t, c, *none))
    t, c, it, t_lo, c_lo, t_hi, c_hi = lax.while_loop(cond, body, varying_like(init, x))
    if not refine:
        return _selection(t, c, it)

    def search(_):
        lo_seen, hi_seen = t_lo >= 0, t_hi < jnp.inf
        # Nothing lies above max|x|: a pass only when no probe had too few.
        hi = lax.cond(hi_seen, lambda: t_hi, lambda: jnp.max(_abs32(x)))
        t2, c2, it2 = _search(
            x,
            k,
            jnp.where(lo_seen, t_lo, 0.0),
            hi,
            jnp.where(lo_seen, c_lo, n),  # 0 is never counted (lo_is_zero)
            jnp.where(hi_seen, c_hi, 0),
            upper=max(1.0, upper),
            search="interpolate",
            max_iters=40,
            delta=0.0,
            lo_is_zero=~lo_seen,
        )
        return t2, c2, it + it2

    t, c, it = lax.cond((c < k) | (c > ub), search, lambda _: (t, c, it), None)
    return _selection(t, c, it)


# random_k's draws come in rows of this many elements, each row from its own
# key: segmented.ROW, so that the packed form (one row of a segment per row of
# the buffer) draws what the 1-D form draws (tested).
RANDOM_ROW = 256


def random_scores(row_keys: jax.Array, row: int = RANDOM_ROW) -> jax.Array:
    """float32 ``(rows, row)`` uniform scores, row ``r`` drawn from ``row_keys[r]``.

    Each score is 30 random bits (uniform on ``2^30`` levels) shifted by the
    smallest normal float32's bit pattern and read as a float32: positive,
    normal and finite (below 4), ordered as the bits, so every ``k``-subset
    is equally likely to hold the ``k`` largest, ties apart (two equal draws:
    probability about ``n / 2^30`` that one sits at the ``k``-th of ``n``).
    Normal because XLA compares subnormals as zero (a 1/128 of 30-bit
    patterns would tie there); positive so that zero padding is below every
    score. The one home of ``random_k``'s draws: :func:`random_k` and its
    segmented form (:func:`jaxcomp.selection.segmented.random_scores`) take
    their rows from it.

    Example:
      >>> import jax
      >>> s = random_scores(jax.random.split(jax.random.key(0), 3))
      >>> s.shape, bool((s > 0).all() & (s < 4).all())
      ((3, 256), True)
    """
    bits = jax.vmap(lambda key: jax.random.bits(key, (row,), jnp.uint32))(row_keys)
    smallest_normal = jnp.uint32(0x00800000)
    return lax.bitcast_convert_type((bits >> 2) + smallest_normal, jnp.float32)


@_flat_input
def random_k(x: jax.Array, k: int, *, key: jax.Array) -> Selection:
    """k coordinates drawn uniformly without replacement (index-based).

    Draws are the top-k of i.i.d. uniform scores (every k-subset equally
    likely; :func:`random_scores`, row ``r`` of :data:`RANDOM_ROW` elements
    from ``fold_in(key, r)``), so the cost is one ``lax.top_k`` over random
    numbers, independent of ``x``'s values. ``threshold`` is meaningless (0)
    and ``count == k``; of equal draws at the k-th the lower index is taken
    (``lax.top_k``'s order), as the segmented form's capacity cut takes it.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.arange(10.0)
      >>> sel = random_k(x, 3, key=jax.random.key(0))
      >>> int(sel.count), len(set(sel.indices.tolist())), bool((sel.indices < 10).all())
      (3, 3, True)
    """
    n = x.shape[0]
    rows = -(-n // RANDOM_ROW)
    row_keys = jax.vmap(jax.random.fold_in, (None, 0))(key, jnp.arange(rows, dtype=jnp.int32))
    scores = random_scores(row_keys).reshape(-1)[:n]
    _, idx = lax.top_k(scores, k)
    sel = _selection(0.0, k)
    return sel._replace(indices=jnp.sort(idx).astype(jnp.int32))


# The selector functions by name, as sparsify(selector=...) and get_selector take them.
SELECTORS = {
    "top_k": exact_top_k,
    "sort_top_k": sort_top_k,
    "ldte_bs": ldte_bs,
    "binary_search": binary_search,
    "dgc": dgc_sample,
    "trimmed_top_k": trimmed_top_k,
    "gaussian_k": gaussian_k,
    "random_k": random_k,
    "threshold": fixed_threshold,
}


def get_selector(name: str):
    """Returns the selector function registered under ``name``.

    Example:
      >>> get_selector("top_k") is exact_top_k
      True
      >>> get_selector("nope")
      Traceback (most recent call last):
          ...
      ValueError: selector must be one of [...], got 'nope'
    """
    try:
        return SELECTORS[name]
    except KeyError:
        raise ValueError(f"selector must be one of {sorted(SELECTORS)}, got {name!r}") from None
