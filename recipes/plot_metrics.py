"""Paper-style plots of GRPO runs from their metrics.jsonl files (nothing else is read).

    python recipes/plot_metrics.py results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy \
        --out results/grpo_metrics.png

Panels: PPO ratio per step (log scale: the legacy padding path blows up), |vLLM - trainer| log-prob per
step, rollout tokens/s per step, and mean reward per step. One line per run, labelled from its metrics
(merge on/off, legacy padding).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [
    ("ratio_mean", "PPO ratio (mean over tokens)", True),
    ("rollout_logprob_diff_mean", "|vLLM − trainer| log-prob", True),
    ("rollout_tokens_per_s", "rollout tokens / s", False),
    ("reward_mean", "mean reward", False),
]


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
    fig, axes = plt.subplots(2, 2, figsize=(7.0, 4.6), constrained_layout=True)
    for run in runs:
        rows = read_metrics(run)
        steps = [r["step"] for r in rows]
        for ax, (key, title, log) in zip(axes.flat, PANELS):
            values = [max(r[key], 1e-12) if log else r[key] for r in rows]
            ax.plot(steps, values, marker="o", markersize=2, linewidth=1, label=label(rows))
            ax.set_title(title)
            ax.set_xlabel("step")
            if log:
                ax.set_yscale("log")
    axes.flat[0].axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    axes.flat[0].legend(frameon=False, fontsize=7)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_metrics.png"))
    args = parser.parse_args()
    print(plot(args.runs, args.out))
