"""Benchmark: the validation grid, vectorized engine vs the plain per-run loop, in one run.

    python -m simulations.bench [--out docs/bench] [--loop-seeds 1] [--quick]
    (or ``linattn simulate bench``)

It times (1) the whole ``linattn simulate validate`` (P1-P6, theory included), (2) the
vectorized simulation of the validation grid (every setting x seed x T0), and (3) the plain
loop (``simulations.loop.run_single``: one run and one client at a time, each T0 from scratch)
on the same runs. The loop's work does not depend on the seed, so with ``--loop-seeds k`` it is
timed on k seeds per setting and scaled by seeds / k (stated in the output); the default times
every run. Results go to ``OUT/bench_simulator.json`` with the script's source beside them.

Measured (docs/bench/bench_simulator*.json; Intel Xeon, 2 cores pinned with taskset, default
grid of 24 settings x 8 seeds x 13 T0 = 2496 runs, loop timed on 1 seed per setting and scaled
x8): torch threads 2: vectorized 30.1 s, loop 309 s, 10.3x, whole validation 79 s; torch
threads 1 (another run, same machine): vectorized 52.5 s, loop 354 s, 6.8x, validation 118 s.
Timings on these shared machines varied by up to 1.5x between runs.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import time
from pathlib import Path

from linattn.fileio import atomic_write_json
from simulations.engine import simulate
from simulations.loop import run_single
from simulations.validate import Grid, ProblemCache, grid_settings, run_validation


def run_bench(out_dir, loop_seeds: int | None = None, quick: bool = False) -> dict:
    import torch

    grid = Grid.quick() if quick else Grid()
    seeds = list(range(grid.seeds))
    loop_seeds = grid.seeds if loop_seeds is None else min(loop_seeds, grid.seeds)

    clock = time.perf_counter()
    validation = run_validation(grid)
    validate_s = time.perf_counter() - clock

    settings = grid_settings(grid, ProblemCache(grid))
    clock = time.perf_counter()
    simulate(settings, seeds)
    vector_s = time.perf_counter() - clock

    clock = time.perf_counter()
    loop_runs = 0
    for st in settings:
        for seed in seeds[:loop_seeds]:
            for t0 in st.warmup_rounds:
                run_single(st, seed, int(t0))
                loop_runs += 1
    loop_measured_s = time.perf_counter() - clock
    loop_s = loop_measured_s * grid.seeds / loop_seeds
    runs = len(settings) * grid.seeds * len(grid.warmup_grid)
    result = {
        "grid": "quick" if quick else "default",
        "settings": len(settings), "seeds": grid.seeds, "warmup_values": len(grid.warmup_grid),
        "runs": runs,
        "validate_total_s": validate_s,
        "validate_grid_simulation_s": validation["timing"]["grid_simulation_s"],
        "vectorized_grid_s": vector_s,
        "loop_runs_timed": loop_runs, "loop_measured_s": loop_measured_s,
        "loop_grid_s": loop_s, "loop_extrapolated": loop_seeds < grid.seeds,
        "speedup": loop_s / vector_s,
        "torch_threads": torch.get_num_threads(),
        "machine": f"{platform.processor() or platform.machine()}, "
                   f"{__import__('os').cpu_count()} visible cores",
        "checks": {k: v["pass"] for k, v in validation["checks"].items()},
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "bench_simulator.json", result, indent=1)
    shutil.copy(__file__, out / "bench_simulator_source.py")
    rows = [("validate (P1-P6, all)", validate_s), ("vectorized grid simulation", vector_s),
            (f"plain loop, same runs{' (scaled)' if result['loop_extrapolated'] else ''}",
             loop_s)]
    print(f"grid: {len(settings)} settings x {grid.seeds} seeds x {len(grid.warmup_grid)} T0 "
          f"= {runs} runs; torch threads {result['torch_threads']}")
    for name, sec in rows:
        print(f"  {name:<36} {sec:8.1f} s")
    print(f"  speedup vectorized vs loop: {result['speedup']:.1f}x")
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="docs/bench")
    parser.add_argument("--loop-seeds", type=int, default=None)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    run_bench(args.out, args.loop_seeds, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
