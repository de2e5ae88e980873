"""The key-chain task's data, tool and rewards (grpo/tasks/key_chain.py), its config and its shipped model."""

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


def test_the_environment_says_which_lookup_was_the_last_and_pays_each_hop_made_in_order():
    """KeyChain (environment_factory), three hops: its lookup gives the key a key names, as the plain tool does; the
    third result adds that it was the last, and a fourth lookup is refused. The step rewards pay 1/3 for each hop
    made in order, and sum to key_chain_hop_reward of the episode's calls: a lookup out of order earns nothing (the
    control: the same keys in order earn all three)."""
    from grpo.episodes.environments import load_environment
    from grpo.tasks.key_chain import LAST_LOOKUP, KeyChain

    (row,) = make_key_chain_problems(1, hops=3, seed=7)
    chain = row["chain"]
    environment = load_environment("grpo.tasks.key_chain:KeyChain")  # the recipe can build and describe it
    assert environment.method_names == ["lookup"]

    def episode(keys):
        env = KeyChain()
        env.reset(seed=0, **row)
        return [env.lookup(key) for key in keys], env

    results, env = episode(chain[:3])
    assert [text for text, _ in results] == [chain[1], chain[2], f"{chain[3]}\n{LAST_LOOKUP}"]
    assert [reward for _, reward in results] == [pytest.approx(1 / 3)] * 3
    with pytest.raises(ValueError, match="no lookups left: all 3 were made"):
        env.lookup(chain[3])
    skipped, _ = episode([chain[0], chain[2], chain[1]])
    assert [text.split("\n")[0] for text, _ in skipped] == [chain[1], chain[3], chain[2]]
    assert [reward for _, reward in skipped] == [pytest.approx(1 / 3), 0.0, pytest.approx(1 / 3)]
    for keys in (chain[:3], [chain[0], chain[2], chain[3]], [chain[0], chain[2], chain[1]]):
        rewards = [reward for _, reward in episode(keys)[0]]
        text = "".join(call(k) for k in keys)
        assert sum(rewards) == pytest.approx(key_chain_hop_reward([text], chain=[chain])[0])
    with pytest.raises(ValueError, match="is not a key"):
        episode(["abc"])
    with pytest.raises(ValueError, match="chain must be a list"):
        KeyChain().reset(seed=0, chain="QXRB")


def test_the_long_config_fits_16_turns_and_the_model_100():
    """recipes/configs/tiny_cpu_long.yaml asks for at least 16 turns (lookups, then the answer) of the key-chain model.
    With the shipped build's tokenizer and chat template, a whole episode's prompt fits data.max_prompt_length
    and the rest max_completion_length; a 99-hop one (100 turns) fits the model's 4096 positions; a key is four
    tokens, one per letter, whatever its letters: the tokens the build's copy phase trains."""
    from transformers import AutoTokenizer

    from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS
    from grpo.tasks.tiny_key_chain import MAX_POSITIONS, key_chain_conversation, key_letter_ids, tools

    cfg = load_config("recipes/configs/tiny_cpu_long.yaml")
    assert cfg.data.name == "generated-key-chain" and cfg.model.build_tiny == "tiny-key-chain"
    assert cfg.environment_factory == "grpo.tasks.key_chain:KeyChain" and not cfg.tools
    assert cfg.max_tool_calling_iterations == cfg.data.key_chain_hops and cfg.data.key_chain_hops + 1 >= 16
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_MODELS / "tiny-qwen3-key-chain")

    def lengths(hops: int) -> tuple[int, int]:
        conversation = key_chain_conversation(make_key_chain_problems(1, hops=hops, seed=5)[0])
        prompt = tokenizer.apply_chat_template(conversation[:1], tools=tools(), add_generation_prompt=True)["input_ids"]
        whole = tokenizer.apply_chat_template(conversation, tools=tools())["input_ids"]
        return len(prompt), len(whole) - len(prompt)

    prompt, completion = lengths(cfg.data.key_chain_hops)
    assert prompt <= cfg.data.max_prompt_length and completion <= cfg.max_completion_length, (prompt, completion)
    assert sum(lengths(99)) <= MAX_POSITIONS
    letters = key_letter_ids(tokenizer)  # what the build's copy phase trains
    for key in ("QXRB", "AAAA", "ZQZQ"):
        ids = tokenizer(key, add_special_tokens=False).input_ids
        assert len(ids) == 4 and set(ids) <= letters
    assert len(letters) == 26 and not letters & set(tokenizer(" lookup key 15", add_special_tokens=False).input_ids)


def test_the_builds_defaults_copy_the_shipped_model_without_training(tmp_path, monkeypatch):
    """model.build_tiny: tiny-key-chain builds with the builder's defaults: they are the shipped build's arguments,
    so a fresh clone copies models/tiny-qwen3-key-chain byte for byte; other arguments train (the control)."""
    import grpo.tasks.tiny_key_chain
    from grpo.tasks.tiny_gsm8k import SHIPPED_MODELS

    def refuse(*args, **kwargs):
        raise AssertionError("trained although a shipped build matches")

    monkeypatch.setattr(grpo.tasks.tiny_key_chain, "_warm_up", refuse)
    out = tmp_path / "key-chain"
    assert grpo.tasks.tiny_key_chain.build_key_chain_model(out) == str(out)
    shipped = SHIPPED_MODELS / "tiny-qwen3-key-chain"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in shipped.iterdir())
    assert all((out / p.name).read_bytes() == p.read_bytes() for p in shipped.iterdir())
    with pytest.raises(AssertionError, match="trained although"):
        grpo.tasks.tiny_key_chain.build_key_chain_model(tmp_path / "other", copy_steps=1, warmup_steps=1, batch_size=2)
