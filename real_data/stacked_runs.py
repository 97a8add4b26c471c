"""Stacked groups: the runs of a sweep trained together in one process, round by round.

Each run keeps its own :class:`~real_data.federation.Federation` (its config, partition,
algorithm, client sampling and minibatch plans), its own state and its own run directory,
written by the same :class:`~real_data.runs.RunLog` as a run trained alone. Per group round:

1. every run still training plans its next round (:meth:`Federation.begin_round`),
2. the runs' local training goes to the engine as one call where the runs can share it
   (:func:`real_data.stacking.train_jobs`: clients of every run on one axis), one by one where
   they cannot,
3. every run aggregates, evaluates and writes its round (:meth:`Federation.finish_round`,
   :meth:`RunLog.record`); a run that diverges stops alone, as it would alone,
4. a run with T0 branches forks each branch from its snapshot at that round, and the branch
   joins the group for the rounds that follow.

A run's result depends only on its own config, not on the group it trains in (up to the order
of summation in batched kernels: tests hold stacked and per-run metrics within 1e-6 in float64).
A killed group resumes from each run's last checkpoint; runs checkpointed at the same rounds
resume in the same groups, so the resumed metrics equal the uninterrupted ones byte for byte.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from linattn.errors import UserError
from real_data.config import Config
from real_data.engines import fast
from real_data.federation import Diverged
from real_data.runs import (
    Prepared,
    RoundHook,
    RunLog,
    RunResult,
    prepare_resume,
    prepare_start,
    release_device_caches,
)
from real_data.stacking import train_jobs


@dataclass(frozen=True)
class Branch:
    """A T0 branch: ``cfg`` started at ``run_dir`` from the parent's snapshot of round
    ``warmup_rounds``."""

    warmup_rounds: int
    cfg: Config
    run_dir: Path


@dataclass(frozen=True)
class RunRequest:
    """One run of a group: a new run (``cfg``) or one to resume (``resume=True``), with the
    rounds to snapshot and the branches to fork from those snapshots."""

    run_dir: Path
    cfg: Config | None = None
    resume: bool = False
    snapshot_rounds: tuple[int, ...] = ()
    branches: tuple[Branch, ...] = ()
    partition: object = None


@dataclass
class _Member:
    prep: Prepared
    log: RunLog | None
    branches: dict[int, list[Branch]] = field(default_factory=dict)
    running: bool = True

    @property
    def fed(self):
        return self.prep.fed


def stack_key(cfg: Config) -> tuple:
    """Runs with equal keys can train in one group: the same model architecture, data set,
    precision, device, engine, minibatch size, local steps and optimizer (up to its lr)."""
    t = cfg.train
    return (cfg.model.name, repr(cfg.model.params), repr(cfg.data), t.precision, t.device,
            t.engine, t.batch_size, t.local_steps, t.local_epochs, t.optimizer, t.momentum,
            t.weight_decay, t.clip_grad_norm)


def run_group(requests: list[RunRequest], dataset=None, device: torch.device | None = None,
              log: Callable[[str], None] = print,
              on_round_end: RoundHook | None = None) -> list[RunResult]:
    """Train the runs of ``requests`` (and their branches) as one stacked group.

    ``dataset``: loaded once by the caller and shared by every run (one copy on the device).
    ``on_round_end(round, run_dir)``: as in :func:`~real_data.runs.start_run`, for every run.
    Returns the results of every run and branch, in the order they finished.
    """
    members, now = [], []
    for r in requests:
        member, ready = _member(r, dataset, device, on_round_end)
        members.append(member)
        now += [(member, b) for b in ready]
    results: list[RunResult] = []
    members += [b for m, br in now if (b := _branch(m, br, dataset, device, log,
                                                     on_round_end)) is not None]
    pad = sum(_clients(m) * (1 + sum(len(v) for v in m.branches.values()))
              for m in members if m.running)
    engine = members[0].fed.cfg.train.engine if members else "vectorized"
    stacked = {"vectorized": fast.train_fast,
               "vectorized_compiled": lambda job: fast.train_fast(job, compile=True)}.get(engine)
    cuda = any(m.fed.device.type == "cuda" for m in members)
    for m in members:
        if m.fed.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(m.fed.device)
    while any(m.running for m in members):
        for m in members:  # resumed at its last round: only its summary was missing
            if m.running and m.prep.state.round >= m.fed.cfg.train.rounds:
                results.append(_close(m, "completed", ""))
        active = [m for m in members if m.running]
        if not active:
            break
        t_start = time.perf_counter()
        # 1. every run plans its round; 2. one engine call where runs can share it
        works = []
        for m in active:
            rnd = m.prep.state.round + 1
            works.append((m, rnd, m.fed.begin_round(m.prep.state, rnd)))
        trained = train_jobs([w.job for _, _, w in works], [m.fed.engine for m in active],
                             stacked, pad_clients=pad)
        for m, rnd, _ in works:
            m.fed.prefetch(rnd + 1)
            m.fed.model.eval()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t_start
        total_clients = sum(len(w.ids) for _, _, w in works)
        # 3. each run's server update, evaluation and files
        for (m, rnd, work), res in zip(works, trained):
            t_run = time.perf_counter()
            try:
                state, records = m.fed.finish_round(m.prep.state, rnd, work, res)
            except Diverged as exc:
                results.append(_close(m, "diverged", f"{exc}; last good checkpoint: round "
                                      f"{m.prep.state.round}"))
                continue
            own = seconds * len(work.ids) / total_clients + time.perf_counter() - t_run
            m.prep = dataclasses.replace(m.prep, state=state)
            m.log.record(rnd, work.plan.stage, state, records, own)
            if rnd >= m.fed.cfg.train.rounds:
                results.append(_close(m, "completed", ""))
            # 4. branches fork from the snapshot just written
            for b in m.branches.pop(rnd, []):
                branch = _branch(m, b, dataset, device, log, on_round_end)
                if branch is not None:
                    members.append(branch)
    if cuda:
        release_device_caches()
    return results


def _clients(m: _Member) -> int:
    t = m.fed.cfg.train
    return min(t.clients_per_round or m.fed.partition.num_clients, m.fed.partition.num_clients)


def _member(req: RunRequest, dataset, device, hook) -> tuple[_Member, list[Branch]]:
    """The member of a request, and the branches whose snapshot exists already."""
    if req.resume:
        prep = prepare_resume(req.run_dir, dataset=dataset, device=device)
    else:
        if req.cfg is None:
            raise UserError(f"run {req.run_dir}: a new run needs its config")
        prep = prepare_start(req.cfg, out=req.run_dir, dataset=dataset,
                             partition=req.partition, snapshot_rounds=req.snapshot_rounds,
                             device=device)
    branches: dict[int, list[Branch]] = {}
    for b in req.branches:
        if b.warmup_rounds not in prep.snapshot_rounds:
            raise UserError(f"branch {b.run_dir}: round {b.warmup_rounds} is not a snapshot "
                            f"round of {req.run_dir}")
        branches.setdefault(b.warmup_rounds, []).append(b)
    done = prep.state.round
    finished = done >= prep.fed.cfg.train.rounds and (req.run_dir / "summary.json").is_file()
    member = _Member(prep, None if finished else RunLog(prep, hook),
                     {t0: bs for t0, bs in branches.items() if t0 > done}, not finished)
    return member, [b for t0, bs in branches.items() if t0 <= done for b in bs]


def _branch(parent: _Member, b: Branch, dataset, device, log, hook) -> _Member | None:
    """The member of a T0 branch: forked from the parent's snapshot, or resumed where a killed
    group left it (``None`` when it is complete)."""
    if (b.run_dir / "summary.json").is_file():
        return None
    if (b.run_dir / "checkpoints" / "last.pt").is_file():
        prep = prepare_resume(b.run_dir, dataset=dataset, device=device)
    else:
        if b.run_dir.exists():  # created but killed before its first checkpoint
            shutil.rmtree(b.run_dir)
        snap = parent.prep.run_dir / "checkpoints" / f"round_{b.warmup_rounds}.pt"
        log(f"branch {b.run_dir} from {snap.name}")
        prep = prepare_start(b.cfg, out=b.run_dir, dataset=dataset,
                             partition=parent.fed.partition, branch=snap, device=device)
    return _Member(prep, RunLog(prep, hook), {})


def _close(m: _Member, status: str, message: str) -> RunResult:
    m.running = False
    return m.log.close(m.prep.state, status, message)
