"""Quantizers: QSGD against the paper's lemmas, the 1-bit family against numpy references.

Statistical tests use fixed seeds (so they are deterministic) and tolerances
stated next to each check: 5 standard errors for means over ``T = 2000``
vmapped draws, 10% for second moments.
"""

from __future__ import annotations

import importlib
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits, f32
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.comm import collectives
from jaxcomp.quantization import (
    bounded_sign_quantizer,
    message_nbytes,
    pack_codes,
    qsgd_bits,
    qsgd_levels,
    qsgd_quantizer,
    sign_quantizer,
    unpack_codes,
)

T = 2000  # draws for the statistical tests


def _draws(quantizer, v, n_draws=T, seed=0):
    """``n_draws`` independent decoded messages of ``v`` (float32 ``[n_draws, n]``)."""
    keys = jax.random.split(jax.random.key(seed), n_draws)
    n = v.shape[0]
    # v is an argument, as a gradient is: a closed-over constant lets XLA fold
    # and reassociate (|v| / m)^2 into |v|^2 / m^2, which overflows at 1e19.
    f = jax.jit(jax.vmap(lambda k, x: quantizer.decode(*quantizer.encode(x, k), n), (0, None)))
    return np.asarray(f(keys, v), np.float64)


def _np_buckets(x, d):
    n = x.shape[0]
    d = n if d is None else min(d, n)
    return [x[i : i + d] for i in range(0, n, d)]


def _qsgd_moments(v, s, d, norm="l2"):
    """Exact per-coordinate variance and P(nonzero) of QSGD, and the bucket scales (float64)."""
    var, nz, scales = [], [], []
    for b in _np_buckets(np.asarray(v, np.float64), d):
        scale = np.linalg.norm(b) if norm == "l2" else np.max(np.abs(b))
        r = np.abs(b) / scale * s if scale > 0 else np.zeros_like(b)
        low = np.floor(r)
        p = r - low
        var.append((scale / s) ** 2 * p * (1 - p))
        nz.append(np.where(low > 0, 1.0, p))
        scales.append(np.full(b.shape, scale))
    return np.concatenate(var), np.concatenate(nz), np.concatenate(scales)


def _gauss(n, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=n).astype(np.float32))


# ---------------------------------------------------------------------------
# QSGD: the paper's lemmas.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "s,d,norm", [(1, None, "l2"), (4, None, "l2"), (7, 128, "l2"), (3, 100, "max")]
)
def test_qsgd_unbiased(s, d, norm):
    v = _gauss(1000, seed=s)
    x = _draws(qsgd_quantizer(s, d, norm), v)
    var, _, scale = _qsgd_moments(v, s, d, norm)
    err = np.abs(x.mean(axis=0) - np.asarray(v, np.float64))
    # 5 standard errors of the mean, plus float32 rounding of scale * level / s.
    tol = 5 * np.sqrt(var / T) + 1e-6 * scale
    assert np.all(err <= tol), np.max(err - tol)


@pytest.mark.parametrize(
    "s,d", [(1, None), (2, None), (16, None), (1, 128), (4, 512), (2**15, None)]
)
def test_qsgd_variance_bound(s, d):
    n = 2048
    v = _gauss(n, seed=7)
    x = _draws(qsgd_quantizer(s, d), v, n_draws=500)
    var, _, _ = _qsgd_moments(v, s, d)
    sq_err = (x - np.asarray(v, np.float64)) ** 2
    for i, b in enumerate(_np_buckets(np.asarray(v, np.float64), d)):
        sl = slice(i * b.shape[0], (i + 1) * b.shape[0]) if d else slice(None)
        nb = b.shape[0]
        bound = min(nb / s**2, math.sqrt(nb) / s) * float(b @ b)
        exact = float(var[sl].sum())
        measured = float(sq_err[:, sl].sum(axis=1).mean())
        assert exact <= bound, (i, exact, bound)
        # 500 draws of a sum of >= 128 independent terms: within 10% (+ float32 floor).
        assert abs(measured - exact) <= 0.1 * exact + 1e-10 * float(b @ b), (i, measured, exact)
        assert measured <= 1.1 * bound


@pytest.mark.parametrize("s", [1, 2, 8])
def test_qsgd_expected_nonzeros(s):
    n = 10_000
    v = _gauss(n, seed=3)
    x = _draws(qsgd_quantizer(s), v, n_draws=500)
    _, nz, _ = _qsgd_moments(v, s, None)
    measured = float(np.count_nonzero(x, axis=1).mean())
    bound = s * (s + math.sqrt(n))
    assert nz.sum() <= bound
    # The count is a sum of independent Bernoullis: 5 standard errors of its mean.
    assert abs(measured - nz.sum()) <= 5 * math.sqrt(nz.sum() / 500) + 1
    assert measured <= bound


def test_qsgd_one_level_sends_norm_or_zero():
    v = _gauss(500, seed=1)
    x = _draws(qsgd_quantizer(1), v, n_draws=50)
    norm = float(np.linalg.norm(np.asarray(v, np.float64)))
    mags = np.unique(np.abs(x))
    assert set(np.round(mags / norm, 5)) <= {0.0, 1.0}
    assert np.all((x == 0) | (np.sign(x) == np.sign(np.asarray(v))))


def test_qsgd_huge_levels_nearly_exact():
    s = 2**15
    v = _gauss(4096, seed=2)
    quantizer = qsgd_quantizer(s, 512)
    codes, scales = quantizer.encode(v, jax.random.key(0))
    assert codes.dtype == jnp.uint8 and codes.size == 4096 * 17 // 8 and scales.shape == (8, 1)
    x = np.asarray(quantizer.decode(codes, scales, 4096), np.float64)
    scale = np.repeat(np.asarray(scales[:, 0], np.float64), 512)
    assert np.all(np.abs(x - np.asarray(v)) <= scale / s * (1 + 1e-5))


def test_qsgd_max_norm_hits_the_max_exactly():
    v = _gauss(300, seed=4)
    x = _draws(qsgd_quantizer(5, norm="max"), v, n_draws=20)
    i = int(np.argmax(np.abs(np.asarray(v))))
    assert np.all(x[:, i] == np.float32(v[i]))
    levels = np.abs(x) / float(np.max(np.abs(np.asarray(v)))) * 5
    np.testing.assert_allclose(levels, np.round(levels), atol=1e-5)


@pytest.mark.parametrize(
    "levels,bits_per",
    [
        (1, 2),
        (2, 3),
        (3, 3),
        (4, 4),
        (7, 4),
        (8, 5),
        (16, 6),
        (127, 8),
        (128, 9),
        (256, 10),
        (2**15, 17),
        (2**31 - 1, 32),
    ],
)
def test_qsgd_wire_format(levels, bits_per):
    # 1 sign bit + ceil(log2(s + 1)) level bits, packed densely: nothing rounded up.
    n, d = 1001, 128
    quantizer = qsgd_quantizer(levels, d)
    assert qsgd_bits(levels) == bits_per == 1 + math.ceil(math.log2(levels + 1))
    codes, scales = quantizer.encode(_gauss(n), jax.random.key(1))
    assert codes.dtype == jnp.uint8 and scales.dtype == jnp.float32
    expected = math.ceil(n * bits_per / 8) + math.ceil(n / d) * 4
    assert message_nbytes(quantizer, n) == expected
    assert codes.size + scales.size * 4 == expected
    # Sign in the top bit (only for nonzero levels), the level below it, never above s.
    raw = np.asarray(unpack_codes(codes, bits_per, n)).astype(np.int64)
    level, sign = raw & ((1 << (bits_per - 1)) - 1), raw >> (bits_per - 1)
    assert level.max() <= levels and not np.any(sign[level == 0])
    x = np.asarray(quantizer.decode(codes, scales, n))
    np.testing.assert_array_equal(sign == 1, x < 0)


def _ref_pack(codes, width):
    """Independent reference: codes as LSB-first '0'/'1' strings, concatenated, 8 per byte."""
    stream = "".join(format(int(c), f"0{width}b")[::-1] for c in codes)
    stream += "0" * (-len(stream) % 8)
    return bytes(int(stream[i : i + 8][::-1], 2) for i in range(0, len(stream), 8))


def _pack_cases():
    rng = np.random.default_rng(0)
    for width in range(1, 33):
        group = 32 // math.gcd(width, 32)  # codes per group of whole uint32 words
        for n in (2 * group + 3, group - 1, 1, 0):  # not multiples of the group
            codes = rng.integers(0, 2**width, size=n, dtype=np.uint64).astype(np.uint32)
            if n > 2:
                codes[:2] = [0, 2**width - 1]
            yield width, codes


def test_pack_every_width_matches_bit_string_reference():
    # The packer is one code for numpy (host) and jax.numpy arrays; every width
    # through numpy here, and a few through XLA below (compiling all 32 is slow).
    for width, codes in _pack_cases():
        packed = pack_codes(codes, width)
        assert packed.dtype == np.uint8 and packed.size == math.ceil(codes.size * width / 8)
        assert packed.tobytes() == _ref_pack(codes, width), (width, codes.size)
        np.testing.assert_array_equal(unpack_codes(packed, width, codes.size), codes)


@pytest.mark.parametrize("width", [1, 6, 13, 32])
def test_pack_under_jit_matches_bit_string_reference(width):
    for w, codes in _pack_cases():
        if w != width or codes.size < 2:
            continue

        def round_trip(c, n=codes.size):
            packed = pack_codes(c, width)
            return packed, unpack_codes(packed, width, n)

        packed, unpacked = jax.jit(round_trip)(jnp.asarray(codes))
        assert np.asarray(packed).tobytes() == _ref_pack(codes, width)
        np.testing.assert_array_equal(np.asarray(unpacked), codes)


def test_qsgd_transform_bf16_deterministic_and_varies_per_step():
    g = {"w": _gauss(3000, seed=5).astype(jnp.bfloat16), "b": jnp.ones((3,), jnp.bfloat16)}

    def run(seed):
        tx = jaxcomp.qsgd(levels=4, bucket_size=256, min_dense_size=10, seed=seed)
        f = jax.jit(tx.update)
        state, outs = tx.init(g), []
        for _ in range(2):
            u, state = f(g, state)
            outs.append(u)
        return outs, state

    a, state = run(0)
    b, _ = run(0)
    c, _ = run(1)
    for leaf in g:
        assert a[0][leaf].dtype == jnp.bfloat16 and a[0][leaf].shape == g[leaf].shape
        assert bits(a[0][leaf]) == bits(b[0][leaf]) and bits(a[1][leaf]) == bits(b[1][leaf])
    assert bits(a[0]["w"]) != bits(a[1]["w"])  # a fresh key each step
    assert bits(a[0]["w"]) != bits(c[0]["w"])  # and per seed
    np.testing.assert_array_equal(f32(a[0]["b"]), 1.0)  # small leaf sent dense
    assert state.residual is None  # no error feedback by default: nothing allocated
    assert int(state.message_bytes["w"]) == 1500 + 12 * 4  # s = 4: 4 bits a coordinate
    assert int(state.message_bytes["b"]) == 6
    # Unbiased through the transform too: bf16 rounding of the message aside.
    g32 = {"w": g["w"].astype(jnp.float32)}
    tx = jaxcomp.qsgd(levels=4, bucket_size=256)
    keys = jnp.arange(400, dtype=jnp.uint32)

    def one(k):
        state = tx.init(g32)._replace(key=jax.random.key_data(jax.random.key(k)))
        return tx.update({"w": g["w"]}, state)[0]["w"].astype(jnp.float32)

    mean = np.asarray(jax.jit(jax.vmap(one))(keys)).mean(axis=0)
    var, _, scale = _qsgd_moments(f32(g["w"]), 4, 256)
    tol = 5 * np.sqrt(var / 400) + 2**-8 * scale / 4
    assert np.all(np.abs(mean - f32(g["w"])) <= tol)


def test_qsgd_float16_saturates_and_keeps_excess():
    # Every element fits in float16 but the L2 norm does not: s = 1 sends +-norm.
    g = {"h": jnp.full((10_000,), 1000.0, jnp.float16)}
    tx = jaxcomp.qsgd(levels=1, min_dense_size=0, error_feedback=True)
    u, state = jax.jit(tx.update)(g, tx.init(g))
    assert np.all(np.isfinite(f32(u["h"]))) and np.all(np.isfinite(state.residual["h"]))
    assert float(np.max(np.abs(f32(u["h"])))) == 65504.0
    acc = f32(g["h"])
    np.testing.assert_array_equal(np.asarray(state.residual["h"]), acc - f32(u["h"]))


# ---------------------------------------------------------------------------
# QSGD: the norm at the edges of float32's range (issue 8, item 10).
# ---------------------------------------------------------------------------


def _edge_vector(n=1024, seed=12):
    """Buckets of 256: huge (|v| ~ 1e19, squares overflow), tiny (squares
    underflow), huge and tiny mixed, and near float32's largest values."""
    g = np.random.default_rng(seed).normal(size=n)
    v = np.concatenate([g[:256] * 1e19, g[256:512] * 1e-25, g[512:768], g[768:] * 1e36])
    v[512:640] *= 1e19
    v[640:768] *= 1e-25
    return v.astype(np.float32)


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_qsgd_scale_exact_for_huge_and_tiny_values(norm):
    v = _edge_vector()
    _, scales = qsgd_quantizer(16, 256, norm).encode(jnp.asarray(v), jax.random.key(0))
    v64 = v.astype(np.float64).reshape(-1, 256)
    ref = np.linalg.norm(v64, axis=1) if norm == "l2" else np.abs(v64).max(axis=1)
    got = np.asarray(scales[:, 0], np.float64)
    assert np.all(np.isfinite(got)), got
    np.testing.assert_allclose(got, ref, rtol=2e-6)


def test_qsgd_unbiased_for_huge_and_tiny_values():
    v = jnp.asarray(_edge_vector(seed=13))
    s, d = 16, 256
    x = _draws(qsgd_quantizer(s, d), v, n_draws=T)
    assert np.all(np.isfinite(x))
    var, _, scale = _qsgd_moments(v, s, d)
    err = np.abs(x.mean(axis=0) - np.asarray(v, np.float64))
    tol = 5 * np.sqrt(var / T) + 1e-6 * scale
    assert np.all(err <= tol), np.max(err / tol)


def test_qsgd_subnormal_bucket_is_finite():
    # XLA:CPU flushes subnormals to zero: such a bucket sends zeros, never NaN.
    v = np.full(512, 1e-40, np.float32)
    v[256:] = np.random.default_rng(0).normal(size=256)
    quantizer = qsgd_quantizer(4, 256)
    x = np.asarray(quantizer.decode(*quantizer.encode(jnp.asarray(v), jax.random.key(0)), 512))
    assert np.all(np.isfinite(x)) and np.all(np.abs(x[:256]) <= 1e-39)


# ---------------------------------------------------------------------------
# No residual without error feedback (issue 8, item 10).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,ef",
    [
        (lambda: jaxcomp.qsgd(levels=4, min_dense_size=10), False),
        (lambda: jaxcomp.sign_sgd(), False),
        (lambda: jaxcomp.qsgd(levels=4, min_dense_size=10, error_feedback=True), True),
        (lambda: jaxcomp.quantize(sign_quantizer(), error_feedback=False), False),
    ],
)
def test_residual_allocated_only_with_error_feedback(make, ef):
    params = {"w": jnp.zeros((300,)), "b": jnp.zeros((5,))}
    tx = optax.chain(make(), optax.sgd(0.1))
    state = tx.init(params)
    sizes = [x.size for x in jax.tree.leaves(state)]
    if ef:
        assert optax.tree.get(state, "residual")["w"].shape == (300,)
    else:
        assert optax.tree.get(state, "residual") is None
        assert max(sizes) < 300  # nothing of the gradient's size is allocated
    g = {"w": _gauss(300, seed=3), "b": jnp.ones((5,))}
    u, new = jax.jit(tx.update)(g, state)
    assert (optax.tree.get(new, "residual") is None) == (not ef)
    np.testing.assert_array_equal(np.asarray(u["b"]), np.float32(-0.1))  # sent dense
    assert jax.tree.structure(new) == jax.tree.structure(state)


# ---------------------------------------------------------------------------
# The paper's "b-bit": s = 2**b levels, the sign apart (issue 8, item 11).
# ---------------------------------------------------------------------------


def test_bits_means_two_to_the_b_levels():
    n = 200
    v = np.linspace(-1.0, 1.0, n).astype(np.float32)
    g = {"w": jnp.asarray(v)}
    for b in range(1, 9):
        assert qsgd_levels(bits=b) == 2**b
        s_quantizer = qsgd_quantizer(qsgd_levels(bits=b))
        assert message_nbytes(s_quantizer, n) == math.ceil(n * (b + 2) / 8) + 4
        if b not in (1, 2, 4, 8):
            continue
        by_bits = jaxcomp.qsgd(bits=b, min_dense_size=0, norm="max", seed=3)
        by_levels = jaxcomp.qsgd(levels=2**b, min_dense_size=0, norm="max", seed=3)
        u, state = by_bits.update(g, by_bits.init(g))
        u2, _ = by_levels.update(g, by_levels.init(g))
        np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(u2["w"]))
        # With the max norm every output is a multiple of 1 / 2**b, and 2**b + 1
        # values are possible per sign: 0..2**b.
        lv = np.asarray(u["w"], np.float64) * 2**b
        np.testing.assert_allclose(lv, np.round(lv), atol=1e-4)
        assert np.abs(lv).max() == 2**b
        # Packed: 1 sign bit + (b + 1) level bits per coordinate, plus one scale.
        assert int(state.message_bytes["w"]) == math.ceil(n * (b + 2) / 8) + 4


def test_four_bits_bucket_512_variance_factor():
    # The paper's "4-bit, bucket 512": s = 16, variance <= sqrt(512) / 2**4 ||v||^2 = 1.41.
    s, d = qsgd_levels(bits=4), 512
    assert s == 16
    factor = min(d / s**2, math.sqrt(d) / s)
    assert abs(factor - math.sqrt(512) / 16) < 1e-12 and abs(factor - 1.4142) < 1e-4
    v = _gauss(2 * d, seed=8)
    x = _draws(qsgd_quantizer(s, d), v, n_draws=400)
    var, _, _ = _qsgd_moments(v, s, d)
    for i in range(2):
        b = np.asarray(v, np.float64)[i * d : (i + 1) * d]
        measured = float(((x[:, i * d : (i + 1) * d] - b) ** 2).sum(axis=1).mean())
        exact = float(var[i * d : (i + 1) * d].sum())
        assert exact <= factor * float(b @ b)
        assert abs(measured - exact) <= 0.1 * exact


@pytest.mark.parametrize("n,bits,d", [(1001, 4, 512), (777, 3, 128)])
def test_message_bytes_is_the_packed_size(n, bits, d):
    tx = jaxcomp.qsgd(bits=bits, bucket_size=d, min_dense_size=0)
    g = {"w": _gauss(n, seed=1)}
    _, state = tx.update(g, tx.init(g))
    width = 1 + math.ceil(math.log2(2**bits + 1))  # sign + levels 0..2**b
    nb = 1 if d is None else math.ceil(n / d)
    assert int(state.message_bytes["w"]) == math.ceil(n * width / 8) + 4 * nb


N_DEV = 8


def test_qsgd_shard_map_devices_differ_and_run_reproduces():
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))

    def make(seed):
        tx = jaxcomp.qsgd(
            levels=2, axis_name="data", min_dense_size=0, error_feedback=True, seed=seed
        )

        def step(g, s):
            g, s = jax.tree.map(lambda x: x[0], (g, s))
            u, s = tx.update(g, s)
            return jax.tree.map(lambda x: x[None], (u, s))

        spec = (P("data"), P("data"))
        f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec))
        return tx, f

    g1 = {"w": _gauss(500, seed=6)}
    g = jax.device_put({"w": jnp.stack([g1["w"]] * N_DEV)}, sharding)  # same gradient everywhere
    tx, f = make(0)
    state = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx.init(g1)), sharding)
    u1, s1 = jax.device_get(f(g, state))
    u2, s2 = jax.device_get(f(g, state))
    tx_other, f_other = make(1)
    state_other = jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx_other.init(g1))
    u3, _ = jax.device_get(f_other(g, jax.device_put(state_other, sharding)))
    res = np.asarray(s1.residual["w"])
    # Different randomness per device: different messages from the same gradient.
    assert len({bits(res[d]) for d in range(N_DEV)}) == N_DEV
    assert bits(u1["w"]) == bits(u2["w"]) and bits(s1.residual["w"]) == bits(s2.residual["w"])
    assert bits(u1["w"][0]) != bits(u3["w"][0])
    # The update is the mean of the 8 messages (sent = acc - residual, one rounding).
    sent = np.asarray(g1["w"])[None] - res
    np.testing.assert_allclose(u1["w"][0], sent.mean(axis=0), rtol=1e-5, atol=1e-6)
    assert float(s1.wire_bytes[0]) == (N_DEV - 1) * (188 + 4)  # s = 2: 3 bits a coordinate


def test_backup_workers_left_out_device_sends_nothing():
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tx = jaxcomp.ef_sign_sgd(axis_name="data")

    def step(g, s, inc):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s, include=inc[0])
        return jax.tree.map(lambda x: x[None], (u, s))

    spec = (P("data"), P("data"), P("data"))
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=spec, out_specs=spec[:2]))
    rng = np.random.default_rng(0)
    g = {"w": jnp.asarray(rng.normal(size=(N_DEV, 64)).astype(np.float32))}
    state = jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx.init({"w": g["w"][0]}))
    include = jnp.arange(N_DEV) != 3
    u, s = jax.device_get(f(*jax.device_put((g, state, include), sharding)))
    np.testing.assert_array_equal(np.asarray(s.residual["w"][3]), np.asarray(g["w"][3]))
    sent = np.asarray(g["w"]) - np.asarray(s.residual["w"])
    expected = np.delete(sent, 3, axis=0).mean(axis=0)
    np.testing.assert_allclose(u["w"][0], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# The 1-bit family against numpy references.
# ---------------------------------------------------------------------------


def _ref_sign(x, d):
    return np.concatenate(
        [np.abs(b).sum() / b.size * np.where(b >= 0, 1.0, -1.0) for b in _np_buckets(x, d)]
    )


def _ref_onebit(x, d):
    out = []
    for b in _np_buckets(x, d):
        pos = b[b >= 0].mean() if np.any(b >= 0) else 0.0
        neg = b[b < 0].mean() if np.any(b < 0) else 0.0
        out.append(np.where(b >= 0, pos, neg))
    return np.concatenate(out)


def _bounded_alpha(b, lam, bound):
    """(alpha, feasible, alpha0) of the bounded sign, in float64."""
    d = b.size
    l1, l2sq = np.abs(b).sum(), float(b @ b)
    alpha0 = lam * math.sqrt(l2sq / d)
    disc = l1 * l1 - d * (1 - bound**2) * l2sq
    if disc < 0:
        return l1 / d, False, alpha0
    lo, hi = (l1 - math.sqrt(disc)) / d, (l1 + math.sqrt(disc)) / d
    return min(max(alpha0, lo), hi), True, alpha0


def _ref_bounded(x, d, lam, bound):
    return np.concatenate(
        [_bounded_alpha(b, lam, bound)[0] * np.where(b >= 0, 1.0, -1.0) for b in _np_buckets(x, d)]
    )


ONE_BIT = {
    "sign_sgd": (lambda d: jaxcomp.sign_sgd(bucket_size=d), _ref_sign, False),
    "ef_sign_sgd": (lambda d: jaxcomp.ef_sign_sgd(bucket_size=d), _ref_sign, True),
    "onebit": (lambda d: jaxcomp.onebit(bucket_size=d), _ref_onebit, True),
    "bounded_sign": (
        lambda d: jaxcomp.bounded_sign(0.6, error_bound=0.8, bucket_size=d),
        lambda x, d: _ref_bounded(x, d, 0.6, 0.8),
        True,
    ),
}


@pytest.mark.parametrize("name", list(ONE_BIT))
@pytest.mark.parametrize("d", [None, 30])
def test_one_bit_matches_numpy_reference(name, d):
    make, ref, ef = ONE_BIT[name]
    tx = make(d)
    f = jax.jit(tx.update)
    rng = np.random.default_rng(0)
    shapes = {"w": (10, 10), "v": (95,), "one": (1,)}
    state = tx.init({k: jnp.zeros(s) for k, s in shapes.items()})
    assert (state.residual is None) == (not ef)
    for step in range(3):
        g = {k: rng.laplace(size=s).astype(np.float32) for k, s in shapes.items()}
        g["v"][:5] = 0.0  # zeros are sent as +
        g["v"][5:40] = np.abs(g["v"][5:40])  # a bucket with no negatives
        u, new = f(g, state)
        for leaf in g:
            acc = (np.asarray(state.residual[leaf]) if ef else 0) + g[leaf]
            expected = ref(acc.reshape(-1).astype(np.float64), d).reshape(acc.shape)
            np.testing.assert_allclose(np.asarray(u[leaf]), expected, rtol=2e-6, atol=1e-7)
            if ef:
                np.testing.assert_array_equal(
                    np.asarray(new.residual[leaf]), acc - np.asarray(u[leaf])
                )
            else:
                assert new.residual is None
            n = g[leaf].size
            nb = 1 if d is None else math.ceil(n / min(d, n))
            scales = 2 if name == "onebit" else 1
            assert int(new.message_bytes[leaf]) == math.ceil(n / 8) + 4 * scales * nb
        assert int(new.step) == step + 1
        state = new


def _bounded_cases():
    rng = np.random.default_rng(11)
    spike = np.zeros(400)
    spike[17] = 5.0
    spike += rng.normal(scale=1e-3, size=400)
    return {
        "gauss": rng.normal(size=1000),
        "laplace": rng.laplace(size=1000),
        "spike": spike,
        "flat": np.full(64, -0.25),
        "two": np.array([3.0, -4.0]),
    }


@pytest.mark.parametrize("case", list(_bounded_cases()))
def test_bounded_sign_error_bound(case):
    x64 = _bounded_cases()[case]
    x = jnp.asarray(x64.astype(np.float32))
    x64 = np.asarray(x, np.float64)
    norm = float(np.linalg.norm(x64))
    rho_sq = np.abs(x64).sum() ** 2 / (x64.size * norm**2)
    best = math.sqrt(max(1 - rho_sq, 0.0))  # min over alpha of ||alpha sign(x) - x|| / ||x||
    for lam in (0.05, 0.5, 0.8, 0.99):
        for bound in (0.3, 0.6, 0.9, 1.0):
            quantizer = bounded_sign_quantizer(lam, bound)
            c = np.asarray(quantizer.decode(*quantizer.encode(x, None), x.size), np.float64)
            err = float(np.linalg.norm(c - x64)) / norm
            alpha, feasible, alpha0 = _bounded_alpha(x64, lam, bound)
            got = float(np.abs(c[0]))
            assert np.all(np.abs(c) == got)  # one scale, signs of x
            np.testing.assert_allclose(got, alpha, rtol=1e-5)
            # The guarantee: within the bound when any scale can be, else the best possible.
            assert err <= max(bound, best) * (1 + 1e-5) + 1e-6, (lam, bound, err)
            if feasible:
                assert err <= bound * (1 + 1e-5) + 1e-6
            else:
                assert bound < best and abs(err - best) <= 1e-5
            if bound == 1.0:
                assert err <= 1.0 + 1e-6  # never worse than sending nothing


def test_bounded_sign_uses_lam_l2_scale_when_within_bound():
    x = _gauss(1000, seed=9)
    tx = jaxcomp.bounded_sign(0.7)
    u, _ = tx.update({"w": x}, tx.init({"w": x}))
    alpha = 0.7 * float(np.linalg.norm(np.asarray(x, np.float64))) / math.sqrt(1000)
    np.testing.assert_allclose(np.abs(np.asarray(u["w"])), alpha, rtol=1e-5)


@pytest.mark.parametrize("magnitude", [1e-20, 1e20])
def test_bounded_sign_scale_at_extreme_magnitudes(magnitude):
    """||x||^2 over- or underflows float32 here (it once gave scale 0, or NaN and a
    silent fall back to the l1 scale): the scale is lam ||x|| / sqrt(d) still."""
    x = jnp.asarray(_gauss(1000, seed=9) * magnitude, jnp.float32)
    tx = jaxcomp.bounded_sign(0.7)
    u, _ = tx.update({"w": x}, tx.init({"w": x}))
    alpha = 0.7 * float(np.linalg.norm(np.asarray(x, np.float64))) / math.sqrt(1000)
    np.testing.assert_allclose(np.abs(np.asarray(u["w"], np.float64)), alpha, rtol=1e-5)


def test_zero_leaf_sends_zero():
    for name in ONE_BIT:
        tx = ONE_BIT[name][0](None)
        u, s = tx.update({"w": jnp.zeros(50)}, tx.init({"w": jnp.zeros(50)}))
        assert not np.any(np.asarray(u["w"]))
        assert s.residual is None or not np.any(np.asarray(s.residual["w"]))


# ---------------------------------------------------------------------------
# All leaves in one exchange per step.
# ---------------------------------------------------------------------------

QUANTIZE_MODULE = importlib.import_module("jaxcomp.transforms.quantize")
# XLA collective instructions in compiled HLO text; an async pair counts once (its start).
HLO_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|collective-permute|reduce-scatter|all-to-all)(-start)?\("
)


def _per_leaf(make, monkeypatch):
    """``make()`` built with the per-leaf exchange: one group per leaf (the reference)."""
    with monkeypatch.context() as m:
        m.setattr(QUANTIZE_MODULE, "_MERGE_LEAVES", False)
        return make()


def _sharded_update(tx, with_include=False):
    """jit(shard_map(tx.update)) over per-device rows of (grads, state[, include])."""
    mesh = jax.make_mesh((N_DEV,), ("data",))

    def step(g, s, *inc):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s, include=inc[0][0] if inc else None)
        return jax.tree.map(lambda x: x[None], (u, s))

    in_specs = (P("data"),) * (3 if with_include else 2)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=in_specs, out_specs=(P("data"),) * 2))


def _stacked(tree):
    return jax.tree.map(lambda x: np.stack([np.asarray(x)] * N_DEV), tree)


def _collectives(tx, like, with_include=False):
    """Collective instructions in the compiled 8-device step of ``tx`` on ``like``'s shapes."""
    sharding = NamedSharding(jax.make_mesh((N_DEV,), ("data",)), P("data"))
    stacked = jax.eval_shape(lambda: jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx.init(like)))
    args = (jax.tree.map(lambda x: jnp.stack([x] * N_DEV), like), stacked)
    args += (jax.ShapeDtypeStruct((N_DEV,), jnp.bool_),) if with_include else ()
    args = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), args)
    hlo = _sharded_update(tx, with_include).lower(*args).compile().as_text()
    return len(HLO_COLLECTIVE.findall(hlo))


def _tree_of(n_leaves):
    """float32 leaves; those of at most 10 elements (3 in 10) are sent dense."""
    sizes = [(40, 9), (3,), (300,), (64,), (5, 5, 4), (7,), (129,), (30, 30), (2,), (777,)]
    shapes = [sizes[i % len(sizes)] for i in range(n_leaves)]
    return {f"l{i:02d}": jnp.zeros(s, jnp.float32) for i, s in enumerate(shapes)}


COUNT_CASES = [
    ("qsgd", "allgather"),
    ("qsgd", "allreduce"),
    ("qsgd", "server"),
    ("qsgd", "gossip"),
    ("sign", "allgather"),
    ("sign", "allreduce"),
    ("sign", "server"),
    ("sign", "gossip"),
    ("sign", "majority"),
    ("onebit", "majority"),
]
COUNT_CODECS = {
    "qsgd": lambda **kw: jaxcomp.qsgd(levels=4, bucket_size=64, **kw),
    "sign": lambda **kw: jaxcomp.sign_sgd(bucket_size=64, **kw),
    "onebit": lambda **kw: jaxcomp.onebit(bucket_size=64, **kw),
}


@pytest.mark.parametrize("codec,exchange", COUNT_CASES)
def test_collectives_per_step_do_not_grow_with_the_leaf_count(codec, exchange):
    def make():
        return COUNT_CODECS[codec](axis_name="data", exchange=exchange, min_dense_size=10)

    with_include = exchange in ("allgather", "allreduce")  # + the backup workers' count
    two, twelve = _tree_of(2), _tree_of(12)
    assert twelve["l01"].size <= 10 < twelve["l00"].size  # dense and quantized leaves
    counts = [_collectives(make(), t, with_include) for t in (two, twelve)]
    assert counts[0] == counts[1], counts
    # One buffer per dtype: codes, scales and the dense values (+ the count): a few collectives;
    # the server's push and pull are N - 1 single-pair ppermutes per buffer.
    per_buffer = N_DEV - 1 if exchange == "server" else 2 if exchange == "gossip" else 1
    assert counts[1] <= 6 * per_buffer, counts


def test_per_leaf_reference_exchange_grows_with_the_leaf_count(monkeypatch):
    """The reference of the bit-equality tests below is the per-leaf exchange: it does grow."""

    def make():
        return jaxcomp.qsgd(levels=4, bucket_size=64, axis_name="data", min_dense_size=10)

    per_leaf = [_collectives(_per_leaf(make, monkeypatch), _tree_of(k)) for k in (2, 12)]
    merged = [_collectives(make(), _tree_of(k)) for k in (2, 12)]
    assert merged[0] == merged[1] == per_leaf[0] == 3  # codes, scales, dense all-reduce
    # Two all-gathers per quantized leaf (8 of 12); XLA's combiner merges the dense psums.
    assert per_leaf[1] >= 2 * 8 + 1, per_leaf


MIXED_LEAVES = {
    "scalar": ((), jnp.float32),
    "empty": ((0, 3), jnp.float32),
    "small": ((10,), jnp.float32),  # below min_dense_size: sent dense
    "small_bf16": ((5,), jnp.bfloat16),  # dense too, in a bfloat16 buffer
    "bf16": ((300,), jnp.bfloat16),
    "w": ((20, 30), jnp.float32),
    "v": ((1001,), jnp.float32),
    # Leaves of one size are decoded together (stacked): with a bfloat16 one, another shape.
    "bf16_twin": ((300,), jnp.float32),
    "w_twin": ((600,), jnp.float32),
}
# name -> (factory given axis_name= and exchange=, exchange, with include=).
MERGE_CASES = {
    "qsgd_allgather": (
        lambda **kw: jaxcomp.qsgd(
            levels=4,
            bucket_size=64,
            error_feedback=True,
            min_dense_size=12,
            keep_message=True,
            **kw,
        ),
        "allgather",
        False,
    ),
    "qsgd_none_dense": (  # the scalar and the small leaves quantized too
        lambda **kw: jaxcomp.qsgd(levels=2, bucket_size=64, min_dense_size=0, **kw),
        "allgather",
        True,
    ),
    "qsgd_allreduce": (
        lambda **kw: jaxcomp.qsgd(
            levels=4, bucket_size=64, error_feedback=True, min_dense_size=12, **kw
        ),
        "allreduce",
        True,
    ),
    "qsgd_server": (
        lambda **kw: jaxcomp.qsgd(
            levels=4, bucket_size=64, error_feedback=True, min_dense_size=12, **kw
        ),
        "server",
        False,
    ),
    "natural_allgather": (
        lambda **kw: jaxcomp.natural_compression(error_feedback=True, min_dense_size=12, **kw),
        "allgather",
        True,
    ),
    "cast_allreduce": (
        lambda **kw: jaxcomp.cast(jnp.bfloat16, error_feedback=True, min_dense_size=12, **kw),
        "allreduce",
        True,
    ),
    "sign_majority": (
        lambda **kw: jaxcomp.ef_sign_sgd(bucket_size=16, min_dense_size=12, **kw),
        "majority",
        True,
    ),
    "signum_majority": (  # momentum: the velocity too
        lambda **kw: jaxcomp.signum(0.9, bucket_size=32, min_dense_size=12, **kw),
        "majority",
        False,
    ),
    "qsgd_gossip": (
        lambda **kw: jaxcomp.qsgd(
            levels=4, bucket_size=64, error_feedback=True, min_dense_size=12, **kw
        ),
        "gossip",
        False,
    ),
    "terngrad_gossip": (
        lambda **kw: jaxcomp.terngrad(bucket_size=64, min_dense_size=12, **kw),
        "gossip",
        False,
    ),
}


def _merged_and_per_leaf(case, monkeypatch, steps=2):
    """Per step, ``(merged, per_leaf)`` outputs ``(updates, state)`` on the mixed tree."""
    factory, exchange, with_include = MERGE_CASES[case]

    def make():
        return factory(axis_name="data", exchange=exchange)

    like = {k: jnp.zeros(s, dt) for k, (s, dt) in MIXED_LEAVES.items()}
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    runs = []
    for tx in (make(), _per_leaf(make, monkeypatch)):
        f = _sharded_update(tx, with_include)
        state, outs = _stacked(tx.init(like)), []
        rng = np.random.default_rng(11)
        for t in range(steps):
            grads = {
                k: rng.laplace(size=(N_DEV, *s)).astype(np.float32).astype(dt)
                for k, (s, dt) in MIXED_LEAVES.items()
            }
            if t == 1:
                grads["v"][2, 7] = np.nan  # device 2 skips this step: it sends zero scales
            include = (np.arange(N_DEV) != 5,) if with_include else ()
            u, state = jax.block_until_ready(f(*jax.device_put((grads, state, *include), sharding)))
            outs.append(jax.device_get((u, state)))
        runs.append(outs)
    return list(zip(*runs, strict=True))


def _check_bit_equal(merged, per_leaf):
    """Every output of the step bit for bit, but ``wire_bytes``; returns (merged, per-leaf) wire."""
    wire = (float(merged[1].wire_bytes[0]), float(per_leaf[1].wire_bytes[0]))
    clear = lambda out: (out[0], out[1]._replace(wire_bytes=None))  # noqa: E731
    a, tree_a = jax.tree.flatten_with_path(clear(merged))
    b, tree_b = jax.tree.flatten_with_path(clear(per_leaf))
    assert tree_a == tree_b
    for (path, x), (_, y) in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        assert bits(x) == bits(y), jax.tree_util.keystr(path)
    return wire


def _check_wire(case, merged, wire):
    """Same wire bytes, but the backup-worker count: once per buffer, not once per leaf."""
    _, exchange, with_include = MERGE_CASES[case]
    if not with_include or exchange == "majority":  # (a vote counts no devices)
        assert wire[0] == wire[1], wire
        return
    count = collectives.allreduce_bytes(4, N_DEV)  # one float32 psum
    dense = ("empty",) if case == "qsgd_none_dense" else ("scalar", "empty", "small", "small_bf16")
    dense_bytes = {}  # per dtype buffer
    for k in dense:
        shape, dt = MIXED_LEAVES[k]
        dense_bytes[dt] = dense_bytes.get(dt, 0) + math.prod(shape) * jnp.dtype(dt).itemsize
    counted = len(dense_bytes) + 1  # each dense buffer, and the messages
    assert wire[1] - wire[0] == (len(MIXED_LEAVES) - counted) * count, wire
    # The formula: the messages' all-gather (the all-reduce: 2 (N - 1) of each leaf's N
    # chunk messages) + a ring all-reduce of each dense buffer with its count + one count.
    sent = sum(int(merged[1].message_bytes[k][0]) for k in MIXED_LEAVES if k not in dense)
    messages = (N_DEV - 1) * sent if exchange == "allgather" else 2 * (N_DEV - 1) / N_DEV * sent
    ring = sum(collectives.allreduce_bytes(b + 4, N_DEV) for b in dense_bytes.values())
    assert wire[0] == np.float32(messages + ring + count), (wire, messages, ring)


@pytest.mark.both_codegens
@pytest.mark.parametrize("case", list(MERGE_CASES))
def test_merged_exchange_equals_per_leaf_bit_for_bit(case, monkeypatch):
    """Every leaf's update, residual, velocity, message and message bytes, bit for bit.

    Per-leaf random keys as before (QSGD, natural compression), a NaN on one
    device, a left-out backup worker. Caveat: XLA:CPU at its default backend
    optimisation (not the tests' level 0) contracts ``w x + w' y`` into FMAs
    depending on how a kernel is fused, and rounded a scalar's dense gossip
    mix up to 4 ulp away from the per-leaf program's.
    """
    for merged, per_leaf in _merged_and_per_leaf(case, monkeypatch):
        wire = _check_bit_equal(merged, per_leaf)
        _check_wire(case, merged, wire)


# ---------------------------------------------------------------------------
# Bad arguments.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: jaxcomp.qsgd(0), "levels"),
        (lambda: jaxcomp.qsgd(-3), "levels"),
        (lambda: jaxcomp.qsgd(2.5), "levels"),
        (lambda: jaxcomp.qsgd(True), "levels"),
        (lambda: jaxcomp.qsgd(2**31), "levels"),
        (lambda: jaxcomp.qsgd(4, bucket_size=0), "bucket_size"),
        (lambda: jaxcomp.qsgd(4, bucket_size=1.5), "bucket_size"),
        (lambda: jaxcomp.qsgd(4, norm="l1"), "norm"),
        (lambda: jaxcomp.qsgd(4, min_dense_size=-1), "min_dense_size"),
        (lambda: jaxcomp.qsgd(4, error_feedback="yes"), "error_feedback"),
        (lambda: jaxcomp.onebit(bucket_size=-2), "bucket_size"),
        (lambda: jaxcomp.sign_sgd(nonfinite="nope"), "nonfinite"),
        (lambda: jaxcomp.ef_sign_sgd(residual_dtype=jnp.int8), "residual_dtype"),
        (lambda: jaxcomp.bounded_sign(0.0), "lam"),
        (lambda: jaxcomp.bounded_sign(1.0), "lam"),
        (lambda: jaxcomp.bounded_sign(0.5, error_bound=0.0), "error_bound"),
        (lambda: jaxcomp.bounded_sign(0.5, error_bound=1.5), "error_bound"),
        (lambda: jaxcomp.quantize("qsgd"), "quantizer"),
        (lambda: jaxcomp.quantize(sign_quantizer(), seed=1.5), "seed"),
        (lambda: pack_codes(jnp.zeros(3, jnp.uint8), 0), "bits"),
        (lambda: pack_codes(jnp.zeros(3, jnp.uint8), 33), "bits"),
        (lambda: jaxcomp.qsgd(), "exactly one of bits"),
        (lambda: jaxcomp.qsgd(4, bits=2), "exactly one of bits"),
        (lambda: jaxcomp.qsgd(levels=4, bits=2), "exactly one of bits"),
        (lambda: jaxcomp.qsgd(bits=0), "bits"),
        (lambda: jaxcomp.qsgd(bits=31), "bits"),
        (lambda: jaxcomp.qsgd(bits=2.0), "bits"),
        (lambda: jaxcomp.qsgd(bits=True), "bits"),
    ],
)
def test_bad_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_state_fields_found_by_name_in_chain():
    tx = optax.chain(jaxcomp.qsgd(levels=3, min_dense_size=4), optax.sgd(0.1))
    params = {"a": jnp.zeros((20, 5)), "b": jnp.zeros((4,))}
    state = tx.init(params)
    _, state = jax.jit(tx.update)({"a": jnp.ones((20, 5)), "b": jnp.ones((4,))}, state)
    for field in ("residual", "message_bytes", "key", "step", "wire_bytes", "nonfinite_steps"):
        optax.tree.get(state, field)
    mb = optax.tree.get(state, "message_bytes")
    assert int(mb["a"]) == 38 + 4 and int(mb["b"]) == 16  # s = 3: 3 bits x 100, packed
