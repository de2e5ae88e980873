"""The trainer at length: the packed forward + backward up to max_model_len, and the episode loop up to 100 turns.

    python bench/bench_long_trainer.py --out results/bench_long_trainer.json

1. Forward + backward at length. The key-chain model's architecture (`grpo.tasks.tiny_gsm8k`'s "tiny" Qwen3, 4096
   positions, tied embeddings; and the "small" size, ~25M parameters, where attention weighs less against the MLP)
   with random weights (memory and time do not depend on their values) and the 768-token vocabulary of the
   shipped tool model, LoRA r 16 / alpha 32 on every linear layer as the recipe's configs, fp32, ``packed_sdpa``.
   One row laid out as the recipe lays out an episode (`grpo.data.make_batch`): a 64-token prompt, then turns of
   12 model tokens and 14 tool tokens (masked) in turn, up to each length of ``--lengths`` (4096 = max_model_len);
   and rows of several shorter episodes packed to the same total. The loss over the response through
   `padding.packed_log_probs` (full logits, as the key-chain config: ``padding.logprob_chunk_size: null``),
   backward. Each size in a fresh subprocess on one thread (on cores shared under nice, the threads of one op
   wait on each other's turn): per layout, an untimed pass, then the peak extra resident memory of one more
   (`bench_common.rss_peak_during`, with ``MALLOC_MMAP_THRESHOLD_=65536``: every tensor of 64 KiB or more its own
   mapping, returned when freed), against `grpo.memory_plan`'s activation estimate for the same tokens (linear in
   tokens: it assumes no ``L x L`` attention matrix); then ``--repeats`` rounds timing every layout in turn (a
   change of the shared machine's load hits every length alike), the median and the least per layout.
2. Episode assembly at 16, 32, 64 and 100 turns: `grpo.episodes.loop.ToolEngine` with the key-chain config's
   tool settings over a stand-in engine that answers every request at once with the turn the key-chain model
   writes ("N left" and a ``lookup`` call on the episode's current key, rendered and tokenized by the template; the
   answer as the last turn), the real tool `grpo.tasks.key_chain.lookup` and its results rendered by the
   template. Parsers: ``auto`` (the shipped tool model's template: the hand parser), vLLM's ``hermes``, and TRL's
   response template on the tokenizer given TRL's Qwen3 training template (``trl``; and ``trl-whole-history``: the
   whole history given to ``parse_response`` as its prefix, as the parser did before reading only its tail).
   Per horizon: the loop's seconds per turn (the stand-in's own time excluded), early and late in the episode,
   the ids decoded per turn, then `ToolEngine._sample` (which re-tokenizes every turn: ``retokenized``) and
   `grpo.data.make_batch`, each time the least of three runs; the 100-turn run of the config's parser profiled
   (cProfile, top by cumulative time).

The JSON records the machine's load: on a shared machine, conclusions rest on ratios within one run.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}
TOOL_MODEL = "models/tiny-qwen3-tools"
CONFIG = "recipes/configs/tiny_cpu_long.yaml"
PROMPT_TOKENS, MODEL_TOKENS, TOOL_TOKENS = 64, 12, 14  # a key-chain episode's layout, per turn
MAX_MODEL_LEN = 4096
VOCAB = 768  # the shipped tool model's vocabulary size
# the tool model's BPE writes a key-chain turn and its result in ~48 tokens (the key-chain model's own, ~26): its
# 100-turn episodes need more than 4096 positions, which the episode loop alone (no model) does not mind
ASSEMBLY_CONTEXT = 8192


def episode_layout(length: int, seed: int):
    """One episode of ``length`` tokens as the recipe lays it out: (prompt ids, completion ids, tool mask)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (length,), generator=generator).tolist()
    mask = []
    while len(mask) < length - PROMPT_TOKENS:
        mask += [1] * MODEL_TOKENS + [0] * TOOL_TOKENS
    return ids[:PROMPT_TOKENS], ids[PROMPT_TOKENS:], mask[: length - PROMPT_TOKENS]


def activation_estimate(model_config, episodes: int, episode_length: int) -> int:
    """`grpo.memory_plan`'s activations term for ``episodes`` episodes of ``episode_length`` tokens, fp32, the
    key-chain config's other settings (no checkpointing, full logits)."""
    from grpo.config import load_config
    from grpo.memory_plan import _activation_bytes

    overrides = [f"per_device_train_batch_size={episodes}", f"max_completion_length={episode_length - PROMPT_TOKENS}"]
    cfg = load_config(CONFIG, overrides)
    return _activation_bytes(model_config, cfg, 4, checkpointing=False)


def packed_row(model, length: int, episodes: int):
    """A forward + backward of ``episodes`` episodes packed to ``length`` tokens through ``model`` (loss over the
    response), as a function; and the number of scored tokens."""
    import torch

    from grpo.data import make_batch
    from grpo.engines.interface import Sample
    from padding import packed_log_probs

    samples = []
    for i in range(episodes):
        prompt, completion, mask = episode_layout(length // episodes, seed=i)
        turns = [1 if m else 0 for m in mask]
        samples.append(
            Sample(prompt, completion, "", [0.0] * len(completion), False, i, tool_mask=mask, turn_of_token=turns)
        )
    batch = make_batch(samples, pad_id=0, device=torch.device("cpu"))
    inputs = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])

    def forward_backward() -> None:
        logps = packed_log_probs(model, *inputs, chunk_size=None)
        (-(logps * inputs[2]).sum() / inputs[2].sum()).backward()
        model.zero_grad(set_to_none=True)

    return forward_backward, int(inputs[2].sum())


def measure_size(size: str, layouts: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Run in a fresh process, on one thread: per layout, an untimed forward + backward, then the peak extra
    resident memory of one more (`rss_peak_during`); then ``repeats`` rounds timing every layout in turn (a change
    of load hits every length alike)."""
    import torch
    from bench_common import ALL_LINEAR, rss_peak_during, with_random_lora

    from grpo.tasks.tiny_gsm8k import new_model
    from padding.packed_attention import PACKED_SDPA

    torch.set_num_threads(1)  # on cores shared under nice, the threads of one op wait on each other's turn
    torch.manual_seed(0)
    model = new_model(
        size,
        vocab_size=VOCAB,
        max_position_embeddings=MAX_MODEL_LEN,
        tie_word_embeddings=True,
        attn_implementation=PACKED_SDPA,
    )
    model = with_random_lora(model, rank=16, targets=ALL_LINEAR, lora_alpha=32)
    rows, runs = [], []
    for length, episodes in layouts:
        run, scored = packed_row(model, length, episodes)
        run()  # first-call allocations and kernel choices
        _, peak = rss_peak_during(run)
        runs.append(run)
        rows.append(
            dict(
                size=size,
                tokens=length,
                episodes=episodes,
                scored_tokens=scored,
                peak_extra_rss_mib=peak / 2**20,
                activation_estimate_mib=activation_estimate(model.config, episodes, length // episodes) / 2**20,
                seconds=[],
                threads=torch.get_num_threads(),
            )
        )
    for _ in range(repeats):
        for run, row in zip(runs, rows):
            start = time.perf_counter()
            run()
            row["seconds"].append(time.perf_counter() - start)
    return rows


def in_subprocess(*argv: str) -> dict | list:
    argv = [sys.executable, __file__, *argv]
    done = subprocess.run(argv, env={**os.environ, **MALLOC}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def passed_on(args) -> list[str]:
    """The layout arguments a timing subprocess needs."""
    return [
        *("--lengths", *map(str, args.lengths)),
        *("--packed", str(args.packed), "--small-up-to", str(args.small_up_to), "--repeats", str(args.repeats)),
    ]


def growth(rows: list[dict], key: str) -> list[float]:
    """The ratio of ``key`` between consecutive rows (each twice the tokens of the one before)."""
    return [round(b[key] / a[key], 3) for a, b in zip(rows, rows[1:])]


# ----------------------------------------------------------------------------- 2. episode assembly
class StandInEngine:
    """Answers every request at once with the turn its episode's model writes next (precomputed ids), and keeps
    the time it spends itself (start and end of each call)."""

    def __init__(self, prompts: list[list[int]], turns: list[list[list[int]]]):
        self.prompts, self.turns = prompts, turns
        self.next_turn = [0] * len(prompts)
        self.calls: list[tuple[float, float]] = []

    def generate(self, histories, sampling, use_tqdm=False):
        from grpo.engines.interface import Sample

        start = time.perf_counter()
        samples = []
        for history in histories:
            episode = next(i for i, p in enumerate(self.prompts) if history[: len(p)] == p)
            ids = self.turns[episode][self.next_turn[episode]]
            self.next_turn[episode] += 1
            samples.append(Sample(history, ids, "", [-0.1] * len(ids), False, episode))
        self.calls.append((start, time.perf_counter()))
        return samples


def key_chain_turns(renderer, chain: list[str]) -> list[list[int]]:
    """The ids of each turn the key-chain model writes for ``chain``: "N left" and a lookup call on the latest key
    per hop, then the answer; each rendered by the template as the model was taught it, through its end-of-turn."""
    from grpo.tasks.tiny_key_chain import _call

    hops = len(chain) - 1
    messages = [
        {"role": "assistant", "content": f"{hops - hop} left", "tool_calls": [_call(chain[hop])]} for hop in range(hops)
    ]
    messages.append({"role": "assistant", "content": f"#### {chain[-1]}"})
    return [renderer.retokenized_turn(message, ended=True) for message in messages]


def parser_tokenizers() -> dict:
    """The tokenizer each parser runs on: the shipped tool model's, and the same given TRL's Qwen3 template."""
    import trl
    from transformers import AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

    shipped = AutoTokenizer.from_pretrained(TOOL_MODEL)
    qwen3 = AutoTokenizer.from_pretrained(TOOL_MODEL)
    qwen3.chat_template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text()
    if not is_chat_template_prefix_preserving(qwen3):
        qwen3.chat_template = get_training_chat_template(qwen3)
    return {"auto": shipped, "hermes": shipped, "trl": qwen3, "trl-whole-history": qwen3}


def whole_history_prefix(parser) -> None:
    """``parser`` (TRL's) given the whole history's text as ``parse_response``'s prefix, as it was before it read
    only the tail from the last assistant header."""
    parser.prefix_text = lambda history_ids: parser.tokenizer.decode(history_ids, skip_special_tokens=False)


def assemble(parser: str, tokenizer, turns: int, episodes: int, profile: bool) -> dict:
    """``episodes`` key-chain episodes of ``turns`` turns through ToolEngine on the stand-in; the loop's time
    without the stand-in's, per turn, early and late, the ids decoded per turn; _sample's and make_batch's time."""
    import torch

    from grpo.config import load_config
    from grpo.data import make_batch
    from grpo.episodes.loop import ToolEngine
    from grpo.tasks.key_chain import lookup, make_key_chain_problems

    hops = turns - 1
    cfg = load_config(
        CONFIG,
        [
            f"data.key_chain_hops={hops}",
            f"max_tool_calling_iterations={hops}",
            f"max_completion_length={ASSEMBLY_CONTEXT - PROMPT_TOKENS}",
            f"tool_calling.parser={parser.removesuffix('-whole-history')}",
        ],
    )
    problems = make_key_chain_problems(episodes, hops=hops, seed=turns)
    engine = ToolEngine(None, tokenizer, [lookup], cfg)
    if parser == "trl-whole-history":
        whole_history_prefix(engine.parser)
    prompts = [engine.renderer.prompt_ids([{"role": "user", "content": p["question"]}]) for p in problems]
    stand_in = StandInEngine(prompts, [key_chain_turns(engine.renderer, p["chain"]) for p in problems])
    engine.engine = stand_in
    decoded = [0]
    decode = tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    tokenizer.decode = counting_decode
    sampling = SimpleNamespace(n=1, max_tokens=64, clone=lambda: SimpleNamespace())
    profiler = cProfile.Profile() if profile else None
    try:
        if profiler:
            profiler.enable()
        start = time.perf_counter()
        finished = engine._turn_by_turn(prompts, sampling, None, False, [])
        loop_end = time.perf_counter()
        if profiler:
            profiler.disable()
        decoded_in_loop = decoded[0]
        samples = [engine._sample(e) for e in finished]
        sample_end = time.perf_counter()
        make_batch(samples, tokenizer.pad_token_id, torch.device("cpu"))
        batch_end = time.perf_counter()
    finally:
        del tokenizer.decode
    for e, problem in zip(finished, problems):  # every episode ran its chain: each call read, each key right
        if len(e.turns) != turns or e.tool_failures or e.tool_calls != hops:
            raise RuntimeError(f"{parser}: an episode of {len(e.turns)} turns, {e.tool_failures} failed calls")
        if problem["chain"][-1] not in tokenizer.decode(e.turns[-1][0]):
            raise RuntimeError(f"{parser}: an episode did not end on its answer")
    # the loop's time in each round that ran tools: from the stand-in's answer to the next request (the turns
    # parsed, the calls run, their results rendered and appended, the next requests built)
    per_round = [(b[0] - a[1]) / episodes for a, b in zip(stand_in.calls, stand_in.calls[1:])]
    stand_in_s = sum(end - begin for begin, end in stand_in.calls)
    tenth = max(1, turns // 10)
    report = dict(
        parser=engine.parser.name if parser != "trl-whole-history" else parser,
        turns=turns,
        episodes=episodes,
        tokens_per_episode=statistics.mean(len(p) + len(s.completion_ids) for p, s in zip(prompts, samples)),
        loop_s_per_turn=(loop_end - start - stand_in_s) / (episodes * turns),
        loop_s_per_turn_first_tenth_of_rounds=statistics.mean(per_round[:tenth]),
        loop_s_per_turn_last_tenth_of_rounds=statistics.mean(per_round[-tenth:]),
        loop_s_per_episode=(loop_end - start - stand_in_s) / episodes,
        stand_in_s=stand_in_s,
        decoded_ids_per_turn=decoded_in_loop / (episodes * turns),
        sample_s_per_episode=(sample_end - loop_end) / episodes,
        make_batch_s=batch_end - sample_end,
    )
    if profiler:
        stats = pstats.Stats(profiler)
        rows = sorted(stats.stats.items(), key=lambda item: -item[1][3])[:15]
        report["profile_top_cumulative"] = [
            dict(
                function=f"{Path(file).name}:{line}({name})",
                calls=calls,
                cumulative_s=round(cumulative, 4),
                own_s=round(own, 4),
            )
            for (file, line, name), (_, calls, own, cumulative, _) in rows
        ]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/bench_long_trainer.json")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"])
    parser.add_argument("--packed", type=int, default=4, help="episodes packed to the longest length (0: none)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forward + backward passes per row")
    parser.add_argument("--small-up-to", type=int, default=4096, help="the longest length of the small size")
    parser.add_argument("--turns", type=int, nargs="+", default=[16, 32, 64, 100])
    parser.add_argument("--episodes", type=int, default=8, help="per rollout, in the episode loop")
    parser.add_argument("--parsers", nargs="+", default=["auto", "hermes", "trl", "trl-whole-history"])
    parser.add_argument("--measure", metavar="SIZE", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        lengths = [n for n in args.lengths if args.measure != "small" or n <= args.small_up_to]
        layouts = [(n, 1) for n in lengths] + ([(max(lengths), args.packed)] if args.packed > 1 else [])
        print(json.dumps(measure_size(args.measure, layouts, args.repeats)))
        return
    if max(args.lengths) > MAX_MODEL_LEN or max(args.turns) > 100 or min(args.turns) < 2:
        raise SystemExit(f"--lengths up to {MAX_MODEL_LEN}, --turns in [2, 100]: got {args.lengths}, {args.turns}")

    from bench_common import machine_info, write_report

    forward = {}
    for size in args.sizes:
        rows = in_subprocess("--measure", size, *passed_on(args))
        for row in rows:
            row.update(median_s=statistics.median(row["seconds"]), min_s=min(row["seconds"]))
            print(
                f"{size} {row['tokens']} tokens, {row['episodes']} episodes: {row['median_s']:.3f} s, "
                f"{row['peak_extra_rss_mib']:.1f} MiB",
                flush=True,
            )
        one = [row for row in rows if row["episodes"] == 1]
        forward[size] = dict(
            one_episode=one,
            time_ratio_per_doubling=growth(one, "median_s"),
            least_time_ratio_per_doubling=growth(one, "min_s"),
            memory_ratio_per_doubling=growth(one, "peak_extra_rss_mib"),
            estimate_ratio_per_doubling=growth(one, "activation_estimate_mib"),
            packed_episodes_at_longest=next((row for row in rows if row["episodes"] > 1), None),
        )
    tokenizers = parser_tokenizers()
    assembly = {}
    for name in args.parsers:
        assemble(name, tokenizers[name], 4, 2, False)  # untimed: the template's compilation, the parser's imports
        rows = []
        for turns in args.turns:
            profile = name == "auto" and turns == max(args.turns)
            runs = [assemble(name, tokenizers[name], turns, args.episodes, profile and i == 0) for i in range(3)]
            # the least of each time over three runs: what the loop costs when the shared machine lets it run
            rows.append({**runs[0], **{k: min(r[k] for r in runs) for k in runs[0] if k.endswith("_s") or "_s_" in k}})
            print(f"{name} {turns} turns: {rows[-1]['loop_s_per_turn'] * 1e3:.3f} ms a turn", flush=True)
        assembly[name] = rows

    report = dict(
        command="python bench/bench_long_trainer.py " + " ".join(sys.argv[1:]),
        machine=machine_info(),
        load="machine.load_average_1_5_15_min says how busy the machine was; on a shared machine absolute times are "
        "not comparable across rows run at different loads, and ratios within one run are the figures",
        memory="each size in a fresh subprocess with MALLOC_MMAP_THRESHOLD_=65536 (every tensor of 64 KiB or more its "
        "own mapping, returned when freed); per layout, the peak extra RSS of one forward + backward after an untimed "
        "one, sampled by bench_common.rss_peak_during",
        timing="each size's layouts in that subprocess on one thread, every layout once per round (repeats rounds): "
        "a change of load hits every length alike; median and least per layout",
        forward_backward=forward,
        episode_assembly=assembly,
    )
    write_report(report, args.out)


if __name__ == "__main__":
    main()
