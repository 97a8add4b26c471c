"""Flower adapter (extra ``flower``): linattn's algorithms on Flower's engines.

- :mod:`real_data.flower.client`: the ClientApp (one node = one client, linattn's engine);
- :mod:`real_data.flower.strategy`: :class:`LinattnStrategy` and one subclass per algorithm
  (FedAvg, FedProx, FedFrozen, FedPart), registry :data:`STRATEGIES`, :func:`strategy_for`;
- :mod:`real_data.flower.simulation`: :func:`simulate` on the Ray simulation engine, and the
  ``server_app`` / ``client_app`` components for ``flwr run``.

Runs write the same run directory as ``linattn run`` (docs/scaleout.md).
"""

from real_data.flower.client import make_client_app
from real_data.flower.simulation import simulate
from real_data.flower.strategy import (
    STRATEGIES,
    FedAvgStrategy,
    FedFrozenStrategy,
    FedPartStrategy,
    FedProxStrategy,
    LinattnStrategy,
    strategy_for,
)

__all__ = [
    "STRATEGIES",
    "FedAvgStrategy",
    "FedFrozenStrategy",
    "FedPartStrategy",
    "FedProxStrategy",
    "LinattnStrategy",
    "make_client_app",
    "simulate",
    "strategy_for",
]
