"""The data-parallel train step: :func:`make_train_step` and :func:`init_opt_state`.

The main path is ``jax.shard_map`` over a mesh axis (default ``"data"``):
parameters replicated, batch sharded along the axis, and the optimizer state
*per device* (error-feedback residuals differ between devices), stored with a
leading device axis sharded along the mesh axis. The step is built from the
pieces of :mod:`jaxcomp.distributed.skeleton` (which leaves ``tx`` exchanges,
the stacked state, compress and count, ``shard_map`` with ``check_vma=False``
and ``jax.jit`` with donation), as every other step builder of jaxcomp.

**Overlap** (``make_train_step(overlap=True)``; DLGS, the ldte_bs paper's
§3.1): each group of parameters (a leaf, or a group of the sparsifier's
``groups=``) is compressed and exchanged as soon as its gradient exists,
through a ``jax.custom_vjp`` identity applied where the group's parameters
are first used: the program issues the group's collective before the lower
layers' backward, so a scheduler can overlap them (accelerators; XLA:CPU
moves collectives after the backward) (:mod:`jaxcomp.transforms.overlap`).
The result is the same as compressing after the backward pass, bit for bit,
as the tests compile (XLA:CPU at optimisation level 0) and at XLA's default
level, where LLVM forms fused multiply-adds (tested with ``nn.BatchNorm``'s
mutable statistics, ``reuse_period=2`` and momentum correction: the
accumulation rounds the gradient and ``m * velocity`` before adding them, see
:mod:`jaxcomp.transforms.overlap`). By design, one difference:
``nonfinite="skip"`` is decided per group (a group whose gradient holds
NaN/Inf sends nothing and keeps its residual; the others send), since waiting
for every gradient would serialise the exchange again. It needs a jaxcomp
sparsifier with the step's ``axis_name`` first in ``tx``
(``optax.chain(jaxcomp.ldte_bs(...), optax.sgd(...))``), receiving every
gradient leaf unchanged; anything else raises a ``ValueError`` when the step
is first called. Not available with model axes or FSDP.

**Data x model parallel** (``param_specs``): ``mesh`` may have axes besides
``axis_name`` (e.g. ``("data", "model")``); ``param_specs`` (a pytree of
``PartitionSpec`` like the parameters, naming model axes only, e.g.
``P(None, "model")`` for a Dense kernel split by columns;
:func:`~jaxcomp.distributed.flax_param_specs` reads them from Flax's
partitioning metadata) says how each parameter is sharded over them.
``loss_fn`` is written for whole arrays: XLA partitions it over the model
axes (``jax.shard_map`` is manual over ``axis_name`` only). The compressor
runs once per model shard on that shard's slice of each gradient (its
``ratio`` applies to the slice, so ``k`` is split over the shards in
proportion to their sizes: each of ``M`` equal shards sends ``ceil(ratio * n
/ M)``) and exchanges over ``axis_name`` only, among the devices holding the
same shard. With a model axis of size 1 this is the 1-D step. Place the
parameters with :func:`~jaxcomp.distributed.place_params` and the state with
:func:`init_opt_state` (both given the same ``param_specs``).

**Two-level mesh** (``axis_name=("node", "local")`` on ``jax.make_mesh((nodes,
L), ("node", "local"))``, or :func:`~jaxcomp.distributed.two_level_mesh` with
several processes): the batch and the per-device state are split over both
axes (``N = nodes * L`` rows), and a compressor given the same ``axis_name``
runs the two-level exchange (:mod:`jaxcomp.transforms.two_level`: a dense
reduce-scatter inside the node, the compressor on the owned shard across
nodes, an all-gather back). ``metrics`` then report ``intra_node_bytes`` and
``inter_node_bytes`` beside ``wire_bytes`` (:func:`~jaxcomp.distributed.skeleton.link_bytes`).
Un-exchanged leaves and a dense optimizer are averaged over all ``N``
devices. Not with ``overlap=True``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp._vma import axis_name_tuple
from jaxcomp.comm import collectives
from jaxcomp.distributed.grads import per_device_value_and_grad, to_varying
from jaxcomp.distributed.placement import (
    add_leading_axes,
    fsdp_specs,
    gather_fsdp,
    own_slices,
    param_layout,
    per_model_shard,
    place_params,
    sharded_update,
)
from jaxcomp.distributed.skeleton import (
    UNEXCHANGED,
    check_stacked_state,
    check_unexchanged,
    compress,
    device_slice,
    device_stack,
    inner_run_wire_bytes,
    jit_step,
    link_bytes,
    mean_leaves,
    shard_step,
    unexchanged_paths,
    wire_bytes_total,
)
from jaxcomp.transforms import overlap as overlap_lib
from jaxcomp.transforms.two_level import is_two_level

__all__ = [
    "init_opt_state",
    "make_train_step",
    "unexchanged_leaves",
]


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
      axis_name: the data-parallel axis, or a tuple of axes (``("node",
        "local")`` for the two-level exchange): leaves then get shape ``(N,
        ...)`` for the ``N = nodes * L`` devices, sharded over both.
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
        return add_leading_axes(tx.init(p), n_model)

    def init(p):
        shard = per_model_shard(
            init_shard, layout, in_specs=(layout.specs,), out_specs=P(*layout.model_axes)
        )
        return add_leading_axes(shard(gather_fsdp(p, layout, axis_name)[0]), 1)

    init_fn = shard_step(
        init, mesh, (layout.data_specs,), P(axis_name), axis_names=layout.manual_data
    )
    return jax.jit(init_fn)(params)


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
      axis_name: mesh axis the batch is split over, or a tuple of axes
        (``("node", "local")`` on ``jax.make_mesh((nodes, L), ("node",
        "local"))``: the batch and the per-device state are split over both,
        the dense mean is over all devices; give the compressor the same
        ``axis_name`` for the two-level exchange, see the module docstring).
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
      overlap: run the sparsifier inside the backward pass (DLGS): each group
        of parameters is compressed and exchanged as soon as its gradient
        exists, so a scheduler can overlap the exchange with the lower layers'
        backward. The same result as compressing after the backward pass, bit
        for bit, but for ``nonfinite="skip"``, decided per group. Needs a
        jaxcomp sparsifier with this ``axis_name`` first in ``tx``; not with
        model axes or FSDP (details in :mod:`jaxcomp.distributed.step`).
      communicate: ``False`` replaces every collective of the step by a local
        stand-in of the same shapes (:func:`jaxcomp.comm.without_communication`):
        not a training step (each device sees its own message ``N`` times), the
        same program without its communication, to time it
        (:func:`time_split`).
      param_specs: data x model parallel training: with ``mesh`` axes besides
        ``axis_name``, a pytree of ``PartitionSpec`` like the parameters,
        naming model axes only (:func:`flax_param_specs` reads them from
        Flax), says how each parameter is sharded over them (None: replicated).
        XLA partitions ``loss_fn`` over the model axes; the compressor runs
        once per model shard on its slice (its ``ratio`` applies to the
        slice) and exchanges over ``axis_name`` among the devices holding the
        same shard. Place the parameters with :func:`place_params` and the
        state with :func:`init_opt_state`, given the same ``param_specs``
        (details in :mod:`jaxcomp.distributed.step`).

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
      With a compressor given ``axis_name=(node, local)`` (the two-level
      exchange, :mod:`jaxcomp.transforms.two_level`) also
      ``intra_node_bytes`` and ``inter_node_bytes``, the bytes it sent over
      each link class (mean over devices; ``wire_bytes`` includes both, and
      the dense all-reduce of un-exchanged leaves besides).

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
    cfg = _step_config(
        loss_fn,
        tx,
        mesh,
        axis_name,
        has_aux=has_aux,
        mutable=mutable,
        unexchanged=V.check_choice("unexchanged", unexchanged, UNEXCHANGED),
        overlap=V.check_bool("overlap", overlap),
        communicate=V.check_bool("communicate", communicate),
        param_specs=param_specs,
    )
    return jit_step(
        functools.partial(_run, cfg),
        donate_argnums=(0, 1, 3) if donate else (),
        arguments=functools.partial(_arguments, cfg),
        results=functools.partial(_results, cfg),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _StepConfig:
    """The validated static options of one :func:`make_train_step` step."""

    loss_fn: Callable
    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: Any
    has_aux: bool
    mutable: bool
    unexchanged: str
    overlap: bool
    communicate: bool
    param_specs: Any
    model_axes: tuple  # mesh axes besides the data axis (XLA partitions over them)
    n_model_devices: int
    value_and_grad: Callable  # per-device (loss, grads) of loss_fn
    overlapped: Callable  # overlap=True: (loss, updates, state) from inside the backward

    @property
    def returns_aux(self) -> bool:
        """Whether ``loss_fn`` returns ``(loss, aux)`` (aux: model state and/or has_aux)."""
        return self.has_aux or self.mutable


def _step_config(loss_fn, tx, mesh, axis_name, *, overlap, param_specs, **options) -> _StepConfig:
    """Builds and checks the step's static options (errors name the argument)."""
    returns_aux = options["has_aux"] or options["mutable"]

    def value_and_grad_with_carriers(fun):
        # d/d(params, carriers) with per-device gradients (see per_device_value_and_grad).
        vg = jax.value_and_grad(fun, argnums=(0, 1), has_aux=returns_aux)
        return lambda params, *args, **kw: vg(to_varying(params, axis_name), *args, **kw)

    model_axes = tuple(a for a in mesh.axis_names if a not in axis_name_tuple(axis_name))
    if overlap and is_two_level(axis_name):
        raise ValueError(
            f"make_train_step(overlap=True) does not support the two-level exchange "
            f"(axis_name={axis_name!r}): compress after the backward pass (overlap=False)"
        )
    if overlap and (model_axes or fsdp_specs(param_specs, axis_name)):
        raise ValueError(
            "make_train_step(overlap=True) works with replicated parameters on a mesh with the "
            f"data axis only; this mesh has {mesh.axis_names} and param_specs {param_specs} "
            "(compress after the backward pass with model axes or FSDP)"
        )
    if model_axes and getattr(tx.update, "sharded_compressor", None) is not None:
        raise ValueError(
            "make_train_step: sharded_optimizer (FSDP) on a mesh with model axes "
            f"{model_axes} is not supported; use optax.chain(compressor, optimizer) there"
        )
    return _StepConfig(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        overlap=overlap,
        param_specs=param_specs,
        model_axes=model_axes,
        n_model_devices=int(np.prod([mesh.shape[a] for a in model_axes])),
        value_and_grad=per_device_value_and_grad(loss_fn, axis_name, has_aux=returns_aux),
        overlapped=overlap_lib.value_and_compressed_grad(
            value_and_grad_with_carriers, tx, axis_name
        ),
        **options,
    )


def _arguments(
    cfg: _StepConfig, params, opt_state, batch, update_args=None, *, model_state=None, rng=None
):
    """The jitted step's arguments from the user's (checked)."""
    if cfg.mutable and model_state is None:
        raise ValueError("make_train_step(mutable=True): pass model_state= to the step")
    return params, opt_state, batch, model_state, rng, update_args or {}


def _results(cfg: _StepConfig, out):
    """What the user's step returns, from the jitted step's outputs."""
    params, opt_state, model_state, metrics, aux = out
    if cfg.has_aux:
        metrics = {**metrics, "aux": aux}
    if cfg.mutable:
        return params, opt_state, model_state, metrics
    return params, opt_state, metrics


def _run(cfg: _StepConfig, params, opt_state, batch, model_state, rng, update_args):
    """The jitted step: checks what ``tx`` exchanges, then the per-device step under shard_map."""
    axis_name = cfg.axis_name
    layout = param_layout(cfg.mesh, axis_name, params, cfg.param_specs)
    check_stacked_state(opt_state, cfg.mesh, layout)
    paths = _dense_paths(cfg, params, update_args, layout)
    per_device = functools.partial(
        _per_device_step, cfg, dense_paths=frozenset(paths), layout=layout
    )
    sharded = shard_step(
        per_device,
        cfg.mesh,
        # Replicated params, model state and key; per-device state, batch
        # and extra args.
        in_specs=(layout.data_specs, P(axis_name), P(axis_name), P(), P(), P(axis_name)),
        out_specs=(layout.data_specs, P(axis_name), P(), P(), P(axis_name)),
        # Manual over the data axis; model axes (if any) stay XLA's to partition.
        axis_names=layout.manual_data,
        communicate=cfg.communicate,
    )
    return sharded(params, opt_state, batch, model_state, rng, update_args)


def _dense_paths(cfg: _StepConfig, params, update_args, layout) -> list:
    """The update leaves ``tx`` leaves un-averaged (averaged densely before it), checked."""
    axis_name, tx = cfg.axis_name, cfg.tx
    tx_dims = getattr(tx.update, "fsdp_dims", None)
    if tx_dims is not None and tuple(tx_dims(params)) != layout.fsdp_dims:
        raise ValueError(
            "make_train_step: sharded_optimizer was given other param_specs than the step "
            f"(split dimensions per leaf {tuple(tx_dims(params))} vs {layout.fsdp_dims}); "
            "give both the same specs"
        )
    probe = functools.partial(check_unexchanged, tx, params, cfg.mesh, axis_name, update_args)
    if cfg.overlap and cfg.unexchanged == "mean":
        # Inside the backward pass the step has no place to average leaves itself.
        return probe(
            layout,
            policy="error",
            who="make_train_step(overlap=True)",
            remedy="With overlap the sparsifier must exchange every leaf (give it "
            f"axis_name={axis_name!r}, and put it first in optax.chain, outside optax.masked).",
        )
    return probe(
        layout,
        policy=cfg.unexchanged,
        why=", so the replicated parameters would diverge between devices",
        remedy="Give every leaf an exchange (a compressor with axis_name, or "
        "jaxcomp.dense_exchange) or use unexchanged='mean' to average them densely before tx.",
    )


def _per_device_step(
    cfg: _StepConfig, params, opt_state, batch, model_state, rng, update_args, dense_paths, layout
):
    """One device's step inside ``shard_map``: gradients, ``tx``, the update and the metrics."""
    axis_name, tx = cfg.axis_name, cfg.tx
    state, extra = device_slice(opt_state), device_slice(update_args)
    # Backup workers: what the step averages itself counts the included devices only.
    include = extra.get("include") if isinstance(extra, dict) else None
    kwargs = {}
    if cfg.mutable:
        kwargs["model_state"] = model_state
    if rng is not None:
        kwargs["rng"] = jax.random.fold_in(rng, lax.axis_index(axis_name))
    if cfg.overlap:
        loss, updates, state = cfg.overlapped(
            cfg.loss_fn, params, state, extra, batch, has_aux=cfg.returns_aux, **kwargs
        )
        dense_wire, wire = jnp.float32(0), wire_bytes_total(state)
        links = None
    else:
        # FSDP leaves: this device holds a slice; the forward and the
        # compressor see the whole parameter (gathered), the update keeps
        # this device's slice.
        full, gather_wire = gather_fsdp(params, layout, axis_name)
        loss, grads = cfg.value_and_grad(full, batch, **kwargs)
        grads, dense_wire = mean_leaves(grads, dense_paths, axis_name, include)
        # With model axes tx runs once per model shard: compress's probes
        # (the branch check, optax.MultiSteps' bytes) see whole leaves only.
        probe = not layout.model_axes
        updates, new_state, wire = compress(
            tx,
            grads,
            state,
            full,
            extra,
            axis_name,
            "make_train_step",
            update=sharded_update(tx, layout),
            probe=probe,
        )
        links = _link_bytes(tx, grads, state, new_state, full, extra, probe)
        state = new_state
        updates = own_slices(updates, params, layout, axis_name)
        dense_wire = dense_wire + gather_wire
    params = optax.apply_updates(params, updates)
    value, aux = (loss[0], loss[1]) if cfg.returns_aux else (loss, None)
    if cfg.mutable:
        new_model_state, aux = aux if cfg.has_aux else (aux, None)
        model_state = jax.tree.map(lambda x: _mean_if_float(x, axis_name, include), new_model_state)
    metrics = {"loss": lax.pmean(value, axis_name)}
    wire = _step_wire_bytes(cfg, wire, dense_wire, dense_paths, layout)
    if wire is not None:
        metrics["wire_bytes"] = lax.pmean(wire, axis_name)
    if links is not None:
        # Summed over the model shards' stacked statistics, as wire_bytes.
        for name, value in zip(("intra_node_bytes", "inter_node_bytes"), links, strict=True):
            metrics[name] = lax.pmean(value / cfg.n_model_devices, axis_name)
    aux_out = device_stack(aux) if cfg.has_aux else None
    return params, device_stack(state), model_state, metrics, aux_out


def _link_bytes(tx, grads, state, new_state, params, extra, probe):
    """``(intra, inter)`` node bytes of a two-level exchange in ``tx``, or None.

    Under ``optax.MultiSteps`` one inner run's pair, traced from the state
    before the update (``probe``: as :func:`compress`'s count).
    """
    if link_bytes(new_state) is None:
        return None
    run = inner_run_wire_bytes(tx, grads, state, params, extra, count=link_bytes) if probe else None
    return link_bytes(new_state, run)


def _step_wire_bytes(cfg: _StepConfig, wire, dense_wire, dense_paths, layout):
    """Bytes this device put on the wire this step (None: nothing reports any)."""
    if wire is not None and cfg.model_axes:
        # Summed over the model shards' stacked statistics: one device sends its shard's.
        wire = wire / cfg.n_model_devices
    if dense_paths or layout.fsdp:
        # The dense all-reduce of whole leaves, split among the model shards.
        dense_wire = dense_wire / cfg.n_model_devices
    if wire is not None or dense_paths or layout.fsdp:
        return dense_wire if wire is None else wire + dense_wire
    return None


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


def _mean_if_float(x, axis_name, include=None):
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return x
    if include is None:
        return lax.pmean(x, axis_name)
    return collectives.dense_mean(x, axis_name, include=include)[0]
