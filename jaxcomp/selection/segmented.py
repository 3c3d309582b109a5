"""Selection for many tensors at once: one buffer, one loop, a threshold per segment.

A model's gradients are tens to hundreds of leaves. Selecting each leaf on
its own makes one program piece per leaf (every ``while_loop``, every
conditional and every counting pass again), so compile time and, on a GPU,
kernel launches grow with the leaf count. Here the leaves (the *segments*)
are packed into one 2-D buffer of rows of :data:`ROW` elements, each segment
starting on a row of its own and padded with zeros to whole rows::

    segment:   0 0 0 0 0 | 1 1 1 1 1 | 1 1 . . . | 2 2 2 . . |     (ROW = 5)
    row:           0           1           2           3

and every selector decides all segments together: one counting pass counts
every segment against its own threshold (a per-row threshold, the row counts
summed per segment), one ``while_loop`` iterates until every segment's
search has converged (a converged segment stays fixed while the others go
on). A segment's result depends on its own elements only: each row holds one
segment, the per-row reductions see one segment's elements, and the
row-to-segment sums run in row order. So a leaf selected with a hundred others
gets the threshold it gets alone (tested bit for bit).

Padding zeros never pass a threshold (``|0| > t`` is false for ``t >= 0``,
and every threshold here is ``>= 0``) and never raise a maximum; sums that
padding would change (the moments) mask it out.

``k`` is an int32 array (one per segment) and may be traced: a warm-up
schedule picks a row of a static table by the step, and the one compiled
selector serves every phase.

Selectors with a segmented form are in :data:`SEGMENTED` (by the 1-D
selector they stand for): ``exact_top_k`` (the same threshold and count bit
for bit: the k-th largest magnitude found by a search on float32 bit
patterns instead of ``lax.top_k``), ``fixed_threshold`` (bit for bit),
``binary_search`` (bit for bit from zero), ``ldte_bs``, ``dgc_sample``,
``trimmed_top_k``, ``gaussian_k`` and ``sidco`` (the same algorithm per segment; see
each for what differs from the 1-D form) and ``random_k`` (the same draws: a
per-row stream of each segment's key, selected by exact top-k on the scores,
with the capacity cut at ``k`` the same coordinates). A form in :data:`SCORES`
selects on a score buffer of its own (``random_k``: its draws) rather than
on ``|x|``: the caller runs selector, capacity cut and mask on that buffer.

Layout of the code: the packed buffer (:class:`SegmentLayout`,
:class:`Targets`, :class:`SegmentSelection`) and its one-pass kernels
(counts, maximum, k-th largest, moments, samples, the capacity cut and the
message extraction) are in :mod:`jaxcomp.selection.packed`, re-exported
here; this module holds the segmented selectors, :data:`SEGMENTED` and
:data:`SCORES`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection import selectors as S1
from jaxcomp.selection.ldte import bracket_step, falsi_fraction
from jaxcomp.selection.multistage import sidco_segmented

# What moved to packed stays importable from here (sparsify and users read it as
# segmented.<name>): hence the noqa on names only re-exported.
from jaxcomp.selection.packed import (
    ROW,
    SegmentLayout,
    SegmentSelection,
    Targets,
    abs32,
    capacity_cut,
    compact,  # noqa: F401 (re-exported)
    count_above,
    count_above_many,
    expand,  # noqa: F401 (re-exported)
    extract,  # noqa: F401 (re-exported)
    float32_above,  # noqa: F401 (re-exported)
    just_below,
    kth_largest_above,
    moments,
    rounded_product,
    segment_max,
    sent_mask,  # noqa: F401 (re-exported)
    strided_layout,
    strided_samples,
)

__all__ = [
    "ROW",
    "SCORES",
    "SEGMENTED",
    "SegmentLayout",
    "SegmentSelection",
    "Targets",
    "binary_search",
    "capacity_cut",
    "dgc_sample",
    "exact_top_k",
    "fixed_threshold",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "random_scores",
    "sidco_segmented",
    "trimmed_top_k",
]


# ---------------------------------------------------------------------------
# Selectors.
# ---------------------------------------------------------------------------


def _selection(t, c, it) -> SegmentSelection:
    return SegmentSelection(
        jnp.asarray(t, jnp.float32), jnp.asarray(c, jnp.int32), jnp.asarray(it, jnp.int32)
    )


def exact_top_k(layout: SegmentLayout, x: jax.Array, targets: Targets) -> SegmentSelection:
    """Exact top-k of every segment: ``selectors.exact_top_k`` bit for bit.

    The k-th largest magnitude comes from the bit-pattern search (at most 10
    passes of 8 probes) instead of ``lax.top_k``: the same float32 value, so
    the same threshold (the float just below it) and count.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxcomp.selection import selectors
      >>> a, b = jnp.array([0.5, -4.0, 1.0, 3.0]), jnp.array([2.0, 1.0, 1.0, 1.0, 6.0])
      >>> layout = SegmentLayout((4, 5))
      >>> sel = exact_top_k(layout, layout.pack([a, b], jnp.float32), Targets(np.array([[2, 2]])))
      >>> bool(sel.threshold[0] == selectors.exact_top_k(a, 2).threshold), sel.count.tolist()
      (True, [2, 2])
    """
    k = targets.k
    n = jnp.asarray(np.asarray(layout.sizes, np.int32))
    kth = kth_largest_above(
        layout, x, jnp.zeros_like(k, jnp.float32), n, k, top=segment_max(layout, x)
    )
    # lax.top_k's k-th value: the k-th largest |x| (0 when fewer than k are nonzero).
    t = just_below(kth)
    return _selection(t, count_above(layout, x, t), jnp.zeros_like(k))


def _top_k_above(layout, x, t, c, k, refine, top):
    """Where ``refine``: the exact top-k threshold among ``{|x| > t}`` (``c >= k`` of them)."""
    kth = kth_largest_above(layout, x, t, c, k, top=top, active=refine)
    t2 = jnp.where(refine, just_below(kth), t)
    c2 = count_above(layout, x, t2)
    return t2, jnp.where(refine, c2, c)


def _log_cosh(z):
    z = jnp.abs(z)
    return z + jnp.log1p(jnp.exp(-2.0 * z)) - math.log(2.0)


# Laplace-model probes counted with the estimate: thresholds whose expected
# count is f * aim * k (t0 - b ln f), as ldte_bs's sample-quantile probes.
_PROBE_FACTORS = (2.4, 1.16, 0.84, 0.4)


def ldte_bs(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    search: str = "interpolate",
    aim: float = 1.25,
    moment_sample: int | None = S1.DEFAULT_MOMENT_SAMPLE,
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
    exact_below: int = 0,
    hint: jax.Array | None = None,
    probes: bool = True,
    estimator: str = "moments",
) -> SegmentSelection:
    """LDTE-BS for every segment (``selectors.ldte_bs``).

    Per segment: the Laplace fit of the (strided-sample) moments (or, with
    ``estimator="mle"``, the sample's median ``mu`` and ``b = mean|x - mu|``)
    gives ``t0 = b ln(cosh(mu/b) / eta)``; one pass counts ``t0``, the ``hint``
    (the previous threshold) and, with ``probes``, four thresholds
    ``t0 - b ln f`` whose expected counts under the fit are ``f`` times the
    aim; the first in ``[k, upper k]`` is kept (the estimate, then the
    hint, then the probe nearest the aim), else the search (bisection,
    Fibonacci or interpolation on log counts) runs from the bracket they
    leave, every segment in one ``while_loop``. Where no threshold fits the
    window (ties, fewer than k nonzeros, the probe cap) the result is the
    1-D selector's: the exact top-k among the "too many" end's survivors.

    What differs from the 1-D selector: the moments (``mean|x - mu|``) are
    summed by rows (the estimate can differ in its last bits; the median is
    ``jnp.median``'s bit for bit), and the improved variant's probes
    come from the Laplace fit rather than the sample's quantiles (no
    per-segment ``top_k`` of the sample). ``probes=False, hint=None,
    search="bisect", aim=1, moment_sample=None`` is the paper's algorithm.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> parts = [jax.random.laplace(jax.random.key(i), (n,)) for i, n in enumerate((5000, 800))]
      >>> layout = SegmentLayout((5000, 800))
      >>> sel = ldte_bs(layout, layout.pack(parts, jnp.float32), Targets(np.array([[50, 8]])))
      >>> [bool(k <= int(c) <= 1.5 * k) for k, c in zip((50, 8), sel.count)]
      [True, True]
    """
    # The estimate's float sums must not fuse with whatever produced x (the
    # accumulation, a backward pass): their rounding would then depend on the
    # program around the selector, and a group would not get the same
    # threshold in a packed step and alone (the overlap path).
    x = lax.optimization_barrier(x)
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    ub_tab = np.floor(upper * ktab).astype(np.int64)
    ub = targets.pick(ub_tab.astype(np.int32))
    cap = targets.pick(np.minimum(sizes, np.ceil(upper * ktab)).astype(np.int32))
    n = jnp.asarray(sizes.astype(np.int32))
    # The estimate.
    V.check_choice("estimator", estimator, ("moments", "mle"))
    ml, mx = layout, x
    if moment_sample is not None:
        ml, strides = strided_layout(layout, lambda _: moment_sample)
        mx = strided_samples(layout, x, ml, strides)
    if estimator == "moments":
        mean, var = moments(ml, mx)
        b = jnp.sqrt(var / 2.0)
    else:
        # The median of at most MEDIAN_SAMPLE elements, as selectors.laplace_threshold.
        medl, strides = strided_layout(ml, lambda _: S1.MEDIAN_SAMPLE)
        mean = _segment_median(medl, strided_samples(ml, mx, medl, strides))
        b = _segment_mean_abs(ml, mx.astype(jnp.float32) - ml.per_row(mean)[:, None])
    eta = targets.pick(np.minimum(1.0, aim * ktab / np.maximum(sizes, 1)).astype(np.float32))
    safe_b = jnp.where(b > 0, b, 1.0)
    t0 = safe_b * (_log_cosh(mean / safe_b) - jnp.log(eta))
    t0 = jnp.maximum(jnp.where(b > 0, t0, 0.0), 0.0)
    # The first pass: estimate, hint, probes.
    cands = [t0]
    if hint is not None:
        h = jnp.asarray(hint, jnp.float32)
        cands.append(jnp.where(jnp.isfinite(h) & (h >= 0), h, t0))
    if probes:
        cands += [jnp.maximum(t0 - rounded_product(b, math.log(f)), 0.0) for f in _PROBE_FACTORS]
    ts0 = jnp.stack(cands, axis=1)
    cs0 = (
        count_above_many(layout, x, ts0) if len(cands) > 1 else count_above(layout, x, t0)[:, None]
    )
    if hint is not None:
        # A hint with nothing above it brackets no better than max|x|: drop it.
        drop = (jnp.arange(ts0.shape[1]) == 1)[None, :] & (cs0 == 0)
        ts0 = jnp.where(drop, t0[:, None], ts0)
        cs0 = jnp.where(drop, cs0[:, :1], cs0)
    preferred = 2 if hint is not None else 1
    t, c = _choose(ts0, cs0, k, ub, aim, preferred)
    lo, c_lo, hi, c_hi, hi_known = _bracket(ts0, cs0, k, ub, n)
    hi = jnp.where(hi_known, hi, segment_max(layout, x))
    c_hi = jnp.where(hi_known, c_hi, 0)
    t, c, it, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t, c, lo == 0,
        upper=upper, search=search, max_iters=max_iters, delta=delta,
    )  # fmt: skip
    t, c = _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero)
    if exact_below:
        small = jnp.asarray(sizes < exact_below)
        if bool(np.any(sizes < exact_below)):
            ex = exact_top_k(layout, x, targets)
            t = jnp.where(small, ex.threshold, t)
            c = jnp.where(small, ex.count, c)
            it = jnp.where(small, 0, it)
    return _selection(t, c, it)


def _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero, searched=None):
    """Where the search ended outside ``[k, ub]``: ldte.threshold_search's fallback.

    The "too many" end ``lo`` (its count, when it was never counted), refined
    to the exact top-k among its survivors when more than ``cap`` pass and
    the bracket did not close. Segments not ``searched`` keep ``(t, c)``.
    """
    feasible = (c >= k) & (c <= ub)
    if searched is not None:
        feasible = feasible | ~searched
    c_lo_true = jnp.where(lo_zero, count_above(layout, x, lo), c_lo)
    open_ = jnp.nextafter(lo, jnp.float32(jnp.inf)) < hi
    refine = ~feasible & (c_lo_true > cap) & open_

    def fallback(_):
        t2, c2 = _top_k_above(layout, x, lo, c_lo_true, k, refine, hi)
        return jnp.where(feasible, t, t2), jnp.where(feasible, c, c2)

    def plain(_):
        return jnp.where(feasible, t, lo), jnp.where(feasible, c, c_lo_true)

    return lax.cond(jnp.any(refine), fallback, plain, None)


def _choose(ts, cs, k, ub, aim, preferred):
    """Per segment ``ldte._choose``: the first preferred candidate in the
    window, else the one in it nearest ``aim * k``, else the first."""
    in_window = (cs >= k[:, None]) & (cs <= ub[:, None])
    target = jnp.log(aim * k.astype(jnp.float32))
    miss = jnp.abs(jnp.log(cs.astype(jnp.float32) + 1.0) - target[:, None])
    rank = jnp.where(jnp.arange(ts.shape[1])[None, :] < preferred, -1.0, miss)
    first = jnp.argmin(jnp.where(in_window, rank, jnp.inf), axis=1)
    first = jnp.where(jnp.any(in_window, axis=1), first, 0)
    pick = jnp.take_along_axis
    return pick(ts, first[:, None], 1)[:, 0], pick(cs, first[:, None], 1)[:, 0]


def _bracket(ts, cs, k, ub, n):
    """Per segment ``ldte._bracket``."""
    many, few = cs > ub[:, None], cs < k[:, None]
    any_many = jnp.any(many, axis=1)
    lo = jnp.where(any_many, jnp.max(jnp.where(many, ts, -jnp.inf), axis=1), 0.0)
    c_lo = jnp.where(any_many, jnp.min(jnp.where(many, cs, n[:, None]), axis=1), n)
    hi_known = jnp.any(few, axis=1)
    hi = jnp.where(hi_known, jnp.min(jnp.where(few, ts, jnp.inf), axis=1), ts[:, 0])
    c_hi = jnp.where(hi_known, jnp.max(jnp.where(few, cs, -1), axis=1), cs[:, 0])
    return lo, c_lo.astype(jnp.int32), hi, c_hi.astype(jnp.int32), hi_known


def _search(layout, x, k, ub, lo, hi, c_lo, c_hi, t, c, lo_zero, *, upper, search, max_iters,
            delta):  # fmt: skip
    """``ldte.threshold_search``'s loop for every segment at once.

    Returns ``(t, c, iterations, lo, c_lo, hi, lo_zero)``; a segment stops
    when its count is in ``[k, ub]``, its bracket no longer shrinks (or is
    below ``delta``) or after ``max_iters`` probes; the loop runs while any
    segment goes on.
    """
    kf = k.astype(jnp.float32)
    target = jnp.log(jnp.sqrt(kf * jnp.maximum(ub.astype(jnp.float32), kf)) + 1.0)
    fib = S1.fibonacci_fractions(max_iters)

    def running(s):
        lo, hi, _, _, _, c, it, _, _, _ = s
        feasible = (c >= k) & (c <= ub)
        mid = lo + rounded_product(hi - lo, 0.5)
        stuck = (mid <= lo) | (mid >= hi) | (hi - lo <= delta)
        return ~feasible & ~stuck & (it < max_iters)

    def body(s):
        go = running(s)
        lo, hi, c_lo, c_hi, _, _, it, _, repeat, _ = s
        if search == "bisect":
            frac = jnp.float32(0.5)
        elif search == "fibonacci":
            frac = fib[jnp.minimum(it, fib.shape[0] - 1)]
        else:
            frac = falsi_fraction(c_lo, c_hi, target, repeat)
        t = jnp.clip(lo + rounded_product(hi - lo, frac), lo, hi)
        new = bracket_step(s, t, count_above(layout, x, t), k, ub)
        return tuple(jnp.where(go, a, b) for a, b in zip(new, s, strict=True))

    zeros = jnp.zeros_like(k)
    init = (lo, hi, c_lo, c_hi, t, c, zeros, zeros, jnp.zeros_like(k, jnp.bool_), lo_zero)
    init = varying_like(init, x)
    s = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    lo, hi, c_lo, _, t, c, it, _, _, lo_zero = s
    return t, c, it, lo, c_lo, hi, lo_zero


_ROUNDS = 2  # decay rounds counted per pass (two thresholds cost about one: _row_counts_many)


def _decay_rounds(layout, x, t, running, decay, at, rounds=_ROUNDS):
    """DGC's adaptation rounds for every segment, both rules: from ``(t, count,
    0)``, while ``running((t, c, it))``: ``t = (t * decay).astype(float32)``,
    ``c`` the count above ``at(t)``, ``it + 1``.

    The thresholds a segment would try next are known in advance, so one
    pass counts the next ``rounds`` of them for every segment
    (:func:`count_above_many`) and each segment takes them in order until it
    stops: the same ``(t, c, it)`` as a round per pass, in a pass per
    ``rounds`` rounds (the first pass also counts the start ``t``). Only a
    round's count is ever taken for a segment, never a later one's, so a
    stopped segment stays stopped.
    """

    def chain(t, m):
        out = []
        for _ in range(m):
            # Each product rounded on its own: XLA would fold (t * d) * d into t * (d * d).
            t = lax.optimization_barrier((t * decay).astype(jnp.float32))
            out.append(t)
        return out

    def counts(ts):
        cs = count_above_many(layout, x, jnp.stack([at(u) for u in ts], axis=1))
        return [cs[:, j] for j in range(len(ts))]

    def advance(s, ts, cs):
        for tj, cj in zip(ts, cs, strict=True):
            go = running(s)
            t, c, it = s
            s = jnp.where(go, tj, t), jnp.where(go, cj, c), jnp.where(go, it + 1, it)
        return s

    ts = [t, *chain(t, rounds - 1)]
    cs = counts(ts)
    s = advance((t, cs[0], jnp.zeros_like(cs[0])), ts[1:], cs[1:])

    def body(s):
        ts = chain(s[0], rounds)
        return advance(s, ts, counts(ts))

    return lax.while_loop(lambda s: jnp.any(running(s)), body, varying_like(s, x))


def dgc_sample(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    sample_ratio: float = 0.01,
    upper: float = 1.3,
    decay: float = 0.8,
    max_adaptations: int = 10,
    rule: str = "reference",
    key: jax.Array | None = None,
    start: jax.Array | None = None,
) -> SegmentSelection:
    """DGC's selection for every segment, as ``selectors.dgc_sample`` bit for bit.

    The strided sample's threshold (its ``ks``-th largest magnitude, found by
    the bit-pattern search: ``lax.top_k``'s value), the adaptation rounds in
    one loop, and the exact top-k among the survivors where the rule asks
    for it. ``key``: a batch of PRNG keys, one per segment (segment ``s``
    starts its sample at ``selectors.dgc_start(key[s], stride)``); ``start``:
    the starts themselves (int32 per segment); neither: 0.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxcomp.selection import selectors
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = dgc_sample(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> int(sel.count[0]), bool(sel.threshold[0] == selectors.dgc_sample(x, 3).threshold)
      (3, True)
    """
    rule, sample_ratio, upper, max_adaptations = S1.check_dgc_options(
        rule, sample_ratio, upper, decay, max_adaptations
    )
    if rule == "at_least_k":
        return _dgc_at_least_k(layout, x, targets, sample_ratio, upper, decay, max_adaptations)
    k = targets.k
    sizes = np.asarray(layout.sizes, np.int64)
    # The reference's set-up per phase and segment: (stride, num_samples, top_k_samples).
    setup = np.asarray(
        [
            [
                S1.dgc_sampling(int(n), int(kk), sample_ratio)
                for kk, n in zip(row, sizes, strict=True)
            ]
            for row in targets.table
        ],
        np.int64,
    ).reshape(len(targets.table), len(sizes), 3)
    strides, m, ks_tab = setup[..., 0], setup[..., 1], setup[..., 2]
    whole_tab = m == sizes[None, :]
    # The sample's slots: the whole segment, or num_samples + 1 (importance[start::stride]).
    lengths = np.where(whole_tab, sizes[None, :], m + 1)
    sl = SegmentLayout(tuple(int(v) for v in lengths.max(axis=0)), layout.row)
    stride = targets.pick(strides.astype(np.int32))
    length = targets.pick(lengths.astype(np.int32))
    whole = targets.pick(whole_tab)
    if start is not None:
        first = jnp.asarray(start, jnp.int32)
    elif key is not None:
        first = jax.vmap(S1.dgc_start)(key, stride)
    else:
        first = jnp.zeros_like(k)
    first = jnp.where(whole, 0, first)
    n_seg = jnp.asarray(sizes.astype(np.int32))
    if sl.sizes == layout.sizes and whole_tab.all():
        sample = x
    else:
        if layout.num_rows * layout.row >= 2**31:
            raise ValueError("segmented selection: buffers beyond 2^31 elements are not supported")
        j = jnp.asarray(sl.row_offset)[:, None] + lax.broadcasted_iota(
            jnp.int32, (sl.num_rows, sl.row), 1
        )
        pos = sl.per_row(first)[:, None] + j * sl.per_row(stride)[:, None]
        ok = sl.valid() & (j < sl.per_row(length)[:, None]) & (pos < sl.per_row(n_seg)[:, None])
        base = jnp.asarray((layout.starts * layout.row).astype(np.int32))[sl.row_segment]
        picked = x.reshape(-1)[jnp.where(ok, base[:, None] + pos, 0)]
        sample = jnp.where(ok, picked, jnp.zeros((), x.dtype))
    ks = targets.pick(ks_tab.astype(np.int32))
    t = kth_largest_above(
        sl, sample, jnp.zeros_like(k, jnp.float32), length, ks, top=segment_max(sl, sample)
    )
    lo_tab, hi_tab = S1.dgc_bounds(targets.table, upper, decay)
    lo = None if lo_tab is None else targets.pick(lo_tab.astype(np.int32))
    hi = targets.pick(hi_tab.astype(np.int32))

    def survivors(t, c):
        return jnp.where(t > 0, c, n_seg)

    def running(s):
        t, c, it = s
        return ~whole & S1.below_decay(survivors(t, c), k, lo, decay) & (it < max_adaptations)

    t, c, it = _decay_rounds(layout, x, t, running, decay, just_below)
    refine = ~whole & (survivors(t, c) > hi) & (it < max_adaptations)
    return _dgc_refined(layout, x, k, just_below(t), c, it, refine)


def _dgc_at_least_k(layout, x, targets, sample_ratio, upper, decay, max_adaptations):
    """``selectors.dgc_sample(rule="at_least_k")`` for every segment."""
    k = targets.k
    sizes = np.asarray(layout.sizes, np.int64)
    sl, strides = strided_layout(layout, lambda n: max(1, math.ceil(sample_ratio * n)))
    m = np.asarray(sl.sizes, np.int64)
    ks_tab = np.asarray(
        [
            [
                S1.target_count(kk / n, mm) if n else 0
                for kk, n, mm in zip(row, sizes, m, strict=True)
            ]
            for row in targets.table
        ],
        np.int32,
    )
    sample = strided_samples(layout, x, sl, strides)
    ks = targets.pick(ks_tab)
    kth = kth_largest_above(
        sl, sample, jnp.zeros_like(k, jnp.float32), jnp.asarray(m.astype(np.int32)), ks,
        top=segment_max(sl, sample),
    )  # fmt: skip

    def running(s):
        t, c, it = s
        return (c < k) & (it < max_adaptations) & (t > 0)

    t, c, it = _decay_rounds(layout, x, just_below(kth), running, decay, lambda t: t)
    hi = targets.pick(np.ceil(upper * targets.table).astype(np.int32))
    return _dgc_refined(layout, x, k, t, c, it, c > hi)


def _dgc_refined(layout, x, k, t, c, it, refine) -> SegmentSelection:
    """DGC's last step, both rules: the exact top-k among the survivors where
    ``refine`` (one more iteration counted there)."""
    t, c = lax.cond(
        jnp.any(refine),
        lambda _: _top_k_above(layout, x, t, c, k, refine, segment_max(layout, x)),
        lambda _: (t, c),
        None,
    )
    return _selection(t, c, it + refine.astype(jnp.int32))


def binary_search(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    start: str = "zero",
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
) -> SegmentSelection:
    """RedSync's threshold bisection for every segment (``selectors.binary_search``).

    ``start="zero"`` bisects ``[0, max|x|]`` per segment: the 1-D selector's
    threshold, count and probes bit for bit (halving a float32 interval is
    exact). ``start="mean"`` starts from ``mean|x|`` (summed by rows: its
    last bits can differ from the 1-D selector's). Where no threshold lands
    in ``[k, upper k]`` (ties) the 1-D selector's fallback: the exact top-k
    among the "too many" end's survivors.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = binary_search(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> float(sel.threshold[0]), int(sel.count[0]), int(sel.iterations[0])
      (1.5, 4, 2)
    """
    S1.check_search_options("bisect", upper, max_iters, delta)
    V.check_choice("start", start, ("zero", "mean"))
    x = lax.optimization_barrier(x)
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    n = jnp.asarray(sizes.astype(np.int32))
    ub = targets.pick(np.floor(upper * ktab).astype(np.int32))
    cap = targets.pick(np.minimum(sizes, np.ceil(upper * ktab)).astype(np.int32))
    amax = segment_max(layout, x)
    zeros = jnp.zeros_like(k)
    if start == "zero":
        lo, hi, c_lo, c_hi = jnp.zeros_like(amax), amax, n, zeros
        lo_zero = jnp.ones_like(k, jnp.bool_)
        ok = ~lo_zero  # nothing decided before the search
        m, cm = amax, zeros
    else:
        m = _segment_mean_abs(layout, x)
        cm = count_above(layout, x, m)
        many = cm > ub
        ok = (cm >= k) & (cm <= ub)
        lo, hi = jnp.where(many, m, 0.0), jnp.where(many, amax, m)
        c_lo, c_hi, lo_zero = jnp.where(many, cm, n), jnp.where(many, 0, cm), ~many
    # The first probe is hi (count c_hi < k); a segment already in the window
    # (the mean's count) does not search.
    t0, c0 = jnp.where(ok, m, hi), jnp.where(ok, cm, c_hi)
    t, c, it, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t0, c0, lo_zero,
        upper=upper, search="bisect", max_iters=max_iters, delta=delta,
    )  # fmt: skip
    t, c = _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero, searched=~ok)
    if start == "mean":
        it = jnp.where(ok, 0, it + 1)
    return _selection(t, c, it)


def fixed_threshold(
    layout: SegmentLayout, x: jax.Array, targets: Targets, *, threshold: float
) -> SegmentSelection:
    """``selectors.fixed_threshold`` for every segment: one count of ``|x| > threshold``.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((5, 3))
      >>> buf = layout.pack([x[:5], x[5:]], jnp.float32)
      >>> fixed_threshold(layout, buf, Targets(np.array([[1, 1]])), threshold=2.5).count.tolist()
      [2, 1]
    """
    zeros = jnp.zeros_like(targets.k)
    # May be an injected (traced) hyperparameter.
    t = zeros.astype(jnp.float32) + jnp.float32(threshold)
    return _selection(t, count_above(layout, x, t), zeros)


def _segment_mean_abs(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 mean of ``|x|`` per segment (summed by rows; 0 for an empty one)."""
    total = layout.segment_sum(jnp.sum(jnp.where(layout.valid(), abs32(x), 0.0), axis=1))
    n = jnp.asarray(np.maximum(np.asarray(layout.sizes, np.float64), 1).astype(np.float32))
    return total / n


def _segment_median(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 ``jnp.median`` of each segment (NaN for an empty one), bit for bit.

    One sort of the whole buffer keyed by (segment, value), the padding
    keyed past the last segment; a segment's ``n`` values then sit at its
    offset among the sorted ones, and the median is the midpoint of the two
    middle ones as ``jnp.median`` computes it.
    """
    sizes = np.asarray(layout.sizes, np.int64)
    if layout.num_rows == 0:
        return jnp.full((layout.num_segments,), jnp.nan, jnp.float32)
    seg = jnp.where(layout.valid(), jnp.asarray(layout.row_segment)[:, None], layout.num_segments)
    _, vals = lax.sort((seg.reshape(-1), x.astype(jnp.float32).reshape(-1)), num_keys=2)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    low = jnp.asarray((off + np.maximum(sizes - 1, 0) // 2).astype(np.int32))
    high = jnp.asarray((off + sizes // 2).astype(np.int32))
    mid = (vals[low] + vals[jnp.minimum(high, vals.shape[0] - 1)]) * jnp.float32(0.5)
    return jnp.where(jnp.asarray(sizes > 0), mid, jnp.nan)


def trimmed_top_k(
    layout: SegmentLayout, x: jax.Array, targets: Targets, *, start: float = 0.8,
    step: float = 0.2,
) -> SegmentSelection:  # fmt: skip
    """RedSync's trimmed top-k for every segment (``selectors.trimmed_top_k``).

    Per segment the thresholds ``mean + r (max - mean)`` of ``|x|`` for
    ``r = start, start - step, ..., 0``, then 0, until at least ``k`` pass,
    all segments in one loop; then the exact top-k among the survivors where
    more than ``k`` pass. So the result is the exact top-k (all nonzeros
    when fewer than ``k``); the mean (summed by rows) can differ from the 1-D
    selector's in its last bits, which can move ``iterations`` only when a
    magnitude sits at a round's threshold.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = trimmed_top_k(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> int(sel.count[0]), int(sel.iterations[0])  # as selectors.trimmed_top_k
      (3, 4)
    """
    rounds = S1.trim_rounds(start, step)
    x = lax.optimization_barrier(x)
    k = targets.k
    mean = _segment_mean_abs(layout, x)
    amax = segment_max(layout, x)

    def running(s):
        _, c, it = s
        return (c < k) & (it < rounds + 1)

    def body(s):
        go = running(s)
        t_old, c_old, it = s
        r = start - step * it.astype(jnp.float32)
        t = jnp.where(it < rounds, mean + rounded_product(r, amax - mean), 0.0)
        c = count_above(layout, x, t)
        return jnp.where(go, t, t_old), jnp.where(go, c, c_old), jnp.where(go, it + 1, it)

    init = varying_like((jnp.zeros_like(mean), jnp.full_like(k, -1), jnp.zeros_like(k)), x)
    t, c, it = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    refine = c > k
    t, c = lax.cond(
        jnp.any(refine),
        lambda _: _top_k_above(layout, x, t, c, k, refine, amax),
        lambda _: (t, c),
        None,
    )
    return _selection(t, c, it - 1)


def gaussian_k(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    corrections: int = 3,
    lower: float = 2 / 3,
    upper: float = 4 / 3,
    refine: bool = True,
) -> SegmentSelection:
    """Gaussian-k for every segment (``selectors.gaussian_k``).

    Per segment ``t = mu + sigma Phi^-1(1 - eta / 2)`` from the segment's
    moments, then up to ``corrections`` rounds of ``t *= 0.5`` (fewer than
    ``lower k`` pass) or ``t *= 1.5`` (more than ``upper k``), every segment
    in one loop; with ``refine`` the interpolation search on counts
    continues, for the segments that ended outside ``[k, upper k]``, from
    the bracket the rounds left, as the 1-D selector does. The moments are
    summed by rows, so the fit can differ from the 1-D selector's in its
    last bits.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> parts = [jax.random.laplace(jax.random.key(i), (n,)) for i, n in enumerate((5000, 800))]
      >>> layout = SegmentLayout((5000, 800))
      >>> sel = gaussian_k(layout, layout.pack(parts, jnp.float32), Targets(np.array([[50, 8]])))
      >>> [bool(k <= int(c) <= 4 / 3 * k) for k, c in zip((50, 8), sel.count)]
      [True, True]
    """
    corrections = V.check_int("corrections", corrections, 0)
    x = lax.optimization_barrier(x)  # as in ldte_bs: the fit's sums on their own
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    n = jnp.asarray(sizes.astype(np.int32))
    mean, var = moments(layout, x)
    # 1 - eta / 2 in float64, then float32, as the 1-D selector's constant.
    p = targets.pick((1.0 - ktab / np.maximum(sizes, 1) / 2.0).astype(np.float32))
    t = jnp.maximum(mean + rounded_product(jnp.sqrt(var), jax.scipy.special.ndtri(p)), 0.0)
    c = count_above(layout, x, t)
    too_few = targets.pick((lower * ktab).astype(np.float32))
    too_many = targets.pick((upper * ktab).astype(np.float32))
    ub = targets.pick(np.floor(max(1.0, upper) * ktab).astype(np.int32))

    bracket = functools.partial(S1.gaussian_bracket, k, ub)

    def running(s):
        _, c, it, *_ = s
        cf = c.astype(jnp.float32)
        return ((cf < too_few) | (cf > too_many)) & (it < corrections)

    def body(s):
        go = running(s)
        t, c, it, *br = s
        t2 = jnp.where(c.astype(jnp.float32) < too_few, t * 0.5, t * 1.5)
        c2 = count_above(layout, x, t2)
        new = (t2, c2, it + 1, *bracket(t2, c2, *br))
        return tuple(jnp.where(go, a, b) for a, b in zip(new, s, strict=True))

    none = (jnp.full_like(t, -1.0), n, jnp.full_like(t, jnp.inf), jnp.zeros_like(k))
    init = varying_like((t, c, jnp.zeros_like(k), *bracket(t, c, *none)), x)
    t, c, it, t_lo, c_lo, t_hi, c_hi = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    if not refine:
        return _selection(t, c, it)
    search = (c < k) | (c > ub)
    lo_seen, hi_seen = t_lo >= 0, t_hi < jnp.inf
    # Nothing lies above max|x|: a pass only when no probe had too few.
    hi = jnp.where(hi_seen, t_hi, segment_max(layout, x))
    c_hi = jnp.where(hi_seen, c_hi, 0)
    lo = jnp.where(lo_seen, t_lo, 0.0)
    c_lo = jnp.where(lo_seen, c_lo, n)  # 0 is never counted (lo_zero)
    # The search's first probe is hi (count c_hi < k), as the 1-D selector's.
    t0, c0 = jnp.where(search, hi, t), jnp.where(search, c_hi, c)
    t2, c2, it2, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t0, c0, ~lo_seen,
        upper=max(1.0, upper), search="interpolate", max_iters=40, delta=0.0,
    )  # fmt: skip
    cap = targets.pick(np.minimum(sizes, np.ceil(max(1.0, upper) * ktab)).astype(np.int32))
    t2, c2 = _settle(layout, x, k, ub, cap, t2, c2, lo, c_lo, hi, lo_zero, searched=search)
    return _selection(t2, c2, it + jnp.where(search, it2, 0))


def random_scores(layout: SegmentLayout, x: jax.Array, key: jax.Array) -> jax.Array:
    """``random_k``'s score buffer: a uniform draw per element, 0 in the padding.

    Row ``r`` of segment ``s`` (its ``r``-th row) draws from ``fold_in(key[s],
    r)`` (:func:`jaxcomp.selection.selectors.random_scores`: positive finite
    float32 scores on ``2^30`` levels), so a segment's draws depend on its own
    key and size only, whatever it is packed with, and with the default row
    they are the 1-D ``random_k``'s draws. ``x`` (the accumulator) only gives
    the device variance: its values take no part.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layout = SegmentLayout((300, 5))
      >>> s = random_scores(layout, jnp.zeros((3, ROW)), jax.random.split(jax.random.key(0), 2))
      >>> int((s > 0).sum()), float(s[2, 5:].max())  # every element drawn; padding 0
      (305, 0.0)
    """
    row_index = jnp.asarray(layout.row_offset // layout.row)  # the row within its segment
    row_keys = jax.vmap(jax.random.fold_in)(key[jnp.asarray(layout.row_segment)], row_index)
    scores = S1.random_scores(row_keys, layout.row)
    return varying_like(jnp.where(layout.valid(), scores, jnp.float32(0)), x)


def random_k(layout: SegmentLayout, x: jax.Array, targets: Targets) -> SegmentSelection:
    """``selectors.random_k`` for every segment, selecting on its scores.

    ``x`` is :func:`random_scores`' buffer (see :data:`SCORES`): the
    threshold is the float just below each segment's exact k-th largest
    score, so ``{score > threshold}`` holds the 1-D form's ``k`` draws, and
    more only where equal draws tie at the k-th (probability about ``n /
    2^30`` per segment and step). The caller's capacity cut at ``k`` then
    keeps the lower indices of the tie, as the 1-D form's ``lax.top_k``
    does: the same coordinates, always.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> layout = SegmentLayout((1000, 40))
      >>> keys = jax.random.split(jax.random.key(0), 2)
      >>> scores = random_scores(layout, jnp.zeros((5, ROW)), keys)
      >>> random_k(layout, scores, Targets(np.array([[10, 2]]))).count.tolist()
      [10, 2]
    """
    return exact_top_k(layout, x, targets)


# The selectors with a segmented form, by the 1-D selector they stand for.
SEGMENTED: dict[Callable, Callable] = {
    S1.exact_top_k: exact_top_k,
    S1.ldte_bs: ldte_bs,
    S1.dgc_sample: dgc_sample,
    S1.fixed_threshold: fixed_threshold,
    S1.binary_search: binary_search,
    S1.trimmed_top_k: trimmed_top_k,
    S1.gaussian_k: gaussian_k,
    S1.random_k: random_k,
    S1.sidco: sidco_segmented,
}

# The segmented forms that select on a score buffer of their own instead of
# the elements' magnitudes, with its function ``score(layout, x, key) -> buffer``
# (``key``: one PRNG key per segment). The selector, the capacity cut and the
# mask then all read that buffer; the message still holds ``x``'s values.
SCORES: dict[Callable, Callable] = {random_k: random_scores}
