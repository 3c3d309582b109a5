"""Shared data generators and numpy references for the selector and conformance tests."""

from __future__ import annotations

import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from experiments import presets
from jaxcomp.selection import selectors

# ---------------------------------------------------------------------------
# Data (numpy, float32 unless cast).
# ---------------------------------------------------------------------------


def laplacian(n: int, seed: int, mean: float = 5e-4, std: float = 5e-3) -> np.ndarray:
    """The LDTE-BS paper's test data: Laplace with the given mean and std."""
    rng = np.random.default_rng(seed)
    return rng.laplace(mean, std / math.sqrt(2.0), size=n).astype(np.float32)


def mixture(n: int, seed: int) -> np.ndarray:
    """90% N(0, 1e-4) + 10% Laplace(0, 5e-3), shuffled."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0.0, 1e-4, size=n)
    heavy = rng.random(n) < 0.1
    x[heavy] = rng.laplace(0.0, 5e-3, size=int(heavy.sum()))
    return x.astype(np.float32)


def mostly_zeros(n: int, seed: int) -> np.ndarray:
    """99% exact zeros, exactly ``int(0.01 n)`` Laplace nonzeros."""
    rng = np.random.default_rng(seed)
    x = np.zeros(n, np.float32)
    m = int(0.01 * n)
    idx = rng.choice(n, size=m, replace=False)
    vals = rng.laplace(0.0, 5e-3, size=m)
    vals[vals == 0] = 1e-3
    x[idx] = vals
    return x


DATA = {"laplacian": laplacian, "mixture": mixture, "mostly_zeros": mostly_zeros}


def k_of(ratio: float, n: int) -> int:
    """Independent ``k = max(1, ceil(ratio n))`` (tests use ratios where ratio*n is not integral
    or exactly representable)."""
    return min(n, max(1, math.ceil(round(ratio * n, 9))))


def cap_of(k: int, n: int, factor: float = 1.5) -> int:
    return min(n, max(k, math.ceil(factor * k)))


# ---------------------------------------------------------------------------
# numpy references.
# ---------------------------------------------------------------------------


def abs32(x) -> np.ndarray:
    return np.abs(np.asarray(x).astype(np.float32))


def count_above(x, t) -> int:
    return int(np.sum(abs32(x) > np.float32(t)))


def topk_set(x, k: int) -> np.ndarray:
    """Reference top-k set by magnitude: ``{|x| >= kth}`` if kth > 0, else all nonzeros."""
    a = abs32(x)
    kth = np.sort(a)[::-1][k - 1]
    return a >= kth if kth > 0 else a > 0


def per_leaf(like, x):
    """A sparsifier's per-leaf array (last axis: the leaf, ``jax.tree.leaves``
    order) as a pytree shaped like ``like``, one value (per device) per leaf."""
    leaves, treedef = jax.tree.flatten(like)
    return treedef.unflatten([x[..., i] for i in range(len(leaves))])


def to_np(tree):
    return jax.tree.map(lambda a: np.asarray(a), tree)


def f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float32)


def bits(a) -> bytes:
    a = np.asarray(a)
    return a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()


@functools.cache
def jit_selector(fn, **options):
    """A jitted ``fn(x, k, **options)`` with ``k`` static (cached per options)."""
    return jax.jit(functools.partial(fn, **options), static_argnums=1)


def cast(x: np.ndarray, dtype) -> jax.Array:
    return jnp.asarray(x).astype(dtype)


def compile_flags_without_devices() -> str:
    """``XLA_FLAGS`` as conftest set them, without the simulated device count.

    For a subprocess that must choose its own device count (its command line or
    ``jax_num_cpu_devices``) but should compile as fast as the tests do.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    return re.sub(r"--xla_force_host_platform_device_count=\d+", "", flags).strip()


# ---------------------------------------------------------------------------
# Compressor factories (the conformance suite runs every one).
# ---------------------------------------------------------------------------

# The factories live in experiments/presets.py (CONFORMANCE), shared with
# experiments.accelerator_check; FACTORIES[name](ratio, **kw) builds one.
FIXED_T = presets.FIXED_THRESHOLD
FACTORIES = {
    name: functools.partial(presets.conformance_compressor, name) for name in presets.CONFORMANCE
}

# Quantizers: name -> (bits per coordinate, bucket size or None, float32 scales per bucket).
QUANTIZERS = {
    "qsgd": (4, 64, 1),
    "qsgd_ef": (2, None, 1),
    "onebit": (1, 100, 2),
    "sign_sgd": (1, None, 1),
    "ef_sign_sgd": (1, 64, 1),
    "bounded_sign": (1, None, 1),
    "terngrad": (2, 64, 1),
    "terngrad_clip_ef": (2, None, 1),
    "natural": (9, None, 1),  # sign + 8 exponent bits; a float32 1 per leaf
    "natural_dithering_ef": (3, 50, 1),  # s = 3: 1 sign bit + 2 level bits
    "signum": (1, 64, 1),
    "cast_bf16_ef": (16, None, 1),  # a float32 power-of-two scale per leaf
    "cast_fp16": (16, None, 1),
}
# Compressors without error feedback: their residual stays zero (the quantizers
# allocate none; the memory-less sparsifier keeps zeros).
NO_ERROR_FEEDBACK = (
    "qsgd", "sign_sgd", "terngrad", "natural", "signum", "cast_fp16", "top_k_no_ef",
)  # fmt: skip
# Quantizers drawing random numbers (the device index is folded into the key).
RANDOMIZED = ("qsgd", "qsgd_ef", "terngrad", "terngrad_clip_ef", "natural", "natural_dithering_ef")
# Quantizers whose exchange is a majority vote, not a mean (exchange="majority").
MAJORITY = ("signum",)
# GRACE's residual scaling: name -> (residual_scale, gradient_scale); "nothing lost"
# reads sent + new residual == residual_scale * old + gradient_scale * g.
RESIDUAL_SCALING = {"top_k_residual_scaled": (0.75, 1.25)}
# Low-rank compressors: name -> (rank, batched, bytes per P/Q value).
LOW_RANK = {
    "powersgd": (1, False, 4),
    "powersgd_batched": (1, True, 4),
    "powersgd_fp16": (1, False, 2),
    "powersgd_batched_bf16": (1, True, 2),
}

# Compressed *optimizers*: the update is Adam's step, not a compressed gradient, so
# "nothing lost" holds for the momentum they exchange (test_conformance's optimizer
# section); they take a learning rate and no ratio. Small schedules so the 8-step
# conformance runs cross every stage (0/1 Adam: variance steps, 1-bit steps, stage 2).
OPTIMIZERS = {
    name: functools.partial(presets.conformance_optimizer, name)
    for name in presets.CONFORMANCE_OPTIMIZERS
}
SPARSIFIERS = tuple(name for name in FACTORIES if name not in QUANTIZERS and name not in LOW_RANK)


def mesh_update(tx, mesh, axis_name: str = "data"):
    """Jitted ``tx.update`` on every device's row of stacked (grads, state): per-device outputs.

    Called as ``(grads, state, params)`` it passes every device's row of the
    stacked params to ``tx.update`` too.
    """

    def run(grads, state, *params):
        first = lambda t: jax.tree.map(lambda a: a[0], t)  # noqa: E731
        upd, new = tx.update(first(grads), first(state), *(first(p) for p in params))
        return jax.tree.map(lambda a: jnp.asarray(a)[None], (upd, new))

    spec = P(axis_name)
    return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


def low_rank_bytes(name: str, tree, min_dense: int = 0):
    """Independent message sizes per leaf (a pytree of ints like ``tree``, whose leaves
    have ``shape`` and ``dtype``) of low-rank compressor ``name``.

    Per leaf, the hook's rule: ``view(shape[0], -1)``, compressed iff ``(n + m) r * 2 <
    n m``, ``P`` and ``Q`` of the given width; the dense leaf otherwise. Batched (the
    hook's ``batched_powerSGD_hook``): the leaves of one dtype with more than
    ``min_dense`` elements form a bucket, a ``s x s`` matrix with ``s = ceil(sqrt(total))``,
    compressed iff ``2 s r * 2 < s^2``; its ``2 s r`` values are counted at its first leaf.
    """
    rank, batched, item = LOW_RANK[name]
    leaves, treedef = jax.tree.flatten(tree)
    sizes = [math.prod(x.shape) for x in leaves]
    out = [size * np.dtype(x.dtype).itemsize for x, size in zip(leaves, sizes, strict=True)]
    if batched:
        buckets: dict = {}
        for i, (x, size) in enumerate(zip(leaves, sizes, strict=True)):
            if size > max(min_dense, 0):
                buckets.setdefault(np.dtype(x.dtype), []).append(i)
        for idx in buckets.values():
            total = sum(sizes[i] for i in idx)
            s = math.ceil(math.sqrt(total))
            while s * s < total:  # float sqrt rounding
                s += 1
            r = min(s, rank)
            if 2 * s * r * 2 < s * s:
                for i in idx:
                    out[i] = 2 * s * r * item if i == idx[0] else 0
        return treedef.unflatten(out)
    for i, (x, size) in enumerate(zip(leaves, sizes, strict=True)):
        if len(x.shape) >= 2 and size > max(min_dense, 0):
            n, m = x.shape[0], size // x.shape[0]
            r = min(n, m, rank)
            if (n + m) * r * 2 < n * m:
                out[i] = (n + m) * r * item
    return treedef.unflatten(out)


def quantized_bytes(name: str, n: int) -> int:
    """Independent message size of quantizer ``name`` for an ``n``-element leaf."""
    bits, bucket, per_bucket = QUANTIZERS[name]
    d = n if bucket is None else min(bucket, n)
    return math.ceil(n * bits / 8) + math.ceil(n / d) * per_bucket * 4


def majority_vote(per_device: np.ndarray) -> np.ndarray:
    """numpy reference of ``exchange="majority"``: ``sign(sum sign)`` times the voters' mean |x|.

    ``per_device`` is ``[N, ...]``: each device's decoded message. A tie (or no
    voter) gives 0.
    """
    x = np.asarray(per_device, np.float64)
    votes = np.sign(x)
    voters = np.sum(votes != 0, axis=0)
    size = np.sum(np.abs(x), axis=0) / np.maximum(voters, 1)
    return np.sign(np.sum(votes, axis=0)) * size


# Selectors that guarantee at least k sent (when k nonzero, tie-free values exist).
AT_LEAST_K = (
    "top_k", "top_k_sort", "ldte_bs", "binary_search", "random_k", "random_k_shared",
    "top_k_fp16_values",
)  # fmt: skip
# Threshold estimates that may send fewer or more than k (capped by the capacity), with
# at least one element whenever one is nonzero.
ESTIMATED_COUNT = ("sidco",)
# Selectors that send exactly k on tie-free data.
EXACTLY_K = ("top_k", "top_k_sort", "random_k", "random_k_shared", "top_k_fp16_values")
# Index-based random selection: exactly k draws (zeros included), no threshold.
RANDOM_K = ("random_k", "random_k_shared")

# Message formats (issue 38): name -> (values' dtype for wider leaves, 16-bit
# indices for index spaces < 2^16, indices shared by every device: values only).
MESSAGE_FORMATS = {
    "top_k_fp16_values": ("float16", True, False),
    "random_k_shared": (None, False, True),
}


def value_itemsize(name: str, dtype) -> int:
    """Bytes per value of sparsifier ``name``'s message for a leaf (group) of ``dtype``."""
    item = np.dtype(dtype).itemsize
    value = MESSAGE_FORMATS.get(name, (None, False, False))[0]
    return min(item, np.dtype(value).itemsize) if value is not None else item


def pair_bytes(name: str, n: int, dtype) -> int:
    """Bytes per sent element of sparsifier ``name``'s sparse message for an
    ``n``-element leaf (group) of ``dtype``: index (int32; uint16 for ``n <
    2^16`` with 16-bit indices; none when shared) plus value."""
    _, small, shared = MESSAGE_FORMATS.get(name, (None, False, False))
    index = 0 if shared else (2 if small and n < 2**16 else 4)
    return index + value_itemsize(name, dtype)


class Counted:
    """``jax.jit`` of ``tx.update`` that counts how often it was traced (called as
    ``(grads, state)`` or ``(grads, state, params)``)."""

    def __init__(self, tx):
        self.tx = tx
        self.traces = 0

        def update(g, s, *params):
            self.traces += 1
            return tx.update(g, s, *params)

        self.fn = jax.jit(update)

    def __call__(self, g, s, *params):
        out = self.fn(g, s, *params)
        jax.block_until_ready(out)
        return out


_TX_CACHE: dict = {}


def compressor(name: str, ratio: float, **kw) -> Counted:
    """Memoized (factory, options) -> counted jitted update, so tests share compilations."""
    key = (name, ratio, tuple(sorted((k, repr(v)) for k, v in kw.items())))
    if key not in _TX_CACHE:
        _TX_CACHE[key] = Counted(FACTORIES[name](ratio, **kw))
    return _TX_CACHE[key]


def laplace_tree(spec: dict, rng: np.random.Generator, scale: float = 1.0) -> dict:
    """A dict of leaves ``{name: (shape, dtype)}`` with Laplace(0, scale) values."""
    return {
        name: jnp.asarray(rng.laplace(0.0, scale, size=shape)).astype(dtype)
        for name, (shape, dtype) in spec.items()
    }


# ---------------------------------------------------------------------------
# Threshold reuse and groups (tests/test_reuse.py, tests/test_groups.py).
# ---------------------------------------------------------------------------


class CountingTopK:
    """Exact top-k that counts its executions (a host callback in its body)."""

    def __init__(self):
        self.calls = 0

    def _bump(self):
        self.calls += 1

    def __call__(self, x, k):
        jax.debug.callback(self._bump)
        return selectors.exact_top_k(x, k)

    def read(self) -> int:
        jax.effects_barrier()
        return self.calls


def ref_threshold(acc, k: int) -> np.float32:
    """Exact top-k threshold: just below the k-th largest magnitude (0 if that is 0)."""
    kth = np.sort(abs32(acc).reshape(-1))[::-1][k - 1]
    return np.nextafter(kth, np.float32(-np.inf)) if kth > 0 else np.float32(0)


def expected_sent(acc, t, cap) -> np.ndarray:
    """Ascending indices of ``|acc| > t``; over ``cap`` of them, the ``cap``
    largest magnitudes, ties to the lower index (a stable sort, as ``lax.top_k``)."""
    mags = abs32(acc).reshape(-1)
    above = np.flatnonzero(mags > np.float32(t))
    if len(above) <= cap:
        return above
    order = np.argsort(-mags[above], kind="stable")
    return np.sort(above[order[:cap]])


def check_step(acc, sent, new_res, t, cap, count):
    np.testing.assert_array_equal(np.flatnonzero(f32(sent)), expected_sent(acc, t, cap))
    assert count == len(expected_sent(acc, t, cap))
    assert np.array_equal(f32(sent) + np.asarray(new_res), acc)  # nothing lost, bit for bit


def compress_on_mesh(compressor, mesh, grads, state, axis="data"):
    """``compressor.update`` on each device's row of ``grads`` and ``state`` (leading axis).

    Returns per-device ``(updates, state)`` stacked along the leading axis.
    """
    return mesh_update(compressor, mesh, axis)(grads, state)


# numpy references of the 1-bit codecs and exchanges (1-bit Adam, 0/1 Adam, 1-bit LAMB).


def sign_codec(x):
    """numpy ``||x||_1 / d * sign(x)`` (zeros sent as +), one bucket."""
    x = np.asarray(x, np.float32)
    scale = np.float32(np.sum(np.abs(x), dtype=np.float64) / x.size)
    return np.where(x < 0, -scale, scale).astype(np.float32)


def _np_scale(v, kind):
    v = np.asarray(v, np.float64)
    if v.size == 0:
        return 0.0
    return np.abs(v).sum() / v.size if kind == "l1" else np.sqrt((v * v).sum() / v.size)


def _np_signed(v, scale):
    return np.where(np.asarray(v) >= 0, scale, -scale)


def np_compressed_allreduce(x, worker_err, server_err, ok, kind):
    """DeepSpeed's compressed_allreduce in numpy, float64.

    x, worker_err: (N, d); server_err: (d,), the servers' chunks concatenated;
    ok: (N,) bool, devices that send. Chunks of ceil(d / 8N) * 8 values, server j
    owns chunk j. Returns (result, new worker errors, new server errors).
    """
    n, d = x.shape
    buf = np.where(ok[:, None], x + worker_err, 0.0)
    sent = np.stack([_np_signed(b, _np_scale(b, kind)) for b in buf]) * ok[:, None]
    new_worker = np.where(ok[:, None], buf - sent, worker_err)
    avg = sent.sum(axis=0) / max(ok.sum(), 1)
    chunk = -(-d // (8 * n)) * 8
    out, new_server = np.zeros(d), np.zeros(d)
    for j in range(n):
        sl = slice(j * chunk, min(d, (j + 1) * chunk))
        sb = avg[sl] + server_err[sl]
        out[sl] = _np_signed(sb, _np_scale(sb, kind))
        new_server[sl] = sb - out[sl]
    return out, new_worker, new_server
