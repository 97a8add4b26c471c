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

The centre is the median of the distinct values of the other axis (the P3 plan's K = 10 and
lr = 0.2). The theory's curves are the exact population dynamics' argmin over every T0 in 0..T
(:func:`linattn_theory.warmup.recommend_warmup`, no probe) on the reference problem
``make_problem()`` (d = 8, 10 clients) with teacher heterogeneity 0.5 (for Dirichlet) and 0
(for IID), the same K and T, and the step size mapped by its ratio to the centre:
eta_theory = 0.05 lr / lr_centre (0.05 is the reference problem's step; its stable range
does not match a network's, so only the direction along each axis is comparable, not the level).
A setting where those dynamics diverge has no theory point.

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
    """``folder`` (or its ``tables/``) holds a ``t0_choice.csv`` with the sweeps' settings."""
    path = _find(Path(folder)) if Path(folder).is_dir() else None
    if path is None:
        return False
    with open(path, newline="") as fh:
        header = next(csv.reader(fh), [])
    return all(k in header for k in SETTING)


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


def _centre(values) -> float:
    distinct = sorted(set(values))
    return distinct[len(distinct) // 2]


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


def _marker(row, centre_dim, centre_cpr) -> tuple[str, str, str]:
    """(marker, colour, label) of a row's kind."""
    iid = row["partition"] == "iid"
    kind = "linear" if row["attention"] == "linear" else "softmax"
    part = "IID" if iid else f"Dirichlet {row['alpha']}"
    if row.get("clients_per_round") not in (None, row.get("num_clients")) \
            and row["clients_per_round"] != centre_cpr:
        return "^", "C2", f"{kind}, {part}, {row['clients_per_round']} of " \
                          f"{row['num_clients']} clients a round"
    if row.get("model_dim") not in (None, centre_dim):
        return "D", "C3", f"{kind}, {part}, width {row['model_dim']}"
    return ("o" if kind == "linear" else "s"), ("C0" if kind == "linear" else "C1"), \
        f"{kind}, {part}"


def make(folder: Path, out_dir=None) -> FigureOutput:
    rows = [r for r in load(folder) if r.get("optimizer", "sgd") == "sgd"]
    plain = [r for r in rows if not r["momentum"]]
    if not plain:
        raise FigureError(f"--real-data {folder}: no plain-SGD T0 choice to place on the axes")
    k_c, lr_c = _centre(r["local_steps"] for r in plain), _centre(r["lr"] for r in plain)
    dims = [r["model_dim"] for r in plain if r.get("model_dim") is not None]
    dim_c = min(dims) if dims else None
    cprs = [r["clients_per_round"] for r in plain if r.get("clients_per_round") is not None]
    cpr_c = max(cprs) if cprs else None
    fig, (k_ax, lr_ax) = new_figure(ncols=2, width=4.6, height=3.4)
    seen, lines = set(), []
    for r in rows:
        on_k = not r["momentum"] and r["lr"] == lr_c
        eff = r["lr"] / (1 - r["momentum"]) if r["momentum"] else r["lr"]
        on_lr = r["local_steps"] == k_c and (r["momentum"] or (
            r.get("model_dim") in (None, dim_c) and r.get("clients_per_round") in (None, cpr_c)))
        marker, colour, label = _marker(r, dim_c, cpr_c)
        if r["momentum"]:
            marker, colour, label = "P", "C4", f"{label}, momentum {r['momentum']:g} " \
                                               "(at lr / (1 - momentum))"
        t, lo, hi = (r[k] / r["rounds"] for k in ("chosen_t0", "t0_low", "t0_high"))
        # Dirichlet a little left of its value, IID a little right: equal choices stay visible
        shift = 1.06 if r["partition"] == "iid" else 1 / 1.06
        for ax, x, go in ((k_ax, r["local_steps"], on_k), (lr_ax, eff, on_lr)):
            if not go:
                continue
            ax.errorbar([x * shift], [t], yerr=[[t - lo], [hi - t]], fmt=marker, color=colour, ms=6,
                        capsize=3, mfc="white" if r["partition"] == "iid" else colour,
                        label=None if (ax, label) in seen else label)
            seen.add((ax, label))
        lines.append(f"{r['sweep']}: T0 = {r['chosen_t0']} [{r['t0_low']}, {r['t0_high']}]")
    rounds = int(plain[0]["rounds"])
    ks = sorted({r["local_steps"] for r in plain if r["lr"] == lr_c} | {k_c})
    lrs = sorted({r["lr"] for r in plain if r["local_steps"] == k_c} | {lr_c})
    for het, style, name in ((0.5, "-", "exact model, heterogeneity 0.5"),
                             (0.0, "--", "exact model, IID (heterogeneity 0)")):
        for ax, xs, point in ((k_ax, ks, lambda k: (k, THEORY_LR)),
                              (lr_ax, lrs, lambda lr: (k_c, THEORY_LR * lr / lr_c))):
            pts = [(x, theory_t0(*point(x), rounds, het)) for x in xs]
            pts = [(x, y / rounds) for x, y in pts if y is not None]
            if pts:
                ax.plot(*zip(*pts), style, color="0.3", lw=1.2, marker=".", label=name)
    for ax, what, ticks in ((k_ax, f"local steps K (lr {lr_c:g})", ks),
                            (lr_ax, f"step size lr (K = {k_c})", lrs)):
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
        ax.minorticks_off()
        ax.set_xlim(min(ticks) / 1.6, max(ticks) * 1.6)
        ax.set_xlabel(what)
        ax.set_ylabel("chosen T0 / T (1: never frozen)")
        ax.set_ylim(-0.05, 1.05)
        ax.legend(fontsize=5.5, loc="lower left")
    k_ax.set_title("P3 along K", fontsize=8)
    lr_ax.set_title("P3 along the step size", fontsize=8)
    paths = save(fig, NAME, out_dir, dpi=100)
    caption = ("P3 on real networks: the validation-selected T0 / T with its bootstrap "
               "interval over seeds, against the exact model's T0* / T (reference problem, "
               f"step mapped as {THEORY_LR:g} lr / {lr_c:g}); " + "; ".join(lines) + ".")
    return FigureOutput(12, NAME, tuple(paths), caption)


def main(argv=None) -> int:
    return run_folder_standalone(make, __doc__, "a P3 study's export folder or out_dir", argv)


if __name__ == "__main__":
    raise SystemExit(main())
