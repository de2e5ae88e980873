"""The end of a tool episode's budget on the scripted engines of test_tools: no request past max_model_len, a turn
cut by max_tokens, a tool result with no room, and what training does with the truncated episodes (their reward,
their loss, the group baseline)."""

from types import SimpleNamespace

import pytest
import torch
from test_tools import CALL, Sampling, prompt_ids, tokenizer, tool_engine  # noqa: F401 - the fixture

from grpo.config import ConfigError, load_config
from grpo.data import group_advantages
from grpo.engines.interface import Sample


def test_no_request_asks_for_more_than_max_model_len(tokenizer):  # noqa: F811
    """max_model_len 30 tokens past the prompt, max_completion_length 64: the first turn asks for 30, the call and
    its result leave ``left`` and the last turn asks for exactly that (cut there, truncated); with min_turn_tokens
    above ``left`` it is never sent and the episode ends after the tool tokens, truncated. The control: a loop that
    does not check max_model_len sends a first turn of 64, which the engine refuses."""
    prompt = prompt_ids(tokenizer)
    limit = len(prompt) + 30
    turns = [CALL, "#### 1776 is the product of the two numbers, so the answer is 1776"]
    engine = tool_engine(tokenizer, turns, engine_max_model_len=limit, max_model_len=limit)
    sample = engine.generate([prompt], Sampling(max_tokens=64))[0]
    requests = [request for batch in engine.engine.requests for request in batch]
    assert all(len(ids) + max_tokens <= limit for ids, _, max_tokens in requests)
    first, last = requests[0][2], requests[-1][2]
    assert first == 30 and len(requests) == 2 and sample.tool_calls == 1
    left = limit - len(requests[-1][0])
    assert last == left > 0 and len(prompt) + len(sample.completion_ids) == limit and sample.truncated

    ending = tool_engine(
        tokenizer, turns, engine_max_model_len=limit, max_model_len=limit, tool_calling={"min_turn_tokens": left + 1}
    )
    sample = ending.generate([prompt], Sampling(max_tokens=64))[0]
    assert len(ending.engine.requests) == 1 and sample.truncated and sample.tool_mask[-1] == 0  # ends on tool tokens

    unchecked = tool_engine(tokenizer, turns, engine_max_model_len=limit)  # the control: the budget alone
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        unchecked.generate([prompt], Sampling(max_tokens=64))
    with pytest.raises(ValueError, match=f"a prompt of {len(prompt)} tokens leaves 0 of max_model_len"):
        tool_engine(tokenizer, turns, max_model_len=len(prompt)).generate([prompt], Sampling(max_tokens=64))


@pytest.mark.parametrize("rule", ["run_calls", "end_episode"])
def test_a_turn_cut_by_max_tokens_runs_no_call_and_ends_its_episode_with_end_episode(tokenizer, rule):  # noqa: F811
    """A first turn cut inside its second call (max_tokens 3 past the first): end_episode ends the episode there,
    truncated, the tool never runs and nothing more is sampled. The control, run_calls (TRL's rule, the default),
    runs the finished call and samples another turn after the cut one."""
    ran = []

    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: the expression
        """
        ran.append(expression)
        return "1776"

    call_ids = tokenizer(CALL, add_special_tokens=False).input_ids
    engine = tool_engine(
        tokenizer, [CALL + "\n" + CALL, "#### 1776"], tools=(calculator,), max_completion_length=256,
        tool_calling={"truncated_turn": rule},
    )  # fmt: skip
    sample = engine.generate([prompt_ids(tokenizer)], Sampling(max_tokens=len(call_ids) + 3))[0]
    if rule == "end_episode":
        assert ran == [] and sample.tool_calls == 0 and len(engine.engine.requests) == 1 and sample.truncated
        assert len(sample.completion_ids) == len(call_ids) + 3
    else:
        assert ran == ["37*48"] and sample.tool_calls == 1 and len(engine.engine.requests) == 2
        assert not sample.truncated and max(sample.turn_of_token) == 2


def test_an_episode_whose_tool_result_has_no_room_is_truncated_and_masked(tokenizer):  # noqa: F811
    """A call that ends its turn (eos) one token before the result would fit: the result is dropped and the episode
    is truncated, so mask_truncated_completions takes its loss away (TRL marks only a last token that ends no turn:
    this episode ends on its eos and kept its loss). The control, room for the result, is not truncated."""
    import grpo_qwen3_4b as recipe

    turn1 = len(tokenizer(CALL, add_special_tokens=False).input_ids) + 1
    probe = tool_engine(tokenizer, [CALL])
    suffix = len(probe.renderer.tool_suffix_ids([{"role": "tool", "name": "calculator", "content": "1776"}]))
    samples = []
    for budget in (turn1 + suffix - 1, turn1 + suffix + 16):
        engine = tool_engine(tokenizer, [CALL, "#### 1776"], max_completion_length=budget)
        samples += engine.generate([prompt_ids(tokenizer)], Sampling(max_tokens=budget))
    dropped, fits = samples
    assert len(dropped.completion_ids) == turn1 and dropped.completion_ids[-1] == tokenizer.eos_token_id
    assert dropped.truncated and not fits.truncated
    for mask in (False, True):
        run = SimpleNamespace(
            cfg=SimpleNamespace(mask_truncated_completions=mask), pad_id=tokenizer.pad_token_id, device="cpu"
        )
        batch = recipe.training_batch(run, samples, torch.zeros(2))
        assert batch["response_mask"][0].sum() == (0 if mask else turn1)
        assert batch["response_mask"][1].sum() > 0


def test_a_truncated_episodes_reward_and_its_place_in_the_group_baseline():
    """One group of four, the last truncated, its reward function giving 1, 0, 1, 1. overflow_reward -1 gives it -1;
    baseline_excludes_truncated leaves it out of the mean (2/3) and the std, its advantage 0. The control, the
    defaults: its reward is the function's and the baseline holds all four (mean 3/4)."""
    import grpo_qwen3_4b as recipe

    def reward(completions, **columns):
        return [1.0, 0.0, 1.0, 1.0]

    samples = [Sample([1], [2], "", [0.0], i == 3, 0) for i in range(4)]
    rows = [{"prompt": "p", "prompt_ids": [1]}]
    base = ["tools=[grpo.tasks.tool_functions:calculator]", "num_generations=4", "per_device_train_batch_size=4"]

    def advantages(*overrides):
        cfg = load_config(None, [*base, *overrides])
        run = SimpleNamespace(cfg=cfg, reward_funcs={"reward": reward}, last_checkpoint=None)
        return recipe.rewards_and_advantages(run, rows, samples, 1)

    rewards, adv = advantages()
    assert rewards.tolist() == [1, 0, 1, 1] and torch.allclose(adv, group_advantages(rewards, 4, "group"))
    assert adv[1] == pytest.approx(-0.75 / rewards.std().item(), rel=1e-3)  # the control: mean 3/4, all four
    rewards, adv = advantages("tool_calling.overflow_reward=-1")
    assert rewards.tolist() == [1, 0, 1, -1]
    rewards, adv = advantages("tool_calling.baseline_excludes_truncated=true")
    kept = torch.tensor([1.0, 0.0, 1.0])
    assert adv[3] == 0 and torch.allclose(adv[:3], (kept - 2 / 3) / (kept.std() + 1e-4))
    batch = group_advantages(torch.tensor([1.0, 0.0, 1.0, 5.0]), 4, "batch", torch.tensor([0, 0, 0, 1]).bool())
    assert torch.allclose(batch[:3], (kept - 2 / 3) / (kept.std() + 1e-4)) and batch[3] == 0

    with pytest.raises(ConfigError, match="overflow_reward=-1.0 rewards truncated tool episodes: set tools"):
        load_config(None, ["tool_calling.overflow_reward=-1"])
    with pytest.raises(ConfigError, match="overflow_reward=nan must be a finite number"):
        load_config(None, [*base, "tool_calling.overflow_reward=.nan"])
