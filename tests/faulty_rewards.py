"""Reward functions with TRL's signature that misbehave on purpose (used by tests/test_reliability.py)."""

import os

_calls = 0


def nan_on_rank0_second_call(completions, **kwargs) -> list[float]:
    """1.0 for every completion, except NaN on rank 0's second call (its step 2): only one rank sees it."""
    global _calls
    _calls += 1
    bad = _calls == 2 and os.environ.get("RANK", "0") == "0"
    return [float("nan") if bad else 1.0 for _ in completions]


def flat_for_two_steps(completions, **kwargs) -> list[float]:
    """The same reward for every completion in the first two rollout steps (zero advantages: no update), then one
    that tells completions apart (their length's parity)."""
    global _calls
    _calls += 1
    return [1.0 if _calls <= 2 else float(len(c) % 2) for c in completions]
