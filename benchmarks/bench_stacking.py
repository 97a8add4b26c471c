"""A real sweep run two ways on one GPU: runs one by one in worker processes, and stacked.

The sweep (default): Fashion-MNIST ViT (the study's ``fmnist_vit``, softmax attention), Dirichlet
alpha 0.1, 3 seeds x (FedAvg + FedFrozen value-only and all-but-Q/K at 7 warm-up lengths):
45 runs. Both ways run ``linattn study`` on the same plan in fresh folders:

- per run: ``--no-stack`` in ``--workers`` processes side by side (``--shard k/n``), each run
  trained alone, T0 branches forked from their family's snapshots;
- stacked: one process, every family in one stacked group;
- with ``--live-pad``, stacked again with ``LINATTN_STACK_PAD=live``
  (:func:`real_data.stacked_runs.run_group`'s ``pad``), the wall-time ratio to the first, and
  ``live_pad_in_effect``: false where the group compiled (a compiled group pads to its whole
  membership either way, so the ratio is then the compilation cache's: give fewer than 2,000
  run-rounds, e.g. ``--rounds 40``, for an eager group).

Reported per way: wall seconds from launch to the last run's summary, completed runs per
GPU-hour, and for the stacked way the effective TFLOP/s (the runs' summed training FLOPs over
its wall time) and the peak GPU memory. Per run, the stacked and the per-run results are
compared: the first round's training loss (one round of bf16 training from the same start, the
GPU agreement tests' 2e-2) and the final test accuracy (a bf16 trajectory over many rounds;
reported, not asserted).

``--slices`` adds the projection of a whole study plan (``--plan main``): each of its sweeps
runs a slice (one seed, one alpha, every arm but the pretrained-FedSQ ones, ``--slice-rounds``
rounds with the arms' T0 grids scaled to them) stacked, and the plan's GPU time is the slices'
seconds per run-round times the plan's run-rounds, sweep by sweep.

Usage (data: ``LINATTN_DATA`` with the packed data sets, ``linattn data pack``)::

    python benchmarks/bench_stacking.py --out docs/bench/stacking.json
    python benchmarks/bench_stacking.py --skip-sweep --slices --out docs/bench/stacking_plan.json

The JSON holds the arguments, device, library versions, per-run rows and this file's source.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from linattn.fileio import atomic_write_json


def _plan(out_dir: Path, config: str, rounds: int, t0s: list[int], seeds: list[int],
          alpha: float, extra: list[str]) -> dict:
    over = [f"train.rounds={rounds}", "model.attention=softmax", "run.plot=false",
            "run.progress=false", *extra]
    return {"name": "bench_stacking", "out_dir": str(out_dir), "seeds": seeds,
            "sweeps": [{"name": "fmnist", "config": config, "overrides": over,
                        "alphas": [alpha],
                        "arms": [{"name": "fedavg", "overrides": ["algorithm.name=fedavg"]},
                                 {"name": "fedfrozen_v",
                                  "overrides": ["algorithm.name=fedfrozen",
                                                "algorithm.train=v"],
                                  "warmup_rounds": t0s},
                                 {"name": "fedfrozen_all",
                                  "overrides": ["algorithm.name=fedfrozen",
                                                "algorithm.train=all_but_qk"],
                                  "warmup_rounds": t0s}]}]}


def _study(plan: Path, *args: str, pad: str = "group") -> subprocess.Popen:
    cmd = [sys.executable, "-m", "linattn", "study", "--plan", str(plan), "--no-tables", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "LINATTN_STACK_PAD": pad})


def _timed(procs: list[subprocess.Popen]) -> tuple[float, list[str]]:
    start = time.perf_counter()
    logs = [p.communicate()[0] for p in procs]
    wall = time.perf_counter() - start
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise SystemExit(f"study failed ({p.returncode}):\n{log[-3000:]}")
    return wall, logs


def _runs(root: Path) -> dict[str, dict]:
    out = {}
    for summary in sorted(root.rglob("summary.json")):
        run = summary.parent
        rows = list(csv.DictReader(open(run / "metrics.csv")))
        glob = [r for r in rows if r["client"] == "global"]
        first = next(float(r["value"]) for r in glob if r["metric"] == "train_loss")
        flops = sum(float(r["value"]) for r in glob if r["metric"] == "train_flops")
        s = json.loads(summary.read_text())
        out[str(run.relative_to(root))] = {
            "status": s["status"], "first_train_loss": first, "train_flops": flops,
            "final_test_acc": s["final"].get("test_acc"),
            "peak_memory_bytes": s.get("peak_memory_bytes")}
    return out


def sweep(args, work: Path) -> dict:
    """The sweep both ways; returns the comparison."""
    t0s = [int(t) for t in args.t0.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    result = {}
    for way in ("alone", "stacked", *(("stacked_live",) if args.live_pad else ())):
        plan = work / f"{way}.yaml"
        plan.write_text(yaml.safe_dump(_plan(work / way, args.config, args.rounds, t0s, seeds,
                                             args.alpha, args.override)))
        if way == "alone":
            if args.alone_seeds:  # a subset of whole seeds: the same runs, fewer of them
                plan.write_text(yaml.safe_dump(_plan(
                    work / way, args.config, args.rounds, t0s,
                    [int(s) for s in args.alone_seeds.split(",")], args.alpha, args.override)))
            wall, _ = _timed([_study(plan, "--no-stack", "--shard", f"{k}/{args.workers}")
                              for k in range(args.workers)])
        else:
            wall, logs = _timed([_study(plan, pad="live" if way == "stacked_live" else "group")])
            result[f"{way}_compiled"] = any("compiled engine" in log for log in logs)
        runs = _runs(work / way)
        result[way] = {"wall_s": wall, "runs": runs, "completed": sum(
            r["status"] == "completed" for r in runs.values())}
        result[way]["runs_per_gpu_hour"] = result[way]["completed"] / (wall / 3600)
        print(f"{way:8s} {len(runs)} runs in {wall:.1f} s: "
              f"{result[way]['runs_per_gpu_hour']:.0f} runs per GPU-hour", flush=True)
    alone, stacked = result["alone"], result["stacked"]
    flops = sum(r["train_flops"] for r in stacked["runs"].values())
    stacked["effective_tflops"] = flops / stacked["wall_s"] / 1e12
    stacked["peak_memory_gib"] = max((r["peak_memory_bytes"] or 0)
                                     for r in stacked["runs"].values()) / 2**30
    pairs = [(alone["runs"][k], stacked["runs"][k]) for k in alone["runs"]
             if k in stacked["runs"]]
    loss_rel = [abs(a["first_train_loss"] - s["first_train_loss"]) / abs(a["first_train_loss"])
                for a, s in pairs]
    acc = [abs(a["final_test_acc"] - s["final_test_acc"]) for a, s in pairs
           if a["final_test_acc"] is not None and s["final_test_acc"] is not None]
    result["comparison"] = {
        "runs_compared": len(pairs),
        "speedup_runs_per_gpu_hour": stacked["runs_per_gpu_hour"] / alone["runs_per_gpu_hour"],
        "first_train_loss_max_rel_diff": max(loss_rel),
        "final_test_acc_mean_abs_diff": sum(acc) / len(acc),
        "final_test_acc_max_abs_diff": max(acc)}
    if "stacked_live" in result:  # the same group, calls padded to each round's runs
        live = result["stacked_live"]
        # a compiled group pads to its whole membership either way (run_group's ``pad``):
        # then the two groups run the same calls and their ratio is the compilation cache's
        # (the second group reuses the first's kernels) and noise, not the padding's
        in_effect = not result["stacked_live_compiled"]
        result["comparison"]["live_pad_in_effect"] = in_effect
        if not in_effect:
            from real_data.stacked_runs import COMPILE_PAYS_RUN_ROUNDS

            print("both stacked groups compiled: live padding not in effect, the ratio below "
                  f"is the compilation cache's; rerun with fewer than {COMPILE_PAYS_RUN_ROUNDS:,} "
                  "run-rounds (e.g. --rounds 40) for an eager group", flush=True)
        result["comparison"]["live_pad_speedup"] = stacked["wall_s"] / live["wall_s"]
        result["comparison"]["live_pad_first_train_loss_max_rel_diff"] = max(
            abs(s["first_train_loss"] - live["runs"][k]["first_train_loss"])
            / abs(s["first_train_loss"]) for k, s in stacked["runs"].items()
            if k in live["runs"])
    print(json.dumps(result["comparison"], indent=1), flush=True)
    print(f"effective {stacked['effective_tflops']:.1f} TFLOP/s, peak "
          f"{stacked['peak_memory_gib']:.1f} GiB", flush=True)
    return result


def slices(args, work: Path) -> dict:
    """Stacked slices of every sweep of a plan, and the plan's projected GPU time."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from real_data import study

    plan = study.load_plan(args.plan)
    out = {"sweeps": {}}
    total = 0.0
    for sw in plan.sweeps:
        arms = [a for a in sw.arms if "pretrained=" not in " ".join(a.overrides)
                or "pretrained=null" in " ".join(a.overrides)]
        rounds = args.slice_rounds
        scale = rounds / max(1, max((t for a in arms for t in a.warmup_rounds), default=1))
        data = {"name": f"slice_{sw.name}", "out_dir": str(work / f"slice_{sw.name}"),
                "seeds": [0], "sweeps": [{
                    "name": sw.name, "config": sw.config,
                    "overrides": [*sw.overrides, f"train.rounds={rounds}", "run.progress=false"],
                    "alphas": list(sw.alphas[:1]) if sw.alphas else None,
                    "arms": [{"name": a.name, "overrides": [
                        _scaled(o, rounds) for o in a.overrides],
                        "reference": a.reference,
                        **({"warmup_rounds": sorted({min(rounds, round(t * scale))
                                                     for t in a.warmup_rounds})}
                           if a.warmup_rounds else {})} for a in arms]}]}
        if data["sweeps"][0]["alphas"] is None:
            del data["sweeps"][0]["alphas"]
        path = work / f"slice_{sw.name}.yaml"
        path.write_text(yaml.safe_dump(data))
        wall, _ = _timed([_study(path)])
        sl = study.load_plan(path)
        slice_rr = sum(_run_rounds(s) for s in study.plan_runs(sl))
        plan_rr = sum(_run_rounds(s) for s in study.plan_runs(plan) if s.sweep.name == sw.name)
        sec = wall / slice_rr * plan_rr
        total += sec
        out["sweeps"][sw.name] = {"slice_wall_s": wall, "slice_run_rounds": slice_rr,
                                  "plan_run_rounds": plan_rr, "projected_s": sec}
        print(f"{sw.name}: slice {wall:.1f} s for {slice_rr} run-rounds -> plan "
              f"{plan_rr} run-rounds: {sec / 60:.1f} GPU-minutes", flush=True)
    out["projected_gpu_minutes"] = total / 60
    print(f"projected: {total / 60:.1f} GPU-minutes", flush=True)
    return out


def _scaled(override: str, rounds: int) -> str:
    """A fixed ``algorithm.warmup_rounds=N`` override scaled into a slice of ``rounds``."""
    key, _, value = override.partition("=")
    if key == "algorithm.warmup_rounds" and value.isdigit():
        return f"{key}={max(1, rounds // 10)}"
    return override


def _run_rounds(spec) -> int:
    """Rounds a run trains itself: a T0 branch starts from its family's snapshot."""
    from real_data import study

    total = study.run_config(spec, spec.warmup_rounds).train.rounds
    branch = spec.arm.warmup_rounds and spec.warmup_rounds != max(spec.arm.warmup_rounds)
    return total - (spec.warmup_rounds or 0) if branch else total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python benchmarks/bench_stacking.py",
                                 description="A sweep run one by one and stacked, one GPU.")
    ap.add_argument("--config", default="fmnist_vit", help="run config (default fmnist_vit)")
    ap.add_argument("--rounds", type=int, default=100,
                    help="rounds per run (default 100, the config's)")
    ap.add_argument("--t0", default="0,10,20,30,40,60,80", help="FedFrozen's T0 grid")
    ap.add_argument("--seeds", default="0,1,2", help="seeds (default 0,1,2)")
    ap.add_argument("--alone-seeds", default="",
                    help="train only these seeds' runs one by one (default: every seed); "
                    "runs per GPU-hour compare the two ways' rates")
    ap.add_argument("--alpha", type=float, default=0.1, help="Dirichlet alpha (default 0.1)")
    ap.add_argument("--workers", type=int, default=2,
                    help="per-run worker processes side by side (default 2)")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                    help="extra config override for every run (repeatable)")
    ap.add_argument("--live-pad", action="store_true",
                    help="also run the stacked way with LINATTN_STACK_PAD=live (an eager "
                    "group's calls padded to each round's runs, not to the group's largest "
                    "membership; a compiled group pads to the group either way)")
    ap.add_argument("--skip-sweep", action="store_true", help="only the plan projection")
    ap.add_argument("--slices", action="store_true", help="project a plan's GPU time")
    ap.add_argument("--plan", default="main", help="plan to project (default main)")
    ap.add_argument("--slice-rounds", type=int, default=10, help="rounds per slice run")
    ap.add_argument("--out", type=Path, help="write the JSON here")
    args = ap.parse_args(argv)
    import torch

    data = {"args": vars(args) | {"out": str(args.out)},
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "torch": torch.__version__, "source": Path(__file__).read_text()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(os.environ.get("BENCH_WORK", tmp))
        work.mkdir(parents=True, exist_ok=True)
        if not args.skip_sweep:
            data["sweep"] = sweep(args, work)
        if args.slices:
            data["plan"] = slices(args, work)
    if args.out:
        atomic_write_json(args.out, data, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
