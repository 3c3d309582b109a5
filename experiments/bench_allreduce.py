"""Benchmark: bytes and time of the sparse exchanges as the device count grows.

For N = 2, 4, 8, 16, 32 simulated CPU devices (one subprocess per N: the
device count is fixed when JAX starts), a 2^22-element float32 gradient per
device and ``jaxcomp.top_k(ratio=1e-3)``, one donated ``tx.update`` inside
``shard_map`` with each exchange: ``dense`` (ring all-reduce of the
gradient, ``jaxcomp.dense_exchange``), ``sparse`` (all-gather of the
(index, value) messages), ``gtopk``, ``oktopk``, ``sparcml`` and
``scalecom`` (:mod:`jaxcomp.comm.sparse_allreduce`). Reports per device and
step the bytes the collectives counted beside each exchange's formula, in
messages (one device's ``cap`` pairs) and as a fraction of dense, and the
median step time; checks the issue's targets (N = 8: at most 3 messages for
gtopk and oktopk; N = 32: at least 20x fewer bytes than dense). Writes
``bench_allreduce.json`` and ``bench_allreduce.png``.

    python -m experiments.bench_allreduce --out results/ [--devices 2,4,8,16,32] [--log2 22]

Times on simulated devices share 2 cores: a collective is a memory copy and
a rendezvous of threads, so time tracks compute (sorting merges, scatters),
not the network; the bytes are what a network would carry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from absl import flags

from experiments import cli, jsonio

__all__ = ["EXCHANGES", "define_flags", "formula_bytes", "main", "measure", "run"]

# "sparse" before the others: its bytes give the message capacity.
EXCHANGES = ("dense", "sparse", "gtopk", "oktopk", "sparcml", "scalecom")
RATIO = 1e-3


def formula_bytes(exchange: str, n_dev: int, size: int, capacity: int) -> float | None:
    """Per-device bytes each exchange's model predicts (None: depends on the data)."""
    from jaxcomp.comm import sparse_allreduce as sa  # noqa: PLC0415

    pair = 8  # int32 index + float32 value
    allreduce = lambda b: 2 * (n_dev - 1) / n_dev * b  # noqa: E731
    if exchange == "dense":
        return allreduce(4 * size)
    if exchange == "sparse":
        return (n_dev - 1) * capacity * pair
    if exchange == "gtopk":
        return sa.gtopk_rounds(n_dev) * capacity * pair
    if exchange == "oktopk":
        per_peer, per_region = sa.oktopk_capacities(capacity, n_dev)
        hist = allreduce(4 * sa._BINS_PER_DEVICE * n_dev)
        return (n_dev - 1) * (per_peer + per_region) * pair + hist
    if exchange == "scalecom":
        return allreduce(4 * capacity) + allreduce(4 * capacity)
    return None  # sparcml: the branch depends on the counts


def measure(n_dev: int, log2: int, repeats: int, exchanges=EXCHANGES) -> list[dict]:
    """Runs in a process with ``n_dev`` devices; one row per exchange."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    import jaxcomp  # noqa: PLC0415
    from experiments.timing import median_ms_threaded  # noqa: PLC0415
    from jaxcomp import distributed as dist  # noqa: PLC0415

    size = 2**log2
    mesh = jax.make_mesh((n_dev,), ("data",), devices=jax.devices()[:n_dev])
    grads = jax.device_put(
        jax.random.laplace(jax.random.key(0), (n_dev, size), jnp.float32),
        NamedSharding(mesh, P("data")),
    )
    rows = []
    capacity = 0
    for exchange in exchanges:
        if exchange == "dense":
            tx = dist.dense_exchange("data")
        else:
            tx = jaxcomp.top_k(ratio=RATIO, axis_name="data", exchange=exchange)

        def body(state, g, tx=tx):
            state = jax.tree.map(lambda x: x[0], state)
            u, state = tx.update({"g": g[0]}, state)
            return jax.tree.map(lambda x: x[None], state), u["g"][None]

        step = jax.jit(
            jax.shard_map(
                body,
                mesh=mesh,
                in_specs=(P("data"), P("data")),
                out_specs=(P("data"), P("data")),
                check_vma=False,
            ),
            donate_argnums=0,
        )

        def fresh(tx=tx):
            return dist.init_opt_state(tx, {"g": jnp.zeros((size,), jnp.float32)}, mesh)

        try:
            ms = median_ms_threaded(
                step, fresh(), grads, next_state=lambda out: out[0], repeats=repeats, warmup=1
            )
        except ValueError as e:  # e.g. gtopk on a non-power-of-two mesh
            rows.append({"exchange": exchange, "devices": n_dev, "error": str(e)})
            continue
        state, _ = jax.block_until_ready(step(fresh(), grads))
        wire = float(np.asarray(optax.tree.get(state, "wire_bytes"))[0])
        if exchange == "sparse":
            # The message capacity (pairs per message, padding included) is
            # what the all-gather moved: (N - 1) messages.
            capacity = round(wire / (8 * (n_dev - 1)))
        elif exchange == "dense":
            capacity = 0
        rows.append(
            {
                "exchange": exchange,
                "devices": n_dev,
                "size": size,
                "capacity": capacity,
                "step_ms": ms,
                "wire_bytes": wire,
                "formula_bytes": formula_bytes(exchange, n_dev, size, capacity),
            }
        )
    return rows


def run(devices, log2: int, repeats: int, out: str | Path, exchanges=EXCHANGES) -> dict:
    """One subprocess per device count; writes the JSON and the PNG."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for n_dev in devices:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (
            env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n_dev}"
        )
        code = (
            "import json, sys; from experiments.bench_allreduce import measure; "
            f"print(json.dumps(measure({n_dev}, {log2}, {repeats}, {tuple(exchanges)!r})))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
        )
        if done.returncode:
            raise RuntimeError(f"N={n_dev} failed:\n{done.stderr[-3000:]}")
        rows += json.loads(done.stdout.strip().splitlines()[-1])
    dense = {r["devices"]: r["wire_bytes"] for r in rows if r["exchange"] == "dense"}
    for r in rows:
        if "error" in r:
            continue
        message = r["capacity"] * 8
        r["messages"] = r["wire_bytes"] / message if message else None
        r["fewer_than_dense"] = dense[r["devices"]] / r["wire_bytes"] if r["wire_bytes"] else None
    targets = _targets(rows)
    result = {"ratio": RATIO, "log2_size": log2, "rows": rows, "targets": targets}
    (out / "bench_allreduce.json").write_text(jsonio.dumps(result, indent=1))
    _plot(rows, out / "bench_allreduce.png")
    return result


def _targets(rows) -> dict:
    def get(exchange, n):
        return next(
            (
                r
                for r in rows
                if r["exchange"] == exchange and r["devices"] == n and "error" not in r
            ),
            None,
        )

    t = {}
    for exchange in ("gtopk", "oktopk"):
        r8, r32 = get(exchange, 8), get(exchange, 32)
        if r8:
            t[f"{exchange}_n8_messages<=3"] = r8["messages"] <= 3
        if r32:
            t[f"{exchange}_n32_fewer_than_dense>=20"] = r32["fewer_than_dense"] >= 20
    return t


def _plot(rows, path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax_b, ax_t) = plt.subplots(1, 2, figsize=(11, 4))
    # Distinct markers and widths: sparcml's bytes equal the all-gather's at this ratio.
    markers = dict(zip(EXCHANGES, "os^vxD", strict=True))
    for i, exchange in enumerate(EXCHANGES):
        sel = [r for r in rows if r["exchange"] == exchange and "error" not in r]
        if not sel:
            continue
        xs = [r["devices"] for r in sel]
        style = dict(marker=markers[exchange], color=f"C{i}", label=exchange, lw=2.5 - 0.3 * i)
        ax_b.plot(xs, [r["wire_bytes"] for r in sel], **style)
        form = [(r["devices"], r["formula_bytes"]) for r in sel if r["formula_bytes"]]
        if form:
            ax_b.plot(*zip(*form, strict=True), ls=":", color=f"C{i}")
        ax_t.plot(xs, [r["step_ms"] for r in sel], **style)
    ax_b.set(xscale="log", yscale="log", xlabel="devices N", title="bytes per device per step")
    ax_t.set(xscale="log", yscale="log", xlabel="devices N", title="step (median ms, simulated)")
    for ax in (ax_b, ax_t):
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"top_k ratio {RATIO} exchanges (dotted: each exchange's formula)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("out", "results", "Output directory.", **fv)
    flags.DEFINE_string("devices", "2,4,8,16,32", "Device counts (comma-separated).", **fv)
    flags.DEFINE_integer("log2", 22, "log2 of the gradient's size per device.", **fv)
    flags.DEFINE_integer("repeats", 3, "Timed steps per exchange (median).", **fv)


def main(argv) -> None:
    """Runs the benchmark; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    devices = [int(n) for n in args.devices.split(",")]
    result = run(devices, args.log2, args.repeats, args.out)
    head = (
        f"{'N':>3} {'exchange':9} {'bytes':>12} {'formula':>12} {'messages':>9} "
        f"{'x dense':>8} {'ms':>9}"
    )
    print(head)
    for r in result["rows"]:
        if "error" in r:
            print(f"{r['devices']:>3} {r['exchange']:9} {r['error'][:70]}")
            continue
        form = "-" if r["formula_bytes"] is None else f"{r['formula_bytes']:.0f}"
        msgs = "-" if r["messages"] is None else f"{r['messages']:.2f}"
        print(
            f"{r['devices']:>3} {r['exchange']:9} {r['wire_bytes']:>12.0f} {form:>12} "
            f"{msgs:>9} {r['fewer_than_dense']:>8.1f} {r['step_ms']:>9.1f}"
        )
    print("targets:", result["targets"])
    print(f"wrote {args.out}/bench_allreduce.json and .png")


if __name__ == "__main__":
    cli.run(main, define_flags)
