"""The one rollout-engine interface the recipe, ``grpo.run`` and the benchmarks use, and what an engine returns.

Two implementations: `grpo.engines.colocated.ColocatedEngine` (one in-process vLLM per training rank,
vllm.mode=colocate) and `grpo.engines.server.ServerEngine` (a separate ``vllm serve``, vllm.mode=server).
"""

from __future__ import annotations

import contextlib
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


class EngineStateError(RuntimeError):
    """A generation the engine cannot serve as asked: outside a generation phase, or on discarded weights."""


class Engine(Protocol):
    """What the recipe, ``grpo.run`` and the benchmarks need of a rollout engine (`ColocatedEngine`: colocated,
    in-process; `ServerEngine`: a separate ``vllm serve``)."""

    def awake(self) -> contextlib.AbstractContextManager: ...  # one generation phase: wake, then sleep at the end

    def sync_policy(self, model, adapter_dir, version: int, rank: int) -> dict[str, float]: ...

    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]: ...

    def close(self) -> None: ...
