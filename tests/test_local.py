"""jaxcomp.comm.without_communication and jaxcomp.distributed.time_split.

Reference for the stand-ins: the real collective run with the *same* input on
every device returns exactly what the local stand-in returns (that is the
stand-ins' definition), so each is checked against the real collective.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist
from jaxcomp.comm import without_communication

N = 4
# XLA collective instructions in compiled HLO text.
_HLO_COLLECTIVE = re.compile(
    r"\b(all-gather|all-reduce|collective-permute|all-to-all|reduce-scatter|"
    r"collective-broadcast)(-start)?\("
)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def _both(fn, mesh, x, out_specs=None):
    """``fn`` and ``without_communication(fn)`` over ``mesh``, each device given ``x``."""
    out_specs = P() if out_specs is None else out_specs
    results, texts = [], []
    for f in (fn, without_communication(fn)):
        g = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(), out_specs=out_specs, check_vma=False))
        results.append(jax.device_get(g(x)))
        texts.append(g.lower(x).compile().as_text())
    return results, texts


# name -> function of one array run inside shard_map over "data".
COLLECTIVE_FNS = {
    "psum": lambda x: lax.psum(x, "data"),
    "pmean": lambda x: lax.pmean(x, "data"),
    "pmax": lambda x: lax.pmax(x, "data"),
    "pmin": lambda x: lax.pmin(x, "data"),
    "psum_tuple": lambda x: lax.psum((x, 2 * x), "data"),
    "ppermute": lambda x: lax.ppermute(x, "data", perm=[(i, (i + 1) % N) for i in range(N)]),
    "all_gather": lambda x: lax.all_gather(x, "data"),
    "all_gather_axis1": lambda x: lax.all_gather(x, "data", axis=1),
    "all_gather_tiled": lambda x: lax.all_gather(x, "data", tiled=True),
    "all_gather_invariant": lambda x: jaxcomp.comm.collectives.all_gather_invariant(x, "data"),
    "psum_scatter": lambda x: lax.psum_scatter(x, "data"),
    "psum_scatter_tiled": lambda x: lax.psum_scatter(x, "data", scatter_dimension=1, tiled=True),
    "all_to_all": lambda x: lax.all_to_all(x, "data", 0, 1),
    "all_to_all_tiled": lambda x: lax.all_to_all(x, "data", 1, 0, tiled=True),
    "int_psum": lambda x: lax.psum(x.astype(jnp.int32), "data"),
    "in_cond": lambda x: lax.cond(x[0, 0] > 0, lambda y: lax.psum(y, "data"), lambda y: y, x),
    "in_while": lambda x: lax.fori_loop(0, 3, lambda i, y: lax.pmean(y, "data") + 1.0, x),
    "in_scan": lambda x: lax.scan(lambda c, r: (c + lax.psum(r, "data"), r), x[0], x)[0],
    "in_jit": lambda x: jax.jit(lambda y: lax.all_gather(y, "data"))(x),
    "in_custom_jvp": lambda x: _custom_psum(x),
}


@jax.custom_jvp
def _custom_psum(x):
    return lax.psum(x, "data")


_custom_psum.defjvp(lambda primals, tangents: (_custom_psum(*primals), tangents[0]))


@pytest.mark.parametrize("name", sorted(COLLECTIVE_FNS))
def test_stand_in_equals_the_collective_on_identical_inputs(mesh, name):
    # Integer-valued floats: sums of N copies are exact either way.
    x = jnp.asarray(np.arange(N * 8).reshape(N, 8) % 7 - 3, jnp.float32)
    (real, local), (real_hlo, local_hlo) = _both(COLLECTIVE_FNS[name], mesh, x)
    assert _HLO_COLLECTIVE.search(real_hlo), "the reference must communicate"
    assert not _HLO_COLLECTIVE.search(local_hlo), _HLO_COLLECTIVE.search(local_hlo)
    for a, b in zip(jax.tree.leaves(real), jax.tree.leaves(local), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)


def test_scatter_stand_ins_take_each_devices_own_chunk(mesh):
    # Per-device outputs (out_specs P("data")) show the chunk is the device's.
    x = jnp.arange(N * 3, dtype=jnp.float32).reshape(N, 3)
    scatters = (
        lambda y: lax.psum_scatter(y, "data")[None],
        lambda y: lax.all_to_all(y, "data", 0, 0),
    )
    for fn in scatters:
        (real, local), _ = _both(fn, mesh, x, out_specs=P("data"))
        np.testing.assert_array_equal(real, local)


def test_optimization_barrier_keeps_the_stand_in_materialised(mesh):
    # sum over N gathered copies could fold to N * x without the barrier.
    fn = lambda x: lax.all_gather(x, "data").sum(0)  # noqa: E731
    _, (_, local_hlo) = _both(fn, mesh, jnp.ones((16,)))
    assert "opt-barrier" in local_hlo or "optimization_barrier" in local_hlo


def test_check_vma_true_is_rejected(mesh):
    f = jax.jit(
        jax.shard_map(
            without_communication(lambda x: lax.psum(x, "data")),
            mesh=mesh,
            in_specs=P("data"),
            out_specs=P(),
        )
    )
    x = jax.device_put(jnp.ones((N, 2)), NamedSharding(mesh, P("data")))
    with pytest.raises(ValueError, match="check_vma=False"):
        f(x)


def test_collective_without_a_stand_in_is_rejected(mesh):
    def fn(x):
        sizes = jnp.ones((N,), jnp.int32)
        offsets = jnp.arange(N, dtype=jnp.int32)
        return lax.ragged_all_to_all(
            x, jnp.zeros_like(x), offsets, sizes, offsets, sizes, axis_name="data"
        )

    f = jax.shard_map(
        without_communication(fn), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
    )
    with pytest.raises(ValueError, match="ragged_all_to_all"):
        jax.make_jaxpr(f)(jnp.ones((N,)))


def _regression(mesh, n_dev):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8 * n_dev, 16)).astype(np.float32)
    w = rng.normal(size=(16, 4)).astype(np.float32)
    batch = dist.shard_batch({"x": x, "y": x @ w}, mesh)
    params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    return loss, params, batch


COMPRESSORS = {
    "dense": lambda: jaxcomp.dense_exchange("data"),
    "ldte_bs": lambda: jaxcomp.ldte_bs(ratio=0.1, axis_name="data"),
    "top_k_groups_reuse": lambda: jaxcomp.top_k(
        ratio=0.1, axis_name="data", reuse_period=2, groups=[["['w']", "['b']"]]
    ),
    "qsgd": lambda: jaxcomp.qsgd(4, axis_name="data", min_dense_size=0),
    "onebit": lambda: jaxcomp.onebit(axis_name="data", min_dense_size=0),
}


@pytest.mark.parametrize("name", sorted(COMPRESSORS))
def test_one_device_step_without_communication_is_the_step(name):
    # With one device every stand-in returns what the collective returns, so
    # the step without communication is the same step, bit for bit.
    mesh1 = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    loss, params0, batch = _regression(mesh1, 1)
    tx = optax.chain(COMPRESSORS[name](), optax.sgd(0.1))
    outs = []
    for communicate in (True, False):
        params = dist.replicate(params0, mesh1)
        state = dist.init_opt_state(tx, params, mesh1)
        step = dist.make_train_step(loss, tx, mesh1, communicate=communicate)
        for _ in range(3):
            params, state, metrics = step(params, state, batch)
        outs.append(jax.device_get((params, state, metrics)))
    jax.tree.map(np.testing.assert_array_equal, outs[0], outs[1])


@pytest.mark.parametrize("overlap", [False, True])
def test_step_without_communication_has_no_collective(mesh, overlap):
    loss, params0, batch = _regression(mesh, N)
    tx = optax.chain(jaxcomp.ldte_bs(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    params = dist.replicate(params0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    texts = {}
    for communicate in (True, False):
        step = dist.make_train_step(
            loss, tx, mesh, communicate=communicate, overlap=overlap, donate=False
        )
        texts[communicate] = step.lower(params, state, batch).compile().as_text()
        new_params, new_state, _ = step(params, state, batch)
        assert jax.tree.map(jnp.shape, new_state) == jax.tree.map(jnp.shape, state)
    assert _HLO_COLLECTIVE.search(texts[True])
    assert not _HLO_COLLECTIVE.search(texts[False])


def test_time_split_parts_add_up_and_leave_the_state(mesh):
    loss, params0, batch = _regression(mesh, N)
    tx = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1, momentum=0.9))
    params = dist.replicate(params0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    before = jax.device_get((params, state))
    split = dist.time_split(loss, tx, mesh, params, state, batch, repeats=3)
    assert split.forward_backward > 0 and split.step > 0
    assert split.compression == max(split.step_without_communication - split.forward_backward, 0)
    assert split.communication == max(split.step - split.step_without_communication, 0)
    # The inputs were copied before each donated call: still valid, unchanged.
    jax.tree.map(np.testing.assert_array_equal, before, jax.device_get((params, state)))


def test_time_split_with_model_state_and_rng(mesh):
    loss_plain, params0, batch = _regression(mesh, N)

    def loss(p, b, model_state, rng):
        noise = 1e-3 * jax.random.normal(rng, b["y"].shape)
        value = loss_plain(p, b) + jnp.mean(noise)
        return value, {"count": model_state["count"] + 1.0}

    tx = optax.chain(jaxcomp.ldte_bs(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    params = dist.replicate(params0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    model_state = dist.replicate({"count": jnp.zeros(())}, mesh)
    split = dist.time_split(
        loss,
        tx,
        mesh,
        params,
        state,
        batch,
        model_state=model_state,
        rng=jax.random.key(0),
        mutable=True,
        repeats=1,
    )
    assert split.step > 0


def test_split_step_time_clips_noise():
    s = dist.split_step_time(2.0, 1.5, 1.4)
    assert (s.compression, s.communication) == (0.0, 0.0)
    s = dist.split_step_time(1.0, 1.25, 2.0)
    assert (s.compression, s.communication) == (0.25, 0.75)


@pytest.mark.parametrize("bad", [{"repeats": 0}, {"donate": False}])
def test_time_split_rejects_bad_arguments(mesh, bad):
    loss, params0, batch = _regression(mesh, N)
    tx = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    params = dist.replicate(params0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    with pytest.raises(ValueError, match="repeats|donate"):
        dist.time_split(loss, tx, mesh, params, state, batch, **bad)
