"""What an engine is given (:class:`LocalJob`) and returns (:class:`ClientResults`).

Randomness. Client ``m`` in round ``t`` draws its minibatches from
``numpy.random.default_rng([training_seed, t, m])``, so every engine (and a resumed run) sees
the same batches. Dropout draws from the torch RNG forked and seeded from the same triple
(sequential engine) or from ``(training_seed, t)`` (vectorized engine): with dropout on, the two
engines agree in distribution only.

Local work. ``local_steps=K``: every client takes K steps of ``batch_size`` samples.
``local_epochs=E``: client m takes ``ceil(E * n_m / B)`` steps, so a larger client does more
steps (as in FedAvg's paper); a client that finishes early is idle (masked) while the others
finish. In both modes the B indices of a step come from successive random permutations of the
client's samples, so a client with fewer than B samples repeats some within a batch and no
batch is ever short.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class OptimizerSpec:
    """Local optimizer, the same in every engine (PyTorch's SGD and Adam update rules).

    Attributes
    ----------
    name : {"sgd", "adam"}
    lr : float
        Step size eta.
    momentum : float
        SGD heavy-ball momentum (dampening 0, not Nesterov).
    weight_decay : float
        L2 coefficient added to the gradient (both optimizers, as in ``torch.optim``).
    betas, eps : Adam's constants.
    clip_grad_norm : float or None
        Per-client clipping of the total gradient norm, as ``clip_grad_norm_``.

    Optimizer state (momentum buffers, Adam moments) is per client and starts from zero in
    every round.
    """

    name: str = "sgd"
    lr: float = 0.05
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad_norm: float | None = None


@dataclass(frozen=True)
class Batches:
    """Minibatch plan for one round.

    Attributes
    ----------
    idx : torch.Tensor
        ``(C, S, B)`` int64 indices into ``x_train``; S is the most steps any client takes.
    active : torch.Tensor
        ``(C, S)`` bool, False for the idle steps of clients that finished early.
    steps : torch.Tensor
        ``(C,)`` int64 steps per client.
    """

    idx: torch.Tensor
    active: torch.Tensor
    steps: torch.Tensor


def client_rng(training_seed: int, rnd: int, client: int) -> np.random.Generator:
    """The batch-sampling generator of one client in one round."""
    return np.random.default_rng([training_seed, rnd, client])


def _draw_plan(train_idx: tuple[np.ndarray, ...], m: int, training_seed: int, rnd: int,
               batch_size: int, local_steps: int | None,
               local_epochs: float | None) -> np.ndarray:
    """Client ``m``'s ``(S_m, B)`` minibatch indices of round ``rnd``."""
    own = np.asarray(train_idx[m])
    n = len(own)
    s = local_steps if local_steps is not None else math.ceil(local_epochs * n / batch_size)
    s = max(int(s), 1)
    rng = client_rng(training_seed, rnd, int(m))
    need = s * batch_size
    order = np.concatenate([rng.permutation(n) for _ in range(math.ceil(need / n))])
    return own[order[:need]].reshape(s, batch_size)


def _stack(plans: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(C, S, B)`` indices (idle steps repeat the first batch), ``(C, S)`` activity, steps."""
    steps = np.array([len(p) for p in plans], dtype=np.int64)
    s_max = int(steps.max())
    if (steps == s_max).all():  # every client takes the same number of steps
        return (np.stack(plans).astype(np.int64, copy=False),
                np.ones((len(plans), s_max), dtype=bool), steps)
    idx = np.empty((len(plans), s_max, plans[0].shape[1]), dtype=np.int64)
    active = np.zeros((len(plans), s_max), dtype=bool)
    for c, (plan, s) in enumerate(zip(plans, steps)):
        idx[c, :s], idx[c, s:] = plan, plan[0]
        active[c, :s] = True
    return idx, active, steps


def _to_batches(stacked: tuple[np.ndarray, np.ndarray, np.ndarray],
                device: torch.device | str) -> Batches:
    idx, active, steps = stacked
    return Batches(torch.from_numpy(idx).to(device), torch.from_numpy(active).to(device),
                   torch.from_numpy(steps))


def make_batches(
    train_idx: tuple[np.ndarray, ...],
    client_ids: np.ndarray,
    training_seed: int,
    rnd: int,
    batch_size: int,
    local_steps: int | None,
    local_epochs: float | None,
    device: torch.device | str = "cpu",
) -> Batches:
    """Draw every sampled client's minibatch indices for round ``rnd`` (see module docstring)."""
    return _to_batches(_stack([_draw_plan(train_idx, int(m), training_seed, rnd, batch_size,
                                          local_steps, local_epochs) for m in client_ids]),
                       device)


class BatchPlanner:
    """:func:`make_batches` with a round drawn ahead on a CPU thread.

    Drawing a plan is per-client Python (one seeded generator and a few permutations per
    client), during which the GPU would sit idle.
    :meth:`prefetch` draws a later round's plans on a background thread while the GPU trains
    the current one (call it once the round's work is queued: the thread holds the GIL, which
    the launches need); :meth:`plan` returns exactly what :func:`make_batches` returns (the draws
    depend only on ``(training_seed, rnd, m)``), taking the clients drawn ahead and drawing
    any others now.
    """

    def __init__(self, train_idx: tuple[np.ndarray, ...], training_seed: int, batch_size: int,
                 local_steps: int | None, local_epochs: float | None,
                 device: torch.device | str = "cpu") -> None:
        self._args = (train_idx, training_seed, batch_size, local_steps, local_epochs)
        self.device = device
        self._pool: ThreadPoolExecutor | None = None
        self._ahead: tuple[int, np.ndarray, Future] | None = None

    def _draw(self, ids: np.ndarray, rnd: int) -> tuple[dict[int, np.ndarray], tuple]:
        train_idx, seed, b, steps, epochs = self._args
        plans = {int(m): _draw_plan(train_idx, int(m), seed, rnd, b, steps, epochs)
                 for m in ids}
        return plans, _stack([plans[int(m)] for m in ids])

    def prefetch(self, client_ids: np.ndarray, rnd: int) -> None:
        """Start drawing round ``rnd``'s plans of ``client_ids`` in the background."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="batch-plan")
        ids = np.array(client_ids)
        self._ahead = (rnd, ids, self._pool.submit(self._draw, ids, rnd))

    def plan(self, client_ids: np.ndarray, rnd: int) -> Batches:
        """The plan of ``client_ids`` in round ``rnd``, as :func:`make_batches`."""
        ready: dict[int, np.ndarray] = {}
        ahead, self._ahead = self._ahead, None  # used once
        if ahead is not None and ahead[0] == rnd:
            try:
                ready, stacked = ahead[2].result()
            except Exception:  # noqa: BLE001 - e.g. a client without samples: drawn below
                ready, stacked = {}, None
            if stacked is not None and np.array_equal(ahead[1], client_ids):
                return _to_batches(stacked, self.device)
        elif ahead is not None and ahead[0] > rnd:
            self._ahead = ahead  # a later round's, still to come
        train_idx, seed, b, steps, epochs = self._args
        plans = [ready[int(m)] if int(m) in ready else
                 _draw_plan(train_idx, int(m), seed, rnd, b, steps, epochs) for m in client_ids]
        return _to_batches(_stack(plans), self.device)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ahead = None, None


def chunk_names(tensors: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """The names of ``tensors`` in order, cut into runs whose tensors hold at most ``limit``
    numbers together (a tensor above ``limit`` is a run of its own): the chunks in which a
    reduction over many parameters concatenates them."""
    chunks: list[list[str]] = []
    size = 0
    for n, t in tensors.items():
        if chunks and size + t.numel() <= limit:
            chunks[-1].append(n)
            size += t.numel()
        else:
            chunks.append([n])
            size = t.numel()
    return chunks


def task_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over samples (images) or over all positions (text), in >= fp32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def client_losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``(C,)`` :func:`task_loss` of each client of stacked ``(C, ...)`` logits and labels."""
    c = logits.shape[0]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
    return ce.reshape(c, -1).mean(1)


@dataclass
class LocalJob:
    """One round of local training for the sampled clients.

    Attributes
    ----------
    model : nn.Module
        Weightless template: only its structure is used (through ``algorithm.forward``).
    algorithm : Algorithm
        Supplies ``forward`` and ``regularizer`` (the local objective).
    global_params : dict
        Global values of every parameter; the start point of each client.
    overrides : dict
        Per-client start values ``(C, ...)`` replacing global ones (personalization).
    trainable : tuple of str
        Names trained this round; everything else is frozen (held once unless overridden).
    client_state : dict
        The algorithm's per-client state, sliced to the round's clients ``(C, ...)``.
    server_state : dataclass or None
        The algorithm's server state.
    batches : Batches
    x, y : torch.Tensor
        Training split on the device.
    optimizer : OptimizerSpec
    dropout_seed : int
        Seeds the forked torch RNG (see the module docstring).
    client_ids : np.ndarray
    autocast : torch.dtype or None
        bf16 autocast on CUDA, ``None`` otherwise.
    lr : torch.Tensor or None
        ``(C,)`` per-client learning rates replacing ``optimizer.lr`` (stacked runs, each
        with its own lr or schedule); ``None``: ``optimizer.lr`` for every client.
    train_mask : dict
        Trainable name -> ``(C,)`` bool: whether each client trains it (stacked runs whose
        trainable sets differ); a name absent here is trained by every client. A masked-out
        client's gradient of that parameter is zero before its norm, clipping, weight decay
        and update, so the parameter keeps its start value and takes no part in the norm.
    pad_clients : int or None
        Pad the engine call to this many clients (a constant shape for a group whose
        membership changes); the padding rows are discarded.
    grad_offset : dict
        Stacked runs: trainable name -> ``(C, ...)`` constant added to each client's gradient
        (SCAFFOLD's c - c_m under SGD), in place of the algorithm's regularizer; a name absent
        here adds nothing.
    prox_mu : torch.Tensor or None
        Stacked runs: ``(C,)`` proximal weight mu_m of each client, whose anchor is its start
        value (FedProx), in place of the algorithm's regularizer.
    correction : dict or None
        Stacked runs: the step correction of every client (:func:`step_correction`), computed
        per run.
    stacked_terms : bool
        The job is several runs' jobs in one: ``grad_offset``, ``prox_mu`` and ``correction``
        replace the algorithm's regularizer and step correction, whatever the first run's
        algorithm is.
    """

    model: nn.Module
    algorithm: object
    global_params: dict[str, torch.Tensor]
    trainable: tuple[str, ...]
    batches: Batches
    x: torch.Tensor
    y: torch.Tensor
    optimizer: OptimizerSpec
    client_ids: np.ndarray
    dropout_seed: int = 0
    overrides: dict[str, torch.Tensor] = field(default_factory=dict)
    client_state: dict[str, torch.Tensor] = field(default_factory=dict)
    server_state: Any = None
    autocast: torch.dtype | None = None
    lr: torch.Tensor | None = None
    train_mask: dict[str, torch.Tensor] = field(default_factory=dict)
    pad_clients: int | None = None
    grad_offset: dict[str, torch.Tensor] = field(default_factory=dict)
    prox_mu: torch.Tensor | None = None
    correction: dict[str, torch.Tensor] | None = None
    stacked_terms: bool = False

    def start(self, name: str) -> torch.Tensor:
        """Stacked ``(C, ...)`` start values of one parameter."""
        if name in self.overrides:
            return self.overrides[name]
        g = self.global_params[name]
        return g.unsqueeze(0).expand(len(self.client_ids), *g.shape)


@dataclass
class ClientResults:
    """What local training returns; per-client tensors have a leading axis of C clients.

    Attributes
    ----------
    params : dict
        Final values of the trainable parameters, ``(C, ...)``.
    data_loss, objective : torch.Tensor
        ``(C,)`` mean over the client's steps of the data loss and of the full local objective
        (data loss + algorithm regularizer), both from the same forward pass.
    first_loss : torch.Tensor
        ``(C,)`` data loss of the first minibatch, at the received model.
    grad_norm_first, grad_norm_last : torch.Tensor
        ``(C,)`` objective-gradient norm (before clipping) at the first and last step.
    steps : torch.Tensor
        ``(C,)`` number of local steps.
    """

    params: dict[str, torch.Tensor]
    data_loss: torch.Tensor
    objective: torch.Tensor
    first_loss: torch.Tensor
    grad_norm_first: torch.Tensor
    grad_norm_last: torch.Tensor
    steps: torch.Tensor


def step_correction(job: LocalJob) -> dict[str, torch.Tensor] | None:
    """The algorithm's per-step correction of the round's clients, or ``None``.

    An algorithm may define ``step_correction(trainable, client_state, server_state)``
    returning, for every trainable parameter, a ``(C, ...)`` tensor d_m (constant over the
    round).
    Every engine then applies it after each optimizer step of client m, outside the
    optimizer's state: y <- y - eta_m d_m, with eta_m the learning rate of that step (an idle
    step of a client that finished early applies nothing). SCAFFOLD's drift correction
    c - c_m enters this way, as its public implementations apply it.
    """
    if job.stacked_terms:
        return job.correction
    fn = getattr(job.algorithm, "step_correction", None)
    if fn is None:
        return None
    return fn(job.trainable, job.client_state, job.server_state)


Engine = Callable[[LocalJob], ClientResults]
