"""Elias gamma, delta and omega codes of positive integers, vectorised with numpy.

Bit order: a message is a string of bits written most significant bit first
into bytes (``np.packbits``' default "big" bit order). The last byte is padded
with bits that cannot complete a codeword, so that asking ``elias_decode`` for
more values than a stream holds raises instead of decoding the padding: zeros
for gamma and delta (their codewords contain a 1), ones for omega (an omega
codeword ends with a 0, and omega(1) is a single 0 bit, so zero padding
would read as 1s). Codewords (textbook definitions, k >= 1):

* gamma(k): ``bitlen(k) - 1`` zeros, then k in binary. gamma(5) = 00101.
* delta(k): gamma(bitlen(k)), then k in binary without its leading 1.
  delta(5) = 01101.
* omega(k) (Elias' recursive code, used by QSGD): k in binary, prefixed
  recursively by the code of ``bitlen - 1`` while that is > 1, then a final 0.
  omega(1) = 0, omega(2) = 100, omega(5) = 101010, omega(16) = 10100100000.

Encoding and decoding work on whole arrays: a codeword is built as a 128-bit
(hi, lo) pair by a loop over recursion depth, never over values. Decoding a
stream of variable-length codes is inherently sequential; it is vectorised by
computing the code length at every bit position (a lookup table on 20-bit
windows) and then following the chain of codeword starts with
self-synchronising lanes (see ``follow_chain``).

Example:

>>> import numpy as np
>>> from jaxcomp.coding import elias_encode, elias_decode
>>> data = elias_encode(np.array([1, 5, 2**40]), code="omega")
>>> elias_decode(data, 3, code="omega").tolist()
[1, 5, 1099511627776]
"""

from __future__ import annotations

import functools

import numpy as np

from jaxcomp import _validation as V

__all__ = [
    "CODES",
    "MAX_VALUE",
    "BitReader",
    "check_size",
    "codeword_lengths",
    "elias_bits",
    "elias_decode",
    "elias_encode",
    "follow_chain",
    "max_codeword_bits",
    "pack_items",
]

# The Elias codes implemented (the ``code`` argument).
CODES = ("gamma", "delta", "omega")
_U64 = np.uint64
_WINDOW = 20  # bits per lookup-table window when decoding
_TABLE_VALUES = 1 << 16  # encode lookup table covers values below this
MAX_VALUE = 2**64 - 1  # values are uint64


def check_code(code: str) -> None:
    if code not in CODES:
        raise ValueError(f"code must be one of {CODES}, got {code!r}")


def _shl(v, s):
    """``v << s`` for uint64 with s outside [0, 63] giving 0 (numpy wraps shifts)."""
    s = np.asarray(s, np.int64)
    ok = (s >= 0) & (s < 64)
    return np.where(ok, v << np.clip(s, 0, 63).astype(_U64), _U64(0))


def _shr(v, s):
    """``v >> s`` for uint64 with s outside [0, 63] giving 0."""
    s = np.asarray(s, np.int64)
    ok = (s >= 0) & (s < 64)
    return np.where(ok, v >> np.clip(s, 0, 63).astype(_U64), _U64(0))


def _bitlen(v) -> np.ndarray:
    """Exact bit length of uint64 values (0 -> 0), via two exact float32-halves."""
    v = np.asarray(v, _U64)
    hi = (v >> _U64(32)).astype(np.float64)
    lo = (v & _U64(0xFFFFFFFF)).astype(np.float64)
    bl_hi = np.frexp(hi)[1].astype(np.int64)
    bl_lo = np.frexp(lo)[1].astype(np.int64)
    return np.where(hi > 0, 32 + bl_hi, bl_lo)


def _python_ints_as_uint64(values, name: str) -> np.ndarray | None:
    """Python integers as uint64, exactly; None if ``values`` holds anything else.

    numpy reads a list mixing ints below 2**63 with ints from 2**63 up as
    float64 (rounding them) or object: read the ints themselves instead.
    """
    if isinstance(values, np.ndarray):
        return None
    try:
        objects = np.asarray(values, dtype=object).ravel()
    except ValueError:  # ragged
        return None
    if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in objects):
        return None
    low, high = min(int(x) for x in objects), max(int(x) for x in objects)
    if low < 1 or high >= 2**64:
        raise ValueError(
            f"{name} must be integers in [1, 2**64 - 1] (uint64), got "
            f"{'minimum ' + str(low) if low < 1 else 'maximum ' + str(high)}"
        )
    return np.array([int(x) for x in objects], dtype=_U64)


def _as_positive_uint64(values, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.dtype.kind in "fO" and arr.size:
        exact = _python_ints_as_uint64(values, name)
        if exact is not None:
            return exact
    if arr.dtype.kind not in "iu":
        if arr.size == 0:
            return np.zeros(0, _U64)
        raise ValueError(f"{name} must be integers, got dtype {arr.dtype}")
    arr = arr.ravel()
    if arr.dtype.kind == "i" and arr.size and arr.min() < 1:
        raise ValueError(f"{name} must be >= 1, got minimum {arr.min()}")
    arr = arr.astype(_U64)
    if arr.size and arr.min() == 0:
        raise ValueError(f"{name} must be >= 1, got a 0")
    return arr


def _codewords_generic(v: np.ndarray, code: str):
    """(hi, lo, length) of each codeword, right-aligned in 128 bits."""
    n = _bitlen(v)
    zero = np.zeros_like(v)
    if code == "gamma":
        return zero, v, 2 * n - 1
    if code == "delta":
        m = _bitlen(n.astype(_U64))
        low = v ^ _shl(_U64(1), n - 1)
        nn = n.astype(_U64)
        hi = _shr(nn, 65 - n)  # gamma(n) sits above the n-1 low bits
        lo = _shl(nn, n - 1) | low
        return hi, lo, 2 * m - 1 + n - 1
    hi, lo = zero.copy(), zero.copy()
    length = np.ones(v.shape, np.int64)  # the final 0
    group = v.copy()
    active = group > 1
    while active.any():  # recursion depth <= 4 for 64-bit values
        bl = _bitlen(group)
        s = length
        g = np.where(active, group, _U64(0))
        lo |= _shl(g, s)
        hi |= np.where(s >= 64, _shl(g, s - 64), _shr(g, 64 - s))
        length = np.where(active, length + bl, length)
        group = np.where(active, (bl - 1).astype(_U64), _U64(1))
        active = group > 1
    return hi, lo, length


@functools.cache
def _encode_table(code: str):
    v = np.arange(1, _TABLE_VALUES, dtype=_U64)
    _, lo, length = _codewords_generic(v, code)
    return np.concatenate([[0], lo]).astype(_U64), np.concatenate([[0], length])


def codewords(values: np.ndarray, code: str):
    """(hi, lo, length) for uint64 values >= 1 (table for small values)."""
    v = np.asarray(values, _U64)
    if v.size and v.max() < _TABLE_VALUES:
        tab_code, tab_len = _encode_table(code)
        idx = v.astype(np.intp)
        return np.zeros_like(v), tab_code[idx], tab_len[idx]
    return _codewords_generic(v, code)


def codeword_lengths(values, code: str = "omega") -> np.ndarray:
    """Length in bits of the codeword of each value (values >= 1).

    Example:
      >>> codeword_lengths([1, 2, 5, 16], "omega").tolist()
      [1, 3, 6, 11]
    """
    check_code(code)
    v = _as_positive_uint64(values, "values")
    return codewords(v, code)[2]


def elias_bits(values, code: str = "omega") -> int:
    """Exact number of bits (without padding) of ``elias_encode(values, code)``.

    Example:
      >>> elias_bits([1, 5], "gamma")  # gamma: 1 and 00101
      6
      >>> -(-elias_bits([1, 5, 9], "delta") // 8) == len(elias_encode([1, 5, 9], "delta"))
      True
    """
    return int(codeword_lengths(values, code).sum())


def pack_items(values: np.ndarray, lengths: np.ndarray) -> tuple[bytes, int]:
    """Concatenates right-aligned items of <= 64 bits, MSB first, zero padded.

    Items never overlap, so the 64-bit words they fall into are OR-reduced over
    contiguous runs (``np.bitwise_or.reduceat``); an item crossing a word
    boundary adds its tail to the next word, and at most one item crosses each
    boundary, so that scatter has unique indices.

    Returns:
      (bytes, number of bits before padding).

    Example:
      >>> import numpy as np
      >>> data, nbits = pack_items(np.array([0b101, 0b1], np.uint64), np.array([3, 2]))
      >>> f"{data[0]:08b}", nbits  # 101 then 01, zero padded
      ('10101000', 5)
    """
    lengths = np.asarray(lengths, np.int64)
    keep = lengths > 0
    if not keep.all():
        values, lengths = values[keep], lengths[keep]
    total = int(lengths.sum())
    if total == 0:
        return b"", 0
    offsets = np.cumsum(lengths) - lengths
    word = offsets >> 6
    end = (offsets & 63) + lengths  # in (0, 127]
    # Left-align within the word; an item crossing into the next word keeps its head.
    left = np.clip(64 - end, 0, 63).astype(_U64)
    right = np.clip(end - 64, 0, 63).astype(_U64)
    head = (values << left) >> right
    out = np.zeros((total + 63) // 64 + 1, _U64)
    starts = np.flatnonzero(np.diff(word, prepend=-1))
    out[word[starts]] = np.bitwise_or.reduceat(head, starts)
    cross = np.flatnonzero(end > 64)
    if cross.size:
        out[word[cross] + 1] |= _shl(values[cross], 128 - end[cross])
    return out.astype(">u8").tobytes()[: (total + 7) // 8], total


def codeword_items(hi, lo, length):
    """Splits 128-bit codewords into (values, lengths) pairs of <= 64 bits, in order."""
    n = length.size
    vals = np.empty(2 * n, _U64)
    lens = np.empty(2 * n, np.int64)
    vals[0::2], vals[1::2] = hi, lo
    lens[0::2], lens[1::2] = np.maximum(length - 64, 0), np.minimum(length, 64)
    return vals, lens


def elias_encode(values, code: str = "omega") -> bytes:
    """Encodes positive integers (uint64 >= 1) back to back into packed bytes.

    Args:
      values: integer array-like, every entry >= 1 (uint64 range).
      code: ``"gamma"``, ``"delta"`` or ``"omega"``.

    Returns:
      The codewords concatenated MSB first, padded to a whole byte with zero
      bits (gamma, delta) or one bits (omega): bits that cannot complete a
      codeword, so the padding never decodes as values.

    Example:
      >>> elias_encode([5], "gamma").hex()  # 00101 + 000 padding
      '28'
      >>> elias_encode([5], "omega").hex()  # 101010 + 11 padding
      'ab'
    """
    check_code(code)
    v = _as_positive_uint64(values, "values")
    hi, lo, length = codewords(v, code)
    data, total = pack_items(*codeword_items(hi, lo, length))
    pad = -total % 8
    if code == "omega" and pad:
        data = data[:-1] + bytes([data[-1] | ((1 << pad) - 1)])
    return data


class BitReader:
    """Random access to the bits of a message (MSB first within bytes).

    Example:
      >>> import numpy as np
      >>> reader = BitReader(bytes([0b10110000]))
      >>> reader.read(np.array([0, 1]), 3).tolist()  # bits 101 and 011
      [5, 3]
    """

    def __init__(self, data: bytes):
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"data must be bytes, got {type(data).__name__}")
        self.nbytes = len(data)
        self.nbits = 8 * self.nbytes
        self.bytes = np.concatenate([np.frombuffer(bytes(data), np.uint8), np.zeros(24, np.uint8)])
        buf = self.bytes
        # Unaligned big-endian views: element i holds the bytes starting at byte i.
        self._u64 = np.ndarray((buf.size - 8,), ">u8", buf, 0, (1,))
        self._u32 = np.ndarray((buf.size - 4,), ">u4", buf, 0, (1,))

    def read(self, pos, k) -> np.ndarray:
        """Values of the ``k`` (0..64) bits starting at bit ``pos`` (beyond end: zeros)."""
        pos = np.minimum(np.asarray(pos, np.int64), self.nbits)
        byte = pos >> 3
        r = (pos & 7).astype(_U64)
        w = (self._u64[byte].astype(_U64) << r) | (
            self.bytes[byte + 8].astype(_U64) >> (_U64(8) - r)
        )
        return _shr(w, 64 - np.asarray(k, np.int64))

    def windows(self, lo: int, hi: int) -> np.ndarray:
        """The ``_WINDOW``-bit window starting at every bit position in [lo, hi)."""
        b0, b1 = lo >> 3, (hi + 7) >> 3
        u = self._u32[b0:b1].astype(np.uint32)
        shifts = np.arange(32 - _WINDOW, 32 - _WINDOW - 8, -1, dtype=np.uint32)
        w = ((u[:, None] >> shifts) & np.uint32((1 << _WINDOW) - 1)).ravel()
        return w[lo - 8 * b0 : hi - 8 * b0]


@functools.cache
def _decode_table(code: str):
    """Length and value of the codeword at the top of each window (0: not within it)."""
    v = np.arange(1, _TABLE_VALUES, dtype=_U64)
    _, lo, length = _codewords_generic(v, code)
    fit = length <= _WINDOW
    lo, length, v = lo[fit], length[fit], v[fit]
    start = lo << (_WINDOW - length).astype(_U64)
    size = np.int64(1) << (_WINDOW - length)
    idx = np.repeat(start.astype(np.int64) - np.cumsum(size) + size, size) + np.arange(size.sum())
    tab_len = np.zeros(1 << _WINDOW, np.uint8)
    tab_val = np.zeros(1 << _WINDOW, np.uint32)
    tab_len[idx] = np.repeat(length, size)
    tab_val[idx] = np.repeat(v, size)
    return tab_len, tab_val, int(v.max())


def max_codeword_bits(code: str, max_value: int) -> int:
    """Bits of the longest codeword of a value in ``[1, max_value]`` (capped at uint64).

    Codeword lengths never decrease with the value, so this is the length of
    ``max_value``'s codeword, computed on Python ints (decoders call it per message).

    Example:
      >>> max_codeword_bits("gamma", 5), max_codeword_bits("omega", 2**70)
      (5, 76)
    """
    v = min(int(max_value), MAX_VALUE)
    if v <= 1:
        return 1
    bits = v.bit_length()
    if code == "gamma":
        return 2 * bits - 1
    if code == "delta":
        return 2 * bits.bit_length() - 1 + bits - 1
    length = 1  # omega: the final 0, then each group of the recursion
    while v > 1:
        bits = v.bit_length()
        length += bits
        v = bits - 1
    return length


def check_size(data, min_bits: int, max_bits: int, what: str) -> int:
    """``len(data)`` in bytes, checked against the bits ``what`` takes (O(1)).

    Decoders call this before any work proportional to the input or to a size
    read from the arguments or a header: a message longer than the longest
    encoding of what it declares is rejected without reading it, so decoding
    time is bounded by the declared sizes, never by the bytes given.

    Args:
      data: the message (bytes-like; anything else raises ``ValueError``).
      min_bits: fewest bits ``what`` can take; the message has at least
        ``ceil(min_bits / 8)`` bytes.
      max_bits: most bits it can take, padding excluded: at most
        ``ceil(max_bits / 8)`` bytes.
      what: what the message declares, for the error message.

    Raises:
      ValueError: ``data`` is not bytes, or its length is outside the bounds.

    Example:
      >>> check_size(bytes(3), 9, 24, "3 bytes")
      3
      >>> check_size(bytes(4), 9, 24, "3 bytes")
      Traceback (most recent call last):
      ...
      ValueError: oversized message: data is 4 bytes, more than the 3 that 3 bytes can take
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"data must be bytes, got {type(data).__name__}")
    nbytes = len(data)
    lo, hi = -(-min_bits // 8), -(-max_bits // 8)
    if nbytes < lo:
        raise ValueError(
            f"truncated message: data is {nbytes} bytes, fewer than the {lo} that {what} take"
        )
    if nbytes > hi:
        raise ValueError(
            f"oversized message: data is {nbytes} bytes, more than the {hi} that {what} can take"
        )
    return nbytes


def _decode_generic(reader: BitReader, pos: np.ndarray, code: str, max_value: int):
    """(values, lengths) of codewords at ``pos``; length 0 where invalid."""
    pos = np.asarray(pos, np.int64)
    if code in ("gamma", "delta"):
        w = reader.read(pos, 64)
        zeros = 64 - _bitlen(w)
        n = zeros + 1
        ok = (w != 0) & (n <= 64)
        value = reader.read(pos + zeros, np.where(ok, n, 0))
        length = 2 * n - 1
        if code == "delta":
            nn = value.astype(np.int64)
            ok &= (nn >= 1) & (nn <= 64)
            nn = np.where(ok, nn, 1)
            low = reader.read(pos + length, nn - 1)
            value = _shl(_U64(1), nn - 1) | low
            length = length + nn - 1
    else:
        value = np.ones(pos.shape, _U64)
        p = pos.copy()
        done = np.zeros(pos.shape, bool)
        ok = np.ones(pos.shape, bool)
        for _ in range(5):  # 4 groups suffice for 64-bit values, then the final 0
            more = ~done & ok & (reader.read(p, 1) == 1)
            done |= ~more & ok
            k = value.astype(np.int64) + 1
            ok &= ~more | (k <= 64)
            step = more & ok
            value = np.where(step, reader.read(p, np.where(step, k, 0)), value)
            p = np.where(step, p + k, p)
        ok &= done
        length = p + 1 - pos
    ok &= (length + pos <= reader.nbits) & (value <= _U64(max_value))
    return value, np.where(ok, length, 0)


def lengths_all(reader: BitReader, lo: int, hi: int, code: str, max_value: int):
    """Codeword length (0 = invalid or above max_value) at every bit position in [lo, hi).

    Returns uint8 lengths (int64 when codes can exceed the table window).
    Codes running past the end of the message are invalid.
    """
    tab_len, tab_val, tab_max = _decode_table(code)
    w = reader.windows(lo, hi)
    lengths = tab_len[w]
    if max_value < tab_max:
        lengths[tab_val[w] > max_value] = 0
    if max_codeword_bits(code, max_value) > _WINDOW:
        far = np.flatnonzero(lengths == 0)
        _, glen = _decode_generic(reader, far + lo, code, max_value)
        lengths = lengths.astype(np.int64)
        lengths[far] = glen
    tail = max(hi - lo - 200, 0)  # only the last positions can run past the end
    over = np.arange(lo + tail, hi) + lengths[tail:] > reader.nbits
    lengths[tail:][over] = 0
    return lengths


def decode_at(reader: BitReader, pos: np.ndarray, code: str, max_value: int):
    """(values uint64, lengths) of the codewords at ``pos``; ValueError if any is invalid."""
    pos = np.asarray(pos, np.int64)
    tab_len, tab_val, _ = _decode_table(code)
    if pos.size == 0:
        return np.zeros(0, _U64), np.zeros(0, np.int64)
    r = pos & 7
    u = reader._u32[pos >> 3].astype(np.uint32)
    w = (u >> (32 - _WINDOW - r).astype(np.uint32)) & np.uint32((1 << _WINDOW) - 1)
    length = tab_len[w].astype(np.int64)
    value = tab_val[w].astype(_U64)
    far = np.flatnonzero(length == 0)
    if far.size:
        value[far], length[far] = _decode_generic(reader, pos[far], code, max_value)
    if (
        (length == 0).any()
        or (value > _U64(max_value)).any()
        or ((pos + length).max() > reader.nbits)
    ):
        raise ValueError(f"invalid or out-of-range Elias {code} codeword in message")
    return value, length


def follow_chain(nxt: np.ndarray, size: int, min_step: int):
    """Positions reached from 0 by ``p -> nxt[p]`` while ``p < size``, and the exit.

    ``nxt`` has ``size + 2`` entries, ``nxt[p] > p`` for ``p < size``; ``size``
    (exact end) and ``size + 1`` (overrun or invalid codeword) are absorbing.
    The chain is sequential, so it is followed by many lanes at once: lane j
    starts at bit ``j * W`` and walks ``K`` steps (covering >= 2W bits). A
    prefix code resynchronises quickly, so lanes j and j+1 meet at a common
    position; from there both follow the true chain. Lane 0 starts on the true
    chain, so the true chain is lane j's path between successive meeting
    points. Meetings are verified exactly; if some lane does not meet its
    successor within its walk (adversarial input), a sequential walk is used.

    Returns:
      (positions ascending, exit position: ``size`` or ``size + 1``).

    Example:
      >>> import numpy as np
      >>> nxt = np.array([2, 3, 4, 5, 5, 5, 6])  # size 5: 0 -> 2 -> 4 -> 5 (exact end)
      >>> positions, end = follow_chain(nxt, 5, min_step=1)
      >>> positions.tolist(), int(end)
      ([0, 2, 4], 5)
    """
    if size == 0:
        return np.zeros(0, np.int64), int(nxt[0])
    idx_t = np.int32 if size + 2 < 2**31 else np.int64
    nxt = nxt.astype(idx_t, copy=False)
    width = 64 * min_step
    steps = 129
    starts = np.arange(0, size, width, dtype=idx_t)
    lanes = starts.size
    path = np.empty((steps + 1, lanes), idx_t)
    path[0] = starts
    for k in range(steps):
        path[k + 1] = nxt[path[k]]
    meet = np.full(lanes - 1, size, np.int64)
    found = np.zeros(lanes - 1, bool)
    if lanes > 1:
        mark = np.full(size + 2, -1, np.int32)
        lane_ids = np.arange(lanes, dtype=np.int32)
        for cls in range(4):  # lanes 4 apart rarely overlap; overlap only hides a meeting
            succ = lane_ids[1:][lane_ids[1:] % 4 == cls]
            if succ.size == 0:
                continue
            sub = path[:, succ]
            mark[sub] = succ[None, :]
            mark[size:] = -1
            hit = mark[path[:, succ - 1]] == succ[None, :]
            first = hit.argmax(axis=0)
            any_hit = hit.any(axis=0)
            found[succ - 1] = any_hit
            meet[succ - 1] = np.where(any_hit, path[first, succ - 1], size)
            mark[sub] = -1
        absorbed = path[-1, :-1] >= size
        bad = ~found & ~absorbed
        if bad.any():
            return _walk(nxt, size)
    x = np.maximum.accumulate(np.concatenate([[0], meet]))  # lane j is true from x[j]
    x_next = np.concatenate([x[1:], [size]])
    live = x < size
    if (path[-1][live] < x_next[live]).any():
        return _walk(nxt, size)
    mask = (path >= x[None, :]) & (path < x_next[None, :])
    positions = path.T[mask.T].astype(np.int64)
    last_lane = np.flatnonzero(live)[-1]
    return positions, int(path[-1, last_lane])


def _walk(nxt: np.ndarray, size: int):
    """Sequential fallback for inputs on which the lanes do not synchronise."""
    nxt_list = nxt.tolist()
    out = []
    p = 0
    while p < size:
        out.append(p)
        p = nxt_list[p]
    return np.asarray(out, np.int64), p


def chain_next(steps: np.ndarray, size: int) -> np.ndarray:
    """``nxt`` for ``follow_chain`` from per-position record lengths (0 = invalid).

    An invalid position steps by one bit: speculative lanes keep walking and
    resynchronise; callers validate every record on the true chain.
    """
    idx_t = np.int32 if size + 2 < 2**31 else np.int64
    nxt = np.empty(size + 2, idx_t)
    np.add(np.arange(size, dtype=idx_t), np.maximum(steps, 1), out=nxt[:size], dtype=idx_t)
    np.minimum(nxt[:size], size + 1, out=nxt[:size])
    nxt[size], nxt[size + 1] = size, size + 1
    return nxt


def elias_decode(data: bytes, count: int, code: str = "omega", *, max_value: int = 2**64 - 1):
    """Decodes exactly ``count`` codewords written by ``elias_encode``.

    Args:
      data: the message.
      count: number of values. Asking for more values than the stream holds
        raises ``ValueError`` (the padding cannot complete a codeword).
      code: ``"gamma"``, ``"delta"`` or ``"omega"``.
      max_value: values above this are rejected as corrupt.

    Returns:
      uint64 array of ``count`` values.

    Raises:
      ValueError: truncated or corrupt message (fewer than ``count`` values),
        wrong padding (not all zeros for gamma/delta, not all ones for omega)
        or trailing bytes; ``count`` or ``max_value`` not an integer in range.
        A message longer than ``count`` codewords of at most ``max_value``
        can be (``count * max_codeword_bits(code, max_value)`` bits, rounded
        up to a byte) is rejected before it is read.

    Example:
      >>> elias_decode(elias_encode([1, 5, 9], "delta"), 3, "delta").tolist()
      [1, 5, 9]
    """
    check_code(code)
    count = V.check_int("count", count, 0)
    max_value = V.check_int("max_value", max_value, 1, MAX_VALUE)
    longest = max_codeword_bits(code, max_value)
    check_size(
        data,
        count,
        count * longest,
        f"count={count} {code} codewords of values <= max_value={max_value}",
    )
    if count == 0:
        return np.zeros(0, _U64)
    reader = BitReader(data)
    size = reader.nbits
    lengths = lengths_all(reader, 0, size, code, max_value)
    positions, exit_ = follow_chain(chain_next(lengths, size), size, 1)
    if positions.size < count:
        raise ValueError(f"truncated message: {positions.size} of {count} codewords")
    end = int(positions[count]) if positions.size > count else exit_
    check_padding(reader, end, ones=code == "omega")
    return decode_at(reader, positions[:count], code, max_value)[0]


def check_padding(reader: BitReader, end: int, *, ones: bool = False) -> None:
    """The message must end within 7 padding bits after bit ``end``, all 0 (or all 1)."""
    if end > reader.nbits:
        raise ValueError("truncated message: last codeword runs past the end")
    pad = reader.nbits - end
    if pad > 7:
        raise ValueError(f"{pad} trailing bits after the message (at most 7 of padding)")
    if pad and reader.read(end, pad)[()] != ((1 << pad) - 1 if ones else 0):
        raise ValueError(f"padding bits must all be {int(ones)}")
