"""Host-side (numpy, outside jit) exact codecs: Elias codes and wire formats.

>>> import numpy as np
>>> from jaxcomp import coding
>>> idx, val = coding.decode_sparse(coding.encode_sparse([2], np.float32([0.5]), 4), 4)
>>> idx.tolist(), val.tolist()
([2], [0.5])
"""

from jaxcomp.coding.elias import CODES, codeword_lengths, elias_bits, elias_decode, elias_encode
from jaxcomp.coding.messages import coded_message_bytes, qsgd_message_bits, qsgd_message_fields
from jaxcomp.coding.wire import (
    SPARSE_FORMATS,
    decode_qsgd,
    decode_sparse,
    encode_qsgd,
    encode_sparse,
    qsgd_bits,
    qsgd_bits_bound,
    qsgd_dense_bound,
    qsgd_paper_bits,
    qsvrg_epoch_bits_bound,
    sparse_bits,
)

__all__ = [
    "CODES",
    "SPARSE_FORMATS",
    "coded_message_bytes",
    "codeword_lengths",
    "decode_qsgd",
    "decode_sparse",
    "elias_bits",
    "elias_decode",
    "elias_encode",
    "encode_qsgd",
    "encode_sparse",
    "qsgd_bits",
    "qsgd_bits_bound",
    "qsgd_dense_bound",
    "qsgd_message_bits",
    "qsgd_message_fields",
    "qsgd_paper_bits",
    "qsvrg_epoch_bits_bound",
    "sparse_bits",
]
