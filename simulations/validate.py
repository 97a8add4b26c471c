"""Checks P1-P6 of THEORY.md section 4 on a stated grid (``linattn simulate validate``), and
W1-W2 (the path-local bound and the probe estimator) on the warm-up grid of
:mod:`simulations.warmup_grid`.

Every check states its criterion, the measured value and PASS or FAIL; the criteria are fixed
here, before any run, and are not tuned to the outcome. :func:`run_validation` returns a dict
with every number (the figures/report code calls it and prints the same numbers).

Monte Carlo: S seeds per setting; a seed fixes the clients' finite data sets, the minibatch
draws and the participation draws (all seeds start from the same (M_0, V_0), as the population
dynamics do). SE = std over seeds / sqrt(S). All losses are *exact population* values of the
simulated parameters (``simulations.metrics``), so the only gaps to the population dynamics are
(i) Monte Carlo error, (ii) the finite data sets (O(1/N)) and (iii) the minibatch noise, whose
mean effect on the non-linear kernel dynamics is O(eta / B) and is not in the population
dynamics. P1 therefore runs with a large batch (``p1_batch_size``) and also reports the gap at
the default batch (diagnosis of (iii)).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import asdict, replace

import numpy as np

from linattn_theory.frozen import frozen_stage, noise_stationary_term
from linattn_theory.warmup_path import warmup_path
from simulations.data import sample_client_data
from simulations.engine import Setting, simulate
from simulations.grid import Grid, ProblemCache, grid_settings, make_setting
from simulations.metrics import compute_metrics, mean_se, phi_star, population, profile_parts
from simulations.report import write_validation
from simulations.warmup_grid import run_warmup_grid


def _argmin(values, rounds) -> int:
    return int(np.asarray(rounds)[int(np.nanargmin(values))])


def _ratio(a: int, b: int) -> float:
    """Factor between two warm-up lengths, with T0 = 0 counted as 1 round."""
    a, b = max(a, 1), max(b, 1)
    return max(a, b) / min(a, b)


def _curve_check(sim, pop, delta0):
    """|mean - pop| <= 4 SE + 0.01 Delta_0 at every T0; returns the record."""
    mean, se = mean_se(sim)
    gap = np.abs(mean - pop)
    allowed = 4 * se + 0.01 * delta0
    with np.errstate(divide="ignore", invalid="ignore"):
        z = np.where(se > 0, gap / se, 0.0)
    return {"sim_mean": mean.tolist(), "sim_se": se.tolist(),
            "population": np.asarray(pop).tolist(),
            "max_abs_gap": float(gap.max()), "max_z": float(np.max(z)),
            "within": bool(np.all(gap <= allowed + 1e-15))}


def _check_p1(grid, problems, records) -> dict:
    rows = []
    for zeta, k, lr in grid.p1_points:
        base = make_setting(grid, problems, zeta, k, lr)
        big = replace(base, batch_size=grid.p1_batch_size,
                      label=base.label + f",B={grid.p1_batch_size}")
        sim_big = compute_metrics(simulate(big, list(range(grid.seeds))))
        pop = population(big)
        delta0 = float(pop.kernel_error_path[0])
        small = records[base.label]
        row = {"setting": big.label, "delta0": delta0,
               "bias": _curve_check(sim_big.bias, pop.bias, delta0),
               "drift": _curve_check(sim_big.drift, pop.drift, delta0),
               "default_batch_bias": _curve_check(small["metrics"].bias, pop.bias, delta0),
               "default_batch_drift": _curve_check(small["metrics"].drift, pop.drift, delta0)}
        bias_mean = np.asarray(row["bias"]["sim_mean"])
        bias_se = np.asarray(row["bias"]["sim_se"])
        row["bias_decreasing"] = bool(np.all(np.diff(bias_mean)
                                             <= 2 * (bias_se[1:] + bias_se[:-1])))
        drift_mean = np.asarray(row["drift"]["sim_mean"])
        row["drift_increasing"] = bool(np.all(np.diff(drift_mean) >= -2 * np.asarray(
            row["drift"]["sim_se"])[1:]))
        row["population_drift_increasing"] = bool(np.all(np.diff(pop.drift) >= 0))
        rows.append(row)
    match = all(r["bias"]["within"] and r["drift"]["within"] for r in rows)
    bias_dec = all(r["bias_decreasing"] for r in rows)
    drift_inc = all(r["drift_increasing"] for r in rows)
    return {
        "criterion": (f"at B={grid.p1_batch_size}, every T0 of the grid: |sim mean - population| "
                      "<= 4 SE + 0.01 Delta_0 for bias and drift; bias non-increasing and drift "
                      "non-decreasing in T0 (each step within 2 SE)"),
        "measured": {"curves_match": match, "bias_decreasing": bias_dec,
                     "drift_increasing": drift_inc,
                     "max_z_bias": max(r["bias"]["max_z"] for r in rows),
                     "max_z_drift": max(r["drift"]["max_z"] for r in rows),
                     "max_z_drift_default_batch": max(r["default_batch_drift"]["max_z"]
                                                      for r in rows)},
        "pass": match and bias_dec and drift_inc,
        "points": rows,
    }


def _check_p2_p3(grid, records) -> tuple[dict, dict]:
    rows = []
    for label, rec in records.items():
        st, m, pop_fine = rec["setting"], rec["metrics"], rec["population_fine"]
        mean, se = mean_se(m.final_error)
        t0s = np.asarray(st.warmup_rounds)
        pred = pop_fine.best_warmup
        emp = _argmin(mean, t0s)
        best = int(np.argmin(mean))
        u_shape = bool(mean[0] - mean[best] > 2 * (se[0] + se[best])
                       and mean[-1] - mean[best] > 2 * (se[-1] + se[best]))
        rows.append({"setting": label, "heterogeneity": st.problem.knobs["kernel_heterogeneity"],
                     "local_steps": st.local_steps, "lr": st.lr,
                     "context_length": st.problem.context_length,
                     "num_clients": st.problem.num_clients,
                     "covariate_shift": st.problem.knobs["covariate_shift"], "predicted_T0": pred,
                     "closed_form_T0": rec["recommendation"]["closed_form"],
                     "bound_argmin_T0": rec["recommendation"]["closed_form"],
                     "empirical_T0": emp, "factor": _ratio(emp, pred),
                     "within_factor_2": _ratio(emp, pred) <= 2.0, "u_shaped": u_shape,
                     "R_pop_at_T": float(pop_fine.final_error[-1]),
                     "R_pop_min": float(pop_fine.final_error.min()),
                     "R_pop_0": float(pop_fine.final_error[0])})
    het = [r for r in rows if r["heterogeneity"] > 0]
    rate = float(np.mean([r["within_factor_2"] for r in het])) if het else float("nan")
    interior = [r for r in het if r["predicted_T0"] < grid.total_rounds]
    p2 = {"criterion": ("heterogeneous points (zeta > 0): empirical argmin of the sim mean R(T0) "
                        "over the T0 grid within a factor 2 of the population-dynamics argmin "
                        "(T0 = 0 counted as 1) on >= 90% of points; U-shape reported"),
          "measured": {"within_factor_2_rate": rate, "points": len(het),
                       "interior_points": len(interior),
                       "interior_within_factor_2_rate": float(np.mean(
                           [r["within_factor_2"] for r in interior])) if interior else float("nan"),
                       "max_factor": float(max(r["factor"] for r in het)) if het else float("nan"),
                       "u_shaped_rate": float(np.mean([r["u_shaped"] for r in het])) if het
                       else float("nan"),
                       "closed_form_within_factor_2_rate": float(np.mean(
                           [_ratio(r["closed_form_T0"], r["predicted_T0"]) <= 2 for r in het]))
                       if het else float("nan")},
          "pass": bool(rate >= 0.9), "points": rows}
    p3 = _check_p3(grid, rows)
    return p2, p3


def _check_p3(grid, rows) -> dict:
    base = {(r["heterogeneity"], r["local_steps"], r["lr"]): r for r in rows
            if r["context_length"] == grid.context_length and r["num_clients"] == grid.num_clients
            and r["covariate_shift"] == grid.covariate_shift}
    axes = {"heterogeneity": grid.heterogeneity, "local_steps": grid.local_steps, "lr": grid.lr}
    pairs = {"predicted_T0": [0, 0], "empirical_T0": [0, 0]}
    for axis, levels in axes.items():
        pos = list(axes).index(axis)
        for key in base:
            if key[pos] != levels[0]:
                continue
            chain = [base.get(key[:pos] + (v,) + key[pos + 1:]) for v in levels]
            if any(c is None for c in chain) or (axis != "heterogeneity" and key[0] == 0):
                continue
            for name in pairs:
                vals = [c[name] for c in chain]
                pairs[name][0] += sum(b <= a for a, b in zip(vals, vals[1:]))
                pairs[name][1] += len(vals) - 1
    t = grid.total_rounds
    iid = [r for r in rows if r["heterogeneity"] == 0]
    flat = [r["predicted_T0"] == t or (r["R_pop_at_T"] - r["R_pop_min"])
            <= 0.01 * (r["R_pop_0"] - r["R_pop_min"]) for r in iid]
    emp_flat = [r["empirical_T0"] >= t // 2 for r in iid]
    rate = {k: (v[0] / v[1] if v[1] else float("nan")) for k, v in pairs.items()}
    return {"criterion": ("T0* non-increasing along each of zeta, K, eta in the base grid (all "
                          "adjacent pairs, zeta > 0 for K and eta); at zeta_K = zeta_V = 0 "
                          f"(rho = {grid.covariate_shift:g} and rho = 0) the population T0* = T "
                          "or R(T) - min R <= 1% of R(0) - min R"),
            "measured": {"monotone_rate_population": rate["predicted_T0"],
                         "monotone_rate_empirical": rate["empirical_T0"],
                         "iid_flat_or_T": bool(all(flat)), "iid_empirical_T0_ge_T_over_2":
                         bool(all(emp_flat))},
            "pass": bool(rate["predicted_T0"] == 1.0 and rate["empirical_T0"] >= 0.9 and all(flat)),
            }


def check_p4(grid, problems) -> dict:
    rows = []
    for (zeta, k, lr), bsz in itertools.product(grid.floor_points, grid.floor_batch_sizes):
        st = make_setting(grid, problems, zeta, k, lr, total_rounds=grid.floor_rounds,
                      warmup_rounds=(grid.floor_warmup,), batch_size=bsz)
        st = replace(st, label=st.label + f",B={bsz}")
        res = simulate(st, list(range(grid.seeds)))
        m = compute_metrics(res)
        prob = st.problem
        kernels = res.kernels[:, grid.floor_warmup]
        phi, hess, opt, _, _ = profile_parts(prob, kernels)
        tail = res.frozen_values[:, 0, grid.floor_rounds // 2 + 1:]  # second half of the rounds
        gap = tail - opt[:, None]
        measured = 0.5 * np.einsum("stia,sij,stja->st", gap, hess, gap).mean(axis=1)
        noise = []
        for i, seed in enumerate(res.seeds):
            data = sample_client_data(prob, st.samples_per_client, int(seed))
            noise.append(_noise_term(st, kernels[i], data))
        floor = m.frozen_floor[:, 0]
        pred = floor + np.asarray(noise)
        diff_mean, diff_se = mean_se(measured - pred)
        rows.append({"setting": st.label, "measured_floor": float(measured.mean()),
                     "measured_se": float(mean_se(measured)[1]),
                     "D_frozen": float(floor.mean()), "noise_term": float(np.mean(noise)),
                     "predicted": float(pred.mean()), "diff": float(diff_mean),
                     "diff_se": float(diff_se),
                     "ratio_measured_to_predicted": float(measured.mean() / pred.mean()),
                     "within": bool(abs(diff_mean) <= 4 * diff_se + 0.1 * pred.mean())})
    return {"criterion": (f"frozen stage from M_T0 (T0 = {grid.floor_warmup}) run "
                          f"{grid.floor_rounds} rounds at B in {list(grid.floor_batch_sizes)}; "
                          "floor = mean over the second half of F(M, V_t) - Phi(M); per seed "
                          "prediction D_frozen(M) (eq. 17) + minibatch noise term (eq. 18, "
                          "gradient covariance of the client's data at V_inf); "
                          "|mean(measured - predicted)| <= 4 SE + 10% of the prediction"),
            "measured": {"ratios": [r["ratio_measured_to_predicted"] for r in rows]},
            "pass": all(r["within"] for r in rows), "points": rows}


def _noise_term(st: Setting, kernel, data) -> float:
    """Eq. (18) with Q_m = covariance over client m's N sequences of u r^T at V_inf(M)."""
    v_inf = frozen_stage(st.problem, kernel, st.lr, st.local_steps).fixed_point
    u = (data.sigma_hat @ (data.query @ kernel)[..., None])[..., 0]  # (C, N, d)
    r = u @ v_inf - data.target  # (C, N, d_y)
    g = np.einsum("cni,cna->cnai", u, r).reshape(u.shape[0], u.shape[1], -1)  # vec column-major
    q = np.stack([np.cov(gc, rowvar=False).reshape(g.shape[-1], g.shape[-1]) for gc in g])
    return noise_stationary_term(st.problem, kernel, st.lr, st.local_steps, st.batch_size,
                                 gradient_covariance=q)


def _check_p5(records) -> dict:
    rows, valid, ratios = [], [], []
    for label, rec in records.items():
        m = rec["metrics"]
        mean, _ = mean_se(m.final_error)
        exact = np.asarray(rec["population"].final_error)
        bound = np.asarray(rec["bound"])
        ok = bound >= exact
        valid.extend(ok.tolist())
        best = int(np.argmin(exact))
        ratios.append(float(bound[best] / exact[best]))
        rows.append({"setting": label, "valid_all_T0": bool(ok.all()),
                     "violations": int((~ok).sum()),
                     "tightness_at_exact_T0": float(bound[best] / exact[best]),
                     "tightness_at_empirical_T0": float(bound[int(np.argmin(mean))]
                                                        / mean[int(np.argmin(mean))]),
                     "median_tightness": float(np.median(bound / exact)),
                     "bound_above_sim_mean": bool(np.all(bound >= mean)),
                     "drift_bound_at_T": float(rec["bound_drift"][-1]),
                     "measured_drift_at_T": float(mean_se(m.drift)[0][-1]),
                     "measured_deviation_at_T": float(mean_se(m.kernel_deviation)[0][-1])})
    rate = float(np.mean(valid))
    return {"criterion": ("path-local bound E(T0) (eq. 35) >= exact R(T0) of the population "
                          "dynamics at every grid point and T0: validity rate must be 1; "
                          "tightness = bound / R at the exact best T0 (the simulator's mean, "
                          "which adds minibatch noise, is reported beside it)"),
            "measured": {"validity_rate": rate, "median_tightness": float(np.median(ratios)),
                         "max_tightness": float(np.max(ratios)),
                         "above_sim_mean_rate": float(np.mean(
                             [r["bound_above_sim_mean"] for r in rows]))},
            "pass": rate == 1.0, "points": rows}


def check_warmup_grid(quick: bool = False) -> tuple[dict, dict]:
    """W1 (bound) and W2 (probe estimator) on :mod:`simulations.warmup_grid`'s settings.

    ``quick`` evaluates its 4 cheapest settings only (the criteria are the same).
    """
    grid = run_warmup_grid(quick=quick)
    total = grid["summary"]["all"]
    parts = {k: v for k, v in grid["summary"].items() if k != "all" and v}
    w1 = {"criterion": ("warm-up grid (differs from this grid in every factor): bound E(T0) >= "
                        "exact R(T0) at every T0 of every setting (rate 1); median E/R at the "
                        "exact best T0 <= 10; bound's argmin within a factor 2 of the exact "
                        "argmin on >= 75% of settings"),
          "measured": {k: total.get(k) for k in ("settings", "validity_rate", "median_tightness",
                                                 "max_tightness", "within_factor_2_rate",
                                                 "norm_bound_median_tightness",
                                                 "norm_bound_within_factor_2_rate")},
          "pass": bool(total["validity_rate"] == 1.0 and total["median_tightness"] <= 10
                       and total["within_factor_2_rate"] >= 0.75),
          "parts": parts, "points": grid["points"], "unstable": grid["unstable"]}
    w2 = {"criterion": ("probe estimator (finite-sample run, seed 0, freeze-now forks): "
                        "R(T0_probe) <= 1.1 R* on >= 90% of settings and <= 1.05 R(T) on all"),
          "measured": {k: total.get(k) for k in ("probe_within_10pct_rate",
                                                 "probe_not_worse_5pct_rate",
                                                 "probe_median_excess", "probe_max_vs_never",
                                                 "probe_median_compute")},
          "pass": bool(total["probe_within_10pct_rate"] >= 0.9
                       and total["probe_not_worse_5pct_rate"] == 1.0),
          "points": grid["points"]}
    return w1, w2


def _check_p6(grid, problems, records) -> dict:
    rows = []
    for zeta, k, lr in grid.p6_points:
        merged = records[make_setting(grid, problems, zeta, k, lr).label]
        st = make_setting(grid, problems, zeta, k, lr, parametrization="factored")
        m = compute_metrics(simulate(st, list(range(grid.seeds))))
        pop = population(replace(st, warmup_rounds=tuple(range(st.total_rounds + 1))))
        mean = mean_se(m.final_error)[0]
        mmean = mean_se(merged["metrics"].final_error)[0]
        rows.append({"setting": st.label,
                     "T0_population_merged": merged["population_fine"].best_warmup,
                     "T0_population_factored": pop.best_warmup,
                     "T0_empirical_merged": _argmin(mmean, st.warmup_rounds),
                     "T0_empirical_factored": _argmin(mean, st.warmup_rounds),
                     "max_abs_R_difference": float(np.max(np.abs(mean - mmean))),
                     "R_min_merged": float(mmean.min()), "R_min_factored": float(mean.min())})
    return {"criterion": "report only: T0* and R(T0) of factored vs merged (same problem, K, eta)",
            "measured": {"T0_shift_factor_population": [
                _ratio(r["T0_population_factored"], r["T0_population_merged"]) for r in rows]},
            "pass": None, "points": rows}


def run_validation(grid: Grid | None = None, out_dir=None, quick: bool = False) -> dict:
    """Run P1-P6 on ``grid`` (default :class:`Grid`, or ``Grid.quick()`` when ``quick``) and
    W1-W2 on the warm-up grid (its 4 cheapest settings when ``quick``).

    Returns a dict: ``grid``, ``checks`` (P1..P6: criterion, measured, pass, points),
    ``warmup_checks`` (W1, W2, the same fields),
    ``settings`` (per setting curves) and ``timing``. With ``out_dir`` it also writes
    ``validation.json``, ``validation.md`` and figures there (``simulations.report``).
    """
    grid = grid or (Grid.quick() if quick else Grid())
    clock = time.perf_counter()
    problems = ProblemCache(grid)
    settings = grid_settings(grid, problems)
    results = simulate(settings, list(range(grid.seeds)))
    sim_time = time.perf_counter() - clock
    records = {}
    for st, res in zip(settings, results):
        star = phi_star(st.problem)
        fine = population(replace(st, warmup_rounds=tuple(range(st.total_rounds + 1))), star)
        path = warmup_path(st.problem, st.start(), st.lr, st.local_steps, st.total_rounds, star)
        t0s = np.asarray(st.warmup_rounds)
        records[st.label] = {"setting": st, "metrics": compute_metrics(res, star),
                             "population": population(st, star), "population_fine": fine,
                             "recommendation": {"warmup_rounds": path.best_warmup,
                                                "closed_form": path.bound_warmup},
                             "bound": path.bound[t0s].tolist(),
                             "bound_drift": path.bound_drift[t0s].tolist()}
    checks = {"P1": _check_p1(grid, problems, records)}
    checks["P2"], checks["P3"] = _check_p2_p3(grid, records)
    checks["P4"] = check_p4(grid, problems)
    checks["P5"] = _check_p5(records)
    checks["P6"] = _check_p6(grid, problems, records)
    warmup_checks = dict(zip(("W1", "W2"), check_warmup_grid(quick)))
    out = {"grid": asdict(grid), "checks": checks, "warmup_checks": warmup_checks,
           "settings": {k: _setting_summary(v) for k, v in records.items()},
           "timing": {"grid_simulation_s": sim_time,
                      "total_s": time.perf_counter() - clock}}
    if out_dir is not None:
        write_validation(out, out_dir)
    return out


def _setting_summary(rec) -> dict:
    m, pop = rec["metrics"], rec["population"]
    mean, se = mean_se(m.final_error)
    return {"warmup_rounds": m.warmup_rounds.tolist(), "R_sim_mean": mean.tolist(),
            "R_sim_se": se.tolist(), "R_population": pop.final_error.tolist(),
            "bias_sim": mean_se(m.bias)[0].tolist(), "bias_population": pop.bias.tolist(),
            "drift_sim": mean_se(m.drift)[0].tolist(), "drift_population": pop.drift.tolist(),
            "bound": rec["bound"], "recommendation": rec["recommendation"],
            "gradient_jump_mean": float(np.mean(m.gradient_jump)),
            "phi_star": m.phi_star}
