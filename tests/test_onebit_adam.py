"""1-bit Adam and 0/1 Adam (jaxcomp.transforms.adam), and the EF-before-Adam mistake.

References: optax.adam (warm-up), numpy re-implementations of one step of
each algorithm from the same state (the papers' / DeepSpeed's formulas), a
pure-Python copy of DeepSpeed's ZeroOneAdam counters, and exact least-squares
optima from numpy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_update, np_compressed_allreduce, sign_codec
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import aggregation as agg
from jaxcomp import distributed as dist
from jaxcomp.transforms.adam import onebit_adam, zero_one_adam

N = 8
B1, B2, EPS = 0.9, 0.999, 1e-8


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def _stacked(tree, mesh):
    sh = NamedSharding(mesh, P("data"))
    return jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sh), tree)


def _stack_init(tx, params, mesh):
    return _stacked(jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), tx.init(params)), mesh)


# ---------------------------------------------------------------------------
# 1-bit Adam.
# ---------------------------------------------------------------------------


def _lsq_problem(seed=0, n=16, d=12):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=(N * n, d)).astype(np.float32)
    y = (a @ rng.normal(size=d) + 1.0 + 0.1 * rng.normal(size=N * n)).astype(np.float32)
    return {"x": a, "y": y}


def _lsq_loss(w, b):
    return 0.5 * jnp.mean((b["x"] @ w["w"] + w["b"] - b["y"]) ** 2)


def test_warmup_is_optax_adam_on_the_mean_gradient(mesh):
    """8 devices, make_train_step: warm-up == dense pmean + optax.adam, to float32 rounding."""
    batch = dist.shard_batch(_lsq_problem(), mesh)
    lr, steps = 0.05, 5

    def run(tx):
        params = dist.replicate({"w": jnp.zeros(12), "b": jnp.zeros(())}, mesh)
        state = dist.init_opt_state(tx, params, mesh)
        step = dist.make_train_step(_lsq_loss, tx, mesh, unexchanged="error")
        out = []
        for _ in range(steps):
            params, state, metrics = step(params, state, batch)
            out.append(jax.tree.map(np.asarray, jax.block_until_ready(params)))
        return out, metrics

    ref, ref_metrics = run(optax.chain(dist.dense_exchange("data"), optax.adam(lr)))
    got, metrics = run(onebit_adam(lr, freeze_step=100, axis_name="data"))
    for r, g in zip(ref, got, strict=True):
        for leaf in r:
            np.testing.assert_allclose(g[leaf], r[leaf], rtol=2e-6, atol=1e-8)
    # Dense exchange of the gradient: the same bytes as the baseline, plus the 4-byte
    # all-reduce that counts the devices with finite gradients.
    extra = 2 * (N - 1) / N * 4
    assert float(metrics["wire_bytes"]) == pytest.approx(float(ref_metrics["wire_bytes"]) + extra)


def test_warmup_single_device_bit_for_bit():
    lr = 0.1
    tx, ref = onebit_adam(lr, freeze_step=10), optax.adam(lr)
    g_rng = np.random.default_rng(1)
    params = {"a": jnp.zeros((7,), jnp.float32), "s": jnp.zeros((), jnp.float32)}
    s, r = tx.init(params), ref.init(params)
    f, fr = jax.jit(tx.update), jax.jit(ref.update)
    for _ in range(4):
        g = jax.tree.map(lambda p: jnp.asarray(g_rng.normal(size=p.shape), jnp.float32), params)
        u, s = f(g, s)
        ur, r = fr(g, r)
        for leaf in params:
            assert np.array_equal(np.asarray(u[leaf]), np.asarray(ur[leaf])), leaf
            assert np.array_equal(np.asarray(s.nu[leaf]), np.asarray(r[0].nu[leaf])), leaf


@pytest.mark.parametrize("bias_correction", [True, False])
def test_compressed_step_matches_numpy_reference(mesh, bias_correction):
    """After the freeze: local momentum, 1-bit EF exchange, frozen v; per device vs numpy."""
    lr, freeze, d = 0.01, 3, 40
    tx = onebit_adam(lr, freeze_step=freeze, axis_name="data", bias_correction=bias_correction)
    upd_fn = mesh_update(tx, mesh)
    rng = np.random.default_rng(2)
    state = _stack_init(tx, {"w": jnp.zeros(d)}, mesh)
    for _ in range(freeze + 2):  # warm-up, then two compressed steps: residuals differ
        g = {"w": rng.normal(size=(N, d)).astype(np.float32)}
        _, state = upd_fn(_stacked(g, mesh), state)
    old = jax.tree.map(np.asarray, state)
    g = {"w": rng.normal(size=(N, d)).astype(np.float32)}
    upd, new = jax.tree.map(np.asarray, upd_fn(_stacked(g, mesh), state))

    t = int(old.count[0]) + 1
    mu, nu = old.mu["w"][0], old.nu["w"][0]
    assert all(np.array_equal(old.nu["w"][i], nu) for i in range(N))  # replicated
    m_i = (1 - np.float32(B1)) * g["w"] + np.float32(B1) * mu
    acc = old.residual["w"] + m_i
    sent = np.stack([sign_codec(a) for a in acc])
    m = sent.sum(0, dtype=np.float64) / N
    if bias_correction:
        m_hat, nu_hat = m / (1 - B1**t), nu / (1 - B2**freeze)
    else:
        m_hat, nu_hat = m, nu
    expected = -lr * m_hat / (np.sqrt(nu_hat.astype(np.float64)) + EPS)
    for i in range(N):
        # Identical on every device (replicated parameters stay replicated) ...
        assert np.array_equal(upd["w"][i], upd["w"][0])
        assert np.array_equal(new.mu["w"][i], new.mu["w"][0])
        # ... and equal to the reference.
        np.testing.assert_allclose(upd["w"][i], expected, rtol=1e-5, atol=1e-9)
        np.testing.assert_allclose(new.mu["w"][i], m, rtol=1e-5, atol=1e-9)
        # Nothing lost per device: residual == accumulated momentum - sent.
        np.testing.assert_allclose(new.residual["w"][i], acc[i] - sent[i], rtol=0, atol=1e-6)
        np.testing.assert_array_equal(new.nu["w"][i], nu)  # v frozen
    assert int(new.message_bytes["w"][0]) == 40 // 8 + 4  # 1 bit per coordinate + one scale
    assert float(new.wire_bytes[0]) == pytest.approx((N - 1) * 9 + 2 * (N - 1) / N * 4 * 2)


def _lsq_single(seed=0, n=200, d=50):
    rng = np.random.default_rng(seed)
    a = (rng.normal(size=(n, d)) * np.linspace(0.3, 2, d)).astype(np.float32)
    y = (a @ rng.normal(size=d) + 0.1 * rng.normal(size=n)).astype(np.float32)
    a64, y64 = a.astype(np.float64), y.astype(np.float64)
    w_opt = np.linalg.lstsq(a64, y64, rcond=None)[0]

    def f(w):
        return 0.5 * np.mean((a64 @ np.asarray(w, np.float64) - y64) ** 2)

    return a, y, f, f(w_opt), f(np.zeros(d))


def _relative_suboptimality(tx, problem, steps=400):
    """Full-batch least squares on one device, lax.scan; (f(w) - f*) / (f(0) - f*)."""
    a, y, f, f_star, f_zero = problem

    def loss(w):
        return 0.5 * jnp.mean((a @ w - y) ** 2)

    def body(carry, _):
        w, st = carry
        u, st = tx.update(jax.grad(loss)(w), st, w)
        return (optax.apply_updates(w, u), st), None

    w0 = jnp.zeros(a.shape[1])
    run = jax.jit(lambda w, s: jax.lax.scan(body, (w, s), None, length=steps)[0][0])
    w = run(w0, tx.init(w0))
    return (f(w) - f_star) / (f_zero - f_star)


@pytest.fixture(scope="module")
def lsq():
    return _lsq_single()


def test_error_feedback_before_adam_is_the_mistake(lsq):
    """EF assumes a linear optimizer after the compressor: fine before SGD, broken before Adam.

    Measured on full-batch least squares (one device, deterministic, 400
    steps): a compressor with error feedback before SGD ends where SGD ends;
    the same compressor before optax.adam ends thousands of times worse than
    Adam and far worse than before SGD; 1-bit Adam (compressing the momentum
    under a frozen variance) ends far better than either mistake.
    """
    lr_adam, lr_sgd = 0.03, 0.1
    compressors = {"top_k": lambda: jaxcomp.top_k(0.1), "ef_sign": lambda: jaxcomp.ef_sign_sgd()}
    sub = {"adam": _relative_suboptimality(optax.adam(lr_adam), lsq)}
    sub["sgd"] = _relative_suboptimality(optax.sgd(lr_sgd), lsq)
    sub["onebit_adam"] = _relative_suboptimality(onebit_adam(lr_adam, freeze_step=300), lsq)
    for name, make in compressors.items():
        sub[f"{name}>sgd"] = _relative_suboptimality(optax.chain(make(), optax.sgd(lr_sgd)), lsq)
        sub[f"{name}>adam"] = _relative_suboptimality(optax.chain(make(), optax.adam(lr_adam)), lsq)
    for name in compressors:
        assert sub[f"{name}>sgd"] <= 1.5 * sub["sgd"], sub  # EF + linear optimizer: no loss
        assert sub[f"{name}>adam"] >= 1000 * sub["adam"], sub  # EF + Adam: broken
        assert sub[f"{name}>adam"] >= 30 * sub[f"{name}>sgd"], sub
        assert sub[f"{name}>adam"] >= 20 * sub["onebit_adam"], sub
    assert sub["onebit_adam"] < 1e-4, sub


# ---------------------------------------------------------------------------
# 0/1 Adam.
# ---------------------------------------------------------------------------


def deepspeed_schedule(steps, var_freeze_step, var_update_scaler, local_scaler, clipper):
    """(kind per step t = 1..steps) from a copy of DeepSpeed ZeroOneAdam's counters.

    ``"var"`` (dense, v updated), ``"onebit"`` (stage 1, 1-bit gradient),
    ``"local"`` (stage 2, no communication) or ``"sync"`` (stage 2, 1-bit sync).
    """
    var_interval, var_counter, local_interval, local_counter = 1, 0, 1, 0
    kinds = []
    for t in range(1, steps + 1):
        if t <= var_freeze_step:
            is_var = t % var_interval == 0
            kinds.append("var" if is_var else "onebit")
            if is_var:
                var_counter += 1
                if var_counter == var_update_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            kinds.append("sync" if t % local_interval == 0 else "local")
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
    return kinds


def test_zero_one_adam_schedule_matches_deepspeed():
    steps, d = 90, 64
    kw = dict(var_freeze_step=40, var_update_scaler=3, local_step_scaler=6, local_step_clipper=4)
    tx = zero_one_adam(0.01, **kw)
    f = jax.jit(tx.update)
    g = {"w": jnp.asarray(np.random.default_rng(3).normal(size=d), jnp.float32)}
    state = tx.init(g)
    got = []
    for _ in range(steps):
        nu_count = int(state.nu_count)
        _, state = f(g, state)
        mb = int(state.message_bytes["w"])
        if int(state.nu_count) == nu_count + 1:
            assert mb == d * 4
            got.append("var")
        elif mb == 0:
            got.append("local")
        else:
            assert mb == d // 8 + 4
            got.append("onebit" if int(state.count) <= 40 else "sync")
    want = deepspeed_schedule(steps, 40, 3, 6, 4)
    assert got == want
    assert set(want) == {"var", "onebit", "local", "sync"}


def zero_one_sync_reference(old, g, lr, t, nu_count):
    """numpy: one stage-2 sync step of 0/1 Adam (DeepSpeed's order of operations) per device."""
    mu, nu = old.mu["w"], old.nu["w"][0]  # m differs per device after local steps
    d = np.sqrt(nu / (1 - B2**nu_count)) + EPS
    m_i = (1 - np.float32(B1)) * g + np.float32(B1) * mu
    step = lr * (m_i / (1 - B1**t)) / d  # this step's local move (positive: p -= step)
    c_i = (old.accumulator["w"] - step) * d  # -sum lr m_hat over the interval
    acc = old.residual["w"] + c_i
    sent = np.stack([sign_codec(a) for a in acc])
    c = sent.sum(0, dtype=np.float64) / N
    lr_sum = old.lr_sum[0] + lr
    upd = c / d - old.accumulator["w"]  # from (last sync + accumulator) to last sync + c / d
    mu_new = -c / lr_sum * (1 - B1**t)
    return upd, mu_new, acc - sent


def test_zero_one_adam_local_steps_and_sync_on_replicas(mesh):
    """Per-device replicas (make_gossip_train_step, mix_params=False): local steps diverge,
    a sync brings every replica to the same point; the sync step matches numpy."""
    lr, d = 0.02, 24
    kw = dict(var_freeze_step=4, var_update_scaler=2, local_step_scaler=2, local_step_clipper=4)
    tx = zero_one_adam(lr, axis_name="data", **kw)
    upd_fn = mesh_update(tx, mesh)
    rng = np.random.default_rng(4)
    state = _stack_init(tx, {"w": jnp.zeros(d)}, mesh)
    params = np.zeros((N, d), np.float32)
    kinds = deepspeed_schedule(16, 4, 2, 2, 4)
    checked_sync = 0
    for t, kind in enumerate(kinds, start=1):
        g = {"w": rng.normal(size=(N, d)).astype(np.float32)}
        old = jax.tree.map(np.asarray, state)
        upd, state = upd_fn(_stacked(g, mesh), state)
        upd = np.asarray(upd["w"])
        params = params + upd
        if kind == "local":
            assert float(np.asarray(state.wire_bytes)[0]) == 0.0
            assert not np.allclose(params[0], params[1])  # replicas differ between syncs
        else:
            spread = np.max(np.abs(params - params[0]))
            assert spread <= 1e-6 * max(1.0, np.max(np.abs(params))), (t, kind, spread)
        if kind == "sync" and np.any(old.accumulator["w"]):
            ref_upd, ref_mu, ref_res = zero_one_sync_reference(
                old, g["w"], lr, t, int(old.nu_count[0])
            )
            new = jax.tree.map(np.asarray, state)
            for i in range(N):
                np.testing.assert_allclose(upd[i], ref_upd[i], rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(new.mu["w"][i], ref_mu, rtol=1e-5, atol=1e-7)
                np.testing.assert_allclose(new.residual["w"][i], ref_res[i], atol=1e-6)
            assert not np.any(new.accumulator["w"]) and not np.any(new.lr_sum)
            checked_sync += 1
    assert checked_sync >= 2


def test_zero_one_adam_gossip_step_trains(mesh):
    """End to end with make_gossip_train_step(mix_params=False): ends close to dense Adam."""
    data = _lsq_problem(5)
    batch = dist.shard_batch(data, mesh)
    params0 = {"w": jnp.zeros(12), "b": jnp.zeros(())}
    a = np.c_[data["x"], np.ones(len(data["y"]))].astype(np.float64)
    w_opt = np.linalg.lstsq(a, data["y"].astype(np.float64), rcond=None)[0]

    def f(w):
        return 0.5 * np.mean((a @ w - data["y"]) ** 2)

    def run(tx, steps=80):
        reps = agg.stack_replicas(params0, mesh)
        state = agg.init_replica_opt_state(tx, reps, mesh)
        step = agg.make_gossip_train_step(_lsq_loss, tx, mesh, mix_params=False)
        for _ in range(steps):
            reps, state, _ = step(reps, state, batch)
            jax.block_until_ready(reps)
        w = np.c_[np.asarray(reps["w"]), np.asarray(reps["b"])]
        assert np.max(np.abs(w - w[0])) <= 1e-5  # step 80 syncs: the replicas agree
        return (f(w[0]) - f(w_opt)) / (f(np.zeros(13)) - f(w_opt))

    kw = dict(var_freeze_step=20, var_update_scaler=4, local_step_scaler=10, local_step_clipper=4)
    ours = run(zero_one_adam(0.1, axis_name="data", **kw))
    adam = run(optax.chain(dist.dense_exchange("data"), optax.adam(0.1)))
    assert ours <= max(3 * adam, 1e-3), (ours, adam)


def test_zero_one_adam_sync_with_zero_learning_rate_keeps_the_momentum():
    """A stage-2 sync where the schedule is 0 (lr_sum == 0): the error feedback is still
    applied (c / d, numpy), and m stays the local momentum; m was -c / 0 = inf."""
    sched = lambda count: jnp.where(count == 3, 0.0, 0.01)  # noqa: E731  (step t = 4)
    tx = zero_one_adam(sched, var_freeze_step=2, local_step_clipper=1)
    rng = np.random.default_rng(8)
    g = {"w": rng.normal(size=10).astype(np.float32)}
    state, update = tx.init(g), jax.jit(tx.update)
    for _ in range(3):  # two variance steps, a sync that leaves a residual
        _, state = update(g, state)
    old = jax.tree.map(np.asarray, state)
    upd, state = update(g, state)
    e = old.residual["w"]
    d = np.sqrt(old.nu["w"].astype(np.float64) / (1 - B2**2)) + EPS
    np.testing.assert_allclose(upd["w"], sign_codec(e) / d, rtol=1e-5)
    np.testing.assert_allclose(state.residual["w"], e - sign_codec(e), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(state.mu["w"], B1 * old.mu["w"] + (1 - B1) * g["w"], rtol=1e-6)
    upd, state = update(g, state)  # lr 0.01 again: a normal sync
    assert np.all(np.isfinite(np.asarray(upd["w"]))) and np.all(np.abs(state.mu["w"]) < 10)


def test_make_train_step_rejects_local_steps(mesh):
    tx = zero_one_adam(0.1, var_freeze_step=2, axis_name="data")
    params = dist.replicate({"w": jnp.zeros(12), "b": jnp.zeros(())}, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(_lsq_loss, tx, mesh)
    with pytest.raises(ValueError, match="local_step_clipper") as info:
        step(params, state, dist.shard_batch(_lsq_problem(), mesh))
    assert "apply_if_finite" not in str(info.value)  # raised as it is, not wrapped


def test_zero_one_adam_without_local_steps_under_make_train_step(mesh):
    tx = zero_one_adam(0.05, var_freeze_step=3, local_step_clipper=1, axis_name="data")
    params = dist.replicate({"w": jnp.zeros(12), "b": jnp.zeros(())}, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(_lsq_loss, tx, mesh, unexchanged="error")
    batch = dist.shard_batch(_lsq_problem(), mesh)
    losses = []
    for _ in range(8):
        params, state, metrics = step(params, state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0]
    assert int(np.asarray(state.count)[0]) == 8


# ---------------------------------------------------------------------------
# Non-finite gradients on one device (the conformance checks of both optimizers
# are in test_conformance.py, family OPTIMIZERS).
# ---------------------------------------------------------------------------


def test_one_device_with_nan_is_left_out_of_the_mean(mesh):
    """8 devices, device 3's gradient NaN: the mean is over the other 7, its residual kept."""
    lr, d = 0.01, 16
    tx = onebit_adam(lr, freeze_step=1, axis_name="data")
    upd_fn = mesh_update(tx, mesh)
    rng = np.random.default_rng(9)
    state = _stack_init(tx, {"w": jnp.zeros(d)}, mesh)
    _, state = upd_fn(_stacked({"w": rng.normal(size=(N, d)).astype(np.float32)}, mesh), state)
    _, state = upd_fn(_stacked({"w": rng.normal(size=(N, d)).astype(np.float32)}, mesh), state)
    old = jax.tree.map(np.asarray, state)
    g = rng.normal(size=(N, d)).astype(np.float32)
    g[3, 5] = np.nan
    _, new = jax.tree.map(np.asarray, upd_fn(_stacked({"w": g}, mesh), state))
    mu = old.mu["w"][0]
    acc = old.residual["w"] + ((1 - np.float32(B1)) * g + np.float32(B1) * mu)
    ok = [i for i in range(N) if i != 3]
    m = np.mean([sign_codec(acc[i]) for i in ok], axis=0)
    np.testing.assert_allclose(new.mu["w"][0], m, rtol=1e-5, atol=1e-8)
    assert np.array_equal(new.residual["w"][3], old.residual["w"][3])
    assert int(new.nonfinite_steps[3]) == 1 and int(new.nonfinite_steps[0]) == 0


@pytest.mark.parametrize(
    "make,arg",
    [
        (lambda: onebit_adam(0.1, freeze_step=-1), "freeze_step"),
        # 0: v frozen at 0, the optimizer never moved (0/1 Adam: NaN updates).
        (lambda: onebit_adam(0.1, freeze_step=0), r"freeze_step must be .* \[1,"),
        (lambda: zero_one_adam(0.1, var_freeze_step=0), r"var_freeze_step must be .* \[1,"),
        (lambda: onebit_adam(0.1, freeze_step=1.5), "freeze_step"),
        (lambda: zero_one_adam(0.1, var_freeze_step=-2), "var_freeze_step"),
        (lambda: zero_one_adam(0.1, var_freeze_step=2, var_update_scaler=0), "var_update_scaler"),
        (lambda: zero_one_adam(0.1, var_freeze_step=2, local_step_scaler=0), "local_step_scaler"),
        (lambda: zero_one_adam(0.1, var_freeze_step=2, local_step_clipper=0), "local_step_clipper"),
    ],
)
def test_bad_schedule_arguments(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_float16_dense_mean_does_not_overflow(mesh):
    """float16 gradients whose sum over the devices exceeds 65504 but whose mean fits: the
    dense (warm-up / variance) step's mean matches numpy's; the sum overflowed to inf."""
    rng = np.random.default_rng(3)
    g = (40000 + 1000 * rng.normal(size=(N, 6))).astype(np.float16)
    mean = g.astype(np.float64).mean(0)
    for tx in (
        onebit_adam(0.1, freeze_step=5, axis_name="data"),
        zero_one_adam(0.1, var_freeze_step=5, local_step_clipper=1, axis_name="data"),
    ):
        state = _stack_init(tx, {"w": jnp.zeros(6, jnp.float16)}, mesh)
        _, new = mesh_update(tx, mesh)(_stacked({"w": g}, mesh), state)
        # float16 shares (g / N) added in float16: a few float16 roundings of the mean.
        np.testing.assert_allclose(np.asarray(new.mu["w"])[0], (1 - B1) * mean, rtol=2e-3)
        np.testing.assert_allclose(np.asarray(new.nu["w"])[0], (1 - B2) * mean**2, rtol=4e-3)


def test_leaves_split_over_an_explicit_mesh_axis_equal_unsharded():
    """jit(tx.update) on leaves split with explicit axes (GSPMD, no shard_map): each leaf
    handled whole, as unsharded; it raised ShardingTypeError."""
    mesh = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(4)
    grads = [
        {"w": rng.normal(size=(16, 3)).astype(np.float32), "b": rng.normal(size=4).astype("f4")}
        for _ in range(3)
    ]
    specs = {"w": P("data", None), "b": P()}
    params = grads[0]  # weight decay and 1-bit LAMB read the (split) parameters
    for tx in (
        onebit_adam(0.1, freeze_step=1),
        zero_one_adam(0.1, var_freeze_step=1, local_step_clipper=2, local_step_scaler=1),
        onebit_adam(0.1, freeze_step=1, weight_decay=0.1),
        zero_one_adam(0.1, var_freeze_step=1, local_step_clipper=1, weight_decay=0.1),
        jaxcomp.onebit_lamb(0.1, freeze_step=1, weight_decay=0.1),
    ):
        ref_state, state = tx.init(grads[0]), None
        with jax.set_mesh(mesh):
            put = lambda g: jax.tree.map(  # noqa: E731
                lambda x, sp: jax.device_put(x, NamedSharding(mesh, sp)), g, specs
            )
            state = jax.jit(tx.init)(put(grads[0]))
        for g in grads:  # warm-up / variance step, then 1-bit (and local) steps
            ref_updates, ref_state = jax.jit(tx.update)(g, ref_state, params)
            with jax.set_mesh(mesh):
                updates, state = jax.jit(tx.update)(put(g), state, put(params))
            assert updates["w"].sharding.spec == P("data", None)
            assert state.residual["w"].sharding.spec == P("data", None)
            for k in g:
                np.testing.assert_array_equal(np.asarray(updates[k]), np.asarray(ref_updates[k]))
                np.testing.assert_array_equal(np.asarray(state.mu[k]), np.asarray(ref_state.mu[k]))


def test_backup_workers_are_refused(mesh):
    """include= (backup workers) raises, named, in tx.update and under make_train_step:
    it was swallowed and the left-out device's gradient averaged in."""
    g = {"w": jnp.ones(4)}
    for tx in (onebit_adam(0.1, freeze_step=1), zero_one_adam(0.1, var_freeze_step=1)):
        with pytest.raises(ValueError, match=r"include= \(backup workers\)"):
            tx.update(g, tx.init(g), include=jnp.bool_(False))
    tx = onebit_adam(0.1, freeze_step=1, axis_name="data")
    params = dist.replicate({"w": jnp.zeros(12), "b": jnp.zeros(())}, mesh)
    step = dist.make_train_step(_lsq_loss, tx, mesh)
    include = jnp.arange(N) > 0
    with pytest.raises(ValueError, match=r"include= \(backup workers\)"):
        step(params, dist.init_opt_state(tx, params, mesh), dist.shard_batch(_lsq_problem(), mesh),
             update_args={"include": include})  # fmt: skip


def test_schedule_learning_rate_and_tree_mismatch():
    sched = optax.linear_schedule(0.1, 0.0, 10)
    tx, ref = onebit_adam(sched, freeze_step=5), optax.adam(sched)
    g = {"w": jnp.array([1.0, -2.0, 0.5])}
    s, r = tx.init(g), ref.init(g)
    for _ in range(3):
        u, s = tx.update(g, s)
        ur, r = ref.update(g, r)
        np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(ur["w"]), rtol=1e-6)
    with pytest.raises(ValueError, match="update got a gradient tree unlike"):
        tx.update({"v": jnp.zeros(3)}, s)


# ---------------------------------------------------------------------------
# The two-stage exchange (DeepSpeed's compressed_allreduce).
# ---------------------------------------------------------------------------


TWO_STAGE_TREE = {"w": (12,), "m": (5, 7), "b": ()}  # d = 47 compressed, "b" dense


def _flat(tree):
    """(N, 47): the compressed leaves of a per-device stacked tree, in leaf order."""
    return np.concatenate([np.asarray(tree[k], np.float64).reshape(N, -1) for k in ("m", "w")], 1)


@pytest.mark.parametrize("codec,kind", [("sign_l2", "l2"), ("sign", "l1")])
def test_two_stage_exchange_matches_numpy_and_loses_nothing(mesh, codec, kind):
    """1-bit Adam's momentum after each compressed step == numpy compressed_allreduce,
    worker and server errors included; every step keeps
    ``mean_i (x_i + e_i) + s == result + mean_i e_i' + s'``; bytes by the formula."""
    rng = np.random.default_rng(3)
    params = {k: jnp.zeros(s) for k, s in TWO_STAGE_TREE.items()}
    tx = onebit_adam(
        0.01, freeze_step=1, axis_name="data", codec=codec, exchange="two_stage", min_dense_size=1
    )
    state = _stack_init(tx, params, mesh)
    assert state.server_residual.shape == (N, 47)
    update = mesh_update(tx, mesh)
    ok = np.ones(N, bool)
    for step in range(4):
        grads = {k: rng.normal(size=(N, *s)).astype(np.float32) for k, s in TWO_STAGE_TREE.items()}
        old = jax.tree.map(np.asarray, state)
        _, state = update(_stacked(grads, mesh), state)
        new = jax.tree.map(np.asarray, state)
        if step == 0:  # warm-up: dense, no errors yet
            assert not np.any(new.server_residual)
            continue
        m_local = B1 * _flat(old.mu) + (1 - B1) * _flat(grads)
        ref, ref_worker, ref_server = np_compressed_allreduce(
            m_local, _flat(old.residual), old.server_residual.sum(0).astype(np.float64), ok, kind
        )
        for i in range(N):  # identical on every device
            np.testing.assert_allclose(_flat(new.mu)[i], ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(_flat(new.residual), ref_worker, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(new.server_residual.sum(0), ref_server, rtol=1e-5, atol=1e-6)
        # Device j's server error is zero outside its chunk (8 values; devices 6, 7 own none).
        for j in range(N):
            outside = np.ones(47, bool)
            outside[8 * j : 8 * j + 8] = False
            assert not np.any(new.server_residual[j][outside])
        # Nothing lost, from jaxcomp's own state alone.
        before = (m_local + _flat(old.residual)).mean(0) + old.server_residual.sum(0)
        after = _flat(new.mu)[0] + _flat(new.residual).mean(0) + new.server_residual.sum(0)
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-6)
        # Dense leaf "b": the plain mean.
        np.testing.assert_allclose(
            new.mu["b"][0], B1 * old.mu["b"][0] + (1 - B1) * grads["b"].mean(), rtol=1e-5
        )
        # Wire: all_to_all of 7 one-byte chunks + the worker's scale to 7 peers, all-gather of
        # the server's 1-byte chunk + scale, the dense scalar's ring all-reduce, the ok-count.
        expected = 7 * (1 + 4) + 7 * (1 + 4) + 2 * 7 / 8 * 4 + 2 * 7 / 8 * 4
        assert float(new.wire_bytes[0]) == pytest.approx(expected)
        assert new.message_bytes["w"][0] == 2 and new.message_bytes["m"][0] == 5


def test_two_stage_leaves_a_nonfinite_device_out(mesh):
    """A device with NaN gradients sends scale 0, is not counted, and keeps its error."""
    rng = np.random.default_rng(4)
    params = {"w": jnp.zeros(40)}
    tx = onebit_adam(0.01, freeze_step=1, axis_name="data", exchange="two_stage")
    state = _stack_init(tx, params, mesh)
    update = mesh_update(tx, mesh)
    for step in range(3):
        g = rng.normal(size=(N, 40)).astype(np.float32)
        if step == 2:
            g[3, 5] = np.nan
        old = jax.tree.map(np.asarray, state)
        _, state = update(_stacked({"w": g}, mesh), state)
    new = jax.tree.map(np.asarray, state)
    ok = np.arange(N) != 3
    m_local = B1 * old.mu["w"].astype(np.float64) + (1 - B1) * np.where(ok[:, None], g, 0)
    ref, ref_worker, ref_server = np_compressed_allreduce(
        m_local, old.residual["w"].astype(np.float64), old.server_residual.sum(0), ok, "l1"
    )
    np.testing.assert_allclose(new.mu["w"][0], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(new.residual["w"], ref_worker, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(new.residual["w"][3], old.residual["w"][3])
    np.testing.assert_allclose(new.server_residual.sum(0), ref_server, rtol=1e-5, atol=1e-6)
    assert new.nonfinite_steps.tolist() == [int(i == 3) for i in range(N)]


def test_two_stage_single_device_and_zero_one_adam(mesh):
    """No axis: worker then server compression of the one device's momentum (numpy, N=1);
    0/1 Adam's stage-2 sync runs through the same exchange (8 devices, numpy)."""
    rng = np.random.default_rng(5)
    g = rng.normal(size=(2, 20)).astype(np.float32)
    tx = onebit_adam(0.01, freeze_step=1, exchange="two_stage", codec="sign_l2")
    state = tx.init({"w": jnp.zeros(20)})
    _, state = tx.update({"w": jnp.asarray(g[0])}, state)
    mu0 = np.asarray(state.mu["w"], np.float64)
    _, state = tx.update({"w": jnp.asarray(g[1])}, state)
    x = (B1 * mu0 + (1 - B1) * g[1])[None]
    ref, ref_worker, ref_server = np_compressed_allreduce(
        x, np.zeros((1, 20)), np.zeros(20), np.ones(1, bool), "l2"
    )
    np.testing.assert_allclose(state.mu["w"], ref, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(state.residual["w"], ref_worker[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.server_residual, ref_server, rtol=1e-5, atol=1e-6)

    # 0/1 Adam, no local steps: steps 1-2 dense (variance), step 3 is stage 2's sync.
    tx = zero_one_adam(
        0.01, var_freeze_step=2, var_update_scaler=8, local_step_clipper=1,
        axis_name="data", exchange="two_stage",
    )  # fmt: skip
    state = _stack_init(tx, {"w": jnp.zeros(30)}, mesh)
    update = mesh_update(tx, mesh)
    for _ in range(3):
        grads = rng.normal(size=(N, 30)).astype(np.float32)
        old = jax.tree.map(np.asarray, state)
        _, state = update(_stacked({"w": grads}, mesh), state)
    new = jax.tree.map(np.asarray, state)
    nu_hat = old.nu["w"][0].astype(np.float64) / (1 - B2**2)
    d = np.sqrt(nu_hat) + EPS
    m_local = B1 * old.mu["w"].astype(np.float64) + (1 - B1) * grads
    c_local = -0.01 * m_local / (1 - B1**3)  # accumulated -lr * m_hat over one step, times d / d
    ref, _, ref_server = np_compressed_allreduce(
        c_local, np.zeros((N, 30)), np.zeros(30), np.ones(N, bool), "l1"
    )
    np.testing.assert_allclose(new.server_residual.sum(0), ref_server, rtol=1e-4, atol=1e-9)
    # m = -c / lr_sum * (1 - b1^t): the decoded result, back in momentum units.
    np.testing.assert_allclose(new.mu["w"][0], -ref / 0.01 * (1 - B1**3), rtol=1e-4, atol=1e-7)
    assert np.all(d > 0)


@pytest.mark.parametrize("codec", ["sign", "sign_l2"])
def test_two_stage_under_make_train_step_is_not_pre_averaged(mesh, codec):
    """The two-stage result is the same on every device and typed so: make_train_step's
    probe sees every leaf exchanged (no dense pre-averaging of the gradients), and its
    steps equal a hand-written shard_map step on per-device gradients."""
    p0 = {"w": jnp.zeros(12), "b": jnp.zeros(())}
    kw = dict(axis_name="data", exchange="two_stage", codec=codec)
    makers = (
        lambda: onebit_adam(0.05, freeze_step=1, **kw),
        lambda: zero_one_adam(0.05, var_freeze_step=1, local_step_clipper=1, **kw),
    )
    batch = dist.shard_batch(_lsq_problem(), mesh)

    def by_hand(p, s, b):
        s = jax.tree.map(lambda x: x[0], s)
        g = dist.per_device_grad(_lsq_loss, "data")(p, b)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), jax.tree.map(lambda x: x[None], s)

    hand = jax.jit(
        jax.shard_map(
            by_hand, mesh=mesh, in_specs=(P(), P("data"), P("data")),
            out_specs=(P(), P("data")), check_vma=False,
        )
    )  # fmt: skip
    for make in makers:
        assert dist.unexchanged_leaves(make(), p0, mesh) == []
    # Training (the slow part) with one optimizer per codec: 1-bit Adam "sign", 0/1 Adam "sign_l2".
    tx = makers[0 if codec == "sign" else 1]()
    params = dist.replicate(p0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    ref_p = dist.replicate(p0, mesh)  # make_train_step donates its inputs
    ref_s = dist.init_opt_state(tx, ref_p, mesh)
    step = dist.make_train_step(_lsq_loss, tx, mesh, unexchanged="error")
    for _ in range(3):
        params, state, _ = step(params, state, batch)
        ref_p, ref_s = hand(ref_p, ref_s, batch)
    res = np.asarray(state.residual["w"])
    assert not np.array_equal(res[0], res[1])  # each device compressed its own momentum
    np.testing.assert_array_equal(res, np.asarray(ref_s.residual["w"]))
    for k in p0:
        np.testing.assert_array_equal(np.asarray(params[k]), np.asarray(ref_p[k]))


def test_two_stage_x64_mixed_dtypes_keep_float64():
    """x64, a float32 leaf first and a float64 leaf: the flat exchange buffer is float64,
    so nothing is lost for the float64 leaf to float64 rounding (it was rounded to
    float32, the first leaf's dtype: 1e-9 lost)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(6)
        tx = onebit_adam(0.01, freeze_step=1, exchange="two_stage")
        g = [
            {"a": rng.normal(size=16).astype(np.float32), "b": 1 + 1e-9 * rng.normal(size=16)}
            for _ in range(2)
        ]
        state = tx.init(jax.tree.map(jnp.zeros_like, g[0]))
        _, state = tx.update(g[0], state)  # warm-up: dense
        mu = np.asarray(state.mu["b"])
        _, state = tx.update(g[1], state)  # the two-stage exchange, zero errors before
        assert state.server_residual.dtype == np.float64 and state.mu["b"].dtype == np.float64
        x = B1 * mu + (1 - B1) * g[1]["b"]
        kept = np.asarray(state.mu["b"]) + np.asarray(state.residual["b"])
        kept = kept + np.asarray(state.server_residual)[16:]  # "b" is the second leaf
        np.testing.assert_allclose(kept, x, rtol=0, atol=1e-14)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"exchange": "ring"}, "exchange"),
        ({"exchange": "two_stage", "codec": "onebit"}, "codec"),
        ({"exchange": "two_stage", "bucket_size": 4}, "bucket_size"),
        ({"codec": "l2"}, "codec"),
    ],
)
def test_two_stage_bad_arguments(kwargs, arg):
    for make in (
        lambda **kw: onebit_adam(0.1, freeze_step=1, **kw),
        lambda **kw: zero_one_adam(0.1, var_freeze_step=1, **kw),
    ):
        with pytest.raises(ValueError, match=arg):
            make(**kwargs)


def test_two_stage_state_is_not_resized_elastically(mesh):
    """The server chunks move with N: elastic.resize_opt_state raises, naming the field."""
    from jaxcomp import elastic

    tx = onebit_adam(0.01, freeze_step=1, axis_name="data", exchange="two_stage")
    state = jax.tree.map(np.asarray, _stack_init(tx, {"w": jnp.zeros(16)}, mesh))
    state = state._replace(server_residual=np.ones_like(state.server_residual))
    with pytest.raises(ValueError, match="server_residual"):
        elastic.resize_opt_state(state, N, 4)
    plain = onebit_adam(0.01, freeze_step=1, axis_name="data")
    small = elastic.resize_opt_state(
        jax.tree.map(np.asarray, _stack_init(plain, {"w": jnp.zeros(16)}, mesh)), N, 4
    )
    assert small.server_residual is None  # allgather: no server error to resize


@pytest.mark.parametrize("exchange", ["allgather", "two_stage"])
def test_inject_hyperparams_learning_rate(exchange):
    """optax.inject_hyperparams over the learning rate (schedules by hand) gives the
    plain optimizer's updates; a schedule-shaping argument must be static and says so."""
    g = {"w": jnp.arange(10.0) - 4.5}
    # Only the arguments given (and the boolean bias_correction) need static_args:
    # the shape-fixing integers the user leaves out default to None.
    fixed = ("bias_correction",)
    zero_one_fixed = ()
    for make, schedule, static in (
        (onebit_adam, {"freeze_step": 1}, fixed),
        (zero_one_adam, {"var_freeze_step": 1, "local_step_clipper": 1}, fixed + zero_one_fixed),
    ):
        ref = make(0.01, exchange=exchange, **schedule)
        tx = optax.inject_hyperparams(make, static_args=(*schedule, *static))(
            learning_rate=0.01, exchange=exchange, **schedule
        )
        s, r = tx.init(g), ref.init(g)
        for _ in range(3):
            u, s = jax.jit(tx.update)(g, s)
            ur, r = jax.jit(ref.update)(g, r)
            # Injected b1, b2 are float32 arrays (as with optax.adam): 1 - b2^t rounds
            # in float32, a relative 1e-5 from the Python-float run.
            np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(ur["w"]), rtol=1e-4)
        s = s._replace(hyperparams={**s.hyperparams, "learning_rate": jnp.float32(0.02)})
        u2, _ = jax.jit(tx.update)(g, s)  # a new rate, no recompilation needed
        assert np.any(np.asarray(u2["w"]) != 0)
    loose = optax.inject_hyperparams(onebit_adam, static_args=fixed)(
        learning_rate=0.01, freeze_step=1
    )
    with pytest.raises(ValueError, match="freeze_step.*static_args"):
        jax.jit(loose.update)(g, loose.init(g))


# ---------------------------------------------------------------------------
# Weight decay and exp_avg_mask: numpy ports of DeepSpeed's OnebitAdam and ZeroOneAdam.
# ---------------------------------------------------------------------------

# One leaf of 128 = N * lcm(N, 8) * 2 values: DeepSpeed compresses it with no padding,
# and two_stage flattens the one leaf as DeepSpeed's per-tensor compressed_allreduce.
WD_SHAPE = (8, 16)
# DeepSpeed's exp_avg_mask: rows 5 and 6 (e.g. padded embedding rows) are zeroed.
WD_MASK = np.ones(WD_SHAPE, np.float32)
WD_MASK[5:7] = 0


def np_onebit_adam(params, grads, lr, wd, freeze, mask):
    """DeepSpeed's OnebitAdam.step (without its dropped initialisation step), numpy float64.

    params: (d,) replicated; grads: list of (N, d) per step. Returns the parameters
    after every step.
    """
    p = np.asarray(params, np.float64).copy()
    m, v = np.zeros_like(p), np.zeros_like(p)
    werr, serr = np.zeros((N, p.size)), np.zeros(p.size)
    out = []
    for step, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        if step <= freeze:  # warm-up: the engine all-reduces the gradient
            gm = g.mean(0)
            m = B1 * m + (1 - B1) * gm
            v = B2 * v + (1 - B2) * gm * gm
        else:
            m_i = B1 * m + (1 - B1) * g
            m, werr, serr = np_compressed_allreduce(m_i, werr, serr, np.ones(N, bool), "l2")
            if mask is not None:
                m = m * mask  # exp_avg.mul_(exp_avg_mask)
        update = m / (np.sqrt(v) + EPS)
        if wd > 0:
            update = update + wd * p
        p = p - lr * update
        out.append(p.copy())
    return out


@pytest.mark.parametrize("wd,masked", [(0.1, False), (0.0, True), (0.05, True)])
def test_onebit_adam_weight_decay_and_exp_avg_mask_match_deepspeed(mesh, wd, masked):
    """Several steps over the freeze, 8 devices, DeepSpeed's settings: parameters
    (identical on every device) == numpy OnebitAdam with weight_decay / exp_avg_mask."""
    lr, freeze, steps = 0.01, 2, 5
    rng = np.random.default_rng(11)
    p0 = rng.normal(size=WD_SHAPE).astype(np.float32)
    grads = [rng.normal(size=(N, *WD_SHAPE)).astype(np.float32) for _ in range(steps)]
    mask = WD_MASK if masked else None
    tx = onebit_adam(
        lr,
        freeze_step=freeze,
        weight_decay=wd,
        exp_avg_mask=None if mask is None else {"w": mask},
        axis_name="data",
        codec="sign_l2",
        exchange="two_stage",
        bias_correction=False,
    )
    ref = np_onebit_adam(
        p0.reshape(-1),
        [g.reshape(N, -1) for g in grads],
        lr,
        wd,
        freeze,
        None if mask is None else mask.reshape(-1),
    )
    update = mesh_update(tx, mesh)
    params = {"w": np.stack([p0] * N)}
    state = _stack_init(tx, {"w": jnp.asarray(p0)}, mesh)
    for step in range(steps):
        upd, state = update(_stacked({"w": grads[step]}, mesh), state, _stacked(params, mesh))
        params = {"w": params["w"] + np.asarray(upd["w"])}
        assert all(np.array_equal(params["w"][i], params["w"][0]) for i in range(N))
        np.testing.assert_allclose(
            params["w"][0].reshape(-1), ref[step], rtol=1e-5, atol=2e-6, err_msg=f"step {step}"
        )
    if masked:  # the masked rows moved by the decay alone after the freeze
        assert not np.any(np.asarray(state.mu["w"])[:, 5:7])


def np_zero_one_adam(params, grads, lr, wd, var_freeze, var_scaler, local_scaler, clipper, mask):
    """DeepSpeed's ZeroOneAdam.step in numpy float64, per device (stage 2 from
    t = var_freeze + 1, jaxcomp's documented timing). params: (d,); grads: list of
    (N, d). Returns each step's (N, d) parameters."""
    p = np.stack([np.asarray(params, np.float64)] * N)
    d = p.shape[1]
    m, v = np.zeros((N, d)), np.zeros(d)
    werr, serr, acc = np.zeros((N, d)), np.zeros(d), np.zeros((N, d))
    ok = np.ones(N, bool)
    lrs, var_interval, var_counter, local_interval, local_counter = 0.0, 1, 0, 1, 0
    mask = np.ones(d) if mask is None else mask
    out = []
    for t, g in enumerate(grads, start=1):
        g = np.asarray(g, np.float64)
        if t <= var_freeze:
            if t % var_interval == 0:
                gm = g.mean(0)
                v = B2 * v + (1 - B2) * gm * gm
                m = B1 * m + (1 - B1) * gm
            else:
                g1, werr, serr = np_compressed_allreduce(g, werr, serr, ok, "l2")
                m = B1 * m + (1 - B1) * g1 * mask
            update = m / (np.sqrt(v) + EPS) + wd * p
            p = p - lr * update
            if t % var_interval == 0:
                var_counter += 1
                if var_counter == var_scaler:
                    var_counter, var_interval = 0, var_interval * 2
        else:
            if t == var_freeze + 1:  # the error buffers are reset once
                werr, serr = np.zeros((N, d)), np.zeros(d)
            m = B1 * m + (1 - B1) * g
            lrs += lr
            update = m / (np.sqrt(v) + EPS) + wd * p
            p = p - lr * update
            acc = acc - lr * update
            if t % local_interval == 0:
                p = p - acc
                acc = acc * (np.sqrt(v) + EPS)
                c, werr, serr = np_compressed_allreduce(acc, werr, serr, ok, "l2")
                c = c * mask
                m = np.stack([-c / lrs] * N)
                p = p + c / (np.sqrt(v) + EPS)
                acc, lrs = np.zeros((N, d)), 0.0
            local_counter += 1
            if local_counter == local_scaler:
                local_counter, local_interval = 0, min(clipper, local_interval * 2)
        out.append(p.copy())
    return out


@pytest.mark.parametrize("wd,masked", [(0.1, False), (0.05, True)])
def test_zero_one_adam_weight_decay_and_exp_avg_mask_match_deepspeed(mesh, wd, masked):
    """Both stages (variance and 1-bit gradient steps, local steps and syncs), 8 devices
    with one parameter replica each: == numpy ZeroOneAdam with weight_decay / exp_avg_mask."""
    lr, steps = 0.01, 9
    schedule = {"var_freeze_step": 4, "var_update_scaler": 1, "local_step_scaler": 2,
                "local_step_clipper": 4}  # fmt: skip
    rng = np.random.default_rng(12)
    p0 = rng.normal(size=WD_SHAPE).astype(np.float32)
    grads = [rng.normal(size=(N, *WD_SHAPE)).astype(np.float32) for _ in range(steps)]
    mask = WD_MASK if masked else None
    tx = zero_one_adam(
        lr,
        **schedule,
        weight_decay=wd,
        exp_avg_mask=None if mask is None else {"w": mask},
        axis_name="data",
        codec="sign_l2",
        exchange="two_stage",
        bias_correction=False,
    )
    ref = np_zero_one_adam(
        p0.reshape(-1),
        [g.reshape(N, -1) for g in grads],
        lr,
        wd,
        4,
        1,
        2,
        4,
        None if mask is None else mask.reshape(-1),
    )
    update = mesh_update(tx, mesh)
    params = {"w": np.stack([p0] * N)}
    state = _stack_init(tx, {"w": jnp.asarray(p0)}, mesh)
    for step in range(steps):
        upd, state = update(_stacked({"w": grads[step]}, mesh), state, _stacked(params, mesh))
        params = {"w": params["w"] + np.asarray(upd["w"])}
        np.testing.assert_allclose(
            params["w"].reshape(N, -1), ref[step], rtol=1e-5, atol=5e-6, err_msg=f"step {step}"
        )


def test_weight_decay_mask_single_device_is_optax_adamw():
    """Warm-up on one device with weight_decay and optax.adamw's mask == optax.adamw;
    bfloat16 parameters decay in float32 (the moments' dtype)."""
    lr, wd = 0.1, 0.2
    mask = {"a": True, "s": False}
    rng = np.random.default_rng(13)
    params = {"a": jnp.asarray(rng.normal(size=7), jnp.float32), "s": jnp.float32(1.5)}
    for make in (
        lambda: onebit_adam(lr, freeze_step=10, weight_decay=wd, mask=mask),
        lambda: zero_one_adam(lr, var_freeze_step=10, weight_decay=wd, mask=lambda p: mask),
    ):
        tx, ref = make(), optax.adamw(lr, weight_decay=wd, mask=mask)
        p, pr = params, params
        s, r = tx.init(p), ref.init(pr)
        for _ in range(3):
            g = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), jnp.float32), p)
            u, s = jax.jit(tx.update)(g, s, p)
            ur, r = jax.jit(ref.update)(g, r, pr)
            p, pr = optax.apply_updates(p, u), optax.apply_updates(pr, ur)
        for k in params:
            np.testing.assert_allclose(np.asarray(p[k]), np.asarray(pr[k]), rtol=1e-6)
    # bfloat16 parameters: updates in bfloat16, the decay term computed in float32.
    pb = {"a": params["a"].astype(jnp.bfloat16)}
    tx = onebit_adam(lr, freeze_step=1, weight_decay=wd, bias_correction=False)
    s = tx.init(pb)
    g = {"a": jnp.ones(7, jnp.bfloat16)}
    for _ in range(2):  # warm-up, then a compressed step
        u, s = jax.jit(tx.update)(g, s, pb)
        assert u["a"].dtype == jnp.bfloat16
    m = np.asarray(s.mu["a"])
    ref = -lr * (m / (np.sqrt(np.asarray(s.nu["a"])) + EPS) + wd * np.asarray(pb["a"], np.float32))
    np.testing.assert_allclose(np.asarray(u["a"], np.float32), ref, rtol=8e-3)


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"weight_decay": -0.1}, "weight_decay"),
        ({"weight_decay": float("nan")}, "weight_decay"),
        ({"weight_decay": 0.1, "mask": {"w": 1.0}}, "mask"),
        ({"exp_avg_mask": {"w": np.full(4, 0.5)}}, "exp_avg_mask"),
    ],
)
def test_weight_decay_and_mask_bad_arguments(kwargs, arg):
    for make in (
        lambda **kw: onebit_adam(0.1, freeze_step=1, **kw),
        lambda **kw: zero_one_adam(0.1, var_freeze_step=1, **kw),
    ):
        with pytest.raises(ValueError, match=arg):
            make(**kwargs)


def test_weight_decay_needs_params_and_mask_must_fit():
    g = {"w": jnp.ones(4)}
    for make in (
        lambda **kw: onebit_adam(0.1, freeze_step=1, **kw),
        lambda **kw: zero_one_adam(0.1, var_freeze_step=1, **kw),
    ):
        tx = make(weight_decay=0.1)
        with pytest.raises(ValueError, match="weight_decay.*params"):
            tx.update(g, tx.init(g))
        with pytest.raises(ValueError, match="exp_avg_mask"):
            make(exp_avg_mask={"w": np.ones(3)}).init(g)
        with pytest.raises(ValueError, match="exp_avg_mask"):
            make(exp_avg_mask={"v": np.ones(4)}).init(g)
        # Without weight decay the parameters stay optional.
        tx = make(exp_avg_mask={"w": np.array([1, 1, 0, 1])})
        tx.update(g, tx.init(g))


def test_inject_hyperparams_weight_decay():
    """An injected (traced) weight_decay: the plain run's updates, the parameters required."""
    params = {"w": jnp.linspace(-1.0, 2.0, 16)}
    g = {"w": jnp.cos(params["w"])}
    for make, schedule in (
        (onebit_adam, {"freeze_step": 1}),
        (zero_one_adam, {"var_freeze_step": 1}),
    ):
        ref = make(0.01, weight_decay=0.1, **schedule)
        tx = optax.inject_hyperparams(make, static_args=(*schedule, "bias_correction"))(
            learning_rate=0.01, weight_decay=0.1, **schedule
        )
        s, r = tx.init(params), ref.init(params)
        for _ in range(3):
            u, s = jax.jit(tx.update)(g, s, params)
            ur, r = jax.jit(ref.update)(g, r, params)
            np.testing.assert_allclose(np.asarray(u["w"]), np.asarray(ur["w"]), rtol=1e-4)
        with pytest.raises(ValueError, match="weight_decay.*params"):
            tx.update(g, s)
