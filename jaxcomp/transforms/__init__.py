"""Optax gradient transformations: the compressors users call."""

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
    "SparsifyState",
    "binary_search",
    "dgc",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "sparsify",
    "threshold",
    "top_k",
    "trimmed_top_k",
]
