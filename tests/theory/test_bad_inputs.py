"""Bad inputs raise ParameterError naming the parameter and its allowed range; the CLI exits 2.

Each case asserts that the message contains the parameter's name and the text of its allowed
range (or expected shape). The CLI cases run ``python -m linattn warmup ...`` in a subprocess
and assert exit status 2, ``error: ...`` with the same text on stderr, and that no --csv/--json
file was written.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from linattn_theory.errors import ParameterError
from linattn_theory.frozen import frozen_stage
from linattn_theory.problem import Problem, make_problem
from linattn_theory.warmup import WarmupConstants

GOOD = dict(delta0=1.0, pl_constant=0.5, smoothness=1.0, heterogeneity=0.5, grad_bound=1.0,
            lr=0.05, local_steps=10, total_rounds=200)


def _raises(fn, *snippets):
    with pytest.raises(ParameterError) as info:
        fn()
    message = str(info.value)
    for snippet in snippets:
        assert snippet in message, (snippet, message)
    return message


@pytest.mark.parametrize("knob", ["kernel_heterogeneity", "value_heterogeneity",
                                  "covariate_shift"])
@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf")])
def test_negative_heterogeneity_knobs(knob, value):
    _raises(lambda: make_problem(dim=2, num_clients=2, **{knob: value}), f"{knob}=", ">= 0")


def test_negative_heterogeneity_constant():
    _raises(lambda: WarmupConstants(**{**GOOD, "heterogeneity": -0.5}), "heterogeneity=-0.5",
            ">= 0")


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_context_length_below_one(n):
    _raises(lambda: make_problem(dim=2, num_clients=2, context_length=n),
            f"context_length={n!r}", "an integer n >= 1")
    base = make_problem(dim=2, num_clients=2, context_length=3)
    fields = {k: getattr(base, k) for k in ("dim", "out_dim", "weights", "covariances",
                                            "kernel_teachers", "value_teachers")}
    _raises(lambda: Problem(context_length=n, **fields), "context_length", ">= 1")


def test_lr_above_stability_limit():
    # smoothness L = 1: the allowed range is (0, 2 / L) = (0, 2)
    _raises(lambda: WarmupConstants(**{**GOOD, "lr": 2.5}), "lr=2.5", "(0, 2)")
    _raises(lambda: WarmupConstants(**{**GOOD, "lr": 0.0}), "lr=0.0", "(0, 2)")
    _raises(lambda: WarmupConstants(**{**GOOD, "lr": 0.5, "stability_limit": 0.4}), "lr=0.5",
            "(0, 0.4)")
    problem = make_problem(dim=2, num_clients=2, seed=0)
    _raises(lambda: frozen_stage(problem, np.eye(2), 100.0, 2), "lr=100",
            "lr must be in (0, ")


def _base_fields(clients=3, dim=3, out_dim=2):
    p = make_problem(dim=dim, num_clients=clients, out_dim=out_dim, covariate_shift=0.3, seed=0)
    return {k: getattr(p, k) for k in ("dim", "out_dim", "context_length", "weights",
                                       "covariances", "kernel_teachers", "value_teachers")}


@pytest.mark.parametrize(("name", "bad", "expected"), [
    ("value_teachers", np.zeros((3, 3, 1)), "expected (3, 3, 2)"),
    ("value_teachers", np.zeros((2, 3, 2)), "expected (3, 3, 2)"),
    ("kernel_teachers", np.zeros((3, 2, 3)), "expected (3, 3, 3)"),
    ("covariances", np.stack([np.eye(3)] * 4), "expected (3, 3, 3)"),
])
def test_mismatched_shapes(name, bad, expected):
    fields = _base_fields()
    fields[name] = bad
    _raises(lambda: Problem(**fields), name, expected, "clients=3, dim=3, out_dim=2")


@pytest.mark.parametrize(("weights", "snippet"), [
    (np.array([0.5, 0.3, 0.3]), "positive and summing to 1"),
    (np.array([0.5, 0.6, -0.1]), "positive and summing to 1"),
    (np.array([0.5, 0.5]), "expected (2,"),  # 2 weights for 3 clients' arrays
    (np.ones((3, 1)) / 3, "a 1-d array with one entry per client"),
])
def test_bad_weights(weights, snippet):
    fields = _base_fields()
    fields["weights"] = weights
    _raises(lambda: Problem(**fields), snippet)


def test_bad_covariances_and_scalars():
    fields = _base_fields()
    cov = fields["covariances"].copy()
    cov[0, 0, 1] += 0.5
    _raises(lambda: Problem(**{**fields, "covariances": cov}), "covariances",
            "symmetric positive definite")
    neg = np.stack([-np.eye(3)] * 3)
    _raises(lambda: Problem(**{**fields, "covariances": neg}), "covariances",
            "symmetric positive definite")
    for name in ("ridge", "kernel_ridge", "noise"):
        _raises(lambda name=name: Problem(**{**fields, name: -1.0}), f"{name}=-1.0",
                ">= 0 and finite")
    _raises(lambda: make_problem(num_clients=3, weights=np.ones(2)), "weights", "shape (3,)")
    _raises(lambda: make_problem(weights="skewed"), "weights=", "'uniform', 'random'")
    _raises(lambda: Problem.from_dict({"dim": 2}), "lacks", "make_problem")


@pytest.mark.parametrize(("name", "value", "snippet"), [
    ("local_steps", 0, "an integer K >= 1"),
    ("local_steps", 2.0, "an integer K >= 1"),
    ("total_rounds", 0, "an integer T >= 1"),
    ("delta0", 0.0, "> 0"),
    ("pl_constant", -1.0, ">= 0"),
    ("smoothness", 0.0, "> 0"),
    ("grad_bound", -1.0, ">= 0"),
    ("frozen_contraction", 1.0, "in [0, 1)"),
    ("frozen_floor", -1.0, ">= 0"),
    ("kernel_distance", -1.0, ">= 0"),
    ("measured_drift_error", -1.0, ">= 0"),
])
def test_warmup_constants_ranges(name, value, snippet):
    _raises(lambda: WarmupConstants(**{**GOOD, name: value}), f"{name}=", snippet)


# --- the command line ----------------------------------------------------------------------


def _cli(args, tmp_path):
    out_csv, out_json = tmp_path / "curve.csv", tmp_path / "t0.json"
    proc = subprocess.run(
        [sys.executable, "-m", "linattn", "warmup", *args, "--csv", str(out_csv),
         "--json", str(out_json)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    return proc, out_csv, out_json


@pytest.mark.parametrize(("args", "snippets"), [
    (["--heterogeneity", "-0.5", "--local-steps", "10", "--lr", "0.05"],
     ["heterogeneity=-0.5", ">= 0"]),
    (["--heterogeneity", "0.5", "--local-steps", "10", "--lr", "3"],
     ["lr=3.0", "(0, 2)"]),
    (["--heterogeneity", "0.5", "--local-steps", "0", "--lr", "0.05"],
     ["local_steps=0", "K >= 1"]),
    (["--heterogeneity", "0.5", "--local-steps", "10"], ["missing --lr"]),
    (["--problem", "PROBLEM", "--lr", "0.05", "--local-steps", "3"],
     ["context_length=0", "n >= 1"]),
])
def test_cli_exits_2_and_writes_nothing(tmp_path, args, snippets):
    problem_file = tmp_path / "problem.json"
    problem_file.write_text(json.dumps({"make_problem": {"dim": 2, "context_length": 0}}))
    args = [str(problem_file) if a == "PROBLEM" else a for a in args]
    proc, out_csv, out_json = _cli(args, tmp_path)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert proc.stderr.startswith("error: "), proc.stderr
    for snippet in snippets:
        assert snippet in proc.stderr, (snippet, proc.stderr)
    assert "Traceback" not in proc.stderr
    assert not out_csv.exists() and not out_json.exists()
    assert list(tmp_path.iterdir()) == [problem_file]  # no temporary files left either


def test_cli_success_writes_curve(tmp_path):
    proc, out_csv, out_json = _cli(["--heterogeneity", "0.5", "--local-steps", "10", "--lr",
                                    "0.05", "--total-rounds", "120"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "T0* =" in proc.stdout
    rows = out_csv.read_text().strip().splitlines()
    assert rows[0].split(",")[0] == "warmup_rounds" and len(rows) == 1 + 121
    payload = json.loads(out_json.read_text())
    assert 0 <= payload["warmup_rounds"] <= 120
