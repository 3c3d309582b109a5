"""Where a train step's time goes: :func:`time_split` (compute against exchange)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp._vma import axis_name_tuple
from jaxcomp.distributed.grads import per_device_value_and_grad
from jaxcomp.distributed.skeleton import shard_step
from jaxcomp.distributed.step import make_train_step

__all__ = [
    "TimeSplit",
    "make_time_split",
    "split_step_time",
    "time_split",
]


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


def make_time_split(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    train_step: Callable | None = None,
    **step_options,
) -> Callable[..., TimeSplit]:
    """A reusable :func:`time_split`: its three programs built and compiled once.

    A training loop that reports the split every epoch calls the returned
    ``timer(params, opt_state, batch, update_args=None, *, model_state=None,
    rng=None, repeats=5)`` each time; only the first call compiles.

    Args:
      loss_fn, tx, mesh, axis_name: as :func:`make_train_step`.
      train_step: the loop's own step, built by :func:`make_train_step` with
        ``donate=True`` and the same options (or anything called the same way),
        timed as the step instead of compiling a second copy. None: built here.
      **step_options: :func:`make_train_step`'s ``has_aux``, ``mutable``,
        ``unexchanged``, ``overlap``, ``param_specs``.

    Returns:
      ``timer(...) -> TimeSplit`` (seconds); the state passed in is not modified.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(ratio=0.5, axis_name="data"), optax.sgd(0.1))
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> step = dist.make_train_step(loss, tx, mesh)
      >>> timer = dist.make_time_split(loss, tx, mesh, train_step=step)
      >>> params = dist.replicate(jnp.zeros(2), mesh)
      >>> state = dist.init_opt_state(tx, params, mesh)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones(2, np.float32)}, mesh)
      >>> splits = [timer(params, state, batch, repeats=1) for epoch in range(2)]
      >>> all(s.step > 0 for s in splits)
      True
    """
    unknown = set(step_options) - {"has_aux", "mutable", "unexchanged", "overlap", "param_specs"}
    if unknown:
        raise ValueError(f"time_split: unknown step options {sorted(unknown)}")
    if train_step is not None and not callable(train_step):
        raise ValueError(
            f"make_time_split: train_step must be callable or None, got {train_step!r}"
        )
    mutable = step_options.get("mutable", False)
    steps = {
        communicate: make_train_step(
            loss_fn, tx, mesh, axis_name, donate=True, communicate=communicate, **step_options
        )
        for communicate in ((False,) if train_step is not None else (True, False))
    }
    if train_step is not None:
        steps[True] = train_step
    forward_backward = _forward_backward_program(
        loss_fn, mesh, axis_name, has_aux=step_options.get("has_aux", False), mutable=mutable
    )

    def timer(
        params, opt_state, batch, update_args=None, *, model_state=None, rng=None, repeats: int = 5
    ) -> TimeSplit:
        repeats = V.check_int("repeats", repeats, 1)
        kw = {"model_state": model_state, "rng": rng} if mutable else {"rng": rng}
        args = (params, opt_state, batch, update_args, kw)
        medians = {
            communicate: _median_seconds_fresh(
                lambda p, s, b, u, k, step=step: step(p, s, b, u, **k), args, repeats
            )
            for communicate, step in steps.items()
        }
        t_fb = _median_seconds_fresh(forward_backward, (params, batch, model_state, rng), repeats)
        return split_step_time(t_fb, medians[False], medians[True])

    return timer


def _forward_backward_program(loss_fn, mesh, axis_name, *, has_aux, mutable):
    """Each device's forward and backward pass, the gradient applied locally (jitted, donated)."""
    value_and_grad = per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux or mutable)

    def forward_backward(params, batch, model_state, rng):
        kwargs = {"model_state": model_state} if mutable else {}
        if rng is not None:
            kwargs["rng"] = jax.random.fold_in(rng, lax.axis_index(axis_name))
        _, grads = value_and_grad(params, batch, **kwargs)
        return optax.apply_updates(params, grads)

    return jax.jit(
        shard_step(
            forward_backward,
            mesh,
            in_specs=(P(), P(axis_name), P(), P()),
            out_specs=P(),
            axis_names=frozenset(axis_name_tuple(axis_name)),
        ),
        donate_argnums=0,
    )


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
    timer = make_time_split(loss_fn, tx, mesh, axis_name, **step_options)
    return timer(
        params, opt_state, batch, update_args, model_state=model_state, rng=rng, repeats=repeats
    )
