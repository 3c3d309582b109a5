r"""What a real model pays: the whole donated update on real parameter trees, per compressor.

For the parameter trees of real models (``experiments.models``: ResNet-20,
VGG-16, ResNet-50, DenseNet-121 at CIFAR's 32x32x3 input, 10 classes; shapes
from ``jax.eval_shape`` of ``model.init``, nothing is run) and each
compressor of ``COMPRESSORS`` (``optax.chain(compressor, optax.sgd(0.1))``),
it compiles and times the update a training step runs::

    update = jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=1)

with the optimizer state donated and threaded from step to step and a fixed
Laplacian gradient (float32, ``--seed``) kept. Per configuration (tree,
compressor, layout, devices) it records:

- ``compile_s``: seconds of ``update.lower(...).compile()`` (tracing and
  lowering, ``lower_s``, included): what the first step of a run waits;
- ``step_ms``: the median of ``--steps`` timed calls after ``--warmup``
  calls, each blocked on (with simulated devices more than one collective
  step in flight can deadlock, see docs/distributed.md);
- ``hlo``: from ``compiled.as_text()``, the ``while`` loops and the
  collectives (all-reduce, all-gather, reduce-scatter, all-to-all,
  collective-permute; an async ``-start``/``-done`` pair counts once) of the
  compiled program (:func:`count_hlo_ops`): each appears once in the text
  however often it runs.

Layouts: ``tree``, the model's parameter tree (tens to hundreds of leaves);
``flat``, one 1-D leaf with the tree's total element count (the same
gradient values, concatenated). PowerSGD compresses matrices: its flat leaf
is 2-D, ``(n // 1024, 1024)`` (the first ``1024 * (n // 1024)`` values, less
than 1024 fewer than the tree; ``leaf_shape`` in the row), and on the tree
it runs with ``reshape="last"`` (Flax's ``(kh, kw, in, out)`` kernels as
``(kh kw in, out)`` matrices; with the default ``"first"`` every
convolution would be sent dense).

The ``*_defer`` compressors (``defer_residual=True``: the accumulator and
the last message's mask instead of a written-out residual) exist on one
device only (``ONE_DEVICE``) and are skipped on ``N`` devices; the
``top_k_<exchange>`` ones differ from ``top_k`` in their exchange only
(``SEVERAL_DEVICES``) and are skipped on one device.

Devices (``--devices``): ``1``, the update alone on one device
(``axis_name=None``: the local compressed update, no exchange); ``N > 1``,
the same update inside ``jax.shard_map`` over a mesh axis ``"data"`` of
``N`` (simulated) devices, the compressor built with ``axis_name="data"``
(it exchanges and returns the average), the state per device stacked along a
leading axis (``jaxcomp.distributed.init_opt_state``), a different
gradient per device, the parameters replicated. The ``sgd`` baseline has no
compressor: on one device it is ``optax.sgd(0.1)`` alone; on ``N`` devices
``optax.chain(jaxcomp.dense_exchange("data"), optax.sgd(0.1))``, the
uncompressed data-parallel update (a dense all-reduce mean per leaf).

How to read the ratios (each from medians of the same run, ``null`` when
the other configuration was not run):

- ``step_vs_sgd`` / ``compile_vs_sgd``: against ``sgd`` on the same tree,
  layout and devices: the price of the compressor over the plain update
  (on ``N`` devices the dense all-reduce is part of the baseline);
- ``step_vs_flat`` / ``compile_vs_flat`` (``tree`` rows): against the same
  compressor on the flat leaf: what the tree's leaf count costs. Near 1 the
  compressor's cost does not grow with the number of leaves; a large
  ``compile_vs_flat`` (or ``while`` loops growing with the leaves) is work
  done per leaf. A compressor selecting per leaf (``granularity="layer"``,
  the default) also selects differently from one selection over the flat
  buffer, so the flat layout is the cost of the same work, not the same
  result.

Budget: ``--budget_s`` bounds each configuration's seconds. Compilation is
never interrupted (a compile alone may take minutes: ``ldte_bs`` per leaf
on ResNet-50 took ~145 s, with warm-up ratios ~8x that); once over the
budget the configuration's remaining warm-up and timed steps are skipped
and recorded (``skipped_steps``, ``over_budget``). To leave out whole
configurations, select with ``--trees``, ``--compressors``, ``--layouts``
and ``--devices``. The JSON is rewritten after every configuration, so an
interrupted run keeps what it measured.

Writes ``<outdir>/bench_model.json`` (every row, with the JAX version,
device count, date and command line in ``meta``) and
``<outdir>/bench_model.png`` (compile time and step time per compressor,
tree vs flat, the ``sgd`` baseline as lines, log scale), and prints the
table. JAX's persistent compilation cache is turned off while measuring
(compile times would be cache reads) unless ``--compilation_cache``.

Run::

    python -m experiments.bench_model --trees=resnet20 --compressors=sgd,ldte_bs,top_k \
        --devices=1
    python -m experiments.bench_model --small --outdir=/tmp/bench_model   # seconds

Flags: ``--trees`` (any of ``TREES``), ``--compressors`` (any of
``COMPRESSORS``), ``--layouts`` (``tree``, ``flat``), ``--devices`` (comma
list of device counts; the largest is simulated on CPU, set before JAX
starts), ``--steps``, ``--warmup``, ``--budget_s``, ``--seed``,
``--outdir``, ``--small`` (a smoke run: the 3-leaf ``small`` tree, ``sgd``
and ``ldte_bs``, 2 timed steps after 1 warm-up; flags given explicitly
override these), ``--compilation_cache``.
"""

from __future__ import annotations

import logging
import math
import os
import re
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from absl import flags
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxcomp
from experiments import cli, jsonio
from experiments.compare import set_cpu_devices
from experiments.models import make_model
from experiments.presets import build, spec
from experiments.timing import environment
from jaxcomp import distributed as dist

__all__ = [
    "COLLECTIVES",
    "COMPRESSORS",
    "LAYOUTS",
    "ONE_DEVICE",
    "SEVERAL_DEVICES",
    "TREES",
    "count_hlo_ops",
    "define_flags",
    "format_table",
    "main",
    "make_tx",
    "run",
    "tree_shapes",
]

AXIS = "data"
LR = 0.1
RATIO = 1e-3
FLAT_COLUMNS = 1024  # the 2-D flat leaf of the compressors in MATRIX_LEAF: (n // 1024, 1024)

# name -> preset (experiments.presets): built as getattr(jaxcomp, compressor)(**kwargs),
# with axis_name="data" on N devices. None: no compressor (the sgd baseline, see make_tx).
# DGC's warm-up: ratios 0.25, 0.0625, 0.015625, 0.004 for 100 steps each, then RATIO.
COMPRESSORS = {
    "sgd": None,
    "ldte_bs": spec("ldte_bs", ratio=RATIO),
    "ldte_bs_warmup": spec(
        "ldte_bs", ratio=RATIO, warmup_ratios=jaxcomp.DGC_WARMUP, steps_per_epoch=100
    ),
    "top_k": spec("top_k", ratio=RATIO),
    "dgc": spec("dgc", ratio=RATIO),
    "gaussian_k": spec("gaussian_k", ratio=RATIO),
    "trimmed_top_k": spec("trimmed_top_k", ratio=RATIO),
    "random_k": spec("random_k", ratio=RATIO),
    # The QSGD paper's "4-bit, bucket 512" (s = 16 levels); leaves <= 10_000 sent dense.
    "qsgd": spec("qsgd", bits=4, bucket_size=512),
    # reshape="last": Flax kernels (kh, kw, in, out) as (kh kw in, out) matrices.
    "powersgd": spec("powersgd", rank=4, reshape="last"),
    # PyTorch's batched_powerSGD_hook: each dtype's leaves as one square matrix.
    "powersgd_batched": spec("powersgd", rank=4, batched=True),
    # The per-leaf one with 16-bit P and Q all-reduces (half the bytes).
    "powersgd_bf16": spec("powersgd", rank=4, reshape="last", pq_dtype="bfloat16"),
    "ldte_bs_global": spec("ldte_bs", ratio=RATIO, granularity="global"),
    # The accumulator plus the last message's mask instead of a written-out residual.
    "ldte_bs_defer": spec("ldte_bs", ratio=RATIO, defer_residual=True),
    "top_k_defer": spec("top_k", ratio=RATIO, defer_residual=True),
    # The exchanges with merging rules of their own (gTop-k's pairwise top-k,
    # Ok-Topk's regions, SparCML's union or dense, ScaleCom's cyclic leader);
    # on one device they are top_k.
    "top_k_gtopk": spec("top_k", ratio=RATIO, exchange="gtopk"),
    "top_k_oktopk": spec("top_k", ratio=RATIO, exchange="oktopk"),
    "top_k_sparcml": spec("top_k", ratio=RATIO, exchange="sparcml"),
    "top_k_scalecom": spec("top_k", ratio=RATIO, exchange="scalecom"),
}
# Compressors for one device only (defer_residual has no exchange): skipped on N devices.
ONE_DEVICE = ("ldte_bs_defer", "top_k_defer")
# Compressors that differ from another only in their exchange: skipped on one device.
SEVERAL_DEVICES = ("top_k_gtopk", "top_k_oktopk", "top_k_sparcml", "top_k_scalecom")
# Compressors whose flat leaf is a matrix (FLAT_COLUMNS columns), not a vector.
MATRIX_LEAF = ("powersgd", "powersgd_bf16")
LAYOUTS = ("tree", "flat")
MODEL_TREES = ("resnet20", "vgg16", "resnet50", "densenet121")
# A tiny tree for --small (a conv kernel, a dense kernel and a bias; 21,056 elements: the
# flat PowerSGD leaf (20, 1024) is compressed, the tree's kernels too).
SMALL_TREE = {"conv": {"kernel": (3, 3, 16, 32)}, "dense": {"kernel": (256, 64), "bias": (64,)}}
TREES = (*MODEL_TREES, "mlp", "cnn", "resnet101", "densenet169", "small")
INPUT_SHAPE = (1, 32, 32, 3)  # CIFAR-shaped: every model of experiments.models takes it
NUM_CLASSES = 10

# HLO opcodes of the collectives, counted once each: the synchronous form and the
# "-start" of an async pair (its "-done" is not counted). An async-start wrapping a
# collective (calls=%computation) is counted by the collective inside that computation.
COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)
_ASYNC_START = {f"{op}-start": op for op in COLLECTIVES}
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s([a-z][\w\-]*)\(")


def count_hlo_ops(hlo_text: str) -> dict:
    """``while`` loops and collectives in an HLO module's text, every computation included.

    Each instruction counts once where it appears in the text (a collective
    inside a loop body once, however many iterations run); an async pair
    (``all-reduce-start`` / ``all-reduce-done``, ...) counts once, under the
    collective's name. Only instruction opcodes are matched, not names or
    metadata (``%while_body``, ``op_name="...while..."``).

    Args:
      hlo_text: ``compiled.as_text()`` (or ``lowered.as_text(dialect="hlo")``).

    Returns:
      ``{"while": w, "all-reduce": a, "all-gather": g, ..., "collectives":
      total}`` with one key per entry of ``COLLECTIVES`` and the total of
      the collectives.

    Example:
      >>> text = '''
      ... ENTRY %main (p: f32[4]) -> f32[4] {
      ...   %p = f32[4]{0} parameter(0)
      ...   %ars = f32[4]{0} all-reduce-start(f32[4]{0} %p), to_apply=%add
      ...   %ard = f32[4]{0} all-reduce-done(f32[4]{0} %ars)
      ...   ROOT %while.1 = (s32[], f32[4]{0}) while((s32[], f32[4]{0}) %t), body=%b
      ... }'''
      >>> c = count_hlo_ops(text)
      >>> c["while"], c["all-reduce"], c["collectives"]
      (1, 1, 1)
    """
    counts = dict.fromkeys(("while", *COLLECTIVES), 0)
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        op = _ASYNC_START.get(m.group(2), m.group(2))
        if op in counts:
            counts[op] += 1
    counts["collectives"] = sum(counts[op] for op in COLLECTIVES)
    return counts


def tree_shapes(name: str) -> dict:
    """The parameter shapes of a tree of ``TREES``: a pytree of ``jax.ShapeDtypeStruct``.

    Models come from ``experiments.models.make_model(name, 10)`` (GroupNorm),
    their ``params`` collection from ``jax.eval_shape`` of ``model.init`` on a
    ``(1, 32, 32, 3)`` input: no parameter is computed.
    """
    if name == "small":
        return jax.tree.map(
            lambda s: jax.ShapeDtypeStruct(s, jnp.float32),
            SMALL_TREE,
            is_leaf=lambda x: isinstance(x, tuple),
        )
    model = make_model(name, NUM_CLASSES)
    variables = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros(INPUT_SHAPE, jnp.float32))
    return variables["params"]


def make_tx(name: str, axis_name: str | None = None):
    """``optax.chain(compressor, optax.sgd(0.1))`` for a name of ``COMPRESSORS``.

    The compressor is ``experiments.presets.build(COMPRESSORS[name], axis_name)``;
    ``sgd`` (no compressor) is ``optax.sgd(0.1)`` alone on one device and
    ``jaxcomp.dense_exchange(axis_name)`` before it on several.
    """
    preset = COMPRESSORS[name]
    if preset is None:
        if axis_name is None:
            return optax.sgd(LR)
        return optax.chain(jaxcomp.dense_exchange(axis_name), optax.sgd(LR))
    return optax.chain(build(preset, axis_name), optax.sgd(LR))


def _layout_shapes(shapes, layout: str, compressor: str):
    """The gradient's pytree of shapes for a layout (flat: one leaf of the tree's size)."""
    if layout == "tree":
        return shapes
    n = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
    if compressor in MATRIX_LEAF and n >= FLAT_COLUMNS:
        shape = (n // FLAT_COLUMNS, FLAT_COLUMNS)
    else:
        shape = (n,)
    return {"flat": jax.ShapeDtypeStruct(shape, jnp.float32)}


def _gradients(shapes, total: int, seed: int, n_dev: int | None, mesh=None):
    """Laplacian float32 gradients shaped like ``shapes``; ``(n_dev, *shape)`` on a mesh.

    One Laplacian vector (per device) of ``total`` elements, the tree's size, is
    drawn and cut into the leaves in order, so the tree and flat layouts of a
    tree hold the same values (the matrix leaf: the first ``rows * 1024`` of them).
    """
    leaves, treedef = jax.tree.flatten(shapes)
    sizes = [math.prod(s.shape) for s in leaves]
    lead = () if n_dev is None else (n_dev,)

    def draw():
        keys = jax.random.split(jax.random.key(seed), n_dev or 1)
        flat = jax.vmap(lambda k: jax.random.laplace(k, (total,), jnp.float32))(keys)
        flat = flat if n_dev else flat[0]
        out, start = [], 0
        for s, size in zip(leaves, sizes, strict=True):
            out.append(flat[..., start : start + size].reshape(*lead, *s.shape))
            start += size
        return jax.tree.unflatten(treedef, out)

    if mesh is None:
        return jax.jit(draw)()
    sharding = NamedSharding(mesh, P(AXIS))
    return jax.jit(draw, out_shardings=jax.tree.unflatten(treedef, [sharding] * len(leaves)))()


def _program(tx, mesh):
    """The jitted update, state (argument 1) donated: alone, or under shard_map over ``mesh``."""
    if mesh is None:
        return jax.jit(lambda g, s, p: tx.update(g, s, p), donate_argnums=1)

    def per_device(grads, state, params):
        # The state and gradients arrive with a leading device axis of 1 (this device's row).
        row = lambda t: jax.tree.map(lambda x: x[0], t)  # noqa: E731
        updates, state = tx.update(row(grads), row(state), params)
        return updates, jax.tree.map(lambda x: x[None], state)

    return jax.jit(
        jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS), P()),
            out_specs=(P(), P(AXIS)),  # the update is the average: the same on every device
            check_vma=False,
        ),
        donate_argnums=1,
    )


def _measure(tree, compressor, layout, n_dev, shapes, *, steps, warmup, budget_s, seed) -> dict:
    """Compiles and times one configuration; returns its row (ratios added by ``run``)."""
    start = time.perf_counter()
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(shapes))
    g_shapes = _layout_shapes(shapes, layout, compressor)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), g_shapes)
    if n_dev == 1:
        mesh = None
        tx = make_tx(compressor)
        params = zeros
        state = jax.jit(tx.init)(params)
        grads = _gradients(g_shapes, total, seed, None)
    else:
        mesh = jax.make_mesh((n_dev,), (AXIS,), devices=jax.devices()[:n_dev])
        tx = make_tx(compressor, AXIS)
        params = dist.replicate(zeros, mesh)
        state = dist.init_opt_state(tx, params, mesh, AXIS)
        grads = _gradients(g_shapes, total, seed, n_dev, mesh)
    jax.block_until_ready((params, state, grads))
    leaves = jax.tree.leaves(g_shapes)
    row = {
        "tree": tree,
        "compressor": compressor,
        "layout": layout,
        "devices": n_dev,
        "leaves": len(leaves),
        "elements": int(sum(math.prod(s.shape) for s in leaves)),
        "leaf_shape": list(leaves[0].shape) if layout == "flat" else None,
    }
    update = _program(tx, mesh)
    t0 = time.perf_counter()
    lowered = update.lower(grads, state, params)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    row.update(lower_s=t1 - t0, compile_s=t2 - t0, hlo=count_hlo_ops(compiled.as_text()))
    del lowered
    # experiments.timing.median_ms_threaded's loop (every step blocked on, the donated
    # state threaded), with the budget checked before each call.
    times, done = [], 0
    for i in range(warmup + steps):
        if time.perf_counter() - start > budget_s:
            break
        t0 = time.perf_counter()
        _, state = jax.block_until_ready(compiled(grads, state, params))
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        done += 1
    row.update(
        warmup_steps=min(done, warmup),
        timed_steps=len(times),
        skipped_steps=warmup + steps - done,
        over_budget=done < warmup + steps,
        step_ms=1e3 * statistics.median(times) if times else None,
        total_s=time.perf_counter() - start,
    )
    return row


def _ratio(a, b):
    return a / b if a is not None and b else None


def _add_ratios(rows: list) -> None:
    """``step_vs_sgd``, ``compile_vs_sgd``, ``step_vs_flat``, ``compile_vs_flat`` per row."""
    index = {(r["tree"], r["devices"], r["layout"], r["compressor"]): r for r in rows}
    for r in rows:
        sgd = index.get((r["tree"], r["devices"], r["layout"], "sgd"))
        flat = index.get((r["tree"], r["devices"], "flat", r["compressor"]))
        if r["layout"] != "tree":
            flat = None
        for what in ("step", "compile"):
            key = "step_ms" if what == "step" else "compile_s"
            r[f"{what}_vs_sgd"] = _ratio(r[key], sgd and sgd[key])
            r[f"{what}_vs_flat"] = _ratio(r[key], flat and flat[key])


def _fmt(x, spec: str) -> str:
    """``format(x, spec)``, or ``-`` padded to the spec's width for a missing value."""
    width = re.match(r"\d*", spec).group()
    return format(x, spec) if x is not None else "-".rjust(int(width or 0))


def format_table(rows: list) -> str:
    """The printed table: one line per configuration, ratios as in the module docstring."""
    head = (
        f"{'tree':12s} {'dev':>3s} {'compressor':15s} {'layout':6s} {'leaves':>6s} "
        f"{'compile s':>9s} {'step ms':>9s} {'x sgd':>7s} {'x flat':>7s} {'cmp x flat':>10s} "
        f"{'while':>5s} {'coll':>5s}  skipped"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['tree']:12s} {r['devices']:3d} {r['compressor']:15s} {r['layout']:6s} "
            f"{r['leaves']:6d} {r['compile_s']:9.2f} {_fmt(r['step_ms'], '9.2f')} "
            f"{_fmt(r['step_vs_sgd'], '7.2f')} {_fmt(r['step_vs_flat'], '7.2f')} "
            f"{_fmt(r['compile_vs_flat'], '10.2f')} {r['hlo']['while']:5d} "
            f"{r['hlo']['collectives']:5d}  {r['skipped_steps'] or ''}"
        )
    return "\n".join(lines)


def _plot(record: dict, path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # absl shows INFO otherwise
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rows = record["rows"]
    panels = list(dict.fromkeys((r["tree"], r["devices"]) for r in rows))
    fig, axes = plt.subplots(
        len(panels), 2, figsize=(12, 3.2 * len(panels)), squeeze=False, constrained_layout=True
    )
    for (tree, n_dev), (ax_c, ax_s) in zip(panels, axes, strict=True):
        mine = [r for r in rows if r["tree"] == tree and r["devices"] == n_dev]
        names = [c for c in dict.fromkeys(r["compressor"] for r in mine) if c != "sgd"]
        names = names or ["sgd"]
        at = {(r["compressor"], r["layout"]): r for r in mine}
        leaves = max(r["leaves"] for r in mine)
        for ax, key, label in ((ax_c, "compile_s", "compile (s)"), (ax_s, "step_ms", "step (ms)")):
            width, drawn = 0.4, False
            for j, (layout, color) in enumerate((("tree", "tab:blue"), ("flat", "tab:orange"))):
                xs = [i + (j - 0.5) * width for i in range(len(names))]
                ys = [(at.get((c, layout)) or {}).get(key) for c in names]
                ax.bar(
                    [x for x, y in zip(xs, ys, strict=True) if y],
                    [y for y in ys if y],
                    width,
                    color=color,
                    label=layout,
                )
                sgd = (at.get(("sgd", layout)) or {}).get(key)
                if sgd:
                    ax.axhline(sgd, color=color, ls="--", lw=1, label=f"sgd ({layout})")
                drawn = drawn or bool(sgd) or any(ys)
            ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize="small")
            if drawn:  # every step skipped (over budget): nothing to scale
                ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "not measured (over budget)", transform=ax.transAxes,
                        ha="center")  # fmt: skip
            ax.set_ylabel(label)
            ax.set_title(f"{tree} ({leaves} leaves), {n_dev} device(s): {label}")
            ax.grid(True, axis="y", alpha=0.3)
        ax_c.legend(fontsize="x-small")
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _write(record: dict, outdir: Path, plot: bool) -> None:
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "bench_model.json").write_text(jsonio.dumps(record, indent=1))
    if plot:
        _plot(record, outdir / "bench_model.png")


def run(
    trees: Sequence[str],
    compressors: Sequence[str],
    layouts: Sequence[str],
    devices: Sequence[int],
    *,
    steps: int = 10,
    warmup: int = 2,
    budget_s: float = 300.0,
    seed: int = 0,
    outdir: str = "results/bench_model",
    command: Sequence[str] = (),
    compilation_cache: bool = False,
) -> dict:
    """Measures every selected configuration; writes the JSON and PNG; returns the record.

    The device count must already be set (``main`` does it before JAX starts):
    ``jax.device_count() >= max(devices)``.

    Returns:
      ``{"meta": {...}, "trees": {name: {"leaves", "params"}}, "rows": [...]}``,
      one row per (tree, devices, compressor, layout) in that nesting order.
    """
    if max(devices) > jax.device_count():
        raise ValueError(
            f"--devices={max(devices)} needs that many devices, JAX has {jax.device_count()} "
            "(on CPU the count is set before JAX starts; pass --devices to python -m)"
        )
    out = Path(outdir)
    meta = {
        **environment(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "device_count": jax.device_count(),
        "command": list(command),
        "steps": steps,
        "warmup": warmup,
        "budget_s": budget_s,
        "seed": seed,
        "ratio": RATIO,
        "lr": LR,
        "compressors": {c: COMPRESSORS[c] for c in compressors},
        "compilation_cache": compilation_cache,
    }
    record = {"meta": meta, "trees": {}, "rows": []}
    cache_was = jax.config.jax_enable_compilation_cache
    if not compilation_cache:
        jax.config.update("jax_enable_compilation_cache", False)
    try:
        for tree in trees:
            shapes = tree_shapes(tree)
            leaves = jax.tree.leaves(shapes)
            record["trees"][tree] = {
                "leaves": len(leaves),
                "params": int(sum(math.prod(s.shape) for s in leaves)),
            }
            for n_dev in devices:
                for compressor in compressors:
                    if n_dev > 1 and compressor in ONE_DEVICE:
                        continue
                    if n_dev == 1 and compressor in SEVERAL_DEVICES:
                        continue
                    for layout in layouts:
                        row = _measure(
                            tree, compressor, layout, n_dev, shapes,
                            steps=steps, warmup=warmup, budget_s=budget_s, seed=seed,
                        )  # fmt: skip
                        record["rows"].append(row)
                        _add_ratios(record["rows"])
                        print(
                            f"{tree} {n_dev} dev {compressor} {layout}: compile "
                            f"{row['compile_s']:.2f} s, step {_fmt(row['step_ms'], '.2f')} ms"
                            + (f", {row['skipped_steps']} steps skipped" if row["over_budget"]
                               else ""),
                            flush=True,
                        )  # fmt: skip
                        _write(record, out, plot=False)
    finally:
        jax.config.update("jax_enable_compilation_cache", cache_was)
    _write(record, out, plot=True)
    return record


# --- command line -----------------------------------------------------------------------

_SMALL = {
    "trees": ["small"],
    "compressors": ["sgd", "ldte_bs"],
    "steps": 2,
    "warmup": 1,
}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines this program's flags on ``flag_values`` (``main`` uses a fresh one)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_list("trees", list(MODEL_TREES), f"Parameter trees, of {TREES}.", **fv)
    flags.DEFINE_list("compressors", list(COMPRESSORS), "Names of COMPRESSORS.", **fv)
    flags.DEFINE_list("layouts", list(LAYOUTS), "tree and/or flat.", **fv)
    flags.DEFINE_list(
        "devices", ["1", "8"], "Device counts: 1 (alone) and/or N (shard_map, simulated).", **fv
    )
    flags.DEFINE_integer("steps", 10, "Timed steps per configuration (median).", **fv)
    flags.DEFINE_integer("warmup", 2, "Untimed steps before them.", **fv)
    flags.DEFINE_float(
        "budget_s", 300.0, "Seconds per configuration; over it, remaining steps are skipped.", **fv
    )
    flags.DEFINE_integer("seed", 0, "Seed of the Laplacian gradients.", **fv)
    flags.DEFINE_string("outdir", "results/bench_model", "Output directory.", **fv)
    flags.DEFINE_bool(
        "small", False, "Smoke run: the 3-leaf 'small' tree, sgd and ldte_bs, 1 warm-up and "
        "2 timed steps (flags given explicitly win).", **fv,
    )  # fmt: skip
    flags.DEFINE_bool(
        "compilation_cache", False, "Keep JAX's persistent compilation cache on.", **fv
    )
    for name, choices in (("trees", TREES), ("compressors", COMPRESSORS), ("layouts", LAYOUTS)):
        flags.register_validator(
            name,
            lambda v, choices=choices: bool(v) and all(x in choices for x in v),
            message=f"--{name}: a non-empty comma list of {', '.join(choices)}",
            flag_values=flag_values,
        )
    flags.register_validator(
        "devices",
        lambda v: bool(v) and all(x.strip().isdigit() and int(x) >= 1 for x in v),
        message="--devices: a comma list of device counts >= 1",
        flag_values=flag_values,
    )
    flags.register_validator(
        "steps", lambda v: v >= 1, message="--steps must be >= 1", flag_values=flag_values
    )
    flags.register_validator(
        "warmup", lambda v: v >= 0, message="--warmup must be >= 0", flag_values=flag_values
    )
    flags.register_validator(
        "budget_s", lambda v: v > 0, message="--budget_s must be > 0", flag_values=flag_values
    )


def _settings(fv: flags.FlagValues) -> dict:
    """The run's arguments from parsed flags, ``--small``'s defaults under explicit flags."""
    values = {
        "trees": list(fv.trees),
        "compressors": list(dict.fromkeys(fv.compressors)),
        "layouts": list(dict.fromkeys(fv.layouts)),
        "devices": [int(d) for d in dict.fromkeys(fv.devices)],
        "steps": fv.steps,
        "warmup": fv.warmup,
        "budget_s": fv.budget_s,
        "seed": fv.seed,
        "outdir": fv.outdir,
        "compilation_cache": fv.compilation_cache,
    }
    if fv.small:
        values.update({k: v for k, v in _SMALL.items() if not fv[k].present})
    return values


# XLA:CPU (jaxlib 0.10.2) deadlocks now and then executing the PowerSGD update on
# ResNet-50's tree (161 leaves) under its concurrency-optimized scheduler: every thread
# parked on a futex, 0% CPU, within the first ~10 steps (12 of 12 runs here; 80- and
# 120-leaf subsets, rank 1, resnet20 did not). With the scheduler off, 0 of 5 runs hung.
# Cause inside XLA not established (not jaxcomp: no params, chain, donation needed).
# It must be in XLA_FLAGS before JAX starts: compile(compiler_options=...) did not help.
CPU_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler=false"


def _set_cpu_scheduler() -> None:
    """Turns XLA:CPU's concurrency-optimized scheduler off unless ``XLA_FLAGS`` names it."""
    flags_now = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_enable_concurrency_optimized_scheduler" not in flags_now:
        os.environ["XLA_FLAGS"] = f"{flags_now} {CPU_SCHEDULER_FLAG}".strip()


def _set_devices(n: int) -> None:
    """At least ``n`` CPU devices, set before JAX starts (a device count already set stays)."""
    if n <= 1 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
        return
    try:
        set_cpu_devices(n)
    except RuntimeError:  # JAX already started here: run() checks the count it has
        pass


def main(argv: Sequence[str] | flags.FlagValues) -> None:
    """Runs the benchmark from a command line: prints the table, writes the JSON and PNG.

    Args:
      argv: a whole command line ``["bench_model", "--small", ...]`` (from
        Python: tests), or the parsed flags (as a program); see
        :mod:`experiments.cli`.
    """
    fv = cli.parse(define_flags, argv)
    settings = _settings(fv)
    _set_cpu_scheduler()  # read when the backend starts: a no-op if JAX already runs
    _set_devices(max(settings["devices"]))
    record = run(**settings, command=cli.command(argv))
    print(format_table(record["rows"]))
    print(f"JSON and plot: {os.path.join(settings['outdir'], 'bench_model.json')}, .png")


if __name__ == "__main__":
    cli.run(main, define_flags)
