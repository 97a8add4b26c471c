"""Benchmark of the analytic module ``linattn_theory`` on one CPU core, against its targets.

Targets: ``recommend_warmup`` under 50 ms for d <= 16 and 20 clients; population
dynamics for 50 T0 values x 500 rounds under 2 s; both on one CPU core. BLAS is limited to one
thread (OMP/OPENBLAS/MKL_NUM_THREADS=1, set before numpy is imported) and the process is pinned
to one core. Every row is the median of several repeats after one untimed warm-up call; wall
time and CPU time (process_time) are both reported, and the target is judged on the median CPU
time. Rows that take a problem build a fresh ``make_problem(...)`` for every call outside the
timed region (a Problem caches products of its covariances and teachers on first use, so a
reused one would hide that cost). Each row also records a calibration workload (a fixed
numpy loop, ``_calibration``) before and after it: a shared VM's core can run 1.6-1.8x slower
for seconds at a time (calibration ~0.20 ms when fast, 0.31-0.35 ms when slow, load average
below 1 either way), which moves every row by the same factor.

Measured results, beside the same rows computed with finite-difference Hessians and per-client
sums: ``docs/results/performance.md#the-analytic-module``; ``docs/bench/theory.json`` holds the
run behind that table, its machine record and calibrations.

Usage: python benchmarks/bench_theory.py [--repeats N] [--output docs/bench/theory.json]
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy is imported anywhere

import argparse  # noqa: E402
import datetime  # noqa: E402
import functools  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import scipy  # noqa: E402

from linattn_theory.dynamics import initial_point, population_dynamics  # noqa: E402
from linattn_theory.problem import make_problem  # noqa: E402
from linattn_theory.profile import solve_profile  # noqa: E402
from linattn_theory.warmup import WarmupConstants, recommend_warmup  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
LR, LOCAL_STEPS = 0.05, 5
CLI_ARGS = ["warmup", "--heterogeneity", "0.5", "--local-steps", "10", "--lr", "0.05"]


def _pin_one_core() -> int | None:
    """Pin this process (and the subprocesses it starts) to the first core it may use."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    core = min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {core})
    return core


def _calibration() -> float:
    """Median CPU ms of a fixed numpy workload (400 stacked 16 x 16 products, 40 at a time).

    Recorded before and after the whole run and before and after every timed row: on a shared
    VM the speed of the core drifts by up to 2x for seconds at a time (about 0.2 ms here when
    fast, 0.33-0.35 ms when slow), and this says which state a row was measured in.
    """
    a = np.random.default_rng(0).standard_normal((40, 16, 16))
    times = []
    for _ in range(15):
        c0 = time.process_time()
        for _ in range(10):
            a @ a
        times.append(time.process_time() - c0)
    return 1e3 * statistics.median(times)


def _measure(fn, repeats: int, fresh=None) -> dict:
    """Median wall and CPU seconds of ``fn()`` over ``repeats`` calls after one warm-up call.

    With ``fresh`` (a function returning a new argument), every call, the warm-up included,
    gets its own ``fresh()`` made outside the timed region, and the row times ``fn(arg)``: a
    Problem caches products of its covariances and teachers on first use
    (``Problem.teacher_products``), and a fresh one makes each timed call compute them.
    """
    calls = ([fn] * (repeats + 1) if fresh is None
             else [functools.partial(fn, fresh()) for _ in range(repeats + 1)])
    before = _calibration()
    calls[0]()
    wall, cpu = [], []
    for call in calls[1:]:
        w0, c0 = time.perf_counter(), time.process_time()
        call()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return {"repeats": repeats, "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "cpu_min_s": min(cpu), "cpu_max_s": max(cpu),
            "wall_min_s": min(wall), "wall_max_s": max(wall),
            "calibration_ms": [before, _calibration()]}


def _measure_subprocess(argv: list[str], repeats: int) -> dict:
    """Median wall seconds of a subprocess (CPU: user + sys of the child, from os.times)."""
    subprocess.run(argv, check=True, capture_output=True)
    wall, cpu = [], []
    for _ in range(repeats):
        t0 = os.times()
        w0 = time.perf_counter()
        subprocess.run(argv, check=True, capture_output=True)
        wall.append(time.perf_counter() - w0)
        t1 = os.times()
        cpu.append((t1.children_user - t0.children_user) + (t1.children_system
                                                            - t0.children_system))
    return {"repeats": repeats, "wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "wall_min_s": min(wall), "wall_max_s": max(wall)}


def _machine(core: int | None) -> dict:
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    except Exception:  # noqa: BLE001 - provenance only
        blas = {}
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "linattn_theory"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", None
    return {
        "cpu_model": model,
        "cpu_count": os.cpu_count(),
        "pinned_core": core,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "scipy": scipy.__version__,
        "blas": {k: blas.get(k) for k in ("name", "version") if k in blas},
        "threads_env": {v: os.environ.get(v) for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS",
                                                       "MKL_NUM_THREADS")},
        "git_commit": commit,
        "linattn_theory_modified": dirty,
    }


def _problem_setup(dim: int, clients: int):
    problem = make_problem(dim=dim, num_clients=clients, seed=0)
    return problem, solve_profile(problem).value, initial_point(problem, seed=0)


def run(repeats: int) -> list[dict]:
    rows = []

    def add(name, params, stats, target=None):
        row = {"name": name, "params": params, **stats, "target_s": target}
        row["meets_target"] = None if target is None else bool(stats["cpu_s"] < target)
        rows.append(row)
        mark = "" if target is None else ("  ok" if row["meets_target"] else "  MISS")
        calibration = ("" if "calibration_ms" not in stats else
                       "  [cal {:.2f}/{:.2f} ms]".format(*stats["calibration_ms"]))
        print(f"  {name:<44} {stats['cpu_s'] * 1e3:>11.3f} ms cpu {stats['wall_s'] * 1e3:>11.3f}"
              f" ms wall{mark}{calibration}", flush=True)

    constants = WarmupConstants(delta0=1.0, pl_constant=0.5, smoothness=1.0, heterogeneity=0.5,
                                grad_bound=1.0, lr=0.05, local_steps=10, total_rounds=200)
    add("recommend_warmup(WarmupConstants)", {"total_rounds": 200},
        _measure(lambda: recommend_warmup(constants), max(50 * repeats, 100)), 0.05)

    grid = np.linspace(0, 500, 50).astype(int)
    for dim, clients in ((8, 10), (16, 20)):
        _, phi_star, start = _problem_setup(dim, clients)

        def fresh(d=dim, c=clients):
            return make_problem(dim=d, num_clients=c, seed=0)

        params = {"dim": dim, "clients": clients, "lr": LR, "local_steps": LOCAL_STEPS}
        add(f"recommend_warmup(problem) d={dim} C={clients}",
            {**params, "total_rounds": 200, "fresh_problem_per_call": True},
            _measure(lambda p: recommend_warmup(p, lr=LR, local_steps=LOCAL_STEPS,
                                                total_rounds=200), repeats, fresh), 0.05)
        add(f"  same, phi_star given d={dim} C={clients}",
            {**params, "total_rounds": 200, "phi_star_given": True,
             "fresh_problem_per_call": True},
            _measure(lambda p, s=phi_star: recommend_warmup(
                p, lr=LR, local_steps=LOCAL_STEPS, total_rounds=200, phi_star=s), repeats,
                fresh), 0.05)
        add(f"population_dynamics 50 T0 x 500 d={dim} C={clients}",
            {**params, "total_rounds": 500, "warmup_values": int(grid.size),
             "fresh_problem_per_call": True},
            _measure(lambda p, s=phi_star, x=start: population_dynamics(
                p, x, LR, LOCAL_STEPS, 500, grid, s), repeats, fresh), 2.0)
        add(f"solve_profile d={dim} C={clients}",
            {"dim": dim, "clients": clients, "restarts": 4, "fresh_problem_per_call": True},
            _measure(lambda p: solve_profile(p), repeats, fresh))

    exe = shutil.which("linattn", path=str(Path(sys.executable).parent))
    cli = [exe] if exe else [sys.executable, "-m", "linattn"]
    add("linattn warmup (subprocess start-up)", {"argv": ["linattn", *CLI_ARGS]},
        _measure_subprocess([*cli, *CLI_ARGS], max(2 * repeats, 10)))
    add("python -c pass (interpreter baseline)", {},
        _measure_subprocess([sys.executable, "-c", "pass"], max(2 * repeats, 10)))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per row (median)")
    ap.add_argument("--output", type=Path, default=ROOT / "docs" / "bench" / "theory.json")
    args = ap.parse_args()
    core = _pin_one_core()
    machine = _machine(core)
    print(f"linattn_theory benchmark on one core ({machine['cpu_model']}, core {core}, "
          f"load {machine['load_average']})")
    started = time.perf_counter()
    calibration = [_calibration()]
    rows = run(args.repeats)
    calibration.append(_calibration())
    print(f"calibration workload: {calibration[0]:.3f} ms before, {calibration[1]:.3f} ms after")
    # the docstring records measured numbers and is edited after a run: hash the code below it
    source = Path(__file__).read_text()
    code = source[source.index('"""', 3) + 3:].encode()
    payload = {
        "benchmark": "linattn_theory",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "judged_on": "median CPU seconds (process_time) per call, one core",
        "machine": {**machine, "load_average_end": list(os.getloadavg())
                    if hasattr(os, "getloadavg") else None},
        "results": rows,
        "calibration_ms": {"before": calibration[0], "after": calibration[1],
                           "what": _calibration.__doc__.split("\n")[0]},
        "total_wall_s": time.perf_counter() - started,
        "script": {"path": "benchmarks/bench_theory.py",
                   "code_sha256": hashlib.sha256(code).hexdigest(),
                   "code_sha256_covers": "the file after its module docstring"},
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
