"""Transformer building blocks shared by the ViT and the character Transformer.

The query, key and value projections are separate ``nn.Linear`` modules so that the query/key
block (which fixes the attention kernel) and the value block are separately addressable. The
code avoids fused kernels (``scaled_dot_product_attention``) so that every op runs under
``torch.func.vmap`` and is counted by ``torch.utils.flop_counter``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def linear_feature_map(x: torch.Tensor) -> torch.Tensor:
    """phi(x) = elu(x) + 1 > 0, the feature map of Katharopoulos et al. (2020)."""
    return F.elu(x) + 1.0


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k, v projections.

    Parameters
    ----------
    dim : int
        Model width d.
    heads : int
        Number of heads h; each has width d / h.
    kind : {"softmax", "linear"}
        ``softmax``: softmax(q k^T / sqrt(d_h)) v. ``linear``: phi(q) (phi(k)^T v) normalized by
        phi(q) sum_j phi(k_j), with phi = elu + 1 (causal: the same with a lower-triangular mask).
    causal : bool
        Mask attention to earlier positions (character model).
    dropout : float
        Dropout on the attention output projection.
    """

    def __init__(self, dim: int, heads: int, kind: str, causal: bool, dropout: float) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim={dim} is not divisible by heads={heads}")
        self.heads, self.kind, self.causal = heads, kind, causal
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        h = self.heads
        # (B, N, D) -> (B, h, N, D/h)
        q = self.q(x).view(b, n, h, d // h).transpose(1, 2)
        k = self.k(x).view(b, n, h, d // h).transpose(1, 2)
        v = self.v(x).view(b, n, h, d // h).transpose(1, 2)
        if self.kind == "softmax":
            scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)  # (B, h, N, N)
            if self.causal:
                mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
                scores = scores.masked_fill(mask, float("-inf"))
            y = scores.softmax(dim=-1) @ v  # (B, h, N, D/h)
        else:
            fq, fk = linear_feature_map(q), linear_feature_map(k)
            if self.causal:
                a = fq @ fk.transpose(-2, -1)  # (B, h, N, N), nonnegative
                a = a * torch.ones(n, n, dtype=a.dtype, device=x.device).tril()
                y = (a @ v) / (a.sum(-1, keepdim=True) + 1e-6)
            else:
                kv = fk.transpose(-2, -1) @ v  # (B, h, D/h, D/h)
                z = fq @ fk.sum(dim=-2, keepdim=True).transpose(-2, -1)  # (B, h, N, 1)
                y = (fq @ kv) / (z + 1e-6)
        y = y.transpose(1, 2).reshape(b, n, d)  # (B, h, N, D/h) -> (B, N, D)
        return self.drop(self.out(y))


@torch.no_grad()
def attention_scores(model: nn.Module, params: dict[str, torch.Tensor],
                     x: torch.Tensor) -> torch.Tensor:
    """Every attention row of ``model`` on the batch ``x`` with ``params`` (a functional call):
    ``(rows, keys)`` float32 scores, the rows of every layer, sample, head and query stacked.
    Softmax attention gives the logits q k^T / sqrt(d_h) (-inf on causally masked keys), linear
    attention its unnormalized weights phi(q) phi(k)^T; both order the keys as the attention
    does. Raises ``ValueError`` for a model without :class:`Attention` modules."""
    from torch.func import functional_call

    modules = [m for m in model.modules() if isinstance(m, Attention)]
    if not modules:
        raise ValueError(f"{type(model).__name__} has no attention layers")
    rows: list[torch.Tensor] = []

    def capture(module: Attention, args) -> None:
        (inp,) = args
        b, n, d = inp.shape
        h = module.heads
        q = module.q(inp).view(b, n, h, d // h).transpose(1, 2).float()
        k = module.k(inp).view(b, n, h, d // h).transpose(1, 2).float()
        with torch.autocast(inp.device.type, enabled=False):  # float32 scores under bf16
            if module.kind == "softmax":
                a = q @ k.transpose(-2, -1) / math.sqrt(d // h)
                if module.causal:
                    mask = torch.ones(n, n, dtype=torch.bool, device=inp.device).triu(1)
                    a = a.masked_fill(mask, float("-inf"))
            else:
                a = linear_feature_map(q) @ linear_feature_map(k).transpose(-2, -1)
                if module.causal:
                    a = a * torch.ones(n, n, dtype=a.dtype, device=inp.device).tril()
            rows.append(a.reshape(-1, n))

    handles = [m.register_forward_pre_hook(capture) for m in modules]
    try:
        functional_call(model, params, (x,))
    finally:
        for hd in handles:
            hd.remove()
    return torch.cat(rows)


class MLP(nn.Module):
    """fc2(act(fc1(x))) with act = GELU or ReLU."""

    def __init__(self, dim: int, hidden: int, activation: str, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = nn.GELU() if activation == "gelu" else nn.ReLU()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.act(self.fc1(x))))


class Block(nn.Module):
    """Pre-norm Transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

    def __init__(
        self,
        dim: int,
        heads: int,
        mlp_dim: int,
        attention: str,
        activation: str,
        causal: bool,
        dropout: float,
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, attention, causal, dropout)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, mlp_dim, activation, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))
