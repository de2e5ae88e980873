"""The chat template's text around the sampled ids (`Renderer`: a tool response's ids rendered alone, an assistant
turn as a re-tokenizing framework would render it again); the calls are read by `grpo.episodes.parsers`.
"""

from __future__ import annotations

from collections.abc import Callable

from grpo.episodes.parsers import TOOL_CALL
from grpo.episodes.tool_text import encode_with_tool_text


class Renderer:
    """The chat template's text around the sampled ids: a tool response's ids (alone), and an assistant turn as
    a re-tokenizing framework would render it again from parsed messages."""

    def __init__(self, tokenizer, tools: list[Callable], template_kwargs: dict | None = None):
        self.tokenizer, self.tools = tokenizer, tools
        self.template_kwargs = template_kwargs or {}  # the prompt's (`data.chat_template_kwargs`), for every render
        self.eos = tokenizer.eos_token_id

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools or None,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **self.template_kwargs,
        )

    def prompt_ids(self, messages: list[dict]) -> list[int]:
        """A conversation's prompt as the recipe tokenizes it (`grpo.data.tokenize_prompts`): rendered with the
        generation header and tokenized, each tool message's content as text (`encode_with_tool_text`)."""
        contents = [m["content"] for m in messages if m["role"] == "tool"]
        return encode_with_tool_text(self.tokenizer, self._render(messages, True), contents)

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        """TRL's `_get_tool_suffix_ids`: the ids the template puts after an assistant turn's end-of-turn token for
        these tool messages (or a user message after them), through the next assistant header. Rendered alone and
        tokenized alone."""
        name = next((m["name"] for m in tool_messages if m.get("name")), "tool")
        call = {"type": "function", "function": {"name": name, "arguments": {}}}
        head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        head_text = self._render(head, False)
        prefix = self.tokenizer(head_text, add_special_tokens=False).input_ids
        contents = [m["content"] for m in tool_messages]
        full = encode_with_tool_text(self.tokenizer, self._render(head + tool_messages, True), contents, len(head_text))
        ends = [i for i, t in enumerate(prefix) if t == self.eos]
        prefix = prefix[: ends[-1] + 1] if ends else prefix
        if full[: len(prefix)] != prefix:
            raise ValueError("the chat template's tool suffix does not follow its assistant turn token for token")
        suffix = full[len(prefix) :]
        if not ends and suffix[:1] == [self.eos]:  # the turn's stop token opens the tool turn (GLM's <|observation|>)
            return suffix[1:]  # the model sampled it: it ends the turn, and is not the tool's to add again
        return suffix

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
