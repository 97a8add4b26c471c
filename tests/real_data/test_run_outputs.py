"""What a run leaves behind: the stage column, the plot, the final line, TensorBoard, defaults
under the current directory, file modes, integer counts in summary.json."""

from __future__ import annotations

import csv
import json
import os
import stat
from pathlib import Path

import pytest
from conftest import TINY, tiny_config

from linattn.cli import main as linattn_main
from real_data import rundir
from real_data.runs import resume_run, start_run

SMALL = ["train.rounds=4", "partition.num_clients=3"]
AVG = [*SMALL, "algorithm.name=fedavg"]
FROZEN = [*SMALL, "algorithm.name=fedfrozen", "algorithm.warmup=fixed",
          "algorithm.warmup_rounds=2"]


def _rows(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def test_every_row_carries_the_stage_of_its_round(tmp_path):
    frozen = start_run(tiny_config(*FROZEN), out=tmp_path / "frozen").run_dir
    lines = (frozen / "metrics.csv").read_text().splitlines()
    assert lines[0] == "round,client,metric,value,stage"
    assert all(len(ln.split(",")) == 5 for ln in lines)
    stages = {(int(r["round"]), r["stage"]) for r in _rows(frozen)}
    assert stages == {(1, "warmup"), (2, "warmup"), (3, "frozen"), (4, "frozen")}
    fedavg = start_run(tiny_config(*AVG), out=tmp_path / "avg")
    assert {r["stage"] for r in _rows(fedavg.run_dir)} == {"full"}
    # the readers of metrics.csv see the same global series as before
    series = rundir.read_global_metrics(frozen / "metrics.csv")
    assert [r for r, _ in series["test_acc"]] == [1, 2, 3, 4]
    from figures.fig7_real_data import find_runs

    runs, _ = find_runs(tmp_path)
    assert len(runs) == 2 and all(len(run.series["test_acc"]) == 4 for run in runs)


def test_a_run_without_the_stage_column_resumes_in_its_own_format(tmp_path):
    old = tmp_path / "old"
    start_run(tiny_config(*FROZEN), out=old, snapshot_rounds=(2,))
    # as if written without the column and killed after round 2's checkpoint
    four = "".join(",".join(ln.split(",")[:4]) + "\n"
                   for ln in (old / "metrics.csv").read_text().splitlines())
    (old / "metrics.csv").write_text(four)
    (old / "checkpoints" / "round_2.pt").replace(old / "checkpoints" / "last.pt")
    resume_run(old)  # drops rounds 3 and 4, then writes them again
    assert (old / "metrics.csv").read_text() == four


def test_curves_have_labels_stages_and_t0(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    run_dir = start_run(tiny_config(*FROZEN), out=tmp_path / "r").run_dir
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rundir.plot_curves(run_dir / "metrics.csv", tmp_path / "curves.png", "title")
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")
    (fig,) = figures
    axes = fig.axes
    assert [ax.get_ylabel() for ax in axes] == ["accuracy", "loss (cross-entropy)",
                                                "learning rate"]
    for ax in axes:
        texts = {t.get_text().strip() for t in ax.texts}
        assert {"T0 = 2", "warmup", "frozen"} <= texts
        assert ax.get_xlabel() == "round" and ax.get_xlim() == (0.0, 4.0)
        assert sum(1 for p in ax.patches if p.get_width() > 0) == 2  # the two stages
        assert all(t == int(t) for t in ax.get_xticks())
    plt.close(fig)
    # the round's lr from metrics.csv, as the schedule sets it (a cut to 0.1x after round 2)
    sched = tiny_config(*FROZEN, "train.lr_schedule={kind: step, milestones: [2], factor: 0.1}")
    run_dir = start_run(sched, out=tmp_path / "s").run_dir
    figures.clear()
    rundir.plot_curves(run_dir / "metrics.csv", tmp_path / "s.png", "title")
    (line,) = [ln for ln in figures[0].axes[2].lines
               if ln.get_label() == "clients' lr of the round"]  # not T0's marker
    lr = sched.train.lr
    assert list(line.get_xdata()) == [1, 2, 3, 4]
    assert list(line.get_ydata()) == pytest.approx([lr, lr, 0.1 * lr, 0.1 * lr], rel=1e-12)


def test_stage_spans_and_t0():
    stages = {1: "warmup", 2: "warmup", 3: "frozen", 4: "frozen"}
    spans = rundir.stage_spans(stages)
    assert spans == [("warmup", 1, 2), ("frozen", 3, 4)]
    assert rundir.warmup_end(spans) == 2
    assert rundir.warmup_end(rundir.stage_spans({1: "warmup", 2: "warmup"})) is None
    assert rundir.warmup_end(rundir.stage_spans({1: "full", 2: "full"})) is None
    assert rundir.stage_spans({1: "full", 2: "group0", 3: "group1", 4: "group0"}) == [
        ("full", 1, 1), ("group0", 2, 2), ("group1", 3, 3), ("group0", 4, 4)]


def test_final_line_shows_last_and_best_accuracy_and_the_bar_stays(tmp_path, capsys):
    out = tmp_path / "r"
    over = [o for o in TINY if not o.startswith("run.progress")]
    code = linattn_main(["run", "--config", "digits_vit", *over, *FROZEN,
                         "run.progress=true", "--out", str(out)])
    assert code == 0
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    best, last = summary["best"]["test_acc"], summary["final"]["test_acc"]
    assert captured.out.strip() == (f"{out}: 4 rounds, test_acc last {last:.4f}, best "
                                    f"{best['value']:.4f} (round {best['round']})")
    # the bar's last state is left on screen (a cleared bar ends in a carriage return)
    assert captured.err.endswith("\n")
    final_bar = captured.err.rstrip("\n").split("\r")[-1]
    assert "4/4" in final_bar and "best" in final_bar and "stage=frozen" in final_bar


def test_summary_counts_are_integers(tmp_path):
    res = start_run(tiny_config(*FROZEN), out=tmp_path / "r")
    text = (res.run_dir / "summary.json").read_text()
    summary = json.loads(text)
    for key in ("rounds_completed", "rounds_planned"):
        assert type(summary[key]) is int, key
    for key in ("bytes_up", "bytes_down", "train_flops", "trainable_params"):
        assert type(summary["final"][key]) is int, key
    assert type(summary["best"]["test_acc"]["round"]) is int
    assert isinstance(summary["final"]["test_acc"], float)
    # a count logged as a float in metrics.csv (fedpart_group=3.0) is an int
    path = tmp_path / "metrics.csv"
    path.write_text(rundir.HEADER + "1,global,fedpart_group,3.0,group3\n"
                    "1,global,test_acc,0.5,group3\n")
    final = rundir.summarize(path)["final"]
    assert final == {"fedpart_group": 3, "test_acc": 0.5}
    assert type(final["fedpart_group"]) is int


def test_tensorboard_logging_writes_an_event_file(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    res = start_run(tiny_config(*AVG, "run.tensorboard=true"), out=tmp_path / "r")
    events = list((res.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0
    acc = EventAccumulator(str(events[0].parent))
    acc.Reload()
    assert [e.step for e in acc.Scalars("test_acc")] == [1, 2, 3, 4]


def test_default_run_directory_is_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = start_run(tiny_config(*AVG))
    assert res.run_dir.resolve().parent == tmp_path / "runs"
    assert (tmp_path / "runs" / res.run_dir.name / "summary.json").is_file()


def test_every_file_of_a_run_directory_is_readable_by_others(tmp_path):
    old = os.umask(0o022)
    try:
        extra = ["run.tensorboard=true"] if _has_tensorboard() else []
        cfg = tiny_config(*FROZEN, "run.plot=true", *extra)
        res = start_run(cfg, out=tmp_path / "r", snapshot_rounds=(0, 2))
        resume_run(res.run_dir)  # rewrites metrics.csv and timings.csv
    finally:
        os.umask(old)
    files = [p for p in res.run_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"config.yaml", "partition.npz", "partition.json", "metrics.csv", "timings.csv",
            "summary.json", "curves.png", "last.pt", "round_0.pt", "round_2.pt",
            "snapshot_rounds.json"} <= names
    modes = {str(p.relative_to(res.run_dir)): oct(stat.S_IMODE(p.stat().st_mode))
             for p in files}
    assert set(modes.values()) == {oct(0o644)}, modes


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True
