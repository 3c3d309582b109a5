r"""Benchmark: pipeline (layer-wise) parallelism against data parallelism on the same devices.

One model, ``depth`` blocks ``tanh(x W + b)`` of width ``width`` and a mean
squared error, trained on 8 simulated CPU devices:

- ``dp_dense`` / ``dp_top_k``: data parallelism over all 8 devices
  (:func:`jaxcomp.distributed.make_train_step`), the dense exchange or
  ``jaxcomp.top_k(ratio)`` with error feedback;
- ``pp{S}x{N}_m{M}_dense`` / ``..._top_k``: ``S`` pipeline stages of
  ``depth / S`` blocks, ``N = 8 / S`` data replicas each,
  ``M`` GPipe micro-batches per replica
  (:func:`jaxcomp.distributed.make_pipeline_train_step`), the same exchanges
  per stage over ``"data"``; ``..._1f1b`` the same with the 1F1B schedule.

Every configuration trains on the same global batch. Times are medians of
whole steps (blocked on) after warm-up, the configurations timed in turns
(one step each per round, ``repeats`` rounds); ``vs_dp_dense`` divides by
``dp_dense``'s median measured in the same run. Each row also records the
GPipe bubble ``(S - 1) / (M + S - 1)``, the bytes one device sent between
stages (``stage_bytes``: activations and cotangents) and the gradient bytes
(``wire_bytes``), means over devices. Writes ``bench_pipeline.json`` and
``bench_pipeline.png`` to ``--out``.

    python -m experiments.bench_pipeline --out results/ [--width 512 --depth 8]

On simulated CPU devices the "devices" share the host's cores: a pipeline
does not gain from a stage's weights fitting one device, and a bubble tick
still computes (on padding), so this measures the schedule's overhead
(bubble, ``ppermute`` per tick, the switch) against data parallelism, not
the memory a pipeline saves on accelerators.
"""

from __future__ import annotations

import os

N_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()

import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from absl import flags  # noqa: E402

import jaxcomp  # noqa: E402
from experiments import cli, jsonio  # noqa: E402
from experiments.timing import environment  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402

__all__ = ["define_flags", "main", "run"]


def _blocks(width: int, depth: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [
        {
            "w": jnp.asarray(rng.normal(0, 1 / np.sqrt(width), (width, width)), jnp.float32),
            "b": jnp.zeros((width,), jnp.float32),
        }
        for _ in range(depth)
    ]


def _apply(blocks, x):
    for p in blocks:
        x = jnp.tanh(x @ p["w"] + p["b"])
    return x


def _mse(y, t):
    return jnp.mean((y - t) ** 2)


def _optimizers(ratio: float) -> dict:
    sgd = optax.sgd(0.05)
    return {
        "dense": optax.chain(dist.dense_exchange("data"), sgd),
        "top_k": optax.chain(jaxcomp.top_k(ratio, axis_name="data"), sgd),
    }


def _first_call(step, carry, batch):
    """The step's first call (compiles) and a second (warm-up): (carry, seconds, metrics)."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(step(*carry, batch))
    first = time.perf_counter() - t0
    out = jax.block_until_ready(step(*out[:2], batch))
    return out[:2], first, jax.device_get(out[2])


def _round_robin_ms(runners: dict, repeats: int) -> dict:
    """Median ms per step of each ``(step, carry, batch)``, timed in turns.

    One step of each configuration per round, ``repeats`` rounds: a load
    change on the (shared) machine falls on every configuration alike, not on
    whichever was being timed then.
    """
    times = {name: [] for name in runners}
    carries = {name: carry for name, (_, carry, _) in runners.items()}
    for _ in range(repeats):
        for name, (step, _, batch) in runners.items():
            t0 = time.perf_counter()
            out = jax.block_until_ready(step(*carries[name], batch))
            times[name].append(time.perf_counter() - t0)
            carries[name] = out[:2]
    return {name: 1e3 * statistics.median(ts) for name, ts in times.items()}


def run(
    width: int,
    depth: int,
    batch: int,
    ratio: float,
    pipelines: list,
    repeats: int,
    out_dir: str,
    schedules: tuple = ("gpipe",),
) -> dict:
    """Times each configuration; ``pipelines``: ``(stages, microbatches)`` pairs, each run
    with every schedule of ``schedules``."""
    n_dev = jax.device_count()
    blocks = _blocks(width, depth)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(batch, width)).astype(np.float32)
    t = rng.normal(size=(batch, width)).astype(np.float32)
    rows, runners = {}, {}
    mesh = jax.make_mesh((n_dev,), ("data",))
    loss = lambda p, b: _mse(_apply(p, b[0]), b[1])  # noqa: E731
    for name, tx in _optimizers(ratio).items():
        step = dist.make_train_step(loss, tx, mesh)
        params = dist.replicate(blocks, mesh)
        carry = (params, dist.init_opt_state(tx, params, mesh))
        placed = dist.shard_batch((x, t), mesh)
        carry, first, m = _first_call(step, carry, placed)
        runners[f"dp_{name}"] = (step, carry, placed)
        rows[f"dp_{name}"] = {
            "first_call_s": first,
            "schedule": None,
            "stages": 1,
            "replicas": n_dev,
            "microbatches": 1,
            "bubble": 0.0,
            "stage_bytes": 0.0,
            "wire_bytes": float(m["wire_bytes"]),
        }
    for stages, microbatches in pipelines:
        if n_dev % stages or depth % stages:
            raise ValueError(f"stages={stages} must divide the devices ({n_dev}) and depth")
        per = depth // stages
        mesh = jax.make_mesh((stages, n_dev // stages), ("stage", "data"))
        # Homogeneous stages (a list of `per` blocks each): the compressor sees the matrices.
        stage_params = [blocks[s * per : (s + 1) * per] for s in range(stages)]
        for schedule in schedules:
            for name, tx in _optimizers(ratio).items():
                stacked, pstages = dist.stack_stages(stage_params, mesh)
                carry = (stacked, dist.init_pipeline_opt_state(tx, stacked, mesh))
                step = dist.make_pipeline_train_step(
                    [_apply] * stages, pstages, _mse, tx, mesh, microbatches, schedule=schedule
                )
                carry, first, m = _first_call(step, carry, (x, t))
                suffix = "" if schedule == "gpipe" else f"_{schedule}"
                key = f"pp{stages}x{n_dev // stages}_m{microbatches}_{name}{suffix}"
                runners[key] = (step, carry, (x, t))
                rows[key] = {
                    "first_call_s": first,
                    "schedule": schedule,
                    "stages": stages,
                    "replicas": n_dev // stages,
                    "microbatches": microbatches,
                    "bubble": dist.bubble_fraction(stages, microbatches, schedule),
                    "stage_bytes": float(m["stage_bytes"]),
                    "wire_bytes": float(m["wire_bytes"]),
                }
    for name, ms in _round_robin_ms(runners, repeats).items():
        rows[name]["step_ms"] = ms
    base = rows["dp_dense"]["step_ms"]
    for row in rows.values():
        row["vs_dp_dense"] = row["step_ms"] / base
    meta = {
        "devices": n_dev,
        "width": width,
        "depth": depth,
        "batch": batch,
        "num_params": depth * (width * width + width),
        "ratio": ratio,
        "repeats": repeats,
        **environment(),
    }
    for name, row in rows.items():
        print(
            f"{name:30s} {row['step_ms']:8.2f} ms {row['vs_dp_dense']:5.2f}x dp_dense  "
            f"bubble {row['bubble']:.2f}  stage {row['stage_bytes']:10.0f} B  "
            f"grad {row['wire_bytes']:10.0f} B"
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    result = {"meta": meta, "results": rows}
    (out / "bench_pipeline.json").write_text(jsonio.dumps(result, indent=1))
    _plot(rows, out / "bench_pipeline.png", meta)
    return result


def _plot(rows: dict, path: Path, meta: dict) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = list(rows)
    fig, ax = plt.subplots(figsize=(8, 0.4 * len(names) + 1.5))
    colors = ["tab:gray" if n.startswith("dp") else "tab:blue" for n in names]
    ax.barh(names, [rows[n]["step_ms"] for n in names], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("median step time (ms)")
    ax.set_title(
        f"pipeline vs data parallel, {meta['num_params']:,} params, {meta['devices']} CPU "
        f"devices, batch {meta['batch']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("width", 512, "Width of each block.", **fv)
    flags.DEFINE_integer("depth", 8, "Blocks (divisible by every stage count).", **fv)
    flags.DEFINE_integer("batch", 256, "Global batch size.", **fv)
    flags.DEFINE_float("ratio", 0.01, "Density of top_k.", **fv)
    flags.DEFINE_list(
        "pipelines", ["2:4", "4:4", "4:16"], "STAGES:MICROBATCHES pipeline configurations.", **fv
    )
    flags.DEFINE_list("schedules", ["gpipe", "1f1b"], "Pipeline schedules to time.", **fv)
    flags.DEFINE_integer("repeats", 9, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    try:
        pipelines = [tuple(int(v) for v in p.split(":")) for p in args.pipelines]
    except ValueError:
        cli.fail(f"--pipelines must be STAGES:MICROBATCHES pairs, got {args.pipelines}")
    if any(len(p) != 2 for p in pipelines):
        cli.fail(f"--pipelines must be STAGES:MICROBATCHES pairs, got {args.pipelines}")
    bad = set(args.schedules) - set(dist.SCHEDULES)
    if bad:
        cli.fail(f"--schedules must be among {dist.SCHEDULES}, got {sorted(bad)}")
    run(
        args.width,
        args.depth,
        args.batch,
        args.ratio,
        pipelines,
        args.repeats,
        args.out,
        tuple(args.schedules),
    )


if __name__ == "__main__":
    cli.run(main, define_flags)
