"""The one rollout-engine interface the recipe, ``grpo.run`` and the benchmarks use, and what an engine returns.

Two implementations: `grpo.engines.colocated.ColocatedEngine` (one in-process vLLM per training rank,
vllm.mode=colocate) and `grpo.engines.server.ServerEngine` (a separate ``vllm serve``, vllm.mode=server).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Protocol


@dataclass
class Sample:
    """One completion of one prompt, as the engine sampled it."""

    prompt_ids: list[int]
    completion_ids: list[int]
    text: str
    logprobs: list[float]  # log-prob of each sampled token under the (tempered) sampling distribution
    truncated: bool  # stopped by max_tokens rather than by EOS
    prompt_index: int  # index into the prompt list given to `generate`
    versions: list[int] | None = None  # the policy version that sampled each token (server: vLLM's weight_versions)
    # multi-turn tool use (grpo.episodes): completion_ids hold every token after the prompt, model and tool tokens
    tool_mask: list[int] | None = None  # TRL's name: 1 on the model's tokens, 0 on tool tokens (no loss)
    turn_of_token: list[int] | None = None  # the model turn (1, 2, ...) that sampled each token, 0 on tool tokens
    tool_calls: int = 0
    tool_failures: int = 0
    tool_malformed: int = 0  # calls the parser could not read (each also counted in tool_failures)
    retokenization_drift: bool = False  # re-rendering and re-tokenizing the episode gives other ids than sampled
    # an agent's session (grpo.episodes.agent): its own reward (None: the reward functions score the text)
    reward: float | None = None
    agent_error: bool = False  # the agent raised, hung or returned no reward: the episode scores 0.0
    agent_refusals: int = 0  # its requests refused for a rewritten history
    # an environment's episode (grpo.episodes.environments): its instance, what it gave each model turn, its failure
    environment: object = None
    turn_rewards: list[float] | None = None  # the step rewards of each model turn's calls (0.0 where none)
    env_failure: str | None = None  # its reset or a step raised or hung: left out of the baseline and the loss


class EngineStateError(RuntimeError):
    """A generation the engine cannot serve as asked: outside a generation phase, or on discarded weights."""


class RolloutAbandoned(Exception):
    """A stop signal came while the rollout waited on tools or on the server: the rollout step is given up (its
    requests are aborted when the engine closes, its tool calls left to their daemon threads)."""


class _Abandoning:
    """Where a stop signal may end the rollout at once (`StopRequest`): the main thread is inside the rollout
    (`rollout_in_progress`) and waiting there on tools or the server (`abandonable_wait`), never in a collective, a
    checkpoint or vLLM's own code. Only the main thread, where Python runs signal handlers, counts."""

    in_rollout = False
    waits = 0
    stopping = False  # a stop signal came: every later wait of a rollout gives it up on entry


@contextlib.contextmanager
def rollout_in_progress():
    """The recipe's rollout (`RolloutQueue.take`): a stop signal during one of its waits abandons it."""
    main = threading.current_thread() is threading.main_thread()
    if main:
        _Abandoning.in_rollout = True
    try:
        yield
    finally:
        if main:
            _Abandoning.in_rollout = False


@contextlib.contextmanager
def abandonable_wait():
    """A wait on tools or on the server that holds nothing a stop would leave half done (no collective)."""
    main = threading.current_thread() is threading.main_thread()
    if main and _Abandoning.in_rollout and _Abandoning.stopping:
        raise RolloutAbandoned("a stop signal came during the rollout")
    if main:
        _Abandoning.waits += 1
    try:
        yield
    finally:
        if main:
            _Abandoning.waits -= 1


def stop_requested() -> bool:
    """Called by a stop signal's handler (on the main thread): the rollout's later waits give it up on entry;
    whether the handler may raise `RolloutAbandoned` now, inside one."""
    _Abandoning.stopping = True
    return _Abandoning.in_rollout and _Abandoning.waits > 0


class Engine(Protocol):
    """What the recipe, ``grpo.run`` and the benchmarks need of a rollout engine (`ColocatedEngine`: colocated,
    in-process; `ServerEngine`: a separate ``vllm serve``)."""

    def awake(self) -> contextlib.AbstractContextManager: ...  # one generation phase: wake, then sleep at the end

    def sync_policy(self, model, adapter_dir, version: int, rank: int) -> dict[str, float]: ...

    # sampling: one SamplingParams for every prompt, or a list of them, one per prompt
    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]: ...

    def close(self) -> None: ...
