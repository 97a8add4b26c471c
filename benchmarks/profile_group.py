"""Where a stacked group's round goes on the host: cProfile of a short stacked sweep.

Usage: ``python benchmarks/profile_group.py [--runs 45] [--rounds 4] [--out FILE]`` prints the
top functions by cumulative time (the data as for bench_stacking.py).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description="cProfile of a short stacked group")
    ap.add_argument("--runs", type=int, default=45, help="runs in the group (default 45)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    ap.add_argument("--out", type=Path, help="write the profile table here")
    args = ap.parse_args()
    from real_data.config import load_config
    from real_data.runs import load_data
    from real_data.stacked_runs import RunRequest, run_group

    work = Path(tempfile.mkdtemp())
    over = [f"train.rounds={args.rounds}", "run.progress=false", "run.plot=false",
            "partition.alpha=0.1", "algorithm.name=fedavg"]
    reqs = [RunRequest(work / f"r{s}", load_config("fmnist_vit", [*over, f"seed={s}"]))
            for s in range(args.runs)]
    dataset = load_data(reqs[0].cfg)
    run_group(reqs[:2], dataset=dataset, log=lambda s: None)  # warm-up: CUDA, allocator
    reqs = [RunRequest(work / f"p{s}", r.cfg) for s, r in enumerate(reqs)]
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    run_group(reqs, dataset=dataset, log=lambda s: None)
    prof.disable()
    wall = time.perf_counter() - start
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(40)
    text = f"{args.runs} runs x {args.rounds} rounds: {wall:.1f} s\n" + buf.getvalue()
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
