"""The run's plots: accuracy vs epoch and vs bytes, and the stacked time split of a step."""

from __future__ import annotations

import numpy as np

__all__ = ["TIME_SPLIT_PARTS", "accuracy_figure", "write_plots", "write_time_split_plot"]

# The parts that add up to a step, bottom to top in the stacked bars.
TIME_SPLIT_PARTS = ("forward_backward", "compression", "communication")


def write_plots(runs: dict, path: str) -> None:
    """Test accuracy vs epoch and vs cumulative bytes per device, one line per run.

    Args:
      runs: ``{label: [epoch record, ...]}`` as written to ``metrics.jsonl``.
      path: the PNG to write.
    """
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig = accuracy_figure(runs, plt)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def accuracy_figure(runs: dict, plt):
    """The figure :func:`write_plots` saves (``plt``: ``matplotlib.pyplot``).

    The bytes axis is logarithmic (runs differ by orders of magnitude), but
    symmetric-log below the smallest positive byte count: a run that sends
    nothing (a coded run with ``r = n``) sits at 0 instead of being dropped
    with matplotlib's "Data has no positive values" warning; with no bytes at
    all the axis is linear.
    """
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    sent = []
    for label, records in runs.items():
        epochs = [r["epoch"] for r in records]
        acc = [100 * r["test_accuracy"] for r in records]
        ax1.plot(epochs, acc, marker="o", label=label)
        sent += [r["cumulative_bytes_per_device"] for r in records]
        ax2.plot([r["cumulative_bytes_per_device"] for r in records], acc, marker="o", label=label)
    ax1.set(xlabel="epoch", ylabel="test accuracy (%)", title="accuracy vs epoch")
    ax2.set(
        xlabel="cumulative bytes on the wire per device",
        ylabel="test accuracy (%)",
        title="accuracy vs communication",
    )
    positive = [b for b in sent if b > 0]
    if positive and len(positive) == len(sent):
        ax2.set_xscale("log")
    elif positive:
        ax2.set_xscale("symlog", linthresh=min(positive))
    for ax in (ax1, ax2):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    return fig


def write_time_split_plot(bars: dict, path: str, title: str = "time per step") -> None:
    """Stacked bars of a step's time: forward+backward, compression, exposed communication.

    The form of the DLGS paper's Figs. 11-13 (one bar per method) or, for one
    run, one bar per epoch.

    Args:
      bars: ``{label: record}``, each record holding ``time_<part>`` seconds
        for the parts of ``TIME_SPLIT_PARTS`` (a ``metrics.jsonl`` record).
      path: the PNG to write.
      title: the plot's title.
    """
    import matplotlib  # noqa: PLC0415 (plotting is optional at import time)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    labels = list(bars)
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.9 * len(labels)), 4))
    bottom = np.zeros(len(labels))
    for part in TIME_SPLIT_PARTS:
        ms = np.array([1e3 * max(bars[k][f"time_{part}"], 0.0) for k in labels])
        ax.bar(
            labels,
            ms,
            bottom=bottom,
            label=part.replace("_", "+", 1) if part == "forward_backward" else part,
        )
        bottom += ms
    ax.set(ylabel="ms per step", title=title, ylim=(0, 1.3 * max(bottom.max(), 1e-9)))
    ax.tick_params(axis="x", labelrotation=30)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(loc="upper center", ncol=3, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
