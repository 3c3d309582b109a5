"""The two-level (node x local) exchange against numpy references (issue 37).

The references are written here from the algorithm of
``jaxcomp/transforms/two_level.py``'s docstring, not from its code: per node
the mean of its ``L`` devices' gradients; a leaf viewed as ``M`` rows of ``R``
elements, padded with zero rows to a multiple of ``L`` and split into ``L``
contiguous blocks (device ``l`` of a node owns block ``l``); on each block the
compressor's own algorithm with error feedback, exchanged over the node axis
only (the mean over nodes of the decoded messages); the blocks reassembled.
Each step's reference starts from the library's previous state (as the other
compressor tests do), so a rounding difference cannot drift.

Runs under raw ``jax.shard_map`` + ``jax.jit`` on the ``("node", "local")``
mesh of the 8 simulated devices (tests/conftest.py), as 2x4 and 4x2, and as
1x8 and 8x1 where cheap. Device ``d`` of the stacked inputs is node
``d // L``, local ``d % L``. Gradients are dyadic (multiples of ``2^-12``,
bfloat16 ones small multiples of ``1/8``), so the node mean is exact in any
summation order and the accumulators, selections and sparsifier residuals can
be compared bit for bit; means over more than two nodes and float64
references of float32 arithmetic are compared to a tolerance.
"""

from __future__ import annotations

import functools
import math

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import bits, cap_of, expected_sent, f32, k_of, ref_threshold
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_groups import by_path, ref_groups
from test_powersgd import _close, _hook_plan, _ref_step

import jaxcomp

AX = ("node", "local")
N = 8
MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]
BF16 = jnp.bfloat16


# ---------------------------------------------------------------------------
# Running a compressor on the mesh.
# ---------------------------------------------------------------------------


@functools.cache
def _mesh(nodes: int, local: int):
    return jax.make_mesh((nodes, local), AX)


def _first(tree):
    return jax.tree.map(lambda a: a[0], tree)


def _stack(tree):
    return jax.tree.map(lambda a: jnp.asarray(a)[None], tree)


class Runner:
    """``tx.init`` and ``tx.update`` under ``jax.jit(jax.shard_map(...))`` on a 2-level mesh.

    Inputs and outputs are stacked per device (leading axis ``N``); outputs come
    back as numpy. ``traces`` counts how often the update was traced.
    """

    def __init__(self, tx, mesh):
        self.mesh, self.traces = mesh, 0

        def step(g, s):
            self.traces += 1
            return _stack(tx.update(_first(g), _first(s)))

        spec = P(AX)
        shard = functools.partial(
            jax.shard_map, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False
        )
        self._init = jax.jit(shard(lambda g: _stack(tx.init(_first(g)))))
        self._step = jax.jit(shard(step))

    def put(self, tree):
        return jax.device_put(tree, NamedSharding(self.mesh, P(AX)))

    def init(self, g):
        return jax.device_get(self._init(self.put(g)))

    def __call__(self, g, state):
        return jax.device_get(self._step(self.put(g), self.put(state)))


def _grads(rng, spec, scale=1.0):
    """Per-device gradients ``{name: (N, *shape)}``: dyadic, so node means are exact."""

    def leaf(s):
        shape, dtype = s
        if jnp.dtype(dtype) == jnp.dtype(BF16):  # 1/8 steps, |x| <= 15/8: node sums exact
            return (rng.integers(-15, 16, size=(N, *shape)) / 8).astype(dtype)
        x = np.clip(rng.normal(0.0, scale, size=(N, *shape)), -8 * scale, 8 * scale)
        return (np.round(x * 2.0**12) / 2.0**12).astype(dtype)

    return jax.tree.map(leaf, spec, is_leaf=_is_spec)


def _is_spec(x):
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], tuple)


def _same_on_every_device(upd):
    for path, u in by_path(upd).items():
        for d in range(N):
            assert bits(u[d]) == bits(u[0]), (path, d)


# ---------------------------------------------------------------------------
# The shard layout, written from the docstring.
# ---------------------------------------------------------------------------


def _rows(shape, row_length=1):
    n = math.prod(shape)
    r = row_length if len(shape) >= 2 else 1
    return n // r, r


def blocks(x, local, row_length=1):
    """``(local, rows * R)``: the leaf's rows zero-padded to a multiple of ``local``, split."""
    m, r = _rows(x.shape, row_length)
    rows = -(-m // local)
    flat = np.zeros((rows * local, r), x.dtype)
    flat[:m] = np.reshape(x, (m, r))
    return flat.reshape(local, rows * r)


def unblock(b, shape, row_length=1):
    """The leaf from its ``local`` blocks (padding dropped)."""
    m, r = _rows(shape, row_length)
    return np.asarray(b).reshape(-1, r)[:m].reshape(shape)


def node_means(g, nodes, local, row_length=1):
    """``(nodes, local, shard)``: each node's mean of its devices' gradients, in blocks.

    Computed in float64 and rounded once to the gradient dtype (exact for
    dyadic gradients, whatever order the library sums in)."""
    x = np.asarray(g).astype(np.float64)
    per = np.stack([blocks(x[d], local, row_length) for d in range(N)])
    mean = per.reshape(nodes, local, local, -1).mean(axis=1)
    return mean.astype(g.dtype)


def _dev(j, local, l):  # noqa: E741
    return j * local + l


def check_invariant(
    g, old_res, upd, new_res, nodes, local, row_length=None, what="", wire16=False, scaling=(1, 1)
):
    """``L sum_d e_new + N u == L sum_d e_old + sum_d g`` on every leaf (float64, rounding).

    ``old_res``/``new_res``: residual trees stacked per device (None: zero). ``wire16``:
    16-bit message values (``value_dtype``), whose sums are rounded to 16 bits.
    ``scaling``: GRACE's residual scaling ``(beta, gamma)``, each node's shard compressing
    ``beta e + gamma m`` of its node mean ``m``: ``L beta sum_d e_old + gamma sum_d g``."""
    old_res, new_res = (None if x is None else by_path(x) for x in (old_res, new_res))
    upd = by_path(upd)
    for path, gl in by_path(g).items():
        shape = gl.shape[1:]
        r = 1 if row_length is None else row_length(shape)

        def placed(res, path=path, shape=shape, r=r):
            if res is None:
                return np.zeros(shape)
            e = np.asarray(res[path], np.float64).reshape(nodes, local, -1)
            return sum(unblock(e[j], shape, r) for j in range(nodes))

        lhs = local * placed(new_res) + N * f32(upd[path][0]).astype(np.float64)
        beta, gamma = scaling
        rhs = local * beta * placed(old_res) + gamma * f32(gl).astype(np.float64).sum(axis=0)
        scale = max(1.0, float(np.max(np.abs(rhs), initial=0.0)))
        wide = gl.dtype == np.float32 and not wire16
        tol = 2e-6 * N * scale if wide else 2e-2 * N * scale
        err = float(np.max(np.abs(lhs - rhs), initial=0.0))
        assert err <= tol, (what, path, err, tol)


# ---------------------------------------------------------------------------
# 1a. A sparsifier: top_k with groups and DGC's warm-up.
# ---------------------------------------------------------------------------


def ref_sparse_step(g, old_res, nodes, local, ratio, groups=None, skip=(), zero=False):
    """Expected ``(update, residual)`` (by path) of exact top-k on the shards.

    ``skip``: ``(node, local)`` devices that send nothing and keep their residual
    (nonfinite="skip"); ``zero``: non-finite shard elements count as 0.
    """
    gp = by_path(g)
    res = {p: np.asarray(v) for p, v in by_path(old_res).items()}
    s = {p: node_means(x, nodes, local) for p, x in gp.items()}
    if zero:
        s = {p: np.where(np.isfinite(f32(x)), x, 0).astype(x.dtype) for p, x in s.items()}
    msg = {p: np.zeros((nodes, local, s[p].shape[-1])) for p in gp}
    new_res = {p: np.array(v) for p, v in res.items()}
    for j in range(nodes):
        for l in range(local):  # noqa: E741
            if (j, l) in skip:
                continue
            d = _dev(j, local, l)
            for group in ref_groups(g, groups or []):
                accs = [res[p][d] + f32(s[p][j, l]) for p in group]
                acc = np.concatenate(accs)
                n = acc.size
                if n == 0:
                    continue
                k = k_of(ratio, n)
                sent = np.zeros(n, bool)
                sent[expected_sent(acc, ref_threshold(acc, k), cap_of(k, n))] = True
                start = 0
                for p, a in zip(group, accs, strict=True):
                    part = np.where(sent[start : start + a.size], a, 0).astype(gp[p].dtype)
                    start += a.size
                    msg[p][j, l] = f32(part)
                    new_res[p][d] = a - f32(part)
    upd = {p: unblock(msg[p].mean(axis=0), gp[p].shape[1:]) for p in gp}
    return upd, new_res


def check_sparse_step(g, upd, new, ref_upd, ref_res):
    _same_on_every_device(upd)
    got_res = by_path(new.inner.residual)
    for p, u in by_path(upd).items():
        assert u.dtype == by_path(g)[p].dtype and u.shape == by_path(g)[p].shape, p
        np.testing.assert_array_equal(got_res[p], ref_res[p], err_msg=p)  # bit for bit
        tol = 1e-6 if u.dtype == np.float32 else 2**-7
        scale = float(np.max(np.abs(ref_upd[p]), initial=0.0))
        np.testing.assert_allclose(f32(u[0]), ref_upd[p], rtol=0, atol=tol * scale, err_msg=p)
        np.testing.assert_array_equal(f32(u[0]) != 0, ref_upd[p] != 0, err_msg=p)


SPARSE_SPEC = {
    "conv": {"kernel": ((12, 10), np.float32), "bias": ((10,), np.float32)},
    "dense": {"kernel": ((203,), np.float32), "bias": ((5,), np.float32)},
    "emb": ((64,), BF16),
}
GROUPS = [["['conv']['kernel']", "['conv']['bias']"], ["['emb']", "['dense']['kernel']"]]


@pytest.mark.parametrize("nodes,local", MESHES)
def test_top_k_groups_and_warmup_match_numpy(nodes, local):
    ratio = 0.01
    tx = jaxcomp.top_k(
        ratio,
        groups=GROUPS,
        warmup_ratios=jaxcomp.DGC_WARMUP,
        steps_per_epoch=1,
        axis_name=AX,
    )
    run = Runner(tx, _mesh(nodes, local))
    rng = np.random.default_rng(0)
    state = run.init(_grads(rng, SPARSE_SPEC))
    phases = [max(r, ratio) for r in jaxcomp.DGC_WARMUP] + [ratio]
    for t in range(6):
        g = _grads(rng, SPARSE_SPEC)
        upd, new = run(g, state)
        phase = phases[min(t, len(phases) - 1)]
        ref_upd, ref_res = ref_sparse_step(g, state.inner.residual, nodes, local, phase, GROUPS)
        check_sparse_step(g, upd, new, ref_upd, ref_res)
        check_invariant(g, state.inner.residual, upd, new.inner.residual, nodes, local, what=t)
        state = new
    assert run.traces == 1


# ---------------------------------------------------------------------------
# 1b. Deterministic quantizers with error feedback: onebit and EF-signSGD.
# ---------------------------------------------------------------------------


def ref_sign_decode(acc, bucket, kind):
    """Decoded message of a shard: per bucket of ``bucket`` values (the last one shorter),
    ``||x||_1 / d * sign`` (``"l1"``, zeros as +) or the means of the >= 0 and < 0 values
    (``"onebit"``). float64."""
    acc = np.asarray(acc, np.float64)
    out = np.zeros_like(acc)
    d = max(1, min(bucket, acc.size))
    for b in range(0, acc.size, d):
        x = acc[b : b + d]
        neg = x < 0
        if kind == "l1":
            alpha = np.abs(x).sum() / x.size
            out[b : b + d] = np.where(neg, -alpha, alpha)
        else:
            pos_mean = x[~neg].mean() if np.any(~neg) else 0.0
            neg_mean = x[neg].mean() if np.any(neg) else 0.0
            out[b : b + d] = np.where(neg, neg_mean, pos_mean)
    return out


QUANT_SPEC = {"w": ((12, 10), np.float32), "b": ((7,), np.float32), "s": ((), np.float32)}
QUANT_BUCKET = 16
QUANTIZERS = {
    "onebit": (lambda: jaxcomp.onebit(bucket_size=QUANT_BUCKET, min_dense_size=0, axis_name=AX)),
    "ef_sign_sgd": (
        lambda: jaxcomp.ef_sign_sgd(bucket_size=QUANT_BUCKET, min_dense_size=0, axis_name=AX)
    ),
}


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_sign_quantizers_match_numpy(name, nodes, local):
    kind = "onebit" if name == "onebit" else "l1"
    run = Runner(QUANTIZERS[name](), _mesh(nodes, local))
    rng = np.random.default_rng(1)
    state = run.init(_grads(rng, QUANT_SPEC))
    for t in range(4):
        g = _grads(rng, QUANT_SPEC)
        upd, new = run(g, state)
        _same_on_every_device(upd)
        for p, gl in g.items():
            s = node_means(gl, nodes, local)
            old = np.asarray(state.inner.residual[p])
            dec = np.zeros(s.shape)
            for j in range(nodes):
                for l in range(local):  # noqa: E741
                    acc = old[_dev(j, local, l)] + f32(s[j, l])
                    dec[j, l] = ref_sign_decode(acc, QUANT_BUCKET, kind)
                    got = np.asarray(new.inner.residual[p][_dev(j, local, l)], np.float64)
                    _close(got, acc - dec[j, l], 1e-5, (name, t, p, j, l))
            ref_u = unblock(dec.mean(axis=0), gl.shape[1:])
            _close(f32(upd[p][0]), ref_u, 1e-5, (name, t, p))
        check_invariant(g, state.inner.residual, upd, new.inner.residual, nodes, local, what=t)
        state = new
    assert run.traces == 1


def test_sign_quantizer_padding_takes_part_in_the_bucket():
    """The zero padding of a shard is quantized with it: a sign quantizer sends zero as
    ``+scale``, so the padding's residual does not stay zero (unlike a sparsifier's or
    PowerSGD's); its decoded value is dropped when the blocks are reassembled, so
    nothing is lost on the leaf's own elements (2x4, a 10-element leaf: the last
    device of a node owns element 9 and two padding zeros)."""
    run = Runner(jaxcomp.onebit(axis_name=AX, min_dense_size=0), _mesh(2, 4))
    g = {"a": (np.arange(N * 10, dtype=np.float32).reshape(N, 10) - 20.0) / 8}
    state = run.init(g)
    upd, new = run(g, state)
    pad = np.asarray(new.inner.residual["a"])[[3, 7], 1:]
    s = node_means(g["a"], 2, 4)
    for j in range(2):  # devices 3 and 7 own [9, pad, pad]: the mean of the >= 0 values
        pos_mean = np.mean([v for v in s[j, 3] if v >= 0])
        np.testing.assert_allclose(pad[j], -pos_mean, rtol=1e-6)
    check_invariant(g, None, upd, new.inner.residual, 2, 4)


# ---------------------------------------------------------------------------
# 1b'. Stochastic quantizers: unbiased and bounded.
# ---------------------------------------------------------------------------


def test_qsgd_two_level_is_unbiased_and_bounded():
    """QSGD without error feedback: the update is the mean over nodes of unbiased,
    bounded quantizations of the node means, so over ``T`` independent steps of the
    same gradients its mean approaches the mean of the ``N`` gradients (5 standard
    errors per coordinate), and ``|u_i| <= mean_j ||bucket of s_j||_2``."""
    nodes, local, T = 2, 4, 200
    run = Runner(jaxcomp.qsgd(4, min_dense_size=0, axis_name=AX), _mesh(nodes, local))
    rng = np.random.default_rng(2)
    g = _grads(rng, {"w": ((6, 10), np.float32)})
    state = run.init(g)
    ups = []
    for _ in range(T):
        upd, state = run(g, state)
        _same_on_every_device(upd)
        ups.append(f32(upd["w"][0]).astype(np.float64))
    ups = np.stack(ups)
    target = f32(g["w"]).astype(np.float64).mean(axis=0)
    se = ups.std(axis=0) / np.sqrt(T)
    assert np.all(np.abs(ups.mean(axis=0) - target) <= 5 * se + 1e-6)
    s = node_means(g["w"], nodes, local).astype(np.float64)  # one bucket per shard
    bound = unblock(
        np.linalg.norm(s, axis=-1).mean(axis=0)[:, None] * np.ones(s.shape[-1]), (6, 10)
    )
    assert np.all(np.abs(ups) <= bound[None] * (1 + 1e-6))
    assert run.traces == 1


# ---------------------------------------------------------------------------
# 1c. PowerSGD: whole matrix rows on a shard.
# ---------------------------------------------------------------------------

PSGD_RANK = 2
PSGD_SPEC = {
    "w": ((40, 24), np.float32),
    "pad": ((21, 40), np.float32),  # 21 rows: padded rows on the last device of a node
    "conv": ((16, 3, 2, 2), np.float32),  # rows of 12
    "b": ((24,), np.float32),
}


def _psgd_rows(shape):
    return math.prod(shape[1:]) if len(shape) >= 2 else 1


@pytest.mark.parametrize("nodes,local", MESHES)
def test_powersgd_matches_numpy(nodes, local):
    run = Runner(jaxcomp.powersgd(PSGD_RANK, axis_name=AX), _mesh(nodes, local))
    rng = np.random.default_rng(3)
    state = run.init(_grads(rng, PSGD_SPEC))
    for t in range(3):
        g = _grads(rng, PSGD_SPEC)
        upd, new = run(g, state)
        _same_on_every_device(upd)
        for p, gl in g.items():
            shape, r = gl.shape[1:], _psgd_rows(gl.shape[1:])
            s = node_means(gl, nodes, local, r)
            old = np.asarray(state.inner.residual[p]).reshape(N, -1)
            got_res = np.asarray(new.inner.residual[p]).reshape(N, -1)
            shard = (s.shape[-1] // r, r) if len(shape) >= 2 else (s.shape[-1],)
            assert new.inner.residual[p].shape[1:] == shard, p
            plan = _hook_plan(shard, PSGD_RANK)
            out = np.zeros(s.shape[1:])
            for l in range(local):  # noqa: E741
                accs = [old[_dev(j, local, l)] + f32(s[j, l]) for j in range(nodes)]
                if plan is None:  # dense: the mean of the accumulators
                    out[l] = np.mean(accs, axis=0)
                    continue
                q_prev = np.asarray(state.inner.q[p])[[_dev(j, local, l) for j in range(nodes)]]
                assert all(bits(q) == bits(q_prev[0]) for q in q_prev), (p, l)
                mats = [a.astype(np.float64).reshape(shard) for a in accs]
                ref_s, ref_q = _ref_step(mats, q_prev[0].astype(np.float64))
                out[l] = ref_s.reshape(-1)
                for j in range(nodes):
                    d = _dev(j, local, l)
                    _close(np.asarray(new.inner.q[p][d]), ref_q, 2e-5, (t, p, j, l))
                    _close(got_res[d], (mats[j] - ref_s).reshape(-1), 2e-5, (t, p, j, l))
                    # Padding rows (zero in every M) stay zero in S and in the residual.
                    m = _rows(shape, r)[0]
                    pad_rows = min(shard[0], max(0, (l + 1) * shard[0] - m))
                    if pad_rows:
                        assert not np.any(got_res[d].reshape(shard)[-pad_rows:]), (p, d)
            _close(f32(upd[p][0]), unblock(out, shape, r), 2e-5, (t, p))
        check_invariant(
            g,
            state.inner.residual,
            upd,
            new.inner.residual,
            nodes,
            local,
            row_length=_psgd_rows,
            what=t,
        )
        state = new
    assert run.traces == 1


# ---------------------------------------------------------------------------
# 2. Nothing lost, for every error-feedback compressor.
# ---------------------------------------------------------------------------

INVARIANT_SPEC = {
    "w": ((20, 12), np.float32),
    "v": ((33,), np.float32),  # padded on 4 and 8 devices
    "h": ((16, 5), BF16),
    "s": ((), np.float32),
}
EF_COMPRESSORS = [
    *(s for s in helpers.SPARSIFIERS if s not in helpers.NO_ERROR_FEEDBACK),
    "qsgd_ef",
    "terngrad_clip_ef",
    "onebit",
    "ef_sign_sgd",
    "natural_dithering_ef",
    "cast_bf16_ef",
    "powersgd",
]


@pytest.mark.parametrize("name", EF_COMPRESSORS)
def test_nothing_lost_every_error_feedback_compressor(name):
    """On 4x2 (the conformance suite runs every compressor on 2x4), three steps."""
    nodes, local = 4, 2
    run = Runner(helpers.FACTORIES[name](0.1, axis_name=AX), _mesh(nodes, local))
    rows = _psgd_rows if name == "powersgd" else None
    rng = np.random.default_rng(4)
    state = run.init(_grads(rng, INVARIANT_SPEC))
    for t in range(3):
        g = _grads(rng, INVARIANT_SPEC)
        upd, new = run(g, state)
        _same_on_every_device(upd)
        wire16 = helpers.value_itemsize(name, np.float32) < 4
        scaling = helpers.RESIDUAL_SCALING.get(name, (1, 1))
        check_invariant(
            g, state.inner.residual, upd, new.inner.residual, nodes, local, rows, t, wire16,
            scaling,
        )  # fmt: skip
        for p, u in g.items():
            assert upd[p].dtype == u.dtype and upd[p].shape == u.shape, p
        state = new
    assert run.traces == 1


# ---------------------------------------------------------------------------
# 3. Bytes per link class.
# ---------------------------------------------------------------------------


def _padded_buffer_bytes(spec, local, row_length=lambda shape: 1):
    """Bytes of the per-dtype buffers the reduce-scatter moves: ``local`` blocks per leaf."""
    total = 0
    for shape, dtype in jax.tree.leaves(spec, is_leaf=_is_spec):
        m, r = _rows(shape, row_length(shape))
        total += local * -(-m // local) * r * np.dtype(dtype).itemsize
    return total


BYTES_SPEC = {"w": ((40, 24), np.float32), "v": ((101,), np.float32), "h": ((30,), BF16)}
BYTES_COMPRESSORS = {
    "top_k": (lambda ax: jaxcomp.top_k(0.05, axis_name=ax), None),
    "ef_sign_sgd": (lambda ax: jaxcomp.ef_sign_sgd(bucket_size=16, axis_name=ax), None),
    "qsgd": (lambda ax: jaxcomp.qsgd(4, min_dense_size=0, axis_name=ax), None),
    "powersgd": (lambda ax: jaxcomp.powersgd(2, axis_name=ax), _psgd_rows),
}


def _flat_step(tx, mesh, axis, g):
    """The state (numpy, per device) after one step of ``tx`` on a 1-D ``mesh``."""
    spec = P(axis)
    init = jax.shard_map(
        lambda x: _stack(tx.init(_first(x))),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
        check_vma=False,
    )
    put = jax.device_put(g, NamedSharding(mesh, spec))
    return jax.device_get(helpers.mesh_update(tx, mesh, axis)(put, jax.jit(init)(put)))[1]


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
@pytest.mark.parametrize("name", list(BYTES_COMPRESSORS))
def test_bytes_per_link_class(name, nodes, local):
    """intra: ``2 (L - 1) / L`` x the padded buffers' bytes; inter: the flat compressor's
    ``wire_bytes`` on a 1-D mesh of ``nodes`` devices fed the shards of local index 0."""
    make, rows = BYTES_COMPRESSORS[name]
    rows = rows or (lambda shape: 1)
    run = Runner(make(AX), _mesh(nodes, local))
    rng = np.random.default_rng(5)
    g = _grads(rng, BYTES_SPEC)
    _, new = run(g, run.init(g))
    intra = 2 * (local - 1) / local * _padded_buffer_bytes(BYTES_SPEC, local, rows)
    np.testing.assert_allclose(new.intra_node_bytes, [intra] * N, rtol=1e-6)
    # The flat compressor over the node axis alone, on this step's shards of local 0.
    flat_mesh = jax.make_mesh((nodes,), ("node",), devices=jax.devices()[:nodes])
    shards = {}
    for p, gl in g.items():
        shape = gl.shape[1:]
        s = node_means(gl, nodes, local, rows(shape))[:, 0]
        shards[p] = s.reshape(nodes, -1, rows(shape)) if rows(shape) > 1 else s
    wire = _flat_step(make("node"), flat_mesh, "node", shards).wire_bytes
    assert np.all(wire > 0) and np.all(wire == wire[0])
    np.testing.assert_array_equal(new.inter_node_bytes, [wire[0]] * N)


def test_two_level_sparse_bytes_target():
    """Issue 37's target on 2x4, ratio 1e-3, a 2^20-element leaf: per device, the
    two-level exchange sends at most 1/4 of the flat all-gather's inter-node bytes and
    at least 100x fewer than a dense ring all-reduce's."""
    nodes, local, n, ratio = 2, 4, 2**20, 1e-3
    rng = np.random.default_rng(6)
    g = {"w": rng.normal(size=(N, n)).astype(np.float32)}
    two = Runner(jaxcomp.top_k(ratio, axis_name=AX), _mesh(nodes, local))
    _, st = two(g, two.init(g))
    inter = float(st.inter_node_bytes[0])
    assert np.all(st.inter_node_bytes == inter) and inter > 0
    # The flat 1-D mesh of 8: an all-gather sends (N - 1) messages; the N - L of them
    # addressed to the devices of the other node cross the slow link.
    flat_mesh = jax.make_mesh((N,), ("data",))
    flat_state = _flat_step(jaxcomp.top_k(ratio, axis_name="data"), flat_mesh, "data", g)
    flat_wire = float(flat_state.wire_bytes[0])
    k = k_of(ratio, n)
    assert flat_wire == (N - 1) * cap_of(k, n) * 8  # a sparse all-gather of (int32, float32)
    flat_inter = flat_wire / (N - 1) * (N - local)
    assert inter <= flat_inter / 4, (inter, flat_inter)
    # A dense ring all-reduce: each device sends 2 (N - 1) / N x n x 4 bytes to its ring
    # neighbour. Laid out node-major, 2 of the 8 ring links cross nodes and the two
    # devices at node boundaries send all of theirs over them: we count that full
    # per-device amount (the slow links carry it whole; averaged over the 8 devices
    # it would be 2/8 of it, still over 100x: asserted too).
    dense = 2 * (N - 1) / N * n * 4
    assert 100 * inter <= dense * 2 / N, (inter, dense)


# ---------------------------------------------------------------------------
# 4. The paths next to the happy one.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_float16_node_sum_overflows_but_the_mean_fits(nodes, local):
    """float16 gradients near 65504 / 2: any two of them sum past float16's range,
    their mean does not; the update stays finite and is the reference's."""
    rng = np.random.default_rng(7)
    g = {"h": (30000.0 + rng.integers(-64, 64, size=(N, 24)) * 8).astype(np.float16)}
    run = Runner(jaxcomp.top_k(0.5, axis_name=AX), _mesh(nodes, local))
    state = run.init(g)
    upd, new = run(g, state)
    assert np.all(np.isfinite(f32(upd["h"]))) and np.all(np.isfinite(new.inner.residual["h"]))
    ref_upd, ref_res = ref_sparse_step(g, state.inner.residual, nodes, local, 0.5)
    np.testing.assert_allclose(f32(upd["h"][0]), ref_upd["['h']"], rtol=2**-10)
    np.testing.assert_allclose(new.inner.residual["h"], ref_res["['h']"], atol=16.0)


def test_x64_float64_leaves():
    with jax.enable_x64(True):
        nodes, local = 2, 4
        spec = {"w": ((50,), np.float64), "v": ((3, 5), np.float32)}
        run = Runner(jaxcomp.top_k(0.1, axis_name=AX), _mesh(nodes, local))
        rng = np.random.default_rng(8)
        state = run.init(_grads(rng, spec))
        assert state.inner.residual["w"].dtype == np.float64
        for _ in range(3):
            g = _grads(rng, spec)
            upd, new = run(g, state)
            assert upd["w"].dtype == np.float64 and upd["v"].dtype == np.float32
            ref_upd, ref_res = ref_sparse_step(g, state.inner.residual, nodes, local, 0.1)
            np.testing.assert_array_equal(new.inner.residual["w"], ref_res["['w']"])
            np.testing.assert_allclose(upd["w"][0], ref_upd["['w']"], rtol=0, atol=1e-15)
            state = new
        assert run.traces == 1


TINY_SPEC = {
    "scalar": ((), np.float32),
    "empty": ((0,), np.float32),
    "empty2": ((0, 5), np.float32),
    "three": ((3,), np.float32),  # fewer elements than local devices
    "row": ((1, 6), np.float32),  # PowerSGD: one row, on the first device only
    "h": ((2,), BF16),
}
TINY = {
    "top_k": (lambda: jaxcomp.top_k(0.5, axis_name=AX), None),
    "ef_sign_sgd": (lambda: jaxcomp.ef_sign_sgd(min_dense_size=0, axis_name=AX), None),
    "powersgd": (lambda: jaxcomp.powersgd(1, axis_name=AX), _psgd_rows),
}


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_empty_and_scalar_leaves(name):
    nodes, local = 2, 4
    make, rows = TINY[name]
    run = Runner(make(), _mesh(nodes, local))
    rng = np.random.default_rng(9)
    state = run.init(_grads(rng, TINY_SPEC))
    for t in range(2):
        g = _grads(rng, TINY_SPEC)
        upd, new = run(g, state)
        _same_on_every_device(upd)
        for p, gl in g.items():
            assert upd[p].dtype == gl.dtype and upd[p].shape == gl.shape, p
        check_invariant(g, state.inner.residual, upd, new.inner.residual, nodes, local, rows, t)
        if name == "top_k":
            ref_upd, ref_res = ref_sparse_step(g, state.inner.residual, nodes, local, 0.5)
            check_sparse_step(g, upd, new, ref_upd, ref_res)
        if name != "ef_sign_sgd":  # padding is never sent: its residual stays zero
            assert not np.any(new.inner.residual["scalar"][:, 0][np.arange(N) % local != 0])
            assert not np.any(new.inner.residual["three"][np.arange(N) % local == 3])
        state = new
    assert run.traces == 1


@pytest.mark.parametrize("policy", ["skip", "zero"])
def test_nan_on_one_device(policy):
    """A NaN in device 5's gradient (node 1, local 1) at element 3 of a 40-element leaf.

    The policy acts on device 5 before the reduce-scatter, so the NaN never
    reaches its node's other values: zero: that element of device 5 counts as 0;
    skip: device 5's whole gradient counts as 0 this step (as on a flat mesh,
    where it would send nothing). Every device then compresses finite node
    means; no residual becomes NaN; the wrapper counts device 5's bad step.
    """
    nodes, local = 2, 4
    run = Runner(jaxcomp.top_k(0.2, nonfinite=policy, axis_name=AX), _mesh(nodes, local))
    spec = {"w": ((40,), np.float32), "b": ((8,), np.float32)}
    rng = np.random.default_rng(10)
    state = run.init(_grads(rng, spec))
    _, state = run(_grads(rng, spec), state)
    g = _grads(rng, spec)
    g["w"][5, 3] = np.nan
    upd, new = run(g, state)
    for p in g:
        assert np.all(np.isfinite(f32(upd[p]))) and np.all(np.isfinite(new.inner.residual[p]))
    filtered = {p: np.array(x) for p, x in g.items()}
    if policy == "zero":
        filtered["w"][5, 3] = 0
    else:
        for p in filtered:
            filtered[p][5] = 0
    ref_upd, ref_res = ref_sparse_step(filtered, state.inner.residual, nodes, local, 0.2)
    check_sparse_step(g, upd, new, ref_upd, ref_res)
    steps = np.asarray(new.nonfinite_steps) - np.asarray(state.nonfinite_steps)
    assert steps.tolist() == [1 if d == 5 else 0 for d in range(N)]
    inner_steps = np.asarray(new.inner.nonfinite_steps) - np.asarray(state.inner.nonfinite_steps)
    assert inner_steps.tolist() == [0] * N


@pytest.mark.parametrize("name", ["include", "scatter", "jaxcomp_overlap"])
def test_unsupported_extra_arguments_rejected(name):
    tx = jaxcomp.top_k(0.1, axis_name=AX)
    with pytest.raises(ValueError, match=name):
        tx.update({"w": jnp.ones(4)}, None, **{name: jnp.bool_(True)})


@pytest.mark.parametrize("axis_name", [("a", "b", "c"), ("node", "node"), ("node", 3), (1, 2)])
@pytest.mark.parametrize(
    "factory",
    [
        lambda ax: jaxcomp.top_k(0.1, axis_name=ax),
        lambda ax: jaxcomp.qsgd(4, axis_name=ax),
        lambda ax: jaxcomp.powersgd(1, axis_name=ax),
        lambda ax: jaxcomp.onebit_adam(0.01, freeze_step=2, axis_name=ax),
    ],
    ids=["top_k", "qsgd", "powersgd", "onebit_adam"],
)
def test_bad_axis_name_rejected(factory, axis_name):
    with pytest.raises(ValueError, match="axis_name"):
        factory(axis_name)


def test_init_outside_shard_map_is_a_clear_error():
    tx = jaxcomp.top_k(0.1, axis_name=AX)
    with pytest.raises(ValueError, match=r"init: axis_name \('node', 'local'\).*shard_map"):
        tx.init({"w": jnp.ones(4)})


# ---------------------------------------------------------------------------
# optax wrappers around a two-level compressor.
# ---------------------------------------------------------------------------

WRAP_SPEC = {"w": ((24,), np.float32), "b": ((6,), np.float32)}


def _bare_updates(rng_seed, steps, ratio=0.25):
    """The bare two-level top_k's per-step updates (stacked per device) on seeded grads."""
    run = Runner(jaxcomp.top_k(ratio, axis_name=AX), _mesh(2, 4))
    rng = np.random.default_rng(rng_seed)
    grads = [_grads(rng, WRAP_SPEC) for _ in range(steps)]
    state = run.init(grads[0])
    out = []
    for g in grads:
        u, state = run(g, state)
        out.append(u)
    return grads, out


def test_chain_with_sgd_and_inject_hyperparams():
    grads, bare = _bare_updates(11, 3)
    txs = {
        "chain": optax.chain(jaxcomp.top_k(0.25, axis_name=AX), optax.sgd(0.5)),
        "inject": optax.inject_hyperparams(jaxcomp.top_k, static_args=("ratio",))(
            ratio=0.25, axis_name=AX, low_pass=1.0
        ),
    }
    for name, tx in txs.items():
        run = Runner(tx, _mesh(2, 4))
        state = run.init(grads[0])
        for g, want in zip(grads, bare, strict=True):
            u, state = run(g, state)
            factor = -0.5 if name == "chain" else 1.0
            for p in g:
                np.testing.assert_array_equal(u[p], want[p] * np.float32(factor), err_msg=name)
        assert run.traces == 1
    # A ratio left to inject_hyperparams would be traced: a clear error naming static_args.
    tx = optax.inject_hyperparams(jaxcomp.top_k)(ratio=0.25, axis_name=AX)
    with pytest.raises(ValueError, match="static_args"):
        Runner(tx, _mesh(2, 4)).init(grads[0])


def test_multi_steps_and_masked():
    grads, _ = _bare_updates(12, 1)
    rng = np.random.default_rng(13)
    g2 = _grads(rng, WRAP_SPEC)
    mean = {p: (grads[0][p] + g2[p]) / 2 for p in g2}  # exact: dyadic gradients
    bare = Runner(jaxcomp.top_k(0.25, axis_name=AX), _mesh(2, 4))
    want, _ = bare(mean, bare.init(mean))
    ms = Runner(optax.MultiSteps(jaxcomp.top_k(0.25, axis_name=AX), 2), _mesh(2, 4))
    state = ms.init(mean)
    u1, state = ms(grads[0], state)
    assert not any(np.any(u1[p]) for p in u1)
    u2, state = ms(g2, state)
    for p in g2:
        np.testing.assert_array_equal(u2[p], want[p], err_msg=p)
    # masked: "w" compressed as alone, "b" passed through (each device's own gradient).
    masked = Runner(
        optax.masked(jaxcomp.top_k(0.25, axis_name=AX), {"w": True, "b": False}), _mesh(2, 4)
    )
    alone = Runner(jaxcomp.top_k(0.25, axis_name=AX), _mesh(2, 4))
    sub = {"w": g2["w"]}
    want_w, _ = alone(sub, alone.init(sub))
    u, _ = masked(g2, masked.init(g2))
    np.testing.assert_array_equal(u["w"], want_w["w"])
    np.testing.assert_array_equal(u["b"], g2["b"])


def test_apply_if_finite():
    """optax.apply_if_finite would skip one device's exchange (a hang): refused, naming
    jaxcomp.apply_if_finite; that one, given the two-level axis_name, skips a step with
    a NaN on any device everywhere, and otherwise gives the bare compressor's update."""
    grads, bare = _bare_updates(14, 2)
    with pytest.raises(ValueError, match="jaxcomp.apply_if_finite"):
        tx = optax.apply_if_finite(jaxcomp.top_k(0.25, axis_name=AX), 3)
        run = Runner(tx, _mesh(2, 4))
        run(grads[0], run.init(grads[0]))
    tx = jaxcomp.apply_if_finite(jaxcomp.top_k(0.25, axis_name=AX), 3, axis_name=AX)
    run = Runner(tx, _mesh(2, 4))
    state = run.init(grads[0])
    bad = {p: v.copy() for p, v in grads[0].items()}
    bad["w"][6, 0] = np.nan
    u, new = run(bad, state)
    assert not any(np.any(u[p]) for p in u)
    assert bits(new.inner_state.inner.residual["w"]) == bits(state.inner_state.inner.residual["w"])
    for g, want in zip(grads, bare, strict=True):
        u, new = run(g, new)
        for p in g:
            np.testing.assert_array_equal(u[p], want[p], err_msg=p)
    assert run.traces == 1


# ---------------------------------------------------------------------------
# The compressor's own exchanges over the node axis, and the Adams.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.top_k(0.25, exchange="gtopk", axis_name=AX),
        lambda: jaxcomp.top_k(0.25, exchange="oktopk", axis_name=AX),
        lambda: jaxcomp.top_k(0.25, exchange="dense", axis_name=AX),
        lambda: jaxcomp.ef_sign_sgd(exchange="server", axis_name=AX),
        lambda: jaxcomp.qsgd(4, error_feedback=True, exchange="allreduce", axis_name=AX),
    ],
    ids=["gtopk", "oktopk", "dense", "sign_server", "qsgd_allreduce"],
)
def test_node_axis_exchanges_lose_nothing(make):
    """Every exchange runs over the node axis only: same update everywhere, nothing lost."""
    nodes, local = 4, 2
    run = Runner(make(), _mesh(nodes, local))
    spec = {"w": ((40,), np.float32), "v": ((9, 3), np.float32)}
    rng = np.random.default_rng(12)
    state = run.init(_grads(rng, spec))
    for t in range(2):
        g = _grads(rng, spec)
        upd, new = run(g, state)
        _same_on_every_device(upd)
        check_invariant(g, state.inner.residual, upd, new.inner.residual, nodes, local, None, t)
        state = new


@pytest.mark.parametrize("name", ["onebit_adam", "zero_one_adam"])
def test_adams_on_the_shards_match_their_flat_run_on_the_node_means(name):
    """1-bit / 0/1 Adam two-level = the same optimizer on a flat mesh of `nodes` devices
    fed each node's mean, shard by shard (its moments live on the shards)."""
    nodes, local = 2, 4
    make = {
        "onebit_adam": lambda ax: jaxcomp.onebit_adam(0.01, freeze_step=2, axis_name=ax),
        "zero_one_adam": lambda ax: jaxcomp.zero_one_adam(0.01, var_freeze_step=2, axis_name=ax),
    }[name]
    run = Runner(make(AX), _mesh(nodes, local))
    spec = {"w": ((16,), np.float32)}  # 4 elements a shard, no padding
    rng = np.random.default_rng(13)
    grads = [_grads(rng, spec) for _ in range(4)]
    state = run.init(grads[0])
    flat_tx = make("node")
    flat_mesh = jax.make_mesh((nodes,), ("node",), devices=jax.devices()[:nodes])

    def flat_steps(gs):  # one shard column: per node the node mean of that shard
        gs = [{"w": g[0]} for g in gs]
        s = flat_tx.init(gs[0])
        out = []
        for g in gs:
            u, s = flat_tx.update(g, s)
            out.append(u["w"])
        return out

    flat = jax.jit(
        jax.shard_map(
            flat_steps, mesh=flat_mesh, in_specs=P("node"), out_specs=P(), check_vma=False
        )
    )
    by_node = NamedSharding(flat_mesh, P("node"))
    ups = []
    for g in grads:
        upd, state = run(g, state)
        _same_on_every_device(upd)
        ups.append(f32(upd["w"][0]))
    means = [node_means(g["w"], nodes, local) for g in grads]  # (nodes, local, 4)
    for l in range(local):  # noqa: E741
        shard_in = [jax.device_put(jnp.asarray(m[:, l]), by_node) for m in means]
        ref = flat(shard_in)
        for t in range(len(grads)):
            np.testing.assert_allclose(ups[t][4 * l : 4 * l + 4], f32(ref[t]), rtol=1e-5, atol=1e-6)
