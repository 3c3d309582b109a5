"""Argument and gradient validation (issue 8, items 5, 9 and 13).

Every bad argument gets a ValueError naming it; numpy scalars and 0-d arrays
of the right kind are accepted; bool/int/complex gradient leaves and
init/update structure mismatches are named by leaf path; ``ldte_bs``'s
``variant="paper"`` is the paper's algorithm bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FACTORIES

import jaxcomp
from jaxcomp.selection import selectors

# ---------------------------------------------------------------------------
# Item 9: arguments.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.ldte_bs(np.float32(0.1)),
        lambda: jaxcomp.top_k(np.array(0.1), seed=np.int64(3), min_dense_size=np.int32(4)),
        lambda: jaxcomp.top_k(jnp.float32(0.1), capacity_factor=np.float64(2.0)),
        lambda: jaxcomp.dgc(0.1, max_adaptations=np.int64(3), sample_ratio=np.float32(0.5)),
        lambda: jaxcomp.qsgd(np.int64(4), bucket_size=np.int64(64), seed=np.int64(7)),
        lambda: jaxcomp.onebit(bucket_size=np.array(16)),
        lambda: jaxcomp.bounded_sign(np.float32(0.5), error_bound=np.float64(0.9)),
        lambda: jaxcomp.sparsify("top_k", 0.1, warmup_ratios=np.array([0.5]), steps_per_epoch=2),
    ],
)
def test_numpy_scalars_accepted(make):
    tx = make()
    g = {"w": jnp.linspace(-1.0, 1.0, 200)}
    u, _ = jax.jit(tx.update)(g, tx.init(g))
    assert np.any(np.asarray(u["w"]))


def test_float32_ratio_means_its_decimal():
    # np.float32(0.1) is 0.10000000149 in float64: k must still be 10 of 100.
    g = {"w": jnp.arange(1.0, 101.0)}
    for ratio in (np.float32(0.1), jnp.float32(0.1), np.array(0.1, np.float32)):
        tx = jaxcomp.top_k(ratio)
        _, state = tx.update(g, tx.init(g))
        assert int(state.sent_count[0]) == 10


BAD = [
    (lambda: jaxcomp.top_k(True), "ratio"),
    (lambda: jaxcomp.top_k(np.bool_(True)), "ratio"),
    (lambda: jaxcomp.top_k(float("inf")), "ratio"),
    (lambda: jaxcomp.top_k(np.array([0.1, 0.2])), "ratio"),
    (lambda: jaxcomp.top_k(0.1, capacity_factor=float("inf")), "capacity_factor"),
    (lambda: jaxcomp.top_k(0.1, capacity_factor="2"), "capacity_factor"),
    (lambda: jaxcomp.top_k(0.1, capacity_factor=True), "capacity_factor"),
    (lambda: jaxcomp.top_k(0.1, momentum=float("nan")), "momentum"),
    (lambda: jaxcomp.top_k(0.1, momentum="0.9"), "momentum"),
    (lambda: jaxcomp.top_k(0.1, min_dense_size=2.0), "min_dense_size"),
    (lambda: jaxcomp.top_k(0.1, min_dense_size=True), "min_dense_size"),
    (lambda: jaxcomp.top_k(0.1, warmup_ratios=0.25, steps_per_epoch=2), "warmup_ratios"),
    (lambda: jaxcomp.top_k(0.1, warmup_ratios="0.25", steps_per_epoch=2), "warmup_ratios"),
    (lambda: jaxcomp.top_k(0.1, warmup_ratios=(0.5,), steps_per_epoch=2.5), "steps_per_epoch"),
    (lambda: jaxcomp.top_k(0.1, seed=1.5), "seed"),
    (lambda: jaxcomp.top_k(0.1, seed=2**40), "seed"),
    (lambda: jaxcomp.top_k(0.1, granularity=["layer"]), "granularity"),
    (lambda: jaxcomp.top_k(0.1, exchange=None), "exchange"),
    (lambda: jaxcomp.top_k(0.1, residual_dtype="nope"), "residual_dtype"),
    (lambda: jaxcomp.top_k(0.1, residual_dtype=jnp.complex64), "residual_dtype"),
    (lambda: jaxcomp.top_k(0.1, momentum_masking="yes"), "momentum_masking"),
    (lambda: jaxcomp.top_k(0.1, low_pass=0.0), "low_pass"),
    (lambda: jaxcomp.top_k(0.1, low_pass=1.5), "low_pass"),
    (lambda: jaxcomp.top_k(0.1, low_pass=float("nan")), "low_pass"),
    (lambda: jaxcomp.sparsify("top_k", 0.1, low_pass="0.5"), "low_pass"),
    (lambda: jaxcomp.ldte_bs(0.1, delta=-1), "delta"),
    (lambda: jaxcomp.ldte_bs(0.1, delta=float("inf")), "delta"),
    (lambda: jaxcomp.ldte_bs(0.1, max_iters=-1), "max_iters"),
    (lambda: jaxcomp.ldte_bs(0.1, upper=0.5), "upper"),
    (lambda: jaxcomp.ldte_bs(0.1, aim=2.0), "aim"),
    (lambda: jaxcomp.ldte_bs(0.1, moment_sample=1), "moment_sample"),
    (lambda: jaxcomp.ldte_bs(0.1, exact_below=-2), "exact_below"),
    (lambda: jaxcomp.ldte_bs(0.1, variant="fast"), "variant"),
    (lambda: jaxcomp.ldte_bs(0.1, hint="last"), "hint"),
    (lambda: jaxcomp.ldte_bs(0.1, hint=1.0), "hint"),
    (lambda: jaxcomp.binary_search(0.1, delta=-1), "delta"),
    (lambda: jaxcomp.dgc(0.1, decay=1.0), "decay"),
    (lambda: jaxcomp.dgc(0.1, max_adaptations=-1), "max_adaptations"),
    (lambda: jaxcomp.trimmed_top_k(0.1, step=0), "step"),
    (lambda: jaxcomp.threshold(0.1, threshold=float("nan")), "threshold"),
    (lambda: jaxcomp.gaussian_k(0.1, corrections=True), "corrections"),
    (lambda: jaxcomp.sparsify("dgc", 0.1, selector_options={"decay": 2.0}), "decay"),
    (lambda: jaxcomp.sparsify("ldte_bs", 0.1, selector_options={"delta": -1.0}), "delta"),
    (lambda: jaxcomp.qsgd(np.float64(4.0)), "levels"),
    (lambda: jaxcomp.qsgd(4, bucket_size=True), "bucket_size"),
    (lambda: jaxcomp.qsgd(4, seed="0"), "seed"),
    (lambda: jaxcomp.bounded_sign(float("nan")), "lam"),
    (lambda: jaxcomp.bounded_sign(0.5, error_bound="1"), "error_bound"),
    (lambda: jaxcomp.onebit(error_feedback=1), "error_feedback"),
]


@pytest.mark.parametrize("make,arg", BAD)
def test_bad_argument_named(make, arg):
    with pytest.raises(ValueError, match=arg):
        make()


def test_bad_comm_arguments_named():
    from jaxcomp.comm import collectives

    with pytest.raises(ValueError, match="num_backup"):
        collectives.fastest_mask(jnp.zeros(4), True)
    with pytest.raises(ValueError, match="num_backup"):
        collectives.fastest_mask(jnp.zeros(4), 4)
    collectives.fastest_mask(jnp.zeros(4), np.int64(1))
    with pytest.raises(ValueError, match="exchange"):
        collectives.exchange_mean(jnp.zeros(1, jnp.int32), jnp.zeros(1), 3, "data", exchange=1)


# ---------------------------------------------------------------------------
# Items 5 and 9: gradient leaves and structure.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FACTORIES))
@pytest.mark.parametrize(
    "dtype,word",
    [(jnp.complex64, "complex"), (jnp.int32, "int32"), (jnp.bool_, "bool")],
)
def test_non_real_float_leaf_named(name, dtype, word):
    tx = FACTORIES[name](0.1)
    good = {"a": {"w": jnp.ones((20,))}}
    bad = {"a": {"w": jnp.ones((20,), dtype)}}
    with pytest.raises(ValueError, match=rf"\['a'\]\['w'\].*{word}"):
        tx.init(bad)
    state = tx.init(good)
    with pytest.raises(ValueError, match=rf"\['a'\]\['w'\].*{word}"):
        tx.update(bad, state)


@pytest.mark.parametrize("name", ["ldte_bs", "qsgd"])
def test_structure_mismatch_named(name):
    tx = FACTORIES[name](0.1)
    state = tx.init({"a": jnp.ones((20,)), "b": jnp.ones((3,))})
    with pytest.raises(ValueError, match=r"\['c'\]"):
        tx.update({"a": jnp.ones((20,)), "c": jnp.ones((3,))}, state)
    with pytest.raises(ValueError, match=r"\['b'\]"):
        tx.update({"a": jnp.ones((20,))}, state)
    if state.residual is None:
        return  # qsgd without error feedback keeps no per-leaf array: any shape is fine
    with pytest.raises(ValueError, match=r"\['a'\].*\(21,\).*\(20,\)"):
        tx.update({"a": jnp.ones((21,)), "b": jnp.ones((3,))}, state)


# ---------------------------------------------------------------------------
# Item 13: the paper's LDTE-BS.
# ---------------------------------------------------------------------------

PAPER = dict(estimator="moments", search="bisect", aim=1.0, moment_sample=None, hint=None)


def _mixture(n, seed):
    # 90% N(0, 1e-4) + 10% Laplace: the estimate misses, the search runs.
    k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
    small = 1e-2 * jax.random.normal(k1, (n,))
    big = jax.random.laplace(k2, (n,))
    return jnp.where(jax.random.uniform(k3, (n,)) < 0.1, big, small)


def test_ldte_paper_variant_is_the_paper_algorithm():
    n, ratio = 70_000, 1e-3  # above the 65536-element moment sample
    g = {"w": _mixture(n, 0)}
    paper = jaxcomp.ldte_bs(ratio, variant="paper")
    explicit = jaxcomp.ldte_bs(ratio, **PAPER)
    default = jaxcomp.ldte_bs(ratio)
    outs = {}
    for name, tx in (("paper", paper), ("explicit", explicit), ("default", default)):
        u, s = jax.jit(tx.update)(g, tx.init(g))
        outs[name] = (np.asarray(u["w"]), s)
    np.testing.assert_array_equal(outs["paper"][0], outs["explicit"][0])
    assert int(outs["paper"][1].search_iterations[0]) == int(
        outs["explicit"][1].search_iterations[0]
    )
    # Independent reference: the selector with the paper's options.
    k = selectors.target_count(ratio, n)
    sel = jax.jit(lambda x: selectors.ldte_bs(x, k, **PAPER))(g["w"])
    ref = np.where(np.abs(np.asarray(g["w"])) > float(sel.threshold), np.asarray(g["w"]), 0)
    np.testing.assert_array_equal(outs["paper"][0], ref)
    assert float(outs["paper"][1].threshold[0]) == float(sel.threshold)
    # The default (improved) variant takes another path: its sample-quantile
    # probes land elsewhere in [k, 1.5k], in fewer passes than bisection.
    assert not np.array_equal(outs["default"][0], outs["paper"][0])
    its = [int(outs[v][1].search_iterations[0]) for v in ("default", "paper")]
    assert its[0] < its[1], its


@pytest.mark.parametrize(
    "kwargs,arg",
    [
        (dict(search="interpolate"), "search"),
        (dict(aim=1.25), "aim"),
        (dict(moment_sample=65536), "moment_sample"),
        (dict(estimator="mle"), "estimator"),
        (dict(hint="previous"), "hint"),
    ],
)
def test_ldte_paper_variant_rejects_contradicting_options(kwargs, arg):
    with pytest.raises(ValueError, match=rf"variant='paper'.*{arg}"):
        jaxcomp.ldte_bs(0.1, variant="paper", **kwargs)
    # Options that agree with the paper, and the improved variant's overrides, are fine.
    jaxcomp.ldte_bs(0.1, variant="paper", **PAPER)
    jaxcomp.ldte_bs(0.1, **kwargs)


# ---------------------------------------------------------------------------
# Issue 34, item 10: a custom selector must return a Selection.
# ---------------------------------------------------------------------------


def threshold_only_selector(x, k):
    """A custom selector's common mistake: it returns the bare threshold."""
    return jnp.sort(jnp.abs(x))[-k]


def good_selector(x, k):
    t = jnp.sort(jnp.abs(x))[-k - 1]
    return selectors.Selection(t, jnp.sum(jnp.abs(x) > t, dtype=jnp.int32), jnp.int32(0))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"reuse_period": 2}, {"axis_name": "data"}],
    ids=["one_device", "reuse", "exchange"],
)
def test_custom_selector_returning_an_array_is_named(kwargs):
    x = np.arange(1.0, 17.0) * (-1.0) ** np.arange(16)  # distinct magnitudes
    g = {"w": jnp.asarray(x, jnp.float32)}

    def run():  # reuse_period probes the selector at construction: named there
        tx = jaxcomp.sparsify(threshold_only_selector, 0.25, min_dense_size=0, **kwargs)
        if "axis_name" not in kwargs:
            return tx.update(g, tx.init(g))
        mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
        spec = jax.sharding.PartitionSpec()
        f = jax.shard_map(tx.update, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False)
        return f(g, tx.init(g))

    with pytest.raises(ValueError, match=r"selector threshold_only_selector returned .*Selection"):
        run()
    # The same selector returning a Selection works: the top 4 of |x| are sent (numpy).
    tx = jaxcomp.sparsify(good_selector, 0.25, min_dense_size=0)
    u, _ = tx.update(g, tx.init(g))
    np.testing.assert_array_equal(np.asarray(u["w"]), np.where(np.abs(x) > 12, x, 0))


# ---------------------------------------------------------------------------
# Issue 34, item 12: errors that pointed the wrong way.
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("axis_name", [None, ()])
def test_dense_exchange_without_an_axis_is_refused_at_construction(axis_name):
    with pytest.raises(ValueError, match=r"dense_exchange: axis_name must name the mesh axis"):
        jaxcomp.dense_exchange(axis_name)


def test_dense_exchange_with_an_axis_is_the_mean():
    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    tx = jaxcomp.dense_exchange("data")
    g = np.arange(8.0, dtype=np.float32).reshape(2, 4)
    spec = jax.sharding.PartitionSpec("data")
    f = jax.jit(
        jax.shard_map(
            lambda x: tx.update(x[0], tx.init(x[0]))[0][None], mesh=mesh, in_specs=spec,
            out_specs=spec,
        )
    )  # fmt: skip
    x = jax.device_put(g, jax.sharding.NamedSharding(mesh, spec))
    np.testing.assert_array_equal(np.asarray(f(x)), np.stack([g.mean(0)] * 2))


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.top_k(0.25),
        lambda: jaxcomp.qsgd(4, error_feedback=True, min_dense_size=0),
        lambda: jaxcomp.powersgd(1),
        lambda: optax.chain(jaxcomp.top_k(0.25), optax.sgd(0.1)),
    ],
    ids=["top_k", "qsgd", "powersgd", "chain"],
)
def test_state_restored_without_a_target_says_how_to_restore(make, tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    tx = make()
    g = {"w": jnp.asarray(np.random.default_rng(0).laplace(size=(8, 6)), jnp.float32)}
    _, state = tx.update(g, tx.init(g))  # a state worth restoring
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "state", state)
    with ocp.StandardCheckpointer() as ckpt:
        plain = ckpt.restore(tmp_path / "state")  # no target: dicts and lists
        typed = ckpt.restore(tmp_path / "state", jax.eval_shape(tx.init, g))
    with pytest.raises(ValueError, match=r"restore with the abstract state as target"):
        tx.update(g, plain)
    # Restored with the target, the next step is the one the original state gives.
    want, typed_want = tx.update(g, state)
    got, typed_got = tx.update(g, typed)
    np.testing.assert_array_equal(np.asarray(got["w"]), np.asarray(want["w"]))
    for a, b in zip(jax.tree.leaves(typed_got), jax.tree.leaves(typed_want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_elias_encode_takes_python_ints_past_int64():
    from jaxcomp import coding

    values = [1, 2**63, 2**64 - 1, 5]  # numpy alone reads this list as float64 (or object)
    data = coding.elias_encode(values)
    assert coding.elias_decode(data, 4).tolist() == values  # exact, not rounded
    # The same values as uint64 give the same bytes.
    assert data == coding.elias_encode(np.array(values, np.uint64))
    with pytest.raises(ValueError, match=r"\[1, 2\*\*64 - 1\].*maximum 18446744073709551616"):
        coding.elias_encode([1, 2**64])
    with pytest.raises(ValueError, match=r"integers in \[1, 2\*\*64 - 1\].*minimum -1"):
        coding.elias_encode([-1, 2**63])
    with pytest.raises(ValueError, match=r"values must be integers, got dtype float64"):
        coding.elias_encode([1.5, 2**63])


def test_groups_path_removed_by_optax_masked_is_named():
    params = {"a": jnp.ones(100), "b": jnp.ones(100), "c": jnp.ones(3)}
    mask = {"a": True, "b": False, "c": True}
    tx = optax.masked(jaxcomp.top_k(0.1, groups=[["['a']", "['b']"]]), mask)
    with pytest.raises(ValueError, match=r"leaf path .*b.* was removed by optax.masked"):
        tx.init(params)
    # A typo is still an unknown path.
    tx = optax.masked(jaxcomp.top_k(0.1, groups=[["['a']", "['x']"]]), mask)
    with pytest.raises(ValueError, match=r"unknown leaf path \"\['x'\]\""):
        tx.init(params)


def _train_step_error(tx):
    from jaxcomp import distributed as dist

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    loss = lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2)  # noqa: E731
    params = dist.replicate(jnp.zeros(2), mesh)
    batch = dist.shard_batch({"x": np.eye(2, dtype=np.float32), "y": np.ones(2, np.float32)}, mesh)
    step = dist.make_train_step(loss, tx, mesh)
    with pytest.raises(ValueError) as info:
        step(params, dist.init_opt_state(tx, params, mesh), batch)
    return str(info.value)


def test_train_step_with_a_wrong_compressor_axis_name_says_so():
    tx = optax.chain(jaxcomp.top_k(0.5, axis_name="batch"), optax.sgd(0.1))
    message = _train_step_error(tx)
    assert "unbound axis name: batch" in message
    assert "give the compressor axis_name='data'" in message
    assert "apply_if_finite" not in message  # not the advice for another problem


def test_train_step_refuses_optax_apply_if_finite_without_the_type_dump():
    inner = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
    message = _train_step_error(optax.apply_if_finite(inner, 3))
    assert "jaxcomp.apply_if_finite(tx, max_consecutive_errors, axis_name='data')" in message
    assert "true_fun" not in message and len(message) < 600  # JAX's cond types: ~2.5 KB


# A hand-written shard_map (no make_train_step probe): the compressor itself
# refuses, when traced, a wrapper whose lax.cond each device decides alone
# (issue 34, item 9). Before, a NaN on one device aborted the process after a
# minute (check_vma=False) or JAX printed kilobytes of branch types.
_PER_DEVICE_WRAPPERS = {
    "optax_apply_if_finite": lambda inner: optax.apply_if_finite(inner, 3),
    "jaxcomp_apply_if_finite_no_axis": lambda inner: jaxcomp.apply_if_finite(inner, 3),
    "multisteps_skip_not_finite": lambda inner: optax.MultiSteps(
        inner, 2, should_skip_update_fn=optax.skip_not_finite
    ),
}
_EXCHANGING = {
    "top_k": lambda: jaxcomp.top_k(0.5, axis_name="data"),
    "qsgd": lambda: jaxcomp.qsgd(bits=2, axis_name="data"),
    "powersgd": lambda: jaxcomp.powersgd(rank=1, axis_name="data"),
    "dense_exchange": lambda: jaxcomp.dense_exchange("data"),
}


def _hand_written_step(tx, check_vma):
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((2,), ("data",), devices=jax.devices()[:2])
    grads = np.ones((2, 4, 8), np.float32)
    grads[1, 0, 0] = np.nan  # one device's gradient
    grads = jax.device_put(grads, jax.NamedSharding(mesh, P("data")))
    state = tx.init(jnp.zeros((4, 8)))

    def step(g, s):
        u, s = tx.update(g[0], s)
        return u, jax.tree.map(lambda x: x[None], s)  # per device, stacked

    f = jax.shard_map(
        step, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P(), P("data")),
        check_vma=check_vma,
    )  # fmt: skip
    return jax.jit(f).lower(grads, state), jax.jit(f), grads, state


@pytest.mark.parametrize("check_vma", [True, False])
@pytest.mark.parametrize("compressor", sorted(_EXCHANGING))
@pytest.mark.parametrize("wrapper", sorted(_PER_DEVICE_WRAPPERS))
def test_per_device_skip_around_an_exchange_is_refused_in_a_hand_written_shard_map(
    wrapper, compressor, check_vma
):
    tx = _PER_DEVICE_WRAPPERS[wrapper](optax.chain(_EXCHANGING[compressor](), optax.sgd(0.1)))
    with pytest.raises(ValueError) as info:
        _hand_written_step(tx, check_vma)
    message = str(info.value)
    assert "axis_name='data'" in message and "jaxcomp.apply_if_finite(tx" in message
    assert "true_fun" not in message and len(message) < 800  # JAX's cond types: ~2.5 KB


@pytest.mark.parametrize("check_vma", [True, False])
def test_jaxcomp_apply_if_finite_with_the_axis_skips_on_every_device(check_vma):
    inner = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
    tx = jaxcomp.apply_if_finite(inner, 3, axis_name="data")
    _, step, grads, state = _hand_written_step(tx, check_vma)
    updates, new_state = step(grads, state)
    np.testing.assert_array_equal(np.asarray(updates), np.zeros((4, 8), np.float32))
    # Skipped on both devices: counted, and nothing enters either residual.
    np.testing.assert_array_equal(np.asarray(new_state.notfinite_count), [1, 1])
    residual = jaxcomp.residuals(new_state.inner_state)
    np.testing.assert_array_equal(np.asarray(residual), np.zeros((2, 4, 8), np.float32))
