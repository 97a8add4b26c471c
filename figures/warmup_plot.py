"""The ``--png`` plot of ``linattn warmup``.

With a problem (``WarmupAdvice``): the exact final error R(T0) against T0, the path-local bound
E(T0) (eq. 35), never freezing R(T) as a line, and the recommended T0, the bound's T0* and the
probe estimate marked; the left panel shows all of 0..T, the right one zooms on the marked
rounds. The y axis is logarithmic and spans R's own range (the bound is cut at its top), so the
minimum is readable. With constants only (``Recommendation``): the stylized bound's terms.

``linattn.theory_cli`` imports this module only when ``--png`` is given, so ``linattn warmup``
starts without torch or matplotlib. :func:`draw` makes the figure before anything is written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from linattn.fileio import atomic_path


def _draw_advice(advice):
    from figures.style import new_figure

    p = advice.path
    r, bound, rounds = p.final_error, p.bound, p.rounds
    marks = [advice.warmup_rounds, advice.closed_form]
    if advice.probe_estimate is not None:
        marks.append(advice.probe_estimate)
    positive = r[r > 0]
    low = float(positive.min()) / 2 if positive.size else 1e-12
    high = 3 * float(max(r[0], r[-1], r.max() if r.size < 2 else np.percentile(r, 99)))
    zoom = min(advice.total_rounds,
               max(10, int(2.5 * max(advice.warmup_rounds, advice.closed_form)) + 5))
    fig, axes = new_figure(ncols=2, width=4.2, height=3.4)
    for ax, right in zip(axes, (advice.total_rounds, zoom)):
        keep = rounds <= right
        ax.plot(rounds[keep], r[keep], color="C0", lw=1.8, label="exact R(T0)")
        ax.plot(rounds[keep], np.minimum(bound[keep], high), color="C1", ls="--", lw=1.2,
                label="bound E(T0) (eq. 35)")
        ax.axhline(advice.never_freeze_error, color="0.4", ls=":", lw=1.2,
                   label=f"never freeze R(T) = {advice.never_freeze_error:.3g}")
        ax.axvline(advice.warmup_rounds, color="C0", lw=1,
                   label=f"recommended T0 = {advice.warmup_rounds}")
        ax.axvline(advice.closed_form, color="C1", lw=1, ls="-.",
                   label=f"bound's T0* = {advice.closed_form}")
        if advice.probe_estimate is not None:
            ax.axvline(advice.probe_estimate, color="C2", lw=1, ls=(0, (1, 1)),
                       label=f"probe estimate = {advice.probe_estimate}")
        ax.set_yscale("log")
        ax.set_ylim(low, high)
        ax.set_xlim(0, right)
        ax.set_xlabel("warm-up rounds T0 (then frozen until T)")
        ax.set_ylabel(r"final excess risk $R(T_0)$")
    axes[0].set_title(f"all T0 (T = {advice.total_rounds})", fontsize=9)
    axes[1].set_title(f"zoom: T0 <= {zoom}", fontsize=9)
    axes[1].legend(fontsize=7, loc="best")
    return fig


def _draw_constants(rec):
    from figures.style import new_figure, series_style

    fig, axes = new_figure(width=5.5, height=3.6)
    ax = axes[0]
    for i, (values, label) in enumerate(((rec.bias, "bias bound"), (rec.drift, "drift bound"),
                                         (rec.total, "total bound"))):
        style = {**series_style(i), "marker": None}
        ax.plot(rec.rounds, values, label=label, **style)
    ax.axvline(rec.warmup_rounds, color="0.5", lw=1, label=f"T0* = {rec.warmup_rounds}")
    ax.set_xlabel("warm-up rounds T0")
    ax.set_ylabel("stylized bound on excess risk (eq. 27)")
    top = float(np.max(rec.total[np.isfinite(rec.total)]))
    bottom = max(float(np.min(rec.total)) / 10, top * 1e-6)
    ax.set_yscale("log")
    ax.set_ylim(bottom, 2 * top)
    ax.legend()
    return fig


def draw(rec):
    """The figure for a ``WarmupAdvice`` (problem) or a ``Recommendation`` (constants)."""
    fig = _draw_advice(rec) if hasattr(rec, "path") else _draw_constants(rec)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path) -> None:
    """Write ``fig`` atomically to ``path`` (format from the suffix) and close it."""
    path = Path(path)
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", dpi=120)
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def plot_recommendation(rec, path: Path) -> None:
    """:func:`draw` then :func:`save_figure`."""
    save_figure(draw(rec), path)
