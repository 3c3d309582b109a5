"""DLGS threshold reuse (``reuse_period=s``, issue 9 item 1).

The selector runs on steps with ``step % s == 0`` (and on the first step of a
warm-up phase, and after a step that sent nothing); in between the stored
threshold ``H`` is applied, capped at the message capacity (first in index
order). A counting selector (``jax.debug.callback`` in its body, which runs
only when the selector is executed, not when traced) tells on which steps it
ran; the references are numpy: the exact top-k threshold of the accumulator
on refresh steps, ``|acc| > H`` truncated to the capacity on reuse steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    Counted,
    CountingTopK,
    abs32,
    bits,
    cap_of,
    check_step,
    f32,
    k_of,
    mesh_update,
    ref_threshold,
)
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist

SPEC = {"up": (600,), "down": (20, 25)}  # ratio 0.02: k = 12 / 10, capacity 18 / 15
RATIO = 0.02


def grads(step, rng):
    # "up" grows (a reused threshold overflows the capacity), "down" shrinks
    # (fewer than k above it): both sides of the reuse step are exercised.
    return {
        "up": jnp.asarray(rng.laplace(size=SPEC["up"]) * (1 + 0.6 * step), jnp.float32),
        "down": jnp.asarray(rng.laplace(size=SPEC["down"]) * 0.7**step, jnp.float32),
    }


def test_selector_runs_every_s_steps_and_reuse_matches_numpy():
    s = 3
    sel = CountingTopK()
    cx = Counted(jaxcomp.sparsify(sel, RATIO, reuse_period=s))
    rng = np.random.default_rng(0)
    state = cx.tx.init(grads(0, rng))
    stored = {}
    overflowed = fewer = False
    for step in range(9):
        g = grads(step, rng)
        before = sel.read()
        upd, new = cx(g, state)
        refresh = step % s == 0
        assert sel.read() - before == (len(SPEC) if refresh else 0), step
        stats = jaxcomp.statistics(new)
        for leaf, shape in SPEC.items():
            n = int(np.prod(shape))
            k, cap = k_of(RATIO, n), cap_of(k_of(RATIO, n), n)
            acc = np.asarray(state.residual[leaf]) + f32(g[leaf])
            if refresh:
                stored[leaf] = ref_threshold(acc, k)
            t = stored[leaf]
            assert np.float32(stats["threshold"][leaf]) == t, (step, leaf)
            count = int(stats["sent_count"][leaf])
            check_step(acc, upd[leaf], new.residual[leaf], t, cap, count)
            assert int(stats["message_bytes"][leaf]) == 8 * count
            if refresh:
                assert count == k
            else:
                assert int(stats["search_iterations"][leaf]) == 0
                overflowed |= int(np.sum(abs32(acc) > t)) > cap
                fewer |= count < k
        state = new
    assert overflowed and fewer  # the capacity cap and an under-full reuse step both ran
    assert cx.traces == 1


def test_warmup_refreshes_at_every_ratio_change():
    s, spe = 3, 2
    warm = (0.25, 0.05)
    sel = CountingTopK()
    cx = Counted(
        jaxcomp.sparsify(sel, 0.01, reuse_period=s, warmup_ratios=warm, steps_per_epoch=spe)
    )
    n = 400
    rng = np.random.default_rng(1)
    state = cx.tx.init({"w": jnp.zeros((n,), jnp.float32)})
    phases = [*warm, 0.01]
    refresh_steps = []
    for step in range(10):
        g = {"w": jnp.asarray(rng.laplace(size=n), jnp.float32)}
        before = sel.read()
        upd, new = cx(g, state)
        ran = sel.read() - before
        assert ran in (0, 1)
        if ran:
            refresh_steps.append(step)
        p = min(step // spe, len(phases) - 1)
        k = k_of(phases[p], n)
        acc = np.asarray(state.residual["w"]) + f32(g["w"])
        if ran:
            t = ref_threshold(acc, k)
        stats = jaxcomp.statistics(new)
        assert np.float32(stats["threshold"]["w"]) == t
        check_step(acc, upd["w"], new.residual["w"], t, cap_of(k, n), int(stats["sent_count"]["w"]))
        state = new
    # step % 3 == 0, and the first step of each phase (steps 0, 2 and 4).
    assert refresh_steps == [0, 2, 3, 4, 6, 9]
    assert cx.traces == 1


def test_skipped_step_then_refresh_with_momentum():
    """A non-finite step sends nothing and stores inf: the next step selects afresh."""
    s, m = 4, 0.9
    sel = CountingTopK()
    tx = jaxcomp.sparsify(sel, 0.05, reuse_period=s, momentum=m, momentum_masking=False)
    cx = Counted(tx)
    n = 300
    k, cap = k_of(0.05, n), cap_of(k_of(0.05, n), n)
    rng = np.random.default_rng(2)
    state = cx.tx.init({"w": jnp.zeros((n,), jnp.float32)})
    ran_at = []
    t = None
    for step in range(6):
        g = rng.laplace(size=n).astype(np.float32)
        if step == 2:
            g[17] = np.nan
        before = sel.read()
        upd, new = cx({"w": jnp.asarray(g)}, state)
        if sel.read() - before:
            ran_at.append(step)
        res_old, v_new = np.asarray(state.residual["w"]), np.asarray(new.velocity["w"])
        if step == 2:  # skipped: nothing sent, residual and velocity kept
            assert not np.any(f32(upd["w"]))
            assert bits(new.residual["w"]) == bits(state.residual["w"])
            assert bits(new.velocity["w"]) == bits(state.velocity["w"])
            assert np.isinf(np.float32(jaxcomp.statistics(new)["threshold"]["w"]))
        else:
            acc = res_old + v_new  # R = e + u, u = m u + g (the library's own u)
            if step in ran_at:
                t = ref_threshold(acc, k)
            stats = jaxcomp.statistics(new)
            assert np.float32(stats["threshold"]["w"]) == t
            check_step(acc, upd["w"], new.residual["w"], t, cap, int(stats["sent_count"]["w"]))
        state = new
    # 0 and 4 on schedule; 3 because step 2 sent nothing.
    assert ran_at == [0, 3, 4]
    assert cx.traces == 1


N_DEV = 8


@pytest.mark.parametrize("factory", [jaxcomp.top_k, jaxcomp.ldte_bs])
@pytest.mark.parametrize("nonzeros", [0, 3])
def test_step_with_fewer_than_k_nonzeros_makes_the_next_step_select(factory, nonzeros):
    """A first step with fewer than k nonzero values (a zero-initialised layer's
    gradient) stores threshold 0. Applied on the next (reuse) step it sent the
    first nonzeros in index order; the selector must run again there."""
    n, k = 1000, 10
    tx = factory(ratio=k / n, reuse_period=5)
    g0 = np.zeros(n, np.float32)
    g0[:nonzeros] = 1e-3
    g1 = np.full(n, 1e-3, np.float32)
    g1[900:910] = 100.0 + np.arange(10)
    step = jax.jit(tx.update)
    state = tx.init({"w": jnp.zeros(n)})
    u0, state = step({"w": jnp.asarray(g0)}, state)
    np.testing.assert_array_equal(np.asarray(u0["w"]), g0)  # the nonzeros it found, all
    assert float(jaxcomp.statistics(state)["threshold"]["w"]) == 0.0
    u1, state = step({"w": jnp.asarray(g1)}, state)
    want = np.zeros(n, np.float32)
    want[900:910] = g1[900:910]
    np.testing.assert_array_equal(np.asarray(u1["w"]), want)  # the k largest of r + g
    assert float(jaxcomp.statistics(state)["threshold"]["w"]) > 0.0


def test_shard_map_matches_single_device_reuse():
    """Under shard_map (extraction path): the mean of what each device alone sends.

    Device 3's gradient is non-finite at step 1, so at step 2 it selects
    afresh while the others reuse: devices disagree on the cond's predicate.
    """
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    kw = dict(reuse_period=3, min_dense_size=4)
    tx = jaxcomp.ldte_bs(0.05, axis_name="data", exchange="sparse", **kw)
    ref = Counted(jaxcomp.ldte_bs(0.05, **kw))

    def step(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], (u, s))

    f = jax.jit(
        jax.shard_map(
            step, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=(P("data"), P("data"))
        )
    )
    spec = {"w": (30, 20), "b": (4,)}
    zeros = {leaf: jnp.zeros(shape, jnp.float32) for leaf, shape in spec.items()}
    state = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx.init(zeros)), sharding)
    refs = [ref.tx.init(zeros) for _ in range(N_DEV)]
    rng = np.random.default_rng(3)
    for t in range(5):
        g = {
            leaf: rng.laplace(size=(N_DEV, *shape)).astype(np.float32)
            for leaf, shape in spec.items()
        }
        if t == 1:
            g["w"][3, 0, 0] = np.inf
        upd, new = f(jax.device_put(g, sharding), state)
        jax.block_until_ready((upd, new))
        sends = []
        thresholds = jaxcomp.statistics(new)["threshold"]  # leading axis: the devices
        for d in range(N_DEV):
            u_d, refs[d] = ref({leaf: jnp.asarray(v[d]) for leaf, v in g.items()}, refs[d])
            sends.append(u_d)
            for leaf in spec:
                assert bits(refs[d].residual[leaf]) == bits(np.asarray(new.residual[leaf])[d])
                alone = jaxcomp.statistics(refs[d])["threshold"][leaf]
                assert float(alone) == float(np.asarray(thresholds[leaf])[d])
        for leaf in spec:
            expected = np.mean([f32(u[leaf]) for u in sends], axis=0)
            np.testing.assert_allclose(np.asarray(upd[leaf])[0], expected, rtol=1e-6, atol=1e-7)
        thr = np.asarray(thresholds["w"])
        if t == 1:
            assert np.isinf(thr[3]) and np.all(np.isfinite(np.delete(thr, 3)))
        if t == 2:  # device 3 refreshed, the others kept step 0's threshold
            others = np.arange(N_DEV) != 3
            before = np.asarray(jaxcomp.statistics(state)["threshold"]["w"])
            np.testing.assert_array_equal(thr[others], before[others])
            assert np.isfinite(thr[3])
        state = new
    assert ref.traces == 1


def test_make_train_step_with_reuse():
    """The check_vma probe of make_train_step traces the reuse cond on invariant state."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data", reuse_period=2), optax.sgd(0.05))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((8 * N_DEV, 16)).astype(np.float32)
    batch = {"x": x, "y": (x @ rng.standard_normal(16)).astype(np.float32)}

    def loss_fn(params, batch):
        return jnp.mean((batch["x"] @ params["w"] + params["b"] - batch["y"]) ** 2)

    params = dist.replicate({"w": np.zeros(16, np.float32), "b": np.zeros((), np.float32)}, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh)
    losses, thresholds = [], []
    for _ in range(4):
        params, state, metrics = step(params, state, dist.shard_batch(batch, mesh))
        jax.block_until_ready((params, metrics))
        losses.append(float(metrics["loss"]))
        thresholds.append(np.asarray(jaxcomp.statistics(state)["threshold"]["w"]))
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(thresholds[1], thresholds[0])  # reuse step: kept
    assert not np.array_equal(thresholds[2], thresholds[1])  # refresh step


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2", 2**31, None])
def test_bad_reuse_period(value):
    if value is None:  # None means 1 (off)
        jaxcomp.ldte_bs(0.1, reuse_period=value)
        return
    # An int32 in the step arithmetic.
    with pytest.raises(ValueError, match=r"reuse_period must be an integer in \[1, 2147483647\]"):
        jaxcomp.ldte_bs(0.1, reuse_period=value)


def test_reuse_needs_a_threshold_selector():
    jaxcomp.random_k(0.1, reuse_period=1)
    with pytest.raises(ValueError, match="reuse_period must be 1 with an index-based selector"):
        jaxcomp.random_k(0.1, reuse_period=2)


def test_reuse_period_traced_points_at_static_args():
    g = {"w": jnp.arange(1.0, 51.0, dtype=jnp.float32)}
    tx = optax.inject_hyperparams(jaxcomp.top_k, static_args=("ratio",))(0.1, reuse_period=2)
    with pytest.raises(ValueError, match="reuse_period.*static_args"):
        jax.jit(tx.update)(g, tx.init(g))
    tx = optax.inject_hyperparams(jaxcomp.top_k, static_args=("ratio", "reuse_period"))(
        0.1, reuse_period=2
    )
    u, _ = jax.jit(tx.update)(g, tx.init(g))
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(u["w"])), np.arange(45, 50))


# ---------------------------------------------------------------------------
# capacity_factor="uncapped": the DLGS paper's reuse rule, nothing above H cut.
# ---------------------------------------------------------------------------


class PaperReuse:
    """numpy reference of the DLGS paper's Algorithm 1 with threshold reuse, one device.

    Per leaf: ``R = e + g``; on steps ``i % s == 0`` the layer threshold ``H``
    is recomputed by an exact top-k of ``|R|`` (the selection is ``|R| >= kth``,
    i.e. ``|R| > H`` with ``H`` the float32 just below the k-th magnitude, the
    library's convention for a threshold), otherwise the stored ``H`` is reused;
    every element with ``|R| > H`` is sent, whatever their number; ``e = R - S``.
    """

    def __init__(self, shapes, ratio, period):
        self.ratio, self.period = ratio, period
        self.e = {leaf: np.zeros(shape, np.float32) for leaf, shape in shapes.items()}
        self.h = {}

    def step(self, i, g):
        sent, counts = {}, {}
        for leaf, e in self.e.items():
            r = e + np.asarray(g[leaf], np.float32)
            if i % self.period == 0:
                kth = np.sort(np.abs(r).reshape(-1))[::-1][k_of(self.ratio, r.size) - 1]
                self.h[leaf] = np.nextafter(kth, np.float32(-np.inf))
            mask = np.abs(r) > self.h[leaf]
            sent[leaf] = np.where(mask, r, np.float32(0))
            self.e[leaf] = np.where(mask, np.float32(0), r)
            counts[leaf] = int(mask.sum())
        return sent, counts


@pytest.mark.parametrize("selector", ["top_k", "counting"])
def test_uncapped_reuse_matches_the_papers_rule(selector):
    """``capacity_factor="uncapped"``: on reuse steps everything above the stored
    threshold is sent (the packed path with "top_k", the 1-D path with a custom
    selector), the counts and message bytes report it; the default cap would
    have cut some of these steps."""
    s = 3
    fn = "top_k" if selector == "top_k" else CountingTopK()
    cx = Counted(jaxcomp.sparsify(fn, RATIO, reuse_period=s, capacity_factor="uncapped"))
    ref = PaperReuse(SPEC, RATIO, s)
    rng = np.random.default_rng(5)
    state = cx.tx.init(grads(0, rng))
    over_default_cap = 0
    for step in range(8):
        g = grads(step, rng)
        upd, state = cx(g, state)
        want, counts = ref.step(step, g)
        stats = jaxcomp.statistics(state)
        for leaf, shape in SPEC.items():
            n = int(np.prod(shape))
            assert bits(f32(upd[leaf])) == bits(want[leaf]), (step, leaf)
            assert bits(state.residual[leaf]) == bits(ref.e[leaf]), (step, leaf)
            assert int(stats["sent_count"][leaf]) == counts[leaf]
            assert int(stats["message_bytes"][leaf]) == 8 * counts[leaf]
            assert np.float32(stats["threshold"][leaf]) == ref.h[leaf]
            over_default_cap += counts[leaf] > cap_of(k_of(RATIO, n), n)
    assert over_default_cap >= 3  # the default capacity would have cut these steps
    assert cx.traces == 1


@pytest.mark.parametrize("exchange", ["auto", "allgather"])
def test_uncapped_reuse_on_8_devices_is_the_mean_of_the_papers_messages(exchange):
    """Under shard_map: the update is the mean over devices of each device's
    uncapped message (numpy reference per device), the residuals each device's.
    A capacity of the group size makes ``"auto"`` all-reduce dense."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    s = 2
    tx = jaxcomp.top_k(
        RATIO, axis_name="data", exchange=exchange, reuse_period=s, capacity_factor="uncapped"
    )
    refs = [PaperReuse(SPEC, RATIO, s) for _ in range(N_DEV)]
    zeros = {leaf: jnp.zeros(shape, jnp.float32) for leaf, shape in SPEC.items()}
    state = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tx.init(zeros)), sharding)
    update = mesh_update(tx, mesh)
    rng = np.random.default_rng(6)
    over_default_cap = 0
    for step in range(4):
        per_dev = [grads(step, rng) for _ in range(N_DEV)]
        g = {leaf: np.stack([np.asarray(p[leaf]) for p in per_dev]) for leaf in SPEC}
        upd, state = update(jax.device_put(g, sharding), state)
        out = [refs[d].step(step, per_dev[d]) for d in range(N_DEV)]
        stats = jaxcomp.statistics(state)
        for leaf, shape in SPEC.items():
            n = int(np.prod(shape))
            want = np.mean([o[0][leaf] for o in out], axis=0, dtype=np.float32)
            np.testing.assert_allclose(np.asarray(upd[leaf])[0], want, rtol=1e-6, atol=1e-7)
            counts = [o[1][leaf] for o in out]
            np.testing.assert_array_equal(np.asarray(stats["sent_count"][leaf]), counts)
            for d in range(N_DEV):
                assert bits(np.asarray(state.residual[leaf])[d]) == bits(refs[d].e[leaf])
            over_default_cap += sum(c > cap_of(k_of(RATIO, n), n) for c in counts)
    assert over_default_cap > 0


@pytest.mark.parametrize("value", ["paper", "Uncapped", 0.5, float("inf"), float("nan"), True])
def test_bad_capacity_factor(value):
    with pytest.raises(
        ValueError,
        match=r"capacity_factor must be a finite real number in \[1, inf\) or 'uncapped'",
    ):
        jaxcomp.top_k(0.1, reuse_period=2, capacity_factor=value)


@pytest.mark.parametrize("exchange", ["gtopk", "oktopk", "scalecom", "auto_topk"])
def test_uncapped_is_refused_by_the_global_selections(exchange):
    """Their global keep count is the capacity: uncapped would keep every summed entry."""
    with pytest.raises(ValueError, match=rf"capacity_factor='uncapped'.*exchange='{exchange}'"):
        jaxcomp.top_k(
            0.1, axis_name="data", exchange=exchange, reuse_period=2, capacity_factor="uncapped"
        )
    # A finite capacity keeps their global top-k; the exact exchanges take uncapped.
    jaxcomp.top_k(0.1, axis_name="data", exchange=exchange, capacity_factor=2.0)
    jaxcomp.top_k(0.1, axis_name="data", exchange="server", capacity_factor="uncapped")


# ---------------------------------------------------------------------------
# selector_options hint="previous": the stored threshold as the selector's hint.
# ---------------------------------------------------------------------------


def _hint_plus_one(x, k, hint=None):
    """A selector whose threshold is the hint + 1 (0.5 without a finite hint)."""
    h = jnp.asarray(hint, jnp.float32)
    t = jnp.where(jnp.isfinite(h), h + 1, jnp.float32(0.5))
    return jaxcomp.selection.Selection(t, jnp.sum(jnp.abs(x) > t, dtype=jnp.int32), jnp.int32(0))


@pytest.mark.parametrize("granularity", ["layer", "global"])
def test_hint_previous_passes_each_groups_stored_threshold(granularity):
    tx = jaxcomp.sparsify(
        _hint_plus_one,
        0.5,
        selector_options={"hint": "previous"},
        granularity=granularity,
        capacity_factor=2.0,
    )
    g = {"a": jnp.full((4,), 100.0), "b": jnp.full((6,), 100.0)}
    state = tx.init(g)
    step = jax.jit(tx.update)
    seen = []
    for grads in (g, g, {"a": g["a"] * jnp.nan, "b": g["b"]}, g, g):
        _, state = step(grads, state)
        # One entry per leaf ("layer"), one scalar for the whole tree ("global").
        assert np.shape(state.threshold) == ((2,) if granularity == "layer" else ())
        seen.append(np.asarray(state.threshold, np.float32))
    # 0.5 (no hint, inf, before the first step), 1.5; a skipped step stores inf, then 0.5, 1.5.
    expect = [0.5, 1.5, np.inf, 0.5, 1.5]
    for got, want in zip(seen, expect, strict=True):
        np.testing.assert_array_equal(got, np.float32(want))


def test_hint_previous_needs_a_selector_that_takes_a_hint():
    with pytest.raises(ValueError, match=r"selector_options \['hint'\] rejected.*hint"):
        jaxcomp.sparsify("top_k", 0.1, selector_options={"hint": "previous"})


def test_ldte_bs_hint_saves_the_probe_pass_under_error_feedback():
    """Fresh Laplace gradients each step: the residual is far from Laplacian, so the
    estimate misses and (without the hint) a probe pass follows on most steps;
    every step's update is the accumulator above the threshold (numpy)."""
    n, ratio = 1 << 17, 1e-3
    k, cap = k_of(ratio, n), cap_of(k_of(ratio, n), n)
    its = {}
    for hint in ("auto", None):
        tx = jaxcomp.ldte_bs(ratio, hint=hint)
        state, res = tx.init({"w": jnp.zeros(n)}), np.zeros(n, np.float32)
        step, its[hint] = jax.jit(tx.update), 0
        rng = np.random.default_rng(0)
        for _ in range(8):
            g = rng.laplace(size=n).astype(np.float32)
            u, state = step({"w": jnp.asarray(g)}, state)
            acc = res + g
            stats = jaxcomp.statistics(state)
            t = np.float32(stats["threshold"]["w"])
            check_step(acc, u["w"], state.residual["w"], t, cap, int(stats["sent_count"]["w"]))
            assert k <= int(stats["sent_count"]["w"]) <= cap
            res = np.asarray(state.residual["w"])
            its[hint] += int(stats["search_iterations"]["w"])
    assert its["auto"] < its[None], its
