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

Layout of the code: this module holds the baselines (sort, fixed threshold,
DGC's sampling, trimmed top-k, Gaussian-k, random-k) and :data:`SELECTORS`,
and re-exports the rest, which lives by job: :mod:`jaxcomp.selection.base`
(:class:`Selection`, counting, exact order statistics, the capacity cut),
:mod:`jaxcomp.selection.ldte` (LDTE-BS and the binary search) and
:mod:`jaxcomp.selection.multistage` (SIDCo).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection import _kernels as kernels

# What moved to base and ldte stays importable from here (segmented, sparsifiers and
# users read it as selectors.<name>): hence the noqa on names only re-exported.
from jaxcomp.selection.base import (
    Selection,
    abs32,
    capacity_cut,
    count_above,
    cut_message,
    exact_top_k,
    flat_input,
    float32_above,  # noqa: F401 (re-exported)
    just_below,
    kth_largest,
    kth_largest_above,
    make_selection,
    strided_sample,
    target_count,
    top_k_above,
)
from jaxcomp.selection.ldte import (  # noqa: F401 (re-exported)
    DEFAULT_MOMENT_SAMPLE,
    MEDIAN_SAMPLE,
    binary_search,
    check_search_options,
    fibonacci_fractions,
    laplace_threshold,
    ldte_bs,
    threshold_search,
)
from jaxcomp.selection.multistage import sidco

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
    "sidco",
    "sort_top_k",
    "target_count",
    "trimmed_top_k",
]


# Read here by tests/test_selectors.py and tests/test_dgc_reference.py.
_kth_largest_above = kth_largest_above
_just_below = just_below


@flat_input
def sort_top_k(x: jax.Array, k: int) -> Selection:
    """Exact top-k through a full sort: the O(n log n) reference.

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> sel = sort_top_k(x, 3)
      >>> int(sel.count), x[jnp.abs(x) > sel.threshold].tolist()
      (3, [-4.0, 3.0, 6.0])
    """
    a = abs32(x)
    t = just_below(jnp.sort(a)[a.shape[0] - k])
    return make_selection(t, kernels.count_above(a, t))


@flat_input
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
    return make_selection(t, kernels.count_above(abs32(x), t))


# ---------------------------------------------------------------------------
# Hierarchical and fitted baselines.
# ---------------------------------------------------------------------------


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


@flat_input
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
        sample = abs32(x)
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
        sample = jnp.where(inside, abs32(x[jnp.where(inside, pos, 0)]), jnp.float32(0))
    t = kth_largest(sample, ks)  # the reference's threshold: survivors are |x| >= t
    c = count_above(x, just_below(t))  # #{|x| >= t}, nonzeros (t = 0: all nonzeros)
    it = jnp.int32(0)
    if whole:
        return make_selection(just_below(t), c, it)
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
        return t, count_above(x, just_below(t)), it + 1

    t, c, it = lax.while_loop(cond, body, varying_like((t, c, it), x))
    # The reference checks for a resample in a round: none left after the last decay.
    resample = (survivors(t, c) > hi) & (it < max_adaptations)
    t = just_below(t)

    def refine(_):
        t2, c2 = top_k_above(x, t, c, k, buffer=4 * max(hi, k))
        return t2, c2, it + 1

    t, c, it = lax.cond(resample, refine, lambda _: (t, c, it), None)
    return make_selection(t, c, it)


def _dgc_at_least_k(x, k, sample_ratio, upper, decay, max_adaptations) -> Selection:
    n = x.shape[0]
    m = max(1, min(n, math.ceil(sample_ratio * n)))
    sample = abs32(strided_sample(x, m))
    ks = target_count(k / n, sample.shape[0])
    t = kth_largest(sample, ks)
    t = just_below(t)
    c = count_above(x, t)

    def cond(s):
        t, c, it = s
        return (c < k) & (it < max_adaptations) & (t > 0)

    def body(s):
        t, _, it = s
        # An injected decay is float64 under x64 (optax.inject_hyperparams
        # stores hyperparameters in the parameters' dtype): the carry stays float32.
        t = (t * decay).astype(t.dtype)
        return t, count_above(x, t), it + 1

    t, c, it = lax.while_loop(cond, body, varying_like((t, c, jnp.int32(0)), x))
    hi = math.ceil(upper * k)

    def refine(_):
        t2, c2 = top_k_above(x, t, c, k, buffer=4 * hi)
        return t2, c2, it + 1

    t, c, it = lax.cond(c > hi, refine, lambda _: (t, c, it), None)
    return make_selection(t, c, it)


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


@flat_input
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
    mean = jnp.mean(abs32(x))
    amax = jnp.max(abs32(x))

    def cond(s):
        _, c, it = s
        return (c < k) & (it < rounds + 1)

    def body(s):
        _, _, it = s
        r = start - step * it.astype(jnp.float32)
        t = jnp.where(it < rounds, mean + r * (amax - mean), 0.0)
        return t, count_above(x, t), it + 1

    init = varying_like((jnp.float32(0), jnp.int32(-1), jnp.int32(0)), x)
    t, c, it = lax.while_loop(cond, body, init)
    # it >= 1 here; report adaptation rounds after the first.
    t, c = lax.cond(
        c > k,
        lambda _: top_k_above(x, t, c, k, buffer=4 * k),
        lambda _: (t, c),
        None,
    )
    return make_selection(t, c, it - 1)


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


@flat_input
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
    c = count_above(x, t)
    ub = math.floor(max(1.0, upper) * k)

    bracket = functools.partial(gaussian_bracket, k, ub)

    def cond(s):
        _, c, it, *_ = s
        return ((c < lower * k) | (c > upper * k)) & (it < corrections)

    def body(s):
        t, c, it, *br = s
        t = jnp.where(c < lower * k, t * 0.5, t * 1.5)
        c = count_above(x, t)
        return (t, c, it + 1, *bracket(t, c, *br))

    none = (jnp.float32(-1), jnp.int32(n), jnp.float32(jnp.inf), jnp.int32(0))
    init = (t, c, jnp.int32(0), *bracket(t, c, *none))
    t, c, it, t_lo, c_lo, t_hi, c_hi = lax.while_loop(cond, body, varying_like(init, x))
    if not refine:
        return make_selection(t, c, it)

    def search(_):
        lo_seen, hi_seen = t_lo >= 0, t_hi < jnp.inf
        # Nothing lies above max|x|: a pass only when no probe had too few.
        hi = lax.cond(hi_seen, lambda: t_hi, lambda: jnp.max(abs32(x)))
        t2, c2, it2 = threshold_search(
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
    return make_selection(t, c, it)


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


@flat_input
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
    sel = make_selection(0.0, k)
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
    "sidco": sidco,
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
