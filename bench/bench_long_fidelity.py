"""Exact at length: the engine's log-probs against the trainer's on every turn of key-chain episodes of 16 to 100 turns.

    python bench/bench_long_fidelity.py --out results/bench_long_fidelity.json

The key-chain model (`grpo.tasks.tiny_key_chain`, its default build under ``--cache``: copied from ``models/`` where
shipped, else built) samples ``--episodes`` episodes per horizon on the colocated vLLM engine in fp32, token in /
token out: N turns each, every turn sampled from the exact ids of the episode so far (up to ``--turn-tokens``
tokens at temperature 1), then the next key of the episode's chain rendered as ``lookup``'s result by the chat
template (`grpo.episodes.formats.Renderer`: the tool tokens, masked as the recipe masks them). The horizon is set
here rather than left to the model, so that every episode has exactly N turns whatever it writes; ``max_model_len``
4096 (the model's positions) holds 100. The trainer then scores the same ids as the recipe does
(`grpo.data.make_batch`, `padding.packed_log_probs` on the Hugging Face model, ``packed_sdpa``). Per turn: the mean
and largest |vLLM - trainer| over the model tokens of that turn across episodes; per episode: the sequence-level
importance weight exp(sum over its model tokens of trainer - vLLM), the weight sequence-level corrections multiply
by. The policy is the base model itself (no LoRA): the recipe's merge serves W + scale*B*A as plain weights, which the
engine reads the same way.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from pathlib import Path

import torch
from bench_common import machine_info, write_report

from grpo.data import make_batch
from grpo.engines.colocated import ColocatedEngine
from grpo.engines.interface import Sample
from grpo.episodes.formats import Renderer
from grpo.tasks.key_chain import make_key_chain_problems
from grpo.tasks.tiny_key_chain import TOOLS, build_key_chain_model
from padding import packed_log_probs
from padding.packed_attention import PACKED_SDPA  # noqa: F401  (registers attn_implementation="packed_sdpa")

MAX_MODEL_LEN = 4096
PER_TURN_BOUND = 1e-6  # mean |vLLM - trainer| per turn, fp32
WEIGHT_BOUND = 1e-3  # |sequence-level importance weight - 1| at the longest horizon


def episodes_at(engine: ColocatedEngine, tokenizer, turns: int, episodes: int, turn_tokens: int, seed: int) -> list:
    """``episodes`` key-chain episodes of exactly ``turns`` turns: each turn sampled, then the chain's next key as
    the tool's result, as `Sample`s with the recipe's tool mask and turn numbers."""
    from vllm import SamplingParams

    problems = make_key_chain_problems(episodes, hops=turns - 1, seed=seed)
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p["question"]}], tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    prompts = [tokenizer(text, add_special_tokens=False).input_ids for text in texts]  # as grpo.data tokenizes them
    renderer = Renderer(tokenizer, TOOLS)
    completions = [dict(ids=[], logprobs=[], tool_mask=[], turn_of_token=[]) for _ in problems]
    torch.manual_seed(seed)
    for turn in range(1, turns + 1):
        sampling = SamplingParams(n=1, temperature=1.0, max_tokens=turn_tokens, logprobs=0)
        histories = [prompt + c["ids"] for prompt, c in zip(prompts, completions)]
        for problem, c, sample in zip(problems, completions, engine.generate(histories, sampling)):
            c["ids"] += sample.completion_ids
            c["logprobs"] += sample.logprobs
            c["tool_mask"] += [1] * len(sample.completion_ids)
            c["turn_of_token"] += [turn] * len(sample.completion_ids)
            if turn < turns:
                result = [{"role": "tool", "name": "lookup", "content": problem["chain"][turn]}]
                tool_ids = renderer.tool_suffix_ids(result)
                c["ids"] += tool_ids
                c["logprobs"] += [0.0] * len(tool_ids)
                c["tool_mask"] += [0] * len(tool_ids)
                c["turn_of_token"] += [0] * len(tool_ids)
    return [
        Sample(
            prompt, c["ids"], "", c["logprobs"], False, i, tool_mask=c["tool_mask"], turn_of_token=c["turn_of_token"]
        )
        for i, (prompt, c) in enumerate(zip(prompts, completions))
    ]


def compare(model, samples: list, pad_id: int, rows_per_forward: int) -> dict:
    """The trainer's log-probs of ``samples`` against the engine's: per turn and per episode."""
    batch = make_batch(samples, pad_id, torch.device("cpu"))
    trainer = torch.zeros_like(batch["vllm_logprobs"])
    with torch.no_grad():
        for start in range(0, len(samples), rows_per_forward):
            rows = slice(start, start + rows_per_forward)
            trainer[rows] = packed_log_probs(
                model, batch["input_ids"][rows], batch["attention_mask"][rows], batch["response_mask"][rows]
            )
    mask = batch["response_mask"].bool()
    gap = (trainer - batch["vllm_logprobs"]).double()
    per_turn = []
    for turn in range(1, int(batch["turn_of_token"].max()) + 1):
        at = mask & (batch["turn_of_token"] == turn)
        diff = gap.abs()[at]
        per_turn.append(
            dict(
                turn=turn,
                episodes=int(at.any(1).sum()),
                tokens=int(at.sum()),
                mean=diff.mean().item(),
                max=diff.max().item(),
            )
        )
    weights = [math.exp(gap[i][mask[i]].sum().item()) for i in range(len(samples))]
    return dict(per_turn=per_turn, sequence_weights=weights, model_tokens=[int(m.sum()) for m in mask])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/bench_long_fidelity.json")
    parser.add_argument("--cache", default="cache", help="where the key-chain model is built or copied if missing")
    parser.add_argument("--turns", type=int, nargs="+", default=[16, 32, 64, 100])
    parser.add_argument("--episodes", type=int, default=4, help="per horizon")
    parser.add_argument("--turn-tokens", type=int, default=12, help="at most, per turn and episode")
    parser.add_argument("--rows-per-forward", type=int, default=4, help="episodes per packed forward of the trainer")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    if max(args.turns) > 100 or min(args.turns) < 2:
        raise SystemExit(f"--turns {args.turns}: each must be in [2, 100] (chains of 1 to 99 lookups)")

    from transformers import AutoModelForCausalLM

    model_dir = build_key_chain_model(Path(args.cache) / "tiny-qwen3-key-chain")
    engine = ColocatedEngine.for_model(
        model_dir, dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN, kv_cache_gb=0.5, max_num_batched_tokens=32768
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="packed_sdpa")
    model.eval()
    tokenizer = engine.tokenizer
    horizons = {}
    for turns in args.turns:
        start = time.perf_counter()
        samples = episodes_at(engine, tokenizer, turns, args.episodes, args.turn_tokens, args.seed + turns)
        rollout_s = time.perf_counter() - start
        figures = compare(model, samples, tokenizer.pad_token_id, args.rows_per_forward)
        worst_mean = max(t["mean"] for t in figures["per_turn"])
        weights = figures["sequence_weights"]
        horizons[f"{turns}_turns"] = dict(
            tokens=[len(s.prompt_ids) + len(s.completion_ids) for s in samples],
            worst_per_turn_mean=worst_mean,
            worst_per_turn_max=max(t["max"] for t in figures["per_turn"]),
            per_turn_within_bound=worst_mean <= PER_TURN_BOUND,
            sequence_weight=dict(min=min(weights), max=max(weights), median=statistics.median(weights)),
            rollout_s=rollout_s,
            **figures,
        )
        print(
            f"{turns} turns: worst per-turn mean |vLLM - trainer| {worst_mean:.2e}, "
            f"sequence weights {min(weights):.6f}..{max(weights):.6f}",
            flush=True,
        )
    engine.close()
    longest = horizons[f"{max(args.turns)}_turns"]["sequence_weight"]
    report = dict(
        command="python bench/bench_long_fidelity.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
        ),
        machine=machine_info(),
        bounds=dict(per_turn_mean=PER_TURN_BOUND, sequence_weight=WEIGHT_BOUND),
        longest_weight_within_bound=max(abs(longest["min"] - 1), abs(longest["max"] - 1)) <= WEIGHT_BOUND,
        horizons=horizons,
    )
    write_report(report, args.out)


if __name__ == "__main__":
    main()
