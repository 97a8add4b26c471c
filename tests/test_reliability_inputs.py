"""Bad input named by its key before anything is written: one test per reported case.

The property-based tests in ``test_reliability_fuzz.py`` cover the schemas at large; these pin
the individual cases (a plan escaping its folder, ``arms: 5``, ``--total-rounds 0``, ``--csv``
on a folder, ragged or NaN problem arrays, NaN Dirichlet alpha, CUDA without a GPU) and the
valid input that must pass (``lr: 5e-3``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from linattn.cli import main as linattn_main
from linattn.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
RUN_BASE = ["model.dim=8", "model.mlp_dim=16", "model.depth=1", "model.heads=2",
            "train.rounds=1", "partition.num_clients=3", "algorithm.name=fedavg",
            "run.progress=false", "run.plot=false"]


def _error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _plan(tmp_path: Path, **sweep) -> Path:
    base = {"name": "digits", "config": "digits_vit", "overrides": RUN_BASE,
            "arms": [{"name": "fedavg"}]}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump({"name": "p", "sweeps": [{**base, **sweep}]}))
    return path


@pytest.mark.parametrize("name", ["../escaped", "/abs/escaped", "a/../../escaped", ".."])
def test_plan_names_cannot_escape_out_dir(tmp_path, capsys, name):
    out = tmp_path / "study" / "out"
    plan = _plan(tmp_path, name=name)
    assert linattn_main(["study", "--plan", str(plan), "--out", str(out)]) == 2
    line = _error(capsys)
    assert "sweeps[0].name" in line and str(plan) in line
    assert not (tmp_path / "study").exists() and not (tmp_path / "escaped").exists()


def test_inside_refuses_paths_outside_the_root(tmp_path):
    from real_data.study.plan import inside

    assert inside(tmp_path, "a/b=1/seed=0") == tmp_path / "a/b=1/seed=0"
    for bad in ("../x", "/etc/x", "a/../../x"):
        with pytest.raises(ConfigError, match="outside the plan's out_dir"):
            inside(tmp_path, bad)


@pytest.mark.parametrize("sweep, key", [({"arms": 5}, "sweeps[0].arms"),
                                        ({"seeds": 5}, "sweeps[0].seeds"),
                                        ({"alphas": [float("nan")]}, "sweeps[0].alphas")])
def test_plan_values_of_the_wrong_shape(tmp_path, capsys, sweep, key):
    out = tmp_path / "out"
    assert linattn_main(["study", "--plan", str(_plan(tmp_path, **sweep)), "--out",
                         str(out)]) == 2
    assert key in _error(capsys) and not out.exists()


def _problem(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "problem.yaml"
    path.write_text(text)
    return path


GOOD = ("dim: 1\nout_dim: 1\ncontext_length: 2\nweights: [1]\ncovariances: [[[1]]]\n"
        "kernel_teachers: [[[0.5]]]\nvalue_teachers: [[[1]]]\n")


@pytest.mark.parametrize("text, key", [
    (GOOD.replace("dim: 1\n", "dim: six\n", 1), "dim='six'"),
    (GOOD.replace("covariances: [[[1]]]", "covariances: [[[1]], [[1, 2]]]"), "covariances"),
    (GOOD.replace("[[[0.5]]]", "[[[.nan]]]"), "kernel_teachers[0, 0, 0] is nan"),
    (GOOD.replace("weights: [1]", "weights: [.inf]"), "weights"),
])
def test_problem_file_errors_name_the_key(tmp_path, capsys, text, key):
    out = tmp_path / "t0.json"
    code = linattn_main(["warmup", "--problem", str(_problem(tmp_path, text)), "--lr", "0.1",
                         "--local-steps", "2", "--json", str(out)])
    line = _error(capsys)
    assert code == 2 and key in line and "lr=" not in line and not out.exists()


def test_warmup_total_rounds_zero_is_refused(tmp_path, capsys):
    problem = _problem(tmp_path, "make_problem: {dim: 2, num_clients: 2}\n"
                                 "schedule: {lr: 0.05, local_steps: 2}\n")
    assert linattn_main(["warmup", "--problem", str(problem), "--total-rounds", "0"]) == 2
    assert "--total-rounds=0" in _error(capsys)
    assert linattn_main(["warmup", "--heterogeneity", "0.5", "--local-steps", "2", "--lr", "0.1",
                         "--total-rounds", "0"]) == 2
    assert "--total-rounds=0" in _error(capsys)


def test_csv_pointing_at_a_folder_is_refused(tmp_path, capsys):
    assert linattn_main(["warmup", "--heterogeneity", "0.5", "--local-steps", "2", "--lr", "0.1",
                         "--csv", str(tmp_path)]) == 2
    assert f"--csv {tmp_path} is a folder" in _error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_nan_alpha_names_partition_alpha(tmp_path, capsys):
    out = tmp_path / "runs"
    assert linattn_main(["run", "--config", "digits_vit", *RUN_BASE, f"run.out_dir={out}",
                         "partition.alpha=.nan"]) == 2
    assert "partition.alpha=nan must be a finite number" in _error(capsys)
    assert not out.exists()


def test_cuda_without_a_gpu_writes_nothing(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "runs"
    assert linattn_main(["run", "--config", "digits_vit", *RUN_BASE, f"run.out_dir={out}",
                         "train.device=cuda"]) == 2
    assert "train.device='cuda'" in _error(capsys) and not out.exists()


@pytest.mark.parametrize("text", ["train.lr=1e-3", "train.lr=5E-3", "train.lr=.5e-2"])
def test_exponent_floats_are_floats(text, tmp_path):
    from real_data.config import load_config

    assert load_config("digits_vit", [text]).train.lr == float(text.split("=")[1])
    path = tmp_path / "c.yaml"
    path.write_text((ROOT / "real_data" / "configs" / "digits_vit.yaml").read_text()
                    .replace("lr: 0.01", "lr: 5e-3"))
    assert load_config(str(path)).train.lr == 0.005
