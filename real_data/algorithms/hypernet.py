"""FedTP's server-side hypernetwork: client embedding -> MLP -> one head per Transformer layer.

The architecture follows the authors' ``ViTHyper``/``ShakesHyper``: an embedding table
``E`` (one row per client), an MLP ``Linear(e, h)`` followed by ``n_hidden`` times
``ReLU, Linear(h, h)`` (no activation after the last), and per layer l one linear head
``H_l: R^h -> R^{|W_l|}`` whose output is reshaped into that layer's attention projection
weights (no bias is generated). PyTorch's default initializations, as in the original.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class HyperNetwork(nn.Module):
    """W_l(k) = H_l(MLP(E[k])) for every layer l and client k.

    Parameters
    ----------
    num_clients : int
        Rows of the embedding table.
    layers : list of dict
        Per layer, ``{parameter name: shape}`` of the weights its head generates (in order).
    embedding_dim, hidden_dim, n_hidden : int
        e, h and the number of (ReLU, Linear(h, h)) blocks after the first Linear(e, h).
    """

    def __init__(self, num_clients: int, layers: list[dict[str, tuple[int, ...]]],
                 embedding_dim: int = 128, hidden_dim: int = 150, n_hidden: int = 3) -> None:
        super().__init__()
        self.layers = [dict(spec) for spec in layers]
        self.embeddings = nn.Embedding(num_clients, embedding_dim)
        mlp: list[nn.Module] = [nn.Linear(embedding_dim, hidden_dim)]
        for _ in range(n_hidden):
            mlp += [nn.ReLU(), nn.Linear(hidden_dim, hidden_dim)]
        self.mlp = nn.Sequential(*mlp)
        self.heads = nn.ModuleList(
            nn.Linear(hidden_dim, sum(math.prod(s) for s in spec.values()))
            for spec in self.layers
        )

    def forward(self, client_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """Generated weights ``{name: (C, *shape)}`` for the clients ``client_ids`` ``(C,)``."""
        features = self.mlp(self.embeddings(client_ids))  # (C, h)
        out: dict[str, torch.Tensor] = {}
        for head, spec in zip(self.heads, self.layers):
            flat = head(features)  # (C, sum of |W| over the layer's projections)
            sizes = [math.prod(s) for s in spec.values()]
            for (name, shape), chunk in zip(spec.items(), flat.split(sizes, dim=1)):
                out[name] = chunk.reshape(len(client_ids), *shape)  # (C, *shape)
        return out

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for spec in self.layers for n in spec)


def hypernet_gradient(
    hnet: HyperNetwork,
    client_ids: torch.Tensor,
    deltas: dict[str, torch.Tensor],
    weights: torch.Tensor,
) -> list[torch.Tensor]:
    """g = sum_k p_k (dW_k / dphi)^T delta_k, one tensor per hypernetwork parameter.

    ``deltas[name]`` is ``(C, *shape)``, delta_k = W_k (generated) - W_k (after local
    training); ``weights`` is ``(C,)`` p_k. One vector-Jacobian product over the stacked
    clients gives the weighted sum, as the authors accumulate it client by client.
    """
    generated = hnet(client_ids)
    names = list(deltas)
    outputs = [generated[n] for n in names]
    grad_outputs = [weights.to(deltas[n].dtype).reshape(-1, *([1] * (deltas[n].dim() - 1)))
                    * deltas[n] for n in names]
    params = list(hnet.parameters())
    grads = torch.autograd.grad(outputs, params, grad_outputs=grad_outputs,
                                allow_unused=True)
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, grads)]


@torch.no_grad()
def sgd_momentum_step(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    buffers: list[torch.Tensor] | None,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> list[torch.Tensor]:
    """``torch.optim.SGD`` (dampening 0, not Nesterov), in place; returns the momentum buffers.

    d = g + lambda phi;  b = d on the first step, else b = mu b + d;  phi <- phi - eta b.
    """
    new_buffers = []
    for i, (p, g) in enumerate(zip(params, grads)):
        d = g + weight_decay * p if weight_decay else g.clone()
        b = d if buffers is None else buffers[i].mul_(momentum).add_(d)
        p.sub_(lr * b)
        new_buffers.append(b)
    return new_buffers
