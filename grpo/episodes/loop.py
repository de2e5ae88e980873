"""Multi-turn tool use, token in / token out: every turn generates from the exact ids of the episode so far.

    engine = ToolEngine(engine, tokenizer, load_tools(cfg.tools), cfg)   # wraps either engine (grpo.run)
    samples = engine.generate(prompt_ids, sampling)                       # whole episodes, one Sample each

An episode's ids are its prompt, then each turn as the engine sampled it, then each tool response rendered alone by
the chat template and tokenized alone (TRL's `_get_tool_suffix_ids` rule: the template's text between the end of
the assistant turn and the next assistant header), appended. Nothing sampled is ever decoded and encoded again: BPE
is not a bijection, so a re-rendered, re-tokenized conversation can hold other ids than the ones sampled, which the
engine never scored (`retokenization_drift` counts how often; `tool_calling.retokenize` trains on those ids instead,
to show what that costs). `tool_mask` (TRL's name) is 0 on the tool tokens: they carry no loss, no KL and no
importance weight, and their log-probs are never compared with the engine's.

TRL's rules (GRPOTrainer 1.16, `_tool_call_loop`): the first turn samples num_generations completions per prompt,
later turns one per episode; a turn's tool calls run, their results are appended, the episode continues, for at most
max_tool_calling_iterations rounds; max_completion_length counts every token after the prompt, tool tokens included,
and a tool result that would pass it is dropped and ends the episode. A tool that raises, returns a non-string,
hangs (`tool_calling.timeout_s`) or floods (`tool_calling.max_output_chars`), a malformed call and an unknown tool
name each give the model an error result and count as a failed call (`tools/failure_frequency`).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial

import torch

from grpo.engines.interface import Sample
from grpo.episodes.formats import Renderer
from grpo.episodes.parsers import make_parser
from grpo.episodes.tools import ToolCaller
from merge.server_health import start_in_daemon_threads


@dataclass
class Episode:
    """One conversation after its prompt: each segment (a model turn, or the tool tokens after it) appended."""

    prompt_ids: list[int]
    prompt_index: int
    number: int = 0  # its place among the rollout's episodes (a server seeds its later turns with it: `turn_seed`)
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    turn_of_token: list[int] = field(default_factory=list)  # 1, 2, ... on the model's tokens, 0 on tool tokens
    versions: list[int] | None = None
    turns: list[tuple[list[int], list, bool]] = field(default_factory=list)  # (ids, calls, ended) per model turn
    tool_responses: list[list[int]] = field(default_factory=list)  # the tool tokens appended after each call turn
    tool_calls: int = 0
    tool_failures: int = 0
    tool_malformed: int = 0  # calls the parser could not read (each also a failed call)
    truncated: bool = False
    caller: ToolCaller | None = None  # an environment's episode: the caller of its own instance's methods
    turn_rewards: list[float] = field(default_factory=list)  # an environment's step rewards, per model turn
    env_failure: str | None = None  # its environment's reset or a step raised or hung

    def add_turn(self, sample: Sample, calls: list, ended: bool) -> None:
        turn = len(self.turns) + 1
        self.completion_ids += sample.completion_ids
        self.logprobs += sample.logprobs
        self.tool_mask += [1] * len(sample.completion_ids)
        self.turn_of_token += [turn] * len(sample.completion_ids)
        if sample.versions is not None:  # extended in place: a turn's work does not grow with the episode
            if self.versions is None:
                self.versions = []
            self.versions += sample.versions
        self.turns.append((sample.completion_ids, calls, ended))
        self.turn_rewards.append(0.0)
        self.truncated = sample.truncated

    def add_tool_tokens(self, ids: list[int]) -> None:
        self.tool_responses.append(ids)
        self.completion_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.tool_mask += [0] * len(ids)
        self.turn_of_token += [0] * len(ids)
        if self.versions is not None:
            self.versions += [self.versions[-1] if self.versions else 0] * len(ids)


@dataclass
class PendingEpisodes:
    """Episodes `ToolEngine.send` started on a server: their requests so far, turn by turn, as they leave."""

    episodes: Future | None = None  # the episodes, once all have ended
    turns: list = field(default_factory=list)  # each turn's `PendingGeneration` (a request of one episode, or a batch)

    @property
    def times(self) -> list[tuple[float, float]]:
        """(sent, answered) of every request of the episodes, in seconds since the epoch, once received."""
        return [interval for turn in list(self.turns) for interval in turn.times]


class ToolEngine:
    """A rollout engine whose `generate` runs whole tool-using episodes on the engine it wraps (either of
    `grpo.engines`); sync, generation phases and close are the wrapped engine's."""

    def __init__(self, engine, tokenizer, tools: list[Callable], cfg, template_kwargs: dict | None = None):
        self.engine, self.tokenizer = engine, tokenizer
        self.renderer = Renderer(tokenizer, tools, template_kwargs)  # the prompt's: `data.chat_template_kwargs`
        settings = cfg.tool_calling
        self.parser = make_parser(settings.parser, tokenizer, tools)
        self.caller = ToolCaller({t.__name__: t for t in tools}, settings.timeout_s, settings.max_output_chars)
        self.max_iterations = cfg.max_tool_calling_iterations
        self.max_completion_length = cfg.max_completion_length
        # the engine's context (`RecipeConfig.max_model_len`): no request asks for more than it holds
        self.max_model_len = getattr(cfg, "max_model_len", None)
        self.min_turn_tokens = settings.min_turn_tokens
        self.end_truncated_turn = settings.truncated_turn == "end_episode"
        self.retokenize = settings.retokenize
        # a server takes requests one at a time (`send`); the colocated engine's offline call takes a whole batch
        self.sends = hasattr(engine, "send")
        self.per_episode = settings.schedule == "per_episode" and self.sends
        self.tool_slots = threading.BoundedSemaphore(settings.max_concurrent)
        self.tokenizing = threading.Lock()  # one tokenizer, episodes on threads of their own

    def awake(self):
        return self.engine.awake()

    def sync_policy(self, model, adapter_dir, version: int, rank: int) -> dict[str, float]:
        return self.engine.sync_policy(model, adapter_dir, version, rank)

    def close(self) -> None:
        self.engine.close()

    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]:
        """Episodes for token-id prompts, ``sampling.n`` per prompt, prompt by prompt: one `Sample` each, its
        `completion_ids` every token after the prompt (model and tool tokens), `tool_mask` 0 on tool tokens.

        On a server each episode's later turns are seeded from its first turn's seed (`turn_seed`), so the same
        episodes come back whether they run per turn or per episode."""
        if not self.sends:
            return [self._sample(e) for e in self._turn_by_turn(prompt_ids, sampling, None, use_tqdm, [])]
        return self.receive(self.send(prompt_ids, sampling))

    def send(self, prompt_ids: list[list[int]], sampling) -> PendingEpisodes:
        """Start the episodes on a server, now, on threads of their own; `receive` collects them. With
        max_staleness >= 1 (`grpo.engines.rollout_queue`) they run while the trainer updates, and a sync can land
        between two turns of an episode as between two decode steps: each turn is sampled by the versions served
        while it runs (every token keeps its own), each its own request, checked as any request is."""
        seeds = torch.randint(0, 2**31 - 1, (len(prompt_ids),)).tolist()  # as the server engine draws them
        run = self._independently if self.per_episode else self._turn_by_turn
        pending = PendingEpisodes()
        (pending.episodes,) = start_in_daemon_threads(
            [partial(run, prompt_ids, sampling, seeds, False, pending.turns)], 1
        )
        return pending

    def receive(self, pending: PendingEpisodes) -> list[Sample]:
        """The episodes `send` started, once every one has ended; a turn's failure (the server gone) is raised."""
        return [self._sample(e) for e in pending.episodes.result()]

    def _generate(
        self, histories, sampling, seeds: list[int] | None, use_tqdm: bool, turns: list, routes: list[int]
    ) -> list[Sample]:
        """One turn of the histories. On a server each request carries its seed and its episode's prompt index as
        its route: all episodes of a prompt start in one request, so each of their turns goes to that engine of a
        data-parallel server, where its prefix is cached."""
        if seeds is None:
            return self.engine.generate(histories, sampling, use_tqdm=use_tqdm)
        pending = self.engine.send(histories, sampling, seeds=seeds, routes=routes)
        turns.append(pending)  # the rollout's requests so far (other episodes' threads append theirs too)
        return self.engine.receive(pending)

    def _turn_by_turn(
        self, prompt_ids, sampling, seeds: list[int] | None, use_tqdm: bool, turns: list, callers: list | None = None
    ) -> list[Episode]:
        """Each turn waits for every episode of the rollout, then goes out as one batch. ``callers``: each prompt's
        own (an environment's episodes, one per prompt)."""
        episodes, continuing = [], []
        first = self._first_turns(prompt_ids, sampling)
        for sample in self._generate(prompt_ids, first, seeds, use_tqdm, turns, list(range(len(prompt_ids)))):
            caller = callers[sample.prompt_index] if callers else None
            episodes.append(Episode(sample.prompt_ids, sample.prompt_index, number=len(episodes), caller=caller))
            if self._after_turn(episodes[-1], sample, sample.prompt_ids):
                continuing.append(episodes[-1])
        rounds = 1
        while continuing and (self.max_iterations is None or rounds <= self.max_iterations):
            continuing = [e for e in continuing if self._append_tool_results(e)]
            if not continuing:
                break
            per_episode = [one_sample(sampling, self._room(e)) for e in continuing]
            histories = [e.prompt_ids + e.completion_ids for e in continuing]
            later = (
                None if seeds is None else [turn_seed(seeds[e.prompt_index], e.number, rounds + 1) for e in continuing]
            )
            routes = [e.prompt_index for e in continuing]
            samples = self._generate(histories, per_episode, later, False, turns, routes)
            continuing = [e for e, s, h in zip(continuing, samples, histories) if self._after_turn(e, s, h)]
            rounds += 1
        return episodes

    def _independently(
        self, prompt_ids, sampling, seeds: list[int], use_tqdm: bool, turns: list, callers: list | None = None
    ) -> list[Episode]:
        """Each episode on a thread of its own: its next turn is sent as soon as its own tools return, whatever the
        other episodes are doing (the tools of at most `tool_calling.max_concurrent` episodes run at once)."""
        first = self._first_turns(prompt_ids, sampling)
        first_turns = [
            self.engine.send([ids], first if not isinstance(first, list) else [first[i]], seeds=[seed], routes=[i])
            for i, (ids, seed) in enumerate(zip(prompt_ids, seeds))
        ]
        turns += first_turns
        episodes: list[Episode | None] = [None] * (len(prompt_ids) * sampling.n)

        def prompt(index: int) -> None:
            samples = self.engine.receive(first_turns[index])
            calls = [partial(episode, index, j, sample) for j, sample in enumerate(samples)]
            for future in start_in_daemon_threads(calls, len(calls)):
                future.result()  # an episode's failure (the server gone) is the prompt's, and so generate's

        def episode(index: int, j: int, sample: Sample) -> None:
            number = index * sampling.n + j
            caller = callers[index] if callers else None
            one = episodes[number] = Episode(prompt_ids[index], index, number=number, caller=caller)
            going, rounds = self._after_turn(one, sample, one.prompt_ids), 1
            while going and (self.max_iterations is None or rounds <= self.max_iterations):
                if not self._append_tool_results(one):
                    break
                turn = one_sample(sampling, self._room(one))
                history = one.prompt_ids + one.completion_ids
                seed = turn_seed(seeds[index], number, rounds + 1)
                (sample,) = self._generate([history], turn, [seed], False, turns, [index])
                going, rounds = self._after_turn(one, sample, history), rounds + 1

        for future in start_in_daemon_threads([partial(prompt, i) for i in range(len(prompt_ids))], len(prompt_ids)):
            future.result()
        return episodes

    def _first_turns(self, prompt_ids: list[list[int]], sampling):
        """``sampling``, or one per prompt where a prompt leaves less than its max_tokens in max_model_len (its
        max_tokens shrunk to what is left); a prompt that leaves no room for min_turn_tokens is refused."""
        if self.max_model_len is None:
            return sampling
        rooms = [min(sampling.max_tokens, self.max_model_len - len(ids)) for ids in prompt_ids]
        if all(room == sampling.max_tokens for room in rooms):
            return sampling
        for ids, room in zip(prompt_ids, rooms):
            if room < self.min_turn_tokens:
                raise ValueError(
                    f"a prompt of {len(ids)} tokens leaves {room} of max_model_len={self.max_model_len} to sample, "
                    f"fewer than tool_calling.min_turn_tokens={self.min_turn_tokens}"
                )
        return [one_sample(sampling, room, n=sampling.n) for room in rooms]

    def _room(self, episode: Episode) -> int:
        """Tokens the episode may still add: what is left of max_completion_length, and of max_model_len after the
        history a request sends (its prompt and every token since)."""
        used = len(episode.completion_ids)
        room = self.max_completion_length - used
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - len(episode.prompt_ids) - used)
        return room

    def _after_turn(self, episode: Episode, sample: Sample, history: list[int]) -> bool:
        """Append a model turn sampled after ``history`` (the request's ids: the episode so far, not copied again);
        whether it called a tool and has room to go on."""
        ids = sample.completion_ids
        ended = bool(ids) and ids[-1] == self.tokenizer.eos_token_id
        with self.tokenizing:
            calls = self.parser.calls(ids, history)
        if not ended:  # cut by max_tokens: the call cut off is no call; its finished ones run (TRL's) or not at all
            calls = [c for c in calls if isinstance(c, dict)]
        episode.add_turn(sample, calls, ended)
        if not ended and self.end_truncated_turn:
            return False
        return bool(calls)  # a turn that called a tool at the budget's end: its calls run and count, as TRL's

    def _append_tool_results(self, episode: Episode) -> bool:
        """Run the last turn's calls and append their rendered results (tool tokens); False, the episode truncated,
        when the results would pass the budget (dropped, as TRL drops them) or leave less than min_turn_tokens for
        another turn (`_room`)."""
        _, calls, _ = episode.turns[-1]
        with self.tool_slots:
            results = (episode.caller or self.caller).run(calls)
        messages = [{"role": "tool", "name": name, "content": text} for name, text, _ in results]
        with self.tokenizing:
            suffix = self.renderer.tool_suffix_ids(messages)
        episode.tool_calls += len(results)
        episode.tool_failures += sum(failed for _, _, failed in results)
        episode.tool_malformed += sum(isinstance(c, str) for c in calls)
        if len(suffix) > self._room(episode):
            episode.truncated = True  # the budget ended it (TRL marks only a last token that ends no turn)
            return False
        episode.add_tool_tokens(suffix)
        if self._room(episode) < self.min_turn_tokens:
            episode.truncated = True  # TRL: a last token that is no end-of-turn token marks a truncated episode
            return False
        return True

    def retokenized(self, episode: Episode) -> tuple[list[int], list[int], list[int], list[float]]:
        """The episode's completion as a re-rendering framework rebuilds it: each model turn parsed and rendered
        again, then tokenized as text; the tool tokens as they were. Returns (ids, tool_mask, turn_of_token,
        the engine's log-probs kept by position within each turn: what such a framework pairs them with)."""
        ids, mask, turn_of, logprobs = [], [], [], []
        tool_segments = iter(episode.tool_responses)
        position = 0
        for turn, (turn_ids, calls, ended) in enumerate(episode.turns, start=1):
            again = self.renderer.retokenized_turn(self.renderer.assistant_message(turn_ids, calls), ended)
            sampled = episode.logprobs[position : position + len(turn_ids)]
            logprobs += (sampled + [0.0] * len(again))[: len(again)]
            ids += again
            mask += [1] * len(again)
            turn_of += [turn] * len(again)
            position += len(turn_ids)
            suffix = next(tool_segments, None)
            if suffix is not None:
                ids += suffix
                mask += [0] * len(suffix)
                turn_of += [0] * len(suffix)
                logprobs += [0.0] * len(suffix)
                position += len(suffix)
        return ids, mask, turn_of, logprobs

    def _sample(self, episode: Episode) -> Sample:
        again = self.retokenized(episode)
        drifted = again[0] != episode.completion_ids
        ids, mask, turn_of, logprobs = (
            again
            if self.retokenize
            else (episode.completion_ids, episode.tool_mask, episode.turn_of_token, episode.logprobs)
        )
        return Sample(
            prompt_ids=episode.prompt_ids,
            completion_ids=ids,
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            logprobs=logprobs,
            truncated=episode.truncated,
            prompt_index=episode.prompt_index,
            versions=episode.versions if not self.retokenize else None,
            tool_mask=mask,
            turn_of_token=turn_of,
            tool_calls=episode.tool_calls,
            tool_failures=episode.tool_failures,
            tool_malformed=episode.tool_malformed,
            retokenization_drift=drifted,
        )


def turn_seed(first_turn_seed: int, episode: int, turn: int) -> int:
    """The seed of an episode's later turn on a server: from its prompt's first-turn seed (drawn from the process's
    RNG, in order), the episode's number and the turn, so it does not depend on when the turn is sent."""
    digest = hashlib.sha256(f"{first_turn_seed}/{episode}/{turn}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def one_sample(sampling, max_tokens: int, n: int = 1):
    """``sampling`` for a later turn: one completion (or ``n``), at most ``max_tokens`` (what is left of the
    budget)."""
    turn = sampling.clone()
    turn.n, turn.max_tokens = n, max_tokens
    return turn
