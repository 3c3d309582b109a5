"""ScaleCom's low-pass filter on the residual (``sparsify(low_pass=beta)``).

``r <- r + beta * (r + g - sent - r)``: checked against a numpy top-k with
error feedback, on a skipped step, at ``beta = 1`` (plain error feedback, bit
for bit) and, with ``exchange="scalecom"`` on 4 devices, through the
exchange's own accounting (test_sparse_allreduce.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp

N, K = 200, 10


def _grads(steps, seed=0):
    rng = np.random.default_rng(seed)
    # Distinct magnitudes: numpy's top-k and lax.top_k pick the same set.
    return [rng.permutation(np.arange(1, N + 1)).astype(np.float32) * rng.choice([-1, 1], N)
            / 64 for _ in range(steps)]  # fmt: skip


def _reference(grads, beta):
    r = np.zeros(N, np.float32)
    out = []
    for g in grads:
        acc = r + g
        top = np.argsort(-np.abs(acc), kind="stable")[:K]
        sent = np.zeros(N, np.float32)
        sent[top] = acc[top]
        plain = np.where(sent != 0, np.float32(0), acc)
        r = r + np.float32(beta) * (plain - r)
        out.append((sent, r))
    return out


@pytest.mark.parametrize("beta", [0.25, 0.5])
def test_low_pass_matches_numpy(beta):
    tx = jaxcomp.top_k(K / N, low_pass=beta)
    grads = _grads(5)
    state = tx.init({"w": grads[0]})
    step = jax.jit(tx.update)
    for g, (sent, res) in zip(grads, _reference(grads, beta), strict=True):
        u, state = step({"w": jnp.asarray(g)}, state)
        np.testing.assert_array_equal(np.asarray(u["w"]), sent)
        np.testing.assert_allclose(np.asarray(state.residual["w"]), res, rtol=1e-6, atol=1e-7)
    # Lossy by design: after the first step the residual holds beta of plain error feedback's.
    plain = _reference(grads, 1.0)
    assert not np.allclose(np.asarray(state.residual["w"]), plain[-1][1])


def test_low_pass_one_is_plain_error_feedback_bit_for_bit():
    grads = _grads(4, seed=1)
    runs = []
    for tx in (jaxcomp.ldte_bs(0.05), jaxcomp.ldte_bs(0.05, low_pass=1.0)):
        state = tx.init({"w": grads[0]})
        for g in grads:
            u, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state)
        runs.append((np.asarray(u["w"]), np.asarray(state.residual["w"])))
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("beta", [0.3, jnp.float32(0.3)])
def test_skipped_step_keeps_the_filtered_residual(beta):
    tx = jaxcomp.top_k(K / N, low_pass=beta)
    grads = _grads(2, seed=2)
    state = tx.init({"w": grads[0]})
    _, state = tx.update({"w": jnp.asarray(grads[0])}, state)
    before = np.asarray(state.residual["w"]).copy()
    bad = grads[1].copy()
    bad[7] = np.nan
    u, state = tx.update({"w": jnp.asarray(bad)}, state)
    assert not np.any(np.asarray(u["w"]))
    np.testing.assert_array_equal(np.asarray(state.residual["w"]).view(np.uint32),
                                  before.view(np.uint32))  # fmt: skip
    assert int(state.nonfinite_steps) == 1


def _one_step_from_the_same_state(make, grads, beta):
    """Plain error feedback for all but the last gradient, then one step of each."""
    plain, filtered = make(), make(low_pass=beta)
    state = plain.init(grads[0])
    for g in grads[:-1]:
        _, state = jax.jit(plain.update)(g, state)
    _, s_plain = jax.jit(plain.update)(grads[-1], state)
    _, s_filt = jax.jit(filtered.update)(grads[-1], state)
    return state, s_plain, s_filt


def _assert_filtered(before, plain, filtered, beta):
    for r, p, f in zip(*map(jax.tree.leaves, (before, plain, filtered)), strict=True):
        r, p = np.asarray(r, np.float64), np.asarray(p, np.float64)
        # XLA:CPU may fuse r + beta * d into one multiply-add: a rounding apart.
        np.testing.assert_allclose(np.asarray(f), r + beta * (p - r), rtol=1e-6, atol=1e-6)


def test_momentum_velocity_untouched_residual_filtered():
    rng = np.random.default_rng(4)
    grads = [{"w": jnp.asarray(rng.laplace(size=N), jnp.float32)} for _ in range(4)]
    make = lambda **kw: jaxcomp.top_k(K / N, momentum=0.9, **kw)  # noqa: E731
    before, s_plain, s_filt = _one_step_from_the_same_state(make, grads, 0.25)
    _assert_filtered(before.residual, s_plain.residual, s_filt.residual, 0.25)
    v_plain, v_filt = np.asarray(s_plain.velocity["w"]), np.asarray(s_filt.velocity["w"])
    assert np.any(v_plain)
    np.testing.assert_array_equal(v_filt.view(np.uint32), v_plain.view(np.uint32))


@pytest.mark.parametrize("layout", [dict(granularity="global"), dict(groups=[["['a']", "['b']"]])])
def test_mixed_dtype_group_filters_the_leaf_rounding_too(layout):
    """A bfloat16 and a float32 leaf in one group travel as float32; the bf16
    leaf's share is rounded to bf16 and that rounding joins its residual:
    filtered like the rest (as for the bf16 leaf compressed alone)."""
    rng = np.random.default_rng(5)
    grads = [
        {
            "a": jnp.asarray(rng.laplace(size=300), jnp.bfloat16),
            "b": jnp.asarray(rng.laplace(size=200), jnp.float32),
        }
        for _ in range(3)
    ]
    make = lambda **kw: jaxcomp.top_k(0.1, **layout, **kw)  # noqa: E731
    before, s_plain, s_filt = _one_step_from_the_same_state(make, grads, 0.25)
    _assert_filtered(before.residual, s_plain.residual, s_filt.residual, 0.25)


def test_injected_low_pass_of_one_loses_nothing():
    """Under ``inject_hyperparams`` beta is traced (the filter cannot be
    skipped at trace time); at 1 the residual is plain error feedback's bit
    for bit. ``r + (r_new - r)`` would not be here: random-k sends elements
    smaller than their old residual, and their bfloat16 wire rounding is
    tiny next to it."""
    import optax  # noqa: PLC0415

    rng = np.random.default_rng(0)
    grads = [{"w": jnp.asarray(rng.standard_normal(4000), jnp.bfloat16)} for _ in range(4)]
    injected = optax.inject_hyperparams(
        jaxcomp.random_k, static_args=("ratio",), hyperparam_dtype=jnp.float32
    )(ratio=0.05, low_pass=1.0, momentum=0.9)
    plain = jaxcomp.random_k(0.05, momentum=0.9)
    s_inj, s_plain = injected.init(grads[0]), plain.init(grads[0])
    for g in grads:
        _, s_inj = jax.jit(injected.update)(g, s_inj)
        r_before = np.asarray(s_plain.residual["w"])
        _, s_plain = jax.jit(plain.update)(g, s_plain)
    r_inj = np.asarray(s_inj.inner_state.residual["w"])
    r_plain = np.asarray(s_plain.residual["w"])
    np.testing.assert_array_equal(r_inj.view(np.uint32), r_plain.view(np.uint32))
    # Not vacuous: the unguarded formula rounds somewhere on this step.
    assert np.any(r_before + (r_plain - r_before) != r_plain)


@pytest.mark.parametrize("momentum", [None, 0.9])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_filter_within_a_rounding_of_the_accumulator(momentum, dtype):
    """The old residual is recomputed as ``acc - increment`` (no copy of it):
    against the formula in float64, every element is within 1.5 ulps of
    ``max(|acc|, |r|)``, on gradients spanning four decades."""
    rng = np.random.default_rng(6)
    size = 20000
    grads = [
        {"w": jnp.asarray(rng.laplace(size=size) * 10 ** rng.uniform(-3, 1, size), dtype)}
        for _ in range(4)
    ]
    make = lambda **kw: jaxcomp.top_k(0.01, momentum=momentum, **kw)  # noqa: E731
    before, s_plain, s_filt = _one_step_from_the_same_state(make, grads, 0.3)
    r = np.asarray(before.residual["w"], np.float32)
    g = np.asarray(grads[-1]["w"], np.float32)
    u = g if momentum is None else np.float32(momentum) * np.asarray(before.velocity["w"]) + g
    acc = r + u
    exact = r.astype(np.float64) + 0.3 * (np.asarray(s_plain.residual["w"], np.float64) - r)
    err = np.abs(np.asarray(s_filt.residual["w"], np.float64) - exact)
    assert np.all(err <= 1.5 * np.spacing(np.maximum(np.abs(acc), np.abs(r))))
    assert np.any(np.asarray(s_plain.residual["w"]) != r)  # the step changed something
