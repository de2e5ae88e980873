"""The rollouts of the recipe's rollout steps, sent to the engine up to ``max_staleness`` syncs ahead.

    queue = RolloutQueue(engine, prompts_for, sampling, max_staleness=1, last_step=30)
    samples, metrics = queue.take(rollout_step)   # after that step's sync: its completions (and sends the next)

max_staleness=0 (either engine): a rollout step's completions are sampled after its sync and waited for; the
synchronous recipe, request for request.

max_staleness=s >= 1 (vllm.mode=server): when rollout step t takes its completions, the requests of steps t+1 .. t+s
go out too, so the server generates them while the trainer scores and updates on step t's. The syncs in between land
between two decode steps (the sync pauses with vLLM's mode "keep"): requests in flight continue on the new weights,
prefilled again on them (the pause clears the cache, preempting them), and every token comes back labelled with the
weight version that sampled it (vLLM's ``weight_versions``). Step t+s's requests leave once version t is served, so
no token is more than s versions older than the trainer that learns from it: a group is held back rather than
dropped, and `ServerEngine.receive` refuses a token older than the version served when its request left, so the
bound is checked on every token. The queue is bounded by the same rule: at most s + 1 rollout steps of requests
exist at a time.

A resumed run starts with an empty queue: what was queued or in flight is regenerated from the checkpoint's policy
(the seeds and the versions that sample it differ from the uninterrupted run's; docs/async.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from grpo.engines.interface import Engine, EngineStateError, RolloutAbandoned, Sample, abandonable_wait
from grpo.engines.server import ServerError


class RolloutQueue:
    """Rollout steps' requests in flight on the engine (at most ``max_staleness`` steps ahead), taken in order."""

    def __init__(
        self,
        engine: Engine,
        prompts_for: Callable[[int], list[list[int]]],
        sampling,
        max_staleness: int,
        last_step: int,
    ):
        self.engine, self.prompts_for, self.sampling = engine, prompts_for, sampling
        self.max_staleness, self.last_step = max_staleness, last_step
        self.sent: dict = {}  # rollout step -> the engine's pending requests (`ServerEngine.send`)
        self.server_intervals: list[tuple[float, float]] = []  # this process's requests: (sent, answered), epoch s
        self.window_start: float | None = None  # where the previous take ended
        self.answered: list[tuple[float, float]] = []  # the last take's requests: (sent, answered), epoch seconds

    def take(self, rollout_step: int, use_tqdm: bool = False) -> tuple[list[Sample], dict]:
        """This rollout step's completions (the engine must serve version ``rollout_step``: its sync is done) and
        the queue's metrics (server mode): the trainer's wait, this process's server idle time, token staleness."""
        # the colocated engine generates in this process (a ToolEngine sends as the engine it wraps does)
        if not getattr(self.engine, "sends", hasattr(self.engine, "send")):
            return self.engine.generate(self.prompts_for(rollout_step), self.sampling, use_tqdm=use_tqdm), {}
        start = time.time()
        for step in range(rollout_step, min(rollout_step + self.max_staleness, self.last_step) + 1):
            if step not in self.sent:
                self.sent[step] = self.engine.send(self.prompts_for(step), self.sampling)
        pending = self.sent.pop(rollout_step)
        samples = receive_on_every_rank(self.engine, pending)
        end = time.time()
        self.answered = pending.times
        window_start = self.window_start if self.window_start is not None else start
        self.server_intervals = [i for i in self.server_intervals if i[1] > window_start] + pending.times
        later = [interval for queued in self.sent.values() for interval in request_intervals(queued, end)]
        busy = union_seconds(self.server_intervals + later, window_start, end)
        metrics = dict(rollout_wait_s=end - start, server_idle_s=(end - window_start) - busy)
        if self.max_staleness > 0:
            metrics.update(staleness_stats(samples, rollout_step))
        self.window_start = end
        return samples, metrics


def receive_on_every_rank(engine, pending) -> list[Sample]:
    """`engine.receive`, with a failure on any rank raised on every rank (the same line): a rank that stopped alone
    would leave the others waiting in the update's collectives. A stop signal during the wait abandons the rollout
    (`RolloutAbandoned`) on every rank alike."""
    failure = None
    try:
        with abandonable_wait():
            samples = engine.receive(pending)
    except (ServerError, EngineStateError, RolloutAbandoned) as error:
        failure = error
    if torch.distributed.is_initialized():
        failures = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(failures, failure)
        failure = next((f for f in failures if f is not None), None)
    if failure is not None:
        raise failure
    return samples


def request_intervals(pending, now: float) -> list[tuple[float, float]]:
    """(sent, answered) of each request of ``pending`` that has been answered, (sent, now) of those in flight; of
    tool episodes (`grpo.episodes.loop.PendingEpisodes`), every turn's requests sent so far."""
    intervals = []
    for part in list(getattr(pending, "turns", [pending])):
        for future in part.futures:
            if not future.done():
                intervals.append((part.sent_at, now))
            elif future.exception() is None:
                _, sent, answered = future.result()
                intervals.append((sent, answered))
    return intervals


def union_intervals(intervals, start: float, end: float) -> list[tuple[float, float]]:
    """The union of ``intervals`` within [start, end], as disjoint sorted intervals."""
    union: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        lo, hi = max(lo, start), min(hi, end)
        if hi <= lo:
            continue
        if union and lo <= union[-1][1]:  # overlaps or touches the last one: extend it
            union[-1] = (union[-1][0], max(union[-1][1], hi))
        else:
            union.append((lo, hi))
    return union


def union_seconds(intervals, start: float, end: float) -> float:
    """The length of the union of ``intervals`` within [start, end]."""
    return sum(hi - lo for lo, hi in union_intervals(intervals, start, end))


def staleness_stats(samples: list[Sample], rollout_step: int) -> dict:
    """Per sampled token, versions behind the trainer that learns from it (version ``rollout_step``)."""
    versions = torch.tensor([v for s in samples for v in s.versions], dtype=torch.float64)
    behind = rollout_step - versions
    return dict(
        staleness_sum=behind.sum().item(),
        staleness_count=float(behind.numel()),
        staleness_max=behind.max().item() if behind.numel() else 0.0,
        stale_completions=float(sum(min(s.versions, default=rollout_step) < rollout_step for s in samples)),
        # an update landed while they were generated: sampled by two versions or more
        updated_in_flight=float(sum(len(set(s.versions)) > 1 for s in samples)),
    )
