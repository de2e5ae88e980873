"""The embedded tool-use task: products the model cannot compute, a calculator it can call, and a small Qwen3.

A second embedded model beside ``grpo.tasks.tiny_gsm8k``'s, for multi-turn rollouts. Each problem asks for the product
of two two-digit numbers ("Ava buys 37 boxes of 48 pens. How many pens?", 1776), which a model of about a million
parameters cannot work out in its head, and the chat lists one tool, ``grpo.tasks.tool_functions.calculator``. The chat
is Qwen3's conversation and tool format without thinking blocks (``CHAT_TEMPLATE``), and the tokenizer a byte-level
BPE trained here on the task's own conversations: its digit runs merge, so one number has several token sequences
and re-tokenizing sampled text does not always give back the sampled ids. The supervised warm-up teaches both
ways of answering. Its first ``tool_only_steps`` steps show only tool calls: the call's format and the copying of
numbers (into the call, then from the tool's result into ``#### <result>``) take about 5,000 such conversations
alone, and more than three times as many when mixed with direct answers, whose products are guesses. The rest mixes: a
``tool_rate`` share (0.4) call the calculator on ``a*b``, the others answer ``#### <product>`` at once, which the
model can only guess. Sampled, the policy then calls the tool on about a third of the problems and is then mostly
right, and otherwise almost always wrong; greedy decoding follows the majority and answers at once, wrongly. GRPO,
rewarded for exact answers, has to learn to call the tool. Everything is deterministic from a seed and cached on disk.

    python -m grpo.tasks.tiny_tools --out cache/tiny-qwen3-tools --seed 0

The problems have ``openai/gsm8k``'s columns (``question``, and ``answer`` = reasoning + ``#### <int>``), so
``grpo.tasks.rewards.gsm8k_exact_answer_reward`` scores an episode's last turn.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch

from grpo.engines.interface import Sample
from grpo.tasks.rewards import gsm8k_exact_answer_reward
from grpo.tasks.tiny_gsm8k import NAMES, OBJECTS, PREFIX_STEPS, all_cores, cached_build, new_model, prefix_record
from grpo.tasks.tool_functions import calculator

TOOLS = [calculator]
QUESTIONS = [
    "{name} buys {a} boxes of {b} {obj}. How many {obj}?",
    "{name} has {a} bags of {b} {obj}. How many {obj} in all?",
    "{name} stacks {a} rows of {b} {obj}. How many {obj}?",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # pad, turn start, turn end (eos), as Qwen3's
# Added tokens that are not special, as in Qwen3: decode(skip_special_tokens=True) keeps them.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOKENIZER_TEXTS = 4000  # conversations the tokenizer is trained on

# Qwen3's chat template without its thinking blocks: the same turns, tool list, tool calls and tool responses, with a
# one-sentence tool preamble (the tiny model's prompts stay short) and {% generation %} around what the assistant
# writes, <|im_end|> included, for assistant-only losses (return_assistant_tokens_mask).
CHAT_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- 'You may call these functions:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\\n</tools><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
        {{- content }}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


# ----------------------------------------------------------------------------- data
def _problem(rng: random.Random) -> dict:
    name, obj = rng.choice(NAMES), rng.choice(OBJECTS)
    a, b = rng.randint(12, 99), rng.randint(12, 99)
    question = rng.choice(QUESTIONS).format(name=name, a=a, b=b, obj=obj)
    return {"question": question, "answer": f"{a}*{b}={a * b}\n#### {a * b}"}


def make_tool_problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` GSM8K-style products of two numbers in 12..99 (columns ``question``, ``answer``), deterministic in
    ``seed``; the answer's first line is the expression to compute, ``a*b=<product>``."""
    rng = random.Random(seed)
    return [_problem(rng) for _ in range(n)]


def prompt_messages(question: str) -> list[dict]:
    """The chat a problem is posed in (the tools are passed beside it: ``tools=TOOLS``)."""
    return [{"role": "user", "content": question}]


def tool_conversation(problem: dict, call_tool: bool) -> list[dict]:
    """A complete warm-up conversation for ``problem``: a calculator call on its expression, the tool's result and
    ``#### <result>``; or, without the tool, ``#### <product>`` at once."""
    expression = problem["answer"].split("\n")[0].split("=")[0]
    result = calculator(expression)
    if not call_tool:
        return [*prompt_messages(problem["question"]), {"role": "assistant", "content": f"#### {result}"}]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": expression}}}
    return [
        *prompt_messages(problem["question"]),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": f"#### {result}"},
    ]


def render(conversations: list[list[dict]], add_generation_prompt: bool = False, tools: list = TOOLS) -> list[str]:
    """``conversations`` rendered by ``CHAT_TEMPLATE`` with ``tools`` listed (the calculator; no tokenizer needed)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    texts, _ = render_jinja_template(
        conversations, tools=tools, chat_template=CHAT_TEMPLATE, add_generation_prompt=add_generation_prompt
    )
    return texts


# ----------------------------------------------------------------------------- tokenizer
# The pre-tokenizer's pieces: a run of digits, text up to and including a newline, other text.
TOOL_PIECES = r"\d+|[^\d\n]*\n|[^\d\n]+"


def build_tool_tokenizer(texts: list[str], vocab_size: int = 768, pieces: str = TOOL_PIECES):
    """A byte-level BPE of ``vocab_size`` tokens trained on ``texts``, with Qwen3's special and tool tokens.

    Unlike Qwen's pre-tokenizer, which splits numbers into single digits, this one lets a run of digits merge (so
    "1776" is "17" "76", and "1" "776" or "1" "7" "7" "6" decode to the same text), and ends a piece at each newline,
    so that a turn's header ("assistant\n") and its content never share a token. Within a line, text merges freely:
    the task's fixed text (the tool list, the call's JSON) becomes a few long tokens and a prompt is about 20 tokens.
    At 768 tokens the fixed text takes most merges and the rest make every two-digit run one token (a larger
    vocabulary merges whole products, a smaller one leaves the digits single).
    ``<|im_end|>`` is the eos, ``<|endoftext|>`` the pad; left padding, ``CHAT_TEMPLATE`` as chat template.
    ``pieces``: the pre-tokenizer's split, a regex whose matches no merge crosses (``TOOL_PIECES``).
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pieces), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(TOOL_TOKENS),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Training does not split off added tokens: the texts between them are what the merges are learned on.
    added = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS + TOOL_TOKENS))
    core.train_from_iterator((piece for text in texts for piece in added.split(text) if piece), trainer=trainer)
    core.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        chat_template=CHAT_TEMPLATE,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens=["<|im_start|>"],
        padding_side="left",
    )


# ----------------------------------------------------------------------------- episodes, for the build's figures
def _generate(model, tokenizer, rows: list[list[int]], *, greedy: bool, max_new_tokens: int) -> list[list[int]]:
    """Left-padded HF generate of ``rows``; each completion's ids up to and including its eos (when it has one)."""
    width = max(len(ids) for ids in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, ids in enumerate(rows):
        input_ids[i, width - len(ids) :] = torch.tensor(ids)
        attention_mask[i, width - len(ids) :] = 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        do_sample=not greedy,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    completions = []
    for ids in out[:, width:].tolist():
        end = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
        completions.append(ids[:end])
    return completions


@dataclass
class GenerateSampling:
    """What `grpo.episodes.loop.ToolEngine` reads of vLLM's ``SamplingParams``, for `GenerateEngine`."""

    n: int = 1
    max_tokens: int = 48
    greedy: bool = False

    def clone(self) -> GenerateSampling:
        return dataclasses.replace(self)


class GenerateEngine:
    """HF ``generate`` behind the rollout engines' ``generate`` (`grpo.engines.interface`): the build measures its
    model with the recipe's own episode loop (`grpo.episodes.loop.ToolEngine`), without vLLM."""

    def __init__(self, model, tokenizer):
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], sampling, use_tqdm: bool = False) -> list[Sample]:
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompt_ids)
        rows = [(index, ids) for index, (ids, s) in enumerate(zip(prompt_ids, per_prompt)) for _ in range(s.n)]
        longest = max(s.max_tokens for s in per_prompt)
        outs = _generate(
            self.model, self.tokenizer, [ids for _, ids in rows], greedy=per_prompt[0].greedy, max_new_tokens=longest
        )
        samples = []
        for (index, ids), out in zip(rows, outs):
            kept = out[: per_prompt[index].max_tokens]
            ended = kept[-1:] == [self.tokenizer.eos_token_id]
            samples.append(Sample(ids, kept, "", [0.0] * len(kept), not ended, index))
        return samples


def measure_tool_episodes(model, tokenizer, problems: list[dict], greedy: bool, seed: int = 0) -> dict:
    """Held-out figures of episodes run by the recipe's loop (`grpo.episodes.loop.ToolEngine`) on HF generate: tool-call
    rate, accuracy, accuracy with and without the tool, and the share of episodes whose re-rendered, re-tokenized
    conversation differs from the sampled ids."""
    from grpo.config import ToolCallingSettings
    from grpo.episodes.loop import ToolEngine

    model.eval()
    settings = SimpleNamespace(
        tool_calling=ToolCallingSettings(), max_tool_calling_iterations=2, max_completion_length=48
    )
    engine = ToolEngine(GenerateEngine(model, tokenizer), tokenizer, TOOLS, settings)
    prompts = render([prompt_messages(p["question"]) for p in problems], add_generation_prompt=True)
    torch.manual_seed(seed)
    episodes = engine.generate(tokenizer(prompts, add_special_tokens=False).input_ids, GenerateSampling(greedy=greedy))
    rewards = gsm8k_exact_answer_reward([e.text for e in episodes], [p["answer"] for p in problems])
    with_tool = [r for r, e in zip(rewards, episodes) if e.tool_calls]
    without = [r for r, e in zip(rewards, episodes) if not e.tool_calls]
    return dict(
        tool_call_rate=len(with_tool) / len(episodes),
        accuracy=sum(rewards) / len(episodes),
        accuracy_with_tool=sum(with_tool) / len(with_tool) if with_tool else None,
        accuracy_without_tool=sum(without) / len(without) if without else None,
        retokenized_differs=sum(e.retokenization_drift for e in episodes) / len(episodes),
    )


# ----------------------------------------------------------------------------- model
def _length_batches(rows: list[list[int]], steps: int, batch_size: int, window: int = 8) -> list[list[int]]:
    """``steps`` batches of row indices, each of rows of about one length: every ``window`` consecutive batches'
    rows are sorted by length, cut into batches, and those batches shuffled (deterministically). A conversation with
    a tool call is twice as long as one without: mixed in one batch, half the direct one would be padding."""
    rng = random.Random(0)  # the rows themselves come from the build's seed
    batches = []
    for start in range(0, steps * batch_size, window * batch_size):
        block = sorted(range(start, min(start + window * batch_size, steps * batch_size)), key=lambda r: len(rows[r]))
        cut = [block[k : k + batch_size] for k in range(0, len(block), batch_size)]
        rng.shuffle(cut)
        batches += cut
    return batches


def _warm_up(
    model,
    tokenizer,
    conversations: list[list[dict]],
    *,
    steps: int,
    batch_size: int,
    lr: float,
    tools: list = TOOLS,
    trained_ids: set[int] | None = None,
    prefix_only=False,
):
    """The supervised warm-up: AdamW (one-cycle schedule) on what the assistant writes in ``conversations`` (its
    content, tool calls and ``<|im_end|>``; not the system, user or tool tokens). Every token weighs the same in
    every batch (the loss is a sum over a batch divided by the mean tokens per batch), so batches of direct answers
    do not outweigh batches of tool calls. ``tools``: those the conversations list (the calculator).
    ``trained_ids``: only the assistant's tokens of these ids are trained, the rest are context (a skill taught on
    its own first). Returns the mean loss per token over the last tenth of the steps and the `prefix_record` after
    PREFIX_STEPS steps (its loss per token of that step); ``prefix_only`` stops there."""
    from tqdm.auto import tqdm

    encoded = tokenizer.apply_chat_template(
        conversations, tools=tools, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    masks = encoded["assistant_masks"]
    if trained_ids is not None:
        masks = [[m and i in trained_ids for i, m in zip(ids, row)] for ids, row in zip(encoded["input_ids"], masks)]
    batches = _length_batches(encoded["input_ids"], steps, batch_size)
    tokens_per_batch = sum(sum(masks[r]) for rows in batches for r in rows) / len(batches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(1, steps), pct_start=0.1)
    model.train()
    tail_loss, tail_tokens, prefix = 0.0, 0, None
    for step, rows in enumerate(bar := tqdm(batches, desc="warm-up tools")):
        width = max(len(encoded["input_ids"][r]) for r in rows)
        input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for i, r in enumerate(rows):
            ids, mask = torch.tensor(encoded["input_ids"][r]), torch.tensor(masks[r]).bool()
            input_ids[i, : len(ids)] = ids
            labels[i, : len(ids)] = torch.where(mask, ids, -100)
        attention_mask = (input_ids != tokenizer.pad_token_id).long()
        loss = model(
            input_ids=input_ids, attention_mask=attention_mask, labels=labels, num_items_in_batch=tokens_per_batch
        ).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        tokens = int((labels[:, 1:] != -100).sum())
        bar.set_postfix(loss=f"{loss.item() * tokens_per_batch / tokens:.3f}")
        if step >= steps - max(1, steps // 10):
            tail_loss, tail_tokens = tail_loss + loss.item() * tokens_per_batch, tail_tokens + tokens
        if step + 1 == min(PREFIX_STEPS, steps):
            prefix = prefix_record(model, step + 1, loss.item() * tokens_per_batch / tokens)
            if prefix_only:
                return None, prefix
    return tail_loss / tail_tokens, prefix


def _initial_state(args: dict):
    """The build's model before its warm-up, its tokenizer (trained on the warm-up's conversations) and those."""
    seed, batch_size = args["seed"], args["batch_size"]
    torch.manual_seed(seed)
    rng = random.Random(seed + 3)
    train = [
        tool_conversation(p, call_tool=i < args["tool_only_steps"] * batch_size or rng.random() < args["tool_rate"])
        for i, p in enumerate(make_tool_problems(args["warmup_steps"] * batch_size, seed=seed + 1))
    ]
    tokenizer = build_tool_tokenizer(render(train[:: max(1, len(train) // TOKENIZER_TEXTS)]))  # both phases
    model = new_model(
        "tiny",
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        rope_theta=10000.0,
    )
    return model, tokenizer, train


def held_out_figures(model, tokenizer, args: dict) -> dict:
    """The held-out figures a build of ``args`` records, measured on ``model``."""
    held_out = make_tool_problems(128, seed=args["seed"] + 2)
    sampled = measure_tool_episodes(model, tokenizer, held_out, greedy=False, seed=args["seed"])
    greedy = measure_tool_episodes(model, tokenizer, held_out, greedy=True)
    return dict(
        tool_call_rate=sampled["tool_call_rate"],
        sampled_accuracy=sampled["accuracy"],
        sampled_accuracy_with_tool=sampled["accuracy_with_tool"],
        sampled_accuracy_without_tool=sampled["accuracy_without_tool"],
        sampled_retokenized_differs=sampled["retokenized_differs"],
        greedy_tool_call_rate=greedy["tool_call_rate"],
        greedy_accuracy=greedy["accuracy"],
    )


def replay_warm_up_prefix(args: dict) -> dict:
    """The `prefix_record` of a build of ``args``, from its first PREFIX_STEPS warm-up steps only."""
    with all_cores():
        model, tokenizer, train = _initial_state(args)
        steps, batch_size, lr = args["warmup_steps"], args["batch_size"], args["learning_rate"]
        return _warm_up(model, tokenizer, train, steps=steps, batch_size=batch_size, lr=lr, prefix_only=True)[1]


def build_tool_model(
    out_dir: str | Path,
    seed: int = 0,
    warmup_steps: int = 480,
    batch_size: int = 32,
    learning_rate: float = 1e-3,
    tool_rate: float = 0.4,
    tool_only_steps: int = 200,
    build: bool = True,
    from_scratch: bool = False,
) -> str:
    """Build (or reuse) the embedded tool-use model in ``out_dir``; returns the path.

    A ``Qwen3ForCausalLM`` of ``tiny_gsm8k``'s "tiny" size (tied embeddings) with a BPE tokenizer trained on the
    warm-up's own conversations, warmed up on them: a ``tool_rate`` share call the calculator (see the module
    docstring). ``build_info.json`` records the arguments and the held-out figures of episodes run with the tool,
    sampled at temperature 1 and greedy. Cached, copied from the shipped build (``models/``), written atomically and
    waited for (``build=False``) as ``tiny_gsm8k.build_tiny_model``.
    """
    out_dir = Path(out_dir)
    args = dict(
        task="tools",
        size="tiny",
        seed=seed,
        warmup_steps=warmup_steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        tool_rate=tool_rate,
        tool_only_steps=tool_only_steps,
    )

    def make():
        model, tokenizer, train = _initial_state(args)
        loss, prefix = _warm_up(model, tokenizer, train, steps=warmup_steps, batch_size=batch_size, lr=learning_rate)
        figures = dict(parameters=sum(p.numel() for p in model.parameters()), final_loss=loss)
        return model, tokenizer, dict(figures, **held_out_figures(model, tokenizer, args), warm_up_prefix=prefix)

    return cached_build(Path(out_dir), args, build, make, from_scratch)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build (or reuse) the embedded tool-use model.")
    parser.add_argument("--out", default="cache/tiny-qwen3-tools")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup-steps", type=int, default=480)
    parser.add_argument("--tool-only-steps", type=int, default=200, help="first warm-up steps that all call the tool")
    parser.add_argument("--tool-rate", type=float, default=0.4, help="share calling the tool after those")
    parser.add_argument("--from-scratch", action="store_true", help="train it, even where a shipped build matches")
    cli = parser.parse_args()
    path = build_tool_model(
        cli.out,
        seed=cli.seed,
        warmup_steps=cli.warmup_steps,
        tool_rate=cli.tool_rate,
        tool_only_steps=cli.tool_only_steps,
        from_scratch=cli.from_scratch,
    )
    print(Path(path, "build_info.json").read_text())
