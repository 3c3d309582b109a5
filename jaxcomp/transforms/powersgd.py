"""PowerSGD: low-rank gradient compression by power iteration (Vogels et al., 2019).

The algorithm of PyTorch's DDP communication hook ``powerSGD_hook``, as one
optax ``GradientTransformationExtraArgs``. Per step, every leaf of two or more
dimensions is viewed as an ``n x m`` matrix (``reshape="first"``: the hook's
``(shape[0], prod(shape[1:]))``) and, if that pays (below), compressed with
rank ``r = min(n, m, rank)``:

    M      = e + g                      # error feedback (M = g without)
    Q      = orth(Q_prev)               # warm start; the first step: random normal
    P      = orth(sum over devices of M Q)           # all-reduce 1: n x r
    Q      = (sum over devices of M^T P) / N         # all-reduce 2: m x r
    S      = P Q^T                      # the same on every device, rank <= r
    e_new  = M - S                      # each device's own M
    update = S

``orth`` is the hook's modified Gram-Schmidt on the columns. Both exchanges
are all-reduces (sums are linear), so the bytes per device are those of a
ring all-reduce of ``(n + m) r`` values instead of ``n m``. A leaf is
compressed only if ``(n + m) r * min_compression_rate < n m`` (the hook's
test, counted in elements); scalars, 1-D leaves, empty leaves and leaves that
fail the test are averaged dense, as the hook's "uncompressed tensors" are.

Contracts (tested): the update is identical on every device (typed
device-invariant under ``shard_map``'s ``check_vma``, like the other jaxcomp
exchanges); its rank per leaf is at most ``r``; nothing is lost per device:
``e_new`` is the correctly rounded ``M - S`` with ``S`` the update as returned
(cast back from the gradient dtype), so ``S + e_new == M`` up to that one
rounding (``|S + e_new - M| <= ulp(M - S) / 2``), as for the quantizers:
``S`` is a computed product, not a selection of ``M``, so an exactly
representable ``M - S`` need not exist.

Differences from the hook, each deliberate:

- A zero column is left zero by ``orth`` (the hook divides by its zero norm
  and returns NaN unless ``orthogonalization_epsilon > 0``), and a column of
  the new ``Q`` that is exactly zero keeps its previous value (a zero
  gradient would otherwise zero the warm-started ``Q`` for good: ``P = M Q``
  stays 0 and the leaf is never sent again). Norms are computed scaled by the
  column's largest magnitude, so they do not overflow.
- Dense leaves keep only the rounding to the gradient dtype in their residual
  (jaxcomp's convention); the hook stores ``local - mean`` for them, which
  averages to zero over the devices, so the updates are the same.
- ``P`` and ``Q`` travel in the residual dtype (float32, float64 under
  ``jax_enable_x64`` for float64 leaves), also for bfloat16/float16 gradients
  (the hook computes them in the gradient dtype).
- Matrix products use ``Precision.HIGHEST`` (no TF32/bf16 passes on GPU/TPU).
- ``start_iter`` defaults to 0 (the hook's 1000 and its ``> 1`` requirement
  come from DDP rebuilding its buckets after the first iteration).
"""

from __future__ import annotations

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
from jaxcomp.transforms.sparsify import _NONFINITE, apply_nonfinite_policy, resolve_residual_dtype

__all__ = [
    "POWERSGD_RESHAPES",
    "PowerSGDState",
    "matrix_plan",
    "orthogonalize",
    "powersgd",
]

# Values of the ``reshape`` argument: which axes of a >2-D leaf become the rows.
POWERSGD_RESHAPES = ("first", "last")

_WHO = "jaxcomp.powersgd"


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
    """``||c||_2`` computed as ``a ||c / a||_2`` with ``a = max |c|`` (no overflow)."""
    a = jnp.max(jnp.abs(c))
    live = a > 0
    s = jnp.where(live, a, 1)
    return jnp.where(live, s * jnp.sqrt(jnp.sum(jnp.square(c / s))), 0)


def orthogonalize(x: jax.Array, epsilon: float = 0.0) -> jax.Array:
    """Modified Gram-Schmidt on the columns of ``x`` (``[k, r]``), as the hook's.

    Column ``i`` is divided by ``||x_i|| + epsilon``, then its projection is
    removed from the columns after it. A column whose norm (plus ``epsilon``)
    is zero stays zero (the hook would divide by zero).

    Example:
      >>> import jax.numpy as jnp
      >>> (5 * orthogonalize(jnp.array([[3.0, 1.0], [4.0, 0.0]]))).round().tolist()
      [[3.0, 4.0], [4.0, -3.0]]
    """
    k, r = x.shape
    if k == 0 or r == 0:
        return x
    cols = [x[:, i] for i in range(r)]
    for i in range(r):
        denom = _scaled_norm(cols[i]) + jnp.asarray(epsilon, x.dtype)
        live = denom > 0
        cols[i] = jnp.where(live, cols[i] / jnp.where(live, denom, 1), 0)
        for j in range(i + 1, r):
            cols[j] = cols[j] - jnp.sum(cols[i] * cols[j]) * cols[i]
    return jnp.stack(cols, axis=1)


def _mm(a, b, contract):
    """``a`` times ``b`` contracting the given dims, at full precision."""
    return lax.dot_general(a, b, (contract, ((), ())), precision=lax.Precision.HIGHEST)


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
    return jnp.isfinite(jnp.sum(x - x)) if x.size else jnp.bool_(True)


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
        the first one, the initial random draw). ``None`` with
        ``warm_start=False``.
      key: raw uint32 PRNG key data. Leaf ``i`` (in ``jax.tree.flatten``
        order) draws ``Q`` at step ``t`` from ``jax.random.normal(fold_in(
        fold_in(key, t), i), (m, r))``: once, at ``t = start_iter``, with a
        warm start, every step without. No device index is folded in, so
        every device draws the same ``Q``.
      message_bytes: int32 per leaf, bytes this device contributed in the last
        step: ``(n + m) r`` values of ``P`` and ``Q`` in the residual dtype,
        or the dense leaf in the gradient dtype (dense leaves; every leaf
        before ``start_iter``); 0 on a step that sent nothing.
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


class _Leaf(NamedTuple):
    update: jax.Array
    residual: Any
    q: Any
    message_bytes: jax.Array
    wire_bytes: jax.Array


def powersgd(
    rank: int,
    *,
    axis_name: Any = None,
    start_iter: int | None = None,
    min_compression_rate: float | None = None,
    min_dense_size: int | None = None,
    error_feedback: bool = True,
    warm_start: bool = True,
    orthogonalization_epsilon: float | None = None,
    reshape: str = "first",
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
      axis_name: mesh axis to average over inside ``shard_map``/``pmap``: two
        all-reduces per compressed leaf (``P``, then ``Q``) and one per dense
        leaf; every device gets the same update. ``None``: the local rank-r
        approximation (one device).
      start_iter: steps ``0 .. start_iter - 1`` average every leaf dense
        (vanilla all-reduce, as the hook; the residual stays zero); PowerSGD
        from step ``start_iter`` on (None: 0). One compilation: with ``start_iter > 0``
        only the collectives sit in a ``lax.cond`` on the step, so vanilla
        steps also compute the (unsent) low-rank products, and PowerSGD steps
        cost what they cost without ``start_iter``.
      min_compression_rate: a leaf is compressed only if ``(n + m) r *
        min_compression_rate < n m`` (element counts), a real >= 0 (None:
        2, the hook's default).
      min_dense_size: leaves with at most this many elements are sent dense
        (None: 0; the rate test above already sends small matrices dense).
      error_feedback: keep ``e = M - S`` per device and add it to the next
        gradient (the paper's and the hook's default). ``False``: no residual
        is allocated (``state.residual`` is None).
      warm_start: reuse the last step's ``Q`` (orthogonalized) instead of a
        fresh random draw every step; keeps ``Q`` in ``state.q``.
      orthogonalization_epsilon: added to each column norm in
        :func:`orthogonalize`, a real >= 0 (None: 0, the hook's default).
        Only arithmetic uses it, so it may be traced
        (``optax.inject_hyperparams``). ``start_iter``,
        ``min_compression_rate`` and ``min_dense_size`` fix the program
        (which leaves are compressed, the dense steps): pass them in
        ``static_args`` when you give them to ``inject_hyperparams``.
      reshape: ``"first"`` (the hook's ``(shape[0], -1)``) or ``"last"``
        (``(-1, shape[-1])``, for Flax's ``(kh, kw, in, out)`` kernels), see
        :func:`matrix_plan`. 2-D leaves are the same either way.
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
        devices' messages and nothing is lost on any device. One extra
        all-reduce of a float32 count. ``"zero"``: non-finite elements are
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
    """
    rank = V.check_int("rank", rank, 1)
    # None defaults (the documented values), so optax.inject_hyperparams does not trace
    # options the user never passed.
    start_iter = V.check_int("start_iter", 0 if start_iter is None else start_iter, 0, 2**31 - 1)
    min_compression_rate = V.check_real(
        "min_compression_rate", 2.0 if min_compression_rate is None else min_compression_rate, 0.0
    )
    min_dense_size = V.check_int(
        "min_dense_size", 0 if min_dense_size is None else min_dense_size, 0
    )
    error_feedback = V.check_bool("error_feedback", error_feedback)
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
    if residual_dtype is not None:  # None: per leaf, see resolve_residual_dtype
        residual_dtype = V.check_float_dtype("residual_dtype", residual_dtype)
    nonfinite = V.check_choice("nonfinite", nonfinite, _NONFINITE)
    seed = V.check_int("seed", seed, -(2**31), 2**31 - 1, allow_traced=True)

    def plan(shape):
        return matrix_plan(
            tuple(shape),
            rank,
            min_compression_rate=min_compression_rate,
            min_dense_size=min_dense_size,
            reshape=reshape,
        )

    def n_devices():
        return 1 if axis_name is None else collectives.axis_size(axis_name)

    def wire(nbytes):
        return jnp.float32(
            0 if axis_name is None else collectives.allreduce_bytes(nbytes, n_devices())
        )

    def dense_leaf(g, residual, sends, cdt) -> _Leaf:
        """The leaf averaged whole; the residual keeps the rounding to its dtype."""
        acc = g.astype(cdt) if residual is None else residual + g.astype(cdt)
        sent = _to_dtype(jnp.where(sends, acc, 0), g.dtype)
        if axis_name is None:
            update = sent
        else:
            update, _ = collectives.dense_mean(sent, axis_name)
        new_res = None if residual is None else jnp.where(sends, acc - sent.astype(cdt), residual)
        nbytes = g.size * g.dtype.itemsize
        return _Leaf(
            update, new_res, None, jnp.where(sends, nbytes, 0).astype(jnp.int32), wire(nbytes)
        )

    def phase_sum(x, vanilla):
        """Sum over devices; skipped (zeros, no communication) in a vanilla step."""
        if axis_name is None:
            return x
        if vanilla is None:
            return lax.psum(x, axis_name)
        # Constant zeros are device-invariant, as the psum is: the branches type alike.
        return _vma.cond(
            vanilla, lambda x: jnp.zeros(x.shape, x.dtype), lambda x: lax.psum(x, axis_name), x
        )

    def low_rank_leaf(g, residual, q_prev, key, step, index, sends, count, vanilla, pl, cdt):
        """One compressed leaf; ``vanilla`` (a traced bool, or None without ``start_iter``)
        turns the step into a dense all-reduce. Only the collectives are conditional: an
        ``n x m`` operand crossing a ``lax.cond`` costs copies and fresh buffers on XLA:CPU
        (a cond around the whole step measured ~4x the unconditional update)."""
        n, m, r = pl
        acc = g.astype(cdt) if residual is None else residual + g.astype(cdt)
        mat = acc.reshape(n, m)
        q0 = q_prev if warm_start else _draw_q(key, step, index, m, r, cdt)
        q0 = orthogonalize(q0, orthogonalization_epsilon)
        # A device that sends nothing contributes zeros: its M never reaches the sums.
        p = phase_sum(jnp.where(sends, _mm(mat, q0, ((1,), (0,))), 0), vanilla)
        p = orthogonalize(p, orthogonalization_epsilon)
        # Q^T = P^T M, [r, m], kept in that layout until it is stored: XLA folds a
        # transpose into the dot, and M^T P with M's rows contracted ran ~7x slower
        # on XLA:CPU for r >= 2 (a strided walk over the big matrix).
        qt_sum = phase_sum(jnp.where(sends, _mm(p, mat, ((0,), (0,))), 0), vanilla)
        qt = qt_sum / jnp.maximum(count, 1).astype(cdt)
        # Overflow in M Q or P^T M (values near the dtype's range): send nothing anywhere.
        ok = _finite(p) & _finite(qt)
        p, qt = jnp.where(ok, p, 0), jnp.where(ok, qt, 0)
        approx = _mm(p, qt, ((1,), (0,)))  # P Q^T, identical on every device
        sent = _to_dtype(approx, g.dtype)
        if nonfinite == "skip":
            # The mean of what the devices sent: K copies of S and N - K zeros.
            # K == N gives a factor of exactly 1.0, hence the bits of `sent`.
            frac = count.astype(cdt) / jnp.asarray(n_devices(), cdt)
            update = _to_dtype(approx * frac, g.dtype)
        else:
            update = sent
        update = update.reshape(g.shape)
        sent = sent.reshape(g.shape)
        nbytes = (n + m) * r * jnp.dtype(cdt).itemsize
        msg, wire_b = jnp.where(sends, nbytes, 0).astype(jnp.int32), wire(nbytes)
        new_q = None
        if warm_start:
            # A zero column (zero gradient, nobody sent) would stay zero forever.
            live = jnp.any(qt != 0, axis=1)
            new_q = jnp.where(live, qt.T, q_prev)
        if vanilla is not None:
            dense = dense_leaf(g, residual, sends, cdt)
            if axis_name is None:
                update = jnp.where(vanilla, dense.update, update)
            else:
                # A cond, not a where: the step is typed device-varying inside shard_map
                # (per-device state) and would make the update look un-exchanged.
                update = _vma.cond(vanilla, lambda d, u: d, lambda d, u: u, dense.update, update)
            sent = jnp.where(vanilla, _to_dtype(jnp.where(sends, acc, 0), g.dtype), sent)
            msg = jnp.where(vanilla, dense.message_bytes, msg)
            wire_b = jnp.where(vanilla, dense.wire_bytes, wire_b)
            if warm_start:
                new_q = jnp.where(vanilla, q_prev, new_q)
        new_res = None
        if residual is not None:
            new_res = jnp.where(sends, acc - sent.astype(cdt), residual)
        return _Leaf(update, new_res, new_q, msg, wire_b)

    def init(params):
        V.check_gradient_leaves(params, f"{_WHO}.init", "parameter")
        leaves, treedef = jax.tree.flatten(params)
        cdts = [resolve_residual_dtype(residual_dtype, [p]) for p in leaves]
        key = jax.random.key(seed)
        qs = []
        for i, (p, cdt) in enumerate(zip(leaves, cdts, strict=True)):
            pl = plan(jnp.shape(p))
            qs.append(None if pl is None else _draw_q(key, start_iter, i, pl[1], pl[2], cdt))
        return PowerSGDState(
            step=jnp.zeros([], jnp.int32),
            residual=treedef.unflatten(
                [jnp.zeros(jnp.shape(p), c) for p, c in zip(leaves, cdts, strict=True)]
            )
            if error_feedback
            else None,
            q=treedef.unflatten(qs) if warm_start else None,
            key=jax.random.key_data(key),
            message_bytes=treedef.unflatten([jnp.zeros([], jnp.int32) for _ in leaves]),
            wire_bytes=jnp.zeros([], jnp.float32),
            nonfinite_steps=jnp.zeros([], jnp.int32),
        )

    def update(updates, state, params=None, *, include=None, **extra_args):
        del params, extra_args
        if include is not None:
            raise ValueError(
                f"{_WHO} does not take include= (backup workers): P and Q are summed over "
                "every device; use a sparsifier or quantizer for partial aggregation"
            )
        # Leaves split over explicit mesh axes (jit outside shard_map): each
        # leaf compressed whole, as on one device (see jaxcomp._sharding).
        return _sharding.whole_leaves(update_leaves, fields=("residual",))(updates, state)

    def update_leaves(updates, state):
        V.check_gradient_leaves(updates, _WHO)
        if error_feedback:
            V.check_tree_like(updates, state.residual, _WHO)
        else:
            V.check_tree_like(updates, state.message_bytes, _WHO, shapes=False)
        check_per_device(updates, axis_name, _WHO)
        grads, finite, sends = apply_nonfinite_policy(updates, nonfinite)

        g_leaves, treedef = jax.tree.flatten(grads)
        count_leaves = len(g_leaves)
        r_leaves = (
            treedef.flatten_up_to(state.residual) if error_feedback else [None] * count_leaves
        )
        q_leaves = treedef.flatten_up_to(state.q) if warm_start else [None] * count_leaves
        cdts = [
            r.dtype if r is not None else resolve_residual_dtype(residual_dtype, [g])
            for g, r in zip(g_leaves, r_leaves, strict=True)
        ]
        plans = [plan(g.shape) for g in g_leaves]
        low = [i for i, pl in enumerate(plans) if pl is not None]
        outs: list[Any] = [None] * count_leaves
        for i, pl in enumerate(plans):
            if pl is None:
                outs[i] = dense_leaf(g_leaves[i], r_leaves[i], sends, cdts[i])

        if low:
            vanilla = None if start_iter == 0 else state.step < start_iter
            if nonfinite == "skip":
                count = phase_sum(sends.astype(jnp.float32), vanilla)
            else:
                count = jnp.float32(n_devices())
            key = jax.random.wrap_key_data(state.key)
            for i in low:
                outs[i] = low_rank_leaf(
                    g_leaves[i],
                    r_leaves[i],
                    q_leaves[i],
                    key,
                    state.step,
                    i,
                    sends,
                    count,
                    vanilla,
                    plans[i],
                    cdts[i],
                )
            if nonfinite == "skip" and axis_name is not None:  # the count's all-reduce
                extra = jnp.float32(collectives.allreduce_bytes(4, n_devices()))
                if vanilla is not None:
                    extra = jnp.where(vanilla, 0, extra)
                i = low[0]
                outs[i] = outs[i]._replace(wire_bytes=outs[i].wire_bytes + extra)

        def field(name):
            return treedef.unflatten([getattr(o, name) for o in outs])

        new_state = PowerSGDState(
            step=state.step + 1,
            residual=field("residual") if error_feedback else None,
            q=field("q") if warm_start else None,
            key=state.key,
            message_bytes=field("message_bytes"),
            wire_bytes=sum((o.wire_bytes for o in outs), jnp.float32(0)),
            nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        )
        return field("update"), new_state

    return optax.GradientTransformationExtraArgs(init, update)
