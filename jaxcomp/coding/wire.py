"""Host-side wire formats: QSGD's Elias format and the sparse (top-k) formats.

All formats are bit strings written MSB first into bytes, zero padded to a
whole byte; decoders reject truncation, corrupt codewords, counts or positions
out of range, nonzero padding and trailing bytes with ``ValueError``. Their
work is bounded by the declared sizes (``n``, the counts in the message): a
message longer than the longest encoding those allow is rejected before it is
read (``elias.check_size``).

QSGD format (``encode_qsgd``), for ``nb`` buckets (``ceil(n / bucket_size)``,
or 1 when ``bucket_size`` is None). The fields are the paper's, per bucket
(32-bit scale, then for each nonzero: Elias(gap), sign bit, Elias(level)),
plus one Elias(count + 1) per bucket so that each bucket is self-delimiting;
they are laid out planar so that decoding vectorises (the parse never has to
switch record type mid-chain):

1. ``nb`` scales, float32 big-endian (bit-exact, NaN payloads kept);
2. ``nb`` codewords Elias(count_b + 1), count_b = nonzeros of bucket b;
3. for each bucket in order, for each nonzero level in order: Elias(gap),
   where gap is the distance from the previous nonzero of the same bucket
   (the first from position -1, so gap >= 1), one sign bit (1 = negative),
   Elias(level), level in 1..s.

Sparse formats (``encode_sparse``), indices strictly increasing in [0, n),
values float32 (bit-exact):

* ``"rle"``: the ldte_bs paper's run-length format, 16-bit units. A 32-bit
  header holds the number of values k (so truncation is always detected),
  then for each value: the zero run before it (index - previous index - 1,
  the first from -1) as 16-bit tokens, then the value's 32 bits. A run r is
  written as ``r // 65535`` tokens 0xFFFF (each "65535 zeros, no value yet")
  followed by one token ``r % 65535`` (< 0xFFFF: "this many zeros, then a
  value"). The stream ends right after the k-th value (zeros after it up to n
  are implicit); everything is 16-bit aligned, so there is no padding.
* ``"elias"``: Elias(k + 1), then for each value Elias(index gap) (the first
  from -1) and the value's 32 bits; then fewer than 8 zero bits of padding.

Example:

>>> import numpy as np
>>> from jaxcomp.coding import encode_qsgd, decode_qsgd
>>> levels = np.array([0, 2, 0, 0, 1, 0, 0, 0])
>>> signs = np.array([0, 1, 0, 0, 0, 0, 0, 0], bool)
>>> data = encode_qsgd(levels, signs, np.float32([1.5]), s=2, bucket_size=None)
>>> out = decode_qsgd(data, n=8, s=2, bucket_size=None)
>>> out[0].tolist(), out[1].tolist()[:2], out[2].tolist()
([0, 2, 0, 0, 1, 0, 0, 0], [False, True], [1.5])
"""

from __future__ import annotations

import math
import struct

import numpy as np

from jaxcomp import _validation as V
from jaxcomp.coding import elias

__all__ = [
    "SPARSE_FORMATS",
    "decode_qsgd",
    "decode_sparse",
    "encode_qsgd",
    "encode_sparse",
    "qsgd_bits",
    "qsgd_bits_bound",
    "qsgd_dense_bound",
    "qsgd_paper_bits",
    "qsvrg_epoch_bits_bound",
    "sparse_bits",
]

# encode_sparse formats: 16-bit zero runs with float32 values, or Elias-coded gaps.
SPARSE_FORMATS = ("rle", "elias")
_RUN_MAX = 0xFFFF  # a full 16-bit token: 65535 zeros, no value
_U64 = np.uint64
_MAX_N = 2**63 - 1  # decoded positions are int64


def _num_buckets(n: int, bucket_size: int | None) -> tuple[int, int]:
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if bucket_size is None:
        return 1, max(n, 1)
    if int(bucket_size) < 1:
        raise ValueError(f"bucket_size must be >= 1 or None, got {bucket_size}")
    return max(-(-n // int(bucket_size)), 1), int(bucket_size)


def _check_s(s: int) -> int:
    if int(s) != s or s < 1:
        raise ValueError(f"s must be an integer >= 1, got {s}")
    return int(s)


def _qsgd_fields(levels, signs, *, s, bucket_size):
    """Validated (nonzero positions, gaps, signs, levels, counts, nb)."""
    s = _check_s(s)
    levels = np.asarray(levels)
    if levels.ndim != 1 or levels.dtype.kind not in "iu":
        raise ValueError(f"levels must be a 1-D integer array, got {levels.dtype} {levels.shape}")
    n = levels.size
    nb, d = _num_buckets(n, bucket_size)
    nz = np.flatnonzero(levels)
    lv = levels[nz]
    if lv.size and (lv.min() < 0 or lv.max() > s):
        raise ValueError(f"levels must lie in [0, s={s}]")
    bucket = nz // d
    prev = np.empty_like(nz)
    prev[1:] = nz[:-1]
    if nz.size:
        prev[0] = -1
        first = np.ones(nz.size, bool)
        first[1:] = bucket[1:] != bucket[:-1]
        prev[first] = bucket[first] * d - 1
    gaps = nz - prev
    counts = np.bincount(bucket, minlength=nb)
    sg = None
    if signs is not None:
        signs = np.asarray(signs)
        if signs.shape != levels.shape:
            raise ValueError(f"signs shape {signs.shape} != levels shape {levels.shape}")
        sg = signs[nz].astype(bool)
    return nz, gaps, sg, lv, counts, nb


def qsgd_bits(levels, *, s: int, bucket_size: int | None, code: str = "omega") -> int:
    """Exact bits (before padding) of ``encode_qsgd`` for these levels (one leaf).

    ``len(encode_qsgd(...)) == ceil(qsgd_bits(...) / 8)``. For a pytree use
    ``jax.tree.map(lambda l: qsgd_bits(np.asarray(l), s=s, bucket_size=d), tree)``.

    Example:
      >>> import numpy as np
      >>> levels = np.array([0, 2, 0, 0, 1, 0, 0, 0])
      >>> signs = np.zeros(8, bool)
      >>> bits = qsgd_bits(levels, s=2, bucket_size=None)
      >>> data = encode_qsgd(levels, signs, np.float32([1.5]), s=2, bucket_size=None)
      >>> len(data) == -(-bits // 8)
      True
    """
    elias.check_code(code)
    _, gaps, _, lv, counts, nb = _qsgd_fields(levels, None, s=s, bucket_size=bucket_size)
    count_bits = elias.codeword_lengths(counts + 1, code).sum()
    record_bits = 0
    if gaps.size:
        record_bits = (
            elias.codeword_lengths(gaps, code).sum()
            + gaps.size
            + elias.codeword_lengths(lv, code).sum()
        )
    return int(32 * nb + count_bits + record_bits)


def encode_qsgd(
    levels, signs, scales, *, s: int, bucket_size: int | None, code: str = "omega"
) -> bytes:
    """Encodes QSGD's (levels, signs, scales) into the wire format (module docs).

    Args:
      levels: 1-D int array of length n with entries in [0, s].
      signs: bool array like ``levels``, True = negative; read where levels > 0.
      scales: float32, one per bucket (``ceil(n / bucket_size)``, 1 if None).
      s: number of quantization levels.
      bucket_size: bucket length d, or None for one bucket (the whole vector).
      code: Elias code for gaps, counts and levels (``"omega"`` as in QSGD).

    Returns:
      The message; ``8 * len`` is ``qsgd_bits`` rounded up to a byte.

    Example:
      >>> import numpy as np
      >>> levels, signs = np.array([0, 2, 0, 1]), np.array([False, True, False, False])
      >>> data = encode_qsgd(levels, signs, np.float32([1.0]), s=2, bucket_size=None)
      >>> len(data) == -(-qsgd_bits(levels, s=2, bucket_size=None) // 8)
      True
    """
    elias.check_code(code)
    _, gaps, sg, lv, counts, nb = _qsgd_fields(levels, signs, s=s, bucket_size=bucket_size)
    scales = np.asarray(scales, np.float32).ravel()
    if scales.size != nb:
        raise ValueError(f"expected {nb} scales, got {scales.size}")
    scale_vals = scales.view(np.uint32).astype(_U64)
    chi, clo, clen = elias.codewords((counts + 1).astype(_U64), code)
    count_vals, count_lens = elias.codeword_items(chi, clo, clen)
    parts_v = [scale_vals, count_vals]
    parts_l = [np.full(nb, 32, np.int64), count_lens]
    if gaps.size:
        ghi, glo, glen = elias.codewords(gaps.astype(_U64), code)
        lhi, llo, llen = elias.codewords(lv.astype(_U64), code)
        sign = sg.astype(_U64)
        rec_len = glen + 1 + llen
        if rec_len.max() <= 64:  # common case: one 64-bit item per record
            shift = (llen + 1).astype(_U64)
            parts_v.append((glo << shift) | (sign << llen.astype(_U64)) | llo)
            parts_l.append(rec_len)
        else:
            m = gaps.size
            vals = np.stack([ghi, glo, sign, lhi, llo], axis=1).ravel()
            lens = np.stack(
                [
                    np.maximum(glen - 64, 0),
                    np.minimum(glen, 64),
                    np.ones(m, np.int64),
                    np.maximum(llen - 64, 0),
                    np.minimum(llen, 64),
                ],
                axis=1,
            ).ravel()
            parts_v.append(vals)
            parts_l.append(lens)
    return elias.pack_items(np.concatenate(parts_v), np.concatenate(parts_l))[0]


def decode_qsgd(data: bytes, *, n: int, s: int, bucket_size: int | None, code: str = "omega"):
    """Decodes ``encode_qsgd``'s message.

    Returns:
      (levels int64 [n], signs bool [n] (False where level is 0), scales float32 [nb]).

    Raises:
      ValueError: truncated, corrupt or oversized message: one longer than
        the longest encoding of ``n`` elements (every element a nonzero with
        the longest gap and level codes) is rejected before it is read, and
        after the bucket counts one longer than their records can take. The
        output arrays are allocated only once the message is valid.

    Example:
      >>> import numpy as np
      >>> levels, signs = np.array([0, 2, 1]), np.array([False, True, False])
      >>> data = encode_qsgd(levels, signs, np.float32([0.5]), s=2, bucket_size=None)
      >>> out = decode_qsgd(data, n=3, s=2, bucket_size=None)
      >>> out[0].tolist(), out[1].tolist(), out[2].tolist()
      ([0, 2, 1], [False, True, False], [0.5])
    """
    elias.check_code(code)
    s = _check_s(s)
    n = V.check_int("n", n, 0, _MAX_N)  # 3.7 is no length
    nb, d = _num_buckets(n, bucket_size)
    s_max = min(s, elias.MAX_VALUE)
    # Each bucket: a 32-bit scale and an Elias(count + 1) of >= 1 bit; then at
    # most n records, none longer than the longest gap, sign and level codes.
    rec_max = elias.max_codeword_bits(code, d) + 1 + elias.max_codeword_bits(code, s)
    head_max = 32 * nb + nb * elias.max_codeword_bits(code, d + 1)
    where = f"(s={s}, bucket_size={bucket_size}, {code})"
    elias.check_size(data, 33 * nb, head_max + n * rec_max, f"n={n} elements {where}")
    reader = elias.BitReader(data)
    scales = np.frombuffer(bytes(data[: 4 * nb]), ">u4").astype(np.uint32).view(np.float32)
    bucket_len = np.minimum(d, n - d * np.arange(nb)) if n else np.zeros(1, np.int64)
    # Counts: a homogeneous chain of codewords, each at most max_len bits.
    base = 32 * nb
    max_count_len = elias.max_codeword_bits(code, d + 1)
    size = min(reader.nbits, base + nb * max_count_len) - base
    lengths = elias.lengths_all(reader, base, base + size, code, d + 1)
    pos, exit_ = elias.follow_chain(elias.chain_next(lengths, size), size, 1)
    if pos.size < nb or (pos.size == nb and exit_ != size):
        raise ValueError("truncated message: bucket counts")
    rec_start = base + (int(pos[nb]) if pos.size > nb else exit_)
    counts = elias.decode_at(reader, pos[:nb] + base, code, d + 1)[0].astype(np.int64) - 1
    if (counts > bucket_len).any():
        raise ValueError("bucket count larger than the bucket")
    total = int(counts.sum())
    elias.check_size(
        data, rec_start + 3 * total, rec_start + total * rec_max, f"{total} nonzeros {where}"
    )
    if total == 0:
        elias.check_padding(reader, rec_start)
        return np.zeros(n, np.int64), np.zeros(n, bool), scales
    # Records: gap code, sign bit, level code; chain over every bit position.
    size = reader.nbits - rec_start
    max_len = max(elias.max_codeword_bits(code, d), 1)
    lengths = elias.lengths_all(reader, rec_start, reader.nbits, code, max(d, s_max))
    idx_t = np.int32 if size + 2 < 2**31 else np.int64
    level_lengths = np.concatenate([lengths.astype(idx_t), np.zeros(1, idx_t)])
    gap_len = level_lengths[:-1].copy()
    if max_len < elias.max_codeword_bits(code, max(d, s_max)):
        gap_len[gap_len > max_len] = 0  # too long for a gap <= d: not a record start
    # The level code starts after the gap code and the sign bit (position size: invalid).
    at = np.arange(1, size + 1, dtype=idx_t)
    at += gap_len
    np.minimum(at, size, out=at)
    level_len = level_lengths[at]
    rec_len = gap_len + 1 + level_len
    rec_len[(gap_len == 0) | (level_len == 0)] = 0
    pos, exit_ = elias.follow_chain(elias.chain_next(rec_len, size), size, 3)
    if pos.size < total:
        raise ValueError(f"truncated message: {pos.size} of {total} nonzeros")
    end = int(pos[total]) if pos.size > total else exit_
    elias.check_padding(reader, rec_start + end)
    pos = pos[:total] + rec_start
    gaps, glen = elias.decode_at(reader, pos, code, d)
    sign_at = pos + glen
    lv, _ = elias.decode_at(reader, sign_at + 1, code, s_max)
    # Positions: cumulative gaps, restarted at every bucket.
    gaps = gaps.astype(np.int64)
    bucket = np.repeat(np.arange(nb), counts)
    csum = np.cumsum(gaps)
    first = np.cumsum(counts) - counts
    restart = np.repeat(np.concatenate([[0], csum])[first], counts)
    local = csum - restart - 1
    if (local >= bucket_len[bucket]).any():
        raise ValueError("nonzero position beyond its bucket")
    idx = bucket * d + local
    # Allocated only now: n comes from the caller, and a corrupt message must
    # raise ValueError, not MemoryError.
    levels = np.zeros(n, np.int64)
    signs = np.zeros(n, bool)
    levels[idx] = lv.astype(np.int64)
    signs[idx] = reader.read(sign_at, 1).astype(bool)
    return levels, signs, scales


def qsgd_bits_bound(n: int, s: int, bucket_size: int | None = None) -> float:
    """QSGD Theorem 3.2's bound on expected bits, summed over buckets, o(1) := 0.

    Per bucket of length d: ``(3 + 1.5 log2(2(s^2+d)/(s(s+sqrt d)))) s(s+sqrt d) + 32``.
    The o(1) term of ``(3/2 + o(1))`` vanishes as n grows; it is taken as 0
    here (the bound reported is the leading-order bound).

    Example:
      >>> # d = 1024, s = 32: (3 + 1.5 * log2(4096 / 2048)) * 32 * 64 + 32
      >>> qsgd_bits_bound(1024, 32)
      9248.0
    """
    s = _check_s(s)
    nb, d = _num_buckets(int(n), bucket_size)
    sizes = [d] * (nb - 1) + [int(n) - d * (nb - 1)] if n else [0]
    total = 0.0
    for size in sizes:
        if size == 0:
            total += 32
            continue
        nnz = s * (s + math.sqrt(size))
        total += (3 + 1.5 * math.log2(2 * (s * s + size) / nnz)) * nnz + 32
    return total


def qsgd_dense_bound(n: int) -> float:
    """The paper's ``2.8 n + 32`` bits at ``s = sqrt(n)`` (Corollary of Theorem 3.2).

    Example:
      >>> round(qsgd_dense_bound(1000), 6)  # 2.8 * 1000 + 32
      2832.0
    """
    return 2.8 * n + 32


def qsgd_paper_bits(n: int, bits: int, bucket_size: int | None = None) -> int:
    """The QSGD paper's section 5 count: ``bits`` per value plus a float32 scale per bucket.

    ``bits * n + 32 * ceil(n / bucket_size)`` (one scale for the whole vector
    when ``bucket_size`` is None; nothing for ``n = 0``). This is the count
    behind the paper's "4-bit sends 77% more than 2-bit (2-bit with bucket
    128, 4-bit with bucket 512) but about 8x less than 32-bit": 4.06 bits per
    value against 2.25 (+81%) and 32 / 4.06 = 7.9x. It is a nominal count, not a
    decodable format: ``b`` bits cannot hold a sign and the ``2^b + 1`` levels
    ``0..s`` of ``s = 2^b``, which ``jaxcomp.qsgd(bits=b)`` packs in ``b + 2``
    bits (``message_bytes``); the Elias-coded size is :func:`qsgd_bits`.

    Args:
      n: number of values (>= 0).
      bits: the paper's "b-bit" (>= 1).
      bucket_size: values per bucket (>= 1), or None: one bucket.

    Raises:
      ValueError: ``n``, ``bits`` or ``bucket_size`` out of range or not an int.

    Example:
      >>> qsgd_paper_bits(512, 4, 512), qsgd_paper_bits(512, 2, 128)  # 4*512 + 32, 2*512 + 4*32
      (2080, 1152)
    """
    n = V.check_int("n", n, 0)
    bits = V.check_int("bits", bits, 1)
    bucket_size = V.check_int("bucket_size", bucket_size, 1, allow_none=True)
    if n == 0:
        return 0
    buckets = 1 if bucket_size is None else -(-n // bucket_size)
    return bits * n + 32 * buckets


def qsvrg_epoch_bits_bound(n: int, epoch_length: int, float_bits: int = 32) -> float:
    """QSGD Theorem 3.6: bits per device per QSVRG epoch, ``(F + 2.8 n)(T + 1) + F n``.

    ``n`` parameters, ``T = epoch_length`` quantized steps at ``s = sqrt(n)``
    (each at most ``F + 2.8 n`` bits, Elias-coded as in Theorem 3.2) and the
    unquantized full gradient (``F n`` bits), ``F = float_bits``; the bound
    as the theorem states it, with its ``T + 1`` messages.

    Example:
      >>> qsvrg_epoch_bits_bound(100, 10)  # (32 + 280) * 11 + 3200
      6632.0
    """
    n = V.check_int("n", n, 1)
    epoch_length = V.check_int("epoch_length", epoch_length, 1)
    float_bits = V.check_int("float_bits", float_bits, 1)
    return (float_bits + 2.8 * n) * (epoch_length + 1) + float(float_bits * n)


def _sparse_inputs(indices, values, n):
    n = V.check_int("n", n, 0)  # 3.7 is no length
    indices = np.asarray(indices)
    if indices.ndim != 1 or (indices.size and indices.dtype.kind not in "iu"):
        raise ValueError("indices must be a 1-D integer array")
    indices = indices.astype(np.int64)
    if indices.size and (indices[0] < 0 or indices[-1] >= n or (np.diff(indices) <= 0).any()):
        raise ValueError(f"indices must be strictly increasing in [0, n={n})")
    if values is not None:
        values = np.asarray(values)
        if values.shape != indices.shape:
            raise ValueError(f"values shape {values.shape} != indices shape {indices.shape}")
        values = values.astype(np.float32, copy=False).view(np.uint32)
    return indices, values, n


def _check_format(format):
    if format not in SPARSE_FORMATS:
        raise ValueError(f"format must be one of {SPARSE_FORMATS}, got {format!r}")


def sparse_bits(indices, n: int, *, format: str = "rle", code: str = "omega") -> int:
    """Exact bits (before padding) of ``encode_sparse`` for these indices.

    Example:
      >>> import numpy as np
      >>> sparse_bits([3, 70000], 80000)  # 32 + (16 + 32) + (16 + 16 + 32)
      144
      >>> len(encode_sparse([3, 70000], np.float32([1.0, 2.0]), 80000)) * 8
      144
    """
    _check_format(format)
    indices, _, n = _sparse_inputs(indices, None, n)
    gaps = np.diff(indices, prepend=-1)
    if format == "rle":
        runs = gaps - 1
        return int(32 + 16 * (runs // _RUN_MAX + 1).sum() + 32 * indices.size)
    return int(
        elias.codeword_lengths([indices.size + 1], code).sum()
        + elias.codeword_lengths(gaps, code).sum()
        + 32 * indices.size
    )


def encode_sparse(indices, values, n: int, *, format: str = "rle", code: str = "omega") -> bytes:
    """Encodes a sparse vector (strictly increasing indices, float32 values).

    Args:
      indices: 1-D int array, strictly increasing, in [0, n).
      values: float32 array like ``indices`` (bits kept exactly).
      n: dense length.
      format: ``"rle"`` (16-bit zero runs, 32-bit values) or ``"elias"``.
      code: Elias code for ``format="elias"``.

    Example:
      >>> import numpy as np
      >>> data = encode_sparse([3, 70000], np.float32([1.0, -2.0]), 80000)
      >>> len(data)  # 32 + (16 + 32) + (16 + 16 + 32) bits
      18
    """
    _check_format(format)
    indices, bits, n = _sparse_inputs(indices, values, n)
    gaps = np.diff(indices, prepend=-1)
    if format == "rle":
        runs = gaps - 1
        full = runs // _RUN_MAX
        units_per = full + 3
        units = np.full(int(units_per.sum()), _RUN_MAX, ">u2")
        end = np.cumsum(units_per)
        units[end - 3] = runs % _RUN_MAX
        units[end - 2] = bits >> 16
        units[end - 1] = bits & 0xFFFF
        return struct.pack(">I", indices.size) + units.tobytes()
    elias.check_code(code)
    hi, lo, length = elias.codewords(np.concatenate([[indices.size + 1], gaps]).astype(_U64), code)
    bits = np.concatenate([[0], bits]).astype(_U64)
    vals = np.stack([hi, lo, bits], axis=1).ravel()
    lens = np.stack(
        [np.maximum(length - 64, 0), np.minimum(length, 64), np.full(length.size, 32, np.int64)],
        axis=1,
    ).ravel()
    lens[2] = 0  # no value after the count
    return elias.pack_items(vals, lens)[0]


def decode_sparse(data: bytes, n: int, *, format: str = "rle", code: str = "omega"):
    """Decodes ``encode_sparse``'s message into (indices int64, values float32).

    Raises:
      ValueError: truncated, corrupt or oversized message, indices out of [0, n).
        A message longer than the longest encoding of its header's count of
        values among ``n`` (of ``n`` values, before the header is read) is
        rejected without being read.

    Example:
      >>> import numpy as np
      >>> data = encode_sparse([1, 3], np.float32([0.5, -1.0]), 8)
      >>> indices, values = decode_sparse(data, 8)
      >>> indices.tolist(), values.tolist()
      ([1, 3], [0.5, -1.0])
    """
    _check_format(format)
    n = V.check_int("n", n, 0, _MAX_N)  # 3.7 is no length
    if format == "rle":
        if elias.check_size(data, 32, 32 + 48 * n, f"n={n} values (rle)") % 2:
            raise ValueError("rle message must be a 32-bit count and 16-bit units")
        count = struct.unpack(">I", bytes(data[:4]))[0]
        if count > n:
            raise ValueError(f"rle count {count} > n={n}")
        # Each value: its 32 bits and a short token, plus the full tokens of
        # runs that add up to at most n - count zeros.
        max_units = 3 * count + (n - count) // _RUN_MAX
        elias.check_size(
            data, 32 + 48 * count, 32 + 16 * max_units, f"count={count} values among n={n} (rle)"
        )
        units = np.frombuffer(bytes(data[4:]), ">u2").astype(np.int64)
        size = units.size
        nxt = np.empty(size + 2, np.int64)
        nxt[:size] = np.minimum(np.arange(size) + np.where(units == _RUN_MAX, 1, 3), size + 1)
        nxt[size], nxt[size + 1] = size, size + 1
        pos, exit_ = elias.follow_chain(nxt, size, 1)
        if exit_ != size:
            raise ValueError("truncated rle message")
        is_run_end = units[pos] != _RUN_MAX
        ends = pos[is_run_end]
        if ends.size != count or (pos.size and not is_run_end[-1]):
            raise ValueError(f"rle message holds {ends.size} values and runs, expected {count}")
        # Zeros so far: 65535 per full token; each value's run ends at a short token.
        zeros = np.where(is_run_end, units[pos], _RUN_MAX)
        indices = np.cumsum(zeros)[is_run_end] + np.arange(count)
        if count and indices[-1] >= n:
            raise ValueError(f"index {indices[-1]} out of range for n={n}")
        bits = ((units[ends + 1] << 16) | units[ends + 2]).astype(np.uint32)
        return indices, bits.view(np.float32)
    elias.check_code(code)
    # Elias(count + 1), then per value an Elias(gap <= n) and 32 bits.
    value_max = elias.max_codeword_bits(code, max(n, 1)) + 32
    head_max = elias.max_codeword_bits(code, n + 1)
    elias.check_size(data, 1, head_max + n * value_max, f"n={n} values ({code})")
    reader = elias.BitReader(data)
    count_value, head = elias.decode_at(reader, np.zeros(1, np.int64), code, n + 1)
    count, head = int(count_value[0]) - 1, int(head[0])
    elias.check_size(
        data, head + 33 * count, head + count * value_max, f"count={count} values among n={n}"
    )
    size = reader.nbits - head
    if count == 0:
        elias.check_padding(reader, head)
        return np.zeros(0, np.int64), np.zeros(0, np.float32)
    lengths = elias.lengths_all(reader, head, reader.nbits, code, max(n, 1)).astype(np.int64)
    steps = np.where(lengths > 0, lengths + 32, 0)
    pos, exit_ = elias.follow_chain(elias.chain_next(steps, size), size, 1)
    if pos.size < count:
        raise ValueError(f"truncated message: {pos.size} of {count} values")
    pos = pos[:count] + head
    gaps, glen = elias.decode_at(reader, pos, code, max(n, 1))
    elias.check_padding(reader, int(pos[-1] + glen[-1] + 32))
    indices = np.cumsum(gaps.astype(np.int64)) - 1
    if indices[-1] >= n:
        raise ValueError(f"index {indices[-1]} out of range for n={n}")
    bits = reader.read(pos + glen, 32).astype(np.uint32)
    return indices, bits.view(np.float32)
