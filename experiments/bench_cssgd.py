"""Benchmark: CSSGD (coded synchronous SGD) against uncoded, all-reduce and asynchronous SGD.

On 8 simulated CPU devices, trains the MLP and the CNN of
:mod:`experiments.models` on digits with ``exchange="coded"`` for
``r = 1..4`` (``jaxcomp.cssgd``: every block of the batch on ``r`` devices,
dense gradients quantized to int32 and exchanged by coded multicast), the
paper's uncoded exchange of the same assignment (``exchange="uncoded"``, each
missing block sent whole by one holder) for ``r = 2..4``, and two baselines
without redundancy: dense data-parallel SGD with a ring all-reduce, and the
paper's asynchronous SGD (``--asgd``, default on: :mod:`jaxcomp.staleness`'s
asynchronous parameter server, one round of ``N`` pushes per batch, each
worker with its own momentum, pushes applied one by one in a random arrival
order, scaled by ``1 / N``). All with the same global batch (280, a multiple
of ``C(8, r)`` for every ``r <= 4``), learning rate, epochs, initialisation
and data order; the synchronous runs through
:func:`experiments.train.train_and_evaluate`::

    python -m experiments.bench_cssgd --out results/      # see docs/cssgd.md for the time

The paper's comparison is time to accuracy: per run, the training time
(step times summed, compilation and evaluation excluded) at the first
epoch's end whose test accuracy reaches ``--target_fraction`` (0.95) times
the dense run's final accuracy (``time_to_accuracy`` in the JSON, a third
plot panel of accuracy against training time). On simulated devices the
asynchronous run gains nothing from not waiting: its round is all-gathered
and replayed in lock step (the workers never straggle), so its time is that
of the simulation, not of a real parameter server.

Measures per run: the median step time (median over epochs of each epoch's
median), its split into forward+backward, compression (for CSSGD:
quantization, encoding, decoding and the SGD update) and exposed
communication (medians over epochs of the records' ``time_*``), the bytes each
device sends and receives per step (multicast accounting: a packet is sent
once, received once per receiver), and the final test accuracy. Ratios are
against the dense run of the same invocation. Then the CSSGD paper's time
model ``T(r) = r T_calc + T_comm / r`` (:func:`jaxcomp.cssgd.step_time`),
fitted on the ``r = 1`` run (``T_calc`` its forward+backward, ``T_comm`` its
exposed communication), predicts every ``r``'s step time and the best ``r``
(:func:`jaxcomp.cssgd.best_redundancy`), printed beside the measured best;
the paper found ``r = 3`` for an MLP and ``r = 2`` for a CNN on 8 workers.
Beside it, the same fit with ``T_comm`` scaled by the bytes this
implementation sends, ``coded_sent(r) / coded_sent(1)``
(:func:`jaxcomp.cssgd.bytes_per_worker`): a block's gradient is a whole model
gradient, so the bytes per device do not fall as ``1 / r`` (on 8 devices they
are 1, 1.5, 1.67, 1.25 times the ``r = 1`` bytes for ``r = 1..4``).
Also printed: the formula loads (:func:`jaxcomp.cssgd.coded_load`,
:func:`jaxcomp.cssgd.uncoded_load`) and :func:`jaxcomp.cssgd.bytes_per_worker`
for each ``r`` against the ring all-reduce's bytes.

On simulated CPU devices communication is a memory copy: redundancy, which
buys less communication with ``r`` times the computation, cannot win here the
way it can on a slow network. The numbers show the mechanism and its costs,
not the paper's speed-ups.

Writes ``bench_cssgd.json`` and ``bench_cssgd.png`` (per model: step time vs
``r`` with the dense baseline and the model's prediction; bytes per device vs
``r`` with the all-reduce's; test accuracy against training time for every
run) to ``--out``, the synchronous runs' own outputs under
``--out/bench_cssgd/<model>/<run>/``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time

from absl import flags

from experiments import cli, jsonio

__all__ = [
    "DEFAULT_MODELS",
    "DEFAULT_REDUNDANCIES",
    "format_table",
    "main",
    "run",
    "write_plot",
]

DEFAULT_MODELS = ("mlp", "cnn")
DEFAULT_REDUNDANCIES = (1, 2, 3, 4)
# The CSSGD paper's best redundancy on 8 workers (its Figs.), for the printout.
PAPER_BEST_R = {"mlp": 3, "cnn": 2}
NOTE = (
    "On simulated CPU devices communication is a memory copy, so redundancy (r times the "
    "computation for 1/r of the communication) cannot win here the way it can on a slow "
    "network; these numbers show the mechanism and its costs, not the paper's speed-ups."
)
_PARTS = ("forward_backward", "compression", "communication", "step")
# The CSSGD paper's Figs. 14-15 (10 workers; ASGD with one more node as the
# parameter server, mean of 10 runs): CSSGD at its best redundancy needs this
# much less training time (%) to reach the serial run's test accuracy than
# SSGD (multicast) and ASGD. DNN on MNIST (our "mlp"), CNN on CIFAR-10 ("cnn").
PAPER_TIME_SAVED = {
    "mlp": {"ssgd": 53.97, "asgd": 26.89},
    "cnn": {"ssgd": 39.11, "asgd": 26.37},
}


def _median_part(records: list, part: str) -> float:
    """Median over the epochs of ``time_<part>`` in seconds (-1 when never measured)."""
    measured = [r[f"time_{part}"] for r in records if r.get("time_step", -1.0) >= 0]
    return statistics.median(measured) if measured else -1.0


def _summary(result: dict, dense: dict | None) -> dict:
    """One run's row: times (ms), bytes per device per step, accuracy, ratios to ``dense``."""
    records, final = result["records"], result["final"]
    sent = final["bytes_per_step_per_device"]
    # The step time while training: the median over epochs of each epoch's median.
    train_step_ms = 1e3 * statistics.median(r["step_time"] for r in records)
    parts = {f"{p}_ms": 1e3 * _median_part(records, p) for p in _PARTS}
    row = {
        # -1 where never measured (the asynchronous run has no time split).
        **{k: max(v, -1.0) for k, v in parts.items()},
        # The time split's step where measured, else the training steps'.
        "step_ms": parts["step_ms"] if parts["step_ms"] >= 0 else train_step_ms,
        "train_step_ms": train_step_ms,
        "sent_bytes": sent,
        # A ring all-reduce receives what it sends; CSSGD counts each packet per receiver.
        "received_bytes": final.get("received_bytes_per_step_per_device", sent),
        "test_accuracy": final["test_accuracy"],
        "clipped": final.get("clipped", 0),
        "epochs": final["epoch"],
    }
    if dense is not None:
        row["step_vs_dense"] = row["step_ms"] / dense["step_ms"]
        row["sent_vs_dense"] = sent / dense["sent_bytes"]
    return row


def _formula(n: int, r: int, num_params: int) -> dict:
    from jaxcomp import cssgd  # noqa: PLC0415

    b = cssgd.bytes_per_worker(n, r, num_params)
    return {
        "r": r,
        "coded_load": float(cssgd.coded_load(n, r)),
        "coded_load_fraction": str(cssgd.coded_load(n, r)),
        "uncoded_load": float(cssgd.uncoded_load(n, r)),
        "uncoded_load_fraction": str(cssgd.uncoded_load(n, r)),
        **{k: float(v) for k, v in b.items()},
        "coded_sent_vs_allreduce": b["coded_sent"] / b["allreduce_sent"],
    }


def _fit(rows: dict, redundancies, n: int, num_params: int) -> dict:
    """The paper's model fitted on the ``r = 1`` run, its predictions and best ``r``.

    Also the variant whose communication term follows this implementation's
    bytes, ``r T_calc + T_comm coded_sent(r) / coded_sent(1)`` (``_bytes`` keys).
    """
    from jaxcomp import cssgd  # noqa: PLC0415

    measured = {r: rows[f"coded_r{r}"]["step_ms"] for r in redundancies}
    out = {"measured_best_r": min(measured, key=lambda r: (measured[r], r))}
    base = rows.get("coded_r1")
    if base is None or base["forward_backward_ms"] < 0:
        return out  # no r = 1 run or no time split: nothing to fit
    t_calc, t_comm = base["forward_backward_ms"], max(base["communication_ms"], 0.0)
    every = sorted({*range(1, n), *redundancies})
    predicted = {r: cssgd.step_time(t_calc, t_comm, r) for r in every}
    sent = {r: cssgd.bytes_per_worker(n, r, num_params)["coded_sent"] for r in every}
    by_bytes = {r: r * t_calc + t_comm * sent[r] / sent[1] for r in every}
    out.update(
        t_calc_ms=t_calc,
        t_comm_ms=t_comm,
        predicted_ms={str(r): t for r, t in predicted.items()},
        predicted_best_r=cssgd.best_redundancy(t_calc, t_comm, n),
        # Over the measured r only, to compare like with like.
        predicted_best_measured_r=min(redundancies, key=lambda r: (predicted[r], r)),
        predicted_bytes_ms={str(r): t for r, t in by_bytes.items()},
        predicted_bytes_best_r=min(range(1, n), key=lambda r: (by_bytes[r], r)),
        # What the model leaves out: the coding's own cost at r = 1.
        r1_compression_ms=base["compression_ms"],
    )
    return out


def _asgd_result(config, num_devices: int) -> dict:
    """The asynchronous SGD baseline of ``config``: :mod:`jaxcomp.staleness`'s parameter server.

    One round per global batch: each of the ``num_devices`` workers computes
    its gradient on its ``batch_size / num_devices`` examples at the
    parameters it last pulled, runs its own SGD with momentum, and pushes; the
    server applies the pushes one by one in a random arrival order, each
    scaled by ``1 / N`` (:func:`jaxcomp.staleness.make_async_train_step`).
    Same model, initialisation, data order, learning rate and epochs as the
    synchronous runs. Step times exclude compilation (one warm-up round,
    discarded), as ``experiments.train`` does. Returns a result shaped like
    ``train.train_and_evaluate``'s (``records``, ``final``, ``num_params``).
    """
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415
    from jax.sharding import Mesh  # noqa: PLC0415

    from experiments import data as data_lib  # noqa: PLC0415
    from experiments import models  # noqa: PLC0415
    from experiments.steps import classifier_loss  # noqa: PLC0415
    from jaxcomp import staleness  # noqa: PLC0415
    from jaxcomp.distributed import shard_batch  # noqa: PLC0415

    c = config
    dataset = data_lib.load_dataset(c.dataset)
    mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",))
    model = models.make_model(c.model, dataset.num_classes)
    params = model.init(jax.random.key(c.seed), dataset.train_x[:1])["params"]
    num_params = int(sum(p.size for p in jax.tree.leaves(params)))
    tx = optax.sgd(c.lr, momentum=c.momentum or None)  # local: each worker's own momentum
    step = staleness.make_async_train_step(classifier_loss(model), tx, mesh, donate=False)
    state = staleness.init_async_state(tx, params, mesh, seed=c.seed)
    first = (dataset.train_x[: c.batch_size], dataset.train_y[: c.batch_size])
    jax.block_until_ready(step(state, shard_batch(first, mesh)))  # compile, discarded
    predict = jax.jit(lambda p, x: jnp.argmax(model.apply({"params": p}, x), -1))
    steps = data_lib.steps_per_epoch(len(dataset.train_y), c.batch_size)
    if c.max_steps_per_epoch:
        steps = min(steps, c.max_steps_per_epoch)
    records, train_time = [], 0.0
    for epoch in range(c.epochs):
        times, losses, stale, wire = [], [], [], []
        batches = data_lib.epoch_batches(
            dataset.train_x, dataset.train_y, c.batch_size, c.seed, epoch
        )
        for _, batch in zip(range(steps), batches, strict=False):
            t0 = time.perf_counter()
            state, m = step(state, shard_batch(batch, mesh))
            # One round in flight: simulated devices deadlock otherwise.
            m = jax.device_get(jax.block_until_ready(m))
            times.append(time.perf_counter() - t0)
            losses.append(float(m["loss"]))
            stale.append(float(np.mean(m["staleness"])))
            wire.append((float(m["push_bytes"]), float(m["pull_bytes"])))
        train_time += sum(times)
        pred = np.asarray(predict(jax.device_get(state.params), dataset.test_x))
        records.append({
            "epoch": epoch + 1,
            "train_loss": statistics.mean(losses),
            "test_accuracy": float(np.mean(pred == dataset.test_y)),
            "train_time": train_time,
            "step_time": statistics.median(times),
            "mean_staleness_pushes": statistics.mean(stale),
        })  # fmt: skip
    push, pull = (statistics.mean(w[i] for w in wire) for i in (0, 1))
    final = {
        **records[-1],
        # A worker's link per round: its push out, the dense parameters back.
        "bytes_per_step_per_device": push,
        "received_bytes_per_step_per_device": pull,
    }
    return {"records": records, "final": final, "num_params": num_params}


def _time_to_accuracy(
    runs: dict, curves: dict, target_fraction: float, steps_per_epoch: int
) -> dict:
    """Training time to a target accuracy, per run, and the time CSSGD saves.

    The target is ``target_fraction`` of the dense all-reduce run's final
    test accuracy (the paper's comparison: time until each method reaches
    the same accuracy); a run that never reaches it at an epoch's end gets
    ``None``. Accuracy is measured at epoch ends only, so times are
    resolved to an epoch. Two times per run: ``measured_seconds``, the step
    times summed up to that epoch (compilation and evaluation excluded), and
    ``seconds``, the steps to the target times the run's median training step
    (``train_step_ms``): on a shared 2-core machine the sum carries the first
    steps' warm-up and other jobs' load, the median does not. The time saved
    (``time_saved_percent``) is computed from ``seconds``.
    """
    target = target_fraction * runs["dense"]["test_accuracy"]
    out = {"target_accuracy": target, "target_fraction": target_fraction, "runs": {}}
    for name, curve in curves.items():
        hit = next((p for p in curve if p["test_accuracy"] >= target), None)
        steps = None if hit is None else hit["epoch"] * steps_per_epoch
        out["runs"][name] = {
            "epochs": None if hit is None else hit["epoch"],
            "steps": steps,
            "measured_seconds": None if hit is None else hit["train_time"],
            "seconds": None if hit is None else steps * runs[name]["train_step_ms"] / 1e3,
        }
    # The paper's figure: CSSGD at its best r against each baseline, time saved.
    seconds = {k: v["seconds"] for k, v in out["runs"].items()}
    coded = {k: t for k, t in seconds.items() if k.startswith("coded_r") and t is not None}
    best = min(coded, key=coded.get) if coded else None
    out["best_coded"] = best
    uncoded = [t for k, t in seconds.items() if k.startswith("uncoded_r") and t is not None]
    baselines = {
        # The paper's SSGD: no redundancy, every gradient multicast whole (our r = 1).
        "ssgd_multicast": seconds.get("coded_r1"),
        "dense": seconds.get("dense"),
        "uncoded": min(uncoded) if uncoded else None,  # the best uncoded r
        "asgd": seconds.get("asgd"),
    }
    out["time_saved_percent"] = {
        k: None if best is None or t is None else 100 * (1 - coded[best] / t)
        for k, t in baselines.items()
    }
    return out


def run(
    out_dir: str,
    *,
    models=DEFAULT_MODELS,
    redundancies=DEFAULT_REDUNDANCIES,
    epochs: int = 5,
    batch_size: int = 280,
    lr: float = 0.1,
    seed: int = 0,
    num_devices: int = 8,
    max_steps_per_epoch: int | None = None,
    dataset: str = "digits",
    progress: bool = False,
    asgd: bool = True,
    target_fraction: float = 0.95,
) -> dict:
    """Trains dense and CSSGD runs per model, writes ``bench_cssgd.json`` and ``.png``.

    Args:
      out_dir: where the JSON and PNG go; the runs under ``out_dir/bench_cssgd/``.
      models: :mod:`experiments.models` names.
      redundancies: the ``r`` of the coded runs, each in ``[1, num_devices]``.
      epochs: epochs per run.
      batch_size: global batch, a multiple of ``C(num_devices, r)`` for every ``r``.
      lr: learning rate (constant; momentum 0.9).
      seed: initialisation and data order, shared by all runs.
      num_devices: mesh size (that many devices must exist).
      max_steps_per_epoch: truncate epochs (smoke tests).
      dataset: ``digits`` or ``synthetic`` (the others need files).
      progress: progress bars.
      asgd: also run the asynchronous SGD baseline (:func:`_asgd_result`).
      target_fraction: the time-to-accuracy target, a fraction in (0, 1] of
        the dense run's final test accuracy.

    Returns:
      The JSON record: ``{"meta", "models": {model: {"num_params", "runs":
      {"dense" | "coded_r<r>" | "uncoded_r<r>" | "asgd": row}, "fit", "formula",
      "time_to_accuracy"}}}``; each row's ``curve`` is its test accuracy and
      training time at every epoch's end.

    Raises:
      ValueError: ``num_devices < 2``, no ``redundancies``, or a configuration
        ``experiments.train`` rejects (e.g. a batch size that is not a
        multiple of ``C(num_devices, r)``), before training.
    """
    import jax  # noqa: PLC0415 (after the device count is set)

    from experiments import train  # noqa: PLC0415
    from experiments.timing import environment  # noqa: PLC0415

    redundancies = tuple(redundancies)
    if num_devices < 2:
        raise ValueError(f"num_devices must be >= 2 (a redundancy to choose), got {num_devices}")
    if not redundancies:
        raise ValueError("redundancies must name at least one r in [1, num_devices]")
    if not 0.0 < target_fraction <= 1.0:
        raise ValueError(f"target_fraction must be in (0, 1], got {target_fraction!r}")
    if asgd and batch_size % num_devices:
        raise ValueError(
            f"batch_size {batch_size} must be divisible by num_devices {num_devices} (asgd)"
        )
    base = train.TrainConfig(
        compressor="dense",
        num_devices=num_devices,
        dataset=dataset,
        epochs=epochs,
        batch_size=batch_size,
        lr=lr,
        momentum=0.9,
        seed=seed,
        progress=progress,
        checkpoint=False,
        time_split=True,
        max_steps_per_epoch=max_steps_per_epoch,
    )
    configs = {}
    for model in models:
        dense = dataclasses.replace(base, model=model)
        configs[model] = {"dense": dense}
        for r in redundancies:
            configs[model][f"coded_r{r}"] = dataclasses.replace(
                dense, exchange="coded", redundancy=r
            )
        # The paper's uncoded baseline: the same assignment, each missing block
        # sent whole by one holder (at r = 1 it is the coded exchange).
        for r in redundancies:
            if r > 1:
                configs[model][f"uncoded_r{r}"] = dataclasses.replace(
                    dense, exchange="uncoded", redundancy=r
                )
    # Every configuration checked before the first (minutes-long) run.
    for runs in configs.values():
        for config in runs.values():
            train.validate_config(config, jax.device_count())
    record = {
        "meta": {
            "num_devices": num_devices,
            "batch_size": batch_size,
            "epochs": epochs,
            "lr": lr,
            "momentum": 0.9,
            "seed": seed,
            "dataset": dataset,
            "max_steps_per_epoch": max_steps_per_epoch,
            "redundancies": list(redundancies),
            "exchange": "coded",
            "asgd": asgd,
            "target_fraction": target_fraction,
            **environment(),
            "note": NOTE,
        },
        "models": {},
    }
    from experiments import data as data_lib  # noqa: PLC0415

    steps_per_epoch = data_lib.steps_per_epoch(
        len(data_lib.load_dataset(dataset).train_y), batch_size
    )
    if max_steps_per_epoch:
        steps_per_epoch = min(steps_per_epoch, max_steps_per_epoch)
    for model, runs in configs.items():
        rows, curves, num_params = {}, {}, None
        results = {}
        for name, config in runs.items():
            workdir = os.path.join(out_dir, "bench_cssgd", model, name)
            results[name] = train.train_and_evaluate(config, workdir, overwrite=True)
        if asgd:
            results["asgd"] = _asgd_result(runs["dense"], num_devices)
        for name, result in results.items():
            num_params = result["num_params"]
            rows[name] = _summary(result, rows.get("dense"))
            curves[name] = [
                {k: r[k] for k in ("epoch", "test_accuracy", "train_time")}
                for r in result["records"]
            ]
            rows[name]["curve"] = curves[name]
        record["models"][model] = {
            "num_params": num_params,
            "runs": rows,
            "fit": _fit(rows, redundancies, num_devices, num_params),
            "formula": [_formula(num_devices, r, num_params) for r in redundancies],
            "time_to_accuracy": _time_to_accuracy(rows, curves, target_fraction, steps_per_epoch),
        }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench_cssgd.json"), "w") as f:
        jsonio.dump(record, f, indent=1)
    write_plot(record, os.path.join(out_dir, "bench_cssgd.png"))
    return record


def format_table(record: dict) -> str:
    """The printed report of :func:`run`'s record."""
    meta = record["meta"]
    n = meta["num_devices"]
    lines = [
        f"CSSGD (exchange=coded) vs dense data-parallel SGD: {n} devices "
        f"({meta['backend']}), {meta['dataset']}, batch {meta['batch_size']}, "
        f"{meta['epochs']} epochs, lr {meta['lr']}, seed {meta['seed']}",
    ]

    def ms(v):
        return "-" if v < 0 else f"{v:.1f}"

    for model, m in record["models"].items():
        head = (
            f"{'run':<10}{'step ms':>9}{'x dense':>8}{'fb ms':>8}{'comp ms':>9}{'comm ms':>9}"
            f"{'pred ms':>9}{'pred2 ms':>9}{'sent B/step':>13}{'x dense':>8}"
            f"{'recv B/step':>13}{'acc %':>7}"
        )
        lines += ["", f"{model} ({m['num_params']:,} parameters)", head, "-" * len(head)]
        fit = m["fit"]
        predicted = fit.get("predicted_ms", {})
        predicted2 = fit.get("predicted_bytes_ms", {})
        for name, row in m["runs"].items():
            r = name.removeprefix("coded_r")
            pred = predicted.get(r) if name != "dense" else None
            pred2 = predicted2.get(r) if name != "dense" else None
            lines.append(
                f"{name:<10}{row['step_ms']:>9.1f}{row.get('step_vs_dense', 1.0):>8.2f}"
                f"{ms(row['forward_backward_ms']):>8}{ms(row['compression_ms']):>9}"
                f"{ms(row['communication_ms']):>9}{'-' if pred is None else f'{pred:.1f}':>9}"
                f"{'-' if pred2 is None else f'{pred2:.1f}':>9}"
                f"{row['sent_bytes']:>13.0f}{row.get('sent_vs_dense', 1.0):>8.2f}"
                f"{row['received_bytes']:>13.0f}{100 * row['test_accuracy']:>7.2f}"
            )
        rs = meta["redundancies"]
        if "predicted_best_r" in fit:
            lines.append(
                f"model T(r) = r*T_calc + T_comm/r fitted at r=1: "
                f"T_calc {fit['t_calc_ms']:.2f} ms, T_comm {fit['t_comm_ms']:.2f} ms -> "
                "predicted best r = "
                f"{fit['predicted_best_r']} of 1..{n - 1} ({fit['predicted_best_measured_r']} of "
                f"{rs}); measured best r = {fit['measured_best_r']} of {rs}"
            )
            lines.append(
                f"  with T_comm scaled by the bytes sent instead of 1/r (pred2 ms): best r = "
                f"{fit['predicted_bytes_best_r']} of 1..{n - 1}"
            )
            lines.append(
                f"  (both leave out the coding's own time, {fit['r1_compression_ms']:.1f} ms "
                "at r=1 here, which grows with r)"
            )
        else:
            lines.append(f"measured best r = {fit['measured_best_r']} of {rs} (no r=1 fit)")
        if model in PAPER_BEST_R:
            lines.append(
                f"  the CSSGD paper found best r = {PAPER_BEST_R[model]} ({model}, 8 workers)"
            )
        tta = m["time_to_accuracy"]
        lines.append(
            f"time to {100 * tta['target_accuracy']:.2f}% test accuracy "
            f"({tta['target_fraction']:g} x the dense run's final; training steps only, "
            "resolved to an epoch's end):"
        )
        for name, hit in tta["runs"].items():
            reached = (
                "not reached"
                if hit["seconds"] is None
                else f"{hit['seconds']:.3f} s = {hit['steps']} steps x median step "
                f"(summed: {hit['measured_seconds']:.3f} s), epoch {hit['epochs']}"
            )
            lines.append(f"  {name:<12}{reached}")
        saved = tta["time_saved_percent"]
        paper = PAPER_TIME_SAVED.get(model)

        def pct(v):
            return "-" if v is None else f"{v:+.1f}%"

        lines.append(
            f"  time saved by the best coded run ({tta['best_coded'] or 'none reached'}): "
            f"vs SSGD multicast (r=1) {pct(saved['ssgd_multicast'])}, "
            f"vs dense all-reduce {pct(saved['dense'])}, vs best uncoded "
            f"{pct(saved['uncoded'])}, vs ASGD {pct(saved['asgd'])}"
        )
        if paper:
            lines.append(
                f"  the CSSGD paper (10 workers, slow network): vs SSGD {paper['ssgd']:+.2f}%, "
                f"vs ASGD {paper['asgd']:+.2f}% (Figs. 14-15)"
            )
        fhead = (
            f"{'r':>3}{'coded load':>12}{'uncoded load':>14}{'coded sent B':>14}"
            f"{'coded recv B':>14}{'uncoded sent B':>16}{'all-reduce B':>14}{'coded/ar':>10}"
        )
        lines += [f"formula ({n} devices, {m['num_params']:,} float32 parameters):", fhead]
        for f in m["formula"]:
            lines.append(
                f"{f['r']:>3}{f['coded_load_fraction']:>12}{f['uncoded_load_fraction']:>14}"
                f"{f['coded_sent']:>14.0f}{f['coded_received']:>14.0f}"
                f"{f['uncoded_sent']:>16.0f}{f['allreduce_sent']:>14.0f}"
                f"{f['coded_sent_vs_allreduce']:>10.2f}"
            )
    lines += ["", f"note: {meta['note']}"]
    return "\n".join(lines)


def write_plot(record: dict, path: str) -> None:
    """Per model: step time vs ``r`` (dense line, model prediction) and bytes vs ``r``."""
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    models = list(record["models"])
    rs = record["meta"]["redundancies"]
    fig, axes = plt.subplots(len(models), 3, figsize=(16, 3.8 * len(models)), squeeze=False)
    for (ax_t, ax_b, ax_a), model in zip(axes, models, strict=True):
        m = record["models"][model]
        runs = m["runs"]
        coded = [runs[f"coded_r{r}"] for r in rs]
        ax_t.plot(rs, [row["step_ms"] for row in coded], "o-", label="coded: measured step")
        if all(row["forward_backward_ms"] >= 0 for row in coded):
            ax_t.plot(rs, [row["forward_backward_ms"] for row in coded], "s:", label="fwd+bwd")
            ax_t.plot(rs, [row["compression_ms"] for row in coded], "^:", label="coding+update")
            ax_t.plot(rs, [row["communication_ms"] for row in coded], "v:", label="exposed comm")
        predicted = m["fit"].get("predicted_ms")
        if predicted:
            xs = sorted(int(r) for r in predicted)
            ax_t.plot(xs, [predicted[str(r)] for r in xs], "k--", label="model r Tc + Tm / r")
            by_bytes = m["fit"]["predicted_bytes_ms"]
            ax_t.plot(xs, [by_bytes[str(r)] for r in xs], "k:", label="model, Tm scaled by bytes")
        ax_t.axhline(runs["dense"]["step_ms"], color="gray", label="dense all-reduce step")
        # Log scale: the parts and the dense step are orders of magnitude apart.
        ax_t.set(
            xlabel="redundancy r", ylabel="ms per step", title=f"{model}: step time", yscale="log"
        )
        formula = {f["r"]: f for f in m["formula"]}
        ax_b.plot(rs, [row["sent_bytes"] for row in coded], "o-", label="coded: sent (measured)")
        ax_b.plot(rs, [row["received_bytes"] for row in coded], "s-", label="coded: received")
        ax_b.plot(rs, [formula[r]["uncoded_sent"] for r in rs], "^--", label="uncoded: sent")
        ax_b.axhline(runs["dense"]["sent_bytes"], color="gray", label="dense ring all-reduce")
        ax_b.set(
            xlabel="redundancy r",
            ylabel="bytes per device per step",
            title=f"{model}: communication ({m['num_params']:,} params)",
            yscale="log",
        )
        ax_t.set_xticks(sorted({*rs, *(int(r) for r in predicted or ())}))
        ax_b.set_xticks(rs)
        tta = m["time_to_accuracy"]
        for name, row in runs.items():
            curve = row["curve"]
            ax_a.plot(
                [p["train_time"] for p in curve],
                [100 * p["test_accuracy"] for p in curve],
                ".-",
                label=name,
            )
        ax_a.axhline(100 * tta["target_accuracy"], color="gray", ls=":", label="target")
        ax_a.set(
            xlabel="training time, s (steps only)",
            ylabel="test accuracy %",
            title=f"{model}: time to accuracy",
            xscale="log",
        )
        for ax in (ax_t, ax_b, ax_a):
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("out", "results", "Output directory.", **fv)
    flags.DEFINE_string("models", ",".join(DEFAULT_MODELS), "comma list", **fv)
    flags.DEFINE_string(
        "redundancies", ",".join(map(str, DEFAULT_REDUNDANCIES)), "comma list", **fv
    )
    flags.DEFINE_integer("epochs", 5, "Epochs per run.", **fv)
    flags.DEFINE_integer("batch_size", 280, "Global batch size.", **fv)
    flags.DEFINE_float("lr", 0.1, "Learning rate.", **fv)
    flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.", **fv)
    flags.DEFINE_integer("num_devices", 8, "Simulated CPU devices.", **fv)
    flags.DEFINE_integer("max_steps_per_epoch", None, "Truncate epochs.", **fv)
    flags.DEFINE_enum("dataset", "digits", ["digits", "synthetic"], "Data set.", **fv)
    flags.DEFINE_bool("progress", False, "Show a progress bar.", **fv)
    flags.DEFINE_bool("asgd", True, "Also run the asynchronous SGD baseline.", **fv)
    flags.DEFINE_float(
        "target_fraction", 0.95, "Time-to-accuracy target: this x the dense final.", **fv
    )


def main(argv) -> dict:
    """Parses the flags, sets the simulated devices, runs and prints the report.

    ``argv``: a command line or parsed flags (:func:`experiments.cli.parse`).
    """
    args = cli.parse(define_flags, argv)
    try:
        redundancies = tuple(int(r) for r in args.redundancies.split(","))
    except ValueError:
        cli.fail(f"--redundancies must be a comma list of integers, got {args.redundancies!r}")
    for r in redundancies:
        if not 1 <= r <= args.num_devices:
            cli.fail(f"--redundancies must be in [1, num_devices={args.num_devices}], got {r}")
    if not 0.0 < args.target_fraction <= 1.0:
        cli.fail(f"--target_fraction must be in (0, 1], got {args.target_fraction}")
    bad = [r for r in redundancies if args.batch_size % math.comb(args.num_devices, r)]
    if bad:
        cli.fail(
            f"--batch_size={args.batch_size} must be a multiple of C({args.num_devices}, r) "
            f"for every r; not for r in {bad}"
        )
    from experiments.compare import set_cpu_devices  # noqa: PLC0415 (imports no JAX backend)

    set_cpu_devices(args.num_devices)
    record = run(
        args.out,
        models=tuple(m for m in args.models.split(",") if m),
        redundancies=redundancies,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        num_devices=args.num_devices,
        max_steps_per_epoch=args.max_steps_per_epoch,
        dataset=args.dataset,
        progress=args.progress,
        asgd=args.asgd,
        target_fraction=args.target_fraction,
    )
    print(format_table(record))
    print(f"JSON and plot: {os.path.join(args.out, 'bench_cssgd.json')}, bench_cssgd.png")
    return record


if __name__ == "__main__":
    cli.run(main, define_flags)
