"""``linattn reproduce`` (the main job) and ``linattn figure N``.

    linattn reproduce [--quick] [--out DIR] [--real-data RUNS_DIR] [--threads N] [--cache DIR]
    linattn figure N [--quick] [--out DIR] [--real-data RUNS_DIR] [--threads N] [--cache DIR]

``reproduce`` runs the theory and simulation checks P1-P6 (``simulations.validate``), draws
figures 1-6 and 8-10 (and 7 with ``--real-data``, 11 where that folder holds a freeze-rule
study's ``rule_regret.json``, 12 where it holds a ``t0_choice.csv`` with the sweeps' settings,
13 where it also holds ``study_per_run.csv``, 14 where it or a subfolder holds a
``kernel_profile.json``) into DIR (default ``figures/out/`` under the
current directory) and writes DIR/report.md with every prediction, its criterion, the numbers
and PASS or FAIL. Intermediate results are cached in DIR/.cache, so a second call redraws in
seconds. It needs no GPU and no download. The router (``linattn/cli.py``) passes argv with
argv[0] the subcommand.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time
from pathlib import Path

from figures.common import FigureError

MODULES = {1: "fig1_bias_drift", 2: "fig2_final_error", 3: "fig3_optimal_warmup",
           4: "fig4_frozen_floor", 5: "fig5_bound", 6: "fig6_gradient_jumps",
           7: "fig7_real_data", 8: "fig8_partitions", 9: "fig9_schedules",
           10: "fig10_shift_map", 11: "fig11_freeze_timing", 12: "fig12_p3_real",
           13: "fig13_p3_curves", 14: "fig14_kernel_profile"}
SIMULATED = (1, 2, 3, 4, 5, 6)  # the figures drawn from the validation result


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one path for user errors: exit status 2 via the router
        raise FigureError(message)


DESCRIPTIONS = {
    "reproduce": "The main job: run the theory and simulation checks P1-P6, draw figures 1-6 "
                 "and 8-10 (and 7 from existing real-data runs with --real-data, 11 where that "
                 "folder holds a freeze-rule report, 12 and 13 where it holds a P3 study's "
                 "T0 choices and per-run scores, 14 where it holds its kernel-profile tables), "
                 "and write "
                 "OUT/report.md with every prediction, its criterion, the numbers and PASS or "
                 "FAIL. Intermediate results are cached, so a second call redraws in seconds. "
                 "No GPU and no download needed.",
    "figure": "Draw one figure (PNG and PDF): 1 bias and drift versus T0, 2 final error "
              "versus T0, 3 optimal warm-up versus heterogeneity, K and lr, 4 frozen-stage "
              "floor, 5 stylized bound versus measured error, 6 gradient-norm jumps, 7 real "
              "data (needs --real-data), 8 partitions, 9 step-size decay and freezing, 10 "
              "where freezing pays (covariate shift x teacher heterogeneity), 11 when to freeze on "
              "real data: accuracy against T0 with each online rule's choice (needs "
              "--real-data: a freeze-rule study's export folder), 12 P3 on real networks: "
              "the validation-selected T0 along K and the step size against the exact "
              "model's direction (needs --real-data: a P3 study's export folder), 13 P3 on "
              "real networks: test accuracy against T0 per setting and per arm (the same "
              "folder), 14 the kernel profile on real networks: Phi along the round, bias and "
              "drift against T0 per reference and budget (needs --real-data: a folder holding "
              "kernel_profile.json tables, e.g. docs/study/p3).",
}


def _parser(command: str) -> argparse.ArgumentParser:
    top = _Parser(prog=f"linattn {command}", description=DESCRIPTIONS[command])
    if command == "figure":
        top.add_argument("number", type=int, choices=sorted(MODULES), help="figure number")
    top.add_argument("--quick", action="store_true",
                     help="smoke version on the small grid (about a minute)")
    top.add_argument("--out", type=Path, default=None, metavar="DIR",
                     help="output folder (default: figures/out under the current directory)")
    top.add_argument("--real-data", type=Path, default=None, metavar="RUNS_DIR",
                     help="folder of real-data run directories (a study's out_dir): figure 7; "
                          "figure 11: a freeze-rule study's export folder or out_dir; "
                          "figures 12 and 13: a P3 study's export folder or out_dir; figure "
                          "14: a folder holding kernel_profile.json tables (or subfolders "
                          "that do); reproduce draws each figure the folder holds the data "
                          "for (an export folder without runs: no figure 7)")
    top.add_argument("--threads", type=int, default=2, metavar="N",
                     help="torch threads (default 2)")
    top.add_argument("--cache", type=Path, default=None, metavar="DIR",
                     help="cache folder (default: OUT/.cache)")
    return top


def _draw(number: int, result, grid, out_dir, cache_dir, real_data):
    module = importlib.import_module(f"figures.{MODULES[number]}")
    if number in (7, 11, 12, 13, 14):
        return module.make(real_data, out_dir)
    if number == 8:
        return module.make(out_dir)
    return module.make(result, grid, out_dir, cache_dir)


def _make_folders(*folders: Path) -> None:
    """Create the output and cache folders now, so a bad path fails before any work."""
    for folder in folders:
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise FigureError(f"cannot create the folder {folder} ({exc.strerror}); give a "
                              "writable --out or --cache") from None


def _real_data_figures(folder) -> list[int]:
    """The real-data figures ``--real-data FOLDER`` draws: 7 where it holds completed run
    directories, 11-14 where it holds a study's exported tables (a freeze-rule report, T0
    choices, per-run scores, a kernel profile). FigureError when it holds neither."""
    if folder is None:
        return []
    from figures.fig7_real_data import find_runs
    from figures.fig11_freeze_timing import has_report
    from figures.fig12_p3_real import has_choices
    from figures.fig13_p3_curves import has_curves
    from figures.fig14_kernel_profile import has_profile

    tables = [n for n, has in ((11, has_report), (12, has_choices), (13, has_curves),
                               (14, has_profile)) if has(folder)]
    try:
        find_runs(folder)
    except FigureError as exc:
        if not tables:
            raise FigureError(f"{exc}; nor a study's exported tables (figures 11-14: "
                              "`linattn study --plan P --export DIR`)") from None
        names = ", ".join(map(str, tables))
        print(f"--real-data {folder}: no run directories, so no figure 7; "
              f"figure{'s' if len(tables) > 1 else ''} {names} from its exported tables",
              flush=True)
        return tables
    return [7, *tables]


def reproduce(args, command: str) -> int:
    from figures.common import cache_dir_for, grid_for, set_threads, validation
    from figures.report import write_report
    from figures.style import OUT_DIR

    wall, cpu = time.perf_counter(), time.process_time()
    load_start = os.getloadavg()[0]
    real = _real_data_figures(args.real_data)  # a bad folder fails here, before the simulations
    set_threads(args.threads)
    out_dir = Path(args.out) if args.out is not None else OUT_DIR
    cache_dir = cache_dir_for(out_dir, args.cache)
    _make_folders(out_dir, cache_dir)
    grid = grid_for(args.quick)
    steps = []

    def step(name, fn):
        clock = time.perf_counter()
        value = fn()
        steps.append({"name": name, "seconds": time.perf_counter() - clock})
        return value

    print(f"validation (P1-P6) on the {'quick' if args.quick else 'default'} grid ...",
          flush=True)
    result, hit, _ = step("theory and simulation checks P1-P6 (run_validation) + "
                          "validation.json", lambda: validation(grid, out_dir, cache_dir))
    steps[-1]["cache"] = "yes" if hit else "no"
    print(f"  {steps[-1]['seconds']:.1f} s ({'cached' if hit else 'computed'})", flush=True)
    numbers = [*SIMULATED, 8, 9, 10] + real
    figures = []
    for number in numbers:
        fig = step(f"figure {number} ({MODULES[number]})",
                   lambda n=number: _draw(n, result, grid, out_dir, cache_dir, args.real_data))
        steps[-1]["cache"] = (", ".join(f"{k}: {'yes' if v else 'no'}"
                                        for k, v in fig.cache_hits.items()) or "-")
        figures.append(fig)
        print(f"  figure {number}: {steps[-1]['seconds']:.1f} s -> {fig.paths[0]}", flush=True)
    timing = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
              "load_average": {"start": load_start, "end": os.getloadavg()[0]},
              "steps": steps, "cache_dir": str(cache_dir)}
    path = write_report(out_dir, result, grid, figures, timing, args.quick, command)
    checks = result["checks"]
    print("  ".join(f"{k}: {({True: 'PASS', False: 'FAIL', None: 'report'})[c['pass']]}"
                    for k, c in checks.items()))
    print(f"wrote {path} (wall {timing['wall_s']:.1f} s, CPU {timing['cpu_s']:.1f} s)")
    return 0


def figure(args) -> int:
    from figures.common import cache_dir_for, grid_for, set_threads, validation

    if args.number == 7 and args.real_data is None:
        raise FigureError("figure 7 reads run directories: give --real-data RUNS_DIR")
    if args.number == 11 and args.real_data is None:
        raise FigureError("figure 11 reads a freeze-rule study's tables: give --real-data DIR "
                          "(e.g. docs/study/freeze_rules)")
    if args.number in (12, 13) and args.real_data is None:
        raise FigureError(f"figure {args.number} reads a P3 study's T0 choices: give "
                          "--real-data DIR (e.g. docs/study/p3)")
    if args.number == 14 and args.real_data is None:
        raise FigureError("figure 14 reads a P3 study's kernel-profile tables: give "
                          "--real-data DIR (e.g. docs/study/p3)")
    set_threads(args.threads)
    grid = grid_for(args.quick)
    cache_dir = cache_dir_for(args.out, args.cache)
    _make_folders(*(f for f in (args.out, cache_dir) if f is not None))
    result = None
    if args.number in SIMULATED:
        result, _, _ = validation(grid, args.out, cache_dir, write=False)
    fig = _draw(args.number, result, grid, args.out, cache_dir, args.real_data)
    print("\n".join(str(p) for p in fig.paths))
    print(fig.caption)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and argv[0] in ("reproduce", "figure") else "reproduce"
    if argv and argv[0] == command:
        argv = argv[1:]
    args = _parser(command).parse_args(argv)
    line = " ".join(["linattn", command, *argv])
    return reproduce(args, line) if command == "reproduce" else figure(args)


if __name__ == "__main__":
    raise SystemExit(main())
