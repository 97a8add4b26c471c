"""Online freeze timing against the best fixed T0: each rule's regret, per setting and overall.

A plan that runs online freeze rules (arms with ``algorithm.warmup=<rule>`` or ``auto``) beside
a fixed-T0 arm (``warmup_rounds``, its T0 chosen on the validation split by the tuning stage)
and FedAvg (never freezing, T0 = T) is read per setting (sweep and alpha), paired by seed:

- the **target** is the best fixed T0 of the grid, never freezing included, by mean validation
  score over the final seeds every candidate finished (ties go to never freezing; the test
  set decides nothing): in a tuned plan the candidates are the tuning stage's choice among the
  grid's T0 values (tuning seed) and T; in a plan whose fixed arm runs its whole grid on the
  final seeds, every grid T0 and T. A diverged candidate has no score and is not the target;
- a method's **regret** is the target's test score minus its own, per seed, in points (mean and
  95% t interval over the seeds both finished; positive: the method lost to the best fixed
  T0). FedAvg's and the fixed arm's rows are references: the one that is the target has
  regret 0 by construction;
- its difference to FedAvg and the verdict are :func:`~real_data.study.tables.compare`'s
  (win / loss where the interval excludes 0, tie by two one-sided tests within 1 point);
- its **overhead**: the training rounds computed over T (the probe estimator's freeze-now forks
  included), the rule's own seconds as a share of the run's wall time, the state it keeps;
- it **refrains correctly** where the target is T and it never froze, and fires where the
  target is a T0 < T.

Across the settings every method completed on all seeds (the same settings for every
method): mean, median and max regret, the settings within 1 point of the target and those more
than 1 point below FedAvg, win / tie / loss / inconclusive against FedAvg, the refrain rate
where the best T0 is T and the fire rate where it is below T. ``rule_regret.json``
holds every per-seed number; ``rule_regret.md`` the tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from linattn.fileio import atomic_write_text
from real_data.study.plan import (
    Plan,
    RunSpec,
    inside,
    override_value,
    run_config,
    run_key,
)
from real_data.study.tables import compare, t_interval

AGAINST = "fedavg"


def _decides_online(plan: Plan, sweep, arm) -> bool:
    """True when ``arm``'s runs decide T0 online: FedFrozen whose resolved ``algorithm.warmup``
    is a rule or ``auto`` (set by the arm, or the default where no T0 is given). An arm with a
    T0 grid runs fixed T0s."""
    if arm.warmup_rounds:
        return False
    named = override_value(arm.overrides, "algorithm.warmup")
    if named is not None:
        return named != "fixed"
    alpha, seed = sweep.alphas[0], sweep.seeds[0]
    key = run_key(sweep.name, arm.name, None, alpha, seed)
    cfg = run_config(RunSpec(key, sweep, arm, alpha, seed, None, inside(plan.out_dir, key)),
                     None)
    return cfg.algorithm.name == "fedfrozen" and cfg.algorithm.params.warmup != "fixed"


def rule_arms(plan: Plan) -> dict[str, list[str]]:
    """Per sweep, the arms that decide T0 online (``algorithm.warmup`` other than ``fixed``,
    as the run resolves it)."""
    out: dict[str, list[str]] = {}
    for sw in plan.sweeps:
        names = [a.name for a in sw.arms if _decides_online(plan, sw, a)]
        if names:
            out.setdefault(sw.name, [])
            out[sw.name] += [n for n in names if n not in out[sw.name]]
    return out


def fixed_arm(plan: Plan, sweep: str) -> str | None:
    """The sweep's fixed-T0 arm: the one with a T0 grid and no online rule, or None."""
    for sw in plan.sweeps:
        if sw.name != sweep:
            continue
        for a in sw.arms:
            if a.warmup_rounds and override_value(a.overrides, "algorithm.warmup") in (
                    None, "fixed"):
                return a.name
    return None


def has_rules(plan: Plan) -> bool:
    return bool(rule_arms(plan))


def _finite(v) -> bool:
    return v is not None and np.isfinite(v)


def rule_regret(plan: Plan, runs: list[dict], seeds: tuple[int, ...] | None = None) -> dict:
    """The report (module docstring) from ``runs`` (:func:`~real_data.study.tables.run_rows`
    of the plan's final stage). ``seeds``: the seeds a setting needs for a method to count in
    the summary (default: every seed of the sweep)."""
    rules = rule_arms(plan)
    verdicts = {(c["sweep"], c["arm"], c["warmup_rounds"], c["alpha"]): c
                for c in compare(runs, AGAINST, "score")}
    settings = []
    for sw in plan.sweeps:
        if sw.name not in rules:
            continue
        fixed = fixed_arm(plan, sw.name)
        need = set(sw.seeds if seeds is None else seeds)
        for alpha in sw.alphas:
            if any(s["sweep"] == sw.name and s["alpha"] == alpha for s in settings):
                continue  # a final plan repeats a sweep's name once per alpha
            cell = [r for r in runs if r["sweep"] == sw.name and r["alpha"] == alpha]
            if not cell:  # nothing of this setting has finished
                continue
            settings.append(_setting(sw.name, alpha, cell, fixed, rules[sw.name], need,
                                     verdicts))
    methods = sorted({m["method"] for s in settings for m in s["methods"]},
                     key=lambda n: (n not in (AGAINST,), n))
    # the summary compares methods on the same settings: those every method completed
    common = [s for s in settings if s["methods"] and all(m["complete"] for m in s["methods"])]
    return {"against": AGAINST, "score": "mean test accuracy of the last 5 evaluations",
            "settings": settings,
            "summary_settings": [[s["sweep"], s["alpha"]] for s in common],
            "incomplete_settings": [[s["sweep"], s["alpha"]] for s in settings
                                    if s not in common],
            "summary": [_summary(name, common) for name in methods]}


def _mean_val(runs: dict, seeds: list[int]) -> float:
    """Mean validation score over ``seeds``; NaN where a run diverged (no score)."""
    vals = [runs[s]["val_score"] for s in seeds]
    return float(np.mean(vals)) if vals and np.all(np.isfinite(vals)) else float("nan")


def _setting(sweep, alpha, cell, fixed, rules, need, verdicts) -> dict:
    fedavg = {r["seed"]: r for r in cell if r["arm"] == AGAINST and r["warmup_rounds"] is None}
    by_t0: dict[int, dict[int, dict]] = {}  # the fixed arm's runs by T0 (one T0 once tuned)
    for r in cell:
        if fixed is not None and r["arm"] == fixed:
            by_t0.setdefault(r["warmup_rounds"], {})[r["seed"]] = r
    horizon = next((int(r["rounds"]) for r in cell if _finite(r.get("rounds"))), None)
    # the target: the fixed T0 or never freezing with the best mean validation score over the
    # seeds every candidate finished (ties go to never freezing); a diverged candidate has no
    # score and cannot be the target
    common = set(fedavg)
    for runs in by_t0.values():
        common &= set(runs)
    both = sorted(common) if by_t0 else []
    val_t0 = {t0: _mean_val(runs, both) for t0, runs in by_t0.items()}
    finite = {t0: v for t0, v in val_t0.items() if np.isfinite(v)}
    chosen_t0 = max(finite, key=lambda t0: (finite[t0], -t0)) if finite else None
    val_avg = _mean_val(fedavg, both)
    fixed_runs = by_t0.get(chosen_t0, {})
    target_arm, target_t0 = fixed, chosen_t0
    if np.isfinite(val_avg) and (chosen_t0 is None or val_avg >= finite[chosen_t0]):
        target_arm, target_t0 = AGAINST, horizon
    target = fedavg if target_arm == AGAINST else fixed_runs
    out = {"sweep": sweep, "alpha": alpha, "rounds": horizon, "chosen_grid_t0": chosen_t0,
           "val_score_chosen_t0": None if chosen_t0 is None else finite[chosen_t0],
           "val_score_fedavg": val_avg if np.isfinite(val_avg) else None,
           "val_score_by_t0": {str(t0): (v if np.isfinite(v) else None)
                               for t0, v in sorted(val_t0.items())},
           "target": target_arm, "target_t0": target_t0,
           "best_is_never": target_arm == AGAINST, "methods": []}
    if not both or (chosen_t0 is None and not np.isfinite(val_avg)):
        # no seed has every candidate's run yet (or all diverged): nothing to score against
        out.update(target=None, target_t0=None, best_is_never=None)
        return out
    for name in [AGAINST, *([fixed] if fixed else []), *rules]:
        own = fedavg if name == AGAINST else (
            fixed_runs if name == fixed else {r["seed"]: r for r in cell if r["arm"] == name})
        seeds = sorted(set(own) & set(target))
        per_seed = []
        for s in seeds:
            r = own[s]
            decided = r.get("decided_T0")
            t0 = (r["warmup_rounds"] if r["warmup_rounds"] is not None else
                  int(decided) if _finite(decided) else horizon)
            per_seed.append({
                "seed": s, "t0": t0, "fired": None if not _finite(r.get("fired"))
                else bool(r["fired"]), "score": r["score"], "val_score": r["val_score"],
                "regret_pts": 100 * (target[s]["score"] - r["score"]),
                "compute_ratio": r.get("compute_ratio"),
                "rule_time_share": (r["rule_seconds"] / r["wall_time_s"]
                                    if _finite(r.get("rule_seconds"))
                                    and _finite(r.get("wall_time_s")) and r["wall_time_s"] > 0
                                    else None),
                "rule_state_bytes": r.get("rule_state_bytes") if _finite(
                    r.get("rule_state_bytes")) else None})
        regrets = [p["regret_pts"] for p in per_seed if np.isfinite(p["regret_pts"])]
        mean, _, half = t_interval(regrets) if regrets else (None, None, None)
        v = verdicts.get((sweep, name, own[seeds[0]]["warmup_rounds"] if seeds else None,
                          alpha)) if name != AGAINST else None
        fired = [p["fired"] for p in per_seed if p["fired"] is not None]
        out["methods"].append({
            "method": name, "kind": ("never freeze" if name == AGAINST else
                                     "fixed T0" if name == fixed else "online"),
            "n": len(regrets), "complete": need <= set(seeds) and len(regrets) == len(seeds),
            "t0_per_seed": [p["t0"] for p in per_seed],
            "score_mean": float(np.mean([p["score"] for p in per_seed])) if per_seed else None,
            "regret_pts": mean, "regret_ci_pts": half,
            "diff_fedavg_pts": None if v is None else 100 * v["diff_mean"],
            "diff_fedavg_ci_pts": (None if v is None or v["ci_low"] is None else
                                   [100 * v["ci_low"], 100 * v["ci_high"]]),
            "verdict": "reference" if name == AGAINST else (
                "missing" if v is None else v["verdict"]),
            "never_fired": (sum(not f for f in fired) if fired else None),
            "compute_ratio": _mean([p["compute_ratio"] for p in per_seed]),
            "rule_time_share": _mean([p["rule_time_share"] for p in per_seed]),
            "rule_state_bytes": _mean([p["rule_state_bytes"] for p in per_seed]),
            "per_seed": per_seed})
    return out


def _mean(values) -> float | None:
    v = [x for x in values if _finite(x)]
    return float(np.mean(v)) if v else None


def _summary(name: str, settings: list[dict]) -> dict:
    rows = [(s, m) for s in settings for m in s["methods"] if m["method"] == name
            and m["complete"]]
    counts = {"win": 0, "tie": 0, "loss": 0, "inconclusive": 0}
    for _, m in rows:
        v = m["verdict"]
        key = ("win" if v.startswith("win") else "loss" if v.startswith("loss") else
               "tie" if v in ("tie", "identical") else "inconclusive")
        if name != AGAINST:
            counts[key] += 1
    never = [(s, m) for s, m in rows if s["best_is_never"]]
    freeze = [(s, m) for s, m in rows if not s["best_is_never"]]

    def share(items, want_never: bool):
        runs = [p for _, m in items for p in m["per_seed"] if p["fired"] is not None]
        if not runs:
            return None
        return float(np.mean([(not p["fired"]) == want_never for p in runs]))

    regrets = [m["regret_pts"] for _, m in rows if m["regret_pts"] is not None]
    return {"method": name, "kind": rows[0][1]["kind"] if rows else None,
            "settings": len(rows),
            "mean_regret_pts": float(np.mean(regrets)) if regrets else None,
            "median_regret_pts": float(np.median(regrets)) if regrets else None,
            "max_regret_pts": float(np.max(regrets)) if regrets else None,
            **({} if name == AGAINST else counts),
            # the recommender's real-data criteria: within 1 point of the target, and never
            # more than 1 point below FedAvg (mean over seeds, per setting)
            "within_1pt_of_target": sum(r <= 1.0 for r in regrets),
            "more_than_1pt_below_fedavg": (None if name == AGAINST else sum(
                m["diff_fedavg_pts"] is not None and m["diff_fedavg_pts"] < -1.0
                for _, m in rows)),
            "refrain_settings": len(never), "refrain_rate": share(never, True),
            "fire_settings": len(freeze), "fire_rate": share(freeze, False),
            "compute_ratio": _mean([m["compute_ratio"] for _, m in rows])}


def _pts(v, signed=True) -> str:
    if v is None:
        return "-"
    return f"{v:+.2f}" if signed else f"{v:.2f}"


def _rate(v) -> str:
    return "-" if v is None else f"{100 * v:.0f}%"


def report_lines(report: dict) -> list[str]:
    """The markdown of :func:`rule_regret`."""
    lines = [
        f"Online freeze timing against the best fixed T0; score: {report['score']}, paired by "
        "seed, in points. Target: the tuning stage's T0 (validation, tuning seed), or never "
        "freezing (T) where FedAvg's mean validation score over the final seeds is at least "
        "that T0's. Regret: target minus method (positive: worse than the best fixed T0), "
        "mean over seeds +- 95% t half-width. vs FedAvg: difference, 95% t interval and "
        "verdict (tie: equivalent within +-1 point by two one-sided tests at 5%). Compute: "
        "training rounds computed over T.", "",
        "Across the settings every method completed on every seed ("
        + (", ".join(f"{sw} {'natural' if a is None else a}"
                     for sw, a in report["summary_settings"]) or "none")
        + ("; left out, unfinished: " + ", ".join(
            f"{sw} {'natural' if a is None else a}" for sw, a in report["incomplete_settings"])
           if report["incomplete_settings"] else "") + "):", "",
        "| method | settings | mean regret | median | max | within 1 pt of target | > 1 pt below "
        "FedAvg | win / tie / loss / inconclusive vs FedAvg | refrains where best is T | fires "
        "where best T0 < T | compute |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for s in sorted(report["summary"], key=lambda s: (s["mean_regret_pts"] is None,
                                                      s["mean_regret_pts"] or 0)):
        wtl = ("-" if s["method"] == AGAINST else
               f"{s['win']} / {s['tie']} / {s['loss']} / {s['inconclusive']}")
        refrain = ("-" if s["refrain_rate"] is None else
                   f"{_rate(s['refrain_rate'])} of {s['refrain_settings']}")
        fire = ("-" if s["fire_rate"] is None else
                f"{_rate(s['fire_rate'])} of {s['fire_settings']}")
        comp = "-" if s["compute_ratio"] is None else f"{s['compute_ratio']:.2f}"
        below = "-" if s["more_than_1pt_below_fedavg"] is None else s["more_than_1pt_below_fedavg"]
        lines.append(f"| {s['method']} | {s['settings']} | {_pts(s['mean_regret_pts'])} | "
                     f"{_pts(s['median_regret_pts'])} | {_pts(s['max_regret_pts'])} | "
                     f"{s['within_1pt_of_target']} | {below} | {wtl} | "
                     f"{refrain} | {fire} | {comp} |")
    for st in report["settings"]:
        alpha = "natural" if st["alpha"] is None else st["alpha"]
        if st["target"] is None:
            lines += ["", f"{st['sweep']}, alpha {alpha}: no target yet (no seed has finished "
                      "both the fixed T0's and FedAvg's run)"]
            continue
        val = ("" if st["val_score_fedavg"] is None else
               f"; validation: chosen T0 {st['val_score_chosen_t0']:.4f}, FedAvg "
               f"{st['val_score_fedavg']:.4f}")
        lines += ["", f"{st['sweep']}, alpha {alpha}: target T0 = {st['target_t0']} "
                  f"({st['target']}; grid choice {st['chosen_grid_t0']}{val})", "",
                  "| method | n | T0 per seed | score | regret | vs FedAvg | 95% CI | verdict | "
                  "compute | rule time | rule state (MB) |",
                  "|---|--:|---|--:|--:|--:|---|---|--:|--:|--:|"]
        for m in st["methods"]:
            t0s = ", ".join("-" if t is None else f"{t:g}" for t in m["t0_per_seed"])
            ci = ("" if m["diff_fedavg_ci_pts"] is None else
                  f"[{m['diff_fedavg_ci_pts'][0]:+.2f}, {m['diff_fedavg_ci_pts'][1]:+.2f}]")
            reg = ("-" if m["regret_pts"] is None else f"{m['regret_pts']:+.2f}"
                   + ("" if m["regret_ci_pts"] is None else f" +- {m['regret_ci_pts']:.2f}"))
            share = "-" if m["rule_time_share"] is None else f"{100 * m['rule_time_share']:.2f}%"
            state = ("-" if m["rule_state_bytes"] is None else
                     f"{m['rule_state_bytes'] / 1e6:.2f}")
            comp = "-" if m["compute_ratio"] is None else f"{m['compute_ratio']:.2f}"
            score = "-" if m["score_mean"] is None else f"{m['score_mean']:.4f}"
            lines.append(f"| {m['method']} | {m['n']} | {t0s} | {score} | {reg} | "
                         f"{_pts(m['diff_fedavg_pts'])} | {ci} | {m['verdict']} | {comp} | "
                         f"{share} | {state} |")
    return lines


def write_rule_regret(plan: Plan, runs: list[dict], out_dir: Path) -> list[Path]:
    """``rule_regret.{json,md}`` in ``out_dir`` where ``plan`` has online freeze rules; none
    otherwise."""
    if not has_rules(plan):
        return []
    report = rule_regret(plan, runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "rule_regret.json", out_dir / "rule_regret.md"]
    atomic_write_text(paths[0], json.dumps(report, indent=1, default=float) + "\n")
    atomic_write_text(paths[1], "\n".join(report_lines(report)) + "\n")
    return paths
