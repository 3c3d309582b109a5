"""Host-side coding benchmark: QSGD's Elias wire format and the sparse formats.

For QSGD at n = 2^16..2^22 (Gaussian data quantized with QSGD's stochastic
rounding in numpy) it measures, as medians after warm-up, the encode and
decode throughput in million coordinates per second on one core, and the
exact bits per coordinate against Theorem 3.2's bound (o(1) := 0) and, at
s = sqrt(n), the paper's 2.8n + 32, next to the fixed-width size the training
transform sends (``jaxcomp.qsgd``'s ``message_bytes``: 1 sign bit +
ceil(log2(s + 1)) level bits per coordinate, packed, plus the scales).
Configurations, with "b-bit" meaning ``s = 2^b`` levels (sign separate), the
QSGD paper's convention and ``jaxcomp.qsgd(bits=b)``'s (4 bits, bucket 512:
variance bound sqrt(512) / 2^4 = 1.41):

- 2-bit, bucket 128 (s = 4); 4-bit, bucket 512 (s = 16);
  8-bit, bucket 512 (s = 256); s = sqrt(n), one bucket.

Plus the sparse formats ("rle": 16-bit zero runs + 32-bit values; "elias":
Elias gaps + 32-bit values) at density 1e-3 (throughput in coordinates of
the dense vector per second, and bits per selected value).

Plus the other quantizers' messages, made by the codecs the transforms run
(``jaxcomp.transforms.quantize``, jitted, on the same Gaussian data): TernGrad,
natural compression, natural dithering (s = 8, bucket 512), Signum's unit
signs and the bfloat16/float16 casts. For each, the fixed-width bits per value
that ``message_bytes`` reports against the order-0 entropy of its codes (the
floor for any coder that codes values independently); for the two whose
codes are QSGD levels (TernGrad: s = 1; natural dithering: level indices
0..s), the exact Elias-coded size in QSGD's wire format with its encode and
decode throughput and a round-trip check.

Targets (issue 4): >= 20 M coordinates/s encode and decode for 4-bit bucket
512 at 2^22; measured bits never above the paper's bound.

One core: numpy's element-wise kernels are single-threaded; BLAS/OpenMP
threads are pinned to 1 below anyway. Writes ``<out>/bench_coding.json`` and
``<out>/bench_coding.png``.

Run: ``python -m experiments.bench_coding [--sizes 16,17,...,22] [--repeats 5]
[--out results] [--peers=terngrad,natural]`` (``--peers=``: no peer
rows).
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags  # noqa: E402

from experiments import cli, jsonio  # noqa: E402
from experiments.timing import environment  # noqa: E402
from jaxcomp import coding  # noqa: E402
from jaxcomp.quantization import (  # noqa: E402
    cast_quantizer,
    message_nbytes,
    natural_dithering_quantizer,
    natural_quantizer,
    qsgd_levels,
    qsgd_quantizer,
    sign_quantizer,
    terngrad_quantizer,
    unpack_codes,
)

QSGD_CONFIGS = (  # (name, bits or None for s = sqrt(n), bucket size)
    ("2-bit/128", 2, 128),
    ("4-bit/512", 4, 512),
    ("8-bit/512", 8, 512),
    ("s=sqrt(n)", None, None),
)
SPARSE_RATIO = 1e-3
TARGET_MCOORDS = 20.0
# name -> (codec, code bits, QSGD levels s when the codes are QSGD levels, bucket size).
PEER_CONFIGS = {
    "terngrad": (lambda: terngrad_quantizer(), 2, 1, None),
    "natural": (natural_quantizer, 9, None, None),
    "natural_dithering/8/512": (lambda: natural_dithering_quantizer(8, 512), 5, 8, 512),
    "signum": (lambda: sign_quantizer(scale="unit"), 1, None, None),
    "cast_bf16": (lambda: cast_quantizer(jnp.bfloat16), 16, None, None),
    "cast_fp16": (lambda: cast_quantizer(jnp.float16), 16, None, None),
}


def qsgd_quantize(v, s, bucket_size, rng):
    """QSGD's stochastic rounding: l = floor(|v|/||v|| s) + Bernoulli(fraction), per bucket."""
    n = v.size
    d = bucket_size or n
    nb = -(-n // d)
    pad = np.zeros(nb * d, np.float32)
    pad[:n] = v
    b = pad.reshape(nb, d)
    norm = np.linalg.norm(b, axis=1).astype(np.float32)
    r = np.abs(b) / np.where(norm > 0, norm, 1)[:, None] * s
    levels = np.floor(r)
    levels += rng.random(r.shape) < (r - levels)
    return levels.astype(np.int64).ravel()[:n], (pad < 0)[:n], norm


def median_s(fn, warmup=1, repeats=5):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_qsgd(n, name, bits, bucket_size, rng, repeats):
    s = qsgd_levels(bits=bits) if bits else math.isqrt(n)  # the one "b-bit" convention
    v = rng.standard_normal(n).astype(np.float32)
    levels, signs, scales = qsgd_quantize(v, s, bucket_size, rng)
    kw = dict(s=s, bucket_size=bucket_size)
    data = coding.encode_qsgd(levels, signs, scales, **kw)
    out = coding.decode_qsgd(data, n=n, **kw)
    exact = bool((out[0] == levels).all() and (out[1] == (signs & (levels > 0))).all())
    t_enc = median_s(lambda: coding.encode_qsgd(levels, signs, scales, **kw), repeats=repeats)
    t_dec = median_s(lambda: coding.decode_qsgd(data, n=n, **kw), repeats=repeats)
    msg_bits = coding.qsgd_bits(levels, **kw)
    bound = coding.qsgd_bits_bound(n, s, bucket_size)
    fixed_bytes = message_nbytes(qsgd_quantizer(s, bucket_size), n)  # what the transform packs
    row = dict(
        kind="qsgd",
        config=name,
        n=n,
        s=s,
        bucket_size=bucket_size,
        exact=exact,
        nonzeros=int((levels > 0).sum()),
        bytes=len(data),
        bits=msg_bits,
        bits_per_coord=msg_bits / n,
        bound_bits=bound,
        within_bound=msg_bits <= bound,
        fixed_width_bytes=fixed_bytes,
        fixed_width_bits_per_coord=8 * fixed_bytes / n,
        encode_mcoords_s=n / t_enc / 1e6,
        decode_mcoords_s=n / t_dec / 1e6,
        encode_ms=1e3 * t_enc,
        decode_ms=1e3 * t_dec,
    )
    if bits is None:
        row["dense_bound_bits"] = coding.qsgd_dense_bound(n)
        row["within_dense_bound"] = msg_bits <= coding.qsgd_dense_bound(n)
    return row


def bench_sparse(n, fmt, rng, repeats):
    k = max(1, math.ceil(SPARSE_RATIO * n))
    indices = np.sort(rng.choice(n, k, replace=False))
    values = rng.standard_normal(k).astype(np.float32)
    data = coding.encode_sparse(indices, values, n, format=fmt)
    idx, val = coding.decode_sparse(data, n, format=fmt)
    exact = bool((idx == indices).all() and (val.view(np.uint32) == values.view(np.uint32)).all())
    t_enc = median_s(lambda: coding.encode_sparse(indices, values, n, format=fmt), repeats=repeats)
    t_dec = median_s(lambda: coding.decode_sparse(data, n, format=fmt), repeats=repeats)
    msg_bits = coding.sparse_bits(indices, n, format=fmt)
    return dict(
        kind="sparse",
        config=fmt,
        n=n,
        k=k,
        exact=exact,
        bytes=len(data),
        bits=msg_bits,
        bits_per_coord=msg_bits / n,
        bits_per_value=msg_bits / k,
        encode_mcoords_s=n / t_enc / 1e6,
        decode_mcoords_s=n / t_dec / 1e6,
        encode_ms=1e3 * t_enc,
        decode_ms=1e3 * t_dec,
    )


def _entropy_bits(codes: np.ndarray) -> float:
    """Order-0 empirical entropy of the codes, in bits per code."""
    _, counts = np.unique(codes, return_counts=True)
    p = counts / codes.size
    return float(-(p * np.log2(p)).sum())


def bench_peer(n, name, rng, repeats):
    """Fixed-width vs entropy bits of one codec's real message (and Elias, for QSGD-style codes)."""
    make, code_bits, s, bucket_size = PEER_CONFIGS[name]
    q = make()
    v = rng.standard_normal(n).astype(np.float32)
    codes, scales = jax.jit(q.encode)(jnp.asarray(v), jax.random.key(n))
    codes, scales = np.asarray(codes), np.asarray(scales)
    flat = codes if code_bits == 16 else unpack_codes(codes, code_bits, n)
    fixed = message_nbytes(q, n)
    scale_bits = 32 * scales.size
    row = dict(
        kind="peer",
        config=name,
        n=n,
        code_bits=code_bits,
        fixed_width_bytes=fixed,
        fixed_width_bits_per_coord=8 * fixed / n,
        entropy_bits_per_coord=_entropy_bits(flat) + scale_bits / n,
    )
    if s is not None:  # QSGD's layout: level in the low bits, sign on top
        sign_bit = 1 << (code_bits - 1)
        levels = (flat & (sign_bit - 1)).astype(np.int64)
        signs = flat >= sign_bit
        kw = dict(s=s, bucket_size=bucket_size)
        data = coding.encode_qsgd(levels, signs, scales.ravel(), **kw)
        out = coding.decode_qsgd(data, n=n, **kw)
        t_enc = median_s(
            lambda: coding.encode_qsgd(levels, signs, scales.ravel(), **kw), repeats=repeats
        )
        t_dec = median_s(lambda: coding.decode_qsgd(data, n=n, **kw), repeats=repeats)
        row.update(
            exact=bool((out[0] == levels).all() and (out[1] == (signs & (levels > 0))).all()),
            bytes=len(data),
            bits=coding.qsgd_bits(levels, **kw),
            bits_per_coord=coding.qsgd_bits(levels, **kw) / n,
            encode_mcoords_s=n / t_enc / 1e6,
            decode_mcoords_s=n / t_dec / 1e6,
            encode_ms=1e3 * t_enc,
            decode_ms=1e3 * t_dec,
        )
    return row


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    configs = [c[0] for c in QSGD_CONFIGS] + ["rle", "elias"]
    for cfg in configs:
        sel = [r for r in rows if r["config"] == cfg and r["kind"] != "peer"]
        if not sel:
            continue
        ns = [r["n"] for r in sel]
        axes[0].plot(ns, [r["encode_mcoords_s"] for r in sel], "o-", label=cfg)
        axes[1].plot(ns, [r["decode_mcoords_s"] for r in sel], "o-", label=cfg)
        if sel[0]["kind"] == "qsgd":
            (line,) = axes[2].plot(ns, [r["bits_per_coord"] for r in sel], "o-", label=cfg)
            axes[2].plot(ns, [r["bound_bits"] / r["n"] for r in sel], "--", color=line.get_color())
    for i, cfg in enumerate(PEER_CONFIGS):
        sel = [r for r in rows if r["config"] == cfg]
        if not sel:
            continue
        ns = [r["n"] for r in sel]
        color = f"C{i + 6}"
        axes[2].plot(ns, [r["fixed_width_bits_per_coord"] for r in sel], ":", color=color)
        axes[2].plot(ns, [r["entropy_bits_per_coord"] for r in sel], "x-", color=color, label=cfg)
    axes[2].legend(fontsize=6)
    for ax, title in zip(
        axes,
        [
            "encode (M coords/s)",
            "decode (M coords/s)",
            "bits/coord (QSGD dashed: bound; others: x entropy, dotted fixed)",
        ],
        strict=True,
    ):
        ax.set_xscale("log", base=2)
        ax.set_title(title)
        ax.set_xlabel("n")
        ax.grid(True, alpha=0.3)
    for ax in axes[:2]:
        ax.set_yscale("log")
        ax.axhline(TARGET_MCOORDS, color="k", lw=0.8, ls=":")
    axes[2].set_yscale("log")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def define_flags(flag_values: flags.FlagValues) -> None:
    """Defines this program's flags on ``flag_values`` (see :mod:`experiments.cli`)."""
    fv = {"flag_values": flag_values}
    flags.DEFINE_string("sizes", "16,17,18,19,20,21,22", "log2 sizes", **fv)
    flags.DEFINE_integer("repeats", 5, "Timed repeats per row (median).", **fv)
    flags.DEFINE_string("out", "results", "Output directory.", **fv)
    flags.DEFINE_list(
        "peers", list(PEER_CONFIGS), "the other quantizers' rows (--peers=: skip them)", **fv
    )
    cli.check_choices("peers", list(PEER_CONFIGS), flag_values)


def main(argv):
    """Runs the benchmark; ``argv``: a command line or parsed flags (:mod:`experiments.cli`)."""
    args = cli.parse(define_flags, argv)
    rng = np.random.default_rng(0)
    rows = []
    for log_n in (int(x) for x in args.sizes.split(",")):
        n = 2**log_n
        for name, bits, bucket_size in QSGD_CONFIGS:
            rows.append(bench_qsgd(n, name, bits, bucket_size, rng, args.repeats))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
        for fmt in coding.SPARSE_FORMATS:
            rows.append(bench_sparse(n, fmt, rng, args.repeats))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
        for name in args.peers:
            rows.append(bench_peer(n, name, rng, args.repeats))
            print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rows[-1].items()})
    target = [r for r in rows if r["config"] == "4-bit/512" and r["n"] == 2**22]
    summary = dict(
        all_exact=all(r["exact"] for r in rows if "exact" in r),
        all_within_bound=all(r["within_bound"] for r in rows if r["kind"] == "qsgd"),
        target_4bit_512_2p22=(
            dict(
                encode_mcoords_s=target[0]["encode_mcoords_s"],
                decode_mcoords_s=target[0]["decode_mcoords_s"],
                target=TARGET_MCOORDS,
            )
            if target
            else None
        ),
    )
    os.makedirs(args.out, exist_ok=True)
    meta = dict(
        **environment(),
        numpy=np.__version__,
        bit_mapping="s = 2**b",
        repeats=args.repeats,
        statistic="median after 1 warm-up",
    )
    with open(os.path.join(args.out, "bench_coding.json"), "w") as f:
        jsonio.dump(dict(meta=meta, summary=summary, rows=rows), f, indent=1)
    plot(rows, os.path.join(args.out, "bench_coding.png"))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    cli.run(main, define_flags)
