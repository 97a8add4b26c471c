"""The ``--png`` plot of ``linattn warmup``: the bound's curves against T0 with T0* marked.

``linattn.theory_cli`` imports this module only when ``--png`` is given, so ``linattn warmup``
starts without torch or matplotlib.
"""

from __future__ import annotations

from pathlib import Path

from linattn.fileio import atomic_path


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
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png")
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)
