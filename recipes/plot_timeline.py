"""When the trainer and the server were busy, from the timeline.jsonl of server-mode runs (one row pair per run).

    python recipes/plot_timeline.py results/tiny-cpu-server-async1 --steps 4 9 --out results/timeline_async.png

A run writes <run_dir>/timeline.jsonl (vllm.mode=server), one line per rollout step, as rank 0 saw it: the trainer's
sync, its wait for the rollout (``rollout``: the time it waited, which is all of the generation when synchronous) and
its update (rewards, old log-probs, optimizer steps), and each of rank 0's requests from sent to answered. The server
row is their union: every request that ran between the first drawn step's sync and the last one's update, those sent
ahead for later rollout steps included. With max_staleness >= 1 the server's bars run under the trainer's updates.
The figure's rollout steps (--steps first last) and the busy fractions over them are printed, and written beside the
PNG as JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from grpo.engines.rollout_queue import union_intervals  # noqa: E402
from grpo.figures import paper_style, save_figure  # noqa: E402
from grpo.metrics import busy_fractions  # noqa: E402

COLORS = {"sync": "#d95f02", "rollout": "#bbbbbb", "update": "#1b9e77", "server": "#7570b3"}


def read_timeline(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "timeline.jsonl").read_text().splitlines()]


def label(run_dir: Path) -> str:
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    staleness = config.get("max_staleness", 0)
    return f"{run_dir.name} (max_staleness={staleness})"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders holding timeline.jsonl")
    parser.add_argument("--steps", nargs=2, type=int, default=(2, 6), metavar=("FIRST", "LAST"))
    parser.add_argument("--out", type=Path, default=Path("timeline.png"))
    args = parser.parse_args(argv)
    paper_style()
    fig, axes = plt.subplots(len(args.runs), 1, figsize=(7, 1.4 * len(args.runs) + 0.4), squeeze=False)
    summary = {}
    for ax, run_dir in zip(axes[:, 0], args.runs):
        every = read_timeline(run_dir)
        lines = [line for line in every if args.steps[0] <= line["rollout_step"] <= args.steps[1]]
        if not lines:
            raise SystemExit(f"{run_dir}: no timeline lines for rollout steps {args.steps[0]}..{args.steps[1]}")
        origin, end = lines[0]["trainer"]["sync"][0], lines[-1]["trainer"]["update"][1]
        for t in lines:
            for name, (lo, hi) in t["trainer"].items():
                ax.barh(1, hi - lo, left=lo - origin, height=0.6, color=COLORS[name], edgecolor="none")
        for lo, hi in union_intervals([tuple(i) for t in every for i in t["server"]], origin, end):
            ax.barh(0, hi - lo, left=lo - origin, height=0.6, color=COLORS["server"], edgecolor="none")
        ax.set_yticks([0, 1], ["server", "trainer"])
        ax.set_title(label(run_dir), loc="left")
        ax.grid(axis="y", visible=False)
        summary[str(run_dir)] = busy_fractions(lines, every)
    axes[-1, 0].set_xlabel(f"seconds from the sync of rollout step {args.steps[0]}")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    names = ["trainer: sync", "trainer: waits for the rollout", "trainer: update", "server: requests in flight"]
    fig.legend(handles, names, loc="lower center", ncol=4, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_figure(fig, args.out)
    args.out.with_suffix(".json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
