"""The schedule study's spot check in the finite-sample simulator.

For a subset of cells (:func:`check_cells`: the eight study cells with C = 4, K = 10, T = 40
and six map cells at eta = 0.06), problem seed 0, every schedule of
:func:`~simulations.schedule_study.decay_schedules` runs in the simulator (N = 2048 sequences
per client, B = 32, ``seeds`` Monte Carlo seeds) with the study's T0 sweep. R(schedule, T0) is
the mean over seeds of F(M_T0, V_T) - Phi* at the simulated parameters (population F), and the
comparison (i)-(iii) is made on that table as in the exact dynamics, whose ratios on the same
problem are reported beside it.
"""

from __future__ import annotations

import warnings

import numpy as np

from linattn_theory.objectives import global_losses
from linattn_theory.profile import solve_profile
from simulations.engine import Setting, simulate
from simulations.schedule_study import (
    Cell,
    compare,
    decay_schedules,
    excess_table,
    map_cells,
    study_cells,
)

SAMPLES_PER_CLIENT, BATCH_SIZE = 2048, 32
KEYS = ("both_over_decay", "frozen_over_decay", "cut_frozen_over_cut", "frozen_warmup",
        "decay_schedule", "both_schedule", "both_warmup")


def check_cells(quick: bool = False) -> list[tuple[str, Cell]]:
    if quick:
        return [("map", c) for c in map_cells(True)[:2]]
    study = [("study", c) for c in study_cells()
             if c.num_clients == 4 and c.local_steps == 10 and c.total_rounds == 40]
    shown = {(1.0, 1.0), (1.0, 0.0), (0.5, 0.5)}
    chosen = [("map", c) for c in map_cells() if c.lr == 0.06
              and (c.kernel_heterogeneity, c.value_heterogeneity) in shown
              and c.covariate_shift in (0.0, 0.5)]
    return study + chosen


def simulated_table(cell: Cell, seeds: list[int], problem_seed: int = 0,
                    samples: int = SAMPLES_PER_CLIENT) -> dict:
    """Mean over seeds of R(schedule, T0) in the simulator (NaN where a seed diverged)."""
    problem = cell.problem(problem_seed)
    star = solve_profile(problem).value
    t0s = cell.warmup_rounds()
    schedules = decay_schedules(cell.lr, cell.total_rounds)
    settings = [Setting(problem=problem, lr=cell.lr, local_steps=cell.local_steps,
                        batch_size=BATCH_SIZE, total_rounds=cell.total_rounds,
                        warmup_rounds=tuple(t0s), samples_per_client=samples, test_samples=8,
                        init_seed=problem_seed, lr_schedule=s, label=name)
                for name, s in schedules.items()]
    with warnings.catch_warnings():  # a diverged seed is reported as NaN below
        warnings.simplefilter("ignore", RuntimeWarning)
        results = simulate(settings, seeds)
    table, spread = [], []
    for res in results:
        kernels = res.kernels[:, t0s]  # (S, J, d, d)
        values = res.frozen_values[:, :, -1]  # (S, J, d, d_y)
        with np.errstate(invalid="ignore", over="ignore"):
            excess = global_losses(problem, kernels, values) - star  # (S, J)
        table.append(np.mean(excess, axis=0))
        spread.append(np.std(excess, axis=0, ddof=1) / np.sqrt(len(seeds)))
    return {"schedules": list(schedules), "warmup_rounds": t0s,
            "excess": np.array(table).tolist(), "standard_error": np.array(spread).tolist()}


def simulator_check(quick: bool = False, seeds: int = 4) -> dict:
    """Simulator against exact dynamics on :func:`check_cells`: the ratios of both."""
    seed_list = list(range(seeds))
    out = []
    samples = 256 if quick else SAMPLES_PER_CLIENT
    for part, cell in check_cells(quick):
        sim = simulated_table(cell, seed_list, samples=samples)
        exact = excess_table(cell, 0)
        row = {"part": part, "label": cell.label,
               "covariate_shift": cell.covariate_shift,
               "kernel_heterogeneity": cell.kernel_heterogeneity,
               "value_heterogeneity": cell.value_heterogeneity}
        if not np.all(np.isfinite(sim["excess"])) or "error" in exact:
            out.append({**row, "error": exact.get("error", "a simulated seed diverged")})
            continue
        cs, ce = compare(sim), compare(exact)
        row["simulator"] = {k: cs[k] for k in KEYS}
        row["exact"] = {k: ce[k] for k in KEYS}
        row["simulator_decay_excess"] = cs["decay"]
        out.append(row)
    valid = [r for r in out if "error" not in r]

    def agree(key):
        both = [(r["simulator"][key] < 0.9, r["exact"][key] < 0.9) for r in valid]
        return float(np.mean([a == b for a, b in both])) if both else None

    return {"seeds": seeds, "samples_per_client": samples,
            "batch_size": BATCH_SIZE, "problem_seed": 0, "cells": out,
            "agreement_below_0.9": {k: agree(k) for k in
                                    ("both_over_decay", "cut_frozen_over_cut")}}
