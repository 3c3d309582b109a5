"""Per-device gradients inside ``shard_map``.

Inside ``shard_map``, ``jax.grad`` w.r.t. replicated parameters returns
gradients already ``psum``-ed over the axis (the transpose of the implicit
``pvary``), so a compressor would see the global sum instead of its device's
gradient: :func:`per_device_grad` casts the parameters to device-varying first.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend
from jax import lax

from jaxcomp._vma import axis_name_tuple, varying_axes

__all__ = [
    "per_device_grad",
    "per_device_value_and_grad",
]


def _is_varying(x, axis_name) -> bool:
    """Whether ``x`` is already typed device-varying along ``axis_name``."""
    return all(name in varying_axes(x) for name in axis_name_tuple(axis_name))


def to_varying(tree, axis_name):
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
        return value_and_grad(to_varying(params, axis_name), *args, **kwargs)

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
