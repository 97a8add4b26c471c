"""The vectorized engine: all of a round's clients at once, over stacked parameters.

:func:`train_vectorized` takes the fast path of :mod:`real_data.engines.fast` (clients folded
into batched kernels, one flat optimizer buffer, CUDA graphs, automatic chunking) whenever it
applies: a ViT or CharTransformer without dropout and an algorithm with the default forward.
Anything else runs :func:`train_vmap`, the general path described below; both compute the
sequential engine's function, and the tests hold each to it.

Trainable parameters are stacked on a leading client axis ``(C, ...)``; frozen parameters are
passed once, unbatched (``in_dims=None``), so a round that freezes Q/K neither stores nor
differentiates C copies of them. Each step gathers the C minibatches with one index tensor,
computes every client's gradient with ``torch.func.grad`` under ``vmap`` and applies the
optimizer rules of :mod:`real_data.engines.optim` to the stacks.
"""

from __future__ import annotations

import contextlib

import torch
from torch.func import grad, vmap

from real_data.engines import fast, optim
from real_data.engines.base import ClientResults, LocalJob, step_correction, task_loss


def train_vectorized(job: LocalJob) -> ClientResults:
    """Train the round's clients together; same semantics as the sequential engine."""
    if fast.supports(job):
        return fast.train_fast(job)
    return train_vmap(job)


def train_vectorized_compiled(job: LocalJob) -> ClientResults:
    """As :func:`train_vectorized`, with the stacked forward and loss ``torch.compile``d.

    Compiles once per chunk shape (tens of seconds, in the first round); compiled against
    eager per card: docs/results/performance.md (docs/bench/engines.json).
    """
    if fast.supports(job):
        return fast.train_fast(job, compile=True)
    return train_vmap(job)


def train_vmap(job: LocalJob) -> ClientResults:
    """The general path: ``vmap(grad(objective))`` over stacked clients, any model/forward."""
    algo, spec, model = job.algorithm, job.optimizer, job.model
    device = job.x.device
    anchor = {n: job.global_params[n] for n in job.trainable}
    fixed_shared = {n: p for n, p in job.global_params.items()
                    if n not in job.trainable and n not in job.overrides}
    fixed_own = {n: v for n, v in job.overrides.items() if n not in job.trainable}
    server_state = job.server_state

    def objective(train, own, cstate, x, y):
        ctx = (torch.autocast(device.type, dtype=job.autocast) if job.autocast
               else contextlib.nullcontext())
        with ctx:
            logits = algo.forward(model, {**fixed_shared, **own, **train}, x)
        data = task_loss(logits, y)
        obj = data + algo.regularizer(train, anchor, cstate, server_state)
        return obj, (obj.detach(), data.detach())

    per_client = vmap(grad(objective, has_aux=True), in_dims=(0, 0, 0, 0, 0),
                      randomness="different")

    # 1. stacked start points (a real copy: the optimizer must not write into global params)
    train = {n: job.start(n).clone() for n in job.trainable}
    state = optim.init_state(spec, train)
    correction = step_correction(job)  # (C, ...) per parameter, applied after each step
    idx, active = job.batches.idx, job.batches.active
    n_clients, n_steps = active.shape
    ragged = not bool(active.all())
    count = torch.zeros(n_clients, dtype=torch.int64, device=device)
    loss_sum = torch.zeros(n_clients, dtype=torch.float64, device=device)
    obj_sum = torch.zeros_like(loss_sum)
    first_loss = gn_first = gn_last = None
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(job.dropout_seed)
        for s in range(n_steps):
            # 2. gather the C minibatches: (C, B, ...) from one index tensor
            xb, yb = job.x[idx[:, s]], job.y[idx[:, s]]
            grads, (obj, data) = per_client(train, fixed_own, job.client_state, xb, yb)
            # 3. per-client norm (before clipping), clipping, optimizer step
            norms = optim.grad_norms(grads).double()
            if spec.clip_grad_norm is not None:
                optim.clip_(grads, norms, spec.clip_grad_norm)
            on = active[:, s]
            count = count + on.long()
            if ragged:
                old_train = train
                old_state = {k: dict(v) for k, v in state.items()}
            train = optim.step(spec, train, grads, state, count)
            if correction is not None:  # y <- y - eta d_m, outside the optimizer
                train = {n: p - spec.lr * correction[n] for n, p in train.items()}
            if ragged:
                # 4. clients that already finished keep their parameters and state
                train = {n: torch.where(_bc(on, p), p, old_train[n]) for n, p in train.items()}
                for k, group in state.items():
                    for n, v in group.items():
                        if n in old_state[k]:
                            group[n] = torch.where(_bc(on, v), v, old_state[k][n])
                        else:
                            group[n] = torch.where(_bc(on, v), v, torch.zeros_like(v))
            loss_sum += torch.where(on, data.double(), 0.0)
            obj_sum += torch.where(on, obj.double(), 0.0)
            if s == 0:
                first_loss, gn_first = data.double(), norms
                gn_last = norms.clone()
            else:
                gn_last = torch.where(on, norms, gn_last)
    steps = job.batches.steps.to(device).double()
    return ClientResults(
        params=train,
        data_loss=loss_sum / steps,
        objective=obj_sum / steps,
        first_loss=first_loss,
        grad_norm_first=gn_first,
        grad_norm_last=gn_last,
        steps=job.batches.steps.clone(),
    )


def _bc(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a ``(C,)`` mask to broadcast against ``(C, ...)``."""
    return mask.reshape(-1, *([1] * (like.dim() - 1)))
