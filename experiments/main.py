r"""Command line for data-parallel training with a jaxcomp compressor.

Example (8 simulated CPU devices)::

    python -m experiments.main --compressor=ldte_bs --ratio=1e-3 --warmup_epochs=4 \
        --momentum_correction --num_devices=8 --dataset=digits --model=mlp \
        --epochs=20 --batch_size=64 --lr=0.1 --workdir=/tmp/ldte

Sampling modes (:mod:`jaxcomp.sampling`): ``--sampling=local`` gives each
device a fixed shard it shuffles alone, ``--sampling=replacement`` draws
i.i.d. from the whole set, ``--sampling=feature`` slices the input features
(and the mlp's first layer) over the devices::

    python -m experiments.main --compressor=dense --sampling=feature --num_devices=8 \
        --dataset=digits --model=mlp --epochs=5 --batch_size=64 --workdir=/tmp/feature

CSSGD (coded synchronous SGD, :mod:`jaxcomp.cssgd`): every block of the
batch on ``--redundancy`` devices, dense gradients exchanged by coded
multicast; the batch size must be a multiple of ``C(num_devices, redundancy)``::

    python -m experiments.main --compressor=dense --exchange=coded --redundancy=3 \
        --num_devices=8 --dataset=digits --model=mlp --epochs=20 --batch_size=280 \
        --workdir=/tmp/cssgd

The papers' CIFAR setups (:mod:`experiments.setups`: model, batch size,
epochs, step schedule, weight decay, synchronised BatchNorm, augmentation,
the paper's compressor settings) by name; flags given explicitly override
the setup (here: the compressor, whose unused settings the setup then drops)::

    python -m experiments.main --setup=resnet20_cifar10 --compressor=qsgd \
        --data_dir=/path/cifar-10-python.tar.gz --workdir=/tmp/r20_qsgd

absl flags live only here; one flag per :class:`experiments.train.TrainConfig`
field, and ``--setup``. The configuration is validated before JAX starts any work (every
field, the batch size against the dataset's size, and the optimizer built abstractly, so
that an argument a jaxcomp factory rejects is a one-line error), and
``--num_devices`` is applied to the CPU backend (``jax_num_cpu_devices``)
before any device is queried. What needs the data (an unreadable CIFAR archive, a batch
larger than a smaller CIFAR directory) is checked after reading it, still before anything
is written to the workdir. The workdir's ``config.json`` must match the
flags to resume (``--overwrite`` starts afresh instead); logging is quiet
unless ``--verbose``.
"""

from __future__ import annotations

import dataclasses
import logging as std_logging
import os
import sys

from absl import app, flags, logging

__all__ = ["config_from_flags", "main"]


def _define_flags() -> None:
    # Importing experiments.train imports jax, but does not initialise a
    # backend: device queries happen only inside train_and_evaluate.
    from experiments.setups import SETUPS  # noqa: PLC0415
    from experiments.train import (  # noqa: PLC0415
        COMPRESSORS,
        EXCHANGES,
        NORMS,
        SAMPLINGS,
        TrainConfig,
    )
    from jaxcomp.cssgd import BITS  # noqa: PLC0415

    d = TrainConfig()
    flags.DEFINE_enum(
        "setup",
        None,
        list(SETUPS),
        "A paper's CIFAR setup (experiments/setups.py) to start from; flags given explicitly "
        "override it.",
    )
    flags.DEFINE_enum("compressor", d.compressor, list(COMPRESSORS), "Compressor or 'dense'.")
    # Flags defaulting to None are per compressor: unset means the
    # compressor's default, set for a compressor that does not use it is an error.
    flags.DEFINE_float(
        "ratio", d.ratio, "Target density of the sparsifiers, in (0, 1] (default 1e-3)."
    )
    flags.DEFINE_integer(
        "warmup_epochs", d.warmup_epochs, "Epochs of DGC warm-up (0..4; sparsifiers)."
    )
    flags.DEFINE_float("momentum", d.momentum, "SGD momentum.")
    flags.DEFINE_bool(
        "momentum_correction",
        d.momentum_correction,
        "Momentum on the compressor (DGC momentum correction), plain SGD after it "
        "(default: on for sparsifiers, off otherwise; not for quantizers).",
    )
    flags.DEFINE_enum(
        "granularity",
        d.granularity,
        ["layer", "global"],
        "Selection granularity of the sparsifiers (default layer).",
    )
    flags.DEFINE_integer(
        "reuse_period",
        d.reuse_period,
        "DLGS threshold reuse s: select every s steps, reuse the stored threshold "
        "in between (default 1: off; sparsifiers only).",
    )
    flags.DEFINE_float(
        "low_pass",
        d.low_pass,
        "ScaleCom's low-pass filter beta in (0, 1] on the residual: r <- r + beta (r_new - r), "
        "lossy below 1 (default 1: plain error feedback; sparsifiers only).",
    )
    flags.DEFINE_enum(
        "merge",
        d.merge,
        ["none", "greedy", "optimal"],
        "DLGS layer merging planned from this model's measured backward times: "
        "none, greedy (the paper's Algorithm 2) or optimal (default none; sparsifiers only).",
    )
    flags.DEFINE_float(
        "merge_alpha",
        d.merge_alpha,
        "The merge planner's link latency in seconds per message, t_c = alpha + beta * bytes "
        "(default 50e-6, 10 GbE; only with --merge greedy or optimal).",
    )
    flags.DEFINE_float(
        "merge_beta",
        d.merge_beta,
        "The merge planner's link time in seconds per byte (default 8e-10, i.e. 1.25e9 bytes/s, "
        "10 GbE; only with --merge greedy or optimal).",
    )
    flags.DEFINE_integer(
        "min_dense_size",
        d.min_dense_size,
        "Leaves this small are sent dense (default: the compressor's, 0 or qsgd's 10000).",
    )
    flags.DEFINE_integer("levels", d.levels, "QSGD levels s (qsgd only; default 16).")
    flags.DEFINE_integer(
        "bits", d.bits, "QSGD 'b-bit' as in the paper: s = 2**bits levels (not with --levels)."
    )
    flags.DEFINE_integer("bucket_size", d.bucket_size, "Quantizer bucket size (default: leaf).")
    flags.DEFINE_integer("rank", d.rank, "PowerSGD rank (powersgd only; default 4).")
    flags.DEFINE_integer(
        "freeze_step",
        d.freeze_step,
        "1-bit / 0/1 Adam: steps of Adam warm-up before the variance is frozen and the "
        "momentum goes 1-bit (default: a fifth of the run).",
    )
    flags.DEFINE_integer("num_devices", d.num_devices, "Mesh size (simulated devices on CPU).")
    flags.DEFINE_string("dataset", d.dataset, "digits | synthetic | cifar10 | cifar100.")
    flags.DEFINE_string("data_dir", d.data_dir, "CIFAR directory or .tar.gz archive.")
    flags.DEFINE_bool("download", d.download, "Download CIFAR if data_dir does not exist.")
    flags.DEFINE_string(
        "model",
        d.model,
        "mlp | cnn | resnet20 | vgg16 | resnet50 | resnet101 | densenet121 | densenet169.",
    )
    flags.DEFINE_enum(
        "norm",
        d.norm,
        list(NORMS),
        "Normalisation of the CIFAR models: group (GroupNorm) or batch (BatchNorm with the "
        "statistics averaged over the devices; running averages evaluate).",
    )
    flags.DEFINE_bool(
        "augment",
        d.augment,
        "Standard CIFAR augmentation: random crop of the image padded by 4 pixels, random "
        "horizontal flip.",
    )
    flags.DEFINE_float(
        "weight_decay", d.weight_decay, "L2 weight decay added to the gradient (>= 0)."
    )
    flags.DEFINE_integer("epochs", d.epochs, "Total epochs.")
    flags.DEFINE_integer("batch_size", d.batch_size, "Global batch size.")
    flags.DEFINE_float("lr", d.lr, "Peak learning rate.")
    flags.DEFINE_enum(
        "schedule",
        d.schedule,
        ["constant", "cosine", "step"],
        "Learning-rate schedule (step: x--lr_decay at each of --lr_milestones, by default "
        "x0.1 at 4/7 and 6/7 of the epochs, as DLGS).",
    )
    flags.DEFINE_list(
        "lr_milestones",
        list(map(str, d.lr_milestones)),
        "Comma list of epochs from which the step schedule multiplies the rate by --lr_decay "
        "(--schedule=step; empty: 4/7 and 6/7 of the epochs).",
    )
    flags.register_validator(
        "lr_milestones",
        lambda v: all(e.strip().isdigit() for e in v),
        message="--lr_milestones must be a comma list of epoch numbers",
    )
    flags.DEFINE_float("lr_decay", d.lr_decay, "Factor of the step schedule, in (0, 1].")
    flags.DEFINE_integer("seed", d.seed, "Seed of initialisation and data order.")
    flags.DEFINE_bool("progress", d.progress, "Show a progress bar.")
    flags.DEFINE_bool("checkpoint", d.checkpoint, "Checkpoint every epoch and resume.")
    flags.DEFINE_bool(
        "time_split",
        d.time_split,
        "Measure each epoch where a step's time goes: forward+backward, compression, exposed "
        "communication (metrics.jsonl time_*, time_split.png).",
    )
    flags.DEFINE_integer("max_steps_per_epoch", d.max_steps_per_epoch, "Truncate epochs.")
    flags.DEFINE_integer(
        "eval_examples",
        d.eval_examples,
        "Evaluate on the first N test examples only (quick CPU runs; default: all).",
    )
    flags.DEFINE_integer(
        "coded_bytes_every",
        d.coded_bytes_every,
        "qsgd: every N steps measure the Elias-coded size of device 0's message on the host "
        "(metrics: coded_bytes_per_step_per_device).",
    )
    flags.DEFINE_string("coordinator_address", None, "Multi-process coordinator host:port.")
    flags.DEFINE_integer("num_processes", None, "Number of processes.")
    flags.DEFINE_integer("process_id", None, "This process's index.")
    flags.DEFINE_list(
        "fit_check_epochs",
        list(d.fit_check_epochs),
        "Comma list of epochs after which to measure W1 of device 0's gradient and residual "
        "to fitted Laplace and Gaussian (fit_check.json, fit_check_epoch<E>.png; "
        "see experiments/fit_check.py).",
    )
    flags.register_validator(
        "fit_check_epochs",
        lambda v: all(e.strip().isdigit() for e in v),
        message="--fit_check_epochs must be a comma list of epoch numbers",
    )
    flags.DEFINE_enum(
        "exchange",
        d.exchange,
        list(EXCHANGES),
        "default: the compressor's own exchange; coded: CSSGD, blocks on --redundancy "
        "devices and coded multicast of the dense gradients; uncoded: the same assignment, "
        "missing blocks sent whole (both need --compressor=dense and --redundancy); "
        "sparsifiers: sparse, dense, server, sparcml, gtopk, oktopk, scalecom, auto, "
        "auto_topk; quantizers: allgather, allreduce, server (signum: majority, its default).",
    )
    flags.DEFINE_integer(
        "redundancy",
        d.redundancy,
        "CSSGD's r: devices per block, in [1, num_devices] (coded/uncoded only; batch_size "
        "a multiple of C(num_devices, r)).",
    )
    flags.DEFINE_float(
        "coded_value_range",
        d.coded_value_range,
        "CSSGD's integer range [-v, v]; larger gradient values are clipped and counted "
        "(default 10, the paper's; coded/uncoded only).",
    )
    flags.DEFINE_enum(
        "coded_bits",
        None if d.coded_bits is None else str(d.coded_bits),
        [str(b) for b in BITS],
        "CSSGD's integer width on the wire (default 32, the paper's; coded/uncoded only).",
    )
    flags.DEFINE_enum(
        "sampling",
        d.sampling,
        list(SAMPLINGS),
        "How the devices share the data (jaxcomp.sampling): global (one shuffle of the "
        "training set per epoch), replacement (each device draws i.i.d. from the whole set), "
        "local (each device shuffles only its own fixed shard), feature (each device holds a "
        "slice of the input features and of the mlp's first layer, the rest replicated).",
    )
    flags.DEFINE_string("workdir", "/tmp/jaxcomp_run", "Output directory.")
    flags.DEFINE_bool(
        "overwrite",
        False,
        "Delete the workdir's checkpoints and metrics first (needed when they belong to "
        "another configuration).",
    )
    flags.DEFINE_bool("verbose", False, "Show INFO logging (absl, orbax, jax).")


_define_flags()
FLAGS = flags.FLAGS


def config_from_flags():
    """A :class:`experiments.train.TrainConfig` from the parsed flags.

    With ``--setup``, the setup's configuration with the flags given
    explicitly on the command line applied over it
    (:func:`experiments.setups.setup_config`); the other flags' defaults are
    not used.
    """
    from experiments import setups  # noqa: PLC0415
    from experiments.train import TrainConfig  # noqa: PLC0415

    names = [f.name for f in dataclasses.fields(TrainConfig)]
    values = {n: getattr(FLAGS, n) for n in names}
    values["fit_check_epochs"] = tuple(int(e) for e in values["fit_check_epochs"])
    values["lr_milestones"] = tuple(int(e) for e in values["lr_milestones"])
    if values["coded_bits"] is not None:  # an enum flag holds strings
        values["coded_bits"] = int(values["coded_bits"])
    if FLAGS.setup is None:
        return TrainConfig(**values)
    return setups.setup_config(FLAGS.setup, **{n: values[n] for n in names if FLAGS[n].present})


def _set_logging(verbose: bool) -> None:
    """absl (and so orbax) and jax loggers at WARNING unless verbose."""
    level = std_logging.INFO if verbose else std_logging.WARNING
    if not FLAGS["verbosity"].present:  # an explicit --verbosity wins
        logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    for name in ("jax", "orbax", "absl"):
        std_logging.getLogger(name).setLevel(level)


def main(argv) -> None:
    """Validates the flags, sets up devices / processes, then trains."""
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    _set_logging(FLAGS.verbose)
    import jax  # noqa: PLC0415

    from experiments import data, train  # noqa: PLC0415

    config = config_from_flags()
    # Everything that does not need devices is checked before JAX starts.
    try:
        train.validate_config(config)
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    path = data.dataset_path(config.dataset, config.data_dir)
    if path is not None and not config.download and not os.path.exists(path):
        sys.exit(f"error: {data.missing_data_message(config.dataset, path, cli=True)}")
    multi = config.coordinator_address is not None
    if multi:
        train.jaxcomp.distributed.initialize_multiprocess(
            config.coordinator_address,
            config.num_processes,
            config.process_id,
            local_device_count=(config.num_devices // config.num_processes)
            if config.num_devices and jax.config.jax_platforms in (None, "", "cpu")
            else None,
        )
    elif config.num_devices and jax.config.jax_platforms in (None, "", "cpu"):
        # Must precede the first device query; harmless when a GPU is used.
        jax.config.update("jax_num_cpu_devices", config.num_devices)
    try:
        result = train.train_and_evaluate(config, FLAGS.workdir, overwrite=FLAGS.overwrite)
    except (train.ConfigError, train.WorkdirError) as e:  # raised before any training
        sys.exit(f"error: {e}")
    final = result["final"]
    if final is not None and jax.process_index() == 0:
        name = config.compressor
        if train.is_coded(config):
            name = f"{config.exchange} r={config.redundancy}"
        if config.sampling != "global":
            name = f"{name} ({config.sampling} sampling)"
        print(
            f"{name}: test accuracy {100 * final['test_accuracy']:.2f}% after "
            f"{final['epoch']} epochs, {final['bytes_per_step_per_device']:.0f} bytes/step/device, "
            f"wall {final['wall_time']:.1f}s; outputs in {FLAGS.workdir}"
        )


if __name__ == "__main__":
    app.run(main)
