"""The embedded default: generated problems, the exact-answer reward, the local tokenizer, the cached build."""

import json
import re

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.tasks.rewards import extract_answer, gsm8k_exact_answer_reward
from grpo.tasks.tiny_gsm8k import build_tiny_model, build_tokenizer, make_problems, with_slips


def test_problems_are_deterministic_per_seed():
    assert make_problems(50, seed=1) == make_problems(50, seed=1)
    assert make_problems(50, seed=1) != make_problems(50, seed=2)
    assert set(make_problems(1, seed=0)[0]) == {"question", "answer"}  # openai/gsm8k's columns


def test_answers_are_correct_arithmetic():
    for problem in make_problems(500, seed=3):
        lines = problem["answer"].split("\n")
        value = None
        for line in lines[:-1]:
            expression, result = line.split("=")
            assert eval(expression) == int(result), line  # noqa: S307 (digits and + - * only)
            value = int(result)
        assert re.fullmatch(r"#### -?\d+", lines[-1]) and int(extract_answer(problem["answer"])) == value


def test_slips_restate_the_result_plus_one_on_a_majority_of_answers():
    """The warm-up's habit: greedy decoding follows a majority, so a slip rate above 0.5 makes greedy answers wrong."""
    problems = make_problems(2000, seed=4)
    slipped = with_slips(problems, slip_rate=0.6, seed=5)
    offsets = [int(extract_answer(s["answer"])) - int(extract_answer(p["answer"])) for p, s in zip(problems, slipped)]
    assert set(offsets) == {0, 1} and 0.57 < offsets.count(1) / len(offsets) < 0.63
    for p, s in zip(problems, slipped):  # the working is kept; only the final line changes
        assert s["question"] == p["question"] and s["answer"].split("\n")[:-1] == p["answer"].split("\n")[:-1]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2+3=5\n#### 5", "5"),
        ("#### 1,234", "1234"),
        ("#### 3 then #### 4", "4"),
        ("no answer", None),
        ("####-7", "-7"),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_reward_plain_and_chat_completions():
    answers = ["1+1=2\n#### 2"] * 3
    assert gsm8k_exact_answer_reward(["x\n#### 2", "#### 3", "2"], answer=answers) == [1.0, 0.0, 0.0]
    chat = [[{"role": "assistant", "content": "#### 2"}], [{"role": "assistant", "content": "#### 20"}]]
    assert gsm8k_exact_answer_reward(chat, answer=answers[:2], prompts=["p", "p"]) == [1.0, 0.0]


def test_tokenizer_is_character_level_and_round_trips():
    tokenizer = build_tokenizer()
    text = "Q: Ava has 12 pens.\nA: 7+5=12\n#### 12"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == len(text)
    assert tokenizer.decode(ids) == text
    digit_ids = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]
    assert len(set(digit_ids)) == 10 and tokenizer.unk_token_id not in digit_ids
    assert tokenizer.pad_token_id != tokenizer.eos_token_id


def test_build_is_cached_and_loadable(tmp_path):
    out = tmp_path / "model"
    build_tiny_model(out, warmup_steps=3, batch_size=4)
    info = json.loads((out / "build_info.json").read_text())
    assert info["args"]["warmup_steps"] == 3 and info["parameters"] > 100_000
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    build_tiny_model(out, warmup_steps=3, batch_size=4)  # same arguments: reused, not rebuilt
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp
    assert not (tmp_path / "model.tmp").exists()
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.config.model_type == "qwen3" and model.config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.decode(tokenizer("#### 42", add_special_tokens=False).input_ids) == "#### 42"
    build_tiny_model(out, warmup_steps=4, batch_size=4)  # other arguments: rebuilt
    assert json.loads((out / "build_info.json").read_text())["args"]["warmup_steps"] == 4
