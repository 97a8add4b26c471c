"""The real-data validation study: a plan of sweeps, run resumably in slices, then aggregated.

A plan (YAML, ``real_data/studies/<name>.yaml``)::

    name: main
    out_dir: runs/study-main          # every run directory lives under here
    seeds: [0, 1, 2]
    sweeps:
      - name: fmnist_softmax
        config: fmnist_vit           # a shipped config name or a YAML path
        overrides: [train.rounds=200, model.attention=softmax]
        alphas: [0.1, 0.3, 1.0]      # partition.alpha values (omit for natural splits)
        arms:
          - {name: fedavg, overrides: [algorithm.name=fedavg]}
          - {name: fedfrozen_v, overrides: [algorithm.name=fedfrozen, algorithm.train=v],
             warmup_rounds: [0, 10, 20, 40, 80, 120, 200]}
          - {name: reference, overrides: [partition.scheme=iid, partition.num_clients=1],
             reference: true}

Each run has a fixed directory ``out_dir/<sweep>/<arm>[-T0=<t>]/alpha=<a>/seed=<s>``, so the
study knows what exists: a completed run is skipped, an interrupted one resumed from its last
checkpoint, a missing one started. An arm with ``warmup_rounds`` trains the warm-up once (the
largest T0, keeping a snapshot at every T0) and branches every other T0 from its snapshot. A
``reference`` arm (a drift-free run, e.g. one client holding the pooled data) keeps snapshots at
every T0 of its sweep, so the Q/K kernel deviation of FedFrozen's warm-up from it can be
measured. ``--slice`` selects runs by a glob over ``<sweep>/<arm>/alpha=<a>/seed=<s>`` so a large
plan splits into GPU calls of under 10 minutes each; ``--budget`` stops starting new runs after
that many seconds; ``--shard k/n`` takes the k-th of n cost-balanced parts of the selection, so n
workers (one or more per GPU) run one plan side by side without touching the same run.

A plan may name central pretraining jobs (FedSQ's transfer initialization) under ``pretrain``;
each writes ``<out_dir>/pretrained/<name>.pt`` before any selected run that needs it starts, and
``{out_dir}`` in an override is replaced by the plan's output folder::

    pretrain:
      - {name: mnist_softmax, config: fmnist_vit_fedsq, source: mnist, epochs: 3,
         overrides: [model.attention=softmax]}
    # an arm then uses  algorithm.pretrained={out_dir}/pretrained/mnist_softmax.pt

Aggregation reads every run's ``metrics.csv`` and ``summary.json`` and writes, per sweep, arm,
T0 and alpha: mean +- std over seeds (with the number of seeds) of final and best accuracy,
rounds-to-best, the accuracy variance over the last rounds, personalized accuracy, the
gradient-norm jump after aggregation, Q/K kernel deviation from the reference, bytes sent and
training FLOPs.
"""

from __future__ import annotations

import csv
import dataclasses
import fnmatch
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from linattn.configio import load_yaml
from linattn.errors import ConfigError, UserError
from linattn.fileio import atomic_path, atomic_write_text

LAST_ROUNDS = 10  # window for the accuracy variance: the last 10 evaluations (eval.every apart)


@dataclass(frozen=True)
class Arm:
    """One algorithm setting of a sweep; ``warmup_rounds`` makes it a T0 sweep (FedFrozen)."""

    name: str
    overrides: tuple[str, ...] = ()
    warmup_rounds: tuple[int, ...] = ()
    reference: bool = False


@dataclass(frozen=True)
class Sweep:
    name: str
    config: str
    overrides: tuple[str, ...]
    alphas: tuple[float | None, ...]
    arms: tuple[Arm, ...]
    seeds: tuple[int, ...]


@dataclass(frozen=True)
class PretrainJob:
    """One central pretraining (``linattn pretrain``) the plan's runs load."""

    name: str
    config: str
    source: str
    overrides: tuple[str, ...] = ()
    epochs: int = 3
    exclude_largest_groups: int = 0
    seed: int = 0


@dataclass(frozen=True)
class Plan:
    name: str
    out_dir: Path
    sweeps: tuple[Sweep, ...]
    pretrain: tuple[PretrainJob, ...] = ()

    def pretrained_path(self, job: PretrainJob) -> Path:
        return self.out_dir / "pretrained" / f"{job.name}.pt"


@dataclass(frozen=True)
class RunSpec:
    """One run of the plan (T0 sweeps: one spec per T0, the largest first)."""

    key: str
    sweep: Sweep
    arm: Arm
    alpha: float | None
    seed: int
    warmup_rounds: int | None
    run_dir: Path


def _require(cond: bool, where: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{where}: {message}")


def _strings(value, where: str) -> tuple[str, ...]:
    _require(isinstance(value, list) and all(isinstance(v, str) for v in value), where,
             "must be a list of key=value strings")
    return tuple(value)


def load_plan(path: Path | str, out_dir: Path | str | None = None) -> Plan:
    """Read and check a plan file; every error names the key and the allowed values."""
    path = Path(path)
    if not path.is_file():
        shipped = Path(__file__).parent / "studies" / (path.name if path.suffix else
                                                       f"{path}.yaml")
        _require(shipped.is_file(), "--plan", f"{path} not found (nor {shipped})")
        path = shipped
    try:
        raw = load_yaml(path) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc})") from None
    _require(isinstance(raw, dict), str(path), "must be a mapping")
    unknown = set(raw) - {"name", "out_dir", "seeds", "sweeps", "pretrain", "common_arms"}
    _require(not unknown, str(path), f"unknown keys {sorted(unknown)}; allowed: name, out_dir, "
             "seeds, sweeps, pretrain, common_arms (YAML anchors only)")
    seeds = raw.get("seeds", [0])
    _require(isinstance(seeds, list) and seeds and all(isinstance(s, int) for s in seeds),
             "seeds", "must be a non-empty list of integers")
    sweeps = []
    _require(isinstance(raw.get("sweeps"), list) and raw["sweeps"], "sweeps",
             "must be a non-empty list")
    for i, sw in enumerate(raw["sweeps"]):
        where = f"sweeps[{i}]"
        _require(isinstance(sw, dict), where, "must be a mapping")
        bad = set(sw) - {"name", "config", "overrides", "alphas", "arms", "seeds"}
        _require(not bad, where, f"unknown keys {sorted(bad)}; allowed: name, config, "
                 "overrides, alphas, arms, seeds")
        for key in ("name", "config", "arms"):
            _require(key in sw, where, f"missing {key!r}")
        alphas = sw.get("alphas", [None])
        _require(isinstance(alphas, list) and all(a is None or (isinstance(a, int | float)
                                                               and a > 0) for a in alphas),
                 f"{where}.alphas", "must be a list of positive numbers")
        arms = []
        for j, arm in enumerate(sw["arms"]):
            aw = f"{where}.arms[{j}]"
            _require(isinstance(arm, dict) and "name" in arm, aw, "must be a mapping with a name")
            bad = set(arm) - {"name", "overrides", "warmup_rounds", "reference"}
            _require(not bad, aw, f"unknown keys {sorted(bad)}; allowed: name, overrides, "
                     "warmup_rounds, reference")
            t0s = arm.get("warmup_rounds", [])
            _require(isinstance(t0s, list) and all(isinstance(t, int) and t >= 0 for t in t0s),
                     f"{aw}.warmup_rounds", "must be a list of integers >= 0")
            arms.append(Arm(arm["name"], _strings(arm.get("overrides", []), f"{aw}.overrides"),
                            tuple(sorted(set(t0s), reverse=True)), bool(arm.get("reference"))))
        names = [a.name for a in arms]
        _require(len(set(names)) == len(names), f"{where}.arms", "arm names must be unique")
        sweeps.append(Sweep(sw["name"], str(sw["config"]),
                            _strings(sw.get("overrides", []), f"{where}.overrides"),
                            tuple(alphas), tuple(arms), tuple(sw.get("seeds", seeds))))
    jobs = []
    _require(isinstance(raw.get("pretrain", []), list), "pretrain", "must be a list")
    fields = {"name", "config", "source", "overrides", "epochs", "exclude_largest_groups", "seed"}
    for i, job in enumerate(raw.get("pretrain", [])):
        where = f"pretrain[{i}]"
        _require(isinstance(job, dict), where, "must be a mapping")
        bad = set(job) - fields
        _require(not bad, where,
                 f"unknown keys {sorted(bad)}; allowed: {', '.join(sorted(fields))}")
        for key in ("name", "config", "source"):
            _require(isinstance(job.get(key), str), where, f"missing {key!r} (a string)")
        for key, low in (("epochs", 1), ("exclude_largest_groups", 0), ("seed", 0)):
            value = job.get(key, low)
            _require(isinstance(value, int) and value >= low, f"{where}.{key}",
                     f"must be an integer >= {low}")
        jobs.append(PretrainJob(job["name"], job["config"], job["source"],
                                _strings(job.get("overrides", []), f"{where}.overrides"),
                                int(job.get("epochs", 3)),
                                int(job.get("exclude_largest_groups", 0)), int(job.get("seed", 0))))
    names = [j.name for j in jobs]
    _require(len(set(names)) == len(names), "pretrain", "job names must be unique")
    out = Path(out_dir or raw.get("out_dir", f"runs/study-{raw.get('name', path.stem)}"))
    return Plan(str(raw.get("name", path.stem)), out, tuple(sweeps), tuple(jobs))


def _key(sweep: str, arm: str, t0, alpha, seed) -> str:
    arm_part = arm if t0 is None else f"{arm}-T0={t0}"
    alpha_part = "natural" if alpha is None else f"alpha={alpha:g}"
    return f"{sweep}/{arm_part}/{alpha_part}/seed={seed}"


def plan_runs(plan: Plan) -> list[RunSpec]:
    specs = []
    for sw in plan.sweeps:
        for arm in sw.arms:
            for alpha in sw.alphas:
                for seed in sw.seeds:
                    for t0 in arm.warmup_rounds or (None,):
                        key = _key(sw.name, arm.name, t0, alpha, seed)
                        specs.append(RunSpec(key, sw, arm, alpha, seed, t0, plan.out_dir / key))
    return specs


def _overrides(spec: RunSpec, t0: int | None) -> list[str]:
    extra = [f"seed={spec.seed}", "run.progress=false"]
    if spec.alpha is not None:
        extra.append(f"partition.alpha={spec.alpha}")
    if t0 is not None:
        extra += [f"algorithm.warmup_rounds={t0}", "algorithm.warmup=fixed"]
    out_dir = str(spec.run_dir.parents[3])  # run_dir = out_dir/<sweep>/<arm>/<alpha>/<seed>
    return [o.replace("{out_dir}", out_dir)
            for o in (*spec.sweep.overrides, *spec.arm.overrides, *extra)]


def _config(spec: RunSpec, t0: int | None):
    from real_data.config import load_config

    return load_config(spec.sweep.config, _overrides(spec, t0))


def _run_rounds(spec: RunSpec) -> int:
    """Rounds the run trains itself (a T0 branch only trains after its snapshot)."""
    return int(_config(spec, None).train.rounds)


def _group_cost(members: list[RunSpec], pace: dict | None = None,
                skip: frozenset = frozenset()) -> float:
    """Rounds the group trains, times the seconds per round measured for its (sweep, arm)
    where ``pace`` has them (:func:`measured_pace`; an arm not yet run in this sweep takes the
    sweep's median times the arm's ratio measured elsewhere); without ``pace`` one unit per
    round (a reference round, one client, 0.3). Members whose key is in ``skip`` (finished)
    cost nothing."""
    rounds = _run_rounds(members[0])
    cost = (0 if members[0].key in skip else rounds) + sum(
        rounds - (m.warmup_rounds or 0) for m in members[1:] if m.key not in skip)
    head = members[0]
    if pace:
        per_round = pace.get((head.sweep.name, head.arm.name))
        if per_round is None:  # the sweep's (or overall) median, times the arm's measured
            # ratio to its sweep's median in the other sweeps (FedSQ ~2.3x, SCAFFOLD ~1.6x)
            base = pace.get(head.sweep.name, pace["*"])
            per_round = base * pace.get(("*", head.arm.name),
                                        0.3 if head.arm.reference else 1.0)
        return cost * per_round
    return cost * (0.3 if head.arm.reference else 1.0)  # one client: a fraction of a round


def measured_pace(specs: list[RunSpec], before: float | None = None) -> dict:
    """Median GPU seconds per round of the completed runs, by (sweep, arm), by sweep and
    overall (``"*"``), and each arm's median ratio to its sweep's median (``("*", arm)``, for
    an arm not yet run in some sweep); empty when none ran on a GPU. CPU runs are left out."""
    by_arm: dict[tuple, list[float]] = {}
    for s in specs:
        if not _finished_before(s.run_dir, before):
            continue
        info = json.loads((s.run_dir / "summary.json").read_text())
        sec = info.get("seconds_per_round")
        if info.get("status") != "completed" or not sec or \
                info.get("device", {}).get("type") != "cuda":
            continue
        by_arm.setdefault((s.sweep.name, s.arm.name), []).append(float(sec))
    if not by_arm:
        return {}
    pace: dict = {k: float(np.median(v)) for k, v in by_arm.items()}
    for sweep in {k[0] for k in by_arm}:
        pace[sweep] = float(np.median([x for k, v in by_arm.items() if k[0] == sweep
                                       for x in v]))
    pace["*"] = float(np.median([x for v in by_arm.values() for x in v]))
    for arm in {k[1] for k in by_arm}:  # ("*", arm): the arm's pace relative to its sweeps'
        pace[("*", arm)] = float(np.median([pace[k] / pace[k[0]] for k in by_arm
                                            if k[1] == arm]))
    return pace


def shard_groups(groups: list[list[RunSpec]], shard: tuple[int, int],
                 pace: dict | None = None, skip: frozenset = frozenset()
                 ) -> list[list[RunSpec]]:
    """The ``k``-th of ``n`` parts of ``groups``, balanced by rounds, or by expected seconds
    with a ``pace`` (:func:`measured_pace`) (longest first, each to the least-loaded part;
    deterministic, so n workers given the same groups and pace split them alike).

    A part keeps the plan's sweep order and runs its longest groups of a sweep first, so a
    worker stopped by a time limit leaves the short groups of the last sweep it reached.
    """
    k, n = shard
    costs = [_group_cost(g, pace, skip) for g in groups]
    loads, owner = [0.0] * n, {}
    for i in sorted(range(len(groups)), key=lambda i: (-costs[i], i)):
        j = min(range(n), key=lambda j: (loads[j], j))
        loads[j] += costs[i]
        owner[i] = j
    sweep_order = {name: i for i, name in enumerate(dict.fromkeys(g[0].sweep.name
                                                                   for g in groups))}
    mine = [i for i in range(len(groups)) if owner[i] == k]
    mine.sort(key=lambda i: (sweep_order[groups[i][0].sweep.name], -costs[i], i))
    return [groups[i] for i in mine]


def ensure_pretrained(plan: Plan, specs: list[RunSpec], log=print,
                      shard: tuple[int, int] | None = None) -> list[Path]:
    """Run every pretraining job a selected run needs and that is missing; returns the files
    written. The file is written under a temporary name and renamed, so a killed job leaves
    nothing that looks finished. ``shard=(k, n)``: only the k-th of every n needed jobs."""
    from real_data.config import load_config
    from real_data.pretrain import PretrainSettings, run_pretrain

    wanted = {o for s in specs for o in _overrides(s, s.warmup_rounds)}
    written = []
    needed = [job for job in plan.pretrain
              if any(str(plan.pretrained_path(job)) in o for o in wanted)]
    if shard is not None:
        needed = needed[shard[0]::shard[1]]
    for job in needed:
        path = plan.pretrained_path(job)
        if path.is_file():
            continue
        log(f"pretrain {job.name} on {job.source} -> {path}")
        settings = PretrainSettings(job.source, epochs=job.epochs, seed=job.seed,
                                    exclude_largest_groups=job.exclude_largest_groups)
        with atomic_path(path) as tmp:  # a unique temporary per writer
            meta = run_pretrain(load_config(job.config, list(job.overrides)), settings, tmp)
        log(f"pretrain {job.name}: source test_acc {meta['source_test_acc']:.4f} "
            f"({meta['samples']} samples, {meta['wall_time_s']:.0f} s)")
        written.append(path)
    return written


def _finished_before(run_dir: Path, before: float | None) -> bool:
    """Final (completed or diverged) by ``before`` (a Unix time; None: now)."""
    summary = run_dir / "summary.json"
    if before is not None and summary.is_file() and summary.stat().st_mtime > before:
        return False
    return _status(run_dir) in FINAL


def _status(run_dir: Path) -> str:
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text()).get("status", "unknown")
    return "partial" if run_dir.exists() else "missing"


def run_study(plan: Plan, pattern: str | list[str] | None = None, max_runs: int | None = None,
              budget_s: float | None = None, log=print,
              shard: tuple[int, int] | None = None, pretrain_only: bool = False,
              deadline_s: float | None = None, pending: bool | float = False) -> dict:
    """Run what is missing, resume what was interrupted; returns counts by outcome (a run
    that fails is logged and counted under ``failed``; the others go on).

    ``shard=(k, n)``: only the k-th of n cost-balanced parts of the selected groups (the split
    ignores what is already done, so it never depends on when a worker starts).
    ``pending``: balance the shards over the groups not yet finished instead, each weighed by
    the GPU seconds per round measured for its arm in the finished runs (for workers that all
    start together on a machine given the finished groups as markers, so the work left is
    spread evenly). A Unix time freezes what counts as finished: runs whose summary.json was
    written after it count as unfinished, so workers that start a few seconds apart, while
    another one already finishes groups, still agree on the split (gpu_study.sh passes the
    time it launches them).
    ``deadline_s``: start a group only if it is expected to end within this many seconds of
    the start, at the pace of the groups run so far (before any: the measured pace when
    ``pending``, else the first group always starts); a group that would not fit is left for
    later and a shorter one tried.
    With ``pretrain_only`` and ``shard=(k, n)``, the k-th of every n pretraining jobs the
    whole selection needs is run (one process per GPU pretrains side by side).
    """

    patterns = [pattern] if isinstance(pattern, str) else list(pattern or [])
    specs = [s for s in plan_runs(plan)
             if not patterns or any(fnmatch.fnmatch(s.key, p) for p in patterns)]
    for p in patterns:
        if not any(fnmatch.fnmatch(s.key, p) for s in specs):
            raise ConfigError(f"--slice {p!r} matches no run of plan {plan.name!r}; "
                              "`linattn study --plan ... --list` shows the run keys")
    # check every config before anything runs, so a bad plan writes nothing
    for s in specs:
        _config(s, s.warmup_rounds)
    groups: dict[tuple, list[RunSpec]] = {}
    for s in specs:
        groups.setdefault((s.sweep.name, s.arm.name, s.alpha, s.seed), []).append(s)
    todo = list(groups.values())
    before = None if isinstance(pending, bool) else float(pending)
    done_then = frozenset(m.key for g in todo for m in g if _finished_before(m.run_dir, before)) \
        if pending is not False else frozenset()
    if pending is not False:
        todo = [g for g in todo if any(m.key not in done_then for m in g)]
    if pretrain_only:
        ensure_pretrained(plan, [m for g in todo for m in g
                                 if _status(m.run_dir) != "completed"], log, shard)
        return {"pretrained": sum(plan.pretrained_path(j).is_file() for j in plan.pretrain)}
    # pending: workers that start together see the same finished runs, so they may also
    # weigh each group by the seconds per round measured so far for its arm
    pace = measured_pace([m for g in groups.values() for m in g], before) \
        if pending is not False else None
    if shard is not None:
        # without pending, over the whole selection: workers started at any time agree on
        # the split, whatever the others have finished meanwhile
        todo = shard_groups(todo, shard, pace, done_then)
    ensure_pretrained(plan, [m for g in todo for m in g
                             if _status(m.run_dir) != "completed"], log)
    counts = {"skipped": 0, "resumed": 0, "started": 0, "branched": 0, "left": 0,
              "diverged": 0, "failed": 0}
    start, done = time.perf_counter(), 0
    spent, cost_done = 0.0, 0.0  # seconds and rounds of the groups run here (for deadline_s)
    for members in todo:
        now = time.perf_counter() - start
        finished = frozenset(m.key for m in members if _status(m.run_dir) in FINAL)
        todo_here = len(finished) < len(members)
        cost = _group_cost(members, pace, finished) if deadline_s is not None else 0.0
        # at the pace of the groups run here; before any, a measured pace is already seconds
        ratio = spent / cost_done if cost_done > 0 else (1.0 if pace else None)
        late = deadline_s is not None and ratio is not None and todo_here and \
            now + cost * ratio > deadline_s
        if (max_runs is not None and done >= max_runs) or (
                budget_s is not None and now > budget_s) or late:
            counts["left"] += sum(_status(m.run_dir) not in FINAL for m in members)
            continue
        t_group = time.perf_counter()
        try:
            _run_group(members, counts, log)
        except UserError:
            raise  # a mistake in the plan or its files (exit 2), not a broken run
        except Exception as exc:  # one broken run must not stop a worker's whole shard
            counts["failed"] += 1
            log(f"FAILED {members[0].key}: {type(exc).__name__}: {exc}")
        if todo_here:
            spent += time.perf_counter() - t_group
            cost_done += cost
        done += 1
    return counts


FINAL = ("completed", "diverged")  # a diverged run is a result (its status says so), not redone


def _run_group(members: list[RunSpec], counts: dict, log) -> None:
    """One T0 family (or a single run): the head, then every branch from its snapshots."""
    import shutil

    from real_data.runs import resume_run, start_run

    head = members[0]
    t0s = head.arm.warmup_rounds
    if head.arm.reference:
        t0s = tuple(sorted({t for a in head.sweep.arms for t in a.warmup_rounds}))
    snapshots = tuple(t for t in t0s if t is not None)
    status = _status(head.run_dir)
    if status in FINAL:
        counts["skipped" if status == "completed" else "diverged"] += 1
    elif status == "partial" and (head.run_dir / "checkpoints" / "last.pt").is_file():
        log(f"resume {head.key}")
        resume_run(head.run_dir)
        counts["resumed"] += 1
    else:
        if status == "partial":  # created but killed before its first checkpoint
            shutil.rmtree(head.run_dir)
        log(f"start  {head.key}")
        head.run_dir.parent.mkdir(parents=True, exist_ok=True)
        start_run(_config(head, head.warmup_rounds), out=head.run_dir,
                  snapshot_rounds=snapshots)
        counts["started"] += 1
    for m in members[1:]:  # the other T0 branch from the largest one's snapshots
        status = _status(m.run_dir)
        if status in FINAL:
            counts["skipped" if status == "completed" else "diverged"] += 1
            continue
        snap = head.run_dir / "checkpoints" / f"round_{m.warmup_rounds}.pt"
        if not snap.is_file():  # the head diverged before this T0
            log(f"no snapshot for {m.key} ({snap.name} missing): not run")
            counts["failed"] += 1
            continue
        if m.run_dir.exists():
            shutil.rmtree(m.run_dir)  # a branch is cheap to redo from its snapshot
        log(f"branch {m.key}")
        m.run_dir.parent.mkdir(parents=True, exist_ok=True)
        start_run(_config(m, m.warmup_rounds), out=m.run_dir, branch=snap)
        counts["branched"] += 1


# ----------------------------------------------------------------------------- aggregation


def _read_metrics(run_dir: Path) -> dict[str, np.ndarray]:
    """Global metrics as arrays indexed by round (1..R)."""
    series: dict[str, dict[int, float]] = {}
    with open(run_dir / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            if row["client"] != "global":
                continue
            series.setdefault(row["metric"], {})[int(row["round"])] = float(row["value"])
    out = {}
    for name, values in series.items():
        rounds = sorted(values)
        out[name] = np.array([values[r] for r in rounds])
        out[name + "@rounds"] = np.array(rounds)
    return out


def kernel_deviation(snapshot_a: Path, snapshot_b: Path, heads: int) -> float:
    """sqrt(sum over layers and heads of ||M_h - M'_h||_F^2), M_h = W_q[h]^T W_k[h].

    The kernel between tokens a and b in head h is a^T W_q[h]^T W_k[h] b (rows of the q and k
    projections split by head), so M_h is the attention kernel of THEORY.md per head.
    """
    import torch

    pa = torch.load(snapshot_a, map_location="cpu", weights_only=False)["global_params"]
    pb = torch.load(snapshot_b, map_location="cpu", weights_only=False)["global_params"]
    total = 0.0
    for name in sorted(pa):
        if not name.endswith("attn.q.weight"):
            continue
        kname = name[: -len("q.weight")] + "k.weight"
        for params in ((pa, pb),):
            qa, ka = params[0][name].double(), params[0][kname].double()
            qb, kb = params[1][name].double(), params[1][kname].double()
            for h in range(heads):
                rows = slice(h * qa.shape[0] // heads, (h + 1) * qa.shape[0] // heads)
                diff = qa[rows].T @ ka[rows] - qb[rows].T @ kb[rows]
                total += float((diff**2).sum())
    return float(np.sqrt(total))


def _run_row(spec: RunSpec) -> dict | None:
    if _status(spec.run_dir) != "completed":
        return None
    summary = json.loads((spec.run_dir / "summary.json").read_text())
    m = _read_metrics(spec.run_dir)
    acc = m.get("test_acc", np.array([np.nan]))
    best_i = int(np.nanargmax(acc))
    row = {
        "final_acc": float(acc[-1]),
        "best_acc": float(acc[best_i]),
        "rounds_to_best": int(m["test_acc@rounds"][best_i]) if "test_acc@rounds" in m else 0,
        "last_acc_var": float(np.var(acc[-LAST_ROUNDS:])),
        "personal_acc": float(m["local_acc_micro"][-1]) if "local_acc_micro" in m else np.nan,
        "grad_norm_jump": float(np.nanmean(m["grad_norm_jump"])) if "grad_norm_jump" in m
        else np.nan,
        "bytes_up": float(np.sum(m.get("bytes_up", [np.nan]))),
        "bytes_down": float(np.sum(m.get("bytes_down", [np.nan]))),
        "train_flops": float(np.sum(m.get("train_flops", [np.nan]))),
        "seconds_per_round": float(summary.get("seconds_per_round", np.nan)),
        "device": summary.get("device", {}).get("name", ""),
    }
    return row


def run_rows(plan: Plan) -> list[dict]:
    """One row per completed run: its sweep, arm, T0, alpha and seed, every run metric, and the
    kernel deviation of its warm-up snapshot from the reference of the same seed (None where
    there is no T0 or no reference snapshot). Runs of one seed share the initialization and the
    partition, so per-seed differences (:func:`paired_differences`) are paired."""
    out = []
    for spec in plan_runs(plan):
        row = _run_row(spec)
        if row is None:
            continue
        dev = _kernel_deviations(plan, spec.sweep.name, spec.arm.name, spec.warmup_rounds,
                                 spec.alpha, [spec])
        out.append({"sweep": spec.sweep.name, "arm": spec.arm.name,
                    "warmup_rounds": spec.warmup_rounds, "alpha": spec.alpha,
                    "seed": spec.seed, **row, "kernel_deviation": dev[0] if dev else None})
    return out


def aggregate(plan: Plan, runs: list[dict] | None = None) -> list[dict]:
    """One row per (sweep, arm, T0, alpha): mean, std and n over seeds of every run metric
    (``runs``: :func:`run_rows` of the plan, computed here when not given)."""
    cells: dict[tuple, list[dict]] = {}
    for r in run_rows(plan) if runs is None else runs:
        cells.setdefault((r["sweep"], r["arm"], r["warmup_rounds"], r["alpha"]), []).append(r)
    out = []
    for (sweep, arm, t0, alpha), items in cells.items():
        rec = {"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha,
               "n_seeds": len(items), "device": items[0]["device"]}
        for metric in ("final_acc", "best_acc", "rounds_to_best", "last_acc_var",
                       "personal_acc", "grad_norm_jump", "bytes_up", "bytes_down",
                       "train_flops", "seconds_per_round"):
            values = np.array([r[metric] for r in items], dtype=np.float64)
            rec[f"{metric}_mean"] = float(np.nanmean(values)) if np.any(np.isfinite(values)) \
                else None
            rec[f"{metric}_std"] = float(np.nanstd(values)) if np.any(np.isfinite(values)) \
                else None
        dev = [r["kernel_deviation"] for r in items if r["kernel_deviation"] is not None]
        rec["kernel_deviation_mean"] = float(np.mean(dev)) if dev else None
        rec["kernel_deviation_std"] = float(np.std(dev)) if dev else None
        rec["kernel_deviation_n"] = len(dev)  # seeds whose reference run exists
        out.append(rec)
    return out


def paired_differences(runs: list[dict], against: str = "fedavg",
                       metric: str = "final_acc") -> list[dict]:
    """Per (sweep, arm, T0, alpha): the mean over seeds of ``metric`` minus the ``against``
    arm's (its T0-free run of the same sweep, alpha and seed), its standard error (std with
    ddof = 1 of the per-seed differences over sqrt n; None for n < 2) and n. Seeds without a
    finished ``against`` run are left out."""
    base = {(r["sweep"], r["alpha"], r["seed"]): r[metric] for r in runs
            if r["arm"] == against and r["warmup_rounds"] is None}
    cells: dict[tuple, list[float]] = {}
    for r in runs:
        if r["arm"] == against and r["warmup_rounds"] is None:
            continue
        b = base.get((r["sweep"], r["alpha"], r["seed"]))
        if b is None or not np.isfinite(b) or not np.isfinite(r[metric]):
            continue
        cells.setdefault((r["sweep"], r["arm"], r["warmup_rounds"], r["alpha"]),
                         []).append(r[metric] - b)
    out = []
    for (sweep, arm, t0, alpha), diffs in cells.items():
        d = np.array(diffs, dtype=np.float64)
        se = float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else None
        out.append({"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha,
                    "against": against, "metric": metric, "n": int(d.size),
                    "diff_mean": float(d.mean()), "diff_se": se})
    return out


def _kernel_deviations(plan, sweep_name, arm_name, t0, alpha, specs) -> list[float]:
    """Kernel deviation of this T0's warm-up snapshot from the sweep's reference arm."""
    if t0 is None:
        return []
    sweep = next(s for s in plan.sweeps if s.name == sweep_name)
    refs = [a for a in sweep.arms if a.reference]
    if not refs:
        return []
    arm = next(a for a in sweep.arms if a.name == arm_name)
    head_t0 = arm.warmup_rounds[0]
    out = []
    for spec in specs:
        source = plan.out_dir / _key(sweep_name, arm_name, head_t0, alpha, spec.seed)
        ref = _reference_dir(plan, sweep, refs[0], alpha, spec.seed, t0)
        a = source / "checkpoints" / f"round_{t0}.pt"
        b = ref / "checkpoints" / f"round_{t0}.pt"
        if a.is_file() and b.is_file():
            heads = int(load_yaml(source / "config.yaml")["model"]["heads"])
            out.append(kernel_deviation(a, b, heads))
    return out


def _reference_dir(plan: Plan, sweep: Sweep, ref: Arm, alpha, seed: int, t0: int) -> Path:
    """The reference run of this alpha and seed; a reference whose partition ignores alpha
    (``iid``: one client holding the pooled data) is the same run at every alpha, so the one
    of another alpha (same seed) stands in when this alpha's is missing."""
    own = plan.out_dir / _key(sweep.name, ref.name, None, alpha, seed)
    if (own / "checkpoints" / f"round_{t0}.pt").is_file():
        return own
    for other in sweep.alphas:
        cand = plan.out_dir / _key(sweep.name, ref.name, None, other, seed)
        if not (cand / "checkpoints" / f"round_{t0}.pt").is_file():
            continue
        scheme = load_yaml(cand / "config.yaml")["partition"]["scheme"]
        if scheme in ("iid", "natural"):
            return cand
    return own


def _n_suffix(n) -> str:
    return f" ({n})" if n else ""


def _fmt(mean, std) -> str:
    if mean is None:
        return "-"
    if abs(mean) >= 1e4:
        return f"{mean:.3g} +- {std:.2g}"
    return f"{mean:.4f} +- {std:.4f}"


def write_tables(rows: list[dict], out_dir: Path, runs: list[dict] | None = None) -> list[Path]:
    """``study.csv``, ``study.json`` and ``study.md`` (mean +- std (n)) in ``out_dir``; with
    ``runs`` (:func:`run_rows`) also ``study_per_run.csv`` (one row per run and seed) and
    ``study_paired.{csv,md}`` (each cell minus FedAvg, paired by seed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=_sort_key)
    paths = [out_dir / "study.csv", out_dir / "study.json", out_dir / "study.md"]
    if rows:
        _write_csv(rows, paths[0])
    atomic_write_text(paths[1], json.dumps(rows, indent=1))
    lines = ["| sweep | alpha | arm | T0 | n | final acc | best acc | rounds to best | "
             "personal acc | acc var (last 10 evals) | grad-norm jump | kernel dev (n) | MB up | "
             "TFLOPs | s/round |", "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['sweep']} | {r['alpha'] if r['alpha'] is not None else 'natural'} | "
            f"{r['arm']} | {'' if r['warmup_rounds'] is None else r['warmup_rounds']} | "
            f"{r['n_seeds']} | {_fmt(r['final_acc_mean'], r['final_acc_std'])} | "
            f"{_fmt(r['best_acc_mean'], r['best_acc_std'])} | "
            f"{_fmt(r['rounds_to_best_mean'], r['rounds_to_best_std'])} | "
            f"{_fmt(r['personal_acc_mean'], r['personal_acc_std'])} | "
            f"{_fmt(r['last_acc_var_mean'], r['last_acc_var_std'])} | "
            f"{_fmt(r['grad_norm_jump_mean'], r['grad_norm_jump_std'])} | "
            f"{_fmt(r['kernel_deviation_mean'], r['kernel_deviation_std'])}"
            f"{_n_suffix(r.get('kernel_deviation_n'))} | "
            f"{(r['bytes_up_mean'] or 0) / 1e6:.1f} | {(r['train_flops_mean'] or 0) / 1e12:.2f} "
            f"| {_fmt(r['seconds_per_round_mean'], r['seconds_per_round_std'])} |")
    atomic_write_text(paths[2], "\n".join(lines) + "\n")
    if runs is not None:
        paths += _write_run_tables(runs, out_dir)
    return paths


def _sort_key(r: dict) -> tuple:
    return (r["sweep"], str(r["alpha"]), r["arm"],
            -1 if r["warmup_rounds"] is None else r["warmup_rounds"], r.get("seed", 0))


def _write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as fh:
        if rows:
            w = csv.DictWriter(fh, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)


def _write_run_tables(runs: list[dict], out_dir: Path) -> list[Path]:
    paired = sorted(paired_differences(runs), key=_sort_key)
    paths = [out_dir / "study_per_run.csv", out_dir / "study_paired.csv",
             out_dir / "study_paired.md"]
    _write_csv(sorted(runs, key=_sort_key), paths[0])
    _write_csv(paired, paths[1])
    lines = ["Final accuracy minus FedAvg's of the same seed, in points: mean over seeds +- its "
             "standard error (ddof = 1), n seeds.", "",
             "| sweep | alpha | arm | T0 | n | minus fedavg (points) | mean / SE |",
             "|" + "---|" * 7]
    for r in paired:
        se = r["diff_se"]
        lines.append(
            f"| {r['sweep']} | {r['alpha'] if r['alpha'] is not None else 'natural'} | "
            f"{r['arm']} | {'' if r['warmup_rounds'] is None else r['warmup_rounds']} | "
            f"{r['n']} | {100 * r['diff_mean']:+.2f}"
            + (f" +- {100 * se:.2f}" if se is not None else "") + " | "
            + (f"{r['diff_mean'] / se:+.1f}" if se else "-") + " |")
    atomic_write_text(paths[2], "\n".join(lines) + "\n")
    return paths


def pack_results(plan: Plan, dest: Path) -> dict:
    """Write ``dest`` (.tar.gz): every completed run's summary, config and the global rows of
    its metrics, and its warm-up snapshots reduced to the Q/K weights the kernel deviation
    reads. Unpacking it into an empty ``out_dir`` and running ``--aggregate-only`` gives the
    tables and figure 7 (they read only global rows); model checkpoints, client states and
    per-client rows stay behind (large; re-running a run rebuilds them). Packing 179 runs took
    6 s on the GPU host (the earlier aggregation plus xz of whole metrics files outlasted a
    10-minute call).
    """
    import io
    import tarfile

    import torch

    dest = Path(dest)
    counts = {"runs": 0, "snapshots": 0}

    def add_bytes(tar, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        for spec in plan_runs(plan):
            if _status(spec.run_dir) not in FINAL or not (spec.run_dir / "metrics.csv").is_file():
                continue  # unfinished, or only a marker of a run finished elsewhere
            counts["runs"] += 1
            for name in ("summary.json", "config.yaml"):
                if (spec.run_dir / name).is_file():
                    tar.add(spec.run_dir / name, arcname=f"{spec.key}/{name}")
            lines = (spec.run_dir / "metrics.csv").read_text().splitlines()
            col = lines[0].split(",").index("client")
            kept = [lines[0]] + [ln for ln in lines[1:] if ln.split(",")[col] == "global"]
            add_bytes(tar, f"{spec.key}/metrics.csv", ("\n".join(kept) + "\n").encode())
            for snap in sorted((spec.run_dir / "checkpoints").glob("round_*.pt")):
                state = torch.load(snap, map_location="cpu", weights_only=False)
                qk = {n: t for n, t in state["global_params"].items()
                      if n.endswith(("attn.q.weight", "attn.k.weight"))}
                buf = io.BytesIO()
                torch.save({"global_params": qk}, buf)
                add_bytes(tar, f"{spec.key}/checkpoints/{snap.name}", buf.getvalue())
                counts["snapshots"] += 1
    return counts


def write_markers(plan: Plan, dest: Path) -> int:
    """Write ``dest`` (.tar.gz) with the ``summary.json`` of every run whose whole group (a T0
    family, or a single run) is finished, and the plan's pretrained files: unpacked into
    ``out_dir`` on a fresh machine, it makes the study skip exactly those groups (an unfinished
    family reruns from its head, which keeps the snapshots its branches need) and start FedSQ
    from the same pretrained S. Returns the number of runs marked."""
    import tarfile

    groups: dict[tuple, list[RunSpec]] = {}
    for s in plan_runs(plan):
        groups.setdefault((s.sweep.name, s.arm.name, s.alpha, s.seed), []).append(s)
    dest = Path(dest)
    marked = 0
    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for members in groups.values():
            if all(_status(m.run_dir) in FINAL for m in members):
                for m in members:
                    rel = m.run_dir.relative_to(plan.out_dir)
                    tar.add(m.run_dir / "summary.json", arcname=f"{rel}/summary.json")
                    marked += 1
        for job in plan.pretrain:
            if plan.pretrained_path(job).is_file():
                tar.add(plan.pretrained_path(job), arcname=f"pretrained/{job.name}.pt")
    return marked


def replace_out(plan: Plan, out_dir: Path) -> Plan:
    return dataclasses.replace(plan, out_dir=Path(out_dir))
