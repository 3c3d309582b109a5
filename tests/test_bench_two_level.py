"""experiments.bench_two_level --small: its JSON, its bytes against formulas
recomputed here from the shapes, and the issue's targets (no timed assertions).

8 simulated devices from tests/conftest.py.
"""

from __future__ import annotations

import json
import math

import pytest

from experiments import bench_two_level as bench


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _two_level_top_k(shapes, nodes: int, local: int, ratio: float) -> tuple[float, float]:
    """(intra, inter) bytes per device of two-level top_k's sparse exchange, from the shapes.

    Each device owns ceil(n / L) elements of a leaf of n; intra: a reduce-scatter
    and an all-gather of the padded float32 buffer, 2 (L - 1) / L of its bytes;
    inter: the shard's message of ceil(1.5 k) (int32, float32) pairs,
    k = max(1, ceil(ratio m)), to each of the nodes - 1 other nodes.
    """
    intra = inter = 0.0
    for shape in shapes:
        m = _ceil_div(math.prod(shape), local)
        intra += 2 * (local - 1) / local * 4 * local * m
        k = max(1, math.ceil(ratio * m - 1e-9))
        inter += (nodes - 1) * 8 * min(m, math.ceil(1.5 * k))
    return intra, inter


def test_bench_two_level_small(tmp_path):
    """One --small run (about 45 s; under xdist a module fixture would run it per worker)."""
    bench.main(["bench_two_level", "--small", "--repeats=3", f"--out={tmp_path}"])
    result = json.loads((tmp_path / "bench_two_level.json").read_text()), tmp_path
    _check_json_png_and_table(result)
    _check_every_measured_byte_count_equals_its_formula(result)
    _check_two_level_top_k_bytes_from_the_shapes(result)
    _check_targets_hold(result)
    _check_one_reduce_scatter_and_all_gather_per_dtype(result)


def _check_json_png_and_table(result):
    data, out = result
    assert (out / "bench_two_level.png").stat().st_size > 0
    table = (out / "table.md").read_text()
    assert table.startswith("| tree | mesh | method |")
    assert set(data) == {
        "meta",
        "bytes",
        "targets",
        "targets_model_tree",
        "user_cost",
        "leaf_count",
    }
    trees = set(data["meta"]["trees"])
    methods = {"dense", "dense_two_level"} | {
        f"{c}_{kind}" for c in ("top_k", "qsgd", "powersgd") for kind in ("flat", "two_level")
    }
    seen = {(r["tree"], r["mesh"], r["method"]) for r in data["bytes"]}
    assert seen == {(t, m, x) for t in trees for m in ("2x4", "4x2") for x in methods}
    assert len(data["bytes"]) == len(table.strip().splitlines()) - 2
    cost = data["user_cost"]
    for name in ("flat", "two_level"):
        assert cost[name]["step_ms"] > 0 and cost[name]["compile_s"] > 0
    assert cost["two_level_over_flat_step_ms"] == pytest.approx(
        cost["two_level"]["step_ms"] / cost["flat"]["step_ms"]
    )
    for n in (10, 100):
        row = data["leaf_count"][f"{n}_leaves"]
        assert row["two_level_compile_s"] > 0 and row["flat_compile_s"] > 0


def _check_every_measured_byte_count_equals_its_formula(result):
    data, _ = result
    for r in data["bytes"]:
        for cls in ("intra", "inter"):
            assert r[f"{cls}_bytes"] == pytest.approx(r[f"{cls}_formula"], rel=1e-6), r
            assert r[f"{cls}_ratio"] == pytest.approx(1.0, rel=1e-6)


def _check_two_level_top_k_bytes_from_the_shapes(result):
    """Recomputed here, independently of the program's formulas."""
    data, _ = result
    shapes = bench.tree_shapes(small=True)
    assert {t: len(s) for t, s in shapes.items()} == {
        t: v["leaves"] for t, v in data["meta"]["trees"].items()
    }
    rows = {(r["tree"], r["mesh"], r["method"]): r for r in data["bytes"]}
    for tree, leaves in shapes.items():
        n = sum(math.prod(s) for s in leaves.values())
        for nodes, local in ((2, 4), (4, 2)):
            intra, inter = _two_level_top_k(leaves.values(), nodes, local, 1e-3)
            row = rows[(tree, f"{nodes}x{local}", "top_k_two_level")]
            assert row["intra_bytes"] == pytest.approx(intra, rel=1e-6)
            assert row["inter_bytes"] == pytest.approx(inter, rel=1e-6)
            # The flat ring all-reduce: 2 (N - 1) / N of the tree's bytes per device,
            # of which nodes / N cross nodes (the mean over the ring's links).
            dense = rows[(tree, f"{nodes}x{local}", "dense")]
            wire = 2 * 7 / 8 * 4 * n
            assert dense["inter_bytes"] == pytest.approx(wire * nodes / 8, rel=1e-6)
            assert dense["intra_bytes"] == pytest.approx(wire * (8 - nodes) / 8, rel=1e-6)


def _check_targets_hold(result):
    data, _ = result
    t = data["targets"]
    assert t["tree"].startswith("leaf_")
    assert t["inter_two_level<=flat_allgather/4"] is True
    assert t["inter_two_level*100<=dense_ring"] is True
    assert t["two_level_over_flat_allgather"] <= 0.25
    assert t["dense_ring_over_two_level"] >= 100


def _check_one_reduce_scatter_and_all_gather_per_dtype(result):
    """The wrapper's collectives over "local" do not grow with the leaf count."""
    data, _ = result
    for n in (10, 100):
        counts = data["leaf_count"][f"{n}_leaves"]["two_level_collectives"]
        assert counts["reduce_scatter@local"] == 1
        assert (
            sum(v for k, v in counts.items() if k.startswith("all_gather") and "@local" in k) == 1
        )
