"""The plotting script renders headless (Agg) from metrics.jsonl files alone."""

import json

import matplotlib.image
import pytest

from plot_metrics import plot, summary


def write_run(folder, merge, legacy, ratio):
    folder.mkdir()
    rows = [dict(rollout_step=s, merge=merge, legacy_slice=legacy, ratio_mean=ratio * s, ratio_max=2 * ratio * s,
                 rollout_logprob_diff_mean=3e-7, rollout_tokens_per_s=2500.0 if merge else 500.0,
                 reward_mean=0.5 + 0.01 * s, step_s=float(s if merge else 2 * s), sync_s=0.1, rollout_s=1.0,
                 update_s=2.0) for s in range(1, 6)]
    rows += [dict(rollout_step=s, global_step=4 * s, eval_reward_greedy=0.7 + 0.01 * s, eval_reward_sampled=0.4 + 0.05 * s)
             for s in (0, 5)]  # evaluation lines: before training and at the end
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_renders_a_nontrivial_png(tmp_path):
    runs = [write_run(tmp_path / "on", True, False, 1.0), write_run(tmp_path / "off", False, False, 1.0),
            write_run(tmp_path / "legacy", True, True, 4e5)]
    out = plot(runs, tmp_path / "plots" / "metrics.png")
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_runs_that_merged_below_fp32_get_the_precision_panel(tmp_path):
    plain = matplotlib.image.imread(plot([write_run(tmp_path / "on", True, False, 1.0)], tmp_path / "plain.png"))
    bf16 = write_run(tmp_path / "bf16", True, False, 1.0)
    rows = [json.loads(line) for line in (bf16 / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        if "reward_mean" in row:
            row["sync_delta_kept"] = 0.97
    (bf16 / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with_panel = matplotlib.image.imread(plot([bf16], tmp_path / "bf16.png"))
    assert with_panel.shape[0] > plain.shape[0]  # a third row of panels


def test_panels_selects_what_is_drawn_and_names_an_unknown_one(tmp_path):
    runs = [write_run(tmp_path / "on", True, False, 1.0), write_run(tmp_path / "off", False, False, 1.0)]
    one = matplotlib.image.imread(plot(runs, tmp_path / "one.png", only=["rollout_logprob_diff_mean"]))
    full = matplotlib.image.imread(plot(runs, tmp_path / "full.png"))
    assert one.shape[1] < full.shape[1] and one.shape[0] < full.shape[0]  # one panel and the legend
    with pytest.raises(ValueError, match="logprob_dif'"):
        plot(runs, tmp_path / "bad.png", only=["logprob_dif"])


def test_missing_metrics_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        plot([tmp_path / "nothing-here"], tmp_path / "x.png")


def test_summary_medians_leave_out_the_warm_up_step(tmp_path):
    on, off = summary([write_run(tmp_path / "on", True, False, 1.0), write_run(tmp_path / "off", False, False, 1.0)])
    assert on["label"] == "merged weights" and off["label"] == "vLLM LoRA"
    assert on["median_step_s"] == 3.5 and off["median_step_s"] == 7.0  # steps 2..5
    assert on["max_abs_ratio_mean_minus_1"] == 4.0 and on["ratio_max"] == 10.0
    assert on["steps"] == 5 and on["reward_first_10"] == pytest.approx(0.53) == on["reward_last_10"]
    assert (on["eval_sampled_first"], on["eval_sampled_last"]) == pytest.approx((0.4, 0.65))
