"""Models and their registry: name -> (config dataclass, module class).

Every model exposes ``param_groups()`` (see :mod:`real_data.models.groups`) and a ``task``
(``"image"`` or ``"text"``); :func:`build_model` fills the data-dependent config fields.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from linattn.errors import ConfigError
from real_data.models.char_transformer import CharTransformer, CharTransformerConfig
from real_data.models.groups import GROUP_KINDS, ParamGroup, names_of_kind, numel
from real_data.models.vit import ViT, ViTConfig

MODELS: dict[str, tuple[type, type[nn.Module]]] = {
    "vit": (ViTConfig, ViT),
    "char_transformer": (CharTransformerConfig, CharTransformer),
}

__all__ = [
    "GROUP_KINDS",
    "MODELS",
    "CharTransformer",
    "CharTransformerConfig",
    "ParamGroup",
    "ViT",
    "ViTConfig",
    "build_model",
    "complete_model_config",
    "model_config_class",
    "names_of_kind",
    "numel",
]


def model_config_class(name: str) -> type:
    """The config dataclass of a registered model; unknown names list the valid ones."""
    if name not in MODELS:
        raise ConfigError(f"model.name: unknown model {name!r}; valid: {', '.join(MODELS)}")
    return MODELS[name][0]


def complete_model_config(name: str, cfg, input_shape: tuple[int, ...], num_classes: int):
    """Fill the data-dependent fields of a model config (error if they contradict the data)."""
    if name == "vit":
        if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
            raise ConfigError(f"model.name: vit needs square images, data has {input_shape}")
        data = {"channels": input_shape[0], "image_size": input_shape[1],
                "num_classes": num_classes}
    else:
        if len(input_shape) != 1:
            raise ConfigError(f"model.name: {name} needs token sequences, data has {input_shape}")
        data = {"seq_len": input_shape[0], "vocab_size": num_classes}
    for key, value in data.items():
        given = getattr(cfg, key)
        if given is not None and given != value:
            raise ConfigError(f"model.{key}={given} contradicts the data ({value}); remove it")
    # the config's own checks run again with the data's fields (patch dividing the image)
    return dataclasses.replace(cfg, **data)


def build_model(name: str, cfg, seed: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Construct a model with initial weights determined by ``seed`` alone.

    The global RNG is forked, so the caller's random state is untouched.
    """
    config_cls, model_cls = MODELS[name]
    assert isinstance(cfg, config_cls)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(cfg)
    return model.to(dtype)
