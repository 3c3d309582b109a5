"""Device-variance typing helpers for code that runs inside ``shard_map``.

With ``check_vma=True`` (the default) JAX types every value inside
``shard_map`` as device-invariant or device-varying along mesh axes. Loop
carries and ``lax.switch`` branch outputs must keep one type, so constants
that meet per-device data have to be cast to varying first.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["varying_axes", "varying_like"]


def varying_axes(x) -> frozenset:
    """Mesh axes along which ``x`` is typed device-varying (empty outside shard_map)."""
    aval = jax.typeof(x)
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
