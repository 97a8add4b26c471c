"""A grid of runs (algorithms x seeds x T0 x alpha) in one process, data loaded once.

For FedFrozen with several warm-up lengths the warm-up is trained once: the run with the
largest T0 keeps a snapshot at every requested T0, and each other T0 branches its frozen stage
from that snapshot (stage 1 of FedFrozen is FedAvg whatever T0 is, so the branch is exactly
the run it replaces, metrics rows included).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from linattn.errors import ConfigError
from real_data import rundir
from real_data.algorithms import get_algorithm
from real_data.config import Config, Named, build_dataclass
from real_data.runs import RunResult, load_data, make_partition_for, start_run
from real_data.stacked_runs import (
    Branch,
    RunRequest,
    group_for_device,
    run_group,
    stack_pad_mode,
)


def _algorithm_section(cfg: Config, name: str, warmup_rounds: int | None) -> Named:
    params_cls = get_algorithm(name).Params
    base = dataclasses.asdict(cfg.algorithm.params) if cfg.algorithm.name == name else {}
    if name == "fedfrozen" and warmup_rounds is not None:
        base = {**base, "warmup_rounds": warmup_rounds, "warmup": "fixed"}
    return Named(name, build_dataclass(params_cls, base, "algorithm"))


def plan_sweep(cfg: Config, algorithms, seeds, warmup_rounds, alphas) -> list[dict]:
    """Every run of the grid as ``{"cfg", "alpha", "seed", "algorithm", "t0s"}``; checks all.

    ``t0s`` lists the warm-up lengths served by one FedFrozen run (largest first).
    """
    plan = []
    for alpha in alphas or [cfg.partition.alpha]:
        for seed in seeds or [cfg.seed]:
            part = dataclasses.replace(cfg.partition, alpha=alpha)
            for name in algorithms or [cfg.algorithm.name]:
                t0s = sorted(set(warmup_rounds), reverse=True) if (
                    name == "fedfrozen" and warmup_rounds) else [None]
                for t0 in t0s:
                    if t0 is not None and t0 > cfg.train.rounds:
                        raise ConfigError(f"--warmup-rounds {t0} exceeds train.rounds="
                                          f"{cfg.train.rounds}")
                section = _algorithm_section(cfg, name, t0s[0])
                if (getattr(section.params, "needs_validation", False)
                        and part.validation_fraction is None):
                    raise ConfigError(
                        f"--algorithms {name}: algorithm.warmup={section.params.warmup} reads "
                        "the validation split; set partition.validation_fraction (e.g. 0.1), "
                        "or give FedFrozen a fixed T0 (--warmup-rounds)")
                c = dataclasses.replace(cfg, seed=seed, partition=part, algorithm=section)
                plan.append({"cfg": c, "alpha": alpha, "seed": seed, "algorithm": name,
                             "t0s": t0s})
    return plan


def run_sweep(cfg: Config, out: Path, algorithms=(), seeds=(), warmup_rounds=(),
              alphas=(), stack: bool = True) -> list[RunResult]:
    """Run the grid; writes one run directory per point and ``out/sweep.csv``.

    ``stack``: train the grid's runs together in stacked groups
    (:mod:`real_data.stacked_runs`; the same results, one engine call per round for all of a
    group's clients); ``False`` trains one run after another.
    """
    plan = plan_sweep(cfg, list(algorithms), list(seeds), list(warmup_rounds), list(alphas))
    dataset = load_data(cfg)
    partitions = {}
    for item in plan:  # check every partition before anything is written
        key = (item["alpha"], item["seed"])
        if key not in partitions:
            partitions[key] = make_partition_for(item["cfg"], dataset)
    if stack:
        stack_pad_mode()  # a bad LINATTN_STACK_PAD stops before anything is written
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    index = rundir.CsvAppender(out / "sweep.csv", "run_dir,algorithm,seed,alpha,warmup_rounds,"
                               "status,final_test_acc,best_test_acc\n")
    results = []
    if stack:
        requests = []
        for i, item in enumerate(plan):
            c, t0s = item["cfg"], item["t0s"]
            c = dataclasses.replace(c, run=dataclasses.replace(c.run, out_dir=str(out)))
            branches = tuple(
                Branch(t0, dataclasses.replace(c, algorithm=_algorithm_section(c, "fedfrozen",
                                                                               t0)),
                       None, (i, t0)) for t0 in t0s[1:])
            requests.append(RunRequest(None, c, False, tuple(t for t in t0s if t is not None),
                                       branches, partitions[(item["alpha"], item["seed"])],
                                       (i, t0s[0])))
        done = {}
        for group in group_for_device(requests, dataset):
            done.update(dict(run_group(group, dataset=dataset)))
        for i, item in enumerate(plan):
            for t0 in item["t0s"]:
                if (i, t0) in done:
                    res = done[(i, t0)]
                    _index(index, res, item, t0)
                    results.append(res)
        return results
    for item in plan:
        c, t0s = item["cfg"], item["t0s"]
        c = dataclasses.replace(c, run=dataclasses.replace(c.run, out_dir=str(out)))
        part = partitions[(item["alpha"], item["seed"])]
        first = start_run(c, dataset=dataset, partition=part,
                          snapshot_rounds=tuple(t for t in t0s if t is not None))
        done = [(t0s[0], first)]
        for t0 in t0s[1:]:
            ct = dataclasses.replace(c, algorithm=_algorithm_section(c, "fedfrozen", t0))
            snap = first.run_dir / "checkpoints" / f"round_{t0}.pt"
            done.append((t0, start_run(ct, dataset=dataset, partition=part, branch=snap)))
        for t0, res in done:
            _index(index, res, item, t0)
            results.append(res)
    return results


def _index(index, res: RunResult, item: dict, t0) -> None:
    s = res.summary
    index.append([(res.run_dir.name, item["algorithm"], item["seed"], item["alpha"],
                   "" if t0 is None else t0, res.status, s["final"].get("test_acc", ""),
                   s["best"].get("test_acc", {}).get("value", ""))])
