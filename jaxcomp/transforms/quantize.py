"""The generic quantizing compressor: error feedback around any codec.

``quantize`` is one optax ``GradientTransformationExtraArgs`` that every
quantizing method in jaxcomp is built from (QSGD, 1-bit SGD, scaled sign,
TernGrad, natural compression, Signum, 16-bit casts, ...); the named factories
in ``quantizers.py`` only pick the codec and the options. It is the analogue
of :func:`jaxcomp.sparsify`. Per step and per leaf:

    v      = b v + (1 - b) g           # only with beta=b (Signum's moving average)
    R      = e + v  (error feedback)  or  R = v  (without); v = g without beta
           = rs e + gs v               # with GRACE's residual_scale=rs, gradient_scale=gs
    msg    = encode(R)                 # packed codes + float32 scales
    S      = decode(msg)               # what every receiver reconstructs
    e_new  = R - S                     # with error feedback; else no e is kept
    update = mean over devices of decode(msg_d)     (summed in accumulation_dtype)
          or majority vote of the decode(msg_d)     (exchange="majority", sign codecs)

The codecs (:class:`jaxcomp.quantization.Quantizer`: a flat float32 vector
to a message ``(codes, scales)`` and back) live in :mod:`jaxcomp.quantization`
and are re-exported here; the exchanges of their messages in
:mod:`jaxcomp.comm.quantized`.

Error feedback keeps ``e_new = R - S`` computed in the residual dtype with one
rounding, ``S`` being the update as returned (cast back to the gradient dtype).
Unlike a sparsifier, whose ``S`` equals ``R`` where it is nonzero, a quantized
``S`` is far from ``R`` element-wise, so ``S + (R - S)`` recovers ``R`` only up
to that one rounding of the difference (an exactly representable ``e_new``
often does not exist): the residual is the correctly rounded ``R - S``, bit for
bit, and ``|S + e_new - R| <= ulp(R - S) / 2``. Leaves sent dense keep the
sparsifier's exact invariant.

The exchange is per step, not per leaf: the messages of all leaves travel
in one buffer per dtype, and one collective per buffer (see ``exchange``).

Layout of the code: :func:`quantize` validates its arguments into a frozen
:class:`_Config` (holding the :class:`jaxcomp.comm.quantized.QuantizedExchange`
it runs); ``init`` and ``update`` are the module-level :func:`_init` and
:func:`_update` over it. A step checks its inputs (:func:`_check_inputs`),
applies the non-finite policy, encodes each leaf on this device
(:func:`_encode_leaf`: accumulate, encode, decode its own message), exchanges
all leaves at once (:func:`jaxcomp.comm.quantized.exchange_leaves`) and
writes the new state.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp import _sharding
from jaxcomp import _validation as V
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.comm.collectives import array_nbytes
from jaxcomp.comm.quantized import (
    QUANTIZER_EXCHANGES,
    VOTE_EXCHANGES,
    Encoded,
    QuantizedExchange,
    exchange_leaves,
    to_dtype,
)
from jaxcomp.quantization.codecs import (
    CAST_DTYPES,
    QSGD_NORMS,
    SIGN_SCALES,
    Quantizer,
    bounded_sign_quantizer,
    cast_quantizer,
    message_nbytes,
    natural_dithering_quantizer,
    natural_quantizer,
    onebit_quantizer,
    qsgd_bits,
    qsgd_levels,
    qsgd_quantizer,
    sign_quantizer,
    terngrad_quantizer,
)
from jaxcomp.quantization.packing import pack_codes, unpack_codes
from jaxcomp.transforms.base import (
    CommonOptions,
    ResidualScaling,
    apply_nonfinite_policy,
    check_common_options,
    check_residual_scaling,
    resolve_residual_dtype,
    scaled_accumulation,
)
from jaxcomp.transforms.two_level import accepts_two_level_axis

__all__ = [
    "CAST_DTYPES",
    "MomentumQuantizeState",
    "QSGD_NORMS",
    "QUANTIZER_EXCHANGES",
    "QuantizeState",
    "Quantizer",
    "SIGN_SCALES",
    "VOTE_EXCHANGES",
    "bounded_sign_quantizer",
    "cast_quantizer",
    "message_nbytes",
    "natural_dithering_quantizer",
    "natural_quantizer",
    "onebit_quantizer",
    "pack_codes",
    "qsgd_bits",
    "qsgd_levels",
    "qsgd_quantizer",
    "quantize",
    "sign_quantizer",
    "terngrad_quantizer",
    "unpack_codes",
]


class QuantizeState(NamedTuple):
    """State of :func:`quantize`.

    Per-leaf statistics are pytrees shaped like the gradients with one scalar
    per leaf; read them with ``optax.tree.get(opt_state, "message_bytes")``
    even inside an ``optax.chain``.

    Attributes:
      step: int32, number of updates so far.
      residual: the error-feedback memory, a pytree like the gradients in the
        residual dtype (per device under ``shard_map``); ``None`` with
        ``error_feedback=False`` (nothing is allocated, as ``velocity`` in
        :class:`jaxcomp.SparsifyState` without momentum), so
        ``optax.tree.get(state, "residual")`` returns None.
      key: raw uint32 PRNG key data of randomized quantizers; step ``t`` uses
        ``fold_in(key, t)``, folded with the device index under ``axis_name``
        and the leaf index, so a seed reproduces a run.
      message_bytes: int32 per leaf, bytes of this device's last message
        (packed codes + float32 scales; the dense tensor for dense-sent
        leaves; 0 when nothing was sent).
      wire_bytes: float32, bytes this device put on the wire in the last step:
        ``(N - 1)`` times the gathered message bytes, a ring all-reduce's for
        dense leaves (0 with ``axis_name=None``); with ``include=``, plus a
        ring all-reduce's of the 4-byte device count per exchanged buffer.
      nonfinite_steps: int32, steps whose gradients held NaN or Inf.
      message: ``None`` unless ``keep_message=True``: then this device's last
        message per leaf, a ``(codes, scales)`` pair (``None`` for leaves sent
        dense), for host-side accounting such as the Elias-coded size
        (:func:`jaxcomp.coding.coded_message_bytes`).
    """

    step: jax.Array
    residual: Any
    key: jax.Array
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array
    message: Any = None


class MomentumQuantizeState(NamedTuple):
    """State of :func:`quantize` with ``beta`` (Signum): :class:`QuantizeState` + ``velocity``.

    A separate type, so that :class:`QuantizeState` (and checkpoints and
    :mod:`jaxcomp.elastic`'s rules for it) keep their layout.

    Attributes:
      step, residual, key, message_bytes, wire_bytes, nonfinite_steps,
        message: as in :class:`QuantizeState`.
      velocity: the moving average ``v = b v + (1 - b) g`` per device, a pytree like
        the gradients in the residual dtype; ``None`` for ``beta=0``
        (signSGD: nothing is allocated). A skipped (non-finite) step keeps it.
    """

    step: jax.Array
    residual: Any
    key: jax.Array
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array
    message: Any = None
    velocity: Any = None


# Whether quantize() exchanges all leaves of a step together (one buffer per
# dtype) or each leaf on its own (one group per leaf: the per-leaf exchange
# the merged one must reproduce bit for bit). Read when quantize() is called;
# the tests switch it off to build the per-leaf reference.
_MERGE_LEAVES = True


@accepts_two_level_axis()
def quantize(
    quantizer: Quantizer,
    *,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    error_feedback: bool = True,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
    beta: float | jax.Array | None = None,
    accumulation_dtype: Any = None,
    momentum: float | jax.Array | None = None,
) -> optax.GradientTransformationExtraArgs:
    """A quantizing compressor, with optional error feedback, around any codec.

    Args:
      quantizer: a :class:`Quantizer` (:func:`qsgd_quantizer`,
        :func:`sign_quantizer`, :func:`onebit_quantizer`,
        :func:`bounded_sign_quantizer`, :func:`terngrad_quantizer`,
        :func:`natural_quantizer`, :func:`natural_dithering_quantizer`,
        :func:`cast_quantizer`, or your own).
      axis_name: mesh axis to average over inside ``shard_map``/``pmap``: the
        packed codes and the scales are all-gathered, every device decodes all
        ``N`` messages and averages them (in device order, so all devices get
        bit-identical updates). ``None``: return the local decoded update.
      exchange: one of :data:`jaxcomp.comm.quantized.QUANTIZER_EXCHANGES`
        (:mod:`jaxcomp.comm.quantized` describes each): ``"allgather"``
        (above); ``"server"`` (device 0 decodes, averages and sends the dense
        mean back; no ``include=``); ``"gossip"`` (each device mixes its own
        and its two ring neighbours' decoded messages: decentralized, train
        with :func:`jaxcomp.aggregation.make_gossip_train_step`; no
        ``include=``); ``"allreduce"`` (a compressed all-reduce of ``N``
        chunk messages per leaf, bytes like a ring all-reduce's, the mean
        quantized a second time; no ``keep_message``); or ``"majority"``
        (sign codecs only, ``quantizer.signs``: signSGD with majority vote).
        Every exchange moves all leaves of a step together, one collective
        per buffer, with the results of exchanging each leaf on its own, bit
        for bit; with ``include=`` the included-device count (a float32) is
        all-reduced once per buffer and counted so in ``wire_bytes``.
      servers: ``exchange="server"`` only: ``M``, a group of parameter
        servers in ``[1, N]`` (checked when the update is traced), spread over
        the axis (:func:`jaxcomp.comm.server_devices`); the coded leaves are
        sharded by leaf (:func:`jaxcomp.comm.assign_to_servers`), the leaves
        sent dense by key range. Each leaf's mean is the one server's.
        None: 1.
      error_feedback: keep ``residual = R - decoded`` and add it to the next
        gradient (1-bit SGD, EF-signSGD). ``False``: send the quantized
        gradient itself (unbiased QSGD, signSGD); no residual is allocated
        (``state.residual`` is None).
      residual_scale: GRACE's ``ResidualMemory`` ``beta`` in [0, 1] (may be
        traced): with error feedback ``R = residual_scale * e +
        gradient_scale * v``, ``e_new = R - decoded``; a skipped (non-finite)
        step keeps ``e``. None: 1. Needs ``error_feedback=True``.
      gradient_scale: GRACE's ``gamma`` > 0 (may be traced). None: 1.
      min_dense_size: leaves with at most this many elements are sent dense
        (QSGD: 10K; None: 0); their residual keeps only the rounding to the gradient
        dtype (zero for float32).
      residual_dtype: float dtype of the residual and of the accumulation.
        ``None`` (default): float32, or the parameter's dtype where it is
        wider (float64 under ``jax_enable_x64``), as in
        :func:`jaxcomp.sparsify`. Codecs compute in float32.
      nonfinite: policy for NaN/Inf gradients, as in :func:`jaxcomp.sparsify`.
        ``"skip"`` (default): a device whose gradients hold a non-finite
        element sends zero scales (an all-zero message) and keeps its
        residual (and velocity); ``"zero"``: non-finite elements are replaced
        by 0.
      seed: seed of the PRNG stream of randomized codecs.
      keep_message: also store this step's packed message per leaf (codes +
        scales, fixed shape) in ``state.message``, so the host can measure it
        (e.g. QSGD's Elias-coded size with
        :func:`jaxcomp.coding.coded_message_bytes`). Off by default: it costs
        a copy of the message in the state.
      beta: ``None`` (default): none, the state is a
        :class:`QuantizeState`. A number ``b`` in ``[0, 1)`` (traceable):
        the codec sees the exponential moving average ``v = b v + (1 - b) g``
        of this device's gradients (Signum's momentum, Bernstein et al.;
        ``sign(v)`` equals the sign of the heavy-ball ``b v + g``), added to the
        residual with error feedback; the state is a
        :class:`MomentumQuantizeState` (``velocity``; None for ``b = 0``).
      accumulation_dtype: the float dtype in which the devices' decoded
        messages are summed (all exchanges); ``None``: float32. Narrower
        dtypes (bfloat16, float16) sum in device order with every partial
        sum rounded to the dtype, after dividing each message by the device
        count (PyTorch DDP's fp16 hook's order: no overflow); a float16
        partial sum past 65504 saturates there (never inf). float64 needs
        ``jax_enable_x64``. The update is then cast to the gradient dtype
        (saturating). With error feedback, what saturation cut off the mean
        stays in the residuals: every device counted in the mean keeps it
        (``"allgather"``), or the device that averaged it keeps ``N`` times
        it (``"allreduce"``: the chunk's owner; ``"server"``: the root), so
        ``sum_d residual_d + N * update == sum_d (old residual_d + grad_d)``
        up to the partial sums' rounding, and later steps send it.
      momentum: deprecated alias of ``beta`` (a DeprecationWarning, the same
        result; both given: ValueError). In jaxcomp ``momentum`` names DGC's
        momentum correction (:func:`jaxcomp.sparsify`), a different rule.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`QuantizeState`
      (:class:`MomentumQuantizeState` with ``beta``).
      ``update`` also takes ``include`` (this device's backup-worker flag): a
      left-out device's message is zeroed, the mean is over included devices.

    Raises:
      ValueError: for a bad argument; the message names it.

    Example:
      >>> import jax.numpy as jnp, optax
      >>> from jaxcomp.transforms.quantize import quantize, sign_quantizer
      >>> tx = quantize(sign_quantizer())
      >>> g = {"w": jnp.array([1.0, -3.0, 2.0, 0.0])}
      >>> u, state = tx.update(g, tx.init(g))
      >>> u["w"].tolist(), state.residual["w"].tolist()
      ([1.5, -1.5, 1.5, 1.5], [-0.5, -1.5, 0.5, -1.5])
    """
    cfg = _make_config(
        quantizer,
        check_common_options(
            axis_name=axis_name,
            min_dense_size=min_dense_size,
            residual_dtype=residual_dtype,
            nonfinite=nonfinite,
            seed=seed,
        ),
        exchange=exchange,
        servers=servers,
        error_feedback=error_feedback,
        scaling=check_residual_scaling(
            residual_scale,
            gradient_scale,
            error_feedback=V.check_bool("error_feedback", error_feedback),
        ),
        keep_message=keep_message,
        beta=resolve_beta(beta, momentum, "quantize"),
        accumulation_dtype=accumulation_dtype,
    )

    def update(updates, state, params=None, *, include=None, **extra_args):
        """``include``: optional bool scalar, this device's backup-worker flag."""
        del params, extra_args
        # Leaves split over explicit mesh axes (jit outside shard_map): each
        # leaf quantized whole, as on one device (see jaxcomp._sharding).
        return _sharding.whole_leaves(functools.partial(_update, cfg))(updates, state, include)

    return optax.GradientTransformationExtraArgs(functools.partial(_init, cfg), update)


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """The validated static options of one :func:`quantize` transform."""

    exchange: QuantizedExchange  # codec, axis, exchange, accumulation dtype, error feedback
    common: CommonOptions
    scaling: ResidualScaling  # GRACE's residual_scale, gradient_scale (error feedback)
    keep_message: bool
    beta: Any  # None (no velocity field), a float, or a JAX array (injected)
    use_velocity: bool
    state_type: type  # QuantizeState, or MomentumQuantizeState with beta
    merge_leaves: bool  # one exchange for all leaves (False: per leaf, the tests' reference)

    @property
    def error_feedback(self) -> bool:
        return self.exchange.error_feedback


def resolve_beta(beta, momentum, who: str):
    """``beta``, or the value of its deprecated alias ``momentum`` (with a DeprecationWarning).

    ``momentum`` meant Signum's moving-average coefficient here; in jaxcomp it
    now means DGC's momentum correction only (:func:`jaxcomp.sparsify`), so the
    coefficient is called ``beta``. Passing both is a ValueError (which one
    was meant is unknown). ``who`` names the factory in the messages.
    """
    if momentum is None:
        return beta
    if beta is not None:
        raise ValueError(
            f"{who}: pass beta (the moving-average coefficient) or its deprecated alias "
            f"momentum, not both; got beta={beta!r}, momentum={momentum!r}"
        )
    warnings.warn(
        f"{who}(momentum=...) is deprecated: the moving-average coefficient is called "
        "beta (momentum means DGC's momentum correction in jaxcomp); pass beta= instead, "
        "same result",
        DeprecationWarning,
        stacklevel=3,  # the caller of the factory
    )
    return momentum


def _make_config(
    quantizer,
    common: CommonOptions,
    *,
    exchange,
    error_feedback,
    scaling,
    keep_message,
    beta,
    accumulation_dtype,
    servers=None,
) -> _Config:
    """Validates :func:`quantize`'s arguments (each error names its argument)."""
    if not isinstance(quantizer, Quantizer):
        raise ValueError(f"quantizer must be a Quantizer, got {quantizer!r}")
    error_feedback = V.check_bool("error_feedback", error_feedback)
    exchange = V.check_choice("exchange", exchange, QUANTIZER_EXCHANGES + VOTE_EXCHANGES)
    if exchange in VOTE_EXCHANGES and not quantizer.signs:
        raise ValueError(
            f"exchange={exchange!r} votes with signs: it needs a sign codec "
            f"(Quantizer.signs, e.g. sign_quantizer), got {quantizer.name}"
        )
    servers = collectives.check_servers(servers, exchange=exchange, axis_name=common.axis_name)
    acc_dtype = jnp.dtype(
        jnp.float32
        if accumulation_dtype is None
        else V.check_float_dtype("accumulation_dtype", accumulation_dtype)
    )
    if acc_dtype == jnp.float64 and not jax.config.jax_enable_x64:
        raise ValueError("accumulation_dtype=float64 needs jax_enable_x64")
    keep_message = V.check_bool("keep_message", keep_message)
    if keep_message and exchange == "allreduce":
        raise ValueError(
            "keep_message=True is for one message per leaf; exchange='allreduce' sends N "
            "chunk messages (use exchange='allgather' to measure messages)"
        )
    with_velocity = beta is not None
    if with_velocity:
        beta = V.check_real("beta", beta, 0.0, 1.0, high_open=True, allow_traced=True)
    return _Config(
        exchange=QuantizedExchange(
            quantizer, common.axis_name, exchange, acc_dtype, error_feedback, servers
        ),
        common=common,
        scaling=scaling,
        keep_message=keep_message,
        beta=beta,
        # A JAX-array beta (injected hyperparameter) keeps a velocity even when 0.
        use_velocity=with_velocity and (V.is_dynamic(beta) or beta > 0),
        state_type=MomentumQuantizeState if with_velocity else QuantizeState,
        merge_leaves=_MERGE_LEAVES,
    )


def _init(cfg: _Config, params) -> QuantizeState | MomentumQuantizeState:
    V.check_gradient_leaves(params, "jaxcomp.quantize.init", "parameter")

    def zeros_like_params():
        rdt = cfg.common.residual_dtype
        return jax.tree.map(
            lambda p: jnp.zeros(jnp.shape(p), resolve_residual_dtype(rdt, [p])), params
        )

    fields = dict(
        step=jnp.zeros([], jnp.int32),
        # Without error feedback no residual is allocated (a full gradient copy).
        residual=zeros_like_params() if cfg.error_feedback else None,
        key=jax.random.key_data(jax.random.key(cfg.common.seed)),
        message_bytes=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), params),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
        message=jax.tree.map(functools.partial(_empty_message, cfg), params)
        if cfg.keep_message
        else None,
    )
    if cfg.state_type is MomentumQuantizeState:
        fields["velocity"] = zeros_like_params() if cfg.use_velocity else None
    return cfg.state_type(**fields)


def _empty_message(cfg: _Config, p):
    """Zeros shaped like the leaf's message; None for a leaf sent dense."""
    n = math.prod(jnp.shape(p))
    if n == 0 or n <= cfg.common.min_dense_size:
        return None
    x = jax.ShapeDtypeStruct((n,), jnp.float32)
    shapes = jax.eval_shape(cfg.exchange.quantizer.encode, x, jax.random.key(0))
    return tuple(jnp.zeros(o.shape, o.dtype) for o in shapes)


def _check_inputs(cfg: _Config, updates, state, include):
    """Validates a step's inputs; returns ``include`` as a bool array (or None)."""
    who = "jaxcomp.quantize"
    V.check_gradient_leaves(updates, who)
    V.check_state_type(state, cfg.state_type, who)
    if cfg.error_feedback:
        V.check_tree_like(updates, state.residual, who)
    else:  # no residual: message_bytes is laid out like the parameters too
        V.check_tree_like(updates, state.message_bytes, who, shapes=False)
    if cfg.use_velocity:
        V.check_tree_like(updates, state.velocity, who)
    check_per_device(updates, cfg.common.axis_name, who)
    if include is None:
        return None
    if cfg.exchange.exchange in ("server", "gossip"):
        raise ValueError(
            f"jaxcomp.quantize: exchange={cfg.exchange.exchange!r} does not take include= "
            "(backup workers); use exchange='allgather'"
        )
    return jnp.asarray(include, jnp.bool_)


def _update(cfg: _Config, updates, state, include):
    include = _check_inputs(cfg, updates, state, include)
    grads, finite, send_ok = apply_nonfinite_policy(updates, cfg.common.nonfinite)
    sends = send_ok if include is None else send_ok & include
    quantizer, axis_name = cfg.exchange.quantizer, cfg.common.axis_name
    key = jax.random.wrap_key_data(state.key)
    if quantizer.randomized:
        key = jax.random.fold_in(key, state.step)
        if axis_name is not None:
            key = jax.random.fold_in(key, lax.axis_index(axis_name))

    g_leaves, treedef = jax.tree.flatten(grads)
    r_leaves = treedef.flatten_up_to(state.residual) if cfg.error_feedback else None
    v_leaves = treedef.flatten_up_to(state.velocity) if cfg.use_velocity else None
    leaves = [
        _encode_leaf(
            cfg,
            g,
            None if r_leaves is None else r_leaves[i],
            None if v_leaves is None else v_leaves[i],
            jax.random.fold_in(key, i) if quantizer.randomized else key,
            sends,
            send_ok,
        )
        for i, g in enumerate(g_leaves)
    ]
    # Every leaf in one exchange; one exchange per leaf builds the tests' reference.
    n = len(leaves)
    groups = [range(n)] if cfg.merge_leaves else [[i] for i in range(n)]
    flat_updates, wire, excess = [None] * n, jnp.float32(0), [None] * n
    for group in groups:
        exchanged, w, cut = exchange_leaves(cfg.exchange, [leaves[i] for i in group], include)
        for i, u, c in zip(group, exchanged, cut, strict=True):
            flat_updates[i], excess[i] = u, c
        wire = wire + w

    def field(values):
        return treedef.unflatten(list(values))

    def residual(leaf, cut):  # in the residual dtype, one rounding (two with a cut)
        r = leaf.acc - leaf.sent.astype(leaf.acc.dtype)
        return (r if cut is None else r + cut.astype(r.dtype)).reshape(leaf.shape)

    fields = dict(
        step=state.step + 1,
        residual=field(map(residual, leaves, excess)) if cfg.error_feedback else None,
        key=state.key,
        message_bytes=field(leaf.nbytes for leaf in leaves),
        wire_bytes=wire,
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        message=field(leaf.message for leaf in leaves) if cfg.keep_message else None,
    )
    if cfg.state_type is MomentumQuantizeState:
        fields["velocity"] = field(leaf.velocity for leaf in leaves) if cfg.use_velocity else None
    updates = (u.reshape(leaf.shape) for u, leaf in zip(flat_updates, leaves, strict=True))
    return field(updates), cfg.state_type(**fields)


def _encode_leaf(cfg: _Config, g, residual, velocity, key, sends, send_ok) -> Encoded:
    """This device's half of a leaf's step: accumulate, encode, decode its own message."""
    shape, n = g.shape, g.size
    out_dtype = g.dtype
    if cfg.error_feedback:
        rdt = residual.dtype  # fixed per leaf by init (resolve_residual_dtype)
    else:  # no residual allocated: the dtype init would have given it
        rdt = resolve_residual_dtype(cfg.common.residual_dtype, [g])
    x = g.reshape(-1).astype(rdt)
    new_vel = None
    if cfg.use_velocity:
        # b and 1 - b in the residual dtype, so that an injected (array)
        # beta gives the same bits as the same Python float.
        b = jnp.asarray(cfg.beta).astype(rdt)
        v = velocity.reshape(-1)
        # A skipped step keeps the velocity and accumulates nothing.
        v = jnp.where(send_ok, b * v + (1 - b) * x, v)
        x = jnp.where(send_ok, v, 0)
        new_vel = v.reshape(shape)
    if not cfg.error_feedback:
        acc = x
    elif cfg.scaling.on:
        # GRACE's beta * e + gamma * v; a skipped step keeps e (no decay).
        e = residual.reshape(-1)
        acc = jnp.where(send_ok, scaled_accumulation(cfg.scaling, e, x), e)
    else:
        acc = residual.reshape(-1) + x

    if n == 0 or n <= cfg.common.min_dense_size:
        sent = jnp.where(sends, acc, 0).astype(out_dtype)
        nbytes = jnp.where(sends, n * out_dtype.itemsize, 0).astype(jnp.int32)
        return Encoded(shape, out_dtype, acc, sent, None, None, key, nbytes, new_vel)
    quantizer, axis_name = cfg.exchange.quantizer, cfg.common.axis_name
    if cfg.exchange.exchange == "allreduce" and axis_name is not None:
        # N chunks, each its own message: chunk j goes to device j (see
        # jaxcomp.comm.quantized's all-reduce).
        n_dev = collectives.axis_size(axis_name)
        c = -(-n // n_dev)
        chunks = jnp.pad(acc, (0, n_dev * c - n)).reshape(n_dev, c)
        keys = jax.vmap(lambda j: jax.random.fold_in(key, j))(jnp.arange(n_dev))
        codes, scales = jax.vmap(quantizer.encode)(chunks, keys)
        scales = jnp.where(sends, scales, 0)
        decoded = jax.vmap(functools.partial(quantizer.decode, n=c))(codes, scales)
        decoded = decoded.reshape(-1)[:n]
    else:
        codes, scales = quantizer.encode(acc, key)
        # An unsent message still travels (static shapes): zero scales decode to 0.
        scales = jnp.where(sends, scales, 0)
        decoded = quantizer.decode(codes, scales, n)
    nbytes = jnp.where(sends, array_nbytes(codes) + array_nbytes(scales), 0).astype(jnp.int32)
    sent = to_dtype(decoded, out_dtype)
    return Encoded(shape, out_dtype, acc, sent, (codes, scales), decoded, key, nbytes, new_vel)
