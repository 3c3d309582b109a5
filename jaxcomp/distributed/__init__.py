"""Data-parallel training: per-device gradients, train steps, placement, FSDP, timing, processes.

The main path is ``jax.shard_map`` over a mesh axis (default ``"data"``):
parameters replicated, batch sharded along the axis, and the optimizer state
*per device* (error-feedback residuals differ between devices), stored with a
leading device axis sharded along the mesh axis::

    mesh = jax.make_mesh((jax.device_count(),), ("data",))
    tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3, axis_name="data"), optax.sgd(0.1))
    params = replicate(params, mesh)
    opt_state = init_opt_state(tx, params, mesh)
    train_step = make_train_step(loss_fn, tx, mesh)
    for batch in batches:
        params, opt_state, metrics = train_step(params, opt_state, shard_batch(batch, mesh))
        jax.block_until_ready(metrics)  # bound the steps in flight (simulated devices)

One module per job: :mod:`~jaxcomp.distributed.grads` (per-device gradients),
:mod:`~jaxcomp.distributed.exchange` (the dense exchange, ``apply_if_finite``,
local accumulation), :mod:`~jaxcomp.distributed.placement` (data on the mesh,
parameter layouts), :mod:`~jaxcomp.distributed.fsdp` (``sharded_optimizer``),
:mod:`~jaxcomp.distributed.skeleton` (the pieces every step builder is made of),
:mod:`~jaxcomp.distributed.step` (``make_train_step``, ``init_opt_state``),
:mod:`~jaxcomp.distributed.timing` (``time_split``, ``make_time_split``),
:mod:`~jaxcomp.distributed.pmap` (the ``pmap`` path),
:mod:`~jaxcomp.distributed.qsvrg` (the QSVRG epoch driver),
:mod:`~jaxcomp.distributed.pipeline` (pipeline parallelism: stages over a
``"stage"`` mesh axis, compressed data parallelism within each) and
:mod:`~jaxcomp.distributed.processes` (several processes). Their public names
are re-exported here.

Two traps this package handles: inside ``shard_map``, ``jax.grad`` w.r.t.
replicated parameters returns gradients already ``psum``-ed over the axis
(the transpose of the implicit ``pvary``), so a compressor would see the
global sum instead of its device's gradient (:func:`per_device_grad` casts the
parameters to device-varying first); and sparse exchanges end in an
all-gather, whose result JAX types as device-varying although every device
holds the same bits, so the step's ``shard_map`` runs with ``check_vma=False``
to return replicated parameters without another all-reduce.
"""

from jaxcomp.distributed.exchange import (
    AccumulateState,
    DenseExchangeState,
    accumulate_then_compress,
    apply_if_finite,
    dense_exchange,
    skip_not_finite,
)
from jaxcomp.distributed.fsdp import (
    ShardedOptimizerState,
    sharded_optimizer,
)
from jaxcomp.distributed.grads import (
    per_device_grad,
    per_device_value_and_grad,
)
from jaxcomp.distributed.pipeline import (
    SCHEDULES,
    PipelineStages,
    bubble_fraction,
    init_pipeline_opt_state,
    make_pipeline_train_step,
    schedule_ticks,
    split_layers,
    stack_stages,
    stage_bytes,
    unstack_stages,
)
from jaxcomp.distributed.placement import (
    flax_param_specs,
    place_params,
    replicate,
    shard_batch,
    two_level_mesh,
)
from jaxcomp.distributed.pmap import (
    make_pmap_train_step,
    stack_for_pmap,
)
from jaxcomp.distributed.processes import (
    initialize_multiprocess,
)
from jaxcomp.distributed.qsvrg import make_qsvrg_epoch
from jaxcomp.distributed.step import (
    init_opt_state,
    make_train_step,
    unexchanged_leaves,
)
from jaxcomp.distributed.timing import (
    TimeSplit,
    make_time_split,
    split_step_time,
    time_split,
)

__all__ = [
    "AccumulateState",
    "DenseExchangeState",
    "PipelineStages",
    "SCHEDULES",
    "ShardedOptimizerState",
    "TimeSplit",
    "accumulate_then_compress",
    "apply_if_finite",
    "bubble_fraction",
    "dense_exchange",
    "flax_param_specs",
    "init_opt_state",
    "init_pipeline_opt_state",
    "initialize_multiprocess",
    "make_pipeline_train_step",
    "make_pmap_train_step",
    "make_qsvrg_epoch",
    "make_time_split",
    "make_train_step",
    "per_device_grad",
    "per_device_value_and_grad",
    "place_params",
    "replicate",
    "schedule_ticks",
    "shard_batch",
    "sharded_optimizer",
    "skip_not_finite",
    "split_layers",
    "split_step_time",
    "stack_for_pmap",
    "stack_stages",
    "stage_bytes",
    "time_split",
    "two_level_mesh",
    "unexchanged_leaves",
    "unstack_stages",
]
