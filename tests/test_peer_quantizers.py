"""TernGrad, natural compression/dithering, Signum with majority vote and 16-bit casts.

Each method's own property against an independent reference: the exact
expectation and variance of the randomized codecs (numpy, float64), the
majority vote and Signum's momentum (numpy, on 8 devices), and the casts'
rounding and accumulation (numpy with ``ml_dtypes``' bfloat16/float16). The
shared conformance suite (``tests/test_conformance.py``) runs them too.

Statistical checks use fixed seeds (deterministic) and ``T`` vmapped draws:
per coordinate ``|mean - E| <= 5 sqrt(Var / T)`` with the exact ``Var``, and
exact equality where ``Var = 0``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import bits, majority_vote
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.quantization import (
    cast_quantizer,
    message_nbytes,
    natural_dithering_quantizer,
    natural_quantizer,
    qsgd_quantizer,
    sign_quantizer,
    terngrad_quantizer,
    unpack_codes,
)
from jaxcomp.transforms.quantize import quantize

T = 4000
N_DEV = 8


def _draws(quantizer, v, n_draws=T, seed=0):
    """``n_draws`` decoded messages of ``v`` with independent keys (float64 ``[n_draws, n]``)."""
    keys = jax.random.split(jax.random.key(seed), n_draws)
    n = v.shape[0]
    f = jax.jit(jax.vmap(lambda k, x: quantizer.decode(*quantizer.encode(x, k), n), (0, None)))
    return np.asarray(f(keys, jnp.asarray(v)), np.float64)


def _check_unbiased(draws, expected, var):
    """Mean of the draws within 5 standard errors of ``expected``; exact where ``var == 0``."""
    mean = draws.mean(axis=0)
    tol = 5 * np.sqrt(var / draws.shape[0])
    assert np.all(np.abs(mean - expected) <= tol), np.max(np.abs(mean - expected) - tol)
    fixed = var == 0
    assert np.all(draws[:, fixed] == expected[fixed])


def _buckets(x, d):
    d = x.shape[0] if d is None else d
    return [(i, x[i : i + d]) for i in range(0, x.shape[0], d)]


# ---------------------------------------------------------------------------
# TernGrad.
# ---------------------------------------------------------------------------


def _terngrad_reference(v, d, clip):
    """Per coordinate: the clipped value (the expectation) and the scale, in float64."""
    v = np.asarray(v, np.float64)
    expected, scale = np.empty_like(v), np.empty_like(v)
    for i, b in _buckets(v, d):
        if clip is not None:
            t = clip * np.std(b)  # population std, as the paper's sigma
            b = np.clip(b, -t, t)
        expected[i : i + len(b)] = b
        scale[i : i + len(b)] = np.max(np.abs(b))
    return expected, scale


@pytest.mark.parametrize("d,clip", [(None, None), (16, None), (None, 2.5)])
def test_terngrad_unbiased_ternary_and_clipped(d, clip):
    rng = np.random.default_rng(0)
    v = rng.laplace(size=50).astype(np.float32)
    v[7] = 0.0
    v[20] = 9.0  # an outlier, clipped with clip=2.5
    q = terngrad_quantizer(d, clip)
    draws = _draws(q, v)
    expected, s = _terngrad_reference(v, d, clip)
    # Every value is one of {-s, 0, s}, with the sign of v.
    assert np.all((draws == 0) | np.isclose(np.abs(draws), s, rtol=1e-6, atol=0))
    assert np.all(draws * np.sign(v) >= 0)
    # E = the (clipped) value; Var = s |v| - v^2 (Bernoulli(|v| / s) times s).
    var = np.maximum(s * np.abs(expected) - expected**2, 0)
    var[np.isclose(np.abs(expected), s, rtol=1e-6)] = 0  # the max: always s
    expected_f32 = np.where(var == 0, draws[0], expected)  # exact values in float32
    _check_unbiased(draws, expected_f32, var)
    if clip is not None:  # the outlier was clipped to 2.5 sigma, the new max
        t = clip * np.std(v.astype(np.float64))
        assert t < 9.0 and np.isclose(np.max(np.abs(draws)), t, rtol=1e-5)


def test_terngrad_two_bits_packed():
    n = 1000
    v = np.random.default_rng(1).standard_normal(n).astype(np.float32)
    for d in (None, 64):
        q = terngrad_quantizer(d)
        nb = 1 if d is None else math.ceil(n / d)
        assert message_nbytes(q, n) == math.ceil(2 * n / 8) + 4 * nb
        codes, scales = q.encode(jnp.asarray(v), jax.random.key(3))
        decoded = np.asarray(q.decode(codes, scales, n))
        code = np.asarray(unpack_codes(np.asarray(codes), 2, n))
        # bit 0: level, bit 1: sign (QSGD's layout for s = 1), against the decoded values.
        np.testing.assert_array_equal(code & 1, decoded != 0)
        np.testing.assert_array_equal(code >> 1, decoded < 0)


# ---------------------------------------------------------------------------
# Natural compression and natural dithering.
# ---------------------------------------------------------------------------


def _pow2_neighbours(a):
    """The powers of two ``lo <= |a| < hi = 2 lo`` (float64)."""
    m, e = np.frexp(np.abs(a))  # |a| = m 2^e, m in [0.5, 1)
    lo = np.ldexp(1.0, e - 1)
    return lo, 2 * lo


def test_natural_compression_unbiased_powers_of_two():
    rng = np.random.default_rng(2)
    v = np.concatenate(
        [
            rng.laplace(size=24) * 10.0 ** rng.integers(-30, 30, 24),  # every order of magnitude
            [0.0, -0.0, 1.0, -0.25, 2.0**-126, 3.0, -3.0, 1e-40, -5e-39],  # exact, subnormal
        ]
    ).astype(np.float32)
    draws = _draws(natural_quantizer(), v)
    x = v.astype(np.float64)
    lo, hi = _pow2_neighbours(x)
    sub = np.abs(x) < 2.0**-126  # subnormal: between 0 and 2^-126
    lo[sub], hi[sub] = 0.0, 2.0**-126
    lo[x == 0], hi[x == 0] = 0.0, 0.0
    # Values: exactly +-lo or +-hi, sign kept; zeros stay zero.
    mag = np.abs(draws)
    assert np.all((mag == lo) | (mag == hi))
    assert np.all((draws == 0) | (np.signbit(draws) == np.signbit(x)))
    assert np.all(draws[:, x == 0] == 0)
    nonzero = mag[mag > 0]
    assert np.all(np.frexp(nonzero)[0] == 0.5)  # powers of two
    # E = x; Var = (hi - |x|)(|x| - lo); powers of two are exact.
    var = (hi - np.abs(x)) * (np.abs(x) - lo)
    _check_unbiased(draws, x, var)
    assert np.all(var[~sub] <= x[~sub] ** 2 / 8)  # the paper's bound (normal floats)


def test_natural_compression_nine_bits_and_huge_values():
    n = 777
    rng = np.random.default_rng(3)
    v = (rng.standard_normal(n) * 10.0 ** rng.integers(-20, 20, n)).astype(np.float32)
    v[:3] = [3e38, -(2.0**127), 0.0]
    q = natural_quantizer()
    assert message_nbytes(q, n) == math.ceil(9 * n / 8) + 4
    codes, scales = q.encode(jnp.asarray(v), jax.random.key(0))
    decoded = np.asarray(q.decode(codes, scales, n))
    assert decoded[0] == 2.0**127 and decoded[1] == -(2.0**127)  # never inf: rounds down
    code = np.asarray(unpack_codes(np.asarray(codes), 9, n))
    # The 9 bits are the decoded float32's sign bit and biased exponent.
    raw = decoded.view(np.uint32)
    np.testing.assert_array_equal(code & 0xFF, (raw >> 23) & 0xFF)
    np.testing.assert_array_equal(code >> 8, raw >> 31)
    assert not np.any(raw & 0x7FFFFF)  # no mantissa: powers of two


@pytest.mark.parametrize("s,d,norm", [(3, None, "l2"), (5, 16, "max")])
def test_natural_dithering_unbiased_on_its_levels(s, d, norm):
    rng = np.random.default_rng(4)
    v = rng.laplace(size=40).astype(np.float32)
    v[5] = 0.0
    draws = _draws(natural_dithering_quantizer(s, d, norm), v)
    x = v.astype(np.float64)
    expected, var, scale = np.empty_like(x), np.empty_like(x), np.empty_like(x)
    for i, b in _buckets(x, d):
        sc = np.linalg.norm(b) if norm == "l2" else np.max(np.abs(b))
        a = np.abs(b) / sc
        lo, hi = _pow2_neighbours(a)
        small = a < 2.0 ** (1 - s)
        lo[small], hi[small] = 0.0, 2.0 ** (1 - s)
        lo[a == 0], hi[a == 0] = 0.0, 0.0
        sl = slice(i, i + len(b))
        expected[sl], var[sl], scale[sl] = b, sc**2 * (hi - a) * (a - lo), sc
    levels = np.concatenate([[0.0], 2.0 ** -np.arange(s, dtype=np.float64)])
    rel = np.abs(draws) / scale
    assert np.all(np.min(np.abs(rel[..., None] - levels), axis=-1) <= 1e-6)
    expected_f32 = np.where(var == 0, draws[0], expected)  # norm="max": the max is exact
    _check_unbiased(draws, expected_f32, var)


# ---------------------------------------------------------------------------
# Majority vote and Signum on 8 devices.
# ---------------------------------------------------------------------------


def _mesh_fn(tx):
    """jit(shard_map(tx.update)) over per-device rows of (grads, state[, include])."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))

    def step(g, s, inc):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s, include=None if inc is None else inc[0])
        return jax.tree.map(lambda x: x[None], (u, s))

    spec = (P("data"), P("data"))

    @jax.jit
    def f(g, s, inc):
        in_specs = spec + (None if inc is None else P("data"),)
        return jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=spec)(g, s, inc)

    def run(g, s, include=None):
        put = lambda t: None if t is None else jax.device_put(t, sharding)  # noqa: E731
        out = f(put(g), put(s), put(include))
        return jax.device_get(jax.block_until_ready(out))

    return run


def _stack_init(tx, like):
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * N_DEV), tx.init(like))


def _np_signs(x, d):
    """Unit sign codec in numpy: +-1 (zero as +), 0 for an all-zero bucket."""
    out = np.where(x < 0, -1.0, 1.0)
    for i, b in _buckets(x, d):
        if not np.any(b):
            out[i : i + len(b)] = 0.0
    return out


def _np_scaled_signs(x, d):
    """sign_sgd's codec in numpy: ||b||_1 / len(b) * sign, zero as +."""
    out = np.empty_like(x, dtype=np.float64)
    for i, b in _buckets(x, d):
        out[i : i + len(b)] = np.abs(b).astype(np.float64).mean() * np.where(b < 0, -1.0, 1.0)
    return out


def _vote_grads(rng, n):
    """Per-device gradients with exact ties in the first 8 coordinates (4 for, 4 against)."""
    g = rng.laplace(size=(N_DEV, n)).astype(np.float32)
    g[:, :8] = np.abs(g[:, :8]) * np.array([1, -1] * 4, np.float32)[:, None]
    g[:, 8:16] = np.abs(g[:, 8:16])  # unanimous
    g[: N_DEV // 2 + 1, 16:24] = -np.abs(g[: N_DEV // 2 + 1, 16:24])  # 5 against 3
    g[:, 40:48] = 0.0  # zeros vote + in a live bucket
    return g


@pytest.mark.parametrize("scaled", [False, True], ids=["signsgd", "sign_sgd_scaled"])
def test_majority_vote_matches_numpy_with_ties_and_abstention(scaled):
    n, d = 100, 32
    if scaled:  # scaled signs: the majority sign at the voters' mean scale
        tx = jaxcomp.sign_sgd(bucket_size=d, axis_name="data", exchange="majority")
        codec = _np_scaled_signs
    else:  # Signum with momentum 0: signSGD with majority vote
        tx = jaxcomp.signum(0.0, bucket_size=d, axis_name="data")
        codec = _np_signs
    run = _mesh_fn(tx)
    rng = np.random.default_rng(5)
    g = _vote_grads(rng, n)
    g[:, 64:96] = 0.0  # one whole bucket of zeros: every device abstains there
    state = _stack_init(tx, {"w": jnp.zeros(n)})
    upd, state = run({"w": g}, state)
    per_dev = np.stack([codec(g[i], d) for i in range(N_DEV)])
    expected = majority_vote(per_dev)
    u = np.asarray(upd["w"])
    assert all(bits(u[i]) == bits(u[0]) for i in range(N_DEV))
    np.testing.assert_allclose(u[0], expected, rtol=1e-5, atol=0)
    assert np.all(u[0, :8] == 0)  # ties
    assert np.all(u[0, 64:96] == 0)  # abstained
    assert np.all(u[0, 16:24] < 0) and np.all(u[0, 8:16] > 0)
    if not scaled:
        assert set(np.unique(u[0])) <= {-1.0, 0.0, 1.0}
    # 1 bit per value + one float32 per bucket, all-gathered.
    assert float(state.wire_bytes[0]) == (N_DEV - 1) * (math.ceil(n / 8) + 4 * math.ceil(n / d))
    # A device whose gradient is not finite sends nothing: it abstains (7 voters).
    g2 = _vote_grads(rng, n)
    g2[3, 50] = np.nan
    upd2, _ = run({"w": g2}, state)
    voters = [i for i in range(N_DEV) if i != 3]
    expected2 = majority_vote(np.stack([codec(g2[i], d) for i in voters]))
    np.testing.assert_allclose(np.asarray(upd2["w"])[0], expected2, rtol=1e-5, atol=0)


def test_signum_momentum_matches_numpy_on_8_devices():
    b, n, steps = 0.9, 300, 4
    tx = jaxcomp.signum(b, axis_name="data")
    run = _mesh_fn(tx)
    rng = np.random.default_rng(6)
    state = _stack_init(tx, {"w": jnp.zeros(n)})
    v_ref = np.zeros((N_DEV, n), np.float64)
    for _ in range(steps):
        g = rng.laplace(size=(N_DEV, n)).astype(np.float32)
        upd, new = run({"w": g}, state)
        v_old = np.asarray(state.velocity["w"])
        v_new = np.asarray(new.velocity["w"])
        # The paper's v = b v + (1 - b) g in float32 (either rounding of a fused multiply-add).
        two = np.float32(b) * v_old + np.float32(1 - b) * g
        np.testing.assert_allclose(v_new, two, rtol=2e-6, atol=1e-7)
        v_ref = b * v_ref + (1 - b) * g.astype(np.float64)  # independent float64 trajectory
        np.testing.assert_allclose(v_new, v_ref, rtol=1e-4, atol=1e-6)
        expected = majority_vote(np.where(v_new < 0, -1.0, 1.0))
        u = np.asarray(upd["w"])
        np.testing.assert_array_equal(u[0], expected)
        assert all(bits(u[i]) == bits(u[0]) for i in range(N_DEV))
        state = new
    assert new.residual is None  # no error feedback, as the paper's Signum


def test_signum_single_device_is_sign_of_momentum_and_zero_allocates_nothing():
    g1, g2 = jnp.array([1.0, -2.0, 0.5, 0.0]), jnp.array([-3.0, 1.0, 0.25, 0.0])
    tx = jaxcomp.signum(0.5)
    s = tx.init({"w": g1})
    _, s = tx.update({"w": g1}, s)
    u, s = tx.update({"w": g2}, s)
    v = 0.5 * (0.5 * np.asarray(g1)) + 0.5 * np.asarray(g2)  # v0 = 0
    np.testing.assert_array_equal(np.asarray(s.velocity["w"]), v.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(u["w"]), np.where(v < 0, -1.0, 1.0))
    tx0 = jaxcomp.signum(0.0)
    s0 = tx0.init({"w": g1})
    assert s0.velocity is None and s0.residual is None
    u0, _ = tx0.update({"w": g2}, s0)
    np.testing.assert_array_equal(np.asarray(u0["w"]), [-1.0, 1.0, 1.0, 1.0])
    u_zero, _ = tx0.update({"w": jnp.zeros(4)}, s0)
    assert not np.any(np.asarray(u_zero["w"]))  # an all-zero leaf abstains: no drift


def test_signum_momentum_injected_and_with_error_feedback():
    g1, g2 = jnp.array([1.0, -2.0, 3.0, -0.5]), jnp.array([-1.0, 1.0, -1.0, 4.0])
    # optax.inject_hyperparams: momentum lives in the state; bit-equal to the plain factory.
    tx = optax.inject_hyperparams(jaxcomp.signum)(momentum=0.9)
    plain = jaxcomp.signum(0.9)
    s, sp = tx.init({"w": g1}), plain.init({"w": g1})
    f = jax.jit(tx.update)
    for g in (g1, g2):
        (u, s), (up, sp) = f({"w": g}, s), plain.update({"w": g}, sp)
        assert bits(u["w"]) == bits(up["w"])
        assert bits(s.inner_state.velocity["w"]) == bits(sp.velocity["w"])
    s.hyperparams["momentum"] = jnp.asarray(0.0, jnp.float32)  # now signSGD: v = g
    u, s = f({"w": g1}, s)
    np.testing.assert_array_equal(np.asarray(s.inner_state.velocity["w"]), np.asarray(g1))
    np.testing.assert_array_equal(np.asarray(u["w"]), np.sign(np.asarray(g1)))
    # With error feedback the residual keeps (e + v) - sign(e + v), bit for bit.
    tx_ef = jaxcomp.signum(0.5, error_feedback=True)
    s = tx_ef.init({"w": g1})
    for g in (g1, g2):
        v = 0.5 * np.asarray(s.velocity["w"]) + 0.5 * np.asarray(g)
        acc = np.asarray(s.residual["w"]) + v.astype(np.float32)
        u, s = tx_ef.update({"w": g}, s)
        np.testing.assert_array_equal(np.asarray(u["w"]), np.where(acc < 0, -1.0, 1.0))
        np.testing.assert_array_equal(np.asarray(s.residual["w"]), acc - np.asarray(u["w"]))


# ---------------------------------------------------------------------------
# 16-bit casts.
# ---------------------------------------------------------------------------

NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_cast_error_feedback_keeps_every_rounding_bit_exact(dtype, grad_dtype):
    np_dt = NP_DTYPES[dtype]
    tx = jaxcomp.cast(getattr(jnp, dtype), error_feedback=True)
    f = jax.jit(tx.update)
    rng = np.random.default_rng(7)
    shape = (30, 7)
    state = tx.init({"w": jnp.zeros(shape, grad_dtype)})
    for _ in range(4):
        g = jnp.asarray(rng.laplace(size=shape) * 10.0 ** rng.integers(-3, 3, shape)).astype(
            grad_dtype
        )
        upd, new = f({"w": g}, state)
        acc = np.asarray(state.residual["w"]) + np.asarray(g).astype(np.float32)
        sent = np.asarray(upd["w"]).astype(np.float32)
        res = np.asarray(new.residual["w"])
        assert np.array_equal(sent + res, acc)  # nothing lost, bit for bit
        if grad_dtype == "float32":  # the message is numpy's round-to-nearest cast
            assert np.array_equal(sent, acc.astype(np_dt).astype(np.float32))
        state = new


def test_cast_float16_overflow_never_inf():
    g = {
        "w": np.array([1e5, -7e4, 65519.0, 1.0, 1e-3], np.float32),  # scaled by 4
        "huge": np.array([3e38, -3.4028235e38, 1.0], np.float32),  # by 2^113: 1.0 -> 0
    }
    for ef in (True, False):
        tx = jaxcomp.cast(jnp.float16, error_feedback=ef)
        upd, state = tx.update(g, tx.init(g))
        u = {k: np.asarray(v) for k, v in upd.items()}
        assert all(np.all(np.isfinite(v)) for v in u.values())
        # Scaled by a power of two: float16's relative rounding (2^-11), no inf.
        np.testing.assert_allclose(u["w"], g["w"], rtol=2.0**-11)
        np.testing.assert_allclose(u["huge"][:2], g["huge"][:2], rtol=2.0**-11)
        assert u["huge"][2] == 0.0  # below the scaled range: documented
        if ef:  # every rounding stays in the residual, bit for bit
            for k in g:
                res = np.asarray(state.residual[k])
                assert np.all(np.isfinite(res)) and np.array_equal(u[k] + res, g[k])
    # Without overflow the message is the plain cast (scale 1).
    plain = g["w"][2:]  # 65519 rounds to 65504, the largest float16
    codes, scales = cast_quantizer(jnp.float16).encode(jnp.asarray(plain), None)
    assert float(scales[0, 0]) == 1.0
    np.testing.assert_array_equal(np.asarray(codes).view(np.float16), plain.astype(np.float16))


@pytest.mark.parametrize("acc", ["float32", "bfloat16"])
def test_cast_bf16_messages_accumulated_as_asked(acc):
    n = 512
    tx = jaxcomp.cast(jnp.bfloat16, accumulation_dtype=getattr(jnp, acc), axis_name="data")
    run = _mesh_fn(tx)
    rng = np.random.default_rng(8)
    # Magnitudes spread over 2^-8..2^8 so that a bfloat16 sum visibly rounds.
    g = (rng.standard_normal((N_DEV, n)) * 2.0 ** rng.integers(-8, 8, (N_DEV, n))).astype(
        np.float32
    )
    upd, state = run({"w": g}, _stack_init(tx, {"w": jnp.zeros(n)}))
    u = np.asarray(upd["w"])[0].astype(np.float64)
    msgs = g.astype(ml_dtypes.bfloat16)  # what each device sends
    exact = msgs.astype(np.float64).sum(axis=0) / N_DEV
    seq = msgs[0] / ml_dtypes.bfloat16(N_DEV)  # bfloat16 partial sums, device order
    for m in msgs[1:]:
        seq = seq + m / ml_dtypes.bfloat16(N_DEV)
    # float32 summation error: at most N eps32 sum|m| / N (any order).
    bound32 = N_DEV * 2.0**-24 * np.abs(msgs.astype(np.float64)).sum(axis=0) / N_DEV
    if acc == "float32":
        assert np.all(np.abs(u - exact) <= bound32)
        # A bfloat16 accumulation would miss that bound (the test tells them apart).
        assert np.mean(np.abs(seq.astype(np.float64) - exact) > bound32) > 0.3
    else:
        np.testing.assert_array_equal(u, seq.astype(np.float64))
    assert float(state.wire_bytes[0]) == (N_DEV - 1) * (2 * n + 4)


def test_cast_allreduce_is_the_rounded_mean_at_ring_bytes():
    n = 1001  # not a multiple of 8: the last chunk is padded
    c = math.ceil(n / N_DEV)
    tx = jaxcomp.cast(jnp.bfloat16, error_feedback=True, axis_name="data", exchange="allreduce")
    run = _mesh_fn(tx)
    rng = np.random.default_rng(9)
    g = rng.standard_normal((N_DEV, n)).astype(np.float32)
    upd, state = run({"w": g}, _stack_init(tx, {"w": jnp.zeros(n)}))
    msgs = g.astype(ml_dtypes.bfloat16).astype(np.float64)
    # Each device sends its cast chunks (nothing lost: the residual keeps the rounding) ...
    res = np.asarray(state.residual["w"])
    assert np.array_equal(msgs.astype(np.float32) + res, g)
    # ... and the update is the float32 mean of the messages, rounded to bfloat16 once.
    u = np.asarray(upd["w"])
    assert all(bits(u[i]) == bits(u[0]) for i in range(N_DEV))
    exact = msgs.mean(axis=0)
    assert np.array_equal(u[0], u[0].astype(ml_dtypes.bfloat16).astype(np.float32))
    half_ulp = np.spacing(np.abs(exact).astype(ml_dtypes.bfloat16)).astype(np.float64) / 2
    bound32 = 2.0**-24 * np.abs(msgs).sum(axis=0)
    assert np.all(np.abs(u[0] - exact) <= half_ulp + bound32)
    # 8 chunk messages per device (2 c bytes + a float32 scale each); 2 (N - 1) on the wire.
    assert int(state.message_bytes["w"][0]) == N_DEV * (2 * c + 4)
    assert float(state.wire_bytes[0]) == 2 * (N_DEV - 1) * (2 * c + 4)
    # A left-out backup worker sends zeros; the mean is over the 7 others.
    include = np.ones(N_DEV, bool)
    include[5] = False
    upd2, _ = run({"w": g}, _stack_init(tx, {"w": jnp.zeros(n)}), include)
    exact7 = np.delete(msgs, 5, axis=0).mean(axis=0)
    bound7 = 2.0**-24 * np.abs(msgs).sum(axis=0)
    half_ulp7 = np.spacing(np.abs(exact7).astype(ml_dtypes.bfloat16)).astype(np.float64) / 2
    assert np.all(np.abs(np.asarray(upd2["w"])[0] - exact7) <= half_ulp7 + bound7)


def test_allreduce_exchange_with_scaled_signs_matches_numpy():
    """The generic compressed all-reduce on another codec: per-chunk messages, re-encoded mean."""
    n, d = 250, 10
    c = math.ceil(n / N_DEV)  # 32: chunks hold 4 buckets of 10 and one of 2
    tx = jaxcomp.sign_sgd(bucket_size=d, axis_name="data", exchange="allreduce")
    run = _mesh_fn(tx)
    g = np.random.default_rng(10).laplace(size=(N_DEV, n)).astype(np.float32)
    upd, _ = run({"w": g}, _stack_init(tx, {"w": jnp.zeros(n)}))

    def chunked(x):  # each zero-padded chunk is its own message (the padding counts in l1 / d)
        x = np.pad(x, (0, N_DEV * c - len(x)))
        return np.concatenate([_np_scaled_signs(x[j * c : (j + 1) * c], d) for j in range(N_DEV)])

    mean = np.mean([chunked(g[i]) for i in range(N_DEV)], axis=0)  # padded length N c
    expected = chunked(mean)[:n]  # the mean chunks re-encoded
    np.testing.assert_allclose(np.asarray(upd["w"])[0], expected, rtol=1e-5)


# ---------------------------------------------------------------------------
# Arguments.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: jaxcomp.terngrad(clip=0.0), "clip"),
        (lambda: jaxcomp.terngrad(clip=-2.5), "clip"),
        (lambda: jaxcomp.terngrad(bucket_size=0), "bucket_size"),
        (lambda: jaxcomp.natural_compression(levels=0), "levels"),
        (lambda: jaxcomp.natural_compression(levels=127), "levels"),
        (lambda: jaxcomp.natural_compression(bucket_size=8), "bucket_size"),
        (lambda: jaxcomp.natural_compression(levels=3, norm="l1"), "norm"),
        (lambda: jaxcomp.signum(1.0), "beta"),
        (lambda: jaxcomp.signum(-0.1), "beta"),
        (lambda: jaxcomp.signum(exchange="mean"), "exchange"),
        (lambda: jaxcomp.cast(jnp.float32), "dtype"),
        (lambda: jaxcomp.cast(jnp.int16), "dtype"),
        (lambda: jaxcomp.cast(accumulation_dtype=jnp.int32), "accumulation_dtype"),
        (lambda: jaxcomp.cast(accumulation_dtype=None), "accumulation_dtype"),
        (lambda: quantize(qsgd_quantizer(4), exchange="majority"), "exchange"),
        (lambda: jaxcomp.terngrad(exchange="majority"), "exchange"),
        (lambda: sign_quantizer(scale="l3"), "scale"),
        (lambda: jaxcomp.cast(exchange="allreduce", keep_message=True), "keep_message"),
    ],
)
def test_bad_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


@pytest.mark.parametrize("bucket_size", [None, 7])
def test_sign_l2_scale_is_the_rms_per_bucket(bucket_size):
    """``scale="l2"`` (DeepSpeed's 1-bit codec): ``sqrt(mean x^2)`` per bucket times sign,
    zeros sent as +, against numpy."""
    rng = np.random.default_rng(21)
    q = sign_quantizer(bucket_size, scale="l2")
    for magnitude in (1.0, 1e-20, 1e20):  # ||x||^2 under- and overflows float32 at the ends
        v = (rng.normal(size=30) * magnitude).astype(np.float32)
        v[4] = 0.0
        codes, scales = q.encode(jnp.asarray(v), jax.random.key(0))
        got = np.asarray(q.decode(codes, scales, v.size), np.float64)
        d = bucket_size or v.size
        want = np.empty(v.size)
        for i in range(0, v.size, d):
            b = v[i : i + d].astype(np.float64)
            want[i : i + d] = np.where(b < 0, -1.0, 1.0) * np.sqrt(np.mean(b * b))
        np.testing.assert_allclose(got, want, rtol=1e-6)
