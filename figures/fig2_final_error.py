"""Figure 2: final error R(T0) versus T0 for several heterogeneity levels (prediction P2).

R(T0) = F(M_T0, V_T) - Phi* after T rounds, the last T - T0 of them with the kernel frozen.
One panel per number of local steps K (at the largest eta of the grid), one series per
zeta = zeta_K = zeta_V. Points: the simulator (mean +- 2 SE, from ``validation.json``); lines:
the exact population dynamics at every integer T0 (computed here, cached); triangles: the
predicted T0* (argmin of the population dynamics, P2's ``predicted_T0``).

    python -m figures.fig2_final_error [--quick] [--out DIR]
"""

from __future__ import annotations

from matplotlib.lines import Line2D

from figures import common
from figures.cache import cached, source_digest
from figures.common import (
    FigureOutput,
    cache_config,
    finite,
    fmt,
    grid_setting,
    p2_rows,
    pct,
    run_standalone,
)
from figures.style import new_figure, save, series_style

NAME = "fig2_final_error"


def panels(grid) -> list[tuple[int, float]]:
    """(K, eta) of each panel: every K of the grid at its largest eta."""
    return [(k, max(grid.lr)) for k in grid.local_steps]


def population_curves(grid, cache_dir=None) -> tuple[dict, bool]:
    """Population R(T0) at T0 = 0..T for every (zeta, K, eta) drawn, cached."""

    def compute():
        from simulations.metrics import phi_star, population

        out = {}
        for k, lr in panels(grid):
            for zeta in grid.heterogeneity:
                st = grid_setting(grid, zeta, k, lr,
                                  warmup_rounds=tuple(range(grid.total_rounds + 1)))
                pop = population(st, phi_star(st.problem))
                out[st.label] = {"warmup_rounds": pop.warmup_rounds.tolist(),
                                 "final_error": pop.final_error.tolist()}
        return out

    config = cache_config(grid, code=source_digest(__file__, common.__file__))
    return cached("fig2_population", config, compute, cache_dir)


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    curves, hit = population_curves(grid, cache_dir)
    rows = p2_rows(result)
    fig, axes = new_figure(ncols=len(panels(grid)), width=3.6, height=3.2)
    for ax, (k, lr) in zip(axes, panels(grid)):
        for i, zeta in enumerate(grid.heterogeneity):
            label = grid_setting(grid, zeta, k, lr).label
            sim, line, row = result["settings"][label], curves[label], rows[label]
            style = series_style(i)
            ax.plot(line["warmup_rounds"], line["final_error"], color=style["color"],
                    linestyle=style["linestyle"])
            ax.errorbar(sim["warmup_rounds"], finite(sim["R_sim_mean"]),
                        yerr=2 * finite(sim["R_sim_se"]), fmt=style["marker"], ms=3.5,
                        capsize=2, color=style["color"], mfc="white")
            t_star = row["predicted_T0"]
            ax.plot([t_star], [line["final_error"][t_star]], marker="v", ms=9,
                    color=style["color"], mec="black", linestyle="none")
        ax.set_yscale("log")
        ax.set_xlabel(r"warm-up rounds $T_0$")
        ax.set_ylabel(r"final error $R(T_0) = F(M_{T_0}, V_T) - \Phi^*$")
        ax.set_title(rf"K={k}, $\eta$={lr:g}, T={grid.total_rounds}", fontsize=9)
    handles = [Line2D([], [], mfc="white", label=rf"$\zeta$={z:g}", **series_style(i))
               for i, z in enumerate(grid.heterogeneity)]
    handles += [Line2D([], [], color="0.3", label="population dynamics"),
                Line2D([], [], color="0.3", marker="o", mfc="white", linestyle="none",
                       label=r"simulator (mean $\pm$ 2 SE)"),
                Line2D([], [], color="0.5", marker="v", mec="black", ms=8, linestyle="none",
                       label=r"predicted $T_0^*$ (population argmin)")]
    axes[0].legend(handles=handles, fontsize=7, loc="best")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(2, NAME, tuple(paths), caption(result, grid),
                        cache_hits={"population curves": hit})


def caption(result: dict, grid) -> str:
    check = result["checks"]["P2"]
    m = check["measured"]
    rows = p2_rows(result)
    stars = "; ".join(
        f"K={k}: " + ", ".join(
            f"zeta={z:g} T0* {rows[grid_setting(grid, z, k, lr).label]['predicted_T0']} "
            f"(sim {rows[grid_setting(grid, z, k, lr).label]['empirical_T0']})"
            for z in grid.heterogeneity)
        for k, lr in panels(grid))
    return (f"Final error R(T0) versus T0 (log scale), one panel per K at eta = "
            f"{max(grid.lr):g}; lines: population dynamics, points: simulator mean +- 2 SE "
            f"over {grid.seeds} seeds, triangles: predicted T0* (population argmin). {stars}. "
            f"P2 {'PASS' if check['pass'] else 'FAIL'}: empirical argmin within a factor 2 "
            f"of T0* on {pct(m['within_factor_2_rate'])} of {m['points']} heterogeneous "
            f"points (max factor {fmt(m['max_factor'])}); U-shaped beyond 2 SE on "
            f"{pct(m['u_shaped_rate'])}.")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())

