"""A study's results: per-run rows, mean +- std over seeds, paired differences, tables, archives.

Aggregation reads every run's ``metrics.csv`` (global rows) and ``summary.json``; the Q/K
kernel deviation reads the warm-up snapshots of a T0 family and of the sweep's reference arm.
"""

from __future__ import annotations

import csv
import io
import json
import tarfile
import zlib
from pathlib import Path

import numpy as np

from linattn.configio import load_yaml
from linattn.errors import DataError
from linattn.fileio import atomic_path, atomic_write_text
from real_data.study.plan import (
    PERSONAL_METRICS,
    Arm,
    Plan,
    Sweep,
    override_value,
    plan_runs,
    run_config,
    run_key,
    same_runs,
    stage_runs,
)
from real_data.study.runner import FINAL, MARKER_FILES, config_mismatch, families, run_status

LAST_ROUNDS = 10  # window for the accuracy variance: the last 10 evaluations (eval.every apart)
SCORE_LAST = 5  # a run's score: the mean test accuracy of its last 5 evaluations


def _read_metrics(run_dir: Path) -> dict[str, np.ndarray]:
    """Global metrics as arrays indexed by round (1..R)."""
    series: dict[str, dict[int, float]] = {}
    with open(run_dir / "metrics.csv", newline="") as fh:
        for row in csv.DictReader(fh):
            if row["client"] != "global":
                continue
            series.setdefault(row["metric"], {})[int(row["round"])] = float(row["value"])
    out = {}
    for name, values in series.items():
        rounds = sorted(values)
        out[name] = np.array([values[r] for r in rounds])
        out[name + "@rounds"] = np.array(rounds)
    return out


def _snapshot_params(path: Path) -> dict:
    """A snapshot's global parameters; a file that does not load (a run folder unpacked from
    an archive missing its last part, say) is a :class:`DataError` naming it."""
    from real_data.checkpoint import read_payload  # torch only here: other commands skip it

    payload = read_payload(path, "cpu", "unpack its run again from a complete archive, or "
                           "remove the run's folder so that the study trains it again")
    if not isinstance(payload, dict) or "global_params" not in payload:
        raise DataError(f"{path}: not a linattn checkpoint (no global_params); a snapshot is "
                        "a run's checkpoints/round_<t>.pt")
    return payload["global_params"]


def kernel_deviation(snapshot_a: Path, snapshot_b: Path, heads: int) -> float:
    """sqrt(sum over layers and heads of ||M_h - M'_h||_F^2), M_h = W_q[h]^T W_k[h].

    The kernel between tokens a and b in head h is a^T W_q[h]^T W_k[h] b (rows of the q and k
    projections split by head), so M_h is the attention kernel of THEORY.md per head.
    """
    pa, pb = _snapshot_params(snapshot_a), _snapshot_params(snapshot_b)
    total = 0.0
    for name in sorted(pa):
        if not name.endswith("attn.q.weight"):
            continue
        kname = name[: -len("q.weight")] + "k.weight"
        for params in ((pa, pb),):
            qa, ka = params[0][name].double(), params[0][kname].double()
            qb, kb = params[1][name].double(), params[1][kname].double()
            for h in range(heads):
                rows = slice(h * qa.shape[0] // heads, (h + 1) * qa.shape[0] // heads)
                diff = qa[rows].T @ ka[rows] - qb[rows].T @ kb[rows]
                total += float((diff**2).sum())
    return float(np.sqrt(total))


def run_row(run_dir: Path) -> dict | None:
    """The metrics of one finished run directory (the score, costs, the T0 it decided), or
    None while it is not completed or diverged."""
    status = run_status(run_dir)
    if status not in ("completed", "diverged"):
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    m = _read_metrics(run_dir)
    acc = m.get("test_acc", np.array([np.nan]))
    best_i = int(np.nanargmax(acc)) if np.any(np.isfinite(acc)) else -1
    val = m.get("val_acc", np.array([np.nan]))
    row = {
        "final_acc": float(acc[-1]),
        "best_acc": float(acc[best_i]),
        "rounds_to_best": int(m["test_acc@rounds"][best_i]) if "test_acc@rounds" in m else 0,
        "score": float(np.mean(acc[-SCORE_LAST:])),
        "val_score": float(np.mean(val[-SCORE_LAST:])),
        "last_acc_var": float(np.var(acc[-LAST_ROUNDS:])),
        "personal_acc": float(m["local_acc_micro"][-1]) if "local_acc_micro" in m else np.nan,
        "grad_norm_jump": float(np.nanmean(m["grad_norm_jump"])) if "grad_norm_jump" in m
        else np.nan,
        "bytes_up": float(np.sum(m.get("bytes_up", [np.nan]))),
        "bytes_down": float(np.sum(m.get("bytes_down", [np.nan]))),
        "train_flops": float(np.sum(m.get("train_flops", [np.nan]))),
        "seconds_per_round": float(summary.get("seconds_per_round", np.nan)),
        "device": summary.get("device", {}).get("name", ""),
        "device_type": summary.get("device", {}).get("type", ""),
        # worker processes that shared the device (NaN where the run did not record it)
        "device_workers": float(summary.get("device", {}).get("workers", np.nan)),
        "status": status,
        # the T0 a run decided itself (warmup=auto or an online freeze rule; T where it never
        # froze), NaN for a fixed T0 or no warm-up
        "decided_T0": float((summary.get("warmup") or {}).get("warmup_rounds", np.nan)
                            if (summary.get("warmup") or {}).get("warmup_rounds") is not None
                            else np.nan),
        **_warmup_costs(summary),
    }
    # the personalized score: every client's own model on its own test (validation) samples
    # at the last round, after eval.finetune's local round where the run fine-tunes (made once,
    # at the end), else under the run's own evaluation parameters: every arm read at one round
    for key, (ft, own) in (("personal_score", PERSONAL_METRICS["test"]),
                           ("personal_val_score", PERSONAL_METRICS["val"])):
        series = m.get(ft) if ft in m else m.get(own)
        row[key] = float(series[-1]) if series is not None else np.nan
    if status == "diverged":  # no score: counted apart (``compare``'s diverged columns)
        for key in ("final_acc", "best_acc", "score", "val_score", "personal_score",
                    "personal_val_score"):
            row[key] = float("nan")
    return row


def _warmup_costs(summary: dict) -> dict:
    """What deciding T0 cost a run, from its ``summary.json``: ``rounds`` (the horizon T),
    ``fired`` (1.0 when an online rule or the probe estimator froze before T, 0.0 when it
    never did, NaN for a fixed T0), ``rule_seconds`` (the rule's or the probes' own wall time),
    ``rule_state_bytes`` (the state the rule keeps) and ``compute_ratio`` (the training rounds
    computed, probes included, over T: 1 for a run that trains each round once)."""
    warm = summary.get("warmup") or {}
    rounds = float(summary.get("rounds_planned", np.nan))
    fired = np.nan
    if warm.get("fired_at") is not None:
        fired = 0.0 if warm["fired_at"] == "never" else 1.0
    elif warm.get("rule") == "auto" and warm.get("warmup_rounds") is not None:
        fired = float(warm["warmup_rounds"] < rounds)
    computed = warm.get("rounds_computed") or {}
    return {"rounds": rounds, "fired": fired,
            "rule_seconds": float(warm.get("rule_seconds", warm.get("probe_seconds", np.nan))),
            "rule_state_bytes": float(warm.get("rule_state_bytes", np.nan)),
            "compute_ratio": float(computed.get("fedavg_equivalent", 1.0)),
            "wall_time_s": float(summary.get("wall_time_s", np.nan))}


def _own_run(spec) -> bool:
    """``spec``'s directory holds a finished run of the configuration the plan asks for."""
    return run_status(spec.run_dir) in FINAL and \
        config_mismatch(spec, run_config(spec, spec.warmup_rounds)) is None


def run_rows(plan: Plan) -> list[dict]:
    """One row per completed or diverged run (``status``; a diverged run's accuracies are NaN):
    its sweep, arm, T0, alpha and seed, every run metric, and the
    kernel deviation of its warm-up snapshot from the reference of the same seed (None where
    there is no T0 or no reference snapshot). Runs of one seed share the initialization and the
    partition, so per-seed differences (:func:`paired_differences`) are paired.

    A run of an arm with ``same_as`` (:func:`same_runs`) is the row of the run it trains as,
    under its own arm and T0, unless its own directory holds a finished run of the plan's
    configuration (trained before the two were known to be one; a run of another
    configuration there, left by an earlier choice, is not read). Such a row has no kernel
    deviation: the run it reads keeps no snapshot at its T0."""
    out = []
    reads = [(spec, spec.run_dir) for spec in plan_runs(plan)]
    reads += [(spec, spec.run_dir if _own_run(spec) else source.run_dir)
              for spec, source in same_runs(plan)]
    for spec, run_dir in reads:
        row = run_row(run_dir)
        if row is None:
            continue
        if spec.sweep.score == "personal":  # the sweep compares every client's own model
            row = {**row, "score": row["personal_score"],
                   "val_score": row["personal_val_score"]}
        dev = _kernel_deviations(plan, spec.sweep.name, spec.arm.name, spec.warmup_rounds,
                                 spec.alpha, [spec])
        out.append({"sweep": spec.sweep.name, "arm": spec.arm.name,
                    "warmup_rounds": spec.warmup_rounds, "alpha": spec.alpha,
                    "seed": spec.seed, **row, "kernel_deviation": dev[0] if dev else None})
    return out


def aggregate(plan: Plan, runs: list[dict] | None = None) -> list[dict]:
    """One row per (sweep, arm, T0, alpha): mean, std and n over seeds of every run metric
    (``runs``: :func:`run_rows` of the plan, computed here when not given)."""
    cells: dict[tuple, list[dict]] = {}
    for r in run_rows(plan) if runs is None else runs:
        cells.setdefault((r["sweep"], r["arm"], r["warmup_rounds"], r["alpha"]), []).append(r)
    out = []
    for (sweep, arm, t0, alpha), items in cells.items():
        rec = {"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha,
               "n_seeds": len(items), "device": items[0]["device"]}
        for metric in ("final_acc", "best_acc", "score", "val_score", "rounds_to_best",
                       "last_acc_var",
                       "personal_acc", "personal_score", "grad_norm_jump", "bytes_up",
                       "bytes_down",
                       "train_flops", "seconds_per_round"):
            values = np.array([r[metric] for r in items], dtype=np.float64)
            rec[f"{metric}_mean"] = float(np.nanmean(values)) if np.any(np.isfinite(values)) \
                else None
            rec[f"{metric}_std"] = float(np.nanstd(values)) if np.any(np.isfinite(values)) \
                else None
        dev = [r["kernel_deviation"] for r in items if r["kernel_deviation"] is not None]
        rec["kernel_deviation_mean"] = float(np.mean(dev)) if dev else None
        rec["kernel_deviation_std"] = float(np.std(dev)) if dev else None
        rec["kernel_deviation_n"] = len(dev)  # seeds whose reference run exists
        out.append(rec)
    return out


# the attention kernel's modules: a snapshot keeps their weights and biases, all that the
# kernel deviation (weights) and the kernel profile Phi (Q/K frozen at the snapshot) read
QK_MODULES = ("attn.q", "attn.k")

PAIRED_FIELDS = ("sweep", "arm", "warmup_rounds", "alpha", "against", "metric", "n", "diff_mean",
                 "diff_se")


def paired_differences(runs: list[dict], against: str = "fedavg",
                       metric: str = "final_acc") -> list[dict]:
    """Per (sweep, arm, T0, alpha): the mean over seeds of ``metric`` minus the ``against``
    arm's (its T0-free run of the same sweep, alpha and seed), its standard error (std with
    ddof = 1 of the per-seed differences over sqrt n; None for n < 2) and n. Seeds without a
    finished ``against`` run are left out."""
    base = {(r["sweep"], r["alpha"], r["seed"]): r[metric] for r in runs
            if r["arm"] == against and r["warmup_rounds"] is None}
    cells: dict[tuple, list[float]] = {}
    for r in runs:
        if r["arm"] == against and r["warmup_rounds"] is None:
            continue
        b = base.get((r["sweep"], r["alpha"], r["seed"]))
        if b is None or not np.isfinite(b) or not np.isfinite(r[metric]):
            continue
        cells.setdefault((r["sweep"], r["arm"], r["warmup_rounds"], r["alpha"]),
                         []).append(r[metric] - b)
    out = []
    for (sweep, arm, t0, alpha), diffs in cells.items():
        mean, se, _ = t_interval(diffs)
        out.append(dict(zip(PAIRED_FIELDS, (sweep, arm, t0, alpha, against, metric, len(diffs),
                                            mean, se), strict=True)))
    return out


def t_interval(diffs, level: float = 0.95) -> tuple[float, float | None, float | None]:
    """(mean, its standard error (ddof = 1; None for fewer than 2), and the half-width of the
    two-sided t interval at ``level`` (None likewise)) of paired differences."""

    d = np.asarray(diffs, dtype=np.float64)
    if d.size < 2:
        return float(d.mean()), None, None
    se = float(d.std(ddof=1) / np.sqrt(d.size))
    return float(d.mean()), se, t_half_width(se, d.size, level)


def t_half_width(se: float, n: int, level: float = 0.95) -> float:
    """Half-width of the two-sided t interval at ``level`` for a mean of ``n`` values with
    standard error ``se``."""
    from scipy import stats

    return float(stats.t.ppf(0.5 + level / 2, n - 1) * se)


def compare(runs: list[dict], against: str = "fedavg", metric: str = "score",
            margin: float = 0.01, level: float = 0.95) -> list[dict]:
    """Paired comparison of every arm with ``against`` per (sweep, T0, alpha), over the seeds
    both completed: the mean difference of ``metric``, its t interval at ``level``, and the
    two one-sided tests (TOST) of equivalence within +-``margin`` (accuracy 0.01 = 1 point).
    Diverged runs have no score and are left out of the pairs; ``diverged`` and
    ``against_diverged`` count them, so a method that diverges on some seeds shows it.

    ``verdict``: ``identical`` when every paired difference is exactly 0 (the same runs, such
    as FedFrozen whose chosen T0 is the horizon); ``win`` or ``loss`` when the interval excludes
    0 (``win within margin`` when TOST also shows the difference below ``margin``); otherwise
    ``tie`` when TOST
    rejects a difference of ``margin`` or more at 1 - ``level`` (the (2 level - 1) interval lies
    inside +-margin); otherwise ``inconclusive`` (too few seeds or too much noise to say).
    """
    from scipy import stats

    diverged: dict[tuple, int] = {}
    for r in runs:
        if r.get("status") == "diverged":
            key = (r["sweep"], r["arm"], r["warmup_rounds"], r["alpha"])
            diverged[key] = diverged.get(key, 0) + 1
    out = []
    for cell in paired_differences(runs, against, metric):
        n = cell["n"]
        rec = {**cell, "ci_low": None, "ci_high": None, "tost_p": None, "equivalent": None,
               "verdict": "inconclusive", "margin": margin, "level": level,
               "diverged": diverged.get((cell["sweep"], cell["arm"], cell["warmup_rounds"],
                                         cell["alpha"]), 0),
               "against_diverged": diverged.get((cell["sweep"], against, None, cell["alpha"]),
                                                0)}
        if n >= 2 and cell["diff_se"] is not None:
            d, se = cell["diff_mean"], cell["diff_se"]
            half = t_half_width(se, n, level)
            rec["ci_low"], rec["ci_high"] = d - half, d + half
            if se > 0:
                p_low = stats.t.sf((d + margin) / se, n - 1)  # H0: diff <= -margin
                p_high = stats.t.cdf((d - margin) / se, n - 1)  # H0: diff >= +margin
                rec["tost_p"] = float(max(p_low, p_high))
            else:
                rec["tost_p"] = 0.0 if abs(d) < margin else 1.0
            rec["equivalent"] = rec["tost_p"] < 1 - level
            within = " within margin" if rec["equivalent"] else ""
            if d == 0 and se == 0:  # the same runs (e.g. a chosen T0 equal to the horizon)
                rec["verdict"] = "identical"
            elif rec["ci_low"] > 0:
                rec["verdict"] = "win" + within
            elif rec["ci_high"] < 0:
                rec["verdict"] = "loss" + within
            elif rec["equivalent"]:
                rec["verdict"] = "tie"
        out.append(rec)
    return out


def _kernel_deviations(plan, sweep_name, arm_name, t0, alpha, specs) -> list[float]:
    """Kernel deviation of this T0's warm-up snapshot from the sweep's reference arm."""
    if t0 is None:
        return []
    sweep = next(s for s in plan.sweeps if s.name == sweep_name)
    refs = [a for a in sweep.arms if a.reference]
    if not refs:
        return []
    arm = next(a for a in sweep.arms if a.name == arm_name)
    head_t0 = arm.warmup_rounds[0]
    out = []
    for spec in specs:
        source = plan.out_dir / run_key(sweep_name, arm_name, head_t0, alpha, spec.seed)
        ref = reference_dir(plan, sweep, refs[0], alpha, spec.seed, t0)
        a = source / "checkpoints" / f"round_{t0}.pt"
        b = ref / "checkpoints" / f"round_{t0}.pt"
        if a.is_file() and b.is_file():
            heads = int(load_yaml(source / "config.yaml")["model"]["heads"])
            out.append(kernel_deviation(a, b, heads))
    return out


def reference_dir(plan: Plan, sweep: Sweep, ref: Arm, alpha, seed: int, t0: int) -> Path:
    """The reference run of this alpha and seed; a reference whose partition ignores alpha
    (``iid``: one client holding the pooled data) is the same run at every alpha, so the one
    of another alpha (same seed) stands in when this alpha's is missing."""
    own = plan.out_dir / run_key(sweep.name, ref.name, None, alpha, seed)
    if (own / "checkpoints" / f"round_{t0}.pt").is_file():
        return own
    for other in sweep.alphas:
        cand = plan.out_dir / run_key(sweep.name, ref.name, None, other, seed)
        if not (cand / "checkpoints" / f"round_{t0}.pt").is_file():
            continue
        scheme = load_yaml(cand / "config.yaml")["partition"]["scheme"]
        if scheme in ("iid", "natural"):
            return cand
    return own


def _n_suffix(n) -> str:
    return f" ({n})" if n else ""


def _fmt(mean, std) -> str:
    if mean is None:
        return "-"
    if abs(mean) >= 1e4:
        return f"{mean:.3g} +- {std:.2g}"
    return f"{mean:.4f} +- {std:.4f}"


def write_tables(rows: list[dict], out_dir: Path, runs: list[dict] | None = None) -> list[Path]:
    """``study.csv``, ``study.json`` and ``study.md`` (mean +- std (n)) in ``out_dir``; with
    ``runs`` (:func:`run_rows`) also ``study_per_run.csv`` (one row per run and seed) and
    ``study_paired.{csv,md}`` (each cell minus FedAvg, paired by seed)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted(rows, key=row_order)
    paths = [out_dir / "study.csv", out_dir / "study.json", out_dir / "study.md"]
    if rows:
        write_csv(rows, paths[0])
    atomic_write_text(paths[1], json.dumps(rows, indent=1))
    lines = ["| sweep | alpha | arm | T0 | n | final acc | best acc | rounds to best | "
             "personal acc | acc var (last 10 evals) | grad-norm jump | kernel dev (n) | MB up | "
             "TFLOPs | s/round |", "|" + "---|" * 15]
    for r in rows:
        lines.append(
            f"| {r['sweep']} | {r['alpha'] if r['alpha'] is not None else 'natural'} | "
            f"{r['arm']} | {'' if r['warmup_rounds'] is None else r['warmup_rounds']} | "
            f"{r['n_seeds']} | {_fmt(r['final_acc_mean'], r['final_acc_std'])} | "
            f"{_fmt(r['best_acc_mean'], r['best_acc_std'])} | "
            f"{_fmt(r['rounds_to_best_mean'], r['rounds_to_best_std'])} | "
            f"{_fmt(r['personal_acc_mean'], r['personal_acc_std'])} | "
            f"{_fmt(r['last_acc_var_mean'], r['last_acc_var_std'])} | "
            f"{_fmt(r['grad_norm_jump_mean'], r['grad_norm_jump_std'])} | "
            f"{_fmt(r['kernel_deviation_mean'], r['kernel_deviation_std'])}"
            f"{_n_suffix(r.get('kernel_deviation_n'))} | "
            f"{(r['bytes_up_mean'] or 0) / 1e6:.1f} | {(r['train_flops_mean'] or 0) / 1e12:.2f} "
            f"| {_fmt(r['seconds_per_round_mean'], r['seconds_per_round_std'])} |")
    atomic_write_text(paths[2], "\n".join(lines) + "\n")
    if runs is not None:
        paths += _write_run_tables(runs, out_dir)
    return paths


def base_arms(plan: Plan) -> dict[tuple[str, str], str]:
    """(sweep, arm) -> the arm of the same sweep that trains the algorithm this arm builds on:
    an arm with ``algorithm.base=NAME`` (FedFrozen on SCAFFOLD) against the sweep's arm whose
    ``algorithm.name`` is NAME and that has no T0 grid. Arms without such a partner are absent."""
    out = {}
    for sweep in plan.sweeps:
        for arm in sweep.arms:
            base = override_value(arm.overrides, "algorithm.base")
            partner = [a.name for a in sweep.arms if not a.warmup_rounds
                       and override_value(a.overrides, "algorithm.name") == base
                       and override_value(a.overrides, "algorithm.base") is None] \
                if base else []
            if partner:
                out[(sweep.name, arm.name)] = partner[0]
    return out


def compare_with_bases(runs: list[dict], bases: dict[tuple[str, str], str],
                       metric: str = "score", margin: float = 0.01) -> list[dict]:
    """:func:`compare` of each arm in ``bases`` with its base arm (:func:`base_arms`): what
    the arm adds on top of the algorithm it builds on, paired by seed."""
    out = []
    for against in sorted(set(bases.values())):
        out += [r for r in compare(runs, against, metric, margin)
                if bases.get((r["sweep"], r["arm"])) == against]
    return out


def write_comparison(runs: list[dict], out_dir: Path, against: str = "fedavg",
                     margin: float = 0.01,
                     bases: dict[tuple[str, str], str] | None = None,
                     personal: tuple[str, ...] = ()) -> list[Path]:
    """``comparison.{csv,md}``: :func:`compare` of every arm with ``against`` on the score
    (mean test accuracy of the last 5 evaluations), paired by seed; with ``bases``
    (:func:`base_arms`) the markdown adds each such arm against its base arm alone, and
    ``comparison_bases.csv`` holds those rows."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = sorted(compare(runs, against, "score", margin), key=row_order)
    paths = [out_dir / "comparison.csv", out_dir / "comparison.md"]
    write_csv(rows, paths[0])

    def pts(v):
        return "" if v is None else f"{100 * v:+.2f}"

    def table(rows: list[dict], label: str) -> list[str]:
        lines = ["| sweep | alpha | arm | T0 | n | diff (pts) | 95% CI | TOST p | verdict | "
                 f"diverged (arm / {label}) |", "|" + "---|" * 10]
        for r in rows:
            ci = "" if r["ci_low"] is None else f"[{pts(r['ci_low'])}, {pts(r['ci_high'])}]"
            tost = "" if r["tost_p"] is None else f"{r['tost_p']:.3f}"
            alpha = r["alpha"] if r["alpha"] is not None else "natural"
            t0 = "" if r["warmup_rounds"] is None else r["warmup_rounds"]
            lines.append(f"| {r['sweep']} | {alpha} | {r['arm']} | {t0} | {r['n']} | "
                         f"{pts(r['diff_mean'])} | {ci} | {tost} | {r['verdict']} | "
                         f"{r['diverged']} / {r['against_diverged']} |")
        return lines

    shown = {r["sweep"] for r in rows}
    own = [name for name in personal if name in shown]
    lines = [f"Score: mean test accuracy of the last {SCORE_LAST} evaluations"
             + (f" ({', '.join(own)}: the personalized accuracy at the last round, every "
                "client's own model on its own test split, a personalized method's or the "
                "global model after one local round of fine-tuning)" if own else "")
             + f". Difference to {against} in points, paired by seed, 95% t interval; tie = "
             f"equivalent within +-{100 * margin:g} point by two one-sided tests at 5%.", "",
             *table(rows, against)]
    extra = sorted(compare_with_bases(runs, bases, "score", margin), key=row_order) \
        if bases else []
    if extra:
        lines += ["", "Each arm that builds on another algorithm against that algorithm's arm "
                  "alone (the same score and tests)."]
        for base in sorted({r["against"] for r in extra}):
            lines += ["", f"Against {base}:", "",
                      *table([r for r in extra if r["against"] == base], base)]
        paths.append(out_dir / "comparison_bases.csv")
        write_csv(extra, paths[-1])
    else:  # a folder's base comparison matches its comparison.md
        (out_dir / "comparison_bases.csv").unlink(missing_ok=True)
    atomic_write_text(paths[1], "\n".join(lines) + "\n")
    return paths


def row_order(r: dict) -> tuple:
    return (r["sweep"], str(r["alpha"]), r["arm"],
            -1 if r["warmup_rounds"] is None else r["warmup_rounds"], r.get("seed", 0))


def write_csv(rows: list[dict], path: Path, fields: tuple[str, ...] | None = None) -> None:
    """``rows`` as CSV, atomically: the header from the first row, else ``fields`` (a header
    alone for no rows; an empty file for no rows and no ``fields``)."""
    text = io.StringIO()
    names = list(rows[0]) if rows else list(fields or ())
    if names:
        w = csv.DictWriter(text, fieldnames=names)
        w.writeheader()
        w.writerows(rows)
    atomic_write_text(path, text.getvalue())


def _write_run_tables(runs: list[dict], out_dir: Path) -> list[Path]:
    paired = sorted(paired_differences(runs), key=row_order)
    paths = [out_dir / "study_per_run.csv", out_dir / "study_paired.csv",
             out_dir / "study_paired.md"]
    write_csv(sorted(runs, key=row_order), paths[0])
    write_csv(paired, paths[1], PAIRED_FIELDS)
    if not paired:
        atomic_write_text(paths[2], "No paired differences: no run of the plan has a finished "
                          "FedAvg run (arm fedavg, no T0) of the same sweep, alpha and seed.\n")
        return paths
    lines = ["Final accuracy minus FedAvg's of the same seed, in points: mean over seeds +- its "
             "standard error (ddof = 1), n seeds.", "",
             "| sweep | alpha | arm | T0 | n | minus fedavg (points) | mean / SE |",
             "|" + "---|" * 7]
    for r in paired:
        se = r["diff_se"]
        lines.append(
            f"| {r['sweep']} | {r['alpha'] if r['alpha'] is not None else 'natural'} | "
            f"{r['arm']} | {'' if r['warmup_rounds'] is None else r['warmup_rounds']} | "
            f"{r['n']} | {100 * r['diff_mean']:+.2f}"
            + (f" +- {100 * se:.2f}" if se is not None else "") + " | "
            + (f"{r['diff_mean'] / se:+.1f}" if se else "-") + " |")
    atomic_write_text(paths[2], "\n".join(lines) + "\n")
    return paths


def packed_before(archive: Path) -> dict[str, bytes]:
    """{run key: its summary.json's bytes} of every run a ``--markers`` archive (or a ``--pack``
    archive) holds: the runs that came back from an earlier machine."""
    archive = Path(archive)
    out = {}
    try:
        with tarfile.open(archive, "r:*") as tar:
            for m in tar.getmembers():
                name = m.name.removeprefix("./")
                if m.isfile() and name.endswith("/summary.json"):
                    out[name[: -len("/summary.json")]] = tar.extractfile(m).read()
    except (OSError, tarfile.TarError) as exc:
        raise DataError(f"{archive}: not a readable study archive ({exc}); pass the "
                        "done_markers.tar.gz of an earlier call") from None
    return out


def pack_results(plans: Plan | list[Plan], dest: Path,
                 except_runs: dict[str, bytes] | None = None) -> dict:
    """Write ``dest`` (.tar.gz): every completed run of ``plans`` (a plan, or a tuned plan's
    stages: the tuning runs too, which choose the final configurations) with its summary,
    config and the global rows of its metrics, and its warm-up snapshots reduced to the Q/K
    weights and biases (what the kernel deviation and the kernel profile Phi read). Unpacking
    it into an empty ``out_dir`` and running ``--aggregate-only`` gives the tables and figure 7
    (they read only global rows), and ``--profile`` the kernel profile; model checkpoints,
    client states and per-client rows stay behind (large; re-running a run rebuilds them).
    ``except_runs`` (:func:`packed_before`): a run whose summary.json is the one recorded there
    came back before and is left out (counted as ``skipped``); a run trained again since (its
    configuration changed) differs and is packed. Every run's results come first in the
    archive, the snapshots after them, so an archive cut short keeps every run's results.
    """
    import torch  # as in kernel_deviation

    dest = Path(dest)
    counts = {"runs": 0, "snapshots": 0, "skipped": 0}
    except_runs = except_runs or {}

    def add_bytes(tar, name: str, data: bytes) -> None:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))

    _, specs = stage_runs(plans)
    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz", compresslevel=6) as tar:
        packed = []
        for spec in specs:
            finished = run_status(spec.run_dir) in FINAL
            if not finished or not (spec.run_dir / "metrics.csv").is_file():
                continue  # unfinished, or only a marker of a run finished elsewhere
            before = except_runs.get(spec.key)
            if before is not None and (spec.run_dir / "summary.json").read_bytes() == before:
                counts["skipped"] += 1
                continue
            counts["runs"] += 1
            packed.append(spec)
            for name in ("summary.json", "config.yaml"):
                if (spec.run_dir / name).is_file():
                    tar.add(spec.run_dir / name, arcname=f"{spec.key}/{name}")
            lines = (spec.run_dir / "metrics.csv").read_text().splitlines()
            col = lines[0].split(",").index("client")
            kept = [lines[0]] + [ln for ln in lines[1:] if ln.split(",")[col] == "global"]
            add_bytes(tar, f"{spec.key}/metrics.csv", ("\n".join(kept) + "\n").encode())
        # the snapshots after every run's results: an archive cut short (a device that returns
        # a bounded number of bytes drops its last parts) still holds every run's results, and
        # unpacks them before the cut
        for spec in packed:
            for snap in sorted((spec.run_dir / "checkpoints").glob("round_*.pt")):
                state = torch.load(snap, map_location="cpu", weights_only=False)
                qk = {n: t.clone() for n, t in state["global_params"].items()
                      if n.rpartition(".")[0].endswith(QK_MODULES)}
                buf = io.BytesIO()
                torch.save({"global_params": qk}, buf)
                add_bytes(tar, f"{spec.key}/checkpoints/{snap.name}", buf.getvalue())
                counts["snapshots"] += 1
    return counts


def write_markers(plans: Plan | list[Plan], dest: Path) -> int:
    """Write ``dest`` (.tar.gz) with the ``summary.json`` and ``config.yaml`` of every run of
    ``plans`` (a plan, or a tuned plan's stages) whose whole group (a T0 family, or a single
    run) is finished, and the plans' pretrained
    files: unpacked into ``out_dir`` on a fresh machine, it makes the study skip exactly those
    groups (an unfinished family reruns from its head, which keeps the snapshots its branches
    need) and start FedSQ from the same pretrained S. A marked run whose configuration
    differs from the plan's (a final run whose arm's choice moved) trains there again
    (:func:`check_existing`). Returns the number of runs marked."""
    dest = Path(dest)
    marked = 0
    out_dir, specs = stage_runs(plans)
    plans = [plans] if isinstance(plans, Plan) else list(plans)
    with atomic_path(dest) as tmp, tarfile.open(tmp, "w:gz") as tar:
        for members in families(specs):
            if all(run_status(m.run_dir) in FINAL for m in members):
                for m in members:
                    rel = m.run_dir.relative_to(out_dir)
                    for name in sorted(MARKER_FILES):
                        if (m.run_dir / name).is_file():
                            tar.add(m.run_dir / name, arcname=f"{rel}/{name}")
                    marked += 1
        pretrained = {p.pretrained_path(job): job.name for p in plans for job in p.pretrain}
        for path, name in pretrained.items():
            if path.is_file():
                tar.add(path, arcname=f"pretrained/{name}.pt")
    return marked


def chosen_t0(runs: list[dict], metric: str = "val_score", n_boot: int = 2000,
              seed: int = 0, level: float = 0.95) -> list[dict]:
    """The validation-selected T0 per (sweep, alpha, T0 arm) and a bootstrap interval over
    seeds.

    ``runs``: :func:`run_rows` (or any dicts with ``sweep, alpha, arm, warmup_rounds, seed``,
    ``metric`` and optionally ``score``). Only seeds with a run at every T0 of the arm count;
    an arm with a single T0 (the final stage of a tuned plan) has no row.
    The chosen T0 maximizes the mean of ``metric`` (default the validation score, the mean
    validation accuracy of the last 5 evaluations) over those seeds; a diverged run (NaN)
    counts as -inf, so a T0 that diverged on some seed is picked only if every T0 did; ties go
    to the smaller T0. The interval: ``n_boot`` resamples of the seeds with replacement, each
    re-picking the argmax of the resampled mean (a random stream per row, seeded by ``seed``
    and the row's key, so a row's interval is the same in any table that holds it);
    ``t0_low``/``t0_high`` are the (1 - level)/2 and (1 + level)/2 percentiles of the picked
    T0 (inverted CDF, so grid values), ``share_chosen`` the share of resamples that pick the
    chosen T0. ``test_score``: the mean test score over the same seeds at the chosen T0 (the
    test set only scores).
    """
    groups: dict[tuple, dict[int, dict[int, dict]]] = {}
    for r in runs:
        if r["warmup_rounds"] is None:
            continue
        groups.setdefault((r["sweep"], r["alpha"], r["arm"]), {}).setdefault(
            r["warmup_rounds"], {})[r["seed"]] = r
    out = []
    for (sweep, alpha, arm), by_t0 in groups.items():
        # each row its own stream: a row's interval does not move when other rows join
        rng = np.random.default_rng([seed, zlib.crc32(f"{sweep}|{alpha}|{arm}".encode())])
        t0s = sorted(by_t0)
        seeds = sorted(set.intersection(*(set(v) for v in by_t0.values())))
        if not seeds or len(t0s) < 2:  # one T0 (a tuned final stage): nothing to choose
            continue
        vals = np.array([[by_t0[t][s][metric] for t in t0s] for s in seeds], dtype=np.float64)
        vals = np.where(np.isfinite(vals), vals, -np.inf)
        if not np.isfinite(vals).any():
            continue
        best = int(np.argmax(vals.mean(0)))
        picks = np.empty(n_boot, dtype=np.int64)
        for b in range(n_boot):
            sample = vals[rng.integers(0, len(seeds), len(seeds))]
            picks[b] = t0s[int(np.argmax(sample.mean(0)))]
        lo, hi = np.percentile(picks, [50 * (1 - level), 50 * (1 + level)],
                               method="inverted_cdf")
        test = [by_t0[t0s[best]][s].get("score", np.nan) for s in seeds]
        out.append({"sweep": sweep, "alpha": alpha, "arm": arm, "n_seeds": len(seeds),
                    "t0_grid": t0s, "chosen_t0": t0s[best], "metric": metric,
                    "chosen_mean": float(vals.mean(0)[best]),
                    "t0_low": int(lo), "t0_high": int(hi),
                    "share_chosen": float(np.mean(picks == t0s[best])),
                    "test_score": float(np.mean(test)) if test else None,
                    "n_boot": n_boot, "level": level})
    return sorted(out, key=lambda r: (r["sweep"], str(r["alpha"]), r["arm"]))


def t0_choice_lines(rows: list[dict]) -> list[str]:
    """Markdown lines of :func:`chosen_t0`'s rows."""
    lines = ["Validation-selected T0 (argmax over the grid of the mean validation score over "
             "seeds) and its bootstrap interval over seeds (resampled, argmax re-picked); the "
             "test score is read at the chosen T0 only.", "",
             "| sweep | alpha | arm | n | chosen T0 | interval | share | val score | "
             "test score |", "|" + "---|" * 9]
    for r in rows:
        pct = f"{100 * r['level']:g}%"
        test = "-" if r["test_score"] is None or not np.isfinite(r["test_score"]) else \
            f"{r['test_score']:.4f}"
        lines.append(f"| {r['sweep']} | {'natural' if r['alpha'] is None else r['alpha']} | "
                     f"{r['arm']} | {r['n_seeds']} | {r['chosen_t0']} | "
                     f"[{r['t0_low']}, {r['t0_high']}] ({pct}) | {r['share_chosen']:.2f} | "
                     f"{r['chosen_mean']:.4f} | {test} |")
    return lines


SETTING_KEYS = ("attention", "local_steps", "lr", "momentum", "optimizer", "partition",
                "num_clients", "clients_per_round", "rounds", "model_dim", "freeze", "base")


def sweep_settings(plan: Plan) -> dict[tuple, dict]:
    """(sweep, alpha, arm) -> the setting its T0 choice is made in (:data:`SETTING_KEYS`):
    attention kind, K, lr, momentum, optimizer, partition scheme, clients (all and per round),
    T, the model's width, and what the arm freezes and on which base algorithm (FedFrozen's
    ``freeze`` and ``base``; None for other algorithms), read from the resolved config of the
    arm's first run, so a figure can place each choice on the axis its sweep varies."""
    out = {}
    for spec in plan_runs(plan):
        key = (spec.sweep.name, spec.alpha, spec.arm.name)
        if key in out or spec.warmup_rounds is None:
            continue
        cfg = run_config(spec, spec.warmup_rounds)
        t, params = cfg.train, cfg.model.params
        out[key] = {"attention": getattr(params, "attention", None), "local_steps": t.local_steps,
                    "lr": t.lr, "momentum": t.momentum, "optimizer": t.optimizer,
                    "partition": cfg.partition.scheme, "num_clients": cfg.partition.num_clients,
                    "clients_per_round": t.clients_per_round or cfg.partition.num_clients,
                    "rounds": t.rounds, "model_dim": getattr(params, "dim", None),
                    "freeze": getattr(cfg.algorithm.params, "freeze", None),
                    "base": getattr(cfg.algorithm.params, "base", None)}
    return out


def write_t0_choice(runs: list[dict], out_dir: Path, plan: Plan | None = None) -> list[Path]:
    """``t0_choice.{csv,md}`` (:func:`chosen_t0`) when some T0 run has a validation score;
    nothing otherwise. With ``plan``, each row also holds its sweep's setting
    (:func:`sweep_settings`)."""
    rows = chosen_t0(runs)
    if not rows:
        return []
    if plan is not None:
        settings = sweep_settings(plan)
        rows = [{**r, **settings.get((r["sweep"], r["alpha"], r["arm"]),
                                     dict.fromkeys(SETTING_KEYS))} for r in rows]
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "t0_choice.csv", out_dir / "t0_choice.md"]
    write_csv([{**r, "t0_grid": " ".join(map(str, r["t0_grid"]))} for r in rows], paths[0])
    atomic_write_text(paths[1], "\n".join(t0_choice_lines(rows)) + "\n")
    return paths
