"""Compressor presets as data, and the one builder that makes a compressor of a preset.

A preset names a jaxcomp factory and its keyword arguments::

    {"compressor": "ldte_bs", "kwargs": {"ratio": 1e-3, "defer_residual": True}}

(:func:`spec` writes one: ``spec("ldte_bs", ratio=1e-3, defer_residual=True)``).
The programs' tables map a row's name to such a preset (``demo.COMPRESSORS``,
``bench_model.COMPRESSORS``, ``bench_exchange.QUANTIZERS``, ...); every one
of them is built by :func:`build`, ``getattr(jaxcomp, compressor)(axis_name=...,
**kwargs)``, so a table is plain data a JSON file can record, not code. A dtype
is written by name (``"bfloat16"``), which the factories accept.
"""

from __future__ import annotations

import inspect
from typing import Any

import jaxcomp

__all__ = [
    "CONFORMANCE",
    "CONFORMANCE_OPTIMIZERS",
    "FIXED_THRESHOLD",
    "build",
    "conformance_compressor",
    "conformance_optimizer",
    "spec",
]


def spec(compressor: str, **kwargs: Any) -> dict[str, Any]:
    """The preset ``{"compressor": compressor, "kwargs": kwargs}`` (a public jaxcomp factory)."""
    if not callable(getattr(jaxcomp, compressor, None)):
        raise ValueError(f"no jaxcomp factory {compressor!r}")
    return {"compressor": compressor, "kwargs": kwargs}


def build(preset: dict[str, Any], axis_name: str | None = None, **overrides: Any):
    """The compressor of ``preset``: ``getattr(jaxcomp, compressor)(axis_name=..., **kwargs)``.

    Args:
      preset: ``{"compressor": name, "kwargs": {...}}`` (see :func:`spec`).
      axis_name: the mesh axis it exchanges over (None: one device, no exchange).
      **overrides: keyword arguments set by the caller's loop, over the preset's
        (``reuse_period=s``, ``groups=plan.groups``, ...).
    """
    factory = getattr(jaxcomp, preset["compressor"])
    return factory(axis_name=axis_name, **{**preset["kwargs"], **overrides})


# The conformance families: every compressor and compressed optimizer of jaxcomp, as the
# conformance suite (tests/test_conformance.py, through tests/helpers.py's FACTORIES and
# OPTIMIZERS) and experiments.accelerator_check build them. A sparsifier's ratio is given
# at build time (conformance_compressor); quantizers and low-rank take none.

# Laplace(0, 1) data in the conformance tests: P(|x| > 2) = e^-2 ~ 13.5%, so the fixed
# threshold often overflows a 10% capacity (exercises the extraction path).
FIXED_THRESHOLD = 2.0

CONFORMANCE = {
    "top_k": spec("top_k"),
    "top_k_sort": spec("top_k", method="sort"),
    "ldte_bs": spec("ldte_bs"),
    "binary_search": spec("binary_search"),
    "dgc": spec("dgc"),
    "trimmed_top_k": spec("trimmed_top_k"),
    "gaussian_k": spec("gaussian_k"),
    # SIDCo with a gamma first stage and generalized Pareto stages after (the most code).
    "sidco": spec("sidco", dist="gamma"),
    "random_k": spec("random_k"),
    "threshold": spec("threshold", threshold=FIXED_THRESHOLD),
    # Memory-less top-k (GRACE's TopKCompressor with NoneMemory): the residual stays
    # zero, what is not sent is dropped.
    "top_k_no_ef": spec("top_k", error_feedback=False),
    # Message formats (DGC's fp16_values / int32_indices; GRACE's RandomKCompressor):
    # float16 values for float32 leaves and uint16 indices for leaves of < 2^16
    # elements; random_k drawing the same coordinates on every device, values only.
    "top_k_fp16_values": spec("top_k", value_dtype="float16", index_dtype="uint16"),
    "random_k_shared": spec("random_k", shared_indices=True),
    # GRACE's ResidualMemory(beta, gamma): sent + new residual == beta e + gamma g.
    "top_k_residual_scaled": spec("top_k", residual_scale=0.75, gradient_scale=1.25),
    # Quantizers: min_dense_size 0 unless the caller sets it, so that small leaves
    # are quantized.
    "qsgd": spec("qsgd", levels=7, bucket_size=64, min_dense_size=0),
    "qsgd_ef": spec("qsgd", levels=1, norm="max", error_feedback=True, min_dense_size=0),
    "onebit": spec("onebit", bucket_size=100),
    "sign_sgd": spec("sign_sgd"),
    "ef_sign_sgd": spec("ef_sign_sgd", bucket_size=64),
    "bounded_sign": spec("bounded_sign", lam=0.5, error_bound=0.9),
    "terngrad": spec("terngrad", bucket_size=64),
    "terngrad_clip_ef": spec("terngrad", clip=2.5, error_feedback=True),
    "natural": spec("natural_compression"),
    "natural_dithering_ef": spec(
        "natural_compression", levels=3, bucket_size=50, error_feedback=True
    ),
    "signum": spec("signum", beta=0.9, bucket_size=64),
    "cast_bf16_ef": spec("cast", dtype="bfloat16", error_feedback=True),
    "cast_fp16": spec("cast", dtype="float16"),
    # Low rank, rank 1: (n + m) * 1 * 2 < n m for the suites' matrices; 0-D and 1-D
    # leaves go dense.
    "powersgd": spec("powersgd", rank=1),
    # The hook's batched variant: every leaf of one dtype in one square matrix.
    "powersgd_batched": spec("powersgd", rank=1, batched=True),
    # 16-bit P and Q all-reduces (fp16_compress_wrapper / bf16_compress_wrapper).
    "powersgd_fp16": spec("powersgd", rank=1, pq_dtype="float16"),
    "powersgd_batched_bf16": spec("powersgd", rank=1, batched=True, pq_dtype="bfloat16"),
}

# Compressed optimizers (their update is Adam's or LAMB's step). Small schedules, so that
# a few steps cross every stage (0/1 Adam: variance steps, 1-bit steps, stage 2).
CONFORMANCE_OPTIMIZERS = {
    "onebit_adam": spec("onebit_adam", learning_rate=0.01, freeze_step=2),
    "onebit_adam_two_stage": spec(
        "onebit_adam", learning_rate=0.01, freeze_step=2, codec="sign_l2", exchange="two_stage"
    ),
    "zero_one_adam": spec(
        "zero_one_adam",
        learning_rate=0.01,
        var_freeze_step=3,
        var_update_scaler=1,
        local_step_scaler=1,
    ),
    "zero_one_adam_two_stage": spec(
        "zero_one_adam",
        learning_rate=0.01,
        var_freeze_step=3,
        var_update_scaler=1,
        local_step_clipper=1,
        exchange="two_stage",
    ),
    "onebit_lamb": spec("onebit_lamb", learning_rate=0.01, freeze_step=2, weight_decay=0.01),
    "onebit_lamb_two_stage": spec(
        "onebit_lamb", learning_rate=0.01, freeze_step=2, codec="sign_l2", exchange="two_stage"
    ),
}


def conformance_compressor(name: str, ratio: float, axis_name: str | None = None, **overrides):
    """The compressor ``CONFORMANCE[name]``; ``ratio`` reaches only factories that take one."""
    preset = CONFORMANCE[name]
    takes_ratio = "ratio" in inspect.signature(getattr(jaxcomp, preset["compressor"])).parameters
    return build(preset, axis_name, **({"ratio": ratio} if takes_ratio else {}), **overrides)


def conformance_optimizer(name: str, axis_name: str | None = None, **overrides):
    """The compressed optimizer ``CONFORMANCE_OPTIMIZERS[name]``."""
    return build(CONFORMANCE_OPTIMIZERS[name], axis_name, **overrides)
