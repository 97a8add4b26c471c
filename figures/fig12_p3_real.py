"""Figure 12: P3 on real networks: the validation-selected T0 along K and the step size, with
the direction the theory's exact model predicts beside it.

Drawn from a study's ``t0_choice.csv`` (``linattn study --plan p3 --aggregate-only --export
DIR``; the rows hold each sweep's setting: attention, K, lr, momentum, partition, clients, T,
model width). Two panels, T0 / T on the vertical axis:

- left, along the local steps K at the centre step size: each setting's chosen T0 with its
  95% bootstrap interval over seeds (linear attention circles, softmax squares; Dirichlet
  filled, IID open); the cross-device sweep (fewer clients a round than the partition holds)
  and a wider model (``model_dim`` above the centre's) as their own markers at their K;
- right, along the step size at the centre K; a momentum run sits at its effective step
  lr / (1 - momentum).

The axes cross at the (K, lr) pair with the most plain-SGD rows (the P3 plan's K = 10 and lr =
0.2, where its K sweep and lr sweep meet; with ties, the pair nearest the middle values). Rows
of another optimizer, of a partition other than Dirichlet or IID, or with a setting missing are
not placed, and the caption lists only the placed ones. The theory's curves are the exact
population dynamics' argmin over every T0 in 0..T
(:func:`linattn_theory.warmup.recommend_warmup`, no probe) on the reference problem
``make_problem()`` (d = 8, 10 clients) with teacher heterogeneity 0.5 (for Dirichlet) and 0 (for
IID), the same K and T, and the step size mapped by its ratio to the centre: eta_theory = 0.05
lr / lr_centre (0.05 is the reference problem's step; its stable range does not match a
network's, so only the direction along each axis is comparable, not the level). A setting where
those dynamics diverge has no theory point.

    linattn figure 12 --real-data docs/study/p3
"""

from __future__ import annotations

import csv
from pathlib import Path

from figures.common import FigureError, FigureOutput, run_folder_standalone
from figures.style import new_figure, save

NAME = "fig12_p3_real"
THEORY_LR = 0.05  # the reference problem's step size (README's example)
SETTING = ("attention", "local_steps", "lr", "momentum", "partition", "rounds")


def _find(folder: Path) -> Path | None:
    for path in (folder / "t0_choice.csv", folder / "tables" / "t0_choice.csv"):
        if path.is_file():
            return path
    return None


def has_choices(folder: Path) -> bool:
    """``folder`` (or its ``tables/``) holds a ``t0_choice.csv`` with at least one choice this
    figure places: plain SGD (momentum 0), a Dirichlet or IID partition, every setting given."""
    path = _find(Path(folder)) if Path(folder).is_dir() else None
    if path is None:
        return False
    try:
        return bool(layout(load(Path(folder)))["points"])
    except FigureError:
        return False


def _num(value: str):
    if value in ("", "None"):
        return None
    try:
        f = float(value)
    except ValueError:
        return value
    return int(f) if f.is_integer() and "." not in value else f


def load(folder: Path) -> list[dict]:
    """The T0-choice rows of a study's export folder or out_dir, numbers parsed."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FigureError(f"--real-data {folder}: no such folder; give a P3 study's export "
                          "folder (e.g. docs/study/p3) or its out_dir")
    path = _find(folder)
    if path is None:
        raise FigureError(f"--real-data {folder}: no t0_choice.csv in it or in its tables/; "
                          "run `linattn study --plan p3 --aggregate-only --export DIR` first")
    try:
        with open(path, newline="") as fh:
            rows = [{k: _num(v) for k, v in r.items()} for r in csv.DictReader(fh)]
    except (OSError, csv.Error, UnicodeDecodeError) as exc:
        raise FigureError(f"{path}: cannot read it ({exc})") from None
    if not rows:
        raise FigureError(f"{path}: no T0 choice to draw")
    missing = [k for k in SETTING if k not in rows[0]]
    if missing:
        raise FigureError(f"{path}: no column {', '.join(missing)}; export the study's tables "
                          "again (`linattn study --plan P --aggregate-only --export DIR`), "
                          "which writes each sweep's setting")
    return rows


NEEDED = ("chosen_t0", "t0_low", "t0_high", "local_steps", "lr", "rounds")


def placeable(rows: list[dict]) -> list[dict]:
    """The rows this figure can place: FedFrozen itself (Q/K frozen, on FedAvg: not the
    equal-size control or a FedProx or SCAFFOLD base, where the export names them), SGD, a
    Dirichlet or IID partition and every value of :data:`NEEDED` given (a momentum row too:
    it sits at its effective step)."""
    return [r for r in rows if r.get("optimizer", "sgd") == "sgd"
            and r.get("freeze") in (None, "qk") and r.get("base") in (None, "fedavg")
            and r.get("partition") in ("dirichlet", "iid")
            and all(isinstance(r.get(k), int | float) for k in NEEDED)
            and isinstance(r.get("momentum") or 0.0, int | float)]


def _centre(plain: list[dict]) -> tuple:
    """(K, lr) of the axes' crossing: the pair with the most plain-SGD rows (the P3 plan's
    K = 10 and lr = 0.2, where the K sweep and the lr sweep meet); among pairs with as many,
    the one nearest the middle of the distinct K and lr values (a study where one axis alone
    has run crosses at its middle value)."""
    counts: dict[tuple, int] = {}
    for r in plain:
        key = (r["local_steps"], r["lr"])
        counts[key] = counts.get(key, 0) + 1
    ks, lrs = sorted({k for k, _ in counts}), sorted({lr for _, lr in counts})

    def off_middle(key) -> float:
        return abs(ks.index(key[0]) - (len(ks) - 1) / 2) + abs(lrs.index(key[1])
                                                                - (len(lrs) - 1) / 2)

    return max(sorted(counts), key=lambda k: (counts[k], -off_middle(k)))


def layout(rows: list[dict]) -> dict:
    """Where each placeable row goes: ``{"centre": (K, lr), "dim", "clients_per_round",
    "points": [{"sweep", "axis" ("K" or "lr"), "x", "t", "lo", "hi", "iid", "kind"}]}``;
    ``t``, ``lo``, ``hi`` are T0 / T (the interval widened to hold the choice). A row goes on
    the K axis at the centre lr (plain SGD), on the lr axis at the centre K (its effective
    step lr / (1 - momentum) with momentum); a cross-device row (fewer clients a round than
    the centre's) or a wider model (``model_dim`` above the smallest) only on the K axis."""
    rows = placeable(rows)
    plain = [r for r in rows if not r.get("momentum")]
    if not plain:
        return {"centre": None, "points": []}
    k_c, lr_c = _centre(plain)
    dims = [r["model_dim"] for r in plain if isinstance(r.get("model_dim"), int)]
    dim_c = min(dims) if dims else None
    cprs = [r["clients_per_round"] for r in plain
            if isinstance(r.get("clients_per_round"), int)]
    cpr_c = max(cprs) if cprs else None
    points = []
    for r in rows:
        momentum = r.get("momentum") or 0.0
        main = r.get("model_dim") in (None, dim_c) and r.get("clients_per_round") in (None,
                                                                                     cpr_c)
        kind = ("momentum" if momentum else "main" if main else
                "cross-device" if r.get("clients_per_round") not in (None, cpr_c) else "wide")
        t, lo, hi = (r[k] / r["rounds"] for k in ("chosen_t0", "t0_low", "t0_high"))
        lo, hi = min(lo, t), max(hi, t)
        base = {"sweep": r["sweep"], "t": t, "lo": lo, "hi": hi, "kind": kind, "row": r,
                "iid": r["partition"] == "iid"}
        if not momentum and r["lr"] == lr_c:
            points.append({**base, "axis": "K", "x": r["local_steps"]})
        if r["local_steps"] == k_c and (momentum or main):
            points.append({**base, "axis": "lr", "x": r["lr"] / (1 - momentum)})
    return {"centre": (k_c, lr_c), "dim": dim_c, "clients_per_round": cpr_c,
            "points": points}


def theory_t0(local_steps: int, lr: float, rounds: int, heterogeneity: float) -> int | None:
    """The exact model's T0* for the mapped setting (None where its dynamics diverge)."""
    from linattn_theory.errors import ParameterError
    from linattn_theory.problem import make_problem
    from linattn_theory.warmup import recommend_warmup

    problem = make_problem(kernel_heterogeneity=heterogeneity,
                           value_heterogeneity=heterogeneity)
    try:
        return int(recommend_warmup(problem, lr=lr, local_steps=int(local_steps),
                                    total_rounds=int(rounds), probe=False).warmup_rounds)
    except ParameterError:
        return None


STYLE = {"main": ("o", "C0"), "cross-device": ("^", "C2"), "wide": ("D", "C3"),
         "momentum": ("P", "C4")}


def _label(p: dict) -> str:
    r = p["row"]
    part = "IID" if p["iid"] else f"Dirichlet {r['alpha']}"
    text = f"{r['attention']}, {part}"
    if p["kind"] == "cross-device":
        text += f", {r['clients_per_round']} of {r['num_clients']} clients a round"
    elif p["kind"] == "wide":
        text += f", width {r['model_dim']}"
    elif p["kind"] == "momentum":
        text += f", momentum {r['momentum']:g} (at lr / (1 - momentum))"
    return text


def make(folder: Path, out_dir=None) -> FigureOutput:
    plan = layout(load(folder))
    if not plan["points"]:
        raise FigureError(f"--real-data {folder}: no T0 choice of plain SGD on a Dirichlet or "
                          "IID partition with every setting given, to place on the axes")
    k_c, lr_c = plan["centre"]
    fig, (k_ax, lr_ax) = new_figure(ncols=2, width=4.6, height=3.4)
    axes = {"K": k_ax, "lr": lr_ax}
    seen, drawn = set(), {}
    for p in plan["points"]:
        marker, colour = STYLE[p["kind"]]
        if p["kind"] == "main" and p["row"]["attention"] != "linear":
            marker, colour = "s", "C1"
        label = _label(p)
        ax = axes[p["axis"]]
        # Dirichlet a little left of its value, IID a little right: equal choices stay visible
        x = p["x"] * (1.06 if p["iid"] else 1 / 1.06)
        ax.errorbar([x], [p["t"]], yerr=[[p["t"] - p["lo"]], [p["hi"] - p["t"]]], fmt=marker,
                    color=colour, ms=6, capsize=3, mfc="white" if p["iid"] else colour,
                    label=None if (p["axis"], label) in seen else label)
        seen.add((p["axis"], label))
        r = p["row"]
        drawn[p["sweep"]] = f"{p['sweep']}: T0 = {r['chosen_t0']} [{r['t0_low']}, {r['t0_high']}]"
    rounds = int(plan["points"][0]["row"]["rounds"])
    ticks = {a: sorted({p["x"] for p in plan["points"] if p["axis"] == a}
                       | {k_c if a == "K" else lr_c}) for a in axes}
    theory_x = {"K": sorted({p["x"] for p in plan["points"]
                             if p["axis"] == "K" and p["kind"] == "main"} | {k_c}),
                "lr": sorted({p["x"] for p in plan["points"]
                              if p["axis"] == "lr" and p["kind"] == "main"} | {lr_c})}
    for het, style, name in ((0.5, "-", "exact model, heterogeneity 0.5"),
                             (0.0, "--", "exact model, IID (heterogeneity 0)")):
        for a, point in (("K", lambda k: (k, THEORY_LR)),
                         ("lr", lambda lr: (k_c, THEORY_LR * lr / lr_c))):
            pts = [(x, theory_t0(*point(x), rounds, het)) for x in theory_x[a]]
            pts = [(x, y / rounds) for x, y in pts if y is not None]
            if pts:
                axes[a].plot(*zip(*pts), style, color="0.3", lw=1.2, marker=".", label=name)
    for a, what in (("K", f"local steps K (lr {lr_c:g})"), ("lr", f"step size lr (K = {k_c})")):
        ax = axes[a]
        ax.set_xscale("log")
        ax.set_xticks(ticks[a], [f"{v:g}" for v in ticks[a]])
        ax.minorticks_off()
        ax.set_xlim(min(ticks[a]) / 1.6, max(ticks[a]) * 1.6)
        ax.set_xlabel(what)
        ax.set_ylabel("chosen T0 / T (1: never frozen)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=5.5, loc="lower left")
        values = {p["x"] for p in plan["points"] if p["axis"] == a and p["kind"] == "main"}
        one = " (one value run)" if len(values) < 2 else ""
        ax.set_title(f"P3 along {'K' if a == 'K' else 'the step size'}{one}", fontsize=8)
    paths = save(fig, NAME, out_dir, dpi=100)
    caption = ("P3 on real networks: the validation-selected T0 / T with its bootstrap "
               "interval over seeds, against the exact model's T0* / T (reference problem, "
               f"step mapped as {THEORY_LR:g} lr / {lr_c:g}); " + "; ".join(drawn.values())
               + ".")
    return FigureOutput(12, NAME, tuple(paths), caption)


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a P3 study's export folder or out_dir", argv)


if __name__ == "__main__":
    raise SystemExit(main())
