"""Optax gradient transformations: the compressors users call."""

from jaxcomp.transforms.quantize import Quantizer, QuantizeState, quantize
from jaxcomp.transforms.quantizers import bounded_sign, ef_sign_sgd, onebit, qsgd, sign_sgd
from jaxcomp.transforms.sparsifiers import (
    binary_search,
    dgc,
    gaussian_k,
    ldte_bs,
    random_k,
    threshold,
    top_k,
    trimmed_top_k,
)
from jaxcomp.transforms.sparsify import DGC_WARMUP, SparsifyState, sparsify

__all__ = [
    "DGC_WARMUP",
    "QuantizeState",
    "Quantizer",
    "SparsifyState",
    "binary_search",
    "bounded_sign",
    "dgc",
    "ef_sign_sgd",
    "gaussian_k",
    "ldte_bs",
    "onebit",
    "qsgd",
    "quantize",
    "random_k",
    "sign_sgd",
    "sparsify",
    "threshold",
    "top_k",
    "trimmed_top_k",
]
