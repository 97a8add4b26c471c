"""FedFrozen (arXiv 2605.06446): FedAvg warm-up, then the attention's Q/K block is frozen."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from linattn.errors import ConfigError
from linattn_theory.errors import ParameterError
from linattn_theory.freeze_rules import RULES, FreezeRule, make_rule, parse_rule
from real_data.algorithms.base import Algorithm, RoundPlan, ServerUpdate
from real_data.models.groups import GROUP_KINDS, names_of_kind

# ``algorithm.warmup`` when neither it nor ``warmup_rounds`` is set: the probe estimator, the
# lowest mean regret against the best fixed T0 among the online choices (docs/results.md)
DEFAULT_RULE = "auto"


@dataclass(frozen=True)
class FedFrozenParams:
    """Attributes
    ----------
    warmup_rounds : int or None
        T0: rounds 1..T0 are FedAvg on the full model; from round T0 + 1 the query/key
        projections stay at their round-T0 global values. Required when ``warmup="fixed"``.
    warmup : str or None
        ``fixed`` (T0 = ``warmup_rounds``), ``auto``: the probe estimator of eq. (36)
        (:mod:`linattn_theory.probe`, run by :mod:`real_data.probe_runs`): every
        ``probe_interval`` warm-up rounds the run forks a freeze-now continuation of
        ``probe_rounds`` frozen rounds, stops warming up when the predicted losses rise, rolls
        back to the best snapshot and freezes there (T0 = T: never), or an online freeze rule of
        :mod:`linattn_theory.freeze_rules` (``perturbation``, ``norm_change``,
        ``norm_change_median``, ``kernel_stability``, ``plateau``, ``fraction=f``): the rule
        watches the warm-up rounds and freezes after the round it fires (never: T0 = T).
        ``auto``, ``plateau`` and ``kernel_stability`` need a validation split
        (``partition.validation_fraction``); ``plateau`` observes the rounds that evaluate.
        Unset (None): ``fixed`` where ``warmup_rounds`` is given, else ``auto``, the method
        with the lowest mean regret against the best fixed T0 of all the online choices on
        the synthetic warm-up grid and on the real-data freeze-rules study
        (docs/results.md, "When to freeze, decided by the run itself").
    train : {"all_but_qk", "v"}
        What trains after T0: everything except Q/K, or the value projections only (the
        restricted value-block problem of the theory).
    probe_rounds : int
        ``warmup=auto``: frozen rounds r of each probe continuation (>= 2; default 10, as
        ``linattn_theory.sampled.probe_run``).
    probe_interval : int or None
        ``warmup=auto``: rounds between snapshots (1..T; default max(1, T // 25)).
    probe_patience, probe_window, probe_margin : int, int, float
        ``warmup=auto``: the selection rule's ``patience`` (>= 1), ``window`` (>= 1) and
        ``margin`` (>= 0) of :class:`linattn_theory.probe.ProbeSelector` (defaults 4, 4, 1).
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
    base : {"fedavg", "fedprox", "scaffold"}
        The algorithm both stages run: FedAvg, FedProx (the proximal term with ``mu`` on the
        parameters that train) or SCAFFOLD (option II control variates, with ``server_lr``,
        as :class:`real_data.algorithms.scaffold.Scaffold`); after T0 it runs on the
        parameters that still train, and the frozen block's control variates stay as they
        are at T0. FedFrozen on top of a drift-correcting method asks whether freezing adds to
        the correction.
    mu : float
        ``base=fedprox``: the proximal coefficient mu >= 0.
    server_lr : float
        ``base=scaffold``: the global step size eta_g > 0.
    """

    warmup_rounds: int | None = None
    warmup: str | None = None
    train: Literal["all_but_qk", "v"] = "all_but_qk"
    probe_rounds: int = 10
    freeze: Literal["qk", "v_attn_out"] = "qk"
    probe_batch: int = 64
    probe_interval: int | None = None
    probe_patience: int = 4
    probe_window: int = 4
    probe_margin: float = 1.0
    base: Literal["fedavg", "fedprox", "scaffold"] = "fedavg"
    mu: float = 0.01
    server_lr: float = 1.0

    @property
    def needs_validation(self) -> bool:
        """True when the warm-up rule (or ``auto``'s probes) reads the validation split."""
        if self.warmup == "auto":
            return True
        return self.rule is not None and self.rule.partition("=")[0] in ("plateau",
                                                                        "kernel_stability")

    @property
    def rule(self) -> str | None:
        """The online freeze rule's spec, or None for ``fixed`` and ``auto``."""
        return None if self.warmup in ("fixed", "auto") else self.warmup

    def __post_init__(self) -> None:
        if self.warmup is None:  # a fixed T0 where one is given, else the best online rule
            object.__setattr__(self, "warmup",
                               "fixed" if self.warmup_rounds is not None else DEFAULT_RULE)
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
            raise ConfigError(f"algorithm.probe_rounds={self.probe_rounds} must be >= 2 (the "
                              "frozen rounds of each probe continuation)")
        if self.probe_interval is not None and self.probe_interval < 1:
            raise ConfigError(f"algorithm.probe_interval={self.probe_interval} must be >= 1 "
                              "(rounds between snapshots), or null for max(1, T // 25)")
        for key in ("probe_patience", "probe_window"):
            if getattr(self, key) < 1:
                raise ConfigError(f"algorithm.{key}={getattr(self, key)} must be >= 1")
        if not self.probe_margin >= 0:
            raise ConfigError(f"algorithm.probe_margin={self.probe_margin} must be >= 0 (in "
                              "units of the predictions' noise sigma)")
        if not self.mu >= 0:
            raise ConfigError(f"algorithm.mu={self.mu} must be >= 0 (base=fedprox's proximal "
                              "coefficient)")
        if not self.server_lr > 0:
            raise ConfigError(f"algorithm.server_lr={self.server_lr} must be > 0 "
                              "(base=scaffold's global step size)")
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
        T0; with ``warmup="auto"`` or a rule ``None`` until decided.
    probe : dict or None
        ``warmup="auto"``: the probe estimator's record (:class:`real_data.probe_runs.
        ProbeDriver` writes it): the snapshot rounds and their validation curves, the round
        warm-up stopped at, the decision and its summary.
    """

    holds_qk: np.ndarray
    warmup_rounds: int | None = None
    probe: dict | None = None
    rule: FreezeRule | None = None
    pending: dict | None = None
    rule_seconds: float = 0.0
    base: Any = None  # the base algorithm's server state (SCAFFOLD's control variate c)


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
        if params.warmup == "auto" and (params.probe_interval or 1) > t_total:
            raise ConfigError(f"algorithm.probe_interval={params.probe_interval} exceeds "
                              f"train.rounds={t_total}; allowed: 1..{t_total}")
        # the block frozen after T0 (and sent to a client once): Q/K, or the control's V/out
        self.qk = (names_of_kind(ctx.groups, "qk") if params.freeze == "qk"
                   else names_of_kind(ctx.groups, "v", "attn_out"))
        if params.train == "v":
            self.frozen_train = names_of_kind(ctx.groups, "v")
        else:
            self.frozen_train = tuple(n for n in ctx.names if n not in self.qk)
        # the algorithm both stages run (FedAvg is this class's own; the others delegate)
        self.base = None
        if params.base == "fedprox":
            from real_data.algorithms.fedprox import FedProx, FedProxParams

            self.base = FedProx(FedProxParams(params.mu), ctx)
        elif params.base == "scaffold":
            from real_data.algorithms.scaffold import Scaffold, ScaffoldParams

            self.base = Scaffold(ScaffoldParams(params.server_lr), ctx)

    def init_server_state(self, global_params) -> FedFrozenState:
        fixed = self.params.warmup == "fixed"
        state = FedFrozenState(np.zeros(self.ctx.num_clients, dtype=bool),
                               self.params.warmup_rounds if fixed else None)
        if self.params.rule is not None:
            state.rule = make_rule(self.params.rule, self.ctx.total_rounds)
            state.warmup_rounds = state.rule.fired_at  # fraction=0: T0 = 0 before round 1
        if self.base is not None:
            state.base = self.base.init_server_state(global_params)
        return state

    def init_client_state(self, global_params):
        return {} if self.base is None else self.base.init_client_state(global_params)

    # -- the base algorithm's local terms, on the parameters that train ---------------------
    def regularizer(self, params, anchor, client_state, server_state):
        if self.base is None:
            return 0.0
        return self.base.regularizer(params, anchor, client_state, server_state.base)

    def local_terms(self, trainable, client_state, server_state):
        """The base algorithm's terms as stacked runs take them (none for FedAvg)."""
        if self.base is None:
            return None, 0.0
        return self.base.local_terms(trainable, client_state, server_state.base)

    def step_correction(self, trainable, client_state, server_state):
        if self.base is None:
            return None
        return self.base.step_correction(trainable, client_state, server_state.base)

    def update_client_state(self, rnd, client_ids, global_params, results, client_state,
                            server_state):
        """The base algorithm's per-client state (SCAFFOLD's control variates of the
        parameters this round trains; the frozen block's stay as they are)."""
        if self.base is not None:
            self.base.round_lr = self.round_lr  # its estimate divides by K eta of this round
            self.base.update_client_state(rnd, client_ids, global_params, results,
                                          client_state, server_state.base)

    @property
    def needs_validation(self) -> bool:
        """True when the warm-up rule (or ``auto``'s probes) reads the validation split."""
        return self.params.needs_validation

    @classmethod
    def forks_with(cls, params) -> bool:
        """``warmup=auto`` forks probe continuations and rolls the run back."""
        return params.warmup == "auto"

    @property
    def probe_interval(self) -> int:
        """Rounds between the snapshots of ``warmup=auto`` (default max(1, T // 25))."""
        t = self.ctx.total_rounds
        return self.params.probe_interval or max(1, t // 25)

    @property
    def attention_probe_batch(self) -> int | None:
        return self.params.probe_batch if self.params.rule == "kernel_stability" else None

    def _frozen(self, rnd: int, server_state: FedFrozenState) -> bool:
        # a fixed T0 comes from the config (so a T0 sweep can branch a warm-up checkpoint)
        fixed = self.params.warmup == "fixed"
        t0 = self.params.warmup_rounds if fixed else server_state.warmup_rounds
        return t0 is not None and rnd > t0

    def plan_round(self, rnd, server_state):
        frozen = self._frozen(rnd, server_state)
        t = self.frozen_train if frozen else self.ctx.names
        # SCAFFOLD sends c down and Delta c_m up for every parameter that trains
        extra = (sum(int(np.prod(self.ctx.shapes[n])) for n in t)
                 if self.params.base == "scaffold" else 0)
        return RoundPlan(t, t, t, extra_upload=extra, extra_download=extra,
                         stage="frozen" if frozen else "warmup")

    def download_numel(self, plan, client_ids, server_state):
        base = super().download_numel(plan, client_ids, server_state)
        if plan.stage != "frozen":
            return base
        missing = int((~server_state.holds_qk[client_ids]).sum())
        return base + missing * sum(int(np.prod(self.ctx.shapes[n])) for n in self.qk)

    def server_update(self, rnd, plan, client_ids, global_params, results, weights,
                      server_state):
        if plan.stage == "frozen":
            server_state.holds_qk[client_ids] = True
        update = super().server_update(rnd, plan, client_ids, global_params, results, weights,
                                       server_state)
        eta_g = self.params.server_lr
        if self.params.base == "scaffold" and eta_g != 1.0:  # x + eta_g (average - x)
            for n in plan.upload:
                x = global_params[n]
                update.params[n] = x + eta_g * (update.params[n] - x)
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
        return ServerUpdate(update.params)

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

    def run_summary(self, server_state: FedFrozenState) -> dict:
        rule = server_state.rule
        if rule is not None:
            return {"warmup": {
                "rule": rule.name, "fired_at": "never" if rule.fired_at is None
                else rule.fired_at, "warmup_rounds": rule.warmup_rounds,
                "rule_seconds": server_state.rule_seconds,
                "rule_state_bytes": rule.state_bytes}}
        probe = server_state.probe
        if probe is None or "summary" not in probe:
            return {}
        return {"warmup": {"rule": "auto", **probe["summary"]}}

    def tag(self) -> str:
        t0 = (str(self.params.warmup_rounds) if self.params.warmup == "fixed"
              else self.params.warmup)
        control = "" if self.params.freeze == "qk" else f"-freeze_{self.params.freeze}"
        base = {"fedavg": "", "fedprox": f"-fedprox-mu{self.params.mu:g}",
                "scaffold": "-scaffold" if self.params.server_lr == 1.0
                else f"-scaffold-lrg{self.params.server_lr:g}"}[self.params.base]
        return f"fedfrozen-{self.params.train}{control}{base}-T0{t0}"
