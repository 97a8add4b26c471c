"""``algorithm.warmup=auto``: the probe estimator of T0 (docs/theory.md, eq. 36) in a real run.

The estimator is :mod:`linattn_theory.probe` (:class:`~linattn_theory.probe.ProbeSelector`),
the same functions the finite-sample simulator drives
(:func:`linattn_theory.sampled.probe_run`); this module runs it on a real network:

1. Every ``algorithm.probe_interval`` rounds t < T of the warm-up (t = 0 included) the run
   keeps a snapshot of its whole state (``checkpoints/probe_<t>.pt``, the checkpoint format of
   :mod:`real_data.checkpoint`) and forks a freeze-now continuation: ``algorithm.probe_rounds``
   rounds r of the frozen stage (the algorithm's ``train`` set, its ``freeze`` block held at
   its round-t value), on copies of the state, so the main trajectory is the one a run
   without probes follows. Probe round s of every probe uses the same clients, minibatches
   and dropout seed (common random numbers, drawn from streams of their own), with the
   learning rate of round min(t + s, T).
2. The probe records the validation objective l_t(s), s = 0..r: the mean cross-entropy on the
   pooled validation split (``partition.validation_fraction``; the test split is never read),
   plus (weight_decay / 2) ||theta||^2 when ``train.weight_decay`` > 0 (the L2 term the
   optimizer adds). The selector predicts the loss of freezing at t (eq. 36); its prediction
   is the row ``probe_prediction`` of round t in ``metrics.csv`` (with ``probe_loss_start``
   and ``probe_loss_end``, l_t(0) and l_t(r)).
3. When the selector says stop (round ``stopped_at``), or at T (where the never-freeze
   candidate, the objective of the round-T model, is kept unless a snapshot beats it by
   sigma), the chosen snapshot t0 becomes T0: the run rolls back to it (state and RNG states
   restored), moves the rows of the discarded rounds t0+1..stopped_at from ``metrics.csv``
   to ``probe_discarded.csv`` (same columns), drops their ``timings.csv`` rows and trains
   the frozen stage t0+1..T. Its ``metrics.csv`` is then the one of a fixed-T0 run with
   T0 = t0, plus the probe rows of the snapshots up to t0.
4. Only snapshots that can still be chosen stay on disk: the best one so far among the
   predictions whose smoothed value is final, and the newest (all of the first three, while
   the oldest smoothed value still waits for its trend); every snapshot file is removed once
   T0 is decided.

The probe's record (snapshot rounds, curves, ``stopped_at``, the decision) is part of the
algorithm's server state, so ``checkpoints/last.pt`` carries it: a run killed at any point
(during the warm-up, during a probe, during or after the roll-back) resumes to the same
``metrics.csv`` and final parameters as an uninterrupted run. The selector is rebuilt by
feeding it the recorded curves again. ``summary.json``'s ``warmup`` holds the decision, every
probe's curve (so the selection replays offline) and the rounds computed;
``curves_probe.png`` plots the predictions (``run.plot``).

A forking run trains in one process: alone, or in a stacked group
(:mod:`real_data.stacked_runs`), whose forking runs probe together at the rounds they share
(:func:`probe_together`: probe round s of every run's continuation in one engine call);
``--distributed`` and Flower refuse it.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np

from linattn.errors import UserError
from linattn_theory.probe import ProbeChoice, ProbeSelector, best_snapshot, smoothed
from real_data import rundir
from real_data.checkpoint import load_checkpoint, restore_rng_states, save_checkpoint
from real_data.engines import BatchPlanner
from real_data.federation import FedState, RoundDraws, sample_clients
from real_data.metrics import evaluate

DISCARDED_FILE = "probe_discarded.csv"
PROBE_STREAM = 36  # the probes' draws: streams of their own, keyed by (role seed, 36, s)
PROBE_METRICS = ("probe_prediction", "probe_loss_start", "probe_loss_end")


def snapshot_path(run_dir: Path, rnd: int) -> Path:
    return run_dir / "checkpoints" / f"probe_{rnd}.pt"


def _seed(role_seed: int) -> int:
    return int(np.random.SeedSequence([role_seed, PROBE_STREAM]).generate_state(1)[0])


class ProbeDriver:
    """Runs the probes of a run with ``algorithm.warmup=auto`` (see the module docstring);
    :func:`real_data.runs._train` calls :meth:`before_round` before every round and once
    after the last."""

    def __init__(self, fed, run_dir: Path, log) -> None:
        self.fed, self.run_dir, self.log = fed, Path(run_dir), log
        algo, cfg = fed.algorithm, fed.cfg
        self.params = algo.params
        self.total = cfg.train.rounds
        self.interval = algo.probe_interval
        t = cfg.train
        self.planner = BatchPlanner(fed.partition.train, _seed(cfg.role_seed("training")),
                                    t.batch_size, t.local_steps, t.local_epochs, fed.device)
        self.sampling_seed = _seed(cfg.role_seed("sampling"))
        self._draws: list[RoundDraws] | None = None
        self._pruned = False

    # -- the record in the server state -------------------------------------------------------
    @staticmethod
    def record(state: FedState) -> dict:
        ss = state.server_state
        if ss.probe is None:
            ss.probe = {"snapshots": [], "curves": [], "stopped_at": None,
                        "continuing_loss": None, "probe_seconds": 0.0}
        return ss.probe

    def selector(self, rec: dict) -> tuple[ProbeSelector, bool]:
        """The selector fed every recorded probe again (it is deterministic), and whether it
        said stop at the last one."""
        p = self.params
        sel = ProbeSelector(self.total, patience=p.probe_patience, window=p.probe_window,
                            margin=p.probe_margin)
        stop = False
        for t, curve in zip(rec["snapshots"], rec["curves"]):
            stop = sel.add(t, curve)
        return sel, stop

    def is_probe_round(self, rnd: int) -> bool:
        return rnd < self.total and rnd % self.interval == 0

    def prepare_resume(self, state: FedState) -> None:
        """A run resumed at a probe round whose probe is not recorded: drop the probe rows a
        killed process may have written for it (the probe runs again)."""
        ss = state.server_state
        if ss.warmup_rounds is not None or not self.is_probe_round(state.round):
            return
        if state.round not in self.record(state)["snapshots"]:
            rundir.drop_rows(self.run_dir / "metrics.csv", state.round, PROBE_METRICS)

    # -- per round ----------------------------------------------------------------------------
    def probe_due(self, state: FedState) -> bool:
        """A probe continuation forks from ``state`` before its next round."""
        if state.server_state.warmup_rounds is not None:
            return False
        rec = self.record(state)
        return (rec["stopped_at"] is None and self.is_probe_round(state.round)
                and state.round not in rec["snapshots"])

    def probed_here(self, state: FedState) -> bool:
        """This run recorded its probe at ``state.round`` and has not decided yet: in a group
        resumed at this round, it probed beside the runs still due here."""
        if state.server_state.warmup_rounds is not None:
            return False
        rec = self.record(state)
        return rec["stopped_at"] is None and state.round in rec["snapshots"]

    def before_round(self, state: FedState,
                     probed: tuple[list[float], float] | None = None) -> FedState:
        """Probe at ``state.round`` if it is a snapshot round, decide T0 when the selector
        stops or the run reaches T, and roll back; returns the state the run continues from.
        ``probed``: the probe's curve and seconds, computed beside other runs' probes
        (:func:`probe_together`), in place of this run's own probe."""
        ss = state.server_state
        if ss.warmup_rounds is not None:
            if not self._pruned:  # a run resumed after its decision: no snapshot is needed
                self._prune(())
            return state
        rec = self.record(state)
        t = state.round
        if rec["stopped_at"] is None:
            if self.is_probe_round(t) and t not in rec["snapshots"]:
                start = time.perf_counter()
                save_checkpoint(snapshot_path(self.run_dir, t), state,
                                {"elapsed": self.log.elapsed})
                if probed is None:
                    curve = self.probe(state)
                else:
                    curve, seconds = probed
                    start -= seconds
                rec["snapshots"].append(t)
                rec["curves"].append(curve)
                sel, stop = self.selector(rec)
                rows = [(t, "global", "probe_prediction", sel.predictions[-1]),
                        (t, "global", "probe_loss_start", curve[0]),
                        (t, "global", "probe_loss_end", curve[-1])]
                self.log.metrics.append([(*r, "warmup") for r in rows] if self.log.tag_stage
                                        else rows)
                if stop:
                    rec["stopped_at"] = t
                seconds = time.perf_counter() - start
                rec["probe_seconds"] += seconds
                self.log.elapsed += seconds
                self._save(state)
                self._prune(self._candidates(sel))
            elif t >= self.total:
                rec["stopped_at"] = self.total
                rec["continuing_loss"] = self.objective(state.global_params)
            if rec["stopped_at"] is None:
                return state
        sel, _ = self.selector(rec)
        return self.decide(state, sel.choose(rec["stopped_at"], rec["continuing_loss"]))

    # -- the probe ----------------------------------------------------------------------------
    def draws(self) -> list[RoundDraws]:
        """Probe rounds s = 1..r: the same clients, minibatches and dropout seed for every
        probe (common random numbers)."""
        if self._draws is None:
            fed, cfg = self.fed, self.fed.cfg
            self._draws = []
            for s in range(1, self.params.probe_rounds + 1):
                ids = sample_clients(self.sampling_seed, s, fed.partition.num_clients,
                                     cfg.train.clients_per_round)
                dropout = int(np.random.SeedSequence(
                    [cfg.role_seed("training"), PROBE_STREAM, s]).generate_state(1)[0])
                self._draws.append(RoundDraws(ids, self.planner.plan(ids, s), dropout))
        return self._draws

    def fork(self, state: FedState) -> FedState:
        """A copy of ``state`` frozen from its round on (the main state is not touched)."""
        ss = copy.deepcopy(state.server_state)
        ss.probe = None
        ss.warmup_rounds = state.round
        return FedState(state.round, dict(state.global_params),
                        copy.deepcopy(state.client_state), ss, state.prev_grad_norm_last,
                        copy.deepcopy(state.plateau))

    def fork_work(self, fork: FedState, s: int, start: int):
        """Probe round ``s`` of the continuation forked at round ``start``: its round index
        (the lr of round min(start + s, T)) and its planned work on the common draws."""
        rnd = min(start + s, self.total)
        return rnd, self.fed.begin_round(fork, rnd, draws=self.draws()[s - 1])

    def fork_round(self, fork: FedState, rnd: int, draws: RoundDraws) -> FedState:
        """One frozen round of a probe continuation (round ``rnd``'s plan and lr)."""
        fed = self.fed
        work = fed.begin_round(fork, rnd, draws=draws)
        results = fed.train_job(work.job)
        fed.model.eval()
        return fed.update_round(fork, rnd, work, results)[0]

    def probe(self, state: FedState) -> list[float]:
        """The validation objective after s = 0..r frozen rounds forked from ``state``."""
        fork = self.fork(state)
        curve = [self.objective(fork.global_params)]
        for s, draws in enumerate(self.draws(), start=1):
            fork = self.fork_round(fork, min(state.round + s, self.total), draws)
            curve.append(self.objective(fork.global_params))
        return curve

    def objective(self, params) -> float:
        """Mean validation cross-entropy plus (weight_decay / 2) ||theta||^2."""
        fed = self.fed
        loss, _ = evaluate(lambda xb: fed.algorithm.forward(fed.model, params, xb),
                           fed.x_val, fed.y_val, fed.cfg.eval.batch_size, fed.autocast)
        value = float(loss.mean())
        wd = fed.optimizer.weight_decay
        if wd:
            value += 0.5 * wd * sum(float(p.double().pow(2).sum()) for p in params.values())
        return value

    # -- the decision -------------------------------------------------------------------------
    def decide(self, state: FedState, choice: ProbeChoice) -> FedState:
        """T0 = the chosen snapshot: roll back to it (or keep the run at T0 = T)."""
        rec = self.record(state)
        t0, stopped = choice.warmup_rounds, rec["stopped_at"]
        frozen = self.total - t0
        used = {"warmup": stopped, "probe": choice.probe_rounds_used, "frozen": frozen,
                "discarded": stopped - t0}
        used["fedavg_equivalent"] = (stopped + choice.probe_rounds_used + frozen) / self.total
        rec["summary"] = {
            "warmup_rounds": t0, "stopped_at": stopped, "snapshots": list(choice.snapshots),
            "predictions": list(choice.predictions), "predicted_loss": choice.predicted_loss,
            # every probe's validation curve l_t(0..r): the selection replays from these alone
            "curves": [[float(v) for v in c] for c in rec["curves"]],
            "continuing_loss": rec["continuing_loss"], "rate": choice.rate,
            "probe_rounds_used": choice.probe_rounds_used, "rounds_computed": used,
            "probe_seconds": rec["probe_seconds"], "probe_interval": self.interval,
            "probe_rounds": self.params.probe_rounds}
        if t0 < stopped:
            snap, _, rng = load_checkpoint(snapshot_path(self.run_dir, t0), self.fed.device)
            restore_rng_states(rng)
            snap.server_state.probe = rec
            state = snap
            self._discard(t0)
        state.server_state.warmup_rounds = t0
        self._save(state)
        self._prune(())
        if t0 < stopped:
            self.log.bar.n = t0
            self.log.bar.refresh()
        return state

    def _discard(self, t0: int) -> None:
        """Rows of rounds > t0 move from metrics.csv to probe_discarded.csv; their timings go.
        Written first, then truncated: a run killed between the two moves them again."""
        metrics = self.run_dir / "metrics.csv"
        later = rundir.rows_after(metrics, t0)
        if later:
            header = rundir.header_of(metrics)
            rundir.write_text(self.run_dir / DISCARDED_FILE, header + "".join(later))
        for name in ("metrics.csv", "timings.csv"):
            rundir.truncate_rows(self.run_dir / name, t0)

    def _save(self, state: FedState) -> None:
        save_checkpoint(self.run_dir / "checkpoints" / "last.pt", state,
                        {"elapsed": self.log.elapsed})
        self.log.saved_round = state.round

    def _candidates(self, sel: ProbeSelector) -> tuple[int, ...]:
        """Snapshots that can still be chosen: the best of the smoothed predictions that are
        final (all but the newest, whose median waits for the next), and the newest (``choose``
        takes the best by :func:`~linattn_theory.probe.best_snapshot` under the selector's
        tie-break, a total order, and later predictions never change final ones).
        The oldest smoothed value follows the trend of the next two medians (the end-point
        rule of :func:`linattn_theory.probe.smoothed`), final from the fourth prediction on:
        until then every snapshot stays."""
        snaps = sel.snapshots
        if len(snaps) < 4:
            return tuple(snaps)
        final = smoothed(sel.predictions)[:-1]
        return (snaps[best_snapshot(final, sel.predictions[:-1], sel.tie_break)], snaps[-1])

    def _prune(self, keep) -> None:
        folder = self.run_dir / "checkpoints"
        for path in folder.glob("probe_*.pt"):
            stem = path.stem.removeprefix("probe_")
            if stem.isdigit() and int(stem) not in keep:
                path.unlink(missing_ok=True)
        self._pruned = not keep


def probe_together(items: list[tuple[ProbeDriver, FedState]], stacked, pad_clients=None
                   ) -> list[tuple[list[float], float] | Exception]:
    """The probe continuations of several runs of a stacked group, forked at the same group
    round: probe round s of every run's continuation in one engine call
    (:func:`real_data.stacking.train_jobs`, clients of every run on one axis), each run's
    validation objective after every round. Per run, its curve and its share of the seconds
    (by clients), or the exception that ended its continuation (a
    :class:`~real_data.federation.Diverged` server update, or an error of its own); the other
    runs go on. Each curve is the one :meth:`ProbeDriver.probe` gives alone, up to the
    summation order of the batched kernels: a run's curve depends on which runs probe beside
    it, so a group resumed after a kill probes again beside the same runs (the group's
    ``companions``, see :mod:`real_data.stacked_runs`)."""
    start = time.perf_counter()
    out: list = [None] * len(items)
    forks: list = [None] * len(items)
    curves: list[list[float]] = [[] for _ in items]
    for i, (d, st) in enumerate(items):
        try:
            forks[i] = d.fork(st)
            curves[i].append(d.objective(forks[i].global_params))
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - this run's continuation ends, not others'
            out[i] = exc
    clients = [0.0] * len(items)
    for s in range(1, max(d.params.probe_rounds for d, _ in items) + 1):
        live = [i for i, (d, _) in enumerate(items)
                if out[i] is None and s <= d.params.probe_rounds]
        if not live:
            break
        works = [(i, *items[i][0].fork_work(forks[i], s, items[i][1].round)) for i in live]
        trained = probe_step([w.job for _, _, w in works],
                             [items[i][0].fed.engine for i, _, _ in works], stacked, pad_clients)
        for (i, rnd, work), res in zip(works, trained):
            fed = items[i][0].fed
            fed.model.eval()
            clients[i] += len(work.ids)
            try:
                forks[i] = fed.update_round(forks[i], rnd, work, res)[0]
                curves[i].append(items[i][0].objective(forks[i].global_params))
            except UserError:
                raise  # a bad config or file stops the group
            except Exception as exc:  # noqa: BLE001 - this run's continuation ends, not others'
                out[i] = exc
    seconds = time.perf_counter() - start
    total = sum(clients) or 1.0
    return [out[i] if out[i] is not None else (curves[i], seconds * clients[i] / total)
            for i in range(len(items))]


def probe_step(jobs, engines, stacked, pad_clients=None):
    """One probe round of every continuation in :func:`probe_together` (one engine call where
    they can share it)."""
    from real_data.stacking import train_jobs

    return train_jobs(jobs, engines, stacked, pad_clients=pad_clients)
