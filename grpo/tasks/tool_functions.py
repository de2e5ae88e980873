"""Tools a policy may call in a multi-turn rollout, named in a config as ``grpo.tasks.tool_functions:<function>``.

Each is a plain Python function with type hints and a Google-style docstring: transformers' ``get_json_schema``
turns it into the JSON schema the chat template lists to the model, and a rollout calls it with the parsed arguments
and returns its result (a string) as the tool message. A tool raises ``ValueError`` on arguments it refuses; the
rollout reports the error to the model instead of a result. The module to extend: add a function here (or in any
importable module) and name it.
"""

from __future__ import annotations

import ast
import operator

_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_CHARS = 256  # a rollout's expression is short; longer text is refused before it is parsed
_MAX_DIGITS = 64  # bounds every intermediate value, so no product grows without bound


def _evaluate(node: ast.AST, expression: str) -> int:
    """The value of ``node``: an integer literal, a unary sign or a binary + - * of such nodes (parentheses only
    shape the tree); any other node is refused."""
    if isinstance(node, ast.Constant) and type(node.value) is int:  # bool is an int subclass: refused
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand, expression)
        value = -value if isinstance(node.op, ast.USub) else value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        value = _OPERATORS[type(node.op)](_evaluate(node.left, expression), _evaluate(node.right, expression))
    else:
        raise ValueError(f"calculator: {expression!r} is not integers with + - * and parentheses")
    if len(str(abs(value))) > _MAX_DIGITS:
        raise ValueError(f"calculator: {expression!r} has a value longer than {_MAX_DIGITS} digits")
    return value


def calculator(expression: str) -> str:
    """Evaluate an integer arithmetic expression.

    Args:
        expression: integers with + - * and parentheses
    """
    if not isinstance(expression, str):
        raise ValueError(f"calculator: {expression!r} is not a string")
    if len(expression) > _MAX_CHARS:
        raise ValueError(f"calculator: {expression[:32]!r}... is longer than {_MAX_CHARS} characters")
    try:  # parsing only builds a tree: nothing is evaluated but the nodes _evaluate allows
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise ValueError(f"calculator: {expression!r} is not an arithmetic expression") from None
    return str(_evaluate(tree.body, expression))
