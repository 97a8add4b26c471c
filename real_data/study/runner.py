"""Running a study plan: resumable run groups, cost-balanced shards, deadlines, pretraining.

A run group is a T0 family (the largest T0 trains the warm-up once and keeps a snapshot at
every T0; every other T0 branches from its snapshot) or a single run. A completed group is
skipped, an interrupted run resumed from its last checkpoint, a missing one started.
"""

from __future__ import annotations

import collections
import csv
import fnmatch
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np

from linattn.errors import ConfigError, DataError, UserError
from linattn.fileio import atomic_path
from real_data.config import load_config
from real_data.lock import RunLocked
from real_data.study.plan import (
    Plan,
    RunSpec,
    plan_runs,
    run_config,
    run_overrides,
    tuned_arm_base,
)

FINAL = ("completed", "diverged")  # a diverged run is a result (its status says so), not redone


# training samples of the shipped image data sets (a run in local epochs counts its steps from
# them; a data set not listed counts one unit per epoch)
TRAIN_SAMPLES = {"fmnist": 60000, "mnist": 60000, "cifar10": 50000, "cifar100": 50000,
                 "digits": 1438}
REFERENCE_CLIENTS = 50  # a unit of work: a round of 50 clients x K = 10 local steps
# A GPU round of fewer clients is bound by the latency of its K sequential local steps, not by
# its width: FedTP's native protocol (5 clients a round, 85 local steps, stacked groups of 6
# runs) measured 0.034 s per run-round and 11 local steps on an H200, against 0.051 for 50
# clients at K = 10 in the same plan (fair.yaml): 0.66 of the reference width, not 0.1 (the
# sweep's median; FedTP's own arm, 0.31 s, gives 0.79). A-priori splits on a CPU count width.
WIDTH_FLOOR = 0.66


def _local_work(cfg, floor: float = 0.0) -> float:
    """A round's a-priori cost relative to a round of 50 clients of K = 10 local steps, for a
    run's config: max(clients per round / 50, floor) (1 + K) / 11 (the server update, the
    evaluation and the bookkeeping cost about one local step's work per client; the fair
    study measured a K = 40 run-round at about 3 to 6 times a K = 10 one on an H200). GPU
    prices pass ``floor=WIDTH_FLOOR`` (a narrow round costs its sequential steps' latency);
    the a-priori split before any measurement counts width as it is. A run in local epochs
    takes K = epochs x its clients' mean minibatches per epoch (training samples of the data
    set over the clients, less the validation share)."""
    train, part = cfg.train, cfg.partition
    clients = min(train.clients_per_round or part.num_clients or REFERENCE_CLIENTS,
                  part.num_clients or REFERENCE_CLIENTS)
    steps = train.local_steps
    if steps is None:
        samples = TRAIN_SAMPLES.get(cfg.data.name)
        if samples is None or not part.num_clients:
            return max(clients / REFERENCE_CLIENTS, floor)
        per_client = samples * (1.0 - (part.validation_fraction or 0.0)) / part.num_clients
        steps = float(train.local_epochs or 1) * math.ceil(per_client / train.batch_size)
    return max(clients / REFERENCE_CLIENTS, floor) * (1.0 + float(steps)) / 11.0


def _block_work(cfg) -> float | None:
    """A Transformer's weight multiply-adds per token, depth (4 d^2 + 2 d mlp_dim) (the Q, K,
    V and output projections and the MLP), from its config; None for a model without
    ``dim``, ``depth`` and ``mlp_dim``. A sweep not run yet is priced by its ratio to the
    measured sweeps' median (at least 1: a smaller model's round is not cheaper on a GPU that a
    small model leaves idle); where the measured model's rounds are bound by latency rather
    than arithmetic, this prices the larger one high, until its own runs are measured."""
    p = cfg.model.params
    dims = [getattr(p, k, None) for k in ("dim", "depth", "mlp_dim")]
    if not all(isinstance(x, int) and x > 0 for x in dims):
        return None
    d, depth, mlp = dims
    return float(depth * (4 * d * d + 2 * d * mlp))


def _attention(cfg) -> str | None:
    """The model's attention kind (softmax, linear, ...), None for a model without one."""
    return getattr(cfg.model.params, "attention", None)


def families(specs: list[RunSpec]) -> list[list[RunSpec]]:
    """The specs grouped by (sweep, arm, alpha, seed): a T0 family (its head, the largest T0,
    first) or a single run, in plan order."""
    out: dict[tuple, list[RunSpec]] = {}
    for s in specs:
        out.setdefault((s.sweep.name, s.arm.name, s.alpha, s.seed), []).append(s)
    return list(out.values())


def rounds_done(run_dir: Path, every: int) -> int:
    """The round an interrupted run resumes from, read without loading its checkpoint: the
    last round its ``timings.csv`` lists down to a multiple of its checkpoint cadence
    ``every``, or the multiple before it where ``checkpoints/last.pt`` is not newer than
    the timings (killed between a round's rows and its checkpoint, or mtimes too coarse to
    tell: never more progress than the checkpoint holds); 0 without a checkpoint."""
    ckpt, timings = run_dir / "checkpoints" / "last.pt", run_dir / "timings.csv"
    try:
        lines = timings.read_text().split()
        last = int(lines[-1].split(",")[0]) if len(lines) > 1 else 0
        after = ckpt.stat().st_mtime_ns > timings.stat().st_mtime_ns
    except (OSError, ValueError):  # no checkpoint (it starts again) or no readable timings
        return 0
    every = max(1, every)
    return (last if after else max(0, last - 1)) // every * every


def rounds_left(members: list[RunSpec], rounds: int, skip: frozenset = frozenset(),
                every: int | None = None) -> int:
    """Run-rounds a family still trains: its head all ``rounds``, each branch the rounds after
    its T0; members in ``skip`` (finished) none. With ``every`` (the runs' checkpoint
    cadence), an interrupted member counts only the rounds after the one it resumes from
    (:func:`rounds_done`), as a group restored on another machine does."""
    def start(m: RunSpec, t0: int) -> int:
        return t0 if every is None else max(t0, rounds_done(m.run_dir, every))

    return sum(rounds - start(m, 0 if i == 0 else (m.warmup_rounds or 0))
               for i, m in enumerate(members) if m.key not in skip)


def group_cost(members: list[RunSpec], pace: dict | None = None,
                skip: frozenset = frozenset(), resumed: bool = False) -> float:
    """Rounds the group trains, times the seconds per round measured for its (sweep, arm)
    where ``pace`` (:func:`measured_pace`) has them. A tuning stage's grid point ``arm+i``
    without a pace of its own takes its arm's. An arm not yet run in this sweep takes the
    sweep's base (``("*sweep", sweep)`` where measured, else the sweep's median) times the
    arm's ratio measured elsewhere; a sweep not yet run, the overall median times
    :func:`_local_work`. Without ``pace``, :func:`_local_work` per round (a
    round of 50 clients of K = 10 local steps is one unit). Members whose key is in ``skip``
    (finished) cost nothing. ``resumed``: an interrupted member costs only the rounds after
    the one it resumes from (:func:`rounds_done`; for a deadline and an estimate, not for
    the shard split, which must not depend on what has run)."""
    cfg = run_config(members[0], members[0].warmup_rounds)  # one read for rounds and work
    cost = rounds_left(members, int(cfg.train.rounds), skip,
                       int(cfg.run.checkpoint_every) if resumed else None)
    head = members[0]
    if pace:
        # a tuning run (arm ``fedavg+1``, a grid point; a plan's own arm names never end in
        # + and a number) costs what its arm costs: the grid varies lr, schedules and mu, not
        # the work of a round
        arm, base_arm = head.arm.name, tuned_arm_base(head.arm.name)
        per_round = pace.get((head.sweep.name, arm), pace.get((head.sweep.name, base_arm)))
        if per_round is None:  # the sweep's (or overall) median, times the arm's measured
            # ratio to its sweep's median in the other sweeps (FedSQ ~2.3x, SCAFFOLD ~1.6x);
            # a sweep not measured yet: the overall median scaled by its local work and by
            # its attention's measured ratio (linear attention ~1.4-1.9x softmax on the ViT)
            base = pace.get(("*sweep", head.sweep.name), pace[head.sweep.name]) \
                if head.sweep.name in pace else \
                pace["*"] * _local_work(cfg, WIDTH_FLOOR) \
                * pace.get(("*attention", _attention(cfg)), 1.0) * _model_scale(cfg, pace)
            per_round = base * pace.get(("*", arm), pace.get(
                ("*", base_arm), 0.3 if head.arm.reference else 1.0))
        return cost * per_round
    # one client: a fraction of a round
    return cost * _local_work(cfg)


def _model_scale(cfg, pace: dict) -> float:
    """A sweep not measured yet: its :func:`_block_work` over the measured sweeps' median
    (``pace["*model"]``), at least 1; 1 where either is unknown."""
    work, ref = _block_work(cfg), pace.get("*model")
    return 1.0 if work is None or not ref else max(1.0, work / ref)


def batch_cost(batch: list[list[RunSpec]], pace: dict | None = None,
               skip: frozenset = frozenset(), resumed: bool = False) -> float:
    """:func:`group_cost` of a stacked batch: the sum over its T0 families (each family's
    head trains all its rounds, its branches the rounds after their T0)."""
    return sum(group_cost(family, pace, skip, resumed) for family in batch)


def measured_pace(specs: list[RunSpec], before: float | None = None,
                  device_share: int | None = None) -> dict:
    """Median GPU seconds per round of the completed runs, by (sweep, arm) and by sweep; overall
    (``"*"``), the median per unit of :func:`_local_work` (so a sweep not run yet, at another
    K, is priced by its own local work); each arm's median ratio to its sweep's median
    (``("*", arm)``, for an arm not yet run in some sweep; from the sweeps where several arms
    ran) and each sweep's median as if all its arms had run (``("*sweep", sweep)``: its
    measured arms' paces over their ratios, the base of its arms not yet run); the median
    pace per unit of local work of the sweeps of each attention kind relative to the overall
    one (``("*attention", kind)``, for a sweep not run yet) and the measured sweeps' median
    model work per token (``"*model"``, :func:`_block_work`, for a sweep of a larger model
    not run yet); empty when none ran on a GPU. CPU runs are left out.

    By default a pace is a run's wall seconds per round, what a worker sharing the GPU as the
    run did sees (``--deadline`` without ``LINATTN_DEVICE_WORKERS``; with it, the deadline
    prices with :func:`wall_pace`, at this call's sharing). With ``device_share``, it is the
    GPU's seconds per round: the wall pace over the worker processes that shared the GPU (the
    run's recorded ``device.workers``; ``device_share`` for a run that does not record it)."""
    measured = []
    for s in specs:
        if not _finished_before(s.run_dir, before):
            continue
        info = json.loads((s.run_dir / "summary.json").read_text())
        sec = info.get("seconds_per_round")
        if info.get("status") != "completed" or not sec or \
                info.get("device", {}).get("type") != "cuda":
            continue
        share = 1 if device_share is None else info["device"].get("workers", device_share)
        measured.append((s, float(sec) / share))
    return _pace(measured)


def wall_pace(specs: list[RunSpec], before: float | None, workers: int) -> dict:
    """:func:`measured_pace` as the wall pace of a worker that shares its GPU with
    ``workers`` processes in all: each run's GPU seconds per round (its wall pace over the
    processes it recorded sharing its GPU; a run that recorded none is taken to have shared it
    as ``workers`` do) times ``workers``. The ratios and the model work stay as they are."""
    pace = measured_pace(specs, before, device_share=workers)
    unitless = {"*model"}
    return {k: v if k in unitless or (isinstance(k, tuple) and k[0] in ("*", "*attention"))
            else v * workers for k, v in pace.items()}


def exported_pace(plan: Plan, table: Path, device_share: int | None = None) -> dict:
    """:func:`measured_pace` from a study's exported per-run table (``study_per_run.csv`` of
    its ``--export`` folder, one row per run: ``sweep``, ``arm``, ``seconds_per_round``,
    ``status``, ``device_type`` or, in a table without that column, ``device`` naming a CUDA
    card: ``NVIDIA ...``), so a fresh clone prices with the GPU paces a study measured and
    published. ``plan`` is the study that wrote the table (its sweeps' local work); rows of
    sweeps or arms it does not have are left out. ``device_share``: GPU seconds, as
    :func:`measured_pace` (the column ``device_workers``, else ``device_share``). Raises
    ``DataError`` naming the file for a missing file or column."""
    table = Path(table)
    try:
        with open(table, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            have = set(reader.fieldnames or ())
            rows = list(reader)
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise DataError(f"{table}: cannot read the per-run table ({exc}); pass the "
                        "study_per_run.csv of a study's --export folder") from None
    need = {"sweep", "arm", "seconds_per_round", "status"}
    if not need <= have or not have & {"device", "device_type"}:
        raise DataError(f"{table}: not a study's per-run table (needs the columns "
                        f"{', '.join(sorted(need))} and device or device_type)")
    first = {}
    for s in plan_runs(plan):
        first.setdefault((s.sweep.name, s.arm.name), s)
    measured = []
    for r in rows:  # a short row's missing cells read as empty
        spec = first.get((r.get("sweep") or "", r.get("arm") or ""))
        gpu = ((r.get("device_type") or "") == "cuda" if "device_type" in have else
               (r.get("device") or "").startswith("NVIDIA"))
        try:
            sec = float(r.get("seconds_per_round") or "nan")
            share = float(r.get("device_workers") or "nan")
        except ValueError:
            continue
        if device_share is None:
            share = 1.0
        elif not (math.isfinite(share) and share >= 1):  # not recorded
            share = float(device_share)
        if (spec is not None and gpu and r.get("status") == "completed"
                and math.isfinite(sec) and sec > 0):
            measured.append((spec, sec / share))
    return _pace(measured)


def _pace(measured: list[tuple[RunSpec, float]]) -> dict:
    """:func:`measured_pace` of completed GPU runs given as (run, seconds per round)."""
    by_arm: dict[tuple, list[float]] = {}
    work: dict[str, float] = {}  # each measured sweep's local work per round
    kind: dict[str, str | None] = {}  # and its attention
    model: dict[str, float | None] = {}  # and its model's work per token
    for s, sec in measured:
        by_arm.setdefault((s.sweep.name, s.arm.name), []).append(sec)
        if s.sweep.name not in work:
            cfg = run_config(s, s.warmup_rounds)
            work[s.sweep.name] = _local_work(cfg, WIDTH_FLOOR)
            kind[s.sweep.name] = _attention(cfg)
            model[s.sweep.name] = _block_work(cfg)
    if not by_arm:
        return {}
    pace: dict = {k: float(np.median(v)) for k, v in by_arm.items()}
    for sweep in {k[0] for k in by_arm}:
        pace[sweep] = float(np.median([x for k, v in by_arm.items() if k[0] == sweep
                                       for x in v]))
    pace["*"] = float(np.median([x / work[k[0]] for k, v in by_arm.items() for x in v]))
    # ("*", arm): the arm's pace relative to its sweeps' median, from the sweeps where more
    # than one arm ran (in a sweep of one measured arm the ratio is 1 by construction)
    arms_of = {sw: [k for k in by_arm if k[0] == sw] for sw in {k[0] for k in by_arm}}
    mixed = {k for sw, ks in arms_of.items() if len(ks) > 1 for k in ks}
    for arm in {k[1] for k in by_arm}:
        keys = [k for k in by_arm if k[1] == arm and k in mixed] or \
            [k for k in by_arm if k[1] == arm]
        pace[("*", arm)] = float(np.median([pace[k] / pace[k[0]] for k in keys]))
    # ("*sweep", sweep): the sweep's median as if every arm had run, from the arms that did
    # (each measured arm's pace over its ratio): a sweep where only the pooled references
    # (one client, ~0.2x a federated round) ran does not price its federated arms as theirs
    for sw, ks in arms_of.items():
        pace[("*sweep", sw)] = float(np.median([pace[k] / pace[("*", k[1])] for k in ks]))
    sizes = [m for m in model.values() if m is not None]
    if sizes:  # "*model": the measured sweeps' median model work per token
        pace["*model"] = float(np.median(sizes))
    for a in set(kind.values()):  # ("*attention", kind): its runs' pace per unit of work
        pace[("*attention", a)] = float(np.median([x / work[k[0]] for k, v in by_arm.items()
                                                  if kind[k[0]] == a for x in v])) / pace["*"]
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
    costs = [group_cost(g, pace, skip) for g in groups]
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
    # imported here: pretraining imports torch, which listing and aggregating do not need
    from real_data.pretrain import PretrainSettings, run_pretrain

    wanted = {o for s in specs for o in run_overrides(s, s.warmup_rounds)}
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
    return run_status(run_dir) in FINAL


def run_status(run_dir: Path) -> str:
    """``summary.json``'s status (``completed``, ``diverged``, ...), else ``partial`` (a run
    directory without it) or ``missing``."""
    summary = run_dir / "summary.json"
    if summary.is_file():
        return json.loads(summary.read_text()).get("status", "unknown")
    return "partial" if run_dir.exists() else "missing"


EXIT_DEVICE_LOST = 3
"""The exit status of a ``linattn study`` worker stopped by :class:`DeviceLost` (a fresh process
resumes its runs; ``scripts/gpu_study.sh`` starts one while time is left)."""


class DeviceLost(RuntimeError):
    """This process's CUDA context is unusable: every later run of it would fail the same way."""


def device_unusable(exc: BaseException) -> bool:
    """True for an error that leaves the process's CUDA context unusable: a device-side assert,
    an illegal memory access, address or instruction, a misaligned address, an unspecified
    launch failure or an uncorrectable ECC error (torch's ``AcceleratorError`` or any
    ``RuntimeError`` reading "CUDA error: " followed by one of these). Every later CUDA call of
    the process raises it again, so the worker's remaining runs would all fail at once. Errors
    the context survives are not among them: out of memory, an invalid configuration or a
    CUBLAS failure fail one run and the worker goes on."""
    # torch raises AcceleratorError, a RuntimeError, for every failed CUDA call, the ones the
    # context survives included: its message decides, as a RuntimeError's does
    if type(exc).__name__ == "OutOfMemoryError" or not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    if "cuda error:" not in text or "out of memory" in text:
        return False
    return any(sign in text for sign in _POISONING_CUDA_ERRORS)


# Messages of the CUDA errors after which the context is lost (cudaErrorAssert,
# cudaErrorIllegalAddress, cudaErrorIllegalInstruction, cudaErrorMisalignedAddress,
# cudaErrorLaunchFailure, cudaErrorECCUncorrectable and their driver counterparts).
_POISONING_CUDA_ERRORS = (
    "device-side assert", "illegal memory access", "illegal address", "illegal instruction",
    "misaligned address", "unspecified launch failure", "uncorrectable ecc",
    "launch timed out", "hardware stack error", "invalid program counter",
)


def run_study(plan: Plan, pattern: str | list[str] | None = None, max_runs: int | None = None,
              budget_s: float | None = None, log=print,
              shard: tuple[int, int] | None = None, pretrain_only: bool = False,
              deadline_s: float | None = None, pending: bool | float = False,
              stack: bool = True, stack_runs: int = 64,
              price_runs: list[RunSpec] | None = None) -> dict:
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
    the start, at the pace of the groups run so far (before any: the pace measured in the
    plan's finished GPU runs when ``pending``, a sweep not run yet priced by its local work;
    without one the first group always starts; with ``LINATTN_DEVICE_WORKERS`` set, each
    run's GPU pace times the processes that share this call's GPU, :func:`wall_pace`, so runs
    measured with fewer workers a GPU do not price it low); a stacked batch that would not fit
    is split into halves, a single group that would not fit is left for later and a shorter
    one tried.
    With ``pretrain_only`` and ``shard=(k, n)``, the k-th of every n pretraining jobs the
    whole selection needs is run (one process per GPU pretrains side by side).
    ``stack``: T0 families that share a model architecture and optimizer train together in
    stacked groups of at most ``stack_runs`` runs (:mod:`real_data.stacked_runs`); budget and
    deadline then apply per stacked group. A run with ``algorithm.warmup=auto`` (it forks probe
    continuations and rolls back) stacks too: the group trains its probes beside the other
    forking runs' (:func:`real_data.probe_runs.probe_together`).
    ``price_runs``: other finished runs of the study (its tuning runs, for the final stage)
    whose measured GPU pace also prices the deadline, so a stage none of whose runs has
    finished yet does not start its first group blind.
    """

    patterns = [pattern] if isinstance(pattern, str) else list(pattern or [])
    specs = [s for s in plan_runs(plan)
             if not patterns or any(fnmatch.fnmatch(s.key, p) for p in patterns)]
    for p in patterns:
        if not any(fnmatch.fnmatch(s.key, p) for s in specs):
            raise ConfigError(f"--slice {p!r} matches no run of plan {plan.name!r}; "
                              "`linattn study --plan ... --list` shows the run keys")
    # check every config before anything runs, so a bad plan writes nothing; a run directory
    # that already exists must hold the run the plan now asks for
    check_existing(specs, log)
    todo = families(specs)
    before = None if isinstance(pending, bool) else float(pending)
    done_then = frozenset(m.key for g in todo for m in g if _finished_before(m.run_dir, before)) \
        if pending is not False else frozenset()
    if pending is not False:
        todo = [g for g in todo if any(m.key not in done_then for m in g)]
    if pretrain_only:
        ensure_pretrained(plan, [m for g in todo for m in g
                                 if run_status(m.run_dir) != "completed"], log, shard)
        return {"pretrained": sum(plan.pretrained_path(j).is_file() for j in plan.pretrain)}
    if stack and todo:
        from real_data.stacked_runs import stack_pad_mode  # it imports torch; --list does not

        stack_pad_mode()  # a bad LINATTN_STACK_PAD stops here, before any run's folder
    # pending: workers that start together see the same finished runs, so they may also
    # weigh each group by the seconds per round measured so far for its arm, in the whole
    # plan (a slice not run yet is priced by the sweeps that ran)
    pace = measured_pace(plan_runs(plan), before) if pending is not False else None
    # the deadline's prices may take every finished run (the split above may not: workers
    # must agree on it whatever finished since they started)
    dpace = (measured_pace([*plan_runs(plan), *price_runs]) or pace
             if deadline_s is not None and price_runs else pace)
    if deadline_s is not None and dpace is not None and "LINATTN_DEVICE_WORKERS" in os.environ:
        # a run's wall pace grows with the processes that share its GPU: the deadline prices
        # at this call's sharing, not at the one each run recorded
        from real_data.rundir import device_workers  # it imports torch; --list does not

        dpace = wall_pace([*plan_runs(plan), *(price_runs or [])],
                          None if price_runs or isinstance(pending, bool)
                          else float(pending),
                          device_workers()) or dpace
    if shard is not None:
        # without pending, over the whole selection: workers started at any time agree on
        # the split, whatever the others have finished meanwhile
        todo = shard_groups(todo, shard, pace, done_then)
    ensure_pretrained(plan, [m for g in todo for m in g
                             if run_status(m.run_dir) != "completed"], log)
    counts = {"skipped": 0, "resumed": 0, "started": 0, "branched": 0, "left": 0,
              "diverged": 0, "failed": 0}
    start, done = time.perf_counter(), 0
    spent, cost_done = 0.0, 0.0  # seconds and rounds of the groups run here (for deadline_s)
    batches = collections.deque(_stack_batches(todo, stack_runs) if stack else
                                [[g] for g in todo])
    while batches:
        batch = batches.popleft()
        members = [m for family in batch for m in family]
        now = time.perf_counter() - start
        finished = frozenset(m.key for m in members if run_status(m.run_dir) in FINAL)
        todo_here = len(finished) < len(members)
        cost = batch_cost(batch, dpace, finished, resumed=True) if deadline_s is not None \
            else 0.0
        # at the pace of the groups run here; before any, a measured pace is already seconds
        ratio = spent / cost_done if cost_done > 0 else (1.0 if dpace else None)
        late = deadline_s is not None and ratio is not None and todo_here and \
            now + cost * ratio > deadline_s
        if late and len(batch) > 1:  # a stacked batch too long: its halves may fit
            half = len(batch) // 2
            batches.extendleft([batch[half:], batch[:half]])
            continue
        if (max_runs is not None and done >= max_runs) or (
                budget_s is not None and now > budget_s) or late:
            counts["left"] += sum(run_status(m.run_dir) not in FINAL for m in members)
            continue
        t_group = time.perf_counter()
        try:
            if stack:
                _run_stacked(batch, counts, log)
            else:
                _run_group(members, counts, log)
        except RunLocked as exc:  # another worker trains it now: leave it to that one
            counts["left"] += sum(run_status(m.run_dir) not in FINAL for m in members)
            log(f"left   {members[0].key}: {exc}")
        except UserError:
            raise  # a mistake in the plan or its files (exit 2), not a broken run
        except Exception as exc:  # one broken run must not stop a worker's whole shard
            counts["failed"] += 1
            log(f"FAILED {members[0].key}: {type(exc).__name__}: {exc}")
            if device_unusable(exc):  # unless the device is gone for this whole process
                raise DeviceLost(f"the CUDA context is unusable after {type(exc).__name__} in "
                                 f"{members[0].key}; a new process resumes its runs "
                                 f"(counts so far: {counts})") from exc
        if todo_here:
            spent += time.perf_counter() - t_group
            cost_done += cost
        done += len(batch)
    return counts


def estimate(plan: Plan, pattern: str | list[str] | None = None,
             pace_plan: Plan | None = None, pace_table: Path | None = None,
             device_share: int = 1) -> list[dict]:
    """What the selection still costs, per sweep: runs not finished, the run-rounds they train
    (a T0 family's head all its rounds, each branch the rounds after its T0) and the GPU
    seconds at the pace measured in the plan's finished GPU runs (:func:`measured_pace`; a
    sweep not run yet priced by its local work; None without any measured run). The same
    costs as ``--deadline`` and ``--shard`` use, before stacking (a stacked group trains its
    runs together; the measured pace is its per-run share). ``pace_plan``: where this plan
    has no finished GPU run, the overall pace per unit of local work (and the arms' ratios)
    measured in that plan's runs prices every sweep; ``pace_table``: that plan's exported
    per-run table (:func:`exported_pace`) where its runs are not here. GPU seconds are the
    GPU's share: a run that trained beside other workers on its GPU counts its wall time over
    their number (``device.workers`` of its summary; ``device_share`` where it is not
    recorded)."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern or [])
    specs = [s for s in plan_runs(plan)
             if not patterns or any(fnmatch.fnmatch(s.key, p) for p in patterns)]
    pace = measured_pace(plan_runs(plan), device_share=device_share)
    borrowed = False
    if not pace and pace_plan is not None:
        other = measured_pace(plan_runs(pace_plan), device_share=device_share)
        if not other and pace_table is not None:
            other = exported_pace(pace_plan, pace_table, device_share)
        pace = {k: v for k, v in other.items() if k == "*" or (isinstance(k, tuple)
                                                              and k[0] in ("*", "*attention"))}
        borrowed = bool(pace)
    rows: dict[str, dict] = {}
    for family in families(specs):
        finished = frozenset(m.key for m in family if run_status(m.run_dir) in FINAL)
        left = [m for m in family if m.key not in finished]
        if not left:
            continue
        row = rows.setdefault(family[0].sweep.name, {
            "sweep": family[0].sweep.name, "runs": 0, "run_rounds": 0,
            "gpu_seconds": 0.0 if pace else None,
            "priced_by": "measured" if family[0].sweep.name in pace else
            (f"local work at {pace_plan.name}'s pace" if borrowed else
             "local work" if pace else "none")})
        cfg = run_config(family[0], family[0].warmup_rounds)
        row["runs"] += len(left)
        row["run_rounds"] += rounds_left(family, int(cfg.train.rounds), finished,
                                         int(cfg.run.checkpoint_every))
        if pace:
            row["gpu_seconds"] += group_cost(family, pace, finished, resumed=True)
    return list(rows.values())


SAME_SECTIONS = ("seed", "data", "partition", "algorithm", "train", "eval")
MARKER_FILES = {"summary.json", "config.yaml"}  # a run marked elsewhere (write_markers)


def config_mismatch(spec: RunSpec, cfg) -> str | None:
    """What differs between the run in ``spec``'s directory and ``cfg`` (the plan changed
    since it ran: a grid point's index names another point, or a tuned choice moved), in the
    sections that decide the results; None if they agree or nothing is there."""
    from linattn.configio import load_yaml
    from real_data.config import config_from_dict, config_to_dict

    saved = spec.run_dir / "config.yaml"
    if not saved.is_file():
        return None
    try:
        data = load_yaml(saved)
    except ConfigError:
        if not saved.exists():  # a stale marker another worker removed meanwhile
            return None
        raise
    have = config_to_dict(config_from_dict(data, source=saved))
    want = config_to_dict(cfg)
    for section in SAME_SECTIONS:
        a, b = have.get(section), want.get(section)
        if a != b:
            if isinstance(a, dict) and isinstance(b, dict):
                key = next(k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))
                return f"{section}.{key}: ran with {a.get(key)!r}, the plan asks {b.get(key)!r}"
            return f"{section}: ran with {a!r}, the plan asks {b!r}"
    return None


def _is_marker(run_dir: Path) -> bool:
    """A run directory holding only what :func:`write_markers` puts there."""
    try:
        return {p.name for p in run_dir.iterdir()} <= MARKER_FILES
    except FileNotFoundError:
        return False


def check_existing(specs: list[RunSpec], log=print) -> None:
    """Raise UserError, changing nothing, if a run directory of ``specs`` holds a run of
    another configuration than the plan's (:func:`config_mismatch`). A marker of another
    configuration (:func:`write_markers`: a summary and config, no metrics) is stale, say a
    final run marked before its arm's choice moved: once no real run conflicts, the stale
    markers are removed with the markers of their T0 family (a family trains whole), so those
    runs train. Workers that start together may remove the same marker."""
    stale, conflicts = set(), []
    for fam in families(specs):
        for s in fam:
            what = config_mismatch(s, run_config(s, s.warmup_rounds))
            if what is None:
                continue
            if _is_marker(s.run_dir):
                stale.add(fam[0].key)
                log(f"stale marker {s.key} ({what}): removed, the run trains")
            else:
                conflicts.append(f"{s.run_dir} holds a run of another configuration ({what})")
    if conflicts:
        more = f" (and {len(conflicts) - 1} more)" if len(conflicts) > 1 else ""
        raise UserError(f"{conflicts[0]}{more}; the plan changed since it ran: move that run "
                        "away or give the study another --out")
    for fam in families(specs):
        if fam[0].key in stale:
            for s in fam:
                if _is_marker(s.run_dir):
                    shutil.rmtree(s.run_dir, ignore_errors=True)


def _head_action(head: RunSpec, counts: dict, log) -> str:
    """What a T0 family's head needs: ``"done"`` (completed or diverged: counted as skipped or
    diverged), ``"resume"`` (a checkpoint exists; counted) or ``"start"`` (a partial run
    without a checkpoint is removed first; the caller counts it once started); logged."""
    status = run_status(head.run_dir)
    if status in FINAL:
        counts["skipped" if status == "completed" else "diverged"] += 1
        return "done"
    if status == "partial" and (head.run_dir / "checkpoints" / "last.pt").is_file():
        log(f"resume {head.key}")
        counts["resumed"] += 1
        return "resume"
    if status == "partial":  # created but killed before its first checkpoint
        shutil.rmtree(head.run_dir)
    log(f"start  {head.key}")
    head.run_dir.parent.mkdir(parents=True, exist_ok=True)
    return "start"


def _stack_batches(families: list[list[RunSpec]], max_runs: int) -> list[list[list[RunSpec]]]:
    """Consecutive T0 families of one stack key, at most ``max_runs`` runs a batch (a run that
    forks probe continuations, ``algorithm.warmup=auto``, stacks with the others)."""
    from real_data.stacked_runs import stack_key

    batches: list[list[list[RunSpec]]] = []
    keys: list[tuple] = []
    for family in families:
        cfg = run_config(family[0], family[0].warmup_rounds)
        key = stack_key(cfg)
        for i in range(len(batches)):
            if keys[i] == key and sum(map(len, batches[i])) + len(family) <= max_runs:
                batches[i].append(family)
                break
        else:
            batches.append([family])
            keys.append(key)
    return batches


def _run_stacked(batch: list[list[RunSpec]], counts: dict, log) -> None:
    """T0 families trained as one stacked group: each head started, resumed or (finished)
    kept for its snapshots; each unfinished branch forked inside the group."""
    from real_data.runs import load_data
    from real_data.stacked_runs import Branch, RunRequest, run_group

    requests, dataset = [], None
    for family in batch:
        head = family[0]
        cfg = run_config(head, head.warmup_rounds)
        dataset = dataset or load_data(cfg)
        t0s = head.arm.warmup_rounds
        if head.arm.reference:
            t0s = tuple(sorted({t for a in head.sweep.arms for t in a.warmup_rounds}))
        head_status = _head_action(head, counts, log)
        resume = head_status != "start"
        counts["started"] += not resume  # queued in the group
        branches = []
        for m in family[1:]:
            status = run_status(m.run_dir)
            if status in FINAL:
                counts["skipped" if status == "completed" else "diverged"] += 1
                continue
            m.run_dir.parent.mkdir(parents=True, exist_ok=True)
            branches.append(Branch(m.warmup_rounds, run_config(m, m.warmup_rounds), m.run_dir,
                                   m.key))
            counts["branched"] += 1
        if head_status == "done" and not branches:
            continue  # nothing of this family left to train
        requests.append(RunRequest(head.run_dir, cfg, resume,
                                   tuple(t for t in t0s if t is not None), tuple(branches),
                                   label=head.key))
    def failed(label, exc: Exception) -> None:  # that run leaves the group, the others go on
        if device_unusable(exc):  # ... unless the device is gone: the whole group stops
            raise exc
        counts["failed"] += 1
        log(f"FAILED {label}: {type(exc).__name__}: {exc}")

    if requests:
        for _, result in run_group(requests, dataset=dataset, log=log, on_error=failed):
            if result.status == "diverged":
                counts["diverged"] += 1


def _run_group(members: list[RunSpec], counts: dict, log) -> None:
    """One T0 family (or a single run): the head, then every branch from its snapshots."""
    # imported here: they import torch, which `linattn study --list` and the tables do not need
    from real_data.runs import resume_run, start_run

    head = members[0]
    t0s = head.arm.warmup_rounds
    if head.arm.reference:
        t0s = tuple(sorted({t for a in head.sweep.arms for t in a.warmup_rounds}))
    snapshots = tuple(t for t in t0s if t is not None)
    action = _head_action(head, counts, log)
    if action == "resume":
        resume_run(head.run_dir)
    elif action == "start":
        start_run(run_config(head, head.warmup_rounds), out=head.run_dir,
                  snapshot_rounds=snapshots)
        counts["started"] += 1
    for m in members[1:]:  # the other T0 branch from the largest one's snapshots
        status = run_status(m.run_dir)
        if status in FINAL:
            counts["skipped" if status == "completed" else "diverged"] += 1
            continue
        snap = head.run_dir / "checkpoints" / f"round_{m.warmup_rounds}.pt"
        if not snap.is_file():  # the head diverged short of this T0
            log(f"no snapshot for {m.key} ({snap.name} missing): not run")
            counts["failed"] += 1
            continue
        if m.run_dir.exists():
            shutil.rmtree(m.run_dir)  # a branch is cheap to redo from its snapshot
        log(f"branch {m.key}")
        m.run_dir.parent.mkdir(parents=True, exist_ok=True)
        start_run(run_config(m, m.warmup_rounds), out=m.run_dir, branch=snap)
        counts["branched"] += 1
