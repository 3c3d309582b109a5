"""Data-parallel sampling modes: which examples and features each device sees.

The patent's framework (docs/algorithms.md section 6) splits data-parallel
training *by sample*, with global shuffling, sampling with replacement or
local shuffling, and *by feature dimension*. This module holds the host-side
(numpy, seeded, deterministic per epoch) index plans that any training loop
can use, and the one device-side operation feature slicing needs.

By sample, each function returns one epoch's plan as an int array of shape
``(steps, num_devices, per_device_batch)``: ``plan[s, d]`` are the training
examples device ``d`` draws at step ``s``. ``plan[s].reshape(-1)`` is the
step's global batch in the layout ``jaxcomp.distributed.shard_batch`` splits
(device ``d`` gets rows ``[d * b, (d + 1) * b)``), so a loop that feeds
``x[plan[s].reshape(-1)]`` to a data-parallel step gives every device exactly
its draws. Every epoch has ``num_examples // batch_size`` steps, as with
global shuffling, and the plan is a function of ``(seed, epoch)`` only, so a
run resumed at an epoch boundary draws what an uninterrupted one would.

- :func:`global_shuffle`: one permutation of the whole training set per
  epoch, cut into global batches (what ``experiments/data.py`` has always
  done, bit for bit: ``np.random.default_rng([seed, epoch]).permutation``).
- :func:`with_replacement`: every device draws its examples i.i.d. uniformly
  from the **whole** training set, from its own random stream. (Drawing from
  the device's own shard instead would be local shuffling's data placement
  with bootstrap order; the patent's "sampling with replacement" is over the
  data, and drawing from all of it keeps each device's gradient an unbiased
  estimate of the full one.)
- :func:`local_shuffle`: the training set is split once (per seed) into
  ``num_devices`` fixed random shards (:func:`local_shards`); every epoch each
  device shuffles only its own shard and never sees another's examples.

By feature, :func:`feature_slices` splits the input features into contiguous
balanced slices, :func:`split_features` / :func:`join_features` stack and
unstack per-device slices (zero-padded to one size, so they can be one array
sharded over the mesh axis), and :func:`feature_parallel_dense` is the
model-parallel first layer ``x @ W`` computed from the slices inside
``jax.shard_map``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxcomp._vma import axis_name_tuple, varying_axes, vma_checked

__all__ = [
    "SAMPLE_MODES",
    "epoch_indices",
    "feature_parallel_dense",
    "feature_slices",
    "global_shuffle",
    "join_features",
    "local_shards",
    "local_shuffle",
    "split_features",
    "with_replacement",
]

# The by-sample modes of epoch_indices (feature slicing is a layout, not a draw).
SAMPLE_MODES = ("global", "replacement", "local")

# Domains of the random streams (SeedSequence spawn keys): global shuffling uses
# the plain SeedSequence([seed, epoch]) of the original data loader, whose spawn
# key is empty, so these streams can never coincide with it or with each other.
_REPLACEMENT = 1
_LOCAL = 2
_PARTITION = 3


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value}")
    return int(value)


def _check_plan(num_examples, batch_size, num_devices, seed, epoch) -> tuple[int, int, int]:
    """Validated ``(steps, num_devices, per_device_batch)`` of an epoch's plan."""
    n = _check_int("num_examples", num_examples, 1)
    batch = _check_int("batch_size", batch_size, 1)
    devices = _check_int("num_devices", num_devices, 1)
    _check_int("seed", seed, 0)
    _check_int("epoch", epoch, 0)
    if batch % devices:
        raise ValueError(
            f"batch_size={batch} must be divisible by num_devices={devices} (every device "
            "draws batch_size / num_devices examples per step)"
        )
    if batch > n:
        raise ValueError(
            f"batch_size must be in [1, num_examples={n}] (an epoch has "
            f"num_examples // batch_size steps), got {batch}"
        )
    return n // batch, devices, batch // devices


def _rng(entropy, domain: int, device: int = 0) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(entropy, spawn_key=(domain, device)))


def global_shuffle(
    num_examples: int, batch_size: int, num_devices: int, *, seed: int, epoch: int
) -> np.ndarray:
    """One epoch of global shuffling: a permutation of the training set, cut into batches.

    Device ``d`` gets rows ``[d * b, (d + 1) * b)`` of each global batch; the
    last ``num_examples % batch_size`` examples of the permutation are
    dropped (static shapes). The global batches do not depend on
    ``num_devices``.

    Args:
      num_examples: training set size.
      batch_size: global batch size, divisible by ``num_devices``.
      num_devices: devices sharing each batch.
      seed: the run's seed (>= 0).
      epoch: 0-based epoch (>= 0).

    Returns:
      int64 ``(num_examples // batch_size, num_devices, batch_size // num_devices)``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> from jaxcomp.sampling import global_shuffle
      >>> plan = global_shuffle(10, 4, 2, seed=0, epoch=0)
      >>> plan.shape
      (2, 2, 2)
      >>> len(set(plan.ravel().tolist()))  # no example twice in an epoch
      8
    """
    steps, devices, per = _check_plan(num_examples, batch_size, num_devices, seed, epoch)
    order = np.random.default_rng([seed, epoch]).permutation(num_examples)
    return order[: steps * batch_size].reshape(steps, devices, per)


def with_replacement(
    num_examples: int, batch_size: int, num_devices: int, *, seed: int, epoch: int
) -> np.ndarray:
    """One epoch of sampling with replacement: i.i.d. uniform draws from the whole set.

    Device ``d`` draws from its own stream (a function of ``seed``, ``epoch``
    and ``d``), so devices draw independently of each other and of how many
    there are; an example can repeat within a step, a device and an epoch,
    and some are not drawn at all (about ``1/e`` of them per epoch).

    Args:
      num_examples: training set size (draws are in ``[0, num_examples)``).
      batch_size: global batch size, divisible by ``num_devices``, at most
        ``num_examples``.
      num_devices: devices sharing each batch.
      seed: the run's seed (>= 0).
      epoch: 0-based epoch (>= 0).

    Returns:
      int64 ``(num_examples // batch_size, num_devices, batch_size // num_devices)``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> from jaxcomp.sampling import with_replacement
      >>> plan = with_replacement(10, 4, 2, seed=0, epoch=0)
      >>> plan.shape, bool(plan.min() >= 0 and plan.max() < 10)
      ((2, 2, 2), True)
    """
    steps, devices, per = _check_plan(num_examples, batch_size, num_devices, seed, epoch)
    plan = [
        _rng([seed, epoch], _REPLACEMENT, d).integers(0, num_examples, size=(steps, per))
        for d in range(devices)
    ]
    return np.stack(plan, axis=1).astype(np.int64)


def local_shards(num_examples: int, num_devices: int, *, seed: int) -> tuple[np.ndarray, ...]:
    """The fixed partition of local shuffling: ``num_devices`` disjoint random shards.

    A random permutation of the training set (a function of ``seed`` only,
    the same every epoch) split into balanced pieces (sizes differ by at most
    one), each sorted.

    Args:
      num_examples: training set size.
      num_devices: number of shards, in ``[1, num_examples]``.
      seed: the run's seed (>= 0).

    Returns:
      ``num_devices`` sorted int64 arrays that partition ``range(num_examples)``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> from jaxcomp.sampling import local_shards
      >>> [len(s) for s in local_shards(10, 3, seed=0)]
      [4, 3, 3]
    """
    n = _check_int("num_examples", num_examples, 1)
    devices = _check_int("num_devices", num_devices, 1)
    _check_int("seed", seed, 0)
    if devices > n:
        raise ValueError(f"num_devices must be in [1, num_examples={n}], got {devices}")
    order = _rng([seed], _PARTITION).permutation(n)
    return tuple(np.sort(s).astype(np.int64) for s in np.array_split(order, devices))


def local_shuffle(
    num_examples: int, batch_size: int, num_devices: int, *, seed: int, epoch: int
) -> np.ndarray:
    """One epoch of local shuffling: each device permutes only its own fixed shard.

    Device ``d`` walks a fresh permutation of ``local_shards(...)[d]`` (its
    own stream, a function of ``seed``, ``epoch`` and ``d``) in batches of
    ``b = batch_size // num_devices``. The epoch has ``num_examples //
    batch_size`` steps (the smallest shard holds at least ``steps * b``
    examples), so a device drops the few examples of its shard that do not
    fill a batch, different ones each epoch.

    Args:
      num_examples: training set size.
      batch_size: global batch size, divisible by ``num_devices``, at most
        ``num_examples``.
      num_devices: devices (one shard each).
      seed: the run's seed (>= 0); it also fixes the shards.
      epoch: 0-based epoch (>= 0).

    Returns:
      int64 ``(num_examples // batch_size, num_devices, batch_size // num_devices)``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> from jaxcomp.sampling import local_shards, local_shuffle
      >>> plan = local_shuffle(8, 4, 2, seed=0, epoch=0)
      >>> shards = local_shards(8, 2, seed=0)
      >>> [sorted(plan[:, d].ravel().tolist()) == shards[d].tolist() for d in range(2)]
      [True, True]
    """
    steps, devices, per = _check_plan(num_examples, batch_size, num_devices, seed, epoch)
    shards = local_shards(num_examples, devices, seed=seed)
    plan = [
        _rng([seed, epoch], _LOCAL, d).permutation(shard)[: steps * per].reshape(steps, per)
        for d, shard in enumerate(shards)
    ]
    return np.stack(plan, axis=1)


_PLANS = {"global": global_shuffle, "replacement": with_replacement, "local": local_shuffle}


def epoch_indices(
    mode: str, num_examples: int, batch_size: int, num_devices: int, *, seed: int, epoch: int
) -> np.ndarray:
    """One epoch's plan of a by-sample mode: ``"global"``, ``"replacement"`` or ``"local"``.

    Dispatches to :func:`global_shuffle`, :func:`with_replacement` or
    :func:`local_shuffle` (same arguments and result).

    Raises:
      ValueError: an unknown ``mode`` or an argument out of its range.

    Example:
      >>> import numpy as np
      >>> from jaxcomp.sampling import epoch_indices, global_shuffle
      >>> a = epoch_indices("global", 10, 4, 2, seed=1, epoch=3)
      >>> bool(np.array_equal(a, global_shuffle(10, 4, 2, seed=1, epoch=3)))
      True
    """
    if not isinstance(mode, str) or mode not in _PLANS:
        raise ValueError(f"mode must be one of {', '.join(SAMPLE_MODES)}, got {mode!r}")
    return _PLANS[mode](num_examples, batch_size, num_devices, seed=seed, epoch=epoch)


def feature_slices(num_features: int, num_devices: int) -> tuple[slice, ...]:
    """Contiguous balanced slices of the feature dimension, one per device.

    The first ``num_features % num_devices`` slices hold one feature more
    (``np.array_split``'s rule); together they cover every feature once.

    Args:
      num_features: features of the input, >= 1.
      num_devices: devices, in ``[1, num_features]`` (every device holds at
        least one feature).

    Returns:
      ``num_devices`` ``slice`` objects with integer ``start`` and ``stop``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> from jaxcomp.sampling import feature_slices
      >>> [(s.start, s.stop) for s in feature_slices(10, 4)]
      [(0, 3), (3, 6), (6, 8), (8, 10)]
    """
    f = _check_int("num_features", num_features, 1)
    devices = _check_int("num_devices", num_devices, 1)
    if devices > f:
        raise ValueError(
            f"num_devices must be in [1, num_features={f}] (every device holds at least one "
            f"feature), got {devices}"
        )
    base, extra = divmod(f, devices)
    bounds = np.cumsum([0] + [base + (d < extra) for d in range(devices)])
    return tuple(slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:], strict=True))


def _axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis must be in [{-ndim}, {ndim}) for a {ndim}-d array, got {axis}")
    return axis % ndim


def split_features(a, num_devices: int, axis: int = -1) -> np.ndarray:
    """Stacks the :func:`feature_slices` of ``a`` along ``axis`` into one array, zero-padded.

    Device ``d``'s slice becomes ``out[d]``, padded with zeros up to the
    largest slice, so the stack can be placed with ``PartitionSpec(axis)``
    (one slice per device). Zero inputs times zero weights add nothing to
    :func:`feature_parallel_dense`, and a zero-padded input column gives its
    padded weight row a zero gradient.

    Args:
      a: an array whose ``axis`` is the feature dimension (inputs ``(B, F)``
        with ``axis=-1``, a first-layer kernel ``(F, H)`` with ``axis=0``).
      num_devices: devices, in ``[1, F]``.
      axis: the feature axis of ``a``.

    Returns:
      numpy ``(num_devices, *a.shape)`` with ``axis`` of size ``ceil(F / num_devices)``.

    Raises:
      ValueError: an argument out of its range (named in the message).

    Example:
      >>> import numpy as np
      >>> from jaxcomp.sampling import split_features
      >>> split_features(np.arange(5.0), 2).tolist()
      [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]
    """
    a = np.asarray(a)
    axis = _axis(axis, a.ndim)
    slices = feature_slices(a.shape[axis], num_devices)
    width = slices[0].stop - slices[0].start
    out = np.zeros((len(slices), *a.shape[:axis], width, *a.shape[axis + 1 :]), a.dtype)
    for d, s in enumerate(slices):
        index = (d, *(slice(None),) * axis, slice(0, s.stop - s.start))
        out[index] = np.take(a, np.arange(s.start, s.stop), axis=axis)
    return out


def join_features(stacked, num_features: int, axis: int = -1) -> np.ndarray:
    """The inverse of :func:`split_features`: the slices concatenated, padding dropped.

    Args:
      stacked: ``(num_devices, ...)`` as :func:`split_features` returns.
      num_features: the feature count of the original array.
      axis: the feature axis of the original array (of ``stacked[0]``).

    Returns:
      numpy array with ``num_features`` along ``axis``.

    Raises:
      ValueError: a shape that :func:`split_features` cannot have made.

    Example:
      >>> import numpy as np
      >>> from jaxcomp.sampling import join_features, split_features
      >>> join_features(split_features(np.arange(5.0), 2), 5).tolist()
      [0.0, 1.0, 2.0, 3.0, 4.0]
    """
    stacked = np.asarray(stacked)
    if stacked.ndim < 2:
        raise ValueError(f"stacked must be (num_devices, ...) with ndim >= 2, got {stacked.shape}")
    axis = _axis(axis, stacked.ndim - 1)
    slices = feature_slices(num_features, stacked.shape[0])
    width = slices[0].stop - slices[0].start
    if stacked.shape[axis + 1] != width:
        raise ValueError(
            f"stacked holds slices of {stacked.shape[axis + 1]} features along axis {axis}; "
            f"{num_features} features over {stacked.shape[0]} devices need {width}"
        )
    parts = [
        np.take(stacked[d], np.arange(s.stop - s.start), axis=axis) for d, s in enumerate(slices)
    ]
    return np.concatenate(parts, axis=axis)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _sum_over_slices(partial, axis_name):
    return lax.psum(partial, axis_name)


def _sum_fwd(partial, axis_name):
    return lax.psum(partial, axis_name), None


def _sum_bwd(axis_name, res, ct):
    del res
    # Every device holds the same cotangent of the sum (the layers after it
    # run replicated), and d(sum_j p_j)/d p_i is the identity: the slice's
    # gradient is the local cotangent. The default transpose of psum under
    # check_vma=False is another psum, N times too large. With check_vma=True
    # the cotangent is typed invariant and the slice's must be varying.
    if vma_checked(axis_name):
        missing = tuple(a for a in axis_name_tuple(axis_name) if a not in varying_axes(ct))
        if missing:
            ct = lax.pcast(ct, missing, to="varying")
    return (ct,)


_sum_over_slices.defvjp(_sum_fwd, _sum_bwd)


def feature_parallel_dense(x: jax.Array, kernel: jax.Array, axis_name) -> jax.Array:
    """The model-parallel dense layer ``x @ W`` from per-device feature slices.

    Inside ``jax.shard_map``, device ``i`` holds ``x[..., slice_i]`` (all the
    examples, its features) and ``W[slice_i, :]``; the result
    ``sum_i x[..., slice_i] @ W[slice_i, :]`` (a ``psum`` over ``axis_name``)
    is the full product on every device. Its gradient w.r.t. the local
    kernel slice is that slice's own, ``x[..., slice_i].T @ dL/dy``, provided
    everything after this layer is computed identically on every device (so
    ``dL/dy`` is the same everywhere), with ``check_vma`` on or off: the
    backward pass does not sum the cotangent over devices again.

    Args:
      x: this device's input slice ``(..., F_i)``.
      kernel: this device's kernel slice ``(F_i, H)``.
      axis_name: the mesh axis the features are sliced over.

    Returns:
      ``(..., H)``, the same on every device.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import NamedSharding, PartitionSpec as P
      >>> from jaxcomp.sampling import feature_parallel_dense, split_features
      >>> mesh = jax.make_mesh((1,), ("data",))
      >>> x, w = np.ones((1, 2), np.float32), np.array([[1.0], [2.0]], np.float32)
      >>> put = lambda a: jax.device_put(a, NamedSharding(mesh, P("data")))
      >>> xs, ws = put(split_features(x, 1, axis=1)), put(split_features(w, 1, axis=0))
      >>> f = jax.shard_map(lambda x, w: feature_parallel_dense(x[0], w[0], "data"),
      ...                   mesh=mesh, in_specs=P("data"), out_specs=P())
      >>> f(xs, ws).tolist()
      [[3.0]]
    """
    partial = jnp.matmul(x, kernel)
    return _sum_over_slices(partial, axis_name)
