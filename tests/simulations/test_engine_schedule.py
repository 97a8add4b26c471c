"""The simulator with a per-round step size: vectorized engine against the plain loop, the
constant schedule against no schedule, and the ``training.lr_schedule`` config key."""

import json

import numpy as np
import pytest
import yaml

from linattn.cli import main as linattn_main
from linattn_theory.problem import make_problem
from linattn_theory.schedules import LRSchedule
from simulations.config import ConfigError, load_config
from simulations.engine import Setting, simulate
from simulations.loop import run_single
from simulations.metrics import population

SEEDS = [0, 3]
TINY = ["problem.dim=3", "problem.num_clients=3", "problem.context_length=4",
        "training.total_rounds=8", "training.warmup_rounds=[0,4,8]", "training.batch_size=4",
        "data.samples_per_client=32", "data.test_samples=8", "simulation.seeds=2"]


@pytest.fixture(scope="module")
def problem():
    return make_problem(dim=3, num_clients=3, context_length=4, kernel_heterogeneity=0.7,
                        value_heterogeneity=0.7, covariate_shift=0.5, seed=2)


def _setting(problem, **kw):
    args = dict(problem=problem, lr=0.1, local_steps=3, batch_size=4, total_rounds=8,
                warmup_rounds=(0, 3, 8), samples_per_client=16, test_samples=8)
    args.update(kw)
    return Setting(**args)


def test_scheduled_engine_equals_plain_loop(problem):
    """Three schedules in one group (and one setting without): every run (setting x seed x
    T0) of the engine equals the loop to 1e-12."""
    settings = [_setting(problem, lr_schedule=LRSchedule("step", milestones=(0.5,))),
                _setting(problem, lr_schedule={"kind": "cosine", "floor": 0.01}),
                _setting(problem, lr=0.05, lr_schedule="exponential"),
                _setting(problem, participation=0.67,
                         lr_schedule={"kind": "exponential", "factor": 0.8, "warmup_rounds": 2})]
    results = simulate(settings, SEEDS)
    for st, res in zip(settings, results):
        for s, seed in enumerate(SEEDS):
            for j, t0 in enumerate(st.warmup_rounds):
                ref = run_single(st, seed, t0)
                np.testing.assert_allclose(res.kernels[s, : t0 + 1], ref.kernels, atol=1e-12)
                np.testing.assert_allclose(res.values[s, : t0 + 1], ref.values, atol=1e-12)
                np.testing.assert_allclose(res.reference_kernels[s, : t0 + 1],
                                           ref.reference_kernels, atol=1e-12)
                np.testing.assert_allclose(res.frozen_values[s, j, t0:], ref.frozen_values,
                                           atol=1e-12)
    # the schedule changes the run: the 10x cut after round 4 moves V less in round 8
    plain = simulate(_setting(problem), SEEDS)
    np.testing.assert_array_equal(results[0].frozen_values[:, :, :5],
                                  plain.frozen_values[:, :, :5])
    assert np.abs(results[0].frozen_values[:, 0, -1] - plain.frozen_values[:, 0, -1]).max() > 1e-4


def test_constant_schedule_is_bit_identical(problem):
    base = simulate(_setting(problem), SEEDS)
    for schedule in (LRSchedule("constant"), "constant"):
        other = simulate(_setting(problem, lr_schedule=schedule), SEEDS)
        for name in ("kernels", "values", "reference_kernels", "test_loss", "frozen_values",
                     "frozen_test_loss"):
            np.testing.assert_array_equal(getattr(other, name), getattr(base, name))
        pop_other, pop_base = population(_setting(problem, lr_schedule=schedule)), population(
            _setting(problem))
        np.testing.assert_array_equal(pop_other.error_curves, pop_base.error_curves)


@pytest.mark.parametrize("schedule, key", [
    ("warp", "training.lr_schedule.kind"),
    ({"kind": "plateau"}, "training.lr_schedule.kind"),
    ({"kind": "step", "milestones": [20]}, "training.lr_schedule.milestones"),
    ({"kind": "step", "milestones": [0.75], "factor": 0}, "training.lr_schedule.factor"),
    ({"kind": "cosine", "floor": 1.0}, "training.lr_schedule.floor"),
    ({"kind": "step", "cut": 0.1}, "training.lr_schedule.cut"),
    (3, "training.lr_schedule"),
])
def test_bad_schedule_exits_2_naming_the_key(tmp_path, capsys, schedule, key):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"training": {"lr": 0.1, "lr_schedule": schedule}}))
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(cfg, TINY)
    assert linattn_main(["simulate", "run", "--config", str(cfg), "--out", str(out),
                         *TINY]) == 2
    assert key in capsys.readouterr().err
    assert not out.exists()


def test_run_with_schedule_writes_it(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml.safe_dump({"training": {
        "lr_schedule": {"kind": "step", "milestones": [0.75], "factor": 0.1}}}))
    out = tmp_path / "run"
    assert linattn_main(["simulate", "run", "--config", str(cfg), "--out", str(out),
                         *TINY]) == 0
    summary = json.loads((out / "summary.json").read_text())
    schedule = summary["settings"][0]["config"]["training"]["lr_schedule"]
    assert schedule == {"kind": "step", "milestones": [0.75], "factor": 0.1}
