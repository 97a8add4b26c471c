"""FedFrozen (arXiv 2605.06446): FedAvg warm-up, then the attention's Q/K block is frozen."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from linattn.errors import ConfigError, UserError
from linattn_theory.warmup import WarmupConstants, recommend_warmup
from real_data.algorithms.base import Algorithm, RoundPlan, ServerUpdate
from real_data.algorithms.warmup_probe import estimate_constants, round_statistics
from real_data.models.groups import names_of_kind


@dataclass(frozen=True)
class FedFrozenParams:
    """Attributes
    ----------
    warmup_rounds : int or None
        T0: rounds 1..T0 are FedAvg on the full model; from round T0 + 1 the query/key
        projections stay at their round-T0 global values. Required when ``warmup="fixed"``.
    warmup : {"fixed", "auto"}
        ``auto``: T0 is recommended by ``linattn_theory.warmup.recommend_warmup`` from
        constants measured during the first ``probe_rounds`` warm-up rounds
        (:mod:`real_data.algorithms.warmup_probe` documents the estimators); T0 >= probe_rounds.
    train : {"all_but_qk", "v"}
        What trains after T0: everything except Q/K, or the value projections only (the
        restricted value-block problem of the theory).
    probe_rounds : int
        Number of warm-up rounds measured for ``warmup="auto"`` (at least 2).
    freeze : {"qk", "v_attn_out"}
        The block frozen after T0: the attention kernel (Q/K, FedFrozen), or the equal-size
        control that freezes the value and attention-output projections instead (as many
        parameters as Q/K: two d x d maps and their biases per layer) and trains everything
        else, Q/K included; it asks whether freezing the kernel matters or freezing any
        block of that size does. ``v_attn_out`` needs ``train=all_but_qk`` (read: all but the
        frozen block).
    """

    warmup_rounds: int | None = None
    warmup: Literal["fixed", "auto"] = "fixed"
    train: Literal["all_but_qk", "v"] = "all_but_qk"
    probe_rounds: int = 5
    freeze: Literal["qk", "v_attn_out"] = "qk"

    def __post_init__(self) -> None:
        if self.warmup == "fixed" and self.warmup_rounds is None:
            raise ConfigError("algorithm.warmup_rounds is required when algorithm.warmup=fixed "
                              "(or set algorithm.warmup=auto)")
        if self.warmup_rounds is not None and self.warmup_rounds < 0:
            raise ConfigError(f"algorithm.warmup_rounds={self.warmup_rounds} must be >= 0")
        if self.probe_rounds < 2:
            raise ConfigError(f"algorithm.probe_rounds={self.probe_rounds} must be >= 2")
        if self.freeze == "v_attn_out" and self.train == "v":
            raise ConfigError("algorithm.freeze=v_attn_out freezes the value projections, so "
                              "algorithm.train=v leaves nothing to train; use "
                              "algorithm.train=all_but_qk")


@dataclass
class FedFrozenState:
    """FedFrozen's server state.

    Attributes
    ----------
    holds_qk : np.ndarray
        ``(num_clients,)`` bool: the client has received the frozen Q/K.
    warmup_rounds : int or None
        T0; with ``warmup="auto"`` ``None`` until the probe has recommended it.
    probe : list of dict
        The probe rounds' statistics (:func:`~real_data.algorithms.warmup_probe.
        round_statistics`), kept until T0 is recommended.
    constants : dict or None
        The measured constants, the loss floor, the regime and the recommended T0 (auto).
    """

    holds_qk: np.ndarray
    warmup_rounds: int | None = None
    probe: list[dict] = field(default_factory=list)
    constants: dict | None = None


class FedFrozen(Algorithm):
    """Two stages: FedAvg for t <= T0, then Q/K frozen, held once and never sent.

    In the frozen stage the clients train (and upload) only the ``train`` set; the Q/K tensors
    are the very round-T0 global tensors, shared by every client (the vectorized engine does
    not stack them). Download: a client receives the frozen Q/K once, the first time it is
    sampled after T0; after that only the trainable set.
    """

    name = "fedfrozen"
    Params = FedFrozenParams

    def __init__(self, params, ctx) -> None:
        super().__init__(params, ctx)
        t_total = ctx.total_rounds
        if params.warmup == "fixed" and params.warmup_rounds > t_total:
            raise ConfigError(f"algorithm.warmup_rounds={params.warmup_rounds} exceeds "
                              f"train.rounds={t_total}; allowed: 0..{t_total}")
        if params.warmup == "auto" and params.probe_rounds > t_total:
            raise ConfigError(f"algorithm.probe_rounds={params.probe_rounds} exceeds "
                              f"train.rounds={t_total}")
        # the block frozen after T0 (and sent to a client once): Q/K, or the control's V/out
        self.qk = (names_of_kind(ctx.groups, "qk") if params.freeze == "qk"
                   else names_of_kind(ctx.groups, "v", "attn_out"))
        if params.train == "v":
            self.frozen_train = names_of_kind(ctx.groups, "v")
        else:
            self.frozen_train = tuple(n for n in ctx.names if n not in self.qk)

    def init_server_state(self, global_params) -> FedFrozenState:
        fixed = self.params.warmup == "fixed"
        return FedFrozenState(np.zeros(self.ctx.num_clients, dtype=bool),
                              self.params.warmup_rounds if fixed else None)

    def _frozen(self, rnd: int, server_state: FedFrozenState) -> bool:
        # a fixed T0 comes from the config (so a T0 sweep can branch a warm-up checkpoint)
        fixed = self.params.warmup == "fixed"
        t0 = self.params.warmup_rounds if fixed else server_state.warmup_rounds
        return t0 is not None and rnd > t0

    def plan_round(self, rnd, server_state):
        if not self._frozen(rnd, server_state):
            names = self.ctx.names
            return RoundPlan(names, names, names, stage="warmup")
        t = self.frozen_train
        return RoundPlan(t, t, t, stage="frozen")

    def download_numel(self, plan, client_ids, server_state):
        base = super().download_numel(plan, client_ids, server_state)
        if plan.stage != "frozen":
            return base
        missing = int((~server_state.holds_qk[client_ids]).sum())
        return base + missing * sum(int(np.prod(self.ctx.shapes[n])) for n in self.qk)

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        metrics = {}
        if plan.stage == "frozen":
            server_state.holds_qk[client_ids] = True
        elif self.params.warmup == "auto" and server_state.warmup_rounds is None:
            metrics = self._probe(rnd, global_params, results, weights, server_state)
        update = super().server_update(rnd, plan, client_ids, global_params, results, weights,
                                       server_state)
        return ServerUpdate(update.params, metrics)

    def _probe(self, rnd, global_params, results, weights,
               server_state: FedFrozenState) -> dict[str, float]:
        """Record a probe round; after the last one set T0 and return the measured constants
        as metrics (none before)."""
        probe = server_state.probe
        probe.append(round_statistics(global_params, results.params, results.first_loss,
                                      results.steps, weights, self.round_lr))
        if len(probe) < self.params.probe_rounds:
            return {}
        est = estimate_constants(probe, self.ctx.optimizer.lr, self.ctx.total_rounds)
        floor = est.pop("loss_floor")
        try:
            rec = recommend_warmup(WarmupConstants(**est), regime="auto")
        except ValueError as exc:  # the theory rejects the measured constants
            raise UserError(f"algorithm.warmup=auto: no T0 from the probe constants {est} "
                            f"({exc}); set algorithm.warmup=fixed and warmup_rounds") from exc
        t0 = int(np.clip(rec.warmup_rounds, rnd, self.ctx.total_rounds))
        server_state.warmup_rounds = t0
        server_state.constants = {**est, "loss_floor": floor, "regime": rec.regime,
                                  "recommended": int(rec.warmup_rounds)}
        server_state.probe = []  # T0 is set: the probe's flat vectors are not needed again
        metrics = {f"probe_{k}": float(v) for k, v in est.items()}
        metrics.update(probe_loss_floor=floor, warmup_rounds_recommended=float(t0))
        return metrics

    def run_summary(self, server_state: FedFrozenState) -> dict:
        if server_state.constants is None:
            return {}
        return {"warmup": {"warmup_rounds": server_state.warmup_rounds,
                           "constants": server_state.constants}}

    def tag(self) -> str:
        t0 = "auto" if self.params.warmup == "auto" else str(self.params.warmup_rounds)
        control = "" if self.params.freeze == "qk" else f"-freeze_{self.params.freeze}"
        return f"fedfrozen-{self.params.train}{control}-T0{t0}"
