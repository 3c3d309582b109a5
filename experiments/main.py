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

The compressor is ``--compressor`` and ``--compressor_kwargs``, its jaxcomp
factory's keyword arguments as JSON or ``key=value`` pairs; ``--ratio``,
``--levels``, ``--bits``, ``--bucket_size``, ``--rank``, ``--freeze_step``,
``--granularity``, ``--reuse_period``, ``--low_pass`` and ``--min_dense_size``
are shorthands of single keys::

    python -m experiments.main --compressor=ldte_bs \
        --compressor_kwargs='{"ratio": 0.01, "variant": "paper"}' --num_devices=8 \
        --epochs=2 --batch_size=64 --workdir=/tmp/ldte_paper
    python -m experiments.main --compressor=qsgd --compressor_kwargs=bits=4,bucket_size=512 \
        --num_devices=8 --epochs=2 --batch_size=64 --workdir=/tmp/qsgd4

The flags (:func:`define_flags`, through :mod:`experiments.cli` as every
program's): one per :class:`experiments.train.TrainConfig` field, generated
from the field (its type and default; its help in ``_HELP``), the shorthands,
and ``--setup``. The configuration is validated before JAX starts any work (every
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
import json
import logging as std_logging
import os

from absl import flags, logging

from experiments import cli

__all__ = ["config_from_flags", "define_flags", "main", "parse_kwargs"]


# The help of each TrainConfig field's flag (a field without one fails at import).
_HELP = {
    "compressor": "A jaxcomp factory name (--compressor_kwargs are its arguments) or 'dense'.",
    "compressor_kwargs": (
        "Keyword arguments of the compressor's jaxcomp factory, as JSON "
        '(\'{"ratio": 0.01, "variant": "paper"}\') or key=value pairs '
        "('ratio=0.01,variant=paper', each value JSON or else a string); checked by the "
        "factory itself. --ratio, --levels, ... are shorthands for single keys."
    ),
    "warmup_epochs": "Epochs of DGC warm-up (0..4; sparsifiers).",
    "momentum": "SGD momentum.",
    "momentum_correction": (
        "Momentum on the compressor (DGC momentum correction), plain SGD after it (default: on "
        "for sparsifiers, off otherwise; not for quantizers)."
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
    "num_devices": "Mesh size (simulated devices on CPU).",
    "mesh": (
        "NODESxLOCAL (e.g. 2x4): the two-level mesh, the compressor dense inside a node and "
        "compressing across nodes (metrics: intra/inter_node_bytes_per_step_per_device); "
        "default: the flat 1-D mesh."
    ),
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
    "servers": (
        "With --exchange=server: the size of the group of parameter servers, in [1, "
        "num_devices], spread over the devices; each owns a key range of the packed gradient "
        "(a quantizer's coded leaves: whole leaves). Default: one server."
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
    "pipeline_stages": (
        "S: pipeline (layer-wise) model parallelism, the mesh (S, num_devices/S) over (stage, "
        "data), the mlp's 6 layers split into S consecutive stages, the compressor exchanging "
        "each stage's gradients over data (metrics: stage_bytes_per_step_per_device); default: "
        "data parallelism only."
    ),
    "microbatches": (
        "M: GPipe micro-batches per data replica and step (with --pipeline_stages; default S); "
        "the bubble is (S-1)/(M+S-1)."
    ),
    "sampling": (
        "How the devices share the data (jaxcomp.sampling): global (one shuffle of the "
        "training set per epoch), replacement (each device draws i.i.d. from the whole set), "
        "local (each device shuffles only its own fixed shard), feature (each device holds a "
        "slice of the input features and of the mlp's first layer, the rest replicated)."
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


# The shorthand flags of single compressor_kwargs keys (config.FLAT_KWARGS: the
# flat fields TrainConfig had before compressor_kwargs), their help.
_SHORTHAND_HELP = {
    "ratio": "Target density of the sparsifiers, in (0, 1] (default 1e-3).",
    "granularity": "Selection granularity of the sparsifiers (default layer).",
    "reuse_period": (
        "DLGS threshold reuse s: select every s steps, reuse the stored threshold in between "
        "(default 1: off; sparsifiers only)."
    ),
    "low_pass": (
        "ScaleCom's low-pass filter beta in (0, 1] on the residual: r <- r + beta (r_new - r), "
        "lossy below 1 (default 1: plain error feedback; sparsifiers only)."
    ),
    "min_dense_size": (
        "Leaves this small are sent dense (default: the compressor's, 0 or qsgd's 10000)."
    ),
    "levels": "QSGD levels s (qsgd only; default 16).",
    "bits": "QSGD 'b-bit' as in the paper: s = 2**bits levels (not with --levels).",
    "bucket_size": "Quantizer bucket size (default: leaf).",
    "rank": "PowerSGD rank (powersgd only; default 4).",
    "freeze_step": (
        "1-bit / 0/1 Adam: steps of Adam warm-up before the variance is frozen and the "
        "momentum goes 1-bit (default: a fifth of the run)."
    ),
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


def _define_field_flag(name: str, kind: str, default, choices, help_: str, fv: dict) -> None:
    """The flag of one TrainConfig field (or shorthand): its type from the annotation."""
    if name in choices:
        value = None if default is None else str(default)
        flags.DEFINE_enum(name, value, list(choices[name]), help_, **fv)
    elif name in _EPOCH_LISTS:
        flags.DEFINE_list(name, [str(e) for e in default], help_, **fv)
        flags.register_validator(
            name,
            lambda v: all(e.strip().isdigit() for e in v),
            message=f"--{name} must be a comma list of epoch numbers",
            **fv,
        )
    elif kind.startswith("bool"):
        flags.DEFINE_bool(name, default, help_, **fv)
    elif kind.startswith("int"):
        flags.DEFINE_integer(name, default, help_, **fv)
    elif kind.startswith("float"):
        flags.DEFINE_float(name, default, help_, **fv)
    elif kind.startswith("str"):
        flags.DEFINE_string(name, default, help_, **fv)
    elif kind.startswith("dict"):  # compressor_kwargs: JSON or key=value pairs
        flags.DEFINE_string(name, None, help_, **fv)
        flags.register_validator(name, _kwargs_parse_error_is_none, message=help_, **fv)
    else:
        raise TypeError(f"TrainConfig.{name}: no flag type for {kind}")


# The shorthands' types (FLAT_KWARGS, as TrainConfig annotated them).
_SHORTHAND_KINDS = {
    "ratio": "float",
    "granularity": "str",
    "reuse_period": "int",
    "low_pass": "float",
    "min_dense_size": "int",
    "levels": "int",
    "bits": "int",
    "bucket_size": "int",
    "rank": "int",
    "freeze_step": "int",
}


def define_flags(flag_values: flags.FlagValues) -> None:
    """One flag per TrainConfig field, the compressor_kwargs shorthands, --setup, --workdir."""
    from experiments.config import FLAT_KWARGS, TrainConfig  # noqa: PLC0415
    from experiments.setups import SETUPS  # noqa: PLC0415

    fv = {"flag_values": flag_values}
    fields = dataclasses.fields(TrainConfig)
    missing = sorted({f.name for f in fields} ^ set(_HELP))
    for table in (_SHORTHAND_HELP, _SHORTHAND_KINDS):
        missing += sorted(set(FLAT_KWARGS) ^ set(table))
    if missing:
        raise RuntimeError(f"experiments/main.py: _HELP and TrainConfig differ in {missing}")
    flags.DEFINE_enum(
        "setup",
        None,
        list(SETUPS),
        "A paper's CIFAR setup (experiments/setups.py) to start from; flags given explicitly "
        "override it.",
        **fv,
    )
    # Flags defaulting to None are unset: the experiment's or the factory's default.
    defaults, choices = TrainConfig(), _choices()
    for field in fields:
        default = getattr(defaults, field.name)
        _define_field_flag(field.name, str(field.type), default, choices, _HELP[field.name], fv)
    for name in FLAT_KWARGS:
        help_ = f"Shorthand of --compressor_kwargs={name}=...: {_SHORTHAND_HELP[name]}"
        _define_field_flag(name, _SHORTHAND_KINDS[name], None, choices, help_, fv)
    flags.DEFINE_string("workdir", "/tmp/jaxcomp_run", "Output directory.", **fv)
    flags.DEFINE_bool(
        "overwrite",
        False,
        "Delete the workdir's checkpoints and metrics first (needed when they belong to "
        "another configuration).",
        **fv,
    )
    flags.DEFINE_bool("verbose", False, "Show INFO logging (absl, orbax, jax).", **fv)


def parse_kwargs(text: str | None) -> dict:
    """``--compressor_kwargs``: a JSON object, or ``key=value`` pairs separated by commas.

    In the pairs form each value is read as JSON (``0.01``, ``true``,
    ``[1, 2]``, ``null``), else as a string (``variant=paper``); a comma
    inside brackets or quotes does not separate pairs.

    Example:
      >>> from experiments.main import parse_kwargs
      >>> parse_kwargs('{"ratio": 0.01, "variant": "paper"}')
      {'ratio': 0.01, 'variant': 'paper'}
      >>> parse_kwargs("ratio=0.01,variant=paper,exact_below=null")
      {'ratio': 0.01, 'variant': 'paper', 'exact_below': None}
    """
    text = (text or "").strip()
    if not text:
        return {}
    if text.startswith("{"):
        value = json.loads(text)
        if not isinstance(value, dict):
            raise ValueError(f"not a JSON object: {text}")
        return value
    out = {}
    for pair in _split_pairs(text):
        key, sep, value = pair.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"{pair!r} is not key=value")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value.strip()
    return out


def _split_pairs(text: str) -> list:
    """``text`` split at the commas outside brackets and quotes."""
    parts, depth, quote, start = [], 0, None, 0
    for i, ch in enumerate(text):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [p for p in (*parts, text[start:]) if p.strip()]


def _kwargs_parse_error_is_none(text) -> bool:
    try:
        parse_kwargs(text)
    except ValueError:
        return False
    return True


def config_from_flags(flag_values: flags.FlagValues):
    """A :class:`experiments.train.TrainConfig` from the parsed flags.

    ``compressor_kwargs`` is ``--compressor_kwargs`` with the shorthands given
    (``--ratio``, ``--levels``, ...; ``--freeze_step`` is 0/1 Adam's
    ``var_freeze_step``) added; a key given both ways must have one value.
    With ``--setup``, the setup's configuration with the flags given
    explicitly on the command line applied over it
    (:func:`experiments.setups.setup_config`; compressor_kwargs key by key);
    the other flags' defaults are not used.

    Raises:
      ValueError: a key given twice with two values.
    """
    from experiments import setups  # noqa: PLC0415
    from experiments.config import FLAT_KWARGS, TrainConfig, kwarg_name  # noqa: PLC0415

    f = flag_values
    names = [field.name for field in dataclasses.fields(TrainConfig)]
    values = {n: f[n].value for n in names}
    values["fit_check_epochs"] = tuple(int(e) for e in values["fit_check_epochs"])
    values["lr_milestones"] = tuple(int(e) for e in values["lr_milestones"])
    if values["coded_bits"] is not None:  # an enum flag holds strings
        values["coded_bits"] = int(values["coded_bits"])
    kwargs = parse_kwargs(values["compressor_kwargs"])
    compressor = f["compressor"].value if f["compressor"].present or f.setup is None else None
    if compressor is None:
        compressor = setups.SETUPS[f.setup].config["compressor"]
    for flat in FLAT_KWARGS:
        if f[flat].value is None:
            continue
        key = kwarg_name(compressor, flat)
        if key in kwargs and kwargs[key] != f[flat].value:
            raise ValueError(
                f"--{flat}={f[flat].value} and --compressor_kwargs {key}={kwargs[key]!r} differ"
            )
        kwargs[key] = f[flat].value
    values["compressor_kwargs"] = kwargs
    present = {n for n in names if f[n].present}
    if kwargs:
        present.add("compressor_kwargs")
    if f.setup is None:
        return TrainConfig(**values)
    return setups.setup_config(f.setup, **{n: values[n] for n in present})


def _set_logging(flag_values: flags.FlagValues) -> None:
    """absl (and so orbax) and jax loggers at WARNING unless --verbose."""
    verbose = flag_values.verbose
    level = std_logging.INFO if verbose else std_logging.WARNING
    if "verbosity" not in flag_values or not flag_values["verbosity"].present:
        logging.set_verbosity(logging.INFO if verbose else logging.WARNING)
    for name in ("jax", "orbax", "absl"):
        std_logging.getLogger(name).setLevel(level)


def main(argv) -> None:
    """Validates the flags, sets up devices / processes, then trains."""
    f = cli.parse(define_flags, argv)
    _set_logging(f)
    import jax  # noqa: PLC0415

    from experiments import data, train  # noqa: PLC0415

    # Everything that does not need devices is checked before JAX starts.
    try:
        config = config_from_flags(f)
        train.validate_config(config)
    except ValueError as e:
        cli.fail(str(e))
    path = data.dataset_path(config.dataset, config.data_dir)
    if path is not None and not config.download and not os.path.exists(path):
        cli.fail(data.missing_data_message(config.dataset, path, cli=True))
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
        result = train.train_and_evaluate(config, f.workdir, overwrite=f.overwrite)
    except (train.ConfigError, train.WorkdirError) as e:  # raised before any training
        cli.fail(str(e))
    final = result["final"]
    if final is not None and jax.process_index() == 0:
        name = config.compressor
        if train.is_coded(config):
            name = f"{config.exchange} r={config.redundancy}"
        if config.sampling != "global":
            name = f"{name} ({config.sampling} sampling)"
        print(
            f"{name}: test accuracy {100 * final['test_accuracy']:.2f}% after "
            f"{final['epoch']} epochs, {final['bytes_per_step_per_device']:.0f} bytes/step/device"
            f"{_link_bytes_text(final)}, wall {final['wall_time']:.1f}s; outputs in {f.workdir}"
        )


def _link_bytes_text(record: dict) -> str:
    """`` (intra-node X, inter-node Y)`` of a two-level run's record, else empty."""
    if "intra_node_bytes_per_step_per_device" not in record:
        return ""
    return (
        f" (intra-node {record['intra_node_bytes_per_step_per_device']:.0f}, "
        f"inter-node {record['inter_node_bytes_per_step_per_device']:.0f})"
    )


if __name__ == "__main__":
    cli.run(main, define_flags)
