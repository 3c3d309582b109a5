"""Device-variance typing helpers for code that runs inside ``shard_map``.

With ``check_vma=True`` (the default) JAX types every value inside
``shard_map`` as device-invariant or device-varying along mesh axes. Loop
carries and ``lax.switch`` branch outputs must keep one type, so constants
that meet per-device data have to be cast to varying first.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys

import jax
import jax.numpy as jnp
from jax import lax

__all__ = [
    "ProbeError",
    "check_not_in_local_branch",
    "check_per_device",
    "cond",
    "device_identical",
    "local_branch",
    "probing",
    "probing_now",
    "varying_axes",
    "varying_like",
    "vma_checked",
]


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` is typed device-varying (empty outside shard_map)."""
    aval = x if isinstance(x, jax.core.ShapedArray) else jax.typeof(x)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", None) or ())  # older jax


def varying_like(tree, ref):
    """Casts ``tree``'s leaves to be device-varying along every axis ``ref`` varies on."""
    axes = varying_axes(ref)
    if not axes:
        return tree

    def cast(v):
        v = jnp.asarray(v)
        missing = tuple(sorted(axes - varying_axes(v)))
        return lax.pcast(v, missing, to="varying") if missing else v

    return jax.tree.map(cast, tree)


def axis_name_tuple(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def vma_checked(axis_name) -> bool:
    """Whether ``shard_map`` tracks device variance for ``axis_name`` here.

    ``lax.axis_index`` is device-varying by construction, so it is typed
    varying exactly when the enclosing ``shard_map`` runs with
    ``check_vma=True``; with ``check_vma=False`` (or outside any mapped axis)
    nothing is typed and nothing can be checked.
    """
    try:
        names = axis_name_tuple(axis_name)
        return all(name in varying_axes(lax.axis_index(name)) for name in names)
    except NameError:  # the axis is not bound: not inside shard_map/pmap
        return False


def check_per_device(grads, axis_name, who: str) -> None:
    """Raises if a gradient leaf is typed device-invariant along ``axis_name``.

    Inside ``jax.shard_map`` with ``check_vma=True``, ``jax.grad`` w.r.t.
    replicated parameters returns gradients already summed over the axis (the
    transpose of the implicit ``pvary``), typed device-invariant. A compressor
    that exchanges over ``axis_name`` would then compress ``N`` times the mean
    and average it again: a silent wrong result. With ``check_vma=False`` the
    types are not tracked and this cannot be seen.
    """
    if axis_name is None:
        return
    check_not_in_local_branch(axis_name, who)
    if _PROBING.get() or not vma_checked(axis_name):
        return
    names = set(axis_name_tuple(axis_name))
    leaves = jax.tree_util.tree_flatten_with_path(grads)[0]
    for path, leaf in leaves:
        if not names <= varying_axes(leaf):
            raise ValueError(
                f"{who}: gradient leaf {jax.tree_util.keystr(path) or '<root>'} is typed "
                f"device-invariant along {axis_name!r} inside shard_map: jax.grad w.r.t. "
                "replicated parameters returns gradients already summed over the devices, so "
                "the compressor would compress N times the mean gradient. Take gradients "
                "with jaxcomp.distributed.per_device_grad (or per_device_value_and_grad), "
                "which casts the parameters to device-varying first. If the gradients really "
                "are identical on every device there is nothing to exchange: use "
                "axis_name=None. (optax.MultiSteps around the compressor also does this: it "
                "traces the compressor on its zero accumulator, typed invariant; in a "
                "hand-written shard_map use check_vma=False there, as make_train_step does.)"
            )


# Set by jaxcomp.apply_if_finite(axis_name=None) while it traces its inner
# transformation inside its per-device lax.cond.
_LOCAL_BRANCH = contextvars.ContextVar("jaxcomp_vma_local_branch", default=False)


@contextlib.contextmanager
def _flag_set(flag: contextvars.ContextVar):
    """``flag`` set to True for the ``with`` block (tracing is synchronous)."""
    token = flag.set(True)
    try:
        yield
    finally:
        flag.reset(token)


def local_branch():
    """Marks tracing inside a ``lax.cond`` whose predicate is this device's own."""
    return _flag_set(_LOCAL_BRANCH)


def _axis_bound(axis_name) -> bool:
    try:
        for name in axis_name_tuple(axis_name):
            lax.axis_size(name)
    except NameError:
        return False
    return True


def _local_branch_wrapper(axis_name) -> str | None:
    """The wrapper (if any) that traces this exchange in a per-device branch.

    Found on the Python stack at trace time: ``optax.apply_if_finite`` (its
    ``do_update`` branch) and ``optax.MultiSteps`` whose skip decision is
    typed device-varying, or is ``optax.skip_not_finite`` where the types are
    not tracked. Tracing is synchronous, so the frames of the wrapper that is
    tracing the branch are on the stack.
    """
    if _LOCAL_BRANCH.get():
        return "jaxcomp.apply_if_finite without axis_name"
    import optax  # noqa: PLC0415 (only at trace time)

    names = set(axis_name_tuple(axis_name))
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("optax"):
            qualname = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
            if qualname.startswith("apply_if_finite.") and qualname.endswith(".do_update"):
                return "optax.apply_if_finite"
            if qualname == "MultiSteps.update":
                skip = frame.f_locals.get("should_skip_update")
                owner = frame.f_locals.get("self")
                varying = skip is not None and bool(names & varying_axes(skip))
                per_device = getattr(owner, "_should_skip_update_fn", None) is (
                    optax.skip_not_finite
                )
                if varying or per_device:
                    return "optax.MultiSteps with a per-device should_skip_update_fn"
        frame = frame.f_back
    return None


def check_not_in_local_branch(axis_name, who: str) -> None:
    """Raises if this exchange is traced in a branch each device picks on its own.

    ``optax.apply_if_finite`` around an exchanging compressor decides with a
    ``lax.cond`` on *this device's* gradients: a NaN on one device sends it
    past the collective while the others wait in it, and the step hangs
    (XLA:CPU aborts the process after a minute with a rendezvous dump that
    names no NaN; with ``check_vma=True`` JAX instead prints kilobytes of
    branch types). Refused when the compressor is traced, naming the wrapper
    that decides on all devices together.
    """
    if not _axis_bound(axis_name):
        return  # not under shard_map: the collective's own error says so
    wrapper = _local_branch_wrapper(axis_name)
    if wrapper is None:
        return
    raise ProbeError(
        f"{who} exchanges over {axis_name!r} inside {wrapper}, which decides with a "
        "lax.cond on this device's own gradients: a non-finite gradient on one device would "
        "skip its exchange while the others wait in it (the step hangs; XLA:CPU aborts the "
        "process). Use jaxcomp.apply_if_finite(tx, max_consecutive_errors, "
        f"axis_name={axis_name!r}) (or jaxcomp.distributed.skip_not_finite({axis_name!r}) "
        "for optax.MultiSteps), which decide on all devices together; the compressor's own "
        "nonfinite='skip' (the default) already never hangs."
    )


# Set while make_train_step traces tx on fresh (invariant) state to find the
# leaves it exchanges: wrappers may then legitimately hand the compressor
# invariant zeros (optax.MultiSteps evaluates shapes on its accumulator).
_PROBING = contextvars.ContextVar("jaxcomp_vma_probing", default=False)


def probing():
    """Marks make_train_step's probe (see :data:`_PROBING`)."""
    return _flag_set(_PROBING)


class ProbeError(ValueError):
    """A configuration that ``make_train_step``'s probe rejects, raised as it is.

    Other exceptions while probing are wrapped in a message about tracing
    under ``check_vma``; these already say what is wrong and what to use.
    """


def probing_now() -> bool:
    """Whether ``make_train_step``'s probe is tracing (see :func:`probing`)."""
    return _PROBING.get()


def device_identical(x, axis_name):
    """``x``, equal on every device along ``axis_name`` by construction, typed so for the probe.

    A ``ppermute``'s output is typed device-varying even when every device
    ends with the same value (gTop-k's recursive doubling, SparCML's merged
    union). ``make_train_step``'s probe reads that type to find the update
    leaves ``tx`` averages, and would take such a leaf for an unexchanged one
    (and average its gradient densely before ``tx``). While probing (tracing
    only: nothing runs) ``x`` is therefore typed invariant with a ``pmax``.
    JAX has no free cast from varying to invariant, so outside the probe ``x``
    comes back as it is: a ``shard_map`` with ``check_vma=True`` needs out
    specs that allow a device-varying value for it (or ``check_vma=False``).
    """
    if not probing_now():
        return x
    axes = tuple(a for a in axis_name_tuple(axis_name) if a in varying_axes(x))
    return lax.pmax(x, axes) if axes else x


def cond(pred, true_fun, false_fun, *operands):
    """``lax.cond`` whose branch outputs are cast to a common device variance.

    Under ``shard_map(check_vma=True)`` both branches must return the same
    varying/invariant types; a branch that returns the old state (typed as it
    came in) and one that returns a new state computed from per-device data
    do not. Each branch is traced once more to read its output types, then
    outputs are cast to varying along the union of both branches' axes.
    """
    outs = [jax.make_jaxpr(f)(*operands).out_avals for f in (true_fun, false_fun)]
    axes = [varying_axes(a) | varying_axes(b) for a, b in zip(*outs, strict=True)]

    def matched(f):
        def run(*ops):
            leaves, treedef = jax.tree.flatten(f(*ops))
            cast = []
            for leaf, want in zip(leaves, axes, strict=True):
                missing = tuple(sorted(want - varying_axes(leaf)))
                cast.append(lax.pcast(leaf, missing, to="varying") if missing else leaf)
            return treedef.unflatten(cast)

        return run

    return lax.cond(pred, matched(true_fun), matched(false_fun), *operands)
