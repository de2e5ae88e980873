"""bench/bench_async.py's measurement of one run: steady state after the warm-up and the whole run, each arm's
tokens and completions, and the server's busy share counting requests sent ahead for later rollout steps."""

import json

import pytest
from bench_async import measure


def test_a_run_is_measured_in_steady_state_and_whole_with_its_tokens(tmp_path):
    # three rollout steps of 2 s each; the first (warm-up) 4 s; the server busy through step 2 and, sent ahead for
    # step 3, through step 2's update
    timeline = [
        dict(rollout_step=1, trainer=dict(sync=[0, 1], rollout=[1, 3], update=[3, 4]), server=[[1, 3]]),
        dict(rollout_step=2, trainer=dict(sync=[4, 4.5], rollout=[4.5, 5], update=[5, 6]), server=[[4.5, 5]]),
        dict(rollout_step=3, trainer=dict(sync=[6, 6.5], rollout=[6.5, 7], update=[7, 8]), server=[[5, 7]]),
    ]
    phases = dict(sync_s=0.5, rollout_s=0.5, update_s=1.0, step_s=2.0)
    metrics = [dict(rollout_step=s, reward_mean=0.5, rollout_tokens=100 * s, **phases) for s in (1, 2, 3)]
    (tmp_path / "timeline.jsonl").write_text("".join(json.dumps(t) + "\n" for t in timeline))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    figures = measure(tmp_path, warmup=1, completions_per_step=64)
    assert figures["seconds"] == 4 and figures["rollout_steps_per_min"] == 30
    assert figures["server_busy"] == pytest.approx(2.5 / 4)  # 4.5..7: step 3's request ran during step 2's update
    assert figures["rollout_tokens"] == 500 and figures["completions"] == 128
    assert figures["rollout_tokens_per_s"] == 125
    assert figures["whole_run"] == dict(
        rollout_steps=3, seconds=8, rollout_steps_per_min=22.5, rollout_tokens=600, completions=192
    )
