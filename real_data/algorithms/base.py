"""The one interface every federated algorithm implements, and the helpers they share.

The round loop (:mod:`real_data.federation`) is written once. Per round it asks the algorithm:

1. :meth:`Algorithm.plan_round` -- which parameters train this round (a mask by name, built
   from the model's declared groups), which are sent down and up;
2. :meth:`Algorithm.client_start` -- per-client start values, if any (personalization);
3. :meth:`Algorithm.regularizer` (+ :meth:`Algorithm.forward`) -- the local objective
   ``data loss + regularizer``, used by the optimizer and by the logged loss alike;
4. :meth:`Algorithm.update_client_state` -- per-client persistent state after local training;
5. :meth:`Algorithm.server_update` -- the new global parameters and the round's extra
   metrics (a :class:`ServerUpdate`), updating the server state in place;
6. :meth:`Algorithm.eval_params` -- a client's personalized model for local evaluation.

State. ``client_state`` is a dict of tensors with a leading axis over *all* clients (the loop
slices the round's clients). ``server_state`` is what :meth:`Algorithm.init_server_state`
returns: ``None`` for an algorithm without one, else a dataclass of the algorithm's own
(tensors, numbers, arrays or modules such as a hypernetwork), checkpointed with ``torch.save``.
``aux_params`` are held once and passed to ``forward`` (a second, frozen model copy). At the
end of a run :meth:`Algorithm.run_summary` gives the algorithm's entries of ``summary.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

from real_data.engines.base import ClientResults, OptimizerSpec, chunk_names
from real_data.models.groups import ParamGroup


@dataclass(frozen=True)
class RoundPlan:
    """What happens in one round.

    Attributes
    ----------
    trainable : tuple of str
        Parameters the clients train (the per-round mask); the rest stay at their sent values.
    upload : tuple of str
        Parameters each client sends back.
    download : tuple of str
        Parameters the server sends each client.
    extra_upload, extra_download : int
        Additional numbers sent per client (for example SCAFFOLD's control variates).
    stage : str
        A label for logs (``"warmup"``, ``"frozen"``, ...).
    """

    trainable: tuple[str, ...]
    upload: tuple[str, ...]
    download: tuple[str, ...]
    extra_upload: int = 0
    extra_download: int = 0
    stage: str = "full"


@dataclass(frozen=True)
class ServerUpdate:
    """What :meth:`Algorithm.server_update` returns.

    Attributes
    ----------
    params : dict
        The new global parameters.
    metrics : dict
        Extra global metrics of the round (FedFrozen's probe constants, FedPart's layer
        group), logged with the round's other global metrics.
    """

    params: dict[str, torch.Tensor]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class AlgorithmContext:
    """What an algorithm may know about the run.

    Attributes
    ----------
    groups : tuple of ParamGroup
        The model's declared parameter groups, in forward order.
    shapes : dict
        Parameter name -> shape, in model order.
    num_clients, total_rounds, clients_per_round : int
    local_steps : int or None
        K (``None`` when training by epochs).
    optimizer : OptimizerSpec
    seed : int
        Seed for randomness the algorithm owns (a hypernetwork's initial weights); the run
        passes its training seed.
    model : dict or None
        The completed model configuration (architecture fields such as ``attention`` and
        ``activation``), so an algorithm loading external weights can check they fit.
    """

    groups: tuple[ParamGroup, ...]
    shapes: dict[str, tuple[int, ...]]
    num_clients: int
    total_rounds: int
    clients_per_round: int
    local_steps: int | None
    optimizer: OptimizerSpec
    seed: int = 0
    model: dict | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.shapes)


class Algorithm:
    """Base class: FedAvg semantics everywhere; subclasses override a few methods.

    Subclasses set ``name`` (the registry key) and ``Params`` (a frozen dataclass of the
    algorithm's own settings, documented with the paper's symbols).
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type]

    def __init__(self, params, ctx: AlgorithmContext) -> None:
        self.params = params
        self.ctx = ctx
        # the clients' learning rate of the round being trained (the round loop sets it from
        # train.lr_schedule before each round); estimates that divide by K eta read this one
        self.round_lr = ctx.optimizer.lr

    # -- state ------------------------------------------------------------------------------
    def init_global_params(
        self, global_params: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """The global model before round 1; default the model's own initialization.

        Called before :meth:`init_server_state` and :meth:`init_client_state`, so an
        algorithm that starts from pretrained weights (FedSQ) replaces them here.
        """
        return global_params

    def init_server_state(self, global_params: dict[str, torch.Tensor]) -> Any:
        """Server state before round 1: a dataclass of the algorithm's own; default ``None``.

        The round loop hands it back to every method below as ``server_state``; the methods
        update it in place.
        """
        return None

    def init_client_state(self, global_params: dict[str, torch.Tensor]) -> dict:
        """Per-client state before round 1, each tensor ``(num_clients, ...)``; default none."""
        return {}

    def aux_params(self) -> dict[str, torch.Tensor]:
        """Tensors held once and passed to :meth:`forward` (a frozen second copy); default none."""
        return {}

    # -- one round --------------------------------------------------------------------------
    def plan_round(self, rnd: int, server_state: Any) -> RoundPlan:
        """Round ``rnd`` (1-based): everything trains and is exchanged."""
        names = self.ctx.names
        return RoundPlan(names, names, names)

    def client_start(
        self,
        client_ids: np.ndarray,
        global_params: dict[str, torch.Tensor],
        client_state: dict,
        server_state: Any,
    ) -> dict[str, torch.Tensor]:
        """Per-client start values ``(C, ...)`` that replace global ones; default none."""
        return {}

    def forward(self, model: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor):
        """Model output for a batch with the given parameters (functional call)."""
        return functional_call(model, params, (x,))

    @classmethod
    def has_model_forward(cls) -> bool:
        """True when :meth:`forward` is this base class's, the model's own function: an engine
        may then compute it with an equivalent forward of its own (the fast engine's stacked
        forward). A subclass that overrides :meth:`forward` gets ``False``."""
        return cls.forward is Algorithm.forward

    def regularizer(
        self,
        params: dict[str, torch.Tensor],
        anchor: dict[str, torch.Tensor],
        client_state: dict,
        server_state: Any,
    ) -> torch.Tensor | float:
        """Term added to the data loss in the local objective (``params``: trainable only).

        ``anchor`` holds the received global values of the trainable parameters; the engines
        call this per client (under ``vmap`` in the vectorized engine), so it must use tensor
        operations only.
        """
        return 0.0

    def step_correction(self, trainable: tuple[str, ...], client_state: dict,
                        server_state: Any) -> dict[str, torch.Tensor] | None:
        """A per-client correction ``(C, ...)`` per trainable parameter that every engine
        subtracts, times the step's learning rate, after each optimizer step, outside the
        optimizer's state (:func:`real_data.engines.base.step_correction`); ``None``: none.
        SCAFFOLD under Adam uses it for its drift correction c - c_m."""
        return None

    def update_client_state(
        self,
        rnd: int,
        client_ids: np.ndarray,
        global_params: dict[str, torch.Tensor],
        results: ClientResults,
        client_state: dict,
        server_state: Any,
    ) -> None:
        """Update ``client_state`` in place for the round's clients; default nothing.

        Called before :meth:`server_update`; server state that follows from the clients' new
        state (SCAFFOLD's server control variate) is updated here as well.
        """

    def server_update(
        self,
        rnd: int,
        plan: RoundPlan,
        client_ids: np.ndarray,
        global_params: dict[str, torch.Tensor],
        results: ClientResults,
        weights: torch.Tensor,
        server_state: Any,
    ) -> ServerUpdate:
        """New global parameters: the p-weighted average of the uploaded parameters; no
        extra metrics."""
        new = dict(global_params)
        new.update(weighted_averages({n: results.params[n] for n in plan.upload}, weights))
        return ServerUpdate(new)

    @property
    def needs_validation(self) -> bool:
        """True when :meth:`observe_round` reads the validation split (the federation then
        requires one); default False."""
        return False

    @property
    def forks_run(self) -> bool:
        """True when the run forks probe continuations and may roll back
        (:mod:`real_data.probe_runs`): it trains in one process (alone or in a stacked group,
        whose forking runs probe together); default False."""
        return self.forks_with(self.params)

    @classmethod
    def forks_with(cls, params) -> bool:
        """:attr:`forks_run` from the settings alone (a stacked group decides from the config
        before it builds anything); default False."""
        return False

    @property
    def attention_probe_batch(self) -> int | None:
        """Pooled validation inputs on which :meth:`observe_round` reads attention rows
        (``attention_scores()``), or None when it reads none; default None."""
        return None

    def observe_round(self, rnd: int, metrics: dict, state, attention_scores) -> dict:
        """After round ``rnd``'s evaluation: ``metrics`` holds the round's global metrics so
        far (``val_acc`` where the round evaluated a validation split), ``state`` the new
        :class:`~real_data.federation.FedState`, ``attention_scores()`` the global model's
        attention rows on the server's probe batch. Returns metrics to add to the round's
        rows; the server state may change in place (FedFrozen's online freeze rules).
        Default: nothing."""
        return {}

    def eval_params(
        self,
        client_id: int,
        global_params: dict[str, torch.Tensor],
        client_state: dict,
        server_state: Any,
    ) -> dict[str, torch.Tensor] | None:
        """A client's personalized parameters for its local test split; ``None``: global."""
        return None

    def download_numel(self, plan: RoundPlan, client_ids: np.ndarray, server_state: Any) -> int:
        """Numbers sent down this round, summed over the round's clients."""
        per = sum(_numel(self.ctx.shapes[n]) for n in plan.download) + plan.extra_download
        return per * len(client_ids)

    def upload_numel(self, plan: RoundPlan, client_ids: np.ndarray, server_state: Any) -> int:
        """Numbers sent up this round, summed over the round's clients."""
        per = sum(_numel(self.ctx.shapes[n]) for n in plan.upload) + plan.extra_upload
        return per * len(client_ids)

    def run_summary(self, server_state: Any) -> dict:
        """Entries the algorithm adds to the run's ``summary.json`` (FedFrozen's measured
        warm-up constants and recommended T0); default none."""
        return {}

    def tag(self) -> str:
        """Short label with the algorithm's key settings, used in run-directory names."""
        return self.name


def weighted_average(stacked: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_m p_m x_m over the leading client axis (``weights`` sum to one)."""
    w = weights.to(stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
    return (w * stacked).sum(dim=0)


def weighted_averages(stacked: dict[str, torch.Tensor], weights: torch.Tensor,
                      chunk_numbers: int = 1 << 24) -> dict[str, torch.Tensor]:
    """:func:`weighted_average` of every tensor of ``stacked`` (each ``(C, *shape)``): the
    tensors of one dtype and device are concatenated into ``(C, P)`` buffers of at most
    ``chunk_numbers`` numbers and averaged in one pass each, so a model's many small parameters
    cost a few kernels, not a few per parameter. Each result is a view of its chunk's average."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[tuple, list[str]] = {}
    for n, t in stacked.items():
        groups.setdefault((t.dtype, t.device), []).append(n)
    for names in groups.values():
        for take in chunk_names({n: stacked[n] for n in names}, chunk_numbers):
            if len(take) == 1:
                out[take[0]] = weighted_average(stacked[take[0]], weights)
                continue
            flat = weighted_average(torch.cat([stacked[n].flatten(1) for n in take], dim=1),
                                    weights)
            sizes = [stacked[n][0].numel() for n in take]
            for n, part in zip(take, torch.split(flat, sizes)):
                out[n] = part.view(stacked[n].shape[1:])
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64))
