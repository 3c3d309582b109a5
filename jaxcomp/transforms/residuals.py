"""Reading a compressor's error-feedback residual and per-leaf statistics out of any optax state."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxcomp.transforms.sparsify import DeferredSparsifyState, SparsifyState

__all__ = ["STATISTICS", "residuals", "statistics"]

# The per-leaf statistics of a sparsifier's state (SparsifyState).
STATISTICS = ("sent_count", "threshold", "search_iterations", "message_bytes")


def _holds_residual(node: Any) -> bool:
    fields = getattr(type(node), "_fields", None)
    return isinstance(node, DeferredSparsifyState) or (fields is not None and "residual" in fields)


def _residual_of(node: Any) -> Any:
    if isinstance(node, DeferredSparsifyState):
        return node.settled().accumulator  # defer_residual=True: the message cleared
    return node.residual


def residuals(opt_state: Any) -> Any:
    """The error-feedback residual of the one compressor in ``opt_state``.

    Works through any optax wrapper (``chain``, ``masked``,
    ``multi_transform``, ``MultiSteps``, ``inject_hyperparams``, ...) and on
    states stacked per device. It is the state's ``residual`` field (what
    ``optax.tree.get(opt_state, "residual")`` finds), except for a
    sparsifier with ``defer_residual=True``, whose
    :class:`jaxcomp.DeferredSparsifyState` keeps the accumulator and its last
    message's mask instead: this returns the accumulator with the message
    cleared, bit for bit the residual. 1-bit and 0/1 Adam's two-stage
    exchange keep a second memory, ``server_residual``, which this does not
    return (read it with ``optax.tree.get``).

    Args:
      opt_state: an optax state holding exactly one jaxcomp compressor state
        with error feedback.

    Returns:
      A pytree like the compressed gradients (``optax.MaskedNode`` at leaves
      an ``optax.masked`` left out).

    Raises:
      ValueError: when ``opt_state`` holds no error-feedback residual (none
        at all, or compressors without error feedback), or several (pass
        the part of the state that holds the one you want).

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.top_k(0.5, defer_residual=True), optax.sgd(1.0))
      >>> g = {"w": jnp.array([1.0, -3.0, 0.5, 2.0])}
      >>> u, state = tx.update(g, tx.init(g))
      >>> jaxcomp.residuals(state)["w"].tolist()
      [1.0, 0.0, 0.5, 0.0]
    """
    nodes = jax.tree.leaves(opt_state, is_leaf=_holds_residual)
    found = [r for n in nodes if _holds_residual(n) and (r := _residual_of(n)) is not None]
    if len(found) != 1:
        what = "no error-feedback residual" if not found else f"{len(found)} residuals"
        raise ValueError(
            f"jaxcomp.residuals: opt_state holds {what}; it takes a state with exactly one "
            "jaxcomp compressor with error feedback (pass the part of the state that holds "
            "the one you want)"
        )
    return found[0]


def _is_sparsifier(node: Any) -> bool:
    return isinstance(node, SparsifyState | DeferredSparsifyState)


def statistics(opt_state: Any) -> dict[str, Any]:
    """The last step's per-leaf statistics of the one sparsifier in ``opt_state``, leaf by leaf.

    A sparsifier keeps each statistic of :data:`STATISTICS` as one array with
    an entry per gradient leaf (:class:`jaxcomp.SparsifyState`: one output
    for all leaves is cheaper to compile and run than a scalar per leaf).
    This returns them as pytrees shaped like the gradients, one value per
    leaf (per device when the state is stacked per device: the leading
    axes). Works through any optax wrapper, like :func:`residuals`.

    Args:
      opt_state: an optax state holding exactly one :func:`jaxcomp.sparsify`
        state with per-leaf statistics (``granularity="layer"``, the
        default, or ``groups=``).

    Returns:
      ``{name: pytree}`` for the names of :data:`STATISTICS`
      (``optax.MaskedNode`` at leaves an ``optax.masked`` left out).

    Raises:
      ValueError: when ``opt_state`` holds no sparsifier state or several,
        or one with ``granularity="global"`` (one value for the whole tree:
        read the fields, e.g. ``optax.tree.get(opt_state, "sent_count")``).

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.top_k(0.5), optax.sgd(1.0))
      >>> g = {"a": jnp.array([1.0, -3.0, 0.5, 2.0]), "b": jnp.arange(6.0)}
      >>> _, state = tx.update(g, tx.init(g))
      >>> optax.tree.get(state, "sent_count").tolist()  # one entry per leaf
      [2, 3]
      >>> int(jaxcomp.statistics(state)["sent_count"]["a"])
      2
    """
    nodes = [n for n in jax.tree.leaves(opt_state, is_leaf=_is_sparsifier) if _is_sparsifier(n)]
    if len(nodes) != 1:
        raise ValueError(
            f"jaxcomp.statistics: opt_state holds {len(nodes)} sparsifier states; it takes a "
            "state with exactly one (pass the part of the state that holds the one you want)"
        )
    (node,) = nodes
    memory = node.accumulator if isinstance(node, DeferredSparsifyState) else node.residual
    leaves, treedef = jax.tree.flatten(memory)
    devices = np.ndim(node.step)  # a state stacked per device: leading axes
    if np.ndim(node.sent_count) != devices + 1:
        raise ValueError(
            "jaxcomp.statistics: this sparsifier has granularity='global', one value of each "
            "statistic for the whole tree: read the fields (optax.tree.get(opt_state, "
            "'sent_count'))"
        )
    return {
        name: treedef.unflatten([getattr(node, name)[..., i] for i in range(len(leaves))])
        for name in STATISTICS
    }
