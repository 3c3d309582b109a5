"""GPU and TPU readiness without either: everything jaxcomp jits lowers for CUDA and TPU.

``jax.export.export(jax.jit(f), platforms=("cuda",))`` lowers ``f`` to StableHLO for
CUDA on this CPU-only jaxlib (no CUDA plugin needed, no compilation): a lowering that
only works on CPU (a CPU-only custom call such as LAPACK's ``lapack_*`` or a host
callback, a ``platform_dependent`` without a GPU branch) fails here. Checked:

* the jitted ``tx.update`` of every compressor of the conformance families
  (``helpers.FACTORIES``: sparsifiers, quantizers, low-rank, Signum, casts) and of the
  compressed optimizers (1-bit Adam, 0/1 Adam; ``helpers.OPTIMIZERS`` when present),
  with ``axis_name="data"`` inside ``jax.shard_map`` over the 8 simulated devices,
  state stacked per device as the conformance suite builds it;
* a whole :func:`jaxcomp.distributed.make_train_step` (a small MLP) with ldte_bs,
  top_k, qsgd and PowerSGD on a 1-D ``("data",)`` mesh and a 2-D ``("data", "model")``
  mesh with ``param_specs``;
* each export's ``platforms`` is ``("cuda",)``, it spans the 8 devices with the input
  shardings given, and every ``custom_call`` target in it is one a CUDA jaxlib
  provides (``CUDA_CUSTOM_CALLS``);
* the backend switches of :mod:`jaxcomp.selection._kernels`: the CUDA export holds the
  GPU formulation and the CPU export the CPU one, and the GPU formulation, run here on
  CPU, gives the numpy reference's results, identical to the CPU formulation's.

TPU (``platforms=("tpu",)``, the same way): every compressor's update, its custom calls
in ``TPU_CUSTOM_CALLS`` (jaxcomp's hold none), and the kernels' TPU form: the plain one,
as CUDA's (``_kernels.PLATFORM_FORMS``), run forced on CPU by the GPU-form test.

Not checked (needs a GPU): that XLA:GPU compiles these modules, their speed, and
numerics of GPU kernels (e.g. TF32 matmuls; jaxcomp's matmuls ask for HIGHEST).
"""

from __future__ import annotations

import functools
import re

import helpers
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import FACTORIES
from jax import export
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from jaxcomp import distributed as dist
from jaxcomp.comm import sparse_allreduce
from jaxcomp.selection import _kernels as kernels

N_DEV = 8
RATIO = 0.1
MIN_DENSE = 6
# A 2-D leaf (PowerSGD compresses it), 1000 + 37 bf16 elements (not a multiple of any
# block or row size) and a leaf sent dense (<= MIN_DENSE).
TREE = {
    "w": ((40, 26), jnp.float32),
    "v": ((1037,), jnp.bfloat16),
    "d": ((6,), jnp.float32),
}

# Every compressor as make(**kw): the conformance families (helpers.FACTORIES, ratio
# RATIO) and the compressed optimizers (helpers.OPTIMIZERS: 1-bit and 0/1 Adam, no
# ratio; these stand-ins if helpers has none). Stage switches (freeze steps) are
# runtime conditions: every stage is in the exported program.
_OPTIMIZERS = {
    "onebit_adam": lambda **kw: jaxcomp.onebit_adam(1e-3, freeze_step=2, **kw),
    "zero_one_adam": lambda **kw: jaxcomp.zero_one_adam(1e-3, var_freeze_step=4, **kw),
}
ALL = {
    **{name: functools.partial(make, RATIO) for name, make in FACTORIES.items()},
    **getattr(helpers, "OPTIMIZERS", _OPTIMIZERS),
}

# custom_call targets that exist in a CUDA jaxlib (jax 0.10.2): the GPU entries of
# jax.export's list of targets with a stable serialization (cuSOLVER QR, Cholesky, LU,
# eigh, SVD, tridiagonal; cuSPARSE gtsv2; the fused threefry kernel) and XLA's built-in
# sharding markers, which every backend's SPMD partitioner consumes. jaxcomp itself
# needs none of them today (its exports hold no custom_call at all); a CPU-only target
# (lapack_*, xla_ffi_python_cpu_callback, ...) in a CUDA export fails the test.
CUDA_CUSTOM_CALLS = frozenset(
    {
        "Sharding",
        "SPMDFullToShardShape",
        "SPMDShardToFullShape",
        "annotate_device_placement",
        "cu_threefry2x32_ffi",
        "cu_lu_pivots_to_permutation",
        "cusolver_getrf_ffi",
        "cusolver_geqrf_ffi",
        "cusolver_orgqr_ffi",
        "cusolver_potrf_ffi",
        "cusolver_syevd_ffi",
        "cusolver_gesvd_ffi",
        "cusolver_gesvdj_ffi",
        "cusolver_sytrd_ffi",
        "cusparse_gtsv2_ffi",
    }
)

# TPU: XLA:TPU's built-in targets with a stable serialization in jax.export's list (QR,
# Householder product, eigh, LU, approximate top-k, buffers, Pallas' tpu_custom_call) and
# the sharding markers. Found by exporting for ("tpu",) on this jaxlib: jaxcomp's updates
# and train steps hold no custom_call; QR lowers to Qr, lax.approx_max_k to ApproxTopK.
TPU_CUSTOM_CALLS = frozenset(
    {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape", "annotate_device_placement"}
    | {"Qr", "ProductOfElementaryHouseholderReflectors", "Eigh", "LuDecomposition"}
    | {"ApproxTopK", "AllocateBuffer", "tpu_custom_call"}
)
ALLOWED = {"cuda": CUDA_CUSTOM_CALLS, "tpu": TPU_CUSTOM_CALLS}

# Both the pretty (`custom_call @name(`) and the generic (`call_target_name = "name"`)
# MLIR spellings.
_CUSTOM_CALL = re.compile(r'custom_call\s*@"?([\w.$-]+)|call_target_name\s*=\s*"([^"]+)"')


def custom_call_targets(exp: export.Exported) -> set[str]:
    return {a or b for a, b in _CUSTOM_CALL.findall(exp.mlir_module())}


def _op_count(exp: export.Exported, op: str) -> int:
    return len(re.findall(rf"\b{re.escape(op)}\b", exp.mlir_module()))


# Multi-result reduces: "%r:2 = stablehlo.reduce(...) ... : (tensor<1x1024xi32>, ...".
_MULTI_REDUCE = re.compile(r"%\S+:(\d+) = stablehlo\.reduce\(.*?: \((tensor<[^>]+>)")


# The CPU kernels' operand: int32 indicators split into rows (the GPU form is flat).
_ROWS = re.compile(r"tensor<\d+x\d+xi32>")


def _multi_reduces(exp):
    return [(int(k), ty) for k, ty in _MULTI_REDUCE.findall(exp.mlir_module())]


def _check_cuda(exp: export.Exported, args, platform: str = "cuda") -> None:
    assert exp.platforms == (platform,)
    bad = custom_call_targets(exp) - ALLOWED[platform]
    assert not bad, f"custom calls a {platform} jaxlib lacks: {sorted(bad)}"
    leaves = jax.tree.leaves(args)
    mesh = leaves[0].sharding.mesh
    assert exp.nr_devices == mesh.size
    got = exp.in_shardings_jax(mesh)
    assert len(got) == len(leaves)
    # The export records the layout a GPU run gets: the same devices hold the same
    # elements of every input the program reads (jit drops unread inputs, e.g. state
    # counters an update overwrites, and records no sharding for them).
    assert sum(g is not None for g in got) >= len(jax.tree.leaves(args[0]))
    for g, a in zip(got, leaves, strict=True):
        assert g is None or g.is_equivalent_to(a.sharding, len(a.shape)), (g, a.sharding)


def _abstract(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


# ---------------------------------------------------------------------------
# The custom-call check itself, on a lowering known to differ per platform.
# ---------------------------------------------------------------------------


def test_custom_call_check_tells_cpu_from_cuda_targets():
    qr = jax.jit(lambda m: jnp.linalg.qr(m)[0])
    m = jax.ShapeDtypeStruct((20, 5), jnp.float32)
    cpu = custom_call_targets(export.export(qr, platforms=("cpu",))(m))
    cuda = custom_call_targets(export.export(qr, platforms=("cuda",))(m))
    # QR lowers to LAPACK on CPU and to cuSOLVER on CUDA.
    assert cpu and all(t.startswith("lapack_") for t in cpu)
    assert cpu.isdisjoint(CUDA_CUSTOM_CALLS)
    assert cuda and cuda <= CUDA_CUSTOM_CALLS
    tpu = custom_call_targets(export.export(qr, platforms=("tpu",))(m))
    assert tpu == {"Qr", "ProductOfElementaryHouseholderReflectors"} and tpu <= TPU_CUSTOM_CALLS


# ---------------------------------------------------------------------------
# Every compressor's update inside shard_map.
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh_1d():
    assert len(jax.devices()) >= N_DEV
    return jax.make_mesh((N_DEV,), ("data",))


def _update_export(tx, mesh, platform="cuda", with_params=False):
    """``tx.update`` per device, exported; ``with_params``: it also gets the parameters
    (the compressed optimizers: 1-bit LAMB's trust ratio needs them)."""

    def step(g, s, *params):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        u, s = tx.update(first(g), first(s), *(first(p) for p in params))
        return jax.tree.map(lambda a: a[None], (u, s))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    sharding = NamedSharding(mesh, P("data"))
    per_device = lambda t: jax.tree.map(  # noqa: E731
        lambda x: jax.ShapeDtypeStruct((N_DEV, *x.shape), x.dtype, sharding=sharding), t
    )
    grads = {k: jax.ShapeDtypeStruct(shape, dt) for k, (shape, dt) in TREE.items()}
    # The conformance suite's state: tx.init's, stacked along a leading device axis.
    args = (per_device(grads), per_device(jax.eval_shape(tx.init, grads)))
    if with_params:
        args = (*args, per_device(grads))
    return export.export(f, platforms=(platform,))(*args), args


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("name", list(ALL))
def test_compressor_update_exports_for_cuda(name, platform, mesh_1d):
    tx = ALL[name](axis_name="data", min_dense_size=MIN_DENSE)
    optimizer = name in getattr(helpers, "OPTIMIZERS", _OPTIMIZERS)
    exp, args = _update_export(tx, mesh_1d, platform, with_params=optimizer)
    _check_cuda(exp, args, platform)
    # The updates come first, one per gradient leaf, shaped like it on every device.
    updates = exp.out_avals[: len(TREE)]
    assert [(a.shape, a.dtype) for a in updates] == [
        ((N_DEV, *g.shape[1:]), g.dtype) for g in jax.tree.leaves(args[0])
    ]
    # The kernels' GPU form: no XLA:CPU multi-output int32 count reduce over rows
    # (see below). A flat multi-output count of several real candidates (LDTE-BS's
    # estimate and hint) is the GPU form of count_above_many.
    assert not [r for r in _multi_reduces(exp) if _ROWS.fullmatch(r[1])]


def test_sparsifier_exports_differ_by_backend(mesh_1d):
    # The same update lowered for CPU holds the CPU count (row reduces with two live
    # int32 outputs: selection and extraction), for CUDA the plain reductions: flat
    # ones (the capacity cut's 8 probes counted at once are one flat 8-output reduce).
    tx = ALL["top_k"](axis_name="data", min_dense_size=MIN_DENSE)
    cpu, _ = _update_export(tx, mesh_1d, platform="cpu")
    cuda, _ = _update_export(tx, mesh_1d)
    assert [r for r in _multi_reduces(cpu) if r[0] == 2 and _ROWS.fullmatch(r[1])]
    assert not [r for r in _multi_reduces(cuda) if _ROWS.fullmatch(r[1])]
    assert all(r[0] == 8 for r in _multi_reduces(cuda))
    barriers = [_op_count(e, "stablehlo.optimization_barrier") for e in (cpu, cuda)]
    assert barriers[0] > barriers[1]


# ---------------------------------------------------------------------------
# A whole training step, data-parallel (1-D mesh) and data x model parallel (2-D).
# ---------------------------------------------------------------------------


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - batch["y"]) ** 2)


@pytest.mark.parametrize("mesh_kind", ["1d", "2d"])
def test_train_step_exports_for_cuda(mesh_kind):
    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(16, 64)).astype(np.float32),
        "b1": np.zeros(64, np.float32),
        "w2": rng.normal(size=(64, 4)).astype(np.float32),
        "b2": np.zeros(4, np.float32),
    }
    batch = {
        "x": rng.normal(size=(16, 16)).astype(np.float32),
        "y": rng.normal(size=(16, 4)).astype(np.float32),
    }
    if mesh_kind == "1d":
        mesh, specs = jax.make_mesh((N_DEV,), ("data",)), None
    else:
        mesh = jax.make_mesh((4, 2), ("data", "model"), axis_types=(AxisType.Auto,) * 2)
        specs = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
    # One step holding four compressors (one per leaf: one trace of the step instead of
    # four); unexchanged="error" proves each leaf goes through its compressor.
    kw = dict(axis_name="data", min_dense_size=2)
    tx = optax.chain(
        optax.multi_transform(
            {
                "ldte_bs": jaxcomp.ldte_bs(0.1, **kw),
                "top_k": jaxcomp.top_k(0.1, **kw),
                "powersgd": jaxcomp.powersgd(1, **kw),
                "qsgd": jaxcomp.qsgd(7, **kw),
            },
            {"w1": "ldte_bs", "b1": "top_k", "w2": "powersgd", "b2": "qsgd"},
        ),
        optax.sgd(0.1),
    )
    placed = dist.place_params(params, mesh, specs)
    state = dist.init_opt_state(tx, placed, mesh, param_specs=specs)
    step = dist.make_train_step(_mlp_loss, tx, mesh, param_specs=specs, unexchanged="error")
    args = jax.tree.map(_abstract, (placed, state, dist.shard_batch(batch, mesh)))
    exp = export.export(jax.jit(step), platforms=("cuda",))(*args)
    _check_cuda(exp, args)
    # The new parameters come first, shaped like the old ones.
    new = exp.out_avals[: len(params)]
    assert [a.shape for a in new] == [p.shape for p in jax.tree.leaves(params)]
    if specs is not None:  # the model-sharded layout is what the GPU program gets
        got = exp.in_shardings_jax(mesh)[: len(params)]
        assert [g.spec for g in got] == [s.sharding.spec for s in jax.tree.leaves(args[0])]


# ---------------------------------------------------------------------------
# Backend switches in jaxcomp.selection._kernels.
# ---------------------------------------------------------------------------

N = 1037  # 1024 + 13: one row of the CPU count and a tail
CAP = 50
_F = jax.ShapeDtypeStruct((N,), jnp.float32)
_T = jax.ShapeDtypeStruct((), jnp.float32)
KERNELS = {
    "count_above": (kernels.count_above, (_F, _T)),
    "count_above_many": (kernels.count_above_many, (_F, jax.ShapeDtypeStruct((4,), jnp.float32))),
    "extract": (functools.partial(kernels.extract, capacity=CAP), (_F, _T)),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_exports_hold_their_backends_formulation(name):
    fn, args = KERNELS[name]
    cpu = export.export(jax.jit(fn), platforms=("cpu",))(*args)
    cuda, tpu = (export.export(jax.jit(fn), platforms=(p,))(*args) for p in ("cuda", "tpu"))
    assert cuda.platforms == ("cuda",) and not custom_call_targets(cuda)
    # TPU takes the plain form too (_kernels.PLATFORM_FORMS): the same module as CUDA's.
    assert kernels.PLATFORM_FORMS["tpu"] == kernels.PLATFORM_FORMS["cuda"] == "default"
    assert tpu.mlir_module() == cuda.mlir_module()
    # CPU: the variadic row reduce whose extra output is kept live by an
    # optimization_barrier copy of the threshold(s); CUDA: no barrier.
    assert _op_count(cpu, "stablehlo.optimization_barrier") >= 1
    assert _op_count(cuda, "stablehlo.optimization_barrier") == 0
    text = cuda.mlir_module()
    if name == "count_above":
        assert _multi_reduces(cpu) == [(2, "tensor<1x1024xi32>")]
        # One plain reduction over all N elements.
        assert _multi_reduces(cuda) == []
        assert f"(tensor<{N}xi32>, tensor<i32>) -> tensor<i32>" in text
    elif name == "count_above_many":
        assert _multi_reduces(cpu) == [(4, "tensor<1x1024xi32>")]
        assert _multi_reduces(cuda) == [(4, f"tensor<{N}xi32>")]  # one flat pass
    else:
        b = kernels.extract_block_size(N, CAP)
        rows = f"tensor<{N // b}x{b}xi32>"
        assert _multi_reduces(cpu) == [(2, rows)]
        assert _multi_reduces(cuda) == []
        assert f"({rows}, tensor<i32>) -> tensor<{N // b}xi32>" in text  # row sums


def _awkward(n: int, seed: int) -> np.ndarray:
    """Laplace values with ties, +-0, NaN and +-inf mixed in."""
    rng = np.random.default_rng(seed)
    x = rng.laplace(0.0, 1.0, n).astype(np.float32)
    x[rng.choice(n, n // 10, replace=False)] = 1.5  # ties at a threshold candidate
    x[rng.choice(n, n // 20, replace=False)] = 0.0
    x[rng.choice(n, n // 20, replace=False)] = -0.0
    x[rng.choice(n, 3, replace=False)] = [np.nan, np.inf, -np.inf]
    return x


def _gpu_form(fn):
    """``fn`` traced with every kernel's non-CPU branch (checked in its jaxpr)."""

    def run(*args):
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        assert "platform_index" not in jaxpr and "optimization_barrier" not in jaxpr
        return jax.jit(fn)(*args)

    return run


@pytest.mark.parametrize(("n", "platform"), [(N, "cuda"), (3 * 1024, "cuda"), (200, "cuda"),
                                             (N, "tpu")])  # fmt: skip
def test_gpu_formulations_match_numpy_and_the_cpu_kernels(n, platform, monkeypatch):
    x = _awkward(n, n)
    a = np.abs(x)
    ts = np.float32([0.0, 1.5, 2.0, np.inf])
    cap = 60
    # The CPU kernels (the public jitted functions), before the switch is forced.
    cpu_counts = [int(kernels.count_above(a, t)) for t in ts]
    cpu_many = np.asarray(kernels.count_above_many(a, ts))
    cpu_ext = [jax.device_get(kernels.extract(x, t, cap)) for t in ts]
    # The platform's form (kernels.PLATFORM_FORMS), traced and run here on CPU.
    form = kernels.PLATFORM_FORMS[platform]
    pick = lambda *a, cpu, default: {"cpu": cpu, "default": default}[form](*a)  # noqa: E731
    monkeypatch.setattr(kernels, "_by_backend", pick)
    # Fresh functions (not the cached jits of the public kernels) through the GPU branch.
    count = _gpu_form(lambda a, t: kernels.count_above.__wrapped__(a, t))
    many = _gpu_form(lambda a, ts: kernels.count_above_many.__wrapped__(a, ts))
    extract = _gpu_form(lambda x, t: kernels.extract.__wrapped__(x, t, cap))
    ref_counts = [int(np.sum(a > t)) for t in ts]  # NaN > t is False
    assert [int(count(a, t)) for t in ts] == ref_counts == cpu_counts
    np.testing.assert_array_equal(many(a, ts), ref_counts)
    np.testing.assert_array_equal(cpu_many, ref_counts)
    for t, c, cpu in zip(ts, ref_counts, cpu_ext, strict=True):
        idx, vals, total = jax.device_get(extract(x, t))
        want = np.flatnonzero(a > t)[:cap]
        pad = cap - len(want)
        np.testing.assert_array_equal(idx, np.concatenate([want, np.full(pad, n)]))
        ref_vals = np.concatenate([x[want], np.zeros(pad, np.float32)])
        assert vals.tobytes() == ref_vals.tobytes()  # bit-exact, -0.0 and NaN included
        assert int(total) == c
        for got, cpu_out in zip((idx, vals, total), cpu, strict=True):
            assert np.asarray(got).tobytes() == np.asarray(cpu_out).tobytes()


def test_multi_platform_export_runs_the_cpu_branch_here():
    # One artifact for CPU and CUDA holds both branches and picks CPU's when called here.
    exp = export.export(jax.jit(kernels.count_above), platforms=("cpu", "cuda"))(_F, _T)
    assert exp.platforms == ("cpu", "cuda")
    x = _awkward(N, 1)
    a = np.abs(x)
    for t in (0.0, 1.5, 3.0):
        assert int(exp.call(a, np.float32(t))) == int(np.sum(a > np.float32(t)))


# Every exchange, not only the default one (scatter needs sharded_optimizer's slices:
# it is exported by the train-step test's FSDP path when that exists, not here).
SPARSE_EXCHANGES = [e for e in sparse_allreduce.EXCHANGES if e != "scatter"]


@pytest.mark.parametrize("exchange", SPARSE_EXCHANGES)
def test_every_sparse_exchange_exports_for_cuda(exchange, mesh_1d):
    tx = jaxcomp.ldte_bs(RATIO, axis_name="data", min_dense_size=MIN_DENSE, exchange=exchange)
    exp, args = _update_export(tx, mesh_1d)
    _check_cuda(exp, args)


@pytest.mark.parametrize(
    "make",
    [
        lambda: jaxcomp.qsgd(bits=4, bucket_size=64, exchange="allreduce", axis_name="data"),
        lambda: jaxcomp.cast(jnp.bfloat16, exchange="allreduce", axis_name="data"),
        lambda: jaxcomp.qsgd(bits=4, exchange="gossip", axis_name="data"),
        lambda: jaxcomp.qsgd(bits=4, exchange="server", axis_name="data"),
    ],
    ids=["qsgd_allreduce", "cast_allreduce", "qsgd_gossip", "qsgd_server"],
)
def test_every_quantizer_exchange_exports_for_cuda(make, mesh_1d):
    tx = make()
    exp, args = _update_export(tx, mesh_1d)
    _check_cuda(exp, args)
