"""Paper-style bar plots of the two benchmarks, from their JSON files alone.

    python bench/plot_bench.py results/bench_rollout.json results/bench_sync.json --out results/bench.png

Panels: (a) rollout tokens/s of base weights, merged LoRA and vLLM LoRA for each model size and dtype
(bench/bench_rollout.py), labelled with merged/base and merged/LoRA; (b) seconds per weight sync for each
sync method and (c) its peak extra memory in units of the largest decoder layer, with the iterator drained
and with the real vLLM push (bench/bench_sync.py).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.figures import paper_style, save_figure  # noqa: E402

MODES = [("base", "base weights"), ("merged", "merged LoRA"), ("lora", "vLLM LoRA")]
METHODS = {
    "merged_lora_params": "ours\n(layer-\nwise)",
    "plain_push": "plain\npush\n(floor)",
    "trl_merge_unmerge": "TRL\nmerge+\nunmerge",
    "full_state_dict": "full\nstate\ndict",
    "trl_integration": "ours\nin TRL\n(merge.trl)",
}
DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def read_json(path: Path, key: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    data = json.loads(path.read_text())
    if key not in data:
        raise ValueError(f"{path} has no {key!r}: is it the right benchmark's output?")
    return data


def rollout_panel(ax, rollout: dict) -> None:
    results = rollout["results"]
    width = 0.26
    for j, (mode, name) in enumerate(MODES):
        xs = [i + (j - 1) * width for i in range(len(results))]
        ax.bar(xs, [r["tokens_per_s"].get(mode) or 0 for r in results], width, label=name, color=f"C{j}")
    for i, r in enumerate(results):
        top = max(v for v in r["tokens_per_s"].values() if v)
        lora = f"{r['merged_over_lora']:.1f}× LoRA" if r.get("merged_over_lora") else "no LoRA"
        ax.text(i, top * 1.15, f"{r['merged_over_base']:.2f}× base\n{lora}", ha="center", va="bottom", fontsize=5.5)
    ax.set_yscale("log")
    ax.set_ylim(top=max(max(v for v in r["tokens_per_s"].values() if v) for r in results) * 6)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels(
        [f"{r['size']}\n{DTYPES.get(r['dtype'], r['dtype'])}\n{r['parameters'] / 1e6:.1f}M" for r in results],
        fontsize=6,
    )
    ax.set_ylabel("tokens / s (median)")
    ax.set_title("(a) rollout throughput")
    ax.legend(frameon=False, fontsize=6, loc="upper right", ncol=3, handlelength=1, columnspacing=0.8)


def sync_panels(ax_time, ax_mem, sync: dict) -> None:
    methods = [m for m in METHODS if m in sync["methods"]]
    values = [sync["methods"][m] for m in methods]
    labels = [METHODS[m] for m in methods]
    colors = ["C2" if m in ("merged_lora_params", "trl_integration") else "0.6" for m in methods]
    xs = range(len(methods))
    ax_time.bar(xs, [v["median_s"] for v in values], 0.6, color=colors)
    for x, v in zip(xs, values):
        ax_time.text(x, v["median_s"], f"{v['over_plain_push']:.2f}×", ha="center", va="bottom", fontsize=6)
    ax_time.set_xticks(list(xs))
    ax_time.set_xticklabels(labels, fontsize=6)
    ax_time.set_ylabel("seconds per sync (median; label: × plain push)")
    ax_time.set_title(
        f"(b) weight sync time ({sync['settings']['parameters'] / 1e6:.1f}M, FSDP2 x2)"
        if "settings" in sync
        else "(b) weight sync time"
    )

    width = 0.38
    for j, (consumer, name) in enumerate([("drain", "iterator drained"), ("vllm_push", "vLLM push")]):
        heights = [v["peak_extra_layers"][consumer] for v in values]
        ax_mem.bar([x + (j - 0.5) * width for x in xs], heights, width, label=name, color=f"C{j + 4}")
    floor = sync.get("unshard_only_peak_extra_layers")
    if floor is not None:
        ax_mem.axhline(floor, color="black", linewidth=0.6, linestyle=":", label="unshard() alone")
    ax_mem.axhline(1.5, color="C3", linewidth=0.8, linestyle="--", label="target 1.5")
    ax_mem.set_xticks(list(xs))
    ax_mem.set_xticklabels(labels, fontsize=6)
    ax_mem.set_ylabel("peak extra memory (largest layers)")
    ax_mem.set_title("(c) weight sync memory")
    ax_mem.legend(frameon=False, fontsize=6)


def plot(rollout_json: Path, sync_json: Path, out: Path) -> Path:
    rollout = read_json(Path(rollout_json), "results")
    sync = read_json(Path(sync_json), "methods")
    paper_style()
    fig, axes = plt.subplots(
        1, 3, figsize=(11.5, 3.4), constrained_layout=True, gridspec_kw=dict(width_ratios=[1.7, 1, 1])
    )
    rollout_panel(axes[0], rollout)
    sync_panels(axes[1], axes[2], sync)
    return save_figure(fig, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rollout", type=Path, help="results/bench_rollout.json (bench/bench_rollout.py)")
    parser.add_argument("sync", type=Path, help="results/bench_sync.json (bench/bench_sync.py)")
    parser.add_argument("--out", type=Path, default=Path("results/bench.png"))
    args = parser.parse_args()
    print(plot(args.rollout, args.sync, args.out))
