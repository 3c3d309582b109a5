"""Pipeline (layer-wise) model parallelism with compressed data parallelism (issue 40).

On 8 simulated devices as 2 stages x 4 data replicas and 4 x 2. The
references are independent: single-device training on the whole batch (a
numpy forward/backward of tanh blocks, and a Flax ``nn.Sequential`` trained
with ``jax.grad`` on one device for the layer split), and a numpy top-k with
error feedback per stage and per data replica (each replica's gradient the
numpy backward on its slice of the batch), averaged over the replicas. The
bytes between stages are checked against their arithmetic.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp import distributed as dist
from tests.helpers import k_of, topk_set

WIDTH, BATCH, LR = 4, 16, 0.1


def block(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def blocks_params(n_stages, seed=0):
    rng = np.random.default_rng(seed)
    return [
        {
            "w": (0.8 * rng.standard_normal((WIDTH, WIDTH))).astype(np.float32),
            "b": (0.3 * rng.standard_normal(WIDTH)).astype(np.float32),
        }
        for _ in range(n_stages)
    ]


def data(seed=1, rows=BATCH, width_in=WIDTH, width_out=WIDTH):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, width_in)).astype(np.float32)
    t = rng.standard_normal((rows, width_out)).astype(np.float32)
    return x, t


def np_loss_and_grads(stage_params, x, t):
    """Numpy forward and backward of the tanh blocks with the mean squared error."""
    hs = [x.astype(np.float64)]
    for p in stage_params:
        hs.append(np.tanh(hs[-1] @ p["w"] + p["b"]))
    out = hs[-1]
    loss = np.mean((out - t) ** 2)
    dh = 2 * (out - t) / out.size
    grads = [None] * len(stage_params)
    for s in reversed(range(len(stage_params))):
        dz = dh * (1 - hs[s + 1] ** 2)
        grads[s] = {"w": hs[s].T @ dz, "b": dz.sum(0)}
        dh = dz @ stage_params[s]["w"].T
    return loss, grads


def run_pipeline(tx, mesh, stage_params, fns, batches, microbatches, schedule="gpipe"):
    stacked, stages = dist.stack_stages(stage_params, mesh)
    state = dist.init_pipeline_opt_state(tx, stacked, mesh)
    step = dist.make_pipeline_train_step(
        fns, stages, mse, tx, mesh, microbatches, schedule=schedule
    )
    metrics = []
    for batch in batches:
        stacked, state, m = step(stacked, state, batch)
        metrics.append(jax.device_get(m))
    return dist.unstack_stages(stacked, stages), state, metrics


def expected_stage_bytes(n_stages, microbatches, per_replica, width, schedule="gpipe"):
    # Each tick S - 1 activations forward and S - 1 cotangents backward, spread over S stages;
    # GPipe's ticks (each way) M + S - 1, lock-step 1F1B's M + 2 S - 2 (both ways each tick).
    ticks = microbatches + (n_stages - 1 if schedule == "gpipe" else 2 * n_stages - 2)
    itemsize = 4
    mb = per_replica // microbatches
    return 2 * ticks * (n_stages - 1) * mb * width * itemsize / n_stages


@pytest.mark.parametrize("shape", [(2, 4), (1, 8)], ids=["2x4", "1x8"])
def test_dense_equals_single_device_training(shape):
    """S stages x N replicas, 2 micro-batches each: plain SGD on the whole batch, three steps.

    With one stage the pipeline is data parallelism (nothing sent between stages).
    """
    n_stages, n_data = shape
    mesh = jax.make_mesh(shape, ("stage", "data"))
    params = blocks_params(2)
    traces = []

    def counted(p, x):
        traces.append(1)  # once per trace of the step: no retrace per step
        return block(p, x)

    fns = [counted, block] if n_stages == 2 else [lambda p, x: block(p[1], block(p[0], x))]
    stage_params = params if n_stages == 2 else [params]
    batches = [data(1), data(2), data(3)]
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    got, _, metrics = run_pipeline(tx, mesh, stage_params, fns, batches, microbatches=2)
    # Traced for the activations' shapes, then once in the step as the primal and once
    # in its custom VJP's forward (the bubble mask): three, whatever the number of steps.
    assert len(traces) == (3 if n_stages == 2 else 0)
    got = got if n_stages == 2 else got[0]
    ref = [{k: v.astype(np.float64) for k, v in p.items()} for p in params]
    for (x, t), m in zip(batches, metrics, strict=True):
        loss, grads = np_loss_and_grads(ref, x, t)
        np.testing.assert_allclose(m["loss"], loss, rtol=2e-6)
        ref = [{k: p[k] - LR * g[k] for k in p} for p, g in zip(ref, grads, strict=True)]
        assert m["stage_bytes"] == expected_stage_bytes(n_stages, 2, BATCH // n_data, WIDTH)
        # The ring all-reduce of a stage's gradients among its replicas.
        per_stage = 2 * (WIDTH * WIDTH + WIDTH) // n_stages
        assert m["wire_bytes"] == 2 * (n_data - 1) / n_data * per_stage * 4
    for p, r in zip(got, ref, strict=True):
        for k in p:
            np.testing.assert_allclose(p[k], r[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_flax_split_4x2_equals_single_device_training(schedule):
    """A Flax nn.Sequential split by layer index into 4 heterogeneous stages (ravelled form)."""
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    layers = [nn.Dense(5), nn.tanh, nn.Dense(3), nn.tanh, nn.Dense(6), nn.Dense(2)]
    model = nn.Sequential(layers)
    batches = [data(3, width_in=3, width_out=2), data(4, width_in=3, width_out=2)]
    params = model.init(jax.random.key(0), batches[0][0])["params"]
    fns, stage_params = dist.split_layers(layers, params, 4)
    assert [sorted(p) for p in stage_params] == [
        ["layers_0"],
        ["layers_2"],
        [],
        ["layers_4", "layers_5"],
    ]
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    got, _, metrics = run_pipeline(tx, mesh, stage_params, fns, batches, 4, schedule)
    ref = params
    for (x, t), m in zip(batches, metrics, strict=True):
        loss, grads = jax.value_and_grad(lambda p, x=x, t=t: mse(model.apply({"params": p}, x), t))(
            ref
        )
        np.testing.assert_allclose(m["loss"], loss, rtol=2e-6)
        ref = jax.tree.map(lambda p, g: p - LR * g, ref, grads)
        # The widest boundary: layer 0's 5 outputs (then 3, then 3).
        assert m["stage_bytes"] == expected_stage_bytes(4, 4, BATCH // 2, 5, schedule)
    merged = {k: v for p in got for k, v in p.items()}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), merged, ref)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_top_k_per_stage_error_feedback_matches_numpy(schedule):
    """jaxcomp.top_k on 2 stages x 4 replicas: per-stage, per-replica top-k with residuals."""
    n_stages, n_data, ratio = 2, 4, 0.3
    mesh = jax.make_mesh((n_stages, n_data), ("stage", "data"))
    params = blocks_params(n_stages, seed=5)
    batches = [data(6), data(7), data(8)]
    tx = optax.chain(jaxcomp.top_k(ratio, axis_name="data"), optax.sgd(LR))
    got, state, metrics = run_pipeline(tx, mesh, params, [block] * n_stages, batches, 4, schedule)
    ref = [{k: v.astype(np.float64) for k, v in p.items()} for p in params]
    residual = [[{k: np.zeros_like(v) for k, v in p.items()} for p in ref] for _ in range(n_data)]
    rows = BATCH // n_data
    for x, t in batches:
        sent = [[None] * n_stages for _ in range(n_data)]
        for d in range(n_data):
            _, grads = np_loss_and_grads(
                ref, x[d * rows : (d + 1) * rows], t[d * rows : (d + 1) * rows]
            )
            for s in range(n_stages):
                sent[d][s] = {}
                for k, g in grads[s].items():
                    acc = residual[d][s][k] + g
                    keep = topk_set(acc.ravel(), k_of(ratio, acc.size)).reshape(acc.shape)
                    sent[d][s][k] = np.where(keep, acc, 0.0)
                    residual[d][s][k] = acc - sent[d][s][k]
        for s in range(n_stages):
            for k in ref[s]:
                mean = sum(sent[d][s][k] for d in range(n_data)) / n_data
                ref[s][k] = ref[s][k] - LR * mean
    for p, r in zip(got, ref, strict=True):
        for k in p:
            np.testing.assert_allclose(p[k], r[k], rtol=1e-5, atol=1e-6)
    # The state's rows: (data replica, stage), each its own residual.
    res = jax.device_get(state[0].residual)
    for d in range(n_data):
        for s in range(n_stages):
            for k in ref[s]:
                np.testing.assert_allclose(res[k][d, s], residual[d][s][k], rtol=1e-4, atol=1e-6)
    assert all(m["wire_bytes"] > 0 for m in metrics)


def test_bfloat16_activations_between_stages():
    """A stage sending bfloat16: padded and sent in bfloat16 (2 bytes), the result unchanged."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    params = blocks_params(2, seed=3)
    fns = [
        lambda p, x: block(p, x).astype(jnp.bfloat16),
        lambda p, h: block(p, h.astype(jnp.float32)),
    ]
    x, t = data(4)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    got, _, (m,) = run_pipeline(tx, mesh, params, fns, [(x, t)], microbatches=2)
    assert m["stage_bytes"] == expected_stage_bytes(2, 2, BATCH // 4, WIDTH) / 2

    def whole(ps):  # one device, the same functions on the whole batch
        return mse(fns[1](ps[1], fns[0](ps[0], x)), t)

    loss, grads = jax.value_and_grad(whole)(params)
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
    for p, q, g in zip(got, params, grads, strict=True):
        for k in p:
            np.testing.assert_allclose(p[k], q[k] - LR * g[k], rtol=1e-5, atol=1e-6)


def test_multisteps_accumulates_before_the_exchange():
    """optax.MultiSteps around the exchange: every 2nd step applies the mean of 2 gradients."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    params = blocks_params(2, seed=4)
    batches = [data(5), data(6), data(7), data(8)]
    inner = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    got, _, metrics = run_pipeline(tx, mesh, params, [block, block], batches, microbatches=2)
    ref = [{k: v.astype(np.float64) for k, v in p.items()} for p in params]
    for pair in (batches[:2], batches[2:]):
        grads = [np_loss_and_grads(ref, x, t)[1] for x, t in pair]
        ref = [
            {k: p[k] - LR * (g0[k] + g1[k]) / 2 for k in p}
            for p, g0, g1 in zip(ref, *grads, strict=True)
        ]
    for p, r in zip(got, ref, strict=True):
        for k in p:
            np.testing.assert_allclose(p[k], r[k], rtol=1e-5, atol=1e-6)
    # The exchange ran on every mini-step (MultiSteps runs its inner update each time).
    assert all(m["wire_bytes"] > 0 for m in metrics)


def test_masked_compressor_and_dense_mean_of_the_rest_4x2():
    """top_k on the kernels only (optax.masked): the biases are averaged densely before tx."""
    n_stages, n_data, ratio = 4, 2, 0.4
    mesh = jax.make_mesh((n_stages, n_data), ("stage", "data"))
    params = blocks_params(n_stages, seed=9)
    batches = [data(10), data(11)]
    mask = {"w": True, "b": False}
    tx = optax.chain(optax.masked(jaxcomp.top_k(ratio, axis_name="data"), mask), optax.sgd(LR))
    got, _, _ = run_pipeline(tx, mesh, params, [block] * n_stages, batches, microbatches=4)
    ref = [{k: v.astype(np.float64) for k, v in p.items()} for p in params]
    residual = [[np.zeros((WIDTH, WIDTH)) for _ in range(n_stages)] for _ in range(n_data)]
    rows = BATCH // n_data
    for x, t in batches:
        grads = [
            np_loss_and_grads(ref, x[d * rows : (d + 1) * rows], t[d * rows : (d + 1) * rows])[1]
            for d in range(n_data)
        ]
        for s in range(n_stages):
            sent = []
            for d in range(n_data):
                acc = residual[d][s] + grads[d][s]["w"]
                keep = topk_set(acc.ravel(), k_of(ratio, acc.size)).reshape(acc.shape)
                sent.append(np.where(keep, acc, 0.0))
                residual[d][s] = acc - sent[-1]
            ref[s] = {
                "w": ref[s]["w"] - LR * sum(sent) / n_data,
                "b": ref[s]["b"] - LR * sum(g[s]["b"] for g in grads) / n_data,
            }
    for p, r in zip(got, ref, strict=True):
        for k in p:
            np.testing.assert_allclose(p[k], r[k], rtol=1e-5, atol=1e-6)


def test_homogeneous_stages_keep_their_matrices_for_powersgd():
    """Stages of the same blocks are stacked leaf by leaf: PowerSGD sees each 4x4 kernel."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    stage_params = [[p, p] for p in blocks_params(2)]  # two blocks per stage
    stacked, stages = dist.stack_stages(stage_params, mesh)
    assert not stages.flat and stacked[0]["w"].shape == (2, WIDTH, WIDTH)
    tx = jaxcomp.powersgd(rank=1, axis_name="data", min_dense_size=0, min_compression_rate=0)
    state = dist.init_pipeline_opt_state(tx, stacked, mesh)
    assert [q.shape for q in jax.tree.leaves(optax.tree.get(state, "q"))] == [(4, 2, WIDTH, 1)] * 2
    # Different layers per stage: one padded flat vector each.
    _, flat = dist.stack_stages([{"w": np.ones((2, 3))}, {"v": np.ones(4)}], mesh)
    assert flat.flat and flat.length == 6
    with pytest.raises(ValueError, match="opt_state .* stacked for the mesh's 4 devices"):
        step = dist.make_pipeline_train_step([block] * 2, stages, mse, tx, mesh, 2)
        step(stacked, jax.tree.map(lambda a: np.asarray(a)[:1], state), data())


def test_bubble_fraction_and_stage_bytes():
    assert dist.bubble_fraction(1, 5) == 0.0
    assert dist.bubble_fraction(4, 4) == 3 / 7
    assert dist.bubble_fraction(4, 4, "1f1b") == 6 / 10
    assert dist.stage_bytes(4, 4, 2, 5, 4, "1f1b") == expected_stage_bytes(4, 4, 8, 5, "1f1b")
    assert dist.stage_bytes(4, 4, 2, 5, 4) == expected_stage_bytes(4, 4, 8, 5)
    with pytest.raises(ValueError, match="num_stages"):
        dist.bubble_fraction(0, 4)


def test_bad_arguments():
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    params = blocks_params(2)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    with pytest.raises(ValueError, match="3 stages given.*'stage' has 2"):
        dist.stack_stages(blocks_params(3), mesh)
    with pytest.raises(ValueError, match="2-D mesh"):
        dist.stack_stages(params, jax.make_mesh((8,), ("data",)))
    with pytest.raises(ValueError, match="one parameter tree per stage"):
        dist.stack_stages(params[0], mesh)
    stacked, stages = dist.stack_stages(params, mesh)
    with pytest.raises(ValueError, match="stage_fns has 3 stages"):
        dist.make_pipeline_train_step([block] * 3, stages, mse, tx, mesh, 2)
    with pytest.raises(ValueError, match="schedule must be one of"):
        dist.make_pipeline_train_step([block] * 2, stages, mse, tx, mesh, 2, schedule="1F1B")
    with pytest.raises(ValueError, match="num_microbatches must be an integer"):
        dist.make_pipeline_train_step([block] * 2, stages, mse, tx, mesh, 0)
    with pytest.raises(ValueError, match="2-D mesh"):
        dist.make_pipeline_train_step(
            [block] * 2, stages, mse, tx, jax.make_mesh((2, 4), ("a", "b")), 2
        )
    step = dist.make_pipeline_train_step([block] * 2, stages, mse, tx, mesh, 3)
    state = None  # never reached: the batch is checked first
    with pytest.raises(ValueError, match=r"num_microbatches must divide .* 4 examples\), got 3"):
        step(stacked, state, data())
    with pytest.raises(ValueError, match="multiple of the 4 data replicas"):
        step(stacked, state, data(rows=6))
    with pytest.raises(ValueError, match="boundaries"):
        dist.split_layers([nn.Dense(2)] * 3, {}, 2, boundaries=[3])
    with pytest.raises(ValueError, match="num_stages"):
        dist.split_layers([nn.Dense(2)] * 3, {}, 4)


def normalized(p, x):
    """An L2 normalisation, then a linear map: finite on every real input, NaN on zeros."""
    return (x / jnp.linalg.norm(x, axis=-1, keepdims=True)) @ p["w"]


def test_gpipe_skips_the_bubble_for_stages_not_finite_on_zeros():
    """Stages NaN on the bubble's zero padding: GPipe runs a stage on its M real ticks only.

    4 stages x 2 replicas, the middle and last stages normalising their input;
    the reference is jax.grad of the same functions on one device, whole batch.
    """
    mesh = jax.make_mesh((4, 2), ("stage", "data"))
    rng = np.random.default_rng(12)
    params = [{"w": rng.standard_normal((WIDTH, WIDTH)).astype(np.float32)} for _ in range(4)]
    fns = [lambda p, x: x @ p["w"], normalized, normalized, normalized]
    x, t = data(13)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    got, _, (m,) = run_pipeline(tx, mesh, params, fns, [(x, t)], microbatches=2)

    def whole(ps):
        h = x
        for fn, p in zip(fns, ps, strict=True):
            h = fn(p, h)
        return mse(h, t)

    loss, grads = jax.value_and_grad(whole)(params)
    np.testing.assert_allclose(m["loss"], loss, rtol=1e-6)
    for p, q, g in zip(got, params, grads, strict=True):
        np.testing.assert_allclose(p["w"], q["w"] - LR * g["w"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_bfloat16_stage_next_to_float32_stage(schedule):
    """A Flax model whose first layer has bfloat16 parameters, split in 2 stages (flat form).

    The stage function sees bfloat16 parameters and ``unstack_stages`` returns
    them; the update runs in the flat vector's float32 and each bfloat16 element
    is rounded back to bfloat16. Reference: the Flax model trained with SGD on
    one device (its bfloat16 update rounded twice, ``lr * g`` then ``p + u``;
    ours once), so the bfloat16 kernel may differ by one bfloat16 ulp per step
    (relative 2**-8 .. 2**-7); the float32 stage then follows within that.
    """
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    layers = [nn.Dense(5, param_dtype=jnp.bfloat16), nn.tanh, nn.Dense(2)]
    model = nn.Sequential(layers)
    batches = [data(14, width_in=3, width_out=2), data(15, width_in=3, width_out=2)]
    params = model.init(jax.random.key(1), batches[0][0])["params"]
    fns, stage_params = dist.split_layers(layers, params, 2)
    seen = []

    def first(p, x):
        seen.append(p["layers_0"]["kernel"].dtype)
        return fns[0](p, x)

    stacked, stages = dist.stack_stages(stage_params, mesh)
    assert stages.flat and stacked.dtype == jnp.float32
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    state = dist.init_pipeline_opt_state(tx, stacked, mesh)
    step = dist.make_pipeline_train_step(
        [first, fns[1]], stages, mse, tx, mesh, 2, schedule=schedule
    )
    ref = params
    for i, (x, t) in enumerate(batches):
        stacked, state, m = step(stacked, state, (x, t))
        loss, grads = jax.value_and_grad(lambda p, x=x, t=t: mse(model.apply({"params": p}, x), t))(
            ref
        )
        # The same parameters at step 0; then the bfloat16 kernel up to an ulp apart.
        np.testing.assert_allclose(m["loss"], loss, rtol=1e-6 if i == 0 else 2e-3)
        ref = optax.apply_updates(ref, jax.tree.map(lambda g: -LR * g, grads))
    assert set(map(str, seen)) == {"bfloat16"}
    got = dist.unstack_stages(stacked, stages)
    dtypes = [jax.tree.map(lambda a: str(a.dtype), p) for p in got]
    assert dtypes == [
        {"layers_0": {"bias": "bfloat16", "kernel": "bfloat16"}},
        {"layers_2": {"bias": "float32", "kernel": "float32"}},
    ]
    assert ref["layers_0"]["kernel"].dtype == jnp.bfloat16
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    for name, (rtol, atol) in (("layers_0", (2 * 2**-7, 1e-4)), ("layers_2", (2e-3, 1e-4))):
        for k in ("kernel", "bias"):
            np.testing.assert_allclose(
                f32(got[name != "layers_0"][name][k]), f32(ref[name][k]), rtol=rtol, atol=atol
            )
    # The stored vector holds exactly the bfloat16 values unstack_stages returns.
    row = np.asarray(jax.device_get(stacked))[0]
    leaves = jax.tree.leaves(got[0])
    np.testing.assert_array_equal(
        row[: sum(a.size for a in leaves)], np.concatenate([f32(a).ravel() for a in leaves])
    )


def test_bad_stage_functions_and_loss():
    """Wrong stage functions or loss: a ValueError naming the argument, at the step's trace."""
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    params = blocks_params(2)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    stacked, stages = dist.stack_stages(params, mesh)
    state = dist.init_pipeline_opt_state(tx, stacked, mesh)
    with pytest.raises(ValueError, match=r"stage_fns\[1\] must be a function"):
        dist.make_pipeline_train_step([block, 2], stages, mse, tx, mesh, 2)
    with pytest.raises(ValueError, match="loss_fn must be a function"):
        dist.make_pipeline_train_step([block, block], stages, "mse", tx, mesh, 2)
    elementwise = lambda y, t: (y - t) ** 2  # noqa: E731
    step = dist.make_pipeline_train_step([block, block], stages, elementwise, tx, mesh, 2)
    with pytest.raises(ValueError, match=r"loss_fn must return a scalar .* got shape \(2, 4\)"):
        step(stacked, state, data())
    doubled = lambda p, x: block(p, jnp.concatenate([x, x]))  # noqa: E731
    step = dist.make_pipeline_train_step([doubled, block], stages, mse, tx, mesh, 2)
    with pytest.raises(ValueError, match=r"stage_fns\[0\] must return one array keeping .* 2 ex"):
        step(stacked, state, data())
    with pytest.raises(ValueError, match=r"stage_params\[1\] leaf \['n'\] has dtype int32"):
        dist.stack_stages([{"w": np.ones(3, np.float32)}, {"n": np.ones(2, np.int32)}], mesh)


def test_mixed_dtype_stage_rounds_each_leaf_to_its_dtype():
    """A stage mixing bfloat16 and float32 leaves (two bfloat16 runs around a float32 one).

    One SGD step against jax.grad on one device: each leaf is ``p - lr g``
    rounded once to its own dtype (bfloat16 within one ulp: the gradients
    summed per micro-batch), and the stored vector holds exactly those values.
    """
    mesh = jax.make_mesh((2, 4), ("stage", "data"))
    rng = np.random.default_rng(16)
    first = {
        "a": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)), jnp.bfloat16),
        "b": jnp.asarray(rng.standard_normal(WIDTH), jnp.float32),
        "c": jnp.asarray(rng.standard_normal(WIDTH), jnp.bfloat16),
    }
    params = [first, {"w": jnp.asarray(rng.standard_normal((WIDTH, WIDTH)), jnp.float32)}]
    fns = [
        lambda p, x: jnp.tanh(x @ p["a"].astype(jnp.float32) + p["b"] * p["c"].astype(jnp.float32)),
        lambda p, x: x @ p["w"],
    ]
    x, t = data(17)
    tx = optax.chain(dist.dense_exchange("data"), optax.sgd(LR))
    stacked, stages = dist.stack_stages(params, mesh)
    state = dist.init_pipeline_opt_state(tx, stacked, mesh)
    step = dist.make_pipeline_train_step(fns, stages, mse, tx, mesh, 2)
    stacked, _, _ = step(stacked, state, (x, t))
    got = dist.unstack_stages(stacked, stages)
    grads = jax.grad(lambda ps: mse(fns[1](ps[1], fns[0](ps[0], x)), t))(params)
    for p, q, g in zip(got, params, grads, strict=True):
        for k in p:
            assert p[k].dtype == q[k].dtype
            exact = np.asarray(q[k], np.float64) - LR * np.asarray(g[k], np.float64)
            want = np.asarray(exact.astype(np.dtype(q[k].dtype)), np.float64)
            ulp = 2**-7 if q[k].dtype == jnp.bfloat16 else 1e-6
            np.testing.assert_allclose(np.asarray(p[k], np.float64), want, rtol=ulp, atol=1e-6)
    # The stored vector (float32) holds exactly the values unstack_stages returns.
    rows = np.asarray(jax.device_get(stacked))
    for row, p in zip(rows, got, strict=True):
        leaves = [np.asarray(a, np.float32).ravel() for a in jax.tree.leaves(p)]
        np.testing.assert_array_equal(row[: sum(a.size for a in leaves)], np.concatenate(leaves))
