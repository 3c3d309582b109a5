"""1-bit LAMB (Li et al., 2021): LAMB warm-up, then frozen v and trust ratios, 1-bit momentum.

LAMB (You et al., 2020) scales each layer's Adam step by a *trust ratio*
``||p|| / ||update||``; the ratio is not linear in the momentum, so 1-bit
LAMB ("1-bit LAMB: Communication Efficient Large-Scale Large-Batch Training
with LAMB's Convergence Speed", following DeepSpeed's ``OnebitLamb``) freezes
it with the variance, after a warm-up, and corrects it by a bounded factor.
Per layer (leaf) ``j``, steps ``t = 1, 2, ...``, per device ``i`` with local
gradient ``g_i``:

Warm-up, ``t <= freeze_step``: LAMB on the dense mean gradient ``g``,

- ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2`` (no bias
  correction; at ``t = freeze_step`` ``v_fresh = v``),
- ``u = m / (sqrt(v) + eps) + wd p``,
- ``c = clip(||p|| / ||u||, min_coeff, max_coeff)`` (1 if either norm is 0),
- ``c_frozen = coeff_beta c_frozen + (1 - coeff_beta) c`` (unless ``c == 1``),
- ``update = -lr c u``.

Compression stage, ``t > freeze_step`` (``v`` frozen):

- at its first step, per layer, ``s_j = mean_k(r_k) / r_j`` with
  ``r_j = ||m_j|| / sqrt(d_j)``: the scaling that gives every layer's
  momentum the same RMS, so that one 1-bit scale serves the flattened model;
- ``m_i = s (b1 m + (1 - b1) g_i)`` is sent in 1 bit with error feedback
  (:mod:`jaxcomp.transforms.adam_base`'s exchanges), and
  ``m = mean_i C[m_i + e_i] / s``, masked like 1-bit Adam's momentum;
- ``g_rec = (m - b1 m_old) / (1 - b1)`` (the gradient the new momentum
  implies), ``v_fresh = b2 v_fresh + (1 - b2) g_rec^2``;
- ``u0 = m / (sqrt(v) + eps)``, ``u = u0 + wd p``;
- ``f = max((sqrt(v) + eps) / (sqrt(v_fresh) + eps))``, with weight decay
  ``f = f r + 1 - r`` (``r = min(1, ||u0|| / ||u||)``), clipped to
  ``[factor_min, factor_max]`` and to within ``factor_threshold`` of the last
  step's ``f`` (relative);
- ``update = -lr c_frozen f u``.

The update is the same on every device (``v``, ``v_fresh`` and ``m`` come
from averaged or identically decoded values, the parameters are
replicated), so it works under :func:`jaxcomp.distributed.make_train_step`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _sharding
from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp.transforms.adam_base import (
    AdamConfig,
    add_weight_decay,
    check_decay_and_mask,
    check_exp_avg_mask,
    check_hyperparameters,
    check_inputs,
    compressed_mean,
    count_ok,
    dense_mean,
    has_weight_decay,
    leaf_bytes,
    make_config,
    mask_momentum,
    moment_dtypes,
    precondition,
    reject_include,
    scale_updates,
    server_init,
    step_size_at,
    tree_where,
    zeros_like_tree,
)
from jaxcomp.transforms.base import apply_nonfinite_policy
from jaxcomp.transforms.two_level import is_two_level

__all__ = ["OnebitLambState", "onebit_lamb"]


class OnebitLambState(NamedTuple):
    """State of :func:`onebit_lamb` (DeepSpeed's ``OnebitLamb`` names in comments).

    Attributes:
      count: int32, steps taken.
      mu: first moment ``m`` (``exp_avg``), identical on every device.
      nu: second moment ``v`` (``exp_avg_sq``), frozen after ``freeze_step``.
      nu_fresh: ``v_fresh`` (``exp_avg_sq_fresh``): ``v`` at the freeze, then
        updated from the reconstructed gradients; it drives the factor.
      residual: error-feedback memory of the scaled momentum (per device).
      server_residual: ``exchange="two_stage"``'s server error, as in
        :class:`jaxcomp.transforms.onebit_adam.OnebitAdamState`.
      scaling_coeff: float32 ``(L,)``, one value per leaf in
        ``jax.tree.leaves(params)`` order (as the three below): ``s_j``
        (``scaling_coeff``), set at the first compressed step (1 before).
      coeff_freeze: float32 ``(L,)``, ``c_frozen`` (``lamb_coeff_freeze``).
      last_factor: float32 ``(L,)``, the last factor ``f`` (``last_factor``).
      lamb_coeff: float32 ``(L,)``, the trust ratio of the last step, ``c``
        or ``c_frozen f`` (DeepSpeed's ``get_lamb_coeffs()``).
      message_bytes, wire_bytes, nonfinite_steps: as in ``OnebitAdamState``.
    """

    count: jax.Array
    mu: Any
    nu: Any
    nu_fresh: Any
    residual: Any
    server_residual: jax.Array | None
    scaling_coeff: Any
    coeff_freeze: Any
    last_factor: Any
    lamb_coeff: Any
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class _OnebitLambConfig(AdamConfig):
    """The validated static options of one :func:`onebit_lamb` transform."""

    who: ClassVar[str] = "jaxcomp.onebit_lamb"
    freeze_step: int  # >= 1: LAMB warm-up steps before v and the trust ratios freeze
    max_coeff: Any  # the warm-up trust ratio's bounds (floats or traced)
    min_coeff: Any
    coeff_beta: Any  # the frozen ratio's moving-average rate
    factor_max: Any  # the compression stage's factor bounds
    factor_min: Any
    factor_threshold: Any  # the largest relative change of the factor per step


def onebit_lamb(
    learning_rate: float | Callable,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    freeze_step: int,
    weight_decay: Any = None,
    mask: Any = None,
    exp_avg_mask: Any = None,
    max_coeff: float = 10.0,
    min_coeff: float = 0.01,
    coeff_beta: float = 0.9,
    factor_max: float = 4.0,
    factor_min: float = 0.5,
    factor_threshold: float = 0.1,
    axis_name: Any = None,
    codec: str = "sign",
    bucket_size: int | None = None,
    exchange: str = "allgather",
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """1-bit LAMB (Li et al., 2021), following DeepSpeed's ``OnebitLamb``.

    The equations are in the module docstring
    (:mod:`jaxcomp.transforms.onebit_lamb`): LAMB with per-layer trust ratios
    clipped to ``[min_coeff, max_coeff]`` during the warm-up, whose moving
    average (``coeff_beta``) is frozen with ``v``; after it the momentum,
    scaled per layer to a common RMS, is exchanged in 1 bit with error
    feedback as in :func:`jaxcomp.onebit_adam` (same codecs, same two
    exchanges), and each layer's frozen ratio is multiplied by a factor
    ``f`` that tracks how far the variance has drifted since the freeze
    (bounded by ``factor_min``, ``factor_max`` and ``factor_threshold``).
    ``update`` needs ``params`` (the trust ratio is ``||p|| / ||update||``).

    ``codec="sign_l2", exchange="two_stage"`` reproduce DeepSpeed's
    exchange, which flattens the whole model's scaled momentum into one
    vector (``two_stage`` does the same with the leaves larger than
    ``min_dense_size``); as for 1-bit Adam, DeepSpeed's first ``step()``
    drops its gradient (its ``freeze_step=F`` is ``freeze_step=F - 1`` here,
    first batch skipped) and it pads the flat momentum to a multiple of
    ``N * lcm(N, 8)`` values, which changes its scales unless the parameter
    count is such a multiple. There is no bias correction, as in DeepSpeed:
    the trust ratio divides the per-layer scale of ``m / sqrt(v)`` away.
    Differences: coordinates whose frozen ``v`` is 0 get no momentum after
    the freeze (as in :func:`jaxcomp.onebit_adam`; DeepSpeed relies on
    ``exp_avg_mask``), a layer whose momentum is 0 at the freeze gets
    scaling 1 (DeepSpeed divides by 0), and with one device (``axis_name``
    None) the 1-bit round trip is still applied (DeepSpeed skips it).

    Args:
      learning_rate: ``lr > 0``, or an optax schedule of the step count.
      b1, b2: decay rates, in ``[0, 1)``.
      eps: ``> 0``, added to ``sqrt(v)``.
      freeze_step: ``>= 1``, LAMB warm-up steps (dense exchange).
      weight_decay: ``>= 0`` (None: 0), decoupled weight decay inside the
        trust ratio, as ``optax.lamb``'s and DeepSpeed's.
      mask: which leaves decay, as ``optax.lamb``'s ``mask``.
      exp_avg_mask: DeepSpeed's ``exp_avg_mask``, as in
        :func:`jaxcomp.onebit_adam`: 0/1 arrays like the parameters; the
        decoded momentum is multiplied by it after each compressed exchange.
      max_coeff, min_coeff: ``0 < min_coeff <= max_coeff``, the warm-up trust
        ratio's bounds (DeepSpeed's defaults 10 and 0.01).
      coeff_beta: in ``[0, 1)``, the moving-average rate of the frozen ratio
        (``1 / (1 - coeff_beta)`` should not exceed ``freeze_step``).
      factor_max, factor_min: ``0 < factor_min <= factor_max``, the factor's
        bounds (4 and 0.5).
      factor_threshold: in ``[0, 1)``, the largest relative change of the
        factor from one step to the next (0.1).
      axis_name, codec, bucket_size, exchange, min_dense_size, residual_dtype, nonfinite:
        as in :func:`jaxcomp.onebit_adam`, but ``axis_name`` is one mesh axis:
        the two-level ``(node_axis, local_axis)`` would split the layers whose
        trust ratios LAMB computes (a ``ValueError``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with
      :class:`OnebitLambState`; updates are added to the parameters.

    Raises:
      ValueError: for a bad argument (the message names it); from ``update``
        without ``params``, for ``include=`` (backup workers) and for an
        ``exp_avg_mask`` unlike the gradients.

    Example:
      >>> import jax.numpy as jnp
      >>> import optax
      >>> import jaxcomp
      >>> tx = jaxcomp.onebit_lamb(0.1, freeze_step=1)
      >>> params = {"w": jnp.array([1.0, 2.0, -2.0, 4.0])}
      >>> state = tx.init(params)
      >>> g = {"w": jnp.array([1.0, 1.0, -1.0, -1.0])}
      >>> u, state = tx.update(g, state, params)  # LAMB: ||u|| = lr * ||p||
      >>> round(float(optax.tree.norm(u)), 4)
      0.5
      >>> u, state = tx.update(g, state, params)  # 1-bit momentum, frozen ratio
      >>> round(float(state.coeff_freeze[0]), 4), int(state.message_bytes["w"])
      (0.0791, 5)
    """
    if is_two_level(axis_name):
        # The two-level exchange runs the inner optimizer on each device's shard of
        # every leaf: the trust ratios would be per shard, not per layer.
        raise ValueError(
            f"axis_name={axis_name!r}: the two-level exchange (node_axis, local_axis) is not "
            "supported by onebit_lamb, whose trust ratio ||p|| / ||update|| is per whole "
            "leaf while the two-level exchange works on shards of it; use one axis"
        )
    hyperparameters = check_hyperparameters(learning_rate, b1, b2, eps)
    freeze_step = V.check_int("freeze_step", freeze_step, 1, 2**31 - 1)
    decay_and_mask = check_decay_and_mask(weight_decay, mask, exp_avg_mask)
    schedule = _check_lamb_coefficients(
        max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold
    )
    cfg = make_config(
        _OnebitLambConfig,
        hyperparameters,
        {"freeze_step": freeze_step, **schedule},
        decay_and_mask=decay_and_mask,
        codec=codec,
        bucket_size=bucket_size,
        exchange=exchange,
        bias_correction=False,
        axis_name=axis_name,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
    )
    return optax.GradientTransformationExtraArgs(
        functools.partial(_lamb_init, cfg), functools.partial(_lamb_update, cfg)
    )


def _check_lamb_coefficients(
    max_coeff, min_coeff, coeff_beta, factor_max, factor_min, factor_threshold
) -> dict:
    """The trust-ratio options, checked (traced values, from optax.inject_hyperparams, pass)."""
    real = functools.partial(V.check_real, allow_traced=True)
    max_coeff = real("max_coeff", max_coeff, 0.0, low_open=True)
    min_coeff = real("min_coeff", min_coeff, 0.0, low_open=True)
    coeff_beta = real("coeff_beta", coeff_beta, 0.0, 1.0, high_open=True)
    factor_max = real("factor_max", factor_max, 0.0, low_open=True)
    factor_min = real("factor_min", factor_min, 0.0, low_open=True)
    factor_threshold = real("factor_threshold", factor_threshold, 0.0, 1.0, high_open=True)
    for low, high, names in (
        (min_coeff, max_coeff, "min_coeff <= max_coeff"),
        (factor_min, factor_max, "factor_min <= factor_max"),
    ):
        if not (V.is_traced(low) or V.is_traced(high)) and float(low) > float(high):
            raise ValueError(f"{names} is required, got {low!r} > {high!r}")
    return {
        "max_coeff": max_coeff,
        "min_coeff": min_coeff,
        "coeff_beta": coeff_beta,
        "factor_max": factor_max,
        "factor_min": factor_min,
        "factor_threshold": factor_threshold,
    }


def _lamb_init(cfg: _OnebitLambConfig, params) -> OnebitLambState:
    V.check_gradient_leaves(params, f"{cfg.who}.init", "parameter")
    check_exp_avg_mask(cfg, params, f"{cfg.who}.init")
    zeros = moment_dtypes(params, cfg.common.residual_dtype)
    n_leaves = len(jax.tree.leaves(params))
    per_leaf = lambda v: jnp.full([n_leaves], v, jnp.float32)  # noqa: E731
    return OnebitLambState(
        count=jnp.zeros([], jnp.int32),
        mu=zeros,
        nu=zeros_like_tree(zeros),
        nu_fresh=zeros_like_tree(zeros),
        residual=zeros_like_tree(zeros),
        server_residual=server_init(cfg, zeros),
        scaling_coeff=per_leaf(1.0),
        coeff_freeze=per_leaf(0.0),
        last_factor=per_leaf(1.0),
        lamb_coeff=per_leaf(1.0),
        message_bytes=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), params),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
    )


def _lamb_update(cfg: _OnebitLambConfig, updates, state, params=None, *, include=None, **extra):
    del extra
    reject_include(cfg.who, include)
    if params is None:
        raise ValueError(
            f"{cfg.who}: update needs the parameters (the trust ratio is ||p|| / ||update||): "
            "call update(grads, state, params)"
        )
    return _sharding.whole_leaves(
        functools.partial(_lamb_step, cfg), fields=("mu", "nu", "nu_fresh", "residual")
    )(updates, state, params)


def _norm(x):
    """float32 ``||x||_2`` of one leaf (0 for an empty leaf)."""
    x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return jnp.sqrt(jnp.sum(x * x)).astype(jnp.float32)


def _lamb_step(cfg: _OnebitLambConfig, updates, state, params):
    """One step of :func:`onebit_lamb` on whole leaves: the warm-up or the compressed stage."""
    V.check_state_type(state, OnebitLambState, cfg.who)
    check_inputs(cfg.who, updates, state.mu, cfg.common.axis_name)
    check_exp_avg_mask(cfg, updates, cfg.who)
    V.check_tree_like(params, state.mu, cfg.who)
    grads, finite, ok = apply_nonfinite_policy(updates, cfg.common.nonfinite)
    g = jax.tree.map(lambda x, m: x.astype(m.dtype), grads, state.mu)
    # The parameters in the moments' dtype: norms and decay are not rounded to bfloat16.
    p = jax.tree.map(lambda x, m: jnp.asarray(x).astype(m.dtype), params, state.mu)
    n_ok, ok_wire = count_ok(cfg, ok)
    count_inc = optax.safe_increment(state.count)
    new, direction, wire = vma.cond(
        state.count < cfg.freeze_step,
        functools.partial(_warm_up_step, cfg, grads, ok, n_ok, p, count_inc),
        functools.partial(_compressed_momentum_step, cfg, g, ok, n_ok, p),
        state,
    )
    step = _leafwise(new.lamb_coeff, direction, lambda c, u: c.astype(u.dtype) * u)
    new_updates = scale_updates(step_size_at(cfg.learning_rate, state.count), step, updates)

    live = n_ok > 0  # some device contributed: else the step is dropped everywhere
    keep = ("message_bytes", "wire_bytes", "nonfinite_steps")
    new = new._replace(count=count_inc, wire_bytes=wire + ok_wire)
    merged = OnebitLambState(
        *(
            getattr(new, f) if f in keep else tree_where(live, getattr(new, f), getattr(state, f))
            for f in OnebitLambState._fields
        )
    )
    merged = merged._replace(nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32))
    return tree_where(live, new_updates, zeros_like_tree(new_updates)), merged


def _stack(scalars):
    """float32 ``(L,)`` of per-leaf scalars (``(0,)`` for a tree without leaves)."""
    return jnp.stack(scalars) if scalars else jnp.zeros([0], jnp.float32)


def _norms(tree):
    """float32 ``(L,)``: ``||x||_2`` of each leaf, in leaf order (0 for an empty leaf)."""
    return _stack([_norm(x) for x in jax.tree.leaves(tree)])


def _warm_up_step(cfg: _OnebitLambConfig, grads, ok, n_ok, p, count_inc, s):
    """LAMB on the dense mean gradient; the clipped trust ratio is averaged into ``coeff_freeze``.

    Returns (new state but count and wire bytes, the direction ``u``, wire bytes).
    """
    mean, wire = dense_mean(cfg, grads, ok, n_ok, s.mu)
    mu = optax.tree.update_moment(mean, s.mu, cfg.b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(mean, s.nu, cfg.b2, 2)
    nu_fresh = tree_where(count_inc == cfg.freeze_step, nu, s.nu_fresh)
    prelim = precondition(mu, nu, cfg.b1, cfg.b2, cfg.eps, 1, 1, bias_correction=False)
    direction = add_weight_decay(cfg, prelim, p)
    # The per-leaf scalars as (L,) vectors: a handful of ops whatever the leaf count.
    w_norm, u_norm = _norms(p), _norms(direction)
    ratio = jnp.clip(w_norm / jnp.where(u_norm > 0, u_norm, 1), cfg.min_coeff, cfg.max_coeff)
    coeff = jnp.where((w_norm > 0) & (u_norm > 0), ratio, 1.0).astype(jnp.float32)
    # DeepSpeed averages only the steps whose ratio is not exactly 1 (1: a zero norm).
    averaged = cfg.coeff_beta * s.coeff_freeze + (1 - cfg.coeff_beta) * coeff
    coeff_freeze = jnp.where(coeff != 1, averaged, s.coeff_freeze).astype(jnp.float32)
    new = s._replace(
        mu=mu,
        nu=nu,
        nu_fresh=nu_fresh,
        coeff_freeze=coeff_freeze,
        lamb_coeff=coeff,
        message_bytes=leaf_bytes(grads),
    )
    return new, direction, wire


def _momentum_scaling(mu, scaling_coeff, first):
    """``s_j = mean_k(r_k) / r_j``, ``r_j = ||m_j|| / sqrt(d_j)``, at the first compressed
    step (``first``); ``scaling_coeff`` after. Empty leaves do not count; a leaf with
    ``r_j = 0`` gets 1."""
    sizes = np.array([m.size for m in jax.tree.leaves(mu)])
    present = sizes > 0
    rms = _norms(mu) / jnp.sqrt(jnp.asarray(np.maximum(sizes, 1), jnp.float32))
    united = jnp.sum(jnp.where(present, rms, 0)) / max(int(present.sum()), 1)
    fresh = jnp.where(present & (rms > 0), united / jnp.where(rms > 0, rms, 1), 1.0)
    return jnp.where(first, fresh, scaling_coeff).astype(jnp.float32)


def _leafwise(vector, tree, fn):
    """``fn(vector[j], leaf_j)`` for every leaf of ``tree`` (``vector``: ``(L,)``)."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef.unflatten([fn(vector[j], x) for j, x in enumerate(leaves)])


def _compressed_momentum_step(cfg: _OnebitLambConfig, g, ok, n_ok, p, s):
    """Compression stage: 1-bit mean of the scaled local momenta, frozen ``v``, the
    frozen ratio times the bounded factor.

    Returns (new state but count and wire bytes, the direction ``u``, wire bytes).
    """
    scaling = _momentum_scaling(s.mu, s.scaling_coeff, s.count == cfg.freeze_step)
    m_local = _leafwise(
        scaling,
        optax.tree.update_moment(g, s.mu, cfg.b1, 1),
        lambda c, m: m * c.astype(m.dtype),
    )
    mean, residual, server, message_bytes, wire = compressed_mean(
        cfg, m_local, s.residual, s.server_residual, s.message_bytes, ok, n_ok, s.count
    )
    mu = _leafwise(scaling, mean, lambda c, m: m / c.astype(m.dtype))
    mu = mask_momentum(cfg, mu, s.nu)
    # The gradient that the new momentum implies, into the fresh variance.
    grad_rec = jax.tree.map(lambda m, old: (m - old * cfg.b1) / (1 - cfg.b1), mu, s.mu)
    nu_fresh = optax.tree.update_moment_per_elem_norm(grad_rec, s.nu_fresh, cfg.b2, 2)
    prelim = precondition(mu, s.nu, cfg.b1, cfg.b2, cfg.eps, 1, 1, bias_correction=False)
    direction = add_weight_decay(cfg, prelim, p)

    def drift(v, v_fresh):  # max (sqrt(v) + eps) / (sqrt(v_fresh) + eps) of one leaf
        if v.size == 0:
            return jnp.float32(1)
        return jnp.max((jnp.sqrt(v) + cfg.eps) / (jnp.sqrt(v_fresh) + cfg.eps)).astype(jnp.float32)

    factor = _stack(
        [drift(v, f) for v, f in zip(jax.tree.leaves(s.nu), jax.tree.leaves(nu_fresh), strict=True)]
    )
    if has_weight_decay(cfg):  # the share of the update that is decay does not drift with v
        u0_norm, u_norm = _norms(prelim), _norms(direction)
        share = jnp.minimum(1.0, u0_norm / jnp.where(u_norm > 0, u_norm, 1))
        share = jnp.where(u_norm > 0, share, 1.0)
        factor = factor * share + (1 - share)
    factor = jnp.clip(factor, cfg.factor_min, cfg.factor_max)
    last = s.last_factor
    factor = jnp.clip(factor, last * (1 - cfg.factor_threshold), last * (1 + cfg.factor_threshold))
    factor = factor.astype(jnp.float32)
    new = s._replace(
        mu=mu,
        nu_fresh=nu_fresh,
        residual=residual,
        server_residual=server,
        scaling_coeff=scaling,
        last_factor=factor,
        lamb_coeff=(s.coeff_freeze * factor).astype(jnp.float32),
        message_bytes=message_bytes,
    )
    return new, direction, wire
