"""``algorithm.warmup=auto`` against a tuned study's final runs, on the configuration the study
chose for its fixed-T0 arm.

For every final run of ``--arm`` (default ``fedfrozen_all``) that ``--slice`` selects, the run
``run`` trains the same configuration (lr, schedule, partition, seeds, validation split) with
``algorithm.warmup=auto`` in place of the chosen T0, into
``<out_dir>/<sweep>/<arm>_auto/alpha=<a>/seed=<s>``; ``compare`` pairs those runs by seed with
the study's FedAvg and with the fixed-T0 arm (the score and the test of
:func:`real_data.study.compare`) and writes ``warmup_auto.{json,md}`` to ``--export``:

    python scripts/auto_on_chosen.py run --plan fair --choices docs/study/fair/choices.json \
        --slice 'fmnist_softmax/*/alpha=0.1/*'
    python scripts/auto_on_chosen.py compare --plan fair --choices docs/study/fair/choices.json \
        --slice 'fmnist_softmax/*/alpha=0.1/*' --export docs/study/fair

The auto run borrows a tuning that searched T0 for the fixed arm, so this favours it; a plan
arm with ``algorithm.warmup=auto`` is tuned on its own grid instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import sys
from pathlib import Path

import numpy as np

from linattn.errors import UserError
from linattn.fileio import atomic_write_json, atomic_write_text
from linattn_theory.probe import ProbeSelector, smoothed
from real_data import study
from real_data.algorithms.fedfrozen import FedFrozenParams
from real_data.config import load_config
from real_data.runs import start_run
from real_data.study.plan import inside
from real_data.study.tables import run_row

# the estimator at its defaults, whatever the fixed-T0 run's file holds for its keys
AUTO = ["algorithm.warmup=auto", "algorithm.warmup_rounds=null",
        *(f"algorithm.{f.name}={'null' if f.default is None else f.default}"
          for f in dataclasses.fields(FedFrozenParams) if f.name.startswith("probe_")
          and f.name != "probe_batch")]


def _decision(summary: dict) -> dict:
    """What the probe rule compared: its best smoothed prediction and snapshot, the loss of
    continuing to T (None when it stopped before T) and the predictions' noise sigma, replayed
    from the predictions ``summary.json`` keeps."""
    preds = [float(p) for p in summary["predictions"]]
    smooth = smoothed(preds, True)
    best = int(np.argmin(smooth))
    sel = ProbeSelector(total_rounds=int(summary["stopped_at"]))
    sel.predictions = preds
    return {"best_snapshot": int(summary["snapshots"][best]),
            "best_prediction": float(smooth[best]),
            "continuing_loss": summary["continuing_loss"], "noise": sel.noise()}


def _pairs(args):
    full = study.load_plan(args.plan)
    plan = study.final_plan(full, study.load_choices(args.choices, full), partial=True)
    # an arm that reads another arm's runs (same_as) is selected too, read from that run
    source = {s.key: src for s, src in study.same_runs(plan)}
    specs = [s for s in [*study.plan_runs(plan), *(s for s, _ in study.same_runs(plan))]
             if any(fnmatch.fnmatch(s.key, p) for p in args.slice)]
    chosen = [s for s in specs if s.arm.name == args.arm]
    if not chosen:
        raise UserError(f"--slice {args.slice} selects no final run of arm {args.arm}")
    out = []
    for s in chosen:
        key = study.run_key(s.sweep.name, f"{args.arm}_auto", None, s.alpha, s.seed)
        out.append((s, inside(plan.out_dir, key)))
    return plan, specs, out, source


def run(args) -> None:
    _, _, pairs, _ = _pairs(args)
    for spec, dest in pairs:
        if study.run_status(dest) == "completed":
            continue
        # the arm's own configuration (an arm that reads another's runs has no config.yaml)
        cfg = load_config(spec.sweep.config, [*study.run_overrides(spec, spec.warmup_rounds),
                                              *AUTO])
        dest.parent.mkdir(parents=True, exist_ok=True)
        print("start", dest, flush=True)
        start_run(cfg, out=dest)


def compare(args) -> None:
    plan, specs, pairs, source = _pairs(args)
    rows = []
    for spec in specs:
        row = run_row(source[spec.key].run_dir if spec.key in source else spec.run_dir)
        if row is not None:
            rows.append({"sweep": spec.sweep.name, "arm": spec.arm.name,
                         "warmup_rounds": spec.warmup_rounds, "alpha": spec.alpha,
                         "seed": spec.seed, **row})
    for spec, dest in pairs:
        row = run_row(dest)
        if row is not None:
            summary = json.loads((dest / "summary.json").read_text())["warmup"]
            rows.append({"sweep": spec.sweep.name, "arm": "auto", "warmup_rounds": None,
                         "alpha": spec.alpha, "seed": spec.seed, **row,
                         "fedavg_equivalent": summary["rounds_computed"]["fedavg_equivalent"],
                         "stopped_at": summary["stopped_at"], **_decision(summary)})
    fixed = [dict(r, warmup_rounds=None) for r in rows if r["arm"] == args.arm]
    result = {"against_fedavg": [c for c in study.compare(rows, "fedavg")
                                 if c["arm"] == "auto"],
              "against_fixed": study.compare([r for r in rows if r["arm"] == "auto"] + fixed,
                                             args.arm),
              "runs": [{k: r[k] for k in ("sweep", "alpha", "seed", "score", "decided_T0",
                                          "stopped_at", "fedavg_equivalent", "best_snapshot",
                                          "best_prediction", "continuing_loss", "noise")}
                       for r in rows if r["arm"] == "auto"]}
    args.export.mkdir(parents=True, exist_ok=True)
    atomic_write_json(args.export / "warmup_auto.json", result, indent=1)
    lines = ["`algorithm.warmup=auto` on the configuration chosen for "
             f"`{args.arm}`, paired by seed; score: mean test accuracy of the last 5 "
             "evaluations; differences in points, 95% t interval.", "",
             "| sweep | alpha | against | n | diff (pts) | 95% CI | verdict |",
             "|---|---|---|---|---|---|---|"]
    for name, cells in (("fedavg", result["against_fedavg"]),
                         (args.arm, result["against_fixed"])):
        for c in cells:
            ci = "" if c["ci_low"] is None else \
                f"[{100 * c['ci_low']:+.2f}, {100 * c['ci_high']:+.2f}]"
            lines.append(f"| {c['sweep']} | {c['alpha']} | {name} | {c['n']} | "
                         f"{100 * c['diff_mean']:+.2f} | {ci} | {c['verdict']} |")
    lines += ["", "The decision: the best smoothed prediction of the validation objective at T "
              "(eq. 36) and its snapshot, the objective of continuing to T (when the run got "
              "there) and the predictions' noise sigma; a snapshot must beat continuing by "
              "sigma.", "",
              "| sweep | alpha | seed | score | T0 decided | stopped at | compute / FedAvg | "
              "best snapshot | best prediction | continuing | sigma |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]

    def num(x):
        return "-" if x is None else f"{x:.3f}"

    for r in result["runs"]:
        lines.append(f"| {r['sweep']} | {r['alpha']} | {r['seed']} | {r['score']:.4f} | "
                     f"{r['decided_T0']:.0f} | {r['stopped_at']} | "
                     f"{r['fedavg_equivalent']:.2f} | {r['best_snapshot']} | "
                     f"{num(r['best_prediction'])} | {num(r['continuing_loss'])} | "
                     f"{num(r['noise'])} |")
    atomic_write_text(args.export / "warmup_auto.md", "\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("run", "compare"))
    ap.add_argument("--plan", required=True)
    ap.add_argument("--choices", type=Path, required=True)
    ap.add_argument("--slice", action="append", required=True)
    ap.add_argument("--arm", default="fedfrozen_all")
    ap.add_argument("--export", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    try:
        (run if args.mode == "run" else compare)(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
