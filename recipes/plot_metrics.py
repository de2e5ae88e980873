"""Paper-style plots of GRPO runs from their metrics.jsonl files (nothing else is read), and a summary table.

    python recipes/plot_metrics.py results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy \
        --out results/grpo_metrics.png

Panels: PPO ratio per step (log scale: the legacy padding path blows up), |vLLM - trainer| log-prob per
step, rollout tokens/s, mean reward, wall time of a whole step and of the weight sync. One line per run,
labelled from its metrics (merge on/off, legacy padding). The table (printed, and written beside the PNG as
JSON) gives each run's medians: the end-to-end step time of merge on vs off comes from the runs' own metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("ratio_mean", "PPO ratio (mean over tokens)", True),
    ("rollout_logprob_diff_mean", "|vLLM − trainer| log-prob", True),
    ("rollout_tokens_per_s", "rollout tokens / s", False),
    ("reward_mean", "mean reward", False),
    ("step_s", "step wall time (s)", False),
    ("sync_s", "weight sync (s)", True),
]
SUMMARY = ["step_s", "rollout_s", "sync_s", "update_s", "rollout_tokens_per_s"]


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (give a run folder holding metrics.jsonl, or the file)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no metrics")
    return rows


def label(rows: list[dict]) -> str:
    first = rows[0]
    text = "merged weights" if first.get("merge") else "vLLM LoRA"
    return text + (", legacy padding" if first.get("legacy_slice") else "")


def plot(runs: list[Path], out: Path) -> Path:
    plt.rcParams.update({"font.family": "serif", "font.size": 9, "axes.spines.top": False,
                         "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3})
    fig, axes = plt.subplots(2, 3, figsize=(9.0, 4.8), constrained_layout=True)
    styles = ["-", "--", ":", "-."]  # identical curves (merge on and off sample the same tokens) stay visible
    for i, run in enumerate(runs):
        rows = read_metrics(run)
        steps = [r["rollout_step"] for r in rows]
        for ax, (key, title, log) in zip(axes.flat, PANELS):
            values = [max(r.get(key, float("nan")), 1e-12) if log else r.get(key, float("nan")) for r in rows]
            line, = ax.plot(steps, values, linestyle=styles[i % len(styles)], marker="o", markersize=2,
                            linewidth=1, label=label(rows))
            if key == "ratio_mean" and "ratio_max" in rows[0]:  # the extreme token, thin, same colour
                ax.plot(steps, [r["ratio_max"] for r in rows], color=line.get_color(), linewidth=0.6, alpha=0.5)
            ax.set_title(title)
            ax.set_xlabel("rollout step")
            if log:
                ax.set_yscale("log")
    axes.flat[0].set_title("PPO ratio: mean (thick), max (thin)")
    axes.flat[0].axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    fig.legend(*axes.flat[0].get_legend_handles_labels(), loc="outside lower center", ncol=len(runs), frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def summary(runs: list[Path]) -> list[dict]:
    """Per run: median of the timing metrics over its steps (step 1 left out: it includes warm-up)."""
    table = []
    for run in runs:
        rows = read_metrics(run)
        steady = rows[1:] or rows
        table.append(dict(run=str(run), label=label(rows), steps=len(rows),
                          **{f"median_{key}": statistics.median(r[key] for r in steady) for key in SUMMARY if key in rows[0]},
                          max_abs_ratio_mean_minus_1=max(abs(r["ratio_mean"] - 1) for r in rows),
                          ratio_max=max(r["ratio_max"] for r in rows) if "ratio_max" in rows[0] else None))
    return table


def print_table(table: list[dict]) -> None:
    print("| run | steps | median step s | rollout s | sync s | update s | rollout tok/s | max abs(ratio_mean-1) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in table:
        cells = [f"{row.get('median_' + key, float('nan')):.3g}" for key in SUMMARY]
        print(f"| {row['label']} (`{row['run']}`) | {row['steps']} | {' | '.join(cells)} | "
              f"{row['max_abs_ratio_mean_minus_1']:.2g} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_metrics.png"))
    args = parser.parse_args()
    print(plot(args.runs, args.out))
    table = summary(args.runs)
    print_table(table)
    args.out.with_suffix(".json").write_text(json.dumps(table, indent=2))
