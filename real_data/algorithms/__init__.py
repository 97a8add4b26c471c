"""Federated algorithms behind one interface (:class:`Algorithm`), with an explicit registry."""

from __future__ import annotations

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm, AlgorithmContext, RoundPlan, weighted_average
from real_data.algorithms.fedavg import FedAvg, FedAvgParams
from real_data.algorithms.fedfrozen import FedFrozen, FedFrozenParams
from real_data.algorithms.fedpart import FedPart, FedPartParams
from real_data.algorithms.fedprox import FedProx, FedProxParams
from real_data.algorithms.fedsq import FedSQ, FedSQParams
from real_data.algorithms.fedtp import FedTP, FedTPParams
from real_data.algorithms.scaffold import Scaffold, ScaffoldParams

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
    "FedPart",
    "FedPartParams",
    "FedProx",
    "FedProxParams",
    "FedSQ",
    "FedSQParams",
    "FedTP",
    "FedTPParams",
    "RoundPlan",
    "Scaffold",
    "ScaffoldParams",
    "get_algorithm",
    "weighted_average",
]


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under ``name``; unknown names list the valid ones."""
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name: unknown algorithm {name!r}; valid: {', '.join(ALGORITHMS)}"
        )
    return ALGORITHMS[name]
