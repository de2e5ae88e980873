"""A model turn's tool calls, parsed from its sampled ids by the model family's own parser.

    parser = make_parser(cfg.tool_calling.parser, tokenizer, tools)   # once, at start-up
    calls = parser.calls(turn_ids, history_ids)                         # per turn: [{"name", "arguments"} | error]

The parser is chosen from the chat template (`tool_calling.parser: auto`) or named in the config:
- ``trl``: TRL 1.16's response template for the family (`trl.chat_template_utils`, read by the tokenizer's own
  ``parse_response``), which also types the arguments from the tools' JSON schemas;
- a vLLM 0.32 tool parser (``hermes``, ``qwen3_xml``, ``llama3_json``, ``glm45``, ``lfm2``, ``gemma4``,
  ``deepseek_v3``, …: `vllm.tool_parsers.ToolParserManager`), given the turn's text after its reasoning, as vLLM's
  server gives it after its reasoning parser;
- ``regex``: the hand parser for ``<tool_call>{"name": …, "arguments": …}</tool_call>`` blocks (the embedded tool
  model's own template, which neither TRL nor vLLM knows by name).

Parsing reads the sampled ids (decoded, never encoded again): it cannot change an id of the episode. Each parser
returns the calls in order; a call the family's opener starts but the parser cannot read is an error string (it
counts as a call and a malformed one, and its result is that error), so a format mismatch shows in
`tools/malformed_frequency` instead of passing as "no tool call".
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from grpo.config import VLLM_TOOL_PARSERS as VLLM_PARSERS
from grpo.config import ConfigError


@dataclass(frozen=True)
class Family:
    """A chat-template family of TRL's shipped templates: its response template (None: TRL has none), its vLLM
    tool parser (None: none that runs offline), and the texts that open and close a tool call (or a block of
    calls) in a model turn."""

    trl_template: str | None
    vllm_parser: str | None
    opener: str
    closer: str


# The TRL template names (trl/chat_templates/<name>.jinja, and each <name>_training.jinja) of each family.
FAMILIES = {
    **dict.fromkeys(
        ("qwen2_5", "qwen3", "qwen3_instruct_2507"), Family("qwen3_template", "hermes", "<tool_call>", "</tool_call>")
    ),
    **dict.fromkeys(
        ("qwen3_5_nothink", "qwen3_5_think", "qwen3_6", "qwen3_8"),
        Family("qwen3_5_template", "qwen3_xml", "<tool_call>", "</tool_call>"),
    ),
    **dict.fromkeys(
        ("nemotron_3_nano", "nemotron_3_super", "nemotron_3_ultra", "nemotron_3_5_lightning"),
        Family("nemotron_3_template", "qwen3_xml", "<tool_call>", "</tool_call>"),
    ),
    **dict.fromkeys(("llama3_1", "llama3_2"), Family("llama3_template", "llama3_json", '{"name"', "<|eot_id|>")),
    "glm4moe": Family("glm4moe_template", "glm45", "<tool_call>", "</tool_call>"),
    # vLLM's `openai` parser is a stub: gpt-oss calls are read by its Harmony parser, which needs the o200k files
    "gptoss": Family("gptoss_template", None, "to=functions.", "<|call|>"),
    **dict.fromkeys(
        ("lfm2_v2", "lfm2_2_5", "lfm2_2_5_v2"),
        Family("lfm2_2_5_template", "lfm2", "<|tool_call_start|>", "<|tool_call_end|>"),
    ),
    **dict.fromkeys(
        ("gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5"),
        Family("gemma4_template", "gemma4", "<|tool_call>", "<tool_call|>"),
    ),
    "deepseekv3": Family(None, "deepseek_v3", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
}
REASONING_CLOSE, REASONING_OPEN = "</think>", "<think>"


def template_family(chat_template: str | dict | None) -> str | None:
    """The TRL template name whose text (or whose ``_training`` variant's text) the chat template is, or None."""
    from trl import chat_template_utils

    if isinstance(chat_template, dict):
        chat_template = chat_template.get("default")
    for name in FAMILIES:
        for variant in (f"{name}_chat_template", f"{name}_training_chat_template"):
            if getattr(chat_template_utils, variant, None) == chat_template:
                return name
    return None


def renders_hermes_json(tokenizer) -> bool:
    """Whether the chat template writes a tool call as ``<tool_call>`` + the call's JSON + ``</tool_call>``."""
    call = {"type": "function", "function": {"name": "probe_tool", "arguments": {"x": 1}}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render a call is not this format
        return False
    body = re.search(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    try:
        return body is not None and json.loads(body.group(1)) == {"name": "probe_tool", "arguments": {"x": 1}}
    except json.JSONDecodeError:
        return False


def resolve_parser(name: str, tokenizer) -> tuple[str, str | None]:
    """(the parser to use, the template family or None) for ``tool_calling.parser=name``; a name that cannot read
    this template's calls is a ConfigError naming it and the template."""
    family = template_family(tokenizer.chat_template)
    known = FAMILIES.get(family)
    if name == "auto":
        if known is not None and known.trl_template is not None:
            return "trl", family
        if known is not None and known.vllm_parser is not None:
            return known.vllm_parser, family
        if renders_hermes_json(tokenizer):
            return "regex", family
        raise ConfigError(
            "tool_calling.parser=auto cannot tell how this chat template writes tool calls (it is none of TRL's "
            "shipped templates and writes no <tool_call>{json}</tool_call>): set tool_calling.parser to one of "
            f"{('trl', 'regex') + VLLM_PARSERS}"
        )
    if name == "trl" and (known is None or known.trl_template is None):
        raise ConfigError(
            f"tool_calling.parser=trl: TRL has no response template for this chat template "
            f"(family {family or 'unknown'}); use auto, regex or a vLLM parser: {VLLM_PARSERS}"
        )
    return name, family


# ----------------------------------------------------------------------------- the parsers
def reasoning_stripped(text: str) -> str:
    """A turn's text after its reasoning (after the last ``</think>``; nothing if a ``<think>`` is left open)."""
    if REASONING_CLOSE in text:
        return text.rsplit(REASONING_CLOSE, 1)[1]
    return "" if REASONING_OPEN in text else text


def closed_calls_only(calls: list, text: str, family: Family) -> list:
    """``calls`` as far as the turn closed them; each call of a block left open (the turn ended or was cut inside
    it: a parser may still read part of it) and each opener the parser did not read, a malformed call."""
    opened, closed = text.count(family.opener), text.count(family.closer)
    if opened > closed:  # the last block is open: its calls are not the model's finished calls
        kept = calls[:closed] if closed else []
        tail = text.rsplit(family.opener, 1)[-1].strip()[:80]
        return kept + [f"malformed tool call (never closed): {family.opener}{tail!r}"] * (len(calls) - len(kept) or 1)
    return calls + [f"malformed tool call (not read by the parser): {text[:80]!r}"] * max(0, opened - len(calls))


def checked_call(name, arguments, raw: str) -> dict | str:
    """``{"name", "arguments"}``, or why not: TRL's rules (`_validate_tool_calls`: a missing or null arguments
    field is ``{}``; a JSON-string arguments field is read as JSON)."""
    if not isinstance(name, str) or not name:
        return f"malformed tool call (no name): {raw[:80]!r}"
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as err:
            return f"malformed tool call (arguments are not JSON: {err.msg}): {raw[:80]!r}"
    if not isinstance(arguments, dict):
        return f"malformed tool call (arguments are not an object): {raw[:80]!r}"
    return {"name": name, "arguments": arguments}


TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
TOOL_CALL_OPEN = "<tool_call>"
HERMES = Family(None, "hermes", TOOL_CALL_OPEN, "</tool_call>")  # a vLLM parser named for an unknown template


def parse_tool_calls(text: str) -> list[dict | str]:
    """The hand parser: the ``<tool_call>{json}</tool_call>`` calls of an assistant turn's text, in order, each
    ``{"name", "arguments"}`` or a string saying why that call is malformed; an opener left unclosed (alone or
    after closed calls) is one more malformed call."""
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(f"malformed tool call (not JSON: {err.msg}): {body.strip()[:80]!r}")
            continue
        if not isinstance(call, dict):
            calls.append(f"malformed tool call (no name): {body.strip()[:80]!r}")
        else:
            calls.append(checked_call(call.get("name"), call.get("arguments"), body.strip()))
    after_last = text.rsplit("</tool_call>", 1)[-1]
    if TOOL_CALL_OPEN in after_last:  # opened, never closed: the turn ended inside the call
        body = after_last.split(TOOL_CALL_OPEN, 1)[1]
        calls.append(f"malformed tool call (no closing </tool_call>): {body[:80]!r}")
    return calls


class RegexParser:
    name = "regex"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def calls(self, turn_ids: list[int], history_ids: list[int]) -> list[dict | str]:
        return parse_tool_calls(self.tokenizer.decode(turn_ids, skip_special_tokens=False))


PREFIX_WINDOW = 64  # history tokens decoded first when looking for the last assistant header (doubled until found)


class TrlParser:
    """TRL's response template of the family, read by the tokenizer's ``parse_response`` with the history as its
    prefix and the tools' schemas (which type the arguments).

    ``parse_response`` reads of its prefix only the text after the template's last start anchor (the assistant
    header: `ResponseTemplate.truncate_past_last_anchor`), but decodes the whole prefix to find it: given the whole
    history, a turn's parse would decode every token of the episode so far, and an episode's parses the square of
    its length. `prefix_text` decodes the history's tail until it holds that anchor, and passes that text."""

    name = "trl"

    def __init__(self, tokenizer, tools: list[Callable], family: str):
        from transformers.utils.chat_parsing.response_templates import load_response_template
        from trl import chat_template_utils

        self.tokenizer, self.tools, self.family = tokenizer, tools, FAMILIES[family]
        # as TRL's `add_response_schema` does, but by family: a `*_training` template is not among its names
        tokenizer.response_template = getattr(chat_template_utils, self.family.trl_template)
        self.start_anchor = load_response_template(tokenizer.response_template).start_anchor_re

    def prefix_text(self, history_ids: list[int]) -> str:
        """The history's text from the start of its last assistant header (the response template's start anchor):
        what ``parse_response`` keeps of the whole history's text, from a decode of its tail only (windows of
        `PREFIX_WINDOW` tokens, doubled until one holds the anchor after its first character, so that a window cut
        inside a token's text or inside an anchor cannot decide the match). No anchor: the whole history's text, as
        ``parse_response`` reads it then."""
        window = PREFIX_WINDOW
        while True:
            whole = window >= len(history_ids)
            text = self.tokenizer.decode(history_ids[-window:] if not whole else history_ids, skip_special_tokens=False)
            starts = [match.start() for match in self.start_anchor.finditer(text)]
            if starts and (starts[-1] > 0 or whole):
                return text[starts[-1] :]
            if whole:
                return text
            window *= 2

    def calls(self, turn_ids: list[int], history_ids: list[int]) -> list[dict | str]:
        text = reasoning_stripped(self.tokenizer.decode(turn_ids, skip_special_tokens=False))
        prefix = self.prefix_text(history_ids)
        try:
            parsed = self.tokenizer.parse_response(turn_ids, prefix=prefix, tools=self.tools or None)
        except (ValueError, TypeError, KeyError):  # the template's parser gives up on a malformed call
            parsed = {}
        calls = []
        for call in (parsed or {}).get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, dict) else {}
            calls.append(checked_call(function.get("name"), function.get("arguments"), json.dumps(call, default=str)))
        return closed_calls_only(calls, text, self.family)


class VllmParser:
    """A vLLM tool parser (`ToolParserManager`) on the turn's text after its reasoning, with the tools' schemas in
    the request, as vLLM's chat server runs it."""

    def __init__(self, name: str, tokenizer, tools: list[Callable], family: Family):
        from transformers.utils import get_json_schema
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        self.name, self.tokenizer, self.family = name, tokenizer, family
        schemas = [{"type": "function", "function": get_json_schema(t)["function"]} for t in tools]
        self.request = ChatCompletionRequest(messages=[{"role": "user", "content": ""}], model="policy", tools=schemas)
        self.parser = ToolParserManager.get_tool_parser(name)(tokenizer, self.request.tools)

    def calls(self, turn_ids: list[int], history_ids: list[int]) -> list[dict | str]:
        text = reasoning_stripped(self.tokenizer.decode(turn_ids, skip_special_tokens=False))
        try:
            found = self.parser.extract_tool_calls(text, self.request)
            parsed = found.tool_calls if found.tools_called else []
        except Exception:  # noqa: BLE001 - a parser's failure on one turn is that turn's malformed call
            parsed = []
        calls = [checked_call(c.function.name, c.function.arguments, c.function.arguments or "") for c in parsed]
        return closed_calls_only(calls, text, self.family)


def make_parser(name: str, tokenizer, tools: list[Callable]):
    """The parser ``tool_calling.parser=name`` gives for this tokenizer's chat template (`resolve_parser`)."""
    chosen, family = resolve_parser(name, tokenizer)
    if chosen == "regex":
        return RegexParser(tokenizer)
    if chosen == "trl":
        return TrlParser(tokenizer, tools, family)
    return VllmParser(chosen, tokenizer, tools, FAMILIES.get(family, HERMES))


# ----------------------------------------------------------------------------- arguments, typed as declared
@functools.cache
def declared_types(func: Callable) -> dict[str, str]:
    """The JSON-schema type of each parameter the tool declares (as TRL and transformers describe it)."""
    from transformers.utils import get_json_schema

    try:
        properties = get_json_schema(func)["function"]["parameters"].get("properties", {})
    except Exception:  # noqa: BLE001 - a callable the config did not load (no docstring): nothing declared
        return {}
    return {key: spec["type"] for key, spec in properties.items() if isinstance(spec.get("type"), str)}


JSON_TYPES = {"integer": int, "number": (int, float), "boolean": bool, "array": list, "object": dict}


def typed_arguments(func: Callable, arguments: dict) -> dict:
    """The arguments with each string value converted to the type the tool declares for it (integer, number,
    boolean, array or object), as TRL's parsing types them from the tool's schema: a model that writes
    ``{"a": "3"}`` for ``a: int`` calls ``f(a=3)``. A value that does not convert is passed as written."""
    kinds, typed = declared_types(func), dict(arguments)
    for key, value in arguments.items():
        expected = JSON_TYPES.get(kinds.get(key))
        if expected is None or not isinstance(value, str):
            continue
        try:
            converted = json.loads(value.strip())
        except json.JSONDecodeError:
            continue
        if isinstance(converted, expected) and isinstance(converted, bool) == (kinds[key] == "boolean"):
            typed[key] = converted
    return typed
