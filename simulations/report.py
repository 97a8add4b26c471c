"""Write a validation result: ``validation.json`` (every number), ``validation.md`` (the P1-P6
and W1-W2 tables) and figures (matplotlib, imported only here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from linattn.fileio import atomic_path, atomic_write_json, atomic_write_text


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None
    return x


def format_value(value) -> str:
    """A measured value as the reports print it: floats to 4 significant digits, None as n/a.

    Shared with ``figures.report`` so the reproduce report prints exactly these strings.
    """
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "[" + ", ".join(format_value(v) for v in value) + "]"
    return str(value)


def markdown_table(result: dict) -> str:
    """The P1-P6 and W1-W2 table: prediction, criterion, measured value, PASS/FAIL."""
    lines = ["| check | criterion | measured | result |", "|---|---|---|---|"]
    for name, check in {**result["checks"], **result.get("warmup_checks", {})}.items():
        measured = "; ".join(f"{k} = {format_value(v)}" for k, v in check["measured"].items())
        verdict = {True: "PASS", False: "FAIL", None: "report"}[check["pass"]]
        lines.append(f"| {name} | {check['criterion']} | {measured} | {verdict} |")
    return "\n".join(lines)


def points_table(check: dict, keys: list[str]) -> str:
    lines = ["| " + " | ".join(["setting", *keys]) + " |", "|" + "---|" * (len(keys) + 1)]
    for row in check["points"]:
        cells = [row["setting"], *(format_value(row.get(k)) for k in keys)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


WARMUP_KEYS = ["part", "exact_T0", "bound_T0", "probe_T0", "valid", "tightness",
               "within_factor_2", "norm_bound_tightness", "probe_excess", "probe_vs_never",
               "probe_compute"]


def _warmup_sections(checks: dict) -> list[str]:
    """W1/W2: both parts of the warm-up grid and its per-setting table."""
    if "W1" not in checks:
        return []
    w1 = checks["W1"]
    keys = list(next(iter(w1["parts"].values())))
    lines = ["## W1/W2 warm-up grid (bound and probe estimator)", "",
             "| part | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for part, summary in w1["parts"].items():
        lines.append(f"| {part} | " + " | ".join(format_value(summary.get(k)) for k in keys)
                     + " |")
    if w1.get("unstable"):
        lines += ["", "Unstable (left out, the warm-up diverges): " + "; ".join(w1["unstable"])]
    rows = [r for r in w1["points"] if "error" not in r]
    lines += ["", points_table({"points": rows}, WARMUP_KEYS), ""]
    return lines


def write_validation(result: dict, out_dir) -> Path:
    """Write JSON, markdown and figures into ``out_dir``; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "validation.json", _jsonable(result), indent=1)
    checks = result["checks"]
    parts = ["# Simulator validation (P1-P6)", "", markdown_table(result), "",
             "## P2/P3 per grid point", "",
             points_table(checks["P2"], ["predicted_T0", "closed_form_T0", "bound_argmin_T0",
                                         "empirical_T0", "factor", "u_shaped"]), "",
             "## P4 frozen floor", "",
             points_table(checks["P4"], ["measured_floor", "measured_se", "D_frozen",
                                         "noise_term", "predicted", "ratio_measured_to_predicted",
                                         "within"]), "",
             "## P5 bound", "",
             points_table(checks["P5"], ["violations", "tightness_at_exact_T0",
                                         "tightness_at_empirical_T0", "median_tightness",
                                         "bound_above_sim_mean", "drift_bound_at_T",
                                         "measured_drift_at_T"]),
             "",
             "## P6 factored vs merged", "",
             points_table(checks["P6"], ["T0_population_merged", "T0_population_factored",
                                         "T0_empirical_merged", "T0_empirical_factored",
                                         "max_abs_R_difference"]), "",
             *_warmup_sections(result.get("warmup_checks", {})),
             f"Timing: {format_value(result['timing'])}", ""]
    atomic_write_text(out / "validation.md", "\n".join(parts))
    _figures(result, out)
    return out


def _figures(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["checks"]["P1"]["points"]
    fig, axes = plt.subplots(2, len(rows), figsize=(4 * len(rows), 6), squeeze=False)
    for i, row in enumerate(rows):
        t0 = result["grid"]["warmup_grid"]
        for j, name in enumerate(("bias", "drift")):
            ax = axes[j, i]
            rec = row[name]
            ax.errorbar(t0, rec["sim_mean"], yerr=2 * np.asarray(rec["sim_se"]), fmt="o",
                        ms=3, label="simulator (mean +- 2 SE)")
            ax.plot(t0, rec["population"], "-", label="population dynamics")
            ax.plot(t0, row[f"default_batch_{name}"]["sim_mean"], "x", ms=4,
                    label=f"simulator, B={result['grid']['batch_size']}")
            ax.set_title(f"{row['setting']}: {name}", fontsize=8)
            ax.set_xlabel("T0")
        axes[0, 0].legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(out / "p1_bias_drift.png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)

    settings = result["settings"]
    n = len(settings)
    cols = min(n, 6)
    nrows = int(np.ceil(n / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(3 * cols, 2.5 * nrows),
                             squeeze=False)
    for ax, (label, s) in zip(axes.ravel(), settings.items()):
        t0 = s["warmup_rounds"]
        ax.errorbar(t0, s["R_sim_mean"], yerr=2 * np.asarray(s["R_sim_se"]), fmt="o", ms=2)
        ax.plot(t0, s["R_population"], "-")
        ax.plot(t0, s["bound"], ":")
        ax.set_yscale("log")
        ax.set_title(label, fontsize=7)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    fig.tight_layout()
    with atomic_path(out / "p2_p5_final_error.png") as tmp:
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
