"""bench/bench_tool_schedule.py's two arms on a stand-in server: the same requests with the same seeds, so the same
tokens; per turn, an episode whose tools answer at once waits for the slowest tool of each turn, per episode not."""

import time
from types import SimpleNamespace

from bench_tool_schedule import per_episode, per_turn

from grpo.engines.interface import Sample


class SeededServer:
    """Answers each request with 3 tokens from its seed and its history's length; records (episode, when, seed)."""

    def __init__(self):
        self.requests, self.start = [], time.perf_counter()

    def send(self, histories, sampling, seeds):
        now = time.perf_counter() - self.start
        self.requests += [(history[0], now, seed) for history, seed in zip(histories, seeds)]
        return [
            Sample(list(h), [s % 97, len(h) % 89, 7], "", [0.0] * 3, False, i)
            for i, (h, s) in enumerate(zip(histories, seeds))
        ]

    def receive(self, pending):
        return pending


def test_both_schedules_sample_the_same_tokens_and_only_per_turn_waits_for_the_slowest_tool():
    prompts = [[1, 2, 3], [4, 5]]
    tool_s = [[0.3, 0.3, 0.0], [0.0, 0.0, 0.0]]  # episode 0's tools take 0.3 s, episode 1's answer at once
    runs = {}
    for run in (per_turn, per_episode):
        server = SeededServer()
        sampled = run(server, prompts, [9, 9], tool_s, SimpleNamespace(), seeds=[11, 12])
        runs[run.__name__] = sampled, server.requests
    (turn_tokens, turn_requests), (episode_tokens, episode_requests) = runs["per_turn"], runs["per_episode"]
    assert turn_tokens == episode_tokens and all(len(tokens) == 3 * 3 for tokens in turn_tokens)
    assert sorted((e, s) for e, _, s in turn_requests) == sorted((e, s) for e, _, s in episode_requests)
    fast_per_turn = [at for episode, at, _ in turn_requests if episode == 4]
    fast_per_episode = [at for episode, at, _ in episode_requests if episode == 4]
    assert max(fast_per_episode) < 0.2 and sorted(fast_per_turn)[1:] >= [0.3, 0.6]  # per turn: behind the slow tools
