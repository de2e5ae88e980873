"""The plotting script renders headless (Agg) from metrics.jsonl files alone, and draws what they hold."""

import json
import runpy
import sys
from pathlib import Path

import matplotlib.image
import plot_metrics
import pytest
from plot_metrics import plot, summary


def write_run(folder, merge, legacy, ratio):
    folder.mkdir()
    rows = [
        dict(
            rollout_step=s,
            merge=merge,
            legacy_slice=legacy,
            ratio_mean=ratio * s,
            ratio_max=2 * ratio * s,
            rollout_logprob_diff_mean=3e-7,
            rollout_tokens_per_s=2500.0 if merge else 500.0,
            reward_mean=0.5 + 0.01 * s,
            step_s=float(s if merge else 2 * s),
            sync_s=0.1,
            rollout_s=1.0,
            update_s=2.0,
        )
        for s in range(1, 6)
    ]
    rows += [
        dict(rollout_step=s, global_step=4 * s, eval_reward_greedy=0.7 + 0.01 * s, eval_reward_sampled=0.4 + 0.05 * s)
        for s in (0, 5)
    ]  # evaluation lines: before training and at the end
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_draws_each_runs_metrics_and_the_script_writes_its_summary(tmp_path, monkeypatch):
    runs = [
        write_run(tmp_path / "on", True, False, 1.0),
        write_run(tmp_path / "off", False, False, 1.0),
        write_run(tmp_path / "legacy", True, True, 4e5),
    ]
    figures = []
    monkeypatch.setattr(plot_metrics, "save_figure", lambda fig, out: figures.append(fig) or out)
    plot(runs, tmp_path / "metrics.png")
    panels = {ax.get_title(): ax for ax in figures[0].axes if ax.get_title()}
    for i, run in enumerate(runs):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "reward_mean" in r]
        evals = [r for r in rows if "eval_reward_greedy" in r]
        for title, key in [
            ("mean reward", "reward_mean"),
            ("rollout tokens / s", "rollout_tokens_per_s"),
            ("|vLLM − trainer| log-prob", "rollout_logprob_diff_mean"),
            ("weight sync (s)", "sync_s"),
            ("rollout step wall time (s)", "step_s"),
        ]:
            line = panels[title].get_lines()[i]
            assert list(line.get_xdata()) == [r["rollout_step"] for r in steps], title
            assert list(line.get_ydata()) == [r[key] for r in steps], title
        mean, extreme = panels["PPO ratio: mean (thick), max (thin)"].get_lines()[2 * i : 2 * i + 2]
        assert list(mean.get_ydata()) == [r["ratio_mean"] for r in steps]
        assert list(extreme.get_ydata()) == [r["ratio_max"] for r in steps]
        greedy, sampled = panels["held-out acc.: greedy •, sampled ×"].get_lines()[2 * i : 2 * i + 2]
        assert list(greedy.get_xdata()) == [r["rollout_step"] for r in evals]
        assert list(greedy.get_ydata()) == [r["eval_reward_greedy"] for r in evals]
        assert list(sampled.get_ydata()) == [r["eval_reward_sampled"] for r in evals]
    legend = [t.get_text() for t in figures[0].axes[-1].get_legend().get_texts()]
    assert legend == ["merged weights", "vLLM LoRA", "merged weights, legacy padding"]

    script = Path(plot_metrics.__file__)  # the command line writes the summary table beside the PNG
    monkeypatch.setattr(sys, "argv", [str(script), *map(str, runs), "--out", str(tmp_path / "cli.png")])
    runpy.run_path(str(script), run_name="__main__")
    assert (tmp_path / "cli.png").stat().st_size > 0
    assert json.loads((tmp_path / "cli.json").read_text()) == summary(runs)


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


def test_timeline_draws_each_side_and_its_busy_fractions(tmp_path):
    """Two rollout steps drawn: the trainer busy 1 s of every 2 (sync + update), the server's requests overlapping,
    and a request of rollout step 3, sent ahead, that ran during step 2's update: the server was busy then too."""
    import plot_timeline

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("max_staleness: 1\n")
    lines = [
        dict(rollout_step=1, trainer=dict(sync=[0, 0.5], rollout=[0.5, 1.0], update=[1.0, 1.5]), server=[[0.5, 1.0]]),
        dict(rollout_step=2, trainer=dict(sync=[1.5, 2.0], rollout=[2.0, 3.5], update=[3.5, 4.0]), server=[[0.9, 3.5]]),
        dict(rollout_step=3, trainer=dict(sync=[4.0, 4.5], rollout=[4.5, 5.0], update=[5.0, 5.5]), server=[[3.6, 4.8]]),
    ]
    (run / "timeline.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "timeline.png"
    summary = plot_timeline.main([str(run), "--steps", "1", "2", "--out", str(out)])
    figures = summary[str(run)]
    assert figures["seconds"] == 4.0 and figures["rollout_steps_per_min"] == 30.0
    assert figures["trainer_busy"] == 2.0 / 4.0 and figures["server_busy"] == pytest.approx(3.4 / 4.0)
    assert matplotlib.image.imread(out).shape[2] in (3, 4)
    assert json.loads(out.with_suffix(".json").read_text()) == summary
    with pytest.raises(SystemExit, match="no timeline lines"):
        plot_timeline.main([str(run), "--steps", "5", "6", "--out", str(out)])


def test_tool_runs_plot_and_their_committed_figures(tmp_path):
    """recipes/plot_tools.py draws the committed tool runs; their figures are the ones docs/tools.md quotes: token in /
    token out keeps every turn at |vLLM - trainer| <= 1e-6 and the trainer/vLLM ratio at 1, the re-tokenized run not."""
    import plot_tools

    results = Path(__file__).resolve().parents[1] / "results"
    runs = [results / name for name in ("tiny-cpu-tools", "tiny-cpu-tools-retokenized", "tiny-cpu-tools-server")]
    out = plot_tools.plot(runs, tmp_path / "tools.png")
    assert matplotlib.image.imread(out).shape[1] > 1000
    exact, retokenized, server = plot_tools.summary(runs)
    for row in (exact, server):
        for turn in ("turn1", "turn2"):
            assert row[f"max_rollout_logprob_diff_{turn}"] <= 1e-6 and row[f"max_worst_ratio_{turn}"] < 1 + 1e-4, row
        assert row["max_ratio_onpolicy_maxdev"] == 0 and row["mean_retokenization_drift"] > 0
        assert row["eval_reward_greedy_last"] > row["eval_reward_greedy_first"] + 0.1
        assert row["eval_tool_success_sampled_last"] > row["eval_tool_success_sampled_first"] + 0.1
    assert retokenized["max_rollout_logprob_diff_turn1"] > 1e-2 and retokenized["max_worst_ratio_turn2"] > 10
