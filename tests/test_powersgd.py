"""PowerSGD against a float64 numpy reference of PyTorch's ``powerSGD_hook``.

The reference (``_ref_step``) is written from the hook's algorithm, not from
the code under test: per compressed leaf ``M_d = e_d + g_d`` viewed as
``(shape[0], -1)``, ``q = orth(Q_prev)``, ``P = orth(sum_d M_d q)``,
``Q = sum_d M_d^T P / K``, ``S = P Q^T``. jaxcomp computes in float32 with its
own summation order, so float32 results are compared with the float64
reference to ``REL`` times the largest magnitude of the reference (about 170
float32 ulps; the errors measured were ~10 ulps: the products sum up to a
few hundred terms, and Gram-Schmidt on random data is well conditioned); float64 results (x64) to
``1e-12``. What the code must get exactly is checked bit for bit: the
residual is the correctly rounded ``M - S`` with ``S`` the returned update
(numpy float32 ``acc - sent``), the update is bitwise identical on every
device, dense leaves are the plain mean.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import Counted, bits, f32
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _vma
from jaxcomp import distributed as dist
from jaxcomp.transforms.powersgd import PowerSGDState, matrix_plan, orthogonalize, powersgd

N_DEV = 8
REL = 2e-5  # float32 vs the float64 reference, relative to max |reference|


# ---------------------------------------------------------------------------
# The numpy reference.
# ---------------------------------------------------------------------------


def _hook_plan(shape, rank, rate=2.0):
    """The hook's decision, written independently: ``view(shape[0], -1)``, compress iff
    ``(n + m) r rate < n m``; 0-D and 1-D leaves dense (jaxcomp's choice)."""
    if len(shape) < 2 or math.prod(shape) == 0:
        return None
    n = shape[0]
    m = math.prod(shape) // n
    r = min(n, m, rank)
    return (n, m, r) if (n + m) * r * rate < n * m else None


def _ref_orth(x, eps=0.0):
    """The hook's modified Gram-Schmidt (float64); a zero column stays zero."""
    x = np.array(x, np.float64)
    for i in range(x.shape[1]):
        d = np.linalg.norm(x[:, i]) + eps
        x[:, i] = x[:, i] / d if d > 0 else 0.0
        for j in range(i + 1, x.shape[1]):
            x[:, j] -= np.dot(x[:, i], x[:, j]) * x[:, i]
    return x


def _ref_orth_robust(x, rtol=1e-9):
    """An orthonormal basis of ``x``'s column space (float64 numpy QR, ``R``'s diagonal made
    >= 0); a column whose ``|R_ii|`` is at most ``rtol`` of the largest is rank deficiency
    (rounding in float64) and is zeroed."""
    q, r = np.linalg.qr(np.asarray(x, np.float64))
    d = np.diag(r)
    q = q * np.where(d < 0, -1.0, 1.0)
    keep = np.abs(d) > rtol * np.max(np.abs(d))
    return q * keep


def _ref_step(mats, q_prev, sends=None, eps=0.0):
    """One PowerSGD step over devices' accumulators ``mats`` (float64 ``n x m``).

    Returns ``(S, Q)``: the included devices' common approximation and their mean ``Q``.
    """
    sends = [True] * len(mats) if sends is None else sends
    q = _ref_orth(q_prev, eps)
    p = sum(
        (m @ q for m, s in zip(mats, sends, strict=True) if s),
        np.zeros((mats[0].shape[0], q.shape[1])),
    )
    p = _ref_orth(p, eps)
    k = max(sum(sends), 1)
    qm = sum((m.T @ p for m, s in zip(mats, sends, strict=True) if s), np.zeros(q.shape)) / k
    return p @ qm.T, qm


def _close(got, ref, rel=REL, what=""):
    got = np.asarray(got, np.float64)
    scale = float(np.max(np.abs(ref))) if np.size(ref) else 0.0
    err = float(np.max(np.abs(got - ref))) if np.size(ref) else 0.0
    assert err <= rel * scale + 1e-30, (what, err, scale)


def _rank_at_most(x, r):
    s = np.linalg.svd(np.asarray(x, np.float64), compute_uv=False)
    assert np.all(s[r:] <= 1e-5 * s[0]), s[: r + 2]


def _as_matrix(x, n, m):
    return np.asarray(x, np.float64).reshape(n, m)


def _check_residual(acc, sent, res):
    """``res`` is the correctly rounded ``acc - sent`` (float32 numpy, bit for bit), so
    ``sent + res`` recovers ``acc`` up to that one rounding."""
    acc, sent, res = (np.asarray(a, np.float32) for a in (acc, sent, res))
    assert np.array_equal(res, acc - sent)
    gap = np.abs((sent.astype(np.float64) + res) - acc)
    assert np.all(gap <= np.spacing(np.abs(acc - sent)).astype(np.float64))


def _laplace(rng, shape, dtype=jnp.float32, scale=1.0):
    return jnp.asarray(rng.laplace(0.0, scale, size=shape)).astype(dtype)


# ---------------------------------------------------------------------------
# Layout and orthogonalization.
# ---------------------------------------------------------------------------


def test_matrix_plan_is_the_hooks_rule():
    shapes = [(), (0,), (7,), (1, 5), (5, 1), (4, 4), (0, 5), (5, 0), (40, 30), (8, 4, 3, 3)]
    shapes += [(3, 3, 64, 128), (2, 50), (600, 2), (128, 1, 1)]
    for shape in shapes:
        for rank in (1, 2, 4, 64):
            for rate in (0.0, 1.0, 2.0, 8.0):
                got = matrix_plan(shape, rank, min_compression_rate=rate)
                assert got == _hook_plan(shape, rank, rate), (shape, rank, rate)
    # "last": the transposed view, (prod(shape[:-1]), shape[-1]).
    assert matrix_plan((3, 3, 64, 128), 2, reshape="last") == (576, 128, 2)
    assert matrix_plan((3, 3, 64, 128), 2) is None  # 3 rows: does not pay
    assert matrix_plan((40, 30), 2, min_dense_size=1200) is None


def test_orthogonalize_against_numpy():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(50, 4)).astype(np.float32)
    x[:, 2] = 0.0  # a zero column stays zero (no NaN)
    got = np.asarray(jax.jit(orthogonalize)(jnp.asarray(x)), np.float64)
    ref = _ref_orth(x)
    _close(got, ref, 1e-5)
    assert not np.any(got[:, 2])
    live = got[:, [0, 1, 3]]
    np.testing.assert_allclose(live.T @ live, np.eye(3), atol=1e-5)
    # With epsilon: column i divided by ||x_i|| + eps.
    got_eps = np.asarray(orthogonalize(jnp.asarray(x), 0.5), np.float64)
    _close(got_eps, _ref_orth(x, 0.5), 1e-5)
    # Huge columns: the norm is computed scaled, no overflow to 0 or NaN.
    big = np.asarray(orthogonalize(jnp.asarray(x * np.float32(1e30))), np.float64)
    _close(big, ref, 1e-5)


def test_orthogonalize_drops_the_rounding_noise_of_a_rank_deficient_matrix():
    """Columns that are combinations of earlier ones come out zero, not normalised noise
    (which would not be orthogonal to the others); a batch is orthogonalised per matrix."""
    rng = np.random.default_rng(20)
    base = rng.integers(-4, 5, size=(3, 40, 2)).astype(np.float32)
    mix = rng.integers(-3, 4, size=(3, 2, 3)).astype(np.float32)
    base[1, :, 1] = 0.0  # matrix 1: rank 1, its column 1 is zero
    x = np.concatenate([base, base @ mix], axis=2)  # [3, 40, 5] of exact rank 2 (1)
    got = np.asarray(jax.jit(orthogonalize)(jnp.asarray(x)), np.float64)
    for b in range(3):
        alone = np.asarray(orthogonalize(jnp.asarray(x[b])), np.float64)
        np.testing.assert_allclose(got[b], alone, rtol=0, atol=1e-6)
        norms = np.linalg.norm(got[b], axis=0)
        live = norms > 0.5
        assert live.sum() == (1 if b == 1 else 2), norms
        np.testing.assert_allclose(norms[~live], 0.0, atol=0)  # dropped: exactly zero
        basis = got[b][:, live]
        np.testing.assert_allclose(basis.T @ basis, np.eye(live.sum()), atol=1e-6)
        # The kept columns span x's columns: projecting x on them gives x back.
        np.testing.assert_allclose(basis @ (basis.T @ x[b]), x[b], atol=1e-5 * np.abs(x[b]).max())


def test_orthogonalization_program_does_not_grow_with_rank():
    """The Gram-Schmidt loop is a ``fori_loop`` and ranks above 2 take a QR: the lowered
    update is the same size at rank 8 and rank 48 (it grew quadratically when the
    Gram-Schmidt projections were unrolled in Python: 72 kB and 1 MB of StableHLO)."""
    g = {"w": jnp.zeros((256, 256), jnp.float32)}
    sizes = {}
    for r in (1, 2, 8, 48):
        assert matrix_plan((256, 256), r) is not None  # compressed
        tx = powersgd(r)
        sizes[r] = len(jax.jit(tx.update).lower(g, tx.init(g)).as_text())
    assert sizes[48] <= 1.02 * sizes[8], sizes
    assert sizes[2] <= 1.02 * sizes[1], sizes


# ---------------------------------------------------------------------------
# One device: every dtype and leaf kind, against the reference, one compilation.
# ---------------------------------------------------------------------------

RANK = 2
TREE = {
    "w": ((20, 25), jnp.float32),
    "conv": ((8, 4, 3, 3), jnp.float32),  # PyTorch layout: viewed as 8 x 36
    "h16": ((30, 20), jnp.bfloat16),
    "f16": ((17, 9), jnp.float16),
    "bias": ((25,), jnp.float32),
    "scalar": ((), jnp.float32),
    "empty": ((0,), jnp.float32),
    "empty2": ((0, 5), jnp.float32),
    "row": ((1, 5), jnp.float32),
    "small": ((4, 4), jnp.bfloat16),
}


def _tree(rng, spec=TREE, scale=1.0):
    return {k: _laplace(rng, s, dt, scale) for k, (s, dt) in spec.items()}


_SINGLE: dict = {}


def _single(**kw):
    key = tuple(sorted(kw.items()))
    if key not in _SINGLE:
        _SINGLE[key] = Counted(powersgd(RANK, **kw))
    return _SINGLE[key]


def _check_single_step(g, old, upd, new, rank=RANK):
    """One single-device step against the reference, leaf by leaf."""
    for leaf, gl in g.items():
        u = upd[leaf]
        assert u.dtype == gl.dtype and u.shape == gl.shape, leaf
        acc = np.asarray(old.residual[leaf]) + f32(gl)
        res = np.asarray(new.residual[leaf])
        assert res.dtype == np.float32, leaf
        pl = _hook_plan(gl.shape, rank)
        itemsize = np.dtype(gl.dtype).itemsize
        if pl is None:  # dense: the accumulator itself, the residual keeps its rounding
            np.testing.assert_array_equal(f32(u), f32(jnp.asarray(acc).astype(gl.dtype)))
            _check_residual(acc, f32(u), res)
            assert int(new.message_bytes[leaf]) == gl.size * itemsize, leaf
            assert new.q[leaf] is None
            continue
        n, m, r = pl
        ref_s, ref_q = _ref_step([_as_matrix(acc, n, m)], np.asarray(old.q[leaf]))
        eps = float(jnp.finfo(gl.dtype).eps)  # the update is cast to the gradient dtype
        _close(_as_matrix(f32(u), n, m), ref_s, max(REL, 2 * eps), leaf)
        _close(np.asarray(new.q[leaf]), ref_q, REL, leaf)
        _rank_at_most(_as_matrix(f32(u), n, m) if gl.dtype == jnp.float32 else ref_s, r)
        _check_residual(acc, f32(u), res)
        assert int(new.message_bytes[leaf]) == (n + m) * r * 4, leaf


def test_single_device_matches_reference_every_dtype_one_compilation():
    cx = _single()
    rng = np.random.default_rng(1)
    state = cx.tx.init(_tree(rng))
    assert isinstance(state, PowerSGDState)
    for _ in range(4):
        g = _tree(rng)
        upd, new = cx(g, state)
        _check_single_step(g, state, upd, new)
        assert float(new.wire_bytes) == 0.0
        assert int(new.nonfinite_steps) == 0
        state = new
    assert int(state.step) == 4
    assert cx.traces == 1
    # Compressed leaves really were compressed: the residual is not zero.
    assert np.any(np.asarray(state.residual["w"]))
    # f32 and bf16 dense leaves: the accumulator is exact in their dtype, nothing remains.
    for leaf in ("bias", "scalar", "row", "small"):
        assert not np.any(np.asarray(state.residual[leaf])), leaf


def test_rank_r_gradient_recovered_exactly():
    """A rank-r gradient is its own rank-r approximation: sent whole from the first step."""
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=(20, RANK)), rng.normal(size=(25, RANK))
    g = {"w": jnp.asarray(a @ b.T, jnp.float32)}
    cx = Counted(powersgd(RANK))
    state = cx.tx.init(g)
    for _ in range(3):
        upd, state = cx(g, state)
        _close(f32(upd["w"]), a @ b.T, 1e-5)
        # Nothing remains but float32 rounding of M - S.
        assert np.max(np.abs(np.asarray(state.residual["w"]))) <= 1e-5 * np.max(np.abs(a @ b.T))


@pytest.mark.parametrize("rank,grad_rank", [(8, 2), (2, 1), (5, 3)])
def test_rank_above_the_gradients_rank_is_an_exact_projection(rank, grad_rank):
    """A Dense layer's gradient from a small batch has a rank below ``rank``: ``M Q`` then
    has dependent columns. The update must still be ``P P^T M`` with ``P`` an orthonormal
    basis of ``M Q``'s columns, here ``M`` itself (before: Gram-Schmidt normalised the
    rounding noise of the dependent columns into columns that were not orthogonal, and
    the update was off by 40-110% of max |M| here). ``M`` holds small integers, so it
    is exactly of rank ``grad_rank`` in float32; the reference is float64 numpy, QR
    with the dependent columns dropped."""
    rng = np.random.default_rng(21)
    a = rng.integers(-8, 9, size=(64, grad_rank))
    b = rng.integers(-8, 9, size=(grad_rank, 32))
    m64 = (a @ b).astype(np.float64)
    assert np.linalg.matrix_rank(m64) == grad_rank
    g = {"w": jnp.asarray(m64, jnp.float32)}
    tx = powersgd(rank, error_feedback=False)
    f = jax.jit(tx.update)
    state = tx.init(g)
    for t in range(3):
        q_prev = np.asarray(state.q["w"], np.float64)
        upd, state = f(g, state)
        p = _ref_orth_robust(m64 @ _ref_orth_robust(q_prev))
        ref = p @ (m64.T @ p).T
        np.testing.assert_allclose(ref, m64, atol=1e-9 * np.abs(m64).max())  # P P^T M = M
        _close(f32(upd["w"]), ref, REL, t)
        assert np.all(np.isfinite(np.asarray(state.q["w"])))


def test_rank_above_two_takes_a_qr_and_matches_the_reference():
    """Rank 4 (the hook's QR path) on the one-device tree: the same update and ``Q`` as the
    Gram-Schmidt reference (QR with ``R``'s diagonal >= 0 is Gram-Schmidt's ``Q``)."""
    rank = 4
    cx = Counted(powersgd(rank))
    rng = np.random.default_rng(22)
    state = cx.tx.init(_tree(rng))
    assert state.q["w"].shape == (25, rank)
    for _ in range(3):
        g = _tree(rng)
        upd, new = cx(g, state)
        _check_single_step(g, state, upd, new, rank=rank)
        state = new
    assert cx.traces == 1


POWER_SHAPE = (30, 20)


def _spectrum_matrix(seed=3):
    """A fixed 30 x 20 matrix with singular values 2^-i (a clear gap after every i)."""
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.normal(size=(30, 20)))
    v, _ = np.linalg.qr(rng.normal(size=(20, 20)))
    return (u * 2.0 ** -np.arange(20)) @ v.T


def _truncated(g, r):
    u, s, vt = np.linalg.svd(g)
    return (u[:, :r] * s[:r]) @ vt[:r]


def test_warm_start_converges_to_truncated_svd_and_fresh_draws_follow_the_stream():
    g64 = _spectrum_matrix()
    g = {"w": jnp.asarray(g64, jnp.float32)}
    best = _truncated(g64, RANK)
    warm = Counted(powersgd(RANK, error_feedback=False))
    cold = Counted(powersgd(RANK, error_feedback=False, warm_start=False, seed=5))
    ws, cs = warm.tx.init(g), cold.tx.init(g)
    assert cs.q is None and cs.residual is None
    key = jax.random.key(5)
    for t in range(25):
        wu, ws = warm(g, ws)
        cu, cs = cold(g, cs)
        # The documented stream: leaf 0 draws normal(fold_in(fold_in(key, t), 0)).
        k_t = jax.random.fold_in(jax.random.fold_in(key, t), 0)
        q_t = jax.random.normal(k_t, (20, RANK), jnp.float32)  # the residual dtype
        ref_s, _ = _ref_step([g64], np.asarray(q_t, np.float64))
        _close(f32(cu["w"]), ref_s, REL, t)
    # Power iteration with a warm start: the best rank-r approximation (Eckart-Young).
    _close(f32(wu["w"]), best, 1e-4)
    # Without, one power step from a random Q each time: visibly off the best.
    assert np.max(np.abs(f32(cu["w"]) - best)) > 1e-3 * np.max(np.abs(best))
    assert warm.traces == 1 and cold.traces == 1


def test_first_step_same_with_and_without_warm_start():
    """With a warm start the initial Q is the draw of step ``start_iter``."""
    g = {"w": jnp.asarray(_spectrum_matrix(4), jnp.float32)}
    outs = []
    for warm in (True, False):
        tx = powersgd(RANK, warm_start=warm, start_iter=1, seed=9)
        state = tx.init(g)
        f = jax.jit(tx.update)
        for _ in range(2):
            u, state = f(g, state)
        outs.append(np.asarray(u["w"]))
    # Two programs: equal up to how XLA fuses each one's float32 matmuls (another
    # initial Q gives another rank-1 approximation, far outside this tolerance).
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6 * np.abs(outs[1]).max())


def test_error_feedback_accumulates_to_the_gradient():
    """Constant full-rank gradient, rank 1: sum of updates + residual == T g (nothing lost
    over time), and the running mean of the updates converges to g."""
    g64 = _spectrum_matrix(5)
    g = {"w": jnp.asarray(g64, jnp.float32)}
    cx = Counted(powersgd(1))
    state = cx.tx.init(g)
    total = np.zeros(POWER_SHAPE)
    errs = []
    for t in range(1, 61):
        upd, state = cx(g, state)
        total += f32(upd["w"])
        lhs = total + np.asarray(state.residual["w"], np.float64)
        _close(lhs, t * f32(g["w"]).astype(np.float64), 1e-5, t)
        errs.append(np.max(np.abs(total / t - g64)) / np.max(np.abs(g64)))
    assert errs[-1] < 0.1 * errs[0]
    assert errs[-1] < 0.05


def test_error_feedback_off_keeps_no_residual():
    rng = np.random.default_rng(6)
    g = {"w": _laplace(rng, (20, 25))}
    tx = powersgd(RANK, error_feedback=False)
    state = tx.init(g)
    assert state.residual is None
    upd, state = jax.jit(tx.update)(g, state)
    ref_s, _ = _ref_step([f32(g["w"]).astype(np.float64)], np.asarray(tx.init(g).q["w"]))
    _close(f32(upd["w"]), ref_s)
    assert state.residual is None


def test_start_iter_dense_then_powersgd_one_compilation():
    rng = np.random.default_rng(7)
    spec = {"w": ((20, 25), jnp.float32), "b": ((25,), jnp.float32)}
    cx = Counted(powersgd(RANK, start_iter=2))
    state = cx.tx.init(_tree(rng, spec))
    q_init = np.asarray(state.q["w"])
    for t in range(4):
        g = _tree(rng, spec)
        upd, new = cx(g, state)
        if t < 2:  # vanilla: the gradient itself, dense bytes, Q untouched, no residual
            for leaf in g:
                assert bits(upd[leaf]) == bits(g[leaf]), (t, leaf)
                assert not np.any(np.asarray(new.residual[leaf]))
            assert int(new.message_bytes["w"]) == 500 * 4
            assert bits(new.q["w"]) == bits(q_init)
        else:
            _check_single_step(g, state, upd, new)
        state = new
    assert cx.traces == 1


# ---------------------------------------------------------------------------
# Non-finite gradients, zero gradients, overflow.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_nonfinite_skip_keeps_state(bad):
    cx = _single()
    rng = np.random.default_rng(8)
    state = cx.tx.init(_tree(rng))
    _, state = cx(_tree(rng), state)
    g = _tree(rng)
    g["h16"] = g["h16"].at[3, 4].set(bad)
    upd, new = cx(g, state)
    for leaf in g:
        assert not np.any(f32(upd[leaf])), leaf
        assert bits(new.residual[leaf]) == bits(state.residual[leaf]), leaf
        if new.q[leaf] is not None:
            assert bits(new.q[leaf]) == bits(state.q[leaf]), leaf
        assert int(new.message_bytes[leaf]) == 0
    assert int(new.nonfinite_steps) == 1
    g2 = _tree(rng)
    upd2, new2 = cx(g2, new)
    _check_single_step(g2, new, upd2, new2)
    assert int(new2.nonfinite_steps) == 1


def test_nonfinite_zero_uses_the_finite_part():
    cx = _single(nonfinite="zero")
    rng = np.random.default_rng(9)
    state = cx.tx.init(_tree(rng))
    for _ in range(2):
        g = _tree(rng)
        g["w"] = g["w"].at[1, 2].set(np.nan).at[3, 4].set(-np.inf)
        g["h16"] = g["h16"].at[0, 0].set(np.inf)
        clean = {k: jnp.where(jnp.isfinite(v), v, 0).astype(v.dtype) for k, v in g.items()}
        upd, new = cx(g, state)
        _check_single_step(clean, state, upd, new)
        state = new
    assert int(state.nonfinite_steps) == 2


def test_zero_gradient_does_not_kill_the_warm_start():
    """M = 0 makes P and Q zero; the stored Q keeps its columns and the leaf recovers."""
    rng = np.random.default_rng(10)
    tx = powersgd(RANK, error_feedback=False)
    f = jax.jit(tx.update)
    zero = {"w": jnp.zeros((20, 25))}
    state = tx.init(zero)
    q0 = state.q["w"]
    for _ in range(2):
        upd, state = f(zero, state)
        assert not np.any(np.asarray(upd["w"]))
        assert bits(state.q["w"]) == bits(q0)
    g = {"w": _laplace(rng, (20, 25))}
    upd, state = f(g, state)
    ref_s, _ = _ref_step([f32(g["w"]).astype(np.float64)], np.asarray(q0))
    _close(f32(upd["w"]), ref_s)


@pytest.mark.parametrize("rank", [1, 4])
def test_overflow_in_the_products_sends_nothing(rank):
    """``P = M Q`` overflowing float32: no NaN anywhere, the residual keeps M, Q is kept
    (rank 4: the QR of an infinite ``P`` neither hangs nor leaks NaN)."""
    tx = powersgd(rank)
    g = {"w": jnp.full((64, 64), 3e38, jnp.float32)}
    state = tx.init(g)
    state = state._replace(q={"w": jnp.ones((64, rank), jnp.float32)})  # orth: 1/8 each
    upd, new = jax.jit(tx.update)(g, state)
    assert not np.any(np.asarray(upd["w"]))
    np.testing.assert_array_equal(np.asarray(new.residual["w"]), np.asarray(g["w"]))
    assert bits(new.q["w"]) == bits(state.q["w"])


BATCH_TREE = {
    "a": ((30, 20), jnp.float32),
    "conv": ((8, 4, 3, 3), jnp.float32),  # 8 x 36
    "b": ((30, 20), jnp.float32),  # same matrix as "a": one batch
    "h16": ((30, 20), jnp.bfloat16),  # same matrix, computed in float32: same batch
    "bias": ((20,), jnp.float32),
    "c": ((30, 20), jnp.float32),
    "d": ((12, 50), jnp.float32),
    "conv2": ((8, 36), jnp.float32),  # the same 8 x 36 matrix as "conv"
}


def _leaf_state(state, leaf):
    """The state of a one-leaf tree holding ``leaf`` of ``state``."""
    return state._replace(
        residual={leaf: state.residual[leaf]},
        q={leaf: state.q[leaf]},
        message_bytes={leaf: state.message_bytes[leaf]},
    )


@pytest.mark.parametrize("rank", [2, 4])
def test_equal_shapes_batched_match_per_leaf_runs(rank):
    """Leaves with the same ``(n, m, r)`` matrix are orthogonalised and multiplied as one
    batch (the hook's ``batch_tensors_with_same_shape``): every leaf's update, residual and
    ``Q`` are those of the leaf run alone (one-leaf tree, same state), up to float32
    rounding (XLA:CPU picks another dot or reduction kernel for a batch: the bits
    differ by an ulp or two; at rank 4, a QR, they were identical here)."""
    tx = powersgd(rank)
    f = jax.jit(tx.update)
    rng = np.random.default_rng(23)
    state = tx.init(_tree(rng, BATCH_TREE))
    for _ in range(3):
        g = _tree(rng, BATCH_TREE)
        upd, new = f(g, state)
        for leaf, (_, dt) in BATCH_TREE.items():
            u1, n1 = f({leaf: g[leaf]}, _leaf_state(state, leaf))
            # A few float32 ulps of the largest element; the update is then rounded to
            # the gradient dtype (bfloat16: one of its ulps), and the residual keeps that.
            tol = max(1e-6, 2 * float(jnp.finfo(dt).eps))
            for got, alone, rel in [
                (upd[leaf], u1[leaf], tol),
                (new.residual[leaf], n1.residual[leaf], tol),
                (new.q[leaf], n1.q[leaf], 1e-6),
            ]:
                if alone is None:
                    assert got is None
                    continue
                _close(f32(got), f32(alone).astype(np.float64), rel, leaf)
            assert int(new.message_bytes[leaf]) == int(n1.message_bytes[leaf])
        state = new


# ---------------------------------------------------------------------------
# x64.
# ---------------------------------------------------------------------------


def test_x64_float64_leaves_compute_in_float64():
    with jax.enable_x64(True):
        rng = np.random.default_rng(11)
        spec = {"w": ((20, 25), np.float64), "v": ((20, 25), np.float32), "s": ((), np.float64)}
        cx = Counted(powersgd(RANK))
        state = cx.tx.init(_tree(rng, spec))
        assert state.q["w"].dtype == np.float64 and state.q["v"].dtype == np.float32
        for _ in range(3):
            g = _tree(rng, spec)
            upd, new = cx(g, state)
            for leaf in g:
                assert upd[leaf].dtype == g[leaf].dtype
            acc = np.asarray(state.residual["w"]) + np.asarray(g["w"])
            ref_s, ref_q = _ref_step([acc], np.asarray(state.q["w"]))
            _close(np.asarray(upd["w"]), ref_s, 1e-12)
            _close(np.asarray(new.q["w"]), ref_q, 1e-12)
            res = np.asarray(new.residual["w"])
            assert res.dtype == np.float64
            assert np.array_equal(res, acc - np.asarray(upd["w"]))
            assert int(new.message_bytes["w"]) == (20 + 25) * RANK * 8
            assert int(new.message_bytes["v"]) == (20 + 25) * RANK * 4
            state = new
        assert cx.traces == 1


# ---------------------------------------------------------------------------
# Arguments, state, tracing checks.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(rank=0), "rank"),
        (dict(rank=1.5), "rank"),
        (dict(rank=True), "rank"),
        (dict(rank=2, start_iter=-1), "start_iter"),
        (dict(rank=2, min_compression_rate=-1.0), "min_compression_rate"),
        (dict(rank=2, min_compression_rate=float("nan")), "min_compression_rate"),
        (dict(rank=2, min_dense_size=-1), "min_dense_size"),
        (dict(rank=2, error_feedback="yes"), "error_feedback"),
        (dict(rank=2, warm_start=1), "warm_start"),
        (dict(rank=2, orthogonalization_epsilon=-1e-8), "orthogonalization_epsilon"),
        (dict(rank=2, reshape="middle"), "reshape"),
        (dict(rank=2, residual_dtype=jnp.int32), "residual_dtype"),
        (dict(rank=2, nonfinite="nope"), "nonfinite"),
        (dict(rank=2, seed=2**40), "seed"),
    ],
)
def test_bad_arguments(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        powersgd(**kwargs)


def test_bad_updates_rejected():
    tx = powersgd(RANK)
    g = {"w": jnp.ones((20, 25))}
    state = tx.init(g)
    with pytest.raises(ValueError, match="include"):
        tx.update(g, state, include=jnp.bool_(True))
    with pytest.raises(ValueError, match=r"\['w'\]"):
        tx.update({"w": jnp.ones((20, 25), jnp.int32)}, state)
    with pytest.raises(ValueError):
        tx.update({"w": jnp.ones((25, 20))}, state)


@pytest.mark.parametrize("eps", [None, 1e-2])
def test_inject_hyperparams_needs_only_the_arguments_given(eps):
    """optax.inject_hyperparams(powersgd) with only ``rank`` static: the options the user
    did not pass default to None (left alone), a given orthogonalization_epsilon is traced
    from the state; the updates follow the numpy reference and the plain transform."""
    kw = {} if eps is None else {"orthogonalization_epsilon": eps}
    inj = optax.inject_hyperparams(powersgd, static_args=("rank",))(rank=RANK, **kw)
    plain = powersgd(RANK, **kw)
    rng = np.random.default_rng(14)
    g0 = {"w": _laplace(rng, (20, 25)), "b": _laplace(rng, (25,))}
    si, sp = inj.init(g0), plain.init(g0)
    assert ("orthogonalization_epsilon" in si.hyperparams) == (eps is not None)
    update = jax.jit(inj.update)
    for _ in range(2):
        g = {"w": _laplace(rng, (20, 25)), "b": _laplace(rng, (25,))}
        inner = si.inner_state
        acc = f32(inner.residual["w"]).astype(np.float64) + f32(g["w"])
        ref_s, _ = _ref_step([acc], np.asarray(inner.q["w"], np.float64), eps=eps or 0.0)
        ui, si = update(g, si)
        up, sp = plain.update(g, sp)
        _close(f32(ui["w"]), ref_s)
        np.testing.assert_array_equal(f32(ui["b"]), f32(g["b"]))  # dense leaf
        for k in g:  # two programs: equal up to how XLA fuses each one's float32 products
            np.testing.assert_allclose(f32(ui[k]), f32(up[k]), rtol=1e-5, atol=1e-6)


def test_state_readable_inside_chain():
    tx = optax.chain(powersgd(RANK, reshape="last"), optax.sgd(0.1))
    params = {"k": jnp.zeros((3, 3, 4, 8), jnp.float32), "b": jnp.zeros((8,), jnp.float32)}
    state = tx.init(params)
    q = optax.tree.get(state, "q")
    assert q["b"] is None and q["k"].shape == (8, RANK)  # viewed as 36 x 8
    rng = np.random.default_rng(12)
    g = {k: _laplace(rng, v.shape) for k, v in params.items()}
    upd, state = jax.jit(tx.update)(g, state)
    mb = optax.tree.get(state, "message_bytes")
    assert int(mb["k"]) == (36 + 8) * RANK * 4 and int(mb["b"]) == 32
    res = optax.tree.get(state, "residual")
    assert jax.tree.structure(res) == jax.tree.structure(params)
    ref_s, _ = _ref_step([f32(g["k"]).astype(np.float64).reshape(36, 8)], np.asarray(q["k"]))
    _close(-f32(upd["k"]).reshape(36, 8) / 0.1, ref_s)


# ---------------------------------------------------------------------------
# Under shard_map over 8 devices: the reference across devices, start_iter,
# NaN on one device, and the update typed device-invariant (out_specs=P()).
# ---------------------------------------------------------------------------

SHARD_TREE = {
    "w": ((40, 30), jnp.float32),
    "w2": ((40, 30), jnp.float32),  # batched with "w"
    "conv": ((8, 4, 3, 3), jnp.float32),
    "h16": ((24, 16), jnp.bfloat16),
    "b": ((30,), jnp.float32),
    "s": ((), jnp.float32),
}


def _stack(tree):
    return jax.tree.map(lambda x: jnp.stack([x] * N_DEV), tree)


def _shard_fn(tx, mesh):
    types = {}

    def step(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        types.update({k: _vma.varying_axes(v) for k, v in u.items()})
        stacked = jax.tree.map(lambda x: x[None], u)
        return u, stacked, jax.tree.map(lambda x: x[None], s)

    # check_vma=True with out_specs=P() for the update: shard_map itself rejects an
    # update typed device-varying (not exchanged).
    spec = P("data")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(P(), spec, spec)))
    return f, types


def test_shard_map_matches_reference_start_iter_and_nan_device():
    assert len(jax.devices()) >= N_DEV
    mesh = jax.make_mesh((N_DEV,), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tx = powersgd(RANK, axis_name="data", start_iter=1)
    f, types = _shard_fn(tx, mesh)
    rng = np.random.default_rng(13)
    state = jax.device_put(_stack(tx.init(_tree(rng, SHARD_TREE))), sharding)
    count_bytes = 2.0 * (N_DEV - 1) / N_DEV * 4
    for t in range(5):
        g = {
            leaf: jnp.asarray(rng.laplace(size=(N_DEV, *shape))).astype(dt)
            for leaf, (shape, dt) in SHARD_TREE.items()
        }
        # A NaN on device 5 in the vanilla step, on device 3 in a PowerSGD step.
        nan_dev = {0: 5, 3: 3}.get(t)
        if nan_dev is not None:
            g["w"] = g["w"].at[nan_dev, 0, 0].set(np.nan)
        u_inv, upd, new = f(jax.device_put(g, sharding), state)
        jax.block_until_ready((u_inv, upd, new))
        u_inv, upd, new, old = jax.device_get((u_inv, upd, new, state))
        assert all(not axes for axes in types.values()), types
        sends = [d != nan_dev for d in range(N_DEV)]
        k = sum(sends)
        wire = 0.0
        for leaf, (shape, dt) in SHARD_TREE.items():
            got = np.asarray(upd[leaf])
            for d in range(N_DEV):  # every device gets the same update, bit for bit
                assert bits(got[d]) == bits(got[0]), (t, leaf, d)
            assert bits(got[0]) == bits(u_inv[leaf]), (t, leaf)
            accs = [np.asarray(old.residual[leaf][d]) + f32(g[leaf][d]) for d in range(N_DEV)]
            res = np.asarray(new.residual[leaf])
            itemsize = np.dtype(dt).itemsize
            pl = _hook_plan(shape, RANK)
            if t == 0 or pl is None:  # vanilla all-reduce of the accumulators (dense)
                mean = (
                    np.mean(np.stack([a for a, s in zip(accs, sends, strict=True) if s]), 0)
                    * k
                    / N_DEV
                )
                tol = 1e-6 if dt == jnp.float32 else 2e-2
                _close(f32(got[0]), mean, tol, (t, leaf))
                nbytes = math.prod(shape) * itemsize
                for d in range(N_DEV):
                    if sends[d]:
                        _check_residual(accs[d], f32(jnp.asarray(accs[d]).astype(dt)), res[d])
                wire += 2.0 * (N_DEV - 1) / N_DEV * nbytes
            else:
                n, m, r = pl
                q_prev = np.asarray(old.q[leaf])
                for d in range(N_DEV):  # Q is the same everywhere
                    assert bits(q_prev[d]) == bits(q_prev[0]), (t, leaf, d)
                mats = [_as_matrix(a, n, m) for a in accs]
                ref_s, ref_q = _ref_step(mats, q_prev[0], sends)
                eps = float(jnp.finfo(dt).eps)
                # The update: the mean of what the devices sent, K copies of S.
                _close(
                    _as_matrix(f32(got[0]), n, m), ref_s * k / N_DEV, max(REL, 2 * eps), (t, leaf)
                )
                _close(np.asarray(new.q[leaf][0]), ref_q, REL, (t, leaf))
                for d in range(N_DEV):
                    if not sends[d]:
                        continue
                    sent = accs[d] - res[d]  # what device d sent: S, the same everywhere
                    _close(_as_matrix(sent, n, m), ref_s, max(REL, 2 * eps), (t, leaf, d))
                    if k == N_DEV:
                        _check_residual(accs[d], f32(got[0]), res[d])
                _rank_at_most(ref_s if dt != jnp.float32 else _as_matrix(got[0], n, m), r)
                nbytes = (n + m) * r * 4
                wire += 2.0 * (N_DEV - 1) / N_DEV * nbytes
            if nan_dev is not None:  # the device with a NaN keeps its residual, sends 0
                assert bits(res[nan_dev]) == bits(old.residual[leaf][nan_dev]), leaf
            msg = np.asarray(new.message_bytes[leaf])
            np.testing.assert_array_equal(msg, [nbytes if s else 0 for s in sends], (t, leaf))
        if t > 0:
            wire += count_bytes
        np.testing.assert_allclose(np.asarray(new.wire_bytes), wire, rtol=1e-6)
        steps = np.asarray(new.nonfinite_steps)
        assert steps[5] == 1 and steps[3] == int(t >= 3), steps
        assert not np.any(np.delete(steps, [3, 5])), steps
        state = jax.device_put(new, sharding)


def test_make_train_step_averages_per_device_gradients():
    """``make_train_step(unexchanged="error")`` accepts the update as exchanged, and
    the first step's parameters are ``-lr S`` of the per-device least-squares gradients."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    lr = 0.1
    tx = optax.chain(powersgd(RANK, axis_name="data"), optax.sgd(lr))
    rng = np.random.default_rng(14)
    x = rng.normal(size=(2 * N_DEV, 16)).astype(np.float32)
    y = rng.normal(size=(2 * N_DEV, 12)).astype(np.float32)

    def loss(w, batch):
        return jnp.mean((batch["x"] @ w["w"] - batch["y"]) ** 2)

    w0 = {"w": jnp.zeros((16, 12), jnp.float32)}
    q0 = np.asarray(tx.init(w0)[0].q["w"])
    params = dist.replicate(w0, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss, tx, mesh, unexchanged="error", donate=False)
    params, state, metrics = step(params, state, dist.shard_batch({"x": x, "y": y}, mesh))
    # Device d's gradient at w = 0: -2 x_d^T y_d / (2 * 12) (mean over its 2 x 12 outputs).
    grads = [
        -2.0 * x[2 * d : 2 * d + 2].T.astype(np.float64) @ y[2 * d : 2 * d + 2] / 24
        for d in range(N_DEV)
    ]
    ref_s, _ = _ref_step(grads, q0)
    _close(np.asarray(params["w"]), -lr * ref_s)
    wire = 2.0 * (N_DEV - 1) / N_DEV * ((16 + 12) * RANK * 4 + 4)
    np.testing.assert_allclose(float(metrics["wire_bytes"]), wire, rtol=1e-6)


def test_invariant_gradients_rejected_under_check_vma():
    """Gradients already summed over the devices (typed invariant) are refused."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tx = powersgd(RANK, axis_name="data")
    g = {"w": jnp.ones((20, 25))}
    state = tx.init(g)

    def step(g):
        return tx.update(g, state)[0]

    f = jax.shard_map(step, mesh=mesh, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match="device-invariant"):
        jax.eval_shape(f, g)


# ---------------------------------------------------------------------------
# Collectives per step: one all-reduce for all P, one for all Q, whatever the leaf count.
# ---------------------------------------------------------------------------

_HLO_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_HLO_ALL_REDUCE = re.compile(r"=\s*(.*?)\s+all-reduce(?:-start)?\(")
_HLO_BRANCHES = re.compile(
    r"(?:branch_computations=\{([^}]*)\}|(?:true|false)_computation=(%\S+?)[,\s])"
)


def _hlo_all_reduces(hlo: str):
    """``[(computation, elements)]`` per all-reduce instruction of compiled HLO text (an
    async start/done pair counted once), and the names of conditional branch computations."""
    found, branches, comp = [], set(), None
    for line in hlo.splitlines():
        head = _HLO_COMPUTATION.match(line)
        if head:
            comp = head.group(1)
            continue
        for listed, single in _HLO_BRANCHES.findall(line):
            branches.update(n.strip().lstrip("%") for n in (listed or single).split(",") if n)
        ar = _HLO_ALL_REDUCE.search(line)
        if ar:
            shapes = re.findall(r"\w+\[([\d,]*)\]", ar.group(1))
            elements = sum(math.prod(int(d) for d in s.split(",") if d) for s in shapes)
            found.append((comp, elements))
    return found, branches


def _compiled_step(tx, tree, mesh):
    """The compiled HLO text of ``tx.update`` inside ``shard_map`` over ``mesh``."""
    state = tx.init(tree)

    def step(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        u, s = tx.update(g, s)
        return u, jax.tree.map(lambda x: x[None], s)

    spec = P("data")
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=(P(), spec)))
    args = jax.device_put((_stack(tree), _stack(state)), NamedSharding(mesh, spec))
    return f.lower(*args).compile().as_text()


def _layers(count):
    """``count`` Dense layers (kernels of three shapes, so equal and different shapes) and
    their biases."""
    tree = {}
    for i in range(count):
        tree[f"k{i}"] = jnp.zeros((48 + 16 * (i % 3), 32), jnp.float32)
        tree[f"b{i}"] = jnp.zeros((32,), jnp.float32)
    return tree


@pytest.mark.parametrize("start_iter", [0, 1])
def test_all_reduces_per_step_do_not_grow_with_the_leaf_count(start_iter):
    """Inside ``shard_map`` on 8 devices, a step over 2 layers and over 10 layers compiles
    to the same number of all-reduces: every compressed leaf's ``P`` travels in one buffer,
    every ``Q`` in another, the dense leaves in a third (the hook's contiguous buffers)."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    counts = {}
    for layers in (2, 10):
        tx = powersgd(RANK, axis_name="data", start_iter=start_iter)
        found, _ = _hlo_all_reduces(_compiled_step(tx, _layers(layers), mesh))
        counts[layers] = len(found)
    # P (+ the NaN count), Q, dense leaves; with start_iter also the vanilla steps' dense
    # exchange of the compressed leaves (XLA may combine independent ones into one).
    assert counts[2] == counts[10], counts
    assert 1 <= counts[10] <= (4 if start_iter else 3), counts


def test_start_iter_exchanges_compressed_leaves_dense_only_in_vanilla_steps():
    """With ``start_iter``, the dense all-reduce of the compressed leaves sits in the
    conditional's vanilla branch; unconditionally the step all-reduces only the dense
    leaves (before, every PowerSGD step all-reduced the compressed leaves whole too)."""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tree = _layers(3)
    tx = powersgd(RANK, axis_name="data", start_iter=1)
    found, branches = _hlo_all_reduces(_compiled_step(tx, tree, mesh))
    assert branches
    biases = sum(x.size for k, x in tree.items() if k.startswith("b"))
    smallest = min(x.size for k, x in tree.items() if k.startswith("k"))
    unconditional = [n for comp, n in found if comp not in branches]
    assert sum(unconditional) <= biases, found
    conditional = [n for comp, n in found if comp in branches]
    assert max(conditional) >= 3 * smallest, found  # the vanilla branch: the kernels whole


def _psums(jaxpr) -> list:
    """``[(dtype, size)]`` of every psum operand in a jaxpr, sub-jaxprs included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name.startswith("psum"):
            found += [(str(v.aval.dtype), v.aval.size) for v in eqn.invars]
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _psums(inner)
    return found


def test_batched_all_reduces_one_p_and_one_q_per_bucket():
    """``batched=True`` over 10 layers (20 float32 leaves, one bucket): the compiled step
    all-reduces ``s r`` values of ``P`` (plus the count) and ``s r`` of ``Q``, nothing
    else; with ``pq_dtype=bfloat16`` the program's ``P`` and ``Q`` all-reduces are
    bfloat16 and the count travels alone. (XLA:CPU then promotes a bfloat16 all-reduce
    to float32 and rounds the sum once; NCCL sums in bfloat16.)"""
    mesh = jax.make_mesh((N_DEV,), ("data",))
    tree = _layers(10)
    size = sum(x.size for x in tree.values())
    sr = (math.isqrt(size - 1) + 1) * RANK
    for pq in (None, jnp.bfloat16):
        tx = powersgd(RANK, axis_name="data", batched=True, pq_dtype=pq)
        found, _ = _hlo_all_reduces(_compiled_step(tx, tree, mesh))
        assert sorted(n for _, n in found) in ([sr, sr + 1], [1, sr, sr]), found
        state = tx.init(tree)

        def step(g, s, tx=tx):
            g, s = jax.tree.map(lambda x: x[0], (g, s))
            return tx.update(g, s)[0]

        f = jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P())
        args = jax.device_put((_stack(tree), _stack(state)), NamedSharding(mesh, P("data")))
        psums = _psums(jax.make_jaxpr(f)(*args).jaxpr)
        if pq is None:
            assert sorted(psums) == [("float32", sr), ("float32", sr + 1)], psums  # + count
        else:
            assert sorted(psums) == [("bfloat16", sr), ("bfloat16", sr), ("float32", 1)], psums
