"""1-bit Adam and 0/1 Adam: Adam with a frozen variance, so that error feedback works.

Why not ``optax.chain(compressor, optax.adam(...))``? Error feedback keeps
``residual = accumulated - sent`` and relies on everything after the
compressor being *linear* in what was sent: then whatever is held back now
moves the parameters by the same amount later, and nothing is lost. Adam's
update ``m / (sqrt(v) + eps)`` is not linear: a coordinate that a sparsifier
holds back for many steps arrives as one large value, Adam normalises it to a
step of about ``lr`` (its ``v`` grows with the square of that value), and the
mass that the residual carried is rescaled away; a sign compressor's constant
magnitudes are normalised the same way. 1-bit Adam (Tang et al., 2021)
freezes ``v`` after a warm-up: from then on the update is
``m / (sqrt(v_frozen) + eps)``, linear in ``m``, and it is the momentum ``m``
that is compressed with error feedback. 0/1 Adam (Lu et al., 2022) updates
``v`` on an exponentially sparser schedule instead of a fixed warm-up, and
adds local steps that skip the synchronisation.

Both reuse jaxcomp's 1-bit codecs (:func:`jaxcomp.quantization.sign_quantizer`,
``||x||_1 / d * sign(x)`` per bucket, by default; ``||x||_2 / sqrt(d) *
sign(x)``, DeepSpeed's, with ``codec="sign_l2"``; or
:func:`jaxcomp.quantization.onebit_quantizer`) and offer two exchanges:

- ``exchange="allgather"`` (default), *single-stage*: every device
  all-gathers the ``N`` 1-bit messages (through
  :func:`jaxcomp.transforms.quantize.quantize`), decodes and averages them
  in device order. The averaged momentum is exactly the mean of the decoded
  worker messages; a device sends ``(N - 1) d`` bits.
- ``exchange="two_stage"``, DeepSpeed's ``compressed_allreduce``: the
  compressed leaves are flattened into one vector of ``d`` values, split
  into ``N`` chunks; an ``all_to_all`` sends chunk ``j`` of every worker's
  1-bit message to device ``j`` (the chunk's "server"), which averages the
  decoded chunks, adds its *server error*, compresses again (one scale per
  chunk) and keeps the new server error; an all-gather of the servers'
  1-bit chunks gives every device the same result. A device sends about
  ``2 d (N - 1) / N`` bits whatever ``N`` is; the result carries a second
  compression error, which the server error feeds back (nothing is lost:
  ``mean_i (x_i + e_i) + s = result + mean_i e_i' + s'``, with ``s`` the
  servers' errors concatenated). Scale per device (worker) and per chunk
  (server), as DeepSpeed; codecs ``"sign"`` and ``"sign_l2"``, no buckets.
  Each device stores the server error as a ``d``-vector that is zero outside
  its own chunk (``N``-independent state, ``d`` rather than ``d / N``
  floats).

Layout of the code: :func:`onebit_adam` and :func:`zero_one_adam` validate
their arguments into a frozen config, :class:`_OnebitAdamConfig` or
:class:`_ZeroOneAdamConfig`: the optimizer's own schedule over
:class:`_AdamConfig`, the options both take (Adam's hyperparameters, checked
by :func:`_check_hyperparameters`; codec, exchange and the common options,
checked by :func:`_make_config`; 0/1 Adam's schedule by
:func:`_check_zero_one_schedule`). ``init`` and ``update`` are module-level
functions over it (:func:`_onebit_init`, :func:`_onebit_update`,
:func:`_zero_one_init`, :func:`_zero_one_update`). The exchanges are
functions of :class:`_AdamConfig`: :func:`_count_ok`, :func:`_dense_mean`,
:func:`_server_init` and :func:`_compressed_mean` (single-stage through
:func:`jaxcomp.transforms.quantize.quantize`, or :func:`_two_stage_mean`
around :func:`_compressed_allreduce`). A 1-bit Adam step
(:func:`_onebit_step`) is the warm-up (:func:`_warm_up_step`) or the
compressed stage (:func:`_compressed_momentum_step`). A 0/1 Adam step
(:func:`_zero_one_step`) is stage 1, :func:`_variance_stage` (a dense
variance step, :func:`_dense_variance_step`, or a 1-bit gradient step,
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
from jax import lax

from jaxcomp import _sharding
from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.quantization import onebit_quantizer, sign_quantizer
from jaxcomp.transforms.base import (
    CommonOptions,
    apply_nonfinite_policy,
    check_common_options,
    resolve_residual_dtype,
)
from jaxcomp.transforms.quantize import QuantizeState, quantize

__all__ = [
    "ADAM_CODECS",
    "ADAM_EXCHANGES",
    "OnebitAdamState",
    "ZeroOneAdamState",
    "onebit_adam",
    "zero_one_adam",
]

# Values of the ``codec`` argument: jaxcomp's 1-bit codecs.
ADAM_CODECS = ("sign", "onebit", "sign_l2")
# Values of the ``exchange`` argument (module docstring).
ADAM_EXCHANGES = ("allgather", "two_stage")


# ---------------------------------------------------------------------------
# Static configuration.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _AdamConfig:
    """The validated static options both optimizers take (see :func:`_make_config`).

    :class:`_OnebitAdamConfig` and :class:`_ZeroOneAdamConfig` add each
    optimizer's schedule and its name for error messages (``who``).
    """

    who: ClassVar[str]
    learning_rate: Any  # float > 0, an optax schedule, or a traced (injected) value
    b1: Any  # b1, b2, eps: floats, or traced (injected) values
    b2: Any
    eps: Any
    bias_correction: bool
    common: CommonOptions  # axis_name, min_dense_size, residual_dtype, nonfinite
    two_stage: bool  # exchange="two_stage" (module docstring); else "allgather"
    sign_scale: str  # "l1", or "l2" with codec="sign_l2": the two-stage exchange's scales
    single_stage: optax.GradientTransformationExtraArgs  # exchange="allgather": quantize(codec)


def _check_hyperparameters(learning_rate, b1, b2, eps):
    """``(learning_rate, b1, b2, eps)``, checked: Adam's arithmetic, which may be traced."""
    # A traced rate (optax.inject_hyperparams) only scales the update: nothing static
    # depends on it, so it is taken as it is, like a schedule.
    if not (callable(learning_rate) or V.is_traced(learning_rate)):
        learning_rate = V.check_real("learning_rate", learning_rate, 0.0, low_open=True)
    # Traced values (optax.inject_hyperparams) are taken as they are: they only enter
    # the arithmetic, never a shape or the schedule.
    b1 = V.check_real("b1", b1, 0.0, 1.0, high_open=True, allow_traced=True)
    b2 = V.check_real("b2", b2, 0.0, 1.0, high_open=True, allow_traced=True)
    # eps > 0: a frozen variance can be 0 where a coordinate never had a gradient.
    eps = V.check_real("eps", eps, 0.0, low_open=True, allow_traced=True)
    return learning_rate, b1, b2, eps


def _make_config(
    cls,
    hyperparameters,
    schedule: dict,
    *,
    codec,
    bucket_size,
    exchange,
    bias_correction,
    axis_name,
    min_dense_size,
    residual_dtype,
    nonfinite,
):
    """The config ``cls`` of one optimizer, from the checked ``hyperparameters``
    (:func:`_check_hyperparameters`) and ``schedule`` (its own options, checked
    by its factory) and the other options both optimizers take, checked here.

    The factory checks in the order of its signature (hyperparameters, its
    schedule, then these), so a call with several bad arguments reports the
    first one; each error names its argument.
    """
    codec = V.check_choice("codec", codec, ADAM_CODECS)
    bucket_size = V.check_int("bucket_size", bucket_size, 1, allow_none=True)
    exchange = V.check_choice("exchange", exchange, ADAM_EXCHANGES)
    if exchange == "two_stage" and (codec == "onebit" or bucket_size is not None):
        raise ValueError(
            f"exchange='two_stage' sends one scale per device and per server chunk "
            f"(DeepSpeed's compressed_allreduce): codec must be 'sign' or 'sign_l2' and "
            f"bucket_size None, got codec={codec!r}, bucket_size={bucket_size!r}"
        )
    sign_scale = "l2" if codec == "sign_l2" else "l1"
    if codec == "onebit":
        quantizer = onebit_quantizer(bucket_size)
    else:
        quantizer = sign_quantizer(bucket_size, scale=sign_scale)
    bias_correction = V.check_bool("bias_correction", bias_correction)
    common = check_common_options(
        axis_name=axis_name,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
    )
    learning_rate, b1, b2, eps = hyperparameters
    return cls(
        learning_rate=learning_rate,
        b1=b1,
        b2=b2,
        eps=eps,
        bias_correction=bias_correction,
        common=common,
        two_stage=exchange == "two_stage",
        sign_scale=sign_scale,
        # Nonfinite steps are filtered before the codec (apply_nonfinite_policy in
        # each step); the inner policy only matters for a device's own message.
        single_stage=quantize(
            quantizer,
            axis_name=common.axis_name,
            error_feedback=True,
            min_dense_size=common.min_dense_size,
            residual_dtype=common.residual_dtype,
            nonfinite="skip",
        ),
        **schedule,
    )


# ---------------------------------------------------------------------------
# Shared arithmetic.
# ---------------------------------------------------------------------------


def _step_size(learning_rate, count):
    """``-lr`` at ``count`` (steps taken so far), as ``optax.scale_by_learning_rate``."""
    if callable(learning_rate):
        return -jnp.asarray(learning_rate(count), jnp.float32)
    return -learning_rate


def _scale(step_size, tree, like):
    """``step_size * u`` cast to the gradient dtype (``optax.scale``'s arithmetic)."""

    def one(u, g):
        s = step_size if isinstance(step_size, float) else step_size.astype(u.dtype)
        return (s * u).astype(jnp.result_type(g))

    return jax.tree.map(one, tree, like)


def _zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _where(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def _leaf_bytes(tree) -> Any:
    """int32 per leaf: bytes of the leaf sent dense."""
    return jax.tree.map(
        lambda g: jnp.asarray(g.size * jnp.dtype(g.dtype).itemsize, jnp.int32), tree
    )


# ---------------------------------------------------------------------------
# The exchanges both optimizers use: dense mean and 1-bit mean with error feedback.
# ---------------------------------------------------------------------------


def _count_ok(cfg: _AdamConfig, ok):
    """(devices that contribute, as float32; bytes of that all-reduce)."""
    axis_name = cfg.common.axis_name
    if axis_name is None:
        return ok.astype(jnp.float32), jnp.float32(0)
    if cfg.common.nonfinite != "skip":  # every device always contributes: no collective needed
        return jnp.float32(collectives.axis_size(axis_name)), jnp.float32(0)
    n_dev = collectives.axis_size(axis_name)
    n_ok = lax.psum(ok.astype(jnp.float32), axis_name)
    return n_ok, jnp.float32(collectives.allreduce_bytes(4, n_dev))


def _dense_mean(cfg: _AdamConfig, grads, ok, n_ok, dtypes):
    """Uncompressed mean over the devices that contribute, cast to ``dtypes``."""
    wire = jnp.float32(0)
    out = []
    g_leaves, treedef = jax.tree.flatten(grads)
    for g, d in zip(g_leaves, treedef.flatten_up_to(dtypes), strict=True):
        mean, leaf_wire = _dense_leaf_mean(g, ok, n_ok, cfg.common.axis_name)
        out.append(mean.astype(d.dtype))
        wire = wire + leaf_wire
    return treedef.unflatten(out), wire


def _server_init(cfg: _AdamConfig, zeros):
    """The two-stage exchange's server error (module docstring): flat, ``d`` values.

    None when there is none to keep (``exchange="allgather"``, or no leaf
    above ``min_dense_size``): orbax refuses to save a zero-size array, and
    None is an empty pytree node that orbax, ``jaxcomp.elastic`` and
    ``jax.tree`` all pass through.
    """
    big = [z for z in jax.tree.leaves(zeros) if z.size > cfg.common.min_dense_size]
    d = sum(z.size for z in big) if cfg.two_stage else 0
    if d == 0:
        return None
    # The widest of the leaves' dtypes: one flat buffer carries them all, and a
    # float64 leaf beside a float32 one must not be rounded to float32.
    return jnp.zeros([d], jnp.result_type(*big))


def _compressed_mean(cfg: _AdamConfig, x, residual, server, message_bytes, ok, n_ok, step):
    """Mean over devices of the 1-bit messages of ``x + residual``.

    Returns (mean, new residual, new server error, message bytes, wire bytes).
    """
    if cfg.two_stage:
        return _two_stage_mean(cfg, x, residual, server, ok, n_ok)
    qs = QuantizeState(
        step=step,
        residual=residual,
        key=jax.random.key_data(jax.random.key(0)),  # the 1-bit codecs draw nothing
        message_bytes=message_bytes,
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
    )
    skip = cfg.common.axis_name is not None and cfg.common.nonfinite == "skip"
    mean, qs = cfg.single_stage.update(x, qs, include=ok if skip else None)
    # A device that sends nothing keeps its residual as it was (quantize
    # would file the unsent x under it, to be sent later a second time).
    new_res = _where(ok, qs.residual, residual)
    mean = jax.tree.map(lambda m, r: m.astype(r.dtype), mean, x)
    return mean, new_res, server, qs.message_bytes, qs.wire_bytes


def _dense_leaf_mean(g, ok, n_ok, axis_name):
    """(mean over the devices that contribute, in ``g``'s dtype; bytes of its all-reduce)."""
    if axis_name is None:
        return g, jnp.float32(0)
    # In the gradient's dtype: that is what travels. Divided like pmean, so the
    # warm-up matches optax.adam after a dense pmean bit for bit; float16 is
    # divided first, as collectives.dense_mean does (a sum of float16
    # gradients overflows 65504 where their mean fits, and mu stayed inf).
    n_dev = collectives.axis_size(axis_name)
    divisor = jnp.maximum(n_ok, 1.0).astype(g.dtype)
    if collectives.divides_first(g.dtype, n_dev):
        mean = lax.psum(jnp.where(ok, g / divisor, jnp.zeros_like(g)), axis_name)
    else:
        total = lax.psum(jnp.where(ok, g, jnp.zeros_like(g)), axis_name)
        mean = total / divisor
    return mean, jnp.float32(collectives.allreduce_bytes(g.size * g.dtype.itemsize, n_dev))


def _sign_scale(x, count, scale):
    """``||x||_1 / count`` or ``||x||_2 / sqrt(count)`` (0 when ``count`` is 0)."""
    count = jnp.maximum(jnp.asarray(count, x.dtype), 1)
    if scale == "l1":
        return jnp.sum(jnp.abs(x)) / count
    return jnp.sqrt(jnp.sum(x * x) / count)


def _signed(bits, scale):
    """Decodes sign bits (True: ``+``) to ``+-scale``."""
    return jnp.where(bits, scale, -scale)


def _two_stage_mean(cfg: _AdamConfig, x, residual, server, ok, n_ok):
    """DeepSpeed's ``compressed_allreduce`` over ``axis_name`` (module docstring).

    Leaves with at most ``min_dense_size`` elements are averaged dense (their
    residual stays 0); the others are flattened into one vector of ``d``
    values and exchanged by :func:`_compressed_allreduce`.

    Returns (mean, new residual, new server error, message bytes, wire bytes).
    """
    axis_name = cfg.common.axis_name
    x_leaves, treedef = jax.tree.flatten(x)
    r_leaves = treedef.flatten_up_to(residual)
    big = [v.size > cfg.common.min_dense_size for v in x_leaves]
    n = 1 if axis_name is None else collectives.axis_size(axis_name)
    me = 0 if axis_name is None else lax.axis_index(axis_name)
    denom = jnp.maximum(n_ok, 1.0)
    wire = jnp.float32(0)
    out = [None] * len(x_leaves)
    new_res = list(r_leaves)
    message_bytes = []
    for i, (v, r, b) in enumerate(zip(x_leaves, r_leaves, big, strict=True)):
        if b:
            message_bytes.append(jnp.asarray(-(-v.size // 8), jnp.int32))
            continue
        # Small leaf: dense, no error feedback (its residual is 0 and stays 0).
        mean, leaf_wire = _dense_leaf_mean(v + r, ok, n_ok, axis_name)
        out[i] = mean.astype(v.dtype)
        wire = wire + leaf_wire
        message_bytes.append(jnp.asarray(v.size * v.dtype.itemsize, jnp.int32))
    # None: nothing to compress two-stage (states made before it was None held shape (0,)).
    d = 0 if server is None else server.shape[0]
    if d:
        flat = jnp.concatenate(
            [
                (v + r).astype(server.dtype).reshape(-1)
                for v, r, b in zip(x_leaves, r_leaves, big, strict=True)
                if b
            ]
        )
        # A device that sends nothing (non-finite gradient) contributes scale 0.
        flat = jnp.where(ok, flat, jnp.zeros_like(flat))
        mean_flat, worker_err, server, wire = _compressed_allreduce(
            cfg, flat, server, ok, denom, n, me, wire
        )
        offset = 0
        for i, (v, r, b) in enumerate(zip(x_leaves, r_leaves, big, strict=True)):
            if not b:
                continue
            size = v.size
            out[i] = mean_flat[offset : offset + size].reshape(v.shape).astype(v.dtype)
            err = worker_err[offset : offset + size].reshape(r.shape).astype(r.dtype)
            new_res[i] = jnp.where(ok, err, r)
            offset += size
    mean = treedef.unflatten(out)
    return mean, treedef.unflatten(new_res), server, treedef.unflatten(message_bytes), wire


def _compressed_allreduce(cfg: _AdamConfig, flat, server, ok, denom, n, me, wire):
    """The two stages over the flat vector ``flat`` of ``d`` values (module docstring).

    ``flat`` is zero-padded to ``n`` chunks of ``c`` values (``c`` a multiple
    of 8, so a chunk's signs pack into whole bytes); this device (``me``)
    serves its chunk, with ``server`` its server error and ``denom`` the
    number of devices that contribute. Returns (the decoded mean of ``flat``,
    this device's worker error, the new server error, ``wire`` plus the bytes
    of this exchange).
    """
    axis_name, scale = cfg.common.axis_name, cfg.sign_scale
    d, dtype = server.shape[0], server.dtype
    chunk = -(-d // (8 * n)) * 8
    padded = n * chunk
    worker_scale = jnp.where(ok, _sign_scale(flat, d, scale), 0).astype(dtype)
    worker_bits = flat >= 0  # 0 goes as +, as DeepSpeed's sign().add_(1).bool()
    worker_err = flat - _signed(worker_bits, worker_scale)
    bits = jnp.pad(worker_bits, (0, padded - d)).reshape(n, chunk)
    packed = jnp.packbits(bits, axis=1, bitorder="little")  # (n, c / 8) uint8
    if axis_name is not None:
        # Row j of what a device receives: worker j's signs of this device's chunk.
        packed = lax.all_to_all(packed, axis_name, 0, 0)
        scales = lax.all_gather(worker_scale, axis_name)
    else:
        packed, scales = packed[me : me + 1], worker_scale[None]
    recv = jnp.unpackbits(packed, axis=1, count=chunk, bitorder="little").astype(bool)
    # Server: the mean of the decoded chunks, in device order, plus its error.
    avg = jnp.sum(_signed(recv, scales[:, None]), axis=0) / denom.astype(dtype)
    valid = me * chunk + jnp.arange(chunk) < d
    server_pad = jnp.pad(server, (0, padded - d))
    server_old = lax.dynamic_slice(server_pad, (me * chunk,), (chunk,))
    server_buf = jnp.where(valid, avg + server_old, 0)
    server_scale = _sign_scale(server_buf, jnp.clip(d - me * chunk, 0, chunk), scale)
    server_bits = server_buf >= 0
    server_new = jnp.where(valid, server_buf - _signed(server_bits, server_scale), 0)
    server = lax.dynamic_update_slice(server_pad, server_new, (me * chunk,))[:d]
    out_packed = jnp.packbits(server_bits, bitorder="little")
    if axis_name is not None:
        # Typed device-invariant (every device gets the same servers' chunks): with
        # plain all_gather make_train_step's probe took the result for unexchanged
        # and averaged the gradients densely before the optimizer.
        out_packed = collectives.all_gather_invariant(out_packed, axis_name)
        out_scales = collectives.all_gather_invariant(server_scale, axis_name)
        c8, f = chunk // 8, dtype.itemsize
        # all_to_all (n - 1 chunks), worker scale, servers' chunks and scales.
        wire = wire + jnp.float32((n - 1) * (c8 + f) + collectives.allgather_bytes(c8 + f, n))
    else:
        out_packed, out_scales = out_packed[None], server_scale[None]
    out_bits = jnp.unpackbits(out_packed, axis=1, count=chunk, bitorder="little")
    mean_flat = _signed(out_bits.astype(bool), out_scales[:, None]).reshape(-1)[:d]
    return mean_flat, worker_err, server, wire


# ---------------------------------------------------------------------------
# Adam's arithmetic and the checks both optimizers make.
# ---------------------------------------------------------------------------


def _moment_dtypes(params, residual_dtype):
    # zeros_like: a parameter split over an explicit mesh axis gets moments split alike.
    return jax.tree.map(
        lambda p: jnp.zeros_like(p, resolve_residual_dtype(residual_dtype, [p])), params
    )


def _precondition(mu, nu, b1, b2, eps, count, nu_count, bias_correction):
    """``mu_hat / (sqrt(nu_hat) + eps)`` (optax.scale_by_adam's arithmetic)."""
    if bias_correction:
        mu = optax.tree.bias_correction(mu, b1, count)
        nu = optax.tree.bias_correction(nu, b2, nu_count)
    return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)


def _denominator(nu, b2, eps, nu_count, bias_correction):
    """``sqrt(nu_hat) + eps``: the (frozen) preconditioner's denominator."""
    if bias_correction:
        nu = optax.tree.bias_correction(nu, b2, nu_count)
    return jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)


def _mask_dead(tree, nu):
    """Zeroes coordinates whose variance is exactly 0 (never had a nonzero gradient).

    A 1-bit code cannot send 0, so such a coordinate would receive
    ``+-scale`` and step by ``scale / eps``; DeepSpeed asks users for an
    ``exp_avg_mask`` for this, here it is derived from the variance.
    """
    return jax.tree.map(lambda x, v: jnp.where(v > 0, x, jnp.zeros_like(x)), tree, nu)


def _reject_include(who, include):
    # Backup workers: what a left-out device did not send has no exact place
    # here (its momentum mixes the shared mean with its gradient, and 0/1
    # Adam's local steps move its parameters), so it is refused rather than
    # silently averaged in. A ProbeError (a ValueError) is raised as it is by
    # make_train_step's probe.
    if include is not None:
        raise vma.ProbeError(
            f"{who} does not take include= (backup workers): the 1-bit momentum exchange "
            "averages every device's message; use a sparsifier or jaxcomp.quantize for "
            "partial aggregation"
        )


def _check_common(who, updates, state_mu, axis_name):
    V.check_gradient_leaves(updates, who)
    V.check_tree_like(updates, state_mu, who)
    check_per_device(updates, axis_name, who)


# ---------------------------------------------------------------------------
# 1-bit Adam.
# ---------------------------------------------------------------------------


class OnebitAdamState(NamedTuple):
    """State of :func:`onebit_adam`.

    Attributes:
      count: int32, steps taken (a step dropped because every device's
        gradient was non-finite does not count).
      mu: first moment ``m``, float32 (or wider) like the parameters; after
        the freeze the averaged compressed momentum, identical on every device.
      nu: second moment ``v``; frozen from step ``freeze_step`` on.
      residual: error-feedback memory of the compressed momentum (per device).
      server_residual: ``exchange="two_stage"``'s server error, a flat vector
        of the compressed leaves' size, zero outside this device's chunk
        (per device); None with ``exchange="allgather"`` (or when every leaf
        is sent dense), as orbax cannot save a zero-size array.
      message_bytes: int32 per leaf, bytes of this device's last message (the
        dense gradient in the warm-up, packed 1-bit codes + scales after;
        two-stage: the leaf's packed signs, the scales are in ``wire_bytes``).
      wire_bytes: float32, bytes this device put on the wire in the last step.
      nonfinite_steps: int32, steps whose gradients (on this device) held
        NaN or Inf.
    """

    count: jax.Array
    mu: Any
    nu: Any
    residual: Any
    server_residual: jax.Array | None
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


@dataclasses.dataclass(frozen=True, eq=False)
class _OnebitAdamConfig(_AdamConfig):
    """The validated static options of one :func:`onebit_adam` transform."""

    who: ClassVar[str] = "jaxcomp.onebit_adam"
    freeze_step: int  # >= 1: warm-up steps (dense exchange) before v is frozen


def onebit_adam(
    learning_rate: float | Callable,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    *,
    freeze_step: int,
    axis_name: Any = None,
    codec: str = "sign",
    bucket_size: int | None = None,
    exchange: str = "allgather",
    bias_correction: bool = True,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
) -> optax.GradientTransformationExtraArgs:
    """1-bit Adam (Tang et al., 2021, "1-bit Adam: Communication Efficient
    Large-Scale Training with Adam's Convergence Speed", Algorithm 1).

    Steps ``t = 0, 1, ...`` (``count`` before the step), per device ``i``
    with local gradient ``g_i``:

    - warm-up, ``t < freeze_step``: plain Adam on the dense mean gradient,
      ``g = mean_i g_i`` (all-reduce), ``m = b1 m + (1 - b1) g``,
      ``v = b2 v + (1 - b2) g^2``.
    - compression stage, ``t >= freeze_step``: ``v`` is frozen at its value
      after ``freeze_step`` steps; each device updates the momentum from its
      *local* gradient, ``m_i = b1 m + (1 - b1) g_i``, sends
      ``C[m_i + e_i]`` (1 bit per coordinate plus a scale per bucket) and keeps
      ``e_i = m_i + e_i - C[m_i + e_i]`` (error feedback, per device); every
      device sets ``m = mean_i C[m_i + e_i]`` (single-stage exchange, see
      the module docstring).
    - both stages: ``update = -lr * m_hat / (sqrt(v_hat) + eps)``, with
      ``m_hat = m / (1 - b1^(t+1))`` and ``v_hat = v / (1 - b2^min(t+1,
      freeze_step))`` when ``bias_correction`` (the bias correction of ``v``
      is frozen with ``v``), else ``m`` and ``v`` themselves.

    The warm-up is ``optax.adam`` on the mean gradient, bit for bit (with
    ``bias_correction=True``; float32 parameters). The paper and DeepSpeed's
    ``OnebitAdam`` apply no bias correction (``bias_correction=False``
    reproduces them; the two differ by under 1% once ``t > 5 / (1 - b2)``).
    DeepSpeed's codec scales by ``||x||_2 / sqrt(d)`` and its exchange is
    two-stage: ``codec="sign_l2", exchange="two_stage"`` reproduce them. The
    defaults are the squared-error-optimal scale ``||x||_1 / d`` per leaf and
    the single-stage exchange (module docstring).
    Coordinates whose frozen ``v`` is exactly 0 get no momentum after the
    freeze (what DeepSpeed's ``exp_avg_mask`` is for; a 1-bit code cannot
    send 0). The paper recommends a warm-up of 15-25% of training.

    Two more differences from DeepSpeed's ``OnebitAdam``, which the settings
    above do not remove:

    - DeepSpeed's first ``step()`` is an initialisation step that drops its
      gradient, so its ``freeze_step=F`` runs ``F - 1`` dense steps on
      gradients. To reproduce it, skip the first batch and pass
      ``freeze_step=F - 1``.
    - DeepSpeed flattens the momentum and pads it with zeros to a multiple of
      ``N * lcm(N, 8)`` (``N`` devices) before its compressed all-reduce; the
      padding counts in its ``sqrt(d)`` scales, so with a parameter count
      that is not such a multiple the decoded values differ (at ``d = 1000``,
      ``N = 4``, parameters differed by up to 68% after a few steps). No
      setting reproduces that padding; with ``d`` a multiple of
      ``N * lcm(N, 8)`` there is none and ``codec="sign_l2",
      exchange="two_stage", bias_correction=False`` match DeepSpeed.

    The update is identical on every device (``v`` comes from the same dense
    means, ``m`` from the same decoded messages), so it works with
    :func:`jaxcomp.distributed.make_train_step` and replicated parameters.

    Args:
      learning_rate: ``lr > 0``, or an optax schedule of the step count.
      b1, b2: Adam's decay rates, in ``[0, 1)``.
      eps: ``> 0``, added to ``sqrt(v_hat)``.
      freeze_step: ``>= 1``, warm-up steps with dense exchange before ``v``
        is frozen (required: there is no good default; DeepSpeed's is 100000).
      axis_name: mesh axis to average over inside ``shard_map``; ``None``:
        one device (the 1-bit round trip is still applied after the freeze).
      codec: ``"sign"`` (``||x||_1 / d * sign(x)``), ``"sign_l2"``
        (``||x||_2 / sqrt(d) * sign(x)``, DeepSpeed's) or ``"onebit"``.
      bucket_size: values sharing one scale (None: one per leaf).
      exchange: ``"allgather"`` (single-stage) or ``"two_stage"``
        (DeepSpeed's compressed all-reduce with server error; see the module
        docstring).
      bias_correction: Adam's bias correction (see above).
      min_dense_size: leaves with at most this many elements are sent dense
        after the freeze too (None: 0).
      residual_dtype: dtype of ``mu``, ``nu`` and the residual (None: float32,
        or wider parameters' dtype).
      nonfinite: ``"skip"``: a device whose gradients hold NaN/Inf sends
        nothing (the means are over the others, its residual is kept); a step
        where no device has finite gradients changes nothing but
        ``nonfinite_steps`` and returns zero updates. ``"zero"``: non-finite
        elements are replaced by 0.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`OnebitAdamState`
      whose updates are to be added to the parameters (``optax.apply_updates``),
      like ``optax.adam``'s.

    Raises:
      ValueError: for a bad argument; the message names it. From ``update``
        for ``include=`` (backup workers are not supported).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.transforms.adam import onebit_adam
      >>> tx = onebit_adam(0.1, freeze_step=1)
      >>> g = {"w": jnp.array([1.0, 1.0, -1.0, -1.0])}
      >>> state = tx.init(g)
      >>> u, state = tx.update(g, state)        # warm-up: optax.adam's first step
      >>> [round(float(x), 4) for x in u["w"]]
      [-0.1, -0.1, 0.1, 0.1]
      >>> u, state = tx.update(g, state)        # frozen v, 1-bit momentum
      >>> int(state.count), int(state.message_bytes["w"])  # 4 bits: 1 byte + a float32 scale
      (2, 5)
    """
    hyperparameters = _check_hyperparameters(learning_rate, b1, b2, eps)
    # freeze_step 0 would freeze v at 0: every coordinate "dead", no step ever.
    freeze_step = V.check_int("freeze_step", freeze_step, 1, 2**31 - 1)
    cfg = _make_config(
        _OnebitAdamConfig,
        hyperparameters,
        {"freeze_step": freeze_step},
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
        functools.partial(_onebit_init, cfg), functools.partial(_onebit_update, cfg)
    )


def _onebit_init(cfg: _OnebitAdamConfig, params) -> OnebitAdamState:
    V.check_gradient_leaves(params, f"{cfg.who}.init", "parameter")
    zeros = _moment_dtypes(params, cfg.common.residual_dtype)
    return OnebitAdamState(
        count=jnp.zeros([], jnp.int32),
        mu=zeros,
        nu=_zeros_like_tree(zeros),
        residual=_zeros_like_tree(zeros),
        server_residual=_server_init(cfg, zeros),
        message_bytes=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), params),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
    )


def _onebit_update(
    cfg: _OnebitAdamConfig, updates, state, params=None, *, include=None, **extra_args
):
    del params, extra_args
    _reject_include(cfg.who, include)
    # Leaves split over explicit mesh axes (jit outside shard_map): each leaf
    # handled whole, as on one device (see jaxcomp._sharding).
    return _sharding.whole_leaves(
        functools.partial(_onebit_step, cfg), fields=("mu", "nu", "residual")
    )(updates, state)


def _onebit_step(cfg: _OnebitAdamConfig, updates, state):
    """One step of :func:`onebit_adam` on whole leaves: the warm-up or the compressed stage."""
    V.check_state_type(state, OnebitAdamState, cfg.who)
    _check_common(cfg.who, updates, state.mu, cfg.common.axis_name)
    grads, finite, ok = apply_nonfinite_policy(updates, cfg.common.nonfinite)
    g = jax.tree.map(lambda x, m: x.astype(m.dtype), grads, state.mu)
    n_ok, ok_wire = _count_ok(cfg, ok)
    count_inc = optax.safe_increment(state.count)
    operands = (state.mu, state.nu, state.residual, state.server_residual, state.message_bytes)
    mu, nu, residual, server, message_bytes, wire = vma.cond(
        state.count < cfg.freeze_step,
        functools.partial(_warm_up_step, cfg, grads, ok, n_ok),
        functools.partial(_compressed_momentum_step, cfg, g, ok, n_ok, state.count),
        operands,
    )
    nu_count = jnp.minimum(count_inc, max(cfg.freeze_step, 1))
    direction = _precondition(
        mu, nu, cfg.b1, cfg.b2, cfg.eps, count_inc, nu_count, cfg.bias_correction
    )
    new_updates = _scale(_step_size(cfg.learning_rate, state.count), direction, updates)

    live = n_ok > 0  # some device contributed: else the step is dropped everywhere
    new_state = OnebitAdamState(
        count=jnp.where(live, count_inc, state.count),
        mu=_where(live, mu, state.mu),
        nu=_where(live, nu, state.nu),
        residual=_where(live, residual, state.residual),
        server_residual=_where(live, server, state.server_residual),  # None stays None
        message_bytes=message_bytes,
        wire_bytes=wire + ok_wire,
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
    )
    new_updates = _where(live, new_updates, _zeros_like_tree(new_updates))
    return new_updates, new_state


def _warm_up_step(cfg: _OnebitAdamConfig, grads, ok, n_ok, operands):
    """Warm-up (``count < freeze_step``): Adam's moments from the dense mean gradient."""
    mu, nu, residual, server, _ = operands
    mean, wire = _dense_mean(cfg, grads, ok, n_ok, mu)
    mu = optax.tree.update_moment(mean, mu, cfg.b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(mean, nu, cfg.b2, 2)
    return mu, nu, residual, server, _leaf_bytes(grads), wire


def _compressed_momentum_step(cfg: _OnebitAdamConfig, g, ok, n_ok, count, operands):
    """Compression stage: ``m`` the 1-bit mean of the local momenta, ``v`` frozen."""
    mu, nu, residual, server, message_bytes = operands
    m_local = optax.tree.update_moment(g, mu, cfg.b1, 1)
    mean, residual, server, message_bytes, wire = _compressed_mean(
        cfg, m_local, residual, server, message_bytes, ok, n_ok, count
    )
    return _mask_dead(mean, nu), nu, residual, server, message_bytes, wire


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
class _ZeroOneAdamConfig(_AdamConfig):
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
    - Weight decay is not built in (chain ``optax.add_decayed_weights``
      before, as an L2 term in the gradient).
    - Coordinates whose ``v`` is exactly 0 receive no decoded 1-bit value
      (DeepSpeed's ``exp_avg_mask``, derived here).

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
    hyperparameters = _check_hyperparameters(learning_rate, b1, b2, eps)
    schedule = _check_zero_one_schedule(
        var_freeze_step, var_update_scaler, local_step_scaler, local_step_clipper
    )
    cfg = _make_config(
        _ZeroOneAdamConfig,
        hyperparameters,
        schedule,
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
    zeros = _moment_dtypes(params, cfg.common.residual_dtype)
    i32 = lambda v: jnp.asarray(v, jnp.int32)  # noqa: E731
    return ZeroOneAdamState(
        count=i32(0),
        mu=zeros,
        nu=_zeros_like_tree(zeros),
        nu_count=i32(0),
        residual=_zeros_like_tree(zeros),
        server_residual=_server_init(cfg, zeros),
        accumulator=_zeros_like_tree(zeros),
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
    del params, extra_args
    _reject_include(cfg.who, include)
    # Leaves split over explicit mesh axes (jit outside shard_map): each leaf
    # handled whole, as on one device (see jaxcomp._sharding).
    return _sharding.whole_leaves(
        functools.partial(_zero_one_step, cfg), fields=("mu", "nu", "residual", "accumulator")
    )(updates, state)


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


def _zero_one_step(cfg: _ZeroOneAdamConfig, updates, state):
    """One step of :func:`zero_one_adam` on whole leaves: stage 1 or stage 2."""
    V.check_state_type(state, ZeroOneAdamState, cfg.who)
    _check_common(cfg.who, updates, state.mu, cfg.common.axis_name)
    if cfg.local_steps and cfg.common.axis_name is not None and vma.probing_now():
        # make_train_step is tracing tx to find un-averaged update leaves.
        raise vma.ProbeError(
            f"{cfg.who}: local steps (local_step_clipper={cfg.local_step_clipper} > 1) give "
            "every device its own parameters between syncs, which replicated parameters cannot "
            "hold. Train with jaxcomp.aggregation.make_gossip_train_step(..., "
            "mix_params=False) (one replica per device), or set local_step_clipper=1."
        )
    grads, finite, ok = apply_nonfinite_policy(updates, cfg.common.nonfinite)
    g = jax.tree.map(lambda x, m: x.astype(m.dtype), grads, state.mu)
    t = optax.safe_increment(state.count)
    lr = -_step_size(cfg.learning_rate, state.count)
    inputs = _StepInputs(
        grads=grads,
        g=g,
        ok=ok,
        count=state.count,
        t=t,
        lr=lr,
        lr32=jnp.asarray(lr, jnp.float32),
        no_message=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), state.message_bytes),
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
            getattr(new, f) if f in keep else _where(live, getattr(new, f), getattr(state, f))
            for f in ZeroOneAdamState._fields
        )
    )
    merged = merged._replace(nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32))
    upd = _where(live, upd, _zeros_like_tree(upd))
    upd = jax.tree.map(lambda u, x: u.astype(jnp.result_type(x)), upd, updates)
    return upd, merged


def _variance_stage(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, s):
    """Stage 1 (``t <= var_freeze_step``): a dense variance step every
    ``var_interval`` steps, a 1-bit gradient step in between.

    Returns (updates, new state, whether some device contributed).
    """
    n_ok, ok_wire = _count_ok(cfg, inputs.ok)
    is_var = inputs.t % s.var_interval == 0
    mu, nu, nu_count, residual, server, message_bytes, wire = vma.cond(
        is_var,
        functools.partial(_dense_variance_step, cfg, inputs, n_ok),
        functools.partial(_onebit_gradient_step, cfg, inputs, n_ok),
        s,
    )
    direction = _precondition(
        mu, nu, cfg.b1, cfg.b2, cfg.eps, inputs.t, nu_count, cfg.bias_correction
    )
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
    mean, wire = _dense_mean(cfg, inputs.grads, inputs.ok, n_ok, s.mu)
    mu = optax.tree.update_moment(mean, s.mu, cfg.b1, 1)
    nu = optax.tree.update_moment_per_elem_norm(mean, s.nu, cfg.b2, 2)
    message_bytes = _leaf_bytes(inputs.grads)
    return mu, nu, s.nu_count + 1, s.residual, s.server_residual, message_bytes, wire


def _onebit_gradient_step(cfg: _ZeroOneAdamConfig, inputs: _StepInputs, n_ok, s):
    """Between variance steps: ``m`` from the 1-bit mean gradient, ``v`` left alone."""
    mean, residual, server, message_bytes, wire = _compressed_mean(
        cfg, inputs.g, s.residual, s.server_residual, s.message_bytes, inputs.ok, n_ok, inputs.count
    )
    mu = optax.tree.update_moment(_mask_dead(mean, s.nu), s.mu, cfg.b1, 1)
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
        residual=_where(first, _zeros_like_tree(s.residual), s.residual),
        server_residual=jax.tree.map(lambda x: jnp.where(first, 0, x), s.server_residual),
    )
    d = _denominator(s.nu, cfg.b2, cfg.eps, s.nu_count, cfg.bias_correction)
    m_local = _where(inputs.ok, optax.tree.update_moment(inputs.g, s.mu, cfg.b1, 1), s.mu)
    m_hat = (
        optax.tree.bias_correction(m_local, cfg.b1, inputs.t) if cfg.bias_correction else m_local
    )
    # lr * m_hat / d: this device's own Adam step (0 with non-finite gradients).
    adam_step = jax.tree.map(lambda m, dd: jnp.where(inputs.ok, inputs.lr * m / dd, 0), m_hat, d)
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
    n_ok, ok_wire = _count_ok(cfg, inputs.ok)
    c_local = jax.tree.map(lambda a, st, dd: (a - st) * dd, s.accumulator, adam_step, d)
    c, residual, server, message_bytes, wire = _compressed_mean(
        cfg, c_local, s.residual, s.server_residual, s.message_bytes, inputs.ok, n_ok, inputs.count
    )
    c = _mask_dead(c, s.nu)
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
        accumulator=_zeros_like_tree(s.accumulator),
        lr_sum=jnp.zeros([], jnp.float32),
        message_bytes=message_bytes,
        wire_bytes=wire + ok_wire,
    )
    return upd, new, n_ok > 0
