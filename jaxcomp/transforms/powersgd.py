"""PowerSGD: low-rank gradient compression by power iteration (Vogels et al., 2019).

The algorithm of PyTorch's DDP communication hook ``powerSGD_hook``, as one
optax ``GradientTransformationExtraArgs``. Per step, every leaf of two or more
dimensions is viewed as an ``n x m`` matrix (``reshape="first"``: the hook's
``(shape[0], prod(shape[1:]))``) and, if that pays (below), compressed with
rank ``r = min(n, m, rank)``:

    M      = e + g                      # error feedback (M = g without)
           = rs e + gs g                # GRACE's residual_scale=rs, gradient_scale=gs
    Q      = orth(Q_prev)               # warm start; the first step: random normal
    P      = orth(sum over devices of M Q)           # all-reduce 1: n x r
    Q      = (sum over devices of M^T P) / N         # all-reduce 2: m x r
    S      = P Q^T                      # the same on every device, rank <= r
    e_new  = M - S                      # each device's own M
    update = S

``orth`` is the hook's ``_orthogonalize``: modified Gram-Schmidt on the
columns (:func:`orthogonalize`) for ``r <= 2`` or a half-precision ``P``/``Q``,
the ``Q`` factor of a QR factorisation otherwise (LAPACK on CPU, cuSOLVER on
GPU; ``orthogonalization_epsilon`` is then unused, as in the hook). Both have
a fixed program size whatever ``r`` (the Gram-Schmidt loop is a
``lax.fori_loop``). Both exchanges are all-reduces (sums are linear), so the
bytes per device are those of a ring all-reduce of ``(n + m) r`` values
instead of ``n m``. A leaf is compressed only if ``(n + m) r *
min_compression_rate < n m`` (the hook's test, counted in elements); scalars,
1-D leaves, empty leaves and leaves that fail the test are averaged dense, as
the hook's "uncompressed tensors" are.

Leaves whose matrices have the same ``(n, m)`` (and compute dtype) are
stacked and orthogonalised and multiplied as one batch (the hook's
``batch_tensors_with_same_shape``), and the ``P`` of every compressed leaf
travels in one flat buffer, their ``Q`` in another and the dense leaves in a
third (the hook's contiguous ``p_memory``/``q_memory`` and uncompressed
buffers; one buffer per dtype): the all-reduces per step do not grow with the
number of leaves. A leaf gets the update it gets alone, up to float32 rounding
(XLA picks other kernels for a batch).

Batched (``batched=True``, PyTorch's ``batched_powerSGD_hook``): a bucket is
every leaf of one gradient dtype with more than ``min_dense_size`` elements,
in ``jax.tree.flatten`` order (the hook's bucket is DDP's, of one dtype; the
per-dtype buffers above are the same grouping). The bucket's accumulators are
flattened, concatenated and zero-padded to ``s * s`` with ``s =
ceil(sqrt(size))``, and that one ``s x s`` matrix is compressed as above at
``r = min(s, rank)``: one ``P`` and one ``Q`` per bucket, ``2 s r`` values on the
wire whatever the number of leaves (scalars and biases included), the
warm-started ``Q`` stored at the bucket's first leaf. Error feedback is per
element, so it is the hook's on the flattened bucket, with one difference:
the hook also keeps the error of the padding (``-S`` there) and adds it back
next step; here the padding is zero every step (it is no gradient). The
bucket is compressed when ``2 s r * min_compression_rate < s^2`` (the hook
always compresses). Batching leaves without aligning their rows destroys
their low-rank structure: the hook's documentation recommends it at rank 1,
where it is cheapest, and warns that accuracy usually drops.

16-bit ``P`` and ``Q`` (``pq_dtype``): PyTorch gets them by wrapping the hook
in ``fp16_compress_wrapper``/``bf16_compress_wrapper``, which casts the whole
bucket to 16 bits, runs the hook there (``M``, the residual, the products,
Gram-Schmidt and ``S`` all in 16 bits) and casts ``S`` back. Here only what
travels is 16-bit: each device's ``M Q`` and ``P^T M``, divided by the device
count ``N``, are rounded to ``pq_dtype`` and all-reduced in it (their sums
rounded as the collective adds; XLA:CPU promotes a 16-bit all-reduce to
float32 and rounds the sum once), then used in the compute dtype: ``P =
orth(sum)``, ``Q = sum * N / K``. ``M``, the residual, the
orthogonalisation and ``S`` stay in the compute dtype, so the rounding of
``P`` and ``Q`` lands in ``S`` and the residual ``M - S`` keeps it (nothing is
lost; a 16-bit residual, the wrapper's, would lose the small errors that error
feedback exists to keep). The division by ``N`` (exact for a power of two;
the hook's ``fp16_compress_hook`` divides before its all-reduce too) and a
saturating cast below ``max / N`` keep a float16 sum of ``N`` messages finite:
with gradients beyond float16's range the messages saturate (``P``'s scale
does not matter, it is orthogonalised; a saturated ``Q`` gives an ``S`` that
is no projection), the update stays finite and the residual keeps the rest.
Bytes: 2 per value in ``message_bytes`` and ``wire_bytes``.

Contracts (tested): the update is identical on every device (typed
device-invariant under ``shard_map``'s ``check_vma``, like the other jaxcomp
exchanges); its rank per leaf is at most ``r``; it is ``P P^T M`` (summed
over the devices) with ``P`` orthonormal also when ``M`` has rank below
``r`` (a gradient from a small batch); nothing is lost per device:
``e_new`` is the correctly rounded ``M - S`` with ``S`` the update as returned
(cast back from the gradient dtype), so ``S + e_new == M`` up to that one
rounding (``|S + e_new - M| <= ulp(M - S) / 2``), as for the quantizers:
``S`` is a computed product, not a selection of ``M``, so an exactly
representable ``M - S`` need not exist.

Layout of the code: :func:`powersgd` validates its arguments into a frozen
:class:`_Config`; ``init`` and ``update`` are the module-level :func:`_init`
and :func:`_update` over it. A step (:func:`_update_leaves`) reads the leaves
and the state into :class:`_StepInputs` (accumulators ``M``, plans, the
:class:`_Group` batches or buckets, from :func:`_layout`), averages the dense leaves
(:func:`_exchange_dense_leaves`), then runs the power iteration over the
groups (:func:`_power_step`: ``M Q`` per group in :func:`_local_p`, the two
all-reduces :func:`_exchange_p` and :func:`_exchange_q`, ``S = P Q^T`` and
each leaf's update, message and ``Q`` in :func:`_finish_group`, and before
``start_iter`` the dense average in their place, :func:`_vanilla_override`).
The steps fill one :class:`_LeafResults`, from which :func:`_new_state`
writes the residuals ``e_new = M - S`` and the statistics.

Differences from the hook, each deliberate:

- A zero column is left zero by Gram-Schmidt (the hook divides by its zero
  norm and returns NaN unless ``orthogonalization_epsilon > 0``), and so is a
  column that the projections cancelled to ``sqrt(eps)`` of its norm or less
  (the rounding noise left by a matrix of rank ``< r``; the hook normalises it
  into a column that is not orthogonal to the others, and ``P (M^T P)^T`` is
  then no projection of ``M``: off by 40-110% of ``max |M|`` in the tests, with
  the hook's arithmetic). Norms
  are computed scaled by the column's largest magnitude, so they do not
  overflow.
- A column of the new ``Q`` that is exactly zero keeps its previous value (a
  zero gradient would otherwise zero the warm-started ``Q`` for good: ``P = M
  Q`` stays 0 and the leaf is never sent again).
- The QR's columns get the signs that make ``R``'s diagonal >= 0, so its ``Q``
  is Gram-Schmidt's in exact arithmetic and the same on every platform (the
  hook keeps the LAPACK/cuSOLVER signs). ``S`` does not depend on the signs;
  the stored ``Q`` does.
- ``P`` and ``Q`` travel in the residual dtype (float32, float64 under
  ``jax_enable_x64`` for float64 leaves), also for bfloat16/float16 gradients
  (the hook computes them in the gradient dtype, and so orthogonalises
  half-precision gradients by Gram-Schmidt at every rank; here only a
  ``residual_dtype`` of bfloat16/float16 does).
- Leaves of the same matrix shape are always batched (the hook's
  ``batch_tensors_with_same_shape`` defaults to False); the whole tree is one
  bucket (the hook exchanges per DDP bucket).
- Dense leaves keep only the rounding to the gradient dtype in their residual
  (jaxcomp's convention); the hook stores ``local - mean`` for them, which
  averages to zero over the devices, so the updates are the same.
- Matrix products use ``Precision.HIGHEST`` (no TF32/bf16 passes on GPU/TPU).
- ``start_iter`` defaults to 0 (the hook's 1000 and its ``> 1`` requirement
  come from DDP rebuilding its buckets after the first iteration).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp import _sharding, _vma
from jaxcomp import _validation as V
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.transforms.base import (
    ResidualScaling,
    apply_nonfinite_policy,
    check_common_options,
    check_residual_scaling,
    indices_by_dtype,
    resolve_residual_dtype,
    scaled_accumulation,
)
from jaxcomp.transforms.two_level import accepts_two_level_axis

__all__ = [
    "POWERSGD_RESHAPES",
    "PQ_DTYPES",
    "PowerSGDState",
    "bucket_plan",
    "matrix_plan",
    "orthogonalize",
    "powersgd",
]

# Values of the ``reshape`` argument: which axes of a >2-D leaf become the rows.
POWERSGD_RESHAPES = ("first", "last")

# Values of the ``pq_dtype`` argument besides None: the 16-bit P and Q all-reduces.
PQ_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))

_WHO = "jaxcomp.powersgd"


def _matrix_rows(arguments: dict):
    """Two-level shards keep whole rows of the matrix view (``reshape``); a bucket
    (``batched=True``) is flattened anyway, so its shards are element-wise."""
    if arguments.get("batched", False):
        return None
    if arguments.get("reshape", "first") == "last":
        return lambda shape: shape[-1] if len(shape) >= 2 else 1
    return lambda shape: math.prod(shape[1:]) if len(shape) >= 2 else 1


def matrix_plan(
    shape: tuple[int, ...],
    rank: int,
    *,
    min_compression_rate: float = 2.0,
    min_dense_size: int = 0,
    reshape: str = "first",
) -> tuple[int, int, int] | None:
    """``(n, m, r)`` if a leaf of this shape is compressed, else ``None`` (sent dense).

    ``reshape="first"`` views the leaf as ``(shape[0], prod(shape[1:]))``, the
    hook's ``tensor.view(shape[0], -1)`` (PyTorch's out-channels-first
    kernels); ``"last"`` as ``(prod(shape[:-1]), shape[-1])``, the same matrix
    up to a transpose for Flax's ``(kh, kw, in, out)`` convolution kernels
    (``"first"`` would make their rows the ``kh`` kernel rows). ``r = min(n, m,
    rank)``. Compressed when the leaf has at least two dimensions, more than
    ``min_dense_size`` elements and ``(n + m) r * min_compression_rate < n m``.

    Example:
      >>> matrix_plan((512, 256), 4), matrix_plan((256,), 4), matrix_plan((4, 4), 4)
      ((512, 256, 4), None, None)
      >>> matrix_plan((3, 3, 64, 128), 2), matrix_plan((3, 3, 64, 128), 2, reshape="last")
      (None, (576, 128, 2))

      (A Flax kernel viewed as ``3 x 73728`` does not pay at rank 2: sent dense.)
    """
    size = math.prod(shape)
    if len(shape) < 2 or size == 0 or size <= min_dense_size:
        return None
    if reshape == "first":
        n, m = shape[0], size // shape[0]
    else:
        n, m = size // shape[-1], shape[-1]
    r = min(n, m, rank)
    if not (n + m) * r * min_compression_rate < n * m:
        return None
    return n, m, r


def _scaled_norm(c: jax.Array) -> jax.Array:
    """``||c||_2`` over the last axis, as ``a ||c / a||_2`` with ``a = max |c|`` (no overflow)."""
    a = jnp.max(jnp.abs(c), axis=-1, keepdims=True)
    live = a > 0
    s = jnp.where(live, a, 1)
    norm = jnp.where(live, s * jnp.sqrt(jnp.sum(jnp.square(c / s), axis=-1, keepdims=True)), 0)
    return norm[..., 0]


def _drop_tolerance(dtype) -> float:
    """Relative norm below which a projected column is rounding noise (see orthogonalize)."""
    return float(jnp.finfo(dtype).eps) ** 0.5


def orthogonalize(x: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Modified Gram-Schmidt on the columns of ``x`` (``[..., k, r]``), the hook's arithmetic.

    Column ``i`` is divided by ``||x_i|| + epsilon``, then its projection is
    removed from the columns after it. One ``lax.fori_loop`` over the columns:
    the program's size does not grow with ``r``. Leading axes are a batch of
    independent matrices.

    Two guards the hook does not have: a column whose norm (plus ``epsilon``) is
    zero stays zero (the hook would divide by zero), and so does a column that
    the projections cancelled to ``sqrt(eps)`` of its norm before them or less
    (``eps`` of ``x``'s dtype; 3.5e-4 in float32). Such a column is rounding
    noise: a matrix of rank ``< r`` (a gradient from a small batch) leaves it,
    and normalised it would not be orthogonal to the columns before it (its
    error relative to its own norm is about ``eps`` over that ratio), so
    ``P (M^T P)^T`` would no longer be a projection of ``M``.

    Example:
      >>> import jax.numpy as jnp
      >>> (5 * orthogonalize(jnp.array([[3.0, 1.0], [4.0, 0.0]]))).round().tolist()
      [[3.0, 4.0], [4.0, -3.0]]
      >>> orthogonalize(jnp.array([[1.0, 2.0], [1.0, 2.0]]))[:, 1].tolist()  # rank 1: dropped
      [0.0, 0.0]
    """
    *batch, k, r = x.shape
    if k == 0 or r == 0:
        return x
    tol = jnp.asarray(_drop_tolerance(x.dtype), x.dtype)
    eps = jnp.asarray(epsilon, x.dtype)
    # [B, r, k]: a column is a contiguous row.
    xt = jnp.swapaxes(x, -1, -2).reshape(math.prod(batch), r, k)
    before = _scaled_norm(xt)  # [B, r]
    later = jnp.arange(r)[:, None]

    def body(i, xt):
        c = lax.dynamic_index_in_dim(xt, i, axis=1, keepdims=False)  # [B, k]
        norm = _scaled_norm(c)
        denom = norm + eps
        live = (denom > 0) & (norm > tol * lax.dynamic_index_in_dim(before, i, 1, False))
        c = jnp.where(live[:, None], c / jnp.where(live, denom, 1)[:, None], 0)
        dots = jnp.sum(c[:, None, :] * xt, axis=-1)  # [B, r]
        xt = jnp.where(later > i, xt - dots[..., None] * c[:, None, :], xt)
        return lax.dynamic_update_index_in_dim(xt, c, i, axis=1)

    xt = lax.fori_loop(0, r, body, xt)
    return jnp.swapaxes(xt.reshape(*batch, r, k), -1, -2)


def _qr_orthogonalize(x: jax.Array) -> jax.Array:
    """The ``Q`` factor of a Householder QR of ``x`` (``[..., k, r]``, ``k >= r``), its
    columns' signs chosen so that ``R``'s diagonal is >= 0 (Gram-Schmidt's ``Q`` in exact
    arithmetic, whatever sign convention the LAPACK/cuSOLVER routine has)."""
    q, rr = jnp.linalg.qr(x, mode="reduced")
    sign = jnp.where(jnp.diagonal(rr, axis1=-2, axis2=-1) < 0, -1, 1).astype(q.dtype)
    return q * sign[..., None, :]


def _orth(x: jax.Array, epsilon) -> jax.Array:
    """The hook's ``_orthogonalize``: Gram-Schmidt for ``r <= 2`` or a half-precision
    dtype, a QR factorisation otherwise (``epsilon`` is then unused, as in the hook)."""
    r = x.shape[-1]
    if r <= 2 or jnp.dtype(x.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        return orthogonalize(x, epsilon)
    return _qr_orthogonalize(x)


def _bmm(a, b, contract):
    """Batched ``a`` times ``b`` (axis 0 the batch), contracting the given dims, at full
    precision."""
    return lax.dot_general(a, b, (contract, ((0,), (0,))), precision=lax.Precision.HIGHEST)


def _to_dtype(x: jax.Array, dtype) -> jax.Array:
    """Casts to ``dtype``, saturating at its largest finite value (float16).

    A low-rank approximation can exceed the largest element of ``M``; with
    error feedback the excess stays in the residual rather than becoming inf.
    """
    dtype = jnp.dtype(dtype)
    big = float(jnp.finfo(dtype).max)
    if big < float(jnp.finfo(x.dtype).max):
        x = jnp.clip(x, -big, big)
    return x.astype(dtype)


def _finite(x: jax.Array) -> jax.Array:
    """Per matrix of a ``[B, k, r]`` batch, whether all its elements are finite."""
    return jnp.isfinite(jnp.sum(x - x, axis=(1, 2)))


def _split(buf: jax.Array, like: list) -> list:
    """The flat ``buf`` cut back into arrays shaped like ``like`` (in order)."""
    out, start = [], 0
    for x in like:
        out.append(buf[start : start + x.size].reshape(x.shape))
        start += x.size
    return out


def _psum_flat(xs: list, axis_name, count=None):
    """``(sums of xs over the devices, summed count)`` in one all-reduce per dtype.

    Each dtype's arrays travel flattened in one buffer, so the number of
    collectives does not grow with the number of leaves (the hook's contiguous
    ``p_memory``/``q_memory``). ``count`` (a float32 scalar, or None) rides at
    the end of the float32 buffer, or travels alone if there is none.
    """
    out: list = [None] * len(xs)
    groups = indices_by_dtype(xs)
    f32 = jnp.dtype(jnp.float32)
    host = f32 if count is not None and f32 in groups else None
    total = None if host is not None or count is None else lax.psum(count, axis_name)
    for dt, idx in groups.items():
        parts = [xs[i].reshape(-1) for i in idx]
        if dt == host:
            parts.append(count.astype(dt)[None])
        buf = lax.psum(parts[0] if len(parts) == 1 else jnp.concatenate(parts), axis_name)
        for i, s in zip(idx, _split(buf, [xs[i] for i in idx]), strict=True):
            out[i] = s
        if dt == host:
            total = buf[-1].astype(jnp.float32)
    return out, total


def _dense_means(xs: list, axis_name) -> list:
    """:func:`jaxcomp.comm.dense_mean` of each array, one all-reduce per dtype (the
    hook's contiguous buffer of uncompressed tensors). Elementwise the same as one
    ``dense_mean`` per array."""
    out: list = [None] * len(xs)
    for idx in indices_by_dtype(xs).values():
        parts = [xs[i].reshape(-1) for i in idx]
        buf = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
        mean, _ = collectives.dense_mean(buf, axis_name)
        for i, s in zip(idx, _split(mean, [xs[i] for i in idx]), strict=True):
            out[i] = s
    return out


def _zeros(xs):
    """Constant zeros like ``xs`` (device-invariant, as a psum is: cond branches type alike)."""
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), xs)


def _draw_q(key, step, index, m, r, dtype):
    """The random ``Q`` of leaf ``index`` at step ``step`` (identical on every device)."""
    k = jax.random.fold_in(jax.random.fold_in(key, step), index)
    return jax.random.normal(k, (m, r), dtype)


class PowerSGDState(NamedTuple):
    """State of :func:`powersgd`.

    Per-leaf statistics are pytrees shaped like the gradients with one scalar
    per leaf; read them with ``optax.tree.get(opt_state, "message_bytes")``
    even inside an ``optax.chain``.

    Attributes:
      step: int32, number of updates so far (steps before ``start_iter`` are
        dense).
      residual: the error-feedback memory ``e``, a pytree like the gradients
        in the residual dtype (per device under ``shard_map``); ``None`` with
        ``error_feedback=False``.
      q: the warm-started ``Q`` per leaf, an ``[m, r]`` array in the residual
        dtype for compressed leaves and ``None`` for dense ones (the mean
        ``Q`` of the last PowerSGD step, identical on every device; before
        the first one, the initial random draw). ``batched=True``: the
        bucket's ``[s, r]`` at its first leaf, ``None`` at its others.
        ``None`` with ``warm_start=False``.
      key: raw uint32 PRNG key data. Leaf ``i`` (in ``jax.tree.flatten``
        order) draws ``Q`` at step ``t`` from ``jax.random.normal(fold_in(
        fold_in(key, t), i), (m, r))``: once, at ``t = start_iter``, with a
        warm start, every step without. No device index is folded in, so
        every device draws the same ``Q``.
      message_bytes: int32 per leaf, bytes this device contributed in the last
        step: ``(n + m) r`` values of ``P`` and ``Q`` in the residual dtype
        (``pq_dtype``: 2 bytes each; ``batched=True``: a bucket's ``2 s r``
        counted at its first leaf, 0 at the others), or the dense leaf in the
        gradient dtype (dense leaves; every leaf before ``start_iter``); 0 on a
        step that sent nothing.
      wire_bytes: float32, bytes this device put on the wire in the last step:
        a ring all-reduce's ``2 (N - 1) / N`` times each message, plus one
        float32 count with ``nonfinite="skip"`` (0 with ``axis_name=None``).
      nonfinite_steps: int32, steps whose gradients held NaN or Inf.
    """

    step: jax.Array
    residual: Any
    q: Any
    key: jax.Array
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


class _Group(NamedTuple):
    """Compressed leaves whose matrices share ``(n, m, r)`` and the compute dtype: one
    batch (the hook's ``batch_tensors_with_same_shape``); or, with ``flat``, one
    bucket (``batched=True``): the leaves flattened, concatenated and zero-padded into
    one ``n x n`` matrix."""

    n: int
    m: int
    r: int
    cdt: Any
    leaves: tuple
    flat: bool = False


def _groups(plans: list, cdts: list) -> list:
    """The batches of compressed leaves, in order of their first leaf."""
    groups: dict = {}
    for i, (pl, cdt) in enumerate(zip(plans, cdts, strict=True)):
        if pl is not None:
            groups.setdefault((*pl, jnp.dtype(cdt)), []).append(i)
    return [_Group(*key, tuple(idx)) for key, idx in groups.items()]


def bucket_plan(
    size: int, rank: int, *, min_compression_rate: float = 2.0
) -> tuple[int, int, int] | None:
    """``(s, s, r)`` if a bucket of ``size`` elements is compressed (``batched=True``), else
    ``None`` (sent dense).

    The hook's ``batched_powerSGD_hook`` views the flattened bucket, zero-padded, as an
    ``s x s`` matrix with ``s = ceil(sqrt(size))``; ``r = min(s, rank)``. Compressed when
    ``2 s r * min_compression_rate < s^2`` (the per-leaf test of :func:`matrix_plan`;
    the hook compresses every bucket).

    Example:
      >>> bucket_plan(1000, 4), bucket_plan(10, 4), bucket_plan(0, 1)
      ((32, 32, 4), None, None)
    """
    if size <= 0:
        return None
    s = math.isqrt(size - 1) + 1  # ceil(sqrt(size)), exact for any int
    r = min(s, rank)
    if not 2 * s * r * min_compression_rate < s * s:
        return None
    return s, s, r


def _layout(cfg: _Config, leaves: list, cdts: list) -> tuple[list, list]:
    """``(plans, groups)``: per leaf its matrix plan (``None``: sent dense), and the
    :class:`_Group` batches of the compressed leaves.

    ``batched=True``: a bucket is every leaf of one gradient dtype (hence one compute
    dtype) with more than ``min_dense_size`` elements (and at least one), in
    ``jax.tree.flatten`` order; each member's plan is its bucket's ``(s, s, r)``.
    """
    if not cfg.batched:
        plans = [_plan(cfg, jnp.shape(x)) for x in leaves]
        return plans, _groups(plans, cdts)
    plans: list = [None] * len(leaves)
    groups = []
    members: dict = {}
    for i, x in enumerate(leaves):
        size = math.prod(jnp.shape(x))
        if size > 0 and size > cfg.min_dense_size:
            dtype = x.dtype if hasattr(x, "dtype") else jnp.result_type(x)
            members.setdefault((jnp.dtype(dtype), jnp.dtype(cdts[i])), []).append(i)
    for (_, cdt), idx in members.items():
        size = sum(math.prod(jnp.shape(leaves[i])) for i in idx)
        pl = bucket_plan(size, cfg.rank, min_compression_rate=cfg.min_compression_rate)
        if pl is None:
            continue
        for i in idx:
            plans[i] = pl
        groups.append(_Group(*pl, cdt, tuple(idx), flat=True))
    return plans, groups


@accepts_two_level_axis(row_length=_matrix_rows)
def powersgd(
    rank: int,
    *,
    axis_name: Any = None,
    start_iter: int | None = None,
    min_compression_rate: float | None = None,
    min_dense_size: int | None = None,
    error_feedback: bool = True,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    warm_start: bool = True,
    orthogonalization_epsilon: float | None = None,
    reshape: str = "first",
    batched: bool = False,
    pq_dtype: Any = None,
    residual_dtype: Any = None,
    nonfinite: str = "skip",
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """PowerSGD, rank-``rank`` compression by one step of power iteration per leaf.

    See the module docstring for the algorithm. Options follow PyTorch's
    ``PowerSGDState``: ``rank`` is ``matrix_approximation_rank``,
    ``start_iter`` ``start_powerSGD_iter``, ``error_feedback``
    ``use_error_feedback``.

    Args:
      rank: the approximation rank ``r``, an int >= 1 (per leaf ``min(n, m,
        rank)``).
      axis_name: mesh axis to average over inside ``shard_map``/``pmap``: one
        all-reduce for the ``P`` of every compressed leaf, then one for their
        ``Q``, and one for the dense leaves (one buffer per dtype), whatever the
        number of leaves; every device gets the same update. ``None``: the local
        rank-r approximation (one device).
      start_iter: steps ``0 .. start_iter - 1`` average every leaf dense
        (vanilla all-reduce, as the hook; the residual stays zero); PowerSGD
        from step ``start_iter`` on (None: 0). One compilation: with ``start_iter > 0``
        only the collectives sit in a ``lax.cond`` on the step (the dense
        all-reduce of the compressed leaves in one branch, ``P`` in the other;
        then ``Q``), so vanilla steps also compute the (unsent) low-rank
        products, and PowerSGD steps send what they send without
        ``start_iter``.
      min_compression_rate: a leaf is compressed only if ``(n + m) r *
        min_compression_rate < n m`` (element counts), a real >= 0 (None:
        2, the hook's default).
      min_dense_size: leaves with at most this many elements are sent dense
        (None: 0; the rate test above already sends small matrices dense).
      error_feedback: keep ``e = M - S`` per device and add it to the next
        gradient (the paper's and the hook's default). ``False``: no residual
        is allocated (``state.residual`` is None).
      residual_scale: GRACE's ``ResidualMemory`` ``beta`` in [0, 1] (may be
        traced): ``M = residual_scale * e + gradient_scale * g``, ``e_new = M -
        S``; a skipped (non-finite) step keeps ``e``. None: 1. Needs
        ``error_feedback=True``.
      gradient_scale: GRACE's ``gamma`` > 0 (may be traced). None: 1.
      warm_start: reuse the last step's ``Q`` (orthogonalized) instead of a
        fresh random draw every step; keeps ``Q`` in ``state.q``.
      orthogonalization_epsilon: added to each column norm in
        :func:`orthogonalize`, a real >= 0 (None: 0, the hook's default).
        Unused where ``r > 2`` (a QR orthogonalises, as in the hook) unless
        ``residual_dtype`` is bfloat16/float16. Only arithmetic uses it, so it
        may be traced
        (``optax.inject_hyperparams``). ``start_iter``,
        ``min_compression_rate`` and ``min_dense_size`` fix the program
        (which leaves are compressed, the dense steps): pass them in
        ``static_args`` when you give them to ``inject_hyperparams``.
      reshape: ``"first"`` (the hook's ``(shape[0], -1)``) or ``"last"``
        (``(-1, shape[-1])``, for Flax's ``(kh, kw, in, out)`` kernels), see
        :func:`matrix_plan`. 2-D leaves are the same either way. Unused with
        ``batched=True``.
      batched: PyTorch's ``batched_powerSGD_hook``: all leaves of one dtype
        (more than ``min_dense_size`` elements each) flattened into one
        zero-padded square matrix of side ``ceil(sqrt(size))`` with one ``P``
        and one ``Q`` (see the module docstring and :func:`bucket_plan`). Far
        fewer bytes and a smaller program than per-leaf PowerSGD at the same
        rank, usually at a worse approximation (the hook recommends rank 1).
      pq_dtype: ``None`` (default: ``P`` and ``Q`` travel in the compute dtype)
        or ``jnp.float16``/``jnp.bfloat16``: the two all-reduces in 16 bits
        (PyTorch's ``fp16_compress_wrapper``/``bf16_compress_wrapper`` around
        the hook, applied to the messages only; the rounding stays in the
        residual; float16 saturates instead of overflowing, and its messages
        below ``6e-8`` round to zero, kept in the residual; see the module
        docstring). With ``nonfinite="skip"`` the count then travels in an
        all-reduce of its own.
      residual_dtype: float dtype of the residual, of ``P``, ``Q`` and of the
        computation. ``None`` (default): float32, or the leaf's dtype where
        wider (float64 under ``jax_enable_x64``), as in :func:`jaxcomp.sparsify`.
      nonfinite: policy for NaN/Inf gradients. ``"skip"`` (default): a device
        whose gradients hold a non-finite element contributes nothing this
        step (zeros to every all-reduce, so the collectives still run and no
        NaN reaches another device's ``P``) and keeps its residual bit for
        bit. With ``K`` of ``N`` devices finite, the included devices' common
        approximation is ``S = P Q_K^T`` with ``Q_K`` the mean of their ``Q``
        (divided by ``K``), each keeps ``e = M - S``, and the update is the
        mean of what every device sent, ``(K / N) S`` (the skipped device sent
        0), as for the sparsifiers: the update stays the average of the
        devices' messages and nothing is lost on any device. One more float32
        (the count) in ``P``'s all-reduce. ``"zero"``: non-finite elements are
        replaced by 0 and the rest is used (no count). Neither ever writes
        NaN/Inf into the residual or ``Q``. Also, should ``P`` or ``Q``
        overflow (values near float32's range), the leaf sends nothing that
        step on every device and each keeps ``M`` as its residual.
      seed: seed of the random ``Q`` draws (shared by every device), an int32;
        only ``init`` reads it, so it may be traced.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`PowerSGDState`.
      ``update`` returns a pytree like the gradients in their dtypes.

    Raises:
      ValueError: for a bad argument (the message names it), and from
        ``update`` for ``include=`` (backup workers are not supported).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxcomp.transforms.powersgd import powersgd
      >>> tx = powersgd(rank=1)
      >>> g = {"w": jnp.outer(jnp.arange(1.0, 7.0), jnp.ones(5)), "b": jnp.ones(5)}
      >>> u, state = tx.update(g, tx.init(g))
      >>> bool(jnp.allclose(u["w"], g["w"])), u["b"].tolist()  # rank 1: exact
      (True, [1.0, 1.0, 1.0, 1.0, 1.0])
      >>> jax.tree.map(int, optax.tree.get(state, "message_bytes"))  # (6 + 5) * 4
      {'b': 20, 'w': 44}

      The batched variant with 16-bit ``P`` and ``Q``: ``b`` and ``w`` (35 values)
      as one ``6 x 6`` matrix, ``2 * 6`` bfloat16 values counted at ``b``:

      >>> tx = powersgd(rank=1, batched=True, pq_dtype=jnp.bfloat16)
      >>> u, state = tx.update(g, tx.init(g))
      >>> jax.tree.map(int, optax.tree.get(state, "message_bytes"))
      {'b': 24, 'w': 0}
    """
    cfg = _make_config(
        rank,
        axis_name=axis_name,
        start_iter=start_iter,
        min_compression_rate=min_compression_rate,
        min_dense_size=min_dense_size,
        error_feedback=error_feedback,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        warm_start=warm_start,
        orthogonalization_epsilon=orthogonalization_epsilon,
        reshape=reshape,
        batched=batched,
        pq_dtype=pq_dtype,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )

    def update(updates, state, params=None, *, include=None, **extra_args):
        del params, extra_args
        return _update(cfg, updates, state, include)

    return optax.GradientTransformationExtraArgs(functools.partial(_init, cfg), update)


# ---------------------------------------------------------------------------
# Static configuration.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """The validated static options of one :func:`powersgd` transform."""

    rank: int
    start_iter: int  # 0: no vanilla steps (and no lax.cond around the collectives)
    min_compression_rate: float
    error_feedback: bool
    scaling: ResidualScaling  # GRACE's residual_scale, gradient_scale
    warm_start: bool
    orthogonalization_epsilon: Any  # float, or a traced value (an injected hyperparameter)
    reshape: str
    batched: bool  # one flattened square matrix per bucket (batched_powerSGD_hook)
    pq_dtype: Any  # None: P and Q travel in the compute dtype; else float16/bfloat16
    # The common options (jaxcomp.transforms.base.CommonOptions).
    axis_name: Any
    min_dense_size: int
    residual_dtype: Any  # None: per leaf, see resolve_residual_dtype
    nonfinite: str
    seed: Any  # int, or a traced integer (only _init reads it)


def _make_config(
    rank,
    *,
    axis_name,
    start_iter,
    min_compression_rate,
    min_dense_size,
    error_feedback,
    residual_scale,
    gradient_scale,
    warm_start,
    orthogonalization_epsilon,
    reshape,
    batched,
    pq_dtype,
    residual_dtype,
    nonfinite,
    seed,
) -> _Config:
    """Validates :func:`powersgd`'s arguments (each error names its argument)."""
    rank = V.check_int("rank", rank, 1)
    # None defaults (the documented values), so optax.inject_hyperparams does not trace
    # options the user never passed.
    start_iter = V.check_int("start_iter", 0 if start_iter is None else start_iter, 0, 2**31 - 1)
    min_compression_rate = V.check_real(
        "min_compression_rate", 2.0 if min_compression_rate is None else min_compression_rate, 0.0
    )
    error_feedback = V.check_bool("error_feedback", error_feedback)
    scaling = check_residual_scaling(residual_scale, gradient_scale, error_feedback=error_feedback)
    warm_start = V.check_bool("warm_start", warm_start)
    if orthogonalization_epsilon is None:
        orthogonalization_epsilon = 0.0
    orthogonalization_epsilon = V.check_real(
        "orthogonalization_epsilon",
        orthogonalization_epsilon,
        0.0,
        allow_traced=isinstance(orthogonalization_epsilon, jax.core.Tracer),
    )
    reshape = V.check_choice("reshape", reshape, POWERSGD_RESHAPES)
    batched = V.check_bool("batched", batched)
    if pq_dtype is not None:
        pq_dtype = V.check_float_dtype("pq_dtype", pq_dtype)
        if pq_dtype not in PQ_DTYPES:
            raise ValueError(
                f"pq_dtype must be None, float16 or bfloat16 (the 16-bit all-reduces), "
                f"got {pq_dtype}"
            )
    common = check_common_options(
        axis_name=axis_name,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )
    return _Config(
        rank=rank,
        start_iter=start_iter,
        min_compression_rate=min_compression_rate,
        error_feedback=error_feedback,
        scaling=scaling,
        warm_start=warm_start,
        orthogonalization_epsilon=orthogonalization_epsilon,
        reshape=reshape,
        batched=batched,
        pq_dtype=pq_dtype,
        axis_name=common.axis_name,
        min_dense_size=common.min_dense_size,
        residual_dtype=common.residual_dtype,
        nonfinite=common.nonfinite,
        seed=common.seed,
    )


def _plan(cfg: _Config, shape) -> tuple[int, int, int] | None:
    """:func:`matrix_plan` of a leaf of this shape under ``cfg``."""
    return matrix_plan(
        tuple(shape),
        cfg.rank,
        min_compression_rate=cfg.min_compression_rate,
        min_dense_size=cfg.min_dense_size,
        reshape=cfg.reshape,
    )


def _n_devices(cfg: _Config) -> int:
    return 1 if cfg.axis_name is None else collectives.axis_size(cfg.axis_name)


def _wire(cfg: _Config, nbytes) -> jax.Array:
    """Bytes on the wire for a message of ``nbytes`` (a ring all-reduce; 0 on one device)."""
    return jnp.float32(
        0 if cfg.axis_name is None else collectives.allreduce_bytes(nbytes, _n_devices(cfg))
    )


# ---------------------------------------------------------------------------
# The two exchanges.
# ---------------------------------------------------------------------------


def _exchange_p(cfg: _Config, vanilla, dense_msgs, p_locs, count):
    """All-reduce 1: ``(means of dense_msgs, sums of p_locs, summed count, flag)``.

    With ``start_iter`` (``vanilla`` a traced bool) the step is either a vanilla
    step (the compressed leaves' ``dense_msgs`` averaged, zeros for ``P``) or a
    PowerSGD step (``P`` summed, zeros for the dense means): one ``lax.cond``
    around the collectives only (a cond around the whole step measured ~4x the
    unconditional update on XLA:CPU, where operands crossing a cond cost copies).
    The compressed leaves' dense messages do cross it, so that PowerSGD steps do
    not all-reduce them too. ``flag`` is ``vanilla`` typed device-invariant (a
    constant of the branch taken), so selecting the update with it keeps the
    update invariant under ``shard_map``'s ``check_vma``.
    """
    axis_name = cfg.axis_name
    if axis_name is None:
        return dense_msgs, p_locs, count, vanilla

    def power(msgs, p, c):
        sums, total = _psum_flat(p, axis_name, c)
        return _zeros(msgs), sums, total, jnp.bool_(False)

    if vanilla is None:
        return (*power(dense_msgs, p_locs, count)[:3], None)

    def dense(msgs, p, c):
        return _dense_means(msgs, axis_name), _zeros(p), _zeros(c), jnp.bool_(True)

    return _vma.cond(vanilla, dense, power, dense_msgs, p_locs, count)


def _exchange_q(cfg: _Config, flag, qt_locs):
    """All-reduce 2: the sums of ``qt_locs`` (zeros in a vanilla step)."""
    axis_name = cfg.axis_name
    if axis_name is None:
        return qt_locs

    def power(q):
        return _psum_flat(q, axis_name)[0]

    if flag is None:
        return power(qt_locs)
    return _vma.cond(flag, _zeros, power, qt_locs)


# ---------------------------------------------------------------------------
# init and update.
# ---------------------------------------------------------------------------


def _init(cfg: _Config, params) -> PowerSGDState:
    V.check_gradient_leaves(params, f"{_WHO}.init", "parameter")
    leaves, treedef = jax.tree.flatten(params)
    cdts = [resolve_residual_dtype(cfg.residual_dtype, [p]) for p in leaves]
    key = jax.random.key(cfg.seed)
    qs: list = [None] * len(leaves)
    for grp in _layout(cfg, leaves, cdts)[1]:
        # One Q per leaf, or per bucket (batched=True: stored at its first leaf).
        for i in grp.leaves[:1] if grp.flat else grp.leaves:
            qs[i] = _draw_q(key, cfg.start_iter, i, grp.m, grp.r, grp.cdt)
    return PowerSGDState(
        step=jnp.zeros([], jnp.int32),
        residual=treedef.unflatten(
            [jnp.zeros(jnp.shape(p), c) for p, c in zip(leaves, cdts, strict=True)]
        )
        if cfg.error_feedback
        else None,
        q=treedef.unflatten(qs) if cfg.warm_start else None,
        key=jax.random.key_data(key),
        message_bytes=treedef.unflatten([jnp.zeros([], jnp.int32) for _ in leaves]),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
    )


def _update(cfg: _Config, updates, state, include):
    if include is not None:
        raise ValueError(
            f"{_WHO} does not take include= (backup workers): P and Q are summed over "
            "every device; use a sparsifier or quantizer for partial aggregation"
        )
    # Leaves split over explicit mesh axes (jit outside shard_map): each
    # leaf compressed whole, as on one device (see jaxcomp._sharding).
    return _sharding.whole_leaves(functools.partial(_update_leaves, cfg), fields=("residual",))(
        updates, state
    )


class _StepInputs(NamedTuple):
    """One step's leaves (``jax.tree.flatten`` order) and what every later step reads."""

    treedef: Any
    grads: list  # after the non-finite policy, in the gradient dtypes
    residuals: list  # e per leaf, or None per leaf without error feedback
    qs: list  # the stored Q per leaf (None: a dense leaf, or no warm start)
    plans: list  # matrix_plan per leaf (None: sent dense)
    groups: list  # the _Group batches of compressed leaves
    accs: list  # M = e + g per leaf, in the residual (compute) dtype
    sends: jax.Array  # bool, False on a skipped (non-finite) step


@dataclasses.dataclass
class _LeafResults:
    """Per leaf (``jax.tree.flatten`` order), what the step returns and stores, filled in
    by :func:`_exchange_dense_leaves` and :func:`_power_step`."""

    updates: list  # in the gradient dtypes
    sent: list  # this device's message in the gradient dtype (S, or M dense): e_new = M - sent
    q: list  # the new warm-start Q (None: a dense leaf, or no warm start)
    message_bytes: list  # int32 scalars
    wire_bytes: list  # float32 scalars, summed into the state's one total

    @classmethod
    def empty(cls, count: int) -> _LeafResults:
        fields = dataclasses.fields(cls)
        return cls(*([None] * count for _ in fields))


def _update_leaves(cfg: _Config, updates, state):
    """One step on leaves that are whole on each device (see :func:`_update`)."""
    V.check_gradient_leaves(updates, _WHO)
    V.check_state_type(state, PowerSGDState, _WHO)
    if cfg.error_feedback:
        V.check_tree_like(updates, state.residual, _WHO)
    else:
        V.check_tree_like(updates, state.message_bytes, _WHO, shapes=False)
    check_per_device(updates, cfg.axis_name, _WHO)
    grads, finite, sends = apply_nonfinite_policy(updates, cfg.nonfinite)
    inputs = _step_inputs(cfg, grads, state, sends)
    out = _LeafResults.empty(len(inputs.grads))
    _exchange_dense_leaves(cfg, inputs, out)
    if inputs.groups:
        _power_step(cfg, inputs, state, out)
    return inputs.treedef.unflatten(out.updates), _new_state(cfg, state, inputs, out, finite)


def _step_inputs(cfg: _Config, grads, state, sends) -> _StepInputs:
    g_leaves, treedef = jax.tree.flatten(grads)
    count_leaves = len(g_leaves)
    r_leaves = (
        treedef.flatten_up_to(state.residual) if cfg.error_feedback else [None] * count_leaves
    )
    q_leaves = treedef.flatten_up_to(state.q) if cfg.warm_start else [None] * count_leaves
    cdts = [
        r.dtype if r is not None else resolve_residual_dtype(cfg.residual_dtype, [g])
        for g, r in zip(g_leaves, r_leaves, strict=True)
    ]
    plans, groups = _layout(cfg, g_leaves, cdts)
    # A skipped step's residual is kept by _new_state (where sends), scaled or not.
    accs = [
        g.astype(c) if r is None else scaled_accumulation(cfg.scaling, r, g)
        for g, r, c in zip(g_leaves, r_leaves, cdts, strict=True)
    ]
    return _StepInputs(treedef, g_leaves, r_leaves, q_leaves, plans, groups, accs, sends)


def _exchange_dense_leaves(cfg: _Config, inputs: _StepInputs, out: _LeafResults) -> None:
    """Dense leaves: averaged whole, one all-reduce per gradient dtype; their residual
    keeps only the rounding to that dtype."""
    sends = inputs.sends
    # What a leaf sends dense: its accumulator in the gradient dtype (0 if skipped).
    dense_sent = [
        None if pl is not None else _to_dtype(jnp.where(sends, acc, 0), g.dtype)
        for g, acc, pl in zip(inputs.grads, inputs.accs, inputs.plans, strict=True)
    ]
    dense = [i for i, pl in enumerate(inputs.plans) if pl is None]
    msgs = [dense_sent[i] for i in dense]
    means = msgs if cfg.axis_name is None else _dense_means(msgs, cfg.axis_name)
    for i, mean in zip(dense, means, strict=True):
        g = inputs.grads[i]
        nbytes = g.size * g.dtype.itemsize
        out.updates[i], out.sent[i] = mean, dense_sent[i]
        out.message_bytes[i] = jnp.where(sends, nbytes, 0).astype(jnp.int32)
        out.wire_bytes[i] = _wire(cfg, nbytes)


def _power_step(cfg: _Config, inputs: _StepInputs, state, out: _LeafResults) -> None:
    """The compressed leaves: one power-iteration step per group (both exchanges), or a
    dense average in a vanilla step (``start_iter``)."""
    sends, eps = inputs.sends, cfg.orthogonalization_epsilon
    vanilla = None if cfg.start_iter == 0 else state.step < cfg.start_iter
    mats, p_locs = _local_p(cfg, inputs, state)
    count = sends.astype(jnp.float32) if cfg.nonfinite == "skip" else None
    low = [i for grp in inputs.groups for i in grp.leaves]
    # In a vanilla step (start_iter) the compressed leaves too are sent dense.
    msgs = (
        []
        if vanilla is None
        else [_to_dtype(jnp.where(sends, inputs.accs[i], 0), inputs.grads[i].dtype) for i in low]
    )
    means, p_sums, count, flag = _exchange_p(cfg, vanilla, msgs, p_locs, count)
    if cfg.nonfinite != "skip":
        count = jnp.float32(_n_devices(cfg))
    ps = [_orth(p.astype(grp.cdt), eps) for p, grp in zip(p_sums, inputs.groups, strict=True)]
    # Q^T = P^T M, [B, r, m], kept in that layout until it is stored: XLA folds a
    # transpose into the dot, and M^T P with M's rows contracted ran ~7x slower
    # on XLA:CPU for r >= 2 (a strided walk over the big matrix).
    qt_locs = [
        _to_message(cfg, jnp.where(sends, _bmm(p, mat, ((1,), (1,))), 0))
        for p, mat in zip(ps, mats, strict=True)
    ]
    qt_sums = _exchange_q(cfg, flag, qt_locs)
    for grp, p, qt_sum in zip(inputs.groups, ps, qt_sums, strict=True):
        _finish_group(cfg, inputs, grp, p, qt_sum, count, out)
    if vanilla is not None:
        _vanilla_override(cfg, inputs, low, vanilla, flag, means, msgs, out)
    if cfg.nonfinite == "skip" and cfg.axis_name is not None:  # the count, in P's all-reduce
        extra = jnp.float32(collectives.allreduce_bytes(4, _n_devices(cfg)))
        if vanilla is not None:
            extra = jnp.where(vanilla, 0, extra)
        out.wire_bytes[low[0]] = out.wire_bytes[low[0]] + extra


def _local_p(cfg: _Config, inputs: _StepInputs, state) -> tuple[list, list]:
    """Per group, the stacked matrices ``M`` (``[B, n, m]``) and this device's ``M Q``."""
    key = jax.random.wrap_key_data(state.key)
    mats, p_locs = [], []
    for grp in inputs.groups:
        n, m, r, cdt = grp.n, grp.m, grp.r, grp.cdt
        if grp.flat:  # the bucket: its leaves flattened, zero-padded to n * m, [1, n, m]
            flat = jnp.concatenate([inputs.accs[i].reshape(-1) for i in grp.leaves])
            mat = jnp.pad(flat, (0, n * m - flat.size)).reshape(1, n, m)
        else:
            mat = jnp.stack([inputs.accs[i].reshape(n, m) for i in grp.leaves])  # [B, n, m]
        owners = grp.leaves[:1] if grp.flat else grp.leaves  # who holds each Q
        if cfg.warm_start:
            q0 = jnp.stack([inputs.qs[i] for i in owners])
        else:
            q0 = jnp.stack([_draw_q(key, state.step, i, m, r, cdt) for i in owners])
        q0 = _orth(q0, cfg.orthogonalization_epsilon)
        mats.append(mat)
        # A device that sends nothing contributes zeros: its M never reaches the sums.
        p_locs.append(_to_message(cfg, jnp.where(inputs.sends, _bmm(mat, q0, ((2,), (1,))), 0)))
    return mats, p_locs


def _to_message(cfg: _Config, x: jax.Array) -> jax.Array:
    """A local ``P`` or ``Q^T`` as it is all-reduced: unchanged, or (``pq_dtype``) divided
    by the device count ``N`` and rounded to the 16-bit dtype, saturating below
    ``max / N`` so that the 16-bit sum of ``N`` messages stays finite (float16)."""
    if cfg.pq_dtype is None:
        return x
    n_dev = _n_devices(cfg)
    # The margin covers the rounding up of a value near max / N (half an ulp, 2^-11).
    big = float(jnp.finfo(cfg.pq_dtype).max) / n_dev / (1 + 2.0**-9)
    x = x / jnp.asarray(n_dev, x.dtype) if n_dev > 1 else x
    return jnp.clip(x, -big, big).astype(cfg.pq_dtype)


def _finish_group(cfg: _Config, inputs: _StepInputs, grp: _Group, p, qt_sum, count, out) -> None:
    """One group's ``S = P Q^T``, its leaves' updates, messages and new ``Q``."""
    n, m, r, cdt = grp.n, grp.m, grp.r, grp.cdt
    sends = inputs.sends
    if cfg.pq_dtype is None:
        qt = qt_sum / jnp.maximum(count, 1).astype(cdt)
    else:  # the messages were divided by N (_to_message): the sum is the mean times K / N
        qt = qt_sum.astype(cdt) * (_n_devices(cfg) / jnp.maximum(count, 1)).astype(cdt)
    # Overflow in M Q or P^T M (values near the dtype's range): that leaf sends
    # nothing anywhere.
    ok = (_finite(p) & _finite(qt))[:, None, None]
    p, qt = jnp.where(ok, p, 0), jnp.where(ok, qt, 0)
    approx = _bmm(p, qt, ((2,), (1,)))  # P Q^T, identical on every device
    nbytes = (n + m) * r * jnp.dtype(cfg.pq_dtype or cdt).itemsize
    if grp.flat:  # the bucket's leaves: consecutive slices of the flattened matrix
        flat, start, parts = approx[0].reshape(-1), 0, []
        for i in grp.leaves:
            size = inputs.grads[i].size
            parts.append(flat[start : start + size])
            start += size
    else:
        parts = list(approx)
    for b, i in enumerate(grp.leaves):
        g = inputs.grads[i]
        out.sent[i] = _to_dtype(parts[b], g.dtype).reshape(g.shape)
        if cfg.nonfinite == "skip":
            # The mean of what the devices sent: K copies of S and N - K zeros.
            # K == N gives a factor of exactly 1.0, hence the bits of `sent`.
            frac = count.astype(cdt) / jnp.asarray(_n_devices(cfg), cdt)
            out.updates[i] = _to_dtype(parts[b] * frac, g.dtype).reshape(g.shape)
        else:
            out.updates[i] = out.sent[i]
        # A bucket's P and Q are counted at its first leaf (0 at the others).
        leaf_bytes = nbytes if not grp.flat or b == 0 else 0
        out.message_bytes[i] = jnp.where(sends, leaf_bytes, 0).astype(jnp.int32)
        out.wire_bytes[i] = _wire(cfg, leaf_bytes)
        if cfg.warm_start and (not grp.flat or b == 0):
            # A zero column (zero gradient, nobody sent) would stay zero forever.
            live = jnp.any(qt[b] != 0, axis=1)
            out.q[i] = jnp.where(live, qt[b].T, inputs.qs[i])


def _vanilla_override(cfg: _Config, inputs, low, vanilla, flag, means, msgs, out) -> None:
    """Before ``start_iter``: the compressed leaves ``low`` get their dense means, send
    their dense messages ``msgs`` and keep their ``Q``."""
    for j, i in enumerate(low):
        g = inputs.grads[i]
        nbytes = g.size * g.dtype.itemsize
        out.updates[i] = jnp.where(flag, means[j], out.updates[i])
        out.sent[i] = jnp.where(vanilla, msgs[j], out.sent[i])
        out.message_bytes[i] = jnp.where(
            vanilla, jnp.where(inputs.sends, nbytes, 0), out.message_bytes[i]
        ).astype(jnp.int32)
        out.wire_bytes[i] = jnp.where(vanilla, _wire(cfg, nbytes), out.wire_bytes[i])
        if cfg.warm_start and out.q[i] is not None:  # (a bucket's other leaves hold none)
            out.q[i] = jnp.where(vanilla, inputs.qs[i], out.q[i])


def _new_state(cfg: _Config, state, inputs: _StepInputs, out: _LeafResults, finite):
    """The state after the step: ``e_new = M - S`` where this device sent, else ``e``."""
    treedef = inputs.treedef
    new_res = None
    if cfg.error_feedback:
        new_res = treedef.unflatten(
            [
                jnp.where(inputs.sends, acc - s.astype(acc.dtype), res)
                for acc, s, res in zip(inputs.accs, out.sent, inputs.residuals, strict=True)
            ]
        )
    return PowerSGDState(
        step=state.step + 1,
        residual=new_res,
        q=treedef.unflatten(out.q) if cfg.warm_start else None,
        key=state.key,
        message_bytes=treedef.unflatten(out.message_bytes),
        wire_bytes=sum(out.wire_bytes, jnp.float32(0)),
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
    )
