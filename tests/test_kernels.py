"""Correctness of jaxcomp.selection._kernels against numpy references."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.selection import _kernels as K

DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def _laplace(n, seed=0):
    rng = np.random.default_rng(seed)
    return rng.laplace(5e-4, 5e-3 / np.sqrt(2), n).astype(np.float32)


def _ref_count(a, t):
    return int(np.sum(np.asarray(a, np.float32) > np.float32(t)))


def _ref_extract(x, t, cap):
    xx = np.asarray(x)
    sel = np.flatnonzero(np.abs(xx.astype(np.float32)) > np.float32(t))
    idx = np.full(cap, xx.shape[0], np.int32)
    vals = np.zeros(cap, xx.dtype)
    s = sel[:cap]
    idx[: len(s)] = s
    vals[: len(s)] = xx[s]
    return idx, vals, len(sel)


def _check_extract(x, t, cap, **kw):
    idx, vals, count = K.extract(x, t, cap, **kw)
    ri, rv, rc = _ref_extract(x, t, cap)
    assert idx.dtype == jnp.int32 and idx.shape == (cap,)
    assert vals.dtype == x.dtype and vals.shape == (cap,)
    assert count.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(idx), ri)
    np.testing.assert_array_equal(np.asarray(vals).view(np.uint8), rv.view(np.uint8))  # bit-exact
    assert int(count) == rc


# ----------------------------------------------------------------------------- moments


@pytest.mark.parametrize(
    "make",
    [
        lambda r, n: r.normal(5e-4, 5e-3, n),
        lambda r, n: 100.0 + r.normal(0.0, 1.0, n),
        lambda r, n: r.laplace(5e-4, 5e-3 / np.sqrt(2), n),
        lambda r, n: -3e3 + r.normal(0.0, 1.0, n),
    ],
)
@pytest.mark.parametrize("n", [1, 7, 1000, 1 << 20])
def test_moments_vs_float64(make, n):
    x = make(np.random.default_rng(n), n).astype(np.float32)
    mean, var, amax = K.moments(jnp.asarray(x))
    xd = x.astype(np.float64)
    std = xd.std()
    assert abs(float(mean) - xd.mean()) <= 1e-5 * max(abs(xd.mean()), std) + 1e-7
    # float32 cannot represent the mean better than ~eps * |mean|: allow that much.
    assert abs(float(var) - xd.var()) <= 1e-4 * xd.var() + 1e-6 * abs(xd.mean()) * std + 1e-12
    assert float(amax) == np.abs(x).max()
    assert all(v.dtype == jnp.float32 for v in (mean, var, amax))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_moments_low_precision_input(dtype):
    x = jnp.asarray(_laplace(4096), dtype)
    xd = np.asarray(x.astype(jnp.float32), np.float64)
    mean, var, amax = K.moments(x)
    np.testing.assert_allclose(float(mean), xd.mean(), rtol=1e-4, atol=1e-8)
    np.testing.assert_allclose(float(var), xd.var(), rtol=1e-4)
    assert float(amax) == np.abs(xd).max()


def test_moments_constant():
    mean, var, amax = K.moments(jnp.full((1000,), -2.5, jnp.float32))
    assert float(mean) == -2.5 and float(var) == 0.0 and float(amax) == 2.5


# -------------------------------------------------------------------------- counting


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 5, 1023, 1024, 1025, 4096 * 3 + 17])
def test_count_above(dtype, n):
    a = jnp.abs(jnp.asarray(_laplace(n, n), dtype))
    a32 = np.asarray(a.astype(jnp.float32))
    for t in [0.0, -1.0, float(np.median(a32)), float(a32.max()), 1e-3, np.inf]:
        c = K.count_above(a, t)
        assert c.dtype == jnp.int32 and c.shape == ()
        assert int(c) == _ref_count(a32, t), t


def test_count_above_ties_zeros_nan():
    a = np.zeros(5000, np.float32)
    a[::3] = 0.25
    a[::7] = 0.5
    a[11] = np.nan
    a[12] = np.inf
    for t in [0.0, 0.25, 0.2, 0.5, np.nan, -np.inf]:
        assert int(K.count_above(jnp.asarray(a), t)) == _ref_count(a, t), t


def test_count_above_large_exact():
    # More than 2^24 selected: float32 accumulation would round here.
    n = (1 << 24) + 4099
    a = jnp.ones((n,), jnp.float32)
    assert int(K.count_above(a, 0.5)) == n
    assert int(K.count_above_many(a, jnp.array([0.5, 2.0, 0.0]))[0]) == n


@pytest.mark.parametrize("m", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n", [3, 1024, 10_000])
def test_count_above_many(m, n):
    a = np.abs(_laplace(n, m))
    ts = np.quantile(a, np.linspace(0.0, 1.0, m)).astype(np.float32)
    if m >= 4:
        ts[1] = ts[2]  # duplicate candidates
    got = K.count_above_many(jnp.asarray(a), jnp.asarray(ts))
    assert got.dtype == jnp.int32 and got.shape == (m,)
    np.testing.assert_array_equal(np.asarray(got), [_ref_count(a, t) for t in ts])


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_count_above_many_low_precision(dtype):
    a = jnp.abs(jnp.asarray(_laplace(3000), dtype))
    ts = jnp.array([0.0, 1e-3, 5e-3, 1e-2], jnp.float32)
    a32 = np.asarray(a.astype(jnp.float32))
    np.testing.assert_array_equal(
        np.asarray(K.count_above_many(a, ts)), [_ref_count(a32, t) for t in np.asarray(ts)]
    )


# --------------------------------------------------------------------------- extract


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 63, 64, 65, 4096, 70_001])
def test_extract_laplace(dtype, n):
    x = jnp.asarray(_laplace(n, n), dtype)
    a = np.abs(np.asarray(x.astype(jnp.float32)))
    k = max(1, math.ceil(1e-2 * n))
    t = float(np.sort(a)[-k])
    for cap in [1, k, math.ceil(1.5 * k) + 1, n + 3]:
        _check_extract(x, t, cap)
    _check_extract(x, 0.0, max(1, n // 2))  # count > capacity


@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
def test_extract_block_sizes(block_size):
    x = jnp.asarray(_laplace(10_007, 3))
    t = float(np.quantile(np.abs(np.asarray(x)), 0.9))
    for cap in [1, 500, 1001, 1002, 2000]:
        _check_extract(x, t, cap, block_size=block_size)


def test_extract_all_zero():
    x = jnp.zeros((1000,), jnp.float32)
    idx, vals, count = K.extract(x, 0.0, 10)
    assert int(count) == 0
    np.testing.assert_array_equal(np.asarray(idx), np.full(10, 1000))
    np.testing.assert_array_equal(np.asarray(vals), np.zeros(10))
    _check_extract(x, -1.0, 10)  # everything selected


def test_extract_all_selected_and_dense_runs():
    rng = np.random.default_rng(5)
    x = rng.normal(size=3001).astype(np.float32)
    x[100:400] = 9.0  # a run of ties filling several whole blocks
    x[2000:2100] = -9.0
    x = jnp.asarray(x)
    _check_extract(x, -1.0, 3001)
    _check_extract(x, -1.0, 5000)
    _check_extract(x, 8.9, 400)
    _check_extract(x, 8.9, 401)
    _check_extract(x, 9.0, 10)  # ties at t are not selected


def test_extract_ties_nan_inf_signed_zero():
    x = np.zeros(777, np.float32)
    x[::5] = 0.5
    x[::11] = -0.5
    x[3] = np.nan
    x[4] = -np.inf
    x[6] = -0.0
    x[700] = np.inf
    x = jnp.asarray(x)
    for t in [0.0, 0.25, 0.5, -0.5]:
        for cap in [1, 50, 200, 800]:
            _check_extract(x, t, cap)


def test_extract_matches_scatter_use():
    x = jnp.asarray(_laplace(5000, 9))
    t = float(np.quantile(np.abs(np.asarray(x)), 0.99))
    idx, vals, count = K.extract(x, t, 80)
    sent = jnp.zeros_like(x).at[idx].set(vals, mode="drop")
    ref_sent, _ = K.dense_split(x, t)
    assert int(count) <= 80
    np.testing.assert_array_equal(np.asarray(sent), np.asarray(ref_sent))


# ------------------------------------------------------------------------ dense split


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_split_bit_exact(dtype):
    x = np.array(jnp.asarray(_laplace(5000, 1), dtype).astype(jnp.float32))
    x[:5] = [np.nan, -0.0, np.inf, -np.inf, 0.0]
    x = jnp.asarray(x, dtype)
    t = 3e-3
    sent, res = K.dense_split(x, t)
    assert sent.dtype == x.dtype and res.dtype == x.dtype
    keep = np.abs(np.asarray(x.astype(jnp.float32))) > np.float32(t)
    xb = np.asarray(x)
    sent, res = np.asarray(sent), np.asarray(res)
    # Selected entries are bit-identical in sent, the others bit-identical in residual.
    np.testing.assert_array_equal(sent[keep].view(np.uint8), xb[keep].view(np.uint8))
    np.testing.assert_array_equal(res[~keep].view(np.uint8), xb[~keep].view(np.uint8))
    assert np.all(res[keep] == 0) and np.all(sent[~keep] == 0)
    # The -0.0 filler makes even the float sum reproduce x bit for bit (non-NaN x).
    ok = ~np.isnan(xb.astype(np.float32))
    np.testing.assert_array_equal((sent + res)[ok].view(np.uint8), xb[ok].view(np.uint8))


@pytest.mark.parametrize("n", [1000, 5000])
def test_kernels_keep_int32_under_x64(n):
    """jax_enable_x64: counts stay int32 (a plain int sum would be int64 and break loop carries)."""
    with jax.enable_x64(True):
        x = np.random.default_rng(3).laplace(size=n)  # float64
        t = np.float32(1.0)
        c = K.count_above(jnp.abs(jnp.asarray(x)), t)
        assert c.dtype == jnp.int32 and int(c) == _ref_count(np.abs(x), t)
        cs = K.count_above_many(jnp.abs(jnp.asarray(x)), jnp.asarray([0.5, 1.0, 2.0]))
        assert cs.dtype == jnp.int32
        assert [int(v) for v in cs] == [_ref_count(np.abs(x), v) for v in (0.5, 1.0, 2.0)]
        idx, vals, total = K.extract(jnp.asarray(x), t, 64)
        ref_idx, ref_vals, ref_total = _ref_extract(x, t, 64)
        assert idx.dtype == jnp.int32 and total.dtype == jnp.int32 and int(total) == ref_total
        np.testing.assert_array_equal(np.asarray(idx), ref_idx)
        np.testing.assert_array_equal(np.asarray(vals), ref_vals)  # float64, bit-exact
