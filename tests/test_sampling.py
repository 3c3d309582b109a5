"""Tests of jaxcomp.sampling and --sampling in the training runs (issue 13).

The by-sample plans are checked against what each mode claims (a permutation
per epoch identical to the original loader's order; each device confined to
its fixed shard; uniform i.i.d. draws), the feature-parallel first layer
against an unsharded single-device model, and the runs against single-device
SGD on the batches the plan names.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
import jaxcomp.sampling as sampling
from experiments import data as data_lib
from experiments import models, steps, train
from experiments import workdir as workdir_lib

# --- by-sample plans --------------------------------------------------------------


def _old_order(n, batch, seed, epoch):
    """experiments/data.py's loader before sampling modes: the order to keep bit for bit."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i * batch : (i + 1) * batch] for i in range(n // batch)]


@pytest.mark.parametrize("n, batch, seed, epoch", [(100, 8, 0, 0), (1437, 64, 3, 7)])
def test_global_shuffle_is_the_old_order(n, batch, seed, epoch):
    old = _old_order(n, batch, seed, epoch)
    for devices in (1, 2, 4, 8):
        plan = sampling.global_shuffle(n, batch, devices, seed=seed, epoch=epoch)
        assert plan.shape == (n // batch, devices, batch // devices)
        # Device d's rows of the global batch, the layout shard_batch splits.
        for s, want in enumerate(old):
            for d in range(devices):
                b = batch // devices
                np.testing.assert_array_equal(plan[s, d], want[d * b : (d + 1) * b])
    # The loader yields exactly the old batches (x == index here).
    x = np.arange(n)
    got = [yb for _, yb in data_lib.epoch_batches(x, x, batch, seed, epoch)]
    assert len(got) == len(old)
    for a, b in zip(got, old, strict=True):
        np.testing.assert_array_equal(a, b)


def test_global_shuffle_is_a_permutation_per_epoch():
    orders = []
    for epoch in range(3):
        plan = sampling.global_shuffle(96, 12, 4, seed=5, epoch=epoch)
        np.testing.assert_array_equal(np.sort(plan.ravel()), np.arange(96))
        orders.append(plan.ravel())
    assert not np.array_equal(orders[0], orders[1])
    assert not np.array_equal(orders[1], orders[2])


def test_local_shards_partition_the_set_and_stay_fixed():
    n, devices = 101, 4
    shards = sampling.local_shards(n, devices, seed=2)
    assert sorted(len(s) for s in shards) == [25, 25, 25, 26]
    np.testing.assert_array_equal(np.sort(np.concatenate(shards)), np.arange(n))  # disjoint, cover
    again = sampling.local_shards(n, devices, seed=2)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))
    other = sampling.local_shards(n, devices, seed=3)
    assert not all(np.array_equal(a, b) for a, b in zip(shards, other, strict=True))
    # A random partition, not contiguous ranges.
    assert any(np.any(np.diff(s) > 1) for s in shards)


@pytest.mark.parametrize("n", [96, 101])
def test_local_shuffle_keeps_each_device_in_its_shard(n):
    devices, batch, seed = 4, 8, 2
    b = batch // devices
    shards = sampling.local_shards(n, devices, seed=seed)
    orders = []
    for epoch in range(3):
        plan = sampling.local_shuffle(n, batch, devices, seed=seed, epoch=epoch)
        assert plan.shape == (n // batch, devices, b)
        for d in range(devices):
            mine = plan[:, d].ravel()  # device d's draws over the epoch, in order
            assert len(np.unique(mine)) == len(mine)  # no repeat within an epoch
            assert np.isin(mine, shards[d]).all()  # never another device's example
            if n % batch == 0:  # 24 per shard, 12 steps of 2: the whole shard each epoch
                np.testing.assert_array_equal(np.sort(mine), shards[d])
            else:
                assert len(mine) == (n // batch) * b
        orders.append(plan[:, 0].ravel())
    assert not np.array_equal(orders[0], orders[1])  # reshuffled every epoch


def test_with_replacement_draws_uniformly_and_independently():
    n, batch, devices, seed = 50, 10, 2, 0
    plans = np.stack(
        [sampling.with_replacement(n, batch, devices, seed=seed, epoch=e) for e in range(200)]
    )
    assert plans.shape == (200, n // batch, devices, batch // devices)
    assert plans.min() >= 0 and plans.max() < n
    # Devices draw their own streams.
    assert not np.array_equal(plans[:, :, 0], plans[:, :, 1])
    # Pearson chi-square against uniform, per device and overall (10,000 draws,
    # 49 degrees of freedom: mean 49, sd 9.9); the seed is fixed, the bound loose.
    for draws in (plans[:, :, 0].ravel(), plans[:, :, 1].ravel(), plans.ravel()):
        counts = np.bincount(draws, minlength=n)
        expected = len(draws) / n
        chi2 = float(np.sum((counts - expected) ** 2 / expected))
        assert chi2 < 49 + 6 * 9.9, chi2
    # Device 0's and device 1's draws at the same position are not correlated.
    a, b = plans[:, :, 0].ravel(), plans[:, :, 1].ravel()
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.05
    # With replacement: one epoch of n draws from n examples covers about 1 - 1/e.
    one = sampling.with_replacement(1000, 100, 4, seed=1, epoch=0).ravel()
    assert 0.58 < len(np.unique(one)) / 1000 < 0.68
    # Deterministic per (seed, epoch), new draws each epoch.
    np.testing.assert_array_equal(plans[3], sampling.with_replacement(n, 10, 2, seed=0, epoch=3))
    assert not np.array_equal(plans[0], plans[1])


def test_epoch_batches_put_each_devices_draws_in_its_rows():
    x = np.arange(64)[:, None] * 10
    y = np.arange(64)
    for mode in sampling.SAMPLE_MODES:
        plan = sampling.epoch_indices(mode, 64, 8, 4, seed=1, epoch=2)
        batches = list(data_lib.epoch_batches(x, y, 8, 1, 2, sampling=mode, num_devices=4))
        assert len(batches) == len(plan) == 8
        for s, (xb, yb) in enumerate(batches):
            for d in range(4):
                np.testing.assert_array_equal(yb[2 * d : 2 * d + 2], plan[s, d])
                np.testing.assert_array_equal(xb[2 * d : 2 * d + 2, 0], 10 * plan[s, d])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: sampling.global_shuffle(10, 3, 2, seed=0, epoch=0), "divisible by num_devices"),
        (lambda: sampling.with_replacement(10, 12, 2, seed=0, epoch=0), "batch_size"),
        (lambda: sampling.local_shuffle(10, 4, 0, seed=0, epoch=0), "num_devices"),
        (lambda: sampling.local_shuffle(0, 4, 2, seed=0, epoch=0), "num_examples"),
        (lambda: sampling.global_shuffle(10, 4, 2, seed=-1, epoch=0), "seed"),
        (lambda: sampling.global_shuffle(10, 4, 2, seed=0, epoch=-1), "epoch"),
        (lambda: sampling.global_shuffle(10, 4.0, 2, seed=0, epoch=0), "batch_size"),
        (lambda: sampling.local_shards(3, 4, seed=0), r"num_devices must be in \[1, num_ex"),
        (lambda: sampling.epoch_indices("feature", 10, 4, 2, seed=0, epoch=0), "mode"),
        (lambda: sampling.epoch_indices(["global"], 10, 4, 2, seed=0, epoch=0), "mode must be"),
        (lambda: sampling.feature_slices(3, 4), r"num_devices must be in \[1, num_features=3"),
        (lambda: sampling.feature_slices(0, 1), "num_features"),
        (lambda: sampling.feature_slices(4, True), "num_devices"),
        (lambda: sampling.split_features(np.ones((2, 3)), 2, axis=2), "axis"),
        (lambda: sampling.join_features(np.ones((2, 5, 3)), 4, axis=0), "slices of 5"),
    ],
)
def test_bad_arguments_raise(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- by feature ---------------------------------------------------------------------


def test_feature_slices_cover_every_feature_once():
    for f in range(1, 40):
        for devices in range(1, f + 1):
            slices = sampling.feature_slices(f, devices)
            assert len(slices) == devices
            covered = np.concatenate([np.arange(f)[s] for s in slices])
            np.testing.assert_array_equal(covered, np.arange(f))  # contiguous, in order, once
            sizes = [s.stop - s.start for s in slices]
            assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1


def test_split_and_join_features_round_trip_with_zero_padding():
    a = np.random.default_rng(0).normal(size=(3, 10, 2))
    stacked = sampling.split_features(a, 4, axis=1)
    assert stacked.shape == (4, 3, 3, 2)
    for d, s in enumerate(sampling.feature_slices(10, 4)):
        width = s.stop - s.start
        np.testing.assert_array_equal(stacked[d][:, :width], a[:, s])
        assert not stacked[d][:, width:].any()
    np.testing.assert_array_equal(sampling.join_features(stacked, 10, axis=1), a)


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@pytest.mark.parametrize("check_vma", [True, False])
def test_feature_parallel_dense_matches_the_unsharded_layer(check_vma):
    # 10 features over 4 devices: slices of 3, 3, 2, 2, padded to 3.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 10)).astype(np.float32)
    w = rng.normal(size=(10, 5)).astype(np.float32)
    v = rng.normal(size=(5,)).astype(np.float32)
    mesh = _mesh(4)
    sharded = NamedSharding(mesh, P("data"))
    xs = jax.device_put(sampling.split_features(x, 4, axis=1), sharded)
    ws = jax.device_put(sampling.split_features(w, 4, axis=0), sharded)

    def loss(w_local, v, x_local):
        h = sampling.feature_parallel_dense(x_local[0], w_local[0], "data")
        return jnp.sum(jnp.tanh(h) * v)

    f = jax.jit(
        jax.shard_map(
            jax.value_and_grad(loss, argnums=(0, 1)),
            mesh=mesh,
            in_specs=(P("data"), P(), P("data")),
            out_specs=(P(), (P("data"), P())),
            check_vma=check_vma,
        )
    )
    value, (gw, gv) = f(ws, v, xs)
    ref, (ref_w, ref_v) = jax.value_and_grad(
        lambda w, v: jnp.sum(jnp.tanh(x @ w) * v), argnums=(0, 1)
    )(w, v)
    np.testing.assert_allclose(value, ref, rtol=1e-5)
    np.testing.assert_allclose(sampling.join_features(gw, 10, axis=0), ref_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gv, ref_v, rtol=1e-5, atol=1e-6)
    assert not np.asarray(gw)[2:, 2:].any()  # the padded rows get no gradient


# The training program's feature-parallel mlp against the unsharded flax model.

_HIDDEN = (16, 8)


def _mlp_problem(batch=12, seed=0):
    model = models.MLP(num_classes=10, hidden=_HIDDEN)
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch, 8, 8, 1)).astype(np.float32)  # 64 features
    y = rng.integers(0, 10, size=batch).astype(np.int32)
    params = jax.device_get(jax.jit(model.init)(jax.random.key(seed), x[:1])["params"])
    return model, params, x, y


def _full_loss(model):
    def loss(p, x, y):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss


def _full_value_and_grad(model):
    """The unsharded model's loss and gradients on one device (the reference)."""
    return jax.jit(jax.value_and_grad(_full_loss(model)))


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for u, v in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol)


def test_feature_mode_loss_and_gradients_equal_the_unsharded_models():
    # 64 features over 3 devices: slices of 22, 21, 21 (padded to 22).
    n = 3
    model, params, x, y = _mlp_problem()
    mesh = _mesh(n)
    layers = steps.feature_layers(params)
    fparams = steps.feature_params(params, mesh)
    xs, ys = steps.feature_batch(x, y, mesh)

    def per_device(p, x, y):
        loss, grads = steps.feature_value_and_grad(layers)(p, x, y)
        return loss[None], jax.tree.map(lambda g: g[None], grads)

    f = jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(steps.FEATURE_PARAM_SPECS, P("data"), P()),
            out_specs=P("data"),
            check_vma=False,  # as in the train step
        )
    )
    losses, grads = jax.device_get(f(fparams, xs, ys))
    ref_loss, ref_grads = _full_value_and_grad(model)(params, x, y)
    for d in range(n):  # every device computes the same loss and rest gradients
        np.testing.assert_allclose(losses[d], ref_loss, rtol=1e-6)
        ref_rest = steps.feature_rest(ref_grads)
        _assert_trees_close(jax.tree.map(lambda g, d=d: g[d], grads["rest"]), ref_rest)
    kernel_grad = sampling.join_features(grads["slice"], 64, axis=0)
    np.testing.assert_allclose(kernel_grad, ref_grads["Dense_0"]["kernel"], rtol=1e-5, atol=1e-6)
    # The gathered layout is the model's parameters again.
    _assert_trees_close(steps.feature_host_params(fparams, 64), params, rtol=0, atol=0)


@pytest.mark.parametrize("compressor", ["dense", "top_k"])
def test_feature_train_steps_equal_single_device_training(compressor):
    # Two steps: the kernel slices get plain SGD with momentum (never averaged
    # or compressed); the other parameters the compressor's update, which for
    # gradients equal on every device is one device's compression of them.
    n, lr, momentum = 3, 0.1, 0.9
    model, params, x, y = _mlp_problem(batch=24, seed=1)
    mesh = _mesh(n)
    # One global selection: the quickest sparsifier to compile.
    overrides = {
        "compressor_kwargs": {"ratio": 0.1, "granularity": "global"},
        "momentum_correction": False,
    }
    overrides = overrides if compressor == "top_k" else {}
    config = train.TrainConfig(
        compressor=compressor, lr=lr, momentum=momentum, sampling="feature", **overrides
    )
    tx, _ = train.build_optimizer(config, 2, 2)
    slice_tx = steps.feature_slice_optimizer(config, 2, 2)
    fparams = steps.feature_params(params, mesh)
    opt_state = steps.init_feature_opt_state(slice_tx, tx, fparams, mesh)
    num_rest = sum(np.size(v) for v in jax.tree.leaves(steps.feature_rest(params)))
    step = steps.make_feature_train_step(
        slice_tx, tx, mesh, steps.feature_layers(params), num_rest, activation_bytes=7.0
    )
    # Single device: the whole model on the whole batch.
    ref_rest_tx = optax.chain(
        jaxcomp.top_k(0.1, granularity="global") if compressor == "top_k" else optax.identity(),
        optax.sgd(lr, momentum=momentum),
    )
    ref_kernel_tx = optax.sgd(lr, momentum=momentum)
    ref = params
    ref_states = (
        ref_kernel_tx.init(ref["Dense_0"]["kernel"]),
        ref_rest_tx.init(steps.feature_rest(params)),
    )
    value_and_grad = _full_value_and_grad(model)
    for s in range(2):
        xb, yb = x[12 * s : 12 * (s + 1)], y[12 * s : 12 * (s + 1)]
        fparams, opt_state, metrics = step(fparams, opt_state, *steps.feature_batch(xb, yb, mesh))
        jax.block_until_ready(metrics)
        loss, g = value_and_grad(ref, xb, yb)
        np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-5)
        ku, kstate = ref_kernel_tx.update(g["Dense_0"]["kernel"], ref_states[0])
        rest_g = steps.feature_rest(g)
        ru, rstate = ref_rest_tx.update(rest_g, ref_states[1])
        ref_states = (kstate, rstate)
        new_rest = optax.apply_updates(steps.feature_rest(ref), ru)
        ref = {**new_rest, "Dense_0": {**new_rest["Dense_0"], "kernel": ref["Dense_0"]["kernel"]}}
        ref["Dense_0"]["kernel"] = optax.apply_updates(ref["Dense_0"]["kernel"], ku)
        _assert_trees_close(steps.feature_host_params(fparams, 64), ref, rtol=1e-4, atol=1e-6)
    if compressor == "dense":
        # The activation bytes plus a ring all-reduce of the other parameters' gradients.
        want = 7.0 + 2 * (n - 1) / n * 4 * num_rest
        np.testing.assert_allclose(metrics["wire_bytes"], want, rtol=1e-6)
    else:
        assert 0 < float(metrics["density"]) < 0.2  # of the rest, at ratio 0.1


# --- the training program ----------------------------------------------------------

TINY = train.TrainConfig(
    compressor="dense",
    num_devices=4,
    dataset="synthetic",
    model="mlp",
    epochs=1,
    batch_size=16,
    max_steps_per_epoch=2,
    progress=False,
    checkpoint=False,
    time_split=False,
    lr=0.05,
)


# Global shuffling is every other run's (tests/test_train.py) and its plan the old order.
@pytest.mark.parametrize(
    "mode, overrides",
    [
        ("replacement", {}),
        ("local", {}),
        # CSSGD cuts its blocks from the global batch: batch_size i.i.d. draws.
        ("replacement", {"exchange": "coded", "redundancy": 2, "batch_size": 24}),
    ],
    ids=["replacement", "local", "replacement-coded"],
)
def test_run_trains_on_the_modes_batches(tmp_path, mode, overrides):
    config = dataclasses.replace(TINY, sampling=mode, **overrides)
    result = train.train_and_evaluate(config, str(tmp_path))
    (record,) = result["records"]
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines == result["records"] and np.isfinite(record["train_loss"])
    stored = json.loads((tmp_path / train.CONFIG_FILE).read_text())["config"]
    assert stored["sampling"] == mode
    # Dense data-parallel SGD is single-device SGD on the union of the devices'
    # draws: replay the plan's two global batches on one device.
    ds = data_lib.load_dataset("synthetic")
    model = models.make_model("mlp", ds.num_classes)
    params = model.init(jax.random.key(config.seed), ds.train_x[:1])["params"]
    tx = optax.sgd(config.lr, momentum=config.momentum)
    state = tx.init(params)
    devices = 1 if config.exchange else 4  # CSSGD's global batch is one stream of draws
    plan = sampling.epoch_indices(
        mode, len(ds.train_y), config.batch_size, devices, seed=config.seed, epoch=0
    )
    value_and_grad = _full_value_and_grad(model)
    for s in range(2):
        idx = plan[s].ravel()
        _, g = value_and_grad(params, ds.train_x[idx], ds.train_y[idx])
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    _assert_trees_close(result["params"], params, rtol=1e-4, atol=1e-6)


def test_feature_run_learns_resumes_exactly_and_rejects_another_mode(tmp_path):
    # 3 devices (64 features: padded slices) and a batch 3 does not divide.
    config = dataclasses.replace(
        TINY,
        dataset="digits",
        sampling="feature",
        num_devices=3,
        batch_size=20,
        epochs=2,
        max_steps_per_epoch=15,
        lr=0.1,
        checkpoint=True,
        time_split=True,
    )
    straight = train.train_and_evaluate(config, str(tmp_path / "a"))
    final = straight["final"]
    assert final["test_accuracy"] > 0.5  # chance is 0.1
    assert straight["records"][1]["train_loss"] < straight["records"][0]["train_loss"]
    act = 2 * (3 - 1) / 3 * 4 * 20 * 256  # all-reduce of the (20, 256) first-layer product
    assert final["activation_bytes_per_step_per_device"] == pytest.approx(act)
    rest = straight["num_params"] - 64 * 256
    assert final["bytes_per_step_per_device"] == pytest.approx(act + 2 * 2 / 3 * 4 * rest)
    assert final["message_bytes_per_step_per_device"] == 4 * rest
    assert final["time_step"] > 0 and final["time_forward_backward"] > 0
    assert (tmp_path / "a" / "time_split.png").stat().st_size > 0
    lines = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert lines == straight["records"]
    # The returned parameters are the mlp's: evaluating them gives the recorded accuracy.
    model = models.make_model("mlp", 10)
    ds = data_lib.load_dataset("digits")
    logits = model.apply({"params": straight["params"]}, ds.test_x)
    correct = int(np.sum(np.argmax(np.asarray(logits), -1) == ds.test_y))
    assert correct / len(ds.test_y) == final["test_accuracy"]

    b = str(tmp_path / "b")
    config = dataclasses.replace(config, time_split=False)  # resumable: not timed again
    train.train_and_evaluate(config, b, stop_after_epoch=1)
    with pytest.raises(train.WorkdirError, match="sampling='feature' there, 'global' now"):
        train.train_and_evaluate(dataclasses.replace(config, sampling="global", batch_size=21), b)
    resumed = train.train_and_evaluate(config, b)
    assert [r["epoch"] for r in resumed["records"]] == [1, 2]
    leaves = jax.tree.leaves(straight["params"]), jax.tree.leaves(resumed["params"])
    for u, v in zip(*leaves, strict=True):
        np.testing.assert_array_equal(u, v)


def test_config_json_without_sampling_resumes_as_global(tmp_path):
    config = dataclasses.replace(TINY, checkpoint=True)
    record = workdir_lib.config_record(config, 4)
    del record["config"]["sampling"]  # a config.json written before the field existed
    (tmp_path / train.CONFIG_FILE).write_text(json.dumps(record))
    (tmp_path / "metrics.jsonl").write_text('{"epoch": 1}\n')
    workdir_lib.check_workdir(config, str(tmp_path), 4, overwrite=False)  # global: the same run
    stored = json.loads((tmp_path / train.CONFIG_FILE).read_text())["config"]
    assert stored["sampling"] == "global"  # rewritten with the field
    (tmp_path / train.CONFIG_FILE).write_text(json.dumps(record))
    with pytest.raises(train.WorkdirError, match="sampling='global' there, 'local' now"):
        workdir_lib.check_workdir(
            dataclasses.replace(config, sampling="local"), str(tmp_path), 4, overwrite=False
        )


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"sampling": "shuffle"}, r"sampling \(--sampling\) must be one of"),
        ({"sampling": "feature", "model": "cnn"}, "needs model='mlp'"),
        (
            {"sampling": "feature", "compressor": "top_k", "merge": "greedy"},
            "merge.*not supported with sampling='feature'",
        ),
        ({"sampling": "feature", "fit_check_epochs": (1,)}, "fit_check_epochs"),
        (
            {
                "sampling": "feature",
                "coordinator_address": "h:1",
                "num_processes": 2,
                "process_id": 0,
            },
            "one process",
        ),
        (
            {"sampling": "local", "exchange": "coded", "redundancy": 2, "batch_size": 24},
            "does not go with exchange='coded'",
        ),
        (
            {"sampling": "feature", "exchange": "uncoded", "redundancy": 2, "batch_size": 24},
            "does not go with exchange='uncoded'",
        ),
        ({"sampling": "local", "batch_size": 18}, "divisible"),
    ],
)
def test_invalid_sampling_config_fails_before_training(tmp_path, overrides, message):
    config = dataclasses.replace(TINY, **overrides)
    with pytest.raises(ValueError, match=message):
        train.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_feature_mode_needs_a_feature_per_device(tmp_path, monkeypatch):
    small = data_lib.load_synthetic(num_train=64, num_test=8, shape=(2, 2, 1))
    monkeypatch.setattr(data_lib, "load_dataset", lambda *a, **k: small)
    config = dataclasses.replace(TINY, sampling="feature", num_devices=8)
    with pytest.raises(ValueError, match="4 input features; num_devices=8"):
        train.train_and_evaluate(config, str(tmp_path))
    assert not (tmp_path / "metrics.jsonl").exists()
    # With as many devices as features it is a valid run (checked, not trained here).
    train.validate_config(dataclasses.replace(config, num_devices=4), 8)


def test_main_sampling_flag_makes_the_config():
    from absl import flags  # noqa: PLC0415

    from experiments import cli, main  # noqa: PLC0415

    def parse(*argv):
        return main.config_from_flags(cli.parse(main.define_flags, ["main", *argv]))

    assert parse("--sampling=local").sampling == "local"
    assert parse().sampling == "global"
    with pytest.raises(flags.IllegalFlagValueError):
        parse("--sampling=bootstrap")
