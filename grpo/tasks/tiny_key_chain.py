"""The key-chain task's small Qwen3 (`grpo.tasks.key_chain`): a model that follows a chain of ``lookup`` calls.

Built as ``grpo.tasks.tiny_tools``' model is, with its machinery: ``tiny_gsm8k``'s "tiny" Qwen3, Qwen3's tool format
(``tiny_tools.CHAT_TEMPLATE``), a byte-level BPE trained on the task's own conversations, the supervised warm-up on
what the assistant writes, `cached_build` and a shipped copy in ``models/``. Two things differ:

- The tokenizer splits capital letters apart (``KEY_PIECES``): a key is always four tokens, one per letter, so copying
  the key a tool returned into the next call is four copies of one token each, whatever the key.
- The model keeps count in its own text. A call turn writes how many lookups are left, this one included
  (``"15 left"``), then the call; after the last (``"1 left"``), it answers ``#### KEY``. Each turn copies the
  latest key and takes one from the latest count: nothing grows with the chain but the context.

The warm-up's conversations: most follow a whole chain of 2 to ``max_warmup_hops`` hops; a ``long_rate`` share pose a
chain of up to 99 hops and show only its first turns (no answer), so that every count the config may ask for is
written and taken one from; a ``guess_rate`` share answer at once with a made-up key, as a model that skips the
tool would (always wrong). Sampled at temperature 1, the policy then sometimes guesses and sometimes slips on a
letter or the count over a long chain; GRPO, rewarded for the last key, has something to learn.

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
    KEY_LENGTH,
    key_chain_answer_reward,
    key_chain_hop_reward,
    lookup,
    make_key_chain_problems,
)
from grpo.tasks.tiny_gsm8k import cached_build, new_model
from grpo.tasks.tiny_tools import GenerateEngine, GenerateSampling, _warm_up, build_tool_tokenizer, render

TOOLS = [lookup]
# The pre-tokenizer's pieces: a run of digits, one capital letter, text up to and including a newline, other text.
KEY_PIECES = r"\d+|[A-Z]|[^\dA-Z\n]*\n|[^\dA-Z\n]+"
LONGEST_CHAIN = 99  # hops the counts of the warm-up reach: 100 model turns
TOKENIZER_TEXTS = 4000
MAX_POSITIONS = 4096  # 100 turns of about 26 tokens each, and the prompt
MEASURED_HOPS = 15  # the build's held-out figures: chains of 15 hops, 16 turns (recipes/configs/tiny_cpu_long.yaml)


def _call(key: str) -> dict:
    return {"type": "function", "function": {"name": "lookup", "arguments": {"key": key}}}


def key_chain_conversation(problem: dict, turns: int | None = None, guess: str | None = None) -> list[dict]:
    """A warm-up conversation for ``problem`` (`make_key_chain_problems`' row): a turn per hop, each writing the
    lookups left and calling ``lookup`` on the latest key, the tool's result after it, then ``#### <last key>``.
    ``turns``: only the first ``turns`` call turns (no answer); ``guess``: answer ``#### <guess>`` at once instead."""
    messages = [{"role": "user", "content": problem["question"]}]
    if guess is not None:
        return [*messages, {"role": "assistant", "content": f"#### {guess}"}]
    chain = problem["chain"]
    hops = len(chain) - 1
    for hop in range(hops if turns is None else min(turns, hops)):
        messages.append({"role": "assistant", "content": f"{hops - hop} left", "tool_calls": [_call(chain[hop])]})
        messages.append({"role": "tool", "name": "lookup", "content": chain[hop + 1]})
    if turns is None or turns >= hops:
        messages.append({"role": "assistant", "content": f"#### {chain[-1]}"})
    return messages


def warmup_conversations(
    n: int, seed: int, max_warmup_hops: int, long_rate: float, long_turns: int, guess_rate: float
) -> list[list[dict]]:
    """``n`` warm-up conversations (see the module docstring), deterministic in ``seed``."""
    rng = random.Random(seed)
    conversations = []
    for i in range(n):
        long = rng.random() < long_rate
        hops = rng.randint(max_warmup_hops + 1, LONGEST_CHAIN) if long else rng.randint(2, max_warmup_hops)
        (problem,) = make_key_chain_problems(1, hops=hops, seed=seed * 1_000_003 + i)
        if rng.random() < guess_rate:
            guess = "".join(rng.choice(string.ascii_uppercase) for _ in range(KEY_LENGTH))
            conversations.append(key_chain_conversation(problem, guess=guess))
        else:
            conversations.append(key_chain_conversation(problem, turns=rng.randint(1, long_turns) if long else None))
    return conversations


def measure_key_chain_episodes(model, tokenizer, problems: list[dict], greedy: bool, seed: int = 0) -> dict:
    """Held-out figures of episodes run by the recipe's loop (`grpo.episodes.loop.ToolEngine`) on HF generate, one
    turn per hop allowed: success (the last key answered), the mean share of hops made in order, the share of
    episodes that called ``lookup`` at all, and model turns per episode."""
    from grpo.config import ToolCallingSettings
    from grpo.episodes.loop import ToolEngine

    hops = len(problems[0]["chain"]) - 1
    model.eval()
    settings = SimpleNamespace(
        tool_calling=ToolCallingSettings(), max_tool_calling_iterations=hops, max_completion_length=32 * (hops + 1)
    )
    engine = ToolEngine(GenerateEngine(model, tokenizer), tokenizer, TOOLS, settings)
    prompts = render([[{"role": "user", "content": p["question"]}] for p in problems], True, tools=TOOLS)
    torch.manual_seed(seed)
    episodes = engine.generate(
        tokenizer(prompts, add_special_tokens=False).input_ids, GenerateSampling(max_tokens=32, greedy=greedy)
    )
    texts = [e.text for e in episodes]
    success = key_chain_answer_reward(texts, [p["answer"] for p in problems])
    hop_share = key_chain_hop_reward(texts, [p["chain"] for p in problems])
    return dict(
        success=sum(success) / len(episodes),
        hop_share=sum(hop_share) / len(episodes),
        lookup_rate=sum(bool(e.tool_calls) for e in episodes) / len(episodes),
        turns=sum(max(e.turn_of_token, default=0) for e in episodes) / len(episodes),
    )


def build_key_chain_model(
    out_dir: str | Path,
    seed: int = 0,
    warmup_steps: int = 200,
    batch_size: int = 32,
    learning_rate: float = 2e-3,
    max_warmup_hops: int = 12,
    long_rate: float = 0.25,
    long_turns: int = 8,
    guess_rate: float = 0.3,
    build: bool = True,
    from_scratch: bool = False,
) -> str:
    """Build (or reuse) the key-chain model in ``out_dir``; returns the path.

    ``tiny_gsm8k``'s "tiny" Qwen3 (tied embeddings, 4096 positions: 100 turns fit) with a BPE tokenizer trained on
    the warm-up's conversations (`warmup_conversations`), warmed up on them. ``build_info.json`` records the
    arguments and the held-out figures of 128 chains of ``MEASURED_HOPS`` hops run with the tool, sampled at
    temperature 1 and greedy. Cached, copied from the shipped build (``models/``), written atomically and waited
    for (``build=False``) as ``tiny_gsm8k.build_tiny_model``.
    """
    args = dict(
        task="key-chain",
        size="tiny",
        seed=seed,
        warmup_steps=warmup_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        max_warmup_hops=max_warmup_hops,
        long_rate=long_rate,
        long_turns=long_turns,
        guess_rate=guess_rate,
    )

    def make():
        torch.manual_seed(seed)
        train = warmup_conversations(
            warmup_steps * batch_size, seed + 1, max_warmup_hops, long_rate, long_turns, guess_rate
        )
        texts = render(train[:: max(1, len(train) // TOKENIZER_TEXTS)], tools=TOOLS)
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
        loss, prefix = _warm_up(
            model, tokenizer, train, steps=warmup_steps, batch_size=batch_size, lr=learning_rate, tools=TOOLS
        )
        held_out = make_key_chain_problems(128, hops=MEASURED_HOPS, seed=seed + 2)
        sampled = measure_key_chain_episodes(model, tokenizer, held_out, greedy=False, seed=seed)
        greedy = measure_key_chain_episodes(model, tokenizer, held_out, greedy=True)
        figures = dict(
            parameters=sum(p.numel() for p in model.parameters()),
            final_loss=loss,
            measured_hops=MEASURED_HOPS,
            sampled_success=sampled["success"],
            sampled_hop_share=sampled["hop_share"],
            sampled_lookup_rate=sampled["lookup_rate"],
            sampled_turns=sampled["turns"],
            greedy_success=greedy["success"],
            greedy_hop_share=greedy["hop_share"],
            warm_up_prefix=prefix,
        )
        return model, tokenizer, figures

    return cached_build(Path(out_dir), args, build, make, from_scratch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (or reuse) the key-chain task's model.")
    parser.add_argument("--out", default="cache/tiny-qwen3-key-chain")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=200)
    parser.add_argument("--guess-rate", type=float, default=0.3, help="share of warm-up answers guessed at once")
    parser.add_argument("--from-scratch", action="store_true", help="train it, even where a shipped build matches")
    cli = parser.parse_args()
    path = build_key_chain_model(
        cli.out,
        seed=cli.seed,
        warmup_steps=cli.warmup_steps,
        guess_rate=cli.guess_rate,
        from_scratch=cli.from_scratch,
    )
    print(Path(path, "build_info.json").read_text())
