"""Finite client data sets for the simulator, drawn from a :class:`Problem` (THEORY.md, section 1).

Client m holds N sequences. Sequence i has context tokens x_1..x_n and a query x_q, i.i.d.
N(0, Sigma_m), and the teacher label

    y_i = V*_m^T Sigma_hat_i M*_m^T x_q,i + eps_i,   eps_i ~ N(0, s^2 I),

so that the population loss of a client is exactly ``linattn_theory.objectives.client_losses``.
The linear-attention student only needs (Sigma_hat_i, x_q,i, y_i); the softmax student also
needs the context tokens, which are then kept.

Randomness is split by role: the tokens of a data set come from the generator of
``(seed, role)`` alone, so settings that share a seed see the same standard-normal draws
(common random numbers) and differ only through Sigma_m and the teachers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from linattn_theory.problem import Problem

# seed roles: one independent stream per purpose (ARCHITECTURE.md, "Seeds are split by role")
ROLE_DATA = 1
ROLE_TEST = 2
ROLE_SAMPLING = 3
ROLE_PARTICIPATION = 4


def role_rng(seed: int, role: int) -> np.random.Generator:
    """The generator of one (seed, role) pair."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(role)]))


@dataclass(frozen=True, eq=False)
class ClientData:
    """The data sets of all clients of one problem for one seed.

    Attributes
    ----------
    sigma_hat : ndarray, shape (C, N, d, d)
        Sigma_hat_i = (1/n) sum_j x_j x_j^T of every sequence.
    query : ndarray, shape (C, N, d)
        x_q,i.
    target : ndarray, shape (C, N, d_y)
        y_i.
    tokens : ndarray, shape (C, N, n, d) or None
        The context tokens (kept only for the softmax student).
    """

    sigma_hat: np.ndarray
    query: np.ndarray
    target: np.ndarray
    tokens: np.ndarray | None = None

    @property
    def samples_per_client(self) -> int:
        return int(self.query.shape[1])


def sample_client_data(problem: Problem, samples_per_client: int, seed: int,
                       role: int = ROLE_DATA, keep_tokens: bool = False) -> ClientData:
    """Draw N sequences per client from the teacher of ``problem``.

    Parameters
    ----------
    problem : Problem
    samples_per_client : int
        N.
    seed : int
        The Monte Carlo seed; with ``role`` it fixes the generator.
    role : int
        ``ROLE_DATA`` for training sets, ``ROLE_TEST`` for the fresh test sets.
    keep_tokens : bool
        Keep the context tokens (softmax student).
    """
    rng = role_rng(seed, role)
    c, d, n = problem.num_clients, problem.dim, problem.context_length
    chol = np.linalg.cholesky(problem.covariances)  # (C, d, d)
    z = rng.standard_normal((c, samples_per_client, n + 1, d))
    x = z @ np.swapaxes(chol, 1, 2)[:, None]  # rows x^T = z^T chol^T, shape (C, N, n+1, d)
    query, context = x[:, :, 0], x[:, :, 1:]
    sigma_hat = np.swapaxes(context, 2, 3) @ context / n  # (C, N, d, d)
    # teacher: u* = Sigma_hat M*^T x_q, y = V*^T u* + eps
    a_star = query @ problem.kernel_teachers  # rows (M*^T x_q)^T, (C, N, d)
    u_star = (sigma_hat @ a_star[..., None])[..., 0]  # Sigma_hat M*^T x_q
    target = u_star @ problem.value_teachers  # (C, N, d_y)
    target = target + problem.noise * rng.standard_normal(target.shape)
    return ClientData(sigma_hat=sigma_hat, query=query, target=target,
                      tokens=np.ascontiguousarray(context) if keep_tokens else None)
