"""Benchmark: dense all-reduce vs sparse all-gather vs automatic exchange, 8 simulated devices.

Per gradient size (2^18..2^24) and ratio (1e-2, 1e-3), one data-parallel
exchange step inside ``jax.shard_map`` over 8 simulated CPU devices:

- ``dense``: the uncompressed baseline, ``pmean`` of the gradient
  (``jaxcomp.distributed.dense_exchange``);
- ``sparse``: ``jaxcomp.ldte_bs(ratio, axis_name="data")`` update: compress
  (threshold + index extraction + error feedback), all-gather the
  (index, value) messages, scatter-add them into the dense mean;
- ``exchange_only``: just :func:`jaxcomp.comm.sparse_mean` on a ready message
  of the same capacity (all-gather + decompress), the collective's own cost;
- ``auto``: ``exchange="auto"``, which picks per leaf the path that moves
  fewer bytes (:func:`jaxcomp.comm.prefer_sparse`).

Quantizers (``--quantizers``, per size, no ratio): the full update step of
each named configuration in ``QUANTIZERS`` below (TernGrad, natural
compression, Signum with majority vote, 16-bit casts with the all-gather and
with the compressed all-reduce, QSGD 4-bit for reference, PowerSGD rank 4 on
the gradient as a ``(size / 1024, 1024)`` matrix, 1-bit Adam with the
single-stage and the two-stage exchange), its bytes per device and its
message, against the same run's dense all-reduce.

A group of parameter servers (``--servers=1,2,4``, per size): the update
step of ``top_k`` (ratio 0.01, sparse push, dense pull) and of ``qsgd``
(4-bit, buckets of 512) with ``exchange="server"`` and ``servers=M``, on a
gradient of ``SERVER_LEAVES`` equal leaves (the quantizer's servers take whole
leaves): the median step time against ``M = 1`` timed in the same run, a
worker's bytes, and per server the bytes its link carries in and out
(:func:`jaxcomp.comm.server_link_bytes`, the busiest server against the
single one), with the sparsifier's pushes split into what is moved (the whole
message to every server) and what is meaningful (the entries in the server's
key range, :func:`jaxcomp.comm.server_message_counts`).

Times are medians after warm-up with every step blocked on (several collective
steps in flight deadlock simulated devices); the optimizer state is donated
and threaded from step to step, as in a training loop. Bytes are per device per step as
reported by the collectives. Writes ``bench_exchange.json`` and
``bench_exchange.png`` to ``--out``.

    python -m experiments.bench_exchange --out results/ [--max_log2 24]
"""

from __future__ import annotations

import os

N_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()

import math  # noqa: E402
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
from experiments.presets import build, spec  # noqa: E402
from experiments.timing import environment, median_ms, median_ms_threaded  # noqa: E402
from jaxcomp import comm  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402
from jaxcomp.selection import selectors  # noqa: E402

__all__ = ["bench_one", "main"]

AXIS = "data"
UPPER = 1.5  # ldte_bs capacity factor (its default ``upper``)

# name -> preset (experiments.presets) of the quantizer rows, built with axis_name="data".
QUANTIZERS = {
    "qsgd_4bit_512": spec("qsgd", bits=4, bucket_size=512),
    "terngrad": spec("terngrad"),
    "natural": spec("natural_compression"),
    "natural_allreduce": spec("natural_compression", exchange="allreduce"),
    "signum_majority": spec("signum", beta=0.9),
    "cast_bf16_allgather": spec("cast", dtype="bfloat16"),
    "cast_bf16_allreduce": spec("cast", dtype="bfloat16", exchange="allreduce"),
    "cast_fp16_allreduce": spec("cast", dtype="float16", exchange="allreduce"),
    # Low rank: the gradient as a (size / 1024, 1024) matrix (LEAF_SHAPES), two all-reduces.
    "powersgd_rank4": spec("powersgd", rank=4),
    # Compressed optimizers: the row times the whole Adam step (its 1-bit exchange of
    # the momentum included) against dense's pmean alone. freeze_step=1 and one dense
    # step before the timing (WARM_UP): every timed step compresses.
    "onebit_adam": spec("onebit_adam", learning_rate=1e-3, freeze_step=1),
    "onebit_adam_two_stage": spec(
        "onebit_adam", learning_rate=1e-3, freeze_step=1, codec="sign_l2", exchange="two_stage"
    ),
}
# Rows timed (and their bytes read) from the state after one step: the dense warm-up.
WARM_UP = ("onebit_adam", "onebit_adam_two_stage")
# The server-group rows: the compressors, and the leaves the gradient is cut into.
SERVER_ROWS = {
    "top_k_0.01": spec("top_k", ratio=0.01, exchange="server"),
    "qsgd_4bit_512": spec("qsgd", bits=4, bucket_size=512, exchange="server", min_dense_size=0),
}
SERVER_LEAVES = 8
# The leaf shape a row compresses (default: the flat gradient).
LEAF_SHAPES = {"powersgd_rank4": lambda size: (size // 1024, 1024)}


def _leaf_shape(name, size):
    return LEAF_SHAPES.get(name, lambda n: (n,))(size)


def _stacked_state(tx, size, mesh, shape=None):
    return dist.init_opt_state(tx, {"g": jnp.zeros(shape or (size,), jnp.float32)}, mesh)


def _update_step(tx, mesh, shape=None):
    """jit(shard_map(tx.update)) over stacked state (donated) and per-device gradients."""

    def body(state, g):
        state = jax.tree.map(lambda x: x[0], state)
        upd, state = tx.update({"g": g[0].reshape(shape or g[0].shape)}, state)
        return jax.tree.map(lambda x: x[None], state), upd["g"].reshape(-1)[None]

    return jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P(AXIS), P(AXIS)),
            out_specs=(P(AXIS), P(AXIS)),
            check_vma=False,
        ),
        donate_argnums=0,
    )


def _exchange_only_step(size, mesh):
    def body(idx, vals):
        mean, sent = comm.sparse_mean(idx[0], vals[0], size, AXIS)
        return mean[None], sent[None]

    return jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(AXIS), P(AXIS)), out_specs=P(AXIS), check_vma=False
        )
    )


def _wire_bytes(state) -> float:
    return float(np.asarray(optax.tree.get(state, "wire_bytes"))[0])


def bench_one(size: int, ratio: float, mesh, repeats: int) -> dict:
    """Times and bytes of the exchange variants for one size and ratio."""
    sh = NamedSharding(mesh, P(AXIS))
    key = jax.random.key(size)
    grads = jax.device_put(jax.random.laplace(key, (N_DEVICES, size), jnp.float32), sh)
    k = selectors.target_count(ratio, size)
    capacity = min(size, math.ceil(UPPER * k))
    row = {"size": size, "ratio": ratio, "k": k, "capacity": capacity}

    def run(tx):
        step = _update_step(tx, mesh)
        ms = median_ms_threaded(
            step,
            _stacked_state(tx, size, mesh),
            grads,
            next_state=lambda out: out[0],
            repeats=repeats,
        )
        new_state, _ = jax.block_until_ready(step(_stacked_state(tx, size, mesh), grads))
        return ms, new_state

    row["dense_ms"], dstate = run(dist.dense_exchange(AXIS))
    row["dense_bytes"] = _wire_bytes(dstate)

    row["sparse_ms"], sstate = run(jaxcomp.ldte_bs(ratio=ratio, axis_name=AXIS, exchange="sparse"))
    row["sparse_bytes"] = _wire_bytes(sstate)
    stats = jaxcomp.statistics(sstate)  # per device
    row["sent_count_mean"] = float(np.mean(np.asarray(stats["sent_count"]["g"])))
    row["message_bytes_mean"] = float(np.mean(np.asarray(stats["message_bytes"]["g"])))

    rng = np.random.default_rng(0)
    idx = np.stack([np.sort(rng.choice(size, capacity, replace=False)) for _ in range(N_DEVICES)])
    vals = rng.standard_normal((N_DEVICES, capacity)).astype(np.float32)
    ex = _exchange_only_step(size, mesh)
    row["exchange_only_ms"] = median_ms(
        ex,
        jax.device_put(idx.astype(np.int32), sh),
        jax.device_put(vals, sh),
        repeats=repeats,
    )

    row["auto_picks_sparse"] = comm.prefer_sparse(capacity, size, 4, N_DEVICES)
    row["auto_ms"], astate = run(jaxcomp.ldte_bs(ratio=ratio, axis_name=AXIS, exchange="auto"))
    row["auto_bytes"] = _wire_bytes(astate)
    row["wire_vs_dense"] = row["sparse_bytes"] / row["dense_bytes"]
    row["message_vs_dense_tensor"] = capacity * 8 / (size * 4)
    row["sparse_vs_dense_time"] = row["sparse_ms"] / row["dense_ms"]
    return row


def bench_quantizers(size: int, mesh, repeats: int, names) -> list[dict]:
    """Time, bytes per device and message of each quantizer's update step, beside dense."""
    sh = NamedSharding(mesh, P(AXIS))
    grads = jax.device_put(
        jax.random.laplace(jax.random.key(size + 1), (N_DEVICES, size), jnp.float32), sh
    )

    def run(tx, shape=None, warm_up=False):
        step = _update_step(tx, mesh, shape)

        def start():  # a fresh state each time: the step donates it
            state = _stacked_state(tx, size, mesh, shape)
            return step(state, grads)[0] if warm_up else state

        ms = median_ms_threaded(
            step, start(), grads, next_state=lambda out: out[0], repeats=repeats
        )
        new_state, _ = jax.block_until_ready(step(start(), grads))
        return ms, new_state

    dense_ms, dstate = run(dist.dense_exchange(AXIS))
    dense_bytes = _wire_bytes(dstate)
    rows = []
    for name in names:
        ms, state = run(build(QUANTIZERS[name], AXIS), _leaf_shape(name, size), name in WARM_UP)
        message = float(np.asarray(optax.tree.get(state, "message_bytes")["g"])[0])
        rows.append(
            {
                "size": size,
                "quantizer": name,
                "ms": ms,
                "wire_bytes": _wire_bytes(state),
                "message_bytes": message,
                "message_bits_per_value": 8 * message / size,
                "dense_ms": dense_ms,
                "dense_bytes": dense_bytes,
                "wire_vs_dense": _wire_bytes(state) / dense_bytes,
                "time_vs_dense": ms / dense_ms,
            }
        )
    return rows


def _leaves_step(tx, mesh):
    """jit(shard_map(tx.update)) on a tree of per-device leaves, state donated."""

    def body(state, grads):
        state, grads = jax.tree.map(lambda x: x[0], (state, grads))
        upd, state = tx.update(grads, state)
        return jax.tree.map(lambda x: x[None], (state, upd))

    spec_ = P(AXIS)
    return jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=spec_, out_specs=spec_, check_vma=False),
        donate_argnums=0,
    )


def bench_servers(size: int, mesh, repeats: int, groups) -> list[dict]:
    """Per compressor of ``SERVER_ROWS`` and group size ``M``: time and bytes per server."""
    sh = NamedSharding(mesh, P(AXIS))
    leaf = size // SERVER_LEAVES
    keys = jax.random.split(jax.random.key(size + 2), SERVER_LEAVES)
    grads = {
        f"l{i}": jax.device_put(jax.random.laplace(k, (N_DEVICES, leaf), jnp.float32), sh)
        for i, k in enumerate(keys)
    }
    zeros = {name: jnp.zeros((leaf,), jnp.float32) for name in grads}
    rows = []
    for name, preset in SERVER_ROWS.items():
        for m in groups:
            tx = build(preset, AXIS, servers=m)
            step = _leaves_step(tx, mesh)
            ms = median_ms_threaded(
                step, dist.init_opt_state(tx, zeros, mesh), grads,
                next_state=lambda out: out[0], repeats=repeats,
            )  # fmt: skip
            state, _ = jax.block_until_ready(step(dist.init_opt_state(tx, zeros, mesh), grads))
            message = [
                float(b)
                for leaf_bytes in jax.tree.leaves(state.message_bytes)
                for b in np.atleast_1d(np.asarray(leaf_bytes)[0])
            ]
            row = {"compressor": name, "size": size, "servers": m, "ms": ms}
            if name.startswith("top_k"):
                # Key ranges of the packed buffer; every server gets the whole message.
                ranges = comm.server_ranges(size, m)
                capacity = min(leaf, math.ceil(UPPER * selectors.target_count(0.01, leaf)))
                push = [8.0 * capacity * SERVER_LEAVES] * m  # moved, not message_bytes (sent)
                pull = [4.0 * (hi - lo) for lo, hi in ranges]
                # What is meaningful: device 0's entries in each range (its sent
                # positions are where its residual is exactly zero).
                res = np.concatenate([np.asarray(r)[0] for r in jax.tree.leaves(state.residual)])
                sent = np.flatnonzero(res == 0)
                row["meaningful_push_bytes"] = [
                    8.0 * int(np.sum((sent >= lo) & (sent < hi))) for lo, hi in ranges
                ]
            else:  # whole leaves per server
                shares = comm.assign_to_servers(message, m)
                push = [sum(message[i] for i in share) for share in shares]
                pull = [4.0 * leaf * len(share) for share in shares]
            link = comm.server_link_bytes(push, pull, N_DEVICES)
            busiest = max(a + b for a, b in zip(link["server_in"], link["server_out"], strict=True))
            row.update(
                worker_bytes=_wire_bytes(state),
                worker_bytes_formula=link["worker"],
                push_bytes=push,
                pull_bytes=pull,
                server_in_bytes=list(link["server_in"]),
                server_out_bytes=list(link["server_out"]),
                busiest_server_bytes=busiest,
            )
            rows.append(row)
        one = next(r for r in rows if r["compressor"] == name and r["servers"] == groups[0])
        for r in rows:
            if r["compressor"] == name:
                r["time_vs_first"] = r["ms"] / one["ms"]
                r["busiest_server_vs_first"] = (
                    r["busiest_server_bytes"] / one["busiest_server_bytes"]
                )
    return rows


def _plot_servers(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    for i, (name, size) in enumerate(dict.fromkeys((r["compressor"], r["size"]) for r in rows)):
        sel = [r for r in rows if (r["compressor"], r["size"]) == (name, size)]
        ms = [r["servers"] for r in sel]
        label = f"{name}, 2^{int(math.log2(size))}"
        ax_t.plot(ms, [r["time_vs_first"] for r in sel], f"C{i}-o", label=label)
        ax_b.plot(ms, [r["busiest_server_vs_first"] for r in sel], f"C{i}-o", label=label)
        ax_b.plot(ms, [r["worker_bytes"] / sel[0]["worker_bytes"] for r in sel], f"C{i}:x")
    ax_t.set_title(f"step time / the first group size's ({N_DEVICES} CPU devices)")
    ax_b.set_title("busiest server's link (o) and a worker's (x) / the first's")
    for ax in (ax_t, ax_b):
        ax.set_xlabel("parameter servers M")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot(rows, path, qrows=()):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4))
    ratios = sorted({r["ratio"] for r in rows}, reverse=True)
    base = list(rows) or list(qrows)  # either part may be skipped; both time dense
    sizes = sorted({r["size"] for r in base})
    dense = [next(r["dense_ms"] for r in base if r["size"] == s) for s in sizes]
    ax_t.plot(sizes, dense, "k-o", label="dense all-reduce")
    dense_b = [next(r["dense_bytes"] for r in base if r["size"] == s) for s in sizes]
    ax_b.plot(sizes, dense_b, "k-o", label="dense all-reduce")
    for ratio, style in zip(ratios, ["-s", "-^", "-v"], strict=False):
        sel = [r for r in rows if r["ratio"] == ratio]
        xs = [r["size"] for r in sel]
        ax_t.plot(xs, [r["sparse_ms"] for r in sel], "C0" + style, label=f"ldte_bs step {ratio:g}")
        ax_t.plot(
            xs, [r["exchange_only_ms"] for r in sel], "C1" + style, label=f"exchange only {ratio:g}"
        )
        ax_b.plot(xs, [r["sparse_bytes"] for r in sel], "C0" + style, label=f"sparse {ratio:g}")
    for i, name in enumerate(dict.fromkeys(r["quantizer"] for r in qrows)):
        sel = [r for r in qrows if r["quantizer"] == name]
        xs = [r["size"] for r in sel]
        style = f"C{i + 2}--."
        ax_t.plot(xs, [r["ms"] for r in sel], style, label=name)
        ax_b.plot(xs, [r["wire_bytes"] for r in sel], style, label=name)
    for ax, title in ((ax_t, "time per step (median ms)"), (ax_b, "bytes per device per step")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("gradient elements")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"exchange on {N_DEVICES} simulated CPU devices")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("out", "results", "output directory", **fv)
    flags.DEFINE_integer("min_log2", 18, "log2 of the smallest gradient size.", **fv)
    flags.DEFINE_integer("max_log2", 22, "log2 of the largest gradient size.", **fv)
    flags.DEFINE_list("ratios", ["0.01", "0.001"], "Sparsifier densities (comma list).", **fv)
    flags.register_validator(
        "ratios",
        lambda v: all(_is_float(r) for r in v),
        message="--ratios: a comma list of numbers",
        flag_values=flag_values,
    )
    flags.DEFINE_integer("repeats", 5, "Timed repeats per row (median).", **fv)
    flags.DEFINE_list(
        "quantizers", list(QUANTIZERS), "quantizer rows to run (--quantizers=: skip them)", **fv
    )
    cli.check_choices("quantizers", list(QUANTIZERS), flag_values)
    flags.DEFINE_bool("no_sparse", False, "skip the sparsifier rows (quantizers only)", **fv)
    flags.DEFINE_list(
        "servers", [], "parameter-server group sizes to run, e.g. 1,2,4 (empty: skip)", **fv
    )
    flags.register_validator(
        "servers",
        lambda v: all(m.strip().isdigit() and 1 <= int(m) <= N_DEVICES for m in v),
        message=f"--servers: a comma list of group sizes in [1, {N_DEVICES}]",
        flag_values=flag_values,
    )


def main(argv):
    """Runs the benchmark; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    if jax.device_count() < N_DEVICES:
        raise SystemExit(
            f"need {N_DEVICES} devices, have {jax.device_count()} (XLA_FLAGS set late?)"
        )
    mesh = jax.make_mesh((N_DEVICES,), (AXIS,))
    rows, qrows, srows = [], [], []
    groups = [int(m) for m in args.servers]
    for log2 in range(args.min_log2, args.max_log2 + 1):
        for row in bench_servers(2**log2, mesh, args.repeats, groups) if groups else ():
            srows.append(row)
            print(
                f"2^{log2} {row['compressor']} servers={row['servers']}: {row['ms']:.1f} ms "
                f"({row['time_vs_first']:.2f}x), worker {row['worker_bytes'] / 1e6:.3f} MB, "
                f"busiest server {row['busiest_server_bytes'] / 1e6:.3f} MB "
                f"({row['busiest_server_vs_first']:.2f}x)",
                flush=True,
            )
        if args.quantizers:
            for row in bench_quantizers(2**log2, mesh, args.repeats, args.quantizers):
                qrows.append(row)
                print(
                    f"2^{log2} {row['quantizer']}: {row['ms']:.1f} ms "
                    f"({row['time_vs_dense']:.2f}x dense {row['dense_ms']:.1f} ms) "
                    f"{row['wire_bytes'] / 1e6:.3f} MB ({100 * row['wire_vs_dense']:.1f}% of dense "
                    f"wire), message {row['message_bits_per_value']:.3f} bits/value",
                    flush=True,
                )
        for ratio in () if args.no_sparse else map(float, args.ratios):
            row = bench_one(2**log2, ratio, mesh, args.repeats)
            rows.append(row)
            print(
                f"2^{log2} ratio={ratio:g}: dense {row['dense_ms']:.1f} ms "
                f"{row['dense_bytes'] / 1e6:.2f} MB | ldte_bs step {row['sparse_ms']:.1f} ms "
                f"{row['sparse_bytes'] / 1e6:.3f} MB ({100 * row['wire_vs_dense']:.2f}% of dense "
                f"wire, message {100 * row['message_vs_dense_tensor']:.2f}% of the tensor) | "
                f"exchange only {row['exchange_only_ms']:.1f} ms | auto -> "
                f"{'sparse' if row['auto_picks_sparse'] else 'dense'} {row['auto_ms']:.1f} ms",
                flush=True,
            )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "devices": N_DEVICES,
        **environment(),
        "repeats": args.repeats,
    }
    (out / "bench_exchange.json").write_text(
        jsonio.dumps(
            {"meta": meta, "rows": rows, "quantizer_rows": qrows, "server_rows": srows}, indent=2
        )
    )
    if rows or qrows:
        _plot(rows, out / "bench_exchange.png", qrows)
    if srows:
        _plot_servers(srows, out / "bench_exchange_servers.png")
    print(f"wrote {out / 'bench_exchange.json'} and the figures")


if __name__ == "__main__":
    cli.run(main, define_flags)
