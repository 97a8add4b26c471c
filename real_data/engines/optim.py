"""PyTorch's SGD and Adam update rules and ``clip_grad_norm_`` on client-stacked tensors.

Every tensor has a leading client axis C; the formulas are those of ``torch.optim.SGD``,
``torch.optim.Adam`` and ``torch.nn.utils.clip_grad_norm_`` applied per client, so the
vectorized engine matches the sequential one (which uses ``torch.optim``) to rounding. The
state keeps torch's names: ``momentum_buffer`` (SGD), ``exp_avg`` and ``exp_avg_sq`` (Adam's
first and second moments). Two layouts: a dict of ``(C, ...)`` tensors (:func:`step`, the
``vmap`` path) and one flat ``(C, P)`` buffer (:func:`flat_step_`, the fast path).
"""

from __future__ import annotations

import torch

from real_data.engines.base import OptimizerSpec

Stacked = dict[str, torch.Tensor]


def _per_client(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Reshape a ``(C,)`` vector to broadcast against ``(C, ...)``."""
    return v.reshape(-1, *([1] * (like.dim() - 1))).to(like.dtype)


def grad_norms(grads: Stacked) -> torch.Tensor:
    """``(C,)`` total 2-norm of each client's gradient."""
    sq = sum(g.float().pow(2).flatten(1).sum(1) if g.dtype != torch.float64
             else g.pow(2).flatten(1).sum(1) for g in grads.values())
    return torch.sqrt(sq)


def clip_(grads: Stacked, norms: torch.Tensor, max_norm: float) -> None:
    """Scale each client's gradient by min(1, max_norm / (norm + 1e-6)), in place."""
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for g in grads.values():
        g.mul_(_per_client(coef, g))


def init_state(spec: OptimizerSpec, params: Stacked) -> dict[str, Stacked]:
    """Zero optimizer state for stacked parameters."""
    if spec.name == "adam":
        return {"exp_avg": {n: torch.zeros_like(p) for n, p in params.items()},
                "exp_avg_sq": {n: torch.zeros_like(p) for n, p in params.items()}}
    if spec.momentum:
        return {"momentum_buffer": {}}
    return {}


def step(
    spec: OptimizerSpec,
    params: Stacked,
    grads: Stacked,
    state: dict[str, Stacked],
    count: torch.Tensor,
) -> Stacked:
    """One optimizer step for every client; returns new parameters, updates ``state``.

    ``count`` is the ``(C,)`` step number after this step (1 on the first step), used by Adam's
    bias corrections.
    """
    new = {}
    for n, p in params.items():
        g = grads[n]
        if spec.weight_decay:
            g = g.add(p, alpha=spec.weight_decay)
        if spec.name == "sgd":
            if spec.momentum:
                buf = state["momentum_buffer"].get(n)
                buf = g.clone() if buf is None else buf.mul(spec.momentum).add(g)
                state["momentum_buffer"][n] = buf
                g = buf
            new[n] = p.add(g, alpha=-spec.lr)
        else:
            b1, b2 = spec.betas
            exp_avg = state["exp_avg"][n].lerp(g, 1 - b1)
            exp_avg_sq = state["exp_avg_sq"][n].mul(b2).addcmul(g, g, value=1 - b2)
            state["exp_avg"][n], state["exp_avg_sq"][n] = exp_avg, exp_avg_sq
            t = count.to(torch.float64)
            step_size = _per_client(spec.lr / (1 - b1**t), p)
            bc2_sqrt = _per_client((1 - b2**t).sqrt(), p)
            new[n] = p - step_size * exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + spec.eps)
    return new


def flat_step_(
    spec: OptimizerSpec,
    flat: torch.Tensor,
    g: torch.Tensor,
    state: dict[str, torch.Tensor],
    count: torch.Tensor,
    on: torch.Tensor,
    ragged: bool,
    lr: torch.Tensor | None = None,
) -> None:
    """SGD (heavy ball) or Adam on a flat ``(C, P)`` buffer, in place.

    ``lr``: ``(C, 1)`` per-client learning rates (in the buffer's dtype) replacing
    ``spec.lr``.

    ``g`` is the ``(C, P)`` gradient, already clipped and with weight decay added; ``state``
    holds ``(C, P)`` buffers under torch's names (``momentum_buffer``, or ``exp_avg`` and
    ``exp_avg_sq``), zero before a client's first step; ``count`` is the ``(C,)`` step number
    after this step. With ``ragged`` only the clients whose ``on`` ``(C, 1)`` is true step;
    the others keep parameters and state. The momentum buffer starts at zero, so its first
    value ``0 * mu + g`` is ``g`` exactly, as SGD's clone of the first gradient.
    """
    if ragged:  # new values first, then kept only for the active clients
        def assign(dst: torch.Tensor, new: torch.Tensor) -> None:
            dst.copy_(torch.where(on, new, dst))
    else:
        def assign(dst: torch.Tensor, new: torch.Tensor) -> None:
            dst.copy_(new)
    if spec.name == "sgd":
        if spec.momentum:
            buf = state["momentum_buffer"]
            if ragged:
                assign(buf, buf.mul(spec.momentum).add(g))
            else:
                buf.mul_(spec.momentum).add_(g)
            g = buf
        if lr is not None:
            if ragged:
                assign(flat, flat - lr * g)
            else:
                flat.sub_(lr * g)
        elif ragged:
            assign(flat, flat.add(g, alpha=-spec.lr))
        else:
            flat.add_(g, alpha=-spec.lr)
        return
    b1, b2 = spec.betas
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    assign(exp_avg, exp_avg.lerp(g, 1 - b1))
    assign(exp_avg_sq, exp_avg_sq.mul(b2).addcmul(g, g, value=1 - b2))
    t = count.double()
    base = spec.lr if lr is None else lr.squeeze(1).double()
    step_size = (base / (1 - b1**t)).to(flat.dtype).unsqueeze(1)
    bc2_sqrt = (1 - b2**t).sqrt().to(flat.dtype).unsqueeze(1)
    assign(flat, flat - step_size * exp_avg / (exp_avg_sq.sqrt() / bc2_sqrt + spec.eps))
