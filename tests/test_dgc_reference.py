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
