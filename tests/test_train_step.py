"""make_train_step off the demo's road: wrappers, un-exchanged leaves, NaN, model state.

Issue 8 items 1, 2, 6 and 16. The references are single-device runs of the
same optax transformation on the full-batch gradient and numpy; "replicated"
parameters are checked on every device's own buffer.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist

N = 8
FEATURES = 16
BATCH = 8 * N
LR = 0.05


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests/conftest.py sets 8 simulated devices"
    return jax.make_mesh((N,), ("data",))


def make_data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, FEATURES)).astype(np.float32)
    y = (x @ rng.standard_normal(FEATURES) + 0.5).astype(np.float32)
    return {"x": x, "y": y}


def loss_fn(params, batch):
    pred = batch["x"] @ params["w"] + params["b"]
    return jnp.mean((pred - batch["y"]) ** 2)


def init_params():
    return {"w": np.zeros(FEATURES, np.float32), "b": np.zeros((), np.float32)}


def device_copies(x):
    """Every device's own buffer of a (nominally replicated) array."""
    return [np.asarray(s.data) for s in x.addressable_shards]


def assert_replicated(params):
    for leaf in jax.tree.leaves(params):
        copies = device_copies(leaf)
        for c in copies[1:]:
            np.testing.assert_array_equal(c, copies[0])


def run_mesh(mesh, tx, batch, steps, **kwargs):
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, **kwargs)
    sharded = dist.shard_batch(batch, mesh)
    metrics = None
    for _ in range(steps):
        params, state, metrics = step(params, state, sharded)
        jax.block_until_ready((params, metrics))
    return params, state, metrics


def run_single(tx, batch, steps):
    """The same tx on one device with the full-batch gradient (the reference)."""
    params = jax.tree.map(jnp.asarray, init_params())
    state = tx.init(params)
    grad = jax.jit(jax.grad(loss_fn))
    update = jax.jit(tx.update)
    for _ in range(steps):
        updates, state = update(grad(params, batch), state, params)
        params = optax.apply_updates(params, updates)
    return jax.tree.map(np.asarray, params)


def assert_close_to(params, ref, rtol=2e-5, atol=2e-6):
    assert_replicated(params)
    for k in ref:
        np.testing.assert_allclose(device_copies(params[k])[0], ref[k], rtol=rtol, atol=atol)


MASK = {"w": True, "b": False}
LABELS = {"w": "compressed", "b": "plain"}


# --- item 1: every update leaf averaged -------------------------------------------


@pytest.mark.parametrize(
    "make_tx, make_ref",
    [
        # Compress w (ratio 1: dense-equivalent, so the reference is plain SGD); b is
        # left out of the compressor and must still be averaged.
        (
            lambda: optax.chain(
                optax.masked(jaxcomp.top_k(1.0, axis_name="data"), MASK), optax.sgd(LR)
            ),
            lambda: optax.sgd(LR),
        ),
        (
            lambda: optax.multi_transform(
                {
                    "compressed": optax.chain(
                        jaxcomp.ldte_bs(1.0, axis_name="data"), optax.sgd(LR, momentum=0.9)
                    ),
                    "plain": optax.adam(LR),
                },
                LABELS,
            ),
            lambda: optax.multi_transform(
                {"compressed": optax.sgd(LR, momentum=0.9), "plain": optax.adam(LR)}, LABELS
            ),
        ),
        # Plain optax: a nonlinear optimizer must see the mean gradient.
        (lambda: optax.adam(LR), lambda: optax.adam(LR)),
        # A compressor without axis_name compresses the averaged gradient.
        (
            lambda: optax.chain(jaxcomp.top_k(0.25), optax.sgd(LR)),
            lambda: optax.chain(jaxcomp.top_k(0.25), optax.sgd(LR)),
        ),
    ],
    ids=["masked", "multi_transform", "plain_adam", "no_axis_name"],
)
def test_unexchanged_leaves_are_averaged(mesh, make_tx, make_ref):
    batch = make_data(1)
    params, _, metrics = run_mesh(mesh, make_tx(), batch, steps=4)
    assert_close_to(params, run_single(make_ref(), batch, steps=4))
    assert float(metrics["wire_bytes"]) > 0


def test_masked_sparse_compressor_keeps_params_replicated(mesh):
    """A real (lossy) compressor on w, b left out: every device ends with the same bits."""
    tx = optax.chain(
        optax.masked(jaxcomp.ldte_bs(0.25, axis_name="data"), MASK), optax.sgd(LR, momentum=0.9)
    )
    params, state, metrics = run_mesh(mesh, tx, make_data(2), steps=5)
    assert_replicated(params)
    assert dist.unexchanged_leaves(tx, init_params(), mesh) == ["['b']"]
    # Bytes: the compressor's sparse all-gather plus the ring all-reduce of b.
    compressor_wire = np.asarray(optax.tree.get(state, "wire_bytes")).mean()
    np.testing.assert_allclose(
        float(metrics["wire_bytes"]), compressor_wire + 2 * (N - 1) / N * 4, rtol=1e-6
    )


@pytest.mark.parametrize(
    "make_tx",
    [
        # b is averaged before tx, then clipped by this device's global norm,
        # which holds its own un-exchanged w.
        lambda: optax.chain(
            optax.clip_by_global_norm(0.01),
            optax.masked(jaxcomp.top_k(1.0, axis_name="data"), MASK),
            optax.sgd(LR),
        ),
        # b is averaged, then multiplied by this device's own N w_i / W.
        lambda: optax.chain(
            jaxcomp.aggregation.scale_by_weight("data"),
            optax.masked(jaxcomp.top_k(1.0, axis_name="data"), MASK),
            optax.sgd(LR),
        ),
        lambda: optax.chain(jaxcomp.aggregation.scale_by_weight("data"), optax.sgd(LR)),
    ],
    ids=["clip_before_masked", "scale_by_weight_masked", "scale_by_weight_alone"],
)
def test_averaged_leaves_made_device_dependent_by_tx_are_rejected(mesh, make_tx):
    weight = {"weight": np.arange(1, N + 1, dtype=np.float32)}
    params = dist.replicate(init_params(), mesh)
    tx = make_tx()
    step = dist.make_train_step(loss_fn, tx, mesh)
    with pytest.raises(ValueError, match=r"differ between devices.*\['b'\]"):
        step(params, dist.init_opt_state(tx, params, mesh), dist.shard_batch(make_data(), mesh),
             dist.shard_batch(weight, mesh))  # fmt: skip


def test_multisteps_skipping_per_device_around_an_exchange_is_rejected(mesh):
    # optax.skip_not_finite decides per device: a NaN on one device would skip
    # its exchange while the others wait in it (the step hangs, XLA aborts).
    inner = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    tx = optax.MultiSteps(inner, 1, should_skip_update_fn=optax.skip_not_finite)
    params = dist.replicate(init_params(), mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    with pytest.raises(ValueError, match=r"skip_not_finite\('data'\)"):
        step(params, dist.init_opt_state(tx, params, mesh), dist.shard_batch(make_data(), mesh))


def test_clip_after_the_exchange_keeps_params_replicated(mesh):
    # The same clip after the exchange sees the mean update on every device:
    # accepted, and equal to clipping the full-batch gradient.
    make = lambda comp: optax.chain(comp, optax.clip_by_global_norm(0.01), optax.sgd(LR))  # noqa: E731
    tx = make(optax.masked(jaxcomp.top_k(1.0, axis_name="data"), MASK))
    params, _, _ = run_mesh(mesh, tx, make_data(3), steps=2)
    assert_close_to(params, run_single(make(optax.identity()), make_data(3), steps=2))


def test_unexchanged_error_names_the_leaf(mesh):
    tx = optax.chain(optax.masked(jaxcomp.top_k(0.5, axis_name="data"), MASK), optax.sgd(LR))
    with pytest.raises(ValueError, match=r"\['b'\]"):
        run_mesh(mesh, tx, make_data(), steps=1, unexchanged="error")
    with pytest.raises(ValueError, match="unexchanged"):
        dist.make_train_step(loss_fn, tx, mesh, unexchanged="ignore")


def test_fully_exchanged_chain_has_no_unexchanged_leaves(mesh):
    for tx in [
        optax.chain(jaxcomp.ldte_bs(0.25, axis_name="data"), optax.sgd(LR, momentum=0.9)),
        optax.chain(
            jaxcomp.dgc(
                0.25, axis_name="data", momentum=0.9, warmup_ratios=(0.5,), steps_per_epoch=2
            ),
            optax.sgd(LR),
        ),
        optax.chain(jaxcomp.qsgd(levels=4, axis_name="data", min_dense_size=0), optax.adam(LR)),
        optax.chain(jaxcomp.onebit(axis_name="data"), optax.sgd(LR)),
        optax.chain(jaxcomp.top_k(0.25, axis_name="data", granularity="global"), optax.sgd(LR)),
        optax.chain(dist.dense_exchange("data"), optax.adam(LR)),
        optax.MultiSteps(
            optax.chain(jaxcomp.top_k(0.25, axis_name="data"), optax.sgd(LR)), every_k_schedule=2
        ),
        dist.apply_if_finite(
            optax.chain(jaxcomp.top_k(0.25, axis_name="data"), optax.sgd(LR)), 3, "data"
        ),
    ]:
        assert dist.unexchanged_leaves(tx, init_params(), mesh) == []


def test_multisteps_compressor_stays_replicated(mesh):
    tx = optax.MultiSteps(
        optax.chain(jaxcomp.ldte_bs(0.25, axis_name="data"), optax.sgd(LR)), every_k_schedule=2
    )
    params, _, _ = run_mesh(mesh, tx, make_data(3), steps=4)
    assert_replicated(params)
    assert np.any(device_copies(params["w"])[0] != 0)


def run_counter(calls):
    """An identity transform that records every run of the program around it (per device)."""

    def update(updates, state, params=None):
        del params
        jax.debug.callback(lambda: calls.append(1))
        return updates, state

    return optax.GradientTransformation(lambda _: optax.EmptyState(), update)


def _wires(mesh, tx, batches):
    params = dist.replicate(init_params(), mesh)
    p, s = params, dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, donate=False)
    wires = []
    for b in batches:
        p, s, metrics = step(p, s, dist.shard_batch(b, mesh))
        wires.append(float(metrics["wire_bytes"]))
    jax.block_until_ready(p)
    return wires, p, s


def test_multisteps_wire_bytes_count_every_mini_step(mesh):
    """Issue 34 item 1: optax.MultiSteps runs its inner update, the exchange included, on
    every mini-step (on the running mean) and keeps the last one's state only; the bytes
    of every run are counted. The leaves the step averages itself (b, outside the
    compressor) cost every step too. A mini-step skipped on all devices sends nothing."""
    plain = optax.chain(jaxcomp.top_k(0.25, axis_name="data"), optax.sgd(LR))
    masked = optax.chain(optax.masked(jaxcomp.top_k(0.25, axis_name="data"), MASK), optax.sgd(LR))
    batches = [make_data(3)] * 4
    for tx in (plain, masked):
        one, _, _ = _wires(mesh, tx, batches)
        dense_b = 2 * (N - 1) / N * 4 if tx is masked else 0.0  # b's ring all-reduce
        exchange = one[0] - dense_b  # one exchange's bytes
        assert exchange > 0 and len(set(one)) == 1
        calls = []
        multi = optax.MultiSteps(optax.chain(run_counter(calls), tx), every_k_schedule=2)
        wires, _, _ = _wires(mesh, multi, batches)
        assert len(calls) == 4 * N  # the inner update (and its exchange) ran on every mini-step
        assert wires == [dense_b + exchange] * 4
    # skip_not_finite: the poisoned mini-step is skipped on every device, nothing is sent.
    poisoned = {k: v.copy() for k, v in make_data(3).items()}
    poisoned["x"][0, 0] = np.nan
    calls = []
    skip = dist.skip_not_finite("data")
    multi = optax.MultiSteps(
        optax.chain(run_counter(calls), plain), every_k_schedule=2, should_skip_update_fn=skip
    )
    wires, _, _ = _wires(mesh, multi, [make_data(3), poisoned, make_data(3)])
    assert len(calls) == 2 * N
    assert wires == [one[0], 0.0, one[0]]


def _per_device_concat(batches):
    """One batch whose shard on device i is the concatenation of the batches' shards i."""
    return {
        k: np.concatenate([b[k].reshape(N, -1, *b[k].shape[1:]) for b in batches], axis=1).reshape(
            -1, *batches[0][k].shape[1:]
        )
        for k in batches[0]
    }


@pytest.mark.parametrize("masked", [False, True], ids=["compressed", "masked"])
def test_accumulate_then_compress_exchanges_once_per_k_mini_steps(mesh, masked):
    """Issue 34 item 1: accumulate locally, compress and exchange once per k mini-steps.

    Bytes: the exchange only on the k-th mini-step (the step's own dense all-reduce of
    b, outside the compressor, every mini-step). Result: the update of k mini-batches
    is the compressor's on their mean gradient, i.e. one plain step on the per-device
    concatenation of the k mini-batches (the loss is a mean over equal halves), and
    optax.MultiSteps' (the same updates, k times the exchanges)."""
    comp = jaxcomp.top_k(0.25, axis_name="data")
    tx = optax.chain(optax.masked(comp, MASK) if masked else comp, optax.sgd(LR))
    k = 2
    batches = [make_data(10 + i) for i in range(2 * k)]
    one, _, _ = _wires(mesh, tx, batches[:1])
    dense_b = 2 * (N - 1) / N * 4 if masked else 0.0
    exchange = one[0] - dense_b
    calls = []
    acc = jaxcomp.accumulate_then_compress(optax.chain(run_counter(calls), tx), every_k=k)
    wires, p_acc, s_acc = _wires(mesh, acc, batches)
    assert len(calls) == 2 * N  # the inner update ran on the 2 last mini-steps only
    assert wires == [dense_b, dense_b + exchange] * 2
    assert int(np.asarray(s_acc.mini_step)[0]) == 0
    # The reference: one plain step per pair, on the pair's per-device concatenation.
    pairs = [_per_device_concat(batches[i : i + k]) for i in range(0, 2 * k, k)]
    _, p_ref, _ = _wires(mesh, tx, pairs)
    _, p_multi, _ = _wires(mesh, optax.MultiSteps(tx, every_k_schedule=k), batches)
    for name in p_ref:
        ref = device_copies(p_ref[name])[0]
        np.testing.assert_allclose(device_copies(p_acc[name])[0], ref, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(device_copies(p_multi[name])[0], ref, rtol=1e-5, atol=1e-6)
        assert not np.array_equal(ref, init_params()[name])
    assert_replicated(p_acc)


def test_accumulate_then_compress_rejects_bad_every_k():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="every_k"):
            jaxcomp.accumulate_then_compress(optax.sgd(LR), bad)


# --- item 2: psum-ed gradients into a compressor -------------------------------------


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: jaxcomp.ldte_bs(0.25, axis_name="data"),
        lambda: jaxcomp.qsgd(levels=4, axis_name="data", min_dense_size=0),
        lambda: dist.dense_exchange("data"),
    ],
    ids=["ldte_bs", "qsgd", "dense_exchange"],
)
def test_psummed_gradient_is_rejected_inside_checked_shard_map(mesh, make_tx):
    tx = make_tx()
    batch = dist.shard_batch(make_data(), mesh)
    params = dist.replicate(init_params(), mesh)

    def step(grad_fn):
        def body(params, batch):
            grads = grad_fn(params, batch)
            updates, _ = tx.update(grads, tx.init(params), params)
            return updates

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P()))

    with pytest.raises(ValueError, match="per_device_grad"):
        step(jax.grad(loss_fn))(params, batch)
    # The documented fix: per-device gradients; the update is the mean gradient's.
    updates = step(dist.per_device_grad(loss_fn, "data"))(params, batch)
    assert np.all(np.isfinite(np.asarray(updates["w"])))


def test_unchecked_shard_map_cannot_be_detected(mesh):
    """check_vma=False: nothing is typed; documented as undetectable, no error."""
    tx = jaxcomp.top_k(1.0, axis_name="data")
    batch = dist.shard_batch(make_data(), mesh)
    params = dist.replicate(init_params(), mesh)

    def body(params, batch):
        return tx.update(jax.grad(loss_fn)(params, batch), tx.init(params), params)[0]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=False)
    jax.jit(fn)(params, batch)


# --- item 6: NaN on one device, skipped everywhere ------------------------------------


def test_apply_if_finite_skips_on_every_device_together(mesh):
    inner = optax.chain(jaxcomp.ldte_bs(0.25, axis_name="data"), optax.sgd(LR, momentum=0.9))
    tx = dist.apply_if_finite(inner, max_consecutive_errors=2, axis_name="data")
    clean = make_data(4)
    poisoned = {k: v.copy() for k, v in clean.items()}
    poisoned["x"][3 * (BATCH // N), 0] = np.nan  # one row of device 3 only
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, donate=False)
    p1, s1, _ = step(params, state, dist.shard_batch(poisoned, mesh))
    jax.block_until_ready(p1)
    # Skipped on all devices: parameters and every device's residual unchanged.
    for k in p1:
        for c in device_copies(p1[k]):
            np.testing.assert_array_equal(c, init_params()[k])
    np.testing.assert_array_equal(np.asarray(s1.notfinite_count), np.ones(N))
    for r in jax.tree.leaves(optax.tree.get(s1, "residual")):
        assert np.all(np.asarray(r) == 0)
    # The next clean step is the same as if the poisoned one never happened.
    p2, _, _ = step(p1, s1, dist.shard_batch(clean, mesh))
    ref, _, _ = step(params, state, dist.shard_batch(clean, mesh))
    for k in p2:
        np.testing.assert_array_equal(device_copies(p2[k])[0], device_copies(ref[k])[0])
    assert_replicated(p2)


def test_apply_if_finite_without_axis_name_around_an_exchange_is_rejected(mesh):
    """Each device would decide on its own gradients, and a one-device NaN would
    hang the exchange (XLA:CPU aborts the process): rejected when the step is
    traced. Around a transformation that exchanges nothing (the step averages the
    gradients first) every device decides alike, and it trains."""
    params = dist.replicate(init_params(), mesh)
    batch = dist.shard_batch(make_data(2), mesh)
    exchanging = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    tx = jaxcomp.apply_if_finite(exchanging, 3)
    step = dist.make_train_step(loss_fn, tx, mesh)
    with pytest.raises(ValueError, match="apply_if_finite without axis_name .* axis_name='data'"):
        step(params, dist.init_opt_state(tx, params, mesh), batch)
    plain = jaxcomp.apply_if_finite(optax.sgd(LR), 3)
    new_params, _, _ = run_mesh(mesh, plain, make_data(2), steps=1)
    assert_close_to(new_params, run_single(optax.sgd(LR), make_data(2), steps=1))


def test_multisteps_skip_not_finite_skips_on_every_device_together(mesh):
    # optax.skip_not_finite would send device 3 alone down MultiSteps' skip branch
    # (the others wait in the exchange): the count is summed over the devices first.
    inner = optax.chain(jaxcomp.ldte_bs(0.25, axis_name="data"), optax.sgd(LR))
    skip = dist.skip_not_finite("data")
    tx = optax.MultiSteps(inner, every_k_schedule=2, should_skip_update_fn=skip)
    clean, clean2 = make_data(4), make_data(5)
    poisoned = {k: v.copy() for k, v in clean.items()}
    poisoned["x"][3 * (BATCH // N), 0] = np.nan  # one row of device 3 only
    params = dist.replicate(init_params(), mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, donate=False)

    def run(batches):
        p, s = params, dist.init_opt_state(tx, params, mesh)
        for b in batches:
            p, s, _ = step(p, s, dist.shard_batch(b, mesh))
        return p, s

    p, s = run([clean, poisoned])
    count = np.asarray(s.skip_state["num_not_finite"])  # device 3's NaN gradient elements
    assert count[0] > 0 and np.all(count == count[0])
    np.testing.assert_array_equal(np.asarray(s.mini_step), np.ones(N))  # skipped everywhere
    p, s = run([clean, poisoned, clean2])  # the second mini-step of the pair
    ref, _ = run([clean, clean2])
    for k in p:
        np.testing.assert_array_equal(device_copies(p[k])[0], device_copies(ref[k])[0])
        assert not np.array_equal(device_copies(p[k])[0], init_params()[k])
    assert_replicated(p)


def test_apply_if_finite_gives_up_after_max_errors_like_optax():
    inner = optax.sgd(1.0)
    ours = dist.apply_if_finite(inner, max_consecutive_errors=1)
    theirs = optax.apply_if_finite(inner, max_consecutive_errors=1)
    params = jnp.zeros(2)
    s_ours, s_theirs = ours.init(params), theirs.init(params)
    for g in [jnp.array([1.0, jnp.nan]), jnp.array([jnp.inf, 1.0]), jnp.array([1.0, 2.0])]:
        u1, s_ours = ours.update(g, s_ours, params)
        u2, s_theirs = theirs.update(g, s_theirs, params)
        np.testing.assert_array_equal(np.asarray(u1), np.asarray(u2))
        assert int(s_ours.total_notfinite) == int(s_theirs.total_notfinite)
    with pytest.raises(ValueError, match="max_consecutive_errors"):
        dist.apply_if_finite(inner, max_consecutive_errors=-1)


# --- item 16: donation, dropout keys, mutable collections, summed bytes ---------------


def test_params_and_state_donated_by_default(mesh):
    tx = optax.chain(jaxcomp.top_k(0.25, axis_name="data"), optax.sgd(LR))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    new_params, new_state, _ = step(params, state, dist.shard_batch(make_data(), mesh))
    jax.block_until_ready(new_params)
    # The arrays with an output of the same shape and dtype are reused in place.
    assert all(x.is_deleted() for x in jax.tree.leaves(params))
    assert all(x.is_deleted() for x in jax.tree.leaves(optax.tree.get(state, "residual")))
    assert not any(x.is_deleted() for x in jax.tree.leaves((new_params, new_state)))


def test_rng_reaches_loss_fn_folded_per_device(mesh):
    def noisy_loss(params, batch, rng):
        # The gradient w.r.t. b is this device's uniform draw.
        return loss_fn(params, batch) * 0 + params["b"] * jax.random.uniform(rng)

    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(1.0))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(noisy_loss, tx, mesh)
    key = jax.random.key(7)
    new_params, _, _ = step(params, state, dist.shard_batch(make_data(), mesh), rng=key)
    draws = [float(jax.random.uniform(jax.random.fold_in(key, d))) for d in range(N)]
    np.testing.assert_allclose(device_copies(new_params["b"])[0], -np.mean(draws), rtol=1e-6)
    assert len(set(draws)) == N


class BNModel(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
        return nn.Dense(1)(x)[:, 0]


def test_batch_norm_statistics_averaged_over_devices(mesh):
    model = BNModel()
    variables = model.init(jax.random.key(0), jnp.zeros((2, FEATURES)), train=False)
    params, batch_stats = variables["params"], variables["batch_stats"]

    def bn_loss(params, batch, model_state):
        pred, updates = model.apply(
            {"params": params, "batch_stats": model_state},
            batch["x"],
            train=True,
            mutable=["batch_stats"],
        )
        return jnp.mean((pred - batch["y"]) ** 2), updates["batch_stats"]

    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    params = dist.replicate(params, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(bn_loss, tx, mesh, mutable=True)
    data = make_data(5)
    x = data["x"].astype(np.float64)
    new_params, _, new_stats, _ = step(
        params, state, dist.shard_batch(data, mesh), model_state=dist.replicate(batch_stats, mesh)
    )
    shards = x.reshape(N, BATCH // N, FEATURES)
    want_mean = 0.1 * shards.mean(axis=1).mean(axis=0)  # momentum 0.9 from mean 0
    want_var = 0.9 + 0.1 * shards.var(axis=1).mean(axis=0)  # from var 1
    stats = jax.tree.map(device_copies, new_stats)
    for d in range(N):
        np.testing.assert_allclose(stats["BatchNorm_0"]["mean"][d], want_mean, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(stats["BatchNorm_0"]["var"][d], want_var, rtol=1e-4)
    assert_replicated(new_params)


def test_wire_bytes_summed_over_every_compressor_in_the_chain(mesh):
    tx = optax.chain(
        optax.multi_transform(
            {
                "sparse": jaxcomp.top_k(0.25, axis_name="data"),
                "quant": jaxcomp.qsgd(levels=4, axis_name="data", min_dense_size=0),
            },
            {"w": "sparse", "b": "quant"},
        ),
        optax.sgd(LR),
    )
    _, state, metrics = run_mesh(mesh, tx, make_data(6), steps=1)
    fields = optax.tree.get_all_with_path(state, "wire_bytes")
    assert len(fields) == 2
    total = sum(float(np.asarray(v).mean()) for _, v in fields)
    assert all(float(np.asarray(v).mean()) > 0 for _, v in fields)
    np.testing.assert_allclose(float(metrics["wire_bytes"]), total, rtol=1e-6)


def test_unexchanged_probe_sees_update_args(mesh):
    """Backup workers' include flags reach the probe with the right per-device shape."""
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    include = jax.device_put(np.arange(N) != 2, NamedSharding(mesh, P("data")))
    batch = dist.shard_batch(make_data(), mesh)
    new_params, _, _ = step(params, state, batch, {"include": include})
    assert_replicated(new_params)


def test_backup_workers_leave_the_densely_averaged_leaves_too(mesh):
    """With include=, the leaves the step averages itself (here b, outside the
    compressor) are the mean over the included devices, as the compressed ones:
    an excluded device's gradient must reach no parameter."""
    tx = optax.chain(optax.masked(jaxcomp.top_k(1.0, axis_name="data"), MASK), optax.sgd(1.0))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    data = make_data(3)
    data["y"][2 * (BATCH // N) : 3 * (BATCH // N)] += 100.0  # device 2's rows, excluded
    included = np.arange(N) != 2
    flag = jax.device_put(included, NamedSharding(mesh, P("data")))
    new_params, _, _ = step(params, state, dist.shard_batch(data, mesh), {"include": flag})
    rows = np.split(np.arange(BATCH), N)
    grads = [jax.grad(loss_fn)(init_params(), {k: v[r] for k, v in data.items()}) for r in rows]
    for leaf in ("w", "b"):
        want = -np.mean([np.asarray(grads[d][leaf]) for d in range(N) if included[d]], axis=0)
        np.testing.assert_allclose(device_copies(new_params[leaf])[0], want, rtol=1e-5)


def test_state_stacked_for_another_device_count_is_rejected(mesh):
    """A state for 8 devices on a 4-device mesh would run, each device reading one
    row of its 2-row block: the other rows' residuals silently dropped."""
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(LR))
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    small = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    step = dist.make_train_step(loss_fn, tx, small)
    batch = dist.shard_batch(make_data(), small)
    with pytest.raises(ValueError, match="stacked for the mesh's 4 devices.*resize_opt_state"):
        step(dist.replicate(init_params(), small), state, batch)
