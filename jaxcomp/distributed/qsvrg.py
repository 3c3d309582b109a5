"""The QSVRG epoch: snapshot, dense full gradient, ``T`` quantized steps in one program.

The driver of :func:`jaxcomp.qsvrg` (QSGD's variance-reduced variant,
Alistarh et al., 2017, section 3.3): each epoch takes a snapshot ``y = x``,
averages the devices' full gradients at ``y`` unquantized, then runs ``T``
inner steps that send the quantized variance-reduced gradient
``grad f_b(x) - grad f_b(y) + grad f(y)``, all inside one jitted
``shard_map`` program (see :mod:`jaxcomp.transforms.qsvrg` for the math).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp.comm import collectives
from jaxcomp.distributed.skeleton import (
    check_unexchanged,
    compress,
    device_slice,
    device_stack,
    shard_step,
)

__all__ = ["make_qsvrg_epoch"]


def make_qsvrg_epoch(
    loss_fn: Callable,
    tx: optax.GradientTransformationExtraArgs,
    mesh: Mesh,
    *,
    epoch_length: int,
    batch_size: int,
    axis_name: str = "data",
    average: bool = False,
    variance_reduced: bool = True,
) -> Callable:
    """A jitted QSVRG epoch over ``mesh``: snapshot, dense full gradient, ``T`` quantized steps.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch
        (a pytree of arrays with a leading example axis).
      tx: :func:`jaxcomp.qsvrg` (with this ``axis_name``), or any transform taking
        ``snapshot_grads`` and ``full_grad``.
      mesh: the device mesh.
      epoch_length: ``T >= 1``, inner steps per epoch.
      batch_size: examples per device per inner step (sampled with
        replacement from the device's own shard).
      axis_name: the data axis.
      average: the next snapshot is the mean of the epoch's iterates
        ``x_1 .. x_T`` (``True``, QSVRG as the paper states it: ``x_1`` is the
        snapshot, ``x_T`` the point of the last gradient; summed in float32,
        or the parameters' dtype where wider, and cast back) or its last
        iterate ``x_{T+1}``. The paper's mode is ``average=True,
        batch_size=1`` with ``qsvrg(..., variant="paper")``.
      variance_reduced: ``False`` runs the baseline with the same sampling,
        codec and step: ``snapshot_grads`` and ``full_grad`` are zeros, so
        every step sends ``Q_s(g_i)`` (quantized SGD, QSGD's Algorithm 1) and
        no full gradient is exchanged.

    Returns:
      ``epoch(params, opt_state, data, key) -> (params, opt_state, metrics)``:
      ``params`` replicated, ``opt_state`` from
      :func:`jaxcomp.distributed.init_opt_state`, ``data`` sharded along its
      leading axis (:func:`jaxcomp.distributed.shard_batch`), ``key`` a PRNG
      key (each device folds in its index and the step). ``metrics``:
      ``wire_bytes`` (one device's bytes this epoch: the full gradient's
      all-reduce plus every quantized exchange) and ``loss`` (full loss at
      the snapshot, mean over devices).

    Raises:
      ValueError: bad ``epoch_length``, ``batch_size`` or ``average``; from
        the first call, a ``tx`` that does not average its update over
        ``axis_name`` (:func:`jaxcomp.qsvrg` without ``axis_name``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jaxcomp import distributed as dist
      >>> from jaxcomp.distributed import make_qsvrg_epoch
      >>> from jaxcomp.transforms.qsvrg import qsvrg
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> data = dist.shard_batch({"x": np.eye(4, dtype=np.float32),
      ...                          "y": np.ones(4, np.float32)}, mesh)
      >>> tx = qsvrg(0.5, bits=8, axis_name="data")
      >>> params = dist.replicate(jnp.zeros(4), mesh)
      >>> state = dist.init_opt_state(tx, params, mesh)
      >>> epoch = make_qsvrg_epoch(loss, tx, mesh, epoch_length=40, batch_size=2)
      >>> for p in range(8):
      ...     params, state, metrics = epoch(params, state, data, jax.random.key(p))
      >>> bool(jnp.allclose(params, 1.0, atol=1e-3))
      True
    """
    cfg = _EpochConfig(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        epoch_length=V.check_int("epoch_length", epoch_length, 1),
        batch_size=V.check_int("batch_size", batch_size, 1),
        average=V.check_bool("average", average),
        variance_reduced=V.check_bool("variance_reduced", variance_reduced),
        grad_fn=jax.grad(loss_fn),
    )
    # The exchanged updates are identical on every device; the state that
    # produced them is per device (shard_step's check_vma=False). The check in
    # _epoch stands in for what check_vma would guard.
    sharded = shard_step(
        functools.partial(_run_epoch, cfg),
        mesh,
        in_specs=(P(), P(axis_name), P(axis_name), P()),
        out_specs=(P(), P(axis_name), P()),
    )
    return jax.jit(functools.partial(_epoch, cfg, sharded))


@dataclasses.dataclass(frozen=True, eq=False)
class _EpochConfig:
    """The validated static options of one :func:`make_qsvrg_epoch` epoch."""

    loss_fn: Callable
    tx: optax.GradientTransformationExtraArgs
    mesh: Mesh
    axis_name: str
    epoch_length: int
    batch_size: int
    average: bool
    variance_reduced: bool
    grad_fn: Callable  # jax.grad(loss_fn)


def _local_grad(cfg: _EpochConfig, params, batch):
    # Per-device gradient: parameters cast to varying, as make_train_step does.
    return cfg.grad_fn(lax.pcast(params, cfg.axis_name, to="varying"), batch)


def _run_epoch(cfg: _EpochConfig, params, opt_state, data, key):
    """One device's epoch inside ``shard_map``: snapshot, full gradient, ``T`` steps."""
    axis_name, tx = cfg.axis_name, cfg.tx
    state = device_slice(opt_state)
    n_dev = collectives.axis_size(axis_name)
    key = jax.random.fold_in(key, lax.axis_index(axis_name))
    m = jax.tree.leaves(data)[0].shape[0]
    snapshot = params
    if cfg.variance_reduced:
        full = jax.tree.map(lambda g: lax.pmean(g, axis_name), _local_grad(cfg, snapshot, data))
        full_bytes = sum(
            collectives.allreduce_bytes(x.size * x.dtype.itemsize, n_dev)
            for x in jax.tree.leaves(full)
        )
    else:
        full, full_bytes = jax.tree.map(jnp.zeros_like, params), 0.0
    loss = lax.pmean(cfg.loss_fn(snapshot, data), axis_name)

    def body(carry, t):
        x, st, total = carry
        idx = jax.random.randint(jax.random.fold_in(key, t), (cfg.batch_size,), 0, m)
        batch = jax.tree.map(lambda a: a[idx], data)
        g = _local_grad(cfg, x, batch)
        gs = (
            _local_grad(cfg, snapshot, batch)
            if cfg.variance_reduced
            else jax.tree.map(jnp.zeros_like, g)
        )
        extra = {"snapshot_grads": gs, "full_grad": full}
        # The paper's y^(p+1) = (1/T) sum_{t=1..T} x_t: the T points the gradients
        # were taken at (x_1 = the snapshot), summed before this step moves x.
        x_sum = jax.tree.map(lambda a, xi: a + xi.astype(a.dtype), total[0], x)
        u, st, wire = compress(tx, g, st, x, extra, axis_name, "make_qsvrg_epoch")
        x = optax.apply_updates(x, u)
        wire = jnp.float32(0) if wire is None else wire
        return (x, st, (x_sum, total[1] + wire)), None

    # The iterates are summed in float32 at least: a bfloat16 sum of 200 iterates
    # of 3.0 drifts to 3.56 (its spacing at 512 is 4).
    zeros = jax.tree.map(
        lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), params
    )
    (x, state, (x_sum, wire)), _ = lax.scan(
        body,
        (params, state, (zeros, jnp.float32(0))),
        jnp.arange(cfg.epoch_length),
    )
    if cfg.average:
        x = jax.tree.map(lambda s, p: (s / cfg.epoch_length).astype(p.dtype), x_sum, params)
    metrics = {"wire_bytes": wire + jnp.float32(full_bytes), "loss": loss}
    return x, device_stack(state), metrics


def _epoch(cfg: _EpochConfig, sharded, params, opt_state, data, key):
    # With out_specs=P() and check_vma=False, an update tx does not average
    # (qsvrg without axis_name) would silently return device 0's private
    # trajectory: trace tx under check_vma once per compilation, as
    # make_train_step does, and refuse it.
    axis_name = cfg.axis_name
    n_dev = cfg.mesh.shape[axis_name]
    zeros = jax.tree.map(lambda p: jnp.zeros((n_dev, *jnp.shape(p)), p.dtype), params)
    check_unexchanged(
        cfg.tx,
        params,
        cfg.mesh,
        axis_name,
        {"snapshot_grads": zeros, "full_grad": zeros},
        policy="error",
        who="make_qsvrg_epoch",
        why=", so the devices' parameters would diverge (the epoch would return device 0's alone)",
        remedy=f"Build it with qsvrg(..., axis_name={axis_name!r}).",
    )
    return sharded(params, opt_state, data, key)
