r"""Synchronous vs bounded-delay vs asynchronous updates on digits, dense and compressed.

Trains the digits MLP on simulated CPU devices with :mod:`jaxcomp.staleness`,
the same data order, initialisation and learning rate for every run:

- ``sync``: every device's gradient at the current parameters (the
  ``max_delay=0`` step, bit for bit ``jaxcomp.distributed.make_train_step``);
- ``fixed_tau<t>``: every device's gradient ``t`` steps old;
- ``uniform_tau<t>``: each device's delay drawn per step from ``{0..t}``;
- ``async``: the patent's asynchronous parameter server, the workers' pushes
  applied one by one in a random arrival order per round, each push scaled
  by ``1/N`` (staleness ``N - 1`` pushes on average, ``(N - 1) / N`` of a
  round);

each with the dense exchange (SGD with momentum) and with top-k at
``--ratio`` (DGC momentum correction: the momentum on the compressor, plain
SGD after it; error feedback per device; in ``async`` the same compressor
runs locally on each worker). Prints the table (final test accuracy and loss
per run, bytes per device per step) and writes ``<outdir>/staleness.json``
(per-epoch curves) and ``<outdir>/staleness.png`` (test accuracy and
training loss per epoch)::

    python -m experiments.staleness --outdir=results/staleness      # ~2 min on 2 cores

Flags: ``--num_devices`` (simulated CPU devices, set before JAX starts),
``--delays`` (comma list of ``tau``), ``--modes`` (any of ``fixed``,
``uniform``, ``async``; ``sync`` always runs), ``--compressors`` (``dense``,
``top_k``), ``--epochs``, ``--batch_size``, ``--lr``, ``--momentum``,
``--ratio``, ``--hidden``, ``--max_steps_per_epoch``, ``--seed``.
"""

from __future__ import annotations

import os
import time

from absl import flags

from experiments import cli, jsonio

__all__ = ["COMPRESSORS", "MODES", "define_flags", "format_table", "main", "run", "run_from_flags"]

COMPRESSORS = ("dense", "top_k")
MODES = ("fixed", "uniform", "async")
AXIS = "data"


def define_flags(flag_values=flags.FLAGS) -> None:
    """Defines this program's flags on ``flag_values`` (tests pass a fresh ``FlagValues``)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("num_devices", 4, "Simulated CPU devices (workers).", **fv)
    flags.DEFINE_integer("epochs", 20, "Epochs per run.", **fv)
    flags.DEFINE_integer("batch_size", 64, "Global batch size (divisible by num_devices).", **fv)
    flags.DEFINE_float("lr", 0.1, "Learning rate.", **fv)
    flags.DEFINE_float("momentum", 0.9, "SGD momentum (on the compressor for top_k).", **fv)
    flags.DEFINE_float("ratio", 0.01, "top_k density.", **fv)
    flags.DEFINE_list("delays", ["1", "2", "4"], "Bounded delays tau to run.", **fv)
    flags.DEFINE_list("modes", list(MODES), "Stale modes: fixed, uniform, async.", **fv)
    flags.DEFINE_list("compressors", list(COMPRESSORS), "dense and/or top_k.", **fv)
    flags.DEFINE_list("hidden", ["256", "128"], "MLP hidden widths.", **fv)
    flags.DEFINE_integer("max_steps_per_epoch", None, "Truncate epochs (tests).", **fv)
    flags.DEFINE_integer("seed", 0, "Initialisation, data order, delays and arrivals.", **fv)
    flags.DEFINE_string("outdir", "results/staleness", "Output directory.", **fv)


def _runs(modes, delays) -> list[tuple[str, str, int]]:
    """(row name, mode, max_delay) in table order."""
    runs = [("sync", "sync", 0)]
    for mode in ("fixed", "uniform"):
        if mode in modes:
            runs += [(f"{mode}_tau{t}", mode, t) for t in delays]
    if "async" in modes:
        runs.append(("async", "async", 0))
    return runs


def _optimizer(compressor: str, mode: str, lr: float, momentum: float, ratio: float):
    import optax  # noqa: PLC0415

    import jaxcomp  # noqa: PLC0415

    # The asynchronous workers compress locally; the server gets each push.
    axis = None if mode == "async" else AXIS
    if compressor == "dense":
        sgd = optax.sgd(lr, momentum=momentum or None)
        return sgd if axis is None else optax.chain(jaxcomp.dense_exchange(axis), sgd)
    return optax.chain(
        jaxcomp.top_k(ratio, axis_name=axis, momentum=momentum), optax.sgd(lr)
    )  # fmt: skip


def run(
    outdir: str,
    *,
    num_devices: int = 4,
    epochs: int = 20,
    batch_size: int = 64,
    lr: float = 0.1,
    momentum: float = 0.9,
    ratio: float = 0.01,
    delays=(1, 2, 4),
    modes=MODES,
    compressors=COMPRESSORS,
    hidden=(256, 128),
    max_steps_per_epoch: int | None = None,
    seed: int = 0,
) -> dict:
    """Trains every (compressor, mode) run; writes ``staleness.json`` and ``staleness.png``.

    Returns:
      The JSON record: ``args``, ``num_params`` and ``rows``, keyed
      ``"<compressor>/<run>"``, each with per-epoch ``test_accuracy``,
      ``test_loss`` and ``train_loss`` (mean over the epoch's steps of the
      devices' losses at the parameters their gradients were taken at),
      ``final_accuracy``, ``final_test_loss``, ``bytes_per_step`` (one
      device, mean over steps: the exchange's ``wire_bytes``; in ``async`` a
      worker's push plus its dense pull), ``mean_delay`` (steps; in
      ``async`` pushes between pull and push divided by ``N``) and
      ``seconds`` (training steps, compilation included).
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415

    from experiments import data as data_lib  # noqa: PLC0415
    from experiments import models  # noqa: PLC0415
    from jaxcomp import distributed as dist  # noqa: PLC0415
    from jaxcomp import staleness  # noqa: PLC0415

    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"modes must be among {MODES}, got {bad}")
    bad = [c for c in compressors if c not in COMPRESSORS]
    if bad:
        raise ValueError(f"compressors must be among {COMPRESSORS}, got {bad}")
    if any(int(t) < 1 for t in delays):
        raise ValueError(f"delays must be ints >= 1, got {list(delays)}")
    if batch_size % num_devices:
        raise ValueError(f"batch_size {batch_size} must be divisible by num_devices {num_devices}")
    if len(jax.devices()) < num_devices:
        raise ValueError(f"num_devices={num_devices} but only {len(jax.devices())} devices exist")
    mesh = Mesh(np.array(jax.devices()[:num_devices]), (AXIS,))
    dataset = data_lib.load_digits()
    model = models.MLP(num_classes=dataset.num_classes, hidden=tuple(int(h) for h in hidden))
    init_params = model.init(jax.random.key(seed), dataset.train_x[:1])["params"]
    num_params = int(sum(p.size for p in jax.tree.leaves(init_params)))

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    @jax.jit
    def evaluate(params):
        logits = model.apply({"params": params}, dataset.test_x)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, dataset.test_y).mean()
        return jnp.mean(jnp.argmax(logits, -1) == dataset.test_y), loss

    steps = data_lib.steps_per_epoch(len(dataset.train_y), batch_size)
    if max_steps_per_epoch:
        steps = min(steps, max_steps_per_epoch)
    rows = {}
    for compressor in compressors:
        for name, mode, max_delay in _runs(modes, [int(t) for t in delays]):
            tx = _optimizer(compressor, mode, lr, momentum, ratio)
            if mode == "async":
                state = staleness.init_async_state(tx, init_params, mesh, seed=seed)
                step = staleness.make_async_train_step(loss_fn, tx, mesh)
            else:
                delay = "fixed" if mode == "sync" else mode
                state = staleness.init_stale_state(tx, init_params, mesh, max_delay, seed=seed)
                step = staleness.make_stale_train_step(loss_fn, tx, mesh, max_delay, delay=delay)
            curves = {"test_accuracy": [], "test_loss": [], "train_loss": []}
            wire, delay_sum, seconds = [], [], 0.0
            for epoch in range(epochs):
                losses = []
                t0 = time.perf_counter()
                batches = data_lib.epoch_batches(
                    dataset.train_x, dataset.train_y, batch_size, seed, epoch
                )
                for _, (x, y) in zip(range(steps), batches, strict=False):
                    state, metrics = step(state, dist.shard_batch({"x": x, "y": y}, mesh))
                    # One step in flight: simulated devices deadlock otherwise.
                    metrics = jax.device_get(jax.block_until_ready(metrics))
                    losses.append(float(metrics["loss"]))
                    wire.append(float(metrics.get("wire_bytes", 0.0)))
                    if mode == "async":
                        delay_sum.append(float(np.mean(metrics["staleness"])) / num_devices)
                    else:
                        delay_sum.append(float(np.mean(metrics["delay"])))
                seconds += time.perf_counter() - t0
                accuracy, test_loss = jax.device_get(evaluate(jax.device_get(state.params)))
                curves["test_accuracy"].append(float(accuracy))
                curves["test_loss"].append(float(test_loss))
                curves["train_loss"].append(float(np.mean(losses)))
            rows[f"{compressor}/{name}"] = {
                "compressor": compressor,
                "mode": mode,
                "max_delay": max_delay,
                **curves,
                "final_accuracy": curves["test_accuracy"][-1],
                "final_test_loss": curves["test_loss"][-1],
                "bytes_per_step": float(np.mean(wire)),
                "mean_delay": float(np.mean(delay_sum)),
                "seconds": seconds,
            }
    record = {
        "args": {
            "num_devices": num_devices,
            "epochs": epochs,
            "batch_size": batch_size,
            "lr": lr,
            "momentum": momentum,
            "ratio": ratio,
            "delays": [int(t) for t in delays],
            "modes": list(modes),
            "compressors": list(compressors),
            "hidden": [int(h) for h in hidden],
            "max_steps_per_epoch": max_steps_per_epoch,
            "seed": seed,
            "steps_per_epoch": steps,
        },  # fmt: skip
        "num_params": num_params,
        "rows": rows,
    }
    os.makedirs(outdir, exist_ok=True)
    with open(os.path.join(outdir, "staleness.json"), "w") as f:
        jsonio.dump(record, f, indent=2)
    write_plot(record, os.path.join(outdir, "staleness.png"))
    return record


def format_table(record: dict) -> str:
    """One line per run: final test accuracy and loss per compressor, bytes, mean delay."""
    rows = record["rows"]
    compressors = record["args"]["compressors"]
    names = list(dict.fromkeys(key.split("/", 1)[1] for key in rows))
    head = f"{'run':<14}" + "".join(
        f"{c + ' acc %':>13}{c + ' loss':>12}{c + ' B/step':>15}" for c in compressors
    )
    lines = [head + f"{'delay (steps)':>15}", "-" * (len(head) + 15)]
    for name in names:
        line = f"{name:<14}"
        delay = None
        for c in compressors:
            row = rows.get(f"{c}/{name}")
            if row is None:
                line += " " * 40
                continue
            delay = row["mean_delay"]
            line += (
                f"{100 * row['final_accuracy']:>13.2f}{row['final_test_loss']:>12.4f}"
                f"{row['bytes_per_step']:>15.0f}"
            )
        lines.append(line + f"{delay:>15.2f}")
    return "\n".join(lines)


def write_plot(record: dict, path: str) -> None:
    """Test accuracy and training loss per epoch, one column per compressor."""
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    compressors = record["args"]["compressors"]
    taus = record["args"]["delays"]
    colors = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:olive")
    fig, axes = plt.subplots(2, len(compressors), figsize=(6 * len(compressors), 8), squeeze=False)
    for col, c in enumerate(compressors):
        ax_acc, ax_loss = axes[0][col], axes[1][col]
        for key, row in record["rows"].items():
            if row["compressor"] != c:
                continue
            name = key.split("/", 1)[1]
            if row["mode"] in ("sync", "async"):
                style = {"color": "k" if row["mode"] == "sync" else "r", "linestyle": "-"}
            else:  # one colour per tau, dashed fixed, dotted uniform
                color = colors[taus.index(row["max_delay"]) % len(colors)]
                style = {"color": color, "linestyle": "--" if row["mode"] == "fixed" else ":"}
            epochs = range(1, len(row["test_accuracy"]) + 1)
            ax_acc.plot(epochs, [100 * a for a in row["test_accuracy"]], label=name, **style)
            ax_loss.plot(epochs, row["train_loss"], label=name, **style)
        ratio = record["args"]["ratio"]
        title = "dense" if c == "dense" else f"top_k ratio {ratio:g}"
        ax_acc.set(xlabel="epoch", ylabel="test accuracy %", title=title)
        ax_loss.set(xlabel="epoch", ylabel="training loss", yscale="log", title=title)
        for ax in (ax_acc, ax_loss):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.suptitle(f"sync vs bounded delay vs async, {record['args']['num_devices']} devices")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_from_flags(flag_values=flags.FLAGS) -> dict:
    """Runs with parsed flags (devices already set up), prints and returns the record."""
    f = flag_values
    record = run(
        f.outdir,
        num_devices=f.num_devices,
        epochs=f.epochs,
        batch_size=f.batch_size,
        lr=f.lr,
        momentum=f.momentum,
        ratio=f.ratio,
        delays=tuple(int(t) for t in f.delays),
        modes=tuple(f.modes),
        compressors=tuple(f.compressors),
        hidden=tuple(int(h) for h in f.hidden),
        max_steps_per_epoch=f.max_steps_per_epoch,
        seed=f.seed,
    )
    print(format_table(record))
    print(f"JSON and plot: {os.path.join(f.outdir, 'staleness.json')}, staleness.png")
    return record


def main(argv) -> None:
    """Sets the simulated devices before JAX starts, then runs.

    ``argv``: a whole command line or the parsed flags (see :mod:`experiments.cli`).
    """
    fv = cli.parse(define_flags, argv)
    import jax  # noqa: PLC0415

    if jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", fv.num_devices)
    run_from_flags(fv)


if __name__ == "__main__":
    cli.run(main, define_flags)
