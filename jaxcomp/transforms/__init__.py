"""Optax gradient transformations: the compressors users call."""

from jaxcomp.quantization import Quantizer
from jaxcomp.transforms.accordion import AccordionState, accordion
from jaxcomp.transforms.adam import (
    OnebitAdamState,
    OnebitLambState,
    ZeroOneAdamState,
    onebit_adam,
    onebit_lamb,
    zero_one_adam,
)
from jaxcomp.transforms.powersgd import PowerSGDState, powersgd
from jaxcomp.transforms.qsvrg import qsvrg
from jaxcomp.transforms.quantize import MomentumQuantizeState, QuantizeState, quantize
from jaxcomp.transforms.quantizers import (
    bounded_sign,
    cast,
    ef_sign_sgd,
    natural_compression,
    onebit,
    qsgd,
    sign_sgd,
    signum,
    terngrad,
)
from jaxcomp.transforms.residuals import residuals, statistics
from jaxcomp.transforms.sparsifiers import (
    binary_search,
    dgc,
    gaussian_k,
    ldte_bs,
    random_k,
    sidco,
    threshold,
    top_k,
    trimmed_top_k,
)
from jaxcomp.transforms.sparsify import (
    DGC_WARMUP,
    DeferredSparsifyState,
    SparsifyState,
    sparsify,
)
from jaxcomp.transforms.two_level import TwoLevelState

__all__ = [
    "AccordionState",
    "DGC_WARMUP",
    "DeferredSparsifyState",
    "MomentumQuantizeState",
    "OnebitAdamState",
    "OnebitLambState",
    "PowerSGDState",
    "QuantizeState",
    "Quantizer",
    "SparsifyState",
    "TwoLevelState",
    "ZeroOneAdamState",
    "accordion",
    "binary_search",
    "bounded_sign",
    "cast",
    "dgc",
    "ef_sign_sgd",
    "gaussian_k",
    "ldte_bs",
    "natural_compression",
    "onebit",
    "onebit_adam",
    "onebit_lamb",
    "powersgd",
    "qsgd",
    "qsvrg",
    "quantize",
    "random_k",
    "sidco",
    "residuals",
    "statistics",
    "sign_sgd",
    "signum",
    "sparsify",
    "terngrad",
    "threshold",
    "top_k",
    "trimmed_top_k",
    "zero_one_adam",
]
