"""Figure 5: the path-local bound against the exact final error (prediction P5).

Left: the bound E(T0) (eq. 35, ``linattn_theory.warmup_path``) against the exact R(T0) of the
population dynamics, one point per grid setting and T0; the bound is valid where the point lies
above the diagonal. Right: tightness, bound / R at the exact best T0 of each setting (P5's
``tightness_at_exact_T0``). Every number comes from ``validation.json``; nothing is computed
here.

    python -m figures.fig5_bound [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np
from matplotlib.lines import Line2D

from figures.common import FigureOutput, check_points, finite, fmt, p2_rows, pct, run_standalone
from figures.style import new_figure, save, series_style

NAME = "fig5_bound"


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    rows = p2_rows(result)
    levels = sorted({r["heterogeneity"] for r in rows.values()})
    steps = sorted({r["local_steps"] for r in rows.values()})
    fig, axes = new_figure(ncols=2, width=3.9, height=3.5)
    lo, hi = np.inf, 0.0
    for label, s in result["settings"].items():
        measured, bound = finite(s["R_population"]), finite(s["bound"])
        ok = np.isfinite(measured) & np.isfinite(bound) & (measured > 0)
        style = series_style(levels.index(rows[label]["heterogeneity"]))
        axes[0].plot(measured[ok], bound[ok], style["marker"], ms=3.5, color=style["color"],
                     mfc="white", alpha=0.8)
        lo, hi = min(lo, measured[ok].min(), bound[ok].min()), max(hi, measured[ok].max(),
                                                                    bound[ok].max())
    span = np.array([lo / 2, hi * 2])
    axes[0].plot(span, span, color="0.5", ls=":", lw=1)
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    axes[0].set_xlabel(r"exact final error $R(T_0)$ (population dynamics)")
    axes[0].set_ylabel(r"path-local bound $E(T_0)$ (eq. 35)")
    axes[0].set_title("validity: every point above the diagonal", fontsize=9)
    handles = [Line2D([], [], linestyle="none", mfc="white", marker=series_style(i)["marker"],
                      color=series_style(i)["color"], label=rf"$\zeta$={z:g}")
               for i, z in enumerate(levels)]
    handles.append(Line2D([], [], color="0.5", ls=":", label="bound = measured"))
    axes[0].legend(handles=handles, fontsize=7, loc="upper left")

    p5 = check_points(result, "P5")
    for i, k in enumerate(steps):
        pts = [(rows[r["setting"]]["heterogeneity"], r["tightness_at_exact_T0"])
               for r in p5 if rows[r["setting"]]["local_steps"] == k]
        jitter = (i - (len(steps) - 1) / 2) * 0.03 * max(max(levels), 1e-9)
        style = series_style(i)
        axes[1].plot([z + jitter for z, _ in pts], [t for _, t in pts], style["marker"],
                     ms=5, color=style["color"], mfc="white", label=f"K={k}")
    median = result["checks"]["P5"]["measured"]["median_tightness"]
    axes[1].axhline(median, color="0.3", ls="--", lw=1, label=f"median {fmt(median)}")
    axes[1].axhline(1.0, color="0.6", ls=":", lw=1, label="bound = measured")
    axes[1].set_yscale("log")
    axes[1].set_xlabel(r"heterogeneity $\zeta$")
    axes[1].set_ylabel(r"tightness: bound / R at the best $T_0$")
    axes[1].set_title("tightness per grid setting", fontsize=9)
    axes[1].legend(fontsize=7, loc="best")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(5, NAME, tuple(paths), caption(result))


def caption(result: dict) -> str:
    check = result["checks"]["P5"]
    m = check["measured"]
    points = sum(len(s["warmup_rounds"]) for s in result["settings"].values())
    return (f"Path-local bound (eq. 35) against the exact final error: left, every "
            f"setting and T0 ({points} points, log-log, diagonal = equality); right, bound / R "
            f"at each setting's exact best T0. P5 "
            f"{'PASS' if check['pass'] else 'FAIL'}: validity {pct(m['validity_rate'])}; "
            f"tightness median {fmt(m['median_tightness'])}, max {fmt(m['max_tightness'])}.")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
