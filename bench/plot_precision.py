"""Paper-style plot of the precision benchmark, from its JSON alone.

    python bench/plot_precision.py results/bench_precision.json --out results/bench_precision.png

One row per model (Qwen3-4B's shape, the 25.2M "small" model), against the update size in bf16 ulps of W: (a) the
share of the LoRA's own log-prob change each mode reproduces (1 = all of it), with the share of the update's energy that
the merged cast keeps in the weights (`sync_delta_kept`, grey); (b) the mean |log-prob error| against fp32 W + Δ;
(c) mean |vLLM − trainer|. Colours are the modes; bf16 solid, fp16 dashed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.figures import paper_style, save_figure  # noqa: E402

MODES = {
    "vllm_merged": "vLLM, merged weights",
    "vllm_adapter": "vLLM, adapter (LoRARequest)",
    "trainer": "trainer (autocast, fp32 LoRA)",
    "merged_weights_fp32_compute": "merged weights, fp32 compute",
}
DTYPES = {"bfloat16": ("bf16", "-"), "float16": ("fp16", "--")}
MODELS = {"qwen3-4b-2layers": "Qwen3-4B shape, 2 layers", "small": "small model (25.2M)", "tiny": "tiny model"}


def plot(data: dict, out: Path) -> Path:
    paper_style()
    runs = data["runs"]
    fig, axes = plt.subplots(len(runs), 3, figsize=(11.0, 2.7 * len(runs)), constrained_layout=True, squeeze=False)
    for row, run in zip(axes, runs):
        for dtype, (short, style) in DTYPES.items():
            points = sorted(
                (r for r in run["results"] if r["dtype"] == dtype and r["update_ulps"] > 0),
                key=lambda r: r["update_ulps"],
            )
            if not points:
                continue
            x = [r["update_ulps"] for r in points]
            for j, (mode, name) in enumerate(MODES.items()):
                if mode not in points[0]:
                    continue
                kw = dict(
                    color=f"C{j}", linestyle=style, marker="o", markersize=2.5, linewidth=1, label=f"{name}, {short}"
                )
                row[0].plot(x, [r[mode]["update_share"] for r in points], **kw)
                row[1].plot(x, [r[mode]["mean_abs_err"] for r in points], **kw)
                if "vllm_minus_trainer" in points[0][mode]:
                    row[2].plot(x, [r[mode]["vllm_minus_trainer"] for r in points], **kw)
            row[0].plot(
                x,
                [r.get("sync_delta_kept", float("nan")) for r in points],
                color="grey",
                linestyle=style,
                linewidth=1.5,
                alpha=0.6,
                label=f"update kept in the merged weights, {short}",
            )
        title = MODELS.get(run["model"], run["model"])
        row[0].set_title(f"{title}: share of the LoRA's log-prob change", fontsize=8)
        row[0].axhline(1.0, color="black", linewidth=0.6)
        row[0].set_ylim(-0.5, 2.0)
        row[1].set_title(f"{title}: mean |log-prob − fp32 W+Δ|", fontsize=8)
        row[1].set_yscale("log")
        row[2].set_title(f"{title}: mean |vLLM − trainer|", fontsize=8)
        row[2].set_yscale("log")
        for ax in row:
            ax.set_xscale("log")
            ax.set_xlabel("update RMS / RMS bf16 ulp of W")
    fig.legend(*axes[0][0].get_legend_handles_labels(), loc="outside lower center", ncol=3, frameon=False, fontsize=7)
    return save_figure(fig, out)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bench", type=Path, help="bench_precision.json")
    parser.add_argument("--out", type=Path, default=Path("results/bench_precision.png"))
    args = parser.parse_args()
    data = json.loads(args.bench.read_text())
    if "runs" not in data:
        raise SystemExit(f"error: {args.bench} has no 'runs': is it bench/bench_precision.py's output?")
    print(plot(data, args.out))
