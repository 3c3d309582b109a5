"""The data-parallel train step: :func:`make_train_step` and :func:`init_opt_state`.

The main path is ``jax.shard_map`` over a mesh axis (default ``"data"``):
parameters replicated, batch sharded along the axis, and the optimizer state
*per device* (error-feedback residuals differ between devices), stored with a
leading device axis sharded along the mesh axis. Sparse exchanges end in an
all-gather, whose result JAX types as device-varying although every device
holds the same bits, so the step's ``shard_map`` runs with ``check_vma=False``
to return replicated parameters without another all-reduce; the step probes
once that the averaged leaves stay identical (:func:`check_averaged_stay_identical`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

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
from jaxcomp._vma import axis_name_tuple, varying_axes
from jaxcomp.comm import collectives
from jaxcomp.comm import local as local_lib
from jaxcomp.distributed.grads import per_device_value_and_grad, to_varying
from jaxcomp.distributed.placement import (
    ParamLayout,
    add_leading_axes,
    fsdp_specs,
    gather_fsdp,
    own_slices,
    param_layout,
    per_model_shard,
    place_params,
    replicated_specs,
    sharded_update,
)
from jaxcomp.transforms import overlap as overlap_lib

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
        return add_leading_axes(tx.init(p), n_model)

    def init(p):
        shard = per_model_shard(
            init_shard, layout, in_specs=(layout.specs,), out_specs=P(*layout.model_axes)
        )
        return add_leading_axes(shard(gather_fsdp(p, layout, axis_name)[0]), 1)

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
    init_shard = per_model_shard(
        lambda p: add_leading_axes(tx.init(p), n_model),
        layout,
        in_specs=(layout.specs,),
        out_specs=P(*layout.model_axes),
        check_vma=True,
    )
    update = sharded_update(tx, layout, check_vma=True, stack_updates=True)
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
    param_specs = layout.specs if layout.specs is not None else replicated_specs(params)
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
    cfg = _step_config(
        loss_fn,
        tx,
        mesh,
        axis_name,
        has_aux=has_aux,
        mutable=mutable,
        unexchanged=unexchanged,
        overlap=V.check_bool("overlap", overlap),
        communicate=V.check_bool("communicate", communicate),
        param_specs=param_specs,
    )
    jitted = jax.jit(functools.partial(_run, cfg), donate_argnums=(0, 1, 3) if donate else ())

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


def _run(cfg: _StepConfig, params, opt_state, batch, model_state, rng, update_args):
    """The jitted step: checks what ``tx`` exchanges, then the per-device step under shard_map."""
    axis_name = cfg.axis_name
    layout = param_layout(cfg.mesh, axis_name, params, cfg.param_specs)
    check_stacked_state(opt_state, cfg.mesh, layout)
    paths = _dense_paths(cfg, params, update_args, layout)
    per_device = functools.partial(
        _per_device_step, cfg, dense_paths=frozenset(paths), layout=layout
    )
    if not cfg.communicate:
        per_device = local_lib.without_communication(per_device)
    sharded = jax.shard_map(
        per_device,
        mesh=cfg.mesh,
        # Replicated params, model state and key; per-device state, batch
        # and extra args.
        in_specs=(layout.data_specs, P(axis_name), P(axis_name), P(), P(), P(axis_name)),
        out_specs=(layout.data_specs, P(axis_name), P(), P(), P(axis_name)),
        # Manual over the data axis; model axes (if any) stay XLA's to partition.
        axis_names=layout.manual_data,
        # Exchanged updates are bit-identical on every device; the
        # optimizer state that produced them is per device (typed varying),
        # so the check would reject replicated parameters. What the check
        # would guard is verified by the trace-time probe instead
        # (_dense_paths: check_averaged_stay_identical).
        check_vma=False,
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
    paths = unexchanged_paths(tx, params, cfg.mesh, axis_name, update_args, layout)
    names = ", ".join(jax.tree_util.keystr(p) for p in paths)
    if paths and cfg.unexchanged == "error":
        raise ValueError(
            "make_train_step: tx does not average these update leaves over "
            f"{axis_name!r}, so the replicated parameters would diverge between devices: "
            f"{names}. Give every leaf an "
            "exchange (a compressor with axis_name, or jaxcomp.dense_exchange) or use "
            "unexchanged='mean' to average them densely before tx."
        )
    if paths and cfg.overlap:
        raise ValueError(
            "make_train_step(overlap=True): tx does not average these update leaves over "
            f"{axis_name!r}: {names}. With "
            "overlap the sparsifier must exchange every leaf (give it axis_name="
            f"{axis_name!r}, and put it first in optax.chain, outside optax.masked)."
        )
    if paths:
        check_averaged_stay_identical(tx, params, cfg.mesh, axis_name, update_args, layout, paths)
        logging.info(
            "make_train_step: averaging %d leaves densely before tx (not exchanged by tx): %s",
            len(paths),
            names,
        )
    return paths


def _per_device_step(
    cfg: _StepConfig, params, opt_state, batch, model_state, rng, update_args, dense_paths, layout
):
    """One device's step inside ``shard_map``: gradients, ``tx``, the update and the metrics."""
    axis_name, tx = cfg.axis_name, cfg.tx
    state = jax.tree.map(lambda x: x[0], opt_state)
    extra = jax.tree.map(lambda x: x[0], update_args)
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
        dense_wire, inner_run_bytes = jnp.float32(0), None
    else:
        # FSDP leaves: this device holds a slice; the forward and the
        # compressor see the whole parameter (gathered), the update keeps
        # this device's slice.
        full, gather_wire = gather_fsdp(params, layout, axis_name)
        loss, grads = cfg.value_and_grad(full, batch, **kwargs)
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
        updates, state = sharded_update(tx, layout)(grads, state, full, **extra)
        updates = own_slices(updates, params, layout, axis_name)
        dense_wire = dense_wire + gather_wire
    params = optax.apply_updates(params, updates)
    value, aux = (loss[0], loss[1]) if cfg.returns_aux else (loss, None)
    if cfg.mutable:
        new_model_state, aux = aux if cfg.has_aux else (aux, None)
        model_state = jax.tree.map(lambda x: _mean_if_float(x, axis_name, include), new_model_state)
    metrics = {"loss": lax.pmean(value, axis_name)}
    wire = _step_wire_bytes(cfg, state, inner_run_bytes, dense_wire, dense_paths, layout)
    if wire is not None:
        metrics["wire_bytes"] = lax.pmean(wire, axis_name)
    aux_out = jax.tree.map(lambda x: jnp.asarray(x)[None], aux) if cfg.has_aux else None
    return params, jax.tree.map(lambda x: x[None], state), model_state, metrics, aux_out


def _step_wire_bytes(cfg: _StepConfig, state, inner_run_bytes, dense_wire, dense_paths, layout):
    """Bytes this device put on the wire this step (None: nothing reports any)."""
    wire = wire_bytes_total(state, inner_run_bytes)
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
