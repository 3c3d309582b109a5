"""The dense exchange and the wrappers around a compressor's exchange.

:func:`dense_exchange` (the uncompressed baseline), :func:`skip_not_finite` and
:func:`apply_if_finite` (a non-finite step skipped on every device together),
and :func:`accumulate_then_compress` (local gradient accumulation before one
compressed exchange).
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp._vma import check_per_device, varying_axes
from jaxcomp.comm import collectives
from jaxcomp.transforms.base import all_finite

__all__ = [
    "AccumulateState",
    "DenseExchangeState",
    "accumulate_then_compress",
    "apply_if_finite",
    "dense_exchange",
    "skip_not_finite",
]


# --- dense baseline ------------------------------------------------------------


class DenseExchangeState(NamedTuple):
    """State of :func:`dense_exchange`: ``wire_bytes`` of the last step (float32)."""

    wire_bytes: jax.Array


def dense_exchange(axis_name) -> optax.GradientTransformationExtraArgs:
    """The uncompressed baseline: all-reduce mean of every gradient leaf.

    Put it where a compressor would go (``optax.chain(dense_exchange("data"),
    optax.sgd(0.1))``) to train plain data-parallel SGD with the same step
    builder; ``wire_bytes`` reports the ring all-reduce's bytes per device.
    An optional ``include`` extra argument (this device's backup-worker flag)
    averages over the included devices only.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.distributed import dense_exchange
      >>> tx = dense_exchange("data")
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P())
      >>> f(jax.device_put(jnp.ones(2), jax.NamedSharding(mesh, P("data")))).tolist()
      [1.0, 1.0]

    Raises:
      ValueError: if ``axis_name`` is None (or an empty tuple): there is no
        axis to average over.
    """
    if axis_name is None or (isinstance(axis_name, tuple) and not axis_name):
        raise ValueError(
            "dense_exchange: axis_name must name the mesh axis (or a tuple of axes) to "
            f"average over, e.g. 'data'; got {axis_name!r} (on one device, with nothing "
            "to exchange, leave dense_exchange out of the chain)"
        )

    def init(params):
        del params
        return DenseExchangeState(wire_bytes=jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, *, include=None, **extra_args):
        del state, params, extra_args
        check_per_device(updates, axis_name, "jaxcomp.dense_exchange")
        leaves, treedef = jax.tree.flatten(updates)
        outs = [collectives.dense_mean(g, axis_name, include=include) for g in leaves]
        wire = sum((b for _, b in outs), jnp.float32(0))
        return treedef.unflatten([m for m, _ in outs]), DenseExchangeState(wire_bytes=wire)

    return optax.GradientTransformationExtraArgs(init, update)


# --- non-finite steps skipped on every device together ----------------------------


def skip_not_finite(axis_name):
    """``optax.skip_not_finite`` decided on all devices together, for ``optax.MultiSteps``.

    ``optax.MultiSteps(opt, k, should_skip_update_fn=optax.skip_not_finite)``
    skips a mini-step through a ``lax.cond`` on this device's gradients: under
    ``shard_map``, with an exchanging compressor in ``opt``, a NaN on one
    device hangs the step as :func:`apply_if_finite` explains. This function
    sums the non-finite count over ``axis_name`` (one scalar all-reduce) so
    every device skips the same mini-steps. Outside ``shard_map`` (where
    ``MultiSteps.init`` calls it) the axis is unbound and the count is this
    device's.

    Args:
      axis_name: the mesh axis (or axes) the compressor exchanges over.

    Returns:
      A ``should_skip_update_fn``: ``(updates, gradient_step, params) ->
      (should_skip, {"should_skip", "num_not_finite"})``, as optax's.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> skip = jaxcomp.distributed.skip_not_finite("data")
      >>> tx = optax.MultiSteps(jaxcomp.top_k(0.5, axis_name="data"), 2,
      ...                       should_skip_update_fn=skip)
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda g: skip(g, 0, None)[1]["num_not_finite"],
      ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
      >>> int(f(jax.device_put(jnp.array([1.0, jnp.nan]), jax.NamedSharding(mesh, P("data")))))
      1
    """

    def should_skip(updates, gradient_step, params):
        _, info = optax.skip_not_finite(updates, gradient_step, params)
        count = info["num_not_finite"]
        try:
            count = lax.psum(count, axis_name)
        except NameError:  # unbound axis: MultiSteps.init, outside shard_map
            pass
        return count > 0, {"should_skip": count > 0, "num_not_finite": count}

    return should_skip


def apply_if_finite(
    inner: optax.GradientTransformation, max_consecutive_errors: int, axis_name=None
) -> optax.GradientTransformationExtraArgs:
    """``optax.apply_if_finite`` that decides on all devices together.

    ``optax.apply_if_finite`` skips a step through a ``lax.cond`` on *this
    device's* gradients. Under ``shard_map`` a NaN on one device then sends
    only that device down the branch without the compressor's collective, and
    the others wait for it forever (on XLA:CPU the rendezvous aborts the
    process). Here the non-finite flag is summed over ``axis_name`` first (one
    scalar all-reduce), so every device takes the same branch: a step whose
    gradients are non-finite on any device is skipped on all of them
    (``inner`` state, residuals included, unchanged; zero update), and after
    more than ``max_consecutive_errors`` such steps in a row the update is
    applied anyway, as in optax. With ``axis_name=None`` it is
    ``optax.apply_if_finite``. The state is optax's ``ApplyIfFiniteState``.

    Which NaN policy to use: a compressor's own ``nonfinite="skip"`` (the
    default) already never hangs: a device with a non-finite gradient sends
    an empty message and keeps its state while the others go on. Wrap the
    whole chain in this function when a non-finite step should be dropped
    everywhere (e.g. dynamic loss scaling, where the next step retries with a
    smaller scale). ``optax.apply_if_finite`` (and this function without
    ``axis_name``) around an exchanging compressor under ``shard_map`` is
    refused when the compressor is traced.

    Args:
      inner: the transformation to protect (e.g. the compressor chained with
        the optimizer).
      max_consecutive_errors: non-finite steps in a row that are skipped
        before the update is applied anyway, an int >= 0.
      axis_name: the mesh axis (or axes) the compressor exchanges over.

    Returns:
      An ``optax.GradientTransformationExtraArgs``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> tx = jaxcomp.apply_if_finite(
      ...     jaxcomp.top_k(0.5, axis_name="data"), max_consecutive_errors=3, axis_name="data")
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> g = jax.device_put(jnp.array([1.0, jnp.nan]), jax.NamedSharding(mesh, P("data")))
      >>> f(g).tolist()
      [0.0, 0.0]
    """
    if not (
        isinstance(max_consecutive_errors, (int, np.integer))
        and not isinstance(max_consecutive_errors, bool)
        and max_consecutive_errors >= 0
    ):
        raise ValueError(
            f"max_consecutive_errors must be an int >= 0, got {max_consecutive_errors!r}"
        )
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return optax.ApplyIfFiniteState(
            notfinite_count=jnp.zeros([], jnp.int32),
            last_finite=jnp.array(True, jnp.bool_),
            total_notfinite=jnp.zeros([], jnp.int32),
            inner_state=inner.init(params),
        )

    def update(updates, state, params=None, **extra_args):
        if extra_args.get("jaxcomp_overlap") is not None:
            # With overlap the exchange already ran in the backward pass: this
            # wrapper could no longer skip it on every device.
            raise ValueError(
                "jaxcomp.apply_if_finite cannot wrap a sparsifier run with "
                "make_train_step(overlap=True): the exchange happens inside the backward "
                "pass, before the finiteness decision. Use the sparsifier's own "
                "nonfinite='skip' (decided per group with overlap) or overlap=False."
            )
        if axis_name is None and vma.probing_now():
            _check_no_exchange_inside(inner, updates, state.inner_state, params, extra_args)
        bad = jnp.int32(0)
        for leaf in jax.tree.leaves(updates):
            bad = bad + (~all_finite(leaf)).astype(jnp.int32)
        if axis_name is not None:
            bad = lax.psum(bad, axis_name)
        finite = bad == 0
        notfinite_count = jnp.where(
            finite, jnp.zeros([], jnp.int32), optax.safe_increment(state.notfinite_count)
        )

        def do_update(_):
            return inner.update(updates, state.inner_state, params, **extra_args)

        def reject_update(_):
            # Fresh zeros, not zeros_like(updates): typed invariant, like an
            # exchanged update, so the branch does not look un-exchanged. Shaped
            # as inner's update, which may differ from the gradient's
            # (sharded_optimizer returns the owned slices).
            shapes = jax.eval_shape(lambda: do_update(None)[0])
            zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), shapes)
            return zeros, state.inner_state

        # Without axis_name each device decides alone: an exchange traced in
        # the branch is refused (vma.check_not_in_local_branch).
        local = vma.local_branch() if axis_name is None else contextlib.nullcontext()
        with local:  # Branch outputs typed alike under check_vma (old vs new inner state).
            new_updates, new_inner = vma.cond(
                finite | (notfinite_count > max_consecutive_errors), do_update, reject_update, None
            )
        return new_updates, optax.ApplyIfFiniteState(
            notfinite_count=notfinite_count,
            last_finite=finite,
            total_notfinite=jnp.where(
                finite, state.total_notfinite, optax.safe_increment(state.total_notfinite)
            ),
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init, update)


class AccumulateState(NamedTuple):
    """State of :func:`accumulate_then_compress`.

    Attributes:
      mini_step: int32, the mini-steps accumulated since the last exchange
        (``0 .. every_k - 1``; the same on every device).
      accumulator: this device's sum of its gradients since the last
        exchange, a pytree like the gradients in float32 (or the gradient's
        dtype where it is wider); per device under ``shard_map``.
      inner_state: the inner transformation's state. Its ``wire_bytes`` are
        this mini-step's: the exchange's on the last mini-step, 0 on the
        mini-steps that only accumulate (nothing is sent there).
    """

    mini_step: jax.Array
    accumulator: Any
    inner_state: Any


def accumulate_then_compress(
    inner: optax.GradientTransformation, every_k: int
) -> optax.GradientTransformationExtraArgs:
    """Gradient accumulation that compresses and exchanges once per ``every_k`` mini-steps.

    Each device adds its gradients locally for ``every_k`` mini-steps; on the
    last one ``inner`` (the compressor, chained with the optimizer) runs on
    their mean: one compression and one exchange per ``every_k`` mini-steps,
    ``every_k`` times fewer bytes than ``optax.MultiSteps(inner, every_k)``.
    That one (optax 0.2.x) runs ``inner``, exchange included, on the running
    mean at *every* mini-step and keeps the result of the last one only: the
    same updates, ``every_k`` exchanges (``make_train_step`` counts them all
    in ``metrics["wire_bytes"]``). The updates are zero on the other
    mini-steps, as ``MultiSteps``' are. The branch is decided by the
    mini-step counter, equal on every device, so no device skips an exchange
    the others wait in.

    The accumulator is per device (like a residual): ``jaxcomp.elastic``
    refuses to resize such a state, as it refuses ``MultiSteps``'; resize at
    an accumulation boundary with your own rule if needed.

    Args:
      inner: the transformation to run every ``every_k`` mini-steps (e.g.
        ``optax.chain(jaxcomp.top_k(1e-3, axis_name="data"), optax.sgd(0.1))``).
      every_k: mini-steps per update, an int >= 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`AccumulateState`.

    Raises:
      ValueError: for ``every_k`` not an int >= 1.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.accumulate_then_compress(jaxcomp.top_k(0.5), every_k=2)
      >>> g = {"w": jnp.array([1.0, -4.0, 2.0, 0.0])}
      >>> state = tx.init(g)
      >>> u, state = tx.update(g, state)  # accumulated only
      >>> u["w"].tolist(), int(state.mini_step)
      ([0.0, 0.0, 0.0, 0.0], 1)
      >>> u, state = tx.update({"w": jnp.array([3.0, 0.0, 2.0, 0.0])}, state)
      >>> u["w"].tolist(), int(state.mini_step)  # top 2 of the mean [2, -2, 2, 0]
      ([2.0, -2.0, 2.0, 0.0], 0)
    """
    every_k = V.check_int("every_k", every_k, 1)
    inner = optax.with_extra_args_support(inner)

    def accumulator_like(g):
        return jnp.zeros(jnp.shape(g), jnp.promote_types(jnp.result_type(g), jnp.float32))

    def init(params):
        return AccumulateState(
            mini_step=jnp.zeros([], jnp.int32),
            accumulator=jax.tree.map(accumulator_like, params),
            inner_state=inner.init(params),
        )

    def update(updates, state, params=None, **extra_args):
        V.check_state_type(state, AccumulateState, "jaxcomp.accumulate_then_compress")
        V.check_tree_like(updates, state.accumulator, "jaxcomp.accumulate_then_compress")
        total = jax.tree.map(lambda a, g: a + g.astype(a.dtype), state.accumulator, updates)
        last = state.mini_step == every_k - 1

        def compress(_):
            mean = jax.tree.map(lambda t, g: (t / every_k).astype(g.dtype), total, updates)
            return inner.update(mean, state.inner_state, params, **extra_args)

        def accumulate(_):
            # Fresh zeros typed invariant, like an exchanged update (see apply_if_finite).
            shapes = jax.eval_shape(lambda: compress(None)[0])
            zeros = jax.tree.map(lambda u: jnp.zeros(u.shape, u.dtype), shapes)
            return zeros, _without_wire_bytes(state.inner_state)

        new_updates, new_inner = vma.cond(last, compress, accumulate, None)
        return new_updates, AccumulateState(
            mini_step=jnp.where(last, 0, state.mini_step + 1).astype(jnp.int32),
            accumulator=jax.tree.map(lambda t: jnp.where(last, jnp.zeros_like(t), t), total),
            inner_state=new_inner,
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _without_wire_bytes(state):
    """``state`` with every ``wire_bytes`` field zero: a mini-step that sent nothing."""

    def zero(path, x):
        name = getattr(path[-1], "name", getattr(path[-1], "key", None)) if path else None
        return jnp.zeros_like(x) if name == "wire_bytes" else x

    return jax.tree_util.tree_map_with_path(zero, state)


def _check_no_exchange_inside(inner, updates, inner_state, params, extra_args) -> None:
    """Raises if ``inner`` exchanges per-device gradients (make_train_step's probe only).

    Without ``axis_name`` each device decides on its own gradients, so one
    device's NaN would send it past the exchange while the others wait in it.
    """
    if not any(varying_axes(leaf) for leaf in jax.tree.leaves(updates)):
        return  # gradients already averaged: every device decides alike
    traced, _ = inner.update(updates, inner_state, params, **extra_args)
    if any(not varying_axes(leaf) for leaf in jax.tree.leaves(traced)):
        raise vma.ProbeError(
            "jaxcomp.apply_if_finite without axis_name wraps a transformation that exchanges "
            "over the mesh: a NaN on one device would skip its exchange while the others wait "
            "in it (the step hangs; XLA:CPU aborts the process). Pass the step's axis, e.g. "
            "jaxcomp.apply_if_finite(tx, max_consecutive_errors, axis_name='data')."
        )
