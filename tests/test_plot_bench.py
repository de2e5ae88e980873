"""plot_bench renders headless (Agg) from the two benchmark JSON files alone (small synthetic ones here)."""

import json

import matplotlib.image
import pytest

from plot_bench import plot


def rollout_json(path):
    results = []
    for size, scale in (("tiny", 5.0), ("small", 1.0)):
        for dtype in ("float32", "bfloat16"):
            tps = dict(base=1000.0 * scale, merged=990.0 * scale, lora=300.0 * scale)
            results.append(dict(size=size, dtype=dtype, parameters=1e6 * scale, tokens_per_s=tps, merged_over_base=tps["merged"] / tps["base"],
                                merged_over_lora=tps["merged"] / tps["lora"]))
    path.write_text(json.dumps(dict(command="python recipes/bench_rollout.py", results=results)))
    return path


def sync_json(path):
    methods = {}
    for name, seconds, drain, push in (("merged_lora_params", 0.46, 2.0, 2.4), ("plain_push", 0.42, 2.0, 2.4),
                                       ("trl_merge_unmerge", 0.83, 0.7, 1.5), ("full_state_dict", 0.63, 8.4, 9.2)):
        methods[name] = dict(median_s=seconds, over_plain_push=seconds / 0.42,
                             peak_extra_layers=dict(drain=drain, vllm_push=push))
    path.write_text(json.dumps(dict(command="python recipes/bench_sync.py", methods=methods,
                                    settings=dict(parameters=2.6e7), unshard_only_peak_extra_layers=2.0)))
    return path


def test_plot_bench_renders_a_nontrivial_png(tmp_path):
    out = plot(rollout_json(tmp_path / "rollout.json"), sync_json(tmp_path / "sync.json"), tmp_path / "plots" / "b.png")
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.05  # not a blank canvas


def test_missing_or_wrong_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        plot(tmp_path / "nothing-here.json", sync_json(tmp_path / "sync.json"), tmp_path / "x.png")
    with pytest.raises(ValueError, match="sync.json"):  # the two files swapped
        plot(sync_json(tmp_path / "sync.json"), rollout_json(tmp_path / "rollout.json"), tmp_path / "x.png")
