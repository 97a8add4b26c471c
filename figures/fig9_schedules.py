"""Figure 9: does freezing the kernel add to step-size decay? (exact population dynamics)

On the schedule study's 2^(8-2) factorial (``simulations.schedule_study.study_cells``: d, C,
K, eta, T, zeta_K, zeta_V, covariate shift rho; 4 problem seeds per cell), per problem:

- left: R(best constant-eta FedFrozen) / R(best decay schedule) on x against
  R(best schedule + FedFrozen) / R(best decay schedule) on y (what freezing adds to decay;
  1 = nothing), by covariate shift;
- right: the fraction of problems where that ratio is below 0.9 (freezing gains more than
  10% over the best decay) at each level of each factor, oracle (best in hindsight) and
  held-out (T0 and schedule chosen on two problem seeds of the cell, reported on the
  other two).

``--quick`` runs the study's tiny grids; the full grids take about 13 minutes in two processes
on a shared 2-core CPU. The study is cached (shared with figure 10).

    python -m figures.fig9_schedules [--quick] [--out DIR]
"""

from __future__ import annotations

import numpy as np

from figures.cache import cached, source_digest
from figures.common import FigureOutput, fmt, pct, run_standalone
from figures.style import new_figure, save, series_style
from simulations.validate import Grid

NAME = "fig9_schedules"


def study_data(grid, cache_dir=None) -> tuple[dict, bool]:
    """The schedule study's exact-dynamics part (rows and summaries), cached."""
    quick = grid == Grid.quick()

    def compute():
        from figures.cache import jsonable
        from simulations.schedule_stats import summarize
        from simulations.schedule_study import run_tables

        seeds = list(range(2 if quick else 4))
        rows = run_tables(seeds, quick, workers=1 if quick else 2)
        return jsonable({"summary": summarize(rows, seeds),
                         "rows": [{k: v for k, v in r.items() if k != "table"}
                                  for r in rows]})

    config = {"quick": quick, "code": source_digest(__file__)}
    return cached("schedule_study", config, compute, cache_dir)


def make(result, grid, out_dir=None, cache_dir=None) -> FigureOutput:
    data, hit = study_data(grid, cache_dir)
    rows = [r for r in data["rows"] if r["part"] == "study" and "error" not in r]
    study = data["summary"]["study"]
    fig, axes = new_figure(ncols=2, width=4.4, height=3.6)
    ax = axes[0]
    for i, rho in enumerate(sorted({r["covariate_shift"] for r in rows})):
        sel = [r for r in rows if r["covariate_shift"] == rho]
        ax.plot([r["frozen_over_decay"] for r in sel], [r["both_over_decay"] for r in sel],
                "o", ms=3.5, alpha=0.7, mfc="white" if rho else None,
                color=series_style(i)["color"], label=rf"covariate shift $\rho$={rho:g}")
    ax.axvline(1.0, color="0.5", lw=0.8)
    ax.axhline(1.0, color="0.5", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("R(FedFrozen, constant eta) / R(best decay)")
    ax.set_ylabel("R(best decay + FedFrozen) / R(best decay)")
    ax.set_title(f"{len(rows)} problems (oracle choice)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")

    ax = axes[1]
    labels, oracle, held = [], [], []
    for factor, levels in study["oracle"]["by_factor"].items():
        for level, stats in levels.items():
            labels.append(f"{factor} = {level}")
            oracle.append(stats.get("below_0.9", np.nan))
            held.append(study["held_out"]["by_factor"][factor][level].get("below_0.9",
                                                                         np.nan))
    y = np.arange(len(labels))
    ax.barh(y - 0.2, oracle, height=0.4, color=series_style(0)["color"], label="oracle")
    ax.barh(y + 0.2, held, height=0.4, color=series_style(1)["color"], label="held-out")
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("fraction with R(best decay + FF) / R(best decay) < 0.9")
    ax.legend(fontsize=7, loc="lower right")
    paths = save(fig, NAME, out_dir)
    return FigureOutput(9, NAME, tuple(paths), caption(study),
                        cache_hits={"schedule study": hit})


def caption(study: dict) -> str:
    oracle, held = study["oracle"], study["held_out"]
    adds = oracle["both_over_decay"]
    return (f"Freezing on top of the best step-size decay, exact population dynamics, "
            f"{study['problems']} problems of a 2^(8-2) factorial over d, C, K, eta, T, "
            f"zeta_K, zeta_V and covariate shift ({study['unstable_problems']} unstable "
            f"problems left out). R(best decay + FedFrozen) / R(best decay): median "
            f"{fmt(adds.get('median'))} (below 0.9 in {pct(adds.get('below_0.9'))}, exactly 1 "
            f"in {pct(adds.get('exactly_1'))}); held-out median "
            f"{fmt(held['both_over_decay'].get('median'))} (below 0.9 in "
            f"{pct(held['both_over_decay'].get('below_0.9'))}). Constant-eta FedFrozen over "
            f"the best decay: median {fmt(oracle['frozen_over_decay'].get('median'))}; the "
            f"best decay beats it in {pct(oracle['decay_beats_frozen'])} of problems.")


def main(argv=None) -> int:
    return run_standalone(make, __doc__, argv)


if __name__ == "__main__":
    raise SystemExit(main())
