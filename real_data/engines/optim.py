"""PyTorch's SGD and Adam update rules and ``clip_grad_norm_`` on client-stacked tensors.

Every tensor has a leading client axis C; the formulas are those of ``torch.optim.SGD``,
``torch.optim.Adam`` and ``torch.nn.utils.clip_grad_norm_`` applied per client, so the
vectorized engine matches the sequential one (which uses ``torch.optim``) to rounding.
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
        return {"m": {n: torch.zeros_like(p) for n, p in params.items()},
                "v": {n: torch.zeros_like(p) for n, p in params.items()}}
    if spec.momentum:
        return {"buf": {}}
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
                buf = state["buf"].get(n)
                buf = g.clone() if buf is None else buf.mul(spec.momentum).add(g)
                state["buf"][n] = buf
                g = buf
            new[n] = p.add(g, alpha=-spec.lr)
        else:
            b1, b2 = spec.betas
            m = state["m"][n].lerp(g, 1 - b1)
            v = state["v"][n].mul(b2).addcmul(g, g, value=1 - b2)
            state["m"][n], state["v"][n] = m, v
            t = count.to(torch.float64)
            step_size = _per_client(spec.lr / (1 - b1**t), p)
            bc2_sqrt = _per_client((1 - b2**t).sqrt(), p)
            new[n] = p - step_size * m / (v.sqrt() / bc2_sqrt + spec.eps)
    return new
