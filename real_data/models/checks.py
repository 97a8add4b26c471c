"""Range checks shared by the model configs, run when a config is built (before any data)."""

from __future__ import annotations

from linattn.errors import ConfigError


def check_transformer(cfg, sizes: tuple[str, ...]) -> None:
    """Raise :class:`ConfigError` naming ``model.<key>`` for an impossible architecture.

    ``sizes`` are the integer fields that must be >= 1 when set (``None``: filled from the
    data later). Also: dropout in [0, 1) and ``heads`` dividing ``dim``.
    """
    for key in sizes:
        value = getattr(cfg, key)
        if value is not None and value < 1:
            raise ConfigError(f"model.{key}={value} must be >= 1")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"model.dropout={cfg.dropout} must be in [0, 1) (0: no dropout)")
    if cfg.dim % cfg.heads:
        raise ConfigError(f"model.heads={cfg.heads} must divide model.dim={cfg.dim}; make "
                          "model.dim a multiple of model.heads")
