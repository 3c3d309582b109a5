"""Placing parameters and batches on the mesh, and how each parameter is laid out.

:func:`replicate`, :func:`shard_batch`, :func:`place_params` and
:func:`flax_param_specs` put data on the mesh; :func:`param_layout` reads
which leaves are split over model axes or the data axis (FSDP), and the
helpers below gather, slice and stack them for the train step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp._vma import axis_name_tuple
from jaxcomp.comm import collectives

__all__ = [
    "flax_param_specs",
    "place_params",
    "replicate",
    "shard_batch",
    "two_level_mesh",
]


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


def two_level_mesh(local: int | None = None, axis_names=("node", "local"), devices=None) -> Mesh:
    """The ``(nodes, local)`` mesh of the two-level exchange, one node per row of devices.

    The devices in process order (process index, then id): with several
    processes and the default ``local`` each process's devices form one node
    row, so the ``"local"`` axis stays inside a process (its fast links) and
    the ``"node"`` axis crosses processes. Give the compressor and
    :func:`~jaxcomp.distributed.make_train_step` ``axis_name=axis_names``.

    Args:
      local: devices per node (None: ``jax.local_device_count()``, one node per
        process); must divide the device count.
      axis_names: the (node, local) axis names.
      devices: the devices to lay out (None: ``jax.devices()``).

    Returns:
      A ``jax.sharding.Mesh`` of shape ``(len(devices) // local, local)``.

    Raises:
      ValueError: when ``local`` is not a positive divisor of the device count.

    Example:
      >>> import jax
      >>> from jaxcomp.distributed import two_level_mesh
      >>> mesh = two_level_mesh(local=1)
      >>> dict(mesh.shape) == {"node": jax.device_count(), "local": 1}
      True
    """
    devices = jax.devices() if devices is None else list(devices)
    devices = sorted(devices, key=lambda d: (d.process_index, d.id))
    local = jax.local_device_count() if local is None else local
    if isinstance(local, bool) or not isinstance(local, int | np.integer) or local < 1:
        raise ValueError(f"two_level_mesh: local must be a positive int, got {local!r}")
    if len(devices) % local:
        raise ValueError(
            f"two_level_mesh: local={local} does not divide the {len(devices)} devices"
        )
    if len(axis_names) != 2 or axis_names[0] == axis_names[1]:
        raise ValueError(f"two_level_mesh: axis_names must be two names, got {axis_names!r}")
    grid = np.array(devices, dtype=object).reshape(len(devices) // local, local)
    return Mesh(grid, tuple(axis_names))


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


def replicated_specs(params):
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


def add_leading_axes(tree, n_leading: int):
    return jax.tree.map(lambda x: jnp.asarray(x)[(None,) * n_leading], tree)


def _unstack(tree, n_leading: int):
    return jax.tree.map(lambda x: x[(0,) * n_leading], tree)


def fsdp_specs(param_specs, axis_name) -> bool:
    """Whether ``param_specs`` split some parameter over the data axis."""
    names = set(axis_name_tuple(axis_name))
    specs = jax.tree.leaves(param_specs, is_leaf=lambda x: isinstance(x, P))
    return any(_spec_axes(s) & names for s in specs if isinstance(s, P))


def gather_fsdp(params, layout: ParamLayout, axis_name):
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


def own_slices(updates, params, layout: ParamLayout, axis_name):
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


def per_model_shard(fn, layout: ParamLayout, in_specs, out_specs, *, check_vma=False):
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


def sharded_update(tx, layout: ParamLayout, *, check_vma=False, stack_updates=False):
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
        return (add_leading_axes(updates, n_model) if stack_updates else updates), add_leading_axes(
            state, n_model
        )

    def update(grads, state, params, **extra):
        mapped = per_model_shard(
            local,
            layout,
            in_specs=(layout.specs, state_spec, layout.specs, P()),
            out_specs=(state_spec if stack_updates else layout.specs, state_spec),
            check_vma=check_vma,
        )
        return mapped(grads, state, params, extra)

    return update
