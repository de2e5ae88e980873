"""The padding layout of a rollout batch, and the one rule that maps packed values back to it.

Layout convention used everywhere in this repository
----------------------------------------------------
A rollout batch is a ``[B, P + R]`` tensor. Row ``i`` holds a prompt **left-padded** inside its first
``P`` columns, followed by a response **right-padded** inside its last ``R`` columns::

    [pad pad p0 p1 p2 | r0 r1 r2 pad]      P = 5, R = 4
    [ p0  p1 p2 p3 p4 | r0 pad pad pad]

``attention_mask`` ``[B, P + R]`` marks real tokens, ``response_mask`` ``[B, R]`` marks real response
tokens. A packed forward drops every padding token and concatenates the real ones into one ``[T]``
sequence whose ``position_ids`` restart at 0 for every sample (``cu_seqlens`` marks the boundaries).

The forward's output ``values[k]`` scores the token *after* packed position ``k``. So the log-prob of
response token ``j`` of sample ``i`` sits at packed index ``start_i + prompt_len_i + j - 1``. The same
function, :func:`no_padding_2_padding`, maps old, reference and current log-probs back to ``[B, R]``;
using different rules for them makes the PPO ratio explode (see :func:`legacy_slice_response`; verl's report of
the same bug reads a ratio of ~451,728 instead of ~1.0: https://github.com/volcengine/verl/pull/5115).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["PackedBatch", "unpad", "pad", "response_layout", "no_padding_2_padding", "legacy_slice_response"]


class PackedBatch(NamedTuple):
    """A padding-free batch: every real token of a ``[B, L]`` batch, in row order."""

    input_ids: torch.Tensor  # [T] real tokens, concatenated
    position_ids: torch.Tensor  # [T] restarts at 0 for every sample
    cu_seqlens: torch.Tensor  # [B + 1] int32, sample i is input_ids[cu_seqlens[i]:cu_seqlens[i + 1]]
    indices: torch.Tensor  # [T] flat positions of the real tokens in the B x L padded batch


def _check_mask(attention_mask: torch.Tensor) -> None:
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask must be [B, L], got shape {tuple(attention_mask.shape)}")


def unpad(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedBatch:
    """Drop padding: ``[B, L]`` ids and mask -> :class:`PackedBatch` (``T`` = number of real tokens).

    Positions count real tokens only, so a left-padded prompt still starts at position 0.
    """
    _check_mask(attention_mask)
    if input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} differ in shape"
        )
    mask = attention_mask.bool()
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    positions = (mask.long().cumsum(dim=1) - 1).flatten()[indices]
    seqlens = mask.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
    return PackedBatch(input_ids.flatten()[indices], positions, cu_seqlens, indices)


def pad(values: torch.Tensor, indices: torch.Tensor, batch_size: int, seq_len: int) -> torch.Tensor:
    """Inverse of :func:`unpad`: scatter ``values`` ``[T, ...]`` back to ``[batch_size, seq_len, ...]``, 0 elsewhere."""
    if values.shape[0] != indices.shape[0]:
        raise ValueError(f"values has {values.shape[0]} rows but indices has {indices.shape[0]}")
    out = values.new_zeros((batch_size * seq_len, *values.shape[1:]))
    out[indices] = values
    return out.view(batch_size, seq_len, *values.shape[1:])


def response_layout(attention_mask: torch.Tensor, response_mask: torch.Tensor):
    """Validate the prompt/response layout; return (prompt_lens [B], response width R)."""
    _check_mask(attention_mask)
    batch, total = attention_mask.shape
    if response_mask.dim() != 2 or response_mask.shape[0] != batch or response_mask.shape[1] > total:
        raise ValueError(f"response_mask must be [B={batch}, R<={total}], got shape {tuple(response_mask.shape)}")
    width = response_mask.shape[1]
    prompt_lens = attention_mask[:, : total - width].sum(dim=1)
    empty = torch.nonzero(prompt_lens == 0).flatten().tolist()
    if empty:
        raise ValueError(
            f"sample(s) {empty} have an empty prompt (prompt length 0): the first response token has no "
            "preceding token to predict it from"
        )
    stray = response_mask.bool() & ~attention_mask[:, total - width :].bool()
    if stray.any():
        bad = torch.nonzero(stray.any(dim=1)).flatten().tolist()
        raise ValueError(f"response_mask marks padding tokens (attention_mask == 0) as response in sample(s) {bad}")
    return prompt_lens, width


def no_padding_2_padding(
    values: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """Packed next-token values ``[T, ...]`` -> response layout ``[B, R, ...]``, 0 at padding.

    ``values[k]`` must score the token after packed position ``k`` (the natural output of a packed
    causal-LM forward); see the module docstring for the layout.
    """
    prompt_lens, width = response_layout(attention_mask, response_mask)
    seqlens = attention_mask.sum(dim=1)
    if values.shape[0] != int(seqlens.sum()):
        raise ValueError(f"values has {values.shape[0]} rows, attention_mask has {int(seqlens.sum())} real tokens")
    starts = seqlens.cumsum(0) - seqlens
    offsets = torch.arange(width, device=values.device)
    index = (starts + prompt_lens - 1)[:, None] + offsets[None, :]  # [B, R]
    keep = response_mask.bool()
    index = torch.where(keep, index, torch.zeros_like(index))  # padding reads row 0, then is zeroed
    gathered = values[index]
    keep = keep.view(*keep.shape, *([1] * (values.dim() - 1)))
    return torch.where(keep, gathered, torch.zeros_like(gathered))


def legacy_slice_response(
    values: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """The wrong rule, kept only to reproduce the before/after plots (``padding.legacy_slice``). Do not use it.

    It right-pads each sample's packed values into a ``[B, P + R]`` row (so every sample starts at
    column 0, whatever its left padding) and slices ``[:, -R-1:-1]``. That is only right for samples
    whose prompt fills all ``P`` columns; every left-padded sample reads other tokens' log-probs, and the
    PPO ratio against correctly placed old log-probs explodes.
    """
    _check_mask(attention_mask)
    batch, total = attention_mask.shape
    width = response_mask.shape[1]
    seqlens = attention_mask.sum(dim=1).tolist()
    rows = torch.split(values, seqlens)
    padded = values.new_zeros((batch, total, *values.shape[1:]))
    for i, row in enumerate(rows):
        padded[i, : row.shape[0]] = row
    sliced = padded[:, -width - 1 : -1]
    keep = response_mask.bool().view(batch, width, *([1] * (values.dim() - 1)))
    return torch.where(keep, sliced, torch.zeros_like(sliced))
