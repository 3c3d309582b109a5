"""Stale updates on a device mesh: bounded-delay SGD and an asynchronous parameter server.

The patent's framework (``docs/algorithms.md`` §6) has synchronous and asynchronous
updates, and a bounded-delay partial aggregation. Both are simulated here on
the ``jax.shard_map`` mesh of :mod:`jaxcomp.distributed`, with any jaxcomp
compressor, deterministically (delays and arrival orders come from a PRNG key
in the state, or are given):

**Bounded delay** (:func:`make_stale_train_step`, stale-synchronous SGD).
At step ``t`` device ``i`` computes its gradient at the parameters of step
``t - d_i`` (``d_i`` in ``[0, max_delay]``); the gradients are compressed
and exchanged by ``tx`` as in :func:`jaxcomp.distributed.make_train_step`
and the averaged update is applied to the *current* parameters::

    w_{t+1} = w_t + tx( g_1(w_{t-d_1}), ..., g_N(w_{t-d_N}) )

The last ``max_delay`` parameter versions live in a ring buffer in
:class:`StaleState` (version ``v`` in slot ``v % max_delay``). ``d_i`` is
``max_delay`` on every device (``delay="fixed"``), a fixed per-device vector,
or drawn every step uniformly from ``{0, ..., max_delay}`` per device
(``delay="uniform"``, :func:`draw_delays`). Before step ``max_delay`` the
history is shorter than the delay: the delay is clamped to ``t``
(``d_i <- min(d_i, t)``), so early steps use the initial parameters. With
``max_delay=0`` the step is :func:`~jaxcomp.distributed.make_train_step`'s,
bit for bit.

**Asynchronous parameter server** (:func:`make_async_train_step`). Every
worker holds the parameters it last pulled. One call of the step is one
*round*: each worker computes its gradient at its pulled parameters, runs its
own ``tx`` locally (a compressor with ``axis_name=None``: error feedback and
momentum per worker) and pushes the result; the server applies the ``N``
pushes one by one in a simulated arrival order (a permutation per round,
:func:`draw_order`, or given), ``w <- w + scale * u_i``; right after its own
push is applied a worker pulls the server's parameters, from which its next
gradient is computed. On the mesh the pushes are all-gathered and every
device replays the server's sequential application (``lax.scan`` over the
arrivals), keeping the snapshot taken right after its own arrival. With the
default ``scale = 1 / N``, a round whose workers all pulled the same
parameters is one synchronous step of the averaged update; staleness (server
updates between a worker's pull and its push being applied) is then between
0 and ``2 (N - 1)`` arrivals, ``N - 1`` on average.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
  >>> from jaxcomp import staleness
  >>> from jaxcomp.distributed import shard_batch
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> loss = lambda w, b: 0.5 * jnp.sum((b["x"] @ w - b["y"]) ** 2)
  >>> tx = optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(1.0))
  >>> state = staleness.init_stale_state(tx, jnp.zeros(1), mesh, max_delay=1)
  >>> step = staleness.make_stale_train_step(loss, tx, mesh, max_delay=1)
  >>> batch = shard_batch({"x": np.ones((1, 1), np.float32), "y": np.ones(1, np.float32)}, mesh)
  >>> for _ in range(3):
  ...     state, metrics = step(state, batch)
  >>> state.params.tolist()  # w <- w - (w_stale - 1): 0, 1 (at w_0), 2 (at w_0), 2 (at w_1)
  [2.0]
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp._vma import axis_name_tuple
from jaxcomp.distributed.grads import per_device_value_and_grad
from jaxcomp.distributed.placement import param_layout, replicate
from jaxcomp.distributed.skeleton import (
    UNEXCHANGED,
    check_stacked_state,
    check_unexchanged,
    compress,
    device_slice,
    device_stack,
    jit_step,
    leaf_names,
    mean_leaves,
    shard_step,
    unexchanged_paths,
)
from jaxcomp.distributed.step import init_opt_state

__all__ = [
    "DELAYS",
    "ORDERS",
    "AsyncState",
    "StaleState",
    "draw_delays",
    "draw_order",
    "init_async_state",
    "init_stale_state",
    "make_async_train_step",
    "make_stale_train_step",
]

# String values of make_stale_train_step's ``delay`` (or a per-device sequence).
DELAYS = ("fixed", "uniform")
# String values of make_async_train_step's ``order`` (or a fixed permutation).
ORDERS = ("random", "round_robin")


def _mesh_size(mesh: Mesh, axis_name) -> int:
    names = axis_name_tuple(axis_name)
    missing = [n for n in names if n not in mesh.shape]
    if missing:
        raise ValueError(f"axis_name {axis_name!r}: the mesh has no axis {missing[0]!r}")
    return int(np.prod([mesh.shape[n] for n in names]))


def _key_data(seed) -> jax.Array:
    """Raw uint32 key data (checkpoints hold plain integers) from an int or a key."""
    if isinstance(seed, jax.Array):
        if jnp.issubdtype(seed.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(seed)
        if seed.dtype == jnp.uint32:
            return seed
    seed = V.check_int("seed", seed, 0)
    return jax.random.key_data(jax.random.key(seed))


def _as_key(key) -> jax.Array:
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def draw_delays(key, step, n_devices: int, max_delay: int) -> jax.Array:
    """The per-device delays of ``delay="uniform"`` at ``step``, before clamping.

    ``jax.random.randint(jax.random.fold_in(key, step), (n_devices,), 0,
    max_delay + 1)``: independent, uniform on ``{0, ..., max_delay}``, the
    same on every device (each takes its own entry). The step then uses
    ``min(d_i, step)`` (the history is shorter before step ``max_delay``).

    Args:
      key: a PRNG key or its raw uint32 data (:attr:`StaleState.key`).
      step: the step number (int or int32 array).
      n_devices: devices along the axis.
      max_delay: the largest delay, an int >= 0.

    Returns:
      int32 ``(n_devices,)``.

    Example:
      >>> import jax
      >>> from jaxcomp.staleness import draw_delays
      >>> d = draw_delays(jax.random.key(0), 5, n_devices=4, max_delay=2)
      >>> d.shape, bool(((d >= 0) & (d <= 2)).all())
      ((4,), True)
    """
    n_devices = V.check_int("n_devices", n_devices, 1)
    max_delay = V.check_int("max_delay", max_delay, 0)
    k = jax.random.fold_in(_as_key(key), step)
    return jax.random.randint(k, (n_devices,), 0, max_delay + 1, dtype=jnp.int32)


def draw_order(key, step, n_devices: int) -> jax.Array:
    """The arrival order of ``order="random"`` in round ``step``: a permutation of the workers.

    ``jax.random.permutation(jax.random.fold_in(key, step), n_devices)``;
    entry ``k`` is the worker whose push the server applies ``k``-th.

    Example:
      >>> import jax
      >>> from jaxcomp.staleness import draw_order
      >>> sorted(draw_order(jax.random.key(0), 3, n_devices=4).tolist())
      [0, 1, 2, 3]
    """
    n_devices = V.check_int("n_devices", n_devices, 1)
    k = jax.random.fold_in(_as_key(key), step)
    return jax.random.permutation(k, n_devices).astype(jnp.int32)


def _replicated_jit(fn, mesh: Mesh):
    return jax.jit(fn, out_shardings=NamedSharding(mesh, P()))


def _scalar_on(mesh: Mesh, value, dtype):
    return replicate(np.asarray(value, dtype), mesh)


# --- bounded delay ----------------------------------------------------------------


class StaleState(NamedTuple):
    """State of :func:`make_stale_train_step`.

    Attributes:
      params: the current parameters ``w_t``, replicated.
      opt_state: per-device optimizer state stacked along a leading device
        axis (:func:`jaxcomp.distributed.init_opt_state`).
      history: ring buffer of past parameters, leaves ``(max_delay,
        *leaf.shape)``, replicated: slot ``v % max_delay`` holds ``w_v`` for
        the last ``max_delay`` versions (filled with the initial parameters).
      step: int32, updates applied so far (``t``).
      key: raw uint32 PRNG key data of the ``delay="uniform"`` draws.
    """

    params: Any
    opt_state: Any
    history: Any
    step: jax.Array
    key: jax.Array


def init_stale_state(
    tx: optax.GradientTransformation,
    params,
    mesh: Mesh,
    max_delay: int,
    axis_name="data",
    *,
    seed: int | jax.Array = 0,
) -> StaleState:
    """The initial :class:`StaleState` for :func:`make_stale_train_step`.

    Args:
      tx: the optimizer (compressor chained with an optax optimizer).
      params: the initial parameters.
      mesh: the device mesh.
      max_delay: the step's ``max_delay`` (ring buffer length), an int >= 0.
      axis_name: the data-parallel axis.
      seed: an int or a PRNG key, for ``delay="uniform"``.

    Returns:
      The state, placed on ``mesh``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import staleness
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(1.0))
      >>> state = staleness.init_stale_state(tx, jnp.zeros(2), mesh, max_delay=3)
      >>> state.history.shape, int(state.step)  # 3 past versions, all the initial params
      ((3, 2), 0)
    """
    max_delay = V.check_int("max_delay", max_delay, 0)
    params = replicate(params, mesh)
    opt_state = init_opt_state(tx, params, mesh, axis_name)
    history = _replicated_jit(
        lambda p: jax.tree.map(lambda x: jnp.repeat(x[None], max_delay, axis=0), p), mesh
    )(params)
    return StaleState(
        params=params,
        opt_state=opt_state,
        history=history,
        step=_scalar_on(mesh, 0, np.int32),
        key=replicate(_key_data(seed), mesh),
    )


def _check_delay(delay, max_delay: int, n_dev: int):
    """``"fixed"``, ``"uniform"`` or a tuple of ``n_dev`` ints in ``[0, max_delay]``."""
    if isinstance(delay, str):
        return V.check_choice("delay", delay, DELAYS)
    if isinstance(delay, (Sequence, np.ndarray)) and not isinstance(delay, bytes):
        values = tuple(V.check_int("delay[i]", d, 0, max_delay) for d in delay)
        if len(values) != n_dev:
            raise ValueError(
                f"delay must give one delay per device along the axis ({n_dev}), got {len(values)}"
            )
        return values
    raise ValueError(
        f"delay must be one of {DELAYS} or a sequence of {n_dev} ints in [0, {max_delay}], "
        f"got {delay!r}"
    )


def _check_history(history, max_delay: int, params) -> None:
    for h, p in zip(jax.tree.leaves(history), jax.tree.leaves(params), strict=True):
        if h.shape != (max_delay, *p.shape):
            raise ValueError(
                f"StaleState.history has leaves of shape {h.shape} for parameters of shape "
                f"{p.shape}: the state was built with another max_delay than the step's "
                f"({max_delay}); use init_stale_state(..., max_delay={max_delay})"
            )


def _check_stacked(who: str, init: str, state, mesh: Mesh, axis_name, per_device: dict) -> None:
    """Raises unless the per-device fields are stacked for the mesh's devices.

    As in make_train_step: shard_map would hand each device a block of rows
    and the step reads the first, silently dropping the others (what those
    devices owed: their residuals, or their pulled parameters).
    """
    layout = param_layout(mesh, axis_name, state.params, None)
    for name, tree in {"opt_state": state.opt_state, **per_device}.items():
        check_stacked_state(tree, mesh, layout, who, f"state.{name}", init)


def make_stale_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    max_delay: int,
    axis_name="data",
    *,
    delay: str | Sequence[int] = "fixed",
    unexchanged: str = "mean",
    donate: bool = True,
) -> Callable:
    """A data-parallel train step whose devices compute gradients at stale parameters.

    Device ``i`` computes its gradient at ``w_{t - d_i}`` (from the ring
    buffer of :class:`StaleState`) on its shard of the batch; ``tx``
    compresses, exchanges and averages the gradients exactly as in
    :func:`jaxcomp.distributed.make_train_step` (each device with its own
    optimizer state, so error feedback is per device), and the update is
    applied to the current parameters ``w_t`` (``tx.update`` gets ``w_t`` as
    ``params``). ``d_i <- min(d_i, t)``: until the history holds ``max_delay``
    versions, delays reaching before step 0 use the initial parameters.

    The ring buffer costs ``max_delay`` copies of the parameters on every
    device. Narrower than ``make_train_step``: no ``has_aux``, mutable model
    state, ``rng``, ``update_args`` or ``overlap``.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of one
        device's shard.
      tx: the optimizer (a compressor with ``axis_name`` chained with an optax
        optimizer, or ``optax.chain(jaxcomp.dense_exchange(axis_name), ...)``).
      mesh: the device mesh.
      max_delay: ``tau``, the largest delay in steps, an int >= 0 (0: the
        synchronous step).
      axis_name: the mesh axis the batch is sharded over.
      delay: ``"fixed"`` (every device ``max_delay`` steps old), ``"uniform"``
        (drawn per step and device from ``{0, ..., max_delay}``, see
        :func:`draw_delays`) or a sequence of one fixed delay per device, each
        in ``[0, max_delay]``.
      unexchanged: ``"mean"`` or ``"error"``, as in ``make_train_step``:
        gradient leaves ``tx`` does not average are averaged densely first
        (or rejected).
      donate: donate the state to the step (the arrays passed in are invalid
        afterwards).

    Returns:
      ``step(state, batch) -> (state, metrics)`` with ``state`` a
      :class:`StaleState` (:func:`init_stale_state` with the same
      ``max_delay``) and ``batch`` sharded along its leading axis
      (:func:`jaxcomp.distributed.shard_batch`). ``metrics``: ``loss`` (mean
      over devices of each device's loss at its stale parameters), ``delay``
      (int32 ``(N,)``, the delays used after clamping) and ``wire_bytes``
      (as ``make_train_step``'s) when ``tx`` reports bytes.

    Raises:
      ValueError: bad arguments; a state built with another ``max_delay``
        (when the step is first called).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp import staleness
      >>> from jaxcomp.distributed import shard_batch
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> state = staleness.init_stale_state(tx, jnp.zeros(2), mesh, max_delay=2)
      >>> step = staleness.make_stale_train_step(loss, tx, mesh, 2, delay="uniform")
      >>> batch = shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                      "y": np.ones(2, np.float32)}, mesh)
      >>> state, metrics = step(state, batch)
      >>> metrics["delay"].tolist()  # clamped: step 0 has no older parameters
      [0]
    """
    max_delay = V.check_int("max_delay", max_delay, 0)
    unexchanged = V.check_choice("unexchanged", unexchanged, UNEXCHANGED)
    donate = V.check_bool("donate", donate)
    n_dev = _mesh_size(mesh, axis_name)
    cfg = _StaleStepConfig(
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        max_delay=max_delay,
        delay=_check_delay(delay, max_delay, n_dev),
        unexchanged=unexchanged,
        n_dev=n_dev,
        value_and_grad=per_device_value_and_grad(loss_fn, axis_name),
    )
    return jit_step(
        functools.partial(_stale_run, cfg),
        donate_argnums=(0,) if donate else (),
        arguments=_stale_arguments,
    )


def _stale_arguments(state: StaleState, batch):
    """The stale step's arguments, checked."""
    if not isinstance(state, StaleState):
        raise ValueError(
            f"state must be a StaleState (init_stale_state), got {type(state).__name__}"
        )
    return state, batch


@dataclasses.dataclass(frozen=True, eq=False)
class _StaleStepConfig:
    """The validated static options of one :func:`make_stale_train_step` step."""

    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: Any
    max_delay: int
    delay: Any  # "fixed", "uniform", or a tuple of one delay per device
    unexchanged: str
    n_dev: int
    value_and_grad: Callable  # per-device (loss, grads) of loss_fn


def _stale_delays(cfg: _StaleStepConfig, step, key):
    """Every device's delay this step, clamped to the versions that exist."""
    if cfg.delay == "uniform":
        drawn = draw_delays(key, step, cfg.n_dev, cfg.max_delay)
    elif cfg.delay == "fixed":
        drawn = jnp.full((cfg.n_dev,), cfg.max_delay, jnp.int32)
    else:
        drawn = jnp.asarray(cfg.delay, jnp.int32)
    # Versions before 0 do not exist: the initial parameters stand in.
    return jnp.minimum(drawn, step)


def _stale_per_device(cfg: _StaleStepConfig, params, opt_state, history, step, key, batch, paths):
    """One device's stale step inside ``shard_map``: ``paths`` are averaged densely first."""
    axis_name, max_delay = cfg.axis_name, cfg.max_delay
    state = device_slice(opt_state)
    if max_delay == 0:
        # No history at all: exactly make_train_step's computation.
        delays = jnp.zeros((cfg.n_dev,), jnp.int32)
        stale = params
    else:
        delays = _stale_delays(cfg, step, key)
        d = delays[lax.axis_index(axis_name)]
        slot = (step - d) % max_delay
        # d == 0 reads the current parameters; its slot holds w_{t - max_delay}.
        stale = jax.tree.map(
            lambda p, h: jnp.where(d == 0, p, lax.dynamic_index_in_dim(h, slot, 0, False)),
            params,
            history,
        )
    loss, grads = cfg.value_and_grad(stale, batch)
    grads, dense_wire = mean_leaves(grads, paths, axis_name)
    updates, state, wire = compress(
        cfg.tx, grads, state, params, {}, axis_name, "make_stale_train_step"
    )
    new_params = optax.apply_updates(params, updates)
    if max_delay:
        history = jax.tree.map(
            lambda h, p: lax.dynamic_update_index_in_dim(h, p, step % max_delay, 0),
            history,
            params,
        )
    metrics = {"loss": lax.pmean(loss, axis_name), "delay": delays}
    if wire is not None or paths:
        wire = dense_wire if wire is None else wire + dense_wire
        metrics["wire_bytes"] = lax.pmean(wire, axis_name)
    return new_params, device_stack(state), history, step + 1, key, metrics


def _stale_run(cfg: _StaleStepConfig, state: StaleState, batch):
    """The jitted stale step: checks the state and what ``tx`` exchanges, then shard_map."""
    axis_name, mesh, tx = cfg.axis_name, cfg.mesh, cfg.tx
    _check_history(state.history, cfg.max_delay, state.params)
    _check_stacked(
        "make_stale_train_step", "staleness.init_stale_state", state, mesh, axis_name, {}
    )
    paths = check_unexchanged(
        tx,
        state.params,
        mesh,
        axis_name,
        policy=cfg.unexchanged,
        who="make_stale_train_step",
        remedy="Give every leaf an exchange or use unexchanged='mean'.",
    )
    sharded = shard_step(
        functools.partial(_stale_per_device, cfg, paths=frozenset(paths)),
        mesh,
        in_specs=(P(), P(axis_name), P(), P(), P(), P(axis_name)),
        out_specs=(P(), P(axis_name), P(), P(), P(), P()),
    )
    params, opt_state, history, step, key, metrics = sharded(
        state.params, state.opt_state, state.history, state.step, state.key, batch
    )
    return StaleState(params, opt_state, history, step, key), metrics


# --- asynchronous parameter server ---------------------------------------------------


class AsyncState(NamedTuple):
    """State of :func:`make_async_train_step`.

    Attributes:
      params: the server's parameters, replicated (every device replays the
        server).
      worker_params: each worker's last pulled parameters, leaves ``(N,
        *leaf.shape)`` sharded along the axis.
      opt_state: each worker's local optimizer state (compressor residuals,
        momentum), stacked along a leading device axis.
      pulled_version: int32 ``(N,)`` sharded along the axis, the number of
        pushes the server had applied when each worker pulled.
      step: int32, rounds so far (the server has applied ``N * step`` pushes).
      key: raw uint32 PRNG key data of the ``order="random"`` draws.
    """

    params: Any
    worker_params: Any
    opt_state: Any
    pulled_version: jax.Array
    step: jax.Array
    key: jax.Array


def init_async_state(
    tx: optax.GradientTransformation,
    params,
    mesh: Mesh,
    axis_name="data",
    *,
    seed: int | jax.Array = 0,
) -> AsyncState:
    """The initial :class:`AsyncState`: every worker has pulled ``params`` (version 0).

    Args:
      tx: each worker's local optimizer (compressor with ``axis_name=None``
        chained with an optax optimizer).
      params: the initial parameters.
      mesh: the device mesh.
      axis_name: the axis the workers are laid out on.
      seed: an int or a PRNG key, for ``order="random"``.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import staleness
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5), optax.sgd(1.0))
      >>> state = staleness.init_async_state(tx, jnp.zeros(2), mesh)
      >>> state.worker_params.shape, state.pulled_version.tolist(), int(state.step)
      ((1, 2), [0], 0)
    """
    n_dev = _mesh_size(mesh, axis_name)
    params = replicate(params, mesh)
    sharded = NamedSharding(mesh, P(axis_name))
    workers = jax.jit(
        lambda p: jax.tree.map(lambda x: jnp.repeat(x[None], n_dev, axis=0), p),
        out_shardings=sharded,
    )(params)
    pulled = jax.jit(lambda: jnp.zeros((n_dev,), jnp.int32), out_shardings=sharded)()
    return AsyncState(
        params=params,
        worker_params=workers,
        opt_state=init_opt_state(tx, params, mesh, axis_name),
        pulled_version=pulled,
        step=_scalar_on(mesh, 0, np.int32),
        key=replicate(_key_data(seed), mesh),
    )


def _check_permutation(name: str, order, n_dev: int) -> tuple:
    try:
        values = np.asarray(order)
    except Exception as e:  # noqa: BLE001 (anything unreadable is the same error)
        raise ValueError(f"{name} must be a permutation of range({n_dev}), got {order!r}") from e
    if (
        values.shape != (n_dev,)
        or not np.issubdtype(values.dtype, np.integer)
        or sorted(values.tolist()) != list(range(n_dev))
    ):
        raise ValueError(f"{name} must be a permutation of range({n_dev}), got {order!r}")
    return tuple(int(v) for v in values)


def _message_bytes_fields(state):
    """``(path, message_bytes, state node)`` of every state holding a ``message_bytes`` field."""
    is_node = lambda x: hasattr(x, "_fields") and "message_bytes" in x._fields  # noqa: E731
    for path, node in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_node)[0]:
        if is_node(node):
            yield path, node.message_bytes, node


def _push_bytes(state, updates) -> jax.Array:
    """Bytes of the message a worker pushes: the compressor's, dense for other leaves.

    jaxcomp compressors report each leaf's message in ``message_bytes``
    (``(index, value)`` pairs actually selected, or the quantized payload);
    leaves no compressor covers (plain optax, ``optax.masked`` leaving them
    out) are pushed dense.
    """
    flat = jax.tree_util.tree_flatten_with_path(updates)[0]
    all_paths = {path for path, _ in flat}
    covered: set = set()
    total = jnp.float32(0)
    for _, field, node in _message_bytes_fields(state):
        leaves = jax.tree_util.tree_flatten_with_path(field)[0]
        if len(leaves) == 1 and leaves[0][0] == ():
            # One array for the leaves the compressor sees (a sparsifier's
            # per-leaf array, or granularity="global"'s one count): they are
            # its residual's leaves (optax.masked and multi_transform give it
            # MaskedNode, no leaf, for the others: pushed dense).
            residual = getattr(node, "residual", None)
            if residual is None:  # defer_residual=True: the accumulator's leaves
                residual = getattr(node, "accumulator", None)
            if residual is None:
                covered = all_paths
            else:
                covered |= {path for path, _ in jax.tree_util.tree_flatten_with_path(residual)[0]}
        else:
            covered |= {path for path, _ in leaves}
        total = total + sum(
            (jnp.sum(jnp.asarray(v, jnp.float32)) for _, v in leaves), jnp.float32(0)
        )
    dense = sum(u.size * u.dtype.itemsize for path, u in flat if path not in covered)
    return total + jnp.float32(dense)


def make_async_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    order: str | Sequence[int] = "random",
    scale: float | None = None,
    donate: bool = True,
) -> Callable:
    """The patent's asynchronous parameter server, one round of ``N`` pushes per call.

    Each worker (device) computes the gradient of ``loss_fn`` at the
    parameters it last pulled, on its shard of the batch, and runs its own
    ``tx`` on it (compression with local error feedback, then the optax
    optimizer); the result is its push. The pushes are all-gathered and the
    server applies them one at a time in the round's arrival order,
    ``w <- w + scale * u_i`` (in ``w``'s dtype); after its own push is applied
    worker ``i`` pulls ``w``. Every device replays the server's sequence, so
    the server parameters stay replicated.

    A simulation: the pushes are all-gathered as dense decompressed updates
    (``N`` copies of the parameters' size per device); the bytes reported are
    the compressed messages a real worker would push. ``loss_fn`` takes
    ``(params, batch)`` only (no aux, model state or ``rng``).

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, one worker's mean loss.
      tx: a *local* optimizer: e.g. ``optax.chain(jaxcomp.top_k(0.01),
        optax.sgd(0.1))`` (``axis_name=None``), or plain ``optax.sgd``. A
        ``tx`` that averages over ``axis_name`` is rejected (the server must
        receive each worker's own update).
      mesh: the device mesh (one worker per device along ``axis_name``).
      axis_name: the mesh axis of the workers.
      order: ``"random"`` (a fresh permutation per round, :func:`draw_order`),
        ``"round_robin"`` (workers ``0..N-1`` every round) or a fixed
        permutation of ``range(N)``. The step's ``order=`` argument overrides
        it for one round.
      scale: factor on every push, > 0 (None: ``1 / N``, so that a round in
        which every worker pulled the same parameters is one synchronous step
        of the averaged update; 1.0 for Downpour-style full steps).
      donate: donate the state to the step.

    Returns:
      ``step(state, batch, order=None) -> (state, metrics)`` with ``state``
      an :class:`AsyncState` (:func:`init_async_state`) and ``batch`` sharded
      along its leading axis. ``metrics``: ``loss`` (mean over workers, each
      at its pulled parameters), ``order`` (int32 ``(N,)``, worker of each
      arrival), ``staleness`` (int32 ``(N,)`` per worker: pushes the server
      applied between the worker's pull and its push), ``push_bytes`` (mean
      bytes a worker pushed: the compressor's ``message_bytes``, dense leaves
      at full size), ``pull_bytes`` (the dense parameters a worker pulls) and
      ``wire_bytes`` (their sum: one worker's link per round).

    Raises:
      ValueError: bad arguments, a ``tx`` that exchanges over ``axis_name``
        (when the step is first called), an ``order`` that is not a
        permutation.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp import staleness
      >>> from jaxcomp.distributed import shard_batch
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5), optax.sgd(1.0))
      >>> loss = lambda w, b: 0.5 * jnp.sum((b["x"] @ w - b["y"]) ** 2)
      >>> state = staleness.init_async_state(tx, jnp.zeros(2), mesh)
      >>> step = staleness.make_async_train_step(loss, tx, mesh)
      >>> batch = shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                      "y": np.array([1.0, 2.0], np.float32)}, mesh)
      >>> state, metrics = step(state, batch)
      >>> state.params.tolist(), float(metrics["push_bytes"])  # one (int32, float32) pair
      ([0.0, 2.0], 8.0)
    """
    n_dev = _mesh_size(mesh, axis_name)
    if isinstance(order, str):
        order = V.check_choice("order", order, ORDERS)
    else:
        order = _check_permutation("order", order, n_dev)
    scale = 1.0 / n_dev if scale is None else V.check_real("scale", scale, 0.0, low_open=True)
    donate = V.check_bool("donate", donate)
    cfg = _AsyncStepConfig(
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        order=order,
        scale=scale,
        n_dev=n_dev,
        value_and_grad=per_device_value_and_grad(loss_fn, axis_name),
    )
    return jit_step(
        functools.partial(_async_run, cfg),
        donate_argnums=(0,) if donate else (),
        arguments=functools.partial(_async_arguments, n_dev),
    )


def _async_arguments(n_dev: int, state: AsyncState, batch, order=None):
    """The round's arguments, checked (``order``: a permutation of the workers, or None)."""
    if not isinstance(state, AsyncState):
        raise ValueError(
            f"state must be an AsyncState (init_async_state), got {type(state).__name__}"
        )
    if order is not None:
        order = jnp.asarray(_check_permutation("order", order, n_dev), jnp.int32)
    return state, batch, order


@dataclasses.dataclass(frozen=True, eq=False)
class _AsyncStepConfig:
    """The validated static options of one :func:`make_async_train_step` step."""

    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: Any
    order: Any  # one of ORDERS, or a permutation of the devices
    scale: float
    n_dev: int
    value_and_grad: Callable  # per-device (loss, grads) of loss_fn


def _async_per_device(
    cfg: _AsyncStepConfig, server, workers, opt_state, pulled, step, key, batch, arrival
):
    """One worker's round inside ``shard_map``: push, then the server's replay of all pushes."""
    axis_name, n_dev, scale = cfg.axis_name, cfg.n_dev, cfg.scale
    state, mine = device_slice(opt_state), device_slice(workers)
    loss, grads = cfg.value_and_grad(mine, batch)
    updates, state = cfg.tx.update(grads, state, mine)
    push = _push_bytes(state, updates)
    pushed = jax.tree.map(lambda u: lax.all_gather(u, axis_name), updates)
    me = lax.axis_index(axis_name)

    def arrive(carry, k):
        w, snapshot, position = carry
        i = arrival[k]
        w = jax.tree.map(
            lambda p, u: (p + scale * lax.dynamic_index_in_dim(u, i, 0, False)).astype(p.dtype),
            w,
            pushed,
        )
        # The worker pulls right after its own push is applied.
        snapshot = jax.tree.map(lambda s, p: jnp.where(i == me, p, s), snapshot, w)
        position = jnp.where(i == me, k, position)
        return (w, snapshot, position), None

    init = (server, mine, jnp.int32(0))
    (server, mine, position), _ = lax.scan(arrive, init, jnp.arange(n_dev, dtype=jnp.int32))
    applied_at = step * n_dev + position  # pushes applied before this worker's
    staleness = applied_at - pulled[0]
    pull = sum(p.size * p.dtype.itemsize for p in jax.tree.leaves(server))
    push_mean = lax.pmean(push, axis_name)
    metrics = {
        "loss": lax.pmean(loss, axis_name),
        "order": arrival,
        "push_bytes": push_mean,
        "pull_bytes": jnp.float32(pull),
        "wire_bytes": push_mean + jnp.float32(pull),
    }
    return (
        server,
        device_stack(mine),
        device_stack(state),
        (applied_at + 1)[None],
        step + 1,
        key,
        metrics,
        staleness[None],
    )


def _async_run(cfg: _AsyncStepConfig, state: AsyncState, batch, arrival):
    """The jitted round: checks the state and that ``tx`` exchanges nothing, then shard_map."""
    axis_name, mesh, n_dev = cfg.axis_name, cfg.mesh, cfg.n_dev
    per_worker = {"worker_params": state.worker_params, "pulled_version": state.pulled_version}
    _check_stacked(
        "make_async_train_step", "staleness.init_async_state", state, mesh, axis_name, per_worker
    )
    paths = unexchanged_paths(cfg.tx, state.params, mesh, axis_name, {})
    all_paths = [p for p, _ in jax.tree_util.tree_flatten_with_path(state.params)[0]]
    exchanged = [p for p in all_paths if p not in set(paths)]
    if exchanged:
        raise ValueError(
            "make_async_train_step: tx averages these update leaves over "
            f"{axis_name!r}: {leaf_names(exchanged)}. "
            "The server applies each worker's own push: give the compressor "
            "axis_name=None (and no jaxcomp.dense_exchange)."
        )
    if arrival is None:
        if cfg.order == "random":
            arrival = draw_order(state.key, state.step, n_dev)
        elif cfg.order == "round_robin":
            arrival = jnp.arange(n_dev, dtype=jnp.int32)
        else:
            arrival = jnp.asarray(cfg.order, jnp.int32)
    replicated, per_device = P(), P(axis_name)
    # The server replay is bit-identical on every device but computed from an
    # all-gather typed varying (shard_step's check_vma=False).
    sharded = shard_step(
        functools.partial(_async_per_device, cfg),
        mesh,
        in_specs=(replicated, *[per_device] * 3, replicated, replicated, per_device, replicated),
        out_specs=(replicated, *[per_device] * 3, replicated, replicated, replicated, per_device),
    )
    server, workers, opt_state, pulled, step, key, metrics, staleness = sharded(
        state.params,
        state.worker_params,
        state.opt_state,
        state.pulled_version,
        state.step,
        state.key,
        batch,
        arrival,
    )
    metrics = {**metrics, "staleness": staleness}
    return AsyncState(server, workers, opt_state, pulled, step, key), metrics
