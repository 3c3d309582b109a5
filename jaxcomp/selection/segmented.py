"""Selection for many tensors at once: one buffer, one loop, a threshold per segment.

A model's gradients are tens to hundreds of leaves. Selecting each leaf on
its own makes one program piece per leaf (every ``while_loop``, every
conditional and every counting pass again), so compile time and, on a GPU,
kernel launches grow with the leaf count. Here the leaves (the *segments*)
are packed into one 2-D buffer of rows of :data:`ROW` elements, each segment
starting on a row of its own and padded with zeros to whole rows::

    segment:   0 0 0 0 0 | 1 1 1 1 1 | 1 1 . . . | 2 2 2 . . |     (ROW = 5)
    row:           0           1           2           3

and every selector decides all segments together: one counting pass counts
every segment against its own threshold (a per-row threshold, the row counts
summed per segment), one ``while_loop`` iterates until every segment's
search has converged (a converged segment stays fixed while the others go
on). A segment's result depends on its own elements only: each row holds one
segment, the per-row reductions see one segment's elements, and the
row-to-segment sums run in row order. So a leaf selected with a hundred others
gets the threshold it gets alone (tested bit for bit).

Padding zeros never pass a threshold (``|0| > t`` is false for ``t >= 0``,
and every threshold here is ``>= 0``) and never raise a maximum; sums that
padding would change (the moments) mask it out.

``k`` is an int32 array (one per segment) and may be traced: a warm-up
schedule picks a row of a static table by the step, and the one compiled
selector serves every phase.

Selectors with a segmented form are in :data:`SEGMENTED` (by the 1-D
selector they stand for): ``exact_top_k`` (the same threshold and count bit
for bit: the k-th largest magnitude found by a search on float32 bit
patterns instead of ``lax.top_k``), ``fixed_threshold`` (bit for bit),
``binary_search`` (bit for bit from zero), ``ldte_bs``, ``dgc_sample``,
``trimmed_top_k`` and ``gaussian_k`` (the same algorithm per segment; see
each for what differs from the 1-D form) and ``random_k`` (the same draws: a
per-row stream of each segment's key, selected by exact top-k on the scores,
with the capacity cut at ``k`` the same coordinates). A form in :data:`SCORES`
selects on a score buffer of its own (``random_k``: its draws) rather than
on ``|x|``: the caller runs selector, capacity cut and mask on that buffer.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import varying_like
from jaxcomp.selection import selectors as S1

__all__ = [
    "ROW",
    "SCORES",
    "SEGMENTED",
    "SegmentLayout",
    "SegmentSelection",
    "Targets",
    "binary_search",
    "capacity_cut",
    "dgc_sample",
    "exact_top_k",
    "fixed_threshold",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "random_scores",
    "trimmed_top_k",
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


def _abs32(x):
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
    (rc,) = _row_counts_many(_abs32(x), [layout.per_row(t)[:, None]])
    return layout.segment_sum(rc)


def count_above_many(layout: SegmentLayout, x: jax.Array, ts: jax.Array) -> jax.Array:
    """int32 ``#{|x| > ts[s, j]}``, shape ``(segments, m)``, in one pass."""
    m = ts.shape[1]
    if layout.num_rows == 0:
        return jnp.zeros((layout.num_segments, m), jnp.int32)
    x, ts = lax.optimization_barrier((x, jnp.asarray(ts, jnp.float32)))
    tr = layout.per_row(ts)
    rcs = _row_counts_many(_abs32(x), [tr[:, j : j + 1] for j in range(m)])
    return layout.segment_sum(jnp.stack(rcs, axis=1))


def segment_max(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 ``max|x|`` per segment (0 for an empty one)."""
    if layout.num_rows == 0:
        return jnp.zeros((layout.num_segments,), jnp.float32)
    m = layout.segment_max(jnp.max(_abs32(x), axis=1))
    return jnp.maximum(m, 0.0)  # empty segments: -inf


def _product(a, b):
    """``a * b`` rounded on its own: never contracted with a following add
    into one fused multiply-add, whose single rounding XLA applies or not
    depending on the fusion around it (a group alone and in a packed step
    must get the same bits)."""
    return lax.optimization_barrier(a * b)


def _bits(t):
    return lax.bitcast_convert_type(jnp.asarray(t, jnp.float32), jnp.int32)


def _float(b):
    return lax.bitcast_convert_type(b, jnp.float32)


def _just_below(v):
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
    b = _bits(_abs32(x))
    low = jnp.iinfo(jnp.int32).min
    below = jnp.where(b <= layout.per_row(hi)[:, None], b, -1)
    above = jnp.where(b > layout.per_row(lo)[:, None], -b, low)
    r1, r2 = _max_many([below, above], [-1, low])
    return _float(jnp.where(at_hi, layout.segment_max(r1), -layout.segment_max(r2)))


def _strided_layout(layout: SegmentLayout, size: Callable[[int], int]):
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


def _sample(layout: SegmentLayout, x: jax.Array, sample: SegmentLayout, strides) -> jax.Array:
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
    mean = _product(total, inv_n)
    d = mean - shift
    var = jnp.maximum(_product(sq, inv_n) - _product(d, d), 0.0)
    return mean, var


# ---------------------------------------------------------------------------
# Selectors.
# ---------------------------------------------------------------------------


def _selection(t, c, it) -> SegmentSelection:
    return SegmentSelection(
        jnp.asarray(t, jnp.float32), jnp.asarray(c, jnp.int32), jnp.asarray(it, jnp.int32)
    )


def exact_top_k(layout: SegmentLayout, x: jax.Array, targets: Targets) -> SegmentSelection:
    """Exact top-k of every segment: ``selectors.exact_top_k`` bit for bit.

    The k-th largest magnitude comes from the bit-pattern search (at most 10
    passes of 8 probes) instead of ``lax.top_k``: the same float32 value, so
    the same threshold (the float just below it) and count.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxcomp.selection import selectors
      >>> a, b = jnp.array([0.5, -4.0, 1.0, 3.0]), jnp.array([2.0, 1.0, 1.0, 1.0, 6.0])
      >>> layout = SegmentLayout((4, 5))
      >>> sel = exact_top_k(layout, layout.pack([a, b], jnp.float32), Targets(np.array([[2, 2]])))
      >>> bool(sel.threshold[0] == selectors.exact_top_k(a, 2).threshold), sel.count.tolist()
      (True, [2, 2])
    """
    k = targets.k
    n = jnp.asarray(np.asarray(layout.sizes, np.int32))
    kth = kth_largest_above(
        layout, x, jnp.zeros_like(k, jnp.float32), n, k, top=segment_max(layout, x)
    )
    # lax.top_k's k-th value: the k-th largest |x| (0 when fewer than k are nonzero).
    t = _just_below(kth)
    return _selection(t, count_above(layout, x, t), jnp.zeros_like(k))


def _top_k_above(layout, x, t, c, k, refine, top):
    """Where ``refine``: the exact top-k threshold among ``{|x| > t}`` (``c >= k`` of them)."""
    kth = kth_largest_above(layout, x, t, c, k, top=top, active=refine)
    t2 = jnp.where(refine, _just_below(kth), t)
    c2 = count_above(layout, x, t2)
    return t2, jnp.where(refine, c2, c)


def _log_cosh(z):
    z = jnp.abs(z)
    return z + jnp.log1p(jnp.exp(-2.0 * z)) - math.log(2.0)


# Laplace-model probes counted with the estimate: thresholds whose expected
# count is f * aim * k (t0 - b ln f), as ldte_bs's sample-quantile probes.
_PROBE_FACTORS = (2.4, 1.16, 0.84, 0.4)


def ldte_bs(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    search: str = "interpolate",
    aim: float = 1.25,
    moment_sample: int | None = S1.DEFAULT_MOMENT_SAMPLE,
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
    exact_below: int = 0,
    hint: jax.Array | None = None,
    probes: bool = True,
    estimator: str = "moments",
) -> SegmentSelection:
    """LDTE-BS for every segment (``selectors.ldte_bs``).

    Per segment: the Laplace fit of the (strided-sample) moments (or, with
    ``estimator="mle"``, the sample's median ``mu`` and ``b = mean|x - mu|``)
    gives ``t0 = b ln(cosh(mu/b) / eta)``; one pass counts ``t0``, the ``hint``
    (the previous threshold) and, with ``probes``, four thresholds
    ``t0 - b ln f`` whose expected counts under the fit are ``f`` times the
    aim; the first in ``[k, upper k]`` is kept (the estimate, then the
    hint, then the probe nearest the aim), else the search (bisection,
    Fibonacci or interpolation on log counts) runs from the bracket they
    leave, every segment in one ``while_loop``. Where no threshold fits the
    window (ties, fewer than k nonzeros, the probe cap) the result is the
    1-D selector's: the exact top-k among the "too many" end's survivors.

    What differs from the 1-D selector: the moments (``mean|x - mu|``) are
    summed by rows (the estimate can differ in its last bits; the median is
    ``jnp.median``'s bit for bit), and the improved variant's probes
    come from the Laplace fit rather than the sample's quantiles (no
    per-segment ``top_k`` of the sample). ``probes=False, hint=None,
    search="bisect", aim=1, moment_sample=None`` is the paper's algorithm.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> parts = [jax.random.laplace(jax.random.key(i), (n,)) for i, n in enumerate((5000, 800))]
      >>> layout = SegmentLayout((5000, 800))
      >>> sel = ldte_bs(layout, layout.pack(parts, jnp.float32), Targets(np.array([[50, 8]])))
      >>> [bool(k <= int(c) <= 1.5 * k) for k, c in zip((50, 8), sel.count)]
      [True, True]
    """
    # The estimate's float sums must not fuse with whatever produced x (the
    # accumulation, a backward pass): their rounding would then depend on the
    # program around the selector, and a group would not get the same
    # threshold in a packed step and alone (the overlap path).
    x = lax.optimization_barrier(x)
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    ub_tab = np.floor(upper * ktab).astype(np.int64)
    ub = targets.pick(ub_tab.astype(np.int32))
    cap = targets.pick(np.minimum(sizes, np.ceil(upper * ktab)).astype(np.int32))
    n = jnp.asarray(sizes.astype(np.int32))
    # The estimate.
    V.check_choice("estimator", estimator, ("moments", "mle"))
    ml, mx = layout, x
    if moment_sample is not None:
        ml, strides = _strided_layout(layout, lambda _: moment_sample)
        mx = _sample(layout, x, ml, strides)
    if estimator == "moments":
        mean, var = moments(ml, mx)
        b = jnp.sqrt(var / 2.0)
    else:
        # The median of at most MEDIAN_SAMPLE elements, as selectors.laplace_threshold.
        medl, strides = _strided_layout(ml, lambda _: S1.MEDIAN_SAMPLE)
        mean = _segment_median(medl, _sample(ml, mx, medl, strides))
        b = _segment_mean_abs(ml, mx.astype(jnp.float32) - ml.per_row(mean)[:, None])
    eta = targets.pick(np.minimum(1.0, aim * ktab / np.maximum(sizes, 1)).astype(np.float32))
    safe_b = jnp.where(b > 0, b, 1.0)
    t0 = safe_b * (_log_cosh(mean / safe_b) - jnp.log(eta))
    t0 = jnp.maximum(jnp.where(b > 0, t0, 0.0), 0.0)
    # The first pass: estimate, hint, probes.
    cands = [t0]
    if hint is not None:
        h = jnp.asarray(hint, jnp.float32)
        cands.append(jnp.where(jnp.isfinite(h) & (h >= 0), h, t0))
    if probes:
        cands += [jnp.maximum(t0 - _product(b, math.log(f)), 0.0) for f in _PROBE_FACTORS]
    ts0 = jnp.stack(cands, axis=1)
    cs0 = (
        count_above_many(layout, x, ts0) if len(cands) > 1 else count_above(layout, x, t0)[:, None]
    )
    if hint is not None:
        # A hint with nothing above it brackets no better than max|x|: drop it.
        drop = (jnp.arange(ts0.shape[1]) == 1)[None, :] & (cs0 == 0)
        ts0 = jnp.where(drop, t0[:, None], ts0)
        cs0 = jnp.where(drop, cs0[:, :1], cs0)
    preferred = 2 if hint is not None else 1
    t, c = _choose(ts0, cs0, k, ub, aim, preferred)
    lo, c_lo, hi, c_hi, hi_known = _bracket(ts0, cs0, k, ub, n)
    hi = jnp.where(hi_known, hi, segment_max(layout, x))
    c_hi = jnp.where(hi_known, c_hi, 0)
    t, c, it, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t, c, lo == 0,
        upper=upper, search=search, max_iters=max_iters, delta=delta,
    )  # fmt: skip
    t, c = _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero)
    if exact_below:
        small = jnp.asarray(sizes < exact_below)
        if bool(np.any(sizes < exact_below)):
            ex = exact_top_k(layout, x, targets)
            t = jnp.where(small, ex.threshold, t)
            c = jnp.where(small, ex.count, c)
            it = jnp.where(small, 0, it)
    return _selection(t, c, it)


def _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero, searched=None):
    """Where the search ended outside ``[k, ub]``: ldte.threshold_search's fallback.

    The "too many" end ``lo`` (its count, when it was never counted), refined
    to the exact top-k among its survivors when more than ``cap`` pass and
    the bracket did not close. Segments not ``searched`` keep ``(t, c)``.
    """
    feasible = (c >= k) & (c <= ub)
    if searched is not None:
        feasible = feasible | ~searched
    c_lo_true = jnp.where(lo_zero, count_above(layout, x, lo), c_lo)
    open_ = jnp.nextafter(lo, jnp.float32(jnp.inf)) < hi
    refine = ~feasible & (c_lo_true > cap) & open_

    def fallback(_):
        t2, c2 = _top_k_above(layout, x, lo, c_lo_true, k, refine, hi)
        return jnp.where(feasible, t, t2), jnp.where(feasible, c, c2)

    def plain(_):
        return jnp.where(feasible, t, lo), jnp.where(feasible, c, c_lo_true)

    return lax.cond(jnp.any(refine), fallback, plain, None)


def _choose(ts, cs, k, ub, aim, preferred):
    """Per segment ``ldte._choose``: the first preferred candidate in the
    window, else the one in it nearest ``aim * k``, else the first."""
    in_window = (cs >= k[:, None]) & (cs <= ub[:, None])
    target = jnp.log(aim * k.astype(jnp.float32))
    miss = jnp.abs(jnp.log(cs.astype(jnp.float32) + 1.0) - target[:, None])
    rank = jnp.where(jnp.arange(ts.shape[1])[None, :] < preferred, -1.0, miss)
    first = jnp.argmin(jnp.where(in_window, rank, jnp.inf), axis=1)
    first = jnp.where(jnp.any(in_window, axis=1), first, 0)
    pick = jnp.take_along_axis
    return pick(ts, first[:, None], 1)[:, 0], pick(cs, first[:, None], 1)[:, 0]


def _bracket(ts, cs, k, ub, n):
    """Per segment ``ldte._bracket``."""
    many, few = cs > ub[:, None], cs < k[:, None]
    any_many = jnp.any(many, axis=1)
    lo = jnp.where(any_many, jnp.max(jnp.where(many, ts, -jnp.inf), axis=1), 0.0)
    c_lo = jnp.where(any_many, jnp.min(jnp.where(many, cs, n[:, None]), axis=1), n)
    hi_known = jnp.any(few, axis=1)
    hi = jnp.where(hi_known, jnp.min(jnp.where(few, ts, jnp.inf), axis=1), ts[:, 0])
    c_hi = jnp.where(hi_known, jnp.max(jnp.where(few, cs, -1), axis=1), cs[:, 0])
    return lo, c_lo.astype(jnp.int32), hi, c_hi.astype(jnp.int32), hi_known


def _search(layout, x, k, ub, lo, hi, c_lo, c_hi, t, c, lo_zero, *, upper, search, max_iters,
            delta):  # fmt: skip
    """``ldte.threshold_search``'s loop for every segment at once.

    Returns ``(t, c, iterations, lo, c_lo, hi, lo_zero)``; a segment stops
    when its count is in ``[k, ub]``, its bracket no longer shrinks (or is
    below ``delta``) or after ``max_iters`` probes; the loop runs while any
    segment goes on.
    """
    kf = k.astype(jnp.float32)
    target = jnp.log(jnp.sqrt(kf * jnp.maximum(ub.astype(jnp.float32), kf)) + 1.0)
    fib = S1.fibonacci_fractions(max_iters)

    def running(s):
        lo, hi, _, _, _, c, it, _, _, _ = s
        feasible = (c >= k) & (c <= ub)
        mid = lo + _product(hi - lo, 0.5)
        stuck = (mid <= lo) | (mid >= hi) | (hi - lo <= delta)
        return ~feasible & ~stuck & (it < max_iters)

    def body(s):
        go = running(s)
        lo, hi, c_lo, c_hi, t_old, c_old, it, last, repeat, lo_z = s
        if search == "bisect":
            frac = jnp.float32(0.5)
        elif search == "fibonacci":
            frac = fib[jnp.minimum(it, fib.shape[0] - 1)]
        else:
            f_lo = jnp.log(c_lo.astype(jnp.float32) + 1.0) - target
            f_hi = jnp.log(c_hi.astype(jnp.float32) + 1.0) - target
            interp = f_lo / jnp.maximum(f_lo - f_hi, 1e-6)
            frac = jnp.where(repeat, 0.5, jnp.clip(interp, 0.02, 0.98))
        t = jnp.clip(lo + _product(hi - lo, frac), lo, hi)
        c = count_above(layout, x, t)
        too_many, too_few = c > ub, c < k
        moved = jnp.where(too_many, 1, jnp.where(too_few, -1, 0)).astype(jnp.int32)
        new = (
            jnp.where(too_many, t, lo),
            jnp.where(too_few, t, hi),
            jnp.where(too_many, c, c_lo),
            jnp.where(too_few, c, c_hi),
            t,
            c,
            it + 1,
            moved,
            (moved != 0) & (moved == last),
            lo_z & ~too_many,
        )
        return tuple(jnp.where(go, a, b) for a, b in zip(new, s, strict=True))

    zeros = jnp.zeros_like(k)
    init = (lo, hi, c_lo, c_hi, t, c, zeros, zeros, jnp.zeros_like(k, jnp.bool_), lo_zero)
    init = varying_like(init, x)
    s = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    lo, hi, c_lo, _, t, c, it, _, _, lo_zero = s
    return t, c, it, lo, c_lo, hi, lo_zero


_ROUNDS = 2  # decay rounds counted per pass (two thresholds cost about one: _row_counts_many)


def _decay_rounds(layout, x, t, running, decay, at, rounds=_ROUNDS):
    """DGC's adaptation rounds for every segment, both rules: from ``(t, count,
    0)``, while ``running((t, c, it))``: ``t = (t * decay).astype(float32)``,
    ``c`` the count above ``at(t)``, ``it + 1``.

    The thresholds a segment would try next are known in advance, so one
    pass counts the next ``rounds`` of them for every segment
    (:func:`count_above_many`) and each segment takes them in order until it
    stops: the same ``(t, c, it)`` as a round per pass, in a pass per
    ``rounds`` rounds (the first pass also counts the start ``t``). Only a
    round's count is ever taken for a segment, never a later one's, so a
    stopped segment stays stopped.
    """

    def chain(t, m):
        out = []
        for _ in range(m):
            # Each product rounded on its own: XLA would fold (t * d) * d into t * (d * d).
            t = lax.optimization_barrier((t * decay).astype(jnp.float32))
            out.append(t)
        return out

    def counts(ts):
        cs = count_above_many(layout, x, jnp.stack([at(u) for u in ts], axis=1))
        return [cs[:, j] for j in range(len(ts))]

    def advance(s, ts, cs):
        for tj, cj in zip(ts, cs, strict=True):
            go = running(s)
            t, c, it = s
            s = jnp.where(go, tj, t), jnp.where(go, cj, c), jnp.where(go, it + 1, it)
        return s

    ts = [t, *chain(t, rounds - 1)]
    cs = counts(ts)
    s = advance((t, cs[0], jnp.zeros_like(cs[0])), ts[1:], cs[1:])

    def body(s):
        ts = chain(s[0], rounds)
        return advance(s, ts, counts(ts))

    return lax.while_loop(lambda s: jnp.any(running(s)), body, varying_like(s, x))


def dgc_sample(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    sample_ratio: float = 0.01,
    upper: float = 1.3,
    decay: float = 0.8,
    max_adaptations: int = 10,
    rule: str = "reference",
    key: jax.Array | None = None,
    start: jax.Array | None = None,
) -> SegmentSelection:
    """DGC's selection for every segment, as ``selectors.dgc_sample`` bit for bit.

    The strided sample's threshold (its ``ks``-th largest magnitude, found by
    the bit-pattern search: ``lax.top_k``'s value), the adaptation rounds in
    one loop, and the exact top-k among the survivors where the rule asks
    for it. ``key``: a batch of PRNG keys, one per segment (segment ``s``
    starts its sample at ``selectors.dgc_start(key[s], stride)``); ``start``:
    the starts themselves (int32 per segment); neither: 0.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxcomp.selection import selectors
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = dgc_sample(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> int(sel.count[0]), bool(sel.threshold[0] == selectors.dgc_sample(x, 3).threshold)
      (3, True)
    """
    rule, sample_ratio, upper, max_adaptations = S1.check_dgc_options(
        rule, sample_ratio, upper, decay, max_adaptations
    )
    if rule == "at_least_k":
        return _dgc_at_least_k(layout, x, targets, sample_ratio, upper, decay, max_adaptations)
    k = targets.k
    sizes = np.asarray(layout.sizes, np.int64)
    # The reference's set-up per phase and segment: (stride, num_samples, top_k_samples).
    setup = np.asarray(
        [
            [
                S1.dgc_sampling(int(n), int(kk), sample_ratio)
                for kk, n in zip(row, sizes, strict=True)
            ]
            for row in targets.table
        ],
        np.int64,
    ).reshape(len(targets.table), len(sizes), 3)
    strides, m, ks_tab = setup[..., 0], setup[..., 1], setup[..., 2]
    whole_tab = m == sizes[None, :]
    # The sample's slots: the whole segment, or num_samples + 1 (importance[start::stride]).
    lengths = np.where(whole_tab, sizes[None, :], m + 1)
    sl = SegmentLayout(tuple(int(v) for v in lengths.max(axis=0)), layout.row)
    stride = targets.pick(strides.astype(np.int32))
    length = targets.pick(lengths.astype(np.int32))
    whole = targets.pick(whole_tab)
    if start is not None:
        first = jnp.asarray(start, jnp.int32)
    elif key is not None:
        first = jax.vmap(S1.dgc_start)(key, stride)
    else:
        first = jnp.zeros_like(k)
    first = jnp.where(whole, 0, first)
    n_seg = jnp.asarray(sizes.astype(np.int32))
    if sl.sizes == layout.sizes and whole_tab.all():
        sample = x
    else:
        if layout.num_rows * layout.row >= 2**31:
            raise ValueError("segmented selection: buffers beyond 2^31 elements are not supported")
        j = jnp.asarray(sl.row_offset)[:, None] + lax.broadcasted_iota(
            jnp.int32, (sl.num_rows, sl.row), 1
        )
        pos = sl.per_row(first)[:, None] + j * sl.per_row(stride)[:, None]
        ok = sl.valid() & (j < sl.per_row(length)[:, None]) & (pos < sl.per_row(n_seg)[:, None])
        base = jnp.asarray((layout.starts * layout.row).astype(np.int32))[sl.row_segment]
        picked = x.reshape(-1)[jnp.where(ok, base[:, None] + pos, 0)]
        sample = jnp.where(ok, picked, jnp.zeros((), x.dtype))
    ks = targets.pick(ks_tab.astype(np.int32))
    t = kth_largest_above(
        sl, sample, jnp.zeros_like(k, jnp.float32), length, ks, top=segment_max(sl, sample)
    )
    lo_tab, hi_tab = S1.dgc_bounds(targets.table, upper, decay)
    lo = None if lo_tab is None else targets.pick(lo_tab.astype(np.int32))
    hi = targets.pick(hi_tab.astype(np.int32))

    def survivors(t, c):
        return jnp.where(t > 0, c, n_seg)

    def running(s):
        t, c, it = s
        return ~whole & S1.below_decay(survivors(t, c), k, lo, decay) & (it < max_adaptations)

    t, c, it = _decay_rounds(layout, x, t, running, decay, _just_below)
    refine = ~whole & (survivors(t, c) > hi) & (it < max_adaptations)
    return _dgc_refined(layout, x, k, _just_below(t), c, it, refine)


def _dgc_at_least_k(layout, x, targets, sample_ratio, upper, decay, max_adaptations):
    """``selectors.dgc_sample(rule="at_least_k")`` for every segment."""
    k = targets.k
    sizes = np.asarray(layout.sizes, np.int64)
    sl, strides = _strided_layout(layout, lambda n: max(1, math.ceil(sample_ratio * n)))
    m = np.asarray(sl.sizes, np.int64)
    ks_tab = np.asarray(
        [
            [
                S1.target_count(kk / n, mm) if n else 0
                for kk, n, mm in zip(row, sizes, m, strict=True)
            ]
            for row in targets.table
        ],
        np.int32,
    )
    sample = _sample(layout, x, sl, strides)
    ks = targets.pick(ks_tab)
    kth = kth_largest_above(
        sl, sample, jnp.zeros_like(k, jnp.float32), jnp.asarray(m.astype(np.int32)), ks,
        top=segment_max(sl, sample),
    )  # fmt: skip

    def running(s):
        t, c, it = s
        return (c < k) & (it < max_adaptations) & (t > 0)

    t, c, it = _decay_rounds(layout, x, _just_below(kth), running, decay, lambda t: t)
    hi = targets.pick(np.ceil(upper * targets.table).astype(np.int32))
    return _dgc_refined(layout, x, k, t, c, it, c > hi)


def _dgc_refined(layout, x, k, t, c, it, refine) -> SegmentSelection:
    """DGC's last step, both rules: the exact top-k among the survivors where
    ``refine`` (one more iteration counted there)."""
    t, c = lax.cond(
        jnp.any(refine),
        lambda _: _top_k_above(layout, x, t, c, k, refine, segment_max(layout, x)),
        lambda _: (t, c),
        None,
    )
    return _selection(t, c, it + refine.astype(jnp.int32))


def binary_search(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    start: str = "zero",
    upper: float = 1.5,
    max_iters: int = 40,
    delta: float = 0.0,
) -> SegmentSelection:
    """RedSync's threshold bisection for every segment (``selectors.binary_search``).

    ``start="zero"`` bisects ``[0, max|x|]`` per segment: the 1-D selector's
    threshold, count and probes bit for bit (halving a float32 interval is
    exact). ``start="mean"`` starts from ``mean|x|`` (summed by rows: its
    last bits can differ from the 1-D selector's). Where no threshold lands
    in ``[k, upper k]`` (ties) the 1-D selector's fallback: the exact top-k
    among the "too many" end's survivors.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = binary_search(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> float(sel.threshold[0]), int(sel.count[0]), int(sel.iterations[0])
      (1.5, 4, 2)
    """
    S1.check_search_options("bisect", upper, max_iters, delta)
    V.check_choice("start", start, ("zero", "mean"))
    x = lax.optimization_barrier(x)
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    n = jnp.asarray(sizes.astype(np.int32))
    ub = targets.pick(np.floor(upper * ktab).astype(np.int32))
    cap = targets.pick(np.minimum(sizes, np.ceil(upper * ktab)).astype(np.int32))
    amax = segment_max(layout, x)
    zeros = jnp.zeros_like(k)
    if start == "zero":
        lo, hi, c_lo, c_hi = jnp.zeros_like(amax), amax, n, zeros
        lo_zero = jnp.ones_like(k, jnp.bool_)
        ok = ~lo_zero  # nothing decided before the search
        m, cm = amax, zeros
    else:
        m = _segment_mean_abs(layout, x)
        cm = count_above(layout, x, m)
        many = cm > ub
        ok = (cm >= k) & (cm <= ub)
        lo, hi = jnp.where(many, m, 0.0), jnp.where(many, amax, m)
        c_lo, c_hi, lo_zero = jnp.where(many, cm, n), jnp.where(many, 0, cm), ~many
    # The first probe is hi (count c_hi < k); a segment already in the window
    # (the mean's count) does not search.
    t0, c0 = jnp.where(ok, m, hi), jnp.where(ok, cm, c_hi)
    t, c, it, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t0, c0, lo_zero,
        upper=upper, search="bisect", max_iters=max_iters, delta=delta,
    )  # fmt: skip
    t, c = _settle(layout, x, k, ub, cap, t, c, lo, c_lo, hi, lo_zero, searched=~ok)
    if start == "mean":
        it = jnp.where(ok, 0, it + 1)
    return _selection(t, c, it)


def fixed_threshold(
    layout: SegmentLayout, x: jax.Array, targets: Targets, *, threshold: float
) -> SegmentSelection:
    """``selectors.fixed_threshold`` for every segment: one count of ``|x| > threshold``.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((5, 3))
      >>> buf = layout.pack([x[:5], x[5:]], jnp.float32)
      >>> fixed_threshold(layout, buf, Targets(np.array([[1, 1]])), threshold=2.5).count.tolist()
      [2, 1]
    """
    zeros = jnp.zeros_like(targets.k)
    # May be an injected (traced) hyperparameter.
    t = zeros.astype(jnp.float32) + jnp.float32(threshold)
    return _selection(t, count_above(layout, x, t), zeros)


def _segment_mean_abs(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 mean of ``|x|`` per segment (summed by rows; 0 for an empty one)."""
    total = layout.segment_sum(jnp.sum(jnp.where(layout.valid(), _abs32(x), 0.0), axis=1))
    n = jnp.asarray(np.maximum(np.asarray(layout.sizes, np.float64), 1).astype(np.float32))
    return total / n


def _segment_median(layout: SegmentLayout, x: jax.Array) -> jax.Array:
    """float32 ``jnp.median`` of each segment (NaN for an empty one), bit for bit.

    One sort of the whole buffer keyed by (segment, value), the padding
    keyed past the last segment; a segment's ``n`` values then sit at its
    offset among the sorted ones, and the median is the midpoint of the two
    middle ones as ``jnp.median`` computes it.
    """
    sizes = np.asarray(layout.sizes, np.int64)
    if layout.num_rows == 0:
        return jnp.full((layout.num_segments,), jnp.nan, jnp.float32)
    seg = jnp.where(layout.valid(), jnp.asarray(layout.row_segment)[:, None], layout.num_segments)
    _, vals = lax.sort((seg.reshape(-1), x.astype(jnp.float32).reshape(-1)), num_keys=2)
    off = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    low = jnp.asarray((off + np.maximum(sizes - 1, 0) // 2).astype(np.int32))
    high = jnp.asarray((off + sizes // 2).astype(np.int32))
    mid = (vals[low] + vals[jnp.minimum(high, vals.shape[0] - 1)]) * jnp.float32(0.5)
    return jnp.where(jnp.asarray(sizes > 0), mid, jnp.nan)


def trimmed_top_k(
    layout: SegmentLayout, x: jax.Array, targets: Targets, *, start: float = 0.8,
    step: float = 0.2,
) -> SegmentSelection:  # fmt: skip
    """RedSync's trimmed top-k for every segment (``selectors.trimmed_top_k``).

    Per segment the thresholds ``mean + r (max - mean)`` of ``|x|`` for
    ``r = start, start - step, ..., 0``, then 0, until at least ``k`` pass,
    all segments in one loop; then the exact top-k among the survivors where
    more than ``k`` pass. So the result is the exact top-k (all nonzeros
    when fewer than ``k``); the mean (summed by rows) can differ from the 1-D
    selector's in its last bits, which can move ``iterations`` only when a
    magnitude sits at a round's threshold.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> x = jnp.array([0.5, -4.0, 1.0, 3.0, -2.0, 0.0, 6.0, -1.5])
      >>> layout = SegmentLayout((8,))
      >>> sel = trimmed_top_k(layout, layout.pack([x], jnp.float32), Targets(np.array([[3]])))
      >>> int(sel.count[0]), int(sel.iterations[0])  # as selectors.trimmed_top_k
      (3, 4)
    """
    rounds = S1.trim_rounds(start, step)
    x = lax.optimization_barrier(x)
    k = targets.k
    mean = _segment_mean_abs(layout, x)
    amax = segment_max(layout, x)

    def running(s):
        _, c, it = s
        return (c < k) & (it < rounds + 1)

    def body(s):
        go = running(s)
        t_old, c_old, it = s
        r = start - step * it.astype(jnp.float32)
        t = jnp.where(it < rounds, mean + _product(r, amax - mean), 0.0)
        c = count_above(layout, x, t)
        return jnp.where(go, t, t_old), jnp.where(go, c, c_old), jnp.where(go, it + 1, it)

    init = varying_like((jnp.zeros_like(mean), jnp.full_like(k, -1), jnp.zeros_like(k)), x)
    t, c, it = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    refine = c > k
    t, c = lax.cond(
        jnp.any(refine),
        lambda _: _top_k_above(layout, x, t, c, k, refine, amax),
        lambda _: (t, c),
        None,
    )
    return _selection(t, c, it - 1)


def gaussian_k(
    layout: SegmentLayout,
    x: jax.Array,
    targets: Targets,
    *,
    corrections: int = 3,
    lower: float = 2 / 3,
    upper: float = 4 / 3,
    refine: bool = True,
) -> SegmentSelection:
    """Gaussian-k for every segment (``selectors.gaussian_k``).

    Per segment ``t = mu + sigma Phi^-1(1 - eta / 2)`` from the segment's
    moments, then up to ``corrections`` rounds of ``t *= 0.5`` (fewer than
    ``lower k`` pass) or ``t *= 1.5`` (more than ``upper k``), every segment
    in one loop; with ``refine`` the interpolation search on counts
    continues, for the segments that ended outside ``[k, upper k]``, from
    the bracket the rounds left, as the 1-D selector does. The moments are
    summed by rows, so the fit can differ from the 1-D selector's in its
    last bits.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> parts = [jax.random.laplace(jax.random.key(i), (n,)) for i, n in enumerate((5000, 800))]
      >>> layout = SegmentLayout((5000, 800))
      >>> sel = gaussian_k(layout, layout.pack(parts, jnp.float32), Targets(np.array([[50, 8]])))
      >>> [bool(k <= int(c) <= 4 / 3 * k) for k, c in zip((50, 8), sel.count)]
      [True, True]
    """
    corrections = V.check_int("corrections", corrections, 0)
    x = lax.optimization_barrier(x)  # as in ldte_bs: the fit's sums on their own
    k = targets.k
    ktab = targets.table
    sizes = np.asarray(layout.sizes, np.int64)
    n = jnp.asarray(sizes.astype(np.int32))
    mean, var = moments(layout, x)
    # 1 - eta / 2 in float64, then float32, as the 1-D selector's constant.
    p = targets.pick((1.0 - ktab / np.maximum(sizes, 1) / 2.0).astype(np.float32))
    t = jnp.maximum(mean + _product(jnp.sqrt(var), jax.scipy.special.ndtri(p)), 0.0)
    c = count_above(layout, x, t)
    too_few = targets.pick((lower * ktab).astype(np.float32))
    too_many = targets.pick((upper * ktab).astype(np.float32))
    ub = targets.pick(np.floor(max(1.0, upper) * ktab).astype(np.int32))

    bracket = functools.partial(S1.gaussian_bracket, k, ub)

    def running(s):
        _, c, it, *_ = s
        cf = c.astype(jnp.float32)
        return ((cf < too_few) | (cf > too_many)) & (it < corrections)

    def body(s):
        go = running(s)
        t, c, it, *br = s
        t2 = jnp.where(c.astype(jnp.float32) < too_few, t * 0.5, t * 1.5)
        c2 = count_above(layout, x, t2)
        new = (t2, c2, it + 1, *bracket(t2, c2, *br))
        return tuple(jnp.where(go, a, b) for a, b in zip(new, s, strict=True))

    none = (jnp.full_like(t, -1.0), n, jnp.full_like(t, jnp.inf), jnp.zeros_like(k))
    init = varying_like((t, c, jnp.zeros_like(k), *bracket(t, c, *none)), x)
    t, c, it, t_lo, c_lo, t_hi, c_hi = lax.while_loop(lambda s: jnp.any(running(s)), body, init)
    if not refine:
        return _selection(t, c, it)
    search = (c < k) | (c > ub)
    lo_seen, hi_seen = t_lo >= 0, t_hi < jnp.inf
    # Nothing lies above max|x|: a pass only when no probe had too few.
    hi = jnp.where(hi_seen, t_hi, segment_max(layout, x))
    c_hi = jnp.where(hi_seen, c_hi, 0)
    lo = jnp.where(lo_seen, t_lo, 0.0)
    c_lo = jnp.where(lo_seen, c_lo, n)  # 0 is never counted (lo_zero)
    # The search's first probe is hi (count c_hi < k), as the 1-D selector's.
    t0, c0 = jnp.where(search, hi, t), jnp.where(search, c_hi, c)
    t2, c2, it2, lo, c_lo, hi, lo_zero = _search(
        layout, x, k, ub, lo, hi, c_lo, c_hi, t0, c0, ~lo_seen,
        upper=max(1.0, upper), search="interpolate", max_iters=40, delta=0.0,
    )  # fmt: skip
    cap = targets.pick(np.minimum(sizes, np.ceil(max(1.0, upper) * ktab)).astype(np.int32))
    t2, c2 = _settle(layout, x, k, ub, cap, t2, c2, lo, c_lo, hi, lo_zero, searched=search)
    return _selection(t2, c2, it + jnp.where(search, it2, 0))


def random_scores(layout: SegmentLayout, x: jax.Array, key: jax.Array) -> jax.Array:
    """``random_k``'s score buffer: a uniform draw per element, 0 in the padding.

    Row ``r`` of segment ``s`` (its ``r``-th row) draws from ``fold_in(key[s],
    r)`` (:func:`jaxcomp.selection.selectors.random_scores`: positive finite
    float32 scores on ``2^30`` levels), so a segment's draws depend on its own
    key and size only, whatever it is packed with, and with the default row
    they are the 1-D ``random_k``'s draws. ``x`` (the accumulator) only gives
    the device variance: its values take no part.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> layout = SegmentLayout((300, 5))
      >>> s = random_scores(layout, jnp.zeros((3, ROW)), jax.random.split(jax.random.key(0), 2))
      >>> int((s > 0).sum()), float(s[2, 5:].max())  # every element drawn; padding 0
      (305, 0.0)
    """
    row_index = jnp.asarray(layout.row_offset // layout.row)  # the row within its segment
    row_keys = jax.vmap(jax.random.fold_in)(key[jnp.asarray(layout.row_segment)], row_index)
    scores = S1.random_scores(row_keys, layout.row)
    return varying_like(jnp.where(layout.valid(), scores, jnp.float32(0)), x)


def random_k(layout: SegmentLayout, x: jax.Array, targets: Targets) -> SegmentSelection:
    """``selectors.random_k`` for every segment, selecting on its scores.

    ``x`` is :func:`random_scores`' buffer (see :data:`SCORES`): the
    threshold is the float just below each segment's exact k-th largest
    score, so ``{score > threshold}`` holds the 1-D form's ``k`` draws, and
    more only where equal draws tie at the k-th (probability about ``n /
    2^30`` per segment and step). The caller's capacity cut at ``k`` then
    keeps the lower indices of the tie, as the 1-D form's ``lax.top_k``
    does: the same coordinates, always.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> layout = SegmentLayout((1000, 40))
      >>> keys = jax.random.split(jax.random.key(0), 2)
      >>> scores = random_scores(layout, jnp.zeros((5, ROW)), keys)
      >>> random_k(layout, scores, Targets(np.array([[10, 2]]))).count.tolist()
      [10, 2]
    """
    return exact_top_k(layout, x, targets)


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
    a = _abs32(x)
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
    cut = jnp.where(over, _just_below(v), t)
    return cut, jnp.where(over, limit, sizes)


def sent_mask(layout: SegmentLayout, x: jax.Array, cut: jax.Array, limit: jax.Array) -> jax.Array:
    """The messages' mask in the packed buffer (see :func:`capacity_cut`)."""
    a = _abs32(x)
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


# The selectors with a segmented form, by the 1-D selector they stand for.
SEGMENTED: dict[Callable, Callable] = {
    S1.exact_top_k: exact_top_k,
    S1.ldte_bs: ldte_bs,
    S1.dgc_sample: dgc_sample,
    S1.fixed_threshold: fixed_threshold,
    S1.binary_search: binary_search,
    S1.trimmed_top_k: trimmed_top_k,
    S1.gaussian_k: gaussian_k,
    S1.random_k: random_k,
}

# The segmented forms that select on a score buffer of their own instead of
# the elements' magnitudes, with its function ``score(layout, x, key) -> buffer``
# (``key``: one PRNG key per segment). The selector, the capacity cut and the
# mask then all read that buffer; the message still holds ``x``'s values.
SCORES: dict[Callable, Callable] = {random_k: random_scores}
