"""Elastic restart: the per-device optimizer state moved to a different number of devices.

:func:`jaxcomp.distributed.init_opt_state` stacks one optimizer state per
device along a leading axis of size ``N``. Part of it is *owed*: under
:func:`jaxcomp.distributed.make_train_step` the parameters move by the mean
over devices of what each device sent, and each device's error-feedback
``residual`` (and DGC ``velocity``) holds what it has not sent yet, so the
devices still owe the parameters ``(1/N) sum_i residual_i``. Restarting on
``M != N`` devices by dropping or duplicating rows would lose or double that.
:func:`resize_opt_state` maps the stacked state to ``M`` devices field by
field (by the type and field name of the jaxcomp state that holds a leaf):

================  ==========================================================
rule              fields, and what device ``j`` of ``M`` gets
================  ==========================================================
``"fold"``        ``residual``, ``velocity`` (per-device owed mass; 1-bit and
                  0/1 Adam's error feedback too); with
                  ``defer_residual=True`` a sparsifier's ``accumulator``,
                  after :meth:`DeferredSparsifyState.settled` wrote its
                  residual out (``sent_threshold`` and ``sent_limit`` are
                  then replicated).
                  Shrinking (``M < N``): old device ``i`` is assigned to
                  ``i mod M`` and ``new_j = (M/N) * sum_{i mod M = j} old_i``.
                  Growing (``M > N``): old device ``i`` is split evenly over
                  its ``c_i = #{j < M : j mod N = i}`` copies,
                  ``new_j = M / (N c_i) * old_{j mod N}``. Either way
                  ``(1/M) sum_j new_j = (1/N) sum_i old_i``.
``"replicated"``  ``step``, ``key`` (PRNG key data) and every leaf of a state
                  jaxcomp does not know (optax's momentum ``trace``, Adam
                  moments, ``count``: computed from the averaged update, the
                  same on every device). They must be equal on every old
                  device (exactly by default: bit for bit, except that
                  ``-0.0 == +0.0`` and NaN equals NaN), else ``ValueError``
                  naming the leaf; every new device gets device 0's copy.
                  0/1 Adam's ``mu``, ``accumulator`` and ``lr_sum`` are
                  per device between its local steps' syncs: such a state
                  is resizable at a sync (``local_step_clipper=1``: always).
``"copy"``        last-step statistics (``sent_count``, ``search_iterations``,
                  ``message_bytes``, ``wire_bytes``, ``received_bytes``,
                  QSGD's kept ``message``): device ``j mod N``'s value (as
                  measured on the old mesh; the next step overwrites them).
``"sum"``         cumulative counters (``nonfinite_steps``, CSSGD's
                  ``clipped`` and ``nonfinite``): shrinking, the sum over the
                  old devices assigned to ``j``; growing, ``j < N`` keeps
                  device ``j``'s count and the new copies start at 0. The
                  total over devices is kept.
``"reselect"``    the stored threshold of DLGS reuse (``threshold``): ``inf``
                  when ``M != N``, which makes the next step select afresh
                  (the residuals it was chosen for changed); kept when
                  ``M == N``.
``"empty"``       a field that must hold no values (1-bit and 0/1 Adam's
                  ``server_residual``: None with the single-stage exchange,
                  so nothing to resize; a two-stage server error raises
                  ``ValueError``).
================  ==========================================================

**The invariant.** For every fold leaf, ``(1/M) sum_j new_j == (1/N) sum_i
old_i`` in exact arithmetic: the devices owe the parameters the same total
after the restart, and steps on ``M`` devices apply it (a step that sends
everything moves the parameters by exactly ``lr`` times that mean; with DGC a
step adds ``m * velocity_j`` to device ``j``'s accumulator, so the velocities'
mean enters the averaged update the way the residuals' mean does). What is
*not* kept is the trajectory: selection is per device and nonlinear, so the
steps after a restart on ``M != N`` devices send other elements than an
uninterrupted run would. Replicated leaves keep their (common) value, so
their mean is kept too. In floating point each new element is computed in
float64 (the sum of at most ``ceil(N/M)`` values and one scaling) and
rounded once to the leaf's dtype, so each element of the owed mean moves by
at most ``2**-24`` times the mean of ``|new_j|`` in float32 (``2**-8`` in
bfloat16), besides float64's own rounding; none when nothing needs rounding,
e.g. growing ``N -> kN`` (each device copied ``k`` times). With ``M == N``
the state is returned unchanged, bit for bit. A new value beyond the leaf's
dtype's range (a float16 residual near its maximum scaled up, when ``M``
neither divides nor is a multiple of ``N``) raises ``ValueError`` rather
than becoming ``inf``.

**PRNG keys.** jaxcomp's compressors keep the seed's key data, the same on
every device, and derive each step's per-device stream by folding in the step
and the device index (CSSGD's key, split every step, is also the same on
every device). So a new device's key is that same key data: device ``j``
then draws the stream a run on ``M`` devices from the start would draw at
that step.

A state that jaxcomp cannot fold raises ``ValueError`` rather than being
copied: a leaf that differs between devices outside the fields above (e.g.
``optax.MultiSteps``' accumulated local gradients, a state type of your own),
a non-finite residual (it was never sent; folding would spread it), a
known state type with a field the rules above do not name, or a
:func:`jaxcomp.distributed.sharded_optimizer` (ZeRO) state with optimizer
moments (each device's slice of the split parameters, shaped by ``N``:
resize its ``compressor`` part and start its ``optimizer`` part afresh). Tell
:func:`resize_opt_state` how to treat your own state types with ``rules=``.

:func:`save` and :func:`restore` wrap this around orbax (imported when
called): the checkpoint stores the device count, and :func:`restore` reads
the state on the host, resizes it and places it on the new mesh with the
layout :func:`jaxcomp.distributed.init_opt_state` gives.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
  >>> from jaxcomp import elastic
  >>> tx = jaxcomp.top_k(0.5, axis_name="data")
  >>> one = tx.init({"w": jnp.zeros(2)})
  >>> state = jax.tree.map(lambda x: np.stack([x, x]), one)  # 2 devices
  >>> state = state._replace(residual={"w": np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)})
  >>> small = elastic.resize_opt_state(state, 2, 1)
  >>> small.residual["w"].tolist()
  [[2.0, 3.0]]
  >>> elastic.resize_opt_state(small, 1, 2).residual["w"].tolist()
  [[2.0, 3.0], [2.0, 3.0]]
  >>> elastic.owed_updates(state)[".residual['w']"].tolist()
  [2.0, 3.0]
"""

from __future__ import annotations

import json
import os
import types
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp import aggregation, cssgd, distributed
from jaxcomp.transforms.adam import OnebitAdamState, OnebitLambState, ZeroOneAdamState
from jaxcomp.transforms.powersgd import PowerSGDState
from jaxcomp.transforms.quantize import MomentumQuantizeState, QuantizeState
from jaxcomp.transforms.sparsify import DeferredSparsifyState, SparsifyState

__all__ = [
    "FIELD_RULES",
    "RULES",
    "owed_updates",
    "place_opt_state",
    "resize_opt_state",
    "restore",
    "save",
    "saved_devices",
]

# How resize_opt_state treats a state field (the table in the module docstring).
RULES = ("fold", "replicated", "copy", "sum", "reselect", "empty")

_SPARSIFY_RULES = {
    "step": "replicated",
    "residual": "fold",
    "velocity": "fold",
    "key": "replicated",
    "sent_count": "copy",
    "threshold": "reselect",
    "search_iterations": "copy",
    "message_bytes": "copy",
    "wire_bytes": "copy",
    "nonfinite_steps": "sum",
}

# The rule of every field of every jaxcomp state type (module docstring). A field
# added to one of these types later must be given a rule here, else
# resize_opt_state raises rather than guessing.
FIELD_RULES: Mapping[type, Mapping[str, str]] = types.MappingProxyType(
    {
        SparsifyState: types.MappingProxyType(_SPARSIFY_RULES),
        # Settled first (DeferredSparsifyState.settled): the accumulator is
        # then the residual, and nothing is pending.
        DeferredSparsifyState: types.MappingProxyType(
            {
                **{f: r for f, r in _SPARSIFY_RULES.items() if f != "residual"},
                "accumulator": "fold",
                "sent_threshold": "replicated",
                "sent_limit": "replicated",
            }
        ),
        QuantizeState: types.MappingProxyType(
            {
                "step": "replicated",
                "residual": "fold",
                "key": "replicated",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
                "message": "copy",
            }
        ),
        MomentumQuantizeState: types.MappingProxyType(
            {
                "step": "replicated",
                "residual": "fold",
                "velocity": "fold",
                "key": "replicated",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
                "message": "copy",
            }
        ),
        PowerSGDState: types.MappingProxyType(
            {
                "step": "replicated",
                "residual": "fold",
                "q": "replicated",  # warm start: the same Q on every device
                "key": "replicated",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
            }
        ),
        OnebitAdamState: types.MappingProxyType(
            {
                "count": "replicated",
                "mu": "replicated",  # the averaged momentum
                "nu": "replicated",  # from the averaged gradient, then frozen
                "residual": "fold",
                # Two-stage server chunks move with the device count: not resized.
                "server_residual": "empty",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
            }
        ),
        OnebitLambState: types.MappingProxyType(
            {
                "count": "replicated",
                "mu": "replicated",
                "nu": "replicated",
                "nu_fresh": "replicated",  # from the averaged momentum
                "residual": "fold",
                "server_residual": "empty",
                "scaling_coeff": "replicated",
                "coeff_freeze": "replicated",
                "last_factor": "replicated",
                "lamb_coeff": "replicated",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
            }
        ),
        ZeroOneAdamState: types.MappingProxyType(
            {
                "count": "replicated",
                # Stage 1: from averaged gradients. Stage 2: mu, accumulator and lr_sum
                # are per device between syncs (local steps) and the same on every
                # device at a sync (accumulator and lr_sum 0): resizable there only.
                "mu": "replicated",
                "nu": "replicated",
                "nu_count": "replicated",
                "residual": "fold",  # gradient, then accumulated-momentum errors
                "server_residual": "empty",
                "accumulator": "replicated",
                "lr_sum": "replicated",
                "var_interval": "replicated",
                "var_counter": "replicated",
                "local_interval": "replicated",
                "local_counter": "replicated",
                "message_bytes": "copy",
                "wire_bytes": "copy",
                "nonfinite_steps": "sum",
            }
        ),
        distributed.DenseExchangeState: types.MappingProxyType({"wire_bytes": "copy"}),
        aggregation.WeightedExchangeState: types.MappingProxyType({"wire_bytes": "copy"}),
        aggregation.ScaleByWeightState: types.MappingProxyType({"wire_bytes": "copy"}),
        aggregation.GossipExchangeState: types.MappingProxyType({"wire_bytes": "copy"}),
        cssgd.CodedState: types.MappingProxyType(
            {
                "clipped": "sum",
                "nonfinite": "sum",
                "key": "replicated",
                "wire_bytes": "copy",
                "received_bytes": "copy",
            }
        ),
    }
)

_FORMAT = "jaxcomp.elastic"
_VERSION = 1
_ITEMS = ("state", "elastic")


# ---------------------------------------------------------------------------
# Rules.
# ---------------------------------------------------------------------------


def _merged_rules(rules) -> dict[type, Mapping[str, str]]:
    out = dict(FIELD_RULES)
    if rules is None:
        return out
    if not isinstance(rules, Mapping):
        raise ValueError(
            f"rules must be a mapping {{NamedTuple type: {{field: rule}}}} or None, got {rules!r}"
        )
    for cls, fields in rules.items():
        if not (isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")):
            raise ValueError(f"rules: keys must be NamedTuple state types, got {cls!r}")
        if not isinstance(fields, Mapping):
            raise ValueError(f"rules[{cls.__name__}] must map field names to rules, got {fields!r}")
        for name, rule in fields.items():
            if rule not in RULES:
                raise ValueError(
                    f"rules[{cls.__name__}][{name!r}] must be one of {RULES}, got {rule!r}"
                )
        out[cls] = fields
    return out


def _check_fields(node, fields: Mapping[str, str]) -> None:
    cls = type(node)
    missing = [f for f in cls._fields if f not in fields]
    unknown = [f for f in fields if f not in cls._fields]
    if missing or unknown:
        raise ValueError(
            f"resize_opt_state: no rule for {cls.__name__} field(s) {missing} (or rules for "
            f"fields it does not have: {unknown}); every field needs one of {RULES} "
            "(pass rules={" + cls.__name__ + ": {...}})"
        )


def _walk(state, rules, leaf_fn):
    """``state`` with every array leaf ``x`` at ``path`` replaced by ``leaf_fn(path, x, rule)``.

    ``rule`` is the rule of the jaxcomp state field holding the leaf, or None
    for a leaf of a state type without rules (treated as replicated).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: type(x) in rules)
    out = []
    for path, node in flat:
        fields = rules.get(type(node))
        if fields is None:
            out.append(leaf_fn(path, node, None))
            continue
        _check_fields(node, fields)
        new = {}
        for name in type(node)._fields:
            sub_path = (*path, jax.tree_util.GetAttrKey(name))
            new[name] = jax.tree_util.tree_map_with_path(
                lambda p, x, sp=sub_path, r=fields[name]: leaf_fn((*sp, *p), x, r),
                getattr(node, name),
            )
        out.append(type(node)(**new))
    return treedef.unflatten(out)


# ---------------------------------------------------------------------------
# Leaves.
# ---------------------------------------------------------------------------


def _host(path, x, n: int) -> np.ndarray:
    """The stacked leaf as a host numpy array with leading axis ``n``."""
    where = jax.tree_util.keystr(path)
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        raise ValueError(
            f"resize_opt_state: leaf {where} spans several processes; restore it from a "
            "checkpoint with jaxcomp.elastic.restore, which reads it in every process"
        )
    if jax.dtypes.issubdtype(jnp.result_type(x), jax.dtypes.prng_key):
        raise ValueError(
            f"resize_opt_state: leaf {where} is a typed PRNG key array; jaxcomp states keep "
            "raw key data (jax.random.key_data), store that instead"
        )
    a = np.asarray(x)
    if a.ndim == 0 or a.shape[0] != n:
        raise ValueError(
            f"resize_opt_state: old_devices={n} but leaf {where} has shape {a.shape}; the "
            "state must be stacked along a leading device axis of size old_devices (as "
            "jaxcomp.distributed.init_opt_state returns it)"
        )
    return a


def _fold(a: np.ndarray, m: int, where: str) -> np.ndarray:
    n = a.shape[0]
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"resize_opt_state: fold leaf {where} must be floating, got {a.dtype}")
    wide = a.astype(np.float64)
    if not np.all(np.isfinite(wide)):
        raise ValueError(
            f"resize_opt_state: fold leaf {where} holds NaN or Inf; folding would spread it "
            "to other devices (jaxcomp never writes non-finite values into a residual)"
        )
    if m <= n:  # old device i goes to i mod m
        out = np.stack([wide[j::m].sum(axis=0) * (m / n) for j in range(m)])
    else:  # old device i split evenly over its copies j = i, i + n, ...
        copies = [len(range(i, m, n)) for i in range(n)]
        out = np.stack([wide[j % n] * (m / (n * copies[j % n])) for j in range(m)])
    with np.errstate(over="ignore"):
        new = out.astype(a.dtype)
    # Rows scaled up (M / (N c_i) > 1 growing, (M/N) * ceil(N/M) > 1 shrinking
    # onto a non-divisor) can leave a narrow dtype's range: refused, since inf
    # (or a saturated value) would lose the owed mass.
    if not np.all(np.isfinite(new)):
        raise ValueError(
            f"resize_opt_state: folding fold leaf {where} ({a.dtype}) from {n} onto {m} "
            f"devices gives values up to {np.abs(out).max():.6g}, beyond {a.dtype}'s range "
            f"(max {float(jnp.finfo(a.dtype).max):.6g}); the owed mass would be lost. Use a "
            "new device count that divides or is a multiple of the old one (each new value "
            "is then a mean or a share of old ones), or a wider residual_dtype (e.g. "
            "float32: cast the state's residuals before resizing)"
        )
    return new


def _replicated(a: np.ndarray, m: int, where: str, rtol: float, known: bool) -> np.ndarray:
    first = a[0]
    if not jnp.issubdtype(a.dtype, jnp.inexact):
        flat = np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], -1)
        same = bool(np.all(flat == flat[:1]))
    else:
        # Values, not bits: -0.0 equals +0.0 (optax.MultiSteps resets its
        # accumulators to (1 - 1) * acc, -0.0 where acc < 0) and NaN equals
        # NaN; otherwise equal floats are equal bits. Equal infinities pass
        # with rtol > 0 too (inf - inf is NaN).
        wide = a.astype(
            np.complex128 if jnp.issubdtype(a.dtype, jnp.complexfloating) else np.float64
        )
        ref = wide[:1]
        close = (wide == ref) | (np.isnan(wide) & np.isnan(ref))
        if rtol > 0:  # a tolerance around a finite value (inf is near no finite one)
            with np.errstate(invalid="ignore"):
                close |= np.isfinite(ref) & (np.abs(wide - ref) <= rtol * np.abs(ref))
        same = bool(np.all(close))
    if not same:
        if known:
            why = "a jaxcomp field that is the same on every device in a synchronous run"
        else:
            why = (
                "outside the per-device fields of jaxcomp's states (FIELD_RULES), so it "
                "must be the same on every device; jaxcomp does not know how to fold it "
                "(optax.MultiSteps' accumulated local gradients, a state of your own: "
                "pass rules={YourState: {field: rule}})"
            )
        tol = "exactly" if rtol == 0 else f"within rtol={rtol}"
        raise ValueError(
            f"resize_opt_state: leaf {where} differs between devices ({tol}); it is {why}"
        )
    return np.ascontiguousarray(np.broadcast_to(first, (m, *first.shape)))


def _check_no_owned_slices(opt_state) -> None:
    """Refuses a :func:`jaxcomp.distributed.sharded_optimizer` (ZeRO) state with moments.

    Its ``optimizer`` part holds each device's owned slice of every split
    parameter: ``1/N`` of the leaf, a shape that depends on the device count.
    Folding or copying rows would give ``M`` devices ``N``-device slices (a
    wrong shape; or, where the slices happen to be equal, e.g. zeros, a state
    that passes the replicated check and crashes the step).
    """
    is_sharded = lambda x: isinstance(x, distributed.ShardedOptimizerState)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=is_sharded)[0]
    for path, node in flat:
        if not is_sharded(node):
            continue
        moments = [x for x in jax.tree.leaves(node.optimizer) if np.ndim(x) > 1]
        if moments:
            where = jax.tree_util.keystr(path) or "opt_state"
            raise ValueError(
                f"resize_opt_state: {where} is a jaxcomp.distributed.sharded_optimizer (ZeRO) "
                "state; its optimizer state holds each device's slice of the split "
                "parameters, whose shape depends on the device count, and cannot be resized. "
                "Resize its compressor part and restart the optimizer's on the new mesh: "
                "fresh = init_opt_state(tx, params, mesh, param_specs=...); "
                "fresh._replace(compressor=resize_opt_state(state.compressor, N, M, mesh=mesh))"
            )


def _resize_leaf(a: np.ndarray, m: int, rule: str | None, where: str, rtol: float):
    n = a.shape[0]
    if rule == "fold":
        return _fold(a, m, where)
    if rule in ("replicated", None):
        return _replicated(a, m, where, rtol, known=rule is not None)
    if rule == "copy":
        return np.ascontiguousarray(a[np.arange(m) % n])
    if rule == "sum":
        if m <= n:
            return np.stack([a[j::m].sum(axis=0, dtype=a.dtype) for j in range(m)])
        return np.concatenate([a, np.zeros((m - n, *a.shape[1:]), a.dtype)])
    if rule == "reselect":
        return np.full((m, *a.shape[1:]), np.inf, a.dtype)
    if rule == "empty":
        if a[0].size:
            raise ValueError(
                f"resize_opt_state: leaf {where} is a two-stage exchange's server error, "
                "held in chunks that move with the device count; it cannot be resized. "
                "Train 1-bit Adam or 0/1 Adam with exchange='allgather' to restart "
                "elastically."
            )
        return np.zeros((m, *a.shape[1:]), a.dtype)
    raise AssertionError(rule)


# ---------------------------------------------------------------------------
# Public API.
# ---------------------------------------------------------------------------


def resize_opt_state(
    opt_state,
    old_devices: int,
    new_devices: int,
    *,
    mesh: Mesh | None = None,
    axis_name="data",
    rules: Mapping[type, Mapping[str, str]] | None = None,
    rtol: float = 0.0,
):
    """Maps a stacked per-device optimizer state from ``old_devices`` to ``new_devices``.

    Every field of jaxcomp's states follows its rule (module docstring,
    :data:`FIELD_RULES`): residuals and velocities are folded so that their
    mean over devices, what the devices still owe the parameters, is kept
    (``(1/M) sum_j new_j == (1/N) sum_i old_i``, one rounding per element to
    the leaf's dtype); replicated leaves are checked and copied; last-step
    statistics copied from device ``j mod N``; cumulative counters summed so
    their total is kept; stored thresholds reset to ``inf`` (select afresh).
    ``new_devices == old_devices`` returns the state unchanged.

    Args:
      opt_state: the stacked state (:func:`jaxcomp.distributed.init_opt_state`
        layout: every leaf with a leading axis of size ``old_devices``), of
        jax arrays (addressable by this process) or numpy arrays.
      old_devices: ``N``, its number of devices, an int >= 1.
      new_devices: ``M``, the number of devices to map it to, an int >= 1.
      mesh: if given, the result is placed on it like ``init_opt_state``
        does (leading axis sharded over ``axis_name``, whose size must be
        ``new_devices``); None: host numpy arrays.
      axis_name: the mesh axis of the devices.
      rules: ``{StateType: {field: rule}}`` for state types of your own (or
        to override jaxcomp's), rules from :data:`RULES`.
      rtol: tolerance of the check that replicated leaves are equal on every
        device: 0 (default) requires them equal (what
        ``make_train_step``'s bit-identical averaged updates give): bit for
        bit, except that ``-0.0`` equals ``+0.0`` and NaN equals NaN; a float
        leaf may then differ by ``rtol`` relative to device 0's value (equal
        values, infinities too, always pass).

    Returns:
      The state with leading axis ``new_devices``, numpy arrays of the same
      dtypes (or placed on ``mesh``).

    Raises:
      ValueError: for device counts below 1, a leaf whose leading axis is not
        ``old_devices``, a mesh whose axis is not ``new_devices``, a leaf that
        differs between devices but has no fold rule, a non-finite or
        non-float fold leaf, a jaxcomp state field without a rule.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
      >>> from jaxcomp import elastic
      >>> one = jaxcomp.top_k(0.5, axis_name="data").init({"w": jnp.zeros(1)})
      >>> state = jax.tree.map(lambda x: np.stack([x] * 3), one)
      >>> state = state._replace(residual={"w": np.array([[3.0], [6.0], [9.0]], np.float32)})
      >>> new = elastic.resize_opt_state(state, 3, 2)
      >>> new.residual["w"].ravel().tolist(), float(new.threshold[0, 0])
      ([8.0, 4.0], inf)
    """
    n = V.check_int("old_devices", old_devices, 1)
    m = V.check_int("new_devices", new_devices, 1)
    rtol = V.check_real("rtol", rtol, 0.0)
    merged = _merged_rules(rules)
    if mesh is not None:
        _check_mesh(mesh, axis_name, m, "new_devices")
    leaves = jax.tree.leaves(opt_state)
    if not leaves:
        raise ValueError("resize_opt_state: opt_state has no array leaves")
    if m != n:
        _check_no_owned_slices(opt_state)
        opt_state = _settled(opt_state, n)

    def leaf_fn(path, x, rule):
        a = _host(path, x, n)
        if m == n:  # nothing moves: bit for bit, whatever the rule
            return a
        return _resize_leaf(a, m, rule, jax.tree_util.keystr(path), rtol)

    out = _walk(opt_state, merged, leaf_fn)
    return out if mesh is None else place_opt_state(out, mesh, axis_name)


def owed_updates(opt_state, *, rules: Mapping[type, Mapping[str, str]] | None = None) -> dict:
    """What the devices still owe the parameters: the mean over devices of every fold leaf.

    Returns:
      ``{path: float64 array}`` for every ``"fold"`` leaf (``residual``,
      ``velocity``; with ``defer_residual=True`` the settled
      ``accumulator``, i.e. the residual), path as ``jax.tree_util.keystr``
      prints it; the mean is over the leading device axis.
      :func:`resize_opt_state` keeps these.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, jaxcomp
      >>> from jaxcomp import elastic
      >>> one = jaxcomp.top_k(0.5, axis_name="data").init({"w": jnp.zeros(1)})
      >>> state = jax.tree.map(lambda x: np.stack([x] * 2), one)
      >>> state = state._replace(residual={"w": np.array([[1.0], [2.0]], np.float32)})
      >>> {k: v.tolist() for k, v in elastic.owed_updates(state).items()}
      {".residual['w']": [1.5]}
    """
    merged = _merged_rules(rules)
    found = {}

    def leaf_fn(path, x, rule):
        if rule == "fold":
            a = np.asarray(x)
            found[jax.tree_util.keystr(path)] = a.astype(np.float64).mean(axis=0)
        return x

    _walk(_settled(opt_state, None), merged, leaf_fn)
    return found


def _settled(opt_state, n):
    """``opt_state`` with every :class:`DeferredSparsifyState` settled (on the host if ``n``).

    With ``defer_residual=True`` a sparsifier leaves its last message in
    ``accumulator``; settled, ``accumulator`` is the residual, which is what
    the devices owe and what folds.
    """

    def settle(path, node):
        if not isinstance(node, DeferredSparsifyState):
            return node
        if n is not None:
            node = jax.tree_util.tree_map_with_path(lambda p, x: _host((*path, *p), x, n), node)
        return node.settled()

    return jax.tree_util.tree_map_with_path(
        settle, opt_state, is_leaf=lambda x: isinstance(x, DeferredSparsifyState)
    )


def _check_mesh(mesh: Mesh, axis_name, m: int | None, what: str) -> int:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a jax.sharding.Mesh, got {mesh!r}")
    if axis_name not in mesh.shape:
        raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
    size = mesh.shape[axis_name]
    if m is not None and size != m:
        raise ValueError(
            f"{what}={m} but the mesh's {axis_name!r} axis has {size} devices; they must agree"
        )
    return size


def place_opt_state(opt_state, mesh: Mesh, axis_name="data"):
    """Places a stacked host state on ``mesh`` as :func:`jaxcomp.distributed.init_opt_state` does.

    Every leaf's leading axis is sharded over ``axis_name`` (replicated over
    the mesh's other axes). Every process passes the whole state (as
    :func:`restore` reads it); each keeps its devices' rows.

    Example:
      >>> import jax, numpy as np
      >>> from jaxcomp import elastic
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> x = elastic.place_opt_state({"r": np.zeros((1, 3), np.float32)}, mesh)["r"]
      >>> x.sharding.spec
      P('data',)
    """
    size = _check_mesh(mesh, axis_name, None, "")
    sharding = NamedSharding(mesh, P(axis_name))

    def place(path, x):
        a = np.asarray(x)
        if a.ndim == 0 or a.shape[0] != size:
            raise ValueError(
                f"place_opt_state: leaf {jax.tree_util.keystr(path)} has shape {a.shape}; "
                f"its leading axis must be the mesh's {axis_name!r} size {size}"
            )
        return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

    return jax.tree_util.tree_map_with_path(place, opt_state)


# ---------------------------------------------------------------------------
# Checkpoints (orbax).
# ---------------------------------------------------------------------------


def _orbax():
    try:
        import orbax.checkpoint as ocp  # noqa: PLC0415 (optional dependency)
    except ImportError as e:  # pragma: no cover (installed with the experiments extra)
        raise ImportError(
            "jaxcomp.elastic.save/restore need orbax-checkpoint (pip install orbax-checkpoint)"
        ) from e
    return ocp


def _leading(opt_state) -> int:
    sizes = {
        jax.tree_util.keystr(p): (np.shape(x)[0] if np.ndim(x) else None)
        for p, x in jax.tree_util.tree_flatten_with_path(opt_state)[0]
    }
    if not sizes:
        raise ValueError("save: opt_state has no array leaves")
    distinct = set(sizes.values())
    if len(distinct) != 1 or None in distinct:
        raise ValueError(
            "save: every leaf of opt_state must have the same leading device axis (the "
            f"init_opt_state layout), got leading sizes {sizes}"
        )
    return distinct.pop()


def _manager(directory, who: str | None = None):
    """orbax's manager of ``directory``; ``who`` (a reader) requires it to exist.

    orbax creates a missing directory: a reader given a typo would create it
    and then report no checkpoint there.
    """
    ocp = _orbax()
    path = os.path.abspath(os.fspath(directory))
    if who is not None and not os.path.isdir(path):
        raise ValueError(f"{who}: the checkpoint directory {path} does not exist")
    return ocp, ocp.CheckpointManager(path, item_names=_ITEMS)


def save(
    directory, step: int, params, opt_state, *, axis_name="data", overwrite: bool = False
) -> None:
    """Saves parameters and the stacked optimizer state with its device count (orbax).

    Writes ``directory/<step>/`` with items ``state`` (``{"params": ...,
    "opt_state": ...}``) and ``elastic`` (JSON: the device count ``N`` and
    the axis name), and waits
    until the write is complete. Call it in every process (orbax coordinates).

    Args:
      directory: the checkpoint root directory (created).
      step: the checkpoint's step number, an int >= 0. It must be after every
        step already in ``directory`` (orbax writes nothing otherwise, and
        :func:`restore` would return the older checkpoint), unless
        ``overwrite``.
      params: the (replicated) parameters.
      opt_state: the stacked state from :func:`jaxcomp.distributed.init_opt_state`
        and training.
      axis_name: the device axis (recorded).
      overwrite: delete the checkpoints at steps ``>= step`` in ``directory``
        first (e.g. a rerun into the same directory); False: raise instead.

    Raises:
      ValueError: ``directory`` already holds a checkpoint at ``step`` or
        later and ``overwrite`` is False; opt_state's leaves have different
        leading axes.

    Example:
      >>> import tempfile, jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist, elastic
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
      >>> params = dist.replicate({"w": jnp.zeros(4)}, mesh)
      >>> d = tempfile.mkdtemp()
      >>> elastic.save(d, 0, params, dist.init_opt_state(tx, params, mesh))
      >>> elastic.saved_devices(d, 0)
      1
      >>> import shutil; shutil.rmtree(d)
    """
    step = V.check_int("step", step, 0)
    if not isinstance(overwrite, bool):
        raise ValueError(f"overwrite must be a bool, got {overwrite!r}")
    n = _leading(opt_state)
    ocp, manager = _manager(directory)
    meta = {"format": _FORMAT, "version": _VERSION, "devices": n, "axis_name": str(axis_name)}
    try:
        # orbax's manager skips (returns False, writes nothing) a step that is
        # not after its latest one: a rerun into the same directory would keep
        # the old run's checkpoint and restore would return it.
        later = sorted(s for s in manager.all_steps() if s >= step)
        if later and not overwrite:
            raise ValueError(
                f"save: {manager.directory} already holds checkpoint step(s) {later} >= "
                f"step={step} (steps: {sorted(manager.all_steps())}); orbax would not write "
                f"step {step}. Save into a new directory, or pass overwrite=True to delete "
                "those steps first"
            )
        for s in later:
            manager.delete(s)
        saved = manager.save(
            step,
            args=ocp.args.Composite(
                # One pytree: orbax's StandardSave refuses a bare array (params may be one).
                state=ocp.args.StandardSave({"params": params, "opt_state": opt_state}),
                elastic=ocp.args.JsonSave(meta),
            ),
        )
        manager.wait_until_finished()
        if not saved:  # never skip silently, whatever orbax's policy decided
            raise ValueError(f"save: orbax did not write step {step} to {manager.directory}")
    finally:
        manager.close()


def _read_meta(ocp, manager, step, directory, who: str) -> dict:
    if step is None:
        step = manager.latest_step()
        if step is None:
            raise ValueError(f"{who}: no checkpoint in {directory}")
    step = V.check_int("step", step, 0)
    if step not in manager.all_steps():
        raise ValueError(
            f"{who}: no checkpoint at step {step} in {directory} "
            f"(steps: {sorted(manager.all_steps())})"
        )
    try:
        meta = manager.restore(step, args=ocp.args.Composite(elastic=ocp.args.JsonRestore()))
        meta = dict(meta["elastic"])
    except Exception as e:  # noqa: BLE001 (whatever orbax raises: not our checkpoint)
        raise ValueError(
            f"{who}: the checkpoint at step {step} in {directory} has no readable "
            f"'elastic' item; it was not written by jaxcomp.elastic.save ({type(e).__name__})"
        ) from e
    if meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
        raise ValueError(f"{who}: unknown checkpoint metadata {json.dumps(meta)}")
    return {**meta, "step": step}


def saved_devices(directory, step: int | None = None) -> int:
    """The number of devices the checkpoint's optimizer state was saved from (None: latest).

    Example:
      >>> import tempfile, shutil, jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist, elastic
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
      >>> params = dist.replicate({"w": jnp.zeros(4)}, mesh)
      >>> d = tempfile.mkdtemp()
      >>> elastic.save(d, 3, params, dist.init_opt_state(tx, params, mesh))
      >>> elastic.saved_devices(d)  # the latest step, saved from a 1-device mesh
      1
      >>> shutil.rmtree(d)
    """
    ocp, manager = _manager(directory, "saved_devices")
    try:
        return int(_read_meta(ocp, manager, step, directory, "saved_devices")["devices"])
    finally:
        manager.close()


def restore(
    directory,
    step: int | None,
    mesh: Mesh,
    tx: optax.GradientTransformation | None,
    params_like,
    *,
    state_like=None,
    axis_name="data",
    rules: Mapping[type, Mapping[str, str]] | None = None,
    rtol: float = 0.0,
):
    """Restores a :func:`save` checkpoint onto ``mesh``, whatever its device count.

    The parameters are restored replicated on ``mesh``. The optimizer state
    is read on the host (every process reads all of it), mapped from the
    saved ``N`` devices to ``M = mesh.shape[axis_name]`` by
    :func:`resize_opt_state` (residuals folded, the owed total kept; see the
    module docstring) and placed with :func:`jaxcomp.distributed.init_opt_state`'s
    layout, ready for :func:`jaxcomp.distributed.make_train_step` on ``mesh``.
    With ``M == N`` the state is restored bit for bit. The parameters are
    restored as saved: this is :func:`jaxcomp.distributed.make_train_step`'s
    layout (replicated parameters); per-device parameter replicas (gossip
    training, ensembles) are not resized.

    Args:
      directory: the checkpoint root given to :func:`save`.
      step: the step to restore; None: the latest.
      mesh: the new device mesh.
      tx: the optimizer the state belongs to (its structure is
        ``tx.init(params_like)`` per device). May be None with ``state_like``.
      params_like: parameters, or ``jax.ShapeDtypeStruct`` leaves, with the
        saved parameters' structure, shapes and dtypes.
      state_like: instead of ``tx``, a stacked state of the right structure on
        any number of devices (arrays or ``ShapeDtypeStruct``), e.g. for
        :func:`jaxcomp.cssgd.init_opt_state`'s ``(CodedState, tx state)``.
      axis_name: the mesh axis of the devices.
      rules, rtol: as in :func:`resize_opt_state`.

    Returns:
      ``(params, opt_state)`` on ``mesh``.

    Raises:
      ValueError: no such directory or checkpoint, a checkpoint not written by :func:`save`,
        a structure unlike ``tx``'s state, and :func:`resize_opt_state`'s errors.

    Example:
      >>> import tempfile, shutil, jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist, elastic
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
      >>> params = dist.replicate({"w": jnp.ones(4)}, mesh)
      >>> d = tempfile.mkdtemp()
      >>> elastic.save(d, 7, params, dist.init_opt_state(tx, params, mesh))
      >>> params, state = elastic.restore(d, None, mesh, tx, {"w": jnp.zeros(4)})
      >>> params["w"].tolist(), state[0].residual["w"].shape
      ([1.0, 1.0, 1.0, 1.0], (1, 4))
      >>> shutil.rmtree(d)
    """
    m = _check_mesh(mesh, axis_name, None, "")
    if (tx is None) == (state_like is None):
        raise ValueError("restore: pass exactly one of tx and state_like")
    if state_like is not None:
        per_device = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x)[1:], jnp.result_type(x)), state_like
        )
    else:
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params_like
        )
        if getattr(tx.update, "sharded_compressor", None) is not None:
            # Its init shapes each device's owned slices under the mesh's axis
            # (outside shard_map: "unbound axis name").
            raise ValueError(
                "restore: tx= cannot describe a sharded_optimizer state (its optimizer holds "
                "per-device slices); pass state_like= (e.g. init_opt_state(tx, params, mesh) "
                "on the saving device count), or restore its compressor part alone"
            )
        per_device = jax.eval_shape(tx.init, abstract)
    replicated = NamedSharding(mesh, P())
    params_target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=replicated),
        params_like,
    )
    ocp, manager = _manager(directory, "restore")
    try:
        meta = _read_meta(ocp, manager, step, directory, "restore")
        n = int(meta["devices"])
        # Host arrays (np.zeros only reserves the pages until orbax fills them).
        state_target = jax.tree.map(lambda s: np.zeros((n, *s.shape), s.dtype), per_device)
        try:
            restored = manager.restore(
                meta["step"],
                args=ocp.args.Composite(
                    state=ocp.args.StandardRestore(
                        {"params": params_target, "opt_state": state_target}
                    ),
                ),
            )
        except Exception as e:  # noqa: BLE001 (orbax's many mismatch errors mean one thing)
            cause = (str(e).strip().splitlines() or [""])[0][:300]
            raise ValueError(
                f"restore: the checkpoint at step {meta['step']} in {directory} does not match "
                f"params_like and the optimizer state's structure ({type(e).__name__}: {cause})"
            ) from e
    finally:
        manager.close()
    restored = restored["state"]
    opt_state = resize_opt_state(
        restored["opt_state"], n, m, mesh=mesh, axis_name=axis_name, rules=rules, rtol=rtol
    )
    return restored["params"], opt_state
