"""Aggregation modes: weighted full aggregation, gossip exchanges and D-PSGD, ensembles.

Every result is checked against an independent numpy reference (or a
single-device optax run) on 8 simulated devices.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import topk_set
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import aggregation as agg
from jaxcomp import distributed as dist

N = 8
W3 = 1.0 / 3.0


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def _put(mesh, tree):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def _ring_mix(x, w=(W3, W3, W3)):
    """numpy ring mix along axis 0: w_self x_i + w_left x_{i-1} + w_right x_{i+1}."""
    x = np.asarray(x, np.float64)
    return w[0] * x + w[1] * np.roll(x, 1, axis=0) + w[2] * np.roll(x, -1, axis=0)


def _allreduce(nbytes):
    return 2.0 * (N - 1) / N * nbytes


@functools.cache
def _exchange_fn(tx, mesh, extra_keys):
    """jit(shard_map) of one ``tx.update`` from fresh state, per-device outputs stacked."""

    def run(grads, extra):
        g = jax.tree.map(lambda a: a[0], grads)
        e = jax.tree.map(lambda a: a[0], extra)
        updates, state = tx.update(g, tx.init(g), None, **e)
        wire = sum(v for _, v in optax.tree.get_all_with_path(state, "wire_bytes"))
        return jax.tree.map(lambda a: a[None], (updates, wire))

    spec = P("data")
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def _exchange(tx, mesh, grads, **extra):
    fn = _exchange_fn(tx, mesh, tuple(sorted(extra)))
    updates, wire = fn(_put(mesh, grads), _put(mesh, extra))
    return jax.tree.map(np.asarray, updates), np.asarray(wire)


# --- full aggregation, weighted -----------------------------------------------------


def _grads(seed):
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((N, 5, 3)).astype(np.float32),
        "b": rng.standard_normal((N, 3)).astype(np.float32),
    }


def _weighted_ref(g, w):
    w = np.asarray(w, np.float64)
    return np.tensordot(w, np.asarray(g, np.float64), axes=1) / w.sum()


def test_weighted_exchange_matches_numpy(mesh):
    tx = agg.weighted_exchange("data")
    g = _grads(0)
    weights = np.array([3, 0, 1, 5, 0, 2, 4, 1], np.float32)
    updates, wire = _exchange(tx, mesh, g, weight=weights)
    for name in g:
        ref = _weighted_ref(g[name], weights)
        # Every device holds the same weighted mean.
        np.testing.assert_allclose(
            updates[name], np.broadcast_to(ref, updates[name].shape), rtol=1e-5, atol=1e-6
        )
        np.testing.assert_array_equal(
            updates[name], np.broadcast_to(updates[name][0], updates[name].shape)
        )
    nbytes = 4 * (5 * 3 + 3)
    np.testing.assert_allclose(wire, _allreduce(nbytes) + _allreduce(12))

    # A zero-weight device is left out even when its gradient is not finite.
    bad = {k: v.copy() for k, v in g.items()}
    bad["w"][1, 0, 0] = np.nan
    updates, _ = _exchange(tx, mesh, bad, weight=weights)
    np.testing.assert_allclose(
        updates["w"][3], _weighted_ref(g["w"], weights), rtol=1e-5, atol=1e-6
    )

    # Backup workers: include=False zeroes a device's weight.
    include = np.array([True, True, False, True, True, True, False, True])
    updates, _ = _exchange(tx, mesh, g, weight=weights, include=include)
    np.testing.assert_allclose(
        updates["b"][0], _weighted_ref(g["b"], weights * include), rtol=1e-5, atol=1e-6
    )

    # All weights 0: a zero update; a negative weight anywhere: NaN everywhere.
    updates, _ = _exchange(tx, mesh, g, weight=np.zeros(N, np.float32))
    assert np.all(updates["w"] == 0)
    neg = weights.copy()
    neg[4] = -1.0
    updates, _ = _exchange(tx, mesh, g, weight=neg)
    assert np.all(np.isnan(updates["w"])) and np.all(np.isnan(updates["b"]))


def test_weighted_exchange_fixed_weights_and_errors(mesh):
    weights = [1.0, 2.0, 0.0, 0.5, 3.0, 1.0, 0.0, 2.5]
    g = _grads(1)
    updates, _ = _exchange(agg.weighted_exchange("data", weights=weights), mesh, g)
    np.testing.assert_allclose(
        updates["w"][5], _weighted_ref(g["w"], weights), rtol=1e-5, atol=1e-6
    )
    for bad in ([1.0, -1.0], [np.nan, 1.0], [0.0, 0.0], "ab", [[1.0, 2.0]], []):
        with pytest.raises(ValueError, match="weights"):
            agg.weighted_exchange("data", weights=bad)
    with pytest.raises(ValueError, match="3 entries"):
        _exchange(agg.weighted_exchange("data", weights=[1.0, 2.0, 3.0]), mesh, g)
    with pytest.raises(ValueError, match="do not also pass"):
        _exchange(
            agg.weighted_exchange("data", weights=weights), mesh, g, weight=np.ones(N, np.float32)
        )
    with pytest.raises(ValueError, match="no weight"):
        _exchange(agg.weighted_exchange("data"), mesh, g)


def test_weighted_exchange_under_x64_weights_in_float64(mesh):
    """float64 gradients: the normalised weights were float32 (~3e-8 relative error)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(4)
        g = {"w": rng.standard_normal((N, 3)), "b": np.broadcast_to(np.pi, (N, 2)).copy()}
        weights = np.array([1.0, 3.0, 0.0, 7.0, 1.0, 1.0, 2.0, 5.0])
        updates, wire = _exchange(agg.weighted_exchange("data"), mesh, g, weight=weights)
        for name in g:
            assert updates[name].dtype == np.float64
            np.testing.assert_allclose(
                updates[name][0], _weighted_ref(g[name], weights), rtol=1e-14
            )
        np.testing.assert_allclose(wire, _allreduce(5 * 8) + _allreduce(24))
        fixed = agg.weighted_exchange("data", weights=[1.0, 1.0, 1.0] + [0.0] * (N - 3))
        updates, _ = _exchange(fixed, mesh, g)
        np.testing.assert_allclose(updates["b"][0], g["b"][0], rtol=1e-15)
        scaled, _ = _exchange(agg.scale_by_weight("data"), mesh, g, weight=weights)
        np.testing.assert_allclose(scaled["w"].mean(0), _weighted_ref(g["w"], weights), rtol=1e-14)


@pytest.mark.parametrize(
    "weights",
    [[1e-40, 1e-40], [3e38, 3e38], [1e-50], [1e308, 1e308, 1e308], [1e-40, 1.0]],
    ids=["f32_subnormal", "f32_sum_overflows", "f32_zero", "f64_sum_overflows", "mixed"],
)
def test_fixed_weights_that_underflow_or_overflow_float32(mesh, weights):
    """Finite weights > 0 whose float32 value is 0 (or sum inf) gave a zero update."""
    w = np.zeros(N)
    w[: len(weights)] = weights
    g = _grads(5)
    ref = _weighted_ref(g["w"], w / w.max())  # numpy float64, scaled first
    updates, _ = _exchange(agg.weighted_exchange("data", weights=w.tolist()), mesh, g)
    np.testing.assert_allclose(updates["w"][0], ref, rtol=1e-5, atol=1e-6)
    # scale_by_weight: the mean over the devices of N w_i / W g_i.
    scaled, _ = _exchange(agg.scale_by_weight("data", weights=w.tolist()), mesh, g)
    np.testing.assert_allclose(scaled["w"].mean(0), ref, rtol=1e-5, atol=1e-6)


def test_per_step_weights_whose_float32_sum_overflows(mesh):
    g = _grads(6)
    weights = np.full(N, 3e38, np.float32)
    weights[::2] = 1e38
    updates, _ = _exchange(agg.weighted_exchange("data"), mesh, g, weight=weights)
    ref = _weighted_ref(g["w"], weights.astype(np.float64) / 1e38)
    np.testing.assert_allclose(updates["w"][0], ref, rtol=1e-5, atol=1e-6)


def test_small_per_step_weights_are_not_flushed(mesh):
    # 2e-38 is a normal float32; scaled by 2^-ceil(log2 N) it would be
    # subnormal, flushed to 0 on XLA:CPU: an all-zero (silent) update.
    g = _grads(7)
    weights = np.full(N, 2e-38, np.float32)
    weights[1] = 4e-38
    updates, _ = _exchange(agg.weighted_exchange("data"), mesh, g, weight=weights)
    ref = _weighted_ref(g["w"], weights.astype(np.float64) / 2e-38)
    np.testing.assert_allclose(updates["w"][0], ref, rtol=1e-5, atol=1e-6)


def _masked_lsq(w, b):
    # Each device's mean loss over its valid rows (the mask), 0 for an empty shard.
    err = b["x"] @ w - b["y"]
    return jnp.sum(b["m"] * err**2) / jnp.maximum(jnp.sum(b["m"]), 1.0)


def test_weighted_train_step_equals_sgd_on_the_union_batch(mesh):
    """Unequal local batches by masking: device i has 4 rows of which the first b_i count.

    With weights b_i the weighted mean of the local mean-loss gradients is the
    gradient of the mean loss over the union of the valid rows.
    """
    rng = np.random.default_rng(2)
    rows, dim, lr = 4, 3, 0.1
    counts = np.array([4, 1, 0, 3, 2, 4, 1, 2])
    x = rng.standard_normal((N * rows, dim)).astype(np.float32)
    y = rng.standard_normal(N * rows).astype(np.float32)
    mask = (np.arange(rows)[None, :] < counts[:, None]).reshape(-1).astype(np.float32)
    tx = optax.chain(agg.weighted_exchange("data"), optax.sgd(lr))
    params = dist.replicate(jnp.zeros(dim), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(_masked_lsq, tx, mesh, unexchanged="error")
    batch = dist.shard_batch({"x": x, "y": y, "m": mask}, mesh)
    update_args = dist.shard_batch({"weight": counts.astype(np.float32)}, mesh)

    xu, yu = x[mask > 0].astype(np.float64), y[mask > 0].astype(np.float64)
    ref = np.zeros(dim)
    for _ in range(3):
        params, state, metrics = step(params, state, batch, update_args)
        ref = ref - lr * 2.0 / len(yu) * xu.T @ (xu @ ref - yu)
    np.testing.assert_allclose(np.asarray(params), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(metrics["wire_bytes"]), _allreduce(12) + _allreduce(12))


def test_scale_by_weight_gives_compressors_the_weighted_mean(mesh):
    g = _grads(3)
    weights = np.array([2, 0, 1, 3, 1, 0, 4, 1], np.float32)
    # ratio 1: every element is sent, the exchange's mean is the weighted mean.
    full = optax.chain(agg.scale_by_weight("data"), jaxcomp.top_k(1.0, axis_name="data"))
    updates, _ = _exchange(full, mesh, g, weight=weights)
    np.testing.assert_allclose(
        updates["w"][2], _weighted_ref(g["w"], weights), rtol=1e-5, atol=1e-6
    )

    # ratio 0.25: nothing lost globally, sum_i residual_i + N update = N weighted mean.
    tx = optax.chain(agg.scale_by_weight("data"), jaxcomp.top_k(0.25, axis_name="data"))

    def run(grads, w):
        gl = jax.tree.map(lambda a: a[0], grads)
        u, s = tx.update(gl, tx.init(gl), None, weight=w[0])
        return jax.tree.map(lambda a: a[None], (u, s[1].residual))

    fn = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    updates, residual = jax.tree.map(np.asarray, fn(_put(mesh, g), _put(mesh, weights)))
    for name in g:
        total = residual[name].astype(np.float64).sum(0) + N * updates[name][0]
        np.testing.assert_allclose(total, N * _weighted_ref(g[name], weights), rtol=1e-5, atol=1e-5)
        assert np.count_nonzero(residual[name][0]) > 0  # device 0 held some back
        assert not np.any(residual[name][1])  # weight 0: nothing owed


# --- gossip as a compressor exchange ------------------------------------------------


def _tree(seed, shapes):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal((N, n)).astype(np.float32) for k, n in shapes.items()}


def test_sparsifier_gossip_is_the_ring_mix_of_messages(mesh):
    """top_k with exchange="gossip": sparse pairs (a), a dense-sent leaf (b), two steps."""
    tx = jaxcomp.top_k(0.25, axis_name="data", exchange="gossip", min_dense_size=4)
    shapes = {"a": 64, "b": 4}
    state = dist.init_opt_state(tx, {k: np.zeros(n, np.float32) for k, n in shapes.items()}, mesh)

    def run(grads, state):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        u, s = tx.update(first(grads), first(state))
        return jax.tree.map(lambda a: a[None], (u, s))

    fn = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    residual = {k: np.zeros((N, n), np.float32) for k, n in shapes.items()}
    k, cap = 16, 24  # k = 0.25 * 64, capacity ceil(1.5 k)
    for t in range(2):
        g = _tree(10 + t, shapes)
        updates, state = fn(_put(mesh, g), state)
        acc = {name: residual[name] + g[name] for name in g}
        sent = {
            "a": np.stack([np.where(topk_set(acc["a"][i], k), acc["a"][i], 0) for i in range(N)]),
            "b": acc["b"],
        }
        for name in g:
            # Each device: the ring mix of its own and its neighbours' messages.
            np.testing.assert_allclose(
                np.asarray(updates[name]), _ring_mix(sent[name]), rtol=1e-5, atol=1e-6
            )
            # Nothing lost: what each device sent left its residual, bit for bit.
            new_res = np.asarray(state.residual[name])
            np.testing.assert_array_equal(new_res, acc[name] - sent[name])
            residual[name] = new_res
        # Two messages per leaf: 24 (int32, float32) pairs, and the 4-float dense leaf.
        np.testing.assert_array_equal(np.asarray(state.wire_bytes), 2 * (cap * 8) + 2 * 16)
    mixed = np.asarray(updates["a"])
    assert not np.allclose(mixed[0], mixed[4])  # decentralized: updates differ per device


def test_sparsifier_gossip_sends_the_dense_message_when_smaller(mesh):
    tx = jaxcomp.top_k(0.5, axis_name="data", exchange="gossip")  # cap 12 pairs > 16 floats
    g = _tree(20, {"c": 16})
    updates, wire = _exchange(tx, mesh, g)
    sent = np.stack([np.where(topk_set(g["c"][i], 8), g["c"][i], 0) for i in range(N)])
    np.testing.assert_allclose(updates["c"], _ring_mix(sent), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(wire, 2 * 16 * 4)


def _sign_decode(x):
    """numpy scaled sign (one bucket): mean |x| times sign, zeros sent as +."""
    x = np.asarray(x, np.float32)
    scale = np.mean(np.abs(x), axis=-1, keepdims=True, dtype=np.float64)
    return np.where(x < 0, -scale, scale)


def test_quantizer_gossip_is_the_ring_mix_of_decoded_messages(mesh):
    tx = jaxcomp.ef_sign_sgd(axis_name="data", exchange="gossip", min_dense_size=4)
    shapes = {"a": 64, "b": 4}
    state = dist.init_opt_state(tx, {k: np.zeros(n, np.float32) for k, n in shapes.items()}, mesh)
    g = _tree(30, shapes)

    def run(grads, state):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        u, s = tx.update(first(grads), first(state))
        return jax.tree.map(lambda a: a[None], (u, s))

    fn = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    updates, state = fn(_put(mesh, g), state)
    sent = {"a": _sign_decode(g["a"]), "b": g["b"]}
    for name in g:
        np.testing.assert_allclose(
            np.asarray(updates[name]), _ring_mix(sent[name]), rtol=1e-5, atol=1e-6
        )
        # Error feedback: the residual is what was not sent (one rounding).
        np.testing.assert_allclose(
            np.asarray(state.residual[name]), g[name] - sent[name], rtol=1e-6, atol=1e-6
        )
    # Two messages: 64 sign bits + one float32 scale; the dense leaf twice.
    np.testing.assert_array_equal(np.asarray(state.wire_bytes), 2 * (8 + 4) + 2 * 16)


_GOSSIP_TXS = {
    "top_k": lambda: optax.chain(
        jaxcomp.top_k(0.25, axis_name="data", exchange="gossip"), optax.sgd(0.1)
    ),
    "qsgd": lambda: jaxcomp.qsgd(bits=2, axis_name="data", exchange="gossip", min_dense_size=0),
    "dense": lambda: optax.chain(agg.gossip_exchange("data"), optax.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(_GOSSIP_TXS))
def test_make_train_step_rejects_gossip(mesh, name):
    tx = _GOSSIP_TXS[name]()
    params = dist.replicate(jnp.zeros(32), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(lambda w, b: jnp.mean((b @ w) ** 2), tx, mesh)
    batch = dist.shard_batch(np.ones((N, 32), np.float32), mesh)
    with pytest.raises(ValueError, match="make_gossip_train_step"):
        step(params, state, batch)


def test_gossip_and_server_reject_backup_workers(mesh):
    g = _tree(40, {"a": 64, "b": 4})
    include = np.ones(N, bool)
    for tx in (
        jaxcomp.top_k(0.25, axis_name="data", exchange="gossip", min_dense_size=4),
        jaxcomp.top_k(0.25, axis_name="data", exchange="server"),
        jaxcomp.top_k(0.25, axis_name="data", exchange="sparcml"),
        jaxcomp.ef_sign_sgd(axis_name="data", exchange="gossip"),
        agg.gossip_exchange("data"),
    ):
        with pytest.raises(ValueError, match="include"):
            _exchange(tx, mesh, g, include=include)


# --- decentralized training (D-PSGD) ------------------------------------------------


def _lsq(w, b):
    return jnp.mean((b["x"] @ w - b["y"]) ** 2)


def _lsq_grad(w, x, y):
    """numpy per-device gradient of the mean squared error; w [N, d], x [N, m, d]."""
    err = np.einsum("nmd,nd->nm", x, w) - y
    return 2.0 / x.shape[1] * np.einsum("nmd,nm->nd", x, err)


def _lsq_problem(seed, dim, rows):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, rows, dim)).astype(np.float32)
    y = rng.standard_normal((N, rows)).astype(np.float32)
    w0 = rng.standard_normal((N, dim)).astype(np.float32)  # replicas start apart
    return x, y, w0


@pytest.mark.parametrize("exchange", ["none", "gossip_exchange"])
def test_gossip_train_step_is_dpsgd(mesh, exchange):
    dim, rows, lr = 4, 6, 0.05
    x, y, w0 = _lsq_problem(50, dim, rows)
    tx = optax.sgd(lr)
    if exchange == "gossip_exchange":
        tx = optax.chain(agg.gossip_exchange("data"), tx)
    reps = agg.stack_replicas(w0, mesh, per_device=True)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_gossip_train_step(_lsq, tx, mesh)
    batch = dist.shard_batch({"x": x.reshape(N * rows, dim), "y": y.reshape(-1)}, mesh)

    ref = w0.astype(np.float64)
    consensus = [float(agg.consensus_distance(reps))]
    for _ in range(3):
        losses = np.mean((np.einsum("nmd,nd->nm", x, ref) - y) ** 2, axis=1)
        reps, state, metrics = step(reps, state, batch)
        grad = _lsq_grad(ref, x, y)
        if exchange == "gossip_exchange":
            grad = _ring_mix(grad)
        ref = _ring_mix(ref) - lr * grad
        np.testing.assert_allclose(np.asarray(reps), ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(float(metrics["loss"]), losses.mean(), rtol=1e-5)
        ref_consensus = np.mean(np.sum((ref - ref.mean(0)) ** 2, axis=1))
        consensus.append(float(agg.consensus_distance(reps)))
        np.testing.assert_allclose(consensus[-1], ref_consensus, rtol=1e-4)
    # Parameter mixing: 2 x 4 float32; the dense gradient gossip as much again.
    wire = 2 * dim * 4 * (2 if exchange == "gossip_exchange" else 1)
    np.testing.assert_allclose(float(metrics["wire_bytes"]), wire)
    assert consensus[-1] < 0.5 * consensus[0]
    assert all(b < a for a, b in zip(consensus, consensus[1:], strict=False))


def test_gossip_compressor_in_the_decentralized_step(mesh):
    """top_k(exchange="gossip") with error feedback under D-PSGD, against numpy."""
    dim, rows, lr, k = 32, 8, 0.05, 4  # ratio 0.125: k = 4, sparse pairs on the wire
    x, y, w0 = _lsq_problem(60, dim, rows)
    tx = optax.chain(jaxcomp.top_k(0.125, axis_name="data", exchange="gossip"), optax.sgd(lr))
    reps = agg.stack_replicas(w0, mesh, per_device=True)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_gossip_train_step(_lsq, tx, mesh)
    batch = dist.shard_batch({"x": x.reshape(N * rows, dim), "y": y.reshape(-1)}, mesh)
    ref = w0.astype(np.float64)
    residual = np.zeros((N, dim))
    for _ in range(3):
        reps, state, metrics = step(reps, state, batch)
        acc = residual + _lsq_grad(ref, x, y)
        sent = np.stack([np.where(topk_set(acc[i], k), acc[i], 0) for i in range(N)])
        residual = acc - sent
        ref = _ring_mix(ref) - lr * _ring_mix(sent)
        np.testing.assert_allclose(np.asarray(reps), ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.asarray(state[0].residual), residual, rtol=1e-4, atol=1e-5)
    # Messages: 6 pairs to each neighbour; parameters: 32 floats to each neighbour.
    np.testing.assert_allclose(float(metrics["wire_bytes"]), 2 * 6 * 8 + 2 * dim * 4)


_GOSSIP_TOP_K = lambda: optax.chain(  # noqa: E731
    jaxcomp.top_k(0.5, axis_name="data", exchange="gossip"), optax.sgd(0.1)
)


@pytest.mark.parametrize(
    "wrap",
    [
        lambda: optax.apply_if_finite(_GOSSIP_TOP_K(), 3),
        lambda: jaxcomp.apply_if_finite(_GOSSIP_TOP_K(), 3),
        lambda: optax.apply_if_finite(optax.chain(agg.gossip_exchange("data"), optax.sgd(0.1)), 3),
    ],
    ids=["optax", "jaxcomp_no_axis", "optax_dense_gossip"],
)
def test_gossip_step_rejects_a_per_device_skip_around_the_exchange(mesh, wrap):
    """A NaN on one device would skip its exchange while the neighbours wait (a hang)."""
    tx = wrap()
    reps = agg.stack_replicas(jnp.zeros(4), mesh)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_gossip_train_step(_lsq, tx, mesh, mix_params=False)
    batch = dist.shard_batch({"x": np.ones((N, 4), np.float32), "y": np.ones(N, np.float32)}, mesh)
    with pytest.raises(ValueError, match=r"jaxcomp.apply_if_finite\(.*axis_name='data'"):
        step(reps, state, batch)


def test_gossip_step_apply_if_finite_with_axis_skips_on_every_device(mesh):
    dim = 4
    x, y, w0 = _lsq_problem(70, dim, 2)
    tx = jaxcomp.apply_if_finite(_GOSSIP_TOP_K(), 3, axis_name="data")
    reps = agg.stack_replicas(w0, mesh, per_device=True)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_gossip_train_step(_lsq, tx, mesh, mix_params=False, donate=False)
    x_nan = x.copy()
    x_nan[3, 0, 0] = np.nan  # device 3 only
    flat = lambda x: dist.shard_batch({"x": x.reshape(-1, dim), "y": y.reshape(-1)}, mesh)  # noqa: E731
    reps, state, _ = step(reps, state, flat(x_nan))
    np.testing.assert_array_equal(np.asarray(reps), w0)  # skipped everywhere
    assert np.asarray(state.total_notfinite).tolist() == [1] * N
    # Then a finite step trains as the unwrapped chain does (numpy: top-2 of 4, ring mix).
    reps, state, _ = step(reps, state, flat(x))
    g = _lsq_grad(w0.astype(np.float64), x, y)
    sent = np.stack([np.where(topk_set(g[i], 2), g[i], 0) for i in range(N)])
    np.testing.assert_allclose(np.asarray(reps), w0 - 0.1 * _ring_mix(sent), rtol=1e-5, atol=1e-6)


def test_gossip_step_wire_bytes_under_multisteps(mesh):
    """optax.MultiSteps runs the inner exchange on every mini-step (and keeps the last
    one's state): every mini-step's exchange is counted (issue 34 item 1)."""
    dim = 32
    x, y, w0 = _lsq_problem(80, dim, 2)
    batch = dist.shard_batch({"x": x.reshape(-1, dim), "y": y.reshape(-1)}, mesh)

    def run(tx, steps):
        reps = agg.stack_replicas(w0, mesh, per_device=True)
        state = agg.init_replica_opt_state(tx, reps, mesh)
        step = agg.make_gossip_train_step(_lsq, tx, mesh, mix_params=False)
        wires = []
        for _ in range(steps):
            reps, state, metrics = step(reps, state, batch)
            wires.append(float(metrics["wire_bytes"]))
        return wires

    (sent,) = run(_GOSSIP_TOP_K(), 1)  # one exchange's bytes (checked against numpy above)
    assert sent > 0
    assert run(optax.MultiSteps(_GOSSIP_TOP_K(), 2), 4) == [sent] * 4


def test_gossip_weights_near_1_are_renormalised_no_drift(mesh):
    """Weights summing to 1.00001 (accepted by isclose) were used as given: replicas drifted."""
    w = (0.5, 0.25, 0.25001)
    got = agg.collectives.check_gossip_weights(w)
    np.testing.assert_allclose(got, np.asarray(w) / np.sum(w), rtol=1e-15)
    assert np.sum(got) == 1.0
    tx = optax.sgd(0.0)
    step = agg.make_gossip_train_step(
        lambda p, b: jnp.sum(p * 0.0) + jnp.mean(b), tx, mesh, weights=w
    )
    start = np.array([1.0, 3.0], np.float32)
    reps = agg.stack_replicas(start, mesh)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    batch = dist.shard_batch(np.zeros(N, np.float32), mesh)
    for _ in range(300):  # as given: 1.00001^300 - 1 = 3e-3 off
        reps, state, _ = step(reps, state, batch)
        jax.block_until_ready(reps)  # one collective step in flight (see docs/distributed.md)
    np.testing.assert_allclose(np.asarray(reps), np.broadcast_to(start, (N, 2)), rtol=1e-6)


def test_bad_gossip_arguments(mesh):
    with pytest.raises(ValueError, match="weights"):
        agg.make_gossip_train_step(_lsq, optax.sgd(0.1), mesh, weights=(0.5, 0.5, 0.5))
    with pytest.raises(ValueError, match="weights"):
        agg.gossip_exchange("data", weights=(1.0, 0.0))
    with pytest.raises(ValueError, match="mix_params"):
        agg.make_gossip_train_step(_lsq, optax.sgd(0.1), mesh, mix_params="yes")
    with pytest.raises(ValueError, match="leading axis"):
        agg.stack_replicas(np.zeros((3, 2)), mesh, per_device=True)


# --- ensembles --------------------------------------------------------------------


def _np_softmax(z):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _np_vote(logits):
    """Loop reference: each member's first maximal class, then the most votes, lowest first."""
    k, b, c = logits.shape
    out = np.zeros(b, np.int64)
    for j in range(b):
        counts = [0] * c
        for m in range(k):
            row = list(logits[m, j])
            counts[row.index(max(row))] += 1
        out[j] = counts.index(max(counts))
    return out


def test_combiners_match_numpy_with_ties():
    logits = np.array(
        [  # 4 members, 5 inputs, 3 classes
            [[1, 2, 0], [5, 5, 0], [0, 0, 1], [2, 1, 0], [0, 3, 3]],
            [[1, 2, 0], [0, 5, 5], [1, 0, 0], [0, 1, 2], [3, 3, 0]],
            [[3, 0, 0], [0, 0, 5], [0, 1, 0], [0, 2, 1], [1, 1, 1]],
            [[0, 0, 4], [5, 0, 0], [0, 0, 1], [1, 0, 2], [0, 0, 3]],
        ],
        np.float32,
    )
    # Input 1: member ties resolve to classes 0, 1, 2, 0 -> 0 wins; input 3: a 1-1-2 split.
    # Input 4: members vote 1, 0, 0, 2 -> class 0; input 2: votes 2, 0, 1, 2 -> 2.
    np.testing.assert_array_equal(np.asarray(agg.majority_vote(logits)), _np_vote(logits))
    probs = np.asarray(agg.average_predictions(logits))
    np.testing.assert_allclose(probs, _np_softmax(logits).mean(0), rtol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(agg.ensemble_predict(logits, "average")),
        np.argmax(_np_softmax(logits).mean(0), -1),
    )
    # An exact tie of averaged probabilities goes to the lowest class index.
    tied = np.array([[[1.0, 0.0]], [[0.0, 1.0]]], np.float32)
    assert agg.ensemble_predict(tied, "average").tolist() == [0]
    assert agg.majority_vote(tied).tolist() == [0]
    with pytest.raises(ValueError, match="method"):
        agg.ensemble_predict(logits, "median")
    with pytest.raises(ValueError, match="shape"):
        agg.majority_vote(np.zeros(3, np.float32))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_average_predictions_of_half_precision_logits_in_float32(dtype):
    """Close classes: bf16/f16 probabilities rounded them together (ties to the lowest)."""
    rng = np.random.default_rng(3)
    logits = jnp.asarray(rng.normal(size=(5, 2000, 10)) * 0.3, dtype)
    ref = _np_softmax(np.asarray(logits, np.float64)).mean(0)
    probs = agg.average_predictions(logits)
    assert probs.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(probs), ref, rtol=1e-5, atol=1e-7)
    got = np.asarray(agg.ensemble_predict(logits, "average"))
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 1e-5  # not a float32-level tie
    np.testing.assert_array_equal(got[clear], np.argmax(ref, -1)[clear])


def test_empty_inputs_in_member_logits_and_evaluate_ensemble():
    """batch_size=None with empty x raised 'range() arg 3 must not be zero'."""
    apply = lambda w, x: x @ w  # noqa: E731
    members = [jnp.eye(2), 2 * jnp.eye(2), jnp.eye(2)]
    empty = np.zeros((0, 2), np.float32)
    for bs in (None, 4):
        out = agg.member_logits(apply, members, empty, batch_size=bs)
        assert out.shape == (3, 0, 2)
        with pytest.raises(ValueError, match="x is empty"):
            agg.evaluate_ensemble(apply, members, empty, np.zeros(0, int), batch_size=bs)


def test_disjoint_shards_and_member_batches_bad_arguments():
    x, y = np.zeros((10, 2)), np.zeros(9)
    with pytest.raises(ValueError, match="x and y must have the same number"):
        next(agg.member_batches(x, y, 2, 2))  # silently dealt by len(y) before
    with pytest.raises(ValueError, match="seed"):
        agg.disjoint_shards(10, 2, seed=1.5)  # a numpy TypeError before
    with pytest.raises(ValueError, match="epoch"):
        next(agg.member_batches(x, x, 2, 2, epoch=-1))


def test_ensemble_step_rejects_a_communicating_tx(mesh):
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
    reps = agg.stack_replicas(jnp.zeros(4), mesh)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_ensemble_train_step(_lsq, tx, mesh)
    x, y, _ = _lsq_problem(70, 4, 2)
    batch = dist.shard_batch({"x": x.reshape(-1, 4), "y": y.reshape(-1)}, mesh)
    with pytest.raises(ValueError, match="communicates"):
        step(reps, state, batch)


def test_digits_ensemble(mesh):
    """8 MLPs, one per device, each on its own disjoint shard of digits; the report."""
    from experiments.data import load_digits  # noqa: PLC0415
    from experiments.models import MLP  # noqa: PLC0415

    data = load_digits()
    x_train = data.train_x.reshape(len(data.train_y), -1)
    x_test = data.test_x.reshape(len(data.test_y), -1)
    model = MLP(num_classes=10, hidden=(32,))
    keys = jax.random.split(jax.random.key(0), N)
    init = jax.vmap(lambda k: model.init(k, x_train[:1]))(keys)  # a different start each

    def loss(params, b):
        logits = model.apply(params, b["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

    tx = optax.sgd(0.1, momentum=0.9)
    reps = agg.stack_replicas(init, mesh, per_device=True)
    state = agg.init_replica_opt_state(tx, reps, mesh)
    step = agg.make_ensemble_train_step(loss, tx, mesh)
    bs = 16
    seen = []
    for epoch in range(4):
        for xb, yb in agg.member_batches(x_train, data.train_y, N, bs, epoch=epoch):
            seen.append((xb, yb))
            reps, state, metrics = step(reps, state, dist.shard_batch({"x": xb, "y": yb}, mesh))
            jax.block_until_ready(metrics)
    assert float(metrics["wire_bytes"]) == 0.0

    # Member i saw only rows of shard i, and the shards are disjoint.
    shards = agg.disjoint_shards(len(data.train_y), N)
    assert len(set(np.concatenate(shards).tolist())) == sum(len(s) for s in shards)
    row_of = {x_train[r].tobytes(): r for r in range(len(x_train))}
    for i in (0, 5):
        rows = {row_of[r.tobytes()] for xb, _ in seen for r in xb[i * bs : (i + 1) * bs]}
        assert rows <= set(shards[i].tolist())

    # Member i equals plain single-device training on the rows device i saw.
    @jax.jit
    def sgd_step(p, s, b):
        updates, s = tx.update(jax.grad(loss)(p, b), s, p)
        return optax.apply_updates(p, updates), s

    for i in (0, 5):
        p = jax.tree.map(lambda a, i=i: a[i], init)
        s = tx.init(p)
        for xb, yb in seen:
            p, s = sgd_step(p, s, {"x": xb[i * bs : (i + 1) * bs], "y": yb[i * bs : (i + 1) * bs]})
        for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(reps), strict=True):
            np.testing.assert_allclose(np.asarray(b)[i], np.asarray(a), rtol=1e-4, atol=1e-5)

    report = agg.evaluate_ensemble(model.apply, reps, x_test, data.test_y)
    members = [jax.tree.map(lambda a, i=i: np.asarray(a)[i], reps) for i in range(N)]
    logits = np.stack([np.asarray(model.apply(m, x_test)) for m in members])
    np.testing.assert_allclose(
        report.member_accuracy, [np.mean(np.argmax(lg, -1) == data.test_y) for lg in logits]
    )
    assert report.average_accuracy == pytest.approx(
        np.mean(np.argmax(_np_softmax(logits).mean(0), -1) == data.test_y)
    )
    assert report.vote_accuracy == pytest.approx(np.mean(_np_vote(logits) == data.test_y))
    print("digits ensemble:", report)
    # The members learned from ~180 examples each; the ensemble is far above chance.
    assert report.average_accuracy > 0.8 and report.vote_accuracy > 0.8
