"""The named quantizing compressors: thin wrappers over :func:`quantize`.

Each factory picks a codec from ``quantize.py`` and passes the common options
of :func:`jaxcomp.transforms.quantize.quantize` (``axis_name``,
``error_feedback``, ``residual_scale``, ``gradient_scale``,
``min_dense_size``, ``residual_dtype``, ``nonfinite``, ``seed``) through as
keywords.

===========================  ============================================  ========  ===============
factory                      message per bucket of ``d`` values            feedback  wire bits/coord
===========================  ============================================  ========  ===============
:func:`qsgd`                 ``scale * sgn * xi``, stochastic levels       off       b + 2 (s = 2^b)
:func:`onebit`               sign; means of the + and - parts              on        1
:func:`sign_sgd`             ``||x||_1 / d * sign(x)``                     off       1
:func:`ef_sign_sgd`          ``||x||_1 / d * sign(x)``                     on        1
:func:`bounded_sign`         ``lam ||x||_2 / sqrt(d) * sign(x)``, bounded  on        1
:func:`terngrad`             ``max|x| * sign * Bernoulli(|x| / max|x|)``   off       2
:func:`natural_compression`  ``sign * 2^e``, stochastic, unbiased          off       9 (sign + exp)
:func:`signum`               ``sign(beta-average)``, majority vote         off       1
:func:`cast`                 ``x`` as float16 / bfloat16                   off       16
===========================  ============================================  ========  ===============

plus one float32 scale per bucket (two for :func:`onebit`; one per leaf for
:func:`natural_compression` and :func:`cast`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomp import _validation as V
from jaxcomp.quantization import (
    bounded_sign_quantizer,
    cast_quantizer,
    natural_dithering_quantizer,
    natural_quantizer,
    onebit_quantizer,
    qsgd_levels,
    qsgd_quantizer,
    sign_quantizer,
    terngrad_quantizer,
)
from jaxcomp.transforms.quantize import quantize, resolve_beta

__all__ = [
    "bounded_sign",
    "cast",
    "ef_sign_sgd",
    "natural_compression",
    "onebit",
    "qsgd",
    "sign_sgd",
    "signum",
    "terngrad",
]

_Tx = optax.GradientTransformationExtraArgs


def qsgd(
    levels: int | None = None,
    *,
    bits: int | None = None,
    bucket_size: int | None = None,
    norm: str = "l2",
    min_dense_size: int | None = None,
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> _Tx:
    """QSGD (Alistarh et al., 2017): unbiased stochastic quantization with ``s`` levels.

    See :func:`jaxcomp.quantization.qsgd_quantizer` for the formula and
    the wire format. "b-bit" means what the paper means: ``s = 2**b`` levels,
    the sign apart (its "4-bit, bucket 512" has variance factor
    ``sqrt(512) / 2**4 = 1.41``). The paper's settings: ``bits=2,
    bucket_size=128``; ``bits=4, bucket_size=512``; ``bits=8,
    bucket_size=512``; tensors under 10K elements sent dense. Give exactly one
    of ``bits`` and ``levels``.

    The codes are packed densely at ``1 + ceil(log2(s + 1))`` bits per
    coordinate (``bits=b``: ``b + 2``, since the levels are ``0..2**b``),
    which ``message_bytes`` reports with the float32 scales. For the
    Elias-coded size the paper measures, see ``keep_message`` and
    :func:`jaxcomp.coding.coded_message_bytes`.

    Args:
      levels: ``s >= 1``, quantization levels per sign (the direct form).
      bits: ``b`` in [1, 30]: ``s = 2**b`` levels, the paper's "b-bit".
      bucket_size: ``d``, values quantized together with one scale (None: the
        whole leaf).
      norm: ``"l2"`` (the paper's ``||v||_2``) or ``"max"`` (``max |v_i|``,
        lower variance, no longer sparse in expectation).
      min_dense_size: leaves with at most this many elements are sent dense
        (None: 10_000, the paper's).
      error_feedback: off by default (QSGD is unbiased).
      axis_name, exchange, servers, residual_dtype, nonfinite, seed: as in
        :func:`jaxcomp.transforms.quantize.quantize` (``seed`` traceable).
      keep_message: keep this step's packed message per leaf in the state
        (``state.message``), for :func:`jaxcomp.coding.coded_message_bytes`
        (the Elias-coded size, the QSGD paper's measure) on the host.

    Raises:
      ValueError: neither or both of ``bits`` and ``levels``, or a bad argument.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.qsgd(bits=4, bucket_size=512), optax.sgd(0.1))
      >>> g = {"w": jax.random.normal(jax.random.key(0), (100_000,))}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> int(optax.tree.get(state, "message_bytes")["w"])  # s = 16: 6 bits/coord + 196 scales
      75784
    """
    quantizer = qsgd_quantizer(qsgd_levels(levels, bits), bucket_size, norm)
    return quantize(
        quantizer,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        min_dense_size=10_000 if min_dense_size is None else min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
        keep_message=keep_message,
    )


def onebit(
    *,
    bucket_size: int | None = None,
    error_feedback: bool = True,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """1-bit SGD with error feedback (Seide et al., 2014).

    Each coordinate sends its sign; per bucket, ``+`` decodes to the mean of
    the non-negative values and ``-`` to the mean of the negative ones (the
    squared-error-optimal reconstruction for that split); what is not sent
    stays in the residual. See
    :func:`jaxcomp.quantization.onebit_quantizer`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.onebit()
      >>> g = {"w": jnp.array([1.0, 3.0, -2.0, -4.0])}
      >>> u, _ = tx.update(g, tx.init(g))
      >>> u["w"].tolist()
      [2.0, 2.0, -3.0, -3.0]
    """
    return quantize(
        onebit_quantizer(bucket_size),
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def sign_sgd(
    *,
    bucket_size: int | None = None,
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """Scaled signSGD: ``C[x] = (||x||_1 / d) * sign(x)``, no error feedback.

    The patent's 1-bit compressor (docs/algorithms.md section 6); zeros are sent
    as ``+``. See :func:`jaxcomp.quantization.sign_quantizer`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.sign_sgd()
      >>> g = {"w": jnp.array([1.0, -3.0, 2.0, -2.0])}
      >>> u, _ = tx.update(g, tx.init(g))
      >>> u["w"].tolist()
      [2.0, -2.0, 2.0, -2.0]
    """
    return quantize(
        sign_quantizer(bucket_size),
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def ef_sign_sgd(
    *,
    bucket_size: int | None = None,
    error_feedback: bool = True,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """EF-signSGD (Karimireddy et al., 2019): scaled sign with error feedback.

    ``p = e + g; C[p] = (||p||_1 / d) sign(p); e = p - C[p]`` (the learning
    rate applied after the compressor: equivalent for a constant rate).

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.ef_sign_sgd()
      >>> g = {"w": jnp.array([1.0, -3.0])}
      >>> u, state = tx.update(g, tx.init(g))
      >>> u["w"].tolist(), state.residual["w"].tolist()
      ([2.0, -2.0], [-1.0, -1.0])
    """
    return quantize(
        sign_quantizer(bucket_size),
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def bounded_sign(
    lam: float | jax.Array = 0.8,
    *,
    error_bound: float | jax.Array = 1.0,
    bucket_size: int | None = None,
    error_feedback: bool = True,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """The patent's improved 1-bit: L2-norm scale ``lam ||x||_2 / sqrt(d)``, bounded error.

    The scale is clipped into the interval where ``||C[x] - x||_2 <=
    error_bound * ||x||_2`` (exactly: the error is a quadratic in the
    scale), or set to the error-minimising ``||x||_1 / d`` when no scale meets
    the bound. See :func:`jaxcomp.quantization.bounded_sign_quantizer`.

    Args:
      lam: ``0 < lambda < 1``, the factor on the L2 scale (traceable).
      error_bound: ``0 < B <= 1``, the relative error bound (traceable).
      bucket_size: values sharing one scale (None: the whole leaf).
      error_feedback: on by default.
      axis_name, min_dense_size, residual_dtype, nonfinite, seed: as in
        :func:`jaxcomp.transforms.quantize.quantize`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.bounded_sign(lam=0.5)
      >>> g = {"w": jnp.array([3.0, -4.0, 0.0, 0.0])}   # ||x||_2 = 5, d = 4
      >>> u, _ = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist()
      [1.25, -1.25, 1.25, 1.25]
    """
    quantizer = bounded_sign_quantizer(lam, error_bound, bucket_size)
    return quantize(
        quantizer,
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def terngrad(
    *,
    clip: float | None = None,
    bucket_size: int | None = None,
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> _Tx:
    """TernGrad (Wen et al., 2017): unbiased stochastic ternarization, per-layer max scale.

    Each coordinate becomes ``s * sign(g_i) * b_i`` with ``s = max|g|`` of its
    layer (or bucket) and ``b_i ~ Bernoulli(|g_i| / s)``: ``E[update] = g``.
    See :func:`jaxcomp.quantization.terngrad_quantizer`.

    Args:
      clip: the paper's gradient clipping, ``|g_i| <= clip * sigma`` with
        ``sigma`` the layer's standard deviation, before ternarizing (the paper
        uses 2.5; biased then). None (default): no clipping, unbiased.
      bucket_size: values sharing one scale (None: the whole leaf, the
        paper's per-layer scale).
      error_feedback: off by default (TernGrad is unbiased).
      servers: as in :func:`jaxcomp.transforms.quantize.quantize`.
      axis_name, exchange, min_dense_size, residual_dtype, nonfinite, seed, keep_message: as
        in :func:`jaxcomp.transforms.quantize.quantize`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.terngrad()
      >>> g = {"w": jnp.array([0.5, -2.0, 0.0, 2.0])}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> sorted(set(abs(v) for v in u["w"].tolist()) - {0.0}), int(state.message_bytes["w"])
      ([2.0], 5)
    """
    return quantize(
        terngrad_quantizer(bucket_size, clip),
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
        keep_message=keep_message,
    )


def natural_compression(
    *,
    levels: int | None = None,
    bucket_size: int | None = None,
    norm: str = "l2",
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> _Tx:
    """Natural compression (Horvath et al., 2019): unbiased rounding to a power of two.

    ``levels=None`` (default): ``C_nat``, every value rounded stochastically
    to one of the two powers of two around it, sign kept, so ``E[update] =
    g`` and the variance is at most ``g^2 / 8``; 9 bits per value on the wire
    (sign + float32 exponent). See
    :func:`jaxcomp.quantization.natural_quantizer`.

    ``levels=s``: natural dithering ``C_nd`` from the same paper, QSGD with
    the levels ``{0, 2^(1-s), ..., 1/2, 1}`` of the bucket's norm (``norm``,
    ``bucket_size``); ``1 + ceil(log2(s + 1))`` bits per value. See
    :func:`jaxcomp.quantization.natural_dithering_quantizer`.

    Args:
      levels: None (natural compression) or ``s`` in [1, 126] (natural
        dithering).
      bucket_size, norm: natural dithering's buckets and norm (``"l2"``, the
        paper's ``p = 2``, or ``"max"``); natural compression has neither
        (passing them raises).
      error_feedback: off by default (both are unbiased).
      servers: as in :func:`jaxcomp.transforms.quantize.quantize`.
      axis_name, exchange, min_dense_size, residual_dtype, nonfinite, seed, keep_message: as
        in :func:`jaxcomp.transforms.quantize.quantize`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.natural_compression()
      >>> g = {"w": jnp.array([1.0, -0.25, 0.0, 4.0, -8.0, 0.5, 2.0, 16.0])}
      >>> u, state = jax.jit(tx.update)(g, tx.init(g))
      >>> u["w"].tolist(), int(state.message_bytes["w"])  # powers of two stay: 9 + 4 bytes
      ([1.0, -0.25, 0.0, 4.0, -8.0, 0.5, 2.0, 16.0], 13)
    """
    if levels is None:
        if bucket_size is not None or norm != "l2":
            raise ValueError(
                "natural_compression: bucket_size and norm are natural dithering's "
                f"(levels=s); got bucket_size={bucket_size!r}, norm={norm!r} with levels=None"
            )
        quantizer = natural_quantizer()
    else:
        quantizer = natural_dithering_quantizer(levels, bucket_size, norm)
    return quantize(
        quantizer,
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
        keep_message=keep_message,
    )


def signum(
    beta: float | jax.Array | None = None,
    *,
    momentum: float | jax.Array | None = None,
    bucket_size: int | None = None,
    axis_name: Any = None,
    exchange: str = "majority",
    servers: int | None = None,
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """Signum / signSGD with majority vote (Bernstein et al., 2018).

    Each device keeps ``v = b v + (1 - b) g`` (``b = beta``; ``b = 0`` is
    signSGD, no velocity allocated), sends ``sign(v)`` (1 bit per value; a
    bucket of zeros abstains, zeros elsewhere vote ``+``) and the update is
    the majority vote ``sign(sum_d sign(v_d))`` in ``{-1, 0, +1}`` (a tie is
    0), the same on every device; the learning rate of the optimizer after it
    sets the step (``optax.sgd(lr)``: ``x -= lr * vote``; the paper's rates
    are ~1e-4). With ``axis_name=None`` the update is ``sign(v)``.

    No error feedback by default, as in the paper (with ``error_feedback=True``
    the residual keeps ``v + e - sign(v + e)``, which is large for unit signs:
    EF-signSGD (:func:`ef_sign_sgd`) scales its signs instead).

    The messages are all-gathered (``(N - 1)`` times 1 bit per value plus one
    float32 per bucket), every device counts the votes: the paper's
    parameter server receives the same messages and sends the vote back
    (``exchange="majority"``; the other exchanges of
    :func:`jaxcomp.transforms.quantize.quantize` average the signs instead).
    Leaves sent dense (``min_dense_size``, default 0) vote with their
    full-precision momentum: keep it 0 for the paper's Signum.

    Args:
      beta: ``b`` in ``[0, 1)``, the moving-average coefficient (traceable);
        None: 0.9, the paper's default.
      momentum: deprecated alias of ``beta`` (a DeprecationWarning, the same
        result; both given: ValueError). In jaxcomp ``momentum`` names DGC's
        momentum correction (:func:`jaxcomp.sparsify`), a different rule.
      bucket_size: values sharing one abstain/vote scale (None: the whole
        leaf). Set it to an embedding's row length so that rows not in the
        batch abstain rather than vote ``+``.
      servers: as in :func:`jaxcomp.transforms.quantize.quantize`.
      axis_name, exchange, error_feedback, min_dense_size, residual_dtype, nonfinite, seed: as
        in :func:`jaxcomp.transforms.quantize.quantize`.

    Returns:
      The transform; its state is a
      :class:`jaxcomp.transforms.quantize.MomentumQuantizeState`
      (``velocity``).

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.signum(beta=0.5)
      >>> g = {"w": jnp.array([1.0, -3.0, 2.0])}
      >>> update = jax.jit(tx.update)
      >>> u, state = update(g, tx.init(g))
      >>> u, state = update({"w": jnp.array([-2.0, 1.0, 0.0])}, state)
      >>> u["w"].tolist(), state.velocity["w"].tolist()  # v = 0.5 v + 0.5 g
      ([-1.0, -1.0, 1.0], [-0.75, -0.25, 0.5])
    """
    beta = resolve_beta(beta, momentum, "signum")
    return quantize(
        sign_quantizer(bucket_size, scale="unit"),
        beta=0.9 if beta is None else beta,
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def cast(
    dtype: Any = jnp.bfloat16,
    *,
    error_feedback: bool = False,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    accumulation_dtype: Any = jnp.float32,
    axis_name: Any = None,
    exchange: str = "allgather",
    servers: int | None = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> _Tx:
    """Low-precision gradients: a cast to bfloat16 or float16 (the DDP compression hooks).

    Each device sends its gradient (plus residual) rounded to ``dtype``, 16
    bits per value; the devices' messages are summed in
    ``accumulation_dtype`` (float32 by default: bfloat16 gradients summed in
    float32) and averaged, then cast to the gradient dtype. With
    ``error_feedback=True`` the residual keeps each step's rounding, bit for
    bit: ``update + residual == gradient + old residual`` exactly (float32
    residual). Values beyond float16's range (``|x| >= 65520``) never become
    inf: the leaf is scaled by a power of two that the message carries (see
    :func:`jaxcomp.quantization.cast_quantizer`).

    Args:
      dtype: ``jnp.bfloat16`` (default) or ``jnp.float16``.
      error_feedback: keep the rounding in a float32 residual (off by
        default, as the DDP hooks).
      accumulation_dtype: dtype of the sum over devices (``jnp.float32``;
        ``dtype`` itself reproduces a 16-bit reduction: each message divided
        by the device count, partial sums rounded). A float16 sum past 65504
        saturates there, never inf; with ``error_feedback=True`` the excess
        stays in the residuals (see :func:`jaxcomp.transforms.quantize.quantize`).
      servers: as in :func:`jaxcomp.transforms.quantize.quantize`.
      axis_name, exchange, min_dense_size, residual_dtype, nonfinite, seed, keep_message: as
        in :func:`jaxcomp.transforms.quantize.quantize`.
        ``exchange="allgather"`` (default): every device receives the ``N``
        16-bit messages, ``(N - 1) * 2`` bytes per value sent, and sums them
        in ``accumulation_dtype`` (the update: the mean of the messages).
        ``exchange="allreduce"``: the DDP hooks' wire, ``2 (N-1)/N * 2``
        bytes per value (half a float32 ring all-reduce's): chunks
        all-to-all, summed in ``accumulation_dtype``, the mean chunk cast to
        ``dtype`` again and all-gathered (the update: the mean rounded to
        ``dtype``).

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.cast(jnp.bfloat16, error_feedback=True)
      >>> g = {"w": jnp.array([1.0 + 2.0**-10, 3.0])}
      >>> u, state = tx.update(g, tx.init(g))
      >>> u["w"].tolist(), state.residual["w"].tolist()  # bfloat16 keeps 8 bits
      ([1.0, 3.0], [0.0009765625, 0.0])
    """
    if accumulation_dtype is None:
        raise ValueError("accumulation_dtype must be a float dtype, got None")
    V.check_float_dtype("accumulation_dtype", accumulation_dtype)
    return quantize(
        cast_quantizer(dtype),
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        accumulation_dtype=accumulation_dtype,
        axis_name=axis_name,
        exchange=exchange,
        servers=servers,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
        keep_message=keep_message,
    )
