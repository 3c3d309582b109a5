"""Compression and exchange inside the backward pass (DLGS, ldte_bs paper §3.1).

After-backward compression waits for every gradient: each group's
compression and collective can only start when the backward pass is over.
Here the sparsifier runs *inside* the backward pass instead: each group of
parameters (one leaf, or a merged group from ``groups=``) passes through an
identity with a ``jax.custom_vjp`` whose backward rule compresses the group's
gradient and exchanges it. The identity is applied where the group's
parameters are first used: the loss is traced to a jaxpr and re-evaluated
equation by equation with the taps inserted (:func:`_eval_with_taps_at_first_use`),
so JAX's reverse pass emits the group's compression and collective right
after that layer's backward and before the lower layers' backward, with no
dependency on their gradients. A scheduler is then free to run the two at
once (XLA's latency-hiding scheduler on accelerators, with asynchronous
collectives). XLA:CPU (jax 0.10.2) runs collectives synchronously and its
scheduler moves them after the backward in the compiled module, so on CPU
this changes the program, not the time line.

The new compressor state cannot leave a backward rule except as a cotangent:
each group's residual (and velocity) is an argument of the differentiated
function whose "cotangent" is the new residual, and the group's statistics
travel in a small float32 carrier (integers as two exact 16-bit halves).
The step then calls ``tx.update`` as usual; the sparsifier recognises the
precomputed result (:class:`_Apply`) and returns it, and the rest of the chain
(``optax.sgd``, ...) runs on the exchanged updates.

The sparsifier is found by calling ``tx.update`` once in a *probe* mode that
stops when the sparsifier is reached (:class:`_Probe`); it must receive the
gradients unchanged (first in ``optax.chain``, not inside ``optax.masked``,
``optax.apply_if_finite`` or another transform that changes or branches on
them), otherwise a ``ValueError`` says so.

Floating point: the group's first compressor operation, ``residual +
gradient``, is now in the backward pass, where XLA fuses it with the
operation that produced the gradient. Where that is a multiply
(``nn.BatchNorm``'s scale gradient ends in ``rsqrt(var + eps) * sum(...)``),
LLVM contracted the two into one fused multiply-add at XLA:CPU's default
optimisation level: ``fl(r + a * b)`` instead of the ``fl(r + fl(a * b))`` of
a materialised gradient, 1 ulp apart, and with ``reuse_period=2`` a flipped
selection later (2e-2 in the parameters after 30 steps); momentum
correction's ``m * velocity + g`` likewise. The accumulation therefore
passes the gradient and ``m * velocity`` through an integer xor with a
run-time zero the compiler cannot see
(:func:`jaxcomp.transforms.sparsify._rounded`), in both paths: both are
rounded before they are added, and the overlap step is bit for bit
compress-after-backward's (tests/test_overlap.py, also compiled at XLA's
default level).

Used by :func:`jaxcomp.distributed.make_train_step` with ``overlap=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core as jex_core
import jax.numpy as jnp
from jax import lax

from jaxcomp import _validation as V
from jaxcomp._vma import axis_name_tuple
from jaxcomp.transforms.base import apply_nonfinite_policy
from jaxcomp.transforms.sparsify import (
    GroupOut,
    StepContext,
    check_updates,
    compress_group,
    finish_step,
    step_inputs,
)

__all__ = ["value_and_compressed_grad"]


class _Found(Exception):
    """Raised by the sparsifier in probe mode to stop ``tx.update`` early."""

    def __init__(self, cfg, state, include):
        super().__init__("jaxcomp overlap probe")
        self.cfg, self.state, self.include = cfg, state, include


def _same_leaves(a, b) -> bool:
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    return ta == tb and all(x is y for x, y in zip(la, lb, strict=True))


_NOT_FIRST = (
    "overlap=True runs the sparsifier inside the backward pass, so it must receive the "
    "gradients unchanged: put it first in optax.chain (optax.chain(jaxcomp.ldte_bs(...), "
    "optax.sgd(...))), not inside optax.masked, optax.multi_transform, an apply_if_finite "
    "or after a transform that changes the gradients (clipping, scaling)"
)


class _Probe:
    """``jaxcomp_overlap`` in probe mode: record the sparsifier and stop."""

    def __init__(self, grads):
        self.grads = grads
        self.trace = jex_core.get_opaque_trace_state()

    def visit(self, cfg, updates, state, include):
        if jex_core.get_opaque_trace_state() != self.trace:
            # Reached inside a lax.cond branch, a loop or another nested trace
            # (e.g. an apply_if_finite around the chain): whatever that wrapper
            # decides would come after the exchange already ran.
            raise ValueError(f"{_NOT_FIRST}; here it runs inside a nested trace (lax.cond, ...).")
        if not _same_leaves(updates, self.grads):
            raise ValueError(f"{_NOT_FIRST}; here it received other gradients.")
        check_updates(cfg, updates, state)
        raise _Found(cfg, state, include)


class _Apply:
    """``jaxcomp_overlap`` in apply mode: return the backward pass's result."""

    def __init__(self, updates, old_state, new_state):
        self.updates, self.old_state, self.new_state = updates, old_state, new_state
        self.used = False

    def visit(self, cfg, updates, state, include):
        del cfg, include
        if state is not self.old_state or not _same_leaves(updates, self.updates):
            raise ValueError(
                "overlap=True supports one jaxcomp sparsifier in tx, first in the chain; "
                "found a second compressor or one that receives changed gradients"
            )
        self.used = True
        return self.updates, self.new_state


def _check_overlap_config(cfg, axis_name) -> None:
    # ("data",) and "data" name the same axis: compare the normalised tuples.
    if cfg.axis_name is None or axis_name_tuple(cfg.axis_name) != axis_name_tuple(axis_name):
        raise ValueError(
            f"overlap=True needs the sparsifier's axis_name to be the step's axis "
            f"{axis_name!r} (it exchanges inside the backward pass), got {cfg.axis_name!r}"
        )
    if cfg.clip_norm is not None:
        raise ValueError(
            "overlap=True compresses each group of leaves in the backward pass as soon as its "
            "gradient is ready, so DGC's clipping by the norm of the whole gradient "
            f"(clip_norm={cfg.clip_norm!r}) cannot run there: leave clip_norm unset, or use "
            "overlap=False"
        )
    dynamic = [k for k, v in cfg.options.items() if V.is_dynamic(v)]
    if V.is_dynamic(cfg.momentum):
        dynamic.append("momentum")
    dynamic += [k for k, v in cfg.scaling._asdict().items() if V.is_dynamic(v)]
    if dynamic:
        raise ValueError(
            "overlap=True does not support injected (traced) hyperparameters yet "
            f"({', '.join(sorted(dynamic))}): pass them as Python numbers"
        )


def find_sparsifier(tx, grads, state, params, extra) -> _Found:
    """Runs ``tx.update`` in probe mode until the sparsifier; returns what it saw."""
    try:
        tx.update(grads, state, params, **extra, jaxcomp_overlap=_Probe(grads))
    except _Found as found:
        return found
    except TypeError as e:
        if "jaxcomp_overlap" not in str(e):
            raise
    raise ValueError(
        "overlap=True needs a jaxcomp sparsifier (jaxcomp.ldte_bs, top_k, dgc, ...) in tx, "
        f"first in optax.chain; none was found. {_NOT_FIRST}."
    )


# Layout of a group's statistics carrier (float32). An int32 field takes two
# slots, its high and low 16 bits as exact float32 values: bit-casting the
# int into one float32 would make small counts denormals, which XLA:CPU
# flushes to zero in any arithmetic on the carrier.
_HEAD = ("count", "threshold", "iterations", "message_bytes", "wire_bytes", "finite")
_INTS = {"count", "iterations", "message_bytes", "finite"}


def _int_halves(x) -> list:
    u = lax.bitcast_convert_type(jnp.asarray(x).astype(jnp.int32), jnp.uint32)
    return [(u >> 16).astype(jnp.float32), (u & 0xFFFF).astype(jnp.float32)]


def _from_halves(hi, lo):
    u = (hi.astype(jnp.uint32) << 16) | lo.astype(jnp.uint32)
    return lax.bitcast_convert_type(u, jnp.int32)


def _slots(name) -> int:
    return 2 if name in _INTS else 1


def _pack(o: GroupOut, finite) -> jax.Array:
    head = dict(
        count=o.count,
        threshold=o.threshold,
        iterations=o.iterations,
        message_bytes=o.message_bytes,
        wire_bytes=o.wire_bytes,
        finite=finite,
    )
    parts = []
    for name in _HEAD:
        if name in _INTS:
            parts += _int_halves(head[name])
        else:
            parts.append(jnp.asarray(head[name], jnp.float32))
    for value in (*o.leaf_counts, *o.leaf_bytes):
        parts += _int_halves(value)
    return jnp.stack(parts)


def _unpack(vec, updates, residuals, velocities):
    m = len(updates)
    pos, head = 0, {}
    for name in _HEAD:
        if name in _INTS:
            head[name] = _from_halves(vec[pos], vec[pos + 1])
        else:
            head[name] = vec[pos]
        pos += _slots(name)
    ints = [_from_halves(vec[pos + 2 * j], vec[pos + 2 * j + 1]) for j in range(2 * m)]
    counts, nbytes = ints[:m], ints[m:]
    out = GroupOut(
        updates=list(updates),
        residuals=list(residuals),
        velocities=None if velocities is None else list(velocities),
        count=head["count"],
        leaf_counts=jnp.stack(counts),
        threshold=head["threshold"],
        iterations=head["iterations"],
        message_bytes=head["message_bytes"],
        leaf_bytes=jnp.stack(nbytes),
        wire_bytes=head["wire_bytes"],
    )
    return out, head["finite"].astype(jnp.bool_)


def _group_tap(cfg, per_leaf: bool):
    """The identity on one group's parameters whose backward rule compresses the group.

    ``tap(leaves, residuals, velocities, stats, stored, key, step, include)``
    returns ``(leaves, token)``; its VJP returns, as the cotangents of
    ``leaves``, ``residuals``, ``velocities`` and ``stats``: the exchanged
    update, the new residuals and velocities and the group's packed
    statistics. ``token`` is a float32 zero the caller adds to the loss: it
    gives every tap a nonzero cotangent, so the backward rule runs even for
    parameters the loss does not use (JAX skips a rule whose outputs all have
    zero cotangents, which would return zeros as the new residual).
    """

    @jax.custom_vjp
    def tap(leaves, residuals, velocities, stats, stored, key, step, include):
        del residuals, velocities, stats, stored, key, step, include
        return leaves, jnp.zeros((), jnp.float32)

    def fwd(leaves, residuals, velocities, stats, stored, key, step, include):
        del stats
        return (leaves, jnp.zeros((), jnp.float32)), (
            residuals,
            velocities,
            stored,
            key,
            step,
            include,
        )

    def bwd(saved, cotangents):
        g_leaves, _ = cotangents
        residuals, velocities, stored, key, step, include = saved
        grads, finite, send_ok = apply_nonfinite_policy(list(g_leaves), cfg.nonfinite)
        ctx = StepContext(step, send_ok, include)
        o = compress_group(
            cfg,
            grads,
            list(residuals),
            None if velocities is None else list(velocities),
            stored,
            key,
            ctx,
            per_leaf=per_leaf,
        )
        new_v = None if o.velocities is None else tuple(o.velocities)
        return (
            tuple(o.updates),
            tuple(o.residuals),
            new_v,
            _pack(o, finite),
            None,
            None,
            None,
            None,
        )

    tap.defvjp(fwd, bwd)
    return tap


def _eval_with_taps_at_first_use(fn, leaves, args, kwargs, tap_leaf):
    """``fn(leaves, args, kwargs)``, each leaf replaced by ``tap_leaf(i, env)`` at its first use.

    ``fn`` is traced to a jaxpr and evaluated equation by equation; just before
    the first equation that reads parameter leaf ``i``, ``tap_leaf(i)`` is
    called and returns ``{leaf index: tapped value}`` for the leaves it taps
    (its whole group). In reverse mode each tap's backward rule then sits
    right after the backward of the layer that uses the parameters, before
    the lower layers' backward, instead of after the whole backward pass.
    Leaves never read are tapped after the last equation.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(leaves, args, kwargs)
    jaxpr = closed.jaxpr
    flat_in = jax.tree.leaves((leaves, args, kwargs))
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, closed.consts, strict=True):
        env[v] = c
    for v, x in zip(jaxpr.invars, flat_in, strict=True):
        env[v] = x
    leaf_var = list(jaxpr.invars[: len(leaves)])
    index_of = {v: i for i, v in enumerate(leaf_var)}
    done: set[int] = set()

    def tap_now(i):
        if i in done:
            return
        for j, value in tap_leaf(i).items():
            done.add(j)
            env[leaf_var[j]] = value

    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal) and v in index_of:
                tap_now(index_of[v])
        # As jax's own eval_jaxpr (jax 0.10): get_bind_params returns the params.
        with eqn.ctx.manager:
            outs = eqn.primitive.bind(
                *map(read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params)
            )
        if not eqn.primitive.multiple_results:
            outs = [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                env[v] = o
    for v in jaxpr.outvars:
        if not isinstance(v, jex_core.Literal) and v in index_of:
            tap_now(index_of[v])
    for i in range(len(leaves)):
        tap_now(i)
    return jax.tree.unflatten(jax.tree.structure(out_shape), [read(v) for v in jaxpr.outvars])


def _stats_size(members) -> int:
    return sum(_slots(name) for name in _HEAD) + 4 * len(members)


def value_and_compressed_grad(
    value_and_grad_fn: Callable, tx, axis_name
) -> Callable[..., tuple[Any, Any, Any]]:
    """Wraps a per-device ``value_and_grad`` so the sparsifier in ``tx`` runs in its backward.

    Args:
      value_and_grad_fn: ``value_and_grad_fn(fun)`` -> a function like
        ``jax.value_and_grad(fun, argnums=(0, 1))`` giving per-device
        gradients (see :func:`jaxcomp.distributed.per_device_value_and_grad`).
      tx: the optimizer; its sparsifier must be first in the chain.
      axis_name: the mesh axis of the step.

    Returns:
      ``f(loss_fn, params, opt_state, extra, *args, **kwargs) -> (value,
      updates, opt_state)``: the loss value (as ``value_and_grad`` returns
      it), and ``tx.update``'s result with the sparsifier's work done in the
      backward pass.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(1.0))
      >>> loss = lambda w, x: jnp.sum(w * x)
      >>> f = value_and_compressed_grad(lambda fun: jax.value_and_grad(fun, argnums=(0, 1)),
      ...                               tx, "data")
      >>> def step(w, x):
      ...     value, updates, _ = f(loss, w, tx.init(w), {}, x)
      ...     return value, updates
      >>> # check_vma=False, as in make_train_step: per-device gradients w.r.t. replicated w.
      >>> g = jax.jit(jax.shard_map(
      ...     step, mesh=mesh, in_specs=(P(), P()), out_specs=P(), check_vma=False))
      >>> value, updates = g(jnp.ones(2), jnp.array([1.0, -3.0]))
      >>> float(value), updates.tolist()  # gradient x; top-1 kept, times -1 by sgd(1.0)
      (-2.0, [-0.0, 3.0])
    """

    def run(loss_fn, params, opt_state, extra, *args, has_aux=False, **kwargs):
        found = find_sparsifier(tx, params, opt_state, params, extra)
        cfg, comp_state = found.cfg, found.state
        _check_overlap_config(cfg, axis_name)
        include = found.include
        if include is not None:
            include = jnp.asarray(include, jnp.bool_)
        inputs = step_inputs(cfg, params, comp_state)
        step = comp_state.step
        taps = [_group_tap(cfg, inputs.layout.per_leaf) for _ in inputs.groups]
        group_of = {i: g for g, gi in enumerate(inputs.groups) for i in gi.members}
        carriers = tuple(
            (
                tuple(gi.residuals),
                None if gi.velocities is None else tuple(gi.velocities),
                jnp.zeros((_stats_size(gi.members),), jnp.float32),
            )
            for gi in inputs.groups
        )

        def tapped_loss(params, carriers, *args, **kwargs):
            leaves = inputs.treedef.flatten_up_to(params)
            tokens = []

            def tap_leaf(i):
                g = group_of[i]
                gi, (res, vel, stats) = inputs.groups[g], carriers[g]
                tapped, token = taps[g](
                    tuple(leaves[m] for m in gi.members),
                    res,
                    vel,
                    stats,
                    gi.stored,
                    gi.key,
                    step,
                    include,
                )
                tokens.append(token)
                return dict(zip(gi.members, tapped, strict=True))

            def call(ls, a, kw):
                return loss_fn(inputs.treedef.unflatten(ls), *a, **kw)

            result = _eval_with_taps_at_first_use(call, leaves, args, kwargs, tap_leaf)
            value = result[0] if has_aux else result
            # + 0: the same loss (a -0.0 loss reads +0.0), a cotangent for every tap.
            value = value + sum(tokens, jnp.float32(0)).astype(jnp.result_type(value))
            return (value, result[1]) if has_aux else value

        value, (updates, carrier_cts) = value_and_grad_fn(tapped_loss)(
            params, carriers, *args, **kwargs
        )
        u_leaves = inputs.treedef.flatten_up_to(updates)
        outs, finites = [], []
        for gi, (res, vel, stats) in zip(inputs.groups, carrier_cts, strict=True):
            o, finite = _unpack(stats, [u_leaves[i] for i in gi.members], res, vel)
            outs.append(o)
            finites.append(finite)
        finite = functools.reduce(jnp.logical_and, finites, jnp.bool_(True))
        updates, new_comp_state = finish_step(cfg, comp_state, inputs, outs, finite)
        handle = _Apply(updates, comp_state, new_comp_state)
        updates, opt_state = tx.update(updates, opt_state, params, **extra, jaxcomp_overlap=handle)
        if not handle.used:  # pragma: no cover (the probe found it)
            raise ValueError(f"overlap=True: the sparsifier was not reached again. {_NOT_FIRST}.")
        return value, updates, opt_state

    return run
