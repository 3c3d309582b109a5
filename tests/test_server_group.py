"""A group of parameter servers (``exchange="server"``, ``servers=M``) against numpy.

The references are written here from the documented rule, not from the
library: server ``j`` is device ``j * N // M`` and owns the flat positions
``[j c, (j + 1) c)`` with ``c = ceil(size / M)`` (the quantizers' coded
leaves: whole leaves, greedy by bytes); each server sums its share of every
worker's message in device order and divides by ``N``; every worker gets the
concatenation. ``M = 1`` is the single server of before.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import comm
from tests.helpers import mesh_update, sign_codec

N = 8
GROUPS = [1, 2, 4]


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() >= N, "tests/conftest.py sets 8 simulated devices"
    return jax.make_mesh((N,), ("data",))


def put(mesh, tree):
    sharding = NamedSharding(mesh, P("data"))
    return jax.tree.map(lambda x: jax.device_put(np.asarray(x), sharding), tree)


def np_ranges(size, m):
    c = -(-size // m)
    return [(min(j * c, size), min((j + 1) * c, size)) for j in range(m)]


def np_server_mean(x):
    """One server's mean: the pushes summed in device order (float32), divided by N."""
    total = np.zeros(x.shape[1:], np.float32)
    for d in range(x.shape[0]):
        total = total + x[d]
    return total / np.float32(x.shape[0])


def test_placement_ranges_assignment_and_link_bytes():
    assert comm.server_devices(N, 1) == (0,)
    assert comm.server_devices(N, 2) == (0, 4)
    assert comm.server_devices(N, 4) == (0, 2, 4, 6)
    assert comm.server_devices(N, 8) == tuple(range(8))
    assert comm.server_devices(N, 2, root=5) == (5, 1)
    for size, m in [(10, 4), (3, 4), (64, 2), (0, 2), (7, 1)]:
        assert comm.server_ranges(size, m) == tuple(np_ranges(size, m))
    # Greedy by bytes: the largest message first, to the least-loaded server.
    assert comm.assign_to_servers([42, 17, 17, 9], 1) == ((0, 1, 2, 3),)
    assert comm.assign_to_servers([42, 17, 17, 9], 2) == ((0,), (1, 2, 3))
    assert comm.assign_to_servers([42, 17, 17, 9], 4) == ((0,), (1,), (2,), (3,))
    assert comm.assign_to_servers([5], 3) == ((0,), (), ())
    # Per server: N - 1 remote pushes in, N - 1 pulls out; a worker's link the sums.
    link = comm.server_link_bytes([80, 80], [12, 8], N)
    assert link == {"worker": 180.0, "server_in": (560.0, 560.0), "server_out": (84.0, 56.0)}
    assert comm.server_link_bytes(80, 20, N) == comm.server_link_bytes([80], [20], N) | {
        "server_in": 560.0,
        "server_out": 140.0,
    }
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, 8\]"):
        comm.server_devices(N, 9)
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, 8\]"):
        comm.check_servers(0, N)


def _collectives(m, size, cap):
    def body(x, idx, vals):
        dense, dense_bytes = comm.server_mean(x[0], "data", servers=m)
        sparse, sparse_bytes = comm.server_sparse_mean(idx[0], vals[0], size, "data", servers=m)
        counts = comm.server_message_counts(idx[0], size, servers=m)
        return jax.tree.map(
            lambda a: jnp.asarray(a)[None], (dense, dense_bytes, sparse, sparse_bytes, counts)
        )

    return jax.shard_map(
        body, mesh=jax.make_mesh((N,), ("data",)), in_specs=P("data"), out_specs=P("data"),
        check_vma=False,
    )  # fmt: skip


@pytest.mark.parametrize("m", GROUPS)
def test_server_group_collectives_match_numpy(mesh, m):
    size, cap, pad = 37, 9, 2
    rng = np.random.default_rng(m)
    x = rng.standard_normal((N, 2, 5)).astype(np.float32)  # 10 elements: ranges 3, 3, 3, 1
    idx = np.stack([rng.choice(size, cap, replace=False) for _ in range(N)]).astype(np.int32)
    idx[:, cap - pad :] = size  # padding
    vals = rng.standard_normal((N, cap)).astype(np.float32)
    args = put(mesh, (x, idx, vals))
    fn = jax.jit(_collectives(m, size, cap))
    dense, dense_bytes, sparse, sparse_bytes, counts = jax.device_get(fn(*args))
    # Dense: each server averages its slice of every worker's x; all get the concatenation.
    flat = x.reshape(N, -1)
    want = np.concatenate([np_server_mean(flat[:, lo:hi]) for lo, hi in np_ranges(10, m)])
    np.testing.assert_array_equal(dense, np.broadcast_to(want.reshape(2, 5), dense.shape))
    np.testing.assert_array_equal(dense_bytes, 2 * 10 * 4)  # push + pull, split over servers
    # Sparse: server j scatter-adds the entries in its range, in device order.
    want = np.zeros(size, np.float32)
    for lo, hi in np_ranges(size, m):
        part = np.zeros(hi - lo, np.float32)
        for d in range(N):
            for i, v in zip(idx[d], vals[d], strict=True):
                if lo <= i < hi:
                    part[i - lo] += v / np.float32(N)
        want[lo:hi] = part
    np.testing.assert_allclose(sparse, np.broadcast_to(want, sparse.shape), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(sparse, np.broadcast_to(sparse[0], sparse.shape))
    # Every server receives a worker's whole message (static shapes); the pull is split.
    np.testing.assert_array_equal(sparse_bytes, m * cap * (4 + 4) + size * 4)
    want_counts = [
        [np.sum((row >= lo) & (row < hi)) for lo, hi in np_ranges(size, m)] for row in idx
    ]
    np.testing.assert_array_equal(counts, want_counts)
    assert counts.sum(1).tolist() == [cap - pad] * N  # padding counts nowhere
    # The servers are the spread devices: every transfer has a server at one end.
    text = fn.lower(*args).as_text()
    perms = re.findall(r"source_target_pairs = dense<\[((?:\[\d+, \d+\](?:, )?)+)\]>", text)
    per_op = [[tuple(map(int, p)) for p in re.findall(r"\[(\d+), (\d+)\]", op)] for op in perms]
    pairs = {p for op in per_op for p in op}
    servers = set(range(0, N, N // m))
    assert pairs and all(a in servers or b in servers for a, b in pairs)
    assert {b for a, b in pairs if b in servers} == servers
    # One ppermute per round and buffer whatever M (server s_j paired with
    # device s_j + r): dense push + pull, sparse indices + values push + pull.
    assert text.count("collective_permute") == len(per_op) == 5 * (N - 1)
    for op in per_op:  # a round: distinct sources, distinct destinations
        assert len({a for a, _ in op}) == len({b for _, b in op}) == len(op)
    if m == 1:  # the single server, bit for bit
        one = jax.jit(
            jax.shard_map(
                lambda x, i, v: (
                    comm.server_mean(x[0], "data")[0][None],
                    comm.server_sparse_mean(i[0], v[0], size, "data")[0][None],
                ),
                mesh=mesh,
                in_specs=P("data"),
                out_specs=P("data"),
                check_vma=False,
            )  # fmt: skip
        )(*args)
        np.testing.assert_array_equal(np.asarray(one[0]), dense)
        np.testing.assert_array_equal(np.asarray(one[1]), sparse)


def _stacked_state(tx, mesh, one):
    return put(mesh, jax.tree.map(lambda a: np.stack([np.asarray(a)] * N), tx.init(one)))


@pytest.mark.parametrize("m", GROUPS)
def test_sparsifier_server_group_matches_numpy(mesh, m):
    ratio, sizes = 0.05, {"a": 300, "b": 5}  # b: sent dense (min_dense_size)
    k = math.ceil(ratio * 300)
    cap = math.ceil(1.5 * k)
    tx = jaxcomp.top_k(ratio, axis_name="data", exchange="server", servers=m, min_dense_size=8)
    state = _stacked_state(tx, mesh, {n: np.zeros(s, np.float32) for n, s in sizes.items()})
    step = mesh_update(tx, mesh)
    rng = np.random.default_rng(10 + m)
    residual = {n: np.zeros((N, s), np.float32) for n, s in sizes.items()}
    for _ in range(2):  # the second step sends what the first kept
        g = {n: rng.standard_normal((N, s)).astype(np.float32) for n, s in sizes.items()}
        update, state = step(put(mesh, g), state)
        update, host = jax.device_get((update, state))
        acc = {n: residual[n] + g[n] for n in sizes}
        sent = {"a": np.zeros_like(acc["a"]), "b": acc["b"]}
        for d in range(N):
            top = np.argsort(-np.abs(acc["a"][d]), kind="stable")[:k]
            sent["a"][d, top] = acc["a"][d, top]
        for n in sizes:
            residual[n] = acc[n] - sent[n]
            np.testing.assert_array_equal(host.residual[n], residual[n])
            want = np.broadcast_to(sent[n].mean(0), update[n].shape)
            np.testing.assert_allclose(update[n], want, rtol=1e-6, atol=1e-7)
            np.testing.assert_array_equal(update[n], np.broadcast_to(update[n][0], update[n].shape))
        # A worker's link: the whole message to each server plus the dense pull; the small
        # leaf pushed and pulled dense, split by key range.
        want_bytes = (m * cap * (4 + 4) + 300 * 4) + 2 * 5 * 4
        np.testing.assert_array_equal(host.wire_bytes, want_bytes)


def test_sparsifier_server_group_equals_one_server_and_global_granularity(mesh):
    g = np.random.default_rng(3).standard_normal((N, 97)).astype(np.float32)
    updates = {}
    for m in (1, 4):
        tx = jaxcomp.top_k(
            0.1, axis_name="data", exchange="server", servers=m, granularity="global"
        )
        state = _stacked_state(tx, mesh, {"w": np.zeros(97, np.float32)})
        updates[m] = np.asarray(mesh_update(tx, mesh)(put(mesh, {"w": g}), state)[0]["w"])
    # The same additions in the same order, split over servers: the same bits.
    np.testing.assert_array_equal(updates[4], updates[1])


def test_fewer_elements_than_servers_pushes_only_to_servers_with_a_range(mesh):
    # 3 elements over 4 servers: ranges of 1, 1, 1 and 0 positions; k = 2, capacity 3.
    g = np.random.default_rng(4).standard_normal((N, 3)).astype(np.float32)
    tx = jaxcomp.top_k(0.5, axis_name="data", exchange="server", servers=4)
    state = _stacked_state(tx, mesh, {"w": np.zeros(3, np.float32)})
    update, state = jax.device_get(mesh_update(tx, mesh)(put(mesh, {"w": g}), state))
    sent = np.zeros_like(g)
    for d in range(N):
        top = np.argsort(-np.abs(g[d]), kind="stable")[:2]
        sent[d, top] = g[d, top]
    np.testing.assert_allclose(update["w"][0], sent.mean(0), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(state.wire_bytes, 3 * 3 * 8 + 3 * 4)


QUANT_SIZES = {"a": 300, "b": 100, "c": 100, "d": 40, "e": 8}  # e: sent dense


@pytest.mark.parametrize("m", GROUPS)
def test_quantizer_server_group_matches_numpy(mesh, m):
    tx = jaxcomp.ef_sign_sgd(axis_name="data", exchange="server", servers=m, min_dense_size=16)
    zeros = {n: np.zeros(s, np.float32) for n, s in QUANT_SIZES.items()}
    state = _stacked_state(tx, mesh, zeros)
    step = mesh_update(tx, mesh)
    rng = np.random.default_rng(20 + m)
    residual = {n: np.zeros((N, s), np.float32) for n, s in QUANT_SIZES.items()}
    for _ in range(2):
        g = {n: rng.standard_normal((N, s)).astype(np.float32) for n, s in QUANT_SIZES.items()}
        update, state = step(put(mesh, g), state)
        update, host = jax.device_get((update, state))
        for n in QUANT_SIZES:
            acc = residual[n] + g[n]
            sent = acc if n == "e" else np.stack([sign_codec(acc[d]) for d in range(N)])
            residual[n] = acc - sent
            np.testing.assert_allclose(host.residual[n], residual[n], rtol=1e-6, atol=1e-6)
            want = np.broadcast_to(np_server_mean(sent), update[n].shape)
            np.testing.assert_allclose(update[n], want, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(update[n], np.broadcast_to(update[n][0], update[n].shape))
    # Messages: packed signs and one float32 scale per leaf; each worker pushes its
    # messages (to whichever server holds the leaf) and pulls the dense means.
    message = {n: -(-s // 8) + 4 for n, s in QUANT_SIZES.items() if n != "e"}
    want = sum(message[n] + QUANT_SIZES[n] * 4 for n in message) + 2 * 8 * 4
    np.testing.assert_array_equal(host.wire_bytes, want)
    np.testing.assert_array_equal(host.message_bytes["a"], message["a"])
    # Per server (assign_to_servers's rule, checked above): N - 1 pushes in, pulls out.
    shares = {1: [("abcd")], 2: ["a", "bcd"], 4: ["a", "b", "c", "d"]}[m]
    link = comm.server_link_bytes(
        [sum(message[n] for n in share) for share in shares],
        [sum(QUANT_SIZES[n] * 4 for n in share) for share in shares],
        N,
    )
    assert link["server_out"] == tuple((N - 1) * sum(QUANT_SIZES[n] * 4 for n in s) for s in shares)
    # Round r of the group is ONE ppermute per buffer whatever M (the shares
    # padded to the largest): signs (uint8) and scales (float32) pushed, the
    # float32 means pulled, and the dense leaf e pushed and pulled.
    text = step.lower(put(mesh, g), state).as_text()
    assert text.count("collective_permute") == 5 * (N - 1)


def test_bad_servers_raise(mesh):
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, "):
        jaxcomp.top_k(0.1, axis_name="data", exchange="server", servers=0)
    with pytest.raises(ValueError, match="servers must be 1 unless exchange='server'"):
        jaxcomp.top_k(0.1, axis_name="data", exchange="allgather", servers=2)
    with pytest.raises(ValueError, match="servers must be 1 unless exchange='server'"):
        jaxcomp.qsgd(bits=4, axis_name="data", servers=2)
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, "):
        jaxcomp.onebit(axis_name="data", exchange="server", servers=1.5)
    # One device (axis_name=None): no group to spread the servers over.
    for factory in (lambda **k: jaxcomp.top_k(0.1, **k), lambda **k: jaxcomp.qsgd(bits=4, **k)):
        with pytest.raises(ValueError, match="servers must be 1 with axis_name=None"):
            factory(exchange="server", servers=2)
        factory(exchange="server", servers=1)
    # The group's static helpers name the argument they refuse.
    with pytest.raises(ValueError, match=r"n_devices must be an integer in \[1, "):
        comm.server_devices(0, 1)
    with pytest.raises(ValueError, match=r"size must be an integer in \[0, "):
        comm.server_ranges(-5, 2)
    with pytest.raises(ValueError, match=r"nbytes\[0\] must be a finite real number in \[0, "):
        comm.assign_to_servers([-1, 2], 2)
    # A formula's float byte counts are balanced as the integers are.
    assert comm.assign_to_servers([42.0, 17.5, 17.5, 9.0], 2) == ((0,), (1, 2, 3))
    with pytest.raises(ValueError, match=r"servers must be an integer in \[1, "):
        comm.assign_to_servers([1, 2], 0)
    # More servers than devices: known when the update is traced on the mesh.
    for tx in (
        jaxcomp.top_k(0.1, axis_name="data", exchange="server", servers=N + 1),
        jaxcomp.ef_sign_sgd(axis_name="data", exchange="server", servers=N + 1),
    ):
        state = _stacked_state(tx, mesh, {"w": np.zeros(64, np.float32)})
        grads = put(mesh, {"w": np.ones((N, 64), np.float32)})
        with pytest.raises(ValueError, match=r"servers must be an integer in \[1, 8\], got 9"):
            mesh_update(tx, mesh)(grads, state)


F16_MAX = 65504.0


def test_float16_saturation_cut_is_kept_by_each_leafs_server():
    """Two servers, one leaf each: what float16 saturation cuts off a leaf's mean stays in
    the residual of that leaf's server (nothing lost), the mean saturated as numpy's."""
    n_dev = 4
    mesh4 = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
    col = np.array(
        [[98304, -98304, 3], [98304, -98304, -1000], [65536, -65536, 7], [32768, -32768, 1]],
        np.float32,
    )  # every value / 4 is exact in float16
    g = {"v": col, "w": -col[:, ::-1].copy()}
    tx = jaxcomp.cast(
        jnp.float16,
        accumulation_dtype=jnp.float16,
        axis_name="data",
        exchange="server",
        servers=2,
        error_feedback=True,
    )
    state = put(mesh4, jax.vmap(tx.init)(g))
    u, state = jax.device_get(mesh_update(tx, mesh4)(put(mesh4, g), state))
    owners = dict(zip("vw", comm.server_devices(n_dev, 2), strict=True))  # v: 0, w: 2
    for name, x in g.items():
        total = np.zeros(x.shape[1])
        for row in x.astype(np.float64):  # each message / N, partial sums saturated
            total = np.clip(total + row / n_dev, -F16_MAX, F16_MAX).astype(np.float16)
            total = total.astype(np.float64)
        upd = np.asarray(u[name], np.float64)
        np.testing.assert_array_equal(upd, np.broadcast_to(total, upd.shape))
        res = np.asarray(state.residual[name], np.float64)
        np.testing.assert_array_equal(res.sum(0) + n_dev * upd[0], x.astype(np.float64).sum(0))
        others = [d for d in range(n_dev) if d != owners[name]]
        np.testing.assert_array_equal(res[others], 0)  # the cut is the server's alone
        assert np.abs(res[owners[name]]).max() > 0


def test_sparsifier_server_group_edge_leaves_and_a_nan_device(mesh):
    """bfloat16, scalar and empty leaves and a device with a NaN gradient (skipped): the
    group of 4 servers gives the single server's update bit for bit, and the skipped
    device keeps its residual."""
    rng = np.random.default_rng(7)
    g = {
        "a": rng.standard_normal((N, 203)).astype(jnp.bfloat16),
        "b": rng.standard_normal((N,)).astype(np.float32),
        "c": np.zeros((N, 0), np.float32),
        "d": rng.standard_normal((N, 64)).astype(np.float32),
    }
    g["d"][3, 5] = np.nan  # device 3 sends nothing this step
    out = {}
    for m in (1, 4):
        tx = jaxcomp.top_k(0.1, axis_name="data", exchange="server", servers=m)
        state = _stacked_state(tx, mesh, jax.tree.map(lambda x: x[0], g))
        out[m] = jax.device_get(mesh_update(tx, mesh)(put(mesh, g), state))
    for name in g:
        np.testing.assert_array_equal(
            np.asarray(out[4][0][name], np.float32), np.asarray(out[1][0][name], np.float32)
        )
        np.testing.assert_array_equal(
            np.asarray(out[4][1].residual[name], np.float32),
            np.asarray(out[1][1].residual[name], np.float32),
        )
    # The skipped device's residual is what it had (zeros): its gradient is not kept.
    assert all(np.all(np.asarray(out[4][1].residual[n])[3] == 0) for n in g)
    # The mean is over the 8 devices, device 3 contributing zeros (numpy, float64).
    acc = g["d"].astype(np.float64)
    sent = np.zeros_like(acc)
    for d in range(N):
        if d != 3:
            top = np.argsort(-np.abs(acc[d]), kind="stable")[: math.ceil(0.1 * 64)]
            sent[d, top] = acc[d, top]
    np.testing.assert_allclose(out[4][0]["d"][0], sent.mean(0), rtol=1e-6, atol=1e-7)
