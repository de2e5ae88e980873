"""Paper-style plots of GRPO runs from their metrics.jsonl files (nothing else is read), and a summary table.

    python recipes/plot_metrics.py results/tiny-cpu-merge results/tiny-cpu-lora results/tiny-cpu-legacy \
        --out results/grpo_metrics.png

Panels: PPO ratio per rollout step (log scale: the legacy padding path blows up), |vLLM - trainer| log-prob,
rollout tokens/s, mean reward, held-out accuracy (greedy: dots, sampled at the training temperature: crosses;
from the runs' eval lines), wall time of a whole rollout step and of the weight sync. One line per run, labelled
from its metrics and config.yaml (merge on/off, legacy padding, TRL's trainer, bf16, MoE). Runs that merged below fp32
add a panel: the share of the LoRA update that the cast of the merged weights kept (sync_delta_kept). The table
(printed, and written beside the PNG as JSON) gives each run's medians and its reward and held-out accuracy at the start
and the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.figures import label, paper_style, read_config, read_metrics, save_figure, split  # noqa: E402

PANELS = [
    ("ratio_mean", "PPO ratio (mean over tokens)", True),
    ("rollout_logprob_diff_mean", "|vLLM − trainer| log-prob", True),
    ("rollout_tokens_per_s", "rollout tokens / s", False),
    ("reward_mean", "mean reward", False),
    ("eval_reward_greedy", "held-out accuracy", False),
    ("step_s", "rollout step wall time (s)", False),
    ("sync_s", "weight sync (s)", True),
]
# drawn when a run has it: merged weights below fp32 (the share of the LoRA update the cast keeps, every sync)
PRECISION_PANEL = ("sync_delta_kept", "LoRA update kept by the merge's cast", False)
SUMMARY = ["step_s", "rollout_s", "sync_s", "update_s", "rollout_tokens_per_s"]


def plot(runs: list[Path], out: Path, only: list[str] | None = None) -> Path:
    """The panels for ``runs`` into ``out``; ``only``: just the panels of these metric names, in PANELS' order."""
    paper_style()
    panels = PANELS + [PRECISION_PANEL] * any(PRECISION_PANEL[0] in row for run in runs for row in read_metrics(run))
    if only:
        every = PANELS + [PRECISION_PANEL]
        unknown = sorted(set(only) - {key for key, _, _ in every})
        if unknown:
            raise ValueError(f"--panels {unknown}: not a panel; choose from {[key for key, _, _ in every]}")
        panels = [panel for panel in every if panel[0] in only]
    ncols = min(4, len(panels) + 1)
    nrows = -(-(len(panels) + 1) // ncols)  # and one cell for the legend
    fig, axes = plt.subplots(nrows, ncols, figsize=(2.75 * ncols, 2.4 * nrows), constrained_layout=True, squeeze=False)
    styles = ["-", "--", ":", "-."]  # identical curves (merge on and off sample the same tokens) stay visible
    for i, run in enumerate(runs):
        rows, evals = split(read_metrics(run))
        for ax, (key, title, log) in zip(axes.flat, panels):
            source = evals if key.startswith("eval_") else rows
            steps = [r["rollout_step"] for r in source]
            values = [r.get(key, float("nan")) for r in source]
            values = [max(v, 1e-12) for v in values] if log else values
            (line,) = ax.plot(
                steps,
                values,
                linestyle=styles[i % len(styles)],
                marker="o",
                markersize=2,
                linewidth=1,
                label=label(rows, read_config(run)),
            )
            if key == "ratio_mean" and "ratio_max" in rows[0]:  # the extreme token, thin, same colour
                ax.plot(steps, [r["ratio_max"] for r in rows], color=line.get_color(), linewidth=0.6, alpha=0.5)
            if key == "eval_reward_greedy":  # sampled at the training temperature, dashed, same colour
                ax.plot(
                    steps,
                    [r["eval_reward_sampled"] for r in source],
                    color=line.get_color(),
                    linewidth=1,
                    linestyle=styles[i % len(styles)],
                    marker="x",
                    markersize=4,
                )
            ax.set_title(title)
            ax.set_xlabel("rollout step")
            if log:
                ax.set_yscale("log")
            else:
                ax.ticklabel_format(axis="y", useOffset=False)  # 0.99999 reads as itself, not as 1e-5 + 1
    titles = {
        "ratio_mean": "PPO ratio: mean (thick), max (thin)",
        "eval_reward_greedy": "held-out acc.: greedy •, sampled ×",
    }
    for ax, (key, _, _) in zip(axes.flat, panels):
        ax.set_title(titles.get(key, ax.get_title()))
        if key == "ratio_mean":
            ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    for ax in axes.flat[len(panels) :]:
        ax.axis("off")
    axes.flat[-1].legend(*axes.flat[0].get_legend_handles_labels(), loc="center", frameon=False, fontsize=8)
    return save_figure(fig, out)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(runs: list[Path]) -> list[dict]:
    """Per run: medians of the timing metrics (rollout step 1 left out: it includes warm-ups), the largest
    deviations of the fidelity metrics, the mean reward of the first and last 10 rollout steps, held-out accuracy
    at the first and last evaluation."""
    table = []
    for run in runs:
        rows, evals = split(read_metrics(run))
        steady = rows[1:] or rows
        row = dict(
            run=str(run),
            label=label(rows, read_config(run)),
            steps=len(rows),
            **{f"median_{key}": statistics.median(r[key] for r in steady) for key in SUMMARY if key in rows[0]},
            max_rollout_logprob_diff_mean=max(r["rollout_logprob_diff_mean"] for r in rows),
            reward_first_10=_mean([r["reward_mean"] for r in rows[:10]]),
            reward_last_10=_mean([r["reward_mean"] for r in rows[-10:]]),
        )
        if "ratio_mean" in rows[0]:
            row.update(
                max_abs_ratio_mean_minus_1=max(abs(r["ratio_mean"] - 1) for r in rows),
                ratio_max=max(r["ratio_max"] for r in rows),
            )
        if "ratio_onpolicy_maxdev" in rows[0]:
            row["max_ratio_onpolicy_maxdev"] = max(r["ratio_onpolicy_maxdev"] for r in rows)
        if evals:
            row.update(
                {
                    f"eval_{mode}_{when}": evals[i][f"eval_reward_{mode}"]
                    for mode in ("greedy", "sampled")
                    for when, i in (("first", 0), ("last", -1))
                }
            )
        table.append(row)
    return table


def print_table(table: list[dict]) -> None:
    print(
        "| run | steps | median step s | rollout s | sync s | update s | rollout tok/s | reward first 10 -> last 10 "
        "| held-out greedy | held-out sampled |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in table:
        cells = [f"{row.get('median_' + key, float('nan')):.3g}" for key in SUMMARY]
        held_out = [
            f"{row['eval_' + m + '_first']:.3f} -> {row['eval_' + m + '_last']:.3f}"
            if "eval_greedy_first" in row
            else "-"
            for m in ("greedy", "sampled")
        ]
        print(
            f"| {row['label']} (`{row['run']}`) | {row['steps']} | {' | '.join(cells)} | "
            f"{row['reward_first_10']:.3f} -> {row['reward_last_10']:.3f} | {' | '.join(held_out)} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_metrics.png"))
    parser.add_argument(
        "--panels", nargs="+", metavar="METRIC", help="only these panels (metric names), e.g. rollout_logprob_diff_mean"
    )
    args = parser.parse_args()
    print(plot(args.runs, args.out, args.panels))
    table = summary(args.runs)
    print_table(table)
    args.out.with_suffix(".json").write_text(json.dumps(table, indent=2))
