"""Aggregation modes (docs/algorithms.md section 6): full, partial (gossip) and ensemble.

**Full aggregation, weighted.** :func:`weighted_exchange` is an exchange like
:func:`jaxcomp.dense_exchange` that returns ``sum_i w_i g_i / sum_i w_i``
over the devices, with this device's weight ``w_i`` passed per step
(``tx.update(grads, state, params, weight=w)``; under
:func:`jaxcomp.distributed.make_train_step`,
``update_args={"weight": array of shape (N,)}``) or fixed at construction.
With ``w_i`` = the local batch size and local losses that are means over the
local batch, the result is the gradient of the mean loss over the union of
the local batches. :func:`scale_by_weight` gives any compressor the same
weighting: put it before the compressor, it scales each device's gradient by
``N w_i / sum_j w_j`` so that the compressor's mean is the weighted mean.

**Partial aggregation, gossip.** :func:`gossip_exchange` (dense) and the
compressors' ``exchange="gossip"`` give each device the ring mix of its own
and its two ring neighbours' (decoded) messages, different on every device
(decentralized, D-PSGD). Such updates cannot drive replicated parameters:
:func:`make_gossip_train_step` keeps one parameter replica per device
(stacked along a leading axis, sharded ``P("data")``) and, D-PSGD style,
also mixes the replicas with the ring neighbours every step,
``x_i <- sum_j W_ij x_j - update_i``. ``make_train_step`` rejects gossip
exchanges (a ``ValueError`` pointing here). Backup workers (the other
partial mode) are the ``include`` argument of the averaging exchanges.

**Ensemble aggregation.** :func:`make_ensemble_train_step` trains ``K = N``
models at once, one per device of the mesh, each on its own data shard and
without any exchange (:func:`member_batches` deals the disjoint shards);
:func:`average_predictions` (mean of the members' softmax probabilities) and
:func:`majority_vote` combine them, and :func:`evaluate_ensemble` reports
each member's accuracy and the ensemble's.

Example (two devices' worth of weighting on one device: the weight cancels):
  >>> import jax, jax.numpy as jnp
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxcomp import aggregation
  >>> tx = aggregation.weighted_exchange("data")
  >>> mesh = jax.make_mesh((1,), ("data",))
  >>> f = jax.jit(jax.shard_map(lambda g, w: tx.update(g, tx.init(g), weight=w[0])[0],
  ...                           mesh=mesh, in_specs=P("data"), out_specs=P()))
  >>> s = jax.NamedSharding(mesh, P("data"))
  >>> f(jax.device_put(jnp.ones(2), s), jax.device_put(jnp.array([3.0]), s)).tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp._vma import check_per_device
from jaxcomp.comm import collectives
from jaxcomp.comm import local as local_lib
from jaxcomp.comm.collectives import GOSSIP_WEIGHTS
from jaxcomp.distributed.skeleton import compress, device_slice, device_stack, jit_step, shard_step
from jaxcomp.ensemble import (  # noqa: F401 (re-exported: their home was this module)
    ENSEMBLE_METHODS,
    EnsembleReport,
    average_predictions,
    disjoint_shards,
    ensemble_predict,
    evaluate_ensemble,
    majority_vote,
    member_batches,
    member_logits,
)

__all__ = [
    "ENSEMBLE_METHODS",
    "GOSSIP_WEIGHTS",
    "EnsembleReport",
    "GossipExchangeState",
    "ScaleByWeightState",
    "WeightedExchangeState",
    "average_predictions",
    "consensus_distance",
    "disjoint_shards",
    "ensemble_predict",
    "evaluate_ensemble",
    "gossip_exchange",
    "init_replica_opt_state",
    "majority_vote",
    "make_ensemble_train_step",
    "make_gossip_train_step",
    "member_batches",
    "member_logits",
    "scale_by_weight",
    "stack_replicas",
    "weighted_exchange",
]

# --- full aggregation, weighted ---------------------------------------------------


def _check_weights(weights) -> tuple[float, ...] | None:
    """Fixed per-device weights: a non-empty sequence of finite numbers >= 0, not all 0."""
    if weights is None:
        return None
    bad = ValueError(
        "weights must be None or a sequence of N finite numbers >= 0 (one per device "
        f"along the axis), not all 0, got {weights!r}"
    )
    if isinstance(weights, (str, bytes)) or np.ndim(weights) != 1:
        raise bad
    try:
        values = tuple(V.check_real("weights", w, 0.0) for w in weights)
    except (TypeError, ValueError):
        raise bad from None
    if not values or max(values) <= 0:
        raise bad
    # Normalised here in float64, by the largest first (no overflow of the sum):
    # weights like 1e-40 (0 in float32) or 3e38 + 3e38 (inf) keep their ratios.
    top = max(values)
    scaled = [v / top for v in values]
    total = math.fsum(scaled)
    return tuple(v / total for v in scaled)


def _weight_dtype(tree):
    """The widest floating dtype of ``tree``'s leaves, at least float32 (float64 under x64)."""
    dtype = jnp.dtype(jnp.float32)
    for leaf in jax.tree.leaves(tree):
        if jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
            dtype = jnp.promote_types(dtype, jnp.result_type(leaf))
    return dtype


def _device_weight(fixed, weight, include, axis_name, who: str, dtype) -> jax.Array:
    """This device's weight in ``dtype`` (0 for a left-out backup worker)."""
    n_dev = collectives.axis_size(axis_name)
    if fixed is not None:
        if weight is not None:
            raise ValueError(
                f"{who}: weights were fixed at construction; do not also pass weight= per step"
            )
        if len(fixed) != n_dev:
            raise ValueError(
                f"{who}: weights has {len(fixed)} entries but axis {axis_name!r} has "
                f"{n_dev} devices; give one weight per device"
            )
        w = jnp.asarray(fixed, dtype)[lax.axis_index(axis_name)]
    else:
        if weight is None:
            raise ValueError(
                f"{who}: no weight. Pass this device's weight per step "
                "(tx.update(grads, state, params, weight=w); with make_train_step, "
                "update_args={'weight': array of shape (N,)}) or weights= at construction"
            )
        w = jnp.asarray(weight).astype(dtype)
        if w.shape != ():
            raise ValueError(
                f"{who}: weight must be this device's scalar weight, got shape {w.shape} "
                "(make_train_step's update_args={'weight': w} takes w of shape (N,) and "
                "hands each device its entry)"
            )
    if include is not None:
        w = jnp.where(jnp.asarray(include, jnp.bool_), w, 0.0)
    return w


def _normalized_weight(w, axis_name) -> tuple[jax.Array, float]:
    """``(w / sum_d w_d, bytes)``: 0 when every weight is 0, NaN when any is < 0 or not finite.

    A bad per-step weight cannot raise inside jit; NaN makes the step visibly
    wrong (every device's update) instead of silently mis-weighted.
    """
    bad = ~jnp.isfinite(w) | (w < 0)
    n_dev = collectives.axis_size(axis_name)
    w = jnp.where(bad, 0.0, w)
    # Two sums in the one all-reduce: of the weights, and of the weights
    # scaled by a power of two >= N (exact), used only when N large finite
    # weights overflow the first; unscaled, small weights (2e-38) do not
    # become subnormal (flushed to 0 on XLA:CPU) on the way.
    scaled = w * jnp.asarray(2.0 ** -math.ceil(math.log2(n_dev)), w.dtype)
    total, total_scaled, n_bad = lax.psum((w, scaled, bad.astype(w.dtype)), axis_name)
    overflow = ~jnp.isfinite(total)
    w, total = jnp.where(overflow, scaled, w), jnp.where(overflow, total_scaled, total)
    coef = jnp.where(total > 0, w / jnp.where(total > 0, total, 1.0), 0.0)
    coef = jnp.where(n_bad > 0, jnp.asarray(jnp.nan, w.dtype), coef)
    return coef, collectives.allreduce_bytes(3 * w.dtype.itemsize, n_dev)


def _scaled(g, coef):
    """``coef * g`` in ``g``'s dtype (computed at least in float32); exactly 0 where coef is 0.

    A weight-0 device (say an empty local batch, whose mean loss is 0/0)
    contributes nothing even if its gradient is not finite.
    """
    g = jnp.asarray(g)
    wide = jnp.promote_types(g.dtype, jnp.float32)
    out = coef.astype(wide) * g.astype(wide)
    return jnp.where(coef == 0, jnp.zeros((), wide), out).astype(g.dtype)


class WeightedExchangeState(NamedTuple):
    """State of :func:`weighted_exchange`: ``wire_bytes`` of the last step (float32)."""

    wire_bytes: jax.Array


def weighted_exchange(
    axis_name, weights: Sequence[float] | None = None
) -> optax.GradientTransformationExtraArgs:
    """Full aggregation, weighted: ``sum_i w_i g_i / sum_i w_i`` over the devices (dense).

    Put it where a compressor would go (``optax.chain(weighted_exchange("data"),
    optax.sgd(0.1))``). Each device's weight is either fixed here
    (``weights``, one per device along the axis) or passed per step as the
    ``weight`` extra argument, a scalar (``tx.update(grads, state, params,
    weight=w)``; :func:`jaxcomp.distributed.make_train_step` takes
    ``update_args={"weight": w}`` with ``w`` of shape ``(N,)`` and hands each
    device its entry). With the local batch sizes as weights and local losses
    that are means over the local batch, the result is the gradient of the
    mean loss over the union batch: ``sum_i b_i (1/b_i) sum_{r in i} g_r /
    sum_i b_i``.

    Devices with weight 0 contribute exactly nothing (even a non-finite
    gradient); when every weight is 0 the update is 0. A negative or
    non-finite per-step weight on any device makes every device's update NaN
    (it cannot raise inside jit; fixed weights are checked here). The
    optional ``include`` extra argument (backup workers) sets a left-out
    device's weight to 0.

    Weights are normalised in the gradients' widest floating dtype (at least
    float32; float64 for float64 gradients under x64); fixed ``weights`` are
    first normalised in float64 here, so tiny or huge ones (``1e-40``,
    ``3e38``) keep their ratios.

    Cost: one all-reduce of the weighted gradients (one multi-operand ``psum``
    for all leaves, in the gradients' dtypes) and one of three scalars in the
    weights' dtype (the weight sum, unscaled and scaled against overflow, and
    a bad-weight count): ``wire_bytes``
    reports both, as a ring all-reduce's ``2 (N - 1) / N`` times their bytes.

    Args:
      axis_name: the mesh axis to aggregate over.
      weights: None (pass ``weight=`` per step) or ``N`` finite numbers >= 0,
        not all 0, device ``i``'s weight at index ``i``.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with
      :class:`WeightedExchangeState`. Its ``update`` raises a ``ValueError``
      when neither or both of ``weights`` and ``weight=`` are given, or when
      ``len(weights)`` is not the axis size.

    Raises:
      ValueError: bad ``weights``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.aggregation import weighted_exchange
      >>> tx = weighted_exchange("data", weights=[2.0])
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> f(jax.device_put(jnp.array([1.0, 3.0]), jax.NamedSharding(mesh, P("data")))).tolist()
      [1.0, 3.0]
    """
    fixed = _check_weights(weights)
    who = "jaxcomp.aggregation.weighted_exchange"

    def init(params):
        del params
        return WeightedExchangeState(wire_bytes=jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, *, weight=None, include=None, **extra_args):
        del state, params, extra_args
        check_per_device(updates, axis_name, who)
        w = _device_weight(fixed, weight, include, axis_name, who, _weight_dtype(updates))
        coef, wire = _normalized_weight(w, axis_name)
        leaves, treedef = jax.tree.flatten(updates)
        # One multi-operand all-reduce for every leaf: one rendezvous, not one per leaf.
        sums = lax.psum([_scaled(g, coef) for g in leaves], axis_name) if leaves else []
        n_dev = collectives.axis_size(axis_name)
        nbytes = sum(g.size * jnp.dtype(g.dtype).itemsize for g in leaves)
        wire = jnp.float32(wire + collectives.allreduce_bytes(nbytes, n_dev))
        return treedef.unflatten(list(sums)), WeightedExchangeState(wire_bytes=wire)

    return optax.GradientTransformationExtraArgs(init, update)


class ScaleByWeightState(NamedTuple):
    """State of :func:`scale_by_weight`: ``wire_bytes`` of its scalar all-reduce (float32)."""

    wire_bytes: jax.Array


def scale_by_weight(
    axis_name, weights: Sequence[float] | None = None
) -> optax.GradientTransformationExtraArgs:
    """Scales this device's gradient by ``N w_i / sum_j w_j``: weighted means from any exchange.

    Chained before an exchange that averages (a compressor with
    ``axis_name``, :func:`jaxcomp.dense_exchange`), the average becomes the
    weighted average: ``(1/N) sum_i N w_i / W g_i = sum_i w_i g_i / W``. The
    compressors' error feedback then works in these scaled units: what a
    device's residual keeps is its share of future weighted means, and
    nothing is lost (``sum_i residual_i + N * update == sum_i N w_i / W g_i``
    plus the residuals carried in). Weights as in :func:`weighted_exchange`
    (fixed ``weights`` or the ``weight`` extra argument; ``include``; all 0:
    zero gradients; a bad per-step weight: NaN; their dtype). Costs one
    all-reduce of three scalars.

    With an exchange that does not average (``exchange="gossip"``) the
    scaling still holds per message but the result is a weighted ring mix,
    not the weighted mean.

    Args:
      axis_name: the mesh axis the following exchange averages over.
      weights: None (pass ``weight=`` per step) or one number >= 0 per device.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`ScaleByWeightState`.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.aggregation import scale_by_weight
      >>> tx = optax.chain(scale_by_weight("data", weights=[5.0]),
      ...                  jaxcomp.top_k(1.0, axis_name="data"))
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.jit(jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                           in_specs=P("data"), out_specs=P()))
      >>> f(jax.device_put(jnp.array([1.0, 3.0]), jax.NamedSharding(mesh, P("data")))).tolist()
      [1.0, 3.0]
    """
    fixed = _check_weights(weights)
    who = "jaxcomp.aggregation.scale_by_weight"

    def init(params):
        del params
        return ScaleByWeightState(wire_bytes=jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, *, weight=None, include=None, **extra_args):
        del state, params, extra_args
        check_per_device(updates, axis_name, who)
        w = _device_weight(fixed, weight, include, axis_name, who, _weight_dtype(updates))
        coef, wire = _normalized_weight(w, axis_name)
        coef = coef * jnp.asarray(collectives.axis_size(axis_name), coef.dtype)
        scaled = jax.tree.map(lambda g: _scaled(g, coef), updates)
        return scaled, ScaleByWeightState(wire_bytes=jnp.float32(wire))

    return optax.GradientTransformationExtraArgs(init, update)


# --- partial aggregation: gossip ---------------------------------------------------


def _by_dtype(leaves) -> dict:
    """Leaf indices grouped by dtype (each group travels as one flat buffer)."""
    groups: dict = {}
    for i, leaf in enumerate(leaves):
        groups.setdefault(jnp.dtype(leaf.dtype), []).append(i)
    return groups


def _gossip_tree(tree, axis_name, weights) -> tuple[Any, jax.Array]:
    """Ring mix of every leaf of ``tree``: one flat buffer (two ``ppermute`` calls) per dtype."""
    leaves, treedef = jax.tree.flatten(tree)
    leaves = [jnp.asarray(x) for x in leaves]
    out = list(leaves)
    wire = jnp.float32(0)
    for dtype, idx in _by_dtype(leaves).items():
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"gossip mixing needs floating-point leaves, got {dtype} (weights of 1/3 "
                "would round to 0)"
            )
        flat = jnp.concatenate([leaves[i].reshape(-1) for i in idx])
        mixed, nbytes = collectives.gossip_mean(flat, axis_name, weights=weights)
        wire = wire + nbytes
        ends = np.cumsum([leaves[i].size for i in idx])[:-1].tolist()
        for i, part in zip(idx, jnp.split(mixed, ends), strict=True):
            out[i] = part.reshape(leaves[i].shape)
    return treedef.unflatten(out), wire


class GossipExchangeState(NamedTuple):
    """State of :func:`gossip_exchange`: ``wire_bytes`` of the last step (float32)."""

    wire_bytes: jax.Array


def gossip_exchange(
    axis_name, weights: Sequence[float] = GOSSIP_WEIGHTS
) -> optax.GradientTransformationExtraArgs:
    """Partial aggregation by gossip: this device's ring mix of the gradients (dense).

    ``u_i = w_self g_i + w_left g_{i-1} + w_right g_{i+1}`` (indices mod
    ``N`` along the axis), the uncompressed counterpart of the compressors'
    ``exchange="gossip"``. Updates differ per device: train with
    :func:`make_gossip_train_step` (``make_train_step`` rejects it). Leaves
    of one dtype travel as one buffer: two ``ppermute`` calls per dtype;
    ``wire_bytes`` is ``2 B``, ``B`` the gradients' bytes.

    Args:
      axis_name: the mesh axis whose order is the ring.
      weights: ``(w_self, w_left, w_right)``, non-negative, summing to 1.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`GossipExchangeState`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jax.sharding import PartitionSpec as P
      >>> from jaxcomp.aggregation import gossip_exchange
      >>> tx = gossip_exchange("data")
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> f = jax.shard_map(lambda g: tx.update(g, tx.init(g))[0], mesh=mesh,
      ...                   in_specs=P("data"), out_specs=P("data"))
      >>> f(jax.device_put(jnp.array([1.0, 3.0]), jax.NamedSharding(mesh, P("data")))).tolist()
      [1.0, 3.0]
    """
    weights = collectives.check_gossip_weights(weights)

    def init(params):
        del params
        return GossipExchangeState(wire_bytes=jnp.zeros([], jnp.float32))

    def update(updates, state, params=None, *, include=None, **extra_args):
        del state, params, extra_args
        if include is not None:
            raise ValueError(
                "jaxcomp.aggregation.gossip_exchange does not take include= (backup workers)"
            )
        check_per_device(updates, axis_name, "jaxcomp.aggregation.gossip_exchange")
        mixed, wire = _gossip_tree(updates, axis_name, weights)
        return mixed, GossipExchangeState(wire_bytes=wire)

    return optax.GradientTransformationExtraArgs(init, update)


def stack_replicas(params, mesh: Mesh, axis_name="data", *, per_device: bool = False):
    """One parameter replica per device: leaves ``(N, *shape)`` sharded along ``axis_name``.

    The layout of :func:`make_gossip_train_step` and
    :func:`make_ensemble_train_step`. Every process must pass the same values.

    Args:
      params: the parameters; copied to every device, or with ``per_device``
        already stacked with a leading axis of size ``N`` (e.g. different
        initialisations, ``jax.vmap(model.init)(keys, x)``).
      mesh: the device mesh.
      axis_name: the axis the replicas are spread over.
      per_device: whether ``params`` already has the leading device axis.

    Returns:
      The stacked replicas (global arrays).

    Raises:
      ValueError: with ``per_device``, a leaf whose leading axis is not ``N``.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp.aggregation import stack_replicas
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> stack_replicas({"w": jnp.ones(3)}, mesh)["w"].shape
      (1, 3)
    """
    per_device = V.check_bool("per_device", per_device)
    n_dev = mesh.shape[axis_name]
    sharding = NamedSharding(mesh, P(axis_name))

    def place(x):
        x = np.asarray(x)
        if per_device:
            if x.ndim == 0 or x.shape[0] != n_dev:
                raise ValueError(
                    f"stack_replicas(per_device=True): every leaf needs a leading axis of "
                    f"{n_dev} (the devices along {axis_name!r}), got shape {x.shape}"
                )
            full = x
        else:
            full = np.broadcast_to(x[None], (n_dev, *x.shape))
        return jax.make_array_from_callback(full.shape, sharding, lambda idx: full[idx])

    return jax.tree.map(place, params)


def init_replica_opt_state(
    tx: optax.GradientTransformation, replicas, mesh: Mesh, axis_name="data"
):
    """Per-device optimizer state for per-device parameters (``tx.init`` of each replica).

    Like :func:`jaxcomp.distributed.init_opt_state`, stacked along a leading
    device axis sharded over ``axis_name``, but each device initialises from
    its own replica (from :func:`stack_replicas`).

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> from jaxcomp.aggregation import init_replica_opt_state, stack_replicas
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> reps = stack_replicas(jnp.zeros(3), mesh)
      >>> state = init_replica_opt_state(optax.adam(0.1), reps, mesh)
      >>> state[0].mu.shape
      (1, 3)
    """

    def init(reps):
        return device_stack(tx.init(device_slice(reps)))

    return jax.jit(shard_step(init, mesh, P(axis_name), P(axis_name)))(replicas)


def _make_replica_step(
    loss_fn, tx, mesh, axis_name, *, mix_weights, has_aux, donate, independent, who
) -> Callable:
    """The per-device-parameter step shared by the gossip and ensemble steps."""
    has_aux = V.check_bool("has_aux", has_aux)
    donate = V.check_bool("donate", donate)
    cfg = _ReplicaStepConfig(
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        mix_weights=mix_weights,
        has_aux=has_aux,
        independent=independent,
        who=who,
        value_and_grad=jax.value_and_grad(loss_fn, has_aux=has_aux),
    )
    return jit_step(
        functools.partial(_replica_run, cfg),
        donate_argnums=(0, 1) if donate else (),
        arguments=_replica_arguments,
        results=functools.partial(_replica_results, cfg),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class _ReplicaStepConfig:
    """The validated static options of one gossip or ensemble step."""

    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: Any
    mix_weights: tuple | None  # the parameters' ring mix (None: not mixed)
    has_aux: bool
    independent: bool  # the ensemble: tx must not communicate
    who: str
    value_and_grad: Callable  # jax.value_and_grad(loss_fn)


def _replica_arguments(replicas, opt_state, batch, update_args=None):
    """The jitted step's arguments (``update_args`` None: none)."""
    return replicas, opt_state, batch, update_args or {}


def _replica_results(cfg: _ReplicaStepConfig, out):
    """``(replicas, opt_state, metrics)``, ``metrics["aux"]`` with ``has_aux``."""
    replicas, opt_state, metrics, aux = out
    if cfg.has_aux:
        metrics = {**metrics, "aux": aux}
    return replicas, opt_state, metrics


def _check_independent(cfg: _ReplicaStepConfig, grads, state, params, extra) -> None:
    """Raises if the ensemble's ``tx`` communicates: the members would not be independent."""
    tx = cfg.tx
    jaxpr = jax.make_jaxpr(lambda g, s, p, e: tx.update(g, s, p, **e))(grads, state, params, extra)
    if local_lib.communicates(jaxpr):
        raise ValueError(
            f"{cfg.who}: tx communicates between devices (a compressor or exchange with "
            "axis_name set?), so the members would not be trained independently on "
            "their own data. Build tx without axis_name (e.g. plain optax, or a "
            "compressor with axis_name=None)."
        )


def _replica_per_device(cfg: _ReplicaStepConfig, reps, opt_state, batch, update_args):
    """One device's step on its own replica inside ``shard_map``."""
    axis_name = cfg.axis_name
    params, state, extra = device_slice(reps), device_slice(opt_state), device_slice(update_args)
    # Parameters come in device-varying (P(axis)): the gradient is this
    # device's own, no psum is inserted.
    out, grads = cfg.value_and_grad(params, batch)
    if cfg.independent:
        _check_independent(cfg, grads, state, params, extra)
    # make_train_step's count: under optax.MultiSteps every mini-step that ran the
    # inner update sent its exchange.
    updates, state, wire = compress(cfg.tx, grads, state, params, extra, axis_name, cfg.who)
    wire = jnp.float32(0) if wire is None else wire
    base = params
    if cfg.mix_weights is not None:
        base, mix_wire = _gossip_tree(params, axis_name, cfg.mix_weights)
        wire = wire + mix_wire
    new = optax.apply_updates(base, updates)
    loss, aux = out if cfg.has_aux else (out, None)
    metrics = {"loss": lax.pmean(loss, axis_name), "wire_bytes": lax.pmean(wire, axis_name)}
    return (
        device_stack(new),
        device_stack(state),
        metrics,
        device_stack(aux) if cfg.has_aux else None,
    )


def _replica_run(cfg: _ReplicaStepConfig, reps, opt_state, batch, update_args):
    """The jitted step: every argument per device, the averaged metrics replicated."""
    per_device = P(cfg.axis_name)
    # Untyped (shard_step's check_vma=False), so any optax transform (lax.cond
    # on per-device values) traces.
    sharded = shard_step(
        functools.partial(_replica_per_device, cfg),
        cfg.mesh,
        in_specs=(per_device,) * 4,
        out_specs=(per_device, per_device, P(), per_device),
    )
    return sharded(reps, opt_state, batch, update_args)


def make_gossip_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    mix_params: bool = True,
    weights: Sequence[float] = GOSSIP_WEIGHTS,
    has_aux: bool = False,
    donate: bool = True,
) -> Callable:
    """A decentralized (D-PSGD) train step: one parameter replica per device.

    Each device ``i`` computes the gradient of ``loss_fn`` at its own replica
    ``x_i`` on its shard of the batch, runs ``tx`` with its own state (a
    gossip exchange, ``exchange="gossip"`` compressors or
    :func:`gossip_exchange`, mixes the gradients with the ring neighbours;
    plain optax keeps them local, as in D-PSGD; an averaging exchange works
    too) and applies its update to the ring mix of the replicas::

        x_i <- w_self x_i + w_left x_{i-1} + w_right x_{i+1} + update_i

    (``update_i`` is ``tx``'s output, e.g. ``-lr * g_i`` for ``optax.sgd``;
    Lian et al. 2017's D-PSGD with ``tx = optax.sgd(lr)``). With
    ``mix_params=False`` the replicas are not mixed: ``x_i <- x_i +
    update_i``. The replicas' mean follows the mean update (the mixing matrix
    is doubly stochastic) and their spread contracts with each mix; read it
    with :func:`consensus_distance`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (``(scalar, aux)`` with
        ``has_aux``), the mean loss on one device's shard.
      tx: the optimizer (e.g. ``optax.chain(jaxcomp.top_k(0.01,
        axis_name="data", exchange="gossip"), optax.sgd(0.1))``).
      mesh: the device mesh.
      axis_name: the mesh axis; its order is the ring.
      mix_params: mix the replicas with the ring neighbours every step.
      weights: ``(w_self, w_left, w_right)`` of the parameter mixing,
        non-negative, summing to 1 (the compressors' gossip uses 1/3 each).
      has_aux: whether ``loss_fn`` returns auxiliary outputs (returned per
        device in ``metrics["aux"]``).
      donate: donate replicas and optimizer state to the step.

    Returns:
      ``step(replicas, opt_state, batch, update_args=None) -> (replicas,
      opt_state, metrics)``: ``replicas`` from :func:`stack_replicas`,
      ``opt_state`` from :func:`init_replica_opt_state`, ``batch`` sharded
      along its leading axis (:func:`jaxcomp.distributed.shard_batch`),
      ``update_args`` per-device extra arguments of ``tx.update`` with a
      leading device axis. ``metrics``: ``loss`` (mean over devices of each
      replica's local loss) and ``wire_bytes`` (mean over devices: every
      ``wire_bytes`` in the state plus the parameter mixing's ``2 B``).
      ``step.lower(...)`` gives the jitted step's ``jax.stages.Lowered``.

    Raises:
      ValueError: bad ``weights``; at the first call, a ``tx`` that decides
        on this device's gradients whether to exchange (``optax.apply_if_finite``
        around a gossip exchange: one device's NaN would hang the step; use
        ``jaxcomp.apply_if_finite(tx, n, axis_name=axis_name)``).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from jaxcomp import aggregation as agg, distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.sgd(0.5)
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> reps = agg.stack_replicas(jnp.zeros(2), mesh)
      >>> state = agg.init_replica_opt_state(tx, reps, mesh)
      >>> step = agg.make_gossip_train_step(loss, tx, mesh)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones(2, np.float32)}, mesh)
      >>> reps, state, metrics = step(reps, state, batch)
      >>> reps.tolist(), float(metrics["loss"])
      ([[0.5, 0.5]], 1.0)
    """
    mix_params = V.check_bool("mix_params", mix_params)
    weights = collectives.check_gossip_weights(weights)
    return _make_replica_step(
        loss_fn,
        tx,
        mesh,
        axis_name,
        mix_weights=weights if mix_params else None,
        has_aux=has_aux,
        donate=donate,
        independent=False,
        who="make_gossip_train_step",
    )


@jax.jit
def consensus_distance(replicas) -> jax.Array:
    """Mean squared distance of the replicas to their mean: ``(1/N) sum_i ||x_i - x_bar||^2``.

    Over every leaf of the stacked replicas (leading device axis), in float32
    (or wider). 0 when all replicas are equal.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.aggregation import consensus_distance
      >>> float(consensus_distance({"w": jnp.array([[0.0, 0.0], [2.0, 0.0]])}))
      1.0
    """
    total = jnp.float32(0)
    for x in jax.tree.leaves(replicas):
        x = jnp.asarray(x)
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
        d = x - jnp.mean(x, axis=0, keepdims=True)
        total = total + jnp.sum(d * d) / x.shape[0]
    return total


# --- ensemble aggregation ----------------------------------------------------------


def make_ensemble_train_step(
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    axis_name="data",
    *,
    has_aux: bool = False,
    donate: bool = True,
) -> Callable:
    """Trains ``K = N`` ensemble members at once, one per device, each on its own data.

    Member ``i`` lives on device ``i`` (replicas from :func:`stack_replicas`,
    the same or different initialisations) and is trained on device ``i``'s
    rows of each batch only, with no exchange: the step is
    :func:`make_gossip_train_step` without mixing, and ``tx`` must not
    communicate (checked when the step is first traced: a ``ValueError``
    otherwise). Give each member a disjoint shard of the training set with
    :func:`member_batches`; combine and evaluate with
    :func:`evaluate_ensemble`.

    Args:
      loss_fn, tx, mesh, axis_name, has_aux, donate: as in
        :func:`make_gossip_train_step` (``tx`` local: plain optax, or a
        compressor with ``axis_name=None``).

    Returns:
      ``step(replicas, opt_state, batch, update_args=None) -> (replicas,
      opt_state, metrics)`` as :func:`make_gossip_train_step`'s (``loss`` is
      the mean of the members' losses; ``wire_bytes`` 0).

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from jaxcomp import aggregation as agg, distributed as dist
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.sgd(0.5)
      >>> loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)
      >>> reps = agg.stack_replicas(jnp.zeros(2), mesh)
      >>> state = agg.init_replica_opt_state(tx, reps, mesh)
      >>> step = agg.make_ensemble_train_step(loss, tx, mesh)
      >>> batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32),
      ...                           "y": np.ones(2, np.float32)}, mesh)
      >>> reps, state, metrics = step(reps, state, batch)
      >>> reps.tolist()
      [[0.5, 0.5]]
    """
    return _make_replica_step(
        loss_fn,
        tx,
        mesh,
        axis_name,
        mix_weights=None,
        has_aux=has_aux,
        donate=donate,
        independent=True,
        who="make_ensemble_train_step",
    )
