"""The embedded tool-use task: the calculator, the chat template, the trained tokenizer and its several token
sequences per number, the episode text (no model is built here: see ``python -m grpo.tasks.tiny_tools``)."""

import random
import re

import pytest
from transformers.utils import get_json_schema

from grpo.tasks.rewards import extract_answer, gsm8k_exact_answer_reward
from grpo.tasks.tiny_tools import (
    CHAT_TEMPLATE,
    TOOLS,
    build_tool_tokenizer,
    make_tool_problems,
    prompt_messages,
    render,
    tool_conversation,
)
from grpo.tasks.tool_functions import calculator


@pytest.fixture(scope="module")
def tokenizer():
    """The task's tokenizer trained on 300 conversations (well under a second)."""
    rng = random.Random(0)
    conversations = [tool_conversation(p, call_tool=rng.random() < 0.5) for p in make_tool_problems(300, seed=0)]
    return build_tool_tokenizer(render(conversations))


@pytest.mark.parametrize(
    "expression, expected",
    [("37*48", "1776"), ("12 * 99", "1188"), ("(2+3)*-4", "-20"), ("7-10", "-3"), ("((5))", "5"), ("+3", "3")],
)
def test_calculator_evaluates_integer_arithmetic(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression",
    ["2**3", "7/2", "7//2", "1.5*2", "True+1", "x*2", "__import__('os')", "abs(-1)", "[1][0]", "", "1 +", "9" * 80],
)
def test_calculator_refuses_anything_else_naming_it(expression):
    with pytest.raises(ValueError, match=re.escape(repr(expression))):
        calculator(expression)


def test_calculator_refuses_long_text_and_non_strings():
    with pytest.raises(ValueError, match="longer than 256 characters"):
        calculator("1+" * 200 + "1")
    with pytest.raises(ValueError, match="42 is not a string"):
        calculator(42)


def test_calculator_has_a_json_schema():
    schema = get_json_schema(calculator)
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "calculator" and function["description"]
    assert function["parameters"]["required"] == ["expression"]
    assert function["parameters"]["properties"]["expression"]["type"] == "string"


def test_a_tool_episode_is_rendered_as_qwen3_renders_it():
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "6*7"}}}
    messages = [
        {"role": "user", "content": "Jo has 6 bags of 7 pens. How many pens?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "#### 42"},
    ]
    (text,) = render([messages])
    tools = '{"type": "function", "function": {"name": "calculator", "description": "Evaluate an integer arithmetic ' \
        'expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string", ' \
        '"description": "integers with + - * and parentheses"}}, "required": ["expression"]}, "return": ' \
        '{"type": "string"}}}'  # fmt: skip
    assert text == (
        "<|im_start|>system\nYou may call these functions:\n<tools>\n" + tools + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nJo has 6 bags of 7 pens. How many pens?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "6*7"}}\n'
        "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n#### 42<|im_end|>\n"
    )
    # Arguments as a JSON string render the same; a system message comes before the tool list, as in Qwen3.
    string_call = {"type": "function", "function": {"name": "calculator", "arguments": '{"expression": "6*7"}'}}
    assert render([[messages[0], {**messages[1], "tool_calls": [string_call]}, *messages[2:]]]) == [text]
    (with_system,) = render([[{"role": "system", "content": "Be brief."}, *messages]])
    assert with_system == text.replace("<|im_start|>system\n", "<|im_start|>system\nBe brief.\n\n", 1)


def test_consecutive_tool_messages_share_one_user_turn_and_content_comes_before_calls():
    calls = [{"function": {"name": "calculator", "arguments": {"expression": e}}} for e in ("1+1", "2*3")]
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "Two calls.", "tool_calls": calls},
        {"role": "tool", "content": "2"},
        {"role": "tool", "content": "6"},
    ]
    from transformers.utils.chat_template_utils import render_jinja_template

    (text,), _ = render_jinja_template([messages], chat_template=CHAT_TEMPLATE, add_generation_prompt=True)
    assert text == (
        "<|im_start|>user\nq<|im_end|>\n"
        '<|im_start|>assistant\nTwo calls.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
        "<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n6\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_problems_are_deterministic_products_of_two_digit_numbers():
    problems = make_tool_problems(300, seed=1)
    assert problems == make_tool_problems(300, seed=1) and problems != make_tool_problems(300, seed=2)
    for problem in problems:
        assert set(problem) == {"question", "answer"}
        expression, result = problem["answer"].split("\n")[0].split("=")
        a, b = map(int, expression.split("*"))
        assert 12 <= a <= 99 and 12 <= b <= 99 and a * b == int(result) == int(extract_answer(problem["answer"]))
        assert re.findall(r"\d+", problem["question"]) == [str(a), str(b)]
    assert gsm8k_exact_answer_reward(["#### 1776", "#### 1777"], answer=["37*48=1776\n#### 1776"] * 2) == [1.0, 0.0]


def test_tokenizer_round_trips_and_keeps_the_tool_tokens(tokenizer):
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.padding_side) == ("<|im_end|>", "<|endoftext|>", "left")
    assert tokenizer.chat_template == CHAT_TEMPLATE
    rng = random.Random(1)
    texts = render([tool_conversation(p, call_tool=rng.random() < 0.5) for p in make_tool_problems(50, seed=9)])
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        assert tokenizer.decode(ids) == text
    (episode,) = render([tool_conversation(make_tool_problems(1, seed=3)[0], call_tool=True)])
    ids = tokenizer(episode, add_special_tokens=False).input_ids
    for token in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"):
        assert tokenizer.convert_tokens_to_ids(token) in ids  # one token each, never split
    kept = tokenizer.decode(ids, skip_special_tokens=True)
    assert "<tool_call>" in kept and "<tool_response>" in kept and "<|im_end|>" not in kept


def test_a_turn_never_shares_a_token_with_its_header(tokenizer):
    """Prompt ids + completion ids are the ids of prompt + completion: what the warm-up trained on is what a
    rollout appends (the tokenizer keeps each line's newline at its end)."""
    problem = make_tool_problems(1, seed=4)[0]
    (prompt,) = render([prompt_messages(problem["question"])], add_generation_prompt=True)
    (whole,) = render([tool_conversation(problem, call_tool=False)])
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    assert encode(whole) == encode(prompt) + encode(whole[len(prompt) :])


def test_assistant_mask_is_what_the_assistant_writes(tokenizer):
    conversation = tool_conversation(make_tool_problems(1, seed=6)[0], call_tool=True)
    out = tokenizer.apply_chat_template(
        [conversation], tools=TOOLS, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    ids, mask = out["input_ids"][0], out["assistant_masks"][0]
    written = tokenizer.decode([i for i, m in zip(ids, mask) if m])
    turns = render([conversation])[0].split("<|im_start|>assistant\n")[2:]
    call = render([conversation[:2]])[0].split("<|im_start|>assistant\n")[-1]
    assert written == call.removesuffix("\n") + turns[-1].removesuffix("\n")


def test_a_number_has_several_token_sequences(tokenizer):
    """Digit runs merge, so the same text has more than one tokenization: a sampled sequence that is not the
    canonical one re-tokenizes to other ids (the drift the project measures)."""
    merged = [t for t in tokenizer.get_vocab() if t.isascii() and t.isdigit() and len(t) >= 2]
    assert len(merged) > 50  # all two-digit factors are single tokens
    canonical = tokenizer("#### 1776", add_special_tokens=False).input_ids
    assert len(canonical) < len("#### 1776")
    digits = tokenizer("#### ", add_special_tokens=False).input_ids + tokenizer.convert_tokens_to_ids(list("1776"))
    assert digits != canonical and tokenizer.decode(digits) == tokenizer.decode(canonical) == "#### 1776"
    assert tokenizer(tokenizer.decode(digits), add_special_tokens=False).input_ids == canonical
