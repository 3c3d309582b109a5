"""The generic quantizing compressor, and the quantizers (codecs) it runs.

``quantize`` is one optax ``GradientTransformationExtraArgs`` that every
quantizing method in jaxcomp is built from (QSGD, 1-bit SGD, scaled sign,
...); the named factories in ``quantizers.py`` only pick the codec. It is the
analogue of :func:`jaxcomp.sparsify`. Per step and per leaf:

    R      = e + g  (error feedback)  or  R = g  (without)
    msg    = encode(R)                 # packed codes + float32 scales
    S      = decode(msg)               # what every receiver reconstructs
    e_new  = R - S                     # with error feedback; else no e is kept
    update = mean over devices of decode(msg_d)

A :class:`Quantizer` turns a flat float32 vector into a message
``(codes, scales)``: ``codes`` an unsigned-integer array with several
coordinates bit-packed per element (the wire payload), ``scales`` a float32
``[buckets, m]`` array. Every codec decodes all-zero scales to all zeros: a
device that sends nothing (non-finite step, left-out backup worker) zeroes its
scales, so fixed-shape collectives still run.

Error feedback keeps ``e_new = R - S`` computed in the residual dtype with one
rounding, ``S`` being the update as returned (cast back to the gradient dtype).
Unlike a sparsifier, whose ``S`` equals ``R`` where it is nonzero, a quantized
``S`` is far from ``R`` element-wise, so ``S + (R - S)`` recovers ``R`` only up
to that one rounding of the difference (an exactly representable ``e_new``
often does not exist): the residual is the correctly rounded ``R - S``, bit for
bit, and ``|S + e_new - R| <= ulp(R - S) / 2``. Leaves sent dense keep the
sparsifier's exact invariant.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.transforms.sparsify import (
    _NONFINITE,
    apply_nonfinite_policy,
    resolve_residual_dtype,
)

__all__ = [
    "QSGD_NORMS",
    "QUANTIZER_EXCHANGES",
    "QuantizeState",
    "Quantizer",
    "bounded_sign_quantizer",
    "message_nbytes",
    "onebit_quantizer",
    "pack_codes",
    "qsgd_bits",
    "qsgd_levels",
    "qsgd_quantizer",
    "quantize",
    "sign_quantizer",
    "unpack_codes",
]

QSGD_NORMS = ("l2", "max")

# ---------------------------------------------------------------------------
# Bit packing.
# ---------------------------------------------------------------------------


def _pack_layout(bits: int) -> tuple[int, int]:
    """(codes per group L, uint32 words per group W): ``L * bits == 32 * W``."""
    g = math.gcd(bits, 32)
    return 32 // g, bits // g


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
    """Packs unsigned codes of ``bits`` bits each densely into bytes.

    The result is one little-endian bit stream: code ``i`` occupies bits
    ``[i * bits, (i + 1) * bits)``, least significant bit first, and bit ``j``
    of the stream is bit ``j % 8`` of byte ``j // 8``. No code is rounded up to
    a wider field: a 6-bit code takes 6 bits. Vectorised: groups of
    ``L = 32 / gcd(bits, 32)`` codes fill exactly ``bits * L / 32`` uint32
    words with static shifts (each code touches at most two words), then the
    words are split into bytes.

    Args:
      codes: 1-D unsigned integers, each below ``2**bits`` (higher bits are
        dropped). A numpy array is packed with numpy (the same code, on the
        host), anything else with ``jax.numpy``.
      bits: code width, an int in [1, 32].

    Returns:
      uint8 array of ``ceil(n * bits / 8)`` bytes.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.transforms.quantize import pack_codes, unpack_codes
      >>> p = pack_codes(jnp.array([1, 0, 3, 2, 1], jnp.uint8), 2)
      >>> p.tolist(), unpack_codes(p, 2, 5).tolist()
      ([177, 1], [1, 0, 3, 2, 1])
    """
    bits = _check_code_bits(bits)
    xp = np if isinstance(codes, np.ndarray) else jnp
    n = codes.shape[0]
    per, words = _pack_layout(bits)
    groups = -(-n // per)
    c = codes.astype(xp.uint32)
    if bits < 32:
        c = c & xp.uint32((1 << bits) - 1)
    c = xp.pad(c, (0, groups * per - n)).reshape(groups, per)
    out = [xp.zeros((groups,), xp.uint32) for _ in range(words)]
    for j in range(per):  # static: at most 32 columns, not a loop over elements
        word, shift = divmod(j * bits, 32)
        out[word] = out[word] | (c[:, j] << shift)
        if shift + bits > 32:  # the code's high bits spill into the next word
            out[word + 1] = out[word + 1] | (c[:, j] >> (32 - shift))
    w = xp.stack(out, axis=1).reshape(-1)
    # Bytes by shifts, not a bitcast: the layout does not depend on endianness.
    b = xp.stack([(w >> (8 * i)) & xp.uint32(0xFF) for i in range(4)], axis=1)
    return b.astype(xp.uint8).reshape(-1)[: -(-n * bits // 8)]


def unpack_codes(packed: jax.Array, bits: int, n: int) -> jax.Array:
    """Inverse of :func:`pack_codes`: the first ``n`` codes, as uint32 (numpy in, numpy out)."""
    bits = _check_code_bits(bits)
    xp = np if isinstance(packed, np.ndarray) else jnp
    per, words = _pack_layout(bits)
    groups = -(-n // per)
    b = packed.astype(xp.uint32)
    b = xp.pad(b, (0, 4 * groups * words - b.shape[0])).reshape(-1, 4)
    w = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    w = w.reshape(groups, words)
    mask = xp.uint32((1 << bits) - 1) if bits < 32 else None
    cols = []
    for j in range(per):
        word, shift = divmod(j * bits, 32)
        v = w[:, word] >> shift
        if shift + bits > 32:
            v = v | (w[:, word + 1] << (32 - shift))
        cols.append(v if mask is None else v & mask)
    return xp.stack(cols, axis=1).reshape(-1)[:n]


def _check_code_bits(bits) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= 32:
        raise ValueError(f"bits must be an int in [1, 32], got {bits!r}")
    return int(bits)


# ---------------------------------------------------------------------------
# Quantizers.
# ---------------------------------------------------------------------------


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
    """

    encode: Callable[[jax.Array, jax.Array], tuple[jax.Array, jax.Array]]
    decode: Callable[[jax.Array, jax.Array, int], jax.Array]
    randomized: bool
    name: str


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


def qsgd_bits(levels: int) -> int:
    """Bits per coordinate of QSGD's packed codes: 1 sign bit + ``ceil(log2(s + 1))`` level bits.

    Levels run over ``0..s``, so ``s = 2**b`` (the paper's "b-bit") takes
    ``b + 2`` bits: ``qsgd_bits(16) == 6``. Packed densely (:func:`pack_codes`),
    never rounded up to a power of two.
    """
    return int(levels).bit_length() + 1


def qsgd_levels(levels: int | None = None, bits: int | None = None) -> int:
    """QSGD's ``s`` from exactly one of ``levels`` (``s`` itself) or ``bits`` (``s = 2**bits``).

    The QSGD paper's "b-bit" is ``s = 2**b`` levels with the sign apart.

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
        # Scaled by the bucket's max, as BLAS nrm2: sum(v * v) overflows for
        # |v| ~ 1e19 and underflows for |v| ~ 1e-20; sum((v / m)^2) is in [1, d].
        m = jnp.max(jnp.abs(xb), axis=1)
        live = m > 0
        a = jnp.abs(xb) / jnp.where(live, m, 1)[:, None]  # in [0, 1], exactly 1 at the max
        if norm == "l2":
            ns = jnp.where(live, jnp.sqrt(jnp.sum(a * a, axis=1)), 1)  # in [1, sqrt(d)]
            scale = m * ns
            r = a * (jnp.float32(s) / ns)[:, None]
        else:
            scale = m
            r = a * jnp.float32(s)
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


def sign_quantizer(bucket_size: int | None = None) -> Quantizer:
    """Scaled sign, ``C[x] = (||x||_1 / d) * sign(x)`` per bucket (signSGD / EF-signSGD).

    ``||x||_1 / d`` (``d`` the bucket's true length) is the scale that
    minimises ``||C[x] - x||_2`` over all ``alpha * sign(x)``. Zeros are sent
    as ``+`` (one bit has no zero). Wire: 1 bit per coordinate, one float32
    per bucket.
    """
    bucket_size = _check_bucket_size(bucket_size)

    def encode(x, key):
        del key
        n = x.shape[0]
        d, nb = _bucketing(n, bucket_size)
        xb = _to_buckets(x.astype(jnp.float32), d, nb)
        scale = jnp.sum(jnp.abs(xb), axis=1) / _true_counts(n, d, nb)
        return _sign_codes(xb, n), scale[:, None]

    return Quantizer(encode, _sign_decode(bucket_size, 0, 0, True), False, "sign")


def onebit_quantizer(bucket_size: int | None = None) -> Quantizer:
    """1-bit SGD's quantizer (Seide et al., 2014): sign with two reconstruction values.

    Per bucket, coordinates ``x_i >= 0`` decode to the mean of the bucket's
    non-negative values and ``x_i < 0`` to the mean of its negative values:
    the two values that minimise the squared error for this sign split (the
    paper's per-column reconstruction; take ``bucket_size`` = a row length of
    a transposed weight for its exact per-column layout). Wire: 1 bit per
    coordinate, two float32 per bucket.
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

    return Quantizer(encode, _sign_decode(bucket_size, 0, 1, False), False, "onebit")


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
        l1 = jnp.sum(jnp.abs(xb), axis=1)
        l2sq = jnp.sum(xb * xb, axis=1)
        alpha0 = jnp.asarray(lam, jnp.float32) * jnp.sqrt(l2sq / count)
        c = (1 - eb32 * eb32) * l2sq
        disc = l1 * l1 - count * c
        root = jnp.sqrt(jnp.maximum(disc, 0))
        hi = (l1 + root) / count
        # The smaller root as c / (d * hi): no cancellation when D ~ ||x||_1^2.
        lo = jnp.where(hi > 0, c / (count * jnp.where(hi > 0, hi, 1)), 0)
        alpha = jnp.where(disc >= 0, jnp.clip(alpha0, lo, hi), l1 / count)
        return _sign_codes(xb, n), alpha[:, None]

    name = "bounded_sign" + (
        ""
        if V.is_dynamic(lam) or V.is_dynamic(error_bound)
        else f"(lam={lam}, error_bound={error_bound})"
    )
    return Quantizer(encode, _sign_decode(bucket_size, 0, 0, True), False, name)


# ---------------------------------------------------------------------------
# The transform.
# ---------------------------------------------------------------------------


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
        dense leaves (0 with ``axis_name=None``).
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


class _LeafOut(NamedTuple):
    update: jax.Array
    residual: jax.Array
    message_bytes: jax.Array
    wire_bytes: jax.Array
    message: Any


def _to_dtype(x: jax.Array, dtype) -> jax.Array:
    """Casts to ``dtype``, saturating at its largest finite value (float16).

    A bucket's scale can exceed float16's range although every element fits
    (QSGD's L2 norm of a large leaf); saturating keeps the update finite and,
    with error feedback, the excess in the residual.
    """
    dtype = jnp.dtype(dtype)
    big = float(jnp.finfo(dtype).max)
    if big < float(jnp.finfo(x.dtype).max):
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def _nbytes(x) -> int:
    return x.size * jnp.dtype(x.dtype).itemsize


# Values of the quantizers' ``exchange`` argument.
QUANTIZER_EXCHANGES = ("allgather", "server", "gossip")


def quantize(
    quantizer: Quantizer,
    *,
    axis_name: Any = None,
    exchange: str = "allgather",
    error_feedback: bool = True,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
    keep_message: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """A quantizing compressor, with optional error feedback, around any codec.

    Args:
      quantizer: a :class:`Quantizer` (:func:`qsgd_quantizer`,
        :func:`sign_quantizer`, :func:`onebit_quantizer`,
        :func:`bounded_sign_quantizer`, or your own).
      axis_name: mesh axis to average over inside ``shard_map``/``pmap``: the
        packed codes and the scales are all-gathered, every device decodes all
        ``N`` messages and averages them (in device order, so all devices get
        bit-identical updates). ``None``: return the local decoded update.
      exchange: ``"allgather"`` (above) or ``"server"``: a parameter server
        (device 0) receives every message, decodes and averages them in
        device order and sends the dense mean back
        (:func:`jaxcomp.comm.server_mean`'s pattern; bytes per worker link:
        its message plus the dense pull). No ``include=`` with the server.
        ``"gossip"``: decentralized, not an average: each device sends its
        message to its two ring neighbours and its update is the mix (1/3
        each) of its own and their decoded messages
        (:func:`jaxcomp.comm.gossip_mean`'s ring), different per device; two
        messages on the wire. Train with
        :func:`jaxcomp.aggregation.make_gossip_train_step` (``make_train_step``
        rejects it); no ``include=``.
      error_feedback: keep ``residual = R - decoded`` and add it to the next
        gradient (1-bit SGD, EF-signSGD). ``False``: send the quantized
        gradient itself (unbiased QSGD, signSGD); no residual is allocated
        (``state.residual`` is None).
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
        residual; ``"zero"``: non-finite elements are replaced by 0.
      seed: seed of the PRNG stream of randomized codecs.
      keep_message: also store this step's packed message per leaf (codes +
        scales, fixed shape) in ``state.message``, so the host can measure it
        (e.g. QSGD's Elias-coded size with
        :func:`jaxcomp.coding.coded_message_bytes`). Off by default: it costs
        a copy of the message in the state.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`QuantizeState`.
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
    if not isinstance(quantizer, Quantizer):
        raise ValueError(f"quantizer must be a Quantizer, got {quantizer!r}")
    error_feedback = V.check_bool("error_feedback", error_feedback)
    min_dense_size = V.check_int(
        "min_dense_size", 0 if min_dense_size is None else min_dense_size, 0
    )
    nonfinite = V.check_choice("nonfinite", nonfinite, _NONFINITE)
    exchange = V.check_choice("exchange", exchange, QUANTIZER_EXCHANGES)
    if residual_dtype is not None:  # None: per leaf, see resolve_residual_dtype
        residual_dtype = V.check_float_dtype("residual_dtype", residual_dtype)
    # Only init reads the seed, so it may be an injected (traced) hyperparameter.
    seed = V.check_int("seed", seed, -(2**31), 2**31 - 1, allow_traced=True)
    keep_message = V.check_bool("keep_message", keep_message)

    def compress_leaf(g, residual, key, sends, include) -> _LeafOut:
        shape, n = g.shape, g.size
        out_dtype = g.dtype
        if error_feedback:
            rdt = residual.dtype  # fixed per leaf by init (resolve_residual_dtype)
        else:  # no residual allocated: the dtype init would have given it
            rdt = resolve_residual_dtype(residual_dtype, [g])
        x = g.reshape(-1).astype(rdt)
        acc = residual.reshape(-1) + x if error_feedback else x

        kept = None
        if n == 0 or n <= min_dense_size:
            sent_out = jnp.where(sends, acc, 0).astype(out_dtype)
            if axis_name is None:
                update, wire = sent_out, jnp.float32(0)
            elif exchange == "server":
                update, wire = collectives.server_mean(sent_out, axis_name)
            elif exchange == "gossip":
                update, wire = collectives.gossip_mean(sent_out, axis_name)
            else:
                update, wire = collectives.dense_mean(sent_out, axis_name, include=include)
            nbytes = jnp.where(sends, n * out_dtype.itemsize, 0).astype(jnp.int32)
        else:
            codes, scales = quantizer.encode(acc, key)
            # An unsent message still travels (static shapes): zero scales decode to 0.
            scales = jnp.where(sends, scales, 0)
            decoded = quantizer.decode(codes, scales, n)
            sent_out = _to_dtype(decoded, out_dtype)
            if axis_name is None:
                update, wire = sent_out, jnp.float32(0)
            elif exchange == "server":
                update, wire = _server_mean(codes, scales, n, out_dtype)
            elif exchange == "gossip":
                update, wire = _gossip_mix(codes, scales, decoded, n, out_dtype)
            else:
                update, wire = _gather_mean(codes, scales, n, out_dtype, include)
            message = _nbytes(codes) + _nbytes(scales)
            nbytes = jnp.where(sends, message, 0).astype(jnp.int32)
            kept = (codes, scales) if keep_message else None
        new_res = (acc - sent_out.astype(rdt)).reshape(shape) if error_feedback else None
        return _LeafOut(update.reshape(shape), new_res, nbytes, wire, kept)

    def _gather_mean(codes, scales, n, out_dtype, include):
        n_dev = collectives.axis_size(axis_name)
        extra = 0.0
        if include is None:
            denom = jnp.float32(n_dev)
        else:
            include = jnp.asarray(include, jnp.bool_)
            denom = jnp.maximum(lax.psum(include.astype(jnp.float32), axis_name), 1.0)
            extra = collectives.allreduce_bytes(4, n_dev)
        all_codes = collectives.all_gather_invariant(codes, axis_name)
        all_scales = collectives.all_gather_invariant(scales, axis_name)
        decoded = jax.vmap(lambda c, s: quantizer.decode(c, s, n))(all_codes, all_scales)
        mean = jnp.sum(decoded, axis=0) / denom
        wire = collectives.allgather_bytes(_nbytes(codes) + _nbytes(scales), n_dev) + extra
        return _to_dtype(mean, out_dtype), jnp.float32(wire)

    def _gossip_mix(codes, scales, decoded, n, out_dtype):
        # This device's ring mix of its own and its two neighbours' decoded
        # messages (float32, then cast once): decentralized, differs per device.
        (l_codes, l_scales), (r_codes, r_scales) = collectives.ring_neighbours(
            (codes, scales), axis_name
        )
        if collectives.axis_size(axis_name) == 1:
            return _to_dtype(decoded, out_dtype), jnp.float32(0)
        w_self, w_left, w_right = (jnp.float32(w) for w in collectives.GOSSIP_WEIGHTS)
        mixed = (
            w_self * decoded
            + w_left * quantizer.decode(l_codes, l_scales, n)
            + w_right * quantizer.decode(r_codes, r_scales, n)
        )
        return _to_dtype(mixed, out_dtype), jnp.float32(2 * (_nbytes(codes) + _nbytes(scales)))

    def _server_mean(codes, scales, n, out_dtype):
        n_dev = collectives.axis_size(axis_name)
        # The root decodes the N messages it received, in device order.
        all_codes = jnp.stack(collectives.push_to_root(codes, axis_name))
        all_scales = jnp.stack(collectives.push_to_root(scales, axis_name))
        decoded = jax.vmap(lambda c, s: quantizer.decode(c, s, n))(all_codes, all_scales)
        mean = collectives.pull_from_root(jnp.sum(decoded, axis=0) / n_dev, axis_name)
        push = _nbytes(codes) + _nbytes(scales)
        link = collectives.server_link_bytes(push, n * jnp.dtype(out_dtype).itemsize, n_dev)
        return _to_dtype(mean, out_dtype), jnp.float32(link["worker"])

    def init(params):
        V.check_gradient_leaves(params, "jaxcomp.quantize.init", "parameter")
        return QuantizeState(
            step=jnp.zeros([], jnp.int32),
            # Without error feedback no residual is allocated (a full gradient copy).
            residual=jax.tree.map(
                lambda p: jnp.zeros(jnp.shape(p), resolve_residual_dtype(residual_dtype, [p])),
                params,
            )
            if error_feedback
            else None,
            key=jax.random.key_data(jax.random.key(seed)),
            message_bytes=jax.tree.map(lambda _: jnp.zeros([], jnp.int32), params),
            wire_bytes=jnp.zeros([], jnp.float32),
            nonfinite_steps=jnp.zeros([], jnp.int32),
            message=jax.tree.map(_empty_message, params) if keep_message else None,
        )

    def _empty_message(p):
        """Zeros shaped like the leaf's message; None for a leaf sent dense."""
        n = math.prod(jnp.shape(p))
        if n == 0 or n <= min_dense_size:
            return None
        x = jax.ShapeDtypeStruct((n,), jnp.float32)
        shapes = jax.eval_shape(quantizer.encode, x, jax.random.key(0))
        return tuple(jnp.zeros(o.shape, o.dtype) for o in shapes)

    def update(updates, state, params=None, *, include=None, **extra_args):
        """``include``: optional bool scalar, this device's backup-worker flag."""
        del params, extra_args
        V.check_gradient_leaves(updates, "jaxcomp.quantize")
        if error_feedback:
            V.check_tree_like(updates, state.residual, "jaxcomp.quantize")
        else:  # no residual: message_bytes is laid out like the parameters too
            V.check_tree_like(updates, state.message_bytes, "jaxcomp.quantize", shapes=False)
        check_per_device(updates, axis_name, "jaxcomp.quantize")
        grads, finite, send_ok = apply_nonfinite_policy(updates, nonfinite)
        if include is not None:
            if exchange in ("server", "gossip"):
                raise ValueError(
                    f"jaxcomp.quantize: exchange={exchange!r} does not take include= "
                    "(backup workers); use exchange='allgather'"
                )
            include = jnp.asarray(include, jnp.bool_)
        sends = send_ok if include is None else send_ok & include
        key = jax.random.wrap_key_data(state.key)
        if quantizer.randomized:
            key = jax.random.fold_in(key, state.step)
            if axis_name is not None:
                key = jax.random.fold_in(key, lax.axis_index(axis_name))

        g_leaves, treedef = jax.tree.flatten(grads)
        if error_feedback:
            r_leaves = treedef.flatten_up_to(state.residual)
        else:
            r_leaves = [None] * len(g_leaves)
        outs = [
            compress_leaf(g, r, jax.random.fold_in(key, i), sends, include)
            if quantizer.randomized
            else compress_leaf(g, r, key, sends, include)
            for i, (g, r) in enumerate(zip(g_leaves, r_leaves, strict=True))
        ]

        def field(name):
            return treedef.unflatten([getattr(o, name) for o in outs])

        new_state = QuantizeState(
            step=state.step + 1,
            residual=field("residual") if error_feedback else None,
            key=state.key,
            message_bytes=field("message_bytes"),
            wire_bytes=sum((o.wire_bytes for o in outs), jnp.float32(0)),
            nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
            message=field("message") if keep_message else None,
        )
        return field("update"), new_state

    return optax.GradientTransformationExtraArgs(init, update)


def message_nbytes(quantizer: Quantizer, n: int) -> int:
    """Bytes of one quantized message of an ``n``-element leaf (static shapes)."""
    out = jax.eval_shape(
        quantizer.encode, jax.ShapeDtypeStruct((n,), jnp.float32), jax.random.key(0)
    )
    return sum(math.prod(o.shape) * jnp.dtype(o.dtype).itemsize for o in out)
