"""Top-k threshold selection kernels (pure, jit-able, O(n), static shapes)."""

from jaxcomp.selection import segmented
from jaxcomp.selection.selectors import (
    SELECTORS,
    Selection,
    binary_search,
    capacity_cut,
    cut_message,
    dgc_sample,
    exact_top_k,
    fixed_threshold,
    gaussian_k,
    get_selector,
    laplace_threshold,
    ldte_bs,
    random_k,
    sort_top_k,
    target_count,
    trimmed_top_k,
)

__all__ = [
    "SELECTORS",
    "Selection",
    "binary_search",
    "capacity_cut",
    "cut_message",
    "dgc_sample",
    "exact_top_k",
    "fixed_threshold",
    "gaussian_k",
    "get_selector",
    "laplace_threshold",
    "ldte_bs",
    "random_k",
    "segmented",
    "sort_top_k",
    "target_count",
    "trimmed_top_k",
]
