"""The reference engine: one client after another, ``loss.backward()`` and ``torch.optim``.

It is deliberately plain: it is the oracle the vectorized engine is tested against. One working
copy of the model's parameters is reused for every client (no deep copy per client).
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from real_data.engines.base import ClientResults, LocalJob, step_correction, task_loss


def _optimizer(job: LocalJob, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    spec = job.optimizer
    if spec.name == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=spec.momentum,
                               weight_decay=spec.weight_decay, foreach=False)
    return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                            weight_decay=spec.weight_decay, foreach=False)


def train_sequential(job: LocalJob) -> ClientResults:
    """Train the round's clients one at a time; same semantics as the vectorized engine."""
    algo, spec = job.algorithm, job.optimizer
    device = job.x.device
    anchor = {n: job.global_params[n] for n in job.trainable}
    fixed_names = [n for n in job.global_params if n not in job.trainable]
    rows: dict[str, list] = {k: [] for k in ("loss", "obj", "first", "gfirst", "glast")}
    finals: dict[str, list[torch.Tensor]] = {n: [] for n in job.trainable}
    correction = step_correction(job)  # (C, ...) per parameter, applied after each step
    for c, m in enumerate(job.client_ids):
        # 1. the client's start point: global values, or its personalized overrides
        fixed = {n: job.start(n)[c] for n in fixed_names}
        train = {n: job.start(n)[c].detach().clone().requires_grad_(True) for n in job.trainable}
        cstate = {k: v[c] for k, v in job.client_state.items()}
        opt = _optimizer(job, list(train.values()))
        steps = int(job.batches.steps[c])
        losses, objs, norms = [], [], []
        seed = int(np.random.SeedSequence([job.dropout_seed, int(m)]).generate_state(1)[0])
        devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            for s in range(steps):
                # 2. forward on the client's minibatch, local objective = data + regularizer
                idx = job.batches.idx[c, s]
                ctx = (torch.autocast(device.type, dtype=job.autocast) if job.autocast
                       else contextlib.nullcontext())
                with ctx:
                    logits = algo.forward(job.model, {**fixed, **train}, job.x[idx])
                data = task_loss(logits, job.y[idx])
                obj = data + algo.regularizer(train, anchor, cstate, job.server_state)
                # 3. backward, norm before clipping, optional clipping, optimizer step
                opt.zero_grad(set_to_none=True)
                obj.backward()
                gn = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in train.values()))
                if spec.clip_grad_norm is not None:
                    torch.nn.utils.clip_grad_norm_(list(train.values()), spec.clip_grad_norm)
                opt.step()
                if correction is not None:  # y <- y - eta d_m, outside the optimizer
                    with torch.no_grad():
                        for n, d in correction.items():
                            train[n].add_(d[c], alpha=-spec.lr)
                losses.append(data.detach())
                objs.append(obj.detach())
                norms.append(gn)
        rows["loss"].append(torch.stack(losses).mean())
        rows["obj"].append(torch.stack(objs).mean())
        rows["first"].append(losses[0])
        rows["gfirst"].append(norms[0])
        rows["glast"].append(norms[-1])
        for n in job.trainable:
            finals[n].append(train[n].detach())
    return ClientResults(
        params={n: torch.stack(v) for n, v in finals.items()},
        data_loss=torch.stack(rows["loss"]).double(),
        objective=torch.stack(rows["obj"]).double(),
        first_loss=torch.stack(rows["first"]).double(),
        grad_norm_first=torch.stack(rows["gfirst"]).double(),
        grad_norm_last=torch.stack(rows["glast"]).double(),
        steps=job.batches.steps.clone(),
    )
