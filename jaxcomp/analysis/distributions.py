"""Are gradients Laplacian? Wasserstein-1 distances to moment-fitted distributions.

The ldte_bs paper (Table 1, Fig. 1) justifies LDTE's Laplacian model by
measuring, for each residual tensor, the Wasserstein-1 distance between its
empirical distribution and a Laplace and a Gaussian fitted by moments, and
finding the Laplace closer. :func:`fit_distances` computes both distances for
one tensor, exactly (up to rounding) and without scipy;
:func:`tree_fit_distances` does it for every leaf of a pytree and aggregates
per model with a geometric mean, as the paper's table does.

How the distance is computed. With the sorted values ``x_(1) <= ... <= x_(n)``
and the fitted quantile function ``Q``,
``W1 = sum_i integral_{(i-1)/n}^{i/n} |x_(i) - Q(u)| du``. Each interval is
split where the integrand changes sign, at ``u* = F(x_(i))`` clipped into the
interval, and at ``u = 1/2`` (the Laplace's kink; both distributions are
symmetric about it, so the upper half is mirrored onto the lower one). Every
piece is then ``width * (x - mean of Q over the piece)``, a product of two
non-negative numbers: the sum has no cancellation. The mean of ``Q`` over a
piece comes from the closed forms
``integral_p^q Phi^-1(u) du = phi(Phi^-1(p)) - phi(Phi^-1(q))`` and
``integral_p^q ln(2u) du = q ln(2q) - q - p ln(2p) + p``, written so that
narrow pieces keep their accuracy in float32: ``log1p`` for the Laplace, and
for the Gaussian a midpoint Taylor expansion (to sixth order) whenever a
piece is narrow compared with the quantile's local scale, where the
difference of two nearly equal ``phi`` values would lose digits. Rounding of
the interval ends only moves the partition, which changes the result by at
most ``eps * (max(x) - min(x))``.

The paper's numbers (Table 1: 4.7 to 46) are not W1 in gradient units (1e-3
to 1e-1 on CIFAR models), and its text (formulas lost) does not say how it
normalised. Its column heads say "EMD" and its Fig. 1 is a histogram of
counts, so :func:`fit_distances` also reports our reading of it: the earth
mover's distance between histograms, in bins. With ``B`` bins of equal width
over ``[min(x), max(x)]``, ``P_j`` the fraction of values in bins ``0..j``
and ``Q_j`` the fitted distribution's mass there (truncated to the range and
renormalised), ``EMD = sum_{j<B} |P_j - Q_j|``, the W1 distance between the
two histograms with bin ``j`` at position ``j``. It is scale- and
shift-free; for a continuous fit and large ``n`` it is about
``B * W1 / (max(x) - min(x))``. The bin count is not in the paper's text:
``bins=1000`` is chosen because it puts the magnitudes of real CIFAR-model
gradients in the paper's range (docs: "Are gradients Laplacian?", where the
other normalisations tried and the evidence are listed).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.special import ndtr, ndtri

from jaxcomp import _validation as V

__all__ = ["EMD_BINS", "FAMILIES", "fit_distances", "tree_fit_distances"]

# The distribution families fit_distances measures each gradient against.
FAMILIES = ("laplace", "gaussian")
# Default bin count of the histogram EMD (the ldte_bs paper's Table 1 units).
EMD_BINS = 1000

# A Gaussian piece of width w around u = m is "narrow" when its width in
# z units, D = w / phi(z_m), satisfies D * (1 + |z_m|) < this. Below it the
# sixth-order expansion is accurate to ~2e-7 (relative to |z|, measured);
# above it the closed form's difference of phi values keeps float32 accuracy.
_TAYLOR_LIMIT = 0.7
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _phi(z):
    return jnp.exp(-0.5 * z * z) * _INV_SQRT_2PI


def _gaussian_lower_mean(p, q):
    """Mean of ``Phi^-1`` over ``[p, q]``, ``0 <= p <= q <= 1/2`` (any value if p == q > 0)."""
    w = q - p
    m = 0.5 * (p + q)
    # One ndtri for the three points: it is a large polynomial program.
    zp, zq, zm = ndtri(jnp.stack([p, q, jnp.where(m > 0, m, 0.25)]))
    d = w / _phi(zm)  # the piece's width in z units
    z2 = zm * zm
    d2 = d * d
    # Mean of Q over the piece: sum_k Q^(2k)(m) w^2k / (2^2k (2k+1)!), where
    # Q^(j) = P_j(z) / phi(z)^j with P_1 = 1, P_{j+1} = j z P_j + P_j'.
    taylor = zm * (
        1.0
        + d2 / 24.0
        + d2 * d2 * (6.0 * z2 + 7.0) / 1920.0
        + d2 * d2 * d2 * ((120.0 * z2 + 326.0) * z2 + 127.0) / 322560.0
    )
    safe_w = jnp.where(w > 0, w, 1.0)
    closed = (_phi(zp) - _phi(zq)) / safe_w
    narrow = d * (1.0 + jnp.abs(zm)) < _TAYLOR_LIMIT
    return jnp.where(narrow | (w <= 0), taylor, closed)


def _laplace_lower_mean(p, q):
    """Mean of ``ln(2u)`` over ``[p, q]``, ``0 <= p <= q <= 1/2`` (finite whenever q > 0).

    ``ln(2q) - 1 - (1 - t) ln(1 - t) / t`` with ``t = (q - p) / q``: exact and
    free of cancellation for narrow pieces (``log1p``).
    """
    safe_q = jnp.where(q > 0, q, 0.25)
    t = (q - p) / safe_q
    safe_t = jnp.where(t > 0, t, 0.5)
    r = p / safe_q
    # (1 - t) ln(1 - t) / t: log1p while 1 - t is inexact, r ln r once it is
    # (r = 0, the first piece, gives 0).
    small = (1.0 - safe_t) * jnp.log1p(-jnp.minimum(safe_t, 0.5)) / safe_t
    large = jax.scipy.special.xlogy(r, r) / safe_t
    corr = jnp.where(t < 0.5, small, large)
    return jnp.where(t > 0, jnp.log(2.0 * safe_q) - 1.0 - corr, jnp.log(2.0 * safe_q))


def _pieces(lower_mean, xc, scale, a, c, b):
    """``integral_a^c (x - Q) du - integral_c^b (x - Q) du`` per sample, ``Q = mu + scale * ell``.

    ``xc = x - mu``. Both integrals are split at 1/2 and the upper parts
    mirrored with ``ell(1 - v) = -ell(v)``: four pieces on ``[0, 1/2]``,
    evaluated in one batch. Pieces of zero width contribute exactly 0.
    """
    half = 0.5
    p = jnp.stack([a, c])
    q = jnp.stack([c, b])
    # 1 - u is exact for u in [1/2, 1] (Sterbenz), so the mirror moves nothing.
    lo_p, lo_q = jnp.minimum(p, half), jnp.minimum(q, half)
    hi_p, hi_q = 1.0 - jnp.maximum(q, half), 1.0 - jnp.maximum(p, half)
    w = jnp.concatenate([lo_q - lo_p, hi_q - hi_p])
    means = lower_mean(jnp.concatenate([lo_p, hi_p]), jnp.concatenate([lo_q, hi_q]))
    # Rows: below-lo, above-lo, below-hi, above-hi.
    ell = jnp.asarray([1.0, 1.0, -1.0, -1.0], xc.dtype)[:, None] * means
    sign = jnp.asarray([1.0, -1.0, 1.0, -1.0], xc.dtype)[:, None]
    parts = jnp.where(w > 0, w * (xc - scale * ell), 0.0)
    return jnp.sum(sign * parts, axis=0)


def _w1(xs, n, mu, scale, family):
    """W1 between the sample ``xs[:n]`` (sorted) and ``family(mu, scale)`` (scale >= 0).

    ``xs`` may be padded past ``n`` (with +inf): those entries get intervals
    of zero width at u = 1 and contribute nothing.
    """
    dtype = xs.dtype
    # One array of interval ends, so neighbours share their rounded end.
    u = jnp.minimum(jnp.arange(xs.shape[0] + 1, dtype=dtype) / n.astype(dtype), 1.0)
    a, b = u[:-1], u[1:]
    xc = xs - mu
    positive = scale > 0
    safe_scale = jnp.where(positive, scale, 1.0)
    # A zero scale is a point mass at mu: F is a step there.
    z = jnp.where(positive, xc / safe_scale, jnp.sign(xc) * jnp.inf)
    if family == "gaussian":
        cdf, lower_mean = ndtr(z), _gaussian_lower_mean
    else:
        e = 0.5 * jnp.exp(-jnp.abs(z))
        cdf, lower_mean = jnp.where(z < 0, e, 1.0 - e), _laplace_lower_mean
    c = jnp.clip(cdf, a, b)
    # Q(u) <= x on [a, c] and >= x on [c, b].
    return jnp.sum(_pieces(lower_mean, xc, scale, a, c, b))


def _compute_dtype():
    return jnp.float64 if jax.config.jax_enable_x64 else jnp.float32


def _is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def fit_distances(x, *, bins: int = EMD_BINS) -> dict:
    """Wasserstein-1 distances from the values of ``x`` to a fitted Laplace and Gaussian.

    Both fits match moments, as the ldte_bs paper's: the Gaussian has the
    sample mean ``mu`` and standard deviation ``sigma`` (``ddof=0``), the
    Laplace location ``mu`` and scale ``b = sqrt(var / 2)`` (its variance is
    ``2 b^2``). The distance is between the empirical distribution of the
    ``n`` values (each of weight ``1/n``) and the fit,
    ``W1 = integral_0^1 |F_n^-1(u) - F^-1(u)| du``, in the units of ``x``;
    it is computed exactly in quantile form (module docstring), in float64
    when x64 is enabled and in float32 otherwise (integers, bfloat16 and
    float16 are upcast). O(n log n) for the sort; jit-able.

    It also reports both distances in the units we read the ldte_bs paper's
    Table 1 in: the earth mover's distance between the histogram of ``x``
    (``bins`` bins of equal width over ``[min(x), max(x)]``) and the fitted
    distribution's mass in the same bins (truncated to that range and
    renormalised), in bins: ``sum_j |P_j - Q_j|`` over the cumulative masses
    (module docstring). It does not change when ``x`` is scaled or shifted.

    A tensor whose values are all equal (``sigma = 0``) fits both families as
    a point mass: all four distances are 0.

    Args:
      x: an array of any shape (flattened), with at least one element.
      bins: the histogram's bin count for the EMD, >= 1 (static).

    Returns:
      A dict of scalar arrays: ``"laplace"`` and ``"gaussian"``, the W1
      distances to the Laplace fit and to the Gaussian fit in the units of
      ``x``; ``"laplace_emd"`` and ``"gaussian_emd"``, the histogram EMDs in
      bins.

    Raises:
      ValueError: ``x`` is empty, ``bins < 1``; or, outside ``jax.jit``, ``x``
        holds NaN or infinite values. Under ``jax.jit`` non-finite input cannot
        raise: all distances are NaN.

    Example:
      >>> import jax
      >>> from jaxcomp.analysis import fit_distances
      >>> g = 0.01 * jax.random.laplace(jax.random.key(0), (100_000,))
      >>> d = fit_distances(g)
      >>> bool(d["laplace"] < d["gaussian"])
      True
      >>> print(f"{float(d['laplace']):.1e} vs {float(d['gaussian']):.1e}")
      4.1e-05 vs 2.1e-03
      >>> print(f"{float(d['laplace_emd']):.2f} vs {float(d['gaussian_emd']):.2f} bins")
      0.18 vs 8.92 bins
    """
    bins = V.check_int("bins", bins, 1)
    if jnp.size(x) == 0:
        raise ValueError(f"x must have at least one element, got shape {jnp.shape(x)}")
    dtype = _compute_dtype()
    flat = jnp.ravel(jnp.asarray(x)).astype(dtype)
    if _is_concrete(flat) and not bool(jnp.all(jnp.isfinite(flat))):
        raise ValueError("x holds NaN or infinite values; W1 to a fitted distribution is undefined")
    # Padded to a bucket of sizes (at most 25% more) with the true size
    # traced: one compilation serves every tensor of the bucket.
    n = flat.shape[0]
    padded = jnp.pad(flat, (0, _bucket(n) - n), constant_values=jnp.inf)
    return _fit_distances(padded, jnp.asarray(n, jnp.int32), bins)


def _bucket(n: int) -> int:
    """The padded length: 1024 up to there, then 4 sizes per octave."""
    if n <= 1024:
        return 1024
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def _histogram_emd(xs, n, mu, scale, family, bins):
    """EMD in bins between the histogram of ``xs[:n]`` (sorted) and ``family(mu, scale)``.

    Bin ``j`` is ``[e_j, e_{j+1})`` (the last one closed), ``e_j = lo + j w``,
    ``w = (hi - lo) / bins``, as ``numpy.histogram``. The fit's masses are
    ``F(e_{j+1}) - F(e_j)``, renormalised by ``F(hi) - F(lo)``.
    """
    dtype = xs.dtype
    lo, hi = xs[0], xs[n - 1]
    j = jnp.arange(1, bins, dtype=dtype)  # the inner edges
    edges = lo + (hi - lo) * (j / bins)
    # Fraction of values below each inner edge: the histogram's cumulative mass
    # through the bin the edge closes (the padding, +inf, is never below one).
    p = jnp.searchsorted(xs, edges, side="left").astype(dtype) / n.astype(dtype)
    positive = scale > 0
    safe_scale = jnp.where(positive, scale, 1.0)
    z = (jnp.concatenate([lo[None], edges, hi[None]]) - mu) / safe_scale
    if family == "gaussian":
        cdf = ndtr(z)
    else:
        e = 0.5 * jnp.exp(-jnp.abs(z))
        cdf = jnp.where(z < 0, e, 1.0 - e)
    mass = cdf[-1] - cdf[0]
    q = (cdf[1:-1] - cdf[0]) / jnp.where(mass > 0, mass, 1.0)
    emd = jnp.sum(jnp.abs(p - q))
    # One value, or all equal: one bin holds everything, for the fit too.
    return jnp.where(positive & (hi > lo) & (mass > 0), emd, 0.0)


@functools.partial(jax.jit, static_argnames="bins")
def _fit_distances(padded, n, bins):
    real = jnp.arange(padded.shape[0]) < n
    finite = jnp.all(jnp.isfinite(padded) | ~real)
    xs = jnp.sort(padded)  # the +inf padding stays past n (x holds no +inf when finite)
    # W1 is shift-invariant: centring on the median keeps float32 digits for
    # tensors whose spread is small next to their offset.
    xs = xs - xs[n // 2]
    # W1 scales with the data: fitted on xs / max|xs|, the variance neither
    # underflows (|x| ~ 1e-20 in float32: a point mass) nor overflows (~1e20).
    top = jnp.max(jnp.where(real, jnp.abs(xs), 0.0))
    scale = jnp.where(finite & (top > 0), top, 1.0).astype(xs.dtype)
    xs = xs / scale
    nf = n.astype(xs.dtype)
    mu = jnp.sum(jnp.where(real, xs, 0.0)) / nf
    # Two-pass: no E[x^2] - mu^2 cancellation.
    var = jnp.sum(jnp.where(real, jnp.square(xs - mu), 0.0)) / nf
    sigma = jnp.sqrt(var)
    b = sigma / math.sqrt(2.0)
    out = {
        "laplace": _w1(xs, n, mu, b, "laplace") * scale,
        "gaussian": _w1(xs, n, mu, sigma, "gaussian") * scale,
        "laplace_emd": _histogram_emd(xs, n, mu, b, "laplace", bins),
        "gaussian_emd": _histogram_emd(xs, n, mu, sigma, "gaussian", bins),
    }
    return {k: jnp.where(finite, v, jnp.nan) for k, v in out.items()}


def tree_fit_distances(tree, *, min_size: int = 1000, bins: int = EMD_BINS) -> tuple[dict, dict]:
    """:func:`fit_distances` of every leaf of ``tree`` large enough, and their geometric means.

    The ldte_bs paper's Table 1 reports one number per model and family;
    here it is the geometric mean over leaves of the per-leaf distances (a
    mean of ratios, so large and small layers weigh alike whatever the scale
    of their values).

    Leaves with fewer than ``min_size`` elements (biases, norm scales) are
    skipped: a handful of values says little about a distribution's shape,
    and W1 of a small sample is dominated by its sampling noise.

    Args:
      tree: a pytree of arrays (gradients, residuals).
      min_size: leaves of at least this many elements are measured; >= 1.
      bins: the histogram EMD's bin count (:func:`fit_distances`).

    Returns:
      ``(per_leaf, summary)``. ``per_leaf`` maps each measured leaf's path
      (``"Dense_0/kernel"``: ``jax.tree_util.keystr(..., simple=True,
      separator="/")``) to its :func:`fit_distances` dict plus ``"size"``.
      ``summary`` holds ``"laplace"``, ``"gaussian"``, ``"laplace_emd"`` and
      ``"gaussian_emd"`` (geometric means over the measured leaves; a zero
      distance makes its mean zero),
      ``"laplace_closer"`` (how many measured leaves are closer to the
      Laplace), ``"num_leaves"`` (measured) and ``"num_skipped"``.

    Raises:
      ValueError: ``min_size < 1``; no leaf has ``min_size`` elements; or as
        :func:`fit_distances` for a measured leaf.

    Example:
      >>> import jax
      >>> from jaxcomp.analysis import tree_fit_distances
      >>> k1, k2 = jax.random.split(jax.random.key(0))
      >>> grads = {"w": jax.random.laplace(k1, (64, 64)),
      ...          "v": jax.random.normal(k2, (4096,)), "b": jax.numpy.ones(64)}
      >>> per_leaf, summary = tree_fit_distances(grads)
      >>> sorted(per_leaf), summary["num_leaves"], summary["num_skipped"]
      (['v', 'w'], 2, 1)
      >>> bool(per_leaf["w"]["laplace"] < per_leaf["w"]["gaussian"])
      True
      >>> bool(per_leaf["v"]["gaussian"] < per_leaf["v"]["laplace"])
      True
    """
    if min_size < 1:
        raise ValueError(f"min_size must be >= 1, got {min_size}")
    bins = V.check_int("bins", bins, 1)
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    per_leaf = {}
    skipped = 0
    for path, leaf in leaves:
        size = int(np.prod(jnp.shape(leaf), dtype=np.int64))
        if size < min_size:
            skipped += 1
            continue
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        try:
            d = fit_distances(leaf, bins=bins)
        except ValueError as e:
            raise ValueError(f"leaf {name!r}: {e}") from None
        per_leaf[name] = {**d, "size": size}
    if not per_leaf:
        raise ValueError(
            f"no leaf of the tree has min_size={min_size} elements or more "
            f"({skipped} leaves, all smaller); lower min_size"
        )
    summary = {}
    for key in (*FAMILIES, *(f"{family}_emd" for family in FAMILIES)):
        logs = jnp.stack([jnp.log(d[key]) for d in per_leaf.values()])
        summary[key] = jnp.exp(jnp.mean(logs))
    summary["laplace_closer"] = sum(
        jnp.asarray(d["laplace"] < d["gaussian"], jnp.int32) for d in per_leaf.values()
    )
    summary["num_leaves"] = len(per_leaf)
    summary["num_skipped"] = skipped
    return per_leaf, summary
