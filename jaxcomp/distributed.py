"""Data-parallel training helpers: per-device gradients, train steps, multi-process set-up.

The main path is ``jax.shard_map`` over a mesh axis (default ``"data"``):
parameters replicated, batch sharded along the axis, and the optimizer state
*per device* (error-feedback residuals differ between devices), stored with a
leading device axis sharded along the mesh axis::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3, axis_name="data"), optax.sgd(0.1))
    params = replicate(params, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    train_step = make_train_step(loss_fn, tx, mesh)
    for batch in batches:
        params, opt_state, metrics = train_step(params, opt_state, shard_batch(batch, mesh))
        jax.block_until_ready(metrics)  # bound the steps in flight (simulated devices)

Two traps this module handles: inside ``shard_map``, ``jax.grad`` w.r.t.
replicated parameters returns gradients already ``psum``-ed over the axis
(the transpose of the implicit ``pvary``), so a compressor would see the
global sum instead of its device's gradient (:func:`per_device_grad` casts the
parameters to device-varying first); and sparse exchanges end in an
all-gather, whose result JAX types as device-varying although every device
holds the same bits, so the step's ``shard_map`` runs with ``check_vma=False``
to return replicated parameters without another all-reduce.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp._vma import axis_name_tuple, check_per_device, varying_axes
from jaxcomp.comm import collectives
from jaxcomp.comm import local as local_lib
from jaxcomp.transforms import overlap as overlap_lib
from jaxcomp.transforms.base import all_finite

__all__ = [
    "AccumulateState",
    "DenseExchangeState",
    "ShardedOptimizerState",
    "TimeSplit",
    "accumulate_then_compress",
    "apply_if_finite",
    "dense_exchange",
    "flax_param_specs",
    "init_opt_state",
    "initialize_multiprocess",
    "make_pmap_train_step",
    "make_train_step",
    "per_device_grad",
    "per_device_value_and_grad",
    "place_params",
    "replicate",
    "shard_batch",
    "sharded_optimizer",
    "skip_not_finite",
    "split_step_time",
    "stack_for_pmap",
    "time_split",
    "unexchanged_leaves",
]


def _is_varying(x, axis_name) -> bool:
    """Whether ``x`` is already typed device-varying along ``axis_name``."""
    return all(name in varying_axes(x) for name in axis_name_tuple(axis_name))


def _to_varying(tree, axis_name):
    def cast(x):
        if _is_varying(x, axis_name):
            return x  # pcast from varying to varying is an error
        return lax.pcast(x, axis_name, to="varying")

    return jax.tree.map(cast, tree)


def per_device_value_and_grad(fun: Callable, axis_name, *, has_aux: bool = False) -> Callable:
    """``jax.value_and_grad`` w.r.t. the first argument, giving this device's gradient.

    Inside ``shard_map``, differentiating w.r.t. replicated (``P()``)
    parameters inserts a ``psum`` over the axis into the backward pass, so
    plain ``jax.grad`` returns the sum of all devices' gradients. This casts
    the parameters to device-varying (``jax.lax.pcast(..., to="varying")``, a
    no-op on the data) before differentiating, so the gradient is the local
    one, which the compressor must see. Leaves already varying are left as
    they are.

    Args:
      fun: ``fun(params, *args) -> scalar`` (or ``(scalar, aux)``).
      axis_name: the mesh axis the batch is sharded over.
      has_aux: as in ``jax.value_and_grad``.

    Returns:
      ``f(params, *args) -> (value, grads)`` (``((value, aux), grads)`` with aux).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.distributed import per_device_value_and_grad
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> f = jax.shard_map(
      ...     lambda w, x: per_device_value_and_grad(loss, "data")(w, x)[1],
      ...     mesh=mesh, in_specs=(P(), P()), out_specs=P("data"))
      >>> f(jnp.ones(2), jnp.array([3.0, 4.0])).tolist()
      [3.0, 4.0]
    """
    value_and_grad = jax.value_and_grad(fun, has_aux=has_aux)

    def wrapped(params, *args, **kwargs):
        return value_and_grad(_to_varying(params, axis_name), *args, **kwargs)

    return wrapped


def per_device_grad(fun: Callable, axis_name, *, has_aux: bool = False) -> Callable:
    """Like :func:`per_device_value_and_grad` but returns only the gradient (and aux).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.distributed import per_device_grad
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> f = jax.jit(jax.shard_map(
      ...     lambda w, x: per_device_grad(loss, "data")(w, x),
      ...     mesh=mesh, in_specs=(P(), P()), out_specs=P("data")))
      >>> f(jnp.ones(2), jnp.array([3.0, 4.0])).tolist()  # d/dw sum(w * x) = x
      [3.0, 4.0]
    """
    value_and_grad = per_device_value_and_grad(fun, axis_name, has_aux=has_aux)

    def wrapped(params, *args, **kwargs):
        value, grads = value_and_grad(params, *args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


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


# --- FSDP: optimizer state sharded over the data axis ------------------------------


class ShardedOptimizerState(NamedTuple):
    """State of :func:`sharded_optimizer`.

    Attributes:
      compressor: the compressor's state, over whole parameters (error
        feedback keeps this device's unsent part of its *whole* gradient).
      optimizer: the optimizer's state over this device's slice of each
        FSDP parameter (whole replicated parameters).
    """

    compressor: optax.OptState
    optimizer: optax.OptState


def _own_slice_tree(tree, fsdp_dims, axis_name, like=None):
    """This device's slice of every split leaf; a leaf already shaped like ``like``'s is kept."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(fsdp_dims):
        raise ValueError(
            f"sharded_optimizer: param_specs describe {len(fsdp_dims)} leaves, got {len(leaves)}"
        )
    full = leaves if like is None else treedef.flatten_up_to(like)
    n_dev = collectives.axis_size(axis_name)
    index = lax.axis_index(axis_name)
    out = []
    for x, f, dim in zip(leaves, full, fsdp_dims, strict=True):
        size = None if dim is None else jnp.shape(f)[dim] // n_dev
        if dim is None or x.shape[dim] == size:  # replicated, or reduce-scattered already
            out.append(x)
            continue
        out.append(lax.dynamic_slice_in_dim(x, index * size, size, axis=dim))
    return jax.tree.unflatten(treedef, out)


def sharded_optimizer(
    compressor: optax.GradientTransformation,
    optimizer: optax.GradientTransformation,
    param_specs,
    axis_name="data",
) -> optax.GradientTransformationExtraArgs:
    """ZeRO-style: the optimizer's state lives on the slice of each parameter a device owns.

    For FSDP training with :func:`make_train_step` (``param_specs`` splitting
    parameters over the data axis, e.g. ``P("data", None)``): the compressor
    sees this device's whole gradient (its residual is whole: error feedback
    keeps what *this device* has not sent of its own gradient) and exchanges
    over ``axis_name``; of the exchanged mean, each device keeps the slice of
    each split parameter it owns, and ``optimizer`` (any optax optimizer:
    momentum, Adam moments) runs on those slices only, so its state is
    ``1/N`` of the parameters' size per device. Replicated parameters
    (``P()`` leaves) are optimized whole. Equivalent to
    ``optax.chain(compressor, optimizer)`` with the whole state on every
    device (tested), at ``1/N`` of the optimizer's memory: bit for bit where
    XLA contracts no multiply-add (XLA:CPU at optimisation level 0, as the
    tests compile); at XLA's default level the optimizer's arithmetic on a
    slice is fused into other kernels than on the whole leaf, and LLVM's
    fused multiply-adds can round differently: per step at most one float32
    ulp of a parameter plus one of its update (tested with Adam on column
    slices: 9e-10 after 3 steps).

    The exchange: with the compressor's usual exchanges every device receives
    the whole mean and keeps its slice. A sparsifier with
    ``exchange="scatter"`` reduce-scatters the messages instead (each device
    receives only the pairs in its slice: about ``1.5`` messages per device
    whatever ``N``, :func:`jaxcomp.comm.sparse_allreduce.scatter_mean`) for
    the parameters split along their *first* dimension (told to it by the
    update argument ``scatter=``); other leaves use ``exchange="auto"``.

    Args:
      compressor: a jaxcomp compressor with ``axis_name`` (or
        :func:`dense_exchange`).
      optimizer: the optax optimizer run on the owned slices.
      param_specs: the parameters' specs, as given to :func:`make_train_step`.
      axis_name: the data axis.

    Returns:
      A transformation whose ``update`` returns, for split parameters, the
      update of the owned slice (``make_train_step`` applies it to that slice).
      Use it only inside :func:`make_train_step` / :func:`init_opt_state`
      (it needs the data axis bound).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> specs = P("data", None)
      >>> tx = dist.sharded_optimizer(jaxcomp.top_k(0.5, axis_name="data"),
      ...                             optax.adam(0.1), specs)
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> w = dist.place_params(jnp.zeros((2, 1)), mesh, specs)
      >>> state = dist.init_opt_state(tx, w, mesh, param_specs=specs)
      >>> step = dist.make_train_step(loss, tx, mesh, param_specs=specs)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones((2, 1), np.float32)}, mesh)
      >>> w, state, metrics = step(w, state, batch)
      >>> w.sharding.spec
      P('data', None)
    """
    if not isinstance(axis_name, str):
        raise ValueError(f"sharded_optimizer: axis_name must be one axis name, got {axis_name!r}")
    specs_cache = {}

    def fsdp_dims(params):
        leaves, treedef = jax.tree.flatten(params)
        key = (treedef, tuple(jnp.shape(x) for x in leaves))
        if key not in specs_cache:
            specs = treedef.flatten_up_to(_broadcast_specs(param_specs, params))
            specs_cache[key] = tuple(
                next(
                    (
                        d
                        for d, e in enumerate(spec)
                        if e is not None and axis_name in axis_name_tuple(e)
                    ),
                    None,
                )
                for spec in specs
            )
        return specs_cache[key]

    def init_fn(params):
        dims = fsdp_dims(params)
        owned = _own_slice_tree(params, dims, axis_name)
        return ShardedOptimizerState(compressor.init(params), optimizer.init(owned))

    def scatter_mask(params):
        """Leaves a compressor with exchange="scatter" may reduce-scatter: split along dim 0."""
        treedef = jax.tree.structure(params)
        return jax.tree.unflatten(treedef, [d == 0 for d in fsdp_dims(params)])

    def update_fn(updates, state, params=None, **extra):
        if params is None:
            raise ValueError("sharded_optimizer.update needs params (make_train_step passes them)")
        dims = fsdp_dims(params)
        exchanged, comp_state = compressor_update(
            updates, state.compressor, params, scatter=scatter_mask(params), **extra
        )
        owned_updates = _own_slice_tree(exchanged, dims, axis_name, like=params)
        owned_params = _own_slice_tree(params, dims, axis_name)
        new, opt_state = optimizer.update(owned_updates, state.optimizer, owned_params)
        return _typed_as_exchanged(new, exchanged, params), ShardedOptimizerState(
            comp_state, opt_state
        )

    def _typed_as_exchanged(new, exchanged, params):
        """While make_train_step probes (tracing only): an owned slice typed as exchanged.

        A slice taken at this device's index is typed device-varying, so the
        probe would take every split leaf for an unexchanged one wherever this
        transformation sits (inside optax.chain, say). A leaf whose
        compressor output was exchanged (typed invariant, or reduce-scattered:
        a slice shape) is typed invariant here; one the compressor left
        per-device stays varying, and the probe still reports it.
        """
        if not vma.probing_now():
            return new
        out = []
        new_leaves, treedef = jax.tree.flatten(new)
        for leaf, ex, p in zip(
            new_leaves,
            treedef.flatten_up_to(exchanged),
            treedef.flatten_up_to(params),
            strict=True,
        ):
            done = axis_name not in varying_axes(ex) or jnp.shape(ex) != jnp.shape(p)
            varying = axis_name in varying_axes(leaf)
            out.append(lax.pmax(leaf, axis_name) if done and varying else leaf)
        return jax.tree.unflatten(treedef, out)

    compressor_update = optax.with_extra_args_support(compressor).update
    # make_train_step's exchange check looks through to the compressor (told
    # which leaves it may reduce-scatter: their slices differ per device).
    update_fn.sharded_compressor = (compressor, scatter_mask)
    update_fn.fsdp_dims = fsdp_dims
    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def _broadcast_specs(param_specs, params):
    """``param_specs`` as a pytree like ``params`` (one spec for all is broadcast)."""
    if isinstance(param_specs, P):
        return jax.tree.map(lambda _: param_specs, params)
    return param_specs


# --- placing data on the mesh --------------------------------------------------


def _place(x, sharding: NamedSharding):
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return jax.jit(lambda v: v, out_shardings=sharding)(x)
    # Each process passes its local data: the whole value for replicated specs,
    # its contiguous slice of the leading axis for sharded ones.
    return jax.make_array_from_process_local_data(sharding, np.asarray(x))


def replicate(tree, mesh: Mesh):
    """Places a pytree replicated on every device of ``mesh`` (works across processes).

    Every process must pass the same values.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp.distributed import replicate
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> p = replicate({"w": jnp.zeros(2)}, mesh)
      >>> p["w"].sharding.spec
      P()
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _place(x, sharding), tree)


def shard_batch(batch, mesh: Mesh, axis_name="data"):
    """Shards a batch along its leading axis over ``axis_name`` (works across processes).

    With several processes each passes its own part of the global batch (its
    devices' rows, in process order); the global batch is their concatenation.

    Example:
      >>> import jax, numpy as np
      >>> from jaxcomp.distributed import shard_batch
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> b = shard_batch({"x": np.arange(4.0)}, mesh)
      >>> b["x"].sharding.spec, b["x"].tolist()
      (P('data',), [0.0, 1.0, 2.0, 3.0])
    """
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(lambda x: _place(x, sharding), batch)


class ParamLayout(NamedTuple):
    """How a step's arrays sit on a mesh with a data axis and optional model axes."""

    data_axes: tuple  # the axes the batch is split over (compression exchanges over these)
    model_axes: tuple  # every other mesh axis: parameters may be sharded over them
    specs: object  # model-axes part of each leaf's spec (None: no model axes)
    data_specs: object  # data-axis part of each leaf's spec: the step's in/out specs
    fsdp_dims: tuple  # per leaf (flattened order): the dimension split over the data axis, or None

    @property
    def manual_data(self) -> frozenset:
        return frozenset(self.data_axes)

    @property
    def fsdp(self) -> bool:
        return any(d is not None for d in self.fsdp_dims)


def _spec_axes(spec) -> set:
    names = set()
    for entry in spec:
        if entry is None:
            continue
        names.update(entry if isinstance(entry, tuple) else (entry,))
    return names


def _keep_axes(spec: P, axes) -> P:
    """``spec`` with only the entries naming ``axes`` (others None)."""
    return P(*(e if e is not None and set(axis_name_tuple(e)) <= set(axes) else None for e in spec))


def _check_spec(leaf, spec, mesh, data_axes, model_axes, axis_name):
    """Validates one leaf's spec; returns the dimension split over the data axis, or None."""
    if not isinstance(spec, P):
        raise ValueError(f"param_specs: every leaf must be a PartitionSpec, got {spec!r}")
    axes = _spec_axes(spec)
    unknown = axes - set(mesh.axis_names)
    if unknown:
        raise ValueError(
            f"param_specs: {spec} names axes {sorted(unknown)} that the mesh does not have "
            f"(axes: {mesh.axis_names})"
        )
    if len(spec) > jnp.ndim(leaf):
        raise ValueError(f"param_specs: {spec} has more entries than the leaf's rank")
    fsdp_dim = None
    for dim, entry in enumerate(spec):
        if entry is None:
            continue
        names = set(axis_name_tuple(entry))
        if names & set(data_axes):
            if names != set(data_axes) or len(data_axes) != 1 or fsdp_dim is not None:
                raise ValueError(
                    f"param_specs: {spec}: a parameter is split over the data axis "
                    f"{axis_name!r} (FSDP) along one dimension, by that axis alone"
                )
            fsdp_dim = dim
        size = int(np.prod([mesh.shape[a] for a in names]))
        if jnp.shape(leaf)[dim] % size:
            raise ValueError(
                f"param_specs: {spec} splits dimension {dim} of a leaf of shape "
                f"{jnp.shape(leaf)} over {size} devices, which does not divide it"
            )
    return fsdp_dim


def param_layout(mesh: Mesh, axis_name, params, param_specs) -> ParamLayout:
    """Validates ``param_specs`` against ``mesh`` and the data axis ``axis_name``."""
    data_axes = axis_name_tuple(axis_name)
    missing = [a for a in data_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"axis_name {axis_name!r} is not an axis of the mesh (axes {mesh.axis_names})"
        )
    model_axes = tuple(a for a in mesh.axis_names if a not in data_axes)
    leaves, treedef = jax.tree.flatten(params)
    if param_specs is None:
        specs = [P()] * len(leaves)
    else:
        try:
            specs = treedef.flatten_up_to(param_specs)
        except (ValueError, TypeError) as e:
            raise ValueError(
                "param_specs must be a pytree of PartitionSpec with the parameters' structure "
                f"({treedef}): {e}"
            ) from None
    dims = [
        _check_spec(leaf, spec, mesh, data_axes, model_axes, axis_name)
        for leaf, spec in zip(leaves, specs, strict=True)
    ]
    model_specs = [_keep_axes(spec, model_axes) for spec in specs]
    data_specs = [_keep_axes(spec, data_axes) for spec in specs]
    return ParamLayout(
        data_axes,
        model_axes,
        jax.tree.unflatten(treedef, model_specs) if model_axes else None,
        jax.tree.unflatten(treedef, data_specs),
        tuple(dims),
    )


def _replicated(params):
    return jax.tree.map(lambda _: P(), params)


def place_params(params, mesh: Mesh, param_specs=None, axis_name="data"):
    """Places parameters on ``mesh``: sharded over model axes by ``param_specs``, else replicated.

    Args:
      params: the parameter pytree (host or device arrays).
      mesh: the device mesh (a data axis, optionally model axes).
      param_specs: a pytree of ``PartitionSpec`` like ``params`` naming model
        axes only (e.g. ``P(None, "model")`` for a Dense kernel split by
        columns), or None (replicated: :func:`replicate`).
      axis_name: the data axis.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
      >>> w = dist.place_params(jnp.zeros((2, 4)), mesh, P(None, "model"))
      >>> w.sharding.spec
      P(None, 'model')
    """
    param_layout(mesh, axis_name, params, param_specs)  # validates
    if param_specs is None:
        return replicate(params, mesh)
    leaves, treedef = jax.tree.flatten(params)
    specs = treedef.flatten_up_to(param_specs)
    placed = [_place(x, NamedSharding(mesh, s)) for x, s in zip(leaves, specs, strict=True)]
    return jax.tree.unflatten(treedef, placed)


def flax_param_specs(boxed_params, rules=None):
    """Mesh ``PartitionSpec`` objects read from Flax's (logical) partitioning metadata.

    ``boxed_params`` are the parameters as ``model.init`` returns them when
    the model annotates its kernels with ``nn.with_partitioning`` (mesh axes)
    or ``nn.with_logical_partitioning`` (logical axes, mapped to mesh axes by
    ``rules``, e.g. ``(("mlp", "model"), ("embed", None))``). Leaves without
    metadata are replicated. Unbox the parameters themselves with
    ``flax.linen.meta.unbox``.

    Example:
      >>> import jax, jax.numpy as jnp, flax.linen as nn
      >>> from jaxcomp import distributed as dist
      >>> init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
      >>> layer = nn.Dense(4, kernel_init=init)
      >>> boxed = layer.init(jax.random.key(0), jnp.ones((1, 2)))["params"]
      >>> specs = dist.flax_param_specs(boxed, rules=(("embed", None), ("mlp", "model")))
      >>> specs["kernel"], specs["bias"]
      (P(None, 'model'), P())
    """
    import flax.linen as nn  # noqa: PLC0415 (flax only for this helper)

    logical = nn.get_partition_spec(boxed_params)
    if rules is None:
        return logical
    return nn.logical_to_mesh(logical, rules)


def _stack(tree, n_leading: int):
    return jax.tree.map(lambda x: jnp.asarray(x)[(None,) * n_leading], tree)


def _unstack(tree, n_leading: int):
    return jax.tree.map(lambda x: x[(0,) * n_leading], tree)


def _fsdp_specs(param_specs, axis_name) -> bool:
    """Whether ``param_specs`` split some parameter over the data axis."""
    names = set(axis_name_tuple(axis_name))
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    return any(_spec_axes(s) & names for s in specs if isinstance(s, P))


def _gather_fsdp(params, layout: ParamLayout, axis_name):
    """Whole FSDP leaves from this device's slices (all-gather); (params, bytes sent)."""
    if not layout.fsdp:
        return params, jnp.float32(0)
    leaves, treedef = jax.tree.flatten(params)
    n_dev = collectives.axis_size(axis_name)
    out, nbytes = [], 0
    for x, dim in zip(leaves, layout.fsdp_dims, strict=True):
        if dim is None:
            out.append(x)
            continue
        out.append(lax.all_gather(x, axis_name, axis=dim, tiled=True))
        nbytes += x.size * x.dtype.itemsize
    wire = jnp.float32(collectives.allgather_bytes(nbytes, n_dev))
    return jax.tree.unflatten(treedef, out), wire


def _own_slices(updates, params, layout: ParamLayout, axis_name):
    """This device's slice of each FSDP leaf's update (already a slice: kept)."""
    if not layout.fsdp:
        return updates
    leaves, treedef = jax.tree.flatten(updates)
    index = lax.axis_index(axis_name)
    out = []
    for u, p, dim in zip(leaves, jax.tree.leaves(params), layout.fsdp_dims, strict=True):
        if u.shape == p.shape:
            out.append(u)
            continue
        if dim is None:
            raise ValueError(
                f"make_train_step: tx returned an update of shape {u.shape} for a replicated "
                f"parameter of shape {p.shape} (a reduce-scatter's slice?): split the parameter "
                f"over {axis_name!r} in param_specs, or exchange it whole"
            )
        size = p.shape[dim]
        if u.shape[dim] != size * collectives.axis_size(axis_name):
            raise ValueError(
                f"make_train_step: an update of shape {u.shape} for a parameter slice of "
                f"shape {p.shape} split over {axis_name!r} along dimension {dim}"
            )
        out.append(lax.dynamic_slice_in_dim(u, index * size, size, axis=dim))
    return jax.tree.unflatten(treedef, out)


def _per_model_shard(fn, layout: ParamLayout, in_specs, out_specs, *, check_vma=False):
    """Runs ``fn`` once per model shard (manual over the model axes), inside the data map."""
    if not layout.model_axes:
        return fn

    def mapped(*args):
        # Built when called: the mesh is the one the enclosing data map is tracing in.
        return jax.shard_map(
            fn,
            mesh=jax.sharding.get_abstract_mesh(),
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(layout.model_axes),
            check_vma=check_vma,
        )(*args)

    return mapped


def _sharded_update(tx, layout: ParamLayout, *, check_vma=False, stack_updates=False):
    """``tx.update`` where each model shard compresses its own slice of every leaf.

    With model axes the optimizer state is stacked ``(model axes..., *local
    shape)`` inside the data map; each shard unstacks its copy, runs ``tx`` on
    its slices of the gradients and parameters, and stacks the result again.
    ``stack_updates`` stacks the updates too (the typing probe: a replicated
    leaf's update is then not asserted equal across shards, which
    ``check_vma`` cannot prove since the state is per shard).
    """
    if not layout.model_axes:
        return tx.update
    n_model = len(layout.model_axes)
    state_spec = P(*layout.model_axes)

    def local(grads, state, params, extra):
        updates, state = tx.update(grads, _unstack(state, n_model), params, **extra)
        return (_stack(updates, n_model) if stack_updates else updates), _stack(state, n_model)

    def update(grads, state, params, **extra):
        mapped = _per_model_shard(
            local,
            layout,
            in_specs=(layout.specs, state_spec, layout.specs, P()),
            out_specs=(state_spec if stack_updates else layout.specs, state_spec),
            check_vma=check_vma,
        )
        return mapped(grads, state, params, extra)

    return update


def init_opt_state(
    tx: optax.GradientTransformation, params, mesh: Mesh, axis_name="data", *, param_specs=None
):
    """Per-device optimizer state, stacked along a leading device axis.

    Runs ``tx.init`` on every device (inside ``shard_map``) so each holds its
    own copy; leaves get shape ``(N, *leaf.shape)`` sharded along
    ``axis_name``, the layout :func:`make_train_step` expects. Per-device
    randomness comes from folding the axis index in the compressor's update,
    not from different initial states.

    Args:
      tx: the optimizer (compressor chained with an optax optimizer).
      params: the parameters (placed replicated with :func:`replicate` if not).
      mesh: the device mesh.
      axis_name: the data-parallel axis.
      param_specs: with model axes in ``mesh`` (every axis but ``axis_name``),
        how each parameter is sharded over them (:func:`place_params`; None:
        replicated). Each model shard then holds the state of its own slices:
        leaves get shape ``(N, M_1, ..., *local shape)`` for model axes of
        sizes ``M_1, ...``, sharded over ``(axis_name, *model axes)``.

    Returns:
      The stacked state (a pytree of global arrays).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.5, axis_name="data"), optax.sgd(0.1))
      >>> params = dist.replicate({"w": jnp.zeros(3)}, mesh)
      >>> state = dist.init_opt_state(tx, params, mesh)
      >>> state[0].residual["w"].shape  # (devices, *leaf.shape)
      (1, 3)
      >>> state[0].residual["w"].sharding.spec
      P('data', None)
    """
    layout = param_layout(mesh, axis_name, params, param_specs)
    params = place_params(params, mesh, param_specs, axis_name)
    n_model = len(layout.model_axes)

    def init_shard(p):
        return _stack(tx.init(p), n_model)

    def init(p):
        shard = _per_model_shard(
            init_shard, layout, in_specs=(layout.specs,), out_specs=P(*layout.model_axes)
        )
        return _stack(shard(_gather_fsdp(p, layout, axis_name)[0]), 1)

    init_fn = jax.shard_map(
        init,
        mesh=mesh,
        in_specs=(layout.data_specs,),
        out_specs=P(axis_name),
        axis_names=layout.manual_data,
        check_vma=False,
    )
    return jax.jit(init_fn)(params)


def check_stacked_state(
    opt_state,
    mesh: Mesh,
    layout: ParamLayout,
    who: str = "make_train_step",
    name: str = "opt_state",
    init: str = "jaxcomp.distributed.init_opt_state(tx, params, mesh)",
) -> None:
    """Raises unless every leaf of ``opt_state`` is stacked for this mesh's data-axis devices.

    The step splits the state's leading axis over the devices and each reads
    its first row: a state stacked for another device count would run, every
    device reading one row of its block, and the other rows (what those
    devices owed, their residuals) would be silently dropped. ``who``,
    ``name`` and ``init``: the step, the field and the initialiser the
    message names.
    """
    n_data = math.prod(mesh.shape[a] for a in layout.data_axes)
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        rows = jnp.shape(leaf)[0] if jnp.ndim(leaf) else None
        if rows != n_data:
            where = f" leaf {jax.tree_util.keystr(path)}" if path else ""
            raise ValueError(
                f"{who}: {name}{where} has shape {jnp.shape(leaf)}, but the state must be "
                f"stacked for the mesh's {n_data} devices along {layout.data_axes} (leading "
                f"axis {n_data}). Create it with {init}; to move a state saved on another "
                "device count without losing its residuals, use "
                "jaxcomp.elastic.resize_opt_state."
            )


def wire_bytes_total(state, inner_run_bytes=None):
    """Sum of every ``wire_bytes`` field in ``state`` (a chain may hold several), or None.

    Under ``optax.MultiSteps`` (optax 0.2.x) the inner transformation runs,
    its exchange included, on every mini-step that is not skipped (on the
    running mean of the mini-batch gradients), but its new state is kept on
    the last mini-step only: on the others ``wire_bytes`` still holds the
    last kept run's. What was sent is counted on every mini-step that ran:
    ``inner_run_bytes`` when the caller knows one run's bytes (see
    :func:`inner_run_wire_bytes`), else the inner state's ``wire_bytes``
    (jaxcomp's exchanges send the same bytes on every run, so that is this
    run's, bar the mini-steps before the first kept run, which read 0).
    """
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    total, found = jnp.float32(0), False
    for node in jax.tree.leaves(state, is_leaf=is_multi):
        if is_multi(node):
            inner = wire_bytes_total(node.inner_opt_state)
            if inner_run_bytes is not None:
                inner = jnp.float32(inner_run_bytes)
            if inner is not None:
                skip = node.skip_state
                skipped = skip.get("should_skip") if isinstance(skip, dict) else None
                ran = True if skipped is None else ~jnp.ravel(skipped)[0]
                total, found = total + jnp.where(ran, inner, 0), True
    rest = jax.tree.map(lambda x: None if is_multi(x) else x, state, is_leaf=is_multi)
    # Each field is a scalar, or one per model shard (stacked): summed over them.
    for _, v in optax.tree.get_all_with_path(rest, "wire_bytes"):
        total, found = total + jnp.sum(jnp.asarray(v, jnp.float32)), True
    return total if found else None


def inner_run_wire_bytes(tx, grads, state, params, extra):
    """Bytes one run of ``optax.MultiSteps``' inner update sends, if they are a constant.

    optax keeps the inner state of the last mini-step only, so the bytes of
    the other mini-steps' runs are never stored. jaxcomp's exchanges compute
    their bytes from shapes and the device count: in the inner update's
    jaxpr (traced, nothing run) the bytes are then a function of literals
    alone, evaluated here. None when ``tx`` is not ``optax.MultiSteps`` or the
    bytes depend on data (the caller falls back to the stored count).
    """
    multi = getattr(tx.update, "__self__", tx)
    if not isinstance(multi, optax.MultiSteps) or not isinstance(state, optax.MultiStepsState):
        return None
    inner = optax.with_extra_args_support(multi.inner_opt)

    def wire(g, s, p, e):
        total = wire_bytes_total(inner.update(g, s, p, **e)[1])
        return jnp.float32(0) if total is None else total

    try:
        closed = jax.make_jaxpr(wire)(grads, state.inner_opt_state, params, extra)
        return _constant_output(closed)
    except Exception:  # noqa: BLE001 (a best effort: the stored count is the fallback)
        return None


def _constant_output(closed) -> float | None:
    """The value of a one-output jaxpr's output if it depends on no input and no effect."""
    literal = jax.extend.core.Literal
    jaxpr = closed.jaxpr
    (out,) = jaxpr.outvars
    if isinstance(out, literal):
        return float(out.val)
    inputs = set(jaxpr.invars)
    needed, cone = {out}, []
    for eqn in reversed(jaxpr.eqns):
        if not any(v in needed for v in eqn.outvars):
            continue
        if eqn.effects or any(v in inputs for v in eqn.invars if not isinstance(v, literal)):
            return None
        cone.append(eqn)
        needed.update(v for v in eqn.invars if not isinstance(v, literal))
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    if any(isinstance(env.get(v), jax.core.Tracer) for v in needed):
        return None  # closed over the step's own values: not a constant
    # Evaluated now (we may be inside the step's trace): a few scalar operations.
    with jax.ensure_compile_time_eval():
        for eqn in reversed(cone):
            args = [v.val if isinstance(v, literal) else env[v] for v in eqn.invars]
            outs = eqn.primitive.bind(*args, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
            env.update(zip(eqn.outvars, outs, strict=True))
    return float(env[out])


UNEXCHANGED = ("mean", "error")


def unexchanged_paths(
    tx, params, mesh, axis_name, update_args, layout=None, scattered=frozenset(), averaged=()
) -> list:
    """Key paths of the update leaves that ``tx`` leaves un-averaged over ``axis_name``.

    Traces (abstractly, nothing runs) ``tx.update`` on device-varying
    gradients and a fresh ``tx.init(params)`` inside a ``shard_map`` with
    ``check_vma=True``: jaxcomp's collectives return results typed
    device-invariant (``pmean``, ``all_gather_invariant``), so an update leaf
    still typed device-varying was not exchanged (``optax.masked`` or
    ``optax.multi_transform`` leaving it out of the compressor, a compressor
    without ``axis_name``, plain optax). The real step runs with
    ``check_vma=False`` and per-device optimizer state, where this typing is
    not available.

    ``averaged``: key paths whose gradients are given device-invariant, as
    the step gives them after averaging them itself; an update leaf still
    varying then was made different per device by ``tx`` (a transform that
    reads per-device values into it).
    """
    found = []
    averaged = frozenset(averaged)
    names = set(axis_name_tuple(axis_name))
    # MultiSteps averages what its inner transform averages; its own lax.cond
    # cannot be typed on fresh state, so look through it.
    multi = getattr(tx.update, "__self__", tx)
    if isinstance(multi, optax.MultiSteps):
        return unexchanged_paths(
            multi.inner_opt, params, mesh, axis_name, update_args, layout, averaged=averaged
        )
    # sharded_optimizer: the compressor exchanges; the optimizer then works on owned slices.
    sharded = getattr(tx.update, "sharded_compressor", None)
    if sharded is not None:
        compressor, scatter_mask = sharded
        mask = scatter_mask(params)
        probed = optax.with_extra_args_support(compressor)
        probed = optax.GradientTransformationExtraArgs(
            probed.init, functools.partial(probed.update, scatter=mask)
        )
        # A reduce-scattered leaf's update is this device's slice (a smaller
        # shape than the parameter's): varying by design. A full-shaped
        # varying update of such a leaf is still unexchanged.
        scattered = {path for path, m in jax.tree_util.tree_flatten_with_path(mask)[0] if m}
        return unexchanged_paths(
            probed, params, mesh, axis_name, update_args, layout, scattered, averaged
        )
    if layout is None:
        layout = param_layout(mesh, axis_name, params, None)
    n_model = len(layout.model_axes)
    init_shard = _per_model_shard(
        lambda p: _stack(tx.init(p), n_model),
        layout,
        in_specs=(layout.specs,),
        out_specs=P(*layout.model_axes),
        check_vma=True,
    )
    update = _sharded_update(tx, layout, check_vma=True, stack_updates=True)
    n_data = math.prod(mesh.shape[a] for a in names)

    def probe(params, extra):
        def gradient(path, p):
            z = jnp.zeros_like(p)
            return z if path in averaged else lax.pcast(z, axis_name, to="varying")

        grads = jax.tree_util.tree_map_with_path(gradient, params)
        extra = jax.tree.map(lambda x: x[0], extra)
        updates, _ = update(grads, init_shard(params), params, **extra)
        shapes = {path: jnp.shape(p) for path, p in jax.tree_util.tree_flatten_with_path(params)[0]}
        for path, leaf in jax.tree_util.tree_flatten_with_path(updates)[0]:
            # This device's slice of a reduce-scatter (on one device: the whole leaf).
            if path in scattered and (jnp.shape(leaf) != shapes[path] or n_data == 1):
                continue
            if names & varying_axes(leaf):
                found.append(path)
        return jnp.zeros([], jnp.float32)

    def abstract(x, spec):
        sharding = NamedSharding(mesh, spec)
        return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)

    probe_map = jax.shard_map(
        probe,
        mesh=mesh,
        in_specs=(P(), P(axis_name)),
        out_specs=P(),
        axis_names=layout.manual_data,
        check_vma=True,
    )
    param_specs = layout.specs if layout.specs is not None else _replicated(params)
    try:
        with vma.probing():
            jax.eval_shape(
                probe_map,
                jax.tree.map(abstract, params, param_specs),
                jax.tree.map(lambda x: abstract(x, P(axis_name)), update_args),
            )
    except vma.ProbeError:
        raise  # already says what to use (make_gossip_train_step, axis_name=...)
    except NameError as e:
        if "unbound axis name" not in str(e):
            raise _probe_error(axis_name, e) from e
        # A compressor's axis_name that is not the step's: not a cond problem.
        raise ValueError(
            f"make_train_step: tx exchanges over a mesh axis the step does not map over "
            f"({e}); the step maps over axis_name={axis_name!r} (mesh axes "
            f"{tuple(mesh.axis_names)}): give the compressor axis_name={axis_name!r}"
        ) from None
    except TypeError as e:
        if "cond branches must have equal output types" not in str(e):
            raise _probe_error(axis_name, e) from e
        # JAX's message is kilobytes of branch types; what it means is one line.
        raise ValueError(
            "make_train_step: tx branches with lax.cond on this device's values (e.g. "
            "optax.apply_if_finite, whose branches differ in device-variance typing): under "
            "shard_map a device that takes the other branch skips the exchange while the "
            "others wait in it (the step hangs). Use jaxcomp.apply_if_finite(tx, "
            f"max_consecutive_errors, axis_name={axis_name!r}), which decides on all devices "
            "together."
        ) from None
    except Exception as e:  # noqa: BLE001 (any tracing failure: say what it means)
        raise _probe_error(axis_name, e) from e
    return found


def _probe_error(axis_name, error: Exception) -> ValueError:
    """What make_train_step says when tracing tx under check_vma fails for another reason."""
    return ValueError(
        "make_train_step could not trace tx under shard_map's check_vma typing to find "
        f"which update leaves it averages over {axis_name!r} "
        f"({type(error).__name__}: {error})."
    )


def check_averaged_stay_identical(
    tx, params, mesh, axis_name, update_args, layout, paths, who="make_train_step"
):
    """Raises if ``tx`` makes a leaf the step averages itself differ between devices.

    The step averages the gradients at ``paths`` before ``tx``; a transform
    that then mixes per-device values into them (``clip_by_global_norm``
    over leaves the compressor has not exchanged yet, ``scale_by_weight``'s
    per-device factor) gives every device another update of a replicated
    parameter.
    """
    diverging = unexchanged_paths(tx, params, mesh, axis_name, update_args, layout, averaged=paths)
    if diverging:
        raise ValueError(
            f"{who}: tx does not average these update leaves, and it makes them "
            "differ between devices even after the step averages their gradients before tx: "
            f"{', '.join(jax.tree_util.keystr(p) for p in diverging)}; the replicated "
            "parameters would diverge. A transform before the exchange reads per-device values "
            "into them (optax.clip_by_global_norm over leaves not exchanged yet, "
            "jaxcomp.aggregation.scale_by_weight's per-device factor). Exchange every leaf "
            "inside tx (optax.multi_transform with jaxcomp.dense_exchange or "
            "jaxcomp.aggregation.weighted_exchange for the others), or move that transform "
            "after the exchange."
        )


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    has_aux: bool = False,
    mutable: bool = False,
    donate: bool = True,
    unexchanged: str = "mean",
    overlap: bool = False,
    communicate: bool = True,
    param_specs=None,
) -> Callable:
    """Builds a jitted data-parallel train step over ``mesh``.

    Each device computes the gradient of ``loss_fn`` on its shard of the batch
    (its own gradient, see :func:`per_device_value_and_grad`), runs ``tx`` (a
    compressor with ``axis_name`` set does the exchange; for the dense
    baseline chain :func:`dense_exchange` first) with its own optimizer state,
    and applies the averaged update to the replicated parameters.

    Parameters stay replicated: every update leaf must be averaged over the
    axis. When the step is traced, ``tx`` is traced once more under
    ``shard_map``'s ``check_vma`` typing to find the leaves it does not
    exchange (``optax.masked`` or ``optax.multi_transform`` leaving some
    parameters out of the compressor, a compressor without ``axis_name``,
    plain optax). With ``unexchanged="mean"`` (default) their gradients are
    averaged with a dense all-reduce *before* ``tx`` (so a stateful optimizer
    sees the mean gradient, as in plain data-parallel training) and the bytes
    are counted in ``metrics["wire_bytes"]``; with ``"error"`` a
    ``ValueError`` names them. :func:`unexchanged_leaves` tells which they are.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with
        ``has_aux``), the mean loss of one device's shard. With ``mutable``
        it is called as ``loss_fn(params, batch, model_state=...)`` and returns
        ``(scalar, new_model_state)`` (``(scalar, (new_model_state, aux))``
        with ``has_aux``); when the step is given ``rng`` it also receives
        ``rng=`` (this device's key).
      tx: the optimizer (a compressor chained with an optax optimizer).
      mesh: the device mesh.
      axis_name: mesh axis the batch is split over.
      has_aux: whether ``loss_fn`` returns auxiliary outputs (returned per
        device in ``metrics["aux"]`` with a leading device axis).
      mutable: whether the model has mutable collections (Flax
        ``batch_stats``): the step takes and returns ``model_state``,
        replicated, the new one averaged over the axis (floating leaves; others
        are taken from the first device).
      donate: donate parameters, optimizer state (and model state) to the
        step (default): the residual update is then done in place, much
        cheaper on large leaves; the arrays passed in are invalid afterwards.
      unexchanged: ``"mean"`` or ``"error"``, what to do with update leaves
        ``tx`` does not average over the axis (see above).
      overlap: run the sparsifier inside the backward pass (DLGS; the
        ldte_bs paper's §3.1): each group of parameters (a leaf, or a group of
        the sparsifier's ``groups=``) is compressed and exchanged as soon as
        its gradient exists, through a ``jax.custom_vjp`` identity applied
        where the group's parameters are first used: the program issues the
        group's collective before the lower layers' backward, so a scheduler
        can overlap them (accelerators; XLA:CPU moves collectives after the
        backward) (:mod:`jaxcomp.transforms.overlap`). The result is the
        same as compressing after the backward pass, bit for bit, as the
        tests compile (XLA:CPU at optimisation level 0) and at XLA's default
        level, where LLVM forms fused multiply-adds (tested with
        ``nn.BatchNorm``'s mutable statistics, ``reuse_period=2`` and
        momentum correction: the accumulation rounds the gradient and
        ``m * velocity`` before adding them, see
        :mod:`jaxcomp.transforms.overlap`). By design, one difference:
        ``nonfinite="skip"`` is decided per group (a group whose gradient
        holds NaN/Inf sends nothing and keeps its residual; the others send),
        since waiting for every gradient would serialise the exchange again.
        Needs a jaxcomp sparsifier with this ``axis_name`` first in ``tx``
        (``optax.chain(jaxcomp.ldte_bs(...), optax.sgd(...))``), receiving
        every gradient leaf unchanged; anything else raises a ``ValueError``
        when the step is first called.
      communicate: ``False`` replaces every collective of the step by a local
        stand-in of the same shapes (:func:`jaxcomp.comm.without_communication`):
        not a training step (each device sees its own message ``N`` times), the
        same program without its communication, to time it
        (:func:`time_split`).
      param_specs: data x model parallel training. ``mesh`` may have axes
        besides ``axis_name`` (e.g. ``("data", "model")``); ``param_specs``
        (a pytree of ``PartitionSpec`` like the parameters, naming model axes
        only, e.g. ``P(None, "model")`` for a Dense kernel split by columns;
        :func:`flax_param_specs` reads them from Flax's partitioning metadata)
        says how each parameter is sharded over them; None replicates
        every parameter. ``loss_fn`` is written for whole arrays: XLA
        partitions it over the model axes (``jax.shard_map`` is manual over
        ``axis_name`` only). The compressor runs once per model shard on that
        shard's slice of each gradient (its ``ratio`` applies to the slice, so
        ``k`` is split over the shards in proportion to their sizes: each of
        ``M`` equal shards sends ``ceil(ratio * n / M)``) and exchanges over
        ``axis_name`` only, among the devices holding the same shard. With a
        model axis of size 1 this is the 1-D step. Place the parameters with
        :func:`place_params` and the state with :func:`init_opt_state` (both
        given the same ``param_specs``). ``overlap`` is not available with
        model axes.

    Returns:
      ``step(params, opt_state, batch, update_args=None, *, model_state=None,
      rng=None)`` returning ``(params, opt_state, metrics)``, or
      ``(params, opt_state, model_state, metrics)`` with ``mutable``.
      ``step.lower(...)`` (same arguments) returns the jitted step's
      ``jax.stages.Lowered``, e.g. to read its compiled HLO.
      ``params`` replicated, ``opt_state`` from :func:`init_opt_state`,
      ``batch`` sharded along its leading axis (:func:`shard_batch`), ``rng``
      a PRNG key (e.g. for dropout; each device gets ``fold_in(rng,
      axis_index)``), ``update_args`` an optional dict of per-device extra
      arguments for ``tx.update`` with a leading device axis (e.g.
      ``{"include": mask}`` for backup workers). ``metrics`` has ``loss``
      (mean over devices) and ``wire_bytes`` (bytes one device put on the
      wire this step, mean over devices: the sum of every ``wire_bytes``
      field in the state plus the dense all-reduce of un-exchanged leaves).

    Raises:
      ValueError: for a bad ``unexchanged``; with ``unexchanged="error"``,
        when ``tx`` leaves an update leaf un-averaged (raised when the step is
        first called, naming the leaves).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.5, axis_name="data"), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> params = dist.replicate(jnp.zeros(2), mesh)
      >>> state = dist.init_opt_state(tx, params, mesh)
      >>> step = dist.make_train_step(loss, tx, mesh)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones(2, np.float32)}, mesh)
      >>> params, state, metrics = step(params, state, batch)
      >>> float(metrics["loss"])
      1.0
    """
    if unexchanged not in UNEXCHANGED:
        raise ValueError(f"unexchanged must be one of {UNEXCHANGED}, got {unexchanged!r}")
    overlap = V.check_bool("overlap", overlap)
    communicate = V.check_bool("communicate", communicate)
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux or mutable)

    def value_and_grad_with_carriers(fun):
        # d/d(params, carriers) with per-device gradients (see per_device_value_and_grad).
        vg = jax.value_and_grad(fun, argnums=(0, 1), has_aux=has_aux or mutable)
        return lambda params, *args, **kw: vg(_to_varying(params, axis_name), *args, **kw)

    overlapped = overlap_lib.value_and_compressed_grad(value_and_grad_with_carriers, tx, axis_name)
    model_axes = tuple(a for a in mesh.axis_names if a not in axis_name_tuple(axis_name))
    if overlap and (model_axes or _fsdp_specs(param_specs, axis_name)):
        raise ValueError(
            "make_train_step(overlap=True) works with replicated parameters on a mesh with the "
            f"data axis only; this mesh has {mesh.axis_names} and param_specs {param_specs} "
            "(compress after the backward pass with model axes or FSDP)"
        )
    n_model_devices = int(np.prod([mesh.shape[a] for a in model_axes]))
    if model_axes and getattr(tx.update, "sharded_compressor", None) is not None:
        raise ValueError(
            "make_train_step: sharded_optimizer (FSDP) on a mesh with model axes "
            f"{model_axes} is not supported; use optax.chain(compressor, optimizer) there"
        )

    def step(params, opt_state, batch, model_state, rng, update_args, dense_paths, layout):
        state = jax.tree.map(lambda x: x[0], opt_state)
        extra = jax.tree.map(lambda x: x[0], update_args)
        # Backup workers: what the step averages itself counts the included devices only.
        include = extra.get("include") if isinstance(extra, dict) else None
        kwargs = {}
        if mutable:
            kwargs["model_state"] = model_state
        if rng is not None:
            kwargs["rng"] = jax.random.fold_in(rng, lax.axis_index(axis_name))
        if overlap:
            loss, updates, state = overlapped(
                loss_fn, params, state, extra, batch, has_aux=has_aux or mutable, **kwargs
            )
            dense_wire, inner_run_bytes = jnp.float32(0), None
        else:
            # FSDP leaves: this device holds a slice; the forward and the
            # compressor see the whole parameter (gathered), the update keeps
            # this device's slice.
            full, gather_wire = _gather_fsdp(params, layout, axis_name)
            loss, grads = value_and_grad(full, batch, **kwargs)
            grads, dense_wire = mean_leaves(grads, dense_paths, axis_name, include)
            if not layout.model_axes:
                # optax.MultiSteps(should_skip_update_fn=optax.skip_not_finite)
                # around an exchange: the probe looks through MultiSteps.
                local_lib.check_no_local_branch_around_exchange(
                    tx, grads, state, full, extra, axis_name, "make_train_step"
                )
            inner_run_bytes = (
                None if layout.model_axes else inner_run_wire_bytes(tx, grads, state, full, extra)
            )
            updates, state = _sharded_update(tx, layout)(grads, state, full, **extra)
            updates = _own_slices(updates, params, layout, axis_name)
            dense_wire = dense_wire + gather_wire
        params = optax.apply_updates(params, updates)
        value, aux = (loss[0], loss[1]) if (has_aux or mutable) else (loss, None)
        if mutable:
            new_model_state, aux = aux if has_aux else (aux, None)
            model_state = jax.tree.map(
                lambda x: _mean_if_float(x, axis_name, include), new_model_state
            )
        metrics = {"loss": lax.pmean(value, axis_name)}
        wire = wire_bytes_total(state, inner_run_bytes)
        if wire is not None and model_axes:
            # Summed over the model shards' stacked statistics: one device sends its shard's.
            wire = wire / n_model_devices
        if dense_paths or layout.fsdp:
            # The dense all-reduce of whole leaves, split among the model shards.
            dense_wire = dense_wire / n_model_devices
        if wire is not None or dense_paths or layout.fsdp:
            wire = dense_wire if wire is None else wire + dense_wire
            metrics["wire_bytes"] = lax.pmean(wire, axis_name)
        aux_out = jax.tree.map(lambda x: jnp.asarray(x)[None], aux) if has_aux else None
        return params, jax.tree.map(lambda x: x[None], state), model_state, metrics, aux_out

    def run(params, opt_state, batch, model_state, rng, update_args):
        layout = param_layout(mesh, axis_name, params, param_specs)
        check_stacked_state(opt_state, mesh, layout)
        tx_dims = getattr(tx.update, "fsdp_dims", None)
        if tx_dims is not None and tuple(tx_dims(params)) != layout.fsdp_dims:
            raise ValueError(
                "make_train_step: sharded_optimizer was given other param_specs than the step "
                f"(split dimensions per leaf {tuple(tx_dims(params))} vs {layout.fsdp_dims}); "
                "give both the same specs"
            )
        paths = unexchanged_paths(tx, params, mesh, axis_name, update_args, layout)
        if paths and unexchanged == "error":
            raise ValueError(
                "make_train_step: tx does not average these update leaves over "
                f"{axis_name!r}, so the replicated parameters would diverge between devices: "
                f"{', '.join(jax.tree_util.keystr(p) for p in paths)}. Give every leaf an "
                "exchange (a compressor with axis_name, or jaxcomp.dense_exchange) or use "
                "unexchanged='mean' to average them densely before tx."
            )
        if paths and overlap:
            raise ValueError(
                "make_train_step(overlap=True): tx does not average these update leaves over "
                f"{axis_name!r}: {', '.join(jax.tree_util.keystr(p) for p in paths)}. With "
                "overlap the sparsifier must exchange every leaf (give it axis_name="
                f"{axis_name!r}, and put it first in optax.chain, outside optax.masked)."
            )
        if paths:
            check_averaged_stay_identical(tx, params, mesh, axis_name, update_args, layout, paths)
            logging.info(
                "make_train_step: averaging %d leaves densely before tx (not exchanged by tx): %s",
                len(paths),
                ", ".join(jax.tree_util.keystr(p) for p in paths),
            )
        per_device = functools.partial(step, dense_paths=frozenset(paths), layout=layout)
        if not communicate:
            per_device = local_lib.without_communication(per_device)
        sharded = jax.shard_map(
            per_device,
            mesh=mesh,
            # Replicated params, model state and key; per-device state, batch
            # and extra args.
            in_specs=(layout.data_specs, P(axis_name), P(axis_name), P(), P(), P(axis_name)),
            out_specs=(layout.data_specs, P(axis_name), P(), P(), P(axis_name)),
            # Manual over the data axis; model axes (if any) stay XLA's to partition.
            axis_names=layout.manual_data,
            # Exchanged updates are bit-identical on every device; the
            # optimizer state that produced them is per device (typed varying),
            # so the check would reject replicated parameters. What the check
            # would guard is verified by the trace-time probe above instead.
            check_vma=False,
        )
        return sharded(params, opt_state, batch, model_state, rng, update_args)

    jitted = jax.jit(run, donate_argnums=(0, 1, 3) if donate else ())

    def train_step(params, opt_state, batch, update_args=None, *, model_state=None, rng=None):
        if mutable and model_state is None:
            raise ValueError("make_train_step(mutable=True): pass model_state= to the step")
        params, opt_state, model_state, metrics, aux = jitted(
            params, opt_state, batch, model_state, rng, update_args or {}
        )
        if has_aux:
            metrics = {**metrics, "aux": aux}
        if mutable:
            return params, opt_state, model_state, metrics
        return params, opt_state, metrics

    def lower(params, opt_state, batch, update_args=None, *, model_state=None, rng=None):
        return jitted.lower(params, opt_state, batch, model_state, rng, update_args or {})

    # For inspection (HLO, cost analysis): train_step.lower(...).compile().as_text().
    train_step.lower = lower
    return train_step


class TimeSplit(NamedTuple):
    """Median seconds of one training step and its parts (:func:`time_split`).

    ``forward_backward + compression + communication == step`` up to the
    clipping of a negative difference (timing noise) to 0.

    Attributes:
      forward_backward: the forward and backward pass (and the elementwise
        application of the gradient to the parameters), no optimizer, no
        compressor, no collective.
      compression: the step without its communication minus
        ``forward_backward``: the compressor's selection, encoding and decoding
        of the ``N`` received messages, and the optimizer's update.
      communication: the step minus the step without communication: the
        *exposed* communication (what overlapping did not hide).
      step: the whole jitted step, state donated, as a training loop pays it.
      step_without_communication: the same step with every collective
        replaced by a local stand-in of the same shapes
        (:func:`jaxcomp.comm.without_communication`).

    Example:
      >>> t = TimeSplit(forward_backward=0.010, compression=0.002, communication=0.003,
      ...               step=0.015, step_without_communication=0.012)
      >>> round(t.forward_backward + t.compression + t.communication, 6) == t.step
      True
      >>> round(t.communication / t.step, 2)  # share of the step spent communicating
      0.2
    """

    forward_backward: float
    compression: float
    communication: float
    step: float
    step_without_communication: float


def split_step_time(
    forward_backward: float, without_communication: float, step: float
) -> TimeSplit:
    """The :class:`TimeSplit` of three measured medians (seconds).

    Example:
      >>> from jaxcomp.distributed import split_step_time
      >>> split_step_time(2.0, 3.0, 4.5).communication
      1.5
    """
    return TimeSplit(
        forward_backward=forward_backward,
        compression=max(without_communication - forward_backward, 0.0),
        communication=max(step - without_communication, 0.0),
        step=step,
        step_without_communication=without_communication,
    )


def _median_seconds_fresh(fn, args, repeats: int) -> float:
    """Median of ``fn(*copy of args)`` (args may be donated), compilation excluded."""
    times = []
    for i in range(repeats + 1):
        fresh = jax.block_until_ready(jax.tree.map(jnp.copy, args))
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*fresh))
        if i:  # the first call compiles
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def time_split(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    params,
    opt_state,
    batch,
    axis_name="data",
    *,
    update_args=None,
    model_state=None,
    rng=None,
    repeats: int = 5,
    **step_options,
) -> TimeSplit:
    """Where a training step's time goes: forward+backward, compression, exposed communication.

    Times three jitted programs on the same inputs (fresh copies per call,
    medians over ``repeats`` calls after one compiling call): the step of
    :func:`make_train_step` (state donated), the same step with
    ``communicate=False`` (every collective replaced by a local stand-in of
    the same shapes), and the forward and backward pass alone. The
    differences are the compression and the exposed communication (see
    :class:`TimeSplit`). The state passed in is not modified.

    On simulated CPU devices "communication" is a copy between threads plus
    the rendezvous of all devices, not a network; with several processes it is
    the real transfer.

    Args:
      loss_fn, tx, mesh, axis_name: as :func:`make_train_step`.
      params, opt_state, batch, update_args, model_state, rng: one step's
        inputs, as the step takes them.
      repeats: timed calls per program (``>= 1``).
      **step_options: :func:`make_train_step`'s ``has_aux``, ``mutable``,
        ``unexchanged``, ``overlap``.

    Returns:
      A :class:`TimeSplit` (seconds).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.5, axis_name="data"), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> params = dist.replicate(jnp.zeros(2), mesh)
      >>> state = dist.init_opt_state(tx, params, mesh)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones(2, np.float32)}, mesh)
      >>> split = dist.time_split(loss, tx, mesh, params, state, batch, repeats=2)
      >>> split.forward_backward > 0 and split.step > 0
      True
    """
    repeats = V.check_int("repeats", repeats, 1)
    unknown = set(step_options) - {"has_aux", "mutable", "unexchanged", "overlap", "param_specs"}
    if unknown:
        raise ValueError(f"time_split: unknown step options {sorted(unknown)}")
    has_aux = step_options.get("has_aux", False)
    mutable = step_options.get("mutable", False)
    kw = {"model_state": model_state, "rng": rng} if mutable else {"rng": rng}
    args = (params, opt_state, batch, update_args)
    medians = {}
    for communicate in (True, False):
        step = make_train_step(
            loss_fn, tx, mesh, axis_name, donate=True, communicate=communicate, **step_options
        )
        medians[communicate] = _median_seconds_fresh(
            lambda p, s, b, u, k, step=step: step(p, s, b, u, **k), (*args, kw), repeats
        )
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux or mutable)

    def forward_backward(params, batch, model_state, rng):
        kwargs = {"model_state": model_state} if mutable else {}
        if rng is not None:
            kwargs["rng"] = jax.random.fold_in(rng, lax.axis_index(axis_name))
        _, grads = value_and_grad(params, batch, **kwargs)
        return optax.apply_updates(params, grads)

    forward_backward = jax.jit(
        jax.shard_map(
            forward_backward,
            mesh=mesh,
            in_specs=(P(), P(axis_name), P(), P()),
            out_specs=P(),
            axis_names=frozenset(axis_name_tuple(axis_name)),
            check_vma=False,
        ),
        donate_argnums=0,
    )
    t_fb = _median_seconds_fresh(forward_backward, (params, batch, model_state, rng), repeats)
    return split_step_time(t_fb, medians[False], medians[True])


def unexchanged_leaves(
    tx: optax.GradientTransformation, params, mesh: Mesh, axis_name="data", update_args=None
) -> list[str]:
    """Paths of the update leaves ``tx`` does not average over ``axis_name``.

    What :func:`make_train_step` averages densely before ``tx`` (or rejects
    with ``unexchanged="error"``). Nothing is computed: ``tx`` is traced.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> params = {"w": jnp.zeros((4, 4)), "b": jnp.zeros(4)}
      >>> tx = optax.masked(jaxcomp.top_k(0.5, axis_name="data"), {"w": True, "b": False})
      >>> dist.unexchanged_leaves(tx, params, mesh)
      ["['b']"]
    """
    paths = unexchanged_paths(tx, params, mesh, axis_name, update_args or {})
    return [jax.tree_util.keystr(p) for p in paths]


def mean_leaves(grads, paths, axis_name, include=None):
    """Dense all-reduce mean of the leaves at ``paths``; (grads, bytes sent).

    One ``pmean`` over all of them: a single multi-operand all-reduce, not one
    collective per bias vector (each costs a rendezvous of all devices). With
    backup workers (``include``, this device's flag) the mean is over the
    included devices, as the compressors' exchanges average their messages.
    """
    if not paths:
        return grads, jnp.float32(0)
    flat, treedef = jax.tree_util.tree_flatten_with_path(grads)
    chosen = [i for i, (path, _) in enumerate(flat) if path in paths]
    leaves = [g for _, g in flat]
    if include is None:
        means = lax.pmean([leaves[i] for i in chosen], axis_name)
        nbytes = sum(leaves[i].size * leaves[i].dtype.itemsize for i in chosen)
        wire = jnp.float32(collectives.allreduce_bytes(nbytes, collectives.axis_size(axis_name)))
    else:
        outs = [collectives.dense_mean(leaves[i], axis_name, include=include) for i in chosen]
        means = [m for m, _ in outs]
        wire = sum((w for _, w in outs), jnp.float32(0))
    for i, m in zip(chosen, means, strict=True):
        leaves[i] = m
    return jax.tree_util.tree_unflatten(treedef, leaves), wire


def _mean_if_float(x, axis_name, include=None):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if include is None:
        return lax.pmean(x, axis_name)
    return collectives.dense_mean(x, axis_name, include=include)[0]


# --- pmap compatibility ----------------------------------------------------------


def stack_for_pmap(tree, n_devices: int | None = None):
    """Stacks ``n_devices`` copies of every leaf (``flax.jax_utils.replicate`` style).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed import stack_for_pmap
      >>> stacked = stack_for_pmap({"w": jnp.arange(3.0)}, n_devices=2)
      >>> stacked["w"].tolist()
      [[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]]
    """
    n = jax.local_device_count() if n_devices is None else n_devices
    return jax.tree.map(lambda x: jnp.broadcast_to(jnp.asarray(x)[None], (n, *jnp.shape(x))), tree)


def make_pmap_train_step(
    loss_fn: Callable, tx: optax.GradientTransformation, axis_name="data"
) -> Callable:
    """The train step as a ``jax.pmap`` (compatibility path; prefer :func:`make_train_step`).

    Every argument has a leading device axis: params and optimizer state from
    :func:`stack_for_pmap` (``tx.init`` per copy), batch reshaped to
    ``(n_devices, per_device_batch, ...)``.

    Returns:
      ``step(params, opt_state, batch) -> (params, opt_state, metrics)``, all
      with a leading device axis.

    Raises:
      ValueError: on the first call for a parameter structure, if ``tx``
        leaves update leaves un-averaged over ``axis_name`` (``optax.masked``
        around the compressor, a compressor without ``axis_name``): the
        replicas would drift apart. Unlike :func:`make_train_step`, this step
        does not average them itself; give every leaf an exchange
        (:func:`dense_exchange` for the rest).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from jaxcomp import distributed as dist
      >>> tx = optax.chain(dist.dense_exchange("data"), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> params = dist.stack_for_pmap(jnp.zeros(2), 1)
      >>> state = dist.stack_for_pmap(tx.init(jnp.zeros(2)), 1)
      >>> step = dist.make_pmap_train_step(loss, tx)
      >>> batch = {"x": np.eye(2, dtype=np.float32)[None], "y": np.ones((1, 2), np.float32)}
      >>> params, state, metrics = step(params, state, batch)
      >>> [[round(float(v), 6) for v in row] for row in params]  # gradient -1 per weight at 0
      [[0.1, 0.1]]
      >>> metrics["loss"].tolist()
      [1.0]
    """
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name)

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": lax.pmean(loss, axis_name)}

    pmapped = jax.pmap(step, axis_name=axis_name)
    checked = set()

    def train_step(params, opt_state, batch):
        leaves, treedef = jax.tree.flatten(params)
        key = (treedef, tuple((jnp.shape(x), jnp.result_type(x)) for x in leaves))
        if key not in checked:  # make_train_step's probe, on a mesh of the pmap's devices
            n_dev = jnp.shape(leaves[0])[0]
            mesh = Mesh(np.array(jax.local_devices()[:n_dev]), (axis_name,))
            one = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
            paths = unexchanged_leaves(tx, one, mesh, axis_name)
            if paths:
                raise ValueError(
                    f"make_pmap_train_step: tx does not average these update leaves over "
                    f"{axis_name!r}, so the per-device parameter copies would drift apart: "
                    f"{', '.join(paths)}. Give every leaf an exchange (a compressor with "
                    "axis_name, or jaxcomp.dense_exchange for the rest), or use "
                    "make_train_step, which averages such leaves densely."
                )
            checked.add(key)
        return pmapped(params, opt_state, batch)

    return train_step


# --- several processes --------------------------------------------------------------


def initialize_multiprocess(
    coordinator_address: str,
    num_processes: int,
    process_id: int,
    local_device_count: int | None = None,
) -> None:
    """Joins JAX's multi-controller runtime (call once per process, before any JAX work).

    Wraps ``jax.distributed.initialize``; with ``local_device_count`` it first
    sets ``jax_num_cpu_devices`` so each process simulates that many CPU
    devices (the CPU collectives then run over gloo). Never called at import:
    gate it behind your program's flags. Afterwards ``jax.devices()`` lists
    the devices of all processes; build the mesh over them and run the same
    program in every process (no collective under ``if process_index == 0``).

    Args:
      coordinator_address: ``"host:port"`` of process 0's coordinator.
      num_processes: total number of processes.
      process_id: this process's index in ``[0, num_processes)``.
      local_device_count: CPU devices to create in this process (None: the
        platform default).

    Example:
      >>> # In each process i of 2 (not run here):
      >>> # initialize_multiprocess("127.0.0.1:12345", 2, i, local_device_count=2)
      >>> # mesh = jax.make_mesh((jax.device_count(),), ("data",))
    """
    if local_device_count is not None:
        jax.config.update("jax_num_cpu_devices", int(local_device_count))
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
    )
