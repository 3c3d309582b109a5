"""DLGS layer merging: the iteration timeline and the merge planners.

The DLGS paper (Ju et al., 2024, §3) models one training iteration of
layer-wise sparsification as two streams. The compute stream runs the forward
pass, then, layer by layer from the last layer ``L`` down to ``1``, the
layer's backward and the sparsification of its gradient; the communication
stream sends each sparsified gradient as soon as it is ready and the previous
send is done. With per-layer backward times ``t_b[l]``, sparsification times
``t_s[l]`` and communication times ``t_c[l]`` (docs/algorithms.md §4)::

    tau_b[L] = t_f              tau_b[l] = tau_s[l+1] + t_s[l+1]
    tau_s[l] = tau_b[l] + t_b[l]
    tau_c[L] = tau_s[L] + t_s[L]
    tau_c[l] = max(tau_s[l] + t_s[l], tau_c[l+1] + t_c[l+1])
    t_iter   = tau_c[1] + t_c[1]

Merging layer ``l`` into ``l-1`` skips ``l``'s sparsification and send: its
tensor joins ``l-1``'s, so a group of merged layers runs its backward times
back to back, is sparsified once (``t_s`` of the group's element count) and
sent once (``t_c`` of the group's element count). Fewer groups pay fewer
per-call overheads (the ``alpha`` of ``alpha + beta * bytes``) but start
sending later. This module evaluates a grouping (:func:`timeline`) and
searches the groupings: the paper's greedy Algorithm 2 (:func:`greedy_merge`)
and an exact dynamic programme (:func:`optimal_merge`).

Conventions: layers are given in backward order, position 0 is layer ``L``
(the first whose gradient exists); a grouping is a tuple of tuples of
positions, contiguous, covering every position once, in backward order. Times
are in any one unit (the profiler in :mod:`jaxcomp.planning.profile` uses
seconds); costs ``t_s`` and ``t_c`` are callables of a group's element count,
so one planner serves any compressor and network.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "METHODS",
    "GroupSchedule",
    "LinearCost",
    "MergePlan",
    "Timeline",
    "greedy_merge",
    "linear_cost",
    "merge_all",
    "no_merge",
    "optimal_merge",
    "plan_merge",
    "timeline",
]

CostFn = Callable[[int], float]

# Planner names accepted by plan_merge (and plan_for_model).
METHODS = ("none", "all", "greedy", "optimal")


# ---------------------------------------------------------------------------
# Cost model.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LinearCost:
    """An affine cost of a group's element count: ``alpha + beta * (bytes_per_element * n)``.

    Built by :func:`linear_cost` (communication: latency plus bytes over
    bandwidth) and by :func:`jaxcomp.planning.fit_sparsify_cost`
    (sparsification: ``a + b * n`` with ``bytes_per_element = 1``). Works on
    Python numbers and numpy arrays alike, with the same floating-point
    operations, so the planners can evaluate it vectorised.

    Attributes:
      alpha: cost per call (e.g. seconds of latency).
      beta: cost per byte (e.g. seconds per byte, one over the bandwidth).
      bytes_per_element: bytes one gradient element of the group costs on the
        wire (e.g. ``8 * ratio`` for (int32 index, float32 value) pairs at
        compression ratio ``ratio``); 1 for a cost per element.

    Example:
      >>> cost = LinearCost(alpha=1.0, beta=0.5, bytes_per_element=2.0)
      >>> cost(10)  # 1 + 0.5 * (2 * 10)
      11.0
    """

    alpha: float
    beta: float
    bytes_per_element: float = 1.0

    def __call__(self, n):
        return self.alpha + self.beta * (self.bytes_per_element * n)


def linear_cost(alpha: float, beta: float, bytes_per_element: float = 1.0) -> LinearCost:
    """The cost ``n -> alpha + beta * bytes_per_element * n`` of a group of ``n`` elements.

    The usual communication model: ``alpha`` latency per message, ``beta``
    time per byte. For a 10 GbE link (50 us latency, 1.25e9 bytes/s) and a
    top-k message of (int32 index, float32 value) pairs at ratio 1e-3 (8 bytes
    per sent element, ``8e-3`` per gradient element):

    Example:
      >>> from jaxcomp import planning
      >>> t_c = planning.linear_cost(50e-6, 1 / 1.25e9, 8 * 1e-3)
      >>> round(t_c(1_000_000) * 1e6, 1)  # microseconds for a 1M-element group
      56.4

    Args:
      alpha: cost per call, finite and >= 0.
      beta: cost per byte, finite and >= 0.
      bytes_per_element: bytes per gradient element of the group, finite and >= 0.

    Returns:
      A :class:`LinearCost`, a callable of the element count.

    Raises:
      ValueError: a negative or non-finite argument (named in the message).
    """
    for name, v in (("alpha", alpha), ("beta", beta), ("bytes_per_element", bytes_per_element)):
        _check_time(name, v)
    return LinearCost(float(alpha), float(beta), float(bytes_per_element))


# ---------------------------------------------------------------------------
# Validation.
# ---------------------------------------------------------------------------


def _check_time(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {v!r}")
    v = float(v)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {v!r}")
    return v


def _check_sizes(sizes) -> tuple[int, ...]:
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (Sequence, np.ndarray)):
        raise ValueError(f"sizes must be a sequence of element counts, got {type(sizes).__name__}")
    if len(sizes) == 0:
        raise ValueError("sizes is empty: there must be at least one layer")
    out = []
    for i, n in enumerate(sizes):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"sizes[{i}] must be an integer >= 0 (an element count), got {n!r}")
        out.append(int(n))
    return tuple(out)


def _check_t_b(t_b, num_layers: int) -> tuple[float, ...]:
    if isinstance(t_b, (str, bytes)) or not isinstance(t_b, (Sequence, np.ndarray)):
        raise ValueError(f"t_b must be a sequence of backward times, got {type(t_b).__name__}")
    if len(t_b) != num_layers:
        raise ValueError(
            f"sizes and t_b must have the same length (one entry per layer, in backward "
            f"order), got {num_layers} and {len(t_b)}"
        )
    return tuple(_check_time(f"t_b[{i}]", v) for i, v in enumerate(t_b))


def _check_cost(name: str, fn) -> CostFn:
    if not callable(fn):
        raise ValueError(f"{name} must be a callable of a group's element count, got {fn!r}")
    return fn


def _cost(name: str, fn: CostFn, n: int) -> float:
    v = fn(n)
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}({n}) must return a real number, got {v!r}") from None
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}({n}) = {v!r}: costs must be finite and >= 0")
    return v


class _Problem(NamedTuple):
    sizes: tuple[int, ...]
    t_b: tuple[float, ...]
    t_f: float
    t_s: CostFn
    t_c: CostFn


def _problem(sizes, t_b, t_f, t_s, t_c) -> _Problem:
    sizes = _check_sizes(sizes)
    return _Problem(
        sizes,
        _check_t_b(t_b, len(sizes)),
        _check_time("t_f", t_f),
        _check_cost("t_s", t_s),
        _check_cost("t_c", t_c),
    )


def _check_groups(groups, num_layers: int) -> tuple[tuple[int, ...], ...]:
    if isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence) or not groups:
        raise ValueError(
            f"groups must be a non-empty sequence of tuples of positions, got {groups!r}"
        )
    out, expect = [], 0
    for gi, g in enumerate(groups):
        if isinstance(g, (str, bytes)) or not isinstance(g, (Sequence, np.ndarray)) or len(g) == 0:
            raise ValueError(f"groups[{gi}] must be a non-empty sequence of positions, got {g!r}")
        g = tuple(g)
        want = tuple(range(expect, expect + len(g)))
        if g != want:
            raise ValueError(
                f"groups must be contiguous runs of positions 0..{num_layers - 1} in backward "
                f"order covering each once; groups[{gi}] is {g!r}, expected {want!r}"
            )
        out.append(tuple(int(p) for p in g))
        expect += len(g)
    if expect != num_layers:
        raise ValueError(
            f"groups cover positions 0..{expect - 1} but there are {num_layers} layers "
            f"(every layer must be in a group)"
        )
    return tuple(out)


# ---------------------------------------------------------------------------
# Timeline.
# ---------------------------------------------------------------------------


class GroupSchedule(NamedTuple):
    """When one group's backward, sparsification and send run (see :func:`timeline`).

    Example:
      >>> from jaxcomp import planning
      >>> t_s, t_c = planning.linear_cost(0.0, 0.0), planning.linear_cost(2.0, 0.0)
      >>> tl = planning.timeline([(0,), (1,)], [1, 1], [1, 1], 0, t_s, t_c)
      >>> g = tl.schedule[1]  # backward 1..2, then waits for the link (busy until 3)
      >>> g.layers, g.backward_end, g.comm_start, g.comm_end
      ((1,), 2.0, 3.0, 5.0)
    """

    layers: tuple[int, ...]
    size: int
    backward_start: float
    backward_end: float
    sparsify_start: float
    sparsify_end: float
    comm_start: float
    comm_end: float


class Timeline(NamedTuple):
    """Predicted iteration of one grouping.

    Attributes:
      time: the iteration time ``t_iter`` (the last send's end).
      schedule: one :class:`GroupSchedule` per group, in backward order.

    Example:
      >>> from jaxcomp import planning
      >>> t_s, t_c = planning.linear_cost(0.0, 0.0), planning.linear_cost(2.0, 0.0)
      >>> tl = planning.timeline([(0,), (1,)], [1, 1], [1, 1], 0, t_s, t_c)
      >>> tl.time, len(tl.schedule)  # sends 1..3 and 3..5
      (5.0, 2)
    """

    time: float
    schedule: tuple[GroupSchedule, ...]

    @property
    def exposed_comm(self) -> float:
        """Communication not hidden behind compute (the paper's ``t_noc``, Eq. 2)."""
        return self.time - self.schedule[-1].sparsify_end


def timeline(groups, sizes, t_b, t_f, t_s: CostFn, t_c: CostFn) -> Timeline:
    """The DLGS timeline (paper Eqs. 3-7) of one grouping of layers.

    Each group starts its backward when the previous group's sparsification
    ends (the forward pass for the first group), runs its layers' backward
    times back to back, is sparsified once (``t_s`` of its element count) and
    sent once (``t_c`` of its element count) when both its sparsification and
    the previous send have ended. With one group per layer this is exactly the
    paper's per-layer recursion.

    Example:
      >>> from jaxcomp import planning
      >>> t_s = planning.linear_cost(1.0, 0.0)   # 1 per sparsification call
      >>> t_c = planning.linear_cost(4.0, 1.0)   # 4 per send + 1 per element
      >>> tl = planning.timeline([(0,), (1, 2)], [2, 1, 1], [3, 3, 3], 5, t_s, t_c)
      >>> tl.time
      22.0
      >>> [(g.backward_start, g.sparsify_end, g.comm_start, g.comm_end) for g in tl.schedule]
      [(5.0, 9.0, 9.0, 15.0), (9.0, 16.0, 16.0, 22.0)]

      The first group runs its backward from 5 to 8, is sparsified until 9 and
      sent until 15 (4 + 2 elements); the second runs two backwards (9..15),
      is sparsified until 16 and sent from 16 (the link is free since 15)
      until 22.

    Args:
      groups: tuple of tuples of layer positions, contiguous, covering
        ``0..L-1`` once, in backward order (position 0 is layer ``L``).
      sizes: element count of each layer, in backward order.
      t_b: backward time of each layer, in backward order.
      t_f: forward time (the backward of layer ``L`` starts at ``t_f``).
      t_s: sparsification time of a group, a callable of its element count.
      t_c: communication time of a group, a callable of its element count
        (e.g. :func:`linear_cost`).

    Returns:
      A :class:`Timeline`: ``time`` (``t_iter``) and the per-group schedule.

    Raises:
      ValueError: empty or mismatched ``sizes``/``t_b``, negative or
        non-finite times or costs, groups that are not contiguous runs covering
        every layer once.
    """
    prob = _problem(sizes, t_b, t_f, t_s, t_c)
    groups = _check_groups(groups, len(prob.sizes))
    return _timeline(prob, groups)


def _timeline(prob: _Problem, groups) -> Timeline:
    compute, comm = prob.t_f, 0.0
    out = []
    for g in groups:
        size = sum(prob.sizes[p] for p in g)
        backward = 0.0
        for p in g:  # the same summation order as the planners' tables
            backward += prob.t_b[p]
        b_start = compute
        s_start = b_start + backward
        compute = s_start + _cost("t_s", prob.t_s, size)
        c_start = max(compute, comm)
        comm = c_start + _cost("t_c", prob.t_c, size)
        out.append(GroupSchedule(g, size, b_start, s_start, s_start, compute, c_start, comm))
    return Timeline(comm, tuple(out))


# ---------------------------------------------------------------------------
# Planners.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """A grouping of layers and its predicted iteration time.

    Attributes:
      groups: tuple of tuples of layer positions (backward order, position 0
        is layer ``L``), contiguous, covering every layer once. A group of
        several layers is sparsified and sent as one tensor.
      time: predicted iteration time of this grouping (:func:`timeline`).
      method: the planner that made it (one of :data:`METHODS`).

    Example:
      >>> from jaxcomp import planning
      >>> t_s, t_c = planning.linear_cost(0.0, 0.0), planning.linear_cost(2.0, 0.0)
      >>> plan = planning.merge_all([1, 1], [1, 1], 0, t_s, t_c)
      >>> plan.groups, plan.time, plan.method
      (((0, 1),), 4.0, 'all')
    """

    groups: tuple[tuple[int, ...], ...]
    time: float
    method: str

    @property
    def num_groups(self) -> int:
        """Number of sparsify-and-send calls per iteration."""
        return len(self.groups)


def _plan(prob: _Problem, groups, method: str) -> MergePlan:
    groups = tuple(tuple(g) for g in groups)
    return MergePlan(groups, _timeline(prob, groups).time, method)


def no_merge(sizes, t_b, t_f, t_s: CostFn, t_c: CostFn) -> MergePlan:
    """Every layer its own group (layer-wise sparsification without merging).

    Arguments and errors as :func:`timeline`'s.

    Example:
      >>> from jaxcomp import planning
      >>> t_s = planning.linear_cost(0.0, 0.0)   # free sparsification
      >>> t_c = planning.linear_cost(2.0, 0.0)   # a send costs 2 whatever its size
      >>> plan = planning.no_merge([1, 1], [1, 1], 0, t_s, t_c)
      >>> plan.groups, plan.time  # sends 1..3 and 3..5
      (((0,), (1,)), 5.0)
    """
    prob = _problem(sizes, t_b, t_f, t_s, t_c)
    return _plan(prob, [(p,) for p in range(len(prob.sizes))], "none")


def merge_all(sizes, t_b, t_f, t_s: CostFn, t_c: CostFn) -> MergePlan:
    """All layers in one group (one sparsification and one send after the whole backward).

    Arguments and errors as :func:`timeline`'s.

    Example:
      >>> from jaxcomp import planning
      >>> t_s = planning.linear_cost(0.0, 0.0)   # free sparsification
      >>> t_c = planning.linear_cost(2.0, 0.0)   # a send costs 2 whatever its size
      >>> planning.merge_all([1, 1], [1, 1], 0, t_s, t_c).time  # backward 0..2, one send 2..4
      4.0
    """
    prob = _problem(sizes, t_b, t_f, t_s, t_c)
    return _plan(prob, [tuple(range(len(prob.sizes)))], "all")


def greedy_merge(sizes, t_b, t_f, t_s: CostFn, t_c: CostFn) -> MergePlan:
    """The DLGS paper's Algorithm 2: greedy layer merging from layer ``L`` down to 2.

    Starting from one group per layer, for ``l = L, ..., 2`` it merges layer
    ``l`` into ``l - 1`` (position ``p`` into ``p + 1``, so the group holding
    ``l`` grows by ``l - 1``) when that makes the predicted iteration time
    strictly smaller, and keeps the merge for the rest of the scan. Each
    decision evaluates the timeline from the end of the groups already closed:
    O(L) per layer, O(L^2) in all (the paper's bound), a few milliseconds
    for L = 200. It can stop short of the best grouping
    (:func:`optimal_merge`): one merge that alone does not pay can enable
    later ones that do.

    Example:
      >>> from jaxcomp import planning
      >>> t_s = planning.linear_cost(0.0, 0.0)     # free sparsification
      >>> t_c = planning.linear_cost(10.0, 0.0)    # a send costs 10 whatever its size
      >>> plan = planning.greedy_merge([5, 5, 5, 5], [1, 1, 1, 1], 0, t_s, t_c)
      >>> plan.groups, plan.time
      (((0, 1, 2, 3),), 14.0)

    Args:
      sizes, t_b, t_f, t_s, t_c: as for :func:`timeline`.

    Returns:
      A :class:`MergePlan` with ``method="greedy"``.

    Raises:
      ValueError: as :func:`timeline`.
    """
    prob = _problem(sizes, t_b, t_f, t_s, t_c)
    L = len(prob.sizes)
    s1 = [_cost("t_s", prob.t_s, n) for n in prob.sizes]
    c1 = [_cost("t_c", prob.t_c, n) for n in prob.sizes]

    def tail(compute, comm, back, size, nxt):
        # The open group (backward ``back``, ``size`` elements), then singletons from ``nxt``.
        compute = (compute + back) + _cost("t_s", prob.t_s, size)
        comm = max(compute, comm) + _cost("t_c", prob.t_c, size)
        for q in range(nxt, L):
            compute = (compute + prob.t_b[q]) + s1[q]
            comm = max(compute, comm) + c1[q]
        return comm

    groups = []
    compute, comm = prob.t_f, 0.0  # state after the closed groups
    start, back, size = 0, prob.t_b[0], prob.sizes[0]  # the open group
    current = tail(compute, comm, back, size, 1)
    for p in range(L - 1):
        cand_back, cand_size = back + prob.t_b[p + 1], size + prob.sizes[p + 1]
        cand = tail(compute, comm, cand_back, cand_size, p + 2)
        if cand < current:  # merge layer p into p + 1
            current, back, size = cand, cand_back, cand_size
            continue
        groups.append(tuple(range(start, p + 1)))
        compute = (compute + back) + _cost("t_s", prob.t_s, size)
        comm = max(compute, comm) + _cost("t_c", prob.t_c, size)
        start, back, size = p + 1, prob.t_b[p + 1], prob.sizes[p + 1]
    groups.append(tuple(range(start, L)))
    return _plan(prob, groups, "greedy")


def _group_costs(name: str, fn: CostFn, counts: np.ndarray, upper: np.ndarray) -> np.ndarray:
    """``fn`` of every contiguous group's element count (entries ``[i, j]``, ``i < j``)."""
    if isinstance(fn, LinearCost):
        with np.errstate(all="ignore"):
            out = fn(counts.astype(np.float64))
        if np.all(np.isfinite(out[upper])) and np.all(out[upper] >= 0):
            return np.where(upper, out, 0.0)
    out = np.zeros(counts.shape)
    for i, j in zip(*np.nonzero(upper), strict=True):
        out[i, j] = _cost(name, fn, int(counts[i, j]))
    return out


def optimal_merge(sizes, t_b, t_f, t_s: CostFn, t_c: CostFn) -> MergePlan:
    """The best contiguous grouping, exactly (never worse than :func:`greedy_merge`).

    Dynamic programming over group boundaries. After the groups that cover
    positions ``0..j-1``, the rest of the iteration depends only on two
    numbers: when the compute stream is free (``C``: the last
    sparsification's end) and when the link is free (``M``: the last send's
    end); the iteration time is non-decreasing in both. So for each boundary
    ``j`` it keeps the Pareto front of ``(C, M)`` pairs over all groupings of
    ``0..j-1`` (a pair is dropped when another is no later in both), extends
    every kept pair by every next group ``j..k-1``, and reads the answer as
    the smallest ``M`` at ``j = L``. Dropping dominated pairs loses nothing, so
    the result is the exact minimum over all ``2^(L-1)`` groupings (up to
    floating-point ties: the front's arithmetic is the timeline's, operation
    for operation).

    Complexity: with ``F`` the largest front, ``O(L^2 F)`` pair extensions
    and a sort per boundary, ``O(L^2 F log(L F))`` time and ``O(L F + L^2)``
    memory, plus ``L(L+1)/2`` evaluations each of ``t_s`` and ``t_c``
    (vectorised for :class:`LinearCost`). ``C`` is the forward and backward
    time of ``0..j-1`` plus the groups' sparsification times; when ``t_s`` is
    affine (``a + b n``, as fitted by
    :func:`jaxcomp.planning.fit_sparsify_cost`) that is fixed by the number of
    groups, so ``F <= L`` and the worst case is ``O(L^3 log L)`` (floating-point
    rounding can split equal ``C`` values, in practice by a few pairs). For an
    arbitrary ``t_s`` the front is bounded only by the ``2^(j-1)`` groupings
    (exponential in the worst case); measured fronts stay small (tens of
    pairs). Typical run time: tens of milliseconds for ResNet-20 (65 leaves),
    well under a second for L = 200.

    Example:
      >>> from jaxcomp import planning
      >>> t_s = planning.linear_cost(1.0, 0.0)    # 1 per sparsification call
      >>> t_c = planning.linear_cost(3.0, 0.5)    # 3 per send + 0.5 per element
      >>> args = ([4, 4, 4, 4], [2, 2, 2, 2], 0, t_s, t_c)
      >>> best = planning.optimal_merge(*args)
      >>> best.groups, best.time
      (((0,), (1, 2, 3)), 19.0)
      >>> planning.no_merge(*args).time, planning.merge_all(*args).time
      (23.0, 20.0)

    Args:
      sizes, t_b, t_f, t_s, t_c: as for :func:`timeline`.

    Returns:
      A :class:`MergePlan` with ``method="optimal"``.

    Raises:
      ValueError: as :func:`timeline`.
    """
    prob = _problem(sizes, t_b, t_f, t_s, t_c)
    L = len(prob.sizes)
    tb = np.asarray(prob.t_b, np.float64)
    sz = np.asarray(prob.sizes, np.int64)
    # back[i, j]: backward time of group i..j-1, summed left to right as the
    # timeline sums it (np.add.accumulate is sequential), so the front's
    # numbers are the timeline's bit for bit.
    back = np.zeros((L + 1, L + 1))
    counts = np.zeros((L + 1, L + 1), np.int64)
    for i in range(L):
        back[i, i + 1 :] = np.add.accumulate(tb[i:])
        counts[i, i + 1 :] = np.cumsum(sz[i:])
    upper = np.triu(np.ones((L + 1, L + 1), bool), 1)
    sparsify = _group_costs("t_s", prob.t_s, counts, upper)
    comm = _group_costs("t_c", prob.t_c, counts, upper)

    # All kept pairs of all boundaries so far, appended boundary by boundary:
    # (C, M), the boundary they end at, and the pair they extend.
    all_c = np.array([prob.t_f])
    all_m = np.array([0.0])
    all_b = np.array([0], np.int64)
    parent = np.array([-1], np.int64)
    for j in range(1, L + 1):
        c = (all_c + back[all_b, j]) + sparsify[all_b, j]
        m = np.maximum(c, all_m) + comm[all_b, j]
        order = np.lexsort((m, c))  # by C, then M
        ms = m[order]
        keep = np.ones(len(order), bool)
        keep[1:] = ms[1:] < np.minimum.accumulate(ms)[:-1]
        front = order[keep]
        if j == L:
            # On a front sorted by C, M decreases: the last pair has the least
            # M, the iteration time. Walk back through the pairs it extends.
            node, bounds = front[-1], [L]
            while node >= 0:
                bounds.append(int(all_b[node]))
                node = parent[node]
            bounds.reverse()
            groups = [tuple(range(a, b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            return _plan(prob, groups, "optimal")
        all_c = np.concatenate([all_c, c[front]])
        all_m = np.concatenate([all_m, m[front]])
        all_b = np.concatenate([all_b, np.full(len(front), j, np.int64)])
        parent = np.concatenate([parent, front])
    raise AssertionError("unreachable")


def plan_merge(sizes, t_b, t_f, t_s: CostFn, t_c: CostFn, method: str = "optimal") -> MergePlan:
    """A merge plan by name: ``"optimal"``, ``"greedy"``, ``"none"`` or ``"all"``.

    Example:
      >>> from jaxcomp import planning
      >>> cost = planning.linear_cost(1.0, 0.0)
      >>> planning.plan_merge([1, 1], [1, 1], 0, cost, cost, method="all").groups
      ((0, 1),)

    Args:
      sizes, t_b, t_f, t_s, t_c: as for :func:`timeline`.
      method: one of :data:`METHODS`: ``"optimal"`` (:func:`optimal_merge`),
        ``"greedy"`` (:func:`greedy_merge`), ``"none"`` (:func:`no_merge`),
        ``"all"`` (:func:`merge_all`).

    Raises:
      ValueError: an unknown ``method``, or as :func:`timeline`.
    """
    planners = {"optimal": optimal_merge, "greedy": greedy_merge, "none": no_merge}
    planners["all"] = merge_all
    if method not in planners:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    return planners[method](sizes, t_b, t_f, t_s, t_c)
