"""``linattn warmup`` with its ``--png`` plot: the theory's CLI plus the figure it draws.

The router sends ``warmup`` here so that ``linattn_theory`` itself never imports matplotlib;
matplotlib is imported only when ``--png`` is given, so ``linattn warmup`` still starts without
torch or matplotlib.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def plot_recommendation(rec, path: Path) -> None:
    """Bias, drift and total bound against T0 with T0* marked, written atomically to ``path``."""
    from figures.style import new_figure, series_style

    fig, axes = new_figure(width=5.5, height=3.6)
    ax = axes[0]
    for i, (values, label) in enumerate(((rec.bias, "bias bound"), (rec.drift, "drift bound"),
                                         (rec.total, "total bound"))):
        style = {**series_style(i), "marker": None}
        ax.plot(rec.rounds, values, label=label, **style)
    ax.axvline(rec.warmup_rounds, color="0.5", lw=1, label=f"T0* = {rec.warmup_rounds}")
    ax.set_xlabel("warm-up rounds T0")
    ax.set_ylabel("bound on excess risk")
    ax.set_yscale("log")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
    os.close(fd)
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
        import matplotlib.pyplot as plt

        plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from linattn_theory import cli

    return cli.main(argv, plot=plot_recommendation)
