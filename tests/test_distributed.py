"""Data-parallel training on 8 simulated devices against numpy references.

Every loop blocks on each step's output: with many collective steps in flight
on simulated CPU devices the in-process rendezvous deadlocks
(docs/distributed.md).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import comm
from jaxcomp import distributed as dist

N = 8
FEATURES = 16
BATCH = 8 * N  # 8 rows per device
LR = 0.05


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests/conftest.py sets 8 simulated devices"
    return jax.make_mesh((N,), ("data",))


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    w_true = rng.standard_normal(FEATURES).astype(np.float32)
    y = (x @ w_true + 0.5 + 0.1 * rng.standard_normal(BATCH)).astype(np.float32)
    return {"x": x, "y": y}


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def numpy_grads(params, batch):
    """Gradient of the mean squared error, in float64 (independent reference)."""
    x, y = batch["x"].astype(np.float64), batch["y"].astype(np.float64)
    r = x @ params["w"] + params["b"] - y
    return {"w": 2 * x.T @ r / len(y), "b": np.array(2 * r.mean())}


def numpy_sgd(params, batch, steps):
    params = {k: np.asarray(v, np.float64) for k, v in params.items()}
    for _ in range(steps):
        g = numpy_grads(params, batch)
        params = {k: params[k] - LR * g[k] for k in params}
    return params


def init_params():
    return {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}


def train(mesh, tx, batch, steps, update_args=None):
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    sharded = dist.shard_batch(batch, mesh)
    metrics = None
    for _ in range(steps):
        params, state, metrics = step(params, state, sharded, update_args)
        jax.block_until_ready((params, metrics))
    return jax.tree.map(np.asarray, params), state, metrics


def test_dense_exchange_reproduces_full_batch_sgd(mesh):
    batch = make_data()
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    params, _, metrics = train(mesh, tx, batch, steps=20)
    ref = numpy_sgd(init_params(), batch, steps=20)
    for k in ref:
        np.testing.assert_allclose(params[k], ref[k], rtol=1e-5, atol=1e-6)
    # A ring all-reduce of w (16 floats) and b (1 float) per device.
    np.testing.assert_allclose(metrics["wire_bytes"], 2 * (N - 1) / N * (FEATURES + 1) * 4)


def test_top_k_ratio_one_reproduces_dense(mesh):
    batch = make_data(1)
    dense, _, _ = train(mesh, optax.chain(dist.dense_exchange("data"), optax.sgd(LR)), batch, 10)
    tx = optax.chain(jaxcomp.top_k(ratio=1.0, axis_name="data"), optax.sgd(LR))
    sparse, state, _ = train(mesh, tx, batch, 10)
    for k in dense:
        np.testing.assert_allclose(sparse[k], dense[k], rtol=1e-6, atol=1e-7)
    residual = optax.tree.get(state, "residual")
    assert all(np.all(np.asarray(r) == 0) for r in jax.tree.leaves(residual))


def test_each_compressor_sees_its_own_local_gradient(mesh):
    batch = make_data(2)
    # k = 1 of 16: the residual after one step is the device's own gradient
    # with its largest-magnitude entry removed.
    tx = optax.chain(jaxcomp.top_k(ratio=1 / FEATURES, axis_name="data"), optax.sgd(LR))
    _, state, _ = train(mesh, tx, batch, steps=1)
    residual_w = np.asarray(optax.tree.get(state, "residual")["w"])  # [N, FEATURES]
    zero = {k: np.asarray(v, np.float64) for k, v in init_params().items()}
    rows = BATCH // N
    global_w = numpy_grads(zero, batch)["w"]
    for d in range(N):
        shard = {k: v[d * rows : (d + 1) * rows] for k, v in batch.items()}
        local = numpy_grads(zero, shard)["w"]
        expected = local.copy()
        expected[np.argmax(np.abs(local))] = 0
        np.testing.assert_allclose(residual_w[d], expected, rtol=1e-5, atol=1e-6)
        assert not np.allclose(residual_w[d], N * global_w, atol=1e-3)  # not the psum-ed one


def test_plain_grad_inside_shard_map_is_psummed(mesh):
    """The trap per_device_grad avoids: grads w.r.t. replicated params come back summed."""
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)

    def grads(w, xs):
        plain = jax.grad(lambda p: jnp.sum(p * xs[0]))(w)
        local = dist.per_device_grad(lambda p: jnp.sum(p * xs[0]), "data")(w)
        return plain[None], local[None]

    fn = jax.jit(jax.shard_map(grads, mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data")))
    plain, local = fn(jnp.ones(2), jax.device_put(x, NamedSharding(mesh, P("data"))))
    np.testing.assert_array_equal(local, x)
    np.testing.assert_array_equal(plain, np.broadcast_to(x.sum(0), (N, 2)))


def test_pmap_path_matches_shard_map(mesh):
    batch = make_data(3)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    ref, _, _ = train(mesh, tx, batch, steps=3)
    step = dist.make_pmap_train_step(loss_fn, tx)
    params = dist.stack_for_pmap(init_params(), N)
    state = jax.pmap(tx.init)(params)
    stacked = jax.tree.map(lambda v: v.reshape(N, -1, *v.shape[1:]), batch)
    for _ in range(3):
        params, state, metrics = step(params, state, stacked)
        jax.block_until_ready((params, metrics))
    for k in ref:
        np.testing.assert_allclose(
            np.asarray(params[k]),
            np.broadcast_to(ref[k], (N,) + ref[k].shape),
            rtol=1e-6,
            atol=1e-7,
        )


def test_pmap_path_rejects_unexchanged_leaves():
    """A masked compressor leaves the bias per device: the pmap step does not average
    it (make_train_step does), so the replicas would drift apart; it says so."""
    tx = optax.chain(
        optax.masked(jaxcomp.top_k(0.5, axis_name="data"), {"w": True, "b": False}),
        optax.sgd(LR),
    )
    step = dist.make_pmap_train_step(loss_fn, tx)
    params = dist.stack_for_pmap(init_params(), N)
    state = jax.pmap(tx.init)(params)
    stacked = jax.tree.map(lambda v: v.reshape(N, -1, *v.shape[1:]), make_data(3))
    with pytest.raises(ValueError, match=r"drift apart: \['b'\]"):
        step(params, state, stacked)


def test_random_k_streams_differ_per_device_and_repeat(mesh):
    batch = make_data(4)
    tx = optax.chain(jaxcomp.random_k(ratio=0.25, axis_name="data", seed=3), optax.sgd(LR))
    runs = [train(mesh, tx, batch, steps=2)[1] for _ in range(2)]
    res = [np.asarray(optax.tree.get(s, "residual")["w"]) for s in runs]
    np.testing.assert_array_equal(res[0], res[1])  # deterministic
    chosen = res[0] == 0  # random_k sends (and zeroes) its chosen coordinates
    assert len({tuple(row) for row in chosen}) > 1  # devices choose differently


def test_gossip_reaches_consensus_on_a_quadratic(mesh):
    # Device i minimises f_i(x) = |x - c_i|^2 / 2; D-PSGD: mix with the ring
    # neighbours, then a local gradient step with a decaying rate.
    rng = np.random.default_rng(5)
    c = rng.standard_normal((N, 4)).astype(np.float32) * 3
    x0 = rng.standard_normal((N, 4)).astype(np.float32) * 10
    steps = 300
    lrs = (0.5 / (1 + 0.1 * np.arange(steps))).astype(np.float32)

    def run(x, cs):
        def body(t, x):
            mixed, _ = comm.gossip_mean(x, "data")
            return mixed - lrs_j[t] * (mixed - cs)

        lrs_j = jnp.asarray(lrs)
        return lax.fori_loop(0, steps, body, x)  # per device: [1, 4]

    sh = NamedSharding(mesh, P("data"))
    fn = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"))
    )
    out = np.asarray(jax.block_until_ready(fn(jax.device_put(x0, sh), jax.device_put(c, sh))))
    # numpy reference of the same iteration with the ring mixing matrix.
    w = np.zeros((N, N))
    for i in range(N):
        w[i, i] = w[i, (i - 1) % N] = w[i, (i + 1) % N] = 1 / 3
    x = x0.astype(np.float64)
    for t in range(steps):
        m = w @ x
        x = m - lrs[t] * (m - c)
    np.testing.assert_allclose(out, x, rtol=1e-4, atol=1e-4)
    spread0 = np.abs(x0 - x0.mean(0)).max()
    assert np.abs(out - out.mean(0)).max() < 1e-2 * spread0  # consensus
    np.testing.assert_allclose(out.mean(0), c.mean(0), atol=1e-3)  # at the average's minimiser


def test_backup_workers_error_feedback_loses_nothing(mesh):
    """Collective-level design: excluded messages absent, kept in the residual."""
    rng = np.random.default_rng(6)
    size, k = 256, 8
    include = np.array([1, 0, 1, 1, 1, 1, 0, 1], bool)
    grads = rng.standard_normal((N, size)).astype(np.float32)
    grads[~include] *= 1000  # a left-out worker's gradient would dominate the mean
    residual0 = rng.standard_normal((N, size)).astype(np.float32) * 0.1

    def step(g, e, flag):
        acc = e[0] + g[0]
        _, idx = lax.top_k(jnp.abs(acc), k)
        idx = idx.astype(jnp.int32)
        vals = jnp.where(idx < size, acc[jnp.minimum(idx, size - 1)], 0)
        mean, _ = comm.exchange_mean(idx, vals, size, "data", exchange="sparse", include=flag[0])
        sent = jnp.zeros((size,), acc.dtype).at[idx].set(vals, mode="drop")
        # What a left-out worker did not get to send goes back to its residual.
        new_e = acc - jnp.where(flag[0], sent, 0)
        return mean[None], new_e[None], sent[None]

    sh = NamedSharding(mesh, P("data"))
    fn = jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    mean, new_e, sent = (
        np.asarray(a)
        for a in jax.block_until_ready(
            fn(*(jax.device_put(a, sh) for a in (grads, residual0, include)))
        )
    )
    acc = residual0 + grads
    ref_sent = np.zeros_like(acc)
    for d in range(N):
        top = np.argsort(-np.abs(acc[d]))[:k]
        ref_sent[d, top] = acc[d, top]
    np.testing.assert_array_equal(sent, ref_sent)
    np.testing.assert_allclose(mean[0], ref_sent[include].mean(0), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(new_e[~include], acc[~include])  # nothing lost
    np.testing.assert_array_equal(new_e[include] + ref_sent[include], acc[include])


SPARSIFY_HAS_INCLUDE = "exchange" in inspect.signature(jaxcomp.sparsify).parameters


@pytest.mark.skipif(not SPARSIFY_HAS_INCLUDE, reason="sparsify(include=...) not integrated yet")
@pytest.mark.parametrize("exchange", ["sparse", "dense"])
def test_sparsify_backup_workers(mesh, exchange):
    batch = make_data(7)
    batch["y"][(BATCH // N) * 1 : (BATCH // N) * 2] += 1e4  # device 1's data is wild
    include = np.ones(N, bool)
    include[1] = include[6] = False
    tx = jaxcomp.top_k(ratio=0.25, axis_name="data", exchange=exchange)
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    zero = {k: np.asarray(v, np.float64) for k, v in init_params().items()}
    rows = BATCH // N

    def body(p, s, b, flag):
        g = dist.per_device_grad(loss_fn, "data")(p, b)
        u, s = tx.update(g, jax.tree.map(lambda x: x[0], s), p, include=flag[0])
        return u, jax.tree.map(lambda x: x[None], s)

    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(), P("data"), P("data"), P("data")),
            out_specs=(P(), P("data")),
            check_vma=False,
        )
    )
    flags = jax.device_put(include, NamedSharding(mesh, P("data")))
    updates, state = jax.block_until_ready(fn(params, state, dist.shard_batch(batch, mesh), flags))
    residual = np.asarray(optax.tree.get(state, "residual")["w"])
    sent_ref = []
    for d in range(N):
        shard = {k: v[d * rows : (d + 1) * rows] for k, v in batch.items()}
        g = numpy_grads(zero, shard)["w"].astype(np.float32)
        if include[d]:
            top = np.argsort(-np.abs(g))[:4]
            s = np.zeros_like(g)
            s[top] = g[top]
            sent_ref.append(s)
            np.testing.assert_allclose(residual[d] + s, g, rtol=1e-5, atol=1e-5)
        else:
            # Kept all it did not send (float32 gradient vs numpy float64 reference).
            np.testing.assert_allclose(residual[d], g, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(updates["w"]), np.mean(sent_ref, 0), rtol=1e-4, atol=1e-4)
