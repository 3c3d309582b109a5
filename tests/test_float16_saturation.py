"""float16 next to wider dtypes: saturation instead of inf, and what cannot be held refused.

A float16 leaf merged with float32 leaves (``granularity="global"``,
``groups=``) travels in the group's float32 message; its share of the update
is saturated at float16's largest finite value (65504) and the excess stays
in a residual: on one device its own, with an exchange every device's (the
excess is the same on each, so the residuals together keep N times what the
update could not hold). gTop-k and Ok-Topk return sums over devices to one
residual, which a float16 residual cannot hold: refused.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import mesh_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

F16_MAX = float(np.finfo(np.float16).max)


def _on_devices(tree, mesh):
    return jax.device_put(tree, NamedSharding(mesh, P("data")))


def _grads(n_dev, step):
    h = np.zeros((n_dev, 8), np.float16)
    h[:, 0] = 60000.0  # every step: past 65504 once accumulated twice
    f = np.zeros((n_dev, 100), np.float32)
    if step == 0:
        f[:, :10] = 1e6  # takes the whole capacity on step 0
    return {"h": jnp.asarray(h), "f": jnp.asarray(f)}


@pytest.mark.parametrize("grouping", [{"granularity": "global"}, {"groups": [["['h']", "['f']"]]}])
def test_one_device_float16_share_is_saturated_and_kept(grouping):
    tx = jaxcomp.top_k(10 / 108, **grouping)
    state = tx.init({k: v[0] for k, v in _grads(1, 0).items()})
    total = {"h": 0.0, "f": 0.0}
    for step in range(4):
        g = {k: v[0] for k, v in _grads(1, step).items()}
        old = {k: np.asarray(r, np.float64) for k, r in state.residual.items()}
        u, state = jax.jit(tx.update)(g, state)
        assert u["h"].dtype == jnp.float16 and np.all(np.isfinite(np.asarray(u["h"])))
        for k in g:
            new = np.asarray(state.residual[k], np.float64)
            inc = np.asarray(u[k], np.float64)
            np.testing.assert_array_equal(inc + new, old[k] + np.asarray(g[k], np.float64))
            total[k] += float(inc[0])
    assert total["h"] == 3 * F16_MAX  # 60000 each step: 65504 from step 1 on, the rest kept


@pytest.mark.parametrize("exchange", ["sparse", "dense", "gtopk", "oktopk"])
def test_exchanged_float16_share_is_saturated_and_nothing_lost(exchange):
    n_dev = 4
    mesh = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
    tx = jaxcomp.top_k(10 / 108, axis_name="data", exchange=exchange, granularity="global")
    state = _on_devices(jax.vmap(tx.init)(_grads(n_dev, 0)), mesh)
    step = mesh_update(tx, mesh)
    for i in range(3):
        g = _grads(n_dev, i)
        old = {k: np.asarray(r, np.float64) for k, r in state.residual.items()}
        u, state = step(_on_devices(g, mesh), state)
        for k in g:
            upd = np.asarray(u[k], np.float64)
            assert np.all(np.isfinite(upd)) and np.all(upd == upd[0])  # the same everywhere
            new = np.asarray(state.residual[k], np.float64)
            got = new.sum(0) + n_dev * upd[0]
            want = (old[k] + np.asarray(g[k], np.float64)).sum(0)
            np.testing.assert_array_equal(got, want)
        assert np.all(np.abs(np.asarray(u["h"], np.float64)) <= F16_MAX)


@pytest.mark.parametrize("exchange", ["gtopk", "oktopk"])
def test_float16_residual_with_a_summing_exchange_is_refused(exchange):
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = jaxcomp.top_k(
        0.25, axis_name="data", exchange=exchange, residual_dtype=jnp.float16, min_dense_size=0
    )
    g = _on_devices({"w": jnp.ones((2, 16), jnp.float16)}, mesh)
    with pytest.raises(ValueError, match="float16 residual cannot hold"):
        mesh_update(tx, mesh)(g, _on_devices(jax.vmap(tx.init)(g), mesh))


@pytest.mark.parametrize("exchange", ["gtopk", "oktopk"])
def test_bfloat16_residual_with_a_summing_exchange_runs(exchange):
    # bfloat16 has float32's range: nothing to refuse.
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = jaxcomp.top_k(
        0.25, axis_name="data", exchange=exchange, residual_dtype=jnp.bfloat16, min_dense_size=0
    )
    g = np.arange(32, dtype=np.float32).reshape(2, 16) - 15.0
    g = _on_devices({"w": jnp.asarray(g, jnp.bfloat16)}, mesh)
    state = _on_devices(jax.vmap(tx.init)(g), mesh)
    u, new = mesh_update(tx, mesh)(g, state)
    upd = np.asarray(u["w"], np.float64)
    assert np.all(upd == upd[0]) and np.any(upd != 0)
    got = np.asarray(new.residual["w"], np.float64).sum(0) + 2 * upd[0]
    np.testing.assert_array_equal(got, np.asarray(g["w"], np.float64).sum(0))


def _np_float16_mean(messages):
    """Reference 16-bit reduction: each message / N, partial sums in device order, saturated."""
    n_dev = messages.shape[0]
    total = np.zeros(messages.shape[1], np.float64)
    for m in messages:
        total = np.clip(total + m / n_dev, -F16_MAX, F16_MAX).astype(np.float16)
        total = total.astype(np.float64)
    return total


@pytest.mark.parametrize("error_feedback", [True, False])
@pytest.mark.parametrize("exchange", ["allgather", "allreduce", "server"])
def test_cast_float16_accumulation_saturates_and_keeps_the_excess(exchange, error_feedback):
    # Columns: a mean past 65504 (+ and -), one that passes it and comes back
    # in device order, one that fits. Every value / 4 is exact in float16 (the
    # leaf's message is scaled by 4), so the reference is exact.
    n_dev = 4
    col = np.array(
        [
            [98304, -98304, 98304, 3],
            [98304, -98304, 98304, -1000],
            [65536, -65536, 98304, 7],
            [32768, -32768, -98304, 1],
        ],
        np.float32,
    )
    g = np.tile(col, (1, 2))  # two chunks per device under "allreduce"
    mesh = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
    tx = jaxcomp.cast(
        jnp.float16,
        accumulation_dtype=jnp.float16,
        axis_name="data",
        exchange=exchange,
        error_feedback=error_feedback,
    )
    grads = _on_devices({"w": jnp.asarray(g)}, mesh)
    state = _on_devices(jax.vmap(tx.init)(grads), mesh)
    step = mesh_update(tx, mesh)
    u, state = step(grads, state)
    upd = np.asarray(u["w"], np.float64)
    want = _np_float16_mean(g.astype(np.float64))
    assert want[0] == F16_MAX and want[1] == -F16_MAX  # the reference saturates
    np.testing.assert_array_equal(upd, np.broadcast_to(want, upd.shape))
    if not error_feedback:
        return
    # Nothing lost: what the update could not hold stays in the residuals.
    res = np.asarray(state.residual["w"], np.float64)
    np.testing.assert_array_equal(res.sum(0) + n_dev * upd[0], g.astype(np.float64).sum(0))
    # ... and is sent on the next steps: with zero gradients the updates add up to the mean.
    total = upd[0].copy()
    zeros = _on_devices({"w": jnp.zeros_like(jnp.asarray(g))}, mesh)
    for _ in range(2):
        u, state = step(zeros, state)
        total += np.asarray(u["w"], np.float64)[0]
    np.testing.assert_array_equal(total, g.astype(np.float64).mean(0))
