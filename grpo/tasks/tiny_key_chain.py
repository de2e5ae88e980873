"""The key-chain task's small Qwen3 (`grpo.tasks.key_chain`): a model that follows a chain of ``lookup`` calls.

Built as ``grpo.tasks.tiny_tools``' model is, with its machinery: ``tiny_gsm8k``'s "tiny" Qwen3, Qwen3's tool format
(``tiny_tools.CHAT_TEMPLATE``), a byte-level BPE trained on the task's own conversations, the supervised warm-up on
what the assistant writes, `cached_build` and a shipped copy in ``models/``. Its episodes run against `KeyChain`
(``environment_factory``), whose ``lookup`` says which lookup was the last. Three things differ:

- The tokenizer splits capital letters apart (``KEY_PIECES``): a key is always four tokens, one per letter, so copying
  the key a tool returned into the next call is four copies of one token each, whatever the key.
- The model keeps no count: each turn calls ``lookup`` on the latest key, until a result says it was the last
  (`key_chain.LAST_LOOKUP`); then it answers ``#### KEY``. Nothing grows with the chain but the context. (Keeping
  count itself, writing the lookups left in each turn, the tiny model miscounted within a few turns.)
- The warm-up has two phases. Trained on everything the assistant writes from the start, the tiny model learns the
  fixed text and copies no letter better than chance after 400 steps; trained on the keys' letters alone first
  (``copy_steps``), it learns to copy them, and the second phase teaches the rest.

The warm-up's conversations follow whole chains of 2 to ``max_warmup_hops`` hops; a ``long_rate`` share pose a chain
of up to 99 hops and show only its first turns (no answer). Sampled at temperature 1, the policy sometimes slips on
a letter over a long chain; GRPO, rewarded for the last key, has that to learn.

    python -m grpo.tasks.tiny_key_chain --out cache/tiny-qwen3-key-chain
"""

from __future__ import annotations

import argparse
import random
import string
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo.tasks.key_chain import (
    KeyChain,
    key_chain_answer_reward,
    key_chain_hop_reward,
    lookup,
    make_key_chain_problems,
)
from grpo.tasks.tiny_gsm8k import all_cores, cached_build, new_model
from grpo.tasks.tiny_tools import GenerateEngine, GenerateSampling, _warm_up, build_tool_tokenizer, render

ENVIRONMENT = "grpo.tasks.key_chain:KeyChain"
TOOLS = [lookup]  # the plain tool (the benchmarks' episodes, which run to their turn limit)
# The pre-tokenizer's pieces: a run of digits, one capital letter, text up to and including a newline, other text.
KEY_PIECES = r"\d+|[A-Z]|[^\dA-Z\n]*\n|[^\dA-Z\n]+"
LONGEST_CHAIN = 99  # hops the counts of the warm-up reach: 100 model turns
TOKENIZER_TEXTS = 4000
MAX_POSITIONS = 4096  # 100 turns of about 26 tokens each, and the prompt
MEASURED_HOPS = 15  # the build's held-out figures: chains of 15 hops, 16 turns (recipes/configs/tiny_cpu_long.yaml)
# the build's defaults, those of the shipped build (models/tiny-qwen3-key-chain)
COPY_STEPS, WARMUP_STEPS, LEARNING_RATE = 300, 400, 3e-3


def _call(key: str) -> dict:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def tools() -> list:
    """`KeyChain`'s tool as the recipe describes it (a bound method: its schema has no ``self``)."""
    return [KeyChain().lookup]


def key_chain_conversation(problem: dict, turns: int | None = None) -> list[dict]:
    """A warm-up conversation for ``problem`` (`make_key_chain_problems`' row) against `KeyChain`: a turn per hop,
    each calling ``lookup`` on the latest key, the environment's result after it, then ``#### <last key>``.
    ``turns``: only the first ``turns`` call turns (no answer)."""
    chain = KeyChain()
    chain.reset(**problem)
    messages = [{"role": "user", "content": problem["question"]}]
    for hop in range(chain.hops if turns is None else min(turns, chain.hops)):
        result, _ = chain.lookup(problem["chain"][hop])
        messages.append({"role": "assistant", "content": "", "tool_calls": [_call(problem["chain"][hop])]})
        messages.append({"role": "tool", "name": "lookup", "content": result})
    if turns is None or turns >= chain.hops:
        messages.append({"role": "assistant", "content": f"#### {problem['chain'][-1]}"})
    return messages


def warmup_conversations(
    n: int, seed: int, max_warmup_hops: int, long_rate: float, long_turns: int
) -> list[list[dict]]:
    """``n`` warm-up conversations (see the module docstring), deterministic in ``seed``."""
    rng = random.Random(seed)
    conversations = []
    for i in range(n):
        long = rng.random() < long_rate
        hops = rng.randint(max_warmup_hops + 1, LONGEST_CHAIN) if long else rng.randint(2, max_warmup_hops)
        (problem,) = make_key_chain_problems(1, hops=hops, seed=seed * 1_000_003 + i)
        conversations.append(key_chain_conversation(problem, turns=rng.randint(1, long_turns) if long else None))
    return conversations


def measure_key_chain_episodes(model, tokenizer, problems: list[dict], greedy: bool, seed: int = 0) -> dict:
    """Held-out figures of episodes run by the recipe's environment loop
    (`grpo.episodes.environments.EnvironmentEngine` on HF generate, `KeyChain`), one turn per hop allowed: success
    (the last key answered), the mean share of hops made in order, and model turns per episode."""
    from grpo.config import ToolCallingSettings
    from grpo.episodes.environments import EnvironmentEngine, load_environment

    hops = len(problems[0]["chain"]) - 1
    model.eval()
    settings = SimpleNamespace(
        tool_calling=ToolCallingSettings(),
        max_tool_calling_iterations=hops,
        max_completion_length=32 * (hops + 1),
        data=SimpleNamespace(max_prompt_length=128),
    )
    engine = EnvironmentEngine(
        GenerateEngine(model, tokenizer), tokenizer, load_environment(ENVIRONMENT), settings, render=None
    )
    prompts = render([[{"role": "user", "content": p["question"]}] for p in problems], True, tools=tools())
    ids = tokenizer(prompts, add_special_tokens=False).input_ids
    torch.manual_seed(seed)
    samples = engine.generate(
        [dict(row, prompt_ids=p) for row, p in zip(problems, ids)], GenerateSampling(max_tokens=32, greedy=greedy)
    )
    texts = [s.text for s in samples]
    engine.release(samples)
    success = key_chain_answer_reward(texts, [p["answer"] for p in problems])
    hop_share = key_chain_hop_reward(texts, [p["chain"] for p in problems])
    return dict(
        success=sum(success) / len(samples),
        hop_share=sum(hop_share) / len(samples),
        turns=sum(max(s.turn_of_token, default=0) for s in samples) / len(samples),
    )


def _initial_state(args: dict):
    """The build's model before its warm-up, its tokenizer (trained on the warm-up's conversations) and those
    conversations: the copy phase's, then the whole warm-up's."""
    torch.manual_seed(args["seed"])
    copy_rows, rows = args["copy_steps"] * args["batch_size"], args["warmup_steps"] * args["batch_size"]
    train = warmup_conversations(
        copy_rows + rows,
        args["seed"] + 1,
        args["max_warmup_hops"],
        args["long_rate"],
        args["long_turns"],
    )
    texts = render(train[:: max(1, len(train) // TOKENIZER_TEXTS)], tools=tools())
    tokenizer = build_tool_tokenizer(texts, pieces=KEY_PIECES)
    model = new_model(
        "tiny",
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    return model, tokenizer, (train[:copy_rows], train[copy_rows:])


def key_letter_ids(tokenizer) -> set[int]:
    """The ids of the capital letters, each a token of its own (``KEY_PIECES``): what the copy phase trains."""
    vocab = tokenizer.get_vocab()
    return {vocab[letter] for letter in string.ascii_uppercase}


def _copy_phase(model, tokenizer, conversations, args: dict, prefix_only: bool = False):
    """The warm-up's first phase: only the keys' letters the assistant writes are trained (the module docstring)."""
    return _warm_up(
        model,
        tokenizer,
        conversations,
        steps=args["copy_steps"],
        batch_size=args["batch_size"],
        lr=args["learning_rate"],
        tools=tools(),
        trained_ids=key_letter_ids(tokenizer),
        prefix_only=prefix_only,
    )


def held_out_figures(model, tokenizer, args: dict) -> dict:
    """The held-out figures a build of ``args`` records, measured on ``model``: 128 chains of ``MEASURED_HOPS``
    hops run against `KeyChain`, sampled at temperature 1 and greedy."""
    held_out = make_key_chain_problems(128, hops=MEASURED_HOPS, seed=args["seed"] + 2)
    sampled = measure_key_chain_episodes(model, tokenizer, held_out, greedy=False, seed=args["seed"])
    greedy = measure_key_chain_episodes(model, tokenizer, held_out, greedy=True)
    return dict(
        measured_hops=MEASURED_HOPS,
        sampled_success=sampled["success"],
        sampled_hop_share=sampled["hop_share"],
        sampled_turns=sampled["turns"],
        greedy_success=greedy["success"],
        greedy_hop_share=greedy["hop_share"],
    )


def replay_warm_up_prefix(args: dict) -> dict:
    """The `prefix_record` of a build of ``args``, from its first PREFIX_STEPS warm-up steps only (the copy
    phase's)."""
    with all_cores():  # as the build (cached_build)
        model, tokenizer, (copy_train, _) = _initial_state(args)
        return _copy_phase(model, tokenizer, copy_train, args, prefix_only=True)[1]


def build_key_chain_model(
    out_dir: str | Path,
    seed: int = 0,
    copy_steps: int = COPY_STEPS,
    warmup_steps: int = WARMUP_STEPS,
    batch_size: int = 32,
    learning_rate: float = LEARNING_RATE,
    max_warmup_hops: int = 12,
    long_rate: float = 0.25,
    long_turns: int = 8,
    build: bool = True,
    from_scratch: bool = False,
) -> str:
    """Build (or reuse) the key-chain model in ``out_dir``; returns the path.

    ``tiny_gsm8k``'s "tiny" Qwen3 (tied embeddings, 4096 positions: 100 turns fit) with a BPE tokenizer trained on
    the warm-up's conversations (`warmup_conversations`), warmed up on them in two phases: ``copy_steps`` on the
    keys alone (`_copy_phase`), then ``warmup_steps`` on all the assistant writes. ``build_info.json`` records the
    arguments and the held-out figures (`held_out_figures`). Cached, copied from the shipped build (``models/``),
    written atomically and waited for (``build=False``) as ``tiny_gsm8k.build_tiny_model``.
    """
    args = dict(
        task="key-chain",
        size="tiny",
        seed=seed,
        copy_steps=copy_steps,
        warmup_steps=warmup_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        max_warmup_hops=max_warmup_hops,
        long_rate=long_rate,
        long_turns=long_turns,
    )

    def make():
        model, tokenizer, (copy_train, train) = _initial_state(args)
        copy_loss, prefix = _copy_phase(model, tokenizer, copy_train, args)
        loss, _ = _warm_up(
            model, tokenizer, train, steps=warmup_steps, batch_size=batch_size, lr=learning_rate, tools=tools()
        )
        figures = dict(parameters=sum(p.numel() for p in model.parameters()), copy_loss=copy_loss, final_loss=loss)
        return model, tokenizer, dict(figures, **held_out_figures(model, tokenizer, args), warm_up_prefix=prefix)

    return cached_build(Path(out_dir), args, build, make, from_scratch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (or reuse) the key-chain task's model.")
    parser.add_argument("--out", default="cache/tiny-qwen3-key-chain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--copy-steps", type=int, default=COPY_STEPS, help="warm-up steps on the keys alone first")
    parser.add_argument("--warmup-steps", type=int, default=WARMUP_STEPS, help="then on all the assistant writes")
    parser.add_argument("--from-scratch", action="store_true", help="train it, even where a shipped build matches")
    cli = parser.parse_args()
    path = build_key_chain_model(
        cli.out,
        seed=cli.seed,
        copy_steps=cli.copy_steps,
        warmup_steps=cli.warmup_steps,
        from_scratch=cli.from_scratch,
    )
    print(Path(path, "build_info.json").read_text())
