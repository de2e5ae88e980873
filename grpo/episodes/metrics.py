"""The per-turn and tool metrics of a rollout step's episodes: this rank's sums (`tool_stats`) and the token masks of
the turn buckets 1, 2, 3-4, 5-8, 9-16 and 17+ (`turn_masks`), read by grpo.metrics and the recipe.
"""

from __future__ import annotations

import torch

from grpo.engines.interface import Sample


def tool_stats(samples: list[Sample], agent: bool = False) -> dict[str, float]:
    """This rank's sums for the tool metrics of a rollout step (reduced across ranks by name); environments' episodes
    (environment_factory) add their failures and step rewards, an ``agent``'s (grpo.episodes.agent) its errors and
    refused requests."""
    if not samples or samples[0].tool_mask is None:
        return {}
    environments = {}
    if samples[0].turn_rewards is not None:  # environment_factory
        environments = dict(
            env_failures=float(sum(s.env_failure is not None for s in samples)),
            env_step_reward=float(sum(sum(s.turn_rewards) for s in samples)),
        )
    stats = dict(
        **environments,
        tool_episodes=float(len(samples)),
        tool_calls=float(sum(s.tool_calls for s in samples)),
        tool_failures=float(sum(s.tool_failures for s in samples)),
        tool_malformed=float(sum(s.tool_malformed for s in samples)),
        tool_turns=float(sum(max(s.turn_of_token, default=0) for s in samples)),
        tool_episodes_calling=float(sum(s.tool_calls > 0 for s in samples)),
        tool_episodes_succeeding=float(sum(s.tool_calls > s.tool_failures for s in samples)),
        tool_drifted=float(sum(s.retokenization_drift for s in samples)),
    )
    if agent:
        stats.update(
            agent_errors=float(sum(s.agent_error for s in samples)),
            agent_refusals=float(sum(s.agent_refusals for s in samples)),
        )
    return stats


# the turn buckets of the per-turn metrics, (first turn, last turn or None); turn1 and turn2 named as before
TURN_GROUPS = {
    "turn1": (1, 1),
    "turn2": (2, 2),
    "turns3to4": (3, 4),
    "turns5to8": (5, 8),
    "turns9to16": (9, 16),
    "turns17plus": (17, None),
}


def turn_masks(batch: dict, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """``mask`` [N, R] restricted to the model tokens of each turn bucket (`TURN_GROUPS`)."""
    turn = batch["turn_of_token"]
    return {
        name: mask & (turn >= low) & (turn <= high if high is not None else True)
        for name, (low, high) in TURN_GROUPS.items()
    }
