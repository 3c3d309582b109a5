"""jaxcomp.comm.sparse_allreduce against numpy references on simulated devices.

Messages carry small integers so that every sum is exact in float32: the
nothing-lost identities are checked with equality, not tolerances.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.comm import sparse_allreduce as sa

SIZE = 512


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


def _messages(n_dev, cap, seed, *, fill=1.0, spread=SIZE, ties=False):
    """Per-device messages: unique indices (padding = SIZE), integer values."""
    rng = np.random.default_rng(seed)
    idx = np.full((n_dev, cap), SIZE, np.int32)
    val = np.zeros((n_dev, cap), np.float32)
    for d in range(n_dev):
        m = int(round(fill * cap))
        chosen = np.sort(rng.choice(spread, size=m, replace=False))
        idx[d, :m] = chosen
        if ties:
            val[d, :m] = rng.choice([-2.0, 2.0, 3.0], size=m)
        else:
            val[d, :m] = rng.integers(1, 1000, size=m) * rng.choice([-1, 1], size=m)
        perm = rng.permutation(cap)  # messages need not be sorted
        idx[d], val[d] = idx[d][perm], val[d][perm]
    return idx, val


def _run(fn, n_dev, idx, val):
    """fn(indices, values) -> Exchanged inside shard_map; per-device numpy results."""
    mesh = _mesh(n_dev)

    def body(i, v):
        ex = fn(i[0], v[0])
        out = [ex.update, ex.wire_bytes]
        if ex.returned_indices is not None:
            out += [ex.returned_indices, ex.returned_values]
        return [o[None] for o in out]

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P("data"), check_vma=False
        )
    )
    put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
    return [np.asarray(o) for o in jax.device_get(f(put(idx), put(val)))]


def _dense(idx, val):
    """Scatter-add of (n_dev, m) pairs into (n_dev, SIZE), padding dropped."""
    out = np.zeros((idx.shape[0], SIZE + 1), np.float64)
    for d in range(idx.shape[0]):
        np.add.at(out[d], idx[d], val[d])
    return out[:, :SIZE]


def _assert_nothing_lost(idx, val, update, back_idx, back_val, n_dev):
    sent = _dense(idx, val).sum(0)
    returned = _dense(back_idx, back_val).sum(0)
    got = n_dev * update[0].astype(np.float64) + returned
    if sa.is_power_of_two(n_dev):  # dividing by N is exact: so is the identity
        np.testing.assert_array_equal(got, sent)
    else:
        np.testing.assert_allclose(got, sent, rtol=1e-6)


def _gtopk_reference(idx, val, cap):
    """Recursive doubling in numpy: merge pairs, keep the top cap (ties: lower index)."""
    n_dev = idx.shape[0]
    msgs = [dict(zip(idx[d].tolist(), val[d].tolist(), strict=True)) for d in range(n_dev)]
    msgs = [{i: v for i, v in m.items() if i < SIZE} for m in msgs]
    for i in range(int(math.log2(n_dev))):
        new = []
        for d in range(n_dev):
            merged = dict(msgs[d])
            for j, v in msgs[d ^ (1 << i)].items():
                merged[j] = merged.get(j, 0.0) + v
            ranked = sorted(merged.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
            new.append(dict(ranked[:cap]))
        msgs = new
    out = np.zeros(SIZE)
    for j, v in msgs[0].items():
        out[j] = v / n_dev
    return out


@pytest.mark.parametrize(
    "n_dev, cap, fill", [(2, 16, 1.0), (4, 24, 0.8), (8, 32, 1.0), (8, 8, 0.5)]
)
def test_gtopk_matches_numpy_and_loses_nothing(n_dev, cap, fill):
    idx, val = _messages(n_dev, cap, seed=n_dev * cap, fill=fill, spread=3 * cap)
    update, wire, back_idx, back_val = _run(
        lambda i, v: sa.gtopk_mean(i, v, SIZE, "data"), n_dev, idx, val
    )
    for d in range(n_dev):  # identical on every device
        np.testing.assert_array_equal(update[d], update[0])
    np.testing.assert_array_equal(update[0], _gtopk_reference(idx, val, cap))
    _assert_nothing_lost(idx, val, update, back_idx, back_val, n_dev)
    assert wire[0] == math.log2(n_dev) * cap * 8


def test_gtopk_with_ties_loses_nothing():
    idx, val = _messages(8, 16, seed=5, spread=40, ties=True)
    update, _, back_idx, back_val = _run(
        lambda i, v: sa.gtopk_mean(i, v, SIZE, "data"), 8, idx, val
    )
    for d in range(8):
        np.testing.assert_array_equal(update[d], update[0])
    _assert_nothing_lost(idx, val, update, back_idx, back_val, 8)


@pytest.mark.parametrize("ties", [False, True])
def test_gtopk_segments_give_each_segment_what_gtopk_gives_it_alone(ties):
    # Three segments packed in one index range (segment s owns [s * SIZE,
    # (s + 1) * SIZE)), overlapping indices across devices (summed), tied
    # magnitudes: update, wire bytes and returned pairs as gtopk_mean alone.
    n_dev, caps = 4, (6, 3, 5)
    parts = [_messages(n_dev, c, seed=10 + s, spread=2 * c, ties=ties) for s, c in enumerate(caps)]
    size = len(caps) * SIZE
    idx = np.concatenate(
        [np.where(i < SIZE, i + s * SIZE, size) for s, (i, _) in enumerate(parts)], axis=1
    ).astype(np.int32)
    val = np.concatenate([v for _, v in parts], axis=1)
    update, wire, back_idx, back_val = _run(
        lambda i, v: sa.gtopk_mean_segments(i, v, size, "data", caps), n_dev, idx, val
    )
    rounds = int(math.log2(n_dev))
    assert wire[0] == rounds * sum(caps) * 8
    for s, (i, v) in enumerate(parts):
        u1, _, b_idx, b_val = _run(lambda i, v: sa.gtopk_mean(i, v, SIZE, "data"), n_dev, i, v)
        np.testing.assert_array_equal(update[:, s * SIZE : (s + 1) * SIZE], u1)
        # Returned pairs: each round's slots of this segment, as the segment's own.
        first = sum(caps[:s])
        for d in range(n_dev):
            for r in range(rounds):
                lo = r * sum(caps) + first
                got_i = back_idx[d, lo : lo + caps[s]]
                got_i = np.where(got_i < size, got_i - s * SIZE, SIZE)
                want = slice(r * caps[s], (r + 1) * caps[s])
                np.testing.assert_array_equal(got_i, b_idx[d, want])
                np.testing.assert_array_equal(back_val[d, lo : lo + caps[s]], b_val[d, want])


@pytest.mark.parametrize("n_dev, crowd", [(4, False), (3, True), (8, False)])
def test_oktopk_segments_give_each_segment_what_oktopk_gives_it_alone(n_dev, crowd):
    # Three segments of different sizes at offsets of a packed index range,
    # overlapping indices across devices (summed), one segment without slots;
    # crowd: device 0's pairs of segment 0 all in its first region (overflow
    # goes back). Update, wire bytes and returned pairs as oktopk_mean alone.
    caps, sizes, offsets = (6, 0, 9, 4), (40, 30, 96, 20), (0, 40, 80, 180)
    size = 256
    parts = []
    for s, (c, n) in enumerate(zip(caps, sizes, strict=True)):
        spread = min(2 * c + 3, n)
        i, v = _messages(n_dev, c, seed=20 + s, spread=spread)
        if crowd and s == 0:  # device 0 alone in the first region; the others high up
            i[0] = np.arange(c)
            i[1:] = np.where(i[1:] < SIZE, i[1:] + n - spread, SIZE)
        parts.append((np.where(i < SIZE, i, n).astype(np.int32), v))
    idx = np.concatenate(
        [np.where(i < n, i + o, size) for (i, _), n, o in zip(parts, sizes, offsets, strict=True)],
        axis=1,
    ).astype(np.int32)
    val = np.concatenate([v for _, v in parts], axis=1)
    update, wire, back_idx, back_val = _run(
        lambda i, v: sa.oktopk_mean_segments(i, v, size, "data", caps, offsets, sizes),
        n_dev, idx, val,
    )  # fmt: skip
    assert wire[0] == sum(sa.oktopk_wire_bytes(c, n_dev, 4) for c in caps if c)
    overflow = sum(caps)
    first_drop = first_slot = 0
    for (i, v), c, n, o in zip(parts, caps, sizes, offsets, strict=True):
        if not c:
            np.testing.assert_array_equal(update[:, o : o + n], 0)
            continue
        u1, _, b_idx, b_val = _run(lambda i, v, n=n: sa.oktopk_mean(i, v, n, "data"), n_dev, i, v)
        np.testing.assert_array_equal(update[:, o : o + n], u1)
        per_peer, per_region = sa.oktopk_capacities(c, n_dev)
        drops = n_dev * per_peer - per_region
        for d in range(n_dev):
            # Overflow: this segment's slots; dropped: its block after every overflow.
            for got, want in [
                (slice(first_slot, first_slot + c), slice(0, c)),
                (slice(overflow + first_drop, overflow + first_drop + drops), slice(c, None)),
            ]:
                got_i = back_idx[d, got]
                np.testing.assert_array_equal(np.where(got_i < size, got_i - o, n), b_idx[d, want])
                np.testing.assert_array_equal(back_val[d, got], b_val[d, want])
        first_slot += c
        first_drop += drops
    assert back_idx.shape[1] == overflow + first_drop
    if crowd:  # the overflow path ran
        assert (back_idx[0, : caps[0]] < size).any()


def test_gtopk_rejects_non_power_of_two():
    idx, val = _messages(3, 4, seed=0)
    with pytest.raises(ValueError, match="power-of-two"):
        _run(lambda i, v: sa.gtopk_mean(i, v, SIZE, "data"), 3, idx, val)


@pytest.mark.parametrize("n_dev", [3, 5, 8])
def test_oktopk_selects_the_top_of_each_region_and_loses_nothing(n_dev):
    cap = 24
    idx, val = _messages(n_dev, cap, seed=n_dev, spread=4 * cap)
    # Enough slack that nothing overflows: the kept sums are exact global sums.
    update, wire, back_idx, back_val = _run(
        lambda i, v: sa.oktopk_mean(i, v, SIZE, "data", slack=float(n_dev)), n_dev, idx, val
    )
    for d in range(n_dev):
        np.testing.assert_array_equal(update[d], update[0])
    _assert_nothing_lost(idx, val, update, back_idx, back_val, n_dev)
    total = _dense(idx, val).sum(0)
    kept = np.flatnonzero(update[0])
    np.testing.assert_allclose(n_dev * update[0][kept], total[kept], rtol=1e-6)
    per_peer, per_region = sa.oktopk_capacities(cap, n_dev, float(n_dev))
    # numpy reference: regions at the quantiles of the selected indices'
    # histogram (16 bins per device), each owner keeps its top per_region.
    bins = 16 * n_dev
    width = -(-SIZE // bins)
    live = idx[idx < SIZE]
    cdf = np.cumsum(np.bincount(live // width, minlength=bins))
    targets = [-(-j * cdf[-1] // n_dev) for j in range(1, n_dev)]
    starts = [0] + [min((np.searchsorted(cdf, t) + 1) * width, SIZE) for t in targets] + [SIZE]
    want = set()
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        region = [j for j in range(lo, hi) if j in set(live.tolist())]
        ranked = sorted(region, key=lambda j: (-abs(total[j]), j))
        want |= set(ranked[:per_region])
    assert set(kept.tolist()) == {j for j in want if total[j] != 0}
    hist = sa._BINS_PER_DEVICE * n_dev * 4
    expected = (n_dev - 1) * (per_peer + per_region) * 8 + 2 * (n_dev - 1) / n_dev * hist
    np.testing.assert_allclose(wire[0], expected, rtol=1e-6)


def test_oktopk_overflow_goes_back_to_the_sender():
    # Every device's pairs crowd one region: the default slack overflows.
    n_dev, cap = 4, 32
    idx, val = _messages(n_dev, cap, seed=1, spread=SIZE)
    idx[0, :] = np.arange(cap)  # device 0 sends 32 low indices
    update, _, back_idx, back_val = _run(
        lambda i, v: sa.oktopk_mean(i, v, SIZE, "data"), n_dev, idx, val
    )
    _assert_nothing_lost(idx, val, update, back_idx, back_val, n_dev)
    for d in range(n_dev):
        np.testing.assert_array_equal(update[d], update[0])


@pytest.mark.parametrize("n_dev, fill", [(2, 1.0), (8, 0.1), (8, 1.0)])
def test_sparcml_is_the_exact_mean_on_both_branches(n_dev, fill):
    cap = 64
    idx, val = _messages(n_dev, cap, seed=n_dev, fill=fill, spread=SIZE)
    update, wire = _run(lambda i, v: sa.sparcml_mean(i, v, SIZE, "data"), n_dev, idx, val)
    np.testing.assert_array_equal(n_dev * update[0].astype(np.float64), _dense(idx, val).sum(0))
    union = sa.sparcml_union_capacity(cap, SIZE, n_dev, 4)
    total = int((idx < SIZE).sum())
    count_bytes = 2 * (n_dev - 1) / n_dev * 4
    if total <= union:  # the sparse rounds: sum_i min(2^i cap, U) pairs
        rounds = sum(min(cap << i, union) for i in range(int(math.log2(n_dev))))
        np.testing.assert_allclose(wire[0], rounds * 8 + count_bytes, rtol=1e-6)
    else:
        dense = 2 * (n_dev - 1) / n_dev * SIZE * 4
        np.testing.assert_allclose(wire[0], dense + count_bytes, rtol=1e-6)


def test_sparcml_takes_each_branch():
    # 8 devices, 64 pairs each of a 512-element tensor: U is below 8 * 64.
    union = sa.sparcml_union_capacity(64, SIZE, 8, 4)
    assert 64 <= union < 8 * 64
    assert sa.sparcml_union_capacity(4, 2**22, 8, 4) == 32  # tiny messages: always sparse


def test_cyclic_leader_rotates_and_is_exact():
    n_dev, cap = 4, 8
    rng = np.random.default_rng(0)
    acc = rng.integers(-50, 50, size=(n_dev, SIZE)).astype(np.float32)
    idx, _ = _messages(n_dev, cap, seed=3)
    mesh = _mesh(n_dev)
    for step in range(n_dev + 1):

        def body(i, a, step=step):
            ex, shared = sa.cyclic_mean(
                i[0],
                lambda ids: jnp.where(ids < SIZE, a[0][jnp.minimum(ids, SIZE - 1)], 0),
                SIZE,
                "data",
                jnp.int32(step),
            )
            return ex.update[None], shared[None]

        f = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("data"), P("data")),
                out_specs=P("data"),
                check_vma=False,
            )
        )
        put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))  # noqa: E731
        update, shared = jax.device_get(f(put(idx), put(acc)))
        leader = step % n_dev
        for d in range(n_dev):
            np.testing.assert_array_equal(np.sort(shared[d]), np.sort(idx[leader]))
        want = np.zeros(SIZE)
        live = idx[leader][idx[leader] < SIZE]
        want[live] = acc[:, live].sum(0) / n_dev
        np.testing.assert_array_equal(update[0], want)


@pytest.mark.parametrize(
    "name, n_dev, want",
    [
        ("auto", 8, "allgather"),
        ("auto", 2048, "dense"),
        ("auto", 6, "allgather"),
        ("auto_topk", 8, "oktopk"),
        ("auto_topk", 2, "allgather"),  # a tie: the exact one
        ("gtopk", 8, "gtopk"),
        ("sparse", 8, "allgather"),  # an alias: reported by its canonical name
    ],
)
def test_choose_exchange(name, n_dev, want):
    assert sa.choose_exchange(name, 4195, 2**22, 4, n_dev) == want


def test_auto_never_picks_an_approximate_exchange():
    for n_dev in (2, 3, 8, 64, 1000):
        for cap in (1, 100, 10_000, 2**20):
            assert sa.choose_exchange("auto", cap, 2**22, 4, n_dev) in sa.EXACT_EXCHANGES


@pytest.mark.parametrize("name", ["gtopk", "auto_topk"])
def test_include_rejected_by_approximate_exchanges(name):
    """Named as asked: auto_topk, whichever exchange it would resolve to."""
    idx, val = _messages(2, 4, seed=0)
    with pytest.raises(ValueError, match=f"exchange='{name}' does not take include="):
        _run(
            lambda i, v: sa.exchange(name, i, v, SIZE, "data", include=jnp.bool_(True)),
            2,
            idx,
            val,
        )


# ---------------------------------------------------------------------------
# Through the sparsifiers: exchange=...
# ---------------------------------------------------------------------------


def _compress_on_devices(tx, grads, n_dev, steps=2):
    """Runs ``tx`` on each device's gradient for ``steps``; per-device results."""

    mesh = _mesh(n_dev)

    def body(g):
        g = g[0]
        state = tx.init(g)
        res_before = []
        updates = []
        for _ in range(steps):
            res_before.append(state.residual)
            u, state = tx.update(g, state)
            updates.append(u)
        res_after = state.residual
        return [x[None] for x in (*res_before, res_after, *updates)]

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    out = jax.device_get(f(jax.device_put(grads, NamedSharding(mesh, P("data")))))
    return out[:steps], out[steps], out[steps + 1 :]


@pytest.mark.parametrize(
    "exchange, n_dev",
    [
        ("gtopk", 8),
        ("oktopk", 8),
        ("oktopk", 6),
        ("scalecom", 4),
        ("sparcml", 8),
        ("server", 4),
        ("auto_topk", 8),
    ],
)
def test_sparsifier_exchanges_lose_nothing(exchange, n_dev):
    import jaxcomp  # noqa: PLC0415

    rng = np.random.default_rng(n_dev)
    grads = rng.integers(-64, 64, size=(n_dev, 2048)).astype(np.float32)
    tx = jaxcomp.top_k(ratio=0.01, axis_name="data", exchange=exchange)
    res_before, res_after, updates = _compress_on_devices(tx, grads, n_dev, steps=2)
    for u in updates:  # the update is the same on every device
        for d in range(n_dev):
            np.testing.assert_array_equal(u[d], u[0])
        assert np.count_nonzero(u[0]) > 0
    # Second step: sum_d new residual + N * update == sum_d (old residual + g).
    lhs = res_after.astype(np.float64).sum(0) + n_dev * updates[1][0].astype(np.float64)
    rhs = res_before[1].astype(np.float64).sum(0) + grads.astype(np.float64).sum(0)
    if sa.is_power_of_two(n_dev):
        np.testing.assert_array_equal(lhs, rhs)
    else:
        np.testing.assert_allclose(lhs, rhs, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("exchange", ["scalecom", "gtopk", "oktopk"])
def test_low_pass_filters_what_the_exchange_leaves(exchange):
    """ScaleCom's low-pass filter (beta = 0.5) on 4 devices: each residual is
    r + beta (r_ef - r), with r_ef the plain error-feedback residual, what the
    exchange gave back included, that loses nothing: sum_d r_ef + N * update
    == sum_d (r + g), exactly (halves and quarters of integers)."""
    n_dev, beta = 4, 0.5
    rng = np.random.default_rng(5)
    grads = rng.integers(-64, 64, size=(n_dev, 2048)).astype(np.float32)
    tx = jaxcomp.top_k(ratio=0.01, axis_name="data", exchange=exchange, low_pass=beta)
    res_before, res_after, updates = _compress_on_devices(tx, grads, n_dev, steps=2)
    r = res_before[1].astype(np.float64)
    plain = r + (res_after.astype(np.float64) - r) / beta
    lhs = plain.sum(0) + n_dev * updates[1][0].astype(np.float64)
    np.testing.assert_array_equal(lhs, r.sum(0) + grads.astype(np.float64).sum(0))
    # The filter acted: half of the unsent part was dropped.
    assert not np.array_equal(res_after, plain.astype(np.float32))


def _steps_on_devices(tx, grads_by_step, n_dev):
    """``tx`` on each device's row of every step's gradient: per-device updates and states."""
    mesh = _mesh(n_dev)
    step = mesh_update(tx, mesh)
    sharded = lambda t: jax.device_put(t, NamedSharding(mesh, P("data")))  # noqa: E731
    first = jax.tree.map(lambda a: a[0], grads_by_step[0])
    state = sharded(jax.tree.map(lambda a: np.stack([a] * n_dev), tx.init(first)))
    out = []
    for g in grads_by_step:
        u, state = step(sharded(g), state)
        out.append(jax.device_get((u, state)))
    return out


@pytest.mark.parametrize("exchange", [None, "sparse", "gtopk"])
def test_float16_message_saturates_and_the_residual_stays_finite(exchange):
    # 40000 + 40000 is past float16's largest value (65504): the wire value saturates,
    # the rest stays in the float32 residual and goes on the next step (it was
    # inf, and the residual -inf, then NaN for good).
    n, n_dev = 20, 2
    g0 = np.zeros(n, np.float16)
    g0[0], g0[1:4] = 40000, 60000
    g1 = np.zeros(n, np.float16)
    g1[0] = 40000
    g2 = np.zeros(n, np.float16)
    g2[6] = 1
    steps = [g0, g1, g2, g2]
    axis = None if exchange is None else "data"
    tx = jaxcomp.top_k(0.1, axis_name=axis, **({} if exchange is None else {"exchange": exchange}))
    if exchange is None:
        state, outs = tx.init({"w": jnp.asarray(g0)}), []
        for g in steps:
            u, state = tx.update({"w": jnp.asarray(g)}, state)
            outs.append(jax.device_get((u["w"], state.residual["w"])))
    else:  # the same gradient on both devices: the mean is each device's message
        outs = [
            (u["w"][0], st.residual["w"][0])
            for u, st in _steps_on_devices(tx, [{"w": np.stack([g] * n_dev)} for g in steps], n_dev)
        ]
    residual = np.zeros(n, np.float64)
    for g, (u, r) in zip(steps, outs, strict=True):
        acc = residual + g.astype(np.float64)
        assert u.dtype == np.float16 and np.all(np.isfinite(u)) and np.all(np.isfinite(r))
        # Nothing lost: what went plus what stayed is the accumulator.
        np.testing.assert_array_equal(u.astype(np.float64) + r, acc)
        residual = r.astype(np.float64)
    assert [float(u[0]) for u, _ in outs] == [0.0, 65504.0, 80000.0 - 65504.0, 0.0]


@pytest.mark.parametrize("exchange", [e for e in sa.EXCHANGES if e != "scatter"])
def test_float16_mean_does_not_overflow_where_it_fits(exchange):
    # Every device sends 16384 at index 3: the mean fits float16, the sum of the
    # 8 messages (131072) does not. The exchanges that add before dividing (gTop-k,
    # Ok-Topk, SparCML, ScaleCom, dense) returned inf; float16 is divided first.
    n_dev, n = 8, 512
    g = np.random.default_rng(0).uniform(-1, 1, size=(n_dev, n)).astype(np.float16)
    g[:, 3] = 16384
    tx = jaxcomp.top_k(0.01, axis_name="data", exchange=exchange, min_dense_size=0)
    ((u, state),) = _steps_on_devices(tx, [{"w": g}], n_dev)
    assert u["w"].dtype == np.float16
    assert np.all(np.isfinite(u["w"])) and np.all(np.isfinite(state.residual["w"]))
    np.testing.assert_array_equal(u["w"][:, 3], np.full(n_dev, 16384, np.float16))


def test_scalecom_device_that_skips_sends_nothing_and_keeps_its_residual():
    n_dev, n, ratio = 4, 40, 0.1
    rng = np.random.default_rng(0)
    g0 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1[2, 0] = np.nan  # device 2 skips step 1 (device 1 leads it)
    tx = jaxcomp.top_k(ratio, axis_name="data", exchange="scalecom")
    (_, s0), (u1, s1) = _steps_on_devices(tx, [{"w": g0}, {"w": g1}], n_dev)
    r0, r1 = s0.residual["w"].astype(np.float64), s1.residual["w"].astype(np.float64)
    np.testing.assert_array_equal(r1[2], r0[2])
    assert jaxcomp.statistics(s1)["sent_count"]["w"].tolist() == [4, 4, 0, 4]
    # The others' accumulators at the leader's indices (its top-4), over N.
    acc = r0 + np.where(np.isnan(g1), 0, g1)
    lead = np.argsort(-np.abs(acc[1]), kind="stable")[:4]
    ref = np.zeros(n)
    ref[lead] = acc[[0, 1, 3]][:, lead].sum(0) / n_dev
    for d in range(n_dev):
        np.testing.assert_array_equal(u1["w"][d], ref)
    for d in (0, 1, 3):  # what they sent left their residuals
        np.testing.assert_array_equal(r1[d][lead], 0)


def test_scalecom_leader_that_skips_applies_nothing():
    n_dev, n = 4, 40
    rng = np.random.default_rng(1)
    g0 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1[1, 3] = np.inf  # device 1 leads step 1 and skips it
    tx = jaxcomp.top_k(0.1, axis_name="data", exchange="scalecom")
    (_, s0), (u1, s1) = _steps_on_devices(tx, [{"w": g0}, {"w": g1}], n_dev)
    r0, r1 = s0.residual["w"], s1.residual["w"]
    assert not np.any(u1["w"])
    np.testing.assert_array_equal(r1[1], r0[1])
    for d in (0, 2, 3):  # no indices: each keeps its whole accumulator
        np.testing.assert_array_equal(r1[d], r0[d] + g1[d])


@pytest.mark.parametrize("exchange", ["gtopk", "oktopk"])
def test_device_that_skips_loses_nothing_and_stays_finite(exchange):
    """A skipping device sends nothing but still owns what its group or region
    leaves: its residual may change, by finite sums, and nothing is lost."""
    n_dev, n = 4, 64
    rng = np.random.default_rng(2)
    g0 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1 = rng.integers(-100, 100, size=(n_dev, n)).astype(np.float32)
    g1[0, 5] = np.nan
    tx = jaxcomp.top_k(0.1, axis_name="data", exchange=exchange)
    (_, s0), (u1, s1) = _steps_on_devices(tx, [{"w": g0}, {"w": g1}], n_dev)
    r0, r1 = s0.residual["w"].astype(np.float64), s1.residual["w"].astype(np.float64)
    assert np.all(np.isfinite(r1)) and np.all(np.isfinite(u1["w"]))
    assert jaxcomp.statistics(s1)["sent_count"]["w"][0] == 0
    assert s1.nonfinite_steps.tolist()[0] == 1
    sent = r0.sum(0) + np.where(np.isnan(g1), 0, g1)[1:].sum(0)  # device 0 adds nothing
    np.testing.assert_array_equal(r1.sum(0) + n_dev * u1["w"][0].astype(np.float64), sent)


def test_exact_exchanges_agree_with_the_all_gather():
    import jaxcomp  # noqa: PLC0415

    rng = np.random.default_rng(0)
    grads = rng.integers(-64, 64, size=(8, 2048)).astype(np.float32)
    results = {
        e: _compress_on_devices(
            jaxcomp.top_k(ratio=0.01, axis_name="data", exchange=e), grads, 8, steps=1
        )[2][0][0]
        for e in ("sparse", "sparcml", "server", "dense")
    }
    for e, u in results.items():
        np.testing.assert_array_equal(u, results["sparse"], err_msg=e)


def test_gtopk_sparsifier_rejects_six_devices():
    import jaxcomp  # noqa: PLC0415

    grads = np.ones((6, 256), np.float32)
    with pytest.raises(ValueError, match="power-of-two"):
        _compress_on_devices(
            jaxcomp.top_k(ratio=0.05, axis_name="data", exchange="gtopk"), grads, 6
        )


@pytest.mark.parametrize("factory", ["qsgd", "onebit", "sign_sgd", "ef_sign_sgd", "bounded_sign"])
def test_quantizers_through_the_server_equal_the_all_gather(factory):
    import jaxcomp  # noqa: PLC0415

    rng = np.random.default_rng(1)
    grads = rng.normal(size=(4, 3000)).astype(np.float32)
    kw = {"min_dense_size": 0}
    if factory == "qsgd":
        kw["levels"] = 4
    out = {}
    for exchange in ("allgather", "server"):
        tx = getattr(jaxcomp, factory)(axis_name="data", exchange=exchange, **kw)
        mesh = _mesh(4)

        def body(g, tx=tx):
            u, s = tx.update(g[0], tx.init(g[0]))
            return u[None], s.wire_bytes[None]

        f = jax.jit(
            jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
        )
        out[exchange] = jax.device_get(f(jax.device_put(grads, NamedSharding(mesh, P("data")))))
    for d in range(4):  # every device: the server's mean, equal to the all-gather's
        np.testing.assert_allclose(
            out["server"][0][d], out["allgather"][0][0], rtol=1e-6, atol=1e-7
        )
    # A worker's link: its message plus the dense pull (3000 float32).
    msg = out["allgather"][1][0] / 3  # the all-gather sends the message to 3 peers
    np.testing.assert_allclose(out["server"][1][0], msg + 3000 * 4, rtol=1e-6)


def test_quantizer_exchange_checked():
    import jaxcomp  # noqa: PLC0415

    with pytest.raises(ValueError, match="exchange"):
        jaxcomp.qsgd(4, axis_name="data", exchange="gtopk")


@pytest.mark.parametrize("exchange", [e for e in sa.EXCHANGES if e != "scatter"])
def test_every_exchange_runs_under_a_checked_shard_map(exchange):
    """A hand-written ``shard_map`` keeps ``check_vma=True`` (its default): every exchange
    traces there (SparCML's two branches once differed in device variance) and gives the
    updates of the unchecked run, bit for bit, on both of SparCML's branches."""
    mesh = jax.make_mesh((8,), ("data",))
    rng = np.random.default_rng(31)
    g = {"w": rng.laplace(size=(8, 300)).astype(np.float32), "b": rng.normal(size=(8, 4))}
    g["b"] = g["b"].astype(np.float32)
    sh = NamedSharding(mesh, P("data"))
    put = lambda t: jax.tree.map(lambda x: jax.device_put(np.asarray(x), sh), t)  # noqa: E731
    # SparCML: its sparse and its dense branch; the others have one.
    for ratio in (0.01, 0.5) if exchange == "sparcml" else (0.01,):
        tx = jaxcomp.ldte_bs(ratio, axis_name="data", exchange=exchange, min_dense_size=4)
        one = jax.tree.map(lambda x: x[0], g)
        state = put(jax.tree.map(lambda x: np.stack([np.asarray(x)] * 8), tx.init(one)))

        def body(gs, st, tx=tx):
            first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
            u, _ = tx.update(first(gs), first(st))
            return jax.tree.map(lambda a: a[None], u)

        out = {
            check: jax.jit(
                jax.shard_map(
                    body, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=check
                )
            )(put(g), state)
            for check in (True, False)
        }
        for k in g:
            np.testing.assert_array_equal(np.asarray(out[True][k]), np.asarray(out[False][k]))


@pytest.mark.parametrize("exchange", ["gtopk", "sparcml", "server"])
def test_make_train_step_compresses_each_devices_gradient(exchange):
    """gTop-k's, SparCML's and the parameter server's updates come out of
    ppermutes, typed device-varying although equal on every device.
    make_train_step's probe once took them for unexchanged leaves and averaged
    the gradients densely before the compressor: every device then compressed
    the same mean gradient (and paid a dense all-reduce). The applied update
    must be the exchange of the per-device top-k messages (numpy references),
    at the exchange's own bytes."""
    from jaxcomp import distributed as dist  # noqa: PLC0415

    n_dev, ratio = 8, 0.05
    mesh = _mesh(n_dev)
    rng = np.random.default_rng(5)
    # Distinct integer magnitudes per device: no ties, every sum exact in float32.
    grads = np.stack([rng.permutation(SIZE) + 1.0 for _ in range(n_dev)])
    grads = (grads * rng.choice([-1.0, 1.0], size=grads.shape)).astype(np.float32)
    tx = optax.chain(jaxcomp.top_k(ratio, axis_name="data", exchange=exchange), optax.sgd(1.0))
    params = dist.replicate({"w": jnp.zeros(SIZE)}, mesh)
    others = [
        jaxcomp.top_k(ratio, axis_name="data", exchange=name)
        for name in sa.EXCHANGES
        if name not in ("gossip", "scatter")  # per-device results by design
    ]
    others += [
        factory(axis_name="data", exchange=name)
        for factory in (jaxcomp.terngrad, jaxcomp.onebit)
        for name in ("allgather", "allreduce", "server")
    ]
    for other in others:
        assert dist.unexchanged_leaves(other, params, mesh) == [], other
    loss = lambda p, b: jnp.sum(p["w"] * b["g"][0])  # noqa: E731 (gradient: this device's row)
    step = dist.make_train_step(loss, tx, mesh, unexchanged="error")
    state = dist.init_opt_state(tx, params, mesh)
    new_params, _, metrics = step(params, state, dist.shard_batch({"g": grads}, mesh))
    k = jaxcomp.selection.target_count(ratio, SIZE)
    cap = math.ceil(1.5 * k)  # the message capacity (capacity_factor 1.5)
    top = np.argsort(-np.abs(grads), axis=1, kind="stable")[:, :k]
    idx = np.full((n_dev, cap), SIZE, np.int32)
    idx[:, :k] = top
    val = np.zeros((n_dev, cap), np.float32)
    val[:, :k] = np.take_along_axis(grads, top, axis=1)
    if exchange == "gtopk":
        want = _gtopk_reference(idx, val, cap)
        want_bytes = math.log2(n_dev) * cap * 8
    else:  # the exact mean (sparcml: the sparse branch, 8 x 26 pairs fit the union)
        want = _dense(idx, val).sum(0) / n_dev
        want_bytes = None
    np.testing.assert_array_equal(-np.asarray(new_params["w"], np.float64), want)
    if want_bytes is not None:
        assert float(metrics["wire_bytes"]) == want_bytes
