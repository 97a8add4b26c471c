"""FedTP (Li et al., arXiv 2211.01572): personalized self-attention from a server hypernetwork."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm, RoundPlan
from real_data.algorithms.hypernet import HyperNetwork, hypernet_gradient, sgd_momentum_step


@dataclass(frozen=True)
class FedTPParams:
    """Attributes
    ----------
    variant : {"hypernetwork", "vanilla"}
        ``hypernetwork``: FedTP, W_k = h(e_k; phi) generated per client. ``vanilla``: the
        authors' ``Personalized-T``, each client keeps its own W_k between rounds.
    embedding_dim, hidden_dim, n_hidden : int
        Client embedding size (128), MLP width (150) and hidden (ReLU, Linear) blocks (3).
    server_lr : float or None
        The hypernetwork's SGD step size eta_phi. ``None`` (the default): the clients' learning
        rate of the round (``train.lr`` under its schedule), as the authors' code steps it
        (``torch.optim.SGD(hnet.parameters(), lr=args.lr, ...)`` in their ``main.py``). A
        number fixes eta_phi, a deviation from the authors.
    server_momentum, server_weight_decay : float
        The hypernetwork's SGD momentum 0.9 and weight decay 1e-3 (the authors').
    """

    variant: Literal["hypernetwork", "vanilla"] = "hypernetwork"
    embedding_dim: int = 128
    hidden_dim: int = 150
    n_hidden: int = 3
    server_lr: float | None = None
    server_momentum: float = 0.9
    server_weight_decay: float = 1e-3

    def __post_init__(self) -> None:
        for key in ("embedding_dim", "hidden_dim"):
            if getattr(self, key) < 1:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)} must be >= 1")
        if self.n_hidden < 0:
            raise ConfigError(f"algorithm.n_hidden={self.n_hidden} must be >= 0")
        if self.server_lr is not None and not self.server_lr > 0:
            raise ConfigError(f"algorithm.server_lr={self.server_lr} must be > 0 or null "
                              "(the clients' learning rate)")
        if not 0 <= self.server_momentum < 1:
            raise ConfigError(f"algorithm.server_momentum={self.server_momentum} must be "
                              "in [0, 1)")
        if self.server_weight_decay < 0:
            raise ConfigError(f"algorithm.server_weight_decay={self.server_weight_decay} "
                              "must be >= 0")


def attention_projections(groups) -> list[list[str]]:
    """Per layer, the names of the q, k, v projection weights (the 2-D tensors of the
    ``qk`` and ``v`` groups, in model order); their biases are not generated."""
    layers: dict[int, list[str]] = {}
    for g in groups:
        if g.kind in ("qk", "v"):
            layers.setdefault(g.layer, []).extend(g.params)
    return [layers[i] for i in sorted(layers)]


@dataclass
class FedTPState:
    """FedTP's server state (the ``hypernetwork`` variant; ``vanilla`` has none).

    Attributes
    ----------
    hypernet : HyperNetwork
        h(.; phi), trained on the server.
    momentum : list of torch.Tensor or None
        The SGD momentum buffer of every hypernetwork parameter (``None`` before the first
        step).
    """

    hypernet: HyperNetwork
    momentum: list[torch.Tensor] | None = None


class FedTP(Algorithm):
    """FedTP: the server's hypernetwork writes each client's attention projections.

    Round t, sampled clients S_t with p_k = n_k / sum_{j in S_t} n_j:

    1. client k receives the global model with W_k = h(e_k; phi) (its q, k, v weights of every
       layer) written in, and trains all parameters locally;
    2. the server averages every parameter with p_k (FedAvg); for the non-attention
       parameters this is the new global model;
    3. with delta_k = W_k - W_k^after, one SGD step (step size the clients' learning rate of
       the round, momentum 0.9, weight decay 1e-3) on phi with gradient
       sum_k p_k (dW_k / dphi)^T delta_k (:func:`hypernet_gradient`).

    Evaluation is personalized: client m is evaluated with the global model plus h(e_m; phi)
    on its local test split; ``local_acc_micro`` is the micro average over all clients.

    Choices the paper leaves open, made here:

    - Our q, k, v are separate ``nn.Linear`` with biases (FedTP's ViT has a fused bias-free
      QKV). One head per layer generates the concatenated q, k, v weights (the fused QKV); the
      q, k, v biases are not generated and are averaged like every other shared parameter.
    - The global model's q, k, v weights are the p-average of the clients' trained ones, as in
      the authors' code (``global_para`` averages every key); they enter only the
      non-personalized ``test_acc``, never a client's start point.
    - ``vanilla`` (Personalized-T): every client starts from the model's initial q, k, v
      weights; they are neither sent nor averaged, so the global model keeps the initial ones
      and its ``test_acc`` is not meaningful (report ``local_acc_*``).
    - The hypernetwork is initialized by PyTorch's defaults under the run's training seed.
    - The authors' script steps the hypernetwork with the clients' learning rate (``args.lr``,
      constant in their runs); under an lr schedule it is the round's rate (``round_lr``), so
      the hypernetwork and the clients decay together. Its momentum buffer persists across
      rounds, as their optimizer's does.
    - Any client may be sampled any round; the embedding table has one row per client and its
      weight decay applies to every row each step (a dense gradient, as with ``torch.optim``).
    """

    name = "fedtp"
    Params = FedTPParams

    def __init__(self, params, ctx) -> None:
        super().__init__(params, ctx)
        self.per_layer = attention_projections(ctx.groups)
        self.attn = tuple(n for layer in self.per_layer for n in layer
                          if len(ctx.shapes[n]) == 2)
        self.rest = tuple(n for n in ctx.names if n not in self.attn)
        self.hypernetwork = params.variant == "hypernetwork"

    # -- state --------------------------------------------------------------------------------
    def init_server_state(self, global_params) -> FedTPState | None:
        if not self.hypernetwork:
            return None
        like = global_params[self.attn[0]]
        specs = [{n: self.ctx.shapes[n] for n in layer if n in self.attn}
                 for layer in self.per_layer]
        seed = int(np.random.SeedSequence([self.ctx.seed, 7]).generate_state(1)[0])
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            hnet = HyperNetwork(self.ctx.num_clients, specs, self.params.embedding_dim,
                                self.params.hidden_dim, self.params.n_hidden)
        return FedTPState(hnet.to(device=like.device, dtype=like.dtype))

    def init_client_state(self, global_params):
        if self.hypernetwork:
            return {}
        n = self.ctx.num_clients
        return {a: global_params[a].unsqueeze(0).repeat(n, *[1] * global_params[a].dim())
                for a in self.attn}

    # -- one round ----------------------------------------------------------------------------
    def plan_round(self, rnd, server_state):
        names = self.ctx.names
        if self.hypernetwork:
            return RoundPlan(names, names, names, stage="hypernetwork")
        return RoundPlan(names, self.rest, self.rest, stage="vanilla")

    def _generate(self, client_ids, server_state: FedTPState) -> dict[str, torch.Tensor]:
        hnet = server_state.hypernet
        ids = torch.as_tensor(np.asarray(client_ids), device=hnet.embeddings.weight.device)
        with torch.no_grad():
            return hnet(ids.long())

    def client_start(self, client_ids, global_params, client_state, server_state):
        if self.hypernetwork:
            return self._generate(client_ids, server_state)
        idx = torch.as_tensor(np.asarray(client_ids)).long()
        return {a: client_state[a][idx.to(client_state[a].device)] for a in self.attn}

    def update_client_state(self, rnd, client_ids, global_params, results, client_state,
                            server_state):
        if self.hypernetwork:
            return
        idx = torch.as_tensor(np.asarray(client_ids)).long()
        for a in self.attn:
            client_state[a][idx.to(client_state[a].device)] = results.params[a]

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        update = super().server_update(rnd, plan, client_ids, global_params, results, weights,
                                       server_state)
        if self.hypernetwork:
            self._hypernet_step(client_ids, results, weights, server_state)
        return update

    def _hypernet_step(self, client_ids, results, weights, server_state: FedTPState) -> None:
        hnet = server_state.hypernet
        generated = self._generate(client_ids, server_state)
        deltas = {a: generated[a] - results.params[a].to(generated[a].dtype) for a in self.attn}
        ids = torch.as_tensor(np.asarray(client_ids), device=hnet.embeddings.weight.device)
        grads = hypernet_gradient(hnet, ids.long(), deltas, weights)
        p = self.params
        server_state.momentum = sgd_momentum_step(
            list(hnet.parameters()), grads, server_state.momentum, self.hypernet_lr(),
            p.server_momentum, p.server_weight_decay)

    def hypernet_lr(self) -> float:
        """eta_phi of this round: ``server_lr``, or the clients' learning rate of the round."""
        return self.round_lr if self.params.server_lr is None else self.params.server_lr

    def eval_params(self, client_id, global_params, client_state, server_state):
        if self.hypernetwork:
            own = {a: w[0] for a, w in self._generate([client_id], server_state).items()}
        else:
            own = {a: client_state[a][client_id] for a in self.attn}
        return {**global_params, **own}

    def tag(self) -> str:
        return "fedtp" if self.hypernetwork else "fedtp-vanilla"
