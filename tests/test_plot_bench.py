"""plot_bench renders headless (Agg) from the two benchmark JSON files alone (small synthetic ones here), and draws
what they hold."""

import json

import matplotlib.image
import plot_bench
import pytest
from plot_bench import plot


def rollout_json(path):
    results = []
    for size, scale in (("tiny", 5.0), ("small", 1.0)):
        for dtype in ("float32", "bfloat16"):
            tps = dict(base=1000.0 * scale, merged=990.0 * scale, lora=300.0 * scale)
            results.append(
                dict(
                    size=size,
                    dtype=dtype,
                    parameters=1e6 * scale,
                    tokens_per_s=tps,
                    merged_over_base=tps["merged"] / tps["base"],
                    merged_over_lora=tps["merged"] / tps["lora"],
                )
            )
    path.write_text(json.dumps(dict(command="python bench/bench_rollout.py", results=results)))
    return path


def sync_json(path):
    methods = {}
    for name, seconds, drain, push in (
        ("merged_lora_params", 0.46, 2.0, 2.4),
        ("plain_push", 0.42, 2.0, 2.4),
        ("trl_merge_unmerge", 0.83, 0.7, 1.5),
        ("full_state_dict", 0.63, 8.4, 9.2),
    ):
        methods[name] = dict(
            median_s=seconds, over_plain_push=seconds / 0.42, peak_extra_layers=dict(drain=drain, vllm_push=push)
        )
    path.write_text(
        json.dumps(
            dict(
                command="python bench/bench_sync.py",
                methods=methods,
                settings=dict(parameters=2.6e7),
                unshard_only_peak_extra_layers=2.0,
            )
        )
    )
    return path


def test_plot_bench_draws_the_benchmarks_figures(tmp_path, monkeypatch):
    rollout, sync = rollout_json(tmp_path / "rollout.json"), sync_json(tmp_path / "sync.json")
    out = plot(rollout, sync, tmp_path / "plots" / "b.png")
    image = matplotlib.image.imread(out)
    assert image.shape[0] > 400 and image.shape[1] > 1000
    figures = []
    monkeypatch.setattr(plot_bench, "save_figure", lambda fig, out: figures.append(fig) or out)
    plot(rollout, sync, tmp_path / "b.png")
    throughput, seconds, memory = figures[0].axes
    results, methods = json.loads(rollout.read_text())["results"], json.loads(sync.read_text())["methods"]
    heights = [bar.get_height() for bar in throughput.patches]  # the bars of base, then merged, then lora
    assert heights == [r["tokens_per_s"][mode] for mode in ("base", "merged", "lora") for r in results]
    labels = [t.get_text() for t in throughput.texts]
    assert labels == [f"{r['merged_over_base']:.2f}× base\n{r['merged_over_lora']:.1f}× LoRA" for r in results]
    assert [bar.get_height() for bar in seconds.patches] == [m["median_s"] for m in methods.values()]
    assert [t.get_text() for t in seconds.texts] == [f"{m['over_plain_push']:.2f}×" for m in methods.values()]
    assert [bar.get_height() for bar in memory.patches] == [
        m["peak_extra_layers"][consumer] for consumer in ("drain", "vllm_push") for m in methods.values()
    ]


def test_missing_or_wrong_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing-here"):
        plot(tmp_path / "nothing-here.json", sync_json(tmp_path / "sync.json"), tmp_path / "x.png")
    with pytest.raises(ValueError, match="sync.json"):  # the two files swapped
        plot(sync_json(tmp_path / "sync.json"), rollout_json(tmp_path / "rollout.json"), tmp_path / "x.png")
