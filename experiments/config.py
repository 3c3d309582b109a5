"""The configuration of a training run: :class:`TrainConfig`, its defaults and its checks.

A run is a client of jaxcomp as a flax example is of flax: general fields
(data, model, schedule, devices, modes) plus ``compressor`` and
``compressor_kwargs``, built as ``getattr(jaxcomp, compressor)(axis_name=...,
**compressor_kwargs)`` by :func:`experiments.presets.build`. The kwargs are
checked by jaxcomp alone: :func:`validate_config` builds the optimizer
abstractly (``jax.eval_shape``), so a factory's ``ValueError`` or an unknown
keyword's ``TypeError`` is an invalid config before any work.

:func:`resolve_config` fills the experiment's per-compressor defaults,
:func:`validate_config` rejects (``ConfigError``) whatever cannot train, and
:func:`build_optimizer` turns a configuration into the optax chain of its
compressor and SGD. No JAX backend starts here.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxcomp
from experiments import data as data_lib
from experiments import models, presets
from jaxcomp import cssgd, planning
from jaxcomp import sampling as sampling_lib
from jaxcomp.comm.quantized import QUANTIZER_EXCHANGES as _QUANTIZER_EXCHANGES

__all__ = [
    "ADAPTIVE",
    "AXIS",
    "MLP_LAYERS",
    "STAGE_AXIS",
    "CODED_EXCHANGES",
    "CODED_FIELDS",
    "COMPRESSED_OPTIMIZERS",
    "COMPRESSORS",
    "ConfigError",
    "EXCHANGES",
    "FLAT_KWARGS",
    "LOW_RANK",
    "NORMS",
    "OWNED_KWARGS",
    "QUANTIZERS",
    "SAMPLINGS",
    "SPARSIFIERS",
    "TWO_LEVEL_AXES",
    "TrainConfig",
    "build_optimizer",
    "data_axis",
    "invalid",
    "is_coded",
    "kwarg_name",
    "learning_rate",
    "mesh_shape",
    "resolve_config",
    "validate_config",
    "validate_data",
    "with_weight_decay",
]

AXIS = "data"
# The mesh axis of the pipeline stages (--pipeline_stages) and the mlp's layers split over it.
STAGE_AXIS = "stage"
MLP_LAYERS = 6
# The mesh axes of a two-level run (``mesh="NODESxLOCAL"``): the slow axis first.
TWO_LEVEL_AXES = ("node", "local")
SPARSIFIERS = (
    "ldte_bs",
    "top_k",
    "dgc",
    "trimmed_top_k",
    "binary_search",
    "gaussian_k",
    "sidco",
    "random_k",
)
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
COMPRESSED_OPTIMIZERS = ("onebit_adam", "zero_one_adam", "onebit_lamb")
# Wrappers that switch an inner compressor's level (compressor_kwargs name the inner
# factory and its levels: {"compressor": "top_k", "low": 0.99, "high": 0.1}).
ADAPTIVE = ("accordion",)
COMPRESSORS = (
    "dense", *SPARSIFIERS, *QUANTIZERS, *LOW_RANK, *COMPRESSED_OPTIMIZERS, *ADAPTIVE,
)  # fmt: skip
SCHEDULES = ("constant", "cosine", "step")
NORMS = models.NORMS
MERGES = ("none", "greedy", "optimal")
DATASETS = ("digits", "synthetic", "synthetic_cifar", "cifar10", "cifar100")
# --exchange: "default" (None) is the compressor's own exchange; the others are CSSGD.
CODED_EXCHANGES = cssgd.EXCHANGES
# A sparsifier's exchange= (jaxcomp.comm.sparse_allreduce) and a quantizer's.
# Not "gossip": its updates differ per device, a decentralized run with per-device
# parameters (jaxcomp.aggregation.make_gossip_train_step), not this replicated one;
# not "scatter": FSDP's reduce-scatter (jaxcomp.distributed.sharded_optimizer).
_RUN_EXCLUDED = ("gossip", "scatter")
# The aliases too ("sparse" for "allgather"): older config.json records use them.
SPARSIFIER_EXCHANGES = tuple(
    e
    for e in (
        *jaxcomp.comm.sparse_allreduce.EXCHANGES,
        *jaxcomp.comm.sparse_allreduce.EXCHANGE_ALIASES,
    )
    if e not in _RUN_EXCLUDED
)
QUANTIZER_EXCHANGES = tuple(e for e in _QUANTIZER_EXCHANGES if e not in _RUN_EXCLUDED)
EXCHANGES = tuple(
    dict.fromkeys(("default", *CODED_EXCHANGES, *SPARSIFIER_EXCHANGES, *QUANTIZER_EXCHANGES))
)
# The compressors whose factories take servers= (with exchange="server").
_SERVED = (*SPARSIFIERS, *QUANTIZERS)
# Fields only CSSGD runs read (must stay None otherwise).
CODED_FIELDS = ("redundancy", "coded_value_range", "coded_bits")
# --sampling: the by-sample modes of jaxcomp.sampling, and "feature" (the
# model-parallel first layer over feature slices, mlp only).
SAMPLINGS = (*sampling_lib.SAMPLE_MODES, "feature")


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run depends on (one absl flag per field in main.py).

    General fields describe the experiment; the compressor is ``compressor``
    and ``compressor_kwargs``, the keyword arguments of its jaxcomp factory,
    passed as given (JSON-able: ``config.json`` records them) and checked by
    the factory itself when :func:`validate_config` builds the optimizer
    abstractly: ``TrainConfig(compressor="qsgd", compressor_kwargs={"bits":
    4, "bucket_size": 512})`` trains with ``jaxcomp.qsgd(bits=4,
    bucket_size=512, axis_name="data", ...)``. What the experiment itself
    derives from its general fields is not in the kwargs (:data:`OWNED_KWARGS`:
    the axis, ``seed``, ``momentum`` under momentum correction, the DGC
    warm-up of ``warmup_epochs``, the merge plan's ``groups``, ``exchange``,
    the Adams' learning rate and ``b1``). Fields some modes use default to
    None ("unset") and are resolved by :func:`resolve_config`.

    Attributes:
      compressor: ``"dense"`` (``jaxcomp.dense_exchange``) or a jaxcomp
        factory name (see ``COMPRESSORS``).
      compressor_kwargs: the factory's keyword arguments, e.g. ``{"ratio":
        0.01, "variant": "paper"}`` for ``ldte_bs`` (the ldte_bs paper's
        Algorithm 2), ``{"levels": 16}`` or ``{"bits": 4}`` and
        ``"bucket_size"`` for ``qsgd``, ``{"rank": 4}`` for ``powersgd``,
        ``{"freeze_step": 100}`` for ``onebit_adam`` and ``onebit_lamb``
        (``var_freeze_step`` for ``zero_one_adam``). The experiment's defaults
        (:func:`resolve_config`): sparsifiers ``ratio=1e-3``,
        ``granularity="layer"``, ``reuse_period=1`` (not ``random_k``);
        ``qsgd`` ``levels=16`` unless ``levels`` or ``bits`` is given;
        ``powersgd`` ``rank=4``; the compressed optimizers' freeze step a fifth of the run's
        steps (the 1-bit Adam paper's 15-25% warm-up). Unset keys are the
        factory's own defaults (``min_dense_size``: 0 for sparsifiers,
        10000 for ``qsgd``). PowerSGD reshapes flax kernels with
        ``reshape="last"`` (``(fan_in, out)`` matrices); 0/1 Adam syncs every
        step (``local_step_clipper=1``: the replicated parameters of these
        runs cannot take local steps). ``momentum`` is the Adams' ``b1`` and
        signum's ``beta`` (its moving average).
      warmup_epochs: epochs of DGC warm-up (``jaxcomp.DGC_WARMUP[:warmup_epochs]``;
        sparsifiers only when nonzero).
      momentum: SGD momentum.
      momentum_correction: put the momentum on the compressor (DGC momentum
        correction) and use plain SGD after it (None: on for sparsifiers, off
        for dense and quantizers; True is rejected for quantizers, and for
        dense it is the same as optimizer momentum).
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
      num_devices: mesh size (None: every device).
      mesh: ``"NODESxLOCAL"`` (e.g. ``"2x4"``): the two-level mesh
        ``(nodes, local)`` over axes ``("node", "local")``, the compressor
        given ``axis_name=("node", "local")`` (a dense reduce-scatter inside
        each node, the compressor across nodes on the owned shard, an
        all-gather back; :mod:`jaxcomp.transforms.two_level`); ``NODES *
        LOCAL`` must be the device count, and with several processes
        ``LOCAL`` each process's devices (one node per process). None (the
        default): the flat 1-D mesh over ``"data"``. Data-parallel runs
        only (not ``sampling="feature"``, CSSGD, ``merge``,
        ``fit_check_epochs`` or ``coded_bytes_every``).
      dataset: ``digits``, ``synthetic``, ``synthetic_cifar`` (32x32x3), ``cifar10``,
        ``cifar100``.
      data_dir: CIFAR directory or ``.tar.gz`` archive.
      download: download CIFAR when ``data_dir`` does not exist.
      model: ``mlp``, ``cnn``, ``alexnet``, ``resnet20``, ``vgg16``, ``vgg19``,
        ``senet18``, ``resnet50``, ``resnet101``, ``densenet121``,
        ``densenet169`` (:mod:`experiments.models`).
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
        ``"allgather"`` (alias ``"sparse"``), ``"dense"``, ``"server"``,
        ``"sparcml"``, ``"gtopk"``, ``"oktopk"``, ``"scalecom"``, ``"auto"``,
        ``"auto_topk"``) or a quantizer's (``"allgather"``, ``"server"``):
        passed to the compressor.
      servers: with ``exchange="server"``, the size of the group of
        parameter servers, in ``[1, num_devices]`` (the factories'
        ``servers``: key ranges of the packed buffer, a quantizer's coded
        leaves by leaf; docs/distributed.md). None: the compressor's default,
        one server.
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
      pipeline_stages: ``S``, pipeline (layer-wise) model parallelism
        (:mod:`jaxcomp.distributed.pipeline`): the mesh is ``(S,
        num_devices / S)`` over ``("stage", "data")``, the mlp's six layers
        (flatten, dense, relu, dense, relu, dense) split by index into ``S``
        consecutive stages, and the compressor exchanges each stage's
        gradients over ``"data"``. None: data parallelism only. ``model="mlp"``,
        global sampling, one process; not with ``mesh``, ``merge``, CSSGD,
        ``fit_check_epochs`` or ``coded_bytes_every``.
      microbatches: ``M``, the GPipe micro-batches per data replica and step
        (``pipeline_stages`` only; None: ``S``); must divide ``batch_size /
        (num_devices / S)``.
    """

    compressor: str = "ldte_bs"
    compressor_kwargs: dict = dataclasses.field(default_factory=dict)
    warmup_epochs: int = 0
    momentum: float = 0.9
    momentum_correction: bool | None = None
    merge: str | None = None
    merge_alpha: float | None = None
    merge_beta: float | None = None
    num_devices: int | None = None
    mesh: str | None = None
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
    servers: int | None = None
    redundancy: int | None = None
    coded_value_range: float | None = None
    coded_bits: int | None = None
    sampling: str = "global"
    lr_milestones: tuple[int, ...] = ()
    lr_decay: float = 0.1
    weight_decay: float = 0.0
    norm: str = "group"
    augment: bool = False
    eval_examples: int | None = None
    pipeline_stages: int | None = None
    microbatches: int | None = None


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
    if compressor in ADAPTIVE:
        return "the adaptive wrapper"
    return "the baseline"


# The flat fields TrainConfig had before compressor_kwargs: factory arguments
# only. Old config.json records and the shorthand flags (--ratio, --levels, ...)
# map them into compressor_kwargs by name (freeze_step is zero_one_adam's
# var_freeze_step).
FLAT_KWARGS = (
    "ratio",
    "granularity",
    "reuse_period",
    "low_pass",
    "min_dense_size",
    "levels",
    "bits",
    "bucket_size",
    "rank",
    "freeze_step",
)


def kwarg_name(compressor: str, flat: str) -> str:
    """The factory keyword of the flat field (or flag) ``flat`` for ``compressor``."""
    if compressor == "zero_one_adam" and flat == "freeze_step":
        return "var_freeze_step"
    return flat


def resolve_config(config: TrainConfig) -> TrainConfig:
    """``config`` checked, with the experiment's per-compressor defaults filled in.

    ``compressor_kwargs``: sparsifiers ``ratio=1e-3``, ``granularity="layer"``
    and (but ``random_k``, which has no threshold to reuse) ``reuse_period=1``;
    ``qsgd`` ``levels=16`` when neither ``levels`` nor ``bits`` is given;
    ``powersgd`` ``rank=4``; ``accordion`` ``compressor="top_k"``, ``low=0.99``,
    ``high=0.1`` (over top-k); other keys as given (unset: the factory's
    default). Sparsifiers ``momentum_correction=True`` and ``merge="none"``
    unless set, the others ``momentum_correction=False`` (dense: either value
    is the same run). ``exchange="default"`` becomes None (the same run);
    CSSGD runs get ``coded_value_range=10.0`` and ``coded_bits=32`` (the
    paper's int32 over ``[-10, 10]``).

    Raises:
      ValueError: the checks of :func:`validate_config` on the fields alone
        (not the data size or the optimizer build, which resolve through here).
    """
    _validate_fields(config)
    c = dataclasses.replace(config, compressor_kwargs=dict(config.compressor_kwargs))
    kw = c.compressor_kwargs
    if c.exchange == "default":
        c = dataclasses.replace(c, exchange=None)
    if is_coded(c):
        c = dataclasses.replace(
            c,
            coded_value_range=10.0 if c.coded_value_range is None else float(c.coded_value_range),
            coded_bits=32 if c.coded_bits is None else c.coded_bits,
        )
    if c.compressor in SPARSIFIERS:
        kw.setdefault("ratio", 1e-3)
        kw.setdefault("granularity", "layer")
        if c.compressor != "random_k":
            kw.setdefault("reuse_period", 1)
        return dataclasses.replace(
            c,
            merge=c.merge or "none",
            # Floats, whatever real type was given (config.json holds them).
            merge_alpha=None if c.merge_alpha is None else float(c.merge_alpha),
            merge_beta=None if c.merge_beta is None else float(c.merge_beta),
            momentum_correction=True if c.momentum_correction is None else c.momentum_correction,
        )
    c = dataclasses.replace(c, momentum_correction=False)
    if c.compressor == "qsgd" and kw.get("levels") is None and kw.get("bits") is None:
        kw["levels"] = 16
    if c.compressor in LOW_RANK:
        kw.setdefault("rank", 4)
    if c.compressor == "accordion":
        # The paper's top-k levels (Agarwal et al., 2021): ratio 0.99 in critical
        # regimes, 0.1 otherwise.
        kw.setdefault("compressor", "top_k")
        if kw["compressor"] == "top_k":
            kw.setdefault("low", 0.99)
            kw.setdefault("high", 0.1)
    return c


class ConfigError(ValueError):
    """The configuration cannot train; raised before anything is written to the workdir."""


def invalid(msg: str):
    """Raises ``ConfigError`` for ``msg`` (an invalid configuration)."""
    raise ConfigError(f"invalid config: {msg}")


def validate_config(config: TrainConfig, device_count: int | None = None) -> None:
    """Raises ``ValueError`` (``ConfigError``) for anything that cannot train, before any work.

    Checks every field, the batch size against the dataset's standard size
    (``experiments.data.DATASET_SPECS``; the loaded data is checked again by
    :func:`train_and_evaluate` before it writes anything), and builds the
    optimizer once, abstractly (``jax.eval_shape`` of its ``init`` on the
    model's parameter shapes), so that every keyword of ``compressor_kwargs``
    the jaxcomp factory rejects (its ``ValueError`` naming the argument, or
    Python's ``TypeError`` for an unknown keyword) is reported here as an
    invalid config; ``compressor_kwargs`` has no other check. It
    compiles nothing, reads no data and starts no JAX backend, so
    ``experiments/main.py`` runs it before setting the device count.

    Args:
      config: the run's configuration.
      device_count: devices available (checks ``num_devices``; None: skipped).
    """
    _validate_fields(config, device_count)
    num_train, shape, num_classes = data_lib.DATASET_SPECS[config.dataset]
    validate_data(config, num_train, shape, config.num_devices or device_count)
    _validate_optimizer(config, num_train, shape, num_classes)


def validate_data(c: TrainConfig, num_train: int, shape, n: int | None) -> None:
    """The checks of a run against its training set (``num_train`` images of ``shape``)."""
    if data_lib.steps_per_epoch(num_train, c.batch_size) < 1:
        invalid(
            f"batch_size={c.batch_size} (--batch_size) exceeds the {num_train} training "
            f"examples of dataset={c.dataset!r}"
        )
    num_features = int(np.prod(shape))
    if c.sampling == "feature" and n is not None and n > num_features:
        invalid(
            f"sampling='feature' gives every device at least one of the "
            f"{num_features} input features; num_devices={n} is too many"
        )


def mesh_shape(config: TrainConfig) -> tuple[int, int] | None:
    """``(nodes, local)`` of ``config.mesh`` (``"NODESxLOCAL"``), None for the flat mesh.

    Raises:
      ValueError: (``ConfigError``) a ``mesh`` not of that form.

    Example:
      >>> from experiments.config import TrainConfig, mesh_shape
      >>> mesh_shape(TrainConfig(mesh="2x4")), mesh_shape(TrainConfig())
      ((2, 4), None)
    """
    if config.mesh is None:
        return None
    parts = str(config.mesh).lower().split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        invalid(
            f"mesh (--mesh) must be NODESxLOCAL with positive ints (e.g. 2x4), got {config.mesh!r}"
        )
    return int(parts[0]), int(parts[1])


def data_axis(config: TrainConfig):
    """The axis name the batch is split over and the compressor exchanges over.

    Example:
      >>> from experiments.config import TrainConfig, data_axis
      >>> data_axis(TrainConfig()), data_axis(TrainConfig(mesh="2x4"))
      ('data', ('node', 'local'))
    """
    return AXIS if config.mesh is None else TWO_LEVEL_AXES


def _validate_mesh(c: TrainConfig, n: int | None) -> None:
    """A two-level ``mesh``: its form, its size, and the modes it works with."""
    shape = mesh_shape(c)
    if shape is None:
        return
    if n is not None and shape[0] * shape[1] != n:
        invalid(f"mesh={c.mesh!r} (--mesh) has {shape[0] * shape[1]} devices, the run {n}")
    others = {
        "sampling='feature'": c.sampling == "feature",
        f"exchange={c.exchange!r} (CSSGD)": is_coded(c),
        "merge (profiled on the flat mesh)": c.merge not in (None, "none"),
        "fit_check_epochs (reads whole residuals)": bool(c.fit_check_epochs),
        "coded_bytes_every (reads whole messages)": c.coded_bytes_every is not None,
        "onebit_lamb (trust ratios of whole leaves)": c.compressor == "onebit_lamb",
    }
    bad = [name for name, on in others.items() if on]
    if bad:
        invalid(f"mesh={c.mesh!r} (--mesh, the two-level exchange) does not work with {bad[0]}")


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
        invalid(
            f"model={c.model!r} (--model) cannot take dataset={c.dataset!r} images of shape "
            f"{tuple(shape)} ({type(error).__name__}: {error})"
        )
    spe = data_lib.steps_per_epoch(num_train, c.batch_size)
    spe = min(spe, c.max_steps_per_epoch or spe)

    def init():
        # Built inside the trace too: factories make small constants (jnp
        # scalars), which outside a trace would start a JAX backend.
        tx, _ = build_optimizer(c, spe, spe * c.epochs)
        shape = mesh_shape(c)
        if shape is None:
            return tx.init(params)
        # The two-level state is per device: init reads the local axis (an abstract mesh).
        mesh = jax.sharding.AbstractMesh(shape, TWO_LEVEL_AXES)
        spec = jax.sharding.PartitionSpec(TWO_LEVEL_AXES)
        per_device = lambda p: jax.tree.map(lambda x: jnp.asarray(x)[None], tx.init(p))  # noqa: E731
        mapped = jax.shard_map(
            per_device,
            mesh=mesh,
            in_specs=jax.sharding.PartitionSpec(),
            out_specs=spec,
            check_vma=False,
        )
        return mapped(params)

    try:
        jax.eval_shape(init)
    except (ValueError, TypeError) as e:  # jaxcomp's checks; an unknown keyword's TypeError
        error = e
    if error is not None:
        invalid(f"{c.compressor} (--compressor_kwargs): {error}")


def _validate_fields(config: TrainConfig, device_count: int | None = None) -> None:
    """The checks of :func:`validate_config` that need neither the data nor the optimizer."""
    c = config
    if c.compressor not in COMPRESSORS:
        invalid(f"unknown compressor {c.compressor!r}; expected one of {', '.join(COMPRESSORS)}")
    sparse = c.compressor in SPARSIFIERS
    kind = _kind(c.compressor)
    _validate_kwargs(c)
    _validate_exchange(c)
    if not 0 <= c.warmup_epochs <= len(jaxcomp.DGC_WARMUP):
        invalid(f"warmup_epochs must be in [0, {len(jaxcomp.DGC_WARMUP)}], got {c.warmup_epochs}")
    if c.warmup_epochs and not sparse:
        invalid(
            f"warmup_epochs (--warmup_epochs) needs a sparsifier ({', '.join(SPARSIFIERS)}), "
            f"not {kind} {c.compressor!r}; leave it 0"
        )
    if not 0.0 <= c.momentum < 1.0:
        invalid(f"momentum must be in [0, 1), got {c.momentum}")
    if c.momentum_correction and c.compressor not in (*SPARSIFIERS, "dense"):
        invalid(
            f"momentum_correction (--momentum_correction) needs a sparsifier, not {kind} "
            f"{c.compressor!r} (leave it unset or false: it runs with momentum on the "
            "optimizer, or its own)"
        )
    _validate_merge(c)
    if c.coded_bytes_every is not None and c.compressor != "qsgd":
        invalid(
            f"coded_bytes_every (--coded_bytes_every) measures qsgd's messages, not those of "
            f"{kind} {c.compressor!r}; leave it unset"
        )
    if c.compressor in COMPRESSED_OPTIMIZERS and (c.exchange not in (None, "default")):
        invalid(f"{c.compressor} has its own exchange; leave exchange unset")
    if c.dataset not in DATASETS:
        invalid(f"unknown dataset {c.dataset!r}; expected one of {', '.join(DATASETS)}")
    if not c.dataset.startswith("cifar") and (c.data_dir is not None or c.download):
        # Forgetting --dataset=cifar10 would train on digits without a word.
        invalid(f"data_dir and download (--data_dir, --download) read CIFAR; dataset={c.dataset!r}")
    if c.model not in models.MODELS:
        invalid(f"unknown model {c.model!r}; expected one of {', '.join(models.MODELS)}")
    if c.schedule not in SCHEDULES:
        invalid(f"schedule must be one of {SCHEDULES}, got {c.schedule!r}")
    if c.epochs < 1 or c.batch_size < 1 or not 0 < c.lr < math.inf:
        invalid(
            f"need epochs >= 1, batch_size >= 1, a finite lr > 0; "
            f"got {c.epochs}, {c.batch_size}, {c.lr}"
        )
    integer = isinstance(c.seed, (int, np.integer)) and not isinstance(c.seed, bool)
    if not (integer and 0 <= c.seed < 2**32):  # jax.random.key keeps 32 bits: 2**32 + 1 is 1
        invalid(f"seed must be an int in [0, 2**32), got {c.seed!r}")
    _validate_recipe(c)
    if c.eval_examples is not None and c.eval_examples < 1:
        invalid(f"eval_examples must be >= 1 (or unset: every test example), got {c.eval_examples}")
    if c.max_steps_per_epoch is not None and c.max_steps_per_epoch < 1:
        invalid(f"max_steps_per_epoch must be >= 1, got {c.max_steps_per_epoch}")
    bad = [e for e in c.fit_check_epochs if not 1 <= e <= c.epochs]
    if bad:
        invalid(f"fit_check_epochs must be in [1, epochs={c.epochs}], got {bad}")
    if c.coded_bytes_every is not None and c.coded_bytes_every < 1:
        invalid(f"coded_bytes_every must be >= 1 (or unset: off), got {c.coded_bytes_every}")
    if c.num_devices is not None:
        if c.num_devices < 1:
            invalid(f"num_devices must be >= 1, got {c.num_devices}")
        if device_count is not None and c.num_devices > device_count:
            invalid(
                f"num_devices={c.num_devices} but only {device_count} devices exist "
                "(on CPU set --num_devices in main.py, or jax_num_cpu_devices / XLA_FLAGS "
                "before JAX initialises)"
            )
    _validate_sampling(c)
    n = c.num_devices or device_count
    _validate_mesh(c, n)
    _validate_pipeline(c, n)
    servers = c.servers
    # The servers are replicas on the "data" axis: a pipeline's stages take their share of n.
    replicas = n // c.pipeline_stages if n and c.pipeline_stages else n
    if servers is not None:
        try:  # the library's one check of servers, bounded by the data replicas
            jaxcomp.comm.check_servers(servers, replicas or None)
        except ValueError:
            invalid(
                f"servers (--servers) must be an integer in [1, {replicas or 2**31 - 1}] "
                f"(the data replicas), got {servers!r}"
            )
    if n is not None and c.compressor in SPARSIFIERS and c.exchange is not None:
        # The exchange's own trace-time check, before anything is written.
        try:
            jaxcomp.comm.sparse_allreduce.check_device_count(c.exchange, n)
        except ValueError as e:
            invalid(f"{e} (--exchange, --num_devices)")
    if is_coded(c):
        _validate_coded_devices(c, n)
    elif c.sampling == "feature":
        pass  # every device sees the whole batch; features vs devices is checked on the data
    elif c.pipeline_stages is not None:
        pass  # the batch is split over the data replicas only (_validate_pipeline)
    elif n is not None and c.batch_size % n:
        invalid(f"batch_size={c.batch_size} is not divisible by num_devices={n}")
    mp = (c.coordinator_address, c.num_processes, c.process_id)
    if any(v is not None for v in mp):
        if any(v is None for v in mp):
            invalid("coordinator_address, num_processes and process_id go together")
        if c.num_processes < 1 or not 0 <= c.process_id < c.num_processes:
            invalid(f"need 0 <= process_id < num_processes, got {c.process_id}, {c.num_processes}")
        if c.batch_size % c.num_processes:
            invalid(f"batch_size={c.batch_size} not divisible by num_processes={c.num_processes}")


def _validate_pipeline(c: TrainConfig, n: int | None) -> None:
    """``pipeline_stages`` and ``microbatches``: their ranges and the modes they work with."""
    if c.pipeline_stages is None:
        if c.microbatches is not None:
            invalid("microbatches (--microbatches) needs --pipeline_stages")
        return
    if (
        isinstance(c.pipeline_stages, bool)
        or not isinstance(c.pipeline_stages, (int, np.integer))
        or not 1 <= c.pipeline_stages <= MLP_LAYERS
    ):
        invalid(
            f"pipeline_stages must be an int in [1, {MLP_LAYERS}] (the mlp's layers), "
            f"got {c.pipeline_stages!r}"
        )
    if c.microbatches is not None and (
        isinstance(c.microbatches, bool)
        or not isinstance(c.microbatches, (int, np.integer))
        or c.microbatches < 1
    ):
        invalid(
            f"microbatches must be an int >= 1 (or unset: pipeline_stages), got {c.microbatches!r}"
        )
    others = {
        "a model other than mlp": c.model != "mlp",
        f"sampling={c.sampling!r}": c.sampling != "global",
        "mesh (--mesh)": c.mesh is not None,
        f"exchange={c.exchange!r} (CSSGD)": is_coded(c),
        "merge": c.merge not in (None, "none"),
        "fit_check_epochs": bool(c.fit_check_epochs),
        "coded_bytes_every": c.coded_bytes_every is not None,
        "several processes": c.num_processes not in (None, 1),
    }
    bad = [name for name, on in others.items() if on]
    if bad:
        invalid(f"pipeline_stages (--pipeline_stages) does not work with {bad[0]}")
    if n is None:
        return
    s = c.pipeline_stages
    if n % s:
        invalid(f"pipeline_stages={s} must divide num_devices={n}")
    per_replica, m = c.batch_size // (n // s), c.microbatches or s
    if c.batch_size % (n // s) or per_replica % m:
        invalid(
            f"microbatches={m} (--microbatches) must divide each data replica's batch "
            f"(batch_size={c.batch_size} / {n // s} replicas)"
        )


def _validate_kwargs(c: TrainConfig) -> None:
    """``compressor_kwargs`` is a JSON object; its values are the factory's to check."""
    kw = c.compressor_kwargs
    if not isinstance(kw, dict) or not all(isinstance(k, str) for k in kw):
        invalid(f"compressor_kwargs must be a dict of keyword arguments, got {kw!r}")
    try:
        json.dumps(kw)
    except (TypeError, ValueError) as e:
        invalid(f"compressor_kwargs must be JSON-able (config.json records them): {e}")
    owned = sorted(set(kw) & set(OWNED_KWARGS))
    if owned:
        invalid(
            f"compressor_kwargs sets {', '.join(owned)}, which the experiment gives "
            f"{c.compressor!r} itself: "
            + "; ".join(f"{name} from {OWNED_KWARGS[name]}" for name in owned)
        )


def _validate_merge(c: TrainConfig) -> None:
    """The checks of the DLGS merge planning (the experiment's, not the factory's)."""
    if c.merge is not None and c.merge not in MERGES:
        invalid(f"merge must be one of {MERGES}, got {c.merge!r}")
    for name in ("merge", "merge_alpha", "merge_beta"):
        if getattr(c, name) is not None and c.compressor not in SPARSIFIERS:
            invalid(
                f"{name} (--{name}) is not used by {_kind(c.compressor)} {c.compressor!r} "
                "(it applies to the sparsifiers); leave it unset"
            )
    if c.merge not in (None, "none") and c.compressor_kwargs.get("granularity") == "global":
        invalid(
            f"merge={c.merge!r} plans groups of layers; granularity='global' is one group already"
        )
    for name in ("merge_alpha", "merge_beta"):
        value = getattr(c, name)
        if value is None:
            continue
        if c.merge in (None, "none"):
            invalid(
                f"{name} (--{name}) sets the merge planner's link; "
                "it needs merge='greedy' or 'optimal'"
            )
        try:  # the planner's own check of a link time
            planning.linear_cost(**{"alpha": 0.0, "beta": 0.0, name.removeprefix("merge_"): value})
        except ValueError as err:
            invalid(f"{name} (--{name}), in seconds: {err}")


def _validate_recipe(c: TrainConfig) -> None:
    """The checks of the step schedule, weight decay, norm and augmentation."""
    milestones = tuple(c.lr_milestones)
    if milestones and c.schedule != "step":
        invalid(
            f"lr_milestones (--lr_milestones) needs schedule='step', got schedule={c.schedule!r}"
        )
    if any(isinstance(m, bool) or int(m) != m for m in milestones):
        invalid(f"lr_milestones must be integer epochs, got {milestones}")
    if milestones and (
        any(b <= a for a, b in zip(milestones, milestones[1:], strict=False))
        or not 1 <= milestones[0]
        or milestones[-1] >= c.epochs
    ):
        invalid(
            f"lr_milestones must be strictly increasing epochs in [1, epochs={c.epochs}), got "
            f"{milestones}"
        )
    if not (np.isfinite(c.lr_decay) and 0.0 < c.lr_decay <= 1.0):
        invalid(f"lr_decay must be in (0, 1], got {c.lr_decay}")
    if c.lr_decay != 0.1 and c.schedule != "step":
        invalid(f"lr_decay (--lr_decay) needs schedule='step', got schedule={c.schedule!r}")
    if not (np.isfinite(c.weight_decay) and c.weight_decay >= 0.0):
        invalid(f"weight_decay must be >= 0, got {c.weight_decay}")
    if c.norm not in NORMS:
        invalid(f"norm (--norm) must be one of {', '.join(NORMS)}, got {c.norm!r}")
    if c.norm == "batch":
        if c.model not in models.NORMALIZED:
            invalid(
                f"norm='batch' needs a model with normalisation layers "
                f"({', '.join(models.NORMALIZED)}), got {c.model!r}"
            )
        if is_coded(c):
            invalid(
                f"norm='batch' is not supported with exchange={c.exchange!r}: CSSGD's step "
                "differentiates a loss without model state; use --norm=group"
            )
        if c.fit_check_epochs:
            invalid(
                "fit_check_epochs (--fit_check_epochs) is not supported with norm='batch' (it "
                "recomputes a device's gradient without the batch statistics); leave it empty"
            )


def _validate_sampling(c: TrainConfig) -> None:
    """The checks of ``sampling`` that need neither the devices nor the data."""
    if c.sampling not in SAMPLINGS:
        invalid(f"sampling (--sampling) must be one of {', '.join(SAMPLINGS)}, got {c.sampling!r}")
    if is_coded(c) and c.sampling in ("local", "feature"):
        invalid(
            f"sampling={c.sampling!r} (--sampling) does not go with exchange={c.exchange!r}: "
            "CSSGD puts every block of the global batch on several devices, so a device would "
            "compute on examples (or features) it does not hold; use --sampling=global or "
            "--sampling=replacement"
        )
    if c.sampling != "feature":
        return
    why = "(--sampling=feature slices the input features of the mlp's first dense layer)"
    if c.model != "mlp":
        invalid(f"sampling='feature' needs model='mlp', got {c.model!r} {why}")
    if c.merge not in (None, "none"):
        invalid(
            f"merge={c.merge!r} (--merge) is not supported with sampling='feature': it plans "
            "groups over all the model's layers, and the first kernel's slices are not "
            "compressed there; leave it unset"
        )
    if c.fit_check_epochs:
        invalid(
            "fit_check_epochs (--fit_check_epochs) is not supported with sampling='feature' (it "
            "measures a device's gradient of a data-parallel batch); leave it empty"
        )
    if c.num_processes is not None or c.coordinator_address is not None:
        invalid(
            "sampling='feature' runs in one process only (the kernel slices are placed and "
            "gathered on the host as whole arrays); leave coordinator_address, num_processes "
            "and process_id unset"
        )


def _validate_exchange(c: TrainConfig) -> None:
    """The checks of ``exchange`` and the CSSGD fields that need no device count."""
    if c.exchange is not None and c.exchange not in EXCHANGES:
        invalid(f"exchange (--exchange) must be one of {', '.join(EXCHANGES)}, got {c.exchange!r}")
    if c.exchange not in (None, "default") and not is_coded(c):
        allowed = (
            SPARSIFIER_EXCHANGES
            if c.compressor in SPARSIFIERS
            else QUANTIZER_EXCHANGES
            if c.compressor in QUANTIZERS
            else ()
        )
        if c.exchange not in allowed:
            invalid(
                f"exchange={c.exchange!r} (--exchange) is not an exchange of "
                f"{_kind(c.compressor)} {c.compressor!r}: it takes "
                f"{', '.join(('default', *CODED_EXCHANGES) if not allowed else allowed)}"
            )
    if c.servers is not None and (c.exchange != "server" or c.compressor not in _SERVED):
        invalid(
            f"servers (--servers) is the size of a group of parameter servers: it needs "
            f"--exchange=server and a sparsifier or quantizer, got exchange={c.exchange!r}, "
            f"compressor={c.compressor!r}"
        )
    if not is_coded(c):
        # Like the per-compressor flags: a CSSGD flag is never silently ignored.
        for name in CODED_FIELDS:
            if getattr(c, name) is not None:
                invalid(
                    f"{name} (--{name}) is only used by CSSGD runs (--exchange=coded or "
                    "--exchange=uncoded), not with the compressor's own exchange; leave it "
                    "unset or set --exchange"
                )
        return
    if c.compressor != "dense":
        invalid(
            f"exchange={c.exchange!r} (--exchange) needs compressor='dense', got "
            f"{_kind(c.compressor)} {c.compressor!r}: CSSGD's coded packets are wrap-around sums "
            "of dense integer gradient segments, which only invert when every device quantizes "
            "the same dense layout; a sparsifier's per-device supports or a quantizer's "
            "per-bucket scales cannot be summed inside a packet, so a sparsified or quantized "
            "message cannot be coded (use --coded_bits=8 or 16 to quantize the coded exchange "
            "itself)"
        )
    if c.redundancy is None:
        invalid(
            f"exchange={c.exchange!r} needs redundancy (--redundancy), the devices holding "
            "each block of the batch, in [1, num_devices]"
        )
    if isinstance(c.redundancy, bool) or not isinstance(c.redundancy, (int, np.integer)):
        invalid(f"redundancy (--redundancy) must be an integer >= 1, got {c.redundancy!r}")
    if c.redundancy < 1:
        invalid(f"redundancy (--redundancy) must be an integer >= 1, got {c.redundancy!r}")
    if c.coded_value_range is not None and not (
        np.isfinite(c.coded_value_range) and c.coded_value_range > 0
    ):
        invalid(f"coded_value_range (--coded_value_range) must be > 0, got {c.coded_value_range}")
    if c.coded_bits is not None and c.coded_bits not in cssgd.BITS:
        invalid(
            f"coded_bits (--coded_bits) must be one of {', '.join(map(str, cssgd.BITS))}, "
            f"got {c.coded_bits}"
        )
    if c.num_processes is not None or c.coordinator_address is not None:
        invalid(
            f"exchange={c.exchange!r} runs in one process only (every device's blocks are cut "
            "from the whole global batch on the host); leave coordinator_address, "
            "num_processes and process_id unset"
        )
    if c.fit_check_epochs:
        invalid(
            f"fit_check_epochs (--fit_check_epochs) is not supported with "
            f"exchange={c.exchange!r} (it measures a device's share of a plain data-parallel "
            "batch; CSSGD's devices hold several overlapping blocks); leave it empty"
        )


def _validate_coded_devices(c: TrainConfig, n: int | None) -> None:
    """CSSGD's checks that need the device count ``n`` (skipped when unknown)."""
    if n is None:
        return
    if c.redundancy > n:
        invalid(
            f"redundancy (--redundancy) must be in [1, num_devices={n}] (a block cannot live "
            f"on more devices than there are), got {c.redundancy}"
        )
    blocks = math.comb(n, c.redundancy)
    if c.batch_size % blocks:
        invalid(
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
    return with_weight_decay(tx, config), compressor


def with_weight_decay(tx, config: TrainConfig):
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
    kwargs = dict(c.compressor_kwargs)
    if c.compressor in COMPRESSED_OPTIMIZERS:
        # Unset: a fifth of the run's steps (the 1-bit Adam paper's 15-25% warm-up).
        kwargs.setdefault(kwarg_name(c.compressor, "freeze_step"), max(1, total_steps // 5))
    if c.compressor == "accordion":
        # Unset: Accordion decides once per epoch (the paper's interval).
        kwargs.setdefault("interval", steps_per_epoch)
    preset = {
        "compressor": "dense_exchange" if c.compressor == "dense" else c.compressor,
        "kwargs": kwargs,
    }
    compressor = presets.build(
        preset, data_axis(c), **_owned(c, lr, on_compressor, steps_per_epoch, groups)
    )
    if c.compressor in COMPRESSED_OPTIMIZERS:
        return compressor, compressor
    if c.compressor == "signum":
        # Signum's momentum is its own (the sign of the momentum is sent): plain SGD after.
        return optax.chain(compressor, optax.sgd(lr)), compressor
    # Momentum correction: the compressor accumulates velocity, so the
    # optimizer after it must be plain SGD or momentum would apply twice.
    sgd = optax.sgd(lr) if on_compressor or c.momentum == 0 else optax.sgd(lr, momentum=c.momentum)
    return optax.chain(compressor, sgd), compressor


# The factory arguments the experiment sets from its general fields (or
# fixes), per kind of compressor; compressor_kwargs may not set them.
OWNED_KWARGS = {
    "axis_name": "--mesh ('data', or ('node', 'local') for a two-level mesh)",
    "seed": "--seed",
    "momentum": "--momentum and --momentum_correction",
    "beta": "--momentum (signum's moving average)",
    "warmup_ratios": "--warmup_epochs",
    "steps_per_epoch": "--warmup_epochs and the data",
    "groups": "--merge",
    "exchange": "--exchange",
    "servers": "--servers",
    "keep_message": "--coded_bytes_every",
    "reshape": "the flax kernels' layout ('last')",
    "learning_rate": "--lr and --schedule",
    "b1": "--momentum",
    "local_step_clipper": "the replicated parameters (1: sync every step)",
}


def _owned(c: TrainConfig, lr, on_compressor: bool, steps_per_epoch: int, groups) -> dict:
    """The keyword arguments of :data:`OWNED_KWARGS` that ``c.compressor``'s factory takes."""
    exchange = {} if c.exchange is None else {"exchange": c.exchange}
    if c.servers is not None:
        exchange["servers"] = c.servers
    if c.compressor in SPARSIFIERS:
        warmup = tuple(jaxcomp.DGC_WARMUP[: c.warmup_epochs]) or None
        return dict(
            momentum=c.momentum if on_compressor else 0.0,
            warmup_ratios=warmup,
            steps_per_epoch=steps_per_epoch if warmup else None,
            groups=groups,
            **exchange,
            seed=c.seed,
        )
    if c.compressor == "qsgd":
        # Kept in the state only when measured: a copy of the message.
        return dict(seed=c.seed, keep_message=c.coded_bytes_every is not None, **exchange)
    if c.compressor == "signum":
        return dict(beta=c.momentum, **exchange)
    if c.compressor in LOW_RANK:
        # Flax kernels are (..., fan_in, out): matrices of their last dimension.
        return dict(reshape="last", seed=c.seed)
    if c.compressor in ("onebit_adam", "onebit_lamb"):
        return dict(learning_rate=lr, b1=c.momentum)
    if c.compressor == "zero_one_adam":
        return dict(learning_rate=lr, b1=c.momentum, local_step_clipper=1)
    if c.compressor == "accordion":
        inner = c.compressor_kwargs.get("compressor")
        layout = {"reshape": "last"} if inner in LOW_RANK else {}
        return dict(seed=c.seed, **layout, **exchange)
    return exchange
