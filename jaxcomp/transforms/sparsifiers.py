"""The named sparsifying compressors: thin wrappers over :func:`sparsify`.

Each factory takes ``ratio`` as its first keyword, its selector's options, and
the common options of :func:`jaxcomp.sparsify` (``axis_name``,
``min_dense_size``, ``residual_dtype``, ``capacity_factor``, ``momentum``,
``momentum_masking``, ``warmup_ratios``, ``steps_per_epoch``,
``granularity``, ``nonfinite``, ``seed``) as keywords.
"""

from __future__ import annotations

import optax

from jaxcomp.transforms.sparsify import sparsify

__all__ = [
    "binary_search",
    "dgc",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "threshold",
    "top_k",
    "trimmed_top_k",
]

_Tx = optax.GradientTransformationExtraArgs


def top_k(ratio: float, *, method: str = "top_k", **kwargs) -> _Tx:
    """Exact top-k sparsification with error feedback (residual gradient compression).

    Args:
      ratio: density in (0, 1].
      method: ``"top_k"`` (``lax.top_k``, radix-select on GPU) or ``"sort"``
        (full sort, the reference).
      **kwargs: common options of :func:`jaxcomp.sparsify`.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.1), optax.sgd(1.0))
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, _ = tx.update(g, tx.init(g))
      >>> [float(v) for v in u["w"]]
      [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -9.0]
    """
    if method not in ("top_k", "sort"):
        raise ValueError(f"method must be 'top_k' or 'sort', got {method!r}")
    return sparsify("top_k" if method == "top_k" else "sort_top_k", ratio, **kwargs)


def ldte_bs(
    ratio: float,
    *,
    estimator: str = "moments",
    search: str = "interpolate",
    aim: float = 1.25,
    moment_sample: int | None = 65536,
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
    exact_below: int = 0,
    **kwargs,
) -> _Tx:
    """LDTE-BS: Laplacian threshold estimate with a binary-search correction.

    Sends between ``k`` and ``1.5 k`` elements per leaf whenever the data
    allows; see :func:`jaxcomp.selection.ldte_bs` for the options.
    ``search="bisect", aim=1.0, moment_sample=None`` is the paper's algorithm
    exactly; the defaults aim the estimate at the middle of the window,
    estimate the moments from a 65536-element strided sample, and refine by
    interpolating log counts (fewer passes, same guarantee).

    Example:
      >>> import jax, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3), optax.sgd(0.1))
      >>> g = {"w": jax.random.laplace(jax.random.key(0), (100_000,))}
      >>> u, state = tx.update(g, tx.init(g))
      >>> bool(100 <= optax.tree.get(state, "sent_count")["w"] <= 150)
      True
    """
    opts = dict(
        estimator=estimator,
        search=search,
        aim=aim,
        moment_sample=moment_sample,
        upper=upper,
        max_iters=max_iters,
        delta=delta,
        exact_below=exact_below,
    )
    # The message holds the whole window [k, upper * k] unless told otherwise.
    kwargs.setdefault("capacity_factor", upper)
    return sparsify("ldte_bs", ratio, selector_options=opts, **kwargs)


def binary_search(
    ratio: float,
    *,
    start: str = "zero",
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
    **kwargs,
) -> _Tx:
    """RedSync's binary search on the threshold, without a distribution estimate."""
    opts = dict(start=start, upper=upper, max_iters=max_iters, delta=delta)
    kwargs.setdefault("capacity_factor", upper)
    return sparsify("binary_search", ratio, selector_options=opts, **kwargs)


def dgc(
    ratio: float,
    *,
    sample_ratio: float = 0.01,
    upper: float = 1.3,
    decay: float = 0.8,
    max_adaptations: int = 10,
    **kwargs,
) -> _Tx:
    """DGC's sampled hierarchical top-k selection (add ``momentum=0.9`` for DGC's recipe)."""
    opts = dict(
        sample_ratio=sample_ratio, upper=upper, decay=decay, max_adaptations=max_adaptations
    )
    return sparsify("dgc", ratio, selector_options=opts, **kwargs)


def trimmed_top_k(ratio: float, *, start: float = 0.8, step: float = 0.2, **kwargs) -> _Tx:
    """RedSync's trimmed top-k: ``mean + r (max - mean)`` prefilter, then exact top-k."""
    return sparsify("trimmed_top_k", ratio, selector_options=dict(start=start, step=step), **kwargs)


def gaussian_k(ratio: float, *, corrections: int = 3, **kwargs) -> _Tx:
    """Gaussian-k (Shi et al.): Gaussian-fit threshold with up to 3 corrections."""
    if not (isinstance(corrections, int) and corrections >= 0):
        raise ValueError(f"corrections must be an int >= 0, got {corrections!r}")
    return sparsify("gaussian_k", ratio, selector_options=dict(corrections=corrections), **kwargs)


def random_k(ratio: float, **kwargs) -> _Tx:
    """k coordinates uniformly at random each step (unscaled, with error feedback).

    The PRNG stream comes from ``seed`` (folded with the step, the leaf and,
    under ``axis_name``, the device index), so runs are deterministic.
    """
    return sparsify("random_k", ratio, **kwargs)


def threshold(ratio: float, *, threshold: float, **kwargs) -> _Tx:
    """Fixed threshold ("fixed-v"): send ``|R| > threshold``.

    ``ratio`` sizes the message capacity ``ceil(1.5 * ratio * n)``; what passes
    the threshold beyond it stays in the residual.
    """
    if not threshold >= 0:
        raise ValueError(f"threshold must be >= 0, got {threshold!r}")
    return sparsify("threshold", ratio, selector_options=dict(threshold=threshold), **kwargs)
