"""The calculator task as an agent that owns its loop: plain `openai` client code, nothing of this project imported.

    agent: agents.calculator_agent:solve       # recipes/configs/tiny_cpu_agent.yaml (recipes/ is on the recipe's path)

The recipe calls ``solve(client, row)`` once per episode with a client on its OpenAI-compatible endpoint (the
session already set) and the dataset row; the same function runs against any OpenAI-compatible server. It asks the
question with the calculator described as an OpenAI tool, runs each call the model makes, sends the results back as
``tool`` messages, and stops when a turn calls no tool (or after MAX_ROUNDS). It returns None: the recipe's reward
functions score the final text, as they score the native tool loop's.
"""

from __future__ import annotations

import ast
import json
import operator

MAX_ROUNDS = 3  # model turns that may call the calculator (the native config's max_tool_calling_iterations + 1)
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an integer arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "integers with + - * and parentheses"}},
            "required": ["expression"],
        },
        # transformers' schema of the native task's tool has it: the same schema renders the same prompt
        "return": {"type": "string"},
    },
}
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """An integer expression of + - * and parentheses, evaluated without eval; an error message otherwise."""

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            result = OPERATORS[type(node.op)](value(node.left), value(node.right))
            if abs(result) > 10**12:
                raise ValueError("too large")
            return result
        raise ValueError("not an integer expression")

    try:
        return str(value(ast.parse(str(expression)[:200].strip(), mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as err:
        return json.dumps({"error": f"calculator: {expression!r}: {err}"})


def solve(client, row: dict) -> float | None:
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(MAX_ROUNDS):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=[CALCULATOR])
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = call.function.arguments
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculate(expression)})
    return None
