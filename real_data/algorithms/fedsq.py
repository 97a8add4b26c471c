"""FedSQ (arXiv 2604.02990): a frozen structural copy S gates a trained quantitative copy Q."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from linattn.errors import ConfigError
from real_data.algorithms.base import Algorithm, RoundPlan
from real_data.models.groups import names_of_kind
from real_data.models.layers import MLP, Attention
from real_data.pretrain import checked_pretrained, transfer_init


@dataclass(frozen=True)
class FedSQParams:
    """Attributes
    ----------
    init : {"pretrained", "warmup"}
        ``pretrained``: S and the initial Q are a centrally pretrained model (the paper's
        transfer initialization; make one with ``linattn pretrain``). ``warmup``: the
        from-scratch variant, FedAvg for rounds 1..T0 and then S = the round-T0 global model.
    pretrained : str or None
        The file written by ``linattn pretrain`` (required with ``init=pretrained``).
    warmup_rounds : int or None
        T0 >= 1 of the from-scratch variant (required with ``init=warmup``).
    strict : bool
        Attention too is gated by S: Q uses S's attention probabilities (S's query/key
        outputs), so Q's query/key get no gradient and are neither trained nor sent.
    reset_head : bool
        Q starts with the run's own freshly initialized ``head`` group (final norm and
        classifier) instead of the source model's: the source labels are other classes.
    """

    init: Literal["pretrained", "warmup"] = "pretrained"
    pretrained: str | None = None
    warmup_rounds: int | None = None
    strict: bool = False
    reset_head: bool = True

    def __post_init__(self) -> None:
        if self.init == "pretrained":
            if self.pretrained is None:
                raise ConfigError("algorithm.pretrained is required with algorithm.init="
                                  "pretrained (make the file with `linattn pretrain`), or set "
                                  "algorithm.init=warmup and algorithm.warmup_rounds")
            if self.warmup_rounds is not None:
                raise ConfigError("algorithm.warmup_rounds belongs to algorithm.init=warmup; "
                                  "set it to null")
        else:
            if self.warmup_rounds is None or self.warmup_rounds < 1:
                raise ConfigError(f"algorithm.warmup_rounds={self.warmup_rounds} must be >= 1 "
                                  "with algorithm.init=warmup")
            if self.pretrained is not None:
                raise ConfigError("algorithm.pretrained belongs to algorithm.init=pretrained; "
                                  "set it to null")


def dual_forward(model: nn.Module, structure: dict[str, torch.Tensor],
                 params: dict[str, torch.Tensor], x: torch.Tensor, strict: bool = False):
    """Q's output under S's gates (the DualCopy forward).

    1. S runs as a plain network (dropout off) and every MLP records its pre-activation
       z_S = fc1_S(norm2_S(h_S)); with ``strict`` every attention also records S's query and
       key outputs.
    2. Q runs with its own weights, but each MLP computes fc2_Q(1[z_S > 0] * z_Q) in place of
       fc2_Q(act(z_Q)); with ``strict`` its attention scores are built from S's query and key,
       i.e. Q mixes its own values with S's attention probabilities.

    The model's MLP and Attention modules are found by type; the hooks exist only during the
    call. With S = Q and a ReLU MLP, 1[z > 0] * z = relu(z): the plain forward.
    """
    mlps = [m for m in model.modules() if isinstance(m, MLP)]
    attns = [m for m in model.modules() if isinstance(m, Attention)] if strict else []
    projections = [p for a in attns for p in (a.q, a.k)]
    seen: dict[int, torch.Tensor] = {}

    def record_pre(mod, inputs, output):
        seen[id(mod)] = inputs[0]

    def record_out(mod, inputs, output):
        seen[id(mod)] = output

    def gate(mod, inputs, output):
        return inputs[0] * (seen[id(mod)] > 0).to(inputs[0].dtype)

    def replace(mod, inputs, output):
        return seen[id(mod)]

    training = model.training
    with _hooks([m.act for m in mlps], record_pre), _hooks(projections, record_out):
        model.train(False)
        try:
            functional_call(model, structure, (x,))
        finally:
            model.train(training)
    with _hooks([m.act for m in mlps], gate), _hooks(projections, replace):
        return functional_call(model, params, (x,))


@contextlib.contextmanager
def _hooks(modules: list[nn.Module], hook):
    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@dataclass
class FedSQState:
    """FedSQ's server state.

    Attributes
    ----------
    structure : dict or None
        S, the frozen structural copy (``None`` until the warm-up of the scratch variant
        ends).
    holds : np.ndarray
        ``(num_clients,)`` bool: the client has taken part in a DualCopy round (it holds S).
    first_dual_done : bool
        A DualCopy round has run (from then on a newly sampled client also receives S).
    """

    structure: dict[str, torch.Tensor] | None
    holds: np.ndarray
    first_dual_done: bool = False


class FedSQ(Algorithm):
    """FedSQ on a Transformer: S frozen and never sent after initialization, Q trained.

    Every round (after the warm-up of the from-scratch variant) the clients train Q under the
    DualCopy forward (:func:`dual_forward`) and the server averages Q with FedAvg weights.
    Choices the paper leaves open (it uses CNNs, whose ReLUs are the only nonlinearity):

    - GELU: the gate is the hard 1[z_S > 0] taken from S's fc1 pre-activation, and Q applies
      it linearly (fc2_Q(m * z_Q)), so given S's gates Q's MLP is linear whatever S's
      activation is. A soft GELU gate Phi(z_S) was not used: it is not binary. With a GELU
      model, Q with S = Q is therefore the ReLU version of the plain model (identical for a
      ReLU model); the native config uses a ReLU ViT so that Q starts exactly at S.
    - LayerNorm and softmax are not ReLU-like: Q computes them itself. Attention is computed in
      Q by default; ``strict`` takes S's attention probabilities instead.
    - S runs without dropout (gates are a property of S alone).
    - Transfer: ``linattn pretrain`` trains the same architecture centrally on a source data
      set (another data set, or the training samples a disjoint target run leaves out); Q
      starts from it with a fresh ``head`` group unless ``reset_head=false``.
    - Bytes: S never changes. A client derives S from the Q it receives in the first DualCopy
      round (Q = S then, head aside); a client first sampled later downloads S once (counted).
    - The paper's metrics, best validation accuracy and rounds to best, are ``best.test_acc``
      (value and round) in ``summary.json``; the test split stands in for validation.

    S lives in the server state (:class:`FedSQState`, checkpointed: the scratch variant makes it
    mid-run) and :meth:`plan_round` hands it to :meth:`forward`, so evaluating a loaded state
    needs one ``plan_round`` call first.
    """

    name = "fedsq"
    Params = FedSQParams

    def __init__(self, params, ctx) -> None:
        super().__init__(params, ctx)
        t0 = params.warmup_rounds
        if t0 is not None and t0 >= ctx.total_rounds:
            raise ConfigError(f"algorithm.warmup_rounds={t0} must be < train.rounds="
                              f"{ctx.total_rounds}")
        self.qk = names_of_kind(ctx.groups, "qk")
        self.head = names_of_kind(ctx.groups, "head")
        self.first_dual = 1 if t0 is None else t0 + 1
        self._structure: dict[str, torch.Tensor] | None = None
        self._pretrained: dict[str, torch.Tensor] | None = None
        if params.init == "pretrained":
            self._pretrained = self._load(params.pretrained)

    def _load(self, path: str) -> dict[str, torch.Tensor]:
        return checked_pretrained(path, self.ctx, "algorithm.pretrained", self.params.reset_head)

    # -- state --------------------------------------------------------------------------------
    def init_global_params(self, global_params):
        if self._pretrained is None:
            return global_params
        return transfer_init(global_params, self._pretrained, self.ctx, self.params.reset_head)

    def init_server_state(self, global_params):
        structure = None
        if self._pretrained is not None:
            like = next(iter(global_params.values()))
            structure = {n: p.to(like.device, like.dtype) for n, p in self._pretrained.items()}
        self._structure = structure
        return FedSQState(structure, np.zeros(self.ctx.num_clients, dtype=bool))

    def aux_params(self):
        """S, the frozen structural copy (empty before the warm-up of the scratch variant)."""
        return self._structure or {}

    # -- one round ----------------------------------------------------------------------------
    def plan_round(self, rnd, server_state):
        # forward sees no server state: S is cached here (also after a resume from a checkpoint)
        self._structure = server_state.structure
        names = self.ctx.names
        if self._structure is None:
            return RoundPlan(names, names, names, stage="warmup")
        if self.params.strict:
            rest = tuple(n for n in names if n not in self.qk)
            return RoundPlan(rest, rest, rest, stage="dual")
        return RoundPlan(names, names, names, stage="dual")

    def forward(self, model, params, x):
        if self._structure is None:
            return super().forward(model, params, x)
        return dual_forward(model, self._structure, params, x, self.params.strict)

    def download_numel(self, plan, client_ids, server_state):
        base = super().download_numel(plan, client_ids, server_state)
        if plan.stage != "dual":
            return base
        holds = server_state.holds[client_ids]
        if server_state.first_dual_done:
            size = sum(int(np.prod(s)) for s in self.ctx.shapes.values())
            base += int((~holds).sum()) * size
        return base

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        update = super().server_update(rnd, plan, client_ids, global_params, results, weights,
                                       server_state)
        if plan.stage == "dual":
            server_state.holds[client_ids] = True
            server_state.first_dual_done = True
        elif rnd == self.params.warmup_rounds:  # from-scratch variant: S = round-T0 model
            server_state.structure = {n: p.detach().clone() for n, p in update.params.items()}
        return update

    def tag(self) -> str:
        p = self.params
        base = "fedsq-pre" if p.init == "pretrained" else f"fedsq-scratch-T0{p.warmup_rounds}"
        return base + ("-strict" if p.strict else "")
