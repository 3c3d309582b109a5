"""Accordion: per-layer adaptive compression in critical learning regimes.

Accordion (Agarwal et al., MLSys 2021, "Adaptive Gradient Communication via
Critical Learning Regime Identification"; reference code
https://github.com/uw-mad-dash/Accordion, ``auto_scale.py``) switches each
layer between two levels of one compressor: a *low* compression level (top-k
ratio 0.99, PowerSGD rank 4: many bytes) while the layer is in a critical
regime, a *high* one (ratio 0.1, rank 1) otherwise. Every ``interval`` steps,
for each layer ``l``:

    G_l(j)   = || sum of the layer's gradients over interval j ||_2
    critical = j == 0  or  G_l(j-1) == 0  or  not (|G_l(j-1) - G_l(j)| / G_l(j-1) < eta)
    level_l  = low  if critical  else  high          (for interval j + 1)

and the first interval runs at the low level (the reference's ``epoch == 0``
rule). ``eta`` is the paper's 0.5. A NaN norm counts as critical (the safe
side: more bytes).

Which gradient: the reference decides on rank 0's local uncompressed
gradient and broadcasts the decision. Here ``G_l`` is the norm of the sum of
the *aggregated* updates the wrapper returned over the interval (the mean of
the devices' messages): identical on every device, so every device takes the
same decision without a collective. With error feedback this sum is the
interval's sum of mean gradients up to the change of the mean residual.

How it runs (one compilation for all steps): both levels are compiled into
one program, two instances of the inner compressor. A leaf's gradient goes to
the instance of its level and the other instance gets zeros; the
error-feedback memory lives in the wrapper (``AccordionState.residual``) and
is handed, whole, to the active instance every step (the inactive one gets a
zero residual, so it sends nothing and keeps nothing). Hence across a switch
``sent + new residual == old residual + g`` holds exactly as for the inner
compressor: nothing is lost. The same hand-over applies to a momentum
velocity (``velocity``: DGC's momentum correction). State specific to a level
(PowerSGD's warm-started ``Q``) stays with its instance.

Bytes: ``message_bytes`` is, per leaf, what the active level's message
holds; ``wire_bytes`` is what the static-shape exchanges carry: both
instances run their collectives every step, each with its fixed capacity, so
the wire carries the low level's capacity plus the high level's capacity
whatever the levels. The difference is the price of static shapes and of
wrapping any compressor unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax import lax

from jaxcomp import _validation as V

__all__ = ["AccordionState", "accordion"]

# Inner-state fields the wrapper moves out of the instances (residual) or
# reads from them (bytes); hidden from ``optax.tree.get`` so that the
# wrapper's own fields are the only ones of these names.
_HOISTED = ("residual", "wire_bytes", "message_bytes", "sent_count")


class AccordionState(NamedTuple):
    """State of :func:`accordion`.

    Per-leaf arrays have one entry per gradient leaf in ``jax.tree.leaves``
    order (shape ``(num_leaves,)``), as :class:`jaxcomp.SparsifyState`'s.

    Attributes:
      step: int32, number of updates so far.
      level: int32 per leaf, the level of the next step: 0 the low
        compression level (critical regime), 1 the high one.
      setting: float32 per leaf, the ratio or rank of ``level``.
      accumulated: float32 pytree like the gradients, the sum of this
        interval's updates so far.
      previous_norm: float32 per leaf, the norm of the last finished
        interval's sum (0 before the first one ends).
      residual: the error-feedback memory, a pytree like the gradients (None
        when the inner compressor has none).
      inner: the two instances' states (low level, high level) as a flat
        tuple of arrays, without their residual and byte fields.
      message_bytes: int32 per leaf, bytes of the last step's message at the
        level that was active.
      sent_count: int32 per leaf, elements sent at the active level (a
        sparsifier's ``sent_count``), or None when the inner compressor has
        no such statistic (PowerSGD).
      wire_bytes: float32, bytes this device put on the wire in the last
        step: both instances' exchanges (static capacities).
      nonfinite_steps: int32, steps whose gradients held NaN or Inf (both
        instances see them: the inactive one gets ``g * 0``).
    """

    step: jax.Array
    level: jax.Array
    setting: jax.Array
    accumulated: Any
    previous_norm: jax.Array
    residual: Any
    inner: tuple
    message_bytes: jax.Array
    sent_count: jax.Array | None
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


def _resolve_factory(compressor) -> Callable[..., optax.GradientTransformation]:
    if isinstance(compressor, str):
        from jaxcomp import transforms  # the package imports this module: late

        factory = getattr(transforms, compressor, None)
        if not callable(factory):
            raise ValueError(f"compressor must be a jaxcomp factory name, got {compressor!r}")
        return factory
    if not callable(compressor):
        raise ValueError(f"compressor must be a callable factory or its name, got {compressor!r}")
    return compressor


def _level_argument(factory) -> str:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    for name in ("ratio", "rank"):
        if name in params:
            return name
    raise ValueError(
        "compressor must take a 'ratio' (a sparsifier) or a 'rank' (PowerSGD), got "
        f"{getattr(factory, '__name__', factory)!r}"
    )


def _check_level(name: str, value, argument: str):
    if argument == "ratio":
        return V.check_ratio(name, value)
    return V.check_int(name, value, 1)


def _strip(state):
    """``state`` without its hoisted fields (None there)."""
    present = {f: None for f in _HOISTED if optax.tree.get_all_with_path(state, f)}
    return optax.tree.set(state, **present) if present else state


def _field(state, name):
    """The one field ``name`` of ``state``, None when absent."""
    return optax.tree.get(state, name)


def _per_leaf(tree, num_leaves: int, dtype) -> jax.Array:
    """A per-leaf statistic as one ``(num_leaves,)`` array (from an array or a scalar per leaf)."""
    if tree is None:
        return jnp.zeros((num_leaves,), dtype)
    leaves = jax.tree.leaves(tree)
    if len(leaves) == 1 and jnp.ndim(leaves[0]) == 1 and leaves[0].shape[0] == num_leaves:
        return jnp.asarray(leaves[0], dtype)
    if len(leaves) == num_leaves and all(jnp.ndim(x) == 0 for x in leaves):
        return (
            jnp.stack([jnp.asarray(x, dtype) for x in leaves]) if leaves else jnp.zeros((0,), dtype)
        )
    # One value for the whole tree (granularity="global"): spread evenly.
    total = sum(jnp.sum(jnp.asarray(x, jnp.float32)) for x in leaves)
    return jnp.full((num_leaves,), total / max(num_leaves, 1)).astype(dtype)


def _split(tree, low_leaf: list, treedef, *, poison: bool = False):
    """``tree`` (None allowed) split into (at the low level, at the high level) by leaf.

    With ``poison``, a leaf's other instance gets ``x * 0`` instead of zeros: 0
    where ``x`` is finite, NaN where it is not, so that both instances see a
    non-finite gradient whenever the tree holds one and apply the inner
    compressor's non-finite policy to the same step (``"skip"``: neither sends).
    """
    if tree is None:
        return None, None
    leaves = treedef.flatten_up_to(tree)
    zero = [x * 0 if poison else jnp.zeros_like(x) for x in leaves]
    low = [jnp.where(c, x, z) for c, x, z in zip(low_leaf, leaves, zero, strict=True)]
    high = [jnp.where(c, z, x) for c, x, z in zip(low_leaf, leaves, zero, strict=True)]
    return treedef.unflatten(low), treedef.unflatten(high)


def _nonfinite_steps(low, high, previous):
    counts = [c for s in (low, high) if (c := _field(s, "nonfinite_steps")) is not None]
    if not counts:
        return previous
    return jnp.maximum(*counts) if len(counts) == 2 else counts[0]


def _join(a, b):
    """Leafwise ``a + b`` (one of the two is zero at every leaf)."""
    if a is None:
        return None
    return jax.tree.map(jnp.add, a, b)


def accordion(
    compressor: str | Callable[..., optax.GradientTransformation],
    low: float,
    high: float,
    *,
    interval: int,
    eta: float = 0.5,
    **compressor_kwargs: Any,
) -> optax.GradientTransformationExtraArgs:
    """Accordion's per-layer switch between a low and a high compression level.

    Every ``interval`` steps each leaf's level is chosen from the relative
    change of the norm of its summed updates over the last two intervals
    (module docstring): critical (``>= eta``) -> ``low``, else ``high``. The
    first interval, and the one after it, run at ``low``.

    Args:
      compressor: a jaxcomp factory with a ``ratio`` (``jaxcomp.top_k``, any
        sparsifier) or a ``rank`` (``jaxcomp.powersgd``), or its name.
      low: the low compression level (critical regime): the larger ratio
        (e.g. 0.99) or rank (e.g. 4).
      high: the high compression level: a ratio in ``(0, low)`` or a rank in
        ``[1, low)``.
      interval: int >= 1, steps per decision (the paper: an epoch, or ten).
      eta: float > 0, the relative change of the norm that marks a critical
        regime (the paper's 0.5).
      **compressor_kwargs: the inner compressor's other arguments
        (``axis_name=``, ``seed=``, ...), given to both levels.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is
      :class:`AccordionState`.

    Raises:
      ValueError: on a bad argument, naming it and its range.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = jaxcomp.accordion(jaxcomp.top_k, low=0.5, high=0.25, interval=2)
      >>> g = {"w": jnp.arange(1.0, 9.0)}
      >>> state = tx.init(g)
      >>> for scale in (1.0, 1.0, 1.0, 1.0, 1.1, 1.1):  # steady norms: not critical
      ...     u, state = tx.update({"w": scale * g["w"]}, state)
      >>> state.level.tolist(), optax.tree.get(state, "setting").tolist()
      ([1], [0.25])
      >>> int(state.message_bytes[0])  # 2 of 8 elements as (int32 index, float32 value)
      16
    """
    factory = _resolve_factory(compressor)
    argument = _level_argument(factory)
    low = _check_level("low", low, argument)
    high = _check_level("high", high, argument)
    if not high < low:
        raise ValueError(
            f"high must compress more than low: a {argument} below low={low!r}, got {high!r}"
        )
    interval = V.check_int("interval", interval, 1)
    eta = V.check_real("eta", eta, 0.0, low_open=True)
    if argument in compressor_kwargs:
        raise ValueError(f"{argument} is set by low and high, got {argument}= as well")
    axis = compressor_kwargs.get("axis_name")
    if isinstance(axis, (tuple, list)) and len(axis) > 1:
        # A two-level exchange wraps each instance's state in a TwoLevelState
        # whose byte and non-finite fields the wrapper does not combine.
        raise ValueError(
            f"axis_name must be one mesh axis for jaxcomp.accordion, got {axis!r} "
            "(the two-level exchange is not supported)"
        )
    txs = (
        factory(**{argument: low}, **compressor_kwargs),
        factory(**{argument: high}, **compressor_kwargs),
    )
    settings = jnp.asarray((low, high), jnp.float32)

    def init_fn(params):
        treedef = jax.tree.structure(params)
        num_leaves = treedef.num_leaves
        states = tuple(tx.init(params) for tx in txs)
        residual = _field(states[0], "residual")
        sent = _field(states[0], "sent_count")
        inner = tuple(jax.tree.leaves(tuple(_strip(s) for s in states)))
        return AccordionState(
            step=jnp.zeros((), jnp.int32),
            level=jnp.zeros((num_leaves,), jnp.int32),
            setting=jnp.full((num_leaves,), low, jnp.float32),
            accumulated=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params),
            previous_norm=jnp.zeros((num_leaves,), jnp.float32),
            residual=residual,
            inner=inner,
            message_bytes=jnp.zeros((num_leaves,), jnp.int32),
            sent_count=None if sent is None else jnp.zeros((num_leaves,), jnp.int32),
            wire_bytes=jnp.zeros((), jnp.float32),
            nonfinite_steps=jnp.zeros((), jnp.int32),
        )

    def update_fn(updates, state, params=None, **extra_args):
        V.check_state_type(state, AccordionState, "jaxcomp.accordion")
        treedef = jax.tree.structure(updates)
        num_leaves = treedef.num_leaves
        # The instances' state structure, from their init (traced only: no work).
        shapes = jax.eval_shape(lambda u: tuple(_strip(tx.init(u)) for tx in txs), updates)
        states = jax.tree.structure(shapes).unflatten(state.inner)
        low_leaf = [state.level[i] == 0 for i in range(num_leaves)]
        g_low, g_high = _split(updates, low_leaf, treedef, poison=True)
        r_low, r_high = _split(state.residual, low_leaf, treedef)
        states = [
            optax.tree.set(s, residual=r) if r is not None else s
            for s, r in zip(states, (r_low, r_high), strict=True)
        ]
        velocity = _field(states[0], "velocity")
        if velocity is not None:  # DGC's momentum: handed over as the residual
            v = _join(velocity, _field(states[1], "velocity"))
            v_low, v_high = _split(v, low_leaf, jax.tree.structure(v))
            states = [
                optax.tree.set(s, velocity=x) for s, x in zip(states, (v_low, v_high), strict=True)
            ]
        out_low, s_low = txs[0].update(g_low, states[0], params, **extra_args)
        out_high, s_high = txs[1].update(g_high, states[1], params, **extra_args)
        new_updates = _join(out_low, out_high)
        residual = _join(_field(s_low, "residual"), _field(s_high, "residual"))
        message = jnp.where(
            state.level == 0,
            _per_leaf(_field(s_low, "message_bytes"), num_leaves, jnp.int32),
            _per_leaf(_field(s_high, "message_bytes"), num_leaves, jnp.int32),
        )
        sent = _field(s_low, "sent_count")
        if sent is not None:
            sent = jnp.where(
                state.level == 0,
                _per_leaf(sent, num_leaves, jnp.int32),
                _per_leaf(_field(s_high, "sent_count"), num_leaves, jnp.int32),
            )
        wire = sum(
            jnp.sum(jnp.asarray(w, jnp.float32))
            for s in (s_low, s_high)
            if (w := _field(s, "wire_bytes")) is not None
        )
        wire = jnp.asarray(wire, jnp.float32)

        # Accordion's decision, at the end of every interval (one cond for the tree).
        step = state.step + 1
        accumulated = jax.tree.map(
            lambda a, u: a + u.astype(jnp.float32), state.accumulated, new_updates
        )
        boundary = step % interval == 0

        def decide(operand):
            acc, previous = operand
            leaves = jax.tree.leaves(acc)
            norms = (
                jnp.stack([jnp.sqrt(jnp.sum(jnp.square(a))) for a in leaves])
                if leaves
                else previous
            )
            change = jnp.abs(previous - norms) / jnp.where(previous == 0, 1.0, previous)
            first = step == interval
            critical = first | (previous == 0) | ~(change < eta)
            zeroed = jax.tree.map(jnp.zeros_like, acc)
            return zeroed, norms.astype(jnp.float32), jnp.where(critical, 0, 1).astype(jnp.int32)

        def keep(operand):
            acc, previous = operand
            return acc, previous, state.level

        accumulated, previous, level = lax.cond(
            boundary, decide, keep, (accumulated, state.previous_norm)
        )
        inner = tuple(jax.tree.leaves((_strip(s_low), _strip(s_high))))
        new_state = AccordionState(
            step=step,
            level=level,
            setting=settings[level],
            accumulated=accumulated,
            previous_norm=previous,
            residual=residual,
            inner=inner,
            message_bytes=message,
            sent_count=sent,
            wire_bytes=wire,
            nonfinite_steps=_nonfinite_steps(s_low, s_high, state.nonfinite_steps),
        )
        return new_updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
