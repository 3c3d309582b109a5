"""Selection of many leaves at once (``jaxcomp.selection.segmented``) keeps per-leaf results.

Two references:

- ``top_k`` and ``dgc``: today's per-leaf code path (the same 1-D selector
  wrapped in a plain function, which has no segmented form and so runs leaf
  by leaf, as every selector did before); updates, residuals, velocities and
  statistics must agree bit for bit.
- ``ldte_bs``: the segmented form sums its moments by rows and takes its
  first-pass probes from the Laplace fit, so its thresholds can differ from the
  1-D selector's in the last bits. The per-layer contract is that a leaf's
  result depends on that leaf alone: the whole tree must give each leaf what
  the leaf gets when it is compressed alone, bit for bit, and every leaf's
  count must land in the window ``[k, 1.5 k]`` whenever the data allow.

- ``random_k``: the packed form selects on per-row draws of each leaf's own
  key, the 1-D form's draws: bit for bit as the per-leaf path, on one device
  and inside ``shard_map``; the draws are checked for uniformity and the
  capacity cut for ties forced at the k-th draw.
- ``threshold`` and ``binary_search`` from zero (bit for bit), ``trimmed_top_k``,
  ``gaussian_k`` and ``binary_search`` from the mean: the
  same counts and iterations as the 1-D selectors per segment, thresholds
  within a few ulp (their means are summed by rows), and the same per-leaf
  contract as ``ldte_bs``.

The segmented kernels themselves are checked against numpy and the 1-D
selectors (``capacity_cut`` message, ``exact_top_k`` and ``dgc_sample``
thresholds).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.comm import sparse_allreduce as sa
from jaxcomp.selection import segmented as sg
from jaxcomp.selection import selectors as S1


def _bits(x):
    a = np.asarray(x)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def _tree(seed, kind="laplace"):
    rng = np.random.default_rng(seed)
    shapes = {"a": (40, 30), "b": (30,), "c": (257,), "d": (3, 3, 8, 16), "e": (5,)}
    g = {k: rng.laplace(size=s).astype(np.float32) for k, s in shapes.items()}
    if kind == "degenerate":  # each leaf its own case: every leaf is selected alone
        g["b"][:] = 0.0
        g["c"][:] = 1.0
        g["c"][-1] = 5.0  # larger than the tie group, last in index order
        g["d"][:] = 1.0  # a tensor of ties
        g["e"][:] = -2.0  # a constant
    if kind == "nonfinite" and seed == 2:
        g["a"][1, 2] = np.nan
    return {k: jnp.asarray(v) for k, v in g.items()}


def _per_leaf(select):
    """The same selector as a plain function: no segmented form, leaf by leaf
    (with a ``key`` parameter, so ``dgc``'s sample start comes from the same key)."""

    def one(x, k, **options):
        return select(x, k, **options)

    def one_keyed(x, k, *, key, **options):
        return select(x, k, key=key, **options)

    return one_keyed if select in (S1.dgc_sample, S1.random_k) else one


def _run(tx, *runs):
    """Each run (a list of gradient trees) from a fresh state, through one jitted
    step: runs on data of the same shapes share one compilation."""
    params = jax.tree.map(jnp.zeros_like, runs[0][0])
    step = jax.jit(tx.update)
    out = []
    for trees in runs:
        state = tx.init(params)
        for g in trees:
            u, state = step(g, state)
            out.append((u, state))
    return out


def _assert_same(a, b):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(_bits(x), _bits(y))


OPTIONS = {
    "plain": {},
    "warmup": {"warmup_ratios": (0.25, 0.05), "steps_per_epoch": 2},
    "momentum": {"momentum": 0.9},
    "defer": {"defer_residual": True},
    "groups": {"groups": [["['a']", "['c']"]]},
    "global": {"granularity": "global"},
    "dense_small": {"min_dense_size": 30},
    "reuse": {"reuse_period": 2},
    "low_pass": {"low_pass": 0.5, "momentum": 0.9},
    "reuse_warmup": {"reuse_period": 3, "warmup_ratios": (0.25,), "steps_per_epoch": 2},
    "warmup_momentum_reuse": {
        "warmup_ratios": (0.25, 0.05),
        "steps_per_epoch": 1,
        "momentum": 0.9,
        "reuse_period": 2,
    },
}


# The data are not part of the program: every case runs Laplacian, degenerate
# (ties, zeros, a constant: one tree, as every leaf is selected alone) and
# NaN-step (skipped) gradients through one compilation per path. top_k takes
# every option; the other selectors the options that meet their own code
# (dgc's sample under warm-up, reuse, merged segments and the deferred mask;
# random_k's draws; no reuse, as random_k has no threshold). dgc's earlier
# rule differs from the default in the selection only.
# Warm-up (a traced k: the costliest programs to compile, the per-leaf
# reference most of all) runs combined with reuse, and with momentum and
# reuse: each selects with the traced k at a warm-up ratio and after
# them, so warm-up on its own runs no path those two do not (random_k, which
# has no reuse, keeps it).
KINDS = ("laplace", "degenerate", "nonfinite")
TOP_K_OPTIONS = tuple(sorted(set(OPTIONS) - {"warmup"}))
DGC_OPTIONS = (
    "plain", "reuse_warmup", "warmup_momentum_reuse", "global", "groups", "defer",
)  # fmt: skip


@pytest.mark.parametrize(
    "name,select,rule,option",
    [("top_k", S1.exact_top_k, None, o) for o in TOP_K_OPTIONS]
    + [("dgc", S1.dgc_sample, "reference", o) for o in DGC_OPTIONS]
    + [("dgc", S1.dgc_sample, "at_least_k", o) for o in ("plain", "reuse_warmup")]
    + [("random_k", S1.random_k, None, o) for o in ("plain", "warmup", "defer", "groups")],
)
def test_exact_selectors_match_the_per_leaf_path(name, select, rule, option):
    runs = [[_tree(s, kind) for s in range(5)] for kind in KINDS]
    kw = dict(OPTIONS[option])
    new = getattr(jaxcomp, name)(0.02, **kw, **({} if rule is None else {"rule": rule}))
    old_kw = dict(kw)
    if rule is not None:
        old_kw["selector_options"] = {"rule": rule}
    if rule == "reference":  # jaxcomp.dgc's default capacity: at most k
        old_kw["capacity_factor"] = 1.0
    old = jaxcomp.sparsify(_per_leaf(select), 0.02, **old_kw)
    for (u1, s1), (u2, s2) in zip(_run(new, *runs), _run(old, *runs), strict=True):
        _assert_same(u1, u2)
        _assert_same(s1, s2)


LDTE_BS = {
    "improved": lambda: jaxcomp.ldte_bs(0.02),
    "paper": lambda: jaxcomp.ldte_bs(0.02, variant="paper"),
    "mle": lambda: jaxcomp.ldte_bs(0.02, estimator="mle"),
}


@pytest.mark.parametrize("variant", sorted(LDTE_BS))
def test_ldte_bs_tree_gives_each_leaf_its_own_result(variant):
    # Two Laplacian leaves, zeros, ties and a constant, each alone and in the tree.
    trees = [_tree(s, "degenerate") for s in range(4)]
    whole = _run(LDTE_BS[variant](), trees)
    for name in trees[0]:
        alone = _run(LDTE_BS[variant](), [{name: t[name]} for t in trees])
        for (u1, s1), (u2, s2) in zip(whole, alone, strict=True):
            np.testing.assert_array_equal(_bits(u1[name]), _bits(u2[name]))
            np.testing.assert_array_equal(_bits(s1.residual[name]), _bits(s2.residual[name]))
            for field in ("threshold", "sent_count", "search_iterations"):
                a = jaxcomp.statistics(s1)[field][name]
                b = jaxcomp.statistics(s2)[field][name]
                np.testing.assert_array_equal(_bits(a), _bits(b))


def test_ldte_bs_counts_land_in_the_window():
    rng = np.random.default_rng(0)
    sizes = (300, 5000, 70_000, 1000)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[3] = (rng.normal(size=1000) * 1e-3).astype(np.float32)
    parts[3][:20] = rng.laplace(size=20)  # a mixture: the Laplace fit misses
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    table = np.asarray([[S1.target_count(0.01, n) for n in sizes]])
    for variant in (
        {},
        {"search": "bisect", "aim": 1.0, "moment_sample": None, "probes": False},
        {"estimator": "mle"},
        {"estimator": "mle", "moment_sample": 200},  # the median of a sample of a sample
    ):
        sel = jax.jit(lambda x, v=variant: sg.ldte_bs(layout, x, sg.Targets(table), **v))(x)
        for s, p in enumerate(parts):
            k = table[0, s]
            t = np.float32(sel.threshold[s])
            count = int(np.sum(np.abs(p) > t))
            assert count == int(sel.count[s])
            assert k <= count <= int(np.floor(1.5 * k)), (variant, s, count, k)


def test_segment_median_is_jnp_median_bit_for_bit():
    rng = np.random.default_rng(4)
    sizes = (1, 2, 5, 256, 257, 1000, 4096, 0, 3)
    parts = [(rng.laplace(size=n) + 0.3).astype(np.float32) for n in sizes]
    parts[6][:] = 3.0  # constant
    parts[8][:] = [np.float32(3e38), np.float32(3e38), -1.0]  # the midpoint's sum overflows
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    med = jax.jit(lambda x: sg._segment_median(layout, x))(x)
    for s, p in enumerate(parts):
        ref = np.float32(jnp.median(jnp.asarray(p))) if p.size else np.float32(np.nan)
        assert _bits(med[s]) == _bits(ref) or (np.isnan(ref) and np.isnan(med[s])), s


def test_segmented_top_k_and_dgc_equal_the_1d_selectors():
    rng = np.random.default_rng(1)
    sizes = (5, 300, 1000, 70_000, 257, 16, 3000, 1)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[2][:50] = 1.0  # ties at the top
    parts[5][:] = 0.0  # fewer than k nonzeros
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    table = np.asarray([[S1.target_count(0.01, n) for n in sizes]])
    at_least_k = functools.partial(sg.dgc_sample, rule="at_least_k")
    pairs = (
        (sg.exact_top_k, S1.exact_top_k),
        (sg.dgc_sample, S1.dgc_sample),  # rule="reference", sample start 0
        (at_least_k, functools.partial(S1.dgc_sample, rule="at_least_k")),
    )
    for seg, one in pairs:
        sel = jax.jit(lambda x, seg=seg: seg(layout, x, sg.Targets(table)))(x)
        for s, p in enumerate(parts):
            ref = jax.jit(one, static_argnums=1)(jnp.asarray(p), int(table[0, s]))
            assert _bits(sel.threshold[s]) == _bits(ref.threshold)
            assert int(sel.count[s]) == int(ref.count)
            assert int(sel.iterations[s]) == int(ref.iterations)


FIT_SELECTORS = [
    (sg.fixed_threshold, S1.fixed_threshold, {"threshold": 1.5}),
    (sg.binary_search, S1.binary_search, {}),
    (sg.binary_search, S1.binary_search, {"start": "mean", "upper": 2.0}),
    (sg.binary_search, S1.binary_search, {"max_iters": 3}),  # the fallback
    (sg.trimmed_top_k, S1.trimmed_top_k, {}),
    (sg.trimmed_top_k, S1.trimmed_top_k, {"start": 0.5, "step": 0.1}),
    (sg.gaussian_k, S1.gaussian_k, {}),
    (sg.gaussian_k, S1.gaussian_k, {"refine": False}),
    (sg.gaussian_k, S1.gaussian_k, {"corrections": 0, "lower": 0.9, "upper": 1.1}),
    (sg.sidco_segmented, S1.sidco, {}),
    (sg.sidco_segmented, S1.sidco, {"dist": "gamma", "stages": 3}),
    (sg.sidco_segmented, S1.sidco, {"dist": "gpareto", "stages": 2}),
]


# Every variant at ratio 0.01; each selector's defaults also at 0.1.
FIT_CASES = [(*case, 0.01) for case in FIT_SELECTORS] + [
    (seg, one, kw, 0.1) for seg, one, kw in FIT_SELECTORS if not kw or seg is sg.fixed_threshold
]


@pytest.mark.parametrize(
    "seg,one,kw,ratio", FIT_CASES, ids=lambda v: getattr(v, "__name__", str(v))
)
def test_segmented_fit_selectors_decide_as_the_1d_selectors(seg, one, kw, ratio):
    rng = np.random.default_rng(3)
    sizes = (5, 300, 1000, 70_000, 257, 16, 3000, 1, 4096)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[2][:50] = 1.0  # ties at the top
    parts[5][:] = 0.0  # fewer than k nonzeros
    parts[8][:] = -3.0  # constant
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    table = np.asarray([[S1.target_count(ratio, n) for n in sizes]])
    sel = jax.jit(lambda x: seg(layout, x, sg.Targets(table), **kw))(x)
    for s, p in enumerate(parts):
        ref = jax.jit(functools.partial(one, k=int(table[0, s]), **kw))(jnp.asarray(p))
        t, t_ref = np.float32(sel.threshold[s]), np.float32(ref.threshold)
        if seg is sg.fixed_threshold or (seg is sg.binary_search and "start" not in kw):
            assert _bits(t) == _bits(t_ref)
        else:  # the means are summed by rows: the last bits may differ
            assert abs(int(_bits(t)) - int(_bits(t_ref))) <= 4, (s, t, t_ref)
        # The count is the threshold's, checked in numpy, and the 1-D selector's.
        assert int(sel.count[s]) == int(np.sum(np.abs(p) > t)) == int(ref.count), s
        assert int(sel.iterations[s]) == int(ref.iterations), s


@pytest.mark.parametrize("name", ["gaussian_k", "trimmed_top_k", "threshold", "binary_search"])
def test_fit_selectors_tree_gives_each_leaf_its_own_result(name):
    make = {
        "binary_search": lambda: jaxcomp.binary_search(0.02, start="mean"),
        "gaussian_k": lambda: jaxcomp.gaussian_k(0.02),
        "trimmed_top_k": lambda: jaxcomp.trimmed_top_k(0.02),
        "threshold": lambda: jaxcomp.threshold(0.02, threshold=1.0),
    }[name]
    trees = [_tree(s, "degenerate") for s in range(3)]
    whole = _run(make(), trees)
    for leaf in trees[0]:
        alone = _run(make(), [{leaf: t[leaf]} for t in trees])
        for (u1, s1), (u2, s2) in zip(whole, alone, strict=True):
            np.testing.assert_array_equal(_bits(u1[leaf]), _bits(u2[leaf]))
            np.testing.assert_array_equal(_bits(s1.residual[leaf]), _bits(s2.residual[leaf]))
            for field in ("threshold", "sent_count", "search_iterations"):
                a = jaxcomp.statistics(s1)[field][leaf]
                b = jaxcomp.statistics(s2)[field][leaf]
                np.testing.assert_array_equal(_bits(a), _bits(b))


def test_capacity_cut_sends_the_largest_ties_to_the_lower_index():
    rng = np.random.default_rng(2)
    sizes = (64, 600, 5, 1000)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[0][:] = 0.0
    parts[0][:10] = 1.0
    parts[0][63] = 5.0  # larger than the ties, last in index order
    parts[1][::3] = 2.0  # many ties, some below
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    t = jnp.asarray([0.5, 0.1, 0.0, 0.0], jnp.float32)
    count = sg.count_above(layout, x, t)
    cap = jnp.asarray([6, 40, 2, 1000], jnp.int32)
    cut, limit = jax.jit(lambda x: sg.capacity_cut(layout, x, t, count, cap))(x)
    mask = layout.unpack(sg.sent_mask(layout, x, cut, limit))
    for s, p in enumerate(parts):
        a = np.abs(p)
        selected = np.flatnonzero(a > np.float32(t[s]))
        # numpy: the cap largest of the selected, ties to the lower index.
        order = selected[np.lexsort((selected, -a[selected]))][: int(cap[s])]
        expected = np.zeros(p.shape, bool)
        expected[order] = True
        np.testing.assert_array_equal(np.asarray(mask[s]), expected)
    assert bool(np.asarray(mask[0])[63])


def test_warmup_compiles_one_selector_and_counts_do_not_grow_with_leaves():
    def loops(n_leaves, **kw):
        params = {f"l{i}": jnp.zeros((100 + 37 * i,)) for i in range(n_leaves)}
        tx = optax.chain(jaxcomp.ldte_bs(0.01, **kw), optax.sgd(0.1))
        state = tx.init(params)
        text = jax.jit(tx.update).lower(params, state).compile().as_text()
        return text.count(" while(")

    warm = {"warmup_ratios": jaxcomp.DGC_WARMUP, "steps_per_epoch": 10}
    assert loops(2) == loops(12)
    assert loops(3, **warm) == loops(3)


def _mesh_run(tx, trees, n_dev, include=None):
    """``tx.update`` inside shard_map on ``n_dev`` devices, each its own gradients
    (and, with ``include``, its own backup-worker flag per step)."""
    mesh = jax.make_mesh((n_dev,), ("data",))
    spec = P("data")
    params = jax.tree.map(jnp.zeros_like, trees[0][0])
    state = jax.tree.map(lambda a: jnp.stack([a] * n_dev), tx.init(params))

    def run(grads, state, flags):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        kw = {} if include is None else {"include": flags[0]}
        upd, new = tx.update(first(grads), first(state), **kw)
        return jax.tree.map(lambda a: jnp.asarray(a)[None], (upd, new))

    step = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, spec))  # noqa: E731
    state = put(state)
    out = []
    for s, per_device in enumerate(trees):
        g = put(jax.tree.map(lambda *a: jnp.stack(a), *per_device))
        flags = put(jnp.ones((n_dev,), bool) if include is None else jnp.asarray(include[s]))
        u, state = step(g, state, flags)
        out.append((u, state))
    return out


def _assert_mesh_paths_agree(new, old, trees, n_dev, include=None):
    """Both transforms' steps in shard_map: updates and states bit for bit."""
    for (u1, s1), (u2, s2) in zip(
        _mesh_run(new, trees, n_dev, include), _mesh_run(old, trees, n_dev, include), strict=True
    ):
        _assert_same(u1, u2)
        _assert_same(s1, s2)


@pytest.mark.parametrize(
    "exchange,option",
    [(e, "plain") for e in ("sparse", "dense", "auto", "server", "gossip")]
    + [(e, "plain") for e in ("gtopk", "oktopk", "auto_topk")]
    + [(e, "warmup_momentum_reuse") for e in ("sparse", "gtopk", "scalecom")]
    + [("scalecom", "low_pass")],
)
def test_exchanges_match_the_per_leaf_path(exchange, option):
    # gossip: each device's own ring mix. The options together: a traced k,
    # the velocity and the reused thresholds in one program, with an exchange
    # that leaves the residual to the selection (sparse: dense, auto, server
    # and gossip take the same selection) and with the two that return pairs
    # to it (gtopk) or send at the leader's positions (scalecom). gtopk: every
    # group's rounds in one message; oktopk: every group's regions and top
    # in one all_to_all and one all-gather (returned pairs added to the
    # residual as the group adds them); auto_topk: one of those, sparse or
    # dense per group. (sparcml: below.)
    # scalecom: every device's values at the cyclic leader's positions.
    n_dev = 4
    trees = [[_tree(10 * s + d) for d in range(n_dev)] for s in range(4)]
    kw = dict(OPTIONS[option], axis_name="data", exchange=exchange)
    new = jaxcomp.top_k(0.02, **kw)
    old = jaxcomp.sparsify(_per_leaf(S1.exact_top_k), 0.02, **kw)
    _assert_mesh_paths_agree(new, old, trees, n_dev)


@pytest.mark.parametrize("ratio", [0.02, 0.3])
def test_sparcml_decides_once_for_all_leaves(ratio):
    # SparCML's choice between sparse rounds and a dense all-reduce is made
    # once for the packed leaves, as for one fused buffer: their total count
    # against the union capacity of their total size. Residuals as each
    # leaf's own choice, bit for bit; the update the same exact mean (up to
    # the order of the additions); the bytes the fused buffer's (numpy
    # formula, checked on the per-leaf path's bytes too). 0.3: dense.
    n_dev = 4
    trees = [[_tree(10 * s + d) for d in range(n_dev)] for s in range(3)]
    kw = dict(axis_name="data", exchange="sparcml")
    new = _mesh_run(jaxcomp.top_k(ratio, **kw), trees, n_dev)
    old = _mesh_run(jaxcomp.sparsify(_per_leaf(S1.exact_top_k), ratio, **kw), trees, n_dev)
    sizes = [x.size for x in jax.tree.leaves(trees[0][0])]
    # Message capacities: ceil(1.5 k) slots (the default capacity_factor), at most n.
    caps = [min(n, -(-3 * S1.target_count(ratio, n) // 2)) for n in sizes]

    def wire(cap, n, total):
        union = sa.sparcml_union_capacity(cap, n, n_dev, 4)
        counts = 2 * (n_dev - 1) / n_dev * 4
        if total <= union:
            return sum(min(cap << i, union) for i in range(2)) * 8 + counts
        return 2 * (n_dev - 1) / n_dev * n * 4 + counts

    choices = set()
    for (u1, s1), (u2, s2) in zip(new, old, strict=True):
        for a, b in zip(jax.tree.leaves(u1), jax.tree.leaves(u2), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
        _assert_same(s1._replace(wire_bytes=0), s2._replace(wire_bytes=0))
        sent = np.asarray(s1.sent_count).sum(0)  # per leaf, over the devices
        want = wire(sum(caps), sum(sizes), sent.sum())
        np.testing.assert_allclose(np.asarray(s1.wire_bytes), want, rtol=1e-6)
        per_leaf = sum(wire(*c) for c in zip(caps, sizes, sent, strict=True))
        np.testing.assert_allclose(np.asarray(s2.wire_bytes), per_leaf, rtol=1e-6)
        choices.add(sent.sum() <= sa.sparcml_union_capacity(sum(caps), sum(sizes), n_dev, 4))
    assert choices == {ratio < 0.1}  # the branch meant


def test_scatter_matches_the_per_leaf_path_in_one_all_to_all():
    # exchange="scatter" (FSDP): the leaves marked split are reduce-scattered
    # (each device gets its region of the mean), the others go "auto". All
    # split leaves' pairs travel in one all_to_all of offsets and one of
    # values; updates (each device's regions), residuals (with the overflow
    # of a crowded region back in them) and statistics bit for bit as the
    # per-leaf path, which runs one pair of all_to_alls per split leaf.
    n_dev, ratio = 4, 0.05
    shapes = {"a": (40, 30), "b": (30,), "c": (256,), "d": (8, 3, 16), "e": (5,)}
    split = {"a": True, "b": False, "c": True, "d": True, "e": False}

    def tree(seed):
        rng = np.random.default_rng(seed)
        g = {k: rng.laplace(size=v).astype(np.float32) for k, v in shapes.items()}
        g["a"][:8] *= 100  # region 0 of "a" holds every large value: overflow
        return {k: jnp.asarray(v) for k, v in g.items()}

    trees = [[tree(10 * s + d) for d in range(n_dev)] for s in range(3)]
    mesh = jax.make_mesh((n_dev,), ("data",))
    put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    stack = lambda ts: jax.tree.map(lambda *a: jnp.stack(a), *ts)  # noqa: E731
    first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
    kw = dict(axis_name="data", exchange="scatter")
    results, all_to_alls = [], []
    per_leaf = jaxcomp.sparsify(_per_leaf(S1.exact_top_k), ratio, **kw)
    for tx in (jaxcomp.top_k(ratio, **kw), per_leaf):

        def run(g, state, tx=tx):
            u, new = tx.update(first(g), first(state), scatter=split)
            return jax.tree.map(lambda a: jnp.asarray(a)[None], (u, new))

        step = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
        params = jax.tree.map(jnp.zeros_like, trees[0][0])
        state = put(stack([tx.init(params)] * n_dev))
        text = step.lower(put(stack(trees[0])), state).compile().as_text()
        all_to_alls.append(text.count(" all-to-all("))
        out = []
        for per_device in trees:
            u, state = step(put(stack(per_device)), state)
            out.append((u, state))
        results.append(out)
    for (u1, s1), (u2, s2) in zip(*results, strict=True):
        assert u1["a"].shape == (n_dev, 10, 30)  # this device's region
        _assert_same(u1, u2)
        _assert_same(s1, s2)
    assert all_to_alls == [2, 6]
    # Step 0, device 0: the cap = 1.5 k largest of "a" all lie in region 0,
    # of which a peer takes scatter_capacity(cap); the rest stays in the residual.
    cap = -(-3 * S1.target_count(ratio, 1200) // 2)
    top = np.argsort(-np.abs(np.asarray(trees[0][0]["a"]).ravel()), kind="stable")[:cap]
    kept = np.asarray(results[0][0][1].residual["a"])[0].ravel()[top] != 0
    assert kept.sum() == cap - sa.scatter_capacity(cap, n_dev) > 0


@pytest.mark.parametrize("exchange", ["sparse", "dense", "auto"])
def test_backup_workers_match_the_per_leaf_path(exchange):
    # include=: a left-out device sends nothing and keeps its residual; the
    # means are over the included devices (one left out, then another, then none).
    n_dev = 4
    trees = [[_tree(10 * s + d) for d in range(n_dev)] for s in range(3)]
    include = [[True, False, True, True], [True, True, True, False], [True] * 4]
    kw = dict(axis_name="data", exchange=exchange, momentum=0.9)
    new = jaxcomp.top_k(0.02, **kw)
    old = jaxcomp.sparsify(_per_leaf(S1.exact_top_k), 0.02, **kw)
    _assert_mesh_paths_agree(new, old, trees, n_dev, include)


@pytest.mark.parametrize("exchange", ["server", "gossip"])
def test_backup_workers_rejected_where_the_exchange_cannot_average_over_them(exchange):
    tx = jaxcomp.top_k(0.02, axis_name="data", exchange=exchange)
    with pytest.raises(ValueError, match=f"exchange='{exchange}' does not take include="):
        _mesh_run(tx, [[_tree(d) for d in range(2)]], 2, [[True, False]])


@pytest.mark.parametrize("ratio", [0.02, 0.4])
def test_gossip_sends_each_leaf_in_its_smaller_form_as_the_per_leaf_path(ratio):
    # A 3-element leaf's 2 pairs (16 bytes) outweigh its 12 dense bytes: it is
    # mixed dense beside the others' pairs; at ratio 0.4 every leaf goes dense.
    n_dev = 4
    trees = [
        [{**_tree(10 * s + d), "f": jnp.arange(3.0) * (d - s)} for d in range(n_dev)]
        for s in range(3)
    ]
    kw = dict(axis_name="data", exchange="gossip", momentum=0.5)
    new = jaxcomp.top_k(ratio, **kw)
    old = jaxcomp.sparsify(_per_leaf(S1.exact_top_k), ratio, **kw)
    _assert_mesh_paths_agree(new, old, trees, n_dev)


@pytest.mark.parametrize(
    "exchange", ["sparse", "server", "gossip", "gtopk", "oktopk", "sparcml", "auto_topk"]
)
def test_one_collective_per_kind_whatever_the_leaf_count(exchange):
    def collectives(n_leaves):
        mesh = jax.make_mesh((4,), ("data",))
        params = {f"l{i}": jnp.zeros((100 + 37 * i,)) for i in range(n_leaves)}
        tx = jaxcomp.ldte_bs(0.01, axis_name="data", exchange=exchange)
        state = jax.tree.map(lambda a: jnp.stack([a] * 4), tx.init(params))
        grads = jax.tree.map(lambda a: jnp.stack([a] * 4), params)

        def run(g, s):
            u, s = tx.update(jax.tree.map(lambda a: a[0], g), jax.tree.map(lambda a: a[0], s))
            return jax.tree.map(lambda a: a[None], u)  # the server's is typed per device

        f = jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
        put = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
        text = jax.jit(f).lower(put(grads), put(state)).compile().as_text()
        ops = ("all-gather", "all-gather-start", "all-reduce", "all-reduce-start")
        ops += ("collective-permute", "collective-permute-start", "all-to-all")
        return sum(text.count(f" {op}(") for op in ops)

    assert collectives(2) == collectives(12)


@pytest.mark.parametrize("wrap", ["chain", "masked", "multi_transform", "MultiSteps", "inject"])
def test_per_leaf_statistics_are_one_array_read_leaf_by_leaf(wrap):
    # The statistics of a step are one array per field, an entry per leaf in
    # jax.tree.leaves order; jaxcomp.statistics gives them back leaf by leaf,
    # through the optax wrappers. Reference: numpy on each leaf's update.
    g = {k: v for k, v in _tree(3).items()}
    g["e"] = jnp.arange(1.0, 6.0)  # 5 elements: sent dense (min_dense_size)
    compressed = ["a", "b", "c", "d", "e"]
    top_k = functools.partial(jaxcomp.top_k, min_dense_size=8)
    if wrap == "chain":
        tx = optax.chain(top_k(0.05), optax.sgd(-1.0))
    elif wrap == "masked":
        compressed = ["a", "c", "e"]
        mask = {k: k in compressed for k in g}
        tx = optax.chain(optax.masked(top_k(0.05), mask), optax.sgd(-1.0))
    elif wrap == "multi_transform":
        compressed = ["a", "c", "e"]
        labels = {k: "c" if k in compressed else "d" for k in g}
        tx = optax.chain(
            optax.multi_transform({"c": top_k(0.05), "d": optax.identity()}, labels),
            optax.sgd(-1.0),
        )
    elif wrap == "MultiSteps":
        tx = optax.MultiSteps(optax.chain(top_k(0.05), optax.sgd(-1.0)), 1)
    else:
        injected = optax.inject_hyperparams(top_k, static_args=("ratio", "min_dense_size"))
        tx = optax.chain(injected(ratio=0.05, momentum=0.5), optax.sgd(-1.0))
    u, state = jax.jit(tx.update)(g, tx.init(g), g)
    counts = np.asarray(optax.tree.get(state, "sent_count"))
    assert counts.shape == (len(compressed),)  # one entry per compressed leaf
    stats = jaxcomp.statistics(state)
    for i, k in enumerate(sorted(compressed)):
        x, sent = np.asarray(g[k]).ravel(), np.asarray(u[k]).ravel()
        n_sent = np.count_nonzero(sent)
        assert int(stats["sent_count"][k]) == int(counts[i]) == n_sent, k
        dense = x.size <= 8  # min_dense_size: sent whole
        item = 4 if dense else 8  # a float32 value, or an (int32 index, value) pair
        assert int(stats["message_bytes"][k]) == item * n_sent, k
        if not dense:  # everything sent is above the threshold, nothing kept is
            t = float(stats["threshold"][k])
            assert np.abs(x[sent != 0]).min() > t >= np.abs(x[sent == 0]).max(), k
            assert n_sent == int(np.ceil(0.05 * x.size)), k


def test_statistics_refuses_global_and_states_without_a_sparsifier():
    g = _tree(0)
    tx = jaxcomp.top_k(0.05, granularity="global")
    _, state = tx.update(g, tx.init(g))
    assert np.shape(state.sent_count) == ()  # one count for the tree
    with pytest.raises(ValueError, match="granularity='global'"):
        jaxcomp.statistics(state)
    with pytest.raises(ValueError, match="holds 0 sparsifier states"):
        jaxcomp.statistics(optax.sgd(0.1).init(g))
    # Stacked per device: the leading axis is the device.
    one = jaxcomp.top_k(0.05).init(g)
    stacked = jax.tree.map(lambda x: np.stack([x, x, x]), one)
    stacked = stacked._replace(sent_count=np.arange(15, dtype=np.int32).reshape(3, 5))
    got = jaxcomp.statistics(stacked)["sent_count"]
    for i, k in enumerate(sorted(g)):
        np.testing.assert_array_equal(got[k], [i, 5 + i, 10 + i])


@pytest.mark.parametrize("kernels", ["this_platform", "default"])
def test_kth_largest_above_matches_numpy_and_its_early_finish(kernels, monkeypatch):
    # The search stops a segment once its bracket's count says which element
    # is the k-th (count(hi) == k - 1: the largest below; count(lo) == k: the
    # smallest above) and finishes it by a masked maximum: the same float32
    # as sorting, with ties, zeros, infinities, k = 1, k = count, k > count.
    # "default": the kernels' GPU/TPU forms (lax.platform_dependent's default), run here.
    if kernels == "default":
        monkeypatch.setattr(lax, "platform_dependent", lambda *a, default, **_: default(*a))
    rng = np.random.default_rng(5)
    sizes = (1, 7, 256, 300, 1000, 5000, 70_000, 513, 64)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[2][:100] = 3.0  # ties
    parts[3][::2] = 0.0
    parts[5][:3] = np.inf
    parts[7][:] = np.round(parts[7])  # small integers: ties everywhere
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    fn = jax.jit(
        lambda x, t, c, k, top, active: sg.kth_largest_above(
            layout, x, t, c, k, top=top, active=active
        )
    )
    mags = [np.abs(p) for p in parts]
    for trial in range(12):
        t = np.asarray(
            [np.quantile(m, rng.uniform(0, 0.99)) if trial % 3 else 0.0 for m in mags], np.float32
        )
        c = np.asarray([np.sum(m > tt) for m, tt in zip(mags, t, strict=True)], np.int32)
        k = np.asarray([rng.integers(1, max(int(cc), 1) + 2) for cc in c], np.int32)
        k[0] = 1
        active = rng.uniform(size=len(sizes)) < 0.8
        for top in (np.full(len(sizes), np.inf, np.float32), np.asarray([m.max() for m in mags])):
            got = np.asarray(fn(x, t, c, k, jnp.asarray(top, jnp.float32), active))
            for s, m in enumerate(mags):
                if not active[s]:
                    continue
                above = np.sort(m[m > t[s]])[::-1]
                want = above[k[s] - 1] if c[s] >= k[s] else np.float32(0)
                assert _bits(np.float32(got[s])) == _bits(np.float32(want)), (trial, s)


# ---------------------------------------------------------------------------
# random_k's packed form.
# ---------------------------------------------------------------------------


def test_random_k_scores_of_a_segment_do_not_depend_on_its_neighbours():
    # A segment's scores and selection, alone and packed with others (at
    # another row), bit for bit; and the 1-D selector draws the same k.
    sizes = (300, 20, 1000, 7)
    layout = sg.SegmentLayout(sizes)
    keys = jax.random.split(jax.random.key(4), len(sizes))
    table = np.asarray([[S1.target_count(0.05, n) for n in sizes]])
    packed = sg.random_scores(layout, jnp.zeros((layout.num_rows, sg.ROW)), keys)
    sel = sg.random_k(layout, packed, sg.Targets(table))
    for s, (n, part) in enumerate(zip(sizes, layout.unpack(packed), strict=True)):
        alone = sg.SegmentLayout((n,))
        one = sg.random_scores(alone, jnp.zeros((alone.num_rows, sg.ROW)), keys[s : s + 1])
        np.testing.assert_array_equal(_bits(part), _bits(alone.unpack(one)[0]))
        sel1 = sg.random_k(alone, one, sg.Targets(table[:, s : s + 1]))
        assert _bits(sel.threshold[s]) == _bits(sel1.threshold[0])
        k = int(table[0, s])
        assert int(sel.count[s]) == k
        chosen = np.flatnonzero(np.asarray(part) > np.float32(sel.threshold[s]))
        ref = S1.random_k(jnp.zeros(n), k, key=keys[s]).indices
        np.testing.assert_array_equal(chosen, np.asarray(ref))
    # Positive finite scores, padding 0 (below every draw).
    valid = np.asarray(layout.valid())
    assert np.all(np.asarray(packed)[valid] > 0) and np.all(np.isfinite(packed))
    assert not np.asarray(packed)[~valid].any()
    assert sg.ROW == S1.RANDOM_ROW


def test_random_k_packed_draws_are_uniform():
    # Through the transform, over 3000 seeds: the marginals of a 40-element
    # leaf (k = 14: each coordinate 1050 times, binomial sd ~26) and the
    # subsets of a 6-element leaf packed after it (k = 3: each of the 20
    # subsets 150 times). Chi-square bounds far in the tail (p < 1e-5).
    g = {"a": jnp.ones((40,)), "b": jnp.ones((6,))}

    def sent(seed):
        tx = jaxcomp.sparsify("random_k", 0.34, seed=seed)  # k = 14 of 40, 3 of 6
        u, _ = tx.update(g, tx.init(g))
        return jax.tree.map(lambda x: x != 0, u)

    n_seeds = 3000
    masks = jax.jit(jax.vmap(sent))(jnp.arange(n_seeds))
    a, b = np.asarray(masks["a"]), np.asarray(masks["b"])
    assert (a.sum(axis=1) == 14).all() and (b.sum(axis=1) == 3).all()
    # Marginals of a: each coordinate sent with probability 14 / 40.
    p = 14 / 40
    expected = n_seeds * p
    chi2 = np.sum((a.sum(axis=0) - expected) ** 2 / (expected * (1 - p)))
    assert chi2 < 90, chi2  # 40 cells: mean ~40
    # Subsets of b: each of the 20 3-subsets with probability 1 / 20.
    codes = b.astype(np.int64) @ (1 << np.arange(6))
    counts = np.bincount(codes, minlength=64)
    subsets = [c for c in range(64) if bin(c).count("1") == 3]
    assert counts.sum() == counts[subsets].sum()
    expected = n_seeds / 20
    chi2 = np.sum((counts[subsets] - expected) ** 2 / expected)
    assert chi2 < 60, chi2  # 19 degrees of freedom: mean 19


def test_random_k_capacity_cut_keeps_k_of_tied_draws(monkeypatch):
    # Every draw equal: all of a leaf pass its threshold, the cut at k sends
    # the k lowest indices (lax.top_k's choice), and nothing is lost.
    def tied(layout, x, key):
        del key
        return sg.varying_like(jnp.where(layout.valid(), jnp.float32(1.0), 0.0), x)

    monkeypatch.setitem(sg.SCORES, sg.random_k, tied)
    g = _tree(1)
    tx = jaxcomp.random_k(0.05, capacity_factor=2.0)  # the capacity is k whatever the factor
    u, state = jax.jit(tx.update)(g, tx.init(g))
    for name, x in g.items():
        k = S1.target_count(0.05, x.size)
        sent = np.flatnonzero(np.asarray(u[name]).ravel())
        np.testing.assert_array_equal(sent, np.arange(k))
        assert int(jaxcomp.statistics(state)["sent_count"][name]) == k
        total = np.asarray(u[name]) + np.asarray(state.residual[name])
        np.testing.assert_array_equal(_bits(total), _bits(x))


@pytest.mark.parametrize(
    "exchange,option",
    [("sparse", "plain"), ("auto", "plain"), ("server", "plain"), ("gossip", "plain"),
     ("auto", "warmup_momentum")],
)  # fmt: skip
def test_random_k_exchanges_match_the_per_leaf_path(exchange, option):
    # Each device its own draws (the key folded with the device index), the
    # same on both paths; updates, residuals and statistics bit for bit.
    n_dev = 4
    trees = [[_tree(10 * s + d) for d in range(n_dev)] for s in range(3)]
    opts = {"warmup_momentum": {"warmup_ratios": (0.25,), "steps_per_epoch": 1, "momentum": 0.9}}
    kw = dict(OPTIONS.get(option, opts.get(option)), axis_name="data", exchange=exchange)
    new = jaxcomp.random_k(0.02, **kw)
    old = jaxcomp.sparsify(_per_leaf(S1.random_k), 0.02, **kw)
    _assert_mesh_paths_agree(new, old, trees, n_dev)
