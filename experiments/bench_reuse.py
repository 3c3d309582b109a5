"""Threshold-reuse benchmark (DLGS's ``s``): step time and density drift.

For LDTE-BS and exact top-k at ``eta = 1e-3`` on one leaf of ``2^22``
Laplacian elements (the LDTE-BS paper's data, ``bench_selection.make_data``)
and reuse periods ``s = 1, 5, 20`` (``reuse_period=s``), it measures:

- ``step_ms``: the full jitted ``tx.update`` on one device (accumulate,
  select or reuse, the mask, the residual), with the optimizer state donated
  and threaded from step to step as in a training loop, and a different
  gradient each step. Steps of a period cost differently (the selector runs
  on the first only), so the median is taken per position in the period over
  ``repeats`` periods and ``step_ms`` is the mean of those medians: the
  average cost per step. ``refresh_ms`` / ``reuse_ms`` are the first
  position's median and the median over the others.
- the density drift between refreshes: on each step after a refresh,
  ``sent / k`` (capped at the capacity ``1.5 k``) and ``above / k``, the
  uncapped count ``#{|R| > H}`` with the stored threshold, averaged over
  ``drift_periods`` periods per position.
- ``floor_ms``: one memory pass, ``jnp.sum(jnp.abs(x))``, in the same run.

Ratios are against ``s = 1`` of the same method and against exact top-k with
``s = 1``, measured in the same run. Writes ``<out>/bench_reuse.json`` and
``<out>/bench_reuse.png``.

Run: ``python -m experiments.bench_reuse [--log2_n 22] [--periods 1,5,20]
[--methods ldte_bs,top_k] [--repeats 7] [--out results]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jaxcomp
from experiments.bench_selection import make_data
from experiments.timing import median_ms
from jaxcomp.selection import selectors

ETA = 1e-3
METHODS = {
    "ldte_bs": lambda s: jaxcomp.ldte_bs(ETA, reuse_period=s),
    "top_k": lambda s: jaxcomp.top_k(ETA, reuse_period=s),
}
NUM_GRADIENTS = 7  # distinct gradients, cycled (7 is prime to every period measured)


def _update_fn(tx, donate: bool):
    def step(state, g):
        updates, state = tx.update({"g": g}, state)
        return updates, state

    return jax.jit(step, donate_argnums=0 if donate else ())


def _time_periods(fn, state, grads, s: int, repeats: int) -> list[list[float]]:
    """Wall times (ms) of every step of ``repeats`` periods after one warm-up period."""
    times = []
    i = 0
    for period in range(repeats + 1):
        row = []
        for _ in range(s):
            t0 = time.perf_counter()
            _, state = jax.block_until_ready(fn(state, grads[i % len(grads)]))
            row.append(1e3 * (time.perf_counter() - t0))
            i += 1
        if period:  # the first period warms up (compilation, first-touch pages)
            times.append(row)
    return times


def _drift(tx, grads, s: int, k: int, periods: int) -> dict:
    """Mean ``sent / k`` and ``above / k`` per position after a refresh."""
    fn = _update_fn(tx, donate=False)
    above_fn = jax.jit(lambda r, g, t: jnp.sum(jnp.abs(r + g) > t, dtype=jnp.int32))
    state = tx.init({"g": grads[0]})
    sent = [[] for _ in range(s)]
    above = [[] for _ in range(s)]
    i = 0
    for period in range(periods + 1):
        for j in range(s):
            g = grads[i % len(grads)]
            _, new = fn(state, g)
            if period:  # the first period starts from a zero residual: skipped
                sent[j].append(int(new.sent_count["g"]) / k)
                above[j].append(int(above_fn(state.residual["g"], g, new.threshold["g"])) / k)
            state = new
            i += 1
    return {
        "sent_over_k": [float(np.mean(v)) for v in sent],
        "above_over_k": [float(np.mean(v)) for v in above],
    }


def run(log2_n, periods, methods, repeats, out_dir, drift_periods=3):
    """Times every method at every reuse period; returns the result rows."""
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"methods must be among {sorted(METHODS)}, got unknown {unknown}")
    periods = sorted(set(periods) | {1})  # s = 1 is the baseline
    n = 2**log2_n
    k = selectors.target_count(ETA, n)
    grads = [jnp.asarray(make_data("laplace", n, seed)) for seed in range(NUM_GRADIENTS)]
    floor = median_ms(jax.jit(lambda v: jnp.sum(jnp.abs(v))), grads[0], repeats=repeats)
    results = []
    for method in methods:
        for s in periods:
            tx = METHODS[method](s)
            fn = _update_fn(tx, donate=True)
            times = _time_periods(fn, tx.init({"g": grads[0]}), grads, s, repeats)
            by_position = [statistics.median(col) for col in zip(*times, strict=True)]
            row = {
                "method": method,
                "s": s,
                "n": n,
                "k": k,
                "step_ms": float(np.mean(by_position)),
                "refresh_ms": by_position[0],
                "reuse_ms": statistics.median(by_position[1:]) if s > 1 else None,
                "step_ms_by_position": by_position,
                "density": _drift(tx, grads, s, k, drift_periods),
            }
            row["step_floors"] = row["step_ms"] / floor
            results.append(row)
            d = row["density"]
            print(
                f"{method:8s} s={s:<3d} step {row['step_ms']:8.2f} ms ({row['step_floors']:5.1f} "
                f"floors) | refresh {row['refresh_ms']:7.2f} ms"
                + (f", reuse {row['reuse_ms']:7.2f} ms" if s > 1 else "")
                + f" | sent/k {d['sent_over_k'][0]:.2f} -> {d['sent_over_k'][-1]:.2f},"
                f" above/k -> {d['above_over_k'][-1]:.2f}",
                flush=True,
            )
    base = {r["method"]: r["step_ms"] for r in results if r["s"] == 1}
    top_k_1 = base.get("top_k")
    for r in results:
        r["speedup_vs_s1"] = base[r["method"]] / r["step_ms"]
        r["speedup_vs_top_k_s1"] = None if top_k_1 is None else top_k_1 / r["step_ms"]
    meta = {
        "eta": ETA,
        "log2_n": log2_n,
        "repeats": repeats,
        "drift_periods": drift_periods,
        "num_gradients": NUM_GRADIENTS,
        "floor_ms": floor,
        "capacity_over_k": math.ceil(1.5 * k) / k,
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_reuse.json")
    with open(path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    png = plot(results, os.path.join(out_dir, "bench_reuse.png"))
    print(f"wrote {path} and {png}")
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_d) = plt.subplots(1, 2, figsize=(11, 4.2))
    methods = list(dict.fromkeys(r["method"] for r in results))
    for method in methods:
        rows = [r for r in results if r["method"] == method]
        ax_t.plot([r["s"] for r in rows], [r["step_ms"] for r in rows], "-o", label=method)
        for r in rows:
            if r["s"] == 1:
                continue
            d = r["density"]
            steps = range(r["s"])
            (line,) = ax_d.plot(steps, d["above_over_k"], "-", label=f"{method} s={r['s']} above")
            ax_d.plot(steps, d["sent_over_k"], ":", color=line.get_color(), label="sent (capped)")
    ax_t.set_xscale("log")
    ax_t.set_xlabel("reuse period s")
    ax_t.set_ylabel("mean ms per step (median per position)")
    ax_t.set_title(f"full update, n = {results[0]['n']}, eta = {ETA:g}")
    ax_t.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    ax_d.axhline(1.0, color="k", lw=0.5)
    ax_d.axhline(1.5, color="k", lw=0.5, ls="--")
    ax_d.set_xlabel("steps since the threshold was selected")
    ax_d.set_ylabel("count / k")
    ax_d.set_title("density drift with a stored threshold")
    ax_d.grid(True, alpha=0.3)
    ax_d.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--log2_n", type=int, default=22)
    parser.add_argument("--periods", default="1,5,20", help="reuse periods s")
    parser.add_argument("--methods", default="ldte_bs,top_k")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--drift_periods", type=int, default=3)
    parser.add_argument("--out", default="results")
    args = parser.parse_args(argv)
    if args.repeats < 5:
        parser.error("--repeats must be >= 5 (medians of at least 5 runs)")
    run(
        args.log2_n,
        [int(s) for s in args.periods.split(",")],
        [m for m in args.methods.split(",") if m],
        args.repeats,
        args.out,
        args.drift_periods,
    )


if __name__ == "__main__":
    main()
