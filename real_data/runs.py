"""Runs: check a config, write a run directory, train round by round, checkpoint, resume.

``start_run`` checks everything (config, data, partition, model, algorithm) before it creates
a directory, so a bad config writes nothing. Each round appends its rows to ``metrics.csv``
(each tagged with the round's stage) and then replaces ``checkpoints/last.pt``; ``resume_run``
drops rows newer than the checkpoint and continues, so a run killed at any point ends with the
same ``metrics.csv`` as an uninterrupted one. A non-finite loss stops the run, keeps the last
good checkpoint and records ``status: diverged`` in ``summary.json``. A run with
``algorithm.warmup=auto`` also forks probe continuations between rounds and rolls back to the
T0 they choose (:mod:`real_data.probe_runs`), resumable at any point as well.

One process writes a run directory at a time: :func:`prepare_start` locks it as it creates
it and :func:`prepare_resume` before it reads anything (:mod:`real_data.lock`);
:meth:`RunLog.close` or any exception releases the lock. A new run that fails to prepare
leaves no directory; an OS fault mid-run keeps ``last.pt`` and names the resume command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from linattn.configio import load_yaml
from linattn.errors import ConfigError, DataError, UserError
from linattn.fileio import atomic_write_json
from real_data import rundir
from real_data.checkpoint import load_checkpoint, restore_rng_states, save_checkpoint
from real_data.config import Config, config_from_dict, config_to_dict
from real_data.device import resolve_device
from real_data.federation import Diverged, Federation, FedState
from real_data.lock import RunLock
from real_data.memory import check_memory

RoundHook = Callable[[int, Path], None]
"""``on_round_end(round, run_dir)``: called once a round's rows are in ``metrics.csv`` and
before its checkpoint is written (where a kill tests resuming)."""


@dataclass(frozen=True)
class RunResult:
    """Outcome of a run: ``status`` is ``completed`` or ``diverged``."""

    run_dir: Path
    status: str
    rounds_completed: int
    message: str
    summary: dict


def load_data(cfg: Config):
    """The data set named by the config (``real_data.data.load_dataset``), on the CPU."""
    from real_data.data import load_dataset

    d = cfg.data
    opts = {k: v for k, v in (("train_limit", d.train_limit), ("test_limit", d.test_limit),
                              ("seq_len", d.seq_len)) if v is not None}
    return load_dataset(cfg.data.name, root=cfg.data.root, **opts)


def make_partition_for(cfg: Config, dataset):
    """The partition of the config, checked against the data set."""
    n_train = len(dataset.y_train)
    if cfg.partition.num_clients > n_train:
        raise ConfigError(f"partition.num_clients={cfg.partition.num_clients} exceeds the "
                          f"{n_train} training samples of {dataset.name}")
    from real_data.data import make_partition

    return make_partition(dataset, cfg.partition.scheme, num_clients=cfg.partition.num_clients,
                          seed=cfg.role_seed("partition"),
                          validation_fraction=cfg.partition.validation_fraction,
                          **cfg.partition.scheme_params())


def shifted(cfg: Config, dataset, partition) -> tuple:
    """``(dataset, partition)`` under ``partition.shift`` (:mod:`real_data.data.shift`): the
    run directory keeps the unshifted partition and the config, from which the shifted data
    are rebuilt. One copy per data set, partition and shift in this process, so stacked runs
    on one partition share it: the last :data:`SHIFTED_KEPT` are kept, and inside
    :func:`shared_shifts` (a stacked group) every one built there, each built once."""
    if cfg.partition.shift is None:
        return dataset, partition
    from real_data.data.shift import apply_shift

    key = (id(dataset), partition.seed, repr(sorted(cfg.partition.shift.items())),
           hash(np.concatenate([*partition.train, *partition.val]).tobytes()),
           hash(np.concatenate(partition.test).tobytes()))
    for cache in (_SCOPES[-1] if _SCOPES else {}, _SHIFTED):
        if key in cache and cache[key][0] is dataset:
            hit = cache[key]
            break
    else:
        hit = (dataset, apply_shift(dataset, partition, cfg.partition.shift))
    if _SCOPES:
        _SCOPES[-1][key] = hit
    _SHIFTED.pop(key, None)
    while len(_SHIFTED) >= SHIFTED_KEPT:
        _SHIFTED.pop(next(iter(_SHIFTED)))
    _SHIFTED[key] = hit
    return hit[1]


SHIFTED_KEPT = 8
_SHIFTED: dict[tuple, tuple] = {}
_SCOPES: list[dict] = []


@contextlib.contextmanager
def shared_shifts():
    """Inside: every shifted data set :func:`shifted` builds is kept until the block ends, so
    a stacked group builds each (data set, partition, shift) once, however many runs and
    distinct partitions it holds and in whatever order they come."""
    _SCOPES.append({})
    try:
        yield
    finally:
        _SCOPES.pop()


def resolve(cfg: Config, dataset) -> Config:
    """Fill role seeds and data-dependent model fields, so the written config is complete."""
    from real_data.models import complete_model_config

    seeds = dataclasses.replace(cfg.seeds, **{r: cfg.role_seed(r) for r in
                                              ("partition", "sampling", "training")})
    model = dataclasses.replace(cfg.model, params=complete_model_config(
        cfg.model.name, cfg.model.params, dataset.input_shape, dataset.num_classes))
    return dataclasses.replace(cfg, seeds=seeds, model=model)


def run_name(cfg: Config, fed: Federation) -> str:
    """A directory name that spells the key hyper-parameters."""
    p, t = cfg.partition, cfg.train
    split = {"dirichlet": f"dir{p.alpha:g}", "classes": f"cls{p.classes_per_client}"}.get(
        p.scheme, p.scheme)
    local = f"K{t.local_steps}" if t.local_steps is not None else f"E{t.local_epochs:g}"
    name = (f"{cfg.name}_{fed.algorithm.tag()}_{split}_N{p.num_clients}_{local}_"
            f"lr{t.lr:g}_T{t.rounds}_seed{cfg.seed}")
    return re.sub(r"[^A-Za-z0-9_.+-]", "-", name)


def _fresh_dir(base: Path) -> Path:
    path, i = base, 1
    while path.exists():
        i += 1
        path = base.with_name(f"{base.name}-{i}")
    return path


def start_run(cfg: Config, out: Path | None = None, dataset=None, partition=None,
              snapshot_rounds: tuple[int, ...] = (), branch: Path | None = None,
              trainer=None, on_round_end: RoundHook | None = None) -> RunResult:
    """Check everything, create the run directory, and train (:func:`prepare_start`, then
    :func:`train_prepared`)."""
    prep = prepare_start(cfg, out, dataset, partition, snapshot_rounds, branch, trainer)
    return train_prepared(prep, on_round_end)


def prepare_start(cfg: Config, out: Path | None = None, dataset=None, partition=None,
                  snapshot_rounds: tuple[int, ...] = (), branch: Path | None = None,
                  trainer=None, device: torch.device | None = None) -> Prepared:
    """Check everything and create the run directory of a new run (or a T0 branch).

    Parameters
    ----------
    cfg : Config
    out : Path, optional
        The run directory (must not exist); default ``run.out_dir/<name with settings>``.
    dataset, partition : optional
        Already loaded (sweeps load data once); otherwise from the config.
    snapshot_rounds : tuple of int
        Rounds whose state is kept as ``checkpoints/round_<t>.pt`` (T0 branching).
    branch : Path, optional
        Start from this checkpoint and copy the source run's metrics up to its round.
    trainer : optional
        Where each round's clients train (:class:`~real_data.federation.Federation`'s hook:
        ``real_data.distributed``, ``real_data.flower``); default this process.
    device : torch.device, optional
        Overrides ``train.device`` (a stacked group puts every run on its one device).
    """
    rundir.device_workers()  # a bad LINATTN_DEVICE_WORKERS fails here, not in the summary
    dataset = load_data(cfg) if dataset is None else dataset
    partition = make_partition_for(cfg, dataset) if partition is None else partition
    cfg = resolve(cfg, dataset)
    device = device or resolve_device(cfg.train.device)
    check_memory(cfg, dataset, partition, device)
    fed = Federation(cfg, *shifted(cfg, dataset, partition), device=device, trainer=trainer)
    fed.source_partition = partition
    _check_output_options(cfg)
    run_dir = Path(out) if out else _fresh_dir(Path(cfg.run.out_dir) / run_name(cfg, fed))
    lock = rundir.create_locked(run_dir)
    try:
        rundir.write_yaml(run_dir / "config.yaml", config_to_dict(cfg))
        from real_data.data import save_partition

        save_partition(partition, run_dir / "partition.npz")
        if snapshot_rounds:  # remembered, so that a resumed run still keeps them
            atomic_write_json(run_dir / rundir.SNAPSHOTS_FILE, sorted(set(snapshot_rounds)),
                              indent=None)
        state, elapsed = fed.initial_state(), 0.0
        if branch is not None:
            state, extra, _ = load_checkpoint(branch, fed.device)
            src = branch.parent.parent
            for name in ("metrics.csv", "timings.csv"):
                shutil.copy(src / name, run_dir / name)
                rundir.truncate_rows(run_dir / name, state.round)
            elapsed = extra.get("elapsed", 0.0)
        if 0 in snapshot_rounds and state.round == 0:
            save_checkpoint(run_dir / "checkpoints" / "round_0.pt", state, {"elapsed": 0.0})
    except BaseException as exc:  # a new run leaves nothing half-written
        lock.release()
        shutil.rmtree(run_dir, ignore_errors=True)
        if isinstance(exc, OSError):
            exc.add_note(f"nothing was kept of {run_dir}")
        raise
    return Prepared(fed, state, run_dir, elapsed, tuple(snapshot_rounds), lock)


def resume_run(run_dir: Path, trainer=None, on_round_end: RoundHook | None = None
               ) -> RunResult:
    """Continue a run from ``checkpoints/last.pt`` (or from the start if there is none).

    ``trainer``, ``on_round_end``: as in :func:`start_run`.
    """
    return train_prepared(prepare_resume(run_dir, trainer), on_round_end)


def prepare_resume(run_dir: Path, trainer=None, dataset=None,
                   device: torch.device | None = None) -> Prepared:
    """Load a run directory's config, partition and last checkpoint, and drop rows newer than
    the checkpoint (``dataset``: already loaded, for a stacked group)."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not a run directory (no config.yaml); give the folder "
                        "`linattn run` wrote")
    rundir.device_workers()  # a bad LINATTN_DEVICE_WORKERS fails here, not in the summary
    lock = RunLock.acquire(run_dir)  # before anything is read, so no writer is mid-round
    try:
        return _open_locked(run_dir, lock, trainer, dataset, device)
    except BaseException:
        lock.release()
        raise


def _open_locked(run_dir: Path, lock: RunLock, trainer, dataset, device) -> Prepared:
    saved = run_dir / "config.yaml"
    cfg = config_from_dict(load_yaml(saved), source=saved)
    dataset = load_data(cfg) if dataset is None else dataset
    from real_data.data import load_partition

    partition = load_partition(run_dir / "partition.npz")
    device = device or resolve_device(cfg.train.device)
    check_memory(cfg, dataset, partition, device)
    fed = Federation(cfg, *shifted(cfg, dataset, partition), device=device, trainer=trainer)
    fed.source_partition = partition
    ckpt = run_dir / "checkpoints" / "last.pt"
    state, elapsed = fed.initial_state(fresh=not ckpt.exists()), 0.0
    if ckpt.exists():
        state, extra, rng = load_checkpoint(ckpt, fed.device)
        if not 0 <= state.round <= cfg.train.rounds:
            raise DataError(f"{ckpt}: round {state.round} is not one of this run's 0.."
                            f"{cfg.train.rounds}; move it away to restart from round 0")
        restore_rng_states(rng)
        elapsed = extra.get("elapsed", 0.0)
    for name in ("metrics.csv", "timings.csv"):
        rundir.truncate_rows(run_dir / name, state.round)
    return Prepared(fed, state, run_dir, elapsed, rundir.read_snapshot_rounds(run_dir), lock)


def _check_output_options(cfg: Config) -> None:
    if cfg.run.tensorboard:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise ConfigError("run.tensorboard=true needs the tensorboard package; install it "
                              "or set run.tensorboard=false") from None


@dataclass
class Prepared:
    """A run ready to train: its federation, state and directory (:func:`prepare_start`,
    :func:`prepare_resume`)."""

    fed: Federation
    state: FedState
    run_dir: Path
    elapsed: float
    snapshot_rounds: tuple[int, ...]
    lock: RunLock | None = None  # the run directory's lock, released by RunLog.close


class RunLog:
    """Everything a run writes per round and at its end, so that a run trained alone and a run
    trained in a stacked group (:mod:`real_data.stacked_runs`) write the same files.

    Per round, in this order: the rows (each tagged with the round's stage) and the round's
    seconds, TensorBoard scalars, ``on_round_end``, then ``checkpoints/last.pt`` (every
    ``run.checkpoint_every`` rounds and at the end) and the T0 snapshots; resume drops rows
    newer than the checkpoint.
    """

    def __init__(self, prep: Prepared, on_round_end: RoundHook | None = None,
                 position: int | None = None) -> None:
        from tqdm import tqdm

        self.prep, self.on_round_end = prep, on_round_end
        fed, run_dir, state = prep.fed, prep.run_dir, prep.state
        self.cfg = fed.cfg
        self.metrics = rundir.CsvAppender(run_dir / "metrics.csv", rundir.HEADER)
        # a metrics.csv written without the stage column is continued in its own format
        self.tag_stage = "stage" in self.metrics.columns
        self.timings = rundir.CsvAppender(run_dir / "timings.csv", "round,seconds\n")
        self.board = _tensorboard(run_dir) if self.cfg.run.tensorboard else None
        self.elapsed = prep.elapsed
        self.best = (_best_so_far(run_dir / "metrics.csv")
                     if self.cfg.run.progress and state.round else (float("-inf"), 0))
        self.bar = tqdm(total=self.cfg.train.rounds, initial=state.round,
                        desc=run_dir.name[:40], disable=not self.cfg.run.progress, leave=True,
                        position=position)
        # the round checkpoints/last.pt holds (None: not written yet, e.g. a new run)
        self.saved_round = state.round if (run_dir / "checkpoints" / "last.pt").is_file() \
            else None

    def record(self, rnd: int, stage: str, state: FedState, records: list,
               seconds: float) -> None:
        """Write round ``rnd``'s rows, timing, checkpoint and snapshot (in that order)."""
        run_dir, cfg = self.prep.run_dir, self.cfg
        self.elapsed += seconds
        self.metrics.append([(*row, stage) for row in records] if self.tag_stage else records)
        self.timings.append([(rnd, seconds)])
        if self.board is not None:
            for _, client, key, value in records:
                if client == "global":
                    self.board.add_scalar(key, value, rnd)
        if self.on_round_end is not None:
            self.on_round_end(rnd, run_dir)
        if rnd % cfg.run.checkpoint_every == 0 or rnd == cfg.train.rounds:
            save_checkpoint(run_dir / "checkpoints" / "last.pt", state,
                            {"elapsed": self.elapsed})
            self.saved_round = rnd
        if rnd in self.prep.snapshot_rounds:
            save_checkpoint(run_dir / "checkpoints" / f"round_{rnd}.pt", state,
                            {"elapsed": self.elapsed})
        # progress: the last and the best test accuracy so far
        self.bar.update(1)
        acc = next((v for r, c, k, v in records if c == "global" and k == "test_acc"), None)
        if acc is not None:
            self.best = max(self.best, (acc, -rnd))
            self.bar.set_postfix({"stage": stage, "test_acc": f"{acc:.3f}",
                                  "best": f"{self.best[0]:.3f} (round {-self.best[1]})"})
        else:
            self.bar.set_postfix({"stage": stage})

    def diverged_message(self, exc: Diverged) -> str:
        """What a diverged run's summary says: the round, and the checkpoint that exists."""
        t = self.cfg.train
        if self.saved_round is None:
            return (f"{exc}; no checkpoint was written before it; lower train.lr (now {t.lr:g}) "
                    "or set train.clip_grad_norm")
        return f"{exc}; last good checkpoint: round {self.saved_round}"

    def close(self, state: FedState, status: str, message: str) -> RunResult:
        """Close the progress bar and TensorBoard, write ``summary.json`` and the plot, and
        release the run directory's lock (also when writing fails)."""
        try:
            self.bar.close()
            if self.board is not None:
                self.board.close()
            return _finish(self.prep.fed, state, self.prep.run_dir, self.elapsed, status,
                           message)
        finally:
            if self.prep.lock is not None:
                self.prep.lock.release()


def train_prepared(prep: Prepared, on_round_end: RoundHook | None = None) -> RunResult:
    """Train a prepared run alone, round by round, to its last round; the run directory's
    lock is released at the end, whatever happens."""
    try:
        result = _train(prep, on_round_end)
    except OSError as exc:  # disk full, read-only: last.pt stays at its last written round
        exc.add_note(f"once fixed, continue with `linattn run --resume {prep.run_dir}`")
        raise
    finally:
        if prep.lock is not None:
            prep.lock.release()
    if prep.fed.device.type == "cuda":
        release_device_caches()
    return result


def _train(prep: Prepared, on_round_end: RoundHook | None) -> RunResult:
    fed, state = prep.fed, prep.state
    log = RunLog(prep, on_round_end)
    status, message = "completed", ""
    if fed.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(fed.device)
    probes = None
    if fed.algorithm.forks_run:  # warmup=auto: probes, a decision and a roll-back
        from real_data.probe_runs import ProbeDriver

        probes = ProbeDriver(fed, prep.run_dir, log)
        probes.prepare_resume(state)
    while True:
        if probes is not None:
            try:
                state = probes.before_round(state)
            except Diverged as exc:
                status, message = "diverged", f"a probe continuation: {exc}"
                break
        rnd = state.round + 1
        if rnd > fed.cfg.train.rounds:
            break
        # 1. one round; on NaN keep the last good checkpoint and stop. plan_round depends only
        #    on (round, server state), so this is the plan run_round follows
        stage = fed.algorithm.plan_round(rnd, state.server_state).stage
        t_start = time.perf_counter()
        try:
            state, records = fed.run_round(state, rnd)
        except Diverged as exc:
            status, message = "diverged", log.diverged_message(exc)
            break
        if fed.device.type == "cuda":
            torch.cuda.synchronize(fed.device)
        # 2. rows first, then the checkpoint
        log.record(rnd, stage, state, records, time.perf_counter() - t_start)
    return log.close(state, status, message)


def release_device_caches() -> None:
    """Drop the fast engine's CUDA graphs and the allocator's cache: a run's graphs capture
    its own data tensors, so no later run can reuse them, and a worker that runs many runs
    would otherwise keep every run's graphs."""
    from real_data.engines import fast

    fast.clear_cache()
    torch.cuda.empty_cache()


def _best_so_far(metrics_path: Path) -> tuple[float, int]:
    """(best test accuracy, -its round) of the rows already written (a resumed run)."""
    acc = rundir.read_global_metrics(metrics_path).get("test_acc", [])
    return max(((v, -r) for r, v in acc), default=(float("-inf"), 0))


def _finish(fed, state, run_dir, elapsed, status, message) -> RunResult:
    summary = {"status": status, "message": message, "rounds_completed": state.round,
               "rounds_planned": fed.cfg.train.rounds, "wall_time_s": elapsed,
               "seconds_per_round": elapsed / max(state.round, 1),
               **rundir.summarize(run_dir / "metrics.csv"), **rundir.provenance(fed.device)}
    if fed.device.type == "cuda":
        summary["peak_memory_bytes"] = torch.cuda.max_memory_allocated(fed.device)
    summary.update(fed.algorithm.run_summary(state.server_state))
    rundir.write_json(run_dir / "summary.json", summary)
    if fed.cfg.run.plot and state.round > 0:
        rundir.plot_curves(run_dir / "metrics.csv", run_dir / "curves.png", run_dir.name)
        if summary.get("warmup", {}).get("rule") == "auto":
            rundir.plot_probe(summary["warmup"], run_dir / "curves_probe.png", run_dir.name)
    return RunResult(run_dir, status, state.round, message, summary)


def _tensorboard(run_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(run_dir / "tensorboard"))
