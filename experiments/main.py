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

absl flags live only here: one flag per :class:`experiments.train.TrainConfig`
field, generated from the field (its type and default; its help in ``_HELP``), and
``--setup``. The configuration is validated before JAX starts any work (every
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


# The help of each TrainConfig field's flag (a field without one fails at import).
_HELP = {
    "compressor": "Compressor or 'dense'.",
    "ratio": "Target density of the sparsifiers, in (0, 1] (default 1e-3).",
    "warmup_epochs": "Epochs of DGC warm-up (0..4; sparsifiers).",
    "momentum": "SGD momentum.",
    "momentum_correction": (
        "Momentum on the compressor (DGC momentum correction), plain SGD after it (default: on "
        "for sparsifiers, off otherwise; not for quantizers)."
    ),
    "granularity": "Selection granularity of the sparsifiers (default layer).",
    "reuse_period": (
        "DLGS threshold reuse s: select every s steps, reuse the stored threshold in between "
        "(default 1: off; sparsifiers only)."
    ),
    "low_pass": (
        "ScaleCom's low-pass filter beta in (0, 1] on the residual: r <- r + beta (r_new - r), "
        "lossy below 1 (default 1: plain error feedback; sparsifiers only)."
    ),
    "merge": (
        "DLGS layer merging planned from this model's measured backward times: none, greedy "
        "(the paper's Algorithm 2) or optimal (default none; sparsifiers only)."
    ),
    "merge_alpha": (
        "The merge planner's link latency in seconds per message, t_c = alpha + beta * bytes "
        "(default 50e-6, 10 GbE; only with --merge greedy or optimal)."
    ),
    "merge_beta": (
        "The merge planner's link time in seconds per byte (default 8e-10, i.e. 1.25e9 "
        "bytes/s, 10 GbE; only with --merge greedy or optimal)."
    ),
    "min_dense_size": (
        "Leaves this small are sent dense (default: the compressor's, 0 or qsgd's 10000)."
    ),
    "levels": "QSGD levels s (qsgd only; default 16).",
    "bits": "QSGD 'b-bit' as in the paper: s = 2**bits levels (not with --levels).",
    "bucket_size": "Quantizer bucket size (default: leaf).",
    "num_devices": "Mesh size (simulated devices on CPU).",
    "dataset": "digits | synthetic | cifar10 | cifar100.",
    "data_dir": "CIFAR directory or .tar.gz archive.",
    "download": "Download CIFAR if data_dir does not exist.",
    "model": "mlp | cnn | resnet20 | vgg16 | resnet50 | resnet101 | densenet121 | densenet169.",
    "epochs": "Total epochs.",
    "batch_size": "Global batch size.",
    "lr": "Peak learning rate.",
    "schedule": (
        "Learning-rate schedule (step: x--lr_decay at each of --lr_milestones, by default x0.1 "
        "at 4/7 and 6/7 of the epochs, as DLGS)."
    ),
    "seed": "Seed of initialisation and data order.",
    "progress": "Show a progress bar.",
    "checkpoint": "Checkpoint every epoch and resume.",
    "time_split": (
        "Measure each epoch where a step's time goes: forward+backward, compression, exposed "
        "communication (metrics.jsonl time_*, time_split.png)."
    ),
    "max_steps_per_epoch": "Truncate epochs.",
    "coded_bytes_every": (
        "qsgd: every N steps measure the Elias-coded size of device 0's message on the host "
        "(metrics: coded_bytes_per_step_per_device)."
    ),
    "coordinator_address": "Multi-process coordinator host:port.",
    "num_processes": "Number of processes.",
    "process_id": "This process's index.",
    "fit_check_epochs": (
        "Comma list of epochs after which to measure W1 of device 0's gradient and residual to "
        "fitted Laplace and Gaussian (fit_check.json, fit_check_epoch<E>.png; see "
        "experiments/fit_check.py)."
    ),
    "exchange": (
        "default: the compressor's own exchange; coded: CSSGD, blocks on --redundancy devices "
        "and coded multicast of the dense gradients; uncoded: the same assignment, missing "
        "blocks sent whole (both need --compressor=dense and --redundancy); sparsifiers: "
        "sparse, dense, server, sparcml, gtopk, oktopk, scalecom, auto, auto_topk; quantizers: "
        "allgather, allreduce, server (signum: majority, its default)."
    ),
    "redundancy": (
        "CSSGD's r: devices per block, in [1, num_devices] (coded/uncoded only; batch_size a "
        "multiple of C(num_devices, r))."
    ),
    "coded_value_range": (
        "CSSGD's integer range [-v, v]; larger gradient values are clipped and counted "
        "(default 10, the paper's; coded/uncoded only)."
    ),
    "coded_bits": (
        "CSSGD's integer width on the wire (default 32, the paper's; coded/uncoded only)."
    ),
    "sampling": (
        "How the devices share the data (jaxcomp.sampling): global (one shuffle of the "
        "training set per epoch), replacement (each device draws i.i.d. from the whole set), "
        "local (each device shuffles only its own fixed shard), feature (each device holds a "
        "slice of the input features and of the mlp's first layer, the rest replicated)."
    ),
    "rank": "PowerSGD rank (powersgd only; default 4).",
    "freeze_step": (
        "1-bit / 0/1 Adam: steps of Adam warm-up before the variance is frozen and the "
        "momentum goes 1-bit (default: a fifth of the run)."
    ),
    "lr_milestones": (
        "Comma list of epochs from which the step schedule multiplies the rate by --lr_decay "
        "(--schedule=step; empty: 4/7 and 6/7 of the epochs)."
    ),
    "lr_decay": "Factor of the step schedule, in (0, 1].",
    "weight_decay": "L2 weight decay added to the gradient (>= 0).",
    "norm": (
        "Normalisation of the CIFAR models: group (GroupNorm) or batch (BatchNorm with the "
        "statistics averaged over the devices; running averages evaluate)."
    ),
    "augment": (
        "Standard CIFAR augmentation: random crop of the image padded by 4 pixels, random "
        "horizontal flip."
    ),
    "eval_examples": "Evaluate on the first N test examples only (quick CPU runs; default: all).",
}


# Fields that are comma lists of epochs (tuple[int, ...] in TrainConfig).
_EPOCH_LISTS = ("fit_check_epochs", "lr_milestones")


def _choices() -> dict:
    """The enum flags' allowed values, per field (``coded_bits`` as strings)."""
    # Importing experiments.config imports jax, but does not initialise a
    # backend: device queries happen only inside train_and_evaluate.
    from experiments import config  # noqa: PLC0415
    from jaxcomp.cssgd import BITS  # noqa: PLC0415

    return {
        "compressor": config.COMPRESSORS,
        "granularity": ("layer", "global"),
        "merge": config.MERGES,
        "norm": config.NORMS,
        "schedule": config.SCHEDULES,
        "exchange": config.EXCHANGES,
        "coded_bits": tuple(str(b) for b in BITS),
        "sampling": config.SAMPLINGS,
    }


def _define_field_flag(field, default, choices) -> None:
    """The flag of one TrainConfig field: its type from the annotation, its default."""
    name, kind, help_ = field.name, str(field.type), _HELP[field.name]
    if name in choices:
        value = None if default is None else str(default)
        flags.DEFINE_enum(name, value, list(choices[name]), help_)
    elif name in _EPOCH_LISTS:
        flags.DEFINE_list(name, [str(e) for e in default], help_)
        flags.register_validator(
            name,
            lambda v: all(e.strip().isdigit() for e in v),
            message=f"--{name} must be a comma list of epoch numbers",
        )
    elif kind.startswith("bool"):
        flags.DEFINE_bool(name, default, help_)
    elif kind.startswith("int"):
        flags.DEFINE_integer(name, default, help_)
    elif kind.startswith("float"):
        flags.DEFINE_float(name, default, help_)
    elif kind.startswith("str"):
        flags.DEFINE_string(name, default, help_)
    else:
        raise TypeError(f"TrainConfig.{name}: no flag type for {kind}")


def _define_flags() -> None:
    from experiments.config import TrainConfig  # noqa: PLC0415
    from experiments.setups import SETUPS  # noqa: PLC0415

    fields = dataclasses.fields(TrainConfig)
    missing = sorted({f.name for f in fields} ^ set(_HELP))
    if missing:
        raise RuntimeError(f"experiments/main.py: _HELP and TrainConfig differ in {missing}")
    flags.DEFINE_enum(
        "setup",
        None,
        list(SETUPS),
        "A paper's CIFAR setup (experiments/setups.py) to start from; flags given explicitly "
        "override it.",
    )
    # Flags defaulting to None are per compressor: unset means the
    # compressor's default, set for a compressor that does not use it is an error.
    defaults, choices = TrainConfig(), _choices()
    for field in fields:
        _define_field_flag(field, getattr(defaults, field.name), choices)
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
