"""Sparsifier message formats (issue 38) against numpy references.

- ``value_dtype``: float16 / bfloat16 values (DGC's ``fp16_values``): the
  update is the mean over 8 devices of the pairs with their values rounded
  (float16: saturated at 65504); the rounding and the saturation stay in the
  residual, bit for bit.
- ``index_dtype="uint16"``: 16-bit indices for index spaces of fewer than
  ``2^16`` elements (DGC's ``int32_indices`` one step further), counted in
  ``message_bytes`` and ``wire_bytes`` and moved as ``uint16`` by the all-gather.
- ``random_k(shared_indices=True)`` (GRACE's ``RandomKCompressor``): the same
  coordinates on every device, the values alone exchanged; the update is the
  mean over devices at those coordinates.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import k_of, mesh_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.comm import sparse_allreduce

N_DEV = 8
NUMPY_DTYPE = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _mesh():
    assert jax.device_count() >= N_DEV
    return jax.make_mesh((N_DEV,), ("data",))


def _on_mesh(tx, mesh):
    """``(step, put)``: the per-device update on stacked rows, and the row placement."""
    sharding = NamedSharding(mesh, P("data"))
    put = lambda t: jax.device_put(t, sharding)  # noqa: E731
    return mesh_update(tx, mesh), put


def _stacked_init(tx, tree):
    one = tx.init(jax.tree.map(lambda a: a[0], tree))
    return jax.tree.map(lambda a: np.stack([np.asarray(a)] * N_DEV), one)


def _wire(values: np.ndarray, dtype: str) -> np.ndarray:
    """numpy reference of a 16-bit wire value, back in float32: float16 saturates at 65504."""
    if dtype == "float16":
        values = np.clip(values, -65504.0, 65504.0)
    return values.astype(NUMPY_DTYPE[dtype]).astype(np.float32)


def _ref_top_k(acc: np.ndarray, k: int, dtype: str | None):
    """One device's top-k message (dense, float32 as it arrives) and its new residual."""
    flat = acc.reshape(-1)
    idx = np.sort(np.argsort(-np.abs(flat), kind="stable")[:k])
    sent = np.zeros_like(flat)
    sent[idx] = flat[idx] if dtype is None else _wire(flat[idx], dtype)
    res = flat.copy()
    res[idx] = flat[idx] - sent[idx]  # the rounding (and saturation) stays
    return sent.reshape(acc.shape), res.reshape(acc.shape), idx


def _allgather_mean(sent: np.ndarray) -> np.ndarray:
    """The all-gather's mean: each device's (float32) values / N, added device by device."""
    out = np.zeros(sent.shape[1:], np.float32)
    for d in range(sent.shape[0]):
        out = out + sent[d] / np.float32(N_DEV)
    return out


def _allreduce_bytes(nbytes: float) -> float:
    return 2.0 * (N_DEV - 1) / N_DEV * nbytes


# ---------------------------------------------------------------------------
# 16-bit values.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("exchange", ["allgather", "dense"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16bit_values_mean_over_devices_and_nothing_lost(dtype, exchange):
    """8 devices, two steps: the mean of the rounded pairs, each device's residual
    bit for bit, message and wire bytes from the formulas."""
    mesh = _mesh()
    ratio, min_dense = 0.05, 5
    spec = {"w": (40, 30), "b": (5,)}  # b: at most min_dense_size, sent dense
    tx = jaxcomp.top_k(
        ratio, axis_name="data", value_dtype=dtype, exchange=exchange, min_dense_size=min_dense
    )
    step, put = _on_mesh(tx, mesh)
    rng = np.random.default_rng(0)
    grads = [
        {k: rng.laplace(size=(N_DEV, *s)).astype(np.float32) for k, s in spec.items()}
        for _ in range(2)
    ]
    state = put(_stacked_init(tx, grads[0]))
    res = {k: np.zeros((N_DEV, *s), np.float32) for k, s in spec.items()}
    eps = float(jnp.finfo(dtype).eps)
    for g in grads:
        upd, state = jax.device_get(step(put(g), put(state)))
        k = k_of(ratio, 1200)
        cap = math.ceil(1.5 * k)
        for leaf in spec:
            acc = res[leaf] + g[leaf]
            if leaf == "w":
                refs = [_ref_top_k(acc[d], k, dtype) for d in range(N_DEV)]
                sent = np.stack([r[0] for r in refs])
                new_res = np.stack([r[1] for r in refs])
            else:  # sent whole, rounded to the wire dtype
                sent = _wire(acc, dtype)
                new_res = acc - sent
            got = np.asarray(upd[leaf])
            assert got.dtype == np.float32
            assert all(np.array_equal(got[d], got[0]) for d in range(N_DEV)), leaf
            # Nothing lost: each device's residual is its accumulator minus its
            # rounded message, bit for bit.
            np.testing.assert_array_equal(np.asarray(state.residual[leaf]), new_res, leaf)
            if leaf == "w" and exchange == "allgather":
                # Gathered in 16 bits, added in float32 (DGC decompresses to float32).
                np.testing.assert_allclose(got[0], _allgather_mean(sent), rtol=1e-6, atol=1e-7)
            else:  # an all-reduce adds in the 16-bit dtype it moves
                mean = sent.astype(np.float64).mean(axis=0)
                np.testing.assert_allclose(got[0], mean, rtol=4 * eps, atol=4 * eps * 1e-2)
            res[leaf] = new_res
        stats = jaxcomp.statistics(state)
        np.testing.assert_array_equal(stats["message_bytes"]["w"], [k * (4 + 2)] * N_DEV)
        np.testing.assert_array_equal(stats["message_bytes"]["b"], [5 * 2] * N_DEV)
        if exchange == "allgather":
            wire = (N_DEV - 1) * cap * (4 + 2) + _allreduce_bytes(5 * 2)
        else:
            wire = _allreduce_bytes(1200 * 2) + _allreduce_bytes(5 * 2)
        np.testing.assert_allclose(np.asarray(state.wire_bytes), wire, rtol=1e-6)


def test_float16_overflow_tiny_leaves_and_nan_one_device():
    """One device, float16 values: |acc| > 65504 is sent saturated and the excess
    waits in the residual (sent on later steps), bit for bit; a bfloat16 leaf
    keeps its own dtype; scalar and empty leaves; a NaN step sends nothing."""
    tx = jaxcomp.top_k(0.25, value_dtype="float16")
    spec = {"w": ((16,), np.float32), "h": ((8,), ml_dtypes.bfloat16), "s": ((), np.float32)}
    spec["e"] = ((0,), np.float32)
    zeros = {k: jnp.zeros(s, dt) for k, (s, dt) in spec.items()}
    state = tx.init(zeros)
    update = jax.jit(tx.update)
    w0 = np.zeros(16, np.float32)
    w0[[1, 5, 9]] = [1.0e5, -3.0e5, 7.0e4]
    steps = [
        {"w": w0, "h": np.arange(8, dtype=np.float32) - 3.5, "s": np.float32(2.5)},
        {"w": np.zeros(16, np.float32), "h": np.ones(8, np.float32), "s": np.float32(1e5)},
        {"w": np.full(16, np.nan, np.float32), "h": np.ones(8, np.float32), "s": np.float32(0)},
        {"w": np.zeros(16, np.float32), "h": np.zeros(8, np.float32), "s": np.float32(0)},
    ]
    res = {k: np.zeros(s, np.float32) for k, (s, _) in spec.items()}
    total_sent = np.zeros(16, np.float64)
    for t, raw in enumerate(steps):
        g = {k: jnp.asarray(np.asarray(v)).astype(spec[k][1]) for k, v in raw.items()}
        g["e"] = zeros["e"]
        upd, state = update(g, state)
        assert all(upd[k].dtype == spec[k][1] for k in spec)
        if t == 2:  # NaN: skipped, the residual kept, nothing sent
            assert int(state.nonfinite_steps) == 1
            for k in spec:
                assert not np.any(np.asarray(upd[k], np.float32)), k
                np.testing.assert_array_equal(np.asarray(state.residual[k]), res[k], k)
            continue
        for k in ("w", "h", "s"):
            acc = res[k] + np.asarray(g[k], np.float32)
            n = acc.size
            kk = k_of(0.25, n)
            # h: a bfloat16 leaf is sent in bfloat16 (no narrower), not float16.
            sent, new_res, _ = _ref_top_k(acc, kk, "float16" if k != "h" else "bfloat16")
            got = np.asarray(upd[k], np.float32)
            np.testing.assert_array_equal(got, sent, k)
            np.testing.assert_array_equal(np.asarray(state.residual[k]), new_res, k)
            assert np.array_equal(got + new_res, acc), k  # nothing lost, bit for bit
            assert np.all(np.abs(got) <= 65504), k
            res[k] = new_res
        total_sent += np.asarray(upd["w"], np.float64)
        stats = jaxcomp.statistics(state)
        assert int(stats["message_bytes"]["w"]) == int(stats["sent_count"]["w"]) * (4 + 2)
        assert int(stats["message_bytes"]["h"]) == int(stats["sent_count"]["h"]) * (4 + 2)
        assert int(stats["message_bytes"]["e"]) == 0
    # Step 0 sent 65504 where |g| was larger; the excess went out later (or waits).
    np.testing.assert_array_equal(total_sent + res["w"], w0.astype(np.float64))
    assert abs(total_sent[5]) > 65504  # -3e5 needed more than one message


def test_value_dtype_under_optax_wrappers():
    """chain and MultiSteps: the 16-bit message reaches the optimizer (one device)."""
    tx = optax.chain(jaxcomp.top_k(0.5, value_dtype="bfloat16"), optax.sgd(1.0))
    tx = optax.MultiSteps(tx, every_k_schedule=2)
    g = {"w": jnp.asarray(np.random.default_rng(3).laplace(size=10).astype(np.float32))}
    state = tx.init(g)
    step = jax.jit(tx.update)
    upd, state = step(g, state)
    assert not np.any(np.asarray(upd["w"]))  # the first of two micro-steps
    upd, state = step(g, state)
    acc = np.asarray(g["w"])  # MultiSteps passes the mean of the two (equal) gradients
    sent, _, _ = _ref_top_k(acc, 5, "bfloat16")
    np.testing.assert_array_equal(np.asarray(upd["w"]), -sent)


# ---------------------------------------------------------------------------
# 16-bit indices.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("selector", ["top_k", "sort_top_k"])  # packed and 1-D engines
def test_uint16_indices_mean_bytes_and_collective(selector):
    """A leaf of 300 elements sends uint16 indices, one of 70000 int32; the
    all-gather really moves uint16 and the update is the numpy mean."""
    mesh = _mesh()
    ratio = 0.01
    tx = jaxcomp.sparsify(
        selector, ratio, axis_name="data", exchange="allgather", index_dtype="uint16",
        value_dtype="bfloat16",
    )  # fmt: skip
    step, put = _on_mesh(tx, mesh)
    rng = np.random.default_rng(1)
    g = {
        "a": rng.laplace(size=(N_DEV, 300)).astype(np.float32),
        "b": rng.laplace(size=(N_DEV, 70000)).astype(np.float32),
    }
    state = put(_stacked_init(tx, g))
    hlo = step.lower(put(g), state).as_text()
    gathered = set(re.findall(r"all_gather.*?-> tensor<\d+x(\d+)x(\w+)>", hlo))
    k_a, k_b = k_of(ratio, 300), k_of(ratio, 70000)
    cap_a, cap_b = math.ceil(1.5 * k_a), math.ceil(1.5 * k_b)
    assert (str(cap_a), "ui16") in gathered and (str(cap_b), "i32") in gathered, gathered
    assert not any(t.startswith("i") and c == str(cap_a) and t != "i32" for c, t in gathered)
    upd, state = jax.device_get(step(put(g), put(state)))
    for leaf, k in (("a", k_a), ("b", k_b)):
        sent = np.stack([_ref_top_k(g[leaf][d], k, "bfloat16")[0] for d in range(N_DEV)])
        got = np.asarray(upd[leaf])[0]
        np.testing.assert_allclose(got, _allgather_mean(sent), rtol=1e-6, atol=1e-7)
    stats = jaxcomp.statistics(state)
    np.testing.assert_array_equal(stats["message_bytes"]["a"], [k_a * (2 + 2)] * N_DEV)
    np.testing.assert_array_equal(stats["message_bytes"]["b"], [k_b * (4 + 2)] * N_DEV)
    wire = (N_DEV - 1) * (cap_a * (2 + 2) + cap_b * (4 + 2))
    np.testing.assert_allclose(np.asarray(state.wire_bytes), wire, rtol=1e-6)


def test_uint16_indices_follow_the_group_index_space():
    """A merged group addresses its whole buffer: two leaves of 40000 (80000 >= 2^16)
    send int32 indices, a leaf of 40000 alone uint16; the default stays int32."""
    g = {"x": jnp.ones((40000,)) * np.arange(40000) % 97, "y": jnp.ones((40000,)), "z": jnp.ones(9)}
    for groups, index_dtype, want in (
        ([["['x']", "['y']"]], "uint16", {"x": 4, "y": 4, "z": 2}),
        (None, "uint16", {"x": 2, "y": 2, "z": 2}),
        (None, None, {"x": 4, "y": 4, "z": 4}),
    ):
        tx = jaxcomp.top_k(0.01, groups=groups, index_dtype=index_dtype)
        _, state = jax.jit(tx.update)(g, tx.init(g))
        stats = jaxcomp.statistics(state)
        for leaf, index in want.items():
            count = int(stats["sent_count"][leaf])
            assert int(stats["message_bytes"][leaf]) == count * (index + 4), (groups, leaf)


# ---------------------------------------------------------------------------
# random_k with shared indices.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("exchange", ["auto", "dense"])
def test_random_k_shared_indices_mean_and_values_only_bytes(exchange):
    """Every device sends the same k coordinates; the update is GRACE's mean over
    devices at them; only the values travel (one all-reduce of k values). A NaN
    device sends zeros there and keeps its residual."""
    mesh = _mesh()
    ratio = 0.02
    spec = {"w": (40, 30), "v": (333,)}
    tx = jaxcomp.random_k(ratio, axis_name="data", shared_indices=True, exchange=exchange)
    step, put = _on_mesh(tx, mesh)
    rng = np.random.default_rng(2)
    g0 = {k: rng.laplace(size=(N_DEV, *s)).astype(np.float32) for k, s in spec.items()}
    state = put(_stacked_init(tx, g0))
    res = {k: np.zeros((N_DEV, *s), np.float32) for k, s in spec.items()}
    seen = []
    for t in range(3):
        g = {k: rng.laplace(size=(N_DEV, *s)).astype(np.float32) for k, s in spec.items()}
        skip = t == 2
        if skip:
            g["v"][3, 7] = np.nan  # device 3 skips this step
        upd, state = jax.device_get(step(put(g), put(state)))
        for leaf, shape in spec.items():
            n = math.prod(shape)
            k = k_of(ratio, n)
            acc = res[leaf] + np.nan_to_num(g[leaf])
            new_res = np.asarray(state.residual[leaf])
            ok = [d for d in range(N_DEV) if not (skip and d == 3)]
            # The coordinates each device cleared from its residual: the same k everywhere.
            idx = [np.flatnonzero((acc[d] != new_res[d]).reshape(-1)) for d in ok]
            assert len(idx[0]) == k and all(np.array_equal(i, idx[0]) for i in idx), leaf
            if skip:  # the skipping device keeps its residual, sends nothing
                np.testing.assert_array_equal(new_res[3], res[leaf][3])
            for d in ok:  # sent exactly acc there (float32 values): nothing lost
                assert not np.any(new_res[d].reshape(-1)[idx[0]])
            want = np.zeros(n, np.float64)
            want[idx[0]] = np.sum([acc[d].reshape(-1)[idx[0]] for d in ok], axis=0) / N_DEV
            got = np.asarray(upd[leaf])
            assert all(np.array_equal(got[d], got[0]) for d in range(N_DEV))
            np.testing.assert_allclose(got[0].reshape(-1), want, rtol=1e-6, atol=1e-7)
            if leaf == "w":
                seen.append(idx[0])
            res[leaf] = new_res
        stats = jaxcomp.statistics(state)
        k_w, k_v = k_of(ratio, 1200), k_of(ratio, 333)
        sent_w = np.asarray(stats["sent_count"]["w"])
        np.testing.assert_array_equal(np.asarray(stats["message_bytes"]["w"]), sent_w * 4)
        if exchange == "auto":  # values only: an all-reduce of k float32
            wire = _allreduce_bytes(k_w * 4) + _allreduce_bytes(k_v * 4)
            pairs = (N_DEV - 1) * (k_w + k_v) * (4 + 4)  # random_k's all-gather of pairs
            assert wire < pairs / 2
        else:
            wire = _allreduce_bytes(1200 * 4) + _allreduce_bytes(333 * 4)
        np.testing.assert_allclose(np.asarray(state.wire_bytes)[0], wire, rtol=1e-6)
    assert not np.array_equal(seen[0], seen[1])  # fresh draws each step


# ---------------------------------------------------------------------------
# Bad combinations.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: jaxcomp.top_k(0.1, value_dtype="int8"), "value_dtype"),
        (lambda: jaxcomp.top_k(0.1, value_dtype="float32"), "value_dtype"),
        (lambda: jaxcomp.ldte_bs(0.1, index_dtype="int8"), "index_dtype"),
        (lambda: jaxcomp.dgc(0.1, index_dtype="uint32"), "index_dtype"),
        (lambda: jaxcomp.sparsify("top_k", 0.1, shared_indices=True), "shared_indices"),
        (lambda: jaxcomp.random_k(0.1, shared_indices="yes"), "shared_indices"),
    ]
    + [
        (
            lambda e=e, o=o: jaxcomp.random_k(0.1, axis_name="data", exchange=e, **o),
            next(iter(o)),
        )
        for e in ("gtopk", "oktopk", "scalecom", "server", "gossip", "scatter", "sparcml")
        for o in (
            {"value_dtype": "float16"},
            {"index_dtype": "uint16"},
            {"shared_indices": True},
        )
    ],
)
def test_bad_combinations_raise(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_shared_indices_refuse_backup_workers_and_exchange_refuses_16bit():
    mesh = _mesh()
    tx = jaxcomp.random_k(0.1, axis_name="data", shared_indices=True)
    g = {"w": jnp.ones((N_DEV, 64))}

    def run(g, s):
        return tx.update(jax.tree.map(lambda a: a[0], g), s, include=jnp.bool_(True))[0]

    f = jax.shard_map(run, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="shared_indices"):
        jax.eval_shape(
            f, jax.device_put(g, NamedSharding(mesh, P("data"))), tx.init({"w": g["w"][0]})
        )

    def gtopk(i, v):
        return sparse_allreduce.exchange("gtopk", i, v, 100, "data").update

    f = jax.shard_map(gtopk, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    with pytest.raises(ValueError, match="16-bit indices"):
        jax.eval_shape(f, jnp.zeros(4, jnp.uint16), jnp.zeros(4))
