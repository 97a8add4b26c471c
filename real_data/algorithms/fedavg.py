"""FedAvg (McMahan et al., 2017): local SGD from the global model, p-weighted averaging."""

from __future__ import annotations

from dataclasses import dataclass

from real_data.algorithms.base import Algorithm


@dataclass(frozen=True)
class FedAvgParams:
    """FedAvg has no settings beyond the shared local-training ones (K, eta, B)."""


class FedAvg(Algorithm):
    """w_{t+1} = sum_{m in S_t} p_m y_m, with y_m client m's model after local training.

    Everything trains, everything is exchanged; the base class already does exactly this.
    """

    name = "fedavg"
    Params = FedAvgParams
