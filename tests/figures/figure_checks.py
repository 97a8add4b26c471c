"""Checks and tiny inputs shared by the figure tests (images, synthetic real-data runs)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

PNG = b"\x89PNG\r\n\x1a\n"


def assert_image_files(paths) -> None:
    """Each path exists and is a non-empty PNG (signature, > 1 kB) or PDF (header)."""
    paths = [Path(p) for p in paths]
    assert {p.suffix for p in paths} == {".png", ".pdf"}
    for p in paths:
        data = p.read_bytes()
        assert len(data) > 1024, f"{p} is only {len(data)} bytes"
        if p.suffix == ".png":
            assert data.startswith(PNG), f"{p} is not a PNG"
        else:
            assert data.startswith(b"%PDF-"), f"{p} is not a PDF"


def write_run(folder: Path, algorithm: dict, rounds: int, accuracy, seed: int,
              partition: dict | None = None, summary_extra: dict | None = None) -> None:
    """A tiny real-data run directory in the runner's format (config, metrics, summary)."""
    from real_data.rundir import HEADER

    folder.mkdir(parents=True)
    config = {"name": "digits_vit", "seed": seed, "data": {"name": "digits"},
              "partition": partition or {"scheme": "dirichlet", "num_clients": 10,
                                         "alpha": 0.3},
              "algorithm": algorithm, "train": {"rounds": rounds}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    rows = []
    for rnd in range(1, rounds + 1):
        acc = accuracy(rnd) + 0.01 * seed
        rows += [(rnd, "global", "test_acc", acc), (rnd, "global", "local_acc_worst10", acc / 2),
                 (rnd, "global", "update_dispersion_rel", 1.0 + 0.1 * rnd),
                 (rnd, "global", "bytes_up", 1000.0), (rnd, 0, "local_test_acc", acc)]
        if rnd > 1:
            rows.append((rnd, "global", "grad_norm_jump", 1.0 + 0.05 * rnd + 0.01 * seed))
    (folder / "metrics.csv").write_text(HEADER + "".join(f"{r},{c},{m},{v!r}\n"
                                                         for r, c, m, v in rows))
    summary = {"status": "completed", "rounds_completed": rounds, **(summary_extra or {})}
    (folder / "summary.json").write_text(json.dumps(summary))


def make_study(root: Path, rounds: int = 6) -> Path:
    """A study layout: fedavg, a FedFrozen T0 sweep, an auto-T0 run and a reference."""
    for seed in (0, 1):
        tail = f"alpha=0.3/seed={seed}"
        write_run(root / "digits" / "fedavg" / tail, {"name": "fedavg"}, rounds,
                  lambda r: 0.1 * r, seed)
        for t0 in (0, 2, 4, 6):
            write_run(root / "digits" / f"fedfrozen_v-T0={t0}" / tail,
                      {"name": "fedfrozen", "warmup": "fixed", "warmup_rounds": t0,
                       "train": "v"}, rounds, lambda r, t0=t0: 0.1 * r - 0.01 * (t0 - 4) ** 2,
                      seed)
        write_run(root / "digits" / "fedfrozen_auto" / tail,
                  {"name": "fedfrozen", "warmup": "auto", "warmup_rounds": None, "train": "v"},
                  rounds, lambda r: 0.09 * r, seed, summary_extra={"warmup": {"warmup_rounds": 3}})
        write_run(root / "digits" / "reference" / tail, {"name": "fedavg"}, rounds,
                  lambda r: 0.12 * r, seed, partition={"scheme": "iid", "num_clients": 1})
    # an unfinished run is skipped, not drawn
    write_run(root / "digits" / "fedprox" / "alpha=0.3/seed=0", {"name": "fedprox"}, rounds,
              lambda r: 0.1 * r, 0, summary_extra={"status": "running"})
    write_rule_export(root / "tables")  # a freeze-rule report, as aggregation writes it
    write_t0_choice_export(root / "tables", [  # the T0 choices with their sweeps' settings
        t0_choice_row("lin_K2", 0.1, 200, 160, 200, "linear", 2, 0.2),
        t0_choice_row("lin_K10", 0.1, 160, 160, 200, "linear", 10, 0.2),
        t0_choice_row("lin_lr05", 0.1, 120, 80, 160, "linear", 10, 0.5)])
    write_per_run_export(root / "tables", {(sweep, "fedfrozen"): lambda t0: 0.6 + 0.0002 * t0
                                           for sweep in ("lin_K2", "lin_K10", "lin_lr05")})
    profile_table_export(root / "profile_adam", {  # a kernel-profile table (figure 14)
        "steps": 1600, "batch_size": 2048, "lr": 0.002, "optimizer": "adam",
        "schedule": "constant", "phi_rule": "min", "eval_every": 50}, bias0=-0.02)
    return root


T0_CHOICE_HEADER = [
    "sweep", "alpha", "arm", "n_seeds", "t0_grid", "chosen_t0", "metric", "chosen_mean",
    "t0_low", "t0_high", "share_chosen", "test_score", "n_boot", "level", "attention",
    "local_steps", "lr", "momentum", "optimizer", "partition", "num_clients",
    "clients_per_round", "rounds", "model_dim", "freeze", "base"]


def t0_choice_row(sweep, alpha, t0, lo, hi, attention, k, lr, momentum=0.0,
                  partition="dirichlet", clients=50, per_round=50, dim=64, freeze="qk",
                  base="fedavg", arm="fedfrozen") -> list:
    """One row of ``t0_choice.csv`` as ``linattn study --export`` writes it (T = 200)."""
    return [sweep, alpha, arm, 3, "0 5 10 20 40 80 120 160 200", t0, "val_score", 0.7,
            lo, hi, 0.9, 0.69, 2000, 0.95, attention, k, lr, momentum, "sgd", partition,
            clients, per_round, 200, dim, freeze, base]


def write_per_run_export(folder: Path, curves: dict) -> Path:
    """``folder/study_per_run.csv`` as ``linattn study --export`` writes it (the columns figure
    13 reads): for every (sweep, arm) -> f of ``curves``, seed s in 0..2 scoring f(T0) + 0.01 s
    at every T0 of the P3 grid, and one reference run without a T0."""
    import csv

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "study_per_run.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["sweep", "arm", "warmup_rounds", "alpha", "seed", "score", "val_score",
                    "status"])
        for (sweep, arm), f in curves.items():
            for t0 in (0, 5, 10, 20, 40, 80, 120, 160, 200):
                for s in (0, 1, 2):
                    w.writerow([sweep, arm, t0, 0.1, s, f(t0) + 0.01 * s, f(t0), "completed"])
            w.writerow([sweep, "reference", "", 0.1, 0, 0.9, 0.9, "completed"])
    return folder


def write_t0_choice_export(folder: Path, rows: list[list]) -> Path:
    """``folder/t0_choice.csv`` holding ``rows`` (:func:`t0_choice_row`)."""
    import csv

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "t0_choice.csv", "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(T0_CHOICE_HEADER)
        writer.writerows(rows)
    return folder


RULES = ("auto", "perturbation", "norm_change", "norm_change_median", "kernel_stability",
         "plateau", "fraction_half")


def _setting(sweep, alpha, fedavg_val, fixed_val):
    """FedAvg scores 0.70 + 0.01 s, the fixed T0 (80) 0.72 + 0.01 s; auto never freezes and
    scores as FedAvg; every other rule fires at 20 and scores 0.68 + 0.01 s."""
    rows = []
    for s in (0, 1, 2):
        for arm, score, val, t0, decided, fired in (
                ("fedavg", 0.70, fedavg_val, None, math.nan, math.nan),
                ("fedfrozen_fixed", 0.72, fixed_val, 80, math.nan, math.nan),
                *((r, 0.70 if r == "auto" else 0.68, 0.5, None, 200.0 if r == "auto" else 20.0,
                   0.0 if r == "auto" else 1.0) for r in RULES)):
            rows.append({"sweep": sweep, "arm": arm, "warmup_rounds": t0, "alpha": alpha,
                         "seed": s, "score": score + 0.01 * s, "val_score": val,
                         "status": "completed", "decided_T0": decided, "rounds": 200.0,
                         "fired": fired, "compute_ratio": 1.0, "rule_seconds": 0.1,
                         "wall_time_s": 10.0, "rule_state_bytes": 0.0})
    return rows


def write_rule_export(folder: Path) -> Path:
    """A freeze-rule study's export: ``rule_regret.json`` (two settings) and ``choices.json``."""
    from real_data import study

    plan = study.load_plan("freeze_rules")
    runs = _setting("fmnist_softmax", 0.1, 0.80, 0.79) + _setting("mnist", 0.1, 0.70, 0.75)
    study.write_rule_regret(plan, runs, folder)
    cands = [{"grid_point": 0, "overrides": [], "warmup_rounds": t, "score": 0.6 + t / 1000,
              "status": "completed"} for t in (10, 20, 40, 80)]
    choices = {"metric": "val_acc", "last": 5, "seed": 100, "choices": [
        {"sweep": sw, "arm": "fedfrozen_fixed", "alpha": 0.1, "metric": "val_acc",
         "chosen": cands[-1], "candidates": cands} for sw in ("fmnist_softmax", "mnist")]}
    (folder / "choices.json").write_text(json.dumps(choices))
    return folder


def profile_table_export(folder, budget, bias0, n_seeds=1, converged=1, refs=("reference",
                                                                           "reference_iid")):
    """A kernel_profile.json as `linattn study --profile` writes it: Phi_fed rising by 0.001 a
    round step, each reference 0.002 above it, Phi_best 0.35."""
    import json

    summary = []
    for ref in refs:
        for i, t0 in enumerate((0, 10, 200)):
            fed, phi_ref = 0.34 + 0.001 * i, 0.34 + (0.002 * i if i else 0.0)
            summary.append({"sweep": "lin_K10", "alpha": 0.1, "arm": "fedfrozen",
                            "warmup_rounds": t0, "reference": ref, "n_seeds": n_seeds,
                            "n_converged": converged, "phi_fed_mean": fed, "phi_fed_std": 0.0,
                            "phi_ref_mean": phi_ref, "phi_ref_std": 0.0,
                            "phi_best_mean": 0.35, "phi_best_std": 0.0,
                            "bias_mean": bias0 + 0.01 * i, "bias_std": 0.002,
                            "drift_mean": fed - phi_ref, "drift_std": None})
    folder.mkdir(parents=True)
    (folder / "kernel_profile.json").write_text(json.dumps(
        {"budget": budget, "summary": summary, "rows": []}))
    return folder

