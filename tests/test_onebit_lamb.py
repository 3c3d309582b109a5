"""1-bit LAMB (jaxcomp.onebit_lamb) against a numpy port of DeepSpeed's OnebitLamb.

The reference re-implements ``deepspeed/runtime/fp16/onebit/lamb.py``'s
``step`` plainly in float64 (without its initialisation step, which drops a
gradient; see the docstring): LAMB warm-up with clipped trust ratios and
their moving average, then the scaled momentum through the compressed
all-reduce (or jaxcomp's all-gather of per-leaf sign messages), the fresh
variance from the reconstructed gradients, and the bounded factor.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import mesh_update, np_compressed_allreduce, sign_codec
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

N = 8
B1, B2, EPS = 0.9, 0.999, 1e-8
# 128 values: a multiple of N * lcm(N, 8) = 64, so DeepSpeed pads nothing.
TREE = {"a": (8, 8), "b": (64,)}
LAMB = dict(max_coeff=10.0, min_coeff=0.01, coeff_beta=0.5, factor_max=4.0, factor_min=0.5,
            factor_threshold=0.1)  # fmt: skip


def np_onebit_lamb(params, grads, lr, wd, freeze, exchange, mask=None, c=LAMB):
    """DeepSpeed's OnebitLamb.step in numpy float64, on replicated parameters.

    params: {leaf: array}; grads: per step {leaf: (n, ...)} for n devices;
    exchange: "two_stage" (DeepSpeed's compressed_allreduce over the flattened
    leaves, sorted by name, l2 scales) or "allgather" (per device and leaf
    ||x||_1 / d sign(x), averaged). Returns per step (params, lamb_coeffs).
    """
    keys = sorted(params)
    p = {k: np.asarray(params[k], np.float64) for k in keys}
    m = {k: np.zeros_like(p[k]) for k in keys}
    v = {k: np.zeros_like(p[k]) for k in keys}
    v_fresh = {k: np.zeros_like(p[k]) for k in keys}
    cf = dict.fromkeys(keys, 0.0)
    last = dict.fromkeys(keys, 1.0)
    scaling = None
    n = next(iter(grads[0].values())).shape[0]
    werr = {k: np.zeros((n, p[k].size)) for k in keys}
    serr = np.zeros(sum(p[k].size for k in keys))
    norm = lambda x: float(np.sqrt(np.sum(np.square(x))))  # noqa: E731
    out = []
    for step, g in enumerate(grads, start=1):
        g = {k: np.asarray(g[k], np.float64) for k in keys}
        coeffs = {}
        if step <= freeze:
            for k in keys:
                gm = g[k].mean(0)
                m[k] = B1 * m[k] + (1 - B1) * gm
                v[k] = B2 * v[k] + (1 - B2) * gm * gm
                if step == freeze:
                    v_fresh[k] = v[k].copy()
                update = m[k] / (np.sqrt(v[k]) + EPS)
                if wd > 0:
                    update = update + wd * p[k]
                w_norm, u_norm = norm(p[k]), norm(update)
                lamb_coeff = 1.0
                if w_norm != 0 and u_norm != 0:
                    lamb_coeff = min(max(w_norm / u_norm, c["min_coeff"]), c["max_coeff"])
                if lamb_coeff != 1.0:
                    cf[k] = c["coeff_beta"] * cf[k] + (1 - c["coeff_beta"]) * lamb_coeff
                coeffs[k] = lamb_coeff
                p[k] = p[k] - lr * lamb_coeff * update
        else:
            if scaling is None:
                scales = {k: norm(m[k]) / np.sqrt(m[k].size) for k in keys}
                united = sum(scales.values()) / len(keys)
                scaling = {k: united / scales[k] for k in keys}
            m_last = {k: m[k].copy() for k in keys}
            local = {k: ((B1 * m[k] + (1 - B1) * g[k]) * scaling[k]).reshape(n, -1) for k in keys}
            if exchange == "two_stage":
                flat = np.concatenate([local[k] for k in keys], axis=1)
                flat_err = np.concatenate([werr[k] for k in keys], axis=1)
                res, flat_err, serr = np_compressed_allreduce(
                    flat, flat_err, serr, np.ones(n, bool), "l2"
                )
                off = 0
                for k in keys:
                    size = p[k].size
                    m[k] = res[off : off + size].reshape(p[k].shape)
                    werr[k] = flat_err[:, off : off + size]
                    off += size
            else:
                for k in keys:
                    buf = local[k] + werr[k]
                    sent = np.stack([sign_codec(b) for b in buf]).astype(np.float64)
                    werr[k] = buf - sent
                    m[k] = sent.mean(0).reshape(p[k].shape)
            for k in keys:
                m[k] = m[k] / scaling[k]
                if mask is not None:
                    m[k] = m[k] * mask[k]
                grad_rec = (m[k] - m_last[k] * B1) / (1 - B1)
                v_fresh[k] = B2 * v_fresh[k] + (1 - B2) * grad_rec * grad_rec
                denom = np.sqrt(v[k]) + EPS
                prelim = m[k] / denom
                update = prelim + wd * p[k] if wd > 0 else prelim
                u_norm = norm(update)
                factor = float(np.max(denom / (np.sqrt(v_fresh[k]) + EPS)))
                if wd > 0:
                    ratio = min(1.0, norm(prelim) / u_norm)
                    factor = factor * ratio + (1.0 - ratio)
                factor = min(max(factor, c["factor_min"]), c["factor_max"])
                factor = min(factor, last[k] * (1.0 + c["factor_threshold"]))
                factor = max(factor, last[k] * (1.0 - c["factor_threshold"]))
                last[k] = factor
                coeffs[k] = cf[k] * factor
                p[k] = p[k] - lr * coeffs[k] * update
        out.append(({k: p[k].copy() for k in keys}, coeffs))
    return out


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",))


def _problem(seed, n):
    rng = np.random.default_rng(seed)
    params = {k: rng.normal(size=s).astype(np.float32) for k, s in TREE.items()}
    # A drift in the gradients' scale after the freeze moves v_fresh away from v.
    grads = [
        {k: (rng.normal(size=(n, *s)) * (1 + 0.5 * t)).astype(np.float32) for k, s in TREE.items()}
        for t in range(7)
    ]
    return params, grads


def _check(got_params, got_coeffs, ref, step):
    ref_params, ref_coeffs = ref[step]
    for k in TREE:
        np.testing.assert_allclose(
            got_params[k], ref_params[k], rtol=2e-5, atol=2e-6, err_msg=f"{k}, step {step}"
        )
        np.testing.assert_allclose(
            float(got_coeffs[k]), ref_coeffs[k], rtol=2e-5, err_msg=f"{k}, step {step}"
        )


@pytest.mark.parametrize(
    "exchange,codec,wd,masked",
    [
        ("two_stage", "sign_l2", 0.0, False),
        ("two_stage", "sign_l2", 0.05, True),
        ("allgather", "sign", 0.05, False),
    ],
)
def test_matches_deepspeed_on_8_devices(mesh, exchange, codec, wd, masked):
    """3 LAMB warm-up steps and 4 compressed steps on 8 devices: parameters (identical on
    every device) and trust ratios == numpy OnebitLamb, with weight decay and exp_avg_mask."""
    lr, freeze = 0.01, 3
    params, grads = _problem(1, N)
    mask = None
    if masked:
        mask = {k: np.ones(s, np.float32) for k, s in TREE.items()}
        mask["a"][6:] = 0  # e.g. two padded embedding rows
    tx = jaxcomp.onebit_lamb(
        lr, freeze_step=freeze, weight_decay=wd, exp_avg_mask=mask, axis_name="data",
        codec=codec, exchange=exchange, **LAMB,
    )  # fmt: skip
    ref = np_onebit_lamb(params, grads, lr, wd, freeze, exchange, mask)
    sh = NamedSharding(mesh, P("data"))
    put = lambda t: jax.tree.map(lambda x: jax.device_put(jnp.asarray(x), sh), t)  # noqa: E731
    stack = lambda t: jax.tree.map(lambda x: np.stack([np.asarray(x)] * N), t)  # noqa: E731
    state = put(stack(tx.init(params)))
    update = mesh_update(tx, mesh)
    p = stack(params)
    for step, g in enumerate(grads):
        upd, state = update(put(g), state, put(p))
        p = jax.tree.map(lambda a, u: a + np.asarray(u), p, upd)
        for k in TREE:
            assert np.all(p[k] == p[k][:1]), k  # replicated parameters stay replicated
        # One coefficient per leaf, in leaf order (sorted names).
        coeffs = dict(zip(sorted(TREE), np.asarray(state.lamb_coeff)[0], strict=True))
        _check({k: p[k][0] for k in TREE}, coeffs, ref, step)
    if masked:
        assert not np.any(np.asarray(state.mu["a"])[:, 6:])


def test_matches_deepspeed_on_one_device():
    """One device (no axis_name), two_stage: the same reference with N = 1 (jaxcomp keeps
    the 1-bit round trip that DeepSpeed skips on one device)."""
    lr, freeze, wd = 0.01, 2, 0.01
    params, grads = _problem(2, 1)
    tx = jaxcomp.onebit_lamb(
        lr, freeze_step=freeze, weight_decay=wd, codec="sign_l2", exchange="two_stage", **LAMB
    )
    ref = np_onebit_lamb(params, grads, lr, wd, freeze, "two_stage")
    state = tx.init(params)
    update = jax.jit(tx.update)
    p = {k: jnp.asarray(v) for k, v in params.items()}
    for step, g in enumerate(grads):
        upd, state = update({k: jnp.asarray(v[0]) for k, v in g.items()}, state, p)
        p = optax.apply_updates(p, upd)
        coeffs = dict(zip(sorted(TREE), np.asarray(state.lamb_coeff), strict=True))
        _check(jax.tree.map(np.asarray, p), coeffs, ref, step)
    assert int(state.count) == len(grads)


def test_bfloat16_parameters():
    """bfloat16 parameters and gradients: bfloat16 updates, float32 moments; the warm-up
    trust ratio is computed from the bfloat16 values in float32."""
    params = {"w": jnp.asarray(np.linspace(-2, 3, 24), jnp.bfloat16)}
    g = {"w": jnp.asarray(np.cos(np.arange(24.0)), jnp.bfloat16)}
    tx = jaxcomp.onebit_lamb(0.1, freeze_step=1, weight_decay=0.1, coeff_beta=0.0)
    state = tx.init(params)
    update = jax.jit(tx.update)
    upd, state = update(g, state, params)
    assert upd["w"].dtype == jnp.bfloat16 and state.mu["w"].dtype == jnp.float32
    p32, g32 = np.asarray(params["w"], np.float64), np.asarray(g["w"], np.float64)
    u = (1 - B1) * g32 / (np.sqrt((1 - B2) * g32 * g32) + EPS) + 0.1 * p32
    ratio = np.linalg.norm(p32) / np.linalg.norm(u)
    np.testing.assert_allclose(float(state.lamb_coeff[0]), ratio, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(upd["w"], np.float64), -0.1 * ratio * u, rtol=1e-2)
    for _ in range(3):  # the compressed stage
        upd, state = update(g, state, params)
        assert upd["w"].dtype == jnp.bfloat16 and np.all(np.isfinite(np.asarray(upd["w"])))


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        ({"freeze_step": 0}, "freeze_step"),
        ({"weight_decay": -1.0}, "weight_decay"),
        ({"max_coeff": 0.0}, "max_coeff"),
        ({"min_coeff": -0.1}, "min_coeff"),
        ({"min_coeff": 2.0, "max_coeff": 1.0}, "min_coeff"),
        ({"coeff_beta": 1.0}, "coeff_beta"),
        ({"factor_max": float("inf")}, "factor_max"),
        ({"factor_min": 0.0}, "factor_min"),
        ({"factor_min": 5.0}, "factor_min"),
        ({"factor_threshold": 1.0}, "factor_threshold"),
        ({"exchange": "two_stage", "codec": "onebit"}, "codec"),
        ({"exp_avg_mask": {"w": np.full(3, 2.0)}}, "exp_avg_mask"),
        ({"axis_name": ("node", "local")}, "axis_name.*two-level"),
    ],
)
def test_bad_arguments(kwargs, arg):
    kw = {"freeze_step": 2, **kwargs}
    with pytest.raises(ValueError, match=arg):
        jaxcomp.onebit_lamb(0.1, **kw)


def test_update_needs_params_and_fitting_mask():
    g = {"w": jnp.ones(4)}
    tx = jaxcomp.onebit_lamb(0.1, freeze_step=1)
    with pytest.raises(ValueError, match="params"):
        tx.update(g, tx.init(g))
    with pytest.raises(ValueError, match="exp_avg_mask"):
        jaxcomp.onebit_lamb(0.1, freeze_step=1, exp_avg_mask={"w": np.ones(3)}).init(g)


def test_optax_wrappers_inject_hyperparams_and_multisteps():
    """optax.inject_hyperparams (every float option traced) gives the plain run's updates
    and takes a new rate without recompiling; optax.MultiSteps passes the parameters."""
    params = {"w": jnp.linspace(-1.0, 2.0, 16), "s": jnp.float32(0.5)}
    grads = [jax.tree.map(lambda p, k=k: jnp.cos(p * (k + 1)), params) for k in range(4)]
    ref = jaxcomp.onebit_lamb(0.01, freeze_step=2, weight_decay=0.01)
    tx = optax.inject_hyperparams(jaxcomp.onebit_lamb, static_args=("freeze_step",))(
        learning_rate=0.01, freeze_step=2, weight_decay=0.01
    )
    s, r = tx.init(params), ref.init(params)
    f = jax.jit(tx.update)
    for g in grads:  # across the freeze
        u, s = f(g, s, params)
        ur, r = jax.jit(ref.update)(g, r, params)
        for k in params:
            np.testing.assert_allclose(np.asarray(u[k]), np.asarray(ur[k]), rtol=1e-4)
    s = s._replace(hyperparams={**s.hyperparams, "learning_rate": jnp.float32(0.02)})
    u2, _ = f(grads[0], s, params)
    assert f._cache_size() == 1
    assert np.any(np.asarray(u2["w"]) != 0)
    multi = optax.MultiSteps(jaxcomp.onebit_lamb(0.01, freeze_step=1), every_k_schedule=2)
    ms = multi.init(params)
    for g in grads:
        u, ms = jax.jit(multi.update)(g, ms, params)
    assert int(ms.inner_opt_state.count) == 2
