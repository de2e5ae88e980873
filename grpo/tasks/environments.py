"""Environments (`environment_factory`, docs/environments.md), named in a config as ``grpo.tasks.environments:<Class>``.

Each is a class built with no argument, one instance per episode: ``reset(**row)`` (the data set's columns and the
group's ``seed``) returns an observation appended to the prompt, or None; its public methods are the tools the model
calls in that episode, described by their type hints and Google-style docstrings. A method returns a string, or
``(string, reward)`` to give its model turn a step reward. The module to extend: add a class here (or in any
importable module) and name it.
"""

from __future__ import annotations

from grpo.tasks.tool_functions import calculator


class Calculator:
    """The tool task's calculator (recipes/configs/tiny_cpu_tools.yaml) as an environment: each episode's instance
    keeps the expressions it evaluated (`history`), which a reward function can read through ``environments=``."""

    def reset(self, seed: int | None = None, **row) -> None:
        self.history: list[str] = []
        return None

    def calculator(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression.

        Args:
            expression: integers with + - * and parentheses
        """
        result = calculator(expression)
        self.history.append(expression)
        return result
