"""The Elias-coded size of the messages a training run actually sent.

``jaxcomp.qsgd`` sends fixed-width packed codes (``message_bytes``: 1 sign bit
+ ``ceil(log2(s + 1))`` level bits per coordinate, plus float32 scales), the
size an all-gather of static shapes moves. The QSGD paper measures the
Elias-coded size instead (:func:`jaxcomp.coding.encode_qsgd`). With
``jaxcomp.qsgd(..., keep_message=True)`` the state keeps each step's packed
message; these host functions unpack it with numpy and return its exact
Elias-coded size.

Conventions match between the transform's codes and the wire format: a code
holds the level in its low bits and the sign in its top bit (1 = negative,
set only for nonzero levels), which is ``encode_qsgd``'s sign bit.

Example:

>>> import jax, jax.numpy as jnp, jaxcomp
>>> from jaxcomp import coding
>>> tx = jaxcomp.qsgd(bits=2, bucket_size=128, min_dense_size=0, keep_message=True)
>>> g = {"w": jax.random.normal(jax.random.key(0), (1000,))}
>>> _, state = jax.jit(tx.update)(g, tx.init(g))
>>> coded = coding.coded_message_bytes(state, g, s=4, bucket_size=128)
>>> 0 < coded["w"] < int(state.message_bytes["w"])
True
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jaxcomp import _validation as V
from jaxcomp.coding import wire
from jaxcomp.quantization import qsgd_bits, unpack_codes

__all__ = ["coded_message_bytes", "qsgd_message_bits", "qsgd_message_fields"]


def _check_s(s) -> int:
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 1 <= s < 2**31:
        raise ValueError(f"s must be an int in [1, 2**31), got {s!r}")
    return int(s)


def qsgd_message_fields(codes, scales, n: int, *, s: int, bucket_size: int | None):
    """``(levels, signs, scales)`` of one leaf's packed QSGD message (``encode_qsgd``'s input).

    Args:
      codes: the packed uint8 codes of an ``n``-element leaf, as
        ``jaxcomp.qsgd`` sends them (``state.message[leaf][0]``).
      scales: its float32 scales, ``[buckets, 1]`` (``state.message[leaf][1]``).
      n: the leaf's number of elements.
      s: QSGD's levels (``2**bits`` for ``jaxcomp.qsgd(bits=...)``).
      bucket_size: the transform's ``bucket_size`` (None: whole leaf).

    Returns:
      ``(levels int64 [n], signs bool [n] (True = negative), scales float32 [nb])``.

    Raises:
      ValueError: ``codes``/``scales`` do not have the sizes ``s`` and
        ``bucket_size`` give for ``n`` elements (checked before anything of
        size ``n`` is allocated), ``bucket_size`` is not None or an int >= 1,
        or a level exceeds ``s``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.qsgd(bits=2, bucket_size=4, min_dense_size=0, keep_message=True)
      >>> g = {"w": jnp.array([1.0, -1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 0.0])}
      >>> _, state = jax.jit(tx.update)(g, tx.init(g))
      >>> codes, scales = state.message["w"]
      >>> levels, signs, scales = qsgd_message_fields(codes, scales, 8, s=4, bucket_size=4)
      >>> levels.tolist(), signs.tolist()[:4], scales.tolist()  # |x| / ||bucket|| * s
      ([2, 2, 2, 2, 4, 0, 0, 0], [False, True, False, False], [2.0, 2.0])
    """
    s = _check_s(s)
    n = V.check_int("n", n, 0)  # 3.7 is no length
    bucket_size = V.check_int("bucket_size", bucket_size, 1, allow_none=True)
    width = qsgd_bits(s)
    codes = np.asarray(codes)
    scales = np.asarray(scales, np.float32).reshape(-1)
    d = n if bucket_size is None else min(bucket_size, n)
    nb = -(-n // d) if n else 0
    # Both sizes are checked before anything n long is allocated (exact integers: n may be huge).
    nbytes = -(-n * width // 8)
    if codes.dtype != np.uint8 or codes.shape != (nbytes,):
        raise ValueError(
            f"codes must be uint8[{nbytes}] for n={n} at s={s} "
            f"({width} bits a coordinate), got {codes.dtype}{list(codes.shape)}: "
            "s or n does not match the message"
        )
    if scales.size != nb:
        raise ValueError(
            f"expected {nb} scales for n={n}, bucket_size={bucket_size}, got {scales.size}"
        )
    raw = unpack_codes(codes, width, n).astype(np.int64)
    levels = raw & ((1 << (width - 1)) - 1)
    if levels.size and levels.max() > s:
        raise ValueError(f"a level exceeds s={s}: the message was not sent with s={s}")
    signs = (raw >> (width - 1)).astype(bool) & (levels > 0)
    return levels, signs, scales


def qsgd_message_bits(
    codes, scales, n: int, *, s: int, bucket_size: int | None, code: str = "omega"
) -> int:
    """Exact bits of the Elias-coded (``encode_qsgd``) form of one leaf's packed message.

    Equals ``coding.qsgd_bits(levels, ...)`` of the unpacked levels, and
    ``ceil(bits / 8) == len(coding.encode_qsgd(*qsgd_message_fields(...), ...))``.
    Arguments as in :func:`qsgd_message_fields`; ``code`` as in ``encode_qsgd``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> from jaxcomp import coding
      >>> tx = jaxcomp.qsgd(bits=2, bucket_size=4, min_dense_size=0, keep_message=True)
      >>> g = {"w": jnp.array([1.0, -1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 0.0])}
      >>> _, state = jax.jit(tx.update)(g, tx.init(g))
      >>> codes, scales = state.message["w"]
      >>> bits = qsgd_message_bits(codes, scales, 8, s=4, bucket_size=4)
      >>> fields = qsgd_message_fields(codes, scales, 8, s=4, bucket_size=4)
      >>> bits == coding.qsgd_bits(fields[0], s=4, bucket_size=4)
      True
    """
    levels, _, _ = qsgd_message_fields(codes, scales, n, s=s, bucket_size=bucket_size)
    return wire.qsgd_bits(levels, s=s, bucket_size=bucket_size, code=code)


def coded_message_bytes(state, params, *, s: int, bucket_size: int | None, code: str = "omega"):
    """Per leaf, bytes of the Elias-coded form of this device's last message.

    Args:
      state: the optimizer state of one device (host numpy or JAX arrays)
        holding one ``QuantizeState`` made with ``keep_message=True``
        (found by name, also inside ``optax.chain``). Under ``shard_map``
        with a leading device axis, slice one device first.
      params: a pytree like the gradients (arrays or ``jax.ShapeDtypeStruct``),
        for the leaf sizes.
      s: QSGD's levels (``2**bits`` for ``jaxcomp.qsgd(bits=...)``).
      bucket_size: the transform's ``bucket_size``.
      code: Elias code, as in :func:`jaxcomp.coding.encode_qsgd`.

    Returns:
      A pytree like ``params`` of Python ints: ``ceil(bits / 8)`` of
      ``encode_qsgd`` for quantized leaves, ``message_bytes`` (the dense
      tensor) for leaves sent dense, 0 for a leaf that sent nothing this step
      (``message_bytes == 0``: non-finite gradients, left-out backup worker).

    Raises:
      ValueError: the state keeps no message (``keep_message=False``), or the
        message does not match ``s``/``bucket_size``.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> tx = jaxcomp.qsgd(bits=2, bucket_size=4, min_dense_size=0, keep_message=True)
      >>> g = {"w": jnp.array([1.0, -1.0, 1.0, 1.0, 2.0, 0.0, 0.0, 0.0])}
      >>> _, state = jax.jit(tx.update)(g, tx.init(g))
      >>> coded = coded_message_bytes(state, g, s=4, bucket_size=4)
      >>> codes, scales = state.message["w"]
      >>> bits = qsgd_message_bits(codes, scales, 8, s=4, bucket_size=4)
      >>> coded["w"] == -(-bits // 8)
      True
    """
    import optax  # noqa: PLC0415

    message = optax.tree.get(state, "message")
    sizes = optax.tree.get(state, "message_bytes")
    if message is None or sizes is None:
        raise ValueError(
            "the state keeps no message: build the compressor with keep_message=True "
            "(e.g. jaxcomp.qsgd(..., keep_message=True))"
        )
    leaves, treedef = jax.tree.flatten(params)
    msgs = treedef.flatten_up_to(message)
    nbytes = treedef.flatten_up_to(sizes)
    out = []
    for p, msg, nb in zip(leaves, msgs, nbytes, strict=True):
        nb = int(np.asarray(nb))
        if msg is None or nb == 0:  # sent dense (its size as sent), or nothing sent
            out.append(nb)
            continue
        n = math.prod(getattr(p, "shape", np.shape(p)))
        codes, scales = (np.asarray(x) for x in msg)
        bits = qsgd_message_bits(codes, scales, n, s=s, bucket_size=bucket_size, code=code)
        out.append(-(-bits // 8))
    return treedef.unflatten(out)
