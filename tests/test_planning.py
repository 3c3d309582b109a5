"""Tests of jaxcomp.planning: the DLGS merge planners against brute force, and the profiler."""

from __future__ import annotations

import itertools
import json
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import planning

# ---------------------------------------------------------------------------
# An independent model of docs/algorithms.md §4 (nothing from merge.py).
# ---------------------------------------------------------------------------


def recursion_time(groups, sizes, t_b, t_f, t_s, t_c):
    """``t_iter`` of a grouping by the §4 recursion over the merged layers.

    Merging gives one "layer" per group (``d`` and ``t_b`` summed); the
    merged layers are numbered ``L..1`` in backward order and the recursion
    is applied as written (``k`` below is the paper's layer index ``l``):
    ``tau_b[L] = t_f``, ``tau_b[l] = tau_s[l+1] + t_s[l+1]``,
    ``tau_s[l] = tau_b[l] + t_b[l]``, ``tau_c[L] = tau_s[L] + t_s[L]``,
    ``tau_c[l] = max(tau_s[l] + t_s[l], tau_c[l+1] + t_c[l+1])``,
    ``t_iter = tau_c[1] + t_c[1]``.
    """
    L = len(groups)
    d, tb = {}, {}
    for i, g in enumerate(groups):  # group i (backward order) is layer L - i
        d[L - i] = sum(sizes[p] for p in g)
        back = 0.0
        for p in g:
            back += t_b[p]
        tb[L - i] = back
    ts = {k: t_s(d[k]) for k in d}
    tc = {k: t_c(d[k]) for k in d}
    tau_b, tau_s, tau_c = {}, {}, {}
    for k in range(L, 0, -1):
        tau_b[k] = t_f if k == L else tau_s[k + 1] + ts[k + 1]
        tau_s[k] = tau_b[k] + tb[k]
        if k == L:
            tau_c[k] = tau_s[k] + ts[k]
        else:
            tau_c[k] = max(tau_s[k] + ts[k], tau_c[k + 1] + tc[k + 1])
    return tau_c[1] + tc[1]


def all_groupings(num_layers):
    """Every contiguous grouping of positions ``0..L-1`` (``2^(L-1)`` of them)."""
    for cuts in itertools.product((False, True), repeat=num_layers - 1):
        groups = [[0]]
        for p, cut in zip(range(1, num_layers), cuts, strict=True):
            if cut:
                groups.append([p])
            else:
                groups[-1].append(p)
        yield tuple(tuple(g) for g in groups)


def brute_force(sizes, t_b, t_f, t_s, t_c):
    """``(best time, every grouping's time)`` by enumeration."""
    times = {g: recursion_time(g, sizes, t_b, t_f, t_s, t_c) for g in all_groupings(len(sizes))}
    return min(times.values()), times


def paper_greedy(sizes, t_b, t_f, t_s, t_c):
    """The DLGS paper's Algorithm 2, literally: scan l = L..2, keep a merge when t_iter drops."""
    L = len(sizes)
    groups = [[p] for p in range(L)]
    current = recursion_time(groups, sizes, t_b, t_f, t_s, t_c)
    for p in range(L - 1):  # layer l = L - p merges into l - 1 (position p + 1)
        # The groups closed before p, the open group holding p grown by p + 1,
        # then singletons (Algorithm 2's scan has not reached them yet).
        closed = [g for g in groups if g[-1] < p]
        open_group = next(g for g in groups if p in g)
        candidate = closed + [open_group + [p + 1]] + [[q] for q in range(p + 2, L)]
        t = recursion_time(candidate, sizes, t_b, t_f, t_s, t_c)
        if t < current:
            groups, current = candidate, t
    return tuple(tuple(g) for g in groups), current


def sqrt_cost(a, b):
    return lambda n: a + b * math.sqrt(n)


def random_instance(rng, num_layers, kind):
    sizes = [int(v) for v in rng.integers(1, 5000, num_layers)]
    t_b = [float(v) for v in rng.uniform(0.0, 1.0, num_layers)]
    t_f = float(rng.uniform(0.0, 2.0))
    if kind == "linear":
        t_s = planning.linear_cost(rng.uniform(0, 0.3), rng.uniform(0, 1e-4))
        t_c = planning.linear_cost(rng.uniform(0, 2.0), rng.uniform(0, 1e-3))
    elif kind == "sqrt":
        t_s = sqrt_cost(rng.uniform(0, 0.3), rng.uniform(0, 5e-3))
        t_c = sqrt_cost(rng.uniform(0, 2.0), rng.uniform(0, 5e-2))
    else:  # mixed: linear selection, concave (e.g. bandwidth-ramp) link
        t_s = planning.linear_cost(rng.uniform(0, 0.3), rng.uniform(0, 1e-4))
        t_c = sqrt_cost(rng.uniform(0, 2.0), rng.uniform(0, 5e-2))
    return sizes, t_b, t_f, t_s, t_c


INSTANCES = [
    (L, kind, seed)
    for L in range(1, 13)
    for kind in ("linear", "sqrt", "mixed")
    for seed in range(2)
]


@pytest.mark.parametrize("num_layers, kind, seed", INSTANCES)
def test_planners_against_brute_force(num_layers, kind, seed):
    rng = np.random.default_rng([num_layers, seed, ("linear", "sqrt", "mixed").index(kind)])
    args = random_instance(rng, num_layers, kind)
    best, times = brute_force(*args)

    optimal = planning.optimal_merge(*args)
    assert optimal.method == "optimal"
    assert math.isclose(optimal.time, best, rel_tol=1e-9)
    assert math.isclose(times[optimal.groups], best, rel_tol=1e-9)  # its groups achieve it

    greedy = planning.greedy_merge(*args)
    assert greedy.time >= optimal.time * (1 - 1e-12)
    groups, t = paper_greedy(*args)
    assert greedy.groups == groups
    assert math.isclose(greedy.time, t, rel_tol=1e-9)

    # The timeline of every grouping is the recursion (per-layer one included).
    for g in list(times)[:64]:
        assert math.isclose(planning.timeline(g, *args).time, times[g], rel_tol=1e-12)
    singletons = tuple((p,) for p in range(num_layers))
    assert math.isclose(planning.no_merge(*args).time, times[singletons], rel_tol=1e-12)
    assert math.isclose(
        planning.merge_all(*args).time, times[(tuple(range(num_layers)),)], rel_tol=1e-12
    )


def test_optimal_beats_greedy_on_a_small_instance():
    # Four equal layers (4 elements, backward 2 each), no forward time, one
    # unit per sparsification call, and a send costing 3 + 0.5 per element.
    # Greedy merges layer L into L-1 (the per-layer schedule's 23 drops to
    # 22), then keeps merging (21, then 20: everything in one group). It can
    # never undo the first merge, but the best grouping sends layer L alone
    # and the other three together: L's send overlaps their backward (19).
    sizes, t_b, t_f = [4, 4, 4, 4], [2, 2, 2, 2], 0.0
    t_s, t_c = planning.linear_cost(1.0, 0.0), planning.linear_cost(3.0, 0.5)
    best, times = brute_force(sizes, t_b, t_f, t_s, t_c)
    greedy = planning.greedy_merge(sizes, t_b, t_f, t_s, t_c)
    optimal = planning.optimal_merge(sizes, t_b, t_f, t_s, t_c)
    assert greedy.groups == ((0, 1, 2, 3),)
    assert greedy.time == times[((0, 1, 2, 3),)] == paper_greedy(sizes, t_b, t_f, t_s, t_c)[1]
    assert optimal.time == best == times[((0,), (1, 2, 3))]
    assert optimal.time < greedy.time
    assert planning.no_merge(sizes, t_b, t_f, t_s, t_c).time == times[((0,), (1,), (2,), (3,))]


def test_timeline_schedule_per_layer_matches_recursion():
    rng = np.random.default_rng(7)
    sizes, t_b, t_f, t_s, t_c = random_instance(rng, 6, "sqrt")
    groups = tuple((p,) for p in range(6))
    tl = planning.timeline(groups, sizes, t_b, t_f, t_s, t_c)
    assert tl.time == recursion_time(groups, sizes, t_b, t_f, t_s, t_c)
    assert tl.schedule[0].backward_start == t_f
    for a, b in zip(tl.schedule[:-1], tl.schedule[1:], strict=True):
        assert b.backward_start == a.sparsify_end  # one compute stream
        assert b.comm_start == max(b.sparsify_end, a.comm_end)  # one link


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sizes": []}, "sizes"),
        ({"sizes": [1, -2, 3]}, r"sizes\[1\]"),
        ({"sizes": [1, 2.5, 3]}, r"sizes\[1\]"),
        ({"sizes": "abc"}, "sizes"),
        ({"t_b": [1.0, 1.0]}, "t_b"),
        ({"t_b": [1.0, -1.0, 1.0]}, r"t_b\[1\]"),
        ({"t_b": [1.0, float("nan"), 1.0]}, r"t_b\[1\]"),
        ({"t_f": -1.0}, "t_f"),
        ({"t_f": float("inf")}, "t_f"),
        ({"t_s": 3.0}, "t_s"),
        ({"t_c": None}, "t_c"),
        ({"t_c": lambda n: -1.0}, r"t_c\("),
        ({"t_s": lambda n: float("nan")}, r"t_s\("),
        ({"t_c": lambda n: "slow"}, r"t_c\("),
    ],
)
def test_bad_arguments_name_themselves(change, message):
    args = {
        "sizes": [1, 2, 3],
        "t_b": [1.0, 1.0, 1.0],
        "t_f": 0.0,
        "t_s": planning.linear_cost(1.0, 0.0),
        "t_c": planning.linear_cost(1.0, 0.1),
    } | change
    for fn in (planning.optimal_merge, planning.greedy_merge, planning.no_merge):
        with pytest.raises(ValueError, match=message):
            fn(**args)
    with pytest.raises(ValueError, match=message):
        planning.timeline([(0,), (1,), (2,)], **args)


@pytest.mark.parametrize(
    "groups",
    [[], [(0,), (2,), (1,)], [(0, 1)], [(0, 1), (1, 2)], [(0,), ()], "abc", [(0, 1, 2, 3)]],
)
def test_bad_groups_raise(groups):
    cost = planning.linear_cost(1.0, 0.0)
    with pytest.raises(ValueError, match="groups"):
        planning.timeline(groups, [1, 2, 3], [1.0, 1.0, 1.0], 0.0, cost, cost)


def test_linear_cost_and_plan_merge_validation():
    with pytest.raises(ValueError, match="alpha"):
        planning.linear_cost(-1.0, 0.0)
    with pytest.raises(ValueError, match="beta"):
        planning.linear_cost(0.0, float("nan"))
    with pytest.raises(ValueError, match="bytes_per_element"):
        planning.linear_cost(0.0, 0.0, -8)
    cost = planning.linear_cost(1.0, 0.0)
    with pytest.raises(ValueError, match="method"):
        planning.plan_merge([1], [1.0], 0.0, cost, cost, method="best")


# ---------------------------------------------------------------------------
# Layers and profiles.
# ---------------------------------------------------------------------------


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="second")(x)  # created second, named to sort after "first"...
        return nn.Dense(8, name="first")(x)  # ...but created after it


class Shuffled(nn.Module):
    """Submodules whose alphabetical (jax.tree.flatten) order is not their execution order."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(8, name="z_in")(x)
        for _ in range(11):  # Dense_0 .. Dense_10: 'Dense_10' sorts before 'Dense_2'
            x = nn.relu(nn.Dense(8)(x))
        x = _Block(name="block")(x)
        x = nn.LayerNorm(name="norm")(x)
        return nn.Dense(3, name="a_out")(x)


def test_model_layers_follow_execution_order():
    model = Shuffled()
    params = model.init(jax.random.key(0), jnp.ones((2, 5)))["params"]
    # Record the order the parameterised modules actually run in.
    ran = []

    def record(next_fun, args, kwargs, context):
        module = context.module
        if context.method_name == "__call__" and isinstance(module, (nn.Dense, nn.LayerNorm)):
            ran.append(jax.tree_util.keystr(tuple(jax.tree_util.DictKey(k) for k in module.path)))
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply({"params": params}, jnp.ones((2, 5)))
    expected = (
        ["['z_in']"]
        + [f"['Dense_{i}']" for i in range(11)]
        + ["['block']['second']", "['block']['first']", "['norm']", "['a_out']"]
    )
    assert ran == expected
    layers = planning.model_layers(params)
    assert [layer.name for layer in layers] == expected
    sorted_names = sorted(
        {jax.tree_util.keystr(p[:-1]) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
    )
    assert sorted_names != expected  # the test would be void otherwise
    assert layers[0].paths == ("['z_in']['kernel']", "['z_in']['bias']")
    assert layers[0].size == 5 * 8 + 8
    assert layers[-2].paths == ("['norm']['scale']", "['norm']['bias']")
    all_paths = [p for layer in layers for p in layer.paths]
    flat = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert sorted(all_paths) == sorted(flat) and len(all_paths) == len(flat)
    assert sum(layer.size for layer in layers) == sum(x.size for x in jax.tree.leaves(params))
    # Parameters rebuilt by jax.tree.map come back key-sorted ('Dense_10' before
    # 'Dense_2'): their dicts no longer tell the order, the forward pass does.
    rebuilt = jax.tree.map(lambda v: v, params)
    assert [layer.name for layer in planning.model_layers(rebuilt)] != expected

    def loss_fn(p, x):
        return jnp.sum(model.apply({"params": p}, x))

    traced = planning.model_layers(rebuilt, loss_fn, jnp.ones((2, 5)))
    assert [layer.name for layer in traced] == expected
    assert traced == layers  # the same layers, paths and sizes


def test_model_layers_root_leaves_and_errors():
    params = {"w": jnp.ones(3), "b": jnp.ones(2), "sub": [jnp.ones(4), {"k": jnp.ones(5)}]}
    layers = planning.model_layers(params)
    assert [(layer.name, layer.size) for layer in layers] == [
        ("['w']", 3),
        ("['b']", 2),
        ("['sub']", 4),
        ("['sub'][1]", 5),
    ]
    with pytest.raises(ValueError, match="params"):
        planning.model_layers({})


class MLP(nn.Module):
    widths: tuple[int, ...] = (256, 128, 64)

    @nn.compact
    def __call__(self, x):
        for w in self.widths[:-1]:
            x = nn.relu(nn.Dense(w)(x))
        return nn.Dense(self.widths[-1])(x)


def _mlp_problem(batch=64, dim=96, widths=(256, 128, 64)):
    model = MLP(widths)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(batch, dim)), jnp.float32)
    y = jnp.asarray(np.arange(batch) % widths[-1], jnp.int32)
    params = model.init(jax.random.key(0), x)["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

    return loss_fn, params, (x, y)


def test_profile_backward_time():
    loss_fn, params, batch = _mlp_problem(batch=8, dim=12, widths=(16, 8, 4))
    prof = planning.profile_backward(loss_fn, params, batch, repeats=2, method="time")
    assert prof.method == "time" and prof.flops_b is None and prof.flops_f is None
    assert [layer.name for layer in prof.layers] == ["['Dense_2']", "['Dense_1']", "['Dense_0']"]
    assert prof.sizes == (8 * 4 + 4, 16 * 8 + 8, 12 * 16 + 16)
    assert len(prof.t_b) == 3
    assert all(t >= 0 and math.isfinite(t) for t in prof.t_b)
    assert prof.t_f > 0
    assert prof.backward_time == sum(prof.t_b)


def test_profile_backward_flops_follow_the_matmuls():
    batch, dim, widths = 64, 96, (256, 128, 64)
    loss_fn, params, data = _mlp_problem(batch, dim, widths)
    prof = planning.profile_backward(loss_fn, params, data, repeats=2, method="flops")
    assert prof.method == "flops" and len(prof.t_b) == 3
    # A Dense layer in x out costs 2 B in out flops per matmul. Differentiating
    # layer l as well adds its weight gradient and the input gradient of layer
    # l + 1 (which only layers below need): each layer is charged what delays
    # its gradient after the next one's. The last layer adds its weight
    # gradient only, and nothing computes the input gradient of the first.
    dims = list(zip((dim, *widths[:-1]), widths, strict=True))
    matmul = [2 * batch * i * o for i, o in dims]
    expected = []
    for pos in range(3):  # backward order
        layer = 2 - pos
        expected.append(matmul[layer] + (matmul[layer + 1] if layer + 1 < 3 else 0))
    # Bias gradients, ReLU and the softmax add a little on top of the matmuls.
    np.testing.assert_allclose(prof.flops_b, expected, rtol=0.03)
    np.testing.assert_allclose(prof.flops_f, sum(matmul), rtol=0.03)  # the forward
    shares = np.asarray(prof.t_b) / sum(prof.t_b)
    np.testing.assert_allclose(shares, np.asarray(expected) / sum(expected), rtol=0.03)
    assert sum(prof.t_b) > 0 and prof.t_f > 0

    # With a fixed rate nothing is timed: the profile is reproducible.
    a = planning.profile_backward(loss_fn, params, data, method="flops", flops_per_second=1e9)
    assert a.flops_b == prof.flops_b and a.flops_f == prof.flops_f and a.layers == prof.layers
    np.testing.assert_allclose(a.t_b, np.asarray(a.flops_b) / 1e9)
    assert a.t_f == a.flops_f / 1e9


def test_profile_backward_validation():
    loss_fn, params, batch = _mlp_problem(batch=4, dim=3, widths=(4, 2))
    with pytest.raises(ValueError, match="repeats"):
        planning.profile_backward(loss_fn, params, batch, repeats=0)
    with pytest.raises(ValueError, match="method"):
        planning.profile_backward(loss_fn, params, batch, method="guess")
    with pytest.raises(ValueError, match="loss_fn"):
        planning.profile_backward("loss", params, batch)
    with pytest.raises(ValueError, match="loss_fn must return a scalar"):
        planning.profile_backward(lambda p, b: b[0], params, batch)
    with pytest.raises(ValueError, match="flops_per_second"):
        planning.profile_backward(loss_fn, params, batch, flops_per_second=1e9)
    with pytest.raises(ValueError, match="flops_per_second"):
        planning.profile_backward(loss_fn, params, batch, method="flops", flops_per_second=0)
    with pytest.raises(ValueError, match="params"):
        planning.profile_backward(loss_fn, {}, batch)


# ---------------------------------------------------------------------------
# Sparsification cost.
# ---------------------------------------------------------------------------


def test_fit_sparsify_cost_recovers_exact_lines():
    sizes = [2**10, 2**12, 2**14, 2**16]
    cost = planning.fit_sparsify_cost(sizes, [3e-5 + 2e-9 * n for n in sizes])
    assert isinstance(cost, planning.LinearCost)
    assert math.isclose(cost.alpha, 3e-5, rel_tol=1e-6)
    assert math.isclose(cost.beta, 2e-9, rel_tol=1e-6)
    assert cost.bytes_per_element == 1.0
    # A negative intercept is clipped: the best line through the origin.
    cost = planning.fit_sparsify_cost([1, 2, 3], [0.0, 1.0, 2.0])
    assert cost.alpha == 0.0 and math.isclose(cost.beta, 8 / 14)
    # A falling trend is clipped: a constant, the mean.
    cost = planning.fit_sparsify_cost([1, 2, 3], [3.0, 2.0, 1.0])
    assert cost.beta == 0.0 and math.isclose(cost.alpha, 2.0)


@pytest.mark.parametrize(
    "sizes, seconds, message",
    [
        ([1, 2], [1.0], "same length"),
        ([4, 4], [1.0, 2.0], "two distinct"),
        ([1, -2], [1.0, 2.0], r"sizes\[1\]"),
        ([1, 2], [1.0, float("inf")], r"seconds\[1\]"),
        ("12", [1.0, 2.0], "sizes"),
    ],
)
def test_fit_sparsify_cost_validation(sizes, seconds, message):
    with pytest.raises(ValueError, match=message):
        planning.fit_sparsify_cost(sizes, seconds)


def test_measure_sparsify_cost_runs_and_validates():
    cost = planning.measure_sparsify_cost("ldte_bs", ratio=0.01, sizes=(256, 1024), repeats=1)
    assert isinstance(cost, planning.LinearCost)
    assert cost.alpha >= 0 and cost.beta >= 0 and cost(1024) > 0
    with pytest.raises(ValueError, match="selector"):
        planning.measure_sparsify_cost("fastest")
    with pytest.raises(ValueError, match="ratio"):
        planning.measure_sparsify_cost(ratio=0.0)
    with pytest.raises(ValueError, match="sizes"):
        planning.measure_sparsify_cost(sizes=(1024,))
    with pytest.raises(ValueError, match="repeats"):
        planning.measure_sparsify_cost(repeats=0)


def test_load_sparsify_cost_reads_bench_selection_json(tmp_path):
    # The layout experiments/bench_selection.py writes (milliseconds per size).
    rows = []
    for data in ("laplace", "mixture"):
        for lg in (10, 12, 14):
            n = 2**lg
            extra = 1.0 if data == "mixture" else 0.0
            rows.append(
                {
                    "data": data,
                    "log2_n": lg,
                    "n": n,
                    "methods": {
                        "top_k": {"threshold_ms": 0.5 + 1e-4 * n, "step_ms": 1.0},
                        "ldte_bs": {
                            "threshold_ms": 0.02 + extra + 2e-6 * n,
                            "step_ms": 0.05 + 4e-6 * n,
                        },
                    },
                }
            )
    path = tmp_path / "bench_selection.json"
    path.write_text(json.dumps({"meta": {}, "results": rows}))
    cost = planning.load_sparsify_cost(str(path))
    assert math.isclose(cost.alpha, 2e-5, rel_tol=1e-6)
    assert math.isclose(cost.beta, 2e-9, rel_tol=1e-6)
    step = planning.load_sparsify_cost(str(path), "ldte_bs", metric="step_ms")
    assert math.isclose(step.alpha, 5e-5, rel_tol=1e-6)
    assert math.isclose(step.beta, 4e-9, rel_tol=1e-6)
    with pytest.raises(ValueError, match="method='gaussian_k'"):
        planning.load_sparsify_cost(str(path), "gaussian_k")
    with pytest.raises(ValueError, match="metric"):
        planning.load_sparsify_cost(str(path), metric="ms")
    (tmp_path / "other.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="path"):
        planning.load_sparsify_cost(str(tmp_path / "other.json"))


# ---------------------------------------------------------------------------
# Planning a model.
# ---------------------------------------------------------------------------


def test_plan_for_model_groups_feed_a_sparsifier():
    loss_fn, params, batch = _mlp_problem(batch=8, dim=12, widths=(16, 8, 4))
    prof = planning.profile_backward(loss_fn, params, batch, method="flops", flops_per_second=1e8)
    t_s = planning.linear_cost(1e-5, 1e-9)
    t_c = planning.linear_cost(50e-6, 1 / 1.25e9, 8 * 0.1)
    flat = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    plans = {}
    for method in planning.METHODS:
        plan = planning.plan_for_model(
            loss_fn, params, batch, ratio=0.1, t_s=t_s, t_c=t_c, method=method, profile=prof
        )
        assert plan.plan == planning.plan_merge(prof.sizes, prof.t_b, prof.t_f, t_s, t_c, method)
        assert plan.profile is prof
        # Every leaf in exactly one group, groups as the plan's layers.
        listed = [p for g in plan.groups for p in g]
        assert sorted(listed) == sorted(flat) and len(listed) == len(flat)
        assert len(plan.groups) == plan.plan.num_groups
        for g, positions in zip(plan.groups, plan.plan.groups, strict=True):
            assert g == tuple(p for q in positions for p in prof.layers[q].paths)
        times = plan.predicted_times()
        assert times[method] == plan.plan.time
        assert times["optimal"] <= min(times.values()) * (1 + 1e-12)
        assert f"({method})" in plan.summary()
        plans[method] = plan
    assert len(plans["all"].groups) == 1 and len(plans["none"].groups) == 3

    for method in ("optimal", "all"):
        tx = jaxcomp.top_k(ratio=0.1, groups=plans[method].groups)
        grads = jax.grad(loss_fn)(params, batch)
        updates, _ = jax.jit(tx.update)(grads, tx.init(params), params)
        assert jax.tree.structure(updates) == jax.tree.structure(params)
        assert all(bool(jnp.all(jnp.isfinite(u))) for u in jax.tree.leaves(updates))


def test_plan_for_model_validation():
    loss_fn, params, batch = _mlp_problem(batch=4, dim=3, widths=(4, 2))
    prof = planning.profile_backward(loss_fn, params, batch, method="flops", flops_per_second=1e8)
    cost = planning.linear_cost(1e-5, 1e-9)
    kw = {"ratio": 0.1, "t_s": cost, "t_c": cost, "profile": prof}
    with pytest.raises(ValueError, match="method"):
        planning.plan_for_model(loss_fn, params, batch, **kw, method="best")
    with pytest.raises(ValueError, match="ratio"):
        planning.plan_for_model(loss_fn, params, batch, **(kw | {"ratio": 2.0}))
    with pytest.raises(ValueError, match="t_c"):
        planning.plan_for_model(loss_fn, params, batch, **(kw | {"t_c": 1.0}))
    with pytest.raises(ValueError, match="t_s"):
        planning.plan_for_model(loss_fn, params, batch, **(kw | {"t_s": 1.0}))
    other = _mlp_problem(batch=4, dim=3, widths=(5, 2))[1]
    with pytest.raises(ValueError, match="profile"):
        planning.plan_for_model(loss_fn, other, batch, **kw)
