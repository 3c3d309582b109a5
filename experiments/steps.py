"""The step programs of a training run, one :class:`Mode` per way of training.

:func:`make_mode` chooses once, from the configuration, between

- data parallelism (:func:`data_parallel_mode`): parameters replicated, the
  batch sharded over the mesh axis, the step of
  :func:`jaxcomp.distributed.make_train_step` (the compressor exchanges);
- feature parallelism (:func:`feature_mode`, ``sampling="feature"``): the
  mlp's first kernel split by input features over the devices, the rest
  replicated; its own step, since ``make_train_step`` takes replicated (or
  FSDP) parameters whose every update is averaged over the axis;
- CSSGD (:func:`coded_mode`, ``exchange`` coded or uncoded): the step of
  :func:`jaxcomp.cssgd.make_train_step`;
- pipeline parallelism (:func:`pipeline_mode`, ``pipeline_stages``): the
  mlp's layers split into stages over the ``"stage"`` mesh axis, the step of
  :func:`jaxcomp.distributed.make_pipeline_train_step`.

A :class:`Mode` places the initial state, compiles the step, times its parts
(:func:`jaxcomp.distributed.split_step_time` of the step, the step without
communication and the forward and backward alone) and reads the trained
parameters back; the training loop (:mod:`experiments.train`) is the same
for all of them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging
from jax import lax
from jax.sharding import PartitionSpec as P

import jaxcomp
from experiments import timing
from experiments.config import (
    AXIS,
    STAGE_AXIS,
    TrainConfig,
    data_axis,
    learning_rate,
    resolve_config,
    with_weight_decay,
)
from jaxcomp import cssgd
from jaxcomp import sampling as sampling_lib
from jaxcomp.distributed.skeleton import device_slice, device_stack, shard_step

__all__ = [
    "FEATURE_PARAM_SPECS",
    "Mode",
    "TIME_SPLIT_FIELDS",
    "classifier_loss",
    "coded_mode",
    "data_parallel_mode",
    "feature_batch",
    "feature_host_params",
    "feature_layers",
    "feature_mode",
    "feature_params",
    "feature_rest",
    "feature_slice_optimizer",
    "feature_value_and_grad",
    "get_field",
    "host_tree",
    "init_feature_opt_state",
    "make_feature_train_step",
    "make_mode",
    "mlp_layers",
    "pipeline_mode",
    "step_stats",
]

# metrics.jsonl holds time_<field> for each field of the step's time split.
TIME_SPLIT_FIELDS = jaxcomp.distributed.TimeSplit._fields
# The per-step metrics every mode returns, summed over an epoch by the loop.
STEP_SUMS = ("loss", "wire_bytes", "message_bytes", "density")


def _no_record(opt_state, sums, steps) -> dict:
    """:attr:`Mode.record`'s default: a mode with no fields of its own in an epoch's record.

    Args:
      opt_state: the run's optimizer state at the epoch's end (unused).
      sums: the step metrics summed over the epoch (unused).
      steps: the epoch's steps (unused).

    Returns:
      ``{}``: the record holds only the loop's common fields.
    """
    return {}


@dataclasses.dataclass
class Mode:
    """One way of training, chosen once per run: its state, step, timing and read-back.

    Attributes:
      carry: the step's leading state, ``(params, opt_state)`` or, with
        BatchNorm, ``(params, opt_state, model_state)``, placed on the mesh.
      place: ``place(xb, yb)``: a host batch as the step's batch argument.
      compile: ``compile(carry, batch)``: the compiled step
        ``run(carry, batch) -> (carry, metrics)`` (state donated); metrics
        hold ``STEP_SUMS`` (and ``sums``' extra names).
      time_split: ``time_split(carry, batch)``: the compiled step's
        :class:`jaxcomp.distributed.TimeSplit`, medians over fresh copies.
      host_params: the model's parameters as host numpy arrays, from the
        step's ``params``.
      compressed: the (host) parameters the compressor sees, for the coded
        size of its messages.
      batch_devices: the devices ``epoch_batches`` draws shares for.
      sampling: the data order's sampling mode (``epoch_batches``; None: the run's).
      sums: the step metrics summed over an epoch.
      record: ``record(opt_state, sums, steps)``: the mode's own fields of
        an epoch's record.
    """

    carry: tuple
    place: Callable
    compile: Callable
    time_split: Callable
    host_params: Callable
    compressed: Any
    batch_devices: int
    sampling: str | None = None
    sums: tuple = STEP_SUMS
    record: Callable = _no_record


def get_field(state, name):
    """``optax.tree.get(state, name)``, None when absent (or ambiguous)."""
    try:
        return optax.tree.get(state, name)
    except (KeyError, ValueError):
        return None


def step_stats(state, num_params: int):
    """Per-device observability counters of this step (float32 scalars)."""
    wire = get_field(state, "wire_bytes")
    msg = get_field(state, "message_bytes")
    sent = get_field(state, "sent_count")

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


def host_tree(tree):
    """A replicated global tree as host numpy arrays (works across processes)."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), tree)


def _median_split(programs, repeats: int = 5):
    """:class:`jaxcomp.distributed.TimeSplit` of ``(fn, args)`` for the step, local, f+b."""
    step, local, forward_backward = (
        timing.median_seconds_fresh(fn, args, repeats) for fn, args in programs
    )
    return jaxcomp.distributed.split_step_time(
        forward_backward=forward_backward, without_communication=local, step=step
    )


def _lazy(build):
    """``build()`` once, on first use (programs only the time split needs)."""
    return functools.cache(build)


def classifier_loss(model):
    """``loss(params, (x, y))``: softmax cross-entropy of a model without mutable state."""

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return loss_fn


def _stateful_loss_fn(model):
    """``loss(params, (x, y), model_state=) -> (loss, new_model_state)`` in training mode.

    BatchNorm (``norm="batch"``, built with ``axis_name=AXIS``) normalises
    with the batch statistics averaged over the devices and returns the
    updated running averages, the same on every device.
    """

    def loss_fn(params, batch, model_state):
        logits, new_state = model.apply(
            {"params": params, **model_state}, batch[0], train=True, mutable=list(model_state)
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()
        return loss, new_state

    return loss_fn


# The step's bytes per link class with a two-level mesh (make_train_step's metrics).
LINK_SUMS = ("intra_node_bytes", "inter_node_bytes")


def data_parallel_mode(
    model, tx, mesh, init_params, init_model_state, num_params: int, axis_name=AXIS
) -> Mode:
    """Replicated parameters, sharded batch: :func:`jaxcomp.distributed.make_train_step`.

    ``message_bytes`` and ``density`` are read from the per-device optimizer
    state the step returns (means over the devices); ``wire_bytes`` is the
    step's own metric. With a two-level ``axis_name`` (``("node", "local")``)
    each device compresses its shard of the node's mean gradient: its count
    is scaled by the local axis size to give the density of that gradient,
    and the step's ``intra_node_bytes`` and ``inter_node_bytes`` are summed
    too (``*_per_step_per_device`` in the record).
    """
    stateful = bool(init_model_state)
    two_level = isinstance(axis_name, tuple)
    shard_scale = mesh.shape[axis_name[1]] if two_level else 1
    loss_fn = _stateful_loss_fn(model) if stateful else classifier_loss(model)
    make_step = functools.partial(
        jaxcomp.distributed.make_train_step, loss_fn, tx, mesh, axis_name, mutable=stateful
    )
    stats = jax.jit(
        lambda s: jax.tree.map(
            lambda a: jnp.mean(a, 0), jax.vmap(lambda d: step_stats(d, num_params))(s)
        )
    )
    params = jaxcomp.distributed.replicate(init_params, mesh)
    carry = (params, jaxcomp.distributed.init_opt_state(tx, params, mesh, axis_name))
    if stateful:
        carry = (*carry, jaxcomp.distributed.replicate(init_model_state, mesh))

    compiled = {}

    def compile(carry, batch):
        lowered = make_step().lower(*carry[:2], batch, model_state=_model_state(carry))
        step = compiled["step"] = lowered.compile()

        def run(carry, batch):
            params, opt_state, model_state, m, _ = step(
                *carry[:2], batch, _model_state(carry), None, {}
            )
            s = stats(opt_state)
            metrics = {
                "loss": m["loss"],
                "wire_bytes": m.get("wire_bytes", jnp.float32(0)),
                "message_bytes": s["message_bytes"],
                # Quantizers' -1 (no density) stays -1.
                "density": jnp.where(s["density"] >= 0, s["density"] * shard_scale, s["density"]),
                **{k: m.get(k, jnp.float32(0)) for k in (LINK_SUMS if two_level else ())},
            }
            return (params, opt_state, *((model_state,) if stateful else ())), metrics

        return run

    def compiled_step(params, opt_state, batch, update_args=None, *, model_state=None, rng=None):
        return compiled["step"](params, opt_state, batch, model_state, rng, update_args or {})

    # The split's other two programs, compiled on the first epoch that reports it.
    timer = _lazy(
        lambda: jaxcomp.distributed.make_time_split(
            loss_fn, tx, mesh, axis_name, mutable=stateful, train_step=compiled_step
        )
    )

    def time_split(carry, batch):
        return timer()(*carry[:2], batch, model_state=_model_state(carry))

    return Mode(
        carry=carry,
        place=lambda xb, yb: jaxcomp.distributed.shard_batch((xb, yb), mesh, axis_name),
        compile=compile,
        time_split=time_split,
        host_params=host_tree,
        compressed=init_params,
        batch_devices=mesh.devices.size,
        sums=(*STEP_SUMS, *LINK_SUMS) if two_level else STEP_SUMS,
        record=_link_record if two_level else Mode.record,
    )


def _link_record(opt_state, sums, steps) -> dict:
    """A two-level run's bytes per link class, per step and device."""
    return {f"{k}_per_step_per_device": sums[k] / steps for k in LINK_SUMS}


def _model_state(carry):
    return carry[2] if len(carry) > 2 else None


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


def feature_rest(params):
    """The mlp's parameters without the first kernel (the replicated part)."""
    rest = dict(params)
    rest[_FIRST] = {k: v for k, v in params[_FIRST].items() if k != "kernel"}
    return rest


def feature_layers(params) -> int:
    """The mlp's dense layers ``Dense_0..Dense_{L-1}`` (what the feature loss applies)."""
    names = [f"Dense_{i}" for i in range(len(params))]
    if sorted(params) != sorted(names) or "kernel" not in params[_FIRST]:
        raise ValueError(
            f"sampling='feature' needs the mlp's parameters Dense_0..Dense_{len(params) - 1}, "
            f"got {sorted(params)}"
        )
    return len(names)


def feature_params(params, mesh):
    """Host mlp parameters placed in the feature layout (one process)."""
    n = mesh.shape[AXIS]
    slices = sampling_lib.split_features(np.asarray(params[_FIRST]["kernel"]), n, axis=0)
    return {
        "slices": jax.device_put(slices, jax.sharding.NamedSharding(mesh, P(AXIS))),
        "rest": jaxcomp.distributed.replicate(feature_rest(params), mesh),
    }


def feature_host_params(params, num_features: int):
    """The feature layout gathered back into the mlp's parameters (host numpy)."""
    rest = host_tree(params["rest"])
    kernel = sampling_lib.join_features(np.asarray(params["slices"]), num_features, axis=0)
    return {**rest, _FIRST: {**rest[_FIRST], "kernel": kernel}}


def feature_batch(xb, yb, mesh):
    """A global batch as the feature step reads it: (N, B, F_max) slices, labels replicated."""
    x = np.asarray(xb).reshape(len(xb), -1)
    slices = sampling_lib.split_features(x, mesh.shape[AXIS], axis=1)
    return (
        jax.device_put(slices, jax.sharding.NamedSharding(mesh, P(AXIS))),
        jaxcomp.distributed.replicate(np.asarray(yb), mesh),
    )


def feature_loss_fn(num_layers: int):
    """``loss({"slice", "rest"}, x_slice, y)`` of the mlp, inside shard_map over AXIS."""

    def loss_fn(p, x, y):
        # models.MLP: Dense, ReLU after every layer but the last.
        h = sampling_lib.feature_parallel_dense(x, p["slice"], AXIS) + p["rest"][_FIRST]["bias"]
        for i in range(1, num_layers):
            layer = p["rest"][f"Dense_{i}"]
            h = jnp.matmul(jax.nn.relu(h), layer["kernel"]) + layer["bias"]
        return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()

    return loss_fn


def feature_value_and_grad(num_layers: int):
    """This device's ``(loss, {"slice": grad, "rest": grad})``, inside shard_map."""
    value_and_grad = jaxcomp.distributed.per_device_value_and_grad(
        feature_loss_fn(num_layers), AXIS
    )

    def f(params, x, y):
        return value_and_grad({"slice": params["slices"][0], "rest": params["rest"]}, x[0], y)

    return f


FEATURE_PARAM_SPECS = {"slices": P(AXIS), "rest": P()}


def feature_slice_optimizer(config: TrainConfig, steps_per_epoch: int, total_steps: int):
    """The kernel slices' optimizer: the run's SGD (momentum, schedule), no compressor."""
    c = resolve_config(config)
    lr = learning_rate(c, steps_per_epoch, total_steps)
    return with_weight_decay(optax.sgd(lr, momentum=c.momentum) if c.momentum else optax.sgd(lr), c)


def init_feature_opt_state(slice_tx, tx, params, mesh):
    """(slice state, rest state), each with a leading device axis sharded over AXIS."""

    def init(slices, rest):
        return device_stack((slice_tx.init(slices[0]), tx.init(rest)))

    init_fn = shard_step(init, mesh, in_specs=(P(AXIS), P()), out_specs=P(AXIS))
    return jax.jit(init_fn)(params["slices"], params["rest"])


def make_feature_train_step(
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
    value_and_grad = feature_value_and_grad(num_layers)

    def step(params, opt_state, x, y):
        slice_state, state = device_slice(opt_state)
        loss, grads = value_and_grad(params, x, y)
        own = params["slices"][0]
        # A slice's gradient is its device's alone: no exchange, no compression.
        slice_updates, slice_state = slice_tx.update(grads["slice"], slice_state, own)
        updates, state = tx.update(grads["rest"], state, params["rest"])
        new_params = {
            "slices": optax.apply_updates(own, slice_updates)[None],
            "rest": optax.apply_updates(params["rest"], updates),
        }
        stats = step_stats(state, num_rest)
        stats["wire_bytes"] = stats["wire_bytes"] + jnp.float32(activation_bytes)
        metrics = {k: lax.pmean(v, AXIS) for k, v in stats.items()}
        metrics["loss"] = lax.pmean(loss, AXIS)
        return new_params, device_stack((slice_state, state)), metrics

    sharded = shard_step(
        step,
        mesh,
        in_specs=(FEATURE_PARAM_SPECS, P(AXIS), P(AXIS), P()),
        out_specs=(FEATURE_PARAM_SPECS, P(AXIS), P()),
        communicate=communicate,
    )
    return jax.jit(sharded, donate_argnums=(0, 1))


def make_feature_forward_backward(mesh, num_layers: int):
    """The feature step's forward and backward, applied locally, without collectives.

    The forward's all-reduce of the partial products is communication: it is
    replaced by its local stand-in here, so the split's communication part
    holds it with the gradient exchange.
    """
    value_and_grad = feature_value_and_grad(num_layers)

    def step(params, x, y):
        _, grads = value_and_grad(params, x, y)
        return {
            "slices": (params["slices"][0] - grads["slice"])[None],
            "rest": optax.apply_updates(params["rest"], grads["rest"]),
        }

    return jax.jit(
        shard_step(
            step,
            mesh,
            in_specs=(FEATURE_PARAM_SPECS, P(AXIS), P()),
            out_specs=FEATURE_PARAM_SPECS,
            communicate=False,
        ),
        donate_argnums=0,
    )


def feature_mode(config: TrainConfig, tx, mesh, init_params, steps_per_epoch: int) -> Mode:
    """``sampling="feature"``: the first kernel's slices per device, the rest data-parallel."""
    c = config
    n_dev = mesh.shape[AXIS]
    num_layers = feature_layers(init_params)
    slice_tx = feature_slice_optimizer(c, steps_per_epoch, steps_per_epoch * c.epochs)
    kernel = init_params[_FIRST]["kernel"]
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(init_params))
    num_rest = num_params - int(np.size(kernel))
    num_features = int(np.shape(kernel)[0])
    # Each device sends its (batch, hidden) float32 partial product into an all-reduce.
    activation_bytes = jaxcomp.comm.collectives.allreduce_bytes(
        4 * c.batch_size * int(np.shape(kernel)[1]), n_dev
    )
    params = feature_params(init_params, mesh)
    args = (slice_tx, tx, mesh, num_layers, num_rest, activation_bytes)
    compiled = {}

    def compile(carry, batch):
        step = compiled["step"] = make_feature_train_step(*args).lower(*carry, *batch).compile()

        def run(carry, batch):
            *carry, metrics = step(*carry, *batch)
            return tuple(carry), metrics

        return run

    local = _lazy(lambda: make_feature_train_step(*args, communicate=False))
    forward_backward = _lazy(lambda: make_feature_forward_backward(mesh, num_layers))

    def time_split(carry, batch):
        return _median_split(
            (
                (compiled["step"], (*carry, *batch)),
                (local(), (*carry, *batch)),
                (forward_backward(), (carry[0], *batch)),
            )
        )

    logging.info(
        "sampling='feature': the first kernel's %d slices are updated by SGD alone (each "
        "device's own gradient, never compressed or averaged); %s compresses the other "
        "%d parameters",
        n_dev,
        c.compressor,
        num_rest,
    )
    return Mode(
        carry=(params, init_feature_opt_state(slice_tx, tx, params, mesh)),
        place=lambda xb, yb: feature_batch(xb, yb, mesh),
        compile=compile,
        time_split=time_split,
        host_params=lambda p: feature_host_params(p, num_features),
        compressed=feature_rest(init_params),
        # Feature runs read whole batches in the global order.
        sampling="global",
        batch_devices=1,
        record=lambda opt_state, sums, steps: {
            "activation_bytes_per_step_per_device": activation_bytes
        },
    )


def _coded_config(config: TrainConfig) -> cssgd.CodedConfig:
    c = resolve_config(config)
    return cssgd.CodedConfig(
        redundancy=c.redundancy,
        value_range=c.coded_value_range,
        bits=c.coded_bits,
        exchange=c.exchange,
    )


def _make_coded_forward_backward(loss_fn, mesh):
    """Each device's per-block gradients of a CSSGD step (vmapped), applied locally."""
    value_and_grad = jaxcomp.distributed.per_device_value_and_grad(loss_fn, AXIS)

    def step(params, blocks):
        local = device_slice(blocks)
        _, block_grads = jax.vmap(value_and_grad, in_axes=(None, 0))(params, local)
        return optax.apply_updates(params, jax.tree.map(lambda g: jnp.mean(g, 0), block_grads))

    return jax.jit(
        shard_step(step, mesh, in_specs=(P(), P(AXIS)), out_specs=P()),
        donate_argnums=0,
    )


def coded_mode(config: TrainConfig, model, tx, mesh, init_params) -> Mode:
    """CSSGD (``exchange`` coded or uncoded): :func:`jaxcomp.cssgd.make_train_step`."""
    c = config
    coded_cfg = _coded_config(c)
    loss_fn = classifier_loss(model)
    params = jaxcomp.distributed.replicate(init_params, mesh)
    # (CodedState, sgd state) per device: a pytree that orbax saves like any other.
    opt_state = cssgd.init_opt_state(tx, params, mesh, AXIS, seed=c.seed)
    make_step = functools.partial(cssgd.make_train_step, loss_fn, tx, mesh, coded_cfg, AXIS)
    compiled = {}

    def compile(carry, batch):
        step = compiled["step"] = make_step().lower(*carry, *batch).compile()

        def run(carry, batch):
            *carry, m = step(*carry, *batch)
            # A CSSGD device's own message is its packets, each multicast once.
            return tuple(carry), {**m, "message_bytes": m["wire_bytes"], "density": -1.0}

        return run

    local = _lazy(lambda: make_step(communicate=False))
    forward_backward = _lazy(lambda: _make_coded_forward_backward(loss_fn, mesh))

    def time_split(carry, batch):
        return _median_split(
            (
                (compiled["step"], (*carry, *batch)),
                (local(), (*carry, *batch)),
                (forward_backward(), (carry[0], *batch)),
            )
        )

    def record(opt_state, sums, steps):
        coded_state = opt_state[0]  # checkpointed, so the totals survive a resume
        return {
            "exchange": c.exchange,
            "redundancy": c.redundancy,
            "received_bytes_per_step_per_device": sums["received_bytes"] / steps,
            "clipped": int(np.sum(np.asarray(coded_state.clipped))),
            "nonfinite": int(np.sum(np.asarray(coded_state.nonfinite))),
        }

    return Mode(
        carry=(params, opt_state),
        place=lambda xb, yb: (cssgd.shard_block_batch((xb, yb), mesh, c.redundancy, AXIS),),
        compile=compile,
        time_split=time_split,
        host_params=host_tree,
        compressed=init_params,
        # CSSGD cuts its blocks from the global batch, whose draws need not divide by device.
        batch_devices=1,
        sums=(*STEP_SUMS, "received_bytes"),
        record=record,
    )


# --pipeline_stages: the mlp as six layers (flatten, Dense_0, relu, Dense_1, relu,
# Dense_2) split by index into the stages; Dense_k is layer 2k + 1.


def mlp_layers(model) -> list:
    """The experiment's mlp (:class:`experiments.models.MLP`) as a list of layers.

    Its ``Dense_k`` parameters are those of layer ``2k + 1`` (``layers_{2k+1}``
    of :func:`jaxcomp.distributed.split_layers`).
    """
    dense = [*model.hidden, model.num_classes]
    layers = [lambda x: x.reshape(x.shape[0], -1)]
    for k, width in enumerate(dense):
        layers.append(nn.Dense(width))
        if k < len(dense) - 1:
            layers.append(nn.relu)
    return layers


def pipeline_mode(config: TrainConfig, model, tx, mesh, init_params) -> Mode:
    """``pipeline_stages``: the mlp split into stages (``make_pipeline_train_step``).

    The step is :func:`jaxcomp.distributed.make_pipeline_train_step` on the
    ``(STAGE_AXIS, AXIS)`` mesh. The time split's ``forward_backward`` is the
    same pipeline with plain SGD and no communication (the micro-batches'
    forward and backward, bubble included); its communication is what the
    step's exchanges expose, the activations between stages and the
    gradients together.
    """
    c = config
    dist = jaxcomp.distributed
    n_stages, n_data = mesh.shape[STAGE_AXIS], mesh.shape[AXIS]
    m = c.microbatches or n_stages
    layers = mlp_layers(model)
    # Dense_k is the mlp's layer 2k + 1 (mlp_layers).
    as_layers = {f"layers_{2 * k + 1}": init_params[f"Dense_{k}"] for k in range(len(init_params))}
    fns, stage_params = dist.split_layers(layers, as_layers, n_stages)
    stacked, stages = dist.stack_stages(stage_params, mesh, STAGE_AXIS)
    # What one device's compressor sees: its stage's (padded) parameters.
    per_stage = stages.length or sum(int(np.size(x)) for x in jax.tree.leaves(stages.structures[0]))
    make = functools.partial(
        dist.make_pipeline_train_step, fns, stages, _cross_entropy, mesh=mesh, num_microbatches=m
    )
    stats = jax.jit(
        lambda s: jax.tree.map(
            jnp.mean, jax.vmap(jax.vmap(lambda d: step_stats(d, max(per_stage, 1))))(s)
        )
    )
    compiled = {}

    def compile(carry, batch):
        step = compiled["step"] = make(tx).lower(*carry, batch).compile()

        def run(carry, batch):
            params, opt_state, metrics = step(*carry, batch)
            s = stats(opt_state)
            return (params, opt_state), {
                "loss": metrics["loss"],
                "wire_bytes": metrics.get("wire_bytes", jnp.float32(0)),
                "stage_bytes": metrics["stage_bytes"],
                "message_bytes": s["message_bytes"],
                "density": s["density"],
            }

        return run

    local = _lazy(lambda: make(tx, communicate=False))
    forward_backward = _lazy(lambda: make(optax.sgd(0.0), communicate=False))

    def time_split(carry, batch):
        args = (*carry, batch)
        return _median_split(
            ((compiled["step"], args), (local(), args), (forward_backward(), args))
        )

    def host_params(params):
        merged = {k: v for stage in dist.unstack_stages(params, stages) for k, v in stage.items()}
        return {
            f"Dense_{(int(k.split('_')[1]) - 1) // 2}": jax.tree.map(np.asarray, v)
            for k, v in merged.items()
        }

    bubble = dist.bubble_fraction(n_stages, m)
    return Mode(
        carry=(stacked, dist.init_pipeline_opt_state(tx, stacked, mesh)),
        place=lambda xb, yb: dist.shard_batch((xb, yb), mesh, AXIS),
        compile=compile,
        time_split=time_split,
        host_params=host_params,
        compressed=init_params,
        batch_devices=n_data,
        sums=(*STEP_SUMS, "stage_bytes"),
        record=lambda opt_state, sums, steps: {
            "stage_bytes_per_step_per_device": sums["stage_bytes"] / steps,
            "pipeline_bubble_fraction": bubble,
        },
    )


def _cross_entropy(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_mode(config: TrainConfig, model, tx, mesh, variables, steps_per_epoch: int) -> Mode:
    """The run's :class:`Mode`, chosen from ``config`` (resolved) once.

    Args:
      config: the resolved configuration.
      model: the Flax model.
      tx: the optimizer (:func:`experiments.config.build_optimizer`).
      mesh: the 1-D mesh over ``AXIS`` (two-level with ``config.mesh``).
      variables: the model's initial variables (``params`` and, with
        BatchNorm, its running averages).
      steps_per_epoch: steps per epoch (the feature slices' schedule).
    """
    init_params = variables["params"]
    if config.pipeline_stages is not None:
        return pipeline_mode(config, model, tx, mesh, init_params)
    if config.sampling == "feature":
        return feature_mode(config, tx, mesh, init_params, steps_per_epoch)
    if config.exchange in cssgd.EXCHANGES:
        return coded_mode(config, model, tx, mesh, init_params)
    # BatchNorm's running averages (empty without norm="batch"): replicated,
    # updated by every step, used to evaluate, checkpointed.
    model_state = {k: v for k, v in variables.items() if k != "params"}
    num_params = sum(int(np.size(x)) for x in jax.tree.leaves(init_params))
    return data_parallel_mode(
        model, tx, mesh, init_params, model_state, num_params, data_axis(config)
    )
