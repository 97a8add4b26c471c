"""Start a run that stops between a round's metrics rows and its checkpoint, for kill tests.

    python tests/real_data/pause_run.py --round N --marker FILE --out RUN_DIR [--distributed]
        [--rolled-back] [--probe-call K] [--group] key=value ...

The run (the shipped ``digits_vit`` config with the overrides) goes through
:func:`real_data.runs.start_run` (or, with ``--distributed`` under torchrun,
:func:`real_data.distributed.run_distributed`) with an ``on_round_end`` hook that, after round
N's rows are written, creates FILE and waits forever, so the test can SIGKILL the process at the
one point where ``metrics.csv`` is ahead of ``checkpoints/last.pt``. ``--rolled-back``
(``algorithm.warmup=auto``): only once the run has rolled back to its T0 (round N of the
frozen stage). ``--probe-call K``: pause instead after the K-th frozen round of the probe
continuations, in the middle of a probe. ``--group``: the run trains in a stacked group
(:func:`real_data.stacked_runs.run_group`) beside a fixed-T0 partner in ``RUN_DIR/../partner``.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _hang(marker: Path, text: str) -> None:
    marker.write_text(text)
    while True:
        time.sleep(1)


def pause_at(round_: int, marker: Path, rolled_back: bool = False):
    """An ``on_round_end`` hook: after round ``round_``'s rows (``rolled_back``: once the run
    has rolled back, see the module docstring), write ``marker`` and hang."""

    def hook(rnd: int, run_dir: Path) -> None:
        if rnd == round_ and (not rolled_back or (run_dir / "probe_discarded.csv").exists()):
            _hang(marker, str(rnd))

    return hook


def pause_in_probe(call: int, marker: Path) -> None:
    """Hang after the ``call``-th frozen round of the probe continuations (warmup=auto; in a
    group, the ``call``-th round of the continuations trained together)."""
    from real_data import probe_runs

    fork_round, step = probe_runs.ProbeDriver.fork_round, probe_runs.probe_step
    calls = [0]

    def counting(fn):
        def counted(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[0] += 1
            if calls[0] == call:
                _hang(marker, f"probe round {call}")
            return out
        return counted

    probe_runs.ProbeDriver.fork_round = counting(fork_round)
    probe_runs.probe_step = counting(step)


def command(*args: str) -> list[str]:
    """argv that runs this file with ``args`` (for subprocess or torchrun)."""
    return [sys.executable, __file__, *args]


def start(round_: int, marker: Path, out: Path, *overrides: str,
          flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """This file in a subprocess: a run of ``overrides`` into ``out`` that pauses after round
    ``round_``'s rows (``flags``: ``--rolled-back``, ``--probe-call K``; stderr piped for
    :func:`wait_paused`)."""
    return subprocess.Popen(command("--round", str(round_), "--marker", str(marker), "--out",
                                    str(out), *flags, *overrides), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def wait_paused(proc: subprocess.Popen, marker: Path, what: str, timeout: float = 150,
                poll: float = 0.05) -> None:
    """Wait until ``marker`` exists; fail with the process's stderr if it ends first, or with
    ``what`` after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while not marker.exists():
        if proc.poll() is not None:
            err = proc.stderr.read()
            raise AssertionError(err.decode()[-3000:] if isinstance(err, bytes) else err[-3000:])
        assert time.time() < deadline, what
        time.sleep(poll)


def kill_when_paused(proc: subprocess.Popen, marker: Path, what: str) -> None:
    """:func:`wait_paused`, then SIGKILL the process at its pause (the process is killed in
    any case: a failed wait leaves no process behind)."""
    try:
        wait_paused(proc, marker, what)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO))  # the checkout is not installed into the venv
    from real_data.config import load_config

    ap = argparse.ArgumentParser()
    ap.add_argument("--round", type=int, required=True)
    ap.add_argument("--marker", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--distributed", action="store_true")
    ap.add_argument("--rolled-back", action="store_true")
    ap.add_argument("--probe-call", type=int)
    ap.add_argument("--group", action="store_true")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    cfg = load_config("digits_vit", args.overrides)
    hook = pause_at(args.round, args.marker, args.rolled_back)
    if args.probe_call is not None:
        pause_in_probe(args.probe_call, args.marker)
    if args.group:  # with a fixed-T0 partner (OUT/../partner) in one stacked group
        from real_data.runs import load_data
        from real_data.stacked_runs import RunRequest, run_group

        partner = load_config("digits_vit", [*args.overrides, "algorithm.warmup=fixed",
                                             "algorithm.warmup_rounds=6"])
        run_group([RunRequest(args.out, cfg), RunRequest(args.out.parent / "partner", partner)],
                  dataset=load_data(cfg), log=lambda s: None, on_round_end=hook)
    elif args.distributed:
        from real_data.distributed import run_distributed

        run_distributed(cfg, out=args.out, on_round_end=hook)
    else:
        from real_data.runs import start_run

        start_run(cfg, out=args.out, on_round_end=hook)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
