"""The files of a run directory, each written by one function here.

Layout::

    RUN_DIR/
      config.yaml        the resolved config (seeds and data-dependent model fields filled in)
      partition.npz      the partition (``real_data.data.save_partition``; .json beside it)
      metrics.csv        long format: round,client,metric,value (client = "global" or an id)
      timings.csv        round,seconds (wall time; kept out of metrics.csv so that a resumed
                         run's metrics.csv is byte-identical to an uninterrupted one)
      summary.json       status, final and best metrics, wall time, code version, libraries,
                         device
      curves.png         learning curves (test accuracy, train loss)
      checkpoints/last.pt            the last good state, with every RNG state
      checkpoints/round_<t>.pt       snapshots kept for branching (T0 sweeps)
      tensorboard/       optional
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from linattn.fileio import atomic_write_json, atomic_write_text

HEADER = "round,client,metric,value\n"


def write_yaml(path: Path, data: dict) -> None:
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def _fmt(v) -> str:
    return repr(float(v)) if isinstance(v, float | np.floating) else str(v)


class CsvAppender:
    """Append rows to a CSV file, flushed and fsynced per call (survives SIGKILL)."""

    def __init__(self, path: Path, header: str) -> None:
        self.path = path
        if not path.exists():
            path.write_text(header)

    def append(self, rows) -> None:
        text = "".join(",".join(_fmt(v) for v in row) + "\n" for row in rows)
        with open(self.path, "a") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def truncate_rows(path: Path, last_round: int) -> None:
    """Keep the header and rows with round <= ``last_round`` (used when resuming)."""
    if not path.exists():
        return
    lines = path.read_text().splitlines(keepends=True)
    keep = lines[:1] + [ln for ln in lines[1:]
                        if ln.strip() and ln.endswith("\n") and int(ln.split(",", 1)[0])
                        <= last_round]
    atomic_write_text(path, "".join(keep))


def read_global_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(round, value), ...] for the global rows of a metrics.csv."""
    out: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as fh:
        for row in csv.DictReader(fh):
            if row["client"] == "global":
                out.setdefault(row["metric"], []).append((int(row["round"]),
                                                          float(row["value"])))
    return out


def code_version() -> str:
    """``git describe`` of the source tree (with ``-dirty``), or ``unknown``."""
    root = Path(__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"],
                             cwd=root, capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def provenance(device: torch.device) -> dict:
    """Code version, library versions and device description."""
    import numpy

    dev = {"type": device.type}
    if device.type == "cuda":
        dev["name"] = torch.cuda.get_device_name(device)
    else:
        dev["name"] = platform.processor() or platform.machine()
        dev["threads"] = torch.get_num_threads()
    return {"code_version": code_version(),
            "libraries": {"python": sys.version.split()[0], "torch": torch.__version__,
                          "numpy": numpy.__version__, "platform": platform.platform()},
            "device": dev}


def summarize(metrics_path: Path) -> dict:
    """Final and best values of the global metrics."""
    series = read_global_metrics(metrics_path)
    final = {k: v[-1][1] for k, v in series.items()}
    best = {}
    for key, better in (("test_acc", max), ("local_acc_mean", max), ("test_loss", min)):
        if key in series:
            rnd, val = better(series[key], key=lambda rv: rv[1])
            best[key] = {"value": val, "round": rnd}
    return {"final": final, "best": best}


def plot_curves(metrics_path: Path, out: Path, title: str) -> None:
    """test accuracy and train loss against rounds (matplotlib imported lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = read_global_metrics(metrics_path)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, keys in zip(axes, (("test_acc", "local_acc_mean"), ("train_loss", "test_loss"))):
        for key in keys:
            if key in series:
                r, v = zip(*series[key])
                ax.plot(r, v, label=key)
        ax.set_xlabel("round")
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON, atomically (mode 0644; integer counts stay integers)."""
    atomic_write_json(path, data)
