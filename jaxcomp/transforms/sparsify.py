"""The generic sparsifying compressor: residual error feedback around a selector.

``sparsify`` is one optax ``GradientTransformationExtraArgs`` that every
sparsifying method in jaxcomp is built from; the named factories
(``jaxcomp.top_k``, ``jaxcomp.ldte_bs``, ...) in ``sparsifiers.py`` only pick
the selector and its options. Per step and per group of leaves (a leaf by
default; docs/algorithms.md section 1):

    R      = e + g                  # accumulate, in the residual dtype
    S      = select(R)              # at most capacity = ceil(1.5 k) elements
    e_new  = R - S                  # everything not sent stays local
    update = mean over devices of S

and with DGC momentum correction (``momentum > 0``):

    u = m u + g;  R = e + u;  S = select(R);  e_new = R - S;  u[S] = 0 (masking)

and with ``nesterov=True`` (DGC's ``DGCSGDMemory(nesterov=True)``):

    u = m (u + g);  R = (e + u) + g;  then as above

DGC's local gradient clipping (``clip_norm=c``, Lin et al. 2018, section 3.3
and appendix D) first scales this device's gradients, all leaves together, by
``min(1, c N^-1/2 / (||g||_2 + 1e-6))`` (``N`` devices on ``axis_name``: each
device's share of a global threshold ``c``). GRACE's residual scaling
(``residual_scale=beta``, ``gradient_scale=gamma``) replaces the
accumulation by ``R = beta e + gamma u`` (``u``: ``g``, the velocity, or
``u + g`` with ``nesterov``), so ``S + e_new == beta e + gamma u``.

With DLGS threshold reuse (``reuse_period = s > 1``, docs/algorithms.md section 4)
the selector runs every ``s`` steps only; in between ``S = {|R| > H}`` with the
stored threshold ``H`` of the group, capped at the capacity like any
selection; ``capacity_factor="uncapped"`` makes the capacity the group's size
``n``, so that, as in the DLGS paper, everything above ``H`` is sent (no
smaller bound holds: ``|R|`` can outgrow a stored ``H`` anywhere).

Contracts (tested for every compressor): ``S + e_new == R`` bit for bit, in
the residual dtype, where ``S`` is the update as returned (cast back from the
gradient dtype, so even the rounding of a bf16 message stays in the residual);
static shapes and one compilation for all steps, warm-up and reuse included.

Message formats (docs/compressors.md, "Message formats"): with
``value_dtype`` (float16 / bfloat16) ``S`` is sent as ``w(S)``, its values
rounded (float16: saturated at 65504) to the wire dtype, and
``e_new = R - w(S)`` keeps the rounding, so ``w(S) + e_new == R`` still
holds bit for bit; ``index_dtype="uint16"`` sends each index as a 16-bit
offset into its group (packed segment) when that has fewer than ``2^16``
elements; ``random_k``'s ``shared_indices`` draws ``S``'s coordinates alike
on every device, so only the values travel: ``update = mean_d R_d[S]``.

Layout of the code: :func:`sparsify` validates its arguments into a frozen
:class:`_Config`; ``init`` and ``update`` call the module-level :func:`_init`
and :func:`_update_entry` (which dispatches to :func:`_update`) over it. A
step resolves the leaves into groups (:func:`_layout`), each flattened into
one buffer (:func:`_flatten_group`).
With a selector that has a segmented form (``top_k``, ``ldte_bs``, ``dgc``,
``gaussian_k``, ``trimmed_top_k``, ``binary_search``, ``sidco``, ``threshold``,
``random_k``: selected, cut and masked on its own draws instead of ``|R|``)
and one device or a packed exchange, the groups of a bucket (one residual
and wire dtype) are packed as segments of one buffer (:func:`_pack`) and
compressed together (:func:`_compress_packed`, see
:mod:`jaxcomp.selection.segmented`); any other group is compressed alone
(:func:`compress_group`, :func:`_compress_flat`: accumulate, select or
reuse with :func:`_select`, send with :func:`_send_dense`,
:func:`_send_masked`, :func:`_send_extracted`). Each result is split back
into its leaves (:func:`_split_group`) and :func:`finish_step` writes the new
state: the per-leaf statistics as one array per field, gathered from each
pack's or group's :class:`_LeafStats`.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from jaxcomp import _sharding, _vma
from jaxcomp import _validation as V
from jaxcomp._vma import check_per_device, varying_like
from jaxcomp.comm import collectives, sparse_allreduce
from jaxcomp.selection import _kernels as kernels
from jaxcomp.selection import segmented, selectors
from jaxcomp.transforms.base import (
    CommonOptions,
    ResidualScaling,
    apply_nonfinite_policy,
    check_common_options,
    check_residual_scaling,
    resolve_residual_dtype,
    scaled_accumulation,
)
from jaxcomp.transforms.two_level import accepts_two_level_axis

__all__ = [
    "DGC_WARMUP",
    "DeferredSparsifyState",
    "SparsifyState",
    "resolve_groups",
    "sparsify",
]

# DGC's warm-up: one ratio per epoch before the target (Lin et al., 2018).
DGC_WARMUP = (0.25, 0.0625, 0.015625, 0.004)

_GRANULARITY = ("layer", "global")


class SparsifyState(NamedTuple):
    """State of :func:`sparsify`.

    Per-leaf statistics are arrays with one entry per gradient leaf, in
    ``jax.tree.leaves`` order (shape ``(num_leaves,)``; one scalar in all for
    ``granularity="global"``): one output for all leaves, because on XLA a
    scalar per leaf is a kernel per leaf to compile and launch. Read them
    with ``optax.tree.get(opt_state, "sent_count")`` even inside an
    ``optax.chain`` (``.sum()`` is the total over the leaves), or leaf by
    leaf with ``jax.tree.unflatten(jax.tree.structure(grads), list(x))``.
    With ``groups=``, a group of merged leaves shares one selection:
    ``threshold`` and ``search_iterations`` hold the group's value at every
    leaf of the group, while ``sent_count`` and ``message_bytes`` hold each
    leaf's share of the group's message (so their sum over the leaves is
    still the total).

    Attributes:
      step: int32, number of updates so far (drives the warm-up schedule and
        the threshold-reuse period).
      residual: the error-feedback memory, a pytree like the gradients in the
        residual dtype (per device under ``shard_map``).
      velocity: DGC momentum-correction velocity ``u`` (like ``residual``), or
        ``None`` when ``momentum == 0``.
      key: raw uint32 PRNG key data (random selectors), advanced by folding in
        the step, so checkpoints hold plain integers.
      sent_count: int32 per leaf, elements sent in the last step.
      threshold: float32 per leaf (the group's), the threshold of the last
        step: the selector's on a selection step, the stored one on a reuse
        step (``reuse_period > 1``: this is DLGS's ``H_l``, applied until the
        next refresh); ``inf`` after a step that sent nothing (non-finite
        gradients, a left-out backup worker), which makes the next step
        select afresh; 0 for dense or index-based leaves.
      search_iterations: int32 per leaf, counting passes after the first (0
        on reuse steps: no selector ran).
      message_bytes: int32 per leaf, bytes of the last message as a list of
        (int32 index, value) pairs, or the dense tensor for dense-sent leaves.
      wire_bytes: float32, bytes this device put on the wire in the last step
        (from the collective's shapes; 0 with ``axis_name=None``).
      nonfinite_steps: int32, steps whose gradients held NaN or Inf.
    """

    step: jax.Array
    residual: Any
    velocity: Any
    key: jax.Array
    sent_count: Any
    threshold: Any
    search_iterations: Any
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array


class DeferredSparsifyState(NamedTuple):
    """State of :func:`sparsify` with ``defer_residual=True`` (one device).

    :class:`SparsifyState` with the error-feedback memory kept as the last
    step left it: ``accumulator`` (the residual plus the last message) and
    the message's mask (``sent_threshold``, ``sent_limit``), which the next
    step clears as it accumulates. A type of its own, so that
    ``SparsifyState`` (its checkpoints, jaxcomp.elastic's rules) keeps its
    layout, and so that reading ``state.residual`` here fails loudly: read
    the residual with :func:`jaxcomp.residuals` or :meth:`settled`. The
    other fields are :class:`SparsifyState`'s.

    Attributes:
      step: as in :class:`SparsifyState`.
      accumulator: a pytree like the gradients in the residual dtype: the
        residual plus the elements of the last message.
      sent_threshold: float32 per leaf, shape ``(num_leaves,)`` whatever the
        ``granularity``: the
        elements of ``accumulator`` whose float32 magnitude is above it were
        sent by the last step, those equal to the next float32 above it
        only at flat indices up to ``sent_limit`` (a capacity cut's tie
        group, see :func:`jaxcomp.selection.capacity_cut`); ``inf`` when
        nothing is pending (a leaf that writes its residual out: see
        ``defer_residual`` in :func:`sparsify`).
      sent_limit: int32 per leaf, shape ``(num_leaves,)``: the flat index of
        the last tie sent: the
        leaf's size or more when the capacity did not cut the message; in a
        group of merged leaves, the group's cut minus the leaf's offset
        (negative when the cut fell before the leaf).
      velocity, key, sent_count, threshold, search_iterations,
        message_bytes, wire_bytes, nonfinite_steps: as in
        :class:`SparsifyState`.
    """

    step: jax.Array
    accumulator: Any
    sent_threshold: Any
    sent_limit: Any
    velocity: Any
    key: jax.Array
    sent_count: Any
    threshold: Any
    search_iterations: Any
    message_bytes: Any
    wire_bytes: jax.Array
    nonfinite_steps: jax.Array

    def settled(self) -> DeferredSparsifyState:
        """The same state with nothing pending.

        ``accumulator`` becomes the residual, ``sent_threshold`` ``inf`` and
        ``sent_limit`` 0: the form whose ``accumulator`` can be read, folded
        or replaced directly. numpy states stay numpy (see :func:`clear_sent`).
        """
        leaves, treedef = jax.tree.flatten(self.accumulator)
        # The per-leaf arrays' last axis is the leaf (leading axes: devices).
        residual = treedef.unflatten(
            [
                clear_sent(a, self.sent_threshold[..., i], self.sent_limit[..., i])
                for i, a in enumerate(leaves)
            ]
        )
        host = isinstance(self.sent_threshold, np.ndarray | np.generic)
        xp = np if host else jnp
        return self._replace(
            accumulator=residual,
            sent_threshold=xp.full(np.shape(self.sent_threshold), np.inf, np.float32),
            sent_limit=xp.zeros(np.shape(self.sent_limit), np.int32),
        )


def _sent_mask(xp, a, threshold, limit):
    """The message's mask: float32 ``|a| > threshold``, the elements equal to the
    next float32 above ``threshold`` only at flat indices ``<= limit``.

    That is :func:`jaxcomp.selection.capacity_cut`'s form: the ``capacity``
    largest magnitudes, ties to the lower index, when the capacity cut the
    message; ``{|a| > threshold}`` when ``limit`` is the size or more.

    The one definition the one-device send (:func:`_send_masked`) and the
    deferred clearing (:func:`clear_sent`) share, so they agree bit for bit.
    Compared in float32 like the selector's counts and extract(): a float64
    accumulator compared in float64 could select more than counted (values
    that round down to the threshold). Leading axes of ``threshold`` (a state
    stacked per device) are leading axes of ``a``; the flat index runs over
    the rest, without a reshape (sharded leaves keep their sharding).
    """
    t = xp.asarray(threshold, np.float32)
    limit = xp.asarray(limit, np.int32)
    if xp is np:
        above = (t.view(np.int32) + np.int32(1)).view(np.float32)  # as float32_above
    else:
        above = selectors.float32_above(t)
    tail = a.shape[t.ndim :]
    index = xp.arange(math.prod(tail), dtype=np.int32).reshape(tail)
    expand = (..., *([None] * len(tail)))
    magnitude = xp.abs(a.astype(np.float32))
    if xp is np:
        # XLA compares float32 subnormals as zero (CPU and GPU flush them):
        # the device's mask never sent one, so the host must not clear one.
        magnitude = np.where(magnitude < np.finfo(np.float32).tiny, np.float32(0), magnitude)
    return (magnitude > t[expand]) & ((magnitude > above[expand]) | (index <= limit[expand]))


def clear_sent(accumulator: Any, sent_threshold: Any, sent_limit: Any) -> Any:
    """One leaf's residual: ``accumulator`` with the pending message's elements set to +0.

    An element was sent when its float32 magnitude is above ``sent_threshold``
    and, if it equals the next float32 above it, its flat index is at most
    ``sent_limit`` (the comparison the step's mask made, so the result is
    bit for bit the residual an immediate write gives). Leading axes of
    ``sent_threshold`` (a state stacked per device) are leading axes of
    ``accumulator``; the flat index runs over the rest.
    numpy in, numpy out (on the host, in the accumulator's dtype whatever
    ``jax_enable_x64`` says); anything else goes through ``jax.numpy``
    (sharded leaves keep their sharding: no reshape).
    """
    host = all(isinstance(v, np.ndarray | np.generic) for v in (accumulator, sent_threshold))
    xp = np if host else jnp
    a = xp.asarray(accumulator)
    sent = _sent_mask(xp, a, sent_threshold, sent_limit)
    return xp.where(sent, xp.zeros((), a.dtype), a)


# ---------------------------------------------------------------------------
# Static configuration and per-step context.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _Config:
    """The validated static options of one :func:`sparsify` transform."""

    select_fn: Callable[..., selectors.Selection]
    options: dict  # keyword options of the selector (may hold traced hyperparameters)
    needs_key: bool  # the selector takes key= (random_k, dgc): draws from the PRNG stream
    hint_previous: bool  # selector_options hint="previous": pass the stored threshold
    phase_ratios: tuple[float, ...]  # warm-up ratios (one per epoch), then the target
    steps_per_epoch: int | None
    capacity_factor: float  # math.inf: "uncapped" (the capacity is the group size)
    min_dense_size: int
    momentum: Any  # float, or a JAX array (an injected hyperparameter)
    use_velocity: bool
    momentum_masking: bool
    nesterov: bool  # DGC's Nesterov momentum correction (needs a velocity)
    clip_norm: Any  # None, or DGC's global-norm clipping threshold c (float or JAX array)
    scaling: ResidualScaling  # GRACE's residual_scale, gradient_scale
    residual_dtype: Any  # None: per group, see resolve_residual_dtype
    axis_name: Any
    exchange: str
    servers: int  # exchange="server": the parameter servers of the group, by key range
    error_feedback: bool  # False: memory-less, the residual written as zeros
    nonfinite: str
    granularity: str
    groups: Any  # None, or a validated groups spec (see resolve_groups)
    reuse_period: int
    low_pass: Any  # float in (0, 1], or a JAX array (an injected hyperparameter)
    defer_residual: bool  # one device: the next step clears the message (DeferredSparsifyState)
    value_dtype: Any  # None, or float16 / bfloat16: the message's values (see _message_dtype)
    small_indices: bool  # uint16 indices where the index space is < 2^16 (see _index_itemsize)
    shared_indices: bool  # random_k: every device the same draws, values-only messages


class StepContext(NamedTuple):
    step: jax.Array  # int32, drives the warm-up phase and the reuse period
    send_ok: jax.Array  # bool, False on a skipped (non-finite) step
    include: jax.Array | None  # bool, False for a left-out backup worker; None: all in
    # The residual-dtype-independent factor of DGC's local clipping (float32
    # scalar), or None without clip_norm.
    clip: jax.Array | None = None

    @property
    def sends(self) -> jax.Array:
        """Whether this device's message goes into the mean this step."""
        return self.send_ok if self.include is None else self.send_ok & self.include


class _Layout(NamedTuple):
    """How the leaves (in ``jax.tree.flatten`` order) are grouped for one step."""

    groups: tuple[tuple[int, ...], ...]  # leaf indices, ascending, groups by first leaf
    per_leaf: bool  # statistics with an entry per leaf (False: one scalar, "global")


class _FlatOut(NamedTuple):
    """One group's buffer after compression (1-D, the buffer's dtypes)."""

    update: jax.Array  # dense, wire dtype, already exchanged
    residual: jax.Array
    velocity: jax.Array | None
    count: jax.Array  # int32, elements sent
    segment_counts: tuple | None  # int32 per leaf of a merged group, else None
    threshold: jax.Array
    iterations: jax.Array
    wire_bytes: jax.Array
    # Deferred clearing (one device): ``residual`` is the accumulator and the
    # message is _sent_mask(acc, sent_threshold, sent_limit); None: written out.
    sent_threshold: jax.Array | None = None
    sent_limit: jax.Array | None = None


class GroupOut(NamedTuple):
    """One group's results split back into its leaves."""

    updates: list
    residuals: list
    velocities: list | None
    count: jax.Array
    leaf_counts: jax.Array  # int32 per leaf (the group's count for a one-leaf group)
    threshold: jax.Array
    iterations: jax.Array
    message_bytes: jax.Array
    leaf_bytes: jax.Array  # int32 per leaf
    wire_bytes: jax.Array
    # Deferred clearing: per leaf, the pending message's threshold and last
    # flat index (``residuals`` then holds the accumulators); None: nothing pending.
    sent_thresholds: jax.Array | None = None
    sent_limits: jax.Array | None = None


class _LeafStats(NamedTuple):
    """The per-leaf statistics of some leaves, one entry per leaf of ``members``.

    A step gathers them from every group (or every packed bucket) into the
    state's per-leaf arrays with one concatenation and one gather per field.
    """

    members: tuple[int, ...]  # leaf indices in jax.tree.flatten order
    count: jax.Array  # int32
    threshold: jax.Array  # float32
    iterations: jax.Array  # int32
    message_bytes: jax.Array  # int32
    sent_threshold: jax.Array | None  # float32, deferred clearing; None: nothing pending
    sent_limit: jax.Array | None  # int32


def _group_stats(members, o: GroupOut) -> _LeafStats:
    """A group's per-leaf statistics (its threshold and iterations at every leaf)."""
    m = len(members)
    return _LeafStats(
        members=tuple(members),
        count=o.leaf_counts,
        threshold=jnp.broadcast_to(o.threshold, (m,)),
        iterations=jnp.broadcast_to(o.iterations, (m,)),
        message_bytes=o.leaf_bytes,
        sent_threshold=o.sent_thresholds,
        sent_limit=o.sent_limits,
    )


def _capacity(k: int, n: int, capacity_factor: float) -> int:
    if math.isinf(capacity_factor):  # "uncapped": the group's size, nothing is ever cut
        return n
    return min(n, max(k, math.ceil(capacity_factor * k)))


# ---------------------------------------------------------------------------
# Groups of leaves.
# ---------------------------------------------------------------------------


class _Broadcast:
    """A label standing for every leaf of a subtree (a pytree leaf, not a node)."""

    __slots__ = ("count", "label")

    def __init__(self, label, count):
        self.label = label
        self.count = count


def _leaf_labels(labels: Any, tree: Any) -> list:
    """One label per leaf of ``tree`` from a labels pytree that is a prefix of it."""
    try:
        marked = jax.tree.map(
            lambda label, sub: _Broadcast(label, len(jax.tree.leaves(sub))),
            labels,
            tree,
            is_leaf=lambda x: x is None,
        )
    except (ValueError, TypeError) as e:
        raise ValueError(
            "groups: a labels pytree must have the structure of the gradients or a prefix "
            "of it (like optax.multi_transform's param_labels), with one hashable label per "
            f"leaf or subtree (None: the leaf stays its own group); got {labels!r} ({e})"
        ) from None
    out = []
    for b in jax.tree.leaves(marked, is_leaf=lambda x: isinstance(x, _Broadcast)):
        try:
            hash(b.label)
        except TypeError:
            raise ValueError(
                f"groups: labels must be hashable (str, int), got {b.label!r}"
            ) from None
        out += [b.label] * b.count
    return out


def resolve_groups(groups: Any, tree: Any) -> tuple[tuple[int, ...], ...]:
    """The groups of ``tree``'s leaves (indices in ``jax.tree.flatten`` order).

    Args:
      groups: any form :func:`sparsify` accepts: a sequence of sequences of
        leaf paths (``jax.tree_util.keystr``), a labels pytree (a prefix of
        ``tree``; ``None`` labels stay alone), or a callable ``tree ->`` one
        of those.
      tree: the gradients (or parameters).

    Returns:
      One ascending tuple of leaf indices per group, every leaf in exactly one
      group (unlisted leaves alone), groups ordered by their first leaf.

    Raises:
      ValueError: for an unknown path, a leaf in two groups, an empty group or
        a labels tree unlike ``tree``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.transforms.sparsify import resolve_groups
      >>> params = {"a": jnp.ones(2), "b": jnp.ones(3), "c": jnp.ones(4)}
      >>> resolve_groups([["['c']", "['a']"]], params)
      ((0, 2), (1,))
      >>> resolve_groups({"a": "x", "b": None, "c": "x"}, params)
      ((0, 2), (1,))
    """
    if callable(groups):
        groups = groups(tree)
    groups = V.check_groups("groups", groups)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    out = []
    if V.is_path_groups(groups):
        index = {p: i for i, p in enumerate(paths)}
        owner: dict[int, int] = {}
        for gi, group in enumerate(groups):
            for path in group:
                if path not in index and path in _masked_paths(tree):
                    raise ValueError(
                        f"groups[{gi}]: leaf path {path!r} was removed by optax.masked (its "
                        "mask is False: this compressor never sees it); list only the leaves "
                        "the mask keeps, or give groups as a callable params -> labels (it "
                        "is called on the masked tree)"
                    )
                if path not in index:
                    shown = ", ".join(repr(p) for p in paths[:6])
                    shown += ", ..." if len(paths) > 6 else ""
                    raise ValueError(
                        f"groups[{gi}]: unknown leaf path {path!r}; paths are written as "
                        f"jax.tree_util.keystr prints them, here: {shown}"
                    )
                if index[path] in owner:
                    raise ValueError(
                        f"groups: leaf {path!r} is in groups[{owner[index[path]]}] and "
                        f"groups[{gi}]; a leaf belongs to one group"
                    )
                owner[index[path]] = gi
            out.append(tuple(sorted(index[p] for p in group)))
    else:
        by_label: dict[Any, list[int]] = {}
        for i, label in enumerate(_leaf_labels(groups, tree)):
            if label is not None:
                by_label.setdefault(label, []).append(i)
        out = [tuple(v) for v in by_label.values()]
    covered = {i for g in out for i in g}
    out += [(i,) for i in range(len(paths)) if i not in covered]
    return tuple(sorted(out, key=lambda g: g[0]))


def _masked_paths(tree: Any) -> set[str]:
    """Paths of the ``optax.MaskedNode`` placeholders ``optax.masked`` put in ``tree``."""
    is_masked = lambda x: isinstance(x, optax.MaskedNode)  # noqa: E731
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_masked)[0]
    return {jax.tree_util.keystr(p) for p, x in flat if is_masked(x)}


def _layout(cfg: _Config, tree: Any) -> _Layout:
    n = len(jax.tree.leaves(tree))
    if cfg.granularity == "global":
        return _Layout((tuple(range(n)),), per_leaf=False)
    if cfg.groups is None:
        return _Layout(tuple((i,) for i in range(n)), per_leaf=True)
    return _Layout(resolve_groups(cfg.groups, tree), per_leaf=True)


# ---------------------------------------------------------------------------
# The factory.
# ---------------------------------------------------------------------------


@accepts_two_level_axis()
def sparsify(
    selector: str | Callable[..., selectors.Selection],
    ratio: float,
    *,
    selector_options: dict | None = None,
    axis_name: Any = None,
    min_dense_size: int | None = None,
    residual_dtype: Any = None,
    capacity_factor: float | str | None = None,
    momentum: float | jax.Array | None = None,
    momentum_masking: bool = True,
    nesterov: bool = False,
    clip_norm: float | jax.Array | None = None,
    warmup_ratios: Sequence[float] | None = None,
    steps_per_epoch: int | None = None,
    granularity: str = "layer",
    groups: Any = None,
    reuse_period: int | None = None,
    nonfinite: str = "skip",
    exchange: str = "auto",
    servers: int | None = None,
    error_feedback: bool = True,
    low_pass: float | jax.Array | None = None,
    residual_scale: float | jax.Array | None = None,
    gradient_scale: float | jax.Array | None = None,
    defer_residual: bool = False,
    value_dtype: Any = None,
    index_dtype: Any = None,
    shared_indices: bool = False,
    seed: int | jax.Array = 0,
) -> optax.GradientTransformationExtraArgs:
    """A sparsifying compressor with error feedback around any selector.

    Args:
      selector: a name from ``jaxcomp.selection.SELECTORS`` or a function
        ``selector(x, k, **selector_options) -> Selection`` (anything else
        returned raises a ValueError naming the selector).
      ratio: target density ``eta`` in (0, 1]; each leaf (group) of ``n``
        elements keeps ``k = max(1, ceil(eta * n))``.
      selector_options: keyword options passed to the selector;
        ``hint="previous"`` passes a selector that takes ``hint=`` (such as
        :func:`jaxcomp.selection.ldte_bs`) the group's previous threshold.
      axis_name: mesh axis to average over inside ``shard_map``/``pmap``.
        ``None``: return the local decompressed update (one device).
      min_dense_size: leaves (groups) with at most this many elements are
        sent dense (as the papers send biases); their residual keeps only
        the rounding to the gradient dtype. None: 0.
      residual_dtype: float dtype of the residual and the accumulation, in
        which "nothing lost" holds bit for bit. ``None`` (default): float32,
        or the parameter's dtype where wider (the widest over a group).
      capacity_factor: messages hold at most ``ceil(capacity_factor * k)``
        pairs, the largest (ties to the lower index); the rest of a larger
        selection stays in the residual. None: 1.5; 1 for ``"dgc"`` with its
        default ``rule="reference"`` (DGC's reference code sends at most ``k``).
        ``"uncapped"``: no cap, everything the threshold passes is sent (the
        DLGS paper's reuse steps); the message buffer is then the group's
        size ``n`` (static shapes: a reused threshold can pass any number of
        elements), so ``exchange="auto"`` all-reduces it dense and
        ``"allgather"`` moves ``n`` pairs per device; ``message_bytes`` and
        ``sent_count`` still report what passed. Refused with the global
        selections (``"gtopk"``, ``"oktopk"``, ``"scalecom"``,
        ``"auto_topk"``), whose global keep count is the capacity.
      momentum: DGC momentum correction factor ``m`` in [0, 1) (then use
        plain SGD after the compressor); may be traced. None: no velocity.
      momentum_masking: DGC momentum factor masking (zero ``u`` where sent).
      nesterov: DGC's Nesterov momentum correction (``DGCSGDMemory(nesterov=True)``):
        ``u = m (u + g)``, ``R = (e + u) + g``; then use plain SGD after the
        compressor. Needs ``momentum > 0`` (or an injected momentum).
        Default False.
      clip_norm: DGC's local gradient clipping before the accumulation, a
        threshold ``c > 0`` (may be traced): this device's gradients, all
        leaves together, are scaled by ``min(1, c / sqrt(N) / (||g||_2 +
        1e-6))``, ``N`` the devices on ``axis_name`` (1 without). After the
        non-finite policy (a NaN never reaches the norm). Not with
        ``make_train_step(overlap=True)`` (which compresses leaf by leaf in
        the backward pass: no norm of the whole gradient). None: off.
      warmup_ratios: ratios for the first epochs, one per epoch (DGC's:
        :data:`DGC_WARMUP`), then ``ratio``; all compiled once (``lax.switch``).
      steps_per_epoch: steps per warm-up phase.
      granularity: ``"layer"`` (per-leaf selection, the papers' default) or
        ``"global"`` (one selection over all leaves: one group of every leaf).
      groups: compress and exchange groups of leaves together (DLGS layer
        merging), one selection and one exchange per group: leaf paths as
        ``jax.tree_util.keystr`` prints them, a pytree of labels (as
        ``optax.multi_transform``'s) or a callable ``params -> labels``.
        None (default): ``granularity`` decides.
      reuse_period: DLGS threshold reuse ``s``, an int >= 1: the selector
        runs every ``s`` steps (and when a stored threshold cannot serve);
        between, the stored threshold ``state.threshold`` is applied, capped
        at the capacity (``capacity_factor="uncapped"``: not capped, the
        paper's rule). Needs a threshold selector. None: 1.
      nonfinite: policy for NaN/Inf gradients. ``"skip"`` (default): a
        device with a non-finite gradient sends nothing this step and keeps
        its residual and velocity; the others' messages are averaged as
        usual. ``"zero"``: non-finite elements are replaced by 0. Neither
        writes NaN/Inf into the residual. Under ``shard_map`` use these, not
        ``optax.apply_if_finite`` (refused: it would hang the step).
      exchange: how messages travel with ``axis_name``
        (:mod:`jaxcomp.comm.sparse_allreduce`): the exact mean
        (``"allgather"`` of the (index, value) pairs, ``"dense"`` all-reduce,
        ``"server"``, ``"sparcml"``, ``"auto"``: allgather or dense, fewer
        bytes), a global selection of the summed messages whose leftovers
        return to a residual (``"gtopk"``, ``"oktopk"``, ``"scalecom"``,
        ``"auto_topk"``), or decentralized ``"gossip"``. ``"sparse"`` is an
        alias of ``"allgather"`` (the same collective, the same results).
        ``include=`` works with ``"allgather"``, ``"dense"`` and ``"auto"``
        only.
      servers: ``exchange="server"`` only: ``M``, a group of parameter
        servers in ``[1, N]`` (``N`` devices on ``axis_name``, checked when
        the update is traced), spread over the axis
        (:func:`jaxcomp.comm.server_devices`), each owning one key range of
        the flat (packed) buffer (:func:`jaxcomp.comm.server_ranges`): a
        worker pushes its whole (index, value) message to every server (static
        shapes), each server averages its range and sends that slice of the
        dense mean back. The same mean as one server; per server ``1 / M`` of
        the dense pull (docs/distributed.md, "A group of parameter servers").
        None: 1, the single server.
      error_feedback: True (default, every sparsifier paper): what is not
        sent stays in the residual and is sent later. False: memory-less
        sparsification (GRACE's ``TopKCompressor`` with ``NoneMemory``): the
        update is the mean over devices of ``select(g_i)`` (of the velocity
        with ``momentum``), what is not sent is dropped, and
        ``state.residual`` stays zeros (kept, so the state's structure is
        the same either way). Excludes ``low_pass`` and ``defer_residual``
        (both act on the residual).
      low_pass: ScaleCom's low-pass filter on the residual, ``beta`` in
        (0, 1]: ``r <- r + beta * (r + g - sent - r)``, deliberately lossy
        below 1. May be traced. None: 1, plain error feedback.
      residual_scale: GRACE's ``ResidualMemory`` ``beta`` in [0, 1] (may be
        traced): the accumulator is ``R = residual_scale * e +
        gradient_scale * u`` (``u``: the gradient, or the DGC velocity), and
        ``e_new = R - S`` as always. None: 1. Not with ``low_pass`` (one
        filter on the residual at a time) nor ``error_feedback=False``.
      gradient_scale: GRACE's ``gamma`` > 0 (may be traced). None: 1.
      defer_residual: one device only (``axis_name=None``): keep the
        accumulator and the message's mask in the state and clear the sent
        elements at the next step (the same updates and residuals, fewer
        dense passes). The state is then a :class:`DeferredSparsifyState`:
        read the residual with :func:`jaxcomp.residuals`. Default False.
      value_dtype: ``"float16"`` or ``"bfloat16"``: the message's values
        travel in that dtype (DGC's ``fp16_values``), for leaves (groups)
        whose gradient dtype is wider; a 16-bit leaf is sent as it is. The
        rounding, and float16's saturation at 65504, stay in the residual
        (nothing lost). The all-gather adds the gathered values in the
        residual dtype; a dense all-reduce adds in the 16-bit dtype (what it
        moves). ``"allgather"``, ``"dense"``, ``"auto"`` or one device.
        None (default): the gradient dtype.
      index_dtype: ``"uint16"``: 16-bit indices for every group (packed
        segment) of fewer than ``2^16`` elements (the space its indices
        address), int32 for larger ones; counted in ``message_bytes`` and
        ``wire_bytes`` and moved as ``uint16`` by the all-gather (DGC's
        ``int32_indices`` one step further). ``"allgather"``, ``"dense"``,
        ``"auto"`` or one device. None or ``"int32"`` (default): int32.
      shared_indices: ``random_k`` only: every device draws the same
        coordinates (the seed's stream, not folded with the device index;
        GRACE's ``RandomKCompressor``) and sends only their values: the
        exchange all-reduces the ``k`` values (``"allgather"``, ``"auto"``;
        ``"dense"`` all-reduces the dense message). The update is the mean
        over devices at the shared coordinates. Default False.
      seed: seed of the PRNG stream of random selectors (``random_k``, its
        own per device; the sample start of ``dgc``, the same on every device
        as in DGC's reference code), an int32; only ``init`` reads it, so it
        may be traced.

    Static options must be Python or numpy values (or named in ``static_args``
    under ``optax.inject_hyperparams``); leaves must be real floating-point
    arrays. Every option in full: docs/compressors.md.

    Returns:
      An ``optax.GradientTransformationExtraArgs`` with :class:`SparsifyState`
      (:class:`DeferredSparsifyState` with ``defer_residual=True``).

    Raises:
      ValueError: for a bad argument (a ratio outside (0, 1], an unknown
        selector, ...); the message names the argument.

    Example:
      >>> import jax.numpy as jnp, optax, jaxcomp
      >>> tx = optax.chain(jaxcomp.ldte_bs(ratio=0.01), optax.sgd(0.1))
      >>> params = {"w": jnp.ones((1000,))}
      >>> state = tx.init(params)
      >>> updates, state = tx.update({"w": jnp.linspace(-1.0, 1.0, 1000)}, state)
      >>> int((updates["w"] != 0).sum()) <= 15
      True
    """
    common = check_common_options(
        axis_name=axis_name,
        min_dense_size=min_dense_size,
        residual_dtype=residual_dtype,
        nonfinite=nonfinite,
        seed=seed,
    )
    cfg = _make_config(
        selector,
        ratio,
        common,
        selector_options=selector_options,
        capacity_factor=capacity_factor,
        momentum=momentum,
        momentum_masking=momentum_masking,
        nesterov=nesterov,
        clip_norm=clip_norm,
        warmup_ratios=warmup_ratios,
        steps_per_epoch=steps_per_epoch,
        granularity=granularity,
        groups=groups,
        reuse_period=reuse_period,
        exchange=exchange,
        servers=servers,
        error_feedback=error_feedback,
        low_pass=low_pass,
        residual_scale=residual_scale,
        gradient_scale=gradient_scale,
        defer_residual=defer_residual,
        value_dtype=value_dtype,
        index_dtype=index_dtype,
        shared_indices=shared_indices,
    )

    def init(params):
        return _init(cfg, common.seed, params)

    def update(updates, state, params=None, *, include=None, scatter=None,
               jaxcomp_overlap=None, **extra_args):  # fmt: skip
        del params, extra_args
        return _update_entry(cfg, updates, state, include, scatter, jaxcomp_overlap)

    return optax.GradientTransformationExtraArgs(init, update)


def _update_entry(cfg: _Config, updates, state, include, scatter, jaxcomp_overlap):
    """``update`` of :func:`sparsify`: its keyword arguments beyond optax's.

    ``include``: optional bool scalar, this device's backup-worker flag.

    ``scatter``: with ``exchange="scatter"``, a pytree of bools like the
    updates: which leaves are reduce-scattered (their update is this
    device's slice, the first dimension split over the devices);
    :func:`jaxcomp.distributed.sharded_optimizer` passes it.

    ``jaxcomp_overlap`` is private to ``make_train_step(overlap=True)``,
    which runs this compressor inside the backward pass
    (:mod:`jaxcomp.transforms.overlap`).
    """
    if jaxcomp_overlap is not None:
        return jaxcomp_overlap.visit(cfg, updates, state, include)
    if cfg.exchange == "scatter":
        return _update(cfg, updates, state, include, scatter=_scatter_leaves(updates, scatter))
    # Leaves split over explicit mesh axes (jit outside shard_map): each
    # leaf compressed whole, as on one device (see jaxcomp._sharding).
    return _sharding.whole_leaves(
        functools.partial(_update, cfg), fields=("residual", "accumulator", "velocity")
    )(updates, state, include)


def _takes_key(select_fn) -> bool:
    """Whether the selector has a ``key`` parameter (``random_k``, ``dgc_sample``)."""
    try:
        params = inspect.signature(select_fn).parameters
    except (TypeError, ValueError):  # some callables have no signature
        return False
    p = params.get("key")
    return p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)


def _make_config(
    selector,
    ratio,
    common: CommonOptions,
    *,
    selector_options,
    capacity_factor,
    momentum,
    momentum_masking,
    nesterov,
    clip_norm,
    warmup_ratios,
    steps_per_epoch,
    granularity,
    groups,
    reuse_period,
    exchange,
    error_feedback,
    low_pass,
    residual_scale,
    gradient_scale,
    defer_residual,
    value_dtype=None,
    index_dtype=None,
    shared_indices=False,
    servers=None,
) -> _Config:
    """Validates :func:`sparsify`'s arguments (each error names its argument)."""
    # Static options default to None (the documented value) so that
    # optax.inject_hyperparams leaves them alone; momentum and seed may be
    # traced hyperparameters.
    if isinstance(selector, str):
        select_fn = selectors.get_selector(selector)
    elif callable(selector):
        select_fn = selector
    else:
        raise ValueError(f"selector must be a name or a callable, got {selector!r}")
    ratio = V.check_ratio("ratio", ratio)
    if selector_options is not None and not isinstance(selector_options, dict):
        raise ValueError(f"selector_options must be a dict or None, got {selector_options!r}")
    options = dict(selector_options or {})
    if capacity_factor is None:
        # DGC's reference code sends at most k (dgc_sample's rule="reference").
        reference_dgc = select_fn is selectors.dgc_sample and (
            options.get("rule", "reference") == "reference"
        )
        capacity_factor = 1.0 if reference_dgc else 1.5
    capacity_factor = _check_capacity_factor(capacity_factor)
    momentum = V.check_real(
        "momentum",
        0.0 if momentum is None else momentum,
        0.0,
        1.0,
        high_open=True,
        allow_traced=True,
    )
    momentum_masking = V.check_bool("momentum_masking", momentum_masking)
    nesterov = V.check_bool("nesterov", nesterov)
    use_velocity = V.is_dynamic(momentum) or momentum > 0
    if nesterov and not use_velocity:
        raise ValueError(
            "nesterov=True is DGC's Nesterov momentum correction: it needs momentum in (0, 1) "
            f"(or an injected momentum), got momentum={momentum!r}"
        )
    clip_norm = V.check_real(
        "clip_norm", clip_norm, 0.0, low_open=True, allow_none=True, allow_traced=True
    )
    defer_residual = V.check_bool("defer_residual", defer_residual)
    if defer_residual and common.axis_name is not None:
        raise ValueError(
            "defer_residual=True applies to one device (axis_name=None): with an exchange the "
            f"residual is updated by a k-sized scatter and nothing is deferred; got "
            f"axis_name={common.axis_name!r}"
        )
    error_feedback = V.check_bool("error_feedback", error_feedback)
    if not error_feedback and (low_pass is not None or defer_residual):
        # Both act on the residual, which memory-less sparsification never keeps.
        raise ValueError(
            "error_feedback=False keeps no residual, so low_pass and defer_residual have "
            f"nothing to act on: leave them unset, got low_pass={low_pass!r}, "
            f"defer_residual={defer_residual!r}"
        )
    low_pass = V.check_real(
        "low_pass", 1.0 if low_pass is None else low_pass, 0.0, 1.0, low_open=True,
        allow_traced=True,
    )  # fmt: skip
    scaling = check_residual_scaling(residual_scale, gradient_scale, error_feedback=error_feedback)
    if scaling.on and (V.is_dynamic(low_pass) or low_pass != 1.0):
        # Two filters on the residual: which applies first is not either peer's rule.
        raise ValueError(
            "low_pass (ScaleCom's filter) and residual_scale/gradient_scale (GRACE's "
            "ResidualMemory) both rescale the residual: use one, got "
            f"low_pass={low_pass!r}, residual_scale={residual_scale!r}, "
            f"gradient_scale={gradient_scale!r}"
        )
    granularity = V.check_choice("granularity", granularity, _GRANULARITY)
    groups = V.check_groups("groups", groups)
    if groups is not None and granularity == "global":
        raise ValueError(
            "groups must be None with granularity='global' (one group holding every leaf "
            f"already), got {groups!r}"
        )
    # An int32 in the step counter's arithmetic.
    reuse_period = V.check_int(
        "reuse_period", 1 if reuse_period is None else reuse_period, 1, 2**31 - 1
    )
    # Aliases ("sparse") become the canonical name here, once: the steps and
    # the per-group choices of "auto" only know the canonical names.
    exchange = sparse_allreduce.canonical_exchange(
        V.check_choice(
            "exchange",
            exchange,
            sparse_allreduce.EXCHANGES + tuple(sparse_allreduce.EXCHANGE_ALIASES),
        )
    )
    servers = collectives.check_servers(servers, exchange=exchange, axis_name=common.axis_name)
    if math.isinf(capacity_factor) and exchange in _GLOBAL_SELECTION_EXCHANGES:
        # Their global keep count is the capacity: uncapped would keep every
        # summed entry (a plain mean sent as pairs, more bytes than dense).
        raise ValueError(
            f"capacity_factor={_UNCAPPED!r} cannot be used with exchange={exchange!r}: its global "
            "selection keeps the capacity's count of the summed entries, so uncapped would keep "
            f"them all; use a finite capacity_factor, or an exact exchange "
            f"(not one of {_GLOBAL_SELECTION_EXCHANGES})"
        )
    if exchange == "scatter" and (groups is not None or granularity != "layer"):
        raise ValueError(
            "exchange='scatter' reduce-scatters each leaf over the devices that own its slices: "
            f"it needs per-leaf buffers (groups=None, granularity='layer'), got groups={groups!r}, "
            f"granularity={granularity!r}"
        )
    value_dtype, small_indices, shared_indices = _check_message_format(
        select_fn, common.axis_name, exchange, value_dtype, index_dtype, shared_indices
    )
    phase_ratios = (ratio,)
    warmup_ratios = () if warmup_ratios is None else V.check_ratios("warmup_ratios", warmup_ratios)
    steps_per_epoch = V.check_int("steps_per_epoch", steps_per_epoch, 1, 2**31 - 1, allow_none=True)
    if warmup_ratios:
        if steps_per_epoch is None:
            raise ValueError("steps_per_epoch must be an int >= 1 with warmup_ratios, got None")
        # A warm-up phase never sends less than the target itself.
        phase_ratios = tuple(max(r, ratio) for r in warmup_ratios) + phase_ratios
    needs_key = _takes_key(select_fn)
    extra = {"key": jax.random.key(0)} if needs_key else {}
    hint_previous = isinstance(options.get("hint"), str) and options["hint"] == "previous"
    if hint_previous:
        # Filled in per step with the group's stored threshold (see _run_selector).
        del options["hint"]
        extra["hint"] = jnp.float32(0)
    if options or hint_previous:
        # Surface unknown or invalid selector options at construction. Only a
        # signature mismatch is reported as an options error: any other error
        # raised while tracing the selector propagates as it is, so that a bug
        # inside the selector is not blamed on its options.
        try:
            signature = inspect.signature(select_fn)
        except (TypeError, ValueError):  # some callables have no signature
            signature = None
        if signature is not None:
            try:
                signature.bind(None, 1, **options, **extra)
            except TypeError as e:
                given = sorted([*options, *(["hint"] if hint_previous else [])])
                raise ValueError(f"selector_options {given} rejected: {e}") from None
    if options or hint_previous or reuse_period > 1:
        probe = jax.eval_shape(
            lambda x: _checked_selection(select_fn, select_fn(x, 1, **options, **extra)),
            jax.ShapeDtypeStruct((4,), jnp.float32),
        )
        if reuse_period > 1 and probe.indices is not None:
            raise ValueError(
                f"reuse_period must be 1 with an index-based selector ({selector!r} picks "
                f"indices, it has no threshold to reuse), got {reuse_period}"
            )
    return _Config(
        select_fn=select_fn,
        options=options,
        needs_key=needs_key,
        hint_previous=hint_previous,
        phase_ratios=phase_ratios,
        steps_per_epoch=steps_per_epoch,
        capacity_factor=capacity_factor,
        min_dense_size=common.min_dense_size,
        momentum=momentum,
        # A JAX-array momentum (injected hyperparameter) keeps a velocity even
        # at 0, so init and update agree on the state's structure.
        use_velocity=use_velocity,
        momentum_masking=momentum_masking,
        nesterov=nesterov,
        clip_norm=clip_norm,
        scaling=scaling,
        residual_dtype=common.residual_dtype,
        axis_name=common.axis_name,
        exchange=exchange,
        servers=servers,
        error_feedback=error_feedback,
        nonfinite=common.nonfinite,
        granularity=granularity,
        groups=groups,
        reuse_period=reuse_period,
        low_pass=low_pass,
        defer_residual=defer_residual,
        value_dtype=value_dtype,
        small_indices=small_indices,
        shared_indices=shared_indices,
    )


# The exchanges whose global selection keeps ``capacity`` entries of the summed
# messages (gTop-k, Ok-Topk, ScaleCom's leader; auto_topk picks among them):
# refused with an uncapped capacity.
_GLOBAL_SELECTION_EXCHANGES = ("gtopk", "oktopk", "scalecom", "auto_topk")

# capacity_factor's one named value: messages as large as their group (a float
# inf in _Config), DLGS's "everything above the threshold" on reuse steps.
_UNCAPPED = "uncapped"


def _check_capacity_factor(value) -> float:
    """A real >= 1, or ``"uncapped"`` (``math.inf``: the capacity is the group's size)."""
    what = (
        f"capacity_factor must be a finite real number in [1, inf) or {_UNCAPPED!r} (no cap), "
        f"got {value!r}"
    )
    if isinstance(value, str):
        if value != _UNCAPPED:
            raise ValueError(what)
        return math.inf
    if V.is_traced(value):  # its own error: a static option, to name in static_args
        return V.check_real("capacity_factor", value, 1.0)
    try:
        return V.check_real("capacity_factor", value, 1.0)
    except ValueError:
        raise ValueError(what) from None


# The exchanges the message-format options (value_dtype, index_dtype,
# shared_indices) work with; the others refuse them (see _check_message_format).
_FORMAT_EXCHANGES = ("allgather", "dense", "auto")
# A 16-bit index addresses a space of fewer than 2^16 elements (its padding
# sentinel, the space's size, must fit too).
_SMALL_INDEX_SPACE = 2**16


def _dtype_or_none(name):
    """``jnp.dtype(name)``, or None where it names no dtype (the caller raises)."""
    try:
        return jnp.dtype(name)
    except TypeError:
        return None


def _check_message_format(select_fn, axis_name, exchange, value_dtype, index_dtype, shared):
    """Validates the message-format options: ``(value dtype or None, small_indices, shared)``."""
    if value_dtype is not None:
        dt = _dtype_or_none(value_dtype)
        if dt not in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16)):
            raise ValueError(
                f"value_dtype must be None, 'float16' or 'bfloat16', got {value_dtype!r}"
            )
        value_dtype = dt
    if index_dtype is None:
        small = False
    else:
        it = _dtype_or_none(index_dtype)
        if it not in (jnp.dtype(jnp.int32), jnp.dtype(jnp.uint16)):
            raise ValueError(
                f"index_dtype must be None, 'int32' or 'uint16' (16-bit indices where the "
                f"index space has fewer than 2^16 elements), got {index_dtype!r}"
            )
        small = it == jnp.dtype(jnp.uint16)
    shared = V.check_bool("shared_indices", shared)
    if shared and select_fn is not selectors.random_k:
        raise ValueError(
            "shared_indices=True needs the random_k selector (every device draws the same "
            f"coordinates from a common key), got selector {select_fn!r}"
        )
    if axis_name is not None and exchange not in _FORMAT_EXCHANGES:
        for name, on, value in (
            ("value_dtype", value_dtype is not None, value_dtype),
            ("index_dtype", small, index_dtype),
            ("shared_indices", shared, shared),
        ):
            if on:
                raise ValueError(
                    f"{name}={value!r} works with exchange 'allgather', 'dense' or 'auto' "
                    f"(or one device), not with exchange={exchange!r}"
                )
    return value_dtype, small, shared


def _message_dtype(cfg: _Config, dtype):
    """The dtype a group of gradient dtype ``dtype`` sends its values in."""
    dtype = jnp.dtype(dtype)
    v = cfg.value_dtype
    return v if v is not None and dtype.itemsize > v.itemsize else dtype


def _index_itemsize(cfg: _Config, n: int) -> int:
    """Bytes per index of a message addressing ``n`` elements (a group, a packed segment)."""
    if cfg.shared_indices:
        return 0  # values only: the indices are drawn alike on every device
    return 2 if cfg.small_indices and n < _SMALL_INDEX_SPACE else 4


# ---------------------------------------------------------------------------
# init and update.
# ---------------------------------------------------------------------------


def _init(cfg: _Config, seed, params) -> SparsifyState | DeferredSparsifyState:
    V.check_gradient_leaves(params, "jaxcomp.sparsify.init", "parameter")
    layout = _layout(cfg, params)
    leaves, treedef = jax.tree.flatten(params)
    # One accumulator per group: one residual dtype per group.
    dtypes: list[Any] = [None] * len(leaves)
    for members in layout.groups:
        rdt = resolve_residual_dtype(cfg.residual_dtype, [leaves[i] for i in members])
        for i in members:
            dtypes[i] = rdt

    def zeros():
        return treedef.unflatten(
            [jnp.zeros(jnp.shape(p), dt) for p, dt in zip(leaves, dtypes, strict=True)]
        )

    # One entry per leaf (see SparsifyState); "global": one scalar.
    stats_shape = [len(leaves)] if layout.per_leaf else []

    def stat(dtype):
        return jnp.zeros(stats_shape, dtype)

    common = dict(
        step=jnp.zeros([], jnp.int32),
        velocity=zeros() if cfg.use_velocity else None,
        key=jax.random.key_data(jax.random.key(seed)),
        sent_count=stat(jnp.int32),
        threshold=stat(jnp.float32),
        search_iterations=stat(jnp.int32),
        message_bytes=stat(jnp.int32),
        wire_bytes=jnp.zeros([], jnp.float32),
        nonfinite_steps=jnp.zeros([], jnp.int32),
    )
    if cfg.defer_residual:
        return DeferredSparsifyState(
            accumulator=zeros(),
            sent_threshold=jnp.full([len(leaves)], jnp.inf, jnp.float32),
            sent_limit=jnp.zeros([len(leaves)], jnp.int32),
            **common,
        )
    return SparsifyState(residual=zeros(), **common)


class _GroupInput(NamedTuple):
    """What one group's compression reads from the state (leaves in group order)."""

    members: tuple[int, ...]  # leaf indices in jax.tree.flatten order
    residuals: list
    velocities: list | None
    stored: jax.Array  # the group's stored threshold (reuse)
    key: jax.Array  # the group's PRNG key (random selectors)


class _StepInputs(NamedTuple):
    """One step's grouping and per-group state, shared by ``update`` and the overlap path."""

    layout: _Layout
    treedef: Any
    groups: tuple[_GroupInput, ...]
    key: jax.Array  # this step's PRNG key (per-leaf layouts fold in each group's first leaf)


def check_updates(cfg: _Config, updates, state) -> None:
    V.check_gradient_leaves(updates, "jaxcomp.sparsify")
    V.check_state_type(state, (SparsifyState, DeferredSparsifyState), "jaxcomp.sparsify")
    if cfg.defer_residual != isinstance(state, DeferredSparsifyState):
        raise ValueError(
            f"jaxcomp.sparsify: a state of a transform with defer_residual="
            f"{not cfg.defer_residual} ({type(state).__name__}) passed to one with "
            f"defer_residual={cfg.defer_residual}; initialise the state with this "
            "transform's init"
        )
    memory = state.accumulator if cfg.defer_residual else state.residual
    V.check_tree_like(updates, memory, "jaxcomp.sparsify")
    check_per_device(updates, cfg.axis_name, "jaxcomp.sparsify")


def step_inputs(cfg: _Config, tree, state) -> _StepInputs:
    """Groups the state's per-leaf arrays the way this step compresses ``tree``."""
    key = jax.random.fold_in(jax.random.wrap_key_data(state.key), state.step)
    # Per device (random_k: each device its own coordinates), except dgc's sample
    # start: DGC's reference seeds every worker's Python random alike, so all
    # draw the same start.
    # shared_indices: random_k's draws alike on every device too (GRACE).
    if (
        cfg.axis_name is not None
        and cfg.needs_key
        and cfg.select_fn is not selectors.dgc_sample
        and not cfg.shared_indices
    ):
        key = jax.random.fold_in(key, lax.axis_index(cfg.axis_name))
    layout = _layout(cfg, tree)
    treedef = jax.tree.structure(tree)
    if not cfg.defer_residual:
        r_leaves = treedef.flatten_up_to(state.residual)
    else:
        # The last step's message, cleared here: XLA fuses it into the
        # accumulation's pass (see DeferredSparsifyState).
        r_leaves = [
            clear_sent(a, state.sent_threshold[i], state.sent_limit[i])
            for i, a in enumerate(treedef.flatten_up_to(state.accumulator))
        ]
    v_leaves = None if state.velocity is None else treedef.flatten_up_to(state.velocity)
    groups = tuple(
        _GroupInput(
            members=members,
            residuals=[r_leaves[i] for i in members],
            velocities=None if v_leaves is None else [v_leaves[i] for i in members],
            # Per-leaf layouts: the group's values sit at each of its leaves.
            stored=state.threshold[members[0]] if layout.per_leaf else state.threshold,
            key=jax.random.fold_in(key, members[0]) if layout.per_leaf else key,
        )
        for members in layout.groups
    )
    return _StepInputs(layout, treedef, groups, key)


def _scatter_leaves(updates, scatter) -> tuple:
    """Per leaf (flattened order), whether ``exchange="scatter"`` reduce-scatters it."""
    if scatter is None:
        raise ValueError(
            "exchange='scatter' reduce-scatters the gradients of parameters split over the data "
            "axis (FSDP): use the compressor inside jaxcomp.distributed.sharded_optimizer, which "
            "tells it which leaves are split (update argument scatter=)"
        )
    treedef = jax.tree.structure(updates)
    try:
        flags = treedef.flatten_up_to(scatter)
    except (ValueError, TypeError) as e:
        raise ValueError(f"scatter= must be a pytree of bools like the updates: {e}") from None
    return tuple(bool(f) for f in flags)


def _update(cfg: _Config, updates, state, include, scatter=None):
    check_updates(cfg, updates, state)
    raw = jax.tree.map(jnp.asarray, updates)
    if include is not None:
        include = jnp.asarray(include, jnp.bool_)
    inputs = step_inputs(cfg, raw, state)
    g_leaves = inputs.treedef.flatten_up_to(raw)
    per_leaf = inputs.layout.per_leaf
    packed = _packed_selector(cfg)
    buckets: dict[tuple, list] = {}
    alone = []
    for j, gi in enumerate(inputs.groups):
        gs = [g_leaves[i] for i in gi.members]
        n = sum(g.size for g in gs)
        if packed is not None and 0 < n and n > cfg.min_dense_size:
            # Selected together with the bucket's other groups (one buffer).
            flat = _flatten_group(cfg, gs, gi.residuals, gi.velocities)
            bucket = (
                jnp.dtype(flat.r.dtype), jnp.dtype(flat.g.dtype), jnp.dtype(flat.wire), flat.defer
            )  # fmt: skip
            buckets.setdefault(bucket, []).append((j, gi, gs, flat))
        else:
            alone.append(j)
    packs = [_pack(items, scatter) for items in buckets.values()]
    if per_leaf:
        packs = [_per_leaf_pack(cfg, p, state, inputs.key) for p in packs]
    # The non-finite policy over the packed buffers and the other leaves: a
    # packed bucket's finiteness is one reduction, not one per leaf.
    alone_leaves = [i for j in alone for i in inputs.groups[j].members]
    arrays, finite, send_ok = apply_nonfinite_policy(
        [p.g for p in packs] + [g_leaves[i] for i in alone_leaves], cfg.nonfinite
    )
    packs = [p._replace(g=g) for p, g in zip(packs, arrays, strict=False)]
    g_leaves = list(g_leaves)
    for i, g in zip(alone_leaves, arrays[len(packs) :], strict=True):
        g_leaves[i] = g
    clip = None if cfg.clip_norm is None else clip_factor(cfg, arrays)
    ctx = StepContext(state.step, send_ok, include, clip)
    outs: list[Any] = [None] * len(inputs.groups)
    for j in alone:
        gi = inputs.groups[j]
        outs[j] = compress_group(
            _leaf_exchange(cfg, scatter, gi.members),
            [g_leaves[i] for i in gi.members],
            gi.residuals,
            gi.velocities,
            gi.stored,
            gi.key,
            ctx,
            per_leaf=per_leaf,
        )
    stats = [_group_stats(inputs.groups[j].members, outs[j]) for j in alone]
    for pack in packs:
        results, pack_stats = _compress_packed(cfg, packed, pack, ctx, per_leaf)
        for (j, *_), o in zip(pack.items, results, strict=True):
            outs[j] = o
        stats.append(pack_stats)
    return finish_step(cfg, state, inputs, outs, finite, stats)


# ---------------------------------------------------------------------------
# Many groups in one buffer (jaxcomp.selection.segmented).
# ---------------------------------------------------------------------------


# The exchanges a packed step runs for all its groups at once: one collective
# (or one fixed set) per kind, whatever the number of groups (sparse
# all-gather, dense all-reduce, the server's push and pull, gossip's two
# neighbour sends per form, gTop-k's rounds, Ok-Topk's histogram, scatter and
# gather, SparCML's rounds or all-reduce; "auto" and "auto_topk" pick a kind
# per group). See _exchange_packed.
_PACKED_EXCHANGES = (
    "allgather", "dense", "auto", "server", "gossip", "gtopk", "oktopk", "sparcml", "auto_topk",
)  # fmt: skip
# ScaleCom's cyclic leader, for all groups in one all-reduce of indices and
# one of values: see _scalecom_packed.
_LEADER_EXCHANGES = ("scalecom",)


def _packed_selector(cfg: _Config):
    """``(segmented selector, options)`` when this step can select every group
    together in one packed buffer, else None (each group alone).

    Today: a selector with a segmented form (``top_k``, ``ldte_bs``, ``dgc``,
    ``gaussian_k``, ``trimmed_top_k``, ``binary_search``, ``sidco``, ``threshold``,
    ``random_k``), one device or one of the exchanges of
    :data:`_PACKED_EXCHANGES` and :data:`_LEADER_EXCHANGES` (all but
    ``scatter``).
    """
    exchanges = _PACKED_EXCHANGES + _LEADER_EXCHANGES + ("scatter",)
    if cfg.axis_name is not None and cfg.exchange not in exchanges:
        return None
    return _segmented_form(cfg)


def _segmented_form(cfg: _Config):
    """``(segmented selector, options)`` standing for ``cfg``'s selector, or None."""
    select = segmented.SEGMENTED.get(cfg.select_fn)
    if select is None:
        return None
    options = dict(cfg.options)
    if cfg.select_fn is selectors.ldte_bs:
        sample = options.get("moment_sample", selectors.DEFAULT_MOMENT_SAMPLE)
        options["probes"] = options.get("search", "interpolate") == "interpolate" and (
            sample is not None
        )
    return select, options


def _scored(cfg: _Config) -> bool:
    """Whether ``cfg``'s segmented form selects on a score buffer of its own
    (``random_k``'s draws, :data:`jaxcomp.selection.segmented.SCORES`), not on ``|acc|``."""
    return segmented.SEGMENTED.get(cfg.select_fn) in segmented.SCORES


class _Pack(NamedTuple):
    """A bucket of groups (one residual and wire dtype) packed as segments of one buffer."""

    items: list  # (group index, _GroupInput, gradient leaves, _FlatGroup) per group
    layout: segmented.SegmentLayout
    g: jax.Array  # (rows, row) gradients, wire dtype
    r: jax.Array  # residuals
    v: jax.Array | None  # velocities
    stored: jax.Array | None = None  # the groups' stored thresholds (None: from ``items``)
    keys: jax.Array | None = None  # the groups' PRNG keys (None: from ``items``)
    # exchange="scatter": per group, whether it is reduce-scattered (else "auto").
    split: tuple[bool, ...] | None = None


def _per_leaf_pack(cfg: _Config, pack: _Pack, state, key) -> _Pack:
    """``pack`` with its groups' stored thresholds and keys read at once.

    In a per-leaf layout each group's stored threshold sits at its first
    leaf and its key is the step's folded with that leaf: one gather and one
    batched ``fold_in``, not one small program piece per group.
    """
    first = np.asarray([gi.members[0] for _, gi, _, _ in pack.items], np.int32)
    keys = jax.vmap(jax.random.fold_in, (None, 0))(key, first) if cfg.needs_key else None
    return pack._replace(stored=state.threshold[first], keys=keys)


def _pack(items, scatter=None) -> _Pack:
    """``items`` packed; ``scatter``: per leaf, whether ``exchange="scatter"`` splits it."""
    flats = [flat for *_, flat in items]
    layout = segmented.SegmentLayout(tuple(int(f.g.shape[0]) for f in flats))
    rdt = flats[0].r.dtype
    return _Pack(
        items=items,
        layout=layout,
        g=layout.pack([f.g for f in flats], flats[0].g.dtype),
        r=layout.pack([f.r for f in flats], rdt),
        v=None if flats[0].v is None else layout.pack([f.v for f in flats], rdt),
        # scatter needs per-leaf groups (checked by the factory).
        split=None if scatter is None else tuple(bool(scatter[i.members[0]]) for _, i, *_ in items),
    )


def _compress_packed(
    cfg: _Config, packed, pack: _Pack, ctx, per_leaf: bool
) -> tuple[list[GroupOut], _LeafStats]:
    """One device: the groups of ``items`` selected, cut and sent together.

    Each group is a segment of one packed buffer (one residual and wire dtype);
    its result is what :func:`compress_group` gives it alone: the same
    accumulation, the segment's own selection (see
    :mod:`jaxcomp.selection.segmented`), the capacity cut per segment, the
    mask, then the same split into leaves.

    A form with a score buffer (:data:`jaxcomp.selection.segmented.SCORES`:
    ``random_k``) is selected, cut and masked on that buffer instead of
    ``|acc|``, with a capacity of ``k`` (the 1-D form's index message: exactly
    ``k``); the message holds ``acc``'s values either way.
    """
    select, options = packed
    score = segmented.SCORES.get(select)
    items, layout = pack.items, pack.layout
    sizes = layout.sizes
    wire, defer = items[0][3].wire, items[0][3].defer
    acc, u = _accumulate(cfg, pack.g, pack.r, pack.v, ctx)
    table = np.asarray([[selectors.target_count(q, n) for n in sizes] for q in cfg.phase_ratios])
    phase = None
    if len(cfg.phase_ratios) > 1:
        phase = jnp.minimum(ctx.step // cfg.steps_per_epoch, len(cfg.phase_ratios) - 1)
    targets = segmented.Targets(table, phase)
    extra = {}
    stored = pack.stored
    if stored is None:
        stored = jnp.stack([gi.stored for _, gi, _, _ in items]).astype(jnp.float32)
    if cfg.hint_previous:
        # No previous threshold before step 0 (the state's starts at 0).
        extra["hint"] = jnp.where(ctx.step == 0, jnp.float32(jnp.inf), stored)
    if cfg.needs_key:
        # Each group's key, as it would get it alone.
        keys = pack.keys
        extra["key"] = jnp.stack([gi.key for _, gi, _, _ in items]) if keys is None else keys
    # What selection, capacity cut and mask compare: acc's magnitudes, or the
    # form's own scores (random_k's draws, from the segments' keys).
    x = acc if score is None else score(layout, acc, extra.pop("key"))
    refresh = _refresh_due(cfg, ctx.step, stored)
    if refresh is None:
        sel = select(layout, x, targets, **options, **extra)
    else:
        # DLGS reuse: the selector runs when any segment is due (its results
        # kept for those), the others apply their stored threshold.
        zeros = jnp.zeros(stored.shape, jnp.int32)
        sel = lax.cond(
            jnp.any(refresh),
            lambda: varying_like(select(layout, x, targets, **options, **extra), acc),
            lambda: varying_like(segmented.SegmentSelection(stored, zeros, zeros), acc),
        )
        sel = segmented.SegmentSelection(
            jnp.where(refresh, sel.threshold, stored),
            jnp.where(refresh, sel.count, segmented.count_above(layout, x, stored)),
            jnp.where(refresh, sel.iterations, 0),
        )
    # A skipped (non-finite) step selects nothing.
    t = jnp.where(ctx.sends, sel.threshold, jnp.inf)
    count = jnp.where(ctx.sends, sel.count, 0)
    # Scores stand for an index-based selector, which sends exactly its k
    # draws whatever capacity_factor: the cut at k keeps the lower indices of
    # draws tied at the k-th, as the 1-D form's lax.top_k does.
    factor = cfg.capacity_factor if score is None else 1.0
    caps = np.vectorize(lambda k, n: _capacity(int(k), int(n), factor))(
        table, np.asarray(sizes)[None, :]
    )
    cap = targets.pick(caps.astype(np.int32))
    n_seg = jnp.asarray(np.asarray(sizes, np.int32))
    shared = None
    if cfg.shared_indices and cfg.axis_name is not None:
        # Every device's coordinates, sent or not: the same draws everywhere,
        # so the values-only exchange reads its positions from them (a device
        # skipping the step sends zeros there and keeps its residual).
        shared_cut, shared_limit = segmented.capacity_cut(layout, x, sel.threshold, sel.count, cap)
        shared = segmented.sent_mask(layout, x, shared_cut, shared_limit)
    cut, limit = lax.cond(
        jnp.any(count > cap),
        lambda: segmented.capacity_cut(layout, x, t, count, cap),
        lambda: varying_like((t, n_seg), acc),
    )
    mask = segmented.sent_mask(layout, x, cut, limit)
    # A threshold on scores means nothing for acc: 0 as the 1-D index-based
    # form reports (inf on a skipped step, as every selector's).
    shown = t if score is None else jnp.where(ctx.sends, jnp.zeros_like(t), jnp.inf)
    sent_out = _to_wire(jnp.where(mask, acc, 0), wire)
    residual = acc if defer else _keep_rest(acc, mask, sent_out)
    new_u = _mask_velocity(cfg, u, mask)
    sent = jnp.minimum(count, cap)
    if cfg.axis_name is None:
        update, wires = sent_out, jnp.zeros((len(sizes),), jnp.float32)
    elif cfg.exchange == "scalecom":
        update, wires, residual, new_u, sent, mask = _scalecom_packed(
            cfg, layout, acc, u, mask, sent_out, caps, phase, ctx
        )
    else:
        update, wires, residual, *shards = _exchange_packed(
            cfg, layout, mask, sent_out, residual, caps, phase, ctx.include, pack.split, shared
        )
    # Sliced at rows read at run time: the leaves of one shape share their
    # kernels (see SegmentLayout.runtime_rows).
    rows = layout.runtime_rows(update)
    updates, residuals = layout.unpack(update, rows), layout.unpack(residual, rows)
    if cfg.axis_name is not None and cfg.exchange == "scatter":
        # A split group's update: this device's region of it (the shards, group by group).
        n_dev = collectives.axis_size(cfg.axis_name)
        split = pack.split or (True,) * len(items)
        ends = np.cumsum([n // n_dev if q else 0 for n, q in zip(sizes, split, strict=True)])
        for j in np.flatnonzero(split):
            updates[j] = shards[0][ends[j] - sizes[j] // n_dev : ends[j]]
    velocities = [None] * len(items) if new_u is None else layout.unpack(new_u, rows)
    stats, shares = _packed_leaf_stats(
        cfg, items, layout.unpack(mask, rows), sent, shown, sel.iterations, (cut, limit), wire,
        per_leaf,
    )  # fmt: skip
    if _low_pass_on(cfg):
        # The filter reads each group's gradients after the non-finite policy
        # (pack.g), as a group compressed alone does.
        items = [(*item[:3], item[3]._replace(g=g)) for item, g in zip(
            items, layout.unpack(pack.g, rows), strict=True)]  # fmt: skip
    outs = []
    for j, (_, _, gs, flat) in enumerate(items):
        o = _FlatOut(
            update=updates[j],
            residual=residuals[j],
            velocity=velocities[j],
            count=sent[j],
            segment_counts=None if j not in shares else tuple(shares[j]),
            threshold=shown[j],
            iterations=sel.iterations[j],
            wire_bytes=wires[j],
            sent_threshold=cut[j] if defer else None,
            sent_limit=limit[j] if defer else None,
        )
        leaf_cfg = cfg if pack.split is None else _leaf_exchange(cfg, pack.split, (j,))
        outs.append(_split_group(leaf_cfg, gs, flat, o, ctx))
    return outs, stats


def _packed_leaf_stats(cfg, items, masks, sent, shown, iterations, pending, wire, per_leaf):
    """A pack's per-leaf statistics as whole arrays (pack order: group by group).

    Returns the :class:`_LeafStats` and, per merged group (index in the
    pack), each leaf's share of the group's message. ``pending`` is the
    message's (threshold, last index) per segment, kept in the statistics
    only when the items defer their residual (``defer_residual``).
    """
    defer = items[0][3].defer
    cut, limit = pending
    leaf_sizes = [[x.size for x in gs] for _, _, gs, _ in items]
    seg = np.repeat(np.arange(len(items)), [len(z) for z in leaf_sizes])
    take = (lambda x: x) if len(seg) == len(items) else (lambda x: x[seg])  # noqa: E731
    leaf_counts = take(sent)
    shares = {}
    if per_leaf and len(seg) > len(items):
        # A merged group's leaves: each its share of the message.
        for j, z in enumerate(leaf_sizes):
            if len(z) > 1:
                shares[j] = jnp.stack(
                    [jnp.sum(masks[j][lo:hi], dtype=jnp.int32) for lo, hi in _bounds(z)]
                )
        pos = np.concatenate([np.flatnonzero(seg == j) for j in shares])
        leaf_counts = leaf_counts.at[pos].set(jnp.concatenate(list(shares.values())))
    offsets = np.concatenate([[0, *itertools.accumulate(z)][:-1] for z in leaf_sizes])
    item = jnp.dtype(wire).itemsize
    pair_bytes = np.asarray(
        [_index_itemsize(cfg, f.g.shape[0]) + item for *_, f in items], np.int32
    )
    stats = _LeafStats(
        members=tuple(i for _, gi, _, _ in items for i in gi.members),
        count=leaf_counts,
        threshold=take(shown),
        iterations=take(iterations),
        # Every packed group is sent as (index, value) pairs (values only
        # with shared indices), its indices sized to the group's index space.
        message_bytes=leaf_counts * take(jnp.asarray(pair_bytes)),
        sent_threshold=take(cut) if defer else None,
        sent_limit=take(limit) - offsets.astype(np.int32) if defer else None,
    )
    return stats, shares


def _leaf_exchange(cfg: _Config, scatter, members) -> _Config:
    """``exchange="scatter"``: the leaves marked split are reduce-scattered, the others ``auto``."""
    if scatter is None or cfg.exchange != "scatter":
        return cfg
    (i,) = members  # scatter needs per-leaf groups (checked by the factory)
    return cfg if scatter[i] else dataclasses.replace(cfg, exchange="auto")


def _leaf_array(parts: list, order: np.ndarray | None) -> jax.Array:
    """Per-leaf pieces concatenated, then put in leaf order (one gather)."""
    x = parts[0] if len(parts) == 1 else jnp.concatenate(parts)
    return x if order is None else x[order]


def finish_step(cfg: _Config, state, inputs: _StepInputs, outs, finite, stats=None):
    """``(updates, new_state)`` from the groups' results, scattered back to leaf order.

    ``stats``: the per-leaf statistics as :class:`_LeafStats` covering every
    leaf once (a packed bucket gives its leaves' in one piece); None: each
    group's own.
    """
    layout, treedef = inputs.layout, inputs.treedef
    n = treedef.num_leaves
    fields = {name: [None] * n for name in ("upd", "res", "vel")}
    for gi, o in zip(inputs.groups, outs, strict=True):
        for j, i in enumerate(gi.members):
            fields["upd"][i] = o.updates[j]
            fields["res"][i] = o.residuals[j]
            fields["vel"][i] = None if o.velocities is None else o.velocities[j]
    if stats is None:
        stats = [_group_stats(gi.members, o) for gi, o in zip(inputs.groups, outs, strict=True)]
    members = np.asarray([i for s in stats for i in s.members], np.int64)
    order = None if np.array_equal(members, np.arange(n)) else np.argsort(members)

    def leaf_array(name, dtype, pending=None):
        if not n:
            return jnp.zeros([0], dtype)
        # pending: the value of a leaf with nothing pending (deferred fields).
        parts = [
            jnp.full((len(s.members),), pending, dtype) if p is None else p
            for s in stats
            for p in [getattr(s, name)]
        ]
        return _leaf_array(parts, order)

    if layout.per_leaf:
        leaf_stats = {
            "sent_count": leaf_array("count", jnp.int32),
            "threshold": leaf_array("threshold", jnp.float32),
            "search_iterations": leaf_array("iterations", jnp.int32),
            "message_bytes": leaf_array("message_bytes", jnp.int32),
        }
    else:
        (o,) = outs
        leaf_stats = {
            "sent_count": o.count,
            "threshold": o.threshold,
            "search_iterations": o.iterations,
            "message_bytes": o.message_bytes,
        }
    if cfg.defer_residual:
        memory = dict(
            accumulator=treedef.unflatten(fields["res"]),
            sent_threshold=leaf_array("sent_threshold", jnp.float32, jnp.inf),
            sent_limit=leaf_array("sent_limit", jnp.int32, 0),
        )
    elif not cfg.error_feedback:
        # Memory-less: what the step did not send is dropped (exchanges that
        # return pairs to a residual included). Zeros typed like the residual
        # (device-varying under shard_map), so a scan's carry keeps its type.
        zeros = [_vma.varying_like(jnp.zeros_like(r), r) for r in fields["res"]]
        memory = dict(residual=treedef.unflatten(zeros))
    else:
        memory = dict(residual=treedef.unflatten(fields["res"]))
    new_state = state._replace(
        step=state.step + 1,
        **memory,
        velocity=None if state.velocity is None else treedef.unflatten(fields["vel"]),
        wire_bytes=sum((o.wire_bytes for o in outs), jnp.float32(0)),
        nonfinite_steps=state.nonfinite_steps + (~finite).astype(jnp.int32),
        **leaf_stats,
    )
    return treedef.unflatten(fields["upd"]), new_state


# ---------------------------------------------------------------------------
# One group: flatten, compress, split back.
# ---------------------------------------------------------------------------


def compress_group(cfg: _Config, gs, rs, vs, stored, key, ctx, *, per_leaf) -> GroupOut:
    """Compresses a group of leaves as one buffer (a one-leaf group: the leaf itself)."""
    flat = _flatten_group(cfg, gs, rs, vs)
    packed = _packed_selector(cfg)
    if packed is not None and 0 < flat.g.shape[0] and flat.g.shape[0] > cfg.min_dense_size:
        # A group alone (the overlap path's backward rules) goes through the
        # packed engine too, as a one-segment pack: the result a packed step
        # gives it (a segment's selection depends on its own elements only).
        gi = _GroupInput(members=(), residuals=rs, velocities=vs, stored=stored, key=key)
        (out,), _ = _compress_packed(cfg, packed, _pack([(0, gi, gs, flat)]), ctx, per_leaf)
        return out
    segments = tuple(g.size for g in gs) if per_leaf and len(gs) > 1 else None
    o = _compress_flat(
        cfg, flat.g, flat.r, flat.v, stored, key, ctx, segments, defer=flat.defer, wire=flat.wire
    )
    return _split_group(cfg, gs, flat, o, ctx)


class _FlatGroup(NamedTuple):
    """A group's leaves flattened into one buffer each (see :func:`_flatten_group`)."""

    g: jax.Array  # the gradients, in the group's gradient dtype
    r: jax.Array  # the residuals, in the residual dtype
    v: jax.Array | None  # the velocities
    wire: Any  # the message's dtype (the gradient dtype, or value_dtype where narrower)
    defer: bool  # one device may leave the message in the accumulator


def _flatten_group(cfg: _Config, gs, rs, vs) -> _FlatGroup:
    # init gave every leaf of a group the group's residual dtype.
    rdt = rs[0].dtype if rs else resolve_residual_dtype(cfg.residual_dtype, [])
    dtypes = {jnp.dtype(g.dtype) for g in gs}
    # Mixed gradient dtypes travel in the residual dtype, one message.
    gdt = dtypes.pop() if len(dtypes) == 1 else rdt
    flat_g = _concat([g.reshape(-1).astype(gdt) for g in gs], gdt)
    wire = _message_dtype(cfg, gdt)
    flat_r = _concat([r.reshape(-1) for r in rs], rdt)
    flat_v = None if vs is None else _concat([v.reshape(-1) for v in vs], rdt)
    # One device defers clearing the message from the accumulator (see
    # DeferredSparsifyState) when the update is the accumulator's values themselves:
    # no leaf-dtype rounding to keep, no low-pass filter on the residual, and
    # the stored accumulator is what the mask compared.
    defer = (
        cfg.defer_residual
        and cfg.axis_name is None
        and not _low_pass_on(cfg)
        and all(jnp.dtype(g.dtype) == rdt for g in gs)
        and wire == rdt
        # A residual narrower than float32: XLA:CPU compares the fused sum
        # unrounded, so the next step's mask, on the stored (rounded) value,
        # could disagree with this step's.
        and jnp.dtype(rdt).itemsize >= 4
        # A packed mask on scores (random_k's draws) is not one the next step
        # could compare again on the accumulator.
        and not _scored(cfg)
    )
    return _FlatGroup(flat_g, flat_r, flat_v, wire, defer)


def _exchange_packed(
    cfg: _Config, layout, mask, sent_out, residual, caps, phase, include=None, split=None,
    shared=None,
):  # fmt: skip
    """The packed messages' mean over ``cfg.axis_name``, one collective (or
    one fixed set) per kind of exchange for all segments: one all-gather of
    the (index, value) pairs of every sparse-sent segment, one all-reduce of
    every dense-sent one, gTop-k's rounds and Ok-Topk's scatter and gather
    for all their segments at once (``"auto"``, ``"auto_topk"``: a kind per
    segment and warm-up phase, as
    :func:`jaxcomp.comm.sparse_allreduce.choose_exchange` picks for the group
    alone). Returns the packed update, each segment's wire bytes (the formula
    its own exchange would report, so the step's total is the per-group sum)
    and the packed residual, with what gTop-k and Ok-Topk dropped added back
    as the group alone adds it. ``include``: this device's backup-worker flag
    (the means over the included devices).

    Each segment's update is what its group alone gets, bit for bit, except
    under SparCML: its choice between sparse rounds and a dense all-reduce is
    made once for all its segments (their total count against the union
    capacity of their total size), as SparCML decides for one fused buffer,
    not per group. Its result is the exact mean either way; only the order of
    the additions, and the bytes, can differ from the per-group choice.

    Message formats: with ``value_dtype`` the update comes back in the
    residual's dtype (the all-gather adds the 16-bit values there, a dense
    all-reduce in 16 bits); with ``index_dtype="uint16"`` the segments of
    fewer than ``2^16`` elements all-gather ``uint16`` offsets into their
    own segment (kind ``"allgather16"``); with ``shared_indices`` (``shared``:
    the mask every device draws alike) the segments all-reduce their values
    only (kind ``"shared"``).
    """
    if include is not None:
        sparse_allreduce.check_include(cfg.exchange)
        if cfg.shared_indices:
            raise ValueError(
                "shared_indices=True all-reduces the values of every device: include= (backup "
                "workers) is not supported with it"
            )
    n_dev = collectives.axis_size(cfg.axis_name)
    item = jnp.dtype(sent_out.dtype).itemsize
    sizes = layout.sizes
    size = layout.num_rows * layout.row
    wide = residual.dtype if sent_out.dtype != residual.dtype and cfg.value_dtype else None
    index_bytes = [_index_itemsize(cfg, n) for n in sizes]

    def branch(p):
        kinds = _packed_kinds(cfg.exchange, caps[p], sizes, item, n_dev, split, index_bytes)
        of_kind = {k: [s for s, kind in enumerate(kinds) if kind == k] for k in set(kinds)}

        def slots(kind):
            return [int(caps[p][s]) if kinds[s] == kind else 0 for s in range(len(sizes))]

        def rows(kind):
            return jnp.asarray(np.isin(layout.row_segment, of_kind[kind])[:, None])

        update = jnp.zeros(sent_out.shape, sent_out.dtype if wide is None else wide)
        flat_res = residual.reshape(-1)
        extra_wire = jnp.float32(0)
        shards = None
        if "gossip_sparse" in of_kind:
            idx, vals = segmented.extract(layout, sent_out, mask, slots("gossip_sparse"))
            own = jnp.where(rows("gossip_sparse"), sent_out, 0)
            # This device's ring mix over the whole buffer: zero outside these
            # segments (no message there), where the dense-sent ones go next.
            mixed, _ = collectives.gossip_sparse_mean(
                idx, vals, update.size, cfg.axis_name, dense=own.reshape(-1)
            )
            update = mixed.reshape(update.shape)
        if "gossip_dense" in of_kind:
            segs = of_kind["gossip_dense"]
            flat = segmented.compact(layout, sent_out, segs)
            mixed, _ = collectives.gossip_mean(flat, cfg.axis_name)
            update = segmented.expand(layout, mixed, segs, update.astype(mixed.dtype))
        if "server" in of_kind:
            idx, vals = segmented.extract(layout, sent_out, mask, slots("server"))
            # The server adds into, and sends back, the segments' own elements
            # (no padding rows on the wire): packed positions in compact order.
            idx, n_compact = _compact_positions(layout, of_kind["server"], slots("server"), idx)
            mean, _ = collectives.server_sparse_mean(
                idx, vals, n_compact, cfg.axis_name, servers=cfg.servers
            )
            update = segmented.expand(layout, mean, of_kind["server"], update)
        if "sparcml" in of_kind:
            segs = of_kind["sparcml"]
            idx, vals = segmented.extract(layout, sent_out, mask, slots("sparcml"))
            idx, n_compact = _compact_positions(layout, segs, slots("sparcml"), idx)
            dense = segmented.compact(layout, sent_out, segs)
            ex = sparse_allreduce.sparcml_mean(idx, vals, n_compact, cfg.axis_name, dense=dense)
            update = segmented.expand(layout, ex.update, segs, update)
            extra_wire = ex.wire_bytes
        if "dense" in of_kind:
            segs = of_kind["dense"]
            flat = segmented.compact(layout, sent_out, segs)
            mean, _ = collectives.dense_mean(flat, cfg.axis_name, include=include)
            update = segmented.expand(layout, mean.astype(update.dtype), segs, update)
        if "scatter" in of_kind:
            segs = of_kind["scatter"]
            idx, vals = segmented.extract(layout, sent_out, mask, slots("scatter"))
            starts = layout.starts * layout.row
            ex = sparse_allreduce.scatter_mean_segments(
                idx, vals, size, cfg.axis_name, slots("scatter"), starts, sizes
            )
            # This device's regions, segment by segment: typed per device, so
            # apart from the update buffer (whose other segments are averages).
            shards = ex.update
            if ex.returned_indices is not None:  # the overflow (none on one device)
                back_idx, back = _returned_pairs(cfg, ex, residual.dtype)
                flat_res = flat_res.at[back_idx].add(back, mode="drop")
        for kind in ("allgather", "allgather16", "shared", "gtopk", "oktopk"):
            if kind not in of_kind:
                continue
            idx, vals = segmented.extract(
                layout, sent_out, mask if kind != "shared" else shared, slots(kind)
            )
            if kind == "allgather":
                mean, _ = collectives.sparse_mean(
                    idx, vals, size, cfg.axis_name, include=include, sum_dtype=wide
                )
            elif kind == "allgather16":
                # Each slot's index as an offset into its own segment: 16 bits.
                seg = np.repeat(np.arange(len(sizes)), slots(kind))
                offsets = (layout.starts * layout.row)[seg].astype(np.int32)
                spans = np.asarray(sizes, np.int32)[seg]
                local = jnp.where(idx < size, idx - offsets, spans).astype(jnp.uint16)
                mean, _ = collectives.sparse_mean(
                    local, vals, size, cfg.axis_name, include=include, sum_dtype=wide,
                    regions=(offsets, spans),
                )  # fmt: skip
            elif kind == "shared":
                # The same positions on every device: the mean of the values alone.
                vals_mean, _ = collectives.dense_mean(vals, cfg.axis_name)
                mean = (
                    jnp.zeros((size,), update.dtype)
                    .at[idx]
                    .set(vals_mean.astype(update.dtype), mode="drop")
                )
            else:
                if kind == "gtopk":
                    ex = sparse_allreduce.gtopk_mean_segments(
                        idx, vals, size, cfg.axis_name, slots(kind)
                    )
                else:
                    ex = sparse_allreduce.oktopk_mean_segments(
                        idx, vals, size, cfg.axis_name, slots(kind),
                        layout.starts * layout.row, sizes,
                    )  # fmt: skip
                mean = ex.update
                if ex.returned_indices is not None:
                    back_idx, back = _returned_pairs(cfg, ex, residual.dtype)
                    flat_res = flat_res.at[back_idx].add(back, mode="drop")
            mean = mean.reshape(update.shape)
            update = mean if len(of_kind) == 1 else jnp.where(rows(kind), mean, update)
        # Servers whose key range of the server segments' compact buffer is not
        # empty: the ones that receive the pushes (server_sparse_mean).
        served = sum(int(sizes[s]) for s in of_kind.get("server", []))
        pushed_to = sum(hi > lo for lo, hi in collectives.server_ranges(served, cfg.servers)) or 1
        wires = _packed_wire_bytes(
            kinds, caps[p], sizes, item, n_dev, include is not None, pushed_to
        )
        wires = jnp.asarray(wires).at[0].add(extra_wire)
        out = update, wires, flat_res.reshape(residual.shape)
        return out if cfg.exchange != "scatter" else (*out, shards)

    if phase is None:
        return branch(0)
    return lax.switch(phase, [functools.partial(branch, p) for p in range(caps.shape[0])])


def _packed_kinds(
    exchange: str, caps, sizes, item: int, n_dev: int, split, index_bytes=None
) -> list:
    """The exchange each segment of a pack runs, as its group alone would pick it.

    ``index_bytes``: per segment, bytes per index of its message (None: 4);
    2 makes its all-gather ``"allgather16"``, 0 (shared indices) its sparse
    exchange ``"shared"``, the values alone all-reduced.
    """
    index_bytes = [4] * len(sizes) if index_bytes is None else index_bytes
    kinds = [
        sparse_allreduce.choose_exchange(exchange, int(c), n, item, n_dev, index_itemsize=b)
        if b
        else ("dense" if exchange == "dense" else "shared")
        for c, n, b in zip(caps, sizes, index_bytes, strict=True)
    ]
    kinds = [
        "allgather16" if kind == "allgather" and b == 2 else kind
        for kind, b in zip(kinds, index_bytes, strict=True)
    ]
    if exchange == "scatter":
        # split: reduce-scattered; the others "auto" (a one-group pack: split).
        kinds = [
            "scatter" if split is None or split[s] else kind
            for s, kind in enumerate(
                sparse_allreduce.choose_exchange("auto", int(c), n, item, n_dev)
                for c, n in zip(caps, sizes, strict=True)
            )
        ]
    if exchange == "gossip":
        # Each group's message in whichever form is smaller, as it alone would send it.
        pairs = [
            sparse_allreduce.gossip_sends_pairs(int(c), n, item)
            for c, n in zip(caps, sizes, strict=True)
        ]
        kinds = ["gossip_sparse" if q else "gossip_dense" for q in pairs]
    return kinds


def _packed_wire_bytes(
    kinds, caps, sizes, item: int, n_dev: int, flagged: bool, servers: int = 1
) -> np.ndarray:
    """Each segment's wire bytes (float32), the formula its group's own exchange reports.

    ``flagged``: with ``include=`` each exchange alone would also count its
    psum of the flags. SparCML reports one total for all its segments: the
    caller adds it to the first. ``servers``: how many servers of a group
    receive the whole message each (:func:`jaxcomp.comm.server_sparse_mean`).
    """
    flags = 4 if flagged else 0
    rounds = sparse_allreduce.gtopk_rounds(n_dev) if n_dev > 1 else 0
    wire_of = {
        "allgather": lambda c, n: (
            collectives.allgather_bytes(c * (4 + item), n_dev)
            + (collectives.allreduce_bytes(flags, n_dev) if flags else 0)
        ),
        "allgather16": lambda c, n: (
            collectives.allgather_bytes(c * (2 + item), n_dev)
            + (collectives.allreduce_bytes(flags, n_dev) if flags else 0)
        ),
        "shared": lambda c, n: collectives.allreduce_bytes(c * item, n_dev),
        "dense": lambda c, n: collectives.allreduce_bytes(n * item + flags, n_dev),
        "server": lambda c, n: collectives.server_link_bytes(
            servers * c * (4 + item), n * item, n_dev
        )["worker"],
        "gossip_sparse": lambda c, n: 2 * c * (4 + item) if n_dev > 1 else 0,
        "gossip_dense": lambda c, n: 2 * n * item if n_dev > 1 else 0,
        "gtopk": lambda c, n: rounds * c * (4 + item),
        "oktopk": lambda c, n: sparse_allreduce.oktopk_wire_bytes(c, n_dev, item),
        "sparcml": lambda c, n: 0,
        "scatter": lambda c, n: (
            (n_dev - 1) * sparse_allreduce.scatter_capacity(c, n_dev) * (4 + item)
        ),
    }
    wires = [wire_of[kind](int(c), n) for c, n, kind in zip(caps, sizes, kinds, strict=True)]
    return np.asarray(wires, np.float32)


def _scalecom_packed(cfg: _Config, layout, acc, u, mask, sent_out, caps, phase, ctx):
    """ScaleCom's cyclic leader for every segment at once: the leader's pairs
    of all segments in one all-reduce of indices and one of values
    (:func:`jaxcomp.comm.sparse_allreduce.cyclic_mean` over the packed
    positions). Every device then sends, and clears from its residual and
    velocity, its own values at the leader's positions, as each group alone
    does (:func:`_send_extracted`). Returns ``(update, wire bytes per segment,
    residual, velocity, sent count per segment, the leader's mask)``.
    """
    if ctx.include is not None:
        sparse_allreduce.check_include(cfg.exchange)
    size = layout.num_rows * layout.row
    wire = sent_out.dtype
    flat_acc = acc.reshape(-1)
    flat_u = None if u is None else u.reshape(-1)
    n_dev = collectives.axis_size(cfg.axis_name)
    item = jnp.dtype(wire).itemsize

    def values(ids):  # a device that skips the step sends zeros and keeps its residual
        return _to_wire(jnp.where(ctx.sends, _values_at(flat_acc, ids), 0), wire)

    def branch(p):
        own, _ = segmented.extract(layout, sent_out, mask, caps[p])
        ex, idx = sparse_allreduce.cyclic_mean(own, values, size, cfg.axis_name, ctx.step)
        idx = jnp.where(ctx.sends, idx, size)
        _, res, vel = _scatter_message(cfg, flat_acc, flat_u, idx, _values_at(flat_acc, idx), wire)
        slot_segment = np.repeat(np.arange(len(layout.sizes)), caps[p]).astype(np.int32)
        sent = jax.ops.segment_sum(
            (idx < size).astype(jnp.int32), slot_segment, len(layout.sizes), indices_are_sorted=True
        )
        wires = [
            collectives.allreduce_bytes(int(c) * 4, n_dev)
            + collectives.allreduce_bytes(int(c) * item, n_dev)
            for c in caps[p]
        ]
        leader = jnp.zeros((size,), bool).at[idx].set(True, mode="drop")
        return (
            ex.update.reshape(acc.shape),
            jnp.asarray(np.asarray(wires, np.float32)),
            res.reshape(acc.shape),
            None if vel is None else vel.reshape(acc.shape),
            sent,
            leader.reshape(acc.shape),
        )

    if phase is None:
        return branch(0)
    return lax.switch(phase, [functools.partial(branch, p) for p in range(caps.shape[0])])


def _compact_positions(layout, segments, slots, idx):
    """Packed flat positions of ``segments``' message slots as positions in
    their compact order (:func:`jaxcomp.selection.segmented.compact`), padding
    slots (index ``num_rows * row``) past its end. Returns ``(positions, size)``."""
    sizes = np.asarray(layout.sizes, np.int64)
    offset = np.zeros(len(sizes), np.int64)
    offset[segments] = np.concatenate([[0], np.cumsum(sizes[segments])[:-1]])
    n_compact = int(sizes[segments].sum())
    slot_seg = np.repeat(np.arange(len(sizes)), slots)
    shift = jnp.asarray((offset - layout.starts * layout.row)[slot_seg].astype(np.int32))
    padding = idx >= layout.num_rows * layout.row
    return jnp.where(padding, n_compact, idx + shift), n_compact


def _split_group(cfg: _Config, gs, flat: _FlatGroup, o: _FlatOut, ctx) -> GroupOut:
    """One group's compressed buffer split back into its leaves."""
    sizes = [g.size for g in gs]
    flat_g, flat_r, flat_v, wire = flat.g, flat.r, flat.v, flat.wire
    rdt = flat_r.dtype

    def split(flat):
        if len(sizes) == 1:
            parts = [flat]
        else:
            parts = jnp.split(flat, list(itertools.accumulate(sizes))[:-1]) if sizes else []
        return [p.reshape(g.shape) for p, g in zip(parts, gs, strict=True)]

    if cfg.exchange == "scatter":
        # This device's slice of the one leaf: its first dimension split over the devices.
        (g,) = gs
        n_dev = collectives.axis_size(cfg.axis_name)
        wide = [o.update.reshape(g.shape[0] // n_dev, *g.shape[1:])]
    else:
        wide = split(o.update)
    # A leaf narrower than the group's message (float16 beside float32 leaves)
    # gets its share saturated at its largest finite value, not inf.
    updates = [_to_wire(u, g.dtype) for u, g in zip(wide, gs, strict=True)]
    residuals = split(o.residual)

    def exact(uw, u):  # the cast to the leaf dtype widens (a 16-bit value_dtype): nothing to keep
        return jnp.promote_types(uw.dtype, u.dtype) == u.dtype

    if cfg.axis_name is None:
        # Casting a leaf's share of the message to its own dtype rounds it
        # (or saturates it): keep that in the residual too (exact, as for one leaf).
        residuals = [
            r if exact(uw, u) else r + (uw.astype(rdt) - u.astype(rdt))
            for r, uw, u in zip(residuals, wide, updates, strict=True)
        ]
    else:
        # What saturation cut off the exchanged update is the same on every
        # device: each keeps it, so the residuals together keep N times what
        # the update could not hold (the rounding to the leaf dtype is not kept).
        residuals = [
            r if exact(uw, u) else r + _saturated_excess(uw, u.dtype).astype(rdt)
            for r, uw, u in zip(residuals, wide, updates, strict=True)
        ]
    if _low_pass_on(cfg):
        # Filtered last: the leaf-dtype rounding above is part of what went unsent.
        before = split(_residual_from_accumulator(cfg, flat_g, flat_r, flat_v, ctx))
        residuals = [_low_pass(cfg, b, r) for b, r in zip(before, residuals, strict=True)]
    velocities = None if o.velocity is None else split(o.velocity)
    sent_thresholds = sent_limits = None
    if o.sent_limit is not None:
        # Each leaf's share of the group's message: its own flat indices.
        starts = np.asarray([0, *itertools.accumulate(sizes)][:-1], np.int32)
        sent_thresholds = jnp.broadcast_to(o.sent_threshold, (len(gs),))
        sent_limits = o.sent_limit - starts

    n = flat_g.shape[0]
    item = jnp.dtype(wire).itemsize
    per_element = item if (n == 0 or n <= cfg.min_dense_size) else _index_itemsize(cfg, n) + item
    # Per-leaf shares of a merged group's message; a one-leaf group's (and the
    # global layout's, which keeps only the group's totals) is the count.
    if o.segment_counts is None:
        leaf_counts = jnp.broadcast_to(o.count, (len(gs),))
    else:
        leaf_counts = jnp.stack(o.segment_counts)
    return GroupOut(
        updates=updates,
        residuals=residuals,
        velocities=velocities,
        count=o.count,
        leaf_counts=leaf_counts,
        threshold=o.threshold,
        iterations=o.iterations,
        message_bytes=o.count * per_element,
        leaf_bytes=leaf_counts * per_element,
        wire_bytes=o.wire_bytes,
        sent_thresholds=sent_thresholds,
        sent_limits=sent_limits,
    )


def _compress_flat(
    cfg: _Config, g, residual, velocity, stored, key, ctx, segments, *, defer=False, wire=None
) -> _FlatOut:
    """One 1-D buffer: accumulate, select (or reuse) per warm-up phase, send.

    ``defer``: a masked send may leave the message in the accumulator (see
    DeferredSparsifyState); the output's ``sent_limit`` then says it did.
    ``wire``: the message's dtype (None: ``g``'s).
    """
    n = g.shape[0]
    wire = g.dtype if wire is None else wire
    acc, u = _accumulate(cfg, g, residual, velocity, ctx)
    if n == 0 or n <= cfg.min_dense_size:
        return _send_dense(cfg, acc, u, wire, ctx, segments)
    refresh = _refresh_due(cfg, ctx.step, stored)

    def phase(ratio):
        k = selectors.target_count(ratio, n)
        cap = _capacity(k, n, cfg.capacity_factor)
        return functools.partial(
            _select_and_send,
            cfg,
            acc,
            u,
            k,
            cap,
            wire,
            key,
            ctx,
            stored,
            refresh,
            segments,
            defer=defer,
        )

    branches = [phase(r) for r in cfg.phase_ratios]
    if len(branches) == 1:
        return branches[0]()
    idx = jnp.minimum(ctx.step // cfg.steps_per_epoch, len(branches) - 1)

    # Branch outputs must agree in device variance under shard_map: the
    # per-device outputs are cast to varying; the update is exchanged
    # (invariant) or local (varying) alike in every phase, and must stay
    # invariant when exchanged (make_train_step reads it).
    def matched(branch):
        o = branch()
        local = o._replace(update=None, wire_bytes=None)
        return varying_like(local, acc)._replace(update=o.update, wire_bytes=o.wire_bytes)

    return lax.switch(idx, [lambda _, b=b: matched(b) for b in branches], None)


def _low_pass_on(cfg: _Config) -> bool:
    return V.is_dynamic(cfg.low_pass) or cfg.low_pass != 1.0


def _residual_from_accumulator(cfg: _Config, g, residual, velocity, ctx: StepContext):
    """The old residual as ``acc - increment``, for the low-pass filter.

    Reading ``residual`` itself after the accumulation made XLA copy it
    instead of accumulating in place: the filter added 4-5 ms to the donated
    one-device ``ldte_bs`` update at 2^22 (9.9-12 ms), 13 ms with momentum;
    this way 1-3.5 ms.
    ``_accumulate`` here is the step's own (XLA merges the two). It is the
    old residual to a rounding of ``acc``, and exactly it on a skipped step
    (a zero increment). (``low_pass`` excludes residual scaling: no scales here.)
    """
    acc, u = _accumulate(cfg, g, residual, velocity, ctx)
    parts, _ = _increments(cfg, g.astype(acc.dtype), velocity, ctx)
    return acc - functools.reduce(jnp.add, parts)


def _low_pass(cfg: _Config, residual, new_residual):
    """ScaleCom's low-pass filter: ``r + beta * (r_new - r)`` (plain error feedback at 1).

    A step from the old residual: a step that changed nothing (a skipped one)
    leaves the residual as it was. A traced ``beta`` of 1 keeps ``r_new``
    itself (in floating point ``r + (r_new - r)`` need not equal ``r_new``):
    injecting the default loses nothing.
    """
    beta = cfg.low_pass
    dynamic = V.is_dynamic(beta)
    if dynamic:
        beta = jnp.asarray(beta).astype(residual.dtype)
    filtered = residual + beta * (new_residual - residual)
    return jnp.where(beta == 1, new_residual, filtered) if dynamic else filtered


def _rounded(g, step):
    """``g``'s bits through an integer xor with a zero no compiler sees: rounded before an add.

    XLA may fuse the operation that produced a value into the kernel that
    adds to it; where that is a multiply (``nn.BatchNorm``'s scale gradient
    ends in ``rsqrt(var + eps) * sum(...)``; momentum's ``m * velocity``),
    LLVM contracts ``r + a * b`` into one fused multiply-add at XLA:CPU's
    default optimisation level (GPU code generators may too), in some
    kernels and not in others: one rounding where a materialised product
    gets two. With ``overlap=True`` the accumulation sits in the backward
    pass, in other kernels than after it, and the results parted by an ulp.
    ``(step | 1) / (step | 1)`` is exactly 1.0 for every int32 step (a finite
    nonzero float32 over itself) but no constant to XLA or LLVM, so its bits
    xor 1.0's are a run-time 0: the product is rounded, passed through
    unchanged (every value, NaN payloads included), then added. An integer
    op per element inside the kernel; ``lax.optimization_barrier`` would cost
    nothing but XLA:CPU removes it before fusing, and a multiply by the 1.0
    can be folded by XLA's simplifier into a neighbouring constant multiply.
    """
    s = (jnp.asarray(step, jnp.int32) | 1).astype(jnp.float32)
    # 0 at run time (s / s is exactly 1.0), unknown to XLA and LLVM: xor-ing
    # the bits with it keeps them, and no multiply-add can be formed across
    # an integer operation (a multiply by s / s could be folded into a
    # neighbouring constant multiply by XLA's simplifier).
    zero = lax.bitcast_convert_type(s / s, jnp.int32) ^ jnp.int32(0x3F800000)
    bits = jnp.dtype(f"int{jnp.dtype(g.dtype).itemsize * 8}")
    return lax.bitcast_convert_type(lax.bitcast_convert_type(g, bits) ^ zero.astype(bits), g.dtype)


def _increments(cfg: _Config, g, velocity, ctx: StepContext):
    """``(parts, u)``: what this step adds to the residual, in order, and the new velocity.

    ``parts`` is ``(g,)`` without momentum, ``(u,)`` with DGC's momentum
    correction and ``(u, g)`` with its Nesterov form (added in that order, as
    ``vec.add_(mmt).add_(grad)`` in DGC's ``DGCSGDMemory.compensate``); zeros
    on a skipped step. ``g`` is in the residual dtype; DGC's local clipping
    (``ctx.clip``) scales it first.
    """
    rdt = g.dtype
    send_ok = ctx.send_ok
    g = _rounded(g, ctx.step)
    if ctx.clip is not None:
        # DGC's grad.mul_(clip_coef), rounded before any add (no FMA).
        g = _rounded(g * ctx.clip.astype(rdt), ctx.step)
    if velocity is None:
        return (g,), None
    # An injected (array) momentum rounds like a Python float would.
    m = cfg.momentum.astype(rdt) if V.is_dynamic(cfg.momentum) else cfg.momentum
    # m * (...) rounded before the add too: XLA fuses this add into other
    # kernels in the two overlap paths, and LLVM may form an FMA in one only.
    if cfg.nesterov:
        # mmt.add_(grad).mul_(momentum)
        u = jnp.where(send_ok, _rounded(m * (velocity + g), ctx.step), velocity)
        # A skipped step's g is zero already (the non-finite policy), or NaN-free.
        return (jnp.where(send_ok, u, 0), jnp.where(send_ok, g, 0)), u
    u = jnp.where(send_ok, _rounded(m * velocity, ctx.step) + g, velocity)
    # A skipped step leaves both the velocity and the residual as they were.
    return (jnp.where(send_ok, u, 0),), u


def _accumulate(cfg: _Config, g, residual, velocity, ctx: StepContext):
    """``(R, u)``: the accumulator in the residual dtype and the new velocity (or None)."""
    rdt = residual.dtype  # fixed per group by init (resolve_residual_dtype)
    parts, u = _increments(cfg, g.astype(rdt), velocity, ctx)
    if not cfg.scaling.on:
        return functools.reduce(jnp.add, parts, residual), u
    # GRACE's residual_scale * e + gradient_scale * increment; a skipped step
    # keeps the residual as it was (no decay).
    acc = scaled_accumulation(
        cfg.scaling,
        residual,
        functools.reduce(jnp.add, parts),
        rounded=functools.partial(_rounded, step=ctx.step),
    )
    return jnp.where(ctx.send_ok, acc, residual), u


def clip_factor(cfg: _Config, arrays) -> jax.Array:
    """DGC's local clipping factor of this device's gradients (float32 scalar).

    ``min(1, c / sqrt(N) / (||g|| + 1e-6))`` with ``||g||`` the L2 norm of all
    ``arrays`` together (the packed buffers and the other leaves, after the
    non-finite policy): one sum of squares per array and one scalar
    reduction behind an ``optimization_barrier`` (as
    :func:`jaxcomp.transforms.base.tree_all_finite`), not a per-leaf chain.
    The ``1e-6`` and the form ``g * (c / (norm + 1e-6))`` where that is below 1
    are ``clip_grad_norm_`` of DGC's ``dgc/clip_grad.py``.
    """
    sums = [jnp.sum(jnp.square(a.astype(jnp.float32))) for a in arrays if a.size]
    if not sums:
        return jnp.float32(1)
    total = jnp.sum(lax.optimization_barrier(jnp.stack(sums)))
    n_dev = 1 if cfg.axis_name is None else collectives.axis_size(cfg.axis_name)
    threshold = jnp.asarray(cfg.clip_norm, jnp.float32) / jnp.float32(math.sqrt(n_dev))
    coef = threshold / (jnp.sqrt(total) + jnp.float32(1e-6))
    return jnp.where(coef < 1, coef, jnp.float32(1))


def _refresh_due(cfg: _Config, step, stored):
    """Whether the selector runs this step (None: every step, no reuse)."""
    if cfg.reuse_period == 1:
        return None
    # inf: the last step sent nothing. 0: it found fewer than k nonzero
    # magnitudes; applied again, it would pass every nonzero and leave the
    # choice to the capacity cut on every step.
    due = (step % cfg.reuse_period == 0) | ~jnp.isfinite(stored) | (stored <= 0)
    if len(cfg.phase_ratios) > 1:  # the first step of every warm-up phase
        spe = cfg.steps_per_epoch
        due = due | ((step % spe == 0) & (step // spe < len(cfg.phase_ratios)))
    return due


# ---------------------------------------------------------------------------
# Selection and sending.
# ---------------------------------------------------------------------------


def _run_selector(cfg: _Config, acc, k, key, stored) -> selectors.Selection:
    form = _segmented_form(cfg)
    # A scored form's threshold is on its scores, not on acc: the 1-D selector
    # serves (random_k: the same draws, as indices).
    if form is not None and not _scored(cfg):
        # The segmented form on one segment: the threshold a packed step
        # would give this group (ldte_bs's estimate is the segmented one's).
        select, options = form
        layout = segmented.SegmentLayout((acc.shape[0],))
        extra = {"hint": jnp.asarray(stored, jnp.float32)[None]} if cfg.hint_previous else {}
        if cfg.needs_key:
            extra["key"] = key[None]
        sel = select(
            layout, layout.pack([acc], acc.dtype), segmented.Targets(np.array([[k]])),
            **options, **extra,
        )  # fmt: skip
        return selectors.Selection(sel.threshold[0], sel.count[0], sel.iterations[0])
    extra = {}
    if cfg.needs_key:
        extra["key"] = key
    if cfg.hint_previous:
        extra["hint"] = stored  # the previous step's threshold (inf at first)
    return _checked_selection(cfg.select_fn, cfg.select_fn(acc, k, **cfg.options, **extra))


def _checked_selection(select_fn, sel) -> selectors.Selection:
    """``sel`` if it is a ``Selection``; else a ValueError naming the selector (a custom one)."""
    if isinstance(sel, selectors.Selection):
        return sel
    name = getattr(select_fn, "__qualname__", None) or repr(select_fn)
    raise ValueError(
        f"selector {name} returned a {type(sel).__name__}, not a Selection: a selector "
        "returns jaxcomp.selection.Selection(threshold, count, iterations[, indices]), "
        "e.g. Selection(t, jnp.sum(jnp.abs(x) > t), jnp.int32(0))"
    )


def _select(cfg: _Config, acc, k, key, stored, refresh, *, count_needed) -> selectors.Selection:
    """The selector's decision, or on a reuse step the stored threshold's.

    Only the scalar decision is inside the ``lax.cond`` (XLA:CPU runs
    conditional branches unfused; the dense work stays outside), and no
    collective is: devices may disagree on ``refresh``. On a reuse step the
    count is needed only by the one-device mask path (the extraction counts).
    """
    if refresh is None:
        return _run_selector(cfg, acc, k, key, stored)

    def fresh(acc, stored):
        sel = _run_selector(cfg, acc, k, key, stored)
        return (
            jnp.asarray(sel.threshold, jnp.float32),
            jnp.asarray(sel.count, jnp.int32),
            jnp.asarray(sel.iterations, jnp.int32),
        )

    def reuse(acc, stored):
        t = stored.astype(jnp.float32)
        count = kernels.count_above(jnp.abs(acc), t) if count_needed else jnp.int32(0)
        return t, count, jnp.int32(0)

    t, count, iterations = _vma.cond(refresh, fresh, reuse, acc, stored)
    return selectors.Selection(t, count, iterations)


def _select_and_send(
    cfg: _Config, acc, u, k, cap, out_dtype, key, ctx, stored, refresh, segments, *, defer=False
) -> _FlatOut:
    # A left-out backup worker selects nothing: its message is absent from
    # the mean and everything stays in its residual (nothing lost; with low_pass < 1
    # the filter still keeps only beta of it, as on any step).
    send_ok = ctx.sends
    n = acc.shape[0]
    masked = cfg.axis_name is None
    x = None
    if masked and not defer and cfg.select_fn not in (selectors.exact_top_k, selectors.sort_top_k):
        # One device, writing the residual now (not deferred): the selector
        # and the overflow cond of _send_masked read their own copy of the
        # accumulator, equal bit for bit (x + (-0.0) == x, NaN stays NaN; the
        # barrier keeps XLA from folding the add or merging the copy into
        # acc). XLA:CPU cannot update an n-sized value in place once it has
        # been read inside a conditional or while loop (the selector's search,
        # the overflow cond), and the step has two n-sized outputs for one
        # donated buffer: an `acc` read there needed a fresh n-sized temporary
        # on every call (page faults). With the copy, acc and the update reuse
        # the donated residual's buffer and the copy and the new residual
        # share the one fresh output buffer: one extra pass, one fresh buffer
        # fewer (ldte_bs at 2^24: 96-101 vs 121-124 ms,
        # experiments/bench_update.py). Not for top-k and sort: they
        # materialise |x| for lax.top_k / the sort anyway and have no control
        # flow over x, so the copy would be a third n-sized buffer. Deferred
        # (defer_residual=True), acc is an output as it is, never written
        # after the selector read it: no copy needed.
        x = acc + lax.optimization_barrier(jnp.array(-0.0, acc.dtype))
    if cfg.hint_previous:
        # The state's threshold starts at 0: no previous threshold before step 0.
        # (On step 0 the selector always runs, so the reuse path never reads it.)
        stored = jnp.where(ctx.step == 0, jnp.float32(jnp.inf), stored)
    sel = _select(cfg, acc if x is None else x, k, key, stored, refresh, count_needed=masked)
    # A skipped (non-finite) step selects nothing.
    sel = sel._replace(
        threshold=jnp.where(send_ok, sel.threshold, jnp.inf),
        count=jnp.where(send_ok, sel.count, 0),
        indices=None if sel.indices is None else jnp.where(send_ok, sel.indices, n),
    )
    if sel.indices is None and masked:
        return _send_masked(cfg, acc, u, sel, cap, out_dtype, segments, x, defer=defer)
    return _send_extracted(cfg, acc, u, sel, cap, out_dtype, ctx, segments)


def _send_dense(cfg: _Config, acc, u, out_dtype, ctx, segments) -> _FlatOut:
    """A small (or empty) buffer sent whole."""
    n = acc.shape[0]
    sent_out = _to_wire(jnp.where(ctx.sends, acc, 0), out_dtype)
    new_res = acc - sent_out.astype(acc.dtype)
    new_u = u
    if u is not None and cfg.momentum_masking:
        new_u = jnp.where(ctx.sends, 0, u)
    if cfg.axis_name is None:
        update, wire = sent_out, jnp.float32(0)
    elif cfg.exchange in ("server", "gossip"):
        if ctx.include is not None:  # server_mean divides by N; gossip mixes neighbours
            sparse_allreduce.check_include(cfg.exchange)
        if cfg.exchange == "server":
            update, wire = collectives.server_mean(sent_out, cfg.axis_name, servers=cfg.servers)
        else:  # this device's ring mix, not the mean
            update, wire = collectives.gossip_mean(sent_out, cfg.axis_name)
    elif cfg.exchange == "scatter":
        if ctx.include is not None:
            sparse_allreduce.check_include(cfg.exchange)
        update, wire = collectives.dense_scatter_mean(sent_out, cfg.axis_name)
    else:
        update, wire = collectives.dense_mean(sent_out, cfg.axis_name, include=ctx.include)
    count = jnp.where(ctx.sends, n, 0).astype(jnp.int32)
    seg = None
    if segments is not None:
        seg = tuple(jnp.where(ctx.sends, m, 0).astype(jnp.int32) for m in segments)
    return _FlatOut(update, new_res, new_u, count, seg, jnp.float32(0), jnp.int32(0), wire)


def _bounds(segments):
    ends = list(itertools.accumulate(segments))
    return list(zip([0, *ends[:-1]], ends, strict=True))


def _send_masked(
    cfg: _Config, acc, u, sel, cap, out_dtype, segments, x=None, *, defer=False
) -> _FlatOut:
    """One device: a dense mask is enough, no stream compaction.

    On overflow (count > capacity: ties, fixed or reused thresholds) the
    message holds the ``cap`` largest selected elements, ties to the lower
    index (:func:`selectors.capacity_cut`); only then is the cut searched.
    The cond returns two scalars: the dense work stays outside it
    (XLA:CPU runs conditional branches unfused). ``x`` (default ``acc``) is
    what the cond reads: the selector's copy of ``acc``, equal to it bit for
    bit, so that ``acc`` stays out of control flow (see _select_and_send).

    ``defer`` (the update in ``acc``'s own dtype): the output's residual is
    ``acc`` itself and ``sent_threshold``, ``sent_limit`` the mask; the next step
    clears the message (see DeferredSparsifyState). ``acc`` is then only read after
    the selector, so XLA accumulates in place and needs neither the copy nor
    a residual pass: 5 n-sized reads and 2 writes instead of 8 and 4.
    """
    n = acc.shape[0]
    copied = x is not None
    x = acc if x is None else x
    cut, limit = lax.cond(
        sel.count > cap,
        lambda _: selectors.capacity_cut(x, sel.threshold, sel.count, cap),
        lambda _: varying_like((jnp.asarray(sel.threshold, jnp.float32), jnp.int32(n)), acc),
        None,
    )
    mask = _sent_mask(jnp, acc, cut, limit)
    sent_out = _to_wire(jnp.where(mask, acc, 0), out_dtype)
    seg = None
    if segments is not None:
        seg = tuple(jnp.sum(mask[lo:hi], dtype=jnp.int32) for lo, hi in _bounds(segments))
    # Deferred: the accumulator, message included (cleared by the next step).
    residual = acc if defer else _keep_rest(acc, mask, sent_out)
    if copied and sent_out.dtype == acc.dtype:
        # The same update, read off the residual (here where(mask, +0, acc)):
        # the bits of acc and-not those of the residual are acc's where sent
        # (residual +0, all bits clear) and +0 where kept (residual == acc bit
        # for bit), for every value, inf, NaN and subnormals included (no
        # float arithmetic: a subtraction acc - residual would make inf - inf
        # a NaN and flush a subnormal under XLA:CPU's denormals-are-zero). Two
        # reasons: the update now comes after the residual, so XLA accumulates
        # in place of the donated residual, writes the update in place of acc,
        # and the one fresh n-sized buffer (the new residual) is first written
        # by the selector's copy, a lighter pass than the accumulation
        # (ldte_bs at 2^24: 92-95 vs 96-101 ms with the copy alone); and
        # XLA:CPU runs this elementwise and-not as fast as the accumulation,
        # while a kernel that selects on a compare (the mask, or the residual's
        # bits == 0) ran 1.9-3.1 ms at 2^22 against 0.8-1.3 (ldte_bs's update
        # at 2^22 1.0-1.4 ms faster, interleaved A/B runs, 2026-11-26).
        bits = jnp.dtype(f"uint{8 * acc.dtype.itemsize}")
        sent_bits = lax.bitcast_convert_type(acc, bits) & ~lax.bitcast_convert_type(residual, bits)
        sent_out = lax.bitcast_convert_type(sent_bits, acc.dtype)
    return _FlatOut(
        update=sent_out,
        residual=residual,
        velocity=_mask_velocity(cfg, u, mask),
        count=jnp.minimum(sel.count, cap),
        segment_counts=seg,
        threshold=sel.threshold,
        iterations=sel.iterations,
        wire_bytes=jnp.float32(0),
        sent_threshold=cut if defer else None,
        sent_limit=limit if defer else None,
    )


def _send_extracted(cfg: _Config, acc, u, sel, cap, out_dtype, ctx, segments) -> _FlatOut:
    """The (index, value) message: the selector's indices or the first ``cap`` above t."""
    n = acc.shape[0]
    if sel.indices is not None:
        idx = sel.indices
        vals = _values_at(acc, idx)
        sent = sel.count
    else:
        idx, vals, count = kernels.extract(acc, sel.threshold, cap)
        sent = jnp.minimum(count, cap)

        def largest(_):  # over capacity: the cap largest, not the first in index order
            cut, limit = selectors.capacity_cut(acc, sel.threshold, count, cap)
            return selectors.cut_message(acc, cut, limit, cap)

        idx, vals = lax.cond(count > cap, largest, lambda _: (idx, vals), None)
    if cfg.axis_name is not None and cfg.exchange == "scalecom":
        if ctx.include is not None:
            sparse_allreduce.check_include(cfg.exchange)

        # Every device sends its own values at this step's leader's indices; a
        # device that skips the step sends zeros there and keeps its residual.
        def values(ids):
            return _to_wire(jnp.where(ctx.sends, _values_at(acc, ids), 0), out_dtype)

        ex, idx = sparse_allreduce.cyclic_mean(idx, values, n, cfg.axis_name, ctx.step)
        idx = jnp.where(ctx.sends, idx, n)
        vals = _values_at(acc, idx)
        sent = jnp.sum(idx < n, dtype=jnp.int32)
    sent_out, new_res, new_u = _scatter_message(cfg, acc, u, idx, vals, out_dtype)
    if cfg.axis_name is None:
        update, wire = sent_out, jnp.float32(0)
    elif cfg.exchange == "scalecom":
        update, wire = ex.update, ex.wire_bytes
    else:
        vals_out = _to_wire(vals, out_dtype)
        if _index_itemsize(cfg, n) == 2:  # padding (n) fits too
            idx = idx.astype(jnp.uint16)
        update, wire, back = _exchange_pairs(cfg, idx, vals_out, n, sent_out, ctx.include, new_res)
        if back is not None:
            new_res = new_res.at[back[0]].add(back[1], mode="drop")
    seg = None
    if segments is not None:
        seg = tuple(
            jnp.sum((idx >= lo) & (idx < hi), dtype=jnp.int32) for lo, hi in _bounds(segments)
        )
    return _FlatOut(update, new_res, new_u, sent, seg, sel.threshold, sel.iterations, wire)


def _exchange_pairs(cfg: _Config, idx, vals, n, dense, include, residual):
    """A group's ``(index, value)`` message through ``cfg.exchange``.

    Returns ``(update, wire_bytes, returned)``: ``returned`` is None or the
    ``(indices, values)`` the exchange left out of the update (gTop-k's and
    Ok-Topk's dropped pairs), in ``residual``'s dtype, for the caller to add
    to this device's residual.
    """
    # value_dtype: the mean in the residual's dtype, the all-gather adding there.
    wide = residual.dtype if cfg.value_dtype is not None else None
    ex = sparse_allreduce.exchange(
        cfg.exchange, idx, vals, n, cfg.axis_name, dense=dense, include=include, sum_dtype=wide,
        servers=cfg.servers,
    )  # fmt: skip
    if ex.returned_indices is None:
        return ex.update, ex.wire_bytes, None
    return ex.update, ex.wire_bytes, _returned_pairs(cfg, ex, residual.dtype)


def _returned_pairs(cfg: _Config, ex, dtype):
    """What exchange ``ex`` returned, as ``(indices, values in dtype)`` for a residual."""
    if jnp.finfo(dtype).maxexp < jnp.finfo(jnp.float32).maxexp:  # float16
        raise ValueError(
            f"exchange={cfg.exchange!r} returns sums over devices of the pairs it "
            "drops to one device's residual, and a float16 residual cannot hold "
            "them (65504 at most: inf, then inf updates); use a float32 residual "
            "(residual_dtype=None, the default for float16 gradients)"
        )
    return ex.returned_indices, ex.returned_values.astype(dtype)


def _values_at(acc, idx):
    """``acc[idx]``, 0 at padding indices (``>= acc.size``)."""
    n = acc.shape[0]
    return jnp.where(idx < n, acc[jnp.minimum(idx, n - 1)], 0)


def _to_wire(values, out_dtype):
    """``values`` in the wire dtype, saturated at its largest finite value.

    A value beyond a narrower wire dtype's range (float16: 65504; float32 for a
    float64 accumulator) would round to inf, and the residual would keep
    ``acc - inf = -inf``, NaN from the next step on, for good. Saturated, the
    largest finite value is sent and the rest stays in the residual (sent on
    later steps). NaN stays NaN.
    """
    out_dtype = jnp.dtype(out_dtype)
    if out_dtype != values.dtype and jnp.issubdtype(out_dtype, jnp.floating):
        big = float(jnp.finfo(out_dtype).max)
        if big < float(jnp.finfo(values.dtype).max):
            values = jnp.clip(values, -big, big)
    return values.astype(out_dtype)


def _saturated_excess(values, out_dtype):
    """``values`` minus their saturation at ``out_dtype``'s largest finite value (else 0)."""
    big = float(jnp.finfo(out_dtype).max)
    if big >= float(jnp.finfo(values.dtype).max):
        return jnp.zeros_like(values)
    return jnp.where(jnp.abs(values) > big, values - jnp.clip(values, -big, big), 0)


def _keep_rest(acc, mask, sent_out):
    if sent_out.dtype == acc.dtype:
        return jnp.where(mask, 0, acc)
    # Keep the rounding (or the saturation) of the wire dtype in the residual.
    return jnp.where(mask, acc - sent_out.astype(acc.dtype), acc)


def _mask_velocity(cfg: _Config, u, mask):
    if u is None or not cfg.momentum_masking:
        return u
    return jnp.where(mask, 0, u)


def _scatter_message(cfg: _Config, acc, u, idx, vals, out_dtype):
    vals_out = _to_wire(vals, out_dtype)
    n = acc.shape[0]
    sent_out = jnp.zeros((n,), out_dtype).at[idx].set(vals_out, mode="drop")
    new_res = acc.at[idx].set(vals - vals_out.astype(acc.dtype), mode="drop")
    new_u = u
    if u is not None and cfg.momentum_masking:
        new_u = u.at[idx].set(0, mode="drop")
    return sent_out, new_res, new_u


def _concat(parts, dtype):
    if not parts:
        return jnp.zeros((0,), dtype)
    if len(parts) == 1:
        return parts[0]
    return jnp.concatenate(parts)
