"""GRACE's residual scaling of the error-feedback memory, against a numpy port.

GRACE's ``ResidualMemory(beta, gamma)`` (sands-lab/grace,
``grace_dl/torch/memory/residual.py``)::

    compensate:  tensor = beta * residual + gamma * tensor
    update:      residual = tensor - decompress(compress(tensor))

is ``residual_scale=beta, gradient_scale=gamma`` of every jaxcomp
error-feedback compressor. The port below is that memory around plain numpy
compressors (top-k, EF-signSGD's scaled sign, PowerSGD's power-iteration
step). One documented difference: GRACE's memory starts empty and skips the
scaling on a tensor's first step; jaxcomp's starts at zeros, so the port
starts at zeros too (the first step sends ``gamma * g``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import k_of, mesh_update
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp

SHAPES = {"b": (9,), "w": (30, 20)}
BETA, GAMMA = 0.75, 1.25


class ResidualMemoryPort:
    """GRACE's ``ResidualMemory`` around ``compress`` (name, tensor -> decompressed)."""

    def __init__(self, beta, gamma, compress):
        self.beta, self.gamma, self.compress = np.float32(beta), np.float32(gamma), compress
        self.residuals = {k: np.zeros(s, np.float32) for k, s in SHAPES.items()}

    def step(self, grads):
        out = {}
        for name, g in grads.items():
            # beta * residual + gamma * tensor, each product rounded to float32.
            tensor = self.beta * self.residuals[name] + self.gamma * np.float32(g)
            out[name] = self.compress(name, tensor)
            self.residuals[name] = tensor - out[name]
        return out


def _top_k(ratio):
    def compress(name, x):
        flat = x.reshape(-1)
        keep = np.argsort(-np.abs(flat), kind="stable")[: k_of(ratio, flat.size)]
        out = np.zeros_like(flat)
        out[keep] = flat[keep]
        return out.reshape(x.shape)

    return compress


def _scaled_sign(name, x):
    """EF-signSGD's codec over the whole leaf: ``||x||_1 / d * sign(x)`` (sign(0) = +1)."""
    scale = np.float32(np.sum(np.abs(np.float64(x))) / x.size)
    return np.where(x >= 0, scale, -scale).astype(np.float32)


class _PowerSGDPort:
    """One power-iteration step per matrix leaf (warm-started ``Q``); 1-D leaves dense."""

    def __init__(self, q0):
        self.q = {k: np.float64(v) for k, v in q0.items() if v is not None}

    def __call__(self, name, m):
        if name not in self.q:
            return m.copy()
        m64 = np.float64(m)
        q, _ = np.linalg.qr(self.q[name])
        p, _ = np.linalg.qr(m64 @ q)
        q_new = m64.T @ p
        self.q[name] = q_new
        return (p @ q_new.T).astype(np.float32)


def _grads(rng, lead=()):
    return {k: rng.laplace(size=(*lead, *s)).astype(np.float32) for k, s in SHAPES.items()}


def _run(tx, port, steps=4, seed=0, exact=False, rtol=2e-6, atol=1e-6):
    rng = np.random.default_rng(seed)
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    step = jax.jit(tx.update)
    for i in range(steps):
        g = _grads(rng)
        old = jax.device_get(state.residual)
        want = port.step(g)
        u, state = step(g, state)
        u, res = jax.device_get((u, state.residual))
        for name in SHAPES:
            if exact:
                np.testing.assert_array_equal(u[name], want[name], err_msg=f"{name} {i}")
                np.testing.assert_array_equal(res[name], port.residuals[name], err_msg=name)
                # Nothing lost, generalized: sent + new == beta * old + gamma * g.
                acc = np.float32(BETA) * old[name] + np.float32(GAMMA) * g[name]
                np.testing.assert_array_equal(u[name] + res[name], acc, err_msg=name)
            else:
                np.testing.assert_allclose(u[name], want[name], rtol, atol, err_msg=f"{name} {i}")
                np.testing.assert_allclose(
                    res[name], port.residuals[name], rtol, atol, err_msg=name
                )
                acc = np.float32(BETA) * old[name] + np.float32(GAMMA) * g[name]
                np.testing.assert_allclose(u[name] + res[name], acc, 1e-6, 1e-6, err_msg=name)
    return state


def test_top_k_is_grace_residual_memory_bit_for_bit():
    ratio = 0.1
    tx = jaxcomp.top_k(ratio, residual_scale=BETA, gradient_scale=GAMMA)
    _run(tx, ResidualMemoryPort(BETA, GAMMA, _top_k(ratio)), exact=True)


def test_ef_sign_sgd_is_grace_residual_memory():
    tx = jaxcomp.ef_sign_sgd(residual_scale=BETA, gradient_scale=GAMMA)
    _run(tx, ResidualMemoryPort(BETA, GAMMA, _scaled_sign))


def test_powersgd_is_grace_residual_memory():
    tx = jaxcomp.powersgd(2, residual_scale=BETA, gradient_scale=GAMMA)
    q0 = jax.device_get(tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()}).q)
    port = ResidualMemoryPort(BETA, GAMMA, _PowerSGDPort(q0))
    _run(tx, port, rtol=1e-4, atol=2e-5)


def test_default_scales_are_plain_error_feedback_bit_for_bit():
    """``residual_scale=1, gradient_scale=1`` (given, or injected) is the default."""
    import optax  # noqa: PLC0415

    g = {k: jnp.asarray(v) for k, v in _grads(np.random.default_rng(1)).items()}
    plain = jaxcomp.ldte_bs(0.1)
    given = optax.inject_hyperparams(jaxcomp.ldte_bs, static_args=("ratio",))(
        ratio=0.1, residual_scale=1.0, gradient_scale=1.0
    )
    s1, s2 = plain.init(g), given.init(g)
    for _ in range(2):
        u1, s1 = jax.jit(plain.update)(g, s1)
        u2, s2 = jax.jit(given.update)(g, s2)
    for a, b in zip(jax.tree.leaves((u1, s1.residual)),
                    jax.tree.leaves((u2, s2.inner_state.residual)), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_top_k_on_a_mesh_scales_each_devices_memory():
    n_dev, ratio = 8, 0.1
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tx = jaxcomp.top_k(
        ratio, axis_name="data", exchange="allgather", residual_scale=BETA, gradient_scale=GAMMA
    )
    ports = [ResidualMemoryPort(BETA, GAMMA, _top_k(ratio)) for _ in range(n_dev)]
    zeros = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * n_dev), tx.init(zeros)), sharding)
    step = mesh_update(tx, mesh)
    rng = np.random.default_rng(2)
    for _ in range(3):
        g = _grads(rng, (n_dev,))
        msgs = [p.step({k: v[d] for k, v in g.items()}) for d, p in enumerate(ports)]
        u, state = step(jax.device_put(g, sharding), state)
        u, res = jax.device_get((u, state.residual))
        for name in SHAPES:
            mean = np.mean([m[name] for m in msgs], axis=0, dtype=np.float64)
            for d in range(n_dev):
                np.testing.assert_allclose(u[name][d], mean, rtol=1e-5, atol=1e-6)
                np.testing.assert_array_equal(res[name][d], ports[d].residuals[name])


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.ef_sign_sgd(residual_scale=0.5),
        lambda: jaxcomp.powersgd(2, residual_scale=0.5),
    ],
    ids=["ef_sign_sgd", "powersgd"],
)
def test_a_skipped_step_keeps_the_residual_unscaled(make):
    tx = make()
    rng = np.random.default_rng(3)
    state = tx.init({k: jnp.zeros(s) for k, s in SHAPES.items()})
    step = jax.jit(tx.update)
    _, state = step(_grads(rng), state)
    bad = _grads(rng)
    bad["w"][0, 0] = np.nan
    u, new = step(bad, state)
    assert int(new.nonfinite_steps) == 1
    for a, b in zip(jax.tree.leaves(state.residual), jax.tree.leaves(new.residual), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(u))


BAD = [
    (dict(residual_scale=1.5), "residual_scale"),
    (dict(residual_scale=-0.1), "residual_scale"),
    (dict(residual_scale=math.nan), "residual_scale"),
    (dict(gradient_scale=0.0), "gradient_scale"),
    (dict(gradient_scale="2"), "gradient_scale"),
    (dict(error_feedback=False, residual_scale=0.5), "error_feedback"),
    (dict(error_feedback=False, gradient_scale=2.0), "error_feedback"),
]


@pytest.mark.parametrize("kwargs, match", BAD)
@pytest.mark.parametrize(
    "factory",
    [
        lambda **kw: jaxcomp.top_k(0.1, **kw),
        lambda **kw: jaxcomp.sparsify("ldte_bs", 0.1, **kw),
        lambda **kw: jaxcomp.onebit(**kw),
        lambda **kw: jaxcomp.qsgd(bits=2, **{"error_feedback": True, **kw}),
        lambda **kw: jaxcomp.powersgd(2, **kw),
    ],
    ids=["top_k", "sparsify", "onebit", "qsgd", "powersgd"],
)
def test_bad_scales_name_the_argument(factory, kwargs, match):
    with pytest.raises(ValueError, match=match):
        factory(**kwargs)


def test_low_pass_and_residual_scaling_are_exclusive():
    with pytest.raises(ValueError, match="low_pass.*residual_scale"):
        jaxcomp.top_k(0.1, low_pass=0.5, residual_scale=0.9)


def test_the_adams_have_no_residual_scaling():
    """1-bit Adam / 0/1 Adam compress Adam's momentum with worker and server errors
    (DeepSpeed's compressed all-reduce); GRACE's memory is a gradient compressor's,
    so they do not take the option (docs/vocabulary.md says why)."""
    import inspect  # noqa: PLC0415

    for factory in (jaxcomp.onebit_adam, jaxcomp.zero_one_adam):
        params = inspect.signature(factory).parameters
        assert "residual_scale" not in params and "gradient_scale" not in params
