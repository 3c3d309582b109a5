"""PowerSGD: bytes per step against dense and top-k, and the time of the jitted update.

For a few layer shapes and ranks it reports:

- **bytes**: what one device puts on the wire per step for the leaf, read
  from ``state.wire_bytes`` after one real step on ``--devices`` simulated
  devices (``jax.shard_map``): PowerSGD's two all-reduces of ``P`` and ``Q``
  (``(n + m) r`` float32 values) and one of a float32 count
  (``nonfinite="skip"``), the dense all-reduce (``jaxcomp.dense_exchange``)
  and top-k's all-gather of ``ceil(1.5 k)`` (index, value) pairs at
  ``ratio = --eta``. The ratio ``dense / powersgd`` and the bits per value
  ``32 (n + m) r / (n m)``.
- **time**: the median of the jitted single-device update (``axis_name=None``,
  state donated and threaded from call to call, as in a training loop) for
  PowerSGD at each rank and ``jaxcomp.top_k(--eta)`` on the same leaf, and
  one memory pass (``sum(|x|)``) as a floor, measured in interleaved rounds
  of one run (one call of each per round), so the load of a shared machine
  drifts over all of them alike. Ratios ``powersgd / top_k`` come from those
  medians.

Writes ``<out>/bench_powersgd.json`` and ``<out>/bench_powersgd.png``.

Run: ``python -m experiments.bench_powersgd [--shapes 1024x1024,4096x1024,3x3x256x256]
[--ranks 1,4,16] [--eta 1e-3] [--devices 8] [--repeats 9] [--out results]``.
A 4-D shape is a Flax ``(kh, kw, in, out)`` kernel, compressed with
``reshape="last"``.
"""

from __future__ import annotations

import math
import os
import statistics
import time

from absl import flags

from experiments import cli, jsonio
from experiments.compare import set_cpu_devices


def _parse_shape(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split("x"))


def _data(shape, seed=0):
    import jax  # noqa: PLC0415

    return jax.random.laplace(jax.random.key(seed), shape) * 5e-3


def wire_bytes(tx, shape, mesh) -> float:
    """Bytes one device sent in one step of ``tx`` over ``mesh`` (``state.wire_bytes``)."""
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    n_dev = mesh.devices.size
    g = {"w": jax.numpy.zeros(shape)}
    state = jax.tree.map(lambda x: jax.numpy.stack([x] * n_dev), tx.init(g))

    def step(g, s):
        g, s = jax.tree.map(lambda x: x[0], (g, s))
        _, s = tx.update(g, s)
        return jax.tree.map(lambda x: x[None], s)

    spec = P("data")
    sharding = NamedSharding(mesh, spec)
    f = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(spec, spec), out_specs=spec))
    grads = {"w": jax.random.normal(jax.random.key(1), (n_dev, *shape))}
    new = f(jax.device_put(grads, sharding), jax.device_put(state, sharding))
    found = optax.tree.get_all_with_path(jax.device_get(new), "wire_bytes")
    return float(sum(float(v[0]) for _, v in found))


def _donated_update(tx):
    import jax  # noqa: PLC0415

    return jax.jit(lambda s, g: tx.update(g, s)[::-1], donate_argnums=0)


def time_updates(fns: dict, g, repeats: int, warmup: int = 3) -> dict:
    """Median ms per call of each ``fn(state, g) -> (state, out)``, interleaved rounds."""
    import jax  # noqa: PLC0415

    states = {}
    for name, (fn, state) in fns.items():
        for _ in range(warmup):
            state, out = fn(state, g)
            jax.block_until_ready((state, out))
        states[name] = state
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, (fn, _) in fns.items():
            t0 = time.perf_counter()
            states[name], out = fn(states[name], g)
            jax.block_until_ready((states[name], out))
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def run(shapes, ranks, eta, n_dev, repeats, out_dir):
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import jaxcomp  # noqa: PLC0415
    from jaxcomp.transforms.powersgd import matrix_plan, powersgd  # noqa: PLC0415

    mesh = jax.make_mesh((n_dev,), ("data",))
    rows = []
    for shape in shapes:
        reshape = "last" if len(shape) > 2 else "first"
        n_el = math.prod(shape)
        dense = wire_bytes(jaxcomp.dense_exchange("data"), shape, mesh)
        topk = wire_bytes(jaxcomp.top_k(eta, axis_name="data", exchange="sparse"), shape, mesh)
        g = {"w": _data(shape)}
        fns = {}
        row = {
            "shape": list(shape),
            "reshape": reshape,
            "elements": n_el,
            "dense_wire_bytes": dense,
            "top_k_wire_bytes": topk,
            "ranks": {},
        }
        for r in ranks:
            plan = matrix_plan(shape, r, reshape=reshape)
            tx = powersgd(r, axis_name="data", reshape=reshape)
            entry = {"plan": plan, "wire_bytes": wire_bytes(tx, shape, mesh)}
            if plan is not None:
                n, m, rr = plan
                entry["bits_per_value"] = 32.0 * (n + m) * rr / (n * m)
            entry["dense_over_powersgd"] = dense / entry["wire_bytes"]
            row["ranks"][str(r)] = entry
            local = powersgd(r, reshape=reshape)
            fns[f"powersgd_r{r}"] = (_donated_update(local), local.init(g))
        tk = jaxcomp.top_k(eta)
        fns["top_k"] = (_donated_update(tk), tk.init(g))
        floor = jax.jit(lambda s, g: (s, jnp.sum(jnp.abs(g["w"]))))
        fns["floor"] = (floor, jnp.zeros([]))
        ms = time_updates(fns, g, repeats)
        row["ms"] = ms
        for r in ranks:
            row["ranks"][str(r)]["ms"] = ms[f"powersgd_r{r}"]
            row["ranks"][str(r)]["time_over_top_k"] = ms[f"powersgd_r{r}"] / ms["top_k"]
            row["ranks"][str(r)]["time_over_floor"] = ms[f"powersgd_r{r}"] / ms["floor"]
        rows.append(row)
        _print_row(row, eta)
    from experiments.timing import environment  # noqa: PLC0415 (imports JAX)

    meta = {
        **environment(),
        "devices": n_dev,
        "eta": eta,
        "repeats": repeats,
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_powersgd.json")
    with open(path, "w") as f:
        jsonio.dump({"meta": meta, "results": rows}, f, indent=1)
    plot(rows, eta, os.path.join(out_dir, "bench_powersgd.png"))
    return {"meta": meta, "results": rows}


def _print_row(row, eta):
    shape = "x".join(map(str, row["shape"]))
    print(
        f"{shape} ({row['reshape']}): dense {row['dense_wire_bytes']:.0f} B, "
        f"top_k({eta:g}) {row['top_k_wire_bytes']:.0f} B; top_k {row['ms']['top_k']:.2f} ms, "
        f"floor {row['ms']['floor']:.2f} ms"
    )
    for r, e in row["ranks"].items():
        print(
            f"  rank {r:>2}: {e['wire_bytes']:.0f} B (dense / powersgd = "
            f"{e['dense_over_powersgd']:.1f}x, {e.get('bits_per_value', 32):.3f} bits/value), "
            f"{e['ms']:.2f} ms = {e['time_over_top_k']:.2f} x top_k, "
            f"{e['time_over_floor']:.1f} floors"
        )


def plot(rows, eta, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in rows:
        label = "x".join(map(str, row["shape"]))
        ranks = [int(r) for r in row["ranks"]]
        ax1.plot(ranks, [row["ranks"][str(r)]["wire_bytes"] for r in ranks], "o-", label=f"{label}")
        color = ax1.lines[-1].get_color()
        ax1.axhline(row["dense_wire_bytes"], ls=":", lw=0.8, color=color)
        ax1.axhline(row["top_k_wire_bytes"], ls="--", lw=0.8, color=color)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("rank r")
    ax1.set_ylabel(f"bytes per device per step (dotted: dense, dashed: top_k({eta:g}))")
    ax1.set_title("PowerSGD wire bytes (ring all-reduce of P and Q)")
    ax1.legend(fontsize=8)
    ax1.grid(True, alpha=0.3)
    width = 0.8 / (len(rows[0]["ms"]) if rows else 1)
    names = list(rows[0]["ms"]) if rows else []
    for i, name in enumerate(names):
        xs = [j + i * width for j in range(len(rows))]
        ax2.bar(xs, [row["ms"][name] for row in rows], width, label=name)
    ax2.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))])
    ax2.set_xticklabels(["x".join(map(str, row["shape"])) for row in rows], fontsize=8)
    ax2.set_ylabel("ms per jitted update (median)")
    ax2.set_title(f"single-device update vs top_k({eta:g}) and one memory pass")
    ax2.legend(fontsize=8)
    ax2.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string(
        "shapes", "1024x1024,4096x1024,3x3x256x256", "Leaf shapes (comma list).", **fv
    )
    flags.DEFINE_string("ranks", "1,4,16", "PowerSGD ranks (comma list).", **fv)
    flags.DEFINE_float("eta", 1e-3, "top_k's ratio", **fv)
    flags.DEFINE_integer("devices", 8, "simulated devices for the bytes", **fv)
    flags.DEFINE_integer("repeats", 9, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    set_cpu_devices(args.devices)
    return run(
        [_parse_shape(s) for s in args.shapes.split(",") if s],
        [int(r) for r in args.ranks.split(",") if r],
        args.eta,
        args.devices,
        args.repeats,
        args.out,
    )


if __name__ == "__main__":
    cli.run(main, define_flags)
