"""Smoke tests of experiments.bench_update (tiny sizes, no timed assertions) and of the
chunked top-k baseline of experiments.bench_selection."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxcomp
from experiments import bench_selection, bench_update


def test_bench_update_writes_json_and_png(tmp_path):
    rows = bench_update.run([12], ["ldte_bs"], repeats=3, out_dir=str(tmp_path), warm_steps=2)
    data = json.loads((tmp_path / "bench_update.json").read_text())
    assert (tmp_path / "bench_update.png").stat().st_size > 0
    assert len(data["results"]) == len(rows) == 1
    assert data["meta"]["targets"] == {"max_floors": 8.0, "min_speedup_vs_top_k": 4.0}
    for row in data["results"]:
        assert row["k"] == max(1, math.ceil(1e-3 * row["n"]))
        assert set(row["methods"]) == {"top_k", "ldte_bs"}  # top_k always runs
        floor = row["floor_ms"]
        np.testing.assert_allclose(row["contract_floors"], row["contract_ms"] / floor)
        base = row["methods"]["top_k"]["update_ms"]
        for m in row["methods"].values():
            # Ratios are those of the medians reported in the same row.
            np.testing.assert_allclose(m["speedup_vs_top_k"], base / m["update_ms"])
            np.testing.assert_allclose(m["floors"], m["update_ms"] / floor)
            np.testing.assert_allclose(m["over_contract"], m["update_ms"] / row["contract_ms"])
            assert set(m["stages_ms"]) == {"check", "accumulate", "select", "send"}
            np.testing.assert_allclose(
                m["stages_ms"]["send"], m["update_ms"] - m["stages_ms"]["select"]
            )
            np.testing.assert_allclose(m["stages_floors"]["check"], m["stages_ms"]["check"] / floor)
            assert m["sent_count"] >= 1 and m["search_iterations"] >= 0
            s = m["hlo"]["summary"]
            # The update reads the gradient and the residual, and writes the
            # update and the residual: at least 2 n-sized reads and writes.
            assert s["reads_every_call"] >= 2 and s["writes_every_call"] >= 2
            assert s["aliased_n"] >= 1  # the donated residual's buffer is reused
            assert s["input_output_alias"]
            for kk in m["kernels_ms"]:  # empty if the profiler is unavailable
                assert kk["ms"] >= 0 and kk["name"]
        assert row["methods"]["top_k"]["speedup_vs_top_k"] == 1.0
        np.testing.assert_allclose(row["dense_step_floors"], row["dense_step_ms"] / floor)
        for m in row["methods"].values():
            # The two other modes, each against top_k in the same mode.
            np.testing.assert_allclose(m["grad_donated_floors"], m["grad_donated_ms"] / floor)
            np.testing.assert_allclose(
                m["grad_donated_alone_floors"], m["grad_donated_alone_ms"] / floor
            )
            np.testing.assert_allclose(m["step_floors"], m["step_ms"] / floor)
            np.testing.assert_allclose(m["step_over_dense"], m["step_ms"] / row["dense_step_ms"])
            np.testing.assert_allclose(m["step_alone_floors"], m["step_alone_ms"] / floor)
            np.testing.assert_allclose(
                m["step_alone_over_dense"], m["step_alone_ms"] / row["dense_step_alone_ms"]
            )
            for mode in ("grad_donated", "grad_donated_alone", "step", "step_alone"):
                np.testing.assert_allclose(
                    m[f"{mode}_speedup_vs_top_k"],
                    row["methods"]["top_k"][f"{mode}_ms"] / m[f"{mode}_ms"],
                )


def test_bench_update_ties_data_runs_the_capacity_cut(tmp_path):
    """--data ties: every step passes far more than the capacity, so the update sends
    exactly the capacity (the cut ran); written beside, not over, bench_update.json."""
    rows = bench_update.run(
        [12],
        ["ldte_bs_deferred"],
        repeats=3,
        out_dir=str(tmp_path),
        warm_steps=2,
        stages=False,
        profile=False,
        modes=False,
        data="ties",
    )
    data = json.loads((tmp_path / "bench_update_ties.json").read_text())
    assert data["meta"]["data"] == "ties" and not (tmp_path / "bench_update.json").exists()
    (row,) = rows
    cap = math.ceil(1.5 * row["k"])
    for m in row["methods"].values():
        assert m["sent_count"] == cap


def test_hlo_passes_counts_a_known_program():
    n = 4096
    r, g = jnp.zeros(n), jnp.ones(n)
    compiled = jax.jit(lambda r, g: (r + g, jnp.sum(g)), donate_argnums=0).lower(r, g).compile()
    out = bench_update.hlo_passes(compiled, n)
    s = out["summary"]
    assert s["reads_every_call"] == 3 and s["writes_every_call"] == 1
    assert s["aliased_n"] == pytest.approx(1.0, abs=1e-3) and s["temp_n"] == 0
    assert all(k["where"] == "every call" for k in out["kernels"])


def test_single_device_update_keeps_acc_out_of_temporaries():
    # sparsify._select_and_send gives the selector its own copy of the
    # accumulator, so that `acc` never enters control flow (the overflow cond
    # of _send_masked) and XLA:CPU can write the residual in place of it: no
    # n-sized temporary at all with a fixed threshold (there was one before:
    # temp 1.06 n), and one fresh n-sized output (the other output, the
    # update, reuses the donated residual's buffer). That is the leaf-by-leaf
    # path (a selector without a segmented form, as a plain function); the
    # packed engine, which "threshold" itself now takes, keeps one n-sized
    # temporary and one copy on a lone leaf (as top_k; ldte_bs two).
    n = 2**16
    g = jnp.ones(n)

    def fixed(x, k, *, threshold):  # no segmented form: the 1-D path
        return jaxcomp.selection.fixed_threshold(x, k, threshold=threshold)

    tx = jaxcomp.sparsify(fixed, 1e-3, selector_options={"threshold": 0.5})
    s = bench_update.hlo_passes(bench_update.update_fn(tx).lower(g, tx.init(g)).compile(), n)
    s = s["summary"]
    assert s["temp_n"] < 0.5
    assert s["fresh_outputs_n"] == pytest.approx(1.0, abs=0.01)
    assert s["aliased_n"] == pytest.approx(1.0, abs=0.01)
    assert s["copies_every_call"] == 0


@pytest.mark.parametrize("log2_n", [10, 14, 16])
def test_chunked_top_k_selects_at_least_k(log2_n):
    n = 2**log2_n
    k = max(1, math.ceil(1e-3 * n))
    x = jnp.asarray(bench_selection.make_data("laplace", n, seed=log2_n))
    sel = jax.jit(bench_selection.chunked_top_k, static_argnums=1)(x, k)
    exact = jax.jit(jaxcomp.selection.exact_top_k, static_argnums=1)(x, k)
    a = np.abs(np.asarray(x))
    assert int(sel.count) == int((a > float(sel.threshold)).sum()) >= k
    # Never above the exact threshold; equal to it unless a row overflowed.
    assert float(sel.threshold) <= float(exact.threshold)
    rows, row, m = bench_selection.chunk_shape(n, k)
    assert rows * row >= n and row >= min(n, 64) and m <= max(256, -(-k // rows))
    assert rows * m >= k


def test_chunked_top_k_is_exact_without_overflow():
    # The k largest spread one per row: every row holds at most m of them.
    n, k = 2**14, 16
    x = np.zeros(n, np.float32)
    rows, row, m = bench_selection.chunk_shape(n, k)
    x[1::7] = 0.5
    x[np.arange(k) * (n // k)] = np.arange(1, k + 1)
    sel = bench_selection.chunked_top_k(jnp.asarray(x), k)
    assert int(sel.count) == k
    assert float(sel.threshold) == float(jaxcomp.selection.exact_top_k(jnp.asarray(x), k).threshold)


def test_grad_donated_update_has_no_fresh_output():
    # With the gradient donated too, both n-sized outputs (update, residual)
    # reuse donated buffers: what the update costs inside a training step,
    # where the gradient is a temporary. The result is the plain update's.
    n = 2**14
    g = jnp.asarray(bench_selection.make_data("laplace", n))
    tx = jaxcomp.ldte_bs(1e-3)
    fn = bench_update.update_fn_grad_donated(tx)
    s = bench_update.hlo_passes(fn.lower(g, tx.init(g)).compile(), n)["summary"]
    assert s["fresh_outputs_n"] < 0.01 and s["aliased_n"] == pytest.approx(2.0, abs=0.01)
    u_ref, s_ref = bench_update.update_fn(tx)(g, tx.init(g))
    u, st = fn(g * 1, tx.init(g))
    np.testing.assert_array_equal(np.asarray(u), np.asarray(u_ref))
    np.testing.assert_array_equal(np.asarray(st.residual), np.asarray(s_ref.residual))


def test_train_step_is_sgd_on_the_compressed_gradient():
    # One step from p = 0 toward target t: the gradient is -t, the compressor
    # sends the largest |t| (ratio 1 / n: exactly one element), SGD moves it.
    n = 4096
    t = np.zeros(n, np.float32)
    t[[5, 100, 3000]] = [1.0, -4.0, 2.0]
    tx = optax.chain(jaxcomp.top_k(1 / n), optax.sgd(bench_update.STEP_LR))
    p, state = bench_update.train_step_fn(tx)(jnp.zeros(n), tx.init(jnp.zeros(n)), jnp.asarray(t))
    want = np.zeros(n, np.float32)
    want[100] = -bench_update.STEP_LR * 4.0  # p - lr * g with g[100] = -(-4)
    np.testing.assert_allclose(np.asarray(p), want, rtol=1e-6)
    residual = optax.tree.get(state, "residual")
    np.testing.assert_array_equal(np.asarray(residual), np.where(np.arange(n) == 100, 0, -t))


def test_deferred_residual_update_makes_fewer_passes():
    # defer_residual=True (jaxcomp.SparsifyState): no selector copy, no
    # residual pass; the update is the same, bit for bit. n = 2^18, where the
    # moments come from a strided sample as at 2^22 (counted from the HLO).
    n = 2**18
    g = jnp.asarray(bench_selection.make_data("laplace", n))
    summary, outputs = {}, {}
    for defer in (False, True):
        tx = jaxcomp.ldte_bs(1e-3, defer_residual=defer)
        fn = bench_update.update_fn_grad_donated(tx)
        summary[defer] = bench_update.hlo_passes(fn.lower(g, tx.init(g)).compile(), n)["summary"]
        u, state = fn(g * 1, tx.init(g))
        outputs[defer] = (np.asarray(u), np.asarray(jaxcomp.residuals(state)))
    plain, deferred = summary[False], summary[True]
    # Deferred: 2 n-sized writes (the accumulator and the update). The default
    # writes 5 since the packed step (jaxcomp.selection.segmented) replaced the
    # one-leaf path's tuned selector copy (4 before); the suite's fusion
    # emitter (tests/conftest.py) fuses the reads differently from XLA's default.
    assert (plain["writes_every_call"], deferred["writes_every_call"]) == (5, 2)
    assert deferred["reads_every_call"] <= plain["reads_every_call"] - 2
    assert deferred["fresh_outputs_n"] < 0.01 and deferred["copies_every_call"] == 0
    for a, b in zip(outputs[False], outputs[True], strict=True):
        np.testing.assert_array_equal(a, b)
