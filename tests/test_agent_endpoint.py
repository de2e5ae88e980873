"""grpo/episodes/agent*.py: agents that own their loop, driven through the OpenAI-compatible endpoint with the
`openai` client, on the scripted engines of test_tools.py (no model, no vLLM): the session's sample is the native
tool loop's, token for token; a rewritten history, an unknown or ended session are refused; a sync between two
turns; an agent that raises or hangs ends only its own episode."""

import json
import threading
import time
from types import SimpleNamespace

import openai
import pytest
import torch
from test_tools import CALL, Sampling, ScriptedEngine, VersionedEngine, prompt_ids, tool_engine
from transformers.utils import get_json_schema

from grpo.config import ConfigError, ToolCallingSettings, load_config
from grpo.data import score
from grpo.episodes.agent import AgentEngine, load_agent
from grpo.episodes.loop import turn_seed
from grpo.episodes.metrics import tool_stats
from grpo.metrics import tool_metrics
from grpo.tasks.tiny_tools import build_tool_tokenizer, make_tool_problems, render, tool_conversation
from grpo.tasks.tool_functions import calculator

QUESTION = "Ava buys 37 boxes of 48 pens. How many pens?"
TOOLS = [{"type": "function", "function": get_json_schema(calculator)["function"]}]


@pytest.fixture(scope="module")
def tokenizer():  # test_tools.py's
    problems = make_tool_problems(300, seed=5)
    return build_tool_tokenizer(render([tool_conversation(p, call_tool=i % 2 == 0) for i, p in enumerate(problems)]))


def calculator_agent(client, row, rewrite=None):
    """An agent written against the openai client alone: asks, runs the calculator on each call, answers."""
    messages = [{"role": "user", "content": row["question"]}]
    for _ in range(4):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return None
        for call in message.tool_calls:
            result = calculator(**json.loads(call.function.arguments))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if rewrite is not None:
            rewrite(client, messages)
    return None


def agent_engine(
    tokenizer, engine, agent, questions=(QUESTION,), max_completion_length=64, max_model_len=None, **settings
):
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(**settings),
        max_tool_calling_iterations=None,
        max_completion_length=max_completion_length,
        max_model_len=max_model_len,
    )
    rows = [{"question": q, "prompt_ids": prompt_ids(tokenizer, q)} for q in questions]
    return AgentEngine(engine, tokenizer, agent, cfg, rows)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def test_a_session_is_the_native_tool_episode_token_for_token(tokenizer):
    """The call turn is sampled in other tokens than the canonical ones (the expression digit by digit). The
    agent's session keeps them: its sample equals the native tool loop's on the same sampled turns, and its second
    request reached the engine as prompt + sampled ids + tool suffix. The control: rendering the agent's second
    request's messages again and tokenizing them (what a re-rendering proxy does) gives other ids."""
    head, tail = CALL.split("37*48")
    odd_call = encode(tokenizer, head) + [encode(tokenizer, c)[0] for c in "37*48"] + encode(tokenizer, tail)
    odd_call += [tokenizer.eos_token_id]
    assert tokenizer.decode(odd_call[:-1]) == CALL and odd_call[:-1] != encode(tokenizer, CALL)
    turns = [odd_call, "#### 1776"]
    native = tool_engine(tokenizer, turns).generate([prompt_ids(tokenizer)], Sampling())[0]

    seen = []

    def agent(client, row):
        calculator_agent(client, row, rewrite=lambda _, messages: seen.append(list(messages)))
        return None

    engine = agent_engine(tokenizer, ScriptedEngine(tokenizer, turns), agent)
    try:
        (sample,) = engine.generate([prompt_ids(tokenizer)], Sampling())
    finally:
        engine.endpoint.close()
    assert sample.prompt_ids == native.prompt_ids == prompt_ids(tokenizer)
    assert sample.completion_ids == native.completion_ids
    assert sample.tool_mask == native.tool_mask and sample.turn_of_token == native.turn_of_token
    assert sample.logprobs == native.logprobs and sample.versions is None
    assert (sample.tool_calls, sample.tool_failures, sample.agent_error, sample.reward) == (1, 0, False, None)
    suffix = engine.renderer.tool_suffix_ids([{"role": "tool", "name": "calculator", "content": "1776"}])
    first, second = engine.engine.requests
    assert first[0][0] == prompt_ids(tokenizer) and second[0][0] == prompt_ids(tokenizer) + odd_call + suffix
    # the control: the second request's messages rendered again hold the canonical call, not the sampled one
    messages = seen[0]
    again = [m if m["role"] != "tool" else {**m, "name": "calculator"} for m in messages]
    for m in again:
        for call in m.get("tool_calls", []):
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    text = tokenizer.apply_chat_template(again, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert encode(tokenizer, text) != second[0][0]
    # the reward functions score the final text when the agent leaves it to them
    rewards, _ = score(
        {"r": lambda completions, **_: [float("1776" in c) for c in completions]}, [{"prompt": "p"}], [sample]
    )
    assert rewards.tolist() == [1.0]


def test_a_rewritten_history_is_refused_naming_the_first_differing_message(tokenizer):
    """After the call turn the agent first summarises it (drops the assistant message), then edits the user's
    question: both are refused with a 400 naming the message; the unchanged history then goes on. The refusals are
    counted on the sample and in the metrics; the agent's own reward replaces the reward functions'."""
    refused = []

    def rewrite(client, messages):
        dropped = messages[:1] + messages[2:]
        edited = [{"role": "user", "content": "How many pens?"}] + messages[1:]
        for attempt in (dropped, edited):
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(model="policy", messages=attempt, tools=TOOLS)
            refused.append((err.value.code, err.value.param, str(err.value)))

    def agent(client, row):
        calculator_agent(client, row, rewrite=rewrite)
        return 0.25

    engine = agent_engine(tokenizer, ScriptedEngine(tokenizer, [CALL, "#### 1776"]), agent)
    try:
        (sample,) = engine.generate([prompt_ids(tokenizer)], Sampling())
    finally:
        engine.endpoint.close()
    (code1, param1, text1), (code2, param2, text2) = refused
    assert (code1, param1, code2, param2) == ("history_rewritten", "messages[1]", "history_rewritten", "messages[0]")
    assert "messages[1] is" in text1 and '"role": "tool"' in text1 and "How many pens?" in text2
    assert sample.agent_refusals == 2 and max(sample.turn_of_token) == 2 and not sample.agent_error
    assert tool_metrics(tool_stats([sample], agent=True))["agent/refusals_per_episode"] == 2.0
    assert not any(k.startswith("agent/") for k in tool_metrics(tool_stats([sample])))  # a native tool run: none
    rewards, _ = score({"r": lambda completions, **_: [1.0 for _ in completions]}, [{"prompt": "p"}], [sample])
    assert rewards.tolist() == [0.25]


def test_an_unknown_or_ended_session_is_refused(tokenizer):
    clients = []

    def agent(client, row):
        clients.append(client)
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}])
        return 1.0

    engine = agent_engine(tokenizer, ScriptedEngine(tokenizer, ["#### 1776"]), agent)
    try:
        (sample,) = engine.generate([prompt_ids(tokenizer)], Sampling())
        assert sample.reward == 1.0 and sample.tool_mask == [1] * len(sample.completion_ids)
        with pytest.raises(openai.ConflictError, match="has ended"):  # the session after its episode was collected
            clients[0].chat.completions.create(model="policy", messages=[{"role": "user", "content": "again"}])
        unknown = openai.OpenAI(
            base_url=engine.endpoint.base_url, api_key="-", default_headers={"X-Session-Id": "nope"}, max_retries=0
        )
        with pytest.raises(openai.NotFoundError, match="unknown session 'nope'"):
            unknown.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
        none = openai.OpenAI(base_url=engine.endpoint.base_url, api_key="-", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="X-Session-Id"):
            none.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    finally:
        engine.endpoint.close()


def test_a_sync_between_two_turns_labels_each_turn_with_the_version_that_sampled_it(tokenizer):
    """On a server (`send`/`receive`): the agents' first turns are sampled by version 1; while their tools wait a
    sync lands (version 2); the second turns carry 2, the first turns and tool tokens 1. Each turn is seeded as the
    tool loop seeds a later turn (`turn_seed` of its prompt's first-turn seed, its episode, the turn)."""
    synced = threading.Event()

    def agent(client, row):
        messages = [{"role": "user", "content": row["question"]}]
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        assert (
            reply.choices[0].finish_reason == "tool_calls" and message.tool_calls[0].function.name == "wait_then_echo"
        )
        synced.wait(10)
        messages += [message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "slow"}]
        client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        return None

    questions = [f"the slow one, number {i}" for i in range(2)]
    engine = agent_engine(tokenizer, VersionedEngine(tokenizer), agent, questions)
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    try:
        torch.manual_seed(0)
        pending = engine.send(prompts, Sampling(n=2, max_tokens=64))
        deadline = time.monotonic() + 10
        while sum(len(batch) for batch in engine.engine.sent) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        engine.engine.version = 2
        synced.set()
        samples = engine.receive(pending)
    finally:
        engine.endpoint.close()
    assert len(samples) == 4 and len(pending.times) == 8
    for sample in samples:
        turns, versions = torch.tensor(sample.turn_of_token), torch.tensor(sample.versions)
        assert set(turns.tolist()) == {0, 1, 2}
        assert (versions[turns == 1] == 1).all() and (versions[turns == 0] == 1).all()
        assert (versions[turns == 2] == 2).all()
    torch.manual_seed(0)
    first = torch.randint(0, 2**31 - 1, (2,)).tolist()
    sent = sorted(seed for batch in engine.engine.sent for _, _, seed in batch)
    assert sent == sorted(turn_seed(first[e // 2], e, t) for e in range(4) for t in (1, 2))


def test_a_tool_result_past_the_budget_ends_the_episode_as_the_native_loop_ends_it(tokenizer):
    """Room for the call turn, not for its result: the native loop drops the result and ends the episode after turn
    1; the endpoint refuses the agent's second request (400 context_length_exceeded) and the session's sample is the
    same. The agent raising on that refusal is no agent error: the episode finished at its limit."""
    turn1 = len(encode(tokenizer, CALL)) + 1
    suffix = tool_engine(tokenizer, [CALL]).renderer.tool_suffix_ids([{"role": "tool", "name": "c", "content": "1776"}])
    budget = turn1 + len(suffix) - 1
    native = tool_engine(tokenizer, [CALL, "#### 1776"], max_completion_length=budget)
    native = native.generate([prompt_ids(tokenizer)], Sampling(max_tokens=budget))[0]
    engine = agent_engine(
        tokenizer, ScriptedEngine(tokenizer, [CALL, "#### 1776"]), calculator_agent, max_completion_length=budget
    )
    try:
        (sample,) = engine.generate([prompt_ids(tokenizer)], Sampling(max_tokens=budget))
    finally:
        engine.endpoint.close()
    assert len(native.completion_ids) == turn1 and sample.completion_ids == native.completion_ids
    assert len(engine.engine.requests) == 1 and (sample.agent_error, sample.reward) == (False, None)


@pytest.mark.parametrize("room", [4, 3])
def test_no_request_asks_for_more_than_max_model_len(tokenizer, room):
    """The agent's prompt leaves ``room`` tokens of max_model_len: with min_turn_tokens=4 the turn is sent asking for
    those 4 tokens at most (the control), with 3 it is not sent: the session ends truncated at its limit (400
    context_length_exceeded), and nothing reached the engine."""
    prompt = prompt_ids(tokenizer)
    engine = agent_engine(
        tokenizer,
        ScriptedEngine(tokenizer, ["#### 1776"]),
        calculator_agent,
        max_model_len=len(prompt) + room,
        min_turn_tokens=4,
    )
    try:
        (sample,) = engine.generate([prompt], Sampling())
    finally:
        engine.endpoint.close()
    assert (sample.agent_error, sample.reward) == (False, None)
    if room == 4:
        assert [[(ids, max_tokens) for ids, _, max_tokens in r] for r in engine.engine.requests] == [[(prompt, 4)]]
    else:
        assert engine.engine.requests == [] and sample.completion_ids == [tokenizer.eos_token_id]


def test_an_agent_that_raises_or_hangs_ends_only_its_own_episode(tokenizer):
    """Three episodes: one agent raises after its first turn, one hangs past agent_timeout_s (its later request is
    refused: the session has ended), one answers. The first two score 0.0 as failed episodes and are counted; the
    third is scored by the reward functions."""
    late = []

    def agent(client, row):
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": row["question"]}])
        if "raises" in row["question"]:
            raise RuntimeError("boom")
        if "hangs" in row["question"]:
            time.sleep(1.5)
            try:
                client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "x"}])
            except openai.APIStatusError as err:
                late.append(err.status_code)
        return None

    questions = ["it raises", "it hangs", "it answers"]
    engine = agent_engine(tokenizer, ScriptedEngine(tokenizer, ["#### 1776"]), agent, questions, agent_timeout_s=0.5)
    try:
        samples = engine.generate([prompt_ids(tokenizer, q) for q in questions], Sampling())
        time.sleep(1.5)
    finally:
        engine.endpoint.close()
    assert [s.agent_error for s in samples] == [True, True, False] and late == [409]
    rewards, _ = score({"r": lambda completions, **_: [1.0 for _ in completions]}, [{"prompt": "p"}] * 3, samples)
    assert rewards.tolist() == [0.0, 0.0, 1.0]
    assert tool_metrics(tool_stats(samples, agent=True))["agent/error_frequency"] == pytest.approx(2 / 3)


def test_an_agent_that_cannot_be_used_is_refused_naming_it():
    with pytest.raises(ConfigError, match="agent 'grpo.tasks.tool_functions:nope' cannot be imported"):
        load_agent("grpo.tasks.tool_functions:nope")
    with pytest.raises(ConfigError, match="must look like 'module:function'"):
        load_agent("calculator")
    assert load_agent("grpo.tasks.tool_functions:calculator") is calculator
    with pytest.raises(ConfigError, match="an agent runs its own tools"):
        load_config(None, ["agent=a:b", "tools=[grpo.tasks.tool_functions:calculator]"])
    with pytest.raises(ConfigError, match="needs data.use_chat_template=true"):
        load_config(None, ["agent=a:b", "data.use_chat_template=false"])


def test_the_shipped_calculator_agent_gives_the_native_episode(tokenizer):
    """recipes/agents/calculator_agent.py (plain openai client code) on the tool task: the same prompt ids as the
    native task's (its calculator schema renders as the tool's own) and the native loop's episode."""
    from recipes.agents.calculator_agent import calculate, solve

    assert (calculate("37*48"), calculate("2**8")) == (
        "1776",
        json.dumps({"error": "calculator: '2**8': not an integer expression"}),
    )
    native = tool_engine(tokenizer, [CALL, "#### 1776"]).generate([prompt_ids(tokenizer)], Sampling())[0]
    engine = agent_engine(tokenizer, ScriptedEngine(tokenizer, [CALL, "#### 1776"]), solve)
    try:
        (sample,) = engine.generate([prompt_ids(tokenizer)], Sampling())
    finally:
        engine.endpoint.close()
    assert (sample.prompt_ids, sample.completion_ids, sample.tool_mask) == (
        native.prompt_ids,
        native.completion_ids,
        native.tool_mask,
    )


def test_the_endpoint_queues_every_agent_of_a_rollout_connecting_at_once():
    """While its threads are busy, 64 agents connect at once: all are queued (socketserver's default backlog of 5,
    the control, drops the seventh connection's handshake)."""
    import socket
    from http.server import BaseHTTPRequestHandler

    from grpo.episodes.agent_endpoint import EndpointServer

    server = EndpointServer(
        ("127.0.0.1", 0), BaseHTTPRequestHandler
    )  # not serving: every connection waits in the queue
    try:
        connections = [socket.create_connection(server.server_address, timeout=2) for _ in range(64)]
        for connection in connections:
            connection.close()
    finally:
        server.server_close()
