"""``defer_residual=True``: the one-device sparsifiers clear their message a step late.

The step keeps the accumulator and the mask of its message (``sent_threshold``,
``sent_limit``) and the next step clears the message as it accumulates. Two
references: the same transform without the option (the residual written out
by the default code path), and the deferred state settled after every step
(nothing pending). Updates and residuals must agree bit for bit, over steps
that cut the message at the capacity (ties), reuse a threshold, switch
warm-up phases, merge leaves into one group or carry DGC momentum.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import per_leaf

import jaxcomp
from jaxcomp import elastic
from jaxcomp.transforms.sparsify import clear_sent


def _bits(x):
    a = np.asarray(x)
    return a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))


def _grads(kind, step):
    rng = np.random.default_rng(step)
    shapes = {"w": (40, 30), "b": (30,), "v": (257,)}
    g = {k: rng.laplace(size=s).astype(np.float32) for k, s in shapes.items()}
    if kind == "degenerate":
        g["w"][:] = 1.0  # all ones: no threshold splits them, the capacity cuts the message
        g["b"][:] = 0.0
    if kind == "nonfinite":  # a NaN on step 2, an inf on step 4
        if step == 2:
            g["w"][3, 4] = np.nan
        if step == 4:
            g["v"][7] = -np.inf
    if kind == "mixed":  # the conformance suite's dtypes and degenerate leaves
        g["b"] = g["b"].astype(jnp.bfloat16)
        g["v"] = g["v"].astype(np.float16)
        g["empty"] = np.zeros((0,), np.float32)
        g["scalar"] = np.float32(rng.laplace())
        g["one"] = rng.laplace(size=(1,)).astype(np.float32)
    return {k: jnp.asarray(v) for k, v in g.items()}


CASES = {
    "ldte_bs": lambda **kw: jaxcomp.ldte_bs(0.01, min_dense_size=0, **kw),
    "top_k": lambda **kw: jaxcomp.top_k(0.01, min_dense_size=0, **kw),
    "gaussian_k": lambda **kw: jaxcomp.gaussian_k(0.01, min_dense_size=0, **kw),
    "binary_search": lambda **kw: jaxcomp.binary_search(0.01, min_dense_size=0, **kw),
    "trimmed_top_k": lambda **kw: jaxcomp.trimmed_top_k(0.01, min_dense_size=0, **kw),
    "threshold": lambda **kw: jaxcomp.threshold(0.01, threshold=1.5, min_dense_size=0, **kw),
    # All-ones gradients meet this threshold exactly: not sent (|x| > t only).
    "threshold_tie": lambda **kw: jaxcomp.threshold(0.01, threshold=1.0, min_dense_size=0, **kw),
    "dgc_momentum": lambda **kw: jaxcomp.dgc(0.01, momentum=0.9, min_dense_size=0, **kw),
    "global": lambda **kw: jaxcomp.ldte_bs(0.01, granularity="global", min_dense_size=0, **kw),
    "groups": lambda **kw: jaxcomp.ldte_bs(
        0.01, groups=[["['b']", "['v']"]], min_dense_size=0, **kw
    ),
    "reuse": lambda **kw: jaxcomp.ldte_bs(0.01, reuse_period=3, min_dense_size=0, **kw),
    "warmup": lambda **kw: jaxcomp.ldte_bs(
        0.01, warmup_ratios=(0.25, 0.05), steps_per_epoch=2, min_dense_size=0, **kw
    ),
    "min_dense_size": lambda **kw: jaxcomp.ldte_bs(0.01, min_dense_size=300, **kw),
    "nonfinite_zero": lambda **kw: jaxcomp.ldte_bs(0.01, nonfinite="zero", min_dense_size=0, **kw),
    "momentum_unmasked": lambda **kw: jaxcomp.top_k(
        0.01, momentum=0.5, momentum_masking=False, min_dense_size=0, **kw
    ),
}


# Laplacian, degenerate and NaN/inf steps have the same shapes: one compilation
# runs the three, each from a fresh state; the mixed tree is its own program.
@pytest.mark.parametrize("kinds", [("laplace", "degenerate", "nonfinite"), ("mixed",)])
@pytest.mark.parametrize("name", sorted(CASES))
def test_deferred_matches_the_written_out_residual(name, kinds):
    deferred_tx = CASES[name](defer_residual=True)
    plain_tx = CASES[name]()
    traces = []

    def deferred_update(g, s):
        traces.append(1)
        return deferred_tx.update(g, s)

    d_step, p_step = jax.jit(deferred_update), jax.jit(plain_tx.update)
    for kind in kinds:
        g0 = _grads(kind, 0)
        deferred, settled, plain = deferred_tx.init(g0), deferred_tx.init(g0), plain_tx.init(g0)
        assert isinstance(deferred, jaxcomp.DeferredSparsifyState)
        assert isinstance(plain, jaxcomp.SparsifyState)
        pending = 0
        for i in range(6):
            g = _grads(kind, i)
            u_d, new_d = d_step(g, deferred)
            u_s, new_s = d_step(g, settled.settled())
            u_p, new_p = p_step(g, plain)
            res_d = jaxcomp.residuals(new_d)
            for k in g:
                for u in (u_s, u_p):
                    np.testing.assert_array_equal(
                        _bits(u_d[k]), _bits(u[k]), err_msg=f"{kind} {k} {i}"
                    )
                np.testing.assert_array_equal(_bits(res_d[k]), _bits(new_p.residual[k]))
                np.testing.assert_array_equal(
                    _bits(res_d[k]), _bits(new_s.settled().accumulator[k])
                )
                if new_d.velocity is not None:
                    np.testing.assert_array_equal(
                        _bits(new_d.velocity[k]), _bits(new_p.velocity[k])
                    )
            pending += int(np.isfinite(np.asarray(new_d.sent_threshold)).sum())
            deferred, settled, plain = new_d, new_s, new_p
        # min_dense_size=300 sends these leaves dense; one global group of mixed
        # dtypes rounds the update, so it writes the residual out.
        if name != "min_dense_size" and (name, kind) != ("global", "mixed"):
            assert pending > 0, kind  # the deferred path ran, not only the written-out one
    assert len(traces) == 1  # one compilation for every step and kind (settled states alike)


def test_nothing_lost_bit_for_bit():
    tx = jaxcomp.ldte_bs(0.01, min_dense_size=0, defer_residual=True)
    state = tx.init(_grads("laplace", 0))
    for i in range(4):
        g = _grads("laplace", i)
        old = jaxcomp.residuals(state)
        u, state = jax.jit(tx.update)(g, state)
        new = jaxcomp.residuals(state)
        for k in g:
            total = np.asarray(u[k]) + np.asarray(new[k])
            np.testing.assert_array_equal(total, np.asarray(old[k]) + np.asarray(g[k]))


def test_capacity_cut_is_per_leaf_in_a_merged_group():
    # All ones in one merged group: the message is the first `capacity` ones
    # of the concatenated group in index order, so the cut falls inside a leaf.
    tx = jaxcomp.ldte_bs(0.01, granularity="global", min_dense_size=0, defer_residual=True)
    g = {"a": jnp.ones(300), "b": jnp.ones(500), "c": jnp.ones(200)}  # flattened a, b, c
    u, state = jax.jit(tx.update)(g, tx.init(g))
    flat_u = np.concatenate([np.asarray(u[k]) for k in "abc"])
    sent = int(state.sent_count)
    assert 10 <= sent < 1000
    np.testing.assert_array_equal(flat_u, (np.arange(1000) < sent).astype(np.float32))
    limits = {k: int(v) for k, v in per_leaf(g, state.sent_limit).items()}
    assert limits == {"a": sent - 1, "b": sent - 1 - 300, "c": sent - 1 - 800}
    res = jaxcomp.residuals(state)
    for k in "abc":  # the accumulator still holds the message; the residual does not
        np.testing.assert_array_equal(np.asarray(state.accumulator[k]), 1.0)
        np.testing.assert_array_equal(np.asarray(res[k]), 1.0 - np.asarray(u[k]))
    # The next step sends the ones the cut kept back first.
    u2, _ = jax.jit(tx.update)(g, state)
    flat_u2 = np.concatenate([np.asarray(u2[k]) for k in "abc"])
    assert np.all(flat_u2[sent : 2 * sent] == 2.0) and np.all(flat_u2[:sent] == 0.0)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.ldte_bs(0.01, min_dense_size=0, low_pass=0.5, defer_residual=True),
        lambda: jaxcomp.random_k(0.01, min_dense_size=0, defer_residual=True),
    ],
    ids=["low_pass", "random_k"],
)
def test_paths_that_write_the_residual_out(make):
    tx = make()
    g = _grads("laplace", 0)
    _, state = jax.jit(tx.update)(g, tx.init(g))
    assert np.all(np.isinf(np.asarray(state.sent_threshold)))
    assert state.sent_threshold.shape == (len(g),)  # one entry per leaf
    for k in g:
        np.testing.assert_array_equal(jaxcomp.residuals(state)[k], state.accumulator[k])


def test_bf16_leaf_writes_its_residual_out_float32_leaf_defers():
    tx = jaxcomp.ldte_bs(0.01, min_dense_size=0, defer_residual=True)
    g = {
        "h": jnp.asarray(np.random.default_rng(0).laplace(size=3000)).astype(jnp.bfloat16),
        "f": jnp.asarray(np.random.default_rng(1).laplace(size=3000).astype(np.float32)),
    }
    u, state = jax.jit(tx.update)(g, tx.init(g))
    sent_threshold = per_leaf(g, state.sent_threshold)
    assert np.isinf(float(sent_threshold["h"]))  # the bf16 message rounds: written out
    assert np.isfinite(float(sent_threshold["f"]))
    res = jaxcomp.residuals(state)
    for k in g:
        total = np.asarray(u[k], np.float32) + np.asarray(res[k])
        np.testing.assert_array_equal(total, np.asarray(g[k], np.float32))


def test_x64_float64_leaf_defers_bit_for_bit():
    with jax.enable_x64(True):
        tx = jaxcomp.ldte_bs(0.01, min_dense_size=0, defer_residual=True)
        g = {"w": jnp.asarray(np.random.default_rng(2).laplace(size=5000))}
        assert g["w"].dtype == jnp.float64
        state = tx.init(g)
        for _ in range(3):
            old = np.asarray(jaxcomp.residuals(state)["w"])
            u, state = jax.jit(tx.update)(g, state)
            assert state.accumulator["w"].dtype == jnp.float64
            assert np.isfinite(float(state.sent_threshold[0]))
            total = np.asarray(u["w"]) + np.asarray(jaxcomp.residuals(state)["w"])
            np.testing.assert_array_equal(total, old + np.asarray(g["w"]))


def test_clear_sent_numpy_and_stacked():
    acc = np.array([[3.0, -1.0, 5.0, 0.5], [2.0, 2.0, 3.0, 2.0]], np.float32)
    # Device 1: a capacity cut of 2 (capacity_cut's form: just below the tie
    # value 2.0, and the last tie sent): the 3.0 and the tie at index 0.
    t = np.array([1.0, np.nextafter(np.float32(2.0), np.float32(0))], np.float32)
    limit = np.array([1, 0], np.int32)  # device 0: a cut below 1.0's successor changes nothing
    out = clear_sent(acc, t, limit)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out, [[0.0, -1.0, 0.0, 0.5], [0.0, 2.0, 0.0, 2.0]])
    np.testing.assert_array_equal(clear_sent(jnp.asarray(acc), jnp.asarray(t), limit), out)
    # float64 on the host stays float64 whatever jax_enable_x64 says.
    assert clear_sent(acc.astype(np.float64), t, limit).dtype == np.float64
    # -0.0 where sent is +0.0, like the immediate write; NaN is never sent.
    nan = clear_sent(np.array([np.nan, -7.0], np.float32), np.float32(1.0), np.int32(5))
    assert np.isnan(nan[0]) and _bits(nan)[1] == 0


def test_state_fields_and_errors():
    tx = jaxcomp.ldte_bs(0.01, min_dense_size=0, defer_residual=True)
    g = _grads("laplace", 0)
    _, state = jax.jit(tx.update)(g, tx.init(g))
    with pytest.raises(AttributeError):
        state.residual  # noqa: B018 - a deferred state has no residual field: loud
    chain = optax.chain(tx, optax.sgd(0.1))
    _, cstate = jax.jit(chain.update)(g, chain.init(g))
    assert optax.tree.get(cstate, "residual") is None  # documented: use jaxcomp.residuals
    acc = optax.tree.get(cstate, "accumulator")
    res = jaxcomp.residuals(cstate)
    assert any(not np.array_equal(res[k], acc[k]) for k in g)  # the message is pending
    settled = state.settled()
    for k in g:
        np.testing.assert_array_equal(settled.accumulator[k], jaxcomp.residuals(state)[k])
        sent_threshold = per_leaf(g, settled.sent_threshold)[k]
        assert np.isinf(float(sent_threshold)) and int(per_leaf(g, settled.sent_limit)[k]) == 0
    plain = jaxcomp.ldte_bs(0.01, min_dense_size=0)
    plain_state = plain.init(g)
    # The default state keeps its layout (checkpoints from before the option restore).
    assert plain_state._fields == (
        "step", "residual", "velocity", "key", "sent_count", "threshold",
        "search_iterations", "message_bytes", "wire_bytes", "nonfinite_steps",
    )  # fmt: skip
    with pytest.raises(ValueError, match="defer_residual=True .* passed to one with defer_resi"):
        plain.update(g, state)
    with pytest.raises(ValueError, match="defer_residual=False .* passed to one with defer_resi"):
        tx.update(g, plain_state)
    with pytest.raises(ValueError, match="defer_residual=True applies to one device"):
        jaxcomp.ldte_bs(0.01, axis_name="data", defer_residual=True)
    with pytest.raises(ValueError, match="defer_residual"):
        jaxcomp.ldte_bs(0.01, defer_residual="yes")


WRAPPERS = {
    "masked": lambda tx: optax.masked(tx, {"w": True, "b": False, "v": True}),
    "multi_transform": lambda tx: optax.multi_transform(
        {"c": tx, "s": optax.sgd(0.1)}, {"w": "c", "b": "s", "v": "c"}
    ),
    "MultiSteps": lambda tx: optax.MultiSteps(tx, every_k_schedule=1),
    "apply_if_finite": lambda tx: optax.apply_if_finite(tx, max_consecutive_errors=2),
    "chain": lambda tx: optax.chain(optax.clip(10.0), tx, optax.sgd(0.1)),
}


@pytest.mark.parametrize("wrap", sorted(WRAPPERS))
def test_residuals_through_optax_wrappers(wrap):
    inner = jaxcomp.ldte_bs(0.01, min_dense_size=0, defer_residual=True)
    plain = jaxcomp.ldte_bs(0.01, min_dense_size=0)
    tx = WRAPPERS[wrap](inner)
    g = _grads("laplace", 0)
    state = tx.init(g)
    u, state = jax.jit(tx.update)(g, state, g)
    res = jaxcomp.residuals(state)
    # Independent: the lone compressor, without the option, on the same (clipped) gradient.
    gc = jax.tree.map(lambda x: jnp.clip(x, -10.0, 10.0), g) if wrap == "chain" else g
    sub = {k: gc[k] for k in ("w", "v")} if wrap in ("masked", "multi_transform") else gc
    _, ref = jax.jit(plain.update)(sub, plain.init(sub))
    for k in sub:
        np.testing.assert_array_equal(np.asarray(res[k]), np.asarray(ref.residual[k]))
    assert np.isfinite(float(per_leaf(sub, optax.tree.get(state, "sent_threshold"))["w"]))


def test_residuals_inject_hyperparams_and_errors():
    tx = optax.inject_hyperparams(
        jaxcomp.ldte_bs, static_args=("ratio", "min_dense_size", "defer_residual")
    )(ratio=0.01, min_dense_size=0, delta=0.0, defer_residual=True)
    g = _grads("laplace", 1)
    _, state = jax.jit(tx.update)(g, tx.init(g))
    ref_tx = jaxcomp.ldte_bs(0.01, min_dense_size=0)
    _, ref = jax.jit(ref_tx.update)(g, ref_tx.init(g))
    for k in g:
        np.testing.assert_array_equal(jaxcomp.residuals(state)[k], ref.residual[k])
    with pytest.raises(ValueError, match="no error-feedback residual"):
        jaxcomp.residuals(optax.sgd(0.1).init(g))
    with pytest.raises(ValueError, match="no error-feedback residual"):
        jaxcomp.residuals(jaxcomp.qsgd(4, error_feedback=False).init(g))
    two = optax.chain(jaxcomp.top_k(0.1), jaxcomp.ldte_bs(0.1, defer_residual=True))
    with pytest.raises(ValueError, match="2 residuals"):
        jaxcomp.residuals(two.init(g))
    q = jaxcomp.qsgd(4, error_feedback=True)
    qs = q.init(g)
    assert jaxcomp.residuals(qs) is qs.residual


def test_elastic_settles_pending_states_before_folding():
    # Two one-device states with pending messages, stacked as two devices.
    tx = jaxcomp.ldte_bs(0.05, min_dense_size=0, defer_residual=True)
    states = []
    for seed in (0, 1):
        s = tx.init(_grads("laplace", seed))
        for i in range(2):
            _, s = jax.jit(tx.update)(_grads("laplace", seed + 10 * i), s)
        states.append(jax.tree.map(np.asarray, s))
    stacked = jax.tree.map(lambda *xs: np.stack(xs), *states)
    leaf_w = sorted(_grads("laplace", 0)).index("w")  # leaf order: dict keys sorted
    assert np.all(np.isfinite(stacked.sent_threshold[:, leaf_w]))
    res = [jaxcomp.residuals(s) for s in states]
    owed = {k: np.mean([np.asarray(r[k], np.float64) for r in res], 0) for k in "wbv"}
    got = elastic.owed_updates(stacked)
    for k in "wbv":
        np.testing.assert_allclose(got[f".accumulator['{k}']"], owed[k], rtol=1e-6, atol=1e-7)
        # The stacked state: each device's own message cleared.
        for d in range(2):
            np.testing.assert_array_equal(jaxcomp.residuals(stacked)[k][d], res[d][k])
    for m in (1, 3):
        new = elastic.resize_opt_state(stacked, 2, m)
        assert np.all(np.isinf(new.sent_threshold[:, leaf_w]))
        for k in "wbv":
            mean = np.asarray(new.accumulator[k], np.float64).mean(0)
            np.testing.assert_allclose(mean, owed[k], rtol=1e-6, atol=1e-7)
    same = elastic.resize_opt_state(stacked, 2, 2)  # nothing moves: bit for bit
    np.testing.assert_array_equal(same.sent_threshold, stacked.sent_threshold)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("factory", [jaxcomp.top_k, jaxcomp.ldte_bs, jaxcomp.dgc])
def test_residual_narrower_than_float32_is_written_out(factory, dtype):
    # XLA:CPU compares the fused sum unrounded; a stored bf16 accumulator
    # compared again next step could disagree (an element sent and kept).
    txs = [factory(0.1, residual_dtype=dtype, defer_residual=d) for d in (False, True)]
    params = {"w": jnp.zeros(64, dtype)}
    states = [tx.init(params) for tx in txs]
    steps = [jax.jit(tx.update) for tx in txs]
    for i in range(8):
        g = {"w": jnp.asarray(np.random.default_rng(i).normal(size=64) * 3).astype(dtype)}
        outs = [step(g, s) for step, s in zip(steps, states, strict=True)]
        states = [o[1] for o in outs]
        np.testing.assert_array_equal(_bits(outs[0][0]["w"]), _bits(outs[1][0]["w"]))
        np.testing.assert_array_equal(
            _bits(states[0].residual["w"]), _bits(jaxcomp.residuals(states[1])["w"])
        )
        assert np.isinf(float(states[1].sent_threshold[0]))


def test_host_settling_treats_subnormals_as_the_device_does():
    # XLA compares float32 subnormals as 0: a zero threshold never sent them.
    acc = np.array([1e-40, 0.5, -1e-42, 0.0, 2e-38], np.float32)
    host = clear_sent(acc, np.float32(0.0), np.int32(10))
    device = clear_sent(jnp.asarray(acc), jnp.float32(0.0), jnp.int32(10))
    np.testing.assert_array_equal(_bits(host), _bits(device))
    np.testing.assert_array_equal(host, np.where(np.abs(acc) < 1e-38, acc, 0))


def test_residuals_of_explicitly_sharded_leaves():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(3)
    grads = {"w": rng.laplace(size=(5, 16)).astype(np.float32), "b": rng.laplace(size=(8,))}
    grads = jax.tree.map(lambda x: np.asarray(x, np.float32), grads)
    specs = {"w": jax.sharding.PartitionSpec(None, "data"), "b": jax.sharding.PartitionSpec()}
    tx = jaxcomp.ldte_bs(0.1, min_dense_size=0, defer_residual=True)
    ref_tx = jaxcomp.ldte_bs(0.1, min_dense_size=0)
    _, ref = jax.jit(ref_tx.update)(grads, ref_tx.init(grads))
    with jax.set_mesh(mesh):
        sharded = jax.tree.map(
            lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), grads, specs
        )
        _, state = jax.jit(tx.update)(sharded, jax.jit(tx.init)(sharded))
        res = jaxcomp.residuals(state)
        settled = state.settled()
    assert state.accumulator["w"].sharding.spec == specs["w"]
    for k in grads:
        np.testing.assert_array_equal(np.asarray(res[k]), np.asarray(ref.residual[k]))
        np.testing.assert_array_equal(np.asarray(settled.accumulator[k]), np.asarray(res[k]))
