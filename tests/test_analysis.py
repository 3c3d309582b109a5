"""jaxcomp.analysis: W1 distances to fitted Laplace / Gaussian, and experiments.fit_check."""

import json
import math
import os
import statistics

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxcomp.analysis import fit_distances, tree_fit_distances

_ND = statistics.NormalDist()
_norm_cdf = np.frompyfunc(_ND.cdf, 1, 1)
_norm_ppf = np.frompyfunc(_ND.inv_cdf, 1, 1)


def _brute_w1(x, family, cells=20000):
    """W1 in CDF form, integral |F_n(t) - F(t)| dt, by Simpson's rule in float64.

    The breakpoints hold every sample and every point where F crosses a
    level of F_n, so the integrand is smooth on each cell.
    """
    x = np.sort(np.asarray(x, np.float64).ravel())
    n = x.size
    mu, sd = x.mean(), x.std()
    levels = np.arange(1, n) / n
    if family == "gaussian":

        def cdf(t):
            return _norm_cdf((t - mu) / sd).astype(np.float64)

        cross = mu + sd * _norm_ppf(levels).astype(np.float64)
        width = 12 * sd
    else:
        b = sd / math.sqrt(2)

        def cdf(t):
            e = 0.5 * np.exp(-np.abs(t - mu) / b)
            return np.where(t < mu, e, 1 - e)

        cross = mu + np.where(levels < 0.5, b * np.log(2 * levels), -b * np.log(2 * (1 - levels)))
        width = 40 * b
    t = np.unique(np.concatenate([np.linspace(mu - width, mu + width, cells + 1), x, cross]))
    mid = 0.5 * (t[:-1] + t[1:])
    fn = np.searchsorted(x, mid, side="right") / n
    f = [np.abs(fn - cdf(p)) for p in (t[:-1], mid, t[1:])]
    return float(np.sum(np.diff(t) * (f[0] + 4 * f[1] + f[2]) / 6))


def _sample(kind, n, seed, loc=5e-4, std=5e-3):
    rng = np.random.default_rng(seed)
    if kind == "laplace":
        return rng.laplace(loc, std / math.sqrt(2), n).astype(np.float32)
    return rng.normal(loc, std, n).astype(np.float32)


@pytest.mark.parametrize("kind", ["laplace", "gaussian"])
def test_samples_are_closest_to_their_own_family(kind):
    other = "gaussian" if kind == "laplace" else "laplace"
    for seed in range(3):
        d = fit_distances(_sample(kind, 20000, seed))
        assert float(d[kind]) < float(d[other]) / 3, (seed, d)


@pytest.mark.parametrize("kind", ["laplace", "gaussian"])
def test_distance_to_the_right_family_shrinks_with_sample_size(kind):
    def mean_distance(n):
        return np.mean([float(fit_distances(_sample(kind, n, s))[kind]) for s in range(3)])

    small, large = mean_distance(1000), mean_distance(20000)
    assert large < small / 2.5, (small, large)  # ~ sqrt(20) expected


@pytest.mark.parametrize(
    "n,kind,loc,std",
    [
        (2, "gaussian", 0.0, 1.0),
        (60, "laplace", 0.3, 2.0),
        (60, "gaussian", 5e-4, 5e-3),
        (400, "laplace", 5e-4, 5e-3),
        (400, "gaussian", 10.0, 0.01),  # offset 1000x the spread
    ],
)
def test_agrees_with_brute_force_float32(n, kind, loc, std):
    x = _sample(kind, n, seed=n, loc=loc, std=std)
    d = fit_distances(x)
    for family in ("laplace", "gaussian"):
        assert d[family].dtype == jnp.float32
        np.testing.assert_allclose(float(d[family]), _brute_w1(x, family), rtol=1e-4)


@pytest.mark.parametrize("scale", [1e-25, 1e-20, 1e20, 1e30])
def test_float32_distances_scale_with_the_data(scale):
    # W1 is homogeneous: d(c x) = c d(x). Unscaled, the float32 variance
    # underflowed below |x| ~ 1e-19 (a point mass) and overflowed above ~1e19.
    x = _sample("laplace", 400, seed=3)
    d = fit_distances(x)
    ds = fit_distances((x * scale).astype(np.float32))
    for family in ("laplace", "gaussian"):
        np.testing.assert_allclose(float(ds[family]) / scale, _brute_w1(x, family), rtol=1e-4)
        np.testing.assert_allclose(float(ds[family]) / scale, float(d[family]), rtol=1e-5)


def test_agrees_with_brute_force_float64():
    x = _sample("laplace", 400, seed=1).astype(np.float64)
    with jax.enable_x64(True):
        d = fit_distances(x)
        assert d["laplace"].dtype == jnp.float64
        for family in ("laplace", "gaussian"):
            np.testing.assert_allclose(float(d[family]), _brute_w1(x, family), rtol=1e-8)


def test_two_points_by_hand():
    # x = (-1, 1): mu = 0, sigma = 1; W1 to N(0, 1) is 2 * integral_0^1/2 |-1 - z(u)| du.
    d = fit_distances(jnp.array([-1.0, 1.0]))
    # integral_0^F(-1) (-1 - z(u)) du + integral_F(-1)^1/2 (z(u) + 1) du, with
    # integral z(u) du = -phi(z): (phi(-1) - F(-1)) + (phi(-1) - phi(0) + 1/2 - F(-1)).
    f, phi1, phi0 = _ND.cdf(-1.0), _ND.pdf(-1.0), _ND.pdf(0.0)
    half = (phi1 - f) + (phi1 - phi0 + 0.5 - f)
    np.testing.assert_allclose(float(d["gaussian"]), 2 * half, rtol=1e-6)
    # Laplace(0, b = 1/sqrt(2)): the same with z(u) = b ln(2u), F(-1) = exp(-1/b) / 2.
    b = 1 / math.sqrt(2)
    f = 0.5 * math.exp(-1 / b)

    def h(u):  # integral_0^u b ln(2v) dv
        return b * (u * math.log(2 * u) - u)

    half = (-f - h(f)) + (h(0.5) - h(f) + (0.5 - f))
    np.testing.assert_allclose(float(d["laplace"]), 2 * half, rtol=1e-6)


@pytest.mark.parametrize("value", [0.0, 3.7, -1e-30])
def test_constant_tensor_is_a_point_mass_at_distance_zero(value):
    d = fit_distances(jnp.full((1000,), value))
    assert float(d["laplace"]) == 0.0 and float(d["gaussian"]) == 0.0
    d = fit_distances(jnp.asarray(value))  # one element
    assert float(d["laplace"]) == 0.0 and float(d["gaussian"]) == 0.0


def test_empty_raises():
    with pytest.raises(ValueError, match="x must have at least one element"):
        fit_distances(jnp.zeros((3, 0)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_raises_eagerly_and_is_nan_under_jit(bad):
    x = np.ones(1000, np.float32)
    x[[3, 17]] = [2.0, bad]
    with pytest.raises(ValueError, match="NaN or infinite"):
        fit_distances(x)
    d = jax.jit(fit_distances)(x)
    assert np.isnan(float(d["laplace"])) and np.isnan(float(d["gaussian"]))


def test_jit_matches_eager_and_dtypes_are_upcast():
    x = _sample("laplace", 1000, seed=7)
    eager = fit_distances(x)
    jitted = jax.jit(fit_distances)(x)
    for family in ("laplace", "gaussian"):
        np.testing.assert_allclose(float(jitted[family]), float(eager[family]), rtol=1e-6)
    # Shape does not matter (flattened); bf16 / int inputs are upcast to float32.
    np.testing.assert_allclose(
        float(fit_distances(x.reshape(10, 100))["laplace"]), float(eager["laplace"]), rtol=0
    )
    b = jnp.asarray(x, jnp.bfloat16)
    db = fit_distances(b)
    assert db["laplace"].dtype == jnp.float32
    ref = np.asarray(b, np.float32)
    np.testing.assert_allclose(float(db["laplace"]), _brute_w1(ref, "laplace"), rtol=1e-4)
    di = fit_distances(np.arange(1000) % 7)
    np.testing.assert_allclose(
        float(di["gaussian"]), _brute_w1(np.arange(1000) % 7, "gaussian"), rtol=1e-4
    )


def test_tree_per_leaf_and_geometric_mean_against_numpy():
    tree = {
        "a": {"kernel": _sample("laplace", 400, 0).reshape(20, 20)},
        "b": _sample("gaussian", 60, 1),
        "bias": np.ones(3, np.float32),  # skipped: smaller than min_size
    }
    per_leaf, summary = tree_fit_distances(tree, min_size=40)
    assert sorted(per_leaf) == ["a/kernel", "b"]
    assert summary["num_leaves"] == 2 and summary["num_skipped"] == 1
    leaves = {"a/kernel": tree["a"]["kernel"], "b": tree["b"]}
    for name, x in leaves.items():
        assert per_leaf[name]["size"] == x.size
        for family in ("laplace", "gaussian"):
            np.testing.assert_allclose(
                float(per_leaf[name][family]), _brute_w1(x, family), rtol=1e-4
            )
    for family in ("laplace", "gaussian"):
        ref = np.exp(np.mean(np.log([_brute_w1(x, family) for x in leaves.values()])))
        np.testing.assert_allclose(float(summary[family]), ref, rtol=1e-4)
    closer = sum(float(d["laplace"]) < float(d["gaussian"]) for d in per_leaf.values())
    assert int(summary["laplace_closer"]) == closer
    jit_leaf, jit_summary = jax.jit(lambda t: tree_fit_distances(t, min_size=40))(tree)
    for family in ("laplace", "gaussian"):
        np.testing.assert_allclose(float(jit_summary[family]), float(summary[family]), rtol=1e-6)
        np.testing.assert_allclose(
            float(jit_leaf["b"][family]), float(per_leaf["b"][family]), rtol=1e-6
        )
    # The default min_size (1000) skips every leaf here: a clear error.
    with pytest.raises(ValueError, match="min_size=1000"):
        tree_fit_distances(tree)
    with pytest.raises(ValueError, match="min_size must be >= 1"):
        tree_fit_distances(tree, min_size=0)
    with pytest.raises(ValueError, match="'b': x holds NaN"):
        tree_fit_distances({"b": np.full(60, np.nan, np.float32)}, min_size=1)


def test_fit_check_smoke(tmp_path):
    """A real (tiny) run with the flag: rows per checked epoch, a table and a PNG.

    top_k rather than ldte_bs: the same residual, and a third of the compile time.
    """
    from experiments import fit_check, train

    config = train.TrainConfig(
        compressor="top_k",
        model="mlp",
        dataset="digits",
        epochs=2,
        batch_size=32,
        num_devices=2,
        max_steps_per_epoch=2,
        progress=False,
        checkpoint=False,
        time_split=False,
        fit_check_epochs=(2,),
    )
    train.train_and_evaluate(config, str(tmp_path))
    with open(tmp_path / fit_check.FIT_CHECK_FILE) as f:
        rows = json.load(f)
    assert [(r["epoch"], r["kind"]) for r in rows] == [(2, "gradient"), (2, "residual")]
    for r in rows:
        # MLP kernels 64x256, 256x128, 128x10; the biases are below MIN_SIZE.
        assert sorted(r["per_leaf"]) == ["Dense_0/kernel", "Dense_1/kernel", "Dense_2/kernel"]
        assert r["num_skipped"] == 3
        assert 0 < r["laplace"] < math.inf and 0 < r["gaussian"] < math.inf
    assert os.path.getsize(tmp_path / "fit_check_epoch2.png") > 10000
    table = fit_check.format_table(rows)
    assert table.count("\n") == 2 and "| mlp | 2 |" in table
    with pytest.raises(ValueError, match="fit_check_epochs must be in"):
        train.validate_config(train.TrainConfig(epochs=2, fit_check_epochs=(3,)))


# Issue 39 item 1: the paper's Table 1 units (histogram EMD in bins) beside W1.


def _numpy_histogram_emd(x, family, bins):
    """EMD in bins between numpy's histogram of x and the fit's bin masses (renormalised)."""
    x = np.asarray(x, np.float64).ravel()
    mu, sd = x.mean(), x.std()
    counts, edges = np.histogram(x, bins=bins)
    if family == "gaussian":
        cdf = _norm_cdf((edges - mu) / sd).astype(np.float64)
    else:
        e = 0.5 * np.exp(-np.abs(edges - mu) / (sd / math.sqrt(2)))
        cdf = np.where(edges < mu, e, 1 - e)
    fitted = np.diff(cdf)
    # W1 between two distributions on the bin positions 0..bins-1: the sum of
    # the absolute differences of their cumulative masses.
    gap = np.cumsum(counts / counts.sum() - fitted / fitted.sum())
    return float(np.sum(np.abs(gap[:-1])))


@pytest.mark.parametrize(
    "kind,n,bins,loc,std",
    [
        ("laplace", 20000, 1000, 5e-4, 5e-3),
        ("gaussian", 3000, 1000, 0.0, 1.0),
        ("laplace", 5000, 10, 10.0, 0.01),  # offset 1000x the spread
        ("gaussian", 1000, 1, 0.0, 1.0),  # one bin: nothing moves
    ],
)
def test_histogram_emd_against_numpy(kind, n, bins, loc, std):
    x = _sample(kind, n, seed=n, loc=loc, std=std)
    d = fit_distances(x, bins=bins)
    for family in ("laplace", "gaussian"):
        ref = _numpy_histogram_emd(x, family, bins)
        np.testing.assert_allclose(float(d[family + "_emd"]), ref, rtol=2e-4, atol=1e-5)
        # W1 is unchanged by the new fields.
        np.testing.assert_allclose(float(d[family]), _brute_w1(x, family), rtol=1e-4)
    # Each family's EMD is smallest for its own samples.
    other = "gaussian" if kind == "laplace" else "laplace"
    if bins > 1:
        assert float(d[kind + "_emd"]) < float(d[other + "_emd"])


def test_histogram_emd_is_scale_and_shift_free_and_jit_matches():
    x = _sample("laplace", 4000, seed=5)
    d = fit_distances(x)
    moved = fit_distances((x * 1e4 - 3.0).astype(np.float32))
    jitted = jax.jit(fit_distances)(x)
    for family in ("laplace", "gaussian"):
        key = family + "_emd"
        np.testing.assert_allclose(float(moved[key]), float(d[key]), rtol=5e-3)
        np.testing.assert_allclose(float(jitted[key]), float(d[key]), rtol=1e-6)
        np.testing.assert_allclose(float(d[key]), _numpy_histogram_emd(x, family, 1000), rtol=2e-4)


def test_histogram_emd_degenerate_and_bad_bins():
    for x in (jnp.full((1000,), 2.5), jnp.asarray(1.0)):
        d = fit_distances(x)
        assert float(d["laplace_emd"]) == 0.0 and float(d["gaussian_emd"]) == 0.0
    x = np.ones(1000, np.float32)
    x[3] = np.nan
    assert np.isnan(float(jax.jit(fit_distances)(x)["laplace_emd"]))
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="bins must be an integer"):
            fit_distances(np.arange(10.0), bins=bad)
    with pytest.raises(ValueError, match="bins must be an integer"):
        tree_fit_distances({"a": np.arange(10.0)}, min_size=1, bins=0)


def test_tree_geometric_mean_of_histogram_emd():
    tree = {"a": _sample("laplace", 2000, 0), "b": _sample("gaussian", 1500, 1)}
    per_leaf, summary = tree_fit_distances(tree, bins=50)
    for family in ("laplace", "gaussian"):
        refs = [_numpy_histogram_emd(x, family, 50) for x in tree.values()]
        for name, ref in zip(tree, refs, strict=True):
            np.testing.assert_allclose(float(per_leaf[name][family + "_emd"]), ref, rtol=2e-4)
        np.testing.assert_allclose(
            float(summary[family + "_emd"]), np.exp(np.mean(np.log(refs))), rtol=2e-4
        )


def test_fit_check_paper_list_and_table():
    from experiments import fit_check, gradient_fit

    assert fit_check._models("mlp,paper") == [
        "mlp", "alexnet", "vgg19", "resnet50", "densenet121", "senet18"
    ]  # fmt: skip
    from experiments import data

    ds = data.load_dataset("synthetic_cifar")  # what --models=paper runs on without CIFAR
    n, shape, classes = data.DATASET_SPECS["synthetic_cifar"]
    assert ds.train_x.shape == (n, *shape) == (2048, 32, 32, 3) and ds.num_classes == classes
    # 8x8 digits would pool VGG-19 and AlexNet down to nothing: refused before training.
    with pytest.raises(ValueError, match="need 32x32 images"):
        fit_check.main(["fit_check", "--models=paper", "--dataset=digits"])

    def row(model, epoch, kind, scale):
        return {
            "model": model, "epoch": epoch, "kind": kind, "laplace": 1e-3 * scale,
            "gaussian": 2e-3 * scale, "laplace_emd": 3.0 * scale, "gaussian_emd": 5.0 * scale,
            "laplace_closer": 2, "num_leaves": 3,
        }  # fmt: skip

    rows = [
        row("vgg19", 1, "residual", 1.0),
        row("vgg19", 2, "gradient", 2.0),
        row("vgg19", 2, "residual", 4.0),  # the last epoch's residual is compared
        row("mlp", 2, "residual", 8.0),  # not in the paper's table
        row("alexnet", 1, "gradient", 16.0),  # no residual (dense): the gradient
    ]
    table = fit_check.format_paper_table(rows).splitlines()
    assert len(table) == 4
    assert table[2].startswith("| alexnet | 1 | gradient | 19.273 | 80.000 | 13.248 | 48.000 |")
    assert table[3].startswith("| vgg19 | 2 | residual | 28.810 | 20.000 | 13.628 | 12.000 |")
    assert "Laplace 2/3 | 8.000e-03 | 4.000e-03 |" in table[3]
    assert fit_check.format_paper_table([row("mlp", 1, "residual", 1.0)]) == ""
    # Rows written before the EMD existed still format.
    old = {k: v for k, v in row("mlp", 1, "residual", 1.0).items() if "emd" not in k}
    assert "1.000e-03 (-)" in gradient_fit.format_table([old])
