"""Online freeze-timing rules against the best fixed T0, on the warm-up grid's 36 settings.

Each setting of :mod:`simulations.warmup_grid` (a design that shares no level with the default
validation grid) is run once as finite-sample FedAvg (seed 0; the data and minibatch draws of the
probe estimator), and every rule of :mod:`linattn_theory.freeze_rules`, with its published
defaults (never tuned per setting, nor on this grid), watches that trajectory and picks its T0;
``auto`` is the probe estimator (:func:`linattn_theory.sampled.probe_run`), and
``fraction=0.5`` the fixed-schedule reference. Each choice is scored by the exact population
dynamics' final excess risk R(T0) (:func:`linattn_theory.warmup_path.warmup_path`, every T0
in 0..T), so the score has no sampling noise:

- regret: R(T0) / R_grid - 1, against the best T0 of the fixed grid {0, T/10, ..., T} (the
  oracle a grid search with a perfect validation split would find);
- against never freezing (FedAvg, T0 = T): win if R(T0) < 0.99 R(T), loss if > 1.01 R(T),
  else tie;
- refrains: among the settings whose best grid T0 is T, how often the rule stays within 1% of
  R(T) (never firing does that);
- compute: training rounds spent over T (the probe's forks included; the rules' signals cost
  no training round).
"""

from __future__ import annotations

import numpy as np

from linattn_theory.advice import PROBE_DEFAULTS
from linattn_theory.dynamics import initial_point
from linattn_theory.errors import ParameterError
from linattn_theory.profile import solve_profile
from linattn_theory.sampled import probe_run, rule_run
from linattn_theory.warmup_path import warmup_path
from simulations.warmup_grid import PARTS, warmup_settings

RULE_SPECS = ("perturbation", "norm_change", "norm_change_median", "kernel_stability",
              "plateau", "fraction=0.5")
METHODS = ("auto", *RULE_SPECS)
TIE = 0.01


def _grid(total_rounds: int) -> list[int]:
    return sorted({round(k * total_rounds / 10) for k in range(11)})


def evaluate_rules(st, seed: int = 0) -> dict:
    """Every method's T0 and scores on one warm-up-grid setting."""
    problem = st.problem()
    start = initial_point(problem)
    path = warmup_path(problem, start, st.lr, st.local_steps, st.total_rounds,
                       solve_profile(problem).value)
    r = path.final_error
    t_total = st.total_rounds
    grid = _grid(t_total)
    grid_best = min(grid, key=lambda t: r[t])
    row = {"setting": st.label, "part": st.part, "T": t_total, "exact_T0": int(path.best_warmup),
           "grid_T0": int(grid_best), "R_grid": float(r[grid_best]), "R_never": float(r[-1]),
           "methods": {}}
    chosen: dict[str, tuple[int | None, float]] = {}
    try:
        run = probe_run(problem, start, st.lr, st.local_steps, t_total, seed=seed,
                        **PROBE_DEFAULTS)
        chosen["auto"] = (run.choice.warmup_rounds, run.rounds_computed["fedavg_equivalent"])
    except ParameterError:
        chosen["auto"] = (None, float("nan"))
    try:
        rules = rule_run(problem, start, st.lr, st.local_steps, t_total, RULE_SPECS, seed=seed)
        chosen.update({k: (t0, 1.0) for k, t0 in rules.warmup_rounds.items()})
    except ParameterError:
        chosen.update({k: (None, float("nan")) for k in RULE_SPECS})
    for name, (t0, compute) in chosen.items():
        if t0 is None:  # the finite-sample run diverged: a miss, scored as the worst T0
            t0 = int(np.argmax(r))
        ratio = float(r[t0] / r[-1])
        row["methods"][name] = {
            "T0": int(t0), "R": float(r[t0]), "regret": float(r[t0] / r[grid_best] - 1),
            "vs_never": ratio,
            "outcome": "win" if ratio < 1 - TIE else "loss" if ratio > 1 + TIE else "tie",
            "compute": compute}
    return row


def summarize(rows: list[dict]) -> dict:
    """Per method: mean and median regret, wins / ties / losses against never freezing, the
    refrain rate where the best grid T0 is T, and the median compute."""
    out = {}
    refrain_rows = [r for r in rows if r["grid_T0"] == r["T"]]
    for name in METHODS:
        ms = [r["methods"][name] for r in rows if name in r["methods"]]
        if not ms:
            continue
        regret = np.array([m["regret"] for m in ms])
        outcomes = [m["outcome"] for m in ms]
        refrained = [r["methods"][name]["vs_never"] <= 1 + TIE for r in refrain_rows]
        out[name] = {"settings": len(ms), "mean_regret": float(regret.mean()),
                     "median_regret": float(np.median(regret)),
                     "max_regret": float(regret.max()),
                     "within_10pct": float(np.mean(regret <= 0.10)),
                     "win": outcomes.count("win"), "tie": outcomes.count("tie"),
                     "loss": outcomes.count("loss"),
                     "refrain_settings": len(refrain_rows),
                     "refrain_rate": float(np.mean(refrained)) if refrained else float("nan"),
                     "median_compute": float(np.nanmedian([m["compute"] for m in ms]))}
    return out


def run_rule_study(quick: bool = False) -> dict:
    """The study on every setting (``quick``: the 4 cheapest, for tests); summaries overall and
    per part of the grid (development, held-out, fresh)."""
    settings = warmup_settings()
    if quick:
        settings = sorted(settings, key=lambda x: (x.total_rounds, x.dim * x.num_clients))[:4]
    rows = [evaluate_rules(st) for st in settings]
    summary = {"all": summarize(rows)}
    summary.update({p: summarize([r for r in rows if r["part"] == p]) for p in PARTS})
    return {"points": rows, "summary": summary, "methods": list(METHODS), "tie_band": TIE}


def report(result: dict) -> str:
    """A markdown table per part: one row per method."""
    lines = ["# Online freeze rules against the best fixed T0 (exact population dynamics)", "",
             "Regret: R(T0) / R(best T0 of {0, T/10, ..., T}) - 1. Against never freezing: win "
             f"/ tie / loss with a +-{100 * result['tie_band']:g}% band. Refrains: where the "
             "best grid T0 is T, the share of settings where the method stays within the band "
             "of R(T). Compute: training rounds over T.", ""]
    for part, summ in result["summary"].items():
        if not summ:
            continue
        n = next(iter(summ.values()))["settings"]
        lines += [f"## {part} ({n} settings)", "",
                  "| method | mean regret | median regret | within 10% | win / tie / loss | "
                  "refrains | compute |", "|---|--:|--:|--:|--:|--:|--:|"]
        for name, s in summ.items():
            refrain = (f"{s['refrain_rate']:.0%} of {s['refrain_settings']}"
                       if s["refrain_settings"] else "-")
            lines.append(f"| {name} | {s['mean_regret']:.3f} | {s['median_regret']:.3f} | "
                         f"{s['within_10pct']:.0%} | {s['win']} / {s['tie']} / {s['loss']} | "
                         f"{refrain} | {s['median_compute']:.2f} |")
        lines.append("")
    lines += ["## Per setting (T0 chosen)", "",
              "| setting | part | grid T0 | exact T0 | " + " | ".join(METHODS) + " |",
              "|---|---|--:|--:|" + "--:|" * len(METHODS)]
    for r in result["points"]:
        lines.append(f"| {r['setting']} | {r['part']} | {r['grid_T0']} | {r['exact_T0']} | "
                     + " | ".join(str(r["methods"][m]["T0"]) for m in METHODS) + " |")
    return "\n".join(lines) + "\n"
