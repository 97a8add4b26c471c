"""The finite-sample oracle ceiling of the probe estimator's T0 choice on the warm-up grid.

For each setting of :func:`simulations.warmup_grid.warmup_settings` (same problem, start, lr, K,
T as :func:`simulations.warmup_grid.evaluate_setting`), one finite-sample run with the data and
minibatch draws of :func:`linattn_theory.sampled.probe_run` for its seed (B, N, 25% validation)
trains the full model for T rounds. At every snapshot round t in {0, T//25, 2 T//25, ...} < T
(the probe's snapshot grid) the kernel is frozen and the frozen stage runs rounds t..T-1 on V
with the run's own minibatch draws of those rounds (common random numbers with the continuing
run; probe_run's own roll-back would draw fresh ones); t = T is the continuing run itself.
Per snapshot it records

- ``val_T``: the finite-sample validation objective (F on the validation split with the
  ridges, as the probe estimator scores it) of (M_t, V_T): what an oracle with unlimited,
  full-length probes on this run could see;
- ``R``: the exact population R(t) of :func:`linattn_theory.warmup_path.warmup_path` (the
  function evaluate_setting uses).

Reported per setting and per part:

- oracle-V: the snapshot with the smallest ``val_T``; within 10% of R* (the minimum of R over
  every T0 in 0..T) and at most 5% above R(T);
- oracle-pop: the snapshot whose finite-sample model (M_t, V_T) has the smallest exact
  population error F - Phi* (``R_sampled``): an oracle without validation-split noise, limited
  only by the finite-sample run itself;
- oracle-grid: the snapshot with the smallest exact R (the grid-discretisation ceiling).

``python -m simulations.probe_ceiling --json OUT [--samples N --batch B --settings 1,2,...]``.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from linattn_theory.advice import PROBE_DEFAULTS
from linattn_theory.dynamics import initial_point
from linattn_theory.errors import ParameterError
from linattn_theory.objectives import global_loss
from linattn_theory.profile import solve_profile
from linattn_theory.sampled import frozen_continuations, probe_run
from linattn_theory.warmup_path import warmup_path
from simulations.warmup_grid import PARTS, warmup_settings

__all__ = ["oracle_setting", "run_probe_ceiling"]


def _sampled_curve(problem, start, lr, local_steps, total_rounds, seed, batch_size,
                   samples_per_client, validation_fraction):
    """Snapshot rounds, val_T and the exact population objective of each continuation's model
    (inf where its frozen stage diverged), and the snapshots (M_t, V_t) by round."""
    run = frozen_continuations(problem, start, lr, local_steps, total_rounds, seed=seed,
                               batch_size=batch_size, samples_per_client=samples_per_client,
                               validation_fraction=validation_fraction)
    pop = [float("inf") if m is None else global_loss(problem, *m) for m in run.models]
    return list(run.rounds), list(run.validation), pop, run.snapshots


def oracle_setting(st, seed: int = 0, samples_per_client: int = 4096, batch_size: int = 256,
                   validation_fraction: float = 0.25, check_probe: bool = False) -> dict:
    """One setting's row: the exact curve on the snapshot grid, val_T per snapshot and the
    oracle choices. ``check_probe`` also runs the default probe estimator (finish=False) and
    checks that its chosen snapshot equals this run's (the same trajectory)."""
    problem = st.problem()
    start = initial_point(problem)
    star = solve_profile(problem).value
    path = warmup_path(problem, start, st.lr, st.local_steps, st.total_rounds, star)
    r = path.final_error
    best = int(np.argmin(r))
    row = {"index": st.index, "setting": st.label, "part": st.part, "T": st.total_rounds,
           "exact_T0": best, "R_min": float(r[best]), "R_never": float(r[-1])}
    t0 = time.perf_counter()
    try:
        rounds, val, pop, snaps = _sampled_curve(problem, start, st.lr, st.local_steps,
                                            st.total_rounds, seed, batch_size,
                                            samples_per_client, validation_fraction)
    except ParameterError as exc:
        row.update({"error": str(exc), "oracle_V_T0": None, "oracle_V_within_10pct": False,
                    "oracle_V_not_worse_5pct": False, "seconds": time.perf_counter() - t0})
        return row
    row["seconds"] = time.perf_counter() - t0
    rg = np.array([r[t] for t in rounds])
    ov = rounds[int(np.argmin(val))]
    op = rounds[int(np.argmin(pop))]
    og = rounds[int(np.argmin(rg))]
    row.update({"rounds": rounds, "val_T": val, "R_grid": rg.tolist(),
                "oracle_V_T0": ov, "oracle_V_excess": float(r[ov] / r[best] - 1),
                "oracle_V_vs_never": float(r[ov] / r[-1]),
                "oracle_V_within_10pct": bool(r[ov] <= 1.1 * r[best]),
                "oracle_V_not_worse_5pct": bool(r[ov] <= 1.05 * r[-1]),
                "R_sampled": [float(x - star) for x in pop],
                "oracle_pop_T0": op, "oracle_pop_excess": float(r[op] / r[best] - 1),
                "oracle_pop_within_10pct": bool(r[op] <= 1.1 * r[best]),
                "oracle_pop_not_worse_5pct": bool(r[op] <= 1.05 * r[-1]),
                "oracle_grid_T0": og, "oracle_grid_excess": float(r[og] / r[best] - 1),
                "oracle_grid_within_10pct": bool(r[og] <= 1.1 * r[best]),
                "oracle_grid_not_worse_5pct": bool(r[og] <= 1.05 * r[-1])})
    if check_probe:
        opts = {**PROBE_DEFAULTS, "batch_size": batch_size,
                "samples_per_client": samples_per_client,
                "validation_fraction": validation_fraction}
        try:
            run = probe_run(problem, start, st.lr, st.local_steps, st.total_rounds, seed=seed,
                            finish=False, **opts)
            p = run.choice.warmup_rounds
            same = True
            if p < st.total_rounds:
                same = bool(np.array_equal(run.kernel, snaps[p][0])
                            and np.array_equal(run.value, snaps[p][1]))
            row.update({"probe_T0": p, "probe_excess": float(r[p] / r[best] - 1),
                        "probe_within_10pct": bool(r[p] <= 1.1 * r[best]),
                        "probe_not_worse_5pct": bool(r[p] <= 1.05 * r[-1]),
                        "probe_snapshot_identical": same})
        except ParameterError as exc:
            row.update({"probe_T0": None, "probe_within_10pct": False,
                        "probe_not_worse_5pct": False, "probe_error": str(exc)})
    return row


def _summary(rows):
    out = {"settings": len(rows)}
    for key in ("oracle_V", "oracle_pop", "oracle_grid", "probe"):
        if rows and f"{key}_within_10pct" in rows[0]:
            w = sum(bool(r.get(f"{key}_within_10pct")) for r in rows)
            n = sum(bool(r.get(f"{key}_not_worse_5pct")) for r in rows)
            out[key] = {"within_10pct": w, "not_worse_5pct": n,
                        "within_10pct_rate": w / len(rows)}
    return out


def run_probe_ceiling(count: int = 72, samples_per_client: int = 4096, batch_size: int = 256,
                      indices=None, seed: int = 0, check_probe: bool = False,
                      verbose: bool = False) -> dict:
    """Oracle rows of the first ``count`` settings (or those in ``indices``) and summaries per
    part and for all (counts of settings within 10% of R* and at most 5% above R(T))."""
    rows = []
    start = time.perf_counter()
    for st in warmup_settings(count):
        if indices is not None and st.index not in indices:
            continue
        row = oracle_setting(st, seed=seed, samples_per_client=samples_per_client,
                             batch_size=batch_size, check_probe=check_probe)
        rows.append(row)
        if verbose:
            print(f"{st.index:3d} {row.get('exact_T0')} V:{row.get('oracle_V_T0')} "
                  f"grid:{row.get('oracle_grid_T0')} probe:{row.get('probe_T0', '-')} "
                  f"exc {row.get('oracle_V_excess', float('nan')):.4f} "
                  f"{row['seconds']:.1f}s", flush=True)
    summary = {"all": _summary(rows)}
    summary.update({p: _summary([r for r in rows if r["part"] == p]) for p in PARTS
                    if any(r["part"] == p for r in rows)})
    return {"config": {"samples_per_client": samples_per_client, "batch_size": batch_size,
                       "seed": seed, "count": count,
                       "indices": None if indices is None else sorted(indices)},
            "points": rows, "summary": summary, "seconds": time.perf_counter() - start}


def _markdown(res) -> str:
    cfg = res["config"]
    keys = [k for k in ("oracle_V", "oracle_pop", "oracle_grid", "probe")
            if k in res["summary"]["all"]]
    lines = [f"N = {cfg['samples_per_client']}, B = {cfg['batch_size']}, "
             f"{res['summary']['all']['settings']} settings, {res['seconds']:.0f} s", "",
             "| part | settings | " + " | ".join(f"{k}: within 10% | {k}: <= 1.05 R(T)"
                                                 for k in keys) + " |",
             "|---|---|" + "---|---|" * len(keys)]
    for part, s in res["summary"].items():
        if not s:
            continue
        cells = " | ".join(f"{s[k]['within_10pct']}/{s['settings']} | "
                           f"{s[k]['not_worse_5pct']}/{s['settings']}" for k in keys)
        lines.append(f"| {part} | {s['settings']} | {cells} |")
    lines += ["", "Oracle-V misses:", "",
              "| # | part | setting | exact T0* | oracle-V T0 | R/R*-1 | R/R(T) | "
              "oracle-pop T0 | pop R/R*-1 | oracle-grid T0 | grid R/R*-1 |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["points"]:
        if r.get("oracle_V_within_10pct") and r.get("oracle_V_not_worse_5pct"):
            continue
        if "error" in r:
            lines.append(f"| {r['index']} | {r['part']} | {r['setting']} | {r['exact_T0']} | "
                         f"diverged | - | - | - | - | - | - |")
            continue
        lines.append(f"| {r['index']} | {r['part']} | {r['setting']} | {r['exact_T0']} | "
                     f"{r['oracle_V_T0']} | {100 * r['oracle_V_excess']:.1f}% | "
                     f"{r['oracle_V_vs_never']:.3f} | {r['oracle_pop_T0']} | "
                     f"{100 * r['oracle_pop_excess']:.1f}% | {r['oracle_grid_T0']} | "
                     f"{100 * r['oracle_grid_excess']:.2f}% |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=72)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--settings", default=None, help="comma-separated setting indices")
    ap.add_argument("--check-probe", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    idx = None if a.settings is None else {int(x) for x in a.settings.split(",")}
    res = run_probe_ceiling(a.count, a.samples, a.batch, indices=idx,
                            check_probe=a.check_probe, verbose=a.verbose)
    print(_markdown(res))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
