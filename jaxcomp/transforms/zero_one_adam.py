"""0/1 Adam (Lu et al., 2022): ``v`` updated on a sparser and sparser schedule, then local steps.

Steps ``t = 1, 2, ...`` (``count + 1``). Stage 1 (``t <= var_freeze_step``,
adaptive variance freezing): on a variance step (``t % var_interval ==
0``, with ``var_interval`` doubling every ``var_update_scaler`` variance
steps) the gradient is averaged densely and ``m`` and ``v`` are updated as
in Adam; on the other steps ``v`` is left alone and the gradient is
exchanged in 1 bit with error feedback. Stage 2 (``v`` frozen): each device
steps on its local momentum and accumulates its parameter change; every
``local_interval`` steps (doubling up to ``local_step_clipper``) the
accumulated momentum is exchanged in 1 bit with error feedback and the
parameters are reset to the last synchronised point plus the decoded mean,
identical on every device. :func:`zero_one_adam`'s docstring has the
equations and the differences from DeepSpeed's ``ZeroOneAdam``; the
exchanges, codecs and Adam's arithmetic are shared with 1-bit Adam
(:mod:`jaxcomp.transforms.adam_base`).

Layout of the code: :func:`zero_one_adam` validates its arguments into a
frozen :class:`_ZeroOneAdamConfig` (its schedule, checked by
:func:`_check_zero_one_schedule`, over
:class:`jaxcomp.transforms.adam_base.AdamConfig`); ``init`` and ``update``
are :func:`_zero_one_init` and :func:`_zero_one_update`. A step
(:func:`_zero_one_step`, reading :class:`_StepInputs`) is stage 1,
:func:`_variance_stage` (a dense variance step,
:func:`_dense_variance_step`, or a 1-bit gradient step,
:func:`_onebit_gradient_step`), or stage 2, :func:`_frozen_variance_stage`
(:func:`_local_step` or :func:`_sync_step`); :func:`_zero_one_result` writes
the new state, dropping a step that no device could take.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
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
    denominator,
    dense_mean,
    leaf_bytes,
    make_config,
    mask_momentum,
    moment_dtypes,
    precondition,
    reject_include,
    server_init,
    step_size_at,
    tree_where,
    zeros_like_tree,
)
from jaxcomp.transforms.base import apply_nonfinite_policy
from jaxcomp.transforms.two_level import accepts_two_level_axis

__all__ = ["ZeroOneAdamState", "zero_one_adam"]


# ---------------------------------------------------------------------------
# 0/1 Adam.
# ---------------------------------------------------------------------------


class ZeroOneAdamState(NamedTuple):
    """State of :func:`zero_one_adam` (the names of DeepSpeed's ``ZeroOneAdam`` in comments).

    Attributes:
      count: int32, steps taken (``step``).
      mu: first moment ``m`` (``exp_avg``).
      nu: second moment ``v`` (``exp_avg_sq``), updated on variance steps only.
      nu_count: int32, variance updates so far (``v``'s bias correction).
      residual: error-feedback memory of the 1-bit exchanges (``worker_error``),
        per device; reset to 0 when the local-step stage begins.
      server_residual: ``exchange="two_stage"``'s server error
        (``server_error``), as in :class:`OnebitAdamState`; reset with
        ``residual``.
      accumulator: the local steps' parameter change since the last
        synchronisation, ``-sum lr_k m_hat_k / (sqrt(v_hat) + eps)``
        (``momentum_accumulator``), per device.
      lr_sum: float32, ``sum lr_k`` over those steps (``lrs``).
      var_interval, var_counter: the variance schedule (``var_interval``,
        ``var_counter``).
      local_interval, local_counter: the local-step schedule
        (``local_step_interval``, ``local_step_counter``).
      message_bytes: int32 per leaf, bytes of this device's last message
        (0 on a local step).
      wire_bytes: float32, bytes this device put on the wire in the last step.
      nonfinite_steps: int32, steps whose gradients held NaN or Inf.
    """

    count: jax.Array
    mu: Any
    nu: Any
    nu_count: jax.Array
    residual: Any
    server_residual: jax.Array | None
    accumulator: Any
    lr_sum: jax.Array
    var_interval: jax.Array
    var_counter: jax.Array
    local_interval: jax.Array
    local_counter: jax.Array
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class _ZeroOneAdamConfig(AdamConfig):
    """The validated static options of one :func:`zero_one_adam` transform."""

    who: ClassVar[str] = "jaxcomp.zero_one_adam"
    var_freeze_step: int  # the last step (t, from 1) that may update v
    var_update_scaler: int  # variance updates per doubling of var_interval
    local_step_scaler: int  # stage-2 steps per doubling of local_interval
    local_step_clipper: int  # the largest local_interval

    @property
    def local_steps(self) -> bool:
        """Whether stage 2 takes local steps between syncs (else every step syncs)."""
        return self.local_step_clipper > 1


@accepts_two_level_axis()
def zero_one_adam(
    learning_rate: float | Callable,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    var_freeze_step: int,
    var_update_scaler: int | None = None,
    local_step_scaler: int | None = None,
    local_step_clipper: int | None = None,
    weight_decay: Any = None,
    mask: Any = None,
    exp_avg_mask: Any = None,
    axis_name: Any = None,
    codec: str = "sign",
    bucket_size: int | None = None,
    exchange: str = "allgather",
    bias_correction: bool = True,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """0/1 Adam (Lu et al., 2022, "Maximizing Communication Efficiency for
    Large-scale Training via 0/1 Adam"), following DeepSpeed's ``ZeroOneAdam``.

    Steps ``t = 1, 2, ...`` (``count + 1``), per device with local gradient ``g_i``.

    Stage 1, ``t <= var_freeze_step`` (adaptive variance freezing):

    - on a variance step (``t % var_interval == 0``) the gradient is averaged
      densely, ``g = mean_i g_i``, and ``m = b1 m + (1 - b1) g``,
      ``v = b2 v + (1 - b2) g^2``;
    - on the other steps ``v`` is left alone and the gradient is exchanged in
      1 bit with error feedback: ``g = mean_i C[g_i + e_i]``,
      ``m = b1 m + (1 - b1) g``;
    - ``update = -lr * m_hat / (sqrt(v_hat) + eps)``;
    - ``var_interval`` starts at 1 and doubles after every
      ``var_update_scaler`` variance steps (the paper's ``kappa``): ``v`` is
      updated at steps 1..16, 18, 20, ..., 48, 52, ... (with 16).

    Stage 2, ``t > var_freeze_step`` (``v`` frozen; 1-bit sync with local
    steps): the error-feedback memory is reset once; every step
    ``m = b1 m + (1 - b1) g_i`` from the local gradient, the local parameter
    change ``-lr * m_hat / d`` (``d = sqrt(v_hat) + eps``) is applied and
    accumulated in ``accumulator``, and ``lr_sum += lr``. On a sync step
    (``t % local_interval == 0``) the accumulated momentum
    ``c_i = accumulator * d`` (``= -sum lr_k m_hat_k``) is exchanged in 1 bit
    with error feedback, ``c = mean_i C[c_i + e_i]``, the parameters are
    reset to the last synchronised point plus ``c / d`` (identical on every
    device), ``m = -c / lr_sum`` (times ``1 - b1^t`` with bias correction;
    with ``lr_sum == 0`` nothing but error feedback was sent and ``m`` stays
    the local one, as after a local step, until the next sync),
    and ``accumulator`` and ``lr_sum`` restart from 0. ``local_interval``
    starts at 1 and doubles, up to ``local_step_clipper`` (the paper's ``H``),
    after every ``local_step_scaler`` stage-2 steps.

    What is simplified or changed from DeepSpeed (and why):

    - By default the exchange is single-stage and the codec's scale
      ``||x||_1 / d``; ``codec="sign_l2", exchange="two_stage"`` is
      DeepSpeed's (module docstring).
    - DeepSpeed's first call is a dummy initialisation step, and its freeze
      flag takes effect one step after ``step > var_freeze_step``; here stage 2
      starts exactly at ``t = var_freeze_step + 1``.
    - ``bias_correction=True`` (default) divides ``m`` by ``1 - b1^t`` and
      ``v`` by ``1 - b2^k`` (``k`` variance updates so far); DeepSpeed takes
      the flag but applies none (``bias_correction=False`` matches it).
    - Coordinates whose ``v`` is exactly 0 receive no decoded 1-bit value
      (derived from ``v``; a 1-bit code cannot send 0), besides those that
      ``exp_avg_mask`` zeroes.

    Weight decay (``weight_decay``, DeepSpeed's and ``optax.adamw``'s,
    decoupled): every step's Adam direction becomes
    ``m_hat / d + wd * p`` (``p`` the parameters before the step, ``wd`` 0
    where ``mask`` is False), in both stages: in stage 2 the local step
    ``-lr * (m_hat / d + wd * p)`` is what ``accumulator`` sums, so the decay
    travels in the synchronised ``c`` and enters ``m = -c / lr_sum``, as in
    DeepSpeed. ``exp_avg_mask`` (DeepSpeed's) multiplies each decoded 1-bit
    mean where DeepSpeed does: the gradient mean before it enters ``m`` in
    stage 1, the synchronised ``c`` in stage 2.

    Local steps make the parameters differ between devices until the next
    sync, so with ``local_step_clipper > 1`` the updates are per device: train
    with one parameter replica per device,
    :func:`jaxcomp.aggregation.make_gossip_train_step` with
    ``mix_params=False`` (parameters and state stacked per device);
    :func:`jaxcomp.distributed.make_train_step` (replicated parameters)
    raises. With ``local_step_clipper=1`` every stage-2 step syncs and the
    update is identical on every device.

    Args:
      learning_rate: ``lr > 0``, or an optax schedule of the step count.
      b1, b2: Adam's decay rates, in ``[0, 1)``.
      eps: ``> 0``, added to ``sqrt(v_hat)``.
      var_freeze_step: ``>= 1``, the last step that may update ``v``
        (DeepSpeed: "usually the end of the learning rate warmup").
      var_update_scaler: ``>= 1``, variance updates per interval doubling
        (None: 16).
      local_step_scaler: ``>= 1``, stage-2 steps per local-interval doubling
        (None: DeepSpeed's default 32678).
      local_step_clipper: ``>= 1``, the largest local interval (None: 16).
      weight_decay, mask, exp_avg_mask: as in :func:`onebit_adam` (above).
      axis_name, codec, bucket_size, exchange, bias_correction, min_dense_size, residual_dtype:
        as in :func:`onebit_adam`.
      nonfinite: as in :func:`onebit_adam`, for the steps that communicate; on
        a local step a device with non-finite gradients takes no step (its
        ``m`` and accumulator are kept, its update is 0) while the schedule
        advances, so the devices stay in lockstep.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with
      :class:`ZeroOneAdamState`; updates are added to the parameters.

    Raises:
      ValueError: for a bad argument (the message names it); under
        ``make_train_step`` with ``local_step_clipper > 1`` and ``axis_name``;
        from ``update`` for ``include=`` (backup workers are not supported).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.transforms.adam import zero_one_adam
      >>> tx = zero_one_adam(0.1, var_freeze_step=2, var_update_scaler=1)
      >>> g = {"w": jnp.array([1.0, -1.0])}
      >>> state = tx.init(g)
      >>> for _ in range(4):
      ...     u, state = tx.update(g, state)
      >>> int(state.nu_count)  # variance updated at steps 1 and 2
      2
    """
    hyperparameters = check_hyperparameters(learning_rate, b1, b2, eps)
    schedule = _check_zero_one_schedule(
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper
    )
    cfg = make_config(
        _ZeroOneAdamConfig,
        hyperparameters,
        schedule,
        decay_and_mask=check_decay_and_mask(weight_decay, mask, exp_avg_mask),
        codec=codec,
        bucket_size=bucket_size,
        exchange=exchange,
        bias_correction=bias_correction,
        axis_name=axis_name,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
    )
    return optax.GradientTransformationExtraArgs(
        functools.partial(_zero_one_init, cfg), functools.partial(_zero_one_update, cfg)
    )


def _check_zero_one_schedule(
    var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper
) -> dict:
    """:func:`zero_one_adam`'s schedule, checked: the :class:`_ZeroOneAdamConfig` fields."""
    # var_freeze_step 0 would start stage 2 with no variance update (v = 0: NaN
    # through the bias correction 1 - b2^0, or no step without it).
    var_freeze_step = V.check_int("var_freeze_step", var_freeze_step, 1, 2**31 - 2)
    # None (the defaults, 16, 32678, 16): optax.inject_hyperparams leaves them alone.
    var_update_scaler = V.check_int(
        "var_update_scaler", 16 if var_update_scaler is None else var_update_scaler, 1, 2**31 - 1
    )
    local_step_scaler = V.check_int(
        "local_step_scaler", 32678 if local_step_scaler is None else local_step_scaler, 1, 2**31 - 1
    )
    local_step_clipper = V.check_int(
        "local_step_clipper", 16 if local_step_clipper is None else local_step_clipper, 1, 2**30
    )
    return {
        "var_freeze_step": var_freeze_step,
        "var_update_scaler": var_update_scaler,
        "local_step_scaler": local_step_scaler,
        "local_step_clipper": local_step_clipper,
    }


def _zero_one_init(cfg: _ZeroOneAdamConfig, params) -> ZeroOneAdamState:
    V.check_gradient_leaves(params, f"{cfg.who}.init", "parameter")
    check_exp_avg_mask(cfg, params, f"{cfg.who}.init")
    zeros = moment_dtypes(params, cfg.common.residual_dtype)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return ZeroOneAdamState(
        count=i32(0),
        mu=zeros,
        nu=zeros_like_tree(zeros),
        nu_count=i32(0),
        residual=zeros_like_tree(zeros),
        server_residual=server_init(cfg, zeros),
        accumulator=zeros_like_tree(zeros),
        lr_sum=jnp.zeros([], jnp.float32),
        var_interval=i32(1),
        var_counter=i32(0),
        local_interval=i32(1),
        local_counter=i32(0),
        message_bytes=jax.tree.map(lambda _: i32(0), params),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=i32(0),
    )


def _zero_one_update(
    cfg: _ZeroOneAdamConfig, updates, state, params=None, *, include=None, **extra_args
):
    del extra_args
    reject_include(cfg.who, include)
    # Leaves split over explicit mesh axes (jit outside shard_map): each leaf
    # handled whole, as on one device (see jaxcomp._sharding).
    return _sharding.whole_leaves(
        functools.partial(_zero_one_step, cfg), fields=("mu", "nu", "residual", "accumulator")
    )(updates, state, params)


class _StepInputs(NamedTuple):
    """What the branches of one 0/1 Adam step read besides the state (:func:`_zero_one_step`)."""

    grads: Any  # after the non-finite policy, in the gradients' dtypes (the dense exchange)
    g: Any  # grads in the moments' dtypes
    ok: jax.Array  # bool: this device's gradients count (see apply_nonfinite_policy)
    count: jax.Array  # int32, steps taken before this one
    t: jax.Array  # int32, count + 1: this step's number
    lr: Any  # the learning rate at count (float32 from a schedule)
    lr32: jax.Array  # lr as float32, summed into lr_sum
    no_message: Any  # int32 0 per leaf: message_bytes of a local step
    params: Any  # the parameters before the step (None without weight decay)


def _zero_one_step(cfg: _ZeroOneAdamConfig, updates, state, params):
    """One step of :func:`zero_one_adam` on whole leaves: stage 1 or stage 2."""
    V.check_state_type(state, ZeroOneAdamState, cfg.who)
    check_inputs(cfg.who, updates, state.mu, cfg.common.axis_name)
    if cfg.local_steps and cfg.common.axis_name is not None and vma.probing_now():
        # make_train_step is tracing tx to find un-averaged update leaves.
        raise vma.ProbeError(
            f"{cfg.who}: local steps (local_step_clipper={cfg.local_step_clipper} > 1) give "
            "every device its own parameters between syncs, which replicated parameters cannot "
            "hold. Train with jaxcomp.aggregation.make_gossip_train_step(..., "
            "mix_params=False) (one replica per device), or set local_step_clipper=1."
        )
    check_exp_avg_mask(cfg, updates, cfg.who)
    if params is None:
        add_weight_decay(cfg, updates, None)  # raises if weight decay needs the parameters
    grads, finite, ok = apply_nonfinite_policy(updates, cfg.common.nonfinite)
    g = jax.tree.map(lambda x, m: x.astype(m.dtype), grads, state.mu)
    t = optax.safe_increment(state.count)
    lr = -step_size_at(cfg.learning_rate, state.count)
    inputs = _StepInputs(
        grads=grads,
        g=g,
        ok=ok,
        count=state.count,
        t=t,
        lr=lr,
        lr32=jnp.asarray(lr, jnp.float32),
        no_message=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), state.message_bytes),
        params=params,
    )
    upd, new, live = vma.cond(
        t <= cfg.var_freeze_step,
        functools.partial(_variance_stage, cfg, inputs),
        functools.partial(_frozen_variance_stage, cfg, inputs),
        state,
    )
    return _zero_one_result(state, new._replace(count=t), upd, updates, live, finite)


def _zero_one_result(state, new, upd, updates, live, finite):
    """The step's updates and new state (``new``, or ``state`` where not ``live``)."""
    # A communicating step where no device had finite gradients is dropped
    # everywhere (the devices agree on it, so their schedules stay aligned).
    keep = ("message_bytes", "wire_bytes", "nonfinite_steps")
    merged = ZeroOneAdamState(
        *(
            getattr(new, f) if f in keep else tree_where(live, getattr(new, f), getattr(state, f))
            for f in ZeroOneAdamState._fields
        )
    )
    merged = merged._replace(nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32))
    upd = tree_where(live, upd, zeros_like_tree(upd))
    upd = jax.tree.map(lambda u, x: u.astype(jnp.result_type(x)), upd, updates)
    return upd, merged


def _variance_stage(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, s):
    """Stage 1 (``t <= var_freeze_step``): a dense variance step every
    ``var_interval`` steps, a 1-bit gradient step in between.

    Returns (updates, new state, whether some device contributed).
    """
    n_ok, ok_wire = count_ok(cfg, inputs.ok)
    is_var = inputs.t % s.var_interval == 0
    mu, nu, nu_count, residual, server, message_bytes, wire = vma.cond(
        is_var,
        functools.partial(_dense_variance_step, cfg, inputs, n_ok),
        functools.partial(_onebit_gradient_step, cfg, inputs, n_ok),
        s,
    )
    direction = precondition(
        mu, nu, cfg.b1, cfg.b2, cfg.eps, inputs.t, nu_count, cfg.bias_correction
    )
    direction = add_weight_decay(cfg, direction, inputs.params)
    upd = jax.tree.map(lambda x: -inputs.lr * x, direction)
    counter = s.var_counter + is_var.astype(jnp.int32)
    wrap = counter == cfg.var_update_scaler
    new = s._replace(
        mu=mu,
        nu=nu,
        nu_count=nu_count,
        residual=residual,
        server_residual=server,
        var_counter=jnp.where(wrap, 0, counter),
        var_interval=jnp.where(wrap, s.var_interval * 2, s.var_interval),
        message_bytes=message_bytes,
        wire_bytes=wire + ok_wire,
    )
    return upd, new, n_ok > 0


def _dense_variance_step(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, n_ok, s):
    """A variance step: ``m`` and ``v`` from the dense mean gradient."""
    mean, wire = dense_mean(cfg, inputs.grads, inputs.ok, n_ok, s.mu)
    mu = optax.tree.update_moment(mean, s.mu, cfg.b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(mean, s.nu, cfg.b2, 2)
    message_bytes = leaf_bytes(inputs.grads)
    return mu, nu, s.nu_count + 1, s.residual, s.server_residual, message_bytes, wire


def _onebit_gradient_step(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, n_ok, s):
    """Between variance steps: ``m`` from the 1-bit mean gradient, ``v`` left alone."""
    mean, residual, server, message_bytes, wire = compressed_mean(
        cfg, inputs.g, s.residual, s.server_residual, s.message_bytes, inputs.ok, n_ok, inputs.count
    )
    mu = optax.tree.update_moment(mask_momentum(cfg, mean, s.nu), s.mu, cfg.b1, 1)
    return mu, s.nu, s.nu_count, residual, server, message_bytes, wire


def _frozen_variance_stage(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, s):
    """Stage 2 (``t > var_freeze_step``): ``v`` frozen; local steps, and a 1-bit
    sync every ``local_interval`` steps.

    Returns (updates, new state, whether the step counts).
    """
    # DeepSpeed resets the error buffers when stage 2 begins: they held
    # gradient errors, from now on they hold accumulated-momentum errors.
    first = inputs.t == cfg.var_freeze_step + 1
    s = s._replace(
        residual=tree_where(first, zeros_like_tree(s.residual), s.residual),
        server_residual=jax.tree.map(lambda x: jnp.where(first, 0, x), s.server_residual),
    )
    d = denominator(s.nu, cfg.b2, cfg.eps, s.nu_count, cfg.bias_correction)
    m_local = tree_where(inputs.ok, optax.tree.update_moment(inputs.g, s.mu, cfg.b1, 1), s.mu)
    m_hat = (
        optax.tree.bias_correction(m_local, cfg.b1, inputs.t) if cfg.bias_correction else m_local
    )
    # lr * (m_hat / d + wd * p): this device's own Adam step (0 with non-finite gradients).
    direction = add_weight_decay(cfg, jax.tree.map(jnp.divide, m_hat, d), inputs.params)
    adam_step = jax.tree.map(lambda x: jnp.where(inputs.ok, inputs.lr * x, 0), direction)
    lr_sum = s.lr_sum + inputs.lr32
    sync = functools.partial(_sync_step, cfg, inputs, d, m_local, adam_step, lr_sum)
    if cfg.local_steps:
        local = functools.partial(_local_step, cfg, inputs, m_local, adam_step, lr_sum)
        upd, new, live = vma.cond(inputs.t % s.local_interval == 0, sync, local, s)
    else:
        upd, new, live = sync(s)
    counter = s.local_counter + 1
    wrap = counter == cfg.local_step_scaler
    new = new._replace(
        local_counter=jnp.where(wrap, 0, counter),
        local_interval=jnp.where(
            wrap, jnp.minimum(s.local_interval * 2, cfg.local_step_clipper), s.local_interval
        ),
    )
    return upd, new, live


def _local_step(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, m_local, adam_step, lr_sum, s):
    """A local step: this device's own Adam step, accumulated until the next sync."""
    upd = jax.tree.map(jnp.negative, adam_step)
    acc = jax.tree.map(jnp.subtract, s.accumulator, adam_step)
    new = s._replace(
        mu=m_local,
        accumulator=acc,
        lr_sum=lr_sum,
        message_bytes=inputs.no_message,
        wire_bytes=jnp.zeros([], jnp.float32),
    )
    # One device (no axis): nobody else's schedule to keep aligned, drop the step.
    return upd, new, inputs.ok if cfg.common.axis_name is None else jnp.bool_(True)


def _sync_step(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, d, m_local, adam_step, lr_sum, s):
    """A sync: the 1-bit mean of the accumulated momenta moves every device to the same point."""
    n_ok, ok_wire = count_ok(cfg, inputs.ok)
    c_local = jax.tree.map(lambda a, st, dd: (a - st) * dd, s.accumulator, adam_step, d)
    c, residual, server, message_bytes, wire = compressed_mean(
        cfg, c_local, s.residual, s.server_residual, s.message_bytes, inputs.ok, n_ok, inputs.count
    )
    c = mask_momentum(cfg, c, s.nu)
    # Parameters stand at (last sync + accumulator): move them to
    # last sync + c / d, the same point on every device.
    upd = jax.tree.map(lambda cc, dd, a: cc / dd - a, c, d, s.accumulator)
    scale = (1 - jnp.float32(cfg.b1) ** inputs.t) if cfg.bias_correction else jnp.float32(1)
    # With lr_sum == 0 (a schedule at 0 since the last sync) the messages
    # carried no momentum, only the error feedback, and -c / 0 was inf:
    # the momentum stays this device's own, as after a local step.
    moved = lr_sum != 0
    divisor = jnp.where(moved, lr_sum, 1)
    mu = jax.tree.map(
        lambda cc, ml: jnp.where(moved, -cc / divisor * scale, ml).astype(cc.dtype),
        c,
        m_local,
    )
    new = s._replace(
        mu=mu,
        residual=residual,
        server_residual=server,
        accumulator=zeros_like_tree(s.accumulator),
        lr_sum=jnp.zeros([], jnp.float32),
        message_bytes=message_bytes,
        wire_bytes=wire + ok_wire,
    )
    return upd, new, n_ok > 0
