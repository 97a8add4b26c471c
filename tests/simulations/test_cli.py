"""``linattn simulate``: config errors exit 2 and write nothing; run and validate write outputs."""

import json
from pathlib import Path

import pytest
import yaml

from linattn.cli import main as linattn_main
from simulations.config import ConfigError, load_config

DEFAULT = Path(__file__).resolve().parents[2] / "simulations" / "configs" / "default.yaml"
TINY = ["problem.dim=3", "problem.num_clients=3", "problem.context_length=4",
        "training.total_rounds=4", "training.warmup_rounds=[0,2,4]", "training.batch_size=4",
        "data.samples_per_client=32", "data.test_samples=8", "simulation.seeds=2"]


def _write(tmp_path, data) -> Path:
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("data, overrides, key", [
    ({"problem": {"dimm": 3}}, [], "problem.dimm"),
    ({"problemm": {}}, [], "problemm"),
    ({"training": {"lr": "fast"}}, [], "training.lr"),
    ({"training": {"local_steps": 2.5}}, [], "training.local_steps"),
    ({"training": {"lr": -0.1}}, [], "training.lr"),
    ({"training": {"participation": 1.5}}, [], "training.participation"),
    ({"training": {"total_rounds": 10, "warmup_rounds": [0, 20]}}, [], "training.warmup_rounds"),
    ({"training": {"attention": "cosine"}}, [], "training.attention"),
    ({"sweep": {"training.lr": [0.1, "x"]}}, [], "training.lr"),
    ({}, ["training.nope=3"], "training.nope"),
    ({}, ["data.samples_per_client=0"], "data.samples_per_client"),
    ({}, ["problem.covariate_shift=true"], "problem.covariate_shift"),
])
def test_bad_config_exits_2_and_writes_nothing(tmp_path, capsys, data, overrides, key):
    cfg = _write(tmp_path, data)
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(cfg, overrides)
    code = linattn_main(["simulate", "run", "--config", str(cfg), "--out", str(out), *overrides])
    assert code == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_missing_file_and_bad_override_exit_2(tmp_path):
    assert linattn_main(["simulate", "run", "--config", str(tmp_path / "no.yaml")]) == 2
    assert linattn_main(["simulate", "run", "--config", str(DEFAULT), "training.lr"]) == 2
    assert linattn_main(["simulate", "frobnicate"]) == 2


def test_shipped_configs_load():
    configs, sweep = load_config(DEFAULT)
    assert len(configs) == 1 and sweep == {}
    configs, sweep = load_config(DEFAULT.parent / "sweep_heterogeneity.yaml")
    assert len(configs) == 9 and set(sweep) == {"problem.kernel_heterogeneity",
                                                "training.local_steps"}


def test_run_writes_run_directory(tmp_path):
    out = tmp_path / "run"
    code = linattn_main(["simulate", "run", "--config", str(DEFAULT), "--out", str(out), *TINY,
                         "sweep.training.lr=[0.05,0.1]"])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["settings"]) == 2
    assert {"code_version", "numpy", "torch", "device"} <= set(summary)
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert [c["training"]["lr"] for c in resolved["configs"]] == [0.05, 0.1]
    header = (out / "metrics.csv").read_text().splitlines()[0]
    assert header == "round,run,metric,value"


def test_validate_quick_writes_report(tmp_path):
    out = tmp_path / "val"
    assert linattn_main(["simulate", "validate", "--quick", "--out", str(out)]) == 0
    result = json.loads((out / "validation.json").read_text())
    assert set(result["checks"]) == {"P1", "P2", "P3", "P4", "P5", "P6"}
    for check in result["checks"].values():
        assert {"criterion", "measured", "pass"} <= set(check)
    assert (out / "validation.md").exists() and (out / "p1_bias_drift.png").exists()
