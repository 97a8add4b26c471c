"""Estimate the theory's warm-up constants from probe rounds of FedAvg on the real network.

The constants are those of ``linattn_theory.warmup.WarmupConstants``; each estimator below uses
only what a FedAvg round already produces (no extra forward or backward passes). Round t of the
probe has global model x_t, client models y_{m,t} after K_m local steps of size eta, weights p_m.

- pseudo-gradient of client m: u_m = (x_t - y_m) / (K_m eta), and u = sum_m p_m u_m
  (exactly the mean local gradient for plain SGD; an effective gradient otherwise);
- F_t, the global objective at x_t: sum_m p_m l_m, with l_m the data loss of client m's first
  minibatch at x_t (unbiased, noisy);
- heterogeneity zeta: sqrt(sum_m p_m ||u_m - u||^2), averaged over the probe rounds (it also
  contains minibatch noise, so it is an upper estimate);
- grad_bound G: max_t ||u_t||;
- smoothness L: the secant curvature along the path, max_t ||u_{t+1} - u_t|| / ||x_{t+1} - x_t||,
  at least mu. It is not capped: stability of eta was observed on the probe path itself (the
  losses stayed finite), so the constants carry ``stability_limit = inf`` rather than asking
  eta < 2 / L of a worst-case secant, as ``linattn_theory.constants`` does for the same reason;
- pl_constant mu and delta0: fit F_t = F_floor + Delta0 rho^t (least squares over a grid of
  rho in (0, 1), F_floor >= 0; with fewer than 4 probe rounds the floor is fixed at 0, the
  infimum of a cross-entropy), so that rho = 1 - eta K mu (the PL contraction per round) gives
  mu = (1 - rho) / (eta K), and delta0 = F_0 - F_floor (the excess over the estimated floor).

All of these are crude (a handful of noisy rounds); the recommended T0 is a starting point to
compare with the empirical best T0, which is what the real-data study does.
"""

from __future__ import annotations

import numpy as np
import torch


def flatten(params: dict[str, torch.Tensor], names, stacked: bool = False) -> torch.Tensor:
    """Concatenate tensors into ``(P,)``, or ``(C, P)`` when ``stacked``."""
    if stacked:
        return torch.cat([params[n].double().flatten(1) for n in names], dim=1)
    return torch.cat([params[n].double().flatten() for n in names])


def round_statistics(
    global_params: dict[str, torch.Tensor],
    client_params: dict[str, torch.Tensor],
    first_loss: torch.Tensor,
    steps: torch.Tensor,
    weights: torch.Tensor,
    lr: float,
) -> dict:
    """One probe round's measurements: F_t, u (flat), zeta_t^2, ||u||, x_t (flat)."""
    names = list(client_params)
    x = flatten(global_params, names)
    y = flatten(client_params, names, stacked=True)  # (C, P)
    k_eta = steps.double().to(y.device).unsqueeze(1) * lr
    u_m = (x.unsqueeze(0) - y) / k_eta  # (C, P)
    p = weights.double().to(y.device)
    u = (p.unsqueeze(1) * u_m).sum(0)
    zeta_sq = float((p * (u_m - u).pow(2).sum(1)).sum())
    return {"loss": float((p * first_loss.double().to(p.device)).sum()), "u": u.cpu(),
            "x": x.cpu(), "zeta_sq": zeta_sq, "grad_norm": float(u.norm()),
            "steps": float((p * steps.double().to(p.device)).sum())}


def fit_geometric(losses: np.ndarray, fit_floor: bool = True) -> tuple[float, float, float]:
    """Least-squares fit of F_t = floor + delta0 * rho^t, floor >= 0 (or 0); (floor, d0, rho)."""
    t = np.arange(len(losses), dtype=np.float64)
    best = (np.inf, float(losses.min()), 0.0, 1.0)
    for rho in np.linspace(0.01, 0.999, 999):
        basis = rho**t
        a = np.stack([np.ones_like(t), basis], axis=1)
        coef, *_ = np.linalg.lstsq(a, losses, rcond=None)
        if coef[0] < 0 or not fit_floor:
            coef = np.array([0.0, basis @ losses / (basis @ basis)])
        resid = float(np.sum((a @ coef - losses) ** 2))
        if resid < best[0]:
            best = (resid, float(coef[0]), float(coef[1]), float(rho))
    return best[1], best[2], best[3]


def estimate_constants(stats: list[dict], lr: float, total_rounds: int) -> dict[str, float]:
    """The WarmupConstants fields from the probe rounds' statistics (see module docstring)."""
    losses = np.array([s["loss"] for s in stats])
    k = float(np.mean([s["steps"] for s in stats]))
    floor, _, rho = fit_geometric(losses, fit_floor=len(losses) >= 4)
    mu = max((1.0 - rho) / (lr * k), 1e-12)
    delta0 = max(float(losses[0]) - floor, 1e-12)
    zeta = float(np.sqrt(np.mean([s["zeta_sq"] for s in stats])))
    grad_bound = max(s["grad_norm"] for s in stats)
    secants = [
        float((b["u"] - a["u"]).norm() / (b["x"] - a["x"]).norm())
        for a, b in zip(stats[:-1], stats[1:])
        if float((b["x"] - a["x"]).norm()) > 0
    ]
    smoothness = max(max(secants) if secants else 1.0 / lr, mu)
    mu = min(mu, smoothness)
    return {"delta0": delta0, "pl_constant": mu, "smoothness": smoothness,
            "heterogeneity": zeta, "grad_bound": grad_bound, "lr": lr,
            "local_steps": max(int(round(k)), 1), "total_rounds": total_rounds,
            "stability_limit": float("inf"), "loss_floor": floor}
