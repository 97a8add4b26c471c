"""Step-size schedules and freezing in the model: does freezing the kernel add to decay?

For every (cell, problem seed) the exact population dynamics
(:func:`linattn_theory.dynamics.population_dynamics`) run once per schedule of
:func:`decay_schedules`, each for every warm-up length T0 = round(f T), f in
:data:`WARMUP_FRACTIONS` (T0 = T: no freezing). The final excess risk
R(schedule, T0) = F(M_T0, V_T) - Phi* gives, per problem:

- (i) ``frozen``: the best constant-eta FedFrozen, min over T0 of R(constant, T0);
- (ii) ``decay``: the best schedule without freezing, min over schedules of R(schedule, T);
- (iii) ``both``: the best of both together, min over schedules and T0;
- ``cut`` and ``cut_frozen``: the 10x cut for the last fifth (``step-4/5``) alone, R(cut, T),
  and with FedFrozen at its best T0, min over T0 of R(cut, T0).

``both / decay`` <= 1 is what freezing adds to the best decay (1: nothing). Two grids:
:func:`study_cells`, a 2^(8-2) fractional factorial over d, C, K, eta, T, zeta_K, zeta_V and
rho (does freezing add to the best decay?), and :func:`map_cells`, covariate shift rho x teacher
heterogeneity (zeta_K, zeta_V) x eta (the map of where freezing pays). The summaries are in
:mod:`simulations.schedule_stats`, the finite-sample spot check in
:mod:`simulations.schedule_sim`, the command (``linattn simulate schedules``) in
:mod:`simulations.schedule_run`.
"""

from __future__ import annotations

import itertools
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

import numpy as np

from linattn_theory.dynamics import initial_point, population_dynamics
from linattn_theory.errors import ParameterError
from linattn_theory.problem import make_problem
from linattn_theory.profile import solve_profile

WARMUP_FRACTIONS = (0.0, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6,
                    0.7, 0.8, 0.9, 1.0)
CONTEXT_LENGTH = 16
CUT = "step-4/5"


def decay_schedules(lr: float, total_rounds: int) -> dict[str, dict]:
    """The schedules compared (``LRSchedule`` mappings); ``constant`` is one of them, so the
    best decay is never worse than the constant step size."""
    return {
        "constant": {"kind": "constant"},
        "step-1/2": {"kind": "step", "milestones": [0.5], "factor": 0.1},
        "step-3/4": {"kind": "step", "milestones": [0.75], "factor": 0.1},
        CUT: {"kind": "step", "milestones": [0.8], "factor": 0.1},
        "step-1/2,3/4": {"kind": "step", "milestones": [0.5, 0.75], "factor": 0.1},
        "cosine-0": {"kind": "cosine", "floor": 0.0},
        "cosine-0.1": {"kind": "cosine", "floor": 0.1 * lr},
        "exp-0.1": {"kind": "exponential", "factor": 0.1 ** (1 / (total_rounds - 1))},
        "exp-0.01": {"kind": "exponential", "factor": 0.01 ** (1 / (total_rounds - 1))},
    }


SCHEDULE_TEXT = {
    "constant": "eta in every round",
    "step-1/2": "eta, then 0.1 eta after round ceil(T/2)",
    "step-3/4": "eta, then 0.1 eta after round ceil(3T/4)",
    CUT: "eta, then 0.1 eta after round ceil(4T/5) (the cut for the last fifth)",
    "step-1/2,3/4": "eta, 0.1 eta after ceil(T/2), 0.01 eta after ceil(3T/4)",
    "cosine-0": "half cosine from eta to 0",
    "cosine-0.1": "half cosine from eta to 0.1 eta",
    "exp-0.1": "eta q^(t-1), q = 0.1^(1/(T-1)) (0.1 eta in round T)",
    "exp-0.01": "eta q^(t-1), q = 0.01^(1/(T-1)) (0.01 eta in round T)",
}


@dataclass(frozen=True)
class Cell:
    """One setting of a grid: make_problem's (d, C, zeta_K, zeta_V, rho) with n = 16, and
    FedAvg's (K, eta, T); the problem seed varies within a cell."""

    dim: int
    num_clients: int
    local_steps: int
    lr: float
    total_rounds: int
    kernel_heterogeneity: float
    value_heterogeneity: float
    covariate_shift: float

    def problem(self, seed: int):
        return make_problem(dim=self.dim, num_clients=self.num_clients,
                            context_length=CONTEXT_LENGTH,
                            kernel_heterogeneity=self.kernel_heterogeneity,
                            value_heterogeneity=self.value_heterogeneity,
                            covariate_shift=self.covariate_shift, seed=seed)

    def warmup_rounds(self) -> list[int]:
        return sorted({int(round(f * self.total_rounds)) for f in WARMUP_FRACTIONS})

    @property
    def label(self) -> str:
        return (f"d={self.dim},C={self.num_clients},K={self.local_steps},lr={self.lr:g},"
                f"T={self.total_rounds},zK={self.kernel_heterogeneity:g},"
                f"zV={self.value_heterogeneity:g},rho={self.covariate_shift:g}")


# the two levels of the eight factors of the study grid (2^(8-2), resolution V)
STUDY_LEVELS = {"dim": (4, 8), "num_clients": (4, 12), "local_steps": (2, 10),
                "lr": (0.03, 0.1), "total_rounds": (40, 120),
                "kernel_heterogeneity": (0.25, 1.0), "value_heterogeneity": (0.25, 1.0),
                "covariate_shift": (0.0, 0.5)}


def study_cells(quick: bool = False) -> list[Cell]:
    """The 2^(8-2) fractional factorial: the first six factors (d, C, K, eta, T, zeta_K) in
    full, zeta_V at the sign of d C K eta and rho at the sign of d C T zeta_K (generators
    G = ABCD, H = ABEF: every main effect and two-factor interaction is estimable). 64 cells;
    ``quick``: 4 small cells for tests."""
    if quick:
        return [Cell(3, 3, k, 0.05, 16, 1.0, zv, rho) for k, zv, rho in
                ((2, 1.0, 0.0), (6, 0.25, 0.0), (2, 0.25, 0.5), (6, 1.0, 0.5))]
    names = list(STUDY_LEVELS)
    cells = []
    for signs in itertools.product((0, 1), repeat=6):
        g = (signs[0] + signs[1] + signs[2] + signs[3]) % 2
        h = (signs[0] + signs[1] + signs[4] + signs[5]) % 2
        levels = {n: STUDY_LEVELS[n][s] for n, s in zip(names, (*signs, g, h))}
        cells.append(Cell(**levels))
    return cells


MAP_SHIFTS = (0.0, 0.1, 0.25, 0.5, 1.0)
MAP_TEACHERS = ((0.0, 0.0), (0.25, 0.25), (0.5, 0.5), (1.0, 1.0), (2.0, 2.0), (1.0, 0.0),
                (0.0, 1.0))
MAP_LRS = (0.03, 0.06, 0.1)


def map_cells(quick: bool = False) -> list[Cell]:
    """Covariate shift rho x teachers (zeta_K, zeta_V) x eta at d = 6, C = 8, K = 5,
    T = 100 (5 x 7 x 3 = 105 cells); ``quick``: 4 small cells."""
    if quick:
        return [Cell(3, 3, 4, 0.05, 16, z, z, rho) for z in (0.0, 1.0) for rho in (0.0, 0.5)]
    return [Cell(6, 8, 5, lr, 100, zk, zv, rho) for rho in MAP_SHIFTS
            for zk, zv in MAP_TEACHERS for lr in MAP_LRS]


def excess_table(cell: Cell, seed: int) -> dict:
    """R(schedule, T0) for every schedule and T0 of ``cell`` on the problem of ``seed``.

    Returns ``{"schedules", "warmup_rounds", "excess"}`` (excess: (schedules, T0) nested
    lists), or ``{"error": message}`` where the step size is unstable on that problem.
    """
    problem = cell.problem(seed)
    star = solve_profile(problem).value
    start = initial_point(problem, seed=seed)
    t0s = cell.warmup_rounds()
    schedules = decay_schedules(cell.lr, cell.total_rounds)
    rows = []
    try:
        for schedule in schedules.values():
            res = population_dynamics(problem, start, cell.lr, cell.local_steps,
                                      cell.total_rounds, t0s, star, lr_schedule=schedule)
            rows.append(res.final_error)
    except ParameterError as exc:
        return {"error": str(exc)}
    return {"schedules": list(schedules), "warmup_rounds": t0s,
            "excess": np.array(rows).tolist()}


def compare(table: dict) -> dict:
    """The per-problem comparison (i)-(iii) and the cut, from :func:`excess_table`."""
    excess = np.asarray(table["excess"])
    names, t0s = table["schedules"], table["warmup_rounds"]
    const, cut = excess[names.index("constant")], excess[names.index(CUT)]
    at_end = excess[:, -1]
    s_both, j_both = np.unravel_index(int(np.argmin(excess)), excess.shape)
    frozen, decay, both = float(const.min()), float(at_end.min()), float(excess.min())
    return {
        "frozen": frozen, "frozen_warmup": t0s[int(np.argmin(const))],
        "decay": decay, "decay_schedule": names[int(np.argmin(at_end))],
        "both": both, "both_schedule": names[s_both], "both_warmup": t0s[j_both],
        "constant": float(const[-1]),
        "cut": float(cut[-1]), "cut_frozen": float(cut.min()),
        "cut_warmup": t0s[int(np.argmin(cut))],
        "both_over_decay": both / decay, "frozen_over_decay": frozen / decay,
        "cut_frozen_over_cut": float(cut.min()) / float(cut[-1]),
    }


def _task(args) -> dict:
    part, index, cell, seed = args
    table = excess_table(cell, seed)
    row = {"part": part, "cell": index, "seed": seed, **asdict(cell), "label": cell.label}
    if "error" in table:
        return {**row, "error": table["error"]}
    return {**row, **compare(table), "table": table}


def run_tables(seeds, quick: bool = False, workers: int = 1) -> list[dict]:
    """Every (part, cell, seed) of both grids, in a fixed order (``workers`` processes)."""
    tasks = [(part, i, cell, s) for part, cells in (("study", study_cells(quick)),
                                                    ("map", map_cells(quick)))
             for i, cell in enumerate(cells) for s in seeds]
    if workers <= 1:
        return [_task(t) for t in tasks]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_task, tasks, chunksize=4))
