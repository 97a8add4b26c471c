"""The torch device a config names: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""

from __future__ import annotations

import torch

from linattn.errors import ConfigError


def resolve_device(name: str, key: str = "train.device") -> torch.device:
    """``auto`` -> CUDA when available, else CPU; a device that is not here names ``key``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ConfigError(f"{key}={name!r} is not a device; use auto, cpu, cuda or "
                          "cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}={name!r} but torch sees no CUDA device; use {key}=cpu "
                          "or auto") from None
    if device.type == "cuda" and device.index is not None and \
            device.index >= torch.cuda.device_count():
        raise ConfigError(f"{key}={name!r} but only {torch.cuda.device_count()} CUDA "
                          "device(s) exist") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"{key}={name!r}: only cpu and cuda devices are supported")
    return device
