"""``linattn run | sweep | bench | study | data``: the real-data commands.

``linattn.cli`` routes here with ``argv[0]`` the subcommand. Bad input raises
:class:`~real_data.errors.UserError` (exit 2 through the router); a diverged run exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _floats(text: str) -> list[float]:
    return [float(v) for v in text.split(",") if v]


def _names(text: str) -> list[str]:
    return [v for v in text.split(",") if v]


def _run(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="linattn run", description="One federated run.")
    ap.add_argument("--config", help="YAML file or shipped config name (e.g. digits_vit)")
    ap.add_argument("--out", type=Path, help="run directory (default: run.out_dir/<name>)")
    ap.add_argument("--resume", type=Path, metavar="RUN_DIR", help="continue a killed run")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    args = ap.parse_args(argv)
    from real_data.errors import UserError
    from real_data.runs import resume_run, start_run

    if args.resume is not None:
        if args.config or args.overrides or args.out:
            raise UserError("--resume takes only the run directory (its config.yaml is used)")
        result = resume_run(args.resume)
    else:
        if not args.config:
            raise UserError("linattn run needs --config (or --resume RUN_DIR)")
        from real_data.config import load_config

        result = start_run(load_config(args.config, args.overrides), out=args.out)
    return _report(result)


def _report(result) -> int:
    final = result.summary.get("final", {})
    if result.status != "completed":
        print(f"run stopped: {result.message}\nrun directory: {result.run_dir}", file=sys.stderr)
        return 1
    acc = final.get("test_acc")
    tail = f", test_acc {acc:.4f}" if acc is not None else ""
    print(f"{result.run_dir}: {result.rounds_completed} rounds{tail}")
    return 0


def _sweep(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="linattn sweep", description="A grid of runs.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--out", type=Path, required=True, help="folder for the runs")
    ap.add_argument("--algorithms", type=_names, default=[], help="comma list")
    ap.add_argument("--seeds", type=_ints, default=[], help="comma list")
    ap.add_argument("--warmup-rounds", type=_ints, default=[], help="FedFrozen T0 list")
    ap.add_argument("--alphas", type=_floats, default=[], help="Dirichlet alpha list")
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    from real_data.config import load_config
    from real_data.sweep import run_sweep

    results = run_sweep(load_config(args.config, args.overrides), args.out, args.algorithms,
                        args.seeds, args.warmup_rounds, args.alphas)
    for r in results:
        acc = r.summary.get("final", {}).get("test_acc")
        print(f"{r.status:9s} {'' if acc is None else f'{acc:.4f}':7s} {r.run_dir}")
    return 0 if all(r.status == "completed" for r in results) else 1


def _bench(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="linattn bench",
                                 description="Seconds per round of each engine on a config.")
    ap.add_argument("--config", required=True)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after one warm-up")
    ap.add_argument("--engines", type=_names, default=["vectorized", "sequential"])
    ap.add_argument("overrides", nargs="*", metavar="key=value")
    args = ap.parse_args(argv)
    from real_data.bench import bench_engines
    from real_data.config import load_config

    for row in bench_engines(load_config(args.config, args.overrides), args.engines,
                             args.rounds):
        print(f"{row['engine']:11s} {row['seconds_per_round']:.4f} s/round  "
              f"(+- {row['std']:.4f}, {row['device']})")
    return 0


def _study(argv: list[str]) -> int:
    from real_data.errors import UserError

    raise UserError("linattn study is not implemented yet; use linattn sweep")


def _data(argv: list[str]) -> int:
    from real_data import data_cli

    return int(data_cli.main(argv) or 0)


COMMANDS = {"run": _run, "sweep": _sweep, "bench": _bench, "study": _study, "data": _data}


def main(argv: list[str] | None = None) -> int:
    """Entry point; ``argv[0]`` is the subcommand (``run``, ``sweep``, ...)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        from real_data.errors import UserError

        raise UserError(f"unknown command {argv[:1]}; valid: {', '.join(COMMANDS)}")
    if argv[0] == "data":
        return _data(argv)
    return COMMANDS[argv[0]](argv[1:])
