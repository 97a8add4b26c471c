"""Evaluation and per-round diagnostics: accuracy, stability, communication and compute.

Stability metrics (logged per round, global rows of ``metrics.csv``):

- ``grad_norm_jump``: mean over the round's clients of the first-step gradient norm at the new
  global model, divided by the previous round's mean last-step norm (at the clients' own
  models). Values well above 1 mean that aggregation landed somewhere much steeper.
- ``update_dispersion``: sqrt(sum_m p_m ||Delta_m - Delta||^2), Delta_m = y_m - x_t over the
  trained parameters and Delta = sum_m p_m Delta_m; ``update_dispersion_rel`` divides by
  ||Delta||.
- ``qk_change``: ||QK_{t+1} - QK_t|| / ||QK_t|| over all query/key parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from real_data.engines.base import chunk_names, task_loss


@torch.no_grad()
def evaluate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    autocast: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss and accuracy (text: averaged over positions), each ``(N,)`` float64."""
    return _in_minibatches(x, y, batch_size, autocast, forward, lambda yb: yb)


def _in_minibatches(x, y, step: int, autocast, logits_of, target
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample loss and accuracy over ``x`` in minibatches of ``step`` samples, under bf16
    autocast when given: ``logits_of(xb)`` and ``target(yb)`` shape one minibatch; the samples
    are on the last axis of the result."""
    losses, correct = [], []
    for start in range(0, len(x), step):
        xb, yb = x[start:start + step], y[start:start + step]
        ctx = (torch.autocast(x.device.type, dtype=autocast) if autocast
               else contextlib.nullcontext())
        with ctx:
            logits = logits_of(xb)
        lv, hit = _loss_hit(logits, target(yb), text=yb.dim() > 1)
        losses.append(lv)
        correct.append(hit)
    return torch.cat(losses, dim=-1), torch.cat(correct, dim=-1)


def _loss_hit(logits: torch.Tensor, y: torch.Tensor, text: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample float64 cross-entropy and accuracy (in >= fp32); ``text``: y's last axis is
    the positions of one sample, averaged."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    lv = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                         reduction="none").reshape(y.shape)
    hit = (logits.argmax(-1) == y).to(torch.float64)
    if text:
        lv, hit = lv.mean(dim=-1), hit.mean(dim=-1)
    return lv.double(), hit


EVAL_MODELS_PER_PASS = 16
"""Models per compiled evaluation pass (:func:`evaluate_stacked` with ``compiled=True``): the
models of a group go through in passes of this many (the last one padded by repeating a model),
so every pass has one shape and the forward compiles once."""

_COMPILED_EVAL: dict[tuple, Callable] = {}


def _compiled_eval(model: torch.nn.Module, names: frozenset[str]) -> Callable:
    """``torch.compile`` of the stacked forward of ``model`` with ``names`` stacked (one per
    model and set of names; a new shape recompiles)."""
    from real_data.engines.stacked import stacked_forward

    key = (id(model), names)
    if key not in _COMPILED_EVAL:
        while len(_COMPILED_EVAL) >= 8:
            _COMPILED_EVAL.pop(next(iter(_COMPILED_EVAL)))

        def forward(params, xb, r: int):
            return stacked_forward(model, params, names, xb.unsqueeze(0).expand(r, *xb.shape))
        _COMPILED_EVAL[key] = torch.compile(forward, dynamic=False)
    return _COMPILED_EVAL[key]


@torch.no_grad()
def evaluate_stacked(
    model: torch.nn.Module,
    params: dict[str, torch.Tensor],
    x: torch.Tensor,
    y: torch.Tensor,
    batch_size: int,
    autocast: torch.dtype | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`evaluate` of R models at once: ``params`` holds every parameter as ``(R, ...)``
    (stacked runs' global models), each model sees every test sample; returns ``(R, N)``
    float64 per-sample loss and accuracy. One stacked forward per minibatch of ``batch_size``
    samples per model (at most 65535 rows in all, the attention kernel's grid) replaces R
    forwards.

    ``compiled``: the forward is ``torch.compile``d and takes the models in passes of
    :data:`EVAL_MODELS_PER_PASS` and the samples in equal minibatches (the last pass and the
    last minibatch padded, their padding dropped), so one compiled shape serves every call."""
    from real_data.engines.stacked import stacked_forward

    r = next(iter(params.values())).shape[0]
    names = frozenset(params)
    if not compiled:
        step = max(1, min(batch_size, 65535 // r))
        return _in_minibatches(
            x, y, step, autocast,
            lambda xb: stacked_forward(model, params, names,
                                       xb.unsqueeze(0).expand(r, *xb.shape)),
            lambda yb: yb.unsqueeze(0).expand(r, *yb.shape))
    per = EVAL_MODELS_PER_PASS
    step = max(1, min(batch_size, 65535 // per, len(x)))
    fwd = _compiled_eval(model, names)
    losses, hits = [], []
    for a in range(0, r, per):
        rows = torch.arange(a, a + per, device=x.device).clamp(max=r - 1)
        chunk = {n: t[rows] for n, t in params.items()}
        real = min(per, r - a)

        def logits_of(xb, chunk=chunk, real=real):
            n = len(xb)
            if n < step:  # the last minibatch: padded to the compiled shape
                xb = torch.cat([xb, xb[:1].expand(step - n, *xb.shape[1:])])
            return fwd(chunk, xb, per)[:real, :n]

        lv, hit = _in_minibatches(x, y, step, autocast, logits_of,
                                  lambda yb, real=real: yb.unsqueeze(0).expand(real, *yb.shape))
        losses.append(lv)
        hits.append(hit)
    return torch.cat(losses), torch.cat(hits)


def worst_fraction_mean(values: np.ndarray, fraction: float = 0.1) -> float:
    """Mean of the lowest ``fraction`` of values (at least one)."""
    k = max(1, int(np.floor(fraction * len(values))))
    return float(np.sort(values)[:k].mean())


def local_summary(per_client_acc: np.ndarray) -> dict[str, float]:
    """Mean, std and worst-10% mean of the clients' local test accuracies."""
    return {"local_acc_mean": float(per_client_acc.mean()),
            "local_acc_std": float(per_client_acc.std()),
            "local_acc_worst10": worst_fraction_mean(per_client_acc, 0.1)}


def update_dispersion(
    global_params: dict[str, torch.Tensor],
    client_params: dict[str, torch.Tensor],
    weights: torch.Tensor,
    chunk_numbers: int = 1 << 24,
) -> tuple[float, float]:
    """(sqrt(sum_m p_m ||Delta_m - Delta||^2), ||Delta||) over the trained parameters.

    The parameters go into ``(C, P)`` float64 buffers of at most ``chunk_numbers`` numbers
    (128 MiB; a concatenation each), so the cost is a handful of kernels per chunk and one
    host sync, whatever the number of parameters."""
    p = weights.double()
    sq = torch.zeros(len(p), dtype=torch.float64, device=p.device)
    mean_sq = torch.zeros((), dtype=torch.float64, device=p.device)
    for take in chunk_names(client_params, chunk_numbers):
        d = torch.cat([(client_params[n].flatten(1) - global_params[n].reshape(1, -1)).double()
                       for n in take], dim=1)  # (C, P_chunk)
        mean = p @ d
        sq += (d - mean).pow(2).sum(1)
        mean_sq += mean.pow(2).sum()
    both = torch.stack([(p * sq).sum(), mean_sq]).sqrt().tolist()  # one sync
    return float(both[0]), float(both[1])


def relative_change(
    old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], names: Iterable[str]
) -> float:
    """||new - old|| / ||old|| over the named tensors (0 when they are empty)."""
    names = list(names)
    if not names:
        return 0.0
    a = torch.cat([old[n].double().flatten() for n in names])
    b = torch.cat([new[n].double().flatten() for n in names])
    num, den = torch.stack([(b - a).pow(2).sum(), a.pow(2).sum()]).tolist()  # one sync
    return float(np.sqrt(num / den)) if den > 0 else float(np.sqrt(num))


def step_flops(
    forward: Callable[[dict[str, torch.Tensor], torch.Tensor], torch.Tensor],
    params: dict[str, torch.Tensor],
    trainable: Iterable[str],
    x: torch.Tensor,
    y: torch.Tensor,
) -> int:
    """FLOPs of one local step (forward + backward to the trainable parameters only).

    Counted by ``torch.utils.flop_counter`` on one real minibatch: weight gradients of frozen
    parameters are not computed, so a frozen stage's saving is measured, not assumed.
    """
    trainable = set(trainable)
    live = {n: (p.detach().clone().requires_grad_(True) if n in trainable else p.detach())
            for n, p in params.items()}
    counter = FlopCounterMode(display=False)
    with counter:
        loss = task_loss(forward(live, x), y)
        wrt = [live[n] for n in params if n in trainable]
        if wrt:
            torch.autograd.grad(loss, wrt)
    return int(counter.get_total_flops())
