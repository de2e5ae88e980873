"""TRL 1.16's own environment tests (``GRPOTrainer(environment_factory=...)``: huggingface/trl's
tests/test_grpo_trainer.py, from https://github.com/huggingface/trl/pull/5093, /pull/6001 and /pull/6349) run against
merge.trl's sync: colocated vLLM on merged weights (``use_merged_lora_sync``), fp32, one engine for every trainer here.

Adapted only where TRL's tests reach for the hub or for transformers' generation:

- the model: the embedded tool model (Qwen3's tool format; ``grpo_trl.tool_tokenizer`` gives TRL its response
  template) with a LoRA adapter whose ``lora_B`` is random (the adapter changes the policy from the first sync on);
  "the parameters have changed" is asked of the trainable ones, the adapter's;
- the reward model: a local reward function, the length of the last message's text (TRL's own test of
  environment-owned data uses it), which separates the scripted completions as the reward model's scores do;
  the hub's prompts: the tool task's;
- generation: TRL's tests script the completions by patching ``model.generate``. Here vLLM generates them: the same
  texts, in this tokenizer's ids, are forced by a vLLM logits processor (:class:`ScriptedTurns`) after vLLM has
  taken the log-probs of its own logits (``logprobs_mode="raw_logprobs"``: at temperature 1 without top-k, top-p or
  min-p they are the numbers TRL's ``processed_logprobs`` gives). Every log-prob TRL trains with is vLLM's, computed
  on the merged weights the sync pushed;
- ``bf16=False`` (GRPOConfig's default autocast would leave the trainer's log-probs bf16-rounded against fp32 vLLM);
- 2 optimizer steps instead of 5 (each generates, so the second rollout runs on weights the first step changed).

The training tests keep TRL's assertions and add the check of the other TRL tests here (tests/test_trl_tools.py): on
every turn, the trainer's peft model scoring each episode one unpadded sequence at a time, the mean |vLLM - trainer|
over the model's tokens within 1e-6 of the log-prob's size (`MAX_RELATIVE_DIFF`), against more than 100 times that
for the model without its adapter.
"""

import itertools
import os
import socket
import sys
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import pytest  # noqa: E402
import torch  # noqa: E402
from trl_helpers import EpisodeScores, randomize_lora_b  # noqa: E402
from vllm.v1.sample.logits_processor import LogitsProcessor  # noqa: E402
from vllm.v1.sample.logits_processor.builtin import process_dict_updates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Mean |vLLM - trainer| over max(1, |log-prob|) on the model's tokens in fp32, per turn. The other TRL tests bound the
# mean |vLLM - trainer| of sampled tokens (log-probs near 0) by 1e-6; TRL's scripted tokens are ones this model would
# rarely sample (log-probs of -8 to -16, where one fp32 step is 9.5e-7, the median |vLLM - trainer| here), so the
# same bound is taken relative to the log-prob's size.
MAX_RELATIVE_DIFF = 1e-6

pytestmark = pytest.mark.filterwarnings("ignore:You are using 'environment_factory'")


class ScriptedTurns(LogitsProcessor):
    """Forces each request's scripted tokens, one per step, and nothing else: the rest of the row is -inf.

    ``next_turn`` (set by a test, read when a request joins the batch) gives the turn for a request's prompt ids;
    None leaves the batch unscripted. vLLM's sampler takes raw log-probs before any logits processor runs, so the
    log-prob of a forced token is the model's own."""

    next_turn: Callable[[list[int]], list[int]] | None = None

    def __init__(self, vllm_config, device, is_pin_memory):
        self.turns: dict[int, tuple[list[int], list[int]]] = {}  # batch index -> (script, the request's output ids)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update) -> None:
        def script(params, prompt_ids, output_ids):
            next_turn = type(self).next_turn
            return None if next_turn is None else (next_turn(list(prompt_ids)), output_ids)

        process_dict_updates(self.turns, batch_update, script)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, (script, output_ids) in self.turns.items():
            token = script[min(len(output_ids), len(script) - 1)]
            logits[index] = float("-inf")
            logits[index, token] = 0.0
        return logits


ENGINE = dict(
    dtype="float32",
    kv_cache_memory_bytes=2**26,
    enforce_eager=True,
    logprobs_mode="raw_logprobs",
    logits_processors=[ScriptedTurns],
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_engine():
    """Every trainer of this module gets the same colocated engine (TRL builds one per trainer): the first
    ``LLM(...)`` TRL asks for is built with :data:`ENGINE`'s settings, later ones get it back. Each trainer's first
    sync pushes its own merged weights, every one of them. TRL's colocate setup writes RANK/WORLD_SIZE/MASTER_* into
    os.environ: restored afterwards, with the name ``LLM`` and one torch thread (as a launched process has)."""
    import trl.generation.vllm_generation as vllm_generation

    sys.path.insert(0, str(ROOT / "recipes"))
    saved_env, saved_threads, trl_llm = dict(os.environ), torch.get_num_threads(), vllm_generation.LLM
    built = []

    def shared_llm(*args, **kwargs):
        if not built:
            built.append(trl_llm(*args, **{**kwargs, **ENGINE}))
        return built[0]

    vllm_generation.LLM = shared_llm
    os.environ["MASTER_PORT"] = str(free_port())  # accelerate's default 29500 may be another run's
    torch.set_num_threads(1)
    try:
        yield built
    finally:
        vllm_generation.LLM = trl_llm
        ScriptedTurns.next_turn = None
        torch.set_num_threads(saved_threads)
        os.environ.clear()
        os.environ.update(saved_env)
        sys.path.remove(str(ROOT / "recipes"))


@pytest.fixture(scope="module")
def tool_model() -> str:
    """The shipped tool model (models/): the scripts decide every token, so no fresher build is needed."""
    return str(ROOT / "models" / "tiny-qwen3-tools")


class Tokens:
    """The tool model's ids of TRL's scripted texts."""

    def __init__(self, model: str):
        from grpo_trl import tool_tokenizer

        self.tokenizer = tool_tokenizer(model)
        self.tool_response = self.tokenizer.convert_tokens_to_ids("<tool_response>")

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)

    def tool_call(self, name: str, arguments: str) -> list[int]:
        return self(f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>')


def script(tokens: Tokens, first_turns: list[list[int]], after_tool: list[int] | None = None) -> None:
    """TRL's ``fake_generate`` for vLLM: a generation's first turns get ``first_turns`` in the order of its prompts
    (the order TRL sends them), a turn after a tool result gets ``after_tool``."""
    rows = itertools.cycle(first_turns)
    ScriptedTurns.next_turn = lambda prompt: after_tool if tokens.tool_response in prompt else next(rows)


def last_message_length(completions, **kwargs) -> list[float]:
    """Stands in for TRL's reward model: the length of the episode's last message's text."""
    return [float(len(completion[-1]["content"])) for completion in completions]


def grpo_trainer(model: str, tmp_path, *, reward_funcs=None, train_dataset=None, environment_factory=None, **config):
    """TRL's ``GRPOTrainer`` as TRL's tests build it, on the tool model with a LoRA adapter, colocated vLLM (the
    module's one engine) and merge.trl's sync; ``config``: the test's own GRPOConfig arguments."""
    from grpo_trl import tool_tokenizer
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from merge.trl import use_merged_lora_sync

    args = GRPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        bf16=False,
        gradient_checkpointing=False,
        model_init_kwargs={"dtype": "float32"},
        use_vllm=True,
        vllm_mode="colocate",
        **config,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward_funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=tool_tokenizer(model),
        peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear"),
        environment_factory=environment_factory,
    )
    randomize_lora_b(trainer.model)
    use_merged_lora_sync(trainer)
    return trainer


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def train_scored(trainer) -> EpisodeScores:
    """``trainer.train()`` with every episode scored by the trainer (`EpisodeScores`)."""
    trainer._generate = scores = EpisodeScores(trainer)
    trainer.train()
    return scores


def assert_fidelity(scores: EpisodeScores, turns: int) -> None:
    """Every turn's mean |vLLM - trainer| on the model's tokens, relative to max(1, |log-prob|), within the bound,
    ``turns`` turns seen; far outside it without the adapter."""
    per_turn = scores.per_turn(relative=True)
    sampled, adapter, base = (torch.cat(x) for x in (scores.sampled, scores.adapter, scores.base))
    print(
        " ".join(f"turn {t}: {mean:.2e} over {n} tokens;" for t, (mean, n) in per_turn.items()),
        f"|vLLM - trainer| mean {adapter.mean():.2e} median {adapter.median():.2e} max {adapter.max():.2e}, "
        f"log-probs median {sampled.median():.1f}; |vLLM - base model| mean {base.mean():.2e}",
    )
    assert sorted(per_turn) == list(range(1, turns + 1))
    assert all(mean <= MAX_RELATIVE_DIFF for mean, _ in per_turn.values()), per_turn
    assert (base / sampled.abs().clamp(min=1.0)).mean() > 100 * MAX_RELATIVE_DIFF, "the adapter changed nothing"


def assert_changed(before: dict[str, torch.Tensor], trainer) -> None:
    for n, param in before.items():
        new_param = trainer.model.get_parameter(n)
        assert not torch.equal(param, new_param), f"Parameter {n} has not changed."


def tool_problems():
    """Stands in for the hub's prompts: the tool task's, as chat prompts."""
    from grpo_trl import tool_problems_dataset

    return tool_problems_dataset(16, seed=0).select_columns(["prompt"])


class CounterEnvironment:
    def reset(self, **kwargs):
        self._counter = 0

    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self._counter += step
        return self._counter


class ScoredCounterEnvironment(CounterEnvironment):
    def get_reward(self) -> float:
        return float(self._counter)


def counter_script(tokens: Tokens) -> None:
    """TRL's completions of its counter tests: a valid call, a call to an unknown tool, no call; then 'Done!'."""
    script(
        tokens,
        [
            tokens.tool_call("increment", '{"step": 1}'),
            tokens.tool_call("decrement", '{"step": 2}'),
            tokens("I won't increment"),
        ],
        after_tool=tokens("Done!"),
    )


def test_train_with_environment_factory(one_engine, tool_model, tmp_path):
    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=last_message_length,
        environment_factory=CounterEnvironment,
        learning_rate=1e-3,
        per_device_train_batch_size=3,
        num_generations=3,
        max_steps=2,
    )
    previous_trainable_params = trainable(trainer)
    counter_script(Tokens(tool_model))
    scores = train_scored(trainer)

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 3)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(1 / 2)
    assert trainer.environments[0]._counter == 1  # incremented once
    assert trainer.environments[1]._counter == 0  # the tool call failed
    assert trainer.environments[2]._counter == 0  # no tool call
    assert_changed(previous_trainable_params, trainer)
    assert_fidelity(scores, turns=2)


def test_train_with_environment_owned_reward(one_engine, tool_model, tmp_path):
    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        environment_factory=ScoredCounterEnvironment,
        learning_rate=1e-3,
        per_device_train_batch_size=3,
        num_generations=3,
        max_steps=2,
    )
    assert trainer.reward_func_names == ["ScoredCounterEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0]
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "increment" in tool_names
    assert "get_reward" not in tool_names
    assert "reset" not in tool_names
    previous_trainable_params = trainable(trainer)
    counter_script(Tokens(tool_model))
    scores = train_scored(trainer)

    # counters 1, 0, 0 -> rewards 1.0, 0.0, 0.0
    assert trainer.state.log_history[-1]["rewards/ScoredCounterEnvironment/mean"] == pytest.approx(1 / 3)
    assert_changed(previous_trainable_params, trainer)
    assert_fidelity(scores, turns=2)


def test_train_with_multiple_environments(one_engine, tool_model, tmp_path):
    from datasets import Dataset

    # With shuffle_dataset=False and num_generations=2, every generation batch is [counter, counter, echo, echo].
    dataset = Dataset.from_dict({"environment": ["counter", "echo"] * 8})
    reset_kwargs_seen = {"counter": [], "echo": []}
    tool_calls_made = {"increment": [], "shout": []}

    class Counter:
        def reset(self, **kwargs):
            reset_kwargs_seen["counter"].append(kwargs)
            return "Count."

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            tool_calls_made["increment"].append(step)
            return step

    class Echo:
        def reset(self, **kwargs):
            reset_kwargs_seen["echo"].append(kwargs)
            return "Echo."

        def shout(self, text: str) -> str:
            """
            Shout the given text.

            Args:
                text: Text to shout.

            Returns:
                The text in upper case.
            """
            tool_calls_made["shout"].append(text)
            return text.upper()

    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=last_message_length,
        train_dataset=dataset,
        environment_factory={"counter": Counter, "echo": Echo},
        learning_rate=1e-3,
        per_device_train_batch_size=4,  # 2 prompts x 2 generations, so a batch mixes both environments
        num_generations=2,
        shuffle_dataset=False,
        max_steps=2,
    )
    assert [tool.__name__ for tool in trainer._env_tools["counter"]] == ["increment"]
    assert [tool.__name__ for tool in trainer._env_tools["echo"]] == ["shout"]
    assert len(trainer._environment_pool["counter"]) == 1
    assert len(trainer._environment_pool["echo"]) == 1
    previous_trainable_params = trainable(trainer)
    tokens = Tokens(tool_model)
    script(
        tokens,
        [
            tokens.tool_call("increment", '{"step": 1}'),  # only Counter exposes it
            tokens("I won't"),  # no call: reward variance within the group
            tokens.tool_call("shout", '{"text": "hi"}'),  # only Echo exposes it
            tokens("Done!"),
        ],
        after_tool=tokens("Done!"),
    )
    scores = train_scored(trainer)

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert tool_calls_made["increment"]
    assert tool_calls_made["shout"]
    assert trainer.state.log_history[-1]["tools/call_frequency"] == pytest.approx(2 / 4)
    assert trainer.state.log_history[-1]["tools/failure_frequency"] == pytest.approx(0.0)
    assert reset_kwargs_seen["counter"] and reset_kwargs_seen["echo"]
    assert all("environment" not in kwargs for kwargs in reset_kwargs_seen["counter"] + reset_kwargs_seen["echo"])
    assert_changed(previous_trainable_params, trainer)
    assert_fidelity(scores, turns=2)


def test_train_with_environment_owned_data(one_engine, tool_model, tmp_path):
    class GuessTheWordEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."  # the environment owns the data and returns the prompt

    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=last_message_length,
        environment_factory=GuessTheWordEnvironment,
        learning_rate=1e-3,
        per_device_train_batch_size=3,
        num_generations=3,
        max_steps=2,
        max_completion_length=8,
    )
    previous_trainable_params = trainable(trainer)
    tokens = Tokens(tool_model)
    script(tokens, [tokens("Done!"), tokens("DoneDone!"), tokens("DoneDoneDone!")])  # distinct lengths
    scores = train_scored(trainer)

    assert trainer.state.log_history[-1]["train_loss"] is not None
    assert_changed(previous_trainable_params, trainer)
    assert_fidelity(scores, turns=1)


def test_train_with_unknown_environment_raises(one_engine, tool_model, tmp_path):
    dataset = tool_problems().map(lambda example: {"environment": "unknown"})

    class Counter:
        def reset(self, **kwargs): ...

        def increment(self, step: int) -> int:
            """
            Increment the internal counter.

            Args:
                step: Value to add to the counter.

            Returns:
                The updated counter value.
            """
            return step

    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=last_message_length,
        train_dataset=dataset,
        environment_factory={"counter": Counter},
        per_device_train_batch_size=3,
        num_generations=3,
    )
    with pytest.raises(ValueError, match="not among the environments"):
        trainer.train()


def test_environment_owned_reward_coexists_with_reward_funcs(one_engine, tool_model, tmp_path):
    class DummyEnvironment:
        def reset(self, **kwargs):
            self._solved = False

        def guess(self, word: str) -> str:
            """
            Submit a guess.

            Args:
                word: The guessed word.

            Returns:
                Feedback about the guess.
            """
            return "nope"

        def get_reward(self) -> float:
            return 1.0 if self._solved else 0.0

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=format_reward,
        environment_factory=DummyEnvironment,
        per_device_train_batch_size=3,
        num_generations=3,
        max_steps=2,
        reward_weights=[0.5],  # only the trainer-owned reward func's
    )
    assert trainer.reward_func_names == ["format_reward", "DummyEnvironment"]
    assert trainer.reward_weights.tolist() == [0.5, 1.0]
    assert len(trainer.reward_funcs) == 2
    tool_names = [tool.__name__ for tool in trainer.tools]
    assert "guess" in tool_names
    assert "get_reward" not in tool_names


def test_environment_owned_reward_mixed_environments(one_engine, tool_model, tmp_path):
    from datasets import Dataset

    class ScoredEnvironment:  # owns its reward
        def reset(self, **kwargs): ...

        def act(self, x: int) -> int:
            """
            Act.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

        def get_reward(self) -> float:
            return 1.0

    class PlainEnvironment:  # no get_reward: scored by reward_funcs
        def reset(self, **kwargs): ...

        def play(self, x: int) -> int:
            """
            Play.

            Args:
                x: A value.

            Returns:
                The value.
            """
            return x

    def format_reward(completions, **kwargs):
        return [0.0 for _ in completions]

    trainer = grpo_trainer(
        tool_model,
        tmp_path,
        reward_funcs=format_reward,
        train_dataset=Dataset.from_dict({"environment": ["scored", "scored2", "plain"]}),
        # scored and scored2 both build ScoredEnvironment: one reward column
        environment_factory={"scored": ScoredEnvironment, "scored2": ScoredEnvironment, "plain": PlainEnvironment},
        per_device_train_batch_size=3,
        num_generations=3,
    )
    assert trainer.reward_func_names == ["format_reward", "ScoredEnvironment"]
    assert trainer.reward_weights.tolist() == [1.0, 1.0]
    env_reward_func = trainer.reward_funcs[-1]
    assert env_reward_func(environments=[ScoredEnvironment(), PlainEnvironment()]) == [1.0, None]


def test_dataset_required_without_environment(one_engine, tool_model, tmp_path):
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        grpo_trainer(tool_model, tmp_path, reward_funcs=last_message_length)


def test_environment_owned_data_requires_max_steps(one_engine, tool_model, tmp_path):
    class DummyEnvironment:
        def reset(self, **kwargs):
            return "Guess the 5-letter word."

    with pytest.raises(ValueError, match="max_steps"):
        grpo_trainer(tool_model, tmp_path, reward_funcs=last_message_length, environment_factory=DummyEnvironment)


def test_multiple_environments_without_dataset_raises(one_engine, tool_model, tmp_path):
    class EnvA:
        def reset(self, **kwargs): ...

    class EnvB:
        def reset(self, **kwargs): ...

    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        grpo_trainer(
            tool_model,
            tmp_path,
            reward_funcs=last_message_length,
            environment_factory={"a": EnvA, "b": EnvB},
            max_steps=1,
        )
