"""One command that checks jaxcomp on whatever accelerator JAX finds (GPU, TPU or CPU).

``python -m experiments.accelerator_check [--out results/accelerator_check]``
(``make accelerator-check``) answers, in about five minutes on one device and
without network, what a user asks first on a new backend. Five parts, each
with its own time budget (``--budget_s=part:seconds,...``): a part over its
budget stops between items and lists what it skipped (``skipped``), so a slow
part cannot starve the others.

1. ``conformance``: one update of every compressor and compressed optimizer
   of the conformance families (``experiments.presets.CONFORMANCE`` and
   ``CONFORMANCE_OPTIMIZERS``), compiled and run on the default device and
   compared with the same update on the host CPU (``jax.devices("cpu")[0]``;
   on a CPU-only machine the same backend, the comparison still runs): nothing
   lost (``sent + residual == gradient``), the same result elementwise. With
   more than one device, the same update inside ``jax.shard_map`` over all of
   them, checked against the mean of the single-device updates on the host CPU.
2. ``selection``: the selection benchmark's sizes (2^20-2^26, the LDTE-BS
   paper's Fig. 5; ``experiments.bench_selection``): both LDTE-BS variants,
   exact ``lax.top_k``, ``lax.approx_max_k``, a sort and the chunked top-k,
   the selection's median time and the achieved count / k.
3. ``model``: ``experiments.bench_model``'s donated update on real models'
   parameter trees for ``ldte_bs``, ``top_k``, ``qsgd``, ``powersgd`` and plain
   SGD: compile time and step time.
4. ``training``: short data-parallel training runs (the demo's MLP on digits,
   then ResNet-20 on synthetic CIFAR-shaped data), dense and ``ldte_bs``, over
   every device, with ``jaxcomp.distributed.make_time_split``.
5. ``overlap`` (more than one device): ``make_train_step(overlap=True)``
   against compressing after the backward pass: step time, and whether the
   collectives run during the backward pass: from a profile of a few steps
   (``jax.profiler.trace``: the time each device's collectives overlap its
   compute ops, ``method: "profile"``), and from the compiled program's
   schedule (``schedule``, ``method: "hlo_schedule"``; the answer when the
   profile has no per-op events).

Writes ``<out>/accelerator_check.json`` (``meta``: device kind, platform,
device count, JAX and jaxlib versions, device and host memory; one entry per
part) and ``<out>/<part>.png``, and prints a summary table. The fields are
described in docs/accelerators.md. ``--small`` runs the same code on tiny sizes
(seconds on CPU; the test suite runs it).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from experiments import bench_model, bench_selection, cli, data, jsonio, models, presets
from experiments.timing import environment, median_ms
from jaxcomp import distributed as dist
from jaxcomp.selection import _kernels as kernels
from jaxcomp.selection import selectors

__all__ = [
    "PARTS",
    "check_update",
    "collectives_during_backward",
    "collectives_overlap_in_profile",
    "define_flags",
    "main",
    "run",
]

AXIS = "data"
PARTS = ("conformance", "selection", "model", "training", "overlap")
# Steps run under jax.profiler.trace per overlap variant, after the timed steps.
PROFILE_STEPS = 2
# The overlapped share of the collectives' time above which the profile's answer is
# "the collectives run during the backward pass". XLA:CPU's thunk executor runs
# independent thunks concurrently now and then: microseconds of overlap in a step's
# milliseconds of collectives, which vary from run to run and are not the overlap asked about.
PROFILE_MIN_FRACTION = 0.01
# Seconds per part (300 in all): a part over its budget skips its remaining items.
BUDGETS = {"conformance": 70.0, "selection": 60.0, "model": 80.0, "training": 60.0, "overlap": 30.0}

# Part 1. The tree every compressor updates: a matrix (PowerSGD compresses it), a vector
# that is not a multiple of any block size, and a leaf sent dense (<= MIN_DENSE).
RATIO = 0.1
MIN_DENSE = 6
TREE = {"w": (40, 26), "v": (1037,), "d": (6,)}
# Selectors that estimate their threshold from sums, and randomized quantizers: another
# backend's reduction order (or a fused multiply-add) may move an element across the
# threshold or a rounding boundary, so up to MISMATCH_TOLERANCE of the elements may differ.
ESTIMATED = (
    "ldte_bs",
    "binary_search",
    "dgc",
    "trimmed_top_k",
    "gaussian_k",
    "sidco",
    "qsgd",
    "qsgd_ef",
    "terngrad",
    "terngrad_clip_ef",
    "natural",
    "natural_dithering_ef",
)
MISMATCH_TOLERANCE = 0.01
RTOL = 1e-5
# Under shard_map, not a mean of the single-device updates: low rank (P and Q summed), a
# majority vote, per-device keys folded into the randomness, optimizers' Adam steps.
RANDOMIZED = ("random_k", "qsgd", "qsgd_ef", "terngrad", "terngrad_clip_ef", "natural",
              "natural_dithering_ef")  # fmt: skip
NOT_A_MEAN = ("powersgd", "signum", *RANDOMIZED, *presets.CONFORMANCE_OPTIMIZERS)

# Part 2: the LDTE-BS paper's Fig. 5 (eta = 1e-3).
SELECTION = ("ldte_bs", "ldte_bs_paper", "top_k", "approx_max_k", "sort_top_k", "chunked_top_k")

# Part 3: bench_model's trees and compressors (sgd: the plain update, the baseline).
MODEL_COMPRESSORS = ("sgd", "ldte_bs", "top_k", "qsgd", "powersgd")

# Part 4: (name, model, dataset) of the training runs; each dense and ldte_bs.
TRAINING = (("mlp_digits", "mlp", "digits"), ("resnet20_synthetic", "resnet20", "synthetic"))

# The sizes of a full run and of --small.
FULL = {
    "selection_log2": (20, 22, 24, 26),
    "repeats": 5,
    "model_trees": ("resnet20", "resnet50", "vgg16", "densenet121"),
    "model_steps": 5,
    "train_steps": 30,
    "batch": 128,
    "training": TRAINING,
    "overlap_model": "resnet20",
}
SMALL = {
    "selection_log2": (12, 14),
    "repeats": 5,
    "model_trees": ("small",),
    "model_steps": 2,
    "train_steps": 2,
    "batch": 16,
    "training": (("mlp_digits", "mlp", "digits"),),
    "overlap_model": "mlp",
}
# --small: one compressor per family (sparsifier, quantizer, low rank, optimizer).
SMALL_CONFORMANCE = ("ldte_bs", "qsgd", "powersgd", "onebit_adam")


class Budget:
    """A part's clock: ``over()`` once its seconds are spent; ``skip(item)`` records an item."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.start = time.perf_counter()
        self.skipped: list[str] = []

    def over(self) -> bool:
        return time.perf_counter() - self.start > self.seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return self.seconds - self.elapsed()


def _host(tree):
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x), np.float32), tree)


# --- part 1: conformance ----------------------------------------------------------------


def _grads(seed: int, lead: tuple = ()) -> dict:
    rng = np.random.default_rng(seed)
    return {k: rng.laplace(size=(*lead, *s)).astype(np.float32) for k, s in TREE.items()}


def _make(name: str, axis_name=None):
    if name in presets.CONFORMANCE_OPTIMIZERS:
        return presets.conformance_optimizer(name, axis_name, min_dense_size=MIN_DENSE)
    return presets.conformance_compressor(name, RATIO, axis_name, min_dense_size=MIN_DENSE)


def _params_arg(name: str, grads):
    """Optimizers take the parameters; compressors none."""
    if name in presets.CONFORMANCE_OPTIMIZERS:
        return jax.tree.map(jnp.zeros_like, grads)
    return None


def _compare(name: str, got: dict, want: dict) -> dict:
    """Elementwise agreement of two update trees (host float32)."""
    mismatched = total = 0
    max_diff = 0.0
    for leaf in want:
        a, b = got[leaf], want[leaf]
        scale = float(np.max(np.abs(b))) if b.size else 0.0
        close = np.isclose(a, b, rtol=RTOL, atol=RTOL * scale)
        mismatched += int(np.sum(~close))
        total += b.size
        if b.size:
            max_diff = max(max_diff, float(np.max(np.abs(a - b))))
    frac = mismatched / max(total, 1)
    tol = MISMATCH_TOLERANCE if name in ESTIMATED else 0.0
    return {
        "mismatch_fraction": frac,
        "max_abs_diff": max_diff,
        "tolerance": tol,
        "ok": frac <= tol,
    }


def _nothing_lost(name: str, g: dict, upd: dict, state) -> bool | None:
    """``sent + residual == g`` on the first step (``gradient_scale * g`` with GRACE's
    residual scaling; None: no residual, or an optimizer)."""
    if name in presets.CONFORMANCE_OPTIMIZERS:
        return None
    if presets.CONFORMANCE[name]["kwargs"].get("error_feedback") is False:
        return None  # memory-less by choice (top_k_no_ef): its residual stays zero
    res = optax.tree.get(state, "residual")
    if res is None:
        return None
    res = _host(res)
    # GRACE's residual scaling: the first step compresses gradient_scale * g.
    gamma = np.float32(presets.CONFORMANCE[name]["kwargs"].get("gradient_scale", 1.0))
    ok = True
    for leaf in g:
        sent, r, x = upd[leaf], res[leaf], gamma * np.asarray(g[leaf], np.float32)
        gap = np.abs((sent.astype(np.float64) + r) - x)
        ulp = np.spacing(np.abs(x - sent)).astype(np.float64)  # a quantizer's one rounding
        ok &= bool(np.all(gap <= ulp + np.spacing(np.abs(x))))
    return ok


def check_update(name: str, device, cpu) -> dict:
    """One update of ``name`` on ``device`` against the same on ``cpu`` (a row of part 1)."""
    tx = _make(name)
    g = _grads(0)
    row = {"name": name, "mode": "single"}
    t0 = time.perf_counter()
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))
    outs, compiled = {}, None
    for where, dev in (("device", device), ("cpu", cpu)):
        gd = jax.device_put(g, dev)
        args = (gd, jax.device_put(tx.init(gd), dev), jax.device_put(_params_arg(name, gd), dev))
        t1 = time.perf_counter()
        if where == "device" or device != cpu:  # on a CPU-only machine: one program, run twice
            compiled = update.lower(*args).compile()
        if where == "device":
            row["compile_s"] = time.perf_counter() - t1
        t1 = time.perf_counter()
        u, s = jax.block_until_ready(compiled(*args))
        if where == "device":
            row["run_ms"] = 1e3 * (time.perf_counter() - t1)
        outs[where] = (_host(u), s)
    u, s = outs["device"]
    row["finite"] = all(bool(np.all(np.isfinite(x))) for x in u.values())
    row["nothing_lost"] = _nothing_lost(name, g, u, s)
    row.update(_compare(name, u, outs["cpu"][0]))
    row["ok"] = row["ok"] and row["finite"] and row["nothing_lost"] is not False
    row["total_s"] = time.perf_counter() - t0
    return row


def check_shard_map(name: str, mesh, cpu) -> dict:
    """The update inside shard_map over ``mesh``: the same on every device, the mean of theirs."""
    n = mesh.size
    tx = _make(name, AXIS)
    g = _grads(1, (n,))
    params = _params_arg(name, {k: v[0] for k, v in g.items()})
    row = {"name": name, "mode": f"shard_map_{n}"}
    t0 = time.perf_counter()

    def step(g, s, p):
        u, s = tx.update(*jax.tree.map(lambda x: x[0], (g, s)), p)
        return jax.tree.map(lambda x: x[None], (u, s))

    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(AXIS), P(AXIS), P()),
                              out_specs=P(AXIS)))  # fmt: skip
    sharding = NamedSharding(mesh, P(AXIS))
    state = jax.tree.map(lambda x: jnp.stack([x] * n), tx.init({k: v[0] for k, v in g.items()}))
    args = (jax.device_put(g, sharding), jax.device_put(state, sharding), params)
    compiled = f.lower(*args).compile()
    row["compile_s"] = time.perf_counter() - t0
    t1 = time.perf_counter()
    u, _ = jax.block_until_ready(compiled(*args))
    row["run_ms"] = 1e3 * (time.perf_counter() - t1)
    u = _host(u)
    row["finite"] = all(bool(np.all(np.isfinite(x))) for x in u.values())
    row["same_on_every_device"] = all(
        np.array_equal(x[d], x[0], equal_nan=True) for x in u.values() for d in range(n)
    )
    ok = row["finite"] and row["same_on_every_device"]
    row["ok"] = ok
    if name not in NOT_A_MEAN:
        ref = _make(name)
        one = jax.jit(lambda g, s: ref.update(g, s))
        per_device = []
        for d in range(n):
            gd = jax.device_put({k: v[d] for k, v in g.items()}, cpu)
            per_device.append(_host(one(gd, jax.device_put(ref.init(gd), cpu))[0]))
        mean = {k: np.mean([p[k] for p in per_device], axis=0) for k in TREE}
        row.update(_compare(name, {k: v[0] for k, v in u.items()}, mean))
        row["ok"] = ok and row["ok"]
        row["reference"] = "mean of single-device updates on the host CPU"
    else:
        row["reference"] = "none (not a mean: low rank, vote, per-device keys or an optimizer)"
    row["total_s"] = time.perf_counter() - t0
    return row


def part_conformance(small: bool, budget: Budget) -> dict:
    names = list(presets.CONFORMANCE) + list(presets.CONFORMANCE_OPTIMIZERS)
    if small:
        names = [n for n in names if n in SMALL_CONFORMANCE]
    device, cpu = jax.devices()[0], jax.devices("cpu")[0]
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,)) if jax.device_count() > 1 else None
    rows = []
    for name in names:
        for mode in ("single", "shard_map") if mesh is not None else ("single",):
            if budget.over():
                budget.skipped.append(f"{name}:{mode}")
                continue
            try:
                row = check_update(name, device, cpu) if mode == "single" else (
                    check_shard_map(name, mesh, cpu))  # fmt: skip
            except Exception as e:  # noqa: BLE001 (a failure is the answer, reported per row)
                row = {"name": name, "mode": mode, "ok": False, "error": f"{type(e).__name__}: {e}"}
            rows.append(row)
    return {
        "rows": rows,
        "families": {
            "compressors": presets.CONFORMANCE,
            "optimizers": presets.CONFORMANCE_OPTIMIZERS,
        },
        "tree": TREE,
        "ratio": RATIO,
        "passed": sum(r["ok"] for r in rows),
        "failed": [f"{r['name']}:{r['mode']}" for r in rows if not r["ok"]],
    }


# --- part 2: selection --------------------------------------------------------------------


def _approx_max_k(x, k):
    """``lax.approx_max_k`` (TPU's fast top-k; exact elsewhere) as a threshold selector."""
    a = jnp.abs(x.astype(jnp.float32))
    v = jnp.min(jax.lax.approx_max_k(a, k)[0])
    t = jnp.where(v > 0, jnp.nextafter(v, jnp.float32(-jnp.inf)), jnp.float32(0))
    return selectors.Selection(t, kernels.count_above(a, t), jnp.int32(0))


def _selectors() -> dict[str, Callable]:
    return {
        name: _approx_max_k if name == "approx_max_k" else bench_selection.SELECTORS[name]
        for name in SELECTION
    }


def part_selection(sizes_log2: Sequence[int], repeats: int, budget: Budget) -> dict:
    rows = []
    methods = _selectors()
    cpu = jax.default_backend() == "cpu"
    for lg in sizes_log2:
        n = 2**lg
        x = jnp.asarray(bench_selection.make_data("laplace", n))
        k = selectors.target_count(bench_selection.ETA, n)
        row = {"log2_n": lg, "n": n, "k": k, "methods": {}}
        for name, select in methods.items():
            if budget.over():
                budget.skipped.append(f"{name}:2^{lg}")
                continue
            if name == "sort_top_k" and cpu and lg > bench_selection.SORT_MAX_LOG2:
                budget.skipped.append(f"{name}:2^{lg} (XLA:CPU sorts take seconds)")
                continue
            f = bench_selection.threshold_fn(select, k)
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            first = time.perf_counter() - t0
            # Fewer calls when the full median would not fit in what is left of the budget.
            reps = repeats if first * (repeats + 2) < budget.left() else 1
            ms = median_ms(f, x, warmup=2 if reps > 1 else 0, repeats=reps)
            t, count, _ = f(x)
            row["methods"][name] = {
                "ms": ms,
                "repeats": reps,
                "first_call_s": first,
                "count": int(count),
                "count_over_k": int(count) / k,
                "threshold": float(t),
            }
        base = row["methods"].get("top_k")
        for m in row["methods"].values():
            m["speedup_vs_top_k"] = base["ms"] / m["ms"] if base else None
        rows.append(row)
    return {"eta": bench_selection.ETA, "data": "laplace", "repeats": repeats, "rows": rows}


# --- part 3: model trees ---------------------------------------------------------------


def part_model(trees: Sequence[str], steps: int, out: str, small: bool, budget: Budget) -> dict:
    rows = []
    devices = [1] + ([jax.device_count()] if jax.device_count() > 1 and not small else [])
    keep = ("tree", "devices", "compressor", "leaves", "compile_s", "step_ms", "skipped_steps",
            "hlo")  # fmt: skip
    for i, tree in enumerate(trees):
        t_tree = time.perf_counter()
        for n_dev in devices:
            for name in MODEL_COMPRESSORS:
                if budget.over():
                    budget.skipped.append(f"{tree}:{n_dev}:{name}")
                    continue
                record = bench_model.run(
                    [tree], [name], ["tree"], [n_dev], steps=steps, warmup=1,
                    budget_s=max(budget.left(), 1.0),
                    outdir=os.path.join(out, "bench_model", f"{tree}_{n_dev}_{name}"),
                )  # fmt: skip
                rows += [{k: r[k] for k in keep} for r in record["rows"]]
        # The trees grow: one that would take twice this one's time is left out.
        if i + 1 < len(trees) and 2 * (time.perf_counter() - t_tree) > budget.left():
            budget.skipped += [f"{t} (the last tree took over half the budget left)"
                               for t in trees[i + 1 :]]  # fmt: skip
            break
    sgd = {(r["tree"], r["devices"]): r for r in rows if r["compressor"] == "sgd"}
    for r in rows:
        base = sgd.get((r["tree"], r["devices"]))
        for key, what in (("step_ms", "step"), ("compile_s", "compile")):
            ok = base and r[key] is not None and base[key]
            r[f"{what}_vs_sgd"] = r[key] / base[key] if ok else None
    return {"compressors": {c: bench_model.COMPRESSORS[c] for c in MODEL_COMPRESSORS}, "rows": rows}


# --- parts 4 and 5: training --------------------------------------------------------------


def _dataset(name: str, small: bool):
    if name == "digits":
        return data.load_digits()
    n = 256 if small else 2048
    return data.load_synthetic(num_train=n, num_test=64, shape=(32, 32, 3))


def _setup(model_name: str, dataset: str, compressor: str, mesh, batch: int, small: bool):
    ds = _dataset(dataset, small)
    model = models.make_model(model_name, ds.num_classes)
    params = model.init(jax.random.key(0), ds.train_x[:1])["params"]

    def loss_fn(p, b):
        logits = model.apply({"params": p}, b[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, b[1]).mean()

    opt = optax.sgd(0.05, momentum=0.9)
    if compressor == "dense":
        tx = optax.chain(jaxcomp.dense_exchange(AXIS), opt)
    else:
        tx = optax.chain(presets.build(presets.spec(compressor, ratio=0.01), AXIS), opt)
    placed = dist.replicate(params, mesh)
    state = dist.init_opt_state(tx, placed, mesh)
    batch = min(batch, len(ds.train_y)) // mesh.size * mesh.size

    def batches(i):
        lo = (i * batch) % (len(ds.train_y) - batch + 1)
        return dist.shard_batch((ds.train_x[lo : lo + batch], ds.train_y[lo : lo + batch]), mesh)

    return loss_fn, tx, placed, state, batches, sum(x.size for x in jax.tree.leaves(params))


def _train(model_name, dataset, compressor, mesh, steps, batch, small, budget) -> dict:
    loss_fn, tx, params, state, batches, n_params = _setup(
        model_name, dataset, compressor, mesh, batch, small
    )
    step = dist.make_train_step(loss_fn, tx, mesh)
    losses, times = [], []
    for i in range(steps + 1):  # the first call compiles
        if i > 2 and budget.over():  # the steps run so far are the measurement
            break
        t0 = time.perf_counter()
        params, state, metrics = jax.block_until_ready(step(params, state, batches(i)))
        times.append(time.perf_counter() - t0)
        losses.append(float(np.mean(metrics["loss"])))
    compile_s, times = times[0], times[1:]
    timer = dist.make_time_split(loss_fn, tx, mesh, train_step=step)
    # time_split runs three programs `repeats` times each: as many as the budget left allows.
    fit = int(budget.left() / (3 * statistics.median(times)))
    repeats = 1 if small else max(1, min(5, fit))
    split = timer(params, state, batches(0), repeats=repeats)
    return {
        "model": model_name,
        "dataset": dataset,
        "compressor": compressor,
        "params": int(n_params),
        "devices": mesh.size,
        "steps": len(times) + 1,
        "compile_s": compile_s,
        "step_ms": 1e3 * statistics.median(times),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "time_split_ms": {k: 1e3 * v for k, v in split._asdict().items()},
        "time_split_repeats": repeats,
    }


def part_training(cfg: dict, small: bool, budget: Budget) -> dict:
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    rows = []
    for name, model_name, dataset in cfg["training"]:
        for compressor in ("dense", "ldte_bs"):
            if budget.over():
                budget.skipped.append(f"{name}:{compressor}")
                continue
            rows.append(
                {"run": name}
                | _train(
                    model_name,
                    dataset,
                    compressor,
                    mesh,
                    cfg["train_steps"],
                    cfg["batch"],
                    small,
                    budget,
                )  # fmt: skip
            )
    return {"rows": rows, "ratio": 0.01}


# An HLO instruction's opcode (the word before its operands' parenthesis).
_OPCODE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s([a-z][\w\-]*)\(")
_MATMULS = ("dot", "convolution")


def collectives_during_backward(hlo_text: str) -> dict:
    """Whether a compiled step schedules collectives among its matmuls (the backward pass).

    Reads the ``ENTRY`` computation's instructions in their scheduled order
    (``compiled.as_text()``) and counts the matmuls (``dot``, ``convolution``:
    the forward and backward passes' layers) scheduled after the first
    collective (``bench_model.COLLECTIVES``, an async ``-start`` included).
    Above zero, a collective is issued while layers' gradients are still being
    computed: the backward pass and the exchange can overlap. Zero: every
    collective waits for the whole backward pass (XLA:CPU's schedule).

    Example:
      >>> text = '''ENTRY %main {
      ...   %a = f32[4,4]{1,0} dot(f32[4,4]{1,0} %p, f32[4,4]{1,0} %q)
      ...   %b = f32[4,4]{1,0} all-reduce-start(f32[4,4]{1,0} %a), to_apply=%add
      ...   %c = f32[4,4]{1,0} dot(f32[4,4]{1,0} %a, f32[4,4]{1,0} %q)
      ... }'''
      >>> collectives_during_backward(text)
      {'collectives': 1, 'matmuls': 2, 'matmuls_after_first_collective': 1, 'interleaved': True}
    """
    start = hlo_text.find("ENTRY")
    entry = hlo_text[start:].split("\n}", 1)[0].splitlines() if start >= 0 else []
    collectives = {*bench_model.COLLECTIVES, *(f"{c}-start" for c in bench_model.COLLECTIVES)}
    ops = []
    for line in entry:
        m = _OPCODE.match(line)
        if m and m.group(2) in collectives:
            ops.append("c")
        elif m and m.group(2) in _MATMULS:
            ops.append("x")
    first = ops.index("c") if "c" in ops else len(ops)
    after = ops[first:].count("x")
    return {
        "collectives": ops.count("c"),
        "matmuls": ops.count("x"),
        "matmuls_after_first_collective": after,
        "interleaved": after > 0,
    }


# An HLO instruction's name and opcode, in any computation of the module.
_NAMED = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([a-z][\w\-]*)\(")
_PROFILE_COLLECTIVES = frozenset(
    {*bench_model.COLLECTIVES}
    | {f"{c}-{end}" for c in bench_model.COLLECTIVES for end in ("start", "done")}
)
# Ops that compute (the layers' forward and backward work); the rest (copies,
# bitcasts, tuples, parameters, control flow) move or name data.
_COMPUTE = ("fusion", "dot", "convolution", "custom-call", "reduce", "sort", "scatter")
_PROFILE_EXAMPLES = 8  # overlapping collectives listed per variant


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """The total length of the intersection of two sorted lists of disjoint intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _opcodes(hlo_text: str) -> dict[str, str]:
    """Every instruction's name -> its opcode (a trace's op event names its instruction)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _NAMED.match(line)
        if m:
            out[m.group(1)] = m.group(3)
    return out


def collectives_overlap_in_profile(events: Sequence[dict], hlo_text: str) -> dict:
    """How long a step's collectives run at the same time as its compute ops, from a trace.

    ``events`` are Chrome-trace events (``jax.profiler.trace``'s
    ``*.trace.json.gz``). The op events are the complete (``"ph": "X"``) events
    whose ``args`` name an HLO instruction (``hlo_op``: XLA:CPU's thunk
    executor writes one per thunk, with ``device_ordinal`` and ``run_id``), of
    ``hlo_text``'s module when the event names one. Each is classified by its
    instruction's opcode in ``hlo_text`` (an unknown name: its stem before the
    first dot): a collective (all-reduce, all-gather, reduce-scatter,
    all-to-all, collective-permute, collective-broadcast, and their async
    ``-start``/``-done`` forms) or compute (fusion, dot, convolution,
    custom-call, reduce, sort, scatter); the rest is counted, not used. Per
    device and step (``device_ordinal``, ``run_id``), the union of the
    collectives' intervals is intersected with the union of the compute
    intervals: ``overlap_s`` sums that intersection over device-steps,
    ``collective_s`` the collectives' union (so ``overlap_s <= collective_s``),
    and ``overlap_fraction`` is their ratio (``None`` without collective time).
    ``available`` is false, with a ``reason``, when no event names an
    instruction.

    Example:
      >>> hlo = '''HloModule jit_step, is_scheduled=true
      ... ENTRY %main {
      ...   %dot.1 = f32[4]{0} dot(f32[4]{0} %p, f32[4]{0} %q)
      ...   %ar = f32[4]{0} all-reduce-start(f32[4]{0} %dot.1), to_apply=%add
      ... }'''
      >>> def op(name, ts, dur, tid=1):
      ...     args = {"hlo_op": name, "hlo_module": "jit_step", "device_ordinal": "0", "run_id": 7}
      ...     return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "args": args}
      >>> r = collectives_overlap_in_profile([op("dot.1", 0, 10), op("ar", 6, 8, tid=2)], hlo)
      >>> r["overlap_s"], r["collective_s"], r["overlap_fraction"], r["overlapping_collectives"]
      (4e-06, 8e-06, 0.5, 1)
    """
    opcodes = _opcodes(hlo_text)
    head = hlo_text.split("\n", 1)[0].replace(",", " ").split()
    module = head[1] if len(head) > 1 and head[0] == "HloModule" else None
    steps: dict[tuple, dict[str, list]] = {}
    seen = {"collective": 0, "compute": 0, "other": 0}
    for e in events:
        args = e.get("args") or {}
        name = args.get("hlo_op")
        if e.get("ph") != "X" or not name or "dur" not in e:
            continue
        if module and args.get("hlo_module", module) != module:
            continue
        opcode = opcodes.get(name, name.split(".")[0])
        if opcode in _PROFILE_COLLECTIVES:
            kind = "collective"
        elif opcode in _COMPUTE:
            kind = "compute"
        else:
            kind = "other"
        seen[kind] += 1
        if kind != "other":
            key = (str(args.get("device_ordinal", e.get("pid"))), str(args.get("run_id", "")))
            lo = float(e["ts"])  # microseconds
            ops = steps.setdefault(key, {"collective": [], "compute": []})
            ops[kind].append((lo, lo + float(e["dur"]), name))
    if not any(seen.values()):
        reason = "no trace event names an HLO instruction (hlo_op) of this program"
        return {"method": "profile", "available": False, "reason": reason}
    overlap_us = collective_us = 0.0
    overlapping, examples = 0, []
    for (device, _), ops in sorted(steps.items()):
        compute = _union([(lo, hi) for lo, hi, _ in ops["compute"]])
        coll = _union([(lo, hi) for lo, hi, _ in ops["collective"]])
        collective_us += sum(hi - lo for lo, hi in coll)
        overlap_us += _intersection(coll, compute)
        start = min(lo for lo, _, _ in ops["compute"] + ops["collective"])
        for lo, hi, name in ops["collective"]:
            o = _intersection([(lo, hi)], compute)
            if o > 0:
                overlapping += 1
                if len(examples) < _PROFILE_EXAMPLES:
                    examples.append({
                        "device": device,
                        "op": name,
                        "start_s": 1e-6 * (lo - start),
                        "end_s": 1e-6 * (hi - start),
                        "overlap_s": 1e-6 * o,
                    })  # fmt: skip
    overlap_us = min(overlap_us, collective_us)  # float rounding only
    return {
        "method": "profile",
        "available": True,
        "device_steps": len(steps),
        "op_events": seen,
        "collective_s": 1e-6 * collective_us,
        "overlap_s": 1e-6 * overlap_us,
        "overlap_fraction": overlap_us / collective_us if collective_us > 0 else None,
        "overlapping_collectives": overlapping,
        "overlapping_examples": examples,
    }


def _profile_step(step, params, state, batches, hlo_text: str, steps: int) -> dict:
    """Runs ``steps`` steps under ``jax.profiler.trace`` in a temporary directory, then reads it."""
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="jaxcomp_profile_") as d:
            with jax.profiler.trace(d):
                for i in range(steps):
                    params, state, _ = jax.block_until_ready(step(params, state, batches(i)))
            paths = glob.glob(os.path.join(d, "plugins", "profile", "*", "*.trace.json.gz"))
            events = []
            for path in paths:
                with gzip.open(path, "rt") as f:
                    trace = json.load(f)
                events += trace["traceEvents"] if isinstance(trace, dict) else trace
    except Exception as e:  # a profiler that cannot run is an answer to record
        return {"method": "profile", "available": False, "reason": f"{type(e).__name__}: {e}"}
    if not paths:
        return {"method": "profile", "available": False,
                "reason": "jax.profiler.trace wrote no *.trace.json.gz"}  # fmt: skip
    found = collectives_overlap_in_profile(events, hlo_text)
    return found | {"profiled_steps": steps, "elapsed_s": time.perf_counter() - t0}


def part_overlap(cfg: dict, small: bool, budget: Budget) -> dict:
    if jax.device_count() < 2:
        budget.skipped.append("one device")
        return {"rows": [], "reason": "one device: nothing to overlap"}
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    model_name = cfg["overlap_model"]
    dataset = "digits" if model_name == "mlp" else "synthetic"
    rows = []
    for overlap in (False, True):
        if budget.over():
            budget.skipped.append(f"overlap={overlap}")
            continue
        loss_fn, tx, params, state, batches, _ = _setup(
            model_name, dataset, "ldte_bs", mesh, cfg["batch"], small
        )
        step = dist.make_train_step(loss_fn, tx, mesh, overlap=overlap)
        t0 = time.perf_counter()
        params, state, _ = jax.block_until_ready(step(params, state, batches(0)))
        compile_s = time.perf_counter() - t0
        # The compiled step's own text (jit's cache: the program just run).
        hlo = step.lower(params, state, batches(0)).compile().as_text()
        schedule = collectives_during_backward(hlo)
        times = []
        for i in range(cfg["train_steps"]):
            t0 = time.perf_counter()
            params, state, _ = jax.block_until_ready(step(params, state, batches(i)))
            times.append(time.perf_counter() - t0)
        # Like the timed steps, a variant that ran is profiled even past the budget
        # (PROFILE_STEPS more steps): its answer is what the part is for.
        profile = _profile_step(step, params, state, batches, hlo, PROFILE_STEPS)
        rows.append({
            "overlap": overlap,
            "model": model_name,
            "compile_s": compile_s,
            "step_ms": 1e3 * statistics.median(times),
            "schedule": schedule,
            "profile": profile,
        })  # fmt: skip
    by = {r["overlap"]: r for r in rows}
    on = by.get(True)
    from_schedule = on["schedule"]["interleaved"] if on else None
    if on and on["profile"]["available"]:
        frac = on["profile"]["overlap_fraction"]
        method, during = "profile", frac is not None and frac >= PROFILE_MIN_FRACTION
    else:
        method, during = "hlo_schedule", from_schedule
    return {
        "rows": rows,
        "method": method,
        "overlap_speedup": (by[False]["step_ms"] / by[True]["step_ms"]) if len(by) == 2 else None,
        "collectives_during_backward": during,
        "schedule": {"method": "hlo_schedule", "collectives_during_backward": from_schedule},
    }


# --- the run -------------------------------------------------------------------------------


def _memory(device) -> dict:
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 (not every backend reports it)
        stats = None
    keep = ("bytes_limit", "bytes_in_use", "peak_bytes_in_use")
    host = None
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        host = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return {"device": {k: stats[k] for k in keep if k in stats} if stats else None,
            "host_bytes": host}  # fmt: skip


def _meta(small: bool, budgets: dict) -> dict:
    d = jax.devices()[0]
    import jaxlib  # noqa: PLC0415

    return {
        **environment(),
        "device_platform": d.platform,
        "device_kind": d.device_kind,
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": jaxlib.__version__,
        "memory": _memory(d),
        "small": small,
        "budgets_s": budgets,
    }


def run(out: str, *, small: bool = False, parts: Sequence[str] = PARTS, budgets=None) -> dict:
    """Runs the chosen parts, writes ``<out>/accelerator_check.json`` and a PNG per part."""
    budgets = {**BUDGETS, **(budgets or {})}
    cfg = SMALL if small else FULL
    os.makedirs(out, exist_ok=True)
    record = {"meta": _meta(small, budgets), "parts": {}}
    jobs = {
        "conformance": lambda b: part_conformance(small, b),
        "selection": lambda b: part_selection(cfg["selection_log2"], cfg["repeats"], b),
        "model": lambda b: part_model(cfg["model_trees"], cfg["model_steps"], out, small, b),
        "training": lambda b: part_training(cfg, small, b),
        "overlap": lambda b: part_overlap(cfg, small, b),
    }
    for part in parts:
        budget = Budget(budgets[part])
        print(f"[{part}] budget {budget.seconds:.0f} s", flush=True)
        try:
            result = jobs[part](budget)
        except Exception as e:  # noqa: BLE001 (reported; the other parts still run)
            result = {"error": f"{type(e).__name__}: {e}"}
        result.update(budget_s=budget.seconds, elapsed_s=budget.elapsed(), skipped=budget.skipped)
        record["parts"][part] = result
        with open(os.path.join(out, "accelerator_check.json"), "w") as f:
            jsonio.dump(record, f, indent=1)
        plot(part, result, os.path.join(out, f"{part}.png"))
    print(summary(record))
    return record


def plot(part: str, result: dict, path: str) -> None:
    """One PNG per part: what its rows measured (a note when it measured nothing)."""
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(9, 4.5), constrained_layout=True)
    rows = result.get("rows") or []
    if part == "selection" and any(r["methods"] for r in rows):
        for name in SELECTION:
            pts = [(r["n"], r["methods"][name]["ms"]) for r in rows if name in r["methods"]]
            if pts:
                ax.loglog(*zip(*pts, strict=True), "-o" if "ldte" in name else "--.", label=name)
        ax.set_xlabel("elements (float32)")
        ax.set_ylabel("median ms")
        ax.legend(fontsize="small")
    elif rows and part != "selection":
        if part == "conformance":
            labels = [f"{r['name']} ({r['mode']})" for r in rows]
            values = [r.get("compile_s") or 0.0 for r in rows]
            colors = ["tab:green" if r["ok"] else "tab:red" for r in rows]
            unit = "compile s (green: ok, red: failed)"
        elif part == "model":
            labels = [f"{r['tree']}/{r['devices']} {r['compressor']}" for r in rows]
            values = [r["step_ms"] or 0.0 for r in rows]
            colors = ["tab:gray" if r["compressor"] == "sgd" else "tab:blue" for r in rows]
            unit = "step ms (gray: plain SGD)"
        elif part == "training":
            labels = [f"{r['run']} {r['compressor']}" for r in rows]
            values = [r["step_ms"] for r in rows]
            colors = ["tab:gray" if r["compressor"] == "dense" else "tab:blue" for r in rows]
            unit = "step ms (gray: dense)"
        else:
            labels = [f"overlap={r['overlap']}" for r in rows]
            values = [r["step_ms"] for r in rows]
            colors = ["tab:blue"] * len(rows)
            unit = "step ms"
        ax.barh(range(len(rows)), values, color=colors)
        ax.set_yticks(range(len(rows)), labels, fontsize="x-small")
        ax.set_xlabel(unit)
    else:
        ax.text(0.5, 0.5, f"nothing measured: {result.get('reason') or result.get('error') or ''}",
                ha="center", transform=ax.transAxes)  # fmt: skip
    ax.set_title(f"{part} on {jax.devices()[0].device_kind} ({jax.__version__})")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary(record: dict) -> str:
    """The printed table: one block per part."""
    m, p = record["meta"], record["parts"]
    device = f"{m['device_kind']} x{m['device_count']} ({m['device_platform']})"
    lines = [f"{device}, jax {m['jax_version']}, jaxlib {m['jaxlib_version']}"]
    for part, r in p.items():
        head = f"[{part}] {r['elapsed_s']:.1f} s of {r['budget_s']:.0f}"
        head += f", skipped {len(r['skipped'])}" if r["skipped"] else ""
        lines.append(head + (f"  ERROR {r['error']}" if "error" in r else ""))
        if part == "conformance" and "rows" in r:
            lines.append(f"  {r['passed']}/{len(r['rows'])} ok; failed: {r['failed'] or 'none'}")
        elif part == "selection" and "rows" in r:
            for row in r["rows"]:
                cells = [f"{n} {v['ms']:.2f} ms ({v['count_over_k']:.2f}k)"
                         for n, v in row["methods"].items()]  # fmt: skip
                lines.append(f"  2^{row['log2_n']}: " + ", ".join(cells))
        elif part == "model" and "rows" in r:
            for row in r["rows"]:
                lines.append(
                    f"  {row['tree']:12s} {row['devices']} dev {row['compressor']:9s} compile "
                    f"{row['compile_s']:6.2f} s step {_f(row['step_ms'], '8.2f')} ms "
                    f"(x sgd {_f(row['step_vs_sgd'], '.2f')})"
                )
        elif part == "training" and "rows" in r:
            for row in r["rows"]:
                s = row["time_split_ms"]
                lines.append(
                    f"  {row['run']:20s} {row['compressor']:8s} step {row['step_ms']:8.2f} ms, "
                    f"fwd+bwd {s['forward_backward']:.2f} compress {s['compression']:.2f} "
                    f"comm {s['communication']:.2f} ms, loss {row['loss_first']:.3f} -> "
                    f"{row['loss_last']:.3f}"
                )
        elif part == "overlap" and r.get("rows"):
            for row in r["rows"]:
                prof = row.get("profile", {})
                seen = (
                    f"profile: {_f(prof['overlap_fraction'], '.1%')} of the collectives' "
                    f"{1e3 * prof['collective_s']:.2f} ms ({prof['device_steps']} device-steps) "
                    "overlaps compute"
                    if prof.get("available")
                    else f"no profile ({prof.get('reason', '-')})"
                )
                lines.append(
                    f"  overlap={row['overlap']!s:5s} step {row['step_ms']:.2f} ms, collectives "
                    f"among the compute in the schedule: {row['schedule']['interleaved']}; {seen}"
                )
    return "\n".join(lines)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("out", "results/accelerator_check", "Output directory.", **fv)
    flags.DEFINE_bool("small", False, "Tiny sizes: seconds on CPU (the tests run this).", **fv)
    flags.DEFINE_list("parts", list(PARTS), f"Parts to run, of {', '.join(PARTS)}.", **fv)
    flags.DEFINE_list(
        "budget_s", [], "Per-part seconds, e.g. selection:120,model:60 (defaults: BUDGETS).", **fv
    )
    cli.check_choices("parts", PARTS, flag_values)


def main(argv) -> dict:
    """Runs the check; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    budgets = {}
    for item in args.budget_s:
        part, _, seconds = item.partition(":")
        if part not in PARTS or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            cli.fail(f"--budget_s: part:seconds with a part of {', '.join(PARTS)}, got {item!r}")
        budgets[part] = float(seconds)
    return run(args.out, small=args.small, parts=args.parts, budgets=budgets)


if __name__ == "__main__":
    cli.run(main, define_flags)
