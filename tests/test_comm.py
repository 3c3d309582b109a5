"""Collectives on 8 simulated devices against dense numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import comm

N = 8


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests/conftest.py sets 8 simulated devices"
    return jax.make_mesh((N,), ("data",))


def run(mesh, fn, *args, out_specs):
    """Runs ``fn`` per device on row ``d`` of every argument (leading axis N)."""

    def body(*xs):
        return fn(*[x[0] for x in xs])

    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=P("data"), out_specs=out_specs, check_vma=False
    )
    placed = [jax.device_put(a, NamedSharding(mesh, P("data"))) for a in args]
    return jax.tree.map(np.asarray, jax.block_until_ready(jax.jit(sharded)(*placed)))


def per_device(fn):
    """Wraps a collective so each device returns its own (result, bytes) row."""
    return lambda *xs: jax.tree.map(lambda y: jnp.asarray(y)[None], fn(*xs))


def random_messages(rng, size, capacity, pad):
    """Per-device fixed-capacity messages: unique indices per device, ``pad`` padded slots."""
    idx = np.stack([rng.choice(size, capacity, replace=False) for _ in range(N)]).astype(np.int32)
    idx[:, capacity - pad :] = size  # padding sentinel
    vals = rng.standard_normal((N, capacity)).astype(np.float32)
    vals[:, capacity - pad :] = 0
    return idx, vals


def decompress(idx, vals, size):
    dense = np.zeros((N, size), np.float32)
    for d in range(N):
        keep = idx[d] < size
        dense[d, idx[d][keep]] = vals[d][keep]
    return dense


def test_dense_mean_matches_numpy(mesh):
    x = np.random.default_rng(0).standard_normal((N, 1000)).astype(np.float32)
    mean, sent = run(mesh, per_device(lambda v: comm.dense_mean(v, "data")), x, out_specs=P("data"))
    np.testing.assert_allclose(mean, np.broadcast_to(x.mean(0), (N, 1000)), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(sent, 2 * (N - 1) / N * 1000 * 4)


def test_sparse_mean_equals_dense_mean_of_decompressed_messages(mesh):
    rng = np.random.default_rng(1)
    size, capacity = 512, 96  # indices collide across devices
    idx, vals = random_messages(rng, size, capacity, pad=10)
    mean, sent = run(
        mesh,
        per_device(lambda i, v: comm.sparse_mean(i, v, size, "data")),
        idx,
        vals,
        out_specs=P("data"),
    )
    dense = decompress(idx, vals, size)
    # Same order as the collective: device by device, each term divided by N
    # first (exact for N = 8). Every device holds the same bits.
    ref = np.zeros(size, np.float32)
    for d in range(N):
        ref = ref + dense[d] / np.float32(N)
    np.testing.assert_array_equal(mean, np.broadcast_to(ref, (N, size)))
    # Against the float64 mean, only float32 summation-order rounding remains.
    np.testing.assert_allclose(mean[0], dense.astype(np.float64).mean(0), rtol=0, atol=1e-6)
    np.testing.assert_array_equal(sent, (N - 1) * capacity * (4 + 4))


def test_sparse_mean_bfloat16_values(mesh):
    rng = np.random.default_rng(2)
    idx, vals = random_messages(rng, 256, 32, pad=0)
    vals16 = jnp.asarray(vals, jnp.bfloat16)
    mean, sent = run(
        mesh,
        per_device(lambda i, v: comm.sparse_mean(i, v, 256, "data")),
        idx,
        vals16,
        out_specs=P("data"),
    )
    assert mean.dtype == jnp.bfloat16
    ref = decompress(idx, np.asarray(vals16, np.float32), 256).mean(0)
    np.testing.assert_allclose(np.asarray(mean[0], np.float32), ref, atol=2e-2)
    np.testing.assert_array_equal(sent, (N - 1) * 32 * (4 + 2))


def test_prefer_sparse_follows_the_byte_model():
    size, n = 2**20, 8
    dense = 2 * (n - 1) / n * size * 4
    # Sparse bytes: capacity * 8 * (N - 1); the crossover capacity is dense / 56.
    crossover = dense / (8 * (n - 1))
    assert comm.prefer_sparse(int(crossover) - 1, size, 4, n)
    assert not comm.prefer_sparse(int(crossover) + 1, size, 4, n)
    assert not comm.prefer_sparse(int(0.25 * size), size, 4, n)  # DGC warm-up 25%: dense
    assert comm.prefer_sparse(int(1.5e-3 * size), size, 4, n)
    assert not comm.prefer_sparse(10, size, 4, 1)  # nothing moves on one device
    # bf16 values: the int32 index dominates, the crossover moves down.
    assert comm.prefer_sparse(int(crossover) - 1, size, 4, n)
    assert not comm.prefer_sparse(int(crossover) - 1, size, 2, n)


@pytest.mark.parametrize("capacity, want_sparse", [(8, True), (120, False)])
def test_exchange_mean_auto_picks_the_cheaper_collective(mesh, capacity, want_sparse):
    size = 256  # crossover capacity: 2 * 7 / 8 * 256 * 4 / (8 * 7) = 16
    assert comm.prefer_sparse(capacity, size, 4, N) == want_sparse
    idx, vals = random_messages(np.random.default_rng(3), size, capacity, pad=2)
    ref = decompress(idx, vals, size).mean(0)
    results = {}
    for exchange in (*comm.EXCHANGES, *comm.EXCHANGE_ALIASES):
        fn = per_device(lambda i, v, e=exchange: comm.exchange_mean(i, v, size, "data", exchange=e))
        results[exchange] = run(mesh, fn, idx, vals, out_specs=P("data"))
        np.testing.assert_allclose(results[exchange][0][0], ref, atol=1e-6)
    sparse_bytes = (N - 1) * capacity * 8
    dense_bytes = 2 * (N - 1) / N * size * 4
    np.testing.assert_array_equal(results["allgather"][1], sparse_bytes)
    # The alias is the same collective: the same mean, bit for bit, the same bytes.
    for alias, canonical in comm.EXCHANGE_ALIASES.items():
        for got, want in zip(results[alias], results[canonical], strict=True):
            np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(results["dense"][1], dense_bytes)
    np.testing.assert_array_equal(results["auto"][1], sparse_bytes if want_sparse else dense_bytes)
    with pytest.raises(ValueError, match="exchange"):
        run(
            mesh,
            lambda i, v: comm.exchange_mean(i, v, size, "data", exchange="x")[0][None],
            idx,
            vals,
            out_specs=P("data"),
        )


def test_partial_aggregation_excludes_backup_workers(mesh):
    rng = np.random.default_rng(4)
    size = 300
    include = np.array([1, 1, 0, 1, 1, 1, 0, 1], bool)
    x = rng.standard_normal((N, size)).astype(np.float32)
    x[~include] = 1e6  # an excluded worker's message must not leak into the mean
    mean, sent = run(
        mesh,
        per_device(lambda v, f: comm.dense_mean(v, "data", include=f)),
        x,
        include,
        out_specs=P("data"),
    )
    np.testing.assert_allclose(mean[3], x[include].mean(0), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sent, 2 * (N - 1) / N * (size * 4 + 4))

    idx, vals = random_messages(rng, size, 40, pad=3)
    vals[~include] = 1e6
    smean, ssent = run(
        mesh,
        per_device(lambda i, v, f: comm.sparse_mean(i, v, size, "data", include=f)),
        idx,
        vals,
        include,
        out_specs=P("data"),
    )
    ref = decompress(idx, vals, size)[include].mean(0)
    np.testing.assert_allclose(smean[5], ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(smean, np.broadcast_to(smean[0], smean.shape))
    np.testing.assert_array_equal(ssent, (N - 1) * 40 * 8 + 2 * (N - 1) / N * 4)


def test_fastest_mask_and_include_fastest(mesh):
    delays = np.array([0.3, 0.9, 0.1, 0.5, 0.9, 0.2, 0.4, 0.8], np.float32)
    mask = np.asarray(comm.fastest_mask(delays, 2))
    # Drop the 2 slowest; the tie at 0.9 keeps the lower index in the order.
    np.testing.assert_array_equal(mask, [1, 0, 1, 1, 0, 1, 1, 1])
    assert np.asarray(comm.fastest_mask(delays, 0)).all()
    delays_rows = np.broadcast_to(delays, (N, N)).copy()
    flags = run(
        mesh, lambda d: comm.include_fastest(d, 2, "data")[None], delays_rows, out_specs=P("data")
    )
    np.testing.assert_array_equal(flags, mask)
    with pytest.raises(ValueError, match="num_backup"):
        comm.fastest_mask(delays, N)


def test_weighted_mean_matches_numpy(mesh):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((N, 50)).astype(np.float32)
    w = rng.uniform(0.5, 3.0, N).astype(np.float32)
    mean, sent = run(
        mesh, per_device(lambda v, s: comm.weighted_mean(v, s, "data")), x, w, out_specs=P("data")
    )
    np.testing.assert_allclose(mean[0], (w[:, None] * x).sum(0) / w.sum(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(sent, 2 * (N - 1) / N * (50 * 4 + 4))


@pytest.mark.parametrize("root", [0, 5])
def test_server_mean_matches_numpy_and_is_identical_everywhere(mesh, root):
    x = np.random.default_rng(6).standard_normal((N, 64)).astype(np.float32)
    mean, sent = run(
        mesh, per_device(lambda v: comm.server_mean(v, "data", root=root)), x, out_specs=P("data")
    )
    ref = np.zeros(64, np.float32)
    for d in range(N):  # the server sums pushes in device order
        ref = ref + x[d]
    np.testing.assert_array_equal(mean, np.broadcast_to(ref / np.float32(N), (N, 64)))
    np.testing.assert_array_equal(sent, 2 * 64 * 4)  # a worker's push + pull
    link = comm.server_link_bytes(256, 256, N)
    assert link == {"worker": 512.0, "server_in": 7 * 256.0, "server_out": 7 * 256.0}


def test_server_sparse_mean_matches_numpy(mesh):
    rng = np.random.default_rng(7)
    idx, vals = random_messages(rng, 128, 20, pad=4)
    mean, sent = run(
        mesh,
        per_device(lambda i, v: comm.server_sparse_mean(i, v, 128, "data", root=2)),
        idx,
        vals,
        out_specs=P("data"),
    )
    np.testing.assert_allclose(
        mean, np.broadcast_to(decompress(idx, vals, 128).mean(0), mean.shape), atol=1e-6
    )
    np.testing.assert_array_equal(mean, np.broadcast_to(mean[0], mean.shape))
    np.testing.assert_array_equal(sent, 20 * 8 + 128 * 4)
    with pytest.raises(ValueError, match="root"):
        run(mesh, lambda v: comm.server_mean(v, "data", root=N)[0][None], vals, out_specs=P("data"))


def test_gossip_mean_mixes_ring_neighbours(mesh):
    x = np.random.default_rng(8).standard_normal((N, 10)).astype(np.float32)
    weights = (0.5, 0.3, 0.2)
    mixed, sent = run(
        mesh,
        per_device(lambda v: comm.gossip_mean(v, "data", weights=weights)),
        x,
        out_specs=P("data"),
    )
    ref = 0.5 * x + 0.3 * np.roll(x, 1, axis=0) + 0.2 * np.roll(x, -1, axis=0)
    np.testing.assert_allclose(mixed, ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(sent, 2 * 10 * 4)
    with pytest.raises(ValueError, match="weights"):
        run(
            mesh,
            lambda v: comm.gossip_mean(v, "data", weights=(0.5, 0.5, 0.5))[0][None],
            x,
            out_specs=P("data"),
        )
