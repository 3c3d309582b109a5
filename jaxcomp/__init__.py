"""jaxcomp: communication-efficient distributed training in JAX.

Compressors are optax gradient transformations with error-feedback state::

    tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3, axis_name="data"), optax.sgd(0.1))
"""

from jaxcomp import (
    aggregation,
    analysis,
    coding,
    comm,
    cssgd,
    distributed,
    elastic,
    planning,
    sampling,
    selection,
    staleness,
)
from jaxcomp.distributed import apply_if_finite, dense_exchange
from jaxcomp.transforms import (
    DGC_WARMUP,
    Quantizer,
    QuantizeState,
    SparsifyState,
    binary_search,
    bounded_sign,
    dgc,
    ef_sign_sgd,
    gaussian_k,
    ldte_bs,
    onebit,
    qsgd,
    quantize,
    random_k,
    sign_sgd,
    sparsify,
    threshold,
    top_k,
    trimmed_top_k,
)

__version__ = "0.1.0"

__all__ = [
    "DGC_WARMUP",
    "QuantizeState",
    "Quantizer",
    "SparsifyState",
    "aggregation",
    "analysis",
    "apply_if_finite",
    "binary_search",
    "bounded_sign",
    "coding",
    "comm",
    "cssgd",
    "dense_exchange",
    "dgc",
    "distributed",
    "ef_sign_sgd",
    "elastic",
    "gaussian_k",
    "ldte_bs",
    "onebit",
    "planning",
    "qsgd",
    "quantize",
    "random_k",
    "sampling",
    "selection",
    "sign_sgd",
    "sparsify",
    "staleness",
    "threshold",
    "top_k",
    "trimmed_top_k",
]
