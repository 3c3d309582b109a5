"""QSVRG (jaxcomp.transforms.qsvrg): the variance-reduced step, the epoch driver's linear
rate against numpy's exact ridge-regression optimum, and the example program."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import distributed as dist
from jaxcomp.distributed import make_qsvrg_epoch
from jaxcomp.transforms.qsvrg import qsvrg

N = 8
FINE = 2**22  # QSGD levels fine enough that Q(v) equals v to ~1e-6 relative


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def _on_mesh(mesh, run, *args):
    """``run`` under ``shard_map`` on ``(array, spec)`` pairs; per-device outputs stacked."""
    specs = tuple(spec for _, spec in args)
    f = jax.jit(jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=P("data"), check_vma=False))
    return np.asarray(f(*(jax.device_put(a, NamedSharding(mesh, s)) for a, s in args)))


def test_step_is_lr_times_variance_reduced_gradient():
    tx = qsvrg(0.3, levels=FINE)
    rng = np.random.default_rng(0)
    g, gs, h = ({"w": jnp.asarray(rng.normal(size=50), jnp.float32)} for _ in range(3))
    f = jax.jit(lambda g, s, gs, h: tx.update(g, s, snapshot_grads=gs, full_grad=h))
    state = tx.init(g)
    u, state = f(g, state, gs, h)
    expected = -0.3 * (np.asarray(g["w"]) - np.asarray(gs["w"]) + np.asarray(h["w"]))
    np.testing.assert_allclose(np.asarray(u["w"]), expected, rtol=1e-5, atol=1e-6)
    assert int(state.step) == 1


def test_mesh_step_is_the_mean_over_devices(mesh):
    tx = qsvrg(0.5, levels=FINE, axis_name="data")
    rng = np.random.default_rng(1)
    g = rng.normal(size=(N, 40)).astype(np.float32)
    gs = rng.normal(size=(N, 40)).astype(np.float32)
    h = rng.normal(size=40).astype(np.float32)

    def run(g, gs, h):
        state = tx.init(g[0])
        u, _ = tx.update(g[0], state, snapshot_grads=gs[0], full_grad=h)
        return u[None]

    u = _on_mesh(mesh, run, (g, P("data")), (gs, P("data")), (h, P()))
    expected = -0.5 * np.mean(g - gs + h, axis=0)
    for i in range(N):
        assert np.array_equal(u[i], u[0])  # the same on every device
    np.testing.assert_allclose(u[0], expected, rtol=1e-5, atol=1e-6)


def test_include_leaves_backup_workers_out_of_the_mean(mesh):
    """``include=`` (backup workers): the mean is over the included devices only."""
    tx = qsvrg(0.5, levels=FINE, axis_name="data")
    rng = np.random.default_rng(4)
    g = rng.normal(size=(N, 24)).astype(np.float32)
    gs = rng.normal(size=(N, 24)).astype(np.float32)
    h = rng.normal(size=24).astype(np.float32)
    inc = np.array([True, False, True, True, False, True, False, True])

    def run(g, gs, h, inc):
        u, _ = tx.update(g[0], tx.init(g[0]), snapshot_grads=gs[0], full_grad=h, include=inc[0])
        return u[None]

    u = _on_mesh(mesh, run, (g, P("data")), (gs, P("data")), (h, P()), (inc, P("data")))
    expected = -0.5 * np.mean((g - gs + h)[inc], axis=0)
    for i in range(N):
        assert np.array_equal(u[i], u[0])
    np.testing.assert_allclose(u[0], expected, rtol=1e-5, atol=1e-6)


def test_injected_learning_rate_equals_the_static_one():
    """optax.inject_hyperparams(qsvrg): the learning rate lives in the state and is traced;
    only the codec's shape-fixing option (levels) is static."""
    rng = np.random.default_rng(6)
    g, gs, h = ({"w": jnp.asarray(rng.normal(size=30), jnp.float32)} for _ in range(3))
    inj = optax.inject_hyperparams(qsvrg, static_args=("levels",))(learning_rate=0.3, levels=FINE)
    update = jax.jit(inj.update)
    si = inj.init(g)
    sr = qsvrg(0.3, levels=FINE).init(g)
    for lr in (0.3, 0.05):  # changed between steps in the state
        si.hyperparams["learning_rate"] = jnp.float32(lr)
        ui, si = update(g, si, snapshot_grads=gs, full_grad=h)
        ur, sr = qsvrg(lr, levels=FINE).update(g, sr, snapshot_grads=gs, full_grad=h)
        expected = -lr * (np.asarray(g["w"]) - np.asarray(gs["w"]) + np.asarray(h["w"]))
        np.testing.assert_allclose(np.asarray(ui["w"]), expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(ui["w"]), np.asarray(ur["w"]), rtol=1e-6)


def test_one_compilation_dtypes_and_nonfinite():
    tx = qsvrg(0.1, bits=4, bucket_size=16)
    traces = []

    def update(g, s, gs, h):
        traces.append(1)
        return tx.update(g, s, snapshot_grads=gs, full_grad=h)

    f = jax.jit(update)
    rng = np.random.default_rng(2)
    spec = {"a": ((), jnp.float32), "e": ((0,), jnp.float32), "b": ((40,), jnp.bfloat16)}

    def tree():
        return {k: jnp.asarray(rng.normal(size=s)).astype(d) for k, (s, d) in spec.items()}

    state = tx.init(tree())
    for _ in range(3):
        u, state = f(tree(), state, tree(), tree())
        for k, (s, d) in spec.items():
            assert u[k].dtype == d and u[k].shape == s
    assert len(traces) == 1
    bad = tree()
    bad["b"] = bad["b"].at[0].set(np.nan)
    u, new = f(bad, state, tree(), tree())
    assert all(not np.any(np.asarray(x, np.float32)) for x in u.values())  # sends nothing
    assert int(new.nonfinite_steps) == int(state.nonfinite_steps) + 1


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: qsvrg(0.0, bits=2), "learning_rate"),
        (lambda: qsvrg(0.1), "bits"),
        (lambda: qsvrg(0.1, bits=2, levels=4), "bits"),
        (lambda: qsvrg(0.1, levels=0), "levels"),
        (lambda: qsvrg(0.1, bits=2, norm="l3"), "norm"),
        (lambda: qsvrg(0.1, bits=2, bucket_size=0), "bucket_size"),
        (lambda: qsvrg(0.1, bits=2, min_dense_size=-1), "min_dense_size"),
    ],
)
def test_bad_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_bad_driver_arguments_and_missing_extra_args(mesh):
    tx = qsvrg(0.1, bits=2)
    loss = lambda w, b: jnp.sum(w)  # noqa: E731
    for kw, arg in (
        (dict(epoch_length=0, batch_size=1), "epoch_length"),
        (dict(epoch_length=1, batch_size=0), "batch_size"),
    ):
        with pytest.raises(ValueError, match=arg):
            make_qsvrg_epoch(loss, tx, mesh, **kw)
    g = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="snapshot_grads"):
        tx.update(g, tx.init(g))
    with pytest.raises(ValueError, match="full_grad"):
        tx.update(g, tx.init(g), snapshot_grads=g, full_grad={"v": jnp.ones(3)})


def test_epoch_rejects_a_transform_that_does_not_exchange(mesh):
    """qsvrg without axis_name would return device 0's own trajectory as the epoch's result
    (out_specs=P() under check_vma=False): refused when the epoch is traced."""
    loss = lambda w, b: 0.5 * jnp.mean((b["x"] @ w["w"] - b["y"]) ** 2)  # noqa: E731
    rng = np.random.default_rng(5)
    data = dist.shard_batch(
        {"x": rng.normal(size=(2 * N, 3)).astype(np.float32), "y": np.ones(2 * N, np.float32)},
        mesh,
    )
    params = dist.replicate({"w": jnp.zeros(3)}, mesh)
    for axis_name, ok in ((None, False), ("data", True)):
        tx = qsvrg(0.1, bits=8, axis_name=axis_name)
        state = dist.init_opt_state(tx, params, mesh)
        epoch = make_qsvrg_epoch(loss, tx, mesh, epoch_length=2, batch_size=1)
        if ok:
            epoch(params, state, data, jax.random.key(0))
        else:
            with pytest.raises(
                ValueError, match=r"\['w'\]\. Build it with qsvrg\(\.\.\., axis_name='data'\)"
            ):
                epoch(params, state, data, jax.random.key(0))


def test_average_of_bfloat16_iterates_is_summed_wide(mesh):
    """average=True: the mean of T identical bfloat16 iterates is that iterate (a sum kept
    in bfloat16 drifts: 200 x 3.0 gave 3.5625)."""
    target = {
        "b": jnp.asarray([3.0, 0.1, -7.3, 250.0], jnp.bfloat16),
        "f": jnp.asarray([3.0, -0.75], jnp.float32),
    }

    def loss(w, batch):  # minimum at `target`: the gradient there is exactly zero
        sq = [jnp.sum((w[k] - target[k]).astype(jnp.float32) ** 2) for k in w]
        return 0.5 * sum(sq) + 0.0 * jnp.sum(batch["x"])

    data = dist.shard_batch({"x": np.ones((N, 1), np.float32)}, mesh)
    params = dist.replicate(target, mesh)
    tx = qsvrg(0.1, bits=8, axis_name="data")
    state = dist.init_opt_state(tx, params, mesh)
    epoch = make_qsvrg_epoch(loss, tx, mesh, epoch_length=200, batch_size=1, average=True)
    out, _, _ = epoch(params, state, data, jax.random.key(0))
    for k in target:  # every iterate equals the start, so must their mean
        assert out[k].dtype == target[k].dtype
        assert np.array_equal(np.asarray(out[k], np.float64), np.asarray(target[k], np.float64))


def _ridge(seed=3, per_device=64, dim=16, lam=0.02):
    rng = np.random.default_rng(seed)
    a = (rng.normal(size=(N * per_device, dim)) / np.sqrt(dim)).astype(np.float32)
    y = (a @ rng.normal(size=dim) + 0.1 * rng.normal(size=len(a))).astype(np.float32)
    # Exact optimum from the augmented least-squares system [A; sqrt(lam M) I] w ~ [y; 0].
    m = len(a)
    aug = np.vstack([a.astype(np.float64), np.sqrt(lam * m) * np.eye(dim)])
    w_star = np.linalg.lstsq(aug, np.r_[y.astype(np.float64), np.zeros(dim)], rcond=None)[0]

    def f(w):
        w = np.asarray(w, np.float64)
        return 0.5 * np.mean((a.astype(np.float64) @ w - y) ** 2) + 0.5 * lam * w @ w

    def loss(w, b):
        return 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2) + 0.5 * lam * jnp.sum(w * w)

    return {"x": a, "y": y}, loss, f, f(w_star)


def test_linear_convergence_against_the_exact_optimum(mesh):
    """Suboptimality shrinks by at least a constant factor every epoch (QSVRG), while
    quantized SGD with the same step, codec and sampler stalls at a noise floor."""
    data, loss, f, f_star = _ridge()
    batch = dist.shard_batch(data, mesh)
    epochs, subs = 7, {}
    for reduced in (True, False):
        tx = qsvrg(0.1, bits=2, axis_name="data", seed=1)
        params = dist.replicate(jnp.zeros(16, jnp.float32), mesh)
        state = dist.init_opt_state(tx, params, mesh)
        epoch = make_qsvrg_epoch(
            loss, tx, mesh, epoch_length=150, batch_size=4, variance_reduced=reduced
        )
        sub = [f(np.zeros(16)) - f_star]
        for p in range(epochs):
            params, state, metrics = epoch(params, state, batch, jax.random.key(p))
            sub.append(f(np.asarray(params)) - f_star)
        subs[reduced] = np.array(sub)
        if reduced:
            n_bytes = float(metrics["wire_bytes"])
    vr, plain = subs[True], subs[False]
    assert np.all(vr > 0)
    ratios = vr[1:] / vr[:-1]
    assert np.all(ratios <= 0.5), ratios  # linear: a constant factor every epoch
    assert vr[-1] <= 1e-5 * vr[0]
    assert plain[-1] >= 100 * vr[-1], (plain, vr)  # the noise floor of quantized SGD
    # One dense all-reduce of the full gradient plus 150 packed 4-bit messages (s = 4).
    message = 16 * 4 // 8 + 4
    assert n_bytes == pytest.approx(2 * (N - 1) / N * 16 * 4 + 150 * (N - 1) * message)


def test_example_program_writes_json_and_png(tmp_path, mesh):
    from experiments import qsvrg as example  # noqa: PLC0415

    result = example.run(epochs=2, epoch_length=20, dim=8, examples_per_device=16, mesh=mesh)
    json_path, png_path = example.write(result, tmp_path)
    loaded = json.loads(json_path.read_text())
    assert len(loaded["qsvrg"]["suboptimality"]) == 3
    assert loaded["qsvrg"]["suboptimality"][-1] < loaded["qsvrg"]["suboptimality"][0]
    assert png_path.stat().st_size > 0


# --- Paper mode (variant="paper"): section 3.3 and Theorem 3.6 exactly ---------------------


def test_paper_mode_quantizes_the_whole_vector_with_ceil_sqrt_n_levels():
    """Every output is a level k/s of its leaf's l2 norm with s = ceil(sqrt(50)) = 8, k the floor
    or ceiling of |v_i| s / ||v||, signs kept, and the mean over many steps is v (unbiased)."""
    rng = np.random.default_rng(7)
    v = {
        "a": rng.normal(size=(5, 6)).astype(np.float32),
        "b": rng.normal(size=20).astype(np.float32),
    }
    zeros = jax.tree.map(np.zeros_like, v)
    s = 8  # n = 30 + 20 = 50 parameters, ceil(sqrt(50)) = 8
    tx = qsvrg(1.0, variant="paper", seed=3)

    def steps(state, _):
        u, state = tx.update(v, state, snapshot_grads=zeros, full_grad=zeros)
        return state, jax.tree.map(lambda x: -x, u)

    k = 2000
    _, q = jax.jit(lambda st: jax.lax.scan(steps, st, None, length=k))(tx.init(v))
    for name, x in v.items():
        x = x.astype(np.float64)
        qk = np.asarray(q[name], np.float64)
        norm = np.linalg.norm(x)
        r = np.abs(x) / norm * s
        level = np.abs(qk) * s / norm
        np.testing.assert_allclose(level, np.round(level), atol=1e-4)
        level = np.round(level)
        assert np.all((level == np.floor(r)) | (level == np.ceil(r)))
        assert np.all((level == 0) | (np.sign(qk) == np.sign(x)))
        # Unbiased: per coordinate the rounding variance is at most (norm / s)^2 / 4.
        np.testing.assert_array_less(np.abs(qk.mean(0) - x), 5 * norm / s / 2 / np.sqrt(k))


def test_paper_mode_levels_and_bit_bound_by_hand():
    from jaxcomp import coding  # noqa: PLC0415
    from jaxcomp.transforms.qsvrg import qsvrg_paper_levels  # noqa: PLC0415

    assert [qsvrg_paper_levels(n) for n in (1, 2, 4, 5, 16, 17, 32, 1024)] == [
        1,
        2,
        2,
        3,
        4,
        5,
        6,
        32,
    ]
    # Theorem 3.6: (F + 2.8 n)(T + 1) + F n, F = 32 bits.
    assert coding.qsvrg_epoch_bits_bound(32, 200) == pytest.approx(121.6 * 201 + 1024)
    assert coding.qsvrg_epoch_bits_bound(1024, 100) == pytest.approx((32 + 2867.2) * 101 + 32768)
    assert coding.qsvrg_epoch_bits_bound(10, 1, float_bits=16) == pytest.approx(44 * 2 + 160)


def _paper_reference(a, y, lam, w0, lr, idx, epochs):
    """QSVRG as section 3.3 states it, in float64 (Q the identity: fine levels)."""
    n_dev, per_device = idx.shape[1], len(a) // idx.shape[1]

    def grad(w, rows):  # mean over `rows` of a_j (a_j.w - y_j) + lam w
        return a[rows].T @ (a[rows] @ w - y[rows]) / len(rows) + lam * w

    x, snapshots = w0.astype(np.float64), []
    for p in range(epochs):
        ysnap = x.copy()
        full = grad(ysnap, np.arange(len(a)))
        iterates = []
        for t in range(idx.shape[2]):
            iterates.append(x)  # x_t, t = 1..T (x_1 = the snapshot)
            v = [
                grad(x, [i * per_device + idx[p, i, t]])
                - grad(ysnap, [i * per_device + idx[p, i, t]])
                + full
                for i in range(n_dev)
            ]
            x = x - lr * np.mean(v, axis=0)
        x = np.mean(iterates, axis=0)  # y^(p+1) = (1/T) sum_t x_t
        snapshots.append(x)
    return snapshots


def test_paper_epoch_matches_a_numpy_reference(mesh):
    """make_qsvrg_epoch(batch_size=1, average=True): single-example steps (the driver's sampled
    indices reproduced from the same keys) and the snapshot the mean of x_1..x_T."""
    rng = np.random.default_rng(8)
    per_device, dim, lam, lr, T, epochs = 6, 5, 0.05, 0.3, 7, 3
    a = rng.normal(size=(N * per_device, dim)).astype(np.float32)
    y = rng.normal(size=N * per_device).astype(np.float32)

    def loss(w, b):
        return 0.5 * jnp.mean((b["x"] @ w - b["y"]) ** 2) + 0.5 * lam * jnp.sum(w * w)

    tx = qsvrg(lr, levels=FINE, axis_name="data")
    params = dist.replicate(jnp.zeros(dim, jnp.float32), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    epoch = make_qsvrg_epoch(loss, tx, mesh, epoch_length=T, batch_size=1, average=True)
    data = dist.shard_batch({"x": a, "y": y}, mesh)
    got = []
    for p in range(epochs):
        params, state, _ = epoch(params, state, data, jax.random.key(p))
        got.append(np.asarray(params))
    # The driver's sampler: device i, step t draws from fold_in(fold_in(key, i), t).
    idx = np.array(
        [
            [
                [
                    int(
                        jax.random.randint(
                            jax.random.fold_in(jax.random.fold_in(jax.random.key(p), i), t),
                            (1,),
                            0,
                            per_device,
                        )[0]
                    )
                    for t in range(T)
                ]
                for i in range(N)
            ]
            for p in range(epochs)
        ]
    )
    want = _paper_reference(
        a.astype(np.float64), y.astype(np.float64), lam, np.zeros(dim), lr, idx, epochs
    )
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_paper_mode_converges_linearly_and_counts_its_bytes(mesh):
    """variant='paper' (s = ceil(sqrt(16)) = 4), batch 1, averaged snapshots: f - f* shrinks
    every epoch; bytes = one dense all-reduce + T packed messages from the 7 other devices."""
    data, loss, f, f_star = _ridge()
    batch = dist.shard_batch(data, mesh)
    tx = qsvrg(0.1, variant="paper", axis_name="data", seed=2)
    params = dist.replicate(jnp.zeros(16, jnp.float32), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    epoch = make_qsvrg_epoch(loss, tx, mesh, epoch_length=150, batch_size=1, average=True)
    sub = [f(np.zeros(16)) - f_star]
    for p in range(5):
        params, state, metrics = epoch(params, state, batch, jax.random.key(p))
        sub.append(f(np.asarray(params)) - f_star)
    sub = np.array(sub)
    assert np.all(sub[1:] / sub[:-1] <= 0.7), sub
    message = 16 * 4 // 8 + 4  # s = 4: 1 + ceil(log2 5) = 4 bits per value, one float32 norm
    n_bytes = float(metrics["wire_bytes"])
    assert n_bytes == pytest.approx(2 * (N - 1) / N * 16 * 4 + 150 * (N - 1) * message)


@pytest.mark.parametrize(
    "kw,arg",
    [
        (dict(variant="exact"), "variant"),
        (dict(variant="paper", bits=2), "bits"),
        (dict(variant="paper", levels=4), "levels"),
        (dict(variant="paper", bucket_size=16), "bucket_size"),
        (dict(variant="paper", norm="max"), "norm"),
        (dict(variant="paper", min_dense_size=-1), "min_dense_size"),
    ],
)
def test_paper_mode_bad_arguments(kw, arg):
    with pytest.raises(ValueError, match=arg):
        qsvrg(0.1, **kw)


def test_paper_bound_and_levels_bad_arguments():
    from jaxcomp import coding  # noqa: PLC0415
    from jaxcomp.transforms.qsvrg import qsvrg_paper_levels  # noqa: PLC0415

    for call, arg in (
        (lambda: coding.qsvrg_epoch_bits_bound(0, 10), "n"),
        (lambda: coding.qsvrg_epoch_bits_bound(8, 0), "epoch_length"),
        (lambda: coding.qsvrg_epoch_bits_bound(8, 1, float_bits=0), "float_bits"),
        (lambda: qsvrg_paper_levels(0), "n"),
    ):
        with pytest.raises(ValueError, match=arg):
            call()


def test_example_program_paper_mode_reports_theorem_3_6(tmp_path, mesh):
    from experiments import qsvrg as example  # noqa: PLC0415

    with pytest.raises(ValueError, match="batch_size"):
        example.run(variant="paper", batch_size=4, mesh=mesh)
    dim, T = 8, 20
    result = example.run(
        variant="paper",
        batch_size=1,
        epochs=2,
        epoch_length=T,
        dim=dim,
        examples_per_device=16,
        mesh=mesh,
    )
    json_path, _ = example.write(result, tmp_path)
    bits = json.loads(json_path.read_text())["qsvrg"]["bits_per_epoch"]
    assert bits["theorem_3_6"] == pytest.approx((32 + 2.8 * dim) * (T + 1) + 32 * dim)
    # s = ceil(sqrt(8)) = 3: 3 bits per value (8 values: 3 bytes) + a float32 norm = 7 bytes.
    assert bits["packed"] == [32 * dim + 8 * T * 7] * 2
    # Elias-coded: T whole-byte messages, each more than its 32-bit norm.
    for e in bits["elias"]:
        assert e > 32 * dim + 32 * T and (e - 32 * dim) % (8 * T) == 0
