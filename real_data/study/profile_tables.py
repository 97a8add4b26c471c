"""Kernel bias and drift of a study, by their definitions (THEORY.md section 5).

For every sweep with a T0 arm (``warmup_rounds``) and at least one ``reference`` arm, every
alpha and seed (a *cell*), Phi (:mod:`real_data.profile`) is evaluated under ONE config, the
T0 family head's (its data, partition and validation split, its initial parameters, its
optimizer and lr), at

- M_T0: the T0 family head's warm-up snapshot ``checkpoints/round_<T0>.pt``, each T0 of the arm;
- M_ref,T0: each reference arm's snapshot at the same round (a reference keeps one at every T0
  of its sweep). Two references are meant: FedAvg on an IID re-partition with the same clients,
  K and lr (``partition.scheme=iid``, same ``num_clients``: isolates heterogeneity), and the
  theory's pooled single client (``partition.num_clients=1``). A reference whose partition
  ignores alpha stands in for a missing one of another alpha (same seed), as for the kernel
  deviation.

Then, per cell, T0 arm, T0 and reference::

    bias(T0)  = Phi(M_ref,T0) - Phi_best
    drift(T0) = Phi(M_T0) - Phi(M_ref,T0)

**Phi_best** is Phi at the kernel of the longest-trained reference: the pooled single-client
reference (the reference arm with ``partition.num_clients=1``; the plan's first reference arm
when none has one client) at its last snapshot round (the largest T0 of the sweep's grid,
T when the grid holds T). It is one number per cell, shared by both references, so the two
bias curves are comparable; it is not a minimum over kernels, and a bias below 0 says a kernel
of the reference's trajectory before T already profiles better than the last one.

Every Phi is cached as JSON under ``<out_dir>/profiles/<sweep>/<alpha>/seed=<s>/`` (named by
kernel and budget, the budget's rule and cadence included: ``__steps4000_min250``; a name
without a rule holds the ``last`` rule's Phi, and a record read from it without a
``phi_rule`` field is labelled ``last``), so the evaluation resumes after a kill and shards
over workers (``linattn study --plan P --profile --shard k/n``). The tables,
``kernel_profile.{csv,json,md}``, hold one row per cell, T0 arm, T0 and reference (Phi values,
bias, drift, the doubled-budget checks, the rule that read Phi) and the mean +- std over seeds.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import time
from pathlib import Path

import numpy as np

from linattn.errors import UserError
from linattn.fileio import atomic_write_text
from real_data.study.plan import Arm, Plan, Sweep, run_config, run_key
from real_data.study.tables import reference_dir, row_order, write_csv

BEST_RULE = ("Phi_best = Phi at the pooled single-client reference's kernel at its last "
             "snapshot round (the longest-trained reference)")


def _alpha_part(alpha) -> str:
    return "natural" if alpha is None else f"alpha={alpha:g}"


def _t0_arms(sweep: Sweep) -> list[Arm]:
    """The arms with T0 snapshots of their own: not a reference, and not a final arm that reads
    another arm's runs (``same_as``: FedFrozen at T0 = T, whose runs keep no snapshot)."""
    return [a for a in sweep.arms if a.warmup_rounds and not a.reference and a.same_as is None]


def _refs(sweep: Sweep) -> list[Arm]:
    return [a for a in sweep.arms if a.reference]


def _pooled_ref(plan: Plan, sweep: Sweep) -> Arm:
    """The reference arm with one client (the theory's pooled reference), else the first."""
    from real_data.study.plan import RunSpec

    for arm in _refs(sweep):
        spec = RunSpec("", sweep, arm, sweep.alphas[0], sweep.seeds[0], None,
                       plan.out_dir / run_key(sweep.name, arm.name, None, sweep.alphas[0],
                                              sweep.seeds[0]))
        if run_config(spec, None).partition.num_clients == 1:
            return arm
    return _refs(sweep)[0]


def profile_cells(plan: Plan) -> list[dict]:
    """Every cell of the plan (module docstring): the evaluating run, the kernels and the
    reference that gives Phi_best. Kernel entries: ``(kind, arm, round, snapshot path)`` with
    kind ``fed`` or ``ref``."""
    cells = []
    for sw in plan.sweeps:
        arms, refs = _t0_arms(sw), _refs(sw)
        if not arms or not refs:
            continue
        grid = sorted({t for a in sw.arms for t in a.warmup_rounds})
        best_arm = _pooled_ref(plan, sw)
        for alpha in sw.alphas:
            for seed in sw.seeds:
                head = arms[0]
                evaluating = plan.out_dir / run_key(sw.name, head.name, head.warmup_rounds[0],
                                                    alpha, seed)
                kernels = []
                for arm in arms:
                    src = plan.out_dir / run_key(sw.name, arm.name, arm.warmup_rounds[0],
                                                 alpha, seed)
                    kernels += [("fed", arm.name, t, src / "checkpoints" / f"round_{t}.pt")
                                for t in sorted(arm.warmup_rounds)]
                for ref in refs:
                    for t in grid:
                        rdir = reference_dir(plan, sw, ref, alpha, seed, t)
                        kernels.append(("ref", ref.name, t, rdir / "checkpoints" /
                                        f"round_{t}.pt"))
                cells.append({"sweep": sw.name, "alpha": alpha, "seed": seed,
                              "run_dir": evaluating, "kernels": kernels,
                              "best": (best_arm.name, grid[-1]),
                              "cache": plan.out_dir / "profiles" / sw.name / _alpha_part(alpha)
                              / f"seed={seed}"})
    return cells


SPLITS = ("cells", "kernels")  # how --shard k/n divides the profile (profile_plan)


def _cache_file(cell: dict, kind: str, arm: str, t: int, budget) -> Path:
    return cell["cache"] / f"{kind}_{arm}_round{t}__{budget.tag()}.json"


def _cached(cell: dict, kind: str, arm: str, t: int, budget) -> Path | None:
    """The cache file that holds this kernel's Phi under ``budget``: its own, or for a budget
    without the check (``check=False``) the checked budget's (Phi at N of the same training,
    up to the round-off of the stack it trained in); None when neither exists."""
    own = _cache_file(cell, kind, arm, t, budget)
    if own.is_file():
        return own
    if not budget.check:
        checked = _cache_file(cell, kind, arm, t, dataclasses.replace(budget, check=True))
        if checked.is_file():
            return checked
    return None


def profile_plan(plan: Plan, budget, log=print, device: str | None = None,
                 shard: tuple[int, int] | None = None, deadline_s: float | None = None,
                 compute: bool = True, stack: int = 32,
                 pattern: list[str] | None = None, split: str = "cells",
                 rounds: tuple[int, ...] | None = None) -> list[dict]:
    """Phi at every kernel of every cell (``shard=(k, n)``: the k-th of every n cells, or with
    ``split="kernels"`` the k-th of every n kernels of each cell, so that n processes share
    each cell: fewer kernels a stack, for cells fewer than the processes or a budget too long
    for one process), read from the cache or computed and cached (``compute=False``: only
    read); a cell's missing kernels train side by side, ``stack`` at a time. ``deadline_s``:
    start no new cell after this many seconds. ``pattern``: globs over the run keys
    (``--slice``); a cell is kept when one of its runs matches (UserError when none is).
    ``rounds`` (``--profile-rounds``): only the kernels of these T0 (and Phi_best's kernel,
    always), a cheaper profile of fewer T0; UserError when one is in no cell's T0 grid.
    Returns one record per kernel found (missing snapshots are logged and left out)."""
    from real_data.profile import run_setup

    cells = profile_cells(plan)
    if pattern:
        cells = [c for c in cells if any(
            fnmatch.fnmatch(str(path.parents[1].relative_to(plan.out_dir)), p)
            for *_, path in c["kernels"] for p in pattern)]
        if not cells:
            raise UserError(
                f"--slice {' '.join(pattern)}: no profile cell of plan {plan.name} has a run "
                "that matches; a cell's runs are its T0 arms' family heads (the largest T0, "
                "e.g. <sweep>/fedfrozen-T0=200/alpha=0.1/seed=0) and its reference arms")
    if split not in SPLITS:
        raise UserError(f"--profile-split {split!r}: one of {', '.join(SPLITS)}")
    if rounds is not None:
        grid = sorted({t for c in cells for _, _, t, _ in c["kernels"]})
        bad = [t for t in rounds if t not in grid]
        if bad or not rounds:
            raise UserError(f"--profile-rounds {','.join(map(str, rounds))}: "
                            f"{'round ' + str(bad[0]) + ' is' if bad else 'no round is'} "
                            f"not a T0 of the plan's cells; give rounds of {grid}")

    def kept(cell: dict) -> list[tuple]:
        """The cell's kernels this call profiles (``rounds``, with Phi_best's always)."""
        return [e for e in cell["kernels"] if rounds is None or e[2] in rounds
                or (e[0] == "ref" and (e[1], e[2]) == tuple(cell["best"]))]

    if shard is not None and split == "cells":
        cells = cells[shard[0]::shard[1]]
    mine = (lambda i: True) if shard is None or split == "cells" else \
        (lambda i: i % shard[1] == shard[0])  # a share of every cell's kernels, by position
    start = time.perf_counter()
    records = []
    for cell in cells:
        late = deadline_s is not None and time.perf_counter() - start > deadline_s
        todo = [(k, a, t, p) for i, (k, a, t, p) in enumerate(kept(cell))
                if mine(i) and _cached(cell, k, a, t, budget) is None and p.is_file()]
        if compute and todo and not late and (cell["run_dir"] / "config.yaml").is_file():
            setup = run_setup(cell["run_dir"], device)
            results = setup.phi_many([(str(p), p) for *_, p in todo], budget, stack,
                                     partial_dir=cell["cache"])
            for (kind, arm, t, _), res in zip(todo, results, strict=True):
                cache = _cache_file(cell, kind, arm, t, budget)
                cache.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cache, json.dumps(res, indent=1))
                log(f"profile {cell['sweep']}/{_alpha_part(cell['alpha'])}/seed="
                    f"{cell['seed']} {kind} {arm} round {t}: Phi {res['phi']:.4f}"
                    + ("" if res["relative_change"] is None else
                       f" (2N change {100 * res['relative_change']:.2f}%)"))
        for i, (kind, arm, t, path) in enumerate(kept(cell)):
            cache = _cached(cell, kind, arm, t, budget)
            if cache is not None:
                res = json.loads(cache.read_text())
                res.setdefault("phi_rule", "last")  # written before the rule was recorded
                records.append({"sweep": cell["sweep"], "alpha": cell["alpha"],
                                "seed": cell["seed"], "kind": kind, "arm": arm, "round": t,
                                "best": cell["best"], **res})
            elif compute and not late and mine(i):
                log(f"profile: {path} missing, left out")
    return records


def bias_drift(records: list[dict]) -> list[dict]:
    """One row per cell, T0 arm, T0 and reference (``records``: :func:`profile_plan`'s, or any
    dicts with ``sweep, alpha, seed, kind, arm, round, phi, relative_change, converged`` and
    ``best = (reference arm, round)``): Phi of the federated kernel, of the reference's at the
    same round and Phi_best, ``bias = phi_ref - phi_best`` and ``drift = phi_fed - phi_ref``.
    A row is left out when one of its three Phi values is missing."""
    phi: dict[tuple, dict] = {}
    for r in records:
        phi[(r["sweep"], r["alpha"], r["seed"], r["kind"], r["arm"], r["round"])] = r
    out = []
    for (sweep, alpha, seed, kind, arm, t), fed in phi.items():
        if kind != "fed":
            continue
        best_arm, best_t = fed["best"]
        best = phi.get((sweep, alpha, seed, "ref", best_arm, best_t))
        if best is None:
            continue
        refs = sorted({k[4] for k in phi if k[:4] == (sweep, alpha, seed, "ref")})
        for ref_arm in refs:
            ref = phi.get((sweep, alpha, seed, "ref", ref_arm, t))
            if ref is None:
                continue
            out.append({"sweep": sweep, "alpha": alpha, "seed": seed, "arm": arm,
                        "warmup_rounds": t, "reference": ref_arm,
                        "phi_fed": fed["phi"], "phi_ref": ref["phi"], "phi_best": best["phi"],
                        "best_kernel": f"{best_arm}@{best_t}",
                        "bias": ref["phi"] - best["phi"], "drift": fed["phi"] - ref["phi"],
                        "val_acc_fed": fed.get("val_acc"), "val_acc_ref": ref.get("val_acc"),
                        "rel_change_fed": fed.get("relative_change"),
                        "rel_change_ref": ref.get("relative_change"),
                        "rel_change_best": best.get("relative_change"),
                        "converged": all(bool(x.get("converged")) for x in (fed, ref, best)),
                        "checked": all(x.get("converged") is not None for x in (fed, ref, best)),
                        **_doubled(fed, ref, best),
                        "steps": fed.get("steps"),
                        "phi_rule": fed.get("phi_rule", "last"),
                        "eval_every": fed.get("eval_every")})
    return sorted(out, key=lambda r: (*row_order(r), r["reference"]))


def _doubled(fed: dict, ref: dict, best: dict) -> dict:
    """Phi, bias and drift read at the check's budget 2N (``phi_doubled``): whether a sign or
    a trend seen at N survives a longer training of the rest. None where one of the three
    kernels has no finite doubled value."""
    two = [x.get("phi_doubled") for x in (fed, ref, best)]
    if any(v is None or not np.isfinite(v) for v in two):
        return {"phi_fed_2n": None, "phi_ref_2n": None, "phi_best_2n": None,
                "bias_2n": None, "drift_2n": None}
    f2, r2, b2 = (float(v) for v in two)
    return {"phi_fed_2n": f2, "phi_ref_2n": r2, "phi_best_2n": b2,
            "bias_2n": r2 - b2, "drift_2n": f2 - r2}


def summarize(rows: list[dict]) -> list[dict]:
    """Mean, std and n over seeds of the Phi values, bias and drift per (sweep, alpha, arm,
    T0, reference), with the number of seeds whose three kernels all passed the check."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault((r["sweep"], r["alpha"], r["arm"], r["warmup_rounds"],
                          r["reference"]), []).append(r)
    out = []
    for (sweep, alpha, arm, t, ref), items in cells.items():
        rec = {"sweep": sweep, "alpha": alpha, "arm": arm, "warmup_rounds": t,
               "reference": ref, "n_seeds": len(items),
               "n_converged": sum(bool(r["converged"]) for r in items),
               "n_checked": sum(bool(r.get("checked", True)) for r in items)}
        for key in ("phi_fed", "phi_ref", "phi_best", "bias", "drift"):
            v = np.array([r[key] for r in items], dtype=np.float64)
            rec[f"{key}_mean"], rec[f"{key}_std"] = float(np.mean(v)), float(np.std(v))
        for key in ("bias_2n", "drift_2n"):  # over the seeds that have the doubled budget
            v = np.array([r[key] for r in items if r.get(key) is not None], dtype=np.float64)
            rec[f"{key}_n"] = int(v.size)
            rec[f"{key}_mean"] = float(np.mean(v)) if v.size else None
            rec[f"{key}_std"] = float(np.std(v)) if v.size else None
        changes = [r[k] for r in items for k in ("rel_change_fed", "rel_change_ref",
                                                   "rel_change_best") if r[k] is not None]
        rec["max_rel_change"] = float(max(changes)) if changes else None
        out.append(rec)
    return sorted(out, key=lambda r: (*row_order(r), r["reference"]))


# P1 along T0, per seed: each statistic, its definition (``early``/``late``: the lower and the
# upper half of the cell's T0 grid, the middle T0 of an odd grid in neither) and the sign P1
# predicts for it (+1 above 0, -1 below 0, 0 no prediction)
TRENDS = (
    ("bias_change", "mean bias over the late T0 minus over the early T0", -1),
    ("rho_bias", "Spearman correlation of bias with T0", -1),
    ("drift_change", "mean drift over the late T0 minus over the early T0", +1),
    ("rho_drift", "Spearman correlation of drift with T0", +1),
    ("drift_mean", "mean drift over the T0 above 0", +1),
    ("phi_fed_change", "mean Phi(M_T0) over the late T0 minus over the early T0", 0),
    ("rho_phi_fed", "Spearman correlation of Phi(M_T0) with T0", 0),
)


def _spearman(x, y) -> float | None:
    from scipy import stats

    if len(x) < 3 or not np.all(np.isfinite(y)) or np.ptp(y) == 0:
        return None
    return float(stats.spearmanr(x, y).statistic)


def trends(rows: list[dict], level: float = 0.95) -> list[dict]:
    """P1 along T0 (bias falls, drift rises), one record per (sweep, alpha, arm, reference,
    statistic): each statistic of :data:`TRENDS` per seed from :func:`bias_drift`'s rows, its
    mean over seeds with the two-sided t interval at ``level`` (seeds as the replicates; none
    for one seed; a correlation's cut to [-1, 1]; seeds that agree exactly give an interval of
    width 0), ``per_seed`` in the order of ``seeds`` (the runs' seeds, ascending), every seed read
    on the T0 all seeds of the cell have (``same_grid``: false where some seed has more), and
    ``verdict``: ``as P1 predicts`` when the interval lies on the predicted
    side of 0, ``against P1`` when on the other, ``not resolved`` when it holds 0 (or fewer
    than 2 seeds have the statistic), ``no prediction`` for Phi(M_T0)'s own trend."""
    from real_data.study.tables import t_interval

    groups: dict[tuple, dict] = {}
    for r in rows:
        key = (r["sweep"], r["alpha"], r["arm"], r["reference"])
        groups.setdefault(key, {}).setdefault(r["seed"], []).append(r)
    out = []
    for key, seeds in groups.items():
        per_seed: dict[str, list] = {name: [] for name, *_ in TRENDS}
        grids = set()
        for seed, items in seeds.items():
            t0s = [r["warmup_rounds"] for r in items]
            if len(set(t0s)) != len(t0s):
                raise ValueError(f"trends: cell {key} seed {seed} has two rows of one T0")
            grids.add(tuple(sorted(t0s)))
        # every seed is read on the T0 all of them have, so the halves are the same T0
        common = sorted(set.intersection(*(set(g) for g in grids)))
        for _, items in sorted(seeds.items()):
            items = sorted((r for r in items if r["warmup_rounds"] in common),
                           key=lambda r: r["warmup_rounds"])
            t0 = np.array([r["warmup_rounds"] for r in items], dtype=np.float64)
            h = len(items) // 2
            val = {k: np.array([r[k] for r in items], dtype=np.float64)
                   for k in ("bias", "drift", "phi_fed")}

            def change(v, h=h):
                return float(v[-h:].mean() - v[:h].mean()) if h else None

            stat = {"bias_change": change(val["bias"]), "rho_bias": _spearman(t0, val["bias"]),
                    "drift_change": change(val["drift"]),
                    "rho_drift": _spearman(t0, val["drift"]),
                    "drift_mean": float(val["drift"][t0 > 0].mean()) if (t0 > 0).any()
                    else None,
                    "phi_fed_change": change(val["phi_fed"]),
                    "rho_phi_fed": _spearman(t0, val["phi_fed"])}
            for name in per_seed:  # a seed with a non-finite Phi has no such statistic
                v = stat[name]
                per_seed[name].append(None if v is None or not np.isfinite(v) else v)
        grid = common
        h = len(grid) // 2
        for name, definition, sign in TRENDS:
            vals = [v for v in per_seed[name] if v is not None]
            rec = {"sweep": key[0], "alpha": key[1], "arm": key[2], "reference": key[3],
                   "statistic": name, "definition": definition,
                   "p1_predicts": {1: "> 0", -1: "< 0", 0: None}[sign],
                   "early_t0": list(grid[:h]), "late_t0": list(grid[-h:]) if h else [],
                   "same_grid": len(grids) == 1, "seeds": sorted(seeds),
                   "per_seed": per_seed[name],
                   "n": len(vals), "level": level, "mean": None, "low": None, "high": None}
            if vals:
                mean, _, half = t_interval(vals, level)
                rec["mean"] = mean
                if half is not None:  # a correlation's interval is cut to [-1, 1]
                    lo, hi = (-1.0, 1.0) if name.startswith("rho_") else (-np.inf, np.inf)
                    rec["low"] = float(max(mean - half, lo))
                    rec["high"] = float(min(mean + half, hi))
            if sign == 0:
                rec["verdict"] = "no prediction"
            elif rec["low"] is None or rec["low"] <= 0 <= rec["high"]:
                rec["verdict"] = "not resolved"
            else:
                rec["verdict"] = ("as P1 predicts" if (rec["low"] > 0) == (sign > 0)
                                  else "against P1")
            out.append(rec)
    return sorted(out, key=lambda r: (*row_order({**r, "warmup_rounds": 0}), r["reference"],
                                      [n for n, *_ in TRENDS].index(r["statistic"])))


def write_kernel_profile(rows: list[dict], out_dir: Path, budget=None,
                         t0_choice: list[dict] | None = None) -> list[Path]:
    """``kernel_profile.csv`` (one row per seed), ``.json`` (rows, summary, the budget, the
    Phi_best rule and the chosen T0 intervals) and ``.md`` (mean +- std over seeds)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = summarize(rows)
    paths = [out_dir / "kernel_profile.csv", out_dir / "kernel_profile.json",
             out_dir / "kernel_profile.md"]
    write_csv(rows, paths[0])  # an empty file for no rows
    meta = {"budget": None if budget is None else {"steps": budget.steps, "lr": budget.lr,
                                                   "batch_size": budget.batch_size,
                                                   "seed": budget.seed,
                                                   "schedule": budget.schedule,
                                                   "optimizer": budget.optimizer,
                                                   "phi_rule": budget.phi_rule,
                                                   "eval_every": budget.eval_every,
                                                   "precision": budget.precision,
                                                   "check": budget.check},
            "phi_best": BEST_RULE, "rows": rows, "summary": summary,
            "trends": trends(rows), "t0_choice": t0_choice or []}
    atomic_write_text(paths[1], json.dumps(meta, indent=1))
    steps = "" if budget is None else (
        f" for {budget.steps} steps"
        + (f" (check: {2 * budget.steps})" if budget.check else
           " (no check run; a checked record of the same budget read where one exists)")
        + ("" if budget.schedule == "constant" else f", {budget.schedule} step size")
        + ("" if budget.optimizer == "run" else f", {budget.optimizer}")
        + ("" if budget.precision == "fp32" else f", {budget.precision} arithmetic"))
    read = ("the validation loss" if budget is None else
            "the validation loss after the last step" if budget.phi_rule == "last" else
            f"the minimum of the validation loss over the budget, read every "
            f"{budget.eval_every} steps")
    lines = [f"Phi: {read}, with Q/K frozen and the rest trained on the pooled training "
             f"data{steps}. bias = Phi(M_ref,T0) - Phi_best, drift = Phi(M_T0) - "
             f"Phi(M_ref,T0); {BEST_RULE}. Mean +- std over seeds (the population std, ddof 0); "
             "converged: seeds whose "
             "three kernels changed Phi by < 1% at twice the budget, of the seeds whose "
             "budget ran the check (a seed profiled with --profile-no-check counts as "
             "unchecked); bias and drift at 2N: "
             "the same differences read at the check's budget (mean +- std over the seeds "
             "that reached it), so a trend that holds at N and at 2N does not hang on one "
             "budget.", "",
             "| sweep | alpha | arm | T0 | reference | n | Phi(M_T0) | Phi(M_ref,T0) | "
             "Phi_best | bias | drift | bias at 2N | drift at 2N | converged | "
             "max 2N change |", "|" + "---|" * 15]

    def f(r, key):
        if r[key + "_mean"] is None:
            return "-"
        return f"{r[key + '_mean']:.4f} +- {r[key + '_std']:.4f}"

    for r in summary:
        change = "-" if r["max_rel_change"] is None else f"{100 * r['max_rel_change']:.2f}%"
        checked = r.get("n_checked", r["n_seeds"])
        verdict = f"{r['n_converged']}/{checked}" + (
            "" if checked == r["n_seeds"] else f" ({r['n_seeds'] - checked} unchecked)")
        lines.append(f"| {r['sweep']} | {'natural' if r['alpha'] is None else r['alpha']} | "
                     f"{r['arm']} | {r['warmup_rounds']} | {r['reference']} | {r['n_seeds']} | "
                     f"{f(r, 'phi_fed')} | {f(r, 'phi_ref')} | {f(r, 'phi_best')} | "
                     f"{f(r, 'bias')} | {f(r, 'drift')} | {f(r, 'bias_2n')} | "
                     f"{f(r, 'drift_2n')} | {verdict} | "
                     f"{change} |")
    lines += trend_lines(meta["trends"])
    if t0_choice:
        from real_data.study.tables import t0_choice_lines

        lines += ["", *t0_choice_lines(t0_choice)]
    atomic_write_text(paths[2], "\n".join(lines) + "\n")
    return paths


def trend_lines(records: list[dict]) -> list[str]:
    """:func:`trends`' records as a Markdown section (none for no records)."""
    if not records:
        return []

    def num(v, fmt="+.4f"):
        return "-" if v is None else format(v, fmt)

    level = round(100 * records[0]["level"])
    lines = ["", f"P1 along T0, per seed (in the order of the runs' seeds, ascending), then "
             f"over seeds (mean, two-sided {level}% t interval with the seeds as replicates). "
             "Statistics: "
             + "; ".join(f"{name}: {d}" for name, d, _ in TRENDS) + ". Phi_best is one "
             "number per seed, so no statistic depends on its choice.", "",
             "| sweep | alpha | arm | reference | early T0 | late T0 | statistic | "
             "P1 predicts | n | mean | interval | per seed | verdict |", "|" + "---|" * 13]
    for r in records:
        interval = "-" if r["low"] is None else f"[{r['low']:+.4f}, {r['high']:+.4f}]"
        lines.append(
            f"| {r['sweep']} | {'natural' if r['alpha'] is None else r['alpha']} | "
            f"{r['arm']} | {r['reference']} | {','.join(map(str, r['early_t0']))} | "
            f"{','.join(map(str, r['late_t0']))}"
            f"{'' if r['same_grid'] else ' (the T0 common to all seeds)'} | {r['statistic']} | "
            f"{r['p1_predicts'] or '-'} | {r['n']} | {num(r['mean'])} | {interval} | "
            f"{' '.join(num(v) for v in r['per_seed'])} | {r['verdict']} |")
    return lines
