"""The named quantizing compressors: thin wrappers over :func:`quantize`.

Each factory picks a codec from ``quantize.py`` and passes the common options
of :func:`jaxcomp.transforms.quantize.quantize` (``axis_name``,
``error_feedback``, ``min_dense_size``, ``residual_dtype``, ``nonfinite``,
``seed``) through as keywords.

=====================  ==========================================  ==========  ==============
factory                message per bucket of ``d`` values           feedback    wire bits/coord
=====================  ==========================================  ==========  ==============
:func:`qsgd`           ``scale * sgn * xi``, stochastic levels      off         b + 2 (s = 2^b)
:func:`onebit`         sign; means of the + and - parts             on          1
:func:`sign_sgd`       ``||x||_1 / d * sign(x)``                    off         1
:func:`ef_sign_sgd`    ``||x||_1 / d * sign(x)``                    on          1
:func:`bounded_sign`   ``lam ||x||_2 / sqrt(d) * sign(x)``, bounded on          1
=====================  ==========================================  ==========  ==============

plus one float32 scale per bucket (two for :func:`onebit`).
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from jaxcomp.transforms.quantize import (
    bounded_sign_quantizer,
    onebit_quantizer,
    qsgd_levels,
    qsgd_quantizer,
    quantize,
    sign_quantizer,
)

__all__ = [
    "bounded_sign",
    "ef_sign_sgd",
    "onebit",
    "qsgd",
    "sign_sgd",
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
    axis_name: Any = None,
    exchange: str = "allgather",
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> _Tx:
    """QSGD (Alistarh et al., 2017): unbiased stochastic quantization with ``s`` levels.

    See :func:`jaxcomp.transforms.quantize.qsgd_quantizer` for the formula and
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
      axis_name, exchange, residual_dtype, nonfinite, seed: as in
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
      >>> u, state = tx.update(g, tx.init(g))
      >>> int(optax.tree.get(state, "message_bytes")["w"])  # s = 16: 6 bits/coord + 196 scales
      75784
    """
    quantizer = qsgd_quantizer(qsgd_levels(levels, bits), bucket_size, norm)
    return quantize(
        quantizer,
        axis_name=axis_name,
        exchange=exchange,
        error_feedback=error_feedback,
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
    axis_name: Any = None,
    exchange: str = "allgather",
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
    :func:`jaxcomp.transforms.quantize.onebit_quantizer`.

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
        axis_name=axis_name,
        exchange=exchange,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def sign_sgd(
    *,
    bucket_size: int | None = None,
    error_feedback: bool = False,
    axis_name: Any = None,
    exchange: str = "allgather",
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """Scaled signSGD: ``C[x] = (||x||_1 / d) * sign(x)``, no error feedback.

    The patent's 1-bit compressor (ALGORITHMS.md section 6); zeros are sent
    as ``+``. See :func:`jaxcomp.transforms.quantize.sign_quantizer`.

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
        axis_name=axis_name,
        exchange=exchange,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )


def ef_sign_sgd(
    *,
    bucket_size: int | None = None,
    error_feedback: bool = True,
    axis_name: Any = None,
    exchange: str = "allgather",
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
        axis_name=axis_name,
        exchange=exchange,
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
    axis_name: Any = None,
    exchange: str = "allgather",
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> _Tx:
    """The patent's improved 1-bit: L2-norm scale ``lam ||x||_2 / sqrt(d)``, bounded error.

    The scale is clipped into the interval where ``||C[x] - x||_2 <=
    error_bound * ||x||_2`` (exactly: the error is a quadratic in the
    scale), or set to the error-minimising ``||x||_1 / d`` when no scale meets
    the bound. See :func:`jaxcomp.transforms.quantize.bounded_sign_quantizer`.

    Args:
      lam: ``0 < lambda < 1``, the factor on the L2 scale (traceable).
      error_bound: ``0 < B <= 1``, the relative error bound (traceable).
      bucket_size: values sharing one scale (None: the whole leaf).
      error_feedback: on by default.
      axis_name, min_dense_size, residual_dtype, nonfinite, seed: as in
        :func:`jaxcomp.transforms.quantize.quantize`.

    Example:
      >>> import jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.bounded_sign(lam=0.5)
      >>> g = {"w": jnp.array([3.0, -4.0, 0.0, 0.0])}   # ||x||_2 = 5, d = 4
      >>> u, _ = tx.update(g, tx.init(g))
      >>> u["w"].tolist()
      [1.25, -1.25, 1.25, 1.25]
    """
    quantizer = bounded_sign_quantizer(lam, error_bound, bucket_size)
    return quantize(
        quantizer,
        error_feedback=error_feedback,
        axis_name=axis_name,
        exchange=exchange,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )
