"""Tool calls in a model family's own format: a conformance matrix over TRL's shipped chat templates, each on a small
BPE trained here with the family's special tokens (no hub). Per family: (a) the template is prefix-preserving, or its
`*_training` template is put in its place; (b) the tool-suffix ids are the tail of the full render; (c) vLLM's tool
parser and TRL's response template read the same calls from the sampled ids (single, parallel, malformed,
budget-cut, inside-<think>); (d) an episode holds exactly the sampled ids."""

import functools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import trl
from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

from grpo.config import ToolCallingSettings
from grpo.episodes.parsers import FAMILIES, TrlParser, VllmParser, make_parser, reasoning_stripped

TEMPLATES = Path(trl.__file__).parent / "chat_templates"
QWEN = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", ["<tool_call>", "</tool_call>", "<think>"])
QWEN = (*QWEN[:2], QWEN[2] + ["</think>", "<tool_response>", "</tool_response>"])
LLAMA = ["<|end_of_text|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
GLM = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_TAGS = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<think>",
    "</think>",
]
GEMMA = ["<pad>", "<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", "<|tool_response>"]
GEMMA += ["<tool_response|>", "<|tool>", "<tool|>", "<|channel>", "<channel|>", "<|think|>", '<|"|>']
GPTOSS = ["<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"]
LFM = ["<|endoftext|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>"]
# family: (special tokens, the first the pad; the token that ends a tool-calling turn, as eos; added, not special)
MATRIX = {
    "qwen2_5": QWEN,
    "qwen3": QWEN,
    "qwen3_5_think": QWEN,
    "qwen3_5_nothink": QWEN,
    "qwen3_6": QWEN,
    "nemotron_3_nano": QWEN,
    "llama3_1": (LLAMA + ["<|python_tag|>"], "<|eot_id|>", []),
    "glm4moe": (GLM, "<|observation|>", GLM_TAGS),
    "lfm2_2_5": (LFM, "<|im_end|>", ["<think>", "</think>"]),
    "gemma4": (GEMMA, "<|tool_response>", []),
    "gptoss": (GPTOSS, "<|call|>", []),
}
CORPUS = [
    "What is 3 times 4? The answer is 12.",
    '{"name": "multiply", "arguments": {"a": 3, "b": 4}}',
    "multiply(a=3, b=4) parameter function arguments",
    "user assistant system tool think I could call it",
]


def multiply(a: int, b: int) -> str:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return str(a * b)


@functools.cache
def family_tokenizer(family: str):
    """A byte-level BPE trained on a few lines, with the family's special tokens, and the family's chat template
    (its training template where the shipped one is not prefix-preserving)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials, stop, added = MATRIX[family]
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 8, trainer=trainer)
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in added])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=stop, pad_token=specials[0])
    tokenizer.chat_template = (TEMPLATES / f"{family}.jinja").read_text()
    if not is_chat_template_prefix_preserving(tokenizer):
        tokenizer.chat_template = get_training_chat_template(tokenizer)
    return tokenizer


def call(a: int, b: int) -> dict:
    return {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=[multiply], add_generation_prompt=generation_prompt, tokenize=False
    )


QUESTION = [{"role": "user", "content": "What is 3 times 4?"}]


@functools.cache
def history_and_turn(family: str, factors: tuple) -> tuple[str, str]:
    """(the history the model is given, the turn it samples) for an assistant turn calling multiply on each pair of
    ``factors``: the template's own rendering of that turn, through the token that ends it."""
    calls = [call(a, b) for a, b in factors]
    tokenizer = family_tokenizer(family)
    prompt = render(tokenizer, QUESTION, True)
    full = render(tokenizer, QUESTION + [{"role": "assistant", "content": "", "tool_calls": calls}], False)
    history = os.path.commonprefix([prompt, full])
    turn, stop = full[len(history) :], tokenizer.eos_token
    return history, (turn[: turn.index(stop) + len(stop)] if stop in turn else turn + stop)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def sampled_ids(tokenizer, text: str) -> list[int]:
    """``text`` as a model may sample it: in other ids than its canonical tokenization where it can (each piece
    between special tokens tokenized in two halves), decoding to the same text."""
    ids = []
    for piece in text.split(tokenizer.eos_token):
        half = len(piece) // 2
        ids += encode(tokenizer, piece[:half]) + encode(tokenizer, piece[half:]) + [tokenizer.eos_token_id]
    return ids[:-1]


def case(family: str, name: str) -> tuple[list[int], list[int], list]:
    """(history ids, sampled turn ids, the calls a parser must read: dicts, or "malformed") of a matrix case."""
    tokenizer = family_tokenizer(family)
    history, single = history_and_turn(family, ((3, 4),))
    expected_single = [{"name": "multiply", "arguments": {"a": 3, "b": 4}}]
    opener = FAMILIES[family].opener
    if name == "single":
        turn, expected = single, expected_single
    elif name == "parallel":
        history, turn = history_and_turn(family, ((3, 4), (5, 6)))
        expected = expected_single + [{"name": "multiply", "arguments": {"a": 5, "b": 6}}]
    elif name == "malformed":  # the turn ends inside its call
        body = single[single.index(opener) :]
        turn = single[: single.index(opener)] + body[: len(body) // 2] + tokenizer.eos_token
        expected = ["malformed"]
    elif name == "budget_cut":  # cut inside the call by the length budget: no end-of-turn token
        ids = sampled_ids(tokenizer, single)
        return encode(tokenizer, history), ids[: len(ids) // 2], ["malformed"]
    else:  # a call written inside the reasoning is no call
        body = single[single.index(opener) : single.rindex(tokenizer.eos_token)].rstrip()
        opened = "" if history.rstrip().endswith("<think>") else "<think>\n"
        turn, expected = f"{opened}I could call {body}\n</think>\n\nThe answer is 12.{tokenizer.eos_token}", []
    return encode(tokenizer, history), sampled_ids(tokenizer, turn), expected


def readable(calls: list) -> list:
    return [c if isinstance(c, dict) else "malformed" for c in calls]


PARSED = [f for f in MATRIX if FAMILIES[f].vllm_parser]
THINKING = [f for f in MATRIX if "<think>" in (TEMPLATES / f"{f}.jinja").read_text()]
ONE_CALL_A_TURN = ("llama3_1", "gptoss")  # their templates render (or accept) one call per assistant turn
CASES = [(f, c) for f in MATRIX for c in ("single", "parallel", "malformed", "budget_cut")]
CASES = [(f, c) for f, c in CASES if not (c == "parallel" and f in ONE_CALL_A_TURN)]
CASES += [(f, "inside_think") for f in THINKING]


def test_the_matrix_spans_ten_families_with_both_parsers():
    assert len(PARSED) >= 10 and all(FAMILIES[f].trl_template for f in MATRIX)


@pytest.mark.parametrize("family", MATRIX)
def test_the_template_is_prefix_preserving_and_the_tool_suffix_is_the_tail_of_the_full_render(family):
    from grpo.episodes.formats import Renderer

    tokenizer = family_tokenizer(family)
    assert is_chat_template_prefix_preserving(tokenizer)  # (a) as shipped, or its training template
    tool = [{"role": "tool", "name": "multiply", "content": "12"}]
    full = QUESTION + [{"role": "assistant", "content": "", "tool_calls": [call(3, 4)]}] + tool
    suffix = Renderer(tokenizer, [multiply]).tool_suffix_ids(tool)
    assert suffix and encode(tokenizer, render(tokenizer, full, True))[-len(suffix) :] == suffix  # (b)
    assert "12" in tokenizer.decode(suffix)


@pytest.mark.parametrize(("family", "name"), CASES)
def test_vllm_and_trl_read_the_same_calls_from_the_sampled_ids(family, name):
    tokenizer = family_tokenizer(family)
    history, turn, expected = case(family, name)
    trl_calls = readable(TrlParser(tokenizer, [multiply], family).calls(turn, history))
    assert trl_calls == expected, (family, name, tokenizer.decode(turn))
    if FAMILIES[family].vllm_parser:
        vllm = VllmParser(FAMILIES[family].vllm_parser, tokenizer, [multiply], FAMILIES[family])
        assert readable(vllm.calls(turn, history)) == trl_calls  # (c)


def test_auto_picks_the_family_parser_and_the_hand_parser_stays_for_the_embedded_template():
    from grpo.tasks.tiny_tools import build_tool_tokenizer

    assert make_parser("auto", family_tokenizer("qwen3"), [multiply]).name == "trl"
    assert make_parser("hermes", family_tokenizer("qwen3"), [multiply]).name == "hermes"
    assert make_parser("auto", build_tool_tokenizer(CORPUS), [multiply]).name == "regex"
    assert reasoning_stripped("<think>a <tool_call>") == "" and reasoning_stripped("x</think>y") == "y"


class ScriptedTurns:
    """Answers an episode's k-th request with ``turns[k]`` (ids), cut at the request's max_tokens."""

    def __init__(self, turns: list[list[int]]):
        self.turns, self.sent = turns, 0

    def generate(self, prompt_ids, sampling, use_tqdm=False):
        from grpo.engines.interface import Sample

        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_ids)
        samples = []
        for index, (ids, params) in enumerate(zip(prompt_ids, per_prompt)):
            turn = self.turns[min(self.sent, len(self.turns) - 1)]
            out = turn[: params.max_tokens]
            samples += [Sample(list(ids), out, "", [-0.5] * len(out), len(out) < len(turn), index)] * params.n
        self.sent += 1
        return samples


@pytest.mark.parametrize("family", MATRIX)
def test_an_episode_holds_exactly_the_sampled_ids(family):
    from grpo.episodes.loop import ToolEngine

    tokenizer = family_tokenizer(family)
    history, turn, _ = case(family, "single")
    answer = sampled_ids(tokenizer, f"The answer is 12.{tokenizer.eos_token}")
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(parser="trl"), max_tool_calling_iterations=None, max_completion_length=200
    )
    engine = ToolEngine(ScriptedTurns([turn, answer]), tokenizer, [multiply], cfg)
    (sample,) = engine.generate([history], SimpleNamespace(n=1, max_tokens=200, clone=lambda: SimpleNamespace()))
    suffix = engine.renderer.tool_suffix_ids([{"role": "tool", "name": "multiply", "content": "12"}])
    assert sample.completion_ids == turn + suffix + answer  # (d): the sampled ids, as sampled
    eos = tokenizer.eos_token_id  # the turn's stop token is not added again by the tool turn (GLM's opens it)
    assert [eos, eos] not in [sample.completion_ids[i : i + 2] for i in range(len(sample.completion_ids) - 1)]
    assert (sample.tool_calls, sample.tool_failures) == (1, 0)
    assert sample.tool_mask == [1] * len(turn) + [0] * len(suffix) + [1] * len(answer)


def episode_ids(tokenizer, history: list[int], turn: list[int], turns: int) -> list[int]:
    """The ids of an episode ``turns`` turns in: ``history``, then ``turn`` and the tool's result, ``turns`` times."""
    from grpo.episodes.formats import Renderer

    suffix = Renderer(tokenizer, [multiply]).tool_suffix_ids([{"role": "tool", "name": "multiply", "content": "12"}])
    return history + (turn + suffix) * turns


@pytest.mark.parametrize("family", MATRIX)
def test_the_trl_parser_reads_of_a_long_history_what_parse_response_reads_of_all_of_it(family):
    from transformers.utils.chat_parsing.response_templates import load_response_template

    tokenizer = family_tokenizer(family)
    history, turn, expected = case(family, "single")
    parser = TrlParser(tokenizer, [multiply], family)
    template = load_response_template(tokenizer.response_template)
    long = episode_ids(tokenizer, history, turn, 30)
    # every cut of the last 80 ids: windows and anchors cut anywhere; and no anchor at all
    for ids in [long[:end] for end in range(len(long) - 80, len(long) + 1)] + [history[:3], []]:
        whole = template.truncate_past_last_anchor(tokenizer.decode(ids))
        assert template.truncate_past_last_anchor(parser.prefix_text(ids)) == whole, (family, len(ids))
    full = tokenizer.parse_response(turn, prefix=long, tools=[multiply])
    assert tokenizer.parse_response(turn, prefix=parser.prefix_text(long), tools=[multiply]) == full
    assert readable(parser.calls(turn, long)) == expected


def test_a_late_turn_of_a_long_episode_is_parsed_from_as_many_decoded_ids_as_an_early_one(monkeypatch):
    from grpo.episodes.loop import ToolEngine

    tokenizer = family_tokenizer("qwen3")
    history, turn, _ = case("qwen3", "single")
    cfg = SimpleNamespace(
        tool_calling=ToolCallingSettings(parser="auto"), max_tool_calling_iterations=99, max_completion_length=10**6
    )
    engine = ToolEngine(ScriptedTurns([turn]), tokenizer, [multiply], cfg)
    assert engine.parser.name == "trl"
    decoded, per_parse = [0], []
    decode = tokenizer.decode

    def counting_decode(ids, *args, **kwargs):
        decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    def counting_calls(turn_ids, history_ids, calls=engine.parser.calls):
        before = decoded[0]
        found = calls(turn_ids, history_ids)
        per_parse.append(decoded[0] - before)
        return found

    monkeypatch.setattr(tokenizer, "decode", counting_decode)
    monkeypatch.setattr(engine.parser, "calls", counting_calls)
    (sample,) = engine.generate([history], SimpleNamespace(n=1, max_tokens=200, clone=lambda: SimpleNamespace()))
    assert sample.tool_calls == 99 and sample.completion_ids == episode_ids(tokenizer, [], turn, 99) + turn  # 100 turns
    assert len(per_parse) == 100 and per_parse[89] == per_parse[9], per_parse[9::10]


def test_an_episode_extends_its_policy_versions_in_place():
    from grpo.engines.interface import Sample
    from grpo.episodes.loop import Episode

    episode = Episode([1, 2], 0)
    episode.add_turn(Sample([1, 2], [5, 6], "", [-1.0, -1.0], False, 0, versions=[3, 3]), [], True)
    versions = episode.versions
    for version in range(4, 40):
        episode.add_tool_tokens([7])
        episode.add_turn(Sample([1, 2], [5], "", [-1.0], False, 0, versions=[version]), [], True)
    assert episode.versions is versions  # one list, extended: no copy of the episode's versions per turn
    assert versions[:4] == [3, 3, 3, 4] and len(versions) == 2 + 2 * 36 == len(episode.completion_ids)
