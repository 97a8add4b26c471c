"""Single runs and sweeps from configs, saved as run directories.

A run directory holds ``config.yaml`` (the resolved configs and the sweep), ``metrics.csv``
(long format: round, run, metric, value) and ``summary.json`` (per setting: R(T0) mean and SE,
empirical and predicted T0*, bias/drift at every T0, wall time, code version, library versions,
device).

Run names in ``metrics.csv``: ``s{i}_seed{k}`` for the warm-up path of setting i, seed k
(metrics kernel_error, reference_error, drift, kernel_deviation, excess, test_loss,
grad_first, grad_last); ``s{i}_seed{k}_T0={t}`` for a frozen-stage run (metric ``error`` =
F(M_T0, V_t) - Phi*); ``s{i}_population_T0={t}`` for the population dynamics (``error``).

Everything is computed before the run directory is created, and every file is written
atomically, so a run that fails writes nothing. A run that diverges is a result: its metrics
are NaN from the round it diverged, ``summary.json`` lists the diverged seeds per setting
(``diverged``) and the command line warns about them.
"""

from __future__ import annotations

import csv
import io
import json
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
import yaml

from linattn.fileio import atomic_write_json, atomic_write_text
from linattn_theory.errors import ParameterError
from linattn_theory.problem import make_problem
from simulations.config import SimConfig
from simulations.divergence import diverged_runs
from simulations.engine import Setting, simulate
from simulations.metrics import compute_metrics, mean_se, phi_star, population


def setting_from_config(cfg: SimConfig, problem=None) -> Setting:
    p, t, d = cfg.problem, cfg.training, cfg.data
    problem = problem or make_problem(
        dim=p.dim, num_clients=p.num_clients, context_length=p.context_length, out_dim=p.out_dim,
        kernel_heterogeneity=p.kernel_heterogeneity, value_heterogeneity=p.value_heterogeneity,
        covariate_shift=p.covariate_shift, ridge=p.ridge, kernel_ridge=p.kernel_ridge,
        noise=p.noise, weights=p.weights, seed=p.seed)
    return Setting(problem=problem, lr=t.lr, local_steps=t.local_steps, batch_size=t.batch_size,
                   total_rounds=t.total_rounds, warmup_rounds=tuple(t.warmup_rounds),
                   samples_per_client=d.samples_per_client, test_samples=d.test_samples,
                   parametrization=t.parametrization, rank=t.rank, attention=t.attention,
                   participation=t.participation, init_scale=t.init_scale,
                   init_seed=t.init_seed, label=cfg.simulation.name,
                   lr_schedule=t.lr_schedule)


def provenance() -> dict:
    """Code version (git HEAD when available), library versions, device."""
    import scipy
    import torch

    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, cwd=Path(__file__).resolve().parent)
        code = head.stdout.strip() if head.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        code = None
    return {"code_version": code, "python": platform.python_version(),
            "numpy": np.__version__, "scipy": scipy.__version__, "torch": torch.__version__,
            "device": f"cpu ({platform.processor() or platform.machine()}), "
                      f"torch threads {torch.get_num_threads()}"}


def run_configs(configs: list[SimConfig], sweep: dict, out_dir) -> dict:
    """Simulate every config (vectorized across them) and write the run directory."""
    clock = time.perf_counter()
    problems: dict[str, object] = {}
    settings = []
    for cfg in configs:  # configs with the same problem section share one Problem (and data)
        key = json.dumps(cfg.to_dict()["problem"], sort_keys=True)
        problems.setdefault(key, setting_from_config(cfg).problem)
        settings.append(setting_from_config(cfg, problems[key]))
    seeds_by_cfg = {(c.simulation.first_seed, c.simulation.seeds) for c in configs}
    results = []
    for first, count in sorted(seeds_by_cfg):
        members = [i for i, c in enumerate(configs)
                   if (c.simulation.first_seed, c.simulation.seeds) == (first, count)]
        seeds = list(range(first, first + count))
        for i, res in zip(members, simulate([settings[i] for i in members], seeds)):
            results.append((i, res))
    results = [r for _, r in sorted(results, key=lambda x: x[0])]
    sim_time = time.perf_counter() - clock

    summary = {"settings": [], "sweep": sweep, "wall_time_s": None, **provenance()}
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["round", "run", "metric", "value"])
    for i, (cfg, st, res) in enumerate(zip(configs, settings, results)):
        summary["settings"].append(_write_setting(writer, i, cfg, st, res))
    summary["wall_time_s"] = time.perf_counter() - clock
    summary["simulation_time_s"] = sim_time
    out = Path(out_dir)  # written only now: nothing of a run that fails on the way
    atomic_write_text(out / "metrics.csv", buffer.getvalue())
    atomic_write_json(out / "summary.json", summary, indent=1)
    atomic_write_text(out / "config.yaml", yaml.safe_dump(
        {"configs": [c.to_dict() for c in configs], "sweep": sweep}, sort_keys=False))
    return summary


def _write_setting(writer, i, cfg, st, res) -> dict:
    t0s = list(st.warmup_rounds)
    linear = st.attention == "linear"
    m = compute_metrics(res)
    paths = {"kernel_error": m.kernel_error_path, "reference_error": m.reference_error_path,
             "drift": m.drift_path, "kernel_deviation": m.deviation_path,
             "excess": m.excess_path, "test_loss": m.test_loss}
    for k, seed in enumerate(res.seeds):
        run = f"s{i}_seed{seed}"
        for name, arr in paths.items():
            for t, v in enumerate(arr[k]):
                writer.writerow([t, run, name, repr(float(v))])
        for name, arr in (("grad_first", res.grad_first), ("grad_last", res.grad_last)):
            for t, v in enumerate(arr[k]):
                writer.writerow([t, run, name, repr(float(v))])
        for j, t0 in enumerate(t0s):
            for t in range(t0, st.total_rounds + 1):
                value = float(m.error_curves[k, j, t])
                writer.writerow([t, f"{run}_T0={t0}", "error", repr(value)])
    record = {"index": i, "config": cfg.to_dict(), "warmup_rounds": t0s,
              "seeds": res.seeds.tolist(), "diverged": diverged_runs(res)}
    final = m.final_error if linear else m.final_test_loss
    mean, se = mean_se(final)
    best = None if np.all(np.isnan(mean)) else int(t0s[int(np.nanargmin(mean))])
    record.update({"final_metric": "R(T0) = F(M_T0, V_T) - Phi*" if linear else "test loss",
                   "final_mean": mean.tolist(), "final_se": se.tolist(),
                   "empirical_best_warmup": best,
                   "gradient_jump_mean": float(np.mean(m.gradient_jump))
                   if m.gradient_jump.size else None})
    if linear:
        star = phi_star(st.problem)
        try:
            pop = population(st, star)
        except ParameterError as exc:  # the exact dynamics diverge too (eta beyond 2/L)
            record["population_error"] = str(exc)
            return record
        for j, t0 in enumerate(t0s):
            for t in range(st.total_rounds + 1):
                writer.writerow([t, f"s{i}_population_T0={t0}", "error",
                                 repr(float(pop.error_curves[j, t]))])
        record.update({"phi_star": star, "population_final": pop.final_error.tolist(),
                       "population_best_warmup": pop.best_warmup,
                       "bias_mean": mean_se(m.bias)[0].tolist(), "bias_population":
                       pop.bias.tolist(), "drift_mean": mean_se(m.drift)[0].tolist(),
                       "drift_population": pop.drift.tolist(),
                       "frozen_floor_mean": mean_se(m.frozen_floor)[0].tolist()})
    return record
