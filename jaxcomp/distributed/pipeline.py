r"""Pipeline (layer-wise) model parallelism with compressed data parallelism.

A 2-D mesh ``("stage", "data")``: the model's layers are split into ``S``
consecutive *stages*, stage ``s`` living on the devices of row ``s`` of the
mesh; each row holds ``N`` data-parallel replicas of its stage. A device's
shard of the batch (``B / N`` examples) is cut into ``M`` micro-batches that
flow through the stages with ``lax.ppermute`` over ``"stage"`` in a GPipe
schedule (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural
Networks using Pipeline Parallelism"): every micro-batch forward, then every
micro-batch backward. Each stage's parameter gradients are accumulated over
the micro-batches, then ``tx`` exchanges them over ``"data"``: any jaxcomp
compressor given ``axis_name="data"``, with its error feedback per stage
(every device keeps the compressor state of its own stage and data replica).

**Schedule.** The forward is a scan over ``T = M + S - 1`` clock ticks: at
tick ``t`` stage ``s`` runs micro-batch ``t - s`` (when ``0 <= t - s < M``)
and sends its activation to stage ``s + 1``. The backward is the scan's
transpose (``jax.grad``): ticks in reverse, each ``ppermute`` transposed to
one from stage ``s + 1`` to ``s`` carrying the cotangents. Each stage is
busy ``M`` ticks out of ``T`` in each direction, so the *bubble* (idle
fraction) is

.. math:: \text{bubble} = \frac{S - 1}{M + S - 1},

the GPipe paper's figure; more micro-batches shrink it (``M >= 4 S`` keeps
it under 20 %). Activations of all ``M`` micro-batches are kept for the
backward (GPipe without re-materialisation).

**1F1B** (``schedule="1f1b"``; Narayanan et al., 2019, "PipeDream:
Generalized Pipeline Parallelism for DNN Training"; the synchronous variant of
Megatron-LM): at tick ``t`` stage ``s`` runs the forward of micro-batch
``t - s`` and the backward of micro-batch ``t - (2 S - 2 - s)``, so each
micro-batch's backward starts as soon as the last stage has its loss, over
``T = M + 2 S - 2`` ticks that each carry an activation forward and a
cotangent back. The backward is written by hand (``jax.vjp``), recomputing
the stage's forward from its stored input: a stage keeps the inputs of at
most ``2 (S - s) - 1`` micro-batches (a ring of ``2 S - 1``) instead of the
residuals of all ``M``. The gradients are GPipe's (the same sums, up to
float rounding). In these lock-step ticks its bubble is ``(2 S - 2) / (M +
2 S - 2)`` of each slot (a stage idles in the first and last ticks in both
directions); 1F1B's gain is the memory, and the recomputed forward is its price.

**Where parameters live.** A stage's parameters live only on its row: they
are stacked with a leading axis of ``S`` sharded over ``"stage"``
(:func:`stack_stages`). Two forms, decided from the stages' parameters:

- *homogeneous* stages (the same tree structure, shapes and dtypes, e.g.
  repeated blocks): stacked leaf by leaf, so each device's compressor sees
  the stage's own tree (a layer-wise compressor such as PowerSGD still sees
  matrices);
- *heterogeneous* stages (different layers per stage): each stage's
  parameters are ravelled into one flat vector
  (``jax.flatten_util.ravel_pytree``, in the common dtype of all stages)
  zero-padded to the longest stage's length. The compressor then sees **one
  flat leaf per stage** (a ``ratio`` applies to the padded length; a low-rank
  compressor sees a vector). The padding's gradient is zero and stays zero.
  Each leaf keeps its own dtype where it is used: the stage function (and
  :func:`unstack_stages`) gets it cut from the vector and cast back (a
  bfloat16 stage next to a float32 one sees bfloat16 parameters). ``tx``
  (the compressor, its error feedback, the optimizer) runs in the vector's
  common dtype; after the update each element of a narrower leaf is rounded
  to that leaf's dtype, so the vector holds exactly the leaves' values (one
  rounding of ``p + u``, where ``optax.sgd`` on bfloat16 parameters
  rounds ``u`` and then ``p + u``).

Every stage parameter is trained: integer, bool or complex leaves are
refused (``ValueError``); close over such constants in the stage function.

Each stage's function runs in a ``lax.switch`` on ``lax.axis_index("stage")``;
activations between stages are flattened per example and zero-padded to the
widest boundary's size, in their common dtype. Every collective (the
``ppermute`` between stages, the compressor's exchange over ``"data"``) is
outside the switch's branches, so every device runs the same collectives.
A stage function need not be finite on the bubble's zero padding (e.g. ``x
/ norm(x)`` on zeros, whose NaN Jacobian times a zero cotangent would be
NaN): 1F1B runs a stage only on the ticks carrying one of its micro-batches
(a ``lax.cond``); GPipe runs it on every tick and its backward selects zero
on bubble ticks (a custom VJP: skipping the forward with a ``lax.cond`` made
its step about twice as slow on XLA:CPU). Either way the loss is taken on
micro-batches only.

**Bytes.** ``metrics["wire_bytes"]``: the gradient exchange (what ``tx``
sent, mean over devices, as :func:`~jaxcomp.distributed.make_train_step`).
``metrics["stage_bytes"]``: what one device sent to its neighbour stage this
step, mean over devices: on each of the ``T`` ticks, the ``S - 1`` sending
stages send one padded micro-batch activation forward and the ``S - 1``
receiving ones a cotangent of the same size backward, so ``2 T (S - 1) m A
b / S`` for micro-batches of ``m`` examples, activations padded to ``A``
elements of ``b`` bytes. Bubble ticks send too (static shapes).

Not here: interleaved stages, tensor parallelism inside a stage, mutable model state
(``batch_stats``) or a PRNG key in the stages, several arrays between stages.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.flatten_util import ravel_pytree
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxcomp import _validation as V
from jaxcomp.distributed.grads import to_varying
from jaxcomp.distributed.placement import ParamLayout
from jaxcomp.distributed.skeleton import (
    UNEXCHANGED,
    check_stacked_state,
    check_unexchanged,
    compress,
    device_slice,
    device_stack,
    jit_step,
    mean_leaves,
    shard_step,
)

__all__ = [
    "PipelineStages",
    "SCHEDULES",
    "bubble_fraction",
    "init_pipeline_opt_state",
    "make_pipeline_train_step",
    "schedule_ticks",
    "split_layers",
    "stack_stages",
    "stage_bytes",
    "unstack_stages",
]


# The schedules of make_pipeline_train_step.
SCHEDULES = ("gpipe", "1f1b")


def schedule_ticks(schedule: str, num_stages: int, num_microbatches: int) -> int:
    """Lock-step ticks of a schedule: ``M + S - 1`` (GPipe, each way), ``M + 2 S - 2`` (1F1B).

    Example:
      >>> from jaxcomp.distributed import schedule_ticks
      >>> schedule_ticks("gpipe", 4, 8), schedule_ticks("1f1b", 4, 8)
      (11, 14)
    """
    schedule = V.check_choice("schedule", schedule, SCHEDULES)
    s = V.check_int("num_stages", num_stages, 1)
    m = V.check_int("num_microbatches", num_microbatches, 1)
    return m + s - 1 if schedule == "gpipe" else m + 2 * s - 2


def bubble_fraction(num_stages: int, num_microbatches: int, schedule: str = "gpipe") -> float:
    """A stage's idle fraction of the schedule's ticks: ``(ticks - M) / ticks``.

    GPipe: ``(S - 1) / (M + S - 1)``. 1F1B in lock-step ticks (each tick one
    forward slot and one backward slot): ``(2 S - 2) / (M + 2 S - 2)``; its
    gain is memory, not the bubble (see :mod:`jaxcomp.distributed.pipeline`).

    Example:
      >>> from jaxcomp.distributed import bubble_fraction
      >>> bubble_fraction(4, 8), bubble_fraction(4, 8, "1f1b")
      (0.2727272727272727, 0.42857142857142855)
    """
    ticks = schedule_ticks(schedule, num_stages, num_microbatches)
    return (ticks - num_microbatches) / ticks


# --- stage parameters ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class PipelineStages:
    """How the stages' parameters are stacked (:func:`stack_stages`).

    Attributes:
      structures: each stage's parameters as ``jax.ShapeDtypeStruct`` trees.
      flat: False for homogeneous stages (stacked leaf by leaf); True when
        each stage is ravelled to one vector padded to ``length``.
      length: the padded vector's length (flat form; 0 otherwise).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("stage", "data"))
      >>> _, stages = dist.stack_stages([{"w": jnp.ones((2, 3))}], mesh)
      >>> stages.num_stages, stages.flat, stages.length  # one stage: stacked leaf by leaf
      (1, False, 0)
      >>> stages.structures[0]["w"].shape
      (2, 3)
    """

    structures: tuple
    flat: bool
    length: int

    @property
    def num_stages(self) -> int:
        """``S``, the number of stages (one parameter tree each)."""
        return len(self.structures)

    def stage_params(self, s: int, local):
        """Stage ``s``'s parameter tree from its stacked entry (one row, leading axis gone).

        In the flat form each leaf is cut from the vector and cast back to its
        own dtype (a bfloat16 stage next to a float32 one gets bfloat16 leaves).
        """
        if not self.flat:
            return local
        leaves, treedef = jax.tree.flatten(self.structures[s])
        sizes = [math.prod(leaf.shape) for leaf in leaves]
        # One split (its transpose, in the backward, is one concatenate; slices would add
        # a padded full-length cotangent per leaf).
        parts = jnp.split(local[: sum(sizes)], np.cumsum(sizes)[:-1]) if leaves else []
        out = [x.reshape(v.shape).astype(v.dtype) for x, v in zip(parts, leaves, strict=True)]
        return jax.tree.unflatten(treedef, out)

    def _round_to_leaf_dtypes(self, s, local):
        """Stage ``s``'s flat vector (``s`` traced), each element rounded to its leaf's dtype.

        After an update in the vector's common dtype, a narrower leaf (bfloat16
        in a float32 vector) holds only values of its own dtype again, so the
        vector is what :meth:`stage_params` returns. Per narrower dtype: one
        ``where`` over the element ranges of its leaves (consecutive leaves
        merged; a small static table of ranges per stage, no per-element
        constant). Identity for the stacked form.
        """
        if not self.flat:
            return local
        index = jnp.arange(self.length)
        for dtype, (starts, ends) in self._narrow_runs(jnp.result_type(local)).items():
            start, end = jnp.asarray(starts)[s], jnp.asarray(ends)[s]
            mask = jnp.any((index >= start[:, None]) & (index < end[:, None]), axis=0)
            local = jnp.where(mask, local.astype(dtype).astype(local.dtype), local)
        return local

    def _narrow_runs(self, common) -> dict:
        """``{dtype: (starts, ends)}``: ``(S, R)`` ranges of the elements of a narrower dtype."""
        runs = {}  # dtype -> per stage, a list of [start, end)
        for s, structure in enumerate(self.structures):
            start = 0
            for leaf in jax.tree.leaves(structure):
                end = start + math.prod(leaf.shape)
                dtype = jnp.dtype(leaf.dtype)
                if dtype != jnp.dtype(common):
                    stage_runs = runs.setdefault(dtype, [[] for _ in self.structures])[s]
                    if stage_runs and stage_runs[-1][1] == start:
                        stage_runs[-1][1] = end  # merged with the previous leaf
                    else:
                        stage_runs.append([start, end])
                start = end
        out = {}
        for dtype, per_stage in runs.items():
            width = max(len(r) for r in per_stage)
            table = np.zeros((self.num_stages, width, 2), np.int32)  # padding: empty [0, 0)
            for s, r in enumerate(per_stage):
                if r:
                    table[s, : len(r)] = r
            out[dtype] = (table[..., 0], table[..., 1])
        return out


def _zeros(structure):
    return jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), structure)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)


def _stages_of(stage_params: Sequence) -> PipelineStages:
    if isinstance(stage_params, dict) or not isinstance(stage_params, Sequence):
        raise ValueError(
            "stage_params must be a list with one parameter tree per stage, got "
            f"{type(stage_params).__name__}"
        )
    if not stage_params:
        raise ValueError("stage_params must hold at least one stage, got an empty list")
    structures = tuple(_abstract(p) for p in stage_params)
    for s, structure in enumerate(structures):
        for path, leaf in jax.tree_util.tree_flatten_with_path(structure)[0]:
            if not jnp.issubdtype(leaf.dtype, jnp.floating):
                raise ValueError(
                    f"stage_params[{s}] leaf {jax.tree_util.keystr(path)} has dtype "
                    f"{leaf.dtype}: every stage parameter is trained (jax.grad), so it must be "
                    "a real floating-point array; pass integer/bool/complex constants to the "
                    "stage function another way (e.g. close over them)"
                )
    first = jax.tree.structure(structures[0])
    homogeneous = all(
        jax.tree.structure(s) == first and jax.tree.leaves(s) == jax.tree.leaves(structures[0])
        for s in structures
    ) and bool(jax.tree.leaves(structures[0]))
    if homogeneous:
        return PipelineStages(structures, flat=False, length=0)
    sizes = [sum(math.prod(x.shape) for x in jax.tree.leaves(s)) for s in structures]
    return PipelineStages(structures, flat=True, length=max(1, *sizes))


def stack_stages(stage_params: Sequence, mesh: Mesh, stage_axis: str = "stage"):
    """The stages' parameters stacked along a leading stage axis, placed on ``mesh``.

    Homogeneous stages (the same tree, shapes and dtypes) are stacked leaf by
    leaf; otherwise each stage is ravelled to one vector zero-padded to the
    longest (see :mod:`jaxcomp.distributed.pipeline`). The leading axis is
    sharded over ``stage_axis`` and replicated over the other mesh axis.

    Args:
      stage_params: one parameter tree per stage (``S`` of them).
      mesh: the ``(stage, data)`` mesh.
      stage_axis: the mesh axis of the stages.

    Returns:
      ``(stacked, stages)``: the stacked parameters and their
      :class:`PipelineStages` (what :func:`unstack_stages` and
      :func:`make_pipeline_train_step` need).

    Raises:
      ValueError: when the number of stages is not the size of ``stage_axis``;
        a parameter leaf that is not a real floating-point array (every stage
        parameter is trained).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("stage", "data"))
      >>> stacked, stages = dist.stack_stages([{"w": jnp.ones((2, 3))}], mesh)
      >>> stacked["w"].shape, stacked["w"].sharding.spec, stages.flat
      ((1, 2, 3), P('stage',), False)
    """
    stages = _stages_of(stage_params)
    _check_mesh(mesh, stage_axis, None)
    if stages.num_stages != mesh.shape[stage_axis]:
        raise ValueError(
            f"stack_stages: {stages.num_stages} stages given, but the mesh axis {stage_axis!r} "
            f"has {mesh.shape[stage_axis]} devices (one stage per row: give exactly that many)"
        )
    if stages.flat:
        rows = [ravel_pytree(p)[0] for p in stage_params]
        dtype = jnp.result_type(*rows)
        rows = [jnp.pad(r.astype(dtype), (0, stages.length - r.size)) for r in rows]
        stacked = jnp.stack(rows)
    else:
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stage_params)
    stacked = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P(stage_axis))), stacked)
    return stacked, stages


def unstack_stages(stacked, stages: PipelineStages) -> list:
    """The inverse of :func:`stack_stages`: one parameter tree per stage.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("stage", "data"))
      >>> stacked, stages = dist.stack_stages([{"w": jnp.ones(2)}], mesh)
      >>> dist.unstack_stages(stacked, stages)[0]["w"].tolist()
      [1.0, 1.0]
    """
    host = jax.device_get(stacked)  # a row of a stage-sharded array: gathered first
    return [
        stages.stage_params(s, jax.tree.map(lambda x, s=s: jnp.asarray(x[s]), host))
        for s in range(stages.num_stages)
    ]


def split_layers(
    layers: Sequence, params, num_stages: int, boundaries: Sequence[int] | None = None
):
    """A Flax ``nn.Sequential`` model split by layer index into consecutive stages.

    ``params`` are ``nn.Sequential(layers).init(...)["params"]`` (keys
    ``layers_0``, ``layers_1``, ...; layers without parameters have none).
    Stage ``s`` applies layers ``boundaries[s-1] <= i < boundaries[s]``.

    Args:
      layers: the Flax modules (or parameter-free callables) applied in order.
      params: the ``nn.Sequential``'s ``"params"`` collection.
      num_stages: ``S``, the number of stages.
      boundaries: the ``S - 1`` layer indices where a new stage starts
        (increasing, in ``[1, len(layers) - 1]``); None: as even as possible.

    Returns:
      ``(stage_fns, stage_params)``: ``stage_fns[s](params_s, x)`` and the
      parameters of each stage (a dict keyed ``layers_i``, with the original
      indices), for :func:`stack_stages` and :func:`make_pipeline_train_step`.

    Example:
      >>> import jax, jax.numpy as jnp
      >>> import flax.linen as nn
      >>> from jaxcomp import distributed as dist
      >>> layers = [nn.Dense(4), nn.relu, nn.Dense(4), nn.relu, nn.Dense(2)]
      >>> params = nn.Sequential(layers).init(jax.random.key(0), jnp.ones((1, 3)))["params"]
      >>> fns, stage_params = dist.split_layers(layers, params, 2)
      >>> [sorted(p) for p in stage_params]
      [['layers_0'], ['layers_2', 'layers_4']]
      >>> x = jnp.ones((5, 3))
      >>> y = fns[1](stage_params[1], fns[0](stage_params[0], x))
      >>> bool(jnp.allclose(y, nn.Sequential(layers).apply({"params": params}, x)))
      True
    """
    n = len(layers)
    s = V.check_int("num_stages", num_stages, 1, n)
    if boundaries is None:
        boundaries = [round(i * n / s) for i in range(1, s)]
    boundaries = [V.check_int("boundaries[i]", b, 1, n - 1) for b in boundaries]
    if len(boundaries) != s - 1 or any(
        b <= a for a, b in zip(boundaries, boundaries[1:], strict=False)
    ):
        raise ValueError(
            f"boundaries must be {s - 1} increasing layer indices in [1, {n - 1}], "
            f"got {list(boundaries)}"
        )
    edges = [0, *boundaries, n]
    fns, stage_params = [], []
    for a, b in zip(edges, edges[1:], strict=False):
        names = [f"layers_{i}" for i in range(a, b)]
        stage_params.append({k: params[k] for k in names if k in params})

        def stage_fn(p, x, a=a, b=b):
            for i in range(a, b):
                layer, name = layers[i], f"layers_{i}"
                if hasattr(layer, "apply"):
                    x = layer.apply({"params": p[name]} if name in p else {}, x)
                else:
                    x = layer(x)
            return x

        fns.append(stage_fn)
    return fns, stage_params


# --- the optimizer state -----------------------------------------------------------------


def _check_mesh(mesh: Mesh, stage_axis: str, data_axis: str | None) -> None:
    names = tuple(mesh.axis_names)
    wanted = {stage_axis} if data_axis is None else {stage_axis, data_axis}
    if not wanted <= set(names) or (data_axis is not None and len(names) != 2):
        raise ValueError(
            f"the pipeline needs a 2-D mesh with axes ({stage_axis!r}, {data_axis or 'data'!r}), "
            f"got axes {names} (jax.make_mesh((S, N), ('stage', 'data')))"
        )


def _layout(data_axis, stage_axis) -> ParamLayout:
    return ParamLayout((data_axis,), (stage_axis,), None, None, ())


def init_pipeline_opt_state(
    tx: optax.GradientTransformation,
    stacked_params,
    mesh: Mesh,
    *,
    stage_axis: str = "stage",
    data_axis: str = "data",
):
    """Per-device optimizer state of a pipeline: each device's stage and data replica.

    Runs ``tx.init`` on every device on its stage's parameters; leaves get
    shape ``(N, S, *leaf.shape)`` sharded over ``(data, stage)`` (the layout
    of :func:`~jaxcomp.distributed.init_opt_state` with a model axis).

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("stage", "data"))
      >>> stacked, _ = dist.stack_stages([{"w": jnp.zeros(3)}], mesh)
      >>> tx = optax.chain(jaxcomp.top_k(0.5, axis_name="data"), optax.sgd(0.1))
      >>> dist.init_pipeline_opt_state(tx, stacked, mesh)[0].residual["w"].shape
      (1, 1, 3)
    """
    _check_mesh(mesh, stage_axis, data_axis)

    def init(params):
        # The stage's row of the parameters; a (data, stage) block of one row each.
        return device_stack(device_stack(tx.init(device_slice(params))))

    specs = jax.tree.map(lambda _: P(stage_axis), stacked_params)
    init_fn = shard_step(init, mesh, (specs,), P(data_axis, stage_axis))
    return jax.jit(init_fn)(stacked_params)


# --- the step --------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class _PipelineConfig:
    """The validated static options of one :func:`make_pipeline_train_step` step."""

    stage_fns: tuple
    stages: PipelineStages
    loss_fn: Callable
    tx: optax.GradientTransformation
    mesh: Mesh
    num_microbatches: int
    stage_axis: str
    data_axis: str
    unexchanged: str
    communicate: bool
    schedule: str

    @property
    def num_stages(self) -> int:
        return self.mesh.shape[self.stage_axis]

    @property
    def num_data(self) -> int:
        return self.mesh.shape[self.data_axis]

    def data_mesh(self) -> Mesh:
        """One stage's row: the 1-D ``data`` mesh its compressor exchanges over."""
        row = np.take(self.mesh.devices, 0, axis=self.mesh.axis_names.index(self.stage_axis))
        return Mesh(row, (self.data_axis,))


def make_pipeline_train_step(
    stage_fns: Sequence[Callable],
    stages: PipelineStages,
    loss_fn: Callable,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    num_microbatches: int,
    *,
    stage_axis: str = "stage",
    data_axis: str = "data",
    donate: bool = True,
    unexchanged: str = "mean",
    communicate: bool = True,
    schedule: str = "gpipe",
) -> Callable:
    """Builds a jitted pipeline-parallel train step with compressed data parallelism.

    The GPipe schedule of :mod:`jaxcomp.distributed.pipeline`: each data
    replica's batch shard is cut into ``num_microbatches`` micro-batches,
    which flow forward through the stages and back; each stage's gradients,
    accumulated over the micro-batches, go through ``tx`` on each device (its
    exchange over ``data_axis``, its error feedback per stage and replica).
    With the dense exchange (:func:`~jaxcomp.distributed.dense_exchange`) the
    step is single-device training on the whole batch. Update leaves ``tx``
    does not exchange are handled as :func:`~jaxcomp.distributed.make_train_step`'s
    ``unexchanged``. Built from the shared step skeleton
    (:mod:`jaxcomp.distributed.skeleton`).

    Args:
      stage_fns: ``S`` functions, ``stage_fns[s](params_s, x) -> y``, one array
        in and one out (leading axis: the micro-batch's examples); stage 0
        receives the batch's inputs, the last stage's output goes to ``loss_fn``.
      stages: the :class:`PipelineStages` from :func:`stack_stages`.
      loss_fn: ``loss_fn(outputs, targets) -> scalar``, the mean loss of a
        micro-batch (the step's loss is the mean over micro-batches: the batch
        mean for equal micro-batches).
      tx: the optimizer, its compressor given ``axis_name=data_axis``.
      mesh: a 2-D mesh with axes ``stage_axis`` (``S`` devices) and
        ``data_axis`` (``N``).
      num_microbatches: ``M`` micro-batches per data replica and step; must
        divide ``B / N``.
      stage_axis, data_axis: the mesh's axis names.
      donate: donate the parameters and optimizer state to the step.
      unexchanged: ``"mean"`` or ``"error"``, as in ``make_train_step``.
      communicate: ``False`` replaces every collective by a local stand-in
        (:func:`jaxcomp.comm.without_communication`), to time the step without
        its communication (not a training step).
      schedule: ``"gpipe"`` (every forward, then every backward, by
        ``jax.grad``) or ``"1f1b"`` (one forward and one backward per tick,
        the backward recomputing the stage's forward: at most ``2 S - 1``
        micro-batch inputs kept instead of all ``M``); the same gradients.

    Returns:
      ``step(params, opt_state, batch)`` returning ``(params, opt_state,
      metrics)``: ``params`` from :func:`stack_stages`, ``opt_state`` from
      :func:`init_pipeline_opt_state`, ``batch = (inputs, targets)`` arrays
      with a leading batch axis of ``B`` examples (placed sharded over
      ``data_axis`` by the step). ``metrics``: ``loss`` (the batch's mean),
      ``stage_bytes`` (activations and cotangents one device sent between
      stages, mean over devices), ``wire_bytes`` (the gradient exchange, mean
      over devices; when ``tx`` reports bytes). ``step.lower`` as
      ``make_train_step``'s.

    Raises:
      ValueError: a mesh without the two axes; a ``stage_fns`` entry or
        ``loss_fn`` not callable; ``len(stage_fns)`` or the stacked stages not
        the stage axis' size; ``num_microbatches`` < 1. When the step is
        called: ``num_microbatches`` not dividing a replica's batch; a stage
        not returning one array with the micro-batch's examples on its leading
        axis; ``loss_fn`` not returning a scalar.

    Example:
      >>> import jax, jax.numpy as jnp, optax, jaxcomp
      >>> from jaxcomp import distributed as dist
      >>> mesh = jax.make_mesh((1, 1), ("stage", "data"))
      >>> stacked, stages = dist.stack_stages([{"w": jnp.ones((2, 1))}], mesh)
      >>> tx = optax.chain(dist.dense_exchange("data"), optax.sgd(0.1))
      >>> state = dist.init_pipeline_opt_state(tx, stacked, mesh)
      >>> step = dist.make_pipeline_train_step(
      ...     [lambda p, x: x @ p["w"]], stages, lambda y, t: jnp.mean((y - t) ** 2),
      ...     tx, mesh, num_microbatches=2)
      >>> batch = (jnp.ones((4, 2)), jnp.zeros((4, 1)))
      >>> stacked, state, metrics = step(stacked, state, batch)
      >>> float(metrics["loss"]), float(metrics["stage_bytes"])
      (4.0, 0.0)
    """
    _check_mesh(mesh, stage_axis, data_axis)
    if isinstance(stage_fns, str) or not isinstance(stage_fns, Sequence):
        raise ValueError(
            f"stage_fns must be a list of functions, one per stage, got {type(stage_fns).__name__}"
        )
    stage_fns = tuple(stage_fns)
    for s, fn in enumerate(stage_fns):
        if not callable(fn):
            raise ValueError(
                f"stage_fns[{s}] must be a function stage_fn(params, x) -> y, "
                f"got {type(fn).__name__}"
            )
    if not callable(loss_fn):
        raise ValueError(
            f"loss_fn must be a function loss_fn(outputs, targets) -> scalar, "
            f"got {type(loss_fn).__name__}"
        )
    if not isinstance(stages, PipelineStages):
        raise ValueError(
            f"stages must be the PipelineStages of stack_stages, got {type(stages).__name__}"
        )
    n_stages = mesh.shape[stage_axis]
    for name, count in (("stage_fns", len(stage_fns)), ("stages", stages.num_stages)):
        if count != n_stages:
            raise ValueError(
                f"make_pipeline_train_step: {name} has {count} stages, but the mesh axis "
                f"{stage_axis!r} has {n_stages} devices (one stage per row)"
            )
    cfg = _PipelineConfig(
        stage_fns=stage_fns,
        stages=stages,
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        num_microbatches=V.check_int("num_microbatches", num_microbatches, 1),
        stage_axis=stage_axis,
        data_axis=data_axis,
        unexchanged=V.check_choice("unexchanged", unexchanged, UNEXCHANGED),
        communicate=V.check_bool("communicate", communicate),
        schedule=V.check_choice("schedule", schedule, SCHEDULES),
    )
    return jit_step(
        functools.partial(_run, cfg),
        donate_argnums=(0, 1) if donate else (),
        arguments=functools.partial(_arguments, cfg),
    )


def _arguments(cfg: _PipelineConfig, params, opt_state, batch):
    """The jitted step's arguments from the user's (checked)."""
    if not isinstance(batch, tuple | list) or len(batch) != 2:
        raise ValueError("batch must be a pair (inputs, targets) of arrays")
    inputs, targets = batch
    n_batch = jnp.shape(inputs)[0] if jnp.ndim(inputs) else 0
    per_replica, rem = divmod(n_batch, cfg.num_data)
    if rem or per_replica == 0 or jnp.shape(targets)[:1] != (n_batch,):
        raise ValueError(
            f"batch: inputs and targets must have the same leading batch size, a positive "
            f"multiple of the {cfg.num_data} data replicas; got shapes {jnp.shape(inputs)} "
            f"and {jnp.shape(targets)}"
        )
    if per_replica % cfg.num_microbatches:
        raise ValueError(
            f"num_microbatches must divide each data replica's batch ({n_batch} / "
            f"{cfg.num_data} = {per_replica} examples), got {cfg.num_microbatches}"
        )
    lead = jax.tree.leaves(params)[0].shape[0] if jax.tree.leaves(params) else None
    if lead != cfg.num_stages:
        raise ValueError(
            f"params must be stacked for the {cfg.num_stages} stages (stack_stages), "
            f"got a leading axis of {lead}"
        )
    sharding = NamedSharding(cfg.mesh, P(cfg.data_axis))
    batch = tuple(jax.device_put(x, sharding) for x in (inputs, targets))
    return params, opt_state, batch


def _run(cfg: _PipelineConfig, params, opt_state, batch):
    """The jitted step: checks the state and what ``tx`` exchanges, then the per-device step."""
    layout = _layout(cfg.data_axis, cfg.stage_axis)
    check_stacked_state(
        opt_state,
        cfg.mesh,
        layout,
        who="make_pipeline_train_step",
        init="jaxcomp.distributed.init_pipeline_opt_state(tx, params, mesh)",
    )
    for path, leaf in jax.tree_util.tree_flatten_with_path(opt_state)[0]:
        if jnp.ndim(leaf) < 2 or jnp.shape(leaf)[1] != cfg.num_stages:
            raise ValueError(
                f"make_pipeline_train_step: opt_state leaf {jax.tree_util.keystr(path)} has "
                f"shape {jnp.shape(leaf)}, but the state must be stacked for (replica, stage): "
                f"({cfg.num_data}, {cfg.num_stages}, ...). Create it with "
                "jaxcomp.distributed.init_pipeline_opt_state(tx, params, mesh)."
            )
    local = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), params)
    paths = check_unexchanged(
        cfg.tx,
        local,
        cfg.data_mesh(),
        cfg.data_axis,
        policy=cfg.unexchanged,
        who="make_pipeline_train_step",
        why=", so a stage's replicas would diverge",
        remedy="Give every leaf an exchange (a compressor with axis_name, or "
        "jaxcomp.dense_exchange) or use unexchanged='mean'.",
    )
    stage, data = cfg.stage_axis, cfg.data_axis
    param_specs = jax.tree.map(lambda _: P(stage), params)
    sharded = shard_step(
        functools.partial(_per_device_step, cfg, dense_paths=frozenset(paths)),
        cfg.mesh,
        in_specs=(param_specs, P(data, stage), P(data)),
        out_specs=(param_specs, P(data, stage), P()),
        communicate=cfg.communicate,
    )
    return sharded(params, opt_state, batch)


def _activation_shapes(cfg: _PipelineConfig, inputs, targets):
    """A micro-batch's shapes entering each stage (``S + 1``: the last is the model's output).

    Checks what the schedule relies on: each stage returns one array with the
    micro-batch's examples on its leading axis, and ``loss_fn`` a scalar.
    """
    shapes = [inputs]
    x = inputs
    for s, fn in enumerate(cfg.stage_fns):
        y = jax.eval_shape(fn, cfg.stages.structures[s], x)
        if not isinstance(y, jax.ShapeDtypeStruct) or y.shape[:1] != inputs.shape[:1]:
            got = f"shape {y.shape}" if isinstance(y, jax.ShapeDtypeStruct) else type(y).__name__
            raise ValueError(
                f"stage_fns[{s}] must return one array keeping the micro-batch's "
                f"{inputs.shape[0]} examples on its leading axis (it got shape {x.shape}), "
                f"got {got}"
            )
        shapes.append(x := y)
    loss = jax.eval_shape(cfg.loss_fn, x, targets)
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        got = (
            f"shape {loss.shape}" if isinstance(loss, jax.ShapeDtypeStruct) else type(loss).__name__
        )
        raise ValueError(
            "loss_fn must return a scalar (the micro-batch's mean loss), got "
            f"{got} for outputs of shape {x.shape}"
        )
    return shapes


@dataclasses.dataclass(frozen=True)
class _Microbatches:
    """One device's view of the schedule: its micro-batches and the padded activations."""

    xs: Any  # (M, m, ...) inputs
    ys: Any  # (M, m, ...) targets
    boundary: list  # the activation stage s sends to s + 1 (per micro-batch)
    output: jax.ShapeDtypeStruct  # the last stage's output (per micro-batch)
    width: int  # padded activation elements per example
    dtype: Any  # the activations' common dtype

    @property
    def size(self) -> int:
        return self.xs.shape[1]

    def zeros(self):
        return jnp.zeros((self.size, self.width), self.dtype)


def _microbatches(cfg: _PipelineConfig, batch) -> _Microbatches:
    m = cfg.num_microbatches
    inputs, targets = batch
    xs = inputs.reshape(m, inputs.shape[0] // m, *inputs.shape[1:])
    ys = targets.reshape(m, targets.shape[0] // m, *targets.shape[1:])
    shapes = _activation_shapes(
        cfg,
        jax.ShapeDtypeStruct(xs.shape[1:], xs.dtype),
        jax.ShapeDtypeStruct(ys.shape[1:], ys.dtype),
    )
    boundary = shapes[1:-1]
    width = max([math.prod(a.shape[1:]) for a in boundary] or [1])
    dtype = jnp.result_type(*[a.dtype for a in boundary]) if boundary else jnp.float32
    return _Microbatches(xs, ys, boundary, shapes[-1], width, dtype)


def _masked_on_the_bubble(stage_fn):
    """``stage_fn(params, x)`` whose cotangents are zero, not ``0 * NaN``, where ``valid`` is False.

    A bubble tick runs the stage on the padding; a stage not finite there (``x
    / |x|`` on zeros) would make ``0 * NaN = NaN`` of its Jacobian, so the
    backward selects zero instead. The forward still runs (a ``lax.cond`` or
    an idle ``lax.switch`` branch per tick skips it but made GPipe's step
    about twice as slow on XLA:CPU); its possibly non-finite values reach only
    bubble ticks downstream, never a micro-batch or the loss.
    """

    @jax.custom_vjp
    def run(params, x, valid):
        return stage_fn(params, x)

    def forward(params, x, valid):
        out, vjp = jax.vjp(stage_fn, params, x)
        return out, (vjp, valid)

    def backward(residuals, g):
        vjp, valid = residuals
        keep = functools.partial(jnp.where, valid)
        d_params, d_x = vjp(g)
        zero = lambda t: keep(t, jnp.zeros_like(t))  # noqa: E731
        return jax.tree.map(zero, d_params), zero(d_x), None

    run.defvjp(forward, backward)
    return run


def _gpipe(cfg: _PipelineConfig, mbs: _Microbatches, local):
    """(loss, gradients) of this stage: GPipe, ``jax.grad`` of the forward scan."""
    n_stages, m = cfg.num_stages, cfg.num_microbatches
    forward_perm = [(i, i + 1) for i in range(n_stages - 1)]

    def loss_of(out, y):
        return jnp.asarray(cfg.loss_fn(out, y), jnp.float32)

    def branch(s):
        stage_fn = _masked_on_the_bubble(cfg.stage_fns[s])

        def run(local, received, x, y, valid):
            inp = x if s == 0 else _unpad(received, mbs.boundary[s - 1])
            out = stage_fn(cfg.stages.stage_params(s, local), inp, valid)
            if s == n_stages - 1:
                # Not on the bubble's padding (a loss may not be finite there, nor its gradient).
                loss = lax.cond(valid, loss_of, lambda *_: jnp.float32(0), out, y)
                return mbs.zeros(), loss
            return _pad(out, mbs.width, mbs.dtype), jnp.float32(0)

        return run

    branches = [branch(s) for s in range(n_stages)]
    s_index = lax.axis_index(cfg.stage_axis)

    def pipeline_loss(local):
        def tick(carry, t):
            received, total = carry
            x = mbs.xs[jnp.clip(t, 0, m - 1)]
            y = mbs.ys[jnp.clip(t - (n_stages - 1), 0, m - 1)]
            j = t - s_index  # this stage's micro-batch at tick t (the last stage's: the loss's)
            valid = (j >= 0) & (j < m)
            out, loss = lax.switch(s_index, branches, local, received, x, y, valid)
            if n_stages > 1:
                out = lax.ppermute(out, cfg.stage_axis, forward_perm)
            return (out, total + loss), None

        start = (mbs.zeros(), jnp.float32(0))
        (_, total), _ = lax.scan(tick, start, jnp.arange(schedule_ticks("gpipe", n_stages, m)))
        return total / m

    return jax.value_and_grad(pipeline_loss)(local)


def _one_forward_one_backward(cfg: _PipelineConfig, mbs: _Microbatches, local):
    """(loss, gradients) of this stage: 1F1B in lock-step ticks, the backward by hand.

    At tick ``t`` stage ``s`` runs the forward of micro-batch ``t - s`` and the
    backward of micro-batch ``t - (2 S - 2 - s)`` (the last stage: the same
    one, loss included), each when it exists; the backward recomputes the
    stage's forward from its stored input (``jax.vjp``). A stage stores the
    inputs of at most ``2 (S - s) - 1`` micro-batches: a ring of ``2 S - 1``.
    """
    n_stages, m = cfg.num_stages, cfg.num_microbatches
    last = n_stages - 1
    ring = 2 * n_stages - 1
    forward_perm = [(i, i + 1) for i in range(last)]
    backward_perm = [(i + 1, i) for i in range(last)]
    zero_grads = jax.tree.map(jnp.zeros_like, local)

    def stage_input(s, received, x):
        return x if s == 0 else _unpad(received, mbs.boundary[s - 1])

    def branch(s):
        fn = cfg.stage_fns[s]

        def apply(local, inp):
            return fn(cfg.stages.stage_params(s, local), inp)

        def forward(local, received, x):
            return _pad(apply(local, stage_input(s, received, x)), mbs.width, mbs.dtype)

        def backward(local, stored, x, y, cotangent):
            inp = stage_input(s, stored, x)
            if s == last:  # its forward, the loss and the backward of one micro-batch
                loss_fn = lambda p, i: jnp.asarray(cfg.loss_fn(apply(p, i), y), jnp.float32) / m  # noqa: E731
                if s == 0:
                    loss, g = jax.value_and_grad(loss_fn)(local, inp)
                    return loss, g, mbs.zeros()
                loss, (g, g_inp) = jax.value_and_grad(loss_fn, argnums=(0, 1))(local, inp)
                return loss, g, _pad(g_inp, mbs.width, mbs.dtype)
            cot = _unpad(cotangent, mbs.boundary[s])
            if s == 0:
                _, vjp = jax.vjp(lambda p: apply(p, inp), local)
                return jnp.float32(0), vjp(cot)[0], mbs.zeros()
            _, vjp = jax.vjp(apply, local, inp)
            g, g_inp = vjp(cot)
            return jnp.float32(0), g, _pad(g_inp, mbs.width, mbs.dtype)

        def run(local, received, x_f, valid_f, stored, x_b, y_b, cotangent, valid_b):
            out = mbs.zeros()
            if s != last:
                out = lax.cond(valid_f, forward, lambda *_: mbs.zeros(), local, received, x_f)
            loss, grads, back = lax.cond(
                valid_b,
                backward,
                lambda *_: (jnp.float32(0), zero_grads, mbs.zeros()),
                local,
                stored,
                x_b,
                y_b,
                cotangent,
            )
            return out, back, loss, grads

        return run

    branches = [branch(s) for s in range(n_stages)]
    s_index = lax.axis_index(cfg.stage_axis)

    def tick(carry, t):
        received, cotangent, stash, total, acc = carry
        j_f = t - s_index
        j_b = t - (2 * n_stages - 2 - s_index)
        valid_f = (j_f >= 0) & (j_f < m)
        valid_b = (j_b >= 0) & (j_b < m)
        stored = stash[jnp.mod(j_b, ring)]
        out, back, loss, grads = lax.switch(
            s_index,
            branches,
            local,
            received,
            mbs.xs[jnp.clip(j_f, 0, m - 1)],
            valid_f,
            # The last stage's backward is this tick's forward: its input was just received.
            jnp.where(s_index == last, received, stored),
            mbs.xs[jnp.clip(j_b, 0, m - 1)],
            mbs.ys[jnp.clip(j_b, 0, m - 1)],
            cotangent,
            valid_b,
        )
        # The slot of micro-batch j_f - ring, done: free whatever j_f is.
        stash = lax.dynamic_update_index_in_dim(stash, received, jnp.mod(j_f, ring), 0)
        if n_stages > 1:
            out = lax.ppermute(out, cfg.stage_axis, forward_perm)
            back = lax.ppermute(back, cfg.stage_axis, backward_perm)
        acc = jax.tree.map(jnp.add, acc, grads)
        return (out, back, stash, total + loss, acc), None

    stash = jnp.zeros((ring, mbs.size, mbs.width), mbs.dtype)
    start = (mbs.zeros(), mbs.zeros(), stash, jnp.float32(0), zero_grads)
    ticks = schedule_ticks("1f1b", n_stages, m)
    (_, _, _, total, grads), _ = lax.scan(tick, start, jnp.arange(ticks))
    return total, grads


def _per_device_step(cfg: _PipelineConfig, params, opt_state, batch, dense_paths):
    """One device's step inside ``shard_map``: the schedule's gradients, ``tx``, the update."""
    n_stages, m = cfg.num_stages, cfg.num_microbatches
    stage, data = cfg.stage_axis, cfg.data_axis
    mbs = _microbatches(cfg, batch)
    # This stage's parameters (its row); this device's state (its (data, stage) block).
    local = device_slice(params)
    state = device_slice(device_slice(opt_state))
    gradients = _gpipe if cfg.schedule == "gpipe" else _one_forward_one_backward
    loss, grads = gradients(cfg, mbs, to_varying(local, (stage, data)))
    grads, dense_wire = mean_leaves(grads, dense_paths, data)
    updates, state, wire = compress(
        cfg.tx, grads, state, local, {}, data, "make_pipeline_train_step"
    )
    local = optax.apply_updates(local, updates)
    local = cfg.stages._round_to_leaf_dtypes(lax.axis_index(stage), local)
    sent = stage_bytes(
        n_stages, m, mbs.size, mbs.width, jnp.dtype(mbs.dtype).itemsize, cfg.schedule
    )
    metrics = {
        # Only the last stage has a loss: the sum over stages is its value.
        "loss": lax.pmean(lax.psum(loss, stage), data),
        "stage_bytes": jnp.float32(sent),
    }
    if wire is not None or dense_paths:
        wire = dense_wire if wire is None else wire + dense_wire
        metrics["wire_bytes"] = lax.pmean(wire, (stage, data))
    return device_stack(local), device_stack(device_stack(state)), metrics


def _pad(x, width: int, dtype):
    """A micro-batch's activation flattened per example and zero-padded to ``width``."""
    flat = x.reshape(x.shape[0], -1).astype(dtype)
    return jnp.pad(flat, ((0, 0), (0, width - flat.shape[1])))


def _unpad(received, like: jax.ShapeDtypeStruct):
    """The inverse of :func:`_pad` for an activation shaped as ``like``."""
    size = math.prod(like.shape[1:])
    return received[:, :size].reshape(like.shape).astype(like.dtype)


def stage_bytes(
    num_stages: int,
    num_microbatches: int,
    microbatch: int,
    width: int,
    itemsize: int,
    schedule: str = "gpipe",
) -> float:
    """Bytes one device sends between stages per step, mean over the devices.

    ``2 T (S - 1) m A b / S`` for the schedule's ``T`` ticks
    (:func:`schedule_ticks`), micro-batches of ``m`` examples, activations
    padded to ``A`` elements of ``b`` bytes (see
    :mod:`jaxcomp.distributed.pipeline`): the forward activations and the
    backward cotangents, bubble ticks included.

    Example:
      >>> from jaxcomp.distributed import stage_bytes
      >>> stage_bytes(2, 4, microbatch=8, width=16, itemsize=4)  # 2 * 5 * 1 * 512 / 2
      2560.0
    """
    ticks = schedule_ticks(schedule, num_stages, num_microbatches)
    return 2 * ticks * (num_stages - 1) * microbatch * width * itemsize / num_stages
