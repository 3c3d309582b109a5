"""Benchmark: DLGS layer merging on ResNet-20, planned and measured (issue 9).

On ``--devices`` simulated CPU devices (8 by default), one data-parallel train
step of ResNet-20 (``experiments.models``, CIFAR-sized synthetic batch) with a
sparsifier compressing and exchanging by groups of layers, for four plans:

- ``none``: one group per layer (layer-wise sparsification, no merging);
- ``greedy``: the DLGS paper's Algorithm 2 (:func:`jaxcomp.planning.greedy_merge`);
- ``optimal``: the exact planner (:func:`jaxcomp.planning.optimal_merge`);
- ``all``: every layer in one group (one selection, one exchange).

The plans come from :func:`jaxcomp.planning.plan_for_model` with this
machine's numbers: the per-layer backward times on one device
(``profile_backward``, ``method="flops"``: XLA's flop shares scaled to the
measured backward), the selector's cost fitted from its timings
(``measure_sparsify_cost``), and the exchange cost ``alpha + beta * bytes``
fitted from all-gathers of (index, value) messages timed on the same
mesh. Each plan runs compress-after-backward and ``overlap=True``.

Reported per plan: groups, collectives per step (counted in the compiled
HLO: all-gathers and all-reduces, including the scalar all-reduces of the
step's metrics, which XLA combines into one), bytes per device per step, the
median step time, and the planner's predicted iteration time. The prediction assumes what the DLGS
timeline assumes (a group's exchange runs while lower layers compute); on
XLA:CPU collectives are synchronous and 8 devices share 2 cores, so the
measured times rank the plans by their per-call overheads rather than
reproduce the prediction. Writes ``bench_merge.json`` and ``bench_merge.png``.

    python -m experiments.bench_merge --out results/ [--ratio 0.01 --repeats 7]
"""

from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import re  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from experiments import cli, jsonio  # noqa: E402
from experiments.models import make_model  # noqa: E402
from experiments.presets import build, spec  # noqa: E402
from experiments.steps import classifier_loss  # noqa: E402
from experiments.timing import environment, median_ms, median_ms_threaded  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402
from jaxcomp import planning  # noqa: E402

__all__ = ["count_collectives", "define_flags", "main", "measure_exchange_cost", "run"]

AXIS = "data"
PLANS = ("none", "greedy", "optimal", "all")


def count_collectives(hlo_text: str) -> dict:
    """All-gathers and all-reduces in a compiled HLO module (any computation)."""
    return {
        "all_gather": len(re.findall(r"\ball-gather(?:-start)?\(", hlo_text)),
        "all_reduce": len(re.findall(r"\ball-reduce(?:-start)?\(", hlo_text)),
    }


def measure_exchange_cost(mesh, ratio: float, sizes=(2**12, 2**14, 2**16, 2**18), repeats=7):
    """``alpha + beta * bytes`` of one sparse exchange on ``mesh``, fitted from timings.

    Times ``jaxcomp.comm.sparse_mean`` of the (int32 index, float32 value)
    message of a group of ``n`` elements at ``ratio`` (capacity ``ceil(1.5
    k)``) for each ``n``, and fits the line through (message bytes, seconds).
    """
    from jaxcomp.comm import collectives  # noqa: PLC0415

    n_dev = mesh.shape[AXIS]
    nbytes, seconds = [], []
    for n in sizes:
        cap = int(np.ceil(1.5 * max(1, np.ceil(ratio * n))))

        def exchange(idx, vals, n=n):
            out, _ = collectives.sparse_mean(idx[0], vals[0], n, AXIS)
            return out[None]

        f = jax.jit(
            jax.shard_map(
                exchange, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS),
                check_vma=False,
            )
        )  # fmt: skip
        sharding = NamedSharding(mesh, P(AXIS))
        rng = np.random.default_rng(0)
        idx = jax.device_put(rng.integers(0, n, (n_dev, cap)).astype(np.int32), sharding)
        vals = jax.device_put(rng.normal(size=(n_dev, cap)).astype(np.float32), sharding)
        seconds.append(median_ms(f, idx, vals, repeats=repeats) / 1e3)
        nbytes.append(8 * cap)
    fit = planning.fit_sparsify_cost(nbytes, seconds)  # a + b * bytes, both >= 0
    # As a cost of the group's element count: 8 bytes per sent element, 1.5 k sent.
    return planning.linear_cost(fit.alpha, fit.beta, 8 * 1.5 * ratio), (nbytes, seconds)


def run(
    ratio: float,
    per_device_batch: int,
    repeats: int,
    compressor: str,
    out_dir: str,
    model: str = "resnet20",
    image_size: int = 32,
    measure: tuple = tuple((m, o) for m in PLANS for o in (False, True)),
) -> dict:
    mesh = jax.make_mesh((jax.device_count(),), (AXIS,))
    n_dev = mesh.shape[AXIS]
    model_name, model = model, make_model(model, 10)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(per_device_batch * n_dev, image_size, image_size, 3))
    x = x.astype(np.float32)
    y = rng.integers(0, 10, per_device_batch * n_dev).astype(np.int32)
    params = model.init(jax.random.key(0), jnp.asarray(x[:1]))["params"]
    loss_fn = classifier_loss(model)
    one_device = (jnp.asarray(x[:per_device_batch]), jnp.asarray(y[:per_device_batch]))

    t0 = time.perf_counter()
    profile = planning.profile_backward(
        loss_fn, params, one_device, repeats=repeats, method="flops"
    )
    profile_s = time.perf_counter() - t0
    t_s = planning.measure_sparsify_cost(compressor, ratio=ratio)
    t_c, comm_points = measure_exchange_cost(mesh, ratio)
    preset = spec(compressor, ratio=ratio, exchange="sparse")  # the --compressor sparsifier
    batch = dist.shard_batch((x, y), mesh)
    rows, predicted = {}, {}
    for method in PLANS:
        plan = planning.plan_for_model(
            loss_fn, params, one_device, ratio=ratio, t_c=t_c, t_s=t_s, method=method,
            profile=profile,
        )  # fmt: skip
        predicted[method] = (plan.plan.num_groups, 1e3 * plan.plan.time)
        tx = optax.chain(
            build(preset, AXIS, groups=plan.groups),
            optax.sgd(0.05),
        )
        for overlap in (False, True):
            if (method, overlap) not in measure:
                continue
            step = dist.make_train_step(loss_fn, tx, mesh, AXIS, overlap=overlap)
            state = (dist.replicate(params, mesh), dist.init_opt_state(tx, params, mesh))
            hlo = step.lower(*state, batch).compile().as_text()
            out = jax.block_until_ready(step(*state, batch))
            ms = median_ms_threaded(
                lambda s, b, step=step: step(*s, b),
                out[:2],
                batch,
                next_state=lambda o: o[:2],
                repeats=repeats,
            )
            key = f"{method}_overlap" if overlap else method
            rows[key] = {
                "plan": method,
                "overlap": overlap,
                "groups": plan.plan.num_groups,
                "collectives": count_collectives(hlo),
                "wire_bytes": float(np.asarray(out[2]["wire_bytes"]).ravel()[0]),
                "step_ms": ms,
                "predicted_ms": 1e3 * plan.plan.time,
            }
            print(
                f"{key:16s} {plan.plan.num_groups:3d} groups  "
                f"{sum(rows[key]['collectives'].values()):4d} collectives  "
                f"{rows[key]['wire_bytes']:10.0f} B  {ms:8.1f} ms measured  "
                f"{rows[key]['predicted_ms']:7.2f} ms predicted"
            )
    base = rows["none"]["step_ms"] if "none" in rows else None
    for row in rows.values():
        row["vs_none"] = None if base is None else row["step_ms"] / base
    meta = {
        "devices": n_dev,
        "model": model_name,
        "layers": len(profile.layers),
        "num_params": int(sum(profile.sizes)),
        "ratio": ratio,
        "compressor": compressor,
        "per_device_batch": per_device_batch,
        "repeats": repeats,
        "profile_s": profile_s,
        "t_f_ms": 1e3 * profile.t_f,
        "t_b_sum_ms": 1e3 * float(sum(profile.t_b)),
        "t_s": {"alpha_s": t_s.alpha, "beta_s_per_element": t_s.beta},
        "t_c": {"alpha_s": t_c.alpha, "beta_s_per_byte": t_c.beta},
        "comm_points": {"bytes": comm_points[0], "seconds": comm_points[1]},
        **environment(),
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta["predicted"] = {m: {"groups": g, "predicted_ms": t} for m, (g, t) in predicted.items()}
    result = {"meta": meta, "results": rows}
    (out / "bench_merge.json").write_text(jsonio.dumps(result, indent=1))
    _plot(rows, out / "bench_merge.png", meta)
    return result


def _plot(rows: dict, path: Path, meta: dict) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    xs = np.arange(len(PLANS))
    pred = meta["predicted"]

    def measured(key):  # NaN: a variant not measured (no bar)
        return rows[key]["step_ms"] if key in rows else float("nan")

    ax1.bar(xs - 0.2, [measured(m) for m in PLANS], 0.4, label="compress after backward")
    ax1.bar(xs + 0.2, [measured(f"{m}_overlap") for m in PLANS], 0.4, label="overlap=True")
    ax1.set_xticks(xs, [f"{m}\n({pred[m]['groups']} groups)" for m in PLANS])
    ax1.set_ylabel("measured step (ms, median)")
    ax1.legend(fontsize=8)
    ax1.set_title(f"{meta['model']}, {meta['devices']} CPU devices, ratio {meta['ratio']:g}")
    ax2.bar(xs, [pred[m]["predicted_ms"] for m in PLANS], color="tab:green")
    ax2.set_xticks(xs, PLANS)
    ax2.set_ylabel("predicted iteration (ms)")
    ax2.set_title("DLGS timeline with this machine's costs")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_float("ratio", 0.01, "Density of the sparsifier.", **fv)
    flags.DEFINE_integer("per_device_batch", 8, "Batch size per device.", **fv)
    flags.DEFINE_string("compressor", "top_k", "a jaxcomp sparsifier name", **fv)
    flags.DEFINE_integer("repeats", 7, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    run(args.ratio, args.per_device_batch, args.repeats, args.compressor, args.out)


if __name__ == "__main__":
    cli.run(main, define_flags)
