"""Figure 13: P3 on real networks, the accuracy behind each choice: test accuracy against the
warm-up length T0, per setting and per arm.

Drawn from a study's export folder (``linattn study --plan p3 --aggregate-only --export DIR``):
``study_per_run.csv`` gives every run's test score (the mean of its last evaluations) and
``t0_choice.csv`` each (sweep, arm)'s setting and validation-chosen T0. Each curve is the mean
over seeds of the test score at every T0 of the grid (T0 = T: never frozen, i.e. the base
algorithm alone), the band one standard error, and the larger marker the T0 chosen on
validation. The panels:

- along the local steps K at the centre step size, and along the step size at the centre K
  (figure 12's axes and centre): FedFrozen (Q/K frozen after T0, on FedAvg) per setting,
  Dirichlet solid and IID dashed; the first row for linear attention where it ran, a second
  row with the same two panels for the other attention where its axes ran;
- "is it the kernel?": at the centre (K, lr) under Dirichlet, every arm of the T0 grid, one
  colour per arm (FedFrozen, the equal-size control that freezes V and the attention output
  instead, FedFrozen on FedProx and on SCAFFOLD), linear attention solid and softmax dashed;
- "scale and regime", where the study holds a wider model or a cross-device sweep at the
  centre: FedFrozen at the centre (K, lr) under Dirichlet for the main model, each wider model
  and each cross-device sweep, in the first row's attention (a panel of its own column where
  the figure has one row, else beside the second row's axes).

    linattn figure 13 --real-data docs/study/p3
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from figures.common import FigureError, FigureOutput, run_folder_standalone
from figures.fig12_p3_real import layout, load
from figures.style import new_figure, save

NAME = "fig13_p3_curves"
PER_RUN = "study_per_run.csv"


def _find(folder: Path) -> Path | None:
    for path in (folder / PER_RUN, folder / "tables" / PER_RUN):
        if path.is_file():
            return path
    return None


def scores(folder: Path) -> dict:
    """{(sweep, arm): {T0: [test score per seed]}} of the completed T0 runs of a study's
    export folder or out_dir (a run without a finite score is left out)."""
    path = _find(Path(folder))
    if path is None:
        raise FigureError(f"--real-data {folder}: no {PER_RUN} in it or in its tables/; run "
                          "`linattn study --plan p3 --aggregate-only --export DIR` first")
    out: dict = {}
    try:
        with open(path, newline="") as fh:
            for r in csv.DictReader(fh):
                if r.get("status") != "completed" or r.get("warmup_rounds") in ("", None):
                    continue
                try:
                    t0, score = int(float(r["warmup_rounds"])), float(r["score"])
                except (KeyError, ValueError):
                    continue
                if np.isfinite(score):
                    out.setdefault((r["sweep"], r["arm"]), {}).setdefault(t0, []).append(score)
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise FigureError(f"{path}: cannot read it ({exc})") from None
    return out


def has_curves(folder: Path) -> bool:
    """``folder`` holds what figure 12 places and the per-run scores behind it."""
    try:
        return bool(panels(Path(folder))["K"] or panels(Path(folder))["lr"])
    except FigureError:
        return False


ARMS = {("qk", "fedavg"): ("FedFrozen (Q/K frozen)", "C0"),
        ("v_attn_out", "fedavg"): ("control: V and output frozen", "C3"),
        ("qk", "fedprox"): ("FedFrozen on FedProx", "C2"),
        ("qk", "scaffold"): ("FedFrozen on SCAFFOLD", "C4")}


def panels(folder: Path) -> dict:
    """The curves of each panel: ``{"K": [...], "lr": [...], "kernel": [...], "scale": [...],
    "centre", "attention", "more": {other attention: {"K": [...], "lr": [...]}}}``
    ("scale" empty where the study has no wider model or cross-device sweep); a curve is
    ``{"sweep", "arm", "label", "x" (T0 / T), "mean", "se", "t" (chosen T0 / T), "iid",
    "colour", "dashed"}``."""
    rows = load(folder)
    runs = scores(folder)
    plan = layout(rows)
    if not plan["points"]:
        raise FigureError(f"--real-data {folder}: no T0 choice of plain SGD on a Dirichlet or "
                          "IID partition with every setting given")
    k_c, lr_c = plan["centre"]
    kinds = {p["row"]["attention"] for p in plan["points"] if p["kind"] == "main"}
    attention = "linear" if "linear" in kinds else sorted(kinds)[0]

    def curve(row, label, colour, dashed):
        by_t0 = runs.get((row["sweep"], row["arm"]), {})
        if not by_t0:
            return None
        t0s = sorted(by_t0)
        vals = [np.asarray(by_t0[t], dtype=float) for t in t0s]
        se = [v.std(ddof=1) / np.sqrt(v.size) if v.size > 1 else 0.0 for v in vals]
        rounds = row["rounds"]
        return {"sweep": row["sweep"], "arm": row["arm"], "label": label,
                "x": [t / rounds for t in t0s], "mean": [float(v.mean()) for v in vals],
                "se": [float(s) for s in se], "t": row["chosen_t0"] / rounds,
                "iid": row["partition"] == "iid", "colour": colour, "dashed": dashed,
                "n": min(v.size for v in vals), "rounds": rounds}

    def axes_of(kind: str) -> dict:
        got: dict = {"K": [], "lr": []}
        for axis in ("K", "lr"):
            pts = [p for p in plan["points"] if p["axis"] == axis and p["kind"] == "main"
                   and p["row"]["attention"] == kind and not p["row"].get("momentum")]
            xs = sorted({p["x"] for p in pts})
            for p in sorted(pts, key=lambda p: (p["x"], p["iid"])):
                what = f"K = {p['x']:g}" if axis == "K" else f"lr {p['x']:g}"
                part = "IID" if p["iid"] else f"Dirichlet {p['row']['alpha']}"
                c = curve(p["row"], f"{what}, {part}", f"C{xs.index(p['x'])}", p["iid"])
                if c is not None:
                    got[axis].append(c)
        return got

    out = {**axes_of(attention), "kernel": [], "scale": [], "centre": (k_c, lr_c),
           "attention": attention, "more": {}}
    for kind in sorted(kinds - {attention}):  # the other attention's axes: a second row
        got = axes_of(kind)
        if got["K"] or got["lr"]:
            out["more"][kind] = got
    for r in rows:
        arm = ARMS.get((r.get("freeze") or "qk", r.get("base") or "fedavg"))
        if (arm is None or r.get("partition") != "dirichlet" or r.get("momentum")
                or r.get("local_steps") != k_c or r.get("lr") != lr_c
                or r.get("optimizer", "sgd") != "sgd" or r.get("model_dim") not in
                (None, plan["dim"]) or r.get("clients_per_round") not in
                (None, plan["clients_per_round"])):
            continue
        c = curve(r, f"{arm[0]}, {r['attention']}", arm[1], r["attention"] != "linear")
        if c is not None:
            out["kernel"].append(c)
    scale = [p for p in plan["points"] if p["axis"] == "K" and p["x"] == k_c and not p["iid"]
             and p["row"]["attention"] == attention and p["kind"] != "momentum"
             and (p["row"].get("freeze") or "qk", p["row"].get("base") or "fedavg")
             == ("qk", "fedavg")]
    if any(p["kind"] != "main" for p in scale):
        for i, p in enumerate(sorted(scale, key=lambda p: (p["kind"] != "main", p["sweep"]))):
            r = p["row"]
            what = (f"{r['clients_per_round']} of {r['num_clients']} clients a round"
                    if p["kind"] == "cross-device" else f"width {r.get('model_dim')}")
            label = f"{'main: ' if p['kind'] == 'main' else ''}{what} ({r['sweep']})"
            c = curve(r, label, f"C{i}", False)
            if c is not None:
                out["scale"].append(c)
    return out


def make(folder: Path, out_dir=None) -> FigureOutput:
    data = panels(Path(folder))
    if not (data["K"] or data["lr"]):
        raise FigureError(f"--real-data {folder}: no per-run score of a setting figure 12 "
                          "places")
    k_c, lr_c = data["centre"]
    rows = [(data["attention"], data)] + list(data["more"].items())
    own_column = bool(data["scale"]) and len(rows) == 1
    fig, grid = new_figure(ncols=4 if own_column else 3, width=3.6, height=3.3,
                           nrows=len(rows))
    grid = [grid] if len(rows) == 1 else list(grid)
    panels_ = []
    scale_title = f"scale and regime ({data['attention']}, K = {k_c}, lr {lr_c:g}, Dirichlet)"
    for r, (kind, got) in enumerate(rows):
        panels_ += [(grid[r][0], f"along K ({kind}, lr {lr_c:g})", got["K"]),
                    (grid[r][1], f"along the step size ({kind}, K = {k_c})", got["lr"])]
        if r == 0:
            panels_.append((grid[r][2], f"is it the kernel? (K = {k_c}, lr {lr_c:g}, "
                            "Dirichlet)", data["kernel"]))
            if own_column:
                panels_.append((grid[r][3], scale_title, data["scale"]))
        elif r == 1 and data["scale"]:
            panels_.append((grid[r][2], scale_title, data["scale"]))
        else:
            grid[r][2].axis("off")
    notes: dict = {}
    for ax, title, curves in panels_:
        for c in curves:
            style = "--" if c["dashed"] else "-"
            mean, se = np.asarray(c["mean"]), np.asarray(c["se"])
            ax.plot(c["x"], mean, style, color=c["colour"], marker=".", lw=1.2,
                    label=c["label"])
            ax.fill_between(c["x"], mean - se, mean + se, color=c["colour"], alpha=0.15, lw=0)
            if c["t"] in c["x"]:
                i = c["x"].index(c["t"])
                ax.plot([c["t"]], [mean[i]], "o", color=c["colour"], ms=6,
                        mfc="white" if c["dashed"] else c["colour"])
            notes[c["sweep"], c["arm"]] = (f"{c['sweep']}/{c['arm']}: {mean[0]:.3f} at "
                                           f"T0 = {round(c['x'][0] * c['rounds'])}, "
                                           f"{mean[-1]:.3f} at T0 = T")
        ax.set_xlabel("T0 / T (1: never frozen)")
        ax.set_ylabel("test accuracy (mean over seeds)")
        ax.set_title(title, fontsize=8)
        ax.set_xlim(-0.03, 1.03)
        if curves:
            ax.legend(fontsize=5.5, loc="best")
    paths = save(fig, NAME, out_dir, dpi=100)
    caption = ("P3 on real networks: test accuracy against T0 / T (mean over seeds, band one "
               "standard error, large marker the T0 chosen on validation); "
               + "; ".join(notes.values()) + ".")
    return FigureOutput(13, NAME, tuple(paths), caption)


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a P3 study's export folder or out_dir", argv)


if __name__ == "__main__":
    raise SystemExit(main())
