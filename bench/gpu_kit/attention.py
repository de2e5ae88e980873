"""The attention section: packed log-probs and LoRA gradients on a packed mini-batch of unequal samples, forward +
backward, under packed_sdpa's per-sample loop, its varlen FlashAttention call (CUDA only) and transformers' sdpa (the
T x T block-diagonal mask): time and max |delta| against the per-sample loop."""

from __future__ import annotations

import torch

import padding.packed_attention as packed_attention
from bench.gpu_kit.policy import lora_grads, mini_batch
from bench.gpu_kit.timing import timed
from padding import packed_log_probs


def check_attention(cfg, model_config, model, device: torch.device) -> dict:
    """Packed log-probs and LoRA gradients (forward + backward) under each attention, against the per-sample loop."""
    batch = mini_batch(cfg, model_config.vocab_size, device, full_length=False, seed=2)
    base = model.get_base_model()
    modes = {"per_sample": ("packed_sdpa", False), "sdpa_mask": ("sdpa", True)}
    if device.type == "cuda":
        modes["varlen"] = ("packed_sdpa", True)

    def forward_backward():
        model.zero_grad(set_to_none=True)
        logps = packed_log_probs(
            model,
            batch["input_ids"],
            batch["attention_mask"],
            batch["response_mask"],
            chunk_size=cfg.padding.logprob_chunk_size,
        )
        (-(logps * batch["response_mask"]).sum() / batch["response_mask"].sum()).backward()
        return logps.detach().float()

    results = {}
    try:
        for mode, (implementation, varlen) in modes.items():
            base.config._attn_implementation = implementation
            packed_attention.VARLEN_ON_CUDA = varlen
            seconds, logps = timed(forward_backward, device, repeats=2)
            results[mode] = dict(seconds=seconds, logps=logps, grads=lora_grads(model))
    finally:
        base.config._attn_implementation = "packed_sdpa"
        packed_attention.VARLEN_ON_CUDA = True
        model.zero_grad(set_to_none=True)
    reference = results["per_sample"]
    lengths = (batch["attention_mask"].sum(dim=1)).tolist()
    out = dict(samples=len(lengths), packed_tokens=int(sum(lengths)), longest=int(max(lengths)))
    for mode, result in results.items():
        out[mode] = dict(
            seconds=result["seconds"],
            speedup_over_per_sample=reference["seconds"] / result["seconds"],
            max_abs_delta_logps=(result["logps"] - reference["logps"]).abs().max().item(),
            max_abs_delta_lora_grad=max(
                (g - reference["grads"][n]).abs().max().item() for n, g in result["grads"].items()
            ),
            max_abs_lora_grad=max(g.abs().max().item() for g in result["grads"].values()),
        )
    return out
