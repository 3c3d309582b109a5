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

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._vma import varying_axes
from jaxcomp.comm import collectives

__all__ = [
    "DenseExchangeState",
    "dense_exchange",
    "init_opt_state",
    "initialize_multiprocess",
    "make_pmap_train_step",
    "make_train_step",
    "per_device_grad",
    "per_device_value_and_grad",
    "replicate",
    "shard_batch",
    "stack_for_pmap",
]


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _is_varying(x, axis_name) -> bool:
    """Whether ``x`` is already typed device-varying along ``axis_name``."""
    return all(name in varying_axes(x) for name in _axis_names(axis_name))


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
    """Like :func:`per_device_value_and_grad` but returns only the gradient (and aux)."""
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
      ...                   in_specs=P(), out_specs=P())
      >>> f(jnp.ones(2)).tolist()
      [1.0, 1.0]
    """

    def init(params):
        del params
        return DenseExchangeState(wire_bytes=jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, *, include=None, **extra_args):
        del state, params, extra_args
        leaves, treedef = jax.tree.flatten(updates)
        outs = [collectives.dense_mean(g, axis_name, include=include) for g in leaves]
        wire = sum((b for _, b in outs), jnp.float32(0))
        return treedef.unflatten([m for m, _ in outs]), DenseExchangeState(wire_bytes=wire)

    return optax.GradientTransformationExtraArgs(init, update)


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
    """
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(lambda x: _place(x, sharding), tree)


def shard_batch(batch, mesh: Mesh, axis_name="data"):
    """Shards a batch along its leading axis over ``axis_name`` (works across processes).

    With several processes each passes its own part of the global batch (its
    devices' rows, in process order); the global batch is their concatenation.
    """
    sharding = NamedSharding(mesh, P(axis_name))
    return jax.tree.map(lambda x: _place(x, sharding), batch)


def init_opt_state(tx: optax.GradientTransformation, params, mesh: Mesh, axis_name="data"):
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

    Returns:
      The stacked state (a pytree of global arrays).
    """
    params = replicate(params, mesh)

    def init(p):
        return jax.tree.map(lambda x: x[None], tx.init(p))

    init_fn = jax.shard_map(init, mesh=mesh, in_specs=P(), out_specs=P(axis_name), check_vma=False)
    return jax.jit(init_fn)(params)


def _loss_metric(loss, axis_name, has_aux):
    value = loss[0] if has_aux else loss
    return lax.pmean(value, axis_name)


def _wire_bytes(state):
    """The compressor's ``wire_bytes`` if the state holds exactly one, else None."""
    try:
        return optax.tree.get(state, "wire_bytes")
    except (KeyError, ValueError):
        return None


def make_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    has_aux: bool = False,
    donate: bool = False,
) -> Callable:
    """Builds a jitted data-parallel train step over ``mesh``.

    Each device computes the gradient of ``loss_fn`` on its shard of the batch
    (its own gradient, see :func:`per_device_value_and_grad`), runs ``tx`` (a
    compressor with ``axis_name`` set does the exchange; for the dense
    baseline chain :func:`dense_exchange` first) with its own optimizer state,
    and applies the averaged update to the replicated parameters.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with
        ``has_aux``), the mean loss of one device's shard.
      tx: the optimizer; every device must end with the same update (true of
        jaxcomp compressors with ``axis_name`` and of :func:`dense_exchange`).
      mesh: the device mesh.
      axis_name: mesh axis the batch is split over.
      has_aux: whether ``loss_fn`` returns auxiliary outputs (returned per
        device in ``metrics["aux"]`` with a leading device axis).
      donate: donate params and optimizer state buffers to the step.

    Returns:
      ``step(params, opt_state, batch, update_args=None) -> (params,
      opt_state, metrics)``: ``params`` replicated, ``opt_state`` from
      :func:`init_opt_state`, ``batch`` sharded along its leading axis
      (:func:`shard_batch`), ``update_args`` an optional dict of per-device
      extra arguments for ``tx.update`` with a leading device axis (e.g.
      ``{"include": mask}`` for backup workers). ``metrics`` has ``loss``
      (mean over devices) and, when the state has one ``wire_bytes`` field,
      ``wire_bytes`` (per device, mean over devices).

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
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux)

    def step(params, opt_state, batch, update_args):
        state = jax.tree.map(lambda x: x[0], opt_state)
        extra = jax.tree.map(lambda x: x[0], update_args or {})
        loss, grads = value_and_grad(params, batch)
        updates, state = tx.update(grads, state, params, **extra)
        params = optax.apply_updates(params, updates)
        metrics = {"loss": _loss_metric(loss, axis_name, has_aux)}
        wire = _wire_bytes(state)
        if wire is not None:
            metrics["wire_bytes"] = lax.pmean(wire, axis_name)
        if has_aux:
            metrics["aux"] = jax.tree.map(lambda x: jnp.asarray(x)[None], loss[1])
        return params, jax.tree.map(lambda x: x[None], state), metrics

    def run(params, opt_state, batch, update_args):
        # out_specs must match the metrics' structure, known from the state's.
        metric_specs = {"loss": P()}
        if _wire_bytes(jax.eval_shape(tx.init, params)) is not None:
            metric_specs["wire_bytes"] = P()
        if has_aux:
            metric_specs["aux"] = P(axis_name)
        sharded = jax.shard_map(
            step,
            mesh=mesh,
            # Replicated params; per-device state, batch and extra args.
            in_specs=(P(), P(axis_name), P(axis_name), P(axis_name)),
            out_specs=(P(), P(axis_name), metric_specs),
            # Sparse exchanges end in an all-gather, typed varying though
            # bit-identical on every device: skip the check instead of paying
            # an all-reduce to make the parameters provably replicated.
            check_vma=False,
        )
        return sharded(params, opt_state, batch, update_args)

    jitted = jax.jit(run, donate_argnums=(0, 1) if donate else ())

    def train_step(params, opt_state, batch, update_args=None):
        return jitted(params, opt_state, batch, update_args)

    return train_step


# --- pmap compatibility ----------------------------------------------------------


def stack_for_pmap(tree, n_devices: int | None = None):
    """Stacks ``n_devices`` copies of every leaf (``flax.jax_utils.replicate`` style)."""
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
    """
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name)

    def step(params, opt_state, batch):
        loss, grads = value_and_grad(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": lax.pmean(loss, axis_name)}

    return jax.pmap(step, axis_name=axis_name)


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
