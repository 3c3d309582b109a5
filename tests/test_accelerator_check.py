"""``python -m experiments.accelerator_check --small``: the accelerator check cannot rot.

Runs the whole check on the test session's backend (8 simulated CPU devices)
and checks its JSON against independent facts: the backend JAX reports, the
selection counts recomputed in numpy from the same data, every part present
with its budget. No timing is asserted.
"""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from absl import flags

from experiments import accelerator_check as ac
from experiments import bench_model, bench_selection, presets
from jaxcomp.selection import selectors


def test_small_run(tmp_path):
    """One --small run, every part checked (a module fixture shared by several tests ran the
    check once per xdist worker that got one of them: CPU 53 -> 28 s with -n 2)."""
    ac.main(["accelerator_check", "--small", f"--out={tmp_path}"])
    with open(tmp_path / "accelerator_check.json") as f:
        record = tmp_path, json.load(f)  # strict JSON: no NaN
    _check_every_part_is_present_with_its_budget_and_plot(record)
    _check_conformance_rows_pass_single_and_sharded(record)
    _check_selection_counts_match_the_data(record)
    _check_model_rows_against_plain_sgd(record)
    _check_training_and_overlap(record)


def _check_every_part_is_present_with_its_budget_and_plot(record):
    out, rec = record
    assert list(rec["parts"]) == list(ac.PARTS)
    for part, r in rec["parts"].items():
        assert "error" not in r, (part, r.get("error"))
        assert r["budget_s"] == ac.BUDGETS[part] and isinstance(r["skipped"], list)
        assert (out / f"{part}.png").stat().st_size > 0
    meta = rec["meta"]
    d = jax.devices()[0]
    assert (meta["device_kind"], meta["device_platform"]) == (d.device_kind, d.platform)
    assert (meta["device_count"], meta["jax_version"]) == (jax.device_count(), jax.__version__)
    assert meta["small"] and "memory" in meta


def _check_conformance_rows_pass_single_and_sharded(record):
    r = record[1]["parts"]["conformance"]
    names = {row["name"] for row in r["rows"]}
    assert names == set(ac.SMALL_CONFORMANCE) - set(r["skipped"])
    assert names <= set(presets.CONFORMANCE) | set(presets.CONFORMANCE_OPTIMIZERS)
    modes = {row["mode"] for row in r["rows"]}
    assert modes == {"single", f"shard_map_{jax.device_count()}"}
    assert all(row["ok"] for row in r["rows"]), r["failed"]
    # A sparsifier with error feedback is checked for nothing lost; an optimizer is not.
    by = {(row["name"], row["mode"]): row for row in r["rows"]}
    assert by[("ldte_bs", "single")]["nothing_lost"] is True
    assert by[("onebit_adam", "single")]["nothing_lost"] is None


def _check_selection_counts_match_the_data(record):
    r = record[1]["parts"]["selection"]
    assert [row["log2_n"] for row in r["rows"]] == list(ac.SMALL["selection_log2"])
    for row in r["rows"]:
        a = np.abs(bench_selection.make_data("laplace", row["n"]))
        k = selectors.target_count(bench_selection.ETA, row["n"])
        assert row["k"] == k and set(row["methods"]) == set(ac.SELECTION)
        for name, m in row["methods"].items():
            count = int(np.sum(a > np.float32(m["threshold"])))
            assert m["count"] == count and math.isclose(m["count_over_k"], count / k), name
            assert count >= k, name  # every method here sends at least k
        assert row["methods"]["top_k"]["count"] == k  # continuous data: no ties


def _check_model_rows_against_plain_sgd(record):
    r = record[1]["parts"]["model"]
    rows = {row["compressor"]: row for row in r["rows"]}
    assert set(rows) == set(ac.MODEL_COMPRESSORS)
    shapes = jax.tree.leaves(bench_model.tree_shapes("small"))
    for row in rows.values():
        assert row["tree"] == "small" and row["leaves"] == len(shapes) and row["compile_s"] > 0
    assert rows["sgd"]["step_vs_sgd"] == 1.0


def _check_training_and_overlap(record):
    parts = record[1]["parts"]
    rows = parts["training"]["rows"]
    assert [(row["run"], row["compressor"]) for row in rows] == [
        ("mlp_digits", "dense"),
        ("mlp_digits", "ldte_bs"),
    ]
    for row in rows:
        assert row["devices"] == jax.device_count()
        assert np.isfinite([row["loss_first"], row["loss_last"]]).all()
        assert set(row["time_split_ms"]) >= {"forward_backward", "compression", "communication"}
    ov = parts["overlap"]
    assert [row["overlap"] for row in ov["rows"]] == [False, True]
    for row in ov["rows"]:
        assert row["schedule"]["collectives"] > 0 and row["schedule"]["matmuls"] > 0
        prof = row["profile"]
        assert prof["method"] == "profile" and isinstance(prof["available"], bool)
        if not prof["available"]:
            assert prof["reason"]
            continue
        assert prof["profiled_steps"] == ac.PROFILE_STEPS and prof["elapsed_s"] > 0
        # One (device, run) group per device and profiled step, at most.
        assert 0 < prof["device_steps"] <= jax.device_count() * ac.PROFILE_STEPS
        assert prof["op_events"]["collective"] > 0 and prof["op_events"]["compute"] > 0
        assert 0 <= prof["overlap_s"] <= prof["collective_s"]
        assert prof["collective_s"] > 0 and 0 <= prof["overlap_fraction"] <= 1
        assert math.isclose(prof["overlap_fraction"], prof["overlap_s"] / prof["collective_s"])
        examples = prof["overlapping_examples"]
        assert len(examples) == min(prof["overlapping_collectives"], ac._PROFILE_EXAMPLES)
        for ex in examples:
            assert 0 <= ex["start_s"] < ex["end_s"]
            assert 0 < ex["overlap_s"] <= ex["end_s"] - ex["start_s"] + 1e-12
    # The part's answer comes from the overlap=True profile when there is one,
    # the compiled schedule's answer stays beside it.
    on = ov["rows"][1]
    assert ov["schedule"] == {
        "method": "hlo_schedule",
        "collectives_during_backward": on["schedule"]["interleaved"],
    }
    if on["profile"]["available"]:
        frac = on["profile"]["overlap_fraction"]
        assert ov["method"] == "profile"
        assert ov["collectives_during_backward"] == (frac >= ac.PROFILE_MIN_FRACTION)
    else:
        assert ov["method"] == "hlo_schedule"
        assert ov["collectives_during_backward"] == on["schedule"]["interleaved"]


def test_a_part_over_its_budget_records_what_it_skipped(tmp_path):
    rec = ac.main(
        ["accelerator_check", "--small", "--parts=selection", "--budget_s=selection:0",
         f"--out={tmp_path}"]
    )  # fmt: skip
    r = rec["parts"]["selection"]
    assert r["budget_s"] == 0.0 and all(not row["methods"] for row in r["rows"])
    sizes = ac.SMALL["selection_log2"]
    assert r["skipped"] == [f"{m}:2^{lg}" for lg in sizes for m in ac.SELECTION]
    with pytest.raises(flags.IllegalFlagValueError):
        ac.main(["accelerator_check", "--parts=nope"])


def test_collectives_during_backward_reads_the_schedule():
    def hlo(*ops):
        body = "\n".join(f"  %i{i} = f32[4]{{0}} {op}(f32[4]{{0}} %p)" for i, op in enumerate(ops))
        # A computation before the entry holds a dot that is not part of the schedule.
        head = "HloModule m\n\n%add {\n  %x = f32[] dot(f32[] %a)\n}\n\n"
        return f"{head}ENTRY %main {{\n{body}\n}}\n"

    after = ac.collectives_during_backward(hlo("dot", "dot", "all-reduce", "fusion"))
    during = ac.collectives_during_backward(hlo("dot", "all-gather-start", "convolution"))
    none = ac.collectives_during_backward(hlo("dot", "fusion"))
    assert (after["interleaved"], during["interleaved"], none["interleaved"]) == (
        False,
        True,
        False,
    )
    assert after["matmuls"] == 2 and during["matmuls_after_first_collective"] == 1


def _event(name, ts, dur, device="0", run=1, module="jit_step"):
    args = {"hlo_op": name, "hlo_module": module, "device_ordinal": device, "run_id": run}
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": 1, "args": args}


def test_collectives_overlap_in_profile_intersects_each_device_steps_intervals():
    hlo = (
        "HloModule jit_step, is_scheduled=true\n\nENTRY %main {\n"
        "  %dot.1 = f32[4]{0} dot(f32[4]{0} %p, f32[4]{0} %q)\n"
        "  %fusion.2 = f32[4]{0} fusion(f32[4]{0} %dot.1), kind=kLoop, calls=%f\n"
        "  %psum.3 = f32[4]{0} all-reduce(f32[4]{0} %fusion.2), to_apply=%add\n"
        "  %ag = f32[8]{0} all-gather-start(f32[4]{0} %fusion.2), dimensions={0}\n"
        "  %copy.4 = f32[4]{0} copy(f32[4]{0} %psum.3)\n}\n"
    )
    events = [
        # device 0, run 1: psum.3 [10, 30) overlaps dot.1 [0, 15) and fusion.2 [12, 20):
        # their union [0, 20) covers 10 of its 20 us.
        _event("dot.1", 0, 15),
        _event("fusion.2", 12, 8),
        _event("psum.3", 10, 20),
        _event("copy.4", 0, 100),  # not compute: ignored
        # device 0, run 2: after the compute, no overlap.
        _event("dot.1", 0, 5, run=2),
        _event("ag", 5, 10, run=2),
        # device 1's compute does not overlap device 0's collectives.
        _event("dot.1", 25, 10, device="1"),
        # another program's events are not this one's.
        _event("psum.3", 0, 1000, module="jit_other"),
        {"ph": "X", "name": "Rendezvous", "ts": 0, "dur": 50, "args": {}},
    ]
    r = ac.collectives_overlap_in_profile(events, hlo)
    assert r["method"] == "profile" and r["available"]
    assert r["device_steps"] == 3
    assert r["op_events"] == {"collective": 2, "compute": 4, "other": 1}
    assert math.isclose(r["collective_s"], 30e-6) and math.isclose(r["overlap_s"], 10e-6)
    assert math.isclose(r["overlap_fraction"], 1 / 3)
    assert r["overlapping_collectives"] == 1
    [ex] = r["overlapping_examples"]
    assert (ex["device"], ex["op"]) == ("0", "psum.3")
    assert math.isclose(ex["start_s"], 10e-6) and math.isclose(ex["overlap_s"], 10e-6)
    none = ac.collectives_overlap_in_profile(events[-1:], hlo)
    assert (none["method"], none["available"]) == ("profile", False) and none["reason"]


def test_notebooks_install_from_one_marked_variable_and_report_the_backend():
    import pathlib  # noqa: PLC0415

    import nbformat  # noqa: PLC0415

    for path in sorted((pathlib.Path(__file__).parents[1] / "colab").glob("*.ipynb")):
        cell = nbformat.read(path, as_version=4).cells[1].source
        assert cell.count("REPO_URL") == 4 and 'REPO_URL = ""' in cell, path.name
        assert "SET THIS" in cell and "git+{REPO_URL}" in cell, path.name
        assert 'jax.default_backend() == "cpu"' in cell and "No GPU or TPU found" in cell
