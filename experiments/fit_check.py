"""The ldte_bs paper's distribution check (Table 1, Fig. 1) on a model being trained.

Are gradients and error-feedback residuals closer to a Laplacian than to a
Gaussian? At chosen epochs a training run measures, for one device's
gradient and one device's residual, the Wasserstein-1 distance of every
layer (leaves of at least ``MIN_SIZE`` elements) to a Laplace and a Gaussian
fitted by moments (:func:`jaxcomp.analysis.tree_fit_distances`), and their
geometric mean over layers::

    python -m experiments.fit_check --models=mlp,cnn --dataset=digits \\
        --epochs=10 --epochs_to_check=1,5,10 --outdir=results/fit_check

``--models=paper`` is the paper's list (``PAPER_MODELS``: AlexNet, VGG-19,
ResNet-50, DenseNet-121, SENet-18 at their CIFAR-10 sizes); it needs 32x32
images (``--dataset=cifar10``, or ``synthetic_cifar`` without the data)::

    python -m experiments.fit_check --models=paper --dataset=synthetic_cifar \\
        --epochs=1 --epochs_to_check=1 --max_steps_per_epoch=4 --batch_size=16

Whenever a model of the paper's list was run, the program also prints the
paper's Table 1 beside ours (:func:`format_paper_table`): for each model and
family the paper's "EMD" and our histogram EMD in bins
(:func:`jaxcomp.analysis.fit_distances`) of the residual (the paper's
accumulated gradient) at the last checked epoch, with W1 in gradient units.

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

import math
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
    "PAPER_MODELS",
    "PAPER_TABLE1",
    "check_epoch",
    "device_gradient",
    "format_paper_table",
    "format_table",
    "define_flags",
    "main",
    "plot_histograms",
    "read_rows",
]


# The ldte_bs paper's Table 1 (CIFAR-10): the "EMD" of each model's
# accumulated gradients to a Gaussian and a Laplacian, geometric mean over
# layers, in the paper's unstated unit.
PAPER_TABLE1 = {
    "alexnet": {"gaussian": 19.273, "laplace": 13.2476},
    "vgg19": {"gaussian": 28.810, "laplace": 13.628},
    "resnet50": {"gaussian": 8.343, "laplace": 4.694},
    "densenet121": {"gaussian": 35.846, "laplace": 19.005},
    "senet18": {"gaussian": 46.224, "laplace": 27.316},
}
# --models=paper: the paper's list, in its order.
PAPER_MODELS = tuple(PAPER_TABLE1)


def format_paper_table(rows: list) -> str:
    """The paper's Table 1 beside ours, in markdown: one row per model of ``PAPER_TABLE1`` run.

    Ours is the residual row (the paper measures the accumulated gradient
    ``R_l``) of the last checked epoch, or the gradient row where the
    compressor keeps no residual (the ``kind`` column says which): the
    histogram EMD in bins for each family, the paper's number before it, and
    W1 in gradient units after. Empty when no model of the paper's list is in
    ``rows``.
    """
    last = {}
    for r in rows:
        if r["model"] not in PAPER_TABLE1:
            continue
        key = r["model"]
        best = last.get(key)
        rank = (r["epoch"], r["kind"] == "residual")
        if best is None or rank > (best["epoch"], best["kind"] == "residual"):
            last[key] = r
    if not last:
        return ""
    lines = [
        "| model | epoch | kind | Gaussian EMD paper | Gaussian EMD ours | Laplacian EMD paper "
        "| Laplacian EMD ours | closer: paper | closer: ours (layers) | W1 Gaussian ours "
        "| W1 Laplace ours |",
        "|" + "---|" * 11,
    ]
    for model in PAPER_MODELS:
        r = last.get(model)
        if r is None:
            continue
        paper = PAPER_TABLE1[model]
        cells = [
            model,
            str(r["epoch"]),
            r["kind"],
            f"{paper['gaussian']:.3f}",
            f"{r.get('gaussian_emd', math.nan):.3f}",
            f"{paper['laplace']:.3f}",
            f"{r.get('laplace_emd', math.nan):.3f}",
            "Laplace",
            f"Laplace {r['laplace_closer']}/{r['num_leaves']}",
            f"{r['gaussian']:.3e}",
            f"{r['laplace']:.3e}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _models(spec: str) -> list:
    """The ``--models`` list; ``paper`` stands for ``PAPER_MODELS``."""
    names = []
    for m in (m.strip() for m in spec.split(",")):
        if m == "paper":
            names += PAPER_MODELS
        elif m:
            names.append(m)
    return names


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("models", "mlp", "comma list; 'paper': the paper's Table 1 list", **fv)
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
    models = _models(args.models)
    from experiments import data  # noqa: PLC0415

    side = data.DATASET_SPECS.get(args.dataset, (0, (32, 32, 3)))[1][:2]
    small = [m for m in models if m in PAPER_MODELS] if side != (32, 32) else []
    if small:
        # Five poolings (VGG) or a stride-4 stem and three (AlexNet) leave nothing of 8x8.
        raise ValueError(
            f"--models: {', '.join(small)} are CIFAR models and need 32x32 images; "
            f"--dataset={args.dataset} has {side[0]}x{side[1]}: use cifar10 or synthetic_cifar"
        )
    from experiments.compare import set_cpu_devices  # noqa: PLC0415

    set_cpu_devices(args.num_devices)
    from experiments import train  # noqa: PLC0415 (after the device count is set)

    check = tuple(int(e) for e in args.epochs_to_check.split(",") if e.strip())
    rows = []
    for model in models:
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
    paper = format_paper_table(rows)
    if paper:
        print("\nThe paper's Table 1 beside ours (EMD: histogram EMD in bins):")
        print(paper)
    os.makedirs(args.outdir, exist_ok=True)
    summary = [{k: v for k, v in r.items() if k != "per_leaf"} for r in rows]
    with open(os.path.join(args.outdir, "table1.json"), "w") as f:
        jsonio.dump(
            {
                "args": cli.values(define_flags, args),
                "rows": summary,
                "markdown": table,
                "paper_markdown": paper,
            },
            f,
            indent=1,
        )
    print(f"per-layer rows and histograms in {args.outdir}/<model>/, table in table1.json")
    return rows


if __name__ == "__main__":
    cli.run(main, define_flags)
