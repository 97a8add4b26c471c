"""Scale-out with torch.distributed: a round's clients sharded over processes (GPUs, nodes).

``linattn run --distributed`` under ``torchrun`` (see docs/scaleout.md). Every rank holds the
same global model and draws the same sampled ids (the central sampling seed, as on one
process); rank r trains the r-th contiguous block of them with the configured engine; ONE
collective per round then gives every rank what the single-process round loop would have
computed from all C clients, so the metrics, checkpoints and run directory are those of a
one-process run (equal to rounding: the sums are taken in another order).

The all-reduce (sum) of one float64 buffer per round, for algorithms whose server update is
the p-weighted average of the uploads (:data:`REDUCIBLE`), with Delta_m = y_m - x_t over the
trained tensors and p_m the round's aggregation weights (sum_m p_m = P, 1 up to rounding)::

    [ D = sum_{m in shard} p_m Delta_m  |  S2 = sum_{m in shard} p_m ||Delta_m||^2  |
      per-client rows (loss, objective, first loss, grad norms, steps), 0 outside the shard ]

so that the new global tensor is P x_t + D, the update norm is ||D|| and the dispersion of
``real_data.metrics.update_dispersion`` is sqrt(sum_m p_m ||Delta_m - D||^2)
= sqrt(S2 - (2 - P) ||D||^2). Any other algorithm (SCAFFOLD, FedTP, FedFrozen before an online
rule fixes T0, one registered later) gets an all-gather of the round's client results instead:
every rank then runs the algorithm's own update on all C clients (exact, but C x P numbers a
round). FedFrozen's ``warmup=auto`` forks probe continuations and rolls back, so it runs in one
process only (the federation refuses it here).

Rank 0 builds the run (config, partition, directory, checkpoints) with
:func:`real_data.runs.start_run` / :func:`~real_data.runs.resume_run` and is the only writer; it
sends the resolved config, the partition and the start state to the other ranks before its first
round (so a resume needs the run directory on rank 0's node only). Every rank loads the data set
itself. Dropout masks depend on how clients are batched: with dropout on, a sharded run equals
the one-process run in distribution only.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from linattn.configio import load_yaml
from linattn.errors import UserError
from real_data.engines import ClientResults
from real_data.federation import TrainedRound

REDUCIBLE: dict[str, Callable[[dict], bool]] = {
    "fedavg": lambda server_state: True,
    "fedprox": lambda server_state: True,
    "fedpart": lambda server_state: True,
    "fedsq": lambda server_state: True,
    # FedFrozen averages like FedAvg once T0 is known (before an online rule fires: gathered)
    "fedfrozen": lambda server_state: server_state.warmup_rounds is not None,
}
"""Algorithm name -> whether its round can be reduced to the p-weighted sum of the updates
(server update = base-class weighted average of the uploads plus bookkeeping on the ids; no
per-client state)."""

SCALARS = ("data_loss", "objective", "first_loss", "grad_norm_first", "grad_norm_last", "steps")


class ShardTrainer:
    """The round hook of :class:`~real_data.federation.Federation` for one rank.

    ``trainer(fed, state, rnd, plan, ids, weights) -> TrainedRound``: trains this rank's share
    of ``ids`` and combines all ranks' shares with one collective.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device) -> None:
        self.rank, self.world_size, self.device = rank, world_size, device
        self.started = rank != 0  # rank 0 sends the start state before its first round

    def shard(self, ids: np.ndarray) -> tuple[int, int]:
        """[lo, hi) of this rank's clients within the round's sorted ids (contiguous blocks)."""
        bounds = np.cumsum([0] + [len(b) for b in np.array_split(ids, self.world_size)])
        return int(bounds[self.rank]), int(bounds[self.rank + 1])

    def __call__(self, fed, state, rnd, plan, ids, weights):
        if not self.started:
            self.send_start(fed, state)
        if len(ids) < self.world_size:
            raise UserError(f"round {rnd} samples {len(ids)} clients for {self.world_size} "
                            "processes; set train.clients_per_round >= the number of processes")
        lo, hi = self.shard(ids)
        results = fed.train_clients(state, rnd, plan, ids[lo:hi])
        reducible = REDUCIBLE.get(fed.algorithm.name, lambda s: False)(state.server_state)
        if reducible:
            return self._reduce(state.global_params, plan.trainable, results, weights, lo,
                                len(ids))
        return TrainedRound(self._gather(state.global_params, plan.trainable, results, len(ids)),
                            weights)

    # -- the two collectives --------------------------------------------------------------
    def _reduce(self, global_params, names, results, weights, lo, n_clients):
        p = weights.double().to(self.device)
        own = p[lo:lo + len(results.steps)]
        sums, s2 = [], torch.zeros(1, dtype=torch.float64, device=self.device)
        for n in names:  # one tensor at a time: (C_own, P_n) float64 temporaries
            d = (results.params[n] - global_params[n].unsqueeze(0)).double().flatten(1)
            sums.append(own @ d)
            s2 += own @ d.pow(2).sum(1)
        sizes = [t.numel() for t in sums]
        rows = torch.zeros(len(SCALARS), n_clients, dtype=torch.float64, device=self.device)
        for i, key in enumerate(SCALARS):
            rows[i, lo:lo + len(own)] = getattr(results, key).double().to(self.device)
        buf = torch.cat([*sums, s2, rows.flatten()])
        dist.all_reduce(buf)
        flat_d, s2, rows = buf.split([sum(sizes), 1, rows.numel()])
        rows = rows.reshape(len(SCALARS), n_clients)
        total = float(p.sum())
        avg = {}
        for n, d in zip(names, flat_d.split(sizes)):
            x = global_params[n]
            avg[n] = (total * x.double() + d.reshape(x.shape)).to(x.dtype).unsqueeze(0)
        d_sq = float(flat_d.pow(2).sum())
        dispersion = float(np.sqrt(max(float(s2) - (2.0 - total) * d_sq, 0.0)))
        reduced = _results(avg, rows)
        # the average is one pseudo-client of weight 1: weighted_average returns it unchanged
        one = torch.ones(1, dtype=torch.float64, device=self.device)
        return TrainedRound(reduced, one, dispersion, float(np.sqrt(d_sq)))

    def _gather(self, global_params, names, results, n_clients) -> ClientResults:
        own = len(results.steps)
        width = max(len(b) for b in np.array_split(np.arange(n_clients), self.world_size))
        cols = [results.params[n].double().flatten(1) for n in names]
        cols += [getattr(results, k).double().to(self.device).unsqueeze(1) for k in SCALARS]
        local = torch.zeros(width, sum(c.shape[1] for c in cols), dtype=torch.float64,
                            device=self.device)
        local[:own] = torch.cat(cols, dim=1)
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local)
        counts = [len(b) for b in np.array_split(np.arange(n_clients), self.world_size)]
        table = torch.cat([part[:k] for part, k in zip(parts, counts)])  # (C, D)
        sizes = [global_params[n].numel() for n in names] + [1] * len(SCALARS)
        pieces = table.split(sizes, dim=1)
        params = {n: pieces[i].reshape(n_clients, *global_params[n].shape)
                  .to(global_params[n].dtype) for i, n in enumerate(names)}
        return _results(params, torch.cat(pieces[len(names):], dim=1).T)

    # -- start and end of a run -----------------------------------------------------------
    def send_start(self, fed, state) -> None:
        """Rank 0: the resolved config, the partition and the start state to every rank."""
        from real_data.config import config_to_dict

        self.started = True
        _broadcast({"config": config_to_dict(fed.cfg), "partition": fed.partition,
                    "state": _move(state, torch.device("cpu"))}, self.device)

    def send_stop(self, error: BaseException | None) -> None:
        """Rank 0: nothing to train (or it failed before its first round); release the ranks."""
        if not self.started:
            self.started = True
            _broadcast({"error": None if error is None else f"{type(error).__name__}: {error}"},
                       self.device)


def _results(params: dict[str, torch.Tensor], rows: torch.Tensor) -> ClientResults:
    """ClientResults from parameters and the ``(len(SCALARS), C)`` per-client rows."""
    cols = dict(zip(SCALARS, rows))
    return ClientResults(params=params, data_loss=cols["data_loss"],
                         objective=cols["objective"], first_loss=cols["first_loss"],
                         grad_norm_first=cols["grad_norm_first"],
                         grad_norm_last=cols["grad_norm_last"],
                         steps=cols["steps"].round().long().cpu())


def _broadcast(payload, device: torch.device):
    box = [payload]
    dist.broadcast_object_list(box, src=0, device=device)
    return box[0]


def _move(obj, device: torch.device):
    """A copy of nested dicts/lists/dataclasses of tensors with every tensor on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, torch.nn.Module):  # a copy: the sender keeps its own on its device
        return copy.deepcopy(obj).to(device)
    if isinstance(obj, dict):
        return {k: _move(v, device) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_move(v, device) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _move(getattr(obj, f.name), device)
                                           for f in dataclasses.fields(obj)})
    return obj


# -- launching ------------------------------------------------------------------------------
def init_from_env(timeout: timedelta | None = None) -> ShardTrainer:
    """Join the process group that ``torchrun`` describes (RANK, WORLD_SIZE, LOCAL_RANK, ...).

    NCCL and ``cuda:LOCAL_RANK`` when CUDA is available, else gloo on the CPU; ``timeout``
    bounds every collective (torch's default when ``None``).
    """
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
               if k not in os.environ]
    if missing:
        raise UserError(f"--distributed needs the torchrun environment ({', '.join(missing)} "
                        "unset); launch with: torchrun --nproc_per_node=2 -m linattn run "
                        "--distributed --config ...")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return ShardTrainer(dist.get_rank(), dist.get_world_size(), device)


def _check_device(cfg, trainer: ShardTrainer) -> None:
    from linattn.errors import ConfigError

    want = cfg.train.device
    ok = want in ("auto", "cuda") if trainer.device.type == "cuda" else want in ("auto", "cpu")
    if not ok:
        allowed = "auto or cuda" if trainer.device.type == "cuda" else "auto or cpu"
        raise ConfigError(f"train.device={want} under --distributed: each process uses "
                          f"{trainer.device.type} (its LOCAL_RANK device); allowed: {allowed}")
    if cfg.partition.shift is not None:
        raise ConfigError("partition.shift is not supported under --distributed (the other "
                          "ranks would train on the unshifted data); run it in one process or "
                          "as a stacked sweep")


def run_distributed(cfg=None, out: Path | None = None, resume: Path | None = None,
                    on_round_end=None):
    """One run over every process of the torchrun job; rank 0 returns the RunResult, others None.

    Parameters
    ----------
    cfg : Config, optional
        A new run's config (as :func:`~real_data.runs.start_run`); ``None`` with ``resume``.
    out : Path, optional
        The new run's directory.
    resume : Path, optional
        A run directory to continue (read by rank 0 only).
    on_round_end : callable, optional
        Rank 0's round hook (as :func:`~real_data.runs.start_run`).
    """
    trainer = init_from_env()
    finished = False
    try:
        result = None
        if trainer.rank == 0:
            result = _lead(trainer, cfg, out, resume, on_round_end)
        else:
            _follow(trainer)
        finished = True
        return result
    finally:
        close_process_group(finished)


def close_process_group(in_step: bool = True) -> None:
    """Tear down the default process group; every rank meets at a barrier first when ``in_step``.

    Without the barrier a rank that leaves early closes its gloo pairs while a peer still
    writes to them, and gloo's worker threads can abort the process at exit. A rank leaving on
    an error skips the barrier (its peers may never reach it).
    """
    if not dist.is_initialized():
        return
    if in_step:
        dist.barrier()
    dist.destroy_process_group()


def _lead(trainer: ShardTrainer, cfg, out, resume, on_round_end=None):
    from real_data import rundir
    from real_data.runs import resume_run, start_run

    try:
        if resume is not None:
            saved = Path(resume) / "config.yaml"
            if saved.exists():  # otherwise resume_run raises the right error

                from real_data.config import config_from_dict

                _check_device(config_from_dict(load_yaml(saved)), trainer)
            result = resume_run(resume, trainer=trainer, on_round_end=on_round_end)
        else:
            _check_device(cfg, trainer)
            result = start_run(cfg, out=out, trainer=trainer, on_round_end=on_round_end)
    except BaseException as exc:
        trainer.send_stop(exc)
        raise
    trainer.send_stop(None)
    result.summary["distributed"] = {"world_size": trainer.world_size,
                                     "backend": dist.get_backend()}
    rundir.write_json(result.run_dir / "summary.json", result.summary)
    return result


def _follow(trainer: ShardTrainer) -> None:
    from real_data.config import config_from_dict
    from real_data.federation import Diverged, Federation
    from real_data.runs import load_data

    start = _broadcast(None, trainer.device)
    if "error" in start:
        if start["error"] is None:
            return
        raise UserError(f"rank {trainer.rank}: rank 0 stopped before training ({start['error']})")
    cfg = config_from_dict(start["config"])
    fed = Federation(cfg, load_data(cfg), start["partition"], device=trainer.device,
                     trainer=trainer)
    fed.initial_state()  # the algorithm sets itself up as on rank 0, then takes rank 0's state
    state = _move(start["state"], trainer.device)
    for rnd in range(state.round + 1, cfg.train.rounds + 1):
        try:
            state, _ = fed.run_round(state, rnd)
        except Diverged:  # rank 0 sees the same reduced values and stops too
            return
