"""Where a stacked group's round goes: host profile or per-phase GPU time of a short sweep.

Usage::

    python benchmarks/profile_group.py [--runs 45] [--rounds 4] [--out FILE]
    python benchmarks/profile_group.py --phases [--engine vectorized_compiled] [--alone 3]

The default prints cProfile's top functions by cumulative time. ``--phases`` times each part
of the group's round (plan, engine, server update, evaluation, records and checkpoints,
branches) with a device synchronization after each, so a phase's time includes its queued GPU
work; ``--alone N`` times the same phases for N runs trained one by one
(``real_data.runs.train_prepared``). The data is as for bench_stacking.py (``LINATTN_DATA``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PHASES = {  # (module, attribute) -> phase
    ("real_data.federation", "Federation.begin_round"): "plan",
    ("real_data.stacked_runs", "train_jobs"): "engine",
    ("real_data.federation", "Federation.train_job"): "engine",
    ("real_data.federation", "Federation.update_round"): "server_update",
    ("real_data.stacked_runs", "evaluate_group"): "evaluation",
    ("real_data.federation", "Federation.evaluate"): "evaluation",
    ("real_data.runs", "RunLog.record"): "records",
    ("real_data.stacked_runs", "_branch"): "branches",
    ("real_data.stacked_runs", "_member"): "setup",
    ("real_data.federation", "Federation.prefetch"): "prefetch",
    ("real_data.stacked_runs", "_close"): "close",
}


def _instrument(times: dict) -> None:
    """Wrap each phase's function: synchronize the device after it, add its seconds."""
    import importlib

    import torch

    depth = [0]
    for (mod, attr), phase in PHASES.items():
        owner = importlib.import_module(mod)
        parts = attr.split(".")
        for p in parts[:-1]:
            owner = getattr(owner, p)
        fn = getattr(owner, parts[-1])

        def wrapped(*a, _fn=fn, _phase=phase, **k):
            if depth[0]:
                return _fn(*a, **k)
            depth[0] += 1
            start = time.perf_counter()
            try:
                return _fn(*a, **k)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[_phase] += time.perf_counter() - start
                depth[0] -= 1
        setattr(owner, parts[-1], wrapped)


def _requests(work: Path, args, tag: str):
    from real_data.config import load_config
    from real_data.stacked_runs import RunRequest

    over = [f"train.rounds={args.rounds}", "run.progress=false", "run.plot=false",
            "partition.alpha=0.1", "algorithm.name=fedavg", f"train.engine={args.engine}",
            *args.override]
    return [RunRequest(work / f"{tag}{s}", load_config("fmnist_vit", [*over, f"seed={s}"]))
            for s in range(args.runs)]


def phases(args) -> dict:
    from real_data.runs import load_data, prepare_start, train_prepared
    from real_data.stacked_runs import RunRequest, run_group

    work = Path(tempfile.mkdtemp())
    reqs = _requests(work, args, "w")
    dataset = load_data(reqs[0].cfg)
    run_group(reqs, dataset=dataset, log=lambda s: None)  # warm-up: compile, allocator
    times: dict = defaultdict(float)
    _instrument(times)
    reqs = [RunRequest(work / f"p{s}", r.cfg) for s, r in enumerate(reqs)]
    prof = cProfile.Profile() if args.cprofile else None
    start = time.perf_counter()
    if prof:
        prof.enable()
    run_group(reqs, dataset=dataset, log=lambda s: None)
    if prof:
        prof.disable()
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_callees("update_round")
        st.sort_stats("cumulative").print_stats(60)
        args.cprofile.write_text(buf.getvalue())
    wall = time.perf_counter() - start
    out = {"stacked": {"runs": args.runs, "rounds": args.rounds, "wall_s": wall,
                       "phases_s": dict(times),
                       "ms_per_run_round": 1e3 * wall / (args.runs * args.rounds)}}
    if args.alone:
        times.clear()
        start = time.perf_counter()
        for s, r in enumerate(reqs[:args.alone]):
            train_prepared(prepare_start(r.cfg, out=work / f"a{s}", dataset=dataset))
        wall = time.perf_counter() - start
        out["alone"] = {"runs": args.alone, "rounds": args.rounds, "wall_s": wall,
                        "phases_s": dict(times),
                        "ms_per_run_round": 1e3 * wall / (args.alone * args.rounds)}
    if args.eval_profile:
        out["evaluation"] = _eval_profile(args, work, dataset)
    print(json.dumps(out, indent=1))
    return out


def _eval_profile(args, work: Path, dataset) -> dict:
    """The stacked evaluation of ``args.runs`` global models alone: seconds per call, and a
    ``torch.profiler`` kernel table written to ``args.eval_profile``."""
    import torch

    from real_data.metrics import evaluate_stacked
    from real_data.runs import prepare_start

    fed = prepare_start(_requests(work, args, "e")[0].cfg, out=work / "eval", dataset=dataset).fed
    params = {n: p.detach().unsqueeze(0).expand(args.runs, *p.shape).contiguous()
              for n, p in fed.model.named_parameters()}

    def once():
        evaluate_stacked(fed.model, params, fed.x_test, fed.y_test, fed.cfg.eval.batch_size,
                         fed.autocast)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    once()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        once()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile() as prof:
        once()
    sort = "cuda_time_total" if torch.cuda.is_available() else "cpu_time_total"
    args.eval_profile.write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    return {"models": args.runs, "samples": len(fed.x_test), "seconds": times}


def main() -> int:
    ap = argparse.ArgumentParser(description="cProfile or per-phase time of a short stacked "
                                             "group")
    ap.add_argument("--runs", type=int, default=45, help="runs in the group (default 45)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds (default 4)")
    ap.add_argument("--phases", action="store_true",
                    help="time each phase with a device synchronization after it")
    ap.add_argument("--engine", default="vectorized",
                    help="train.engine of the runs (default vectorized)")
    ap.add_argument("--alone", type=int, default=0,
                    help="with --phases: also time this many runs trained one by one")
    ap.add_argument("--override", action="append", default=[],
                    help="a config override for every run (repeatable)")
    ap.add_argument("--cprofile", type=Path,
                    help="with --phases: write cProfile tables of the stacked group here")
    ap.add_argument("--eval-profile", type=Path,
                    help="with --phases: time the stacked evaluation of --runs models alone "
                    "and write its kernel table here")
    ap.add_argument("--out", type=Path, help="write the table (or JSON) here")
    args = ap.parse_args()
    if args.phases:
        result = phases(args)
        if args.out:
            args.out.write_text(json.dumps(result, indent=1))
        return 0
    from real_data.runs import load_data
    from real_data.stacked_runs import RunRequest, run_group

    work = Path(tempfile.mkdtemp())
    reqs = _requests(work, args, "r")
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
