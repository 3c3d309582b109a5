"""Selection benchmark: the LDTE-BS paper's Fig. 5 on this machine.

For every selector, every size and three data sets (Laplacian with mean 5e-4
and std 5e-3 as in the paper, a 90% N(0, 1e-4) + 10% Laplace mixture, and
99%-zeros data) at ``eta = 1e-3`` it measures, as medians after warm-up:

- ``threshold``: the selector alone (threshold and count);
- ``step``: the full compress step of one leaf, ``acc = e + g``, selection,
  fixed-capacity extraction of the (index, value) message and the residual
  update (for exact top-k the natural baseline: ``lax.top_k`` indices, gather,
  residual scatter), with the residual donated and threaded from step to step
  as in a training loop;
- ``floor``: one memory pass, ``jnp.sum(jnp.abs(x))``, in the same run.

SIDCo (``sidco_<dist>``: exponential, gamma, generalized Pareto, stages
adapted) runs next to LDTE-BS (``ldte_bs`` and ``ldte_bs_paper``): its
``count_over_k`` is an estimate's, not a window's; one line per size
compares both.

Beside exact ``lax.top_k`` it runs ``chunked_top_k``, the fairest top-k
baseline for GPU users and an approximate one: on a GPU, ``lax.top_k`` at a
gradient-sized ``k`` is a full sort (XLA uses its fast kernels only for
``k <= 16``, RAFT's ``select_k`` for ``k`` up to 128-256), so practical GPU
top-k sparsifiers reshape the tensor into rows (>= 64 elements), take a small
top-k (<= 256) of every row and keep the k largest of those candidates (see
:func:`chunked_top_k`). Its ``count`` (vs ``k``) and ``exact_threshold``
(whether its threshold equals exact top-k's) are reported.

Ratios are against exact ``lax.top_k`` and the floor measured in the same run,
so machine drift cancels. Writes ``<out>/bench_selection.json`` and
``<out>/bench_selection.png`` (log-log time against size, per data set).

Run: ``python -m experiments.bench_selection [--sizes 10,12,...,24]
[--repeats 7] [--out results]``.
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli, jsonio
from experiments.timing import environment, median_ms, median_ms_threaded
from jaxcomp.selection import _kernels as kernels
from jaxcomp.selection import selectors

ETA = 1e-3

# chunked_top_k: candidates per row (XLA:GPU's fast top-k handles k <= 16),
# oversampling of the k candidates needed, and the GPU paths' bounds.
CHUNK_PER_ROW = 8
CHUNK_OVERSAMPLE = 2.0
CHUNK_MIN_ROW = 64
CHUNK_MAX_PER_ROW = 256


def chunk_shape(n: int, k: int, per_row: int = CHUNK_PER_ROW, oversample: float = CHUNK_OVERSAMPLE):
    """``(rows, row, m)`` of :func:`chunked_top_k`: ``rows`` rows of ``row``, top-``m`` each.

    ``row`` is the largest power of two with about ``per_row / oversample``
    of the k largest elements per row (at least 64 elements, the whole tensor
    if smaller); ``m`` is ``per_row``, raised (up to 256, then up to ``row``)
    until the ``rows * m`` candidates number at least ``oversample * k``.
    """
    if n <= CHUNK_MIN_ROW:
        row = n
    else:
        row = 2 ** math.floor(math.log2(max(1.0, per_row * n / (oversample * k))))
        row = min(max(row, CHUNK_MIN_ROW), n)
    rows = -(-n // row)
    m = min(row, max(per_row, math.ceil(oversample * k / rows)))
    m = min(m, max(CHUNK_MAX_PER_ROW, math.ceil(k / rows)))  # > 256 only if k needs it
    return rows, row, m


def chunked_top_k(x, k):
    """Approximate top-k the fast GPU way: top-``m`` per row, then the k-th largest candidate.

    ``|x|`` is zero-padded and reshaped into rows (:func:`chunk_shape`: rows
    of >= 64 elements, ``m <= 256`` candidates per row, at ``eta = 1e-3``
    rows of 2048 with 8 candidates each), ``lax.top_k`` runs on every row (on
    a GPU the fast batched kernels), and the threshold is the k-th largest of
    the ``rows * m`` candidates (a small top-k). NOT exact: when a row holds
    more than ``m`` of the k largest elements, some of them are not
    candidates, the threshold comes out lower, and the set ``{|x| > t}``
    (counted over the whole tensor) holds more than k elements; it is exact
    top-k (same threshold) whenever no row overflows. It never selects fewer
    than k (ties and zeros aside), since ``rows * m >= k``.
    """
    a = jnp.abs(x.astype(jnp.float32))
    n = a.shape[0]
    rows, row, m = chunk_shape(n, k)
    padded = jnp.pad(a, (0, rows * row - n)).reshape(rows, row)  # zeros are never selected
    cand = jax.lax.top_k(padded, m)[0].reshape(-1)
    # min of the top-k values, not values[k - 1] (which XLA:CPU turns into a sort)
    v = jnp.min(jax.lax.top_k(cand, min(k, cand.shape[0]))[0])
    t = jnp.where(v > 0, jnp.nextafter(v, jnp.float32(-jnp.inf)), jnp.float32(0))
    return selectors.Selection(t, kernels.count_above(a, t), jnp.int32(0))


# name -> selector(x, k); random_k needs a key.
SELECTORS = {
    "top_k": selectors.exact_top_k,
    "chunked_top_k": chunked_top_k,
    "sort_top_k": selectors.sort_top_k,
    "ldte_bs": selectors.ldte_bs,
    "ldte_bs_paper": lambda x, k: selectors.ldte_bs(
        x, k, search="bisect", aim=1.0, moment_sample=None
    ),
    "ldte_bs_fibonacci": lambda x, k: selectors.ldte_bs(x, k, search="fibonacci"),
    "binary_search": selectors.binary_search,
    "dgc": selectors.dgc_sample,
    "trimmed_top_k": selectors.trimmed_top_k,
    "gaussian_k": selectors.gaussian_k,
    "random_k": lambda x, k: selectors.random_k(x, k, key=jax.random.key(0)),
    # SIDCo (Abdelmoniem et al., MLSys 2021), each fit, stages adapted (jaxcomp.sidco's default).
    "sidco_exponential": lambda x, k: selectors.sidco(x, k, dist="exponential"),
    "sidco_gamma": lambda x, k: selectors.sidco(x, k, dist="gamma"),
    "sidco_gpareto": lambda x, k: selectors.sidco(x, k, dist="gpareto"),
}
# The rows printed against ldte_bs (both variants) at every size.
VERSUS_LDTE = ("ldte_bs_paper", "sidco_exponential", "sidco_gamma", "sidco_gpareto")
# A full sort costs seconds above 2^20 on XLA:CPU (10 s at 2^24): skipped there.
SORT_MAX_LOG2 = 20


def make_data(kind: str, n: int, seed: int = 0) -> np.ndarray:
    """The benchmark's data sets (float32)."""
    rng = np.random.default_rng(seed)
    if kind == "laplace":
        return rng.laplace(5e-4, 5e-3 / math.sqrt(2), n).astype(np.float32)
    if kind == "mixture":
        normal = rng.normal(0.0, 1e-4, n)
        lap = rng.laplace(0.0, 5e-3 / math.sqrt(2), n)
        return np.where(rng.random(n) < 0.9, normal, lap).astype(np.float32)
    if kind == "zeros99":
        lap = rng.laplace(0.0, 5e-3 / math.sqrt(2), n)
        return np.where(rng.random(n) < 0.99, 0.0, lap).astype(np.float32)
    if kind == "ties":  # small integers: every top-k tie group is far over any capacity
        return (1e-3 * rng.integers(-3, 4, n)).astype(np.float32)
    raise ValueError(f"unknown data kind {kind!r}")


def threshold_fn(select, k):
    return jax.jit(lambda x: select(x, k)[:3])


def step_fn(name, select, k, capacity):
    """One leaf's compress step: accumulate, select, extract, update residual."""
    if name == "top_k":

        def step(e, g):
            acc = e + g
            _, idx = jax.lax.top_k(jnp.abs(acc), k)
            vals = acc[idx]
            return idx, vals, acc.at[idx].set(0.0)

    elif name == "random_k":

        def step(e, g):
            acc = e + g
            idx = select(acc, k).indices
            return idx, acc[idx], acc.at[idx].set(0.0)

    else:

        def step(e, g):
            acc = e + g
            sel = select(acc, k)
            idx, vals, _ = kernels.extract(acc, sel.threshold, capacity)
            return idx, vals, acc.at[idx].set(0.0, mode="drop")

    # The residual is donated, as in a training step that donates its
    # optimizer state: the new residual is written in place of the old one.
    return jax.jit(step, donate_argnums=0)


def run(sizes_log2, kinds, repeats, out_dir, methods=None):
    """Times every selector in ``methods`` (default all; ``top_k`` is the baseline, always run)."""
    unknown = sorted(set(methods or ()) - set(SELECTORS))
    if unknown:
        raise ValueError(f"methods must be among {sorted(SELECTORS)}, got unknown {unknown}")
    chosen = {
        name: fn for name, fn in SELECTORS.items() if methods is None or name in {"top_k", *methods}
    }
    results = []
    for kind in kinds:
        for lg in sizes_log2:
            n = 2**lg
            x = jnp.asarray(make_data(kind, n))
            k = selectors.target_count(ETA, n)
            cap = min(n, math.ceil(1.5 * k))
            floor = median_ms(jax.jit(lambda v: jnp.sum(jnp.abs(v))), x, repeats=repeats)
            row = {"data": kind, "log2_n": lg, "n": n, "k": k, "floor_ms": floor, "methods": {}}
            for name, select in chosen.items():
                if name == "sort_top_k" and lg > SORT_MAX_LOG2:
                    continue
                f = threshold_fn(select, k)
                t_ms = median_ms(f, x, repeats=repeats)
                _, count, iters = f(x)
                s_ms = median_ms_threaded(
                    step_fn(name, select, k, cap),
                    jnp.zeros_like(x),
                    x,
                    next_state=lambda out: out[2],
                    repeats=repeats,
                )
                row["methods"][name] = {
                    "threshold_ms": t_ms,
                    "step_ms": s_ms,
                    "count": int(count),
                    "count_over_k": int(count) / k,
                    "iterations": int(iters),
                    "threshold": float(f(x)[0]),
                }
            base = row["methods"]["top_k"]
            if "chunked_top_k" in row["methods"]:
                ch = row["methods"]["chunked_top_k"]
                ch["exact_threshold"] = ch["threshold"] == base["threshold"]
                ch["rows"], ch["row"], ch["per_row"] = chunk_shape(n, k)
            for m in row["methods"].values():
                m["threshold_speedup_vs_top_k"] = base["threshold_ms"] / m["threshold_ms"]
                m["step_speedup_vs_top_k"] = base["step_ms"] / m["step_ms"]
                m["threshold_floors"] = m["threshold_ms"] / floor
                m["step_floors"] = m["step_ms"] / floor
            results.append(row)
            if "chunked_top_k" in row["methods"]:
                ch = row["methods"]["chunked_top_k"]
                print(
                    f"{kind:8s} 2^{lg:<2d} chunked_top_k ({ch['rows']} rows of {ch['row']},"
                    f" top-{ch['per_row']} each) {ch['threshold_ms']:8.2f} ms"
                    f" ({ch['threshold_speedup_vs_top_k']:5.2f}x top_k), count {ch['count']}"
                    f" = {ch['count_over_k']:.3f}k, exact threshold: {ch['exact_threshold']}",
                    flush=True,
                )
            if "ldte_bs" not in row["methods"]:
                continue
            ld = row["methods"]["ldte_bs"]
            for name in VERSUS_LDTE:
                if name in row["methods"]:
                    m = row["methods"][name]
                    print(
                        f"{kind:8s} 2^{lg:<2d} {name:17s} {m['threshold_ms']:7.2f} ms"
                        f" ({m['threshold_floors']:5.1f} floors, "
                        f"{ld['threshold_ms'] / m['threshold_ms']:5.2f}x ldte_bs), count"
                        f" {m['count_over_k']:.2f}k (ldte_bs {ld['count_over_k']:.2f}k) / step"
                        f" {m['step_ms']:7.2f} ms ({ld['step_ms'] / m['step_ms']:5.2f}x ldte_bs)",
                        flush=True,
                    )
            print(
                f"{kind:8s} 2^{lg:<2d} floor {floor:7.3f} ms | top_k {base['threshold_ms']:8.2f}"
                f" / step {base['step_ms']:8.2f} ms | ldte_bs {ld['threshold_ms']:7.2f}"
                f" ({ld['threshold_speedup_vs_top_k']:5.1f}x, {ld['threshold_floors']:5.1f} floors,"
                f" {ld['iterations']} it, {ld['count_over_k']:.2f}k) / step {ld['step_ms']:7.2f}"
                f" ({ld['step_speedup_vs_top_k']:5.1f}x, {ld['step_floors']:5.1f} floors)",
                flush=True,
            )
    meta = {
        "eta": ETA,
        "repeats": repeats,
        **environment(),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_selection.json")
    with open(path, "w") as f:
        jsonio.dump({"meta": meta, "results": results}, f, indent=1)
    png = plot(results, os.path.join(out_dir, "bench_selection.png"))
    print(f"wrote {path} and {png}")
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = sorted({r["data"] for r in results}, key=["laplace", "mixture", "zeros99"].index)
    fig, axes = plt.subplots(2, len(kinds), figsize=(5.5 * len(kinds), 8.5), squeeze=False)
    for col, kind in enumerate(kinds):
        rows = [r for r in results if r["data"] == kind]
        for line, metric in enumerate(("threshold_ms", "step_ms")):
            ax = axes[line][col]
            names = list(rows[0]["methods"])
            for name in names:
                pts = [
                    (r["n"] * 4, r["methods"][name][metric]) for r in rows if name in r["methods"]
                ]
                style = "-o" if name.startswith(("ldte", "sidco")) else "--."
                ax.loglog(*zip(*pts, strict=True), style, label=name, ms=4)
            ax.loglog(
                [r["n"] * 4 for r in rows], [r["floor_ms"] for r in rows], "k:", label="floor"
            )
            ax.set_title(f"{kind}: {'selection' if line == 0 else 'full compress step'}")
            ax.set_xlabel("tensor bytes (float32)")
            ax.set_ylabel("median ms")
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"top-{ETA:g} selection on {jax.default_backend()} ({jax.__version__})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("sizes", "10,12,14,16,18,20,22,24", "log2 sizes", **fv)
    flags.DEFINE_string("data", "laplace,mixture,zeros99", "Data sets (comma list).", **fv)
    flags.DEFINE_integer("repeats", 7, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_string("methods", "", "comma-separated selectors (default all)", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    sizes = [int(s) for s in args.sizes.split(",")]
    methods = [m for m in args.methods.split(",") if m] or None
    run(sizes, args.data.split(","), args.repeats, args.out, methods)


if __name__ == "__main__":
    cli.run(main, define_flags)
