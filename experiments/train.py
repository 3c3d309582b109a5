"""Data-parallel training of a Flax model with any jaxcomp compressor.

``train_and_evaluate(config, workdir)`` is the testable core of
``experiments/main.py``: parameters replicated over a 1-D mesh (axis
``"data"``), the global batch sharded over it, each device compressing its
own gradient inside ``jax.shard_map`` and the compressor exchanging the
messages (``jaxcomp.dense_exchange`` for the uncompressed baseline).
``sampling`` picks how the devices share the data (global shuffling,
sampling with replacement, local shuffling of fixed shards, or feature
slices with a model-parallel first layer; :mod:`jaxcomp.sampling`).
With ``exchange="coded"`` or ``"uncoded"`` the run is CSSGD instead
(:mod:`jaxcomp.cssgd`): every block of the global batch lives on
``redundancy`` devices and the dense gradients are exchanged by coded
multicast (or, for comparison, uncoded) before a local SGD step.

Outputs in ``workdir``:

- ``metrics.jsonl``: one strict JSON object per epoch, a non-finite value (a
  diverged loss) as null (see :func:`train_and_evaluate`).
- ``accuracy.png``: test accuracy vs epoch and vs cumulative bytes on the wire.
- ``checkpoints/``: orbax checkpoints after every epoch (parameters, the
  per-device optimizer state with residuals, velocities and PRNG key data,
  with ``norm="batch"`` the BatchNorm running averages, and the epoch, which
  is the whole data-order and augmentation state); a rerun with the same
  workdir resumes from the latest one.
- ``config.json``: the resolved configuration and what identifies the data
  (sizes, image shape, a fingerprint), written before training. A run
  refuses (``ValueError``) a workdir whose checkpoints or metrics belong to
  another configuration or other data, unless told to overwrite them.
- ``merge_plan.json``: with ``merge`` set, the DLGS merge plan (groups of
  leaf paths, the profile and cost model it came from, the predicted
  iteration time of every planner); a rerun with the same configuration
  reuses it instead of profiling again, so a resumed run compiles the same
  groups.
- ``fit_check.json`` and ``fit_check_epoch<E>.png``: with ``fit_check_epochs``
  set, the distribution check of :mod:`experiments.gradient_fit` (W1 of device
  0's gradient and residual to fitted Laplace and Gaussian, per layer).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp
from experiments import data as data_lib
from experiments import jsonio, models, timing
from jaxcomp import cssgd, planning
from jaxcomp import sampling as sampling_lib
from jaxcomp.comm.quantized import QUANTIZER_EXCHANGES as _QUANTIZER_EXCHANGES
from jaxcomp.quantization import qsgd_levels

__all__ = [
    "CODED_EXCHANGES",
    "CODED_FIELDS",
    "COMPRESSED_OPTIMIZERS",
    "COMPRESSORS",
    "CONFIG_FILE",
    "ConfigError",
    "EXCHANGES",
    "LOW_RANK",
    "MERGE_ALPHA",
    "MERGE_BETA",
    "MERGE_PLAN_FILE",
    "NORMS",
    "RESUMABLE_FIELDS",
    "QUANTIZERS",
    "SAMPLINGS",
    "SPARSIFIERS",
    "SPARSIFIER_FACTORIES",
    "TIME_SPLIT_FIELDS",
    "TIME_SPLIT_PARTS",
    "TrainConfig",
    "WorkdirError",
    "build_optimizer",
    "is_coded",
    "learning_rate",
    "merge_link_cost",
    "resolve_config",
    "train_and_evaluate",
    "unused_fields",
    "validate_config",
    "write_plots",
    "write_time_split_plot",
]

AXIS = "data"
# metrics.jsonl holds time_<field> for each field of the step's time split.
TIME_SPLIT_FIELDS = jaxcomp.distributed.TimeSplit._fields
# The parts that add up to a step, bottom to top in the stacked bars.
TIME_SPLIT_PARTS = ("forward_backward", "compression", "communication")
SPARSIFIERS = (
    "ldte_bs",
    "ldte_bs_paper",
    "top_k",
    "dgc",
    "trimmed_top_k",
    "binary_search",
    "gaussian_k",
    "random_k",
)
# Registry names that are not a jaxcomp factory name: (factory, fixed options).
SPARSIFIER_FACTORIES = {"ldte_bs_paper": ("ldte_bs", {"variant": "paper"})}
QUANTIZERS = (
    "qsgd",
    "onebit",
    "sign_sgd",
    "ef_sign_sgd",
    "bounded_sign",
    "terngrad",
    "natural_compression",
    "signum",
    "cast",
)
# PowerSGD: rank-r power iteration, chained before SGD like the others.
LOW_RANK = ("powersgd",)
# Whole optimizers with compression inside (nothing chained after them).
COMPRESSED_OPTIMIZERS = ("onebit_adam", "zero_one_adam")
COMPRESSORS = ("dense", *SPARSIFIERS, *QUANTIZERS, *LOW_RANK, *COMPRESSED_OPTIMIZERS)
SCHEDULES = ("constant", "cosine", "step")
NORMS = models.NORMS
MERGES = ("none", "greedy", "optimal")
DATASETS = ("digits", "synthetic", "cifar10", "cifar100")
# --exchange: "default" (None) is the compressor's own exchange; the others are CSSGD.
CODED_EXCHANGES = cssgd.EXCHANGES
# A sparsifier's exchange= (jaxcomp.comm.sparse_allreduce) and a quantizer's.
# Not "gossip": its updates differ per device, a decentralized run with per-device
# parameters (jaxcomp.aggregation.make_gossip_train_step), not this replicated one;
# not "scatter": FSDP's reduce-scatter (jaxcomp.distributed.sharded_optimizer).
_RUN_EXCLUDED = ("gossip", "scatter")
SPARSIFIER_EXCHANGES = tuple(
    e for e in jaxcomp.comm.sparse_allreduce.EXCHANGES if e not in _RUN_EXCLUDED
)
QUANTIZER_EXCHANGES = tuple(e for e in _QUANTIZER_EXCHANGES if e not in _RUN_EXCLUDED)
EXCHANGES = tuple(
    dict.fromkeys(("default", *CODED_EXCHANGES, *SPARSIFIER_EXCHANGES, *QUANTIZER_EXCHANGES))
)
# Fields only CSSGD runs read (must stay None otherwise).
CODED_FIELDS = ("redundancy", "coded_value_range", "coded_bits")
# --sampling: the by-sample modes of jaxcomp.sampling, and "feature" (the
# model-parallel first layer over feature slices, mlp only).
SAMPLINGS = (*sampling_lib.SAMPLE_MODES, "feature")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on (one absl flag per field in main.py).

    Fields that only some compressors use default to None ("unset") and are
    resolved per compressor by :func:`resolve_config`; setting one for a
    compressor that does not use it is a ``ValueError`` (see
    :func:`unused_fields`), so no flag is ever silently ignored.

    Attributes:
      compressor: ``"dense"`` or a jaxcomp factory name (see ``COMPRESSORS``).
      ratio: target density of the sparsifiers, in (0, 1] (None: 1e-3;
        sparsifiers only).
      warmup_epochs: epochs of DGC warm-up (``jaxcomp.DGC_WARMUP[:warmup_epochs]``;
        sparsifiers only when nonzero).
      momentum: SGD momentum.
      momentum_correction: put the momentum on the compressor (DGC momentum
        correction) and use plain SGD after it (None: on for sparsifiers, off
        for dense and quantizers; True is rejected for quantizers, and for
        dense it is the same as optimizer momentum).
      granularity: ``"layer"`` (per-leaf k) or ``"global"`` (one k for the
        whole model) (None: ``"layer"``; sparsifiers only).
      reuse_period: DLGS threshold reuse ``s``: the selector runs every
        ``s`` steps and the stored per-leaf (per-group) threshold is applied
        in between (None: 1, off; sparsifiers only).
      low_pass: ScaleCom's low-pass filter ``beta`` in (0, 1] on the
        residual (``jaxcomp.sparsify(low_pass=)``; lossy below 1). None: 1,
        plain error feedback (sparsifiers only).
      merge: DLGS layer merging: ``"none"`` (one group per leaf), ``"greedy"``
        (the paper's Algorithm 2) or ``"optimal"`` (the exact planner) over the
        model's layers (the leaves of one module form a layer), planned from
        the backward profile of one device's shard of the first batch
        (``jaxcomp.planning.profile_backward(method="flops")``), the selector's
        measured cost and the link ``merge_alpha``, ``merge_beta``; see
        ``merge_plan.json`` (None: ``"none"``; sparsifiers only, with
        ``granularity="layer"``).
      merge_alpha: the planner's link latency in seconds per message (the
        DLGS cost model ``t_c = alpha + beta * bytes``). None: ``MERGE_ALPHA``,
        50e-6 (10 GbE); only with ``merge`` ``"greedy"`` or ``"optimal"``.
      merge_beta: the planner's link time in seconds per byte. None:
        ``MERGE_BETA``, 1 / 1.25e9 (10 GbE); only with ``merge`` ``"greedy"``
        or ``"optimal"``.
      min_dense_size: leaves this small are sent dense (None: the compressor
        factory's default, 0 for sparsifiers and 10000 for ``qsgd``; not for dense).
      levels: QSGD quantization levels ``s`` (None: 16, the QSGD paper's
        "4-bit"; ``qsgd`` only).
      bits: QSGD's "b-bit" as in the QSGD paper: ``s = 2**bits`` levels, the
        sign apart (``qsgd`` only; give ``levels`` or ``bits``, not both).
      bucket_size: bucket size of the quantizers (None: whole leaf; quantizers only).
      num_devices: mesh size (None: every device).
      dataset: ``digits``, ``synthetic``, ``cifar10``, ``cifar100``.
      data_dir: CIFAR directory or ``.tar.gz`` archive.
      download: download CIFAR when ``data_dir`` does not exist.
      model: ``mlp``, ``cnn``, ``resnet20``, ``vgg16``, ``resnet50``,
        ``resnet101``, ``densenet121``, ``densenet169`` (:mod:`experiments.models`).
      epochs: total epochs (a resumed run continues up to this number).
      batch_size: global batch size (divisible by ``num_devices``).
      lr: peak learning rate.
      schedule: ``"constant"``, ``"cosine"`` (decay to 0 over all steps) or
        ``"step"``: the rate times ``lr_decay`` at the start of each epoch of
        ``lr_milestones``; without milestones the DLGS paper's, x0.1 after
        4/7 and again after 6/7 of the epochs (epochs 80 and 120 of 140).
      lr_milestones: 0-based epochs from which the rate is multiplied by
        ``lr_decay`` once more, strictly increasing in ``[1, epochs)``
        (``schedule="step"`` only; empty: the 4/7, 6/7 default).
      lr_decay: the step schedule's factor, in (0, 1] (``schedule="step"``
        only unless 0.1, the default).
      weight_decay: L2 coefficient ``wd``: ``wd * params`` is added to each
        device's gradient before the compressor and the momentum (PyTorch
        SGD's coupled ``weight_decay``, every parameter), so the compressor
        sees it as part of the gradient, as in DGC; ``>= 0`` (0: off).
      norm: ``"group"`` (GroupNorm) or ``"batch"`` (BatchNorm, statistics
        averaged over the data axis: synchronised, the whole global batch's;
        the running averages evaluate and are checkpointed) in the models
        with normalisation layers (``models.NORMALIZED``); others take only
        ``"group"``. ``"batch"`` is not supported with CSSGD exchanges or
        ``fit_check_epochs`` (their gradients come from a stateless loss).
      augment: the standard CIFAR augmentation of every training batch
        (:func:`experiments.data.augment`: random crop of the image padded by
        4 black pixels, random horizontal flip), drawn from
        ``(seed, epoch, step)`` for the whole global batch, so it does not
        depend on the device or process count and resumes exactly.
      eval_examples: evaluate on the first this many test examples (quick
        CPU runs; the metrics then describe that subset), at most the test
        set's size (checked once the data is loaded); None: all.
      seed: parameter init and data order.
      progress: show a tqdm bar per epoch.
      checkpoint: save an orbax checkpoint after every epoch and resume from
        the latest one found in the workdir.
      time_split: measure each epoch where a step's time goes (forward and
        backward, compression, exposed communication; see
        :func:`train_and_evaluate`); costs two extra compilations (the step
        without its collectives, the forward and backward alone); the
        ``time_*`` metrics are -1 when off.
      max_steps_per_epoch: truncate epochs (tests, quick looks); None: all.
      coded_bytes_every: every this many steps, read device 0's last QSGD
        message on the host and measure its Elias-coded size (the QSGD
        paper's measure), recorded as ``coded_bytes_per_step_per_device``
        (``qsgd`` only; None: off, and the metric is -1).
      coordinator_address: multi-process coordinator ``host:port`` (None: one process).
      num_processes: number of processes (with ``coordinator_address``).
      process_id: this process's index (with ``coordinator_address``).
      fit_check_epochs: after these epochs (1-based), measure how Laplacian
        device 0's gradient and residual are (:mod:`experiments.fit_check`;
        rows appended to ``fit_check.json``, histograms in
        ``fit_check_epoch<E>.png``); empty: off. Not timed in ``wall_time``.
      exchange: None or ``"default"``: the compressor's own exchange;
        ``"coded"``: CSSGD (:mod:`jaxcomp.cssgd`), the global batch split into
        ``C(n, r)`` blocks, each on ``redundancy`` devices, the dense
        gradients quantized to integers and exchanged by coded multicast;
        ``"uncoded"``: the same assignment with the missing blocks sent whole
        (the CSSGD paper's comparison; the same decoded gradient). Coded and
        uncoded need ``compressor="dense"``, one process, ``redundancy``, and
        a ``batch_size`` that is a multiple of ``C(num_devices, redundancy)``.
        A sparsifier's exchange (``jaxcomp.comm.sparse_allreduce.EXCHANGES``:
        ``"sparse"``, ``"dense"``, ``"server"``, ``"sparcml"``, ``"gtopk"``,
        ``"oktopk"``, ``"scalecom"``, ``"auto"``, ``"auto_topk"``) or a
        quantizer's (``"allgather"``, ``"server"``): passed to the compressor.
      redundancy: CSSGD's ``r``, devices per block, in ``[1, num_devices]``
        (coded/uncoded only, required there).
      coded_value_range: the integers cover ``[-v, v]`` (None: 10.0, the
        paper's; larger gradient values are clipped and counted; coded/uncoded only).
      coded_bits: integer width on the wire, 8, 16 or 32 (None: 32, the
        paper's; coded/uncoded only).
      sampling: how the devices share the data (``SAMPLINGS``; see
        :mod:`jaxcomp.sampling`). By sample, each device computes its
        gradient on ``batch_size / num_devices`` examples per step drawn by
        ``"global"`` shuffling (one permutation of the training set per
        epoch; the default, and what runs without this field did),
        ``"replacement"`` (each device draws i.i.d. uniformly from the whole
        training set) or ``"local"`` shuffling (the training set split once
        into ``num_devices`` fixed shards, each device shuffling only its
        own). CSSGD runs cut their blocks from the global batch: they take
        ``"global"`` or ``"replacement"`` (the global batch then ``batch_size``
        i.i.d. draws). By feature, ``"feature"``: every device sees the whole
        global batch (``"global"`` order) but only its contiguous slice of
        the input features (``jaxcomp.sampling.feature_slices``) and owns that
        slice of the first dense layer's kernel; the partial products are
        summed over the devices (``jaxcomp.sampling.feature_parallel_dense``)
        and the rest of the model runs identically on every device. The
        kernel slices are updated by the optimizer alone (plain SGD with
        ``momentum`` and the schedule; never compressed or averaged: a
        slice's gradient is its device's own and never leaves it); the other
        parameters' gradients, the same on every device, go through the
        compressor and its exchange as in data-parallel runs. ``model="mlp"``
        only, one process, not with ``merge``, ``fit_check_epochs`` or a
        CSSGD exchange; ``batch_size`` need not divide by ``num_devices``.
      rank: PowerSGD's rank (None: 4; ``powersgd`` only). Flax kernels are
        reshaped with ``reshape="last"`` (``(fan_in, out)`` matrices).
      freeze_step: the step after which 1-bit Adam / 0/1 Adam freeze the
        variance and start exchanging 1-bit momentum (None: a fifth of the
        run's steps, the 1-bit Adam paper's 15-25% warm-up;
        ``onebit_adam``/``zero_one_adam`` only). These are whole optimizers:
        ``momentum`` is their ``b1``, the learning rate and schedule are
        theirs, and 0/1 Adam syncs every step (``local_step_clipper=1``: the
        replicated parameters of these runs cannot take local steps).
    """

    compressor: str = "ldte_bs"
    ratio: float | None = None
    warmup_epochs: int = 0
    momentum: float = 0.9
    momentum_correction: bool | None = None
    granularity: str | None = None
    reuse_period: int | None = None
    low_pass: float | None = None
    merge: str | None = None
    merge_alpha: float | None = None
    merge_beta: float | None = None
    min_dense_size: int | None = None
    levels: int | None = None
    bits: int | None = None
    bucket_size: int | None = None
    num_devices: int | None = None
    dataset: str = "digits"
    data_dir: str | None = None
    download: bool = False
    model: str = "mlp"
    epochs: int = 10
    batch_size: int = 128
    lr: float = 0.1
    schedule: str = "constant"
    seed: int = 0
    progress: bool = True
    checkpoint: bool = True
    time_split: bool = True
    max_steps_per_epoch: int | None = None
    coded_bytes_every: int | None = None
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    fit_check_epochs: tuple[int, ...] = ()
    exchange: str | None = None
    redundancy: int | None = None
    coded_value_range: float | None = None
    coded_bits: int | None = None
    sampling: str = "global"
    rank: int | None = None
    freeze_step: int | None = None
    lr_milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1
    weight_decay: float = 0.0
    norm: str = "group"
    augment: bool = False
    eval_examples: int | None = None


def is_coded(config: TrainConfig) -> bool:
    """Whether ``config`` is a CSSGD run (``exchange`` coded or uncoded)."""
    return config.exchange in CODED_EXCHANGES


def _kind(compressor: str) -> str:
    if compressor in SPARSIFIERS:
        return "the sparsifier"
    if compressor in QUANTIZERS:
        return "the quantizer"
    if compressor in LOW_RANK:
        return "the low-rank compressor"
    if compressor in COMPRESSED_OPTIMIZERS:
        return "the compressed optimizer"
    return "the baseline"


def unused_fields(compressor: str) -> dict:
    """The optional :class:`TrainConfig` fields ``compressor`` does not use.

    Args:
      compressor: a name in ``COMPRESSORS``.

    Returns:
      ``{field: description of the compressors that use it}`` for every
      field that must stay None (unset) with ``compressor``.
    """
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    out = {}
    if compressor not in SPARSIFIERS:
        for name in (
            *("ratio", "granularity", "reuse_period", "low_pass"),
            *("merge", "merge_alpha", "merge_beta"),
        ):
            out[name] = "the sparsifiers"
    if compressor == "random_k":  # it picks indices: there is no threshold to reuse
        out["reuse_period"] = "the threshold sparsifiers"
    if compressor not in QUANTIZERS or compressor == "cast":
        out["bucket_size"] = "the quantizers but cast"
    if compressor != "qsgd":
        # "bits" is qsgd's other way to give the levels, when the config has it.
        out.update({n: "qsgd" for n in ("levels", "bits", "coded_bytes_every") if n in names})
    if compressor not in LOW_RANK:
        out["rank"] = "powersgd"
    if compressor not in COMPRESSED_OPTIMIZERS:
        out["freeze_step"] = "onebit_adam and zero_one_adam"
    if compressor == "dense":
        out["min_dense_size"] = "the sparsifiers and quantizers"
    return out


def resolve_config(config: TrainConfig) -> TrainConfig:
    """``config`` validated, with its unset per-compressor fields given their defaults.

    Sparsifiers: ``ratio=1e-3``, ``granularity="layer"``,
    ``momentum_correction=True``. Quantizers: ``momentum_correction=False``;
    ``qsgd``: ``levels=16`` when neither ``levels`` nor ``bits`` is given.
    Dense: ``momentum_correction=False`` (either value is the same run).
    ``min_dense_size`` unset means the compressor factory's own default.
    Fields the compressor does not use stay None. ``exchange="default"``
    becomes None (the same run); CSSGD runs get ``coded_value_range=10.0``
    and ``coded_bits=32`` (the paper's int32 over ``[-10, 10]``).

    Raises:
      ValueError: the checks of :func:`validate_config` on the fields alone
        (not the data size or the optimizer build, which resolve through here).
    """
    _validate_fields(config)
    c = config
    if c.exchange == "default":
        c = dataclasses.replace(c, exchange=None)
    if is_coded(c):
        c = dataclasses.replace(
            c,
            coded_value_range=10.0 if c.coded_value_range is None else float(c.coded_value_range),
            coded_bits=32 if c.coded_bits is None else c.coded_bits,
        )
    if c.compressor in SPARSIFIERS:
        return dataclasses.replace(
            c,
            ratio=1e-3 if c.ratio is None else c.ratio,
            granularity=c.granularity or "layer",
            # random_k picks indices: no threshold to reuse, the field stays unset.
            reuse_period=None if c.compressor == "random_k" else c.reuse_period or 1,
            merge=c.merge or "none",
            # Floats, whatever real type was given (config.json holds them).
            merge_alpha=None if c.merge_alpha is None else float(c.merge_alpha),
            merge_beta=None if c.merge_beta is None else float(c.merge_beta),
            momentum_correction=True if c.momentum_correction is None else c.momentum_correction,
        )
    c = dataclasses.replace(c, momentum_correction=False)
    if c.compressor == "qsgd" and c.levels is None and getattr(c, "bits", None) is None:
        c = dataclasses.replace(c, levels=16)
    if c.compressor in LOW_RANK and c.rank is None:
        c = dataclasses.replace(c, rank=4)
    return c


class ConfigError(ValueError):
    """The configuration cannot train; raised before anything is written to the workdir."""


def _invalid(msg: str):
    raise ConfigError(f"invalid config: {msg}")


def validate_config(config: TrainConfig, device_count: int | None = None) -> None:
    """Raises ``ValueError`` (``ConfigError``) for anything that cannot train, before any work.

    Checks every field, the batch size against the dataset's standard size
    (``experiments.data.DATASET_SPECS``; the loaded data is checked again by
    :func:`train_and_evaluate` before it writes anything), and builds the
    optimizer once, abstractly (``jax.eval_shape`` of its ``init`` on the
    model's parameter shapes), so that every argument a jaxcomp factory
    rejects (``levels``, ``freeze_step``, ``reuse_period`` of a selector
    without a threshold, ...) is reported here as an invalid config. It
    compiles nothing, reads no data and starts no JAX backend, so
    ``experiments/main.py`` runs it before setting the device count.

    Args:
      config: the run's configuration.
      device_count: devices available (checks ``num_devices``; None: skipped).
    """
    _validate_fields(config, device_count)
    num_train, shape, num_classes = data_lib.DATASET_SPECS[config.dataset]
    _validate_data(config, num_train, shape, config.num_devices or device_count)
    _validate_optimizer(config, num_train, shape, num_classes)


def _validate_data(c: TrainConfig, num_train: int, shape, n: int | None) -> None:
    """The checks of a run against its training set (``num_train`` images of ``shape``)."""
    if data_lib.steps_per_epoch(num_train, c.batch_size) < 1:
        _invalid(
            f"batch_size={c.batch_size} (--batch_size) exceeds the {num_train} training "
            f"examples of dataset={c.dataset!r}"
        )
    num_features = int(np.prod(shape))
    if c.sampling == "feature" and n is not None and n > num_features:
        _invalid(
            f"sampling='feature' gives every device at least one of the "
            f"{num_features} input features; num_devices={n} is too many"
        )


@functools.lru_cache(maxsize=8)
def _param_shapes(model: str, shape: tuple, num_classes: int, norm: str):
    """The model's parameters as ``jax.ShapeDtypeStruct`` (traced, not computed)."""
    net = models.make_model(model, num_classes, norm=norm, axis_name=AXIS)
    # The key is made inside the trace: a concrete one would start a JAX backend.
    variables = jax.eval_shape(
        lambda: net.init(jax.random.key(0), jnp.zeros((1, *shape), jnp.float32))
    )
    return variables["params"]


def _validate_optimizer(config: TrainConfig, num_train: int, shape, num_classes) -> None:
    """Builds the run's optimizer and its state abstractly; a factory's ValueError fails."""
    c = config
    # The errors are raised outside the except blocks: one message, no chained traceback.
    error = None
    try:
        params = _param_shapes(c.model, tuple(shape), num_classes, c.norm)
    except Exception as e:  # noqa: BLE001 (whatever the model raises on these inputs)
        error = e
    if error is not None:
        _invalid(
            f"model={c.model!r} (--model) cannot take dataset={c.dataset!r} images of shape "
            f"{tuple(shape)} ({type(error).__name__}: {error})"
        )
    spe = data_lib.steps_per_epoch(num_train, c.batch_size)
    spe = min(spe, c.max_steps_per_epoch or spe)

    def init():
        # Built inside the trace too: factories make small constants (jnp
        # scalars), which outside a trace would start a JAX backend.
        tx, _ = build_optimizer(c, spe, spe * c.epochs)
        return tx.init(params)

    try:
        jax.eval_shape(init)
    except ValueError as e:
        error = e
    if error is not None:
        _invalid(f"{c.compressor}: {error}")


def _validate_fields(config: TrainConfig, device_count: int | None = None) -> None:
    """The checks of :func:`validate_config` that need neither the data nor the optimizer."""
    c = config
    if c.compressor not in COMPRESSORS:
        _invalid(f"unknown compressor {c.compressor!r}; expected one of {', '.join(COMPRESSORS)}")
    sparse = c.compressor in SPARSIFIERS
    kind = _kind(c.compressor)
    # A flag the compressor would not read is an error, never silently ignored.
    for name, users in unused_fields(c.compressor).items():
        if getattr(c, name) is not None:
            _invalid(
                f"{name} (--{name}) is not used by {kind} {c.compressor!r} (it applies to "
                f"{users}); leave it unset"
            )
    _validate_exchange(c)
    if c.ratio is not None and not 0.0 < c.ratio <= 1.0:
        _invalid(f"ratio must be in (0, 1], got {c.ratio}")
    if not 0 <= c.warmup_epochs <= len(jaxcomp.DGC_WARMUP):
        _invalid(f"warmup_epochs must be in [0, {len(jaxcomp.DGC_WARMUP)}], got {c.warmup_epochs}")
    if c.warmup_epochs and not sparse:
        _invalid(
            f"warmup_epochs (--warmup_epochs) needs a sparsifier ({', '.join(SPARSIFIERS)}), "
            f"not {kind} {c.compressor!r}; leave it 0"
        )
    if not 0.0 <= c.momentum < 1.0:
        _invalid(f"momentum must be in [0, 1), got {c.momentum}")
    if c.momentum_correction and c.compressor not in (*SPARSIFIERS, "dense"):
        _invalid(
            f"momentum_correction (--momentum_correction) needs a sparsifier, not {kind} "
            f"{c.compressor!r} (leave it unset or false: it runs with momentum on the "
            "optimizer, or its own)"
        )
    if c.granularity is not None and c.granularity not in ("layer", "global"):
        _invalid(f"granularity must be 'layer' or 'global', got {c.granularity!r}")
    if c.reuse_period is not None and c.reuse_period < 1:
        _invalid(f"reuse_period must be >= 1 (1: off), got {c.reuse_period}")
    if c.low_pass is not None and not 0 < c.low_pass <= 1:
        _invalid(f"low_pass must be in (0, 1] (1: plain error feedback), got {c.low_pass}")
    if c.merge is not None and c.merge not in MERGES:
        _invalid(f"merge must be one of {MERGES}, got {c.merge!r}")
    if c.merge not in (None, "none") and c.granularity == "global":
        _invalid(
            f"merge={c.merge!r} plans groups of layers; granularity='global' is one group already"
        )
    for name in ("merge_alpha", "merge_beta"):
        value = getattr(c, name)
        if value is None:
            continue
        if c.merge in (None, "none"):
            _invalid(
                f"{name} (--{name}) sets the merge planner's link; "
                "it needs merge='greedy' or 'optimal'"
            )
        try:  # the planner's own check of a link time
            planning.linear_cost(**{"alpha": 0.0, "beta": 0.0, name.removeprefix("merge_"): value})
        except ValueError as err:
            _invalid(f"{name} (--{name}), in seconds: {err}")
    if c.min_dense_size is not None and c.min_dense_size < 0:
        _invalid(f"min_dense_size must be >= 0, got {c.min_dense_size}")
    if c.levels is not None and c.levels < 1:
        _invalid(f"qsgd needs levels >= 1, got {c.levels}")
    if c.rank is not None and c.rank < 1:
        _invalid(f"rank must be >= 1, got {c.rank}")
    # zero_one_adam's var_freeze_step + 1 must fit in int32 (its stage-2 start); 0
    # would freeze a variance never updated (no step, or NaN).
    if c.freeze_step is not None and not 1 <= c.freeze_step <= 2**31 - 2:
        _invalid(f"freeze_step must be in [1, 2**31 - 2], got {c.freeze_step}")
    if c.compressor in COMPRESSED_OPTIMIZERS and (c.exchange not in (None, "default")):
        _invalid(f"{c.compressor} has its own exchange; leave exchange unset")
    if c.bits is not None and not 1 <= c.bits <= 30:
        _invalid(f"bits must be in [1, 30] (s = 2**bits levels), got {c.bits}")
    if c.levels is not None and c.bits is not None:
        _invalid(
            "give qsgd one of levels (--levels, s itself) and bits (--bits, s = 2**bits), "
            f"not both; got levels={c.levels}, bits={c.bits}"
        )
    if c.bucket_size is not None and c.bucket_size < 1:
        _invalid(f"bucket_size must be >= 1, got {c.bucket_size}")
    if c.dataset not in DATASETS:
        _invalid(f"unknown dataset {c.dataset!r}; expected one of {', '.join(DATASETS)}")
    if not c.dataset.startswith("cifar") and (c.data_dir is not None or c.download):
        # Forgetting --dataset=cifar10 would train on digits without a word.
        _invalid(
            f"data_dir and download (--data_dir, --download) read CIFAR; dataset={c.dataset!r}"
        )
    if c.model not in models.MODELS:
        _invalid(f"unknown model {c.model!r}; expected one of {', '.join(models.MODELS)}")
    if c.schedule not in SCHEDULES:
        _invalid(f"schedule must be one of {SCHEDULES}, got {c.schedule!r}")
    if c.epochs < 1 or c.batch_size < 1 or not 0 < c.lr < math.inf:
        _invalid(
            f"need epochs >= 1, batch_size >= 1, a finite lr > 0; "
            f"got {c.epochs}, {c.batch_size}, {c.lr}"
        )
    integer = isinstance(c.seed, (int, np.integer)) and not isinstance(c.seed, bool)
    if not (integer and 0 <= c.seed < 2**32):  # jax.random.key keeps 32 bits: 2**32 + 1 is 1
        _invalid(f"seed must be an int in [0, 2**32), got {c.seed!r}")
    _validate_recipe(c)
    if c.eval_examples is not None and c.eval_examples < 1:
        _invalid(
            f"eval_examples must be >= 1 (or unset: every test example), got {c.eval_examples}"
        )
    if c.max_steps_per_epoch is not None and c.max_steps_per_epoch < 1:
        _invalid(f"max_steps_per_epoch must be >= 1, got {c.max_steps_per_epoch}")
    bad = [e for e in c.fit_check_epochs if not 1 <= e <= c.epochs]
    if bad:
        _invalid(f"fit_check_epochs must be in [1, epochs={c.epochs}], got {bad}")
    if c.coded_bytes_every is not None and c.coded_bytes_every < 1:
        _invalid(f"coded_bytes_every must be >= 1 (or unset: off), got {c.coded_bytes_every}")
    if c.num_devices is not None:
        if c.num_devices < 1:
            _invalid(f"num_devices must be >= 1, got {c.num_devices}")
        if device_count is not None and c.num_devices > device_count:
            _invalid(
                f"num_devices={c.num_devices} but only {device_count} devices exist "
                "(on CPU set --num_devices in main.py, or jax_num_cpu_devices / XLA_FLAGS "
                "before JAX initialises)"
            )
    _validate_sampling(c)
    n = c.num_devices or device_count
    if n is not None and c.compressor in SPARSIFIERS and c.exchange is not None:
        # The exchange's own trace-time check, before anything is written.
        try:
            jaxcomp.comm.sparse_allreduce.check_device_count(c.exchange, n)
        except ValueError as e:
            _invalid(f"{e} (--exchange, --num_devices)")
    if is_coded(c):
        _validate_coded_devices(c, n)
    elif c.sampling == "feature":
        pass  # every device sees the whole batch; features vs devices is checked on the data
    elif n is not None and c.batch_size % n:
        _invalid(f"batch_size={c.batch_size} is not divisible by num_devices={n}")
    mp = (c.coordinator_address, c.num_processes, c.process_id)
    if any(v is not None for v in mp):
        if any(v is None for v in mp):
            _invalid("coordinator_address, num_processes and process_id go together")
        if c.num_processes < 1 or not 0 <= c.process_id < c.num_processes:
            _invalid(f"need 0 <= process_id < num_processes, got {c.process_id}, {c.num_processes}")
        if c.batch_size % c.num_processes:
            _invalid(f"batch_size={c.batch_size} not divisible by num_processes={c.num_processes}")


def _validate_recipe(c: TrainConfig) -> None:
    """The checks of the step schedule, weight decay, norm and augmentation."""
    milestones = tuple(c.lr_milestones)
    if milestones and c.schedule != "step":
        _invalid(
            f"lr_milestones (--lr_milestones) needs schedule='step', got schedule={c.schedule!r}"
        )
    if any(isinstance(m, bool) or int(m) != m for m in milestones):
        _invalid(f"lr_milestones must be integer epochs, got {milestones}")
    if milestones and (
        any(b <= a for a, b in zip(milestones, milestones[1:], strict=False))
        or not 1 <= milestones[0]
        or milestones[-1] >= c.epochs
    ):
        _invalid(
            f"lr_milestones must be strictly increasing epochs in [1, epochs={c.epochs}), got "
            f"{milestones}"
        )
    if not (np.isfinite(c.lr_decay) and 0.0 < c.lr_decay <= 1.0):
        _invalid(f"lr_decay must be in (0, 1], got {c.lr_decay}")
    if c.lr_decay != 0.1 and c.schedule != "step":
        _invalid(f"lr_decay (--lr_decay) needs schedule='step', got schedule={c.schedule!r}")
    if not (np.isfinite(c.weight_decay) and c.weight_decay >= 0.0):
        _invalid(f"weight_decay must be >= 0, got {c.weight_decay}")
    if c.norm not in NORMS:
        _invalid(f"norm (--norm) must be one of {', '.join(NORMS)}, got {c.norm!r}")
    if c.norm == "batch":
        if c.model not in models.NORMALIZED:
            _invalid(
                f"norm='batch' needs a model with normalisation layers "
                f"({', '.join(models.NORMALIZED)}), got {c.model!r}"
            )
        if is_coded(c):
            _invalid(
                f"norm='batch' is not supported with exchange={c.exchange!r}: CSSGD's step "
                "differentiates a loss without model state; use --norm=group"
            )
        if c.fit_check_epochs:
            _invalid(
                "fit_check_epochs (--fit_check_epochs) is not supported with norm='batch' (it "
                "recomputes a device's gradient without the batch statistics); leave it empty"
            )


def _validate_sampling(c: TrainConfig) -> None:
    """The checks of ``sampling`` that need neither the devices nor the data."""
    if c.sampling not in SAMPLINGS:
        _invalid(f"sampling (--sampling) must be one of {', '.join(SAMPLINGS)}, got {c.sampling!r}")
    if is_coded(c) and c.sampling in ("local", "feature"):
        _invalid(
            f"sampling={c.sampling!r} (--sampling) does not go with exchange={c.exchange!r}: "
            "CSSGD puts every block of the global batch on several devices, so a device would "
            "compute on examples (or features) it does not hold; use --sampling=global or "
            "--sampling=replacement"
        )
    if c.sampling != "feature":
        return
    why = "(--sampling=feature slices the input features of the mlp's first dense layer)"
    if c.model != "mlp":
        _invalid(f"sampling='feature' needs model='mlp', got {c.model!r} {why}")
    if c.merge not in (None, "none"):
        _invalid(
            f"merge={c.merge!r} (--merge) is not supported with sampling='feature': it plans "
            "groups over all the model's layers, and the first kernel's slices are not "
            "compressed there; leave it unset"
        )
    if c.fit_check_epochs:
        _invalid(
            "fit_check_epochs (--fit_check_epochs) is not supported with sampling='feature' (it "
            "measures a device's gradient of a data-parallel batch); leave it empty"
        )
    if c.num_processes is not None or c.coordinator_address is not None:
        _invalid(
            "sampling='feature' runs in one process only (the kernel slices are placed and "
            "gathered on the host as whole arrays); leave coordinator_address, num_processes "
            "and process_id unset"
        )


def _validate_exchange(c: TrainConfig) -> None:
    """The checks of ``exchange`` and the CSSGD fields that need no device count."""
    if c.exchange is not None and c.exchange not in EXCHANGES:
        _invalid(f"exchange (--exchange) must be one of {', '.join(EXCHANGES)}, got {c.exchange!r}")
    if c.exchange not in (None, "default") and not is_coded(c):
        allowed = (
            SPARSIFIER_EXCHANGES
            if c.compressor in SPARSIFIERS
            else QUANTIZER_EXCHANGES
            if c.compressor in QUANTIZERS
            else ()
        )
        if c.exchange not in allowed:
            _invalid(
                f"exchange={c.exchange!r} (--exchange) is not an exchange of "
                f"{_kind(c.compressor)} {c.compressor!r}: it takes "
                f"{', '.join(('default', *CODED_EXCHANGES) if not allowed else allowed)}"
            )
    if not is_coded(c):
        # Like the per-compressor flags: a CSSGD flag is never silently ignored.
        for name in CODED_FIELDS:
            if getattr(c, name) is not None:
                _invalid(
                    f"{name} (--{name}) is only used by CSSGD runs (--exchange=coded or "
                    "--exchange=uncoded), not with the compressor's own exchange; leave it "
                    "unset or set --exchange"
                )
        return
    if c.compressor != "dense":
        _invalid(
            f"exchange={c.exchange!r} (--exchange) needs compressor='dense', got "
            f"{_kind(c.compressor)} {c.compressor!r}: CSSGD's coded packets are wrap-around sums "
            "of dense integer gradient segments, which only invert when every device quantizes "
            "the same dense layout; a sparsifier's per-device supports or a quantizer's "
            "per-bucket scales cannot be summed inside a packet, so a sparsified or quantized "
            "message cannot be coded (use --coded_bits=8 or 16 to quantize the coded exchange "
            "itself)"
        )
    if c.redundancy is None:
        _invalid(
            f"exchange={c.exchange!r} needs redundancy (--redundancy), the devices holding "
            "each block of the batch, in [1, num_devices]"
        )
    if isinstance(c.redundancy, bool) or not isinstance(c.redundancy, (int, np.integer)):
        _invalid(f"redundancy (--redundancy) must be an integer >= 1, got {c.redundancy!r}")
    if c.redundancy < 1:
        _invalid(f"redundancy (--redundancy) must be an integer >= 1, got {c.redundancy!r}")
    if c.coded_value_range is not None and not (
        np.isfinite(c.coded_value_range) and c.coded_value_range > 0
    ):
        _invalid(f"coded_value_range (--coded_value_range) must be > 0, got {c.coded_value_range}")
    if c.coded_bits is not None and c.coded_bits not in cssgd.BITS:
        _invalid(
            f"coded_bits (--coded_bits) must be one of {', '.join(map(str, cssgd.BITS))}, "
            f"got {c.coded_bits}"
        )
    if c.num_processes is not None or c.coordinator_address is not None:
        _invalid(
            f"exchange={c.exchange!r} runs in one process only (every device's blocks are cut "
            "from the whole global batch on the host); leave coordinator_address, "
            "num_processes and process_id unset"
        )
    if c.fit_check_epochs:
        _invalid(
            f"fit_check_epochs (--fit_check_epochs) is not supported with "
            f"exchange={c.exchange!r} (it measures a device's share of a plain data-parallel "
            "batch; CSSGD's devices hold several overlapping blocks); leave it empty"
        )


def _validate_coded_devices(c: TrainConfig, n: int | None) -> None:
    """CSSGD's checks that need the device count ``n`` (skipped when unknown)."""
    if n is None:
        return
    if c.redundancy > n:
        _invalid(
            f"redundancy (--redundancy) must be in [1, num_devices={n}] (a block cannot live "
            f"on more devices than there are), got {c.redundancy}"
        )
    blocks = math.comb(n, c.redundancy)
    if c.batch_size % blocks:
        _invalid(
            f"batch_size={c.batch_size} must be a multiple of C(num_devices, redundancy) = "
            f"C({n}, {c.redundancy}) = {blocks} (CSSGD splits each batch into one block per "
            f"{c.redundancy}-subset of the {n} devices; e.g. 280 serves 8 devices at r = 1..4)"
        )


def learning_rate(config: TrainConfig, steps_per_epoch: int, total_steps: int):
    """The run's learning rate: a float (``constant``) or an optax schedule of the step.

    ``"step"``: ``lr * lr_decay**j`` from the first step of the ``j``-th epoch
    of ``lr_milestones`` (optax counts the steps already taken: step
    ``m * steps_per_epoch`` is the first with the new rate); without
    milestones, x``lr_decay`` at ``round(epochs * 4/7)`` and
    ``round(epochs * 6/7)`` (the DLGS paper's 80 and 120 of 140), merged into
    one drop when they coincide.
    """
    c = config
    if c.schedule == "cosine":
        return optax.cosine_decay_schedule(c.lr, max(total_steps, 1))
    if c.schedule == "step":
        epochs = total_steps // max(steps_per_epoch, 1)
        decay = getattr(c, "lr_decay", 0.1)
        milestones = tuple(getattr(c, "lr_milestones", ()))
        if not milestones:
            milestones = tuple(round(epochs * f) for f in (4 / 7, 6 / 7))
        boundaries = {}
        for epoch in milestones:
            at = int(epoch) * steps_per_epoch
            boundaries[at] = boundaries.get(at, 1.0) * decay
        return optax.piecewise_constant_schedule(c.lr, boundaries)
    return c.lr


def build_optimizer(config: TrainConfig, steps_per_epoch: int, total_steps: int, groups=None):
    """The compressor and the full optimizer ``optax.chain(compressor, sgd)``.

    Args:
      config: the run's configuration.
      steps_per_epoch: steps per epoch (drives the warm-up schedule).
      total_steps: steps of the whole run (the cosine schedule's length).
      groups: a sparsifier's ``groups=`` (the merge plan's groups of leaf
        paths); None: one group per leaf.

    Returns:
      ``(tx, compressor)``; ``tx``'s state is ``(compressor_state, sgd_state)``
      (with ``weight_decay``, ``tx`` is ``optax.chain(add_decayed_weights, that)``
      and its state ``(EmptyState, (compressor_state, sgd_state))``).
      For CSSGD runs (``exchange`` coded or uncoded) ``(sgd, None)``: the
      plain local SGD (with momentum) that ``jaxcomp.cssgd.make_train_step``
      applies to the exchanged mean gradient; the coded exchange replaces the
      compressor (a communicating ``tx`` would be rejected there).
    """
    tx, compressor = _build_optimizer(config, steps_per_epoch, total_steps, groups)
    return _with_weight_decay(tx, config), compressor


def _with_weight_decay(tx, config: TrainConfig):
    """``tx`` after coupled L2 (``wd * params`` added to the gradient); ``tx`` when 0.

    Without weight decay the chain (and so the optimizer state a checkpoint
    holds) is exactly what runs before ``weight_decay`` existed had.
    """
    wd = getattr(config, "weight_decay", 0.0)
    return optax.chain(optax.add_decayed_weights(wd), tx) if wd else tx


def _build_optimizer(config: TrainConfig, steps_per_epoch: int, total_steps: int, groups=None):
    c = resolve_config(config)
    lr = learning_rate(c, steps_per_epoch, total_steps)
    if is_coded(c):
        return (optax.sgd(lr, momentum=c.momentum) if c.momentum else optax.sgd(lr)), None
    on_compressor = c.momentum_correction and c.compressor in SPARSIFIERS and c.momentum > 0
    # Unset: the factory's own default (qsgd sends leaves of <= 10000 dense).
    dense_size = {} if c.min_dense_size is None else {"min_dense_size": c.min_dense_size}
    # Unset: the compressor's own default exchange.
    exchange = {} if c.exchange is None else {"exchange": c.exchange}
    if c.compressor == "dense":
        compressor = jaxcomp.dense_exchange(AXIS)
    elif c.compressor in SPARSIFIERS:
        warmup = tuple(jaxcomp.DGC_WARMUP[: c.warmup_epochs]) or None
        factory, extra = SPARSIFIER_FACTORIES.get(c.compressor, (c.compressor, {}))
        compressor = getattr(jaxcomp, factory)(
            **extra,
            ratio=c.ratio,
            axis_name=AXIS,
            momentum=c.momentum if on_compressor else 0.0,
            warmup_ratios=warmup,
            steps_per_epoch=steps_per_epoch if warmup else None,
            granularity=c.granularity,
            reuse_period=c.reuse_period,
            low_pass=c.low_pass,
            groups=groups,
            **dense_size,
            **exchange,
            seed=c.seed,
        )
    elif c.compressor == "qsgd":
        compressor = jaxcomp.qsgd(
            c.levels,
            bits=c.bits,
            bucket_size=c.bucket_size,
            axis_name=AXIS,
            seed=c.seed,
            # Kept in the state only when measured: a copy of the message.
            keep_message=c.coded_bytes_every is not None,
            **dense_size,
            **exchange,
        )
    elif c.compressor == "signum":
        # Signum's momentum is its own (the sign of the momentum is sent): plain SGD after.
        compressor = jaxcomp.signum(
            c.momentum, bucket_size=c.bucket_size, axis_name=AXIS, **dense_size, **exchange
        )
        return optax.chain(compressor, optax.sgd(lr)), compressor
    elif c.compressor == "cast":
        compressor = jaxcomp.cast(axis_name=AXIS, **dense_size, **exchange)
    elif c.compressor in LOW_RANK:
        # Flax kernels are (..., fan_in, out): matrices of their last dimension.
        compressor = jaxcomp.powersgd(
            c.rank, axis_name=AXIS, reshape="last", seed=c.seed, **dense_size
        )
    elif c.compressor in COMPRESSED_OPTIMIZERS:
        freeze = max(1, total_steps // 5) if c.freeze_step is None else c.freeze_step
        if c.compressor == "onebit_adam":
            tx = jaxcomp.onebit_adam(
                lr, b1=c.momentum, freeze_step=freeze, axis_name=AXIS, **dense_size
            )
        else:
            tx = jaxcomp.zero_one_adam(
                lr,
                b1=c.momentum,
                var_freeze_step=freeze,
                local_step_clipper=1,
                axis_name=AXIS,
                **dense_size,
            )
        return tx, tx
    else:
        compressor = getattr(jaxcomp, c.compressor)(
            bucket_size=c.bucket_size, axis_name=AXIS, **dense_size, **exchange
        )
    # Momentum correction: the compressor accumulates velocity, so the
    # optimizer after it must be plain SGD or momentum would apply twice.
    sgd = optax.sgd(lr) if on_compressor or c.momentum == 0 else optax.sgd(lr, momentum=c.momentum)
    return optax.chain(compressor, sgd), compressor


def _get(state, name):
    try:
        return optax.tree.get(state, name)
    except (KeyError, ValueError):
        return None


def _step_stats(state, num_params: int):
    """Per-device observability counters of this step (float32 scalars)."""
    wire = _get(state, "wire_bytes")
    msg = _get(state, "message_bytes")
    sent = _get(state, "sent_count")

    def total(tree):
        # Per-leaf pytrees of scalars (quantizers) or one array per field (sparsifiers).
        leaves = jax.tree.leaves(tree)
        return sum((jnp.sum(jnp.asarray(x, jnp.float32)) for x in leaves), jnp.float32(0))

    return {
        "wire_bytes": jnp.float32(0) if wire is None else jnp.asarray(wire, jnp.float32),
        # The dense baseline's message is the whole float32 gradient.
        "message_bytes": jnp.float32(4 * num_params) if msg is None else total(msg),
        "density": jnp.float32(-1) if sent is None else total(sent) / num_params,
    }


def _loss_fn(model):
    def loss_fn(params, x, y):
        logits = model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return loss_fn


def _stateful_loss_fn(model):
    """``loss(params, model_state, x, y) -> (loss, new_model_state)`` in training mode.

    BatchNorm (``norm="batch"``, built with ``axis_name=AXIS``) normalises
    with the batch statistics averaged over the devices and returns the
    updated running averages, the same on every device.
    """

    def loss_fn(params, model_state, x, y):
        logits, new_state = model.apply(
            {"params": params, **model_state}, x, train=True, mutable=list(model_state)
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss, new_state

    return loss_fn


def _make_train_step(
    model, tx, mesh, num_params: int, communicate: bool = True, stateful: bool = False
):
    """The jitted step (params and optimizer state donated).

    ``communicate=False``: the same step with every collective replaced by a
    local stand-in of the same shapes (``jaxcomp.comm.without_communication``),
    to time it without its communication. ``stateful``: the model has
    mutable collections (BatchNorm's ``batch_stats``): the step is
    ``step(params, opt_state, model_state, x, y) -> (params, opt_state,
    model_state, metrics)``, the model state replicated (and donated).
    """
    # Casts params to device-varying so each device compresses its own gradient.
    if stateful:
        value_and_grad = jaxcomp.distributed.per_device_value_and_grad(
            _stateful_loss_fn(model), AXIS, has_aux=True
        )
    else:
        value_and_grad = jaxcomp.distributed.per_device_value_and_grad(_loss_fn(model), AXIS)

    def update(params, opt_state, loss, grads):
        state = jax.tree.map(lambda a: a[0], opt_state)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        metrics = {k: lax.pmean(v, AXIS) for k, v in _step_stats(state, num_params).items()}
        metrics["loss"] = lax.pmean(loss, AXIS)
        return params, jax.tree.map(lambda a: a[None], state), metrics

    def step(params, opt_state, x, y):
        loss, grads = value_and_grad(params, x, y)
        return update(params, opt_state, loss, grads)

    def stateful_step(params, opt_state, model_state, x, y):
        (loss, new_state), grads = value_and_grad(params, model_state, x, y)
        # Already the same on every device (statistics of the whole batch);
        # the mean keeps them replicated whatever the float rounding.
        new_state = jax.tree.map(lambda a: lax.pmean(a, AXIS), new_state)
        params, opt_state, metrics = update(params, opt_state, loss, grads)
        return params, opt_state, new_state, metrics

    fn = stateful_step if stateful else step
    state_specs = (P(),) if stateful else ()
    sharded = jax.shard_map(
        fn if communicate else jaxcomp.comm.without_communication(fn),
        mesh=mesh,
        in_specs=(P(), P(AXIS), *state_specs, P(AXIS), P(AXIS)),
        out_specs=(P(), P(AXIS), *state_specs, P()),
        # A sparse exchange ends in an all-gather, typed varying though
        # identical on every device (see jaxcomp.distributed.make_train_step).
        check_vma=False,
    )
    return jax.jit(sharded, donate_argnums=(0, 1, 2) if stateful else (0, 1))


def _make_forward_backward(model, mesh, stateful: bool = False):
    """Each device's forward and backward pass, the gradient applied locally.

    ``stateful``: ``f(params, model_state, x, y)`` (BatchNorm in training
    mode, its statistics averaged over the devices as in the step).
    """
    if stateful:
        value_and_grad = jaxcomp.distributed.per_device_value_and_grad(
            _stateful_loss_fn(model), AXIS, has_aux=True
        )
    else:
        value_and_grad = jaxcomp.distributed.per_device_value_and_grad(_loss_fn(model), AXIS)

    def step(params, *args):
        _, grads = value_and_grad(params, *args)
        return optax.apply_updates(params, grads)

    state_specs = (P(),) if stateful else ()
    return jax.jit(
        jax.shard_map(
            step,
            mesh=mesh,
            in_specs=(P(), *state_specs, P(AXIS), P(AXIS)),
            out_specs=P(),
            check_vma=False,
        ),
        donate_argnums=0,
    )


# --sampling=feature: the mlp's first dense layer is model-parallel over slices of
# the input features; the rest of the model runs replicated on the whole batch.
#
# Parameters {"slices": kernel slices (N, F_max, H) sharded over AXIS (device d
# owns rows feature_slices(F, N)[d] of the kernel, zero-padded to F_max), "rest":
# every other parameter, replicated}; optimizer state (slice state, rest state),
# each stacked per device. The slices' gradients are their devices' own
# (sampling.feature_parallel_dense sums the partial products forward and
# passes the replicated cotangent back unchanged), so they get the optimizer
# alone; the rest's gradients are the same on every device and take the
# compressor's path as in data-parallel runs.

_FIRST = "Dense_0"


def _feature_rest(params):
    """The mlp's parameters without the first kernel (the replicated part)."""
    rest = dict(params)
    rest[_FIRST] = {k: v for k, v in params[_FIRST].items() if k != "kernel"}
    return rest


def _feature_layers(params) -> int:
    """The mlp's dense layers ``Dense_0..Dense_{L-1}`` (what the feature loss applies)."""
    names = [f"Dense_{i}" for i in range(len(params))]
    if sorted(params) != sorted(names) or "kernel" not in params[_FIRST]:
        raise ValueError(
            f"sampling='feature' needs the mlp's parameters Dense_0..Dense_{len(params) - 1}, "
            f"got {sorted(params)}"
        )
    return len(names)


def _feature_params(params, mesh):
    """Host mlp parameters placed in the feature layout (one process)."""
    n = mesh.shape[AXIS]
    slices = sampling_lib.split_features(np.asarray(params[_FIRST]["kernel"]), n, axis=0)
    return {
        "slices": jax.device_put(slices, jax.sharding.NamedSharding(mesh, P(AXIS))),
        "rest": jaxcomp.distributed.replicate(_feature_rest(params), mesh),
    }


def _feature_host_params(params, num_features: int):
    """The feature layout gathered back into the mlp's parameters (host numpy)."""
    rest = _host_tree(params["rest"])
    kernel = sampling_lib.join_features(np.asarray(params["slices"]), num_features, axis=0)
    return {**rest, _FIRST: {**rest[_FIRST], "kernel": kernel}}


def _feature_batch(xb, yb, mesh):
    """A global batch as the feature step reads it: (N, B, F_max) slices, labels replicated."""
    x = np.asarray(xb).reshape(len(xb), -1)
    slices = sampling_lib.split_features(x, mesh.shape[AXIS], axis=1)
    return (
        jax.device_put(slices, jax.sharding.NamedSharding(mesh, P(AXIS))),
        jaxcomp.distributed.replicate(np.asarray(yb), mesh),
    )


def _feature_loss_fn(num_layers: int):
    """``loss({"slice", "rest"}, x_slice, y)`` of the mlp, inside shard_map over AXIS."""

    def loss_fn(p, x, y):
        # models.MLP: Dense, ReLU after every layer but the last.
        h = sampling_lib.feature_parallel_dense(x, p["slice"], AXIS) + p["rest"][_FIRST]["bias"]
        for i in range(1, num_layers):
            layer = p["rest"][f"Dense_{i}"]
            h = jnp.matmul(jax.nn.relu(h), layer["kernel"]) + layer["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    return loss_fn


def _feature_value_and_grad(num_layers: int):
    """This device's ``(loss, {"slice": grad, "rest": grad})``, inside shard_map."""
    value_and_grad = jaxcomp.distributed.per_device_value_and_grad(
        _feature_loss_fn(num_layers), AXIS
    )

    def f(params, x, y):
        return value_and_grad({"slice": params["slices"][0], "rest": params["rest"]}, x[0], y)

    return f


_FEATURE_PARAM_SPECS = {"slices": P(AXIS), "rest": P()}


def _feature_slice_optimizer(config: TrainConfig, steps_per_epoch: int, total_steps: int):
    """The kernel slices' optimizer: the run's SGD (momentum, schedule), no compressor."""
    c = resolve_config(config)
    lr = learning_rate(c, steps_per_epoch, total_steps)
    return _with_weight_decay(
        optax.sgd(lr, momentum=c.momentum) if c.momentum else optax.sgd(lr), c
    )


def _init_feature_opt_state(slice_tx, tx, params, mesh):
    """(slice state, rest state), each with a leading device axis sharded over AXIS."""

    def init(slices, rest):
        return jax.tree.map(lambda a: a[None], (slice_tx.init(slices[0]), tx.init(rest)))

    init_fn = jax.shard_map(
        init, mesh=mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS), check_vma=False
    )
    return jax.jit(init_fn)(params["slices"], params["rest"])


def _make_feature_train_step(
    slice_tx,
    tx,
    mesh,
    num_layers: int,
    num_rest: int,
    activation_bytes: float,
    communicate: bool = True,
):
    """The jitted feature-parallel step (params and optimizer state donated).

    ``num_rest`` counts the compressed parameters (density and the dense
    message size refer to them); ``activation_bytes`` is the all-reduce of
    the first layer's partial products, added to the step's wire bytes.
    """
    value_and_grad = _feature_value_and_grad(num_layers)

    def step(params, opt_state, x, y):
        slice_state, state = jax.tree.map(lambda a: a[0], opt_state)
        loss, grads = value_and_grad(params, x, y)
        own = params["slices"][0]
        # A slice's gradient is its device's alone: no exchange, no compression.
        slice_updates, slice_state = slice_tx.update(grads["slice"], slice_state, own)
        updates, state = tx.update(grads["rest"], state, params["rest"])
        new_params = {
            "slices": optax.apply_updates(own, slice_updates)[None],
            "rest": optax.apply_updates(params["rest"], updates),
        }
        stats = _step_stats(state, num_rest)
        stats["wire_bytes"] = stats["wire_bytes"] + jnp.float32(activation_bytes)
        metrics = {k: lax.pmean(v, AXIS) for k, v in stats.items()}
        metrics["loss"] = lax.pmean(loss, AXIS)
        return new_params, jax.tree.map(lambda a: a[None], (slice_state, state)), metrics

    sharded = jax.shard_map(
        step if communicate else jaxcomp.comm.without_communication(step),
        mesh=mesh,
        in_specs=(_FEATURE_PARAM_SPECS, P(AXIS), P(AXIS), P()),
        out_specs=(_FEATURE_PARAM_SPECS, P(AXIS), P()),
        check_vma=False,  # as _make_train_step (sparse exchanges end in an all-gather)
    )
    return jax.jit(sharded, donate_argnums=(0, 1))


def _make_feature_forward_backward(mesh, num_layers: int):
    """The feature step's forward and backward, applied locally, without collectives.

    The forward's all-reduce of the partial products is communication: it is
    replaced by its local stand-in here, so the split's communication part
    holds it with the gradient exchange.
    """
    value_and_grad = _feature_value_and_grad(num_layers)

    def step(params, x, y):
        _, grads = value_and_grad(params, x, y)
        return {
            "slices": (params["slices"][0] - grads["slice"])[None],
            "rest": optax.apply_updates(params["rest"], grads["rest"]),
        }

    return jax.jit(
        jax.shard_map(
            jaxcomp.comm.without_communication(step),
            mesh=mesh,
            in_specs=(_FEATURE_PARAM_SPECS, P(AXIS), P()),
            out_specs=_FEATURE_PARAM_SPECS,
            check_vma=False,
        ),
        donate_argnums=0,
    )


def _batch_loss_fn(model):
    """``loss(params, (x, y))``: the loss of one block, as ``jaxcomp.cssgd`` calls it."""
    loss_fn = _loss_fn(model)
    return lambda params, batch: loss_fn(params, *batch)


def _coded_config(config: TrainConfig) -> cssgd.CodedConfig:
    c = resolve_config(config)
    return cssgd.CodedConfig(
        redundancy=c.redundancy,
        value_range=c.coded_value_range,
        bits=c.coded_bits,
        exchange=c.exchange,
    )


def _make_coded_forward_backward(model, mesh):
    """Each device's per-block gradients of a CSSGD step (vmapped), applied locally."""
    value_and_grad = jaxcomp.distributed.per_device_value_and_grad(_batch_loss_fn(model), AXIS)

    def step(params, blocks):
        local = jax.tree.map(lambda a: a[0], blocks)
        _, block_grads = jax.vmap(value_and_grad, in_axes=(None, 0))(params, local)
        return optax.apply_updates(params, jax.tree.map(lambda g: jnp.mean(g, 0), block_grads))

    return jax.jit(
        jax.shard_map(step, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=P(), check_vma=False),
        donate_argnums=0,
    )


def _time_split(programs, params, opt_state, batch, repeats: int = 5, model_state=None):
    """``jaxcomp.distributed.TimeSplit`` of the step, medians over fresh copies of the state.

    ``model_state``: the BatchNorm statistics of a stateful step (None: stateless).
    """
    step, local_step, forward_backward = programs
    extra = () if model_state is None else (model_state,)
    return jaxcomp.distributed.split_step_time(
        forward_backward=timing.median_seconds_fresh(
            forward_backward, (params, *extra, *batch), repeats
        ),
        without_communication=timing.median_seconds_fresh(
            local_step, (params, opt_state, *extra, *batch), repeats
        ),
        step=timing.median_seconds_fresh(step, (params, opt_state, *extra, *batch), repeats),
    )


def _coded_bytes(config: TrainConfig, opt_state, params) -> float:
    """Elias-coded bytes (``jaxcomp.coding.encode_qsgd``) of device 0's last message.

    Read on the host from the message the step kept (``keep_message``): this
    process's first device's shard of the per-device state.
    """
    kept = {name: optax.tree.get(opt_state, name) for name in ("message", "message_bytes")}
    kept = jax.tree.map(lambda a: np.asarray(a.addressable_data(0))[0], kept)
    s = qsgd_levels(config.levels, config.bits)
    per_leaf = jaxcomp.coding.coded_message_bytes(kept, params, s=s, bucket_size=config.bucket_size)
    return float(sum(jax.tree.leaves(per_leaf)))


def _host_tree(tree):
    """A replicated global tree as host numpy arrays (works across processes)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def _evaluate(model, params, x, y, batch: int = 512, model_state=None) -> float:
    """Test accuracy; BatchNorm models normalise with the running averages ``model_state``."""
    extra = model_state or {}
    apply = jax.jit(
        lambda p, s, xb: jnp.argmax(model.apply({"params": p, **s}, xb, train=False), -1)
    )
    correct = 0
    for i in range(0, len(y), batch):
        pred = np.asarray(apply(params, extra, x[i : i + batch]))
        correct += int(np.sum(pred == y[i : i + batch]))
    return correct / max(len(y), 1)


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


def _checkpoint_manager(workdir: str):
    import orbax.checkpoint as ocp  # noqa: PLC0415 (only needed with checkpointing)

    return ocp, ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"),
        options=ocp.CheckpointManagerOptions(max_to_keep=2),
    )


def _metrics_line(record: dict) -> str:
    """``record`` as a line of strict JSON: a non-finite float (a diverged loss) as null.

    Python's ``json`` would write ``NaN``/``Infinity``, which is not JSON: ``jq``,
    JavaScript and other strict parsers reject the whole file.
    """
    return jsonio.dumps(record) + "\n"


def _read_records(path: str, upto: int) -> list:
    """The records of ``metrics.jsonl`` up to epoch ``upto``; null read back as NaN.

    No field is null otherwise, so a resumed run's records hold the floats an
    uninterrupted run's would (NaN for any non-finite value); files written
    with a bare ``NaN`` still read.
    """
    if not os.path.exists(path):
        return []
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        records = [{k: math.nan if v is None else v for k, v in r.items()} for r in records]
        return [r for r in records if r["epoch"] <= upto]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise WorkdirError(
            f"{path} is not a metrics file of this program ({e}){_OVERWRITE}"
        ) from None


class WorkdirError(ValueError):
    """The workdir holds a run this configuration must not resume or mix with."""


CONFIG_FILE = "config.json"
_CONFIG_FORMAT = 1
# Fields that change neither the trained parameters nor what the metrics
# mean: a run may resume with other values. ``epochs`` may also grow (to
# train longer, never shrink) when both schedules are "constant"; with "cosine" the
# schedule of the epochs already done depends on it.
RESUMABLE_FIELDS = (
    "progress",
    "checkpoint",
    "time_split",
    "time_compression",  # the name of time_split in config.json of older runs
    "data_dir",
    "download",
    "coordinator_address",
    "num_processes",
    "process_id",
    "fit_check_epochs",
)
_OVERWRITE = (
    "; use another --workdir, or pass --overwrite (train_and_evaluate(..., overwrite=True)) "
    "to delete its checkpoints and metrics"
)


def _config_record(config: TrainConfig, num_devices: int) -> dict:
    """What ``config.json`` holds: the resolved config with the real device count."""
    fields = dataclasses.asdict(resolve_config(config))
    fields["num_devices"] = num_devices
    # As config.json holds it (tuples become lists), so that a stored
    # configuration compares equal to the one it was written from.
    return {"format": _CONFIG_FORMAT, "config": json.loads(json.dumps(fields))}


# Fields added after config.json existed whose default is not None: a
# config.json without them is a run that had this value.
_ADDED_FIELD_DEFAULTS = {
    "sampling": "global",
    "lr_milestones": [],
    "lr_decay": 0.1,
    "weight_decay": 0.0,
    "norm": "group",
    "augment": False,
}


def _data_record(dataset) -> dict:
    """What identifies the data a run trains and tests on, for ``config.json``.

    ``data_dir`` may change on resuming (the same files moved), so the data
    themselves are recorded: their sizes, image shape and a cheap fingerprint
    (every label and 16 evenly spaced images of each split).
    """
    digest = hashlib.sha256()
    for x, y in ((dataset.train_x, dataset.train_y), (dataset.test_x, dataset.test_y)):
        picks = np.unique(np.linspace(0, len(y) - 1, 16).astype(np.int64))
        digest.update(np.ascontiguousarray(np.asarray(y, np.int64)).tobytes())
        digest.update(np.ascontiguousarray(np.asarray(x[picks], np.float32)).tobytes())
    return {
        "train_examples": len(dataset.train_y),
        "test_examples": len(dataset.test_y),
        "image_shape": [int(d) for d in dataset.train_x.shape[1:]],
        "num_classes": int(dataset.num_classes),
        "fingerprint": digest.hexdigest()[:16],
    }


def _config_differences(stored: dict, current: dict) -> list:
    # A run under a constant schedule may be extended, unless something else
    # depends on the total: the compressed Adams' default freeze step (a fifth).
    extensible = stored.get("schedule") == current.get("schedule") == "constant" and not (
        current.get("compressor") in COMPRESSED_OPTIMIZERS and current.get("freeze_step") is None
    )
    diffs = []
    for name in sorted(set(stored) | set(current)):
        if name in RESUMABLE_FIELDS or (name == "epochs" and extensible):
            continue
        # A field absent from an older config.json had its default (None unless listed).
        old = stored.get(name, _ADDED_FIELD_DEFAULTS.get(name))
        new = current.get(name, _ADDED_FIELD_DEFAULTS.get(name))
        if old != new:
            diffs.append(f"{name}={old!r} there, {new!r} now")
    return diffs


def _has_state(workdir: str) -> bool:
    """Whether ``workdir`` holds checkpoints or metrics a run could mix with its own."""
    ckpt = os.path.join(workdir, "checkpoints")
    if os.path.isdir(ckpt) and os.listdir(ckpt):
        return True
    metrics = os.path.join(workdir, "metrics.jsonl")
    if os.path.exists(metrics):
        with open(metrics) as f:
            return bool(f.read().strip())
    return False


def _clear_workdir(workdir: str) -> None:
    """Deletes what this program wrote in ``workdir`` (nothing else)."""
    import shutil  # noqa: PLC0415

    shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
    names = os.listdir(workdir) if os.path.isdir(workdir) else []
    written = [
        "metrics.jsonl",
        "accuracy.png",
        "time_split.png",
        CONFIG_FILE,
        MERGE_PLAN_FILE,
        "fit_check.json",
        *(n for n in names if re.fullmatch(r"fit_check_epoch\d+\.png", n)),
    ]
    for name in written:
        path = os.path.join(workdir, name)
        if os.path.exists(path):
            os.remove(path)


def _check_workdir(
    config: TrainConfig, workdir: str, num_devices: int, overwrite: bool, data: dict | None = None
) -> None:
    """Refuses a workdir holding another configuration's run; writes ``config.json``.

    Runs before any training, so a resumed run can only continue its own
    checkpoints and metrics. ``data`` (:func:`_data_record`) is recorded and
    must match the stored record; a ``config.json`` without one (written
    before it was recorded) is accepted, its data unknown.
    """
    record = _config_record(config, num_devices)
    if data is not None:
        record["data"] = data
    path = os.path.join(workdir, CONFIG_FILE)
    primary = jax.process_index() == 0
    if overwrite:
        if primary:
            _clear_workdir(workdir)
    elif _has_state(workdir):
        if not os.path.exists(path):
            raise WorkdirError(
                f"workdir {workdir} holds checkpoints or metrics but no {CONFIG_FILE} (written "
                f"by an older version, or not by this program), so they cannot be checked "
                f"against this configuration{_OVERWRITE}"
            )
        try:
            with open(path) as f:
                stored = json.load(f)
            fmt, stored_config = stored["format"], stored["config"]
            if not isinstance(stored_config, dict):
                raise TypeError("'config' is not an object")
        except (ValueError, KeyError, TypeError) as e:
            raise WorkdirError(
                f"{path} is not a valid run configuration ({e}){_OVERWRITE}"
            ) from None
        if fmt != _CONFIG_FORMAT:
            raise WorkdirError(
                f"{path} has format {fmt!r}, this program writes {_CONFIG_FORMAT}{_OVERWRITE}"
            )
        diffs = _config_differences(stored_config, record["config"])
        if diffs:
            raise WorkdirError(
                f"workdir {workdir} holds a run with another configuration "
                f"({'; '.join(diffs)}), refusing to resume from it{_OVERWRITE}"
            )
        if not stored_config.get("checkpoint", True):
            # The run there saved no checkpoint: this one would start over and
            # truncate its metrics (finished or not) without a word.
            raise WorkdirError(
                f"workdir {workdir} holds a run with checkpoint=False (--checkpoint=false), "
                f"which left no checkpoint to resume from; a rerun would start over and "
                f"rewrite its metrics{_OVERWRITE}"
            )
        stored_epochs, epochs = stored_config.get("epochs"), record["config"]["epochs"]
        if isinstance(stored_epochs, int) and epochs < stored_epochs:
            # Only growing is resuming: a shrunk rerun would train nothing past
            # the epochs done and leave config.json claiming fewer than it holds.
            done = len(_read_records(os.path.join(workdir, "metrics.jsonl"), math.inf))
            raise WorkdirError(
                f"workdir {workdir} holds a run of epochs={stored_epochs} ({done} done), "
                f"epochs={epochs} now: epochs may only grow (--epochs>={stored_epochs}) on "
                f"resuming{_OVERWRITE}"
            )
        stored_data = stored.get("data")
        if data is not None and isinstance(stored_data, dict):
            changed = [
                f"{k}={stored_data.get(k)!r} there, {v!r} now"
                for k, v in data.items()
                if stored_data.get(k) != v
            ]
            if changed:
                # data_dir may change on resuming, the data may not: the epochs
                # done and those to come would train (and test) on two datasets.
                raise WorkdirError(
                    f"workdir {workdir} holds a run on other data ({'; '.join(changed)}; "
                    f"--data_dir={config.data_dir!r} now), refusing to resume from it{_OVERWRITE}"
                )
        if not config.checkpoint:
            # Without checkpoints the run starts over: it would rewrite the
            # metrics of the run there, and a later resume would mix the two.
            raise WorkdirError(
                f"workdir {workdir} holds a run's checkpoints or metrics, and checkpoint=False "
                f"(--checkpoint=false) would start over and rewrite them{_OVERWRITE}"
            )
    if primary:
        os.makedirs(workdir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(record, f, indent=2)
    if jax.process_count() > 1:
        # The other processes must not list checkpoints while they are deleted.
        from jax.experimental import multihost_utils  # noqa: PLC0415

        multihost_utils.sync_global_devices("jaxcomp_check_workdir")


MERGE_PLAN_FILE = "merge_plan.json"
_MERGE_PLAN_FORMAT = 1
# The link the merge planner assumes (t_c = alpha + beta * bytes): 10 Gbit
# Ethernet, 50 us per message and 1.25e9 bytes/s. A message carries an
# (int32 index, float32 value) pair per selected element, 8 * ratio bytes per
# gradient element.
MERGE_ALPHA = 50e-6
MERGE_BETA = 1 / 1.25e9


def _storable(tree):
    """``tree`` with its zero-size leaves as None, for orbax.

    Orbax refuses to save an array of zero size ("Cannot save arrays with zero
    size"), and such a leaf holds nothing: 1-bit Adam's and 0/1 Adam's server
    error with the all-gather exchange, an empty parameter.
    """
    return jax.tree.map(lambda x: None if np.size(x) == 0 else x, tree)


def _with_empty_leaves(restored, target):
    """``restored`` with ``target``'s zero-size leaves where :func:`_storable` put None."""
    return jax.tree.map(
        lambda r, t: t if r is None else r, restored, target, is_leaf=lambda x: x is None
    )


def merge_link_cost(config: TrainConfig) -> planning.LinearCost:
    """The merge planner's ``t_c``: the config's link (or 10 GbE) for (index, value) messages."""
    alpha = MERGE_ALPHA if config.merge_alpha is None else config.merge_alpha
    beta = MERGE_BETA if config.merge_beta is None else config.merge_beta
    return planning.linear_cost(alpha, beta, 8 * config.ratio)


def _layer_groups_to_paths(layers, layer_groups) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(p for q in g for p in layers[q].paths) for g in layer_groups)


def _stored_merge_plan(
    path: str, config_record: dict, layer_names: list, t_c: planning.LinearCost
) -> dict | None:
    """The plan in ``path`` when it was made for this configuration, model and link, else None."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored["format"] != _MERGE_PLAN_FORMAT or stored["layers"] != layer_names:
            return None
        if _config_differences(stored["config"], config_record):
            return None
        # Unset flags stand for MERGE_ALPHA and MERGE_BETA: a plan made for other
        # constants is another link's plan.
        if stored["t_c"] != dataclasses.asdict(t_c):
            return None
        flat = [q for g in stored["layer_groups"] for q in g]
        if flat != list(range(len(layer_names))):
            return None
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return stored


def _make_merge_plan(
    config: TrainConfig, model, params, dataset, num_devices: int, model_state=None
) -> dict:
    """Profiles one device's shard of the first batch and plans the merge (a JSON record)."""
    xb, yb = next(
        data_lib.epoch_batches(dataset.train_x, dataset.train_y, config.batch_size, config.seed, 0)
    )
    per_device = config.batch_size // num_devices

    if model_state:
        # One device's training forward (batch statistics of its shard; the
        # cross-device mean of the step is communication, not profiled here).
        local_model = model.clone(axis_name=None)

        def loss_fn(p, batch):
            logits, _ = local_model.apply(
                {"params": p, **model_state}, batch[0], train=True, mutable=list(model_state)
            )
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    else:

        def loss_fn(p, batch):
            logits = model.apply({"params": p}, batch[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    batch = (jnp.asarray(xb[:per_device]), jnp.asarray(yb[:per_device]))
    t0 = time.perf_counter()
    # Flops split the backward between layers deterministically (timings of
    # single layers are noise on a small model); one timing sets the scale.
    profile = planning.profile_backward(loss_fn, params, batch, method="flops")
    selector = SPARSIFIER_FACTORIES.get(config.compressor, (config.compressor,))[0]
    t_s = planning.measure_sparsify_cost(selector, ratio=config.ratio)
    t_c = merge_link_cost(config)
    model_plan = planning.plan_for_model(
        loss_fn,
        params,
        batch,
        ratio=config.ratio,
        t_s=t_s,
        t_c=t_c,
        method=config.merge,
        profile=profile,
    )
    seconds = time.perf_counter() - t0
    summary = model_plan.summary()
    logging.info("%s\n  (profiled and planned in %.1f s)", summary, seconds)
    return {
        "format": _MERGE_PLAN_FORMAT,
        "method": config.merge,
        "layers": [layer.name for layer in profile.layers],
        "layer_groups": [list(g) for g in model_plan.plan.groups],
        "groups": [list(g) for g in model_plan.groups],
        "predicted_time": model_plan.plan.time,
        "predicted_times": model_plan.predicted_times(),
        "profile": {
            "method": profile.method,
            "t_f": profile.t_f,
            "t_b": list(profile.t_b),
            "sizes": list(profile.sizes),
            "flops_b": list(profile.flops_b),
            "flops_f": profile.flops_f,
            "batch_per_device": per_device,
            "seconds": seconds,
        },
        "t_s": {"selector": selector, "alpha": t_s.alpha, "beta": t_s.beta},
        "t_c": dataclasses.asdict(t_c),
        "summary": summary,
    }


def _merge_groups(
    config: TrainConfig, model, params, dataset, workdir: str, num_devices: int, model_state=None
):
    """The sparsifier's ``groups`` of a ``merge`` run, and its ``merge_plan.json`` record.

    Process 0 reuses the workdir's plan when it was made for this
    configuration (a resumed run must compile the same groups) or makes and
    writes one; every process then builds the groups from process 0's layer
    grouping, so all of them run the same program.
    """
    layers = planning.model_layers(params)[::-1]  # backward order, as the planner's positions
    names = [layer.name for layer in layers]
    path = os.path.join(workdir, MERGE_PLAN_FILE)
    record = None
    if jax.process_index() == 0:
        config_record = _config_record(config, num_devices)["config"]
        record = _stored_merge_plan(path, config_record, names, merge_link_cost(config))
        if record is not None:
            logging.info("reusing the merge plan in %s", path)
        else:
            record = _make_merge_plan(config, model, params, dataset, num_devices, model_state)
            # As merge_plan.json holds it (tuples become lists), so that the
            # returned record equals the stored one.
            record["config"] = json.loads(json.dumps(config_record))
            with open(path, "w") as f:
                json.dump(record, f, indent=1)
        owner = np.zeros(len(layers), np.int32)  # group index of each layer position
        # The plan's positions index its own layer list (the forward pass's
        # order, see planning.model_layers): map them by name.
        position = {name: q for q, name in enumerate(names)}
        for gi, g in enumerate(record["layer_groups"]):
            owner[[position[record["layers"][q]] for q in g]] = gi
    else:
        owner = np.zeros(len(layers), np.int32)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils  # noqa: PLC0415

        owner = np.asarray(multihost_utils.broadcast_one_to_all(owner))
    layer_groups = [[] for _ in range(int(owner.max()) + 1)]
    for q, gi in enumerate(owner.tolist()):
        layer_groups[gi].append(q)
    return _layer_groups_to_paths(layers, layer_groups), record


def train_and_evaluate(
    config: TrainConfig,
    workdir: str,
    *,
    stop_after_epoch: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Trains ``config.model`` on ``config.dataset`` with ``config.compressor``.

    Each epoch appends to ``workdir/metrics.jsonl`` one line of strict JSON (a
    non-finite value, such as the loss of a diverged run, is written as
    ``null``; the records returned, and those read back on resuming, hold
    NaN there): ``epoch`` (1-based),
    ``train_loss`` (mean over the epoch's steps), ``test_accuracy`` (fraction),
    ``wall_time`` (seconds of training so far, evaluation included),
    ``train_time`` (seconds in training steps so far: no compilation, no
    evaluation, no compression timing),
    ``bytes_per_step_per_device`` (mean ``wire_bytes``: what each device put
    on the wire per step; the ring all-reduce's for dense),
    ``message_bytes_per_step_per_device`` (the device's own compressed
    gradient, dense: 4 bytes per parameter), ``cumulative_bytes_per_device``,
    ``density`` (elements sent / parameters, -1 for quantizers),
    ``coded_bytes_per_step_per_device`` (``qsgd`` with ``coded_bytes_every``:
    the mean, over the epoch's measured steps, of the Elias-coded size of
    device 0's message, ``jaxcomp.coding.coded_message_bytes``, beside the
    fixed-width ``message_bytes``; -1 when not measured),
    ``step_time`` (median seconds of the epoch's steps, host work included),
    and the time split of a step (``time_split``; seconds, -1 when off),
    measured after each epoch on its last batch and the current state, as
    medians of 5 calls on fresh copies of the donated state:
    ``time_step`` (the jitted step alone), ``time_forward_backward``,
    ``time_compression`` (the step with every collective replaced by a local
    stand-in of the same shapes, minus the forward and backward: selection,
    encoding, decoding of the received messages, the optimizer's update) and
    ``time_communication`` (the step minus that: the exposed communication),
    ``time_step_without_communication``; ``compression_time_share`` is
    ``time_compression / time_step``. ``time_split.png`` stacks the three
    parts per epoch (:func:`jaxcomp.distributed.time_split` for the method).

    CSSGD runs (``exchange`` coded or uncoded, :mod:`jaxcomp.cssgd`) record
    the same fields with the multicast accounting of ``cssgd.coded_mean``:
    ``bytes_per_step_per_device`` is the mean over devices of the bytes each
    sends (every packet once, however many devices receive it;
    ``cssgd.bytes_per_worker(n, r, num_params)["coded_sent"]`` when coded),
    ``message_bytes_per_step_per_device`` the same bytes (a device's own
    message is its packets), ``density`` -1, and besides them ``exchange``,
    ``redundancy``, ``received_bytes_per_step_per_device`` (what a device
    receives: each packet counted once per receiver) and ``clipped`` and
    ``nonfinite`` (gradient values clipped to ``coded_value_range`` and
    non-finite values so far in the run, summed over devices, so a value of
    a block held by ``r`` devices counts ``r`` times). Their time split runs
    the same method on CSSGD's step: ``time_forward_backward`` is the
    per-block gradients of the device's ``C(n-1, r-1)`` blocks (``r`` times
    plain data parallelism's work), ``time_compression`` the quantization,
    encoding, decoding and SGD update, ``time_communication`` the exposed
    all-gather that stands in for the multicast.

    ``sampling`` decides which examples each device's share of a batch holds
    (:mod:`jaxcomp.sampling`; the step is the same). Feature runs
    (``sampling="feature"``) put the first layer's partial products through
    an all-reduce every step: ``bytes_per_step_per_device`` adds its bytes
    (``activation_bytes_per_step_per_device``, a ring all-reduce of the
    ``(batch_size, hidden)`` float32 product) to the compressor's exchange
    of the other parameters' gradients, which ``message_bytes`` and
    ``density`` describe (the kernel slices are not compressed); their time
    split counts that all-reduce as communication.

    Args:
      config: the run configuration (validated first).
      workdir: output directory (created); resumes from its checkpoints. Its
        ``config.json`` (the resolved configuration, written before training)
        must match ``config`` except for ``RESUMABLE_FIELDS`` (and ``epochs``
        with constant schedules), and its record of the data (sizes, image
        shape, fingerprint; absent from older ones) the data loaded,
        whenever it holds checkpoints or metrics.
        With several processes it must be one directory all of them share
        (orbax's primary process creates the checkpoint directories; separate
        per-process directories make the other processes wait and time out).
      stop_after_epoch: end this call after that epoch as if interrupted (the
        schedule still spans ``config.epochs``; rerun to resume).
      overwrite: delete the workdir's checkpoints, metrics, plot and
        ``config.json`` first instead of resuming (a new run).

    Returns:
      ``{"compile_time": seconds to compile the step in this call,
      "records": [...], "final": last record, "num_params": int,
      "params": host numpy parameters, "model_state": host numpy BatchNorm
      running averages (``{"batch_stats": ...}``; None without ``norm="batch"``),
      "merge_plan": the merge_plan.json
      record (None without ``merge``, and on processes other than 0)}``.

    Raises:
      ValueError: an invalid configuration (``ConfigError``: a bad field, an
        argument a jaxcomp factory rejects, a batch larger than the training
        set, data that cannot be read), raised before anything is written to
        the workdir; a workdir holding another configuration's run (or one
        without ``config.json``), or checkpoints that cannot be restored
        (``WorkdirError``; all before any training).
    """
    validate_config(config, jax.device_count())
    c = resolve_config(config)
    n_dev = c.num_devices or jax.device_count()
    if jax.process_count() > 1 and n_dev != jax.device_count():
        # A mesh over a prefix of jax.devices() would leave some processes out.
        _invalid(
            f"with {jax.process_count()} processes num_devices must be "
            f"every device ({jax.device_count()}), got {n_dev}"
        )
    coded_cfg = _coded_config(c) if is_coded(c) else None
    if coded_cfg is not None and jax.process_count() > 1:
        _invalid(
            f"exchange={c.exchange!r} runs in one process only (each device's "
            f"blocks are cut from the whole global batch on the host), got "
            f"{jax.process_count()} processes"
        )
    feature = c.sampling == "feature"
    if feature and jax.process_count() > 1:
        _invalid(
            f"sampling='feature' runs in one process only, got {jax.process_count()} processes"
        )
    label = c.compressor if coded_cfg is None else f"{c.exchange} r={c.redundancy}"
    if c.sampling != "global":
        label = f"{label} ({c.sampling} sampling)"
    # The data is read and checked before config.json is written: a run that
    # cannot start leaves the workdir as it was.
    dataset = error = None
    try:
        dataset = data_lib.load_dataset(c.dataset, c.data_dir, c.download)
    except ValueError as e:  # unreadable or malformed CIFAR (load_cifar's one-line message)
        error = e
    if error is not None:
        _invalid(f"dataset={c.dataset!r} (--data_dir): {error}")
    _validate_data(c, len(dataset.train_y), dataset.train_x.shape[1:], n_dev)
    num_test = len(dataset.test_y)
    if c.eval_examples is not None and c.eval_examples > num_test:
        # Clamped, the run would claim a subset it does not evaluate on.
        _invalid(
            f"eval_examples={c.eval_examples} (--eval_examples) exceeds the {num_test} test "
            f"examples of dataset={c.dataset!r}; use at most {num_test}, or unset for all"
        )
    _check_workdir(c, workdir, n_dev, overwrite, _data_record(dataset))
    spe = data_lib.steps_per_epoch(len(dataset.train_y), c.batch_size)
    num_features = int(np.prod(dataset.train_x.shape[1:]))
    if c.max_steps_per_epoch is not None:
        spe = min(spe, c.max_steps_per_epoch)
    os.makedirs(workdir, exist_ok=True)
    mesh = jax.make_mesh((n_dev,), (AXIS,), devices=jax.devices()[:n_dev])
    n_proc = c.num_processes or 1
    proc = c.process_id or 0

    model = models.make_model(c.model, dataset.num_classes, norm=c.norm, axis_name=AXIS)
    variables = model.init(jax.random.key(c.seed), dataset.train_x[:1])
    init_params = variables["params"]
    # BatchNorm's running averages (empty without norm="batch"): replicated,
    # updated by every step, used to evaluate, checkpointed.
    init_model_state = {k: v for k, v in variables.items() if k != "params"}
    stateful = bool(init_model_state)
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(init_params))
    groups = merge_plan = None
    if c.compressor in SPARSIFIERS and c.merge != "none":
        groups, merge_plan = _merge_groups(
            c, model, init_params, dataset, workdir, n_dev, init_model_state
        )
    tx, _ = build_optimizer(c, spe, spe * c.epochs, groups=groups)
    if feature:
        num_layers = _feature_layers(init_params)
        slice_tx = _feature_slice_optimizer(c, spe, spe * c.epochs)
        num_rest = num_params - int(np.size(init_params[_FIRST]["kernel"]))
        hidden = int(np.shape(init_params[_FIRST]["kernel"])[1])
        # Each device sends its (batch, hidden) float32 partial product into an all-reduce.
        activation_bytes = jaxcomp.comm.collectives.allreduce_bytes(
            4 * c.batch_size * hidden, n_dev
        )
        params = _feature_params(init_params, mesh)
        opt_state = _init_feature_opt_state(slice_tx, tx, params, mesh)
        feature_step_args = (slice_tx, tx, mesh, num_layers, num_rest, activation_bytes)
        train_step = _make_feature_train_step(*feature_step_args)
        logging.info(
            "sampling='feature': the first kernel's %d slices are updated by SGD alone (each "
            "device's own gradient, never compressed or averaged); %s compresses the other "
            "%d parameters",
            n_dev,
            c.compressor,
            num_rest,
        )
    elif coded_cfg is None:
        params = jaxcomp.distributed.replicate(init_params, mesh)
        opt_state = jaxcomp.distributed.init_opt_state(tx, params, mesh, AXIS)
        train_step = _make_train_step(model, tx, mesh, num_params, stateful=stateful)
    else:
        params = jaxcomp.distributed.replicate(init_params, mesh)
        # (CodedState, sgd state) per device: a pytree that orbax saves like any other.
        opt_state = cssgd.init_opt_state(tx, params, mesh, AXIS, seed=c.seed)
        train_step = cssgd.make_train_step(_batch_loss_fn(model), tx, mesh, coded_cfg, AXIS)

    def place(xb, yb):
        """The step's batch arguments: rows sharded, feature slices, or CSSGD's blocks."""
        if feature:
            return _feature_batch(xb, yb, mesh)
        if coded_cfg is None:
            return jaxcomp.distributed.shard_batch((xb, yb), mesh, AXIS)
        return (cssgd.shard_block_batch((xb, yb), mesh, c.redundancy, AXIS),)

    model_state = jaxcomp.distributed.replicate(init_model_state, mesh) if stateful else None
    # The step's leading state: (params, opt_state[, model_state]).
    carry = (params, opt_state, model_state) if stateful else (params, opt_state)

    metrics_path = os.path.join(workdir, "metrics.jsonl")
    start_epoch = 0
    manager = ocp = None
    if c.checkpoint:
        try:
            ocp, manager = _checkpoint_manager(workdir)
            latest = manager.latest_step()
        except Exception as e:  # noqa: BLE001 (an unreadable directory, whatever orbax says)
            raise WorkdirError(
                f"cannot read the checkpoints in {os.path.join(workdir, 'checkpoints')} "
                f"({type(e).__name__}: {e}){_OVERWRITE}"
            ) from None
        if latest is not None:
            target = {"params": params, "opt_state": opt_state, "epoch": np.zeros([], np.int32)}
            if stateful:
                target["model_state"] = model_state
            abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, _storable(target))
            try:
                restored = manager.restore(latest, args=ocp.args.StandardRestore(abstract))
                restored = _with_empty_leaves(restored, target)
            except Exception as e:  # noqa: BLE001 (any orbax failure means the same here)
                manager.close()
                cause = (str(e).strip().splitlines() or [""])[0][:300]
                raise WorkdirError(
                    f"cannot restore the epoch-{latest} checkpoint in "
                    f"{os.path.join(workdir, 'checkpoints')}: it is corrupted or its structure "
                    f"does not match this configuration's parameters and optimizer state "
                    f"({type(e).__name__}: {cause}){_OVERWRITE}"
                ) from None
            params, opt_state = restored["params"], restored["opt_state"]
            if stateful:
                model_state = restored["model_state"]
            start_epoch = int(restored["epoch"])
            carry = (params, opt_state, model_state) if stateful else (params, opt_state)
            logging.info("resumed from %s at epoch %d", workdir, start_epoch)
    records = _read_records(metrics_path, start_epoch)
    if jax.process_index() == 0:
        with open(metrics_path, "w") as f:  # drop lines of epochs the checkpoint lacks
            f.writelines(_metrics_line(r) for r in records)
    wall0 = time.perf_counter() - (records[-1]["wall_time"] if records else 0.0)
    cum_bytes = records[-1]["cumulative_bytes_per_device"] if records else 0.0
    train_time = records[-1]["train_time"] if records else 0.0
    local = c.batch_size // n_proc
    # Compile ahead of time so step times (and train_time) exclude compilation.
    t0 = time.perf_counter()
    dummy = place(dataset.train_x[:local], dataset.train_y[:local])
    train_step = train_step.lower(*carry, *dummy).compile()
    compile_time = time.perf_counter() - t0
    if c.time_split and feature:
        split_programs = (
            train_step,
            _make_feature_train_step(*feature_step_args, communicate=False),
            _make_feature_forward_backward(mesh, num_layers),
        )
    elif c.time_split and coded_cfg is None:
        split_programs = (
            train_step,
            _make_train_step(model, tx, mesh, num_params, communicate=False, stateful=stateful),
            _make_forward_backward(model, mesh, stateful=stateful),
        )
    elif c.time_split:
        split_programs = (
            train_step,
            cssgd.make_train_step(
                _batch_loss_fn(model), tx, mesh, coded_cfg, AXIS, communicate=False
            ),
            _make_coded_forward_backward(model, mesh),
        )
    show = c.progress and jax.process_index() == 0

    end_epoch = c.epochs if stop_after_epoch is None else min(c.epochs, stop_after_epoch)
    for epoch in range(start_epoch, end_epoch):
        if show:
            from tqdm import tqdm  # noqa: PLC0415 (progress bars are optional)

            bar = tqdm(total=spe, desc=f"{label} epoch {epoch + 1}/{c.epochs}", leave=False)
        sums = {"loss": 0.0, "wire_bytes": 0.0, "message_bytes": 0.0, "density": 0.0}
        if coded_cfg is not None:
            sums["received_bytes"] = 0.0
        coded = []  # Elias-coded bytes of device 0's message, every coded_bytes_every steps
        step_times = []
        batches = data_lib.epoch_batches(
            dataset.train_x,
            dataset.train_y,
            c.batch_size,
            c.seed,
            epoch,
            # Feature runs read whole batches in the global order; CSSGD cuts its
            # blocks from the global batch, whose draws need not divide by device.
            sampling="global" if feature else c.sampling,
            num_devices=1 if feature or coded_cfg is not None else n_dev,
        )
        for i, (xb, yb) in zip(range(spe), batches, strict=False):
            t0 = time.perf_counter()
            if c.augment:
                # The whole global batch, from (seed, epoch, step): the same
                # images whatever the device or process count, and on resume.
                xb = data_lib.augment(
                    xb, data_lib.augment_seed(c.seed, epoch, i), fill=dataset.pad_value
                )
            # Each process feeds its own rows of the global batch (device-major).
            xb, yb = xb[proc * local : (proc + 1) * local], yb[proc * local : (proc + 1) * local]
            batch = place(xb, yb)
            *carry, m = train_step(*carry, *batch)
            params, opt_state = carry[0], carry[1]
            # Block every step: many collective steps in flight deadlock the
            # simulated CPU devices' rendezvous (docs/distributed.md).
            m = jax.device_get(jax.block_until_ready(m))
            if coded_cfg is not None:
                # A CSSGD device's own message is its packets, each multicast once.
                m = {**m, "message_bytes": m["wire_bytes"], "density": -1.0}
            step_times.append(time.perf_counter() - t0)
            train_time += step_times[-1]
            for k in sums:
                sums[k] += float(m[k])
            if c.coded_bytes_every and (epoch * spe + i + 1) % c.coded_bytes_every == 0:
                compressed = _feature_rest(init_params) if feature else init_params
                coded.append(_coded_bytes(c, opt_state, compressed))
            if show:
                bar.update(1)
                bar.set_postfix(loss=f"{float(m['loss']):.4f}")
        if show:
            bar.close()
        split = None
        if c.time_split:
            model_state = carry[2] if stateful else None
            split = _time_split(split_programs, params, opt_state, batch, model_state=model_state)
        t_step = statistics.median(step_times)
        host_params = _feature_host_params(params, num_features) if feature else _host_tree(params)
        host_state = _host_tree(carry[2]) if stateful else None
        n_eval = c.eval_examples or len(dataset.test_y)
        acc = _evaluate(
            model,
            host_params,
            dataset.test_x[:n_eval],
            dataset.test_y[:n_eval],
            model_state=host_state,
        )
        cum_bytes += sums["wire_bytes"]
        record = {
            "epoch": epoch + 1,
            "train_loss": sums["loss"] / spe,
            "test_accuracy": acc,
            "wall_time": time.perf_counter() - wall0,
            "train_time": train_time,
            "bytes_per_step_per_device": sums["wire_bytes"] / spe,
            "message_bytes_per_step_per_device": sums["message_bytes"] / spe,
            "cumulative_bytes_per_device": cum_bytes,
            "density": sums["density"] / spe,
            "coded_bytes_per_step_per_device": statistics.mean(coded) if coded else -1.0,
            "compression_time_share": split.compression / split.step if split else -1.0,
            "step_time": t_step,
            **{f"time_{k}": getattr(split, k) if split else -1.0 for k in TIME_SPLIT_FIELDS},
        }
        if feature:
            record["activation_bytes_per_step_per_device"] = activation_bytes
        if coded_cfg is not None:
            coded_state = opt_state[0]  # checkpointed, so the totals survive a resume
            record.update(
                exchange=c.exchange,
                redundancy=c.redundancy,
                received_bytes_per_step_per_device=sums["received_bytes"] / spe,
                clipped=int(np.sum(np.asarray(coded_state.clipped))),
                nonfinite=int(np.sum(np.asarray(coded_state.nonfinite))),
            )
        records.append(record)
        logging.info("%s epoch %d: %s", label, epoch + 1, record)
        if jax.process_index() == 0:
            with open(metrics_path, "a") as f:
                f.write(_metrics_line(record))
        # Device 0's buffers and the files live on process 0.
        if epoch + 1 in c.fit_check_epochs and jax.process_index() == 0:
            from experiments import gradient_fit  # noqa: PLC0415 (matplotlib only when asked)

            t_check = time.perf_counter()
            gradient_fit.check_epoch(
                workdir,
                epoch + 1,
                config=c,
                model=model,
                params=params,
                opt_state=opt_state,
                batch=(xb, yb),
                num_devices=n_dev,
            )
            wall0 += time.perf_counter() - t_check  # not part of wall_time
        if manager is not None:
            epoch_done = np.asarray(epoch + 1, np.int32)
            state = {"params": params, "opt_state": opt_state, "epoch": epoch_done}
            if stateful:
                state["model_state"] = carry[2]
            manager.save(epoch + 1, args=ocp.args.StandardSave(_storable(state)))
            manager.wait_until_finished()

    if manager is not None:
        manager.close()
    if jax.process_index() == 0 and records:
        write_plots({label: records}, os.path.join(workdir, "accuracy.png"))
        if c.time_split:
            write_time_split_plot(
                {f"epoch {r['epoch']}": r for r in records if r["time_step"] >= 0},
                os.path.join(workdir, "time_split.png"),
                title=f"{label}: time per step",
            )
    return {
        "compile_time": compile_time,
        "records": records,
        "final": records[-1] if records else None,
        "num_params": num_params,
        "params": _feature_host_params(params, num_features) if feature else _host_tree(params),
        "model_state": _host_tree(carry[2]) if stateful else None,
        "merge_plan": merge_plan,
    }
