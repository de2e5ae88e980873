"""`attn_implementation="packed_sdpa"`: a packed row's samples attend each within itself, at their own cost.

transformers runs a packed ``[1, T]`` row under ``sdpa`` (or ``eager``) through a block-diagonal ``T x T`` mask
built from the restarting ``position_ids``: attention then costs ``T^2`` instead of ``sum(L_i^2)``, and the
kernel is the masked one. ``packed_sdpa`` splits the row where ``position_ids`` restart (transformers' own rule,
``masking_utils.find_packed_sequence_indices``) and runs transformers' ``sdpa_attention_forward`` on each sample
with ``is_causal=True`` -- what ``flash_attention_2``'s varlen kernel does on GPUs that have it. Anything else
(a padded batch, a KV-cache step, sliding-window layers) goes to ``sdpa`` unchanged, with the mask transformers
built for it. Importing this module registers the name with transformers.

The sample bounds are read from ``position_ids`` once per forward (one device -> host copy), not once per decoder
layer: every layer of a forward gets the same ``position_ids`` tensor, and :func:`packed_sample_bounds` remembers
its answer for that tensor (see there).
"""

from __future__ import annotations

import weakref

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_SDPA = "packed_sdpa"


def _bounds_from_positions(positions: list[int]) -> list[int] | None:
    """:func:`packed_sample_bounds` on a host copy of the row (pure Python: no device work, no further sync)."""
    length = len(positions)
    starts = [k for k in range(1, length) if positions[k] != positions[k - 1] + 1]
    # a sample starts where positions do not count up by 1 ... and every sample at 0: padded rows (generate gives
    # padding the position 1) are not packed rows
    if not starts or positions[0] != 0 or any(positions[k] for k in starts):
        return None
    return [0, *starts, length]


# (weak reference to a position_ids tensor, its _version, its bounds): the last few forwards' rows. Every decoder
# layer of one forward gets the same position_ids object, so only the first layer reads it (one device -> host
# copy per forward, instead of one per layer); a checkpointed layer's recompute in the backward finds it too.
_CACHE: list[tuple[weakref.ref, int, list[int] | None]] = []
_CACHE_SIZE = 4


def packed_sample_bounds(position_ids: torch.Tensor | None, length: int) -> list[int] | None:
    """``[0, start_1, ..., T]`` for a packed ``[1, T]`` row of two or more samples; None for anything else.

    One host read per ``position_ids`` tensor (``.tolist()`` of the row), remembered for that tensor object while
    it lives and is not modified in place: the decoder layers of one forward share one read.
    """
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length) or length < 2:
        return None
    if position_ids.is_inference():  # no version counter to tell an in-place change: read it every time
        return _bounds_from_positions(position_ids[0].tolist())
    for ref, version, bounds in _CACHE:
        if ref() is position_ids and version == position_ids._version:
            return bounds
    bounds = _bounds_from_positions(position_ids[0].tolist())  # the one device -> host read
    _CACHE[:] = [entry for entry in _CACHE if entry[0]() is not None][-(_CACHE_SIZE - 1):]
    _CACHE.append((weakref.ref(position_ids), position_ids._version, bounds))
    return bounds


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
