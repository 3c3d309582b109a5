"""The packed buffer of many segments and its one-pass kernels.

:mod:`jaxcomp.selection.segmented` selects for many tensors (*segments*) at
once. They are packed into one 2-D buffer of rows of :data:`ROW` elements,
each segment starting on a row of its own and padded with zeros to whole
rows (:class:`SegmentLayout`: where each segment lives, packing and
unpacking, per-row and per-segment reductions). The kernels here make one
pass over that buffer for every segment at once: counts against a threshold
per segment (:func:`count_above`, several candidates per pass with
:func:`count_above_many`), the maximum (:func:`segment_max`), the exact
``k``-th largest magnitude by a search on float32 bit patterns
(:func:`kth_largest_above`), the moments (:func:`moments`) and strided
samples (:func:`strided_layout`, :func:`strided_samples`). The capacity cut
(:func:`capacity_cut`, :func:`sent_mask`) and the message extraction
(:func:`extract`, :func:`compact`, :func:`expand`) work on the same buffer.

A segment's result depends on its own elements only: each row holds one
segment, the per-row reductions see one segment's elements, and the
row-to-segment sums run in row order, so a tensor packed with a hundred
others gets the bits it gets alone. For the same reason products that a
later add could contract into a fused multiply-add are rounded on their own
(:func:`rounded_product`). Padding zeros never pass a threshold (``|0| > t``
is false for ``t >= 0``) and never raise a maximum; sums that padding would
change (the moments) mask it out. :class:`Targets` holds the per-segment
target counts (a static table and a traced phase), :class:`SegmentSelection`
what a segmented selector returns.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._vma import varying_like

__all__ = [
    "ROW",
    "SegmentLayout",
    "SegmentSelection",
    "Targets",
    "capacity_cut",
]

# Row width: a segment is padded to whole rows (at most ROW - 1 zeros each);
# 256 keeps a ResNet-20's padding near 5% (65 leaves, many of 16-64
# elements), and counts over rows of 256 run as fast as flat ones on XLA:CPU.
ROW = 256


@dataclasses.dataclass(frozen=True, eq=False)
class SegmentLayout:
    """Where each segment lives in the packed ``(num_rows, ROW)`` buffer.

    Attributes:
      sizes: elements per segment.
      row: the row width.

    Example:
      >>> import jax.numpy as jnp
      >>> layout = SegmentLayout((3, 5), row=4)  # rows: [a a a .] [b b b b] [b . . .]
      >>> buf = layout.pack([jnp.arange(1.0, 4.0), jnp.arange(10.0, 15.0)], jnp.float32)
      >>> buf.shape, layout.row_segment.tolist()
      ((3, 4), [0, 1, 1])
      >>> [p.tolist() for p in layout.unpack(buf)]
      [[1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0, 14.0]]
    """

    sizes: tuple[int, ...]
    row: int = ROW

    @functools.cached_property
    def rows(self) -> np.ndarray:
        """Rows per segment (0 for an empty one)."""
        return np.asarray([-(-n // self.row) for n in self.sizes], np.int64)

    @functools.cached_property
    def starts(self) -> np.ndarray:
        """First row of each segment."""
        return np.concatenate([[0], np.cumsum(self.rows)[:-1]]).astype(np.int64)

    @property
    def num_rows(self) -> int:
        return int(self.rows.sum())

    @property
    def num_segments(self) -> int:
        return len(self.sizes)

    @functools.cached_property
    def row_segment(self) -> np.ndarray:
        """The segment of each row (int32)."""
        return np.repeat(np.arange(len(self.sizes), dtype=np.int32), self.rows)

    @functools.cached_property
    def row_offset(self) -> np.ndarray:
        """Flat index, within its segment, of each row's first element (int32)."""
        off = np.arange(self.num_rows, dtype=np.int64) - self.starts[self.row_segment]
        return (off * self.row).astype(np.int32)

    def pack(self, parts: Sequence[jax.Array], dtype) -> jax.Array:
        """The ``(num_rows, row)`` buffer of the 1-D ``parts`` (one per segment).

        One concatenation of rows: each part's full rows (a reshape) and its
        last row padded with zeros. A copy XLA fuses into one kernel; a
        gather of the concatenated parts into the padded rows (the earlier
        form) took 4x as long on ResNet-20's tree and 1.7x on ResNet-50's.
        """
        if self.num_rows == 0:
            return jnp.zeros((0, self.row), dtype)
        rows = []
        for p, n in zip(parts, self.sizes, strict=True):
            flat = jnp.ravel(p).astype(dtype)
            full, tail = divmod(n, self.row)
            if full:
                rows.append(flat[: full * self.row].reshape(full, self.row))
            if tail:
                rows.append(jnp.pad(flat[full * self.row :], (0, self.row - tail))[None])
        return rows[0] if len(rows) == 1 else jnp.concatenate(rows)

    def unpack(self, buf: jax.Array, rows: Sequence[jax.Array] | None = None) -> list[jax.Array]:
        """The 1-D segments of a packed buffer (the padding dropped).

        ``rows``: :meth:`runtime_rows`, to slice each segment's rows out at a
        row the compiler does not see (the same elements).
        """
        if rows is not None:
            zero = jnp.zeros((), jnp.int32)
            spans = zip(rows, self.rows, self.sizes, strict=True)
            return [
                lax.dynamic_slice(buf, (r, zero), (int(m), self.row)).reshape(-1)[:n]
                for r, m, n in spans
            ]
        flat = buf.reshape(-1)
        return [
            flat[int(s) * self.row : int(s) * self.row + n]
            for s, n in zip(self.starts, self.sizes, strict=True)
        ]

    def runtime_rows(self, like: jax.Array) -> tuple[jax.Array, ...] | None:
        """Each segment's first row (:attr:`starts`), as int32 scalars computed at run time.

        XLA:CPU compiles every distinct kernel on its own (about 9 ms each at
        its default codegen; identical kernels once), and a kernel that
        slices a segment out at a constant row is a distinct kernel per
        segment: unpacking ResNet-50's 161 leaves compiled 161 kernels (2.1
        s). Sliced at rows the program reads at run time, leaves of one shape
        share a kernel (32 kernels, 0.8 s); slicing whole rows keeps the
        kernels as fast as the constant slices (a flat offset cost ResNet-50's
        step 15%). The rows come out of a ``while_loop`` whose trip count (0
        or 1, from the sign bit of ``like``'s first element) XLA cannot know;
        each is the constant either way. ``like``: a buffer whose device
        variance the rows take (under ``shard_map``: the one sliced with them
        that varies least). None for an empty buffer or one segment.

        Example:
          >>> import jax.numpy as jnp
          >>> layout = SegmentLayout((3, 5), row=4)
          >>> buf = layout.pack([jnp.arange(1.0, 4.0), jnp.arange(10.0, 15.0)], jnp.float32)
          >>> rows = layout.runtime_rows(buf)
          >>> [int(r) for r in rows], [p.tolist() for p in layout.unpack(buf, rows)]
          ([0, 1], [[1.0, 2.0, 3.0], [10.0, 11.0, 12.0, 13.0, 14.0]])
        """
        if not like.size or self.num_segments < 2:
            return None
        first = like.reshape(-1)[0]
        bits = lax.bitcast_convert_type(first, jnp.dtype(f"uint{8 * first.dtype.itemsize}"))
        sign = lax.shift_right_logical(bits, bits.dtype.type(8 * first.dtype.itemsize - 1))
        trips = 1 - sign.astype(jnp.int32)
        rows = varying_like(tuple(jnp.int32(int(s)) for s in self.starts), like)

        def body(carry):
            i, xs = carry
            zero = i >> 31  # i counts from 0
            return i + 1, tuple(x + zero for x in xs)

        _, rows = lax.while_loop(lambda c: c[0] < trips, body, (trips * 0, rows))
        return rows

    def per_row(self, values: jax.Array) -> jax.Array:
        """A per-segment array broadcast to rows (leading axis segments -> rows)."""
        return jnp.asarray(values)[self.row_segment]

    def segment_sum(self, per_row: jax.Array) -> jax.Array:
        """Per-segment sums of a per-row array, in row order (0 for an empty segment)."""
        return jax.ops.segment_sum(
            per_row, self.row_segment, self.num_segments, indices_are_sorted=True
        )

    def segment_max(self, per_row: jax.Array) -> jax.Array:
        """Per-segment maxima of a per-row array (its dtype's lowest for an empty segment)."""
        return jax.ops.segment_max(
            per_row, self.row_segment, self.num_segments, indices_are_sorted=True
        )

    def valid(self) -> jax.Array:
        """bool ``(num_rows, row)``: which slots hold a segment's element (not padding)."""
        size = np.asarray(self.sizes, np.int64)[self.row_segment] if self.sizes else np.zeros(0)
        left = (size - self.row_offset).astype(np.int32)  # elements of the segment from here on
        return lax.broadcasted_iota(jnp.int32, (self.num_rows, self.row), 1) < left[:, None]


class SegmentSelection(NamedTuple):
    """A selector's decision for every segment (arrays of shape ``(segments,)``).

    As :class:`jaxcomp.selection.Selection`, per segment: segment ``s`` sends
    ``{i: |x_i| > threshold[s]}``, ``count[s]`` elements.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> layout = SegmentLayout((4, 3))
      >>> x = layout.pack([jnp.array([1.0, -5.0, 2.0, 0.5]), jnp.array([3.0, 1.0, -4.0])],
      ...                 jnp.float32)
      >>> from jaxcomp.selection.segmented import exact_top_k
      >>> sel = exact_top_k(layout, x, Targets(np.array([[2, 1]])))
      >>> sel.count.tolist()  # two of the first segment, one of the second
      [2, 1]
    """

    threshold: jax.Array
    count: jax.Array
    iterations: jax.Array


class Targets(NamedTuple):
    """Per-segment target counts, static per warm-up phase, and the phase.

    ``table[p, s]`` is segment ``s``'s ``k`` in phase ``p``; ``phase`` is
    None (one phase) or a traced int32 scalar. Derived integer tables (the
    window's upper end, sample sizes) are computed in Python from ``table``
    and picked by the same phase, so they are exact.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> Targets(np.array([[100, 10], [10, 1]]), phase=jnp.int32(1)).k.tolist()
      [10, 1]
    """

    table: np.ndarray  # int64 (phases, segments)
    phase: Any = None

    def pick(self, table) -> jax.Array:
        """Row ``phase`` of a ``(phases, segments)`` numpy table, as an array."""
        table = np.asarray(table)
        if self.phase is None or table.shape[0] == 1:
            return jnp.asarray(table[0])
        return jnp.asarray(table)[self.phase]

    @property
    def k(self) -> jax.Array:
        return self.pick(self.table.astype(np.int32))


# ---------------------------------------------------------------------------
# Kernels: one pass over the buffer for every segment.
# ---------------------------------------------------------------------------


def _add_all(acc, val):
    return [a + v for a, v in zip(acc, val, strict=True)]


def abs32(x):
    return jnp.abs(x.astype(jnp.float32))


def _row_counts_many(a: jax.Array, ts: list[jax.Array]) -> list[jax.Array]:
    """Per-row int32 counts of ``a > t`` for per-row thresholds ``t`` (each ``(rows, 1)``)."""

    def cpu(a, *ts):
        # XLA:CPU's fast exact count: a variadic int32 row reduce with two or
        # more live outputs (see jaxcomp.selection._kernels); the barrier
        # keeps equal thresholds distinct outputs.
        tl = list(lax.optimization_barrier(tuple(ts)))
        if len(tl) == 1:
            tl = [tl[0], lax.optimization_barrier(tl[0])]
            c0, c1 = lax.reduce(
                [(a > t).astype(jnp.int32) for t in tl], [jnp.int32(0)] * 2, _add_all, (1,)
            )
            return [jnp.minimum(c0, c1)]
        ops = [(a > t).astype(jnp.int32) for t in tl]
        return list(lax.reduce(ops, [jnp.int32(0)] * len(tl), _add_all, (1,)))

    def other(a, *ts):
        return [jnp.sum(a > t, axis=1, dtype=jnp.int32) for t in ts]

    return lax.platform_dependent(a, *ts, cpu=cpu, default=other)


def count_above(layout: SegmentLayout, x: jax.Array, t: jax.Array) -> jax.Array:
    """int32 ``#{|x| > t[s]}`` per segment (float32 compare), one pass."""
    if layout.num_rows == 0:
        return jnp.zeros((layout.num_segments,), jnp.int32)
    x, t = lax.optimization_barrier((x, jnp.asarray(t, jnp.float32)))
    (rc,) = _row_counts_many(abs32(x), [layout.per_row(t)[:, None]])
    return layout.segment_sum(rc)


def count_above_many(layout: SegmentLayout, x: jax.Array, ts: jax.Array) -> jax.Array:
    """int32 ``#{|x| > ts[s, j]}``, shape ``(segments, m)``, in one pass."""
    m = ts.shape[1]
    if layout.num_rows == 0:
        return jnp.zeros((layout.num_segments, m), jnp.int32)
    x, ts = lax.optimization_barrier((x, jnp.asarray(ts, jnp.float32)))
    tr = layout.per_row(ts)
    rcs = _row_counts_many(abs32(x), [tr[:, j : j + 1] for j in range(m)])
    return layout.segment_sum(jnp.stack(rcs, axis=1))


def segment_max(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 ``max|x|`` per segment (0 for an empty one)."""
    if layout.num_rows == 0:
        return jnp.zeros((layout.num_segments,), jnp.float32)
    m = layout.segment_max(jnp.max(abs32(x), axis=1))
    return jnp.maximum(m, 0.0)  # empty segments: -inf


def rounded_product(a, b):
    """``a * b`` rounded on its own: never contracted with a following add
    into one fused multiply-add, whose single rounding XLA applies or not
    depending on the fusion around it (a group alone and in a packed step
    must get the same bits)."""
    return lax.optimization_barrier(a * b)


def _bits(t):
    return lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.int32)


def _float(b):
    return lax.bitcast_convert_type(b, jnp.float32)


def just_below(v):
    return jnp.where(v > 0, _float(_bits(v) - 1), jnp.float32(0))


def float32_above(t):
    return _float(_bits(t) + 1)


_PROBES = 8


def kth_largest_above(
    layout: SegmentLayout,
    x: jax.Array,
    t: jax.Array,
    count: jax.Array,
    k: jax.Array,
    *,
    top: jax.Array,
    active: jax.Array | None = None,
) -> jax.Array:
    """Per segment, the k-th largest float32 ``|x|`` above ``t`` (0 if ``count < k``).

    :func:`jaxcomp.selection.base.kth_largest_above` for every segment
    at once: a search on float32 bit patterns with 8 probes per segment
    counted in one pass, at most 10 passes; ``top`` bounds ``|x|`` from above
    (``inf`` is always safe). Segments not ``active`` take no part (their
    result is meaningless).

    The search also keeps the counts at its bracket ``(lo, hi]``: a segment
    whose ``count(hi) == k - 1`` has its k-th largest as the largest ``|x|
    <= hi``, one whose ``count(lo) == k`` as the smallest ``|x| > lo``, so it
    stops there, and one pass of masked maxima finishes all such segments.
    The bit search needs a pass per 9-fold cut of the bracket's bit range
    (23 bits from ``t`` to ``2 t``); this stops once the bracket holds one
    element (about a 9-fold cut of its elements per pass), so a segment of a
    tree no longer waits for the slowest bit range. Until a probe has landed
    at or below the k-th (above a positive ``t``), the probes halve the
    distance to ``lo`` instead of splitting the bracket evenly: the k-th of a
    refine or a capacity cut lies close above ``t`` (``count(t)`` within a
    small factor of ``k``), in the first ninth of ``(t, max]``.
    """
    lo = jnp.maximum(_bits(t), 0)
    hi = jnp.minimum(_bits(top), _bits(jnp.inf))  # a NaN top: inf (|x| <= inf besides NaNs)
    if active is not None:
        hi = jnp.where(active, hi, lo + 1)
    j = jnp.arange(1, _PROBES + 1, dtype=jnp.int32)
    # count(lo) unknown (-1) until a probe lands; count(hi) = 0 at top (top >= max|x|).
    c_lo = jnp.full_like(k, -1)
    c_hi = jnp.zeros_like(k)
    can_finish = k >= 1

    def state(s):
        lo, hi, c_lo, c_hi = s
        searching = (hi - lo) > 1
        at_hi = searching & can_finish & (c_hi == k - 1)
        at_lo = searching & can_finish & ~at_hi & (c_lo == k)
        return searching & ~at_hi & ~at_lo, at_hi, at_lo

    def body(s):
        lo, hi, c_lo, c_hi = s
        run = state(s)[0]
        q, r = jnp.divmod(hi - lo, _PROBES + 1)
        even = lo[:, None] + q[:, None] * j + jnp.minimum(j, r[:, None])
        # Until a probe lands at or below the k-th (count(lo) unknown) above a
        # positive lo, the probes halve the distance to lo: lo + (hi - lo) / 2^(9 - j).
        halving = lo[:, None] + jnp.right_shift((hi - lo)[:, None], _PROBES + 1 - j)
        probes = jnp.where(((c_lo < 0) & (lo > 0))[:, None], halving, even)
        cnt = count_above_many(layout, x, _float(probes))
        many = cnt >= k[:, None]
        # Counts fall as probes rise: the largest probe with many has the least count of those.
        new_lo = jnp.max(jnp.where(many, probes, lo[:, None]), axis=1)
        least = jnp.min(jnp.where(many, cnt, jnp.iinfo(jnp.int32).max), axis=1)
        new_c_lo = jnp.where(jnp.any(many, axis=1), least, c_lo)
        new_hi = jnp.min(jnp.where(many, hi[:, None], probes), axis=1)
        new_c_hi = jnp.max(jnp.where(many, c_hi[:, None], cnt), axis=1)
        pick = lambda a, b: jnp.where(run, a, b)  # noqa: E731
        return pick(new_lo, lo), pick(new_hi, hi), pick(new_c_lo, c_lo), pick(new_c_hi, c_hi)

    s = lax.while_loop(lambda s: jnp.any(state(s)[0]), body, varying_like((lo, hi, c_lo, c_hi), x))
    lo, hi = s[0], s[1]
    _, at_hi, at_lo = state(s)
    kth = lax.cond(
        jnp.any(at_hi | at_lo),
        lambda: jnp.where(at_hi | at_lo, _finish(layout, x, lo, hi, at_hi), _float(hi)),
        lambda: _float(hi),
    )
    return jnp.where(count >= k, kth, jnp.float32(0))


def _max_many(a: list[jax.Array], init: list[int]) -> list[jax.Array]:
    """Per-row maxima of int32 arrays (each at least its ``init``): on XLA:CPU
    one variadic reduce (it runs a lone float or int max reduce several times
    slower), elsewhere plain reductions (as :func:`_row_counts_many`)."""

    def body(acc, val):
        return [jnp.maximum(p, q) for p, q in zip(acc, val, strict=True)]

    def cpu(*a):
        return list(lax.reduce(list(a), [jnp.int32(v) for v in init], body, (1,)))

    def other(*a):
        return [jnp.maximum(jnp.max(x, axis=1), jnp.int32(v)) for x, v in zip(a, init, strict=True)]

    return list(lax.platform_dependent(*a, cpu=cpu, default=other))


def _finish(layout, x, lo, hi, at_hi):
    """Per segment: the largest ``|x| <= float(hi)`` where ``at_hi``, else the
    smallest ``|x| > float(lo)``, in one pass (on float32 bit patterns, which
    order as the non-negative floats; a NaN's lies above every one of them,
    so it takes no part: ``hi <= bits(inf)``, and the smallest above ``lo`` is
    a number where ``count(lo) >= 1``)."""
    x, lo, hi = lax.optimization_barrier((x, lo, hi))
    b = _bits(abs32(x))
    low = jnp.iinfo(jnp.int32).min
    below = jnp.where(b <= layout.per_row(hi)[:, None], b, -1)
    above = jnp.where(b > layout.per_row(lo)[:, None], -b, low)
    r1, r2 = _max_many([below, above], [-1, low])
    return _float(jnp.where(at_hi, layout.segment_max(r1), -layout.segment_max(r2)))


def strided_layout(layout: SegmentLayout, size: Callable[[int], int]):
    """The layout of per-segment strided samples and each segment's stride.

    Segment ``s`` keeps ``m = size(n)`` elements at a fixed odd stride, as
    ``base.strided_sample`` takes them (all of it when ``n <= m``).
    """
    sizes, strides = [], []
    for n in layout.sizes:
        m = min(n, size(n))
        stride = 1
        if n > m:
            stride = n // m
            if stride % 2 == 0:
                stride -= 1
        sizes.append(m)
        strides.append(stride)
    return SegmentLayout(tuple(sizes), layout.row), np.asarray(strides, np.int64)


def strided_samples(
    layout: SegmentLayout, x: jax.Array, sample: SegmentLayout, strides
) -> jax.Array:
    """The packed strided samples of every segment (x itself when nothing is strided)."""
    if sample.sizes == layout.sizes:
        return x
    seg = sample.row_segment
    base = layout.starts[seg] * layout.row  # segment start in x
    stride = strides[seg]
    ok = sample.valid()
    if layout.num_rows * layout.row >= 2**31:
        raise ValueError("segmented selection: buffers beyond 2^31 elements are not supported")
    # Built in the program: as a constant the index table would be as large as the sample.
    rows = (
        jnp.asarray(base.astype(np.int32))[:, None]
        + (lax.broadcasted_iota(jnp.int32, ok.shape, 1) + jnp.asarray(sample.row_offset)[:, None])
        * jnp.asarray(stride.astype(np.int32))[:, None]
    )
    rows = jnp.where(ok, rows, 0)
    picked = x.reshape(-1)[rows]
    return jnp.where(ok, picked, jnp.zeros((), x.dtype))


def moments(layout: SegmentLayout, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-segment float32 mean and population variance (around the first element).

    As :func:`jaxcomp.selection._kernels.moments` per segment (shifted by the
    segment's first element against cancellation), summed by rows.
    """
    x = x.astype(jnp.float32)
    valid = layout.valid()
    shift = x.reshape(-1)[jnp.asarray((layout.starts * layout.row).astype(np.int32))]
    n = np.maximum(np.asarray(layout.sizes, np.float64), 1)
    inv_n = jnp.asarray((1.0 / n).astype(np.float32))
    total = layout.segment_sum(jnp.sum(jnp.where(valid, x, 0.0), axis=1))
    d2 = jnp.square(x - layout.per_row(shift)[:, None])
    sq = layout.segment_sum(jnp.sum(jnp.where(valid, d2, 0.0), axis=1))
    mean = rounded_product(total, inv_n)
    d = mean - shift
    var = jnp.maximum(rounded_product(sq, inv_n) - rounded_product(d, d), 0.0)
    return mean, var


# ---------------------------------------------------------------------------
# The capacity cut.
# ---------------------------------------------------------------------------


def capacity_cut(
    layout: SegmentLayout, x: jax.Array, t: jax.Array, count: jax.Array, capacity: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Per segment ``selectors.capacity_cut``: ``(cut, limit)`` of the message.

    Segment ``s`` sends ``{i: |x_i| > cut[s] and (|x_i| > float32_above(cut[s])
    or i <= limit[s])}`` (``i`` its flat index within the segment): the
    ``capacity[s]`` largest of ``{|x| > t[s]}``, ties to the lower index.
    Segments with ``count <= capacity`` keep ``(t, size)``. The same message
    as the 1-D ``capacity_cut`` (tested).

    Example:
      >>> import jax.numpy as jnp
      >>> x = jnp.zeros(64).at[:10].set(1.0).at[63].set(5.0)  # ten ties, one larger
      >>> layout = SegmentLayout((64,))
      >>> buf = layout.pack([x], jnp.float32)
      >>> t, count = jnp.array([0.5]), jnp.array([11], jnp.int32)
      >>> cut, limit = capacity_cut(layout, buf, t, count, jnp.array([6], jnp.int32))
      >>> int(limit[0])  # the last tie sent: ties 0-4 and the 5.0
      4
    """
    sizes = jnp.asarray(np.asarray(layout.sizes, np.int32))
    over = count > capacity
    # The segments' maxima (a cheap pass) narrow the search's first bracket.
    v = kth_largest_above(layout, x, t, count, capacity, top=segment_max(layout, x), active=over)
    # How many ties at v are wanted: capacity - #{|x| > v} (>= 1 where over).
    wanted = capacity - count_above(layout, x, v)
    a = abs32(x)
    ties = (a == layout.per_row(v)[:, None]).astype(jnp.int32)
    row_ties = jnp.sum(ties, axis=1, dtype=jnp.int32)
    incl = jnp.cumsum(row_ties, dtype=jnp.int32)  # exact: integers
    base = layout.per_row(jnp.concatenate([jnp.zeros((1,), jnp.int32), incl])[
        jnp.asarray(layout.starts.astype(np.int32))])  # fmt: skip
    local_incl = incl - base  # ties of the segment up to and including this row
    before = local_incl < layout.per_row(wanted)
    # The row holding the wanted-th tie: the segment's first row + rows before it.
    r = jnp.asarray(layout.starts.astype(np.int32)) + layout.segment_sum(before.astype(jnp.int32))
    r = jnp.clip(r, 0, max(layout.num_rows - 1, 0))
    prior = jnp.where(
        r > jnp.asarray(layout.starts.astype(np.int32)), local_incl[jnp.maximum(r - 1, 0)], 0
    )
    row_t = ties[r]  # (segments, row)
    cum = jnp.cumsum(row_t, axis=1, dtype=jnp.int32)
    col = jnp.sum(cum < (wanted - prior)[:, None], axis=1, dtype=jnp.int32)
    limit = jnp.asarray(layout.row_offset)[r] + col
    cut = jnp.where(over, just_below(v), t)
    return cut, jnp.where(over, limit, sizes)


def sent_mask(layout: SegmentLayout, x: jax.Array, cut: jax.Array, limit: jax.Array) -> jax.Array:
    """The messages' mask in the packed buffer (see :func:`capacity_cut`)."""
    a = abs32(x)
    c = layout.per_row(cut)[:, None]
    above = layout.per_row(float32_above(cut))[:, None]
    index = jnp.asarray(layout.row_offset)[:, None] + lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return (a > c) & ((a > above) | (index <= layout.per_row(limit)[:, None]))


def _valid_positions(layout: SegmentLayout, segments: Sequence[int]) -> jax.Array:
    """int32 flat positions in the packed buffer of the given segments' elements, in order."""
    parts = [
        (int(layout.starts[s]) * layout.row, layout.sizes[s]) for s in segments if layout.sizes[s]
    ]
    if not parts:
        return jnp.zeros((0,), jnp.int32)
    # One iota per run, concatenated: a constant table would be as large as the buffer.
    return jnp.concatenate([start + jnp.arange(n, dtype=jnp.int32) for start, n in parts])


def compact(layout: SegmentLayout, buf: jax.Array, segments: Sequence[int]) -> jax.Array:
    """The elements of ``segments`` (ascending) as one 1-D array, padding dropped."""
    return buf.reshape(-1)[_valid_positions(layout, segments)]


def expand(layout: SegmentLayout, flat: jax.Array, segments: Sequence[int], out: jax.Array):
    """``out`` (packed) with the elements of ``segments`` replaced by ``flat``."""
    pos = _valid_positions(layout, segments)
    return out.reshape(-1).at[pos].set(flat, unique_indices=True).reshape(out.shape)


_BLOCK = 64


def extract(
    layout: SegmentLayout, x: jax.Array, mask: jax.Array, capacities: Sequence[int]
) -> tuple[jax.Array, jax.Array]:
    """Flat packed indices and values of the elements ``mask`` marks, segment by segment.

    Segment ``s`` fills ``capacities[s]`` slots (static; 0 leaves it out) with
    its marked elements in ascending index order, at most as many as it has
    slots (the capacity cut has made sure of that); unused slots are padding
    (index ``num_rows * row``, value 0). The two-level compaction of
    :func:`jaxcomp.selection._kernels.extract` over all segments at once:
    counts per block of 64 elements, their cumulative sum, a search for each
    slot's block, and the rank inside the block by a 0/1 matmul.
    """
    size = layout.num_rows * layout.row
    caps = np.asarray(capacities, np.int64)
    total = int(caps.sum())
    if total == 0 or size == 0:
        return jnp.full((total,), size, jnp.int32), jnp.zeros((total,), x.dtype)
    blocks_per_row = layout.row // _BLOCK
    m = mask.reshape(-1, _BLOCK)
    counts = jnp.sum(m, axis=1, dtype=jnp.int32)
    incl = jnp.cumsum(counts, dtype=jnp.int32)
    excl_rows = jnp.concatenate([jnp.zeros((1,), jnp.int32), incl])
    # Each slot's segment and rank in it (static), and the marks before the segment.
    slot_seg = np.repeat(np.arange(len(caps)), caps).astype(np.int32)
    slot_rank = (np.arange(total) - np.repeat(np.cumsum(caps) - caps, caps)).astype(np.int32)
    first_block = (layout.starts * blocks_per_row).astype(np.int32)
    last_block = ((layout.starts + layout.rows) * blocks_per_row).astype(np.int32)
    base = excl_rows[jnp.asarray(first_block)]
    marked = excl_rows[jnp.asarray(last_block)] - base
    target = base[slot_seg] + jnp.asarray(slot_rank)
    valid = jnp.asarray(slot_rank) < marked[slot_seg]
    nb = counts.shape[0]
    blk = jnp.minimum(jnp.searchsorted(incl, target, side="right").astype(jnp.int32), nb - 1)
    rank = target - (incl[blk] - counts[blk])
    pos = blk[:, None] * _BLOCK + jnp.arange(_BLOCK, dtype=jnp.int32)[None, :]
    xf = x.reshape(-1)
    rows = xf[pos]
    sel = mask.reshape(-1)[pos]
    tri = jnp.triu(jnp.ones((_BLOCK, _BLOCK), jnp.float32))
    csum = jnp.dot(sel.astype(jnp.float32), tri, precision=lax.Precision.HIGHEST)
    j = jnp.minimum(jnp.sum(csum <= rank[:, None].astype(jnp.float32), axis=1, dtype=jnp.int32),
                    _BLOCK - 1)  # fmt: skip
    idx = jnp.where(valid, blk * _BLOCK + j, size)
    picked = jnp.take_along_axis(rows, j[:, None], axis=1)[:, 0]
    return idx, jnp.where(valid, picked, jnp.zeros((), x.dtype))
