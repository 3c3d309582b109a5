"""Data x model parallel training: compression over the data axis, parameters sharded over "model".

References: the same compressor on a 1-D data mesh with every model shard of a
parameter given as a leaf of its own (per-shard selection is per-leaf
selection of the slices), the 1-D step itself (model axis of size 1), and
plain single-device SGD on the whole batch (dense exchange).
"""

from __future__ import annotations

import contextlib
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FACTORIES
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist
from jaxcomp.comm import collectives

N_DATA, N_MODEL = 4, 2
RATIO = 0.25
ROWS = 3  # batch rows per data device
SHAPES = {"w": (6, 8), "v": (8, 5), "b": (7,)}
SPECS = {"w": P(None, "model"), "v": P("model", None), "b": P()}
# Slices of each leaf held by model shard 0 and 1.
SLICES = {
    "w": [np.s_[:, :4], np.s_[:, 4:]],
    "v": [np.s_[:4, :], np.s_[4:, :]],
}


def _mesh(n_data=N_DATA, n_model=N_MODEL, types=AxisType.Auto):
    devices = np.array(jax.devices()[: n_data * n_model]).reshape(n_data, n_model)
    return jax.sharding.Mesh(devices, ("data", "model"), axis_types=(types, types))


def _mesh_1d(n_data=N_DATA):
    return jax.sharding.Mesh(np.array(jax.devices()[:n_data]), ("data",))


def _linear_loss(params, batch):
    # d loss / d params[leaf] = mean of this device's rows of batch[leaf]: per-device
    # gradients are exactly the data, whatever the sharding.
    return sum(jnp.sum(jnp.mean(batch[k], axis=0) * params[k]) for k in params)


def _data(seed, n_data=N_DATA, steps=2):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in SHAPES.items()}
    batches = [
        {k: rng.laplace(size=(n_data * ROWS, *s)).astype(np.float32) for k, s in SHAPES.items()}
        for _ in range(steps)
    ]
    return params, batches


def _split(tree):
    """Every model-sharded leaf as one leaf per shard (the 1-D reference's parameters)."""
    out = {}
    for k, x in tree.items():
        if k not in SLICES:
            out[k] = x
            continue
        for i, sl in enumerate(SLICES[k]):
            out[f"{k}{i}"] = x[(slice(None), *sl)] if x.ndim > len(SHAPES[k]) else x[sl]
    return out


def _train(loss, tx, mesh, params, batches, specs=None):
    params = dist.place_params(params, mesh, specs)
    state = dist.init_opt_state(tx, params, mesh, param_specs=specs)
    step = dist.make_train_step(loss, tx, mesh, param_specs=specs)
    metrics = None
    for batch in batches:
        params, state, metrics = step(params, state, dist.shard_batch(batch, mesh))
    return jax.device_get(params), jax.device_get(state), jax.device_get(metrics)


def _tx(name, axis_name="data"):
    # min_dense_size 2: the small test leaves are compressed, not sent dense.
    return optax.chain(
        FACTORIES[name](RATIO, axis_name=axis_name, min_dense_size=2), optax.sgd(0.1)
    )


# The per-shard mechanism is generic (one shard_map around tx.update): one compressor
# per code path: exact and estimated thresholds, momentum correction, quantizers with
# and without buckets (the randomized ones are in the size-one test below).
DETERMINISTIC = ["top_k", "ldte_bs", "dgc", "gaussian_k", "onebit", "ef_sign_sgd"]


@pytest.mark.parametrize("name", DETERMINISTIC)
def test_each_model_shard_compresses_its_own_slice(name):
    params, batches = _data(0)
    got, state, _ = _train(_linear_loss, _tx(name), _mesh(), params, batches, SPECS)
    ref, _, _ = _train(_linear_loss, _tx(name), _mesh_1d(), _split(params), map(_split, batches))
    for k, slices in SLICES.items():
        for i, sl in enumerate(slices):
            np.testing.assert_allclose(got[k][sl], ref[f"{k}{i}"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got["b"], ref["b"], rtol=1e-6, atol=1e-6)
    # The state is per (data device, model shard), holding the shard's slice.
    residual = optax.tree.get(state, "residual")
    if residual is not None:
        assert residual["w"].shape == (N_DATA, N_MODEL, 6, 4)
        assert residual["v"].shape == (N_DATA, N_MODEL, 4, 5)


# The randomized ones (their keys fold in the leaf index, so the split reference differs),
# and one of each kind. Every randomized quantizer draws its key in the one place
# (quantize.update_leaves: fold in the step, the device, the leaf): QSGD with and without
# error feedback stand for them.
@pytest.mark.parametrize("name", ["random_k", "qsgd", "qsgd_ef", "top_k", "onebit"])
def test_model_axis_of_size_one_is_the_1d_step(name):
    params, batches = _data(1, n_data=8)
    specs = {"w": P(None, "model"), "v": P("model", None), "b": P()}
    got, state, m2 = _train(_linear_loss, _tx(name), _mesh(8, 1), params, batches, specs)
    ref, ref_state, m1 = _train(_linear_loss, _tx(name), _mesh_1d(8), params, batches)
    for k in params:
        np.testing.assert_array_equal(got[k], ref[k])
    residual = optax.tree.get(state, "residual")
    ref_residual = optax.tree.get(ref_state, "residual")
    if ref_residual is not None:
        for k in params:
            np.testing.assert_array_equal(residual[k][:, 0], ref_residual[k])
    assert float(m2["wire_bytes"]) == float(m1["wire_bytes"])


class _MLP(nn.Module):
    """Megatron-style pair: first kernel split by columns, second by rows."""

    # With explicit axes, the row-split product must say how its output is sharded.
    explicit: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        x = nn.Dense(8, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")))(x)
        x = nn.tanh(x)
        dot = functools.partial(lax.dot_general, out_sharding=P()) if self.explicit else None
        kernel_init = nn.with_logical_partitioning(init, ("mlp", "embed"))
        return nn.Dense(3, kernel_init=kernel_init, dot_general=dot)(x)


RULES = (("embed", None), ("mlp", "model"))


@pytest.mark.parametrize("axis_types", [AxisType.Auto, AxisType.Explicit])
def test_flax_partitioned_dense_training_equals_single_device_sgd(axis_types):
    model = _MLP()
    sharded_model = _MLP(explicit=axis_types == AxisType.Explicit)
    boxed = model.init(jax.random.key(0), jnp.ones((1, 5)))["params"]
    specs = dist.flax_param_specs(boxed, RULES)
    assert specs["Dense_0"]["kernel"] == P(None, "model")
    assert specs["Dense_1"]["kernel"] == P("model", None)
    params = nn.meta.unbox(boxed)
    rng = np.random.default_rng(2)
    batches = [
        {"x": rng.normal(size=(8, 5)).astype(np.float32), "y": rng.normal(size=(8, 3))}
        for _ in range(3)
    ]

    def loss(p, batch, model=model):
        out = model.apply({"params": p}, batch["x"])
        return jnp.mean((out - batch["y"].astype(np.float32)) ** 2)

    sharded_loss = functools.partial(loss, model=sharded_model)

    mesh = _mesh(4, 2, axis_types)
    for tx in (
        optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(0.1)),
        # ratio 1: every element is selected, so the exchange is the dense mean.
        optax.chain(jaxcomp.top_k(1.0, axis_name="data"), optax.sgd(0.1)),
    ):
        got, _, metrics = _train(sharded_loss, tx, mesh, params, batches, specs)
        ref = params
        for batch in batches:  # the unsharded reference: one device, the whole batch
            g = jax.grad(loss)(ref, batch)
            ref = jax.tree.map(lambda p, g: p - 0.1 * g, ref, g)
        for g_leaf, r_leaf in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(g_leaf, r_leaf, rtol=2e-5, atol=2e-6)
        assert float(metrics["loss"]) == pytest.approx(float(loss(got, batches[-1])), rel=0.5)


def test_wire_bytes_are_one_devices_share():
    params, batches = _data(3)
    tx = optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(0.1))
    _, _, metrics = _train(_linear_loss, tx, _mesh(), params, batches, SPECS)
    # Each device all-reduces its slices over the 4 data devices: w and v halves, b whole.
    local = (24 + 20 + 7) * 4
    assert float(metrics["wire_bytes"]) == pytest.approx(collectives.allreduce_bytes(local, 4))


def test_time_split_and_communicate_false_with_model_axes():
    params, batches = _data(4)
    mesh = _mesh()
    tx = _tx("top_k")
    placed = dist.place_params(params, mesh, SPECS)
    state = dist.init_opt_state(tx, placed, mesh, param_specs=SPECS)
    batch = dist.shard_batch(batches[0], mesh)
    split = dist.time_split(_linear_loss, tx, mesh, placed, state, batch, param_specs=SPECS)
    assert split.step > 0
    step = dist.make_train_step(_linear_loss, tx, mesh, param_specs=SPECS, communicate=False)
    hlo = step.lower(placed, state, batch).as_text()
    # The data axis' exchange is gone (the model axis has no collective in this loss).
    assert "all-gather" not in hlo and "all_gather" not in hlo


@pytest.mark.parametrize(
    "specs, match",
    [
        ({"w": P(("data", "model"), None), "v": P(), "b": P()}, "by that axis alone"),
        ({"w": P(None, "tensor"), "v": P(), "b": P()}, "does not have"),
        ({"w": P(None, "model"), "v": P(None, "model"), "b": P()}, "does not divide"),
        ({"w": P(None, "model"), "v": P()}, "structure"),
    ],
)
def test_bad_param_specs(specs, match):
    params, _ = _data(5)
    with pytest.raises(ValueError, match=match):
        dist.place_params(params, _mesh(), specs)


def test_overlap_rejected_with_model_axes():
    with pytest.raises(ValueError, match="overlap"):
        dist.make_train_step(_linear_loss, _tx("top_k"), _mesh(), param_specs=SPECS, overlap=True)


# --- FSDP: parameters (and optimizer state) split over the data axis ---------------

FSDP_SPECS = {"w": P("data", None), "v": P("data", None), "b": P()}


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w"] + params["b"][:8])
    return jnp.mean((h @ params["v"][:, :3] - batch["y"]) ** 2)


def _mlp_data(seed, steps=2, rows=2 * 4):
    rng = np.random.default_rng(seed)
    params = {
        "w": rng.normal(size=(8, 8)).astype(np.float32),
        "v": rng.normal(size=(8, 4)).astype(np.float32),
        "b": rng.normal(size=(8,)).astype(np.float32),
    }
    batches = [
        {
            "x": rng.normal(size=(rows, 8)).astype(np.float32),
            "y": rng.normal(size=(rows, 3)).astype(np.float32),
        }
        for _ in range(steps)
    ]
    return params, batches


@pytest.mark.parametrize(
    "name, axis_types",
    [
        ("dense", AxisType.Auto),
        ("ldte_bs", AxisType.Auto),
        ("qsgd_ef", AxisType.Auto),
        ("top_k", AxisType.Explicit),
    ],
)
def test_fsdp_equals_replicated_training(name, axis_types):
    """Split parameters (and, with sharded_optimizer, Adam's moments) train as replicated ones."""
    params, batches = _mlp_data(6)
    devices = np.array(jax.devices()[:4])
    mesh = jax.sharding.Mesh(devices, ("data",), axis_types=(axis_types,))
    if name == "dense":
        compressor = jaxcomp.dense_exchange("data")
    else:
        compressor = FACTORIES[name](RATIO, axis_name="data", min_dense_size=2)
    runs = {
        "replicated": (optax.chain(compressor, optax.adam(0.01)), None),
        "fsdp": (optax.chain(compressor, optax.adam(0.01)), FSDP_SPECS),
        "sharded": (dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS), FSDP_SPECS),
    }
    out = {
        k: _train(_mlp_loss, tx, mesh, params, batches, specs) for k, (tx, specs) in runs.items()
    }
    ref_params, _, ref_metrics = out["replicated"]
    for kind in ("fsdp", "sharded"):
        got, state, metrics = out[kind]
        for k in params:
            np.testing.assert_array_equal(got[k], ref_params[k])
        # The FSDP all-gather of the split parameters is counted on top of the exchange.
        gathered = (8 * 8 + 8 * 4) // 4 * 4
        assert float(metrics["wire_bytes"]) == pytest.approx(
            float(ref_metrics["wire_bytes"]) + collectives.allgather_bytes(gathered, 4)
        )
    mu = out["sharded"][1].optimizer[0].mu
    assert mu["w"].shape == (4, 2, 8) and mu["v"].shape == (4, 2, 4) and mu["b"].shape == (4, 8)
    # Device d's moments are the whole run's moments of its slice.
    whole_mu = out["replicated"][1][1][0].mu
    for d in range(4):
        np.testing.assert_array_equal(mu["w"][d], whole_mu["w"][d, 2 * d : 2 * d + 2])
    fsdp_params = dist.place_params(params, mesh, FSDP_SPECS)
    assert fsdp_params["w"].sharding.spec == P("data", None)


# XLA's default backend optimisation level (tests/conftest.py sets 0): at it
# XLA:CPU contracts a multiply and an add in one kernel into an FMA.
USERS_OPTIMIZATION = {"xla_backend_optimization_level": 3}


class _ColumnSplitMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(24, name="hidden")(x))
        return nn.Dense(16, name="out")(h)


def test_sharded_optimizer_with_last_axis_split_within_a_rounding_per_step():
    """sharded_optimizer(qsgd, adam), Dense kernels split by columns (issue 34, item 4).

    Documented: bit for bit as the tests compile (XLA:CPU at optimisation
    level 0); at XLA's default level, where LLVM contracts multiply-adds in
    whichever kernel XLA fused them, Adam's arithmetic on a column slice and
    on the whole kernel can round differently: per step at most one float32
    ulp of a parameter plus one of the update (Adam's is at most about
    ``lr``); observed 9e-10 after 3 steps, 1-2 ulps.
    """
    n = 8
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    model = _ColumnSplitMLP()
    params = jax.device_get(model.init(jax.random.key(0), jnp.zeros((1, 20)))["params"])

    def loss(p, batch):
        return jnp.mean((model.apply({"params": p}, batch["x"]) - batch["y"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [
        {
            "x": rng.normal(size=(4 * n, 20)).astype(np.float32),
            "y": rng.normal(size=(4 * n, 16)).astype(np.float32),
        }
        for _ in range(3)
    ]
    specs = jax.tree.map(lambda x: P(None, "data") if x.ndim == 2 else P(), params)
    runs = {
        "replicated": (optax.chain(jaxcomp.qsgd(axis_name="data", bits=4), optax.adam(1e-3)), None),
        "sharded": (
            dist.sharded_optimizer(jaxcomp.qsgd(axis_name="data", bits=4), optax.adam(1e-3), specs),
            specs,
        ),
    }
    for options in (None, USERS_OPTIMIZATION):
        out = {}
        for kind, (tx, sp) in runs.items():
            p = dist.place_params(params, mesh, sp)
            state = dist.init_opt_state(tx, p, mesh, param_specs=sp)
            step = dist.make_train_step(loss, tx, mesh, param_specs=sp, donate=False)
            compiled = step.lower(p, state, dist.shard_batch(batches[0], mesh)).compile(
                compiler_options=options
            )
            out[kind] = []
            for batch in batches:
                p, state, *_ = compiled(p, state, dist.shard_batch(batch, mesh), None, None, {})
                out[kind].append(jax.device_get(p))
        for t, (got, ref) in enumerate(zip(out["sharded"], out["replicated"], strict=True)):
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
                if options is None:
                    np.testing.assert_array_equal(a, b)
                else:  # per step: an ulp of the parameter and one of the update (<= lr)
                    bound = (t + 1) * (np.spacing(np.abs(b)) + np.spacing(np.float32(1e-3)))
                    assert np.all(np.abs(a - b) <= bound), (t, float(np.max(np.abs(a - b))))
    assert not np.array_equal(out["sharded"][-1]["hidden"]["kernel"], params["hidden"]["kernel"])


def test_fsdp_and_model_axes_together():
    """A leaf split over "data" (FSDP) beside leaves split over "model" (tensor parallel)."""
    params, batches = _data(7)
    specs = {"w": P(None, "model"), "v": P("data", None), "b": P()}
    tx = optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(0.1))
    got, state, _ = _train(_linear_loss, tx, _mesh(), params, batches, specs)
    ref, _, _ = _train(_linear_loss, tx, _mesh_1d(), params, batches)
    for k in params:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-6, atol=1e-6)


def test_bad_fsdp_specs():
    params, _ = _mlp_data(8)
    with pytest.raises(ValueError, match="does not divide"):
        dist.place_params(params, _mesh_1d(3), {"w": P("data", None), "v": P(), "b": P()})
    with pytest.raises(ValueError, match="one dimension"):
        dist.place_params({"w": params["w"]}, _mesh_1d(), {"w": P("data", "data")})


# --- compressors under jit on leaves split over explicit mesh axes (GSPMD) ---------


@pytest.mark.parametrize(
    "name, in_context",
    [(name, True) for name in FACTORIES]
    # Outside jax.set_mesh: the library reshards on each array's own mesh.
    + [(name, False) for name in ("ldte_bs", "top_k", "qsgd_ef", "onebit")],
)
def test_compressor_on_explicitly_sharded_leaves_equals_unsharded(name, in_context):
    """jit(tx.update) on leaves split with explicit axes: each leaf compressed whole."""
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(9)
    grads = {
        "w": rng.laplace(size=(16, 5)).astype(np.float32),
        "b": rng.laplace(size=(8,)).astype(np.float32),
    }
    specs = {"w": P("data", None), "b": P()}
    tx = FACTORIES[name](RATIO, min_dense_size=2)
    ref_state = tx.init(grads)
    ref_updates, ref_state = jax.jit(tx.update)(grads, ref_state)
    with jax.set_mesh(mesh) if in_context else contextlib.nullcontext():
        sharded = jax.tree.map(
            lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s)), grads, specs
        )
        state = jax.jit(tx.init)(sharded)
        updates, state = jax.jit(tx.update)(sharded, state)
    assert updates["w"].sharding.spec == P("data", None)
    for k in grads:
        np.testing.assert_array_equal(np.asarray(updates[k]), np.asarray(ref_updates[k]))
    residual = optax.tree.get(state, "residual")
    if residual is not None:
        assert residual["w"].sharding.spec == P("data", None)
        ref_residual = optax.tree.get(ref_state, "residual")
        for k in grads:
            np.testing.assert_array_equal(np.asarray(residual[k]), np.asarray(ref_residual[k]))


def test_onebit_on_a_leaf_split_over_an_auto_axis_within_reassociation():
    """Auto axes: XLA partitions the compressor, so a scale is summed per shard, then across.

    The documented difference from one device (issue 34, item 4): per-element
    work and the code (the signs) are the same bit for bit; each of a
    bucket's two scales (the means of its non-negative and of its negative
    values) is a float32 sum in another order, within a relative ``n *
    2**-24`` of the exact mean (``n`` the bucket's length), as the one-device
    scale is; the residual is the accumulator minus the update on either.
    """
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    g = np.random.default_rng(9).laplace(size=(64, 33)).astype(np.float32)
    tx = jaxcomp.onebit(min_dense_size=2)
    one_device, _ = jax.jit(tx.update)({"w": g}, tx.init({"w": g}))
    split = {"w": jax.device_put(g, jax.sharding.NamedSharding(mesh, P("data", None)))}
    updates, state = jax.jit(tx.update)(split, jax.jit(tx.init)(split))
    got, ref = np.asarray(updates["w"]), np.asarray(one_device["w"])
    np.testing.assert_array_equal(got >= 0, g >= 0)
    np.testing.assert_array_equal(ref >= 0, g >= 0)
    pos = g >= 0
    exact = np.where(pos, g[pos].astype(np.float64).mean(), g[~pos].astype(np.float64).mean())
    for u in (got, ref):
        np.testing.assert_allclose(u, exact, rtol=g.size * 2.0**-24, atol=0)
    residual = np.asarray(optax.tree.get(state, "residual")["w"])
    np.testing.assert_array_equal(residual, g - got)  # error feedback (zero old residual)


# --- FSDP's reduce-scatter of sparse messages (exchange="scatter") -------------------


def test_scatter_mean_against_numpy_and_nothing_lost():
    """Each device gets the mean of every message's pairs in its region; overflow comes back."""
    from jaxcomp.comm import sparse_allreduce

    n_dev, size, cap = 8, 64, 12
    mesh = _mesh_1d(n_dev)
    rng = np.random.default_rng(10)
    idx = np.stack([np.sort(rng.choice(size, cap, replace=False)) for _ in range(n_dev)])
    idx[0, :] = np.arange(cap)  # device 0 crowds region 0 and 1: overflow past 3 per peer
    idx[1, -2:] = size  # padding
    val = rng.normal(size=(n_dev, cap)).astype(np.float32)

    def run(i, v):
        ex = sparse_allreduce.scatter_mean(i[0], v[0], size, "data")
        return ex.update[None], ex.returned_indices[None], ex.returned_values[None], ex.wire_bytes

    f = jax.jit(
        jax.shard_map(
            run,
            mesh=mesh,
            in_specs=(P("data"), P("data")),
            out_specs=(P("data"), P("data"), P("data"), P()),
            check_vma=False,
        )
    )
    upd, ret_i, ret_v, wire = jax.device_get(f(jnp.asarray(idx, jnp.int32), jnp.asarray(val)))
    per_peer = sparse_allreduce.scatter_capacity(cap, n_dev)
    region = size // n_dev
    sent_total = np.zeros(size)  # what the devices sent, minus what came back
    kept = np.zeros(size)
    for d in range(n_dev):
        valid = idx[d] < size
        np.add.at(sent_total, idx[d][valid], val[d][valid])
        back = ret_i[d] < size
        np.add.at(sent_total, ret_i[d][back], -ret_v[d][back])
        # Numpy reference of the overflow: past per_peer pairs of one region, in index order.
        owners = idx[d][valid] // region
        ranks = np.array([np.sum(owners[:j] == owners[j]) for j in range(len(owners))])
        np.testing.assert_array_equal(
            np.sort(ret_i[d][back]), np.sort(idx[d][valid][ranks >= per_peer])
        )
    for d in range(n_dev):
        kept[d * region : (d + 1) * region] = upd[d] * n_dev
    np.testing.assert_allclose(kept, sent_total, rtol=1e-5, atol=1e-5)
    assert np.any(ret_i[0] < size)  # the crowded device did overflow
    assert float(wire) == (n_dev - 1) * per_peer * 8


def test_fsdp_scatter_exchange_trains_like_the_all_gather():
    params, batches = _mlp_data(11, steps=3)
    mesh = _mesh_1d()
    out = {}
    for exchange in ("sparse", "scatter"):
        # Ratio 0.5: a region's capacity per peer (ceil(1.5 cap / N)) holds the whole
        # region, so nothing overflows back into a residual and the runs agree.
        compressor = jaxcomp.ldte_bs(0.5, axis_name="data", min_dense_size=2, exchange=exchange)
        tx = dist.sharded_optimizer(compressor, optax.sgd(0.1, momentum=0.9), FSDP_SPECS)
        out[exchange] = _train(_mlp_loss, tx, mesh, params, batches, FSDP_SPECS)
    for k in params:  # the same sums, added in another order
        np.testing.assert_allclose(out["scatter"][0][k], out["sparse"][0][k], rtol=1e-5, atol=1e-6)
    assert float(out["scatter"][2]["wire_bytes"]) < float(out["sparse"][2]["wire_bytes"])


def test_fsdp_scatter_on_a_one_device_mesh_is_plain_training():
    # One GPU (a Colab): each device's region is the whole leaf. Refused before
    # ("the update leaves differ between devices"); now the plain step's result.
    params, batches = _mlp_data(13, steps=3)
    mesh = _mesh_1d(1)
    out = {}
    for exchange in ("sparse", "scatter"):
        compressor = jaxcomp.ldte_bs(0.3, axis_name="data", min_dense_size=2, exchange=exchange)
        tx = dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS)
        out[exchange] = _train(_mlp_loss, tx, mesh, params, batches, FSDP_SPECS)
    # Reference: the same optimizer on one device without a mesh (numpy-free
    # but independent of the FSDP path: no sharded_optimizer, no shard_map).
    tx = optax.chain(jaxcomp.ldte_bs(0.3, min_dense_size=2), optax.adam(0.01))
    ref, state = dict(params), tx.init(params)
    for batch in batches:
        grads = jax.grad(_mlp_loss)(ref, batch)
        updates, state = tx.update(grads, state, ref)
        ref = optax.apply_updates(ref, updates)
    for k in params:
        for exchange in ("sparse", "scatter"):
            np.testing.assert_allclose(out[exchange][0][k], ref[k], rtol=1e-6, atol=1e-7)


def test_scatter_needs_the_sharded_optimizer():
    params, batches = _mlp_data(12, steps=1)
    compressor = jaxcomp.top_k(RATIO, axis_name="data", exchange="scatter")
    with pytest.raises(ValueError, match="sharded_optimizer"):
        _train(_mlp_loss, optax.chain(compressor, optax.sgd(0.1)), _mesh_1d(), params, batches)
    with pytest.raises(ValueError, match="per-leaf"):
        jaxcomp.top_k(RATIO, axis_name="data", exchange="scatter", granularity="global")
    # A parameter left replicated while the compressor was told it is split.
    tx = dist.sharded_optimizer(
        compressor, optax.sgd(0.1), {"w": P("data", None), "v": P(), "b": P()}
    )
    specs = {"w": P(), "v": P(), "b": P()}
    with pytest.raises(ValueError, match="same specs"):
        _train(_mlp_loss, tx, _mesh_1d(), params, batches, specs)


# --- FSDP next to the happy path: optax wrappers, x64 --------------------------------


def _fsdp_wrapped(kind):
    """(tx, sharded_tx) pairs: the same optimizer written with an optax wrapper."""
    compressor = FACTORIES["ldte_bs"](RATIO, axis_name="data", min_dense_size=2)
    if kind == "masked":  # the bias left out of the compressor (averaged densely before tx)
        mask = {"w": True, "v": True, "b": False}
        return optax.chain(optax.masked(compressor, mask), optax.adam(0.01)), None
    if kind == "multi_steps":  # two micro-batches per applied step
        return optax.MultiSteps(optax.chain(compressor, optax.sgd(0.1)), 2), None
    if kind == "inject_hyperparams":  # the optimizer's state on the owned slices
        adam = optax.inject_hyperparams(optax.adam)(learning_rate=0.01)
        return (
            optax.chain(compressor, optax.inject_hyperparams(optax.adam)(learning_rate=0.01)),
            dist.sharded_optimizer(compressor, adam, FSDP_SPECS),
        )
    if kind == "apply_if_finite":  # the skip branch's zeros shaped as the owned slices
        return (
            jaxcomp.apply_if_finite(optax.chain(compressor, optax.adam(0.01)), 3, axis_name="data"),
            jaxcomp.apply_if_finite(
                dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS), 3, "data"
            ),
        )
    if kind == "chain":  # sharded_optimizer after a (here inactive) clipping transform
        clip = optax.clip_by_global_norm(1e6)
        return (
            optax.chain(clip, compressor, optax.adam(0.01)),
            optax.chain(clip, dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS)),
        )
    raise AssertionError(kind)


def test_exchange_probe_sees_through_a_chained_sharded_optimizer():
    """Inside optax.chain the probe once took the owned slices for unexchanged leaves
    and averaged their gradients densely before tx (the compressor then compressed the
    mean gradient). A compressor that exchanges nothing is still reported."""
    params, _ = _mlp_data(9)
    mesh = _mesh_1d(4)
    placed = dist.place_params(params, mesh, FSDP_SPECS)
    clip = optax.clip_by_global_norm(1e6)
    for compressor, want in [
        (FACTORIES["top_k"](RATIO, axis_name="data"), []),
        (FACTORIES["top_k"](RATIO), ["['b']", "['v']", "['w']"]),  # no axis_name
    ]:
        tx = optax.chain(clip, dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS))
        assert dist.unexchanged_leaves(tx, placed, mesh) == want


@pytest.mark.parametrize(
    "kind", ["masked", "multi_steps", "inject_hyperparams", "chain", "apply_if_finite"]
)
def test_fsdp_with_optax_wrappers_equals_replicated_training(kind):
    """optax.masked, MultiSteps and inject_hyperparams around FSDP training: the split
    parameters end bit for bit where the replicated ones do (or a clear error)."""
    params, batches = _mlp_data(9, steps=4)
    mesh = _mesh_1d(4)
    tx, sharded = _fsdp_wrapped(kind)
    ref, _, _ = _train(_mlp_loss, tx, mesh, params, batches)
    runs = {"fsdp": (tx, FSDP_SPECS)}
    if sharded is not None:
        runs["sharded"] = (sharded, FSDP_SPECS)
    for label, (t, specs) in runs.items():
        got, _, _ = _train(_mlp_loss, t, mesh, params, batches, specs)
        for k in params:
            np.testing.assert_array_equal(got[k], ref[k], err_msg=f"{label} {k}")
    if kind == "multi_steps":  # the wrapper really accumulated: 4 micro-batches, 2 updates
        one_step, _, _ = _train(_mlp_loss, tx, mesh, params, batches[:1])
        np.testing.assert_array_equal(one_step["w"], params["w"])


def test_fsdp_under_x64_keeps_float64_and_equals_replicated():
    """jax_enable_x64 with float64 parameters: FSDP and sharded_optimizer train as the
    replicated run does, and every parameter and moment stays float64."""
    with jax.enable_x64(True):
        params, batches = _mlp_data(10)
        params = jax.tree.map(lambda a: a.astype(np.float64), params)
        batches = [jax.tree.map(lambda a: a.astype(np.float64), b) for b in batches]
        mesh = _mesh_1d(4)
        compressor = FACTORIES["top_k"](RATIO, axis_name="data", min_dense_size=2)
        tx = optax.chain(compressor, optax.adam(0.01))
        ref, _, _ = _train(_mlp_loss, tx, mesh, params, batches)
        sharded = dist.sharded_optimizer(compressor, optax.adam(0.01), FSDP_SPECS)
        for t in (tx, sharded):
            got, state, _ = _train(_mlp_loss, t, mesh, params, batches, FSDP_SPECS)
            for k in params:
                assert got[k].dtype == np.float64, k
                np.testing.assert_array_equal(got[k], ref[k])
            for leaf in jax.tree.leaves(optax.tree.get(state, "mu")):
                assert leaf.dtype == np.float64


def test_model_axes_under_x64_keep_float64():
    """jax_enable_x64, float64 parameters on a data x model mesh: each model shard's result
    equals the 1-D run on its slice, in float64 (residuals included)."""
    with jax.enable_x64(True):
        params, batches = _data(11)
        params = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
        batches = [jax.tree.map(lambda a: np.asarray(a, np.float64), b) for b in batches]
        got, state, _ = _train(_linear_loss, _tx("ldte_bs"), _mesh(), params, batches, SPECS)
        ref, _, _ = _train(
            _linear_loss, _tx("ldte_bs"), _mesh_1d(), _split(params), map(_split, batches)
        )
        for k, slices in SLICES.items():
            assert got[k].dtype == np.float64
            for i, sl in enumerate(slices):
                np.testing.assert_allclose(got[k][sl], ref[f"{k}{i}"], rtol=1e-12, atol=1e-12)
        assert optax.tree.get(state, "residual")["w"].dtype == np.float64
