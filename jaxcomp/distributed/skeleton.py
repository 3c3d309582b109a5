"""The step skeleton every data-parallel step builder is made of.

Every train step of jaxcomp (:func:`~jaxcomp.distributed.make_train_step`,
the pmap path, the QSVRG epoch, :mod:`jaxcomp.staleness`,
:mod:`jaxcomp.aggregation`, :mod:`jaxcomp.cssgd`) has the same shape, built
from the pieces of this module:

1. **Which leaves ``tx`` exchanges** (:func:`check_unexchanged`), decided when
   the step is first traced: ``tx`` is traced once more under ``shard_map``'s
   ``check_vma`` typing (:func:`unexchanged_paths`); the leaves it leaves
   un-averaged are rejected (``"error"``) or averaged densely before it
   (``"mean"``, :func:`mean_leaves`), after a probe that ``tx`` keeps them
   identical on every device (:func:`check_averaged_stay_identical`).
2. **The per-device stacked state.** The optimizer state is per device
   (error-feedback residuals differ), stored with a leading device axis
   sharded along the data axis (:func:`check_stacked_state` checks it): each
   device reads its row with :func:`device_slice` and returns it with
   :func:`device_stack`.
3. **Compress and count** (:func:`compress`): one device's ``tx.update``,
   after the check that no branch on this device's values skips an exchange
   (``optax.apply_if_finite`` around one would hang the step), and the bytes
   it put on the wire: every ``wire_bytes`` field of the new state
   (:func:`wire_bytes_total`), under ``optax.MultiSteps`` those of every
   mini-step that ran the exchange (:func:`inner_run_wire_bytes`).
4. **Mapped and jitted** (:func:`shard_step`, :func:`jit_step`): the
   per-device step under ``jax.shard_map`` with ``check_vma=False``, then
   ``jax.jit`` with donation, returning a step with a ``.lower`` attribute.
   Sparse exchanges end in an all-gather, whose result JAX types as
   device-varying although every device holds the same bits, and the
   optimizer state that produced an exchanged update is per device (typed
   varying): with ``check_vma=True`` the step could not return replicated
   parameters without another all-reduce. What the check would guard is
   verified by the trace-time probes of step 1 instead.

Layout of the code: the stacked-state convention, then the exchange checks
(step 1), the byte counts and :func:`compress` (step 3), and the mapping and
jitting (step 4); each builder keeps only what is its own (its gradients, its
state, its metrics).
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
from collections.abc import Callable, Sequence

import jax
import jax.extend
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp import _vma as vma
from jaxcomp._vma import axis_name_tuple, varying_axes
from jaxcomp.comm import collectives
from jaxcomp.comm import local as local_lib
from jaxcomp.distributed.placement import (
    ParamLayout,
    add_leading_axes,
    param_layout,
    per_model_shard,
    replicated_specs,
    sharded_update,
)

__all__ = [
    "UNEXCHANGED",
    "check_unexchanged",
    "compress",
    "device_slice",
    "device_stack",
    "jit_step",
    "link_bytes",
    "shard_step",
    "wire_bytes_total",
]

# The policies for update leaves tx does not average (make_train_step's ``unexchanged``).
UNEXCHANGED = ("mean", "error")


# --- the per-device stacked state ----------------------------------------------------


def device_slice(tree):
    """This device's entry of a per-device stacked tree (inside ``shard_map``): row 0.

    Under ``shard_map`` with ``P(axis_name)`` each device gets a block of one
    row of a tree stacked along a leading device axis (the optimizer state of
    :func:`~jaxcomp.distributed.init_opt_state`, ``update_args``, replicas).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed.skeleton import device_slice
      >>> device_slice({"w": jnp.array([[1.0, 2.0]])})["w"].tolist()
      [1.0, 2.0]
    """
    return jax.tree.map(lambda x: x[0], tree)


def device_stack(tree):
    """The inverse of :func:`device_slice`: a leading device axis of one row on every leaf.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed.skeleton import device_stack
      >>> device_stack({"w": jnp.array([1.0, 2.0]), "n": 3})["n"].shape
      (1,)
    """
    return jax.tree.map(lambda x: jnp.asarray(x)[None], tree)


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


# --- which leaves tx exchanges -------------------------------------------------------


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


def leaf_names(paths) -> str:
    """``"['b'], ['c']"``: key paths as the error messages name them (``<root>`` for ``()``)."""
    return ", ".join(jax.tree_util.keystr(p) or "<root>" for p in paths)


def check_unexchanged(
    tx,
    params,
    mesh: Mesh,
    axis_name,
    update_args=None,
    layout: ParamLayout | None = None,
    *,
    policy: str = "mean",
    who: str = "make_train_step",
    why: str = "",
    remedy: str = "",
) -> list:
    """The update leaves a step averages densely before ``tx``, decided and checked.

    Traces ``tx`` (:func:`unexchanged_paths`, nothing runs) for the update
    leaves it leaves un-averaged over ``axis_name``. With ``policy="error"``
    any such leaf raises; with ``"mean"`` the step averages their gradients
    itself (:func:`mean_leaves`), after :func:`check_averaged_stay_identical`
    made sure ``tx`` does not make them differ between devices again.

    Args:
      tx: the optimizer the step runs on each device.
      params: the parameters (arrays or ``jax.ShapeDtypeStruct``).
      mesh: the device mesh.
      axis_name: the data axis.
      update_args: per-device extra arguments of ``tx.update`` with a leading
        device axis (None: none).
      layout: the step's :class:`~jaxcomp.distributed.placement.ParamLayout`
        (None: replicated parameters).
      policy: one of :data:`UNEXCHANGED`.
      who: the step the messages name.
      why, remedy: the error's consequence (after the axis, e.g. ``", so the
        replicated parameters would diverge"``) and what to do (after the names).

    Returns:
      The key paths to average densely (``[]`` when ``tx`` exchanges every leaf).

    Raises:
      ValueError: with ``policy="error"``, naming the un-averaged leaves; a
        ``tx`` that makes averaged leaves differ again.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp.distributed.skeleton import check_unexchanged
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> params = {"w": jnp.zeros(4), "b": jnp.zeros(2)}
      >>> tx = optax.masked(jaxcomp.top_k(0.5, axis_name="data"), {"w": True, "b": False})
      >>> check_unexchanged(tx, params, mesh, "data")
      [(DictKey(key='b'),)]
    """
    policy = V.check_choice("policy", policy, UNEXCHANGED)
    update_args = {} if update_args is None else update_args
    paths = unexchanged_paths(tx, params, mesh, axis_name, update_args, layout)
    if not paths:
        return paths
    names = leaf_names(paths)
    if policy == "error":
        raise ValueError(
            f"{who}: tx does not average these update leaves over {axis_name!r}{why}: "
            f"{names}. {remedy}"
        )
    check_averaged_stay_identical(tx, params, mesh, axis_name, update_args, layout, paths, who)
    logging.info(
        "%s: averaging %d leaves densely before tx (not exchanged by tx): %s",
        who,
        len(paths),
        names,
    )
    return paths


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


# --- compress and count ------------------------------------------------------------


# The byte fields of a state: a compressor's ``wire_bytes``; a two-level
# exchange's (TwoLevelState) intra-node bytes beside its inner compressor's
# ``wire_bytes`` (its ``inter_node_bytes`` repeats those: never added to the total).
WIRE_FIELDS = ("wire_bytes", "intra_node_bytes")
LINK_FIELDS = ("intra_node_bytes", "inter_node_bytes")


def _fields_total(state, fields, inner_run_bytes=None):
    """Sum of the fields named ``fields`` in ``state``, or None (:func:`wire_bytes_total`)."""
    is_multi = lambda x: isinstance(x, optax.MultiStepsState)  # noqa: E731
    total, found = jnp.float32(0), False
    for node in jax.tree.leaves(state, is_leaf=is_multi):
        if is_multi(node):
            inner = _fields_total(node.inner_opt_state, fields)
            if inner_run_bytes is not None:
                inner = jnp.float32(inner_run_bytes)
            if inner is not None:
                skip = node.skip_state
                skipped = skip.get("should_skip") if isinstance(skip, dict) else None
                ran = True if skipped is None else ~jnp.ravel(skipped)[0]
                total, found = total + jnp.where(ran, inner, 0), True
    rest = jax.tree.map(lambda x: None if is_multi(x) else x, state, is_leaf=is_multi)
    # Each field is a scalar, or one per model shard (stacked): summed over them.
    for field in fields:
        for _, v in optax.tree.get_all_with_path(rest, field):
            total, found = total + jnp.sum(jnp.asarray(v, jnp.float32)), True
    return total if found else None


def wire_bytes_total(state, inner_run_bytes=None):
    """Bytes sent this step: every ``wire_bytes`` field in ``state`` (a chain may hold several).

    A two-level exchange (:class:`~jaxcomp.transforms.two_level.TwoLevelState`)
    adds its ``intra_node_bytes`` to its compressor's ``wire_bytes`` (the
    inter-node bytes): its ``inter_node_bytes`` repeats those and is not
    added again. None when nothing in ``state`` reports bytes.

    Under ``optax.MultiSteps`` (optax 0.2.x) the inner transformation runs,
    its exchange included, on every mini-step that is not skipped (on the
    running mean of the mini-batch gradients), but its new state is kept on
    the last mini-step only: on the others ``wire_bytes`` still holds the
    last kept run's. What was sent is counted on every mini-step that ran:
    ``inner_run_bytes`` when the caller knows one run's bytes (see
    :func:`inner_run_wire_bytes`), else the inner state's ``wire_bytes``
    (jaxcomp's exchanges send the same bytes on every run, so that is this
    run's, bar the mini-steps before the first kept run, which read 0).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed.skeleton import wire_bytes_total
      >>> from jaxcomp.transforms.two_level import TwoLevelState
      >>> inner = {"wire_bytes": jnp.float32(12.0)}
      >>> float(wire_bytes_total(TwoLevelState(inner, jnp.float32(42.0), jnp.float32(12.0), 0)))
      54.0
    """
    return _fields_total(state, WIRE_FIELDS, inner_run_bytes)


def link_bytes(state, inner_run_bytes=None):
    """``(intra_node_bytes, inter_node_bytes)`` sent this step (None: no two-level exchange).

    The sums of those fields of every
    :class:`~jaxcomp.transforms.two_level.TwoLevelState` in ``state`` (a
    compressor given ``axis_name=(node, local)``); their sum is its part of
    :func:`wire_bytes_total`. ``inner_run_bytes``: under ``optax.MultiSteps``
    one inner run's pair (:func:`inner_run_wire_bytes` with
    ``count=link_bytes``), counted on every mini-step that ran it.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed.skeleton import link_bytes
      >>> from jaxcomp.transforms.two_level import TwoLevelState
      >>> state = (TwoLevelState({"wire_bytes": 12.0}, jnp.float32(42.0), jnp.float32(12.0), 0),)
      >>> [float(b) for b in link_bytes(state)], link_bytes({"wire_bytes": 12.0})
      ([42.0, 12.0], None)
    """
    if _fields_total(state, LINK_FIELDS[:1]) is None:
        return None
    runs = (None, None) if inner_run_bytes is None else inner_run_bytes
    return tuple(
        _fields_total(state, (field,), run) for field, run in zip(LINK_FIELDS, runs, strict=True)
    )


def inner_run_wire_bytes(tx, grads, state, params, extra, count=None):
    """Bytes one run of ``optax.MultiSteps``' inner update sends, if they are a constant.

    optax keeps the inner state of the last mini-step only, so the bytes of
    the other mini-steps' runs are never stored. jaxcomp's exchanges compute
    their bytes from shapes and the device count: in the inner update's
    jaxpr (traced, nothing run) the bytes are then a function of literals
    alone, evaluated here. ``count``: the inner state to its bytes, a scalar
    or a tuple of them (default :func:`wire_bytes_total`; :func:`link_bytes`
    for the two-level pair). None when ``tx`` is not ``optax.MultiSteps`` or
    the bytes depend on data (the caller falls back to the stored count).
    """
    multi = getattr(tx.update, "__self__", tx)
    if not isinstance(multi, optax.MultiSteps) or not isinstance(state, optax.MultiStepsState):
        return None
    inner = optax.with_extra_args_support(multi.inner_opt)
    count = wire_bytes_total if count is None else count

    def wire(g, s, p, e):
        total = count(inner.update(g, s, p, **e)[1])
        return jnp.float32(0) if total is None else total

    try:
        closed = jax.make_jaxpr(wire)(grads, state.inner_opt_state, params, extra)
        return _constant_output(closed)
    except Exception:  # noqa: BLE001 (a best effort: the stored count is the fallback)
        return None


def _constant_output(closed):
    """The value of a jaxpr's output (a float; a tuple of them for several) if it
    depends on no input and no effect, else None."""
    literal = jax.extend.core.Literal
    jaxpr = closed.jaxpr
    outs = list(jaxpr.outvars)
    inputs = set(jaxpr.invars)
    needed, cone = {v for v in outs if not isinstance(v, literal)}, []
    for eqn in reversed(jaxpr.eqns):
        if not any(v in needed for v in eqn.outvars):
            continue
        if eqn.effects or any(v in inputs for v in eqn.invars if not isinstance(v, literal)):
            return None
        cone.append(eqn)
        needed.update(v for v in eqn.invars if not isinstance(v, literal))
    if needed & inputs:
        return None  # an output is an input itself
    env = dict(zip(jaxpr.constvars, closed.consts, strict=True))
    if any(isinstance(env.get(v), jax.core.Tracer) for v in needed):
        return None  # closed over the step's own values: not a constant
    # Evaluated now (we may be inside the step's trace): a few scalar operations.
    with jax.ensure_compile_time_eval():
        for eqn in reversed(cone):
            args = [v.val if isinstance(v, literal) else env[v] for v in eqn.invars]
            results = eqn.primitive.bind(*args, **eqn.params)
            results = results if eqn.primitive.multiple_results else [results]
            env.update(zip(eqn.outvars, results, strict=True))
    values = tuple(float(v.val if isinstance(v, literal) else env[v]) for v in outs)
    return values[0] if len(values) == 1 else values


def compress(tx, grads, state, params, extra, axis_name, who: str, *, update=None, probe=True):
    """One device's ``tx.update`` inside ``shard_map``, checked and counted.

    Before the update, raises if ``tx`` decides on this device's gradients
    whether to run an exchange (``optax.apply_if_finite`` around one: a
    device that skips it leaves the others waiting, the step hangs;
    :func:`jaxcomp.comm.local.check_no_local_branch_around_exchange`). The
    bytes are every ``wire_bytes`` field of the new state, under
    ``optax.MultiSteps`` those of one inner run on every mini-step that ran it
    (:func:`wire_bytes_total`, :func:`inner_run_wire_bytes`).

    Args:
      tx: the optimizer.
      grads, state, params: this device's gradients, optimizer state (its row,
        :func:`device_slice`) and the parameters ``tx`` sees.
      extra: extra keyword arguments of ``tx.update`` (a dict).
      axis_name: the data axis.
      who: the step the error names.
      update: the update function to run (default ``tx.update``; the FSDP and
        model-parallel step passes its per-shard one).
      probe: run the branch check and the ``MultiSteps`` count (the step turns
        them off on a mesh with model axes, where ``tx`` runs per model shard).

    Returns:
      ``(updates, new_state, wire)``, ``wire`` a float32 scalar, or None when
      nothing in the state reports bytes.

    Example:
      >>> import jax, jax.numpy as jnp, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.distributed.skeleton import compress, shard_step
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = jaxcomp.top_k(0.5, axis_name="data")
      >>> def step(g):
      ...     updates, _, wire = compress(tx, g, tx.init(g), None, {}, "data", "example")
      ...     return updates, wire
      >>> f = jax.jit(shard_step(step, mesh, P("data"), (P(), P())))
      >>> g = jax.device_put(jnp.array([1.0, -3.0]), jax.NamedSharding(mesh, P("data")))
      >>> updates, wire = f(g)
      >>> updates.tolist(), float(wire)  # the larger half; one device sends nothing
      ([0.0, -3.0], 0.0)
    """
    inner_run_bytes = None
    if probe:
        local_lib.check_no_local_branch_around_exchange(
            tx, grads, state, params, extra, axis_name, who
        )
        inner_run_bytes = inner_run_wire_bytes(tx, grads, state, params, extra)
    updates, state = (tx.update if update is None else update)(grads, state, params, **extra)
    return updates, state, wire_bytes_total(state, inner_run_bytes)


# --- mapped and jitted -----------------------------------------------------------------


def shard_step(
    per_device: Callable,
    mesh: Mesh,
    in_specs: Sequence,
    out_specs: Sequence,
    *,
    axis_names=None,
    communicate: bool = True,
) -> Callable:
    """``per_device`` mapped over ``mesh`` with ``jax.shard_map(..., check_vma=False)``.

    ``check_vma`` is off because an exchanged update is bit-identical on
    every device but computed from per-device state (typed varying); the
    builders check what it would guard when they are traced
    (:func:`check_unexchanged`). Specs: ``P()`` for what is replicated (the
    parameters, a key), ``P(axis_name)`` for what is per device (the stacked
    state, the batch).

    Args:
      per_device: one device's step.
      mesh: the device mesh.
      in_specs, out_specs: as ``jax.shard_map``'s.
      axis_names: the mesh axes the map is manual over (None: all; a mesh
        with model axes leaves those to XLA).
      communicate: ``False`` replaces every collective by a local stand-in of
        the same shapes (:func:`jaxcomp.comm.without_communication`), to time
        the step without its communication.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.distributed.skeleton import shard_step
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = shard_step(lambda w, s: (w + s[0], s + 1), mesh, (P(), P("data")), (P(), P("data")))
      >>> s = jax.device_put(jnp.ones((1, 2)), jax.NamedSharding(mesh, P("data")))
      >>> [x.tolist() for x in f(jnp.zeros(2), s)]
      [[1.0, 1.0], [[2.0, 2.0]]]
    """
    fn = per_device if communicate else local_lib.without_communication(per_device)
    manual = {} if axis_names is None else {"axis_names": axis_names}
    return jax.shard_map(
        fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False, **manual
    )


def jit_step(
    run: Callable,
    *,
    donate_argnums: Sequence[int] = (),
    arguments: Callable | None = None,
    results: Callable | None = None,
) -> Callable:
    """``run`` jitted with donation, as the step users call, with a ``.lower`` attribute.

    Args:
      run: the step's jitted body (its checks and its :func:`shard_step`).
      donate_argnums: the arguments of ``run`` donated to it.
      arguments: maps the user's arguments to ``run``'s (a tuple), checking
        them (None: passed through); its signature is the step's.
      results: maps ``run``'s outputs to what the step returns (None: as is).

    Returns:
      ``step(*args, **kwargs)``; ``step.lower(*args, **kwargs)`` returns the
      jitted step's ``jax.stages.Lowered`` (e.g. to read its compiled HLO).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.distributed.skeleton import jit_step
      >>> step = jit_step(lambda x, n: x * n, arguments=lambda x, n=2: (x, n))
      >>> float(step(jnp.float32(3.0))), "mul" in step.lower(jnp.float32(3.0)).as_text()
      (6.0, True)
    """
    jitted = jax.jit(run, donate_argnums=tuple(donate_argnums))

    def prepare(args, kwargs):
        return args if arguments is None else arguments(*args, **kwargs)

    def step(*args, **kwargs):
        out = jitted(*prepare(args, kwargs))
        return out if results is None else results(out)

    def lower(*args, **kwargs):
        return jitted.lower(*prepare(args, kwargs))

    if arguments is not None:
        step.__signature__ = inspect.signature(arguments)
    step.lower = lower
    return step
