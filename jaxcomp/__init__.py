"""jaxcomp: communication-efficient distributed training in JAX.

Compressors are optax gradient transformations with error-feedback state::

    tx = optax.chain(jaxcomp.ldte_bs(ratio=1e-3, axis_name="data"), optax.sgd(0.1))
"""

from jaxcomp import comm, distributed, selection
from jaxcomp.distributed import dense_exchange
from jaxcomp.transforms import (
    DGC_WARMUP,
    SparsifyState,
    binary_search,
    dgc,
    gaussian_k,
    ldte_bs,
    random_k,
    sparsify,
    threshold,
    top_k,
    trimmed_top_k,
)

__version__ = "0.1.0"

__all__ = [
    "DGC_WARMUP",
    "SparsifyState",
    "binary_search",
    "comm",
    "dense_exchange",
    "dgc",
    "distributed",
    "gaussian_k",
    "ldte_bs",
    "random_k",
    "selection",
    "sparsify",
    "threshold",
    "top_k",
    "trimmed_top_k",
]
