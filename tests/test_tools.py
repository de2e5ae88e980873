"""grpo/episodes/: multi-turn episodes token in / token out on a scripted engine (no model, no vLLM), the tool mask
through the padded batch and the packed log-probs, misbehaving tools, the budget, the retokenized comparison, and
the refusals of a bad `tools` entry."""

import json
import time
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from grpo.config import ConfigError, ToolCallingSettings
from grpo.data import make_batch, select
from grpo.engines.interface import Sample
from grpo.episodes.loop import ToolEngine, turn_seed
from grpo.episodes.metrics import tool_stats
from grpo.episodes.parsers import parse_tool_calls
from grpo.episodes.tools import ToolCaller, load_tools
from grpo.tasks.tiny_tools import build_tool_tokenizer, make_tool_problems, render, tool_conversation
from grpo.tasks.tool_functions import calculator

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37*48"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tokenizer():
    problems = make_tool_problems(300, seed=5)
    texts = render([tool_conversation(p, call_tool=i % 2 == 0) for i, p in enumerate(problems)])
    return build_tool_tokenizer(texts)


@dataclass
class Sampling:  # what ToolEngine reads of vLLM's SamplingParams
    n: int = 1
    max_tokens: int = 64

    def clone(self):
        return Sampling(self.n, self.max_tokens)


class ScriptedEngine:
    """Answers turn k of every episode with ``turns[k]`` (ids, or a text tokenized canonically, then the eos), cut
    at the request's max_tokens; each sampled token's log-prob is -0.5. Records every request."""

    def __init__(self, tokenizer, turns, max_model_len=None):
        self.tokenizer, self.turns, self.requests = tokenizer, turns, []
        self.response_open = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.max_model_len = max_model_len  # a request past it is refused, as vLLM's server answers it (HTTP 400)

    def generate(self, prompt_ids, sampling, use_tqdm=False):
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_ids)
        self.requests.append([(list(ids), s.n, s.max_tokens) for ids, s in zip(prompt_ids, per_prompt)])
        for ids, params in zip(prompt_ids, per_prompt):
            if self.max_model_len is not None and len(ids) + params.max_tokens > self.max_model_len:
                raise ValueError(
                    f"max_tokens={params.max_tokens} with {len(ids)} prompt tokens exceeds max_model_len "
                    f"{self.max_model_len}"
                )
        samples = []
        for index, (ids, params) in enumerate(zip(prompt_ids, per_prompt)):
            turn = self.turns[min(ids.count(self.response_open), len(self.turns) - 1)]
            full = turn if isinstance(turn, list) else self.encode(turn) + [self.tokenizer.eos_token_id]
            out = full[: params.max_tokens]
            for _ in range(params.n):
                samples.append(Sample(list(ids), out, "", [-0.5] * len(out), len(out) < len(full), index))
        return samples

    def encode(self, text):
        return self.tokenizer(text, add_special_tokens=False).input_ids


def tool_engine(tokenizer, turns, tools=(calculator,), engine_max_model_len=None, **settings):
    """A `ToolEngine` on a `ScriptedEngine` (refusing requests past ``engine_max_model_len``); ``settings``: the
    config's (``max_model_len`` as `RecipeConfig.max_model_len` gives it, absent by default)."""
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(**settings.pop("tool_calling", {})),
        max_tool_calling_iterations=settings.pop("max_tool_calling_iterations", None),
        max_completion_length=settings.pop("max_completion_length", 64),
        **settings,
    )
    return ToolEngine(ScriptedEngine(tokenizer, turns, engine_max_model_len), tokenizer, list(tools), cfg)


def prompt_ids(tokenizer, question="Ava buys 37 boxes of 48 pens. How many pens?"):
    messages = [{"role": "user", "content": question}]
    text = tokenizer.apply_chat_template(messages, tools=[calculator], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def test_an_episode_is_the_sampled_ids_and_each_tool_response_tokenized_alone(tokenizer):
    engine = tool_engine(tokenizer, [CALL, "#### 1776"])
    prompt = prompt_ids(tokenizer)
    samples = engine.generate([prompt], Sampling(n=2))
    assert len(samples) == 2
    turn1 = engine.engine.encode(CALL) + [tokenizer.eos_token_id]
    suffix = engine.renderer.tool_suffix_ids([{"role": "tool", "name": "calculator", "content": "1776"}])
    turn2 = engine.engine.encode("#### 1776") + [tokenizer.eos_token_id]
    assert tokenizer.decode(suffix) == "\n<|im_start|>user\n<tool_response>\n1776\n</tool_response><|im_end|>\n" + (
        "<|im_start|>assistant\n"
    )
    for s in samples:
        assert s.prompt_ids == prompt and s.completion_ids == turn1 + suffix + turn2
        assert s.tool_mask == [1] * len(turn1) + [0] * len(suffix) + [1] * len(turn2)
        assert s.turn_of_token == [1] * len(turn1) + [0] * len(suffix) + [2] * len(turn2)
        assert s.logprobs == [-0.5] * len(turn1) + [0.0] * len(suffix) + [-0.5] * len(turn2)
        assert (s.tool_calls, s.tool_failures, s.truncated, s.retokenization_drift) == (1, 0, False, False)
        assert s.text.endswith("#### 1776")
    # the second turn is generated from the exact ids so far, one completion per episode, within the budget
    first, second = engine.engine.requests
    assert first == [(prompt, 2, 64)]
    assert second == [(prompt + turn1 + suffix, 1, 64 - len(turn1 + suffix))] * 2
    # canonical ids here: the chat template renders the same conversation to the same ids
    messages = tool_conversation({"question": "Ava buys 37 boxes of 48 pens. How many pens?", "answer": "37*48="}, True)
    text = tokenizer.apply_chat_template(messages, tools=[calculator], tokenize=False)
    assert tokenizer(text, add_special_tokens=False).input_ids == prompt + samples[
        0
    ].completion_ids + engine.engine.encode("\n")
    stats = tool_stats(samples)
    assert stats["tool_calls"] == 2 and stats["tool_turns"] == 4 and stats["tool_drifted"] == 0


def test_a_turn_sampled_in_other_tokens_than_the_canonical_ones_is_kept_as_sampled(tokenizer):
    """BPE is not a bijection: "#### 1776" sampled digit by digit decodes to the canonical text, whose tokens differ.
    Token in / token out trains on the sampled ids; the retokenized comparison on the canonical ones."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    odd = encode("#### ") + [encode(digit)[0] for digit in "1776"] + [tokenizer.eos_token_id]
    canonical = encode("#### 1776") + [tokenizer.eos_token_id]
    assert odd != canonical and tokenizer.decode(odd) == tokenizer.decode(canonical)
    sampled = tool_engine(tokenizer, [CALL, odd]).generate([prompt_ids(tokenizer)], Sampling())[0]
    assert sampled.completion_ids[-len(odd) :] == odd and sampled.retokenization_drift
    again = tool_engine(tokenizer, [CALL, odd], tool_calling={"retokenize": True})
    retokenized = again.generate([prompt_ids(tokenizer)], Sampling())[0]
    assert retokenized.completion_ids[-len(canonical) :] == canonical and retokenized.retokenization_drift
    # the engine's log-probs are kept by position: the retokenized turn pairs tokens with other tokens' values
    assert len(retokenized.logprobs) == len(retokenized.completion_ids) == len(retokenized.tool_mask)
    assert retokenized.completion_ids[: -len(canonical)] == sampled.completion_ids[: -len(odd)]


def test_misbehaving_tools_give_error_results_and_count_as_failures():
    def raises(x: int) -> str:
        """Raise.

        Args:
            x: anything
        """
        raise RuntimeError("boom")

    def not_a_string(x: int) -> str:
        """Return an int.

        Args:
            x: anything
        """
        return x

    def hangs(x: int) -> str:
        """Sleep.

        Args:
            x: anything
        """
        time.sleep(30)
        return "late"

    def floods(x: int) -> str:
        """Flood.

        Args:
            x: anything
        """
        return "9" * 10_000

    tools = {f.__name__: f for f in (raises, not_a_string, hangs, floods, calculator)}
    caller = ToolCaller(tools, timeout_s=0.5, max_output_chars=100)
    text = "".join(
        f"<tool_call>\n{body}\n</tool_call>"
        for body in [
            '{"name": "raises", "arguments": {"x": 1}}',
            '{"name": "not_a_string", "arguments": {"x": 1}}',
            '{"name": "hangs", "arguments": {"x": 1}}',
            '{"name": "floods", "arguments": {"x": 1}}',
            '{"name": "nope", "arguments": {}}',
            '{"name": "calculator", "arguments": {"expression": "2*"}}',
            '{"name": "calculator", "arguments": {"expression": "2*3"}',  # a brace short
            '{"name": "calculator", "arguments": {"expression": "6*7"}}',
        ]
    )
    start = time.perf_counter()
    results = caller.run(parse_tool_calls(text))
    assert time.perf_counter() - start < 5  # the hung tool is abandoned at its timeout
    assert [failed for _, _, failed in results] == [True] * 7 + [False]
    errors = [json.loads(result)["error"] for _, result, failed in results if failed]
    for error, words in zip(
        errors,
        [
            "RuntimeError: boom",
            "returned int, not str",
            "timed out after 0.5 s",
            "10000 characters, over the cap of 100",
        ]
        + ["'nope' not found", "'2*' is not an arithmetic expression", "malformed tool call (not JSON"],
    ):
        assert words in error, (words, error)
    assert results[-1] == ("calculator", "42", False)
    assert parse_tool_calls('<tool_call>\n{"name": "calcul') == [
        'malformed tool call (no closing </tool_call>): \'\\n{"name": "calcul\''
    ]


def test_failures_reach_the_model_and_the_metrics(tokenizer):
    bad = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "import os"}}\n</tool_call>'
    engine = tool_engine(tokenizer, [bad, "#### 0"], max_completion_length=256)
    sample = engine.generate([prompt_ids(tokenizer)], Sampling(max_tokens=256))[0]
    assert (sample.tool_calls, sample.tool_failures) == (1, 1)
    assert "is not an arithmetic expression" in tokenizer.decode(sample.completion_ids)
    stats = tool_stats([sample])
    assert stats["tool_failures"] == 1 and stats["tool_episodes_succeeding"] == 0


def test_the_budget_counts_tool_tokens_and_drops_a_result_that_would_pass_it(tokenizer):
    turn1 = len(tokenizer(CALL, add_special_tokens=False).input_ids) + 1
    suffix = len(
        tool_engine(tokenizer, [CALL]).renderer.tool_suffix_ids([{"role": "tool", "name": "c", "content": "1776"}])
    )
    # room for the call, not for its result: the result is dropped and the episode ends after turn 1 (TRL's rule)
    short = tool_engine(tokenizer, [CALL, "#### 1776"], max_completion_length=turn1 + suffix - 1)
    sample = short.generate([prompt_ids(tokenizer)], Sampling(max_tokens=turn1 + suffix - 1))[0]
    assert len(sample.completion_ids) == turn1 and sample.tool_calls == 1 and len(short.engine.requests) == 1
    # room for the result and three more tokens: the last turn is cut there, truncated
    tight = tool_engine(tokenizer, [CALL, "#### 1776 is the product"], max_completion_length=turn1 + suffix + 3)
    sample = tight.generate([prompt_ids(tokenizer)], Sampling(max_tokens=turn1 + suffix + 3))[0]
    assert len(sample.completion_ids) == turn1 + suffix + 3 and sample.truncated
    assert tight.engine.requests[1][0][2] == 3


def test_max_tool_calling_iterations_bounds_the_rounds(tokenizer):
    engine = tool_engine(tokenizer, [CALL], max_tool_calling_iterations=2, max_completion_length=512)
    sample = engine.generate([prompt_ids(tokenizer)], Sampling(max_tokens=512))[0]
    assert sample.tool_calls == 2 and max(sample.turn_of_token) == 3 and len(engine.engine.requests) == 3


def test_tool_tokens_carry_no_loss_through_the_batch_and_the_packed_log_probs(tokenizer):
    """make_batch masks the tool tokens inside the response; the padding rule reads every model token at its place
    (the per-sequence forward's values), 0 on tool tokens; select keeps the model tokens after a tool response."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from padding import packed_log_probs

    engine = tool_engine(tokenizer, [CALL, "#### 1776"])
    samples = engine.generate(
        [prompt_ids(tokenizer), prompt_ids(tokenizer, "Bo has 12 bags of 15 cups. How many?")], Sampling()
    )
    samples.append(tool_engine(tokenizer, ["#### 5"]).generate([prompt_ids(tokenizer, "Hi")], Sampling())[0])
    batch = make_batch(samples, tokenizer.pad_token_id, torch.device("cpu"))
    mask = torch.tensor([s.tool_mask + [0] * (batch["response_mask"].shape[1] - len(s.tool_mask)) for s in samples])
    assert torch.equal(batch["response_mask"], mask) and batch["turn_of_token"].max() == 2
    sub = select(batch, slice(0, 2))
    assert sub["response_mask"].shape[1] == len(samples[0].completion_ids)  # not the count of model tokens
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, attn_implementation="sdpa",
    )  # fmt: skip
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        got = packed_log_probs(model, batch["input_ids"], batch["attention_mask"], batch["response_mask"])
        for i, s in enumerate(samples):
            ids = torch.tensor([s.prompt_ids + s.completion_ids])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1 : -1].log_softmax(-1)
            want = logits.gather(-1, torch.tensor(s.completion_ids)[:, None])[:, 0] * torch.tensor(s.tool_mask)
            assert (got[i, : len(want)] - want).abs().max() < 1e-5
        legacy = packed_log_probs(
            model, batch["input_ids"], batch["attention_mask"], batch["response_mask"], legacy_slice=True
        )
    assert (legacy - got)[batch["response_mask"].bool()].abs().max() > 0.1  # the misaligned slice reads other tokens


def test_a_tool_that_cannot_be_used_is_refused_naming_it():
    with pytest.raises(ConfigError, match="'grpo.tasks.tool_functions:nope' cannot be imported"):
        load_tools(["grpo.tasks.tool_functions:nope"])
    with pytest.raises(ConfigError, match="'json:dumps' cannot be described to the model"):
        load_tools(["json:dumps"])
    with pytest.raises(ConfigError, match="two functions of the same name"):
        load_tools(["grpo.tasks.tool_functions:calculator", "grpo.tasks.tool_functions:calculator"])
    assert load_tools(["grpo.tasks.tool_functions:calculator"]) == [calculator]


def test_the_recipe_refuses_a_tool_it_cannot_describe_before_the_model_loads(tmp_path):
    """One line, exit code 2, from the plain recipe on the tool config: nothing is built or loaded first."""
    from recipe_runs import run_recipe

    overrides = ["model.build_tiny=null", "model.name_or_path=/no/such/model", "tools=[json:dumps]"]
    proc = run_recipe(tmp_path, *overrides, config="tiny_cpu_tools.yaml")
    assert proc.returncode == 2, proc.stderr[-3000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("error: tools entry 'json:dumps' cannot be described to the model"), line
    assert not (tmp_path / "run").exists()


def wait_then_echo(key: str) -> str:
    """Return the key, after 0.6 s when it is "slow".

    Args:
        key: "slow" or anything else
    """
    time.sleep(0.6 if key == "slow" else 0.0)
    return key


class SendingEngine(ScriptedEngine):
    """A scripted server engine (`send` / `receive`): the first turn of a prompt asking for "slow" calls
    `wait_then_echo("slow")`, of any other `wait_then_echo("fast")`; every later turn answers. Records when each
    request was sent, its ids and its seed, and its route (`routes`, in order)."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer, [])
        self.sent, self.routes = [], []

    def send(self, prompt_ids, sampling, seeds=None, routes=None):
        self.sent.append([(time.monotonic(), list(ids), seed) for ids, seed in zip(prompt_ids, seeds)])
        self.routes += [(list(ids), route) for ids, route in zip(prompt_ids, routes)]
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_ids)
        samples = []
        for index, (ids, params) in enumerate(zip(prompt_ids, per_prompt)):
            if self.response_open in ids:
                text = "#### done"
            else:
                key = "slow" if "slow" in self.tokenizer.decode(ids) else "fast"
                text = f'<tool_call>\n{{"name": "wait_then_echo", "arguments": {{"key": "{key}"}}}}\n</tool_call>'
            full = self.encode(text) + [self.tokenizer.eos_token_id]
            samples += [Sample(list(ids), full, "", [-0.5] * len(full), False, index) for _ in range(params.n)]
        return samples

    def receive(self, pending):
        return pending


@pytest.mark.parametrize("schedule", ["per_episode", "per_turn"])
def test_on_a_server_each_episode_sends_its_next_turn_when_its_own_tools_return(tokenizer, schedule):
    """Two prompts, two episodes each; one prompt's tool takes 0.6 s. Per episode, the fast episodes' second turns
    leave before the slow tool returns; per turn (the control) they wait for it and leave in one batch with the slow
    ones. Both schedules give the same episodes and the same seeds: the first turn's from the process's RNG, later
    turns' derived from it (`turn_seed`), whatever the order they leave in."""
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(schedule=schedule),
        max_tool_calling_iterations=None,
        max_completion_length=96,
    )
    engine = ToolEngine(SendingEngine(tokenizer), tokenizer, [wait_then_echo], cfg)
    prompts = [prompt_ids(tokenizer, "the fast one, please"), prompt_ids(tokenizer, "the slow one, please")]
    torch.manual_seed(0)
    started = time.monotonic()
    samples = engine.generate(prompts, Sampling(n=2, max_tokens=96))
    sent = [request for batch in engine.engine.sent for request in batch]
    assert len(samples) == 4 and all(s.tool_calls == 1 and s.tool_failures == 0 for s in samples)
    assert [s.prompt_index for s in samples] == [0, 0, 1, 1]
    later = [(at - started, ids[: len(prompts[0])] == prompts[0], seed) for at, ids, seed in sent[2:]]
    fast, slow = [at for at, is_fast, _ in later if is_fast], [at for at, is_fast, _ in later if not is_fast]
    assert len(fast) == len(slow) == 2
    if schedule == "per_episode":
        assert max(fast) < 0.5 <= min(slow), later  # the fast episodes went on while the slow tool ran
    else:
        assert min(fast) >= 0.6 and len(engine.engine.sent) == 2, later  # one batch per turn, after the slow tools
    torch.manual_seed(0)
    first = torch.randint(0, 2**31 - 1, (2,)).tolist()
    assert [seed for _, _, seed in sent[:2]] == first
    assert sorted(seed for _, _, seed in later) == sorted(turn_seed(first[e // 2], e, 2) for e in range(4))
    # every turn of an episode is routed by its prompt (one engine of a data-parallel server holds its prefix)
    assert all(route == (0 if ids[: len(prompts[0])] == prompts[0] else 1) for ids, route in engine.engine.routes)
    assert len(engine.engine.routes) == 2 + 4


class VersionedEngine(SendingEngine):
    """`SendingEngine` as a server that labels every token with the weight version it serves when the request
    arrives (`version`, which a test's sync changes), each request's reply as vLLM's `receive` gives it."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.version = 1

    def send(self, prompt_ids, sampling, seeds=None, routes=None):
        version = self.version  # on arrival (before it is recorded as sent)
        samples = super().send(prompt_ids, sampling, seeds, routes)
        for sample in samples:
            sample.versions = [version] * len(sample.completion_ids)
        now = time.time()
        return SimpleNamespace(samples=samples, futures=[], sent_at=now, times=[(now, now)] * len(prompt_ids))

    def receive(self, pending):
        return pending.samples


@pytest.mark.parametrize("sync_between_turns", [True, False])
@pytest.mark.parametrize("schedule", ["per_episode", "per_turn"])
def test_a_sync_between_two_turns_labels_each_turn_with_the_version_that_sampled_it(
    tokenizer, schedule, sync_between_turns
):
    """max_staleness >= 1: `send` starts the episodes and returns while their tools run; a sync landing then (the
    server serves version 2) reaches every one of the 8 episodes between its turns. Each token keeps its version:
    the first turn's and its tool tokens 1, the second turn's 2. The control, no sync, leaves every token at 1."""
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(schedule=schedule), max_tool_calling_iterations=None, max_completion_length=96
    )
    engine = ToolEngine(VersionedEngine(tokenizer), tokenizer, [wait_then_echo], cfg)
    prompts = [prompt_ids(tokenizer, f"the slow one, number {i}") for i in range(4)]
    pending = engine.send(prompts, Sampling(n=2, max_tokens=96))
    deadline = time.monotonic() + 10
    while sum(len(batch) for batch in engine.engine.sent) < len(prompts) and time.monotonic() < deadline:
        time.sleep(0.01)  # every first turn sent, on version 1; their tools now take 0.6 s
    assert not pending.episodes.done()  # send returned with the episodes running
    if sync_between_turns:
        engine.engine.version = 2
    samples = engine.receive(pending)
    assert len(samples) == 8 and all(s.tool_calls == 1 for s in samples)
    assert len(pending.times) == len(prompts) + 8  # every request of every turn, for the queue's busy time
    second = 2 if sync_between_turns else 1
    for sample in samples:
        turns = torch.tensor(sample.turn_of_token)
        versions = torch.tensor(sample.versions)
        assert set(turns.tolist()) == {0, 1, 2}
        assert (versions[turns == 1] == 1).all() and (versions[turns == 0] == 1).all()  # the tool tokens: turn 1's
        assert (versions[turns == 2] == second).all()
