"""LDTE-BS and RedSync's binary search: a threshold from an estimate, corrected on counts.

LDTE-BS (``docs/algorithms.md`` section 2) fits a Laplace distribution to
the residual ``x``: the mean and variance (of a strided sample by default)
give ``mu`` and ``b = sqrt(var / 2)``, and the threshold whose expected
count is ``k`` is ``t = b * ln(cosh(mu / b) / eta)`` with ``eta = k / n``
(:func:`laplace_threshold`). One pass counts ``nnz = #{|x| > t}``. If
``nnz`` is outside ``[k, upper * k]`` a ``lax.while_loop`` searches
``[t, max|x|]`` (too many) or ``[0, t]`` (too few), recounting each probe,
until ``k <= nnz <= upper * k``, the bracket is narrower than ``delta`` (or
stops shrinking in float32), or ``max_iters`` probes were made
(:func:`threshold_search`; midpoint, Fibonacci or regula falsi probes on log
counts). :func:`binary_search` is that search alone, from ``[0, max|x|]``
(or RedSync's ``[mean|x|, max|x|]``).

When the estimate misses (the residual under error feedback is far from
Laplacian), :func:`ldte_bs` first counts, in one pass, thresholds read off
the strided sample's own quantiles for counts around the window and one
beyond each end, so that the window is usually hit, else the bracket is
tight. With a ``hint`` (the previous step's threshold, which the
sparsifiers pass) those probes join the estimate's pass on every call
rather than only after a miss: under error feedback the estimate misses on
most steps, and this saves the second pass those steps took.

If no threshold can satisfy the window (ties: more than ``upper * k``
values share the top magnitudes, as with all-ones, +-1 or small-integer
data; fewer than ``k`` nonzeros; the probe cap), the result is on the "too
many" side: the largest probed threshold that passes at least ``k`` (refined
to the exact top-k among its survivors if the bracket did not close), or 0
(all nonzeros) when fewer than ``k`` are nonzero. ``count`` may then exceed
the capacity ``ceil(upper * k)``: the sparsifier sends the ``capacity``
largest selected elements, ties to the lower index
(:func:`jaxcomp.selection.base.capacity_cut`), and keeps the rest in the
residual, so every step sends at least ``min(k, nnz)`` elements.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection import _kernels as kernels
from jaxcomp.selection.base import (
    Selection,
    abs32,
    count_above,
    count_above_many,
    exact_top_k,
    flat_input,
    just_below,
    make_selection,
    strided_sample,
    top_k_above,
)

__all__ = [
    "DEFAULT_MOMENT_SAMPLE",
    "MEDIAN_SAMPLE",
    "binary_search",
    "laplace_threshold",
    "ldte_bs",
]


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


def threshold_search(
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
        lo, hi, c_lo, c_hi, _, _, it, _, repeat, _ = s
        if search == "bisect":
            frac = jnp.float32(0.5)
        elif search == "fibonacci":
            frac = fib[it]
        else:
            frac = falsi_fraction(c_lo, c_hi, target, repeat)
        t = jnp.clip(lo + (hi - lo) * frac, lo, hi)
        return bracket_step(s, t, count_above(x, t), k, ub)

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
        c_lo_true = jnp.where(lo_zero, count_above(x, lo), c_lo)
        # When the bracket stopped before closing (probe cap, delta), lo may lie
        # well below the k-th value: refine to the exact top-k among lo's set.
        # After a closed bracket (adjacent floats: a tie) lo is that already.
        open_ = jnp.nextafter(lo, jnp.float32(jnp.inf)) < hi
        return lax.cond(
            (c_lo_true > cap) & open_,
            lambda: top_k_above(x, lo, c_lo_true, k, buffer=4 * cap),
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
    xs = x if moment_sample is None else strided_sample(x, moment_sample)
    if estimator == "moments":
        mean, var, _ = kernels.moments(xs)
        mu, b = mean, jnp.sqrt(var / 2.0)
    elif estimator == "mle":
        xs32 = xs.astype(jnp.float32)
        mu = jnp.median(strided_sample(xs32, MEDIAN_SAMPLE))
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

    ``sample``: ``strided_sample(x, sample_size)`` if the caller has it already.
    """
    n = x.shape[0]
    sample = abs32(strided_sample(x, sample_size) if sample is None else sample)
    m = sample.shape[0]
    ks = [max(1, min(m, math.ceil(f * aim * k / n * m))) for f in _PROBE_FACTORS]
    vals = lax.top_k(sample, max(ks))[0]
    # vals[j - 1] by a masked min: indexing lax.top_k's output makes XLA:CPU
    # rewrite it into a full sort (measured 12 vs 0.6 passes).
    iota = lax.iota(jnp.int32, vals.shape[0])
    return jnp.stack([just_below(jnp.min(jnp.where(iota < j, vals, jnp.inf))) for j in ks])


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


@flat_input
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

    The Laplace fit of :func:`laplace_threshold`, one counting pass, then a
    search on counts until ``k <= nnz <= upper * k``; the module docstring has
    the algorithm and what it returns when no threshold fits the window (at
    least ``min(k, nnz)`` elements, the excess cut by the sparsifier).

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
        (``search="interpolate"`` on a sampled tensor) join that pass too, on
        every call (module docstring: it saves a pass under error feedback).
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
        ts0, cs0 = t0[None], count_above(x, t0)[None]
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
        cs0 = count_above_many(x, ts0)
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
        sample = strided_sample(x, moment_sample)

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
    hi = lax.cond(need_max, lambda: jnp.max(abs32(x)), lambda: hi)
    c_hi = jnp.where(need_max, 0, c_hi)
    # The while loop starts at the current probe and runs zero times when it
    # is already in the window (no lax.cond around it: XLA:CPU runs
    # conditional branches as separate, slower computations).
    t, c, it2 = threshold_search(
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
    return make_selection(t, c, it + it2)


@flat_input
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
    amax = jnp.max(abs32(x))
    if start == "zero":
        t, c, it = threshold_search(
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
        return make_selection(t, c, it)
    m = jnp.mean(abs32(x))
    cm = count_above(x, m)
    ub = math.floor(upper * k)
    many = cm > ub
    t, c, it = threshold_search(
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
    return make_selection(jnp.where(ok, m, t), jnp.where(ok, cm, c), jnp.where(ok, 0, it + 1))


def falsi_fraction(c_lo, c_hi, target, repeat):
    """Where in ``[lo, hi]`` the next probe goes: regula falsi on ``log(count)``.

    Laplacian (exponential) tails make ``log(count)`` nearly linear in the
    threshold, so one or two probes usually land in ``[k, ub]``. Illinois-style
    safeguard: after the same end moved twice in a row (``repeat``), bisect
    once, so the search never stalls at one end. Shared by the per-leaf and
    the segmented search, which must probe the same thresholds.
    """
    f_lo = jnp.log(c_lo.astype(jnp.float32) + 1.0) - target
    f_hi = jnp.log(c_hi.astype(jnp.float32) + 1.0) - target
    interp = f_lo / jnp.maximum(f_lo - f_hi, 1e-6)
    return jnp.where(repeat, 0.5, jnp.clip(interp, 0.02, 0.98))


def bracket_step(state, t, c, k, ub):
    """The search state after probing threshold ``t`` with count ``c``.

    ``state`` is ``(lo, hi, c_lo, c_hi, t, c, it, last, repeat, lo_zero)``:
    too many above ``t`` (``c > ub``) raises ``lo`` to ``t``, too few
    (``c < k``) lowers ``hi``; ``last``/``repeat`` track which end moved (for
    :func:`falsi_fraction`'s safeguard). Shared by the per-leaf and the
    segmented search (per segment, elementwise).
    """
    lo, hi, c_lo, c_hi, _, _, it, last, _, lo_zero = state
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
