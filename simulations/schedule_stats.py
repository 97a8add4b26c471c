"""Summaries of the schedule study (:mod:`simulations.schedule_study`): medians, fractions
and the held-out protocol.

Ratios are of final excess risk R = F(M_T0, V_T) - Phi*; a ratio below 1 favours the
numerator's method. ``both / decay`` is what freezing adds on top of the best decay schedule
(1: nothing; it can exceed 1 only under the held-out protocol).
"""

from __future__ import annotations

import numpy as np

from simulations.schedule_study import CUT, STUDY_LEVELS


def _stats(values) -> dict:
    """Median, quartiles and the fractions below 0.99, 0.9, 0.5 (and exactly 1)."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if x.size == 0:
        return {"n": 0}
    q1, med, q3 = np.quantile(x, [0.25, 0.5, 0.75])
    return {"n": int(x.size), "median": float(med), "q1": float(q1), "q3": float(q3),
            "min": float(x.min()), "max": float(x.max()),
            "below_0.99": float(np.mean(x < 0.99)), "below_0.9": float(np.mean(x < 0.9)),
            "below_0.5": float(np.mean(x < 0.5)), "exactly_1": float(np.mean(x == 1.0)),
            "above_1.01": float(np.mean(x > 1.01))}


def _fraction(flags) -> float | None:
    flags = list(flags)
    return float(np.mean(flags)) if flags else None


def held_out(rows: list[dict], selection: list[int]) -> list[dict]:
    """Per cell, choose on the ``selection`` seeds and evaluate on the others.

    Choices (lowest mean over the selection problems of log R): (i) the T0 of constant-eta
    FedFrozen, (ii) the schedule without freezing, (iii) the (schedule, T0) pair. Returns one
    record per held-out problem with the three excesses and their ratios.
    """
    out = []
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        if "error" not in r:
            cells.setdefault((r["part"], r["cell"]), []).append(r)
    for members in cells.values():
        chosen = [r for r in members if r["seed"] in selection]
        if not chosen:
            continue
        names = chosen[0]["table"]["schedules"]
        logs = np.mean([np.log(np.asarray(r["table"]["excess"])) for r in chosen], axis=0)
        const = names.index("constant")
        j_frozen = int(np.argmin(logs[const]))
        s_decay = int(np.argmin(logs[:, -1]))
        s_both, j_both = np.unravel_index(int(np.argmin(logs)), logs.shape)
        for r in members:
            if r["seed"] in selection:
                continue
            e = np.asarray(r["table"]["excess"])
            frozen, decay, both = e[const, j_frozen], e[s_decay, -1], e[s_both, j_both]
            t0s = r["table"]["warmup_rounds"]
            out.append({"part": r["part"], "cell": r["cell"], "seed": r["seed"],
                        **{k: r[k] for k in STUDY_LEVELS},
                        "frozen_warmup": t0s[j_frozen], "decay_schedule": names[s_decay],
                        "both_schedule": names[s_both], "both_warmup": t0s[j_both],
                        "both_over_decay": float(both / decay),
                        "frozen_over_decay": float(frozen / decay)})
    return out


def by_factor(rows: list[dict], key: str = "both_over_decay") -> dict:
    """Median of ``key`` and the fraction below 0.9 at each level of each factor."""
    out = {}
    for factor in STUDY_LEVELS:
        levels = sorted({r[factor] for r in rows})
        out[factor] = {str(level): _stats([r[key] for r in rows if r[factor] == level])
                       for level in levels}
    return out


def _cell_medians(rows: list[dict], key: str) -> list[dict]:
    cells: dict[int, list[dict]] = {}
    for r in rows:
        cells.setdefault(r["cell"], []).append(r)
    return [{"cell": c, "label": rs[0]["label"], key: float(np.median([r[key] for r in rs]))}
            for c, rs in sorted(cells.items())]


def study_summary(rows: list[dict], seeds) -> dict:
    ok = [r for r in rows if r["part"] == "study" and "error" not in r]
    failed = [r for r in rows if r["part"] == "study" and "error" in r]
    half = len(seeds) // 2
    held = held_out([r for r in rows if r["part"] == "study"], list(seeds[:half]))
    cells = _cell_medians(ok, "both_over_decay")
    return {
        "problems": len(ok), "unstable_problems": len(failed),
        "unstable_cells": sorted({r["label"] for r in failed}),
        "oracle": {
            "both_over_decay": _stats(r["both_over_decay"] for r in ok),
            "frozen_over_decay": _stats(r["frozen_over_decay"] for r in ok),
            "decay_beats_frozen": _fraction(r["decay"] < r["frozen"] for r in ok),
            "decay_schedule_counts": _counts(r["decay_schedule"] for r in ok),
            "both_schedule_counts": _counts(r["both_schedule"] for r in ok),
            "by_factor": by_factor(ok),
        },
        "held_out": {
            "both_over_decay": _stats(r["both_over_decay"] for r in held),
            "frozen_over_decay": _stats(r["frozen_over_decay"] for r in held),
            "by_factor": by_factor(held),
        },
        "where_it_adds": {
            "oracle": _stats(r["both_over_decay"] for r in ok if r["both_over_decay"] < 0.99),
            "held_out": _stats(r["both_over_decay"] for r in held
                               if r["both_over_decay"] < 0.99),
        },
        "by_shift_and_local_steps": {
            f"rho={rho:g},K={k}": {
                "oracle": _stats(r["both_over_decay"] for r in ok
                                 if r["covariate_shift"] == rho and r["local_steps"] == k),
                "held_out": _stats(r["both_over_decay"] for r in held
                                   if r["covariate_shift"] == rho and r["local_steps"] == k),
                "frozen_over_decay": _stats(r["frozen_over_decay"] for r in ok
                                            if r["covariate_shift"] == rho
                                            and r["local_steps"] == k)}
            for rho in STUDY_LEVELS["covariate_shift"] for k in STUDY_LEVELS["local_steps"]},
        "cells_where_freezing_adds": [c for c in cells if c["both_over_decay"] < 0.9],
        "cells": len(cells),
    }


def _counts(values) -> dict:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def _claim_stats(rows: list[dict]) -> dict:
    """The quoted claim's numbers on a subset: cut + FedFrozen over the cut alone, how often
    the cut alone beats FedFrozen's best constant-eta T0, how often the best T0 is T."""
    return {
        "settings": len(rows),
        "cut_frozen_over_cut": _stats(r["cut_frozen_over_cut"] for r in rows),
        "cut_beats_frozen": _fraction(r["cut"] < r["frozen"] for r in rows),
        "cut_best_warmup_is_T": _fraction(r["cut_warmup"] == r["total_rounds"] for r in rows),
        "both_over_decay": _stats(r["both_over_decay"] for r in rows),
        "both_best_warmup_is_T": _fraction(r["both_warmup"] == r["total_rounds"] for r in rows),
    }


def map_summary(rows: list[dict]) -> dict:
    """The map (median ratios per covariate shift x teachers, over eta and seeds), the claim
    at rho = 0 and rho > 0 with teachers differing, and the on/off pairs."""
    ok = [r for r in rows if r["part"] == "map" and "error" not in r]
    failed = [r for r in rows if r["part"] == "map" and "error" in r]
    grid = {}
    for r in ok:
        key = (r["covariate_shift"], r["kernel_heterogeneity"], r["value_heterogeneity"])
        grid.setdefault(key, []).append(r)
    cells = [{"covariate_shift": k[0], "kernel_heterogeneity": k[1],
              "value_heterogeneity": k[2], "n": len(v),
              "both_over_decay": float(np.median([r["both_over_decay"] for r in v])),
              "cut_frozen_over_cut": float(np.median([r["cut_frozen_over_cut"] for r in v])),
              "frozen_over_decay": float(np.median([r["frozen_over_decay"] for r in v]))}
             for k, v in sorted(grid.items())]
    differ = [r for r in ok if r["kernel_heterogeneity"] > 0 or r["value_heterogeneity"] > 0]
    no_shift = [r for r in differ if r["covariate_shift"] == 0]
    shifted = [r for r in differ if r["covariate_shift"] > 0]
    return {"problems": len(ok), "unstable_problems": len(failed),
            "unstable_cells": sorted({r["label"] for r in failed}), "cells": cells,
            "teachers_differ_no_shift": _claim_stats(no_shift),
            "teachers_differ_shift": _claim_stats(shifted),
            "pairs": shift_pairs(differ)}


def shift_pairs(rows: list[dict]) -> dict:
    """Same teachers (seed, zeta_K, zeta_V), same eta: rho = 0 against each rho > 0."""
    base = {(r["seed"], r["kernel_heterogeneity"], r["value_heterogeneity"], r["lr"]): r
            for r in rows if r["covariate_shift"] == 0}
    out = {}
    for key in ("cut_frozen_over_cut", "both_over_decay"):
        pairs = [(base[k][key], r[key]) for r in rows if r["covariate_shift"] > 0
                 for k in [(r["seed"], r["kernel_heterogeneity"], r["value_heterogeneity"],
                            r["lr"])] if k in base]
        off, on = np.array(pairs).T if pairs else (np.array([]), np.array([]))
        out[key] = {"pairs": len(pairs),
                    "lower_without_shift": _fraction(off < on) if pairs else None,
                    "equal": _fraction(off == on) if pairs else None,
                    "median_without_shift": float(np.median(off)) if pairs else None,
                    "median_with_shift": float(np.median(on)) if pairs else None}
        per_shift = {}
        for rho in sorted({r["covariate_shift"] for r in rows if r["covariate_shift"] > 0}):
            sel = [(base[k][key], r[key]) for r in rows if r["covariate_shift"] == rho
                   for k in [(r["seed"], r["kernel_heterogeneity"], r["value_heterogeneity"],
                              r["lr"])] if k in base]
            a, b = np.array(sel).T
            per_shift[str(rho)] = {"pairs": len(sel), "lower_without_shift":
                                   float(np.mean(a < b)), "median_with_shift":
                                   float(np.median(b))}
        out[key]["by_shift"] = per_shift
    return out


def summarize(rows: list[dict], seeds) -> dict:
    return {"study": study_summary(rows, seeds), "map": map_summary(rows),
            "cut": CUT}
