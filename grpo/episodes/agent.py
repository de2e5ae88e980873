"""Agents that own their loop, trained token in / token out: the `agent` config key.

    agent = load_agent(cfg.agent)                                   # 'module:function', refused in one line at start-up
    engine = AgentEngine(engine, tokenizer, agent, cfg, rows)       # wraps either engine, as ToolEngine does
    samples = engine.generate(prompt_ids, sampling)                 # one Sample per agent session

For each episode of a rollout (``sampling.n`` per prompt) the agent function is called on a thread of its own with an
``openai.OpenAI`` client whose base URL is the rollout's endpoint (`grpo.episodes.agent_endpoint`) and whose
``X-Session-Id`` header names the episode's session, and with the dataset row of the prompt:
``agent(client, row) -> float | None``. It runs its own loop (its own tools, its own messages); the session's ids
become the episode's sample exactly as a native tool episode's do (`ToolEngine._sample`: prompt ids, completion ids,
tool_mask 0 on the ids the endpoint rendered, the engine's log-prob and version per sampled token). A float is the
episode's reward; None leaves it to the reward functions, which score the sample's text. At most
tool_calling.max_concurrent agents run at once. An agent that raises, returns something else or runs past
tool_calling.agent_timeout_s ends only its own episode: its session is closed (its later requests get 409), the
error is counted (`agent/error_frequency`) and the episode scores 0.0 whatever it sampled. An episode the endpoint
ended at max_completion_length or max_tool_calling_iterations is a finished one: the reward functions score it,
whatever the agent does with the refusal.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable
from functools import partial

import torch

from grpo.engines.interface import Sample
from grpo.episodes.agent_endpoint import SESSION_HEADER, AgentEndpoint, AgentSession
from grpo.episodes.loop import PendingEpisodes, ToolEngine, one_sample
from grpo.episodes.tools import import_function
from merge.server_health import start_in_daemon_threads

log = logging.getLogger(__name__)

FAILED_REWARD = 0.0


def load_agent(name: str | None) -> Callable | None:
    """'module:function' -> the agent function; what cannot be imported is a ConfigError naming it."""
    return None if name is None else import_function(name, what="agent")


class AgentEngine(ToolEngine):
    """A rollout engine whose `generate` runs one agent session per episode through the OpenAI endpoint, on the
    engine it wraps; sync, generation phases and close are the wrapped engine's (close also stops the endpoint)."""

    def __init__(self, engine, tokenizer, agent: Callable, cfg, rows: list[dict], template_kwargs: dict | None = None):
        super().__init__(engine, tokenizer, [], cfg, template_kwargs)
        self.agent, self.template_kwargs = agent, template_kwargs or {}
        self.timeout_s = cfg.tool_calling.agent_timeout_s
        self.max_concurrent = cfg.tool_calling.max_concurrent
        self.rows: dict[tuple[int, ...], dict] = {}
        for row in rows:
            self.rows.setdefault(tuple(row["prompt_ids"]), row)
        self.offline = threading.Lock() if not self.sends else None  # the colocated engine: one batch call at a time
        self.endpoint = AgentEndpoint(self)
        for transport in ("httpx", "httpx2"):  # the agents' clients' (openai's is httpx2): a line per request otherwise
            logging.getLogger(transport).setLevel(logging.WARNING)

    def close(self) -> None:
        self.endpoint.close()
        super().close()

    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]:
        if not self.sends:
            return self._samples(self._sessions(prompt_ids, sampling, None, []))
        return self.receive(self.send(prompt_ids, sampling))

    def send(self, prompt_ids: list[list[int]], sampling) -> PendingEpisodes:
        """Start the rollout's agent sessions on a server, now; `receive` collects them."""
        seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()  # as ToolEngine.send draws them
        pending = PendingEpisodes()
        run = partial(self._sessions, prompt_ids, sampling, seeds, pending.turns)
        (pending.episodes,) = start_in_daemon_threads([run], 1)
        return pending

    def receive(self, pending: PendingEpisodes) -> list[Sample]:
        return self._samples(pending.episodes.result())

    def _sessions(self, prompt_ids, sampling, seeds: list[int] | None, requests: list):
        """Every episode's agent, at most max_concurrent at once; (session, row, its outcome) per episode. A turn
        the engine failed (the server gone) is the rollout's failure, raised here as the tool loop raises it."""
        rows = [self._row(ids) for ids in prompt_ids]
        sessions = [
            self.endpoint.open(
                index, index * sampling.n + j, None if seeds is None else seeds[index], sampling, requests
            )
            for index in range(len(prompt_ids))
            for j in range(sampling.n)
        ]
        runs = [partial(self._run_agent, s, rows[s.prompt_index]) for s in sessions]
        outcomes = [future.result() for future in start_in_daemon_threads(runs, self.max_concurrent)]
        failed = next((s.engine_error for s in sessions if s.engine_error is not None), None)
        if failed is not None:
            raise failed
        return [(s, rows[s.prompt_index], outcome) for s, outcome in zip(sessions, outcomes)]

    def _row(self, ids: list[int]) -> dict:
        row = self.rows.get(tuple(ids))
        if row is None:
            raise ValueError(f"a prompt of {len(ids)} ids is no row of the data set the agent engine was given")
        return row

    def _run_agent(self, session: AgentSession, row: dict):
        """The agent's reward (a float or None), or the error that ended its episode (a str)."""
        import openai

        client = openai.OpenAI(
            base_url=self.endpoint.base_url,
            api_key="local",
            default_headers={SESSION_HEADER: session.id},
            max_retries=0,
            timeout=self.timeout_s,
            http_client=openai.DefaultHttpxClient(trust_env=False),  # the endpoint is local: no proxy from the env
        )
        (future,) = start_in_daemon_threads([partial(self.agent, client, dict(row))], 1)
        try:
            value = future.result(timeout=self.timeout_s)
        except TimeoutError:
            outcome = f"the agent ran past tool_calling.agent_timeout_s={self.timeout_s:g}"
        except BaseException as err:  # noqa: BLE001 - an agent's own error (raised in its thread) ends its episode
            outcome = f"the agent raised {type(err).__name__}: {err}"
        else:
            real = isinstance(value, (int, float)) and not isinstance(value, bool)
            if value is None or (real and math.isfinite(value)):
                outcome = None if value is None else float(value)
            else:
                outcome = f"the agent returned {value!r:.80}, not a finite float or None"
        self.endpoint.end(session, outcome if isinstance(outcome, str) else "its agent returned")
        if isinstance(outcome, str) and session.at_limit:  # its error answers the refusal at the episode's limit
            log.info("agent episode %d ended at its limit; then %s", session.number, outcome)
            outcome = None
        if isinstance(outcome, str):
            log.warning("agent episode %d (prompt %d): %s", session.number, session.prompt_index, outcome)
        return outcome

    def _generate_turn(self, session: AgentSession, history: list[int], budget: int, seed: int | None) -> Sample:
        """One turn of one session on the wrapped engine, with the rollout's settings and at most ``budget`` tokens:
        a request of its own on a server, seeded; on the colocated engine one offline call at a time."""
        sampling = one_sample(session.sampling, budget)
        if self.offline is not None:
            with self.offline:
                return self.engine.generate([history], sampling)[0]
        (sample,) = self._generate([history], sampling, [seed], False, session.requests, [session.prompt_index])
        return sample

    def _samples(self, ended: list[tuple[AgentSession, dict, object]]) -> list[Sample]:
        """Each session's episode as a native tool episode becomes a Sample (`ToolEngine._sample`). An episode whose
        agent sampled nothing is its row's prompt and one end-of-turn token masked out (no loss, stamped with the
        rollout's latest version), so its group keeps its size."""
        samples = []
        for session, row, outcome in ended:
            episode = session.episode
            if episode is None or not episode.turns:
                sample = Sample(
                    row["prompt_ids"], [self.tokenizer.eos_token_id], "", [0.0], False, session.prompt_index
                )
                sample.tool_mask, sample.turn_of_token = [0], [0]
            else:
                sample = self._sample(episode)
            sample.agent_refusals = session.refusals
            sample.agent_error = isinstance(outcome, str)
            sample.reward = FAILED_REWARD if sample.agent_error else outcome
            samples.append(sample)
        if self.sends:
            latest = max((v for s in samples for v in s.versions or []), default=0)
            for sample in samples:
                sample.versions = sample.versions or [latest] * len(sample.completion_ids)
        return samples
