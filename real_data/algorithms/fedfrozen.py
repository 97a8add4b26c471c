"""FedFrozen (arXiv 2605.06446): FedAvg warm-up, then the attention's Q/K block is frozen."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from linattn.errors import ConfigError, UserError
from linattn_theory.errors import ParameterError
from linattn_theory.freeze_rules import RULES, FreezeRule, make_rule, parse_rule
from linattn_theory.warmup import WarmupConstants, recommend_warmup
from real_data.algorithms.base import Algorithm, RoundPlan, ServerUpdate
from real_data.algorithms.warmup_probe import estimate_constants, round_statistics
from real_data.models.groups import GROUP_KINDS, names_of_kind


@dataclass(frozen=True)
class FedFrozenParams:
    """Attributes
    ----------
    warmup_rounds : int or None
        T0: rounds 1..T0 are FedAvg on the full model; from round T0 + 1 the query/key
        projections stay at their round-T0 global values. Required when ``warmup="fixed"``.
    warmup : str
        ``fixed`` (T0 = ``warmup_rounds``), ``auto``: T0 is recommended by
        ``linattn_theory.warmup.recommend_warmup`` from constants measured during the first
        ``probe_rounds`` warm-up rounds (:mod:`real_data.algorithms.warmup_probe` documents the
        estimators; T0 >= probe_rounds), or an online freeze rule of
        :mod:`linattn_theory.freeze_rules` (``perturbation``, ``norm_change``,
        ``norm_change_median``, ``kernel_stability``, ``plateau``, ``fraction=f``): the rule
        watches the warm-up rounds and freezes after the round it fires (never: T0 = T).
        ``plateau`` and ``kernel_stability`` need a validation split
        (``partition.validation_fraction``); ``plateau`` observes the rounds that evaluate.
    train : {"all_but_qk", "v"}
        What trains after T0: everything except Q/K, or the value projections only (the
        restricted value-block problem of the theory).
    probe_rounds : int
        Number of warm-up rounds measured for ``warmup="auto"`` (at least 2).
    probe_batch : int
        Validation inputs (evenly spaced over the pooled validation split) on which
        ``warmup=kernel_stability`` reads the attention rows each round (default 64).
    freeze : {"qk", "v_attn_out"}
        The block frozen after T0: the attention kernel (Q/K, FedFrozen), or the equal-size
        control that freezes the value and attention-output projections instead (as many
        parameters as Q/K: two d x d maps and their biases per layer) and trains everything
        else, Q/K included; it asks whether freezing the kernel matters or freezing any
        block of that size does. ``v_attn_out`` needs ``train=all_but_qk`` (read: all but the
        frozen block).
    """

    warmup_rounds: int | None = None
    warmup: str = "fixed"
    train: Literal["all_but_qk", "v"] = "all_but_qk"
    probe_rounds: int = 5
    freeze: Literal["qk", "v_attn_out"] = "qk"
    probe_batch: int = 64

    @property
    def rule(self) -> str | None:
        """The online freeze rule's spec, or None for ``fixed`` and ``auto``."""
        return None if self.warmup in ("fixed", "auto") else self.warmup

    def __post_init__(self) -> None:
        if self.rule is not None:
            try:
                parse_rule(self.rule)
            except ParameterError as exc:
                raise ConfigError(f"algorithm.warmup={self.warmup!r}: one of fixed, auto, "
                                  f"{', '.join(RULES[:-1])}, fraction=f with f in [0, 1] "
                                  f"({exc})") from None
        if not 1 <= self.probe_batch <= 4096:
            raise ConfigError(f"algorithm.probe_batch={self.probe_batch} must be in 1..4096")
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
    rule: FreezeRule | None = None
    pending: dict | None = None
    rule_seconds: float = 0.0


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
        state = FedFrozenState(np.zeros(self.ctx.num_clients, dtype=bool),
                               self.params.warmup_rounds if fixed else None)
        if self.params.rule is not None:
            state.rule = make_rule(self.params.rule, self.ctx.total_rounds)
            state.warmup_rounds = state.rule.fired_at  # fraction=0: T0 = 0 before round 1
        return state

    @property
    def needs_validation(self) -> bool:
        """True when the warm-up rule reads the validation split."""
        rule = self.params.rule
        return rule is not None and rule.partition("=")[0] in ("plateau", "kernel_stability")

    @property
    def attention_probe_batch(self) -> int | None:
        return self.params.probe_batch if self.params.rule == "kernel_stability" else None

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
        rule = server_state.rule
        if plan.stage != "frozen" and rule is not None and rule.fired_at is None:
            start = time.perf_counter()
            new = update.params

            def delta(names):
                return torch.cat([(new[n] - global_params[n]).double().flatten()
                                  for n in names]).cpu().numpy()
            pending = {"delta": delta(self.qk)} if "delta" in rule.needs else {}
            if "other_deltas" in rule.needs:
                pending["other_deltas"] = {
                    kind: delta(names) for kind in GROUP_KINDS
                    if (names := [n for n in names_of_kind(self.ctx.groups, kind)
                                  if n not in self.qk])}
            server_state.pending = pending
            server_state.rule_seconds += time.perf_counter() - start
        return ServerUpdate(update.params, metrics)

    def observe_round(self, rnd, metrics, state, attention_scores) -> dict:
        """Feed the warm-up rule this round's signals; when it fires, T0 = ``rnd``."""
        ss = state.server_state
        rule = ss.rule
        if rule is None or rule.fired_at is not None or self._frozen(rnd, ss):
            return {}
        start = time.perf_counter()
        signals = dict(ss.pending or {})
        ss.pending = None
        signals["lr"] = self.round_lr
        if "val_score" in rule.needs:
            if "val_acc" not in metrics:  # plateau: only the rounds that evaluate
                return {}
            signals["val_score"] = metrics["val_acc"]
        if "scores" in rule.needs:
            signals["scores"] = attention_scores().cpu().numpy()
        fired = rule.observe(rnd, **{k: signals[k] for k in rule.needs})
        if fired:
            ss.warmup_rounds = rnd
        ss.rule_seconds += time.perf_counter() - start
        out = {"freeze_rule_fired": float(fired)}
        if rule.signal and np.isfinite(rule.signal[-1]):
            out["freeze_rule_signal"] = rule.signal[-1]
        return out

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
        rule = server_state.rule
        if rule is not None:
            return {"warmup": {
                "rule": rule.name, "fired_at": "never" if rule.fired_at is None
                else rule.fired_at, "warmup_rounds": rule.warmup_rounds,
                "rule_seconds": server_state.rule_seconds,
                "rule_state_bytes": rule.state_bytes}}
        if server_state.constants is None:
            return {}
        return {"warmup": {"warmup_rounds": server_state.warmup_rounds,
                           "constants": server_state.constants}}

    def tag(self) -> str:
        t0 = (str(self.params.warmup_rounds) if self.params.warmup == "fixed"
              else self.params.warmup)
        control = "" if self.params.freeze == "qk" else f"-freeze_{self.params.freeze}"
        return f"fedfrozen-{self.params.train}{control}-T0{t0}"
