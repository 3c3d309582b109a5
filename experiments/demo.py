"""`make demo`: every sparsifying compressor on one 4M-element Laplacian gradient.

Prints, per compressor, what one error-feedback step sends (count and density
against the target k), the bytes of its (index, value) message against the
dense tensor, and the median time of one ``tx.update`` (state donated, as in
a training step) next to exact top-k's and a one-pass floor (``sum(|x|)``)
measured in the same run.

Run: ``python -m experiments.demo [--size 4194304] [--ratio 0.001]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

import jaxcomp
from experiments import cli
from experiments.presets import build, spec
from experiments.timing import median_ms, median_ms_threaded

# name -> preset (experiments.presets), built with ratio=--ratio.
COMPRESSORS = {
    "top_k": spec("top_k"),
    "ldte_bs": spec("ldte_bs"),
    "ldte_bs (paper: bisect)": spec("ldte_bs", search="bisect", aim=1.0, moment_sample=None),
    "binary_search": spec("binary_search"),
    "dgc": spec("dgc"),
    "trimmed_top_k": spec("trimmed_top_k"),
    "gaussian_k": spec("gaussian_k"),
    "random_k": spec("random_k"),
}


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines the demo's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("size", 2**22, "Elements of the gradient.", **fv)
    flags.DEFINE_float("ratio", 1e-3, "Density of the message (k = ratio * size).", **fv)


def main(argv):
    """Runs the demo; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    if args.size < 1:
        cli.fail(f"--size must be >= 1, got {args.size}")
    if not 0 < args.ratio <= 1:  # NaN too
        cli.fail(f"--ratio must be in (0, 1], got {args.ratio}")
    n, ratio = args.size, args.ratio
    rng = np.random.default_rng(0)
    # The LDTE-BS paper's test data: Laplacian, mean 5e-4, std 5e-3.
    g = {"w": jnp.asarray(rng.laplace(5e-4, 5e-3 / np.sqrt(2), n).astype(np.float32))}
    k = jaxcomp.selection.target_count(ratio, n)
    floor = median_ms(jax.jit(lambda x: jnp.sum(jnp.abs(x))), g["w"])
    print(
        f"jaxcomp demo: one compress step on {n:,} float32 Laplacian values, "
        f"ratio {ratio:g} (k = {k:,}), {jax.device_count()} {jax.default_backend()} device(s)"
    )
    print(f"one-pass floor sum(|x|): {floor:.2f} ms; dense tensor: {4 * n:,} bytes\n")
    header = (
        f"{'compressor':<26}{'sent':>8}{'sent/k':>8}{'msg bytes':>11}"
        f"{'vs dense':>10}{'iters':>6}{'ms':>9}{'x floor':>9}"
    )
    print(header)
    print("-" * len(header))
    rows = {}
    for name, preset in COMPRESSORS.items():
        tx = build(preset, ratio=ratio)
        # The optimizer state is donated, as a training step would: the new
        # residual is written in place of the old one.
        step = jax.jit(lambda state, grads, tx=tx: tx.update(grads, state)[::-1], donate_argnums=0)
        ms = median_ms_threaded(step, tx.init(g), g, next_state=lambda out: out[0])
        new_state, _ = step(tx.init(g), g)
        (sent,), (nbytes,) = new_state.sent_count.tolist(), new_state.message_bytes.tolist()
        rows[name] = ms
        print(
            f"{name:<26}{sent:>8,}{sent / k:>8.2f}{nbytes:>11,}{4 * n / nbytes:>9.0f}x"
            f"{int(new_state.search_iterations[0]):>6}{ms:>9.2f}{ms / floor:>9.1f}"
        )
    print(f"\nldte_bs step vs exact top_k step: {rows['top_k'] / rows['ldte_bs']:.1f}x faster")


if __name__ == "__main__":
    cli.run(main, define_flags)
