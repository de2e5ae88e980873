"""The key-chain task's data, tool and rewards (grpo/tasks/key_chain.py); no model."""

import pytest

from grpo.config import load_config
from grpo.data import load_problems, reward_columns
from grpo.episodes.tools import ToolCaller, load_tools
from grpo.tasks.key_chain import (
    key_chain_answer_reward,
    key_chain_hop_reward,
    lookup,
    make_key_chain_problems,
    next_key,
)


def call(key: str) -> str:
    return f'<tool_call>\n{{"name": "lookup", "arguments": {{"key": "{key}"}}}}\n</tool_call>'


def test_a_problem_is_a_chain_of_lookups_of_the_configured_length():
    """data.key_chain_hops=5: each row's chain is its start key and the 5 keys lookup gives in turn, its answer the
    last; the same seed gives the same rows, the held-out split (another seed) others."""
    cfg = load_config(None, ["data.name=generated-key-chain", "data.key_chain_hops=5", "data.num_generated=50"])
    rows = load_problems(cfg)
    assert len(rows) == 50 and rows == load_problems(cfg)
    assert {r["chain"][0] for r in load_problems(cfg, "test")} != {r["chain"][0] for r in rows}
    for row in rows:
        chain = row["chain"]
        assert len(chain) == 6 and all(lookup(a) == b for a, b in zip(chain, chain[1:]))
        assert row["answer"] == f"#### {chain[-1]}" and chain[0] in row["question"] and "5 lookups" in row["question"]
    assert len({r["chain"][0] for r in rows}) > 40  # start keys drawn from 26^4, not a handful
    # the columns reach the reward functions by name (grpo.data.score)
    assert reward_columns(key_chain_hop_reward) == ["chain"] and reward_columns(key_chain_answer_reward) == ["answer"]


def test_lookup_refuses_what_is_not_a_key_as_an_error_result():
    (tool,) = load_tools(["grpo.tasks.key_chain:lookup"])  # a tool the recipe can describe to the model
    results = ToolCaller({"lookup": tool}).run(
        [{"name": "lookup", "arguments": {"key": "QXRB"}}, {"name": "lookup", "arguments": {"key": "qx; rm"}}]
    )
    assert results[0] == ("lookup", next_key("QXRB"), False)
    assert results[1][2] and "is not a key of 4 capital letters" in results[1][1]
    with pytest.raises(ValueError, match="hops=0"):
        make_key_chain_problems(1, hops=0)


def test_the_hop_reward_credits_each_hop_made_in_order_and_the_answer_reward_only_the_last_key():
    """Four hops. An episode that follows the chain and answers: hop reward 1, answer reward 1. One that stops after
    two hops and answers the key it reached: 0.5 and 0 (an earlier key of the chain is no answer). One that skips
    the second hop yet names the right key: 0.25 (nothing counts after the missed hop) and 1."""
    (row,) = make_key_chain_problems(1, hops=4, seed=3)
    chain = row["chain"]
    full = "".join(call(k) + f"<tool_response>{next_key(k)}</tool_response>" for k in chain[:-1]) + f"#### {chain[-1]}"
    partial = call(chain[0]) + call(chain[1]) + f"#### {chain[2]}"
    skipped = call(chain[0]) + call(chain[2]) + call(chain[3]) + f"#### {chain[-1]}"
    completions = [full, partial, skipped]
    hops = key_chain_hop_reward(completions, chain=[chain] * 3)
    answers = key_chain_answer_reward(completions, answer=[row["answer"]] * 3)
    assert hops == [1.0, 0.5, 0.25] and answers == [1.0, 0.0, 1.0]


def test_the_long_config_fits_16_turns_and_the_model_100():
    """recipes/configs/tiny_cpu_long.yaml asks for 16 turns (15 lookups, then the answer) of the key-chain model.
    With the builder's tokenizer (trained on its warm-up's conversations) and chat template, a whole 15-hop episode's
    prompt fits data.max_prompt_length and the rest max_completion_length; a 99-hop one (100 turns) fits the model's
    4096 positions; a key is four tokens, whatever its letters."""
    from grpo.tasks.tiny_key_chain import (
        KEY_PIECES,
        MAX_POSITIONS,
        TOOLS,
        key_chain_conversation,
        render,
        warmup_conversations,
    )
    from grpo.tasks.tiny_tools import build_tool_tokenizer

    cfg = load_config("recipes/configs/tiny_cpu_long.yaml")
    assert cfg.data.name == "generated-key-chain" and cfg.model.build_tiny == "tiny-key-chain"
    assert cfg.max_tool_calling_iterations == cfg.data.key_chain_hops and cfg.data.key_chain_hops + 1 >= 16
    texts = render(warmup_conversations(400, 1, 12, 0.25, 8, 0.3), tools=TOOLS)
    tokenizer = build_tool_tokenizer(texts, pieces=KEY_PIECES)

    def lengths(hops: int) -> tuple[int, int]:
        conversation = key_chain_conversation(make_key_chain_problems(1, hops=hops, seed=5)[0])
        prompt = tokenizer.apply_chat_template(conversation[:1], tools=TOOLS, add_generation_prompt=True)["input_ids"]
        whole = tokenizer.apply_chat_template(conversation, tools=TOOLS)["input_ids"]
        return len(prompt), len(whole) - len(prompt)

    prompt, completion = lengths(cfg.data.key_chain_hops)
    assert prompt <= cfg.data.max_prompt_length and completion <= cfg.max_completion_length, (prompt, completion)
    assert sum(lengths(99)) <= MAX_POSITIONS
    for key in ("QXRB", "AAAA", "ZQZQ"):
        assert len(tokenizer(key, add_special_tokens=False).input_ids) == 4
