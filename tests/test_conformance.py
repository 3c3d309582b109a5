"""One conformance suite that every compressor in jaxcomp must pass.

Sparsifier-only features (ratio, capacity and counts, momentum correction,
warm-up, threshold reuse, global granularity) run on ``SPARSIFIERS``; quantizers branch to
their own message checks where a check is about what a sparsifier sends.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    AT_LEAST_K,
    ESTIMATED_COUNT,
    EXACTLY_K,
    FACTORIES,
    LOW_RANK,
    MAJORITY,
    NO_ERROR_FEEDBACK,
    OPTIMIZERS,
    QUANTIZERS,
    RANDOM_K,
    RANDOMIZED,
    RESIDUAL_SCALING,
    SPARSIFIERS,
    Counted,
    bits,
    cap_of,
    compressor,
    expected_sent,
    f32,
    k_of,
    laplace_tree,
    low_rank_bytes,
    majority_vote,
    mesh_update,
    pair_bytes,
    quantized_bytes,
    value_itemsize,
)
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

NAMES = list(FACTORIES)
RATIO = 0.1
MIN_DENSE = 8

# Deterministic tree: scalar/small leaves sent dense (<= MIN_DENSE), the rest sparse.
TREE = {
    "scalar": ((), jnp.float32),
    "small": ((3,), jnp.float32),
    "small16": ((8,), jnp.bfloat16),
    "empty": ((0,), jnp.float32),
    "w": ((20, 25), jnp.float32),
    "b16": ((300,), jnp.bfloat16),
    "h16": ((17, 9), jnp.float16),
}


def _res(state, like):
    """The residual; zeros for a quantizer without error feedback (it allocates none)."""
    res = optax.tree.get(state, "residual")
    if res is None:
        return jax.tree.map(lambda x: np.zeros(np.shape(x), np.float32), like)
    return res


def _compensated(name, old, inc):
    """The accumulator a step compresses: ``old + inc``, or with GRACE's residual
    scaling (:data:`RESIDUAL_SCALING`) ``beta old + gamma inc``, each product
    rounded (in ``old``'s dtype)."""
    old = np.asarray(old)
    inc = np.asarray(inc).astype(old.dtype)
    if name not in RESIDUAL_SCALING:
        return old + inc
    beta, gamma = (np.asarray(x, old.dtype) for x in RESIDUAL_SCALING[name])
    return beta * old + gamma * inc


def _check_lost_nothing(g, old_res, upd, new_res, rdtype=np.float32, name=None):
    """``sent + new_res == old_res + g`` bit for bit (sparsifiers); with GRACE's
    residual scaling (:data:`RESIDUAL_SCALING`) ``== beta old_res + gamma g``.

    Quantizers (``name`` given): without error feedback the residual stays 0;
    with it, ``new_res`` is the correctly rounded ``acc - sent``, bit for bit,
    so ``sent + new_res`` is ``acc`` up to that one rounding (a quantized
    ``sent`` is far from ``acc``, and an exact float residual need not exist).
    """
    for leaf in g:
        sent = f32(upd[leaf]).astype(rdtype)
        acc = _compensated(name, np.asarray(old_res[leaf]), f32(g[leaf]).astype(rdtype))
        res = np.asarray(new_res[leaf])
        if name in NO_ERROR_FEEDBACK:
            assert not np.any(res) and not np.any(np.asarray(old_res[leaf])), leaf
        elif name in QUANTIZERS or name in LOW_RANK:
            assert np.array_equal(res, acc - sent), leaf
            gap = np.abs((sent + res).astype(np.float64) - acc.astype(np.float64))
            ulp = np.spacing(np.abs(acc - sent)).astype(np.float64)
            assert np.all(gap <= ulp), (leaf, np.max(gap - ulp))
        else:
            lhs = sent + res
            assert np.array_equal(lhs, acc), (leaf, np.max(np.abs(lhs - acc)))


def _check_quantized_message(name, g, upd, state, min_dense):
    """Message bytes per leaf: the dense tensor, or packed codes + float32 scales."""
    for leaf, gl in g.items():
        n = gl.size
        item = np.dtype(gl.dtype).itemsize
        expected = n * item if n <= min_dense else quantized_bytes(name, n)
        assert int(state.message_bytes[leaf]) == expected, (leaf, n)
        assert np.all(np.isfinite(f32(upd[leaf]))), leaf


def _check_message(name, g, upd, state, min_dense):
    """Capacity, sent_count == nnz, message_bytes and the selector's window, per leaf."""
    if name in QUANTIZERS:
        _check_quantized_message(name, g, upd, state, min_dense)
        return
    if name in LOW_RANK:
        expected = low_rank_bytes(name, g, min_dense)
        for leaf, gl in g.items():
            assert int(state.message_bytes[leaf]) == expected[leaf], (leaf, gl.shape)
            assert np.all(np.isfinite(f32(upd[leaf]))), leaf
        return
    stats = jaxcomp.statistics(state)  # the sparsifier's per-leaf arrays, leaf by leaf
    for leaf, gl in g.items():
        n = gl.size
        u = np.asarray(upd[leaf])
        nnz = int(np.count_nonzero(u))
        sent = int(stats["sent_count"][leaf])
        if name in RANDOM_K:
            # Index-based: a drawn index whose accumulator is exactly 0 (a
            # residual cancelled by the next gradient) is sent as a 0.
            assert nnz <= sent, (leaf, sent, nnz)
        else:
            assert sent == nnz, (leaf, sent, nnz)
        if n <= min_dense:
            assert nnz == n, leaf  # Laplacian data: every element nonzero
            assert int(stats["message_bytes"][leaf]) == n * value_itemsize(name, gl.dtype)
            continue
        k = k_of(RATIO, n)
        cap = cap_of(k, n)
        assert nnz <= cap, (leaf, nnz, cap)
        assert int(stats["message_bytes"][leaf]) == sent * pair_bytes(name, n, gl.dtype), leaf
        picked = sent if name in RANDOM_K else nnz  # random_k: its draws, zeros too
        if name in AT_LEAST_K:
            assert picked >= k, (leaf, picked, k)
        if name in EXACTLY_K and gl.dtype == jnp.float32:
            assert picked == k, (leaf, picked, k)


# Exactness checked again under XLA's default codegen (make test's last tier) for
# one compressor of each error-feedback family.
BOTH_CODEGENS = (
    "top_k", "ldte_bs", "random_k", "qsgd_ef", "ef_sign_sgd", "natural_dithering_ef",
    "cast_bf16_ef", "powersgd",
)  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.both_codegens) if n in BOTH_CODEGENS else n for n in NAMES],
)
def test_lost_nothing_capacity_and_counts(name):
    cx = compressor(name, RATIO, min_dense_size=MIN_DENSE)
    rng = np.random.default_rng(0)
    g0 = laplace_tree(TREE, rng)
    state = cx.tx.init(g0)
    for _ in range(6):
        g = laplace_tree(TREE, rng)
        upd, new = cx(g, state)
        _check_lost_nothing(g, _res(state, g), upd, _res(new, g), name=name)
        _check_message(name, g, upd, new, MIN_DENSE)
        for leaf in ("scalar", "small", "empty"):  # f32 dense leaves: residual stays 0
            if value_itemsize(name, np.float32) == 4:  # (16-bit values: their rounding)
                assert not np.any(np.asarray(_res(new, g)[leaf])), leaf
        for leaf, gl in g.items():
            assert upd[leaf].dtype == gl.dtype and upd[leaf].shape == gl.shape
            assert _res(new, g)[leaf].dtype == jnp.float32
        if name in SPARSIFIERS:
            # One array per statistic, an entry per leaf in jax.tree.leaves order;
            # jaxcomp.statistics reads them leaf by leaf, shaped like the gradients.
            stats = jaxcomp.statistics(new)
            for field in ("sent_count", "threshold", "search_iterations", "message_bytes"):
                array = np.asarray(getattr(new, field))
                assert array.shape == (len(jax.tree.leaves(g)),), field
                tree = stats[field]
                assert jax.tree.structure(tree) == jax.tree.structure(g), field
                assert all(np.shape(v) == () for v in jax.tree.leaves(tree)), field
                np.testing.assert_array_equal(
                    [np.asarray(v) for v in jax.tree.leaves(tree)], array, err_msg=field
                )
        else:  # quantizers and low-rank: a pytree of message_bytes, a scalar per leaf
            tree = new.message_bytes
            assert jax.tree.structure(tree) == jax.tree.structure(g), "message_bytes"
            assert all(np.shape(v) == () for v in jax.tree.leaves(tree)), "message_bytes"
        assert float(new.wire_bytes) == 0.0
        state = new
    assert int(state.step) == 6
    assert cx.traces == 1


LEAF_SHAPES = [(), (0,), (1,), (5,), (4, 25), (300,)]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@st.composite
def _trees(draw):
    nleaves = draw(st.integers(1, 2))
    spec = {
        f"l{i}": (draw(st.sampled_from(LEAF_SHAPES)), draw(st.sampled_from(DTYPES)))
        for i in range(nleaves)
    }
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.sampled_from([-4, 0, 3]))
    return spec, seed, 10.0**log_scale


@pytest.mark.parametrize("name", NAMES)
@settings(
    max_examples=5,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_trees())
# random_k draws an index whose accumulator is exactly 0 on step 1 (a residual
# cancelled by the gradient): it is sent as a 0.
@example(case=({"l0": ((), jnp.float32), "l1": ((300,), jnp.bfloat16)}, 2252, 1e-4))
def test_lost_nothing_hypothesis(name, case):
    spec, seed, scale = case
    cx = compressor(name, RATIO)
    rng = np.random.default_rng(seed)
    state = cx.tx.init(laplace_tree(spec, rng))
    for _ in range(4):
        g = laplace_tree(spec, rng, scale)
        upd, new = cx(g, state)
        _check_lost_nothing(g, _res(state, g), upd, _res(new, g), name=name)
        _check_message(name, g, upd, new, 0)
        for leaf in g:
            assert np.all(np.isfinite(np.asarray(_res(new, g)[leaf])))
        state = new


MOM_TREE = {"w": ((40, 25), jnp.float32), "h": ((200,), jnp.bfloat16), "d": ((4,), jnp.float32)}


@pytest.mark.parametrize("name", SPARSIFIERS)
# Without masking, the stored velocity and the accumulated one are the same
# rounding only if XLA rounds m*u + g alike in every kernel that computes it.
@pytest.mark.parametrize("masking", [True, pytest.param(False, marks=pytest.mark.default_codegen)])
def test_momentum_correction_lost_nothing(name, masking):
    m = 0.9
    cx = compressor(name, RATIO, momentum=m, momentum_masking=masking, min_dense_size=4)
    rng = np.random.default_rng(1)
    state = cx.tx.init(laplace_tree(MOM_TREE, rng))
    for _ in range(5):
        g = laplace_tree(MOM_TREE, rng)
        upd, new = cx(g, state)
        for leaf in g:
            u_old = np.asarray(state.velocity[leaf])
            # numpy float32 reference m*u + g. XLA may contract it into one
            # fused multiply-add (a single rounding), so either rounding is
            # accepted per element; both are computed independently here.
            u_two = np.float32(m) * u_old + f32(g[leaf])
            u_fma = (
                np.float64(np.float32(m)) * u_old.astype(np.float64)
                + f32(g[leaf]).astype(np.float64)
            ).astype(np.float32)
            sent = f32(upd[leaf])
            lhs = sent + np.asarray(new.residual[leaf])
            v = np.asarray(new.velocity[leaf])
            res_old = np.asarray(state.residual[leaf])
            if name in NO_ERROR_FEEDBACK:
                # Memory-less: the residual stays zero, the message is u where sent.
                assert not np.any(np.asarray(new.residual[leaf])), leaf
                # (u rounded to the leaf's dtype: the message travels in it.)
                on = sent != 0
                wire_two, wire_fma = (
                    f32(jnp.asarray(u).astype(g[leaf].dtype)) for u in (u_two, u_fma)
                )
                assert np.all((sent[on] == wire_two[on]) | (sent[on] == wire_fma[on])), leaf
                continue
            if not masking:
                # The library's own velocity satisfies the invariant exactly ...
                assert np.array_equal(lhs, _compensated(name, res_old, v)), leaf
            else:
                assert not np.any(v[sent != 0]), leaf  # masked where sent
                kept = v[sent == 0]
                assert np.all((kept == u_two[sent == 0]) | (kept == u_fma[sent == 0])), leaf
            # ... and equals the float32 momentum update m*u + g.
            two, fma = (_compensated(name, res_old, u) for u in (u_two, u_fma))
            ok = (lhs == two) | (lhs == fma)
            assert np.all(ok), (leaf, np.max(np.abs(lhs - two)))
        state = new


@pytest.mark.parametrize("name", ["top_k", "top_k_sort", "ldte_bs", "binary_search", "thr0"])
def test_ratio_one_sends_everything(name):
    if name == "thr0":
        cx = Counted(jaxcomp.threshold(1.0, threshold=0.0))
    else:
        cx = compressor(name, 1.0)
    rng = np.random.default_rng(2)
    spec = {"a": ((50,), jnp.float32), "b": ((7, 3), jnp.float32)}
    state = cx.tx.init(laplace_tree(spec, rng))
    for _ in range(3):
        g = laplace_tree(spec, rng)
        g["a"] = g["a"].at[::5].set(0.0)  # zeros stay zero
        upd, new = cx(g, state)
        sent_count = jaxcomp.statistics(new)["sent_count"]
        for leaf in g:
            acc = np.asarray(state.residual[leaf]) + f32(g[leaf])
            np.testing.assert_array_equal(np.asarray(upd[leaf]), acc)
            assert not np.any(np.asarray(new.residual[leaf]))
            assert int(sent_count[leaf]) == np.count_nonzero(acc)
        state = new


WARM_N = 4096
WARM_RATIO = 1e-3


@pytest.mark.parametrize("name", SPARSIFIERS)
def test_warmup_phases_and_single_compilation(name):
    spe = 2
    cx = Counted(FACTORIES[name](WARM_RATIO, warmup_ratios=jaxcomp.DGC_WARMUP, steps_per_epoch=spe))
    rng = np.random.default_rng(3)
    spec = {"w": ((WARM_N,), jnp.float32)}
    state = cx.tx.init(laplace_tree(spec, rng))
    phases = list(jaxcomp.DGC_WARMUP) + [WARM_RATIO]
    seen = []
    for step in range(12):
        g = laplace_tree(spec, rng)
        upd, new = cx(g, state)
        _check_lost_nothing(g, state.residual, upd, new.residual, name=name)
        p = min(step // spe, len(phases) - 1)
        k = k_of(max(phases[p], WARM_RATIO), WARM_N)
        c = int(jaxcomp.statistics(new)["sent_count"]["w"])
        assert c == int(np.count_nonzero(np.asarray(upd["w"])))
        assert c <= cap_of(k, WARM_N), (step, c, k)
        if name in EXACTLY_K:
            assert c == k, (step, c, k)
        elif name in AT_LEAST_K:
            assert k <= c <= math.floor(1.5 * k), (step, c, k)
        seen.append(c)
        state = new
    assert cx.traces == 1
    if name in AT_LEAST_K:
        assert seen[0] > seen[2] > seen[4] > seen[6] > seen[8]


@pytest.mark.parametrize("name", NAMES)
def test_state_readable_inside_chain(name):
    tx = optax.chain(FACTORIES[name](RATIO, min_dense_size=2), optax.sgd(0.1))
    # Explicit float32: the suite also runs with JAX_ENABLE_X64=1 (float64 default).
    params = {"a": jnp.zeros((30, 4), jnp.float32), "b": {"c": jnp.zeros((2,), jnp.float32)}}
    state = tx.init(params)
    res = optax.tree.get(state, "residual")
    if name in NO_ERROR_FEEDBACK and name in QUANTIZERS:  # no residual: tree.get finds None
        assert res is None
        res = _res(state, params)
    assert jax.tree.structure(res) == jax.tree.structure(params)
    g = laplace_tree({"a": ((30, 4), jnp.float32)}, np.random.default_rng(4))
    g["b"] = {"c": jnp.array([1.0, -2.0], jnp.float32)}
    upd, state = jax.jit(tx.update)(g, state)
    res = _res(state, params)
    assert jax.tree.structure(res) == jax.tree.structure(params)
    for r, p in zip(jax.tree.leaves(res), jax.tree.leaves(params), strict=True):
        assert r.shape == p.shape
    mb = optax.tree.get(state, "message_bytes")
    if name in SPARSIFIERS:
        # One array per statistic, an entry per leaf in jax.tree.leaves order
        # (a, b.c); jaxcomp.statistics reads them leaf by leaf through the chain.
        fields = ("sent_count", "threshold", "search_iterations", "message_bytes")
        arrays = {field: np.asarray(optax.tree.get(state, field)) for field in fields}
        stats = jaxcomp.statistics(state)
        for field in fields:
            assert arrays[field].shape == (2,), field
            assert jax.tree.structure(stats[field]) == jax.tree.structure(params), field
            np.testing.assert_array_equal(
                [np.asarray(v) for v in jax.tree.leaves(stats[field])], arrays[field], field
            )
        mb = stats["message_bytes"]
    assert jax.tree.structure(mb) == jax.tree.structure(params)
    if name in QUANTIZERS:
        assert int(mb["b"]["c"]) == 8  # dense leaf
        assert int(mb["a"]) == quantized_bytes(name, 120)
        return
    if name in LOW_RANK:
        expected = low_rank_bytes(name, params, min_dense=2)
        assert int(mb["b"]["c"]) == expected["b"]["c"]  # dense (or in the bucket: 0)
        assert int(mb["a"]) == expected["a"]
        return
    sent = stats["sent_count"]
    value = value_itemsize(name, np.float32)
    assert int(sent["b"]["c"]) == 2 and int(mb["b"]["c"]) == 2 * value
    assert int(mb["a"]) == int(sent["a"]) * pair_bytes(name, 120, np.float32)
    if name in NO_ERROR_FEEDBACK:  # memory-less: the residual stays zero
        assert not any(np.any(np.asarray(r)) for r in jax.tree.leaves(res))
        return
    if value < 4:  # 16-bit values: the residual keeps their rounding where sent
        return
    # Sent where the residual was cleared (f32 leaf), sgd scales by -0.1.
    np.testing.assert_array_equal(np.asarray(upd["a"]) != 0, np.asarray(res["a"]) == 0)


# ---------------------------------------------------------------------------
# Non-finite gradients.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_skip_keeps_state(name, bad):
    momentum = {} if name not in SPARSIFIERS else dict(momentum=0.9, momentum_masking=True)
    cx = compressor(name, RATIO, min_dense_size=4, **momentum)
    rng = np.random.default_rng(5)
    state = cx.tx.init(laplace_tree(MOM_TREE, rng))
    for _ in range(2):
        _, state = cx(laplace_tree(MOM_TREE, rng), state)
    g = laplace_tree(MOM_TREE, rng)
    g["h"] = g["h"].at[7].set(bad)
    upd, new = cx(g, state)
    for leaf in g:
        assert not np.any(f32(upd[leaf])), leaf
        assert bits(_res(new, g)[leaf]) == bits(_res(state, g)[leaf]), leaf
        assert np.all(np.isfinite(np.asarray(_res(new, g)[leaf])))
        if getattr(state, "velocity", None) is not None:  # DGC's, and Signum's momentum
            assert bits(new.velocity[leaf]) == bits(state.velocity[leaf]), leaf
            assert np.all(np.isfinite(np.asarray(new.velocity[leaf])))
    assert int(new.nonfinite_steps) == int(state.nonfinite_steps) + 1
    # The next finite step proceeds normally.
    g2 = laplace_tree(MOM_TREE, rng)
    upd2, new2 = cx(g2, new)
    assert any(np.any(f32(u)) for u in upd2.values())
    assert int(new2.nonfinite_steps) == int(new.nonfinite_steps)


@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_zero_uses_finite_part(name):
    cx = compressor(name, RATIO, nonfinite="zero")
    rng = np.random.default_rng(6)
    spec = {"w": ((500,), jnp.float32), "h": ((64,), jnp.bfloat16)}
    state = cx.tx.init(laplace_tree(spec, rng))
    for step in range(3):
        g = laplace_tree(spec, rng)
        g["w"] = g["w"].at[jnp.array([3, 90, 91])].set(jnp.array([np.nan, np.inf, -np.inf]))
        g["h"] = g["h"].at[5].set(np.nan)
        upd, new = cx(g, state)
        clean = {k: jnp.where(jnp.isfinite(v), v, 0).astype(v.dtype) for k, v in g.items()}
        _check_lost_nothing(clean, _res(state, g), upd, _res(new, g), name=name)
        for leaf in g:
            assert np.all(np.isfinite(np.asarray(_res(new, g)[leaf])))
            assert np.all(np.isfinite(f32(upd[leaf])))
        assert int(new.nonfinite_steps) == step + 1
        state = new


@pytest.mark.parametrize("name", SPARSIFIERS)
def test_overflowing_accumulator_sends_inf_and_keeps_the_rest(name):
    # Finite gradients whose accumulation overflows float32: 40 elements of
    # |r + g| = inf, more than the capacity (15 at k = 10), so every selector
    # ties there and sends at most the capacity. What it keeps stays inf in the
    # residual and is 0 in the update (the update read off the residual as
    # acc - residual would give inf - inf = NaN there).
    cx = compressor(name, 0.01, min_dense_size=0)
    rng = np.random.default_rng(7)
    g = {"w": jnp.asarray(rng.laplace(size=1000).astype(np.float32))}
    big = rng.choice(1000, size=40, replace=False)
    g["w"] = g["w"].at[big].set(np.float32(3e38) * np.sign(g["w"][big]))
    state = cx.tx.init(g)
    state = state._replace(residual={"w": jnp.zeros(1000).at[big].set(g["w"][big])})
    with np.errstate(over="ignore"):
        acc = _compensated(name, state.residual["w"], g["w"])
    assert np.sum(np.isinf(acc)) == 40
    upd, new = cx(g, state)
    u, r = np.asarray(upd["w"]), np.asarray(new.residual["w"])
    assert not np.any(np.isnan(u)) and not np.any(np.isnan(r))
    sent = u != 0
    if name in NO_ERROR_FEEDBACK:  # memory-less: sends acc where sent, keeps nothing
        assert not np.any(r)
        r = np.where(sent, 0, acc)
    if value_itemsize(name, np.float32) < 4:
        # float16 values: an inf is sent saturated (65504), the residual keeps inf.
        assert np.all(np.isfinite(u)) and np.all(np.abs(u) <= 65504)
        np.testing.assert_array_equal(u + r, acc)
    else:
        np.testing.assert_array_equal(np.where(sent, u, r), acc)  # nothing lost, nothing made up
        assert not np.any(r[sent])
    count = int(jaxcomp.statistics(new)["sent_count"]["w"])
    assert 0 < np.sum(sent) <= 15 and count == np.sum(sent)


@pytest.mark.parametrize("name", NAMES)
def test_apply_if_finite_protects_residual(name):
    # optax skips the inner update on a non-finite gradient, so the compressor's
    # own `nonfinite` policy never runs here (test_nonfinite_* cover it): what this
    # checks is that the compressor's state survives the wrapper's select of
    # old and new state (its dtypes, counters and keys) and is kept bit for bit.
    tx = optax.apply_if_finite(FACTORIES[name](RATIO), 3)
    f = jax.jit(tx.update)
    rng = np.random.default_rng(7)
    spec = {"w": ((200,), jnp.float32)}
    state = tx.init(laplace_tree(spec, rng))
    _, state = f(laplace_tree(spec, rng), state)
    g = laplace_tree(spec, rng)
    before = _res(state, g)
    g["w"] = g["w"].at[11].set(np.nan)
    upd, state2 = f(g, state)
    after = _res(state2, g)
    assert bits(after["w"]) == bits(before["w"])
    assert np.all(np.isfinite(np.asarray(after["w"])))
    assert int(state2.notfinite_count) == 1


# ---------------------------------------------------------------------------
# Bad arguments.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", SPARSIFIERS)
@pytest.mark.parametrize("ratio", [0, 0.0, -0.1, 1.5, "a", float("nan"), None])
def test_bad_ratio(name, ratio):
    with pytest.raises(ValueError, match="ratio"):
        FACTORIES[name](ratio)


BAD_COMMON = [
    (dict(momentum=-0.1), "momentum"),
    (dict(momentum=1.0), "momentum"),
    (dict(min_dense_size=-1), "min_dense_size"),
    (dict(warmup_ratios=(0.25, 0.0625)), "steps_per_epoch"),
    (dict(warmup_ratios=(0.25,), steps_per_epoch=0), "steps_per_epoch"),
    (dict(warmup_ratios=(0.25,), steps_per_epoch=2**31), "steps_per_epoch"),  # int32 step
    (dict(reuse_period=2**31), "reuse_period"),
    (dict(warmup_ratios=(0.25, 0.0), steps_per_epoch=2), "warmup_ratios"),
    (dict(granularity="nope"), "granularity"),
    (dict(nonfinite="nope"), "nonfinite"),
    (dict(capacity_factor=0.5), "capacity_factor"),
    (dict(residual_dtype=jnp.int32), "residual_dtype"),
]
# The arguments quantizers share with sparsifiers.
QUANTIZER_COMMON = ("min_dense_size", "nonfinite", "residual_dtype")


@pytest.mark.parametrize(
    "name,kwargs,arg",
    [
        (name, kwargs, arg)
        for name in NAMES
        for kwargs, arg in BAD_COMMON
        if name in SPARSIFIERS or arg in QUANTIZER_COMMON
    ],
)
def test_bad_common_arguments(name, kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        FACTORIES[name](RATIO, **kwargs)


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: jaxcomp.sparsify("nope", 0.1), "selector"),
        (lambda: jaxcomp.ldte_bs(0.1, search="nope"), "search"),
        (lambda: jaxcomp.ldte_bs(0.1, estimator="nope"), "estimator"),
        (lambda: jaxcomp.threshold(0.1, threshold=-1), "threshold"),
        (lambda: jaxcomp.sparsify("top_k", 0.1, selector_options={"bogus": 1}), "bogus"),
        (lambda: jaxcomp.sparsify("ldte_bs", 0.1, selector_options={"bogus": 1}), "bogus"),
        (lambda: jaxcomp.top_k(0.1, method="nope"), "method"),
        (lambda: jaxcomp.gaussian_k(0.1, corrections=-1), "corrections"),
        (lambda: jaxcomp.dgc(0.1, sample_ratio=0.0), "sample_ratio"),
        (lambda: jaxcomp.binary_search(0.1, start="nope"), "start"),
    ],
)
def test_bad_selector_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


# ---------------------------------------------------------------------------
# Global granularity.
# ---------------------------------------------------------------------------

GLOBAL_TREE = {"a": ((300,), jnp.float32), "b": ((20, 10), jnp.float32), "c": ((50,), jnp.float32)}


@pytest.mark.parametrize("name", SPARSIFIERS)
@pytest.mark.parametrize("mixed", [False, True], ids=["f32", "mixed_dtypes"])
def test_global_granularity(name, mixed):
    spec = dict(GLOBAL_TREE)
    if mixed:
        spec["c"] = ((50,), jnp.bfloat16)
    # Not memoized: the mixed and plain trees are different pytrees, and the
    # trace count below is per tree.
    cx = Counted(FACTORIES[name](RATIO, granularity="global"))
    rng = np.random.default_rng(8)
    state = cx.tx.init(laplace_tree(spec, rng))
    total = sum(math.prod(s) for s, _ in spec.values())
    k = k_of(RATIO, total)
    for _ in range(5):
        g = laplace_tree(spec, rng)
        upd, new = cx(g, state)
        _check_lost_nothing(g, state.residual, upd, new.residual, name=name)
        nnz = sum(int(np.count_nonzero(f32(u))) for u in upd.values())
        assert int(new.sent_count) == nnz
        assert nnz <= cap_of(k, total)
        if name in AT_LEAST_K:
            assert nnz >= k
        if name in EXACTLY_K and not mixed:
            assert nnz == k
        if not mixed and name in ("top_k", "top_k_sort"):
            acc = np.concatenate(
                [(np.asarray(state.residual[n]) + f32(g[n])).reshape(-1) for n in spec]
            )
            sent = np.concatenate([f32(upd[n]).reshape(-1) for n in spec]) != 0
            kth = np.sort(np.abs(acc))[::-1][k - 1]
            np.testing.assert_array_equal(sent, np.abs(acc) >= kth)
        state = new
    assert cx.traces == 1


# ---------------------------------------------------------------------------
# Threshold reuse (DLGS's s; tests/test_reuse.py counts the selector's runs).
# ---------------------------------------------------------------------------

REUSE = [name for name in SPARSIFIERS if name not in RANDOM_K]  # random_k has no threshold


@pytest.mark.parametrize("name", REUSE)
def test_reuse_period_lost_nothing_and_single_compilation(name):
    s = 3
    cx = compressor(name, RATIO, min_dense_size=MIN_DENSE, reuse_period=s)
    rng = np.random.default_rng(11)
    state = cx.tx.init(laplace_tree(TREE, rng))
    for step in range(7):
        g = laplace_tree(TREE, rng)
        upd, new = cx(g, state)
        _check_lost_nothing(g, state.residual, upd, new.residual, name=name)
        before, stats = jaxcomp.statistics(state), jaxcomp.statistics(new)
        for leaf, gl in g.items():
            nnz = int(np.count_nonzero(f32(upd[leaf])))
            assert int(stats["sent_count"][leaf]) == nnz, leaf
            if gl.size <= MIN_DENSE:
                continue
            # dgc sends at most k, as DGC's reference code.
            cap = cap_of(k_of(RATIO, gl.size), gl.size, 1.0 if name == "dgc" else 1.5)
            assert nnz <= cap, (leaf, nnz, cap)
            if step % s:  # reuse: the stored threshold, first `cap` in index order
                t = np.float32(before["threshold"][leaf])
                assert np.float32(stats["threshold"][leaf]) == t, (step, leaf)
                assert int(stats["search_iterations"][leaf]) == 0
                acc = _compensated(name, state.residual[leaf], f32(gl))
                np.testing.assert_array_equal(
                    np.flatnonzero(f32(upd[leaf])), expected_sent(acc, t, cap), err_msg=leaf
                )
        state = new
    assert cx.traces == 1


# ---------------------------------------------------------------------------
# Groups of leaves compressed as one buffer (DLGS layer merging; more in
# tests/test_groups.py): a mixed-dtype sparse group, a dense group, a group
# with an empty leaf.
# ---------------------------------------------------------------------------

GROUPS = [["['w']", "['b16']"], ["['scalar']", "['small']"], ["['empty']", "['h16']"]]


@pytest.mark.parametrize("name", SPARSIFIERS)
def test_groups_lost_nothing_per_leaf_and_single_compilation(name):
    cx = compressor(name, RATIO, min_dense_size=MIN_DENSE, groups=GROUPS)
    rng = np.random.default_rng(12)
    state = cx.tx.init(laplace_tree(TREE, rng))
    for _ in range(4):
        g = laplace_tree(TREE, rng)
        upd, new = cx(g, state)
        _check_lost_nothing(g, state.residual, upd, new.residual, name=name)
        stats = jaxcomp.statistics(new)
        counts = stats["sent_count"]
        for leaf in g:
            nnz = int(np.count_nonzero(f32(upd[leaf])))
            assert int(counts[leaf]) == nnz, leaf  # each leaf's share
        for group in (("w", "b16"), ("empty", "h16")):
            size = sum(g[leaf].size for leaf in group)
            sent = sum(int(counts[leaf]) for leaf in group)
            assert sent <= cap_of(k_of(RATIO, size), size), (group, sent)
            thresholds = {float(stats["threshold"][leaf]) for leaf in group}
            assert len(thresholds) == 1, (group, thresholds)  # one selection per group
        # The dense group (4 elements <= MIN_DENSE) sends everything.
        assert int(counts["small"]) == 3 and int(counts["scalar"]) == 1
        state = new
    assert cx.traces == 1


# ---------------------------------------------------------------------------
# Under shard_map over 8 simulated devices.
# ---------------------------------------------------------------------------

N_DEV = 8
SHARD_TREE = {"w": ((40, 30), jnp.float32), "v": ((333,), jnp.float32), "d": ((6,), jnp.float32)}
SHARD_MIN_DENSE = 6


def _stack(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tree)


def _device(tree, d):
    return jax.tree.map(lambda x: x[d], tree)


# Low-rank: not a mean of per-device compressions (P and Q are summed); tests/test_powersgd.py.
@pytest.mark.parametrize("name", [name for name in NAMES if name not in LOW_RANK])
def test_shard_map_matches_mean_of_single_device_updates(name):
    assert len(jax.devices()) >= N_DEV
    mesh = jax.make_mesh((N_DEV,), ("data",))
    # exchange="sparse": all-gather the (index, value) messages ("auto" may pick dense).
    exchange = {} if name in QUANTIZERS else dict(exchange="sparse")
    tx = FACTORIES[name](RATIO, axis_name="data", min_dense_size=SHARD_MIN_DENSE, **exchange)
    ref = compressor(name, RATIO, min_dense_size=SHARD_MIN_DENSE)

    def step(g, s):
        g = jax.tree.map(lambda x: x[0], g)
        s = jax.tree.map(lambda x: x[0], s)
        u, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], u), jax.tree.map(lambda x: x[None], s)

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))
        )
    )
    sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(9)
    state = jax.device_put(_stack(tx.init(laplace_tree(SHARD_TREE, rng))), sharding)
    for _ in range(3):
        g = {
            leaf: jnp.asarray(rng.laplace(size=(N_DEV, *shape))).astype(dt)
            for leaf, (shape, dt) in SHARD_TREE.items()
        }
        upd, new = f(jax.device_put(g, sharding), state)
        jax.block_until_ready((upd, new))
        upd, new, old = jax.device_get((upd, new, state))
        per_dev = []
        for d in range(N_DEV):
            gd = _device(g, d)
            if name in RANDOMIZED and name in NO_ERROR_FEEDBACK:
                # The key depends on the device and the step only, and zeros quantize to
                # zeros: with every other device's gradient zeroed, the mean is device
                # d's own message / N.
                only_d = {leaf: jnp.zeros_like(v).at[d].set(v[d]) for leaf, v in g.items()}
                u_only, _ = f(jax.device_put(only_d, sharding), jax.device_put(old, sharding))
                u_only = jax.device_get(u_only)
                per_dev.append({leaf: f32(v[0]) * N_DEV for leaf, v in u_only.items()})
            elif name in RANDOM_K or name in RANDOMIZED:
                # The device index is folded into the key: compare with what the device
                # itself sent (acc - new residual), and with its own residual invariant.
                sent = {
                    leaf: (np.asarray(old.residual[leaf][d]) + f32(gd[leaf]))
                    - np.asarray(new.residual[leaf][d])
                    for leaf in gd
                }
                per_dev.append(sent)
                if name in RANDOM_K:
                    count = jaxcomp.statistics(new)["sent_count"]["w"][d]  # stacked: (N_DEV,)
                    assert int(count) == k_of(RATIO, 1200)
            else:
                u_d, s_d = ref(gd, _device(old, d))
                per_dev.append({leaf: f32(v) for leaf, v in u_d.items()})
                for leaf in gd:
                    if name in NO_ERROR_FEEDBACK and name in QUANTIZERS:  # no residual
                        assert s_d.residual is None and new.residual is None
                    else:
                        assert bits(s_d.residual[leaf]) == bits(new.residual[leaf][d]), (d, leaf)
                    if name in QUANTIZERS:  # a pytree of message_bytes
                        want_count, got_count = s_d.message_bytes[leaf], new.message_bytes[leaf][d]
                    else:  # the sparsifier's per-leaf sent_count, leaf by leaf
                        want_count = jaxcomp.statistics(s_d)["sent_count"][leaf]
                        got_count = jaxcomp.statistics(new)["sent_count"][leaf][d]
                    assert int(want_count) == int(got_count)
        for leaf in SHARD_TREE:
            stacked = np.stack([p[leaf] for p in per_dev])
            # A majority-vote exchange aggregates by vote: its premise is not a mean.
            expected = majority_vote(stacked) if name in MAJORITY else np.mean(stacked, axis=0)
            got = np.asarray(upd[leaf])
            for d in range(N_DEV):  # every device gets the same update
                assert bits(got[d]) == bits(got[0]), (leaf, d)
            scale = float(np.max(np.abs(expected)))
            # 16-bit values sent dense are added in 16 bits by the all-reduce.
            dense16 = value_itemsize(name, np.float32) < 4 and got[0].size <= SHARD_MIN_DENSE
            rtol = 2e-3 if dense16 else 1e-6
            np.testing.assert_allclose(got[0], expected, rtol=rtol, atol=1e-7 * scale)
        if name in RANDOM_K:
            idx = [np.flatnonzero(p["w"]) for p in per_dev]
            # Each device its own draws; shared indices: the same on every device.
            same = [np.array_equal(idx[0], i) for i in idx[1:]]
            assert all(same) if name == "random_k_shared" else not all(same)
        wire = 0.0
        for shape, _ in SHARD_TREE.values():
            n = math.prod(shape)
            if n <= SHARD_MIN_DENSE and name in MAJORITY:  # the values all-gathered for the vote
                wire += (N_DEV - 1) * n * 4
            elif n <= SHARD_MIN_DENSE:
                wire += 2.0 * (N_DEV - 1) / N_DEV * n * value_itemsize(name, np.float32)
            elif name in QUANTIZERS:  # all-gather of the packed message
                wire += (N_DEV - 1) * quantized_bytes(name, n)
            else:
                k = k_of(RATIO, n)
                # random_k sends exactly k, dgc at most k (capacity k).
                cap = k if name in (*RANDOM_K, "dgc") else cap_of(k, n)
                if name == "random_k_shared":  # the k values all-reduced, no indices
                    wire += 2.0 * (N_DEV - 1) / N_DEV * k * 4
                else:
                    wire += (N_DEV - 1) * cap * pair_bytes(name, n, np.float32)
        np.testing.assert_allclose(np.asarray(new.wire_bytes), wire, rtol=1e-6)
        state = jax.device_put(new, sharding)


# ---------------------------------------------------------------------------
# Liveness: every step sends at least k (issue 8, item 3).
# ---------------------------------------------------------------------------

LIVE_N = 200
LIVE_RATIO = 0.1  # k = 20, capacity 30
LIVE_STEPS = 16  # > 2 n / capacity: every element must have been sent by then
LIVE_KINDS = ["ones", "signs", "small_ints", "constant", "ties_few_larger", "laplace", "k_sparse"]
# Threshold sparsifiers under the liveness property; "threshold" (a user's
# fixed threshold may exceed everything) is exempt, DGC has its own guarantee.
LIVE = [name for name in SPARSIFIERS if name != "threshold"]


def _live_grad(kind: str, step: int, n: int = LIVE_N, device: int = 0) -> np.ndarray:
    """Tie-heavy (and continuous) gradients; each step and device draws anew."""
    rng = np.random.default_rng([step, device, LIVE_KINDS.index(kind)])
    if kind == "ones":
        return np.ones(n, np.float32)
    if kind == "signs":
        return np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    if kind == "small_ints":  # ~1/7 zeros, magnitudes 1..3
        return rng.integers(-3, 4, n).astype(np.float32)
    if kind == "constant":
        return np.full(n, -0.375, np.float32)
    if kind == "ties_few_larger":  # 3 larger values, at the end of index order
        g = np.ones(n, np.float32)
        g[-3:] = 5.0
        return g
    if kind == "laplace":
        return rng.laplace(size=n).astype(np.float32)
    g = np.zeros(n, np.float32)  # k_sparse: exactly k nonzeros, fixed positions
    g[np.arange(0, n, n // k_of(LIVE_RATIO, n))] = 1.0 + rng.random(k_of(LIVE_RATIO, n))
    return g.astype(np.float32)


def _check_live_step(name, acc, sent, count, k, cap):
    """The liveness property for one step of one device (numpy reference ``acc``)."""
    nnz_acc = int(np.count_nonzero(acc))
    nnz = int(np.count_nonzero(sent))
    assert nnz <= cap, (nnz, cap)
    if name in RANDOM_K:  # index-based: exactly k coordinates, zeros included
        assert count == k
        return
    assert count == nnz
    if name == "dgc":  # documented guarantee (jaxcomp.selection.dgc_sample, rule="reference")
        a = np.abs(acc)
        m = math.ceil(0.8 * k)
        if nnz_acc:
            assert nnz >= 1
        if np.sum(a >= a.max() / 9) >= m:
            assert nnz >= m, (nnz, k)
        return
    if name in ESTIMATED_COUNT:
        # An estimated threshold (jaxcomp.selection.multistage): fewer than k may pass,
        # but never nothing while something is nonzero (capped at the float below max|x|).
        if nnz_acc:
            assert nnz >= 1, (nnz, nnz_acc)
        return
    assert nnz >= min(k, nnz_acc), (nnz, k, nnz_acc)


@pytest.mark.parametrize("name", LIVE)
def test_liveness_every_step_sends_at_least_k(name):
    cx = compressor(name, LIVE_RATIO)  # shared with other tests: count our traces
    traces = cx.traces
    k = k_of(LIVE_RATIO, LIVE_N)
    # random_k sends k; dgc at most k, as DGC's reference code.
    cap = k if name in (*RANDOM_K, "dgc") else cap_of(k, LIVE_N)
    for kind in LIVE_KINDS:
        state = cx.tx.init({"w": jnp.zeros((LIVE_N,), jnp.float32)})
        gmax = 0.0
        for step in range(LIVE_STEPS):
            g = _live_grad(kind, step)
            gmax = max(gmax, float(np.abs(g).max()))
            old = np.asarray(state.residual["w"])
            upd, state = cx({"w": jnp.asarray(g)}, state)
            sent, res = np.asarray(upd["w"]), np.asarray(state.residual["w"])
            acc = _compensated(name, old, g)
            if name in NO_ERROR_FEEDBACK:  # memory-less: what is not sent is dropped
                assert not np.any(res) and not np.any(old), (kind, step)
                res = np.where(sent != 0, 0, acc)
            assert np.array_equal(sent + res, acc), (kind, step)  # nothing lost
            count = int(jaxcomp.statistics(state)["sent_count"]["w"])
            _check_live_step(name, acc, sent, count, k, cap)
            if step == 0 and kind in ("ones", "constant") and name not in RANDOM_K:
                # Overflow (all n tie): the first `cap` in index order, on the mask path.
                np.testing.assert_array_equal(np.flatnonzero(sent), np.arange(cap))
            if step == 0 and kind == "ties_few_larger" and name not in RANDOM_K:
                # Overflow with larger values last in index order: the cap
                # largest are sent, ties to the lower index, not the first cap.
                want = [*range(min(cap, np.count_nonzero(sent)) - 3), *range(LIVE_N - 3, LIVE_N)]
                np.testing.assert_array_equal(np.flatnonzero(sent), want)
        # Bounded residual: an element waits at most ~n / k steps for its turn
        # (the bug this guards against: nothing sent, |residual| = steps * |g|).
        # random_k's draws ignore the values: bounded in expectation only.
        bound = (math.ceil(LIVE_N / k) + 2) * gmax
        if name not in RANDOM_K:
            assert float(np.abs(np.asarray(state.residual["w"])).max()) <= bound, kind
    assert cx.traces - traces <= 1


@pytest.mark.parametrize("name", ["ldte_bs"])
def test_liveness_under_shard_map_sparse_exchange(name):
    """The extract path (axis_name, exchange="sparse"): per device >= k; on overflow the
    ``cap`` largest, ties to the lower index."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tx = FACTORIES[name](LIVE_RATIO, axis_name="data", exchange="sparse")
    k = k_of(LIVE_RATIO, LIVE_N)
    cap = cap_of(k, LIVE_N)

    def step(g, s):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), jax.tree.map(lambda x: x[0], s))
        return jax.tree.map(lambda x: x[None], u), jax.tree.map(lambda x: x[None], s)

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))
        )
    )
    sharding = NamedSharding(mesh, P("data"))
    # Devices 0-1 see all ones, 2-3 ones and three 5s last, devices 4-7 random signs.
    kinds = ["ones"] * 2 + ["ties_few_larger"] * 2 + ["signs"] * 4
    state = jax.device_put(_stack(tx.init({"w": jnp.zeros((LIVE_N,), jnp.float32)})), sharding)
    for t in range(LIVE_STEPS // 2):  # > n / capacity: a full round of the ties
        g = np.stack([_live_grad(kinds[d], t, device=d) for d in range(N_DEV)])
        old = np.asarray(state.residual["w"])
        upd, new = f(jax.device_put({"w": jnp.asarray(g)}, sharding), state)
        jax.block_until_ready((upd, new))
        res = np.asarray(new.residual["w"])
        counts = np.asarray(jaxcomp.statistics(new)["sent_count"]["w"])  # one per device
        sent = old + g - res  # what each device sent (exact: the residual keeps the rest)
        for d in range(N_DEV):
            assert np.array_equal(sent[d] + res[d], old[d] + g[d])
            _check_live_step(name, old[d] + g[d], sent[d], int(counts[d]), k, cap)
            if t == 0 and kinds[d] == "ones":
                np.testing.assert_array_equal(np.flatnonzero(sent[d]), np.arange(cap))
            if t == 0 and kinds[d] == "ties_few_larger":
                want = [*range(cap - 3), *range(LIVE_N - 3, LIVE_N)]
                np.testing.assert_array_equal(np.flatnonzero(sent[d]), want)
        np.testing.assert_allclose(np.asarray(upd["w"])[0], sent.mean(axis=0), rtol=1e-6, atol=1e-6)
        state = new
    assert float(np.abs(np.asarray(state.residual["w"])).max()) <= math.ceil(LIVE_N / k) + 2


# ---------------------------------------------------------------------------
# jax_enable_x64 (issue 8, item 7). `make test` also runs a subset of this
# suite with JAX_ENABLE_X64=1.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_x64_every_compressor_nothing_lost(name, dtype):
    """Under x64: float32 and float64 gradients; float64 keeps a float64 residual."""
    with jax.enable_x64(True):
        dt = np.dtype(dtype)
        # "v" has >= 1024 elements: the row-parallel count kernels run.
        spec = {"v": ((40, 30), dt), "s": ((), dt), "d": ((5,), dt)}
        rng = np.random.default_rng(10)
        # Not memoized: the x64 trace must not replace the suite's cached ones.
        cx = Counted(FACTORIES[name](RATIO, min_dense_size=5))
        state = cx.tx.init(laplace_tree(spec, rng))
        for _ in range(3):
            g = laplace_tree(spec, rng)
            assert all(v.dtype == dt for v in g.values())
            upd, new = cx(g, state)
            for leaf, gl in g.items():
                assert upd[leaf].dtype == dt and upd[leaf].shape == gl.shape, leaf
                if name in NO_ERROR_FEEDBACK:
                    continue
                res_old = np.asarray(state.residual[leaf])
                res = np.asarray(new.residual[leaf])
                assert res.dtype == dt, leaf  # residual_dtype=None: float32 or wider
                acc = _compensated(name, res_old, gl)
                sent = np.asarray(upd[leaf])
                if name not in SPARSIFIERS:  # the correctly rounded acc - sent
                    assert np.array_equal(res, acc - sent), leaf
                else:
                    assert np.array_equal(sent + res, acc), leaf
            if name in SPARSIFIERS:
                n = 1200
                nnz = int(np.count_nonzero(np.asarray(upd["v"])))
                assert int(jaxcomp.statistics(new)["sent_count"]["v"]) == nnz
                k = k_of(RATIO, n)
                assert nnz <= cap_of(k, n)
                if name in AT_LEAST_K:
                    assert nnz >= k
            state = new
        assert cx.traces == 1


@pytest.mark.parametrize("name", ["top_k", "ldte_bs", "binary_search", "gaussian_k"])
def test_x64_float64_selection_matches_the_count(name):
    """The mask compares in float32 like the selector's count.

    Values a hair above the float32 threshold round down onto it: a float64
    comparison would select them too, beyond the count and the capacity.
    """
    with jax.enable_x64(True):
        n, k = 200, 20
        t32 = np.nextafter(np.float32(2.0), np.float32(0))  # top_k's threshold below 2.0
        g = np.full(n, np.float64(t32) + 1e-12)  # rounds to t32 in float32
        g[::10] = 2.0  # exactly k values at 2.0
        tx = FACTORIES[name](RATIO)
        upd, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, tx.init({"w": jnp.asarray(g)}))
        sent = np.asarray(upd["w"])
        np.testing.assert_array_equal(np.flatnonzero(sent), np.arange(0, n, 10))
        assert int(jaxcomp.statistics(state)["sent_count"]["w"]) == k


def test_selector_errors_name_the_real_cause():
    """Only a signature mismatch is an options error; a TypeError inside the selector propagates."""

    def selector(x, k, *, scale=1.0):
        raise TypeError("carry types differ (a bug inside the selector)")

    with pytest.raises(TypeError, match="inside the selector"):
        jaxcomp.sparsify(selector, 0.1, selector_options={"scale": 2.0})
    with pytest.raises(ValueError, match="selector_options.*bogus"):
        jaxcomp.sparsify(selector, 0.1, selector_options={"bogus": 2.0})


# ---------------------------------------------------------------------------
# Compressed optimizers (OPTIMIZERS: 1-bit Adam, 0/1 Adam and 1-bit LAMB, both
# exchanges). Their update is an Adam (LAMB) step, so the premises differ from
# a compressor's: nothing is lost in the *momentum* they exchange (not in the
# update), the state counts ``count`` (not ``step``), and there is no ratio.
# Every update gets the parameters (1-bit LAMB's trust ratio needs them; the
# Adams' weight decay would). Each check below is the compressor check of the
# same name, restated for them.
# ---------------------------------------------------------------------------

OPT_NAMES = list(OPTIMIZERS)
OPT_TREE = {
    "scalar": ((), jnp.float32),
    "empty": ((0,), jnp.float32),
    "b16": ((30,), jnp.bfloat16),
    "h16": ((9,), jnp.float16),
    "w": ((6, 7), jnp.float32),
}


def _opt_tree(rng, spec=OPT_TREE):
    return {k: jnp.asarray(rng.normal(size=s)).astype(dt) for k, (s, dt) in spec.items()}


_OPT_CACHE: dict = {}


def _opt(name, **kw) -> Counted:
    """One compiled update per (optimizer, options), shared by the tests below."""
    key = (name, tuple(sorted(kw.items())))
    if key not in _OPT_CACHE:
        _OPT_CACHE[key] = Counted(OPTIMIZERS[name](**kw))
    return _OPT_CACHE[key]


@pytest.mark.parametrize("name", OPT_NAMES)
def test_optimizer_one_compilation_dtypes_tiny_and_empty_leaves(name):
    counted = _opt(name)
    rng = np.random.default_rng(6)
    params = _opt_tree(rng)
    state = counted.tx.init(params)
    for _ in range(8):  # across the warm-up / stage boundaries and local/sync steps
        g = _opt_tree(rng)
        upd, state = counted(g, state, params)
        for leaf, gl in g.items():
            assert upd[leaf].dtype == gl.dtype and upd[leaf].shape == gl.shape, leaf
            assert np.all(np.isfinite(np.asarray(upd[leaf], np.float32))), leaf
            assert state.mu[leaf].dtype == jnp.float32 and state.residual[leaf].dtype == jnp.float32
    assert counted.traces == 1
    assert int(state.count) == 8
    assert int(state.message_bytes["empty"]) == 0


@pytest.mark.parametrize("name", OPT_NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_optimizer_nonfinite_skip_keeps_state(name, bad):
    counted = _opt(name)
    rng = np.random.default_rng(7)
    params = _opt_tree(rng)
    state = counted.tx.init(params)
    for _ in range(4):
        _, state = counted(_opt_tree(rng), state, params)
    g = _opt_tree(rng)
    g["b16"] = g["b16"].at[3].set(bad)
    upd, new = counted(g, state, params)
    for leaf in g:
        assert not np.any(np.asarray(upd[leaf], np.float32)), leaf
        for field in ("mu", "nu", "residual"):
            a, b = getattr(new, field)[leaf], getattr(state, field)[leaf]
            assert np.array_equal(np.asarray(a), np.asarray(b)), (field, leaf)
    assert np.array_equal(np.asarray(new.server_residual), np.asarray(state.server_residual))
    assert int(new.count) == int(state.count)
    assert int(new.nonfinite_steps) == int(state.nonfinite_steps) + 1
    upd2, new2 = counted(_opt_tree(rng), new, params)
    assert any(np.any(np.asarray(u, np.float32)) for u in upd2.values())
    assert int(new2.count) == int(state.count) + 1


@pytest.mark.parametrize("name", OPT_NAMES)
def test_optimizer_nonfinite_zero_uses_the_finite_part(name):
    counted = _opt(name, nonfinite="zero")
    rng = np.random.default_rng(8)
    spec = {"w": ((5, 7), jnp.float32)}
    params = _opt_tree(rng, spec)
    state = counted.tx.init(params)
    for _ in range(5):
        g = _opt_tree(rng, spec)
        g["w"] = g["w"].at[1, 2].set(np.nan)
        upd, state = counted(g, state, params)
        for leaf in g:
            assert np.all(np.isfinite(np.asarray(upd[leaf], np.float32))), leaf
            for field in (state.mu, state.residual):
                assert np.all(np.isfinite(np.asarray(field[leaf]))), leaf
        for srv in jax.tree.leaves(state.server_residual):  # None with exchange="allgather"
            assert np.all(np.isfinite(np.asarray(srv)))
    assert int(state.nonfinite_steps) == 5 and int(state.count) == 5


@pytest.mark.parametrize("name", OPT_NAMES)
def test_optimizer_apply_if_finite_and_state_readable_inside_chain(name):
    """Wrapped in optax.apply_if_finite inside a chain: a NaN step is not applied, the
    residual stays finite, and optax.tree.get finds the optimizer's fields."""
    tx = optax.chain(optax.clip_by_global_norm(10.0), optax.apply_if_finite(OPTIMIZERS[name](), 3))
    f = jax.jit(tx.update)
    rng = np.random.default_rng(10)
    spec = {"w": ((20,), jnp.float32)}
    params = _opt_tree(rng, spec)
    state = tx.init(params)
    for _ in range(3):
        _, state = f(_opt_tree(rng, spec), state, params)
    g = _opt_tree(rng, spec)
    g["w"] = g["w"].at[0].set(np.nan)
    upd, state2 = f(g, state, params)
    assert int(optax.tree.get(state2, "notfinite_count")) == 1
    assert not np.any(np.asarray(upd["w"]))
    assert int(optax.tree.get(state2, "count")) == 3
    assert np.all(np.isfinite(np.asarray(optax.tree.get(state2, "residual")["w"])))
    assert np.array_equal(
        np.asarray(optax.tree.get(state2, "mu")["w"]), np.asarray(optax.tree.get(state, "mu")["w"])
    )


OPT_BAD = [
    (dict(learning_rate=0.0), "learning_rate"),
    (dict(b1=1.0), "b1"),
    (dict(b2=-0.1), "b2"),
    (dict(eps=0.0), "eps"),
    (dict(codec="nope"), "codec"),
    (dict(bucket_size=0), "bucket_size"),
    (dict(exchange="nope"), "exchange"),
    (dict(nonfinite="nope"), "nonfinite"),
    (dict(min_dense_size=-1), "min_dense_size"),
    (dict(residual_dtype=jnp.int32), "residual_dtype"),
    (dict(bias_correction=1), "bias_correction"),
]


@pytest.mark.parametrize("kwargs,arg", OPT_BAD)
@pytest.mark.parametrize("make", [jaxcomp.onebit_adam, jaxcomp.zero_one_adam])
def test_optimizer_bad_arguments(make, kwargs, arg):
    kw = dict(kwargs)
    lr = kw.pop("learning_rate", 0.01)
    schedule = {"freeze_step": 2} if make is jaxcomp.onebit_adam else {"var_freeze_step": 2}
    with pytest.raises(ValueError, match=arg):
        make(lr, **schedule, **kw)


@pytest.mark.parametrize("name", OPT_NAMES)
def test_optimizer_shard_map_exchange_loses_nothing(name):
    """8 devices under shard_map: on every 1-bit exchange, the mean of what the devices
    had to send (their message plus residual) equals the exchanged mean plus the mean
    of the new residuals plus the change of the servers' errors; the momentum and
    update are identical on every device."""
    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("data",))
    sh = NamedSharding(mesh, P("data"))
    tx = OPTIMIZERS[name](axis_name="data")
    b1 = 0.9
    spec = {"w": ((6, 7), jnp.float32), "v": ((40,), jnp.float32)}
    rng = np.random.default_rng(11)
    params = _opt_tree(rng, spec)
    one = tx.init(params)
    put = lambda t: jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sh), t)  # noqa: E731
    stack = lambda t: jax.tree.map(lambda x: np.stack([np.asarray(x)] * n), t)  # noqa: E731
    state = put(stack(one))
    params = put(stack(params))
    update = mesh_update(tx, mesh)
    onebit_steps = 0
    for _ in range(3):  # onebit_adam: warm, warm, 1-bit; zero_one_adam: var, var, 1-bit
        g = {k: rng.normal(size=(n, *s)).astype(np.float32) for k, (s, _) in spec.items()}
        old = jax.tree.map(np.asarray, state)
        upd, state = update(put(g), state, params)
        new = jax.tree.map(np.asarray, state)
        upd = jax.tree.map(np.asarray, upd)
        for leaf in spec:
            assert np.all(upd[leaf] == upd[leaf][:1]), leaf
            assert np.all(new.mu[leaf] == new.mu[leaf][:1]), leaf
        if not np.any(new.message_bytes["w"] < g["w"][0].nbytes):
            continue  # a dense step
        onebit_steps += 1
        # None with exchange="allgather": no server error.
        srv_old, srv_new = (
            0 if s.server_residual is None else s.server_residual.sum(0) for s in (old, new)
        )
        before, after = [], []
        for leaf in ("w", "v"):
            x = g[leaf].astype(np.float64)
            if name.startswith("onebit_adam"):  # the local momentum is exchanged
                x = b1 * old.mu[leaf].astype(np.float64) + (1 - b1) * x
                mean = new.mu[leaf][0].astype(np.float64)
            elif name.startswith("onebit_lamb"):  # the local momentum, scaled per leaf
                # One coefficient per leaf, in leaf order (v, w).
                scale = new.scaling_coeff[0][sorted(spec).index(leaf)].astype(np.float64)
                x = scale * (b1 * old.mu[leaf].astype(np.float64) + (1 - b1) * x)
                mean = scale * new.mu[leaf][0].astype(np.float64)
            else:  # stage 1 of 0/1 Adam: the gradient is exchanged, m = b1 m + (1 - b1) mean
                mean = (new.mu[leaf][0] - b1 * old.mu[leaf][0]) / (1 - b1)
            before.append((x + old.residual[leaf]).mean(0).reshape(-1))
            after.append((mean + new.residual[leaf].mean(0)).reshape(-1))
        # The two-stage server error runs over the compressed leaves in leaf order (v, w).
        before = np.concatenate(before[::-1]) + srv_old
        after = np.concatenate(after[::-1]) + srv_new
        np.testing.assert_allclose(after, before, rtol=1e-4, atol=1e-5)
    assert onebit_steps == 1


@pytest.mark.parametrize("name", OPT_NAMES)
def test_x64_optimizers_keep_float64(name):
    """Under x64, float64 gradients: float64 moments, residuals and server error, finite."""
    with jax.enable_x64(True):
        spec = {"v": ((40, 3), np.float64), "s": ((), np.float64)}
        rng = np.random.default_rng(12)
        counted = Counted(OPTIMIZERS[name]())  # not memoized: the x64 trace
        params = _opt_tree(rng, spec)
        state = counted.tx.init(params)
        for _ in range(6):
            g = _opt_tree(rng, spec)
            upd, state = counted(g, state, params)
            assert upd["v"].dtype == np.float64 and np.all(np.isfinite(np.asarray(upd["v"])))
            assert state.mu["v"].dtype == np.float64 and state.residual["v"].dtype == np.float64
            if state.server_residual is not None:  # None with exchange="allgather"
                assert state.server_residual.dtype == np.float64
        assert counted.traces == 1


# ---------------------------------------------------------------------------
# Checkpoints: every state round-trips through orbax and continues bit for bit.
# ---------------------------------------------------------------------------

_CKPT_PARAMS = {"kernel": ((16, 8), np.float32), "bias": ((8,), np.float32)}


def _ckpt_grads(steps: int) -> list:
    rng = np.random.default_rng(21)
    return [
        {k: jnp.asarray(rng.normal(size=s).astype(d)) for k, (s, d) in _CKPT_PARAMS.items()}
        for _ in range(steps)
    ]


def _assert_same_bits(a, b, what: str) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b), what
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape, what
        assert bits(x) == bits(y), what


def _ckpt_tx(name: str):
    return OPTIMIZERS[name]() if name in OPTIMIZERS else FACTORIES[name](RATIO)


@pytest.mark.parametrize("name", NAMES + OPT_NAMES)
def test_state_round_trips_through_orbax(name, tmp_path):
    """Saved with orbax after 2 steps and restored onto the abstract state, a state
    continues bit for bit (1-bit and 0/1 Adam's single-stage state once held a
    zero-size array, which orbax refuses to save)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 (optional dependency)

    tx = _ckpt_tx(name)
    params = {k: jnp.zeros(s, d) for k, (s, d) in _CKPT_PARAMS.items()}
    # The optimizers get the parameters (1-bit LAMB needs them), the compressors not.
    update = jax.jit(tx.update)
    if name in OPTIMIZERS:
        update = jax.jit(lambda g, s: tx.update(g, s, params))
    grads = _ckpt_grads(4)
    # Committed to the device orbax restores onto: jit keys its compiled programs
    # on committedness, so an uncommitted state would compile the update twice.
    state = jax.device_put(tx.init(params), jax.devices()[0])
    for g in grads[:2]:
        _, state = update(g, state)
    checkpointer = ocp.StandardCheckpointer()
    try:
        checkpointer.save(tmp_path / "state", state)
        checkpointer.wait_until_finished()
        restored = checkpointer.restore(tmp_path / "state", jax.eval_shape(tx.init, params))
    finally:
        checkpointer.close()
    _assert_same_bits(restored, state, "restored state")
    for g in grads[2:]:
        upd, state = update(g, state)
        upd_r, restored = update(g, restored)
        _assert_same_bits(upd_r, upd, "updates")
        _assert_same_bits(restored, state, "states")


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam", "onebit_lamb"])
def test_adam_state_round_trips_through_elastic(name, tmp_path):
    """elastic.save / elastic.restore on the same device count: 1-bit and 0/1 Adam's
    and 1-bit LAMB's default (single-stage) states come back bit for bit and train on
    identically."""
    from jaxcomp import distributed as dist  # noqa: PLC0415
    from jaxcomp import elastic  # noqa: PLC0415

    kw = {"axis_name": "data"}
    if name == "zero_one_adam":
        kw["local_step_clipper"] = 1  # make_train_step: replicated parameters, no local steps
    tx = OPTIMIZERS[name](**kw)
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    rng = np.random.default_rng(22)

    def loss(p, b):
        return jnp.mean((b["x"] @ p["kernel"] + p["bias"] - b["y"]) ** 2)

    batches = [
        dist.shard_batch(
            {
                "x": rng.normal(size=(4, 16)).astype(np.float32),
                "y": rng.normal(size=(4, 8)).astype(np.float32),
            },
            mesh,
        )
        for _ in range(4)
    ]
    like = {k: jnp.zeros(s, d) for k, (s, d) in _CKPT_PARAMS.items()}
    params = dist.replicate(like, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss, tx, mesh, donate=False)
    for b in batches[:2]:
        params, state, _ = step(params, state, b)
    elastic.save(tmp_path, 2, params, state)
    params_r, state_r = elastic.restore(tmp_path, 2, mesh, tx, like)
    assert state_r.server_residual is None
    _assert_same_bits(state_r, state, "restored state")
    _assert_same_bits(params_r, params, "restored params")
    for b in batches[2:]:
        params, state, _ = step(params, state, b)
        params_r, state_r, _ = step(params_r, state_r, b)
        _assert_same_bits(params_r, params, "params")
        _assert_same_bits(state_r, state, "states")


# ---------------------------------------------------------------------------
# The two-level exchange (axis_name=("node", "local")) on a 2x4 mesh.
# ---------------------------------------------------------------------------

TWO_LEVEL_TREE = {"w": ((12, 10), jnp.float32), "h": ((9,), jnp.bfloat16), "s": ((), jnp.float32)}


@pytest.mark.parametrize("name", NAMES)
def test_two_level_shapes_and_lost_nothing(name):
    """Two steps on 2x4: the update has the gradients' shapes and dtypes and is the same on
    every device; with error feedback ``L sum e_new + N u == L sum e + sum g`` (residuals
    are per shard: the device of local index ``l`` owns rows ``l`` of the padded leaf)."""
    nodes, local, n_dev = 2, 4, 8
    axes = ("node", "local")
    mesh = jax.make_mesh((nodes, local), axes)
    tx = FACTORIES[name](RATIO, axis_name=axes)
    sharding = NamedSharding(mesh, P(axes))
    init = jax.jit(
        jax.shard_map(
            lambda g: jax.tree.map(lambda a: a[None], tx.init(jax.tree.map(lambda a: a[0], g))),
            mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False,
        )
    )  # fmt: skip
    step = mesh_update(tx, mesh, axes)
    rng = np.random.default_rng(0)
    stacked = {k: ((n_dev, *s), dt) for k, (s, dt) in TWO_LEVEL_TREE.items()}
    state = init(jax.device_put(laplace_tree(stacked, rng), sharding))
    for _ in range(2):
        g = laplace_tree(stacked, rng)
        upd, new = jax.device_get(step(jax.device_put(g, sharding), state))
        old_res, new_res = (optax.tree.get(s, "residual") for s in (jax.device_get(state), new))
        for leaf, gl in g.items():
            u = np.asarray(upd[leaf])
            assert u.dtype == gl.dtype and u.shape == gl.shape, leaf
            assert all(bits(u[d]) == bits(u[0]) for d in range(n_dev)), leaf
            if name in NO_ERROR_FEEDBACK:
                continue
            shape = gl.shape[1:]
            n = math.prod(shape)

            def placed(res, leaf=leaf, n=n, shape=shape):
                e = np.asarray(res[leaf], np.float64).reshape(nodes, -1)[:, :n]
                return e.sum(axis=0).reshape(shape)

            lhs = local * placed(new_res) + n_dev * f32(u[0]).astype(np.float64)
            rhs = local * placed(old_res) + f32(gl).astype(np.float64).sum(axis=0)
            if name in RESIDUAL_SCALING:  # beta (sum of residuals) + gamma (sum of g)
                beta, gamma = RESIDUAL_SCALING[name]
                rhs = local * beta * placed(old_res) + gamma * f32(gl).astype(np.float64).sum(0)
            wide = gl.dtype == jnp.float32 and value_itemsize(name, np.float32) == 4
            tol = (2e-6 if wide else 2e-2) * n_dev * max(1, np.abs(rhs).max())
            assert np.max(np.abs(lhs - rhs)) <= tol, (leaf, np.max(np.abs(lhs - rhs)))
        state = jax.device_put(new, sharding)
