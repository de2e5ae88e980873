"""Plots of environment runs (`environment_factory`) compared by advantage mode across seeds, and a summary table.

    python recipes/plot_env.py results/tiny-cpu-env-episode-s{0,1,2} results/tiny-cpu-env-turn-s{0,1,2} \
        --out results/grpo_env.png

Runs are grouped by their config's `advantage` (episode, turn, state). Panels: held-out success (sampled at the training
temperature, and greedy) against rollout steps, each mode's mean across its seeds with its standard error; mean
training reward (outcome and step rewards); the worst per-turn mean |vLLM − trainer| of each step (turns 3 and on
in the recipe's buckets: 3-4, 5-8, 9-16). The table (printed, and written beside the PNG as JSON) has a row per run
(its held-out success at each evaluation, its fidelity) and a row per mode, ``results/<the runs' common name>*``
(each evaluation's mean and standard error across the seeds), and says when the turn mode's mean first reached the
episode mode's final mean.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from grpo.figures import paper_style, read_config, read_metrics, save_figure, split  # noqa: E402

TURN_DIFF = re.compile(r"rollout_logprob_diff_(turns?\d+(?:to\d+)?)$")  # turn1, turn2, turns3to4, turns5to8, ...
MODES = ("episode", "turn", "state")  # RecipeConfig.advantage's choices, in the plots' colour order


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (the sample std over sqrt(n); 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else 0.0)


def run_row(run: Path) -> dict:
    rows, evals = split(read_metrics(run))
    turn_means = [v for r in rows for k, v in r.items() if TURN_DIFF.match(k)]
    turns = {TURN_DIFF.match(k).group(1) for r in rows for k in r if TURN_DIFF.match(k)}
    config = read_config(run)
    return dict(
        run=str(run),
        advantage=config.get("advantage", "episode"),
        seed=config.get("seed"),
        steps=len(rows),
        eval_steps=[r["rollout_step"] for r in evals],
        eval_success_sampled=[r["eval_reward_sampled"] for r in evals],
        eval_success_greedy=[r["eval_reward_greedy"] for r in evals],
        reward_mean=[r["reward_mean"] for r in rows],
        turns_scored=sorted(turns, key=lambda t: int(re.search(r"\d+", t).group())),
        max_turn_logprob_diff=max(turn_means),
        max_token_logprob_diff=max(r["rollout_logprob_diff_max"] for r in rows),
        max_ratio_onpolicy_maxdev=max(r["ratio_onpolicy_maxdev"] for r in rows),
        env_failure_frequency=max(r.get("env/failure_frequency", 0.0) for r in rows),
    )


def mode_row(mode: str, runs: list[dict]) -> dict:
    """Each evaluation's mean and standard error across ``runs`` (one advantage mode, its seeds)."""
    steps = runs[0]["eval_steps"]
    if any(r["eval_steps"] != steps for r in runs):
        raise ValueError(f"advantage={mode}: the runs evaluated at different steps: {[r['eval_steps'] for r in runs]}")
    prefix = Path(runs[0]["run"]).parent / re.sub(r"\d+$", "", Path(runs[0]["run"]).name)
    row = dict(run=f"{prefix}*", advantage=mode, seeds=[r["seed"] for r in runs], eval_steps=steps)
    for what in ("sampled", "greedy"):
        stats = [mean_and_error([r[f"eval_success_{what}"][i] for r in runs]) for i in range(len(steps))]
        row[f"success_{what}_mean"] = [m for m, _ in stats]
        row[f"success_{what}_error"] = [e for _, e in stats]
        row[f"success_{what}_first"], row[f"success_{what}_first_error"] = stats[0]
        row[f"success_{what}_last"], row[f"success_{what}_last_error"] = stats[-1]
        for step, (mean, error) in zip(steps, stats):
            row[f"success_{what}_at_{step}"], row[f"success_{what}_at_{step}_error"] = mean, error
    row["max_turn_logprob_diff"] = max(r["max_turn_logprob_diff"] for r in runs)
    row["max_ratio_onpolicy_maxdev"] = max(r["max_ratio_onpolicy_maxdev"] for r in runs)
    return row


def summary(runs: list[Path]) -> list[dict]:
    per_run = [run_row(run) for run in runs]
    modes = {mode: mode_row(mode, rows) for mode in MODES if (rows := [r for r in per_run if r["advantage"] == mode])}
    table = per_run + list(modes.values())
    if "episode" in modes and "turn" in modes:
        episode, turn = modes["episode"], modes["turn"]
        target = episode["success_sampled_last"]
        reached = [s for s, m in zip(turn["eval_steps"], turn["success_sampled_mean"]) if m >= target]
        turn["reaches_episode_final_at_step"] = reached[0] if reached else None
        turn["reaches_episode_final_share"] = reached[0] / episode["eval_steps"][-1] if reached else None
    return table


def plot(table: list[dict], out: Path) -> Path:
    paper_style()
    fig, (sampled_ax, greedy_ax, reward_ax, diff_ax) = plt.subplots(1, 4, figsize=(12, 3.2), constrained_layout=True)
    colors = dict(zip(MODES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    for row in table:
        if "seeds" in row:  # a mode's row: mean and standard error across seeds
            for ax, what in ((sampled_ax, "sampled"), (greedy_ax, "greedy")):
                mean, error = row[f"success_{what}_mean"], row[f"success_{what}_error"]
                ax.errorbar(row["eval_steps"], mean, yerr=error, color=colors[row["advantage"]], marker="o", capsize=3)
            continue
        color = colors[row["advantage"]]
        steps = range(1, row["steps"] + 1)
        name = f"{row['advantage']}, seed {row['seed']}"
        reward_ax.plot(steps, row["reward_mean"], color=color, alpha=0.6, label=name)
        rows, _ = split(read_metrics(Path(row["run"])))
        worst = [max(v for k, v in r.items() if TURN_DIFF.match(k)) for r in rows]
        diff_ax.plot(steps, worst, color=color, alpha=0.6)
    for ax, title in [
        (sampled_ax, "held-out success, sampled (mean ± s.e.)"),
        (greedy_ax, "held-out success, greedy (mean ± s.e.)"),
        (reward_ax, "mean reward (outcome + steps)"),
        (diff_ax, "worst turn's mean |vLLM − trainer|"),
    ]:
        ax.set_title(title)
        ax.set_xlabel("rollout step")
    diff_ax.set_yscale("log")
    reward_ax.legend(fontsize=6, frameon=False)
    return save_figure(fig, out)


def print_table(table: list[dict]) -> None:
    print("| advantage | seeds | held-out success sampled, first -> last | greedy, first -> last | worst turn diff |")
    print("|---|---|---|---|---|")
    for r in table:
        if "seeds" in r:
            print(
                f"| {r['advantage']} | {len(r['seeds'])} | {r['success_sampled_first']:.3f} ± "
                f"{r['success_sampled_first_error']:.3f} -> {r['success_sampled_last']:.3f} ± "
                f"{r['success_sampled_last_error']:.3f} | {r['success_greedy_first']:.3f} -> "
                f"{r['success_greedy_last']:.3f} | {r['max_turn_logprob_diff']:.2g} |"
            )
    turn = next((r for r in table if r.get("advantage") == "turn" and "seeds" in r), None)
    if turn is not None and "reaches_episode_final_at_step" in turn:
        step = turn["reaches_episode_final_at_step"]
        print(f"turn credit reaches the episode mode's final sampled success at rollout step {step}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="environment runs' folders")
    parser.add_argument("--out", type=Path, default=Path("results/grpo_env.png"))
    args = parser.parse_args()
    table = summary(args.runs)
    print(plot(table, args.out))
    print_table(table)
    args.out.with_suffix(".json").write_text(json.dumps(table, indent=2))
