"""What 1-bit Adam, 0/1 Adam and 1-bit LAMB share: options, two exchanges, Adam's arithmetic.

The optimizers (:mod:`jaxcomp.transforms.onebit_adam`,
:mod:`jaxcomp.transforms.zero_one_adam`, :mod:`jaxcomp.transforms.onebit_lamb`;
:mod:`jaxcomp.transforms.adam` says why they exist) reuse jaxcomp's 1-bit codecs
(:func:`jaxcomp.quantization.sign_quantizer`, ``||x||_1 / d * sign(x)`` per
bucket, by default; ``||x||_2 / sqrt(d) * sign(x)``, DeepSpeed's, with
``codec="sign_l2"``; or :func:`jaxcomp.quantization.onebit_quantizer`) and
offer two exchanges:

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

Layout of the code: :class:`AdamConfig` holds the options the optimizers
take (Adam's hyperparameters, checked by :func:`check_hyperparameters`;
weight decay and the momentum mask, by :func:`check_decay_and_mask`;
codec, exchange and the common options, checked by :func:`make_config`);
each optimizer's own config adds its schedule. The exchanges are functions
of :class:`AdamConfig`: :func:`count_ok`, :func:`dense_mean`,
:func:`server_init` and :func:`compressed_mean` (single-stage through
:func:`jaxcomp.transforms.quantize.quantize`, or :func:`_two_stage_mean`
around :func:`_compressed_allreduce`). Adam's arithmetic
(:func:`precondition`, :func:`denominator`, :func:`mask_momentum`,
:func:`add_weight_decay`, ...) and the
checks both optimizers make (:func:`reject_include`, :func:`check_inputs`)
follow. The names here are public so that the two optimizers' modules can
import them; none is in ``__all__`` but the two option tuples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.quantization import onebit_quantizer, sign_quantizer
from jaxcomp.transforms.base import CommonOptions, check_common_options, resolve_residual_dtype
from jaxcomp.transforms.quantize import QuantizeState, quantize

__all__ = ["ADAM_CODECS", "ADAM_EXCHANGES"]
# Values of the ``codec`` argument: jaxcomp's 1-bit codecs.
ADAM_CODECS = ("sign", "onebit", "sign_l2")
# Values of the ``exchange`` argument (module docstring).
ADAM_EXCHANGES = ("allgather", "two_stage")


# ---------------------------------------------------------------------------
# Static configuration.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class AdamConfig:
    """The validated static options both optimizers take (see :func:`make_config`).

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
    # Decoupled weight decay (optax.adamw's, DeepSpeed's weight_decay): a float >= 0 or
    # a traced (injected) value; decay_mask is optax.adamw's mask (None: every leaf).
    weight_decay: Any
    decay_mask: Any
    # DeepSpeed's exp_avg_mask: None, or numpy bool arrays like the parameters
    # (broadcastable to each leaf), False where the momentum is zeroed.
    exp_avg_mask: Any


def check_hyperparameters(learning_rate, b1, b2, eps):
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


def check_decay_and_mask(weight_decay, mask, exp_avg_mask):
    """``(weight_decay, mask, exp_avg_mask)``, checked (see :func:`add_weight_decay`
    and :func:`mask_momentum`); ``exp_avg_mask``'s leaves become numpy bool arrays."""
    # None (0, the default): optax.inject_hyperparams leaves it alone, so an injected
    # run does not ask for the parameters it would need for a traced rate.
    weight_decay = V.check_real(
        "weight_decay", 0.0 if weight_decay is None else weight_decay, 0.0, allow_traced=True
    )
    if mask is not None and not callable(mask):
        bad = [m for m in jax.tree.leaves(mask) if not isinstance(m, bool | np.bool_)]
        if bad:
            raise ValueError(
                f"mask must be None, a pytree of booleans like the parameters (or a prefix "
                f"of it) or a callable returning one (optax.adamw's mask), got leaf {bad[0]!r}"
            )
    if exp_avg_mask is not None:

        def one(m):
            if V.is_traced(m):
                raise ValueError(
                    "exp_avg_mask must be concrete (numpy or jax arrays of 0/1), not traced"
                )
            a = np.asarray(m)
            if not (
                a.dtype == bool
                or (np.issubdtype(a.dtype, np.number) and np.all((a == 0) | (a == 1)))
            ):
                raise ValueError(
                    "exp_avg_mask must hold only 0/1 (or booleans): 0 where the momentum "
                    f"is zeroed after each exchange, got values {np.unique(a)[:5]!r}"
                )
            return a.astype(bool)

        exp_avg_mask = jax.tree.map(one, exp_avg_mask)
    return weight_decay, mask, exp_avg_mask


def make_config(
    cls,
    hyperparameters,
    schedule: dict,
    *,
    decay_and_mask,
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
    (:func:`check_hyperparameters`), ``schedule`` (its own options, checked
    by its factory) and ``decay_and_mask`` (:func:`check_decay_and_mask`)
    and the other options both optimizers take, checked here.

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
    weight_decay, decay_mask, exp_avg_mask = decay_and_mask
    return cls(
        weight_decay=weight_decay,
        decay_mask=decay_mask,
        exp_avg_mask=exp_avg_mask,
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


def step_size_at(learning_rate, count):
    """``-lr`` at ``count`` (steps taken so far), as ``optax.scale_by_learning_rate``."""
    if callable(learning_rate):
        return -jnp.asarray(learning_rate(count), jnp.float32)
    return -learning_rate


def scale_updates(step_size, tree, like):
    """``step_size * u`` cast to the gradient dtype (``optax.scale``'s arithmetic)."""

    def one(u, g):
        s = step_size if isinstance(step_size, float) else step_size.astype(u.dtype)
        return (s * u).astype(jnp.result_type(g))

    return jax.tree.map(one, tree, like)


def zeros_like_tree(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def tree_where(pred, new, old):
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), new, old)


def leaf_bytes(tree) -> Any:
    """int32 per leaf: bytes of the leaf sent dense."""
    return jax.tree.map(
        lambda g: jnp.asarray(g.size * jnp.dtype(g.dtype).itemsize, jnp.int32), tree
    )


# ---------------------------------------------------------------------------
# The exchanges both optimizers use: dense mean and 1-bit mean with error feedback.
# ---------------------------------------------------------------------------


def count_ok(cfg: AdamConfig, ok):
    """(devices that contribute, as float32; bytes of that all-reduce)."""
    axis_name = cfg.common.axis_name
    if axis_name is None:
        return ok.astype(jnp.float32), jnp.float32(0)
    if cfg.common.nonfinite != "skip":  # every device always contributes: no collective needed
        return jnp.float32(collectives.axis_size(axis_name)), jnp.float32(0)
    n_dev = collectives.axis_size(axis_name)
    n_ok = lax.psum(ok.astype(jnp.float32), axis_name)
    return n_ok, jnp.float32(collectives.allreduce_bytes(4, n_dev))


def dense_mean(cfg: AdamConfig, grads, ok, n_ok, dtypes):
    """Uncompressed mean over the devices that contribute, cast to ``dtypes``."""
    wire = jnp.float32(0)
    out = []
    g_leaves, treedef = jax.tree.flatten(grads)
    for g, d in zip(g_leaves, treedef.flatten_up_to(dtypes), strict=True):
        mean, leaf_wire = _dense_leaf_mean(g, ok, n_ok, cfg.common.axis_name)
        out.append(mean.astype(d.dtype))
        wire = wire + leaf_wire
    return treedef.unflatten(out), wire


def server_init(cfg: AdamConfig, zeros):
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


def compressed_mean(cfg: AdamConfig, x, residual, server, message_bytes, ok, n_ok, step):
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
    new_res = tree_where(ok, qs.residual, residual)
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


def _two_stage_mean(cfg: AdamConfig, x, residual, server, ok, n_ok):
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


def _compressed_allreduce(cfg: AdamConfig, flat, server, ok, denom, n, me, wire):
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


def moment_dtypes(params, residual_dtype):
    # zeros_like: a parameter split over an explicit mesh axis gets moments split alike.
    return jax.tree.map(
        lambda p: jnp.zeros_like(p, resolve_residual_dtype(residual_dtype, [p])), params
    )


def precondition(mu, nu, b1, b2, eps, count, nu_count, bias_correction):
    """``mu_hat / (sqrt(nu_hat) + eps)`` (optax.scale_by_adam's arithmetic)."""
    if bias_correction:
        mu = optax.tree.bias_correction(mu, b1, count)
        nu = optax.tree.bias_correction(nu, b2, nu_count)
    return jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu, nu)


def denominator(nu, b2, eps, nu_count, bias_correction):
    """``sqrt(nu_hat) + eps``: the (frozen) preconditioner's denominator."""
    if bias_correction:
        nu = optax.tree.bias_correction(nu, b2, nu_count)
    return jax.tree.map(lambda v: jnp.sqrt(v) + eps, nu)


def mask_momentum(cfg: AdamConfig, tree, nu):
    """Zeroes, in a decoded 1-bit mean, the coordinates that must not move.

    Two masks, both applied where DeepSpeed multiplies by its
    ``exp_avg_mask`` (right after each compressed exchange, before the
    result enters the momentum):

    - derived, always: coordinates whose variance is exactly 0 (never had a
      nonzero gradient). A 1-bit code cannot send 0, so such a coordinate
      would receive ``+-scale`` and step by ``scale / eps``.
    - ``cfg.exp_avg_mask``, the user's (DeepSpeed's ``exp_avg_mask``): 0
      where the momentum is zeroed, e.g. embedding rows a shorter sequence
      never reaches, whose variance is not 0 after an earlier phase.
    """
    if cfg.exp_avg_mask is None:
        return jax.tree.map(lambda x, v: jnp.where(v > 0, x, jnp.zeros_like(x)), tree, nu)
    return jax.tree.map(
        lambda x, v, m: jnp.where((v > 0) & m, x, jnp.zeros_like(x)), tree, nu, cfg.exp_avg_mask
    )


def check_exp_avg_mask(cfg: AdamConfig, tree, who):
    """``cfg.exp_avg_mask`` fits ``tree`` (parameters or gradients), else a ValueError."""
    if cfg.exp_avg_mask is None:
        return
    t_paths, t_def = jax.tree_util.tree_flatten_with_path(tree)
    m_leaves, m_def = jax.tree.flatten(cfg.exp_avg_mask)
    if m_def != t_def:
        raise ValueError(
            f"{who}: exp_avg_mask must have the parameters' tree structure, got {m_def} "
            f"for parameters {t_def}"
        )
    for (path, x), m in zip(t_paths, m_leaves, strict=True):
        try:
            fits = np.broadcast_shapes(m.shape, jnp.shape(x)) == jnp.shape(x)
        except ValueError:
            fits = False
        if not fits:
            raise ValueError(
                f"{who}: exp_avg_mask leaf {jax.tree_util.keystr(path)} has shape {m.shape}, "
                f"not broadcastable to the parameter's shape {tuple(jnp.shape(x))}"
            )


def has_weight_decay(cfg: AdamConfig) -> bool:
    """Whether the step adds a decay term (a traced rate may be nonzero)."""
    return V.is_traced(cfg.weight_decay) or float(cfg.weight_decay) > 0


def add_weight_decay(cfg: AdamConfig, direction, params):
    """``direction + weight_decay * params`` where ``cfg.decay_mask`` allows
    (``optax.add_decayed_weights``, as ``optax.adamw`` chains it before the
    learning rate: decoupled weight decay, scaled by ``lr`` like DeepSpeed's).

    The parameters are cast to the direction's (moments') dtype first, so a
    bfloat16 parameter's decay term is not rounded to bfloat16.
    """
    if not has_weight_decay(cfg):
        return direction
    if params is None:
        raise ValueError(
            f"{cfg.who}: weight_decay={cfg.weight_decay!r} needs the parameters: call "
            "update(grads, state, params)"
        )
    V.check_tree_like(params, direction, cfg.who)
    params = jax.tree.map(lambda p, d: jnp.asarray(p).astype(d.dtype), params, direction)
    decay = optax.add_decayed_weights(cfg.weight_decay, cfg.decay_mask)
    out, _ = decay.update(direction, decay.init(params), params)
    return out


def reject_include(who, include):
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


def check_inputs(who, updates, state_mu, axis_name):
    V.check_gradient_leaves(updates, who)
    V.check_tree_like(updates, state_mu, who)
    check_per_device(updates, axis_name, who)
