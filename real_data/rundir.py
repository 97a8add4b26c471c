"""The files of a run directory, each written by one function here.

Layout::

    RUN_DIR/
      config.yaml        the resolved config (seeds and data-dependent model fields filled in)
      partition.npz      the partition (``real_data.data.save_partition``; .json beside it)
      metrics.csv        long format: round,client,metric,value,stage (client = "global" or
                         an id; stage = what trained that round, the algorithm's RoundPlan.stage:
                         FedFrozen's "warmup" then "frozen", FedPart's "groupN", else "full")
      timings.csv        round,seconds (wall time; kept out of metrics.csv so that a resumed
                         run's metrics.csv is byte-identical to an uninterrupted one)
      summary.json       status, final and best metrics, wall time, code version, libraries,
                         device
      curves.png         accuracy, loss and the round's lr, the stages shaded, T0 marked
      curves_probe.png   algorithm.warmup=auto: the probes' predictions, T0 marked
      probe_discarded.csv  algorithm.warmup=auto: the rows of the warm-up rounds after T0
                         that the roll-back discarded (metrics.csv's columns)
      checkpoints/last.pt            the last good state, with every RNG state
      checkpoints/round_<t>.pt       snapshots kept for branching (T0 sweeps)
      checkpoints/probe_<t>.pt       algorithm.warmup=auto: snapshots that can still be T0
      snapshot_rounds.json           their rounds (so that a resumed run keeps them too)
      tensorboard/       optional (run.tensorboard=true; the ``tensorboard`` extra)

Every file is readable by others (mode 0644): whole files are written through
``linattn.fileio``, and a CSV is created that way before rows are appended to it.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
import yaml

from linattn.errors import DataError, UserError
from linattn.fileio import atomic_path, atomic_write_json, atomic_write_text, naming
from real_data.lock import RunLock

HEADER = "round,client,metric,value,stage\n"

# metrics that count things (bytes, FLOPs, parameters, rounds): integers in summary.json
COUNT_METRICS = frozenset({"bytes_up", "bytes_down", "train_flops", "trainable_params",
                           "fedpart_group"})


SNAPSHOTS_FILE = "snapshot_rounds.json"  # the rounds start_run was asked to keep


def create_locked(run_dir: Path) -> RunLock:
    """Create ``run_dir`` (which must not exist) and lock it before anything is written."""
    if run_dir.exists():
        raise UserError(f"run directory {run_dir} already exists; choose another --out")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        run_dir.mkdir()
    except FileExistsError:  # another process made it a moment ago
        raise UserError(f"run directory {run_dir} already exists; choose another "
                        "--out") from None
    try:
        return RunLock.acquire(run_dir)
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise


def read_snapshot_rounds(run_dir: Path) -> tuple[int, ...]:
    """The T0 snapshot rounds a run keeps (``snapshot_rounds.json``; none without it)."""
    path = run_dir / SNAPSHOTS_FILE
    if not path.is_file():
        return ()
    try:
        rounds = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        rounds = None
    if not (isinstance(rounds, list) and all(isinstance(r, int) for r in rounds)):
        raise DataError(f"{path}: not a JSON list of rounds; write the T0 rounds to keep, "
                        "e.g. [0, 5, 10], or remove the file to keep none")
    return tuple(rounds)


def write_yaml(path: Path, data: dict) -> None:
    atomic_write_text(path, yaml.safe_dump(data, sort_keys=False))


def _fmt(v) -> str:
    return repr(float(v)) if isinstance(v, float | np.floating) else str(v)


class CsvAppender:
    """Append rows to a CSV file, flushed and fsynced per call (survives SIGKILL).

    ``columns`` are the names in the file's header: a file that exists keeps its own.
    """

    def __init__(self, path: Path, header: str) -> None:
        self.path = path
        if not path.exists():
            atomic_write_text(path, header)
        self.columns = tuple(_lines(path, header.split(",")[0].strip())[0].strip().split(","))

    def append(self, rows) -> None:
        text = "".join(",".join(_fmt(v) for v in row) + "\n" for row in rows)
        with naming(self.path), open(self.path, "a") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())


def _lines(path: Path, first: str = "round") -> list[str]:
    """The lines of a CSV file whose header starts with column ``first``; unreadable content
    names the file."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text (byte {exc.start}); the file is damaged: "
                        "restore it from a copy or start the run again") from None
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].split(",", 1)[0].strip() != first:
        raise DataError(f"{path}: no '{first},...' header; the file is damaged: restore it "
                        "from a copy or start the run again")
    return lines


def truncate_rows(path: Path, last_round: int) -> None:
    """Keep the header and rows with round <= ``last_round`` (used when resuming).

    A last line without its newline (a write cut short) is dropped; any other line that is
    not a row raises :class:`DataError` naming the file and the line.
    """
    if not path.exists():
        return
    lines = _lines(path)
    keep = lines[:1]
    for number, line in enumerate(lines[1:], start=2):
        if not line.endswith("\n") or not line.strip():
            continue
        try:
            rnd = int(line.split(",", 1)[0])
        except ValueError:
            raise DataError(f"{path}, line {number}: {line[:60].rstrip()!r} is not a row "
                            "(round first); delete that line (or restore the file), then "
                            "resume") from None
        if rnd <= last_round:
            keep.append(line)
    atomic_write_text(path, "".join(keep))


def header_of(path: Path) -> str:
    """The header line of a CSV file written here (with its newline)."""
    return _lines(path)[0]


def rows_after(path: Path, last_round: int) -> list[str]:
    """The complete rows (lines) of a CSV file with round > ``last_round``."""
    if not path.exists():
        return []
    return [line for line in _lines(path)[1:]
            if line.endswith("\n") and line.split(",", 1)[0].strip().isdigit()
            and int(line.split(",", 1)[0]) > last_round]


def drop_rows(path: Path, rnd: int, metrics) -> None:
    """Remove the global rows of round ``rnd`` whose metric is one of ``metrics`` (a run
    resumed at a probe round drops the probe rows a killed process wrote)."""
    if not path.exists():
        return
    lines = _lines(path)
    prefixes = tuple(f"{rnd},global,{m}," for m in metrics)
    kept = [line for line in lines[1:] if not line.startswith(prefixes)]
    if len(kept) < len(lines) - 1:
        atomic_write_text(path, lines[0] + "".join(kept))


def write_text(path: Path, text: str) -> None:
    """``text`` written atomically (mode 0644)."""
    atomic_write_text(path, text)


def read_global_metrics(path: Path) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(round, value), ...] for the global rows of a metrics.csv."""
    out: dict[str, list[tuple[int, float]]] = {}
    for number, row in enumerate(csv.DictReader(_lines(path)), start=2):
        try:
            if row["client"] == "global":
                out.setdefault(row["metric"], []).append((int(row["round"]),
                                                          float(row["value"])))
        except (KeyError, TypeError, ValueError):
            raise DataError(f"{path}, line {number}: not a row of round,client,metric,value; "
                            "delete that line (or restore the file)") from None
    return out


def read_stages(path: Path) -> dict[int, str]:
    """round -> stage from a metrics.csv (empty when the file has no stage column)."""
    out: dict[int, str] = {}
    reader = csv.DictReader(_lines(path))
    if "stage" not in (reader.fieldnames or ()):
        return out
    for row in reader:
        if row["stage"] and (row["round"] or "").isdigit():
            out[int(row["round"])] = row["stage"]
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


DEVICE_WORKERS_ENV = "LINATTN_DEVICE_WORKERS"
"""Worker processes that share this process's device (``scripts/gpu_study.sh`` sets it to its
workers per GPU): a run's wall time per round is then that share of the device, so its device
seconds are the wall seconds over this count (:func:`device_workers`)."""


def device_workers() -> int:
    """The processes sharing this device (``LINATTN_DEVICE_WORKERS``, default 1)."""
    raw = os.environ.get(DEVICE_WORKERS_ENV, "1")
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise UserError(f"{DEVICE_WORKERS_ENV}={raw!r}: the number of worker processes that "
                        "share this device, an integer >= 1 (unset it for one)")
    return value


def provenance(device: torch.device) -> dict:
    """Code version, library versions and device description (with ``workers``: the
    processes that shared the device, :func:`device_workers`)."""
    import numpy

    dev = {"type": device.type, "workers": device_workers()}
    if device.type == "cuda":
        dev["name"] = torch.cuda.get_device_name(device)
    else:
        dev["name"] = platform.processor() or platform.machine()
        dev["threads"] = torch.get_num_threads()
    return {"code_version": code_version(),
            "libraries": {"python": sys.version.split()[0], "torch": torch.__version__,
                          "numpy": numpy.__version__, "platform": platform.platform()},
            "device": dev}


def _count(metric: str, value: float):
    return int(value) if metric in COUNT_METRICS and float(value).is_integer() else value


def summarize(metrics_path: Path) -> dict:
    """Final and best values of the global metrics."""
    series = read_global_metrics(metrics_path)
    final = {k: _count(k, v[-1][1]) for k, v in series.items()}
    best = {}
    for key, better in (("test_acc", max), ("local_acc_mean", max), ("test_loss", min),
                        ("val_acc", max), ("val_loss", min)):
        if key in series:
            rnd, val = better(series[key], key=lambda rv: rv[1])
            best[key] = {"value": val, "round": rnd}
    return {"final": final, "best": best}


# (y label, [(metric, legend label), ...]) per panel of curves.png
PANELS = (("accuracy", (("test_acc", "test, global model"),
                        ("val_acc", "validation, global model"),
                        ("local_acc_mean", "local test, client mean"))),
          ("loss (cross-entropy)", (("train_loss", "train, clients' mean"),
                                    ("val_loss", "validation, global model"),
                                    ("test_loss", "test, global model"))),
          ("learning rate", (("lr", "clients' lr of the round"),)))
STAGE_COLOURS = ("#d6e6f4", "#fbe0c6", "#dcefd6", "#eddcf0", "#f6f0c2", "#e4e4e4")


def stage_spans(stages: dict[int, str]) -> list[tuple[str, int, int]]:
    """Contiguous runs of one stage as (stage, first round, last round), in round order."""
    spans: list[tuple[str, int, int]] = []
    for rnd in sorted(stages):
        if spans and spans[-1][0] == stages[rnd] and spans[-1][2] == rnd - 1:
            spans[-1] = (stages[rnd], spans[-1][1], rnd)
        else:
            spans.append((stages[rnd], rnd, rnd))
    return spans


def warmup_end(spans: list[tuple[str, int, int]]) -> int | None:
    """T0: the last round of a ``warmup`` stage that another stage follows (else None)."""
    for (stage, _, last), _next in zip(spans, spans[1:]):
        if stage == "warmup":
            return last
    return None


def plot_curves(metrics_path: Path, out: Path, title: str) -> None:
    """Accuracy, loss and the clients' learning rate (its schedule) against rounds, the stages
    shaded and T0 marked (matplotlib lazily).

    Round r moves the model from its state after round r - 1 to the one after round r, so a
    stage covering rounds a..b is shaded over (a - 1, b] and T0 is drawn at x = T0.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator
    from matplotlib.transforms import blended_transform_factory

    series = read_global_metrics(metrics_path)
    spans = stage_spans(read_stages(metrics_path))
    names = list(dict.fromkeys(stage for stage, _, _ in spans))
    colour = {n: STAGE_COLOURS[i % len(STAGE_COLOURS)] for i, n in enumerate(names)}
    last = max((r for values in series.values() for r, _ in values), default=1)
    t0 = warmup_end(spans)
    # name each stage above its span when every span is wide enough, else in a legend
    inline = all(b - a + 1 >= 0.12 * last for _, a, b in spans)
    fig, axes = plt.subplots(1, len(PANELS), figsize=(14, 4.2), layout="constrained")
    for ax, (ylabel, keys) in zip(axes, PANELS):
        above = blended_transform_factory(ax.transData, ax.transAxes)
        if len(names) > 1:
            for stage, a, b in spans:
                ax.axvspan(a - 1, b, color=colour[stage], lw=0, zorder=0)
                if inline:
                    ax.text((a - 1 + b) / 2, 1.01, stage, transform=above, ha="center",
                            va="bottom", fontsize=9, color="0.25")
        for key, label in keys:
            if key in series:
                r, v = zip(*series[key])
                ax.plot(r, v, label=label, marker="o" if len(r) <= 30 else None, ms=3)
                if key == "lr" and min(v) > 0 and max(v) > 10 * min(v):
                    ax.set_yscale("log")  # a decay over decades stays readable
        if t0 is not None:
            lo, hi = ax.get_ylim()  # headroom for the label, clear of the curves
            ax.set_ylim(lo, hi + 0.12 * (hi - lo))
            ax.axvline(t0, color="0.15", ls="--", lw=1.2)
            ax.text(t0, 0.97, f" T0 = {t0}", transform=above, ha="left", va="top",
                    fontsize=9)
        ax.set_xlim(0, last)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round", fontsize=10)
        ax.set_ylabel(ylabel, fontsize=10)
        ax.tick_params(labelsize=9)
        ax.grid(True, color="0.88", lw=0.6)
        ax.set_axisbelow(True)
        if ax.lines:  # below the panel, where it can hide no curve
            ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2,
                      frameon=False)
    fig.suptitle(title, fontsize=10)
    if len(names) > 1 and not inline:
        fig.legend(handles=[Patch(color=colour[n], label=n) for n in names], title="stage",
                   loc="outside lower center", ncol=min(len(names), 8), fontsize=8,
                   title_fontsize=8, frameon=False)
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png", dpi=120)
    finally:
        plt.close(fig)


def plot_probe(warmup: dict, out: Path, title: str) -> None:
    """``algorithm.warmup=auto``: each snapshot's predicted final validation loss (eq. 36)
    against its round, the chosen T0, the round warm-up stopped at and, when the run reached
    T, the never-freeze loss (linear axes; matplotlib lazily)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    snaps, preds = warmup["snapshots"], warmup["predictions"]
    fig, ax = plt.subplots(figsize=(6, 4), layout="constrained")
    ax.plot(snaps, preds, marker="o", ms=3, label="prediction P_t (eq. 36)")
    t0 = warmup["warmup_rounds"]
    ax.axvline(t0, color="0.15", ls="--", lw=1.2, label=f"chosen T0 = {t0}")
    if warmup["stopped_at"] != t0:
        ax.axvline(warmup["stopped_at"], color="0.55", ls=":", lw=1.2,
                   label=f"warm-up stopped at {warmup['stopped_at']}")
    if warmup.get("continuing_loss") is not None:
        ax.axhline(warmup["continuing_loss"], color="tab:red", ls="-.", lw=1.0,
                   label="never freeze (validation loss at T)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("snapshot round t (freeze after t)", fontsize=10)
    ax.set_ylabel("predicted validation loss at T", fontsize=10)
    ax.tick_params(labelsize=9)
    ax.grid(True, color="0.88", lw=0.6)
    ax.set_axisbelow(True)
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(title, fontsize=9)
    try:
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png", dpi=120)
    finally:
        plt.close(fig)


def write_json(path: Path, data: dict) -> None:
    """``data`` as JSON, atomically (mode 0644; integer counts stay integers)."""
    atomic_write_json(path, data)
