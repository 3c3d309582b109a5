"""PowerSGD's batched variant and 16-bit ``P``/``Q`` against numpy ports of PyTorch's hooks.

``_ref_batched`` ports ``batched_powerSGD_hook`` (torch/distributed/algorithms/
ddp_comm_hooks/powerSGD_hook.py) in float64: the bucket (here: every leaf of one
dtype, flattened in ``jax.tree.flatten`` order) zero-padded to ``s * s`` with
``s = ceil(sqrt(n))`` and viewed as one ``s x s`` matrix ``M``; ``q = orth(Q_prev)``,
``P = orth(sum_d M_d q)``, ``Q = sum_d M_d^T P / N``, ``S = P Q^T`` truncated to
``n``. One documented difference: the hook also keeps the error of the padding
(``-S`` there) and adds it back at the next step; jaxcomp drops it (the padding is no
gradient), and so does the port.

``pq`` (the ``fp16_compress_wrapper``/``bf16_compress_wrapper`` arithmetic at the
wire): each device's ``M q`` and ``M^T P`` divided by ``N`` and rounded to the 16-bit
dtype before its all-reduce, the sum rounded to it, ``Q`` the rounded sum times
``N / K``. On one device there is no sum, so the reference and the code round the same
products and are compared to float32 accuracy; on 8 devices XLA's 16-bit summation
order is its own, so ``Q`` is compared to a few 16-bit ulps.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from helpers import Counted, bits, f32, mesh_update
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp.transforms.powersgd import bucket_plan, powersgd

N_DEV = 8
REL = 2e-5  # float32 against the float64 reference, relative to max |reference|


def _orth(x):
    """The hook's modified Gram-Schmidt (float64); a zero column stays zero."""
    x = np.array(x, np.float64)
    for i in range(x.shape[1]):
        d = np.linalg.norm(x[:, i])
        x[:, i] = x[:, i] / d if d > 0 else 0.0
        for j in range(i + 1, x.shape[1]):
            x[:, j] -= np.dot(x[:, i], x[:, j]) * x[:, i]
    return x


def _round(x, dtype):
    """``x`` rounded to ``dtype`` (None: unchanged), saturating at its largest value."""
    if dtype is None:
        return x
    dtype = jnp.dtype(dtype)
    big = float(ml_dtypes.finfo(dtype).max)
    return np.clip(x, -big, big).astype(dtype).astype(np.float64)


def _ref_batched(flats, q_prev, pq=None, sends=None):
    """One step of the hook on the devices' flattened buckets ``flats`` (float64).

    Returns ``(S truncated to n, Q)``."""
    n = flats[0].size
    s = math.isqrt(n - 1) + 1
    mats = [np.pad(f, (0, s * s - n)).reshape(s, s) for f in flats]
    approx, q = _ref_matrix_step(mats, q_prev, pq, sends)
    return approx.reshape(-1)[:n], q


def _ref_matrix_step(mats, q_prev, pq=None, sends=None):
    """The power step on the devices' matrices; with ``pq`` the messages rounded.

    Devices with ``sends[d]`` False (a non-finite gradient) contribute nothing; ``Q`` is
    the mean over the ``K`` others (the 16-bit messages are divided by ``N``, their
    rounded sum multiplied by ``N / K``)."""
    n_dev = len(mats)
    sends = [True] * n_dev if sends is None else sends
    mats = [m for m, ok in zip(mats, sends, strict=True) if ok]
    k = len(mats)
    q = _orth(q_prev)
    p = _round(sum(_round(m @ q / n_dev, pq) for m in mats), pq)
    p = _orth(p)
    if pq is None:
        qm = sum(m.T @ p for m in mats) / k
    else:
        qm = _round(sum(_round(m.T @ p / n_dev, pq) for m in mats), pq) * n_dev / k
    return p @ qm.T, qm


def _close(got, ref, rel=REL, what=""):
    got = np.asarray(got, np.float64)
    scale = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
    err = float(np.max(np.abs(got - ref))) if np.size(ref) else 0.0
    assert err <= rel * scale + 1e-30, (what, err, scale)


def _check_residual(acc, sent, res):
    """``res`` is the correctly rounded ``acc - sent`` (float32, bit for bit)."""
    acc, sent, res = (np.asarray(a, np.float32) for a in (acc, sent, res))
    assert np.array_equal(res, acc - sent)


RANK = 2
# float32 bucket: 500 + 288 + 25 + 1 + 5 = 819 elements (s = 29, r = 2); bfloat16 bucket:
# 600 + 300 (s = 30); the empty leaf is sent dense (nothing to send).
TREE = {
    "w": ((20, 25), jnp.float32),
    "conv": ((8, 4, 3, 3), jnp.float32),
    "h16": ((30, 20), jnp.bfloat16),
    "bias": ((25,), jnp.float32),
    "scalar": ((), jnp.float32),
    "empty": ((0,), jnp.float32),
    "row": ((1, 5), jnp.float32),
    "b16": ((300,), jnp.bfloat16),
}


def _tree(rng, lead=()):
    return {k: jnp.asarray(rng.laplace(size=(*lead, *s))).astype(dt) for k, (s, dt) in TREE.items()}


def _buckets():
    """Leaf names per bucket (one per dtype, in jax.tree.flatten order: sorted keys)."""
    out: dict = {}
    for k in sorted(TREE):
        shape, dt = TREE[k]
        if math.prod(shape):
            out.setdefault(jnp.dtype(dt), []).append(k)
    return list(out.values())


def _flat(tree_np, names):
    return np.concatenate([np.asarray(tree_np[k], np.float64).reshape(-1) for k in names])


def _split(flat, names):
    out, start = {}, 0
    for k in names:
        size = math.prod(TREE[k][0])
        out[k] = flat[start : start + size].reshape(TREE[k][0])
        start += size
    return out


def test_bucket_plan_is_the_hooks_square():
    for size in (1, 2, 4, 5, 99, 100, 101, 819, 10**6 + 1):
        s = math.ceil(math.sqrt(size))
        assert bucket_plan(size, 1, min_compression_rate=0.0) == (s, s, 1), size
    assert bucket_plan(0, 4) is None
    assert bucket_plan(819, 4) == (29, 29, 4)
    assert bucket_plan(64, 4) is None  # 2 * 8 * 4 * 2 >= 64: does not pay
    assert bucket_plan(3, 8, min_compression_rate=0.0) == (2, 2, 2)  # r <= s


@pytest.mark.parametrize("pq", [None, "bfloat16"])
def test_batched_one_device_matches_the_hook(pq):
    """Four steps over two buckets (float32 with a scalar, 1-D, 4-D leaves; bfloat16),
    against the hook's port: update, ``Q``, residual, bytes; one compilation."""
    cx = Counted(powersgd(RANK, batched=True, pq_dtype=pq))
    rng = np.random.default_rng(0)
    state = cx.tx.init(_tree(rng))
    item = 4 if pq is None else 2
    for t in range(4):
        g = _tree(rng)
        upd, new = cx(g, state)
        accs = {k: np.asarray(state.residual[k]) + f32(g[k]) for k in TREE}
        for names in _buckets():
            first = names[0]
            flat = _flat(accs, names)
            s = math.isqrt(flat.size - 1) + 1
            ref_s, ref_q = _ref_batched([flat], np.asarray(state.q[first]), pq)
            eps = max(float(jnp.finfo(g[k].dtype).eps) for k in names)
            got = _flat({k: f32(upd[k]) for k in names}, names)
            _close(got, ref_s, max(REL, 2 * eps), (t, first))
            _close(np.asarray(new.q[first]), ref_q, REL, (t, first))
            if pq is not None:  # Q is a 16-bit sum (times N / K = 1 here)
                q = np.asarray(new.q[first])
                assert np.array_equal(q.astype(ml_dtypes.bfloat16).astype(np.float32), q)
            assert int(new.message_bytes[first]) == 2 * s * RANK * item
            for k in names:
                _check_residual(accs[k], f32(upd[k]), new.residual[k])
                if k != first:
                    assert int(new.message_bytes[k]) == 0 and new.q[k] is None, k
        assert int(new.message_bytes["empty"]) == 0 and upd["empty"].shape == (0,)
        state = new
    assert cx.traces == 1
    assert np.any(np.asarray(state.residual["scalar"]))  # the scalar was compressed too


def _stack(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tree)


@pytest.mark.parametrize("pq", [None, "float16"])
def test_batched_on_eight_devices_matches_the_hook(pq):
    """8 simulated devices in ``shard_map``, three steps: the update is the same on every
    device and the hook's (summed ``P``, mean ``Q``), each device keeps its own residual,
    the bytes are a ring all-reduce of ``2 s r`` values per bucket plus the count. At the
    last step device 3 has a NaN: it sends nothing and keeps its residual, the others
    share ``S`` from their ``K = 7`` messages and the update is ``(K / N) S``."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tx = powersgd(RANK, batched=True, pq_dtype=pq, axis_name="data")
    f = mesh_update(tx, mesh)
    rng = np.random.default_rng(1)
    state = jax.device_put(_stack(tx.init(_tree(rng))), sharding)
    item = 4 if pq is None else 2
    for t in range(3):
        g = _tree(rng, (N_DEV,))
        sends = [not (t == 2 and d == 3) for d in range(N_DEV)]
        if t == 2:
            g["w"] = g["w"].at[3, 0, 0].set(jnp.nan)
        k_sent = sum(sends)
        upd, new = jax.device_get(f(jax.device_put(g, sharding), state))
        old = jax.device_get(state)
        wire = 2.0 * (N_DEV - 1) / N_DEV * 4  # the non-finite count (nonfinite="skip")
        for names in _buckets():
            first = names[0]
            accs = [
                {k: np.asarray(old.residual[k][d]) + f32(g[k][d]) for k in names}
                for d in range(N_DEV)
            ]
            flats = [_flat(a, names) for a in accs]
            s = math.isqrt(flats[0].size - 1) + 1
            ref_s, ref_q = _ref_batched(flats, np.asarray(old.q[first][0]), pq, sends)
            for k in names:
                for d in range(N_DEV):
                    assert bits(upd[k][d]) == bits(upd[k][0]), (t, k, d)
                    if not sends[d]:  # kept bit for bit
                        assert bits(new.residual[k][d]) == bits(old.residual[k][d]), (t, k)
                    elif k_sent == N_DEV:
                        _check_residual(accs[d][k], f32(upd[k][0]), new.residual[k][d])
            eps = max(float(jnp.finfo(g[k].dtype).eps) for k in names)
            if pq is None:
                tol_q, tol_s = REL, max(REL, 2 * eps)
            else:  # XLA sums the 16-bit messages in its own order: a few float16 ulps
                tol_q = tol_s = max(8 * float(jnp.finfo(jnp.float16).eps), 2 * eps)
            got = _flat({k: f32(upd[k][0]) for k in names}, names)
            _close(got, ref_s * k_sent / N_DEV, tol_s, (t, first))
            _close(np.asarray(new.q[first][0]), ref_q, tol_q, (t, first))
            for d in range(N_DEV):  # what each device sent: S, the same everywhere
                if sends[d]:
                    sent = flats[d] - _flat({k: new.residual[k][d] for k in names}, names)
                    _close(sent, ref_s, tol_s, (t, first, d))
            nbytes = 2 * s * RANK * item
            np.testing.assert_array_equal(
                np.asarray(new.message_bytes[first]), [nbytes if ok else 0 for ok in sends]
            )
            wire += 2.0 * (N_DEV - 1) / N_DEV * nbytes
        np.testing.assert_allclose(np.asarray(new.wire_bytes), wire, rtol=1e-6)
        state = jax.device_put(new, sharding)


@pytest.mark.parametrize("pq", ["float16", "bfloat16"])
def test_sixteen_bit_pq_per_leaf_matches_the_rounded_reference(pq):
    """Per-leaf PowerSGD with 16-bit ``P``/``Q`` on one device: the update and ``Q`` are
    those of the float64 reference that rounds ``M q`` and ``M^T P`` to ``pq``, to float32
    accuracy (not to 16-bit accuracy: the rounding happens where the reference has it),
    the residual keeps the rest, the bytes are ``(n + m) r`` 2-byte values."""
    shape = (40, 30)
    cx = Counted(powersgd(RANK, pq_dtype=pq))
    rng = np.random.default_rng(2)
    g = {"w": jnp.asarray(rng.laplace(size=shape), jnp.float32)}
    state = cx.tx.init(g)
    unrounded_gap = 0.0
    for t in range(3):
        g = {"w": jnp.asarray(rng.laplace(size=shape), jnp.float32)}
        upd, new = cx(g, state)
        acc = np.asarray(state.residual["w"]) + f32(g["w"])
        q_prev = np.asarray(state.q["w"])
        ref_s, ref_q = _ref_matrix_step([acc.astype(np.float64)], q_prev, pq)
        _close(f32(upd["w"]), ref_s, REL, t)
        _close(np.asarray(new.q["w"]), ref_q, REL, t)
        unrounded_gap = max(
            unrounded_gap,
            float(np.max(np.abs(_ref_matrix_step([acc], q_prev)[0] - ref_s)) / np.abs(ref_s).max()),
        )
        _check_residual(acc, f32(upd["w"]), new.residual["w"])
        assert int(new.message_bytes["w"]) == (40 + 30) * RANK * 2
        state = new
    assert unrounded_gap > 10 * REL  # the rounding is visible at this tolerance
    assert cx.traces == 1


def test_float16_pq_overflow_stays_finite_and_nothing_is_lost():
    """Gradients near 1e6 (1e30 in one leaf): ``M q`` is far beyond float16's range. The
    messages saturate (after the division by ``N``, so that the 8-device sum cannot
    overflow either): the update, ``Q`` and the residual stay finite, the residual is
    ``M - S`` to the bit, and the update still points along the gradient."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    spec = {"w": (40, 30), "v": (16, 16)}
    for batched in (False, True):
        tx = powersgd(RANK, pq_dtype="float16", batched=batched, axis_name="data")
        f = mesh_update(tx, mesh)
        rng = np.random.default_rng(3)
        base = {k: rng.laplace(size=s) for k, s in spec.items()}
        state = jax.device_put(
            _stack(tx.init({k: jnp.zeros(s) for k, s in spec.items()})), sharding
        )
        for t in range(3):
            g = {
                "w": jnp.asarray(1e6 * (base["w"] + 0.1 * rng.laplace(size=(N_DEV, 40, 30)))),
                "v": jnp.asarray(1e30 * (base["v"] + 0.1 * rng.laplace(size=(N_DEV, 16, 16)))),
            }
            g = jax.tree.map(lambda x: x.astype(jnp.float32), g)
            upd, new = jax.device_get(f(jax.device_put(g, sharding), state))
            old = jax.device_get(state)
            for k in spec:
                assert np.all(np.isfinite(np.asarray(upd[k]))), (batched, t, k)
                assert np.all(np.isfinite(np.asarray(new.residual[k]))), (batched, t, k)
                for d in range(N_DEV):
                    acc = np.asarray(old.residual[k][d]) + f32(g[k][d])
                    _check_residual(acc, f32(upd[k][0]), new.residual[k][d])
            assert all(np.all(np.isfinite(np.asarray(q))) for q in jax.tree.leaves(new.q))
            u = f32(upd["w"][0]).reshape(-1)
            assert np.dot(u, base["w"].reshape(-1)) > 0, (batched, t)
            state = jax.device_put(new, sharding)


def test_batched_with_bf16_params_and_start_iter():
    """bfloat16 parameters only (one bfloat16 bucket, float32 residual), vanilla first
    step (dense, the update is the gradient), then the batched step against the port."""
    g_spec = {"a": (24, 24), "b": (24,)}
    tx = powersgd(1, batched=True, start_iter=1)
    cx = Counted(tx)
    rng = np.random.default_rng(4)
    state = tx.init({k: jnp.zeros(s, jnp.bfloat16) for k, s in g_spec.items()})
    for t in range(3):
        g = {k: jnp.asarray(rng.laplace(size=s), jnp.bfloat16) for k, s in g_spec.items()}
        upd, new = cx(g, state)
        if t == 0:
            for k in g_spec:
                np.testing.assert_array_equal(f32(upd[k]), f32(g[k]))
                assert int(new.message_bytes[k]) == math.prod(g_spec[k]) * 2
        else:
            accs = {k: np.asarray(state.residual[k]) + f32(g[k]) for k in g_spec}
            flat = np.concatenate([accs["a"].reshape(-1), accs["b"]]).astype(np.float64)
            ref_s, ref_q = _ref_batched([flat], np.asarray(state.q["a"]))
            got = np.concatenate([f32(upd["a"]).reshape(-1), f32(upd["b"])])
            _close(got, ref_s, 2 * float(jnp.finfo(jnp.bfloat16).eps), t)
            _close(np.asarray(new.q["a"]), ref_q, REL, t)
            assert int(new.message_bytes["a"]) == 2 * 25 * 1 * 4
            assert int(new.message_bytes["b"]) == 0
        for k in g_spec:
            _check_residual(np.asarray(state.residual[k]) + f32(g[k]), f32(upd[k]), new.residual[k])
        state = new
    assert cx.traces == 1


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="batched"):
        powersgd(1, batched="yes")
    with pytest.raises(ValueError, match="pq_dtype"):
        powersgd(1, pq_dtype=jnp.float32)
    with pytest.raises(ValueError, match="pq_dtype"):
        powersgd(1, pq_dtype="int8")
    with pytest.raises(ValueError, match="pq_dtype"):
        powersgd(1, pq_dtype="not a dtype")


def test_batched_bf16_pq_inside_chain_and_multisteps():
    """``optax.MultiSteps(chain(powersgd(batched, pq_dtype=bfloat16), sgd), 2)``: the first
    call returns zeros, the second applies ``-lr S`` of the hook's port (16-bit rounding
    included) on the mean of the two gradients; the state stays readable."""
    lr = 0.5
    spec = {"a": (24, 20), "b": (20,)}
    inner = optax.chain(powersgd(1, batched=True, pq_dtype=jnp.bfloat16), optax.sgd(lr))
    tx = optax.MultiSteps(inner, every_k_schedule=2)
    params = {k: jnp.zeros(s) for k, s in spec.items()}
    state = tx.init(params)
    q0 = np.asarray(optax.tree.get(state, "q")["a"])
    f = jax.jit(tx.update)
    rng = np.random.default_rng(5)
    grads = [{k: jnp.asarray(rng.laplace(size=s), jnp.float32) for k, s in spec.items()}]
    grads.append({k: jnp.asarray(rng.laplace(size=s), jnp.float32) for k, s in spec.items()})
    u0, state = f(grads[0], state, params)
    assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(u0))
    u1, state = f(grads[1], state, params)
    mean = {k: (f32(grads[0][k]) + f32(grads[1][k])) / 2 for k in spec}
    flat = np.concatenate([mean["a"].reshape(-1), mean["b"]]).astype(np.float64)
    ref_s, _ = _ref_batched([flat], q0, "bfloat16")
    got = np.concatenate([f32(u1["a"]).reshape(-1), f32(u1["b"])])
    _close(got, -lr * ref_s, 1e-4)
    mb = jax.tree.map(int, optax.tree.get(state, "message_bytes"))
    assert mb == {"a": 2 * 23 * 1 * 2, "b": 0}, mb  # 500 values: a 23 x 23 matrix


def test_batched_without_warm_start_or_error_feedback_draws_the_documented_q():
    """No warm start, no error feedback: each step the bucket's ``Q`` is the documented
    draw ``normal(fold_in(fold_in(key, t), i), (s, r))`` with ``i`` the bucket's first
    leaf, and the update is the port's on the gradient alone."""
    spec = {"a": (7,), "b": (30, 12), "c": ()}  # one bucket: 367 values, s = 20
    tx = powersgd(3, batched=True, warm_start=False, error_feedback=False, seed=4)
    cx = Counted(tx)
    rng = np.random.default_rng(6)
    state = tx.init({k: jnp.zeros(s) for k, s in spec.items()})
    assert state.q is None and state.residual is None
    key = jax.random.key(4)
    for t in range(2):
        g = {k: jnp.asarray(rng.laplace(size=s), jnp.float32) for k, s in spec.items()}
        upd, state = cx(g, state)
        q_t = jax.random.normal(jax.random.fold_in(jax.random.fold_in(key, t), 0), (20, 3))
        flat = np.concatenate([f32(g[k]).reshape(-1) for k in sorted(spec)]).astype(np.float64)
        ref_s, _ = _ref_batched([flat], np.asarray(q_t, np.float64))
        got = np.concatenate([f32(upd[k]).reshape(-1) for k in sorted(spec)])
        _close(got, ref_s, REL, t)
        assert int(state.message_bytes["a"]) == 2 * 20 * 3 * 4
    assert cx.traces == 1
