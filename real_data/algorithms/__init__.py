"""Federated algorithms behind one interface (:class:`Algorithm`), with an explicit registry."""

from __future__ import annotations

from linattn.errors import ConfigError
from real_data.algorithms.base import (
    Algorithm,
    AlgorithmContext,
    RoundPlan,
    ServerUpdate,
    weighted_average,
    weighted_averages,
)
from real_data.algorithms.fedavg import FedAvg, FedAvgParams
from real_data.algorithms.fedfrozen import FedFrozen, FedFrozenParams, FedFrozenState
from real_data.algorithms.fedpart import FedPart, FedPartParams, FedPartState
from real_data.algorithms.fedprox import FedProx, FedProxParams
from real_data.algorithms.fedsq import FedSQ, FedSQParams, FedSQState
from real_data.algorithms.fedtp import FedTP, FedTPParams, FedTPState
from real_data.algorithms.scaffold import Scaffold, ScaffoldParams, ScaffoldState

ALGORITHMS: dict[str, type[Algorithm]] = {
    cls.name: cls for cls in (FedAvg, FedProx, Scaffold, FedFrozen, FedPart, FedTP, FedSQ)
}

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmContext",
    "FedAvg",
    "FedAvgParams",
    "FedFrozen",
    "FedFrozenParams",
    "FedFrozenState",
    "FedPart",
    "FedPartParams",
    "FedPartState",
    "FedProx",
    "FedProxParams",
    "FedSQ",
    "FedSQParams",
    "FedSQState",
    "FedTP",
    "FedTPParams",
    "FedTPState",
    "RoundPlan",
    "Scaffold",
    "ScaffoldParams",
    "ScaffoldState",
    "ServerUpdate",
    "get_algorithm",
    "weighted_average",
    "weighted_averages",
]


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under ``name``; unknown names list the valid ones."""
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}"
        )
    return ALGORITHMS[name]
