"""`attn_implementation="packed_sdpa"`: a packed row's samples attend each within itself, at their own cost.

transformers runs a packed ``[1, T]`` row under ``sdpa`` (or ``eager``) through a block-diagonal ``T x T`` mask
built from the restarting ``position_ids``: attention then costs ``T^2`` instead of ``sum(L_i^2)``, and the
kernel is the masked one. ``packed_sdpa`` splits the row where ``position_ids`` restart (transformers' own rule,
``masking_utils.find_packed_sequence_indices``) and runs transformers' ``sdpa_attention_forward`` on each sample
with ``is_causal=True`` -- what ``flash_attention_2``'s varlen kernel does on GPUs that have it. Anything else
(a padded batch, a KV-cache step, sliding-window layers) goes to ``sdpa`` unchanged, with the mask transformers
built for it. Importing this module registers the name with transformers.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_SDPA = "packed_sdpa"


def packed_sample_bounds(position_ids: torch.Tensor | None, length: int) -> list[int] | None:
    """``[0, start_1, ..., T]`` for a packed ``[1, T]`` row of two or more samples; None for anything else."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length) or length < 2:
        return None
    row = position_ids[0]
    starts = (torch.diff(row) != 1).nonzero().flatten() + 1  # a sample starts where positions do not count up by 1
    # ... and every sample at 0: padded rows (generate gives padding the position 1) are not packed rows
    if starts.numel() == 0 or row[0] != 0 or row[starts].any():
        return None
    return [0, *starts.tolist(), length]


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: ``query`` ``[1, H, T, D]`` -> ``([1, T, H, D], None)``."""
    bounds = packed_sample_bounds(kwargs.get("position_ids"), query.shape[2])
    if bounds is None or kwargs.get("sliding_window") is not None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal", "position_ids")}
    outputs = [
        sdpa_attention_forward(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                               dropout=dropout, scaling=scaling, is_causal=True, **kwargs)[0]
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=1), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # the fallback's mask; the packed path ignores it
