"""Run directories: bad configs write nothing, SIGKILL + resume, NaN handling, T0 branching."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from conftest import TINY, run_cli, tiny_config
from pause_run import kill_when_paused
from pause_run import start as start_paused

from linattn.cli import main as linattn_main
from real_data import engines
from real_data.runs import start_run
from real_data.sweep import run_sweep


def round_maps(metrics_csv: Path) -> set[int]:
    return {int(ln.split(",")[0]) for ln in metrics_csv.read_text().splitlines()[1:]}


SMALL = [*TINY, "train.rounds=5", "partition.num_clients=4", "algorithm.warmup_rounds=2"]


@pytest.mark.parametrize("override, text", [
    ("train.lrr=0.1", "train.lrr"),
    ("partition.alpha=0", "partition.alpha"),
    ("algorithm.warmup_rounds=50", "algorithm.warmup_rounds=50 exceeds train.rounds=5"),
    ("partition.num_clients=5000", "partition.num_clients=5000 exceeds"),
    ("train.rounds=ten", "train.rounds"),
])
def test_bad_config_exits_2_and_writes_nothing(tmp_path, capsys, override, text):
    out = tmp_path / "runs"
    code = linattn_main(["run", "--config", "digits_vit", *SMALL, f"run.out_dir={out}",
                         override])
    assert code == 2
    assert text in capsys.readouterr().err
    assert not out.exists()


def test_bad_config_exit_code_through_the_command(tmp_path):
    res = run_cli("run", "--config", "digits_vit", f"run.out_dir={tmp_path / 'r'}",
                  "partition.alpha=-1")
    assert res.returncode == 2, res.stderr
    assert "error: partition.alpha=-1.0 must be > 0" in res.stderr
    assert not (tmp_path / "r").exists()


def test_killed_run_resumes_to_identical_metrics(tmp_path):
    args = ["run", "--config", "digits_vit", *SMALL, "train.rounds=6"]
    killed, marker = tmp_path / "killed", tmp_path / "paused"
    proc = start_paused(4, marker, killed, *SMALL, "train.rounds=6")
    # killed with round 4's rows written, its checkpoint not yet
    kill_when_paused(proc, marker, "the run never reached round 4")
    assert proc.returncode == -signal.SIGKILL
    assert torch.load(killed / "checkpoints" / "last.pt", weights_only=False)["round"] == 3
    assert round_maps(killed / "metrics.csv") == {1, 2, 3, 4}  # round 4 is newer than last.pt
    assert linattn_main(["run", "--resume", str(killed)]) == 0
    whole = tmp_path / "whole"
    assert linattn_main([*args, "--out", str(whole)]) == 0
    assert (killed / "metrics.csv").read_bytes() == (whole / "metrics.csv").read_bytes()
    assert json.loads((killed / "summary.json").read_text())["rounds_completed"] == 6


def test_nan_stops_run_and_keeps_last_good_checkpoint(tmp_path, monkeypatch,
                                                      capsys):
    real = engines.ENGINES["vectorized"]
    calls = []

    def poisoned(job):  # round 3 returns a NaN loss for its second client
        res = real(job)
        calls.append(1)
        if len(calls) == 3:
            res.objective[1] = float("nan")
        return res

    monkeypatch.setitem(engines.ENGINES, "vectorized", poisoned)
    out = tmp_path / "nan"
    code = linattn_main(["run", "--config", "digits_vit", *SMALL, "--out", str(out)])
    assert code == 1
    err = capsys.readouterr().err
    assert "non-finite loss or parameters in round 3" in err and "round 2" in err
    ckpt = torch.load(out / "checkpoints" / "last.pt", weights_only=False)
    assert ckpt["round"] == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged" and summary["rounds_completed"] == 2
    assert round_maps(out / "metrics.csv") == {1, 2}


def test_t0_sweep_branches_equal_direct_runs(tmp_path):
    cfg = tiny_config("train.rounds=4", "partition.num_clients=3", "algorithm.warmup_rounds=1")
    results = run_sweep(cfg, tmp_path / "sweep", algorithms=["fedfrozen"],
                        warmup_rounds=[1, 3], stack=False)  # runs alone: bit for bit
    assert len(results) == 2 and all(r.status == "completed" for r in results)
    branch = next(r for r in results if "T01_" in r.run_dir.name)
    direct = start_run(tiny_config("train.rounds=4", "partition.num_clients=3",
                                   "algorithm.warmup_rounds=1"), out=tmp_path / "direct")
    assert (branch.run_dir / "metrics.csv").read_bytes() == \
        (direct.run_dir / "metrics.csv").read_bytes()
    assert (tmp_path / "sweep" / "sweep.csv").read_text().count("\n") == 3


def test_run_directory_contents(tmp_path):
    res = start_run(tiny_config("train.rounds=2", "partition.num_clients=3", "run.plot=true",
                                "algorithm.warmup_rounds=1"), out=tmp_path / "r")
    names = {p.name for p in res.run_dir.iterdir()}
    assert {"config.yaml", "partition.npz", "metrics.csv", "timings.csv", "summary.json",
            "curves.png", "checkpoints"} <= names
    summary = json.loads((res.run_dir / "summary.json").read_text())
    for key in ("final", "best", "wall_time_s", "code_version", "libraries", "device"):
        assert key in summary
    header = (res.run_dir / "metrics.csv").read_text().splitlines()[0]
    assert header == "round,client,metric,value,stage"
    assert (Path(res.run_dir) / "checkpoints" / "last.pt").exists()


def test_cli_routes_data_and_checks_study_plans(capsys, monkeypatch):
    from real_data import cli, data_cli

    seen = []
    monkeypatch.setattr(data_cli, "main", lambda argv: seen.append(argv) or 0)
    assert cli.main(["data", "list"]) == 0 and seen == [["data", "list"]]
    assert linattn_main(["study", "--plan", "no-such-plan"]) == 2
    assert "no-such-plan" in capsys.readouterr().err


def test_sweep_command_writes_an_index(tmp_path, capsys):
    code = linattn_main(["sweep", "--config", "digits_vit", "--out", str(tmp_path / "s"),
                         "--algorithms", "fedavg,fedprox", "--seeds", "0,1", *TINY,
                         "partition.num_clients=4", "train.rounds=2"])
    assert code == 0
    rows = (tmp_path / "s" / "sweep.csv").read_text().splitlines()
    assert len(rows) == 5 and rows[1].split(",")[1:3] == ["fedavg", "0"]


def test_a_sweep_whose_fedfrozen_needs_a_validation_split_exits_2_before_training(
        tmp_path, capsys):
    """FedFrozen without a T0 is ``warmup=auto``, which reads the validation split: a sweep
    without one stops while planning, before its FedAvg run trains or anything is written."""
    out = tmp_path / "s"
    code = linattn_main(["sweep", "--config", "digits_vit", "--out", str(out),
                         "--algorithms", "fedavg,fedfrozen", *TINY, "partition.num_clients=4",
                         "train.rounds=2", "algorithm.name=fedavg"])
    assert code == 2
    assert "partition.validation_fraction" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                         reason="needs a CUDA GPU"))])
def test_checkpoint_loads_generators_on_the_cpu_and_restores_them(tmp_path, device):
    """Resuming a CUDA run once failed: the RNG states were loaded onto the GPU with the rest,
    and torch.set_rng_state needs a CPU byte tensor. State (a module too) goes to the device."""
    from real_data.checkpoint import load_checkpoint, restore_rng_states, save_checkpoint
    from real_data.federation import FedState

    dev = torch.device(device)
    net = torch.nn.Linear(2, 2).to(dev)  # a module in the server state (FedTP's hypernetwork)
    state = FedState(3, {"w": torch.ones(2, device=dev)}, {0: {"c": torch.zeros(2, device=dev)}},
                     {"m": [torch.ones(1, device=dev)], "net": net}, 1.5)
    torch.manual_seed(7)
    save_checkpoint(tmp_path / "c.pt", state, {"elapsed": 1.0})
    expected = torch.rand(3)
    loaded, extra, rng = load_checkpoint(tmp_path / "c.pt", dev)
    assert rng["torch"].device.type == dev.type and extra == {"elapsed": 1.0}  # as loaded
    assert loaded.global_params["w"].device.type == dev.type
    assert loaded.client_state[0]["c"].device.type == dev.type
    assert loaded.server_state["m"][0].device.type == dev.type
    assert next(loaded.server_state["net"].parameters()).device.type == dev.type
    torch.rand(5)  # move the generator on; restoring must bring it back
    restore_rng_states(rng)
    assert torch.equal(torch.rand(3), expected)


def test_resumed_run_still_keeps_its_snapshots(tmp_path):
    """A T0 head run interrupted before its later snapshots must still write them on resume
    (the study branches the other T0 from them)."""
    from real_data.runs import resume_run

    cfg = tiny_config("train.rounds=4", "partition.num_clients=3", "algorithm.name=fedavg",
                      "run.checkpoint_every=1")
    run = tmp_path / "head"
    start_run(cfg, out=run, snapshot_rounds=(2, 4))
    whole = torch.load(run / "checkpoints" / "round_4.pt", weights_only=False)
    # as if killed after round 2: last.pt is round 2's state, no round-4 snapshot, no summary
    (run / "checkpoints" / "round_2.pt").replace(run / "checkpoints" / "last.pt")
    (run / "checkpoints" / "round_4.pt").unlink()
    (run / "summary.json").unlink()
    resume_run(run)
    again = torch.load(run / "checkpoints" / "round_4.pt", weights_only=False)
    assert again["round"] == 4
    for name, value in whole["global_params"].items():
        assert torch.equal(again["global_params"][name], value), name
