"""The fast vectorized path: stacked forward, one flat parameter buffer, CUDA graphs, chunks.

Same semantics as the ``vmap`` path of :mod:`real_data.engines.vectorized` (and hence as the
sequential reference), organised for a GPU:

1. The forward pass is :func:`~real_data.engines.stacked.stacked_forward`: clients folded into
   the batch, batched GEMMs, fused attention, frozen parameters shared (one GEMM for all).
2. The gradient of ``sum_c objective_c`` with respect to the stacked trainable parameters is
   every client's own gradient (clients share no trainable tensor), so one ``autograd.grad``
   replaces ``vmap(grad(...))``.
3. The trainable parameters of a chunk of clients live in one ``(Cc, P)`` buffer; the gradient
   norm, clipping, weight decay and the SGD / Adam update
   (:func:`~real_data.engines.optim.flat_step_`) are a handful of kernels over it. A captured
   SGD step on CUDA runs :class:`~real_data.engines.flat_update.FlatSGD` instead,
   which reads each parameter's gradient in place rather than concatenating them.
4. On CUDA one local step (minibatch gather, forward, backward, optimizer, loss accounting) is
   captured once as a CUDA graph and replayed ``S`` times per chunk, so a step costs one launch
   whatever the number of clients; the step index lives on the device.
5. Clients run in chunks of at most ``Cc`` (padded to equal size, one graph); ``Cc`` comes from
   a probe step of a few clients that measures memory per client, so any client count fits.

Graphs are cached by everything they capture (model, trainable set, data tensors, shapes,
optimizer, precision); :func:`clear_cache` releases them. A regularizer that returns a tensor
(FedProx) runs under ``vmap`` in the eager step, without a graph, since it may read server
state that changes between rounds; so does an algorithm's step correction (SCAFFOLD's c - c_m,
:func:`~real_data.engines.base.step_correction`), a ``(Cc, P)`` buffer subtracted after each
optimizer step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict
from dataclasses import replace

import torch
from torch.func import vmap

from real_data.engines import flat_update, optim
from real_data.engines.base import ClientResults, LocalJob, client_losses, step_correction
from real_data.engines.fast_setup import RunnerSetup as _Setup
from real_data.engines.fast_setup import make_setup as _setup
from real_data.engines.stacked import stacked_forward
from real_data.engines.stacked import supports as model_supported

MEMORY_FRACTION = 0.6  # of the free device memory a chunk may take (probe-based)
PROBE_CLIENTS = 8
MAX_FOLDED_BATCH = 65535  # C B rows in one attention launch (CUDA grid limit)
_CACHE: OrderedDict[tuple, _Runner] = OrderedDict()
_CACHE_SIZE = 4
_CHUNK: dict[tuple, int] = {}


def supports(job: LocalJob) -> bool:
    """True when the fast path computes the same function as the reference engines: a model
    the stacked forward mirrors, and an algorithm whose forward is the model's own."""
    return model_supported(job.model) and job.algorithm.has_model_forward()


def release_graphs() -> None:
    """Drop cached CUDA graphs and their buffers, keeping the chunk-size probes (a caller
    whose call shape changes and that will not come back to the old one)."""
    while _CACHE:
        _CACHE.popitem(last=False)[1].release()


def clear_cache() -> None:
    """Drop cached CUDA graphs, their buffers and the chunk-size probes."""
    while _CACHE:
        _CACHE.popitem(last=False)[1].release()
    _CHUNK.clear()


def _allow_recompiles(limit: int = 256) -> None:
    """Let dynamo keep a compiled version per runner: its recompile limit (8 by default)
    counts the versions of one function, and every runner compiles ``_Runner._loss``,
    ``_Runner._apply`` and ``_Runner._account`` for its own chunk size, trainable set and
    model; past the limit dynamo would silently run them eagerly."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # torch >= 2.6: recompile_limit
        if hasattr(cfg, name) and getattr(cfg, name) < limit:
            setattr(cfg, name, limit)


class _Runner:
    """Static buffers, the local step and (on CUDA) its graph for a chunk of ``cc`` clients."""

    def __init__(self, job: LocalJob, setup: _Setup, cc: int) -> None:
        dev, dt = job.x.device, setup.dtype
        self.job, self.setup, self.cc = job, setup, cc
        self.model, self.x, self.y = job.model, job.x, job.y
        self.numel = [int(torch.Size(s).numel()) for s in setup.shapes]
        # 1. trainable parameters: one (Cc, P) buffer; each parameter a leaf view into it
        self.flat = torch.zeros(cc, sum(self.numel), dtype=dt, device=dev)
        self.views = dict(zip(setup.trainable, self._split(self.flat)))
        self.leaves = {n: v.detach().requires_grad_(True) for n, v in self.views.items()}
        spec = setup.spec
        # optimizer state: (Cc, P) buffers under torch's names (optim.flat_step_)
        names = (("exp_avg", "exp_avg_sq") if spec.name == "adam"
                 else ("momentum_buffer",) if spec.momentum else ())
        self.opt_state = {k: torch.zeros_like(self.flat) for k in names}
        # each client's learning rate is data: a new lr (a schedule, stacked runs) reuses the
        # graph and the compiled code
        self.lr = torch.zeros(cc, 1, dtype=dt, device=dev)
        # stacked runs: 1 where a client trains a column, 0 where its run keeps it frozen
        self.mask = torch.ones_like(self.flat) if setup.masked else None
        # the algorithm's step correction d_m: y <- y - eta d_m after each optimizer step
        self.corr = torch.zeros_like(self.flat) if setup.correction else None
        # stacked runs' local terms: a gradient offset o_m (SCAFFOLD under SGD) and a proximal
        # pull mu_m (p - anchor_m) (FedProx), the objective's value sum <o_m, p> +
        # mu_m / 2 ||p - anchor_m||^2, anchor_m the client's start
        self.offset = torch.zeros_like(self.flat) if setup.offset else None
        self.prox = torch.zeros(cc, 1, dtype=dt, device=dev) if setup.prox else None
        self.anchor = torch.zeros_like(self.flat) if setup.prox else None
        offsets = torch.tensor([0] + self.numel, dtype=torch.int64).cumsum(0).tolist()
        self.columns = {n: (offsets[i], offsets[i + 1])
                        for i, n in enumerate(setup.trainable)}
        # 2. frozen parameters: shared (one copy) or the clients' own (stacked) values
        self.shared = {n: job.global_params[n].clone() for n in setup.shared}
        self.own = {n: job.overrides[n][:1].expand(cc, *job.overrides[n].shape[1:]).clone()
                    for n in setup.own}
        self.cstate = {k: v[:1].expand(cc, *v.shape[1:]).clone()
                       for k, v in job.client_state.items()}
        self.stacked = frozenset(setup.trainable) | frozenset(setup.own)
        # 3. the round's minibatch plan and the step counter live on the device
        self.idx = torch.zeros(cc, setup.steps, setup.batch, dtype=torch.int64, device=dev)
        self.active = torch.ones(cc, setup.steps, dtype=torch.bool, device=dev)
        self.s = torch.zeros((), dtype=torch.int64, device=dev)
        self.count = torch.zeros(cc, dtype=torch.int64, device=dev)
        self.acc = {k: torch.zeros(cc, dtype=torch.float64, device=dev)
                    for k in ("loss", "obj", "first", "gfirst", "glast")}
        mode = setup.compile if isinstance(setup.compile, str) else None
        if setup.compile:  # every runner compiles the same methods for its own shapes
            _allow_recompiles()
        self.loss_fn = (torch.compile(self._loss, dynamic=False, mode=mode) if setup.compile
                        else self._loss)
        # the step after the gradients (norm, clipping, optimizer, accounting): one or two
        # fused kernels over the (Cc, P) buffers when compiled, about twenty eagerly
        self.apply_fn = (torch.compile(self._apply, dynamic=False) if setup.compile
                         else self._apply)
        # captured SGD on CUDA: the update reads each gradient in place (two Triton kernels)
        self.sgd = (flat_update.FlatSGD(self.numel, self.flat,
                                        self.opt_state.get("momentum_buffer"), setup.spec,
                                        setup.ragged, self.lr.view(cc))
                    if setup.graphs and setup.triton_update and not setup.masked
                    and not setup.offset and not setup.prox
                    and flat_update.usable(self.flat, setup.spec) else None)
        self.account_fn = (torch.compile(self._account, dynamic=False) if setup.compile
                           else self._account)
        self._rows: list = []
        self.graph: torch.cuda.CUDAGraph | None = None
        self.eager = False

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        parts = flat.split(self.numel, dim=1)
        return [p.view(flat.shape[0], *s) for p, s in zip(parts, self.setup.shapes)]

    # -- per chunk ----------------------------------------------------------------------------
    def load(self, job: LocalJob, rows: torch.Tensor,
             correction: dict[str, torch.Tensor] | None = None) -> None:
        """Start values, optimizer state, batches and accumulators of the clients ``rows``
        (``correction``: the job's :func:`step_correction`, computed here if not given)."""
        if any(n in job.overrides for n in self.views):
            for n, view in self.views.items():
                view.copy_(job.start(n)[rows])
        else:  # every client starts at the global values: one concat, one broadcast copy
            g = torch.cat([job.global_params[n].reshape(-1) for n in self.views])
            self.flat.copy_(g.unsqueeze(0).expand_as(self.flat))
        for n, t in self.shared.items():
            t.copy_(job.global_params[n])
        for n, t in self.own.items():
            t.copy_(job.overrides[n][rows])
        for k, t in self.cstate.items():
            t.copy_(job.client_state[k][rows])
        for t in self.opt_state.values():
            t.zero_()
        if job.lr is None:
            self.lr.fill_(job.optimizer.lr)
        else:
            self.lr.copy_(job.lr[rows].unsqueeze(1))
        if self.mask is not None:
            for n in self.setup.masked:
                a, b = self.columns[n]
                self.mask[:, a:b].copy_(job.train_mask[n][rows].unsqueeze(1))
        if self.corr is not None:
            d = step_correction(job) if correction is None else correction
            for n, view in zip(self.setup.trainable, self._split(self.corr)):
                view.copy_(d[n][rows])
            if self.mask is not None:
                self.corr.mul_(self.mask)
        if self.offset is not None:
            self.offset.zero_()
            for n, view in zip(self.setup.trainable, self._split(self.offset)):
                if n in job.grad_offset:
                    view.copy_(job.grad_offset[n][rows])
            if self.mask is not None:
                self.offset.mul_(self.mask)
        if self.prox is not None:
            self.prox.copy_(job.prox_mu[rows].unsqueeze(1))
            self.anchor.copy_(self.flat)
        self.idx.copy_(job.batches.idx[rows])
        self.active.copy_(job.batches.active[rows])
        for t in (self.s, self.count, *self.acc.values()):
            t.zero_()

    def run(self, job: LocalJob, rows: torch.Tensor, steps: int,
            correction: dict[str, torch.Tensor] | None = None) -> None:
        """Load the clients ``rows`` and take ``steps`` local steps (graph replays on CUDA)."""
        self.job = job
        self.load(job, rows, correction)
        if self.setup.graphs and self.graph is None and not self.eager:
            try:
                self._capture()
            except RuntimeError as exc:  # an op that cannot be captured: step eagerly
                warnings.warn(f"CUDA graph capture failed, stepping eagerly: {exc}",
                              stacklevel=2)
                self.graph, self.eager = None, True
                self.sgd = None  # eagerly its address table would sync every step
                torch.cuda.synchronize()
            self.load(job, rows, correction)  # the warm-up steps changed the buffers
        for _ in range(steps):
            if self.graph is not None:
                self.graph.replay()
            else:
                self.step()

    def release(self) -> None:
        """Free this runner's CUDA graph now and break its reference cycle (``loss_fn`` is its
        bound method). Without this its graph would be freed by the cyclic garbage
        collector at any later moment, possibly while another graph is being captured, which
        invalidates that capture ("operation not permitted when stream is capturing")."""
        self.graph, self.job, self.loss_fn, self.apply_fn = None, None, None, None
        self.account_fn, self.sgd, self._rows = None, None, []

    def _capture(self) -> None:
        """Warm up on a side stream (allocator, cuBLAS, compilation), then capture one step."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.step()
                # every warm-up step reads step 0's minibatch: a round of fewer than 3 local
                # steps has no column 1 or 2 to index (load() resets the buffers afterwards)
                self.s.zero_()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    # -- one local step for every client of the chunk ------------------------------------------
    def _loss(self, leaves: dict, xb: torch.Tensor, yb: torch.Tensor) -> torch.Tensor:
        ac = self.setup.autocast
        ctx = (torch.autocast(xb.device.type, dtype=ac, cache_enabled=False) if ac
               else contextlib.nullcontext())
        with ctx:
            logits = stacked_forward(self.model, {**self.shared, **self.own, **leaves},
                                     self.stacked, xb, self.setup.attention,
                                     self.setup.fold_norms)
        return client_losses(logits, yb)

    def step(self) -> None:
        setup = self.setup
        # 1. this step's minibatches (C, B, ...) and activity, from the device-side counter
        idx = self.idx.index_select(1, self.s.reshape(1)).squeeze(1)  # (Cc, B)
        on = self.active.index_select(1, self.s.reshape(1)).squeeze(1)  # (Cc,)
        first = self.s == 0
        # 2. every client's objective; one backward gives every client's own gradient
        data = self.loss_fn(self.leaves, self.x[idx], self.y[idx])
        if setup.regularizer == "tensor":
            job = self.job
            anchor = {n: job.global_params[n] for n in setup.trainable}
            reg = vmap(lambda tr, cs: job.algorithm.regularizer(tr, anchor, cs, job.server_state))
            obj = data + reg(self.leaves, self.cstate)
        else:
            obj = data + setup.regularizer
        if self.offset is not None or self.prox is not None:
            obj = obj + self._terms_value()
        grads = torch.autograd.grad(data.sum() if self.offset is not None or
                                    self.prox is not None else obj.sum(),
                                    list(self.leaves.values()))
        if self.sgd is not None:
            norms, self._rows = self.sgd.step(list(grads), on)
            self.account_fn(norms.double(), data.detach(), obj.detach(), on, first)
        else:
            self.apply_fn(list(grads), data.detach(), obj.detach(), on, first)
        if self.corr is not None:
            self._correct(on)

    def _terms_value(self) -> torch.Tensor:
        """``(Cc,)`` the stacked local terms' value at the current parameters (no gradient:
        :meth:`_apply` adds their gradient to the data gradient)."""
        with torch.no_grad():
            val = torch.zeros(self.cc, dtype=self.flat.dtype, device=self.flat.device)
            if self.offset is not None:
                val = val + (self.offset * self.flat).sum(1)
            if self.prox is not None:
                val = val + 0.5 * self.prox[:, 0] * (self.flat - self.anchor).pow(2).sum(1)
        return val

    def _correct(self, on: torch.Tensor) -> None:
        """y <- y - eta d_m after the optimizer step (clients that finished early: nothing)."""
        if self.setup.ragged:
            self.flat.copy_(torch.where(on.unsqueeze(1), self.flat - self.lr * self.corr,
                                        self.flat))
        else:
            self.flat.sub_(self.lr * self.corr)

    def _apply(self, grads: list[torch.Tensor], data: torch.Tensor, obj: torch.Tensor,
               on: torch.Tensor, first: torch.Tensor) -> None:
        """Norm, clipping, weight decay and the update on the flat buffers; loss accounting."""
        spec, cc = self.setup.spec, self.cc
        g = torch.cat([t.reshape(cc, -1) for t in grads], dim=1)  # (Cc, P)
        if self.offset is not None:
            g.add_(self.offset)
        if self.prox is not None:
            g.add_(self.prox * (self.flat - self.anchor))
        if self.mask is not None:  # a run's frozen parameters: no gradient, no norm share
            g.mul_(self.mask)
        # 3. norm before clipping, clipping, weight decay, optimizer update (flat buffers)
        norms = torch.linalg.vector_norm(g, dim=1).double()
        if spec.clip_grad_norm is not None:
            coef = (spec.clip_grad_norm / (norms + 1e-6)).clamp(max=1.0)
            g.mul_(coef.to(g.dtype).unsqueeze(1))
        if spec.weight_decay:
            g.add_(self.flat, alpha=spec.weight_decay)
            if self.mask is not None:
                g.mul_(self.mask)
        self.count.add_(on.long())  # Adam's step count, before its update
        optim.flat_step_(spec, self.flat, g, self.opt_state, self.count, on.unsqueeze(1),
                         self.setup.ragged, self.lr)
        self._account(norms, data, obj, on, first)

    def _account(self, norms: torch.Tensor, data: torch.Tensor, obj: torch.Tensor,
                 on: torch.Tensor, first: torch.Tensor) -> None:
        """4. Loss accounting (clients that finished early add nothing)."""
        data, obj = data.double(), obj.double()
        acc = self.acc
        acc["loss"].add_(torch.where(on, data, 0.0))
        acc["obj"].add_(torch.where(on, obj, 0.0))
        acc["first"].copy_(torch.where(first, data, acc["first"]))
        acc["gfirst"].copy_(torch.where(first, norms, acc["gfirst"]))
        acc["glast"].copy_(torch.where(on, norms, acc["glast"]))
        self.s.add_(1)


def probe_step(job: LocalJob, setup: _Setup, k: int) -> None:
    """One eager local step of a ``k``-client chunk (the memory probe of :func:`_max_chunk`).

    ``k`` may exceed the job's clients: a stacked group pads its calls to its largest
    membership, so a call of its last 2 runs can be the first of a new setup (their trainable
    set without the others' masks) with a padded shape of 70 clients. The probe then repeats
    the job's last client, as :func:`train_fast` pads its last chunk."""
    rows = torch.arange(k, device=job.x.device).clamp(max=len(job.client_ids) - 1)
    probe = _Runner(job, replace(setup, graphs=False, compile=False), k)
    probe.run(job, rows, 1)
    probe.release()


def _max_chunk(job: LocalJob, setup: _Setup, clients: int) -> int:
    """Largest chunk that fits: memory per client from one eager step of a few clients."""
    cap = max(1, MAX_FOLDED_BATCH // setup.batch)
    if job.x.device.type != "cuda":
        return min(clients, cap)
    if setup in _CHUNK:
        return min(clients, _CHUNK[setup])
    k = min(clients, PROBE_CLIENTS)
    dev = job.x.device
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    probe_step(job, setup, k)
    torch.cuda.synchronize(dev)
    per_client = (torch.cuda.max_memory_allocated(dev) - before) / k
    free, _ = torch.cuda.mem_get_info(dev)
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
    _CHUNK[setup] = max(1, min(cap, int(MEMORY_FRACTION * free / per_client)))
    return min(clients, _CHUNK[setup])


def _runner(job: LocalJob, setup: _Setup, cc: int) -> _Runner:
    key = (setup, cc)
    if not setup.graphs:
        return _Runner(job, setup, cc)
    if key in _CACHE:
        _CACHE.move_to_end(key)
        runner = _CACHE[key]
        runner.job = job
        return runner
    while len(_CACHE) >= _CACHE_SIZE:
        _CACHE.popitem(last=False)[1].release()
    _CACHE[key] = runner = _Runner(job, setup, cc)
    return runner


def train_fast(job: LocalJob, graphs: bool = True, compile: bool | str = False,
               attention: str = "auto", fold_norms: bool = True,
               triton_update: bool = True) -> ClientResults:
    """Train the round's clients with the fast path (see the module docstring).

    Parameters
    ----------
    job : LocalJob
        A job for which :func:`supports` is true.
    graphs : bool
        Capture and replay one local step as a CUDA graph (CUDA only).
    compile : bool or str
        ``torch.compile`` the stacked forward and loss, and the update after the gradients
        (compiles once per chunk shape, which takes tens of seconds; see docs/bench/NOTES.md).
        A string is the forward's ``torch.compile`` mode, e.g.
        ``"max-autotune-no-cudagraphs"`` (the step is captured as a CUDA graph anyway).
    attention : {"auto", "sdpa", "triton"}
        Softmax attention kernel (:func:`~real_data.engines.stacked.stacked_forward`): the
        one-tile Triton kernel where it applies, or always SDPA.
    fold_norms : bool
        Fold each LayerNorm's per-client affine into the next linears' weights where they
        are all trained (the same function; see :meth:`stacked._Net.layer_norm`).
    triton_update : bool
        In a captured SGD step on CUDA, update through :class:`flat_update.FlatSGD` (the
        gradients read in place) instead of concatenating them first.
    """
    setup = _setup(job, graphs, compile, attention, fold_norms, triton_update)
    n_clients = len(job.client_ids)
    dev = job.x.device
    # a stacked group pads to its largest membership: one shape while runs finish or fork
    shape = max(n_clients, job.pad_clients or 0)
    cc = _max_chunk(job, setup, shape)
    n_chunks = -(-shape // cc)
    cc = -(-shape // n_chunks)  # equal chunks: one graph; the last one padded
    runner = _runner(job, setup, cc)
    correction = step_correction(job) if setup.correction else None
    # copied now, while the device is idle: a host-to-device copy after the queued steps would
    # hold the host until they finish
    steps = job.batches.steps.to(dev).double()
    flat = torch.empty(n_clients, runner.flat.shape[1], dtype=setup.dtype, device=dev)
    acc = {k: torch.empty(n_clients, dtype=torch.float64, device=dev) for k in runner.acc}
    for a in range(0, n_clients, cc):
        real = min(cc, n_clients - a)
        rows = torch.arange(a, a + cc, device=dev).clamp(max=n_clients - 1)
        runner.run(job, rows, setup.steps, correction)
        flat[a:a + real].copy_(runner.flat[:real])
        for k, t in runner.acc.items():
            acc[k][a:a + real].copy_(t[:real])
    # each parameter a (C, *shape) view into the one (C, P) result
    params = dict(zip(setup.trainable, runner._split(flat)))
    return ClientResults(
        params=params,
        data_loss=acc["loss"] / steps,
        objective=acc["obj"] / steps,
        first_loss=acc["first"],
        grad_norm_first=acc["gfirst"],
        grad_norm_last=acc["glast"],
        steps=job.batches.steps.clone(),
    )
