"""jaxcomp.accordion against a numpy reference of Accordion (uw-mad-dash/Accordion).

The reference re-implements, in plain numpy, Accordion's per-layer rule
(``auto_scale.run_auto_scale_gng``: the first decision and a zero previous norm
give the low compression level; else ``|prev - cur| / prev < eta`` gives the
high one) on the norms of each layer's summed updates over an interval, and the
inner compressor it switches: top-k with error feedback (``R = e + g``, send the
``k`` largest ``|R|``, ``e = R - sent``) with one residual carried across the
switches. The synthetic gradients' norms change in known ways per interval, so
the levels are known; the test also checks them against the hand-derived ones.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Counted, cap_of, k_of, mesh_update, topk_set
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.distributed.skeleton import wire_bytes_total

N_DEV = 8
LOW, HIGH = 0.75, 0.25  # top-k ratios: low compression (critical), high compression
INTERVAL = 3
ETA = 0.5
SIZES = (16, 24, 20)
# Per interval, each leaf's gradient scale: leaf 0 steady (high from the third
# interval on), leaf 1 triples every interval (critical throughout), leaf 2 jumps
# fourfold in interval 4 (critical for interval 5 only).
SCALES = np.array(
    [
        [1.0, 1.0, 1.0, 1.0, 1.0, 1.0],
        [1.0, 3.0, 9.0, 27.0, 81.0, 243.0],
        [1.0, 1.0, 1.0, 4.0, 4.0, 4.0],
    ]
)
# Level used in each interval (0 low compression, 1 high), derived by hand from SCALES:
# intervals 1-2 low (the reference's first-epoch rule), then the relative changes.
EXPECTED_LEVELS = np.array(
    [
        [0, 0, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 1, 1, 0, -1],
    ]
)


def _gradients(num_devices: int = 1, seed: int = 0):
    """Per step, per leaf ``[num_devices, n]`` gradients: a fixed pattern times the interval's
    scale (distinct magnitudes: no top-k ties)."""
    rng = np.random.default_rng(seed)
    base = [rng.permutation(n * num_devices).reshape(num_devices, n) + 1.0 for n in SIZES]
    signs = [rng.choice([-1.0, 1.0], size=(num_devices, n)) for n in SIZES]
    steps = []
    for j in range(SCALES.shape[1]):
        for s in range(INTERVAL):
            jitter = 1.0 + 0.01 * s
            steps.append(
                [
                    (SCALES[i, j] * jitter * signs[i] * base[i] / n).astype(np.float32)
                    for i, n in enumerate(SIZES)
                ]
            )
    return steps


def _ref_topk(acc: np.ndarray, ratio: float) -> np.ndarray:
    """Top-k as jaxcomp.top_k sends it: every ``|acc|`` at or above the k-th largest (ties
    included), at most ``cap_of(k)`` of them (the largest, ties to the lower index)."""
    k = k_of(ratio, acc.size)
    sent = np.zeros_like(acc)
    idx = np.flatnonzero(topk_set(acc, k))
    if len(idx) > cap_of(k, acc.size):
        idx = idx[np.argsort(-np.abs(acc[idx]), kind="stable")[: cap_of(k, acc.size)]]
    sent[idx] = acc[idx]
    return sent


def _ref_decide(previous, current, first: bool) -> np.ndarray:
    """auto_scale.run_auto_scale_gng, per layer: 0 (low compression) or 1 (high)."""
    out = []
    for prev, cur in zip(previous, current, strict=True):
        if first or prev == 0.0:
            out.append(0)
        else:
            out.append(0 if not abs(prev - cur) / prev < ETA else 1)
    return np.array(out)


def _reference(steps, num_devices: int = 1):
    """Accordion over error-feedback top-k, one residual per device across switches.

    Returns per step: the levels used, the mean update per leaf, the residuals.
    """
    n_leaves = len(SIZES)
    level = np.zeros(n_leaves, int)
    residual = [np.zeros((num_devices, n), np.float32) for n in SIZES]
    accumulated = [np.zeros(n, np.float64) for n in SIZES]
    previous = np.zeros(n_leaves)
    out = []
    for t, grads in enumerate(steps):
        used = level.copy()
        updates = []
        for i in range(n_leaves):
            ratio = (LOW, HIGH)[used[i]]
            sent = np.stack(
                [_ref_topk(residual[i][d] + grads[i][d], ratio) for d in range(num_devices)]
            )
            residual[i] = (residual[i] + grads[i]) - sent
            update = sent.mean(axis=0, dtype=np.float64)
            accumulated[i] += update
            updates.append(update)
        if (t + 1) % INTERVAL == 0:
            current = np.array([np.linalg.norm(a) for a in accumulated])
            level = _ref_decide(previous, current, first=(t + 1) == INTERVAL)
            previous = current
            accumulated = [np.zeros_like(a) for a in accumulated]
        out.append((used, updates, [r.copy() for r in residual]))
    return out


def _tree(leaves):
    return {f"l{i}": jnp.asarray(x) for i, x in enumerate(leaves)}


def test_levels_and_updates_match_reference():
    steps = _gradients()
    ref = _reference([[g for g in s] for s in steps])
    tx = jaxcomp.accordion(jaxcomp.top_k, low=LOW, high=HIGH, interval=INTERVAL, eta=ETA)
    update = Counted(tx)
    state = tx.init(_tree([g[0] for g in steps[0]]))
    levels = []
    for t, grads in enumerate(steps):
        used = np.asarray(state.level)
        old_residual = [np.asarray(x) for x in jax.tree.leaves(state.residual)]
        g = [x[0] for x in grads]
        u, state = update(_tree(g), state)
        ref_used, ref_updates, ref_residual = ref[t]
        np.testing.assert_array_equal(used, ref_used)
        levels.append(used)
        u = jax.tree.leaves(u)
        residual = [np.asarray(x) for x in jax.tree.leaves(state.residual)]
        for i in range(len(SIZES)):
            np.testing.assert_array_equal(np.asarray(u[i]), ref_updates[i].astype(np.float32))
            np.testing.assert_array_equal(residual[i], ref_residual[i][0])
            # Nothing lost, at every step and so across every switch: bit for bit.
            np.testing.assert_array_equal(np.asarray(u[i]) + residual[i], old_residual[i] + g[i])
        # (int32 index, float32 value) pairs of the active level's message
        want_bytes = [8 * int(np.count_nonzero(x)) for x in ref_updates]
        np.testing.assert_array_equal(np.asarray(state.message_bytes), want_bytes)
        np.testing.assert_array_equal(8 * np.asarray(state.sent_count), want_bytes)
        np.testing.assert_array_equal(np.asarray(state.setting), np.take([LOW, HIGH], state.level))
    per_interval = np.array(levels)[::INTERVAL].T
    np.testing.assert_array_equal(per_interval[:2], EXPECTED_LEVELS[:2])
    # Leaf 2's sixth interval depends on how much residual the switch to low flushed.
    np.testing.assert_array_equal(per_interval[2, :5], EXPECTED_LEVELS[2, :5])
    assert update.traces == 1  # one compilation for every step and level


def test_shard_map_every_device_decides_the_same():
    steps = _gradients(N_DEV, seed=1)[: 4 * INTERVAL]
    ref = _reference(steps, N_DEV)
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tx = jaxcomp.accordion("top_k", low=LOW, high=HIGH, interval=INTERVAL, axis_name="data")
    run = mesh_update(tx, mesh)
    sh = NamedSharding(mesh, P("data"))
    put = lambda t: jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sh), t)  # noqa: E731
    one = tx.init(_tree([g[0] for g in steps[0]]))
    state = put(jax.tree.map(lambda a: np.stack([np.asarray(a)] * N_DEV), one))
    for t, grads in enumerate(steps):
        used = np.asarray(state.level)
        u, state = run(put(_tree(grads)), state)
        ref_used, ref_updates, ref_residual = ref[t]
        np.testing.assert_array_equal(used, np.broadcast_to(ref_used, used.shape))
        levels = np.asarray(state.level)
        assert (levels == levels[0]).all()  # the same decision on every device
        for i, x in enumerate(jax.tree.leaves(u)):
            x = np.asarray(x)
            assert (x == x[0]).all()
            # float32 mean of 8 messages vs float64: a few ulps of the largest value.
            np.testing.assert_allclose(x[0], ref_updates[i], rtol=0, atol=1e-6 * np.abs(x).max())
        for i, r in enumerate(jax.tree.leaves(state.residual)):
            np.testing.assert_array_equal(np.asarray(r), ref_residual[i])
    # Both instances' exchanges are on the wire: the low level's capacity plus the high one's.
    assert float(np.asarray(state.wire_bytes)[0]) > 0


def test_powersgd_levels_nothing_lost_across_a_switch():
    rng = np.random.default_rng(3)
    tx = jaxcomp.accordion(jaxcomp.powersgd, low=3, high=1, interval=1, min_dense_size=0)
    shape = (40, 30)
    state = tx.init({"w": jnp.zeros(shape)})
    update = jax.jit(tx.update)
    seen = set()
    for scale in (1.0, 1.0, 1.0, 10.0, 10.0, 10.0):
        g = (scale * rng.normal(size=shape)).astype(np.float32)
        old = np.asarray(state.residual["w"])
        lv = int(state.level[0])
        seen.add(lv)
        u, state = update({"w": jnp.asarray(g)}, state)
        np.testing.assert_allclose(
            np.asarray(u["w"]) + np.asarray(state.residual["w"]), old + g, rtol=1e-5, atol=1e-5
        )
        # P and Q at the active rank: (n + m) r float32 values.
        assert int(state.message_bytes[0]) == (40 + 30) * (3, 1)[lv] * 4
    assert seen == {0, 1}


def test_chain_multisteps_and_byte_fields():
    tx = optax.MultiSteps(
        optax.chain(
            jaxcomp.accordion(jaxcomp.top_k, low=0.5, high=0.25, interval=2), optax.sgd(1.0)
        ),
        every_k_schedule=2,
    )
    g = {"a": jnp.arange(1.0, 9.0), "b": jnp.arange(1.0, 5.0)}
    state = tx.init(g)
    update = jax.jit(tx.update)
    for _ in range(6):
        _, state = update(g, state)
    assert optax.tree.get(state, "message_bytes").shape == (2,)
    assert optax.tree.get(state, "level").shape == (2,)
    wire = optax.tree.get(state, "wire_bytes")
    assert float(wire_bytes_total(state)) == float(wire) == 0.0  # one device: no wire
    assert set(jaxcomp.residuals(state)) == {"a", "b"}


def test_empty_and_scalar_leaves():
    tx = jaxcomp.accordion(jaxcomp.top_k, low=1.0, high=0.5, interval=1)
    g = {"s": jnp.float32(2.0), "e": jnp.zeros((0,))}
    state = tx.init(g)
    for _ in range(3):
        old = float(state.residual["s"])
        u, state = tx.update(g, state)
        assert float(u["s"]) + float(state.residual["s"]) == old + 2.0
        assert u["e"].shape == (0,)
    # The empty leaf's norm is 0: critical (low level); the scalar's is steady: high.
    assert state.level.tolist() == [0, 1]


def test_nonfinite_gradient_skips_both_levels():
    # One leaf at each level; a NaN in the high-level leaf: the default policy
    # ("skip") sends nothing at either level and keeps every residual.
    tx = jaxcomp.accordion(jaxcomp.top_k, low=0.5, high=0.25, interval=1)
    update = jax.jit(tx.update)
    g = {"a": jnp.arange(1.0, 9.0), "b": jnp.arange(1.0, 9.0)}
    state = tx.init(g)
    for scale in (1.0, 1.0, 8.0):  # "a" triples in norm (critical), "b" steady
        _, state = update({"a": scale * g["a"], "b": g["b"]}, state)
    assert state.level.tolist() == [0, 1]
    old = jax.tree.map(np.asarray, state.residual)
    bad = {"a": g["a"], "b": g["b"].at[3].set(jnp.nan)}
    u, state = update(bad, state)
    for k in ("a", "b"):
        np.testing.assert_array_equal(np.asarray(u[k]), 0.0)
        np.testing.assert_array_equal(np.asarray(state.residual[k]), old[k])
    assert int(state.nonfinite_steps) == 1


def test_bfloat16_gradients_keep_the_rounding_in_the_residual():
    tx = jaxcomp.accordion(jaxcomp.top_k, low=0.5, high=0.25, interval=1)
    rng = np.random.default_rng(5)
    g = {"w": jnp.asarray(rng.normal(size=40), jnp.bfloat16)}
    state = tx.init(g)
    update = jax.jit(tx.update)
    for step in range(4):
        gs = {"w": (g["w"] * (1 + step)).astype(jnp.bfloat16)}
        old = np.asarray(state.residual["w"], np.float32)
        u, state = update(gs, state)
        assert u["w"].dtype == jnp.bfloat16
        res = np.asarray(state.residual["w"], np.float32)
        np.testing.assert_array_equal(
            np.asarray(u["w"], np.float32) + res, old + np.asarray(gs["w"], np.float32)
        )


def test_dgc_momentum_velocity_is_handed_over():
    """DGC's momentum correction (u = m u + g; R = e + u; send top-k of R; e = R - sent;
    u = 0 where sent), in numpy with one velocity and one residual across the switches."""
    m = 0.9
    tx = jaxcomp.accordion(jaxcomp.top_k, low=0.5, high=0.125, interval=1, momentum=m)
    update = jax.jit(tx.update)
    rng = np.random.default_rng(7)
    base = (rng.permutation(16) + 1.0).astype(np.float32) * rng.choice([-1.0, 1.0], 16)
    state = tx.init({"w": jnp.zeros(16)})
    u_ref = np.zeros(16, np.float32)
    e_ref = np.zeros(16, np.float32)
    levels = []
    for scale in (1.0, 1.0, 1.0, 4.0, 4.0, 4.0, 4.0):
        g = (scale * base).astype(np.float32)
        level = int(state.level[0])
        levels.append(level)
        u_ref = np.float32(m) * u_ref + g
        acc = e_ref + u_ref
        sent = _ref_topk(acc, (0.5, 0.125)[level])
        e_ref = acc - sent
        u_ref = np.where(sent != 0, np.float32(0), u_ref)
        out, state = update({"w": jnp.asarray(g)}, state)
        np.testing.assert_allclose(np.asarray(out["w"]), sent, rtol=1e-6)
        np.testing.assert_allclose(np.asarray(state.residual["w"]), e_ref, rtol=1e-6, atol=1e-6)
    assert set(levels) == {0, 1}  # both levels ran, with switches between them


def test_two_level_axis_is_rejected():
    with pytest.raises(ValueError, match="axis_name"):
        jaxcomp.accordion("top_k", low=0.5, high=0.1, interval=1, axis_name=("node", "local"))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"compressor": "no_such", "low": 0.5, "high": 0.1, "interval": 1}, "compressor"),
        ({"compressor": "qsgd", "low": 0.5, "high": 0.1, "interval": 1}, "compressor"),
        ({"compressor": "top_k", "low": 1.5, "high": 0.1, "interval": 1}, "low"),
        ({"compressor": "top_k", "low": 0.5, "high": 0.0, "interval": 1}, "high"),
        ({"compressor": "top_k", "low": 0.1, "high": 0.5, "interval": 1}, "high"),
        ({"compressor": "powersgd", "low": 2.5, "high": 1, "interval": 1}, "low"),
        ({"compressor": "top_k", "low": 0.5, "high": 0.1, "interval": 0}, "interval"),
        ({"compressor": "top_k", "low": 0.5, "high": 0.1, "interval": 2, "eta": 0}, "eta"),
        ({"compressor": "top_k", "low": 0.5, "high": 0.1, "interval": 2, "ratio": 0.3}, "ratio"),
    ],
)
def test_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        jaxcomp.accordion(**kwargs)


def test_reference_rule_on_known_norms():
    """The numpy rule itself on hand-computed norms (guards the reference)."""
    assert _ref_decide([0.0, 0.0], [1.0, 2.0], first=True).tolist() == [0, 0]
    assert _ref_decide([2.0, 2.0, 0.0], [1.0, 1.1, 3.0], first=False).tolist() == [0, 1, 0]
    assert math.isclose(abs(2.0 - 1.0) / 2.0, ETA)  # exactly eta: critical
