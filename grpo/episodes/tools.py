"""The tools of a config and their calls: `load_tools` ('module:function' -> functions the model can be told about),
`ToolCaller` (time limit, output cap, concurrency) and the error result a failed call gives the model.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass

from grpo.config import ConfigError
from grpo.engines.interface import RolloutAbandoned, abandonable_wait
from grpo.episodes.parsers import typed_arguments
from merge.server_health import start_in_daemon_threads


def import_function(name: str, what: str) -> Callable:
    """'module:function' -> the function; a name that does not look so, cannot be imported or is not callable is a
    ConfigError naming ``what`` and the name."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{what} {name!r} must look like 'module:function'")
    try:
        func = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{what} {name!r} cannot be imported: {err}") from None
    if not callable(func):
        raise ConfigError(f"{what} {name!r} is not a function")
    return func


def load_tools(names: list[str] | None) -> list[Callable]:
    """'module:function' -> the functions, each with a JSON schema from its signature and docstring (as TRL and
    transformers build it); what cannot be imported or described is a ConfigError naming it."""
    from transformers.utils import get_json_schema

    tools = []
    for name in names or []:
        func = import_function(name, what="tools entry")
        try:
            get_json_schema(func)
        except Exception as err:  # transformers' TypeHintParsingException / DocstringParsingException
            raise ConfigError(
                f"tools entry {name!r} cannot be described to the model: {err} (a tool needs type hints and a "
                "Google-style docstring with an Args: section)"
            ) from None
        tools.append(func)
    names_seen = [t.__name__ for t in tools]
    if len(set(names_seen)) != len(names_seen):
        raise ConfigError(f"tools={names} holds two functions of the same name: the model calls a tool by name")
    return tools


@dataclass
class ToolCaller:
    """Runs tool calls with a time limit and an output cap; every failure becomes an error result."""

    tools: dict[str, Callable]
    timeout_s: float = 10.0
    max_output_chars: int = 2000

    def run(self, calls: list[dict | str]) -> list[tuple[str, str, bool]]:
        """(tool name, result text, failed) per call, the calls run concurrently (daemon threads: a hung tool is
        abandoned at its timeout, never waited for). A tool ends nothing but its own call: whatever it raises,
        ``SystemExit`` (a library's ``sys.exit``) and ``KeyboardInterrupt`` included, is its error result; a stop
        signal to the trainer during the wait abandons the rollout (`RolloutAbandoned`, raised in this thread)."""
        futures = start_in_daemon_threads([lambda c=c: self._invoke(c) for c in calls], max_workers=8)
        results = []
        with abandonable_wait():
            for call, future in zip(calls, futures):
                results.append(self._result(call, future))
        return results

    def _result(self, call: dict | str, future) -> tuple[str, str, bool]:
        name = call["name"] if isinstance(call, dict) else "unknown"
        try:
            value = future.result(timeout=self.timeout_s)
        except TimeoutError:
            return name, error_result(f"tool {name!r} timed out after {self.timeout_s:g} s"), True
        except RolloutAbandoned:  # raised by the stop signal's handler in this thread, not by the tool
            raise
        except BaseException as err:  # noqa: BLE001 - a tool's own error (raised in its thread) is the model's result
            return name, error_result(f"{type(err).__name__}: {err}"), True
        return self._text(name, value)

    def _text(self, name: str, value) -> tuple[str, str, bool]:
        """A tool's value as its call's result: a string within the cap, else an error result."""
        if not isinstance(value, str):
            return name, error_result(f"tool {name!r} returned {type(value).__name__}, not str"), True
        if len(value) > self.max_output_chars:
            problem = f"tool {name!r} returned {len(value)} characters, over the cap of {self.max_output_chars}"
            return name, error_result(problem), True
        return name, value, False

    def _invoke(self, call: dict | str):
        tool, arguments = self._resolve(call)
        return run_to_result(tool(**arguments))

    def _resolve(self, call: dict | str) -> tuple[Callable, dict]:
        """The tool a call names and its arguments typed as the tool declares them; a malformed call or an unknown
        name raises ValueError (the model's error result)."""
        if isinstance(call, str):
            raise ValueError(call)
        if call["name"] not in self.tools:
            raise ValueError(f"tool {call['name']!r} not found; the tools are {sorted(self.tools)}")
        tool = self.tools[call["name"]]
        return tool, typed_arguments(tool, call["arguments"])


def run_to_result(value):
    """An `async def` tool's coroutine run to its end here, on the call's own thread and event loop, within the
    timeout; any other value as it is."""
    return asyncio.run(value) if inspect.iscoroutine(value) else value


def error_result(message: str) -> str:
    return json.dumps({"error": message})
