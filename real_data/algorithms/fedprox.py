"""FedProx (Li et al., 2020): FedAvg with a proximal term in the local objective."""

from __future__ import annotations

from dataclasses import dataclass

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm


@dataclass(frozen=True)
class FedProxParams:
    """Attributes
    ----------
    mu : float
        Proximal coefficient mu >= 0; mu = 0 is FedAvg.
    """

    mu: float = 0.01

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ConfigError(f"algorithm.mu={self.mu} must be >= 0")


class FedProx(Algorithm):
    """Local objective h_m(w) = L_m(w) + (mu / 2) ||w - w_t||^2, w_t the received model.

    The same expression is minimized and logged (``local_objective``); the sum runs over the
    trainable parameters.
    """

    name = "fedprox"
    Params = FedProxParams

    def regularizer(self, params, anchor, client_state, server_state):
        sq = sum((p - anchor[n]).pow(2).sum() for n, p in params.items())
        return 0.5 * self.params.mu * sq

    def local_terms(self, trainable, client_state, server_state):
        """The regularizer as stacked runs take it: no gradient offset, proximal weight mu
        (anchor: the client's start, the round's global model)."""
        return None, float(self.params.mu)

    def tag(self) -> str:
        return f"fedprox-mu{self.params.mu:g}"


