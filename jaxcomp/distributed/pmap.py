"""The ``jax.pmap`` compatibility path: :func:`stack_for_pmap`, :func:`make_pmap_train_step`."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh

from jaxcomp.distributed.grads import per_device_value_and_grad
from jaxcomp.distributed.skeleton import check_unexchanged

__all__ = [
    "make_pmap_train_step",
    "stack_for_pmap",
]


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
            check_unexchanged(
                tx,
                one,
                mesh,
                axis_name,
                policy="error",
                who="make_pmap_train_step",
                why=", so the per-device parameter copies would drift apart",
                remedy="Give every leaf an exchange (a compressor with axis_name, or "
                "jaxcomp.dense_exchange for the rest), or use make_train_step, which averages "
                "such leaves densely.",
            )
            checked.add(key)
        return pmapped(params, opt_state, batch)

    return train_step
