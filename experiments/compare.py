"""The ldte_bs paper's Table 2 comparison at small scale: one command, one table.

Dense baseline, exact top-k, DGC's hierarchical selection, RedSync's trimmed
top-k and LDTE-BS (jaxcomp's default variant and the paper's exact
algorithm, ``variant="paper"``), all at density 0.1% with DGC warm-up and momentum
correction, same seed and data, on 8 simulated CPU devices by default::

    python -m experiments.compare --dataset=digits            # here, ~3 min
    python -m experiments.compare --dataset=cifar10 --model=resnet20 \
        --data_dir=/path/cifar-10-python.tar.gz --epochs=160 --batch_size=512 \
        --num_devices=0                                       # GPU: all devices

``--table=exchanges`` trains LDTE-BS with each sparse all-reduce
(``gtopk``, ``oktopk``, ``scalecom``, ``sparcml``) beside the all-gather
and dense, on 8 simulated devices (~14 min), and ``scalecom`` with its
paper's low-pass filter on the residual (``low_pass=SCALECOM_LOW_PASS``):
the accuracy effect of applying a global top-k of the sum instead of the union.

``--table=peers`` trains the peers' compressors (TernGrad, natural
compression, Signum, bf16 cast, PowerSGD, 1-bit and 0/1 Adam) beside dense,
LDTE-BS and QSGD 4-bit.

``--table=accordion`` trains Accordion (``jaxcomp.accordion``: per layer, the
low compression level in critical regimes, else the high one, decided once
per epoch) over top-k (ratios 0.99 / 0.1) and PowerSGD (ranks 4 / 1) beside
each fixed level and dense: bytes and accuracy.

``--table=qsgd`` runs the QSGD paper's section 5 experiment in small form:
dense and QSGD 2-, 4- and 8-bit (bucket 512; 2-bit also at bucket 128, the
paper's 2-bit setting; leaves of at most 10,000 values dense, the paper's
practice), and prints, beside the usual table, each row's
bits per quantized value packed (what ``jaxcomp.qsgd`` sends), Elias-coded
(the paper's wire format, measured on device 0's messages) and by the
paper's count (``jaxcomp.coding.qsgd_paper_bits``: ``b`` bits a value plus a
float32 scale a bucket), and the paper's stated figures (4-bit: 77% more
than 2-bit at bucket 128, about 8x less than 32-bit)::

    python -m experiments.compare --table=qsgd --dataset=digits

``--table=dlgs`` runs the DLGS paper's comparison instead: dense, global
top-k, layer-wise top-k (LAGS), layer-wise with the paper's threshold reuse
(everything above the reused threshold sent: ``capacity_factor="uncapped"``),
DLGS as the paper runs it (that reuse plus the paper's greedy merge of this
model's layers, its Algorithm 2) and jaxcomp's variant of DLGS
(``dlgs_ours``: reuse capped at 1.5 k, the exact merge planner), in the
paper's schedule (lr 0.1 stepped x0.1 after 4/7 and 6/7 of the epochs, no
warm-up; ratio 0.1 by default, ``--ratio=0.01`` for its second setting) but
14 epochs instead of 140 (``--epochs=140``). It then prints the paper's
Tables 1-2 (final accuracy and loss, training seconds and the speed-up over
dense) and the alpha column beside what the paper states (its tables'
numbers are not in the text we have: their prose is)::

    python -m experiments.compare --table=dlgs --dataset=digits   # ~2.5 min, 2 cores

The paper's four CIFAR-10 runs, one command each (GPU runtime)::

    python -m experiments.compare --table=dlgs --dataset=cifar10 --model=resnet20 \
        --data_dir=/path/cifar-10-python.tar.gz --batch_size=96 --num_devices=0 \
        --epochs=140 --ratio=0.1 --outdir=results/dlgs_resnet20_0.1  # and --ratio=0.01
    python -m experiments.compare --table=dlgs --dataset=cifar10 --model=vgg16 \
        --data_dir=/path/cifar-10-python.tar.gz --batch_size=96 --num_devices=0 \
        --epochs=140 --ratio=0.1 --outdir=results/dlgs_vgg16_0.1     # and --ratio=0.01

The merging rows plan their merge for a 10 GbE link unless ``--merge_alpha``
(seconds per message) and ``--merge_beta`` (seconds per byte) give another,
as in the training program.

Writes ``<outdir>/<name>/metrics.jsonl`` per run (a rerun overwrites them),
``<outdir>/comparison.png``
and ``<outdir>/comparison.json``, and prints the table: final accuracy and
its delta to dense, epochs and training seconds (steps only, compilation and
evaluation excluded) to a target accuracy, alpha (the ldte_bs paper's Table
3: exact top-k's seconds to the target over the run's), median step time and
its split into forward+backward, compression and exposed communication (ms;
also ``<outdir>/time_split.png``, the DLGS paper's Figs. 11-13), bytes per
step per device on the wire (and of the device's own message), their ratio
to dense, density, compression time share, the step's compile time and the
wall time (compilation and evaluation included).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

from absl import flags

from experiments import cli, jsonio
from experiments.setups import DLGS_PAPER_KWARGS, DLGS_REUSE_PERIOD

__all__ = [
    "ACCORDION_TABLE",
    "DLGS_EPOCHS",
    "DLGS_PAPER_CLAIMS",
    "DLGS_TABLE",
    "EXCHANGE_TABLE",
    "PAPER_TABLE2",
    "PEERS_TABLE",
    "QSGD_PAPER_CLAIMS",
    "QSGD_TABLE",
    "SCALECOM_LOW_PASS",
    "TABLES",
    "for_compressor",
    "format_dlgs_paper",
    "format_qsgd_bits",
    "format_table",
    "define_flags",
    "main",
    "run_configs",
    "with_merge_link",
]

# name -> TrainConfig overrides (the comparison's rows); compressor_kwargs are
# the factory's arguments, merged over the table's (for_compressor).
PAPER_TABLE2 = {
    "dense": {"compressor": "dense"},
    "top_k": {"compressor": "top_k"},
    "dgc": {"compressor": "dgc"},
    "trimmed_top_k": {"compressor": "trimmed_top_k"},
    "ldte_bs": {"compressor": "ldte_bs"},
    # Algorithm 2 of the ldte_bs paper exactly (jaxcomp.ldte_bs(variant="paper")).
    "ldte_bs_paper": {"compressor": "ldte_bs", "compressor_kwargs": {"variant": "paper"}},
    # SIDCo (Abdelmoniem et al., MLSys 2021), each fit, stages adapted: an estimated
    # threshold without a search, against LDTE-BS's estimate corrected on counts.
    **{
        f"sidco_{dist}": {"compressor": "sidco", "compressor_kwargs": {"dist": dist}}
        for dist in ("exponential", "gamma", "gpareto")
    },
}


# The DLGS paper's Table 2 methods: uncompressed, global top-k, layer-wise
# top-k (LAGS), and DLGS (threshold reuse and the paper's greedy merge,
# Algorithm 2); beside them threshold reuse alone, and jaxcomp's variant of
# DLGS (the message capped at 1.5 k, the exact merge planner).
DLGS_TABLE = {
    "dense": {"compressor": "dense"},
    "top_k": {"compressor": "top_k", "compressor_kwargs": {"granularity": "global"}},
    "lags": {"compressor": "top_k", "compressor_kwargs": {"granularity": "layer"}},
    "dlgs_reuse": {"compressor": "top_k", "compressor_kwargs": DLGS_PAPER_KWARGS},
    "dlgs": {"compressor": "top_k", "compressor_kwargs": DLGS_PAPER_KWARGS, "merge": "greedy"},
    "dlgs_ours": {
        "compressor": "top_k",
        "compressor_kwargs": {"reuse_period": DLGS_REUSE_PERIOD},
        "merge": "optimal",
    },
}
# What the DLGS paper states for each row of its Tables 1-2 (ResNet-20 and
# VGG-16 on CIFAR-10, ResNet-50 on a 100-class ImageNet subset; 3 workers and
# a parameter server, RTX 4090s over 2x25 Gbit/s RoCE; 140 epochs at batch 32
# per worker). The tables' numbers themselves are not in the text we have
# (the journal's tables are images); only its prose is: "-" marks a row the
# text says nothing about. Table 3's alpha is the ldte_bs paper's measure
# (exact top-k's seconds to the target accuracy over the run's); the DLGS
# paper has no such table, its one speed-up figure is against uncompressed.
DLGS_PAPER_CLAIMS = {
    "dense": {"table1": "reference", "table2": "slowest (comm >> compute)", "alpha": "-"},
    "top_k": {"table1": "-", "table2": "faster than dense", "alpha": "-"},
    "lags": {
        "table1": "-",
        "table2": "more sparsify time than top_k, faster overall",
        "alpha": "-",
    },
    "dlgs": {
        "table1": "very close to dense",
        "table2": "fastest at 0.1 and 0.01; up to 1.99x vs dense (0.01)",
        "alpha": "-",
    },
}
# ScaleCom's low-pass filter beta on the residual: 0.1 is our choice (the
# stabler of 0.5 and 0.1 in one digits run each).
SCALECOM_LOW_PASS = 0.1
# The sparse all-reduces against the all-gather (issue: exchanges that scale
# with N): the same LDTE-BS selection, exchanged differently. gtopk, oktopk
# and scalecom change which elements are applied; sparcml is exact.
EXCHANGE_TABLE = {
    "dense": {"compressor": "dense"},
    "ldte_bs": {"compressor": "ldte_bs"},
    **{
        f"ldte_bs_{e}": {"compressor": "ldte_bs", "exchange": e}
        for e in ("gtopk", "oktopk", "scalecom", "sparcml")
    },
    "ldte_bs_scalecom_low_pass": {
        "compressor": "ldte_bs",
        "exchange": "scalecom",
        "compressor_kwargs": {"low_pass": SCALECOM_LOW_PASS},
    },
}
# The peers' compressors (issue: everything GRACE, DDP hooks, BytePS and
# DeepSpeed ship) beside dense, LDTE-BS and QSGD. Sign methods and the Adams
# take their papers' small learning rates.
PEERS_TABLE = {
    "dense": {"compressor": "dense"},
    "ldte_bs": {"compressor": "ldte_bs"},
    "qsgd_4bit": {"compressor": "qsgd", "compressor_kwargs": {"bits": 4, "bucket_size": 512}},
    "terngrad": {"compressor": "terngrad"},
    "natural": {"compressor": "natural_compression"},
    "signum": {"compressor": "signum", "lr": 1e-3},
    "cast_bf16": {"compressor": "cast", "exchange": "allreduce"},
    "powersgd_r4": {"compressor": "powersgd", "compressor_kwargs": {"rank": 4}},
    "onebit_adam": {"compressor": "onebit_adam", "lr": 1e-3},
    "zero_one_adam": {"compressor": "zero_one_adam", "lr": 1e-3},
}
# Accordion (Agarwal et al., MLSys 2021) against its two fixed levels, for top-k
# (the paper's ratios 0.99 and 0.1) and PowerSGD (ranks 4 and 1); it decides once
# per epoch (compressor_kwargs "interval", default steps_per_epoch).
ACCORDION_TABLE = {
    "dense": {"compressor": "dense"},
    "top_k_0.99": {"compressor": "top_k", "compressor_kwargs": {"ratio": 0.99}},
    "top_k_0.1": {"compressor": "top_k", "compressor_kwargs": {"ratio": 0.1}},
    "accordion_top_k": {
        "compressor": "accordion",
        "compressor_kwargs": {"compressor": "top_k", "low": 0.99, "high": 0.1},
    },
    "powersgd_r4": {"compressor": "powersgd", "compressor_kwargs": {"rank": 4}},
    "powersgd_r1": {"compressor": "powersgd", "compressor_kwargs": {"rank": 1}},
    "accordion_powersgd": {
        "compressor": "accordion",
        "compressor_kwargs": {"compressor": "powersgd", "low": 4, "high": 1},
    },
}
# The QSGD paper's section 5 in small form: 2-, 4- and 8-bit QSGD, bucket 512
# (and 2-bit at bucket 128, the paper's 2-bit setting),
# leaves of at most 10,000 values dense (the paper's practice, jaxcomp.qsgd's
# default, given here so the bit count below cannot drift from it); each row
# measures device 0's Elias-coded message every 5 steps.
_QSGD_MIN_DENSE = 10_000


def _qsgd_row(bits: int, bucket_size: int) -> dict:
    kwargs = {"bits": bits, "bucket_size": bucket_size, "min_dense_size": _QSGD_MIN_DENSE}
    return {"compressor": "qsgd", "compressor_kwargs": kwargs, "coded_bytes_every": 5}


QSGD_TABLE = {
    "dense": {"compressor": "dense"},
    "qsgd_2bit_b128": _qsgd_row(2, 128),
    **{f"qsgd_{b}bit": _qsgd_row(b, 512) for b in (2, 4, 8)},
}
# What the paper's section 5 states for each bit width (the text gives no
# other per-width figure; its accuracies are on ImageNet, CIFAR-10, AN4, MNIST).
QSGD_PAPER_CLAIMS = {
    4: "+77% vs 2-bit (bucket 128), ~8x < 32-bit",
}
# The ldte_bs paper's setting: density 0.1%, DGC warm-up, momentum correction.
_LDTE_SETTING = dict(
    compressor_kwargs={"ratio": 1e-3},
    warmup_epochs=4,
    momentum_correction=True,
    schedule="cosine",
    epochs=30,
)
# Plain SGD with momentum after the compressor, no warm-up and no momentum
# correction (the Accordion and QSGD tables: rows differ only in the compressor).
_PLAIN_SGD_SETTING = dict(
    compressor_kwargs={},
    warmup_epochs=0,
    momentum_correction=False,
    schedule="cosine",
    epochs=30,
)
# The DLGS table's default length: a tenth of the paper's 140 epochs.
DLGS_EPOCHS = 14
# table -> (rows, defaults of the paper's setting for flags left unset).
TABLES = {
    "ldte_bs": (
        PAPER_TABLE2,
        _LDTE_SETTING,
    ),
    "exchanges": (
        EXCHANGE_TABLE,
        _LDTE_SETTING,
    ),
    "peers": (
        PEERS_TABLE,
        _LDTE_SETTING,
    ),
    # Accordion: no warm-up and no momentum correction (SGD momentum after the
    # compressor, the same for every row), so that the rows differ only in the level.
    "accordion": (
        ACCORDION_TABLE,
        _PLAIN_SGD_SETTING,
    ),
    # QSGD: plain SGD with momentum after the compressor, no warm-up.
    "qsgd": (
        QSGD_TABLE,
        _PLAIN_SGD_SETTING,
    ),
    # DLGS: lr 0.1 stepped down x0.1 after 4/7 and 6/7 of the epochs (the
    # paper's 80 and 120 of 140), compression ratio 0.1 (--ratio=0.01 its
    # second), no warm-up. 14 epochs, not the paper's 140, so that the default
    # run takes minutes on a CPU (--epochs=140 for the paper's length).
    "dlgs": (
        DLGS_TABLE,
        dict(
            compressor_kwargs={"ratio": 0.1},
            warmup_epochs=0,
            momentum_correction=True,
            schedule="step",
            epochs=DLGS_EPOCHS,
        ),
    ),
}


def for_compressor(base, overrides: dict):
    """``base`` with ``overrides``, sparsifier-only settings dropped for other compressors.

    ``base`` holds the sparsifiers' settings (``compressor_kwargs`` such as
    the ratio, warm-up, momentum correction); a row's ``compressor_kwargs``
    are merged over the base's key by key. A run of dense or a quantizer gets
    none of the base's (the compressor's defaults) unless ``overrides`` gives
    them, since its factory rejects a sparsifier's arguments.
    """
    from experiments import train  # noqa: PLC0415

    config = dataclasses.replace(base, **overrides)
    own = overrides.get("compressor_kwargs", {})
    if config.compressor in train.SPARSIFIERS:
        return dataclasses.replace(config, compressor_kwargs={**base.compressor_kwargs, **own})
    drop = dict(warmup_epochs=0, momentum_correction=None)
    drop = {n: v for n, v in drop.items() if n not in overrides}
    return dataclasses.replace(config, compressor_kwargs=dict(own), **drop)


def with_merge_link(runs: dict, merge_alpha=None, merge_beta=None) -> dict:
    """``runs`` with the merge planner's link set on the rows that plan a merge.

    Args:
      runs: ``{name: overrides}``, as in ``TABLES``.
      merge_alpha: seconds per message (None: the training program's default,
        10 GbE), given to every row whose ``merge`` is ``"greedy"`` or
        ``"optimal"``.
      merge_beta: seconds per byte (None: the default).

    Raises:
      ValueError: a link is given but no row plans a merge.
    """
    link = {
        n: v for n, v in (("merge_alpha", merge_alpha), ("merge_beta", merge_beta)) if v is not None
    }
    if not link:
        return runs
    merging = [n for n, o in runs.items() if o.get("merge", "none") != "none"]
    if not merging:
        raise ValueError(
            f"--{next(iter(link))} sets the merge planner's link, but no row of this table "
            "plans a merge (--table=dlgs has one)"
        )
    return {n: {**o, **link} if n in merging else o for n, o in runs.items()}


def validate_runs(base, runs: dict) -> dict:
    """``{name: config}`` of every ``{name: overrides}`` run, each validated.

    Raises:
      train.ConfigError: the first row's bad setting, before anything trains.
    """
    from experiments import train  # noqa: PLC0415 (after the device count is set)

    configs = {name: for_compressor(base, overrides) for name, overrides in runs.items()}
    for config in configs.values():
        train.validate_config(config)
    return configs


def run_configs(base, runs: dict, outdir: str) -> dict:
    """Trains every ``{name: overrides}`` run from ``base`` into ``outdir/name``.

    Returns:
      ``{name: train_and_evaluate result}`` (records and final record).
    """
    from experiments import train  # noqa: PLC0415 (after the device count is set)

    configs = validate_runs(base, runs)  # every row's bad setting before the first run trains
    results = {}
    for name, config in configs.items():
        # A comparison is a fresh run: its directory never resumes an older one.
        results[name] = train.train_and_evaluate(config, os.path.join(outdir, name), overwrite=True)
    train.write_plots(
        {n: r["records"] for n, r in results.items()}, os.path.join(outdir, "comparison.png")
    )
    split = {n: _median_split(r["records"]) for n, r in results.items()}
    if all(v["time_step"] >= 0 for v in split.values()):
        train.write_time_split_plot(
            split, os.path.join(outdir, "time_split.png"), title="time per step (median of epochs)"
        )
    return results


def _median_split(records: list) -> dict:
    """``time_<field>`` medians over the epochs that measured the time split (-1: none)."""
    from experiments import train  # noqa: PLC0415

    measured = [r for r in records if r.get("time_step", -1.0) >= 0]
    return {
        f"time_{k}": statistics.median(r[f"time_{k}"] for r in measured) if measured else -1.0
        for k in train.TIME_SPLIT_FIELDS
    }


def _summary(records: list, dense_final: dict, target: float) -> dict:
    final = records[-1]
    hit = next((r for r in records if r["test_accuracy"] >= target), None)
    return {
        "final_accuracy": 100 * final["test_accuracy"],
        "delta_vs_dense": 100 * (final["test_accuracy"] - dense_final["test_accuracy"]),
        "epochs_to_target": hit["epoch"] if hit else None,
        "seconds_to_target": hit["train_time"] if hit else None,
        "step_ms": 1e3 * statistics.median(r["step_time"] for r in records),
        "wire_bytes": final["bytes_per_step_per_device"],
        "wire_ratio": dense_final["bytes_per_step_per_device"]
        / max(final["bytes_per_step_per_device"], 1e-9),
        "message_bytes": final["message_bytes_per_step_per_device"],
        "message_ratio": dense_final["message_bytes_per_step_per_device"]
        / max(final["message_bytes_per_step_per_device"], 1e-9),
        "density": final["density"],
        "compression_time_share": final["compression_time_share"],
        # The step's time split (medians over epochs, ms; -1: not measured).
        **{
            f"{k[len('time_') :]}_ms": 1e3 * v if v >= 0 else -1.0
            for k, v in _median_split(records).items()
        },
        "wall_time": final["wall_time"],
    }


def _with_compile(summary: dict, result: dict) -> dict:
    return {**summary, "compile_time": result.get("compile_time", float("nan"))}


def format_table(
    results: dict, target: float, baseline: str = "dense", speedup_over: str = "top_k"
) -> tuple[str, dict]:
    """A plain-text table of the runs against ``baseline`` (last-epoch bytes).

    Besides accuracy, bytes and times, each row has ``speedup_to_target``:
    the ldte_bs paper's Table 3 alpha, the training seconds ``speedup_over``
    (exact top-k, the paper's radixSelect) needs to reach ``target`` divided
    by the run's (None when either never reaches it), and the step's time
    split (forward+backward, compression, exposed communication; ms).

    Returns:
      ``(table text, {name: summary dict})``.
    """
    dense_final = results[baseline]["final"]
    rows = {
        n: _with_compile(_summary(r["records"], dense_final, target), r) for n, r in results.items()
    }
    reference = rows.get(speedup_over, {}).get("seconds_to_target")
    for s in rows.values():
        reach = s["seconds_to_target"]
        s["speedup_to_target"] = reference / reach if reference and reach else None
    head = (
        f"{'run':<14}{'acc %':>7}{'d acc':>7}{'ep>=' + format(100 * target, '.0f'):>7}"
        f"{'s to tgt':>9}{'alpha':>6}{'step ms':>8}{'fb':>6}{'comp':>6}{'comm':>6}"
        f"{'wire B/step':>12}{'x dense':>8}"
        f"{'msg B/step':>11}{'x dense':>8}{'density':>9}{'comp %':>7}{'compile s':>10}{'wall s':>7}"
    )
    lines = [head, "-" * len(head)]

    def ms(v):
        return "-" if v < 0 else f"{v:.1f}"

    for n, s in rows.items():
        ep = "-" if s["epochs_to_target"] is None else str(s["epochs_to_target"])
        sec = "-" if s["seconds_to_target"] is None else f"{s['seconds_to_target']:.1f}"
        alpha = "-" if s["speedup_to_target"] is None else f"{s['speedup_to_target']:.2f}"
        parts = "".join(
            f"{ms(s[p]):>6}" for p in ("forward_backward_ms", "compression_ms", "communication_ms")
        )
        dens = "-" if s["density"] < 0 else f"{100 * s['density']:.3f}%"
        comp = (
            "-" if s["compression_time_share"] < 0 else f"{100 * s['compression_time_share']:.0f}"
        )
        lines.append(
            f"{n:<14}{s['final_accuracy']:>7.2f}{s['delta_vs_dense']:>+7.2f}{ep:>7}{sec:>9}"
            f"{alpha:>6}{s['step_ms']:>8.1f}{parts}{s['wire_bytes']:>12.0f}{s['wire_ratio']:>8.1f}"
            f"{s['message_bytes']:>11.0f}{s['message_ratio']:>8.1f}{dens:>9}{comp:>7}"
            f"{s['compile_time']:>10.1f}{s['wall_time']:>7.1f}"
        )
    return "\n".join(lines), rows


def format_qsgd_bits(
    results: dict, runs: dict, reference: str = "qsgd_2bit_b128"
) -> tuple[str, dict]:
    """The QSGD table's bits per quantized value: packed, Elias-coded, the paper's count.

    Per run, over the leaves QSGD quantizes (more than ``min_dense_size``
    values; the paper quantizes 99% of its values, here the dense leaves are
    a larger share, so they are left out of the per-value figures as they
    are of the paper's): ``packed`` from the last epoch's
    ``message_bytes_per_step_per_device``, ``elias`` from
    ``coded_bytes_per_step_per_device`` (both with the dense leaves' 32 bits a
    value taken off), ``paper`` by :func:`jaxcomp.coding.qsgd_paper_bits`.
    Each is also given as the ratio to ``reference`` (the paper's 2-bit
    setting, bucket 128, against which it states 4-bit's +77%) and to 32 bits.

    Args:
      results: ``{name: train_and_evaluate result}`` (``params`` and ``final``).
      runs: ``{name: overrides}``, as in ``QSGD_TABLE`` (the QSGD rows give
        ``bits``, ``bucket_size`` and ``min_dense_size``).
      reference: the row the ratios are taken to (absent: no ratio).

    Returns:
      ``(table text, {name: {"bits", "packed", "elias", "paper", ...}})`` for
      the QSGD rows.
    """
    import jax  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    from jaxcomp import coding  # noqa: PLC0415

    rows = {}
    for name, overrides in runs.items():
        if overrides.get("compressor") != "qsgd":
            continue
        kw = overrides["compressor_kwargs"]
        b, d, small = kw["bits"], kw["bucket_size"], kw["min_dense_size"]
        sizes = [int(np.size(x)) for x in jax.tree.leaves(results[name]["params"])]
        quantized = [n for n in sizes if n > small]
        n_q, n_dense = sum(quantized), sum(n for n in sizes if n <= small)
        final = results[name]["final"]

        def per_value(nbytes, n_q=n_q, n_dense=n_dense):
            return (8 * nbytes - 32 * n_dense) / n_q if nbytes >= 0 and n_q else None

        rows[name] = {
            "bits": b,
            "bucket_size": d,
            "quantized_values": n_q,
            "dense_values": n_dense,
            "packed": per_value(final["message_bytes_per_step_per_device"]),
            "elias": per_value(final["coded_bytes_per_step_per_device"]),
            "paper": sum(coding.qsgd_paper_bits(n, b, d) for n in quantized) / n_q if n_q else None,
            "paper_claim": QSGD_PAPER_CLAIMS.get(b, "-"),
        }
    ref_row = rows.get(reference)

    def cell(row, key):
        v = row[key]
        if v is None:
            return f"{'-':>24}"
        vs_ref = f"{100 * (v / ref_row[key] - 1):+.0f}%" if ref_row and ref_row[key] else "-"
        return f"{v:>7.2f}{vs_ref:>8}{32 / v:>8.1f}x"

    head = (
        f"{'run':<16}{'acc %':>7}"
        + "".join(f"{k + ' b/value, vs ref, 32/b':>32}" for k in ("packed", "elias", "paper"))
        + "  paper states"
    )
    lines = [f"bits per quantized value; ref = {reference}", head, "-" * len(head)]
    for name, row in rows.items():
        acc = 100 * results[name]["final"]["test_accuracy"]
        row["accuracy"] = acc
        cells = "".join(f"{cell(row, k):>32}" for k in ("packed", "elias", "paper"))
        lines.append(f"{name:<16}{acc:>7.2f}{cells}  {row['paper_claim']}")
    return "\n".join(lines), rows


def format_dlgs_paper(results: dict, rows: dict, setting: str) -> tuple[str, dict]:
    """The DLGS paper's Tables 1-2 and the alpha column: ours beside what the paper states.

    Per run: Table 1's final test accuracy and training loss, Table 2's
    training seconds (steps only) and their speed-up over dense, and alpha
    (``speedup_to_target`` of :func:`format_table`); the paper's column is
    :data:`DLGS_PAPER_CLAIMS` (its prose: the tables' numbers are not in our
    text). ``msg B``: the device's own message per step, the last epoch's
    mean (with ``capacity_factor="uncapped"``, what passed the thresholds).

    Args:
      results: ``{name: train_and_evaluate result}``; ``"dense"`` among them.
      rows: ``{name: summary}`` as :func:`format_table` returns them.
      setting: one line saying what ours ran (model, data, devices, epochs).

    Returns:
      ``(table text, {name: {"accuracy", "loss", "train_seconds",
      "speedup_vs_dense", "alpha", "message_bytes", "paper": {...}}})``.
    """
    dense_time = results["dense"]["final"]["train_time"] if "dense" in results else None
    out = {}
    for name, result in results.items():
        final, row = result["final"], rows[name]
        seconds = final["train_time"]
        out[name] = {
            "accuracy": 100 * final["test_accuracy"],
            "loss": final["train_loss"],
            "train_seconds": seconds,
            "speedup_vs_dense": dense_time / seconds if dense_time and seconds else None,
            "alpha": row["speedup_to_target"],
            "message_bytes": row["message_bytes"],
            "paper": DLGS_PAPER_CLAIMS.get(name, {"table1": "-", "table2": "-", "alpha": "-"}),
        }

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    lines = [
        "DLGS paper vs ours. Paper: ResNet-20 / VGG-16 on CIFAR-10, ResNet-50 on an "
        "ImageNet subset, 3 GPU workers + parameter server, 140 epochs, batch 32 per worker "
        "(its tables' numbers are not in our text: its prose is quoted). Ours: " + setting,
        f"{'run':<12}{'acc %':>7}{'loss':>8}  {'paper Table 1':<22}"
        f"{'train s':>8}{'x dense':>8}{'msg B':>9}  {'paper Table 2':<54}{'alpha':>6}"
        "  paper alpha",
    ]
    lines.append("-" * len(lines[-1]))
    for name, r in out.items():
        p = r["paper"]
        lines.append(
            f"{name:<12}{r['accuracy']:>7.2f}{r['loss']:>8.4f}  {p['table1']:<22}"
            f"{r['train_seconds']:>8.1f}{num(r['speedup_vs_dense'], '.2f'):>8}"
            f"{r['message_bytes']:>9.0f}  "
            f"{p['table2']:<54}{num(r['alpha'], '.2f'):>6}  {p['alpha']}"
        )
    return "\n".join(lines), out


def set_cpu_devices(num_devices: int) -> None:
    """Simulates ``num_devices`` CPU devices; call before JAX initialises (no-op on GPU)."""
    import jax  # noqa: PLC0415

    if num_devices and jax.config.jax_platforms in (None, "", "cpu"):
        jax.config.update("jax_num_cpu_devices", num_devices)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("dataset", "digits", "Data set.", **fv)
    flags.DEFINE_string("data_dir", None, "CIFAR directory or .tar.gz archive.", **fv)
    flags.DEFINE_string("model", "mlp", "Model.", **fv)
    flags.DEFINE_enum("table", "ldte_bs", sorted(TABLES), "The comparison to run.", **fv)
    flags.DEFINE_integer("epochs", None, "default: the table's", **fv)
    flags.DEFINE_integer("batch_size", 64, "Global batch size.", **fv)
    flags.DEFINE_float("lr", 0.1, "Learning rate.", **fv)
    flags.DEFINE_float("ratio", None, "default: the table's", **fv)
    flags.DEFINE_integer("warmup_epochs", None, "default: the table's", **fv)
    flags.DEFINE_string("schedule", None, "default: the table's", **fv)
    flags.DEFINE_integer("num_devices", 8, "0: every device", **fv)
    flags.DEFINE_integer("seed", 0, "Seed of initialisation and data order.", **fv)
    flags.DEFINE_float("target", 0.95, "accuracy (fraction)", **fv)
    flags.DEFINE_string("outdir", "results/compare", "Output directory.", **fv)
    flags.DEFINE_bool("progress", False, "Show a progress bar.", **fv)
    link = "the DLGS merge planner's link (rows that plan a merge); unset: 10 GbE"
    flags.DEFINE_float("merge_alpha", None, f"s per message, {link}", **fv)
    flags.DEFINE_float("merge_beta", None, f"s per byte, {link}", **fv)


def main(argv) -> dict:
    """Runs the comparison and prints the table."""
    args = cli.parse(define_flags, argv)
    if not 0 <= args.target <= 1:  # NaN too
        cli.fail(f"--target is an accuracy fraction in [0, 1], got {args.target}")
    if args.num_devices < 0:
        cli.fail(f"--num_devices must be >= 0 (0: every device), got {args.num_devices}")
    rows_spec, defaults = TABLES[args.table]
    try:
        rows_spec = with_merge_link(rows_spec, args.merge_alpha, args.merge_beta)
    except ValueError as err:
        cli.fail(str(err))
    set_cpu_devices(args.num_devices)
    from experiments import train  # noqa: PLC0415

    given = {n: getattr(args, n) for n in ("warmup_epochs", "schedule", "epochs")}
    setting = {**defaults, **{n: v for n, v in given.items() if v is not None}}
    if args.ratio is not None:
        setting["compressor_kwargs"] = {**defaults["compressor_kwargs"], "ratio": args.ratio}
    base = train.TrainConfig(
        **setting,
        momentum=0.9,
        num_devices=args.num_devices or None,
        dataset=args.dataset,
        data_dir=args.data_dir,
        model=args.model,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
        progress=args.progress,
        checkpoint=False,
    )
    try:  # a bad setting in one line, as experiments.main says it
        results = run_configs(base, rows_spec, args.outdir)
    except train.ConfigError as err:  # raised before the run it concerns trains
        cli.fail(str(err))
    table, rows = format_table(results, args.target)
    print(table)
    record = {"args": cli.values(define_flags, args), "rows": rows}
    if args.table == "qsgd":
        bits_table, record["qsgd_bits"] = format_qsgd_bits(results, rows_spec)
        print(bits_table)
    if args.table == "dlgs":
        ours = (
            f"{args.model} on {args.dataset}, {args.num_devices or 'all'} devices, "
            f"{base.epochs} epochs, global batch {args.batch_size}, "
            f"ratio {base.compressor_kwargs['ratio']}"
        )
        paper_table, record["dlgs_paper"] = format_dlgs_paper(results, rows, ours)
        print(paper_table)
    with open(os.path.join(args.outdir, "comparison.json"), "w") as f:
        jsonio.dump(record, f, indent=2)
    print(f"plots and JSON in {args.outdir}")
    return rows


if __name__ == "__main__":
    cli.run(main, define_flags)
