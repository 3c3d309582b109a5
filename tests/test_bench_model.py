"""experiments.bench_model: the HLO counter on known programs and a --small smoke run.

No timed assertions: the rows' fields, the ratios against the same run's
medians, the budget's skipping and the HLO counts are checked, not speeds.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from absl import flags
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from experiments import bench_model

# Async pairs count once; opcodes only (not %while_body, metadata, or -done halves); an
# async-start wrapping a collective counts through the computation it calls.
HLO_TEXT = """\
HloModule m, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%while_body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %ar.1 = f32[4]{0} all-reduce(f32[4]{0} %x), channel_id=1, to_apply=%add
  ROOT %t = (s32[], f32[4]{0}) tuple(%i, %ar.1)
}

%async_rs (q: f32[8]) -> f32[1] {
  %q = f32[8]{0} parameter(0)
  ROOT %rs = f32[1]{0} reduce-scatter(f32[8]{0} %q), dimensions={0}, to_apply=%add
}

ENTRY %main (a: f32[4]) -> f32[4] {
  %a = f32[4]{0} parameter(0), metadata={op_name="jit(f)/while/body/all-gather"}
  %ags = (f32[4]{0}, f32[32]{0}) all-gather-start(f32[4]{0} %a), dimensions={0}
  %agd = f32[32]{0} all-gather-done((f32[4]{0}, f32[32]{0}) %ags)
  %ars = f32[4]{0} all-reduce-start(f32[4]{0} %a), to_apply=%add
  %ard = f32[4]{0} all-reduce-done(f32[4]{0} %ars)
  %cps = (f32[4]{0}, f32[4]{0}, u32[], u32[]) collective-permute-start(f32[4]{0} %a)
  %cpd = f32[4]{0} collective-permute-done((f32[4]{0}, f32[4]{0}, u32[], u32[]) %cps)
  %a2a = (f32[2]{0}, f32[2]{0}) all-to-all(f32[2]{0} %b, f32[2]{0} %c), dimensions={0}
  %rss = ((f32[8]{0}), f32[1]{0}) async-start(f32[8]{0} %z), calls=%async_rs
  %rsd = f32[1]{0} async-done(((f32[8]{0}), f32[1]{0}) %rss), calls=%async_rs
  %w1 = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t0), condition=%cond, body=%while_body
  ROOT %w2 = (s32[], /*index=1*/f32[4]{0}) while((s32[], f32[4]{0}) %w1), condition=%c, body=%b
}
"""


def test_count_hlo_ops_on_text():
    c = bench_model.count_hlo_ops(HLO_TEXT)
    assert c["while"] == 2
    assert c["all-reduce"] == 2  # one in the loop body, one async pair
    assert c["all-gather"] == 1 and c["collective-permute"] == 1 and c["all-to-all"] == 1
    assert c["reduce-scatter"] == 1  # inside the async computation, not the start/done
    assert c["collectives"] == 6
    assert set(c) == {"while", "collectives", *bench_model.COLLECTIVES}
    assert bench_model.count_hlo_ops("") == dict.fromkeys(c, 0)


def test_count_hlo_ops_on_a_compiled_program_with_two_loops_and_three_psums():
    mesh = jax.make_mesh((8,), ("data",))

    def f(x, n):
        # Every psum sums a device-varying value (no simplification to a multiply).
        i = (lax.axis_index("data") + 1).astype(jnp.float32)
        a = lax.psum(x * i, "data")

        def body(c):
            k, v = c
            return k + 1, lax.psum(v * (i + k.astype(jnp.float32)), "data")

        # Trip counts known only at run time: XLA cannot remove or unroll the loops.
        _, a = lax.while_loop(lambda c: c[0] < n[0], body, (jnp.int32(0), a))
        b = lax.while_loop(lambda v: jnp.sum(v) < 1e6, lambda v: v * 2 + i, a)
        return lax.psum(b * i, "data")

    g = jax.jit(
        jax.shard_map(f, mesh=mesh, in_specs=(P("data"), P()), out_specs=P(), check_vma=False)
    )
    x = jax.device_put(jnp.ones((8, 4)), NamedSharding(mesh, P("data")))
    n = jax.device_put(jnp.array([3], jnp.int32), NamedSharding(mesh, P()))
    c = bench_model.count_hlo_ops(g.lower(x, n).compile().as_text())
    assert c["while"] == 2
    assert c["all-reduce"] == 3  # the one in the loop body counts once
    assert c["collectives"] == 3
    # The same loops on one device: no collective.
    local = jax.jit(lambda v: lax.while_loop(lambda u: jnp.sum(u) < 1e6, lambda u: u * 2 + 1, v))
    c1 = bench_model.count_hlo_ops(local.lower(jnp.ones(4)).compile().as_text())
    assert c1["while"] == 1 and c1["collectives"] == 0


def test_every_registered_compressor_builds_on_one_and_several_devices():
    params = {"w": jnp.zeros((64, 32)), "b": jnp.zeros(32)}
    for name in bench_model.COMPRESSORS:
        for axis in (None, bench_model.AXIS):
            if axis is not None and name in bench_model.ONE_DEVICE:
                with pytest.raises(ValueError, match="defer_residual=True applies to one device"):
                    bench_model.make_tx(name, axis)  # why run() skips it on N devices
                continue
            tx = bench_model.make_tx(name, axis)
            assert isinstance(tx, optax.GradientTransformation)
        # One device: the local update traces and keeps the structure (nothing compiled).
        tx = bench_model.make_tx(name)
        u, _ = jax.eval_shape(tx.update, params, jax.eval_shape(tx.init, params), params)
        assert jax.tree.map(lambda v: v.shape, u) == jax.tree.map(jnp.shape, params)


def test_trees_come_from_the_models_and_layouts_hold_the_same_gradient():
    shapes = bench_model.tree_shapes("resnet20")  # abstract: nothing initialised
    leaves = jax.tree.leaves(shapes)
    assert len(leaves) == 65 and sum(x.size for x in leaves) == 272_474
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    small = bench_model.tree_shapes("small")
    n = 21056
    tree = bench_model._gradients(small, n, 0, None)
    flat = bench_model._gradients(bench_model._layout_shapes(small, "flat", "ldte_bs"), n, 0, None)
    matrix = bench_model._layout_shapes(small, "flat", "powersgd")
    assert matrix["flat"].shape == (20, 1024)
    matrix = bench_model._gradients(matrix, n, 0, None)
    whole = jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    np.testing.assert_array_equal(whole, flat["flat"])
    np.testing.assert_array_equal(whole[: 20 * 1024], matrix["flat"].ravel())
    # Eight devices: one row per device, sharded over the axis, a different gradient each.
    mesh = jax.make_mesh((8,), (bench_model.AXIS,))
    per_device = bench_model._gradients(small, n, 0, 8, mesh)["dense"]["kernel"]
    assert per_device.shape == (8, 256, 64)
    assert per_device.sharding.spec == P(bench_model.AXIS)
    rows = np.asarray(per_device)
    assert not np.array_equal(rows[0], rows[1])


def _load(tmp_path):
    return json.loads((tmp_path / "bench_model.json").read_text())


def test_small_run_writes_every_row_with_consistent_ratios(tmp_path):
    argv = ["bench_model", "--small", "--devices=1,8", f"--outdir={tmp_path}"]
    bench_model.main([*argv, "--compilation_cache"])
    record = _load(tmp_path)
    assert (tmp_path / "bench_model.png").stat().st_size > 0
    meta = record["meta"]
    assert meta["device_count"] == jax.device_count() == 8
    assert meta["command"][:4] == argv and meta["jax"] == jax.__version__
    assert meta["steps"] == 2 and meta["warmup"] == 1  # --small's defaults
    assert record["trees"] == {"small": {"leaves": 3, "params": 21056}}
    rows = record["rows"]
    keys = [(r["devices"], r["compressor"], r["layout"]) for r in rows]
    assert keys == [
        (d, c, lay) for d in (1, 8) for c in ("sgd", "ldte_bs") for lay in ("tree", "flat")
    ]
    at = {k: r for k, r in zip(keys, rows, strict=True)}
    for (d, c, lay), r in at.items():
        assert r["tree"] == "small" and r["elements"] == 21056
        assert r["leaves"] == (3 if lay == "tree" else 1)
        assert r["leaf_shape"] == (None if lay == "tree" else [21056])
        assert r["warmup_steps"] == 1 and r["timed_steps"] == 2
        assert r["skipped_steps"] == 0 and not r["over_budget"]
        assert r["step_ms"] > 0 and r["compile_s"] >= r["lower_s"] > 0
        # Ratios are those of the medians in the same file.
        sgd = at[(d, "sgd", lay)]
        np.testing.assert_allclose(r["step_vs_sgd"], r["step_ms"] / sgd["step_ms"])
        np.testing.assert_allclose(r["compile_vs_sgd"], r["compile_s"] / sgd["compile_s"])
        if lay == "tree":
            flat = at[(d, c, "flat")]
            np.testing.assert_allclose(r["step_vs_flat"], r["step_ms"] / flat["step_ms"])
            np.testing.assert_allclose(r["compile_vs_flat"], r["compile_s"] / flat["compile_s"])
        else:
            assert r["step_vs_flat"] is None and r["compile_vs_flat"] is None
    # One device: no collective; sgd is a plain elementwise update (no loop).
    for (d, c, _), r in at.items():
        if d == 1:
            assert r["hlo"]["collectives"] == 0
        if c == "sgd":
            assert r["hlo"]["while"] == 0
    # Eight devices: sgd averages with all-reduces; ldte_bs exchanges with all-gathers.
    for lay in ("tree", "flat"):
        assert at[(8, "sgd", lay)]["hlo"]["all-reduce"] >= 1
        assert at[(8, "ldte_bs", lay)]["hlo"]["all-gather"] >= 1
        assert at[(8, "ldte_bs", lay)]["hlo"]["while"] >= 1  # its threshold search


def test_budget_skips_the_steps_not_the_compile_and_flat_powersgd_is_a_matrix(tmp_path):
    bench_model.main([
        "bench_model", "--small", "--compressors=sgd,powersgd", "--layouts=flat",
        "--devices=1", "--budget_s=1e-9", f"--outdir={tmp_path}", "--compilation_cache",
    ])  # fmt: skip
    rows = {r["compressor"]: r for r in _load(tmp_path)["rows"]}
    assert set(rows) == {"sgd", "powersgd"}
    for r in rows.values():
        assert r["compile_s"] > 0 and "while" in r["hlo"]  # compiled all the same
        assert r["over_budget"] and r["timed_steps"] == 0 and r["warmup_steps"] == 0
        assert r["skipped_steps"] == 3  # 1 warm-up + 2 timed
        assert r["step_ms"] is None and r["step_vs_sgd"] is None
    # The flat PowerSGD leaf is (n // 1024, 1024): 20 x 1024 of the 21,056 values.
    assert rows["powersgd"]["leaf_shape"] == [20, 1024]
    assert rows["powersgd"]["elements"] == 20480
    assert rows["sgd"]["leaf_shape"] == [21056]


@pytest.mark.parametrize(
    "bad",
    ["--compressors=nope", "--trees=resnet9", "--layouts=diagonal", "--devices=0", "--steps=0"],
)
def test_bad_flags_are_rejected_before_any_work(bad, tmp_path):
    with pytest.raises(flags.IllegalFlagValueError):
        bench_model.main(["bench_model", bad, f"--outdir={tmp_path}"])
    assert not (tmp_path / "bench_model.json").exists()
