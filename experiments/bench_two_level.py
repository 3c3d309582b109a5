"""Benchmark: bytes per link class of the two-level exchange, and what it costs a user.

On 8 simulated CPU devices arranged as ``nodes x local`` = 2x4 and 4x2 (the
mesh ``jax.make_mesh((nodes, L), ("node", "local"))`` of
:mod:`jaxcomp.transforms.two_level`), for two gradient trees (the parameter
tree of ResNet-20 from :mod:`experiments.models`, and one ``2048 x 2048``
leaf, ``2^22`` elements, for the headline ratio) and each method:

- ``dense``: the flat ring all-reduce (``jaxcomp.distributed.dense_exchange``
  on a 1-D mesh of the 8 devices, ``"data"``);
- ``dense_two_level``: reduce-scatter in the node, ring all-reduce over the
  nodes of the ``1/L`` shard, all-gather in the node, measured as the
  two-level wrapper around a compressor whose inner exchange is dense
  (``top_k(ratio=1, exchange="dense")``: sends every element);
- ``<c>_flat``: compressor ``c`` on the 1-D mesh of 8 devices; its measured
  ``wire_bytes`` split into link classes by the topology, the mean over the
  devices: an all-gather (top_k's sparse exchange, qsgd) sends ``N - 1``
  copies of a device's message, ``N - L`` of them to other nodes; a ring
  all-reduce (powersgd, dense) crosses nodes on ``nodes`` of its ``N`` links;
- ``<c>_two_level``: compressor ``c`` with ``axis_name=("node", "local")``,
  measured ``TwoLevelState.intra_node_bytes`` / ``inter_node_bytes``,

with ``c`` in ``top_k`` (ratio 1e-3, the sparse all-gather exchange),
``qsgd`` (4 bits, buckets of 512, every leaf quantized: ``min_dense_size=0``)
and ``powersgd`` (rank 4, ``reshape="last"``: Flax's ``(kh, kw, in, out)``
kernels as ``(kh kw in) x out`` matrices, whose rows the two-level shards keep
whole). Every measured byte count sits beside its formula, computed here from
the leaf shapes alone, with the ratio measured / formula.

The issue's targets (on 2x4, top_k at 1e-3, the 2^22 leaf): inter-node bytes
per device of the two-level sparse exchange at most 1/4 of the flat
all-gather's, and at least 100x under the dense ring all-reduce's.

What a user pays (2x4 against the flat 8-device mesh, top_k): compile time
(first call minus a step) and median step time of the whole jitted, donated
training step (``jaxcomp.distributed.make_train_step`` with ResNet-20's loss
on a small batch); the compile time of the two-level
wrapper alone on trees of 10 and 100 leaves of the same total size; and the
collective equations in its jaxpr by primitive and axis (one reduce-scatter
and one all-gather over ``"local"`` per dtype, whatever the leaf count).

Writes ``bench_two_level.json``, ``bench_two_level.png`` (bars of inter- and
intra-node bytes per method and mesh, log scale) and ``table.md`` (the
markdown table it prints) to ``--out``.

    python -m experiments.bench_two_level --out results/ [--small]

Times on simulated devices share the host's cores: a collective is a memory
copy, so the times track compute, not a network; the bytes are what a
network would carry.
"""

from __future__ import annotations

import os

N_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()

import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxcomp  # noqa: E402
from experiments import cli, jsonio, models  # noqa: E402
from experiments.steps import classifier_loss  # noqa: E402
from experiments.timing import environment  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402

__all__ = [
    "COMPRESSORS",
    "MESHES",
    "count_collectives",
    "define_flags",
    "formula_bytes",
    "main",
    "run",
    "tree_shapes",
]

MESHES = ((2, 4), (4, 2))  # (nodes, local)
COMPRESSORS = ("top_k", "qsgd", "powersgd")
RATIO = 1e-3
QSGD_BITS, QSGD_BUCKET = 4, 512
POWERSGD_RANK = 4
TWO = ("node", "local")
FLAT = "data"
F32 = 4  # bytes of a float32; a sparse pair is an int32 index and a float32 value
PAIR = 8


# ---------------------------------------------------------------------------
# The trees and the compressors.
# ---------------------------------------------------------------------------


def _resnet(small: bool):
    if small:  # one block per stage, narrow: 25 leaves
        return models.ResNet20(num_classes=10, blocks_per_stage=1, widths=(8, 16, 32))
    return models.ResNet20(num_classes=10)


def tree_shapes(small: bool) -> dict:
    """``{tree name: {leaf path: shape}}``: the model's parameters and the one big leaf."""
    variables = jax.eval_shape(
        _resnet(small).init, jax.random.key(0), jnp.zeros((1, 32, 32, 3), jnp.float32)
    )
    params = {
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_leaves_with_path(variables["params"])
    }
    side = 256 if small else 2048  # 2^16 or 2^22 elements
    return {"resnet20": params, f"leaf_2^{int(math.log2(side * side))}": {"w": (side, side)}}


def _compressor(name: str, axis_name):
    if name == "top_k":
        return jaxcomp.top_k(RATIO, axis_name=axis_name, exchange="sparse")
    if name == "qsgd":
        return jaxcomp.qsgd(
            bits=QSGD_BITS, bucket_size=QSGD_BUCKET, min_dense_size=0, axis_name=axis_name
        )
    if name == "powersgd":
        return jaxcomp.powersgd(POWERSGD_RANK, reshape="last", axis_name=axis_name)
    if name == "dense_two_level":  # the wrapper around an inner exchange that is dense
        return jaxcomp.top_k(1.0, axis_name=axis_name, exchange="dense")
    if name == "dense":
        return dist.dense_exchange(axis_name)
    raise ValueError(f"unknown method {name!r}")


# ---------------------------------------------------------------------------
# Formulas, from the shapes alone.
# ---------------------------------------------------------------------------


def _ring(nbytes: float, n: int) -> float:
    """Bytes one device sends in a ring all-reduce of ``nbytes`` over ``n`` devices."""
    return 2 * (n - 1) / n * nbytes


def _top_k_capacity(n: int, ratio: float) -> int:
    """Pairs in a leaf's message: ``k = max(1, ceil(ratio n))``, capacity ``ceil(1.5 k)``."""
    k = max(1, math.ceil(round(ratio * n, 9)))
    return min(n, max(k, math.ceil(1.5 * k)))


def _qsgd_message(n: int) -> int:
    """Packed codes (``bits + 2`` bits per value) plus a float32 scale per bucket."""
    code_bits = QSGD_BITS + 2
    return math.ceil(n * code_bits / 8) + F32 * math.ceil(n / QSGD_BUCKET)


def _powersgd_message(shape: tuple[int, ...]) -> int:
    """Bytes all-reduced for a leaf: ``P`` and ``Q`` if the leaf is compressed, else the leaf."""
    size = math.prod(shape)
    if len(shape) < 2:
        return F32 * size
    n, m = math.prod(shape[:-1]), shape[-1]  # reshape="last"
    r = min(n, m, POWERSGD_RANK)
    return F32 * (n + m) * r if 2 * (n + m) * r < n * m else F32 * size


def _powersgd_compresses(shape: tuple[int, ...]) -> bool:
    return _powersgd_message(shape) < F32 * math.prod(shape)


def _row_length(method: str, shape: tuple[int, ...]) -> int:
    """Elements a two-level shard keeps together (PowerSGD: a matrix row)."""
    return shape[-1] if method == "powersgd" and len(shape) >= 2 else 1


def _shard(method: str, shape: tuple[int, ...], local: int) -> tuple[int, ...]:
    """The shard of a leaf one of ``local`` devices owns: ``ceil(M / L)`` rows of ``R``."""
    r = _row_length(method, shape)
    rows = -(-math.prod(shape) // r // local)
    return (rows, r) if r > 1 else (rows,)


def _message_bytes(method: str, shapes, n_dev: int) -> float:
    """What the method's flat exchange over ``n_dev`` devices sends per device."""
    if method == "top_k":
        return (n_dev - 1) * sum(PAIR * _top_k_capacity(math.prod(s), RATIO) for s in shapes)
    if method == "qsgd":
        return (n_dev - 1) * sum(_qsgd_message(math.prod(s)) for s in shapes)
    if method == "powersgd":
        # With nonfinite="skip" a float32 device count rides in P's all-reduce.
        count = F32 if any(_powersgd_compresses(s) for s in shapes) else 0
        return _ring(sum(_powersgd_message(s) for s in shapes) + count, n_dev)
    if method in ("dense", "dense_two_level"):
        return _ring(sum(F32 * math.prod(s) for s in shapes), n_dev)
    raise ValueError(f"unknown method {method!r}")


def _split_flat(method: str, wire: float, nodes: int, local: int) -> tuple[float, float]:
    """``(intra, inter)``: a flat exchange's bytes per device by link class (device mean).

    An all-gather sends ``N - 1`` copies of each message, ``N - L`` to other
    nodes; a ring all-reduce over node-major devices crosses nodes on
    ``nodes`` of its ``N`` links.
    """
    n = nodes * local
    if method in ("top_k", "qsgd"):
        inter = wire * (n - local) / (n - 1)
    else:
        inter = wire * nodes / n
    return wire - inter, inter


def formula_bytes(method: str, shapes, nodes: int, local: int) -> dict:
    """Per-device bytes by link class that the formulas give, from the leaf shapes.

    Args:
      method: ``dense``, ``dense_two_level``, ``<c>_flat`` or ``<c>_two_level``
        for ``c`` in :data:`COMPRESSORS`.
      shapes: the leaves' shapes (float32).
      nodes, local: the mesh.

    Returns:
      ``{"intra": bytes, "inter": bytes}`` per device and step (flat methods:
      the mean over the devices).
    """
    shapes = [tuple(s) for s in shapes]
    if method == "dense" or method.endswith("_flat"):
        base = method.removesuffix("_flat")
        intra, inter = _split_flat(base, _message_bytes(base, shapes, nodes * local), nodes, local)
        return {"intra": intra, "inter": inter}
    base = "dense_two_level" if method == "dense_two_level" else method.removesuffix("_two_level")
    shards = [_shard(base, s, local) for s in shapes]
    padded = F32 * local * sum(math.prod(s) for s in shards)
    # Reduce-scatter and all-gather of the padded buffer: 2 (L - 1) / L of it.
    return {"intra": _ring(padded, local), "inter": _message_bytes(base, shards, nodes)}


# ---------------------------------------------------------------------------
# Measurements.
# ---------------------------------------------------------------------------


def _grads(shapes: dict, mesh, axes, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    g = {k: rng.normal(size=(mesh.size, *s)).astype(np.float32) for k, s in shapes.items()}
    return jax.device_put(g, NamedSharding(mesh, P(axes)))


def _update_fn(tx, mesh, axes):
    """jit(shard_map) of one ``tx.init`` + ``tx.update``: the state per device."""

    def step(g):
        g = jax.tree.map(lambda x: x[0], g)
        _, state = tx.update(g, tx.init(g))
        return jax.tree.map(lambda x: jnp.asarray(x)[None], state)

    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False)
    )


def _per_device(x) -> float:
    """The per-device value of a state field, checked to agree on every device."""
    v = np.asarray(x, np.float64).reshape(-1)
    if not np.all(v == v[0]):
        raise AssertionError(f"bytes differ across devices: {v}")
    return float(v[0])


def _measure(method: str, shapes: dict, nodes: int, local: int) -> dict:
    """Measured ``{"intra", "inter"}`` bytes per device of one method on one mesh."""
    flat = method == "dense" or method.endswith("_flat")
    base = method.removesuffix("_flat").removesuffix("_two_level")
    if method == "dense_two_level":
        base = method
    if flat:
        mesh = jax.make_mesh((nodes * local,), (FLAT,))
        state = _update_fn(_compressor(base, FLAT), mesh, FLAT)(_grads(shapes, mesh, FLAT))
        wire = _per_device(optax.tree.get(state, "wire_bytes"))
        intra, inter = _split_flat(base, wire, nodes, local)
        return {"intra": intra, "inter": inter, "wire": wire}
    mesh = jax.make_mesh((nodes, local), TWO)
    state = _update_fn(_compressor(base, TWO), mesh, TWO)(_grads(shapes, mesh, TWO))
    return {
        "intra": _per_device(state.intra_node_bytes),
        "inter": _per_device(state.inter_node_bytes),
    }


def _methods() -> list[str]:
    return (
        ["dense", "dense_two_level"]
        + [f"{c}_flat" for c in COMPRESSORS]
        + [f"{c}_two_level" for c in COMPRESSORS]
    )


def _bytes_rows(trees: dict) -> list[dict]:
    rows = []
    for tree, shapes in trees.items():
        flat_cache: dict = {}
        for nodes, local in MESHES:
            for method in _methods():
                flat = method == "dense" or method.endswith("_flat")
                if flat and method in flat_cache:  # the 1-D run does not depend on the mesh
                    wire = flat_cache[method]["wire"]
                    intra, inter = _split_flat(method.removesuffix("_flat"), wire, nodes, local)
                    got = {"intra": intra, "inter": inter, "wire": wire}
                else:
                    got = _measure(method, shapes, nodes, local)
                    if flat:
                        flat_cache[method] = got
                want = formula_bytes(method, shapes.values(), nodes, local)
                row = {"tree": tree, "mesh": f"{nodes}x{local}", "method": method}
                for cls in ("intra", "inter"):
                    row[f"{cls}_bytes"] = got[cls]
                    row[f"{cls}_formula"] = want[cls]
                    row[f"{cls}_ratio"] = got[cls] / want[cls] if want[cls] else 1.0
                if "wire" in got:
                    row["flat_wire_bytes"] = got["wire"]
                rows.append(row)
    return rows


def _targets(rows: list[dict], tree: str) -> dict:
    def inter(method):
        return next(
            r["inter_bytes"]
            for r in rows
            if r["tree"] == tree and r["mesh"] == "2x4" and r["method"] == method
        )

    sparse = inter("top_k_two_level")
    return {
        "tree": tree,
        "two_level_over_flat_allgather": sparse / inter("top_k_flat"),
        "dense_ring_over_two_level": inter("dense") / sparse,
        "dense_two_level_over_two_level": inter("dense_two_level") / sparse,
        "inter_two_level<=flat_allgather/4": sparse <= inter("top_k_flat") / 4,
        "inter_two_level*100<=dense_ring": 100 * sparse <= inter("dense"),
    }


# ---------------------------------------------------------------------------
# What a user pays: the training step, compile time against the leaf count.
# ---------------------------------------------------------------------------


def _time_step(step, state, batch, repeats: int) -> dict:
    """First call (trace + compile + one step) and the median of ``repeats`` donated steps."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(step(*state, batch))
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats + 1):  # the first repeat warms up
        state = out[:2]
        t0 = time.perf_counter()
        out = jax.block_until_ready(step(*state, batch))
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times[1:])
    row = {"first_call_s": first, "compile_s": first - step_s, "step_ms": 1e3 * step_s}
    if isinstance(out[2], dict) and "wire_bytes" in out[2]:  # make_train_step's metrics
        row["metrics_wire_bytes"] = float(np.asarray(out[2]["wire_bytes"]).ravel()[0])
    return row


def _user_cost(small: bool, repeats: int) -> dict:
    """Flat (8 devices) vs two-level (2x4) top_k: the whole training step."""
    model = _resnet(small)
    loss = classifier_loss(model)
    per_device = 2 if small else 4
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N_DEVICES * per_device, 32, 32, 3)).astype(np.float32)
    y = rng.integers(0, 10, N_DEVICES * per_device).astype(np.int32)
    init = model.init(jax.random.key(0), x[:1])["params"]
    rows = {}
    for name, shape, axes in (("flat", (N_DEVICES,), FLAT), ("two_level", (2, 4), TWO)):
        mesh = jax.make_mesh(shape, axes if isinstance(axes, tuple) else (axes,))
        tx = optax.chain(_compressor("top_k", axes), optax.sgd(0.1))
        batch = jax.device_put((x, y), NamedSharding(mesh, P(axes)))
        # "error": a leaf the compressor did not exchange would be averaged densely
        # before it, and the step would no longer be the two-level exchange alone.
        step = dist.make_train_step(loss, tx, mesh, axes, unexchanged="error")
        state = (dist.replicate(init, mesh), dist.init_opt_state(tx, init, mesh, axes))
        rows[name] = {"step_kind": "make_train_step", **_time_step(step, state, batch, repeats)}
    ratios = {
        f"two_level_over_flat_{k}": rows["two_level"][k] / rows["flat"][k]
        for k in ("compile_s", "step_ms")
    }
    n_params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(init))
    meta = {"leaves": len(jax.tree.leaves(init)), "params": n_params, "batch": len(x)}
    return {**meta, "repeats": repeats, **rows, **ratios}


def count_collectives(jaxpr) -> dict:
    """``{"primitive@axes": count}`` of the collective equations in a jaxpr, at any depth."""
    counts: dict = {}

    def names(v):
        v = (v,) if isinstance(v, str) else v
        return v if isinstance(v, tuple) and v and all(isinstance(a, str) for a in v) else None

    def walk(j):
        for eqn in j.eqns:
            axes = names(eqn.params.get("axis_name", eqn.params.get("axes")))
            if axes is not None:
                key = f"{eqn.primitive.name}@{','.join(axes)}"
                counts[key] = counts.get(key, 0) + 1
            for v in eqn.params.values():
                for sub in v if isinstance(v, tuple | list) else (v,):
                    if hasattr(sub, "eqns"):
                        walk(sub)
                    elif hasattr(sub, "jaxpr") and hasattr(sub.jaxpr, "eqns"):
                        walk(sub.jaxpr)

    walk(jaxpr.jaxpr if hasattr(jaxpr, "jaxpr") else jaxpr)
    return dict(sorted(counts.items()))


def _leaf_count_cost(total: int, compiles: int, leaf_counts=(10, 100)) -> dict:
    """Compile time of ``tx.update`` (flat and two-level top_k) on trees of equal total size.

    The median of ``compiles`` compilations, each of a new function (trace, lower and
    compile; JAX's persistent compilation cache, on in the tests, would serve repeats).
    """
    out = {"total_elements": total, "compiles": compiles}
    for n_leaves in leaf_counts:
        shapes = {f"l{i:03d}": (total // n_leaves,) for i in range(n_leaves)}
        row = {}
        for name, shape, axes in (("flat", (N_DEVICES,), FLAT), ("two_level", (2, 4), TWO)):
            mesh = jax.make_mesh(shape, axes if isinstance(axes, tuple) else (axes,))
            grads = _grads(shapes, mesh, axes)
            times = []
            for _ in range(compiles):
                # A new function each time: jit would serve the same one from its cache.
                fn = _update_fn(_compressor("top_k", axes), mesh, axes)
                t0 = time.perf_counter()
                fn.lower(grads).compile()
                times.append(time.perf_counter() - t0)
            row[f"{name}_compile_s"] = statistics.median(times)
            row[f"{name}_collectives"] = count_collectives(jax.make_jaxpr(fn)(grads))
        out[f"{n_leaves}_leaves"] = row
    a, b = (out[f"{n}_leaves"] for n in leaf_counts)
    for name in ("flat", "two_level"):
        out[f"{name}_compile_growth"] = b[f"{name}_compile_s"] / a[f"{name}_compile_s"]
    return out


# ---------------------------------------------------------------------------
# Output.
# ---------------------------------------------------------------------------


def _table(rows: list[dict]) -> str:
    head = (
        "| tree | mesh | method | intra-node B/device | formula | inter-node B/device | formula "
        "| inter vs dense ring |\n|---|---|---|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        dense = next(
            d["inter_bytes"]
            for d in rows
            if d["tree"] == r["tree"] and d["mesh"] == r["mesh"] and d["method"] == "dense"
        )
        lines.append(
            f"| {r['tree']} | {r['mesh']} | {r['method']} | {r['intra_bytes']:,.0f} | "
            f"{r['intra_formula']:,.0f} | {r['inter_bytes']:,.0f} | {r['inter_formula']:,.0f} | "
            f"{dense / r['inter_bytes']:,.1f}x |"
        )
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    trees = list(dict.fromkeys(r["tree"] for r in rows))
    meshes = [f"{n}x{m}" for n, m in MESHES]
    methods = _methods()
    fig, axes = plt.subplots(len(trees), len(meshes), figsize=(12, 3.6 * len(trees)), squeeze=False)
    x = np.arange(len(methods))
    for i, tree in enumerate(trees):
        for j, mesh in enumerate(meshes):
            ax = axes[i][j]
            sel = {r["method"]: r for r in rows if r["tree"] == tree and r["mesh"] == mesh}
            for off, cls, color in ((-0.2, "inter", "tab:red"), (0.2, "intra", "tab:blue")):
                vals = [max(sel[m][f"{cls}_bytes"], 1.0) for m in methods]
                ax.bar(x + off, vals, 0.4, color=color, label=f"{cls}-node")
            ax.set_yscale("log")
            ax.set_xticks(x, methods, rotation=35, ha="right", fontsize=7)
            ax.set_title(f"{tree}, {mesh} (nodes x local)", fontsize=9)
            ax.set_ylabel("bytes per device per step")
            ax.grid(True, axis="y", which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(small: bool, repeats: int, out_dir: str | Path) -> dict:
    """Measures everything, writes the JSON, the PNG and ``table.md``; returns the JSON's dict."""
    if jax.device_count() < N_DEVICES:
        raise RuntimeError(
            f"needs {N_DEVICES} devices (XLA_FLAGS=--xla_force_host_platform_device_count="
            f"{N_DEVICES} before JAX starts), found {jax.device_count()}"
        )
    trees = tree_shapes(small)
    rows = _bytes_rows(trees)
    headline = next(t for t in trees if t.startswith("leaf_"))
    result = {
        "meta": {
            "small": small,
            "ratio": RATIO,
            "qsgd": {"bits": QSGD_BITS, "bucket_size": QSGD_BUCKET, "min_dense_size": 0},
            "powersgd": {"rank": POWERSGD_RANK, "reshape": "last"},
            "meshes": [f"{n}x{m}" for n, m in MESHES],
            "trees": {
                k: {"leaves": len(v), "elements": sum(map(math.prod, v.values()))}
                for k, v in trees.items()
            },  # fmt: skip
            **environment(),
        },
        "bytes": rows,
        "targets": _targets(rows, headline),
        "targets_model_tree": _targets(rows, "resnet20"),
        "user_cost": _user_cost(small, repeats),
        "leaf_count": _leaf_count_cost(100 * (2**10 if small else 2**14), 1 if small else 3),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = _table(rows)
    (out / "table.md").write_text(table)
    (out / "bench_two_level.json").write_text(jsonio.dumps(result, indent=1))
    _plot(rows, out / "bench_two_level.png")
    return result


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("out", "results", "Output directory.", **fv)
    flags.DEFINE_bool("small", False, "Small trees and model, few repeats (the test).", **fv)
    flags.DEFINE_integer("repeats", 7, "Timed training steps (median; at least 3).", **fv)


def main(argv) -> dict:
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    if args.repeats < 3:
        cli.fail("--repeats must be >= 3 (medians of at least 3 steps)")
    result = run(args.small, args.repeats, args.out)
    print((Path(args.out) / "table.md").read_text())
    for key in ("targets", "targets_model_tree"):
        print(f"{key}:", result[key])
    cost = result["user_cost"]
    for name in ("flat", "two_level"):
        r = cost[name]
        print(f"{name:10s} compile {r['compile_s']:6.2f} s  step {r['step_ms']:8.1f} ms  "
              f"({r['step_kind']})")  # fmt: skip
    print(
        f"two-level / flat: compile {cost['two_level_over_flat_compile_s']:.2f}x, "
        f"step {cost['two_level_over_flat_step_ms']:.2f}x"
    )
    lc = result["leaf_count"]
    for key in ("10_leaves", "100_leaves"):
        r = lc[key]
        print(
            f"{key}: compile flat {r['flat_compile_s']:.2f} s, two-level "
            f"{r['two_level_compile_s']:.2f} s; collectives {r['two_level_collectives']}"
        )
    print(f"wrote {args.out}/bench_two_level.json, bench_two_level.png and table.md")
    return result


if __name__ == "__main__":
    cli.run(main, define_flags)
