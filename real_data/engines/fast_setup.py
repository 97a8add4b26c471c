"""What a fast-engine runner depends on: its setup (the cache key of a CUDA graph or compiled
step, without the chunk size), read off a :class:`~real_data.engines.base.LocalJob`."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from real_data.engines.base import LocalJob, step_correction


@dataclass(frozen=True)
class RunnerSetup:
    """What one round's runner depends on (its cache key without the chunk size)."""

    trainable: tuple[str, ...]
    shared: tuple[str, ...]
    own: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    steps: int
    batch: int
    ragged: bool
    regularizer: object  # a float constant, or "tensor"
    spec: object
    autocast: object
    dtype: torch.dtype
    data: tuple
    model: int
    graphs: bool
    compile: bool | str  # False, True (default mode) or a torch.compile mode
    attention: str
    fold_norms: bool = True
    triton_update: bool = True
    masked: tuple[str, ...] = ()  # trainable names some clients do not train (stacked runs)
    correction: bool = False  # the algorithm's step correction (engines.base.step_correction)
    offset: bool = False  # stacked runs: a per-client gradient offset (LocalJob.grad_offset)
    prox: bool = False  # stacked runs: a per-client proximal term (LocalJob.prox_mu)


def regularizer_kind(job: LocalJob) -> object:
    """The regularizer of client 0: a number (constant for all) or ``"tensor"``."""
    anchor = {n: job.global_params[n] for n in job.trainable}
    one = {n: job.overrides[n][0] if n in job.overrides else job.global_params[n]
           for n in job.trainable}
    r = job.algorithm.regularizer(one, anchor, {k: v[0] for k, v in job.client_state.items()},
                                  job.server_state)
    return "tensor" if isinstance(r, torch.Tensor) else float(r)


def make_setup(job: LocalJob, graphs: bool, compile: bool | str, attention: str = "auto",
           fold_norms: bool = True, triton_update: bool = True) -> RunnerSetup:
    fixed = [n for n in job.global_params if n not in job.trainable]
    reg = 0.0 if job.stacked_terms else regularizer_kind(job)
    correction = step_correction(job) is not None
    dev = job.x.device
    steps = job.batches.steps  # on the CPU: no device sync
    ragged = bool((steps != steps.max()).any())
    return RunnerSetup(
        trainable=tuple(job.trainable),
        shared=tuple(n for n in fixed if n not in job.overrides),
        own=tuple(n for n in fixed if n in job.overrides),
        shapes=tuple(tuple(job.global_params[n].shape) for n in job.trainable),
        steps=int(job.batches.idx.shape[1]), batch=int(job.batches.idx.shape[2]),
        # the lr is data (_Runner.lr), not part of what a graph or compiled step depends on
        ragged=ragged, regularizer=reg, spec=replace(job.optimizer, lr=0.0),
        autocast=job.autocast,
        dtype=job.global_params[job.trainable[0]].dtype,
        data=(job.x.data_ptr(), tuple(job.x.shape), job.x.dtype, job.y.data_ptr(),
              tuple(job.y.shape), str(dev), tuple(sorted(job.client_state))),
        model=id(job.model),
        graphs=graphs and dev.type == "cuda" and reg != "tensor" and not correction,
        compile=compile,
        attention=attention,
        fold_norms=fold_norms,
        triton_update=triton_update,
        masked=tuple(n for n in job.trainable if n in job.train_mask),
        correction=correction,
        offset=bool(job.grad_offset),
        prox=job.prox_mu is not None,
    )
