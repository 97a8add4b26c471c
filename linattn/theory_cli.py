"""``linattn warmup`` and ``linattn theory``: the analytic module on the command line.

Imports numpy and the analytic module (and yaml/json for problem files), never torch; matplotlib
only when ``--png`` is given, through ``figures.warmup_plot``. The analytic module itself does
no I/O: problem files are read and results written here.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import sys
from pathlib import Path

import numpy as np

from linattn.configio import load_yaml
from linattn.errors import ConfigError
from linattn.fileio import atomic_write_json, atomic_write_text
from linattn_theory.constants import estimate_constants
from linattn_theory.dynamics import initial_point
from linattn_theory.errors import ParameterError
from linattn_theory.problem import Problem
from linattn_theory.warmup import WarmupConstants, recommend_warmup

# Constants assumed when neither a flag nor a problem file gives them; printed with the result.
DEFAULTS = {
    "delta0": 1.0,
    "pl_constant": 0.5,
    "smoothness": 1.0,
    "grad_bound": 1.0,
    "total_rounds": 200,
}


def _warmup_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="linattn warmup",
        description="Warm-up length T0 before freezing the attention kernel. With a problem "
        "file: the exact optimum of the population dynamics over every T0 in 0..T, the "
        "path-local bound's T0* and a probe estimate from a finite-sample run "
        "(docs/theory.md, eqs. 31-36; the same numbers as recommend_warmup). With constants "
        "only: the stylized bound's closed form (eqs. 24-29).",
    )
    src = ap.add_argument_group("constants (direct)")
    src.add_argument("--heterogeneity", type=float, help="zeta >= 0 (client gradient spread)")
    src.add_argument("--local-steps", type=int, help="K >= 1")
    src.add_argument("--lr", type=float, help="eta in (0, 2/L)")
    src.add_argument("--total-rounds", type=int, help="T >= 1 (default 200)")
    src.add_argument("--smoothness", type=float, help="L > 0 (default 1)")
    src.add_argument("--pl-constant", type=float, help="mu >= 0 (default 0.5)")
    src.add_argument("--delta0", type=float, help="Phi(M_0) - Phi* > 0 (default 1)")
    src.add_argument("--grad-bound", type=float, help="G >= 0 (default 1)")
    src.add_argument("--kernel-distance", type=float, help="D_0 >= 0 (enables nonconvex regime)")
    src.add_argument("--drift-error", type=float,
                     help="measured e >= 0 (replaces (K-1) eta L zeta / 2)")
    src.add_argument("--frozen-floor", type=float, default=0.0, help="D_frozen >= 0")
    prob = ap.add_argument_group("constants (measured from a problem)")
    prob.add_argument("--problem", type=Path,
                      help="YAML/JSON problem file: a 'make_problem' mapping or explicit arrays")
    prob.add_argument("--no-probe", action="store_true",
                      help="with --problem: skip the probe estimator (a finite-sample run)")
    ap.add_argument("--regime", choices=("auto", "pl", "nonconvex"), default="auto",
                    help="which bound's regime gives T0*: pl (Polyak-Lojasiewicz), nonconvex, "
                         "or auto (the lower minimum)")
    ap.add_argument("--csv", type=Path, help="write the curves per T0 (with --problem: exact R, "
                    "bound and their terms; else the stylized bound's terms)")
    ap.add_argument("--png", type=Path, help="plot the curves (needs matplotlib)")
    ap.add_argument("--json", type=Path, help="write the recommendation as JSON (warmup_rounds, "
                    "closed_form, probe_estimate, never_freeze_error, recommended_error, ...)")
    return ap


def load_problem_file(path: Path):
    """Read a problem file (YAML or JSON) into (Problem, schedule mapping); every error names
    the file and the key."""
    if not path.is_file():
        raise ParameterError(f"problem file {path} does not exist; give a YAML or JSON file")
    try:
        data = load_yaml(path)  # JSON is YAML
    except ConfigError as exc:
        raise ParameterError(f"cannot parse problem file: {exc}") from None
    if not isinstance(data, dict):
        raise ParameterError(f"problem file {path} must hold a mapping (make_problem: {{...}} "
                             "or the arrays dim, out_dim, context_length, weights, ...)")
    schedule = data.get("schedule", {})
    try:
        if not isinstance(schedule, dict):
            raise ParameterError(f"schedule={schedule!r} must be a mapping (lr, local_steps, "
                                 "total_rounds, init_seed)")
        return Problem.from_dict(data), schedule
    except ParameterError as exc:
        raise ParameterError(f"problem file {path}: {exc}") from None
    except TypeError as exc:
        raise ParameterError(f"problem file {path}: {exc}") from None


def _schedule_value(value, key: str, kind: type, low: float, source: str):
    """A schedule value from a flag or the problem file's ``schedule`` mapping, checked."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and \
        math.isfinite(value) and value >= low and (kind is float or float(value).is_integer())
    if kind is float and value == 0:
        ok = False
    if not ok:
        allowed = "a finite number > 0" if kind is float else f"an integer >= {int(low)}"
        raise ParameterError(f"{source}{key}={value!r} is not allowed; {key} must be {allowed}")
    return kind(value)


def _check_outputs(args) -> None:
    """Refuse an output path that is a folder before anything is computed."""
    for flag in ("csv", "json", "png"):
        path = getattr(args, flag, None)
        if path is not None and path.is_dir():
            raise ParameterError(f"--{flag} {path} is a folder; give a file name, e.g. "
                                 f"{path / ('warmup.' + flag)}")


def _constants_from_args(args):
    missing = [f for f in ("heterogeneity", "local_steps", "lr") if getattr(args, f) is None]
    if missing:
        flags = ", ".join("--" + m.replace("_", "-") for m in missing)
        raise ParameterError(f"missing {flags}; give them, or --problem FILE")
    assumed = {k: v for k, v in DEFAULTS.items() if getattr(args, k) is None}
    values = {k: (getattr(args, k) if getattr(args, k) is not None else v)
              for k, v in DEFAULTS.items()}
    constants = WarmupConstants(
        heterogeneity=args.heterogeneity,
        local_steps=args.local_steps,
        lr=args.lr,
        kernel_distance=args.kernel_distance,
        frozen_floor=args.frozen_floor,
        measured_drift_error=args.drift_error,
        **values,
    )
    return constants, assumed


def _problem_schedule(args):
    """(problem, lr, K, T, start) from --problem and the flags, every value checked."""
    problem, schedule = load_problem_file(args.problem)
    lr = args.lr if args.lr is not None else schedule.get("lr")
    steps = args.local_steps if args.local_steps is not None else schedule.get("local_steps")
    total = args.total_rounds if args.total_rounds is not None else \
        schedule.get("total_rounds", DEFAULTS["total_rounds"])
    if lr is None or steps is None:
        raise ParameterError("with --problem give --lr and --local-steps (or a 'schedule' "
                             "mapping with lr and local_steps in the file)")
    where = f"problem file {args.problem}: schedule."
    lr = _schedule_value(lr, "lr", float, 0, "--" if args.lr is not None else where)
    steps = _schedule_value(steps, *(("local-steps", int, 1, "--") if args.local_steps
                                     is not None else ("local_steps", int, 1, where)))
    total = _schedule_value(total, *(("total-rounds", int, 1, "--") if args.total_rounds
                                     is not None else ("total_rounds", int, 1, where)))
    seed = _schedule_value(schedule.get("init_seed", 0), "init_seed", int, 0, where)
    return problem, lr, steps, total, initial_point(problem, seed=seed)


def _advice_rows(advice):
    p = advice.path
    header = ["warmup_rounds", "exact_R", "bound", "bias", "drift", "value_error",
              "bound_bias", "bound_drift", "bound_value", "kernel_deviation", "deviation_bound"]
    rows = np.column_stack([p.rounds, p.final_error, p.bound, p.bias, p.drift, p.value_error,
                            p.bound_bias, p.bound_drift, p.bound_value, p.kernel_deviation,
                            p.deviation_bound])
    return header, rows


def _stylized_rows(rec):
    header = ["warmup_rounds", "bias", "drift", "frozen_floor", "transient", "total"]
    return header, np.column_stack([rec.rounds, rec.bias, rec.drift, rec.frozen,
                                    rec.transient, rec.total])


def warmup_main(argv: list[str]) -> int:
    args = _warmup_parser().parse_args(argv)
    _check_outputs(args)
    if args.lr is not None and not math.isfinite(args.lr):
        raise ParameterError(f"--lr={args.lr!r} is not allowed; --lr must be a finite number > 0 "
                             "(e.g. --lr 0.05)")
    if args.total_rounds is not None:
        _schedule_value(args.total_rounds, "total-rounds", int, 1, "--")
    # 1. compute everything; nothing is written before this succeeds
    if args.problem is not None:
        problem, lr, steps, total, start = _problem_schedule(args)
        rec = recommend_warmup(problem, lr=lr, local_steps=steps, total_rounds=total,
                               start=start, probe=not args.no_probe)
        header, rows = _advice_rows(rec)
        assumed = {}
    else:
        constants, assumed = _constants_from_args(args)
        rec = recommend_warmup(constants, regime=args.regime)
        header, rows = _stylized_rows(rec)
    print(rec.explanation())
    if assumed:
        print("  assumed (not given): " + ", ".join(f"{k}={v}" for k, v in assumed.items()))
    figure = None
    if args.png:
        from figures.warmup_plot import draw  # matplotlib only for --png

        figure = draw(rec)
    # 2. write
    if args.csv:
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(header)
        for r in rows:
            w.writerow([int(r[0]), *(f"{x:.10g}" for x in r[1:])])
        atomic_write_text(args.csv, buf.getvalue())
        print(f"wrote {args.csv}")
    if args.json:
        atomic_write_json(args.json, rec.to_dict())
        print(f"wrote {args.json}")
    if figure is not None:
        from figures.warmup_plot import save_figure

        save_figure(figure, args.png)
        print(f"wrote {args.png}")
    return 0


def theory_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="linattn theory",
                                 description="Phi*, D_frozen and the constants of a problem.")
    ap.add_argument("--problem", type=Path, required=True, help="YAML/JSON problem file")
    ap.add_argument("--lr", type=float, required=True)
    ap.add_argument("--local-steps", type=int, required=True)
    ap.add_argument("--total-rounds", type=int, default=DEFAULTS["total_rounds"])
    args = ap.parse_args(argv)
    lr = _schedule_value(args.lr, "lr", float, 0, "--")
    steps = _schedule_value(args.local_steps, "local-steps", int, 1, "--")
    total = _schedule_value(args.total_rounds, "total-rounds", int, 1, "--")
    problem, _ = load_problem_file(args.problem)
    c = estimate_constants(problem, lr, steps, total)
    print(json.dumps(c.to_dict(), indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``linattn warmup`` (the default) and ``linattn theory``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, rest = (argv[0], argv[1:]) if argv else ("warmup", [])
    try:
        if command == "theory":
            return theory_main(rest)
        return warmup_main(rest)
    except ParameterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
