"""`attn_implementation="packed_sdpa"`: a packed row's samples attend each within itself, at their own cost.

transformers runs a packed ``[1, T]`` row under ``sdpa`` (or ``eager``) through a block-diagonal ``T x T`` mask
built from the restarting ``position_ids``: attention then costs ``T^2`` instead of ``sum(L_i^2)``, and the
kernel is the masked one. ``packed_sdpa`` splits the row where ``position_ids`` restart (transformers' own rule,
``masking_utils.find_packed_sequence_indices``) and attends causally within each sample:

- on CUDA in fp16/bf16, one call per layer of torch's variable-length FlashAttention
  (``torch.nn.attention.varlen.varlen_attn``) over the whole row, given the samples' cumulative bounds;
- elsewhere (CPU, fp32), transformers' ``sdpa_attention_forward`` on each sample with ``is_causal=True``.

Its mask function (:func:`packed_sdpa_mask`) builds no mask for a packed row: transformers would otherwise
materialise the ``T x T`` mask every forward for nothing. Anything else (a padded batch, a KV-cache step,
sliding-window layers) goes to ``sdpa`` unchanged, with the mask transformers' ``sdpa_mask`` builds for it.
Importing this module registers the name with transformers.

The sample bounds are read from ``position_ids`` once per forward (one device -> host copy), not once per decoder
layer: every layer of a forward gets the same ``position_ids`` tensor, and :func:`packed_sample_bounds` remembers
its answer for that tensor (see there).
"""

from __future__ import annotations

import functools
import inspect
import weakref

import torch
from torch.nn.attention.varlen import varlen_attn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    and_masks,
    causal_mask_function,
    packed_sequence_mask_function,
    sdpa_mask,
)

VARLEN_PARAMETERS = inspect.signature(varlen_attn).parameters  # its keywords grew across torch releases

PACKED_SDPA = "packed_sdpa"
# False: the per-sample loop on CUDA too (bench/gpu_check.py compares both)
VARLEN_ON_CUDA = True


def _bounds_from_positions(positions: list[int]) -> list[int] | None:
    """:func:`packed_sample_bounds` on a host copy of the row (pure Python: no device work, no further sync)."""
    starts = [k for k in range(1, len(positions)) if positions[k] != positions[k - 1] + 1]
    return [0, *starts, len(positions)] if starts else None


# (weak reference to a position_ids tensor, its _version, its bounds): the last few forwards' rows. Every decoder
# layer of one forward gets the same position_ids object, so only the first layer reads it (one device -> host
# copy per forward, instead of one per layer); a checkpointed layer's recompute in the backward finds it too.
_CACHE: list[tuple[weakref.ref, int, list[int] | None]] = []
_CACHE_SIZE = 4


def packed_sample_bounds(position_ids: torch.Tensor | None, length: int) -> list[int] | None:
    """``[0, start_1, ..., T]`` for a ``[1, T]`` row of two or more samples; None for anything else.

    A sample starts wherever a position is not its predecessor's + 1 (transformers' rule for packed rows). One
    host read per ``position_ids`` tensor (``.tolist()`` of the row), remembered for that tensor object while it
    lives and is not modified in place: the decoder layers of one forward share one read.
    """
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length) or length < 2:
        return None
    if position_ids.is_inference():  # no version counter to tell an in-place change: read it every time
        return _bounds_from_positions(position_ids[0].tolist())
    for ref, version, bounds in _CACHE:
        if ref() is position_ids and version == position_ids._version:
            return bounds
    bounds = _bounds_from_positions(position_ids[0].tolist())  # the one device -> host read
    _CACHE[:] = [entry for entry in _CACHE if entry[0]() is not None][-(_CACHE_SIZE - 1) :]
    _CACHE.append((weakref.ref(position_ids), position_ids._version, bounds))
    return bounds


@functools.lru_cache(maxsize=8)
def _flash_capable(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 0)  # FlashAttention-2: Ampere or newer


def varlen_usable(query: torch.Tensor, key: torch.Tensor, dropout: float) -> bool:
    """Whether torch's varlen FlashAttention kernel takes this layer: CUDA (sm80+), fp16/bf16 (after autocast),
    a head dimension of at most 256, no dropout (varlen_attn has none). Its forward and backward are CUDA-only."""
    if not (VARLEN_ON_CUDA and query.is_cuda and dropout == 0.0 and query.shape[-1] <= 256):
        return False
    dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
    return dtype in (torch.float16, torch.bfloat16) and key.dtype == query.dtype and _flash_capable(query.device)


@functools.lru_cache(maxsize=8)
def _cu_seqlens(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The samples' cumulative bounds as FlashAttention takes them (int32, on the kernel's device), once per row."""
    return torch.tensor(bounds, dtype=torch.int32, device=device)


def _varlen_attention(module, query, key, value, bounds: list[int], scaling):
    """All samples of the row in one causal FlashAttention call: ``[1, H, T, D]`` -> ``[1, T, H, D]``."""
    if torch.is_autocast_enabled("cuda"):  # sdpa is on autocast's list, a custom op is not: cast as sdpa would be
        dtype = torch.get_autocast_dtype("cuda")
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    cu_seqlens = _cu_seqlens(tuple(bounds), query.device)
    longest = max(end - start for start, end in zip(bounds[:-1], bounds[1:]))
    # [T, H, D] rows, made contiguous as transformers' own flash_attention_2 path does (one copy per layer)
    query, key, value = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
    options = dict(scale=scaling, window_size=(-1, 0))  # (-1, 0): causal
    if query.shape[1] != key.shape[1]:
        if "enable_gqa" in VARLEN_PARAMETERS:
            options["enable_gqa"] = True
        else:  # torch <= 2.12 takes as many key/value heads as query heads: each group's own copy
            groups = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = varlen_attn(query, key, value, cu_seqlens, cu_seqlens, longest, longest, **options)
    return out[None]


def packed_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention signature: ``query`` ``[1, H, T, D]`` -> ``([1, T, H, D], None)``.

    A packed row comes without a mask (:func:`packed_sdpa_mask` builds none for it); a mask means padding, a cache
    or a window, which sdpa handles with it.
    """
    bounds = None
    if attention_mask is None and kwargs.get("sliding_window") is None and query.shape[2] == key.shape[2]:
        bounds = packed_sample_bounds(kwargs.get("position_ids"), query.shape[2])
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if varlen_usable(query, key, dropout):
        return _varlen_attention(module, query, key, value, bounds, scaling), None
    kwargs = {k: v for k, v in kwargs.items() if k not in ("is_causal", "position_ids")}
    outputs = [
        sdpa_attention_forward(
            module,
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            None,
            dropout=dropout,
            scaling=scaling,
            is_causal=True,
            **kwargs,
        )[0]
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=1), None


# transformers' predicate for a packed row without padding: and_masks(causal, packed_sequence_mask_function(...))
_AND_MASK_CODE = and_masks().__code__
_PACKED_MASK_CODE = packed_sequence_mask_function(None).__code__


def causal_within_packed_samples(mask_function) -> bool:
    """Whether ``mask_function`` is transformers' mask of a packed row and nothing else: causal, within each sample
    (``create_causal_mask`` builds it when ``position_ids`` restart, with no 2-D mask and no cache)."""
    if getattr(mask_function, "__code__", None) is not _AND_MASK_CODE:
        return False
    parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
    return (
        len(parts) == 2
        and parts[0] is causal_mask_function
        and getattr(parts[1], "__code__", None) is _PACKED_MASK_CODE
    )


def packed_sdpa_mask(*args, mask_function=causal_mask_function, attention_mask=None, local_size=None, **kwargs):
    """transformers' mask interface: no mask for a packed row (the attention splits it itself), else ``sdpa_mask``."""
    if attention_mask is None and local_size is None and causal_within_packed_samples(mask_function):
        return None
    return sdpa_mask(*args, mask_function=mask_function, attention_mask=attention_mask, local_size=local_size, **kwargs)


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa_mask)
