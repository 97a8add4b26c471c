"""``linattn simulate ...``: run a config (single run or sweep), validate P1-P6, benchmark.

    linattn simulate run --config simulations/configs/default.yaml [--out DIR] key=value ...
    linattn simulate validate [--quick] [--out DIR]
    linattn simulate bench [--out DIR] [--loop-seeds N]
    linattn simulate schedules [--quick] [--out DIR] [--workers N] [--sim-seeds N]

The router (``linattn/cli.py``) passes argv with argv[0] == "simulate". Bad input raises
``simulations.config.ConfigError`` (``user_error = True``): exit status 2, nothing written.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

from simulations.config import ConfigError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would exit(2) itself; keep one path for user errors
        raise ConfigError(message)


DESCRIPTION = ("The synthetic federated simulator of linear attention: run a YAML config "
               "(a single run or a sweep), check the theory's predictions P1-P6 on a grid, "
               "time the vectorized simulator against a plain loop, compare step-size "
               "decay with freezing (schedules), or compare online freeze-timing rules "
               "(freeze-rules). "
               "Run 'linattn simulate COMMAND --help' for a command's options.")


def _out_option(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument("--out", default=default, metavar="DIR",
                        help=f"output directory (default: {default} under the current "
                        "directory)")


def _parser() -> argparse.ArgumentParser:
    top = _Parser(prog="linattn simulate", description=DESCRIPTION)
    sub = top.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND",
                             title="commands",
                             help="run, validate, bench, schedules or freeze-rules")
    run = sub.add_parser("run", help="single run or sweep from a YAML config",
                         description="A single run or a sweep from a YAML config: writes "
                         "config.yaml, metrics.csv and summary.json into the run directory.")
    run.add_argument("--config", required=True, help="YAML file (see simulations/configs)")
    run.add_argument("--out", default=None, metavar="DIR",
                     help="run directory (default: runs/simulate/NAME-TIME under the current "
                     "directory)")
    run.add_argument("--threads", type=int, default=1, metavar="N",
                     help="torch threads (default 1)")
    run.add_argument("overrides", nargs="*", metavar="key=value",
                     help="dotted config overrides, e.g. training.lr=0.05")
    val = sub.add_parser("validate", help="checks P1-P6 on the default grid",
                         description="Check the theory's predictions P1-P6 against the "
                         "simulator on the default grid (or the small one with --quick) and "
                         "write validation.json and validation.md.")
    val.add_argument("--quick", action="store_true", help="small grid (seconds; for tests)")
    _out_option(val, "runs/simulate/validation")
    val.add_argument("--threads", type=int, default=1, metavar="N",
                     help="torch threads (default 1)")
    bench = sub.add_parser("bench", help="vectorized vs plain loop on the validation grid",
                           description="Time the vectorized simulator against a plain loop "
                           "on the validation grid and write the timings as JSON.")
    bench.add_argument("--out", default="docs/bench", metavar="DIR",
                       help="directory for the bench JSON (default: docs/bench under the "
                       "current directory)")
    bench.add_argument("--loop-seeds", type=int, default=None, metavar="N",
                       help="seeds per setting timed with the plain loop (default: all)")
    bench.add_argument("--quick", action="store_true", help="quick grid")
    bench.add_argument("--threads", type=int, default=2, metavar="N",
                       help="torch threads (default 2)")
    sched = sub.add_parser("schedules", help="does freezing add to step-size decay? (model)",
                           description="The exact population dynamics with per-round step "
                           "sizes on two synthetic grids (a 2^(8-2) factorial and a covariate "
                           "shift x teacher heterogeneity map), plus a simulator spot check: "
                           "the best constant-eta FedFrozen, the best decay schedule, and both. "
                           "Writes schedule_study.json, schedule_study.csv and "
                           "schedule_tables.json.")
    sched.add_argument("--quick", action="store_true", help="tiny grids (seconds; for tests)")
    _out_option(sched, "runs/simulate/schedules")
    sched.add_argument("--workers", type=int, default=1, metavar="N",
                       help="processes for the exact dynamics (default 1)")
    sched.add_argument("--sim-seeds", type=int, default=4, metavar="N",
                       help="Monte Carlo seeds of the simulator spot check (default 4)")
    sched.add_argument("--threads", type=int, default=1, metavar="N",
                       help="torch threads (default 1)")
    rules = sub.add_parser("freeze-rules", help="online freeze-timing rules against the best "
                           "fixed T0 (model)",
                           description="Every online freeze-timing rule (perturbation, "
                           "norm_change, norm_change_median, kernel_stability, plateau, "
                           "fraction=0.5) and the probe estimator (auto) on the warm-up grid's "
                           "36 settings: each picks T0 on one finite-sample run, scored by the "
                           "exact population dynamics against the best T0 of the grid "
                           "{0, T/10, ..., T} and against never freezing. Writes "
                           "freeze_rules.json and freeze_rules.md.")
    rules.add_argument("--quick", action="store_true", help="the 4 cheapest settings (seconds)")
    _out_option(rules, "runs/simulate/freeze_rules")
    return top


def _threads(n: int) -> None:
    import torch

    if n < 1:
        raise ConfigError(f"--threads={n} is not allowed; --threads must be >= 1")
    torch.set_num_threads(n)


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    if argv and argv[0] == "simulate":
        argv = argv[1:]
    parser = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args = parser.parse_args(argv)
    if args.command == "run":
        from simulations.config import load_config
        from simulations.divergence import describe
        from simulations.runs import run_configs

        _threads(args.threads)
        configs, sweep = load_config(args.config, args.overrides)  # raises before any write
        name = configs[0].simulation.name
        out = Path(args.out or f"runs/simulate/{name}-{time.strftime('%Y%m%d-%H%M%S')}")
        with warnings.catch_warnings():  # the diverged runs are reported below instead
            warnings.simplefilter("ignore", RuntimeWarning)
            summary = run_configs(configs, sweep, out)
        for rec in summary["settings"]:
            line = (f"setting {rec['index']}: empirical best T0 = {rec['empirical_best_warmup']}")
            if "population_best_warmup" in rec:
                line += f", population T0* = {rec['population_best_warmup']}"
            print(line)
            if rec["diverged"]:
                lr = rec["config"]["training"]["lr"]
                print(f"warning: setting {rec['index']} (training.lr={lr:g}) diverged: "
                      f"{describe(rec['diverged'])}; its metrics are NaN from there; lower "
                      "training.lr", file=sys.stderr)
            if "population_error" in rec:
                print(f"warning: setting {rec['index']}: population dynamics not computed: "
                      f"{rec['population_error']}", file=sys.stderr)
        print(f"wrote {out} ({summary['wall_time_s']:.1f} s)")
        return 0
    if args.command == "validate":
        from simulations.report import markdown_table
        from simulations.validate import run_validation

        _threads(args.threads)
        result = run_validation(out_dir=args.out, quick=args.quick)
        print(markdown_table(result))
        print(f"wrote {args.out} ({result['timing']['total_s']:.1f} s)")
        return 0
    if args.command == "bench":
        from simulations.bench import run_bench

        _threads(args.threads)
        run_bench(args.out, loop_seeds=args.loop_seeds, quick=args.quick)
        return 0
    if args.command == "schedules":
        from simulations.schedule_run import main as schedules_main

        _threads(args.threads)
        if args.workers < 1 or args.sim_seeds < 2:
            raise ConfigError(f"--workers={args.workers}, --sim-seeds={args.sim_seeds} are not "
                              "allowed; --workers must be >= 1 and --sim-seeds >= 2")
        return schedules_main(args)
    if args.command == "freeze-rules":
        from linattn.fileio import atomic_write_json, atomic_write_text
        from simulations.freeze_rules_study import report, run_rule_study

        start = time.perf_counter()
        result = run_rule_study(quick=args.quick)
        result["wall_time_s"] = time.perf_counter() - start
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        text = report(result)
        atomic_write_json(out / "freeze_rules.json", result, indent=1)
        atomic_write_text(out / "freeze_rules.md", text)
        print(text)
        print(f"wrote {out} ({result['wall_time_s']:.1f} s)")
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
