"""The chat template of a tool-using run: TRL's shipped Qwen3 template (not prefix-preserving) swapped for its
training template as TRL's GRPOTrainer does, a template with no training version refused at start-up, and the
template's keyword arguments (`data.chat_template_kwargs`) the same for the prompt and every tool response. On the
embedded tool model's tokenizer with Qwen3's thinking tokens added (its ids unchanged)."""

import json
import shutil
from pathlib import Path

import pytest
import trl
from recipe_runs import launch
from transformers import AutoModelForCausalLM, AutoTokenizer

from grpo.config import ConfigError, load_config
from grpo.data import tokenize_prompts
from grpo.episodes.formats import Renderer
from grpo.episodes.loop import ToolEngine
from grpo.episodes.parsers import make_parser
from grpo.episodes.templates import use_prefix_preserving_template
from grpo.episodes.tools import ToolCaller, load_tools
from grpo.tasks.tiny_tools import _warm_up, make_tool_problems, tool_conversation
from grpo.tasks.tool_functions import calculator

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_TOOL_MODEL = ROOT / "models" / "tiny-qwen3-tools"
TRL_TEMPLATES = Path(trl.__file__).parent / "chat_templates"
THINK_TOKENS = ["<think>", "</think>"]  # Qwen3's, added (not special) as Qwen3's tokenizer has them
WARM_UP_STEPS = 24
TOOL_RESULT = [{"role": "tool", "name": "calculator", "content": "1776"}]
QWEN3_PYTHON_CONFIG = ROOT / "recipes" / "configs" / "qwen3_4b_gsm8k_python.yaml"


def with_qwen3_template(tokenizer):
    """``tokenizer`` with TRL's shipped Qwen3 template and Qwen3's thinking tokens appended after its own ids."""
    from tokenizers import AddedToken

    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in THINK_TOKENS])
    tokenizer.chat_template = (TRL_TEMPLATES / "qwen3.jinja").read_text()
    return tokenizer


@pytest.fixture
def qwen3_tokenizer():
    return with_qwen3_template(AutoTokenizer.from_pretrained(SHIPPED_TOOL_MODEL))


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


def test_trls_qwen3_template_is_swapped_for_its_training_template_and_the_tool_suffix_follows(qwen3_tokenizer):
    kwargs = {"enable_thinking": False}
    with pytest.raises(ValueError, match="does not follow its assistant turn"):  # the shipped template, as is
        Renderer(qwen3_tokenizer, [calculator], kwargs).tool_suffix_ids(TOOL_RESULT)
    use_prefix_preserving_template(qwen3_tokenizer, [calculator], kwargs, "qwen3")
    assert qwen3_tokenizer.chat_template == (TRL_TEMPLATES / "qwen3_training.jinja").read_text()
    suffix = Renderer(qwen3_tokenizer, [calculator], kwargs).tool_suffix_ids(TOOL_RESULT)
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "37*48"}}}
    messages = [{"role": "user", "content": "37*48?"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    full = qwen3_tokenizer.apply_chat_template(
        messages + TOOL_RESULT, tools=[calculator], add_generation_prompt=True, tokenize=False, **kwargs
    )
    assert encode(qwen3_tokenizer, full)[-len(suffix) :] == suffix  # the tail of the whole conversation's render
    assert qwen3_tokenizer.decode(suffix).startswith("\n<|im_start|>user\n<tool_response>\n1776\n</tool_response>")


def test_a_template_with_no_training_version_is_refused_in_one_line_naming_it(qwen3_tokenizer):
    qwen3_tokenizer.chat_template = "{#- a custom Qwen3 template #}\n" + qwen3_tokenizer.chat_template
    with pytest.raises(ConfigError) as refused:
        use_prefix_preserving_template(qwen3_tokenizer, [calculator], {}, "my/model")
    message = str(refused.value)
    assert "\n" not in message and "'my/model'" in message and "a custom Qwen3 template" in message
    assert "not prefix-preserving" in message and "_training.jinja" in message
    embedded = AutoTokenizer.from_pretrained(SHIPPED_TOOL_MODEL)  # control: prefix-preserving, kept as it is
    template = embedded.chat_template
    use_prefix_preserving_template(embedded, [calculator], {}, "embedded")
    assert embedded.chat_template == template


@pytest.mark.parametrize("thinking", [False, True])
def test_every_tool_response_ends_as_the_prompt_does(qwen3_tokenizer, thinking):
    """The prompt's ids end with the generation header the template writes for data.chat_template_kwargs (an empty
    think block with thinking off, none with it on); the tool loop's suffix ends with the very same ids."""
    cfg = load_config(
        ROOT / "recipes" / "configs" / "tiny_cpu_tools.yaml",
        [f"data.chat_template_kwargs.enable_thinking={thinking}", "data.max_prompt_length=512"],
    )
    use_prefix_preserving_template(qwen3_tokenizer, [calculator], cfg.data.chat_template_kwargs, "qwen3")
    (row,) = tokenize_prompts(cfg, qwen3_tokenizer, [{"question": "37*48?"}], tools=[calculator])
    suffix = ToolEngine(
        None, qwen3_tokenizer, [calculator], cfg, cfg.data.chat_template_kwargs
    ).renderer.tool_suffix_ids(TOOL_RESULT)
    header = encode(qwen3_tokenizer, "<|im_start|>assistant\n" + ("" if thinking else "<think>\n\n</think>\n\n"))
    assert row["prompt_ids"][-len(header) :] == header
    assert suffix[-len(header) :] == header


def test_the_qwen3_python_config_reads_and_runs_a_program_written_in_qwen3s_tool_format(qwen3_tokenizer):
    """recipes/configs/qwen3_4b_gsm8k_python.yaml's start-up on Qwen3's template (TRL's shipped one, which Qwen3-4B's
    tokenizer carries), as far as it goes without the weights: its tool loads, TRL's training template replaces
    Qwen3's, the parser is TRL's Qwen3 response template, the prompt lists the tool under the config's system prompt.
    Then a multi-line program written as Qwen3 writes a call (its arguments as JSON) is read back and run by the
    sandbox under the config's tool_calling limits, its output the call's result; a failing program's, an error
    result. The stand-in tokenizer is not Qwen3's, so the prompt's length is not held to data.max_prompt_length."""
    cfg = load_config(QWEN3_PYTHON_CONFIG, ["data.max_prompt_length=4096"])
    tools = load_tools(cfg.tools)
    assert [tool.__name__ for tool in tools] == ["python"]
    use_prefix_preserving_template(qwen3_tokenizer, tools, cfg.data.chat_template_kwargs, cfg.model.name_or_path)
    assert qwen3_tokenizer.chat_template == (TRL_TEMPLATES / "qwen3_training.jinja").read_text()
    parser = make_parser(cfg.tool_calling.parser, qwen3_tokenizer, tools)
    assert parser.name == "trl"
    question = "Janet's ducks lay 16 eggs a day. She eats 3 and bakes with 4, and sells the rest at $2. How much?"
    (row,) = tokenize_prompts(cfg, qwen3_tokenizer, [{"question": question}], tools=tools)
    assert cfg.data.system_prompt in row["prompt"] and '"name": "python"' in row["prompt"] and question in row["prompt"]

    code = "eggs = 16 - 3 - 4\nprint(eggs * 2)"
    call = json.dumps({"name": "python", "arguments": {"code": code}})  # the template's own rendering of a call
    turn = encode(qwen3_tokenizer, f"<tool_call>\n{call}\n</tool_call><|im_end|>")
    calls = parser.calls(turn, history_ids=row["prompt_ids"])
    assert calls == [{"name": "python", "arguments": {"code": code}}]
    caller = ToolCaller({"python": tools[0]}, cfg.tool_calling.timeout_s, cfg.tool_calling.max_output_chars)
    assert caller.run(calls) == [("python", "18\n", False)]
    [(_, result, failed)] = caller.run([{"name": "python", "arguments": {"code": "print(16 // 0)"}}])
    assert failed and "ZeroDivisionError" in result  # a program that fails is the model's error result


def qwen3_templated_model(out_dir: Path) -> str:
    """The shipped embedded tool model with TRL's Qwen3 template and thinking tokens. Its embedding (tied) grows by
    rows for the new ids (transformers' mean initialisation), every id it had keeps its row; a short warm-up on tool
    conversations rendered by Qwen3's training template teaches it that template's longer tool preamble (without it
    the model writes no well-formed call)."""
    shutil.copytree(SHIPPED_TOOL_MODEL, out_dir)
    tokenizer = with_qwen3_template(AutoTokenizer.from_pretrained(out_dir))
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype="float32")
    rows = model.get_input_embeddings().weight.detach().clone()
    model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=64)
    assert model.get_input_embeddings().weight[: len(rows)].equal(rows)
    shipped = tokenizer.chat_template
    use_prefix_preserving_template(tokenizer, [calculator], {}, "qwen3")  # has the assistant masks' markers
    conversations = [tool_conversation(p, call_tool=True) for p in make_tool_problems(WARM_UP_STEPS * 16, seed=11)]
    _warm_up(model, tokenizer, conversations, steps=WARM_UP_STEPS, batch_size=16, lr=2e-3)
    tokenizer.chat_template = shipped  # the recipe swaps it at start-up
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return str(out_dir)


def test_the_tool_task_trains_with_trls_qwen3_template(tmp_path):
    """The embedded tool task with TRL's Qwen3 template on its tokenizer (swapped for the training template at
    start-up): each turn's engine log-probs equal the trainer's, the on-policy ratio is exactly 1."""
    model = qwen3_templated_model(tmp_path / "model")
    proc, metrics = launch(
        tmp_path / "runs",
        model,
        "max_steps=4",
        "max_completion_length=48",
        "data.max_prompt_length=200",
        config="tiny_cpu_tools.yaml",
    )
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "TRL's training template replaces it" in proc.stderr
    assert len(metrics) == 2, proc.stderr[-3000:]
    for m in metrics:
        assert m["tools/call_frequency"] > 0 and m["model_tokens_turn2"] > 0, m  # episodes went on after a tool
        assert m["rollout_logprob_diff_turn1"] <= 1e-6 and m["rollout_logprob_diff_turn2"] <= 1e-6, m
        assert m["ratio_onpolicy_maxdev"] == 0, m
