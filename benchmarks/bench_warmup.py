"""Benchmark of the warm-up recommendation for a problem, on one CPU core.

Target: the whole ``linattn warmup --problem FILE --json OUT`` call under 2 s for d = 16,
20 clients, T = 500 (K = 5, eta = 0.05). BLAS is limited to one thread (set before numpy is
imported) and the process and its subprocesses are pinned to one core. Rows: the parts of
``recommend_warmup(problem, ...)`` in process (Phi*, the exact R(T0) for every T0 with the
path-local bound, the probe estimator's finite-sample run), the in-process call with and
without the probe, and the command line as a subprocess (interpreter start and imports
included), each the median of ``--repeats`` runs after one untimed warm-up call (mean and std
beside it). The result, with this script's source digest, the config and the machine, goes to
``docs/bench/warmup.json``; ``docs/results/validation.md`` quotes it.

Usage: python benchmarks/bench_warmup.py [--repeats N] [--output docs/bench/warmup.json]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported anywhere

import argparse  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from linattn.fileio import atomic_write_json  # noqa: E402
from linattn_theory.advice import PROBE_DEFAULTS  # noqa: E402
from linattn_theory.dynamics import initial_point  # noqa: E402
from linattn_theory.problem import make_problem  # noqa: E402
from linattn_theory.profile import solve_profile  # noqa: E402
from linattn_theory.sampled import probe_run  # noqa: E402
from linattn_theory.warmup import recommend_warmup  # noqa: E402
from linattn_theory.warmup_path import warmup_path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = {"dim": 16, "num_clients": 20, "kernel_heterogeneity": 0.5, "value_heterogeneity": 0.5,
          "lr": 0.05, "local_steps": 5, "total_rounds": 500}
TARGET_S = 2.0


def _pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _problem():
    keys = ("dim", "num_clients", "kernel_heterogeneity", "value_heterogeneity")
    return make_problem(**{k: CONFIG[k] for k in keys})


def _measure(fn, repeats: int) -> dict:
    fn()                                            # untimed warm-up call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "std_s": statistics.pstdev(times), "repeats": repeats}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", type=Path, default=ROOT / "docs" / "bench" / "warmup.json")
    args = ap.parse_args(argv)
    _pin_one_core()
    lr, steps, total = CONFIG["lr"], CONFIG["local_steps"], CONFIG["total_rounds"]
    schedule = {"lr": lr, "local_steps": steps, "total_rounds": total}
    star = solve_profile(_problem(), restarts=1).value
    rows = {
        "Phi* (solve_profile, 1 start)": _measure(
            lambda: solve_profile(_problem(), restarts=1), args.repeats),
        "exact R(T0), T0 = 0..T, and bound (warmup_path)": _measure(
            lambda: warmup_path((p := _problem()), initial_point(p), lr, steps, total, star),
            args.repeats),
        "probe estimator (probe_run)": _measure(
            lambda: probe_run((p := _problem()), initial_point(p), lr, steps, total,
                              **PROBE_DEFAULTS), args.repeats),
        "recommend_warmup(problem), no probe": _measure(
            lambda: recommend_warmup(_problem(), **schedule, probe=False), args.repeats),
        "recommend_warmup(problem), with probe": _measure(
            lambda: recommend_warmup(_problem(), **schedule), args.repeats),
    }
    with tempfile.TemporaryDirectory() as tmp:
        problem_file = Path(tmp) / "problem.json"
        keys = ("dim", "num_clients", "kernel_heterogeneity", "value_heterogeneity")
        problem_file.write_text(json.dumps({"make_problem": {k: CONFIG[k] for k in keys},
                                            "schedule": schedule}))
        for label, extra in (("linattn warmup --problem (CLI, subprocess)", []),
                             ("linattn warmup --problem --no-probe (CLI, subprocess)",
                              ["--no-probe"])):
            cmd = [sys.executable, "-m", "linattn", "warmup", "--problem", str(problem_file),
                   "--json", str(Path(tmp) / "out.json"), *extra]
            rows[label] = _measure(lambda c=cmd: subprocess.run(c, check=True, cwd=ROOT,
                                                                capture_output=True),
                                   args.repeats)
    width = max(map(len, rows))
    print(f"{'row':<{width}}  median s   mean +- std s   target")
    for label, r in rows.items():
        target = f"< {TARGET_S:g} s: {'PASS' if r['median_s'] < TARGET_S else 'FAIL'}" \
            if "CLI" in label or "recommend" in label else ""
        print(f"{label:<{width}}  {r['median_s']:8.3f}   {r['mean_s']:.3f} +- {r['std_s']:.3f}"
              f"   {target}")
    source = Path(__file__).read_bytes()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    payload = {"config": CONFIG, "probe": PROBE_DEFAULTS, "target_s": TARGET_S, "rows": rows,
               "machine": {"python": platform.python_version(), "numpy": np.__version__,
                           "processor": platform.processor() or platform.machine(),
                           "cores_used": 1, "load_average": os.getloadavg()},
               "source_sha256": hashlib.sha256(source).hexdigest(), "commit": commit}
    atomic_write_json(args.output, payload, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
