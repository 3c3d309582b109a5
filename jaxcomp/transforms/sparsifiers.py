"""The named sparsifying compressors: thin wrappers over :func:`sparsify`.

Each factory takes ``ratio`` as its first argument, its selector's options, and
the common options of :func:`jaxcomp.sparsify` as keywords (listed explicitly,
so ``optax.inject_hyperparams`` can bind them): ``axis_name``,
``min_dense_size``, ``residual_dtype``, ``capacity_factor``, ``momentum``,
``momentum_masking``, ``nesterov``, ``clip_norm``, ``warmup_ratios``,
``steps_per_epoch``, ``granularity``, ``groups``, ``reuse_period``,
``nonfinite``, ``exchange``, ``error_feedback``, ``low_pass``,
``residual_scale``, ``gradient_scale``, ``defer_residual``, ``seed``.

``reuse_period=s`` is DLGS's threshold reuse (the selector runs every ``s``
steps, the stored threshold is applied in between) and ``groups=`` DLGS's
layer merging (groups of leaves compressed and exchanged as one buffer); see
:func:`jaxcomp.sparsify`. ``random_k`` has no threshold to reuse.

With ``optax.inject_hyperparams`` the traceable hyperparameters (``momentum``,
``clip_norm``, ``low_pass``, ``residual_scale``, ``gradient_scale``,
``threshold``, ``delta``, ``decay``, ``seed``) live in the optimizer state and
can change between steps without recompiling; options that fix shapes, sizes
or iteration caps default to ``None`` (their documented value) and, when given,
must be named in ``static_args`` (``ratio`` always):

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> tx = optax.inject_hyperparams(jaxcomp.ldte_bs, static_args=("ratio",))(
    ...     ratio=0.01, momentum=0.9)
    >>> g = {"w": jnp.linspace(-1.0, 1.0, 1000)}
    >>> state = tx.init(g)
    >>> u, state = jax.jit(tx.update)(g, state)
    >>> state.hyperparams["momentum"] = jnp.float32(0.5)  # takes effect, no retrace
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import jax
import optax

from jaxcomp import _validation as V
from jaxcomp.selection.multistage import check_sidco_options
from jaxcomp.selection.selectors import DEFAULT_MOMENT_SAMPLE, check_dgc_options, trim_rounds
from jaxcomp.transforms.sparsify import sparsify

__all__ = [
    "LDTE_VARIANTS",
    "binary_search",
    "dgc",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "sidco",
    "threshold",
    "top_k",
    "trimmed_top_k",
]

_Tx = optax.GradientTransformationExtraArgs

# The keywords every named sparsifier forwards to sparsify unchanged: all of
# sparsify's but the selector, the ratio and the selector's options.
COMMON_KEYWORDS = tuple(
    name
    for name, p in inspect.signature(sparsify).parameters.items()
    # shared_indices is random_k's own (it needs random draws).
    if p.kind is p.KEYWORD_ONLY and name not in ("selector_options", "shared_indices")
)
_Float = float | jax.Array

# The options each LDTE-BS variant fixes. "paper" is Algorithm 2 of the ldte_bs
# paper exactly: moments of every element, aim at k, bisection (so no
# sample-quantile probes, which only run with search="interpolate").
LDTE_VARIANTS = {
    "improved": dict(
        estimator="moments",
        search="interpolate",
        aim=1.25,
        moment_sample=DEFAULT_MOMENT_SAMPLE,
        hint="previous",
    ),
    "paper": dict(estimator="moments", search="bisect", aim=1.0, moment_sample=None, hint=None),
}


def _common_options(args: dict) -> dict:
    """:func:`sparsify`'s common keywords, taken by name from a named factory's
    arguments (its ``locals()``), so no reordering can misbind them."""
    return {name: args[name] for name in COMMON_KEYWORDS}


def top_k(
    ratio: float,
    *,
    method: str = "top_k",
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """Exact top-k sparsification with error feedback (residual gradient compression).

    Args:
      ratio: density in (0, 1].
      method: ``"top_k"`` (``lax.top_k``, radix-select on GPU) or ``"sort"``
        (full sort, the reference).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.1), optax.sgd(1.0))
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, _ = tx.update(g, tx.init(g))
      >>> [float(v) for v in u["w"]]
      [-0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -0.0, -9.0]
    """
    method = V.check_choice("method", method, ("top_k", "sort"))
    common = _common_options(locals())
    return sparsify("top_k" if method == "top_k" else "sort_top_k", ratio, **common)


def ldte_bs(
    ratio: float,
    *,
    variant: str = "improved",
    estimator: str | None = None,
    search: str | None = None,
    aim: float | None = None,
    moment_sample: int | str | None = "auto",
    hint: str | None = "auto",
    upper: float | None = None,
    max_iters: int | None = None,
    delta: _Float = 0.0,
    exact_below: int | None = None,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """LDTE-BS: Laplacian threshold estimate with a binary-search correction.

    Sends between ``k`` and ``1.5 k`` elements per leaf whenever the data
    allows; see :func:`jaxcomp.selection.ldte_bs` for the options.

    Args:
      ratio: density in (0, 1].
      variant: ``"improved"`` (default: the estimate aims at the middle of the
        window, ``aim=1.25``; moments from a 65536-element strided sample;
        the previous step's threshold and sample-quantile probes counted in
        the estimate's pass, then interpolation search on log counts: fewer
        passes, same guarantee) or ``"paper"`` (the paper's algorithm
        exactly: ``estimator="moments", search="bisect", aim=1.0,
        moment_sample=None, hint=None``, no probes). The variant sets the
        defaults of ``estimator``, ``search``, ``aim``, ``moment_sample`` and
        ``hint``; under ``"improved"`` explicit values override them, under
        ``"paper"`` an explicit value that differs from the paper's raises
        ``ValueError``.
      estimator: ``"moments"`` or ``"mle"`` (None: the variant's).
      search: ``"bisect"``, ``"fibonacci"`` or ``"interpolate"`` (None: the
        variant's).
      aim: the estimate targets ``aim * k`` elements, in ``(0, upper]``
        (None: the variant's).
      moment_sample: elements the moments are estimated from; ``None`` uses
        every element; ``"auto"``: the variant's (65536 / every element).
      hint: ``"previous"``: count the previous step's threshold, and the
        sample-quantile probes, in the same pass as the Laplacian estimate
        (the estimate is kept whenever it is in the window, then the
        previous threshold). Under error feedback the estimate misses on
        most steps, which then took a second count pass for the probes.
        ``None``: the estimate alone, probes in a second pass when it
        misses; ``"auto"``: the variant's (``"previous"`` / ``None``). See
        :func:`jaxcomp.selection.ldte_bs` (``hint=``).
      upper: the window's upper factor (None: 1.5, the paper's).
      max_iters: cap on search probes (None: 40).
      delta: stop the search when the bracket is narrower (traceable).
      exact_below: leaves with fewer elements use exact top-k (None: 0).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3), optax.sgd(0.1))
      >>> g = {"w": jax.random.laplace(jax.random.key(0), (100_000,))}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> bool(100 <= jaxcomp.statistics(state)["sent_count"]["w"] <= 150)
      True
    """
    variant = V.check_choice("variant", variant, tuple(LDTE_VARIANTS))
    fixed = LDTE_VARIANTS[variant]
    given = dict(estimator=estimator, search=search, aim=aim)
    if moment_sample != "auto":
        given["moment_sample"] = moment_sample
    if not (isinstance(hint, str) and hint == "auto"):
        given["hint"] = V.check_choice("hint", hint, ("previous", None, "auto"))
    given = {k: v for k, v in given.items() if v is not None or k in ("moment_sample", "hint")}
    if variant == "paper":
        for name, value in given.items():
            same = value is None if fixed[name] is None else _equal(value, fixed[name])
            if not same:
                raise ValueError(
                    f"ldte_bs(variant='paper') is the paper's algorithm exactly: {name} must "
                    f"be {fixed[name]!r} (or left unset), got {value!r}; use "
                    "variant='improved' to change it"
                )
    opts = {**fixed, **given}
    opts["estimator"] = V.check_choice("estimator", opts["estimator"], ("moments", "mle"))
    upper = V.check_real("upper", 1.5 if upper is None else upper, 1.0)
    opts["aim"] = V.check_real("aim", opts["aim"], 0.0, upper, low_open=True)
    opts["moment_sample"] = V.check_int("moment_sample", opts["moment_sample"], 2, allow_none=True)
    opts.update(
        upper=upper,
        max_iters=V.check_int("max_iters", 40 if max_iters is None else max_iters, 0),
        delta=V.check_real("delta", delta, 0.0, allow_traced=True),
        exact_below=V.check_int("exact_below", 0 if exact_below is None else exact_below, 0),
    )
    # The message holds the whole window [k, upper * k] unless told otherwise.
    capacity_factor = upper if capacity_factor is None else capacity_factor
    common = _common_options(locals())
    return sparsify("ldte_bs", ratio, selector_options=opts, **common)


def _equal(value, expected) -> bool:
    try:
        return bool(value == expected) and not isinstance(value, bool)
    except Exception:  # arrays and odd types: not the paper's value
        return False


def binary_search(
    ratio: float,
    *,
    start: str = "zero",
    upper: float | None = None,
    max_iters: int | None = None,
    delta: _Float = 0.0,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """RedSync's binary search on the threshold, without a distribution estimate.

    Args:
      ratio: density in (0, 1].
      start: ``"zero"`` (bisect ``[0, max|x|]``) or ``"mean"`` (RedSync's code).
      upper: accept ``k <= nnz <= upper * k`` (None: 1.5).
      max_iters: cap on probes (None: 40).
      delta: stop when the bracket is narrower than this (traceable).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.binary_search(ratio=0.2)  # k = 2 of 10, sends k to 1.5 k
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist()  # the threshold found keeps the 3 largest
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 7.0, 8.0, 9.0]
      >>> (u["w"] + state.residual["w"]).tolist() == g["w"].tolist()  # nothing lost
      True
    """
    start = V.check_choice("start", start, ("zero", "mean"))
    upper = V.check_real("upper", 1.5 if upper is None else upper, 1.0)
    opts = dict(
        start=start,
        upper=upper,
        max_iters=V.check_int("max_iters", 40 if max_iters is None else max_iters, 0),
        delta=V.check_real("delta", delta, 0.0, allow_traced=True),
    )
    capacity_factor = upper if capacity_factor is None else capacity_factor
    common = _common_options(locals())
    return sparsify("binary_search", ratio, selector_options=opts, **common)


def dgc(
    ratio: float,
    *,
    sample_ratio: float | None = None,
    upper: float | None = None,
    decay: _Float = 0.8,
    max_adaptations: int | None = None,
    rule: str = "reference",
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """DGC's sampled hierarchical top-k selection (add ``momentum=0.9`` for DGC's recipe).

    By default the selection follows DGC's reference code
    (synxlin/deep-gradient-compression, ``DGCCompressor._sparsify``): a
    strided sample of at least ``max(sample_ratio * n, 2 / ratio)`` elements
    (the whole tensor when ``n <= 2 / ratio``) from a random start drawn every
    step (from ``seed`` and the step), the threshold decayed by ``decay``
    while fewer than ``decay * k`` pass, exact top-k among the survivors when
    more than ``upper * k`` pass, and at most ``k`` sent. One difference:
    where more than ``k`` survive without that top-k, the reference sends the
    first ``k`` survivors in index order and this sends the ``k`` largest
    (see :func:`jaxcomp.selection.dgc_sample` for exactly when and why).
    The selector sees ``k`` (``ceil(ratio * n)``), so its ``2 / ratio`` is
    ``2 n / k``: the reference's when ``ratio * n`` is an integer.
    ``rule="at_least_k"`` keeps jaxcomp's earlier rule: a fixed sample from
    index 0, decay while fewer than ``k`` pass, no cut to ``k`` (messages up
    to the usual capacity ``1.5 k``).

    Args:
      ratio: density in (0, 1].
      sample_ratio: fraction sampled for the threshold (None: 0.01), in
        [0.01, 1] (the reference's range) with ``rule="reference"``, in
        (0, 1] with ``"at_least_k"``.
      upper: exact top-k among survivors above ``upper * k`` (None: 1.3).
      decay: threshold factor in (0, 1) while too few pass (traceable); with
        ``rule="reference"`` also the lower bound ``decay * k`` (the
        reference's ``compress_lower_bound`` is both).
      max_adaptations: cap on adaptation rounds (None: 10).
      rule: ``"reference"`` (default) or ``"at_least_k"``, as above.
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).
        ``capacity_factor`` None is 1 with ``rule="reference"`` (at most
        ``k`` sent), 1.5 with ``"at_least_k"``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.dgc(ratio=0.2), optax.sgd(1.0))
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, _ = jax.jit(tx.update)(g, tx.init(g))
      >>> [float(v) for v in u["w"]][-3:]  # the 2 largest of 10, times -1 by sgd(1.0)
      [-0.0, -8.0, -9.0]
    """
    rule, sample_ratio, upper, max_adaptations = check_dgc_options(
        rule,
        0.01 if sample_ratio is None else sample_ratio,
        1.3 if upper is None else upper,
        decay,
        10 if max_adaptations is None else max_adaptations,
    )
    opts = dict(
        sample_ratio=sample_ratio, upper=upper, decay=decay, max_adaptations=max_adaptations,
        rule=rule,
    )  # fmt: skip
    common = _common_options(locals())
    return sparsify("dgc", ratio, selector_options=opts, **common)


def trimmed_top_k(
    ratio: float,
    *,
    start: float | None = None,
    step: float | None = None,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """RedSync's trimmed top-k: ``mean + r (max - mean)`` prefilter, then exact top-k.

    Args:
      ratio: density in (0, 1].
      start: first ``r``, in [0, 1] (None: 0.8).
      step: decrement of ``r`` while fewer than ``k`` survive, > 0 (None: 0.2).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.trimmed_top_k(ratio=0.2)
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist()  # exactly the 2 largest
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0]
    """
    opts = dict(start=0.8 if start is None else start, step=0.2 if step is None else step)
    trim_rounds(**opts)  # checked here, not at the first update
    common = _common_options(locals())
    return sparsify("trimmed_top_k", ratio, selector_options=opts, **common)


def gaussian_k(
    ratio: float,
    *,
    corrections: int | None = None,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """Gaussian-k (Shi et al.): Gaussian-fit threshold with up to 3 corrections.

    Args:
      ratio: density in (0, 1].
      corrections: cap on threshold corrections, >= 0 (None: 3).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.gaussian_k(ratio=0.2)
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist(), int(jaxcomp.statistics(state)["sent_count"]["w"])
      ([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0], 2)
    """
    corrections = V.check_int("corrections", 3 if corrections is None else corrections, 0)
    common = _common_options(locals())
    return sparsify("gaussian_k", ratio, selector_options=dict(corrections=corrections), **common)


def sidco(
    ratio: float,
    *,
    dist: str = "exponential",
    stages: int | str | None = None,
    first_ratio: float | None = None,
    tolerance: float | None = None,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """SIDCo (Abdelmoniem et al., MLSys 2021): a multi-stage statistical threshold.

    Fits an exponential, gamma or generalized Pareto distribution to the
    residual's magnitudes and reads the threshold off its tail; with several
    stages each stage refits the exceedances of the previous threshold (peaks
    over threshold), the stage densities multiplying to ``ratio``. No sort,
    no search: a pass per stage and one count
    (:mod:`jaxcomp.selection.multistage` has the fits). The count is an
    estimate, above or below ``k``; at most ``capacity_factor * k`` are sent
    (the largest), the rest stays in the residual.

    Args:
      ratio: target density in (0, 1].
      dist: ``"exponential"`` (default), ``"gamma"`` (the paper's gamma first
        stage, generalized Pareto after) or ``"gpareto"``.
      stages: an int in ``[1, 16]`` (capped per leaf at ``ceil(log2(1 /
        ratio))``) or ``"adaptive"`` (None: adaptive): the reference's rule,
        one stage fewer when the achieved density is above ``1 + tolerance``
        times the target, one more below ``1 - tolerance``, applied inside
        the step per leaf (no state across steps).
      first_ratio: the first stage's density, in (0, 1) (None: 0.25, the
        reference's).
      tolerance: the adaptive rule's band, in (0, 1) (None: 0.2).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.sidco(0.01, dist="exponential", stages=1)
      >>> g = {"w": jax.random.laplace(jax.random.key(0), (10_000,))}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> sent = int(jaxcomp.statistics(state)["sent_count"]["w"])
      >>> 80 <= sent <= 120  # |g| is exponential: one stage hits k = 100 closely
      True
    """
    dist, stages, first_ratio, tolerance = check_sidco_options(
        dist,
        "adaptive" if stages is None else stages,
        0.25 if first_ratio is None else first_ratio,
        0.2 if tolerance is None else tolerance,
    )
    common = _common_options(locals())
    options = dict(dist=dist, stages=stages, first_ratio=first_ratio, tolerance=tolerance)
    return sparsify("sidco", ratio, selector_options=options, **common)


def random_k(
    ratio: float,
    *,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    shared_indices: bool = False,
    seed: int | jax.Array = 0,
) -> _Tx:
    """k coordinates uniformly at random each step (unscaled, with error feedback).

    The PRNG stream comes from ``seed`` (folded with the step, the leaf and,
    under ``axis_name``, the device index), so runs are deterministic.

    With ``shared_indices=True`` every device draws the same coordinates
    (the stream is not folded with the device index: GRACE's
    ``RandomKCompressor`` with a common seed) and the exchange all-reduces
    their ``k`` values alone, no indices: half the bytes of float32 pairs or
    fewer. The update is the mean over devices at those coordinates.

    Args:
      ratio: density in (0, 1].
      shared_indices: the same draws on every device, values-only messages
        (``exchange`` ``"auto"``, ``"allgather"`` or ``"dense"``). Default False.
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.random_k(ratio=0.2)
      >>> g = {"w": jnp.arange(1.0, 11.0)}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> int((u["w"] != 0).sum())  # k = 2 random coordinates, sent unscaled
      2
      >>> (u["w"] + state.residual["w"]).tolist() == g["w"].tolist()  # the rest kept
      True
    """
    common = _common_options(locals())
    return sparsify("random_k", ratio, shared_indices=shared_indices, **common)


def threshold(
    ratio: float,
    *,
    threshold: _Float,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: _Float | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: _Float | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: _Float | None = None,
    residual_scale: _Float | None = None,
    gradient_scale: _Float | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    seed: int | jax.Array = 0,
) -> _Tx:
    """Fixed threshold ("fixed-v"): send ``|R| > threshold``.

    ``ratio`` sizes the message capacity ``ceil(1.5 * ratio * n)``; what passes
    the threshold beyond it stays in the residual.

    Args:
      ratio: density in (0, 1], sizes the capacity.
      threshold: finite, >= 0 (traceable).
      **common options: keywords of :func:`jaxcomp.sparsify` (``momentum``
        and ``seed`` traceable; the others static, None = default).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.threshold(ratio=0.2, threshold=7.5)  # ratio sizes the message
      >>> g = {"w": jnp.arange(10.0)}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist()  # |g| > 7.5
      [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 8.0, 9.0]
    """
    threshold = V.check_real("threshold", threshold, 0.0, allow_traced=True)
    common = _common_options(locals())
    return sparsify("threshold", ratio, selector_options=dict(threshold=threshold), **common)
