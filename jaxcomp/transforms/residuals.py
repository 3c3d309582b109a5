"""Reading the error-feedback residual out of any optax state."""

from __future__ import annotations

from typing import Any

import jax

from jaxcomp.transforms.sparsify import DeferredSparsifyState

__all__ = ["residuals"]


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
