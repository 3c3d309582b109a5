"""DLGS layer merging of a run: the merge plan, profiled once and kept in ``merge_plan.json``."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import logging

from experiments import data as data_lib
from experiments.config import TrainConfig, resolve_config
from experiments.workdir import MERGE_PLAN_FILE, config_differences, config_record
from jaxcomp import planning

__all__ = ["MERGE_ALPHA", "MERGE_BETA", "merge_groups", "merge_link_cost"]

_MERGE_PLAN_FORMAT = 1
# The link the merge planner assumes (t_c = alpha + beta * bytes): 10 Gbit
# Ethernet, 50 us per message and 1.25e9 bytes/s. A message carries an
# (int32 index, float32 value) pair per selected element, 8 * ratio bytes per
# gradient element.
MERGE_ALPHA = 50e-6
MERGE_BETA = 1 / 1.25e9


def merge_link_cost(config: TrainConfig) -> planning.LinearCost:
    """The merge planner's ``t_c``: the config's link (or 10 GbE) for (index, value) messages."""
    alpha = MERGE_ALPHA if config.merge_alpha is None else config.merge_alpha
    beta = MERGE_BETA if config.merge_beta is None else config.merge_beta
    return planning.linear_cost(alpha, beta, 8 * _ratio(config))


def _ratio(config: TrainConfig) -> float:
    """The sparsifier's density (its ``compressor_kwargs`` resolved)."""
    return resolve_config(config).compressor_kwargs["ratio"]


def _layer_groups_to_paths(layers, layer_groups) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(p for q in g for p in layers[q].paths) for g in layer_groups)


def _stored_merge_plan(
    path: str, run_record: dict, layer_names: list, t_c: planning.LinearCost
) -> dict | None:
    """The plan in ``path`` when it was made for this configuration, model and link, else None."""
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            stored = json.load(f)
        if stored["format"] != _MERGE_PLAN_FORMAT or stored["layers"] != layer_names:
            return None
        if config_differences(stored["config"], run_record):
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
    t_s = planning.measure_sparsify_cost(config.compressor, ratio=_ratio(config))
    t_c = merge_link_cost(config)
    model_plan = planning.plan_for_model(
        loss_fn,
        params,
        batch,
        ratio=_ratio(config),
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
        "t_s": {"selector": config.compressor, "alpha": t_s.alpha, "beta": t_s.beta},
        "t_c": dataclasses.asdict(t_c),
        "summary": summary,
    }


def merge_groups(
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
        run_record = config_record(config, num_devices)["config"]
        record = _stored_merge_plan(path, run_record, names, merge_link_cost(config))
        if record is not None:
            logging.info("reusing the merge plan in %s", path)
        else:
            record = _make_merge_plan(config, model, params, dataset, num_devices, model_state)
            # As merge_plan.json holds it (tuples become lists), so that the
            # returned record equals the stored one.
            record["config"] = json.loads(json.dumps(run_record))
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
