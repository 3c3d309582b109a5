"""The pure selectors of jaxcomp.selection against numpy references."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    DATA,
    abs32,
    count_above,
    expected_sent,
    jit_selector,
    k_of,
    laplacian,
    mixture,
    topk_set,
)

import jaxcomp
from jaxcomp import selection as sel

SEEDS = (0, 1, 2)

# ---------------------------------------------------------------------------
# Exact top-k (lax.top_k and sort).
# ---------------------------------------------------------------------------

EXACT = [sel.exact_top_k, sel.sort_top_k]


def _check_exact(fn, x, k):
    s = jit_selector(fn)(x, k)
    a = abs32(x)
    expected = topk_set(a, k)
    got = a > np.float32(s.threshold)
    np.testing.assert_array_equal(got, expected)
    assert int(s.count) == int(expected.sum())
    assert int(s.iterations) == 0
    return s


@pytest.mark.parametrize("fn", EXACT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("n,k", [(1, 1), (7, 1), (7, 7), (1000, 1), (1000, 10), (4096, 4096)])
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_top_k_matches_numpy_on_laplacian(fn, n, k, seed):
    s = _check_exact(fn, jnp.asarray(laplacian(n, seed)), k)
    assert int(s.count) == k  # continuous data: no ties


@pytest.mark.parametrize("fn", EXACT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("k", [1, 5, 50, 200, 999, 1000])
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_top_k_ties_select_the_whole_tie_group(fn, k, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(-4, 5, size=1000).astype(np.float32)  # many ties and zeros
    s = _check_exact(fn, jnp.asarray(x), k)
    assert int(s.count) >= min(k, int(np.count_nonzero(x)))


@pytest.mark.parametrize("fn", EXACT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("k", [10, 37, 100])
def test_exact_top_k_more_k_than_nonzeros_selects_all_nonzeros(fn, k):
    x = np.zeros(100, np.float32)
    x[[3, 17, 40, 41, 99]] = [1.0, -2.0, 0.5, -0.25, 3.0]
    s = _check_exact(fn, jnp.asarray(x), k)
    assert int(s.count) == 5 < k
    assert float(s.threshold) == 0.0


@pytest.mark.parametrize("fn", EXACT, ids=lambda f: f.__name__)
def test_exact_top_k_all_zeros_selects_nothing(fn):
    s = jit_selector(fn)(jnp.zeros(64), 8)
    assert int(s.count) == 0


@pytest.mark.parametrize("fn", EXACT, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("k", [1, 16, 300, 2048])
def test_exact_top_k_low_precision(fn, dtype, k):
    x = jnp.asarray(laplacian(2048, 3, mean=0.0, std=1.0)).astype(dtype)  # ties after rounding
    _check_exact(fn, x, k)


# ---------------------------------------------------------------------------
# LDTE-BS and binary search: window [k, 1.5k].
# ---------------------------------------------------------------------------

SEARCH_CONFIGS = [
    (sel.ldte_bs, dict(search=s, estimator=e, aim=a))
    for s in ("bisect", "fibonacci", "interpolate")
    for e in ("moments", "mle")
    for a in (1.0, 1.25)
] + [(sel.binary_search, dict(start="zero")), (sel.binary_search, dict(start="mean"))]


def _cfg_id(c):
    fn, opts = c
    return fn.__name__ + "-" + "-".join(str(v) for v in opts.values())


@pytest.mark.parametrize("cfg", SEARCH_CONFIGS, ids=_cfg_id)
@pytest.mark.parametrize("n,ratio", [(2**16, 1e-2), (2**18, 1e-3)])
def test_search_selectors_land_in_window(cfg, n, ratio):
    fn, opts = cfg
    f = jit_selector(fn, **opts)
    k = k_of(ratio, n)
    ub = math.floor(1.5 * k)
    for kind, make in DATA.items():
        for seed in SEEDS:
            x = make(n, seed)
            s = f(jnp.asarray(x), k)
            c = int(s.count)
            assert c == count_above(x, s.threshold), (kind, seed)
            nnz = int(np.count_nonzero(x))
            if nnz >= k:
                assert k <= c <= ub, (kind, seed, k, c)
            else:  # infeasible: the closest feasible count is all nonzeros
                assert c == nnz, (kind, seed, k, c, nnz)


def _tie_data(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """Data on which no threshold passes between k and 1.5 k (k = 100, n = 4096)."""
    if kind == "all_equal":
        return np.full(n, -0.375, np.float32)
    if kind == "ones":
        return np.ones(n, np.float32)
    if kind == "signs":
        return np.where(rng.random(n) < 0.5, -1.0, 1.0).astype(np.float32)
    if kind == "all_zero":
        return np.zeros(n, np.float32)
    if kind == "few_nonzeros":
        x = np.zeros(n, np.float32)
        x[rng.choice(n, 60, replace=False)] = rng.laplace(size=60)
        return x
    if kind == "two_levels":  # 90 at 2.0, the rest at 1.0: window [100, 150] impossible
        x = np.ones(n, np.float32)
        x[rng.choice(n, 90, replace=False)] = 2.0
        return x
    return rng.integers(-3, 4, size=n).astype(np.float32)


TIE_KINDS = ["all_equal", "ones", "signs", "all_zero", "few_nonzeros", "two_levels", "integers"]


# The sampled-quantile probes run when the tensor exceeds moment_sample.
PROBE_CONFIGS = [(sel.ldte_bs, dict(moment_sample=1024)), (sel.ldte_bs, dict(moment_sample=512))]


@pytest.mark.parametrize("cfg", SEARCH_CONFIGS + PROBE_CONFIGS, ids=_cfg_id)
def test_search_selectors_infeasible_pass_the_top_k_with_ties(cfg):
    """No threshold lands in [k, 1.5k]: the result is on the "too many" side.

    The set passed is exactly the top-k set with its ties ({|x| >= k-th
    magnitude}, all nonzeros if fewer than k): at least min(k, nnz), never the
    empty set that would stall a leaf (the sparsifier truncates to capacity).
    """
    fn, opts = cfg
    n, k = 4096, 100
    f = jit_selector(fn, **opts)  # one compilation serves every kind (same shape)
    for kind in TIE_KINDS:
        x = _tie_data(kind, n, np.random.default_rng(0))
        s = f(jnp.asarray(x), k)
        c = int(s.count)
        assert c == count_above(x, s.threshold), kind
        np.testing.assert_array_equal(abs32(x) > np.float32(s.threshold), topk_set(x, k), kind)
        assert c >= min(k, int(np.count_nonzero(x))), kind


@pytest.mark.parametrize(
    "fn,opts",
    [
        (sel.ldte_bs, dict(search="bisect", max_iters=1)),
        (sel.ldte_bs, dict(search="interpolate", max_iters=0)),
        (sel.ldte_bs, dict(search="bisect", aim=1.0, moment_sample=None, delta=1e-2)),
        (sel.binary_search, dict(start="zero", max_iters=2)),
        (sel.binary_search, dict(start="mean", max_iters=1)),
    ],
    ids=lambda v: getattr(v, "__name__", None) or "-".join(f"{a}={b}" for a, b in v.items()),
)
@pytest.mark.parametrize("kind", ["laplacian", "mixture"])
def test_search_stopped_early_falls_back_to_exact_top_k(fn, opts, kind):
    """Probe cap or ``delta`` hit outside the window: exact top-k (continuous data), not < k."""
    n, k = 2**14, 16
    for seed in SEEDS:
        x = DATA[kind](n, seed)
        s = jit_selector(fn, **opts)(jnp.asarray(x), k)
        c = int(s.count)
        assert c == count_above(x, s.threshold)
        if not k <= c <= math.floor(1.5 * k):  # the search stopped outside the window
            np.testing.assert_array_equal(abs32(x) > np.float32(s.threshold), topk_set(x, k))
            assert c == k, (seed, c)


# ---------------------------------------------------------------------------
# The Laplacian threshold estimate.
# ---------------------------------------------------------------------------


def _analytic_t(mu, b, eta):
    return b * math.log(math.cosh(mu / b) / eta)


@pytest.mark.parametrize(
    "mu,b", [(0.0, 1.0), (5e-4, 5e-3 / math.sqrt(2)), (0.5, 1.0), (-0.3, 0.2), (3.0, 1.0)]
)
@pytest.mark.parametrize("estimator", ["moments", "mle"])
@pytest.mark.parametrize("k", [1000, 10000])
def test_laplace_threshold_matches_analytic(mu, b, estimator, k):
    n = 2**20
    x = np.random.default_rng(7).laplace(mu, b, size=n).astype(np.float32)
    f = jax.jit(lambda x: sel.laplace_threshold(x, k, estimator=estimator, aim=1.0))
    t = f(jnp.asarray(x))
    expected = _analytic_t(mu, b, k / n)
    # Sampling error of the fitted b at n = 2^20 is ~0.1-0.2%; 1% is > 5 sigma.
    np.testing.assert_allclose(float(t), expected, rtol=1e-2)


@pytest.mark.parametrize("n", [1000, 4096, 65536])
@pytest.mark.parametrize("seed", SEEDS)
def test_laplace_threshold_mle_is_median_and_mean_abs_deviation(n, seed):
    mu_true, b_true = 0.2, 0.7
    x = np.random.default_rng(seed).laplace(mu_true, b_true, size=n).astype(np.float32)
    k = max(1, n // 100)
    t = jax.jit(lambda x: sel.laplace_threshold(x, k, estimator="mle", aim=1.0))(jnp.asarray(x))
    x64 = x.astype(np.float64)
    mu = np.median(x64)
    b = np.mean(np.abs(x64 - mu))
    np.testing.assert_allclose(float(t), _analytic_t(mu, b, k / n), rtol=1e-4)


@pytest.mark.parametrize("n", [1000, 65536])
def test_laplace_threshold_moments_is_mean_and_std(n):
    x = np.random.default_rng(3).laplace(0.1, 0.5, size=n).astype(np.float32)
    k = max(1, n // 100)
    t = jax.jit(lambda x: sel.laplace_threshold(x, k, estimator="moments", aim=1.0))(jnp.asarray(x))
    x64 = x.astype(np.float64)
    mu, b = x64.mean(), math.sqrt(x64.var() / 2)
    np.testing.assert_allclose(float(t), _analytic_t(mu, b, k / n), rtol=1e-4)


# ---------------------------------------------------------------------------
# DGC, trimmed top-k, Gaussian-k.
# ---------------------------------------------------------------------------

BASELINES = [sel.dgc_sample, sel.trimmed_top_k, sel.gaussian_k]


@pytest.mark.parametrize("fn", BASELINES, ids=lambda f: f.__name__)
@pytest.mark.parametrize("kind", list(DATA))
@pytest.mark.parametrize("ratio", [1e-3, 1e-2])
def test_baselines_count_matches_numpy(fn, kind, ratio):
    n = 2**16
    k = k_of(ratio, n)
    f = jit_selector(fn)
    for seed in SEEDS:
        x = DATA[kind](n, seed)
        s = f(jnp.asarray(x), k)
        assert int(s.count) == count_above(x, s.threshold), (seed, float(s.threshold))
        assert float(s.threshold) >= 0.0


@pytest.mark.parametrize("kind", ["laplacian", "mixture"])
@pytest.mark.parametrize("ratio", [1e-3, 1e-2, 0.1])
@pytest.mark.parametrize("n", [1000, 2**16])
def test_trimmed_top_k_is_exact_top_k(kind, ratio, n):
    k = k_of(ratio, n)
    f = jit_selector(sel.trimmed_top_k)
    for seed in SEEDS:
        x = DATA[kind](n, seed)
        a = np.sort(abs32(x))[::-1]
        assert a[k] < a[k - 1]  # no tie at the k-th value
        s = f(jnp.asarray(x), k)
        t = np.float32(s.threshold)
        assert a[k] <= t < a[k - 1]  # between the (k+1)-th and the k-th largest
        np.testing.assert_array_equal(abs32(x) > t, topk_set(x, k))
        assert int(s.count) == k


@pytest.mark.parametrize("rule", ["reference", "at_least_k"])
@pytest.mark.parametrize("n", [2**16, 2**18])
@pytest.mark.parametrize("seed", SEEDS)
def test_dgc_reaches_its_window_on_laplacian(n, seed, rule):
    # The reference stops anywhere in [0.8 k, 1.3 k] (jaxcomp.dgc then sends at
    # most k); the earlier rule decays until k pass.
    k = k_of(1e-2, n)
    x = laplacian(n, seed)
    s = jit_selector(sel.dgc_sample, rule=rule)(jnp.asarray(x), k)
    c = int(s.count)
    assert c == count_above(x, s.threshold)
    low = math.ceil(0.8 * k) if rule == "reference" else k
    assert low <= c <= math.ceil(1.3 * k)


# ---------------------------------------------------------------------------
# random_k.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n,k", [(1, 1), (10, 3), (1000, 10), (1000, 1000)])
def test_random_k_indices(n, k):
    f = jit_selector(sel.random_k)
    x = jnp.zeros(n)
    s = f(x, k, key=jax.random.key(0))
    idx = np.asarray(s.indices)
    assert idx.shape == (k,)
    assert idx.dtype == np.int32
    assert np.all(np.diff(idx) > 0)  # sorted and distinct
    assert idx.min() >= 0 and idx.max() < n
    assert int(s.count) == k
    again = f(x, k, key=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(again.indices), idx)
    if 0 < k < n:
        others = [np.asarray(f(x, k, key=jax.random.key(i)).indices) for i in range(1, 6)]
        assert any(not np.array_equal(o, idx) for o in others)


def test_random_k_marginals_are_uniform():
    n, k, trials = 64, 8, 4000
    keys = jax.random.split(jax.random.key(123), trials)
    idx = jax.jit(jax.vmap(lambda key: sel.random_k(jnp.zeros(n), k, key=key).indices))(keys)
    idx = np.asarray(idx)
    assert all(len(set(row)) == k for row in idx[:200])
    counts = np.bincount(idx.reshape(-1), minlength=n)
    p = k / n
    expected = trials * p
    sd = math.sqrt(trials * p * (1 - p))
    assert np.all(np.abs(counts - expected) < 5 * sd), counts
    chi2 = float(np.sum((counts - expected) ** 2 / (expected * (1 - p))))
    df = n - 1
    assert chi2 < df + 5 * math.sqrt(2 * df), chi2


# ---------------------------------------------------------------------------
# jit with static k: same answer as eager.
# ---------------------------------------------------------------------------

ALL_THRESHOLD_SELECTORS = [
    (sel.exact_top_k, {}),
    (sel.sort_top_k, {}),
    (sel.ldte_bs, {}),
    (sel.binary_search, {}),
    (sel.dgc_sample, {}),
    (sel.trimmed_top_k, {}),
    (sel.gaussian_k, {}),
    (sel.sidco, {"dist": "gamma"}),
    (sel.fixed_threshold, {"threshold": 4e-3}),
]


@pytest.mark.parametrize("cfg", ALL_THRESHOLD_SELECTORS, ids=lambda c: c[0].__name__)
def test_jit_matches_eager(cfg):
    fn, opts = cfg
    x = jnp.asarray(laplacian(2048, 5))
    k = 20
    eager = fn(x, k, **opts)
    jitted = jit_selector(fn, **opts)(x, k)
    assert float(eager.threshold) == float(jitted.threshold)
    assert int(eager.count) == int(jitted.count) == count_above(x, jitted.threshold)
    assert jitted.threshold.dtype == jnp.float32
    assert jitted.count.dtype == jnp.int32


def test_fixed_threshold_counts():
    x = laplacian(4096, 2)
    s = jit_selector(sel.fixed_threshold, threshold=4e-3)(jnp.asarray(x), 5)
    assert float(s.threshold) == np.float32(4e-3)
    assert int(s.count) == count_above(x, np.float32(4e-3))


def test_mixture_generator_shape():
    x = mixture(1000, 0)
    assert x.dtype == np.float32 and x.shape == (1000,)


def test_ldte_bs_exact_below_dispatches_small_tensors_to_exact_top_k():
    x = np.random.default_rng(11).laplace(size=5000).astype(np.float32)
    k = 50
    kth = np.sort(np.abs(x))[::-1][k - 1]
    small = jax.jit(lambda v: sel.ldte_bs(v, k, exact_below=5001))(jnp.asarray(x))
    np.testing.assert_array_equal(np.abs(x) > float(small.threshold), np.abs(x) >= kth)
    assert int(small.count) == k
    # At or above the size, the Laplacian estimate runs (generally not exact k).
    big = jax.jit(lambda v: sel.ldte_bs(v, k, exact_below=5000))(jnp.asarray(x))
    assert k <= int(big.count) <= 75
    with pytest.raises(ValueError, match="exact_below"):
        sel.ldte_bs(jnp.asarray(x), k, exact_below=-1)


# ---------------------------------------------------------------------------
# Liveness of the fitted baselines on tie-heavy data (issue 8, item 3).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", TIE_KINDS + ["laplacian", "mixture"])
@pytest.mark.parametrize("k", [1, 100, 1000])
def test_gaussian_k_passes_at_least_k(kind, k):
    """Gaussian-k tops up to k when its corrections end short (constant data: 0 before)."""
    n = 4096
    f = jit_selector(sel.gaussian_k)
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        x = DATA[kind](n, seed) if kind in DATA else _tie_data(kind, n, rng)
        s = f(jnp.asarray(x), k)
        c = int(s.count)
        assert c == count_above(x, s.threshold)
        assert c >= min(k, int(np.count_nonzero(x))), (seed, c)
        # A threshold set is a top set: with ties it holds the whole tie group.
        np.testing.assert_array_equal(abs32(x) > np.float32(s.threshold), topk_set(x, c))


@pytest.mark.parametrize("rule", ["reference", "at_least_k"])
@pytest.mark.parametrize("kind", TIE_KINDS + ["laplacian", "mixture", "mostly_zeros"])
@pytest.mark.parametrize("k", [1, 100, 1000])
def test_dgc_guarantees(kind, k, rule):
    """DGC's documented guarantee: >= 1 if x != 0; >= m if m values reach max|x| / 9,
    with m = ceil(0.8 k) (reference rule, every sample start) or k (at_least_k)."""
    n = 4096
    m = math.ceil(0.8 * k) if rule == "reference" else k
    f = jax.jit(lambda x, s: sel.dgc_sample(x, k, rule=rule, start=s))
    stride = sel.dgc_sampling(n, k)[0]
    for seed in SEEDS:
        rng = np.random.default_rng(seed)
        x = DATA[kind](n, seed) if kind in DATA else _tie_data(kind, n, rng)
        for start in {0, stride // 2, stride - 1}:
            s = f(jnp.asarray(x), start)
            c = int(s.count)
            a = abs32(x)
            assert c == count_above(x, s.threshold)
            if a.max() > 0:
                assert c >= 1
                if np.sum(a >= a.max() / 9) >= m:
                    assert c >= m, (seed, start, c)
            else:
                assert c == 0


@pytest.mark.parametrize("rule", ["reference", "at_least_k"])
def test_dgc_may_end_below_k_and_reports_it(rule):
    """The exemption: sampled outliers 1e4 x the rest; DGC ends below k, never at 0."""
    n, k = 10_000, 100
    x = laplacian(n, 0, mean=0.0, std=1.0)
    # Indices 0, stride, 2 stride are in the sample from start 0 (the reference
    # rule's threshold is its sample's 3rd largest here).
    stride = sel.dgc_sampling(n, k)[0] if rule == "reference" else n // 100 - 1
    x[: 3 * stride : stride] = 1e4
    s = jit_selector(sel.dgc_sample, rule=rule)(jnp.asarray(x), k)
    c = int(s.count)
    assert c == count_above(x, s.threshold)
    assert 1 <= c < (math.ceil(0.8 * k) if rule == "reference" else k)


@pytest.mark.parametrize("t", [-1.0, 0.0, 0.5, 5.0])
def test_one_device_send_is_cap_largest_above_t_bit_for_bit(t):
    """sparsify on one device, with any threshold selector (here a custom one that may
    return a negative t): the update holds the elements with |acc| > t, over ``cap`` of
    them the ``cap`` largest (ties to the lower index), and the residual the rest, bit
    for bit, signed zeros included, with and without overflow. (The selector reads a
    copy of the accumulator and the update is read off the residual:
    sparsify._select_and_send, _send_masked.)"""
    import jaxcomp  # noqa: PLC0415

    n, ratio, cap = 1000, 0.01, 15  # k = 10, capacity ceil(1.5 k)

    def select(x, k):
        tt = jnp.float32(t)
        count = jnp.sum(jnp.abs(x.astype(jnp.float32)) > tt, dtype=jnp.int32)
        return sel.Selection(tt, count, jnp.int32(0))

    tx = jaxcomp.sparsify(select, ratio)
    rng = np.random.default_rng(0)
    g = rng.laplace(size=n).astype(np.float32)
    g[::7] = 0.0
    g[3::11] = -0.0
    r = np.zeros(n, np.float32)
    r[3::11] = -0.0  # -0.0 + -0.0: accumulators that are -0.0
    state = tx.init(jnp.asarray(g))._replace(residual=jnp.asarray(r))
    step = jax.jit(tx.update)
    for _ in range(3):
        upd, state = step(jnp.asarray(g), state)
        acc = r + g
        idx = np.flatnonzero(np.abs(acc) > np.float32(t))
        mask = np.zeros(n, bool)
        mask[expected_sent(acc, t, cap)] = True
        ref_u = np.where(mask, acc, np.float32(0))
        r = np.where(mask, np.float32(0), acc)
        np.testing.assert_array_equal(np.asarray(upd).view(np.uint32), ref_u.view(np.uint32))
        np.testing.assert_array_equal(np.asarray(state.residual).view(np.uint32), r.view(np.uint32))
        # The gradients are one array: its leaf's entry (sent_count has one per leaf).
        assert int(jaxcomp.statistics(state)["sent_count"]) == min(idx.size, cap)


@pytest.mark.parametrize("kind", ["laplace", "ties", "sparse", "tiny", "f16", "f64"])
def test_kth_largest_above_matches_numpy(kind):
    # The fallback of the two-stage selections (DGC's and RedSync's refine,
    # LDTE-BS's infeasible window) bisects float32 bit patterns instead of
    # running lax.top_k on an n-sized masked copy: the same value, the k-th
    # largest of where(|x| > t, |x|, 0), for every t and k, ties and zeros.
    rng = np.random.default_rng(len(kind))
    fn = jax.jit(sel.selectors._kth_largest_above, static_argnums=3)
    n = 1000
    make = {
        "laplace": lambda: rng.laplace(size=n).astype(np.float32),
        "ties": lambda: rng.integers(-3, 4, size=n).astype(np.float32),
        "sparse": lambda: np.where(rng.random(n) < 0.05, 2.0, 0.0).astype(np.float32),
        # Tiny but normal: XLA:CPU flushes float32 subnormals to zero in its
        # comparisons, so every count (and this bisection) sees them as 0.
        "tiny": lambda: (rng.normal(size=n) * 1e-30).astype(np.float32),
        "f16": lambda: rng.laplace(size=n).astype(np.float16),
        "f64": lambda: rng.laplace(size=n),
    }[kind]
    for _ in range(4):
        x = make()
        a = np.abs(x.astype(np.float32))
        for t in (0.0, float(np.quantile(a, rng.random()))):
            count = int((a > t).sum())
            for k in (1, 37, n):  # k > count too: the masked zeros make the k-th 0
                want = np.sort(np.where(a > t, a, 0))[::-1][k - 1]
                got = fn(jnp.asarray(x), jnp.float32(t), jnp.int32(count), k)
                assert float(got) == float(want), (k, t, count)


@pytest.mark.parametrize("name", ["ldte_bs", "dgc", "trimmed_top_k"])
def test_tied_fallback_under_checked_shard_map(name):
    # Tied magnitudes force the two-stage refine (its bisection's while_loop):
    # inside a user's shard_map with check_vma=True it must trace and give the
    # unchecked run's update and residuals, and send k..capacity elements.
    import jaxcomp  # noqa: PLC0415

    n_dev, n = 4, 4096
    mesh = jax.make_mesh((n_dev,), ("d",))
    g = np.ones((n_dev, n), np.float32)
    g[:, ::3] = 2.0
    g[1] *= -1.0
    g = jax.device_put(jnp.asarray(g), jax.NamedSharding(mesh, jax.P("d")))
    tx = getattr(jaxcomp, name)(1e-3, axis_name="d")

    def two_steps(gl):
        gl = gl[0]
        u, s = tx.update(gl, tx.init(gl))
        u, s = tx.update(gl, s)
        return u[None], s.residual[None], s.sent_count[None]

    outs = [
        jax.jit(
            jax.shard_map(
                two_steps, mesh=mesh, in_specs=jax.P("d"), out_specs=jax.P("d"), check_vma=c
            )
        )(g)
        for c in (True, False)
    ]
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    k = sel.target_count(1e-3, n)
    assert np.all((k <= np.asarray(outs[0][2])) & (np.asarray(outs[0][2]) <= math.ceil(1.5 * k)))


# ---------------------------------------------------------------------------
# LDTE-BS with a hint (the previous step's threshold), counted in the first pass.
# ---------------------------------------------------------------------------

HINT_N = 1 << 17  # above the 65536-element moment sample: the probes join the first pass


def _in_window_threshold(a: np.ndarray, count: int) -> np.float32:
    """A float32 t with exactly ``count`` elements of ``a`` above it (numpy)."""
    top = np.sort(a)[::-1]
    return np.float32((np.float64(top[count - 1]) + top[count]) / 2)


def test_ldte_bs_hint_in_window_is_used_when_the_estimate_misses():
    x = mixture(HINT_N, 3)  # the Laplacian estimate misses this mixture
    k = k_of(1e-3, HINT_N)
    a = abs32(x)
    estimate = jax.jit(lambda v: sel.laplace_threshold(v, k, aim=1.25, moment_sample=65536))
    t0 = float(estimate(jnp.asarray(x)))
    assert not k <= count_above(x, t0) <= 1.5 * k  # precondition: the estimate misses
    hint = _in_window_threshold(a, k + 7)
    s = jit_selector(sel.ldte_bs)(jnp.asarray(x), k, hint=hint)
    assert float(s.threshold) == hint
    assert int(s.count) == count_above(x, hint) == k + 7
    assert int(s.iterations) == 0  # counted beside the estimate: no probe pass


def test_ldte_bs_keeps_an_estimate_in_window_over_the_hint():
    x = laplacian(HINT_N, 4)  # the estimate lands in the window here
    k = k_of(1e-3, HINT_N)
    plain = jit_selector(sel.ldte_bs)(jnp.asarray(x), k)
    assert int(plain.iterations) == 0
    hint = _in_window_threshold(abs32(x), k)  # also in the window, but not the estimate
    s = jit_selector(sel.ldte_bs)(jnp.asarray(x), k, hint=hint)
    assert float(s.threshold) == float(plain.threshold) != hint
    assert int(s.count) == int(plain.count) == count_above(x, plain.threshold)


@pytest.mark.parametrize("hint", [np.inf, np.nan, -1.0, 0.0, 1e30])
@pytest.mark.parametrize("data", ["mixture", "laplacian"])
def test_ldte_bs_useless_hints_give_the_plain_threshold(hint, data):
    """Non-finite or negative hints are ignored; far ones (0, huge) only bracket."""
    x = DATA[data](HINT_N, 5)
    k = k_of(1e-3, HINT_N)
    plain = jit_selector(sel.ldte_bs)(jnp.asarray(x), k)
    s = jit_selector(sel.ldte_bs)(jnp.asarray(x), k, hint=jnp.float32(hint))
    assert k <= int(s.count) <= 1.5 * k
    assert int(s.count) == count_above(x, s.threshold)
    # The same probes, counted in the first pass instead of a second one.
    assert float(s.threshold) == float(plain.threshold)
    assert int(s.iterations) <= int(plain.iterations)


@pytest.mark.parametrize("search", ["bisect", "fibonacci", "interpolate"])
@pytest.mark.parametrize("moment_sample", [None, 65536])
def test_ldte_bs_hint_with_every_search_stays_in_the_window(search, moment_sample):
    x = mixture(HINT_N, 6)
    k = k_of(1e-3, HINT_N)
    a = abs32(x)
    for hint in (_in_window_threshold(a, 3 * k), _in_window_threshold(a, k // 2)):
        s = jit_selector(sel.ldte_bs, search=search, moment_sample=moment_sample)(
            jnp.asarray(x), k, hint=hint
        )
        assert k <= int(s.count) <= 1.5 * k
        assert int(s.count) == count_above(x, s.threshold)


def test_ldte_bs_hint_on_tied_data_sends_at_least_k():
    x = np.tile(np.float32([1, -1, 0.5, 0]), HINT_N // 4)  # 65536 values tie at the top
    k = k_of(1e-3, HINT_N)
    s = jit_selector(sel.ldte_bs)(jnp.asarray(x), k, hint=jnp.float32(0.75))
    assert int(s.count) == count_above(x, s.threshold) >= k


@pytest.mark.parametrize("search", ["bisect", "fibonacci", "interpolate"])
def test_ldte_bs_hint_above_max_is_dropped(search):
    """A hint with nothing above it would bracket the search far above max|x|: dropped."""
    rng = np.random.default_rng(7)
    x = np.where(rng.random(50_000) < 0.05, rng.normal(size=50_000), 0).astype(np.float32)
    k = 50
    plain = jit_selector(sel.ldte_bs, search=search)(jnp.asarray(x), k)
    for hint in (10 * np.abs(x).max(), 1e30):
        s = jit_selector(sel.ldte_bs, search=search)(jnp.asarray(x), k, hint=jnp.float32(hint))
        assert float(s.threshold) == float(plain.threshold)
        assert int(s.iterations) == int(plain.iterations)
        assert k <= int(s.count) == count_above(x, s.threshold) <= 1.5 * k


# ---------------------------------------------------------------------------
# target_count, trimmed_top_k's step, dgc's injected decay under x64.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "ratio, n",
    [(0.07, 100), (0.3, 10), (1e-3, 1000), (1e-3, 10_000_001), (1e-3, 1 << 22), (0.5, 7)],
)
def test_target_count_is_ceil_of_the_exact_product(ratio, n):
    from fractions import Fraction

    # The decimal ratio the user wrote, times n, exactly: ceil of that.
    exact = Fraction(repr(ratio)) * n
    assert sel.target_count(ratio, n) == min(n, max(1, math.ceil(exact)))


def test_trimmed_top_k_rejects_a_step_of_millions_of_passes():
    with pytest.raises(ValueError, match="step must be >"):
        jaxcomp.trimmed_top_k(0.01, step=1e-10)
    with pytest.raises(ValueError, match="step must be >"):
        sel.trimmed_top_k(jnp.ones(8), 2, step=1e-7)
    # The bound itself: 1023 rounds are allowed.
    assert jaxcomp.selection.selectors.trim_rounds(0.8, 0.8 / 1023) == 1024


def test_dgc_with_injected_hyperparameters_under_x64():
    # optax.inject_hyperparams stores decay (and momentum) as float64 with
    # float64 parameters: the while loop's float32 threshold carry must stay float32.
    with jax.enable_x64(True):
        g = {"w": jnp.asarray(np.random.default_rng(0).laplace(size=500))}
        tx = optax.inject_hyperparams(jaxcomp.dgc, static_args=("ratio",))(ratio=0.01, momentum=0.9)
        plain = jaxcomp.dgc(0.01, momentum=0.9)
        u, _ = jax.jit(tx.update)(g, tx.init(g))
        ref, _ = jax.jit(plain.update)(g, plain.init(g))
        np.testing.assert_array_equal(np.asarray(u["w"]), np.asarray(ref["w"]))


@pytest.mark.parametrize("name", sorted(sel.SELECTORS))
def test_selectors_reject_input_that_is_not_1d(name):
    # exact_top_k on a (20, 10) array used to count over the flattened rows
    # against a row-wise threshold (count 159 for k = 10), silently.
    select = sel.get_selector(name)
    options = {"random_k": {"key": jax.random.key(0)}, "threshold": {"threshold": 0.5}}
    with pytest.raises(ValueError, match="x must be 1-D"):
        select(jnp.ones((20, 10)), 10, **options.get(name, {}))
    one_d = select(jnp.arange(200.0), 10, **options.get(name, {}))
    # sidco's estimate on uniform magnitudes lies above max|x|: capped to send the largest.
    assert int(one_d.count) >= (1 if name == "sidco" else 10) or name == "threshold"


def _cut_reference(x, t, cap):
    """numpy: ascending indices of the ``cap`` largest float32 magnitudes above ``t``,
    ties to the lower index (a stable sort, as ``lax.top_k`` breaks them)."""
    mags = abs32(x)
    above = np.flatnonzero(mags > np.float32(t))
    return np.sort(above[np.argsort(-mags[above], kind="stable")[:cap]])


@pytest.mark.parametrize(
    "kind",
    ["few_larger_last", "small_ints", "sparse_ties", "inf", "smallest_normal", "f64", "bf16"],
)
@pytest.mark.parametrize("n,cap", [(64, 6), (5000, 20), (5000, 400)])
def test_capacity_cut_is_the_cap_largest_ties_to_lower_index(kind, n, cap):
    """capacity_cut (both paths: survivors within 4 cap compacted, else bisection) and
    cut_message against a stable numpy sort, and _sent_mask on device and host agree."""
    from jaxcomp.transforms.sparsify import _sent_mask  # noqa: PLC0415

    rng = np.random.default_rng([n, cap, len(kind)])
    dtype = {"f64": np.float64, "bf16": jnp.bfloat16}.get(kind, np.float32)
    t = np.float32(0.5)
    x = np.zeros(n, np.float32)
    if kind == "few_larger_last":  # the case the first-in-index-order cut got wrong
        x[: 2 * cap] = 1.0
        x[-3:] = 5.0
    elif kind in ("small_ints", "bf16"):
        x = rng.integers(-4, 5, n).astype(np.float32)
    elif kind == "f64":  # distinct in float64, ties in float32 (compared there)
        x = rng.integers(-4, 5, n) * (1 + 1e-10 * rng.random(n))
    elif kind == "sparse_ties":  # survivors within 4 cap: the compacting path
        pos = rng.choice(n, min(n, 3 * cap), replace=False)
        x[pos] = rng.integers(1, 4, pos.size) * rng.choice([-1.0, 1.0], pos.size)
    elif kind == "inf":
        x = rng.integers(-2, 3, n).astype(np.float32)
        x[rng.choice(n, cap // 2 + 1, replace=False)] = rng.choice([-np.inf, np.inf], cap // 2 + 1)
        x[0] = np.nan  # never selected
    elif kind == "smallest_normal":  # the cut's float32 below v is subnormal
        t = np.float32(0)
        tiny = np.finfo(np.float32).tiny
        x[rng.choice(n, 2 * cap, replace=False)] = tiny
        x[-1] = 2 * tiny
    with jax.enable_x64(kind == "f64"):
        xd = jnp.asarray(x, dtype)
        xh = np.asarray(xd)  # the values the device holds
        count = int(np.sum(abs32(xh) > t))
        assert count > cap
        cut, limit = jax.jit(sel.selectors.capacity_cut, static_argnums=3)(
            xd, jnp.float32(t), jnp.int32(count), cap
        )
        want = _cut_reference(xh, t, cap)
        idx, vals = jax.jit(sel.selectors.cut_message, static_argnums=3)(xd, cut, limit, cap)
        np.testing.assert_array_equal(np.asarray(idx), want)
        assert np.asarray(vals).dtype == xh.dtype
        np.testing.assert_array_equal(np.asarray(vals), xh[want])
        for xp, a in ((jnp, xd), (np, xh)):
            mask = np.asarray(_sent_mask(xp, a, np.asarray(cut), np.asarray(limit)))
            np.testing.assert_array_equal(np.flatnonzero(mask), want)


def test_capacity_cut_extract_upper_selects_the_tie_group():
    x = jnp.asarray([3.0, -2.0, 2.0, 1.0, 2.0, -2.0, 4.0], jnp.float32)
    below = np.nextafter(np.float32(2), np.float32(0))
    idx, vals, total = sel.selectors.kernels.extract(x, below, 2, upper=2.0)
    assert int(total) == 4  # |x| == 2 at 1, 2, 4, 5
    np.testing.assert_array_equal(np.asarray(idx), [1, 2])
    np.testing.assert_array_equal(np.asarray(vals), [-2.0, 2.0])
