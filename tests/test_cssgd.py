"""jaxcomp.cssgd: assignment, quantization, coded exchange, loads and the time model.

References are independent: brute-force set enumeration for the assignment,
numpy for quantization, the uncoded exchange and a numpy mean for decoding,
and the paper's closed-form loads for the byte counts.
"""

import itertools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import cssgd
from jaxcomp import distributed as dist


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


# ---------------------------------------------------------------------------
# Assignment (Algorithm 2).
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, r", [(1, 1), (4, 1), (4, 2), (5, 3), (8, 3), (8, 8)])
def test_every_block_on_exactly_r_workers(n, r):
    a = cssgd.assign_blocks(n, r)
    assert len(a.subsets) == math.comb(n, r)
    assert set(a.subsets) == set(itertools.combinations(range(n), r))
    holders = {q: [k for k in range(n) if q in a.worker_blocks[k]] for q in range(len(a.subsets))}
    for q, subset in enumerate(a.subsets):
        assert tuple(holders[q]) == subset  # block q on exactly its r workers
    for blocks in a.worker_blocks:
        assert len(blocks) == math.comb(n - 1, r - 1)


@pytest.mark.parametrize("n, r", [(0, 1), (4, 0), (4, 5), (4, 1.5)])
def test_bad_assignment_rejected(n, r):
    with pytest.raises(ValueError, match="redundancy|n must"):
        cssgd.assign_blocks(n, r)


def test_block_batch_layout_and_errors():
    x = np.arange(12 * 2).reshape(12, 2)
    y = np.arange(12)
    blocks = cssgd.block_batch({"x": x, "y": y}, 4, 2)  # C(4,2) = 6 blocks of 2
    a = cssgd.assign_blocks(4, 2)
    assert blocks["y"].shape == (4, 3, 2) and blocks["x"].shape == (4, 3, 2, 2)
    for k in range(4):
        for i, q in enumerate(a.worker_blocks[k]):
            np.testing.assert_array_equal(blocks["y"][k, i], y[2 * q : 2 * q + 2])
    # Every example appears on exactly r = 2 workers.
    assert sorted(np.bincount(blocks["y"].ravel())) == [2] * 12
    with pytest.raises(ValueError, match="multiple of C"):
        cssgd.block_batch(np.arange(10), 4, 2)
    with pytest.raises(ValueError, match="multiple of C"):
        cssgd.block_batch(np.arange(3), 4, 2)  # fewer examples than blocks
    with pytest.raises(ValueError, match="leading batch axis"):
        cssgd.block_batch({"x": np.arange(12), "y": np.arange(6)}, 4, 2)


# ---------------------------------------------------------------------------
# Quantization.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bits", cssgd.BITS)
def test_quantize_matches_numpy_and_counts_clipping(bits):
    x = np.array([0.0, 0.1, -0.1, 9.99, 10.0, -10.0, 12.0, -1e9, np.nan, np.inf], np.float32)
    q, clipped, nonfinite = cssgd.quantize(jnp.asarray(x), 10.0, bits)
    top = 2 ** (bits - 1) - 1
    ref = np.round(np.clip(np.nan_to_num(x, nan=0.0, posinf=0.0), -10, 10) * (top / 10.0))
    ref = np.clip(ref, -top, top)
    q = np.asarray(q).astype(np.int64)
    # int32: float32 holds 2^31 - 128 at the top, not 2^31 - 1.
    np.testing.assert_allclose(q, ref, atol=0 if bits < 32 else 128)
    assert q.min() >= -top and q.max() <= top  # never wrapped
    assert int(clipped) == 2 and int(nonfinite) == 2
    assert np.asarray(cssgd.quantize(jnp.asarray(x), 10.0, bits)[0]).dtype == np.dtype(f"int{bits}")


def test_int32_end_points_are_the_float32_representable_ones():
    # The paper maps [-10, 10] onto 0x80000001..0x7FFFFFFF. The quantizer
    # scales, rounds and clips in float32 before the cast to int32, and
    # float32 holds 24 significant bits: between 2^30 and 2^31 its integers
    # are 128 apart. The paper's end points do not survive the float32 round
    # trip: +0x7FFFFFFF becomes 2^31 (outside int32; the cast then depends on
    # the backend: XLA saturates, C and numpy leave it undefined) and
    # -0x7FFFFFFF becomes -2^31 = 0x80000000 (one level past the positive end:
    # an asymmetric range). The symmetric end points that survive it are
    # +-(2^31 - 128), the largest float32 below 2^31: 0x7FFFFF80 / 0x80000080.
    for paper_end in (0x7FFFFFFF, -0x7FFFFFFF):
        assert int(np.float32(paper_end)) != paper_end
        assert abs(int(np.float32(paper_end))) == 2**31
    top = int(np.nextafter(np.float32(2**31), np.float32(0)))
    assert top == 0x7FFFFF80 and int(np.float32(top)) == top
    assert int(np.float32(top + 63)) == top and int(np.float32(top + 64)) == 2**31
    assert np.array(-top, np.int32).view(np.uint32) == 0x80000080
    # quantize's ends are exactly these, for the range's ends and beyond (clipped).
    x = jnp.array([10.0, -10.0, 12.0, -1e30, np.nextafter(np.float32(10), np.float32(0))])
    q, clipped, _ = cssgd.quantize(x, 10.0, 32)
    words = np.asarray(q).view(np.uint32)
    np.testing.assert_array_equal(words[:4], [0x7FFFFF80, 0x80000080, 0x7FFFFF80, 0x80000080])
    assert int(clipped) == 2
    # The largest float32 below 10 is still on the top level: what the ends
    # give up, value_range * 127 / (2^31 - 1) ~ 6e-7, is below float32's
    # own spacing at 10 (9.5e-7).
    assert words[4] == 0x7FFFFF80
    assert 10.0 * 127 / (2**31 - 1) < float(np.spacing(np.float32(10)))
    # And they invert: dequantize gives back +-value_range to float32 rounding.
    back = np.asarray(cssgd.dequantize(q[:2], 10.0, 32))
    np.testing.assert_allclose(back, [10.0, -10.0], rtol=float(np.finfo(np.float32).eps))


def test_stochastic_rounding_is_unbiased():
    x = jnp.full((200_000,), 0.3, jnp.float32)
    q, _, _ = cssgd.quantize(x, 1.0, 8, key=jax.random.key(0))
    # 0.3 * 127 = 38.1: level 38 or 39, 39 with probability 0.1.
    assert set(np.unique(np.asarray(q)).tolist()) == {38, 39}
    share = float(np.mean(np.asarray(q) == 39))
    assert abs(share - 0.1) < 5 * np.sqrt(0.1 * 0.9 / x.size)


@pytest.mark.parametrize("bits", [8, 32])
def test_value_range_whose_float32_scale_is_not_finite_rejected(bits):
    """Below (2^(bits-1) - 1) 2^-126 every value decoded to 0 with clipped = 0."""
    low = (2 ** (bits - 1) - 1) * float(np.finfo(np.float32).tiny)
    for bad in (low / 2, 1e-40, 1e39):
        with pytest.raises(ValueError, match="value_range must be in"):
            cssgd.CodedConfig(redundancy=1, value_range=bad, bits=bits)
        with pytest.raises(ValueError, match="value_range"):
            cssgd.quantize(jnp.zeros(2), bad, bits)
    # The smallest allowed range decodes to numpy's mean (4 devices, r = 2: its
    # scale times C(4, 2) = 6 blocks is past float32's max).
    vr = low * 1.01
    rng = np.random.default_rng(bits)
    all_blocks = (rng.uniform(-1, 1, size=(math.comb(4, 2), 5)) * vr).astype(np.float32)
    mean, _, stats = _exchange(4, 2, all_blocks, value_range=vr, bits=bits)
    step = vr / (2 ** (bits - 1) - 1)
    np.testing.assert_allclose(mean[0], all_blocks.astype(np.float64).mean(0), rtol=1e-6, atol=step)
    assert np.abs(mean[0]).max() > 0.1 * vr and stats.clipped.tolist() == [0] * 4


def test_quantize_takes_a_traced_value_range():
    # value_range only scales: a traced one is not checked (a static one is).
    x = jnp.array([0.5, -1.0, 3.0])
    fn = jax.jit(lambda x, r: cssgd.dequantize(cssgd.quantize(x, r, 8)[0], r, 8))
    step = 2.0 / 127
    ref = np.round(np.clip(np.asarray(x), -2.0, 2.0) / step) * step
    np.testing.assert_allclose(np.asarray(fn(x, 2.0)), ref, rtol=1e-6)


# ---------------------------------------------------------------------------
# The exchange.
# ---------------------------------------------------------------------------


def _exchange(n, r, all_blocks, **cfg_kw):
    """Runs coded_mean on n devices, worker k holding its blocks of ``all_blocks`` (Q, G)."""
    cfg = cssgd.CodedConfig(redundancy=r, **cfg_kw)
    own = np.asarray(cssgd.assign_blocks(n, r).worker_blocks)
    mesh = _mesh(n)

    def run(b):
        mean, stats, blocks = cssgd.coded_mean(
            b[0], cfg, "data", key=jax.random.key(1), return_blocks=True
        )
        return mean[None], blocks[None], jax.tree.map(lambda s: s[None], stats)

    f = jax.jit(
        jax.shard_map(run, mesh=mesh, in_specs=P("data"), out_specs=P("data"), check_vma=False)
    )
    x = jax.device_put(all_blocks[own], NamedSharding(mesh, P("data")))
    return jax.device_get(f(x))


@pytest.mark.parametrize(
    "n, r", [(2, 1), (3, 2), (4, 1), (4, 2), (4, 3), (5, 2), (8, 1), (8, 3), (8, 7), (8, 8)]
)
def test_decoded_blocks_equal_the_quantized_blocks_exactly(n, r):
    rng = np.random.default_rng(100 * n + r)
    q_blocks, size = math.comb(n, r), 11  # 11 elements: not a multiple of r (padding)
    # Values near the range's edges: packet sums overflow int32 and wrap.
    all_blocks = rng.choice([-0.99, 0.99], size=(q_blocks, size)) * rng.uniform(
        0.9, 1.0, size=(q_blocks, size)
    )
    all_blocks = all_blocks.astype(np.float32)
    coded = _exchange(n, r, all_blocks, value_range=1.0)
    uncoded = _exchange(n, r, all_blocks, value_range=1.0, exchange="uncoded")
    want, _, _ = cssgd.quantize(jnp.asarray(all_blocks), 1.0, 32)
    want = np.asarray(want)
    for k in range(n):  # integer equality, on every device
        np.testing.assert_array_equal(coded[1][k], want)
        np.testing.assert_array_equal(uncoded[1][k], want)
    # The same mean on every device, coded and uncoded alike, and numpy's.
    for k in range(n):
        np.testing.assert_array_equal(coded[0][k], coded[0][0])
        np.testing.assert_array_equal(uncoded[0][k], coded[0][0])
    ref = np.asarray(cssgd.dequantize(jnp.asarray(want), 1.0, 32), np.float64).mean(0)
    np.testing.assert_allclose(coded[0][0], ref, rtol=0, atol=1e-7)


@pytest.mark.parametrize("bits", [8, 16])
def test_narrow_integers_decode_exactly_too(bits):
    rng = np.random.default_rng(bits)
    all_blocks = rng.uniform(-1, 1, size=(math.comb(5, 2), 7)).astype(np.float32)
    coded = _exchange(5, 2, all_blocks, value_range=1.0, bits=bits)
    want = np.asarray(cssgd.quantize(jnp.asarray(all_blocks), 1.0, bits)[0])
    for k in range(5):
        np.testing.assert_array_equal(coded[1][k], want)


def test_clipping_and_nonfinite_are_counted_never_wrapped():
    n, r = 4, 2
    all_blocks = np.zeros((math.comb(n, r), 5), np.float32)
    all_blocks[0, 0] = 50.0  # block 0 = workers (0, 1): clipped on both
    coded = _exchange(n, r, all_blocks, value_range=10.0)
    stats = coded[2]
    assert stats.clipped.tolist() == [1, 1, 0, 0]
    np.testing.assert_allclose(coded[0][0][0], 10.0 / math.comb(n, r), rtol=1e-6)
    all_blocks[1, 2] = np.nan
    coded = _exchange(n, r, all_blocks, value_range=10.0)
    assert coded[2].nonfinite.tolist() == [1, 0, 1, 0]  # block 1 = workers (0, 2)
    assert np.isnan(coded[0]).all()  # a NaN gradient makes the step NaN, as plain SGD


def test_stochastic_rounding_needs_a_key_and_stays_exact():
    rng = np.random.default_rng(0)
    all_blocks = rng.uniform(-1, 1, size=(math.comb(4, 2), 6)).astype(np.float32)
    coded = _exchange(4, 2, all_blocks, value_range=1.0, bits=8, rounding="stochastic")
    # Each block rounded with fold_in(key, block id): its holders agree, and
    # every device decodes exactly those integers.
    want = np.stack(
        [
            np.asarray(cssgd.quantize(b, 1.0, 8, jax.random.fold_in(jax.random.key(1), q))[0])
            for q, b in enumerate(all_blocks)
        ]
    )
    for k in range(4):
        np.testing.assert_array_equal(coded[1][k], want)
    cfg = cssgd.CodedConfig(redundancy=2, rounding="stochastic")
    with pytest.raises(ValueError, match="key"):
        _trace_coded_mean(cfg, (1, 3, 2))


def _trace_coded_mean(cfg, shape):
    """Traces ``coded_mean`` (no key) on 4 devices, each given zeros of ``shape[1:]``."""
    jax.make_jaxpr(
        jax.shard_map(
            lambda b: cssgd.coded_mean(b[0], cfg, "data")[0],
            mesh=_mesh(4),
            in_specs=P(),
            out_specs=P(),
            check_vma=False,
        )
    )(jnp.zeros(shape))


def test_leading_axis_and_redundancy_checked():
    cfg = cssgd.CodedConfig(redundancy=2)
    trace = _trace_coded_mean

    with pytest.raises(ValueError, match="leading axis of C"):
        trace(cfg, (1, 2, 5))  # C(3, 1) = 3 blocks per worker, not 2
    with pytest.raises(ValueError, match="redundancy"):
        trace(cssgd.CodedConfig(redundancy=5), (1, 1, 5))


@pytest.mark.parametrize(
    "kw, name",
    [
        ({"redundancy": 0}, "redundancy"),
        ({"redundancy": 2, "value_range": 0.0}, "value_range"),
        ({"redundancy": 2, "bits": 12}, "bits"),
        ({"redundancy": 2, "rounding": "up"}, "rounding"),
        ({"redundancy": 2, "exchange": "gossip"}, "exchange"),
    ],
)
def test_bad_config_rejected(kw, name):
    with pytest.raises(ValueError, match=name):
        cssgd.CodedConfig(**kw)


# ---------------------------------------------------------------------------
# Loads and bytes.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("n, r", [(2, 1), (4, 1), (4, 2), (4, 3), (5, 2), (8, 2), (8, 3), (8, 7)])
def test_counted_bytes_equal_the_papers_loads(n, r):
    size = 12 * r  # a multiple of r: segments are exact
    all_blocks = np.zeros((math.comb(n, r), size), np.float32)
    norm = n * math.comb(n, r) * size * 4  # every worker's share of every block, bytes
    for exchange, formula in (("coded", cssgd.coded_load), ("uncoded", cssgd.uncoded_load)):
        stats = _exchange(n, r, all_blocks, exchange=exchange)[2]
        total = sum(Fraction(int(b)) for b in stats.sent_bytes)
        assert total / norm == formula(n, r)
        # Each worker receives every missing block's worth: C(n-1, r) gradients.
        assert stats.received_bytes.tolist() == [math.comb(n - 1, r) * size * 4] * n
        b = cssgd.bytes_per_worker(n, r, size)
        assert b[f"{exchange}_sent"] == total / n
    assert cssgd.coded_load(n, r) == Fraction(1, r) * (1 - Fraction(r, n))


def test_loads_by_hand():
    # n = 8: coded (1/r)(1 - r/8), uncoded 1 - r/8.
    assert [cssgd.coded_load(8, r) for r in (1, 2, 4, 7)] == [
        Fraction(7, 8),
        Fraction(3, 8),
        Fraction(1, 8),
        Fraction(1, 56),
    ]
    assert cssgd.uncoded_load(8, 2) == Fraction(3, 4)
    # Bytes per worker, 1000 float32 elements on 8 workers: C(7, r) / r gradients coded.
    for r, grads in ((1, 7), (2, 10.5), (3, 35 / 3), (4, 8.75), (7, 1 / 7)):
        b = cssgd.bytes_per_worker(8, r, 1001 * math.lcm(1, 2, 3, 4, 7))
        assert b["coded_sent"] == pytest.approx(grads * 4 * 1001 * 84)
    assert cssgd.bytes_per_worker(8, 2, 1000)["allreduce_sent"] == 2 * 7 / 8 * 4000


def test_time_model_and_best_redundancy_by_hand():
    assert cssgd.step_time(1.0, 6.0, 2) == 2.0 + 3.0
    # T(r) = r + 9/r on 8 workers: 10, 6.5, 6, 6.25, ... -> r = 3.
    assert cssgd.best_redundancy(1.0, 9.0, 8) == 3
    # T(r) = 2r + 8/r: 10, 8, 8.67 -> r = 2; no communication -> r = 1.
    assert cssgd.best_redundancy(2.0, 8.0, 8) == 2
    assert cssgd.best_redundancy(1.0, 0.0, 8) == 1
    with pytest.raises(ValueError, match="t_calc"):
        cssgd.step_time(-1.0, 1.0, 1)


# ---------------------------------------------------------------------------
# Training.
# ---------------------------------------------------------------------------


def _problem(batch):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 2))).astype(np.float32)

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)

    return loss, {"x": x, "y": y}, {"w": jnp.zeros((6, 2)), "b": jnp.zeros((2,))}


@pytest.mark.parametrize("r", [1, 2, 3])
def test_training_matches_plain_sgd_on_the_whole_batch(r):
    n = 4
    loss, batch, params0 = _problem(12)  # C(4, 1..3) = 4, 6, 4 divide 12
    mesh = _mesh(n)
    tx = optax.sgd(0.1, momentum=0.9)
    cfg = cssgd.CodedConfig(redundancy=r)
    params = dist.replicate(params0, mesh)
    state = cssgd.init_opt_state(tx, params, mesh)
    step = cssgd.make_train_step(loss, tx, mesh, cfg)
    blocks = cssgd.shard_block_batch(batch, mesh, r)
    ref_params, ref_state = params0, tx.init(params0)
    for _ in range(3):
        params, state, metrics = step(params, state, blocks)
        ref_loss, grads = jax.value_and_grad(loss)(ref_params, batch)
        updates, ref_state = tx.update(grads, ref_state)
        ref_params = optax.apply_updates(ref_params, updates)
        # Block means of equal-size blocks average to the batch mean; each
        # worker's mean over its blocks averages to the same.
        np.testing.assert_allclose(float(metrics["loss"]), float(ref_loss), rtol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        jax.device_get(params),
        ref_params,
    )
    expected = cssgd.bytes_per_worker(n, r, 6 * 2 + 2)["coded_sent"]
    assert float(metrics["wire_bytes"]) == expected
    assert int(metrics["clipped"]) == 0


def test_communicating_optimizer_rejected():
    import jaxcomp  # noqa: PLC0415

    loss, batch, params0 = _problem(12)
    mesh = _mesh(4)
    tx = optax.chain(jaxcomp.top_k(ratio=0.5, axis_name="data"), optax.sgd(0.1))
    params = dist.replicate(params0, mesh)
    state = cssgd.init_opt_state(tx, params, mesh)
    step = cssgd.make_train_step(loss, tx, mesh, cssgd.CodedConfig(redundancy=2))
    with pytest.raises(ValueError, match="communicates"):
        step(params, state, cssgd.shard_block_batch(batch, mesh, 2))


def test_train_step_rejects_redundancy_above_the_mesh():
    loss, _, _ = _problem(12)
    with pytest.raises(ValueError, match="redundancy"):
        cssgd.make_train_step(loss, optax.sgd(0.1), _mesh(2), cssgd.CodedConfig(redundancy=3))


def test_train_step_rejects_blocks_laid_out_for_another_redundancy():
    """r=2 and r=3 layouts on 4 devices both hold C(3, 1) = C(3, 2) = 3 blocks per worker."""
    loss, batch, params0 = _problem(12)
    mesh = _mesh(4)
    tx = optax.sgd(0.1)
    params = dist.replicate(params0, mesh)
    state = cssgd.init_opt_state(tx, params, mesh)
    for r_layout, r_step in ((2, 3), (3, 2)):
        cfg = cssgd.CodedConfig(redundancy=r_step)
        step = cssgd.make_train_step(loss, tx, mesh, cfg, donate=False)
        for blocks in (
            cssgd.shard_block_batch(batch, mesh, r_layout),
            cssgd.block_batch(batch, 4, r_layout),
        ):
            with pytest.raises(ValueError, match=rf"redundancy r={r_layout}.*redundancy={r_step}"):
                step(params, state, blocks)
            with pytest.raises(ValueError, match="shard_block_batch"):
                step.lower(params, state, blocks)
        # Its own layout trains: the update is -0.1 x the whole batch's gradient.
        new, _, _ = step(params, state, cssgd.shard_block_batch(batch, mesh, r_step))
        want = jax.grad(loss)(params0, batch)
        np.testing.assert_allclose(new["w"], -0.1 * want["w"], rtol=1e-5, atol=1e-6)


def test_cfg_that_is_not_a_coded_config_rejected():
    """cfg=2 raised AttributeError: 'int' object has no attribute 'redundancy'."""
    loss, _, _ = _problem(12)
    with pytest.raises(ValueError, match="cfg must be a jaxcomp.cssgd.CodedConfig"):
        cssgd.make_train_step(loss, optax.sgd(0.1), _mesh(2), 2)
    with pytest.raises(ValueError, match="cfg must be"):
        _trace_coded_mean({"redundancy": 2}, (1, 3, 2))


def test_stochastic_training_keeps_devices_identical():
    # Replicated outputs are each device's own buffer: they must agree bit for
    # bit, which needs every holder of a block to round it alike.
    loss, batch, params0 = _problem(12)
    mesh = _mesh(4)
    tx = optax.sgd(0.1)
    cfg = cssgd.CodedConfig(redundancy=2, bits=8, value_range=4.0, rounding="stochastic")
    params = dist.replicate(params0, mesh)
    state = cssgd.init_opt_state(tx, params, mesh, seed=3)
    step = cssgd.make_train_step(loss, tx, mesh, cfg)
    blocks = cssgd.shard_block_batch(batch, mesh, 2)
    for _ in range(3):
        params, state, metrics = step(params, state, blocks)
    for leaf in jax.tree.leaves(params):
        shards = [np.asarray(s.data) for s in leaf.addressable_shards]
        for s in shards[1:]:
            np.testing.assert_array_equal(s, shards[0])
    assert np.isfinite(float(metrics["loss"]))
