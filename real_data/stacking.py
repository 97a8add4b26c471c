"""Run stacking: one round of several runs trained as one engine call.

The runs of a sweep that share a model architecture and a data set differ in what the engine
sees only through data: start values, minibatch indices, the learning rate and which
parameters train. So their sampled clients go on one client axis, as a single run's clients
already do, and the fast engine trains them together:

1. every parameter of every client starts at its own run's global value (``overrides``),
2. the trainable set is the union of the runs' trainable sets; a per-client mask keeps each
   client's gradient (and so its norm, clipping, weight decay and update) to its own run's set,
3. each client steps with its own run's learning rate (a tensor, so a change of lr never
   recompiles or recaptures),
4. the round's minibatch plans are concatenated (padded to the longest with idle steps); runs
   whose training tensors differ (shifted data sets: each partition and shift relabels or
   transforms the data its own way, :mod:`real_data.data.shift`) index one pooled copy of
   their tensors, each run's indices offset to its own block (:func:`pooled_data`; built
   once per set of tensors, so a group's call keeps one data tensor from round to round),
5. a run whose algorithm adds a local term expressible per client (``local_terms``: FedProx's
   proximal weight, SCAFFOLD's gradient offset c - c_m) or a step correction brings it as data:
   per-client offsets, weights and corrections, zero for the other runs.

In exact arithmetic each client computes what it computes in its own run: masked entries are
exact zeros, and the only difference is the order of summation inside batched kernels. Jobs that
the fast path cannot stack (a forward of the algorithm's own, a regularizer or per-client state
not expressed as local terms, a model without the stacked forward, dropout) are trained one by
one in the same round.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from real_data.algorithms.base import Algorithm
from real_data.engines import fast
from real_data.engines.base import Batches, ClientResults, LocalJob, step_correction


def stackable(job: LocalJob) -> bool:
    """True when ``job`` can share an engine call with other runs' jobs.

    The algorithm must use the model's own forward; its regularizer must be zero, or be what
    its ``local_terms`` describe (FedProx, SCAFFOLD: defined by the class that defines
    ``local_terms``, so a subclass that changes the regularizer is not taken), and so must any
    per-client state it holds; it gives no per-client start values; the model needs the stacked
    forward; dropout must be off (its random stream is per engine call).
    """
    algo = type(job.algorithm)
    owner = next((c for c in algo.__mro__ if "local_terms" in vars(c)), None)
    termed = owner is not None and algo.regularizer is owner.regularizer
    return (algo.forward is Algorithm.forward
            and (algo.regularizer is Algorithm.regularizer or termed)
            and (not job.client_state or termed) and not job.overrides and job.lr is None
            and not job.train_mask and not job.stacked_terms and fast.supports(job)
            and not job.model.training)


def compatible(a: LocalJob, b: LocalJob) -> bool:
    """True when two stackable jobs can go into one engine call (their data may be different
    tensors of one shape per sample, dtype and device: :func:`pooled_data`)."""
    sa, sb = a.optimizer, b.optimizer
    same_spec = dataclasses.replace(sa, lr=0.0) == dataclasses.replace(sb, lr=0.0)
    shapes = {n: tuple(t.shape) for n, t in a.global_params.items()}
    return (same_spec and _same_kind(a.x, b.x) and _same_kind(a.y, b.y)
            and a.autocast == b.autocast
            and shapes == {n: tuple(t.shape) for n, t in b.global_params.items()}
            and next(iter(a.global_params.values())).dtype
            == next(iter(b.global_params.values())).dtype
            and type(a.model) is type(b.model)
            and a.batches.idx.shape[2] == b.batches.idx.shape[2])


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape[1:] == b.shape[1:] and a.dtype == b.dtype
                      and a.device == b.device)


_POOL: dict[str, tuple] = {}  # "last": (pairs, x, y, offsets by (id(x), id(y)))


def pooled_data(pairs: list[tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor, dict[tuple[int, int], int]]:
    """One ``(x, y)`` holding every distinct pair of ``pairs`` (training inputs and labels of
    stacked runs) one after another, and the row where each pair starts (by the ids of its
    tensors). A single pair is returned as it is. The last pool is kept, and serves any call
    whose pairs it holds (a group whose runs finish keeps its data tensor, and so its CUDA
    graphs); a call with a new pair pools the old pairs and the new ones again;
    :func:`clear_pool` drops it."""
    distinct: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    for x, y in pairs:
        distinct.setdefault((id(x), id(y)), (x, y))
    if len(distinct) == 1:
        (key, (x, y)), = distinct.items()
        return x, y, {key: 0}
    last = _POOL.get("last")
    if last is not None and all(k in last[3] and last[0][k][0] is x and last[0][k][1] is y
                                for k, (x, y) in distinct.items()):
        return last[1], last[2], last[3]
    if last is not None:  # keep the old pairs: runs come back to them in later rounds
        distinct = {**last[0], **distinct}
    offsets, start = {}, 0
    for k, (x, _) in distinct.items():
        offsets[k] = start
        start += len(x)
    x = torch.cat([x for x, _ in distinct.values()])
    y = torch.cat([y for _, y in distinct.values()])
    _POOL["last"] = (distinct, x, y, offsets)
    return x, y, offsets


def clear_pool() -> None:
    """Drop the pooled data of :func:`pooled_data` (a stacked group calls it at its end)."""
    _POOL.clear()


def _pad_steps(b: Batches, steps: int) -> Batches:
    extra = steps - b.idx.shape[1]
    if extra == 0:
        return b
    c, _, batch = b.idx.shape
    idx = torch.cat([b.idx, b.idx[:, -1:].expand(c, extra, batch)], dim=1)
    active = torch.cat([b.active, b.active.new_zeros(c, extra)], dim=1)
    return Batches(idx, active, b.steps)


def stack_jobs(jobs: list[LocalJob], pad_clients: int | None = None) -> LocalJob:
    """One job whose clients are the clients of every job in ``jobs``, in order.

    ``pad_clients``: a client count the engine pads the call to, so that a group whose
    membership changes (a run finishes, a branch forks) keeps one compiled shape.
    """
    first = jobs[0]
    names = list(first.global_params)  # model order
    trainable = tuple(n for n in names if any(n in j.trainable for j in jobs))
    overrides = {n: torch.cat([j.start(n) for j in jobs]) for n in names}
    mask = {}
    for n in trainable:
        on = torch.cat([torch.full((len(j.client_ids),), n in j.trainable, dtype=torch.bool)
                        for j in jobs])
        if not bool(on.all()):
            mask[n] = on.to(first.x.device)
    lr = torch.cat([torch.full((len(j.client_ids),), float(j.optimizer.lr),
                               dtype=torch.float64) for j in jobs]).to(first.x.device)
    terms = _local_terms(jobs, trainable)
    steps = max(int(j.batches.idx.shape[1]) for j in jobs)
    padded = [_pad_steps(j.batches, steps) for j in jobs]
    x, y, offsets = pooled_data([(j.x, j.y) for j in jobs])
    idx = [b.idx + offsets[(id(j.x), id(j.y))] if offsets[(id(j.x), id(j.y))] else b.idx
           for j, b in zip(jobs, padded)]
    batches = Batches(torch.cat(idx), torch.cat([b.active for b in padded]),
                      torch.cat([b.steps for b in padded]))
    return LocalJob(model=first.model, algorithm=first.algorithm,
                    global_params=first.global_params, trainable=trainable, batches=batches,
                    x=x, y=y, optimizer=first.optimizer,
                    client_ids=np.concatenate([j.client_ids for j in jobs]),
                    dropout_seed=first.dropout_seed, overrides=overrides,
                    autocast=first.autocast, lr=lr, train_mask=mask,
                    pad_clients=pad_clients, **terms)


def _local_terms(jobs: list[LocalJob], trainable: tuple[str, ...]) -> dict:
    """The stacked job's ``grad_offset``, ``prox_mu`` and ``correction`` (each run's own, zero
    for the runs and parameters without one; left out when no run of ``jobs`` has one) and
    ``stacked_terms``, always: a stacked job never runs the first run's regularizer."""
    offsets, mus, corrections = [], [], []
    for j in jobs:
        fn = getattr(j.algorithm, "local_terms", None)
        off, mu = (fn(j.trainable, j.client_state, j.server_state) if fn is not None
                   else (None, 0.0))
        offsets.append(off)
        mus.append(float(mu))
        corrections.append(step_correction(j))
    if not any(o is not None for o in offsets) and not any(mus) and \
            not any(c is not None for c in corrections):
        # no run brings a term: still none of the first run's regularizer (FedProx at mu = 0
        # would otherwise be read as a per-client tensor regularizer)
        return {"stacked_terms": True}

    def per_name(parts: list[dict | None]) -> dict[str, torch.Tensor]:
        out = {}
        for n in trainable:
            cols = []
            for j, d in zip(jobs, parts):
                if d is not None and n in d and n in j.trainable:
                    cols.append(d[n])
                else:
                    g = j.global_params[n]
                    cols.append(g.new_zeros((len(j.client_ids), *g.shape)))
            out[n] = torch.cat(cols)
        return out

    dev = jobs[0].x.device
    return {"grad_offset": per_name(offsets) if any(o is not None for o in offsets) else {},
            "prox_mu": (torch.cat([torch.full((len(j.client_ids),), mu, dtype=torch.float64)
                                   for j, mu in zip(jobs, mus)]).to(dev)
                        if any(mus) else None),
            "correction": (per_name(corrections)
                           if any(c is not None for c in corrections) else None),
            "stacked_terms": True}


def split_results(results: ClientResults, jobs: list[LocalJob]) -> list[ClientResults]:
    """The results of a stacked call, one :class:`ClientResults` per job (its own rows and
    trainable parameters)."""
    out, start = [], 0
    for j in jobs:
        rows = slice(start, start + len(j.client_ids))
        out.append(ClientResults(
            params={n: results.params[n][rows] for n in j.trainable},
            data_loss=results.data_loss[rows], objective=results.objective[rows],
            first_loss=results.first_loss[rows], grad_norm_first=results.grad_norm_first[rows],
            grad_norm_last=results.grad_norm_last[rows], steps=results.steps[rows]))
        start = rows.stop
    return out


def train_jobs(jobs: list[LocalJob], engines: list, stacked_engine=fast.train_fast,
               pad_clients: int | None = None) -> list[ClientResults]:
    """Train every job of one round: the stackable ones together, in groups of compatible
    jobs (one call of ``stacked_engine`` each), the others one by one with their own engine
    (``engines[i]`` for ``jobs[i]``; ``stacked_engine=None`` stacks nothing)."""
    results: list[ClientResults | None] = [None] * len(jobs)
    groups: list[list[int]] = []
    for i, job in enumerate(jobs):
        if stacked_engine is None or not stackable(job):
            results[i] = engines[i](job)
            continue
        for g in groups:
            if compatible(jobs[g[0]], job):
                g.append(i)
                break
        else:
            groups.append([i])
    for g in groups:
        members = [jobs[i] for i in g]
        if len(members) == 1:  # alone: the plain path, with shared frozen parameters
            results[g[0]] = stacked_engine(members[0])
            continue
        pad = pad_clients if len(groups) == 1 else None
        for i, r in zip(g, split_results(stacked_engine(stack_jobs(members, pad)), members)):
            results[i] = r
    return results
