"""recipes/grpo_trl.py on the tool task: TRL 1.16's own multi-turn loop (``GRPOTrainer(tools=[calculator])``) with
merge.trl's sync, a few colocated-vLLM steps in this process (fp32). Each episode TRL generated is scored again by
the trainer's model, one unpadded sequence at a time, before any update: on the model's tokens (TRL's ``tool_mask``)
vLLM's log-probs equal the trainer's, on the turns after a tool result as on the first."""

import json
import os
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine lives in this process

import pytest  # noqa: E402
import torch  # noqa: E402
from trl_helpers import EpisodeScores, randomize_lora_b, record_syncs, short_recipe_argv  # noqa: E402

from merge.trl import MergedLoraSync  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAX_LOGPROB_DIFF = 1e-6  # mean |vLLM - trainer| on model tokens in fp32, the standalone recipe's tool-run bound


def recipe_argv(out: Path, model: str) -> list[str]:
    """recipes/configs/trl_tiny_cpu_tools.yaml, shortened: 2 rollouts of 16 episodes (4 prompts x 4), a dense reward
    besides (the short warm-up's model is never exactly right: the adapter still moves)."""
    return short_recipe_argv("trl_tiny_cpu_tools.yaml", out, model, "tools", "--max_steps", "4")


@pytest.fixture(scope="module")
def tool_run(tiny_tool_model, tmp_path_factory):
    """The recipe's trainer on the tool task trained 4 optimizer steps = 2 rollouts, every sync and episode checked.
    One torch thread (as each of 2 launched processes has); TRL's colocate setup writes RANK/WORLD_SIZE/MASTER_*
    into os.environ: restored afterwards."""
    import grpo_trl

    saved_env, saved_threads = dict(os.environ), torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("trl-tools")
        trainer = grpo_trl.setup(recipe_argv(out, tiny_tool_model))
        model = trainer.model
        randomize_lora_b(model)  # the adapter changes the policy from the first sync on
        timed_sync = trainer.vllm_generation.sync_weights  # the recipe's timer around merge.trl's MergedLoraSync
        syncs = record_syncs(trainer)
        trainer._generate = scores = EpisodeScores(trainer)
        trainer.train()
        metrics = [json.loads(line) for line in (out / "tools" / "metrics.jsonl").read_text().splitlines()]
    finally:
        torch.set_num_threads(saved_threads)
        os.environ.clear()
        os.environ.update(saved_env)
    return SimpleNamespace(installed=timed_sync.method, syncs=syncs, scores=scores, metrics=metrics)


def test_trl_tool_episodes_sample_with_the_trainers_logprobs_on_every_turn(tool_run):
    assert isinstance(tool_run.installed, MergedLoraSync)
    syncs = tool_run.syncs
    assert len(syncs) == 2, "one sync per rollout (a tool loop's later turns generate without one)"
    assert all(s.before == s.after for s in syncs), "a sync changed the trainer's parameters"
    assert any(not torch.equal(syncs[0].lora[n], syncs[1].lora[n]) for n in syncs[1].lora), "the adapter never moved"

    scores = tool_run.scores
    adapter, base, turns = (torch.cat(x) for x in (scores.adapter, scores.base, scores.turns))
    after_tool = turns > 1
    print(
        f"{len(scores.adapter)} episodes, {scores.tool_calls} tool calls, {adapter.numel()} model tokens "
        f"({int(after_tool.sum())} after a tool result): |vLLM - trainer| mean {adapter.mean():.2e} (after a tool "
        f"result {adapter[after_tool].mean():.2e}), max {adapter.max():.2e}; |vLLM - base model| mean {base.mean():.2e}"
    )
    assert scores.tool_calls > 0 and after_tool.sum() > 0, "no episode went on after a tool result"
    assert adapter.mean() <= MAX_LOGPROB_DIFF and adapter[after_tool].mean() <= MAX_LOGPROB_DIFF
    # the bound can tell: vLLM serving the weights without the adapter would be far outside it
    assert base.mean() > 100 * MAX_LOGPROB_DIFF

    assert [m["rollout_step"] for m in tool_run.metrics] == [1, 2]
    for line in tool_run.metrics:  # TRL's own check and the recipe's, both over tool_mask * completion_mask
        assert line["tools/call_frequency"] > 0, line
        assert line["rollout_logprob_diff_mean"] <= MAX_LOGPROB_DIFF, line
        assert line["token_logprob_diff_mean"] <= MAX_LOGPROB_DIFF, line


def test_the_recipe_refuses_a_task_switch_that_does_not_fit():
    """Tools on plain-text prompts (TRL parses tool calls only in chat completions), or one task's model built for
    the other task's problems: refused while the arguments are read, before any work."""
    import grpo_trl

    with pytest.raises(ValueError, match="need chat prompts"):
        grpo_trl.TinyGsm8kArguments(tools=["grpo.tasks.tool_functions:calculator"])
    with pytest.raises(ValueError, match="other task"):
        grpo_trl.TinyGsm8kArguments(build_tiny="tiny-tools")
    with pytest.raises(ValueError, match="other task"):
        grpo_trl.TinyGsm8kArguments(dataset="generated-tools", tools=["grpo.tasks.tool_functions:calculator"])
