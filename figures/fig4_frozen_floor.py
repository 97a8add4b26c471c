"""Figure 4: the frozen-stage floor versus the number of local steps K (prediction P4).

After a warm-up of T0 rounds the kernel is frozen and FedAvg on the value block converges to a
fixed point V_inf(M) whose excess over Phi(M) is the floor D_frozen(M) (eq. 17); minibatch noise
adds the stationary term of eq. (18). At (zeta, eta) of the validation's P4 points:

- line: the closed form D_frozen at the population kernel M_T0 of a warm-up with the same K
  (``population_dynamics(...).frozen_floor``), K = 1..K_max (computed here, cached);
- points: the simulator's floor (mean over the second half of the frozen rounds of
  F(M, V_t) - Phi(M), mean +- 2 SE over seeds) and its per-seed prediction D_frozen(M) + noise
  term, from the validation's own P4 code run at more values of K
  (``simulations.validate.check_p4`` with the grid's ``floor_points`` replaced);
- the validation's P4 rows at other batch sizes, from ``validation.json``.

    python -m figures.fig4_frozen_floor [--quick] [--out DIR]
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from figures import common
from figures.cache import cached, source_digest
from figures.common import (
    FigureOutput,
    cache_config,
    check_points,
    fmt,
    grid_setting,
    run_standalone,
)
from figures.style import new_figure, save, series_style
from simulations.validate import Grid

NAME = "fig4_frozen_floor"


def sweep(grid) -> dict:
    """(zeta, eta) of the sweep (the most heterogeneous P4 point) and the K values."""
    zeta = max(z for z, _, _ in grid.floor_points)
    lr = next(lr for z, _, lr in grid.floor_points if z == zeta)
    ks = (2, 5) if grid == Grid.quick() else (2, 3, 5, 8, 10)
    return {"heterogeneity": zeta, "lr": lr, "local_steps": ks,
            "batch_size": grid.batch_size, "theory_local_steps": list(range(1, max(ks) + 3))}


def compute_floors(grid, cache_dir=None) -> tuple[dict, bool]:
    """Simulated floors (P4's code) and the closed-form line, cached."""
    spec = sweep(grid)

    def compute():
        from linattn_theory.errors import ParameterError
        from simulations.metrics import phi_star, population
        from simulations.validate import ProblemCache, check_p4

        zeta, lr = spec["heterogeneity"], spec["lr"]
        floor_grid = replace(grid, floor_points=tuple((zeta, k, lr)
                                                      for k in spec["local_steps"]),
                             floor_batch_sizes=(spec["batch_size"],))
        rows = check_p4(floor_grid, ProblemCache(floor_grid))["points"]
        theory = []
        for k in spec["theory_local_steps"]:
            st = grid_setting(grid, zeta, k, lr, total_rounds=grid.floor_rounds,
                              warmup_rounds=(grid.floor_warmup,))
            try:
                pop = population(st, phi_star(st.problem))
                theory.append({"local_steps": k, "D_frozen": float(pop.frozen_floor[0]),
                               "contraction": float(pop.contraction[0])})
            except ParameterError:
                theory.append({"local_steps": k, "D_frozen": None, "contraction": None})
        return {"rows": [{**r, "local_steps": k} for r, k in zip(rows, spec["local_steps"])],
                "theory": theory}

    config = cache_config(grid, sweep=spec, code=source_digest(__file__, common.__file__))
    return cached("fig4_floors", config, compute, cache_dir)


def make(result: dict, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    data, hit = compute_floors(grid, cache_dir)
    spec = sweep(grid)
    fig, axes = new_figure(ncols=1, width=5.0, height=3.6)
    ax = axes[0]
    # K = 1 is FedAvg without local drift: D_frozen = 0 (round-off ~1e-28 on a log axis)
    theory = [t for t in data["theory"] if t["local_steps"] > 1 and t["D_frozen"] is not None]
    ax.plot([t["local_steps"] for t in theory], [t["D_frozen"] for t in theory],
            label=r"closed form $D_{frozen}(M_{T_0})$, population kernel",
            **series_style(0, marker=False))
    rows = data["rows"]
    ks = np.array([r["local_steps"] for r in rows])
    ax.plot(ks, [r["predicted"] for r in rows], ms=5, mfc="white",
            label=rf"$D_{{frozen}}(M)$ + noise term (eq. 18), B={spec['batch_size']}",
            **series_style(1))
    ax.plot(ks, [r["D_frozen"] for r in rows], "^", ms=5, color="0.55", mfc="white",
            label=r"$D_{frozen}(M)$ at the simulated kernels")
    ax.errorbar(ks, [r["measured_floor"] for r in rows],
                yerr=[2 * r["measured_se"] for r in rows], fmt="o", ms=5, capsize=3,
                color="0.0", label=rf"simulator, B={spec['batch_size']} (mean $\pm$ 2 SE)")
    others = _other_batches(result, grid, spec)
    if others:
        ax.errorbar([r["local_steps"] for r in others], [r["measured_floor"] for r in others],
                    yerr=[2 * r["measured_se"] for r in others], fmt="D", ms=5, capsize=3,
                    color="0.4", mfc="0.8",
                    label="simulator, " + ", ".join(sorted({f"B={r['batch_size']}"
                                                            for r in others})) + " (P4)")
    ax.set_yscale("log")
    ax.set_xlabel("local steps K")
    ax.set_ylabel(r"frozen-stage floor $F(M, V_t) - \Phi(M)$")
    ax.set_title(rf"$\zeta$={spec['heterogeneity']:g}, $\eta$={spec['lr']:g}, "
                 rf"$T_0$={grid.floor_warmup}, {grid.floor_rounds} rounds", fontsize=9)
    ax.set_xticks(range(2, max(ks) + 3))
    ax.legend(fontsize=7, loc="best")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(4, NAME, tuple(paths), caption(result, grid, data),
                        cache_hits={"floor sweep": hit})


def _other_batches(result: dict, grid, spec) -> list[dict]:
    """The validation's P4 rows at (zeta, eta) of the sweep and another batch size."""
    out = []
    for (zeta, k, lr), bsz in ((p, b) for p in grid.floor_points
                               for b in grid.floor_batch_sizes):
        if zeta == spec["heterogeneity"] and lr == spec["lr"] and bsz != spec["batch_size"]:
            label = grid_setting(grid, zeta, k, lr).label + f",B={bsz}"
            row = next(r for r in check_points(result, "P4") if r["setting"] == label)
            out.append({**row, "local_steps": k, "batch_size": bsz})
    return out


def caption(result: dict, grid, data: dict) -> str:
    check = result["checks"]["P4"]
    spec = sweep(grid)
    per_k = "; ".join(f"K={r['local_steps']}: {fmt(r['measured_floor'])} +- "
                      f"{fmt(r['measured_se'])} vs {fmt(r['predicted'])} "
                      f"(ratio {fmt(r['ratio_measured_to_predicted'])})" for r in data["rows"])
    ratios = ", ".join(fmt(r) for r in check["measured"]["ratios"])
    return (f"Frozen-stage floor versus K at zeta = {spec['heterogeneity']:g}, eta = "
            f"{spec['lr']:g} (T0 = {grid.floor_warmup}, {grid.floor_rounds} rounds, "
            f"{grid.seeds} seeds, log scale); line: closed form D_frozen at the population "
            f"kernel (K >= 2; it is 0 at K = 1); circles: simulator floor; squares: D_frozen + "
            f"noise term at the simulated kernels. Measured vs predicted: {per_k}. P4 "
            f"{'PASS' if check['pass'] else 'FAIL'} on the validation's points "
            f"(measured/predicted {ratios}).")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
