"""Multi-turn rollouts whose tools take time: each episode's next turn sent when its own tool returns (per episode)
against every episode's turn sent together once the slowest tool of the turn has returned (per turn).

    python bench/bench_tool_schedule.py --out results/bench_tool_schedule.json

One ``vllm serve`` on the embedded tool model (`grpo.tasks.tiny_tools`; built under ``--cache`` if missing) with the
recipe's prefix cache, pinned to ``--server-core``; this client on ``--client-core``. A rollout is ``--episodes``
episodes of the tool task's prompts, each ``--turns`` turns long: every turn samples up to ``--turn-tokens`` tokens,
then the episode's tool runs for its own time and a tool response of ``--tool-response-tokens`` is appended (as in
bench/bench_tool_cache.py, so every episode runs exactly ``--turns`` turns). The tools' times are drawn per episode
and turn from an exponential distribution of mean ``--tool-mean-s`` (seeded per repetition, the same in both arms):
most tools answer quickly, a few take several times the mean, as searches and code runs do.

- per turn (`tool_calling.schedule: per_turn`): a turn's requests leave together; the tools run concurrently; the
  next turn leaves when the slowest has returned.
- per episode (`per_episode`, the server's default in the recipe): each episode on a thread of its own sends its
  next turn as soon as its own tool returns.

Both arms send the same requests with the same seeds (each turn's from the repetition, the episode and the turn),
so they sample the same tokens (checked: ``episodes_differing``). The figure is rollout tokens per second (sampled
tokens over the rollout's wall time); the speed-up is each repetition's per-episode / per-turn ratio, with the
median and spread over repetitions; the first repetition is a warm-up, not counted.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests
import torch
from bench_common import machine_info
from bench_tool_cache import (
    base_engine,
    pinned_tool_model,
    serve_tool_model,
    tool_bench_parser,
    tool_prompts,
    tool_response_ids,
)

from grpo.episodes.formats import Renderer
from grpo.episodes.loop import turn_seed
from grpo.tasks.tiny_tools import TOOLS

ARMS = ("per_episode", "per_turn")


def request_seed(seeds: list[int], episode: int, turn: int) -> int:
    """A turn's request seed, whichever arm sends it: the episode's own first, then the recipe's `turn_seed`."""
    return seeds[episode] if turn == 0 else turn_seed(seeds[episode], episode, turn + 1)


def per_turn(engine, prompts, tool_ids, tool_s, sampling, seeds):
    """Each turn: every episode's request together, then the tools concurrently (the slowest one's time)."""
    histories, sampled = [list(p) for p in prompts], [[] for _ in prompts]
    for turn in range(len(tool_s[0])):
        turn_seeds = [request_seed(seeds, e, turn) for e in range(len(prompts))]
        for history, tokens, sample in zip(
            histories, sampled, engine.receive(engine.send(histories, sampling, turn_seeds))
        ):
            tokens += sample.completion_ids
            history += sample.completion_ids + tool_ids
        if turn < len(tool_s[0]) - 1:
            time.sleep(max(times[turn] for times in tool_s))
    return sampled


def per_episode(engine, prompts, tool_ids, tool_s, sampling, seeds):
    """Each episode on a thread of its own: its next turn leaves as soon as its own tool returns."""
    sampled = [[] for _ in prompts]

    def episode(e: int) -> None:
        history = list(prompts[e])
        for turn in range(len(tool_s[e])):
            (sample,) = engine.receive(engine.send([history], sampling, [request_seed(seeds, e, turn)]))
            sampled[e] += sample.completion_ids
            history += sample.completion_ids + tool_ids
            if turn < len(tool_s[e]) - 1:
                time.sleep(tool_s[e][turn])

    threads = [threading.Thread(target=episode, args=(e,)) for e in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sampled


def main() -> None:
    parser = tool_bench_parser(__doc__, "results/bench_tool_schedule.json")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tool-mean-s", type=float, default=0.2, help="the tools' mean time (exponential)")
    args = parser.parse_args()
    model = pinned_tool_model(args)
    log_path = Path(tempfile.mkdtemp(prefix="bench_tool_schedule-")) / "server.log"
    proc, url = serve_tool_model(model, log_path, args)
    from vllm import SamplingParams

    sampling = SamplingParams(n=1, temperature=1.0, max_tokens=args.turn_tokens, logprobs=0)
    runs = {arm: [] for arm in ARMS}
    engine = None
    try:
        engine = base_engine(proc, url, log_path, model)
        prompts = tool_prompts(engine.tokenizer, args.episodes)
        tool_ids = tool_response_ids(Renderer(engine.tokenizer, TOOLS), args.tool_response_tokens)
        for repetition in range(args.repetitions + 1):
            generator = torch.Generator().manual_seed(repetition)
            tool_s = (
                torch.empty(args.episodes, args.turns).exponential_(1 / args.tool_mean_s, generator=generator)
            ).tolist()
            seeds = torch.randint(0, 2**31 - 1, (args.episodes,), generator=generator).tolist()
            for arm in ARMS[repetition % 2 :] + ARMS[: repetition % 2]:
                # as after a sync: nothing an earlier rollout left in the cache is found
                requests.post(f"{url}/reset_prefix_cache").raise_for_status()
                start = time.perf_counter()
                run = per_episode if arm == "per_episode" else per_turn
                sampled = run(engine, prompts, tool_ids, tool_s, sampling, seeds)
                seconds = time.perf_counter() - start
                if repetition:
                    runs[arm].append(dict(seconds=seconds, sampled=sampled, tool_s=tool_s))
                print(f"rep {repetition} {arm}: {sum(map(len, sampled)) / seconds:.0f} tok/s, {seconds:.2f} s")
    finally:
        if engine is not None:
            engine.close()
        proc.terminate()
        with contextlib.suppress(Exception):
            proc.wait(timeout=60)

    rates = {arm: [sum(map(len, run["sampled"])) / run["seconds"] for run in runs[arm]] for arm in ARMS}
    ratios = [a / b for a, b in zip(rates["per_episode"], rates["per_turn"])]
    pairs = list(zip(runs["per_episode"], runs["per_turn"]))
    # what waiting for the slowest tool costs per rollout: the sum over turns of (slowest - each episode's own)
    waits = [sum(max(t[k] for t in run["tool_s"]) for k in range(args.turns - 1)) for run in runs["per_turn"]]
    flags = vars(args).items()
    report = dict(
        command=" ".join(
            [
                "python bench/bench_tool_schedule.py",
                *(f"--{k.replace('_', '-')} {v}" for k, v in flags if v is not None),
            ]
        ),
        machine=machine_info(),
        tokens_per_s={arm: dict(median=statistics.median(v), all=v) for arm, v in rates.items()},
        speedup_per_episode_over_per_turn=dict(
            median=statistics.median(ratios), min=min(ratios), max=max(ratios), all=ratios
        ),
        seconds={arm: [run["seconds"] for run in runs[arm]] for arm in ARMS},
        per_turn_tool_wait_s=waits,
        sampled_tokens={arm: [sum(map(len, run["sampled"])) for run in runs[arm]] for arm in ARMS},
        episodes_differing=sum(a != b for one, other in pairs for a, b in zip(one["sampled"], other["sampled"])),
    )
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    ratio = report["speedup_per_episode_over_per_turn"]
    print(f"per episode over per turn: {ratio['median']:.2f}x (min {ratio['min']:.2f}, max {ratio['max']:.2f})")


if __name__ == "__main__":
    main()
