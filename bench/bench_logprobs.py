"""Update-phase memory and time of the log-probs, full-vocabulary logits vs the LM head on response rows in chunks.

    python bench/bench_logprobs.py --out results/bench_logprobs.json

1. Qwen3-4B's exact layers (2 of its 36, `grpo/qwen3_4b_shape.py`) with its 151,936-token vocabulary, fp32 on CPU,
   LoRA r = 32 on every linear layer, gradient checkpointing on (as the Qwen config): one mini-batch of
   ``--rows`` sequences of ``--prompt`` + ``--response`` tokens, `padding.packed_log_probs` forward + backward with
   ``chunk_size=None`` (every packed token's logits, as before) and ``chunk_size=512`` (the default), interleaved.
   Measured: the peak RSS over the RSS before (the process runs with ``MALLOC_MMAP_THRESHOLD_=65536``, so every
   tensor of 64 KiB or more is its own mapping, returned when freed, and RSS follows the live tensors), against
   `grpo.memory_plan`'s activations term for the same batch and model.
2. The embedded default's shape (the tiny Qwen3, a 128-token vocabulary, 16 sequences of 40 + 32 tokens): the
   time of the same forward + backward with and without chunks, interleaved (its configs keep full logits).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # glibc reads it at start: run again with it
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})

import torch
from bench_common import ALL_LINEAR, machine_info, rss_peak_during, with_random_lora
from transformers import AutoModelForCausalLM, Qwen3Config

from grpo.config import load_config
from grpo.memory_plan import GIB, memory_plan
from grpo.parallel import apply_activation_checkpointing
from grpo.qwen3_4b_shape import qwen3_4b_config
from grpo.tasks.tiny_gsm8k import SIZES
from padding import packed_log_probs

MIB = 2**20


def batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    """Left-padded prompts (one shorter), right-padded responses (one shorter): the recipe's layout."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, prompt + response), generator=generator)
    mask = torch.ones(rows, prompt + response, dtype=torch.long)
    mask[0, : prompt // 8] = 0
    response_mask = torch.ones(rows, response, dtype=torch.long)
    response_mask[-1, -response // 8 :] = 0
    mask[-1, -response // 8 :] = 0
    return ids, mask, response_mask


def forward_backward(model, inputs, chunk_size) -> None:
    logps = packed_log_probs(model, *inputs, chunk_size=chunk_size)
    (-(logps * inputs[2]).sum() / inputs[2].sum()).backward()
    model.zero_grad(set_to_none=True)


def interleaved(measure, modes: dict, reps: int) -> dict:
    values = {name: [] for name in modes}
    for rep in range(reps):
        for name in list(modes) if rep % 2 == 0 else list(modes)[::-1]:
            values[name].append(measure(modes[name]))
    return values


def qwen_slice(args) -> dict:
    torch.manual_seed(0)
    config = qwen3_4b_config(num_layers=2)
    model = with_random_lora(AutoModelForCausalLM.from_config(config, dtype=torch.float32), rank=32, targets=ALL_LINEAR)
    apply_activation_checkpointing(model)
    model.train()
    inputs = batch(args.rows, args.prompt, args.response, config.vocab_size)
    modes = {"full_logits": None, "chunks_512": 512}
    forward_backward(model, inputs, 512)  # first touch of the weights' gradients' pages, lazy state

    def peak(chunk_size):
        start = time.perf_counter()
        _, extra = rss_peak_during(lambda: forward_backward(model, inputs, chunk_size))
        return extra, time.perf_counter() - start

    runs = interleaved(peak, modes, args.reps)
    result = {}
    for name, chunk_size in modes.items():
        overrides = [
            f"per_device_train_batch_size={args.rows}",
            "steps_per_generation=1",
            f"num_generations={args.rows}",
            f"data.max_prompt_length={args.prompt}",
            f"max_completion_length={args.response}",
            "model.dtype=float32",
            "gradient_checkpointing=true",
            "lora.r=32",
            f"padding.logprob_chunk_size={'null' if chunk_size is None else chunk_size}",
        ]
        plan = memory_plan(config, load_config(None, overrides), world=1)["terms"]["activations"]
        measured = statistics.median(extra for extra, _ in runs[name])
        result[name] = dict(
            chunk_size=chunk_size,
            peak_extra_mib=measured / MIB,
            plan_activations_mib=plan / MIB,
            plan_over_measured=plan / measured,
            median_s=statistics.median(s for _, s in runs[name]),
            raw=runs[name],
        )
    return result


def tiny_default(args) -> dict:
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, tie_word_embeddings=True, **SIZES["tiny"])
    model = with_random_lora(AutoModelForCausalLM.from_config(config, dtype=torch.float32), rank=16, targets=ALL_LINEAR)
    model.train()
    inputs = batch(16, 40, 32, config.vocab_size)
    forward_backward(model, inputs, None)

    def seconds(chunk_size):
        start = time.perf_counter()
        forward_backward(model, inputs, chunk_size)
        return time.perf_counter() - start

    runs = interleaved(seconds, {"full_logits": None, "chunks_512": 512}, args.tiny_reps)
    medians = {name: statistics.median(values) for name, values in runs.items()}
    return dict(median_s=medians, chunks_over_full=medians["chunks_512"] / medians["full_logits"], raw=runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4, help="sequences in the mini-batch")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--response", type=int, default=192)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tiny-reps", type=int, default=7)
    parser.add_argument("--out", type=Path, default=Path("results/bench_logprobs.json"))
    args = parser.parse_args()
    start = time.perf_counter()
    slice_result, tiny_result = qwen_slice(args), tiny_default(args)
    for name, r in slice_result.items():
        print(
            f"Qwen3-4B slice, {name}: peak {r['peak_extra_mib']:.0f} MiB, plan {r['plan_activations_mib']:.0f} MiB "
            f"(plan / measured {r['plan_over_measured']:.2f}), {r['median_s']:.2f} s"
        )
    print(f"embedded default's shape: chunks / full logits time {tiny_result['chunks_over_full']:.2f}")
    out = dict(
        machine=machine_info(),
        command="python bench/bench_logprobs.py " + " ".join(sys.argv[1:]),
        settings=dict(
            rows=args.rows,
            prompt=args.prompt,
            response=args.response,
            reps=args.reps,
            tiny_reps=args.tiny_reps,
            malloc="MALLOC_MMAP_THRESHOLD_=65536",
            gib=GIB,
        ),
        qwen3_4b_slice=slice_result,
        tiny_default=tiny_result,
        wall_s=time.perf_counter() - start,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
