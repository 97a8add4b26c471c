"""The ``linattn`` command: a thin router to each part's own ``cli.py``.

Each subcommand names the module that implements it; the module is imported only when its
subcommand runs, so ``linattn warmup`` never imports torch or matplotlib.

Every part raises errors for bad user input as exceptions carrying ``user_error = True``;
the router prints them as ``error: ...`` and exits with status 2. An ``OSError`` becomes one
line too, ``error: <file>: <reason>; <what to do>``: exit 1 for a fault of the machine (disk
full, read-only file system, no permission, I/O error), 2 for a path that is wrong (missing,
a folder where a file belongs). Notes attached on the way (``add_note``, e.g. the command that
continues a run) follow on the same line.
"""

from __future__ import annotations

import errno
import importlib
import sys

# errno -> (exit status, what to do)
OS_FIXES: dict[int, tuple[int, str]] = {
    errno.ENOSPC: (1, "the disk is full: free space there or write to another disk"),
    errno.EDQUOT: (1, "the disk quota is used up: free space or write elsewhere"),
    errno.EROFS: (1, "the file system is read-only: write to another folder (--out, "
                     "run.out_dir)"),
    errno.EACCES: (1, "no permission: fix the folder's permissions or choose another path"),
    errno.EPERM: (1, "no permission: fix the folder's permissions or choose another path"),
    errno.EIO: (1, "the device reported an I/O error: check the disk"),
    errno.ENOENT: (2, "no such file or folder: check the path"),
    errno.EISDIR: (2, "that is a folder: give a file name"),
    errno.ENOTDIR: (2, "part of the path is a file, not a folder: check the path"),
    errno.ENAMETOOLONG: (2, "the name is too long: choose a shorter path"),
}

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
    "profile": ("real_data.cli", "the kernel profile Phi(M) of a run at its Q/K snapshots"),
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
    except Exception as exc:  # noqa: BLE001 - user errors and OS faults become one line
        if getattr(exc, "user_error", False):
            print(f"error: {_one_line(str(exc), exc)}", file=sys.stderr)
            return 2
        if isinstance(exc, OSError):
            code, line = os_error_line(exc)
            print(f"error: {line}", file=sys.stderr)
            return code
        if isinstance(exc, MemoryError):
            print(_one_line("error: out of memory; lower the batch sizes, the model size or "
                            "the number of clients per round", exc), file=sys.stderr)
            return 1
        raise


def _one_line(text: str, exc: BaseException) -> str:
    return "; ".join([text, *getattr(exc, "__notes__", ())])


def os_error_line(exc: OSError) -> tuple[int, str]:
    """(exit status, ``<file>: <reason>; <what to do>``) for an OS fault."""
    code, fix = OS_FIXES.get(exc.errno, (1, "check the path and the disk"))
    where = exc.filename if exc.filename2 is None else f"{exc.filename} -> {exc.filename2}"
    reason = exc.strerror or str(exc)
    head = f"{where}: {reason}" if where is not None else reason
    return code, _one_line(f"{head}; {fix}", exc)
