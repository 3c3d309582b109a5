"""Every named factory works under ``optax.inject_hyperparams`` (issue 8, item 8).

The traceable hyperparameters live in the optimizer state: the jitted update
equals the plain factory's bit for bit, and changing a hyperparameter between
steps takes effect without a retrace. Static options passed traced raise a
ValueError that points at ``static_args``.
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from jaxcomp.quantization import sign_quantizer

RATIO = 0.05

# (factory, static arguments, traceable hyperparameters, one to change, new value)
CASES = {
    "ldte_bs": (jaxcomp.ldte_bs, dict(ratio=RATIO), dict(momentum=0.9, delta=0.0), "delta", 0.05),
    "top_k": (jaxcomp.top_k, dict(ratio=RATIO), dict(momentum=0.9), "momentum", 0.3),
    "low_pass": (jaxcomp.top_k, dict(ratio=RATIO), dict(low_pass=0.5), "low_pass", 0.25),
    # Injected at 1, the filter is off bit for bit (r + (r_new - r) can round).
    "low_pass_one": (jaxcomp.top_k, dict(ratio=RATIO), dict(low_pass=1.0), "low_pass", 0.5),
    "dgc": (jaxcomp.dgc, dict(ratio=RATIO), dict(momentum=0.9, decay=0.8), "decay", 0.5),
    "threshold": (jaxcomp.threshold, dict(ratio=RATIO), dict(threshold=1.0), "threshold", 0.25),
    "binary_search": (
        jaxcomp.binary_search,
        dict(ratio=RATIO),
        dict(delta=0.0, momentum=0.5),
        "delta",
        0.1,
    ),
    # momentum is handled by sparsify for all: changing it is tested once (top_k).
    "random_k": (jaxcomp.random_k, dict(ratio=RATIO), dict(momentum=0.9, seed=3), None, None),
    "gaussian_k": (jaxcomp.gaussian_k, dict(ratio=RATIO), dict(momentum=0.9), None, None),
    "trimmed_top_k": (jaxcomp.trimmed_top_k, dict(ratio=RATIO), dict(momentum=0.9), None, None),
    "sparsify": (
        jaxcomp.sparsify,
        dict(selector="top_k", ratio=RATIO),
        dict(momentum=0.5),
        None,
        None,
    ),
    "qsgd": (jaxcomp.qsgd, dict(levels=7, min_dense_size=0), dict(seed=5), None, None),
    "onebit": (jaxcomp.onebit, dict(), dict(), None, None),
    "sign_sgd": (jaxcomp.sign_sgd, dict(), dict(), None, None),
    "ef_sign_sgd": (jaxcomp.ef_sign_sgd, dict(), dict(), None, None),
    "bounded_sign": (
        jaxcomp.bounded_sign,
        dict(),
        dict(lam=0.6, error_bound=0.9),
        "error_bound",
        0.7,
    ),
    "quantize": (
        jaxcomp.quantize,
        dict(quantizer=sign_quantizer(8)),
        dict(seed=1),
        None,
        None,
    ),
}


def _grads(step):
    return {"w": jax.random.laplace(jax.random.fold_in(jax.random.key(0), step), (30, 20))}


def _bits(tree):
    return jax.tree.map(lambda x: np.atleast_1d(np.asarray(x)).view(np.uint8), tree)


def _assert_bit_equal(a, b):
    for x, y in zip(jax.tree.leaves(_bits(a)), jax.tree.leaves(_bits(b)), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", list(CASES))
def test_inject_hyperparams_matches_plain(name):
    factory, static, hyper, change, new_value = CASES[name]
    # Every factory has an explicit signature that inject_hyperparams can bind.
    params = inspect.signature(factory).parameters.values()
    assert all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in params)
    injected = optax.inject_hyperparams(factory, static_args=tuple(static))(**static, **hyper)
    plain = factory(**static, **hyper)
    traces = []

    def step(g, s):
        traces.append(1)
        return injected.update(g, s)

    step = jax.jit(step)
    s_inj, s_plain = injected.init(_grads(0)), plain.init(_grads(0))
    for t in range(2):
        u_inj, s_inj = step(_grads(t), s_inj)
        u_plain, s_plain = jax.jit(plain.update)(_grads(t), s_plain)
        _assert_bit_equal(u_inj, u_plain)
        _assert_bit_equal(s_inj.inner_state, s_plain)
    assert any(np.any(np.asarray(x)) for x in jax.tree.leaves(u_inj))
    if change is None:
        return
    # A new value through the state takes effect, without a retrace.
    s_inj.hyperparams[change] = jnp.asarray(new_value, s_inj.hyperparams[change].dtype)
    u_inj, s_inj2 = step(_grads(2), s_inj)
    changed = factory(**static, **{**hyper, change: new_value})
    u_ref, s_ref = jax.jit(changed.update)(_grads(2), s_plain)
    _assert_bit_equal(u_inj, u_ref)
    _assert_bit_equal(s_inj2.inner_state, s_ref)
    # ... and it mattered: the old value gives another result.
    u_old, _ = jax.jit(plain.update)(_grads(2), s_plain)
    assert any(
        not np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(u_old), jax.tree.leaves(u_ref), strict=True)
    ) or not all(
        np.array_equal(np.asarray(a), np.asarray(b))
        for a, b in zip(jax.tree.leaves(s_ref), jax.tree.leaves(s_inj.inner_state), strict=True)
    )
    assert len(traces) == 1


@pytest.mark.parametrize(
    "factory,kwargs,arg",
    [
        (jaxcomp.ldte_bs, dict(ratio=RATIO), "ratio"),
        (jaxcomp.ldte_bs, dict(ratio=RATIO, max_iters=10), "max_iters"),
        (jaxcomp.dgc, dict(ratio=RATIO, sample_ratio=0.1), "sample_ratio"),
        (jaxcomp.qsgd, dict(levels=7), "levels"),
        (jaxcomp.onebit, dict(bucket_size=64), "bucket_size"),
    ],
)
def test_static_argument_passed_traced_names_static_args(factory, kwargs, arg):
    static = tuple(k for k in kwargs if k != arg and k in ("ratio", "levels"))
    tx = optax.inject_hyperparams(factory, static_args=static)(**kwargs)
    g = _grads(0)
    state = tx.init(g)
    with pytest.raises(ValueError, match=rf"{arg}.*static_args"):
        jax.jit(tx.update)(g, state)
    # Named in static_args, the same call works.
    tx = optax.inject_hyperparams(factory, static_args=tuple(kwargs))(**kwargs)
    jax.jit(tx.update)(g, tx.init(g))
