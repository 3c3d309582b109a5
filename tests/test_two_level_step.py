"""make_train_step on the two-level mesh ``("node", "local")`` (issue 37).

The references are numpy: per-device gradients of the same loss on each
device's batch slice, then the two-level algorithm written out (node means,
shards of ``ceil(n / L)`` elements, top-k with error feedback per shard, the
mean over nodes, reassembled), and single-device training on the whole
batch for the dense optimizer. Byte counts are checked against their
formulas.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import distributed as dist

AX = ("node", "local")
N = 8
ROWS = 4  # batch rows per device
IN, HIDDEN = 6, 5
RATIO = 0.3
LR = 0.1
SHAPES = {"w1": (IN, HIDDEN), "b1": (HIDDEN,), "w2": (HIDDEN,), "b2": ()}


def loss_fn(params, batch):
    hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((hidden @ params["w2"] + params["b2"] - batch["y"]) ** 2)


def init_params():
    rng = np.random.default_rng(1)
    return {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in SHAPES.items()}


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        x = rng.standard_normal((N * ROWS, IN)).astype(np.float32)
        out.append({"x": x, "y": np.sin(x.sum(1)).astype(np.float32)})
    return out


_grad = jax.jit(jax.grad(loss_fn))


def device_grads(params, batch):
    """Each device's gradient on its slice of the batch (device d = node * L + local)."""
    return [
        {k: np.asarray(v, np.float64) for k, v in _grad(params, sliced).items()}
        for sliced in (
            jax.tree.map(lambda a, d=d: a[d * ROWS : (d + 1) * ROWS], batch) for d in range(N)
        )
    ]


def top_k_send(acc, ratio):
    """The top-k message of one shard (numpy): the k largest magnitudes kept."""
    k = min(acc.size, max(1, math.ceil(ratio * acc.size)))
    sent = np.zeros_like(acc)
    idx = np.argsort(-np.abs(acc), kind="stable")[:k]
    sent[idx] = acc[idx]
    return sent


def two_level_top_k(grads, residuals, nodes, local, ratio=RATIO):
    """One two-level top-k exchange in numpy: (update, new residuals[node][local][leaf])."""
    updates, new = {}, [[{} for _ in range(local)] for _ in range(nodes)]
    for name, shape in SHAPES.items():
        size = math.prod(shape)
        rows = -(-size // local)
        sums = np.zeros((local, rows))
        for n in range(nodes):
            node = np.mean([grads[n * local + i][name].reshape(-1) for i in range(local)], axis=0)
            shards = np.pad(node, (0, rows * local - size)).reshape(local, rows)
            for i in range(local):
                acc = shards[i] + residuals[n][i][name]
                sent = top_k_send(acc, ratio)
                new[n][i][name] = acc - sent
                sums[i] += sent
        updates[name] = (sums / nodes).reshape(-1)[:size].reshape(shape)
    return updates, new


def zero_residuals(nodes, local):
    return [
        [{k: np.zeros(-(-math.prod(s) // local)) for k, s in SHAPES.items()} for _ in range(local)]
        for _ in range(nodes)
    ]


def padded_bytes(local, names=tuple(SHAPES)):
    return 4 * sum(-(-math.prod(SHAPES[k]) // local) * local for k in names)


def intra_bytes(local, names=tuple(SHAPES)):
    return 2 * (local - 1) / local * padded_bytes(local, names)


def inter_bytes(nodes, local, names=tuple(SHAPES), ratio=RATIO):
    """The sparse all-gather of the shard messages to ``nodes - 1`` peers.

    Each shard of ``n`` elements sends a message of capacity ``min(n, ceil(1.5 k))``
    (index, value) pairs, 8 bytes each (top_k's default ``capacity_factor``).
    """
    pairs = 0
    for name in names:
        n = -(-math.prod(SHAPES[name]) // local)
        k = max(1, math.ceil(ratio * n))
        pairs += min(n, max(k, math.ceil(1.5 * k)))
    return (nodes - 1) * 8 * pairs


def mesh_for(nodes, local):
    assert jax.device_count() >= N, "tests/conftest.py sets 8 simulated devices"
    return jax.make_mesh((nodes, local), AX)


def run_step(mesh, tx, data, **options):
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh, axis_name=AX)
    step = dist.make_train_step(loss_fn, tx, mesh, axis_name=AX, **options)
    history = []
    for batch in data:
        params, state, metrics = step(params, state, dist.shard_batch(batch, mesh, axis_name=AX))
        history.append(jax.tree.map(np.asarray, metrics))
    return jax.tree.map(np.asarray, params), state, history


def top_k_tx():
    return jaxcomp.top_k(RATIO, axis_name=AX, exchange="sparse")


MESHES = pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])


@MESHES
@pytest.mark.parametrize("steps", [1, 3])
def test_top_k_step_matches_numpy_two_level(nodes, local, steps):
    data = batches(steps)
    params, state, history = run_step(
        mesh_for(nodes, local), optax.chain(top_k_tx(), optax.sgd(LR)), data
    )
    ref = {k: v.astype(np.float64) for k, v in init_params().items()}
    residuals = zero_residuals(nodes, local)
    for batch in data:
        grads = device_grads(jax.tree.map(np.float32, ref), batch)
        updates, residuals = two_level_top_k(grads, residuals, nodes, local)
        ref = {k: ref[k] - LR * updates[k] for k in ref}
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref[k], rtol=2e-5, atol=2e-6)
        stored = np.asarray(state[0].inner.residual[k])  # (N, shard)
        want = np.stack([residuals[d // local][d % local][k] for d in range(N)])
        np.testing.assert_allclose(stored, want, rtol=2e-5, atol=2e-6)
    intra, inter = intra_bytes(local), inter_bytes(nodes, local)
    for metrics in history:
        assert metrics["intra_node_bytes"] == pytest.approx(intra)
        assert metrics["inter_node_bytes"] == pytest.approx(inter)
        assert metrics["wire_bytes"] == pytest.approx(intra + inter)


def single_device_training(tx, data):
    params = jax.tree.map(jnp.asarray, init_params())
    state = tx.init(params)
    for batch in data:
        updates, state = tx.update(jax.grad(loss_fn)(params, batch), state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


@MESHES
@pytest.mark.parametrize("exchange", ["step", "dense_exchange"])
def test_dense_optimizer_averages_over_both_axes(nodes, local, exchange):
    """A dense optimizer is single-device training on the whole batch."""
    data = batches(3)
    opt = optax.sgd(LR, momentum=0.9)
    tx = opt if exchange == "step" else optax.chain(dist.dense_exchange(axis_name=AX), opt)
    params, _, history = run_step(mesh_for(nodes, local), tx, data)
    want = single_device_training(opt, data)
    for k in SHAPES:
        np.testing.assert_allclose(params[k], want[k], rtol=2e-5, atol=2e-6)
    # The dense all-reduce over all N devices; no link classes without a two-level compressor.
    assert history[-1]["wire_bytes"] == pytest.approx(2 * (N - 1) / N * padded_bytes(1))
    assert "intra_node_bytes" not in history[-1]


def reference_run(data, nodes, local, optimizer):
    """numpy two-level top-k, its update fed to ``optimizer(update, step) -> delta``."""
    ref = {k: v.astype(np.float64) for k, v in init_params().items()}
    residuals = zero_residuals(nodes, local)
    for t, batch in enumerate(data):
        grads = device_grads(jax.tree.map(np.float32, ref), batch)
        updates, residuals = two_level_top_k(grads, residuals, nodes, local)
        delta = optimizer(updates, t)
        ref = {k: ref[k] + delta[k] for k in ref}
    return ref


def test_chain_with_momentum_matches_numpy():
    nodes, local, beta = 2, 4, 0.9
    data = batches(3)
    tx = optax.chain(top_k_tx(), optax.sgd(LR, momentum=beta))
    params, _, _ = run_step(mesh_for(nodes, local), tx, data)
    trace = {k: 0.0 for k in SHAPES}

    def momentum(updates, t):
        for k in trace:
            trace[k] = updates[k] + beta * trace[k]
        return {k: -LR * trace[k] for k in trace}

    ref = reference_run(data, nodes, local, momentum)
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref[k], rtol=2e-5, atol=2e-6)


def test_inject_hyperparams_schedule_matches_numpy():
    nodes, local = 4, 2
    data = batches(3)
    schedule = optax.linear_schedule(LR, LR / 4, 3)
    tx = optax.inject_hyperparams(
        lambda learning_rate: optax.chain(top_k_tx(), optax.sgd(learning_rate))
    )(learning_rate=schedule)
    params, _, history = run_step(mesh_for(nodes, local), tx, data)
    lrs = [LR, LR - LR * 3 / 4 / 3, LR - 2 * LR * 3 / 4 / 3]
    ref = reference_run(data, nodes, local, lambda u, t: {k: -lrs[t] * v for k, v in u.items()})
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref[k], rtol=2e-5, atol=2e-6)
    assert history[-1]["intra_node_bytes"] == pytest.approx(intra_bytes(local))


def test_multi_steps_runs_on_the_mean_and_counts_every_run():
    """MultiSteps(every 2): the inner two-level top-k sees each device's mean of two mini-steps."""
    nodes, local, every = 2, 4, 2
    data = batches(4)
    tx = optax.MultiSteps(optax.chain(top_k_tx(), optax.sgd(LR)), every_k_schedule=every)
    params, _, history = run_step(mesh_for(nodes, local), tx, data)
    ref = {k: v.astype(np.float64) for k, v in init_params().items()}
    residuals = zero_residuals(nodes, local)
    for start in range(0, len(data), every):
        now = jax.tree.map(np.float32, ref)
        per_step = [device_grads(now, b) for b in data[start : start + every]]
        mean = [{k: np.mean([g[d][k] for g in per_step], axis=0) for k in SHAPES} for d in range(N)]
        updates, residuals = two_level_top_k(mean, residuals, nodes, local)
        ref = {k: ref[k] - LR * updates[k] for k in ref}
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref[k], rtol=2e-5, atol=2e-6)
    # optax runs the inner update (its exchange) on every mini-step: each sends.
    intra, inter = intra_bytes(local), inter_bytes(nodes, local)
    for metrics in history:
        assert metrics["intra_node_bytes"] == pytest.approx(intra)
        assert metrics["inter_node_bytes"] == pytest.approx(inter)
        assert metrics["wire_bytes"] == pytest.approx(intra + inter)


def test_masked_leaves_are_averaged_densely_over_all_devices():
    """check_unexchanged: the leaves outside the compressor get the mean over all N devices."""
    nodes, local = 2, 4
    data = batches(2)
    mask = {"w1": True, "b1": False, "w2": True, "b2": False}
    tx = optax.chain(optax.masked(top_k_tx(), mask), optax.sgd(LR))
    params, _, history = run_step(mesh_for(nodes, local), tx, data)
    ref = {k: v.astype(np.float64) for k, v in init_params().items()}
    residuals = zero_residuals(nodes, local)
    for batch in data:
        grads = device_grads(jax.tree.map(np.float32, ref), batch)
        updates, residuals = two_level_top_k(grads, residuals, nodes, local)
        for k in ("b1", "b2"):
            updates[k] = np.mean([g[k] for g in grads], axis=0)
        ref = {k: ref[k] - LR * updates[k] for k in ref}
    for k in SHAPES:
        np.testing.assert_allclose(params[k], ref[k], rtol=2e-5, atol=2e-6)
    sparse = ("w1", "w2")
    intra, inter = intra_bytes(local, sparse), inter_bytes(nodes, local, sparse)
    dense = 2 * (N - 1) / N * 4 * (HIDDEN + 1)
    assert history[-1]["intra_node_bytes"] == pytest.approx(intra)
    assert history[-1]["inter_node_bytes"] == pytest.approx(inter)
    assert history[-1]["wire_bytes"] == pytest.approx(intra + inter + dense)
    with pytest.raises(ValueError, match=r"\['b1'\]"):
        run_step(mesh_for(nodes, local), tx, data[:1], unexchanged="error")


def test_state_is_per_device_over_both_axes_and_donated():
    nodes, local = 2, 4
    mesh = mesh_for(nodes, local)
    tx = optax.chain(top_k_tx(), optax.sgd(LR))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh, axis_name=AX)
    residual = state[0].inner.residual["w1"]
    assert residual.shape == (N, -(-IN * HIDDEN // local))
    assert residual.sharding.spec[0] == AX
    step = dist.make_train_step(loss_fn, tx, mesh, axis_name=AX)
    batch = dist.shard_batch(batches(1)[0], mesh, axis_name=AX)
    new_params, new_state, _ = step(params, state, batch)
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert residual.is_deleted()
    assert not any(x.is_deleted() for x in jax.tree.leaves((new_params, new_state)))
    # A state stacked for another device count is refused, naming both axes.
    flat_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    flat_tx = optax.chain(jaxcomp.top_k(RATIO, axis_name="data"), optax.sgd(LR))
    flat_state = dist.init_opt_state(flat_tx, dist.replicate(init_params(), flat_mesh), flat_mesh)
    with pytest.raises(ValueError, match="8 devices along \\('node', 'local'\\)"):
        step(new_params, flat_state, batch)


def test_overlap_and_local_branch_are_refused_naming_both_axes():
    mesh = mesh_for(2, 4)
    tx = optax.chain(top_k_tx(), optax.sgd(LR))
    with pytest.raises(ValueError, match="overlap=True.*two-level"):
        dist.make_train_step(loss_fn, tx, mesh, axis_name=AX, overlap=True)
    # optax.apply_if_finite decides per device: the remedy names both axes, not the node axis.
    wrapped = optax.apply_if_finite(tx, 3)
    with pytest.raises(ValueError, match=r"axis_name=\('node', 'local'\)"):
        run_step(mesh, wrapped, batches(1))
    finite = dist.apply_if_finite(tx, 3, axis_name=AX)
    params, _, _ = run_step(mesh, finite, batches(1))
    plain, _, _ = run_step(mesh, tx, batches(1))
    for k in SHAPES:
        np.testing.assert_array_equal(params[k], plain[k])


def test_time_split_runs_on_the_two_level_mesh():
    mesh = mesh_for(2, 4)
    tx = optax.chain(top_k_tx(), optax.sgd(LR))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh, axis_name=AX)
    batch = dist.shard_batch(batches(1)[0], mesh, axis_name=AX)
    split = dist.time_split(loss_fn, tx, mesh, params, state, batch, axis_name=AX, repeats=1)
    assert split.step > 0 and split.forward_backward > 0
    # The state passed in is not modified (still usable).
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))


def test_two_level_mesh_puts_consecutive_devices_on_a_node():
    mesh = dist.two_level_mesh(local=4)
    assert dict(mesh.shape) == {"node": 2, "local": 4}
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    np.testing.assert_array_equal(ids, np.arange(8).reshape(2, 4))
    with pytest.raises(ValueError, match="local=3 does not divide"):
        dist.two_level_mesh(local=3)
    with pytest.raises(ValueError, match="local must be a positive int"):
        dist.two_level_mesh(local=0)
