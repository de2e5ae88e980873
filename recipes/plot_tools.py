"""Paper-style plots of multi-turn tool runs (`tools`) from their metrics.jsonl files, and a summary table.

    python recipes/plot_tools.py results/tiny-cpu-tools results/tiny-cpu-tools-retokenized \
        results/tiny-cpu-tools-server --out results/grpo_tools.png

Panels, per turn of the episodes (turn 1: the first model turn; turn 2: the one after the first tool result): the
mean |vLLM − trainer| log-prob of the model's tokens, and the worst token's trainer-over-vLLM probability ratio
(max(ratio, 1/ratio): 1 when the trainer scores exactly what the engine sampled); the share of episodes whose
re-rendered, re-tokenized conversation differs from the sampled ids; tool calls per episode; mean reward; held-out
accuracy (greedy: dots, sampled: crosses) and the share of held-out episodes that got a tool result (greedy). The
table (printed, and written beside the PNG as JSON) gives each run's figures, first and last.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.figures import label, paper_style, read_config, read_metrics, save_figure, split  # noqa: E402

TURNS = {"turn1": "turn 1", "turn2": "turn 2"}
EVAL_KEYS = ("eval_reward_greedy", "eval_reward_sampled", "eval_tool_success_greedy", "eval_tool_success_sampled")


def worst_ratio(row: dict, turn: str) -> float:
    """The token of ``turn`` whose trainer-over-vLLM probability ratio is furthest from 1, as max(r, 1/r)."""
    return max(row[f"is_ratio_{turn}_max"], 1 / row[f"is_ratio_{turn}_min"])


def tool_label(rows: list[dict], config: dict) -> str:
    calling = config.get("tool_calling") or {}
    how = "re-tokenized" if calling.get("retokenize") else "token in / token out"
    return f"{how}, {label(rows, config)}"


def plot(runs: list[Path], out: Path) -> Path:
    paper_style()
    fig, axes = plt.subplots(2, 4, figsize=(11, 4.8), constrained_layout=True)
    (diff_ax, ratio_ax, drift_ax, calls_ax), (reward_ax, eval_ax, success_ax, legend_ax) = axes
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        rows, evals = split(read_metrics(run))
        name, color = tool_label(rows, read_config(run)), colors[i % len(colors)]
        steps = [r["rollout_step"] for r in rows]
        for turn, style in zip(TURNS, ("-", "--")):
            have = [r for r in rows if f"rollout_logprob_diff_{turn}" in r]
            x = [r["rollout_step"] for r in have]
            diff_ax.plot(x, [max(r[f"rollout_logprob_diff_{turn}"], 1e-12) for r in have], style, color=color)
            ratio_ax.plot(x, [worst_ratio(r, turn) for r in have], style, color=color)
        drift_ax.plot(steps, [r["retokenization_drift"] for r in rows], color=color)
        calls_ax.plot(steps, [r["tools/call_frequency"] for r in rows], color=color)
        reward_ax.plot(steps, [r["reward_mean"] for r in rows], color=color, label=name)
        eval_steps = [r["rollout_step"] for r in evals]
        eval_ax.plot(eval_steps, [r["eval_reward_greedy"] for r in evals], "-o", color=color, markersize=3)
        eval_ax.plot(eval_steps, [r["eval_reward_sampled"] for r in evals], "--x", color=color, markersize=4)
        success_ax.plot(eval_steps, [r["eval_tool_success_greedy"] for r in evals], "-o", color=color, markersize=3)
        success_ax.plot(eval_steps, [r["eval_tool_success_sampled"] for r in evals], "--x", color=color, markersize=4)
    for ax, title, log in [
        (diff_ax, "|vLLM − trainer|: turn 1 —, turn 2 --", True),
        (ratio_ax, "worst token's trainer/vLLM ratio", True),
        (drift_ax, "re-tokenized ≠ sampled (episodes)", False),
        (calls_ax, "tool calls per episode", False),
        (reward_ax, "mean reward", False),
        (eval_ax, "held-out accuracy", False),
        (success_ax, "held-out episodes with a tool result", False),
    ]:
        ax.set_title(title)
        ax.set_xlabel("rollout step")
        if log:
            ax.set_yscale("log")
    ratio_ax.axhline(1.0, color="black", linewidth=0.6, linestyle="--")
    legend_ax.axis("off")
    legend_ax.legend(
        *reward_ax.get_legend_handles_labels(),
        loc="center",
        frameon=False,
        fontsize=8,
        title="held-out: • greedy, × sampled",
    )
    return save_figure(fig, out)


def summary(runs: list[Path]) -> list[dict]:
    """Per run: the fidelity figures' worst step per turn, the drift, tool use and accuracy first and last."""
    table = []
    for run in runs:
        rows, evals = split(read_metrics(run))
        row = dict(run=str(run), label=tool_label(rows, read_config(run)), steps=len(rows))
        for turn in TURNS:
            have = [r for r in rows if f"rollout_logprob_diff_{turn}" in r]
            row[f"max_rollout_logprob_diff_{turn}"] = max(r[f"rollout_logprob_diff_{turn}"] for r in have)
            row[f"max_worst_ratio_{turn}"] = max(worst_ratio(r, turn) for r in have)
        row.update(
            max_ratio_onpolicy_maxdev=max(r["ratio_onpolicy_maxdev"] for r in rows),
            mean_retokenization_drift=sum(r["retokenization_drift"] for r in rows) / len(rows),
            tool_calls_per_episode_first=rows[0]["tools/call_frequency"],
            tool_calls_per_episode_last=rows[-1]["tools/call_frequency"],
        )
        for key in EVAL_KEYS:
            row[f"{key}_first"], row[f"{key}_last"] = (evals[0][key], evals[-1][key]) if evals else (None, None)
        table.append(row)
    return table


def print_table(table: list[dict]) -> None:
    print(
        "| run | max \\|vLLM − trainer\\| turn 1 / turn 2 | worst ratio turn 1 / turn 2 | drift | held-out greedy "
        "| held-out sampled | tool results (greedy) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in table:
        held_out = [
            f"{r[key + '_first']:.3f} -> {r[key + '_last']:.3f}" if r[key + "_first"] is not None else "-"
            for key in EVAL_KEYS[:3]
        ]
        print(
            f"| {r['label']} (`{r['run']}`) | {r['max_rollout_logprob_diff_turn1']:.2g} / "
            f"{r['max_rollout_logprob_diff_turn2']:.2g} | {r['max_worst_ratio_turn1']:.4g} / "
            f"{r['max_worst_ratio_turn2']:.4g} | {r['mean_retokenization_drift']:.3f} | {' | '.join(held_out)} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="tool runs' folders (or metrics.jsonl files)")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_tools.png"))
    args = parser.parse_args()
    print(plot(args.runs, args.out))
    table = summary(args.runs)
    print_table(table)
    args.out.with_suffix(".json").write_text(json.dumps(table, indent=2))
