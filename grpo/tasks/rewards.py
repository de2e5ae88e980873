"""Reward functions, named in a config as ``grpo.tasks.rewards:<function>`` (``reward_funcs``).

Each has TRL's reward-function signature: ``f(completions, **columns) -> list[float | None]``, one value per
completion (None: not applicable). A parameter without a default names a dataset column the recipe passes
(``answer`` below); ``prompts``, ``completions`` and ``completion_ids`` come from the rollout. Add a function here
(or in any importable module) and name it in ``reward_funcs``; several are summed, as in TRL.
"""

from __future__ import annotations

import re


def extract_answer(text: str) -> str | None:
    """The number after the last ``####`` (GSM8K convention), without commas or spaces; None if absent."""
    matches = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
    return matches[-1].replace(",", "") if matches else None


def gsm8k_exact_answer_reward(completions, answer, **kwargs) -> list[float]:
    """TRL reward function: 1.0 when the completion's ``####`` number equals the reference answer's, else 0.0.

    ``completions`` are strings, or chat messages (``[{"role": "assistant", "content": ...}]``).
    """
    rewards = []
    for completion, reference in zip(completions, answer):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        got = extract_answer(text)
        rewards.append(float(got is not None and got == extract_answer(reference)))
    return rewards
