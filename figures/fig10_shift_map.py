"""Figure 10: which heterogeneity makes freezing pay (exact population dynamics).

On the schedule study's map (``simulations.schedule_study.map_cells``: covariate shift rho x
teacher heterogeneity (zeta_K, zeta_V) x eta in {0.03, 0.06, 0.1}, d = 6, C = 8, K = 5,
T = 100; 4 problem seeds), medians over eta and seeds of:

- left: R(best decay + FedFrozen) / R(best decay);
- middle: R(cut + FedFrozen at its best T0) / R(cut alone), the cut being 0.1 eta for the
  last fifth of the run;
- right: the same problems (same teachers, same eta) with covariate shift off (x) and on
  (y): the cut ratio of each pair.

    python -m figures.fig10_shift_map [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np

from figures.common import FigureOutput, fmt, pct, run_standalone
from figures.fig9_schedules import study_data
from figures.style import new_figure, save, series_style

NAME = "fig10_shift_map"


def _heatmap(ax, cells, key, title, row_labels=True):
    shifts = sorted({c["covariate_shift"] for c in cells})
    teachers = sorted({(c["kernel_heterogeneity"], c["value_heterogeneity"]) for c in cells},
                      key=lambda t: (t[0] != t[1], t))
    grid = np.full((len(teachers), len(shifts)), np.nan)
    for c in cells:
        i = teachers.index((c["kernel_heterogeneity"], c["value_heterogeneity"]))
        grid[i, shifts.index(c["covariate_shift"])] = c[key]
    image = ax.imshow(grid, cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=7,
                    color="white" if grid[i, j] < 0.6 else "black")
    ax.set_xticks(range(len(shifts)), [f"{s:g}" for s in shifts])
    ax.set_yticks(range(len(teachers)),
                  [f"zK={k:g}, zV={v:g}" if row_labels else "" for k, v in teachers],
                  fontsize=7)
    ax.set_xlabel(r"covariate shift $\rho$")
    ax.set_title(title, fontsize=8)
    ax.grid(False)
    return image


def make(result, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    data, hit = study_data(grid, cache_dir)
    shift = data["summary"]["map"]
    rows = [r for r in data["rows"] if r["part"] == "map" and "error" not in r]
    fig, axes = new_figure(ncols=3, width=3.6, height=3.4, constrained=True)
    _heatmap(axes[0], shift["cells"], "both_over_decay", "R(best decay + FF) / R(best decay)")
    image = _heatmap(axes[1], shift["cells"], "cut_frozen_over_cut",
                     "R(cut + FF) / R(cut)", row_labels=False)
    fig.colorbar(image, ax=axes[:2].tolist(), shrink=0.8)
    ax = axes[2]
    base = {(r["seed"], r["kernel_heterogeneity"], r["value_heterogeneity"], r["lr"]): r
            for r in rows if r["covariate_shift"] == 0}
    for i, rho in enumerate(sorted({r["covariate_shift"] for r in rows} - {0.0})):
        pairs = [(base[k]["cut_frozen_over_cut"], r["cut_frozen_over_cut"]) for r in rows
                 if r["covariate_shift"] == rho
                 and (r["kernel_heterogeneity"] > 0 or r["value_heterogeneity"] > 0)
                 for k in [(r["seed"], r["kernel_heterogeneity"], r["value_heterogeneity"],
                            r["lr"])] if k in base]
        if pairs:
            x, y = np.array(pairs).T
            ax.plot(x, y, "o", ms=3, alpha=0.7, color=series_style(i)["color"],
                    label=rf"$\rho$={rho:g}")
    ax.plot([0, 1], [0, 1], color="0.5", lw=0.8)
    ax.set_xlim(0, 1.05)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel(r"R(cut + FF) / R(cut), $\rho$ = 0")
    ax.set_ylabel(r"same problem, $\rho$ > 0")
    ax.legend(fontsize=7, loc="lower right")
    paths = save(fig, NAME, out_dir, tight=False)
    return FigureOutput(10, NAME, tuple(paths), caption(shift),
                        cache_hits={"schedule study": hit})


def caption(shift: dict) -> str:
    off, on = shift["teachers_differ_no_shift"], shift["teachers_differ_shift"]
    pairs = shift["pairs"]["cut_frozen_over_cut"]
    return (f"Where freezing pays in the model: teachers differing, without covariate shift "
            f"R(cut + FedFrozen) / R(cut) has median "
            f"{fmt(off['cut_frozen_over_cut'].get('median'))} ({off['settings']} problems), "
            f"with covariate shift {fmt(on['cut_frozen_over_cut'].get('median'))} "
            f"({on['settings']}); R(best decay + FedFrozen) / R(best decay) "
            f"{fmt(off['both_over_decay'].get('median'))} against "
            f"{fmt(on['both_over_decay'].get('median'))}. Same teachers with the shift off "
            f"and on: the cut ratio is lower without shift in "
            f"{pct(pairs['lower_without_shift'])} of {pairs['pairs']} pairs.")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
