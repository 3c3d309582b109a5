"""Groups of leaves compressed and exchanged as one buffer (``groups=``, issue 9 item 2).

The reference is numpy: concatenate a group's accumulators (in
``jax.tree.flatten`` order), select on the concatenation (exact top-k, or the
stored threshold on reuse steps, first ``capacity`` in index order), split
back. Collectives are counted in the step's jaxpr under ``shard_map``.
"""

from __future__ import annotations

import collections

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    Counted,
    CountingTopK,
    bits,
    cap_of,
    expected_sent,
    f32,
    k_of,
    per_leaf,
    ref_threshold,
)
from jax.extend import core as jex_core
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

RATIO = 0.05
SPEC = {
    "conv": {"kernel": ((30, 10), jnp.float32), "bias": ((10,), jnp.float32)},
    "dense": {"kernel": ((200,), jnp.float32), "bias": ((5,), jnp.float32)},
    "emb": ((64,), jnp.bfloat16),
}
# Two merged groups (the second of mixed dtypes, listed out of order); dense.bias alone.
GROUPS = [["['conv']['kernel']", "['conv']['bias']"], ["['emb']", "['dense']['kernel']"]]
LABELS = {"conv": "c", "dense": {"kernel": "d", "bias": None}, "emb": "d"}


def make_tree(rng, spec=SPEC, scale=1.0):
    return jax.tree.map(
        lambda s: jnp.asarray(rng.laplace(0.0, scale, size=s[0])).astype(s[1]),
        spec,
        is_leaf=lambda x: isinstance(x, tuple) and isinstance(x[0], tuple),
    )


def by_path(tree) -> dict:
    return {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(tree)[0]}


def ref_groups(tree, groups) -> list[list[str]]:
    """The groups of paths in flatten order, every other leaf alone."""
    order = list(by_path(tree))
    out = [sorted(g, key=order.index) for g in groups]
    listed = {p for g in groups for p in g}
    return out + [[p] for p in order if p not in listed]


def _check_one_selection_per_group(state):
    """A merged group's leaves share its threshold."""
    thresholds = by_path(per_leaf(state.residual, state.threshold))
    for group in GROUPS:
        ts = {float(np.asarray(thresholds[p])) for p in group}
        assert len(ts) == 1, group


def check_groups_step(tree_g, old_res, upd, new, groups, *, ratio, stored=None):
    """One step against numpy; returns the group thresholds used (for reuse steps)."""
    g, res, u = by_path(tree_g), by_path(old_res), by_path(upd)
    new_res, counts = by_path(new.residual), by_path(per_leaf(new.residual, new.sent_count))
    thresholds = by_path(per_leaf(new.residual, new.threshold))
    mbytes = by_path(per_leaf(new.residual, new.message_bytes))
    used = {}
    for group in ref_groups(tree_g, groups):
        accs = [np.asarray(res[p]) + f32(g[p]) for p in group]
        acc = np.concatenate([a.reshape(-1) for a in accs])
        n = acc.size
        k, cap = k_of(ratio, n), cap_of(k_of(ratio, n), n)
        t = ref_threshold(acc, k) if stored is None else stored[group[0]]
        sent = np.zeros(n, bool)
        sent[expected_sent(acc, t, cap)] = True
        start = 0
        for p, a in zip(group, accs, strict=True):
            mask = sent[start : start + a.size].reshape(a.shape)
            start += a.size
            np.testing.assert_array_equal(f32(u[p]) != 0, mask, err_msg=p)
            assert np.array_equal(f32(u[p]) + np.asarray(new_res[p]), a), p  # nothing lost
            assert int(counts[p]) == int(mask.sum()), p
            assert int(mbytes[p]) == 8 * int(mask.sum()), p  # int32 index + float32 value
            assert np.float32(thresholds[p]) == t, p
            used[p] = t
    return used


def test_groups_match_numpy_concatenation():
    cx = Counted(jaxcomp.top_k(RATIO, groups=GROUPS))
    rng = np.random.default_rng(0)
    state = cx.tx.init(make_tree(rng))
    for _ in range(4):
        g = make_tree(rng)
        upd, new = cx(g, state)
        check_groups_step(g, state.residual, upd, new, GROUPS, ratio=RATIO)
        for p, x in by_path(g).items():
            assert by_path(upd)[p].dtype == x.dtype and by_path(upd)[p].shape == x.shape
        state = new
    assert cx.traces == 1


def test_group_forms_agree_and_global_is_one_group():
    rng = np.random.default_rng(1)
    trees = [make_tree(rng) for _ in range(3)]
    forms = {
        "paths": GROUPS,
        "labels": LABELS,
        "callable": lambda params: jax.tree.map(lambda _: "one", params),
    }
    results = {}
    for name, groups in forms.items():
        tx = jaxcomp.top_k(RATIO, groups=groups)
        state = tx.init(trees[0])
        for g in trees[1:]:
            upd, state = jax.jit(tx.update)(g, state)
        results[name] = (upd, state)
    for field in ("residual", "sent_count", "threshold", "message_bytes"):
        a, b = getattr(results["paths"][1], field), getattr(results["labels"][1], field)
        assert jax.tree.all(jax.tree.map(lambda x, y: bits(x) == bits(y), a, b)), field
    # One label for everything is granularity="global" (whose stats are scalars).
    tx = jaxcomp.top_k(RATIO, granularity="global")
    state = tx.init(trees[0])
    for g in trees[1:]:
        upd, state = jax.jit(tx.update)(g, state)
    one_upd, one = results["callable"]
    ours, theirs = jax.tree.leaves((upd, state.residual)), jax.tree.leaves((one_upd, one.residual))
    for x, y in zip(ours, theirs, strict=True):
        assert bits(x) == bits(y)
    assert int(state.sent_count) == int(one.sent_count.sum())
    assert int(state.message_bytes) == int(one.message_bytes.sum())
    assert {float(t) for t in np.asarray(one.threshold)} == {float(state.threshold)}


@pytest.mark.parametrize("masking", [pytest.param(False, marks=pytest.mark.default_codegen), True])
def test_groups_with_momentum_correction(masking):
    m = 0.9
    cx = Counted(jaxcomp.top_k(RATIO, groups=GROUPS, momentum=m, momentum_masking=masking))
    rng = np.random.default_rng(2)
    state = cx.tx.init(make_tree(rng))
    for _ in range(4):
        g = make_tree(rng)
        upd, new = cx(g, state)
        # numpy copies: a reference computed on JAX arrays would run in float32 through XLA.
        old_v = {p: np.asarray(v) for p, v in by_path(state.velocity).items()}
        old_r = {p: np.asarray(r) for p, r in by_path(state.residual).items()}
        for p, gp in by_path(g).items():
            sent = f32(by_path(upd)[p])
            lhs = sent + np.asarray(by_path(new.residual)[p])
            v = np.asarray(by_path(new.velocity)[p])
            # m*u + g in float32, with or without a fused multiply-add.
            u_two = np.float32(m) * old_v[p] + f32(gp)
            u_fma = (np.float64(np.float32(m)) * old_v[p] + f32(gp).astype(np.float64)).astype(
                np.float32
            )
            ok = (lhs == old_r[p] + u_two) | (lhs == old_r[p] + u_fma)
            assert np.all(ok), p  # nothing lost per leaf
            if masking:
                assert not np.any(v[sent != 0]), p
            else:
                assert np.array_equal(lhs, np.asarray(old_r[p]) + v), p
        _check_one_selection_per_group(new)
        state = new
    assert cx.traces == 1


def test_groups_compose_with_reuse():
    s = 2
    sel = CountingTopK()
    cx = Counted(jaxcomp.sparsify(sel, RATIO, groups=GROUPS, reuse_period=s))
    rng = np.random.default_rng(3)
    state = cx.tx.init(make_tree(rng))
    n_groups = len(ref_groups(state.residual, GROUPS))
    stored = None
    for step in range(5):
        g = make_tree(rng, scale=1.0 + step)  # growing: reuse steps overflow the capacity
        before = sel.read()
        upd, new = cx(g, state)
        refresh = step % s == 0
        assert sel.read() - before == (n_groups if refresh else 0)
        used = check_groups_step(
            g, state.residual, upd, new, GROUPS, ratio=RATIO, stored=None if refresh else stored
        )
        if refresh:
            stored = used
        state = new
    assert cx.traces == 1


def _collectives(jaxpr, counts=None) -> collections.Counter:
    """Collective primitives in a jaxpr, sub-jaxprs (cond, switch, pjit) included."""
    counts = collections.Counter() if counts is None else counts
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name.startswith(("psum", "all_gather", "all_to_all", "ppermute", "reduce_scatter")):
            counts[name.split("_invariant")[0]] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jex_core.ClosedJaxpr):
                    _collectives(sub.jaxpr, counts)
                elif isinstance(sub, jex_core.Jaxpr):
                    _collectives(sub, counts)
    return counts


N_DEV = 8
SHARD_SPEC = {
    "conv": {"kernel": ((30, 10), jnp.float32), "bias": ((10,), jnp.float32)},
    "dense": {"kernel": ((200,), jnp.float32), "bias": ((5,), jnp.float32)},
    "emb": ((64,), jnp.float32),
}


def _sharded_step(tx, mesh):
    def step(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], (u, s))

    return jax.shard_map(
        step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))
    )


def _stack(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tree)


@pytest.mark.parametrize(
    "exchange,per_group", [("dense", {"psum": 1}), ("sparse", {"all_gather": 2})]
)
def test_one_exchange_per_step(exchange, per_group):
    """All-reduces (dense) or index + value all-gathers (sparse): one per step, not per
    leaf or group (a packed step sends every group's message in one collective)."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    g = make_tree(np.random.default_rng(4), SHARD_SPEC)
    n_leaves = len(jax.tree.leaves(g))
    n_groups = len(ref_groups(g, GROUPS))
    assert (n_leaves, n_groups) == (5, 3)
    for groups, expected in ((None, 1), (GROUPS, 1)):
        tx = jaxcomp.ldte_bs(
            RATIO, axis_name="data", exchange=exchange, groups=groups, reuse_period=3
        )
        f = _sharded_step(tx, mesh)
        args = jax.device_put((_stack(g), _stack(tx.init(g))), sharding)
        counts = _collectives(jax.make_jaxpr(f)(*args).jaxpr)
        assert counts == collections.Counter({k: v * expected for k, v in per_group.items()})


def test_shard_map_matches_mean_of_single_device_group_updates():
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    kw = dict(groups=GROUPS, reuse_period=2)
    tx = jaxcomp.ldte_bs(RATIO, axis_name="data", exchange="sparse", **kw)
    ref = Counted(jaxcomp.ldte_bs(RATIO, **kw))
    f = jax.jit(_sharded_step(tx, mesh))
    rng = np.random.default_rng(5)
    g0 = make_tree(rng, SHARD_SPEC)
    state = jax.device_put(_stack(tx.init(g0)), sharding)
    refs = [ref.tx.init(g0) for _ in range(N_DEV)]
    for _ in range(3):
        per_dev = [make_tree(rng, SHARD_SPEC) for _ in range(N_DEV)]
        g = jax.tree.map(lambda *xs: jnp.stack(xs), *per_dev)
        upd, new = f(jax.device_put(g, sharding), state)
        jax.block_until_ready((upd, new))
        sends = []
        for d in range(N_DEV):
            u_d, refs[d] = ref(per_dev[d], refs[d])
            sends.append(by_path(u_d))
            mine = jax.tree.map(lambda x, d=d: np.asarray(x)[d], new)
            _check_one_selection_per_group(mine)
            for field in ("residual", "sent_count", "threshold", "message_bytes"):
                ref_leaves = jax.tree.leaves(getattr(refs[d], field))
                for x, y in zip(ref_leaves, jax.tree.leaves(getattr(mine, field)), strict=True):
                    assert bits(x) == bits(y), (d, field)
        for p, u in by_path(upd).items():
            expected = np.mean([f32(s[p]) for s in sends], axis=0)
            got = np.asarray(u)
            assert all(bits(got[d]) == bits(got[0]) for d in range(N_DEV))
            np.testing.assert_allclose(got[0], expected, rtol=1e-6, atol=1e-7)
        state = new
    assert ref.traces == 1


BAD_CONSTRUCTION = [
    (dict(groups=[["['a']", "['b']"], ["['a']"]]), r"\['a'\].*groups\[0\] and groups\[1\]"),
    (dict(groups=[["['a']", "['a']"]]), r"\['a'\].*groups\[0\] and groups\[0\]"),
    (dict(groups=[["['a']"], []]), r"groups\[1\] is empty"),
    (dict(groups=[["['a']"]], granularity="global"), "groups must be None with granularity"),
    (dict(groups=jnp.zeros(3)), "groups must be None, a sequence"),
]


@pytest.mark.parametrize("kwargs,match", BAD_CONSTRUCTION)
def test_bad_groups_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        jaxcomp.top_k(RATIO, **kwargs)


BAD_AT_INIT = [
    ([["['a']", "['nope']"]], r"groups\[0\]: unknown leaf path \"\['nope'\]\".*\['a'\]"),
    ({"a": "x", "zzz": "y"}, "labels pytree must have the structure"),
    ({"a": np.zeros(2), "b": None}, "labels must be hashable"),
]


@pytest.mark.parametrize("groups,match", BAD_AT_INIT)
def test_bad_groups_at_init(groups, match):
    params = {"a": jnp.zeros(4), "b": jnp.zeros(3)}
    tx = jaxcomp.top_k(RATIO, groups=groups)
    with pytest.raises(ValueError, match=match):
        tx.init(params)


def test_resolve_groups_unlisted_leaves_alone():
    from jaxcomp.transforms.sparsify import resolve_groups

    params = {"a": 0.0, "b": {"c": 0.0, "d": 0.0}, "e": 0.0}
    assert resolve_groups([["['e']", "['a']"]], params) == ((0, 3), (1,), (2,))
    assert resolve_groups({"a": None, "b": 1, "e": 1}, params) == ((0,), (1, 2, 3))
    assert resolve_groups([], params) == ((0,), (1,), (2,), (3,))
