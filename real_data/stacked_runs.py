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

A run that forks probe continuations and rolls back (``algorithm.warmup=auto``,
:mod:`real_data.probe_runs`) trains in the group: before a round, the forking runs that probe
there fork their continuations and train them together (probe round s of every run in one
engine call, :func:`~real_data.probe_runs.probe_together`), each then decides and rolls back
on its own, and a rolled-back run goes on from its T0 beside runs at other rounds (each run's
round, lr and draws are its own). It closes once its decision at T is made. No T0 branch forks
from it.

A run's result depends only on its own config, not on the group it trains in (up to the order
of summation in batched kernels: tests hold stacked and per-run metrics within 1e-6 in float64).
A killed group resumes from each run's last checkpoint; runs checkpointed at the same rounds
resume in the same groups, so the resumed metrics equal the uninterrupted ones byte for byte.
A kill between two runs' writes of one round leaves them a round apart: the run behind redoes
that round in a smaller batch, within the batched kernels' rounding of the uninterrupted
values. Probes are the exception that matters (a probe's curve decides T0): a forking run
whose probe was not recorded probes again beside the runs that recorded theirs at that round,
so its curve is the uninterrupted one byte for byte.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
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
from real_data.probe_runs import ProbeDriver, probe_together
from real_data.runs import (
    Prepared,
    RoundHook,
    RunLog,
    RunResult,
    prepare_resume,
    prepare_start,
    release_device_caches,
    shared_shifts,
)
from real_data.stacking import clear_pool, train_jobs

FAILED = object()  # what run_group's guard gives for a run that failed and left the group


@dataclass(frozen=True)
class Branch:
    """A T0 branch: ``cfg`` started at ``run_dir`` (``None``: named after its settings under
    ``run.out_dir``) from the parent's snapshot of round ``warmup_rounds``; ``label`` comes
    back with its result."""

    warmup_rounds: int
    cfg: Config
    run_dir: Path | None
    label: object = None


@dataclass(frozen=True)
class RunRequest:
    """One run of a group: a new run (``cfg``; ``run_dir=None`` names it after its settings)
    or one to resume (``resume=True``), with the rounds to snapshot, the branches to fork from
    those snapshots, and a ``label`` that comes back with its result."""

    run_dir: Path | None
    cfg: Config | None = None
    resume: bool = False
    snapshot_rounds: tuple[int, ...] = ()
    branches: tuple[Branch, ...] = ()
    partition: object = None
    label: object = None


@dataclass
class _Member:
    prep: Prepared
    log: RunLog | None
    branches: dict[int, list[Branch]] = field(default_factory=dict)
    running: bool = True
    label: object = None
    probes: object = None  # a forking run's ProbeDriver (algorithm.warmup=auto)

    @property
    def fed(self):
        return self.prep.fed


def forks_run(cfg: Config) -> bool:
    """A run that forks probe continuations and rolls back (FedFrozen with
    ``algorithm.warmup=auto``, :mod:`real_data.probe_runs`): no T0 branch can fork from it,
    and in a group it carries a fork per probe (:func:`estimate_run_bytes`)."""
    from real_data.algorithms import get_algorithm

    return get_algorithm(cfg.algorithm.name).forks_with(cfg.algorithm.params)


def stack_key(cfg: Config) -> tuple:
    """Runs with equal keys can train in one group: the same model architecture, data set,
    precision, device, engine, minibatch size, local steps and optimizer (up to its lr)."""
    t = cfg.train
    return (cfg.model.name, repr(cfg.model.params), repr(cfg.data), t.precision, t.device,
            t.engine, t.batch_size, t.local_steps, t.local_epochs, t.optimizer, t.momentum,
            t.weight_decay, t.clip_grad_norm)


STACK_PAD_ENV = "LINATTN_STACK_PAD"
STACK_PADS = ("group", "live")


def stack_pad_mode(pad: str | None = None) -> str:
    """How an eager group pads its engine calls: ``pad``, else ``LINATTN_STACK_PAD``, else
    ``"group"``. Raises ``UserError`` naming the variable for any other value."""
    mode = pad if pad is not None else os.environ.get(STACK_PAD_ENV, "group")
    if mode not in STACK_PADS:
        source = "pad" if pad is not None else STACK_PAD_ENV
        raise UserError(f"{source}={mode!r}: one of {', '.join(STACK_PADS)} (group: every "
                        "engine call padded to the group's largest membership; live: to the "
                        "runs training in the round)")
    return mode


COMPILE_PAYS_RUN_ROUNDS = 2000
"""Run-rounds from which a CUDA group of ``train.engine=vectorized`` runs compiles its engine
(``compile="auto"``): on an H200 the compiled engine saves about 23 ms per run-round of the
study's Fashion-MNIST ViT (45-run group: 37 ms eager, 14 ms compiled), so 2000 run-rounds save
about 46 s, the order of one compilation (tens of seconds per chunk shape, docs/bench/NOTES.md)."""


def _run_rounds(members: list[_Member]) -> int:
    """Run-rounds a group still trains: its runs' remaining rounds and their branches'."""
    total = 0
    for m in members:
        if m.running:
            r = m.fed.cfg.train.rounds
            total += r - m.prep.state.round + sum((r - t0) * len(bs)
                                                  for t0, bs in m.branches.items())
    return total


def run_group(requests: list[RunRequest], dataset=None, device: torch.device | None = None,
              log: Callable[[str], None] = print,
              on_round_end: RoundHook | None = None,
              on_error: Callable[[object, Exception], None] | None = None,
              compile: str = "auto", pad: str | None = None
              ) -> list[tuple[object, RunResult]]:
    """Train the runs of ``requests`` (and their branches) as one stacked group.

    ``dataset``: loaded once by the caller and shared by every run (one copy on the device).
    ``compile``: ``"auto"`` compiles the stacked engine (``torch.compile``) for a CUDA group
    of ``train.engine=vectorized`` runs with at least :data:`COMPILE_PAYS_RUN_ROUNDS`
    run-rounds to train, where the compilation pays for itself; ``"always"`` and ``"never"``
    decide it regardless (``train.engine=vectorized_compiled`` always compiles).
    ``pad`` (default ``LINATTN_STACK_PAD``, else ``"group"``): ``"group"`` pads every engine
    call to the group's largest membership (every run and every branch still to fork), one
    shape for the group's life; ``"live"`` pads an eager group's calls only to the runs
    training in the round, so a T0 family does not train its unforked branches' clients as
    padding from round 1 (each new membership then captures its own CUDA graph, and the
    previous shape's graphs are released, so runs whose client count changes from round to
    round capture a graph each round). A compiled group pads as ``"group"`` either way: each
    new shape would compile again.
    ``log``: a line once the group is prepared, before its first round (its runs, engine and
    preparation seconds), and one per branch forked or skipped.
    ``on_round_end(round, run_dir)``: as in :func:`~real_data.runs.start_run`, for every run.
    ``on_error(label, exception)``: a run whose preparation, server update, round records
    (evaluation, a freeze rule's observation) or files fail is reported here and leaves the
    group while the others go on (without it, the error propagates); a user error (a bad
    config or file) always propagates, and a diverged run closes as diverged.
    Returns ``(label, result)`` of every run and branch trained here, in the order they
    finished (a request or branch finished before the call returns nothing).
    """
    if compile not in ("auto", "always", "never"):
        raise ValueError(f"compile={compile!r}: one of 'auto', 'always', 'never'")
    pad = stack_pad_mode(pad)
    with shared_shifts():  # each shifted data set of the group built once
        try:
            return _run_group(requests, dataset, device, log, on_round_end, on_error, compile,
                              pad)
        finally:
            clear_pool()  # the group's pooled training data (shifted runs)


def _run_group(requests, dataset, device, log, on_round_end, on_error, compile, pad_mode
               ) -> list[tuple[object, RunResult]]:
    def guarded(label, fn, *args):
        """``fn(*args)``; with ``on_error``, a failure is reported and gives ``FAILED``."""
        if on_error is None:
            return fn(*args)
        try:
            return fn(*args)
        except (UserError, Diverged):
            raise  # a bad config or file stops the group; a diverged run closes as such
        except Exception as exc:  # noqa: BLE001 - one broken run leaves, the others go on
            on_error(label, exc)
            return FAILED

    t_prepare = time.perf_counter()
    for r in requests:
        if r.branches and forks_run(r.cfg if r.cfg is not None else _saved_config(r.run_dir)):
            raise UserError(f"run {r.run_dir}: algorithm.warmup=auto decides its own T0 and "
                            "rolls back, so no T0 branch can fork from it")
    members, now = [], []
    for r in requests:
        got = guarded(r.label if r.label is not None else r.run_dir, _member, r, dataset,
                      device, on_round_end)
        if got is not FAILED:
            members.append(got[0])
            now += [(got[0], b) for b in got[1]]
    results: list[tuple[object, RunResult]] = []
    members += [b for m, br in now if (b := guarded(br.label, _branch, m, br, dataset, device,
                                                     log, on_round_end)) not in (None, FAILED)]
    pad = sum(_clients(m) * (1 + sum(len(v) for v in m.branches.values()))
              for m in members if m.running)
    engine = members[0].fed.cfg.train.engine if members else "vectorized"
    cuda = any(m.fed.device.type == "cuda" for m in members)
    if engine == "vectorized" and compile == "auto":
        compiled = cuda and _run_rounds(members) >= COMPILE_PAYS_RUN_ROUNDS
    else:
        compiled = engine == "vectorized_compiled" or compile == "always"
    stacked = (None if engine == "sequential" else
               (lambda job: fast.train_fast(job, compile=True)) if compiled else fast.train_fast)
    live = pad_mode == "live" and not compiled
    if members:
        log(f"stacked group of {len(members)} runs: {'compiled' if compiled else 'eager'} "
            f"engine, calls padded to {'the round' if live else 'the group'}, prepared in "
            f"{time.perf_counter() - t_prepare:.1f} s")
    for m in members:
        if m.fed.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(m.fed.device)
    probe_pad = sum(_clients(m) for m in members if m.running and m.probes is not None)
    live_clients = None
    while any(m.running for m in members):
        # the forking runs' probes due before this round, together; then each decides
        # (a decision at T, or where its selector stops, may roll it back to its T0)
        forking = [m for m in members if m.running and m.probes is not None]
        due = [m for m in forking if m.probes.probe_due(m.prep.state)]
        # a resumed group whose kill fell between the runs' records of one probe round probes
        # again beside the runs that recorded theirs (results dropped), so every run's curve
        # comes from the batch it came from uninterrupted; padded to the forking runs'
        # clients at the start, so every probe round has one shape
        rounds = {m.prep.state.round for m in due}
        batch = [m for m in forking if m in due or (
            m.prep.state.round in rounds and m.probes.probed_here(m.prep.state))]
        probed = dict(zip(map(id, batch), probe_together(
            [(m.probes, m.prep.state) for m in batch], stacked, probe_pad) if due else []))
        probed = {k: v for k, v in probed.items() if any(id(m) == k for m in due)}
        for m in forking:
            got = probed.get(id(m))
            if isinstance(got, Diverged):
                results.append(_close(m, "diverged", f"a probe continuation: {got}"))
                continue
            if isinstance(got, Exception):  # its continuation broke: it leaves (or raises)
                guarded(m.label, _raise, got)
                _leave(m)
                continue
            try:
                state = guarded(m.label, m.probes.before_round, m.prep.state, got)
            except Diverged as exc:
                results.append(_close(m, "diverged", f"a probe continuation: {exc}"))
                continue
            if state is FAILED:
                _leave(m)
                continue
            m.prep = dataclasses.replace(m.prep, state=state)
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
        if live:  # the round's clients: a new shape leaves the old graphs unused
            clients = sum(len(w.ids) for _, _, w in works)
            if clients != live_clients and live_clients is not None and cuda:
                fast.release_graphs()
            live_clients = clients
        trained = train_jobs([w.job for _, _, w in works], [m.fed.engine for m in active],
                             stacked, pad_clients=None if live else pad)
        for m, rnd, _ in works:
            m.fed.prefetch(rnd + 1)
            m.fed.model.eval()
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t_start
        total_clients = sum(len(w.ids) for _, _, w in works)
        # 3. each run's server update; the evaluations in one stacked pass; each run's files
        updated = []
        for (m, rnd, work), res in zip(works, trained):
            t_run = time.perf_counter()
            try:
                got = guarded(m.label, m.fed.update_round, m.prep.state, rnd, work, res)
            except Diverged as exc:
                results.append(_close(m, "diverged", m.log.diverged_message(exc)))
                continue
            if got is FAILED:
                _leave(m)
                continue
            state, pending = got
            updated.append((m, rnd, work, state, pending, time.perf_counter() - t_run))
        t_eval = time.perf_counter()
        evaluated = evaluate_group([(m.fed, state) for m, rnd, _, state, _, _ in updated
                                    if m.fed.evaluates(rnd)], compiled and cuda)
        share = (time.perf_counter() - t_eval) / max(len(evaluated), 1)
        for m, rnd, work, state, pending, t_own in updated:
            t_run = time.perf_counter()
            hits = evaluated.get(id(m.fed))
            records = guarded(m.label, m.fed.round_records, state, pending,
                              None if hits is None else (lambda s, h=hits: h))
            if records is FAILED:  # its evaluation or round observation broke: it leaves
                _leave(m)
                continue
            own = (seconds * len(work.ids) / total_clients + t_own
                   + (share if hits is not None else 0.0) + time.perf_counter() - t_run)
            m.prep = dataclasses.replace(m.prep, state=state)
            if guarded(m.label, m.log.record, rnd, work.plan.stage, state, records,
                       own) is FAILED:
                _leave(m)
                continue
            if rnd >= m.fed.cfg.train.rounds and m.probes is None:  # a forking run decides
                results.append(_close(m, "completed", ""))         # at T, next pass
            # 4. branches fork from the snapshot just written
            for b in m.branches.pop(rnd, []):
                branch = guarded(b.label, _branch, m, b, dataset, device, log, on_round_end)
                if branch not in (None, FAILED):
                    members.append(branch)
    if cuda:
        release_device_caches()
    return results


def evaluate_group(items: list[tuple], compiled: bool = False
                   ) -> dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per-sample loss and accuracy of several runs' global models on each split they evaluate
    (:meth:`~real_data.federation.Federation.eval_splits`), one stacked forward per minibatch
    for the runs that share a model, the split's samples and the plain forward
    (``{id(federation): {split: (loss, hit)}}``; ``compiled``: the forward compiled, see
    :func:`~real_data.metrics.evaluate_stacked`); the rest is left to each run's own
    evaluation."""
    from real_data.algorithms.base import Algorithm
    from real_data.engines.stacked import supports
    from real_data.metrics import evaluate_stacked

    groups: dict[tuple, list[tuple]] = {}
    for fed, state in items:
        if not (type(fed.algorithm).forward is Algorithm.forward and supports(fed.model)):
            continue
        for split, (x, y) in fed.eval_splits().items():
            key = (split, id(x), id(y), type(fed.model), repr(fed.cfg.model.params),
                   fed.autocast, fed.cfg.eval.batch_size)
            groups.setdefault(key, []).append((fed, state, x, y))
    out: dict[int, dict] = {}
    for key, members in groups.items():
        if len(members) < 2:
            continue
        fed0, _, x, y = members[0]
        params = {n: torch.stack([m[1].global_params[n] for m in members])
                  for n in members[0][1].global_params}
        loss, hit = evaluate_stacked(fed0.model, params, x, y, fed0.cfg.eval.batch_size,
                                     fed0.autocast, compiled=compiled)
        for i, (fed, *_rest) in enumerate(members):
            out.setdefault(id(fed), {})[key[0]] = (loss[i], hit[i])
    return out


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
    finished = done >= prep.fed.cfg.train.rounds and (prep.run_dir / "summary.json").is_file()
    if finished and prep.lock is not None:  # kept only as the source of its snapshots
        prep.lock.release()
    member = _Member(prep, None if finished else RunLog(prep, hook),
                     {t0: bs for t0, bs in branches.items() if t0 > done}, not finished,
                     req.label)
    if not finished and prep.fed.algorithm.forks_run:  # warmup=auto: probes and a decision
        member.probes = ProbeDriver(prep.fed, prep.run_dir, member.log)
        member.probes.prepare_resume(prep.state)
    return member, [b for t0, bs in branches.items() if t0 <= done for b in bs]


def _branch(parent: _Member, b: Branch, dataset, device, log, hook) -> _Member | None:
    """The member of a T0 branch: forked from the parent's snapshot, or resumed where a killed
    group left it (``None`` when it is complete)."""
    snap = parent.prep.run_dir / "checkpoints" / f"round_{b.warmup_rounds}.pt"
    if b.run_dir is None:
        if not snap.is_file():
            log(f"no snapshot {snap} (the parent stopped before it): branch not run")
            return None
        prep = prepare_start(b.cfg, dataset=dataset, partition=parent.fed.source_partition,
                             branch=snap, device=device)
        return _Member(prep, RunLog(prep, hook), {}, label=b.label)
    if (b.run_dir / "summary.json").is_file():
        return None
    if not snap.is_file() and not (b.run_dir / "checkpoints" / "last.pt").is_file():
        log(f"no snapshot for {b.run_dir} ({snap.name} missing: the parent stopped before "
            "it): not run")
        return None
    if (b.run_dir / "checkpoints" / "last.pt").is_file():
        prep = prepare_resume(b.run_dir, dataset=dataset, device=device)
    else:
        if b.run_dir.exists():  # created but killed before its first checkpoint
            shutil.rmtree(b.run_dir)
        log(f"branch {b.run_dir} from {snap.name}")
        prep = prepare_start(b.cfg, out=b.run_dir, dataset=dataset,
                             partition=parent.fed.source_partition, branch=snap, device=device)
    return _Member(prep, RunLog(prep, hook), {}, label=b.label)



def _raise(exc: Exception) -> None:
    raise exc


def _leave(m: _Member) -> None:
    """A failed run leaves the group: its progress bar and TensorBoard closed and its run
    directory's lock released now (its files stay as the last checkpoint left them, so the
    next call resumes it); no summary is written."""
    m.running = False
    with contextlib.suppress(Exception):  # its own files may be what broke
        m.log.bar.close()
    with contextlib.suppress(Exception):
        if m.log.board is not None:
            m.log.board.close()
    if m.prep.lock is not None:
        m.prep.lock.release()


def _close(m: _Member, status: str, message: str) -> tuple[object, RunResult]:
    m.running = False
    return m.label, m.log.close(m.prep.state, status, message)


def estimate_run_bytes(cfg: Config, num_params: int) -> int:
    """Device memory one run adds to a stacked group, in bytes (an upper estimate).

    Per client of a round: its start values, trainable copy, gradient and optimizer state
    (``(C, P)`` each, 4 + 1 momentum or 2 Adam buffers); per run: the global model, a
    checkpoint copy and the algorithm's per-client state (as large as the model per client,
    for SCAFFOLD).
    """
    t = cfg.train
    width = 8 if t.precision == "fp64" else 4
    buffers = 4 + (2 if t.optimizer == "adam" else 1 if t.momentum else 0)
    clients = t.clients_per_round or cfg.partition.num_clients
    per_run = 3 + (cfg.partition.num_clients if cfg.algorithm.name == "scaffold" else 0)
    forks = 2 if forks_run(cfg) else 1  # a probe continuation trains a second copy
    return width * num_params * (clients * buffers + per_run) * forks


def plan_groups(requests: list[RunRequest], num_params: Callable[[Config], int],
                free_bytes: int, max_runs: int = 64,
                fraction: float = 0.5) -> list[list[RunRequest]]:
    """Split ``requests`` into stacked groups: runs of one :func:`stack_key` together (in
    order), each group's runs (branches counted) within ``fraction`` of ``free_bytes`` and at
    most ``max_runs``. A run that cannot fit alone is a :class:`UserError` naming it."""
    groups: dict[tuple, list[list[RunRequest]]] = {}
    budget = fraction * free_bytes
    for r in requests:
        cfg = r.cfg if r.cfg is not None else _saved_config(r.run_dir)
        need = estimate_run_bytes(cfg, num_params(cfg)) * (1 + len(r.branches))
        if need > budget:
            raise UserError(f"run {r.run_dir} needs about {need / 2**30:.2f} GiB in a group "
                            f"({1 + len(r.branches)} runs with its branches), more than "
                            f"{budget / 2**30:.2f} GiB available; lower "
                            "train.clients_per_round or use a larger device")
        chunks = groups.setdefault(stack_key(cfg), [[]])
        last = chunks[-1]
        used = sum(estimate_run_bytes(c := q.cfg if q.cfg is not None else
                                      _saved_config(q.run_dir), num_params(c))
                   * (1 + len(q.branches)) for q in last)
        runs = sum(1 + len(q.branches) for q in last)
        if last and (used + need > budget or runs + 1 + len(r.branches) > max_runs):
            chunks.append([])
        chunks[-1].append(r)
    return [c for chunks in groups.values() for c in chunks if c]


def _saved_config(run_dir: Path) -> Config:
    from linattn.configio import load_yaml
    from real_data.config import config_from_dict

    return config_from_dict(load_yaml(run_dir / "config.yaml"))


def free_bytes(device: torch.device) -> int:
    """Memory a group may use on ``device``: free CUDA memory, or available host memory."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def group_for_device(requests: list[RunRequest], dataset,
                     max_runs: int = 64) -> list[list[RunRequest]]:
    """:func:`plan_groups` sized by a probe of the first run's model and its device."""
    from real_data.device import resolve_device
    from real_data.memory import parameter_count
    from real_data.models import complete_model_config

    if not requests:
        return []
    counts: dict[str, int] = {}

    def num_params(cfg: Config) -> int:
        key = repr((cfg.model.name, cfg.model.params))
        if key not in counts:
            mcfg = complete_model_config(cfg.model.name, cfg.model.params, dataset.input_shape,
                                         dataset.num_classes)
            counts[key] = parameter_count(mcfg)
        return counts[key]

    first = requests[0].cfg if requests[0].cfg is not None else _saved_config(
        requests[0].run_dir)
    return plan_groups(requests, num_params, free_bytes(resolve_device(first.train.device)),
                       max_runs)
