"""One vocabulary for every compressor (docs/vocabulary.md): canonical names, aliases.

The table itself is checked against the signatures by
``tests/test_structure.py``; here the behaviour: memory-less sparsification
(``error_feedback=False``) against an independent numpy reference on one
device and on a mesh, and the aliases (``exchange="sparse"``, Signum's
``momentum``) giving exactly the results of the canonical names.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import k_of, mesh_update
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp.transforms.quantize import quantize, sign_quantizer

RATIO = 0.1
SHAPES = {"w": (40, 25), "b": (7,)}


def _grads(rng, lead=()):
    return {k: rng.laplace(size=(*lead, *s)).astype(np.float32) for k, s in SHAPES.items()}


def _top_k_np(x: np.ndarray) -> np.ndarray:
    """Independent memory-less top-k of one tensor: its k largest magnitudes, the rest 0."""
    flat = x.reshape(-1)
    k = k_of(RATIO, flat.size)
    keep = np.argsort(-np.abs(flat), kind="stable")[:k]
    out = np.zeros_like(flat)
    out[keep] = flat[keep]
    return out.reshape(x.shape)


def _bits(x):
    return np.asarray(x).view(np.uint32)


# ---------------------------------------------------------------------------
# error_feedback=False: update = mean over devices of top-k(g_i), residual zero.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("factory", [jaxcomp.top_k, jaxcomp.ldte_bs])
def test_memoryless_top_k_one_device_matches_numpy(factory):
    # ldte_bs: a threshold search, exact top-k on this data only where it hits k;
    # checked as "sends only values of g, at most the capacity, residual zero".
    tx = factory(RATIO, error_feedback=False)
    rng = np.random.default_rng(0)
    state = tx.init(_grads(rng))
    update = jax.jit(tx.update)
    for _ in range(3):
        g = _grads(rng)
        u, state = update({k: jnp.asarray(v) for k, v in g.items()}, state)
        for leaf, gl in g.items():
            got = np.asarray(u[leaf])
            assert not np.any(np.asarray(state.residual[leaf])), leaf  # nothing kept
            if factory is jaxcomp.top_k:
                np.testing.assert_array_equal(got, _top_k_np(gl), err_msg=leaf)
            else:
                sent = got != 0
                np.testing.assert_array_equal(got[sent], gl[sent], err_msg=leaf)
                assert sent.sum() <= np.ceil(1.5 * k_of(RATIO, gl.size)), leaf


@pytest.mark.parametrize("n_dev", [4, 8])
@pytest.mark.parametrize("exchange", ["allgather", "dense", "auto"])
def test_memoryless_top_k_on_a_mesh_is_the_mean_of_per_device_top_k(n_dev, exchange):
    assert len(jax.devices()) >= n_dev  # tests/conftest.py forces 8 host devices
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    tx = jaxcomp.top_k(RATIO, axis_name="data", exchange=exchange, error_feedback=False)
    step = mesh_update(tx, mesh)
    sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(1)
    stack = lambda t: jax.tree.map(lambda x: jnp.stack([x] * n_dev), t)  # noqa: E731
    state = jax.device_put(stack(tx.init(_grads(rng))), sharding)
    for _ in range(3):
        g = _grads(rng, (n_dev,))
        u, state = step(jax.device_put(g, sharding), state)
        u, res = jax.device_get((u, state.residual))
        for leaf, gl in g.items():
            want = np.mean([_top_k_np(gl[d]) for d in range(n_dev)], axis=0, dtype=np.float64)
            for d in range(n_dev):  # every device gets the mean (summation order aside)
                np.testing.assert_allclose(u[leaf][d], want, rtol=1e-6, atol=1e-7, err_msg=leaf)
            assert not np.any(res[leaf]), leaf


def test_error_feedback_true_is_the_default_bit_for_bit():
    rng = np.random.default_rng(2)
    g = {k: jnp.asarray(v) for k, v in _grads(rng).items()}
    outs = []
    for tx in (
        jaxcomp.dgc(RATIO, momentum=0.9),
        jaxcomp.dgc(RATIO, momentum=0.9, error_feedback=True),
    ):
        state = tx.init(g)
        for _ in range(2):
            u, state = tx.update(g, state)
        outs.append((u, state.residual, state.velocity))
    for a, b in zip(jax.tree.leaves(outs[0]), jax.tree.leaves(outs[1]), strict=True):
        assert np.array_equal(_bits(a), _bits(b))


@pytest.mark.parametrize(
    "kwargs",
    [dict(error_feedback=1), dict(error_feedback=False, low_pass=0.5),
     dict(error_feedback=False, defer_residual=True)],
)  # fmt: skip
def test_bad_error_feedback_names_the_argument(kwargs):
    with pytest.raises(ValueError, match="error_feedback"):
        jaxcomp.top_k(RATIO, **kwargs)


# ---------------------------------------------------------------------------
# Aliases: the same results as the canonical names.
# ---------------------------------------------------------------------------


def test_sparse_is_an_alias_of_allgather_bit_for_bit():
    n_dev = 4
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    rng = np.random.default_rng(3)
    g = jax.device_put(_grads(rng, (n_dev,)), sharding)
    outs = {}
    for name in ("allgather", "sparse"):
        tx = jaxcomp.ldte_bs(RATIO, axis_name="data", exchange=name)
        state = jax.device_put(
            jax.tree.map(lambda x: jnp.stack([x] * n_dev), tx.init(_grads(rng))), sharding
        )
        step = mesh_update(tx, mesh)
        for _ in range(2):
            u, state = step(g, state)
        outs[name] = jax.device_get((u, state.residual, state.wire_bytes))
    for a, b in zip(
        jax.tree.leaves(outs["allgather"]), jax.tree.leaves(outs["sparse"]), strict=True
    ):
        assert np.array_equal(_bits(a), _bits(b))


def test_unknown_exchange_lists_the_canonical_names_and_the_alias():
    with pytest.raises(ValueError, match="exchange must be one of.*'allgather'.*'sparse'"):
        jaxcomp.top_k(RATIO, exchange="all_gather")


def _signum_run(tx):
    g1, g2 = jnp.array([1.0, -2.0, 3.0, -0.5]), jnp.array([-1.0, 1.0, -1.0, 4.0])
    state = tx.init({"w": g1})
    for g in (g1, g2):
        u, state = tx.update({"w": g}, state)
    return np.asarray(u["w"]), np.asarray(state.velocity["w"])


@pytest.mark.parametrize(
    "canonical, deprecated",
    [
        (lambda: jaxcomp.signum(beta=0.5), lambda: jaxcomp.signum(momentum=0.5)),
        (
            lambda: quantize(sign_quantizer(), beta=0.5),
            lambda: quantize(sign_quantizer(), momentum=0.5),
        ),
    ],
    ids=["signum", "quantize"],
)
def test_momentum_is_a_deprecated_alias_of_beta(canonical, deprecated):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the canonical name warns about nothing
        want = _signum_run(canonical())
    with pytest.warns(DeprecationWarning, match="beta"):
        tx = deprecated()
    for a, b in zip(want, _signum_run(tx), strict=True):
        assert np.array_equal(_bits(a), _bits(b))


def test_signum_default_beta_is_the_papers():
    assert all(
        np.array_equal(_bits(a), _bits(b))
        for a, b in zip(
            _signum_run(jaxcomp.signum()), _signum_run(jaxcomp.signum(0.9)), strict=True
        )
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.signum(0.5, momentum=0.5),
        lambda: quantize(sign_quantizer(), beta=0.5, momentum=0.5),
    ],
    ids=["signum", "quantize"],
)
def test_beta_and_momentum_together_name_both(make):
    with pytest.raises(ValueError, match="beta.*momentum"):
        make()
