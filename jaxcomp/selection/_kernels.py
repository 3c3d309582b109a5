"""Fast one-pass kernels for threshold selection on XLA:CPU (pure JAX, static shapes).

All functions are jit-compiled, use only static shapes, no host callbacks and no custom
calls, and are exact (integer counts, bit-exact extracted values) for any input,
including ties, zeros, NaN (never selected: ``NaN > t`` is False), ``count > capacity``
and lengths that are not a multiple of the block size.

Backends. The formulations below are tuned for XLA:CPU. Where the CPU form is a
workaround for XLA:CPU's emitters (the two-output variadic reduce with an
``optimization_barrier`` copy of the threshold, the 1024-row split), the kernel picks a
plain formulation on every other platform with ``lax.platform_dependent`` (see
``_by_backend``), resolved when the program is lowered for its platform, so a CPU run
compiles exactly the program it compiled before and a CUDA export holds only the GPU
form (``tests/test_export.py`` checks both)::

    kernel              XLA:CPU (cpu=)                     other backends (default=)
    count_above         2-output variadic row reduce       jnp.sum(a > t, dtype=int32)
    count_above_many    row-split variadic, barriers       one flat m-output variadic reduce
    extract (counts)    2-output variadic row reduce       jnp.sum(rows > t, axis=1)

The two forms return identical integers (exact counts). TPU takes the plain form
deliberately (``PLATFORM_FORMS`` lists every platform's choice): the CPU form only works
around XLA:CPU's emitters (YNNPACK fusions that exclude compares, a single-output reduce
rewritten into a reduce-window tree), which TPU does not have. The plain form is what
XLA's fusion is built for on any accelerator (compare + convert + reduce as one
reduction over the whole vector), the ``optimization_barrier`` copies the CPU form needs
would only keep XLA from fusing, and the 1024-row split, which buys XLA:CPU its two
cores' loop partitioning, would only add a reshape (not measured on a TPU: none here).
A TPU export holds only the plain form, the same module as CUDA's (``tests/test_export.py``
checks it and runs that form, forced, on CPU). Not switched:
the structure of :func:`extract` (per-block counts, a scan over n / B blocks, a gather
of ``capacity x B`` elements, an in-row rank by a 0/1 matmul) is the classic two-level GPU
stream compaction; ``jnp.nonzero(mask, size=c)`` would be two n-long cumulative sums and
an n-element scatter-add instead. :func:`moments` (three plain reductions) and
:func:`dense_split` (two ``where``) are backend-neutral. The GPU forms are what XLA:GPU
is known to emit well (compare + convert fused into one reduction kernel; a variadic
reduce as one multi-output reduction); their speed has not been measured here (no GPU).

How XLA:CPU (jax 0.10.2) compiles these patterns -- the facts behind every choice below
(found with ``jax.jit(f).lower(...).compile().as_text()``):

* A reduction whose producers are all YNNPACK-supported ops (abs, neg, add, sub, mul,
  div, min, max, ceil, floor, sign, exp, convert, ...; dtypes f32/bf16 only) becomes ONE
  ``__ynn_fusion`` that streams the input: that is the floor ``sum(abs(x))``.
* ``compare``/``select`` are *not* YNNPACK ops. ``sum(a > t)`` or ``sum(where(a > t,
  1., 0.))`` therefore first materialises an n-element temporary (loop fusion), then
  reduces it, often through a tree of ``reduce-window`` fusions. A fresh n-sized
  buffer costs ~10 floors at 2^24 (64 MiB of first-touch page faults).
* Row reductions (``reshape(-1, B).sum(1)``) inside a YNN fusion are slow (3-10 floors).
* A *variadic* ``lax.reduce`` with >= 2 live int32 outputs is not YNN-eligible and is
  not split into a reduce-window tree: XLA emits one vectorised loop fusion
  (compare + convert + add) that reads the input once, in parallel over rows when the
  output is non-scalar. This is the fastest exact count found, 0.6-1.2 floors --
  sometimes faster than the YNN floor itself. A single-output ``lax.reduce`` is
  rewritten into the slow tree, and an unused second output is pruned, so the second
  output must be live: we count against ``t`` and against an
  ``optimization_barrier`` copy of ``t`` (XLA cannot prove them equal, so it can
  neither CSE the two compares nor drop one) and return their ``minimum`` (equal).
* Float sums reduced by YNN are fast but float variadic reductions are sequential
  (~10 floors), so ``moments`` uses three YNN reductions instead of one variadic one.
* Sibling elementwise outputs are NOT fused into one multi-output loop: two ``where``s of
  the same x are two loop fusions, each reading x (``dense_split`` below). A variadic
  reduce over a trailing axis of 2 does give one 2-output fusion, but it cannot write in
  place of its operand, so with donated buffers XLA adds a copy.
* An n-sized value that is read inside a ``lax.cond`` or ``lax.while_loop`` cannot be
  updated in place afterwards (XLA's buffer sharing rejects it: "buffer cannot be
  shared"), so it keeps its own buffer; when the program's outputs are two n-sized arrays
  and only one input buffer is donated, that is a fresh temporary on every call. The
  single-device sparsifier therefore gives the selector its own copy of the accumulator
  (``sparsify._select_and_send``). Fresh n-sized buffers are expensive: glibc serves
  them with ``mmap``, and the first write of a fresh 64 MiB buffer (2^24 floats) cost
  ~20-35 ms here against ~3 ms for a floor pass, ~9 ms with
  ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (huge pages) set before Python starts.

Measured medians (float32 Laplacian data, eta = 1e-3, k = ceil(eta n), capacity =
ceil(1.5 k), 2 cores; median of 3 interleaved rounds x 7 runs after warm-up). Absolute
times drift 20-50% between runs (the 2^24 floor read 1.8-3.6 ms), so ratios to the floor
``jit(sum(abs(x)))`` measured in the same run are what matter; ``a..b`` = two runs of
the ``__main__`` benchmark, single values = prototype runs (/tmp, same protocol)::

    kernel / formulation                       2^22 x floor     2^24 x floor
    floor jit(sum(abs(x)))       [ms]          0.70..0.89 ms    2.9..3.6 ms
    lax.top_k + jnp.min (reference)            20..26           31..39
    count: jnp.sum(a > t, dtype=int32)         3.1..3.6         6.8..7.7
    count: reshape(-1,1024) f32 row sums       1.9..3.3         8..10
    count: YNN sum(min(ceil(a - t), 1))        1.5..1.7         1.2..1.7
    count_above  (variadic int32, rows 1024) * 0.75..0.83       0.88..1.03
    count_above_many m=4  (one pass)         * 0.91..1.29       1.33..1.58
    count_above_many m=8                     * 0.84..1.12       1.38..1.61
    count_above_many m=16                    * 1.60..2.14       4.8..5.6
    count_many: m separate YNN sums, m=8       13..15           28
    count_many: broadcast (m, n) YNN, m=8      21..22           21
    moments (3 YNN reductions)               * 2.2..2.6         1.7..2.0
    moments (one variadic f32 reduce)          11               8.4
    extract block counts only, B=64            0.6              0.66
    extract (B=64, matmul in-row rank)       * 2.1..2.5         2.4..3.2
    extract (B=64, cumsum in-row rank)         2.6..3.4         2.9..3.1
    extract B=32 / 128 / 256 (cumsum rank)     2.8/3.5/5.7      2.8/6.1/10.9
    jnp.nonzero(mask, size=capacity)           59               54
    dense_split: sent & residual (2 fusions) * 3.4..3.8         10.6..12.2
    zeros.at[idx].set(v) + x.at[idx].set(0)    1.9..2.5         10..12
    x.at[idx].set(0) with x donated            0.13             ~1 (noisy)

(``*`` = formulation implemented here; rerun: ``python -m jaxcomp.selection._kernels``.)
At 2^24 every kernel that writes an n-sized array (dense outputs, non-donated scatter)
costs ~10 floors: the fresh 64 MiB output buffers, not the arithmetic, dominate.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "count_above",
    "count_above_many",
    "dense_split",
    "extract",
    "extract_block_size",
    "moments",
]

# Rows for the row-parallel variadic count: outputs of n / 1024 int32 partial counts
# let XLA split the loop over both cores ("outer_dimension_partitions"), while the
# final sum of n / 1024 ints is negligible. 256..4096 measured within noise.
_COUNT_ROW = 1024
# Block size for extract(): 64 minimises (count pass + cumsum over n/B blocks + gather of
# capacity x B elements). B=32 makes the count pass 2x slower (1.7 vs 0.6 floors),
# B >= 128 makes the capacity x B gather and in-row rank dominate.
_EXTRACT_BLOCK = 64


# The form each platform lowers (see the module docstring): XLA:CPU's workaround form on
# CPU, the plain one on GPUs and TPUs; any other platform takes the plain one too.
PLATFORM_FORMS = {"cpu": "cpu", "cuda": "default", "rocm": "default", "tpu": "default"}


def _by_backend(*args, cpu, default):
    """The form ``PLATFORM_FORMS`` names for the platform the program is lowered for.

    ``lax.platform_dependent``: the choice is made at lowering time per platform (no
    runtime conditional; a ``jax.export`` for ``("cuda",)`` or ``("tpu",)`` contains
    only the plain branch, one for ``("cpu", "cuda")`` both). Both branches return
    identical results. One indirection so that tests can run a platform's form on CPU.
    """
    forms = {"cpu": cpu, "default": default}
    branches = {platform: forms[form] for platform, form in PLATFORM_FORMS.items()}
    return lax.platform_dependent(*args, **branches, default=default)


def _f32(x: jax.Array) -> jax.Array:
    return x if x.dtype == jnp.float32 else x.astype(jnp.float32)


def _add_all(acc, val):
    return [a + v for a, v in zip(acc, val, strict=True)]


def _rowwise_counts(a: jax.Array, ts: list[jax.Array], row: int) -> list[jax.Array]:
    """Per-row counts of ``a > t`` for each t in ``ts``, a 2-D (rows, row) f32 array.

    ``ts`` must have >= 2 entries (see module docstring: variadic reduce trick).
    """
    ops = [(a > t).astype(jnp.int32) for t in ts]
    return lax.reduce(ops, [jnp.int32(0)] * len(ts), _add_all, (1,))


def _counts_multi(a: jax.Array, ts: list[jax.Array], row: int) -> list[jax.Array]:
    """Total counts of ``a > t`` (1-D f32 a) for each t, via the row-parallel variadic."""
    n = a.shape[0]
    nf = n // row
    totals = [jnp.int32(0)] * len(ts)
    if nf:
        # Slicing the head is fused into the reduce (no copy) when n % row != 0.
        head = a[: nf * row].reshape(nf, row) if nf * row != n else a.reshape(nf, row)
        parts = _rowwise_counts(head, ts, row)
        # dtype pinned: under jax_enable_x64 a plain sum of int32 is int64.
        totals = [jnp.sum(p, dtype=jnp.int32) for p in parts]
    if nf * row != n:
        tail = a[nf * row :]
        totals = [
            tot + jnp.sum(tail > t, dtype=jnp.int32) for tot, t in zip(totals, ts, strict=True)
        ]
    return totals


@jax.jit
def moments(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Mean, (population) variance and max |x| of a 1-D float array, in float32.

    Three YNNPACK-fused streaming reductions over x (sum(x), sum((x - x[0])^2),
    max|x|): 2.6-2.9 floors measured. A single variadic float reduce reads x once but
    XLA:CPU emits it as a sequential scalar loop (8-11 floors); a shared ``x - x[0]``
    feeding two sums gets materialised (4-8 floors). The variance is computed around
    the shift ``s = x[0]`` so that data with a large mean (100 + N(0, 1)) keep ~1e-5
    relative accuracy instead of losing everything to cancellation::

        var = mean((x - s)^2) - (mean(x) - s)^2   (clipped at 0)

    Args:
        x: 1-D float array (f32, bf16, f16, ...); n >= 1. Computed in float32.

    Returns:
        ``(mean, var, max_abs)``, three float32 scalars.
    """
    x = _f32(jnp.ravel(x))
    n = x.shape[0]
    s = x[0]
    inv_n = jnp.float32(1.0 / n)
    mean = jnp.sum(x) * inv_n
    msq = jnp.sum(jnp.square(x - s)) * inv_n
    d = mean - s
    var = jnp.maximum(msq - d * d, jnp.float32(0.0))
    return mean, var, jnp.max(jnp.abs(x))


@jax.jit
def count_above(a: jax.Array, t: jax.Array | float) -> jax.Array:
    """Exact number of elements with ``a > t`` (comparison in float32).

    One vectorised, row-parallel pass: a variadic int32 ``lax.reduce`` over rows of
    1024 with two live outputs (``a > t`` and ``a > t'`` where ``t'`` is an
    ``optimization_barrier`` copy of t), see the module docstring for why. Measured
    0.7-0.9 floors, vs 4.6 / 10 floors for ``jnp.sum(a > t, dtype=int32)`` at
    2^22 / 2^24 and 1.4-1.7 floors for the best YNN float formulation
    ``sum(min(ceil(a - t), 1))`` (which also needs care with NaN and denormals).
    Integer accumulation: exact up to 2^31 - 1 elements.

    Backend switch: on any platform but CPU the count is the plain
    ``jnp.sum(a > t, dtype=int32)`` (XLA:GPU fuses the compare into its reduction
    kernel; the second output would only double the compares). Same result.

    Args:
        a: 1-D float array (usually |x|), any float dtype; upcast to float32 in-register.
        t: scalar threshold.

    Returns:
        int32 scalar count.
    """
    a = _f32(jnp.ravel(a))
    t = jnp.asarray(t, jnp.float32)
    return _by_backend(a, t, cpu=_count_above_cpu, default=_count_above_gpu)


def _count_above_cpu(a: jax.Array, t: jax.Array) -> jax.Array:
    """:func:`count_above` on XLA:CPU: the two-output variadic row reduce."""
    t2 = lax.optimization_barrier(t)
    c0, c1 = _counts_multi(a, [t, t2], _COUNT_ROW)
    return jnp.minimum(c0, c1)


def _count_above_gpu(a: jax.Array, t: jax.Array) -> jax.Array:
    """:func:`count_above` on every other backend: one plain fused reduction.

    XLA:GPU fuses compare + convert into its reduction kernel, so the canonical
    form reads ``a`` once; the CPU trick would only double the compares.
    """
    return jnp.sum(a > t, dtype=jnp.int32)


@jax.jit
def count_above_many(a: jax.Array, ts: jax.Array) -> jax.Array:
    """Exact counts of ``a > ts[j]`` for m static candidate thresholds in ONE pass.

    Same variadic int32 row reduce as :func:`count_above` with m outputs. Measured
    (ratio to floor at 2^22 / 2^24): m=4 1.3/1.2, m=8 1.7/1.6, m=16 3.6/3.8, i.e. 8
    candidates cost ~2 single counts and far less than 8; the cost grows roughly
    linearly beyond m ~ 8 (compute-bound, one compare+add per element and candidate).

    Backend switch: on any platform but CPU, one flat m-output variadic reduce over
    ``a`` (one multi-output reduction kernel on XLA:GPU, reading ``a`` once), without
    the CPU row split, tail pass and barriers. Same result.

    Args:
        a: 1-D float array (usually |x|), any float dtype; compared in float32.
        ts: float array of shape (m,), m >= 1 static.

    Returns:
        int32 array of shape (m,).
    """
    a = _f32(jnp.ravel(a))
    ts = jnp.asarray(ts, jnp.float32).reshape(-1)
    m = ts.shape[0]
    tl = [ts[j] for j in range(m)]
    if m == 1:
        return count_above(a, tl[0])[None]
    return _by_backend(a, tl, cpu=_count_above_many_cpu, default=_count_above_many_gpu)


def _count_above_many_cpu(a: jax.Array, tl: list[jax.Array]) -> jax.Array:
    """:func:`count_above_many` on XLA:CPU: row-split variadic reduce, barriered candidates."""
    # Barrier so that equal candidates stay distinct HLO values (no CSE into one
    # output, which could fall back to the slow single-output path).
    tl = list(lax.optimization_barrier(tuple(tl)))
    return jnp.stack(_counts_multi(a, tl, _COUNT_ROW))


def _count_above_many_gpu(a: jax.Array, tl: list[jax.Array]) -> jax.Array:
    """:func:`count_above_many` elsewhere: ONE flat m-output variadic reduce.

    XLA:GPU emits a variadic reduce as one multi-output reduction kernel that reads
    ``a`` once; the CPU row split, tail pass and barriers are not needed there.
    """
    ops = [(a > t).astype(jnp.int32) for t in tl]
    return jnp.stack(lax.reduce(ops, [jnp.int32(0)] * len(tl), _add_all, (0,)))


def _row_counts_cpu(rows: jax.Array, t: jax.Array) -> jax.Array:
    """Per-row int32 counts of ``rows > t`` on XLA:CPU: two-output variadic row reduce."""
    t2 = lax.optimization_barrier(t)
    c0, c1 = _rowwise_counts(rows, [t, t2], rows.shape[1])
    return jnp.minimum(c0, c1)


def _row_counts_gpu(rows: jax.Array, t: jax.Array) -> jax.Array:
    """Per-row int32 counts of ``rows > t`` elsewhere: a plain row reduction (one kernel)."""
    return jnp.sum(rows > t, axis=1, dtype=jnp.int32)


def _block_counts(x: jax.Array, t: jax.Array, block: int) -> jax.Array:
    """int32 counts of ``|x| > t`` per block of ``block`` elements (last one partial)."""
    n = x.shape[0]
    nf = n // block
    parts = []
    if nf:
        head = x[: nf * block] if nf * block != n else x
        head = jnp.abs(_f32(head.reshape(nf, block)))
        parts.append(_by_backend(head, t, cpu=_row_counts_cpu, default=_row_counts_gpu))
    if nf * block != n:
        tail = jnp.abs(_f32(x[nf * block :]))
        parts.append(jnp.sum(tail > t, dtype=jnp.int32)[None])
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def extract_block_size(n: int, capacity: int) -> int:
    """Block size for :func:`extract`: the gather touches ``capacity x B`` elements.

    ``B = 64`` is fastest at density 1e-3 (the block-count pass gets slower
    for small B), but at 1e-2 the ``capacity x 64`` gather outgrows the tensor
    (measured 22.6 floors at 2^22 vs 7.4 with B = 8). So B is the largest power
    of two in [8, 64] with ``capacity * B <= n / 16``.
    """
    b = _EXTRACT_BLOCK
    while b > 8 and capacity * b * 16 > n:
        b //= 2
    return b


@functools.partial(jax.jit, static_argnames=("capacity", "block_size"))
def extract(
    x: jax.Array,
    t: jax.Array | float,
    capacity: int,
    *,
    block_size: int | None = None,
    upper: jax.Array | float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Indices and values of the first ``capacity`` elements with ``|x| > t``.

    With ``upper``, of those with ``t < |x| <= upper`` (a tie group: ``t``
    just below ``upper``); the per-block counts then take a second pass.

    Two-level stream compaction (2.2-2.5 floors measured, vs ~55-60 floors for
    ``jnp.nonzero(mask, size=capacity)`` and ~19 ms / 30 floors for a blockwise
    ``lax.top_k``):

    1. per-block counts of ``|x| > t`` over blocks of ``block_size`` (64) elements in
       one row-parallel variadic int32 pass (0.6-0.7 floors);
    2. inclusive ``jnp.cumsum`` of the n / 64 block counts (``lax.associative_scan``
       and a two-level/matmul scan measured within noise of it);
    3. for each output slot p: its block ``b = searchsorted(incl, p, 'right')`` (the
       default 'scan' method; 'sort' was 4x slower, 'compare_all' 400 ms) and rank
       ``r = p - excl[b]`` inside that block;
    4. gather the ``capacity x 64`` elements of those blocks, rank the selected ones in
       each row with a float32 matmul by a 64 x 64 upper-triangular ones matrix
       (exact: sums <= 64; 15-25% faster than ``jnp.cumsum(axis=1)``), and take
       ``j = #{columns with rank <= r}`` as the in-block position.

    Backend switch: on any platform but CPU the per-block counts of step 1 are a plain
    row reduction ``jnp.sum(|rows| > t, axis=1)``; steps 2-4 are the same everywhere
    (the structure is the usual GPU two-level compaction, see the module docstring).
    Same result.

    Slots ``p >= count`` are padding: index ``n`` (out of range, so
    ``.at[idx].set(v, mode="drop")`` ignores it) and value 0.

    Args:
        x: 1-D float array (any float dtype), n >= 1, n < 2^31 - block_size.
        t: scalar threshold; the comparison ``|x| > t`` is done in float32.
        capacity: static number of output slots, >= 1.
        block_size: static block size; ``None`` picks one from the density
            (:func:`extract_block_size`).
        upper: optional scalar bound, compared in float32 like ``t``.

    Returns:
        ``(indices, values, count)``: int32[capacity] ascending indices,
        x.dtype[capacity] values ``x[indices]``, and the int32 total number of
        selected elements (may exceed ``capacity``).
    """
    x = jnp.ravel(x)
    n = x.shape[0]
    bsz = extract_block_size(n, capacity) if block_size is None else block_size
    t = jnp.asarray(t, jnp.float32)
    counts = _block_counts(x, t, bsz)
    if upper is not None:
        upper = jnp.asarray(upper, jnp.float32)
        counts = counts - _block_counts(x, upper, bsz)
    nb = counts.shape[0]
    incl = jnp.cumsum(counts, dtype=jnp.int32)
    total = incl[-1]
    p = jnp.arange(capacity, dtype=jnp.int32)
    blk = jnp.searchsorted(incl, p, side="right").astype(jnp.int32)
    blk = jnp.minimum(blk, nb - 1)
    rank = p - (incl[blk] - counts[blk])
    pos = blk[:, None] * bsz + jnp.arange(bsz, dtype=jnp.int32)[None, :]
    rows = x.at[pos].get(mode="fill", fill_value=0)
    sel = (jnp.abs(_f32(rows)) > t) & (pos < n)
    if upper is not None:
        sel = sel & ~(jnp.abs(_f32(rows)) > upper)
    tri = jnp.triu(jnp.ones((bsz, bsz), jnp.float32))
    csum = jnp.dot(sel.astype(jnp.float32), tri, precision=lax.Precision.HIGHEST)
    j = jnp.sum(csum <= rank[:, None].astype(jnp.float32), axis=1, dtype=jnp.int32)
    j = jnp.minimum(j, bsz - 1)
    valid = p < total
    idx = jnp.where(valid, blk * bsz + j, n)
    picked = jnp.take_along_axis(rows, j[:, None], axis=1)[:, 0]
    vals = jnp.where(valid, picked, jnp.zeros((), x.dtype))
    return idx, vals, total


@jax.jit
def dense_split(x: jax.Array, t: jax.Array | float) -> tuple[jax.Array, jax.Array]:
    """Dense ``sent = where(|x| > t, x, -0.)`` and ``residual = where(|x| > t, -0., x)``.

    XLA:CPU (jax 0.10.2) emits two loop fusions, each reading x (it does not fuse
    sibling elementwise outputs); using ``where`` for both (not ``x - sent``) keeps
    every entry of x bit-exact in one of the two outputs. The filler zero is ``-0.0``
    so that even the float sum ``sent + residual`` equals x bit-for-bit for every
    non-NaN x, including ``-0.0`` (``+0.0 + -0.0`` would give ``+0.0``; ``-0.0 + y ==
    y`` bitwise for all y). Writing two n-sized outputs
    costs far more than the read (fresh output buffers are first-touched): measured
    3.4-3.8 floors at 2^22 and 10.6-12.2 floors at 2^24. Scattering ``capacity`` values instead
    (``zeros.at[idx].set(vals, mode="drop")`` + ``x.at[idx].set(0, mode="drop")``)
    costs 1.9-2.5 / 10-12 floors: again the two n-sized outputs (zero fill and copy of
    x) dominate; the scatter itself is ~0.1 ms for 6k slots (0.13 floors measured for
    ``x.at[idx].set(0)`` with x donated, i.e. updated in place).

    Args:
        x: float array (any shape/dtype).
        t: scalar threshold (comparison in float32).

    Returns:
        ``(sent, residual)`` with x's shape and dtype.
    """
    t = jnp.asarray(t, jnp.float32)
    keep = jnp.abs(_f32(x)) > t
    zero = jnp.array(-0.0, x.dtype)  # see docstring: -0.0 + y == y bitwise
    return jnp.where(keep, x, zero), jnp.where(keep, zero, x)


def _benchmark() -> None:  # pragma: no cover - manual tool
    import time

    import numpy as np

    def bench_all(cases, rounds=3, reps=7):
        # Interleaved rounds so that drift hits every case (and the floor) alike.
        for f, *args in cases.values():
            jax.block_until_ready(f(*args))
            jax.block_until_ready(f(*args))
        times = {name: [] for name in cases}
        for _ in range(rounds):
            for name, (f, *args) in cases.items():
                for _ in range(reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(f(*args))
                    times[name].append(time.perf_counter() - t0)
        return {name: float(np.median(v)) * 1e3 for name, v in times.items()}

    for lg in (22, 24):
        n = 2**lg
        xn = np.random.default_rng(0).laplace(5e-4, 5e-3 / np.sqrt(2), n).astype(np.float32)
        x = jnp.asarray(xn)
        a = jnp.abs(x)
        k = math.ceil(1e-3 * n)
        cap = math.ceil(1.5 * k)
        t = jnp.float32(np.sort(np.abs(xn))[-k])
        floor = jax.jit(lambda x: jnp.sum(jnp.abs(x)))
        idx = jnp.arange(cap, dtype=jnp.int32) * 97
        vals = x[idx]
        cases = {
            "floor sum(abs(x))": (floor, x),
            "top_k + min": (jax.jit(lambda x, k=k: jnp.min(lax.top_k(jnp.abs(x), k)[0])), x),
            "sum(a > t) int32": (jax.jit(lambda a, t: jnp.sum(a > t, dtype=jnp.int32)), a, t),
            "count_above": (count_above, a, t),
            "moments": (moments, x),
            "extract": (functools.partial(extract, capacity=cap), x, t),
            "dense_split": (dense_split, x, t),
            "scatter set x2": (
                jax.jit(
                    lambda x, i, v: (
                        jnp.zeros_like(x).at[i].set(v, mode="drop"),
                        x.at[i].set(0, mode="drop"),
                    )
                ),
                x,
                idx,
                vals,
            ),
        }
        for m in (4, 8, 16):
            ts = jnp.linspace(t * 0.8, t * 1.2, m)
            cases[f"count_above_many m={m}"] = (count_above_many, a, ts)
        res = bench_all(cases)
        fl = res["floor sum(abs(x))"]
        for name, ms in res.items():
            print(f"2^{lg} {name:24s} {ms:9.3f} ms {ms / fl:7.2f} x floor", flush=True)


if __name__ == "__main__":  # pragma: no cover
    _benchmark()
