"""The ensemble's members: their data shards, and their predictions combined.

:func:`jaxcomp.aggregation.make_ensemble_train_step` trains ``K = N`` models
at once, one per device, each on its own data; this module deals the data
(:func:`disjoint_shards`, :func:`member_batches`: disjoint shards, one per
member) and combines the trained members' predictions:
:func:`average_predictions` (the mean of the members' softmax
probabilities), :func:`majority_vote` (each member votes its arg-max class,
ties go to the lowest class) and :func:`evaluate_ensemble` (each member's
accuracy and the ensemble's). Host-side and jit-able functions of arrays; no
mesh. The names are also importable from :mod:`jaxcomp.aggregation`, their
earlier home.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxcomp.ensemble import ensemble_predict
  >>> logits = jnp.array([[[5.0, 0.0]], [[0.0, 1.0]], [[0.0, 1.0]]])
  >>> ensemble_predict(logits, "average").tolist(), ensemble_predict(logits, "vote").tolist()
  ([0], [1])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxcomp import _validation as V

__all__ = [
    "ENSEMBLE_METHODS",
    "EnsembleReport",
    "average_predictions",
    "disjoint_shards",
    "ensemble_predict",
    "evaluate_ensemble",
    "majority_vote",
    "member_batches",
    "member_logits",
]

# Combiners of evaluate_ensemble / ensemble_predict.
ENSEMBLE_METHODS = ("average", "vote")


def disjoint_shards(num_examples: int, num_members: int, seed: int = 0) -> list[np.ndarray]:
    """Disjoint index shards of equal size, one per member (a fixed permutation by ``seed``).

    The ``num_examples % num_members`` left-over examples are in no shard.

    Example:
      >>> from jaxcomp.ensemble import disjoint_shards
      >>> [len(s) for s in disjoint_shards(10, 3)]
      [3, 3, 3]
    """
    num_examples = V.check_int("num_examples", num_examples, 0)
    num_members = V.check_int("num_members", num_members, 1)
    seed = V.check_int("seed", seed, 0)
    order = np.random.default_rng(seed).permutation(num_examples)
    size = num_examples // num_members
    return [order[i * size : (i + 1) * size] for i in range(num_members)]


def member_batches(
    x: np.ndarray,
    y: np.ndarray,
    num_members: int,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One epoch of global batches in which member ``i``'s rows come from shard ``i`` only.

    The training set is split once into :func:`disjoint_shards` (by
    ``seed``); each epoch every shard is shuffled (by ``(seed, epoch)``) and
    each global batch is the concatenation of the members' next
    ``batch_size`` rows in member order, so :func:`jaxcomp.distributed.shard_batch`
    hands device ``i`` exactly its member's rows. The epoch has
    ``shard_size // batch_size`` full batches.

    Args:
      x, y: the training set (leading axis: examples).
      num_members: ``K``, the devices along the axis.
      batch_size: rows per member per step, >= 1.
      seed, epoch: the split and the shuffling.

    Yields:
      ``(x_batch, y_batch)`` with ``K * batch_size`` rows.

    Example:
      >>> import numpy as np
      >>> from jaxcomp.ensemble import member_batches
      >>> xb, yb = next(member_batches(np.arange(8.0), np.arange(8), 2, 2))
      >>> xb.shape
      (4,)
    """
    batch_size = V.check_int("batch_size", batch_size, 1)
    epoch = V.check_int("epoch", epoch, 0)
    if len(x) != len(y):
        raise ValueError(
            f"x and y must have the same number of examples (leading axis), got {len(x)} "
            f"and {len(y)}"
        )
    shards = disjoint_shards(len(y), num_members, seed)
    rng = np.random.default_rng([seed, epoch])
    shuffled = [s[rng.permutation(len(s))] for s in shards]
    for step in range(len(shards[0]) // batch_size):
        idx = np.concatenate([s[step * batch_size : (step + 1) * batch_size] for s in shuffled])
        yield x[idx], y[idx]


def average_predictions(logits) -> jax.Array:
    """Ensemble by averaging predictions: the mean of the members' softmax probabilities.

    Args:
      logits: ``[K, ..., C]``, member ``k``'s logits at index ``k``.

    Returns:
      ``[..., C]`` probabilities (float32 or wider).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ensemble import average_predictions
      >>> average_predictions(jnp.array([[[0.0, 0.0]], [[0.0, 0.0]]])).tolist()
      [[0.5, 0.5]]
    """
    logits = _check_logits(logits)
    # bf16/f16 probabilities round close classes together (and ties go to the
    # lowest index): compute in float32 or wider.
    logits = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
    return jnp.mean(jax.nn.softmax(logits, axis=-1), axis=0)


def majority_vote(logits) -> jax.Array:
    """Ensemble by majority voting: the class most members predict.

    Each member votes for its ``argmax`` class (ties within a member: the
    lowest class index); the class with the most votes wins, ties between
    classes going to the lowest class index.

    Args:
      logits: ``[K, ..., C]``.

    Returns:
      int32 ``[...]`` class indices.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ensemble import majority_vote
      >>> votes = jnp.array([[[0.0, 1.0, 0.0]], [[0.0, 0.0, 1.0]]])  # one vote each for 1 and 2
      >>> majority_vote(votes).tolist()
      [1]
    """
    logits = _check_logits(logits)
    num_classes = logits.shape[-1]
    votes = jnp.argmax(logits, axis=-1)  # first maximum: the lowest index
    counts = jnp.sum(jax.nn.one_hot(votes, num_classes, dtype=jnp.int32), axis=0)
    return jnp.argmax(counts, axis=-1).astype(jnp.int32)


def ensemble_predict(logits, method: str = "average") -> jax.Array:
    """The ensemble's class predictions: ``"average"`` (argmax of :func:`average_predictions`,
    ties to the lowest class index) or ``"vote"`` (:func:`majority_vote`).

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.ensemble import ensemble_predict
      >>> logits = jnp.array([[[5.0, 0.0]], [[0.0, 1.0]], [[0.0, 1.0]]])  # confident 0, two 1s
      >>> ensemble_predict(logits, "average").tolist(), ensemble_predict(logits, "vote").tolist()
      ([0], [1])
    """
    method = V.check_choice("method", method, ENSEMBLE_METHODS)
    if method == "vote":
        return majority_vote(logits)
    return jnp.argmax(average_predictions(logits), axis=-1).astype(jnp.int32)


def _check_logits(logits) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim < 2 or logits.shape[0] < 1 or logits.shape[-1] < 1:
        raise ValueError(
            "logits must have shape [K, ..., C] with K >= 1 members and C >= 1 classes, "
            f"got {logits.shape}"
        )
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be floating point, got {logits.dtype}")
    return logits


class EnsembleReport(NamedTuple):
    """Accuracy of each ensemble member and of the ensemble (:func:`evaluate_ensemble`).

    Attributes:
      member_accuracy: one accuracy per member, in member order.
      average_accuracy: the ensemble by averaged softmax probabilities.
      vote_accuracy: the ensemble by majority vote.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> apply = lambda w, x: x @ w  # a linear "model"
      >>> members = [jnp.eye(2), jnp.eye(2)[::-1], jnp.eye(2)]
      >>> report = evaluate_ensemble(apply, members, np.eye(2, dtype=np.float32), np.array([0, 1]))
      >>> report.member_accuracy, report.average_accuracy, report.vote_accuracy
      ((1.0, 0.0, 1.0), 1.0, 1.0)
    """

    member_accuracy: tuple[float, ...]
    average_accuracy: float
    vote_accuracy: float


def member_logits(apply_fn: Callable, members, x, *, batch_size: int | None = None) -> np.ndarray:
    """Every member's logits on ``x``: numpy ``[K, B, C]``.

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, C]`` (e.g. ``model.apply``).
      members: the members' parameters: one pytree whose leaves have a leading
        member axis ``K`` (what :func:`make_ensemble_train_step` trains), or a
        Python ``list`` of ``K`` parameter pytrees.
      x: the inputs.
      batch_size: evaluate in chunks of this many inputs (None: all at once).

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> apply = lambda p, x: x @ p["w"]
      >>> members = {"w": jnp.stack([jnp.eye(2), 2 * jnp.eye(2)])}  # K = 2 members
      >>> member_logits(apply, members, np.array([[1.0, 2.0]], np.float32)).tolist()
      [[[1.0, 2.0]], [[2.0, 4.0]]]
    """
    if isinstance(members, list):
        if not members:
            raise ValueError("members must not be an empty list")
        members = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
    batch_size = V.check_int("batch_size", batch_size, 1, allow_none=True)
    fn = jax.jit(jax.vmap(apply_fn, in_axes=(0, None)))
    n = len(x)
    step = max(n, 1) if batch_size is None else batch_size  # empty x: one empty chunk
    parts = [np.asarray(fn(members, x[i : i + step])) for i in range(0, max(n, 1), step)]
    return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def evaluate_ensemble(
    apply_fn: Callable, members, x, y, *, batch_size: int | None = None
) -> EnsembleReport:
    """Accuracy of each member and of the ensemble (averaged probabilities, majority vote).

    Args:
      apply_fn: ``apply_fn(params, x) -> logits [B, C]``.
      members: stacked member parameters or a list of them (:func:`member_logits`).
      x: inputs ``[B, ...]``.
      y: integer labels ``[B]``.
      batch_size: evaluate in chunks (None: all at once).

    Returns:
      An :class:`EnsembleReport`.

    Raises:
      ValueError: empty ``x``, or ``y`` not one label per input.

    Example:
      >>> import jax.numpy as jnp, numpy as np
      >>> from jaxcomp.ensemble import evaluate_ensemble
      >>> apply = lambda w, x: x @ w  # a linear "model"
      >>> members = [jnp.eye(2), jnp.eye(2)[::-1], jnp.eye(2)]
      >>> report = evaluate_ensemble(apply, members, np.eye(2, dtype=np.float32), np.array([0, 1]))
      >>> report.member_accuracy, report.vote_accuracy
      ((1.0, 0.0, 1.0), 1.0)
    """
    if len(x) == 0:
        raise ValueError("evaluate_ensemble: x is empty (no inputs), so there is no accuracy")
    logits = member_logits(apply_fn, members, x, batch_size=batch_size)
    y = np.asarray(y)
    if logits.shape[1:-1] != y.shape:
        raise ValueError(
            f"y must have shape {logits.shape[1:-1]} (one label per input), got {y.shape}"
        )
    member = tuple(float(np.mean(np.argmax(lg, axis=-1) == y)) for lg in logits)
    average = float(np.mean(np.asarray(ensemble_predict(logits, "average")) == y))
    vote = float(np.mean(np.asarray(ensemble_predict(logits, "vote")) == y))
    return EnsembleReport(member, average, vote)
