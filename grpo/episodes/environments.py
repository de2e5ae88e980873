"""Stateful environments, TRL 1.16's `environment_factory`: one instance per episode, its public methods the tools.

    environment = load_environment(cfg.environment_factory)     # 'module:Class', refused in one line at start-up
    engine = EnvironmentEngine(engine, tokenizer, environment, cfg, render)   # wraps either engine, as ToolEngine
    samples = engine.generate(rows, sampling)                   # rows, not ids: each reset gets its row
    rewards = score(...)                                        # reward functions get environments= (one a sample)
    engine.release(samples)                                     # every instance closed once its episode is scored

The contract is TRL's: the class is instantiated with no argument; ``reset(**row)`` returns an observation (a str,
appended to the prompt's user message, or None); its public methods (not ``reset``, ``close``, ``get_reward``, nor
a name starting with "_") are the episode's tools, described to the model by their type hints and docstrings as
`tools` are; a ``get_reward()`` method, where there is one, is an extra reward function named after the class.

Added here:
- **One initial state per group.** ``reset`` also gets ``seed``: one number per prompt, the same for the
  ``num_generations`` episodes of that prompt (drawn from the process's RNG, so a resumed run draws it again), so a
  group compares its episodes from one state and its baseline is the state's, not a mixture's.
- **Per-step rewards.** A method may return ``(observation, reward)``: the reward (a finite number) is its model
  turn's; `turn_rewards` holds each turn's sum (`advantage`: docs/environments.md).
- **Failures of the environment are not the policy's.** A factory or a reset that raises or runs past
  tool_calling.timeout_s, a reset whose observation is not a str or makes the prompt longer than
  data.max_prompt_length, a step that runs past the timeout, raises an `OSError` (Python's `EnvironmentError`:
  ConnectionError, a broken pipe, a sandbox gone) or `EnvironmentFailure`, or returns a reward that is not a finite
  number end the episode as failed (`Sample.env_failure`): the recipe leaves it out of its group's baseline and of
  the loss, and counts it (`env/failure_frequency`). Any other exception a step raises is the model's, as in TRL
  (an environment tells the model "no such move" by raising ValueError): an error result, as are a malformed
  call, an unknown method and arguments the method does not take.
- **Every instance is released**, its ``close()`` called (within tool_calling.timeout_s, on a thread of its own: one
  that hangs is left there and counted) once: after scoring (`release`), when the rollout fails or is abandoned
  (its episodes' instances at once), and for whatever is still open when the engine closes (a stop signal's path).
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

from grpo.config import ConfigError
from grpo.data import USER_TEXT
from grpo.engines.interface import RolloutAbandoned, Sample, abandonable_wait
from grpo.episodes.loop import Episode, PendingEpisodes, ToolEngine, one_sample
from grpo.episodes.parsers import typed_arguments
from grpo.episodes.tools import ToolCaller, import_function, run_to_result
from merge.server_health import start_in_daemon_threads

log = logging.getLogger(__name__)

NOT_TOOLS = ("reset", "close", "get_reward")  # the contract's own methods: never offered to the model
SEED = "seed"  # reset's keyword for the group's seed


class EnvironmentFailure(RuntimeError):
    """An environment's reset or step failed (raised or hung): its episode failed, not by the policy's doing. An
    environment may raise it itself, as it may raise an OSError."""


class EnvironmentFailing(RuntimeError):
    """More episodes in a row failed than tool_calling.max_consecutive_failures allows: the run stops."""


class StepError(Exception):
    """What an environment's method raised (wrapped on the call's thread, so that it tells from a model's fault)."""


@dataclass
class Environment:
    """A loaded environment_factory: the factory, the class's tool names and the probe's methods (their schemas, and
    the types their arguments are converted to)."""

    factory: Callable
    name: str
    method_names: list[str]
    described: list[Callable]  # the probe instance's bound methods: only their signatures and docstrings are used

    def tools_of(self, instance) -> dict[str, Callable]:
        return {name: getattr(instance, name) for name in self.method_names}

    @property
    def get_reward(self) -> Callable | None:
        """TRL's extra reward source: ``get_reward()`` of each completion's instance, where the class has one."""
        if not callable(getattr(self.described_class, "get_reward", None)):
            return None

        def get_reward(environments, **kwargs):
            return [None if e is None else e.get_reward() for e in environments]

        return get_reward

    @property
    def described_class(self) -> type:
        return type(self.described[0].__self__) if self.described else object


def tool_method_names(cls: type) -> list[str]:
    """The public methods of an environment class that are the model's tools (TRL lists them on the class, so that a
    property is not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in NOT_TOOLS
    ]


def load_environment(name: str | None) -> Environment | None:
    """'module:Class' -> the environment, its tools described; what cannot be imported, built, reset with a seed
    or described is a ConfigError naming it. One instance is built to read its methods (TRL's probe), then closed."""
    if name is None:
        return None
    from transformers.utils import get_json_schema

    factory = import_function(name, what="environment_factory")
    try:
        probe = factory()
    except Exception as err:  # noqa: BLE001 - the user's constructor: any error is the config's to name
        raise ConfigError(f"environment_factory {name!r} raised {type(err).__name__} when built: {err}") from None
    cls = type(probe)
    reset = getattr(cls, "reset", None)
    if not callable(reset):
        raise ConfigError(f"environment_factory {name!r} builds {cls.__name__}, which has no reset method")
    parameters = inspect.signature(reset).parameters.values()
    if not any(p.name == SEED or p.kind is p.VAR_KEYWORD for p in parameters):
        raise ConfigError(
            f"environment_factory {name!r}: {cls.__name__}.reset takes no {SEED!r} (nor **kwargs): it is given the "
            "group's seed, one per prompt (docs/environments.md)"
        )
    method_names = tool_method_names(cls)
    if not method_names:
        raise ConfigError(f"environment_factory {name!r}: {cls.__name__} has no public method for the model to call")
    described = [getattr(probe, method) for method in method_names]
    for method in described:
        try:
            get_json_schema(method)
        except Exception as err:  # noqa: BLE001 - transformers' TypeHintParsingException / DocstringParsingException
            raise ConfigError(
                f"environment_factory {name!r}: method {method.__name__!r} cannot be described to the model: {err} "
                "(a method needs type hints and a Google-style docstring with an Args: section)"
            ) from None
    close_within(probe, timeout_s=10.0)
    return Environment(factory, name, method_names, described)


def check_reset_arguments(environment: Environment, row: dict) -> None:
    """A row's columns and the seed must fit reset's signature: refused at start-up, naming them, rather than every
    episode failing."""
    kwargs = reset_arguments(row, 0)
    try:
        inspect.signature(environment.described_class.reset).bind(None, **kwargs)
    except TypeError as err:
        raise ConfigError(
            f"environment_factory {environment.name!r}: reset(**row, seed=...) with the data's columns "
            f"{sorted(kwargs)} fails: {err}"
        ) from None


def reset_arguments(row: dict, seed: int) -> dict:
    """reset's keyword arguments: the row's columns (TRL's: the dataset row, `prompt` included) and the seed."""
    return {**{k: v for k, v in row.items() if k not in ("prompt_ids", USER_TEXT)}, SEED: seed}


def close_within(instance, timeout_s: float) -> str | None:
    """Call ``instance.close()`` where it has one, on a thread of its own, waiting at most ``timeout_s``; what went
    wrong (it raised or hung), or None."""
    close = getattr(instance, "close", None)
    if not callable(close):
        return None
    (future,) = start_in_daemon_threads([close], 1)
    try:
        future.result(timeout=timeout_s)
    except TimeoutError:
        return f"close() still running after {timeout_s:g} s (left on its thread)"
    except BaseException as err:  # noqa: BLE001 - the environment's own error: reported, the run goes on
        return f"close() raised {type(err).__name__}: {err}"
    return None


@dataclass
class EnvironmentCaller(ToolCaller):
    """Runs one episode's calls on its own instance. A step that hangs or raises an OSError or `EnvironmentFailure`
    is an `EnvironmentFailure`; a ``(observation, reward)`` return gives its reward to `step_rewards`; anything
    else that goes wrong is the model's: an error result."""

    described: dict[str, Callable] = field(default_factory=dict)  # name -> the probe's method (argument types)
    step_rewards: list[float] = field(default_factory=list)  # the last `run`'s rewards

    def run(self, calls: list[dict | str]) -> list[tuple[str, str, bool]]:
        self.step_rewards = []
        return super().run(calls)

    def _invoke(self, call: dict | str):
        tool, arguments = self._resolve(call)
        try:
            inspect.signature(tool).bind(**arguments)
        except TypeError as err:
            raise ValueError(f"{call['name']}: {err}") from None  # arguments the method does not take: the model's
        try:
            return run_to_result(tool(**arguments))
        except (OSError, EnvironmentFailure) as err:  # the environment's infrastructure: told apart here
            raise StepError(f"{call['name']} raised {type(err).__name__}: {err}") from err

    def _resolve(self, call: dict | str) -> tuple[Callable, dict]:
        tool, _ = super()._resolve(call)
        return tool, typed_arguments(self.described[call["name"]], call["arguments"])

    def _result(self, call: dict | str, future) -> tuple[str, str, bool]:
        name = call["name"] if isinstance(call, dict) else "unknown"
        try:
            value = future.result(timeout=self.timeout_s)
        except TimeoutError:
            raise EnvironmentFailure(f"step {name!r} ran past tool_calling.timeout_s={self.timeout_s:g}") from None
        except StepError as err:
            raise EnvironmentFailure(f"step {err}") from None
        except RolloutAbandoned:  # raised by the stop signal's handler in this thread, not by the environment
            raise
        except BaseException:  # noqa: BLE001 - the model's fault (the future is done: raised again at once)
            return super()._result(call, future)
        if isinstance(value, tuple) and len(value) == 2:
            value, reward = value
            real = isinstance(reward, (int, float)) and not isinstance(reward, bool)
            if not real or not math.isfinite(reward):
                raise EnvironmentFailure(f"step {name!r} returned the reward {reward!r:.80}, not a finite number")
            self.step_rewards.append(float(reward))
        return self._text(name, value)


class EnvironmentEngine(ToolEngine):
    """A rollout engine whose `generate` runs one environment episode per completion on the engine it wraps (either
    of `grpo.engines`), through `ToolEngine`'s loop: its prompts are rows (``takes_rows``)."""

    takes_rows = True

    def __init__(self, engine, tokenizer, environment: Environment, cfg, render: Callable, template_kwargs=None):
        """``render(row, observation) -> prompt ids``: the row's user message with the observation appended, through
        the chat template with the environment's methods described (`grpo.data.render_prompt`)."""
        super().__init__(engine, tokenizer, environment.described, cfg, template_kwargs)
        self.environment, self.render = environment, render
        self.max_prompt_length = cfg.data.max_prompt_length
        self.timeout_s = cfg.tool_calling.timeout_s
        self.max_output_chars = cfg.tool_calling.max_output_chars
        self.max_concurrent = cfg.tool_calling.max_concurrent
        self.open: dict[int, object] = {}  # id -> every instance built and not released yet
        self.state = threading.Lock()
        self.closed = False
        self.streak = self.longest_streak = 0  # episodes of this process that failed in a row (now, since `streak`)
        self.last_failure: str | None = None
        self.close_failures = 0

    # -- the rollout ------------------------------------------------------------------------------------------------
    def generate(self, rows: list[dict], sampling, use_tqdm: bool = False) -> list[Sample]:
        if not self.sends:
            return self._rollout(rows, sampling, draw_seeds(len(rows)), None, use_tqdm, [])
        return self.receive(self.send(rows, sampling))

    def send(self, rows: list[dict], sampling) -> PendingEpisodes:
        """Start the episodes on a server, now; `receive` collects them (`ToolEngine.send`)."""
        group_seeds, request_seeds = draw_seeds(len(rows)), draw_seeds(len(rows) * sampling.n)
        pending = PendingEpisodes()
        run = partial(self._rollout, rows, sampling, group_seeds, request_seeds, False, pending.turns)
        (pending.episodes,) = start_in_daemon_threads([run], 1)
        return pending

    def receive(self, pending: PendingEpisodes) -> list[Sample]:
        return pending.episodes.result()

    def _rollout(self, rows, sampling, group_seeds, request_seeds, use_tqdm, turns) -> list[Sample]:
        """``sampling.n`` episodes per row, each on an instance of its own reset with its row and its group's seed;
        the episodes whose reset worked run through `ToolEngine`'s loop, each prompt its own (its observation may
        differ), one completion each. Samples in order, `prompt_index` the row's."""
        slots = [(i, j) for i in range(len(rows)) for j in range(sampling.n)]
        instances: list = [None] * len(slots)
        try:
            starts = [partial(self._start, instances, k, rows[i], group_seeds[i]) for k, (i, _) in enumerate(slots)]
            with abandonable_wait():
                started = [future.result() for future in start_in_daemon_threads(starts, self.max_concurrent)]
            live = [k for k, (_, failure) in enumerate(started) if failure is None]
            callers = [
                EnvironmentCaller(
                    self.environment.tools_of(instances[k]),
                    self.timeout_s,
                    self.max_output_chars,
                    described={f.__name__: f for f in self.environment.described},
                )
                for k in live
            ]
            one = one_sample(sampling, sampling.max_tokens)
            prompts = [started[k][0] for k in live]
            if not live:
                episodes = []
            elif self.per_episode:
                episodes = self._independently(prompts, one, [request_seeds[k] for k in live], use_tqdm, turns, callers)
            else:
                seeds = None if request_seeds is None else [request_seeds[k] for k in live]
                episodes = self._turn_by_turn(prompts, one, seeds, use_tqdm, turns, callers)
            by_slot = dict(zip(live, episodes))
            samples = []
            for k, (i, _) in enumerate(slots):
                if k in by_slot:
                    sample = self._episode_sample(by_slot[k])
                else:
                    sample = self._failed_start(rows[i], started[k][1])
                sample.prompt_index, sample.environment = i, instances[k]
                samples.append(sample)
        except BaseException:
            self.release_instances(instances)  # the rollout failed or was abandoned: its episodes end here
            raise
        if self.sends:  # a failed start sampled nothing: its one masked token carries the rollout's latest version
            latest = max((v for s in samples for v in s.versions or []), default=0)
            for sample in samples:
                sample.versions = sample.versions or [latest] * len(sample.completion_ids)
        self._count_failures(samples)
        return samples

    def _start(self, instances: list, k: int, row: dict, seed: int) -> tuple[list[int] | None, str | None]:
        """Build slot ``k``'s instance and reset it (within tool_calling.timeout_s): (its prompt ids, None), or
        (None, what failed)."""
        try:
            instance = self.environment.factory()
        except Exception as err:  # noqa: BLE001 - the environment's own error: its episode failed
            return None, f"environment_factory raised {type(err).__name__}: {err}"
        with self.state:
            instances[k] = instance
            self.open[id(instance)] = instance
            closed = self.closed
        if closed:
            self.release_instances([instance])
            return None, "the engine was closed"
        (future,) = start_in_daemon_threads([partial(instance.reset, **reset_arguments(row, seed))], 1)
        try:
            observation = future.result(timeout=self.timeout_s)
        except TimeoutError:
            return None, f"reset ran past tool_calling.timeout_s={self.timeout_s:g}"
        except BaseException as err:  # noqa: BLE001 - the environment's own error: its episode failed
            return None, f"reset raised {type(err).__name__}: {err}"
        if observation is None or observation == "":
            return row["prompt_ids"], None
        if not isinstance(observation, str):
            return None, f"reset returned {type(observation).__name__}, not a str or None"
        with self.tokenizing:
            ids = self.render(row, observation)
        if len(ids) > self.max_prompt_length:
            return None, (
                f"reset's observation made the prompt {len(ids)} tokens, over data.max_prompt_length="
                f"{self.max_prompt_length}"
            )
        return ids, None

    def _append_tool_results(self, episode: Episode) -> bool:
        """`ToolEngine`'s, on the episode's own instance; its step rewards go to the turn that called; a step that
        failed ends the episode as failed."""
        try:
            going = super()._append_tool_results(episode)
        except EnvironmentFailure as failure:
            episode.env_failure = str(failure)
            return False
        episode.turn_rewards[len(episode.turns) - 1] += sum(episode.caller.step_rewards)
        return going

    def _episode_sample(self, episode: Episode) -> Sample:
        sample = self._sample(episode)
        sample.turn_rewards = list(episode.turn_rewards)
        sample.env_failure = episode.env_failure
        return sample

    def _failed_start(self, row: dict, failure: str) -> Sample:
        """An episode whose environment never started: the row's prompt and one end-of-turn token masked out (no
        loss), so its group keeps its size."""
        return Sample(
            row["prompt_ids"],
            [self.tokenizer.eos_token_id],
            "",
            [0.0],
            False,
            0,
            tool_mask=[0],
            turn_of_token=[0],
            turn_rewards=[],
            env_failure=failure,
        )

    # -- failures in a row ------------------------------------------------------------------------------------------
    def _count_failures(self, samples: list[Sample]) -> None:
        with self.state:
            for sample in samples:
                if sample.env_failure is None:
                    self.streak = 0
                    continue
                self.streak += 1
                self.longest_streak = max(self.longest_streak, self.streak)
                self.last_failure = sample.env_failure
                log.warning("environment episode failed (prompt %d): %s", sample.prompt_index, sample.env_failure)

    def failure_streak(self) -> tuple[int, str | None]:
        """The longest run of failed episodes reached since the last call (a run that goes on counts its earlier
        failures too), and the last failure."""
        with self.state:
            longest, self.longest_streak = self.longest_streak, 0
            return longest, self.last_failure

    # -- release ----------------------------------------------------------------------------------------------------
    def release(self, samples: list[Sample]) -> None:
        """Close the instances of scored episodes (each once)."""
        self.release_instances([s.environment for s in samples])

    def release_instances(self, instances: list) -> None:
        for instance in instances:
            with self.state:
                if instance is None or self.open.pop(id(instance), None) is None:
                    continue  # never built, or released already
            problem = close_within(instance, self.timeout_s)
            if problem is not None:
                with self.state:
                    self.close_failures += 1
                log.warning("an environment instance of %s: %s", self.environment.name, problem)

    def close(self) -> None:
        """Release every instance still open (queued or abandoned rollouts' too), then close the wrapped engine."""
        with self.state:
            self.closed = True
            still_open = list(self.open.values())
        self.release_instances(still_open)
        super().close()


def draw_seeds(count: int) -> list[int]:
    """Seeds from the process's RNG, as the server engine draws its requests' (a resumed run draws them again)."""
    return torch.randint(0, 2**31 - 1, (count,)).tolist()
