"""SCAFFOLD (Karimireddy et al., 2020) with option II control variates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm, RoundPlan, ServerUpdate, weighted_average


@dataclass(frozen=True)
class ScaffoldParams:
    """Attributes
    ----------
    server_lr : float
        Global step size eta_g > 0 (1 recovers the plain average of the client models).
    """

    server_lr: float = 1.0

    def __post_init__(self) -> None:
        if self.server_lr <= 0:
            raise ConfigError(f"algorithm.server_lr={self.server_lr} must be > 0")


@dataclass
class ScaffoldState:
    """SCAFFOLD's server state.

    Attributes
    ----------
    c : dict
        The server control variate c, one tensor per parameter (shaped like it).
    """

    c: dict[str, torch.Tensor]


class Scaffold(Algorithm):
    """Drift-corrected local steps with server and client control variates c, c_m.

    Local step: y <- y - eta (g_m(y) + c - c_m). This is written as the local objective
    h_m(y) = L_m(y) + <c - c_m, y>, whose gradient is exactly that corrected gradient, so the
    logged ``local_objective`` is what the optimizer follows (``train_loss`` is L_m alone).

    After K_m local steps (option II): c_m+ = c_m - c + (x - y_m) / (K_m eta); the client sends
    y_m and Delta c_m = c_m+ - c_m. Server: x <- x + eta_g sum_m p_m (y_m - x) and
    c <- c + (1/N) sum_{m in S} Delta c_m (N clients in all, as in the paper's |S|/N * mean).
    Both control variates are updated in :meth:`update_client_state`, where the Delta c_m are
    formed; :meth:`server_update` moves x only.
    With momentum or Adam the (x - y)/(K eta) estimate is only approximate; the paper uses SGD.
    Control variates are sent with the model, doubling both directions' traffic.
    """

    name = "scaffold"
    Params = ScaffoldParams

    def init_server_state(self, global_params) -> ScaffoldState:
        return ScaffoldState({n: torch.zeros_like(p) for n, p in global_params.items()})

    def init_client_state(self, global_params):
        n_clients = self.ctx.num_clients
        return {n: torch.zeros(n_clients, *p.shape, dtype=p.dtype, device=p.device)
                for n, p in global_params.items()}

    def plan_round(self, rnd, server_state):
        names = self.ctx.names
        size = sum(int(torch.Size(self.ctx.shapes[n]).numel()) for n in names)
        return RoundPlan(names, names, names, extra_upload=size, extra_download=size)

    def regularizer(self, params, anchor, client_state, server_state):
        c = server_state.c
        return sum(((c[n] - client_state[n]) * p).sum() for n, p in params.items())

    def update_client_state(self, rnd, client_ids, global_params, results, client_state,
                            server_state):
        idx = torch.as_tensor(client_ids, device=results.steps.device).long()
        k_eta = results.steps.double() * self.round_lr  # (C,): K eta of this round
        server_c = server_state.c
        for n, c in list(server_c.items()):
            y = results.params[n]
            scale = k_eta.to(y.device).reshape(-1, *([1] * (y.dim() - 1))).to(y.dtype)
            ci = client_state[n][idx.to(client_state[n].device)]
            ci_new = ci - c + (global_params[n] - y) / scale
            delta_c = (ci_new - ci).sum(dim=0)  # sum over the round's clients of Delta c_m
            client_state[n][idx.to(client_state[n].device)] = ci_new
            server_c[n] = c + delta_c / self.ctx.num_clients

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        eta_g = self.params.server_lr
        new = {}
        for n, x in global_params.items():
            avg = weighted_average(results.params[n], weights)
            new[n] = avg if eta_g == 1.0 else x + eta_g * (avg - x)
        return ServerUpdate(new)

    def tag(self) -> str:
        lr_g = self.params.server_lr
        return "scaffold" if lr_g == 1.0 else f"scaffold-lrg{lr_g:g}"
