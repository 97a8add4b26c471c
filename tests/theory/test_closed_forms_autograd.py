"""Closed-form losses and gradients (docs/theory.md, eqs. 4-11) against torch autograd.

The expected client loss L_m(M, V) is rebuilt in torch (float64) by two routes that share no
code with ``linattn_theory``:

A. the Gaussian fourth-moment identity, eq. (4), written out again in torch;
B. no fourth-moment identity at all: the per-sequence loss is a quadratic in Sigma_hat,
   l(S) = 1/2 tr(D(S)^T Sigma D(S)) + d_y s^2/2 with D(S) = M S V - M* S V* (expectation over
   the query and the noise), so E l(Sigma_hat) = l(Sigma) + sum_ab Cov(Sigma_hat)_ab q(E_a, E_b)
   exactly, with the Wishart covariance Cov(Sigma_hat_ij, Sigma_hat_kl) =
   (Sigma_ik Sigma_jl + Sigma_il Sigma_jk) / n and q the bilinear form of l.

torch.autograd differentiates both; every closed-form gradient must agree to relative error
< 1e-8 (Frobenius norm of the difference over the norm of the reference). The profile Phi is
rebuilt in torch through an explicit linear solve (no envelope theorem), so autograd of it
checks eq. (11) independently.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from linattn_theory.objectives import (
    client_gradients,
    client_losses,
    factored_gradients,
    global_gradient,
    global_loss,
    local_gradients,
)
from linattn_theory.problem import make_problem
from linattn_theory.profile import (
    kernel_profile,
    optimal_value,
    profile_and_gradient,
    profile_gradient,
    profile_values,
)

F64 = torch.float64
REL_TOL = 1e-8

# (dim, out_dim, context_length, clients, covariate_shift, weights)
CASES = [
    (2, 1, 1, 2, 0.0, "uniform"),
    (3, 2, 3, 3, 0.5, "random"),
    (5, 2, 10, 4, 0.8, "random"),
]


def _problem(case, seed=0):
    d, dy, n, c, rho, w = case
    return make_problem(dim=d, num_clients=c, context_length=n, out_dim=dy,
                        kernel_heterogeneity=0.7, value_heterogeneity=0.6, covariate_shift=rho,
                        ridge=0.03, kernel_ridge=0.02, noise=0.2, weights=w, seed=seed)


def _rel(actual, expected) -> float:
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-300))


def _t(x) -> torch.Tensor:
    return torch.tensor(np.array(x, dtype=np.float64), dtype=F64)


def _loss_fourth_moment(sigma, m_star, v_star, noise, n, kernel, value):
    """Route A: eq. (4) rewritten in torch; one client; differentiable in (kernel, value)."""
    def g(a):
        return (sigma @ a @ sigma
                + (sigma @ a.T @ sigma + torch.trace(a @ sigma) * sigma) / n)

    quad = torch.trace(value.T @ g(kernel.T @ sigma @ kernel) @ value)
    cross = torch.trace(value.T @ g(kernel.T @ sigma @ m_star) @ v_star)
    const = torch.trace(v_star.T @ g(m_star.T @ sigma @ m_star) @ v_star)
    return 0.5 * quad - cross + 0.5 * const + 0.5 * v_star.shape[1] * noise**2


def _loss_wishart(sigma, m_star, v_star, noise, n, kernel, value):
    """Route B: quadratic-in-Sigma_hat expectation with the Wishart covariance (no eq. 4)."""
    def resid(s):  # D(S) = M S V - M* S V*, shape (d, d_y)
        return kernel @ s @ value - m_star @ s @ v_star

    mean_part = 0.5 * torch.trace(resid(sigma).T @ sigma @ resid(sigma))
    # basis responses Z[i, j] = M E_ij V - M* E_ij V*  -> shape (d, d, d, d_y)
    z = (torch.einsum("pi,ja->ijpa", kernel, value)
         - torch.einsum("pi,ja->ijpa", m_star, v_star))
    q = 0.5 * torch.einsum("ijpa,pq,klqa->ijkl", z, sigma, z)
    cov = (torch.einsum("ik,jl->ijkl", sigma, sigma)
           + torch.einsum("il,jk->ijkl", sigma, sigma)) / n
    return mean_part + torch.sum(q * cov) + 0.5 * v_star.shape[1] * noise**2


ROUTES = {"fourth_moment": _loss_fourth_moment, "wishart": _loss_wishart}


def _client_loss_fn(problem, route):
    fn = ROUTES[route]
    data = [(_t(problem.covariances[c]), _t(problem.kernel_teachers[c]),
             _t(problem.value_teachers[c])) for c in range(problem.num_clients)]

    def loss(c, kernel, value):
        s, ms, vs = data[c]
        return fn(s, ms, vs, problem.noise, problem.context_length, kernel, value)

    return loss


def _random_point(problem, rng, per_client=False, scale=0.8):
    d, dy, c = problem.dim, problem.out_dim, problem.num_clients
    lead = (c,) if per_client else ()
    return (scale * rng.standard_normal((*lead, d, d)),
            scale * rng.standard_normal((*lead, d, dy)))


@pytest.mark.parametrize("case", CASES)
def test_two_torch_routes_agree_with_client_losses(case):
    """client_losses and global_loss equal both torch routes (rel. 1e-12)."""
    problem = _problem(case)
    rng = np.random.default_rng(1)
    kernel, value = _random_point(problem, rng)
    closed = client_losses(problem, kernel, value)
    for route in ROUTES:
        loss = _client_loss_fn(problem, route)
        ref = np.array([loss(c, _t(kernel), _t(value)).item()
                        for c in range(problem.num_clients)])
        assert _rel(closed, ref) < 1e-12, (route, closed, ref)
    p = problem.weights
    f_ref = (float(p @ closed) + 0.5 * problem.ridge * np.sum(value**2)
             + 0.5 * problem.kernel_ridge * np.sum(kernel**2))
    assert abs(global_loss(problem, kernel, value) - f_ref) <= 1e-12 * abs(f_ref)


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("case", CASES)
def test_client_and_local_gradients_match_autograd(case, route):
    """eqs. (7)-(8) per client, at a shared point and at per-client points; plus the ridges."""
    problem = _problem(case)
    loss = _client_loss_fn(problem, route)
    rng = np.random.default_rng(2)
    for per_client in (False, True):
        kernel, value = _random_point(problem, rng, per_client=per_client)
        gm, gv = client_gradients(problem, kernel, value)
        lgm, lgv = local_gradients(problem, kernel, value)
        for c in range(problem.num_clients):
            mk = _t(kernel[c] if per_client else kernel).requires_grad_(True)
            vk = _t(value[c] if per_client else value).requires_grad_(True)
            ref_m, ref_v = torch.autograd.grad(loss(c, mk, vk), (mk, vk))
            assert _rel(gm[c], ref_m) < REL_TOL
            assert _rel(gv[c], ref_v) < REL_TOL
            local = (loss(c, mk, vk) + 0.5 * problem.ridge * torch.sum(vk**2)
                     + 0.5 * problem.kernel_ridge * torch.sum(mk**2))
            ref_lm, ref_lv = torch.autograd.grad(local, (mk, vk))
            assert _rel(lgm[c], ref_lm) < REL_TOL
            assert _rel(lgv[c], ref_lv) < REL_TOL


@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("case", CASES)
def test_global_gradient_matches_autograd(case, route):
    """grad F of eq. (3): weighted client losses plus both ridges."""
    problem = _problem(case)
    loss = _client_loss_fn(problem, route)
    kernel, value = _random_point(problem, np.random.default_rng(3))
    mk, vk = _t(kernel).requires_grad_(True), _t(value).requires_grad_(True)
    f = sum(float(w) * loss(c, mk, vk) for c, w in enumerate(problem.weights))
    f = f + 0.5 * problem.ridge * torch.sum(vk**2) + 0.5 * problem.kernel_ridge * torch.sum(mk**2)
    ref_m, ref_v = torch.autograd.grad(f, (mk, vk))
    gm, gv = global_gradient(problem, kernel, value)
    assert _rel(gm, ref_m) < REL_TOL
    assert _rel(gv, ref_v) < REL_TOL
    assert abs(global_loss(problem, kernel, value) - f.item()) <= 1e-12 * abs(f.item())


@pytest.mark.parametrize("rank", [1, 2, 4])
@pytest.mark.parametrize("case", CASES[1:])
def test_factored_gradients_match_autograd(case, rank):
    """eq. (9): f_m(W_Q W_K^T, V) differentiated in (W_Q, W_K, V), shared and per client."""
    problem = _problem(case)
    loss = _client_loss_fn(problem, "wishart")
    d, c_num = problem.dim, problem.num_clients
    rng = np.random.default_rng(4)
    for per_client in (False, True):
        lead = (c_num,) if per_client else ()
        query = rng.standard_normal((*lead, d, rank))
        key = rng.standard_normal((*lead, d, rank))
        value = rng.standard_normal((*lead, d, problem.out_dim))
        gq, gk, gv = factored_gradients(problem, query, key, value)
        assert gq.shape == (c_num, d, rank) and gk.shape == (c_num, d, rank)
        for c in range(c_num):
            q = _t(query[c] if per_client else query).requires_grad_(True)
            k = _t(key[c] if per_client else key).requires_grad_(True)
            v = _t(value[c] if per_client else value).requires_grad_(True)
            m = q @ k.T
            f = (loss(c, m, v) + 0.5 * problem.ridge * torch.sum(v**2)
                 + 0.5 * problem.kernel_ridge * torch.sum(m**2))
            ref_q, ref_k, ref_v = torch.autograd.grad(f, (q, k, v))
            assert _rel(gq[c], ref_q) < REL_TOL
            assert _rel(gk[c], ref_k) < REL_TOL
            assert _rel(gv[c], ref_v) < REL_TOL


def _torch_profile(problem, kernel):
    """Phi(M) = min_V F(M, V) in torch: H, C, c from route A, V* by torch.linalg.solve."""
    p = _t(problem.weights)
    n, d = problem.context_length, problem.dim
    hess = problem.ridge * torch.eye(d, dtype=F64)
    lin = torch.zeros(d, problem.out_dim, dtype=F64)
    const = 0.5 * problem.kernel_ridge * torch.sum(kernel**2)
    for c in range(problem.num_clients):
        s, ms, vs = (_t(problem.covariances[c]), _t(problem.kernel_teachers[c]),
                     _t(problem.value_teachers[c]))

        def g(a, s=s):
            return s @ a @ s + (s @ a.T @ s + torch.trace(a @ s) * s) / n

        hess = hess + p[c] * g(kernel.T @ s @ kernel)
        lin = lin + p[c] * g(kernel.T @ s @ ms) @ vs
        const = const + p[c] * (0.5 * torch.trace(vs.T @ g(ms.T @ s @ ms) @ vs)
                                + 0.5 * problem.out_dim * problem.noise**2)
    v_opt = torch.linalg.solve(hess, lin)
    return const - 0.5 * torch.sum(lin * v_opt), v_opt


@pytest.mark.parametrize("case", CASES)
def test_profile_gradient_matches_autograd_through_solve(case):
    """grad Phi by the envelope theorem (eq. 11) vs autograd through the solve of eq. (10)."""
    problem = _problem(case)
    rng = np.random.default_rng(5)
    kernels = rng.standard_normal((3, problem.dim, problem.dim)) * 0.7
    for kernel in kernels:
        mk = _t(kernel).requires_grad_(True)
        phi, v_opt = _torch_profile(problem, mk)
        (ref,) = torch.autograd.grad(phi, mk)
        assert abs(kernel_profile(problem, kernel) - phi.item()) <= 1e-12 * abs(phi.item())
        assert _rel(optimal_value(problem, kernel), v_opt.detach()) < 1e-10
        assert _rel(profile_gradient(problem, kernel), ref) < REL_TOL
        value, grad = profile_and_gradient(problem, kernel)
        assert abs(value - phi.item()) <= 1e-12 * abs(phi.item())
        assert _rel(grad, ref) < REL_TOL
    batched = profile_values(problem, kernels)
    single = np.array([kernel_profile(problem, k) for k in kernels])
    np.testing.assert_allclose(batched, single, rtol=1e-12)


@pytest.mark.parametrize("case", CASES)
def test_envelope_theorem_with_wishart_route(case):
    """grad_M F(M, V) at V = V*(M) held fixed (route B) equals grad Phi (eq. 11)."""
    problem = _problem(case)
    loss = _client_loss_fn(problem, "wishart")
    kernel = np.random.default_rng(6).standard_normal((problem.dim, problem.dim))
    v_opt = _t(optimal_value(problem, kernel))
    mk = _t(kernel).requires_grad_(True)
    f = sum(float(w) * loss(c, mk, v_opt) for c, w in enumerate(problem.weights))
    f = f + 0.5 * problem.kernel_ridge * torch.sum(mk**2)
    (ref,) = torch.autograd.grad(f, mk)
    assert _rel(profile_gradient(problem, kernel), ref) < REL_TOL
