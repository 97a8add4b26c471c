"""Tuning on a validation split, then the chosen configurations over every seed.

A plan with a ``tune`` section runs in two stages, in one folder::

    tune: {seed: 100, last: 5, validation_fraction: 0.1}
    seeds: [0, 1, 2, 3, 4]
    sweeps:
      - name: fmnist_softmax
        config: fmnist_vit
        alphas: [0.1]
        grid:                          # every arm of the sweep: the same budget
          train.lr: [0.02, 0.05, 0.1]
          train.lr_schedule: [{kind: constant}, {kind: cosine},
                              {kind: step, milestones: [0.75], factor: 0.1}]
        arms:
          - {name: fedavg, overrides: [algorithm.name=fedavg]}
          - {name: fedprox, overrides: [algorithm.name=fedprox],
             grid: {algorithm.mu: [0.001, 0.01, 0.1]}}     # added to the sweep's grid
          - {name: fedfrozen_v, overrides: [algorithm.name=fedfrozen, algorithm.train=v],
             warmup_rounds: [20, 50, 100, 150]}            # T0 is tuned too

1. **Tuning** (:func:`tuning_plan`): every grid point of every arm (and every T0 of a T0 arm,
   branched from one warm-up as usual) on the single seed ``tune.seed``, with each client's
   ``validation_fraction`` held out (``partition.validation_fraction``) and ``eval.test=false``:
   the tuning runs never read the test set. Arm ``<arm>`` at grid point i is ``<arm>+<i>``.
2. **Choice** (:func:`choose`): per sweep, arm and alpha, the grid point and T0 with the best
   score, the mean of the last ``tune.last`` evaluations of ``tune.metric`` (``val_acc``,
   highest; ``val_loss``, lowest); a diverged candidate scores worst; ties go to the first
   candidate in grid order. Every candidate's score is written to ``<out_dir>/choices.json``.
3. **Final runs** (:func:`final_plan`): the chosen configuration of every arm over the plan's
   ``seeds``, with the same validation split held out (the data each arm was tuned on) and the
   test set evaluated; reference arms (``reference: true``) run here only. The comparison
   (:func:`real_data.study.tables.compare`) reads these runs.

Every arm gets the same grid budget (the sweep's grid; an arm's own ``grid`` adds keys of its
own, such as FedProx's mu). The tuning seed should differ from the final seeds, so the final
partitions and initializations are not the ones the choice was made on.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import numpy as np

from linattn.errors import ConfigError
from linattn.fileio import atomic_write_json
from real_data.study.plan import (
    PERSONAL_METRICS,
    Arm,
    Plan,
    Sweep,
    higher_is_better,
    inside,
    override_value,
    plan_runs,
    run_key,
    with_same_runs,
)
from real_data.study.runner import run_status

CHOICES_FILE = "choices.json"
# a sweep with ``score: personal`` is tuned on every client's own validation samples at the
# last round: after eval.finetune's local round where the run fine-tunes (one value, at the
# end), else under the run's own evaluation parameters (a personalized method's models; the
# global model otherwise), its last evaluation, so every arm is read at the same round
PERSONAL = "personal"


def grid_points(sweep: Sweep, arm: Arm) -> list[tuple[str, ...]]:
    """The arm's grid points as override tuples, in grid order (the sweep's grid with the
    arm's own keys added or replacing the sweep's); ``[()]`` without a grid."""
    merged = dict(sweep.grid)
    merged.update(dict(arm.grid))
    keys = sorted(merged)
    return [tuple(f"{k}={_override_value(v)}" for k, v in zip(keys, combo))
            for combo in itertools.product(*(merged[k] for k in keys))]


def _override_value(value) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value)  # numbers, lists and mappings: YAML flow that load_yaml reads


def _held_out(plan: Plan) -> tuple[str, ...]:
    return (f"partition.validation_fraction={plan.tune.validation_fraction}",)


def _tuned_arm(arm: Arm, i: int) -> str:
    return f"{arm.name}+{i}"


def _need_tune(plan: Plan) -> None:
    if plan.tune is None:
        raise ConfigError(f"plan {plan.name} has no 'tune' section; add tune: {{seed: 0, "
                          "last: 5, validation_fraction: 0.1}} and a grid")


def _only_candidate(plan: Plan, sweep: Sweep, arm: Arm) -> bool:
    """An arm with one grid point and at most one T0 has nothing to choose, so it takes no
    tuning run; except FedAvg in a sweep that has a reference sweep or is one, whose
    validation score measures the shift's difficulty (:mod:`~real_data.study.difficulty`)."""
    if len(grid_points(sweep, arm)) * max(1, len(arm.warmup_rounds)) != 1:
        return False
    measured = {sw.name for sw in plan.sweeps if sw.reference_sweep} | {
        sw.reference_sweep for sw in plan.sweeps if sw.reference_sweep}
    return not (arm.name == "fedavg" and sweep.name in measured)


def tuning_plan(plan: Plan) -> Plan:
    """The tuning stage's runs: every grid point of every non-reference arm with more than
    one candidate (:func:`_only_candidate`), on ``tune.seed``, scored on validation only."""
    _need_tune(plan)
    extra = (*_held_out(plan), "eval.test=false")
    sweeps = []
    for sw in plan.sweeps:
        arms = tuple(Arm(_tuned_arm(arm, i), (*arm.overrides, *point, *extra),
                         arm.warmup_rounds)
                     for arm in sw.arms
                     if not arm.reference and not _only_candidate(plan, sw, arm)
                     for i, point in enumerate(grid_points(sw, arm)))
        sweeps.append(dataclasses.replace(sw, arms=arms, seeds=(plan.tune.seed,), grid=()))
    return dataclasses.replace(plan, name=f"{plan.name}-tune", sweeps=tuple(sweeps), tune=None)


def tuning_runs(plan: Plan, arms: set | None = None) -> list:
    """The tuning stage's runs (:func:`tuning_plan`), each named by the arm it tunes
    (``fedavg`` for the grid point ``fedavg+1``), so their measured paces price that arm's
    final runs; only the (sweep, arm) pairs in ``arms`` where given."""
    tuned = {(sw.name, _tuned_arm(arm, i)): arm for sw in plan.sweeps for arm in sw.arms
             for i in range(len(grid_points(sw, arm)))}
    runs = []
    for s in plan_runs(tuning_plan(plan)):
        arm = tuned[s.sweep.name, s.arm.name]
        if arms is None or (s.sweep.name, arm.name) in arms:
            runs.append(dataclasses.replace(s, arm=dataclasses.replace(s.arm, name=arm.name)))
    return runs


def _score(run_dir: Path, metric: str, last: int, head: Path | None = None
           ) -> tuple[float | None, str]:
    """(score, status): the mean of the last ``last`` values of ``metric``; ``None`` unless
    the run is final and its metrics are here (a ``--markers`` summary alone has none).
    ``head``: the T0 family's warm-up run this branch forks from; when it diverged before the
    branch's T0 (no snapshot), the branch is the same diverged trajectory and scores as
    diverged."""
    status = run_status(run_dir)
    worst = -np.inf if higher_is_better(metric) else np.inf
    if status in ("missing", "partial") and head is not None and head != run_dir \
            and run_status(head) == "diverged" and \
            not (head / "checkpoints" / f"round_{_t0_of(run_dir)}.pt").is_file():
        return worst, "diverged"
    if status not in ("completed", "diverged"):
        return None, status
    if not (run_dir / "metrics.csv").is_file():  # a finished-elsewhere marker: no scores here
        return (worst, status) if status == "diverged" else (None, "marker")
    wanted = PERSONAL_METRICS["val"] if metric == PERSONAL else (metric,)
    found: dict[str, list] = {m: [] for m in wanted}
    with open(run_dir / "metrics.csv", newline="") as fh:
        import csv

        for row in csv.DictReader(fh):
            if row["client"] == "global" and row["metric"] in found:
                found[row["metric"]].append((int(row["round"]), float(row["value"])))
    # personal: the fine-tuned models' score where the run fine-tunes, else its own models'
    values = next((found[m] for m in wanted if found[m]), [])
    if status == "diverged" or not values:
        return worst, status
    tail = [v for _, v in sorted(values)[-last:]]
    score = float(np.mean(tail))
    return (score if np.isfinite(score) else worst), status


def _t0_of(run_dir: Path) -> int:
    """T0 of a family member's directory ``.../<arm>-T0=<t>/<alpha>/<seed>``."""
    return int(run_dir.parents[1].name.rsplit("-T0=", 1)[1])


def choose(plan: Plan, write: bool = True, partial: bool = False) -> dict:
    """The chosen grid point and T0 of every (sweep, arm, alpha), from the finished tuning
    runs; raises ConfigError naming the missing runs while tuning is unfinished. With
    ``partial``, a (sweep, arm, alpha) whose tuning is unfinished is left out instead and
    listed under ``"unfinished"`` with the number of its runs not final. With ``write``, the
    whole table goes to ``<out_dir>/choices.json``."""
    _need_tune(plan)
    tune = plan.tune
    out, missing, marked = {"metric": tune.metric, "last": tune.last, "seed": tune.seed,
                            "choices": []}, [], []
    unfinished = []
    for sw in plan.sweeps:
        metric = PERSONAL if sw.score == PERSONAL else tune.metric
        higher = higher_is_better(metric)
        for arm in sw.arms:
            if arm.reference:
                continue
            points = grid_points(sw, arm)
            if _only_candidate(plan, sw, arm):  # chosen without a tuning run: no score
                only = {"grid_point": 0, "overrides": list(points[0]),
                        "warmup_rounds": (arm.warmup_rounds or (None,))[0], "score": None,
                        "status": "only candidate"}
                out["choices"] += [{"sweep": sw.name, "arm": arm.name, "alpha": alpha,
                                    "metric": metric, "chosen": only, "candidates": [only]}
                                   for alpha in sw.alphas]
                continue
            for alpha in sw.alphas:
                cands = []
                for i, point in enumerate(points):
                    head = None
                    if arm.warmup_rounds:  # the family's warm-up run: the largest T0
                        head = inside(plan.out_dir, run_key(sw.name, _tuned_arm(arm, i),
                                                            max(arm.warmup_rounds), alpha,
                                                            tune.seed))
                    for t0 in arm.warmup_rounds or (None,):
                        key = run_key(sw.name, _tuned_arm(arm, i), t0, alpha, tune.seed)
                        score, status = _score(inside(plan.out_dir, key), metric,
                                               1 if metric == PERSONAL else tune.last, head)
                        if score is None:
                            (marked if status == "marker" else missing).append(key)
                            continue
                        cands.append({"grid_point": i, "overrides": list(point),
                                      "warmup_rounds": t0, "score": score, "status": status})
                need = len(points) * len(arm.warmup_rounds or (None,))
                if len(cands) < need:
                    unfinished.append({"sweep": sw.name, "arm": arm.name, "alpha": alpha,
                                       "runs_not_final": need - len(cands)})
                    continue
                best = (max if higher else min)(cands, key=lambda c: c["score"])
                if best["status"] == "diverged":
                    raise ConfigError(f"every tuning run of {sw.name}/{arm.name} (alpha "
                                      f"{alpha}) diverged; lower the grid's learning rates")
                out["choices"].append({"sweep": sw.name, "arm": arm.name, "alpha": alpha,
                                       "metric": metric, "chosen": best, "candidates": cands})
    if partial:
        out["unfinished"] = unfinished
    elif marked:
        raise ConfigError(f"tuning of plan {plan.name}: {len(marked)} run(s) finished elsewhere "
                          f"are here only as markers, without their metrics (e.g. {marked[0]});"
                          " unpack their --pack archive into the plan's out_dir, or pass "
                          "--choices with the choices.json the tuning wrote")
    elif missing:
        raise ConfigError(f"tuning of plan {plan.name} is unfinished: {len(missing)} run(s) "
                          f"not final, e.g. {missing[0]}; run `linattn study --plan ... "
                          "--stage tune` first")
    if write:
        write_choices(plan, out)
    return out


def write_choices(plan: Plan, choices: dict) -> Path:
    """``<out_dir>/choices.json``: the table :func:`choose` returns."""
    dest = inside(plan.out_dir, CHOICES_FILE)
    atomic_write_json(dest, _plain(choices), indent=1)
    return dest


def _plain(value):
    if isinstance(value, float) and not np.isfinite(value):
        return None if np.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def final_plan(plan: Plan, choices: dict | None = None, partial: bool = False) -> Plan:
    """The final stage's runs: every arm at its chosen grid point and T0 (one sweep per alpha,
    since the choice is made per alpha) over the plan's seeds, test set evaluated.

    ``choices``: a table as :func:`choose` writes it (e.g. read by :func:`load_choices`);
    default, chosen from the tuning runs (nothing written: :func:`write_choices` stores a
    table). With ``partial``, an arm without a choice (its
    tuning unfinished, or absent from ``choices``) is left out, and so is a sweep and alpha
    left with no arm to compare.

    An arm whose chosen configuration trains exactly as an earlier arm's (FedFrozen choosing
    never to freeze at FedAvg's lr and schedule) trains no runs of its own: it reads that
    arm's (``Arm.same_as``, :func:`real_data.study.plan.with_same_runs`)."""
    choices = choose(plan, False, partial) if choices is None else choices
    chosen = {(c["sweep"], c["arm"], c["alpha"]): c["chosen"] for c in choices["choices"]}
    sweeps = []
    for sw in plan.sweeps:
        for alpha in sw.alphas:
            arms = []
            for arm in sw.arms:
                if arm.reference:
                    arms.append(dataclasses.replace(
                        arm, overrides=(*arm.overrides, *_held_out(plan)), grid=()))
                    continue
                c = chosen.get((sw.name, arm.name, alpha))
                if c is None:
                    if partial:
                        continue
                    raise ConfigError(f"no chosen configuration for {sw.name}/{arm.name} "
                                      f"(alpha {alpha}); finish its tuning runs, or pass "
                                      "choices that include it")
                t0 = c["warmup_rounds"]
                arms.append(Arm(arm.name, (*arm.overrides, *c["overrides"], *_held_out(plan)),
                                () if t0 is None else (int(t0),)))
            if any(not a.reference for a in arms):
                sweeps.append(with_same_runs(dataclasses.replace(
                    sw, alphas=(alpha,), arms=tuple(arms), grid=()), plan.out_dir))
    return dataclasses.replace(plan, sweeps=tuple(sweeps), tune=None)


def load_choices(path: Path | str, plan: Plan) -> dict:
    """A choices table written by :func:`choose` (``<out_dir>/choices.json``, or its copy
    exported with the study's tables), checked against ``plan``: every entry names a sweep,
    arm and alpha of the plan, its overrides are one of that arm's grid points and its T0 one
    of the arm's T0 values; the metric, ``last`` and tuning seed are the plan's."""
    _need_tune(plan)
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--choices {path}: no such file; pass the choices.json that the "
                          "tuning stage wrote (in the study's out_dir)") from None
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--choices {path}: not a readable JSON file ({exc})") from None

    def bad(what: str) -> ConfigError:
        return ConfigError(f"--choices {path}: {what}; it must be the choices.json the tuning "
                           f"stage of plan {plan.name} wrote")

    if not isinstance(raw, dict) or not isinstance(raw.get("choices"), list):
        raise bad("no 'choices' list")
    tune = plan.tune
    for key, want in (("metric", tune.metric), ("last", tune.last), ("seed", tune.seed)):
        if raw.get(key) != want:
            raise bad(f"{key} is {raw.get(key)!r}, the plan's tune section says {want!r}")
    arms = {(sw.name, arm.name, alpha): (sw, arm) for sw in plan.sweeps for arm in sw.arms
            if not arm.reference for alpha in sw.alphas}
    seen = set()
    for i, c in enumerate(raw["choices"]):
        try:
            key = (c["sweep"], c["arm"], c["alpha"])
            ch = c["chosen"]
            overrides, t0 = tuple(ch["overrides"]), ch["warmup_rounds"]
        except (KeyError, TypeError):
            raise bad(f"entry {i} lacks sweep, arm, alpha or chosen overrides and "
                      "warmup_rounds") from None
        if key not in arms:
            raise bad(f"entry {i}: {key[0]}/{key[1]} (alpha {key[2]}) is not an arm of the "
                      "plan")
        if key in seen:
            raise bad(f"entry {i}: {key[0]}/{key[1]} (alpha {key[2]}) is chosen twice")
        seen.add(key)
        sw, arm = arms[key]
        if overrides not in grid_points(sw, arm):
            raise bad(f"entry {i}: overrides {list(overrides)} are not a grid point of "
                      f"{key[0]}/{key[1]}")
        if t0 not in (list(arm.warmup_rounds) or [None]):
            raise bad(f"entry {i}: warmup_rounds {t0!r} is not one of {key[0]}/{key[1]}'s "
                      f"T0 values {list(arm.warmup_rounds)}")
    return raw


def export_choices(plan: Plan, folder: Path | str, choices: dict | None = None) -> Path:
    """Write the choices the final stage uses to ``<folder>/choices.json``: ``choices`` (a
    table read by :func:`load_choices`) or the one in ``<out_dir>/choices.json``."""
    if choices is None:
        choices = json.loads(inside(plan.out_dir, CHOICES_FILE).read_text())
    dest = Path(folder) / CHOICES_FILE
    atomic_write_json(dest, _plain(choices), indent=1)
    return dest


def _schedule_label(overrides) -> str | None:
    """``constant``, ``cosine``, ``step@0.75x0.1``...: the schedule a grid point sets, or None
    where the grid has no schedule axis."""
    s = override_value(overrides, "train.lr_schedule")
    if s is None:
        return None
    kind = s.get("kind", "constant") if isinstance(s, dict) else str(s)
    if kind == "step" and isinstance(s, dict):
        return f"step@{','.join(str(m) for m in s.get('milestones', []))}x{s.get('factor')}"
    return kind


def schedule_gains(choices: dict, against: str = "fedavg") -> list[dict]:
    """What a decaying learning rate and what freezing gain on the validation split, from the
    tuning candidates in ``choices`` (as :func:`choose` writes them; higher is better for an
    accuracy metric). Per sweep, alpha and arm: the best candidate at a constant lr and the
    best with a decaying schedule (over lr, the arm's own grid keys and T0), the decay's gain
    (decayed minus constant), and the arm's lead over ``against`` at a constant lr and with
    both tuned over every schedule. Scores are on the tuning seed's validation split, which
    chose the configurations; they say where a gain lies, the final runs test it.
    Empty where the grid has no schedule axis; an arm whose every candidate diverged (no finite
    score) has no row."""
    def sign_of(c) -> float:  # an entry's own metric (a personal sweep's), else the table's
        metric = c.get("metric") or choices.get("metric", "val_acc")
        return 1.0 if higher_is_better(metric) else -1.0

    def top(pool):
        return max(pool, key=lambda x: sign * float(x["score"])) if pool else None

    rows, best, signs = [], {}, {}
    for c in choices.get("choices", []):
        sign = signs[(c["sweep"], c["alpha"])] = sign_of(c)
        cands = [x for x in c.get("candidates") or []
                 if x.get("score") is not None and np.isfinite(float(x["score"]))]
        labels = [_schedule_label(x["overrides"]) for x in cands]
        if not cands or any(lb is None for lb in labels):
            continue

        const = top([x for x, lb in zip(cands, labels) if lb == "constant"])
        decay = top([x for x, lb in zip(cands, labels) if lb != "constant"])
        row = {"sweep": c["sweep"], "alpha": c["alpha"], "arm": c["arm"]}
        for name, x in (("constant", const), ("decay", decay)):
            row[f"{name}_score"] = None if x is None else float(x["score"])
            row[f"{name}_lr"] = None if x is None else override_value(x["overrides"],
                                                                       "train.lr")
            row[f"{name}_T0"] = None if x is None else x.get("warmup_rounds")
            row[f"{name}_schedule"] = None if x is None else _schedule_label(x["overrides"])
        row["decay_gain"] = None if const is None or decay is None else \
            sign * (float(decay["score"]) - float(const["score"]))
        row["best_score"] = float(top(cands)["score"])
        rows.append(row)
        best[(c["sweep"], c["alpha"], c["arm"])] = row
    for row in rows:
        sign = signs[(row["sweep"], row["alpha"])]
        ref = best.get((row["sweep"], row["alpha"], against))
        for name, key in (("vs_against_constant", "constant_score"),
                          ("vs_against_best", "best_score")):
            row[name] = None if ref is None or row["arm"] == against or \
                row[key] is None or ref[key] is None else sign * (row[key] - ref[key])
    return rows


def write_schedule_gains(choices: dict, folder: Path | str,
                         against: str = "fedavg") -> list[Path]:
    """:func:`schedule_gains` as ``schedule_gain.{csv,md}`` in ``folder`` (points for an
    accuracy metric); nothing where the grid has no schedule axis."""
    import csv
    import io

    from linattn.fileio import atomic_write_text

    rows = schedule_gains(choices, against)
    folder = Path(folder)
    if not rows:  # no schedule axis: no table, and none left from an earlier export
        for name in ("schedule_gain.csv", "schedule_gain.md"):
            (folder / name).unlink(missing_ok=True)
        return []
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(rows[0]), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(folder / "schedule_gain.csv", buf.getvalue())
    acc = higher_is_better(choices.get("metric", "val_acc"))
    scale, unit = (100.0, "points") if acc else (1.0, "loss units, positive = lower loss")

    def pts(x):
        return "" if x is None else f"{scale * x:+.2f}"

    def cfg(r, name):
        t0 = r[f"{name}_T0"]
        return (f"{scale * r[f'{name}_score']:.2f} (lr {r[f'{name}_lr']}"
                f"{'' if name == 'constant' else ', ' + str(r[f'{name}_schedule'])}"
                f"{'' if t0 is None else ', T0 ' + str(t0)})") if r[f"{name}_score"] is not None \
            else ""

    lines = [f"Validation {choices.get('metric', 'val_acc')} of the tuning seed (mean of the "
             f"last {choices.get('last')} evaluations), best over the grid; differences in "
             f"{unit}. decay gain: the best decayed schedule against the best constant lr; "
             f"vs {against}: the arm's best against {against}'s best, at a constant lr and "
             "with every schedule (a freezing arm's best includes never freezing where its "
             "T0 grid holds T). These scores made the choices; the final runs' paired "
             "comparison tests them.",
             "",
             "| sweep | alpha | arm | best constant lr | best decayed | decay gain | "
             f"vs {against}, constant lr | vs {against}, any schedule |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        alpha = "natural" if r["alpha"] is None else r["alpha"]
        lines.append(f"| {r['sweep']} | {alpha} | {r['arm']} | {cfg(r, 'constant')} | "
                     f"{cfg(r, 'decay')} | {pts(r['decay_gain'])} | "
                     f"{pts(r['vs_against_constant'])} | {pts(r['vs_against_best'])} |")
    atomic_write_text(folder / "schedule_gain.md", "\n".join(lines) + "\n")
    return [folder / "schedule_gain.csv", folder / "schedule_gain.md"]
