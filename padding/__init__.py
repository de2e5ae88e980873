"""Padding-free (packed) log-probs put back into the padded response layout, with one rule.

The public names, re-exported from the modules that hold them (docs/layout.md).
"""

from padding.layout import PackedBatch, legacy_slice_response, no_padding_2_padding, pad, response_layout, unpad
from padding.log_probs import (
    DEFAULT_CHUNK_SIZE,
    packed_log_probs,
    sampled_log_probs,
    selective_log_softmax,
    token_entropy,
)

__all__ = [
    "PackedBatch",
    "unpad",
    "pad",
    "response_layout",
    "no_padding_2_padding",
    "legacy_slice_response",
    "packed_log_probs",
    "sampled_log_probs",
    "selective_log_softmax",
    "token_entropy",
    "DEFAULT_CHUNK_SIZE",
]
