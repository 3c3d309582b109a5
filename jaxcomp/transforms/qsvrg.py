"""QSVRG: quantized stochastic variance-reduced gradient (Alistarh et al., 2017, section 3.3).

QSGD's variance-reduced variant for a finite sum ``f(x) = mean_j f_j(x)``
split over ``N`` devices. Epoch ``p`` of length ``T``:

1. snapshot ``y = x``; every device computes the full gradient of its own
   data at ``y`` and the devices average it *unquantized* (dense all-reduce):
   ``H = grad f(y)``;
2. ``T`` inner steps: device ``i`` samples a minibatch ``b`` of its data and
   forms ``v_i = grad f_b(x) - grad f_b(y) + H`` (unbiased for ``grad f(x)``,
   with variance that vanishes as ``x`` and ``y`` approach the optimum);
   it sends ``Q_s(v_i)`` (QSGD, unbiased, no error feedback); every device
   applies ``x <- x - lr * mean_i Q_s(v_i)``;
3. the next snapshot is the last iterate (``average=False``) or the mean of
   the epoch's iterates ``x_1 .. x_T`` (``average=True``, the paper's choice
   for its proof: ``y^(p+1) = (1/T) sum_{t=1..T} x_t^(p)`` with ``x_1 = y^(p)``).

Paper mode (``variant="paper"``, the algorithm exactly as section 3.3 states
it, for reproducing Theorem 3.6): ``Q~(v) = Q(v, sqrt(n))``, one quantizer
with ``s = ceil(sqrt(n))`` levels for the whole ``n``-parameter vector (the
ceiling keeps Lemma 3.1's variance bound ``min(n/s^2, sqrt(n)/s) <= 1``, so
``E||Q~(v)||^2 <= 2 ||v||^2``), no bucketing, the ``l2`` norm. The driver's
options complete it: ``average=True`` and ``batch_size=1`` (one example
``j`` per device and step). Theorem 3.6 then bounds each device's
communication per epoch by ``(F + 2.8 n)(T + 1) + F n`` bits (``F = 32``,
:func:`jaxcomp.coding.qsvrg_epoch_bits_bound`), counting the Elias-coded
messages of Theorem 3.2; our packed messages spend
``1 + ceil(log2(s + 1))`` bits per value, more than ``2.8`` once
``n >= 16`` (``experiments.qsvrg --variant=paper`` prints both).
The default mode keeps QSGD's practical knobs (``bits``/``levels``,
buckets, the max norm): a fixed ``s`` independent of the model size, as
QSGD's experiments use, since ``s = sqrt(n)`` grows with the model and
packs into ``log2(sqrt(n))`` bits per value.

For ``mu``-strongly convex ``f`` with ``L``-smooth ``f_j``, a step
``lr = O(1 / L)`` and ``T = O(L / mu)``, the paper proves linear convergence:
the expected suboptimality shrinks by a constant factor per epoch, while
quantized SGD with a constant step stalls at a noise floor.

Two pieces: :func:`qsvrg`, an optax transform for step 2 (it receives the
snapshot's minibatch gradient and the full gradient as extra arguments of
``update``), and :func:`jaxcomp.distributed.make_qsvrg_epoch`, a small driver
that runs whole epochs (1-3) inside one jitted ``shard_map`` program.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from jaxcomp import _validation as V
from jaxcomp.quantization import qsgd_levels, qsgd_quantizer
from jaxcomp.transforms.quantize import quantize

__all__ = ["QSVRG_VARIANTS", "qsvrg", "qsvrg_paper_levels"]

#: ``variant=`` of :func:`qsvrg`: ``"default"`` (QSGD's practical codec
#: options) or ``"paper"`` (section 3.3 exactly: ``s = ceil(sqrt(n))``).
QSVRG_VARIANTS = ("default", "paper")


def qsvrg_paper_levels(n: int) -> int:
    """The paper mode's ``s = ceil(sqrt(n))`` for an ``n``-parameter model (``n >= 1``).

    Example:
      >>> qsvrg_paper_levels(32), qsvrg_paper_levels(49), qsvrg_paper_levels(1)
      (6, 7, 1)
    """
    n = V.check_int("n", n, 1)
    return max(1, math.isqrt(n - 1) + 1)


def qsvrg(
    learning_rate: float | Callable,
    *,
    levels: int | None = None,
    bits: int | None = None,
    bucket_size: int | None = None,
    norm: str = "l2",
    axis_name: Any = None,
    min_dense_size: int | None = None,
    seed: int = 0,
    variant: str = "default",
    keep_message: bool = False,
) -> optax.GradientTransformationExtraArgs:
    """QSVRG's inner step: ``-lr * mean_i Q_s(g_i - snapshot_grads_i + full_grad)``.

    ``update(grads, state, params=None, *, snapshot_grads, full_grad, include=None)``:
    ``grads`` is this device's minibatch gradient at the current point,
    ``snapshot_grads`` the gradient of *the same minibatch* at the epoch's
    snapshot, ``full_grad`` the full gradient at the snapshot averaged over
    all devices (the same on every device; exchanged dense once per epoch,
    which :func:`jaxcomp.distributed.make_qsvrg_epoch` does). The variance-reduced gradient is
    quantized with QSGD's codec (:func:`jaxcomp.quantization.qsgd_quantizer`,
    unbiased, no error feedback) and exchanged by
    :func:`jaxcomp.transforms.quantize.quantize` (all-gather of the packed
    messages, identical mean on every device). ``include`` (optional bool
    scalar, this device's backup-worker flag): a left-out device's message is
    dropped and the mean is over the included devices (each device's
    variance-reduced gradient is unbiased on its own).

    Args:
      learning_rate: ``lr > 0`` or an optax schedule of the step count; a
        traced scalar too (``optax.inject_hyperparams``: only arithmetic
        uses it, so it can change between steps without recompiling).
      levels, bits: QSGD's ``s`` or ``s = 2**bits``; give exactly one.
      bucket_size, norm: QSGD's bucketing and scale (see :func:`jaxcomp.qsgd`).
      axis_name: mesh axis to average over (None: one device).
      min_dense_size: leaves with at most this many elements are sent dense
        (None: 0).
      seed: seed of the quantizer's random stream.
      variant: one of :data:`QSVRG_VARIANTS`. ``"paper"``: section 3.3's
        ``Q(v, sqrt(n))``, ``s = ceil(sqrt(n))`` with ``n`` the number of
        parameters of the whole tree (known at ``init``/``update``), each
        leaf scaled by its own ``l2`` norm (one leaf: the paper's single
        vector exactly); ``levels``, ``bits`` and ``bucket_size`` must be
        None and ``norm`` ``"l2"``. Run it with
        ``make_qsvrg_epoch(..., batch_size=1, average=True)``.
      keep_message: keep this device's last packed message in the state
        (``QuantizeState.message``) for
        :func:`jaxcomp.coding.coded_message_bytes` (its Elias-coded size).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state is the
      quantizer's :class:`jaxcomp.QuantizeState` (``message_bytes``,
      ``wire_bytes``, ...); updates are added to the parameters.

    Raises:
      ValueError: a bad argument (named), or ``update`` without
        ``snapshot_grads``/``full_grad`` or with trees unlike ``grads``.

    Example:
      >>> import jax.numpy as jnp
      >>> from jaxcomp.transforms.qsvrg import qsvrg
      >>> tx = qsvrg(0.5, levels=2**20)  # fine levels: Q(v) ~ v
      >>> g = {"w": jnp.array([1.0, 2.0])}
      >>> u, _ = tx.update(g, tx.init(g), snapshot_grads={"w": jnp.array([1.0, 1.0])},
      ...                  full_grad={"w": jnp.array([0.5, 0.0])})
      >>> [round(float(x), 3) for x in u["w"]]  # -0.5 * (g - snapshot + full)
      [-0.25, -0.5]
    """
    traced_lr = isinstance(learning_rate, jax.core.Tracer)
    if not callable(learning_rate):
        # A static value becomes a Python float (weakly typed: the update keeps the
        # gradient dtype); a traced one (inject_hyperparams) cannot be range-checked.
        learning_rate = V.check_real(
            "learning_rate", learning_rate, 0.0, low_open=True, allow_traced=traced_lr
        )
    variant = V.check_choice("variant", variant, QSVRG_VARIANTS)
    who = "jaxcomp.qsvrg"
    options = dict(
        axis_name=axis_name,
        error_feedback=False,
        min_dense_size=min_dense_size,
        seed=seed,
        keep_message=keep_message,
    )
    if variant == "paper":
        for name, value in (("levels", levels), ("bits", bits), ("bucket_size", bucket_size)):
            if value is not None:
                raise ValueError(
                    f"{who}: variant='paper' sets s = ceil(sqrt(n)) over the whole "
                    f"vector; {name} must be None, got {value!r}"
                )
        if norm != "l2":
            raise ValueError(
                f"{who}: variant='paper' scales by the l2 norm; norm must be 'l2', got {norm!r}"
            )
        # Validate the remaining options now, not at the first init.
        quantize(qsgd_quantizer(1), **options)
    else:
        fixed = quantize(qsgd_quantizer(qsgd_levels(levels, bits), bucket_size, norm), **options)

    def inner_for(tree):
        """The quantizing exchange for ``tree`` (paper mode: ``s`` from its size)."""
        if variant != "paper":
            return fixed
        n = sum(int(x.size) for x in jax.tree.leaves(tree))
        return quantize(qsgd_quantizer(qsvrg_paper_levels(max(n, 1))), **options)

    def init(params):
        return inner_for(params).init(params)

    def update(
        updates, state, params=None, *, snapshot_grads=None, full_grad=None, include=None, **extra
    ):
        del params, extra
        if snapshot_grads is None or full_grad is None:
            raise ValueError(
                f"{who}: update needs snapshot_grads= (this minibatch's gradient at the "
                "snapshot) and full_grad= (the full gradient at the snapshot, averaged over "
                "the devices); see jaxcomp.distributed.make_qsvrg_epoch"
            )
        V.check_tree_like(snapshot_grads, updates, f"{who} (snapshot_grads)")
        V.check_tree_like(full_grad, updates, f"{who} (full_grad)")
        v = jax.tree.map(
            lambda g, gs, h: (g - gs.astype(g.dtype)) + h.astype(g.dtype),
            updates,
            snapshot_grads,
            full_grad,
        )
        # Each device's v is unbiased for grad f(x) on its own, so the mean over the
        # included devices (the quantizer's backup-worker exchange) is still unbiased.
        mean, state_new = inner_for(updates).update(v, state, include=include)
        count = state.step
        if callable(learning_rate) or traced_lr:
            if callable(learning_rate):
                step = -jnp.asarray(learning_rate(count), jnp.float32)
            else:  # injected: in its own dtype (float64 ones stay exact under x64)
                step = -learning_rate
            out = jax.tree.map(lambda m: step.astype(m.dtype) * m, mean)
        else:
            out = jax.tree.map(lambda m: -learning_rate * m, mean)
        return out, state_new

    return optax.GradientTransformationExtraArgs(init, update)
