"""Compressors on leaves sharded with explicit mesh axes (``jax.jit`` outside ``shard_map``).

With ``jax.make_mesh``'s default explicit axis types, an array's sharding is
part of its type, and operations a compressor needs on the whole leaf
(``lax.top_k``, slicing a sample, gathering at indices) raise
``ShardingTypeError`` on a leaf split over a mesh axis. A compressor called on
such leaves (e.g. in a GSPMD/FSDP program: the gradient there is already the
global mean, reduced by XLA) compresses each whole leaf, as on one device: the
leaf is resharded to replicated for the compressor, and its update and
per-element state (residual, velocity) go back to the leaf's sharding, bit
for bit the one-device result.

With auto axis types nothing is resharded: XLA partitions the compressor's
own computation over the mesh. Elementwise work and exact reductions
(counts, maxima, top-k's search on bit patterns) give the one-device bits,
but a float32 sum over the whole split leaf may be taken per shard and then
across shards: equal to the one-device sum up to float32 reassociation (for
``n`` values of one sign, both within a relative ``(n - 1) * 2**-24`` of the
exact sum; one ulp where seen). ``onebit`` and ``ef_sign_sgd`` without
``bucket_size`` (each scale a mean over the whole leaf) are such a case: the
signs are the same, each scale within that bound (tested for ``onebit``).
What depends on such a sum (a QSGD level, a threshold estimated from
moments) can then differ where a value sits at a boundary. Inside
``shard_map`` (manual axes) nothing is explicit and nothing changes.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

__all__ = ["explicit_specs", "replicate_explicit", "reshard_like", "whole_leaves"]


def _spec(x):
    sharding = getattr(jax.typeof(x), "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or all(e is None for e in spec):
        return None
    return spec


def _on_own_mesh(x, spec):
    """``spec`` on the mesh of ``x``'s own sharding: no ``jax.set_mesh`` context needed."""
    mesh = jax.typeof(x).sharding.mesh
    return jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, spec))


def explicit_specs(tree):
    """Per leaf, its explicit ``PartitionSpec`` if it is split over a mesh axis; None if none is.

    Returns None when no leaf of ``tree`` is explicitly split (the common case:
    nothing to do).
    """
    leaves, treedef = jax.tree.flatten(tree)
    specs = [_spec(x) for x in leaves]
    if all(s is None for s in specs):
        return None
    return treedef, specs


def replicate_explicit(tree):
    """``tree`` with every explicitly split leaf resharded to replicated."""

    def full(x):
        return x if _spec(x) is None else _on_own_mesh(x, P())

    return jax.tree.map(full, tree)


def reshard_like(tree, specs):
    """Reshards ``tree``'s leaves (same structure as ``specs``' tree) to those specs."""
    if specs is None or tree is None:
        return tree
    treedef, leaf_specs = specs
    leaves = treedef.flatten_up_to(tree)
    out = [x if s is None else _on_own_mesh(x, s) for x, s in zip(leaves, leaf_specs, strict=True)]
    return jax.tree.unflatten(treedef, out)


def whole_leaves(update_fn, fields=("residual", "velocity")):
    """``update_fn(updates, state, ...)`` compressing explicitly split leaves whole.

    Without explicitly split leaves this is ``update_fn``. Otherwise the
    leaves, the state and the other positional arguments go in replicated,
    and the updates and the state's per-element ``fields`` (pytrees like the
    updates) come back with the leaves' shardings.
    """

    def wrapped(updates, state, *args, **kwargs):
        specs = explicit_specs(updates)
        if specs is None:
            return update_fn(updates, state, *args, **kwargs)
        # The other positional arguments (the parameters, for weight decay and
        # LAMB's trust ratio) go in replicated too: they meet the whole leaves.
        new_updates, new_state = update_fn(
            replicate_explicit(updates),
            replicate_explicit(state),
            *(replicate_explicit(a) for a in args),
            **kwargs,
        )
        per_element = {
            f: reshard_like(getattr(new_state, f), specs)
            for f in fields
            if getattr(new_state, f, None) is not None
        }
        return reshard_like(new_updates, specs), new_state._replace(**per_element)

    return wrapped
