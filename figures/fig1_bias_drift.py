"""Figure 1: bias and drift versus the warm-up length T0 (prediction P1).

bias(T0) = Phi(M_bar_T0) - Phi* and drift(T0) = Phi(M_T0) - Phi(M_bar_T0) (docs/theory.md,
section 3) at the P1 points of the validation grid. Points: the simulator at the large batch
of P1 (mean +- 2 SE over the seeds) and at the default batch (mean); lines: the exact
population dynamics (eqs. 19-21) at every integer T0 in [0, T]. The simulator numbers are those
of ``validation.json`` (check P1); the lines are computed here and cached.

    python -m figures.fig1_bias_drift [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np

from figures import common
from figures.cache import cached, source_digest
from figures.common import (
    FigureOutput,
    cache_config,
    check_points,
    finite,
    fmt,
    grid_setting,
    run_standalone,
)
from figures.style import new_figure, save, series_style

NAME = "fig1_bias_drift"


def population_curves(grid, cache_dir=None) -> tuple[dict, bool]:
    """Population bias and drift at T0 = 0..T for every P1 point, cached."""

    def compute():
        from simulations.metrics import phi_star, population

        out = {}
        for zeta, k, lr in grid.p1_points:
            st = grid_setting(grid, zeta, k, lr,
                              warmup_rounds=tuple(range(grid.total_rounds + 1)))
            pop = population(st, phi_star(st.problem))
            out[st.label] = {"warmup_rounds": pop.warmup_rounds.tolist(),
                             "bias": pop.bias.tolist(), "drift": pop.drift.tolist()}
        return out

    config = cache_config(grid, code=source_digest(__file__, common.__file__))
    return cached("fig1_population", config, compute, cache_dir)


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    curves, hit = population_curves(grid, cache_dir)
    rows = check_points(result, "P1")
    t0 = np.asarray(result["grid"]["warmup_grid"])
    fig, axes = new_figure(ncols=len(rows), width=3.4, height=2.8, nrows=2)
    for i, ((zeta, k, lr), row) in enumerate(zip(grid.p1_points, rows)):
        line = curves[grid_setting(grid, zeta, k, lr).label]
        for j, (name, symbol) in enumerate((("bias", r"bias($T_0$) = $\Phi(\bar M_{T_0})-\Phi^*$"),
                                            ("drift", r"drift($T_0$) = $\Phi(M_{T_0})-"
                                                      r"\Phi(\bar M_{T_0})$"))):
            ax = axes[j, i]
            rec = row[name]
            ax.plot(line["warmup_rounds"], line[name], label="population dynamics",
                    **series_style(0, marker=False))
            ax.errorbar(t0, finite(rec["sim_mean"]), yerr=2 * finite(rec["sim_se"]),
                        fmt="o", ms=3.5, capsize=2, color="0.25", mfc="white",
                        label=f"simulator, B={grid.p1_batch_size} (mean $\\pm$ 2 SE)")
            ax.plot(t0, finite(row[f"default_batch_{name}"]["sim_mean"]), "x", ms=4,
                    color="0.5", label=f"simulator, B={grid.batch_size} (mean)")
            if name == "drift":
                ax.axhline(0.0, color="0.6", lw=0.8, ls=":")
            ax.set_xlabel(r"warm-up rounds $T_0$")
            ax.set_ylabel(symbol)
            ax.set_title(rf"$\zeta$={zeta:g}, K={k}, $\eta$={lr:g}", fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(1, NAME, tuple(paths), caption(result, grid),
                        cache_hits={"population curves": hit})


def caption(result: dict, grid) -> str:
    check = result["checks"]["P1"]
    m = check["measured"]
    verdict = "PASS" if check["pass"] else "FAIL"
    return (f"Bias and drift versus the warm-up length T0 at the P1 points. Points: simulator "
            f"at B = {grid.p1_batch_size} (mean +- 2 SE over {grid.seeds} seeds) and at "
            f"B = {grid.batch_size} (crosses); lines: exact population dynamics. P1 {verdict}: "
            f"curves within tolerance {fmt(m['curves_match'])}, bias non-increasing "
            f"{fmt(m['bias_decreasing'])}, drift non-decreasing {fmt(m['drift_increasing'])}; "
            f"max |gap|/SE {fmt(m['max_z_bias'])} (bias), {fmt(m['max_z_drift'])} (drift), "
            f"{fmt(m['max_z_drift_default_batch'])} (drift at B = {grid.batch_size}).")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
