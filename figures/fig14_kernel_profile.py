"""Figure 14: the kernel profile on a real network, P1 by its definitions: Phi along the
warm-up round for the federated kernel and each drift-free reference's, and bias(T0) and
drift(T0) against each reference.

Drawn from the kernel-profile tables of a P3 study (``kernel_profile.json``, written by
``linattn study --plan p3 --profile ...``): the folder's own table and those of its
subfolders (one per Phi budget, e.g. ``docs/study/p3/profile_adam_1600x2048/``). One row of
three panels per (budget, sweep, alpha) of the first T0 arm (FedFrozen): the budgets whose
every checked kernel passed the doubled-budget check first (seeds profiled without the check,
``--profile-no-check``, are counted apart), then the others by folder name.

- Phi(M) against the round: the federated head's snapshot M_T0 and each reference's M_ref,T0
  (mean over seeds, the band one standard deviation where there are several), the dotted
  line Phi_best;
- bias(T0) = Phi(M_ref,T0) - Phi_best per reference (P1 says it falls);
- drift(T0) = Phi(M_T0) - Phi(M_ref,T0) per reference (P1 says it rises from 0).

    linattn figure 14 --real-data docs/study/p3
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from figures.common import FigureError, FigureOutput, run_folder_standalone
from figures.style import new_figure, save

NAME = "fig14_kernel_profile"
TABLE = "kernel_profile.json"
REFERENCES = {"reference": ("pooled single client", "C2"),
              "reference_iid": ("FedAvg, IID re-partition", "C1")}


def _tables(folder: Path) -> list[Path]:
    """The folder's kernel-profile tables: its own, its ``tables/`` one and its subfolders'."""
    found = [folder / TABLE, folder / "tables" / TABLE]
    if folder.is_dir():
        found += sorted(p / TABLE for p in folder.iterdir() if p.is_dir())
    return [p for p in dict.fromkeys(found) if p.is_file()]  # tables/ once


ROW_KEYS = ("sweep", "alpha", "arm", "warmup_rounds", "reference", "n_seeds", "n_converged")
MEANS = ("phi_fed", "phi_ref", "phi_best", "bias", "drift")


def _check_table(path: Path, meta) -> list[dict]:
    """The table's summary rows, each with the keys and numbers figure 14 draws; FigureError
    naming the file, the row and the key otherwise."""
    fix = "write it again with `linattn study --plan P --profile ...` or move it out of the folder"
    if not isinstance(meta, dict) or not isinstance(meta.get("summary"), list):
        raise FigureError(f"{path}: not a kernel-profile table (no summary list); {fix}")
    budget = meta.get("budget")
    if budget is not None and not (isinstance(budget, dict) and isinstance(
            budget.get("steps"), int)):
        raise FigureError(f"{path}: budget: not a budget with an integer steps; {fix}")
    for i, r in enumerate(meta["summary"]):
        if not isinstance(r, dict):
            raise FigureError(f"{path}: summary[{i}]: not a row; {fix}")
        for key in (*ROW_KEYS, *(f"{k}_mean" for k in MEANS)):
            if key not in r:
                raise FigureError(f"{path}: summary[{i}]: no {key!r}; {fix}")
        for key in (f"{k}_mean" for k in MEANS):
            if isinstance(r[key], bool) or not isinstance(r[key], int | float):
                raise FigureError(f"{path}: summary[{i}]: {key} is {r[key]!r}, not a number; "
                                  f"{fix}")
        for key in (f"{k}_std" for k in MEANS):  # optional: a missing or null std, no band
            v = r.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise FigureError(f"{path}: summary[{i}]: {key} is {v!r}, not a number; {fix}")
        for key in ("warmup_rounds", "n_seeds", "n_converged", "n_checked"):
            if key in r and (isinstance(r[key], bool) or not isinstance(r[key], int)):
                raise FigureError(f"{path}: summary[{i}]: {key} is {r[key]!r}, not an "
                                  f"integer; {fix}")
    return meta["summary"]


def _budget_label(budget: dict | None, folder: str) -> str:
    if not budget:
        return folder
    opt = "run's optimizer" if budget.get("optimizer") in (None, "run") else budget["optimizer"]
    lr = "" if budget.get("lr") is None else f" lr {budget['lr']:g}"
    rule = (f"min every {budget.get('eval_every')}" if budget.get("phi_rule") == "min"
            else "last step")
    prec = budget.get("precision") or "fp32"
    return (f"{budget['steps']} x {budget.get('batch_size')}, {opt}{lr}, "
            f"{budget.get('schedule', 'constant')}, {rule}"
            + ("" if prec == "fp32" else f", {prec}")
            + ("" if budget.get("check", True) else ", no check"))


def profiles(folder: Path) -> list[dict]:
    """One entry per (table, sweep, alpha) of the first T0 arm: its budget's label, the seeds,
    how many of them passed the doubled-budget check, and per reference the mean and std over
    seeds of Phi(M_T0), Phi(M_ref,T0), bias and drift at every T0."""
    folder = Path(folder)
    out = []
    for path in _tables(folder):
        try:
            meta = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise FigureError(f"{path}: not a kernel-profile table ({type(exc).__name__}); "
                              "write it with `linattn study --plan P --profile ...`") from None
        summary = _check_table(path, meta)
        cells: dict = {}
        for r in summary:
            cells.setdefault((r["sweep"], r["alpha"]), []).append(r)
        for (sweep, alpha), rows in cells.items():
            arm = rows[0]["arm"]
            rows = [r for r in rows if r["arm"] == arm]
            refs: dict = {}
            for r in sorted(rows, key=lambda r: r["warmup_rounds"]):
                refs.setdefault(r["reference"], []).append(r)
            if not refs:
                continue
            n = max(r["n_seeds"] for r in rows)
            # the verdict of the row with the most checked seeds that failed: one row's
            # counts, never a minimum of each count over different rows
            worst = max(rows, key=lambda r: (r.get("n_checked", r["n_seeds"])
                                             - r["n_converged"], -r["n_converged"]))
            converged = worst["n_converged"]
            checked = worst.get("n_checked", worst["n_seeds"])
            passed = all(0 < r.get("n_checked", r["n_seeds"]) == r["n_converged"]
                         for r in rows)
            label = path.parent.name if path.parent != folder else folder.name
            out.append({"table": str(path), "folder": label, "sweep": sweep, "alpha": alpha,
                        "arm": arm, "n_seeds": n, "n_converged": converged,
                        "n_checked": checked, "passed": passed,
                        "budget": _budget_label(meta.get("budget"), label),
                        "refs": {ref: {k: [r[f"{k}_mean"] for r in rs] for k in
                                       ("phi_fed", "phi_ref", "phi_best", "bias", "drift")}
                                 | {f"{k}_std": [r.get(f"{k}_std") or 0.0 for r in rs] for k in
                                    ("phi_fed", "phi_ref", "bias", "drift")}
                                 | {"t0": [r["warmup_rounds"] for r in rs]}
                                 for ref, rs in refs.items()}})
    out.sort(key=lambda p: (not p["passed"], p["folder"], p["sweep"]))
    return out


def has_profile(folder: Path) -> bool:
    """``folder`` holds a kernel-profile table figure 14 can draw: False where it holds none,
    FigureError naming the file where one is malformed (``reproduce`` stops on it, as
    ``linattn figure 14`` does, instead of leaving the figure out unsaid)."""
    return bool(_tables(Path(folder))) and bool(profiles(Path(folder)))


def _band(ax, x, mean, std, colour, label, style="-"):
    mean, std = np.asarray(mean, float), np.asarray(std, float)
    ax.plot(x, mean, style, color=colour, marker=".", lw=1.2, label=label)
    if np.any(std > 0):
        ax.fill_between(x, mean - std, mean + std, color=colour, alpha=0.15, lw=0)


def make(folder: Path, out_dir=None) -> FigureOutput:
    data = profiles(Path(folder))
    if not data and _tables(Path(folder)):
        raise FigureError(f"{', '.join(map(str, _tables(Path(folder))))}: no summary rows (no "
                          "kernel profiled); run `linattn study --plan p3 --profile ...` over "
                          "the cell's runs first")
    if not data:
        raise FigureError(f"--real-data {folder}: no {TABLE} in it, in its tables/ or in a "
                          "subfolder; run `linattn study --plan p3 --profile ...` (and "
                          "--export DIR) first")
    fig, grid = new_figure(ncols=3, width=3.6, height=3.0, nrows=len(data))
    grid = [grid] if len(data) == 1 else list(grid)
    notes = []
    for row, p in zip(grid, data, strict=True):
        check = ("no seed checked" if p["n_checked"] == 0 else
                 f"converged {p['n_converged']}/{p['n_checked']}"
                 if p["n_checked"] == p["n_seeds"] else
                 f"{p['n_checked']} checked, {p['n_converged']} converged")
        where = (f"{p['sweep']}, {'natural' if p['alpha'] is None else 'alpha ' + str(p['alpha'])}"
                 f", {p['n_seeds']} seed{'s' if p['n_seeds'] > 1 else ''}, {check}")
        first = next(iter(p["refs"].values()))
        _band(row[0], first["t0"], first["phi_fed"], first["phi_fed_std"], "C0",
              f"federated ({p['arm']})")
        for ref, c in p["refs"].items():
            name, colour = REFERENCES.get(ref, (ref, "C3"))
            _band(row[0], c["t0"], c["phi_ref"], c["phi_ref_std"], colour, name)
            _band(row[1], c["t0"], c["bias"], c["bias_std"], colour, name)
            _band(row[2], c["t0"], c["drift"], c["drift_std"], colour, name)
        row[0].axhline(first["phi_best"][0], color="0.4", ls=":", lw=1, label="Phi_best")
        for ax in row[1:]:
            ax.axhline(0.0, color="0.4", lw=0.8)
        titles = ("Phi(M) against the round", "bias(T0) (P1: falls)",
                  "drift(T0) (P1: rises from 0)")
        ylabels = ("Phi (validation loss, nats)", "Phi(M_ref,T0) - Phi_best",
                   "Phi(M_T0) - Phi(M_ref,T0)")
        for ax, title, ylabel in zip(row, titles, ylabels, strict=True):
            ax.set_title(f"{title}\n{p['budget']}\n{where}", fontsize=7)
            ax.set_xlabel("round (T0)")
            ax.set_ylabel(ylabel, fontsize=8)
            ax.legend(fontsize=5.5, loc="best")
        phi = np.asarray(first["phi_fed"], float)
        refs = "; ".join(
            f"{REFERENCES.get(ref, (ref,))[0]}: bias {c['bias'][0]:+.4f} at T0 = "
            f"{c['t0'][0]} to {c['bias'][-1]:+.4f} at {c['t0'][-1]}, drift "
            f"{min(c['drift']):+.4f} to {max(c['drift']):+.4f}"
            for ref, c in p["refs"].items())
        notes.append(f"{p['budget']} ({where}): federated Phi {phi[0]:.4f} at T0 = "
                     f"{first['t0'][0]}, {phi[-1]:.4f} at {first['t0'][-1]}; {refs}")
    paths = save(fig, NAME, out_dir, dpi=100)
    caption = ("The kernel profile on a real network (mean over seeds, band one standard "
               "deviation): " + " | ".join(notes) + ".")
    return FigureOutput(14, NAME, tuple(paths), caption)


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a P3 study's export folder (with the kernel "
                                 "profile's tables) or out_dir", argv)


if __name__ == "__main__":
    raise SystemExit(main())
