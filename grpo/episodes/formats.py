"""The model's tool-call format: the calls parsed from a turn's sampled text, and the chat template's text around
the sampled ids (`Renderer`: a tool response's ids rendered alone, an assistant turn as a re-tokenizing framework
would render it again).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"


def parse_tool_calls(text: str) -> list[dict | str]:
    """The tool calls of an assistant turn's text, in order: each ``{"name", "arguments"}``, or a string saying
    why that call is malformed (it still counts as a call, and its result is that error)."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"malformed tool call (not JSON: {err.msg}): {body.strip()[:80]!r}")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append(f"malformed tool call (no name): {body.strip()[:80]!r}")
        elif not isinstance(call.get("arguments", {}), dict):
            calls.append(f"malformed tool call (arguments are not an object): {body.strip()[:80]!r}")
        else:
            calls.append({"name": call["name"], "arguments": call.get("arguments", {})})
    if not calls and TOOL_CALL_OPEN in text:  # opened, never closed: the turn ended inside the call
        calls.append(f"malformed tool call (no closing </tool_call>): {text.split(TOOL_CALL_OPEN, 1)[1][:80]!r}")
    return calls


class Renderer:
    """The chat template's text around the sampled ids: a tool response's ids (alone), and an assistant turn as
    a re-tokenizing framework would render it again from parsed messages."""

    def __init__(self, tokenizer, tools: list[Callable]):
        self.tokenizer, self.tools = tokenizer, tools
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=self.tools or None, add_generation_prompt=generation_prompt, tokenize=False
        )

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """TRL's `_get_tool_suffix_ids`: the ids the template puts after an assistant turn's end-of-turn token for
        these tool messages, through the next assistant header. Rendered alone and tokenized alone."""
        call = {"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        prefix = self.tokenizer(self._render(head, False), add_special_tokens=False).input_ids
        full = self.tokenizer(self._render(head + tool_messages, True), add_special_tokens=False).input_ids
        ends = [i for i, t in enumerate(prefix) if t == self.eos]
        prefix = prefix[: ends[-1] + 1] if ends else prefix
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template's tool suffix does not follow its assistant turn token for token")
        return full[len(prefix) :]

    def assistant_message(self, turn_ids: list[int], calls: list[dict | str]) -> dict:
        """An assistant turn as a framework that parses and re-renders keeps it: text, plus its parsed calls."""
        text = self.tokenizer.decode([t for t in turn_ids if t != self.eos], skip_special_tokens=False)
        good = [c for c in calls if isinstance(c, dict)]
        if not good or len(good) != len(calls):  # malformed calls stay in the text as written
            return {"role": "assistant", "content": text}
        content = TOOL_CALL.sub("", text).strip()
        return {
            "role": "assistant",
            "content": content,
            "tool_calls": [{"type": "function", "function": c} for c in good],
        }

    def retokenized_turn(self, message: dict, ended: bool) -> list[int]:
        """The ids a re-rendering framework trains on for one assistant turn: the template's text of ``message``
        (through its end-of-turn token when the turn ``ended``), tokenized as text."""
        head = [{"role": "user", "content": "dummy"}]
        start = self._render(head, True)
        text = self._render(head + [message], False)[len(start) :]
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        ends = [i for i, t in enumerate(ids) if t == self.eos]
        if not ended:  # cut by the length budget: no end-of-turn token was sampled
            return ids[: ends[-1]] if ends else ids
        return ids[: ends[-1] + 1] if ends else ids
