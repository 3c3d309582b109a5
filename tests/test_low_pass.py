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


def test_injected_low_pass_of_one_loses_nothing():
    """Under ``inject_hyperparams`` beta is traced (the filter cannot be
    skipped at trace time); at 1 the residual is plain error feedback's bit
    for bit, bfloat16 gradients (a wire rounding kept in the residual) included."""
    import optax  # noqa: PLC0415

    rng = np.random.default_rng(3)
    small = rng.uniform(-1.0, 1.0, N)
    big = np.where(np.arange(N) < 3 * K, rng.uniform(50.0, 100.0, N), 0.0)  # sent on step 2
    for dtype in (jnp.float32, jnp.bfloat16):
        grads = [{"w": jnp.asarray(g, dtype)} for g in (small, big + small, small / 3)]
        injected = optax.inject_hyperparams(jaxcomp.top_k, static_args=("ratio",))(
            ratio=3 * K / N, low_pass=1.0
        )
        plain = jaxcomp.top_k(3 * K / N)
        s_inj, s_plain = injected.init(grads[0]), plain.init(grads[0])
        for g in grads:
            _, s_inj = jax.jit(injected.update)(g, s_inj)
            _, s_plain = jax.jit(plain.update)(g, s_plain)
        r_inj = np.asarray(s_inj.inner_state.residual["w"])
        r_plain = np.asarray(s_plain.residual["w"])
        assert r_plain.dtype == np.float32 and np.any(r_plain)
        np.testing.assert_array_equal(r_inj.view(np.uint32), r_plain.view(np.uint32))
