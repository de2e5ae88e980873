"""The three attentions of a packed row on one CUDA GPU, each against an fp32 reference (<= 1 minute, no vLLM).

    PYTHONPATH=. python bench/gpu_attention_kernels.py --out results/gpu_attention_kernels.json

bench/gpu_check.py compares whole-model log-probs of a random Qwen3-4B in bf16 between the attentions; there every
path differs from the others by bf16's rounding through 36 layers. This isolates the attention: one layer's
query/key/value at Qwen3-4B's heads (32 query, 8 key/value, dimension 128) over 16 packed samples of 100-645
tokens, in bf16 through packed_sdpa's varlen FlashAttention call, its per-sample loop and transformers' sdpa with
the T x T block-diagonal mask, each against the per-sample loop in fp32: the output's max and mean abs error and
each input gradient's max error relative to its largest entry.
"""

from __future__ import annotations

import argparse
import sys
import types

import torch
from bench_common import write_report
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import padding.packed_attention as packed_attention


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: bench/gpu_attention_kernels.py needs a CUDA GPU")
    torch.manual_seed(0)
    device = torch.device("cuda", 0)
    lengths = torch.randint(100, 646, (16,), generator=torch.Generator().manual_seed(2)).tolist()
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    tokens = bounds[-1]
    positions = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    module = types.SimpleNamespace(num_key_value_groups=4, is_causal=True, training=False)
    query = torch.randn(1, 32, tokens, 128, device=device)
    key, value = torch.randn(1, 8, tokens, 128, device=device), torch.randn(1, 8, tokens, 128, device=device)
    grad_out = torch.randn(1, tokens, 32, 128, device=device)
    scale = 128**-0.5
    mask = torch.zeros(tokens, tokens, dtype=torch.bool, device=device)
    for start, end in zip(bounds[:-1], bounds[1:]):
        mask[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool, device=device).tril()

    def run(mode: str, dtype: torch.dtype):
        q, k, v = (t.to(dtype).clone().requires_grad_(True) for t in (query, key, value))
        packed_attention.VARLEN_ON_CUDA = mode == "varlen"
        if mode == "sdpa_mask":
            out = sdpa_attention_forward(module, q, k, v, mask[None, None], dropout=0.0, scaling=scale)[0]
        else:
            attention = packed_attention.packed_sdpa_attention
            out = attention(module, q, k, v, None, scaling=scale, position_ids=positions)[0]
        (out.float() * grad_out).sum().backward()
        return out.float().detach(), [t.grad.float() for t in (q, k, v)]

    reference, reference_grads = run("per_sample", torch.float32)
    report = dict(
        command=" ".join(["python", "bench/gpu_attention_kernels.py", *(argv if argv is not None else sys.argv[1:])]),
        gpu=torch.cuda.get_device_name(device),
        torch=torch.__version__,
        tokens=tokens,
        reference_output_abs_max=reference.abs().max().item(),
    )
    for mode in ("varlen", "per_sample", "sdpa_mask"):
        out, grads = run(mode, torch.bfloat16)
        report[mode] = dict(
            output_max_abs_error=(out - reference).abs().max().item(),
            output_mean_abs_error=(out - reference).abs().mean().item(),
            grad_max_relative_error=dict(
                zip("qkv", [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, reference_grads)])
            ),
        )
    packed_attention.VARLEN_ON_CUDA = True
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
