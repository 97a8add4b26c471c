"""Figure 3: the optimal warm-up length T0* versus zeta, K and eta (prediction P3).

Three panels, one per axis, the other two held at the grid values where T0* is interior
(largest K, largest eta, largest zeta). Theory curves on a finer sweep than the grid, both
computed here and cached:

- exact T0*: argmin over T0 = 0..T of the exact population dynamics' R(T0) (eqs. 19-21), the
  headline of ``recommend_warmup(problem, ...)``;
- bound T0*: argmin of the path-local bound (eq. 35, ``linattn_theory.warmup_path``), the
  ``closed_form`` of ``recommend_warmup``, the same numbers as the validation uses.

Points: the simulator's empirical argmin at the grid points (P2's ``empirical_T0``, from
``validation.json``). A sweep point whose step size is unstable on the path is left out.

    python -m figures.fig3_optimal_warmup [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np

from figures import common
from figures.cache import cached, source_digest
from figures.common import (
    FigureOutput,
    base_rows,
    cache_config,
    fmt,
    grid_problem,
    grid_setting,
    pct,
    run_standalone,
)
from figures.style import new_figure, save, series_style
from simulations.validate import Grid

NAME = "fig3_optimal_warmup"
AXES = ("heterogeneity", "local_steps", "lr")
SYMBOLS = {"heterogeneity": r"heterogeneity $\zeta$ ($=\zeta_K=\zeta_V$)",
           "local_steps": "local steps K", "lr": r"step size $\eta$"}


def sweeps(grid) -> dict[str, dict]:
    """Per axis: the swept values and the fixed (zeta, K, eta); fewer values on the quick grid."""
    quick = grid == Grid.quick()
    zeta, k, lr = max(grid.heterogeneity), max(grid.local_steps), max(grid.lr)
    n_zeta = 5 if quick else 9
    lr_factors = (0.5, 0.75, 1.0, 1.25) if quick else (0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2)
    return {
        "heterogeneity": {"values": np.linspace(0.0, zeta, n_zeta).round(4).tolist(),
                          "fixed": {"local_steps": k, "lr": lr}},
        "local_steps": {"values": list(range(1, k + 1)), "fixed": {"heterogeneity": zeta,
                                                                  "lr": lr}},
        "lr": {"values": [round(lr * f, 6) for f in lr_factors],
               "fixed": {"heterogeneity": zeta, "local_steps": k}},
    }


def theory_point(grid, problem, zeta: float, k: int, lr: float, star: float) -> dict:
    """Exact argmin and the bound's T0* at one (zeta, K, eta); None when unstable."""
    from linattn_theory.errors import ParameterError
    from linattn_theory.warmup_path import warmup_path

    st = grid_setting(grid, zeta, k, lr, problem=problem,
                      warmup_rounds=tuple(range(grid.total_rounds + 1)))
    try:
        path = warmup_path(problem, st.start(), lr, k, grid.total_rounds, star)
    except ParameterError as exc:
        return {"population": None, "closed_form": None, "bound_argmin": None,
                "error": str(exc)}
    return {"population": path.best_warmup, "closed_form": path.bound_warmup,
            "bound_argmin": path.bound_warmup}


def theory_curves(grid, cache_dir=None) -> tuple[dict, bool]:
    """Theory T0* along every axis of :func:`sweeps`, cached."""

    def compute():
        from simulations.metrics import phi_star

        problems: dict[float, tuple] = {}
        out = {}
        for axis, spec in sweeps(grid).items():
            points = []
            for value in spec["values"]:
                coords = {**spec["fixed"], axis: value}
                zeta = float(coords["heterogeneity"])
                if zeta not in problems:
                    prob = grid_problem(grid, zeta)
                    problems[zeta] = (prob, phi_star(prob))
                prob, star = problems[zeta]
                points.append({axis: value, **theory_point(
                    grid, prob, zeta, int(coords["local_steps"]), float(coords["lr"]), star)})
            out[axis] = points
        return out

    config = cache_config(grid, sweeps=sweeps(grid),
                          code=source_digest(__file__, common.__file__))
    return cached("fig3_theory", config, compute, cache_dir)


def simulated_optima(result: dict, grid) -> dict[str, list[tuple]]:
    """Per axis: (value, empirical T0, population T0, closed-form T0) at the grid points."""
    out = {}
    for axis, spec in sweeps(grid).items():
        pts = []
        for row in base_rows(result, grid):
            if all(row[key] == val for key, val in spec["fixed"].items()):
                pts.append((row[axis], row["empirical_T0"], row["predicted_T0"],
                            row["closed_form_T0"]))
        out[axis] = sorted(pts)
    return out


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    curves, hit = theory_curves(grid, cache_dir)
    optima = simulated_optima(result, grid)
    fig, axes = new_figure(ncols=3, width=3.4, height=3.1)
    for ax, axis in zip(axes, AXES):
        pts = curves[axis]
        x = np.array([p[axis] for p in pts], dtype=float)
        for i, (key, label) in enumerate((("population", "exact argmin (recommended T0)"),
                                          ("closed_form", "path-local bound's T0* (eq. 35)"))):
            y = np.array([np.nan if p[key] is None else p[key] for p in pts], dtype=float)
            ax.plot(x, y, ms=3.5, label=label, **series_style(i))
        sim = optima[axis]
        if sim:
            ax.plot([p[0] for p in sim], [p[1] for p in sim], "*", ms=11, color="0.45",
                    mec="black", label="simulator argmin (grid points)")
        ax.set_xlabel(SYMBOLS[axis])
        ax.set_ylabel(r"optimal warm-up $T_0^*$ (rounds)")
        ax.set_ylim(-2, grid.total_rounds + 3)
        fixed = sweeps(grid)[axis]["fixed"]
        ax.set_title(", ".join(f"{_short(k)}={v:g}" for k, v in fixed.items())
                     + f", T={grid.total_rounds}", fontsize=9)
        if axis == "local_steps":
            ax.set_xticks(x)
    axes[0].legend(fontsize=7, loc="best")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(3, NAME, tuple(paths), caption(result, grid, curves),
                        cache_hits={"theory sweep": hit})


def _short(key: str) -> str:
    return {"heterogeneity": r"$\zeta$", "local_steps": "K", "lr": r"$\eta$"}[key]


def caption(result: dict, grid, curves: dict) -> str:
    check = result["checks"]["P3"]
    m = check["measured"]
    skipped = sum(p.get("error") is not None for pts in curves.values() for p in pts)
    closed = result["checks"]["P2"]["measured"]["closed_form_within_factor_2_rate"]
    return (f"Optimal warm-up T0* versus zeta, K and eta (T = {grid.total_rounds}); lines: "
            f"exact population-dynamics argmin (the recommended T0) and the path-local bound's "
            f"T0* (eq. 35) on a finer sweep, "
            f"stars: simulator argmin at the grid points"
            + (f"; {skipped} unstable sweep points left out" if skipped else "")
            + f". P3 {'PASS' if check['pass'] else 'FAIL'}: T0* non-increasing on "
            f"{pct(m['monotone_rate_population'])} (population) and "
            f"{pct(m['monotone_rate_empirical'])} (simulator) of adjacent grid pairs; "
            f"zeta = 0 flat or T0* = T: {fmt(m['iid_flat_or_T'])}. The bound's T0* is within "
            f"a factor 2 of the exact T0* on {pct(closed)} of the heterogeneous points (P2).")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
