"""make_train_step(overlap=True): the sparsifier inside the backward pass (issue 9).

The reference is the same step with compression after the backward pass
(overlap=False): parameters and the whole optimizer state must agree bit for
bit (the BatchNorm tests below also at XLA's default optimisation level,
where XLA:CPU contracts multiply-adds). The scheduling property is read from
the compiled HLO's dataflow.
"""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist

N = 4
DIMS = (24, 40, 56, 12)  # distinct shapes: each layer's ops are recognisable in HLO


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("data",), devices=jax.devices()[:N])


def init_params(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {
        f"l{i}": {
            "w": (rng.standard_normal((DIMS[i], DIMS[i + 1])) * 0.3).astype(dtype),
            "b": np.zeros(DIMS[i + 1], dtype),
        }
        for i in range(len(DIMS) - 1)
    }


def loss_fn(params, batch):
    h = batch["x"]
    for i in range(len(DIMS) - 1):
        layer = params[f"l{i}"]
        h = jnp.tanh(h @ layer["w"].astype(h.dtype) + layer["b"].astype(h.dtype))
    return jnp.mean((h - batch["y"]) ** 2)


def make_batch(seed=1, nan_at=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((8 * N, DIMS[0])).astype(np.float32)
    y = rng.standard_normal((8 * N, DIMS[-1])).astype(np.float32)
    return {"x": x, "y": y}


def run(mesh, tx, steps, overlap, params=None, batches=None):
    params = dist.replicate(init_params() if params is None else params, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, overlap=overlap)
    metrics = []
    for i in range(steps):
        batch = make_batch(seed=i) if batches is None else batches[i]
        params, state, m = step(params, state, dist.shard_batch(batch, mesh))
        jax.block_until_ready(params)
        metrics.append(jax.tree.map(np.asarray, m))
    return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state), metrics


def assert_trees_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(x, y)


def assert_states_equal(a, b):
    """Every field bit for bit but ``threshold``, equal to within 8 float32 ulps.

    The one documented difference: ``ldte_bs``'s Laplace estimate (a few float
    operations per group) is compiled into the backward pass with overlap and
    into the packed step without it, and can round differently in its last
    bit; the sent sets, residuals and parameters are the same (checked here).
    """
    la, ta = jax.tree_util.tree_flatten_with_path(a)
    lb, tb = jax.tree_util.tree_flatten_with_path(b)
    assert ta == tb
    for (path, x), (_, y) in zip(la, lb, strict=True):
        if "threshold" in jax.tree_util.keystr(path):
            xi = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
            yi = np.asarray(y, np.float32).view(np.int32).astype(np.int64)
            assert np.all(np.abs(xi - yi) <= 8), (path, x, y)
        else:
            np.testing.assert_array_equal(x, y)


CONFIGS = {
    "ldte_bs_momentum_reuse": lambda: jaxcomp.ldte_bs(
        ratio=0.1, axis_name="data", momentum=0.9, reuse_period=2
    ),
    "top_k_groups_dense_small": lambda: jaxcomp.top_k(
        ratio=0.05,
        axis_name="data",
        min_dense_size=40,
        groups=[["['l0']['w']", "['l1']['w']"], ["['l2']['w']", "['l2']['b']"]],
    ),
    "dgc_warmup_sparse": lambda: jaxcomp.dgc(
        ratio=0.02,
        axis_name="data",
        warmup_ratios=(0.25,),
        steps_per_epoch=2,
        exchange="sparse",
    ),
    "random_k_zero_policy": lambda: jaxcomp.random_k(
        ratio=0.1, axis_name="data", nonfinite="zero", seed=3
    ),
    # DGC's Nesterov correction and GRACE's residual scaling: their products are
    # rounded before the adds, so the backward pass's fusions give the same bits.
    "top_k_nesterov_scaled": lambda: jaxcomp.top_k(
        ratio=0.1,
        axis_name="data",
        momentum=0.9,
        nesterov=True,
        residual_scale=0.9,
        gradient_scale=1.1,
    ),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_overlap_matches_compress_after_backward(mesh, name):
    tx = optax.chain(CONFIGS[name](), optax.sgd(0.1, momentum=0.5))
    # 3 steps: a reuse step (s = 2), a refresh, and the warm-up phase change (2 steps/epoch).
    ref = run(mesh, tx, 3, overlap=False)
    got = run(mesh, tx, 3, overlap=True)
    assert_trees_equal(got[0], ref[0])  # parameters
    assert_states_equal(got[1], ref[1])  # every state field, residuals and counters
    for a, b in zip(got[2], ref[2], strict=True):
        assert_trees_equal(a, b)  # loss and wire bytes
    # Not vacuous: the parameters moved and something was sent.
    assert not np.array_equal(got[0]["l0"]["w"], init_params()["l0"]["w"])
    assert got[2][-1]["wire_bytes"] > 0


def test_overlap_bf16_params(mesh):
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), init_params())
    tx = optax.chain(jaxcomp.ldte_bs(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    ref = run(mesh, tx, 2, overlap=False, params=params)
    got = run(mesh, tx, 2, overlap=True, params=params)
    assert_trees_equal(got[0], ref[0])
    assert_states_equal(got[1], ref[1])


def test_overlap_nan_skips_only_the_groups_that_hold_it(mesh):
    """``nonfinite="skip"`` is decided per group with overlap: documented difference."""
    tx = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    params = init_params()
    params = dist.replicate(params, mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, overlap=True)
    params, state, _ = step(params, state, dist.shard_batch(make_batch(0), mesh))
    before = jax.tree.map(np.asarray, optax.tree.get(state, "residual"))

    # A NaN in the first layer's bias gradient of every device: a NaN bias
    # value reaches every leaf's gradient through the forward pass, so use a
    # loss whose NaN touches only l2's gradients instead.
    def nan_loss(p, batch):
        bad = jnp.sum(p["l2"]["b"]) * jnp.float32(np.nan)
        return loss_fn(p, batch) + bad

    step_nan = dist.make_train_step(nan_loss, tx, mesh, overlap=True)
    params2, state2, _ = step_nan(params, state, dist.shard_batch(make_batch(1), mesh))
    after = jax.tree.map(np.asarray, optax.tree.get(state2, "residual"))
    # l2's bias group held the NaN: its residual is untouched; the others moved on.
    np.testing.assert_array_equal(after["l2"]["b"], before["l2"]["b"])
    assert not np.array_equal(after["l0"]["w"], before["l0"]["w"])
    for leaf in jax.tree.leaves(after):
        assert np.all(np.isfinite(leaf))
    for leaf in jax.tree.leaves(jax.tree.map(np.asarray, params2)):
        assert np.all(np.isfinite(leaf))
    assert int(np.asarray(optax.tree.get(state2, "nonfinite_steps"))[0]) == 1
    sent = jaxcomp.statistics(state2)["sent_count"]  # stacked per device
    assert int(np.asarray(sent["l2"]["b"])[0]) == 0


# --- rejected set-ups: a clear error, never a silent wrong result --------------


def _expect_error(mesh, tx, match):
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, overlap=True)
    with pytest.raises(ValueError, match=match):
        step(params, state, dist.shard_batch(make_batch(), mesh))


def test_overlap_rejects_transform_before_the_sparsifier(mesh):
    tx = optax.chain(
        optax.clip_by_global_norm(1.0), jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1)
    )
    _expect_error(mesh, tx, "first in optax.chain")


def test_overlap_rejects_masked_sparsifier(mesh):
    mask = {f"l{i}": {"w": True, "b": False} for i in range(3)}
    tx = optax.chain(
        optax.masked(jaxcomp.top_k(ratio=0.1, axis_name="data"), mask),
        jaxcomp.dense_exchange("data"),
        optax.sgd(0.1),
    )
    _expect_error(mesh, tx, "first in optax.chain|does not average")


def test_overlap_rejects_missing_or_local_sparsifier(mesh):
    _expect_error(
        mesh, optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(0.1)), "needs a jaxcomp"
    )
    _expect_error(
        mesh, optax.chain(jaxcomp.top_k(ratio=0.1), optax.sgd(0.1)), "axis_name|does not average"
    )


@pytest.mark.parametrize("comp_axis, step_axis", [(("data",), "data"), ("data", ("data",))])
def test_overlap_accepts_either_spelling_of_the_axis(mesh, comp_axis, step_axis):
    # ("data",) and "data" are one axis: overlap=True used to refuse the pair.
    tx = optax.chain(jaxcomp.top_k(ratio=0.25, axis_name=comp_axis), optax.sgd(0.1))
    rng = np.random.default_rng(0)
    data = {"x": rng.standard_normal((2 * N, 8)), "y": rng.standard_normal(2 * N)}
    batch = dist.shard_batch(jax.tree.map(lambda a: a.astype(np.float32), data), mesh)
    out = {}
    for overlap in (False, True):
        params = dist.replicate(jnp.zeros(8), mesh)
        state = dist.init_opt_state(tx, params, mesh, axis_name=step_axis)
        step = dist.make_train_step(
            lambda w, b: jnp.mean((b["x"] @ w - b["y"]) ** 2),
            tx,
            mesh,
            axis_name=step_axis,
            overlap=overlap,
            donate=False,
        )
        out[overlap] = jax.tree.map(np.asarray, step(params, state, batch)[:2])
    assert_trees_equal(out[True], out[False])
    assert np.count_nonzero(out[True][0]) > 0


def test_overlap_rejects_dgc_clipping(mesh):
    # The norm of the whole gradient does not exist while the backward pass runs.
    tx = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data", clip_norm=1.0), optax.sgd(0.1))
    _expect_error(mesh, tx, "clip_norm")


def test_overlap_rejects_injected_hyperparameters(mesh):
    tx = optax.chain(
        optax.inject_hyperparams(jaxcomp.ldte_bs, static_args=("ratio", "axis_name"))(
            ratio=0.1, axis_name="data", momentum=0.9
        ),
        optax.sgd(0.1),
    )
    _expect_error(mesh, tx, "injected")


def test_overlap_bad_flag():
    with pytest.raises(ValueError, match="overlap"):
        dist.make_train_step(loss_fn, optax.sgd(0.1), jax.make_mesh((1,), ("data",)), overlap=2)


# --- the compiled program's dataflow --------------------------------------------

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _entry_graph(hlo: str):
    """Instruction -> operand names of the ENTRY computation, and the text of each."""
    entry = hlo[hlo.index("\nENTRY") :]
    entry = entry[: entry.index("\n}")]
    deps, text = {}, {}
    for line in entry.splitlines()[1:]:
        m = _INSTR.match(line)
        if not m:
            continue
        name, rhs = m.groups()
        rhs = rhs.split(", metadata=")[0]
        deps[name] = re.findall(r"%([\w.\-]+)", rhs)
        text[name] = rhs
    return deps, text


def _ancestors(deps, name):
    seen, stack = set(), [name]
    while stack:
        for d in deps.get(stack.pop(), []):
            if d not in seen:
                seen.add(d)
                stack.append(d)
    return seen


@pytest.mark.parametrize("overlap", [False, True])
def test_last_layer_exchange_waits_for_first_layer_gradient_only_without_overlap(mesh, overlap):
    """With overlap the last layer's collective depends only on its own gradient.

    Compressing after the backward pass decides ``nonfinite="skip"`` on every
    gradient at once, so each collective waits for the first layer's weight
    gradient (the last one the backward computes). With ``overlap=True`` it
    does not: a scheduler is free to issue it while the backward still runs.
    """
    tx = optax.chain(
        jaxcomp.ldte_bs(ratio=0.1, axis_name="data", exchange="sparse"), optax.sgd(0.1)
    )
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, overlap=overlap)
    hlo = step.lower(params, state, dist.shard_batch(make_batch(), mesh)).compile().as_text()
    deps, text = _entry_graph(hlo)
    # The first layer's weight gradient: the dot producing f32[24,40] (or its
    # transposed layout) from the batch; the last layer's weight message: the
    # all-gathers of l2.w's capacity (56 * 12 = 672 elements, k = 68, 1.5k = 102).
    # Without overlap the step is packed: one all-gather of every layer's slots
    # (indices and values), which waits for every gradient.
    first_grad = [n for n, t in text.items() if re.match(r"f32\[(24,40|40,24)\]\{1,0\} dot\(", t)]
    shape = r"\w32\[4,102\]" if overlap else r"\w32\[4,\d+\]"
    last_exchange = [n for n, t in text.items() if re.match(shape + r".* all-gather\(", t)]
    assert len(first_grad) == 1, first_grad
    assert len(last_exchange) == 2, last_exchange  # indices and values
    waits = [first_grad[0] in _ancestors(deps, n) for n in last_exchange]
    assert waits == [not overlap] * 2


@pytest.mark.parametrize("has_aux", [True])  # the aux path; without aux is the same tap
def test_overlap_unused_parameter_keeps_its_residual(mesh, has_aux):
    """A leaf the loss does not use still gets compressed (zero gradient, old residual).

    JAX skips a backward rule whose outputs all have zero cotangents; without
    the tap's loss token the unused leaf's residual would come back as zeros.
    """
    params = {**init_params(), "unused": np.ones(64, np.float32)}

    def loss(p, batch):
        value = loss_fn({k: v for k, v in p.items() if k != "unused"}, batch)
        return (value, {"twice": 2 * value}) if has_aux else value

    tx = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    results = {}
    for overlap in (False, True):
        p = dist.replicate(params, mesh)
        state = dist.init_opt_state(tx, p, mesh)
        residual = state[0].residual
        state = (state[0]._replace(residual={**residual, "unused": residual["unused"] + 1.0}),)
        state += (dist.init_opt_state(tx, params, mesh)[1],)
        step = dist.make_train_step(loss, tx, mesh, overlap=overlap, has_aux=has_aux)
        p, state, metrics = step(p, state, dist.shard_batch(make_batch(), mesh))
        results[overlap] = jax.tree.map(np.asarray, (p, state, metrics))
    assert_trees_equal(results[True], results[False])
    # Not vacuous: the unused leaf's residual (all ones) was partly sent.
    unused_res = results[True][1][0].residual["unused"]
    assert 0 < np.count_nonzero(unused_res[0]) < 64
    assert np.count_nonzero(results[True][0]["unused"] != 1.0) > 0


@pytest.mark.parametrize("overlap", [False, True])
def test_program_issues_last_layer_exchange_before_first_layer_gradient(mesh, overlap):
    """In the program JAX emits (the lowered module XLA schedules), with overlap the
    last layer's collective comes before the first layer's weight gradient.

    The taps are applied where each parameter is first used, so the reverse pass
    emits a group's compression and exchange right after that layer's backward.
    (XLA:CPU's scheduler then moves the collectives after the backward in the
    compiled module: collectives are synchronous on CPU.)
    """
    tx = optax.chain(
        jaxcomp.ldte_bs(ratio=0.1, axis_name="data", exchange="sparse"), optax.sgd(0.1)
    )
    params = dist.replicate(init_params(), mesh)
    state = dist.init_opt_state(tx, params, mesh)
    step = dist.make_train_step(loss_fn, tx, mesh, overlap=overlap)
    lines = step.lower(params, state, dist.shard_batch(make_batch(), mesh)).as_text().splitlines()
    # The first layer's weight gradient: a dot_general giving (24, 40) or (40, 24);
    # the last layer's message: all-gathers of l2.w's capacity, 102 pairs.
    first_grad = [
        i for i, line in enumerate(lines)
        if "dot_general" in line and re.search(r"-> tensor<(24x40|40x24)xf32>", line)
    ]  # fmt: skip
    shape = r"-> tensor<4x102x(i32|f32)>" if overlap else r"-> tensor<4x\d+x(i32|f32)>"
    last_exchange = [
        i for i, line in enumerate(lines)
        if "all_gather" in line and re.search(shape, line)
    ]  # fmt: skip
    assert len(first_grad) == 1 and len(last_exchange) == 2, (first_grad, last_exchange)
    before = [i < first_grad[0] for i in last_exchange]
    assert before == [overlap] * 2


def test_overlap_with_dropout_rng_and_model_state(mesh):
    """``rng=`` (dropout) and ``mutable=True`` (a running statistic) as without overlap."""

    def loss(p, batch, model_state, rng):
        h = jnp.tanh(batch["x"] @ p["l0"]["w"] + p["l0"]["b"])
        keep = jax.random.bernoulli(rng, 0.8, h.shape)
        h = jnp.where(keep, h / 0.8, 0)
        for i in (1, 2):
            h = jnp.tanh(h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"])
        running = 0.9 * model_state["mean"] + 0.1 * jnp.mean(h, axis=0)
        return jnp.mean((h - batch["y"]) ** 2), {"mean": running}

    tx = optax.chain(jaxcomp.ldte_bs(ratio=0.1, axis_name="data", momentum=0.9), optax.sgd(0.1))
    results = {}
    for overlap in (False, True):
        params = dist.replicate(init_params(), mesh)
        state = dist.init_opt_state(tx, params, mesh)
        model_state = dist.replicate({"mean": np.zeros(DIMS[-1], np.float32)}, mesh)
        step = dist.make_train_step(loss, tx, mesh, mutable=True, overlap=overlap)
        for i in range(2):
            params, state, model_state, metrics = step(
                params,
                state,
                dist.shard_batch(make_batch(seed=i), mesh),
                model_state=model_state,
                rng=jax.random.key(i),
            )
            jax.block_until_ready(params)
        results[overlap] = jax.tree.map(np.asarray, (params, state, model_state, metrics))
    (p1, s1, m1, x1), (p2, s2, m2, x2) = results[True], results[False]
    assert_trees_equal((p1, m1, x1), (p2, m2, x2))
    assert_states_equal(s1, s2)  # ldte_bs's thresholds: see assert_states_equal
    assert np.any(results[True][2]["mean"] != 0)


def test_overlap_rejects_apply_if_finite_around_the_chain(mesh):
    """The exchange runs in the backward pass, before any wrapper's NaN decision.

    Accepting it would silently apply the finite groups' updates on a NaN step
    (the wrapper sees the exchanged, NaN-free updates).
    """
    inner = optax.chain(jaxcomp.top_k(ratio=0.1, axis_name="data"), optax.sgd(0.1))
    _expect_error(
        mesh, dist.apply_if_finite(inner, 3, axis_name="data"), "cannot wrap a sparsifier"
    )
    _expect_error(mesh, optax.apply_if_finite(inner, 3), "apply_if_finite|nested trace")


def test_statistics_carrier_round_trips_integers_through_arithmetic():
    # Small ints bit-cast into float32 would be denormals (flushed to zero by
    # XLA:CPU arithmetic); the carrier holds exact 16-bit halves instead.
    from jaxcomp.transforms.overlap import _from_halves, _int_halves

    values = jnp.asarray([0, 1, 5, 65535, 65536, 2**24 + 1, 2**31 - 1, -1, -(2**31)], jnp.int32)

    @jax.jit
    def round_trip(v):
        hi, lo = _int_halves(v)
        return _from_halves(hi + 0.0, lo * 1.0)

    np.testing.assert_array_equal(np.asarray(round_trip(values)), np.asarray(values))


# --- BatchNorm: one rounding of the error-feedback accumulation (issue 34, item 4) ---


class _BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        for width in (32, 16):
            x = nn.relu(nn.BatchNorm(use_running_average=False, momentum=0.9)(nn.Dense(width)(x)))
        return nn.Dense(4)(x)


def _bn_batch(seed):
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal((8 * N, 12)).astype(np.float32),
        "y": rng.standard_normal((8 * N, 4)).astype(np.float32),
    }


def _batch_norm_setup(mesh):
    model = _BatchNormNet()
    variables = model.init(jax.random.key(0), jnp.zeros((2, 12)))
    params, stats = jax.device_get(variables["params"]), jax.device_get(variables["batch_stats"])

    def loss(p, batch, model_state):
        out, new = model.apply(
            {"params": p, "batch_stats": model_state}, batch["x"], mutable=["batch_stats"]
        )
        return jnp.mean((out - batch["y"]) ** 2), new["batch_stats"]

    return loss, dist.replicate(params, mesh), dist.replicate(stats, mesh)


def _bn_tx(momentum=None):
    return optax.chain(
        jaxcomp.top_k(ratio=0.1, axis_name="data", reuse_period=2, momentum=momentum),
        optax.sgd(0.1, momentum=0.9),
    )


# XLA's default backend optimisation level. tests/conftest.py sets 0 to compile
# faster; at 0 LLVM contracts no multiply and add into an FMA, at XLA's default
# (users' programs) it does, where XLA put the two in one kernel.
USERS_OPTIMIZATION = {"xla_backend_optimization_level": 3}


def _as_users_compile(step, params, state, batch, stats, fixed_batch=True):
    """``step`` compiled at XLA's default optimisation level.

    Returns ``f(params, state, stats)`` on ``batch`` (``f(params, state,
    stats, batch)`` with ``fixed_batch=False``) -> ``(params, state, stats,
    metrics, aux)``.
    """
    compiled = step.lower(params, state, batch, model_state=stats).compile(
        compiler_options=USERS_OPTIMIZATION
    )
    if fixed_batch:
        return lambda p, s, ms: compiled(p, s, batch, ms, None, {})
    return lambda p, s, ms, b: compiled(p, s, b, ms, None, {})


def test_overlap_batch_norm_accumulator_rounds_the_gradient_first(mesh):
    """The accumulator is ``fl(old residual + fl(gradient))`` in both paths, at XLA's default level.

    BatchNorm's scale gradient ends in a multiply (``rsqrt(var + eps) *
    sum(dy * (x - mean))``). With overlap XLA fuses it into the compressor's
    accumulation, and at XLA:CPU's default optimisation level LLVM contracted
    the two into one fused multiply-add (``fl(r + a * b)``): the residual of
    the scale 1 ulp off compress-after-backward's from the second step (issue
    34, item 4). Checked against independently taken per-device gradients,
    element by element, for both paths.
    """
    loss, params, stats = _batch_norm_setup(mesh)
    tx = _bn_tx()
    state = dist.init_opt_state(tx, params, mesh)
    batch = dist.shard_batch(_bn_batch(1), mesh)
    # Each path's step compiled once; compress-after-backward's also takes the
    # first step (on another batch of the same shapes): the scales leave 1 and
    # the residuals are nonzero.
    steps = {
        overlap: _as_users_compile(
            dist.make_train_step(loss, tx, mesh, mutable=True, overlap=overlap, donate=False),
            params,
            state,
            batch,
            stats,
            fixed_batch=False,
        )
        for overlap in (False, True)
    }
    params, state, stats, *_ = steps[False](
        params, state, stats, dist.shard_batch(_bn_batch(0), mesh)
    )

    def grads(p, ms, b):
        g = dist.per_device_grad(loss, "data", has_aux=True)(p, b, model_state=ms)[0]
        return jax.tree.map(lambda x: x[None], g)

    per_device = jax.jit(
        jax.shard_map(
            grads, mesh=mesh, in_specs=(P(), P(), P("data")), out_specs=P("data"), check_vma=False
        )
    )
    g = per_device.lower(params, stats, batch).compile(compiler_options=USERS_OPTIMIZATION)(
        params, stats, batch
    )
    old = jax.tree.map(np.asarray, jaxcomp.residuals(state))
    want = jax.tree.map(lambda r, x: r + np.asarray(x), old, g)  # float32: two roundings
    for overlap in (False, True):
        _, new_state, *_ = steps[overlap](params, state, stats, batch)
        got = jax.tree.map(np.asarray, jaxcomp.residuals(new_state))
        for path, r in jax.tree_util.tree_leaves_with_path(got):
            kept = r != 0  # not sent: the residual is the accumulator
            assert kept.sum() > 0
            np.testing.assert_array_equal(
                r[kept], _at(want, path)[kept], err_msg=f"{overlap}{path}"
            )


def _at(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


@pytest.mark.parametrize("momentum", [None, 0.9], ids=["plain", "momentum"])
@pytest.mark.parametrize("users", [False, True], ids=["tests_xla_flags", "xla_default_level"])
def test_overlap_batch_norm_with_reuse_bit_for_bit(mesh, users, momentum):
    """BatchNorm with ``reuse_period=2``: 4 steps as compress-after-backward, bit for bit.

    Mutable statistics, the reused threshold and the residuals flow through
    the overlap path as after the backward pass, compiled as the tests
    compile and as users run (XLA's default optimisation level, where XLA:CPU
    contracts multiply-adds: before the accumulation rounded the gradient
    and ``m * velocity`` first, the parameters parted by 2e-2 within 30
    steps, and with momentum correction by 1e-9 from the second step).
    """
    loss, params0, stats0 = _batch_norm_setup(mesh)
    tx = _bn_tx(momentum)
    results = {}
    for overlap in (False, True):
        params, stats = params0, stats0
        state = dist.init_opt_state(tx, params, mesh)
        step = dist.make_train_step(loss, tx, mesh, mutable=True, overlap=overlap, donate=False)
        run = None
        for i in range(4):
            batch = dist.shard_batch(_bn_batch(i), mesh)
            if run is None:
                run = (
                    _as_users_compile(step, params, state, batch, stats, fixed_batch=False)
                    if users
                    else lambda p, s, ms, b, step=step: step(p, s, b, model_state=ms)
                )
            params, state, stats, metrics, *_ = run(params, state, stats, batch)
            jax.block_until_ready(params)
        results[overlap] = jax.tree.map(np.asarray, (params, state, stats, metrics))
    assert_trees_equal(results[True], results[False])
    assert np.any(jaxcomp.residuals(results[True][1])["BatchNorm_0"]["scale"] != 0)
