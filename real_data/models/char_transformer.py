"""A causal character-level Transformer for next-character prediction (Shakespeare)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from real_data.models.checks import check_transformer
from real_data.models.groups import ParamGroup, check_groups, group
from real_data.models.layers import Block


@dataclass(frozen=True)
class CharTransformerConfig:
    """Character Transformer hyper-parameters; ``vocab_size``, ``seq_len`` default to the data's.

    Attributes
    ----------
    dim, depth, heads, mlp_dim : int
        Width d, number of blocks, heads, MLP hidden width.
    attention : {"softmax", "linear"}
        Causal softmax attention, or causal linear attention (phi = elu + 1).
    activation : {"gelu", "relu"}
    dropout : float
    """

    dim: int = 128
    depth: int = 2
    heads: int = 8
    mlp_dim: int = 512
    attention: Literal["softmax", "linear"] = "softmax"
    activation: Literal["gelu", "relu"] = "gelu"
    dropout: float = 0.0
    vocab_size: int | None = None
    seq_len: int | None = None

    def __post_init__(self) -> None:
        check_transformer(self, ("dim", "depth", "heads", "mlp_dim", "vocab_size", "seq_len"))


class CharTransformer(nn.Module):
    """Token + position embedding -> causal pre-norm blocks -> final norm -> vocabulary head.

    Input ``(B, L)`` int64 character ids, output logits ``(B, L, vocab_size)``.
    """

    task = "text"

    def __init__(self, cfg: CharTransformerConfig) -> None:
        super().__init__()
        if cfg.vocab_size is None or cfg.seq_len is None:
            raise ValueError("CharTransformerConfig needs vocab_size and seq_len")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.pos = nn.Parameter(torch.randn(1, cfg.seq_len, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_dim, cfg.attention, cfg.activation, True,
                  cfg.dropout)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        h = self.tok(x) + self.pos[:, :n]  # (B, L, D)
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.norm(h))  # (B, L, V)

    def param_groups(self) -> tuple[ParamGroup, ...]:
        """Groups in forward order: embed, per block (norm, qk, v, attn_out, mlp), head."""
        groups = [group(self, "embed", None, [self.tok, self.pos])]
        for i, blk in enumerate(self.blocks):
            groups += [
                group(self, "norm", i, [blk.norm1, blk.norm2]),
                group(self, "qk", i, [blk.attn.q, blk.attn.k]),
                group(self, "v", i, [blk.attn.v]),
                group(self, "attn_out", i, [blk.attn.out]),
                group(self, "mlp", i, [blk.mlp]),
            ]
        groups.append(group(self, "head", None, [self.norm, self.head]))
        out = tuple(groups)
        check_groups(self, out)
        return out
