"""Quantizers: codecs from a flat float32 vector to a fixed-shape message and back.

A :class:`Quantizer` turns a flat float32 vector into a message ``(codes,
scales)``: ``codes`` an unsigned-integer array with several coordinates
bit-packed per element (the wire payload, see
:mod:`jaxcomp.quantization.packing`), ``scales`` a float32 ``[buckets, m]``
array. Every codec decodes all-zero scales to all zeros: a device that sends
nothing (non-finite step, left-out backup worker) zeroes its scales, so
fixed-shape collectives still run. :func:`jaxcomp.quantize` runs any of them
with error feedback; the exchanges that average their messages are in
:mod:`jaxcomp.comm.quantized`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp.quantization.packing import pack_codes, unpack_codes

__all__ = [
    "CAST_DTYPES",
    "NATURAL_BITS",
    "QSGD_NORMS",
    "Quantizer",
    "SIGN_SCALES",
    "bounded_sign_quantizer",
    "cast_quantizer",
    "message_nbytes",
    "natural_dithering_quantizer",
    "natural_quantizer",
    "onebit_quantizer",
    "qsgd_bits",
    "qsgd_levels",
    "qsgd_quantizer",
    "sign_quantizer",
    "terngrad_quantizer",
]

# qsgd_quantizer / natural_dithering_quantizer bucket scales: L2 norm or max |x|.
QSGD_NORMS = ("l2", "max")
# sign_quantizer's scales: ||x||_1 / d (scaled sign), or 1 (signSGD / Signum).
SIGN_SCALES = ("l1", "unit", "l2")
# cast_quantizer's wire dtypes.
CAST_DTYPES = ("float16", "bfloat16")


class Quantizer(NamedTuple):
    """A codec from a flat float32 vector to a fixed-shape message and back.

    Attributes:
      encode: ``encode(x, key) -> (codes, scales)`` for a 1-D float32 ``x``
        of static size ``n``; ``key`` is a PRNG key (ignored unless
        ``randomized``).
      decode: ``decode(codes, scales, n) -> float32[n]``; all-zero scales
        decode to zeros.
      randomized: whether ``encode`` draws random numbers.
      name: for error messages and ``repr``.
      signs: whether this is a sign codec: every coordinate decodes to
        ``+-`` its bucket's value (or 0 for a bucket sent as zeros), so the
        sign of the decoded value is the coordinate's vote and
        ``quantize(exchange="majority")`` may take it.

    Example:
      >>> import jax.numpy as jnp
      >>> def encode(x, key):  # int8 codes, one float32 scale per leaf
      ...     scale = jnp.maximum(jnp.max(jnp.abs(x)), 1e-30) / 127
      ...     return jnp.round(x / scale).astype(jnp.int8), scale[None]
      >>> decode = lambda codes, scales, n: codes.astype(jnp.float32) * scales[0]
      >>> q = Quantizer(encode=encode, decode=decode, randomized=False, name="int8")
      >>> import jaxcomp
      >>> tx = jaxcomp.quantize(q)  # error feedback: the rounding stays in the residual
      >>> g = {"w": jnp.array([127.0, -63.6, 0.0])}
      >>> u, state = tx.update(g, tx.init(g))
      >>> u["w"].tolist(), [round(r, 4) for r in state.residual["w"].tolist()]
      ([127.0, -64.0, 0.0], [0.0, 0.4, 0.0])
      >>> message_nbytes(q, 3)  # 3 int8 codes + 1 float32 scale
      7
    """

    encode: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array, jax.Array, int], jax.Array]
    randomized: bool
    name: str
    signs: bool = False


def _check_bucket_size(bucket_size):
    return V.check_int("bucket_size", bucket_size, 1, allow_none=True)


def _bucketing(n: int, bucket_size: int | None) -> tuple[int, int]:
    """(bucket length d, number of buckets) for a leaf of ``n`` elements."""
    d = n if bucket_size is None else min(bucket_size, n)
    return d, -(-n // d)


def _to_buckets(x: jax.Array, d: int, nb: int) -> jax.Array:
    """``x`` zero-padded to ``nb * d`` and reshaped to ``[nb, d]``."""
    n = x.shape[0]
    if nb * d != n:
        x = jnp.pad(x, (0, nb * d - n))
    return x.reshape(nb, d)


def _from_buckets(xb: jax.Array, n: int) -> jax.Array:
    return xb.reshape(-1)[:n]


def _true_counts(n: int, d: int, nb: int) -> np.ndarray:
    """Elements per bucket, the last one possibly partial (float32 constants)."""
    counts = np.full((nb,), d, np.float32)
    counts[-1] = n - (nb - 1) * d
    return counts


def _bucket_norms(xb: jax.Array, norm: str):
    """``(scale, a, ns)`` per bucket row: the norm, ``|x| / max|x|`` and ``scale / max|x|``.

    Scaled by the bucket's max, as BLAS nrm2: ``sum(v * v)`` overflows for
    ``|v| ~ 1e19`` and underflows for ``|v| ~ 1e-20``; ``sum((v / m)^2)`` is
    in ``[1, d]``. ``a`` is in ``[0, 1]``, exactly 1 at the max; ``ns`` is
    ``||a||_2`` in ``[1, sqrt(d)]`` (``norm="l2"``) or None (``"max"``).
    """
    m = jnp.max(jnp.abs(xb), axis=1)
    live = m > 0
    a = jnp.abs(xb) / jnp.where(live, m, 1)[:, None]
    if norm == "l2":
        ns = jnp.where(live, jnp.sqrt(jnp.sum(a * a, axis=1)), 1)
        return m * ns, a, ns
    return m, a, None


def qsgd_bits(levels: int) -> int:
    """Bits per coordinate of QSGD's packed codes: 1 sign bit + ``ceil(log2(s + 1))`` level bits.

    Levels run over ``0..s``, so ``s = 2**b`` (the paper's "b-bit") takes
    ``b + 2`` bits: ``qsgd_bits(16) == 6``. Packed densely (:func:`pack_codes`),
    never rounded up to a power of two.

    Example:
      >>> qsgd_bits(16), qsgd_bits(4), qsgd_bits(1)  # 1 sign bit + ceil(log2(s + 1))
      (6, 4, 2)
    """
    return int(levels).bit_length() + 1


def qsgd_levels(levels: int | None = None, bits: int | None = None) -> int:
    """QSGD's ``s`` from exactly one of ``levels`` (``s`` itself) or ``bits`` (``s = 2**bits``).

    The QSGD paper's "b-bit" is ``s = 2**b`` levels with the sign apart.

    Example:
      >>> qsgd_levels(bits=4), qsgd_levels(levels=7)
      (16, 7)
    """
    if (levels is None) == (bits is None):
        got = "both" if levels is not None else "neither"
        raise ValueError(
            "qsgd needs exactly one of bits (s = 2**bits levels, the QSGD paper's "
            f"'b-bit') or levels (s itself), got {got}"
        )
    if bits is not None:
        return 2 ** V.check_int("bits", bits, 1, 30)
    return V.check_int("levels", levels, 1, 2**31 - 1)


def qsgd_quantizer(levels: int, bucket_size: int | None = None, norm: str = "l2") -> Quantizer:
    """QSGD's stochastic quantizer ``Q_s`` (Alistarh et al., 2017).

    Per bucket ``v`` of ``d`` consecutive values (the whole leaf when
    ``bucket_size`` is None; the last bucket may be shorter), with scale
    ``||v||_2`` (``norm="l2"``) or ``max_i |v_i|`` (``norm="max"``) and
    ``s = levels``: ``l_i = floor(|v_i| / scale * s)``, then
    ``xi_i = (l_i + 1) / s`` with probability ``|v_i| / scale * s - l_i``,
    else ``l_i / s``, and ``Q(v)_i = scale * sgn(v_i) * xi_i``.

    ``levels`` is ``s`` itself; the paper's "b-bit" QSGD is ``s = 2**b``
    (:func:`jaxcomp.qsgd` takes ``bits=b``).

    The norm is computed scaled, as BLAS ``nrm2`` does: ``m = max_i |v_i|``,
    ``||v||_2 = m * ||v / m||_2`` and ``|v_i| / scale * s = (|v_i| / m) *
    (s / ||v / m||_2)``, so no square over- or underflows: the scale is finite
    whenever the true norm is a finite float32 (``|v_i|`` near ``1e19`` and
    up), and buckets of tiny values (squares below float32's range) keep
    their norm and stay unbiased. Subnormal inputs follow the backend (XLA:CPU
    flushes them to zero, so such a bucket sends zeros).

    Wire format: per coordinate one ``qsgd_bits(s) = 1 + ceil(log2(s + 1))``
    -bit code, the level ``s * xi_i`` in the low bits and the sign (1 =
    negative, set only for nonzero levels: the sign convention of
    :func:`jaxcomp.coding.encode_qsgd`) in the top bit, packed densely with
    :func:`pack_codes` (``s = 16``: 6 bits); plus one float32 scale per
    bucket. Levels above ``2**23`` add nothing in float32.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = qsgd_quantizer(2, norm="max")  # levels {0, 1/2, 1} of max |x|
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([2.0, -4.0, 0.0])).tolist()  # on the levels: no random rounding
      [2.0, -4.0, 0.0]
    """
    levels = V.check_int("levels", levels, 1, 2**31 - 1)
    bucket_size = _check_bucket_size(bucket_size)
    norm = V.check_choice("norm", norm, QSGD_NORMS)
    s = levels
    bits = qsgd_bits(s)
    sign_bit = 1 << (bits - 1)

    def encode(x, key):
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        scale, a, ns = _bucket_norms(xb, norm)
        r = a * (jnp.float32(s) / ns)[:, None] if norm == "l2" else a * jnp.float32(s)
        low = jnp.floor(r)
        u = jax.random.uniform(key, xb.shape, jnp.float32)
        level = jnp.minimum(low + (u < r - low), s).astype(jnp.uint32)
        negative = (xb < 0) & (level > 0)
        code = level | jnp.where(negative, jnp.uint32(sign_bit), jnp.uint32(0))
        return pack_codes(_from_buckets(code, n), bits), scale[:, None]

    def decode(codes, scales, n):
        d, nb = _bucketing(n, bucket_size)
        code = _to_buckets(unpack_codes(codes, bits, n), d, nb)
        level = (code & jnp.uint32(sign_bit - 1)).astype(jnp.float32)
        signed = jnp.where(code >= jnp.uint32(sign_bit), -level, level)
        return _from_buckets(signed * (scales / jnp.float32(s)), n)

    return Quantizer(encode, decode, True, f"qsgd(levels={levels}, norm={norm!r})")


def _sign_codes(xb, n):
    """1-bit codes, 1 for negative: ``x >= 0`` (zero included) decodes positive."""
    return pack_codes(_from_buckets((xb < 0).astype(jnp.uint8), n), 1)


def _sign_decode(bucket_size, pos_col, neg_col, negate_neg):
    """Decoder of 1-bit codes with per-bucket values for the + and - codes."""

    def decode(codes, scales, n):
        d, nb = _bucketing(n, bucket_size)
        neg = _to_buckets(unpack_codes(codes, 1, n), d, nb) != 0
        pos_val = scales[:, pos_col : pos_col + 1]
        neg_val = scales[:, neg_col : neg_col + 1]
        return _from_buckets(jnp.where(neg, -neg_val if negate_neg else neg_val, pos_val), n)

    return decode


def sign_quantizer(bucket_size: int | None = None, *, scale: str = "l1") -> Quantizer:
    """Sign per bucket: scaled, ``C[x] = (||x||_1 / d) * sign(x)``, or unit, ``C[x] = sign(x)``.

    ``scale="l2"``: ``(||x||_2 / sqrt(d)) * sign(x)``, DeepSpeed's 1-bit
    Adam codec (the compressed vector has the norm of ``x``).
    ``scale="l1"`` (signSGD / EF-signSGD): ``||x||_1 / d`` (``d`` the
    bucket's true length) is the scale that minimises ``||C[x] - x||_2`` over
    all ``alpha * sign(x)``. ``scale="unit"`` (signSGD and Signum as in
    Bernstein et al., whose learning rate sets the step): every coordinate
    decodes to ``+-1``, and a bucket of zeros to zeros (its scale is 0: an
    unused layer does not drift by the learning rate every step). Zeros in a
    bucket that has nonzeros are sent as ``+`` (one bit has no zero). Wire: 1
    bit per coordinate, one float32 per bucket.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> x = jnp.array([1.0, -3.0, 2.0, 0.0])
      >>> def roundtrip(q, x):
      ...     return q.decode(*q.encode(x, jax.random.key(0)), x.size)
      >>> jax.jit(lambda x: roundtrip(sign_quantizer(), x))(x).tolist()  # ||x||_1 / d = 1.5
      [1.5, -1.5, 1.5, 1.5]
      >>> jax.jit(lambda x: roundtrip(sign_quantizer(scale="unit"), x))(x).tolist()
      [1.0, -1.0, 1.0, 1.0]
    """
    bucket_size = _check_bucket_size(bucket_size)
    scale = V.check_choice("scale", scale, SIGN_SCALES)

    def encode(x, key):
        del key
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        if scale == "l1":
            alpha = jnp.sum(jnp.abs(xb), axis=1) / _true_counts(n, d, nb)
        elif scale == "l2":  # ||x||_2 / sqrt(d), scaled as nrm2 (no over/underflow)
            norm, _, _ = _bucket_norms(xb, "l2")
            alpha = norm / jnp.sqrt(_true_counts(n, d, nb))
        else:
            alpha = jnp.any(xb != 0, axis=1).astype(jnp.float32)
        return _sign_codes(xb, n), alpha[:, None]

    name = "sign" if scale == "l1" else f"sign(scale={scale!r})"
    return Quantizer(encode, _sign_decode(bucket_size, 0, 0, True), False, name, signs=True)


def onebit_quantizer(bucket_size: int | None = None) -> Quantizer:
    """1-bit SGD's quantizer (Seide et al., 2014): sign with two reconstruction values.

    Per bucket, coordinates ``x_i >= 0`` decode to the mean of the bucket's
    non-negative values and ``x_i < 0`` to the mean of its negative values:
    the two values that minimise the squared error for this sign split (the
    paper's per-column reconstruction; take ``bucket_size`` = a row length of
    a transposed weight for its exact per-column layout). Wire: 1 bit per
    coordinate, two float32 per bucket.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = onebit_quantizer()
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([1.0, 3.0, -2.0, -4.0])).tolist()  # means of the >= 0 and < 0 values
      [2.0, 2.0, -3.0, -3.0]
    """
    bucket_size = _check_bucket_size(bucket_size)

    def encode(x, key):
        del key
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        neg = xb < 0
        neg_sum = jnp.sum(jnp.where(neg, xb, 0), axis=1)
        pos_sum = jnp.sum(jnp.where(neg, 0, xb), axis=1)
        neg_count = jnp.sum(neg, axis=1, dtype=jnp.int32).astype(jnp.float32)
        pos_count = _true_counts(n, d, nb) - neg_count  # padding zeros are not counted
        pos_mean = jnp.where(pos_count > 0, pos_sum / jnp.maximum(pos_count, 1), 0)
        neg_mean = jnp.where(neg_count > 0, neg_sum / jnp.maximum(neg_count, 1), 0)
        return _sign_codes(xb, n), jnp.stack([pos_mean, neg_mean], axis=1)

    return Quantizer(encode, _sign_decode(bucket_size, 0, 1, False), False, "onebit", signs=True)


def bounded_sign_quantizer(
    lam: float = 0.8, error_bound: float = 1.0, bucket_size: int | None = None
) -> Quantizer:
    """The patent's improved 1-bit: L2-norm scaling by ``lam``, error bounded.

    Per bucket ``x`` of true length ``d``: ``C[x] = alpha * sign(x)`` with the
    L2 scale ``alpha_0 = lam * ||x||_2 / sqrt(d)`` (``0 < lam < 1``), then the
    bound ``||C[x] - x||_2 <= error_bound * ||x||_2`` enforced exactly: the
    error ``f(alpha) = d alpha^2 - 2 alpha ||x||_1 + ||x||_2^2`` is a
    quadratic, so the admissible scales form the interval between its roots
    ``(||x||_1 -+ sqrt(D)) / d``, ``D = ||x||_1^2 - d (1 - B^2) ||x||_2^2``,
    and ``alpha_0`` is clipped into it. When ``D < 0`` no scaled sign meets the
    bound (the smallest error of any ``alpha sign(x)`` is
    ``sqrt(1 - ||x||_1^2 / (d ||x||_2^2)) ||x||_2``, reached at
    ``alpha = ||x||_1 / d``) and that minimiser is used. So always
    ``||C[x] - x|| <= max(error_bound, that minimum) * ||x||`` up to float32
    rounding; with ``error_bound = 1`` (default) the bound always holds: never
    worse than sending nothing, hence a contraction for error feedback.
    Default ``lam = 0.8`` ~ ``sqrt(2 / pi)``, the error-minimising factor for
    Gaussian gradients (``E|x| / sqrt(E x^2)``). Wire: 1 bit per coordinate,
    one float32 per bucket.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = bounded_sign_quantizer(lam=0.5)
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> [round(v, 4) for v in roundtrip(jnp.array([3.0, -4.0])).tolist()]  # 0.5 * 5 / sqrt(2)
      [1.7678, -1.7678]
    """
    # lam and error_bound may be traced (optax.inject_hyperparams).
    lam = V.check_real("lam", lam, 0.0, 1.0, low_open=True, high_open=True, allow_traced=True)
    error_bound = V.check_real(
        "error_bound", error_bound, 0.0, 1.0, low_open=True, allow_traced=True
    )
    bucket_size = _check_bucket_size(bucket_size)
    # In float32 either way, so a traced error_bound gives the same bits.
    eb32 = jnp.asarray(error_bound, jnp.float32)

    def encode(x, key):
        del key
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        count = _true_counts(n, d, nb)
        # In units of the bucket's max m (as nrm2): ||x||^2 itself overflows
        # float32 for |x| ~ 1e19 and underflows for |x| ~ 1e-20. Every term
        # below is homogeneous in x, so alpha = m * (the same formula on x / m).
        _, a, ns = _bucket_norms(xb, "l2")
        m = jnp.max(jnp.abs(xb), axis=1)
        l1 = jnp.sum(a, axis=1)
        l2sq = ns * ns
        alpha0 = jnp.asarray(lam, jnp.float32) * jnp.sqrt(l2sq / count)
        c = (1 - eb32 * eb32) * l2sq
        disc = l1 * l1 - count * c
        root = jnp.sqrt(jnp.maximum(disc, 0))
        hi = (l1 + root) / count
        # The smaller root as c / (d * hi): no cancellation when D ~ ||x||_1^2.
        lo = jnp.where(hi > 0, c / (count * jnp.where(hi > 0, hi, 1)), 0)
        alpha = jnp.where(disc >= 0, jnp.clip(alpha0, lo, hi), l1 / count)
        return _sign_codes(xb, n), (m * jnp.where(m > 0, alpha, 0))[:, None]

    name = "bounded_sign" + (
        ""
        if V.is_dynamic(lam) or V.is_dynamic(error_bound)
        else f"(lam={lam}, error_bound={error_bound})"
    )
    return Quantizer(encode, _sign_decode(bucket_size, 0, 0, True), False, name, signs=True)


def terngrad_quantizer(bucket_size: int | None = None, clip: float | None = None) -> Quantizer:
    """TernGrad's stochastic ternarization (Wen et al., 2017), with its gradient clipping.

    Per bucket (per layer: ``bucket_size=None``) with ``s = max_i |x_i|``:
    ``C[x]_i = s * sign(x_i) * b_i``, ``b_i ~ Bernoulli(|x_i| / s)``, so
    ``E C[x] = x`` and each coordinate is one of ``{-s, 0, s}``. This is
    :func:`qsgd_quantizer` with one level and the max norm, and is built from
    it: the same codes and the same decoder.

    ``clip=c``: the paper's gradient clipping first, ``x_i <- sign(x_i)
    min(|x_i|, c * sigma)`` with ``sigma`` the bucket's standard deviation
    (population, over its true elements; computed scaled by the bucket's max,
    so it neither over- nor underflows). The paper uses ``c = 2.5``. Clipping
    makes ``C`` biased (``E C[x]`` is the clipped ``x``); with error feedback
    the clipped part stays in the residual.

    Wire: 2 bits per coordinate (level bit and sign bit, QSGD's code layout
    for ``s = 1``), packed; one float32 scale per bucket.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = terngrad_quantizer()
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([2.0, -2.0, 0.0])).tolist()  # |x_i| / max |x| is 0 or 1: no rounding
      [2.0, -2.0, 0.0]
    """
    bucket_size = _check_bucket_size(bucket_size)
    clip = V.check_real("clip", clip, 0.0, None, low_open=True, allow_none=True)
    inner = qsgd_quantizer(1, bucket_size, "max")
    c32 = None if clip is None else np.float32(clip)

    def encode(x, key):
        if c32 is not None:
            x = _clip_sigma(x.astype(jnp.float32), c32, bucket_size)
        return inner.encode(x, key)

    return Quantizer(encode, inner.decode, True, f"terngrad(clip={clip})")


def _clip_sigma(x: jax.Array, c, bucket_size) -> jax.Array:
    """``x`` clipped to ``[-c sigma, c sigma]`` per bucket, ``sigma`` the bucket's std."""
    n = x.shape[0]
    d, nb = _bucketing(n, bucket_size)
    xb = _to_buckets(x, d, nb)
    counts = _true_counts(n, d, nb)
    valid = (np.arange(nb * d) < n).reshape(nb, d)  # padding is not part of the bucket
    m = jnp.max(jnp.abs(xb), axis=1)
    a = xb / jnp.where(m > 0, m, 1)[:, None]  # in [-1, 1]: no square over- or underflows
    mean = jnp.sum(a, axis=1) / counts
    dev = jnp.where(valid, a - mean[:, None], 0)
    sigma = m * jnp.sqrt(jnp.sum(dev * dev, axis=1) / counts)
    t = (c * sigma)[:, None]
    return _from_buckets(jnp.clip(xb, -t, t), n)


def _pow2(k: jax.Array) -> jax.Array:
    """``2.0 ** k`` in float32, exact, for integer ``k`` in [-126, 127] (built from the bits)."""
    return lax.bitcast_convert_type((k.astype(jnp.int32) + 127) << 23, jnp.float32)


NATURAL_BITS = 9  # float32's sign and 8 exponent bits


def natural_quantizer() -> Quantizer:
    """Natural compression ``C_nat`` (Horvath et al., 2019): each value to a power of two.

    ``|x| = 2^e (1 + f)``, ``f in [0, 1)``, goes to ``2^(e + 1)`` with
    probability ``f`` and to ``2^e`` otherwise, sign kept: unbiased, ``E
    C_nat(x) = x``, with variance at most ``x^2 / 8``. The probability is
    exact: ``f`` is the float32 mantissa ``M / 2^23`` and the draw is
    ``r < M`` for a uniform 23-bit integer ``r``. Float32 subnormals
    (``|x| < 2^-126``) round the same way between 0 and ``2^-126``, so they
    stay unbiased. Values above ``2^127`` always round down to ``2^127``
    (``2^128`` is not a float32): never inf, but biased there, by up to a
    factor 2 (with error feedback the excess stays in the residual).

    Wire: what is left of a float32 once the mantissa is dropped, the sign
    bit and the 8-bit exponent: 9 bits per coordinate (the sign is sent as 0
    for zeros), packed with :func:`pack_codes`; plus one float32 per leaf,
    1 (0 from a device that sends nothing, see :func:`quantize`).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = natural_quantizer()
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([0.5, -4.0, 0.0])).tolist()  # powers of two are kept exactly
      [0.5, -4.0, 0.0]
      >>> message_nbytes(q, 3)  # 3 x 9 bits in 4 bytes + one float32
      8
    """

    def encode(x, key):
        n = x.shape[0]
        b = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
        exponent = (b >> 23) & jnp.uint32(0xFF)
        mantissa = b & jnp.uint32(0x7FFFFF)
        r = jax.random.bits(key, (n,), jnp.uint32) >> 9  # uniform on [0, 2^23)
        e = jnp.minimum(exponent + (r < mantissa).astype(jnp.uint32), jnp.uint32(254))
        negative = ((b >> 31) != 0) & (e > 0)
        code = e | jnp.where(negative, jnp.uint32(1 << 8), jnp.uint32(0))
        return pack_codes(code, NATURAL_BITS), jnp.ones((1, 1), jnp.float32)

    def decode(codes, scales, n):
        c = unpack_codes(codes, NATURAL_BITS, n)
        b = ((c >> 8) << 31) | ((c & jnp.uint32(0xFF)) << 23)
        return lax.bitcast_convert_type(b, jnp.float32) * scales[0, 0]

    return Quantizer(encode, decode, True, "natural")


def natural_dithering_quantizer(
    levels: int, bucket_size: int | None = None, norm: str = "l2"
) -> Quantizer:
    """Natural dithering ``C_nd`` (Horvath et al., 2019): QSGD with power-of-two levels.

    Per bucket with scale ``||v||_2`` (``norm="l2"``) or ``max_i |v_i|``
    (``"max"``) and ``s = levels``: ``a_i = |v_i| / scale`` in ``[0, 1]`` is
    rounded stochastically and without bias to one of its two neighbours in
    ``{0, 2^(1-s), ..., 1/4, 1/2, 1}``, and ``C(v)_i = scale * sgn(v_i) *
    level``. Between two powers of two the probability of rounding up is
    ``2 f - 1`` for ``a = f 2^e`` (exact in float32); below ``2^(1-s)`` it
    is ``a 2^(s-1)``. The norm is computed scaled, as in
    :func:`qsgd_quantizer`.

    Wire: QSGD's code layout with the level index ``0..s`` in the low bits
    and the sign on top, ``1 + ceil(log2(s + 1))`` bits per coordinate
    (``s = 8``: 5 bits), packed; one float32 scale per bucket.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> q = natural_dithering_quantizer(4, norm="max")  # levels {0, 1/8, 1/4, 1/2, 1}
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([2.0, -4.0, 1.0, 0.0])).tolist()  # |x| / 4 are levels: no rounding
      [2.0, -4.0, 1.0, 0.0]
    """
    s = V.check_int("levels", levels, 1, 126)
    bucket_size = _check_bucket_size(bucket_size)
    norm = V.check_choice("norm", norm, QSGD_NORMS)
    bits = qsgd_bits(s)
    sign_bit = 1 << (bits - 1)
    lowest = np.float32(2.0 ** (1 - s))

    def encode(x, key):
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        scale, a, ns = _bucket_norms(xb, norm)
        if ns is not None:
            a = a / ns[:, None]
        f, e = jnp.frexp(a)  # a = f 2^e, f in [0.5, 1): between 2^(e-1) and 2^e
        small = a < lowest
        p = jnp.where(small, a * np.float32(2.0 ** (s - 1)), 2 * f - 1)
        up = jax.random.uniform(key, xb.shape, jnp.float32) < p
        low = jnp.where(small, 0, e - 1 + s)  # level index of 2^(e-1) is e - 1 + s
        level = jnp.clip(low + up, 0, s).astype(jnp.uint32)
        negative = (xb < 0) & (level > 0)
        code = level | jnp.where(negative, jnp.uint32(sign_bit), jnp.uint32(0))
        return pack_codes(_from_buckets(code, n), bits), scale[:, None]

    def decode(codes, scales, n):
        d, nb = _bucketing(n, bucket_size)
        code = _to_buckets(unpack_codes(codes, bits, n), d, nb)
        level = (code & jnp.uint32(sign_bit - 1)).astype(jnp.int32)
        mag = jnp.where(level > 0, _pow2(jnp.maximum(level, 1) - s), 0)
        signed = jnp.where(code >= jnp.uint32(sign_bit), -mag, mag)
        return _from_buckets(signed * scales, n)

    return Quantizer(encode, decode, True, f"natural_dithering(levels={s}, norm={norm!r})")


def cast_quantizer(dtype: Any = jnp.bfloat16) -> Quantizer:
    """A cast to float16 or bfloat16, as PyTorch DDP's ``fp16_compress_hook`` / ``bf16_...``.

    The message is ``x`` rounded to ``dtype`` (round to nearest even), 16 bits
    per coordinate, sent as its bit pattern; it decodes exactly to float32.

    Overflow: a value beyond ``dtype``'s range would round to ``inf``
    (float16: ``|x| >= 65520``). Then the whole leaf is divided by a power of
    two ``2^k`` that brings its max under ``2^(emax - 1)`` (exact: only the
    exponents change) and ``2^k`` travels as the message's float32 scale;
    otherwise the scale is 1 and the message is bit for bit the plain cast.
    So the update is never inf; with error feedback the residual keeps every
    rounding. When scaled, values more than float16's dynamic range (about
    ``2^40``) below the leaf's max round to 0 (kept in the residual with
    error feedback, lost without). The check costs one ``max|x|`` pass per
    leaf.

    Wire: 16 bits per coordinate plus one float32 per leaf.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> q = cast_quantizer(jnp.float16)
      >>> roundtrip = jax.jit(lambda x: q.decode(*q.encode(x, jax.random.key(0)), x.size))
      >>> roundtrip(jnp.array([1.0, 1 / 3])).tolist() == [1.0, float(np.float16(1 / 3))]
      True
      >>> message_nbytes(q, 2)  # 2 x 16 bits + one float32 scale
      8
    """
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt is None or dt.name not in CAST_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(CAST_DTYPES)}, got {dtype!r}")
    _, top = math.frexp(float(jnp.finfo(dt).max))  # max < 2^top
    f32_max = np.float32(jnp.finfo(jnp.float32).max)

    def encode(x, key):
        del key
        x = x.astype(jnp.float32)
        m = jnp.max(jnp.abs(x))
        over = jnp.isinf(m.astype(dt))
        _, e = jnp.frexp(m)  # m < 2^e: m / 2^(e - top + 1) < 2^(top - 1) <= max
        scale = jnp.where(over, _pow2(jnp.where(over, e - top + 1, 0)), np.float32(1))
        y = (x / scale).astype(dt)
        return lax.bitcast_convert_type(y, jnp.uint16), scale.reshape(1, 1)

    def decode(codes, scales, n):
        del n
        y = lax.bitcast_convert_type(codes, dt).astype(jnp.float32) * scales[0, 0]
        # A scaled max within 2^-9 of float32's max may round up to 2^128.
        return jnp.clip(y, -f32_max, f32_max)

    return Quantizer(encode, decode, False, f"cast({dt.name})")


def message_nbytes(quantizer: Quantizer, n: int) -> int:
    """Bytes of one quantized message of an ``n``-element leaf (static shapes).

    Example:
      >>> message_nbytes(qsgd_quantizer(16), 1000)  # 6 bits * 1000 + one float32 scale
      754
      >>> message_nbytes(onebit_quantizer(), 64)  # 64 bits + two float32 per bucket
      16
    """
    out = jax.eval_shape(
        quantizer.encode, jax.ShapeDtypeStruct((n,), jnp.float32), jax.random.key(0)
    )
    return sum(math.prod(o.shape) * jnp.dtype(o.dtype).itemsize for o in out)
