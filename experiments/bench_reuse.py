"""Threshold-reuse benchmark (DLGS's ``s``): step time and density drift.

For LDTE-BS and exact top-k at ``eta = 1e-3`` on one leaf of ``2^22``
Laplacian elements (the LDTE-BS paper's data, ``bench_selection.make_data``)
and reuse periods ``s = 1, 5, 20`` (``reuse_period=s``), it measures:

- ``step_ms``: the full jitted ``tx.update`` on one device (accumulate,
  select or reuse, the mask, the residual), with the optimizer state donated
  and threaded from step to step as in a training loop, and a different
  gradient each step, after ``warm_steps`` steps (the residual grows from
  zero for about ``3 n / k`` steps before its distribution settles). Steps
  of a period cost differently (the selector runs on the first only), so
  the median is taken per position in the period over ``repeats`` periods
  (interleaved: one period of every configuration per round, so that the
  load of a shared machine affects all alike) and ``step_ms`` is the mean
  of those medians: the average cost per step. ``refresh_ms`` / ``reuse_ms`` are the first
  position's median and the median over the others.
- the density drift between refreshes: on each step after a refresh,
  ``sent / k`` (capped at the capacity ``1.5 k``) and ``above / k``, the
  uncapped count ``#{|R| > H}`` with the stored threshold, averaged over
  ``drift_periods`` periods per position: ``density`` after the warm-up
  (steady state) and ``density_start`` from the second period on (a residual
  still growing from zero, as at the start of training).
- the kernel, the scalar decision that reuse replaces, as medians (also
  interleaved):
  ``select_ms`` (the selector alone on one gradient, what a refresh step
  runs) and ``apply_ms`` (``count_above(|R|, H)`` with a stored threshold,
  what a reuse step runs); ``kernel_ms = (select_ms + (s - 1) apply_ms) / s``
  is the kernel's average cost per step.
- ``floor_ms``: one memory pass, ``jnp.sum(jnp.abs(x))``, in the same run.

Ratios (``speedup_vs_s1`` for the update, ``kernel_speedup_vs_s1``) are
against ``s = 1`` of the same method and against exact top-k with
``s = 1``, measured in the same run. Writes ``<out>/bench_reuse.json`` and
``<out>/bench_reuse.png``.

Run: ``python -m experiments.bench_reuse [--log2_n 22] [--periods 1,5,20]
[--methods ldte_bs,top_k] [--repeats 7] [--warm_steps 3000] [--out results]``.
"""

from __future__ import annotations

import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import cli, jsonio
from experiments.bench_selection import make_data
from experiments.presets import build, spec
from experiments.timing import environment, median_ms
from jaxcomp.selection import _kernels as kernels
from jaxcomp.selection import selectors

ETA = 1e-3
# name -> preset (experiments.presets), built with reuse_period=s.
METHODS = {"ldte_bs": spec("ldte_bs", ratio=ETA), "top_k": spec("top_k", ratio=ETA)}
SELECTORS = {"ldte_bs": selectors.ldte_bs, "top_k": selectors.exact_top_k}  # the kernels
NUM_GRADIENTS = 7  # distinct gradients, cycled (7 is prime to every period measured)


def _update_fn(tx, donate: bool):
    def step(state, g):
        updates, state = tx.update({"g": g}, state)
        return updates, state

    return jax.jit(step, donate_argnums=0 if donate else ())


def _time_period(fn, state, grads, s: int):
    """Wall times (ms) of the ``s`` steps of one period, and the state after it."""
    row = []
    i = int(state.step)
    for j in range(i, i + s):
        t0 = time.perf_counter()
        _, state = jax.block_until_ready(fn(state, grads[j % len(grads)]))
        row.append(1e3 * (time.perf_counter() - t0))
    return row, state


def _advance(fn, state, grads, steps: int):
    i = int(state.step)
    for j in range(i, i + steps):
        _, state = fn(state, grads[j % len(grads)])
    return jax.block_until_ready(state)


def _drift(fn, state, grads, s: int, k: int, periods: int):
    """Mean ``sent / k`` and ``above / k`` per position over ``periods`` periods."""
    above_fn = jax.jit(lambda r, g, t: jnp.sum(jnp.abs(r + g) > t, dtype=jnp.int32))
    sent = [[] for _ in range(s)]
    above = [[] for _ in range(s)]
    i = int(state.step)
    for _ in range(periods):
        for j in range(s):
            g = grads[i % len(grads)]
            _, new = fn(state, g)
            (count,), (t,) = new.sent_count, new.threshold  # the one leaf's entries
            sent[j].append(int(count) / k)
            above[j].append(int(above_fn(state.residual["g"], g, t)) / k)
            state = new
            i += 1
    density = {
        "sent_over_k": [float(np.mean(v)) for v in sent],
        "above_over_k": [float(np.mean(v)) for v in above],
    }
    return density, state


def run(log2_n, periods, methods, repeats, out_dir, drift_periods=3, warm_steps=3000):
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
    kernel, configs = {}, []
    for method in methods:
        select = jax.jit(lambda x, m=method: SELECTORS[m](x, k)[:2])
        apply = jax.jit(lambda x, t: kernels.count_above(jnp.abs(x), t))
        stored = select(grads[0])[0]
        kernel[method] = {"select": (select, (grads[0],)), "apply": (apply, (grads[1], stored))}
        for s in periods:
            tx = build(METHODS[method], reuse_period=s)
            fn, fn_kept = _update_fn(tx, donate=True), _update_fn(tx, donate=False)
            state = _advance(fn_kept, tx.init({"g": grads[0]}), grads, s)  # skip a zero residual
            start, state = _drift(fn_kept, state, grads, s, k, drift_periods)
            state = _advance(fn, state, grads, -(-warm_steps // s) * s - int(state.step))
            configs.append(dict(method=method, s=s, fns=(fn, fn_kept), state=state, start=start))
    # Timing: one period of every configuration (and one call of every kernel)
    # per round, so that the load of a shared machine drifts over all of them
    # alike. Round 0 warms up.
    for c in configs:
        c["times"] = []
    kernel_ms = {(m, name): [] for m in methods for name in ("select", "apply")}
    for rnd in range(repeats + 1):
        for (method, name), times in kernel_ms.items():
            f, args = kernel[method][name]
            times.append(median_ms(f, *args, warmup=1, repeats=1))
        for c in configs:
            row, c["state"] = _time_period(c["fns"][0], c["state"], grads, c["s"])
            if rnd:
                c["times"].append(row)
    kernel = {key: statistics.median(times[1:]) for key, times in kernel_ms.items()}
    for c in configs:
        method, s = c["method"], c["s"]
        steady, _ = _drift(c["fns"][1], c["state"], grads, s, k, drift_periods)
        by_position = [statistics.median(col) for col in zip(*c["times"], strict=True)]
        select_ms, apply_ms = kernel[method, "select"], kernel[method, "apply"]
        row = {
            "method": method,
            "s": s,
            "n": n,
            "k": k,
            "step_ms": float(np.mean(by_position)),
            "refresh_ms": by_position[0],
            "reuse_ms": statistics.median(by_position[1:]) if s > 1 else None,
            "step_ms_by_position": by_position,
            "select_ms": select_ms,
            "apply_ms": apply_ms,
            "kernel_ms": (select_ms + (s - 1) * apply_ms) / s,
            "density_start": c["start"],
            "density": steady,
        }
        row["step_floors"] = row["step_ms"] / floor
        results.append(row)
        d, d0 = row["density"], row["density_start"]
        print(
            f"{method:8s} s={s:<3d} step {row['step_ms']:8.2f} ms ({row['step_floors']:5.1f} "
            f"floors) | refresh {row['refresh_ms']:7.2f} ms"
            + (f", reuse {row['reuse_ms']:7.2f} ms" if s > 1 else "")
            + f" | kernel {row['kernel_ms']:6.2f} ms"
            + f" | sent/k {d['sent_over_k'][0]:.2f} -> {d['sent_over_k'][-1]:.2f},"
            f" above/k -> {d['above_over_k'][-1]:.2f} (from zero:"
            f" {d0['above_over_k'][-1]:.2f})",
            flush=True,
        )
    base = {r["method"]: r for r in results if r["s"] == 1}
    top_k_1 = base["top_k"]["step_ms"] if "top_k" in base else None
    for r in results:
        r["speedup_vs_s1"] = base[r["method"]]["step_ms"] / r["step_ms"]
        r["kernel_speedup_vs_s1"] = base[r["method"]]["kernel_ms"] / r["kernel_ms"]
        r["speedup_vs_top_k_s1"] = None if top_k_1 is None else top_k_1 / r["step_ms"]
    meta = {
        "eta": ETA,
        "log2_n": log2_n,
        "repeats": repeats,
        "drift_periods": drift_periods,
        "warm_steps": warm_steps,
        "num_gradients": NUM_GRADIENTS,
        "floor_ms": floor,
        "capacity_over_k": math.ceil(1.5 * k) / k,
        **environment(),
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "bench_reuse.json")
    with open(path, "w") as f:
        jsonio.dump({"meta": meta, "results": results}, f, indent=1)
    png = plot(results, os.path.join(out_dir, "bench_reuse.png"))
    print(f"wrote {path} and {png}")
    return results


def plot(results, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator, NullFormatter

    fig, (ax_t, *ax_d) = plt.subplots(1, 3, figsize=(16, 4.6))
    methods = list(dict.fromkeys(r["method"] for r in results))
    for method in methods:
        rows = [r for r in results if r["method"] == method]
        (line,) = ax_t.plot(
            [r["s"] for r in rows], [r["step_ms"] for r in rows], "-o", label=f"{method} update"
        )
        ax_t.plot(
            [r["s"] for r in rows],
            [r["kernel_ms"] for r in rows],
            "--s",
            color=line.get_color(),
            label=f"{method} kernel (select/apply)",
        )
        for r in rows:
            if r["s"] == 1:
                continue
            for ax, d in zip(ax_d, (r["density"], r["density_start"]), strict=True):
                steps = range(r["s"])
                (line,) = ax.plot(steps, d["above_over_k"], "-", label=f"{method} s={r['s']}")
                ax.plot(steps, d["sent_over_k"], ":", color=line.get_color())
    ax_t.set_xscale("log")
    ax_t.set_yscale("log")
    periods = sorted({r["s"] for r in results})
    ax_t.set_xticks(periods, [str(s) for s in periods])
    ax_t.xaxis.set_minor_formatter(NullFormatter())
    ax_t.set_xlabel("reuse period s")
    ax_t.set_ylabel("ms per step (mean over a period of medians)")
    ax_t.set_title(
        f"jitted update (state donated) and kernel, n = 2^{results[0]['n'].bit_length() - 1}"
    )
    ax_t.legend(fontsize=8)
    titles = (
        "drift, steady state (after warm-up)",
        "drift, residual growing from zero (same colors)",
    )
    for ax, title in zip(ax_d, titles, strict=True):
        ax.axhline(1.0, color="k", lw=0.5)
        ax.axhline(1.5, color="k", lw=0.5, ls="--")
        ax.set_xlabel("steps since the threshold was selected")
        ax.set_ylabel("#{|R| > H} / k (solid), sent / k (dotted)")
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_d[1].set_yscale("log")
    for ax in (ax_t, ax_d[1]):
        ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    for ax in (ax_t, *ax_d):
        ax.grid(True, which="both", alpha=0.3)
    ax_d[0].legend(fontsize=8, title="capacity 1.5 k: dashed", title_fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("log2_n", 22, "log2 of the gradient size.", **fv)
    flags.DEFINE_string("periods", "1,5,20", "reuse periods s", **fv)
    flags.DEFINE_string("methods", "ldte_bs,top_k", "Sparsifiers (comma list).", **fv)
    flags.DEFINE_integer("repeats", 7, "Timed repeats (median; at least 5).", **fv)
    flags.DEFINE_integer("drift_periods", 3, "Reuse periods of the drift measurement.", **fv)
    flags.DEFINE_integer("warm_steps", 3000, "Steps before the drift measurement.", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)


def main(argv):
    """Runs the program; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    cli.check_repeats(args.repeats)
    run(
        args.log2_n,
        [int(s) for s in args.periods.split(",")],
        [m for m in args.methods.split(",") if m],
        args.repeats,
        args.out,
        args.drift_periods,
        args.warm_steps,
    )


if __name__ == "__main__":
    cli.run(main, define_flags)
