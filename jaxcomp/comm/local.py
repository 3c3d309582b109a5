"""A function's collectives replaced by local stand-ins of the same shapes.

Used to measure how much of a training step's time is *exposed*
communication: time the step as it is, then time
``without_communication(step)`` (the same program with every collective
replaced by a local operation producing the same shapes and dtypes, as if every
device had received what it sent itself) and take the difference. The
compression, the decoding of ``N`` messages and everything else stay in the
program; only the transfer between devices (and its synchronisation) is gone.

Stand-ins, for ``N`` devices along the collective's axes (the values are what
the collective would return if every device held this device's input):

==============================  ===============================================
collective                      local stand-in
==============================  ===============================================
``psum`` (``pmean``'s sum)      ``N * x``
``pmax``, ``pmin``, ``ppermute``  ``x``
``pbroadcast``                  ``x``
``all_gather``                  ``N`` copies of ``x`` stacked (or tiled)
``psum_scatter``                ``N *`` this device's chunk of ``x``
``all_to_all``                  ``N`` copies of this device's chunk of ``x``
==============================  ===============================================

Each stand-in's result goes through ``lax.optimization_barrier`` so that XLA
cannot fold it into what follows (e.g. sum ``N`` identical copies as a
product): the stand-in costs what materialising its result costs, like the
receive buffer of the collective it replaces.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core

__all__ = ["COLLECTIVES", "communicates", "without_communication"]

# Primitives that name a mesh axis but move no data between devices.
_LOCAL = frozenset({"axis_index", "pvary"})


def _axes_size(names) -> int:
    names = names if isinstance(names, tuple | list) else (names,)
    return math.prod(lax.axis_size(n) for n in names if isinstance(n, str))


def _psum(xs, params):
    n = _axes_size(params["axes"])
    return [x * jnp.asarray(n, x.dtype) for x in xs]


def _identity(xs, params):
    return list(xs)


def _all_gather(xs, params):
    (x,) = xs
    n, d = params["axis_size"], params["all_gather_dimension"]
    if params["tiled"]:
        return [jnp.concatenate([x] * n, axis=d)]
    return [jnp.broadcast_to(jnp.expand_dims(x, d), (*x.shape[:d], n, *x.shape[d:]))]


def _own_chunk(x, axis_name, n: int, d: int, keepdims: bool):
    """This device's chunk (of ``n``) of ``x`` along ``d``, as a scatter gives it."""
    size = x.shape[d] // n
    start = lax.axis_index(axis_name) * size
    chunk = lax.dynamic_slice_in_dim(x, start, size, axis=d)
    return chunk if keepdims else lax.squeeze(chunk, (d,))


def _reduce_scatter(xs, params):
    (x,) = xs
    n, d = params["axis_size"], params["scatter_dimension"]
    chunk = _own_chunk(x, params["axis_name"], n, d, keepdims=params["tiled"])
    return [chunk * jnp.asarray(n, x.dtype)]


def _all_to_all(xs, params):
    (x,) = xs
    n = _axes_size(params["axis_name"])
    chunk = _own_chunk(x, params["axis_name"], n, params["split_axis"], keepdims=True)
    return [jnp.concatenate([chunk] * n, axis=params["concat_axis"])]


# Collective primitive name -> its local stand-in ``(operands, params) -> outputs``.
COLLECTIVES: dict[str, Callable] = {
    "psum": _psum,
    "psum_invariant": _psum,
    "pmax": _identity,
    "pmin": _identity,
    "ppermute": _identity,
    "pbroadcast": _identity,
    "all_gather": _all_gather,
    "all_gather_invariant": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "all_to_all": _all_to_all,
}


def _names_axis(eqn) -> bool:
    """Whether ``eqn`` is a collective (a primitive naming a mesh axis)."""
    for key in ("axis_name", "axes"):
        value = eqn.params.get(key)
        values = value if isinstance(value, tuple | list | frozenset | set) else (value,)
        if any(isinstance(v, str) for v in values):
            return True
    return False


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jex_core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jex_core.Jaxpr):
                yield item


def _communicates(jaxpr, cache) -> bool:
    key = id(jaxpr)
    if key not in cache:
        cache[key] = any(
            (_names_axis(e) and e.primitive.name not in _LOCAL)
            or any(_communicates(j, cache) for j in _sub_jaxprs(e))
            for e in jaxpr.eqns
        )
    return cache[key]


def communicates(jaxpr) -> bool:
    """Whether ``jaxpr`` (a ``Jaxpr`` or ``ClosedJaxpr``) moves data between devices.

    True when it holds a collective over a mesh axis (``psum``, ``all_gather``,
    ``ppermute``, ...), also inside nested ``jit``, ``cond``, ``while_loop``,
    ``scan`` and custom-derivative calls; ``axis_index`` does not count.

    Example:
      >>> import jax
      >>> from jax.sharding import PartitionSpec as P
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> communicates(jax.make_jaxpr(lambda x: x * 2)(1.0))
      False
      >>> f = jax.jit(jax.shard_map(
      ...     lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P(), out_specs=P()))
      >>> communicates(jax.make_jaxpr(f)(1.0))
      True
    """
    return _communicates(getattr(jaxpr, "jaxpr", jaxpr), {})


def _eval_closed(closed, cache, *args):
    return _eval(closed.jaxpr, closed.consts, cache, *args)


def _higher_order(eqn, ins, cache):
    """Re-runs a control-flow or call primitive whose body communicates."""
    name, p = eqn.primitive.name, eqn.params
    if name in ("jit", "pjit", "closed_call", "core_call"):
        return _eval_closed(p.get("jaxpr", p.get("call_jaxpr")), cache, *ins)
    if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
        # Only the primal runs here (the program is already differentiated).
        closed = p.get("call_jaxpr", p.get("fun_jaxpr"))
        return _eval_closed(closed, cache, *ins)
    if name == "cond":
        index, *ops = ins
        branches = [functools.partial(_eval_closed, b, cache) for b in p["branches"]]
        return lax.switch(index, branches, *ops)
    if name == "while":
        nc, nb = p["cond_nconsts"], p["body_nconsts"]
        cond_consts, body_consts, init = ins[:nc], ins[nc : nc + nb], ins[nc + nb :]
        return lax.while_loop(
            lambda carry: _eval_closed(p["cond_jaxpr"], cache, *cond_consts, *carry)[0],
            lambda carry: _eval_closed(p["body_jaxpr"], cache, *body_consts, *carry),
            list(init),
        )
    if name == "scan":
        nc, ncarry = p["num_consts"], p["num_carry"]
        consts, init, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]

        def body(carry, x):
            out = _eval_closed(p["jaxpr"], cache, *consts, *carry, *x)
            return out[:ncarry], out[ncarry:]

        carry, ys = lax.scan(body, list(init), list(xs), length=p["length"], reverse=p["reverse"])
        return [*carry, *ys]
    if name == "shard_map":
        # A nested map (jaxcomp's per-model-shard compressor): same map, rewritten body.
        return jax.shard_map(
            lambda *args: tuple(_eval(p["jaxpr"], (), cache, *args)),
            mesh=p["mesh"],
            in_specs=p["in_specs"],
            out_specs=p["out_specs"],
            axis_names=p["newly_manual_axes"],
            check_vma=p["check_vma"],
        )(*ins)
    raise ValueError(
        f"without_communication: cannot replace the collectives inside a {name!r} "
        "primitive; supported around collectives: jit, cond, while_loop, scan, "
        "shard_map, custom_jvp/custom_vjp calls"
    )


def _eval(jaxpr, consts, cache, *args):
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = c
    for v, x in zip(jaxpr.invars, args, strict=True):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        with eqn.ctx.manager:
            if name in COLLECTIVES:
                if any(getattr(v.aval, "vma", None) for v in eqn.invars if hasattr(v, "aval")):
                    raise ValueError(
                        "without_communication needs shard_map(..., check_vma=False): a "
                        "local stand-in cannot produce the device-invariant type a "
                        f"{name!r} returns under check_vma=True"
                    )
                outs = lax.optimization_barrier(COLLECTIVES[name](ins, eqn.params))
            elif _names_axis(eqn) and name not in _LOCAL:
                raise ValueError(
                    f"without_communication: no local stand-in for the collective {name!r}; "
                    f"supported: {', '.join(sorted(COLLECTIVES))}"
                )
            elif any(_communicates(j, cache) for j in _sub_jaxprs(eqn)):
                outs = _higher_order(eqn, ins, cache)
            else:
                # As jax's own eval_jaxpr (jax 0.10): get_bind_params returns the params.
                outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs, strict=True):
            if not isinstance(v, jex_core.DropVar):
                if tuple(jnp.shape(o)) != tuple(v.aval.shape):
                    raise AssertionError(f"{name}: stand-in shape {jnp.shape(o)} != {v.aval}")
                env[v] = o
    return [read(v) for v in jaxpr.outvars]


def without_communication(fn: Callable) -> Callable:
    """``fn`` with its collectives replaced by local stand-ins of the same shapes.

    Call the result where ``fn`` would be called: inside ``jax.shard_map``
    (with ``check_vma=False``, as jaxcomp's train steps run). ``fn`` is traced
    to a jaxpr and re-evaluated with every collective (``psum``/``pmean``,
    ``all_gather``, ``ppermute``, ``psum_scatter``, ``all_to_all``, ...)
    replaced by a local operation of the same output shapes (see the module
    docstring), also inside ``jit``, ``cond``, ``while_loop`` and ``scan``.
    Timing the result against ``fn`` measures the communication ``fn``
    exposes; the results are not the exchanged values (each device sees its
    own input ``N`` times).

    Args:
      fn: a function of arrays that uses collectives over mesh axes.

    Returns:
      A function with the same signature and output shapes.

    Raises:
      ValueError: (when called) for a collective without a local stand-in, a
        collective inside another higher-order primitive, or ``check_vma=True``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.comm import without_communication
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> mean = lambda x: jax.lax.pmean(x, "data")
      >>> f = jax.jit(jax.shard_map(without_communication(mean), mesh=mesh,
      ...             in_specs=P(), out_specs=P(), check_vma=False))
      >>> f(jnp.arange(3.0)).tolist()
      [0.0, 1.0, 2.0]
    """

    @functools.wraps(fn)
    def local(*args, **kwargs):
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(*args, **kwargs)
        flat = jax.tree.leaves((args, kwargs))
        outs = _eval(closed.jaxpr, closed.consts, {}, *flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return local


# Collectives whose result is the same on every device along the axis they name.
_UNIFORM_COLLECTIVES = frozenset(
    {"psum", "psum_invariant", "pmax", "pmin", "all_gather", "all_gather_invariant"}
)


def _names(value) -> set:
    return set(value) if isinstance(value, tuple | list | frozenset | set) else {value}


def _branch_taint(jaxpr, taint, axis_name) -> tuple[bool, list[bool]]:
    """Device-dependence of ``jaxpr``'s outputs, and whether it branches on it around a collective.

    ``taint[i]``: input ``i`` may differ between the devices along
    ``axis_name``. Returns ``(bad, out_taint)``: ``bad`` when a ``cond`` (or a
    ``while`` loop's condition) decided on such values wraps a collective,
    where one device could leave the collective the others wait in.
    """
    tainted = {v for v, t in zip(jaxpr.invars, taint, strict=True) if t}
    is_var = lambda v: not isinstance(v, jax.extend.core.Literal)  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [is_var(v) and v in tainted for v in eqn.invars]
        name, params = eqn.primitive.name, eqn.params
        subs = [getattr(j, "jaxpr", j) for j in _sub_jaxprs(eqn)]
        bad, outs = False, None
        if name == "cond":
            branches = [b.jaxpr for b in params["branches"]]
            bad = ins[0] and any(_communicates(b, {}) for b in branches)
            results = [_branch_taint(b, ins[1:], axis_name) for b in branches]
            bad = bad or any(r[0] for r in results)
            outs = [ins[0] or any(t) for t in zip(*(r[1] for r in results), strict=True)]
        elif name == "while":
            nc, nb = params["cond_nconsts"], params["body_nconsts"]
            cond, body = params["cond_jaxpr"].jaxpr, params["body_jaxpr"].jaxpr
            carry = ins[nc + nb :]
            while True:  # the carries' taint to a fixed point
                body_bad, new = _branch_taint(body, ins[nc : nc + nb] + carry, axis_name)
                new = [a or b for a, b in zip(carry, new, strict=True)]
                if new == carry:
                    break
                carry = new
            cond_bad, (pred,) = _branch_taint(cond, ins[:nc] + carry, axis_name)
            bad = body_bad or cond_bad or (pred and _communicates(body, {}))
            outs = carry
        elif len(subs) == 1 and len(subs[0].invars) == len(ins):
            bad, outs = _branch_taint(subs[0], ins, axis_name)  # jit, custom_jvp, ...
            outs = outs if len(outs) == len(eqn.outvars) else None
        else:
            bad = any(_branch_taint(j, [any(ins)] * len(j.invars), axis_name)[0] for j in subs)
        if bad:
            return True, []
        if outs is None:
            varies = any(ins) or name in ("axis_index", "ppermute")
            if name in _UNIFORM_COLLECTIVES and _names(axis_name) <= _names(
                params.get("axes", params.get("axis_name"))
            ):
                varies = False
            outs = [varies] * len(eqn.outvars)
        tainted.update(v for v, t in zip(eqn.outvars, outs, strict=True) if t)
    return False, [is_var(v) and v in tainted for v in jaxpr.outvars]


def check_no_local_branch_around_exchange(tx, grads, state, params, extra, axis_name, who):
    """Raises if ``tx`` decides on this device's gradients whether to run a collective.

    ``optax.apply_if_finite`` (or ``jaxcomp.apply_if_finite`` without
    ``axis_name``) around an exchange sends a device with a NaN gradient down
    the branch without it while its neighbours wait there: the step hangs
    (XLA:CPU aborts the process). Only the gradients and extra arguments
    count as device-dependent here: state counters (``optax.MultiSteps``'s
    mini-step) are equal on every device.
    """
    closed = jax.make_jaxpr(lambda g, e: tx.update(g, state, params, **e))(grads, extra)
    taint = [True] * len(closed.jaxpr.invars)
    if _branch_taint(closed.jaxpr, taint, axis_name)[0]:
        raise ValueError(
            f"{who}: tx decides on this device's own gradients whether to run an exchange "
            "(optax.apply_if_finite, jaxcomp.apply_if_finite without axis_name, or "
            "optax.MultiSteps with should_skip_update_fn=optax.skip_not_finite around a "
            "gossip or averaging exchange): a non-finite gradient on one device would skip "
            "its exchange while its neighbours wait in it (the step hangs; XLA:CPU aborts). "
            f"Use jaxcomp.apply_if_finite(tx, max_consecutive_errors, axis_name={axis_name!r}) "
            f"or jaxcomp.distributed.skip_not_finite({axis_name!r}), which decide on all "
            "devices together."
        )
