"""How the plots of `results/` are written (recipes/plot_metrics.py, bench/plot_*.py): one place for the file format."""

from __future__ import annotations

from pathlib import Path


def save_figure(fig, out: Path) -> Path:
    """Write ``fig`` to ``out`` (150 dpi, folders created) and free it; returns ``out``."""
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out
