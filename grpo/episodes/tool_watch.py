"""A guard on the reward that rises while the tool calls die out.

A policy can learn to score without its tools (a parser that stopped reading its calls, a task it can guess): in one
published case Qwen3-4B reached ~0.93 reward while never making a tool call
(https://github.com/awslabs/agentcore-rl-toolkit/issues/97). The run goes on (that may be what the task rewards), but
the log says so: `ToolUseWatch.check` returns a warning when, over its window of rollout steps, the mean reward rose
while the tool calls per episode fell from some to none.
"""

from __future__ import annotations

from collections import deque


class ToolUseWatch:
    def __init__(self, window: int = 5):
        if window < 2:
            raise ValueError(f"ToolUseWatch window={window}: a rise needs at least 2 rollout steps")
        self.steps: deque[tuple[int, float, float]] = deque(maxlen=window)
        self.warned = False

    def check(self, rollout_step: int, reward_mean: float, calls_per_episode: float) -> str | None:
        """A one-line warning the first time the reward has risen over the window while the calls fell to zero
        (again only after the calls come back); None otherwise."""
        self.steps.append((rollout_step, reward_mean, calls_per_episode))
        if calls_per_episode > 0:
            self.warned = False
            return None
        (first_step, first_reward, first_calls), (_, last_reward, _) = self.steps[0], self.steps[-1]
        if self.warned or len(self.steps) < self.steps.maxlen or first_calls == 0 or last_reward <= first_reward:
            return None
        self.warned = True
        return (
            f"rollout step {rollout_step}: the reward rose from {first_reward:.3f} to {last_reward:.3f} since step "
            f"{first_step} while the tool calls per episode fell from {first_calls:.3f} to 0: the policy scores "
            "without its tools (check tools/malformed_frequency: a parser that no longer reads the calls looks the "
            "same)"
        )
