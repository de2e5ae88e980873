"""How the plots of `results/` read their runs, look and are written (recipes/plot_metrics.py, recipes/plot_tools.py,
bench/plot_*.py): a run folder's metrics and config, one figure style and one file format. matplotlib is imported
inside the functions only: nothing on the training path loads it."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

# The one style of every plot: serif 8 pt, no top or right spine, a light grid drawn behind the data.
PAPER_STYLE = {
    "font.family": "serif",
    "font.size": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.axisbelow": True,
}


def paper_style() -> None:
    """Set matplotlib's rcParams to PAPER_STYLE; each plot calls it before it draws."""
    import matplotlib

    matplotlib.rcParams.update(PAPER_STYLE)


def save_figure(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (150 dpi, folders created) and free it; returns ``out``."""
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def read_metrics(run: Path) -> list[dict]:
    path = run / "metrics.jsonl" if run.is_dir() else run
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (give a run folder holding metrics.jsonl, or the file)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path} holds no metrics")
    return rows


def label(rows: list[dict], config: dict) -> str:
    """What tells a run apart: how vLLM serves the policy (and where, how far ahead, with which correction), the
    trainer, the padding rule, the dtype, an MoE model."""
    first = rows[0]
    text = (
        "TRL GRPOTrainer + merged sync"
        if first.get("trainer") == "trl"
        else ("merged weights" if first.get("merge") else "vLLM LoRA")
    )
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    dtype = model.get("dtype") or config.get("dtype")
    # the standalone recipe's attention when not its default (TRL's trainer runs padded batches)
    attention = model.get("attn_implementation") or "packed_sdpa"
    vllm = config.get("vllm") if isinstance(config.get("vllm"), dict) else {}
    correction = config.get("vllm_importance_sampling_mode", "sequence_mask")
    extras = [
        ("vllm serve" if vllm.get("mode") == "server" else None),
        (f"max_staleness={config['max_staleness']}" if config.get("max_staleness") else None),
        (correction if config.get("max_staleness") and correction != "sequence_mask" else None),
        ("legacy padding" if first.get("legacy_slice") else None),
        ({"bfloat16": "bf16", "float16": "fp16"}.get(dtype)),
        ("MoE" if "moe" in str(model.get("build_tiny")) else None),
        (f"{attention} attention" if attention != "packed_sdpa" and first.get("trainer") != "trl" else None),
    ]
    return ", ".join([text, *(e for e in extras if e)])


def read_config(run: Path) -> dict:
    """The run's config.yaml (beside its metrics.jsonl), or {} when there is none."""
    path = (run if run.is_dir() else run.parent) / "config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def split(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the rollout steps' lines, the evaluation lines) of a metrics.jsonl."""
    return [r for r in rows if "reward_mean" in r], [r for r in rows if "eval_reward_greedy" in r]
