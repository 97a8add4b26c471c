"""Parameter groups declared by a model, so that algorithms never match names by substring.

A model returns its groups in forward order (embedding first, head last). Each group has a
``kind`` from :data:`GROUP_KINDS` and, for per-layer groups, the layer index; algorithms select
by kind (FedFrozen: ``qk``) or by position (FedPart: shallow to deep).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

GROUP_KINDS = ("embed", "qk", "v", "attn_out", "mlp", "norm", "head")


@dataclass(frozen=True)
class ParamGroup:
    """One named set of parameters.

    Attributes
    ----------
    name : str
        ``"embed"``, ``"head"`` or ``"layers.{i}.{kind}"``.
    kind : str
        One of :data:`GROUP_KINDS`.
    layer : int or None
        Block index for per-layer groups, ``None`` for ``embed`` and ``head``.
    params : tuple of str
        Parameter names as in ``model.named_parameters()``.
    """

    name: str
    kind: str
    layer: int | None
    params: tuple[str, ...]


def group(
    root: nn.Module, kind: str, layer: int | None, members: Iterable[nn.Module | nn.Parameter]
) -> ParamGroup:
    """Build a group from module or parameter objects of ``root`` (identity, not names)."""
    if kind not in GROUP_KINDS:
        raise ValueError(f"unknown group kind {kind!r}; valid: {GROUP_KINDS}")
    name_of = {id(p): n for n, p in root.named_parameters()}
    names: list[str] = []
    for m in members:
        tensors = m.parameters() if isinstance(m, nn.Module) else [m]
        names.extend(name_of[id(p)] for p in tensors)
    gname = kind if layer is None else f"layers.{layer}.{kind}"
    return ParamGroup(gname, kind, layer, tuple(names))


def names_of_kind(groups: Iterable[ParamGroup], *kinds: str) -> tuple[str, ...]:
    """All parameter names in groups whose kind is one of ``kinds``, in model order."""
    bad = [k for k in kinds if k not in GROUP_KINDS]
    if bad:
        raise ValueError(f"unknown group kind(s) {bad}; valid: {GROUP_KINDS}")
    return tuple(n for g in groups if g.kind in kinds for n in g.params)


def check_groups(model: nn.Module, groups: tuple[ParamGroup, ...]) -> None:
    """Every parameter belongs to exactly one group."""
    seen: dict[str, str] = {}
    for g in groups:
        for n in g.params:
            if n in seen:
                raise ValueError(f"parameter {n} is in groups {seen[n]} and {g.name}")
            seen[n] = g.name
    missing = [n for n, _ in model.named_parameters() if n not in seen]
    if missing:
        raise ValueError(f"parameters in no group: {missing}")


def numel(params: dict[str, torch.Tensor], names: Iterable[str]) -> int:
    """Total element count of the named tensors."""
    return int(sum(params[n].numel() for n in names))
