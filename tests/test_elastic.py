"""Elastic restart (jaxcomp.elastic): compressor state saved on N devices, restored on M.

References are numpy: the documented rule written as an assignment matrix,
the owed total ``(1/N) sum_i residual_i`` in float64, and for the "is the owed
mass really applied" check the parameter change of draining every residual
(one zero-gradient step that sends everything), predicted from the old state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh

import jaxcomp
import jaxcomp.elastic as elastic
from jaxcomp import cssgd
from jaxcomp import distributed as dist

AXIS = "data"
LR = 0.1
MOMENTUM = 0.9
F32_EPS = 2.0**-24  # one rounding to float32, relative


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]), (AXIS,))


def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def _zero_loss(p, b):
    """Gradient exactly zero: a step only sends what the state still owes."""
    del b
    return 0.0 * (jnp.sum(p["w"]) + jnp.sum(p["b"]))


def _params():
    rng = np.random.default_rng(0)
    return {
        "w": rng.normal(size=(12, 6)).astype(np.float32),
        "b": np.zeros(6, np.float32),
    }


def _batch(n_dev: int, seed: int, mesh: Mesh):
    rng = np.random.default_rng(seed)
    b = {
        "x": rng.normal(size=(2 * n_dev, 12)).astype(np.float32),
        "y": rng.normal(size=(2 * n_dev, 6)).astype(np.float32),
    }
    return dist.shard_batch(b, mesh)


def _train(tx, mesh, steps: int):
    n = mesh.shape[AXIS]
    params = dist.replicate(_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(_loss, tx, mesh, donate=False)
    for s in range(steps):
        params, state, metrics = step(params, state, _batch(n, s, mesh))
        jax.block_until_ready(metrics)
    return params, state


def _host(tree):
    return jax.tree.map(np.asarray, tree)


def _weights(n: int, m: int) -> np.ndarray:
    """The documented assignment as an (N, M) matrix of shares; rows sum to 1."""
    w = np.zeros((n, m))
    if m <= n:
        w[np.arange(n), np.arange(n) % m] = 1.0
    else:
        for j in range(m):
            w[j % n, j] = 1.0
        w /= w.sum(axis=1, keepdims=True)
    return w


def _fold_reference(old: np.ndarray, m: int) -> np.ndarray:
    n = old.shape[0]
    flat = old.reshape(n, -1).astype(np.float64)
    return ((m / n) * _weights(n, m).T @ flat).reshape(m, *old.shape[1:])


def _assert_owed_kept(old: np.ndarray, new: np.ndarray):
    """(1/M) sum_j new_j == (1/N) sum_i old_i up to one float32 rounding of the new values."""
    owed_old = old.astype(np.float64).mean(axis=0)
    owed_new = new.astype(np.float64).mean(axis=0)
    bound = F32_EPS * np.abs(new.astype(np.float64)).mean(axis=0) + 1e-300
    assert np.all(np.abs(owed_new - owed_old) <= bound), np.max(np.abs(owed_new - owed_old))
    assert np.any(owed_old != 0)  # a real check, not zeros against zeros


def _check_sparsify_fold(old_state, new_state, m: int):
    """Every field of a SparsifyState against the documented rule (numpy)."""
    n = np.asarray(old_state.step).shape[0]
    for field in ("residual", "velocity"):
        old_tree = getattr(old_state, field)
        if old_tree is None:
            assert getattr(new_state, field) is None
            continue
        for key in old_tree:
            old = np.asarray(old_tree[key])
            new = np.asarray(getattr(new_state, field)[key])
            assert new.shape == (m, *old.shape[1:]) and new.dtype == old.dtype
            np.testing.assert_allclose(new, _fold_reference(old, m), rtol=F32_EPS, atol=0)
            _assert_owed_kept(old, new)
    src = np.arange(m) % n
    # One entry per leaf (the last axis), per device (the first).
    np.testing.assert_array_equal(new_state.sent_count, np.asarray(old_state.sent_count)[src])
    np.testing.assert_array_equal(new_state.message_bytes, np.asarray(old_state.message_bytes)[src])
    assert np.asarray(new_state.threshold).shape == np.asarray(old_state.threshold)[src].shape
    assert np.all(np.isinf(np.asarray(new_state.threshold)))
    np.testing.assert_array_equal(new_state.wire_bytes, np.asarray(old_state.wire_bytes)[src])
    old_nf, new_nf = np.asarray(old_state.nonfinite_steps), np.asarray(new_state.nonfinite_steps)
    assert new_nf.sum() == old_nf.sum()
    for rep in ("step", "key"):
        old = np.asarray(getattr(old_state, rep))
        np.testing.assert_array_equal(getattr(new_state, rep), np.repeat(old[:1], m, axis=0))


def _assert_delta(delta, want, params):
    """``delta`` (a float32 parameter difference) equals ``want`` up to float32 roundings.

    The new parameters are rounded at the parameters' scale (2**-24 of |w|,
    twice counted), the mean of the messages at the update's.
    """
    for k in want:
        tol = 1e-5 * np.abs(want[k]) + 2.0**-23 * np.abs(np.asarray(params[k], np.float64))
        assert np.all(np.abs(delta[k] - want[k]) <= tol + 1e-12), (k, delta[k] - want[k])
        assert np.any(want[k] != 0)


def _drain_delta(tx_drain, params, state, mesh):
    """Parameter change of one zero-gradient step of ``tx_drain`` (sends everything)."""
    step = dist.make_train_step(_zero_loss, tx_drain, mesh, donate=False)
    n = mesh.shape[AXIS]
    new_params, _, metrics = step(params, state, _batch(n, 0, mesh))
    jax.block_until_ready(metrics)
    return {
        k: np.asarray(new_params[k], np.float64) - np.asarray(params[k], np.float64) for k in params
    }


# ---------------------------------------------------------------------------
# 8 -> 4 -> 8 through orbax checkpoints.
# ---------------------------------------------------------------------------


def test_ldte_bs_momentum_8_to_4_to_8(tmp_path):
    tx = optax.chain(
        jaxcomp.ldte_bs(ratio=0.1, axis_name=AXIS, momentum=MOMENTUM, reuse_period=2),
        optax.sgd(LR, momentum=MOMENTUM),
    )
    mesh8, mesh4 = _mesh(8), _mesh(4)
    params8, state8 = _train(tx, mesh8, steps=3)
    old = _host(state8)
    assert np.asarray(old[0].step)[0] == 3
    elastic.save(tmp_path / "a", 3, params8, state8)
    assert elastic.saved_devices(tmp_path / "a") == 8

    # Same device count: bit for bit, thresholds kept.
    _, same = elastic.restore(tmp_path / "a", 3, mesh8, tx, _params())
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(_host(same)), strict=True):
        np.testing.assert_array_equal(a, b)

    params4, state4 = elastic.restore(tmp_path / "a", 3, mesh4, tx, _params())
    for k in params4:
        np.testing.assert_array_equal(params4[k], params8[k])
        assert params4[k].sharding.mesh.shape[AXIS] == 4
    for leaf in jax.tree.leaves(state4):
        assert leaf.shape[0] == 4 and leaf.sharding.spec[0] == AXIS
        assert leaf.sharding.mesh.devices.size == 4
    new = _host(state4)
    _check_sparsify_fold(old[0], new[0], 4)
    # Halves: new_j = (old_j + old_{j+4}) / 2.
    r = np.asarray(old[0].residual["w"], np.float64)
    np.testing.assert_allclose(new[0].residual["w"], (r[:4] + r[4:]) / 2, rtol=F32_EPS)
    # optax's momentum of the averaged update: device 0's (the same everywhere).
    for k in ("w", "b"):
        np.testing.assert_array_equal(new[1][0].trace[k], np.repeat(old[1][0].trace[k][:1], 4, 0))

    # Training continues on 4 devices (the stored thresholds say: select afresh).
    step4 = dist.make_train_step(_loss, tx, mesh4, donate=False)
    _, after, metrics = step4(params4, state4, _batch(4, 7, mesh4))
    assert np.isfinite(float(metrics["loss"]))
    after = _host(after)
    assert np.all(after[0].step == 4)
    assert all(np.all(np.isfinite(t)) for t in jax.tree.leaves(after[0].threshold))

    # Back to 8: every device of 4 split over its two copies (a copy: exact).
    elastic.save(tmp_path / "b", 3, params4, state4)
    params8b, state8b = elastic.restore(tmp_path / "b", None, mesh8, tx, _params())
    back = _host(state8b)
    np.testing.assert_array_equal(params8b["w"], params8["w"])
    assert all(x.sharding.mesh.devices.size == 8 for x in jax.tree.leaves(state8b))
    _check_sparsify_fold(new[0], back[0], 8)
    for field in ("residual", "velocity"):
        for k in ("w", "b"):
            four = getattr(new[0], field)[k]
            np.testing.assert_array_equal(getattr(back[0], field)[k], np.concatenate([four, four]))
            # The owed total of the original 8 devices survives 8 -> 4 -> 8.
            _assert_owed_kept(getattr(old[0], field)[k], getattr(back[0], field)[k])

    # The owed mass is what gets applied: one zero-gradient step sending
    # everything (top_k at ratio 1, same state layout) moves the parameters by
    # -lr * (0.9 * trace + mean_i(residual_i + 0.9 * velocity_i)), from the old state.
    drain = optax.chain(
        jaxcomp.top_k(1.0, axis_name=AXIS, momentum=MOMENTUM), optax.sgd(LR, momentum=MOMENTUM)
    )
    want = {}
    for k in ("w", "b"):
        e = np.asarray(old[0].residual[k], np.float64).mean(0)
        u = np.asarray(old[0].velocity[k], np.float64).mean(0)
        trace = np.asarray(old[1][0].trace[k][0], np.float64)
        want[k] = -LR * (MOMENTUM * trace + e + MOMENTUM * u)
    _assert_delta(_drain_delta(drain, params4, state4, mesh4), want, _host(params4))


def test_qsgd_error_feedback_8_to_4_to_8(tmp_path):
    tx = optax.chain(
        jaxcomp.qsgd(bits=2, bucket_size=16, min_dense_size=0, error_feedback=True, axis_name=AXIS),
        optax.sgd(LR),
    )
    mesh8, mesh4 = _mesh(8), _mesh(4)
    params8, state8 = _train(tx, mesh8, steps=2)
    old = _host(state8)[0]
    assert isinstance(old, jaxcomp.QuantizeState)
    elastic.save(tmp_path, 2, params8, state8)
    params4, state4 = elastic.restore(tmp_path, 2, mesh4, tx, _params())
    new = _host(state4)[0]
    for k in ("w", "b"):
        o, n4 = np.asarray(old.residual[k]), np.asarray(new.residual[k])
        np.testing.assert_allclose(n4, _fold_reference(o, 4), rtol=F32_EPS, atol=0)
        _assert_owed_kept(o, n4)
        np.testing.assert_array_equal(new.message_bytes[k], old.message_bytes[k][:4])
    np.testing.assert_array_equal(new.key, np.repeat(old.key[:1], 4, axis=0))

    step4 = dist.make_train_step(_loss, tx, mesh4, donate=False)
    _, after, metrics = step4(params4, state4, _batch(4, 5, mesh4))
    assert np.isfinite(float(metrics["loss"])) and np.all(np.asarray(after[0].step) == 3)

    state8b = elastic.resize_opt_state(state4, 4, 8, mesh=mesh8)
    back = _host(state8b)[0]
    for leaf in jax.tree.leaves(state8b):
        assert leaf.shape[0] == 8 and leaf.sharding.spec[0] == AXIS
    for k in ("w", "b"):
        _assert_owed_kept(np.asarray(old.residual[k]), np.asarray(back.residual[k]))


def test_top_k_uneven_8_to_3_applies_the_owed_mass():
    """8 -> 3 (uneven: devices 0, 1 take three old ones, device 2 two)."""
    tx = optax.chain(jaxcomp.top_k(0.25, axis_name=AXIS), optax.sgd(LR))
    params8, state8 = _train(tx, _mesh(8), steps=2)
    old = _host(state8)[0]
    assert old.velocity is None
    mesh3 = _mesh(3)
    state3 = elastic.resize_opt_state(state8, 8, 3, mesh=mesh3)
    new = _host(state3)[0]
    _check_sparsify_fold(old, new, 3)
    r = np.asarray(old.residual["w"], np.float64)
    np.testing.assert_allclose(new.residual["w"][2], (3 / 8) * (r[2] + r[5]), rtol=F32_EPS)
    drain = optax.chain(jaxcomp.top_k(1.0, axis_name=AXIS), optax.sgd(LR))
    params3 = dist.replicate(_host(params8), mesh3)
    want = {k: -LR * np.asarray(old.residual[k], np.float64).mean(0) for k in ("w", "b")}
    _assert_delta(_drain_delta(drain, params3, state3, mesh3), want, _host(params8))


def test_zero_one_adam_4_to_3_keeps_the_owed_residual():
    """0/1 Adam (make_train_step: syncs every stage-2 step): residuals folded, the rest
    replicated; it had no rules (a misleading 'state of your own' error). Between the
    syncs of local steps the accumulator differs per device: refused, named."""
    tx = jaxcomp.zero_one_adam(LR, var_freeze_step=1, local_step_clipper=1, axis_name=AXIS)
    mesh3 = _mesh(3)
    params4, state4 = _train(tx, _mesh(4), steps=3)  # a variance step, then two 1-bit syncs
    old = _host(state4)
    state3 = elastic.resize_opt_state(state4, 4, 3, mesh=mesh3)
    new = _host(state3)
    for k in ("w", "b"):
        o, n3 = np.asarray(old.residual[k]), np.asarray(new.residual[k])
        np.testing.assert_allclose(n3, _fold_reference(o, 3), rtol=F32_EPS, atol=0)
        _assert_owed_kept(o, n3)
        for field in ("mu", "nu", "accumulator"):
            np.testing.assert_array_equal(
                getattr(new, field)[k], np.repeat(getattr(old, field)[k][:1], 3, axis=0)
            )
    assert int(new.nonfinite_steps.sum()) == int(old.nonfinite_steps.sum())
    assert new.count.tolist() == [3] * 3 and new.server_residual is None
    step3 = dist.make_train_step(_loss, tx, mesh3, donate=False)
    _, after, metrics = step3(dist.replicate(_host(params4), mesh3), state3, _batch(3, 5, mesh3))
    assert np.isfinite(float(metrics["loss"])) and np.all(np.asarray(after.count) == 4)

    moved = old.accumulator["b"] + np.arange(4, dtype=np.float32)[:, None]  # local steps taken
    local = old._replace(accumulator={**old.accumulator, "b": moved})
    with pytest.raises(ValueError, match=r"accumulator\['b'\] differs between devices"):
        elastic.resize_opt_state(local, 4, 3)


# ---------------------------------------------------------------------------
# The rule on synthetic states (no devices involved).
# ---------------------------------------------------------------------------


def _stacked(one, n):
    return jax.tree.map(lambda x: np.repeat(np.asarray(x)[None], n, axis=0), one)


def _random_sparsify_state(n: int, seed: int):
    tx = jaxcomp.ldte_bs(0.1, axis_name=AXIS, momentum=0.5)
    state = _stacked(tx.init(_params()), n)
    rng = np.random.default_rng(seed)

    def rand(tree, dtype=np.float32):
        return jax.tree.map(lambda x: rng.normal(size=x.shape).astype(dtype), tree)

    def ints(tree):
        return jax.tree.map(lambda x: rng.integers(0, 100, size=x.shape, dtype=np.int32), tree)

    return state._replace(
        step=np.full(n, 5, np.int32),
        residual=rand(state.residual),
        velocity=rand(state.velocity),
        sent_count=ints(state.sent_count),
        threshold=jax.tree.map(np.abs, rand(state.threshold)),
        message_bytes=ints(state.message_bytes),
        wire_bytes=rng.random(n).astype(np.float32),
        nonfinite_steps=rng.integers(0, 5, size=n, dtype=np.int32),
    )


@pytest.mark.parametrize("n, m", [(8, 3), (3, 8), (5, 2), (2, 7), (1, 4), (6, 1)])
def test_rule_against_assignment_matrix(n, m):
    old = _random_sparsify_state(n, seed=n * 10 + m)
    new = elastic.resize_opt_state(old, n, m)
    _check_sparsify_fold(old, new, m)
    # Cumulative counters: shrinking sums the assigned devices, growing keeps the
    # old devices' counts and starts the copies at 0 (totals kept either way).
    shares = _weights(n, m) > 0
    want = (
        (shares * old.nonfinite_steps[:, None]).sum(0)
        if m <= n
        else np.concatenate([old.nonfinite_steps, np.zeros(m - n, np.int32)])
    )
    np.testing.assert_array_equal(new.nonfinite_steps, want)
    owed = elastic.owed_updates(new)
    assert sorted(owed) == sorted(
        f".{f}['{k}']" for f in ("residual", "velocity") for k in ("b", "w")
    )
    np.testing.assert_allclose(
        owed[".residual['w']"],
        np.asarray(old.residual["w"], np.float64).mean(0),
        rtol=1e-6,
        atol=1e-7,
    )


def test_same_count_is_identity_and_float64_rounding():
    old = _random_sparsify_state(4, seed=1)
    same = elastic.resize_opt_state(old, 4, 4)
    for a, b in zip(jax.tree.leaves(old), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(a, b)  # thresholds kept too
    # bfloat16 residuals: one rounding to bfloat16 (2**-8 relative).
    bf = old._replace(residual=jax.tree.map(lambda x: x.astype(jnp.bfloat16), old.residual))
    new = elastic.resize_opt_state(bf, 4, 3)
    for k in ("w", "b"):
        got = np.asarray(new.residual[k], np.float64)
        ref = _fold_reference(np.asarray(bf.residual[k]), 3)
        np.testing.assert_allclose(got, ref, rtol=2.0**-8, atol=0)
        assert new.residual[k].dtype == jnp.bfloat16


def test_fold_that_leaves_the_dtype_range_is_refused():
    # 2 -> 3 devices scales device 1's row by 3/2: 50000 * 1.5 > float16's max.
    one = jaxcomp.top_k(0.5, axis_name=AXIS, residual_dtype=jnp.float16).init(
        {"w": jnp.zeros(2, jnp.float16)}
    )
    state = _stacked(one, 2)._replace(
        residual={"w": np.array([[50000, 1], [50000, 1]], np.float16)}
    )
    with pytest.raises(ValueError, match=r"residual\['w'\] \(float16\) from 2 onto 3.*range"):
        elastic.resize_opt_state(state, 2, 3)
    for m in (1, 4):  # a divisor or a multiple: means and shares stay in range
        new = elastic.resize_opt_state(state, 2, m)
        np.testing.assert_array_equal(
            np.asarray(new.residual["w"], np.float64), _fold_reference(state.residual["w"], m)
        )


def test_cssgd_state_counters_and_key():
    mesh = _mesh(8)
    coded, sgd_state = cssgd.init_opt_state(optax.sgd(LR, momentum=MOMENTUM), _params(), mesh)
    coded = _host(coded)._replace(
        clipped=np.arange(8, dtype=np.int32),
        nonfinite=np.arange(8, dtype=np.int32) * 2,
        wire_bytes=np.arange(8, dtype=np.float32) + 0.5,
    )
    new_coded, new_sgd = elastic.resize_opt_state((coded, sgd_state), 8, 3)
    np.testing.assert_array_equal(new_coded.clipped, [0 + 3 + 6, 1 + 4 + 7, 2 + 5])
    assert new_coded.nonfinite.sum() == coded.nonfinite.sum()
    np.testing.assert_array_equal(new_coded.wire_bytes, [0.5, 1.5, 2.5])
    np.testing.assert_array_equal(new_coded.key, np.repeat(coded.key[:1], 3, axis=0))
    assert new_sgd[0].trace["w"].shape == (3, 12, 6)


def test_custom_rules_and_unknown_varying_leaves():
    from typing import NamedTuple

    class AccState(NamedTuple):
        acc: np.ndarray
        count: np.ndarray

    state = AccState(acc=np.arange(8.0).reshape(4, 2), count=np.full(4, 3, np.int32))
    with pytest.raises(ValueError, match=r"\.acc differs between devices.*rules="):
        elastic.resize_opt_state(state, 4, 2)
    new = elastic.resize_opt_state(
        state, 4, 2, rules={AccState: {"acc": "fold", "count": "replicated"}}
    )
    np.testing.assert_allclose(new.acc, [[(0 + 4) / 2, (1 + 5) / 2], [(2 + 6) / 2, (3 + 7) / 2]])
    with pytest.raises(ValueError, match="no rule for AccState"):
        elastic.resize_opt_state(state, 4, 2, rules={AccState: {"acc": "fold"}})
    with pytest.raises(ValueError, match="must be one of"):
        elastic.resize_opt_state(state, 4, 2, rules={AccState: {"acc": "mean", "count": "copy"}})
    with pytest.raises(ValueError, match="NamedTuple"):
        elastic.resize_opt_state(state, 4, 2, rules={dict: {}})

    # optax.MultiSteps around a compressor accumulates local gradients: refused.
    ms = optax.MultiSteps(optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR)), 2)
    stacked = _stacked(ms.init(_params()), 4)
    acc = stacked.acc_grads
    acc["w"][1] += 1.0
    with pytest.raises(ValueError, match=r"acc_grads\['w'\] differs between devices"):
        elastic.resize_opt_state(stacked, 4, 2)


def test_replicated_leaves_checked():
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR, momentum=MOMENTUM))
    state = _stacked(tx.init(_params()), 4)
    trace = state[1][0].trace["w"]
    trace[:] = 1.0
    trace[2, 0, 0] = 1.0 + 1e-7
    with pytest.raises(ValueError, match=r"trace\['w'\] differs between devices \(exactly\)"):
        elastic.resize_opt_state(state, 4, 2)
    new = elastic.resize_opt_state(state, 4, 2, rtol=1e-6)
    np.testing.assert_array_equal(new[1][0].trace["w"], np.ones((2, 12, 6), np.float32))
    steps = state[0]._replace(step=np.array([1, 1, 2, 1], np.int32))
    with pytest.raises(ValueError, match=r"\.step differs between devices"):
        elastic.resize_opt_state((steps, state[1]), 4, 2, rtol=1e-6)


def test_replicated_check_treats_signed_zeros_and_nans_as_equal():
    # optax.MultiSteps at an accumulation boundary writes (1 - 1) * acc: -0.0
    # where acc < 0, so the all-zero accumulators differ in their sign bits.
    ms = optax.MultiSteps(optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR)), 2)
    stacked = _stacked(ms.init(_params()), 4)
    acc = stacked.acc_grads["w"]
    acc[1, 0, :3] = -0.0
    acc[3, 5, 0] = -0.0
    assert np.signbit(acc).sum() == 4 and np.all(acc == 0)
    new = elastic.resize_opt_state(stacked, 4, 2)
    np.testing.assert_array_equal(new.acc_grads["w"], np.zeros((2, 12, 6), np.float32))
    # NaN at the same place on every device is the same value; elsewhere not.
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR, momentum=MOMENTUM))
    state = _stacked(tx.init(_params()), 4)
    trace = state[1][0].trace["b"]
    trace[:, 2] = np.nan
    new = elastic.resize_opt_state(state, 4, 3)
    assert np.isnan(new[1][0].trace["b"][:, 2]).all()
    trace[1, 3] = np.nan
    with pytest.raises(ValueError, match=r"trace\['b'\] differs between devices \(exactly\)"):
        elastic.resize_opt_state(state, 4, 3)
    # Integer leaves stay bit for bit.
    steps = state[0]._replace(step=np.array([1, 1, 2, 1], np.int32))
    with pytest.raises(ValueError, match=r"\.step differs between devices"):
        elastic.resize_opt_state((steps, state[1]), 4, 2)


def test_rtol_accepts_equal_infinities():
    # reduce_on_plateau's best_value starts at +inf on every device: inf - inf
    # is NaN, which the tolerance test used to count as a difference.
    tx = optax.chain(
        jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR), optax.contrib.reduce_on_plateau()
    )
    state = _stacked(tx.init(_params()), 2)
    assert np.isposinf(state[2].best_value).all()
    new = elastic.resize_opt_state(state, 2, 1, rtol=1e-6)
    np.testing.assert_array_equal(new[2].best_value, np.full(1, np.inf, np.float32))
    for other in (-np.inf, 1e30):  # an unequal value is still refused
        state[2].best_value[1] = other
        with pytest.raises(ValueError, match=r"best_value differs between devices \(within"):
            elastic.resize_opt_state(state, 2, 1, rtol=1e-6)


def test_restore_with_a_sharded_optimizer_tx_says_to_pass_state_like(tmp_path):
    # tx.init of a sharded_optimizer shapes the owned slices under the mesh's
    # axis: traced outside shard_map it failed with "unbound axis name".
    from jax.sharding import PartitionSpec as P

    specs = {"w": P(AXIS, None), "b": P()}
    tx = dist.sharded_optimizer(jaxcomp.top_k(0.5, axis_name=AXIS), optax.adam(0.01), specs)
    mesh4 = _mesh(4)
    params = dist.place_params(_params(), mesh4, specs)
    state = dist.init_opt_state(tx, params, mesh4, param_specs=specs)
    elastic.save(tmp_path / "z", 1, params, state)
    with pytest.raises(ValueError, match="sharded_optimizer.*state_like="):
        elastic.restore(tmp_path / "z", 1, mesh4, tx, _params())


def test_sharded_optimizer_state_is_refused_and_its_compressor_resized():
    # ZeRO keeps each device's 1/N slice of the moments: another device count
    # needs other slices. Zero moments used to pass the replicated check and
    # come out N-device shaped ((2, 3, 6) instead of (2, 6, 6)).
    from jax.sharding import PartitionSpec as P

    specs = {"w": P(AXIS, None), "b": P()}
    tx = dist.sharded_optimizer(jaxcomp.top_k(0.5, axis_name=AXIS), optax.adam(0.01), specs)
    mesh4, mesh2 = _mesh(4), _mesh(2)
    state = dist.init_opt_state(
        tx, dist.place_params(_params(), mesh4, specs), mesh4, param_specs=specs
    )
    assert state.optimizer[0].mu["w"].shape == (4, 3, 6)
    with pytest.raises(ValueError, match="sharded_optimizer .*cannot be resized"):
        elastic.resize_opt_state(state, 4, 2)
    assert elastic.resize_opt_state(state, 4, 4) is not None  # nothing moves: allowed
    # What the message recommends: a fresh optimizer part, the compressor's resized.
    params2 = dist.place_params(_params(), mesh2, specs)
    fresh = dist.init_opt_state(tx, params2, mesh2, param_specs=specs)
    comp = _host(state.compressor)._replace(
        residual=jax.tree.map(
            lambda x: np.random.default_rng(0).normal(size=x.shape).astype(np.float32),
            _host(state.compressor.residual),
        )
    )
    new = fresh._replace(compressor=elastic.resize_opt_state(comp, 4, 2, mesh=mesh2))
    for k in ("w", "b"):
        _assert_owed_kept(comp.residual[k], np.asarray(new.compressor.residual[k]))
    step = dist.make_train_step(_loss, tx, mesh2, param_specs=specs, donate=False)
    _, new, metrics = step(params2, new, _batch(2, 0, mesh2))
    assert np.isfinite(float(metrics["loss"]))
    assert new.optimizer[0].mu["w"].shape == (2, 6, 6)


def test_bad_arguments():
    state = _random_sparsify_state(4, seed=2)
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(ValueError, match="new_devices"):
            elastic.resize_opt_state(state, 4, bad)
    with pytest.raises(ValueError, match="old_devices"):
        elastic.resize_opt_state(state, 0, 2)
    with pytest.raises(ValueError, match=r"old_devices=8 but leaf .* has shape \(4,\)"):
        elastic.resize_opt_state(state, 8, 2)
    with pytest.raises(ValueError, match="rtol"):
        elastic.resize_opt_state(state, 4, 2, rtol=-1.0)
    with pytest.raises(ValueError, match="new_devices=3 but the mesh's 'data' axis has 2"):
        elastic.resize_opt_state(state, 4, 3, mesh=_mesh(2))
    nan = state._replace(residual={**state.residual, "b": state.residual["b"].copy()})
    nan.residual["b"][1, 0] = np.nan
    with pytest.raises(ValueError, match=r"residual\['b'\] holds NaN"):
        elastic.resize_opt_state(nan, 4, 2)
    with pytest.raises(ValueError, match="has no array leaves"):
        elastic.resize_opt_state({}, 4, 2)
    with pytest.raises(ValueError, match="leading axis must be"):
        elastic.place_opt_state(state, _mesh(2))


def test_checkpoint_errors(tmp_path):
    mesh = _mesh(2)
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR))
    with pytest.raises(ValueError, match="same leading device axis"):
        elastic.save(tmp_path, 0, _params(), {"a": np.zeros((2, 3)), "b": np.zeros((3,))})
    with pytest.raises(ValueError, match="no checkpoint"):
        elastic.restore(tmp_path, None, mesh, tx, _params())
    state = _stacked(tx.init(_params()), 4)
    elastic.save(tmp_path, 1, _params(), state)  # host arrays save too
    with pytest.raises(ValueError, match="no checkpoint at step 2"):
        elastic.restore(tmp_path, 2, mesh, tx, _params())
    with pytest.raises(ValueError, match="exactly one of tx and state_like"):
        elastic.restore(tmp_path, 1, mesh, None, _params())
    other = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR, momentum=MOMENTUM))
    with pytest.raises(ValueError, match="does not match"):
        elastic.restore(tmp_path, 1, mesh, other, _params())
    # state_like: any stacked state of the right structure gives it.
    params, restored = elastic.restore(tmp_path, 1, mesh, None, _params(), state_like=state)
    assert jax.tree.leaves(restored)[0].shape[0] == 2
    np.testing.assert_array_equal(params["w"], _params()["w"])
    # A bare array as the parameters (orbax's StandardSave alone refuses one).
    elastic.save(tmp_path / "bare", 0, np.arange(3.0, dtype=np.float32), state)
    bare, _ = elastic.restore(
        tmp_path / "bare", 0, mesh, None, np.zeros(3, np.float32), state_like=state
    )
    np.testing.assert_array_equal(bare, [0.0, 1.0, 2.0])


def test_save_refuses_an_existing_or_earlier_step(tmp_path):
    # orbax skips a step that is not after its latest: a rerun into the same
    # directory used to write nothing, and restore returned the old run.
    mesh = _mesh(2)
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR))
    state = _stacked(tx.init(_params()), 2)
    old = _params()
    new = jax.tree.map(lambda x: x + 1.0, old)
    like = _params()
    elastic.save(tmp_path, 5, old, state)
    elastic.save(tmp_path, 10, old, state)
    for step in (10, 3):  # the same step, and one before the latest
        with pytest.raises(ValueError, match=r"already holds checkpoint step.*overwrite=True"):
            elastic.save(tmp_path, step, new, state)
    got, _ = elastic.restore(tmp_path, None, mesh, tx, like)
    np.testing.assert_array_equal(got["w"], old["w"])
    assert elastic.saved_devices(tmp_path, 5) == 2
    # overwrite=True deletes the steps >= step, then writes.
    elastic.save(tmp_path, 10, new, state, overwrite=True)
    got, _ = elastic.restore(tmp_path, None, mesh, tx, like)
    np.testing.assert_array_equal(got["w"], new["w"])
    got, _ = elastic.restore(tmp_path, 5, mesh, tx, like)
    np.testing.assert_array_equal(got["w"], old["w"])
    elastic.save(tmp_path, 3, new, state, overwrite=True)
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [3]
    got, _ = elastic.restore(tmp_path, None, mesh, tx, like)
    np.testing.assert_array_equal(got["w"], new["w"])
    with pytest.raises(ValueError, match="overwrite must be a bool"):
        elastic.save(tmp_path, 11, new, state, overwrite=1)


def test_readers_do_not_create_a_missing_directory(tmp_path):
    typo = tmp_path / "typo_ckpt"
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name=AXIS), optax.sgd(LR))
    with pytest.raises(ValueError, match=r"saved_devices: the checkpoint directory .* not exist"):
        elastic.saved_devices(typo)
    with pytest.raises(ValueError, match=r"restore: the checkpoint directory .* not exist"):
        elastic.restore(typo, None, _mesh(2), tx, _params())
    assert not typo.exists()
    with pytest.raises(ValueError, match="^saved_devices: no checkpoint in"):
        elastic.saved_devices(tmp_path)
