"""Guess-the-number, a stateful environment (`environment_factory: grpo.tasks.guess_number:GuessNumber`).

Each episode's instance draws a secret from 0 to 63 with the group's seed (so the ``num_generations`` episodes of a
prompt chase the same number) and answers each ``guess(number)`` with ``higher``, ``lower`` or ``correct``, and the
interval the secret is still known to lie in (``"higher: 32 to 63"``). Binary search finds any secret in at most
7 guesses (the first at 31); an episode has ``MAX_GUESSES`` = 8, so solving it takes 6 to 9 model turns in general.

Rewards: ``guess_number_reward`` (a reward function, read through ``environments=``) is the outcome, 1.0 when the
episode found the secret. Each guess also earns a step reward, the shaping ``SHAPING * log2(before / after) / 6``
for narrowing the interval from ``before`` to ``after`` numbers. It is potential-based (the log-size of the interval
is the potential), so an episode's shaping sums to ``SHAPING * (6 - log2(final interval))/6`` whatever the path: at
most ``SHAPING``, reached by finding the secret, and no path earns more by taking more guesses. A midpoint guess earns
about a sixth of it, a guess at an end of the interval almost nothing: turn-level credit (``advantage: turn``) sees
which guesses were informative.

    rows = make_guess_problems(4096, seed=0)   # data.name: generated-guess
"""

from __future__ import annotations

import math
import random

LOWEST, HIGHEST = 0, 63
MAX_GUESSES = 8  # binary search needs at most 7 (2^7 - 1 >= 64 numbers)
SHAPING = 0.3  # the most step reward an episode can earn: finding the secret
QUESTION = "Game {game}: find my number from 0 to 63 in at most 8 guesses."
GAMES = 100_000  # game numbers are drawn from 0..GAMES-1: train and held-out rows rarely share a prompt


def make_guess_problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` rows (columns ``question`` and ``game``), deterministic in ``seed``. The game number only tells prompts
    apart (held-out prompts must differ from training prompts); the secret comes from the group's seed."""
    rng = random.Random(seed)
    games = [rng.randrange(GAMES) for _ in range(n)]
    return [{"question": QUESTION.format(game=game), "game": game} for game in games]


def narrowing_reward(before: int, after: int) -> float:
    """The step reward for narrowing the secret's interval from ``before`` to ``after`` numbers."""
    return SHAPING * math.log2(before / after) / math.log2(HIGHEST - LOWEST + 1)


class GuessNumber:
    """One game: a secret from 0 to 63, found by guessing, with higher/lower feedback and the interval left."""

    def reset(self, seed: int | None = None, **row) -> None:
        self.secret = random.Random(seed).randint(LOWEST, HIGHEST)
        self.low, self.high = LOWEST, HIGHEST
        self.found = False
        self.moves: list[tuple[int, int, int]] = []  # (low, high, guess): each guess and the interval it was made in
        return None

    @property
    def guesses(self) -> int:
        return len(self.moves)

    def guess(self, number: int) -> tuple[str, float]:
        """Guess the secret number.

        Args:
            number: the guess, from 0 to 63
        """
        if isinstance(number, bool) or not isinstance(number, int):
            raise ValueError(f"the guess must be an integer, not {number!r:.40}")
        if not LOWEST <= number <= HIGHEST:
            raise ValueError(f"{number} is not from {LOWEST} to {HIGHEST}")
        if self.found:
            raise ValueError(f"the number was found already: {self.secret}")
        if self.guesses >= MAX_GUESSES:
            raise ValueError(f"no guesses left: all {MAX_GUESSES} were used")
        self.moves.append((self.low, self.high, number))
        before = self.high - self.low + 1
        if number == self.secret:
            self.found, self.low, self.high = True, number, number
            return f"correct: {number}", narrowing_reward(before, 1)
        if number < self.secret:
            self.low = max(self.low, number + 1)
            word = "higher"
        else:
            self.high = min(self.high, number - 1)
            word = "lower"
        return f"{word}: {self.low} to {self.high}", narrowing_reward(before, self.high - self.low + 1)


def guess_number_reward(completions: list[str], environments: list, **kwargs) -> list[float | None]:
    """The outcome: 1.0 for an episode that found its secret (within its guesses), else 0.0; None for an episode
    without an instance (its environment failed: never scored)."""
    return [None if env is None else float(env.found) for env in environments]
