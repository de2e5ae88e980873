"""How the plots of `results/` look and are written (recipes/plot_metrics.py, bench/plot_*.py): one figure style
and one file format. matplotlib is imported inside the functions only: nothing on the training path loads it."""

from __future__ import annotations

from pathlib import Path

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
