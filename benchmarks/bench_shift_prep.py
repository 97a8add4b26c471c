"""Preparation of a study's stacked group: seconds from the group's start to its first round.

Builds the stacked group a study worker starts first (``--plan``, ``--stage final`` with
``--choices``, ``--shard k/n``; the first ``--runs`` run groups of the shard) and runs
:func:`real_data.stacked_runs.run_group` up to its first engine call, which it does not make.
Prints one JSON row: the runs, the preparation seconds (in all and per run), the shifted data
sets built (:func:`real_data.data.shift.apply_shift` calls), the distinct training tensors the
runs index, and the engine calls the first round would take (runs on different training
tensors cannot share one, :func:`real_data.stacking.compatible`), and the distinct fast-engine
setups among those calls: on CUDA each setup is one cached runner with its CUDA graph, and
the engine keeps ``fast._CACHE_SIZE`` of them, so a round of more setups than that captures
a graph in every call, every round.

Usage (``LINATTN_DATA`` as for the study; the run directories go to a temporary folder)::

    PYTHONPATH=. python benchmarks/bench_shift_prep.py --plan shift_fmnist \\
        --choices docs/study/shift_fmnist/choices.json --shard 0/2 [--runs 10] [--threads 2] \\
        [--set train.rounds=2] [--no-test]

``--set KEY=VALUE`` (repeatable) overrides every run's config, e.g. ``train.rounds=2``;
``--no-test`` evaluates the validation split instead of the test splits, as the tuning stage
does (``eval.test=false``, ``partition.validation_fraction=0.2``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time


class _FirstRound(Exception):
    """Raised at the group's first engine call: the preparation is over."""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plan", default="shift_fmnist")
    ap.add_argument("--choices", default="docs/study/shift_fmnist/choices.json")
    ap.add_argument("--shard", default="0/2")
    ap.add_argument("--runs", type=int, help="only the shard's first RUNS run groups")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--no-test", action="store_true")
    args = ap.parse_args(argv)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    import real_data.data.shift as shift_mod
    import real_data.stacked_runs as sr
    from real_data import study
    from real_data.study import plan as plan_mod
    from real_data.study import runner

    extra = list(args.set) + (["eval.test=false", "partition.validation_fraction=0.2"]
                              if args.no_test else [])
    if extra:
        from real_data.config import load_config

        def run_config(spec, t0):
            return load_config(spec.sweep.config, [*plan_mod.run_overrides(spec, t0), *extra])

        runner.run_config = run_config
    calls = {"apply_shift": 0}
    real_apply = shift_mod.apply_shift

    def counted_apply(*a, **k):
        calls["apply_shift"] += 1
        return real_apply(*a, **k)

    shift_mod.apply_shift = counted_apply
    seen: dict = {}

    def first_round(jobs, engines, stacked, pad_clients=None):
        from real_data.stacking import compatible, stackable

        groups: list = []
        for j in jobs:
            if not stackable(j):
                groups.append([j])
                continue
            for g in groups:
                if stackable(g[0]) and compatible(g[0], j):
                    g.append(j)
                    break
            else:
                groups.append([j])
        seen["engine_calls"] = len(groups)
        from real_data.engines import fast
        from real_data.engines.fast_setup import make_setup
        from real_data.stacking import stack_jobs

        setups = {make_setup(g[0] if len(g) == 1 else stack_jobs(g), True, False)
                  for g in groups if stackable(g[0])}
        seen["engine_setups"] = len(setups)
        seen["runner_cache"] = fast._CACHE_SIZE
        seen["train_tensors"] = len({id(j.x) for j in jobs})
        raise _FirstRound

    sr.train_jobs = first_round
    with tempfile.TemporaryDirectory() as out:
        full = study.load_plan(args.plan, out)
        plan = study.final_plan(full, study.load_choices(args.choices, full))
        groups: dict = {}
        for s in study.plan_runs(plan):
            groups.setdefault((s.sweep.name, s.arm.name, s.alpha, s.seed), []).append(s)
        k, n = (int(v) for v in args.shard.split("/"))
        todo = runner.shard_groups(list(groups.values()), (k, n))[:args.runs]
        batch = runner._stack_batches(todo, 64)[0]
        counts = dict.fromkeys(("skipped", "resumed", "started", "branched", "left",
                                "diverged", "failed"), 0)
        t0 = time.perf_counter()
        try:
            runner._run_stacked(batch, counts, lambda line: None)
        except _FirstRound:
            pass
        seconds = time.perf_counter() - t0
    runs = sum(map(len, batch))
    row = {"plan": args.plan, "shard": args.shard, "runs": runs, "set": extra,
           "threads": torch.get_num_threads(), "prepare_s": round(seconds, 3),
           "per_run_s": round(seconds / max(runs, 1), 3),
           "shifted_built": calls["apply_shift"], **seen}
    print(json.dumps(row))
    return row


if __name__ == "__main__":
    main()
