"""The measurement behind the ldte_bs paper's distribution check (Table 1, Fig. 1).

At chosen epochs a training run (``experiments.train`` with
``fit_check_epochs``) measures, for one device's gradient and one device's
residual, the Wasserstein-1 distance of every layer (leaves of at least
``MIN_SIZE`` elements) to a Laplace and a Gaussian fitted by moments
(:func:`jaxcomp.analysis.tree_fit_distances`), and their geometric mean over
layers, and draws the largest layers' histograms with both fitted densities.
:mod:`experiments.fit_check` is the program that runs it (and documents what
is measured); this module is what the training loop calls, so that the
program can import the training loop without a cycle.
"""

from __future__ import annotations

import json
import math
import os

import numpy as np

from experiments import jsonio

__all__ = [
    "FIT_CHECK_FILE",
    "MIN_SIZE",
    "check_epoch",
    "device_gradient",
    "format_table",
    "plot_histograms",
    "read_rows",
]

FIT_CHECK_FILE = "fit_check.json"
MIN_SIZE = 1000  # leaves below this are skipped (biases), as tree_fit_distances' default
_PLOT_LAYERS = 3


def device_gradient(model, params, x, y):
    """The gradient of the mean cross-entropy on ``(x, y)`` (one device's shard), on one device.

    Args:
      model: the flax module.
      params: host (numpy) parameters.
      x: the inputs of one device's shard.
      y: their integer labels.
    """
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    def loss_fn(p):
        logits = model.apply({"params": p}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return jax.tree.map(np.asarray, jax.jit(jax.grad(loss_fn))(params))


def _device0(tree):
    """Device 0's slice of a per-device tree (leading device axis) as host numpy."""
    import jax  # noqa: PLC0415

    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0))[0], tree)


def _row(kind: str, epoch: int, config, tree) -> dict:
    from jaxcomp.analysis import tree_fit_distances  # noqa: PLC0415

    per_leaf, summary = tree_fit_distances(tree, min_size=MIN_SIZE)
    return {
        "model": config.model,
        "dataset": config.dataset,
        "compressor": config.compressor,
        "epoch": epoch,
        "kind": kind,
        "laplace": float(summary["laplace"]),
        "gaussian": float(summary["gaussian"]),
        "laplace_emd": float(summary["laplace_emd"]),
        "gaussian_emd": float(summary["gaussian_emd"]),
        "laplace_closer": int(summary["laplace_closer"]),
        "num_leaves": summary["num_leaves"],
        "num_skipped": summary["num_skipped"],
        "per_leaf": {
            name: {
                "laplace": float(d["laplace"]),
                "gaussian": float(d["gaussian"]),
                "laplace_emd": float(d["laplace_emd"]),
                "gaussian_emd": float(d["gaussian_emd"]),
                "size": d["size"],
            }
            for name, d in per_leaf.items()
        },
    }


def read_rows(workdir: str) -> list:
    """The rows of ``workdir/fit_check.json`` (empty when there is none)."""
    path = os.path.join(workdir, FIT_CHECK_FILE)
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def check_epoch(workdir: str, epoch: int, *, config, model, params, opt_state, batch, num_devices):
    """Measures device 0's gradient and residual; appends rows to ``fit_check.json``, plots.

    Called by ``experiments.train.train_and_evaluate`` after each epoch in
    ``config.fit_check_epochs``. Rows of this or later epochs already in the
    file (an earlier run resumed from an older checkpoint) are replaced.

    Args:
      workdir: the run's directory.
      epoch: the 1-based epoch just finished.
      config: the resolved ``TrainConfig``.
      model: the flax module.
      params: the replicated parameters after the epoch.
      opt_state: the per-device optimizer state (leading device axis).
      batch: ``(x, y)`` host arrays of this process's rows of the last batch.
      num_devices: mesh size.

    Returns:
      The new rows.
    """
    import jax  # noqa: PLC0415
    import optax  # noqa: PLC0415

    host_params = jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
    per_device = config.batch_size // num_devices
    x, y = batch
    trees = {"gradient": device_gradient(model, host_params, x[:per_device], y[:per_device])}
    try:
        trees["residual"] = _device0(optax.tree.get(opt_state, "residual"))
    except (KeyError, ValueError):  # no error feedback (dense)
        pass
    rows = [_row(kind, epoch, config, tree) for kind, tree in trees.items()]
    if jax.process_index() == 0:
        kept = [r for r in read_rows(workdir) if r["epoch"] < epoch]
        with open(os.path.join(workdir, FIT_CHECK_FILE), "w") as f:
            jsonio.dump(kept + rows, f, indent=1)
        plot_histograms(
            trees,
            rows,
            os.path.join(workdir, f"fit_check_epoch{epoch}.png"),
            title=f"{config.model} on {config.dataset}, {config.compressor}, epoch {epoch}",
        )
    return rows


def _leaf(tree, name: str) -> np.ndarray:
    import jax  # noqa: PLC0415

    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        if jax.tree_util.keystr(path, simple=True, separator="/") == name:
            return np.asarray(leaf, np.float64).ravel()
    raise KeyError(name)


def plot_histograms(trees: dict, rows: list, path: str, title: str = "") -> None:
    """Fig. 1: histograms of the largest layers with the fitted Laplace and Gaussian densities.

    Args:
      trees: ``{kind: pytree}`` (``"gradient"``, ``"residual"``).
      rows: the matching :func:`check_epoch` rows (their per-layer distances
        go in the legends).
      path: the PNG to write.
      title: the figure's title.
    """
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    by_kind = {r["kind"]: r for r in rows}
    sizes = by_kind["gradient"]["per_leaf"]
    names = sorted(sizes, key=lambda n: -sizes[n]["size"])[:_PLOT_LAYERS]
    kinds = [k for k in ("gradient", "residual") if k in trees]
    fig, axes = plt.subplots(
        len(kinds), len(names), figsize=(4.2 * len(names), 3.4 * len(kinds)), squeeze=False
    )
    for i, kind in enumerate(kinds):
        for j, name in enumerate(names):
            ax = axes[i][j]
            v = _leaf(trees[kind], name)
            mu, sd = v.mean(), v.std()
            b = sd / math.sqrt(2.0)
            lo, hi = v.min(), v.max()
            if sd > 0:
                lo, hi = max(lo, mu - 10 * sd), min(hi, mu + 10 * sd)
            if not hi > lo:
                lo, hi = mu - 1.0, mu + 1.0
            dens, _, _ = ax.hist(
                v, bins=120, range=(lo, hi), density=True, color="0.6", label="empirical"
            )
            if sd > 0:
                t = np.linspace(lo, hi, 600)
                d = by_kind[kind]["per_leaf"][name]
                lap = np.exp(-np.abs(t - mu) / b) / (2 * b)
                gau = np.exp(-0.5 * ((t - mu) / sd) ** 2) / (sd * math.sqrt(2 * math.pi))
                ax.plot(t, lap, "C3", lw=1.4, label=f"Laplace, W1={d['laplace']:.2e}")
                ax.plot(t, gau, "C0", lw=1.4, ls="--", label=f"Gaussian, W1={d['gaussian']:.2e}")
            ax.set_yscale("log")
            if np.any(dens > 0):  # the Gaussian's tails would stretch the axis to 1e-20
                ax.set_ylim(bottom=0.3 * dens[dens > 0].min())
            ax.set_title(f"{kind}: {name} ({v.size})", fontsize=9)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def format_table(rows: list) -> str:
    """Table 1 in markdown: per model and epoch, geometric-mean W1 of gradients and residuals.

    Each distance cell is ``W1 (EMD)``: W1 in the gradient's units, then the
    histogram EMD in bins (:func:`jaxcomp.analysis.fit_distances`), the unit
    we read the paper's Table 1 in. Rows written before the EMD existed show
    ``-`` for it.
    """
    keyed = {}
    for r in rows:
        keyed.setdefault((r["model"], r["epoch"]), {})[r["kind"]] = r
    head = (
        "| model | epoch | gradient W1 (EMD) Laplace | gradient W1 (EMD) Gaussian "
        "| gradient Laplace closer | residual W1 (EMD) Laplace | residual W1 (EMD) Gaussian "
        "| residual Laplace closer |"
    )
    lines = [head, "|" + "---|" * 8]
    for (model, epoch), kinds in keyed.items():
        cells = [model, str(epoch)]
        for kind in ("gradient", "residual"):
            r = kinds.get(kind)
            if r is None:
                cells += ["-", "-", "-"]
            else:
                cells += [
                    f"{r['laplace']:.3e} ({_emd(r, 'laplace')})",
                    f"{r['gaussian']:.3e} ({_emd(r, 'gaussian')})",
                    f"{r['laplace_closer']}/{r['num_leaves']} layers",
                ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _emd(row: dict, family: str) -> str:
    value = row.get(f"{family}_emd")
    return "-" if value is None else f"{value:.2f}"
