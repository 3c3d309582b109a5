"""Benchmark: what a user pays for one whole data-parallel train step.

``jaxcomp.distributed.make_train_step`` (forward, backward, compress, exchange,
optimizer, parameter update: one ``jit(shard_map(...))``) on an MLP over 4
simulated CPU devices, per configuration:

- ``dense``: ``dense_exchange`` + SGD, the uncompressed baseline;
- ``ldte_bs``: ``jaxcomp.ldte_bs(ratio, axis_name="data")`` + SGD;
- ``ldte_bs_masked``: the compressor on the weight matrices only
  (``optax.masked``); the biases are the un-exchanged leaves the step finds at
  trace time and averages with a dense all-reduce before ``tx``;
- each also with ``donate=False``: parameters and optimizer state copied
  instead of updated in place (the cost donation saves);
- ``ldte_bs_update_only``: just ``tx.update`` under ``shard_map`` (state
  donated), the compressor's kernel share of the whole step;
- ``ldte_bs_overlap``: ``ldte_bs`` with ``make_train_step(overlap=True)``,
  the compressor inside the backward pass (same result; on XLA:CPU
  collectives are synchronous and the scheduler keeps them after the
  backward, so this measures the cost of the mechanism, not real overlap).

Times are medians after warm-up with every step blocked on; ratios are
against ``dense`` (donated) measured in the same run. Writes
``bench_train_step.json`` and ``bench_train_step.png`` to ``--out``.

    python -m experiments.bench_train_step --out results/ [--width 1024]

Simulated devices: 4 unless ``XLA_FLAGS`` already sets
``--xla_force_host_platform_device_count`` (e.g. 8).
"""

from __future__ import annotations

import os

N_DEVICES = 4
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()

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
from experiments import cli, jsonio  # noqa: E402
from experiments.timing import environment, median_ms_threaded  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402

__all__ = ["define_flags", "main", "run"]

AXIS = "data"


def _params(width: int, depth: int, d_in: int, d_out: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    dims = [d_in] + [width] * depth + [d_out]
    return {
        f"layer{i}": {
            "w": jnp.asarray(rng.normal(0, 1 / np.sqrt(a), (a, b)), jnp.float32),
            "b": jnp.zeros((b,), jnp.float32),
        }
        for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True))
    }


def _loss(params, batch):
    x, y = batch
    for i in range(len(params)):
        layer = params[f"layer{i}"]
        x = x @ layer["w"] + layer["b"]
        if i < len(params) - 1:
            x = jax.nn.relu(x)
    return optax.softmax_cross_entropy_with_integer_labels(x, y).mean()


def _optimizers(ratio: float) -> dict:
    sgd = optax.sgd(0.05)
    weights_only = lambda p: jax.tree.map_with_path(  # noqa: E731
        lambda path, _: path[-1].key == "w", p
    )
    return {
        "dense": optax.chain(dist.dense_exchange(AXIS), sgd),
        "ldte_bs": optax.chain(jaxcomp.ldte_bs(ratio, axis_name=AXIS), sgd),
        "ldte_bs_masked": optax.chain(
            optax.masked(jaxcomp.ldte_bs(ratio, axis_name=AXIS), weights_only), sgd
        ),
    }


def run(width: int, depth: int, ratio: float, repeats: int, out_dir: str) -> dict:
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    n_dev = mesh.shape[AXIS]
    d_in, d_out, per_device = 784, 10, 32
    init = _params(width, depth, d_in, d_out)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(per_device * n_dev, d_in)).astype(np.float32)
    y = rng.integers(0, d_out, per_device * n_dev).astype(np.int32)
    batch = dist.shard_batch((x, y), mesh)
    num_params = sum(v.size for v in jax.tree.leaves(init))
    rows = {}
    variants = [(name, tx, donate, False) for name, tx in _optimizers(ratio).items()
                for donate in (True, False)]  # fmt: skip
    variants.append(("ldte_bs", _optimizers(ratio)["ldte_bs"], True, True))
    for name, tx, donate, overlap in variants:
        step = dist.make_train_step(_loss, tx, mesh, AXIS, donate=donate, overlap=overlap)
        state = (dist.replicate(init, mesh), dist.init_opt_state(tx, init, mesh))
        t0 = time.perf_counter()
        out = jax.block_until_ready(step(*state, batch))
        compile_s = time.perf_counter() - t0
        ms = median_ms_threaded(
            lambda s, b, step=step: step(*s, b),
            out[:2],
            batch,
            next_state=lambda o: o[:2],
            repeats=repeats,
        )
        key = name if donate else f"{name}_not_donated"
        key = f"{key}_overlap" if overlap else key
        rows[key] = {
            "step_ms": ms,
            "first_call_s": compile_s,
            "wire_bytes": int(np.asarray(out[2]["wire_bytes"]).ravel()[0]),
            "unexchanged_leaves": len(dist.unexchanged_leaves(tx, init, mesh)),
        }
    # The compressor alone: tx.update under shard_map on ready per-device gradients.
    tx = _optimizers(ratio)["ldte_bs"]
    sharding = NamedSharding(mesh, P(AXIS))
    grads = jax.device_put(
        jax.tree.map(lambda p: jnp.asarray(rng.laplace(size=(n_dev, *p.shape)), p.dtype), init),
        sharding,
    )

    def update_only(state, g):
        first = lambda t: jax.tree.map(lambda v: v[0], t)  # noqa: E731
        _, new_state = tx.update(first(g), first(state))
        return jax.tree.map(lambda v: v[None], new_state)

    update = jax.jit(
        jax.shard_map(
            update_only,
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS)),
            out_specs=P(AXIS),
            check_vma=False,
        ),
        donate_argnums=0,
    )
    state = dist.init_opt_state(tx, init, mesh)
    rows["ldte_bs_update_only"] = {
        "step_ms": median_ms_threaded(update, state, grads, repeats=repeats)
    }
    base = rows["dense"]["step_ms"]
    for row in rows.values():
        row["vs_dense"] = row["step_ms"] / base
    rows["ldte_bs_overlap"]["vs_after_backward"] = (
        rows["ldte_bs_overlap"]["step_ms"] / rows["ldte_bs"]["step_ms"]
    )
    for name in _optimizers(ratio):
        rows[name]["donation_saves"] = (
            1 - rows[name]["step_ms"] / rows[f"{name}_not_donated"]["step_ms"]
        )
    meta = {
        "devices": n_dev,
        "width": width,
        "depth": depth,
        "num_params": int(num_params),
        "ratio": ratio,
        "repeats": repeats,
        **environment(),
    }
    for name, row in rows.items():
        extra = f" (donation saves {row['donation_saves']:.0%})" if "donation_saves" in row else ""
        print(f"{name:28s} {row['step_ms']:8.2f} ms  {row['vs_dense']:5.2f}x dense{extra}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "results": rows}
    (out / "bench_train_step.json").write_text(jsonio.dumps(result, indent=1))
    _plot(rows, out / "bench_train_step.png", meta)
    return result


def _plot(rows: dict, path: Path, meta: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.barh(names, [rows[n]["step_ms"] for n in names], color="tab:blue")
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms)")
    ax.set_title(
        f"whole train step, {meta['num_params']:,} params, {meta['devices']} CPU devices,"
        f" ratio {meta['ratio']:g}"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("width", 1024, "Hidden width of the MLP.", **fv)
    flags.DEFINE_integer("depth", 2, "Hidden layers of the MLP.", **fv)
    flags.DEFINE_float("ratio", 1e-3, "Density of the sparsifier.", **fv)
    flags.DEFINE_integer("repeats", 9, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    run(args.width, args.depth, args.ratio, args.repeats, args.out)


if __name__ == "__main__":
    cli.run(main, define_flags)
