"""The round loop, written once for every algorithm and engine.

A :class:`Federation` binds a resolved config to data, a partition, a model template, an
algorithm and an engine; :meth:`Federation.run_round` advances a :class:`FedState` by one round
and returns the round's metric records. Nothing here writes files (see :mod:`real_data.runs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from linattn_theory.schedules import PlateauState
from real_data.algorithms import AlgorithmContext, get_algorithm
from real_data.config import Config
from real_data.device import resolve_device
from real_data.engines import BatchPlanner, ClientResults, LocalJob, OptimizerSpec, get_engine
from real_data.metrics import (
    evaluate,
    local_summary,
    relative_change,
    step_flops,
    update_dispersion,
)
from real_data.models import build_model, complete_model_config, names_of_kind

BYTES_PER_NUMBER = 4  # communication is counted in float32, whatever the compute precision

Record = tuple[int, str, str, float]  # (round, "global" or client id, metric, value)


class Diverged(RuntimeError):
    """A non-finite loss or parameter; the round's results are discarded."""


@dataclass
class FedState:
    """Everything that changes from round to round (checkpointed whole).

    Attributes
    ----------
    round : int
        Rounds completed (0 before training).
    global_params : dict
    client_state : dict
        The algorithm's per-client state (see :mod:`real_data.algorithms.base`).
    server_state : dataclass or None
        The algorithm's server state (see :mod:`real_data.algorithms.base`).
    prev_grad_norm_last : float or None
        Mean last-step gradient norm of the previous round (for ``grad_norm_jump``).
    """

    round: int
    global_params: dict[str, torch.Tensor]
    client_state: dict = field(default_factory=dict)
    server_state: Any = None
    prev_grad_norm_last: float | None = None
    plateau: PlateauState | None = None  # train.lr_schedule kind plateau: its running state


class TrainedRound(NamedTuple):
    """What a trainer hook (:class:`Federation`'s ``trainer``) returns for one round.

    Attributes
    ----------
    results : ClientResults
        The round's client results, as :meth:`Federation.train_clients` returns them (or
        their p-weighted reduction to one pseudo-client, with ``weights`` to match).
    weights : torch.Tensor
        The aggregation weights ``server_update`` receives with ``results``.
    update_dispersion, update_norm : float or None
        The round's update dispersion and norm over all clients, when the trainer computed
        them itself (:func:`real_data.metrics.update_dispersion`); ``None``: computed from
        ``results``.
    """

    results: ClientResults
    weights: torch.Tensor
    update_dispersion: float | None = None
    update_norm: float | None = None


@dataclass
class RoundWork:
    """A round planned by :meth:`Federation.begin_round`, to be trained and then finished by
    :meth:`Federation.finish_round` (a stacked group trains many runs' works together)."""

    ids: np.ndarray
    plan: Any
    weights: torch.Tensor
    bytes_up: int
    bytes_down: int
    lr: float
    job: LocalJob | None = None


class RoundDraws(NamedTuple):
    """A round's random draws given from outside (:meth:`Federation.begin_round`): the sorted
    client ids, their minibatch plan (``engines.Batches``) and the dropout seed."""

    ids: np.ndarray
    batches: Any
    dropout_seed: int


def sample_clients(seed: int, rnd: int, num_clients: int, per_round: int | None) -> np.ndarray:
    """Sorted ids of the clients of round ``rnd``, from ``default_rng([seed, rnd])``."""
    if per_round is None or per_round >= num_clients:
        return np.arange(num_clients)
    rng = np.random.default_rng([seed, rnd])
    return np.sort(rng.choice(num_clients, size=per_round, replace=False))


class Federation:
    """One federated training setup (see module docstring)."""

    def __init__(self, cfg: Config, dataset, partition, device: torch.device | None = None,
                 trainer=None):
        t = cfg.train
        self.cfg = cfg
        # scale-out hook: trains the round elsewhere (real_data.distributed, real_data.flower);
        # trainer(fed, state, rnd, plan, ids, weights) -> TrainedRound
        self.trainer = trainer
        self.device = device or resolve_device(t.device)
        self.dtype = torch.float64 if t.precision == "fp64" else torch.float32
        use_bf16 = t.precision == "bf16" and self.device.type == "cuda"
        self.autocast = torch.bfloat16 if use_bf16 else None
        self.x_train, self.y_train, self.x_test, self.y_test = _device_data(
            dataset, self.device, self.dtype)
        self.partition = partition
        # the partition as written to the run directory (``runs.shifted`` replaces it by the
        # unshifted one it built this federation's partition from); a T0 branch starts from it
        self.source_partition = partition
        self.sizes = torch.as_tensor(partition.sizes, dtype=torch.float64)
        # the pooled validation split (every client's held-out training samples), if any
        self.x_val, self.y_val = _validation_data(partition, self.x_train, self.y_train)
        if not cfg.eval.test and self.x_val is None:
            from linattn.errors import ConfigError

            raise ConfigError("eval.test=false leaves nothing to evaluate: set "
                              "partition.validation_fraction (for example 0.1) or eval.test=true")
        mcfg = complete_model_config(cfg.model.name, cfg.model.params, dataset.input_shape,
                                     dataset.num_classes)
        self.model = build_model(cfg.model.name, mcfg, cfg.role_seed("training"), self.dtype)
        self.model.to(self.device).eval()  # dropout switched on per engine through train()
        self.groups = self.model.param_groups()
        self.qk_names = names_of_kind(self.groups, "qk")
        self.optimizer = OptimizerSpec(name=t.optimizer, lr=t.lr, momentum=t.momentum,
                                       weight_decay=t.weight_decay,
                                       clip_grad_norm=t.clip_grad_norm)
        shapes = {n: tuple(p.shape) for n, p in self.model.named_parameters()}
        ctx = AlgorithmContext(self.groups, shapes, partition.num_clients, t.rounds,
                               t.clients_per_round or partition.num_clients, t.local_steps,
                               self.optimizer, seed=cfg.role_seed("training"),
                               model=dataclasses.asdict(mcfg))
        self.algorithm = get_algorithm(cfg.algorithm.name)(cfg.algorithm.params, ctx)
        self._check_rule_inputs()
        if t.init_from is not None and getattr(cfg.algorithm.params, "init", None) == \
                "pretrained":
            from linattn.errors import ConfigError

            raise ConfigError("train.init_from and algorithm.pretrained both initialize the "
                              "model; FedSQ takes its pretrained model from "
                              "algorithm.pretrained, so leave train.init_from null")
        self.engine = get_engine(t.engine)
        self.planner = BatchPlanner(partition.train, cfg.role_seed("training"), t.batch_size,
                                    t.local_steps, t.local_epochs, self.device)
        schedule = t.schedule
        self._multipliers = (None if schedule.kind == "constant" and not schedule.warmup_rounds
                             else schedule.multipliers(t.lr, t.rounds))
        self._flops: dict[tuple[str, ...], int] = {}

    # -- state --------------------------------------------------------------------------------
    def initial_state(self, fresh: bool = True) -> FedState:
        """Round 0's state. ``fresh=False`` (a resume, whose checkpoint replaces the parameters)
        skips reading ``train.init_from``, so a resumed run does not need that file."""
        params = {n: p.detach().clone() for n, p in self.model.named_parameters()}
        t = self.cfg.train
        if t.init_from is not None and fresh:  # transfer initialization, whatever the algorithm
            from real_data.pretrain import checked_pretrained, transfer_init

            loaded = checked_pretrained(t.init_from, self.algorithm.ctx, "train.init_from",
                                        t.init_reset_head)
            params = transfer_init(params, loaded, self.algorithm.ctx, t.init_reset_head)
        params = self.algorithm.init_global_params(params)
        return FedState(0, params, self.algorithm.init_client_state(params),
                        self.algorithm.init_server_state(params))

    # -- one round ----------------------------------------------------------------------------
    def round_lr(self, state: FedState, rnd: int) -> float:
        """The clients' learning rate in round ``rnd``: ``train.lr`` times the schedule's
        multiplier (``plateau``: the running state's)."""
        t = self.cfg.train
        if self._multipliers is None:
            return t.lr
        scale = float(self._multipliers[rnd - 1])
        if state.plateau is not None:
            scale *= state.plateau.multiplier
        return t.lr * scale

    def run_round(self, state: FedState, rnd: int) -> tuple[FedState, list[Record]]:
        """Advance ``state`` (at round ``rnd - 1``) by round ``rnd``; raise Diverged on NaN."""
        work = self.begin_round(state, rnd, job=self.trainer is None)
        # 2. local training on every sampled client (or on other processes: self.trainer)
        if self.trainer is None:
            results = self.train_job(work.job)
            self.prefetch(rnd + 1)  # once this round is queued: its launches need the GIL
            self.model.eval()
            trained = TrainedRound(results, work.weights)
        else:
            trained = self.trainer(self, state, rnd, work.plan, work.ids, work.weights)
        return self.finish_round(state, rnd, work, trained)

    def begin_round(self, state: FedState, rnd: int, job: bool = True,
                    draws: RoundDraws | None = None) -> RoundWork:
        """1. Who takes part in round ``rnd``, what trains, with which weights, learning rate
        and minibatches (``job``: also build the engine's :class:`LocalJob`).

        ``draws``: the clients, minibatches and dropout seed to use instead of round ``rnd``'s
        own (a probe continuation of ``algorithm.warmup=auto`` gives every probe the same
        ones); the plan and learning rate stay round ``rnd``'s."""
        cfg, algo = self.cfg, self.algorithm
        ids = sample_clients(cfg.role_seed("sampling"), rnd, self.partition.num_clients,
                             cfg.train.clients_per_round) if draws is None else draws.ids
        plan = algo.plan_round(rnd, state.server_state)
        w = self.sizes[ids]
        lr = self.round_lr(state, rnd)
        algo.round_lr = lr
        work = RoundWork(ids, plan, (w / w.sum()).to(self.device),
                         BYTES_PER_NUMBER * algo.upload_numel(plan, ids, state.server_state),
                         BYTES_PER_NUMBER * algo.download_numel(plan, ids, state.server_state),
                         lr)
        if job:
            work.job = self.local_job(state, rnd, plan, ids, draws=draws)
        return work

    def prefetch(self, rnd: int) -> None:
        """Draw round ``rnd``'s minibatch plans on a CPU thread (after this round is queued)."""
        t = self.cfg.train
        if rnd <= t.rounds:
            self.planner.prefetch(sample_clients(self.cfg.role_seed("sampling"), rnd,
                                                 self.partition.num_clients,
                                                 t.clients_per_round), rnd)

    def finish_round(self, state: FedState, rnd: int, work: RoundWork,
                     trained: TrainedRound | ClientResults,
                     evaluator=None) -> tuple[FedState, list[Record]]:
        """3-5. The server update, the round's diagnostics and evaluation, from the clients'
        results (``ClientResults`` of this process, or a trainer's :class:`TrainedRound`).

        ``evaluator(new_state) -> {split: (loss, hit)}``: the global model's per-sample loss
        and accuracy on ``"test"`` and/or ``"val"`` computed elsewhere (a stacked group
        evaluates its runs in one pass); a split it leaves out is evaluated here."""
        new_state, pending = self.update_round(state, rnd, work, trained)
        return new_state, self.round_records(new_state, pending, evaluator)

    def update_round(self, state: FedState, rnd: int, work: RoundWork,
                     trained: TrainedRound | ClientResults) -> tuple[FedState, tuple]:
        """3-4. The server update and the round's diagnostics (the first part of
        :meth:`finish_round`); returns the new state and what :meth:`round_records` needs."""
        algo, t = self.algorithm, self.cfg.train
        if isinstance(trained, ClientResults):
            trained = TrainedRound(trained, work.weights)
        ids, plan, weights = work.ids, work.plan, work.weights
        bytes_up, bytes_down = work.bytes_up, work.bytes_down
        algo.round_lr = work.lr
        results = trained.results
        _check_finite(rnd, ids, results.objective, results.params)
        # 3. client state, then the server update
        algo.update_client_state(rnd, ids, state.global_params, results, state.client_state,
                                 state.server_state)
        update = algo.server_update(rnd, plan, ids, state.global_params, results,
                                    trained.weights, state.server_state)
        new_params = update.params
        _check_finite(rnd, ids, None, {n: new_params[n] for n in plan.upload})
        # 4. diagnostics of the round
        p = weights.double()
        losses = results.data_loss.to(p.device).double()
        # one host sync for the round's scalars and the clients' losses
        head = torch.stack([(p * losses).sum(), (p * results.objective.to(p.device)).sum(),
                            results.grad_norm_first.mean().double().to(p.device),
                            results.grad_norm_last.mean().double().to(p.device)])
        scalars = torch.cat([head, losses]).tolist()
        steps = int(results.steps.sum())
        g = {
            "train_loss": scalars[0],
            "local_objective": scalars[1],
            "bytes_up": float(bytes_up),
            "bytes_down": float(bytes_down),
            "train_flops": float(steps * self._step_flops(plan.trainable, plan.stage)),
            "trainable_params": float(sum(new_params[n].numel() for n in plan.trainable)),
            "qk_change": relative_change(state.global_params, new_params, self.qk_names),
        }
        if trained.update_dispersion is None:
            g["update_dispersion"], g["update_norm"] = update_dispersion(
                state.global_params, results.params, weights)
        else:
            g["update_dispersion"], g["update_norm"] = (trained.update_dispersion,
                                                        trained.update_norm)
        g["update_dispersion_rel"] = g["update_dispersion"] / max(g["update_norm"], 1e-300)
        if state.prev_grad_norm_last is not None:
            g["grad_norm_jump"] = scalars[2] / max(state.prev_grad_norm_last, 1e-300)
        records: list[Record] = [(rnd, str(int(m)), "train_loss", v)
                                 for m, v in zip(ids, scalars[4:])]
        plateau = state.plateau
        if self._multipliers is not None and t.schedule.kind == "plateau":
            plateau = dataclasses.replace(plateau or PlateauState())
            if self.x_val is None:  # with a validation split it observes val_loss instead
                plateau.observe(g["train_loss"], t.schedule)
        new_state = FedState(rnd, new_params, state.client_state, state.server_state,
                             scalars[3], plateau)
        g["lr"] = work.lr
        return new_state, (rnd, g, records, update.metrics)

    def round_records(self, new_state: FedState, pending: tuple,
                      evaluator=None) -> list[Record]:
        """5. The evaluation, and every record of the round (the second part of
        :meth:`finish_round`)."""
        rnd, g, records, extra = pending
        if self.evaluates(rnd):
            g_eval, per_client = self.evaluate(new_state, evaluator)
            g.update(g_eval)
            records += [(rnd, str(m), "local_test_acc", a) for m, a in per_client.items()]
            if new_state.plateau is not None and self.x_val is not None:
                new_state.plateau.observe(g_eval["val_loss"], self.cfg.train.schedule)
            if self.cfg.eval.finetune and rnd == self.cfg.train.rounds and (
                    self.cfg.eval.test or self.x_val is not None):
                ft, ft_val, ft_lr = self.finetuned_accuracy(new_state, rnd)
                if tuple(self.cfg.eval.finetune_lr_factors) != (1.0,):
                    g["local_ft_lr"] = ft_lr  # the step, where it is not the run's lr alone
                if ft is not None:
                    records += [(rnd, str(m), "local_ft_acc", a) for m, a in enumerate(ft)]
                    sizes = np.array([len(ix) for ix in self.partition.test], dtype=np.float64)
                    g.update({"local_ft_acc_mean": float(ft.mean()),
                              "local_ft_acc_micro": float((ft * sizes).sum()
                                                          / max(sizes.sum(), 1))})
                if ft_val is not None:
                    g["local_ft_val_acc_micro"] = ft_val
        g.update(extra)
        g.update(self.algorithm.observe_round(rnd, g, new_state,
                                              lambda: self._attention_probe(new_state)))
        return records + [(rnd, "global", k, v) for k, v in sorted(g.items())]

    def _check_rule_inputs(self) -> None:
        """What the algorithm's round observation reads exists: the validation split, a probe
        batch within it, and attention layers; and the validation split where the fine-tuning
        chooses its step among several (ConfigError naming the key otherwise)."""
        from linattn.errors import ConfigError
        from real_data.models.layers import Attention

        algo, name = self.algorithm, self.cfg.algorithm.name
        factors = self.cfg.eval.finetune_lr_factors
        if self.cfg.eval.finetune and len(factors) > 1 and self.x_val is None:
            raise ConfigError(f"eval.finetune_lr_factors={list(factors)} chooses the "
                              "fine-tuning step on the clients' validation samples: set "
                              "partition.validation_fraction (e.g. 0.1), or give one factor")
        if algo.needs_validation and self.x_val is None:
            params = self.cfg.algorithm.params
            default = (" (algorithm.warmup=auto is the default where algorithm.warmup_rounds "
                       "is unset; or give algorithm.warmup_rounds, a fixed T0)"
                       if getattr(params, "warmup", None) == "auto"
                       and getattr(params, "warmup_rounds", 0) is None else "")
            raise ConfigError(f"algorithm.name={name} with these settings "
                              f"({_settings(self.cfg)}) reads the validation split; set "
                              f"partition.validation_fraction (e.g. 0.1){default}")
        if algo.forks_run and self.trainer is not None:
            raise ConfigError(f"algorithm.name={name} ({_settings(self.cfg)}) forks probe "
                              "continuations and rolls the run back, which runs in one "
                              "process: run it without --distributed or Flower, or set "
                              "algorithm.warmup to fixed or an online rule")
        batch = algo.attention_probe_batch
        if batch is not None:
            if not any(isinstance(m, Attention) for m in self.model.modules()):
                raise ConfigError(f"algorithm.name={name} ({_settings(self.cfg)}) reads "
                                  f"attention rows, and model.name={self.cfg.model.name} has "
                                  "no attention layers")
            if batch > len(self.x_val):
                raise ConfigError(f"algorithm.probe_batch={batch} exceeds the validation "
                                  f"split's {len(self.x_val)} samples; lower it or raise "
                                  "partition.validation_fraction")

    def _attention_probe(self, state: FedState):
        """The global model's attention rows on ``algorithm.attention_probe_batch`` pooled
        validation inputs evenly spaced over the split (so every client's inputs are in it)."""
        from real_data.models.layers import attention_scores

        n = self.algorithm.attention_probe_batch
        batch = self.x_val[torch.linspace(0, len(self.x_val) - 1, n).round().long()]
        ctx = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast
               else contextlib.nullcontext())
        with ctx:
            return attention_scores(self.model, state.global_params, batch)

    def train_clients(self, state: FedState, rnd: int, plan, ids: np.ndarray):
        """Local training of the clients ``ids`` in round ``rnd`` here (-> ClientResults)."""
        self.algorithm.round_lr = lr = self.round_lr(state, rnd)
        results = self.train_job(self.local_job(state, rnd, plan, ids, lr))
        self.model.eval()
        return results

    def train_job(self, job: LocalJob):
        """Run ``job`` on this federation's engine (dropout on where the model has it)."""
        if self.model.training != (self._dropout > 0):
            self.model.train(self._dropout > 0)
        return self.engine(job)

    def local_job(self, state: FedState, rnd: int, plan, ids: np.ndarray,
                  lr: float | None = None, draws: RoundDraws | None = None) -> LocalJob:
        """The engine's job for the clients ``ids`` in round ``rnd`` (``lr``: the round's
        learning rate, by default from the schedule; ``draws``: minibatches and dropout seed
        in place of round ``rnd``'s, see :meth:`begin_round`)."""
        cfg, algo = self.cfg, self.algorithm
        lr = self.round_lr(state, rnd) if lr is None else lr
        idx = torch.as_tensor(ids, device=self.device)
        optimizer = self.optimizer if lr == self.optimizer.lr else \
            dataclasses.replace(self.optimizer, lr=lr)
        if self.model.training != (self._dropout > 0):
            self.model.train(self._dropout > 0)
        return LocalJob(
            model=self.model, algorithm=algo, global_params=state.global_params,
            trainable=plan.trainable,
            batches=self.planner.plan(ids, rnd) if draws is None else draws.batches,
            x=self.x_train, y=self.y_train, optimizer=optimizer, client_ids=ids,
            dropout_seed=int(np.random.SeedSequence([cfg.role_seed("training"), rnd])
                             .generate_state(1)[0]) if draws is None else draws.dropout_seed,
            overrides=algo.client_start(ids, state.global_params, state.client_state,
                                        state.server_state),
            client_state={k: v[idx] for k, v in state.client_state.items()},
            server_state=state.server_state, autocast=self.autocast)

    @property
    def _dropout(self) -> float:
        return float(getattr(self.cfg.model.params, "dropout", 0.0))

    def evaluates(self, rnd: int) -> bool:
        """Whether round ``rnd`` ends with an evaluation (``eval.every``, and the last)."""
        return rnd % self.cfg.eval.every == 0 or rnd == self.cfg.train.rounds

    def eval_splits(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """The splits an evaluation reads: ``"val"`` (the pooled validation split, if the
        partition has one) and ``"test"`` (unless ``eval.test`` is false)."""
        out = {}
        if self.x_val is not None:
            out["val"] = (self.x_val, self.y_val)
        if self.cfg.eval.test:
            out["test"] = (self.x_test, self.y_test)
        return out

    def evaluate(self, state: FedState, evaluator=None
                 ) -> tuple[dict[str, float], dict[int, float]]:
        """Global validation and test loss/accuracy and every client's local test accuracy
        (``evaluator``: see :meth:`finish_round`)."""
        algo, bs = self.algorithm, self.cfg.eval.batch_size

        def fwd(params):
            return lambda xb: algo.forward(self.model, params, xb)

        done = {} if evaluator is None else evaluator(state)
        out: dict[str, float] = {}
        hits = {}
        for split, (x, y) in self.eval_splits().items():
            loss, h = done[split] if split in done else evaluate(
                fwd(state.global_params), x, y, bs, self.autocast)
            out[f"{split}_loss"], out[f"{split}_acc"] = float(loss.mean()), float(h.mean())
            hits[split] = h
        hit = hits.get("test")
        if self.cfg.eval.clients and "val" in hits:
            out["local_val_acc_micro"] = self._local_val_micro(state, hits["val"])
        per_client: dict[int, float] = {}
        if self.cfg.eval.clients and hit is not None:
            hit_np = hit.cpu().numpy()
            sizes = np.array([len(ix) for ix in self.partition.test], dtype=np.float64)
            for m, test_idx in enumerate(self.partition.test):
                own = algo.eval_params(m, state.global_params, state.client_state,
                                       state.server_state)
                if own is None:
                    per_client[m] = float(hit_np[test_idx].mean()) if len(test_idx) else 0.0
                else:
                    ix = torch.as_tensor(test_idx, device=self.device)
                    _, h = evaluate(fwd(own), self.x_test[ix], self.y_test[ix], bs,
                                    self.autocast)
                    per_client[m] = float(h.mean())
            acc = np.array(list(per_client.values()))
            out.update(local_summary(acc))
            # micro average: correct predictions over all local test samples (FedTP's metric)
            out["local_acc_micro"] = float((acc * sizes).sum() / max(sizes.sum(), 1.0))
        return out, per_client

    def _local_val_micro(self, state: FedState, pooled_hits) -> float:
        """Correct predictions over every client's own validation samples, each client under
        its evaluation parameters (a personalized method's own model; the global model
        otherwise, where this is ``val_acc``): the personalized score a tuning reads."""
        algo = self.algorithm
        return self._own_validation_micro(
            lambda m: algo.eval_params(m, state.global_params, state.client_state,
                                       state.server_state), algo.forward, pooled_hits)

    def _own_validation_micro(self, params_of, forward, pooled_hits=None) -> float:
        """Accuracy over all clients' own validation samples (the pooled split's client-order
        slices), client m under ``params_of(m)`` through ``forward``; where that is None, the
        global model's per-sample ``pooled_hits``."""
        h_all = None if pooled_hits is None else pooled_hits.cpu().numpy()
        correct, start = 0.0, 0
        for m, idx in enumerate(self.partition.val):
            n = len(idx)
            own = params_of(m) if n else None
            if own is None:
                correct += float(h_all[start:start + n].sum()) if n else 0.0
            else:
                _, h = evaluate(lambda xb, p=own: forward(self.model, p, xb),
                                self.x_val[start:start + n], self.y_val[start:start + n],
                                self.cfg.eval.batch_size, self.autocast)
                correct += float(h.sum())
            start += n
        return correct / max(start, 1)

    def finetuned_accuracy(self, state: FedState, rnd: int
                           ) -> tuple[np.ndarray | None, float | None, float]:
        """Every client's local test accuracy after fine-tuning the global model for one local
        round: all parameters, the run's optimizer at its base ``train.lr`` (not the schedule's
        last, which is 0 at the end of a cosine) times a factor of ``eval.finetune_lr_factors``,
        its K steps (or E epochs) on fresh minibatches of its own training samples, the plain
        objective (no proximal term or control variate), whatever the algorithm. The same
        budget for every algorithm and schedule, so "FedAvg + fine-tuning" and "FedFrozen +
        fine-tuning" meet a personalized method such as FedTP on its own metric. With several
        factors each fine-tunes from the same start on the same minibatches and dropout draws;
        the step whose models score best on the clients' own validation samples is kept (ties
        to the first listed), and only its models are scored on the test set.

        Returns the per-client test accuracies of the kept step (None with ``eval.test``
        false), its fine-tuned models' accuracy over all clients' own validation samples (None
        without a validation split), what a tuning on the personalized score reads, and the
        kept step size."""
        from real_data.algorithms.fedavg import FedAvg, FedAvgParams

        plain = FedAvg(FedAvgParams(), self.algorithm.ctx)
        ids = np.arange(self.partition.num_clients)
        names = tuple(state.global_params)
        seed = int(np.random.SeedSequence([self.cfg.role_seed("training"), rnd, 1])
                   .generate_state(1)[0])
        batches = self.planner.plan(ids, rnd + 1)  # every step on the same minibatches

        def fine_tune(lr: float):
            job = LocalJob(
                model=self.model, algorithm=plain, global_params=state.global_params,
                trainable=names, batches=batches, x=self.x_train,
                y=self.y_train, optimizer=dataclasses.replace(self.optimizer, lr=lr),
                client_ids=ids, dropout_seed=seed, overrides={}, client_state={},
                server_state=None, autocast=self.autocast)
            results = self.train_job(job)
            self.model.eval()

            def own(m):
                return {n: results.params[n][m] if n in results.params else v
                        for n, v in state.global_params.items()}

            val = None if self.x_val is None else self._own_validation_micro(own,
                                                                               plain.forward)
            return own, val

        best = None
        for factor in self.cfg.eval.finetune_lr_factors:
            lr = factor * self.cfg.train.lr
            own, val = fine_tune(lr)
            if best is None or (val is not None and val > best[2]):
                best = (lr, own, val)
            own = None  # one step's client models at a time beside the best
        lr, own, val = best
        acc = None
        if self.cfg.eval.test:
            bs = self.cfg.eval.batch_size
            acc = np.zeros(len(ids))
            for m, test_idx in enumerate(self.partition.test):
                if not len(test_idx):
                    continue
                ix = torch.as_tensor(test_idx, device=self.device)
                p = own(m)
                _, h = evaluate(lambda xb, p=p: plain.forward(self.model, p, xb),
                                self.x_test[ix], self.y_test[ix], bs, self.autocast)
                acc[m] = float(h.mean())
        return acc, val, lr

    def _step_flops(self, trainable: tuple[str, ...], stage: str = "full") -> int:
        # keyed by stage too: an algorithm may change its forward between stages (FedSQ)
        key = (stage, *trainable)
        if key not in self._flops:
            from real_data.algorithms.base import Algorithm

            algo = self.algorithm
            b = min(self.cfg.train.batch_size, len(self.x_train))
            # the count depends on the forward, the model, the batch and the trainable set
            # only, so every federation of a stacked group or sweep shares one measurement
            forward = ("plain" if type(algo).forward is Algorithm.forward
                       else (type(algo).__name__, repr(self.cfg.algorithm)))
            shared = (forward, self.cfg.model.name, repr(self.cfg.model.params), self.dtype,
                      self.device.type, b, tuple(self.x_train.shape[1:]), key)
            if shared not in _FLOPS:
                ix = torch.arange(b, device=self.device)
                params = {n: p.detach() for n, p in self.model.named_parameters()}
                _FLOPS[shared] = step_flops(
                    lambda ps, xb: algo.forward(self.model, ps, xb), params, trainable,
                    self.x_train[ix], self.y_train[ix])
            self._flops[key] = _FLOPS[shared]
        return self._flops[key]


_FLOPS: dict[tuple, int] = {}  # step FLOPs by (forward, model, batch, stage, trainable set)


_DATA: dict[tuple, tuple] = {}  # (id of the data set, device, dtype) -> its tensors there
_TENSORS: dict[tuple, tuple] = {}  # (id of a CPU tensor, device, dtype) -> (it, its copy)


def _device_data(dataset, device: torch.device, dtype: torch.dtype) -> tuple:
    """The data set's splits on ``device`` (images in ``dtype``), one copy for every federation
    of the data set in this process, so that stacked runs share the tensors they index. Each
    tensor moves once: data sets that share one (the inputs of concept-shifted data sets,
    :func:`real_data.data.shift.apply_shift`) share its copy too."""
    key = (id(dataset), str(device), dtype)
    if key not in _DATA or _DATA[key][0] is not dataset:
        while len(_DATA) >= 2:
            _DATA.pop(next(iter(_DATA)))
            _VAL.clear()  # validation copies keep their data set's tensors alive
        floating = dataset.x_train.is_floating_point()
        _DATA[key] = (dataset, (_on_device(dataset.x_train, device, dtype if floating else None),
                                _on_device(dataset.y_train, device, None),
                                _on_device(dataset.x_test, device, dtype if floating else None),
                                _on_device(dataset.y_test, device, None)))
    return _DATA[key][1]


def _on_device(t: torch.Tensor, device: torch.device, dtype: torch.dtype | None
               ) -> torch.Tensor:
    """``t`` on ``device`` (in ``dtype`` unless ``None``), one copy per tensor in this process
    (the :data:`DEVICE_TENSORS` tensors asked for last are kept)."""
    key = (id(t), str(device), dtype)
    if key in _TENSORS and _TENSORS[key][0] is t:
        _TENSORS[key] = _TENSORS.pop(key)  # the most recently asked for goes last
        return _TENSORS[key][1]
    while len(_TENSORS) >= DEVICE_TENSORS:
        _TENSORS.pop(next(iter(_TENSORS)))
    moved = t.to(device)
    _TENSORS[key] = (t, moved if dtype is None else moved.to(dtype))
    return _TENSORS[key][1]


DEVICE_TENSORS = 8  # two data sets' four splits


def _validation_data(partition, x_train: torch.Tensor, y_train: torch.Tensor) -> tuple:
    """The pooled validation samples on the training tensors' device (``(None, None)`` without
    a validation split); one copy per partition in this process, so that stacked runs on one
    partition evaluate them in one pass."""
    if not partition.has_validation:
        return None, None
    idx = partition.val_pooled
    # the labels are part of the key: a concept shift relabels the same inputs (one x_train
    # tensor, several y_train), and each data set must read its own labels
    key = (id(x_train), id(y_train), x_train.dtype, len(idx), hash(idx.tobytes()))
    held = _VAL.get(key)
    if held is None or held[0] is not x_train or held[1] is not y_train:
        while len(_VAL) >= 8:
            _VAL.pop(next(iter(_VAL)))
        ix = torch.as_tensor(idx, device=x_train.device)
        _VAL[key] = (x_train, y_train, x_train[ix], y_train[ix])
    return _VAL[key][2:]


_VAL: dict[tuple, tuple] = {}


def _check_finite(rnd, ids, objective, params) -> None:
    """Raise Diverged if a client's objective or any parameter is not finite. One host sync:
    the parameters are checked through their norms (one fused multi-tensor kernel on CUDA; a
    parameter beyond about 1e19 in float32 overflows its norm and counts as diverged too)."""
    checks = []
    if objective is not None:
        checks.append(torch.isfinite(objective).all())
    if params:
        checks.append(torch.isfinite(torch.stack(torch._foreach_norm(list(params.values()))))
                      .all())
    if not checks or bool(torch.stack(checks).all()):
        return
    bad: list = []
    if objective is not None:
        bad = [int(ids[c]) for c in torch.nonzero(~torch.isfinite(objective)).flatten().tolist()]
    bad = bad or ["(aggregate)"]
    raise Diverged(f"non-finite loss or parameters in round {rnd} (clients {bad[:10]}); "
                   "try a smaller train.lr or set train.clip_grad_norm")


def _settings(cfg: Config) -> str:
    """The algorithm's settings as ``algorithm.key=value`` pairs, for error messages."""
    params = cfg.algorithm.params
    fields = getattr(params, "__dataclass_fields__", {})
    return ", ".join(f"algorithm.{k}={getattr(params, k)}" for k in fields)
