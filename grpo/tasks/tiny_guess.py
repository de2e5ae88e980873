"""Guess-the-number's small Qwen3 (`grpo.tasks.guess_number`): a model that plays the game with its ``guess`` tool.

Built as ``grpo.tasks.tiny_tools``' model is, with its machinery: ``tiny_gsm8k``'s "tiny" Qwen3, Qwen3's tool format
(``tiny_tools.CHAT_TEMPLATE``), a byte-level BPE trained on the task's own conversations (a run of digits merges:
every number from 0 to 63 is one token), the supervised warm-up on what the assistant writes, `cached_build` and a
shipped copy in ``models/``.

The warm-up's conversations are games played against `GuessNumber` itself, so the feedback is the environment's
text: each guess is the midpoint of the interval the last feedback named with probability ``midpoint_rate``, else a
number within 3 of one of its ends (a player creeping along, `near_an_end`); after ``correct`` (or the last guess)
the model answers ``#### <number>``. A mixed player finds the secret within the 8 guesses only sometimes (binary
search always does; at ``midpoint_rate`` 0.5 the teacher finds it in about 78% of games), and the small model
computes the midpoint of two numbers only sometimes, so the warmed-up policy, sampled at temperature 1, starts with
some success and GRPO has a better strategy to find: the midpoint. The build (and its replay) runs on one thread:
on a machine shared with other work, two threads waited on each other.

    python -m grpo.tasks.tiny_guess --out cache/tiny-qwen3-guess
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo.tasks.guess_number import HIGHEST, LOWEST, MAX_GUESSES, GuessNumber, make_guess_problems
from grpo.tasks.tiny_gsm8k import all_cores, cached_build, new_model
from grpo.tasks.tiny_tools import GenerateEngine, GenerateSampling, _warm_up, build_tool_tokenizer, render

ENVIRONMENT = "grpo.tasks.guess_number:GuessNumber"
TOKENIZER_TEXTS = 4000
TURN_TOKENS = 32  # the most tokens a turn of the build's held-out episodes may take
COMPLETION_TOKENS = 256  # an episode's budget there: recipes/configs/tiny_cpu_env.yaml's max_completion_length


def tools() -> list:
    """``GuessNumber``'s tool as the recipe describes it (a bound method: its schema has no ``self``)."""
    return [GuessNumber().guess]


def _call(number: int) -> dict:
    return {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}


def near_an_end(low: int, high: int, rng: random.Random) -> int:
    """A guess within 3 of an end of the interval ``low..high`` (either end, equally likely)."""
    step = rng.randint(0, min(3, high - low))
    return low + step if rng.random() < 0.5 else high - step


def guess_conversation(question: str, secret: int, midpoint_rate: float, rng: random.Random) -> list[dict]:
    """A warm-up game of ``question`` against `GuessNumber` with ``secret``: midpoint guesses mixed with others
    (see the module docstring), the environment's feedback after each, then ``#### <number>``."""
    game = GuessNumber()
    game.reset()
    game.secret = secret
    messages = [{"role": "user", "content": question}]
    low, high = LOWEST, HIGHEST
    while not game.found and game.guesses < MAX_GUESSES:
        number = (low + high) // 2 if rng.random() < midpoint_rate else near_an_end(low, high, rng)
        feedback, _ = game.guess(number)
        messages.append({"role": "assistant", "content": "", "tool_calls": [_call(number)]})
        messages.append({"role": "tool", "name": "guess", "content": feedback})
        low, high = game.low, game.high
    messages.append({"role": "assistant", "content": f"#### {(low + high) // 2}"})
    return messages


def warmup_conversations(n: int, seed: int, midpoint_rate: float) -> list[list[dict]]:
    """``n`` warm-up games, deterministic in ``seed``."""
    rng = random.Random(seed)
    rows = make_guess_problems(n, seed=seed)
    return [guess_conversation(row["question"], rng.randint(LOWEST, HIGHEST), midpoint_rate, rng) for row in rows]


def measure_guess_episodes(model, tokenizer, rows: list[dict], greedy: bool, seed: int = 0) -> dict:
    """Held-out figures of games run by the recipe's environment loop (`grpo.episodes.environments.EnvironmentEngine`
    on HF generate, each episode's secret from a seed drawn after ``torch.manual_seed(seed)``): success (secret
    found), guesses per episode, and the share of guesses that were the midpoint of the interval left."""
    from grpo.config import ToolCallingSettings
    from grpo.episodes.environments import EnvironmentEngine, load_environment

    model.eval()
    settings = SimpleNamespace(
        tool_calling=ToolCallingSettings(),
        max_tool_calling_iterations=MAX_GUESSES,
        max_completion_length=COMPLETION_TOKENS,
        data=SimpleNamespace(max_prompt_length=128),
    )
    environment = load_environment(ENVIRONMENT)
    engine = EnvironmentEngine(GenerateEngine(model, tokenizer), tokenizer, environment, settings, render=None)
    prompts = render([[{"role": "user", "content": row["question"]}] for row in rows], True, tools=tools())
    ids = tokenizer(prompts, add_special_tokens=False).input_ids
    torch.manual_seed(seed)
    samples = engine.generate(
        [dict(row, prompt_ids=p) for row, p in zip(rows, ids)],
        GenerateSampling(max_tokens=TURN_TOKENS, greedy=greedy),
    )
    games = [s.environment for s in samples]
    engine.release(samples)
    moves = [move for game in games for move in game.moves]
    return dict(
        success=sum(g.found for g in games) / len(games),
        guesses=sum(g.guesses for g in games) / len(games),
        midpoint_share=sum(number == (low + high) // 2 for low, high, number in moves) / max(1, len(moves)),
    )


def _initial_state(args: dict):
    """The build's model before its warm-up, its tokenizer (trained on the warm-up's conversations) and those."""
    torch.manual_seed(args["seed"])
    train = warmup_conversations(args["warmup_steps"] * args["batch_size"], args["seed"] + 1, args["midpoint_rate"])
    tokenizer = build_tool_tokenizer(render(train[:: max(1, len(train) // TOKENIZER_TEXTS)], tools=tools()))
    model = new_model(
        "tiny",
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    return model, tokenizer, train


def held_out_figures(model, tokenizer, args: dict) -> dict:
    """The held-out figures a build of ``args`` records, measured on ``model``: 128 games, sampled at temperature 1
    and greedy."""
    held_out = make_guess_problems(128, seed=args["seed"] + 2)
    sampled = measure_guess_episodes(model, tokenizer, held_out, greedy=False, seed=args["seed"])
    greedy = measure_guess_episodes(model, tokenizer, held_out, greedy=True, seed=args["seed"])
    return dict(
        sampled_success=sampled["success"],
        sampled_guesses=sampled["guesses"],
        sampled_midpoint_share=sampled["midpoint_share"],
        greedy_success=greedy["success"],
        greedy_midpoint_share=greedy["midpoint_share"],
    )


def replay_warm_up_prefix(args: dict) -> dict:
    """The `prefix_record` of a build of ``args``, from its first PREFIX_STEPS warm-up steps only."""
    with all_cores():
        torch.set_num_threads(1)  # as the build: all_cores restores the count after
        model, tokenizer, train = _initial_state(args)
        steps, batch_size, lr = args["warmup_steps"], args["batch_size"], args["learning_rate"]
        return _warm_up(
            model, tokenizer, train, steps=steps, batch_size=batch_size, lr=lr, tools=tools(), prefix_only=True
        )[1]


def build_guess_model(
    out_dir: str | Path,
    seed: int = 0,
    warmup_steps: int = 300,
    batch_size: int = 32,
    learning_rate: float = 2e-3,
    midpoint_rate: float = 0.5,
    build: bool = True,
    from_scratch: bool = False,
) -> str:
    """Build (or reuse) guess-the-number's model in ``out_dir``; returns the path.

    ``tiny_gsm8k``'s "tiny" Qwen3 (tied embeddings) with a BPE tokenizer trained on the warm-up's games
    (`warmup_conversations`), warmed up on them. ``build_info.json`` records the arguments and the held-out
    figures (`held_out_figures`). Cached, copied from the shipped build (``models/``), written atomically and waited
    for (``build=False``) as ``tiny_gsm8k.build_tiny_model``.
    """
    args = dict(
        task="guess",
        size="tiny",
        seed=seed,
        warmup_steps=warmup_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        midpoint_rate=midpoint_rate,
    )

    def make():
        torch.set_num_threads(1)  # cached_build restores its own count after
        model, tokenizer, train = _initial_state(args)
        loss, prefix = _warm_up(
            model, tokenizer, train, steps=warmup_steps, batch_size=batch_size, lr=learning_rate, tools=tools()
        )
        figures = dict(parameters=sum(p.numel() for p in model.parameters()), final_loss=loss)
        return model, tokenizer, dict(figures, **held_out_figures(model, tokenizer, args), warm_up_prefix=prefix)

    return cached_build(Path(out_dir), args, build, make, from_scratch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (or reuse) guess-the-number's model.")
    parser.add_argument("--out", default="cache/tiny-qwen3-guess")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=300)
    parser.add_argument("--midpoint-rate", type=float, default=0.5, help="share of warm-up guesses at the midpoint")
    parser.add_argument("--from-scratch", action="store_true", help="train it, even where a shipped build matches")
    cli = parser.parse_args()
    path = build_guess_model(
        cli.out,
        seed=cli.seed,
        warmup_steps=cli.warmup_steps,
        midpoint_rate=cli.midpoint_rate,
        from_scratch=cli.from_scratch,
    )
    print(Path(path, "build_info.json").read_text())
