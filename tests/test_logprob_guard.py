"""The |vLLM - trainer| log-prob guard on multi-turn episodes: one turn that drifts stops the step before its update;
one outlying token of a sparse turn group (as between two bf16 attention kernels) does not."""

from types import SimpleNamespace

import pytest
import torch
from recipe_runs import ROOT

from grpo.config import load_config
from grpo.faults import LogprobGuard
from grpo.metrics import fidelity_totals

# Two episodes of 12 response positions: turn 1 the first 6 tokens, a tool result (turn 0: not the model's), then
# turn 2; the second episode's turn 3 holds 2 tokens only (a sparse group).
TURNS = torch.tensor(
    [
        [1, 1, 1, 1, 1, 1, 0, 0, 2, 2, 2, 2],
        [1, 1, 1, 1, 0, 0, 2, 2, 0, 0, 3, 3],
    ]
)
KERNEL_NOISE = 1e-6  # |vLLM - trainer| of every token between two healthy fp32 kernels


def tool_batch(turn_offsets: dict[int, float] | None = None, outlier: float = 0.0) -> dict:
    """A rank's batch of multi-turn episodes: the engine's log-probs differ from the trainer's by the kernel noise,
    plus ``turn_offsets`` on every model token of a turn, plus ``outlier`` on the last token of turn 3."""
    trainer = torch.full(TURNS.shape, -1.0)
    engine = trainer + KERNEL_NOISE
    for turn, offset in (turn_offsets or {}).items():
        engine[TURNS == turn] += offset
    engine[1, -1] += outlier
    mask = TURNS > 0  # the model's tokens; tool results carry no log-prob to compare
    return dict(turn_of_token=TURNS, response_mask=mask.float(), vllm_logprobs=engine, old_logprobs=trainer)


def tools_cfg(dtype: str = "float32"):
    return load_config(ROOT / "recipes" / "configs" / "tiny_cpu_tools.yaml", [f"model.dtype={dtype}"])


def test_fidelity_totals_hold_each_turn_groups_sum_count_and_largest_token():
    totals = fidelity_totals(tool_batch({2: 0.5}, outlier=0.25))
    assert totals["logprob_diff_count"] == 18
    assert totals["logprob_diff_turn1_count"] == 10 and totals["logprob_diff_turn2_count"] == 6
    assert totals["logprob_diff_turn2_sum"] == pytest.approx(6 * (0.5 + KERNEL_NOISE), rel=1e-5)
    assert totals["logprob_diff_turns3to4_count"] == 2
    assert totals["logprob_diff_turns3to4_max"] == pytest.approx(0.25 + KERNEL_NOISE, rel=1e-5)


def test_each_turn_bucket_holds_its_turns_and_the_metrics_name_each_one():
    """One episode of 20 turns (turn k: k tokens off by k/100, a tool token between turns): turn 1 and turn 2 keep
    their names, turns 3-4, 5-8, 9-16 and 17+ each their own, every model token in exactly one."""
    from grpo.metrics import per_turn_statistics, tool_metrics

    turns = torch.tensor([[k for k in range(1, 21) for _ in range(k)] + [0]])
    trainer = torch.full(turns.shape, -1.0)
    engine = trainer + turns / 100
    batch = dict(turn_of_token=turns, response_mask=(turns > 0).float(), vllm_logprobs=engine, old_logprobs=trainer)
    totals = fidelity_totals(batch)
    buckets = {"turn1": [1], "turn2": [2], "turns3to4": [3, 4], "turns5to8": range(5, 9)}
    buckets |= {"turns9to16": range(9, 17), "turns17plus": range(17, 21)}
    for name, members in buckets.items():
        assert totals[f"logprob_diff_{name}_count"] == sum(members), name
        assert totals[f"logprob_diff_{name}_max"] == pytest.approx(max(members) / 100, rel=1e-5), name
    assert sum(totals[f"logprob_diff_{name}_count"] for name in buckets) == totals["logprob_diff_count"] == 210
    statistics = per_turn_statistics(batch, batch["response_mask"].bool())
    metrics = tool_metrics(dict(statistics, tool_episodes=1.0, tool_calls=19.0, tool_failures=0.0, tool_turns=20.0,
                                tool_episodes_calling=1.0, tool_episodes_succeeding=1.0, tool_drifted=0.0))  # fmt: skip
    assert metrics["model_tokens_turns17plus"] == 17 + 18 + 19 + 20 and metrics["model_tokens_turn2"] == 2


def test_a_sparse_turn_group_with_one_outlying_token_does_not_stop_a_healthy_run():
    """bf16: one token of the 2-token turn-3 group off by 0.164 (the largest single-token |delta log p| measured
    between two bf16 attention kernels) puts that group's mean at 0.08, four times the bf16 limit; the group is
    judged without its largest token. Control: the same group with both tokens off stops the run."""
    guard = LogprobGuard(tools_cfg("bfloat16"))
    guard.check(1, fidelity_totals(tool_batch()))  # calibrates: the baseline is the kernel noise
    outlier = fidelity_totals(tool_batch(outlier=0.164))
    mean = outlier["logprob_diff_turns3to4_sum"] / outlier["logprob_diff_turns3to4_count"]
    assert mean > guard.limit  # judged by its mean alone, this healthy step would stop the run
    guard.check(2, outlier)
    with pytest.raises(RuntimeError, match=r"rollout step 3: rollout_logprob_diff_turns3to4 .*exceeds"):
        guard.check(3, fidelity_totals(tool_batch({3: 0.164})))


def recipe_run(cfg) -> SimpleNamespace:
    """The parts of a `grpo.run.Run` that the recipe's update phase reads, around a guard of ``cfg`` (an engine
    without environments: nothing to release, no failure streak)."""
    return SimpleNamespace(cfg=cfg, guard=LogprobGuard(cfg), engine=SimpleNamespace(), last_checkpoint=None)


@pytest.fixture
def recipe(monkeypatch):
    """The recipe with its phases replaced by stand-ins: the batch is the one ``batches`` hands out, and each
    update is recorded in ``updates`` (nothing trains)."""
    import grpo_qwen3_4b as recipe

    recipe.batches, recipe.updates = [], []
    monkeypatch.setattr(recipe, "rewards_and_advantages", lambda run, rows, samples, step: (torch.ones(2), None))
    monkeypatch.setattr(recipe, "training_batch", lambda run, samples, advantages: recipe.batches.pop(0))
    monkeypatch.setattr(recipe, "old_log_probs", lambda run, batch, step: None)
    monkeypatch.setattr(recipe, "update", lambda run, batch, step: recipe.updates.append(step) or {})
    return recipe


def test_one_drifting_turn_stops_the_step_before_its_update(recipe):
    """fp32: turn 2 alone off by 2e-4, twice the fp32 limit, while the step's mean stays under it (a third of the
    tokens drift), stops rollout step 3 before its update; the control, step 2 with turn 2 in order, updates."""
    run = recipe_run(tools_cfg())
    recipe.batches += [tool_batch(), tool_batch(), tool_batch({2: 2e-4})]
    for step in (1, 2):
        recipe.update_phase(run, [], [], step)
    assert recipe.updates == [1, 2]
    drifting = fidelity_totals(recipe.batches[0])
    assert drifting["logprob_diff_sum"] / drifting["logprob_diff_count"] < run.guard.limit
    with pytest.raises(RuntimeError, match=r"rollout step 3: rollout_logprob_diff_turn2 .*stopped before"):
        recipe.update_phase(run, [], [], 3)
    assert recipe.updates == [1, 2]  # no update of step 3: the weights are the ones its rollouts were judged on
