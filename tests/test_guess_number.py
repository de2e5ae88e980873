"""Guess-the-number's rules, data and reward (grpo/tasks/guess_number.py); no model, no engine."""

import math
import random

import pytest

from grpo.config import load_config
from grpo.data import load_problems, reward_columns
from grpo.episodes.environments import EnvironmentCaller, load_environment
from grpo.tasks.guess_number import (
    MAX_GUESSES,
    SHAPING,
    GuessNumber,
    guess_number_reward,
    make_guess_problems,
    narrowing_reward,
)


def started(seed: int) -> GuessNumber:
    game = GuessNumber()
    assert game.reset(seed=seed, **make_guess_problems(1)[0]) is None
    return game


def binary_search(game: GuessNumber) -> list[tuple[int, str, float]]:
    """Guess each interval's midpoint until the secret is found: (guess, feedback, step reward) per guess."""
    low, high, steps = 0, 63, []
    while True:
        number = (low + high) // 2
        feedback, reward = game.guess(number)
        steps.append((number, feedback, reward))
        if feedback.startswith("correct"):
            return steps
        low, high = (int(x) for x in feedback.split(": ")[1].split(" to "))


def test_the_group_seed_decides_the_secret():
    """One seed, one secret, whichever instance draws it (a group's episodes chase one number); other seeds others."""
    assert {started(7).secret for _ in range(4)} == {started(7).secret}
    secrets = {started(seed).secret for seed in range(200)}
    assert secrets <= set(range(64)) and len(secrets) > 50


def test_feedback_gives_the_interval_left_and_binary_search_finds_every_secret_in_the_budget():
    game = started(0)
    game.secret = 40
    assert game.guess(31) == ("higher: 32 to 63", pytest.approx(narrowing_reward(64, 32)))
    assert game.guess(50)[0] == "lower: 32 to 49"
    assert game.guess(10)[0] == "higher: 32 to 49"  # a guess outside the interval narrows nothing
    assert game.guess(40)[0] == "correct: 40" and game.found
    turns = []
    for secret in range(64):
        game = started(0)
        game.secret = secret
        steps = binary_search(game)
        assert steps[0][0] == 31 and game.found
        turns.append(len(steps))
        # potential-based shaping: the guesses' rewards sum to SHAPING for every secret found, whatever the path
        assert sum(r for _, _, r in steps) == pytest.approx(SHAPING)
    assert max(turns) == 7 <= MAX_GUESSES and sum(turns) / 64 > 5  # 6 or more turns with the answer, in general


def test_the_step_reward_credits_informative_guesses_and_cannot_be_farmed():
    """A midpoint earns a sixth of SHAPING, a guess at the interval's end almost nothing, one outside it nothing;
    eight guesses creeping up from 0 earn less than a binary search's first three."""
    assert narrowing_reward(64, 32) == pytest.approx(SHAPING / 6)
    game = started(0)
    game.secret = 63
    assert game.guess(0)[1] == pytest.approx(SHAPING * math.log2(64 / 63) / 6)
    assert game.guess(0)[1] == 0.0
    creeping = started(0)
    creeping.secret = 63
    crept = sum(creeping.guess(n)[1] for n in range(MAX_GUESSES))
    assert not creeping.found and crept < 3 * SHAPING / 6


def test_bad_moves_are_the_models_errors_and_the_budget_is_enforced():
    """Each bad move raises ValueError naming it: an error result in the episode (grpo.episodes.environments), the
    environment's state unchanged."""
    game = started(3)
    for bad, words in [(64, "64 is not from 0 to 63"), (-1, "-1 is not from 0 to 63"), ("31", "integer")]:
        with pytest.raises(ValueError, match=words):
            game.guess(bad)
    assert game.guesses == 0
    wrong = (game.secret + 1) % 64
    for _ in range(MAX_GUESSES):
        game.guess(wrong)
    with pytest.raises(ValueError, match="no guesses left: all 8 were used"):
        game.guess(game.secret)
    assert not game.found
    found = started(3)
    found.guess(found.secret)
    with pytest.raises(ValueError, match="found already"):
        found.guess(found.secret)


def test_through_the_recipes_environment_loader_and_caller():
    """The recipe describes guess(number: int) to the model, converts the model's JSON arguments to int, and takes
    its (observation, reward) as the turn's text and step reward; a bad move is an error result, not a failure."""
    environment = load_environment("grpo.tasks.guess_number:GuessNumber")
    assert environment.method_names == ["guess"]
    game = started(11)
    game.secret = 5
    caller = EnvironmentCaller(
        environment.tools_of(game), 10.0, 1000, described={f.__name__: f for f in environment.described}
    )
    results = caller.run(
        [{"name": "guess", "arguments": {"number": 31}}, {"name": "guess", "arguments": {"number": 99}}]
    )
    assert results[0][1] == "lower: 0 to 30" and caller.step_rewards == [pytest.approx(narrowing_reward(64, 31))]
    assert "99 is not from 0 to 63" in results[1][1] and game.guesses == 1


def test_the_outcome_reward_and_the_data():
    """1.0 for a found secret, 0.0 otherwise, None for a failed episode (no instance); the rows of data.name
    generated-guess, the held-out split's prompts other than the training split's."""
    found, lost = started(1), started(2)
    found.guess(found.secret)
    assert guess_number_reward(["", "", ""], environments=[found, lost, None]) == [1.0, 0.0, None]
    assert reward_columns(guess_number_reward) == []
    cfg = load_config(None, ["data.name=generated-guess", "data.num_generated=300"])
    rows = load_problems(cfg)
    assert len(rows) == 300 and rows == load_problems(cfg)
    assert all(f"Game {row['game']}: find my number from 0 to 63" in row["question"] for row in rows)
    held_out = {row["question"] for row in load_problems(cfg, "test")}
    assert len(held_out - {row["question"] for row in rows}) > 290


def test_the_env_config_fits_the_longest_game_in_its_budget():
    """recipes/configs/tiny_cpu_env.yaml: the shipped model's environment, data and reward; a game of all 8 guesses
    (the most the environment takes) and the answer, as the warm-up writes it, fits max_completion_length with the
    shipped tokenizer, and its prompt data.max_prompt_length; every number a guess can be is one token."""
    from transformers import AutoTokenizer

    from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS
    from grpo.tasks.tiny_guess import near_an_end, tools

    cfg = load_config("recipes/configs/tiny_cpu_env.yaml")
    assert cfg.environment_factory == "grpo.tasks.guess_number:GuessNumber" and cfg.advantage == "episode"
    assert cfg.data.name == "generated-guess" and cfg.model.build_tiny == "tiny-guess"
    assert cfg.max_tool_calling_iterations == MAX_GUESSES and cfg.model.dtype == "float32"
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODELS / "tiny-qwen3-guess")
    game = started(0)
    game.secret = 62
    conversation = [{"role": "user", "content": make_guess_problems(1, seed=4)[0]["question"]}]
    while game.guesses < MAX_GUESSES:
        number = near_an_end(game.low, game.low + 3, random.Random(game.guesses)) if game.guesses else 31
        call = {"type": "function", "function": {"name": "guess", "arguments": {"number": number}}}
        conversation += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "guess", "content": game.guess(number)[0]},
        ]
    assert not game.found
    conversation.append({"role": "assistant", "content": "#### 60"})
    prompt = tokenizer.apply_chat_template(conversation[:1], tools=tools(), add_generation_prompt=True)["input_ids"]
    whole = tokenizer.apply_chat_template(conversation, tools=tools())["input_ids"]
    assert len(prompt) <= cfg.data.max_prompt_length and len(whole) - len(prompt) <= cfg.max_completion_length
    assert all(len(tokenizer(str(n), add_special_tokens=False).input_ids) == 1 for n in range(64))


def test_the_builds_defaults_copy_the_shipped_model_without_training(tmp_path, monkeypatch):
    """model.build_tiny: tiny-guess builds with the builder's defaults: they are the shipped build's arguments, so a
    fresh clone copies models/tiny-qwen3-guess byte for byte; other arguments train (the control)."""
    import grpo.tasks.tiny_guess
    from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS

    def refuse(*args, **kwargs):
        raise AssertionError("trained although a shipped build matches")

    monkeypatch.setattr(grpo.tasks.tiny_guess, "_warm_up", refuse)
    out = tmp_path / "guess"
    assert grpo.tasks.tiny_guess.build_guess_model(out) == str(out)
    shipped = SHIPPED_MODELS / "tiny-qwen3-guess"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in shipped.iterdir())
    with pytest.raises(AssertionError, match="trained although"):
        grpo.tasks.tiny_guess.build_guess_model(tmp_path / "other", midpoint_rate=0.9, warmup_steps=2, batch_size=2)


def test_the_policy_probe_reads_binary_searchs_states_and_the_numbers_token():
    """recipes/guess_policy.py: the states binary search passes through (depth 2: 32 to 63 and 0 to 30, each after
    the feedback to 31), and the probability it reads is the model's for the midpoint's own token, the one token
    that differs between the call to the midpoint and to another number (the control: another number's is another
    probability, and the probabilities of several numbers at a state sum to at most 1)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS
    from recipes.guess_policy import binary_search_states, midpoint_probability

    levels = binary_search_states(2)
    assert [[(lo, hi) for _, lo, hi in states] for states in levels] == [[(0, 63)], [(0, 30), (32, 63)]]
    assert [m for m, _, _ in levels[1]] == [[(31, "lower: 0 to 30")], [(31, "higher: 32 to 63")]]
    model_dir = SHIPPED_MODELS / "tiny-qwen3-guess"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    question = make_guess_problems(1, seed=3)[0]["question"]
    moves, low, high = levels[1][1]
    at_midpoint = midpoint_probability(model, tokenizer, question, moves, low, high)
    numbers = [low, 46, 47, 48, high]  # 47 the midpoint
    others = [midpoint_probability(model, tokenizer, question, moves, n, n) for n in numbers]
    assert others[2] == pytest.approx(at_midpoint, abs=1e-7)
    assert 0.0 < at_midpoint < 1.0 and len({round(p, 6) for p in others}) == 5 and sum(others) <= 1.0 + 1e-5
