"""The plotting script renders headless (Agg) from metrics.jsonl files alone."""

import json

import matplotlib.image
import pytest

from plot_metrics import plot


def write_run(folder, merge, legacy, ratio):
    folder.mkdir()
    rows = [dict(step=s, merge=merge, legacy_slice=legacy, ratio_mean=ratio * s, rollout_logprob_diff_mean=3e-7,
                 rollout_tokens_per_s=2500.0 if merge else 500.0, reward_mean=0.5 + 0.01 * s) for s in range(1, 6)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_plot_renders_a_nontrivial_png(tmp_path):
    runs = [write_run(tmp_path / "on", True, False, 1.0), write_run(tmp_path / "off", False, False, 1.0),
            write_run(tmp_path / "legacy", True, True, 4e5)]
    out = plot(runs, tmp_path / "plots" / "metrics.png")
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 600
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_missing_metrics_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        plot([tmp_path / "nothing-here"], tmp_path / "x.png")
