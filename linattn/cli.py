"""The ``linattn`` command: a thin router to each part's own ``cli.py``.

Each subcommand names the module that implements it; the module is imported only when its
subcommand runs, so ``linattn warmup`` never imports torch or matplotlib.

Every part raises errors for bad user input as exceptions carrying ``user_error = True``;
the router prints them as ``error: ...`` and exits with status 2.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
ROUTES: dict[str, tuple[str, str]] = {
    "warmup": ("linattn.theory_cli",
               "optimal warm-up length T0* from constants or a problem file"),
    "theory": ("linattn.theory_cli", "analytic quantities of a problem (losses, Phi*, D_frozen)"),
    "simulate": ("simulations.cli", "synthetic federated simulator: run, sweep, validate P1-P6"),
    "data": ("real_data.cli", "fetch, verify and list the real data sets"),
    "run": ("real_data.cli", "one federated run on real data from a YAML config"),
    "sweep": ("real_data.cli", "a grid of federated runs sharing data and warm-up checkpoints"),
    "pretrain": ("real_data.cli", "central pretraining on a source data set (FedSQ's S)"),
    "study": ("real_data.cli", "the real-data validation study from a plan file"),
    "reproduce": ("figures.cli", "the main job: theory + simulation checks, figures, report"),
    "figure": ("figures.cli", "draw one figure"),
}


def _usage() -> str:
    lines = ["usage: linattn <command> [options]", "", "commands:"]
    width = max(len(k) for k in ROUTES)
    for name, (_, text) in ROUTES.items():
        lines.append(f"  {name:<{width}}  {text}")
    lines.append("")
    lines.append("Run `linattn <command> --help` for the options of one command.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from linattn import __version__

        print(__version__)
        return 0
    command = argv[0]
    if command not in ROUTES:
        print(
            f"error: unknown command {command!r}; valid commands: {', '.join(ROUTES)}",
            file=sys.stderr,
        )
        return 2
    module = importlib.import_module(ROUTES[command][0])
    try:
        return int(module.main(argv) or 0)
    except Exception as exc:  # noqa: BLE001 - only user errors are turned into exit 2
        if getattr(exc, "user_error", False):
            print(f"error: {exc}", file=sys.stderr)
            return 2
        raise
