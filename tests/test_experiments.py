"""Smoke tests of the experiment programs on tiny sizes (they must not rot)."""

from __future__ import annotations

import json
import math

import numpy as np

from experiments import bench_selection, demo


def test_bench_selection_writes_json_and_png(tmp_path):
    rows = bench_selection.run([10, 12], ["laplace"], repeats=5, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "bench_selection.json").read_text())
    assert (tmp_path / "bench_selection.png").stat().st_size > 0
    assert len(data["results"]) == len(rows) == 2
    for row in data["results"]:
        k = row["k"]
        assert k == max(1, math.ceil(1e-3 * row["n"]))
        methods = row["methods"]
        assert methods["top_k"]["count"] == k  # no ties in continuous data
        assert k <= methods["ldte_bs"]["count"] <= math.floor(1.5 * k)
        # Ratios are computed from the medians in the same row.
        m = methods["ldte_bs"]
        np.testing.assert_allclose(
            m["threshold_speedup_vs_top_k"], methods["top_k"]["threshold_ms"] / m["threshold_ms"]
        )


def test_bench_selection_data_sets():
    n = 100_000
    zeros = bench_selection.make_data("zeros99", n)
    assert abs(np.count_nonzero(zeros) / n - 0.01) < 0.002
    lap = bench_selection.make_data("laplace", n)
    assert abs(lap.mean() - 5e-4) < 1e-4 and abs(lap.std() - 5e-3) < 1e-4


def test_demo_prints_every_compressor(capsys):
    demo.main(["--size", "8192", "--ratio", "0.01"])
    out = capsys.readouterr().out
    for name in demo.COMPRESSORS:
        assert name in out
