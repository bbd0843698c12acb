"""The drawing helpers every figure of the package shares (matplotlib, Agg backend): the tasks' own
figures and the trainer's run plots (``geoattn.training.plots``) both draw through them, so they sit at
the task layer, below training."""

from __future__ import annotations

from pathlib import Path


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path, *, dpi: int = 110) -> Path:
    """Lay out ``fig``, write it to ``path`` as PNG and close it (pyplot keeps open figures): ``path``."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path
