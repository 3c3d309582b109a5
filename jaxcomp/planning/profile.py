"""Profiling a model for DLGS layer merging, and planning its groups.

:mod:`jaxcomp.planning.merge` plans from numbers: per-layer backward times
``t_b``, the forward time ``t_f``, and the costs ``t_s`` (sparsify) and
``t_c`` (send) of a group of ``n`` elements. This module measures them for a
Flax model and turns a plan into the ``groups=`` argument of the sparsifiers:

- :func:`model_layers`: the layers of a params tree, in execution order.
- :func:`profile_backward`: ``t_f`` and each layer's ``t_b`` on this device,
  by timing (``method="time"``) or from XLA's flop counts scaled to the
  measured backward (``method="flops"``, deterministic up to one scale).
- :func:`fit_sparsify_cost`, :func:`measure_sparsify_cost`,
  :func:`load_sparsify_cost`: ``t_s`` as a fitted ``a + b n``.
- :func:`plan_for_model`: all of it at once; its ``groups`` go straight to
  ``jaxcomp.ldte_bs(..., groups=...)``.

See :func:`plan_for_model` for the whole path from a model to ``groups``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp.planning import merge as merge_lib

__all__ = [
    "BackwardProfile",
    "Layer",
    "ModelPlan",
    "PROFILE_METHODS",
    "fit_sparsify_cost",
    "load_sparsify_cost",
    "measure_sparsify_cost",
    "model_layers",
    "plan_for_model",
    "profile_backward",
]

# Methods of profile_backward.
PROFILE_METHODS = ("time", "flops")


# ---------------------------------------------------------------------------
# Layers.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layer:
    """One layer of a params tree: the leaves sharing a parent.

    Attributes:
      name: the parent's path (``jax.tree_util.keystr``), e.g. ``"['Dense_0']"``;
        a leaf directly at the root is a layer of its own, named by its path.
      paths: ``jax.tree_util.keystr`` paths of the layer's leaves, in the
        order the module created them.
      size: total element count of the leaves.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import planning
      >>> params = {"d1": {"w": jnp.ones((4, 3)), "b": jnp.ones(3)}}
      >>> layer = planning.model_layers(params)[0]
      >>> layer.name, layer.size  # 12 + 3 elements
      ("['d1']", 15)
    """

    name: str
    paths: tuple[str, ...]
    size: int


def _leaves_in_creation_order(tree) -> list[tuple[tuple, Any]]:
    """``(key path, leaf)`` pairs, mappings walked in their insertion order.

    ``jax.tree.flatten`` sorts dict keys; Flax's ``init`` returns dicts whose
    insertion order is the order the modules ran, which is what we want.
    Non-mapping containers (lists, tuples, dataclasses) keep JAX's order.
    """
    out = []

    def walk(node, prefix):
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk(v, (*prefix, jax.tree_util.DictKey(k)))
            return
        pairs, _ = jax.tree_util.tree_flatten_with_path(
            node, is_leaf=lambda x: isinstance(x, Mapping)
        )
        for path, v in pairs:
            if isinstance(v, Mapping):
                walk(v, (*prefix, *path))
            else:
                out.append(((*prefix, *path), v))

    walk(tree, ())
    return out


def _first_uses(loss_fn, params, batch) -> dict[str, int]:
    """Per leaf path, the position in ``loss_fn``'s traced program of its first use.

    The forward pass's equations come in execution order, whatever order the
    parameters' dicts have (``jax.tree.map`` and ``dist.replicate`` return
    them key-sorted). Leaves the loss never reads are absent.
    """
    from jax.extend import core as jex_core  # noqa: PLC0415

    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    jaxpr = jax.make_jaxpr(loss_fn)(params, batch).jaxpr
    path_of = {v: jax.tree_util.keystr(p) for v, (p, _) in zip(jaxpr.invars, flat, strict=False)}
    first: dict[str, int] = {}
    for pos, eqn in enumerate(jaxpr.eqns):
        for v in eqn.invars:
            if not isinstance(v, jex_core.Literal) and v in path_of:
                first.setdefault(path_of[v], pos)
    return first


def model_layers(params, loss_fn=None, batch=None) -> tuple[Layer, ...]:
    """The layers of a Flax params tree, in forward (execution) order.

    A layer is the set of leaves with the same parent path (the kernel and
    bias of one ``Dense``, the scale and bias of one ``GroupNorm``). With
    ``loss_fn`` and ``batch``, the order is the order the forward pass first
    reads each layer (traced with ``jax.make_jaxpr``, nothing run): right
    whatever order the dicts have. Without them it is the insertion order of
    the nested dicts ``model.init`` returns, which is the order the
    submodules ran, but only as long as no ``jax.tree.map`` (or
    ``dist.replicate``, ``place_params``) rebuilt them: those sort the keys,
    ``'Dense_10'`` before ``'Dense_2'``. A parent whose leaves are not
    adjacent (a module holding both parameters and submodules) is placed at
    its first leaf; layers the loss never reads go last.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import planning
      >>> params = {"z": {"kernel": jnp.ones((2, 3)), "bias": jnp.ones(3)},
      ...           "a": {"kernel": jnp.ones((3, 1)), "bias": jnp.ones(1)}}
      >>> [(l.name, l.size) for l in planning.model_layers(params)]
      [("['z']", 9), ("['a']", 4)]

    Args:
      params: a pytree of arrays (e.g. ``model.init(...)["params"]``).
      loss_fn: ``loss_fn(params, batch) -> scalar``, whose forward pass
        gives the order (None: the dicts' insertion order).
      batch: an input of ``loss_fn`` (with ``loss_fn``).

    Returns:
      A tuple of :class:`Layer`, first-run layer first.

    Raises:
      ValueError: ``params`` has no array leaves.
    """
    pairs = _leaves_in_creation_order(params)
    if not pairs:
        raise ValueError("params has no leaves: there is no layer to profile")
    reference = {
        jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]
    }
    found = [jax.tree_util.keystr(p) for p, _ in pairs]
    if set(found) != reference or len(found) != len(reference):
        raise ValueError(
            "params: could not walk its leaves (a mapping type that flattens unlike a dict?)"
        )
    order: dict[str, list] = {}
    for path, leaf in pairs:
        parent = path[:-1]
        name = jax.tree_util.keystr(parent if parent else path)
        order.setdefault(name, []).append((jax.tree_util.keystr(path), int(np.size(leaf))))
    layers = [
        Layer(name, tuple(p for p, _ in items), sum(n for _, n in items))
        for name, items in order.items()
    ]
    if loss_fn is not None:
        first = _first_uses(loss_fn, params, batch)
        unused = len(first) + len(layers)  # after every read layer, in insertion order

        def when(path):
            return first.get(path, unused)

        layers = [
            dataclasses.replace(layer, paths=tuple(sorted(layer.paths, key=when)))
            for layer in layers
        ]
        layers.sort(key=lambda layer: when(layer.paths[0]))
    return tuple(layers)


# ---------------------------------------------------------------------------
# Backward profile.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BackwardProfile:
    """Per-layer backward times of one model on one device (backward order).

    Attributes:
      layers: the model's layers, last-run layer first (position 0 is the
        layer whose gradient exists first), as the planners of
        :mod:`jaxcomp.planning.merge` index them.
      sizes: element count of each layer, in backward order.
      t_b: seconds of backward each layer adds, in backward order.
      t_f: seconds of the forward pass (the loss alone).
      method: ``"time"`` or ``"flops"`` (see :func:`profile_backward`).
      flops_b: with ``method="flops"``, the flops each layer adds (backward
        order); None with ``method="time"``.
      flops_f: with ``method="flops"``, the forward's flops; else None.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import planning
      >>> params = {"d1": {"w": jnp.ones((4, 3))}, "d2": {"w": jnp.ones((3, 2))}}
      >>> loss = lambda p, x: jnp.sum((x @ p["d1"]["w"]) @ p["d2"]["w"])
      >>> prof = planning.profile_backward(loss, params, jnp.ones((2, 4)), method="flops")
      >>> prof.sizes, prof.method, len(prof.t_b)  # backward order: d2 first
      ((6, 12), 'flops', 2)
    """

    layers: tuple[Layer, ...]
    sizes: tuple[int, ...]
    t_b: tuple[float, ...]
    t_f: float
    method: str
    flops_b: tuple[float, ...] | None = None
    flops_f: float | None = None

    @property
    def backward_time(self) -> float:
        """Seconds of the whole backward (``sum(t_b)``)."""
        return float(sum(self.t_b))


def _median_seconds(fn, args, repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _flops(stage) -> float:
    analysis = stage.cost_analysis()
    # A dict on current JAX; a list of one dict per executable on older ones.
    if isinstance(analysis, (list, tuple)):
        return float(sum((a or {}).get("flops", 0.0) for a in analysis))
    return float((analysis or {}).get("flops", 0.0))


def _check_repeats(repeats) -> int:
    if isinstance(repeats, bool) or not isinstance(repeats, numbers.Integral) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    return int(repeats)


def _check_profile_options(loss_fn, repeats, method, flops_per_second) -> int:
    """Validates :func:`profile_backward`'s options; returns ``repeats`` as an int."""
    if not callable(loss_fn):
        raise ValueError(f"loss_fn must be a callable (params, batch) -> scalar, got {loss_fn!r}")
    repeats = _check_repeats(repeats)
    if method not in PROFILE_METHODS:
        raise ValueError(f"method must be one of {PROFILE_METHODS}, got {method!r}")
    if flops_per_second is not None:
        if method != "flops":
            raise ValueError("flops_per_second applies to method='flops' only")
        if (
            isinstance(flops_per_second, bool)
            or not isinstance(flops_per_second, numbers.Real)
            or not math.isfinite(flops_per_second)
            or flops_per_second <= 0
        ):
            raise ValueError(f"flops_per_second must be a number > 0, got {flops_per_second!r}")
    return repeats


def profile_backward(
    loss_fn: Callable[[Any, Any], Any],
    params,
    batch,
    *,
    repeats: int = 5,
    method: str = "time",
    flops_per_second: float | None = None,
) -> BackwardProfile:
    """Measures the forward time and each layer's backward time on this device.

    With layers ``1..L`` in forward order (:func:`model_layers`), let ``T_l``
    be the time of ``jax.value_and_grad(loss_fn)`` taken w.r.t. the
    parameters of layers ``l..L`` only: the other leaves are passed as
    non-differentiated arguments, so JAX computes no gradient below layer
    ``l`` (neither their weight gradients nor the input gradient of layer
    ``l``). Then ``t_f = T_{L+1}`` (the loss alone) and the backward of layer
    ``l`` is ``t_b[l] = T_l - T_{l+1}``: what it takes from layer ``l+1``'s
    gradient to layer ``l``'s (the input gradient of ``l+1`` and the weight
    gradient of ``l``), the quantity the DLGS timeline needs. Every function
    is jitted, warmed up, and timed as the median of ``repeats`` runs, with
    results blocked on; ``L + 1`` programs are compiled.

    ``method="time"`` uses those timings directly. Differences of noisy
    timings can be negative: they are clipped at 0, so a layer cheaper than
    the timing noise gets ``t_b = 0`` (and ``sum(t_b)`` can exceed the
    measured backward). Use ``repeats`` to trade profiling time for noise.

    ``method="flops"`` takes the same differences of XLA's cost-analysis
    flop counts (``jax.jit(f).lower(...).cost_analysis()``, counted before
    XLA optimises, so only the two timed programs compile) and
    scales them so they sum to the measured whole backward (the full
    ``value_and_grad`` time minus ``t_f``): only those two functions are
    timed. The split between layers is deterministic; only the scale is
    measured (when timing noise makes the measured backward not positive, the
    forward's seconds per flop sets it). With ``flops_per_second`` nothing is timed (``t_f`` and
    ``t_b`` are flops over that rate): the profile is fully reproducible.
    Flops ignore memory traffic, so layers that are cheap in flops but move
    much data (normalisations, element-wise ops) get less than their share.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import planning
      >>> params = {"dense1": {"w": jnp.ones((32, 64))}, "dense2": {"w": jnp.ones((64, 8))}}
      >>> loss = lambda p, x: jnp.sum((x @ p["dense1"]["w"]) @ p["dense2"]["w"])
      >>> prof = planning.profile_backward(loss, params, jnp.ones((16, 32)), method="flops")
      >>> [layer.name for layer in prof.layers], prof.sizes
      (["['dense2']", "['dense1']"], (512, 2048))
      >>> len(prof.t_b), all(t >= 0 for t in prof.t_b)
      (2, True)

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``, jit-able.
      params: the model's parameters (a Flax params tree).
      batch: the batch ``loss_fn`` takes (one device's share of a global
        batch, to profile what each device computes).
      repeats: timed runs per function (their median is kept), >= 1.
      method: ``"time"`` or ``"flops"``.
      flops_per_second: with ``method="flops"``, a fixed rate instead of the
        measured scale (None: measured); > 0.

    Returns:
      A :class:`BackwardProfile` (layers in backward order).

    Raises:
      ValueError: a ``loss_fn`` that is not callable or does not return a
        scalar, empty ``params``, ``repeats < 1``, an unknown ``method``, or a
        ``flops_per_second`` that is not a positive number (or is given with
        ``method="time"``).
    """
    repeats = _check_profile_options(loss_fn, repeats, method, flops_per_second)
    layers = model_layers(params, loss_fn, batch)[::-1]  # backward order
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    index = {jax.tree_util.keystr(p): i for i, (p, _) in enumerate(flat)}
    leaves = [jnp.asarray(v) for _, v in flat]

    def loss_of(diff_idx, const_idx):
        def f(diff, const, b):
            full = [None] * len(leaves)
            for i, v in zip(diff_idx, diff, strict=True):
                full[i] = v
            for i, v in zip(const_idx, const, strict=True):
                full[i] = v
            return loss_fn(jax.tree_util.tree_unflatten(treedef, full), b)

        return f

    def program(num_layers: int):
        """The jitted value_and_grad w.r.t. the first ``num_layers`` layers (backward order)."""
        diff_idx = sorted(index[p] for layer in layers[:num_layers] for p in layer.paths)
        const_idx = sorted(set(range(len(leaves))) - set(diff_idx))
        f = loss_of(diff_idx, const_idx)
        args = ([leaves[i] for i in diff_idx], [leaves[i] for i in const_idx], batch)
        fn = jax.jit(f) if num_layers == 0 else jax.jit(jax.value_and_grad(f))
        return fn, args

    loss_fn_jit, loss_args = program(0)
    out = jax.eval_shape(loss_fn_jit, *loss_args)
    if getattr(out, "shape", None) != ():
        raise ValueError(
            f"loss_fn must return a scalar loss, got {getattr(out, 'shape', type(out).__name__)}"
        )
    L = len(layers)
    sizes = tuple(layer.size for layer in layers)

    if method == "time":
        totals = []
        for num in range(L + 1):
            fn, args = program(num)
            compiled = fn.lower(*args).compile()
            totals.append(_median_seconds(compiled, args, repeats))
            del compiled
        t_f = totals[0]
        t_b = tuple(max(0.0, b - a) for a, b in zip(totals[:-1], totals[1:], strict=True))
        return BackwardProfile(layers, sizes, t_b, float(t_f), method)

    flops, timed = [], {}
    for num in range(L + 1):
        fn, args = program(num)
        lowered = fn.lower(*args)
        # The unoptimised module's count: the same per-layer shares as the
        # compiled one (within 0.2% on ResNet-20) without compiling L + 1
        # programs; only the two timed ones are compiled.
        flops.append(_flops(lowered))
        if flops_per_second is None and num in (0, L):
            timed[num] = _median_seconds(lowered.compile(), args, repeats)
        del lowered
    diffs = [max(0.0, b - a) for a, b in zip(flops[:-1], flops[1:], strict=True)]
    total = sum(diffs)
    if flops_per_second is None:
        t_f = timed[0]
        backward = timed[L] - timed[0]
        if backward > 0 and total > 0:
            scale = backward / total
        else:
            # Timing noise (a loaded machine) can make the measured backward
            # vanish: use the forward pass's measured seconds per flop instead.
            scale = t_f / flops[0] if flops[0] > 0 else 0.0
    else:
        t_f = flops[0] / flops_per_second
        scale = 1.0 / flops_per_second
    t_b = tuple(d * scale for d in diffs)
    return BackwardProfile(
        layers, sizes, t_b, float(t_f), method, tuple(map(float, diffs)), float(flops[0])
    )


# ---------------------------------------------------------------------------
# Sparsification cost.
# ---------------------------------------------------------------------------


def _real_vector(name: str, values) -> np.ndarray:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise ValueError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise ValueError(f"{name}[{i}] must be a real number, got {v!r}")
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"{name}[{i}] must be finite and >= 0, got {v!r}")
        out.append(float(v))
    return np.asarray(out, np.float64)


def fit_sparsify_cost(sizes, seconds) -> merge_lib.LinearCost:
    """Least-squares fit of ``seconds ~ a + b * n`` with ``a, b >= 0``.

    Example:
      >>> from jaxcomp import planning
      >>> cost = planning.fit_sparsify_cost([1000, 2000, 4000], [3e-5, 5e-5, 9e-5])
      >>> round(cost.alpha * 1e6, 6), round(cost.beta * 1e9, 6)  # 10 us + 20 ns per element
      (10.0, 20.0)

    Args:
      sizes: element counts (at least two distinct), >= 0.
      seconds: the time measured at each size, >= 0.

    Returns:
      A :class:`~jaxcomp.planning.LinearCost` ``n -> a + b * n`` (``alpha=a``,
      ``beta=b``, ``bytes_per_element=1``). When the unconstrained fit has a
      negative coefficient, the best fit with that coefficient 0 is returned.

    Raises:
      ValueError: mismatched lengths, fewer than two distinct sizes, negative
        or non-finite values.
    """
    n = _real_vector("sizes", sizes)
    s = _real_vector("seconds", seconds)
    if len(n) != len(s):
        raise ValueError(f"sizes and seconds must have the same length, got {len(n)} and {len(s)}")
    if len(np.unique(n)) < 2:
        raise ValueError(f"sizes must hold at least two distinct element counts, got {list(n)}")
    design = np.stack([np.ones_like(n), n], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, s, rcond=None)
    if a < 0 or b < 0:
        # The constrained optimum lies on a boundary: a = 0 or b = 0.
        b0 = max(0.0, float(n @ s) / float(n @ n))
        a0 = float(np.mean(s))
        err_a0 = float(np.sum((s - b0 * n) ** 2))
        err_b0 = float(np.sum((s - a0) ** 2))
        a, b = (0.0, b0) if err_a0 <= err_b0 else (a0, 0.0)
    return merge_lib.linear_cost(max(0.0, float(a)), max(0.0, float(b)))


def measure_sparsify_cost(
    selector: str | Callable = "ldte_bs",
    *,
    ratio: float = 1e-3,
    sizes: Sequence[int] = (2**12, 2**14, 2**16, 2**18),
    repeats: int = 5,
    seed: int = 0,
) -> merge_lib.LinearCost:
    """Times a top-k selector on this device at several sizes and fits ``a + b n``.

    The data are Laplacian (mean 5e-4, standard deviation 5e-3, the LDTE-BS
    paper's gradient model and ``experiments/bench_selection.py``'s
    ``laplace``); ``k = max(1, ceil(ratio * n))``. Each size is one jitted
    ``selector(x, k)`` call, warmed up, timed as the median of ``repeats``.
    This is the threshold selection alone: the extraction of the message and
    the residual update add another pass or two over the group.

    Args:
      selector: a name in ``jaxcomp.selection.SELECTORS`` (``"random_k"`` is
        given a fixed key) or a callable ``(x, k) -> Selection``.
      ratio: the compression ratio, in (0, 1].
      sizes: element counts to time (at least two distinct, each >= 1).
      repeats: timed runs per size, >= 1.
      seed: the data's seed.

    Example:
      >>> from jaxcomp import planning
      >>> cost = planning.measure_sparsify_cost("top_k", ratio=0.01, sizes=(1024, 4096), repeats=1)
      >>> cost.alpha >= 0 and cost.beta >= 0
      True

    Returns:
      :func:`fit_sparsify_cost` of the medians (seconds).

    Raises:
      ValueError: an unknown selector name, a ratio outside (0, 1], bad
        ``sizes`` or ``repeats``.
    """
    from jaxcomp import selection  # noqa: PLC0415 (selection imports nothing from here)

    if isinstance(selector, str):
        select = selection.get_selector(selector)
        if selector == "random_k":
            select = _with_key(select)
        elif selector == "threshold":
            raise ValueError("selector 'threshold' has no k to time; pass a top-k selector")
    elif callable(selector):
        select = selector
    else:
        raise ValueError(f"selector must be a selector name or a callable, got {selector!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    repeats = _check_repeats(repeats)
    if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (Sequence, np.ndarray)):
        raise ValueError(f"sizes must be a sequence of element counts, got {sizes!r}")
    for i, n in enumerate(sizes):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 1:
            raise ValueError(f"sizes[{i}] must be an integer >= 1, got {n!r}")
    if len(set(int(n) for n in sizes)) < 2:
        raise ValueError(f"sizes must hold at least two distinct element counts, got {sizes!r}")
    rng = np.random.default_rng(seed)
    seconds = []
    for n in sizes:
        n = int(n)
        x = jnp.asarray(rng.laplace(5e-4, 5e-3 / math.sqrt(2), n).astype(np.float32))
        k = selection.target_count(float(ratio), n)
        fn = jax.jit(lambda v, k=k: select(v, k))
        seconds.append(_median_seconds(fn, (x,), repeats))
    return fit_sparsify_cost([int(n) for n in sizes], seconds)


def _with_key(select):
    def run(x, k):
        return select(x, k, key=jax.random.key(0))

    return run


def load_sparsify_cost(
    path: str,
    method: str = "ldte_bs",
    *,
    data: str = "laplace",
    metric: str = "threshold_ms",
) -> merge_lib.LinearCost:
    """``t_s`` fitted to a ``bench_selection.json`` of ``experiments/bench_selection.py``.

    That file holds, per data set and size, each method's median milliseconds:
    ``threshold_ms`` (the selector alone, as :func:`measure_sparsify_cost`
    times it) and ``step_ms`` (the whole compress step of one tensor:
    accumulate, select, extract the message, update the residual).

    Example:
      >>> import json, os, tempfile
      >>> from jaxcomp import planning
      >>> ms = {n: 0.01 + 1e-6 * n for n in (1024, 4096, 16384)}  # a cut-down bench_selection.json
      >>> rows = [{"data": "laplace", "n": n, "methods": {"ldte_bs": {"threshold_ms": t}}}
      ...         for n, t in ms.items()]
      >>> path = os.path.join(tempfile.mkdtemp(), "bench_selection.json")
      >>> with open(path, "w") as f:
      ...     json.dump({"meta": {}, "results": rows}, f)
      >>> cost = planning.load_sparsify_cost(path, "ldte_bs")
      >>> round(cost.alpha * 1e6, 6), round(cost.beta * 1e9, 6)  # 10 us + 1 ns per element
      (10.0, 1.0)

    Args:
      path: the JSON file.
      method: a method the benchmark ran (``"ldte_bs"``, ``"top_k"``, ...).
      data: the data set (``"laplace"``, ``"mixture"``, ``"zeros99"``).
      metric: ``"threshold_ms"`` or ``"step_ms"``.

    Returns:
      :func:`fit_sparsify_cost` of the sizes and times (in seconds).

    Raises:
      ValueError: an unreadable file, a bad ``metric``, or fewer than two
        sizes of ``method`` on ``data`` in it.
    """
    if metric not in ("threshold_ms", "step_ms"):
        raise ValueError(f"metric must be 'threshold_ms' or 'step_ms', got {metric!r}")
    try:
        with open(path) as f:
            rows = json.load(f)["results"]
        points = {
            int(r["n"]): float(r["methods"][method][metric]) / 1e3
            for r in rows
            if r["data"] == data and method in r["methods"]
        }
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"path {path!r} is not a bench_selection.json ({e!r})") from None
    if len(points) < 2:
        raise ValueError(
            f"{path} holds {len(points)} size(s) of method={method!r} on data={data!r}; "
            "the fit needs at least two"
        )
    n = sorted(points)
    return fit_sparsify_cost(n, [points[k] for k in n])


# ---------------------------------------------------------------------------
# Planning a model.
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    """A merge plan of one model, ready for a sparsifier's ``groups=``.

    Attributes:
      plan: the :class:`~jaxcomp.planning.MergePlan` over layer positions
        (backward order).
      profile: the :class:`BackwardProfile` it was planned from.
      groups: the plan's groups as leaf paths (``jax.tree_util.keystr``), one
        tuple per group in backward order, every leaf in exactly one group:
        pass to ``jaxcomp.ldte_bs(..., groups=model_plan.groups)``.
      t_s: the sparsification cost used.
      t_c: the communication cost used.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp import planning
      >>> params = {"d1": {"w": jnp.ones((4, 3))}, "d2": {"w": jnp.ones((3, 2))}}
      >>> loss = lambda p, x: jnp.sum((x @ p["d1"]["w"]) @ p["d2"]["w"])
      >>> x = jnp.ones((2, 4))
      >>> mp = planning.plan_for_model(
      ...     loss, params, x, ratio=0.1,
      ...     t_s=planning.linear_cost(0.0, 0.0), t_c=planning.linear_cost(1.0, 0.0),
      ...     profile=planning.profile_backward(loss, params, x, method="flops"))
      >>> mp.groups  # a send costs 1 s: one group, last layer first
      (("['d2']['w']", "['d1']['w']"),)
      >>> mp.plan.groups
      ((0, 1),)
    """

    plan: merge_lib.MergePlan
    profile: BackwardProfile
    groups: tuple[tuple[str, ...], ...]
    t_s: Callable[[int], float]
    t_c: Callable[[int], float]

    def predicted_times(self) -> dict[str, float]:
        """Predicted iteration time of every planner on this profile (``{method: seconds}``)."""
        p = self.profile
        return {
            m: merge_lib.plan_merge(p.sizes, p.t_b, p.t_f, self.t_s, self.t_c, m).time
            for m in merge_lib.METHODS
        }

    def summary(self) -> str:
        """A few lines: the plan, its predicted time beside the other planners', the groups."""
        p, plan = self.profile, self.plan
        times = self.predicted_times()
        others = ", ".join(f"{m} {1e3 * t:.3f} ms" for m, t in times.items() if m != plan.method)
        lines = [
            f"DLGS merge plan ({plan.method}): {len(p.layers)} layers in {plan.num_groups} "
            f"groups, predicted iteration {1e3 * plan.time:.3f} ms ({others})",
            f"  profile ({p.method}): forward {1e3 * p.t_f:.3f} ms, backward "
            f"{1e3 * p.backward_time:.3f} ms, {sum(p.sizes):,} parameters",
        ]
        for i, g in enumerate(plan.groups):
            names = p.layers[g[0]].name + ("" if len(g) == 1 else f" .. {p.layers[g[-1]].name}")
            size = sum(p.sizes[q] for q in g)
            lines.append(f"  group {i}: {len(g)} layer(s), {size:,} elements: {names}")
        return "\n".join(lines)


def plan_for_model(
    loss_fn: Callable[[Any, Any], Any],
    params,
    batch,
    *,
    ratio: float,
    t_c: Callable[[int], float],
    t_s: Callable[[int], float] | None = None,
    method: str = "optimal",
    profile: BackwardProfile | None = None,
) -> ModelPlan:
    """Profiles a model, plans its layer merging, and returns the sparsifier's groups.

    Example:
      >>> import jax, jax.numpy as jnp, optax
      >>> import flax.linen as nn
      >>> import jaxcomp
      >>> from jaxcomp import planning
      >>> class MLP(nn.Module):
      ...     @nn.compact
      ...     def __call__(self, x):
      ...         h = nn.relu(nn.Dense(16)(x))
      ...         return nn.Dense(3)(h)
      >>> model = MLP()
      >>> x, y = jnp.ones((8, 4)), jnp.zeros(8, jnp.int32)
      >>> params = model.init(jax.random.key(0), x)["params"]
      >>> def loss_fn(p, batch):
      ...     logits = model.apply({"params": p}, batch[0])
      ...     return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
      >>> plan = planning.plan_for_model(
      ...     loss_fn, params, (x, y), ratio=0.1,
      ...     t_s=planning.linear_cost(1e-5, 1e-9), t_c=planning.linear_cost(1.0, 0.0),
      ...     profile=planning.profile_backward(loss_fn, params, (x, y), method="flops"))
      >>> len(plan.groups)  # a send costs 1 s: everything in one group
      1
      >>> plan.groups[0]  # the last layer's leaves first
      ... # doctest: +NORMALIZE_WHITESPACE
      ("['Dense_1']['kernel']", "['Dense_1']['bias']",
       "['Dense_0']['kernel']", "['Dense_0']['bias']")
      >>> tx = jaxcomp.top_k(ratio=0.1, groups=plan.groups)

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (see :func:`profile_backward`).
      params: the model's parameters.
      batch: one device's batch.
      ratio: the compression ratio, in (0, 1] (for measuring ``t_s``).
      t_c: communication cost of a group of ``n`` elements, e.g.
        ``planning.linear_cost(alpha, beta, bytes_per_element=8 * ratio)``.
      t_s: sparsification cost of a group of ``n`` elements (None:
        :func:`measure_sparsify_cost` of ``"ldte_bs"`` at ``ratio``).
      method: a planner of :data:`~jaxcomp.planning.METHODS`.
      profile: a profile of these ``params`` (None: ``profile_backward(loss_fn,
        params, batch)``, timed).

    Returns:
      A :class:`ModelPlan`.

    Raises:
      ValueError: an unknown ``method``, a ``ratio`` outside (0, 1], a
        non-callable cost, a ``profile`` of other parameters, or as
        :func:`profile_backward` and :func:`~jaxcomp.planning.plan_merge`.
    """
    if method not in merge_lib.METHODS:
        raise ValueError(f"method must be one of {merge_lib.METHODS}, got {method!r}")
    if isinstance(ratio, bool) or not isinstance(ratio, numbers.Real) or not 0 < ratio <= 1:
        raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
    if not callable(t_c):
        raise ValueError(f"t_c must be a callable of a group's element count, got {t_c!r}")
    if t_s is not None and not callable(t_s):
        raise ValueError(f"t_s must be None or a callable of a group's element count, got {t_s!r}")
    if profile is not None:
        if not isinstance(profile, BackwardProfile):
            raise ValueError(
                f"profile must be a BackwardProfile or None, got {type(profile).__name__}"
            )
        # Another model's profile is refused before its loss is traced on these params.
        if sorted((layer.name, layer.size) for layer in profile.layers) != sorted(
            (layer.name, layer.size) for layer in model_layers(params)
        ):
            raise ValueError(
                "profile: its layers are not those of params (profiled another model?)"
            )
    layers = model_layers(params, loss_fn, batch)[::-1]
    if profile is None:
        profile = profile_backward(loss_fn, params, batch)
    elif tuple(profile.layers) != layers:
        raise ValueError("profile: its layers are not those of params (profiled another model?)")
    if t_s is None:
        t_s = measure_sparsify_cost("ldte_bs", ratio=float(ratio))
    plan = merge_lib.plan_merge(profile.sizes, profile.t_b, profile.t_f, t_s, t_c, method)
    groups = tuple(tuple(p for q in g for p in layers[q].paths) for g in plan.groups)
    return ModelPlan(plan, profile, groups, t_s, t_c)
