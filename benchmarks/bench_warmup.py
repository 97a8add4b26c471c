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

``--against REV`` times the code of commit REV beside this tree's, side by side in one run:
REV's tree is exported (``git archive``) to a temporary directory, and every row runs in a
fresh process per tree (its library first on ``PYTHONPATH``, its directory as the working
directory of the command line), the two trees alternating row by row, with this script's row
definitions for both. The table then shows both medians and their ratio (REV / this tree), and
the JSON holds REV's rows under ``reference``.

Usage: python benchmarks/bench_warmup.py [--repeats N] [--output docs/bench/warmup.json]
                                         [--against REV]
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
KEYS = ("dim", "num_clients", "kernel_heterogeneity", "value_heterogeneity")
CLI_ROWS = {"linattn warmup --problem (CLI, subprocess)": [],
            "linattn warmup --problem --no-probe (CLI, subprocess)": ["--no-probe"]}


def _pin_one_core() -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _problem():
    return make_problem(**{k: CONFIG[k] for k in KEYS})


def _measure(fn, repeats: int) -> dict:
    fn()                                            # untimed warm-up call
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "mean_s": statistics.fmean(times),
            "std_s": statistics.pstdev(times), "repeats": repeats}


def _row_functions(workdir: Path, tree: Path) -> dict:
    """Each row's call: in process (the library on sys.path) or the command line run in
    ``tree`` with ``tree`` first on PYTHONPATH."""
    lr, steps, total = CONFIG["lr"], CONFIG["local_steps"], CONFIG["total_rounds"]
    schedule = {"lr": lr, "local_steps": steps, "total_rounds": total}
    star = solve_profile(_problem(), restarts=1).value
    rows = {
        "Phi* (solve_profile, 1 start)": lambda: solve_profile(_problem(), restarts=1),
        "exact R(T0), T0 = 0..T, and bound (warmup_path)": lambda: warmup_path(
            (p := _problem()), initial_point(p), lr, steps, total, star),
        "probe estimator (probe_run)": lambda: probe_run(
            (p := _problem()), initial_point(p), lr, steps, total, **PROBE_DEFAULTS),
        "recommend_warmup(problem), no probe": lambda: recommend_warmup(
            _problem(), **schedule, probe=False),
        "recommend_warmup(problem), with probe": lambda: recommend_warmup(
            _problem(), **schedule),
    }
    problem_file = workdir / "problem.json"
    problem_file.write_text(json.dumps({"make_problem": {k: CONFIG[k] for k in KEYS},
                                        "schedule": schedule}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for label, extra in CLI_ROWS.items():
        cmd = [sys.executable, "-m", "linattn", "warmup", "--problem", str(problem_file),
               "--json", str(workdir / "out.json"), *extra]
        rows[label] = (lambda c=cmd: subprocess.run(c, check=True, cwd=tree, env=env,
                                                    capture_output=True))
    return rows


def _child(label: str, repeats: int) -> int:
    """Time one row in this process (the library from PYTHONPATH) and print it as JSON."""
    _pin_one_core()
    tree = Path(os.environ.get("BENCH_TREE", ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        fn = _row_functions(Path(tmp), tree)[label]
        print(json.dumps(_measure(fn, repeats)))
    return 0


def _export(rev: str, dest: Path) -> str:
    """Write commit ``rev``'s tree into ``dest``; return the full commit id."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.strip()
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", commit], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def _side_by_side(labels, repeats: int, trees: dict) -> dict:
    """Every row in a fresh process per tree, alternating the trees row by row."""
    out = {name: {} for name in trees}
    order = list(trees)
    for i, label in enumerate(labels):
        for name in (order if i % 2 == 0 else order[::-1]):
            tree = trees[name]
            env = {**os.environ, "BENCH_TREE": str(tree), "PYTHONPATH": os.pathsep.join(
                [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])}
            res = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child",
                                  label, "--repeats", str(repeats)], cwd=tree, env=env,
                                 capture_output=True, text=True, check=True)
            out[name][label] = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"  {name:>9}: {label}: {out[name][label]['median_s']:.3f} s", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output", type=Path, default=ROOT / "docs" / "bench" / "warmup.json")
    ap.add_argument("--against", metavar="REV",
                    help="also time commit REV's code, side by side (see the module docstring)")
    ap.add_argument("--child", metavar="ROW", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, args.repeats)
    _pin_one_core()
    reference = None
    with tempfile.TemporaryDirectory() as tmp:
        labels = list(_row_functions(Path(tmp), ROOT))
        if args.against:
            ref_tree = Path(tmp) / "reference"
            ref_commit = _export(args.against, ref_tree)
            both = _side_by_side(labels, args.repeats, {"this tree": ROOT,
                                                        "reference": ref_tree})
            rows, reference = both["this tree"], {"commit": ref_commit,
                                                  "rows": both["reference"]}
        else:
            fns = _row_functions(Path(tmp), ROOT)
            rows = {label: _measure(fns[label], args.repeats) for label in labels}
    width = max(map(len, rows))
    head = f"{'row':<{width}}  median s   mean +- std s   target"
    print(head + ("   reference s   ratio" if reference else ""))
    for label, r in rows.items():
        target = f"< {TARGET_S:g} s: {'PASS' if r['median_s'] < TARGET_S else 'FAIL'}" \
            if "CLI" in label or "recommend" in label else ""
        line = (f"{label:<{width}}  {r['median_s']:8.3f}   {r['mean_s']:.3f} +- {r['std_s']:.3f}"
                f"   {target:<14}")
        if reference:
            ref = reference["rows"][label]["median_s"]
            line += f"   {ref:11.3f}   {ref / r['median_s']:5.2f}x"
        print(line.rstrip())
    source = Path(__file__).read_bytes()
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    payload = {"config": CONFIG, "probe": PROBE_DEFAULTS, "target_s": TARGET_S, "rows": rows,
               "machine": {"python": platform.python_version(), "numpy": np.__version__,
                           "processor": platform.processor() or platform.machine(),
                           "cores_used": 1, "load_average": os.getloadavg()},
               "source_sha256": hashlib.sha256(source).hexdigest(), "commit": commit}
    if reference:
        payload["reference"] = reference
        payload["speedup"] = {label: reference["rows"][label]["median_s"] / r["median_s"]
                              for label, r in rows.items()}
    atomic_write_json(args.output, payload, indent=1)
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(argv=None))
