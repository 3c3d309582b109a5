"""The two-level (node x local) exchange: compress only where the link is slow.

A cluster has fast links inside a node (NVLink) and slow ones between nodes
(Ethernet, InfiniBand). On a mesh ``jax.make_mesh((nodes, L), ("node",
"local"))`` every compressor accepts ``axis_name=("node", "local")`` (the
first name is the slow axis) and then exchanges in three steps, the
hierarchical scheme of Horovod, BytePS and the ldte_bs paper's §4.4 model:

1. **Dense reduce-scatter over** ``"local"``: each device ends up owning
   ``1/L`` of every leaf, holding the mean of that part over its node's
   ``L`` devices, ``s = (1/L) sum_l g_l`` restricted to the shard.
2. **The compressor on the shard**, with its error feedback, its exchange
   over ``"node"`` only (any of its exchanges: sparse or quantized
   all-gather, gTop-k, Ok-Topk, parameter server, ...):
   ``u_shard = mean over nodes of C(s + e)``, ``e_new = s + e - C(s + e)``.
3. **Dense all-gather over** ``"local"`` of the shards of ``u``.

So every device compresses ``1/L`` of the gradient and sends it once over
the slow link, and nothing is lost: with ``N = nodes * L`` devices, summing
over all devices (each residual covers only its own shard),
``L sum e_new + N u = L sum e + sum g`` (a residual stands for the ``L``
devices of its node; with ``L = 1`` this is the flat invariant). The update
is the flat compressor's update of the node means; with a dense exchange it
is the plain mean of the ``N`` gradients.

**Shards.** A leaf of ``n`` elements is viewed as ``M`` rows of ``R``
elements (``R = 1`` for element-wise compressors; PowerSGD keeps its
matrix rows whole), the rows padded with zeros to a multiple of ``L`` and
split into ``L`` contiguous blocks: the shard has ``ceil(M / L)`` rows,
shape ``(ceil(M / L),)`` or ``(ceil(M / L), R)``. Padding enters as zeros
and its decoded values are dropped when the leaf is reassembled; a
compressor that never sends a zero as nonzero (sparsifiers, PowerSGD, QSGD)
keeps its residual zero, a sign quantizer (zero sent as ``+scale``) does
not, and its padding takes part in the bucket's scale. ``min_dense_size``,
``groups`` and every per-leaf option apply to the shards. All leaves of a dtype travel in one
reduce-scatter and one all-gather per step (the cost does not grow with the
leaf count); float16 values are divided by ``L`` before they are added, so
a sum that would overflow where the mean fits does not.

**Bytes.** The state counts each link class apart: ``intra_node_bytes``,
the reduce-scatter and the all-gather, ``2 (L - 1) / L`` times the padded
buffer's bytes (a ring's cost; the buffers of 16-bit leaves in their own
dtype), and ``inter_node_bytes``, the compressor's own ``wire_bytes``
(counted for its ``nodes`` peers). Their sum is the step's
``wire_bytes`` for :func:`jaxcomp.distributed.make_train_step`.

**Non-finite gradients.** The compressor's ``nonfinite`` policy is applied
on each device before the reduce-scatter, so one device's NaN never reaches
its node's other values: ``"zero"`` replaces that device's non-finite
elements by 0, ``"skip"`` drops that device's whole gradient this step (as
on a flat mesh, where it would send nothing). The compressor then sees
finite node means; ``TwoLevelState.nonfinite_steps`` counts this device's
non-finite steps.

The state is per device and shaped like the shards, so ``init`` must run
where the ``"local"`` axis is bound (inside ``shard_map``, as
:func:`jaxcomp.distributed.init_opt_state` does).

Not supported (a clear error): backup workers (``include``), the
scattered FSDP exchange (``scatter``) and the backward-overlapped step
(``make_train_step(overlap=True)``); each would need its own two-level form.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import check_not_in_local_branch
from jaxcomp.comm import collectives
from jaxcomp.transforms.base import NONFINITE_POLICIES, indices_by_dtype, tree_all_finite

__all__ = [
    "TwoLevelState",
    "accepts_two_level_axis",
    "is_two_level",
    "shard_shape",
    "two_level",
]


class TwoLevelState(NamedTuple):
    """State of a compressor run with a two-level ``axis_name``.

    Attributes:
      inner: the compressor's own state, shaped like this device's shards.
      intra_node_bytes: float32, bytes this device sent over intra-node links
        in the last step (the reduce-scatter and the all-gather).
      inter_node_bytes: float32, bytes it sent over inter-node links (the
        compressor's exchange over the node axis; its ``wire_bytes``).
      nonfinite_steps: int32, steps whose gradient on this device held a NaN
        or Inf (handled by the ``nonfinite`` policy before the reduce-scatter).
    """

    inner: Any
    intra_node_bytes: jax.Array
    inter_node_bytes: jax.Array
    nonfinite_steps: jax.Array


def is_two_level(axis_name: Any) -> bool:
    """Whether ``axis_name`` names two levels, ``(node_axis, local_axis)``.

    Raises:
      ValueError: for a tuple or list that is not two distinct axis names.

    Example:
      >>> is_two_level(("node", "local")), is_two_level("data"), is_two_level(("data",))
      (True, False, False)
    """
    if not isinstance(axis_name, tuple | list) or len(axis_name) == 1:
        return False  # one name, or one name in a tuple (JAX's spelling of the same axis)
    if len(axis_name) != 2 or not all(isinstance(a, str) for a in axis_name):
        raise ValueError(
            "axis_name must be a mesh axis name, or two of them (node_axis, local_axis) for "
            f"the two-level exchange, got {axis_name!r}"
        )
    if axis_name[0] == axis_name[1]:
        raise ValueError(f"axis_name: the two levels must be different axes, got {axis_name!r}")
    return True


def _rows(shape: tuple[int, ...], row_length: int) -> tuple[int, int]:
    """``(M, R)``: the leaf viewed as ``M`` rows of ``R`` elements."""
    n = math.prod(shape)
    row_length = max(1, row_length) if len(shape) >= 2 else 1
    if n % row_length:
        raise ValueError(f"row_length {row_length} does not divide a leaf of shape {shape}")
    return n // row_length, row_length


def shard_shape(shape: tuple[int, ...], local: int, row_length: int = 1) -> tuple[int, ...]:
    """Shape of the shard of a leaf that each of ``local`` devices owns.

    The leaf is viewed as rows of ``row_length`` elements (1-D and scalar
    leaves as rows of one), padded to a multiple of ``local`` rows and split
    into ``local`` blocks.

    Example:
      >>> shard_shape((10,), 4), shard_shape((6, 5), 4), shard_shape((6, 5), 4, row_length=5)
      ((3,), (8,), (2, 5))
      >>> shard_shape((), 8)
      (1,)
    """
    m, r = _rows(tuple(shape), row_length)
    rows = -(-m // local) if m else 0
    return (rows, r) if r > 1 else (rows,)


@dataclasses.dataclass(frozen=True)
class _Config:
    node_axis: str
    local_axis: str
    row_length: Callable[[tuple[int, ...]], int]
    nonfinite: str | None


def _plan(cfg: _Config, leaves: list, local: int) -> list:
    """Per leaf ``(rows, row_length, shard_shape)`` for ``local`` devices."""
    plan = []
    for x in leaves:
        shape = tuple(np.shape(x))
        m, r = _rows(shape, cfg.row_length(shape))
        plan.append((m, r, shard_shape(shape, local, r)))
    return plan


def _pack(leaves: list, plan: list, local: int) -> list:
    """``(dtype, leaf indices, buffer)`` per dtype: each buffer ``(local, size)``, row ``l``
    holding device ``l``'s shard of every leaf of that dtype."""
    packed = []
    for dtype, idx in indices_by_dtype(leaves).items():
        blocks = []
        for i in idx:
            m, r, rows = plan[i][0], plan[i][1], plan[i][2][0]
            x = jnp.pad(jnp.reshape(leaves[i], (m, r)), ((0, rows * local - m), (0, 0)))
            blocks.append(x.reshape(local, rows * r))
        packed.append((dtype, idx, jnp.concatenate(blocks, axis=1)))
    return packed


def _filter_nonfinite(packed: list, policy: str | None):
    """The ``nonfinite`` policy on this device's packed buffers, and whether all was finite.

    On the few buffers, not per leaf: one ``where`` per dtype reads the flag.
    """
    finite = tree_all_finite([buf for _, _, buf in packed])
    if policy == "zero":
        packed = [(d, i, jnp.where(jnp.isfinite(b), b, jnp.zeros_like(b))) for d, i, b in packed]
    elif policy == "skip":
        packed = [(d, i, jnp.where(finite, b, jnp.zeros_like(b))) for d, i, b in packed]
    return packed, finite


def _scatter_mean(cfg: _Config, packed: list, plan: list, local: int, n_leaves: int):
    """Step 1: this device's shard of the node mean of every leaf, and the bytes sent."""
    shards: list = [None] * n_leaves
    wire = 0.0
    for dtype, idx, buf in packed:
        # float16: divide first, so a sum that overflows where the mean fits cannot.
        added, divisor = collectives.mean_first(buf, local)
        summed = lax.psum_scatter(added, cfg.local_axis, scatter_dimension=0, tiled=True)
        mean = summed[0] if divisor == 1 else summed[0] / jnp.asarray(divisor, dtype)
        wire += collectives.array_nbytes(buf) * (local - 1) / local
        start = 0
        for i in idx:
            size = math.prod(plan[i][2])
            shards[i] = mean[start : start + size].astype(dtype).reshape(plan[i][2])
            start += size
    return shards, wire


def _gather(cfg: _Config, shards: list, like: list, plan: list, local: int):
    """Step 3: every leaf whole again from the ``local`` devices' shards, and the bytes sent."""
    out: list = [None] * len(shards)
    wire = 0.0
    for dtype, idx in indices_by_dtype(shards).items():
        buf = jnp.concatenate([jnp.reshape(shards[i], (-1,)) for i in idx]).astype(dtype)
        full = collectives.all_gather_invariant(buf, cfg.local_axis)  # (local, size)
        wire += collectives.array_nbytes(buf) * (local - 1)
        start = 0
        for i in idx:
            m, r, sshape = plan[i]
            size = math.prod(sshape)
            block = full[:, start : start + size].reshape(local * sshape[0], r)
            out[i] = block[:m].reshape(np.shape(like[i]))
            start += size
    return out, wire


def _local_size(cfg: _Config, who: str) -> int:
    try:
        return collectives.axis_size(cfg.local_axis)
    except NameError as e:  # an unbound axis name
        raise ValueError(
            f"{who}: axis_name ({cfg.node_axis!r}, {cfg.local_axis!r}) is a two-level exchange; "
            "run init and update inside shard_map over both axes (e.g. with "
            "jaxcomp.distributed.init_opt_state and make_train_step)"
        ) from e


def _init(cfg: _Config, inner: optax.GradientTransformation, params) -> TwoLevelState:
    local = _local_size(cfg, "init")
    leaves, treedef = jax.tree.flatten(params)
    plan = _plan(cfg, leaves, local)
    shards = [jnp.zeros(p[2], jnp.asarray(x).dtype) for x, p in zip(leaves, plan, strict=True)]
    zero = jnp.zeros([], jnp.float32)
    inner_state = inner.init(jax.tree.unflatten(treedef, shards))
    return TwoLevelState(inner_state, zero, zero, jnp.zeros([], jnp.int32))


def _update(cfg: _Config, inner, updates, state: TwoLevelState, params, extra):
    for name in ("include", "scatter", "jaxcomp_overlap"):
        if extra.get(name) is not None:
            raise ValueError(
                f"the two-level exchange (axis_name=({cfg.node_axis!r}, {cfg.local_axis!r})) "
                f"does not support {name!r} (backup workers, the scattered exchange and the "
                "backward-overlapped step each need their own two-level form)"
            )
    extra = {k: v for k, v in extra.items() if k not in ("include", "scatter", "jaxcomp_overlap")}
    # Refused here, before the inner compressor's own check, whose remedy would
    # name the node axis alone (a decision per node row still hangs the local exchange).
    check_not_in_local_branch((cfg.node_axis, cfg.local_axis), "the two-level exchange")
    local = _local_size(cfg, "update")
    leaves, treedef = jax.tree.flatten(updates)
    plan = _plan(cfg, leaves, local)
    # The policy acts on this device, before its NaN reaches the node's values.
    packed, finite = _filter_nonfinite(_pack(leaves, plan, local), cfg.nonfinite)
    shards, intra_in = _scatter_mean(cfg, packed, plan, local, len(leaves))
    shard_params = None
    if params is not None:
        p_leaves = jax.tree.leaves(params)
        shard_params = jax.tree.unflatten(
            treedef, _scatter_own(cfg, p_leaves, plan, local) if p_leaves else p_leaves
        )
    shard_updates, inner_state = inner.update(
        jax.tree.unflatten(treedef, shards), state.inner, shard_params, **extra
    )
    out, intra_out = _gather(cfg, jax.tree.leaves(shard_updates), leaves, plan, local)
    intra = jnp.float32(intra_in + intra_out)
    bad = state.nonfinite_steps + (~finite).astype(jnp.int32)
    new_state = TwoLevelState(inner_state, intra, _wire(inner_state), bad)
    return jax.tree.unflatten(treedef, out), new_state


def _wire(state) -> jax.Array:
    """Sum of the ``wire_bytes`` fields of the compressor's state (one per model shard)."""
    fields = optax.tree.get_all_with_path(state, "wire_bytes")
    return sum((jnp.sum(jnp.asarray(v, jnp.float32)) for _, v in fields), jnp.float32(0))


def _scatter_own(cfg: _Config, leaves: list, plan: list, local: int) -> list:
    """This device's shard of every (replicated) parameter leaf: no communication."""
    me = lax.axis_index(cfg.local_axis)
    out = []
    for x, (m, r, sshape) in zip(leaves, plan, strict=True):
        rows = sshape[0]
        x = jnp.pad(jnp.reshape(x, (m, r)), ((0, rows * local - m), (0, 0)))
        out.append(lax.dynamic_slice_in_dim(x, me * rows, rows).reshape(sshape))
    return out


def two_level(
    inner: optax.GradientTransformation,
    node_axis: str,
    local_axis: str,
    *,
    row_length: Callable[[tuple[int, ...]], int] | None = None,
    nonfinite: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Runs ``inner`` (built with ``axis_name=node_axis``) on this device's shard.

    Most users never call this: every compressor factory given
    ``axis_name=(node_axis, local_axis)`` returns it (see the module
    docstring for the algorithm, shards and bytes).

    Args:
      inner: a compressor whose exchange is over ``node_axis``.
      node_axis: the slow (inter-node) mesh axis.
      local_axis: the fast (intra-node) mesh axis.
      row_length: leaf shape to the number of elements a shard keeps together
        in a row (PowerSGD: a matrix row); None: element-wise (1).
      nonfinite: the policy (``"skip"``/``"zero"``) applied on each device
        before the reduce-scatter; None leaves non-finite values to ``inner``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`TwoLevelState`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1, 1), ("node", "local"))
      >>> tx = jaxcomp.top_k(ratio=0.5, axis_name=("node", "local"))
      >>> def step(g):
      ...     u, state = tx.update(g, tx.init(g))
      ...     return u, state.inner.residual
      >>> u, residual = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P(),
      ...                             check_vma=False)({"w": jnp.array([1.0, -4.0, 2.0, 0.5])})
      >>> u["w"].tolist(), residual["w"].tolist()
      ([0.0, -4.0, 2.0, 0.0], [1.0, 0.0, 0.0, 0.5])
    """
    if node_axis == local_axis:
        raise ValueError(f"two_level: node_axis and local_axis must differ, got {node_axis!r}")
    if nonfinite is not None:
        nonfinite = V.check_choice("nonfinite", nonfinite, NONFINITE_POLICIES)
    cfg = _Config(node_axis, local_axis, row_length or (lambda shape: 1), nonfinite)
    inner = optax.with_extra_args_support(inner)

    def update(updates, state, params=None, **extra):
        return _update(cfg, inner, updates, state, params, extra)

    return optax.GradientTransformationExtraArgs(functools.partial(_init, cfg, inner), update)


def accepts_two_level_axis(
    row_length: Callable[[dict], Callable[[tuple[int, ...]], int] | None] | None = None,
) -> Callable:
    """Decorates a compressor factory so that ``axis_name=(node, local)`` works.

    The factory is called with ``axis_name=node`` and its transformation
    wrapped by :func:`two_level`; any other ``axis_name`` passes through.

    Args:
      row_length: called with the factory's bound arguments, the
        ``row_length`` of :func:`two_level` (None: element-wise).

    Example:
      >>> import optax
      >>> @accepts_two_level_axis()
      ... def scaled(factor, *, axis_name=None):
      ...     return optax.scale(factor)
      >>> tx = scaled(2.0, axis_name=("node", "local"))  # scale(2.0) on each shard
      >>> type(scaled(2.0, axis_name="data")).__name__
      'GradientTransformation'
    """

    def decorate(factory: Callable) -> Callable:
        signature = inspect.signature(factory)

        @functools.wraps(factory)
        def wrapped(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            axis_name = bound.arguments.get("axis_name")
            if not is_two_level(axis_name):
                return factory(*args, **kwargs)
            node_axis, local_axis = axis_name
            bound.arguments["axis_name"] = node_axis
            inner = factory(*bound.args, **bound.kwargs)
            bound.apply_defaults()
            rows = None if row_length is None else row_length(bound.arguments)
            nonfinite = bound.arguments.get("nonfinite")
            return two_level(inner, node_axis, local_axis, row_length=rows, nonfinite=nonfinite)

        return wrapped

    return decorate
