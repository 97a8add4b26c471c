"""Per-sequence gradients of the attention student in closed form, batched (torch).

Linear attention (THEORY.md, section 1): for one sequence with Sigma_hat, x_q and label y,

    u = Sigma_hat M^T x_q,   yhat = V^T u,   r = yhat - y,   loss = 1/2 ||r||^2,
    grad_V = u r^T,          grad_M = x_q (Sigma_hat V r)^T.

Softmax attention (the optional student; the data still come from the linear teacher):

    s_j = x_q^T M x_j / sqrt(d),  a = softmax(s),  u = sum_j a_j x_j,  yhat = V^T u,
    grad_V = u r^T,  grad_M = x_q (sum_j a_j (x_j - u)^T g x_j)^T / sqrt(d),  g = V r.

Factored kernel M = W_Q W_K^T: grad_{W_Q} = grad_M W_K, grad_{W_K} = grad_M^T W_Q (eq. 9).
Ridge terms lambda V and lambda_M M are added to the minibatch means, as in the local
objectives f_m of ``linattn_theory.objectives.local_gradients``.

Every function broadcasts over arbitrary leading axes (runs, stage copies, clients); the
batch axis B sits just before the feature axes.
"""

from __future__ import annotations

import math

import torch

ATTENTIONS = ("linear", "softmax")


def features(kernel, batch: dict, attention: str):
    """u of every sequence, shape (..., B, d); ``kernel`` has shape (..., d, d)."""
    xq = batch["query"]
    if attention == "linear":
        a = torch.einsum("...kl,...bk->...bl", kernel, xq)  # M^T x_q
        return torch.einsum("...bij,...bj->...bi", batch["sigma_hat"], a), None
    tokens = batch["tokens"]  # (..., B, n, d)
    qm = torch.einsum("...bk,...kl->...bl", xq, kernel)  # x_q^T M
    scores = torch.einsum("...bjl,...bl->...bj", tokens, qm) / math.sqrt(kernel.shape[-1])
    att = torch.softmax(scores, dim=-1)
    return torch.einsum("...bj,...bjl->...bl", att, tokens), att


def residuals(kernel, value, batch: dict, attention: str):
    """(u, r, attention weights or None); r = V^T u - y has shape (..., B, d_y)."""
    u, att = features(kernel, batch, attention)
    res = torch.einsum("...bi,...ia->...ba", u, value) - batch["target"]
    return u, res, att


def kernel_value_gradients(kernel, value, batch: dict, attention: str, ridge, kernel_ridge):
    """Minibatch-mean gradients (grad_M f, grad_V f) of the local objective.

    Parameters
    ----------
    kernel : tensor, shape (..., d, d)
    value : tensor, shape (..., d, d_y)
    batch : dict of tensors
        ``query`` (..., B, d), ``target`` (..., B, d_y) and ``sigma_hat`` (..., B, d, d)
        (linear) or ``tokens`` (..., B, n, d) (softmax); broadcast against the parameters.
    ridge, kernel_ridge : float or tensor broadcastable to the parameters
        lambda and lambda_M.
    """
    u, res, att = residuals(kernel, value, batch, attention)
    size = res.shape[-2]
    grad_v = torch.einsum("...bi,...ba->...ia", u, res) / size + ridge * value
    xq = batch["query"]
    if attention == "linear":
        # grad_M = mean_b x_q (Sigma_hat V r)^T
        vr = torch.einsum("...ia,...ba->...bi", value, res)
        w = torch.einsum("...bij,...bj->...bi", batch["sigma_hat"], vr)
        grad_m = torch.einsum("...bk,...bl->...kl", xq, w) / size
    else:
        tokens = batch["tokens"]
        g = torch.einsum("...ia,...ba->...bi", value, res)  # V r
        xg = torch.einsum("...bjl,...bl->...bj", tokens, g)
        ug = torch.sum(u * g, dim=-1, keepdim=True)
        ds = att * (xg - ug)  # d loss / d s_j
        z = torch.einsum("...bj,...bjl->...bl", ds, tokens)
        grad_m = torch.einsum("...bk,...bl->...kl", xq, z) / (size * math.sqrt(kernel.shape[-1]))
    return grad_m + kernel_ridge * kernel, grad_v


def value_gradient(kernel, value, batch: dict, attention: str, ridge):
    """Minibatch-mean grad_V f alone (frozen stage)."""
    u, res, _ = residuals(kernel, value, batch, attention)
    return torch.einsum("...bi,...ba->...ia", u, res) / res.shape[-2] + ridge * value


def sequence_loss(kernel, value, batch: dict, attention: str):
    """Mean over the batch axis of 1/2 ||yhat - y||^2, shape (...)."""
    _, res, _ = residuals(kernel, value, batch, attention)
    return 0.5 * torch.mean(torch.sum(res**2, dim=-1), dim=-1)


def parameter_gradients(params: tuple, batch: dict, attention: str, ridge, kernel_ridge):
    """Gradients for the merged (M, V) or factored (W_Q, W_K, V) parameter tuple."""
    if len(params) == 2:
        return kernel_value_gradients(params[0], params[1], batch, attention, ridge,
                                      kernel_ridge)
    query, key, value = params
    grad_m, grad_v = kernel_value_gradients(query @ key.transpose(-1, -2), value, batch,
                                            attention, ridge, kernel_ridge)
    return grad_m @ key, grad_m.transpose(-1, -2) @ query, grad_v


def linear_gradients_stacked(kernel, value, sigma_hat, query, target, ridge, kernel_ridge):
    """Linear-attention gradients for S stacked parameter copies sharing one minibatch.

    The same numbers as :func:`kernel_value_gradients` (linear), arranged so that the
    per-sequence products with Sigma_hat are one batched matmul over (run, client, sequence)
    with the S copies as columns, instead of a broadcast that copies Sigma_hat S times.

    Parameters
    ----------
    kernel : tensor, shape (R, S, C, d, d)
    value : tensor, shape (R, S, C, d, d_y)
    sigma_hat : tensor, shape (R, C, B, d, d)
    query : tensor, shape (R, C, B, d)
    target : tensor, shape (R, C, B, d_y)
    ridge, kernel_ridge : tensor, shape (R, 1, 1, 1, 1)

    Returns
    -------
    grad_kernel, grad_value : tensors shaped like ``kernel`` and ``value``
    """
    size = query.shape[-2]
    xq = query.unsqueeze(1)  # (R, 1, C, B, d)
    a = torch.matmul(xq, kernel)  # rows x_q^T M = (M^T x_q)^T, (R, S, C, B, d)
    u = torch.matmul(sigma_hat, a.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)  # Sigma_hat a
    res = torch.matmul(u, value) - target.unsqueeze(1)  # (R, S, C, B, d_y)
    grad_v = torch.matmul(u.transpose(-1, -2), res) / size + ridge * value
    vr = torch.matmul(res, value.transpose(-1, -2))  # (V r)^T, (R, S, C, B, d)
    w = torch.matmul(sigma_hat, vr.permute(0, 2, 3, 4, 1)).permute(0, 4, 1, 2, 3)
    grad_m = torch.matmul(xq.transpose(-1, -2), w) / size + kernel_ridge * kernel
    return grad_m, grad_v


def kernel_of(params: tuple):
    """M from a merged or factored parameter tuple."""
    return params[0] if len(params) == 2 else params[0] @ params[1].transpose(-1, -2)
