"""Quantization codecs: the :class:`Quantizer` s and their bit packing.

The codecs a quantizing compressor runs (:func:`jaxcomp.quantize` and the
named quantizers built on it) and the host-side tools that read their
messages (:mod:`jaxcomp.coding`).
"""

from jaxcomp.quantization import codecs, packing
from jaxcomp.quantization.codecs import (
    CAST_DTYPES,
    NATURAL_BITS,
    QSGD_NORMS,
    SIGN_SCALES,
    Quantizer,
    bounded_sign_quantizer,
    cast_quantizer,
    message_nbytes,
    natural_dithering_quantizer,
    natural_quantizer,
    onebit_quantizer,
    qsgd_bits,
    qsgd_levels,
    qsgd_quantizer,
    sign_quantizer,
    terngrad_quantizer,
)
from jaxcomp.quantization.packing import pack_codes, unpack_codes

__all__ = [
    "CAST_DTYPES",
    "NATURAL_BITS",
    "QSGD_NORMS",
    "SIGN_SCALES",
    "Quantizer",
    "bounded_sign_quantizer",
    "cast_quantizer",
    "codecs",
    "message_nbytes",
    "natural_dithering_quantizer",
    "natural_quantizer",
    "onebit_quantizer",
    "pack_codes",
    "packing",
    "qsgd_bits",
    "qsgd_levels",
    "qsgd_quantizer",
    "sign_quantizer",
    "terngrad_quantizer",
    "unpack_codes",
]
