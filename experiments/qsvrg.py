"""QSVRG vs quantized SGD on ridge regression: the QSGD paper's linear convergence (section 3.3).

Ridge regression ``f(w) = 1/(2M) ||A w - y||^2 + lam/2 ||w||^2`` (strongly
convex) on synthetic data split over every device (8 simulated CPU devices by
default; ``--num_devices`` takes fewer); the exact
optimum comes from numpy (``(A^T A / M + lam I) w = A^T y / M``). Both methods
use the same QSGD codec, step size, sampler and epoch length
(:func:`jaxcomp.distributed.make_qsvrg_epoch`): QSVRG with an unquantized
full gradient per epoch, the baseline (``variance_reduced=False``) plain
quantized SGD. Log suboptimality against epochs is a straight line for QSVRG
(linear rate) and flattens at a noise floor for quantized SGD::

    python -m experiments.qsvrg --out=results/qsvrg

Writes ``qsvrg.json`` (per-epoch suboptimality, the fitted rate per epoch,
bytes per device) and ``qsvrg.png``.

``--variant=paper`` runs QSVRG as section 3.3 states it: ``s = ceil(sqrt(n))``
levels over the whole ``n``-vector (``qsvrg(..., variant="paper")``),
single-example steps (``--batch_size`` is 1) and the mean of the epoch's
iterates as the next snapshot; it reports, per epoch and device, Theorem
3.6's bound ``(F + 2.8 n)(T + 1) + F n`` bits beside the bits sent: the
full gradient (``F n``) plus ``T`` messages, packed as sent and Elias-coded
(:func:`jaxcomp.coding.coded_message_bytes` of the epoch's last message,
times ``T``)::

    python -m experiments.qsvrg --variant=paper --out=results/qsvrg_paper
"""

from __future__ import annotations

import os

N_DEVICES = 8
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={N_DEVICES}"
    ).strip()

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, jsonio  # noqa: E402
from jaxcomp import coding  # noqa: E402
from jaxcomp import distributed as dist  # noqa: E402
from jaxcomp.distributed import make_qsvrg_epoch  # noqa: E402
from jaxcomp.transforms.qsvrg import QSVRG_VARIANTS, qsvrg, qsvrg_paper_levels  # noqa: E402

__all__ = ["define_flags", "main", "ridge_problem", "run", "write"]


def ridge_problem(n_devices, per_device, dim, lam, seed):
    """(data dict, loss_fn, f(w) in float64, w_star, f_star): rows of norm ~1."""
    rng = np.random.default_rng(seed)
    a = (rng.normal(size=(n_devices * per_device, dim)) / np.sqrt(dim)).astype(np.float32)
    y = (a @ rng.normal(size=dim) + 0.1 * rng.normal(size=len(a))).astype(np.float32)
    a64, y64 = a.astype(np.float64), y.astype(np.float64)
    m = len(a)
    w_star = np.linalg.solve(a64.T @ a64 / m + lam * np.eye(dim), a64.T @ y64 / m)

    def f(w):
        w = np.asarray(w, np.float64)
        return 0.5 * np.mean((a64 @ w - y64) ** 2) + 0.5 * lam * w @ w

    def loss_fn(w, batch):
        return 0.5 * jnp.mean((batch["x"] @ w - batch["y"]) ** 2) + 0.5 * lam * jnp.sum(w * w)

    return {"x": a, "y": y}, loss_fn, f, w_star, f(w_star)


def run(
    *,
    epochs=12,
    epoch_length=200,
    batch_size=4,
    lr=0.1,
    bits=2,
    dim=32,
    examples_per_device=128,
    lam=0.01,
    seed=0,
    mesh=None,
    variant="default",
):
    """Both methods; returns per-epoch suboptimality ``f(w_p) - f*`` and bytes.

    ``variant="paper"``: ``s = ceil(sqrt(dim))`` (``bits`` unused), one
    example per step (``batch_size`` must be 1), the averaged snapshot, and
    per epoch Theorem 3.6's bits beside the measured ones (``bits_per_epoch``).
    """
    if variant not in QSVRG_VARIANTS:
        raise ValueError(f"variant must be one of {QSVRG_VARIANTS}, got {variant!r}")
    paper = variant == "paper"
    if paper and batch_size != 1:
        raise ValueError(
            f"variant='paper' takes single-example steps: batch_size must be 1, got {batch_size}"
        )
    mesh = mesh or jax.make_mesh((jax.device_count(),), ("data",))
    n_dev = mesh.shape["data"]
    data, loss_fn, f, _, f_star = ridge_problem(n_dev, examples_per_device, dim, lam, seed)
    batch = dist.shard_batch(data, mesh)
    out = {
        "f_star": f_star,
        "config": dict(
            epochs=epochs,
            epoch_length=epoch_length,
            batch_size=batch_size,
            lr=lr,
            bits=bits,
            dim=dim,
            examples_per_device=examples_per_device,
            lam=lam,
            seed=seed,
            devices=n_dev,
            variant=variant,
            levels=qsvrg_paper_levels(dim) if paper else 2**bits,
            average=paper,
        ),
    }
    codec = dict(variant="paper", keep_message=True) if paper else dict(bits=bits)
    for name, reduced in (("qsvrg", True), ("qsgd", False)):
        tx = qsvrg(lr, axis_name="data", seed=seed, **codec)
        params = dist.replicate(jnp.zeros(dim, jnp.float32), mesh)
        state = dist.init_opt_state(tx, params, mesh)
        epoch = make_qsvrg_epoch(
            loss_fn,
            tx,
            mesh,
            epoch_length=epoch_length,
            batch_size=batch_size,
            variance_reduced=reduced,
            average=paper,
        )
        sub, wire, coded = [f(np.asarray(params)) - f_star], [], []
        for p in range(epochs):
            params, state, metrics = epoch(params, state, batch, jax.random.key(seed * 1000 + p))
            jax.block_until_ready(params)
            sub.append(f(np.asarray(params)) - f_star)
            wire.append(float(metrics["wire_bytes"]))
            if paper:
                coded.append(_sent_bits(state, params, dim, epoch_length, reduced))
        ratios = np.array(sub[1:]) / np.array(sub[:-1])
        out[name] = {
            "suboptimality": sub,
            # Geometric-mean contraction per epoch over all epochs.
            "rate_per_epoch": float(np.exp(np.mean(np.log(ratios)))),
            "worst_ratio": float(np.max(ratios)),
            "wire_bytes_per_epoch": float(np.mean(wire)),
        }
        if paper:
            out[name]["bits_per_epoch"] = {
                "theorem_3_6": coding.qsvrg_epoch_bits_bound(dim, epoch_length),
                "packed": [c[0] for c in coded],
                "elias": [c[1] for c in coded],
            }
    return out


def _sent_bits(state, params, dim, epoch_length, reduced):
    """(packed, Elias-coded) bits device 0 sent this epoch: ``F n`` + ``T`` messages.

    The packed size is the same every step (static shapes); the Elias-coded
    one is the epoch's last message's, taken as every step's.
    """
    local = jax.tree.map(lambda a: np.asarray(a)[0], state)
    full = 32 * dim if reduced else 0
    packed = sum(int(b) for b in jax.tree.leaves(local.message_bytes))
    elias = coding.coded_message_bytes(
        local, np.asarray(params), s=qsvrg_paper_levels(dim), bucket_size=None
    )
    return (
        float(full + 8 * epoch_length * packed),
        float(full + 8 * epoch_length * sum(jax.tree.leaves(elias))),
    )


def _plot(result, path):
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, label in (("qsvrg", "QSVRG"), ("qsgd", "quantized SGD")):
        sub = result[name]["suboptimality"]
        ax.semilogy(
            range(len(sub)),
            sub,
            "o-",
            label=f"{label} (x{result[name]['rate_per_epoch']:.2g}/epoch)",
        )
    c = result["config"]
    ax.set_xlabel(f"epoch ({c['epoch_length']} steps, {c['devices']} devices)")
    ax.set_ylabel("f(w) - f*")
    codec = f"QSGD s = {c['levels']}" + (" = ceil(sqrt n), paper mode" if c["average"] else "")
    ax.set_title(f"ridge regression, {codec}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_integer("epochs", 12, "Epochs (snapshots) per method.", **fv)
    flags.DEFINE_integer("epoch_length", 200, "Inner steps per epoch (T).", **fv)
    flags.DEFINE_integer("batch_size", 4, "Examples per device per step.", **fv)
    flags.DEFINE_float("lr", 0.1, "Step size of both methods.", **fv)
    flags.DEFINE_integer("bits", 2, "QSGD bits: s = 2**bits levels.", **fv)
    flags.DEFINE_integer("dim", 32, "Features.", **fv)
    flags.DEFINE_integer("examples_per_device", 128, "Examples per device.", **fv)
    flags.DEFINE_float("lam", 0.01, "Ridge regularisation (strong convexity).", **fv)
    flags.DEFINE_integer("seed", 0, "Data and sampling seed.", **fv)
    flags.DEFINE_string("out", "results/qsvrg", "Output directory.", **fv)
    flags.DEFINE_enum(
        "variant",
        "default",
        list(QSVRG_VARIANTS),
        "paper: s = ceil(sqrt(dim)), batch 1, averaged snapshot, Theorem 3.6's bits.",
        **fv,
    )
    flags.DEFINE_integer(
        "num_devices",
        None,
        "Devices of the data axis (default: every device; 8 simulated on CPU).",
        **fv,
    )


def main(argv):
    """Runs both methods, writes the JSON and PNG; ``argv``: see :mod:`experiments.cli`."""
    v = cli.parse(define_flags, argv)
    available = jax.device_count()
    n = available if v.num_devices is None else v.num_devices
    if not 1 <= n <= available:
        cli.fail(f"--num_devices must be in [1, {available}] (devices here), got {n}")
    paper = v.variant == "paper"
    result = run(
        mesh=jax.make_mesh((n,), ("data",), devices=jax.devices()[:n]),
        epochs=v.epochs,
        epoch_length=v.epoch_length,
        batch_size=1 if paper else v.batch_size,
        variant=v.variant,
        lr=v.lr,
        bits=v.bits,
        dim=v.dim,
        examples_per_device=v.examples_per_device,
        lam=v.lam,
        seed=v.seed,
    )
    write(result, v.out)
    for name in ("qsvrg", "qsgd"):
        r = result[name]
        print(
            f"{name}: final f - f* = {r['suboptimality'][-1]:.3e}, "
            f"rate per epoch {r['rate_per_epoch']:.3f}, "
            f"{r['wire_bytes_per_epoch']:.0f} bytes/device/epoch"
        )
    if paper:
        b = result["qsvrg"]["bits_per_epoch"]
        print(
            f"qsvrg bits sent per device per epoch: Theorem 3.6 bound {b['theorem_3_6']:.0f}; "
            f"packed {np.mean(b['packed']):.0f}, Elias-coded {np.mean(b['elias']):.0f} "
            f"(min {np.min(b['elias']):.0f}, max {np.max(b['elias']):.0f})"
        )


def write(result, out_dir):
    """Writes ``qsvrg.json`` and ``qsvrg.png`` to ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "qsvrg.json").write_text(jsonio.dumps(result, indent=2))
    _plot(result, out / "qsvrg.png")
    return out / "qsvrg.json", out / "qsvrg.png"


if __name__ == "__main__":
    cli.run(main, define_flags)
