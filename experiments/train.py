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

Layout of the code: :mod:`experiments.config` (the configuration, its checks,
the optimizer), :mod:`experiments.steps` (one :class:`experiments.steps.Mode`
per way of training: data parallel, feature parallel, CSSGD),
:mod:`experiments.workdir` (``config.json``, checkpoints, metrics files),
:mod:`experiments.merging` (the DLGS merge plan) and :mod:`experiments.plots`;
this module is the training loop, and re-exports the names other programs
import from it.

The metrics
-----------

Each epoch of :func:`train_and_evaluate` appends to ``workdir/metrics.jsonl``
one line of strict JSON (a non-finite value, such as the loss of a diverged run, is written as
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
with a two-level ``mesh`` (``"NODESxLOCAL"``) also
``intra_node_bytes_per_step_per_device`` and
``inter_node_bytes_per_step_per_device`` (the two-level exchange's bytes
over each link class; their sum is its part of ``bytes_per_step_per_device``;
``density`` is then the fraction of the node-mean gradient sent, each
device's count over its shard times ``LOCAL``),
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

Pipeline runs (``pipeline_stages``, :func:`experiments.steps.pipeline_mode`)
record besides ``stage_bytes_per_step_per_device`` (activations and
cotangents a device sent between stages, mean over devices) and
``pipeline_bubble_fraction``; ``bytes_per_step_per_device`` stays the
gradient exchange, and ``message_bytes`` and ``density`` are a device's
stage's (its compressor sees its stage's parameters only). Their time split's
forward and backward is the pipeline without exchanges (bubble included), so
its communication is the stages' transfers and the gradient exchange.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

import jaxcomp
from experiments import data as data_lib
from experiments import models, steps
from experiments.config import (
    AXIS,
    CODED_EXCHANGES,
    CODED_FIELDS,
    COMPRESSED_OPTIMIZERS,
    COMPRESSORS,
    EXCHANGES,
    LOW_RANK,
    NORMS,
    QUANTIZERS,
    SAMPLINGS,
    SPARSIFIERS,
    STAGE_AXIS,
    TWO_LEVEL_AXES,
    ConfigError,
    TrainConfig,
    build_optimizer,
    data_axis,
    invalid,
    is_coded,
    learning_rate,
    mesh_shape,
    resolve_config,
    validate_config,
    validate_data,
)
from experiments.merging import MERGE_ALPHA, MERGE_BETA, merge_groups, merge_link_cost
from experiments.plots import (
    TIME_SPLIT_PARTS,
    accuracy_figure,
    write_plots,
    write_time_split_plot,
)
from experiments.steps import TIME_SPLIT_FIELDS, host_tree
from experiments.workdir import (
    CONFIG_FILE,
    MERGE_PLAN_FILE,
    RESUMABLE_FIELDS,
    WorkdirError,
    check_workdir,
    data_record,
    metrics_line,
    open_checkpoints,
    save_checkpoint,
    start_metrics,
)
from jaxcomp.quantization import qsgd_levels

__all__ = [
    "AXIS",
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
    "TIME_SPLIT_FIELDS",
    "TIME_SPLIT_PARTS",
    "TrainConfig",
    "WorkdirError",
    "accuracy_figure",
    "build_optimizer",
    "is_coded",
    "learning_rate",
    "merge_link_cost",
    "resolve_config",
    "train_and_evaluate",
    "validate_config",
    "write_plots",
    "write_time_split_plot",
]


def _coded_bytes(config: TrainConfig, opt_state, params) -> float:
    """Elias-coded bytes (``jaxcomp.coding.encode_qsgd``) of device 0's last message.

    Read on the host from the message the step kept (``keep_message``): this
    process's first device's shard of the per-device state.
    """
    kept = {name: optax.tree.get(opt_state, name) for name in ("message", "message_bytes")}
    kept = jax.tree.map(lambda a: np.asarray(a.addressable_data(0))[0], kept)
    kw = resolve_config(config).compressor_kwargs
    s = qsgd_levels(kw.get("levels"), kw.get("bits"))
    per_leaf = jaxcomp.coding.coded_message_bytes(
        kept, params, s=s, bucket_size=kw.get("bucket_size")
    )
    return float(sum(jax.tree.leaves(per_leaf)))


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


def _label(c: TrainConfig) -> str:
    """The run's name in logs, progress bars and plots."""
    label = f"{c.exchange} r={c.redundancy}" if is_coded(c) else c.compressor
    return label if c.sampling == "global" else f"{label} ({c.sampling} sampling)"


def _prepare(config: TrainConfig, workdir: str, overwrite: bool):
    """``(resolved config, devices, dataset)``, checked; ``config.json`` written.

    The data is read and checked before ``config.json`` is written: a run
    that cannot start leaves the workdir as it was.
    """
    validate_config(config, jax.device_count())
    c = resolve_config(config)
    n_dev = c.num_devices or jax.device_count()
    n_proc = jax.process_count()
    if n_proc > 1 and n_dev != jax.device_count():
        # A mesh over a prefix of jax.devices() would leave some processes out.
        invalid(
            f"with {n_proc} processes num_devices must be "
            f"every device ({jax.device_count()}), got {n_dev}"
        )
    if is_coded(c) and n_proc > 1:
        invalid(
            f"exchange={c.exchange!r} runs in one process only (each device's "
            f"blocks are cut from the whole global batch on the host), got {n_proc} processes"
        )
    if c.sampling == "feature" and n_proc > 1:
        invalid(f"sampling='feature' runs in one process only, got {n_proc} processes")
    dataset = error = None
    try:
        dataset = data_lib.load_dataset(c.dataset, c.data_dir, c.download)
    except ValueError as e:  # unreadable or malformed CIFAR (load_cifar's one-line message)
        error = e
    if error is not None:
        invalid(f"dataset={c.dataset!r} (--data_dir): {error}")
    validate_data(c, len(dataset.train_y), dataset.train_x.shape[1:], n_dev)
    num_test = len(dataset.test_y)
    if c.eval_examples is not None and c.eval_examples > num_test:
        # Clamped, the run would claim a subset it does not evaluate on.
        invalid(
            f"eval_examples={c.eval_examples} (--eval_examples) exceeds the {num_test} test "
            f"examples of dataset={c.dataset!r}; use at most {num_test}, or unset for all"
        )
    check_workdir(c, workdir, n_dev, overwrite, data_record(dataset))
    os.makedirs(workdir, exist_ok=True)
    return c, n_dev, dataset


def _resume(c: TrainConfig, workdir: str, carry: tuple):
    """``(carry, checkpoint manager or None, epochs done)``: the latest checkpoint's state."""
    if not c.checkpoint:
        return carry, None, 0
    target = {"params": carry[0], "opt_state": carry[1], "epoch": np.zeros([], np.int32)}
    if len(carry) > 2:
        target["model_state"] = carry[2]
    manager, restored = open_checkpoints(workdir, target)
    if restored is None:
        return carry, manager, 0
    carry = (restored["params"], restored["opt_state"])
    if "model_state" in target:
        carry = (*carry, restored["model_state"])
    return carry, manager, int(restored["epoch"])


@dataclasses.dataclass
class _Run:
    """What the loop carries from epoch to epoch (and a resumed run reads back)."""

    config: TrainConfig
    mode: steps.Mode
    dataset: data_lib.Dataset
    steps_per_epoch: int
    label: str
    records: list
    wall0: float
    cum_bytes: float
    train_time: float


def _run_epoch(run: _Run, step, carry: tuple, epoch: int, show: bool):
    """One epoch's steps: ``(carry, sums of the step metrics, step times, coded sizes, batch)``.

    ``batch``: the last step's ``(placed batch, host rows of this process)``.
    """
    c, mode, dataset, spe = run.config, run.mode, run.dataset, run.steps_per_epoch
    n_proc, proc = c.num_processes or 1, c.process_id or 0
    local = c.batch_size // n_proc
    if show:
        from tqdm import tqdm  # noqa: PLC0415 (progress bars are optional)

        bar = tqdm(total=spe, desc=f"{run.label} epoch {epoch + 1}/{c.epochs}", leave=False)
    sums = dict.fromkeys(mode.sums, 0.0)
    coded, step_times = [], []  # coded: Elias-coded bytes, every coded_bytes_every steps
    batches = data_lib.epoch_batches(
        dataset.train_x,
        dataset.train_y,
        c.batch_size,
        c.seed,
        epoch,
        sampling=mode.sampling or c.sampling,
        num_devices=mode.batch_devices,
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
        batch = mode.place(xb, yb)
        carry, m = step(carry, batch)
        # Block every step: many collective steps in flight deadlock the
        # simulated CPU devices' rendezvous (docs/distributed.md).
        m = jax.device_get(jax.block_until_ready(m))
        step_times.append(time.perf_counter() - t0)
        for k in sums:
            sums[k] += float(m[k])
        if c.coded_bytes_every and (epoch * spe + i + 1) % c.coded_bytes_every == 0:
            coded.append(_coded_bytes(c, carry[1], mode.compressed))
        if show:
            bar.update(1)
            bar.set_postfix(loss=f"{float(m['loss']):.4f}")
    if show:
        bar.close()
    return carry, sums, step_times, coded, (batch, (xb, yb))


def _epoch_record(run: _Run, model, carry, epoch, sums, step_times, coded, split) -> dict:
    """Evaluates the epoch's parameters; the epoch's ``metrics.jsonl`` record."""
    c, spe, dataset = run.config, run.steps_per_epoch, run.dataset
    run.train_time += sum(step_times)
    n_eval = c.eval_examples or len(dataset.test_y)
    acc = _evaluate(
        model,
        run.mode.host_params(carry[0]),
        dataset.test_x[:n_eval],
        dataset.test_y[:n_eval],
        model_state=host_tree(carry[2]) if len(carry) > 2 else None,
    )
    run.cum_bytes += sums["wire_bytes"]
    return {
        "epoch": epoch + 1,
        "train_loss": sums["loss"] / spe,
        "test_accuracy": acc,
        "wall_time": time.perf_counter() - run.wall0,
        "train_time": run.train_time,
        "bytes_per_step_per_device": sums["wire_bytes"] / spe,
        "message_bytes_per_step_per_device": sums["message_bytes"] / spe,
        "cumulative_bytes_per_device": run.cum_bytes,
        "density": sums["density"] / spe,
        "coded_bytes_per_step_per_device": statistics.mean(coded) if coded else -1.0,
        "compression_time_share": split.compression / split.step if split else -1.0,
        "step_time": statistics.median(step_times),
        **{f"time_{k}": getattr(split, k) if split else -1.0 for k in TIME_SPLIT_FIELDS},
        **run.mode.record(carry[1], sums, spe),
    }


def _write_plots(run: _Run, workdir: str) -> None:
    """``accuracy.png`` and (with the time split) ``time_split.png``, on process 0."""
    if jax.process_index() != 0 or not run.records:
        return
    write_plots({run.label: run.records}, os.path.join(workdir, "accuracy.png"))
    if run.config.time_split:
        write_time_split_plot(
            {f"epoch {r['epoch']}": r for r in run.records if r["time_step"] >= 0},
            os.path.join(workdir, "time_split.png"),
            title=f"{run.label}: time per step",
        )


def _mesh(c: TrainConfig, n_dev: int):
    """The run's mesh: flat over ``AXIS``, two-level ``(nodes, local)`` with ``mesh``,
    or ``(stages, replicas)`` over ``(STAGE_AXIS, AXIS)`` with ``pipeline_stages``."""
    if c.pipeline_stages is not None:
        shape = (c.pipeline_stages, n_dev // c.pipeline_stages)
        return jax.make_mesh(shape, (STAGE_AXIS, AXIS), devices=jax.devices()[:n_dev])
    shape = mesh_shape(c)
    if shape is None:
        return jax.make_mesh((n_dev,), (AXIS,), devices=jax.devices()[:n_dev])
    return jaxcomp.distributed.two_level_mesh(
        shape[1], TWO_LEVEL_AXES, devices=jax.devices()[:n_dev]
    )


def train_and_evaluate(
    config: TrainConfig,
    workdir: str,
    *,
    stop_after_epoch: int | None = None,
    overwrite: bool = False,
) -> dict:
    """Trains ``config.model`` on ``config.dataset`` with ``config.compressor``.

    The records' fields are listed in this module's docstring.

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
    c, n_dev, dataset = _prepare(config, workdir, overwrite)
    spe = data_lib.steps_per_epoch(len(dataset.train_y), c.batch_size)
    spe = min(spe, c.max_steps_per_epoch or spe)
    mesh = _mesh(c, n_dev)
    model = models.make_model(c.model, dataset.num_classes, norm=c.norm, axis_name=data_axis(c))
    variables = model.init(jax.random.key(c.seed), dataset.train_x[:1])
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(variables["params"]))
    groups = merge_plan = None
    if c.compressor in SPARSIFIERS and c.merge != "none":
        model_state = {k: v for k, v in variables.items() if k != "params"}
        groups, merge_plan = merge_groups(
            c, model, variables["params"], dataset, workdir, n_dev, model_state
        )
    tx, _ = build_optimizer(c, spe, spe * c.epochs, groups=groups)
    mode = steps.make_mode(c, model, tx, mesh, variables, spe)
    carry, manager, start_epoch = _resume(c, workdir, mode.carry)
    metrics_path = os.path.join(workdir, "metrics.jsonl")
    records = start_metrics(metrics_path, start_epoch)
    last = records[-1] if records else {}
    run = _Run(
        config=c,
        mode=mode,
        dataset=dataset,
        steps_per_epoch=spe,
        label=_label(c),
        records=records,
        wall0=time.perf_counter() - last.get("wall_time", 0.0),
        cum_bytes=last.get("cumulative_bytes_per_device", 0.0),
        train_time=last.get("train_time", 0.0),
    )
    # Compile ahead of time so step times (and train_time) exclude compilation.
    t0 = time.perf_counter()
    local = c.batch_size // (c.num_processes or 1)
    step = mode.compile(carry, mode.place(dataset.train_x[:local], dataset.train_y[:local]))
    compile_time = time.perf_counter() - t0
    show = c.progress and jax.process_index() == 0
    end_epoch = c.epochs if stop_after_epoch is None else min(c.epochs, stop_after_epoch)
    for epoch in range(start_epoch, end_epoch):
        carry, sums, step_times, coded, (batch, host_batch) = _run_epoch(
            run, step, carry, epoch, show
        )
        split = mode.time_split(carry, batch) if c.time_split else None
        record = _epoch_record(run, model, carry, epoch, sums, step_times, coded, split)
        records.append(record)
        logging.info("%s epoch %d: %s", run.label, epoch + 1, record)
        if jax.process_index() == 0:
            with open(metrics_path, "a") as f:
                f.write(metrics_line(record))
        # Device 0's buffers and the files live on process 0.
        if epoch + 1 in c.fit_check_epochs and jax.process_index() == 0:
            from experiments import gradient_fit  # noqa: PLC0415 (matplotlib only when asked)

            t_check = time.perf_counter()
            gradient_fit.check_epoch(
                workdir,
                epoch + 1,
                config=c,
                model=model,
                params=carry[0],
                opt_state=carry[1],
                batch=host_batch,
                num_devices=n_dev,
            )
            run.wall0 += time.perf_counter() - t_check  # not part of wall_time
        if manager is not None:
            state = {"params": carry[0], "opt_state": carry[1]}
            if len(carry) > 2:
                state["model_state"] = carry[2]
            save_checkpoint(manager, state, epoch + 1)
    if manager is not None:
        manager.close()
    _write_plots(run, workdir)
    return {
        "compile_time": compile_time,
        "records": records,
        "final": records[-1] if records else None,
        "num_params": num_params,
        "params": mode.host_params(carry[0]),
        "model_state": host_tree(carry[2]) if len(carry) > 2 else None,
        "merge_plan": merge_plan,
    }
