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
