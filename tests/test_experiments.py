"""Smoke tests of the experiment programs on tiny sizes (they must not rot)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from helpers import compile_flags_without_devices, compress_on_mesh

from experiments import bench_selection, demo


def test_bench_selection_writes_json_and_png(tmp_path):
    rows = bench_selection.run(
        [10, 12],
        ["laplace"],
        repeats=5,
        out_dir=str(tmp_path),
        methods=["ldte_bs", "gaussian_k", "sidco_gpareto"],
    )
    data = json.loads((tmp_path / "bench_selection.json").read_text())
    assert (tmp_path / "bench_selection.png").stat().st_size > 0
    assert len(data["results"]) == len(rows) == 2
    for row in data["results"]:
        assert set(row["methods"]) == {"top_k", "ldte_bs", "gaussian_k", "sidco_gpareto"}
        k = row["k"]
        assert k == max(1, math.ceil(1e-3 * row["n"]))
        methods = row["methods"]
        assert methods["top_k"]["count"] == k  # no ties in continuous data
        assert k <= methods["ldte_bs"]["count"] <= math.floor(1.5 * k)
        # SIDCo's count is an estimate: the count of its own threshold, at least one.
        sid = methods["sidco_gpareto"]
        assert sid["count"] >= 1 and sid["count_over_k"] == sid["count"] / k
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


def test_bench_pipeline_writes_json_and_png(tmp_path):
    from experiments import bench_pipeline  # noqa: PLC0415

    result = bench_pipeline.run(8, 2, 16, 0.25, [(2, 2)], 5, str(tmp_path), ("gpipe", "1f1b"))
    data = json.loads((tmp_path / "bench_pipeline.json").read_text())
    assert (tmp_path / "bench_pipeline.png").stat().st_size > 0
    rows = data["results"]
    pipelined = {"pp2x4_m2_dense", "pp2x4_m2_top_k"}
    assert set(rows) == {"dp_dense", "dp_top_k", *pipelined, *(f"{p}_1f1b" for p in pipelined)}
    assert rows == result["results"]
    row = rows["pp2x4_m2_dense"]
    # 3 ticks, micro-batches of 16 / 4 / 2 = 2 examples of 8 floats, both ways, over 2 stages.
    assert row["stage_bytes"] == 2 * 3 * 1 * 2 * 8 * 4 / 2 and row["bubble"] == 1 / 3
    # Ring all-reduce of one stage's 8 x 8 + 8 floats among its 4 replicas.
    assert row["wire_bytes"] == 2 * 3 / 4 * 72 * 4
    assert row["vs_dp_dense"] == row["step_ms"] / rows["dp_dense"]["step_ms"]
    # 1F1B: 2 + 2 * 2 - 2 = 4 ticks, each both ways; the same gradient exchange.
    row = rows["pp2x4_m2_dense_1f1b"]
    assert row["stage_bytes"] == 2 * 4 * 1 * 2 * 8 * 4 / 2 and row["bubble"] == 2 / 4
    assert row["wire_bytes"] == 2 * 3 / 4 * 72 * 4


def test_demo_prints_every_compressor(capsys):
    demo.main(["demo", "--size", "8192", "--ratio", "0.01"])
    out = capsys.readouterr().out
    for name in demo.COMPRESSORS:
        assert name in out


PROGRAMS = (
    "bench_allreduce", "bench_coding", "bench_cssgd", "bench_exchange", "bench_merge",
    "bench_model", "bench_pipeline", "bench_powersgd", "bench_reuse", "bench_selection",
    "bench_train_step", "bench_update", "compare", "demo", "demo_training", "fit_check", "qsvrg",
    "scalability", "staleness",
)  # fmt: skip


def test_programs_parse_their_own_flags_without_touching_the_global_ones():
    # Every program but main.py reads its flags through experiments.cli: from
    # Python, a command line parsed into a FlagValues of its own, so programs
    # imported in one process never clash on a flag name.
    import importlib  # noqa: PLC0415

    from absl import flags  # noqa: PLC0415

    from experiments import cli  # noqa: PLC0415

    names, environ = {}, dict(os.environ)
    for program in PROGRAMS:
        module = importlib.import_module(f"experiments.{program}")
        os.environ.clear()  # some set thread or device counts on import: not for later tests
        os.environ.update(environ)
        parsed = cli.parse(module.define_flags, [program])
        names[program] = set(cli.values(module.define_flags, parsed))
        assert names[program], program
        assert not names[program] & set(flags.FLAGS), program
    assert "repeats" in names["bench_selection"] & names["bench_reuse"]  # shared names
    with pytest.raises(flags.UnrecognizedFlagError):
        cli.parse(demo.define_flags, ["demo", "--repeats=5"])
    with pytest.raises(flags.IllegalFlagValueError):
        cli.parse(demo.define_flags, ["demo", "--size=big"])


def test_presets_are_data_built_by_one_builder():
    import jaxcomp  # noqa: PLC0415
    from experiments import bench_exchange, bench_model, bench_reuse, presets  # noqa: PLC0415

    tables = [demo.COMPRESSORS, bench_model.COMPRESSORS, bench_exchange.QUANTIZERS]
    tables.append(bench_reuse.METHODS)
    for table in tables:
        for preset in table.values():
            if preset is not None:  # bench_model's sgd: no compressor
                assert set(preset) == {"compressor", "kwargs"}
                json.dumps(preset)  # plain data, as a JSON file records it
                assert callable(getattr(jaxcomp, preset["compressor"]))
    tx = presets.build(presets.spec("top_k", ratio=0.5), reuse_period=2)
    g = {"w": np.arange(4.0, dtype=np.float32)}
    u, _ = tx.update(g, tx.init(g))
    assert np.count_nonzero(u["w"]) == 2
    with pytest.raises(ValueError, match="no jaxcomp factory"):
        presets.spec("top_k_typo")


def test_compare_rows_are_valid_configs():
    # Every comparison row, from compare's sparsifier base, passes the
    # training program's validation (sparsifier-only settings dropped where
    # unused), and the paper's exact LDTE-BS is one of them.
    from experiments import compare, train  # noqa: PLC0415

    assert compare.PAPER_TABLE2["ldte_bs_paper"] == {
        "compressor": "ldte_bs",
        "compressor_kwargs": {"variant": "paper"},
    }
    base = train.TrainConfig(
        compressor_kwargs={"ratio": 1e-3}, warmup_epochs=4, momentum_correction=True
    )
    qsgd = {"compressor": "qsgd", "compressor_kwargs": {"bucket_size": 512}}
    rows = {**compare.PAPER_TABLE2, "qsgd": qsgd}
    for overrides in rows.values():
        config = compare.for_compressor(base, overrides)
        train.validate_config(config)
        if config.compressor in train.SPARSIFIERS:
            assert (config.compressor_kwargs["ratio"], config.warmup_epochs) == (1e-3, 4)
            assert config.momentum_correction
        else:
            assert "ratio" not in config.compressor_kwargs
            assert (config.warmup_epochs, config.momentum_correction) == (0, None)
    assert compare.for_compressor(base, rows["qsgd"]).compressor_kwargs == {"bucket_size": 512}
    paper = compare.for_compressor(base, rows["ldte_bs_paper"]).compressor_kwargs
    assert paper == {"ratio": 1e-3, "variant": "paper"}


def test_compare_qsgd_table_reports_bits_per_value_beside_the_paper(tmp_path):
    # compare --table=qsgd on tiny epochs: each QSGD row's bits per quantized
    # value, packed and by the paper's count, against a count by hand of the
    # model's leaves; the Elias-coded size lies between the scales and the packed.
    from experiments import compare, train  # noqa: PLC0415

    rows, setting = compare.TABLES["qsgd"]
    settings = {n: (r["compressor_kwargs"]["bits"], r["compressor_kwargs"]["bucket_size"])
                for n, r in rows.items() if n != "dense"}  # fmt: skip
    assert settings == {
        "qsgd_2bit_b128": (2, 128), "qsgd_2bit": (2, 512), "qsgd_4bit": (4, 512),
        "qsgd_8bit": (8, 512),
    }  # fmt: skip
    base = train.TrainConfig(
        **{**setting, "epochs": 1},
        num_devices=2,
        dataset="digits",
        model="mlp",
        batch_size=32,
        max_steps_per_epoch=5,  # coded_bytes_every=5: one Elias measurement
        time_split=False,
        progress=False,
        checkpoint=False,
    )
    compare.validate_runs(base, rows)  # every row; two of them train (the paper's pair)
    pair = {n: rows[n] for n in ("qsgd_2bit_b128", "qsgd_4bit")}
    results = compare.run_configs(base, pair, str(tmp_path))
    table, bits = compare.format_qsgd_bits(results, pair)
    assert sorted(bits) == sorted(pair)
    sizes = [np.size(x) for x in jax.tree.leaves(results["qsgd_4bit"]["params"])]
    big = np.array([n for n in sizes if n > 10_000])
    assert big.sum() > 0.9 * sum(sizes)  # the MLP's two large weight matrices
    paper = {}
    for name in pair:
        b, d = settings[name]
        row, scales = bits[name], np.ceil(big / d).sum()
        assert row["quantized_values"] == big.sum()
        # Packed: 1 sign bit + ceil(log2(2^b + 1)) = b + 1 level bits, 32 per bucket.
        np.testing.assert_allclose(row["packed"], ((b + 2) * big.sum() + 32 * scales) / big.sum())
        paper[name] = (b * big.sum() + 32 * scales) / big.sum()
        np.testing.assert_allclose(row["paper"], paper[name])
        assert 32 * scales / big.sum() < row["elias"] < row["packed"]
        assert row["accuracy"] == 100 * results[name]["final"]["test_accuracy"]
    # 4-bit against the paper's 2-bit: by the paper's count +81% and 7.9x here too.
    ratio = paper["qsgd_4bit"] / paper["qsgd_2bit_b128"]
    line = next(s for s in table.splitlines() if s.startswith("qsgd_4bit"))
    assert f"{100 * (ratio - 1):+.0f}%" in line and f"{32 / paper['qsgd_4bit']:.1f}x" in line
    assert "+77% vs 2-bit" in line


def test_compare_accordion_rows_are_valid_configs():
    # compare --table=accordion: every row validates in the table's setting, and the
    # Accordion rows switch between exactly the levels of the fixed rows beside them.
    from experiments import compare, train  # noqa: PLC0415

    rows, setting = compare.TABLES["accordion"]
    base = train.TrainConfig(**setting)
    configs = {n: compare.for_compressor(base, o) for n, o in rows.items()}
    for config in configs.values():
        train.validate_config(config)
        assert not config.momentum_correction and config.warmup_epochs == 0
    kw = {n: c.compressor_kwargs for n, c in configs.items()}
    assert (kw["accordion_top_k"]["low"], kw["accordion_top_k"]["high"]) == (
        kw["top_k_0.99"]["ratio"],
        kw["top_k_0.1"]["ratio"],
    )
    assert (kw["accordion_powersgd"]["low"], kw["accordion_powersgd"]["high"]) == (
        kw["powersgd_r4"]["rank"],
        kw["powersgd_r1"]["rank"],
    )
    swapped = {"compressor": "top_k", "low": 0.1, "high": 0.99}
    bad = compare.for_compressor(base, {"compressor": "accordion", "compressor_kwargs": swapped})
    with pytest.raises(train.ConfigError, match="accordion.*high"):
        train.validate_config(bad)


def test_dlgs_table_rows_are_the_papers_methods():
    # compare --table=dlgs: each row passes validation in the paper's setting,
    # and the rows differ exactly in what the DLGS paper compares.
    from experiments import compare, setups, train  # noqa: PLC0415

    rows, setting = compare.TABLES["dlgs"]
    assert setting["epochs"] == compare.DLGS_EPOCHS and setting["schedule"] == "step"
    assert setting["warmup_epochs"] == 0 and setting["compressor_kwargs"] == {"ratio": 0.1}
    base = train.TrainConfig(**setting, momentum=0.9)
    configs = {n: compare.for_compressor(base, o) for n, o in rows.items()}
    for config in configs.values():
        train.validate_config(config)
    resolved = {n: train.resolve_config(c) for n, c in configs.items() if n != "dense"}
    kw = {n: c.compressor_kwargs for n, c in resolved.items()}
    assert kw["top_k"]["granularity"] == "global"
    assert (kw["lags"]["granularity"], kw["lags"]["reuse_period"]) == ("layer", 1)
    period = setups.DLGS_REUSE_PERIOD
    assert period > 1
    # The paper's DLGS: reuse with nothing above the threshold cut, greedy merge
    # (its Algorithm 2); threshold reuse alone; jaxcomp's (capped, optimal merge).
    paper = (period, "uncapped")
    assert (kw["dlgs_reuse"]["reuse_period"], kw["dlgs_reuse"]["capacity_factor"]) == paper
    assert (kw["dlgs"]["reuse_period"], kw["dlgs"]["capacity_factor"]) == paper
    assert kw["dlgs_ours"]["reuse_period"] == period
    assert kw["dlgs_ours"].get("capacity_factor") is None  # the factory's 1.5
    merges = {n: resolved[n].merge for n in ("dlgs_reuse", "dlgs", "dlgs_ours")}
    assert merges == {"dlgs_reuse": "none", "dlgs": "greedy", "dlgs_ours": "optimal"}
    assert all(k["ratio"] == 0.1 for k in kw.values())
    # The setups' DLGS is the table's paper row.
    for name in ("dlgs_resnet20_cifar10", "dlgs_vgg16_cifar10"):
        setup = train.resolve_config(setups.setup_config(name))
        assert setup.merge == "greedy" and setup.compressor_kwargs == kw["dlgs"]


def test_compare_dlgs_table_prints_the_papers_column(tmp_path):
    # compare --table=dlgs in a tiny mode: dense and the paper's DLGS (uncapped
    # reuse, greedy merge) train a few steps; the paper table holds our numbers
    # from the runs and the paper's statements beside them.
    from experiments import compare, train  # noqa: PLC0415

    rows, setting = compare.TABLES["dlgs"]
    base = train.TrainConfig(
        **{**setting, "epochs": 1},
        momentum=0.9,
        num_devices=2,
        dataset="digits",
        model="mlp",
        batch_size=32,
        max_steps_per_epoch=6,
        time_split=False,
        progress=False,
        checkpoint=False,
    )
    pair = {n: rows[n] for n in ("dense", "dlgs")}
    results = compare.run_configs(base, pair, str(tmp_path))
    _, summaries = compare.format_table(results, target=0.0)
    text, out = compare.format_dlgs_paper(results, summaries, "tiny")
    assert "Ours: tiny" in text and "paper Table 1" in text and "paper Table 2" in text
    for name in pair:
        line = next(s for s in text.splitlines() if s.startswith(name + " "))
        claims = compare.DLGS_PAPER_CLAIMS[name]
        assert claims["table1"] in line and claims["table2"] in line
        final = results[name]["final"]
        assert f"{100 * final['test_accuracy']:.2f}" in line
        assert out[name]["train_seconds"] == final["train_time"]
    assert "up to 1.99x vs dense" in text
    assert out["dense"]["speedup_vs_dense"] == pytest.approx(1.0)
    assert out["dlgs"]["message_bytes"] == summaries["dlgs"]["message_bytes"] > 0
    assert results["dlgs"]["merge_plan"]["method"] == "greedy"


def test_compare_merge_link_reaches_only_the_merging_row():
    from experiments import compare, train  # noqa: PLC0415

    rows, setting = compare.TABLES["dlgs"]
    linked = compare.with_merge_link(rows, merge_alpha=1e-3)
    base = train.TrainConfig(**setting, momentum=0.9)
    configs = {n: compare.for_compressor(base, o) for n, o in linked.items()}
    for name, config in configs.items():
        train.validate_config(config)
        merging = rows[name].get("merge", "none") != "none"
        assert config.merge_alpha == (1e-3 if merging else None), name
        assert config.merge_beta is None, name
    assert sum(c.merge_alpha is not None for c in configs.values()) == 2  # dlgs, dlgs_ours
    # The planner's cost: the flag's latency, the default bandwidth.
    cost = train.merge_link_cost(train.resolve_config(configs["dlgs"]))
    unlinked = compare.for_compressor(base, rows["dlgs"])
    default = train.merge_link_cost(train.resolve_config(unlinked))
    assert cost(0) == pytest.approx(1e-3) and default(0) == pytest.approx(train.MERGE_ALPHA)
    assert cost(10**6) - cost(0) == pytest.approx(default(10**6) - default(0))
    assert compare.with_merge_link(rows) is rows
    # A table with no merging row, or a bad value, stops before any training.
    with pytest.raises(ValueError, match="--merge_beta.*no row"):
        compare.with_merge_link(compare.TABLES["ldte_bs"][0], merge_beta=1e-9)
    for bad in (["--table=peers", "--merge_alpha=1e-3"], ["--target=nan"], ["--num_devices=-1"]):
        with pytest.raises(SystemExit):  # cli.fail's error, before any device or training
            compare.main(["compare", *bad, "--outdir=/nonexistent/x"])
    bad = compare.with_merge_link(rows, merge_alpha=-1.0)
    with pytest.raises(ValueError, match="merge_alpha"):
        compare.run_configs(base, bad, "/nonexistent/compare")


def test_compare_and_demos_reject_bad_settings_in_one_line(capsys):
    # Settings only train.validate_config rejects: cli.fail's one-line error
    # (exit 2), not a traceback, before any training.
    from experiments import compare, demo_training  # noqa: PLC0415

    for main, bad in (
        (compare.main, ["--ratio=2"]),
        (compare.main, ["--epochs=0"]),
        (compare.main, ["--schedule=bogus"]),
        (demo_training.main, ["--epochs=0"]),
        (demo.main, ["--size=0"]),
        (demo.main, ["--ratio=0"]),
    ):
        # --num_devices=0: keep JAX's device count (already initialised here).
        argv = bad if main is demo.main else [*bad, "--num_devices=0", "--outdir=/nonexistent/x"]
        with pytest.raises(SystemExit) as exit_info:
            main(["program", *argv])
        assert exit_info.value.code == 2, bad
        err = capsys.readouterr().err
        assert "Traceback" not in err and ("invalid config" in err or "must be" in err), bad


def test_ldte_bs_paper_row_runs_the_paper_variant():
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxcomp  # noqa: PLC0415
    from experiments import train  # noqa: PLC0415

    # Two devices with the same gradient exchange exactly what one device
    # running jaxcomp.ldte_bs(variant="paper") alone would send.
    g = {"w": np.random.default_rng(0).laplace(size=4096).astype(np.float32)}
    config = train.TrainConfig(
        compressor="ldte_bs",
        compressor_kwargs={"ratio": 0.01, "variant": "paper"},
        momentum_correction=False,
    )
    _, compressor = train.build_optimizer(config, 10, 100)
    mesh = jax.make_mesh((2,), (train.AXIS,), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(train.AXIS))

    def stacked(tree):
        return jax.device_put(jax.tree.map(lambda a: np.stack([a, a]), tree), sharding)

    updates, _ = compress_on_mesh(
        compressor, mesh, stacked(g), stacked(compressor.init(g)), train.AXIS
    )
    ref = jaxcomp.ldte_bs(0.01, variant="paper")
    expected = ref.update(jax.tree.map(jnp.asarray, g), ref.init(g))[0]["w"]
    assert int(jnp.sum(expected != 0)) > 0
    np.testing.assert_array_equal(np.asarray(updates["w"])[0], np.asarray(expected))


def test_bench_train_step_writes_json_and_png(tmp_path):
    from experiments import bench_train_step

    result = bench_train_step.run(width=16, depth=1, ratio=0.05, repeats=3, out_dir=str(tmp_path))
    data = json.loads((tmp_path / "bench_train_step.json").read_text())
    assert (tmp_path / "bench_train_step.png").stat().st_size > 0
    rows = data["results"]
    assert rows == json.loads(json.dumps(result["results"]))
    assert data["meta"]["num_params"] == 784 * 16 + 16 + 16 * 10 + 10
    # Masking the biases out of the compressor leaves exactly them to the dense mean.
    assert rows["ldte_bs_masked"]["unexchanged_leaves"] == 2
    assert rows["ldte_bs"]["unexchanged_leaves"] == rows["dense"]["unexchanged_leaves"] == 0
    for name in ("dense", "ldte_bs", "ldte_bs_masked"):
        np.testing.assert_allclose(
            rows[name]["donation_saves"],
            1 - rows[name]["step_ms"] / rows[f"{name}_not_donated"]["step_ms"],
        )
    assert rows["ldte_bs"]["wire_bytes"] < rows["dense"]["wire_bytes"]


def test_bench_reuse_writes_json_and_png(tmp_path):
    from experiments import bench_reuse

    rows = bench_reuse.run(
        12, [3], ["ldte_bs", "top_k"], repeats=5, out_dir=str(tmp_path), warm_steps=20
    )
    data = json.loads((tmp_path / "bench_reuse.json").read_text())
    assert (tmp_path / "bench_reuse.png").stat().st_size > 0
    assert data["results"] == json.loads(json.dumps(rows))
    assert {(r["method"], r["s"]) for r in rows} == {
        (m, s) for m in ("ldte_bs", "top_k") for s in (1, 3)
    }
    for r in rows:
        k = r["k"]
        assert k == max(1, math.ceil(1e-3 * r["n"]))
        assert len(r["step_ms_by_position"]) == r["s"]
        np.testing.assert_allclose(r["step_ms"], np.mean(r["step_ms_by_position"]))
        for density in (r["density"], r["density_start"]):
            sent, above = density["sent_over_k"], density["above_over_k"]
            assert len(sent) == len(above) == r["s"]
            # Right after a refresh: top-k sends exactly k, LDTE-BS within [k, 1.5 k].
            if r["method"] == "top_k":
                assert sent[0] == above[0] == 1.0
            else:
                assert 1.0 <= sent[0] <= 1.5
            # Never more than the capacity, whatever the stored threshold lets through.
            assert all(s_ <= math.ceil(1.5 * k) / k + 1e-9 for s_ in sent)
            assert all(s_ <= a + 1e-12 for s_, a in zip(sent, above, strict=True))
        base = next(b for b in rows if b["method"] == r["method"] and b["s"] == 1)
        np.testing.assert_allclose(r["speedup_vs_s1"], base["step_ms"] / r["step_ms"])
        # The kernel: the selector on refresh steps, count_above on the others.
        np.testing.assert_allclose(
            r["kernel_ms"], (r["select_ms"] + (r["s"] - 1) * r["apply_ms"]) / r["s"]
        )
        np.testing.assert_allclose(r["kernel_speedup_vs_s1"], base["kernel_ms"] / r["kernel_ms"])


def test_bench_selection_json_feeds_the_merge_planner(tmp_path):
    from jaxcomp import planning  # noqa: PLC0415

    bench_selection.run(
        [10, 12], ["laplace"], repeats=1, out_dir=str(tmp_path), methods=["ldte_bs"]
    )
    path = str(tmp_path / "bench_selection.json")
    for metric in ("threshold_ms", "step_ms"):
        cost = planning.load_sparsify_cost(path, "ldte_bs", metric=metric)
        assert cost.alpha >= 0 and cost.beta >= 0 and cost(2**12) > 0


def test_bench_merge_plans_on_a_small_model(tmp_path):
    from experiments import bench_merge

    # Every plan is made and predicted; two are compiled and measured (time).
    measure = (("none", False), ("all", True))
    result = bench_merge.run(
        ratio=0.1, per_device_batch=2, repeats=5, compressor="top_k", out_dir=str(tmp_path),
        model="mlp", image_size=4, measure=measure,
    )  # fmt: skip
    assert (tmp_path / "bench_merge.png").stat().st_size > 0
    meta = json.loads((tmp_path / "bench_merge.json").read_text())["meta"]
    assert meta["layers"] == 3
    predicted = meta["predicted"]
    assert sorted(predicted) == sorted(bench_merge.PLANS)
    assert predicted["none"]["groups"] == 3 and predicted["all"]["groups"] == 1
    # The exact planner is never predicted slower than the others.
    best = predicted["optimal"]["predicted_ms"]
    assert all(best <= p["predicted_ms"] + 1e-9 for p in predicted.values())
    rows = result["results"]
    assert sorted(rows) == ["all_overlap", "none"]
    # One sparse group is two all-gathers (indices, values): fewer groups, fewer collectives.
    # A packed step sends every group's pairs in one all-gather (indices, values).
    assert rows["none"]["collectives"]["all_gather"] == 2
    assert rows["all_overlap"]["collectives"]["all_gather"] == 2
    assert all(r["wire_bytes"] > 0 for r in rows.values())


def _fake_records(accuracies, step_seconds, split):
    """Epoch records as train.train_and_evaluate writes them (only what compare reads)."""
    fb, comp, comm = split
    records, t = [], 0.0
    for epoch, acc in enumerate(accuracies, 1):
        t += step_seconds
        records.append(
            {
                "epoch": epoch,
                "test_accuracy": acc,
                "train_time": t,
                "wall_time": 2 * t,
                "step_time": step_seconds,
                "bytes_per_step_per_device": 100.0,
                "message_bytes_per_step_per_device": 10.0,
                "density": 0.01,
                "compression_time_share": comp / (fb + comp + comm),
                "time_forward_backward": fb,
                "time_compression": comp + 1e-3 * epoch,  # medians over epochs are taken
                "time_communication": comm,
                "time_step": fb + comp + comm,
                "time_step_without_communication": fb + comp,
            }
        )
    return records


def test_compare_table_has_table3_alpha_and_the_time_split():
    from experiments import compare  # noqa: PLC0415

    results = {
        name: {"records": _fake_records(acc, sec, split), "compile_time": 1.0}
        for name, acc, sec, split in [
            ("dense", [0.5, 0.96, 0.97], 4.0, (0.001, 0.0, 0.003)),
            ("top_k", [0.5, 0.8, 0.96], 2.0, (0.001, 0.002, 0.001)),  # target after 6 s
            ("ldte_bs", [0.96, 0.97, 0.97], 1.5, (0.001, 0.0005, 0.001)),  # after 1.5 s
            ("never", [0.1, 0.2, 0.3], 1.0, (0.001, 0.001, 0.001)),
        ]
    }
    for r in results.values():
        r["final"] = r["records"][-1]
    table, rows = compare.format_table(results, target=0.95)
    assert rows["top_k"]["speedup_to_target"] == 1.0
    assert rows["ldte_bs"]["speedup_to_target"] == 6.0 / 1.5
    assert rows["dense"]["speedup_to_target"] == 6.0 / 8.0
    assert rows["never"]["speedup_to_target"] is None
    # Medians over the three epochs, in ms.
    np.testing.assert_allclose(rows["top_k"]["compression_ms"], 1e3 * (0.002 + 2e-3))
    np.testing.assert_allclose(rows["dense"]["communication_ms"], 3.0)
    assert "alpha" in table.splitlines()[0] and "4.00" in table


def _strict_json(text):
    """``json.loads`` that rejects NaN and Infinity, as jq and JavaScript do."""

    def reject(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=reject)


def test_result_files_write_non_finite_values_as_null():
    from experiments import compare, jsonio  # noqa: PLC0415

    nan, inf = float("nan"), float("inf")
    assert _strict_json(jsonio.dumps({"a": [1.5, nan, {"b": -inf}], "c": (2, inf), "d": "x"})) == {
        "a": [1.5, None, {"b": None}],
        "c": [2, None],
        "d": "x",
    }
    # A diverged run (NaN accuracy and times) in compare's rows, as comparison.json holds them.
    results = {
        name: {"records": _fake_records(acc, 1.0, (0.001, 0.001, 0.001)), "compile_time": 1.0}
        for name, acc in [("dense", [0.5, 0.9]), ("top_k", [0.5, nan])]
    }
    for r in results.values():
        r["final"] = r["records"][-1]
    _, rows = compare.format_table(results, target=0.95)
    assert math.isnan(rows["top_k"]["final_accuracy"])
    stored = _strict_json(jsonio.dumps({"rows": rows}))["rows"]
    assert stored["top_k"]["final_accuracy"] is None
    assert stored["dense"] == rows["dense"]


def test_bench_cssgd_writes_json_and_png(tmp_path):
    from experiments import bench_cssgd  # noqa: PLC0415
    from jaxcomp import cssgd  # noqa: PLC0415

    record = bench_cssgd.run(
        str(tmp_path), models=("mlp",), redundancies=(1, 2), epochs=2, batch_size=24,
        num_devices=4, max_steps_per_epoch=2, target_fraction=0.5,
    )  # fmt: skip
    data = json.loads((tmp_path / "bench_cssgd.json").read_text())
    assert (tmp_path / "bench_cssgd.png").stat().st_size > 0
    assert data == json.loads(json.dumps(record))
    mlp = data["models"]["mlp"]
    assert sorted(mlp["runs"]) == ["asgd", "coded_r1", "coded_r2", "dense", "uncoded_r2"]
    size = mlp["num_params"]
    # The paper's uncoded baseline: each missing block sent whole by one holder.
    uncoded = mlp["runs"]["uncoded_r2"]
    assert uncoded["received_bytes"] == cssgd.bytes_per_worker(4, 2, size)["uncoded_sent"]
    # Coding changes the bytes, not the gradient: the same quantized mean.
    assert uncoded["test_accuracy"] == mlp["runs"]["coded_r2"]["test_accuracy"]
    # ASGD: each worker pushes its dense float32 update and pulls the parameters.
    asgd = mlp["runs"]["asgd"]
    assert asgd["sent_bytes"] == asgd["received_bytes"] == 4 * size
    assert asgd["forward_backward_ms"] == -1.0  # no time split for the asynchronous run
    # Time to accuracy, recomputed from every run's curve: the first epoch's end
    # at or above target_fraction x the dense run's final accuracy.
    tta = mlp["time_to_accuracy"]
    target = 0.5 * mlp["runs"]["dense"]["test_accuracy"]
    np.testing.assert_allclose(tta["target_accuracy"], target)
    assert sorted(tta["runs"]) == sorted(mlp["runs"])
    for name, row in mlp["runs"].items():
        curve = row["curve"]
        assert [p["epoch"] for p in curve] == [1, 2]
        assert curve[-1]["test_accuracy"] == row["test_accuracy"]
        assert 0 < curve[0]["train_time"] < curve[1]["train_time"]
        hits = [p for p in curve if p["test_accuracy"] >= target]
        got = tta["runs"][name]
        assert got["measured_seconds"] == (hits[0]["train_time"] if hits else None), name
        # The robust time: steps to the target (2 per epoch here) x the median step.
        steps = 2 * hits[0]["epoch"] if hits else None
        assert got["steps"] == steps, name
        if hits:
            assert got["seconds"] == pytest.approx(steps * row["train_step_ms"] / 1e3), name
    assert mlp["runs"]["asgd"]["step_ms"] == mlp["runs"]["asgd"]["train_step_ms"] > 0
    assert tta["runs"]["dense"]["seconds"] is not None  # the dense run reaches its own
    secs = {k: v["seconds"] for k, v in tta["runs"].items()}
    reached = {k: t for k, t in secs.items() if k.startswith("coded") and t is not None}
    if reached:
        best = min(reached, key=reached.get)
        assert tta["best_coded"] == best
        for base, run_name in (
            ("dense", "dense"),
            ("asgd", "asgd"),
            ("ssgd_multicast", "coded_r1"),
        ):
            t = secs[run_name]
            expected = None if t is None else 100 * (1 - reached[best] / t)
            assert tta["time_saved_percent"][base] == pytest.approx(expected)
    for r in (1, 2):
        expected = cssgd.bytes_per_worker(4, r, mlp["num_params"])
        row = mlp["runs"][f"coded_r{r}"]
        assert row["sent_bytes"] == expected["coded_sent"]
        assert row["received_bytes"] == expected["coded_received"]
        dense_ms = mlp["runs"]["dense"]["step_ms"]
        np.testing.assert_allclose(row["step_vs_dense"], row["step_ms"] / dense_ms)
        assert row["forward_backward_ms"] > 0
        formula = mlp["formula"][r - 1]
        assert formula["coded_sent"] == expected["coded_sent"]
        assert formula["coded_load"] == float(cssgd.coded_load(4, r))
    # The dense baseline's ring all-reduce, per leaf, sums to the formula's.
    np.testing.assert_allclose(
        mlp["runs"]["dense"]["sent_bytes"], mlp["formula"][0]["allreduce_sent"], rtol=1e-6
    )
    fit = mlp["fit"]
    assert fit["t_calc_ms"] == mlp["runs"]["coded_r1"]["forward_backward_ms"]
    assert fit["predicted_best_r"] == cssgd.best_redundancy(fit["t_calc_ms"], fit["t_comm_ms"], 4)
    assert fit["measured_best_r"] in (1, 2)
    table = bench_cssgd.format_table(record)
    assert "coded_r2" in table and "memory copy" in table and "time to" in table
    assert "asgd" in table and "uncoded_r2" in table
    with pytest.raises(ValueError, match="target_fraction"):
        bench_cssgd.run(str(tmp_path), models=("mlp",), target_fraction=0.0)


def _run_program(module, *args):
    """``python -m experiments.<module> *args`` in a fresh process (it picks its device count)."""
    env = {**os.environ, "XLA_FLAGS": compile_flags_without_devices()}
    proc = subprocess.run(
        [sys.executable, "-m", f"experiments.{module}", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_bench_exchange_writes_json_and_png_with_the_ring_and_all_gather_bytes(tmp_path):
    _run_program(
        "bench_exchange", "--min_log2=10", "--max_log2=10", "--ratios", "0.01",
        "--repeats=1", f"--out={tmp_path}",
    )  # fmt: skip
    data = json.loads((tmp_path / "bench_exchange.json").read_text())
    assert (tmp_path / "bench_exchange.png").stat().st_size > 0
    n_dev = data["meta"]["devices"]
    assert n_dev == 8 and f"device_count={n_dev}" in data["meta"]["xla_flags"]
    (row,) = data["rows"]
    n = row["size"]
    assert n == 1024 and row["k"] == math.ceil(0.01 * n)
    # A ring all-reduce sends 2 (N - 1) / N of the float32 tensor; the sparse
    # all-gather sends the capacity's (int32 index, float32 value) pairs to N - 1 peers.
    assert row["dense_bytes"] == 2 * (n_dev - 1) / n_dev * 4 * n
    assert row["capacity"] == math.ceil(1.5 * row["k"])
    assert row["sparse_bytes"] == (n_dev - 1) * row["capacity"] * 8
    assert row["message_bytes_mean"] == row["sent_count_mean"] * 8
    assert row["k"] <= row["sent_count_mean"] <= row["capacity"]
    assert row["wire_vs_dense"] == row["sparse_bytes"] / row["dense_bytes"]


def test_bench_powersgd_writes_json_and_png_with_the_ring_bytes(tmp_path):
    _run_program(
        "bench_powersgd", "--shapes=64x32", "--ranks=1", "--devices=2", "--repeats=5",
        f"--out={tmp_path}",
    )  # fmt: skip
    data = json.loads((tmp_path / "bench_powersgd.json").read_text())
    assert (tmp_path / "bench_powersgd.png").stat().st_size > 0
    (row,) = data["results"]
    n, n_dev = 64 * 32, 2
    assert row["elements"] == n and data["meta"]["devices"] == n_dev
    assert row["dense_wire_bytes"] == 2 * (n_dev - 1) / n_dev * 4 * n
    for rank in (1,):
        r = row["ranks"][str(rank)]
        # P (64 x r) and Q (32 x r) are all-reduced in float32, not the 64 x 32 gradient.
        assert 2 * (n_dev - 1) / n_dev * 4 * (64 + 32) * rank <= r["wire_bytes"] < n * 4
        assert r["dense_over_powersgd"] == row["dense_wire_bytes"] / r["wire_bytes"]


def test_bench_allreduce_bytes_match_each_exchanges_formula(tmp_path):
    from experiments import bench_allreduce

    exchanges = ("dense", "sparse", "gtopk", "scalecom")
    result = bench_allreduce.run([2, 4], 10, 1, tmp_path, exchanges=exchanges)
    assert json.loads((tmp_path / "bench_allreduce.json").read_text()) == result
    assert (tmp_path / "bench_allreduce.png").stat().st_size > 0
    rows = {(r["exchange"], r["devices"]): r for r in result["rows"]}
    assert set(rows) == {(e, n) for e in exchanges for n in (2, 4)}
    n, cap = 1024, math.ceil(1.5 * math.ceil(1e-3 * 1024))
    for (exchange, n_dev), r in rows.items():
        assert r["capacity"] == (0 if exchange == "dense" else cap)
        # Independent of formula_bytes: ring all-reduce 2 (N - 1) / N of the
        # float32 buffer; all-gather N - 1 messages of (int32, float32) pairs;
        # gTop-k log2 N rounds of one message; ScaleCom all-reduces the leader's
        # indices and then the values (cap 4-byte words each).
        ring = 2 * (n_dev - 1) / n_dev
        expected = {
            "dense": ring * 4 * n,
            "sparse": (n_dev - 1) * cap * 8,
            "gtopk": math.log2(n_dev) * cap * 8,
            "scalecom": 2 * ring * 4 * cap,
        }[exchange]
        assert r["wire_bytes"] == r["formula_bytes"] == expected, (exchange, n_dev)
        dense = rows[("dense", n_dev)]["wire_bytes"]
        assert r["fewer_than_dense"] == dense / r["wire_bytes"]


def _records(byte_counts):
    return [
        {"epoch": e + 1, "test_accuracy": 0.5 + 0.1 * e, "cumulative_bytes_per_device": b}
        for e, b in enumerate(byte_counts)
    ]


@pytest.mark.parametrize("with_dense", [False, True])
def test_accuracy_plot_of_a_run_that_sends_nothing(tmp_path, with_dense):
    """A coded run with r = n sends 0 bytes: plotted at 0, without matplotlib's warning."""
    import warnings  # noqa: PLC0415

    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from experiments import train  # noqa: PLC0415

    runs = {"cssgd_r4": _records([0.0, 0.0])}
    if with_dense:
        runs["dense"] = _records([1e6, 2e6])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Data has no positive values" was a UserWarning
        train.write_plots(runs, str(tmp_path / "accuracy.png"))
        fig = train.accuracy_figure(runs, plt)
    assert (tmp_path / "accuracy.png").stat().st_size > 0
    ax = fig.axes[1]
    lo, hi = ax.get_xlim()
    assert lo <= 0.0 <= hi  # the zero-byte run is on the plot, not dropped
    assert hi >= (2e6 if with_dense else 0.0)
    assert ax.get_xscale() == ("symlog" if with_dense else "linear")
    plt.close(fig)
    # Runs that all send bytes keep the plain log axis.
    fig = train.accuracy_figure({"dense": _records([1e6, 2e6])}, plt)
    assert fig.axes[1].get_xscale() == "log"
    plt.close(fig)


def test_bench_exchange_server_rows_write_json_and_png(tmp_path):
    """The parameter-server group rows only: bytes per server from the formulas match the
    bytes the compressors report; the busiest server's link shrinks as 1 / M."""
    from experiments import bench_exchange  # noqa: PLC0415

    argv = ["prog", f"--out={tmp_path}", "--min_log2=12", "--max_log2=12", "--quantizers="]
    bench_exchange.main([*argv, "--no_sparse", "--servers=1,2", "--repeats=1"])
    data = json.loads((tmp_path / "bench_exchange.json").read_text())
    assert (tmp_path / "bench_exchange_servers.png").stat().st_size > 0
    rows = data["server_rows"]
    assert {(r["compressor"], r["servers"]) for r in rows} == {
        (c, m) for c in bench_exchange.SERVER_ROWS for m in (1, 2)
    }
    for r in rows:
        assert r["worker_bytes"] == r["worker_bytes_formula"]
        assert len(r["server_in_bytes"]) == r["servers"]
        assert r["server_out_bytes"] == [7 * b for b in r["pull_bytes"]]
        if r["servers"] == 2:  # equal leaves and ranges: half of the single server's pull
            one = next(o for o in rows if (o["compressor"], o["servers"]) == (r["compressor"], 1))
            assert r["pull_bytes"] == [one["pull_bytes"][0] / 2] * 2
        if "meaningful_push_bytes" in r:  # top-k: exactly k entries of each leaf are sent
            assert sum(r["meaningful_push_bytes"]) == 8 * 8 * math.ceil(0.01 * 512)
            pairs = zip(r["meaningful_push_bytes"], r["push_bytes"], strict=True)
            assert all(m <= p for m, p in pairs)
