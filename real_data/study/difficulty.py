"""How hard a shift makes the task: FedAvg's gap to the same data without the shift.

A sweep with ``reference_sweep: <name>`` (:mod:`real_data.study.plan`) is measured against that
sweep: its difficulty is the reference's FedAvg score minus its own, in points, on validation
(the tuning seed's best grid point, from the tuning choices) and on test (the final runs, paired
by seed, with a 95% t interval). Two kinds of heterogeneity compare fairly only at matched
difficulty, so :func:`match` pairs every concept-shift sweep with the covariate-shift sweep of the
same reference whose validation gap is nearest (a calibration plan such as
``shift_fmnist_calibration`` picks the strengths a study then uses).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from linattn.configio import parse_overrides
from linattn.fileio import atomic_write_text
from real_data.study.plan import Plan, higher_is_better
from real_data.study.tables import t_interval, write_csv

AGAINST = "fedavg"


def shift_of(sweep) -> dict | None:
    """The sweep's ``partition.shift`` as a mapping (None without one)."""
    values = dict(parse_overrides(list(sweep.overrides)))  # as a run's config reads them
    return values.get("partition.shift")


def describe(shift: dict | None) -> str:
    if not shift:
        return "none"
    if shift.get("kind") == "concept":
        groups = shift.get("groups", 2)
        return (f"concept: {shift.get('classes')} classes relabelled in {groups - 1} of "
                f"{groups} client groups")
    return f"covariate: {shift.get('transform', 'rotation')} spread {shift.get('spread')}"


def validation_gaps(plan: Plan, choices: dict) -> list[dict]:
    """Per sweep with a reference and alpha: FedAvg's chosen validation score, the reference's,
    and the gap (reference minus sweep, in the metric's units; points for accuracy). A sweep
    whose FedAvg or whose reference's FedAvg has no finite chosen score yet is left out."""
    chosen = {}
    for c in choices["choices"]:
        if c["arm"] != AGAINST:
            continue
        try:  # an exported table writes an infinite score as a string
            score = float((c.get("chosen") or {}).get("score"))
        except (TypeError, ValueError):
            continue
        if np.isfinite(score):
            metric = c.get("metric") or choices.get("metric", "val_acc")
            chosen[(c["sweep"], c["alpha"])] = (score, metric)
    rows = []
    for sw in plan.sweeps:
        if sw.reference_sweep is None:
            continue
        for alpha in sw.alphas:
            own, ref = chosen.get((sw.name, alpha)), chosen.get((sw.reference_sweep, alpha))
            if own is None or ref is None or own[1] != ref[1]:  # one metric on both sides
                continue
            sign = 1.0 if higher_is_better(own[1]) else -1.0
            shift = shift_of(sw)
            rows.append({"sweep": sw.name, "alpha": alpha, "reference": sw.reference_sweep,
                         "kind": (shift or {}).get("kind"), "shift": describe(shift),
                         "metric": own[1], "val_score": own[0],
                         "reference_val_score": ref[0], "val_gap": sign * (ref[0] - own[0])})
    return rows


def match(rows: list[dict]) -> list[dict]:
    """Every concept-shift row with the covariate-shift row of the same reference and alpha
    whose validation gap is nearest (ties: the first in plan order); a covariate row is used
    once per alpha, the concept rows taking theirs in increasing order of gap."""
    out, used = [], set()
    concept = sorted((r for r in rows if r["kind"] == "concept"), key=lambda r: r["val_gap"])
    for c in concept:
        cands = [r for r in rows if r["kind"] == "covariate" and r["reference"] == c["reference"]
                 and r["alpha"] == c["alpha"] and (r["sweep"], r["alpha"]) not in used]
        if not cands:
            continue
        best = min(cands, key=lambda r: abs(r["val_gap"] - c["val_gap"]))
        used.add((best["sweep"], best["alpha"]))
        out.append({"concept": c["sweep"], "concept_gap": c["val_gap"],
                    "covariate": best["sweep"], "covariate_shift": best["shift"],
                    "covariate_gap": best["val_gap"], "alpha": c["alpha"],
                    "gap_difference": best["val_gap"] - c["val_gap"]})
    return out


def test_gaps(plan: Plan, runs: list[dict], metric: str = "score",
              level: float = 0.95) -> list[dict]:
    """Per sweep with a reference and alpha: FedAvg's final score against the reference's
    FedAvg, paired by seed: the mean gap (reference minus sweep), its t interval, n."""
    score = {(r["sweep"], r["alpha"], r["seed"]): r.get(metric) for r in runs
             if r["arm"] == AGAINST and r["warmup_rounds"] is None}
    rows = []
    for sw in plan.sweeps:
        if sw.reference_sweep is None:
            continue
        for alpha in sw.alphas:
            d, own_all, ref_all = [], [], []
            for seed in sw.seeds:
                own = score.get((sw.name, alpha, seed))
                ref = score.get((sw.reference_sweep, alpha, seed))
                if own is None or ref is None or not (np.isfinite(own) and np.isfinite(ref)):
                    continue
                d.append(ref - own)
                own_all.append(own)
                ref_all.append(ref)
            if not d:
                continue
            gap, _, half = t_interval(d, level)
            shift = shift_of(sw)
            rows.append({"sweep": sw.name, "alpha": alpha, "reference": sw.reference_sweep,
                         "kind": (shift or {}).get("kind"), "shift": describe(shift),
                         "n": len(d), "score": float(np.mean(own_all)),
                         "reference_score": float(np.mean(ref_all)), "gap": gap,
                         "gap_low": None if half is None else gap - half,
                         "gap_high": None if half is None else gap + half})
    return rows


def write_difficulty(plan: Plan, folder, choices: dict | None = None,
                     runs: list[dict] | None = None) -> list:
    """``difficulty.{csv,md}`` in ``folder``: the validation gaps (with ``choices``) and the
    matched pairs, and the final runs' test gaps (with ``runs``); nothing without a reference
    sweep in the plan."""
    if not any(sw.reference_sweep for sw in plan.sweeps):
        return []
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    val = validation_gaps(plan, choices) if choices is not None else []
    test = test_gaps(plan, runs) if runs is not None else []
    pairs = match(val)
    rows = ([{"table": "validation", **r} for r in val] + [{"table": "test", **r} for r in test]
            + [{"table": "match", **r} for r in pairs])
    if not rows:
        return []

    def pts(x):
        return "" if x is None else f"{100 * x:.2f}"

    lines = ["Difficulty: FedAvg's score on the data without the shift (reference sweep) minus "
             "its score with the shift, in points; larger is harder."]
    if val:
        lines += ["", f"Validation ({choices.get('metric', 'val_acc')}, tuning seed "
                  f"{choices.get('seed')}, mean of the last {choices.get('last')} evaluations; "
                  "FedAvg's chosen grid point):", "",
                  "| sweep | shift | FedAvg | reference | gap (pts) |", "|---|---|---|---|---|"]
        lines += [f"| {r['sweep']} | {r['shift']} | {pts(r['val_score'])} | "
                  f"{pts(r['reference_val_score'])} | {pts(r['val_gap'])} |" for r in val]
    if pairs:
        lines += ["", "Matched pairs (each concept shift with the covariate shift of the nearest "
                  "validation gap):", "",
                  "| concept sweep | gap | covariate sweep | covariate shift | gap | difference |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {p['concept']} | {pts(p['concept_gap'])} | {p['covariate']} | "
                  f"{p['covariate_shift']} | {pts(p['covariate_gap'])} | "
                  f"{pts(p['gap_difference'])} |" for p in pairs]
    if test:
        lines += ["", "Test (final runs, paired by seed, 95% t interval):", "",
                  "| sweep | shift | n | FedAvg | reference | gap (pts) | 95% CI |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['sweep']} | {r['shift']} | {r['n']} | {pts(r['score'])} | "
                  f"{pts(r['reference_score'])} | {pts(r['gap'])} | "
                  + ("" if r["gap_low"] is None else
                     f"[{pts(r['gap_low'])}, {pts(r['gap_high'])}]") + " |" for r in test]
    csv_path, md_path = folder / "difficulty.csv", folder / "difficulty.md"
    keys = list(dict.fromkeys(k for r in rows for k in r))  # one header for the three tables
    write_csv([{k: r.get(k, "") for k in keys} for r in rows], csv_path)
    atomic_write_text(md_path, "\n".join(lines) + "\n")
    return [csv_path, md_path]
