"""Reward functions with TRL's signature that misbehave on purpose (used by tests/test_reliability.py)."""

import os

_calls = 0


def nan_on_rank0_second_call(completions, **kwargs) -> list[float]:
    """1.0 for every completion, except NaN on rank 0's second call (its step 2): only one rank sees it."""
    global _calls
    _calls += 1
    bad = _calls == 2 and os.environ.get("RANK", "0") == "0"
    return [float("nan") if bad else 1.0 for _ in completions]
