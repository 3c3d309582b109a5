"""SIDCo: a multi-stage statistical threshold (Abdelmoniem et al., MLSys 2021).

SIDCo ("An Efficient Statistical-based Gradient Compression Technique for
Distributed Training Systems"; reference code github.com/ahmedcs/sidco,
``ExpCompressor``, ``GParetoCompressor``, ``GammaGParetoCompressor``) fits a
sparsity-inducing distribution to the magnitudes ``a = |x|`` and reads the
threshold off its tail, with no sort and no search. With target density
``delta = k / n``, ``M`` stages and the first stage's density ``delta_1``
(``first_ratio``, 0.25):

* one stage (``M = 1``, or ``delta >= delta_1``): ``eta = F^-1(delta)``, the
  threshold whose tail probability under the fit of all of ``a`` is ``delta``;
* ``M > 1`` stages (peaks over threshold): stage 1 takes ``eta_1`` at density
  ``delta_1`` from the fit of all of ``a``; stage ``m = 2..M`` fits the
  exceedances ``{a_i > eta_(m-1)}`` shifted by their smallest value
  ``a_min`` (the reference's ``t_min``, the first magnitude above
  ``eta_(m-1)``) and sets ``eta_m = a_min + F^-1(delta_s)``, with
  ``delta_s = (delta / delta_1) ** (1 / (M - 1))``. The stage densities
  multiply to ``delta``: the expected count is ``k`` when each fit is right.

The fits are closed form (``L = ln(density) < 0``):

* ``"exponential"``: scale ``beta = mean`` (MLE); ``F^-1 = -beta L``.
* ``"gpareto"``: generalized Pareto by the method of moments, in Hosking's
  parameterisation as the reference writes it: with ``q = mean^2 / var``
  (unbiased variance), scale ``alpha = mean (q + 1) / 2``, shape
  ``kappa = (q - 1) / 2`` (``kappa = -xi``): ``F^-1 = alpha (1 - e^(kappa L)) / kappa``
  (``-alpha L`` as ``kappa -> 0``).
* ``"gamma"``: stage 1 fits a gamma distribution by the approximate MLE
  (Minka's closed form): ``s = ln(mean) - mean(ln(a / ||a||_2 + eps))``,
  shape ``alpha = (3 - s + sqrt((s - 3)^2 + 24 s)) / (12 s)``, scale
  ``beta = mean / alpha``, and the paper's tail approximation
  ``F^-1 = -beta (L + ln Gamma(alpha))``; the later stages fit a
  generalized Pareto to the exceedances (the reference's
  ``GammaGParetoCompressor``). ``eps`` is float64's machine epsilon, as in
  the reference (zeros would make ``ln`` infinite).

Every stage reads the tensor once per statistic of its exceedances (count,
sum, sum of squares and minimum, shifted by the previous threshold against
cancellation): two streaming float sums and one int32 reduce for the count
and the minimum, with no n-sized temporary. The gamma fit adds one pass (the norm comes first), and
one pass counts the result. The threshold is an estimate: the count may be below or
above ``k`` (the sparsifier sends at most its capacity, ``ceil(1.5 k)`` by
default, the largest first).

The number of stages. ``stages=M`` fixes it (the reference's ``stages >= 1``),
capped per tensor at ``M_max = ceil(log2(1 / delta))`` (the reference's clip);
``stages="adaptive"`` adapts it to the achieved density by the reference's
rule (``adapt_stages`` with ``stages=-1``): achieved over target density above
``1 + tolerance``: one stage fewer; below ``1 - tolerance``: one more; within:
keep. The reference applies the rule every few steps to one stage count
shared by all layers (process-global counters); here it runs inside the step,
per tensor, from one stage (the reference's initial count): at most
``M_max - 1`` moves, each recomputing the stage chain (``m`` stages: ``m``
passes; a chain of ``m + 1`` stages does not extend the chain of ``m``:
``delta_s`` depends on ``M``, so only the first fit is shared), stopping
when the density is within the tolerance, at a bound, or when the
direction would reverse, keeping the threshold whose count is
nearest ``k``. On data the first fit describes (Laplacian gradients: the
magnitudes are exponential) one stage is within the tolerance and the
selector makes two passes. So no memory
across steps is needed: the optimizer state keeps its structure, and every
step's threshold depends on that step's data only.

Deviations from the reference, each where it cannot be right otherwise: a
stage whose exceedances are fewer than two, or whose fit is not finite,
keeps the previous stage's threshold (the reference would divide by zero);
a negative or non-finite estimate becomes 0 (every nonzero, cut to the
capacity); and the threshold is at most the float just below ``max|x|``, so
at least one element is sent whenever one is nonzero (constant data, whose
variance is 0, otherwise sends nothing). ``delta >= first_ratio`` always
takes one stage (the reference's ``M > 1`` stages at such densities move the
threshold below the exceedances' minimum). The magnitudes are not divided by
their norm for the exponential and generalized Pareto fits (both scale with
the data, so the threshold does too).

:func:`sidco` is the 1-D selector (``SELECTORS['sidco']``, the factory
:func:`jaxcomp.sidco`); :func:`sidco_segmented` the same for many
tensors packed in one buffer (:mod:`jaxcomp.selection.segmented`: one pass
serves every segment, one loop every segment's stages), which the 1-D form
runs on one segment, so a tensor gets the same threshold alone and packed.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection.base import Selection, flat_input, make_selection
from jaxcomp.selection.packed import (
    SegmentLayout,
    SegmentSelection,
    Targets,
    abs32,
    count_above,
    just_below,
)

__all__ = [
    "SIDCO_DISTRIBUTIONS",
    "SIDCO_MAX_STAGES",
    "check_sidco_options",
    "sidco",
    "sidco_segmented",
    "sidco_stages",
]

# The values of ``dist``: the distribution fitted to the magnitudes (gamma: its first
# stage only; generalized Pareto after, as in the paper).
SIDCO_DISTRIBUTIONS = ("exponential", "gamma", "gpareto")

# The largest fixed stage count accepted (a stage is a pass over the tensor);
# per tensor it is capped at ceil(log2(n / k)) anyway.
SIDCO_MAX_STAGES = 16

# float64's machine epsilon, added to the normalised magnitudes inside the gamma
# fit's log as in the reference (sys.float_info.epsilon).
_GAMMA_EPS = float(np.finfo(np.float64).eps)

# The int32 bits of float32 +inf: the minimum of no exceedances, in the bits.
_INF_BITS = np.int32(np.float32(np.inf).view(np.int32))


def check_sidco_options(dist, stages, first_ratio, tolerance):
    """SIDCo's options, checked: ``(dist, stages, first_ratio, tolerance)``.

    Example:
      >>> check_sidco_options("gamma", 3, 0.25, 0.2)
      ('gamma', 3, 0.25, 0.2)
      >>> check_sidco_options("normal", 1, 0.25, 0.2)
      Traceback (most recent call last):
          ...
      ValueError: dist must be one of ('exponential', 'gamma', 'gpareto'), got 'normal'
    """
    dist = V.check_choice("dist", dist, SIDCO_DISTRIBUTIONS)
    if not (isinstance(stages, str) and stages == "adaptive"):
        if isinstance(stages, str):
            raise ValueError(
                f"stages must be 'adaptive' or an int in [1, {SIDCO_MAX_STAGES}], got {stages!r}"
            )
        stages = V.check_int("stages", stages, 1, SIDCO_MAX_STAGES)
    first_ratio = V.check_real("first_ratio", first_ratio, 0.0, 1.0, low_open=True, high_open=True)
    tolerance = V.check_real("tolerance", tolerance, 0.0, 1.0, low_open=True, high_open=True)
    return dist, stages, first_ratio, tolerance


def sidco_stages(k: int, n: int, stages, first_ratio: float = 0.25) -> tuple[int, int]:
    """``(start, most)``: the stage count a tensor of ``n`` with target ``k`` starts
    with and the most it may use (``ceil(log2(n / k))``, at least 1; 1 when
    ``k / n >= first_ratio``).

    Example:
      >>> sidco_stages(100, 100_000, 3)  # delta = 1e-3: at most ceil(log2 1000) = 10
      (3, 10)
      >>> sidco_stages(100, 100_000, "adaptive")  # from one stage, as the reference
      (1, 10)
      >>> sidco_stages(50, 100, 4)  # delta = 0.5 >= first_ratio: one stage
      (1, 1)
    """
    delta = k / n if n else 1.0
    if delta >= first_ratio or delta >= 1.0:
        return 1, 1
    most = max(1, math.ceil(math.log(delta) / math.log(0.5)))
    if stages == "adaptive":
        return 1, most
    return min(int(stages), most), most


def _tail(dist: str, mean, var, log_ratio):
    """``F^-1`` at tail density ``exp(log_ratio)`` of the exponential or
    generalized Pareto fit of (shifted) magnitudes with this mean and variance."""
    if dist == "exponential":
        return -mean * log_ratio
    q = mean * mean / var
    scale = 0.5 * mean * (q + 1.0)
    shape = 0.5 * (q - 1.0)
    small = jnp.abs(shape) < 1e-6
    safe = jnp.where(small, 1.0, shape)
    return jnp.where(small, -scale * log_ratio, -scale * jnp.expm1(safe * log_ratio) / safe)


def _count_and_min(acc, val):
    return acc[0] + val[0], jnp.minimum(acc[1], val[1])


def _count_min_cpu(a, shift):
    """Per row ``#{a > shift}`` and ``min{a > shift}`` (inf if none) on XLA:CPU:
    one variadic int32 row reduce, the minimum over the float bits (for
    ``a >= 0`` their order is the floats'), read back as a float."""
    above = a > shift
    # max(a, 0 * shift) is a; written so to depend on the stage, or XLA hoists
    # the bits out of the loop into an n-sized buffer of their own.
    bits = lax.bitcast_convert_type(jnp.maximum(a, shift * 0.0), jnp.int32)
    count, lo = lax.reduce(
        [above.astype(jnp.int32), jnp.where(above, bits, _INF_BITS)],
        [jnp.int32(0), _INF_BITS],
        _count_and_min,
        (1,),
    )
    return count, lax.bitcast_convert_type(lo, jnp.float32)


def _count_min_plain(a, shift):
    """:func:`_count_min_cpu` on other backends: two plain reductions."""
    above = a > shift
    count = jnp.sum(above, axis=1, dtype=jnp.int32)
    return count, jnp.min(jnp.where(above, a, jnp.inf), axis=1)


def _masked_row_stats(a, shift):
    """Per row: count, sum and sum of squares of ``a - shift`` over ``a > shift``,
    and the smallest such ``a`` (inf if none): one stage's statistics.

    Written for XLA:CPU (see :mod:`jaxcomp.selection._kernels`): ``compare`` and
    ``select`` are not YNNPACK ops, so ``where(a > shift, ...)`` feeding float
    reductions materialised an n-sized temporary per statistic (four per stage,
    ~25 ms at 2^22). Here the sums take ``max(a - shift, 0)`` (``a - shift`` on
    the exceedances, 0 elsewhere: the same floats in the same order), each
    with its own copies of the scalars so that XLA does not share (and
    materialise) one broadcast between them: two streaming YNNPACK reductions.
    On XLA:CPU the count and the minimum are one variadic int32 row reduce
    (:func:`_count_min_cpu`), emitted as one vectorised loop; on other
    backends two plain reductions. Bit for bit the masked statistics; the padding's
    zeros never pass (``shift >= 0``)."""
    s1, s2, z1, z2 = lax.optimization_barrier((shift, shift, jnp.float32(0), jnp.float32(0)))
    y = jnp.maximum(a - s1, z1)
    y2 = jnp.maximum(a - s2, z2)
    count, lo = lax.platform_dependent(a, shift, cpu=_count_min_cpu, default=_count_min_plain)
    return (
        count,
        jnp.sum(y, axis=1),
        jnp.sum(y2 * y2, axis=1),
        lo,
    )


def sidco_segmented(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    dist: str = "exponential",
    stages: int | str = "adaptive",
    first_ratio: float = 0.25,
    tolerance: float = 0.2,
) -> SegmentSelection:
    """SIDCo for every segment of a packed buffer (module docstring).

    Per segment the same fits as :func:`sidco`, every segment's stages in one
    ``while_loop`` (a pass per stage serves all segments; a segment whose
    chain is done stays fixed), so the compiled program does not grow with
    the number of segments. ``iterations`` counts the passes over the tensor
    after the first fit's.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jaxcomp.selection.segmented import SegmentLayout, Targets
      >>> parts = [jax.random.laplace(jax.random.key(i), (n,)) for i, n in enumerate((5000, 800))]
      >>> layout = SegmentLayout((5000, 800))
      >>> buf, targets = layout.pack(parts, jnp.float32), Targets(np.array([[50, 8]]))
      >>> sel = sidco_segmented(layout, buf, targets)
      >>> [bool(0.5 * k <= int(c) <= 2 * k) for k, c in zip((50, 8), sel.count)]
      [True, True]
    """
    dist, stages, first_ratio, tolerance = check_sidco_options(dist, stages, first_ratio, tolerance)
    x = lax.optimization_barrier(x)  # the fits' sums on their own, as ldte_bs
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    nseg = layout.num_segments
    if layout.num_rows == 0:
        zero = jnp.zeros((nseg,), jnp.int32)
        return SegmentSelection(jnp.zeros((nseg,), jnp.float32), zero, zero)
    # (start, most) stages of every segment in every warm-up phase, static.
    plan = np.asarray(
        [
            [
                sidco_stages(int(kk), int(n), stages, first_ratio)
                for kk, n in zip(row, sizes, strict=True)
            ]
            for row in ktab
        ],
        np.int64,
    )
    start = targets.pick(plan[..., 0].astype(np.int32))
    most = targets.pick(plan[..., 1].astype(np.int32))
    delta = ktab / np.maximum(sizes, 1)[None, :]
    log_delta = targets.pick(np.log(np.clip(delta, 1e-30, 1.0)).astype(np.float32))
    log_first = np.float32(math.log(first_ratio))

    a = abs32(x)
    per_row = layout.per_row
    n = jnp.asarray(np.maximum(sizes, 1).astype(np.float32))

    # Stage 1's fit of all magnitudes (zeros included, as the reference), and
    # max|x| for the liveness cap, in one pass. The padding's zeros add nothing
    # to these sums (only the gamma fit's logs mask them out).
    av = a
    s1 = layout.segment_sum(jnp.sum(av, axis=1))
    s2 = layout.segment_sum(jnp.sum(av * av, axis=1))
    amax = jnp.maximum(layout.segment_max(jnp.max(av, axis=1)), 0.0)
    mean = s1 / n
    var = jnp.maximum(s2 / n - mean * mean, 0.0) * (n / jnp.maximum(n - 1.0, 1.0))
    tail_dist = "gpareto" if dist == "gamma" else dist
    if dist == "gamma":
        norm = jnp.sqrt(s2)
        eps = per_row(norm * _GAMMA_EPS)[:, None]
        # Every row's sum of logs in one streaming pass; then the rows holding
        # padding (at most one per segment, the last) again with the padding
        # masked out: a mask over the whole buffer is a compare, which XLA:CPU
        # cannot stream (it materialised the n logs, ~5 passes).
        row_logs = jnp.sum(jnp.log(a + eps), axis=1)
        sizes_np = np.asarray(layout.sizes, np.int64)
        part = np.flatnonzero(sizes_np % layout.row)
        if part.size:
            last = (layout.starts[part] + layout.rows[part] - 1).astype(np.int32)
            width = (sizes_np[part] % layout.row).astype(np.int32)
            col = lax.broadcasted_iota(jnp.int32, (part.size, layout.row), 1)
            tail = jnp.log(a[last] + eps[last])
            row_logs = row_logs.at[last].set(
                jnp.sum(jnp.where(col < width[:, None], tail, 0.0), axis=1)
            )
        mean_log = layout.segment_sum(row_logs) / n
        s = jnp.log(mean) - mean_log
        s = jnp.where(s > 0, s, jnp.nan)  # s <= 0: constant data, no gamma fit
        shape = (3.0 - s + jnp.sqrt((s - 3.0) ** 2 + 24.0 * s)) / (12.0 * s)
        scale = mean / shape
        lgamma = jax.scipy.special.gammaln(shape)

        def first_fit(log_ratio):
            return -scale * (log_ratio + lgamma)
    else:

        def first_fit(log_ratio):
            return _tail(dist, mean, var, log_ratio)

    def clean(t):
        # Non-finite or negative: 0 (every nonzero, cut to capacity); at most the
        # float below max|x|, so a nonzero tensor always sends something.
        t = jnp.where(jnp.isfinite(t) & (t > 0), t, 0.0)
        return jnp.minimum(t, just_below(amax))

    def chain(m, active):
        """The threshold after ``m`` stages, per segment (``active`` ones)."""
        multi = m > 1
        log1 = jnp.where(multi, log_first, log_delta)
        log_s = jnp.where(multi, (log_delta - log_first) / jnp.maximum(m - 1, 1), 0.0)
        t = clean(first_fit(log1))

        def running(c):
            j, _, going = c
            return going & active & (j < m)

        def body(c):
            j, t, going = c
            go = running(c)
            cnt, sy, syy, lo = _masked_row_stats(abs32(x), per_row(t)[:, None])
            cnt = layout.segment_sum(cnt).astype(jnp.float32)
            sy, syy = layout.segment_sum(sy), layout.segment_sum(syy)
            a_min = -layout.segment_max(-lo)
            safe = jnp.maximum(cnt, 1.0)
            # Moments of a - a_min over the exceedances, from a - t (t < a_min).
            mean_y = sy / safe
            var_e = jnp.maximum(syy / safe - mean_y * mean_y, 0.0) * (
                safe / jnp.maximum(safe - 1, 1)
            )
            mean_e = mean_y - (a_min - t)
            t_new = a_min + _tail(tail_dist, mean_e, var_e, log_s)
            ok = go & (cnt >= 2) & jnp.isfinite(t_new) & (var_e > 0)
            t = jnp.where(ok, jnp.minimum(t_new, just_below(amax)), t)
            return jnp.where(go, j + 1, j), t, going & ok

        init = varying_like((jnp.ones_like(m), t, jnp.ones_like(active)), x)
        j, t, _ = lax.while_loop(lambda c: jnp.any(running(c)), body, init)
        return t, j - 1  # passes after the first fit's

    everyone = jnp.ones((nseg,), jnp.bool_)
    t, passes = chain(start, everyone)
    c = count_above(layout, x, t)
    if stages != "adaptive":
        return SegmentSelection(t, c, passes)

    kf = jnp.maximum(k, 1).astype(jnp.float32)
    log_k = jnp.log(kf)

    def miss(c):
        return jnp.abs(jnp.log(c.astype(jnp.float32) + 1.0) - log_k)

    def want(c):
        # The reference's rule: density above 1 + tolerance: a stage fewer; below: one more.
        ratio = c.astype(jnp.float32) / kf
        return jnp.where(ratio > 1.0 + tolerance, -1, jnp.where(ratio < 1.0 - tolerance, 1, 0))

    def moving(s):
        m, _, c, last, _, _, _ = s
        w = want(c)
        nxt = m + w
        return (w != 0) & (nxt >= 1) & (nxt <= most) & (w != -last)

    def adapt(s):
        go = moving(s)
        m, t, c, last, it, best_t, best_c = s
        w = want(c)
        m2 = jnp.where(go, m + w, m)
        t2, p2 = chain(m2, go)
        c2 = count_above(layout, x, t2)
        better = go & (miss(c2) < miss(best_c))
        return (
            m2,
            jnp.where(go, t2, t),
            jnp.where(go, c2, c),
            jnp.where(go, w, last),
            jnp.where(go, it + p2 + 1, it),
            jnp.where(better, t2, best_t),
            jnp.where(better, c2, best_c),
        )

    init = (start, t, c, jnp.zeros_like(start), passes, t, c)
    init = varying_like(init, x)
    _, _, _, _, it, best_t, best_c = lax.while_loop(lambda s: jnp.any(moving(s)), adapt, init)
    return SegmentSelection(best_t, best_c, it)


@flat_input
def sidco(
    x: jax.Array,
    k: int,
    *,
    dist: str = "exponential",
    stages: int | str = "adaptive",
    first_ratio: float = 0.25,
    tolerance: float = 0.2,
) -> Selection:
    """SIDCo's multi-stage threshold estimate (module docstring), on a 1-D array.

    Args:
      x: 1-D array (the residual).
      k: static target count; the target density is ``k / x.size``.
      dist: ``"exponential"``, ``"gamma"`` (gamma first stage, generalized
        Pareto after) or ``"gpareto"``.
      stages: an int in ``[1, 16]`` (capped per tensor at
        ``ceil(log2(n / k))``) or ``"adaptive"`` (default: the reference's
        rule, inside the step).
      first_ratio: the first stage's density ``delta_1`` in ``(0, 1)``.
      tolerance: ``"adaptive"`` keeps the stage count while the achieved
        density is within ``(1 +- tolerance)`` of the target.

    Returns:
      A :class:`Selection`; ``count`` may be above or below ``k``;
      ``iterations`` counts the passes after the first fit's.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jax.random.laplace(jax.random.key(0), (100_000,))  # |x| is exponential
      >>> sel = jax.jit(sidco, static_argnums=1)(x, 100)
      >>> bool(80 <= int(sel.count) <= 120)
      True
    """
    n = x.shape[0]
    layout = SegmentLayout((n,))
    sel = sidco_segmented(
        layout, layout.pack([x], jnp.float32), Targets(np.array([[k]])),
        dist=dist, stages=stages, first_ratio=first_ratio, tolerance=tolerance,
    )  # fmt: skip
    return make_selection(sel.threshold[0], sel.count[0], sel.iterations[0])
