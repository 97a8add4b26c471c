"""A small Vision Transformer for 8x8x1, 28x28x1 and 32x32x3 images."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from linattn.errors import ConfigError
from real_data.models.checks import check_transformer
from real_data.models.groups import ParamGroup, check_groups, group
from real_data.models.layers import Block


@dataclass(frozen=True)
class ViTConfig:
    """ViT hyper-parameters; ``image_size``, ``channels``, ``num_classes`` default to the data's.

    Attributes
    ----------
    patch : int
        Patch side p; the image side must be divisible by it (N = (H / p)^2 patches).
    dim, depth, heads, mlp_dim : int
        Width d, number of blocks, heads, MLP hidden width.
    attention : {"softmax", "linear"}
    activation : {"gelu", "relu"}
    dropout : float
        Dropout in attention output and MLP; 0 makes training deterministic given the batches.
    pool : {"cls", "mean"}
        Classify from the CLS token or the mean of patch tokens.
    """

    patch: int = 4
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_dim: int = 128
    attention: Literal["softmax", "linear"] = "softmax"
    activation: Literal["gelu", "relu"] = "gelu"
    dropout: float = 0.0
    pool: Literal["cls", "mean"] = "cls"
    image_size: int | None = None
    channels: int | None = None
    num_classes: int | None = None

    def __post_init__(self) -> None:
        check_transformer(self, ("patch", "dim", "depth", "heads", "mlp_dim", "image_size",
                                 "channels", "num_classes"))
        if self.image_size is not None and self.image_size % self.patch:
            raise ConfigError(f"model.patch={self.patch} must divide the image size "
                              f"{self.image_size} (e.g. model.patch=1 or a divisor of it)")


class ViT(nn.Module):
    """Patch embedding -> pre-norm blocks -> final norm -> linear head.

    Input ``(B, C, H, W)`` float, output logits ``(B, num_classes)``.
    """

    task = "image"

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        if cfg.image_size is None or cfg.channels is None or cfg.num_classes is None:
            raise ValueError("ViTConfig needs image_size, channels and num_classes")
        if cfg.image_size % cfg.patch:
            raise ValueError(f"image_size={cfg.image_size} not divisible by patch={cfg.patch}")
        self.cfg = cfg
        n_patches = (cfg.image_size // cfg.patch) ** 2
        self.patch_embed = nn.Linear(cfg.channels * cfg.patch**2, cfg.dim)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos = nn.Parameter(torch.randn(1, n_patches + 1, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(
            Block(cfg.dim, cfg.heads, cfg.mlp_dim, cfg.attention, cfg.activation, False,
                  cfg.dropout)
            for _ in range(cfg.depth)
        )
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        p = self.cfg.patch
        # (B, C, H, W) -> (B, C, H/p, p, W/p, p) -> (B, H/p, W/p, C, p, p) -> (B, N, C p p)
        x = x.reshape(b, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)
        x = x.reshape(b, (h // p) * (w // p), c * p * p)
        x = self.patch_embed(x)  # (B, N, D)
        x = torch.cat([self.cls.expand(b, -1, -1), x], dim=1) + self.pos  # (B, N+1, D)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        x = x[:, 0] if self.cfg.pool == "cls" else x[:, 1:].mean(dim=1)  # (B, D)
        return self.head(x)

    def param_groups(self) -> tuple[ParamGroup, ...]:
        """Groups in forward order: embed, per block (norm, qk, v, attn_out, mlp), head."""
        groups = [group(self, "embed", None, [self.patch_embed, self.cls, self.pos])]
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
