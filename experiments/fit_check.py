"""The ldte_bs paper's distribution check (Table 1, Fig. 1) on a model being trained.

Are gradients and error-feedback residuals closer to a Laplacian than to a
Gaussian? At chosen epochs a training run measures, for one device's
gradient and one device's residual, the Wasserstein-1 distance of every
layer (leaves of at least ``MIN_SIZE`` elements) to a Laplace and a Gaussian
fitted by moments (:func:`jaxcomp.analysis.tree_fit_distances`), and their
geometric mean over layers::

    python -m experiments.fit_check --models=mlp,cnn --dataset=digits \\
        --epochs=10 --epochs_to_check=1,5,10 --outdir=results/fit_check

runs ``experiments.train.train_and_evaluate`` once per model with
``fit_check_epochs`` set (the same as ``python -m experiments.main
--fit_check_epochs=1,5,10``), then writes ``<outdir>/table1.json`` and prints
the table in markdown. Each run's workdir ``<outdir>/<model>`` holds
``fit_check.json`` (one row per checked epoch and kind, with the per-layer
distances) and ``fit_check_epoch<E>.png``: histograms of the largest layers'
gradient and residual with both fitted densities overlaid (the paper's
Fig. 1).

What is measured, at the end of a checked epoch:

- gradient: device 0's gradient of the loss on its shard of the epoch's last
  batch, at the parameters after that epoch (``batch_size / num_devices``
  examples, as one worker computes it);
- residual: device 0's error-feedback residual after the epoch's last step
  (``optax.tree.get(opt_state, "residual")``; with momentum correction it
  carries the accumulated velocity, as the paper's residual does). Absent for
  compressors without one (``dense``).
"""

from __future__ import annotations

import os

from absl import flags

from experiments import cli, jsonio
from experiments.gradient_fit import (
    FIT_CHECK_FILE,
    MIN_SIZE,
    check_epoch,
    device_gradient,
    format_table,
    plot_histograms,
    read_rows,
)

__all__ = [
    "FIT_CHECK_FILE",
    "MIN_SIZE",
    "check_epoch",
    "device_gradient",
    "format_table",
    "define_flags",
    "main",
    "plot_histograms",
    "read_rows",
]


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("models", "mlp", "comma list", **fv)
    flags.DEFINE_string("dataset", "digits", "Data set.", **fv)
    flags.DEFINE_string("data_dir", None, "CIFAR directory or .tar.gz archive.", **fv)
    flags.DEFINE_string("compressor", "ldte_bs", "Compressor.", **fv)
    flags.DEFINE_float("ratio", None, "Density (default: the compressor's).", **fv)
    flags.DEFINE_integer("epochs", 10, "Total epochs.", **fv)
    flags.DEFINE_string("epochs_to_check", "1,5,10", "comma list", **fv)
    flags.DEFINE_integer("batch_size", 64, "Global batch size.", **fv)
    flags.DEFINE_float("lr", 0.1, "Learning rate.", **fv)
    flags.DEFINE_integer("num_devices", 2, "0: every device", **fv)
    flags.DEFINE_integer("max_steps_per_epoch", None, "Truncate epochs.", **fv)
    flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.", **fv)
    flags.DEFINE_string("outdir", "results/fit_check", "Output directory.", **fv)
    flags.DEFINE_bool("progress", False, "Show a progress bar.", **fv)


def main(argv) -> list:
    """Trains each model with ``fit_check_epochs``, writes ``table1.json``, prints the table."""
    args = cli.parse(define_flags, argv)
    from experiments.compare import set_cpu_devices  # noqa: PLC0415

    set_cpu_devices(args.num_devices)
    from experiments import train  # noqa: PLC0415 (after the device count is set)

    check = tuple(int(e) for e in args.epochs_to_check.split(",") if e.strip())
    rows = []
    for model in [m.strip() for m in args.models.split(",") if m.strip()]:
        config = train.TrainConfig(
            compressor=args.compressor,
            compressor_kwargs={} if args.ratio is None else {"ratio": args.ratio},
            dataset=args.dataset,
            data_dir=args.data_dir,
            model=model,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            num_devices=args.num_devices or None,
            max_steps_per_epoch=args.max_steps_per_epoch,
            seed=args.seed,
            progress=args.progress,
            checkpoint=False,
            time_split=False,
            fit_check_epochs=check,
        )
        workdir = os.path.join(args.outdir, model)
        train.train_and_evaluate(config, workdir, overwrite=True)
        rows += read_rows(workdir)
    table = format_table(rows)
    print(table)
    os.makedirs(args.outdir, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "per_leaf"} for r in rows]
    with open(os.path.join(args.outdir, "table1.json"), "w") as f:
        jsonio.dump(
            {"args": cli.values(define_flags, args), "rows": summary, "markdown": table},
            f,
            indent=1,
        )
    print(f"per-layer rows and histograms in {args.outdir}/<model>/, table in table1.json")
    return rows


if __name__ == "__main__":
    cli.run(main, define_flags)
