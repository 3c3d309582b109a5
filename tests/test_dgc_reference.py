"""``dgc`` against a numpy port of DGC's reference selection (issue 34, item 15).

The port follows ``DGCCompressor.initialize`` (the stride and sample size)
and ``DGCCompressor._sparsify`` of synxlin/deep-gradient-compression
(``dgc/compression.py``) line by line, with the sample start given instead
of drawn and ``torch.topk``'s choice among equal magnitudes made as
``lax.top_k`` makes it (the lower index). jaxcomp's default rule must find
the reference's threshold, rounds and survivors bit for bit and send what it
sends, except where the reference cuts more than ``k`` survivors to the
first ``k`` in index order: there jaxcomp sends the ``k`` largest of the same
survivors (documented in ``jaxcomp.selection.dgc_sample``).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp.selection import segmented as sg
from jaxcomp.selection import selectors as S1

# ---------------------------------------------------------------------------
# The port (numpy, float32 magnitudes as the reference's float32 tensors).
# ---------------------------------------------------------------------------


def reference_setup(numel, compress_ratio, sample_ratio=0.01):
    """``DGCCompressor.initialize`` for one tensor: (num_selects, num_samples,
    top_k_samples, sample_stride)."""
    sample_ratio = min(max(sample_ratio, 0.01), 1.0)
    if sample_ratio < 1.0:
        pct_numel = int(math.ceil(numel * sample_ratio))
        cpr_numel = int(math.ceil(2 / compress_ratio))
        if numel <= cpr_numel:
            sample_stride = 1
            num_samples = numel
        else:
            sample_stride = int(math.ceil(numel / max(pct_numel, cpr_numel) / 32)) * 32 + 1
            num_samples = numel // sample_stride
            while num_samples < max(pct_numel, cpr_numel):
                sample_stride = sample_stride - 8
                num_samples = numel // sample_stride
    else:
        sample_stride = 1
        num_samples = numel
    top_k_samples = int(math.ceil(num_samples * compress_ratio))
    num_selects = int(math.ceil(numel * compress_ratio))
    return num_selects, num_samples, top_k_samples, sample_stride


def _topk_indices(values, k):
    """``torch.topk(values, k)[1]``, equal magnitudes to the lower index."""
    return np.argsort(-values, kind="stable")[:k]


def reference_sparsify(
    tensor,
    compress_ratio,
    sample_start,
    *,
    sample_ratio=0.01,
    compress_upper_bound=1.3,
    compress_lower_bound=0.8,
    max_adaptation_iters=10,
):
    """``DGCCompressor._sparsify`` (strided_sample=True, resample=True) with a given start.

    Returns a dict: ``threshold`` (float32, the last one), ``rounds`` (decays),
    ``resampled``, ``survivors`` (ascending indices before the cut to
    ``num_selects``) and ``sent`` (ascending indices after it).
    """
    tensor = np.asarray(tensor, np.float32).reshape(-1)
    numel = tensor.size
    num_selects, num_samples, top_k_samples, sample_stride = reference_setup(
        numel, compress_ratio, sample_ratio
    )
    importance = np.abs(tensor)
    if numel == num_samples:
        samples = importance
    else:
        assert 0 <= sample_start < sample_stride
        samples = importance[sample_start::sample_stride]
    threshold = np.min(samples[_topk_indices(samples, top_k_samples)])
    mask = importance >= threshold
    indices = np.flatnonzero(mask)
    num_indices = indices.size
    rounds, resampled = 0, False
    if numel > num_samples:
        for _ in range(max_adaptation_iters):
            if num_indices > num_selects:
                if num_indices > num_selects * compress_upper_bound:
                    indices = indices[_topk_indices(importance[indices], num_selects)]
                    resampled = True
                    break
                else:
                    break
            elif num_indices < compress_lower_bound * num_selects:
                # A float32 tensor times a Python float: float32.
                threshold = np.float32(threshold * np.float32(compress_lower_bound))
                rounds += 1
            else:
                break
            mask = importance >= threshold
            indices = np.flatnonzero(mask)
            num_indices = indices.size
    survivors = np.sort(indices)
    sent = np.sort(indices[:num_selects])
    return dict(
        threshold=np.float32(threshold),
        rounds=rounds,
        resampled=resampled,
        survivors=survivors,
        sent=sent,
        stride=sample_stride,
        k=num_selects,
    )


# ---------------------------------------------------------------------------
# Data: one case per behaviour of the reference.
# ---------------------------------------------------------------------------


def _laplace(n, seed):
    return np.random.default_rng(seed).laplace(size=n).astype(np.float32)


def _case(name, n, k, seed=0):
    rng = np.random.default_rng(seed)
    x = _laplace(n, seed)
    if name == "ties":  # two levels, the larger ones spread over the index order
        x = np.ones(n, np.float32)
        x[::7] = 2.0
        x[rng.random(n) < 0.5] *= -1
    elif name == "ties_larger_last":  # the whole tensor sampled: ties at the k-th value
        x = np.ones(n, np.float32)
        x[-3:] = 5.0
    elif name == "zeros":
        x = np.zeros(n, np.float32)
    elif name == "mostly_zeros":  # the sample's threshold is 0: everything survives
        x = np.zeros(n, np.float32)
        x[rng.choice(n, size=max(1, n // 500), replace=False)] = 1.0 + rng.random(max(1, n // 500))
    elif name == "small_ints":
        x = rng.integers(-3, 4, n).astype(np.float32)
    return x


# (name, n, k): k / n the compression ratio; Laplacian data at several starts
# lands below 0.8k (decays), in [0.8k, k], in (k, 1.3k] and above 1.3k.
CASES = [
    ("laplace", 100_000, 100),
    ("laplace", 100_000, 1000),
    ("laplace", 20_000, 20),
    ("laplace", 4096, 41),
    ("laplace", 150, 1),  # n <= 2 / r: the whole tensor
    ("laplace", 60, 3),  # n > 2 / r = 40, but the stride falls to 1: the whole tensor
    ("laplace", 1000, 50),
    ("ties", 20_000, 200),
    ("ties_larger_last", 150, 1),
    ("zeros", 10_000, 100),
    ("mostly_zeros", 50_000, 50),
    ("small_ints", 10_000, 1000),
]


def _starts(stride):
    return sorted({0, 1, stride // 2, stride - 1})


def _jaxcomp_message(x, sel, k):
    """The message ``jaxcomp.dgc`` sends for this selection: at most ``k``, the largest."""
    xj = jnp.asarray(x)
    if int(sel.count) <= k:
        return np.flatnonzero(np.abs(x) > np.float32(sel.threshold))
    cut, limit = S1.capacity_cut(xj, sel.threshold, sel.count, k)
    idx, _ = S1.cut_message(xj, cut, limit, k)
    idx = np.asarray(idx)
    return idx[idx < x.size]


@functools.cache
def _selector(k, options):
    """One jitted selector per ``k`` and options: the start is an argument, so
    every start (and seed) of a case runs one trace and compilation."""
    return jax.jit(lambda v, s: S1.dgc_sample(v, k, start=s, **dict(options)))


def _select(x, k, start, **options):
    return _selector(k, tuple(sorted(options.items())))(jnp.asarray(x), jnp.int32(start))


@pytest.mark.parametrize("name,n,k", CASES, ids=lambda v: str(v))
def test_default_selection_is_the_reference(name, n, k):
    ratio = k / n
    for seed in (0, 1):
        x = _case(name, n, k, seed)
        stride = reference_setup(n, ratio)[3]
        assert S1.dgc_sampling(n, k)[0] == stride
        for start in _starts(stride):
            ref = reference_sparsify(x, ratio, start)
            assert ref["k"] == k
            sel = _select(x, k, start)
            nonzero = x != 0
            # Threshold and rounds bit for bit (resample: the k-th largest survivor).
            if not ref["resampled"]:
                assert np.float32(sel.threshold) == np.float32(
                    S1._just_below(jnp.float32(ref["threshold"]))
                ), (start, float(sel.threshold), float(ref["threshold"]))
            assert int(sel.iterations) == ref["rounds"] + int(ref["resampled"])
            # The survivors: the reference's, nonzeros (zeros carry nothing); after
            # a resample all of the k-th largest's ties (the cut below picks k).
            survivors = np.flatnonzero(np.abs(x) > np.float32(sel.threshold))
            assert int(sel.count) == survivors.size
            expected = ref["survivors"]
            if ref["resampled"]:
                expected = np.flatnonzero(np.abs(x) >= np.abs(x[expected]).min())
            np.testing.assert_array_equal(survivors, expected[nonzero[expected]])
            # The message: at most k, the reference's, or the k largest of its survivors.
            msg = _jaxcomp_message(x, sel, k)
            assert msg.size <= k
            if ref["survivors"].size <= k or ref["resampled"]:
                np.testing.assert_array_equal(msg, ref["sent"][nonzero[ref["sent"]]])
            else:
                surv = ref["survivors"]
                order = surv[np.lexsort((surv, -np.abs(x[surv])))][:k]
                np.testing.assert_array_equal(msg, np.sort(order[nonzero[order]]))
                assert ref["sent"].size == k


def test_counts_in_each_window_are_covered():
    """The cases above reach (k, 1.3k], > 1.3k (resample) and < 0.8k (decay)."""
    windows = set()
    for name, n, k in CASES:
        for seed in (0, 1):
            x = _case(name, n, k, seed)
            stride = reference_setup(n, k / n)[3]
            for start in _starts(stride):
                ref = reference_sparsify(x, k / n, start)
                c = ref["survivors"].size
                if ref["resampled"]:
                    windows.add("above_upper")
                elif k < c <= 1.3 * k:
                    windows.add("k_to_upper")
                if ref["rounds"]:
                    windows.add("decayed")
    assert {"above_upper", "k_to_upper", "decayed"} <= windows


def test_outlier_ends_below_the_lower_bound():
    """Sampled outliers 1e4 x the rest (as many as the sample's top: the reference
    samples at least 2 / r elements, so that is >= 2): ten decays, fewer than
    0.8 k survive, as in the reference."""
    n, k = 10_000, 100
    x = (_laplace(n, 3) * 1e-3).astype(np.float32)
    _, _, top, stride = reference_setup(n, k / n)
    start = 5
    x[start : start + top * stride : stride] = 1e4  # in the sample
    ref = reference_sparsify(x, k / n, start)
    assert ref["rounds"] == 10 and not ref["resampled"]
    assert ref["survivors"].size == top < 0.8 * k
    sel = _select(x, k, start)
    assert int(sel.iterations) == 10
    np.testing.assert_array_equal(
        np.flatnonzero(np.abs(x) > np.float32(sel.threshold)), ref["survivors"]
    )
    assert stride > 1


@pytest.mark.parametrize("rule", ["reference", "at_least_k"])
def test_segmented_form_equals_the_1d_selector_for_both_rules(rule):
    rng = np.random.default_rng(4)
    sizes = (5, 300, 1000, 70_000, 257, 16, 3000, 1, 0, 100_000)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    parts[2][:50] = 1.0  # ties at the top
    parts[5][:] = 0.0  # fewer than k nonzeros
    parts[9][7] = 1e4  # an outlier
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    keys = jax.random.split(jax.random.key(7), len(sizes))
    for ratio in (0.01, 0.001, 0.1):
        table = np.asarray([[S1.target_count(ratio, n) for n in sizes]])
        sel = jax.jit(
            lambda x, keys, table=table: sg.dgc_sample(
                layout, x, sg.Targets(table), key=keys, rule=rule
            )
        )(x, keys)
        for s, p in enumerate(parts):
            if not sizes[s]:
                continue
            one = jax.jit(
                lambda p, key, k=int(table[0, s]): S1.dgc_sample(p, k, key=key, rule=rule)
            )(jnp.asarray(p), keys[s])
            got, want = np.asarray(sel.threshold[s]), np.asarray(one.threshold)
            assert got.view(np.uint32) == want.view(np.uint32), (ratio, s)
            assert int(sel.count[s]) == int(one.count)
            assert int(sel.iterations[s]) == int(one.iterations)


def test_start_comes_from_the_key_and_changes_per_step():
    x = jnp.asarray(_laplace(100_000, 0))
    k = 100
    stride = S1.dgc_sampling(100_000, k)[0]
    starts = [int(S1.dgc_start(jax.random.key(i), stride)) for i in range(20)]
    assert all(0 <= s < stride for s in starts) and len(set(starts)) > 5
    for i in (0, 1):
        by_key = S1.dgc_sample(x, k, key=jax.random.key(i))
        by_start = S1.dgc_sample(x, k, start=starts[i])
        assert float(by_key.threshold) == float(by_start.threshold)


def _leaf_key(seed, step, leaf):
    """The key ``jaxcomp.sparsify`` gives a leaf's selector at a step (one device)."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), step), leaf)


def test_dgc_transform_sends_the_reference_message_and_loses_nothing():
    """Through ``jaxcomp.dgc``: each step's message is the reference's for that
    step's start (the k largest survivors where the reference cuts to the first
    k), at most k, and sent + new residual == old residual + gradient bit for bit."""
    n, ratio, seed = 1000, 0.05, 3  # counts below, within and above [0.8 k, 1.3 k]
    k = S1.target_count(ratio, n)
    tx = jaxcomp.dgc(ratio, seed=seed)
    params = {"w": jnp.zeros((n,), jnp.float32)}
    state = tx.init(params)
    step = jax.jit(tx.update)
    stride = reference_setup(n, k / n)[3]
    starts = set()
    for i in range(8):
        g = _laplace(n, 10 + i)
        old = np.asarray(state.residual["w"])
        u, state = step({"w": jnp.asarray(g)}, state)
        sent, new = np.asarray(u["w"]), np.asarray(state.residual["w"])
        acc = old + g
        np.testing.assert_array_equal(sent + new, acc)
        np.testing.assert_array_equal(np.flatnonzero(sent), np.flatnonzero(sent != 0))
        assert np.count_nonzero(sent) <= k
        # The start: uniform from the step's key (S1.dgc_start), written out.
        bits = jax.random.bits(_leaf_key(seed, i, 0), dtype=jnp.uint32)
        start = int(bits) % stride
        starts.add(start)
        ref = reference_sparsify(acc, k / n, start)
        if ref["survivors"].size <= k or ref["resampled"]:
            expected = ref["sent"]
        else:
            surv = ref["survivors"]
            expected = np.sort(surv[np.lexsort((surv, -np.abs(acc[surv])))][:k])
        np.testing.assert_array_equal(np.flatnonzero(sent), expected)
        np.testing.assert_array_equal(sent[expected], acc[expected])
    assert len(starts) > 1


def test_dgc_sends_at_most_k_by_default():
    """The reference sends at most k (the earlier rule sent k to 1.3 k here)."""
    n, ratio = 2**16, 0.01
    k = S1.target_count(ratio, n)
    for rule, at_most in (("reference", k), ("at_least_k", None)):
        tx = jaxcomp.dgc(ratio, rule=rule)
        state = tx.init({"w": jnp.zeros((n,), jnp.float32)})
        step = jax.jit(tx.update)
        counts = []
        for i in range(4):
            u, state = step({"w": jnp.asarray(_laplace(n, i))}, state)
            counts.append(int(np.count_nonzero(np.asarray(u["w"]))))
        if at_most is None:
            assert min(counts) >= k and max(counts) > k, counts
        else:
            assert max(counts) <= k, counts


def test_at_least_k_rule_keeps_the_earlier_selection():
    x = jnp.asarray(_laplace(2**16, 1))
    k = 655
    old = S1.dgc_sample(x, k, rule="at_least_k")
    assert int(old.count) >= k
    tx = jaxcomp.dgc(0.01, rule="at_least_k")
    g = {"w": x}
    u, _ = jax.jit(tx.update)(g, tx.init(g))
    assert np.count_nonzero(np.asarray(u["w"])) == int(old.count)


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: jaxcomp.dgc(0.01, rule="nope"), "rule must be one of"),
        (lambda: jaxcomp.dgc(0.01, sample_ratio=0.001), "sample_ratio"),
        (lambda: S1.dgc_sample(jnp.ones(8), 2, rule="first_k"), "rule must be one of"),
        (
            lambda: jaxcomp.sparsify("dgc", 0.01, selector_options={"rule": "nope"}),
            "rule",
        ),
    ],
)
def test_bad_rule_and_sample_ratio(make, match):
    with pytest.raises(ValueError, match=match):
        make()
    # The earlier rule still accepts small sample ratios.
    jaxcomp.dgc(0.01, rule="at_least_k", sample_ratio=0.001)


@pytest.mark.parametrize("rule", ["reference", "at_least_k"])
@pytest.mark.parametrize("decay", [0.8, 0.5])
def test_rounds_several_per_pass_and_the_refine_equal_the_1d_selector(rule, decay):
    # Sampled outliers (index 0 is in both rules' samples from start 0) force
    # many decay rounds, more than segmented._ROUNDS per pass, and decays
    # past the window force the survivors' top-k: every segment as the 1-D
    # selector, bit for bit, whatever max_adaptations cuts.
    rng = np.random.default_rng(11)
    sizes = (3000, 20_000, 5000, 70_000, 4096, 300)
    parts = [rng.laplace(size=n).astype(np.float32) for n in sizes]
    for p, big in zip(parts, (40.0, 15.0, 200.0, 12.0, 1e4, 8.0), strict=True):
        n = p.size
        stride, _, ks = S1.dgc_sampling(n, S1.target_count(0.01, n), 0.01)
        p[: (ks + 1) * stride : stride] = big  # the reference's sample top
        m = math.ceil(0.01 * n)
        p[: 4 * (n // m) : (n // m) - 1 + (n // m) % 2] = big  # at_least_k's sample top
    parts[4][1:100] = 2.0  # ties where the rounds end
    layout = sg.SegmentLayout(sizes)
    x = layout.pack([jnp.asarray(p) for p in parts], jnp.float32)
    table = np.asarray([[S1.target_count(0.01, n) for n in sizes]])
    start = jnp.zeros((len(sizes),), jnp.int32)
    seen = set()
    # No round, a cut inside the first pass (rounds come _ROUNDS = 2 a pass)
    # and inside a later one, no cut.
    for max_adaptations in (0, 1, 5, 25):
        opts = dict(rule=rule, decay=decay, max_adaptations=max_adaptations)
        sel = jax.jit(
            lambda x, o=opts: sg.dgc_sample(layout, x, sg.Targets(table), start=start, **o)
        )(x)
        for s, p in enumerate(parts):
            one = jax.jit(lambda p, k=int(table[0, s]), o=opts: S1.dgc_sample(p, k, **o))(
                jnp.asarray(p)
            )
            got, want = np.asarray(sel.threshold[s]), np.asarray(one.threshold)
            assert got.view(np.uint32) == want.view(np.uint32), (max_adaptations, s)
            assert int(sel.count[s]) == int(one.count)
            assert int(sel.iterations[s]) == int(one.iterations)
            seen.add(int(one.iterations))
    assert max(seen) > 2 * sg._ROUNDS  # several passes of rounds ran


# ---------------------------------------------------------------------------
# DGC's memory: Nesterov momentum correction and local gradient clipping.
# ---------------------------------------------------------------------------
#
# A numpy port of ``DGCSGDMemory`` (synxlin/deep-gradient-compression,
# ``dgc/memory.py``): ``compensate`` (clip, then the momentum correction) and
# ``update`` (factor masking of the sent coordinates), in float32 like the
# reference's tensors. The clipping is the reference's ``clip_grad_norm_``
# (``dgc/clip_grad.py``: ``coef = max_norm / (norm + 1e-6)``, applied if below 1)
# with the paper's choices (Lin et al. 2018, section 3.3 and appendix D): the
# norm of this worker's whole gradient, and ``max_norm = c / sqrt(N)``.
# The selection is exact top-k (the memory does not depend on the selector).

MEMORY_SHAPES = {"v": (300,), "w": (40, 25)}


class DGCMemoryPort:
    def __init__(self, momentum, nesterov, clip=None, n_workers=1, masking=True):
        self.m, self.nesterov, self.masking = np.float32(momentum), nesterov, masking
        self.clip = None if clip is None else clip / math.sqrt(n_workers)
        self.mmt = {k: np.zeros(s, np.float32) for k, s in MEMORY_SHAPES.items()}
        self.vec = {k: np.zeros(s, np.float32) for k, s in MEMORY_SHAPES.items()}

    def clip_coef(self, grads):
        if self.clip is None:
            return None
        norm = np.float32(np.sqrt(sum(np.sum(np.float64(g) ** 2) for g in grads.values())))
        coef = np.float32(self.clip) / (norm + np.float32(1e-6))
        return coef if coef < 1 else None

    def compensate(self, grads):
        coef = self.clip_coef(grads)
        out = {}
        for name, g in grads.items():
            g = np.asarray(g, np.float32)
            if coef is not None:
                g = g * coef  # grad.mul_(clip_coef)
            mmt, vec = self.mmt[name], self.vec[name]
            if self.nesterov:
                mmt = (mmt + g) * self.m  # mmt.add_(grad).mul_(momentum)
                vec = (vec + mmt) + g  # vec.add_(mmt).add_(grad)
            else:
                mmt = mmt * self.m + g  # mmt.mul_(momentum).add_(grad)
                vec = vec + mmt  # vec.add_(mmt)
            self.mmt[name], self.vec[name] = mmt, vec
            out[name] = vec
        return out

    def update(self, name, indices, wire=np.float32):
        """Masks the sent coordinates; returns the message (values in ``wire``)."""
        vec = self.vec[name].reshape(-1).copy()
        sent = np.zeros_like(vec)
        sent[indices] = vec[indices].astype(wire).astype(np.float32)
        # index_fill_(0, indices, 0); a narrower wire keeps its rounding (nothing lost).
        vec[indices] = vec[indices] - sent[indices]
        self.vec[name] = vec.reshape(self.vec[name].shape)
        if self.masking:
            mmt = self.mmt[name].reshape(-1).copy()
            mmt[indices] = 0
            self.mmt[name] = mmt.reshape(self.mmt[name].shape)
        return sent.reshape(self.vec[name].shape)

    def step(self, grads, ratio, wire=np.float32):
        vecs = self.compensate(grads)
        msgs = {}
        for name, vec in vecs.items():
            flat = np.abs(vec.reshape(-1))
            k = max(1, math.ceil(round(ratio * flat.size, 9)))
            msgs[name] = self.update(name, np.argsort(-flat, kind="stable")[:k], wire)
        return msgs


def _memory_grads(rng, step, lead=(), dtype=np.float32):
    # Every third step ten times larger: clipping on some steps and not on others.
    scale = 10.0 if step % 3 == 2 else 1.0
    return {
        k: (scale * rng.laplace(size=(*lead, *s))).astype(np.float32).astype(dtype)
        for k, s in MEMORY_SHAPES.items()
    }


def _assert_close_or_equal(got, want, exact, err_msg="", atol=1e-6):
    if exact:
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=err_msg)
    else:
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-6, atol=atol, err_msg=err_msg)


@pytest.mark.parametrize(
    "nesterov, clip, masking",
    [(True, None, True), (True, None, False), (True, 80.0, True), (False, 80.0, True)],
)
def test_memory_matches_dgc_sgd_memory(nesterov, clip, masking):
    """Several steps of ``top_k`` with DGC's options against the port: velocity
    (``momentums``), residual (``velocities``) and message; bit for bit without
    clipping, to float32 rounding with it (the norm's summation order)."""
    ratio = 0.05
    tx = jaxcomp.top_k(
        ratio, momentum=0.9, nesterov=nesterov, momentum_masking=masking, clip_norm=clip
    )
    port = DGCMemoryPort(0.9, nesterov, clip, masking=masking)
    rng = np.random.default_rng(7)
    state = tx.init({k: jnp.zeros(s) for k, s in MEMORY_SHAPES.items()})
    step = jax.jit(tx.update)
    clipped = 0
    for i in range(6):
        g = _memory_grads(rng, i)
        clipped += port.clip_coef(g) is not None
        want = port.step(g, ratio)
        u, state = step({k: jnp.asarray(v) for k, v in g.items()}, state)
        for name in MEMORY_SHAPES:
            exact = clip is None
            _assert_close_or_equal(u[name], want[name], exact, f"{name} step {i}")
            _assert_close_or_equal(state.velocity[name], port.mmt[name], exact, name)
            _assert_close_or_equal(state.residual[name], port.vec[name], exact, name)
            sent = np.flatnonzero(np.asarray(u[name]))
            np.testing.assert_array_equal(sent, np.flatnonzero(want[name]))
    assert clip is None or 0 < clipped < 6  # clipping both on and off


def test_clipping_uses_the_device_count_on_a_mesh():
    """shard_map on 8 devices: each device clips its own gradient at ``c / sqrt(8)``
    and keeps its own DGC memory; the update is the mean of the messages."""
    from helpers import mesh_update  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    n_dev, ratio, clip = 8, 0.05, 230.0
    mesh = Mesh(np.array(jax.devices()[:n_dev]), ("data",))
    sharding = NamedSharding(mesh, P("data"))
    tx = jaxcomp.top_k(
        ratio, axis_name="data", exchange="allgather", momentum=0.9, nesterov=True,
        clip_norm=clip,
    )  # fmt: skip
    ports = [DGCMemoryPort(0.9, True, clip, n_workers=n_dev) for _ in range(n_dev)]
    zeros = {k: jnp.zeros(s) for k, s in MEMORY_SHAPES.items()}
    state = jax.device_put(jax.tree.map(lambda x: jnp.stack([x] * n_dev), tx.init(zeros)), sharding)
    step = mesh_update(tx, mesh)
    rng = np.random.default_rng(8)
    clipped = 0
    for i in range(3):
        g = _memory_grads(rng, i, (n_dev,))
        per_dev = [{k: v[d] for k, v in g.items()} for d in range(n_dev)]
        clipped += sum(p.clip_coef(x) is not None for p, x in zip(ports, per_dev, strict=True))
        msgs = [p.step(x, ratio) for p, x in zip(ports, per_dev, strict=True)]
        u, state = step(jax.device_put(g, sharding), state)
        u, res, vel = jax.device_get((u, state.residual, state.velocity))
        for name in MEMORY_SHAPES:
            mean = np.mean([m[name] for m in msgs], axis=0, dtype=np.float64)
            for d in range(n_dev):
                np.testing.assert_allclose(u[name][d], mean, rtol=1e-5, atol=1e-6)
                _assert_close_or_equal(res[name][d], ports[d].vec[name], False, name)
                _assert_close_or_equal(vel[name][d], ports[d].mmt[name], False, name)
    assert 0 < clipped < 3 * n_dev


def test_bfloat16_gradients_keep_the_message_rounding():
    """bf16 gradients: the memory in float32, the message in bf16, its rounding
    kept in the residual (the port with a bf16 wire)."""
    ratio, clip = 0.05, 80.0
    tx = jaxcomp.top_k(ratio, momentum=0.9, nesterov=True, clip_norm=clip)
    port = DGCMemoryPort(0.9, True, clip)
    rng = np.random.default_rng(9)
    state = tx.init({k: jnp.zeros(s, jnp.bfloat16) for k, s in MEMORY_SHAPES.items()})
    step = jax.jit(tx.update)
    for i in range(4):
        g = _memory_grads(rng, i, dtype=jnp.bfloat16)
        want = port.step({k: v.astype(np.float32) for k, v in g.items()}, ratio, jnp.bfloat16)
        u, state = step({k: jnp.asarray(v) for k, v in g.items()}, state)
        for name in MEMORY_SHAPES:
            assert u[name].dtype == jnp.bfloat16 and state.residual[name].dtype == jnp.float32
            _assert_close_or_equal(u[name].astype(jnp.float32), want[name], False, name)
            # The residual's small values are acc - bf16(acc): a few float32 ulps of
            # the accumulator (|acc| ~ 10) through the clipping factor's rounding.
            _assert_close_or_equal(state.residual[name], port.vec[name], False, name, 2e-5)
            _assert_close_or_equal(state.velocity[name], port.mmt[name], False, name)


@pytest.mark.parametrize("nonfinite", ["skip", "zero"])
def test_nan_gradients_stay_out_of_the_memory(nonfinite):
    """Clipping, Nesterov and residual scaling: a NaN never reaches the norm, the
    residual or the velocity; a skipped step leaves both as they were (no decay)."""
    tx = jaxcomp.top_k(
        0.05, momentum=0.9, nesterov=True, clip_norm=80.0, residual_scale=0.5,
        nonfinite=nonfinite,
    )  # fmt: skip
    rng = np.random.default_rng(10)
    state = tx.init({k: jnp.zeros(s) for k, s in MEMORY_SHAPES.items()})
    step = jax.jit(tx.update)
    u, state = step(_memory_grads(rng, 0), state)
    bad = _memory_grads(rng, 1)
    bad["w"][3, 4] = np.nan
    u, new = step(bad, state)
    for tree in (u, new.residual, new.velocity):
        assert all(np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(tree))
    assert int(new.nonfinite_steps) == 1
    if nonfinite == "skip":
        for a, b in zip(jax.tree.leaves((state.residual, state.velocity)),
                        jax.tree.leaves((new.residual, new.velocity)), strict=True):  # fmt: skip
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert not any(np.any(np.asarray(x)) for x in jax.tree.leaves(u))


def test_injected_clip_norm_and_scales_match_static_values_without_retracing():
    import optax  # noqa: PLC0415

    g = {k: jnp.asarray(v) for k, v in _memory_grads(np.random.default_rng(11), 2).items()}
    kw = dict(momentum=0.9, clip_norm=200.0, residual_scale=0.75, gradient_scale=1.25)
    injected = optax.inject_hyperparams(jaxcomp.top_k, static_args=("ratio", "nesterov"))(
        ratio=0.05, nesterov=True, **kw
    )
    traces = []

    def update(g, state):
        traces.append(1)
        return injected.update(g, state)

    step = jax.jit(update)

    def run_static(**over):
        tx = jaxcomp.top_k(0.05, nesterov=True, **{**kw, **over})
        s = tx.init(g)
        outs = []
        for _ in range(2):
            u, s = tx.update(g, s)
            outs.append((u, s.residual, s.velocity))
        return outs

    state = injected.init(g)
    for i, want in enumerate(run_static()):
        u, state = step(g, state)
        got = (u, state.inner_state.residual, state.inner_state.velocity)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(i))
    state.hyperparams["clip_norm"] = jnp.float32(20.0)
    u, _ = step(g, state)
    assert len(traces) == 1
    tx = jaxcomp.top_k(0.05, nesterov=True, **{**kw, "clip_norm": 20.0})
    s0 = tx.init(g)
    s0 = s0._replace(residual=state.inner_state.residual, velocity=state.inner_state.velocity)
    s0 = s0._replace(step=state.inner_state.step)
    want, _ = tx.update(g, s0)
    for a, b in zip(jax.tree.leaves(u), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(nesterov=True), "nesterov.*momentum"),
        (dict(momentum=0.0, nesterov=True), "nesterov.*momentum"),
        (dict(momentum=0.9, nesterov=1), "nesterov"),
        (dict(clip_norm=0.0), "clip_norm"),
        (dict(clip_norm=-1.0), "clip_norm"),
        (dict(clip_norm=float("nan")), "clip_norm"),
        (dict(clip_norm="1"), "clip_norm"),
    ],
)
def test_bad_dgc_memory_arguments_name_them(kwargs, match):
    for factory in (jaxcomp.top_k, jaxcomp.dgc):
        with pytest.raises(ValueError, match=match):
            factory(0.05, **kwargs)
    with pytest.raises(ValueError, match=match):
        jaxcomp.sparsify("top_k", 0.05, **kwargs)
