"""jaxcomp.staleness against single-device references that replay the delays and arrivals.

A linear least-squares problem on 4 of the 8 simulated devices: the
references are python loops in numpy (float64) that keep the parameter
history (bounded delay) or the server and each worker's pulled copy
(asynchronous parameter server), with top-k error feedback written out.
Every step is blocked on (simulated devices: see docs/distributed.md).
"""

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxcomp
import jaxcomp.staleness as staleness
from jaxcomp import distributed as dist

N = 4
DIM = 6
ROWS = 4  # per device
LR = 0.1
SEED = 3


@pytest.fixture(scope="module")
def mesh():
    return Mesh(np.array(jax.devices()[:N]), ("data",))


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N * ROWS, DIM)).astype(np.float32)
    y = rng.normal(size=N * ROWS).astype(np.float32)
    return x, y


def loss_fn(w, b):
    return jnp.mean((b["x"] @ w - b["y"]) ** 2)


def batch_on(mesh, data):
    x, y = data
    return dist.shard_batch({"x": x, "y": y}, mesh)


def grad_np(w, data, i):
    """Device i's gradient of its shard's mean squared error, float64."""
    x, y = (a.astype(np.float64)[i * ROWS : (i + 1) * ROWS] for a in data)
    return 2.0 * x.T @ (x @ w - y) / ROWS


def dense_tx():
    return optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(LR))


def top_k_np(acc, k):
    """(sent, new residual) of exact top-k by magnitude."""
    sent = np.zeros_like(acc)
    idx = np.argsort(-np.abs(acc), kind="stable")[:k]
    sent[idx] = acc[idx]
    return sent, acc - sent


def reference_delays(delay, max_delay, steps):
    """Per-step delays as documented: drawn from fold_in(key, t), clamped to t."""
    out = []
    for t in range(steps):
        if delay == "uniform":
            k = jax.random.fold_in(jax.random.key(SEED), t)
            d = np.asarray(jax.random.randint(k, (N,), 0, max_delay + 1))
        elif delay == "fixed":
            d = np.full(N, max_delay)
        else:
            d = np.asarray(delay)
        out.append(np.minimum(d, t))
    return out


def run_stale(mesh, data, tx, max_delay, steps, **kw):
    state = staleness.init_stale_state(tx, np.zeros(DIM, np.float32), mesh, max_delay, seed=SEED)
    step = staleness.make_stale_train_step(loss_fn, tx, mesh, max_delay, **kw)
    batch = batch_on(mesh, data)
    metrics = []
    for _ in range(steps):
        state, m = step(state, batch)
        metrics.append(jax.device_get(jax.block_until_ready(m)))
    return state, metrics


def test_zero_delay_is_make_train_step_bit_for_bit(mesh, data):
    tx = optax.chain(jaxcomp.top_k(0.34, axis_name="data"), optax.sgd(LR, momentum=0.9))
    for delay in ("fixed", "uniform"):
        state, metrics = run_stale(mesh, data, tx, 0, 3, delay=delay)
        params = dist.replicate(np.zeros(DIM, np.float32), mesh)
        opt_state = dist.init_opt_state(tx, params, mesh)
        step = dist.make_train_step(loss_fn, tx, mesh)
        for m in metrics:
            params, opt_state, ref = step(params, opt_state, batch_on(mesh, data))
            jax.block_until_ready(params)
            assert np.asarray(ref["loss"]).tobytes() == np.asarray(m["loss"]).tobytes()
            assert float(ref["wire_bytes"]) == float(m["wire_bytes"])
            assert m["delay"].tolist() == [0] * N
        assert np.asarray(state.params).tobytes() == np.asarray(params).tobytes()
        for a, b in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(opt_state), strict=True):
            assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


@pytest.mark.parametrize(
    "delay, max_delay", [("fixed", 2), ("uniform", 2), ((0, 3, 1, 2), 3)], ids=str
)
def test_dense_delays_match_reference(mesh, data, delay, max_delay):
    steps = 7
    state, metrics = run_stale(mesh, data, dense_tx(), max_delay, steps, delay=delay)
    delays = reference_delays(delay, max_delay, steps)
    history = [np.zeros(DIM)]
    for t, d in enumerate(delays):
        grads = [grad_np(history[t - d[i]], data, i) for i in range(N)]
        history.append(history[t] - LR * np.mean(grads, axis=0))
        assert metrics[t]["delay"].tolist() == d.tolist()
        x, y = (a.astype(np.float64) for a in data)
        shards = [slice(i * ROWS, (i + 1) * ROWS) for i in range(N)]
        residuals = [x[r] @ history[t - d[i]] - y[r] for i, r in enumerate(shards)]
        loss = np.mean([np.mean(e**2) for e in residuals])
        np.testing.assert_allclose(metrics[t]["loss"], loss, rtol=1e-5)
    if delay == "uniform":  # the draws really varied
        assert len({tuple(d) for d in delays[2:]}) > 1
    np.testing.assert_allclose(state.params, history[-1], rtol=1e-5, atol=1e-6)
    # The ring buffer holds the last max_delay versions at slot v % max_delay.
    for v in range(steps - max_delay, steps):
        np.testing.assert_allclose(state.history[v % max_delay], history[v], rtol=1e-5)
    assert int(state.step) == steps


@pytest.mark.parametrize(
    "exchange",
    [{}, {"exchange": "server", "servers": 2}, {"exchange": "server", "servers": 4}],
    ids=["auto", "servers2", "servers4"],
)
def test_top_k_error_feedback_with_fixed_delay_matches_reference(mesh, data, exchange):
    # A group of parameter servers (key ranges of DIM = 6: 2 + 2 + 2 with M = 4,
    # the fourth empty) averages exactly as the all-gather: the same reference.
    ratio, max_delay, steps = 0.34, 1, 5
    k = math.ceil(ratio * DIM)
    tx = optax.chain(jaxcomp.top_k(ratio, axis_name="data", **exchange), optax.sgd(LR))
    state, metrics = run_stale(mesh, data, tx, max_delay, steps)
    history = [np.zeros(DIM)]
    residual = np.zeros((N, DIM))
    for t in range(steps):
        d = min(max_delay, t)
        sent = np.zeros((N, DIM))
        for i in range(N):
            sent[i], residual[i] = top_k_np(residual[i] + grad_np(history[t - d], data, i), k)
        history.append(history[t] - LR * sent.mean(axis=0))
    np.testing.assert_allclose(state.params, history[-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        optax.tree.get(state.opt_state, "residual"), residual, rtol=1e-5, atol=1e-6
    )


def async_reference(data, orders, k=None, scale=1.0 / N):
    """The server applies each push in arrival order; workers pull right after their own."""
    server = np.zeros(DIM)
    workers = np.zeros((N, DIM))
    residual = np.zeros((N, DIM))
    pulled = np.zeros(N, int)
    version = 0
    staleness_out, push_bytes = [], []
    for order in orders:
        pushes, nbytes = {}, []
        for i in range(N):
            g = grad_np(workers[i], data, i)
            if k is None:
                pushes[i] = -LR * g
                nbytes.append(DIM * 4)
            else:
                sent, residual[i] = top_k_np(residual[i] + g, k)
                pushes[i] = -LR * sent
                nbytes.append(np.count_nonzero(sent) * 8)  # (int32, float32) pairs
        stale = np.zeros(N, int)
        for i in order:
            stale[i] = version - pulled[i]
            server = server + scale * pushes[i]
            version += 1
            workers[i], pulled[i] = server, version
        staleness_out.append(stale)
        push_bytes.append(np.mean(nbytes))
    return server, workers, residual, staleness_out, push_bytes


@pytest.mark.parametrize("compressed", [False, True], ids=["sgd", "top_k"])
def test_async_server_matches_sequential_reference(mesh, data, compressed):
    k = 2
    tx = optax.chain(jaxcomp.top_k(k / DIM), optax.sgd(LR)) if compressed else optax.sgd(LR)
    state = staleness.init_async_state(tx, np.zeros(DIM, np.float32), mesh, seed=SEED)
    step = staleness.make_async_train_step(loss_fn, tx, mesh)
    batch = batch_on(mesh, data)
    given = {1: [3, 2, 1, 0]}  # round 1's order is given to the step
    orders, metrics = [], []
    for t in range(4):
        if t in given:
            orders.append(given[t])
        else:
            key = jax.random.fold_in(jax.random.key(SEED), t)
            orders.append(np.asarray(jax.random.permutation(key, N)).tolist())
        state, m = step(state, batch, order=given.get(t))
        metrics.append(jax.device_get(jax.block_until_ready(m)))
    server, workers, residual, stale, push = async_reference(
        data, orders, k if compressed else None
    )
    np.testing.assert_allclose(state.params, server, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.worker_params, workers, rtol=1e-5, atol=1e-6)
    if compressed:
        np.testing.assert_allclose(
            optax.tree.get(state.opt_state, "residual"), residual, rtol=1e-5, atol=1e-6
        )
    for t, m in enumerate(metrics):
        assert m["order"].tolist() == orders[t]
        assert m["staleness"].tolist() == stale[t].tolist()
        assert float(m["push_bytes"]) == push[t]
        assert float(m["pull_bytes"]) == DIM * 4
        assert float(m["wire_bytes"]) == push[t] + DIM * 4
    assert int(state.step) == 4
    assert sorted(np.asarray(state.pulled_version).tolist()) == list(range(3 * N + 1, 4 * N + 1))


def test_async_first_round_is_a_synchronous_step(mesh, data):
    # scale = 1/N: every worker pulled w_0, so the round applies the mean update.
    state = staleness.init_async_state(optax.sgd(LR), np.zeros(DIM, np.float32), mesh)
    step = staleness.make_async_train_step(loss_fn, optax.sgd(LR), mesh, order="round_robin")
    state, metrics = step(state, batch_on(mesh, data))
    expected = -LR * np.mean([grad_np(np.zeros(DIM), data, i) for i in range(N)], axis=0)
    np.testing.assert_allclose(state.params, expected, rtol=1e-6)
    assert metrics["order"].tolist() == list(range(N))
    assert metrics["staleness"].tolist() == list(range(N))


@pytest.mark.parametrize(
    "wrapper, granularity",
    [("masked", "layer"), ("masked", "global"), ("multi_transform", "global")],
)
def test_async_push_bytes_count_masked_leaves_dense(mesh, wrapper, granularity):
    # granularity="global" reports one count for the covered leaves: the bias
    # next to it is still pushed dense (it was left out).
    params = {"w": np.zeros((8, 2), np.float32), "b": np.zeros(2, np.float32)}
    top_k = jaxcomp.top_k(0.25, granularity=granularity)
    if wrapper == "masked":
        tx = optax.chain(optax.masked(top_k, {"w": True, "b": False}), optax.sgd(LR))
    else:
        tx = optax.multi_transform(
            {"c": optax.chain(top_k, optax.sgd(LR)), "d": optax.sgd(LR)}, {"w": "c", "b": "d"}
        )

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    rng = np.random.default_rng(1)
    batch = dist.shard_batch(
        {"x": rng.normal(size=(8, 8)).astype(np.float32),
         "y": rng.normal(size=(8, 2)).astype(np.float32)}, mesh)  # fmt: skip
    state = staleness.init_async_state(tx, params, mesh)
    state, metrics = staleness.make_async_train_step(loss, tx, mesh)(state, batch)
    # top-k of 16 weights at 25%: 4 (int32, float32) pairs; the bias sent whole.
    assert float(metrics["push_bytes"]) == 4 * 8 + 2 * 4
    assert float(metrics["pull_bytes"]) == (16 + 2) * 4


def test_state_stacked_for_another_device_count_is_refused(mesh, data):
    # A 4-device state on 2 devices: shard_map would give each device 2 rows
    # and the step keep the first, dropping the other devices' residuals.
    mesh2 = Mesh(np.array(jax.devices()[:2]), ("data",))
    x, y = data
    batch2 = dist.shard_batch({"x": x[: 2 * ROWS], "y": y[: 2 * ROWS]}, mesh2)
    w0 = np.zeros(DIM, np.float32)
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    stale = jax.device_get(staleness.init_stale_state(tx, w0, mesh, max_delay=1))
    step = staleness.make_stale_train_step(loss_fn, tx, mesh2, 1, donate=False)
    with pytest.raises(ValueError, match=r"make_stale_train_step: state\.opt_state .*\(4,\)"):
        step(stale, batch2)
    local = optax.chain(jaxcomp.top_k(0.5), optax.sgd(LR))
    astate = jax.device_get(staleness.init_async_state(local, w0, mesh))
    astep = staleness.make_async_train_step(loss_fn, local, mesh2, donate=False)
    with pytest.raises(ValueError, match=r"make_async_train_step: state\.opt_state .*\(4,\)"):
        astep(astate, batch2)
    # Plain sgd keeps no optimizer state: the pulled parameters are checked.
    plain = jax.device_get(staleness.init_async_state(optax.sgd(LR), w0, mesh))
    pstep = staleness.make_async_train_step(loss_fn, optax.sgd(LR), mesh2, donate=False)
    with pytest.raises(ValueError, match=r"state\.worker_params has shape \(4, 6\)"):
        pstep(plain, batch2)


def test_stale_step_rejects_a_tx_that_makes_averaged_leaves_device_dependent(mesh, data):
    # b is averaged before tx, then clipped by each device's own global norm:
    # the shard_map's out_specs=P() would return device 0's value silently.
    tx = optax.chain(
        optax.clip_by_global_norm(0.1),
        optax.masked(jaxcomp.top_k(1.0, axis_name="data"), {"w": True, "b": False}),
        optax.sgd(LR),
    )

    def loss(p, batch):
        return jnp.mean((batch["x"] @ p["w"] + p["b"] - batch["y"]) ** 2)

    params = {"w": np.zeros(DIM, np.float32), "b": np.zeros((), np.float32)}
    state = staleness.init_stale_state(tx, params, mesh, 0, seed=SEED)
    step = staleness.make_stale_train_step(loss, tx, mesh, 0)
    with pytest.raises(ValueError, match=r"make_stale_train_step: .*differ between devices"):
        step(state, batch_on(mesh, data))


def test_draw_delays_is_uniform_per_device_and_step():
    key = jax.random.key(0)
    draws = np.stack([np.asarray(staleness.draw_delays(key, t, N, 2)) for t in range(60)])
    assert draws.min() == 0 and draws.max() == 2
    counts = np.bincount(draws.ravel(), minlength=3)
    assert counts.min() > 0.2 * draws.size  # about a third each
    assert len({tuple(r) for r in draws}) > 10  # varies per step and device
    assert np.array_equal(staleness.draw_delays(key, 7, N, 2), draws[7])  # deterministic


def test_bad_arguments_raise(mesh, data):
    tx = dense_tx()
    with pytest.raises(ValueError, match="max_delay"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, -1)
    with pytest.raises(ValueError, match="delay"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, 2, delay="poisson")
    with pytest.raises(ValueError, match="one delay per device"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, 2, delay=(0, 1))
    with pytest.raises(ValueError, match=r"delay\[i\]"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, 2, delay=(0, 1, 2, 3))
    with pytest.raises(ValueError, match="axis_name"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, 1, axis_name="model")
    with pytest.raises(ValueError, match="scale"):
        staleness.make_async_train_step(loss_fn, optax.sgd(LR), mesh, scale=0.0)
    with pytest.raises(ValueError, match="permutation"):
        staleness.make_async_train_step(loss_fn, optax.sgd(LR), mesh, order=(0, 0, 1, 2))
    state = staleness.init_stale_state(tx, np.zeros(DIM, np.float32), mesh, 1)
    with pytest.raises(ValueError, match="another max_delay"):
        staleness.make_stale_train_step(loss_fn, tx, mesh, 2)(state, batch_on(mesh, data))
    # An exchanging tx would average the pushes: not the asynchronous server.
    astate = staleness.init_async_state(tx, np.zeros(DIM, np.float32), mesh)
    with pytest.raises(ValueError, match="axis_name=None"):
        staleness.make_async_train_step(loss_fn, tx, mesh)(astate, batch_on(mesh, data))
    local = staleness.init_async_state(optax.sgd(LR), np.zeros(DIM, np.float32), mesh)
    step = staleness.make_async_train_step(loss_fn, optax.sgd(LR), mesh)
    with pytest.raises(ValueError, match="permutation"):
        step(local, batch_on(mesh, data), order=[0, 1, 2])


def test_experiment_writes_json_and_png(tmp_path):
    from absl import flags  # noqa: PLC0415

    from experiments import staleness as experiment  # noqa: PLC0415

    fv = flags.FlagValues()
    experiment.define_flags(fv)
    fv(["staleness", f"--outdir={tmp_path}", "--num_devices=4", "--epochs=2",
        "--max_steps_per_epoch=3", "--batch_size=32", "--delays=1", "--modes=uniform,async",
        "--compressors=dense", "--hidden=16"])  # fmt: skip
    record = experiment.run_from_flags(fv)
    data = json.loads((tmp_path / "staleness.json").read_text())
    assert (tmp_path / "staleness.png").stat().st_size > 0
    assert data == json.loads(json.dumps(record))
    rows = data["rows"]
    assert sorted(rows) == ["dense/async", "dense/sync", "dense/uniform_tau1"]
    num_params = data["num_params"]
    assert num_params == 64 * 16 + 16 + 16 * 10 + 10
    for row in rows.values():
        assert len(row["test_accuracy"]) == len(row["train_loss"]) == 2
        assert 0.0 <= row["final_accuracy"] <= 1.0
        assert row["final_accuracy"] == row["test_accuracy"][-1]
        assert all(math.isfinite(v) for v in row["train_loss"])
    # Bytes per device per step, from the formulas: ring all-reduce, dense push + pull.
    np.testing.assert_allclose(
        rows["dense/sync"]["bytes_per_step"], 2 * (4 - 1) / 4 * 4 * num_params, rtol=1e-6
    )
    assert rows["dense/uniform_tau1"]["bytes_per_step"] == rows["dense/sync"]["bytes_per_step"]
    assert rows["dense/async"]["bytes_per_step"] == 2 * 4 * num_params
    assert rows["dense/sync"]["mean_delay"] == 0.0
    # Delays drawn from {0, 1} (clamped to 0 at step 0): strictly between.
    assert 0.0 < rows["dense/uniform_tau1"]["mean_delay"] < 1.0


def test_stale_step_counts_wire_bytes_as_make_train_step(mesh, data):
    """The stale step counts bytes through the step skeleton (distributed.skeleton.compress):
    under optax.MultiSteps every mini-step that ran the exchange is counted (it counted the
    kept state's, 0 before the first kept run), as make_train_step and the gossip step."""
    batch = batch_on(mesh, data)

    def top_k():
        return optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))

    def wires(tx, steps):
        state = staleness.init_stale_state(tx, jnp.zeros(DIM), mesh, max_delay=1)
        step = staleness.make_stale_train_step(loss_fn, tx, mesh, 1)
        out = []
        for _ in range(steps):
            state, metrics = step(state, batch)
            out.append(float(metrics["wire_bytes"]))
        return out

    (sent,) = wires(top_k(), 1)  # one exchange's bytes
    assert sent > 0
    assert wires(optax.MultiSteps(top_k(), 2), 4) == [sent] * 4
