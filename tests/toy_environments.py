"""Environments for the tests (importable by module name: tests/ is on the launched recipe's PYTHONPATH): a number
to find with higher/lower answers, and the same with faults. Every instance records itself in `BUILT`, so a test
can see which were reset, called and closed."""

import random
import threading
import time

from grpo.tasks.environments import Calculator

BUILT: list = []  # every instance built, in order


class SecretNumber:
    """A secret number from 0 to 99 drawn from ``seed`` (from its own RNG without one); ``guess`` answers "higher",
    "lower" or "right", with the step reward 1.0 for the right guess (0.0 otherwise)."""

    def __init__(self):
        self.secret, self.guesses, self.closed, self.reset_kwargs = None, [], 0, None
        BUILT.append(self)

    def reset(self, seed=None, **row):
        self.reset_kwargs = {**row, "seed": seed}
        self.secret = random.Random(seed).randrange(100)  # seed None: the instance's own draw
        return f" (secret drawn: {self.secret})"

    def guess(self, number: int) -> tuple[str, float]:
        """Guess the secret.

        Args:
            number: the guess, 0 to 99
        """
        if not 0 <= number <= 99:
            raise ValueError(f"{number} is not from 0 to 99")
        self.guesses.append(number)
        if number == self.secret:
            return "right", 1.0
        return ("higher" if number < self.secret else "lower"), 0.0

    def close(self):
        self.closed += 1


class ResetRaises(SecretNumber):
    def reset(self, seed=None, **row):
        raise ConnectionError("sandbox preempted")


class GuessRaises(SecretNumber):
    def guess(self, number: int) -> str:
        """Guess the secret.

        Args:
            number: the guess
        """
        raise ConnectionError("sandbox preempted")


class GuessHangs(SecretNumber):
    def guess(self, number: int) -> str:
        """Guess the secret.

        Args:
            number: the guess
        """
        time.sleep(30)
        return "late"


class CloseHangs(SecretNumber):
    """close() of an instance that was reset hangs until `release` is set (within 30 s)."""

    release = threading.Event()

    def close(self):
        if self.secret is not None:
            self.release.wait(30)
        super().close()


class BadReward(SecretNumber):
    def guess(self, number: int) -> tuple[str, float]:
        """Guess the secret.

        Args:
            number: the guess
        """
        return "right", float("nan")


class NoSeed:
    """reset cannot take the group's seed."""

    def reset(self, question):
        return None

    def look(self) -> str:
        """Look around."""
        return "nothing"


class PreemptedCalculator(Calculator):
    """The shipped calculator environment whose sandbox is preempted after its first 16 episodes in a process: every
    later reset raises ConnectionError."""

    resets = 0

    def reset(self, seed=None, **row):
        PreemptedCalculator.resets += 1
        if PreemptedCalculator.resets > 16:
            raise ConnectionError("sandbox preempted")
        return super().reset(seed, **row)
